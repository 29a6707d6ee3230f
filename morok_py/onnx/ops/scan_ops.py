"""CumProd: each output element multiplies the inputs before (or after) it along the axis, one kernel."""
from __future__ import annotations

from morok_py import AxisType, Ops, UOp

from morok_py.onnx.tensor import KB
from morok_py.onnx.ops.common import as_uop, isr, keep_const
from morok_py.onnx.ops.registry import op


@op("CumProd")
def _cumprod(ctx, ins, a):
    x = ins[0]
    ax = int(ctx.scalar(ins[1])) % x.ndim
    excl, rev = a.get("exclusive", 0), a.get("reverse", 0)
    out = ctx.k.empty(x.shape, x.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    idx = [kb.rng(s) for s in x.shape]
    r = kb.rng(x.shape[ax], AxisType.REDUCE)
    src = list(idx)
    src[ax] = r
    i, j = as_uop(idx[ax]), as_uop(r)
    cond = {(0, 0): j <= i, (1, 0): j < i, (0, 1): j >= i, (1, 1): j > i}[(excl, rev)]
    one = UOp.const(1.0 if x.dtype.is_float else 1, x.dtype)
    v = cond.where(kb.load(x, src), one)
    if isr(r):
        v = v.reduce(r, op=Ops.MUL)
    kb.store(out, idx, v)
    kb.run()
    return [keep_const(out, ins[:1])]
