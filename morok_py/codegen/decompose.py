"""Decompositions a renderer can ask for through `Renderer.decompositor()`: rewrites of ops a
target lacks, or has only as slow scalar library calls, into plain ALU ops that vectorize."""
from __future__ import annotations

from typing import Callable

from ..dtypes import dtypes
from ..ir import Ops, UOp

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
