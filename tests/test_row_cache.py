"""The row cache (codegen/strategies/row_cache.py) keeps a row that several passes of a group-per-row
kernel read in shared memory. Loads of two buffers at the same index are two rows: an index table and the
values it selects (a scatter with a reduction, Resize's linear taps) must not share one array. Checked by
interpreting the kernel lowered with each CUDA renderer's options (no GPU needed), and on the device
(marked `cuda`)."""
from __future__ import annotations

import numpy as np
import pytest

from morok_py import AxisType, Ops, UOp, dtypes
from morok_py.codegen.lower import lower
from morok_py.codegen.scan import scan_kernel
from morok_py.codegen.strategies.row_cache import row_cache_plan
from morok_py.codegen.symbolic import simplify

import linear_interp as LI
from conftest import PAIRS, open_target, random_array

CUDA_PAIRS = ["nvrtc", "llvm-nvptx"]
P, U = 37, 301          # output elements, updates (odd sizes)


def scatter_max():
    """out[p] = max(data[p], max over u with ind[u] == p of upd[u]): ind[u] and upd[u] share an index."""
    data, ind, upd, out = (UOp.param(0, dtypes.float32), UOp.param(1, dtypes.int32),
                           UOp.param(2, dtypes.float32), UOp.param(3, dtypes.float32))
    p, u = UOp.range(P, 0), UOp.range(U, 1, AxisType.REDUCE)
    hit = ind.load(u).cast(dtypes.index) == p
    v = hit.where(upd.load(u), UOp.const(float("-inf"), dtypes.float32)).reduce(u, op=Ops.MAX)
    return UOp.sink(out.store(p, data.load(p).maximum(v)))


def scatter_sum_times_max():
    """out[p] = (sum of the hits' upd) * (max of the hits' upd), two passes over ind and upd: both rows are
    read twice, so both are cached, each in its own array."""
    ind, upd, out = UOp.param(0, dtypes.int32), UOp.param(1, dtypes.float32), UOp.param(2, dtypes.float32)
    p = UOp.range(P, 0)
    u1, u2 = UOp.range(U, 1, AxisType.REDUCE), UOp.range(U, 2, AxisType.REDUCE)
    s = (ind.load(u1).cast(dtypes.index) == p).where(upd.load(u1), UOp.const(0.0, dtypes.float32)).reduce(u1)
    m = (ind.load(u2).cast(dtypes.index) == p).where(
        upd.load(u2), UOp.const(float("-inf"), dtypes.float32)).reduce(u2, op=Ops.MAX)
    return UOp.sink(out.store(p, s * m))


def indices(rng):
    ind = rng.integers(0, P, U).astype(np.int32)
    ind[:P] = rng.permutation(P)           # every output is hit at least once, many more than once
    return ind


def want_max(data, ind, upd):
    out = data.copy()
    np.maximum.at(out, ind, upd)
    return out


def want_sum_times_max(ind, upd):
    s, m = np.zeros(P, np.float64), np.full(P, -np.inf)
    np.add.at(s, ind, upd.astype(np.float64))
    np.maximum.at(m, ind, upd.astype(np.float64))
    return s * m


def cuda_renderer(key: str):
    cuda = pytest.importorskip("morok_py.backends.cuda", reason="the cuda extra is not installed")
    return {c.cache_key: r for r, c in cuda.compile_only_pairs("sm_90")}[key]


def test_loads_of_two_buffers_at_one_index_are_two_rows():
    ast = simplify(scatter_sum_times_max())
    plan = row_cache_plan(ast, [r for r in ast.toposort() if r.op is Ops.RANGE and r.arg[-1] is AxisType.GLOBAL],
                          scan_kernel(ast))
    keys = {}
    for load, (_, key) in plan.items():
        keys.setdefault(key, set()).add(load.src[0].arg)
    assert sorted(keys.values(), key=min) == [{0}, {1}]     # ind's row and upd's row, apart
    ast = simplify(scatter_max())
    assert not row_cache_plan(ast, [r for r in ast.toposort() if r.op is Ops.RANGE and r.arg[-1] is AxisType.GLOBAL],
                              scan_kernel(ast))              # each row read once: nothing to cache


@pytest.mark.parametrize("key", CUDA_PAIRS)
def test_interpreted_scatter_max_matches_numpy(rng, key):
    r = cuda_renderer(key)
    kernel, info = lower(scatter_max(), r.caps, "scatter_max", r.decompositor())
    assert kernel.schedule.mapping == "group_per_row"
    data, ind, upd = random_array(rng, P, np.float32), indices(rng), random_array(rng, U, np.float32)
    out = np.zeros(P, np.float32)
    writes = LI.run(kernel, info, [data, ind, upd, out])
    np.testing.assert_array_equal(out, want_max(data, ind, upd))
    assert (writes[3] == 1).all()


@pytest.mark.parametrize("key", CUDA_PAIRS)
def test_interpreted_two_cached_rows_match_numpy(rng, key):
    r = cuda_renderer(key)
    kernel, info = lower(scatter_sum_times_max(), r.caps, "scatter_sum_max", r.decompositor())
    assert kernel.schedule.mapping == "group_per_row" and kernel.schedule.row_cache
    ind, upd = indices(rng), random_array(rng, U, np.float32)
    out = np.zeros(P, np.float32)
    LI.run(kernel, info, [ind, upd, out])
    np.testing.assert_allclose(out, want_sum_times_max(ind, upd), rtol=1e-5, atol=1e-5)


CUDA_DEVICE_PAIRS = [p for p in PAIRS if p.id in ("CUDA-nvrtc", "CUDA-llvm-nvptx")]


@pytest.fixture(params=CUDA_DEVICE_PAIRS)
def gpu(request):
    return open_target(*request.param)


def test_device_scatter_max_matches_numpy(gpu, rng):
    data, ind, upd = random_array(rng, P, np.float32), indices(rng), random_array(rng, U, np.float32)
    out = gpu.empty(P, dtypes.float32)
    gpu.compile(scatter_max())(gpu.buf(data), gpu.buf(ind), gpu.buf(upd), out)
    np.testing.assert_array_equal(out.numpy(), want_max(data, ind, upd))


def test_device_two_cached_rows_match_numpy(gpu, rng):
    ind, upd = indices(rng), random_array(rng, U, np.float32)
    out = gpu.empty(P, dtypes.float32)
    gpu.compile(scatter_sum_times_max())(gpu.buf(ind), gpu.buf(upd), out)
    np.testing.assert_allclose(out.numpy(), want_sum_times_max(ind, upd), rtol=1e-5, atol=1e-5)
