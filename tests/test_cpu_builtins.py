"""CPU kernels whose conversions LLVM lowers to compiler-runtime calls: bfloat16 rounding is provided by
backends/cpu/builtins.py (Debian 12's libgcc has none: a bfloat16 kernel used to crash the interpreter
by calling address 0), and an object needing a symbol nobody provides is refused at load by name."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from morok_py import DeviceError, UOp, dtypes
from morok_py.backends.cpu import builtins
from morok_py.backends.cpu.compiler import host_cpu, llvm

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


def _cast_kernel(src, dst):
    x, out = UOp.param(0, src), UOp.param(1, dst)
    i = UOp.range(UOp.variable("n", 1, 1 << 24), 0)
    return UOp.sink(out.store(i, x.load(i).cast(dst)))


def _special(n, rng, npdt):
    bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32).astype(npdt)       # every float32 exponent: denormals, inf, nan included
    if npdt == np.float64:                       # and doubles past float32's range and precision
        x = np.concatenate([x, rng.standard_normal(n) * 10.0 ** rng.integers(-60, 60, n)])
    edge = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8,
                     1.0 + 2**-8 + 2**-30, 3.5e38, -1e300], npdt)
    return np.concatenate([x, edge, rng.standard_normal(n).astype(npdt)])


@pytest.mark.parametrize("src", [dtypes.float32, dtypes.float64], ids=lambda d: d.name)
def test_bfloat16_rounding_matches_ml_dtypes(cpu, rng, src):
    x = _special(50_001, rng, src.np)
    out = cpu.empty(len(x), dtypes.bfloat16)
    cpu.compile(_cast_kernel(src, dtypes.bfloat16), name=f"to_bf16_{src.name}")(cpu.buf(x), out, n=len(x))
    got = out.numpy()
    if src is dtypes.float32:
        ref = x.astype(BF16)
    else:   # one correct rounding: float32 rounded to odd, then to nearest even (ml_dtypes rounds twice)
        with np.errstate(over="ignore", invalid="ignore"):
            f = x.astype(np.float32)
        inexact = (f.astype(np.float64) != x) & np.isfinite(f)
        ref = (f.view(np.uint32) | inexact.astype(np.uint32)).view(np.float32).astype(BF16)
    nan = np.isnan(ref.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
    ok = got.view(np.uint16) == ref.view(np.uint16)
    if src is dtypes.float32 and "+avx512bf16" in host_cpu()[1].split(","):
        # the target converts with VCVTNEPS2BF16, which treats denormal inputs as zero (sign kept)
        tiny = (np.abs(x) < np.finfo(np.float32).tiny) & (x != 0)
        ok |= tiny & (got.astype(np.float32) == 0) & (np.signbit(got.astype(np.float32)) == np.signbit(x))
    assert np.all(ok[~nan]), x[~nan & ~ok][:10]


def test_bfloat16_arithmetic_runs(cpu, rng):
    a = rng.standard_normal(1003).astype(BF16)
    b = rng.standard_normal(1003).astype(BF16)
    x, y, out = UOp.param(0, dtypes.bfloat16), UOp.param(1, dtypes.bfloat16), UOp.param(2, dtypes.bfloat16)
    i = UOp.range(1003, 0)
    o = cpu.empty(1003, dtypes.bfloat16)
    cpu.compile(UOp.sink(out.store(i, x.load(i) * y.load(i) + x.load(i))), name="bf16_fma")(cpu.buf(a), cpu.buf(b), o)
    af, bf = a.astype(np.float32), b.astype(np.float32)
    ref = ((af * bf).astype(BF16).astype(np.float32) + af).astype(BF16)
    np.testing.assert_allclose(o.numpy().astype(np.float32), ref.astype(np.float32), rtol=8e-3, atol=1e-6)


def _object_calling(symbol: str) -> bytes:
    b = llvm()
    from morok_py.backends.cpu.compiler import CPUCompiler
    tm = CPUCompiler().target_machine
    mod = b.parse_assembly(f"""
declare float @{symbol}(float)
define void @calls_it(ptr %p) {{
  %x = load float, ptr %p
  %y = call float @{symbol}(float %x)
  store float %y, ptr %p
  ret void
}}""")
    mod.triple = tm.triple
    return tm.emit_object(mod)


def test_undefined_symbols_are_listed():
    obj = _object_calling("morok_no_such_function")
    assert builtins.undefined_symbols(obj) == ["morok_no_such_function"]
    assert builtins.unresolved(llvm(), ["morok_no_such_function", "expf", "__truncsfbf2"]) == ["morok_no_such_function"]
    assert builtins.undefined_symbols(b"not an object") == []


def test_an_object_needing_a_missing_symbol_is_refused_at_load(cpu):
    spec = cpu.dev.renderer.render(_cast_kernel(dtypes.float32, dtypes.float32), name="calls_it")
    compiled = cpu.dev.compiler.compile(spec)
    bad = dataclasses.replace(compiled, bytes=_object_calling("morok_no_such_function"))
    with pytest.raises(DeviceError, match="morok_no_such_function"):
        cpu.dev.runtime(bad)
