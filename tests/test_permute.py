"""Permutations through shared-memory tiles (codegen/strategies/permute.py): recognised from the index
expressions of a plain IR kernel, chosen by the default GPU schedule, right on every shape (checked in the
test-only interpreter, which also catches races and out-of-range accesses), rendered and compiled for
every CUDA and ROCm pair, unchanged on the CPU, and run on a GPU against numpy (marked `cuda`)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from morok_py import AxisType, LaunchError, UOp, dtypes
from morok_py.codegen.capabilities import Capabilities
from morok_py.codegen.linear import L
from morok_py.codegen.lower import lower
from morok_py.codegen.scan import scan_kernel
from morok_py.codegen.schedule import Schedule, candidate_schedules, default_schedule
from morok_py.codegen.strategies.permute import TILE
from morok_py.codegen.symbolic import simplify
from morok_py.dtypes import from_numpy

import linear_interp as LI
from conftest import PAIRS, amdgpu_llvm_pair, cuda_compile_pair, open_target, random_array

CAPS = Capabilities(
    has_local=True, has_shared=True, local_max=(1024, 1024, 64), default_group=256,
    grid_max=(2**31 - 1, 65535, 65535), warp_size=32, group_reduce=True, vector_width=4)

# (input shape, permutation): output axis k is input axis perm[k]; sizes off the 32-element tile
CASES = [((37, 70), (1, 0)), ((64, 96), (1, 0)), ((3, 45, 33), (2, 0, 1)), ((5, 33, 40), (0, 2, 1)),
         ((2, 3, 9, 35), (0, 3, 1, 2)), ((2, 34, 3, 33), (3, 1, 0, 2)), ((2, 3, 2, 5, 34), (4, 3, 2, 1, 0)),
         ((2, 33, 2, 3, 36), (0, 4, 2, 3, 1)),
         ((3, 40, 7, 7), (0, 2, 3, 1)), ((2, 5, 3, 64), (0, 3, 1, 2)), ((2, 3, 4, 5, 6), (4, 3, 0, 2, 1))]


def permuted(shape, perm, symbolic=False, dtype=dtypes.float32):
    """out = x.transpose(perm) written in the IR: one range per output axis, both indices row-major."""
    nd = len(shape)
    ends = [UOp.variable(f"d{i}", 1, 1 << 16) if symbolic else s for i, s in enumerate(shape)]
    x, out = UOp.param(0, dtype), UOp.param(1, dtype)
    rs = [UOp.range(ends[perm[k]], k) for k in range(nd)]
    at = {perm[k]: rs[k] for k in range(nd)}
    idx = at[0]
    for i in range(1, nd):
        idx = idx * ends[i] + at[i]
    oidx = rs[0]
    for k in range(1, nd):
        oidx = oidx * ends[perm[k]] + rs[k]
    return UOp.sink(out.store(oidx, x.load(idx)))


def values(shape, symbolic):
    return {f"d{i}": s for i, s in enumerate(shape)} if symbolic else {}


def schedule_of(ast, caps=CAPS) -> Schedule:
    ast = simplify(ast)
    return default_schedule(ast, caps, scan_kernel(ast))


# ---- recognition -------------------------------------------------------------------------------------

@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape,perm", CASES)
def test_a_permutation_gets_the_tiled_schedule(shape, perm, symbolic):
    from morok_py.codegen.strategies.permute import permute_plan
    ast = simplify(permuted(shape, perm, symbolic))
    s = schedule_of(ast)
    # a plain 2-D permutation (nothing but the two chains) takes larger groups, longer tiles along b; others 256
    plane = not permute_plan(ast, scan_kernel(ast)).rest
    assert s.permute == TILE and s.mapping == "groups" and s.group == (512 if plane else 256)
    assert f"permute={TILE}" in str(s) and Schedule.from_json(s.to_json()) == s


def test_what_is_no_permutation_keeps_its_schedule():
    x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)
    r, c = UOp.range(40, 0), UOp.range(50, 1)
    copy = UOp.sink(out.store(r * 50 + c, x.load(r * 50 + c)))             # both contiguous along c
    outer = permuted((6, 7, 40), (1, 0, 2))                                  # the last axis stays
    bcast = UOp.sink(out.store(c * 40 + r, x.load(r)))                      # not a permutation of the load
    k = UOp.range(40, 2, AxisType.REDUCE)
    red = UOp.sink(out.store(c, x.load(k * 50 + c).reduce(k)))
    for ast in (copy, outer, bcast, red):
        assert not schedule_of(ast).permute
    cpu = dataclasses.replace(CAPS, has_local=False, has_shared=False, has_threads=True, group_reduce=False,
                              vector_width=1)
    assert schedule_of(permuted((37, 70), (1, 0)), cpu).mapping == "threads"


def test_a_permute_schedule_is_refused_where_it_cannot_apply():
    ast = simplify(permuted((6, 7, 40), (1, 0, 2)))
    with pytest.raises(ValueError, match="permut"):
        lower(ast, CAPS, "p", schedule=Schedule("groups", group=256, permute=32))
    with pytest.raises(ValueError):
        Schedule("groups", group=32, permute=64)     # under one tile row per pass


# ---- the kernel, in the interpreter --------------------------------------------------------------------

def interpret(ast, shape, perm, symbolic, dtype=np.float32, schedule=None, rng=None):
    kernel, info = lower(ast, CAPS, "p", schedule=schedule)
    assert any(i.kind is L.LOCAL for i in kernel.walk()) and kernel.schedule.permute
    x = random_array(rng, shape, dtype)
    out = np.zeros(x.size, dtype)
    writes = LI.run(kernel, info, [x.reshape(-1).copy(), out], values(shape, symbolic))
    np.testing.assert_array_equal(out.reshape([shape[p] for p in perm]), x.transpose(perm))
    assert (writes[1] == 1).all()          # every output element stored exactly once
    return kernel


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape,perm", CASES)
def test_interpreted_permutations_match_numpy(rng, shape, perm, symbolic):
    interpret(permuted(shape, perm, symbolic), shape, perm, symbolic, rng=rng)


def test_short_contiguous_axes_are_merged_with_the_next_one_out():
    """NCHW -> NHWC with 7 x 7 images: the load's run is h and w together (49 elements), not w alone."""
    from morok_py.codegen.strategies.permute import permute_plan
    ast = simplify(permuted((3, 40, 7, 7), (0, 2, 3, 1)))
    plan = permute_plan(ast, scan_kernel(ast))
    assert [r.src[0].arg for r in plan.a] == [7, 7] and [r.src[0].arg for r in plan.b] == [40]
    assert plan.a_end.arg == 49 and plan.load_vec is None and plan.store_vec == ()


# runs along the load shorter than the tile: whole-run tiles read flat (contiguous over b or not, odd or even run,
# b a multiple of the tile or not)
SHORT_RUNS = [((2, 128, 7, 7), (0, 2, 3, 1)), ((3, 40, 7, 7), (0, 2, 3, 1)), ((2, 70, 6, 6), (0, 2, 3, 1)),
              ((2, 64, 5, 5), (0, 2, 3, 1)), ((40, 3, 7, 7), (1, 2, 3, 0)), ((3, 130, 3, 3), (0, 2, 3, 1))]


@pytest.mark.parametrize("dt", [np.float32, np.float16, np.int8])
@pytest.mark.parametrize("shape,perm", SHORT_RUNS)
def test_short_runs_are_read_as_whole_tiles(rng, shape, perm, dt):
    ast = simplify(permuted(shape, perm, False, from_numpy(np.dtype(dt))))
    for s in (None, Schedule("groups", group=64, permute=32), Schedule("groups", group=1024, permute=64)):
        interpret(ast, shape, perm, False, dt, s, rng)


def test_larger_groups_write_longer_tile_rows():
    """Each work-item moves ITEM_ELEMENTS elements: 512 items take 64 x 128 tiles, while the shared tile fits."""
    from morok_py.codegen.strategies.permute import tile_rows
    assert tile_rows(64, 256, 4, 65) == 64 and tile_rows(64, 512, 4, 65) == 128 and tile_rows(32, 256, 4, 33) == 128
    assert tile_rows(64, 1024, 4, 65) == 128          # 64 x 256 float32 would pass 48 KiB
    assert tile_rows(64, 512, 8, 65) == 64 and tile_rows(64, 64, 4, 65) == 64


def test_a_contiguous_short_run_tile_is_read_as_vectors(rng):
    """NCHW -> NHWC at 7 x 7: 64 channels of 49 elements are one aligned run, read as 4-wide vectors and written
    as 4-wide vectors along the channels."""
    shape, perm = (2, 128, 7, 7), (0, 2, 3, 1)
    k = interpret(permuted(shape, perm), shape, perm, False, rng=rng)
    widths = {(i.kind, i.arg) for i in k.walk() if i.kind in (L.LOAD, L.STORE) and i.arg and i.src[0].kind is L.PARAM}
    assert widths == {(L.LOAD, 4), (L.STORE, 4)}


def test_full_aligned_tiles_use_vector_loads_and_stores(rng):
    k = interpret(permuted((128, 192), (1, 0)), (128, 192), (1, 0), False, rng=rng)
    widths = {(i.kind, i.arg) for i in k.walk() if i.kind in (L.LOAD, L.STORE) and i.arg}
    assert widths == {(L.LOAD, 4), (L.STORE, 4)}
    # static sizes that the tile divides: no scalar edge path at all
    assert not any(i.kind in (L.LOAD, L.STORE) and not i.arg and i.src[0].kind is L.PARAM for i in k.walk())


# odd row strides: full tiles whose rows start at every offset modulo the vector width, on both sides
ODD = [((131, 197), (1, 0)), ((130, 201), (1, 0)), ((3, 67, 133), (0, 2, 1)), ((70, 3, 133), (2, 1, 0))]


@pytest.mark.parametrize("dt", [np.float32, np.float16])
@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape,perm", ODD)
def test_full_tiles_of_unaligned_rows_are_right(rng, shape, perm, symbolic, dt):
    ast = simplify(permuted(shape, perm, symbolic, from_numpy(np.dtype(dt))))
    for s in (None, Schedule("groups", group=64, permute=32), Schedule("groups", group=1024, permute=64)):
        interpret(ast, shape, perm, symbolic, dt, s, rng)


def test_a_value_of_the_ranges_on_odd_full_tiles(rng):
    x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)
    R, C = 131, 197
    r, c = UOp.range(R, 0), UOp.range(C, 1)
    ast = UOp.sink(out.store(c * R + r, x.load(r * C + c) * 2.0 + (c * 1000 + r).cast(dtypes.float32)))
    kernel, info = lower(ast, CAPS, "p")
    assert kernel.schedule.permute
    xv = random_array(rng, (R, C), np.float32)
    o = np.zeros(R * C, np.float32)
    LI.run(kernel, info, [xv.reshape(-1).copy(), o])
    want = xv * 2 + (np.arange(C)[None, :] * 1000 + np.arange(R)[:, None]).astype(np.float32)
    np.testing.assert_array_equal(o.reshape(C, R), want.T)


@pytest.mark.parametrize("dt", [np.float16, np.float64, np.int8, np.int32])
def test_every_candidate_schedule_is_right(rng, dt):
    shape, perm = (66, 72), (1, 0)
    ast = simplify(permuted(shape, perm, True, from_numpy(np.dtype(dt))))
    cands = [s for s in candidate_schedules(ast, CAPS, scan_kernel(ast)) if s.permute]
    assert {s.permute for s in cands} == {32, 64} and len(cands) >= 4
    for s in cands:
        interpret(ast, shape, perm, True, dt, s, rng)


def test_the_stored_value_may_compute_on_the_load_and_the_ranges(rng):
    x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float16)
    R, C = 45, 52
    r, c = UOp.range(R, 0), UOp.range(C, 1)
    ast = UOp.sink(out.store(c * R + r, (x.load(r * C + c) * 2.0 + c.cast(dtypes.float32)).cast(dtypes.float16)))
    kernel, info = lower(ast, CAPS, "p")
    assert kernel.schedule.permute
    xv = random_array(rng, (R, C), np.float32)
    o = np.zeros(R * C, np.float16)
    LI.run(kernel, info, [xv.reshape(-1).copy(), o])
    np.testing.assert_array_equal(o.reshape(C, R), (xv * 2 + np.arange(C)[None, :]).astype(np.float16).T)


def test_the_launch_check_still_guards_both_buffers(rng):
    shape, perm = (37, 70), (1, 0)
    kernel, info = lower(permuted(shape, perm, True), CAPS, "p")
    x = random_array(rng, shape, np.float32).reshape(-1)
    with pytest.raises(LaunchError):
        LI.run(kernel, info, [x, np.zeros(x.size - 1, np.float32)], values(shape, True))
    with pytest.raises(LaunchError):
        LI.run(kernel, info, [x[:-1].copy(), np.zeros(x.size, np.float32)], values(shape, True))


# ---- rendered and compiled for every GPU pair -----------------------------------------------------------

KERNELS = {"2d": ((4096, 4100), (1, 0), False), "3d_sym": ((8, 300, 500), (0, 2, 1), True),
           "2d_odd": ((8191, 8193), (1, 0), True),
           "5d": ((2, 3, 4, 40, 36), (4, 1, 0, 3, 2), False)}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("key", ["nvrtc", "llvm-nvptx"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_pairs_render_and_compile_the_tiled_kernel(arch, key, kernel):
    shape, perm, sym = KERNELS[kernel]
    r, c = cuda_compile_pair(key, arch)
    spec = r.render(permuted(shape, perm, sym), f"transpose_{kernel}")
    assert spec.launch.local_size[0] == (512 if kernel.startswith("2d") else 256)
    assert spec.linear.schedule.permute == TILE
    src = spec.src
    assert ("__shared__" in src and "__syncthreads" in src) if key == "nvrtc" else "addrspace(3)" in src
    out = c.compile(spec)
    assert out.bytes[:4] == b"\x7fELF"


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("arch", ["gfx90a", "gfx1100"])
def test_rocm_pairs_render_and_compile_the_tiled_kernel(arch, kernel):
    from morok_py.backends.rocm import compile_only_pairs
    shape, perm, sym = KERNELS[kernel]
    ast = permuted(shape, perm, sym)
    r, c = amdgpu_llvm_pair(arch)
    spec = r.render(ast, f"transpose_{kernel}")
    assert "addrspace(3)" in spec.src and spec.linear.schedule.permute == TILE
    assert c.compile(spec).bytes[:4] == b"\x7fELF"
    hr, hc = compile_only_pairs(arch)[1]
    hspec = hr.render(ast, f"transpose_{kernel}")
    assert "__shared__" in hspec.src and "__syncthreads" in hspec.src
    if hc.available() is None:
        assert hc.compile(hspec).bytes


# ---- on a device ---------------------------------------------------------------------------------------

def run_on(target, rng, shape, perm, symbolic, dtype=np.float32):
    ast = permuted(shape, perm, symbolic, from_numpy(np.dtype(dtype)))
    x = random_array(rng, shape, dtype)
    out = target.empty(x.size, from_numpy(np.dtype(dtype)))
    prog = target.compile(ast)
    prog(target.buf(x), out, **values(shape, symbolic))
    np.testing.assert_array_equal(out.numpy().reshape([shape[p] for p in perm]), x.transpose(perm))
    return prog


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape,perm", CASES[:4] + [((2, 3, 4, 40, 36), (4, 1, 0, 3, 2))])
def test_cpu_permutations_are_unchanged(cpu, rng, shape, perm, symbolic):
    run_on(cpu, rng, shape, perm, symbolic)


CPU = dataclasses.replace(CAPS, has_local=False, has_shared=False, has_threads=True, group_reduce=False, vector_width=1)


def test_a_static_cpu_permutation_is_walked_in_blocks_and_others_are_not():
    """On the CPU a permutation of static sizes whose sides are each contiguous along one range takes blocks of
    CPU_BLOCK (printed, stored and read back); symbolic sizes, a side merged from short ranges (NCHW -> NHWC at
    7 x 7: runs of 49) and what is no permutation keep the plain walk. The schedule is refused where it cannot apply."""
    from morok_py.codegen.strategies.permute import CPU_BLOCK, CPU_BLOCK_MIN_REUSE
    s = schedule_of(permuted((700, 37), (1, 0)), CPU)
    assert s == Schedule("threads", block_permute=CPU_BLOCK) and f"block_permute={CPU_BLOCK}" in str(s)
    assert Schedule.from_json(s.to_json()) == s
    assert schedule_of(permuted((1, 56, 56, 64), (0, 3, 1, 2)), CPU).block_permute == CPU_BLOCK    # NHWC -> NCHW
    # the plain walk comes back to an input line after fewer than CPU_BLOCK_MIN_REUSE others: NCHW -> NHWC at 64
    # channels, or a 2-D transpose of that few rows
    assert not schedule_of(permuted((1, 64, 56, 56), (0, 2, 3, 1)), CPU).block_permute
    assert not schedule_of(permuted((CPU_BLOCK_MIN_REUSE - 1, 700), (1, 0)), CPU).block_permute
    assert schedule_of(permuted((CPU_BLOCK_MIN_REUSE, 700), (1, 0)), CPU).block_permute
    assert not schedule_of(permuted((700, 37), (1, 0), symbolic=True), CPU).block_permute
    assert not schedule_of(permuted((3, 40, 7, 7), (0, 2, 3, 1)), CPU).block_permute
    assert not schedule_of(permuted((6, 7, 40), (1, 0, 2)), CPU).block_permute
    with pytest.raises(ValueError, match="permut"):
        lower(simplify(permuted((6, 7, 40), (1, 0, 2))), CPU, "p", schedule=Schedule("threads", block_permute=16))
    with pytest.raises(ValueError, match="block_permute"):
        Schedule("threads", block_permute=16, register_tile=(4, 8))
    with pytest.raises(ValueError, match="block_permute"):
        Schedule("groups", block_permute=16)


# sizes below, at and off the block edge on either side; 2-D to 5-D; NCHW <-> NHWC of resnet50's shapes
BLOCK_CASES = [((37, 70), (1, 0)), ((5, 200), (1, 0)), ((16, 16), (1, 0)), ((3, 45, 33), (2, 0, 1)),
               ((2, 34, 40, 33), (3, 1, 0, 2)), ((40, 3, 2, 5, 34), (4, 3, 2, 1, 0)), ((1, 56, 56, 64), (0, 3, 1, 2)),
               ((1, 64, 56, 56), (0, 2, 3, 1)), ((2, 56, 33, 40), (0, 3, 1, 2))]


@pytest.mark.parametrize("shape,perm", BLOCK_CASES)
def test_cpu_block_permutations_match_numpy_at_every_level(cpu_level, rng, shape, perm, monkeypatch):
    """The blocked walk moves every element (the output NaN-filled first) at every x86-64 level the host runs,
    float32 and the 2-byte float16, in a split launch (the thread split is the blocks' range). Every case takes
    blocks here (the reuse rule set to 1, the disk cache off), however soon its plain walk would come back."""
    from morok_py.codegen.strategies import permute as PM
    monkeypatch.setattr(PM, "CPU_BLOCK_MIN_REUSE", 1)
    monkeypatch.setenv("MOROK_CACHE", "0")
    for dtype in (np.float32, np.float16):
        ast = simplify(permuted(shape, perm, dtype=from_numpy(np.dtype(dtype))))
        assert PM.cpu_block_plan(ast, scan_kernel(ast)) is not None
        name = f"perm_blocked_{'_'.join(map(str, shape))}_{np.dtype(dtype).name}"
        assert cpu_level.dev.renderer.render(ast, name).linear.schedule.block_permute == PM.CPU_BLOCK
        x = random_array(rng, shape, dtype)
        out = cpu_level.buf(np.full(x.size, np.nan, dtype))
        cpu_level.compile(ast, name)(cpu_level.buf(x), out)
        np.testing.assert_array_equal(out.numpy().reshape([shape[p] for p in perm]), x.transpose(perm))


GPU_PAIRS = [p for p in PAIRS if p.id in ("CUDA-nvrtc", "CUDA-llvm-nvptx", "ROCM-llvm-amdgpu", "ROCM-hiprtc")]


@pytest.fixture(params=GPU_PAIRS)
def gpu(request):
    return open_target(*request.param)


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape,perm", CASES + [((1000, 1001), (1, 0)), ((512, 1024), (1, 0)), ((515, 2051), (1, 0)),
                                                ((5, 131, 67), (0, 2, 1))])
def test_device_permutations_match_numpy(gpu, rng, shape, perm, symbolic):
    run_on(gpu, rng, shape, perm, symbolic)


@pytest.mark.parametrize("dt", [np.float16, np.float64, np.int8])
def test_device_permutations_of_other_dtypes(gpu, rng, dt):
    run_on(gpu, rng, (67, 3, 130), (2, 1, 0), True, dt)


def test_device_symbolic_program_takes_many_sizes(gpu, rng):
    ast = permuted((1, 1, 1), (2, 0, 1), True)
    prog = gpu.compile(ast)
    for shape in [(1, 1, 1), (3, 31, 33), (2, 64, 128), (5, 7, 1000)]:
        x = random_array(rng, shape, np.float32)
        out = gpu.empty(x.size, dtypes.float32)
        prog(gpu.buf(x), out, **values(shape, True))
        np.testing.assert_array_equal(out.numpy().reshape(shape[2], shape[0], shape[1]), x.transpose(2, 0, 1))


def test_device_launch_check_refuses_a_buffer_too_small(gpu, rng):
    shape = (37, 70)
    prog = gpu.compile(permuted(shape, (1, 0), True))
    x = gpu.buf(random_array(rng, shape, np.float32))
    with pytest.raises(LaunchError):
        prog(x, gpu.empty(37 * 70 - 1, dtypes.float32), d0=37, d1=70)
    with pytest.raises(LaunchError):
        prog(gpu.buf(random_array(rng, 37 * 70 - 1, np.float32)), gpu.empty(37 * 70, dtypes.float32), d0=37, d1=70)
