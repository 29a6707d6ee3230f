"""Gather, GatherElements and OneHot."""
from __future__ import annotations

from morok_py import UOp, dtypes

from morok_py.onnx.tensor import KB
from morok_py.onnx.ops.common import as_uop, keep_const
from morok_py.onnx.ops.registry import op


@op("Gather")
def _gather(ctx, ins, a):
    x, ind = ins
    ax = a.get("axis", 0) % x.ndim
    shape = list(x.shape[:ax]) + list(ind.shape) + list(x.shape[ax + 1:])
    out = ctx.k.empty(shape, x.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    idx = [kb.rng(s) for s in shape]
    d = x.shape[ax]
    # on an extent-1 axis the index is 0: a load clamped to [0, 0] would fold away and leave its slot unused
    j = kb.load(ind, idx[ax:ax + ind.ndim]) if d > 1 else 0
    j = (j < 0).where(j + d, j).clamp(0, d - 1).cast(dtypes.index) if d > 1 else j
    kb.store(out, idx, kb.load(x, idx[:ax] + [j] + idx[ax + ind.ndim:]))
    kb.run()
    return [keep_const(out, ins)]


@op("GatherElements")
def _gather_elements(ctx, ins, a):
    x, ind = ins
    ax = a.get("axis", 0) % x.ndim
    out = ctx.k.empty(ind.shape, x.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    idx = [kb.rng(s) for s in ind.shape]
    d = x.shape[ax]
    j = kb.load(ind, idx) if d > 1 else 0       # extent 1: index 0, no load (as in Gather)
    j = (j < 0).where(j + d, j).clamp(0, d - 1).cast(dtypes.index) if d > 1 else j
    src = list(idx)
    src[ax] = j
    kb.store(out, idx, kb.load(x, src))
    kb.run()
    return [out]


@op("OneHot")
def _onehot(ctx, ins, a):
    ind, depth, values = ins
    depth = int(ctx.scalar(depth))
    nd = ind.ndim + 1
    ax = a.get("axis", -1) % nd
    shape = list(ind.shape[:ax]) + [depth] + list(ind.shape[ax:])
    out = ctx.k.empty(shape, values.dtype)
    kb = KB(ctx.k, ctx.n())
    idx = [kb.rng(s) for s in shape]
    j = kb.load(ind, idx[:ax] + idx[ax + 1:])
    if j.dtype.is_float:
        j = j.trunc()
    dcon = UOp.const(depth, j.dtype)
    j = (j < UOp.const(0, j.dtype)).where(j + dcon, j)
    hit = j == as_uop(idx[ax]).cast(j.dtype)
    kb.store(out, idx, hit.where(kb.load(values.with_((1,), (0,), values.offset + values.strides[0]), [0]),
                                 kb.load(values.with_((1,), (0,)), [0])))
    kb.run()
    return [out]
