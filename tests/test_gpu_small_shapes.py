"""Small and skinny shapes on a GPU (codegen/strategies/small_shapes.py, the split rows of
strategies/grid_reduce.py): decode contractions of 16-64 rows on skinny blocks, half-size tiles for
contractions that would leave SMs idle (constant or bounded symbolic sizes), few long rows on full-size
groups, and reductions over few rows split over several work-groups per row.

The schedule tests render with the real CUDA renderers (no GPU needed) and run the split-row reduction
through the linear-kernel interpreter; the `cuda` tests run each strategy on both CUDA pairs against numpy
(the `device` fixture also runs them on the CPU pairs, whose schedules the shared layer also picks).
"""
from __future__ import annotations

import numpy as np
import pytest

from morok_py import LaunchError, Ops, UOp, dtypes, kernels as K
from morok_py.codegen.lower import lower
from morok_py.codegen.scan import scan_kernel
from morok_py.codegen.schedule import Schedule, candidate_schedules, default_schedule
from morok_py.codegen.strategies import small_shapes
from morok_py.codegen.symbolic import simplify
from morok_py.dtypes import to_numpy

import linear_interp as LI
from conftest import open_target, random_array

GPU_PAIRS = [
    pytest.param(("CUDA", "nvrtc"), id="CUDA-nvrtc", marks=pytest.mark.cuda),
    pytest.param(("CUDA", "llvm-nvptx"), id="CUDA-llvm-nvptx", marks=pytest.mark.cuda),
]
TOL = {"float16": (2 ** -9, 2e-3), "bfloat16": (2 ** -6, 1e-2), "float32": (1e-4, 1e-4)}


@pytest.fixture(params=GPU_PAIRS)
def gpu(request):
    return open_target(*request.param)


def cuda_renderer():
    from backends.cuda.device import compile_only_pairs
    return compile_only_pairs("sm_90")[0]


def default_for(ast, caps):
    ast = simplify(ast)
    return default_schedule(ast, caps, scan_kernel(ast))


def bounded(n: str, hi: int = 1024) -> UOp:
    return UOp.variable(n, 1, hi)


# ---- the schedules (no GPU) -----------------------------------------------------------------------

@pytest.mark.parametrize("dt", [dtypes.float16, dtypes.bfloat16])
def test_decode_contraction_takes_a_skinny_tensor_core_tile(dt):
    r, c = cuda_renderer()
    s = default_for(K.matmul(32, 4096, 4096, dtype=dt), r.caps)
    assert s.tensor_core == "mma_m16n8k16" and s.matmul_tile[:2] == (32, small_shapes.DECODE_COLS), s
    spec = r.render(K.matmul(32, 4096, 4096, dtype=dt), "decode")
    assert spec.launch_dims({})[0][0] * spec.launch_dims({})[0][1] == 4096 // small_shapes.DECODE_COLS
    assert "tensor_core=mma_m16n8k16" in str(spec.linear.schedule) and "matmul_tile=32x32x" in str(spec.linear.schedule)
    c.compile(spec)


def test_decode_rows_are_rounded_to_the_fragment():
    r, _ = cuda_renderer()
    assert default_for(K.matmul(17, 4096, 4096, dtype=dtypes.float16), r.caps).matmul_tile[0] == 32
    assert default_for(K.matmul(64, 4096, 4096, dtype=dtypes.float16), r.caps).matmul_tile[0] == 64
    # fewer rows than a fragment: the GEMV's split reduction, as before
    assert default_for(K.matmul(8, 4096, 4096), r.caps).split > 1


def test_float32_decode_takes_a_skinny_cuda_core_tile():
    r, c = cuda_renderer()
    s = default_for(K.matmul(32, 4096, 4096), r.caps)
    assert s.mapping == "tiled" and s.tensor_core is None
    assert s.matmul_tile == (32, small_shapes.DECODE_SPLIT_COLS, 64, 4, 4), s     # split in parts: the wide tile
    c.compile(r.render(K.matmul(32, 4096, 4096), "decode32"))
    # a K that does not split keeps DECODE_COLS columns, 4 x 2 outputs per work-item
    assert default_for(K.matmul(32, 4096, 4000), r.caps).matmul_tile == (32, small_shapes.DECODE_COLS, 64, 4, 2)
    # ... as do blocks of more than 32 rows, and a tile whose blocks fill the GPU unsplit
    assert default_for(K.matmul(64, 4096, 4096), r.caps).matmul_tile == (64, small_shapes.DECODE_COLS, 64, 8, 2)
    assert default_for(K.matmul(32, 8192, 4096), r.caps).matmul_tile == (32, small_shapes.DECODE_COLS, 64, 4, 2)


def test_deep_float32_decode_tiles_are_candidates_with_async_copies_only():
    """The DECODE_CORE_BK-deep tiles (double-buffered in the dynamic shared memory) are searched where the
    default fills by cp.async: float accumulators on a target with asynchronous copies."""
    import dataclasses
    r, c = cuda_renderer()
    deep = (32, small_shapes.DECODE_COLS, small_shapes.DECODE_CORE_BK, 4, 2)
    ast = simplify(K.matmul(32, 4096, 4096))
    cands = candidate_schedules(ast, r.caps, scan_kernel(ast))
    s = next(s for s in cands if s.matmul_tile == deep)
    assert s.async_fill
    from morok_py.codegen.schedule import using
    with using(s):
        spec = r.render(K.matmul(32, 4096, 4096), "deep")
    assert "extern __shared__" in spec.src           # 72 KiB: past the static limit
    c.compile(spec)
    for caps, dt in ((dataclasses.replace(r.caps, async_copy=False), dtypes.float32), (r.caps, dtypes.int32)):
        ast = simplify(K.matmul(32, 4096, 4096, dtype=dt))
        assert all(s.matmul_tile is None or s.matmul_tile[2] < small_shapes.DECODE_CORE_BK
                   for s in candidate_schedules(ast, caps, scan_kernel(ast)))


def test_float32_decode_splits_k_over_four_groups_per_tile():
    """The decode tile's 64 blocks would leave most of an H100's 132 SMs idle: DECODE_SPLIT_K groups per
    output tile, a hidden scratch for the parts and a ticket counter per tile; both CUDA pairs compile it."""
    pairs = __import__("backends.cuda.device", fromlist=["x"]).compile_only_pairs("sm_90")[:2]
    cols = small_shapes.DECODE_SPLIT_COLS
    for r, c in pairs:
        s = default_for(K.matmul(32, 4096, 4096), r.caps)
        assert s.split_k == small_shapes.DECODE_SPLIT_K and f"split_k={small_shapes.DECODE_SPLIT_K}" in str(s), s
        spec = r.render(K.matmul(32, 4096, 4096), "decode32")
        assert spec.launch_dims({})[0] == (4096 // cols, 1, small_shapes.DECODE_SPLIT_K)
        assert [h.count for h in spec.launch.hidden] == [(4096 // cols) * 4 * 32 * cols, 4096 // cols]
        c.compile(spec)


@pytest.mark.parametrize("ast,why", [
    (lambda: K.matmul(32, 4096, 4000), "K no multiple of parts x BK"),
    (lambda: K.matmul(32, 4096, 4096, dtype=dtypes.int32), "integer sum"),
    (lambda: K.matmul(32, bounded("N", 4096), 4096), "symbolic N"),
    (lambda: K.matmul(64, 8192, 4096), "256 blocks: the GPU is full"),
])
def test_decode_without_split_k(ast, why):
    r, _ = cuda_renderer()
    assert default_for(ast(), r.caps).split_k == 0, why


def test_split_k_schedule_is_refused_where_it_cannot_apply():
    r, _ = cuda_renderer()
    with pytest.raises(ValueError, match="split_k"):
        Schedule("groups", group=256, split_k=4)
    with pytest.raises(ValueError, match="split_k"):
        lower(simplify(K.matmul(32, 256, 300)), r.caps, "s",
              schedule=Schedule("tiled", group=128, matmul_tile=(32, 32, 64, 4, 2), split_k=4))


@pytest.mark.parametrize("M,N,Kd,S", [(19, 70, 512, 4), (32, 96, 256, 2), (64, 37, 1024, 8), (5, 33, 128, 2)])
def test_split_k_interpreted(rng, M, N, Kd, S):
    """Each output tile on S groups, the last summing the parts: odd M and N, every output stored once."""
    r, _ = cuda_renderer()
    BM = _pow2(M)
    tile = (BM, small_shapes.DECODE_COLS, 64, max(1, BM // 8), 2)
    ast = simplify(K.matmul(M, N, Kd))
    kernel, info = lower(ast, r.caps, "sk", schedule=Schedule("tiled", group=(BM // tile[3]) * 16, matmul_tile=tile,
                                                            async_fill=True, split_k=S))
    assert info.launch_dims({})[0][2] == S and len(info.hidden) == 2
    a = random_array(rng, (M, Kd), np.float32)
    w = random_array(rng, (Kd, N), np.float32)
    out = np.zeros(M * N, np.float32)
    writes = LI.run(kernel, info, [a.reshape(-1), w.reshape(-1), out], {})
    np.testing.assert_allclose(out.reshape(M, N), a.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)
    assert (writes[2] == 1).all()


def test_wide_split_k_decode_tile_is_a_candidate():
    """The search also times the decode tile with twice the columns, 4 x 4 outputs per item, K in 8 parts."""
    r, _ = cuda_renderer()
    ast = simplify(K.matmul(32, 4096, 4096))
    wide = [s for s in candidate_schedules(ast, r.caps, scan_kernel(ast))
            if s.split_k == small_shapes.DECODE_WIDE_SPLIT and s.matmul_tile[1] == 2 * small_shapes.DECODE_COLS]
    assert len(wide) == 1 and wide[0].matmul_tile == (32, 64, 64, 4, 4) and wide[0].group == 128
    assert small_shapes.decode_wide_split(simplify(K.matmul(32, 4096, 4000)), r.caps, None) == []


@pytest.mark.parametrize("M,N,Kd", [(19, 130, 1024), (32, 70, 512), (64, 37, 1536)])
def test_wide_split_k_interpreted(rng, M, N, Kd):
    """The wide split-k candidate on odd M and N: each output tile on 8 groups, every output stored once."""
    r, _ = cuda_renderer()
    BM = _pow2(M)
    tile = (BM, 2 * small_shapes.DECODE_COLS, 64, max(1, BM // 8), 4)
    ast = simplify(K.matmul(M, N, Kd))
    S = small_shapes.DECODE_WIDE_SPLIT
    kernel, info = lower(ast, r.caps, "wide", schedule=Schedule("tiled", group=(BM // tile[3]) * 16, matmul_tile=tile,
                                                              async_fill=True, split_k=S))
    assert info.launch_dims({})[0][2] == S
    a = random_array(rng, (M, Kd), np.float32)
    w = random_array(rng, (Kd, N), np.float32)
    out = np.zeros(M * N, np.float32)
    writes = LI.run(kernel, info, [a.reshape(-1), w.reshape(-1), out], {})
    np.testing.assert_allclose(out.reshape(M, N), a.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)
    assert (writes[2] == 1).all()


@pytest.mark.parametrize("M,N,Kd", [(32, 96, 512), (19, 70, 333), (64, 37, 300)])
def test_deep_float32_decode_tile_interpreted(rng, M, N, Kd):
    """The deep decode tile (cp.async fills, both buffers in dynamic shared memory) on odd sizes, through the
    linear-kernel interpreter, against numpy."""
    r, _ = cuda_renderer()
    tile = (_pow2(M), small_shapes.DECODE_COLS, small_shapes.DECODE_CORE_BK, _pow2(M) // 8, 2)
    ast = simplify(K.matmul(M, N, Kd))
    kernel, info = lower(ast, r.caps, "deep", schedule=Schedule("tiled", group=128, matmul_tile=tile, async_fill=True))
    a = random_array(rng, (M, Kd), np.float32)
    w = random_array(rng, (Kd, N), np.float32)
    out = np.zeros(M * N, np.float32)
    LI.run(kernel, info, [a.reshape(-1), w.reshape(-1), out], {})
    np.testing.assert_allclose(out.reshape(M, N), a.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)


def _pow2(x: int) -> int:
    p = 8
    while p < x:
        p *= 2
    return p


@pytest.mark.parametrize("ast", [lambda: K.matmul(1000, 1000, 1000),
                                 lambda: K.matmul(bounded("M"), bounded("N"), bounded("K"))], ids=["static", "bounded"])
def test_contractions_under_a_wave_of_blocks_take_half_size_tiles(ast):
    r, c = cuda_renderer()
    s = default_for(ast(), r.caps)
    assert s.matmul_tile[:2] == (64, 128), s        # 16 x 8 = 128 blocks over 1000 x 1000
    c.compile(r.render(ast(), "mm"))
    # too few blocks of half the rows: half the rows and columns
    assert default_for(K.matmul(400, 400, 1000), r.caps).matmul_tile[:2] == (64, 64)


def test_unbounded_symbolic_and_large_contractions_keep_the_full_tile():
    r, _ = cuda_renderer()
    assert default_for(K.matmul(), r.caps).matmul_tile[:2] == (128, 128)
    assert default_for(K.matmul(4096, 4096, 4096), r.caps).matmul_tile[:2] == (128, 128)


def test_few_long_rows_are_split_over_groups_or_take_full_groups():
    r, c = cuda_renderer()
    s = default_for(K.reduce_axis("sum", [8, 131072], 1), r.caps)
    assert s.reduce == "grid" and s.row_split == 64 and "row_split=64" in str(s) and s.vector_width == 4
    spec = r.render(K.reduce_axis("sum", [8, 131072], 1), "sum_rows")
    assert spec.launch_dims({})[0] == (8 * 64, 1, 1)
    assert [h.count for h in spec.launch.hidden][-1] >= 8      # a ticket counter per row
    c.compile(spec)
    soft = default_for(K.softmax(8, 131072), r.caps)
    assert soft.group == small_shapes.FEW_ROWS_GROUP and soft.reduce == "group" and soft.vector_width == 4
    assert "float4" in r.render(K.softmax(8, 131072), "softmax").src
    # many rows, or short ones: as before
    assert default_for(K.reduce_axis("sum", [4096, 4096], 1), r.caps).row_split == 0
    assert default_for(K.reduce_axis("sum", [8, 1000], 1), r.caps) == Schedule("group_per_row", reduce="group", group=256)


def test_small_shape_schedules_are_searchable_and_stored():
    r, _ = cuda_renderer()
    for ast in (K.reduce_axis("sum", [8, 131072], 1), K.matmul(32, 4096, 4096, dtype=dtypes.float16)):
        ast = simplify(ast)
        cands = candidate_schedules(ast, r.caps, scan_kernel(ast))
        assert Schedule.from_json(cands[0].to_json()) == cands[0]
        assert len(cands) > 3
    ast = simplify(K.reduce_axis("sum", [8, 131072], 1))
    splits = {s.row_split for s in candidate_schedules(ast, r.caps, scan_kernel(ast))}
    assert {8, 16, 32, 64, 128} <= splits
    with pytest.raises(ValueError):
        Schedule("group_per_row", reduce="group", group=256, row_split=4)
    with pytest.raises(ValueError):
        Schedule("group_per_row", reduce="grid", group=256, row_split=3)


def _split_rows_interpreted(ast, x, out_shape, vals, split, group=32, width=1):
    r, _ = cuda_renderer()
    kernel, info = lower(ast, r.caps, "rows", schedule=Schedule("group_per_row", reduce="grid", group=group,
                                                                  row_split=split, vector_width=width))
    out = np.zeros(out_shape, np.float32)
    writes = LI.run(kernel, info, [x.reshape(-1), out], vals)
    assert (writes[-1] == 1).all(), "every row's output is stored once, by the last of its groups"
    return out, info


@pytest.mark.parametrize("width", [1, 4])
@pytest.mark.parametrize("op,cols,split", [("sum", 1001, 4), ("max", 333, 8), ("sum", 37, 2), ("min", 1024, 4)])
def test_split_rows_interpreted(rng, op, cols, split, width):
    x = random_array(rng, (3, cols), np.float32)
    out, info = _split_rows_interpreted(K.reduce_axis(op, [3, cols], 1), x, 3, {}, split, width=width)
    np.testing.assert_allclose(out, getattr(x.astype(np.float64), op)(1), rtol=1e-5, atol=1e-5)
    assert info.launch_dims({})[0] == (3 * split, 1, 1)


def test_split_rows_with_symbolic_columns_interpreted(rng):
    x = random_array(rng, (5, 211), np.float32)
    ast = K.reduce_axis("sum", [5, None], 1)
    out, _ = _split_rows_interpreted(ast, x, 5, {"d1": 211}, 4)
    np.testing.assert_allclose(out, x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cols", [1000, 999])      # aligned rows (4-wide loads) and misaligned ones (scalar)
def test_wide_rows_softmax_interpreted(rng, cols):
    r, _ = cuda_renderer()
    x = random_array(rng, (2, cols), np.float32)
    kernel, info = lower(K.softmax(2, cols), r.caps, "softmax",
                         schedule=Schedule("group_per_row", reduce="group", group=64, vector_width=4))
    out = np.zeros(2 * cols, np.float32)
    writes = LI.run(kernel, info, [x.reshape(-1), out], {})
    assert (writes[-1] == 1).all()
    e = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    np.testing.assert_allclose(out.reshape(2, cols), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-8)


def test_wide_rows_need_32_bit_row_loads():
    r, _ = cuda_renderer()
    with pytest.raises(ValueError):
        lower(K.reduce_axis("sum", [8, 1000], 1, dtype=dtypes.float16), r.caps, "x",
              schedule=Schedule("group_per_row", reduce="group", group=256, vector_width=4))


def test_split_rows_refuse_symbolic_rows_and_other_kernels():
    r, _ = cuda_renderer()
    for ast in (K.reduce_axis("sum", [None, 1000], 1), K.softmax(8, 1000), K.sum_all(1000)):
        with pytest.raises(ValueError):
            lower(ast, r.caps, "x", schedule=Schedule("group_per_row", reduce="grid", group=256, row_split=4))


# ---- on the devices -------------------------------------------------------------------------------

def _matmul_check(target, rng, ast, M, N, Kd, dt, vals=None):
    a = (random_array(rng, (M, Kd), np.float32)).astype(to_numpy(dt))
    w = (random_array(rng, (Kd, N), np.float32) / np.sqrt(Kd)).astype(to_numpy(dt))
    out = target.empty(M * N, dt)
    target.compile(ast)(target.buf(a), target.buf(w), out, **(vals or {}))
    want = a.astype(np.float64) @ w.astype(np.float64)
    rtol, atol = TOL[dt.name]
    np.testing.assert_allclose(out.numpy().astype(np.float64).reshape(M, N), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dt", [dtypes.float16, dtypes.bfloat16, dtypes.float32], ids=lambda d: d.name)
@pytest.mark.parametrize("M,N,Kd", [(32, 4096, 4096), (17, 520, 999), (48, 1000, 333), (64, 136, 72)])
def test_decode_contractions(device, rng, dt, M, N, Kd):
    _matmul_check(device, rng, K.matmul(M, N, Kd, dtype=dt), M, N, Kd, dt)


@pytest.mark.parametrize("M,N,Kd", [(32, 4096, 4096), (19, 333, 1024)])
def test_split_k_decode_launched_twice(device, rng, M, N, Kd):
    """The split-k decode tile (float32) twice on the same buffers: the last group of each tile resets its ticket
    counter, so the second launch combines its own parts."""
    a = random_array(rng, (M, Kd), np.float32)
    w = (random_array(rng, (Kd, N), np.float32) / np.sqrt(Kd)).astype(np.float32)
    prog = device.compile(K.matmul(M, N, Kd))
    bufs = [device.buf(a), device.buf(w), device.empty(M * N, dtypes.float32)]
    for scale in (1, 2):
        if scale == 2:
            bufs[0] = device.buf(2 * a)
        prog(*bufs)
        np.testing.assert_allclose(bufs[2].numpy().reshape(M, N), scale * a.astype(np.float64) @ w, rtol=1e-4,
                                   atol=1e-4)


@pytest.mark.parametrize("B,N,Kd", [(8, 4096, 4096), (5, 333, 1000), (16, 97, 640)])
def test_small_batch_gemv_through_the_checked_call(device, rng, B, N, Kd):
    """The GEMV's split with the whole batch per work-item (GEMV_UPCAST_SPLIT; NVRTC with the occupancy hint
    GEMV_UPCAST_RESIDENT), called twice on the same buffers (the checked call's remembered launch)."""
    a = random_array(rng, (B, Kd), np.float32)
    w = (random_array(rng, (Kd, N), np.float32) / np.sqrt(Kd)).astype(np.float32)
    prog = device.compile(K.matmul(B, N, Kd))
    bufs = [device.buf(a), device.buf(w), device.empty(B * N, dtypes.float32)]
    for _ in range(2):
        prog(*bufs)
        np.testing.assert_allclose(bufs[2].numpy().reshape(B, N), a.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("M,N,Kd", [(1000, 1000, 1000), (77, 1001, 999), (1024, 3, 1024)])
def test_bounded_symbolic_contractions(device, rng, M, N, Kd):
    ast = K.matmul(bounded("M"), bounded("N"), bounded("K"))
    _matmul_check(device, rng, ast, M, N, Kd, dtypes.float32, {"M": M, "N": N, "K": Kd})


@pytest.mark.parametrize("op,rows,cols", [("sum", 8, 131072), ("max", 5, 40001), ("mean", 3, 65539),
                                          ("min", 1, 20000)])
def test_few_long_rows_reduced(device, rng, op, rows, cols):
    x = random_array(rng, (rows, cols), np.float32)
    out = device.empty(rows, dtypes.float32)
    prog = device.compile(K.reduce_axis(op, [rows, cols], 1))
    for _ in range(3):       # the per-row ticket counters are reset by each row's last group
        x = random_array(rng, (rows, cols), np.float32)
        prog(device.buf(x), out)
        np.testing.assert_allclose(out.numpy(), getattr(x.astype(np.float64), op)(1), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("rows,cols", [(8, 131072), (3, 50257)])
def test_few_long_rows_softmax(device, rng, rows, cols):
    x = random_array(rng, (rows, cols), np.float32)
    out = device.empty(rows * cols, dtypes.float32)
    device.compile(K.softmax(rows, cols))(device.buf(x), out)
    e = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    np.testing.assert_allclose(out.numpy().reshape(rows, cols), e / e.sum(1, keepdims=True), rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("split", [2, 16, 128])
def test_split_rows_with_symbolic_columns(gpu, rng, split):
    """An explicit row_split over symbolic columns (the search's candidates), odd sizes."""
    from morok_py import cache
    r, c = gpu.pair()
    ast = K.reduce_axis("sum", [6, None], 1)
    prog = gpu.dev.runtime(cache.compile_ast(r, c, ast, "rows_sym", Schedule("group_per_row", reduce="grid",
                                                                            group=256, row_split=split)))
    for cols in (1, 999, 70001):
        x = random_array(rng, (6, cols), np.float32)
        out = gpu.empty(6, dtypes.float32)
        prog(gpu.buf(x), out, d1=cols)
        np.testing.assert_allclose(out.numpy(), x.astype(np.float64).sum(1), rtol=1e-4, atol=1e-3)


def test_launch_check_guards_every_buffer(gpu, rng):
    """A buffer too small for what the kernel touches is refused before the launch, for each strategy."""
    cases = [(K.matmul(32, 4096, 4096, dtype=dtypes.float16), [32 * 4096, 4096 * 4096, 32 * 4096], dtypes.float16, {}),
             (K.matmul(32, 520, 999), [32 * 999, 999 * 520, 32 * 520], dtypes.float32, {}),
             (K.matmul(bounded("M"), bounded("N"), bounded("K")), [1000 * 1000] * 3, dtypes.float32,
              {"M": 1000, "N": 1000, "K": 1000}),
             (K.reduce_axis("sum", [8, 131072], 1), [8 * 131072, 8], dtypes.float32, {})]
    for ast, sizes, dt, vals in cases:
        prog = gpu.compile(ast)
        for short in range(len(sizes)):
            bufs = [gpu.empty(n - (i == short), dt) for i, n in enumerate(sizes)]
            with pytest.raises(LaunchError):
                prog(*bufs, **vals)
        if vals:
            with pytest.raises(LaunchError):
                prog(*[gpu.empty(n, dt) for n in sizes], **dict(vals, M=1025))
