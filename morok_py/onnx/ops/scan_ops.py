"""CumSum and CumProd: each output element sums (multiplies) the inputs before (or after) it along the axis,
one reduction kernel."""
from __future__ import annotations

from morok_py import AxisType, Ops, UOp

from morok_py.onnx.tensor import KB
from morok_py.onnx.ops.common import as_uop, isr, keep_const
from morok_py.onnx.ops.registry import op


def _cumulative(ctx, ins, a, reduce_op: Ops, identity: int):
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
    neutral = UOp.const(float(identity) if x.dtype.is_float else identity, x.dtype)
    v = cond.where(kb.load(x, src), neutral)
    if isr(r):
        v = v.reduce(r, op=reduce_op)
    kb.store(out, idx, v)
    kb.run()
    return [keep_const(out, ins[:1])]


@op("CumSum")
def _cumsum(ctx, ins, a):
    return _cumulative(ctx, ins, a, Ops.ADD, 0)


@op("CumProd")
def _cumprod(ctx, ins, a):
    return _cumulative(ctx, ins, a, Ops.MUL, 1)
