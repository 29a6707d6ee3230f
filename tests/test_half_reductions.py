"""float16 and bfloat16 reductions on a GPU load 16 bytes per access (the target: half kernels keep >= 0.9x
the float32 bytes/s, benchmarks/half_bandwidth.py). The grid reduction (a whole-array sum) and the group reduction (a row max) stride
their work-items over the reduced range in chunks of 8 halves, one 16-byte vector load per chunk
(`GroupReduce.vector_reduce_plan`), the lanes combined in the float32 accumulator; the tail, and rows
whose start is no multiple of 8, take the scalar strided loop. float32 reductions keep their scalar
loop. Checked by rendering and compiling for the GPU pairs and by running the lowered programs in the
test interpreter against numpy on odd, misaligned and symbolic sizes, NaN and inf rows included."""
from __future__ import annotations

import numpy as np
import pytest

import linear_interp as LI
from conftest import random_array
from test_gpu_lowering import renderers
from morok_py import dtypes
from morok_py import kernels as K
from morok_py.codegen.linear import If, L, Loop
from morok_py.dtypes import to_numpy

HALVES = ["float16", "bfloat16"]
PAIRS = ["nvrtc", "llvm-nvptx", "llvm-amdgpu"]


def _instrs(items):
    for it in items:
        if isinstance(it, Loop):
            yield it.var
            yield from _instrs(it.body)
        elif isinstance(it, If):
            yield from _instrs(it.body)
        else:
            yield it


def _global_load_widths(linear) -> list[tuple[str, int]]:
    """(dtype, width) of every load from a kernel parameter."""
    return [(i.dtype.name, i.arg or 1) for i in _instrs(linear.body)
            if i.kind is L.LOAD and i.src[0].kind is L.PARAM]


def _kernels(d):
    return {"sum": K.sum_all(dtype=d), "sum_static": K.sum_all(1003, dtype=d),
            "row_max": K.row_max(dtype=d), "row_max_static": K.row_max(7, 1001, dtype=d)}


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("pair", range(3), ids=PAIRS)
def test_half_reductions_load_16_bytes(pair, dt):
    r, c = renderers()[pair]
    d = getattr(dtypes, dt)
    for name, ast in _kernels(d).items():
        spec = r.render(ast, f"{name}_{dt}")
        assert spec.linear.schedule.reduce == ("grid" if name.startswith("sum") else "group"), spec.linear.schedule
        widths = _global_load_widths(spec.linear)
        # the input: one 8-wide (16-byte) load in the chunk loop, one scalar load in the tail loop
        assert (dt, 8) in widths and (dt, 1) in widths, (name, widths)
        assert all(w in (1, 8) for _, w in widths), widths
        llvm_t = "half" if dt == "float16" else "bfloat"
        assert "uint4 " in spec.src or f"<8 x {llvm_t}>" in spec.src or "<8 x i16>" in spec.src, spec.src[:4000]
        if c.available() is None:       # sm_90 with its resources: test_half_reductions_compile_for_sm90
            assert c.compile(spec).payload
    # float32 is unchanged: its scalar loads already move as many bytes per load as the halves' scalar
    # loads did twice over; the halves now move 16 bytes per load
    for name, ast in _kernels(dtypes.float32).items():
        assert all(w == 1 for _, w in _global_load_widths(r.render(ast, name).linear)), name


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("key", ["nvrtc", "llvm-nvptx"])
def test_half_reductions_compile_for_sm90(key, dt):
    from conftest import cuda_compile_pair
    r, c = cuda_compile_pair(key)
    from test_gpu_tile import cubin_resources
    for name, ast in _kernels(getattr(dtypes, dt)).items():
        spec = r.render(ast, f"{name}_{dt}")
        res = cubin_resources(c.compile(spec).payload)
        assert res.get("frame", 0) == 0, (name, res)       # no spills: the 8 lanes fit in registers


def _half(x: np.ndarray, dt: str) -> np.ndarray:
    return x.astype(to_numpy(getattr(dtypes, dt)))


def _as_f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1003, 2048 + 5, 70001])
@pytest.mark.parametrize("static", [False, True], ids=["symbolic", "static"])
def test_half_sum_in_the_interpreter(dt, n, static, rng):
    r, _ = renderers()[0]
    spec = r.render(K.sum_all(n if static else None, dtype=getattr(dtypes, dt)), f"sum_{dt}")
    x = _half(random_array(rng, n, np.float32), dt)
    out = np.zeros(1, x.dtype)
    writes = LI.run(spec.linear, spec.launch, [x, out], {} if static else {"n": n})
    assert writes[1].tolist() == [1]
    want = _as_f32(x).astype(np.float64).sum()
    tol = 2.0 ** -10 if dt == "float16" else 2.0 ** -7      # the result's rounding to the half type
    np.testing.assert_allclose(_as_f32(out)[0], want, rtol=tol, atol=1e-2)


@pytest.mark.parametrize("dt", HALVES)
def test_half_sum_accumulates_in_float32(dt):
    """4099 ones: a half accumulator would stop at 2048 (float16) or 256 (bfloat16)."""
    r, _ = renderers()[0]
    spec = r.render(K.sum_all(dtype=getattr(dtypes, dt)), f"ones_{dt}")
    x = _half(np.ones(4099, np.float32), dt)
    out = np.zeros(1, x.dtype)
    LI.run(spec.linear, spec.launch, [x, out], {"n": 4099})
    assert _as_f32(out)[0] == _as_f32(_half(np.array([4099.0], np.float32), dt))[0]


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("shape", [(1, 1), (2, 8), (4, 64), (3, 1003), (5, 17), (9, 2051), (2, 4096)])
@pytest.mark.parametrize("static", [False, True], ids=["symbolic", "static"])
def test_half_row_max_in_the_interpreter(dt, shape, static, rng):
    """Aligned rows take the 16-byte loads, misaligned ones (cols not a multiple of 8) the scalar loop;
    NaN rows give NaN, inf and -inf rows their extreme, exactly as numpy."""
    rows, cols = shape
    r, _ = renderers()[0]
    spec = r.render(K.row_max(rows, cols, dtype=getattr(dtypes, dt)) if static
                    else K.row_max(dtype=getattr(dtypes, dt)), f"rmax_{dt}")
    x = random_array(rng, shape, np.float32)
    if rows > 2:
        x[1, cols // 2] = np.nan
        x[2, cols - 1] = np.inf
    if rows > 4:
        x[3, :] = -np.inf
        x[4, 0] = np.nan
    a = _half(x, dt)
    out = np.zeros(rows, a.dtype)
    writes = LI.run(spec.linear, spec.launch, [a.ravel(), out], {} if static else {"d0": rows, "d1": cols})
    assert (writes[1] == 1).all()
    np.testing.assert_array_equal(_as_f32(out), _as_f32(a).max(axis=1))


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("sched", [dict(reduce="group", group=32, row_groups=4), dict(reduce="group", group=64)],
                         ids=["row_groups", "group64"])
def test_half_row_max_under_other_group_schedules(dt, sched, rng):
    """Rows walked by fewer work-groups (Schedule.row_groups) and smaller groups take the same chunks."""
    from morok_py.codegen.lower import lower
    from morok_py.codegen.schedule import Schedule
    r, _ = renderers()[0]
    s = Schedule("group_per_row", **sched)
    kernel, info = lower(K.row_max(dtype=getattr(dtypes, dt)), r.caps, "rm", schedule=s)
    assert (dt, 8) in _global_load_widths(kernel)
    for rows, cols in ((11, 45), (9, 64), (6, 1001)):
        a = _half(random_array(rng, (rows, cols), np.float32), dt)
        a[2, 3] = np.nan
        out = np.zeros(rows, a.dtype)
        writes = LI.run(kernel, info, [a.ravel(), out], dict(d0=rows, d1=cols))
        assert (writes[1] == 1).all()
        np.testing.assert_array_equal(_as_f32(out), _as_f32(a).max(axis=1))


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("group", [32, 128])
def test_half_grid_sum_under_other_groups(dt, group, rng):
    from morok_py.codegen.lower import lower
    from morok_py.codegen.schedule import Schedule
    r, _ = renderers()[0]
    kernel, info = lower(K.sum_all(dtype=getattr(dtypes, dt)), r.caps, "s",
                         schedule=Schedule("group_per_row", reduce="grid", group=group))
    assert (dt, 8) in _global_load_widths(kernel)
    for n in (5, 8 * group + 3, 20011):
        x = _half(random_array(rng, n, np.float32), dt)
        out = np.zeros(1, x.dtype)
        LI.run(kernel, info, [x, out], {"n": n})
        tol = 2.0 ** -10 if dt == "float16" else 2.0 ** -7
        np.testing.assert_allclose(_as_f32(out)[0], _as_f32(x).astype(np.float64).sum(), rtol=tol, atol=1e-2)
