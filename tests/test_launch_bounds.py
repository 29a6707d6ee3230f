"""The launch check's index bounds: sound (never smaller than what the code touches), tight where the
code's indices are plain size arithmetic (a register-tiled matmul on every CPU tile shape, symbolic or
static), and narrowed by WHERE conditions the way a graph executor writes Gather with negative indices.

The register-tile tests do not depend on the host: they lower for each tile a CPU pair can have
(backends/cpu/renderer.register_tile_for) and enumerate every index the lowered kernel computes."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from morok_py import LaunchError, UOp, dtypes, kernels as K
from morok_py.codegen.lower import Capabilities, lower
from morok_py.codegen.symbolic import evaluate
from morok_py.ir import Ops

from morok_py.backends.cpu.renderer import register_tile_for, tile_lanes_for

FEATURES = ("", "+sse4.2", "+avx,+avx2,+fma", "+avx2,+avx512f")
TILES = sorted({register_tile_for(f) for f in FEATURES})
LANES = {register_tile_for(f): tile_lanes_for(f) for f in FEATURES}
SIZES = [(64, 128, 256), (60, 128, 256), (66, 130, 257), (1, 1, 1), (7, 5, 3), (200, 17, 33), (13, 33, 2)]


def _numpy_index(index: UOp, axes: dict[int, np.ndarray], values: dict[str, int]) -> np.ndarray:
    """Every value `index` takes over the enclosing ranges (numpy broadcasting, C integer division)."""
    memo: dict[int, np.ndarray] = {}
    for n in index.toposort():
        s = [memo[id(x)] for x in n.src]
        if n.op is Ops.RANGE:
            v = axes[id(n)]
        elif n.op is Ops.CONST:
            v = np.int64(n.arg)
        elif n.op is Ops.DEFINE_VAR:
            v = np.int64(values[n.arg[0]])
        elif n.op is Ops.ADD:
            v = s[0] + s[1]
        elif n.op is Ops.SUB:
            v = s[0] - s[1]
        elif n.op is Ops.MUL:
            v = s[0] * s[1]
        elif n.op is Ops.IDIV:
            v = np.sign(s[0]) * np.sign(s[1]) * (np.abs(s[0]) // np.abs(s[1]))
        elif n.op is Ops.MOD:
            v = s[0] - s[1] * (np.sign(s[0]) * np.sign(s[1]) * (np.abs(s[0]) // np.abs(s[1])))
        elif n.op is Ops.MAX:
            v = np.maximum(s[0], s[1])
        elif n.op is Ops.MIN:
            v = np.minimum(s[0], s[1])
        else:
            raise AssertionError(f"unexpected {n.op} in a matmul index")
        memo[id(n)] = v
    return memo[id(index)]


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("symbolic", [True, False], ids=["symbolic", "static"])
@pytest.mark.parametrize("lanes", [False, True], ids=["scalar", "lanes"])
def test_register_tile_bounds_are_exact_and_inside_the_buffers(tile, symbolic, lanes):
    for M, N, Kd in SIZES:
        ast = K.matmul() if symbolic else K.matmul(M, N, Kd)
        caps = Capabilities(has_threads=True, register_tile=tile, tile_lanes=LANES[tile] if lanes else 0)
        _, info = lower(ast, caps, "mm")
        values = info.values_from({"M": M, "N": N, "K": Kd} if symbolic else {})
        _, _, bounds, _ = info.prepare(values)
        sizes = [M * Kd, Kd * N, M * N]
        touched: dict[int, list[int]] = {}
        checked: dict[int, list[int]] = {}
        for a, b in zip(info.accesses, bounds):
            assert a.index.free_ranges <= set(a.enclosing)
            ends = [evaluate(r.src[0], values) for r in a.enclosing]
            if b is None:
                assert min(ends, default=1) <= 0
                continue
            grids = np.meshgrid(*[np.arange(e, dtype=np.int64) for e in ends], indexing="ij", sparse=True)
            idx = _numpy_index(a.index, {id(r): g for r, g in zip(a.enclosing, grids)}, values)
            lo, hi = int(np.min(idx)), int(np.max(idx))
            slot, _, clo, chi = b
            assert clo <= lo and hi <= chi, f"unsound: checked [{clo}, {chi}], touched [{lo}, {hi}]"
            t, c = touched.setdefault(slot, [lo, hi]), checked.setdefault(slot, [clo, chi])
            t[0], t[1], c[0], c[1] = min(t[0], lo), max(t[1], hi), min(c[0], clo), max(c[1], chi)
        for slot, (lo, hi) in touched.items():
            assert 0 <= lo and hi < sizes[slot], f"{(M, N, Kd)}: slot {slot} touches [{lo}, {hi}] of {sizes[slot]}"
            # every element of each matrix is used, and the check claims no more than that
            assert (lo, hi) == (0, sizes[slot] - 1) == tuple(checked[slot]), (M, N, Kd, slot, checked[slot])


def test_readme_symbolic_matmul_runs_on_every_tile_shape_the_host_has(cpu, rng):
    for M, N, Kd in [(64, 128, 256), (60, 128, 256), (66, 130, 257)]:
        a, b = rng.standard_normal((M, Kd)).astype(np.float32), rng.standard_normal((Kd, N)).astype(np.float32)
        out = cpu.empty(M * N, dtypes.float32)
        cpu.compile(K.matmul())(cpu.buf(a), cpu.buf(b), out, M=M, N=N, K=Kd)
        np.testing.assert_allclose(out.numpy().reshape(M, N), a @ b, rtol=1e-4, atol=1e-4)


# ---- WHERE narrows the check ----------------------------------------------------------------

D = 37     # table rows; index data is random in a wider range


def _gather(index_of) -> UOp:
    """out[i] = table[index_of(idx[i], i, n)]: the index built from loaded data, as an executor does."""
    table, idx, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.int32), UOp.param(2, dtypes.float32)
    n = UOp.variable("n", 1, 1 << 24)
    i = UOp.range(n, 0)
    return UOp.sink(out.store(i, table.load(index_of(idx.load(i), i, n))))


def _run(device, ast, ix, table=None):
    table = np.random.default_rng(1).standard_normal(D).astype(np.float32) if table is None else table
    out = device.empty(len(ix), dtypes.float32)
    device.compile(ast)(device.buf(table), device.buf(ix.astype(np.int32)), out, n=len(ix))
    return out.numpy(), table


def test_python_style_negative_gather_index(device, rng):
    """j = clamp(idx, -D, D-1); j < 0 ? j + D : j -- the true arm sees j in [-D, -1], the false one [0, D-1]."""
    def index_of(x, i, n):
        j = x.clamp(-D, D - 1)
        return (j < 0).where(j + D, j)
    ix = rng.integers(-D, D, 1003)
    got, table = _run(device, _gather(index_of), ix)
    np.testing.assert_array_equal(got, table[ix])


def test_a_wrong_arm_is_still_refused(device, rng):
    def index_of(x, i, n):
        j = x.clamp(-D, D - 1)
        return (j < 0).where(j + D + 1, j)      # j = -1 reads row D
    with pytest.raises(LaunchError, match=r"may touch indices \[0, 37\]"):
        _run(device, _gather(index_of), rng.integers(-D, D, 100))


def test_greater_equal_narrows_through_not(device, rng):
    def index_of(x, i, n):
        j = x.clamp(-D, D - 1)
        return (j >= 0).where(j, j + D)         # >= is NOT(<): the arms swap their facts
    ix = rng.integers(-D, D, 1003)
    got, table = _run(device, _gather(index_of), ix)
    np.testing.assert_array_equal(got, table[ix % D])


def test_and_narrows_both_sides_of_the_true_arm(device, rng):
    """An unclamped index used only where 0 <= j < D: the true arm needs both facts."""
    def index_of(x, i, n):
        return ((x >= 0) & (x < D)).where(x, 0)
    ix = rng.integers(-100, 100, 1003)
    got, table = _run(device, _gather(index_of), ix)
    np.testing.assert_array_equal(got, np.where((ix >= 0) & (ix < D), table[np.clip(ix, 0, D - 1)], table[0]))


def test_and_does_not_narrow_its_false_arm(device, rng):
    def index_of(x, i, n):
        return ((x >= 0) & (x < D)).where(0, x)     # the false arm runs when either fact fails
    with pytest.raises(LaunchError, match="may touch indices"):
        _run(device, _gather(index_of), rng.integers(0, D, 100))


def test_or_narrows_its_false_arm(device, rng):
    def index_of(x, i, n):
        return ((x < 0) | (x >= D)).where(D - 1, x)
    ix = rng.integers(-100, 100, 1003)
    got, table = _run(device, _gather(index_of), ix)
    np.testing.assert_array_equal(got, table[np.where((ix < 0) | (ix >= D), D - 1, ix)])


def test_equal_narrows_the_true_arm_to_the_value(device, rng):
    def index_of(x, i, n):
        return (x == 5).where(x, 0)
    ix = rng.integers(-1000, 1000, 1003)
    ix[::7] = 5
    got, table = _run(device, _gather(index_of), ix)
    np.testing.assert_array_equal(got, table[np.where(ix == 5, 5, 0)])


def test_not_equal_cuts_off_an_end(device, rng):
    """i != 0 ? i - 1 : 0 over i in [0, n): the true arm sees i in [1, n-1]."""
    prog = device.compile(_copy_rows(lambda i, n: (i != 0).where(i - 1, 0)))
    t = rng.standard_normal(D).astype(np.float32)
    o = device.empty(D, dtypes.float32)
    prog(device.buf(t), o, n=D)
    np.testing.assert_array_equal(o.numpy(), t[np.maximum(np.arange(D) - 1, 0)])


def _copy_rows(index_of) -> UOp:
    """out[i] = table[index_of(i, n)]: an index of the loop variable and sizes only."""
    table, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)
    n = UOp.variable("n", 1, 1 << 24)
    i = UOp.range(n, 0)
    return UOp.sink(out.store(i, table.load(index_of(i, n))))


def test_compare_with_a_variable_narrows(device, rng):
    """i < m ? i : m - 1 with m a bound variable: the true arm sees i <= m - 1."""
    m = UOp.variable("m", 1, 1 << 20)
    prog = device.compile(_copy_rows(lambda i, n: (i < m).where(i, m - 1)))
    t = rng.standard_normal(D).astype(np.float32)
    o = device.empty(100, dtypes.float32)
    prog(device.buf(t), o, n=100, m=20)
    np.testing.assert_array_equal(o.numpy(), t[np.minimum(np.arange(100), 19)])
    with pytest.raises(LaunchError, match=r"may touch indices \[0, 49\]"):     # m past the table
        prog(device.buf(t), o, n=100, m=50)


def test_an_unreachable_arm_does_not_count(device, rng):
    prog = device.compile(_copy_rows(lambda i, n: (i < 0).where(i + (1 << 20), i)))   # a range is never < 0
    t = rng.standard_normal(D).astype(np.float32)
    o = device.empty(D, dtypes.float32)
    prog(device.buf(t), o, n=D)
    np.testing.assert_array_equal(o.numpy(), t)


def test_a_float_condition_does_not_narrow(device, rng):
    def index_of(x, i, n):
        j = x.clamp(-D, D - 1)
        return (j.cast(dtypes.float32) < 0.0).where(j + D, j)
    with pytest.raises(LaunchError, match=r"may touch indices \[-37, 73\]"):
        _run(device, _gather(index_of), rng.integers(-D, D, 100))


def test_narrowing_keeps_the_overflow_check_of_the_unselected_arm(cpu):
    """Both arms are computed: an arm that overflows the index type is refused even where it is unused."""
    big = UOp.variable("big", 0, 2**31 - 1)
    prog = cpu.compile(_copy_rows(lambda i, n: (i < 0).where(i * big, i)))
    with pytest.raises(LaunchError, match="outside int32"):
        prog(cpu.buf(np.ones(D, np.float32)), cpu.empty(D, dtypes.float32), n=D, big=2**30)


def test_narrowing_rules_match_brute_force():
    """Every rule against enumeration: for each small interval and constant, the narrowed interval of
    c.where(x + 100, x) contains every value the expression takes and equals the exact range."""
    from morok_py.codegen.symbolic import interval_of, narrowed_interval
    n = UOp.variable("n", -8, 8)
    m = UOp.variable("m", -8, 8)
    x = UOp.range(UOp.const(9), 0) + n      # x in [n, n + 8]
    conds = {
        "lt": lambda k: x < k, "gt": lambda k: x > k, "le": lambda k: x <= k, "ge": lambda k: x >= k,
        "eq": lambda k: x == k, "ne": lambda k: x != k, "lt_var": lambda k: x < m,
        "and": lambda k: (x >= k) & (x < k + 3), "or": lambda k: (x < k) | (x > k + 3),
    }
    for (name, cond), nv, mv, k in itertools.product(conds.items(), range(-3, 4), (-2, 5), range(-4, 12, 3)):
        e = cond(k).where(x + 100, x)
        values = {"n": nv, "m": mv}
        plain: dict[int, tuple] = {}
        for node in e.toposort():
            plain[id(node)] = interval_of(node, [plain[id(s)] for s in node.src], values, lambda r: 9)
        got = narrowed_interval(e, plain, values, lambda r: 9)
        xs = np.arange(nv, nv + 9)
        holds = {"lt": xs < k, "gt": xs > k, "le": xs <= k, "ge": xs >= k, "eq": xs == k, "ne": xs != k,
                 "lt_var": xs < mv, "and": (xs >= k) & (xs < k + 3), "or": (xs < k) | (xs > k + 3)}[name]
        vals = np.where(holds, xs + 100, xs)
        assert got[0] <= vals.min() and vals.max() <= got[1], (name, nv, mv, k, got)
        if name in ("lt", "gt", "le", "ge", "lt_var"):   # one-sided facts are exact on both arms; ==, !=,
            assert got == (vals.min(), vals.max()), (name, nv, mv, k, got)  # AND, OR narrow one arm only


def test_where_constants_take_the_other_arms_type():
    """mask.where(36, x): the 36 is x's type, not the bool condition's (it used to become True)."""
    x = UOp.param(0, dtypes.int32).load(0)
    mask = x < 3
    assert mask.where(36, x).src[1] is UOp.const(36, dtypes.int32)
    assert mask.where(x, 36).src[2] is UOp.const(36, dtypes.int32)
    h = UOp.param(1, dtypes.float16).load(0)
    assert mask.where(h, 3).src[2] is UOp.const(3.0, dtypes.float16)
    assert mask.where(1.5, 2).dtype is dtypes.float32
    assert mask.where(True, False).dtype is dtypes.bool
