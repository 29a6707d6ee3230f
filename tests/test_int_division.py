"""Integer division means one thing on every pair (morok_py.ir.INT_DIVISION): `//` and `%` floor like
numpy, `cdiv` / `cmod` truncate like C and ONNX, a zero divisor gives 0 and INT_MIN // -1 wraps; no
input traps the process. Checked against numpy on edge values at every x86-64 level the host runs and
on every pair (GPU pairs where the hardware is present), compiled for every CUDA and ROCm pair without
a GPU; and the guards stay out of index arithmetic, which range analysis proves safe."""
from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest

from morok_py import AxisType, UOp, dtypes
from morok_py import kernels as K
from morok_py.codegen.decompose import defined_division
from morok_py.codegen.symbolic import _division_interval, int_divide, simplify, static_intervals
from morok_py.dtypes import DType
from morok_py.ir import Ops

from conftest import amdgpu_llvm_pair, cuda_compile_pair

INT_DTYPES = [dtypes.int8, dtypes.int16, dtypes.int32, dtypes.int64,
              dtypes.uint8, dtypes.uint16, dtypes.uint32, dtypes.uint64]
OPS = ["floordiv", "mod", "cdiv", "cmod"]


def _np(dt: DType) -> np.dtype:
    return np.dtype(dt.name)


def reference(op: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """numpy's answer: floor_divide / remainder; truncation through fmod (C's remainder); 0 for y == 0."""
    with np.errstate(all="ignore"):
        if op == "floordiv":
            return np.floor_divide(x, y)
        if op == "mod":
            return np.remainder(x, y)
        r = np.fmod(x, y)
        return r if op == "cmod" else np.floor_divide(x - r, y)    # x - r is a multiple of y: exact


def edge_values(dt: DType) -> list[int]:
    lo, hi = dt.min(), dt.max()
    vals = {0, 1, 2, 3, 7, hi, hi - 1, hi // 2, hi // 2 + 1}
    if lo < 0:
        vals |= {lo, lo + 1, -1, -2, -3, -7, lo // 2}
    return sorted(vals)


def operands(dt: DType, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Every pair of edge values, then random pairs: full-range dividends over small and full-range
    divisors (zeros included). An odd count, not a multiple of any vector width."""
    e = edge_values(dt)
    pairs = np.array(list(itertools.product(e, e)), dtype=object)
    info = np.iinfo(_np(dt))
    m = 301
    rx = rng.integers(info.min, info.max, size=m, endpoint=True, dtype=_np(dt))
    small = rng.integers(max(info.min, -9), 10, size=m, dtype=_np(dt))
    full = rng.integers(info.min, info.max, size=m, endpoint=True, dtype=_np(dt))
    ry = np.where(rng.integers(0, 2, size=m) == 1, small, full)
    x = np.concatenate([pairs[:, 0].astype(_np(dt)), rx])
    y = np.concatenate([pairs[:, 1].astype(_np(dt)), ry])
    if len(x) % 2 == 0:
        x, y = x[:-1], y[:-1]
    return x, y


def _x_forms(x: UOp) -> list:
    """The dividend as is, known >= 0 and known <= 0 (what the guards specialise on), with numpy twins."""
    return [(x, lambda v: v), (x.maximum(0), lambda v: np.maximum(v, 0)), (x.minimum(0), lambda v: np.minimum(v, 0))]


def _y_forms(y: UOp, dt: DType) -> list:
    forms = [(y, lambda v: v), (y.maximum(0), lambda v: np.maximum(v, 0)), (y.maximum(1), lambda v: np.maximum(v, 1))]
    if dt.min() < 0:
        forms += [(y.minimum(0), lambda v: np.minimum(v, 0)), (y.minimum(-1), lambda v: np.minimum(v, -1))]
    else:
        forms += [(y.minimum(7), lambda v: np.minimum(v, 7))]
    for c in (7, -1 if dt.min() < 0 else dt.max()):        # constant divisors: no guard, a negation for -1
        forms.append((UOp.const(c, dt), lambda v, c=c: np.full_like(v, c)))
    return forms


def division_kernel(dt: DType) -> tuple[UOp, list]:
    """out[c * n + i] = case c of a[i], b[i]: each of the four divisions of each dividend form by each
    divisor form. Returns the kernel and, per case, the numpy function of (x, y)."""
    a, b, out = UOp.param(0, dt), UOp.param(1, dt), UOp.param(2, dt)
    n = UOp.variable("n", 1, 1 << 20)
    i = UOp.range(n, 0)
    x, y = a.load(i), b.load(i)
    stores, refs = [], []
    for (xu, xf), (yu, yf) in itertools.product(_x_forms(x), _y_forms(y, dt)):   # 3 x 7 x 4 cases
        for op in OPS:
            v = {"floordiv": lambda p, q: p // q, "mod": lambda p, q: p % q,
                 "cdiv": lambda p, q: p.cdiv(q), "cmod": lambda p, q: p.cmod(q)}[op](xu, yu)
            stores.append(out.store(len(refs) * n + i, v))
            refs.append(lambda xs, ys, op=op, xf=xf, yf=yf: reference(op, xf(xs), yf(ys)))
    return UOp.sink(*stores), refs


def check_matches_numpy(target, dt: DType, rng: np.random.Generator) -> None:
    ast, refs = division_kernel(dt)
    x, y = operands(dt, rng)
    n = len(x)
    out = target.empty(n * len(refs), dt)
    target.compile(ast, f"divide_{dt.name}")(target.buf(x), target.buf(y), out, n=n)
    got = out.numpy().reshape(len(refs), n)
    for c, ref in enumerate(refs):
        want = ref(x, y)
        bad = np.nonzero(got[c] != want)[0]
        assert not len(bad), (f"{target.name} {dt.name} case {c} ({OPS[c % 4]}): x, y, got, numpy = "
                              f"{[(x[k], y[k], got[c][k], want[k]) for k in bad[:4]]}")


# ---- the semantics, in Python ---------------------------------------------------------------------

def test_int_divide_is_numpys_floor_and_cs_truncation():
    for dt in (dtypes.int8, dtypes.int32, dtypes.uint16):
        e = edge_values(dt)
        x, y = (np.array(v, dtype=_np(dt)) for v in zip(*itertools.product(e, e)))
        for op, name in zip((Ops.IDIV, Ops.MOD, Ops.CDIV, Ops.CMOD), OPS):
            got = [int_divide(op, int(p), int(q), dt) for p, q in zip(x, y)]
            assert got == reference(name, x, y).tolist(), (dt.name, name)


def test_constants_fold_to_the_defined_values():
    def fold(expr: UOp) -> int:
        out = simplify(expr)
        assert out.op is Ops.CONST
        return out.arg
    c = lambda v: UOp.const(v, dtypes.int32)   # noqa: E731
    assert (fold(c(-7) // c(2)), fold(c(-7) % c(2)), fold(c(-7).cdiv(c(2))), fold(c(-7).cmod(c(2)))) == (-4, 1, -3, -1)
    assert (fold(c(7) // c(-2)), fold(c(7) % c(-2)), fold(c(7).cdiv(c(-2))), fold(c(7).cmod(c(-2)))) == (-4, -1, -3, 1)
    assert [fold(f(c(5), c(0))) for f in (lambda p, q: p // q, lambda p, q: p % q, UOp.cdiv, UOp.cmod)] == [0] * 4
    lo = dtypes.int32.min()
    assert (fold(c(lo) // c(-1)), fold(c(lo).cdiv(c(-1))), fold(c(lo) % c(-1)), fold(c(lo).cmod(c(-1)))) == (lo, lo, 0, 0)


def test_a_zero_divisor_folds_away_without_a_constant_dividend():
    x = UOp.param(0, dtypes.int32).load(UOp.range(10, 0))
    assert simplify(x // 0).op is Ops.CONST and simplify(x.cmod(0)).arg == 0
    assert simplify(x.cdiv(1)) is x and simplify(x // 1) is x
    assert simplify(x // -1) is -x and simplify(x.cdiv(-1)) is -x and simplify(x % -1).arg == 0


def test_multiply_then_divide_cancels_only_in_index_arithmetic():
    r = UOp.range(100, 0)
    assert simplify((r * 4) // 4) is r and simplify((r * 4) % 4).arg == 0
    x = UOp.param(0, dtypes.int8).load(r)
    assert simplify((x * 2) // 2) is not x       # 100 * 2 wraps in int8: (100 * 2) // 2 == -28


def test_division_intervals_hold_every_value():
    rng = np.random.default_rng(7)
    for _ in range(300):
        x = tuple(sorted(rng.integers(-9, 10, size=2)))
        y = tuple(sorted(rng.integers(-9, 10, size=2)))
        for op in (Ops.IDIV, Ops.MOD, Ops.CDIV, Ops.CMOD):
            lo, hi = _division_interval(op, x, y)
            vals = [int_divide(op, p, q) for p in range(x[0], x[1] + 1) for q in range(y[0], y[1] + 1)]
            assert lo <= min(vals) and max(vals) <= hi, (op, x, y, (lo, hi), (min(vals), max(vals)))


def test_static_intervals_use_variable_bounds_and_wrap_to_the_dtype():
    n = UOp.variable("n", 3, 50)
    r = UOp.range(n, 0)
    x = UOp.param(0, dtypes.uint8).load(r)
    wraps = x.cast(dtypes.int32) * 20000000         # up to 5.1e9: leaves int32, so anything int32 holds
    q = r // n
    iv = static_intervals(UOp.sink(UOp.param(1, dtypes.int32).store(r, wraps + q)))
    assert iv[id(r)] == (0, 49) and iv[id(q)] == (0, 16) and iv[id(x)] == (0, 255)
    assert iv[id(wraps)] == (dtypes.int32.min(), dtypes.int32.max())


# ---- no guard where range analysis proves it unneeded ----------------------------------------------

def test_the_named_kernels_are_left_unchanged():
    for name in sorted(K.NAMED):
        ast = simplify(K.named(name))
        assert defined_division(ast) is ast, name


def _index_math_kernel(divisor: UOp) -> UOp:
    """out[r] = a[r // d] + a[r % d] + sum_k a[(r // d + k) % d]: index arithmetic only."""
    a, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)
    n = UOp.variable("n", 1, 1 << 20)
    r = UOp.range(n, 0)
    k = UOp.range(7, 1, AxisType.REDUCE)
    s = a.load((r // divisor + k) % divisor).reduce(k)
    return UOp.sink(out.store(r, a.load(r // divisor) + a.load(r % divisor) + s))


def test_index_arithmetic_renders_without_guards(cpu):
    for d in (UOp.const(3), UOp.variable("d", 1, 64)):
        ast = _index_math_kernel(d)
        assert defined_division(simplify(ast)) is simplify(ast)
        src = cpu.pair()[0].render(ast, "index_math").src
        assert "sdiv" in src or "udiv" in src or "srem" in src, src
        assert "select" not in src, src          # no guard on the divisor, no floor fix-up


def test_a_divisor_that_may_be_zero_is_guarded(cpu):
    ast = _index_math_kernel(UOp.variable("d", 0, 64))
    assert defined_division(simplify(ast)) is not simplify(ast)
    src = cpu.pair()[0].render(ast, "index_math").src
    assert "select" in src and ("sdiv" in src or "srem" in src)


# ---- every pair: numpy's answers -------------------------------------------------------------------

@pytest.mark.parametrize("dt", INT_DTYPES, ids=lambda d: d.name)
def test_every_x86_level_matches_numpy(cpu_level, dt, rng):
    check_matches_numpy(cpu_level, dt, rng)


@pytest.mark.parametrize("dt", INT_DTYPES, ids=lambda d: d.name)
def test_every_pair_matches_numpy(device, dt, rng):
    """CPU (LLVM, MLIR) here; CUDA (nvrtc, llvm-nvptx, MLIR) and ROCm pairs on a machine with the GPU."""
    check_matches_numpy(device, dt, rng)


# ---- every GPU pair compiles it (no GPU needed) ----------------------------------------------------

def _compiles(renderer, compiler, dt: DType) -> None:
    spec = renderer.render(division_kernel(dt)[0], f"divide_{dt.name}")
    out = compiler.compile(spec)
    assert out.bytes is not None and out.bytes[:4] == b"\x7fELF", (compiler.cache_key, dt.name)


@pytest.mark.parametrize("key", ["nvrtc", "llvm-nvptx", "mlir"])
def test_cuda_pairs_compile_it(key):
    r, c = cuda_compile_pair(key, "sm_90")
    for dt in INT_DTYPES:
        _compiles(r, c, dt)


@pytest.mark.parametrize("key", ["llvm-amdgpu", "hiprtc", "mlir"])
def test_rocm_pairs_compile_it(key):
    import test_rocm_compile as RC
    if key == "llvm-amdgpu":
        r, c = amdgpu_llvm_pair("gfx90a")
    elif key == "hiprtc":
        r, c = RC.usable_hip_pair("gfx90a")
    else:
        r, c = RC.usable_mlir_pair("gfx90a")
    for dt in INT_DTYPES:
        _compiles(r, c, dt)


# ---- the process survives --------------------------------------------------------------------------

_SURVIVES = """
import numpy as np
from morok_py import Buffer, UOp, dtypes
from morok_py.registry import get_device
dev = get_device("CPU")
a, b, q, r = (UOp.param(s, dtypes.int32) for s in range(4))
i = UOp.range(UOp.variable("n", 1, 1000), 0)
prog = dev.compile(UOp.sink(q.store(i, a.load(i) // b.load(i)), r.store(i, a.load(i) % b.load(i))), "div")
x = np.array([5, -7, 123456, -2**31, -2**31], dtype=np.int32)
y = np.array([0, 0, 0, -1, 0], dtype=np.int32)
qo, ro = dev.buffer(5, dtypes.int32), dev.buffer(5, dtypes.int32)
prog(Buffer.from_numpy(x, dev), Buffer.from_numpy(y, dev), qo, ro, n=5)
print(*qo.numpy().tolist(), *ro.numpy().tolist())
"""


def test_division_by_zero_and_int_min_by_minus_one_do_not_kill_the_interpreter():
    res = subprocess.run([sys.executable, "-c", _SURVIVES], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-2000:]}"
    assert res.stdout.split() == ["0", "0", "0", str(-2**31), "0"] + ["0"] * 5
