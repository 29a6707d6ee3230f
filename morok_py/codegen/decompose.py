"""Decompositions a renderer can ask for through `Renderer.decompositor()`: rewrites of ops a
target lacks, or has only as slow scalar library calls, into plain ALU ops that vectorize."""
from __future__ import annotations

from typing import Callable

from ..dtypes import DType, dtypes
from ..ir import INT_DIVISION, Ops, UOp
from .symbolic import Interval, static_intervals

# 2**f on [-0.5, 0.5], degree 6, relative error 1.9e-9 (least squares on Chebyshev nodes)
_EXP2_POLY = (1.0000000005920209, 0.6931472056005099, 0.24022646608714093, 0.055503289975169734,
              0.009618519534337691, 0.0013399860363405708, 0.00015337576838359186)


def exp2_float32(x: UOp) -> UOp:
    """2**x for float32 in plain ALU ops: 2**n * p(f) with n = round(x), f = x - n.

    Results below 2**-126 flush to zero; NaN stays NaN; overflow gives inf.
    """
    xc = x.maximum(-126.0).minimum(128.0)
    n = (xc + (xc < 0.0).where(-0.5, 0.5)).trunc()
    f = xc - n
    p = UOp.const(_EXP2_POLY[-1], dtypes.float32)
    for c in reversed(_EXP2_POLY[:-1]):
        p = p * f + c
    # 2**(n-1) built from the exponent bits, times 2: keeps 2**127.x finite
    scale = ((n.cast(dtypes.int32) + 126) << 23).bitcast(dtypes.float32)
    res = p * scale * 2.0
    return (x != x).where(x, res)


def vector_friendly_math(node: UOp) -> UOp | None:
    """EXP2 on float32/float16/bfloat16 as a polynomial (libm's exp2f is a scalar call that blocks
    vectorization); float64 keeps the library call for its accuracy."""
    if node.op is Ops.EXP2 and node.dtype is not None and node.dtype.name in ("float32", "float16", "bfloat16") \
            and not getattr(node, "_decomposed", False):
        x = node.src[0]
        if node.dtype is dtypes.float32:
            return exp2_float32(x)
        return exp2_float32(x.cast(dtypes.float32)).cast(node.dtype)
    return None


def chain(*rules: Callable[[UOp], UOp | None]) -> Callable[[UOp], UOp | None]:
    def apply(node: UOp) -> UOp | None:
        for r in rules:
            out = r(node)
            if out is not None:
                return out
        return None
    return apply


_INT_DIVISION_NAMES = frozenset(op.name for op in INT_DIVISION)


def defined_division(root: UOp) -> UOp:
    """Every IDIV / MOD / CDIV / CMOD of `root` as machine division that cannot trap, computing what
    ir.INT_DIVISION defines. Where range analysis (symbolic.static_intervals) proves the divisor
    nonzero, no INT_MIN / -1, and floor equal to truncation, the node is left as it is: index
    arithmetic renders unchanged. Renderers print all four ops as plain sdiv / srem (C's / and %)."""
    nodes = root.toposort()
    if not any(type(n.op) is Ops and n.op._name_ in _INT_DIVISION_NAMES for n in nodes):   # by name: a str hashes in C
        return root
    iv = static_intervals(root)
    memo: dict[int, UOp] = {}
    for node in nodes:
        src = tuple(memo[id(s)] for s in node.src)
        new = node if all(a is b for a, b in zip(src, node.src)) else UOp(node.op, node.dtype, src, node.arg)
        if node.op in INT_DIVISION:
            new = _safe_division(node.op, src[0], src[1], iv[id(node.src[0])], iv[id(node.src[1])], node.dtype)
        memo[id(node)] = new
    return memo[id(root)]


def _safe_division(op: Ops, x: UOp, y: UOp, X: Interval, Y: Interval, dt: DType) -> UOp:
    """x op y given the intervals X of x and Y of y: the divisor is replaced by 1 where it is 0 (the
    quotient then selected to 0; the remainder x % 1 is 0 already) or where x == INT_MIN and y == -1
    (x / 1 == INT_MIN is the wrapped quotient, x % 1 == 0 the remainder); floor division steps the
    truncated quotient down by one where the remainder is nonzero and its sign differs from y's."""
    signed = not dt.is_unsigned
    may_zero = Y[0] <= 0 <= Y[1]
    may_wrap = signed and X[0] <= dt.min() and Y[0] <= -1 <= Y[1]
    same_signs = (X[0] >= 0 and Y[0] >= 0) or (X[1] <= 0 and Y[1] <= 0)
    floor_fix = op in (Ops.IDIV, Ops.MOD) and signed and not same_signs
    if not (may_zero or may_wrap or floor_fix):
        return UOp(op, dt, (x, y), None)
    bad = (y == 0) if may_zero else None
    if may_wrap:
        wraps = (x == dt.min()) & (y == -1)
        bad = wraps if bad is None else bad | wraps
    ys = bad.where(1, y) if bad is not None else y
    quotient = op in (Ops.IDIV, Ops.CDIV)
    if not floor_fix:
        if not quotient:
            return UOp(Ops.CMOD, dt, (x, ys), None)
        q = UOp(Ops.CDIV, dt, (x, ys), None)
        return (y == 0).where(0, q) if may_zero else q
    r = UOp(Ops.CMOD, dt, (x, ys), None)
    # adjust where r != 0 and sign(r) != sign(ys); a known sign of y or x leaves one comparison
    if Y[0] >= 0:           # ys >= 1
        adj = r < 0
    elif Y[1] <= 0:         # ys <= -1, or ys == 1 with r == 0
        adj = 0 < r
    elif X[0] >= 0:         # r >= 0
        adj = (0 < r) & (ys < 0)
    elif X[1] <= 0:         # r <= 0
        adj = (r < 0) & (0 < ys)
    else:
        adj = (r != 0) & ((r ^ ys) < 0)
    if not quotient:
        return adj.where(r + ys, r)
    q = UOp(Ops.CDIV, dt, (x, ys), None)
    q = adj.where(q - 1, q)
    return (y == 0).where(0, q) if may_zero else q
