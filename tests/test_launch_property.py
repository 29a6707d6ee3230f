"""A property test of the launch check: every launch the check accepts touches only memory inside its
buffers, and buffers of exactly the size a launch needs are never refused.

Kernels come from a small fixed set (the kernel builders, and IR kernels with broadcasts, reductions,
clamped gathers and where-guarded indices), each compiled once for the CPU; hypothesis draws the
variable values and the buffer sizes around the exact ones. Each buffer is a zero-copy view into a
larger numpy array whose guard regions (and the view's unused tail) hold a sentinel: after a run
the guards must be intact and the output must equal numpy's, so a stray write breaks a guard and a
stray read brings a sentinel into the result."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the property tests need hypothesis (the dev extra)")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from morok_py import AxisType, Buffer, LaunchError, UOp, dtypes, kernels as K  # noqa: E402
from morok_py.registry import get_device  # noqa: E402

F32, I32 = dtypes.float32, dtypes.int32
GUARD = 256                  # guard elements on each side of a view (beyond any size delta drawn)
SENTINEL = {np.float32: np.float32(1e30), np.int32: np.int32(-77777)}
SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Case:
    """A kernel, the range each variable is drawn from, the exact buffer sizes for given values, the
    dtype of each buffer (the last is the output), random inputs and the numpy result."""
    name: str
    build: Callable[[], UOp]
    variables: dict[str, int]                       # name -> largest value drawn (the smallest is 1)
    sizes: Callable[[dict], list[int]]
    kinds: tuple
    reference: Callable[..., np.ndarray]
    data: Callable[[np.random.Generator, dict, list[int]], list[np.ndarray]] | None = None
    lows: tuple = ()                                # (name, smallest value) where 0 is valid


# ---- IR kernels ---------------------------------------------------------------------------------

def _var(name: str, lo: int = 1, hi: int = 1 << 20) -> UOp:
    return UOp.variable(name, lo, hi)


def outer_product() -> UOp:
    """out[i, j] = a[i] * b[j]: two broadcasts of symbolic length."""
    a, b, out = UOp.param(0, F32), UOp.param(1, F32), UOp.param(2, F32)
    n, m = _var("n"), _var("m")
    i, j = UOp.range(n, 0), UOp.range(m, 1)
    return UOp.sink(out.store(i * m + j, a.load(i) * b.load(j)))


def shifted() -> UOp:
    """out[i] = x[i + s] where i + s < n, else 0: the load's index is guarded by a where."""
    x, out = UOp.param(0, F32), UOp.param(1, F32)
    n, s = _var("n"), _var("s", 0, 64)
    i = UOp.range(n, 0)
    ok = (i + s) < n
    return UOp.sink(out.store(i, ok.where(x.load(ok.where(i + s, 0)), UOp.const(0.0))))


def left_padded() -> UOp:
    """out[i] = x[i - p] for i >= p, else 0 (a padded window): where-guarded, x holds n - p."""
    x, out = UOp.param(0, F32), UOp.param(1, F32)
    n, p = _var("n"), _var("p", 0, 64)
    i = UOp.range(n, 0)
    inside = (i < p).logical_not()
    return UOp.sink(out.store(i, inside.where(x.load(inside.where(i - p, 0)), UOp.const(0.0))))


def stencil() -> UOp:
    """out[i] = x[max(i - 1, 0)] + x[min(i + 1, n - 1)]: clamped neighbours."""
    x, out = UOp.param(0, F32), UOp.param(1, F32)
    n = _var("n")
    i = UOp.range(n, 0)
    return UOp.sink(out.store(i, x.load((i - 1).maximum(0)) + x.load((i + 1).minimum(n - 1))))


def reversed_copy() -> UOp:
    x, out = UOp.param(0, F32), UOp.param(1, F32)
    n = _var("n")
    i = UOp.range(n, 0)
    return UOp.sink(out.store(i, x.load(n - 1 - i)))


def tiled() -> UOp:
    """out[i] = x[i % m]: a periodic broadcast of a symbolic period."""
    x, out = UOp.param(0, F32), UOp.param(1, F32)
    n, m = _var("n"), _var("m")
    i = UOp.range(n, 0)
    return UOp.sink(out.store(i, x.load(i % m)))


def strided_rows() -> UOp:
    """out[r] = sum_k x[r * stride + k] for k < w, with stride >= w chosen at launch."""
    x, out = UOp.param(0, F32), UOp.param(1, F32)
    r_n, w, stride = _var("rows"), _var("w"), _var("stride")
    r = UOp.range(r_n, 0)
    k = UOp.range(w, 1, AxisType.REDUCE)
    return UOp.sink(out.store(r, x.load(r * stride + k).reduce(k)))


# ---- references ---------------------------------------------------------------------------------

def _f64(a):
    return np.asarray(a, np.float64)


def _shift_ref(v, x):
    n, s = v["n"], v["s"]
    out = np.zeros(n)
    out[: max(0, n - s)] = x[s:n]
    return out


def _pad_ref(v, x):
    n, p = v["n"], v["p"]
    out = np.zeros(n)
    out[p:] = x[: max(0, n - p)]
    return out


def _gather_data(rng, v, sizes):
    T = v.get("table_n", v.get("vocab"))
    return [rng.standard_normal(sizes[0]).astype(np.float32),
            rng.integers(-3, T + 3, sizes[1]).astype(np.int32)]


def _strided_sizes(v):
    return [(v["rows"] - 1) * v["stride"] + v["w"], v["rows"]]     # a stride below w overlaps rows


def _conv_ref(v, x, w, b):
    """conv2d(N, C=2, H=7, W=6, CO=3, KH=3, KW=2, stride 2) + bias, relu: OH = 3, OW = 3."""
    x, w = _f64(x).reshape(v["N"], 2, 7, 6), _f64(w).reshape(3, 2, 3, 2)
    out = np.zeros((v["N"], 3, 3, 3))
    for oh in range(3):
        for ow in range(3):
            patch = x[:, :, oh * 2:oh * 2 + 3, ow * 2:ow * 2 + 2]
            out[:, :, oh, ow] = np.einsum("nchw,ochw->no", patch, w)
    return np.maximum(out + _f64(b).reshape(1, 3, 1, 1), 0).reshape(-1)


def _softmax_ref(v, x):
    x = _f64(x).reshape(v["rows"], v["cols"])
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).reshape(-1)


CASES = [
    Case("add", lambda: K.add(), {"n": 40}, lambda v: [v["n"]] * 3, (np.float32,) * 3,
         lambda v, a, b: _f64(a) + b),
    Case("sum_rows", lambda: K.reduce_axis("sum", [None, None], 1), {"d0": 12, "d1": 12},
         lambda v: [v["d0"] * v["d1"], v["d0"]], (np.float32,) * 2,
         lambda v, x: _f64(x).reshape(v["d0"], v["d1"]).sum(axis=1)),
    Case("max_cols", lambda: K.reduce_axis("max", [None, None], 0), {"d0": 12, "d1": 12},
         lambda v: [v["d0"] * v["d1"], v["d1"]], (np.float32,) * 2,
         lambda v, x: _f64(x).reshape(v["d0"], v["d1"]).max(axis=0)),
    Case("matmul", lambda: K.matmul(), {"M": 9, "N": 9, "K": 9},
         lambda v: [v["M"] * v["K"], v["K"] * v["N"], v["M"] * v["N"]], (np.float32,) * 3,
         lambda v, a, b: (_f64(a).reshape(v["M"], v["K"]) @ _f64(b).reshape(v["K"], v["N"])).reshape(-1)),
    Case("softmax", lambda: K.softmax(), {"rows": 8, "cols": 12},
         lambda v: [v["rows"] * v["cols"]] * 2, (np.float32,) * 2, _softmax_ref),
    Case("broadcast", lambda: K.broadcast_binary("sub", (7, 1, 5), (3, 5)), {},
         lambda v: [35, 15, 105], (np.float32,) * 3,
         lambda v, a, b: (_f64(a).reshape(7, 1, 5) - _f64(b).reshape(3, 5)).reshape(-1)),
    Case("gather", lambda: K.gather(), {"table_n": 20, "n": 30},
         lambda v: [v["table_n"], v["n"], v["n"]], (np.float32, np.int32, np.float32),
         lambda v, t, i: _f64(t)[np.clip(i, 0, v["table_n"] - 1)], _gather_data),
    Case("gather_rows", lambda: K.gather_rows(), {"vocab": 9, "dim": 6, "n": 9},
         lambda v: [v["vocab"] * v["dim"], v["n"], v["n"] * v["dim"]], (np.float32, np.int32, np.float32),
         lambda v, t, i: _f64(t).reshape(v["vocab"], v["dim"])[np.clip(i, 0, v["vocab"] - 1)].reshape(-1),
         _gather_data),
    Case("conv2d", lambda: K.conv2d(None, 2, 7, 6, 3, 3, 2, stride=2, bias=True, relu=True), {"N": 4},
         lambda v: [v["N"] * 2 * 7 * 6, 3 * 2 * 3 * 2, 3, v["N"] * 3 * 3 * 3], (np.float32,) * 4, _conv_ref),
    Case("outer", outer_product, {"n": 16, "m": 16}, lambda v: [v["n"], v["m"], v["n"] * v["m"]],
         (np.float32,) * 3, lambda v, a, b: np.outer(_f64(a), b).reshape(-1)),
    Case("shifted", shifted, {"n": 30, "s": 40}, lambda v: [v["n"], v["n"]], (np.float32,) * 2,
         _shift_ref, lows=(("s", 0),)),
    Case("left_padded", left_padded, {"n": 30, "p": 40}, lambda v: [max(1, v["n"] - v["p"]), v["n"]],
         (np.float32,) * 2, _pad_ref, lows=(("p", 0),)),
    Case("stencil", stencil, {"n": 30}, lambda v: [v["n"], v["n"]], (np.float32,) * 2,
         lambda v, x: _f64(x)[np.maximum(np.arange(v["n"]) - 1, 0)] + _f64(x)[np.minimum(np.arange(v["n"]) + 1,
                                                                                      v["n"] - 1)]),
    Case("reversed", reversed_copy, {"n": 30}, lambda v: [v["n"], v["n"]], (np.float32,) * 2,
         lambda v, x: _f64(x)[::-1]),
    Case("tiled", tiled, {"n": 30, "m": 12}, lambda v: [v["m"], v["n"]], (np.float32,) * 2,
         lambda v, x: _f64(x)[np.arange(v["n"]) % v["m"]]),
    Case("strided_rows", strided_rows, {"rows": 8, "w": 8, "stride": 12}, _strided_sizes, (np.float32,) * 2,
         lambda v, x: np.array([_f64(x)[r * v["stride"]: r * v["stride"] + v["w"]].sum() for r in range(v["rows"])])),
]

_programs: dict[str, object] = {}


def program(case: Case):
    """The case's kernel, compiled once per test session (compiles are the slow part)."""
    prog = _programs.get(case.name)
    if prog is None:
        prog = _programs[case.name] = get_device("CPU").compile(case.build(), f"property {case.name}")
    return prog


class Guarded:
    """A Buffer of `size` elements viewing the middle of a larger array; everything around the
    `used` elements of real data (the rest of the view, and GUARD elements each side) holds SENTINEL."""

    def __init__(self, data: np.ndarray, size: int, kind) -> None:
        kind = np.dtype(kind)
        total = size + 2 * GUARD
        raw = np.empty(total * kind.itemsize + 64, np.uint8)
        start = (-raw.ctypes.data) % 64
        self.whole = raw[start:start + total * kind.itemsize].view(kind)
        self.whole[:] = SENTINEL[kind.type]
        self.used = min(size, data.size)
        self.whole[GUARD:GUARD + self.used] = data[: self.used]
        self.before = self.whole.copy()
        self.size = size
        self.buffer = Buffer.from_dlpack(self.whole[GUARD:GUARD + size])

    @property
    def view(self) -> np.ndarray:
        return self.whole[GUARD:GUARD + self.size]

    def guards_intact(self) -> bool:
        return (np.array_equal(self.whole[:GUARD], self.before[:GUARD])
                and np.array_equal(self.whole[GUARD + self.size:], self.before[GUARD + self.size:]))


def inputs_for(case: Case, values: dict, exact: list[int], rng: np.random.Generator) -> list[np.ndarray]:
    if case.data is not None:
        return case.data(rng, values, exact)
    return [rng.standard_normal(n).astype(np.float32) for n in exact[:-1]]


def launch(case: Case, values: dict, sizes: list[int], seed: int, exact: list[int] | None = None,
           data_values: dict | None = None):
    """Run the case with buffers of `sizes` (inputs hold exact-length random data, cut to size, drawn for
    `data_values`, by default the launch's own values); returns (accepted, error, guarded buffers, the exact
    sizes, the inputs)."""
    exact = case.sizes(values) if exact is None else exact
    rng = np.random.default_rng(seed)
    data = inputs_for(case, values if data_values is None else data_values, exact, rng)
    bufs = [Guarded(d, n, k) for d, n, k in zip(data, sizes, case.kinds)]
    out = Guarded(np.empty(0, case.kinds[-1]), sizes[-1], case.kinds[-1])
    try:
        program(case)(*[g.buffer for g in bufs], out.buffer, wait=True, **values)
    except LaunchError as e:
        return False, e, bufs + [out], exact, data
    return True, None, bufs + [out], exact, data


def check_accepted(case: Case, values: dict, guarded: list[Guarded], exact: list[int], data: list[np.ndarray]):
    for slot, g in enumerate(guarded):
        assert g.guards_intact(), f"{case.name} {values}: the launch wrote outside buffer {slot} (size {g.size})"
        if slot < len(guarded) - 1:
            assert np.array_equal(g.whole, g.before), f"{case.name} {values}: input buffer {slot} was written"
    out = guarded[-1]
    want = np.asarray(case.reference(values, *data), np.float64).reshape(-1)
    n = min(out.size, exact[-1])
    got = out.view[:n].astype(np.float64)
    np.testing.assert_allclose(got, want[:n], rtol=2e-5, atol=2e-5,
                               err_msg=f"{case.name} {values} sizes {[g.size for g in guarded]} (exact {exact}): "
                                       f"the result differs from numpy, so the kernel read outside its data")
    assert (out.view[n:] == SENTINEL[np.float32]).all(), f"{case.name} {values}: wrote past the output's extent"


def draw_values(data, case: Case) -> dict:
    lows = dict(case.lows)
    return {k: data.draw(st.integers(lows.get(k, 1), hi), label=k) for k, hi in case.variables.items()}


@settings(max_examples=150, **SETTINGS)
@given(st.data())
def test_an_accepted_launch_touches_only_its_buffers(data):
    case = data.draw(st.sampled_from(CASES), label="case")
    values = draw_values(data, case)
    exact = case.sizes(values)
    deltas = [data.draw(st.one_of(st.just(0), st.integers(-3, 3)), label=f"delta{i}") for i in range(len(exact))]
    sizes = [max(1, n + d) for n, d in zip(exact, deltas)]
    accepted, err, guarded, exact, inputs = launch(case, values, sizes, data.draw(st.integers(0, 2**32 - 1)))
    if accepted:
        check_accepted(case, values, guarded, exact, inputs)
    else:
        assert any(s < n for s, n in zip(sizes, exact)), \
            f"{case.name} {values}: buffers of sizes {sizes} >= the exact {exact} were refused: {err}"
        for slot, g in enumerate(guarded):
            assert np.array_equal(g.whole, g.before), f"{case.name}: a refused launch changed buffer {slot}"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_exactly_sized_buffers_are_never_refused(case):
    """Each kernel at its smallest values, at mixed ones and at its largest, with exact sizes."""
    lows = dict(case.lows)
    for pick in (lambda k, hi: lows.get(k, 1), lambda k, hi: (hi + 1) // 2 + 1 if hi > 1 else hi,
                 lambda k, hi: hi):
        values = {k: pick(k, hi) for k, hi in case.variables.items()}
        exact = case.sizes(values)
        accepted, err, guarded, exact, inputs = launch(case, values, exact, 5)
        assert accepted, f"{case.name} {values}: exactly-sized buffers {exact} were refused: {err}"
        check_accepted(case, values, guarded, exact, inputs)


@settings(max_examples=40, **SETTINGS)
@given(st.data())
def test_a_value_outside_its_variable_range_is_refused_before_the_launch(data):
    case = data.draw(st.sampled_from([c for c in CASES if c.variables]), label="case")
    values = draw_values(data, case)
    exact = case.sizes(values)
    name = data.draw(st.sampled_from(sorted(case.variables)), label="bad variable")
    var = next(v for v in program(case).launch.variables if v.name == name)
    good = dict(values)       # the buffers' data is drawn for valid values; only the launch gets the bad one
    values[name] = data.draw(st.one_of(st.integers(-2**31, var.min - 1), st.integers(var.max + 1, var.max + 2**31)))
    accepted, err, guarded, *_ = launch(case, values, [n + 8 for n in exact], 7, exact, data_values=good)
    assert not accepted and "outside its range" in str(err), f"{case.name} {values}: {err}"
    for g in guarded:
        assert np.array_equal(g.whole, g.before)
