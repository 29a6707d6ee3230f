"""Storage-only formats: float8 (e4m3fn, e4m3fnuz, e5m2, e5m2fnuz, e8m0fnu), float4_e2m1fn, int4,
uint4, int2, uint2. One element per byte, with ml_dtypes' encodings, so numpy arrays of those types
move in and out of Buffers unchanged. Conversions are composed from integer IR ops (UOp.cast), so
every renderer prints them.

Reference: ml_dtypes' own astype (round to nearest even, its overflow and NaN rules) for the default
cast; numpy.clip to the format's finite range then astype for `saturate=True` (ONNX's definition);
onnx.numpy_helper.to_float8e8m0 for float8_e8m0fnu's rounding modes. Compared bit for bit, NaN codes
included, over every float16 value, 200k random float32 bit patterns, float64 and the boundary values
(largest finite, halfway to the next, smallest subnormals), both signs.
"""
from __future__ import annotations

import numpy as np
import pytest

from morok_py import AxisType, Ops, UOp, dtypes
from morok_py.dtypes import FLOAT_FORMATS, from_numpy

from conftest import amdgpu_llvm_pair, open_target

md = pytest.importorskip("ml_dtypes", reason="the narrow formats' numpy types come from ml_dtypes")

FLOATS = ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float4_e2m1fn"]
INTS = ["int4", "uint4", "int2", "uint2"]


def cast_kernel(src, to, **kw):
    a = UOp.param(0, src)
    i = UOp.range(UOp.variable("n", 1, 1 << 30), 0)
    v = a.load(i).cast(to, **kw)
    return UOp.sink(UOp.param(1, v.dtype).store(i, v))


def run_cast(target, x: np.ndarray, to, **kw) -> np.ndarray:
    src = from_numpy(x.dtype)
    prog = target.compile(cast_kernel(src, to, **kw), name=f"cast_{src.name}_{to.name}")
    out = target.empty(x.size, to)
    prog(target.buf(x), out, n=x.size)
    return out.numpy()


def float_inputs(src) -> np.ndarray:
    rng = np.random.default_rng(7)
    if src == np.float16:
        return np.arange(1 << 16, dtype=np.uint16).view(np.float16)          # every float16
    bits = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = [448, 456, 464, 465, 480, 240, 244, 248, 57344, 61440, 61439, 6, 5, 7, 0.25, 0.75, 1.25,
             2.0 ** -6, 2.0 ** -9, 2.0 ** -10, 1.5 * 2.0 ** -10, 2.0 ** -7, 2.0 ** -17, 3 * 2.0 ** -18,
             2.0 ** -16, 1.25 * 2.0 ** -16, 1e-45, 3e38, np.inf, np.nan, 0.0]
    x = np.concatenate([bits, np.array(edges, np.float32), np.linspace(-500, 500, 10007, dtype=np.float32)])
    x = np.concatenate([x, -x])
    if src == np.float64:
        x = np.concatenate([x.astype(np.float64), np.array([448 + 2 ** -40, 464 - 2 ** -40, 1e300, 5e-324])])
    return x


def same_bits(got, want, what):
    g, w = got.view(np.uint8), want.view(np.uint8)
    bad = np.nonzero(g != w)[0]
    assert bad.size == 0, f"{what}: {bad.size} differ, e.g. codes {g[bad[:5]]} != {w[bad[:5]]}"


@pytest.mark.parametrize("src", [np.float32, np.float64, np.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", FLOATS)
def test_float_to_narrow_float_matches_ml_dtypes_bit_for_bit(cpu, name, src):
    x = float_inputs(src)
    with np.errstate(all="ignore"):
        want = x.astype(getattr(md, name))
    same_bits(run_cast(cpu, x, getattr(dtypes, name)), want, f"{src.__name__} -> {name}")


@pytest.mark.parametrize("src", [np.float32, np.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", FLOATS[:4])
def test_saturating_cast_clamps_overflow_and_infinity(cpu, name, src):
    x = float_inputs(src)
    mdt = getattr(md, name)
    info = md.finfo(mdt)
    with np.errstate(all="ignore"):
        want = np.clip(x, info.min, info.max).astype(mdt)       # NaN stays NaN
    got = run_cast(cpu, x, getattr(dtypes, name), saturate=True)
    same_bits(got, want, f"saturating {src.__name__} -> {name}")
    assert np.isfinite(got.astype(np.float32)[~np.isnan(x)]).all()


@pytest.mark.parametrize("to", [np.float32, np.float64, np.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", FLOATS + ["float8_e8m0fnu"])
def test_every_code_decodes_exactly(cpu, name, to):
    dt = getattr(dtypes, name)
    codes = np.arange(1 << dt.narrow, dtype=np.uint8).view(getattr(md, name))
    got = run_cast(cpu, codes, from_numpy(to))
    with np.errstate(all="ignore"):
        want = codes.astype(to)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    np.testing.assert_array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))


@pytest.mark.parametrize("a,b", [("float8_e4m3fn", "float8_e5m2"), ("float8_e5m2", "float4_e2m1fn"),
                                 ("float8_e4m3fnuz", "float8_e5m2fnuz")])
def test_narrow_to_narrow_goes_through_the_exact_value(cpu, a, b):
    codes = np.arange(256, dtype=np.uint8).view(getattr(md, a))
    with np.errstate(all="ignore"):
        want = codes.astype(np.float32).astype(getattr(md, b))
    same_bits(run_cast(cpu, codes, getattr(dtypes, b)), want, f"{a} -> {b}")


@pytest.mark.parametrize("mode", ["up", "nearest", "down"])
@pytest.mark.parametrize("saturate", [True, False])
def test_e8m0_rounding_modes_follow_onnx(cpu, mode, saturate):
    helper = pytest.importorskip("onnx.numpy_helper", reason="float8_e8m0fnu's rounding modes are ONNX's")
    x = float_inputs(np.float32)
    want = helper.to_float8e8m0(x, saturate, mode)
    got = run_cast(cpu, x, dtypes.float8_e8m0fnu, saturate=saturate, round_mode=mode)
    same_bits(got, want, f"e8m0 {mode} saturate={saturate}")


@pytest.mark.parametrize("src", [np.float32, np.int32, np.int64, np.uint8, np.int8, np.uint64],
                         ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", INTS)
def test_narrow_ints_wrap_like_ml_dtypes(cpu, rng, name, src):
    if src == np.float32:
        x = rng.uniform(-300, 300, 1001).astype(np.float32)
    else:
        info = np.iinfo(src)
        x = rng.integers(info.min, info.max, 1001, endpoint=True, dtype=src)
    with np.errstate(all="ignore"):
        want = x.astype(getattr(md, name))
    same_bits(run_cast(cpu, x, getattr(dtypes, name)), want, f"{src.__name__} -> {name}")


@pytest.mark.parametrize("to", [np.float32, np.float16, np.int8, np.uint8, np.int64, np.bool_],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", INTS)
def test_narrow_ints_decode(cpu, name, to):
    dt = getattr(dtypes, name)
    lo, hi = (0, 1 << dt.narrow) if dt.is_unsigned else (-(1 << (dt.narrow - 1)), 1 << (dt.narrow - 1))
    codes = np.arange(lo, hi).astype(getattr(md, name))
    got = run_cast(cpu, codes, from_numpy(to))
    np.testing.assert_array_equal(got, codes.astype(to))


def test_numpy_arrays_round_trip_through_buffers(cpu, rng):
    for name in FLOATS + INTS + ["float8_e8m0fnu"]:
        x = rng.integers(0, 256, 1000, dtype=np.uint8)
        if getattr(dtypes, name).narrow < 8:
            x &= (1 << getattr(dtypes, name).narrow) - 1
        arr = x.view(getattr(md, name))
        b = cpu.buf(arr)
        assert b.dtype is getattr(dtypes, name) and b.nbytes == 1000
        back = b.numpy()
        assert back.dtype == arr.dtype
        np.testing.assert_array_equal(back.view(np.uint8), x)


def test_a_sum_of_float8_values_accumulates_in_float32(cpu, rng):
    x = rng.standard_normal((37, 1001)).astype(np.float32).astype(md.float8_e4m3fn)
    a, out = UOp.param(0, dtypes.float8_e4m3fn), UOp.param(1, dtypes.float32)
    r = UOp.range(37, 0)
    k = UOp.range(1001, 1, AxisType.REDUCE)
    total = a.load(r * 1001 + k).cast(dtypes.float32).reduce(k)
    o = cpu.empty(37, dtypes.float32)
    cpu.compile(UOp.sink(out.store(r, total)), name="f8_rowsum")(cpu.buf(x), o)
    np.testing.assert_allclose(o.numpy(), x.astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-4)
    # a reduce straight over the float8 loads widens them itself and rounds the result once to float8
    k2 = UOp.range(1001, 2, AxisType.REDUCE)
    r2 = UOp.range(37, 3)
    s = a.load(r2 * 1001 + k2).reduce(k2, op=Ops.MAX)
    assert s.dtype is dtypes.float8_e4m3fn
    o2 = cpu.empty(37, dtypes.float8_e4m3fn)
    cpu.compile(UOp.sink(UOp.param(1, dtypes.float8_e4m3fn).store(r2, s)), name="f8_rowmax")(cpu.buf(x), o2)
    np.testing.assert_array_equal(o2.numpy().view(np.uint8), x.max(axis=1).view(np.uint8))


def test_arithmetic_on_a_storage_only_dtype_is_refused_with_the_fix():
    x = UOp.param(0, dtypes.float8_e5m2).load(0)
    with pytest.raises(TypeError, match="storage-only dtype.*cast it first"):
        x + x
    with pytest.raises(TypeError, match="storage-only"):
        x * 2.0
    with pytest.raises(TypeError, match="no float8_e5m2 constants"):
        UOp.const(1.0, dtypes.float8_e5m2)
    with pytest.raises(ValueError, match="storage-only"):
        x.reduce(UOp.range(4, 0, AxisType.REDUCE), acc_dtype=dtypes.float8_e5m2)
    with pytest.raises(ValueError, match="round_mode"):
        x.cast(dtypes.float8_e8m0fnu, round_mode="toward_zero")
    # selecting between two stored values is fine: no arithmetic
    sel = (UOp.param(1, dtypes.int32).load(0) > 0).where(x, x)
    assert sel.dtype is dtypes.float8_e5m2


def test_formats_table_matches_ml_dtypes():
    for name, f in FLOAT_FORMATS.items():
        info = md.finfo(getattr(md, name))
        assert float(np.array([f.max_code], np.uint8).view(getattr(md, name))[0]) == float(info.max), name
        assert getattr(dtypes, name).np == np.dtype(getattr(md, name))


# ---- the GPU renderers print the same compositions ------------------------------------------------

def narrow_kernels():
    out = []
    for name in FLOATS + ["float8_e8m0fnu"]:
        dt = getattr(dtypes, name)
        out.append((cast_kernel(dtypes.float32, dt, saturate=True), f"enc_{name}"))
        out.append((cast_kernel(dtypes.float16, dt), f"enc16_{name}"))
        out.append((cast_kernel(dtypes.float64, dt), f"enc64_{name}"))
        out.append((cast_kernel(dt, dtypes.float32), f"dec_{name}"))
    for name in INTS:
        dt = getattr(dtypes, name)
        out.append((cast_kernel(dtypes.float32, dt), f"enc_{name}"))
        out.append((cast_kernel(dt, dtypes.float16), f"dec_{name}"))
    return out


@pytest.mark.parametrize("key", ["nvrtc", "llvm-nvptx"])
def test_narrow_casts_compile_for_cuda(key):
    pytest.importorskip("cuda.bindings", reason="the cuda extra is not installed (pip install morok-py[cuda])")
    from morok_py.backends.cuda import compile_only_pairs
    pairs = [(r, c) for r, c in compile_only_pairs("sm_90") if c.cache_key == key]
    assert pairs, f"no {key} pair"
    r, c = pairs[0]
    why = c.available()
    if why is not None:
        pytest.skip(f"compiler {key} is not usable here: {why}")
    for ast, name in narrow_kernels():
        compiled = c.compile(r.render(ast, name))
        assert compiled.bytes[:4] == b"\x7fELF" and compiled.arch == "sm_90"


@pytest.mark.parametrize("arch", ["gfx90a", "gfx1100"])
def test_narrow_casts_compile_for_amdgpu(arch):
    r, c = amdgpu_llvm_pair(arch)
    for ast, name in narrow_kernels():
        compiled = c.compile(r.render(ast, name))
        assert compiled.bytes[:4] == b"\x7fELF" and compiled.arch == arch


GPU_PAIRS = [pytest.param(("CUDA", "nvrtc"), id="CUDA-nvrtc", marks=pytest.mark.cuda),
             pytest.param(("CUDA", "llvm-nvptx"), id="CUDA-llvm-nvptx", marks=pytest.mark.cuda),
             pytest.param(("ROCM", "llvm-amdgpu"), id="ROCM-llvm-amdgpu", marks=pytest.mark.rocm)]


@pytest.mark.parametrize("pair", GPU_PAIRS)
def test_gpu_narrow_casts_match_ml_dtypes(pair):
    gpu = open_target(*pair)
    for name in FLOATS:
        for src in (np.float32, np.float16):
            x = float_inputs(src)
            with np.errstate(all="ignore"):
                want = x.astype(getattr(md, name))
            same_bits(run_cast(gpu, x, getattr(dtypes, name)), want, f"{src.__name__} -> {name}")
        codes = np.arange(1 << getattr(dtypes, name).narrow, dtype=np.uint8).view(getattr(md, name))
        got = run_cast(gpu, codes, dtypes.float32)
        want = codes.astype(np.float32)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
    for name in INTS:
        x = np.arange(-300, 300, dtype=np.int32)
        same_bits(run_cast(gpu, x, getattr(dtypes, name)), x.astype(getattr(md, name)), f"int32 -> {name}")
