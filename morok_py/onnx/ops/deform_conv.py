"""DeformConv (2-d, groups, offset groups, optional mask and bias): one kernel; each kernel tap samples the
input bilinearly (zero outside) at its offset position, as the ONNX reference does through GridSample."""
from __future__ import annotations

from morok_py import AxisType, UOp, dtypes

from morok_py.onnx.errors import UnsupportedOp
from morok_py.onnx.tensor import KB
from morok_py.onnx.ops.common import as_uop, isr, keep_const
from morok_py.onnx.ops.registry import op

F32 = dtypes.float32


def _f(v: float) -> UOp:
    return UOp.const(float(v), F32)


def _fi(i) -> UOp:
    return as_uop(i).cast(dtypes.int32).cast(F32)


@op("DeformConv")
def _deform_conv(ctx, ins, a):
    X, Wt, off = ins[0], ins[1], ins[2]
    B = ins[3] if len(ins) > 3 and ins[3] is not None else None
    mask = ins[4] if len(ins) > 4 and ins[4] is not None else None
    if X.ndim != 4:
        raise UnsupportedOp("DeformConv on other than 2-d images")
    N, C, H, W = X.shape
    OC, CG = Wt.shape[0], Wt.shape[1]
    kh_, kw_ = list(a.get("kernel_shape", Wt.shape[2:]))
    sh, sw = list(a.get("strides", [1, 1]))
    dh, dw = list(a.get("dilations", [1, 1]))
    pads = list(a.get("pads", [0, 0, 0, 0]))
    G, OG = a.get("group", 1), a.get("offset_group", 1)
    OH, OW = off.shape[2], off.shape[3]
    ocg, icog = OC // G, C // OG
    out = ctx.k.empty((N, OC, OH, OW), X.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    n, oc, i, j = kb.rng(N), kb.rng(OC), kb.rng(OH), kb.rng(OW)
    ci, ki, kj = kb.rng(CG, AxisType.REDUCE), kb.rng(kh_, AxisType.REDUCE), kb.rng(kw_, AxisType.REDUCE)
    cin = as_uop(oc) // ocg * CG + as_uop(ci) if G > 1 else as_uop(ci)
    og = cin // icog if OG > 1 else 0
    tap = (as_uop(og) * kh_ + as_uop(ki)) * kw_ + as_uop(kj)
    y = _f(-pads[0]) + _fi(i) * _f(sh) + _fi(ki) * _f(dh) + kb.load(off, [n, tap * 2, i, j]).cast(F32)
    x = _f(-pads[1]) + _fi(j) * _f(sw) + _fi(kj) * _f(dw) + kb.load(off, [n, tap * 2 + 1, i, j]).cast(F32)
    y0, x0 = y.floor(), x.floor()
    ty, tx = y - y0, x - x0
    zero = _f(0.0)

    def pixel(yy: UOp, xx: UOp) -> UOp:
        ok = (yy >= zero) & (yy <= _f(H - 1)) & (xx >= zero) & (xx <= _f(W - 1))
        yi = yy.clamp(0.0, float(H - 1)).cast(dtypes.int32).cast(dtypes.index).clamp(0, H - 1)
        xi = xx.clamp(0.0, float(W - 1)).cast(dtypes.int32).cast(dtypes.index).clamp(0, W - 1)
        return ok.where(kb.load(X, [n, cin, yi, xi]).cast(F32), zero)
    one = _f(1.0)
    v = ((one - ty) * (one - tx) * pixel(y0, x0) + (one - ty) * tx * pixel(y0, x0 + one)
         + ty * (one - tx) * pixel(y0 + one, x0) + ty * tx * pixel(y0 + one, x0 + one))
    v = v * kb.load(Wt, [oc, ci, ki, kj]).cast(F32)
    if mask is not None:
        v = v * kb.load(mask, [n, tap, i, j]).cast(F32)
    rr = [r for r in (ci, ki, kj) if isr(r)]
    if rr:
        v = v.reduce(*rr)
    if B is not None:
        v = v + kb.load(B, [oc]).cast(F32)
    kb.store(out, [n, oc, i, j], v.cast(X.dtype))
    kb.run()
    return [keep_const(out, ins)]
