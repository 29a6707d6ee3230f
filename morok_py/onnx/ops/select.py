"""Ops whose output size depends on the data: Compress, NonZero, Unique. The selection (which elements,
how many) is computed on the host from the values read back; Compress then gathers on the device, while
NonZero's and Unique's outputs are the host results themselves (Unique is a sort with bookkeeping; there is
no sort kernel). Reading the values back makes the run's launch list unreplayable."""
from __future__ import annotations

import numpy as np

from morok_py import dtypes

from morok_py.onnx.tensor import KB, View
from morok_py.onnx.ops.common import keep_const
from morok_py.onnx.ops.registry import op


def take(ctx, x: View, idx: np.ndarray, axis: int) -> View:
    """x indexed along `axis` by the host indices `idx` (one gather kernel)."""
    shape = list(x.shape)
    shape[axis] = len(idx)
    out = ctx.k.empty(shape, x.dtype)
    if out.size == 0:
        return out
    ind = ctx.const_view(np.asarray(idx, np.int64))
    kb = KB(ctx.k, ctx.n())
    o = [kb.rng(s) for s in shape]
    src = list(o)
    if x.shape[axis] > 1:       # on an extent-1 axis every index is 0 (and a clamped load would fold away)
        src[axis] = kb.load(ind, [o[axis]]).cast(dtypes.index).clamp(0, x.shape[axis] - 1)
    else:
        src[axis] = 0
    kb.store(out, o, kb.load(x, src))
    kb.run()
    return out


@op("Compress")
def _compress(ctx, ins, a):
    x, cond = ins
    c = np.asarray(ctx.host(cond)).reshape(-1).astype(bool)
    if "axis" not in a:
        flat = x.try_reshape((x.size,))
        if flat is None:
            flat = ctx.k.from_numpy(ctx.host(x).reshape(-1))
        x, axis = flat, 0
    else:
        axis = a["axis"] % x.ndim
    idx = np.nonzero(c[:x.shape[axis]])[0]
    return [keep_const(take(ctx, x, idx, axis), ins)]


@op("NonZero")
def _nonzero(ctx, ins, a):
    x = np.asarray(ctx.host(ins[0]))
    res = np.array(np.nonzero(x.reshape(1) if x.ndim == 0 else x), dtype=np.int64)
    return [keep_const(ctx.k.from_numpy(res), ins)]


@op("Unique")
def _unique(ctx, ins, a):
    x = np.asarray(ctx.host(ins[0]))
    axis = a.get("axis")
    if axis is None:
        x = x.reshape(-1)
        axis = 0
    axis %= x.ndim
    y, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True, return_counts=True, axis=axis)
    if not a.get("sorted", 1):
        order = np.argsort(first, kind="stable")      # unique values in the order they first occur
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        first, counts = first[order], counts[order]
        inverse = rank[inverse.reshape(-1)]
        y = np.take(x, first, axis=axis)
    outs = [y, first.astype(np.int64), inverse.reshape(-1).astype(np.int64), counts.astype(np.int64)]
    return [keep_const(ctx.k.from_numpy(np.ascontiguousarray(v)), ins) for v in outs[:max(len(ctx.node.output), 1)]]
