"""Helpers every op family uses: the op context, dtype maps, one-kernel elementwise, reshape and cast."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from morok_py import Ops, UOp, dtypes
from morok_py.dtypes import DType

from morok_py.onnx.errors import UnsupportedOp
from morok_py.onnx.tensor import View, copy, elementwise, iconst


# ONNX element type -> morok_py dtype
ONNX_DT: dict[int, DType] = {1: dtypes.float32, 2: dtypes.uint8, 3: dtypes.int8, 4: dtypes.uint16, 5: dtypes.int16,
                             6: dtypes.int32, 7: dtypes.int64, 9: dtypes.bool, 10: dtypes.float16,
                             11: dtypes.float64, 12: dtypes.uint32, 13: dtypes.uint64, 16: dtypes.bfloat16,
                             17: dtypes.float8_e4m3fn, 18: dtypes.float8_e4m3fnuz, 19: dtypes.float8_e5m2,
                             20: dtypes.float8_e5m2fnuz, 21: dtypes.uint4, 22: dtypes.int4, 23: dtypes.float4_e2m1fn,
                             24: dtypes.float8_e8m0fnu, 25: dtypes.uint2, 26: dtypes.int2}
ONNX_ELEM: dict[DType, int] = {dt: t for t, dt in ONNX_DT.items()}
HAS_MIN_REDUCE = Ops.MIN in __import__("morok_py.ir", fromlist=["REDUCE_OPS"]).REDUCE_OPS


class Ctx:
    """What an op sees of the executor: the kernel builder, its node, the opset and host reads."""

    def __init__(self, ex, name: str, node, opset: int) -> None:
        self.ex, self.k, self.name, self.node, self.opset = ex, ex.k, name, node, opset

    def n(self, suffix: str = "") -> str:
        return self.name + (":" + suffix if suffix else "")

    def host(self, v: View) -> np.ndarray:
        return self.ex.host(v)

    def ints(self, v: View | None) -> list[int] | None:
        return None if v is None else [int(x) for x in np.asarray(self.host(v)).reshape(-1)]

    def scalar(self, v: View):
        return np.asarray(self.host(v)).reshape(-1)[0]

    def const_view(self, arr: np.ndarray) -> View:
        return self.k.from_numpy(np.asarray(arr), const=True)


def method(x: UOp, name: str, *args) -> UOp:
    """A UOp method another engineer is adding (tanh, erf, ...): a clear error until it lands."""
    fn = getattr(x, name, None)
    if fn is None:
        raise UnsupportedOp(f"UOp.{name}() is not in this morok_py yet")
    return fn(*args)


def isr(r) -> bool:
    """A real range (KB.rng makes extent-1 ranges the constant 0)."""
    return isinstance(r, UOp) and r.op is Ops.RANGE


def fconst(x: UOp, v: float) -> UOp:
    return UOp.const(float(v), x.dtype)


def keep_const(out: View, ins: Sequence[View | None]) -> View:
    out.const = all(v is None or v.const for v in ins)
    return out


HALF = (dtypes.float16, dtypes.bfloat16)


def compute_dtype(x: UOp) -> UOp:
    """Half precision and the storage-only formats (float8, int4, ...) are computed on in float32/int32."""
    if x.dtype in HALF or (x.dtype.storage_only and x.dtype.is_float):
        return x.cast(dtypes.float32)
    return x.cast(dtypes.int32) if x.dtype.storage_only else x


def ew(ctx: Ctx, ins: Sequence[View], fn: Callable, dtype: DType | None = None, suffix: str = "") -> View:
    """One elementwise kernel. Half-precision operands are computed in float32 and rounded once at the
    store, as the ONNX reference (numpy + ml_dtypes) does within one op."""
    def body(xs, _):
        return fn(*[compute_dtype(x) for x in xs])
    out = elementwise(ctx.k, ctx.n(suffix), ins, body, dtype or ins[0].dtype)
    return keep_const(out, ins)


def abs_value(x: UOp) -> UOp:
    if x.dtype.is_unsigned or x.dtype.is_bool:
        return x
    return (x < UOp.const(0, x.dtype)).where(-x, x)


def as_uop(i) -> UOp:
    return i if isinstance(i, UOp) else iconst(i)


def cast_to(ctx, x: View, dt: DType, a=None) -> View:
    if x.dtype == dt:
        return x
    a = a or {}
    sat, mode = bool(a.get("saturate", 1)), a.get("round_mode", "up")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if dt.is_bool:
        return ew(ctx, [x], lambda u: u != UOp.const(0, u.dtype), dt)
    # the storage-only source itself, not a float32 copy of it: the library converts it exactly
    return keep_const(elementwise(ctx.k, ctx.n(), [x], lambda xs, _: xs[0].cast(dt, saturate=sat, round_mode=mode),
                                   dt), [x])


def reshape(ctx, x: View, shape: Sequence[int]) -> View:
    v = x.try_reshape(shape)
    if v is None:
        v = copy(ctx.k, ctx.n("contiguous"), x).try_reshape(shape)
        v.const = x.const
    return v
