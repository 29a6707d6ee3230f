"""Tiled GPU contractions (codegen/gpu_tile.py): which kernels take the tiled path, the lowering's
logic checked by running the LinearKernel in a test-only interpreter (tests/linear_interp.py: work-items
in lock step, barriers and shared-memory races checked), every case rendered and compiled for CUDA
(NVRTC, llvm-nvptx) and AMDGPU (llvm + ld.lld), and cuda/rocm-marked runs on a real device.

The interpreter tests are lowering tests: they prove the kernel's logic (tiles, clamping, the k tail,
barrier placement, the epilogue guards) against numpy, not what a device computes.
"""
from __future__ import annotations

import dataclasses
import io
import struct

import numpy as np
import pytest

from morok_py import AxisType, Ops, UOp, dtypes, kernels as K
from morok_py.codegen import gpu_tile
from morok_py.codegen.symbolic import simplify
from morok_py.codegen.linear import If, L, Loop
from morok_py.codegen.lower import Capabilities, Variable, lower, scan_kernel
from morok_py.dtypes import from_numpy

import linear_interp as LI
from conftest import PAIRS, amdgpu_llvm_pair, open_target, random_array

DEFAULT = (128, 128, 8, 8, 8)
CAPS = Capabilities(has_local=True, has_shared=True, max_dims=3, local_max=(1024, 1024, 64), default_group=256,
                    grid_max=(2**31 - 1, 65535, 65535), warp_size=32, group_reduce=True, vector_width=4,
                    matmul_tile=DEFAULT)
SMALL = (32, 32, 4, 2, 2)       # 256 work-items too, but fewer elements per tile: quick to interpret
ODD = (48, 32, 8, 3, 2)         # a tile that is not a power of two: a guarded fill pass, scalar reads


def caps(tile=DEFAULT) -> Capabilities:
    return dataclasses.replace(CAPS, matmul_tile=tile)


def tile_contraction(ast, c, name="mm"):
    """What `lower` does before trying the tiled path: fold the AST."""
    return gpu_tile.tile_contraction(simplify(ast), c, name)


def var(name: str, lo: int = 1, hi: int = 1 << 20) -> UOp:
    return UOp.variable(name, lo, hi)


def end(x) -> UOp:
    return x if isinstance(x, UOp) else UOp.const(int(x))


def contraction(f, g=None, M=None, N=None, Kd=None, dtype=dtypes.float32, a_t=False, b_t=False, extra=(),
                batch=None, op=Ops.ADD):
    """out[i, j] = g(REDUCE_k f(a[i, k], b[k, j], i, j, k), i, j) with row-major (or transposed) a and b;
    `extra` params follow a and b, the output is the last param."""
    M, N, Kd = (x if x is not None else var(n) for x, n in ((M, "M"), (N, "N"), (Kd, "K")))
    a, b = UOp.param(0, dtype), UOp.param(1, dtype)
    ex = [UOp.param(2 + n, d) for n, d in enumerate(extra)]
    out = UOp.param(2 + len(extra), dtype)
    i, j = UOp.range(M, 1), UOp.range(N, 2)
    k = UOp.range(Kd, 3, AxisType.REDUCE)
    base_a = base_b = base_o = UOp.const(0)
    if batch is not None:
        bb = UOp.range(batch, 0)
        base_a, base_b, base_o = bb * (end(M) * end(Kd)), bb * (end(Kd) * end(N)), bb * (end(M) * end(N))
    av = a.load(base_a + (k * end(M) + i if a_t else i * end(Kd) + k))
    bv = b.load(base_b + (j * end(Kd) + k if b_t else k * end(N) + j))
    red = f(av, bv, i, j, k, *ex).reduce(k, op=op)
    val = g(red, i, j, *ex) if g is not None else red
    return UOp.sink(out.store(base_o + i * end(N) + j, val))


MUL = lambda a, b, i, j, k, *ex: a * b  # noqa: E731


def lowered(ast, tile=DEFAULT):
    kernel, info = lower(ast, caps(tile), "mm")
    assert any(i.kind is L.LOCAL for i in kernel.walk()), "expected the tiled lowering"
    return kernel, info


def interpret(ast, arrays, out_shape, vals, tile=DEFAULT, out_dtype=np.float32):
    """Run the tiled lowering of `ast` in the interpreter; the output and its per-element store counts."""
    kernel, info = lowered(ast, tile)
    out = np.zeros(int(np.prod(out_shape)), out_dtype)
    writes = LI.run(kernel, info, [np.ascontiguousarray(x).reshape(-1) for x in arrays] + [out], vals)
    return out.reshape(out_shape), writes[-1].reshape(out_shape)


def operands(rng, M, N, Kd, dtype=np.float32, a_t=False, b_t=False):
    a = random_array(rng, (M, Kd), dtype)
    b = random_array(rng, (Kd, N), dtype)
    return a, b, (a.T.copy() if a_t else a), (b.T.copy() if b_t else b)


SIZES = [(1, 1, 1), (7, 5, 3), (33, 65, 17), (128, 128, 8), (130, 257, 31)]


# ---- which kernels take the tiled path ------------------------------------------------------------

@pytest.mark.parametrize("name", ["matmul", "dense"])
def test_named_contractions_are_tiled(name):
    kernel, info = lower(K.named(name), caps(), name)
    assert kernel.local_size == (256, 1, 1) and info.group_per_item
    assert sum(1 for i in kernel.walk() if i.kind is L.LOCAL) == 2
    assert sum(1 for i in kernel.walk() if i.kind is L.ACC and i.dtype == dtypes.float32) == 64


@pytest.mark.parametrize("name", ["add", "sum", "sum_rows", "sum_cols", "softmax", "row_max", "bias_relu",
                                  "gather", "embedding", "broadcast_add"])
def test_other_kernels_are_left_to_the_general_path(name):
    assert tile_contraction(K.named(name), caps(), name) is None


def test_no_tiles_without_the_capability():
    assert tile_contraction(K.matmul(), dataclasses.replace(CAPS, matmul_tile=None), "mm") is None
    assert tile_contraction(K.matmul(), dataclasses.replace(CAPS, has_shared=False), "mm") is None


def test_a_load_of_f_over_both_output_ranges_is_not_tiled():
    ast = contraction(lambda a, b, i, j, k, c: a * b * c.load(i * 1000 + j), extra=(dtypes.float32,))
    assert tile_contraction(ast, caps(), "mm") is None


def test_f_reading_the_output_is_not_tiled():
    out = UOp.param(2, dtypes.float32)
    ast = contraction(lambda a, b, i, j, k: a * b + out.load(k))
    assert tile_contraction(ast, caps(), "mm") is None


def test_an_epilogue_reading_other_outputs_is_not_tiled():
    out = UOp.param(2, dtypes.float32)
    ast = contraction(MUL, lambda r, i, j: r + out.load(j * 1000 + i))
    assert tile_contraction(ast, caps(), "mm") is None
    ast = contraction(MUL, lambda r, i, j: r + out.load(i * end(var("N")) + j))    # C += A @ B: its own element
    assert tile_contraction(ast, caps(), "mm") is not None


def test_malformed_kernels_are_left_to_the_general_path_which_reports_them():
    a64 = UOp.param(0, dtypes.float64)
    bad_dtype = contraction(lambda a, b, i, j, k: a * b * a64.load(k).cast(dtypes.float32))
    bad_vars = contraction(MUL, M=var("M"), N=var("M", 1, 7))
    bad_end = contraction(MUL, N=UOp.param(2, dtypes.int32).load(0).cast(dtypes.index), extra=(dtypes.int32,))
    for ast in (bad_dtype, bad_vars, bad_end):
        assert tile_contraction(ast, caps(), "mm") is None
        with pytest.raises(ValueError):
            lower(ast, caps(), "mm")


def test_tiled_and_general_paths_share_one_kernel_scan():
    """`lower` scans the kernel once and hands the scan to the tiled path; without one it scans itself:
    the same params, variables and range ends either way, and those of the general path."""
    ast = simplify(contraction(MUL, M=var("M"), N=37, Kd=var("K")))
    scan = scan_kernel(ast)
    given, own = gpu_tile.tile_contraction(ast, caps(), "mm", scan), gpu_tile.tile_contraction(ast, caps(), "mm")
    assert given[0].dump() == own[0].dump()
    _, general = lower(ast, dataclasses.replace(CAPS, matmul_tile=None), "mm")
    for info in (given[1], own[1]):
        assert info.params == general.params == scan.params
        assert info.variables == general.variables == scan.variables == [Variable("K", 1, 1 << 20),
                                                                         Variable("M", 1, 1 << 20)]
        assert [r.key for r in info.range_ends] == [r.key for r in general.range_ends]


def test_small_constant_extents_use_the_general_path_or_a_smaller_tile():
    assert tile_contraction(K.matmul(7, 300, 64), caps(), "mm") is None
    kernel, _ = tile_contraction(K.matmul(130, 257, 31), caps(), "mm")
    assert kernel.local_size == (256, 1, 1)
    assert max(i.arg for i in kernel.walk() if i.kind is L.LOCAL) == 8 * (64 + 4)     # 64x64 blocks
    kernel, _ = tile_contraction(K.matmul(4096, 4096, 4096), caps(), "mm")
    assert max(i.arg for i in kernel.walk() if i.kind is L.LOCAL) == 2 * 8 * (128 + 4)   # double-buffered


def test_launch_grid_is_one_group_per_output_block():
    _, info = lower(K.matmul(), caps(), "mm")
    assert info.launch_dims({"M": 130, "N": 257, "K": 31}) == ((3, 2, 1), (256, 1, 1))
    assert info.launch_dims({"M": 128, "N": 128, "K": 1}) == ((1, 1, 1), (256, 1, 1))
    _, info = lower(contraction(MUL, M=var("M", 0), N=var("N", 0)), caps(), "mm")
    assert info.launch_dims({"M": 0, "N": 5, "K": 3})[0] == (0, 0, 0)


def test_bounds_checks_stay_those_of_the_general_path():
    ast = K.matmul()
    _, tiled = lower(ast, caps(), "mm")
    _, general = lower(ast, dataclasses.replace(CAPS, matmul_tile=None), "mm")
    key = lambda a: (a.slot, a.store, a.index.key, tuple(r.axis for r in a.enclosing))  # noqa: E731
    assert sorted(map(key, tiled.accesses)) == sorted(map(key, general.accesses))
    vals = {"M": 33, "N": 65, "K": 17}
    _, _, b_tiled, _ = tiled.prepare(vals)
    _, _, b_general, _ = general.prepare(vals)
    assert sorted(b_tiled) == sorted(b_general)


def _barriers(kernel) -> list[tuple[int, int]]:
    """(If depth, loop depth) of every BARRIER; asserts that no loop holds an integer division."""
    def walk(items, depth, loops, out):
        for it in items:
            if isinstance(it, Loop):
                walk(it.body, depth, loops + 1, out)
            elif isinstance(it, If):
                walk(it.body, depth + 1, loops, out)
            else:
                out.append((it, depth, loops))
        return out

    instrs = walk(kernel.body, 0, 0, [])
    assert not [i for i, _, loops in instrs if loops and i.kind is L.ALU and i.arg in (Ops.IDIV, Ops.MOD)]
    return sorted((d, loops) for i, d, loops in instrs if i.kind is L.BARRIER)


def test_inner_loop_has_no_integer_division_and_barriers_are_uniform():
    # symbolic sizes (under K > 0 and the uniform branch between the aligned and the scalar variant): the
    # aligned variant's first fill and its one barrier per tile; the scalar variant's two per tile (after the
    # fill and after the arithmetic); one in the tail (under K > 0 and the tail's condition)
    assert _barriers(lowered(K.matmul())[0]) == [(2, 0), (2, 1), (2, 1), (2, 1), (3, 0)]
    gpu_tile.ALIGNED_VARIANT = False
    try:
        assert _barriers(lowered(K.matmul())[0]) == [(1, 1), (1, 1), (2, 0)]
    finally:
        gpu_tile.ALIGNED_VARIANT = True


# ---- the lowering, run in the interpreter ---------------------------------------------------------

def check(got, want, writes, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    assert (writes == 1).all(), "every output is stored exactly once"


@pytest.mark.parametrize("M,N,Kd", SIZES)
def test_lowering_symbolic_matmul(rng, M, N, Kd):
    a, b, _, _ = operands(rng, M, N, Kd)
    got, w = interpret(K.matmul(), [a, b], (M, N), {"M": M, "N": N, "K": Kd})
    check(got, a @ b, w)


def test_lowering_one_program_serves_many_sizes(rng):
    kernel, info = lowered(K.matmul())
    for M, N, Kd in [(3, 200, 9), (129, 1, 16), (64, 130, 1), (1, 129, 40)]:
        a, b, _, _ = operands(rng, M, N, Kd)
        out = np.zeros(M * N, np.float32)
        w = LI.run(kernel, info, [a.reshape(-1), b.reshape(-1), out], {"M": M, "N": N, "K": Kd})
        check(out.reshape(M, N), a @ b, w[2].reshape(M, N))


@pytest.mark.parametrize("M,N,Kd", [(130, 257, 31), (64, 48, 9)])
def test_lowering_static_sizes(rng, M, N, Kd):
    a, b, _, _ = operands(rng, M, N, Kd)
    got, w = interpret(K.matmul(M, N, Kd), [a, b], (M, N), {})
    check(got, a @ b, w)


def _vector_loads(kernel) -> set[int]:
    """The buffer slots read by 4-wide global loads."""
    return {i.src[0].arg for i in kernel.walk() if i.kind is L.LOAD and i.arg and i.src[0].kind is L.PARAM}


@pytest.mark.parametrize("M,N,Kd", [(70, 96, 40), (132, 260, 44), (20, 24, 12)])
@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, True)])
def test_lowering_static_aligned_sizes_fill_full_tiles_with_vector_loads(rng, M, N, Kd, a_t, b_t):
    """Constant strides that are multiples of 4: full tiles are filled by 4-wide global loads (along k
    for A and for transposed B: one shared store per lane; along the row for B and transposed A: one vector
    store), rows and columns past the block's end clamped a whole vector at a time; the k tail stays
    scalar. Transposed A is contiguous along its rows: vector loads need M % 4 == 0 too."""
    a, b, ga, gb = operands(rng, M, N, Kd, a_t=a_t, b_t=b_t)
    ast = contraction(MUL, M=M, N=N, Kd=Kd, a_t=a_t, b_t=b_t)
    kernel, _ = lowered(ast)
    assert _vector_loads(kernel) == ({1} if a_t and M % 4 else {0, 1})
    got, w = interpret(ast, [ga, gb], (M, N), {})
    check(got, a @ b, w)


def test_unaligned_constant_strides_keep_scalar_fills():
    assert _vector_loads(lowered(K.matmul(64, 48, 9))[0]) == {1}    # A's rows are 9 apart; B's 48


def _branches(kernel):
    """The conditions of the Ifs directly under `K > 0` (the aligned / scalar variant branch)."""
    has_k = [it for it in kernel.body if isinstance(it, If)][0]
    return [it for it in has_k.body if isinstance(it, If)]


def test_symbolic_strides_get_an_aligned_variant():
    """Symbolic strides prove no alignment: the kernel holds a vector-filled, double-buffered k loop taken
    when K and N are multiples of 4 at launch (one uniform branch) beside the scalar, single-buffered one;
    the scalar passes are computed inside the blocks that use them."""
    kernel, _ = lowered(K.matmul())
    assert _vector_loads(kernel) == {0, 1}
    assert [i.arg for i in kernel.walk() if i.kind is L.LOCAL] == [2 * 16 * 132] * 2
    fast, slow, tail = _branches(kernel)
    assert _vector_loads(dataclasses.replace(kernel, body=fast.body)) == {0, 1}
    assert _vector_loads(dataclasses.replace(kernel, body=slow.body + tail.body)) == set()
    # a static, aligned kernel needs no variant branch (its Ifs: the first fill, the k tail); transposed B
    # (contiguous along k) needs only K % 4 == 0
    assert len(_branches(lowered(K.matmul(4096, 4096, 4096))[0])) == 2
    ast = contraction(MUL, b_t=True)
    assert _vector_loads(lowered(ast)[0]) == {0, 1}


@pytest.mark.parametrize("M,N,Kd", [(36, 68, 40), (33, 68, 40), (36, 66, 40), (36, 68, 42), (5, 4, 4), (64, 8, 20)])
@pytest.mark.parametrize("a_t,b_t", [(False, False), (False, True), (True, False)])
def test_lowering_symbolic_sizes_take_the_aligned_variant_when_they_can(rng, monkeypatch, M, N, Kd, a_t, b_t):
    """Sizes that are multiples of 4 take the aligned variant, others the scalar one: both match numpy
    (interpreted, barriers and races checked), tiles with partial blocks and a k tail included."""
    a, b, ga, gb = operands(rng, M, N, Kd, a_t=a_t, b_t=b_t)
    got, w = interpret(contraction(MUL, a_t=a_t, b_t=b_t), [ga, gb], (M, N), {"M": M, "N": N, "K": Kd}, tile=SMALL)
    check(got, a @ b, w)


def test_double_buffering_where_every_tile_has_vector_fills():
    """One barrier per full tile (after storing the prefetched next tile), one after the first fill and
    one in the tail; the buffer read alternates through an index accumulator, not a division."""
    kernel, _ = lowered(K.matmul(4096, 4096, 4100))
    # the default schedule doubles BK (8 -> 16) where both double-buffered tiles fit (gpu_tile.deeper_tile)
    assert kernel.schedule.matmul_tile == (128, 128, 16, 8, 8)
    assert [i.arg for i in kernel.walk() if i.kind is L.LOCAL] == [2 * 16 * 132] * 2
    assert _barriers(kernel) == [(1, 1), (2, 0), (2, 0)]
    assert [i.arg for i in lowered(K.matmul(64, 48, 9))[0].walk() if i.kind is L.LOCAL] == [16 * 68] * 2


@pytest.mark.parametrize("double_buffer", [0, 2])
@pytest.mark.parametrize("unroll", [False, True])
@pytest.mark.parametrize("M,N,Kd", [(7, 5, 3), (50, 70, 37), (33, 65, 16)])
def test_lowering_with_and_without_double_buffering(rng, monkeypatch, double_buffer, unroll, M, N, Kd):
    monkeypatch.setattr(gpu_tile, "DOUBLE_BUFFER", double_buffer)
    monkeypatch.setattr(gpu_tile, "UNROLL_FULL_TILES", unroll)
    a, b, _, _ = operands(rng, M, N, Kd)
    got, w = interpret(K.matmul(), [a, b], (M, N), {"M": M, "N": N, "K": Kd}, tile=SMALL)
    check(got, a @ b, w)
    M, N, Kd = M + 30, N + 39 - N % 4, Kd + 4 - Kd % 4      # static and aligned: vector fills
    a, b, _, _ = operands(rng, M, N, Kd)
    got, w = interpret(contraction(MUL, M=M, N=N, Kd=Kd), [a, b], (M, N), {}, tile=ODD)
    check(got, a @ b, w)


@pytest.mark.parametrize("tile", [SMALL, ODD, (64, 64, 8, 4, 4), (16, 64, 16, 1, 4)], ids=str)
@pytest.mark.parametrize("M,N,Kd", [(7, 5, 3), (50, 70, 37)])
def test_lowering_other_tiles(rng, tile, M, N, Kd):
    a, b, _, _ = operands(rng, M, N, Kd)
    got, w = interpret(K.matmul(), [a, b], (M, N), {"M": M, "N": N, "K": Kd}, tile=tile)
    check(got, a @ b, w)


@pytest.mark.parametrize("a_t,b_t", [(False, True), (True, False), (True, True)])
def test_lowering_transposed_operands(rng, a_t, b_t):
    M, N, Kd = 37, 45, 21
    a, b, ga, gb = operands(rng, M, N, Kd, a_t=a_t, b_t=b_t)
    got, w = interpret(contraction(MUL, a_t=a_t, b_t=b_t), [ga, gb], (M, N), {"M": M, "N": N, "K": Kd},
                       tile=SMALL)
    check(got, a @ b, w)


@pytest.mark.parametrize("double_buffer", [1, 2])
@pytest.mark.parametrize("M,N,Kd", [(7, 5, 3), (33, 65, 17)])
def test_lowering_padding_never_reaches_the_accumulators(rng, monkeypatch, M, N, Kd, double_buffer):
    """f(0, 0) = 1 here: any padded k, row or column that reached an output would show."""
    monkeypatch.setattr(gpu_tile, "DOUBLE_BUFFER", double_buffer)
    a, b, _, _ = operands(rng, M, N, Kd)
    ast = contraction(lambda a, b, i, j, k: (a - b) * (a - b) + 1.0)
    got, w = interpret(ast, [a, b], (M, N), {"M": M, "N": N, "K": Kd})
    want = ((a[:, :, None] - b[None, :, :]) ** 2 + 1).sum(axis=1)
    check(got, want, w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("M,N,Kd", [(7, 5, 3), (130, 70, 20)])
def test_lowering_bias_relu_epilogue(rng, M, N, Kd):
    x, w_, _, _ = operands(rng, M, N, Kd)
    bias = random_array(rng, N, np.float32)
    got, w = interpret(K.matmul_bias_relu(), [x, w_, bias], (M, N), {"M": M, "N": N, "K": Kd})
    check(got, np.maximum(x @ w_ + bias, 0), w)


def test_lowering_batched(rng):
    B, M, N, Kd = 3, 20, 33, 11
    a = random_array(rng, (B, M, Kd), np.float32)
    b = random_array(rng, (B, Kd, N), np.float32)
    ast = contraction(MUL, M=M, N=N, Kd=Kd, batch=var("B"))
    got, w = interpret(ast, [a, b], (B, M, N), {"B": B}, tile=SMALL)
    check(got, a @ b, w)


@pytest.mark.parametrize("double_buffer", [1, 2])
def test_lowering_units_of_every_kind(rng, monkeypatch, double_buffer):
    """f with loads over {i, k}, {k, j}, {k}, {i}, {j} and none, and ranges used as values; a BK-vector
    tile double-buffered too (mode 2)."""
    monkeypatch.setattr(gpu_tile, "DOUBLE_BUFFER", double_buffer)
    M, N, Kd = 19, 23, 13
    a, b, _, _ = operands(rng, M, N, Kd)
    wk, wi, wj, s = (random_array(rng, n, np.float32) for n in (Kd, M, N, 1))
    F = dtypes.float32

    def f(a_, b_, i, j, k, wk_, wi_, wj_, s_):
        return (a_ * k.cast(F) + b_) * wk_.load(k) + wi_.load(i) * wj_.load(j) + s_.load(0) * a_

    def g(r, i, j, wk_, wi_, wj_, s_):
        return r * wj_.load(j) + i.cast(F)

    ast = contraction(f, g, extra=(F, F, F, F))
    got, w = interpret(ast, [a, b, wk, wi, wj, s], (M, N), {"M": M, "N": N, "K": Kd}, tile=SMALL)
    kk = np.arange(Kd, dtype=np.float32)
    want = ((a[:, :, None] * kk[None, :, None] + b[None]) * wk[None, :, None] + wi[:, None, None] * wj[None, None, :]
            + s[0] * a[:, :, None]).sum(axis=1)
    want = want * wj[None, :] + np.arange(M, dtype=np.float32)[:, None]
    check(got, want, w, rtol=1e-4, atol=1e-4)


def test_lowering_max_reduction(rng):
    M, N, Kd = 21, 17, 11
    a, b, _, _ = operands(rng, M, N, Kd)
    ast = contraction(lambda a, b, *_: a + b, op=Ops.MAX)
    got, w = interpret(ast, [a, b], (M, N), {"M": M, "N": N, "K": Kd}, tile=SMALL)
    check(got, (a[:, :, None] + b[None]).max(axis=1), w)


def test_lowering_empty_reduction_stores_the_epilogue_of_zero(rng):
    M, N = 5, 6
    bias = random_array(rng, N, np.float32)
    ast = contraction(MUL, lambda r, i, j, bias_: r + bias_.load(j), Kd=var("K", 0), extra=(dtypes.float32,))
    got, w = interpret(ast, [np.zeros(0, np.float32), np.zeros(0, np.float32), bias], (M, N),
                       {"M": M, "N": N, "K": 0}, tile=SMALL)
    check(got, np.broadcast_to(bias, (M, N)), w)


def test_lowering_accumulate_into_the_output(rng):
    M, N, Kd = 9, 14, 5
    a, b, _, _ = operands(rng, M, N, Kd)
    c0 = random_array(rng, (M, N), np.float32)
    out = UOp.param(2, dtypes.float32)
    ast = contraction(MUL, lambda r, i, j: r + out.load(i * end(var("N")) + j))
    kernel, info = lowered(ast, SMALL)
    c = c0.reshape(-1).copy()
    w = LI.run(kernel, info, [a.reshape(-1), b.reshape(-1), c], {"M": M, "N": N, "K": Kd})
    check(c.reshape(M, N), c0 + a @ b, w[2].reshape(M, N))


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.float64], ids=lambda d: np.dtype(d).name)
def test_lowering_other_dtypes(rng, dtype):
    M, N, Kd = 21, 34, 19
    a, b, _, _ = operands(rng, M, N, Kd, dtype)
    got, w = interpret(K.matmul(dtype=from_numpy(dtype)), [a, b], (M, N), {"M": M, "N": N, "K": Kd},
                       tile=SMALL, out_dtype=dtype)
    if dtype == np.float16:   # rounded to half after every multiply and add
        check(got.astype(np.float32), a.astype(np.float32) @ b.astype(np.float32), w, rtol=2e-2, atol=5e-2)
    else:
        check(got, a @ b, w)


def test_lowering_with_the_kk_loop_unrolled_in_the_kernel(rng, monkeypatch):
    monkeypatch.setattr(gpu_tile, "UNROLL_FULL_TILES", True)
    M, N, Kd = 50, 70, 37
    a, b, _, _ = operands(rng, M, N, Kd)
    kernel, _ = lowered(K.matmul())
    bk = kernel.schedule.matmul_tile[2]      # 16: the default schedule doubles the caps' BK of 8
    # 4-wide shared reads: BK steps of the scalar variant, BK of the aligned one, the tail's rolled loop; and
    # the aligned variant's 4-wide global loads (first fill, prefetch: two per tile)
    assert sum(1 for i in kernel.walk() if i.kind is L.LOAD and i.arg == 4) == 2 * 4 * bk + 4 + 8
    got, w = interpret(K.matmul(), [a, b], (M, N), {"M": M, "N": N, "K": Kd}, tile=SMALL)
    check(got, a @ b, w)


# ---- the interpreter itself ------------------------------------------------------------------------

def test_interpreter_runs_the_general_paths_group_reductions(rng):
    """Known-good shared-memory code (softmax's work-group combines) passes the race checks."""
    kernel, info = lower(K.softmax(), CAPS, "softmax")
    x = random_array(rng, (3, 300), np.float32)
    out = np.zeros(x.size, np.float32)
    LI.run(kernel, info, [x.reshape(-1), out], {"rows": 3, "cols": 300})
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out.reshape(x.shape), e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)


def _drop_barriers(items, which):
    """The kernel with the `which`-th and later BARRIERs (in program order) removed."""
    count = [0]

    def go(items):
        out = []
        for it in items:
            if isinstance(it, Loop):
                it = dataclasses.replace(it, body=go(it.body))
            elif isinstance(it, If):
                it = dataclasses.replace(it, body=go(it.body))
            elif it.kind is L.BARRIER:
                count[0] += 1
                if count[0] - 1 == which:
                    continue
            out.append(it)
        return out
    return go(items)


@pytest.mark.parametrize("Kd,which", [(13, 2), (13, 3), (13, 4), (20, 0), (20, 1), (20, 4)])
def test_interpreter_catches_each_missing_barrier(rng, Kd, which):
    """Symbolic sizes; barriers in program order: the aligned variant's first fill and its loop (0, 1), the
    scalar variant's two (2, 3), the k tail (4). K = 13 takes the scalar variant, K = 20 the aligned one."""
    kernel, info = lowered(K.matmul(), SMALL)
    broken = dataclasses.replace(kernel, body=_drop_barriers(kernel.body, which))
    a, b, _, _ = operands(rng, 40, 40, Kd)
    with pytest.raises(LI.InterpError, match="race"):
        LI.run(broken, info, [a.reshape(-1), b.reshape(-1), np.zeros(1600, np.float32)], {"M": 40, "N": 40, "K": Kd})


@pytest.mark.parametrize("which", [0, 1, 2])
def test_interpreter_catches_each_missing_barrier_of_the_double_buffered_loop(rng, which):
    M, N, Kd = 50, 40, 44       # static, aligned: vector fills, two buffers, a k tail of 4
    kernel, info = lowered(contraction(MUL, M=M, N=N, Kd=Kd), ODD)
    assert _barriers(kernel) == [(1, 1), (2, 0), (2, 0)]
    a, b, _, _ = operands(rng, M, N, Kd)
    out = np.zeros(M * N, np.float32)
    LI.run(kernel, info, [a.reshape(-1), b.reshape(-1), out], {})
    np.testing.assert_allclose(out.reshape(M, N), a @ b, rtol=1e-5, atol=1e-5)
    broken = dataclasses.replace(kernel, body=_drop_barriers(kernel.body, which))
    with pytest.raises(LI.InterpError, match="race"):
        LI.run(broken, info, [a.reshape(-1), b.reshape(-1), out], {})


# ---- rendered and compiled for every GPU target (no device needed) ----------------------------------

def _cases():
    F = dtypes.float32
    return {
        "matmul": K.matmul(),
        "matmul_static": K.matmul(4096, 4096, 4096),
        "dense": K.matmul_bias_relu(),
        "padding": contraction(lambda a, b, *_: (a - b) * (a - b) + 1.0),
        "transposed": contraction(MUL, a_t=True, b_t=True),
        "batched": contraction(MUL, batch=var("B")),
        "units": contraction(lambda a, b, i, j, k, w: a * b * w.load(k) + k.cast(F), extra=(F,)),
        "max": contraction(lambda a, b, *_: a + b, op=Ops.MAX),
        "half": K.matmul(dtype=dtypes.float16),
        "int32": K.matmul(dtype=dtypes.int32),
        "float64": K.matmul(dtype=dtypes.float64),
    }


CASES = list(_cases())


def _cuda_pair(key: str, arch: str = "sm_90"):
    pytest.importorskip("cuda.bindings", reason="the cuda extra is not installed (pip install morok-py[cuda])")
    from morok_py.backends.cuda import compile_only_pairs
    r, c = next(rc for rc in compile_only_pairs(arch) if rc[1].cache_key == key)
    if c.available() is not None:
        pytest.skip(f"{key} is unavailable here: {c.available()}")
    return r, c


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """Registers per thread and stack frame (local memory: spills) of the one kernel in a CUBIN, read
    from the EIATTR_REGCOUNT / EIATTR_FRAME_SIZE attributes of its .nv.info section."""
    elftools = pytest.importorskip("elftools", reason="pyelftools reads CUBINs (pip install pyelftools)")
    from elftools.elf.elffile import ELFFile
    names = {0x2F: "regs", 0x11: "frame", 0x12: "stack"}
    out: dict[str, int] = {}
    for sec in ELFFile(io.BytesIO(cubin)).iter_sections():
        if not sec.name.startswith(".nv.info"):
            continue
        d, o = sec.data(), 0
        while o + 4 <= len(d):
            fmt, attr = d[o], d[o + 1]
            if fmt == 4:      # EIFMT_SVAL: u16 size, then (u32 symbol, u32 value) for these attributes
                size = struct.unpack_from("<H", d, o + 2)[0]
                if attr in names and size == 8:
                    out[names[attr]] = struct.unpack_from("<I", d, o + 8)[0]
                o += 4 + size
            else:
                o += 4
    assert "regs" in out, "no register count in the CUBIN"
    return out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("key", ["nvrtc", "llvm-nvptx"])
def test_cuda_compiles(key, case):
    r, c = _cuda_pair(key)
    spec = r.render(_cases()[case], case)
    assert "__shared__" in spec.src or "addrspace(3)" in spec.src
    res = cubin_resources(c.compile(spec).bytes)
    assert res.get("frame", 0) == 0 and res.get("stack", 0) == 0, f"local memory (spills): {res}"


@pytest.mark.parametrize("static", [False, True], ids=["symbolic", "static"])
@pytest.mark.parametrize("key", ["nvrtc", "llvm-nvptx"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_float32_matmul_fits_two_blocks_per_sm(key, arch, static):
    """<= 128 registers per thread (two 256-thread blocks per SM, which the occupancy hint asks for), no
    spills, vector shared reads; 4-wide global loads of the tiles too (symbolic sizes: in the aligned
    variant)."""
    r, c = _cuda_pair(key, arch)
    spec = r.render(K.matmul(4096, 4096, 4096) if static else K.matmul(), "matmul")
    res = cubin_resources(c.compile(spec).bytes)
    assert res["regs"] <= 128 and res.get("frame", 0) == 0, res
    if key == "llvm-nvptx":
        ptx = c.ptx(spec)
        assert ".local" not in ptx and "ld.shared.v4" in ptx and ".minnctapersm 2" in ptx
        assert "ld.global.nc.v4" in ptx


def test_occupancy_hint_only_for_plain_products():
    """acc += a * b of 4-byte (or smaller) values: two groups per SM; heavier f and 8-byte accumulators
    (which would spill under the 128-register cap) get no hint and a rolled kk loop."""
    assert lowered(K.matmul())[0].min_groups == 2
    assert lowered(K.matmul(dtype=dtypes.float16))[0].min_groups == 2
    assert lowered(K.matmul_bias_relu())[0].min_groups == 2
    for ast in (K.matmul(dtype=dtypes.float64), contraction(lambda a, b, *_: a + b, op=Ops.MAX),
                contraction(lambda a, b, *_: (a - b) * (a - b) + 1.0)):
        kernel, _ = lowered(ast)
        assert kernel.min_groups == 0
        assert any(isinstance(it, Loop) and it.end.kind is L.CONST for it in _loops(kernel.body))


def _loops(items):
    for it in items:
        if isinstance(it, (Loop, If)):
            if isinstance(it, Loop):
                yield it
            yield from _loops(it.body)


def test_occupancy_hint_rendering():
    """CUDA C: __launch_bounds__(threads, blocks); NVPTX: nvvm.minctasm; HIP C and AMDGPU print none (HIP's
    second argument means waves per EU)."""
    from morok_py.backends.cuda.renderer import CUDARenderer, NVPTXRenderer
    from morok_py.backends.rocm.renderer import AMDGPURenderer, HIPRenderer
    from morok_py.device import DeviceSpec
    cu, rocm = DeviceSpec.parse("CUDA"), DeviceSpec.parse("ROCM")
    src = CUDARenderer(cu, "sm_90").render(K.matmul(), "matmul").src
    assert 'extern "C" __global__ void __launch_bounds__(256, 2) k_matmul(' in src
    src = CUDARenderer(cu, "sm_90").render(K.matmul(dtype=dtypes.float64), "matmul").src
    assert 'extern "C" __global__ void __launch_bounds__(256) k_matmul(' in src
    assert '"nvvm.maxntid"="256" "nvvm.minctasm"="2"' in NVPTXRenderer(cu, "sm_90").render(K.matmul(), "mm").src
    assert "minctasm" not in NVPTXRenderer(cu, "sm_90").render(K.matmul(dtype=dtypes.float64), "mm").src
    assert "__launch_bounds__(256) k_matmul(" in HIPRenderer(rocm, "gfx942").render(K.matmul(), "matmul").src
    assert "nvvm" not in AMDGPURenderer(rocm, "gfx942").render(K.matmul(), "matmul").src


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("arch", ["gfx90a", "gfx942", "gfx1100"])
def test_amdgpu_compiles(arch, case):
    r, c = amdgpu_llvm_pair(arch)
    spec = r.render(_cases()[case], case)
    assert "addrspace(3)" in spec.src and "s.barrier" in spec.src
    out = c.compile(spec)
    assert out.bytes[:4] == b"\x7fELF"


@pytest.mark.parametrize("unroll", [False, True])
@pytest.mark.parametrize("arch", ["gfx90a", "gfx1100"])
def test_amdgpu_float32_matmul_has_no_spills(arch, unroll, monkeypatch):
    from morok_py.backends.rocm import compiler as C
    monkeypatch.setattr(gpu_tile, "UNROLL_FULL_TILES", unroll)
    r, c = amdgpu_llvm_pair(arch)
    (meta,) = C.code_object_metadata(c.compile(r.render(K.matmul(), "matmul")).bytes)["amdhsa.kernels"]
    assert meta[".private_segment_fixed_size"] == 0 and meta[".vgpr_spill_count"] == 0, meta
    assert meta[".vgpr_count"] <= 128 and meta[".group_segment_fixed_size"] <= 16 << 10, meta


@pytest.mark.parametrize("key", ["nvrtc", "llvm-nvptx"])
def test_cuda_compiles_with_the_kk_loop_unrolled(key, monkeypatch):
    monkeypatch.setattr(gpu_tile, "UNROLL_FULL_TILES", True)
    r, c = _cuda_pair(key)
    res = cubin_resources(c.compile(r.render(K.matmul(), "matmul")).bytes)
    assert res.get("frame", 0) == 0, res


@pytest.mark.parametrize("case", CASES)
def test_hip_c_renders(case):
    from morok_py.backends.rocm.renderer import HIPRenderer
    from morok_py.device import DeviceSpec
    src = HIPRenderer(DeviceSpec.parse("ROCM"), "gfx942").render(_cases()[case], case).src
    assert "__shared__" in src and "__syncthreads();" in src


# ---- on a device -----------------------------------------------------------------------------------

GPU_PAIRS = [p for p in PAIRS if p.id != "CPU-llvm"]


@pytest.fixture(params=GPU_PAIRS)
def gpu(request):
    return open_target(*request.param)


@pytest.mark.parametrize("M,N,Kd", SIZES + [(1000, 1030, 515)])
def test_device_matmul(gpu, rng, M, N, Kd):
    a, b, _, _ = operands(rng, M, N, Kd)
    out = gpu.empty(M * N, dtypes.float32)
    gpu.compile(K.matmul())(gpu.buf(a), gpu.buf(b), out, M=M, N=N, K=Kd)
    np.testing.assert_allclose(out.numpy().reshape(M, N), a @ b, rtol=1e-4, atol=1e-4 * np.sqrt(Kd))


def test_device_symbolic_program_many_sizes(gpu, rng):
    prog = gpu.compile(K.matmul())
    for M, N, Kd in [(3, 200, 9), (129, 1, 16), (64, 130, 1), (257, 129, 40), (256, 132, 44)]:   # the last: aligned variant
        a, b, _, _ = operands(rng, M, N, Kd)
        out = gpu.empty(M * N, dtypes.float32)
        prog(gpu.buf(a), gpu.buf(b), out, M=M, N=N, K=Kd)
        np.testing.assert_allclose(out.numpy().reshape(M, N), a @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("M,N,Kd", [(130, 257, 31), (512, 384, 100)])
def test_device_static_matmul(gpu, rng, M, N, Kd):
    a, b, _, _ = operands(rng, M, N, Kd)
    out = gpu.empty(M * N, dtypes.float32)
    gpu.compile(K.matmul(M, N, Kd))(gpu.buf(a), gpu.buf(b), out)
    np.testing.assert_allclose(out.numpy().reshape(M, N), a @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("M,N,Kd", [(7, 5, 3), (130, 257, 31)])
def test_device_bias_relu(gpu, rng, M, N, Kd):
    x, w, _, _ = operands(rng, M, N, Kd)
    bias = random_array(rng, N, np.float32)
    out = gpu.empty(M * N, dtypes.float32)
    gpu.compile(K.matmul_bias_relu())(gpu.buf(x), gpu.buf(w), gpu.buf(bias), out, M=M, N=N, K=Kd)
    np.testing.assert_allclose(out.numpy().reshape(M, N), np.maximum(x @ w + bias, 0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("M,N,Kd", [(7, 5, 3), (130, 257, 31)])
def test_device_padding_never_reaches_the_accumulators(gpu, rng, M, N, Kd):
    a, b, _, _ = operands(rng, M, N, Kd)
    out = gpu.empty(M * N, dtypes.float32)
    gpu.compile(contraction(lambda a, b, *_: (a - b) * (a - b) + 1.0))(gpu.buf(a), gpu.buf(b), out, M=M, N=N, K=Kd)
    want = ((a[:, :, None] - b[None, :, :]) ** 2 + 1).sum(axis=1)
    np.testing.assert_allclose(out.numpy().reshape(M, N), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("a_t,b_t", [(False, True), (True, False), (True, True)])
def test_device_transposed_operands(gpu, rng, a_t, b_t):
    M, N, Kd = 130, 257, 31
    a, b, ga, gb = operands(rng, M, N, Kd, a_t=a_t, b_t=b_t)
    out = gpu.empty(M * N, dtypes.float32)
    gpu.compile(contraction(MUL, a_t=a_t, b_t=b_t))(gpu.buf(ga), gpu.buf(gb), out, M=M, N=N, K=Kd)
    np.testing.assert_allclose(out.numpy().reshape(M, N), a @ b, rtol=1e-4, atol=1e-4)


def test_device_batched(gpu, rng):
    B, M, N, Kd = 3, 70, 133, 29
    a = random_array(rng, (B, M, Kd), np.float32)
    b = random_array(rng, (B, Kd, N), np.float32)
    out = gpu.empty(B * M * N, dtypes.float32)
    gpu.compile(contraction(MUL, batch=var("B")))(gpu.buf(a), gpu.buf(b), out, B=B, M=M, N=N, K=Kd)
    np.testing.assert_allclose(out.numpy().reshape(B, M, N), a @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.float64], ids=lambda d: np.dtype(d).name)
def test_device_other_dtypes(gpu, rng, dtype):
    M, N, Kd = 70, 133, 29
    a, b, _, _ = operands(rng, M, N, Kd, dtype)
    out = gpu.empty(M * N, from_numpy(dtype))
    gpu.compile(K.matmul(dtype=from_numpy(dtype)))(gpu.buf(a), gpu.buf(b), out, M=M, N=N, K=Kd)
    got = out.numpy().reshape(M, N)
    if dtype == np.float16:
        np.testing.assert_allclose(got.astype(np.float32), a.astype(np.float32) @ b.astype(np.float32),
                                   rtol=2e-2, atol=1e-1)
    else:
        np.testing.assert_allclose(got, a @ b, rtol=1e-6 if dtype == np.float64 else 0)


# ---- full tiles filled by asynchronous copies (Schedule.async_fill) --------------------------------

ASYNC_CAPS = dataclasses.replace(CAPS, async_copy=True)


def async_lowered(ast, tile=SMALL, fill=True):
    from morok_py.codegen.schedule import Schedule
    s = Schedule("tiled", group=(tile[0] // tile[3]) * (tile[1] // tile[4]), matmul_tile=tile, async_fill=fill)
    return lower(ast, ASYNC_CAPS, "mm", schedule=s)


def _copies(kernel) -> list[int]:
    return [i.arg for i in kernel.walk() if i.kind is L.CP_ASYNC]


@pytest.mark.parametrize("M,N,Kd,static", [(36, 68, 40, False), (33, 66, 42, False), (64, 72, 40, True),
                                           (70, 96, 40, True), (5, 4, 4, False)])
@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, True)])
@pytest.mark.parametrize("tile", [SMALL, (32, 64, 8, 2, 4)], ids=str)
@pytest.mark.parametrize("min_bytes", [4, 16])
def test_async_fill_matches_numpy(rng, monkeypatch, M, N, Kd, static, a_t, b_t, tile, min_bytes):
    """Full double-buffered tiles copied by cp.async (A along k: one 4-byte copy per element; B along its
    rows: one 16-byte copy per vector), the next tile's copies in flight under the k step and waited for at
    its end; the interpreter checks every read of a pending copy and every write to a buffer still read.
    Unaligned symbolic sizes take the scalar variant, the k tail stays the register path. With
    ASYNC_MIN_BYTES 16 (the default) A along k stays register-staged beside B's copies."""
    monkeypatch.setattr(gpu_tile, "ASYNC_MIN_BYTES", min_bytes)
    a, b, ga, gb = operands(rng, M, N, Kd, a_t=a_t, b_t=b_t)
    ast = contraction(MUL, M=M if static else None, N=N if static else None, Kd=Kd if static else None,
                      a_t=a_t, b_t=b_t)
    kernel, info = async_lowered(ast, tile)
    if static and M % 4 == 0 and N % 4 == 0 and Kd % 4 == 0:
        assert _copies(kernel) and set(_copies(kernel)) == ({4, 16} if min_bytes == 4 else {16})
    out = np.zeros(M * N, np.float32)
    writes = LI.run(kernel, info, [ga.reshape(-1), gb.reshape(-1), out], {} if static else {"M": M, "N": N, "K": Kd})
    check(out.reshape(M, N), a @ b, writes[-1].reshape(M, N))


def test_async_fill_needs_the_wait_the_model_says_so(rng):
    """Without the wait at the end of the k step, the next step reads a tile whose copies may not have
    landed: the interpreter reports it (the test of the model, not of the lowering)."""
    M, N, Kd = 64, 72, 40
    a, b, _, _ = operands(rng, M, N, Kd)
    kernel, info = async_lowered(K.matmul(M, N, Kd))

    def drop(items):
        out = []
        for it in items:
            if isinstance(it, (Loop, If)):
                it.body[:] = drop(it.body)
            if isinstance(it, Loop) or not (getattr(it, "kind", None) is L.CP_WAIT):
                out.append(it)
        return out
    body = []
    for it in kernel.body:      # only the waits inside the k loop go
        if isinstance(it, If):
            for sub in it.body:
                if isinstance(sub, Loop):
                    sub.body[:] = drop(sub.body)
        body.append(it)
    with pytest.raises(LI.InterpError, match="pending|race|cp.async") as e:
        LI.run(kernel, info, [a.reshape(-1), b.reshape(-1), np.zeros(M * N, np.float32)], {})


def test_async_fill_is_the_schedules_choice_and_needs_the_capability():
    from morok_py.codegen.schedule import Schedule
    ast = K.matmul(64, 72, 40)
    assert not _copies(async_lowered(ast, fill=False)[0])
    assert not _copies(lower(ast, CAPS, "mm")[0])
    with pytest.raises(ValueError, match="asynchronous copies"):
        lower(ast, CAPS, "mm", schedule=Schedule("tiled", group=256, matmul_tile=SMALL, async_fill=True))
    with pytest.raises(ValueError, match="async_fill"):
        Schedule("groups", group=256, async_fill=True)
    s = Schedule("tiled", group=256, matmul_tile=SMALL, async_fill=True)
    assert "async_fill=True" in str(s) and Schedule.from_json(s.to_json()) == s


@pytest.mark.parametrize("static", [False, True], ids=["symbolic", "static"])
@pytest.mark.parametrize("key", ["nvrtc", "llvm-nvptx"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("min_bytes", [4, 16])
def test_cuda_async_filled_matmul_compiles_within_two_blocks_per_sm(monkeypatch, key, arch, static, min_bytes):
    """The 4096^3 float32 kernel with cp.async fills: cp.async in the code (16-byte copies through .cg;
    with ASYNC_MIN_BYTES 4, A's 4-byte ones through .ca), <= 128 registers, no spills."""
    import dataclasses as dc
    from morok_py.codegen.schedule import using
    monkeypatch.setattr(gpu_tile, "ASYNC_MIN_BYTES", min_bytes)
    r, c = _cuda_pair(key, arch)
    ast = K.matmul(4096, 4096, 4096) if static else K.matmul()
    base = r.render(ast, "schedule").linear.schedule
    with using(dc.replace(base, async_fill=True)):
        spec = r.render(ast, "matmul")
    res = cubin_resources(c.compile(spec).bytes)
    assert res["regs"] <= 128 and res.get("frame", 0) == 0, res
    text = spec.src if key == "nvrtc" else c.ptx(spec)
    assert ("cp.async.ca.shared.global" in text) == (min_bytes == 4) and "cp.async.cg.shared.global" in text


def test_async_fill_is_the_default_where_the_target_has_async_copies():
    """The default tiled schedule fills by cp.async on targets with asynchronous copies (CUDA sm_80+; the
    H100 timings are at schedule.ASYNC_FILL_DEFAULT), and the kernel then copies B's 16-byte runs."""
    from morok_py.backends.cuda.renderer import cuda_caps
    assert cuda_caps("sm_80").async_copy and cuda_caps("sm_90a").async_copy and not cuda_caps("sm_75").async_copy
    kernel, _ = lower(K.matmul(), ASYNC_CAPS, "mm")
    assert kernel.schedule.async_fill and set(_copies(kernel)) == {16}
    kernel, _ = lower(K.matmul(), CAPS, "mm")
    assert not kernel.schedule.async_fill and not _copies(kernel)
    # integer accumulators keep the register fill (an int32 product spilled under the register cap)
    assert not lower(K.matmul(dtype=dtypes.int32), ASYNC_CAPS, "mm")[0].schedule.async_fill


def test_vector_runs_are_proven_through_floor_division_and_modulo_by_a_multiple_of_the_width():
    """`_vector_aligned`: 8 elements from a row index i that is a multiple of 8 are contiguous and 8-aligned
    where i enters through i // D and i % D with 8 | D and everything else is a multiple of 8 (an implicit
    GEMM's (image, row, column) split of its pixel rows); a divisor or a stride 8 does not divide is refused,
    and the brute-force check over every run agrees with each verdict."""
    i, k = UOp.range(4 * 144, 0), UOp.range(16, 2, AxisType.REDUCE)
    cases = {
        "i % 144 + (i // 144) * 16 * 144 + k * 144": True,      # a 1x1 layer: pixel i % P, 8 | P
        "((i // 56) % 56) * 56 + i % 56 + k * 3136": True,      # (row, column), 8 | OW
        "((i // 12) % 12) * 12 + i % 12 + k * 144": False,      # 8 does not divide OW (contiguous, unproven)
        "i % 12 + k * 16": False,                               # runs cross a block of 12
        "(i // 16) * 4 + i % 16": False,                        # the block's offset not a multiple of 8
        "i % 16 + k * 12": False,                               # k's stride not a multiple of 8
        "(i % 16) * 2": False,                                  # not unit stride along i
        "i + k * 64": True,                                     # affine
    }
    env = {"i": i, "k": k}
    for text, want in cases.items():
        idx = eval(text, {}, env)
        assert gpu_tile._vector_aligned(idx, i, 8) is want, text
        f = eval("lambda i, k: " + text)
        runs_ok = all(all(f(s + l, kk) == f(s, kk) + l for l in range(8)) and f(s, kk) % 8 == 0
                      for s in range(0, 4 * 144, 8) for kk in range(16))
        assert runs_ok or not want, text
