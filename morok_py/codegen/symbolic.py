"""Index arithmetic: constant folding and identities on UOps, concrete evaluation of integer
expressions at launch time, and interval (min/max) analysis of load/store indices."""
from __future__ import annotations

import math
from operator import is_not
from typing import Any, Callable, Mapping

from ..dtypes import DType, dtypes
from ..errors import ArgumentError
from ..ir import INT_DIVISION, Ops, UOp, toposort_outside

# ---------------------------------------------------------------------------------------------
# folding


def _c_idiv(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _c_mod(a: int, b: int) -> int:
    return a - b * _c_idiv(a, b)


def int_divide(op: Ops, a: int, b: int, dt: DType | None = None) -> int:
    """What IDIV / MOD / CDIV / CMOD give for a and b (ir.INT_DIVISION): floor or truncating, 0 for
    b == 0; with `dt` the quotient wraps to it (INT_MIN // -1 == INT_MIN)."""
    if b == 0:
        return 0
    if op is Ops.MOD: return a % b
    if op is Ops.CMOD: return _c_mod(a, b)
    q = a // b if op is Ops.IDIV else _c_idiv(a, b)
    return _wrap(q, dt) if dt is not None and dt.is_int else q


def _wrap(v: int, dt: DType) -> int:
    """Two's-complement wrap of an int to dt (C semantics of fixed-width integers)."""
    bits = dt.bits
    v &= (1 << bits) - 1
    if dt.kind == "i" and v >= 1 << (bits - 1):
        v -= 1 << bits
    return v


def _is_const(u: UOp, value: Any = None) -> bool:
    return u.op is Ops.CONST and (value is None or (u.arg == value and type(u.arg) is not bool or u.arg is value))


_INT_FOLD: dict[Ops, Callable[[int, int], int]] = {
    Ops.ADD: lambda a, b: a + b, Ops.SUB: lambda a, b: a - b, Ops.MUL: lambda a, b: a * b,
    Ops.MAX: max, Ops.MIN: min, Ops.AND: lambda a, b: a & b, Ops.OR: lambda a, b: a | b,
    Ops.XOR: lambda a, b: a ^ b,
}


_FOLDED = frozenset(_INT_FOLD) | INT_DIVISION
# the names of the ops `fold` may change (membership by name: a str hashes in C, an Ops member in Python)
_FOLDED_NAMES = frozenset(o.name for o in _FOLDED)
_FOLDS_NAMES = _FOLDED_NAMES | frozenset(o.name for o in (Ops.MUL, Ops.CAST, Ops.WHERE, Ops.CMPLT, Ops.CMPEQ,
                                                           Ops.CMPNE, Ops.NOT))


def fold(node: UOp) -> UOp:
    """One step of folding on a node whose sources are already folded."""
    op, src = node.op, node.src
    name = op._name_ if type(op) is Ops else None
    if name not in _FOLDS_NAMES:
        return node
    if name in _FOLDED_NAMES and node.dtype.is_int:
        a, b = src
        if a.op is Ops.CONST and b.op is Ops.CONST:
            if op in INT_DIVISION:
                return UOp.const(int_divide(op, a.arg, b.arg, node.dtype), node.dtype)
            return UOp.const(_wrap(_INT_FOLD[op](a.arg, b.arg), node.dtype), node.dtype)
        if op is Ops.ADD:
            if _is_const(b, 0): return a
            if _is_const(a, 0): return b
        if op is Ops.SUB and _is_const(b, 0): return a
        if op is Ops.MUL:
            if _is_const(b, 1): return a
            if _is_const(a, 1): return b
            if _is_const(b, 0) or _is_const(a, 0): return UOp.const(0, node.dtype)
        if op in INT_DIVISION:
            # x // 1 == x, x % 1 == 0 and x // 0 == x % 0 == 0, for floor and truncating division alike
            if _is_const(b, 1) and op in (Ops.IDIV, Ops.CDIV): return a
            if _is_const(b, 1) or _is_const(b, 0): return UOp.const(0, node.dtype)
            if _is_const(b, -1):    # a negation that wraps (INT_MIN // -1 == INT_MIN); the remainder is 0
                return UOp(Ops.NEG, node.dtype, (a,), None) if op in (Ops.IDIV, Ops.CDIV) else UOp.const(0, node.dtype)
            # (x * c) // c -> x and (x * c) % c -> 0 hold for floor and truncating division when x*c
            # does not wrap, which the launch-time bounds check guarantees for index math (only there)
            if node.dtype is dtypes.index and b.op is Ops.CONST and b.arg > 0 and a.op is Ops.MUL \
                    and a.src[1].op is Ops.CONST and a.src[1].arg == b.arg:
                return a.src[0] if op in (Ops.IDIV, Ops.CDIV) else UOp.const(0, node.dtype)
    if op is Ops.MUL and node.dtype.is_float:
        a, b = src
        if _is_const(b, 1.0): return a
        if _is_const(a, 1.0): return b
    if op is Ops.CAST and src[0].op is Ops.CONST:
        v = src[0].arg
        dt = node.dtype
        if dt.is_float:
            return UOp.const(float(v), dt)
        if dt.is_bool:
            return UOp.const(bool(v), dt)
        if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
            return node
        return UOp.const(_wrap(int(v), dt), dt)
    if op is Ops.WHERE and src[0].op is Ops.CONST:
        return src[1] if src[0].arg else src[2]
    if op in (Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE) and src[0].op is Ops.CONST and src[1].op is Ops.CONST:
        a, b = src[0].arg, src[1].arg
        return UOp.const({Ops.CMPLT: a < b, Ops.CMPEQ: a == b, Ops.CMPNE: a != b}[op], dtypes.bool)
    if op is Ops.NOT and src[0].op is Ops.CONST and src[0].dtype.is_bool:
        return UOp.const(not src[0].arg, dtypes.bool)
    return node


def rewrite(root: UOp, fn: Callable[[UOp], UOp | None]) -> UOp:
    """Bottom-up rewrite: rebuild each node from rewritten sources, then apply `fn` until it
    returns None (no change); the result is folded."""
    return _rewrite(root, fn, {})


def _rewrite(root: UOp, fn: Callable[[UOp], UOp | None], memo: dict[UOp, UOp]) -> UOp:
    """`rewrite` sharing `memo` (node -> its rewritten form; the keys keep their nodes alive) with the
    rewrites of the subgraphs `fn` builds: a node's rewritten form depends on the node alone (`fn` is a
    function of the node), so a node reached again is not rewritten again."""
    hit = memo.get(root)
    if hit is not None:
        return hit
    get = memo.__getitem__
    for node in toposort_outside(root, memo):
        src = node.src
        new_src = tuple(map(get, src))
        cur = UOp(node.op, node.dtype, new_src, node.arg) if any(map(is_not, new_src, src)) else node
        for _ in range(64):
            nxt = fn(cur)
            if nxt is None or nxt is cur:
                break
            # a decomposition builds a new subgraph: rewrite it too so its parts get folded
            cur = _rewrite(nxt, fn, memo) if nxt.src else nxt
        memo[node] = fold(cur)
    return memo[root]


def simplify(root: UOp) -> UOp:
    """`rewrite` with no rule: the folding alone."""
    memo: dict[UOp, UOp] = {}
    get = memo.__getitem__
    for node in toposort_outside(root, memo):
        src = node.src
        if src:
            new_src = tuple(map(get, src))
            memo[node] = fold(UOp(node.op, node.dtype, new_src, node.arg) if any(map(is_not, new_src, src)) else node)
        else:
            memo[node] = fold(node)
    return memo[root]


# ---------------------------------------------------------------------------------------------
# concrete evaluation of launch-time integer expressions (range ends, launch sizes)


def evaluate(expr: UOp, values: Mapping[str, int]) -> int:
    """Evaluate an integer expression of variables and constants."""
    memo: dict[int, int] = {}
    for node in expr.toposort():
        memo[id(node)] = _eval_node(node, [memo[id(s)] for s in node.src], values)
    return memo[id(expr)]


def _eval_node(node: UOp, s: list, values: Mapping[str, int]) -> Any:
    op = node.op
    if op is Ops.CONST: return node.arg
    if op is Ops.DEFINE_VAR: return values[node.arg[0]]
    if op is Ops.ADD: return s[0] + s[1]
    if op is Ops.SUB: return s[0] - s[1]
    if op is Ops.MUL: return s[0] * s[1]
    if op in INT_DIVISION: return int_divide(op, s[0], s[1], node.dtype)
    if op is Ops.MAX: return max(s[0], s[1])
    if op is Ops.MIN: return min(s[0], s[1])
    if op is Ops.NEG: return -s[0]
    if op is Ops.SHL: return s[0] << s[1]
    if op is Ops.SHR: return s[0] >> s[1]
    if op is Ops.AND: return s[0] & s[1]
    if op is Ops.OR: return s[0] | s[1]
    if op is Ops.XOR: return s[0] ^ s[1]
    if op is Ops.CMPLT: return s[0] < s[1]
    if op is Ops.CMPEQ: return s[0] == s[1]
    if op is Ops.CMPNE: return s[0] != s[1]
    if op is Ops.WHERE: return s[1] if s[0] else s[2]
    if op is Ops.CAST: return int(s[0])
    raise ArgumentError(f"{op.name} cannot appear in a launch-time size expression")


# ---------------------------------------------------------------------------------------------
# interval analysis

Interval = tuple  # (lo, hi) with Python ints (floats for float values)


def _dtype_range(dt: DType) -> Interval:
    return (dt.min(), dt.max())


def _corners(f, a: Interval, b: Interval) -> Interval:
    vals = [f(x, y) for x in a for y in b]
    return (min(vals), max(vals))


_EXACT = INT_DIVISION | frozenset({Ops.ADD, Ops.SUB, Ops.MUL, Ops.MAX, Ops.MIN, Ops.NEG, Ops.AND, Ops.OR,
                    Ops.XOR, Ops.SHL, Ops.SHR, Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE, Ops.WHERE, Ops.CAST, Ops.NOT})


def _exact(op: Ops, node: UOp, v: list) -> int | None:
    """The value of an integer/bool node whose sources are known exactly, as the kernel computes it
    (division as ir.INT_DIVISION defines it, two's-complement wrap for bitwise ops and casts); None
    where that is not plain (a shift past the width, a cast from a float)."""
    dt = node.dtype
    if dt is None or not (dt.is_int or dt.is_bool):
        return None
    if op in (Ops.SHL, Ops.SHR) and not (v[0] >= 0 and 0 <= v[1] < dt.bits):
        return None
    if op is Ops.CAST and not (node.src[0].dtype.is_int or node.src[0].dtype.is_bool):
        return None
    if op is Ops.NOT:
        return int(not v[0]) if dt.is_bool else _wrap(~v[0], dt)
    r = int(_eval_node(node, v, {}))
    # arithmetic is left unwrapped so that the launch check sees (and refuses) an overflow
    return _wrap(r, dt) if op in (Ops.AND, Ops.OR, Ops.XOR, Ops.CAST) and not dt.is_bool else r


def _division_interval(op: Ops, x: Interval, y: Interval) -> Interval:
    """The values of x op y (ir.INT_DIVISION) over the nonzero divisors of y, and 0 where y may be 0.
    Quotients are not wrapped (INT_MIN // -1 shows as an overflow, like other arithmetic)."""
    parts: list[Interval] = []
    if y[0] <= 0 <= y[1]:
        parts.append((0, 0))
    for lo, hi in ((max(y[0], 1), y[1]), (y[0], min(y[1], -1))):
        if lo > hi:
            continue
        if op is Ops.IDIV:      # floor and truncation are monotone in x, and in y on one side of 0
            parts.append(_corners(lambda a, b: a // b, x, (lo, hi)))
        elif op is Ops.CDIV:
            parts.append(_corners(_c_idiv, x, (lo, hi)))
        elif op is Ops.CMOD:    # the dividend's sign, below |y| and |x| in magnitude
            m = max(abs(lo), abs(hi)) - 1
            parts.append((0 if x[0] >= 0 else max(x[0], -m), 0 if x[1] <= 0 else min(x[1], m)))
        elif lo > 0:            # MOD by a positive divisor: [0, y), and x itself where x >= 0
            parts.append((0, min(x[1], hi - 1) if x[0] >= 0 else hi - 1))
        else:                   # MOD by a negative divisor: (y, 0], and x itself where x <= 0
            parts.append((max(x[0], lo + 1) if x[1] <= 0 else lo + 1, 0))
    return (min(p[0] for p in parts), max(p[1] for p in parts))


def static_intervals(root: UOp) -> dict[int, Interval]:
    """id -> [lo, hi] of every node of `root` for any launch: variables over their declared bounds,
    ranges over [0, end - 1] for their largest end, loaded data over its dtype. Sound under
    wrap-around: an interval that leaves its dtype becomes the whole dtype."""
    memo: dict[int, Interval] = {}
    for node in root.toposort():
        op, dt = node.op, node.dtype
        if op is Ops.DEFINE_VAR:
            iv = (node.arg[1], node.arg[2])
        elif op is Ops.RANGE:
            iv = (0, max(0, memo[id(node.src[0])][1] - 1))
        else:
            iv = interval_of(node, [memo[id(s)] for s in node.src], {}, lambda r: 0)
        if dt is not None and dt.is_int and (iv[0] < dt.min() or iv[1] > dt.max()):
            iv = _dtype_range(dt)
        memo[id(node)] = iv
    return memo


def interval_of(node: UOp, s: list[Interval], values: Mapping[str, int],
                range_end: Callable[[UOp], int]) -> Interval:
    """The [lo, hi] a node can take given the intervals of its sources (sound, maybe loose)."""
    op, dt = node.op, node.dtype
    if op is Ops.CONST:
        return (node.arg, node.arg)
    if op is Ops.DEFINE_VAR:
        v = values[node.arg[0]]
        return (v, v)
    if op is Ops.RANGE:
        return (0, max(0, range_end(node) - 1))
    if dt is not None and dt.is_float:
        return (float("-inf"), float("inf"))
    if op in _EXACT and all(lo == hi for lo, hi in s):
        # every source is one known value (a size expression of the bound variables): the node's value
        # is known exactly. The interval rules below are only sound, and compose loosely: N % 16 with
        # N = 128 would be [0, 15], and a tile count built from it several rows too many
        exact = _exact(op, node, [lo for lo, _ in s])
        if exact is not None:
            return (exact, exact)
    if op is Ops.ADD: return (s[0][0] + s[1][0], s[0][1] + s[1][1])
    if op is Ops.SUB: return (s[0][0] - s[1][1], s[0][1] - s[1][0])
    if op is Ops.MUL: return _corners(lambda x, y: x * y, s[0], s[1])
    if op is Ops.NEG: return (-s[0][1], -s[0][0])
    if op is Ops.MAX: return (max(s[0][0], s[1][0]), max(s[0][1], s[1][1]))
    if op is Ops.MIN: return (min(s[0][0], s[1][0]), min(s[0][1], s[1][1]))
    if op is Ops.WHERE: return (min(s[1][0], s[2][0]), max(s[1][1], s[2][1]))
    if op in INT_DIVISION:
        return _division_interval(op, s[0], s[1])
    if op is Ops.AND and s[0][0] >= 0 and s[1][0] >= 0:
        return (0, min(s[0][1], s[1][1]))
    if op is Ops.SHL and s[0][0] >= 0 and 0 <= s[1][0] and s[1][1] < dt.bits:
        return (s[0][0] << s[1][0], s[0][1] << s[1][1])
    if op is Ops.SHR and s[0][0] >= 0 and 0 <= s[1][0] and s[1][1] < dt.bits:
        return (s[0][0] >> s[1][1], s[0][1] >> s[1][0])
    if op in (Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE, Ops.NOT) and dt.is_bool:
        return (0, 1)
    if op is Ops.CAST and node.src[0].dtype.is_int or op is Ops.CAST and node.src[0].dtype.is_bool:
        lo, hi = s[0]
        dlo, dhi = _dtype_range(dt)
        if dlo <= lo and hi <= dhi:
            return (lo, hi)
    return _dtype_range(dt) if dt is not None else (0, 0)


# ---------------------------------------------------------------------------------------------
# WHERE narrowing: c.where(a, b) reads a only where c holds and b only where it does not


def _narrowables(root: UOp) -> tuple[dict[int, frozenset[int]], set[int]]:
    """(deps, above): deps maps id(node) -> ids of the integer nodes compared in a WHERE condition
    that `node` depends on (empty sets left out): only those nodes can be narrowed by a WHERE above
    them. `above` holds the ids of nodes with a narrowing WHERE at or below them."""
    compared: set[int] = set()
    wheres: set[int] = set()
    for n in root.toposort():
        if n.op is Ops.WHERE:
            wheres.add(id(n))
            stack = [n.src[0]]
            while stack:
                c = stack.pop()
                if c.op in (Ops.NOT, Ops.AND, Ops.OR) and c.dtype.is_bool:
                    stack.extend(c.src)
                elif c.op in (Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE) and c.src[0].dtype.is_int:
                    compared.update(id(x) for x in c.src if x.op is not Ops.CONST)
    deps: dict[int, frozenset[int]] = {}
    above: set[int] = set()
    if not compared:
        return deps, above
    for n in root.toposort():
        d = frozenset({id(n)}) if id(n) in compared else frozenset()
        for s in n.src:
            d |= deps.get(id(s), frozenset())
        if d:
            deps[id(n)] = d
        if id(n) in wheres or any(id(s) in above for s in n.src):
            above.add(id(n))
    return deps, above


def narrowed_interval(root: UOp, plain: Mapping[int, Interval], values: Mapping[str, int],
                      range_end: Callable[[UOp], int]) -> Interval:
    """The interval of `root` with every WHERE's arms analysed under their condition: in
    `c.where(a, b)` where c compares integer expressions (x < y, x == y, x != y, and NOT / AND / OR of
    such), a is analysed with x and y narrowed to the side where c holds and b to the side where it
    fails; an arm that cannot run (an empty narrowed interval) does not count. `plain` holds every
    node's interval without narrowing (the launch check's first pass, which also proved that no node
    overflows whatever the conditions: an unselected arm is still computed).

    Sound because UOps are hash-consed: the x inside a is the very value the condition tested."""
    deps, above = _narrowables(root)
    if not deps:
        return plain[id(root)]
    memo: dict[tuple, Interval] = {}

    def iv(node: UOp, env: dict[int, Interval]) -> Interval:
        if id(node) not in above and not (env and deps.get(id(node), frozenset()) & env.keys()):
            return plain[id(node)]
        if id(node) in env:
            return env[id(node)]
        key = (id(node), tuple(sorted(env.items())))
        hit = memo.get(key)
        if hit is not None:
            return hit
        if node.op is Ops.WHERE:
            arms = []
            for truth, arm in ((True, node.src[1]), (False, node.src[2])):
                sub = narrow(node.src[0], env, truth)
                if sub is not None:
                    arms.append(iv(arm, sub))
            out = (min(a[0] for a in arms), max(a[1] for a in arms)) if arms else plain[id(node)]
        else:
            out = interval_of(node, [iv(s, env) for s in node.src], values, range_end)
            p = plain[id(node)]     # narrowing never widens (the plain rules may be looser than exact)
            out = (max(out[0], p[0]), min(out[1], p[1])) if out[0] <= p[1] and p[0] <= out[1] else out
        memo[key] = out
        return out

    def clip(env: dict[int, Interval] | None, x: UOp, lo, hi) -> dict[int, Interval] | None:
        if env is None or x.op is Ops.CONST:
            return env
        cur = iv(x, env)
        new = (max(cur[0], lo), min(cur[1], hi))
        if new[0] > new[1]:
            return None     # the arm is unreachable
        if new == cur:
            return env
        return {**env, id(x): new}

    def narrow(c: UOp, env: dict[int, Interval] | None, truth: bool) -> dict[int, Interval] | None:
        """env with the facts of `c == truth` added; None where that cannot hold."""
        if env is None:
            return None
        if c.op is Ops.CONST:
            return env if bool(c.arg) == truth else None
        if c.op is Ops.NOT and c.dtype.is_bool:
            return narrow(c.src[0], env, not truth)
        if c.op in (Ops.AND, Ops.OR) and c.dtype.is_bool:
            if (c.op is Ops.AND) == truth:      # both hold (AND true) or both fail (OR false)
                return narrow(c.src[1], narrow(c.src[0], env, truth), truth)
            return env
        if c.op not in (Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE) or not c.src[0].dtype.is_int:
            return env
        x, y = c.src
        X, Y = iv(x, env), iv(y, env)
        if c.op is Ops.CMPLT:
            if truth:       # x < y
                env = clip(env, x, X[0], Y[1] - 1)
                return clip(env, y, X[0] + 1, Y[1]) if env is not None else None
            env = clip(env, x, Y[0], X[1])          # x >= y
            return clip(env, y, Y[0], X[1]) if env is not None else None
        if (c.op is Ops.CMPEQ) == truth:            # x == y
            lo, hi = max(X[0], Y[0]), min(X[1], Y[1])
            env = clip(env, x, lo, hi)
            return clip(env, y, lo, hi) if env is not None else None
        # x != y: only an end of one side can be cut off, where the other side is one known value
        for a, A, B in ((x, X, Y), (y, Y, X)):
            if B[0] == B[1] and env is not None:
                if A[0] == B[0]:
                    env = clip(env, a, A[0] + 1, A[1])
                elif A[1] == B[0]:
                    env = clip(env, a, A[0], A[1] - 1)
        return env

    return iv(root, {})
