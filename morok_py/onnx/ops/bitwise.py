"""BitShift, BitwiseAnd/Or/Xor/Not and BitCast: elementwise integer kernels with numpy broadcasting."""
from __future__ import annotations

from morok_py import UOp, dtypes
from morok_py.dtypes import DType

from morok_py.onnx.errors import OnnxError
from morok_py.onnx.tensor import elementwise
from morok_py.onnx.ops.common import ONNX_DT, ew, keep_const
from morok_py.onnx.ops.registry import OPS, op

UNSIGNED = {1: dtypes.uint8, 2: dtypes.uint16, 4: dtypes.uint32, 8: dtypes.uint64}


def shift(x: UOp, s: UOp, left: bool) -> UOp:
    """x shifted by s bits; a shift outside [0, width) gives 0 (or -1 shifting a negative value right), as
    the ONNX reference does. Left shifts of signed values wrap (done on the unsigned bits)."""
    dt: DType = x.dtype
    width = dt.itemsize * 8
    z = UOp.const(0, dt)
    ok = (s >= z) & (s < UOp.const(width, dt)) if not dt.is_unsigned else s < UOp.const(width, dt)
    s = ok.where(s, z)                       # never an out-of-range shift in the kernel (undefined in C/LLVM)
    if left:
        if dt.is_unsigned:
            r = x << s
        else:
            u = UNSIGNED[dt.itemsize]
            r = (x.bitcast(u) << s.bitcast(u)).bitcast(dt)
        return ok.where(r, z)
    r = x >> s
    if dt.is_unsigned:
        return ok.where(r, z)
    return ok.where(r, (x < z).where(UOp.const(-1, dt), z))


@op("BitShift")
def _bitshift(ctx, ins, a):
    d = a["direction"]
    left = (d.decode() if isinstance(d, bytes) else d) == "LEFT"
    return [ew(ctx, ins[:2], lambda x, s: shift(x, s, left))]


OPS["BitwiseAnd"] = lambda ctx, ins, a: [ew(ctx, ins[:2], lambda x, y: x & y)]
OPS["BitwiseOr"] = lambda ctx, ins, a: [ew(ctx, ins[:2], lambda x, y: x | y)]
OPS["BitwiseXor"] = lambda ctx, ins, a: [ew(ctx, ins[:2], lambda x, y: x ^ y)]
OPS["BitwiseNot"] = lambda ctx, ins, a: [ew(ctx, ins[:1], lambda x: ~x)]


@op("BitCast")
def _bitcast(ctx, ins, a):
    x, to = ins[0], ONNX_DT[a["to"]]
    if x.dtype.itemsize != to.itemsize:
        raise OnnxError(f"BitCast from {x.dtype} to {to}: the sizes differ")
    if x.dtype == to:
        return [x]

    def f(xs, _):
        v = xs[0]
        if v.dtype.is_bool:                  # bool is one byte 0/1: the same bits as a uint8
            v = v.cast(dtypes.uint8)
        return v.cast(to) if to.is_bool else v.bitcast(to) if v.dtype != to else v
    return [keep_const(elementwise(ctx.k, ctx.n(), [x], f, to), ins)]
