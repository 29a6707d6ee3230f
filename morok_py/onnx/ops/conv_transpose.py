"""ConvTranspose as one gather kernel: each output element sums the input elements whose strided,
dilated window lands on it (no scatter, no atomics)."""
from __future__ import annotations

from morok_py import AxisType, UOp

from morok_py.onnx.tensor import KB, iconst
from morok_py.onnx.ops.common import as_uop, isr, keep_const
from morok_py.onnx.ops.registry import op


def _geometry(a, spatial, kshape):
    """Output sizes and begin pads, as the ONNX reference computes them."""
    nd = len(spatial)
    strides = list(a.get("strides", [1] * nd))
    dil = list(a.get("dilations", [1] * nd))
    opad = list(a.get("output_padding", [0] * nd))[:nd]
    auto = a.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    pads = a.get("pads")
    out_shape = a.get("output_shape")
    full = [strides[d] * (spatial[d] - 1) + opad[d] + (kshape[d] - 1) * dil[d] + 1 for d in range(nd)]
    if pads is None and auto in ("SAME_UPPER", "SAME_LOWER"):
        out = list(out_shape) if out_shape is not None else [spatial[d] * strides[d] for d in range(nd)]
        total = [full[d] - out[d] for d in range(nd)]
        begin = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in total]
        return out, begin, strides, dil
    pads = list(pads) if pads is not None else [0] * (2 * nd)
    if out_shape is not None:
        out = list(out_shape)[-nd:]
    else:
        out = [full[d] - pads[d] - pads[d + nd] for d in range(nd)]
    return out, pads[:nd], strides, dil


@op("ConvTranspose")
def _conv_transpose(ctx, ins, a):
    x, w = ins[0], ins[1]
    b = ins[2] if len(ins) > 2 else None
    G = a.get("group", 1)
    N, C = x.shape[0], x.shape[1]
    Cg, Mg = C // G, w.shape[1]
    kshape = list(w.shape[2:])
    spatial = list(x.shape[2:])
    outs, begin, strides, dil = _geometry(a, spatial, kshape)
    out = ctx.k.empty([N, Mg * G] + outs, x.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    n, co = kb.rng(N), kb.rng(Mg * G)
    sp = [kb.rng(o) for o in outs]
    ci = kb.rng(Cg, AxisType.REDUCE)
    kk = [kb.rng(s, AxisType.REDUCE) for s in kshape]
    g = as_uop(co) // Mg if G > 1 else iconst(0)
    m = as_uop(co) % Mg if G > 1 else co
    cin = g * Cg + as_uop(ci) if G > 1 else ci
    coords, valid = [], None
    for d in range(len(spatial)):
        # output o takes input i where o = i * stride + k * dil - pad: i = (o + pad - k * dil) / stride
        t = as_uop(sp[d]) + begin[d] - as_uop(kk[d]) * dil[d]
        tn = t.maximum(iconst(0))
        i = tn // strides[d] if strides[d] > 1 else tn
        ok = (t >= 0) & (i < spatial[d])
        if strides[d] > 1:
            ok = ok & (tn % strides[d] == 0)
        valid = ok if valid is None else valid & ok
        coords.append(i.minimum(iconst(spatial[d] - 1)))
    xv = valid.where(kb.load(x, [n, cin] + coords), UOp.const(0, x.dtype))
    v = xv * kb.load(w, [cin, m] + kk)
    rr = [r for r in [ci] + kk if isr(r)]
    if rr:
        v = v.reduce(*rr)
    if b is not None:
        v = v + kb.load(b, [co])
    kb.store(out, [n, co] + sp, v)
    kb.run()
    return [keep_const(out, ins)]
