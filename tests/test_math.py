"""The math a graph executor needs -- tanh, sigmoid, erf, pow, floor, ceil, round (half to even), isnan,
isinf, abs -- and MIN reductions, against numpy/math computed in float64.

They are UOp methods composed of IR ops, so every renderer gets them: run on the CPU here, rendered and
compiled for both CUDA pairs and for AMDGPU without a GPU, and run on a GPU by the `cuda`-marked tests.

Tolerances (relative, with an absolute floor near zero): float32 1e-5 / 1e-6, float64 1e-12 / 1e-300,
float16 2e-3 / 1e-4 (a half ulp is 4.9e-4). floor, ceil, round, isnan, isinf, abs are exact.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from morok_py import AxisType, Buffer, Ops, UOp, dtypes, kernels as K
from morok_py.dtypes import from_numpy

from conftest import amdgpu_llvm_pair, open_target, random_array

EDGES = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-30, -1e-30, 1e-40, -1e-40, 1e-310, 1e30, -1e30,
         0.5, -0.5, 1.5, 2.5, -2.5, 0.3, -0.3, 0.1, 1.0, -1.0, 0.9999, 1.0001, 4.0, -4.0, 6.0, 1e5, 8388609.0]
TOL = {np.float32: (1e-5, 1e-6), np.float64: (1e-12, 1e-300), np.float16: (2e-3, 1e-4)}
EXACT = ("floor", "ceil", "round", "isnan", "isinf", "abs")


def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _sigmoid(x):
    with np.errstate(over="ignore"):
        return np.where(x >= 0, 1 / (1 + np.exp(-np.abs(x))), np.exp(-np.abs(x)) / (1 + np.exp(-np.abs(x))))


UNARY_REF = {"tanh": np.tanh, "sigmoid": _sigmoid, "erf": _erf, "floor": np.floor, "ceil": np.ceil,
             "round": np.rint, "isnan": np.isnan, "isinf": np.isinf, "abs": np.abs, "log1p": np.log1p}


def sweep(dtype, n=20011) -> np.ndarray:
    """A dense sweep of [-30, 30] (n points: not a multiple of any vector width) plus the edge values."""
    with np.errstate(over="ignore"):
        return np.concatenate([np.linspace(-30, 30, n), EDGES]).astype(dtype)


def assert_matches(got, want, dtype, exact=False):
    """want is the float64 reference; NaN where NaN, inf where inf, zeros with their sign."""
    got, want = np.asarray(got), np.asarray(want)
    if want.dtype == np.bool_:
        np.testing.assert_array_equal(got, want)
        return
    g = got.astype(np.float64)
    with np.errstate(over="ignore"):
        w = want.astype(dtype).astype(np.float64)      # the reference rounded to the output type
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    inf = np.isinf(w)
    np.testing.assert_array_equal(g[inf], w[inf])
    zero = w == 0
    if exact:
        np.testing.assert_array_equal(np.signbit(g[zero]), np.signbit(w[zero]))
    fin = np.isfinite(w)
    rtol, atol = (0, 0) if exact else TOL[np.dtype(dtype).type]
    np.testing.assert_allclose(g[fin], want[fin], rtol=rtol, atol=atol)


def run_unary(target, fn, x):
    dt = from_numpy(x.dtype)
    prog = target.compile(K.unary(fn, dtype=dt), name=f"math_{fn}")
    out = target.empty(x.size, dtypes.bool if fn in ("isnan", "isinf") else dt)
    prog(target.buf(x), out, n=x.size)
    return out.numpy()


def run_pow(target, x, y):
    a, b = UOp.param(0, from_numpy(x.dtype)), UOp.param(1, from_numpy(y.dtype))
    i = UOp.range(UOp.variable("n", 1, 1 << 30), 0)
    v = a.load(i).pow(b.load(i))
    out = target.empty(x.size, v.dtype)
    target.compile(UOp.sink(UOp.param(2, v.dtype).store(i, v)), name="math_pow")(target.buf(x), target.buf(y), out,
                                                                                  n=x.size)
    return out.numpy()


def pow_ref(x, y):
    with np.errstate(all="ignore"):
        return np.power(x.astype(np.float64), y.astype(np.float64))


def pow_cases(dtype, rng, n=1003):
    """(label, base, exponent) arrays: random float exponents, integer-valued ones (float and int32),
    results near the float32 range's ends, and every pair of special values."""
    x = rng.uniform(-30, 30, n).astype(dtype)
    yi = rng.integers(-10, 11, n)
    special = np.array([0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 3.0, -3.0, math.inf, -math.inf, math.nan,
                        1e-30, 1e30, -1e30, 2.5, -2.5, 1e-40])
    sx, sy = np.array(list(itertools.product(special, special))).T
    with np.errstate(over="ignore"):
        return [("float", x, rng.uniform(-4, 4, n).astype(dtype)),
                ("integer-valued", x, yi.astype(dtype)),
                ("int32", x, yi.astype(np.int32)),
                ("large", rng.uniform(0.01, 100, n).astype(dtype), rng.uniform(-19, 19, n).astype(dtype)),
                ("special", sx.astype(dtype), sy.astype(dtype))]


# ---- CPU: elementwise math ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("fn", list(UNARY_REF))
def test_unary_math_matches_numpy_on_a_sweep_and_edge_values(cpu, fn, dtype):
    x = sweep(dtype)
    want = UNARY_REF[fn](x.astype(np.float64))
    assert_matches(run_unary(cpu, fn, x), want, dtype, exact=fn in EXACT)


@pytest.mark.parametrize("fn", ["tanh", "erf"])
def test_odd_functions_keep_the_sign_of_zero_and_tiny_values(cpu, fn):
    x = np.array([-0.0, 0.0, -1e-30, 1e-30, -1e-40, 1e-40], dtype=np.float32)
    got = run_unary(cpu, fn, x)
    assert list(np.signbit(got)) == [True, False, True, False, True, False]
    np.testing.assert_allclose(got[2:4], UNARY_REF[fn](x[2:4].astype(np.float64)), rtol=1e-6)


def test_tanh_sigmoid_erf_saturate_without_nan(cpu):
    x = np.array([-1e30, -200.0, -89.0, -30.0, 30.0, 89.0, 200.0, 1e30, -math.inf, math.inf], dtype=np.float32)
    np.testing.assert_array_equal(run_unary(cpu, "tanh", x), np.tanh(x.astype(np.float64)).astype(np.float32))
    np.testing.assert_array_equal(run_unary(cpu, "erf", x), np.sign(x))
    s = run_unary(cpu, "sigmoid", x)
    assert not np.isnan(s).any() and (s[x > 0] == 1.0).all()
    np.testing.assert_allclose(s, _sigmoid(x.astype(np.float64)), rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: d.__name__)
def test_log1p_keeps_relative_accuracy_near_zero(cpu, dtype):
    """log(1 + x) would lose everything below eps: the tail of softplus/Mish (log1p(exp(x)), x << 0)."""
    x = np.concatenate([np.geomspace(1e-30, 0.5, 4001), -np.geomspace(1e-30, 0.5, 4001),
                        np.exp(np.linspace(-80, 0, 2001)), [0.0099, 0.01, 0.0101, -0.0099, -0.01, -1.0, 1e30,
                                                            np.inf, -np.inf, np.nan, -2.0]]).astype(dtype)
    with np.errstate(all="ignore"):
        want = np.log1p(x.astype(np.float64))
    assert_matches(run_unary(cpu, "log1p", x), want, dtype)


def test_round_is_half_to_even_like_numpy(cpu):
    x = np.arange(-10.5, 10.6, 0.5, dtype=np.float32)
    np.testing.assert_array_equal(run_unary(cpu, "round", x), np.rint(x))
    big = np.array([8388607.5, -8388607.5, 8388608.0, 16777217.0, 0.49999997, -0.49999997], dtype=np.float32)
    np.testing.assert_array_equal(run_unary(cpu, "round", big), np.rint(big))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16], ids=lambda d: d.__name__)
def test_pow_matches_numpy_for_every_kind_of_exponent(cpu, rng, dtype):
    for label, x, y in pow_cases(dtype, rng):
        got = run_pow(cpu, x, y)
        assert got.dtype == dtype, label
        assert_matches(got, pow_ref(x, y), dtype)


@pytest.mark.parametrize("exponent", [0, 1, 2, 3, -1, -2, 5, 16, -16, 17, 0.5, -0.5, 2.5, 1 / 3, 1e-3, 40.0,
                                      math.inf, -math.inf, math.nan])
def test_pow_with_a_constant_exponent(cpu, exponent):
    x = np.concatenate([np.linspace(-30, 30, 1003), [0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0, 1e-30,
                                                     0.5, -0.5]]).astype(np.float32)
    xs = UOp.param(0, dtypes.float32)
    i = UOp.range(UOp.variable("n", 1, 1 << 30), 0)
    ast = UOp.sink(UOp.param(1, dtypes.float32).store(i, xs.load(i).pow(exponent)))
    out = cpu.empty(x.size, dtypes.float32)
    cpu.compile(ast, name="pow_const")(cpu.buf(x), out, n=x.size)
    assert_matches(out.numpy(), pow_ref(x, np.full_like(x, exponent)), np.float32)


def test_pow_operator_and_kernels_binary(cpu, rng):
    x = rng.uniform(0.1, 3, 1003).astype(np.float32)
    y = rng.uniform(-3, 3, 1003).astype(np.float32)
    out = cpu.empty(1003, dtypes.float32)
    cpu.compile(K.binary("pow"))(cpu.buf(x), cpu.buf(y), out, n=1003)
    assert_matches(out.numpy(), pow_ref(x, y), np.float32)
    a = UOp.param(0, dtypes.float32).load(UOp.range(3, 0))
    assert (a ** 2).op is Ops.MUL and (2.0 ** a).dtype == dtypes.float32


def test_int_inputs_compute_in_float32(cpu):
    x = np.array([-3, -1, 0, 2, 7], dtype=np.int32)
    for fn in ("tanh", "sigmoid", "erf"):
        k = K.unary(fn, dtype=dtypes.int32)
        out = cpu.empty(5, dtypes.float32)
        cpu.compile(k)(cpu.buf(x), out, n=5)
        np.testing.assert_allclose(out.numpy(), UNARY_REF[fn](x.astype(np.float64)), rtol=1e-5, atol=1e-6)
    assert UOp.param(0, dtypes.int32).load(0).floor().dtype == dtypes.int32


# ---- MIN reductions --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.float64, np.int8, np.uint16, np.bool_],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("axis", [0, 1])
def test_min_reduction_over_rows_and_columns(cpu, rng, dtype, axis):
    shape = (37, 1003) if axis == 1 else (1003, 37)
    x = random_array(rng, shape, dtype)
    if dtype == np.bool_:
        x = rng.random(shape) < 0.995          # mostly True: rows that are all True must stay True
    out = cpu.empty(shape[1 - axis], from_numpy(dtype))
    prog = cpu.compile(K.reduce_axis("min", [None, None], axis, dtype=from_numpy(dtype)))
    prog(cpu.buf(x), out, d0=shape[0], d1=shape[1])
    np.testing.assert_array_equal(out.numpy(), x.min(axis=axis))


def test_min_reduction_of_everything_and_nan_propagation(cpu, rng):
    n = 100003
    x = random_array(rng, n, np.float32)
    k = UOp.range(UOp.variable("n", 1, 1 << 30), 0, AxisType.REDUCE)
    ast = UOp.sink(UOp.param(1, dtypes.float32).store(0, UOp.param(0, dtypes.float32).load(k).reduce(k, op=Ops.MIN)))
    prog = cpu.compile(ast)
    out = cpu.empty(1, dtypes.float32)
    prog(cpu.buf(x), out, n=n)
    assert out.numpy()[0] == x.min()
    x[n // 2] = math.nan
    prog(cpu.buf(x), out, n=n)
    assert math.isnan(out.numpy()[0])           # like numpy.min


def test_min_reduce_validates_like_the_other_ops():
    k = UOp.range(5, 0, AxisType.REDUCE)
    x = UOp.param(0, dtypes.int32).load(k)
    assert x.reduce(k, op=Ops.MIN).arg is Ops.MIN
    with pytest.raises(ValueError, match="reduce op must be one of"):
        x.reduce(k, op=Ops.SUB)


def test_reduce_identity_of_min():
    from morok_py.codegen.lower import reduce_identity
    assert reduce_identity(dtypes.float32, Ops.MIN) == math.inf
    assert reduce_identity(dtypes.int32, Ops.MIN) == 2**31 - 1
    assert reduce_identity(dtypes.uint8, Ops.MIN) == 255
    assert reduce_identity(dtypes.bool, Ops.MIN) is True and reduce_identity(dtypes.bool, Ops.MAX) is False


# ---- every renderer: one kernel with every op, compiled without a GPU --------------------------------

def every_math_kernel(dt=dtypes.float32):
    """Every new op and MIN reductions (per row, float and int, and a bool 'all') in one kernel."""
    x, y, n = UOp.param(0, dt), UOp.param(1, dt), UOp.param(2, dtypes.int32)
    out, flags, mins, imins = (UOp.param(3, dt), UOp.param(4, dtypes.bool), UOp.param(5, dt),
                               UOp.param(6, dtypes.int32))
    i = UOp.range(UOp.variable("n", 1, 1 << 24), 0)
    a, b = x.load(i), y.load(i)
    v = a.tanh() + a.sigmoid() + a.erf() + a.floor() + a.ceil() + a.round() + a.abs() + a.pow(b) \
        + a.pow(n.load(i)) + a.pow(3) + a.pow(0.5) + a.log1p()
    flag = a.isnan() | b.isinf()
    rows = UOp.range(UOp.variable("rows", 1, 1 << 20), 1)
    k = UOp.range(UOp.variable("cols", 1, 1 << 20), 2, AxisType.REDUCE)
    cols = UOp.variable("cols", 1, 1 << 20)
    idx = rows * cols + k
    row_min = x.load(idx).reduce(k, op=Ops.MIN)
    k2 = UOp.range(UOp.variable("cols", 1, 1 << 20), 3, AxisType.REDUCE)
    idx2 = rows * cols + k2
    irow_min = n.load(idx2).reduce(k2, op=Ops.MIN) + (x.load(idx2) < 0.0).reduce(k2, op=Ops.MIN).cast(dtypes.int32)
    return UOp.sink(out.store(i, v), flags.store(i, flag), mins.store(rows, row_min), imins.store(rows, irow_min))


def total_min_kernel(dt=dtypes.float32):
    """A grid reduction: the MIN of a whole vector."""
    k = UOp.range(UOp.variable("n", 1, 1 << 30), 0, AxisType.REDUCE)
    return UOp.sink(UOp.param(1, dt).store(0, UOp.param(0, dt).load(k).reduce(k, op=Ops.MIN)))


CUDA_PAIRS = ["nvrtc", "llvm-nvptx"]


@pytest.mark.parametrize("dt", [dtypes.float32, dtypes.float64, dtypes.float16], ids=lambda d: d.name)
@pytest.mark.parametrize("key", CUDA_PAIRS)
def test_every_math_op_compiles_for_cuda(key, dt):
    pytest.importorskip("cuda.bindings", reason="the cuda extra is not installed (pip install morok-py[cuda])")
    from morok_py.backends.cuda import compile_only_pairs
    for ast, name in ((every_math_kernel(dt), "math_ops"), (total_min_kernel(dt), "math_min")):
        for r, c in compile_only_pairs("sm_90"):
            if c.cache_key != key:
                continue
            why = c.available()
            if why is not None:
                pytest.skip(f"compiler {key} is not usable here: {why}")
            compiled = c.compile(r.render(ast, name))
            assert compiled.bytes[:4] == b"\x7fELF" and compiled.arch == "sm_90"


@pytest.mark.parametrize("dt", [dtypes.float32, dtypes.float64, dtypes.float16], ids=lambda d: d.name)
@pytest.mark.parametrize("arch", ["gfx90a", "gfx1100"])
def test_every_math_op_compiles_for_amdgpu(arch, dt):
    r, c = amdgpu_llvm_pair(arch)
    for ast, name in ((every_math_kernel(dt), "math_ops"), (total_min_kernel(dt), "math_min")):
        compiled = c.compile(r.render(ast, name))
        assert compiled.bytes[:4] == b"\x7fELF" and compiled.arch == arch


# ---- on a GPU: the same checks on both CUDA pairs --------------------------------------------------

GPU_PAIRS = [pytest.param(("CUDA", "nvrtc"), id="CUDA-nvrtc", marks=pytest.mark.cuda),
             pytest.param(("CUDA", "llvm-nvptx"), id="CUDA-llvm-nvptx", marks=pytest.mark.cuda),
             pytest.param(("ROCM", "llvm-amdgpu"), id="ROCM-llvm-amdgpu", marks=pytest.mark.rocm),
             pytest.param(("ROCM", "hiprtc"), id="ROCM-hiprtc", marks=pytest.mark.rocm)]


@pytest.fixture(params=GPU_PAIRS)
def gpu(request):
    return open_target(*request.param)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16], ids=lambda d: d.__name__)
def test_gpu_unary_math_matches_numpy(gpu, dtype):
    x = sweep(dtype)
    for fn, ref in UNARY_REF.items():
        assert_matches(run_unary(gpu, fn, x), ref(x.astype(np.float64)), dtype, exact=fn in EXACT)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16], ids=lambda d: d.__name__)
def test_gpu_pow_matches_numpy(gpu, rng, dtype):
    for label, x, y in pow_cases(dtype, rng):
        assert_matches(run_pow(gpu, x, y), pow_ref(x, y), dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.float64, np.bool_], ids=lambda d: np.dtype(d).name)
def test_gpu_min_reductions(gpu, rng, dtype):
    for axis, shape in ((1, (37, 1003)), (0, (1003, 37)), (1, (3, 100003))):
        x = random_array(rng, shape, dtype) if dtype != np.bool_ else rng.random(shape) < 0.995
        out = gpu.empty(shape[1 - axis], from_numpy(dtype))
        gpu.compile(K.reduce_axis("min", [None, None], axis, dtype=from_numpy(dtype)))(
            gpu.buf(x), out, d0=shape[0], d1=shape[1])
        np.testing.assert_array_equal(out.numpy(), x.min(axis=axis))
    n = 1 << 20
    v = random_array(rng, n, dtype) if dtype != np.bool_ else rng.random(n) < 0.99999
    out = gpu.empty(1, from_numpy(dtype))
    gpu.compile(total_min_kernel(from_numpy(dtype)))(gpu.buf(v), out, n=n)
    assert out.numpy()[0] == v.min()
