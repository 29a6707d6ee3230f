"""MaxUnpool (zeros, then one kernel storing each value at its pooled index) and Upsample (the opset-7/9
form of Resize: nearest is one gather kernel here, linear runs as Resize with asymmetric coordinates)."""
from __future__ import annotations

import numpy as np

from morok_py import UOp, dtypes

from morok_py.onnx.errors import UnsupportedOp
from morok_py.onnx.tensor import KB, fill, iconst, prod
from morok_py.onnx.ops.common import as_uop, keep_const
from morok_py.onnx.ops.registry import OPS, op


@op("MaxUnpool")
def _max_unpool(ctx, ins, a):
    x, ind = ins[0], ins[1]
    oshape = ctx.ints(ins[2]) if len(ins) > 2 and ins[2] is not None else None
    kshape = list(a["kernel_shape"])
    nd = len(kshape)
    strides = list(a.get("strides", [1] * nd))
    pads = list(a.get("pads", [0] * (2 * nd)))
    inferred = list(x.shape[:2]) + [(x.shape[2 + d] - 1) * strides[d] - (pads[d] + pads[nd + d]) + kshape[d]
                                    for d in range(nd)]
    shape = oshape or inferred
    zero = 0.0 if x.dtype.is_float else 0
    out = fill(ctx.k, ctx.n("zeros"), shape, zero, x.dtype)
    if x.size == 0 or out.size == 0:
        return [out]
    # the indices count in the inferred shape; its block sits at the output's origin
    kb = KB(ctx.k, ctx.n())
    e = [kb.rng(s) for s in x.shape]
    total = prod(inferred)
    flat = kb.load(ind, e).clamp(0, total - 1).cast(dtypes.index) if total > 1 else iconst(0)
    dst, rest = [], flat
    for d in reversed(range(len(inferred))):
        dst.append((rest % inferred[d]).clamp(0, min(inferred[d], shape[d]) - 1))
        rest = rest // inferred[d]
    kb.store(out, list(reversed(dst)), kb.load(x, e))
    kb.run()
    return [keep_const(out, ins)]


@op("Upsample")
def _upsample(ctx, ins, a):
    x = ins[0]
    scales = [float(s) for s in (ctx.host(ins[1]).reshape(-1) if len(ins) > 1 else a["scales"])]
    mode = a.get("mode", b"nearest")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode == "linear" and "Resize" in OPS:
        sv = ins[1] if len(ins) > 1 else ctx.const_view(np.array(scales, np.float32))
        return OPS["Resize"](ctx, [x, sv], {"mode": b"linear"})     # Resize-10's (X, scales) form: asymmetric
    if mode != "nearest":
        raise UnsupportedOp(f"Upsample mode {mode!r}")
    shape = [int(s * f) for s, f in zip(x.shape, scales)]
    out = ctx.k.empty(shape, x.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    o = [kb.rng(s) for s in shape]
    # source = floor(out / scale), computed in float32 as the reference does
    src = [as_uop(i) if f == 1.0 else (as_uop(i).cast(dtypes.int32).cast(dtypes.float32) / UOp.const(f, dtypes.float32))
           .floor().cast(dtypes.int32).cast(dtypes.index).clamp(0, d - 1) for i, f, d in zip(o, scales, x.shape)]
    kb.store(out, o, kb.load(x, src))
    kb.run()
    return [keep_const(out, ins[:1])]
