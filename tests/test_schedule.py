"""Schedules (codegen/schedule.py): the default schedule names today's heuristics, a schedule prints and
stores itself, a kernel refuses one it cannot take, and every candidate a search may time computes the
same outputs as numpy (GPU schedules run in the test interpreter, CPU ones on the CPU)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from morok_py import kernels as K
from morok_py import dtypes
from morok_py.ir import Ops
from morok_py.codegen import schedule as S
from morok_py.codegen.linear import L
from morok_py.codegen.lower import lower, scan_kernel
from morok_py.codegen.schedule import Schedule, candidate_schedules, default_schedule
from morok_py.codegen.symbolic import simplify

import linear_interp as LI
from conftest import random_array
from test_gpu_tile import CAPS

GPU = dataclasses.replace(CAPS, grid_reduce=True, warp_shuffle=True)


def cpu_caps(cpu):
    return cpu.pair()[0].caps


def default_for(ast, caps) -> Schedule:
    ast = simplify(ast)
    return default_schedule(ast, caps, scan_kernel(ast))


@pytest.mark.parametrize("kernel,gpu,want", [
    ("add", True, "Schedule(groups, group=256, vector_width=4)"),
    ("sum", True, "Schedule(group_per_row, reduce=grid, group=256)"),
    ("softmax", True, "Schedule(group_per_row, reduce=group, group=256)"),     # symbolic row: no row cache
    (lambda: K.softmax(64, 1000), True, "Schedule(group_per_row, reduce=group, group=256, row_cache=True)"),
    # vocabulary rows (201 KB, three passes): 128 rows in flight, each walked by 1024 items (row_groups)
    (lambda: K.softmax(1000, 50257), True, "Schedule(group_per_row, reduce=group, group=1024, row_groups=128)"),
    # <= 128 rows, fewer than an H100's SMs: full-size groups (strategies/small_shapes.py)
    (lambda: K.softmax(100, 50257), True, "Schedule(group_per_row, reduce=group, group=1024, vector_width=4)"),
    (lambda: K.row_max(1000, 50257), True, "Schedule(group_per_row, reduce=group, group=256)"),   # one pass
    ("row_max", True, "Schedule(group_per_row, reduce=group, group=256)"),
    ("matmul", True, "Schedule(tiled, group=256, matmul_tile=128x128x16x8x8)"),   # BK doubled: fits
    (lambda: K.matmul(dtype=dtypes.float64), True, "Schedule(tiled, group=256, matmul_tile=128x128x8x8x8)"),
    ("broadcast_add", True, "Schedule(groups, group=256, vector_width=4)"),
    ("sum_cols", True, "Schedule(groups, group=256, unroll=8, split=8, min_groups=8)"),     # a column reduction
    (lambda: K.reduce_axis("sum", [8192, 8192], 0), True,
     "Schedule(groups, group=256, unroll=8, split=8, min_groups=8, unrolled=True)"),       # static: unrolled here
    # batch-8 GEMV on a CUDA printer without split_upcast (NVRTC): every item computes the whole batch, two
    # groups per SM asked for (schedule.GEMV_UPCAST_RESIDENT)
    (lambda: K.matmul(8, 4096, 4096), True,
     "Schedule(groups, group=1024, unroll=4, split=32, min_groups=1, upcast=8, unrolled=True)"),
    (lambda: K.matmul(8, 4096, 4000), True,       # K no multiple of 128: the 512-item form, 2 groups per SM
     "Schedule(groups, group=512, unroll=4, split=16, min_groups=2, upcast=8)"),
    (lambda: K.reduce_axis("sum", [5, 7, 9], 1), True, "Schedule(groups, group=256, unroll=8, split=8, min_groups=8)"),
    (lambda: K.reduce_axis("max", [5, 7, 9], 2), True, "Schedule(groups, group=256)"),   # rows, two GLOBAL ranges
    ("add", False, "Schedule(threads)"),
    ("softmax", False, "Schedule(threads)"),
    ("sum_cols", False, "Schedule(threads, reduce=stream, stream_block=1024)"),   # rows streamed into the output
])
def test_default_schedule_names_the_heuristics(cpu, kernel, gpu, want):
    ast = K.named(kernel) if isinstance(kernel, str) else kernel()
    assert str(default_for(ast, GPU if gpu else cpu_caps(cpu))) == want


def test_cpu_matmul_default_has_the_targets_register_tile(cpu):
    caps = cpu_caps(cpu)
    assert default_for(K.named("matmul"), caps) == Schedule("threads", register_tile=caps.register_tile,
                                                           tile_lanes=caps.tile_lanes, pack=bool(caps.tile_lanes),
                                                           prefetch=bool(caps.tile_lanes))


def test_lowered_kernel_carries_its_schedule(cpu):
    kernel, _ = lower(K.named("softmax"), GPU, "sm")
    assert kernel.schedule == default_for(K.named("softmax"), GPU)


def test_schedule_json_round_trip():
    for s in (Schedule("threads", register_tile=(6, 16)), Schedule("tiled", group=64, matmul_tile=(64, 64, 8, 4, 4)),
              Schedule("group_per_row", reduce="group", group=128, row_cache=True)):
        assert Schedule.from_json(s.to_json()) == s


@pytest.mark.parametrize("text", ["", "{", "[]", '{"mapping": "warp"}', '{"mapping": "threads", "x": 1}',
                                  '{"mapping": "tiled", "group": 64, "matmul_tile": [64, "a"]}',
                                  '{"mapping": "groups", "group": true}', '{"reduce": "group"}'])
def test_corrupt_schedule_text_is_a_value_error(text):
    with pytest.raises(ValueError):
        Schedule.from_json(text)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(mapping="groups", reduce="group", group=64), "needs mapping 'group_per_row'"),
    (dict(mapping="group_per_row", group=64), "reduce 'group' or 'grid'"),
    (dict(mapping="tiled", group=64), "go together"),
    (dict(mapping="groups", group=64, register_tile=(4, 8)), "CPU"),
    (dict(mapping="groups", group=96), "power-of-two"),
    (dict(mapping="threads", unroll=4), "GPU fields"),
])
def test_inconsistent_schedules_are_refused(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        Schedule(**kwargs)


@pytest.mark.parametrize("kernel,sched", [
    ("softmax", Schedule("group_per_row", reduce="grid", group=256)),      # has a GLOBAL range
    ("add", Schedule("tiled", group=256, matmul_tile=(128, 128, 8, 8, 8))),
    ("matmul", Schedule("group_per_row", reduce="group", group=256)),     # two GLOBAL ranges
    ("sum_rows", Schedule("groups", group=256, vector_width=4)),          # not elementwise
    ("add", Schedule("threads")),                                          # a CPU schedule on a GPU
])
def test_a_kernel_refuses_a_schedule_it_cannot_take(kernel, sched):
    with pytest.raises(ValueError):
        lower(K.named(kernel), GPU, "k", schedule=sched)


def test_using_applies_a_schedule_to_renders_in_the_block():
    want = Schedule("groups", group=64)
    with S.using(want):
        kernel, info = lower(K.named("add"), GPU, "k")
    assert kernel.schedule == want and info.local_size == (64, 1, 1)
    assert lower(K.named("add"), GPU, "k")[0].schedule != want


# -- every candidate computes the same outputs -------------------------------------------------------

def _cases(rng):
    """(kernel, inputs, output size, numpy reference, variables): odd sizes, random data."""
    M, N, Kd = 37, 29, 23
    a, b = random_array(rng, (M, Kd), np.float32), random_array(rng, (Kd, N), np.float32)
    x = random_array(rng, (M, N), np.float32)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    v = random_array(rng, 1001, np.float32)
    return {
        "matmul": (K.matmul(), [a, b], M * N, a.astype(np.float64) @ b, dict(M=M, N=N, K=Kd)),
        "sum_cols": (K.reduce_axis("sum", [None, None], 0), [x], N, x.astype(np.float64).sum(0), dict(d0=M, d1=N)),
        "sum_rows": (K.reduce_axis("sum", [None, None], 1), [x], M, x.astype(np.float64).sum(1), dict(d0=M, d1=N)),
        "softmax": (K.softmax(M, N), [x], M * N, e / e.sum(axis=1, keepdims=True), {}),
        "sum": (K.sum_all(), [v], 1, v.astype(np.float64).sum(), dict(n=1001)),
        "add": (K.add(), [x, x[::-1].copy()], M * N, x + x[::-1], dict(n=M * N)),
    }


@pytest.mark.parametrize("kernel", ["matmul", "sum_cols", "sum_rows", "softmax", "sum", "add"])
def test_every_gpu_candidate_matches_numpy(rng, kernel):
    small = dataclasses.replace(GPU, matmul_tile=(32, 32, 4, 2, 2))   # quick to interpret
    ast, ins, n_out, want, vals = _cases(rng)[kernel]
    sast = simplify(ast)
    cands = candidate_schedules(sast, small, scan_kernel(sast))
    assert len(cands) >= 2 and cands[0] == default_schedule(sast, small, scan_kernel(sast))
    cands = cands[::max(1, len(cands) // 8)]      # a spread of them: the interpreter is slow
    for sched in cands:
        kernel_, info = lower(ast, small, "k", schedule=sched)
        out = np.zeros(n_out, np.float32)
        writes = LI.run(kernel_, info, [i.reshape(-1) for i in ins] + [out], vals)
        np.testing.assert_allclose(out.reshape(np.shape(want)) if np.ndim(want) else out[0], want,
                                   rtol=2e-5, atol=2e-5, err_msg=str(sched))
        assert writes[-1].min() >= 1, f"{sched}: an output was never stored"


@pytest.mark.parametrize("kernel", ["matmul", "sum_cols", "softmax", "add"])
def test_every_cpu_candidate_matches_numpy(cpu, rng, kernel):
    renderer, compiler = cpu.pair()
    ast, ins, n_out, want, values = _cases(rng)[kernel]
    cands = candidate_schedules(simplify(ast), renderer.caps, scan_kernel(simplify(ast)))
    if kernel == "matmul":
        assert len(cands) >= 4
    for sched in cands:
        with S.using(sched):
            spec = renderer.render(ast, "k")
        assert spec.linear.schedule == sched
        prog = cpu.dev.runtime(compiler.compile(spec))
        out = cpu.empty(n_out, dtypes.float32)
        prog(*[cpu.buf(i) for i in ins], out, wait=True, **values)
        got = out.numpy()
        np.testing.assert_allclose(got.reshape(np.shape(want)) if np.ndim(want) else got[0], want,
                                   rtol=2e-5, atol=2e-5, err_msg=str(sched))


# -- split serial reductions (strategies/split_reduce.py) ---------------------------------------------

@pytest.mark.parametrize("rows,cols,split,group", [(37, 29, 8, 256), (1, 5, 4, 64), (300, 3, 16, 128), (64, 65, 2, 64)])
@pytest.mark.parametrize("dt", ["float32", "int32"])
def test_split_column_sum_matches_numpy(rng, rows, cols, split, group, dt):
    """Odd and tiny sizes, symbolic: every output stored once, by one item, from in-range loads."""
    ast = K.reduce_axis("sum", [None, None], 0, dtype=getattr(dtypes, dt))
    sched = Schedule("groups", group=group, unroll=4, split=split)
    kernel, info = lower(ast, GPU, "cols", schedule=sched)
    x = random_array(rng, (rows, cols), np.dtype(dt))
    out = np.zeros(cols, np.dtype(dt))
    writes = LI.run(kernel, info, [x.reshape(-1), out], dict(d0=rows, d1=cols))
    want = x.astype(np.float64).sum(0)
    np.testing.assert_allclose(out, want.astype(out.dtype) if dt == "int32" else want, rtol=1e-5, atol=1e-4)
    assert (writes[1] == 1).all()


def check_gemv(kernel, info, rng, B, Kd, N, values=None, tol=1e-5) -> None:
    """Interpret a lowered x[B, K] @ W[K, N] on random data against numpy; every output stored once."""
    a, w = random_array(rng, (B, Kd), np.float32), random_array(rng, (Kd, N), np.float32)
    out = np.zeros(B * N, np.float32)
    writes = LI.run(kernel, info, [a.reshape(-1), w.reshape(-1), out], values or {})
    np.testing.assert_allclose(out.reshape(B, N), a.astype(np.float64) @ w, rtol=tol, atol=tol)
    assert (writes[2] == 1).all()


@pytest.mark.parametrize("B,Kd,N", [(8, 33, 45), (3, 100, 7)])
def test_split_gemv_matches_numpy(rng, B, Kd, N):
    """x[b, :] @ W: x is read the same by a whole warp, W along its rows."""
    ast = K.matmul()
    sast = simplify(ast)
    assert default_schedule(sast, GPU, scan_kernel(sast)).mapping == "tiled"    # symbolic sizes: tiles
    kernel, info = lower(ast, GPU, "gemv", schedule=Schedule("groups", group=128, unroll=8, split=4))
    check_gemv(kernel, info, rng, B, Kd, N, dict(M=B, N=N, K=Kd))


@pytest.mark.parametrize("B,Kd,N,group,split,unrolled", [(8, 33, 45, 64, 2, False), (3, 100, 7, 128, 4, False),
                                                        (16, 9, 70, 256, 8, False), (8, 64, 45, 64, 2, True)])
def test_upcast_gemv_matches_numpy(rng, B, Kd, N, group, split, unrolled):
    """Schedule.upcast: each work-item computes all B batch rows of its column (one loop, B accumulators,
    W[k, n] loaded once for all of them, per unrolled copy); odd sizes; every output stored once."""
    ast = K.matmul(B, N, Kd)
    sched = Schedule("groups", group=group, unroll=4, split=split, upcast=B, unrolled=unrolled)
    kernel, info = lower(ast, GPU, "gemv", schedule=sched)
    w_loads = [i for i in kernel.walk() if i.kind is L.LOAD and i.src[0].kind is L.PARAM and i.src[0].arg == 1]
    assert len(w_loads) == (4 if unrolled else 1) and kernel.schedule == sched
    check_gemv(kernel, info, rng, B, Kd, N)


def test_upcast_is_a_gemv_candidate_and_refused_elsewhere():
    ast = simplify(K.matmul(8, 4096, 4096))
    ups = [c for c in candidate_schedules(ast, GPU, scan_kernel(ast))[1:] if c.upcast]
    assert ups and all(c.upcast == 8 and c.split > 1 for c in ups)
    assert Schedule.from_json(ups[0].to_json()) == ups[0]
    with pytest.raises(ValueError, match="upcast"):      # the batch depends on every load: nothing to share
        lower(K.reduce_axis("sum", [5, 7, 9], 1), GPU, "r", schedule=Schedule("groups", group=64, split=2, upcast=5))
    with pytest.raises(ValueError, match="upcast"):
        Schedule("groups", group=64, upcast=8)


@pytest.mark.parametrize("B,Kd,N", [(8, 4096, 4096), (5, 1000, 333), (2, 640, 97)])
def test_nvptx_gemv_default_is_the_upcast_split_and_correct(rng, B, Kd, N):
    """The llvm-nvptx printer's capabilities ask for the upcast split of a small batch (GEMV_UPCAST_SPLIT,
    the lowering's unroll where K is a multiple of 64); NVRTC's the same with the occupancy hint
    (GEMV_UPCAST_RESIDENT groups per SM). Both interpreted on odd sizes against numpy, every output stored once."""
    from backends.cuda.renderer import NVPTXRenderer, CUDARenderer
    from morok_py.codegen.schedule import GEMV_UPCAST_RESIDENT, GEMV_UPCAST_SPLIT, GEMV_UPCAST_WIDE
    assert NVPTXRenderer.caps.split_upcast == 8 and CUDARenderer.caps.split_upcast == 0
    nvptx = dataclasses.replace(GPU, split_upcast=8)
    ast = K.matmul(B, N, Kd)
    got = default_for(ast, nvptx)
    assert got == Schedule("groups", **GEMV_UPCAST_SPLIT, upcast=B, unrolled=Kd % 64 == 0)
    if Kd % 128 == 0:
        assert default_for(ast, GPU) == Schedule("groups", **GEMV_UPCAST_WIDE, upcast=B, unrolled=True, min_groups=1)
    else:
        assert default_for(ast, GPU) == Schedule("groups", **GEMV_UPCAST_SPLIT, upcast=B, unrolled=Kd % 64 == 0,
                                                 min_groups=GEMV_UPCAST_RESIDENT)
    for caps in (nvptx, GPU):
        check_gemv(*lower(ast, caps, "gemv"), rng, B, Kd, N, tol=1e-4)


def test_upcast_default_stays_within_the_batch_and_group_limits():
    nvptx = dataclasses.replace(GPU, split_upcast=8)
    assert default_for(K.matmul(12, 4096, 4096), nvptx).upcast == 0           # over split_upcast: no upcast
    small = dataclasses.replace(nvptx, max_threads_per_group=256)
    assert default_for(K.matmul(8, 4096, 4096), small).upcast == 0             # a 512-item group cannot launch


def _loops(items):
    from morok_py.codegen.linear import If, Loop
    for it in items:
        if isinstance(it, (Loop, If)):
            if isinstance(it, Loop):
                yield it
            yield from _loops(it.body)


@pytest.mark.parametrize("ast,shape,ins,sched,dt", [
    (lambda: K.reduce_axis("sum", [64, 37], 0), (64, 37), 1, Schedule("groups", group=64, unroll=4, split=4, unrolled=True),
     np.float32),
    (lambda: K.reduce_axis("max", [96, 5], 0, dtype=dtypes.int32), (96, 5), 1,
     Schedule("groups", group=64, unroll=4, split=8, unrolled=True), np.int32),
    (lambda: K.matmul(3, 45, 64), (3, 64, 45), 2, Schedule("groups", group=256, unroll=8, split=8, unrolled=True), np.float32),
])
def test_split_loops_unrolled_by_the_lowering(rng, ast, shape, ins, sched, dt):
    """A constant trip count that is a multiple of split x unroll: the lowering unrolls the loop itself (one
    step of split*unroll, each copy's loads at copy 0's index + a constant, no unroll hint); outputs as numpy."""
    kernel, info = lower(ast(), GPU, "u", schedule=sched)
    (loop,) = [lp for lp in _loops(kernel.body) if lp.step is not None]
    assert loop.step.arg == sched.split * sched.unroll and loop.unroll == 0
    loads = [i for i in loop.body if i.kind is L.LOAD]
    assert len(loads) == ins * sched.unroll
    for i in loads[ins:]:      # copies 1..: base index + constant
        assert i.src[1].kind is L.ALU and i.src[1].arg is Ops.ADD and i.src[1].src[1].kind is L.CONST
    if ins == 1:
        x = random_array(rng, shape, dt)
        out = np.zeros(shape[1], dt)
        writes = LI.run(kernel, info, [x.reshape(-1), out], {})
        want = x.max(0) if dt == np.int32 else x.astype(np.float64).sum(0)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        assert (writes[1] == 1).all()
    else:
        check_gemv(kernel, info, rng, *shape)


def test_h100_timed_defaults_stay_off_amd_targets():
    """row_groups and the lowering's unroll were timed on an H100 only: AMD-like caps (64-lane waves) keep
    one work-group per row and the unroll hint."""
    amd = dataclasses.replace(GPU, warp_size=64, grid_max=(2**31 - 1, 2**31 - 1, 2**31 - 1))
    assert default_for(K.softmax(1000, 50257), amd).row_groups == 0
    assert not default_for(K.reduce_axis("sum", [8192, 8192], 0), amd).unrolled
    assert default_for(K.softmax(1000, 50257), GPU).row_groups == 128


def test_unrolled_needs_a_trip_count_it_divides():
    with pytest.raises(ValueError, match="unrolled"):
        Schedule("groups", group=64, split=4, unrolled=True)
    with pytest.raises(ValueError, match="multiple"):     # 65 rows: no whole rounds of 4 x 4
        lower(K.reduce_axis("sum", [65, 37], 0), GPU, "u", schedule=Schedule("groups", group=64, unroll=4, split=4,
                                                                             unrolled=True))
    ast = simplify(K.matmul(8, 4096, 4096))
    cands = candidate_schedules(ast, GPU, scan_kernel(ast))
    assert cands[1].upcast == 8 and cands[1].unrolled                 # searched first after the default
    assert any(c.unrolled and not c.upcast for c in cands)


def test_split_refuses_kernels_with_loop_ranges_in_stores():
    with pytest.raises(ValueError, match="split"):
        lower(K.softmax(), GPU, "sm", schedule=Schedule("groups", group=256, split=8))


@pytest.mark.parametrize("key", ["nvrtc", "llvm-nvptx"])
@pytest.mark.parametrize("kernel", [lambda: K.reduce_axis("sum", [None, None], 0), lambda: K.matmul(8, 4096, 4096),
                                    lambda: K.reduce_axis("max", [None, None], 0, dtype=dtypes.float16)])
def test_split_reductions_compile_for_sm90(kernel, key):
    from conftest import cuda_compile_pair
    r, c = cuda_compile_pair(key)
    spec = r.render(kernel(), "split")
    from test_gpu_tile import cubin_resources
    res = cubin_resources(c.compile(spec).payload)
    sched = spec.linear.schedule
    # no spills; but llvm-nvptx's default upcast GEMV (512 items, so at most 128 registers) keeps a 16-byte
    # frame: that is the form timed at 49-53 us on an H100 against 87-95 for the plain split (no frame)
    frame = 16 if sched.upcast and key == "llvm-nvptx" else 0
    assert sched.split > 1 and res.get("frame", 0) <= frame, res
    if sched.min_groups and sched.upcast:
        # NVRTC's upcast GEMV: one group of 1024 (or two of 512) per SM, so ptxas may take 64 registers per item
        # (it took 32 without the hint and issued the unrolled W loads one after another: schedule.GEMV_UPCAST_WIDE)
        assert spec.linear.min_groups == sched.min_groups and 32 < res["regs"] <= 64, res
    elif sched.min_groups:
        # the occupancy hint (column reductions): 8 groups of 256 per SM, at most 32 registers per item
        assert spec.linear.min_groups == sched.min_groups == 8 and res["regs"] <= 32, res


def test_min_groups_is_a_hint_of_the_general_gpu_path():
    for bad in (dict(mapping="threads"), dict(mapping="tiled", group=256, matmul_tile=(64, 64, 8, 4, 4))):
        with pytest.raises(ValueError, match="min_groups"):
            Schedule(**bad, min_groups=2)
    sched = Schedule("groups", group=128, unroll=8, split=4, min_groups=16)
    assert Schedule.from_json(sched.to_json()) == sched and "min_groups=16" in str(sched)
    ast = simplify(K.matmul(8, 4096, 4096))
    cands = candidate_schedules(ast, GPU, scan_kernel(ast))
    assert any(c.split > 1 and not c.min_groups for c in cands) and any(c.min_groups for c in cands)


# -- rows walked by a fixed number of work-groups (Schedule.row_groups) ----------------------------------

def _softmax_ref(x):
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("rows,cols,n", [(37, 130, 8), (3, 130, 8), (37, 1, 16), (5, 67, 1)])
@pytest.mark.parametrize("static", [True, False], ids=["static", "symbolic"])
@pytest.mark.parametrize("row_cache", [False, True], ids=["", "row_cache"])
def test_row_groups_softmax_matches_numpy(rng, rows, cols, n, static, row_cache):
    """Fewer work-groups than rows (and more), odd sizes, symbolic counts: every output stored once."""
    if row_cache and not static:
        pytest.skip("the row cache needs a constant row length")
    ast = K.softmax(rows, cols) if static else K.softmax()
    sched = Schedule("group_per_row", reduce="group", group=64, row_cache=row_cache, row_groups=n)
    kernel, info = lower(ast, GPU, "sm", schedule=sched)
    assert kernel.schedule == sched and str(sched).endswith(f"row_groups={n})")
    x = random_array(rng, (rows, cols), np.float32)
    out = np.zeros(rows * cols, np.float32)
    writes = LI.run(kernel, info, [x.reshape(-1), out], {} if static else dict(rows=rows, cols=cols))
    np.testing.assert_allclose(out.reshape(rows, cols), _softmax_ref(x), rtol=2e-5, atol=1e-6)
    assert (writes[1] == 1).all()
    assert info.launch_dims({} if static else dict(rows=rows, cols=cols))[0][0] == min(rows, n)


def test_row_groups_row_max_and_refusals(rng):
    """One output per row (stored by item 0 of the group walking it); a kernel without rows refuses."""
    sched = Schedule("group_per_row", reduce="group", group=32, row_groups=4)
    kernel, info = lower(K.row_max(), GPU, "rm", schedule=sched)
    x = random_array(rng, (11, 45), np.float32)
    out = np.zeros(11, np.float32)
    writes = LI.run(kernel, info, [x.reshape(-1), out], dict(d0=11, d1=45))
    np.testing.assert_array_equal(out, x.max(axis=1))
    assert (writes[1] == 1).all()
    with pytest.raises(ValueError, match="row_groups"):
        lower(K.sum_all(), GPU, "s", schedule=Schedule("group_per_row", reduce="group", group=64, row_groups=8))
    with pytest.raises(ValueError, match="row_groups"):
        Schedule("group_per_row", reduce="grid", group=64, row_groups=8)
    assert Schedule.from_json(sched.to_json()) == sched


def test_row_groups_candidates_for_vocabulary_rows():
    ast = simplify(K.softmax(1000, 50257))
    cands = candidate_schedules(ast, GPU, scan_kernel(ast))
    assert cands[0].row_groups == 128
    assert {(c.group, c.row_groups) for c in cands if c.row_groups} >= {(256, 64), (1024, 256)}
    assert any(not c.row_groups for c in cands)      # one work-group per row stays a candidate


@pytest.mark.parametrize("key", ["nvrtc", "llvm-nvptx"])
def test_vocabulary_softmax_compiles_for_sm90(key):
    cuda = pytest.importorskip("morok_py.backends.cuda", reason="the cuda extra is not installed")
    pairs = {c.cache_key: (r, c) for r, c in cuda.compile_only_pairs("sm_90")}
    if key not in pairs or pairs[key][1].available() is not None:
        pytest.skip(f"{key} is not usable here")
    r, c = pairs[key]
    spec = r.render(K.softmax(1000, 50257), "softmax")
    assert spec.linear.schedule.row_groups == 128
    assert c.compile(spec).payload


# -- on a device (the CPU here; CUDA/ROCm where present) -------------------------------------------------

@pytest.mark.parametrize("rows,cols", [(1000, 50257), (129, 50001)])
def test_vocabulary_softmax_on_the_device(device, rng, rows, cols):
    x = random_array(rng, (rows, cols), np.float32)
    out = device.empty(rows * cols, dtypes.float32)
    device.compile(K.softmax(rows, cols))(device.buf(x), out)
    np.testing.assert_allclose(out.numpy().reshape(rows, cols), _softmax_ref(x), rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("rows,cols", [(8192, 37), (1001, 3000), (3, 5)])
def test_column_sum_on_the_device(device, rng, rows, cols):
    x = random_array(rng, (rows, cols), np.float32)
    out = device.empty(cols, dtypes.float32)
    device.compile(K.reduce_axis("sum", [None, None], 0))(device.buf(x), out, d0=rows, d1=cols)
    np.testing.assert_allclose(out.numpy(), x.astype(np.float64).sum(0), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("B,Kd,N", [(8, 4096, 4096), (3, 1001, 77)])
def test_small_batch_gemv_on_the_device(device, rng, B, Kd, N):
    a, w = random_array(rng, (B, Kd), np.float32), random_array(rng, (Kd, N), np.float32)
    out = device.empty(B * N, dtypes.float32)
    device.compile(K.matmul(B, N, Kd))(device.buf(a), device.buf(w), out)
    np.testing.assert_allclose(out.numpy().reshape(B, N), a.astype(np.float64) @ w, rtol=1e-4, atol=2e-3)


@pytest.mark.parametrize("kernel", ["sum_cols", "softmax", "matmul"])
def test_search_on_the_device_keeps_outputs_right(device, rng, tmp_path, monkeypatch, kernel):
    """A short search per kernel: the stored winner gives numpy's answer on odd sizes."""
    from morok_py import cache
    monkeypatch.setenv("MOROK_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv("MOROK_CACHE", raising=False)
    ast, ins, n_out, want, values = _cases(rng)[kernel]
    res = cache.beam_search(device.dev, ast, "searched", beam=6, values=values, compiler=device.compiler,
                            seconds=30)
    assert str(res.schedule) in res.times and not [w for w in res.rejected.values() if "differ" in w]
    cache.clear_memory_caches()
    hits = cache.stats.schedule_hits
    prog = device.compile(ast, "searched")
    assert cache.stats.schedule_hits == hits + 1
    out = device.empty(n_out, dtypes.float32)
    prog(*[device.buf(i) for i in ins], out, **(values or {}))
    got = out.numpy()
    np.testing.assert_allclose(got.reshape(np.shape(want)) if np.ndim(want) else got[0], want, rtol=2e-5, atol=2e-5)


# -- CPU column reductions that stream rows (opt.stream_columns) ----------------------------------------

@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("dt", ["float32", "int32"])
@pytest.mark.parametrize("rows,cols,block", [(37, 2 * 128 + 37, 128), (5, 3, 1024), (300, 256, 128)])
def test_streamed_column_reduction_matches_numpy(cpu, rng, op, dt, rows, cols, block):
    """Full blocks split over the threads, the tail once; symbolic sizes."""
    renderer, compiler = cpu.pair()
    ast = K.reduce_axis(op, [None, None], 0, dtype=getattr(dtypes, dt))
    with S.using(Schedule("threads", reduce="stream", stream_block=block)):
        spec = renderer.render(ast, "cols")
    prog = cpu.dev.runtime(compiler.compile(spec))
    x = random_array(rng, (rows, cols), np.dtype(dt))
    out = cpu.empty(cols, getattr(dtypes, dt))
    prog(cpu.buf(x), out, wait=True, d0=rows, d1=cols)
    want = x.astype(np.float64).sum(0) if op == "sum" else x.max(0)
    np.testing.assert_allclose(out.numpy(), want.astype(out.numpy().dtype) if dt == "int32" else want,
                               rtol=1e-5, atol=1e-4)


def test_a_column_mean_is_not_streamed(cpu):
    """The output holds the running value, so an epilogue (x / n) keeps the register tile."""
    caps = cpu_caps(cpu)
    assert default_for(K.reduce_axis("sum", [None, None], 0), caps).reduce == "stream"
    mean = default_for(K.reduce_axis("mean", [None, None], 0), caps)
    assert mean.reduce == "serial" and mean.register_tile == (1, 2 * caps.register_tile[1])   # one row of columns
    with pytest.raises(ValueError, match="column reduction"):
        lower(K.reduce_axis("mean", [None, None], 0), caps, "m", schedule=Schedule("threads", reduce="stream",
                                                                                     stream_block=64))


@pytest.mark.parametrize("N", [10, 5, 13])
def test_a_narrow_static_matmul_gets_a_power_of_two_tile_and_a_remainder(cpu, rng, N):
    """N below the target's tile width: the largest power-of-two width <= N plus remainder columns
    (2/3 of the rows: with lane vectors the remainder is one more vector per tile row)."""
    caps = cpu_caps(cpu)
    M, Kd = 37, 23
    sched = default_for(K.matmul(M, N, Kd), caps)
    w = 1 << (N.bit_length() - 1)
    rows = max(1, caps.register_tile[0] * 2 // 3) if 4 * (N - w) <= w else caps.register_tile[0]
    assert sched.register_tile == (rows, w)
    a, b = random_array(rng, (M, Kd), np.float32), random_array(rng, (Kd, N), np.float32)
    out = cpu.empty(M * N, dtypes.float32)
    cpu.compile(K.matmul(M, N, Kd))(cpu.buf(a), cpu.buf(b), out, wait=True)
    np.testing.assert_allclose(out.numpy().reshape(M, N), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)


def _every_family(dt):
    return {"matmul": K.matmul(4096, 4096, 4096, dtype=dt), "matmul_sym": K.matmul(dtype=dt),
            "matmul_odd": K.matmul(4000, 3001, 1023, dtype=dt), "gemv8": K.matmul(8, 4096, 4096, dtype=dt),
            "sum_cols": K.reduce_axis("sum", [8192, 8192], 0, dtype=dt), "softmax": K.softmax(1000, 50257),
            "sum": K.sum_all(), "add": K.add()}


@pytest.mark.parametrize("target", ["cpu", "sm_75", "sm_80", "sm_90", "sm_90a", "gfx90a", "gfx1100"])
@pytest.mark.parametrize("dt", ["float32", "int32", "float16"])
def test_the_default_schedule_is_the_first_candidate(cpu, target, dt):
    """A search times cands[0] as the default, the one a candidate must beat by SWITCH_MARGIN. The flipped
    cp.async fill of the tiled matmul (targets with async copies) was inserted before it: the H100's static
    4096^3 search then kept the register fill, 1.6% slower by its own timings (benchmarks/search_context.py)."""
    from morok_py.backends.cuda.renderer import cuda_caps
    from morok_py.backends.rocm.renderer import capabilities as rocm_caps
    caps = (cpu.pair()[0].caps if target == "cpu" else cuda_caps(target) if target.startswith("sm_")
            else rocm_caps(target))
    flipped_seen = False
    for name, ast in _every_family(getattr(dtypes, dt)).items():
        if dt != "float32" and name in ("softmax", "sum", "add"):
            continue
        sast = simplify(ast)
        scan = scan_kernel(sast)
        base = default_schedule(sast, caps, scan)
        cands = candidate_schedules(sast, caps, scan)
        assert cands[0] == base, (name, cands[:3])
        assert len(set(cands)) == len(cands)
        if base.mapping == "tiled" and base.tensor_core is None and caps.async_copy:
            assert cands[1] == dataclasses.replace(base, async_fill=not base.async_fill), name
            flipped_seen = True
    if target in ("sm_80", "sm_90", "sm_90a") and dt != "float16":
        assert flipped_seen        # the case the test is about was reached


_LOADED = r"""
import json, os, sys
from morok_py import Device
import morok_py.codegen.schedule
GPU = ("morok_py.codegen.strategies.matrix_units", "morok_py.codegen.strategies.wgmma",
       "morok_py.codegen.strategies.permute", "morok_py.codegen.strategies.small_shapes")
before = [m for m in GPU if m in sys.modules]
Device[sys.argv[1]]
print(json.dumps({"before": before, "after": [m for m in GPU if m in sys.modules]}))
"""


@pytest.mark.parametrize("device", ["CPU", "CUDA"])
def test_a_gpu_device_loads_the_schedules_strategies_when_it_opens(device):
    """Opening a GPU device imports the strategy modules its default schedule consults (a process's first
    compile, often a disk-cache hit, then does not load them inside the call); the CPU's never does. CUDA
    runs here as a compile-only device (MOROK_CUDA_ARCH) where there is no driver."""
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, MOROK_CUDA_ARCH="sm_90a")
    out = subprocess.run([sys.executable, "-c", _LOADED, device], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == []
    assert len(got["after"]) == (4 if device == "CUDA" else 0), got
