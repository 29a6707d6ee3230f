"""RoiAlign (avg and max; half_pixel and output_half_pixel): one kernel, each output bin reducing over its
sampling grid of bilinear samples as the ONNX reference computes them (coordinates in float64). With an
adaptive grid (sampling_ratio 0) the grid's size per ROI depends on the ROI: the kernel loops to the
largest one, found from the ROIs read on the host, and masks the samples beyond each ROI's own grid."""
from __future__ import annotations

import math

import numpy as np

from morok_py import AxisType, Ops, UOp, dtypes

from morok_py.onnx.tensor import KB
from morok_py.onnx.ops.common import as_uop, isr, keep_const
from morok_py.onnx.ops.registry import op

F64 = dtypes.float64


def _f(v: float) -> UOp:
    return UOp.const(float(v), F64)


def _idx(v: UOp, hi: int) -> UOp:
    """A non-negative integral float64 as an index clamped into [0, hi]."""
    return v.clamp(0.0, float(hi)).cast(dtypes.int32).cast(dtypes.index).clamp(0, hi)


@op("RoiAlign")
def _roi_align(ctx, ins, a):
    X, rois, bidx = ins
    mode = a.get("mode", b"avg")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    ctm = a.get("coordinate_transformation_mode", b"half_pixel")
    half = (ctm.decode() if isinstance(ctm, bytes) else ctm) == "half_pixel"
    PH, PW = a.get("output_height", 1), a.get("output_width", 1)
    ratio = int(a.get("sampling_ratio", 0))
    scale = float(a.get("spatial_scale", 1.0))
    N, C, H, W = X.shape
    R = rois.shape[0]
    off = 0.5 if half else 0.0
    if ratio > 0:
        GH = GW = ratio
    else:
        r = np.asarray(ctx.host(rois), np.float64).reshape(R, 4) * scale
        hs, ws = r[:, 3] - r[:, 1], r[:, 2] - r[:, 0]
        if not half:
            hs, ws = np.maximum(hs, 1.0), np.maximum(ws, 1.0)
        GH = max([int(math.ceil(h / PH)) for h in hs] + [1])
        GW = max([int(math.ceil(w / PW)) for w in ws] + [1])
    out = ctx.k.empty((R, C, PH, PW), X.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    n, c, ph, pw = kb.rng(R), kb.rng(C), kb.rng(PH), kb.rng(PW)
    iy, ix = kb.rng(GH, AxisType.REDUCE), kb.rng(GW, AxisType.REDUCE)
    x1, y1, x2, y2 = [kb.load(rois, [n, k]).cast(F64) * _f(scale) - _f(off) for k in range(4)]
    rw, rh = x2 - x1, y2 - y1
    if not half:
        rw, rh = rw.maximum(1.0), rh.maximum(1.0)
    bh, bw = rh / _f(PH), rw / _f(PW)
    if ratio > 0:
        gh, gw = _f(ratio), _f(ratio)
        inside = None
    else:
        gh, gw = (rh / _f(PH)).ceil(), (rw / _f(PW)).ceil()
        fy, fx = as_uop(iy).cast(dtypes.int32).cast(F64), as_uop(ix).cast(dtypes.int32).cast(F64)
        inside = (fy < gh) & (fx < gw)
    count = (gh * gw).maximum(1.0)

    def fl(i) -> UOp:
        return as_uop(i).cast(dtypes.int32).cast(F64)
    y = y1 + fl(ph) * bh + (fl(iy) + _f(0.5)) * bh / gh
    x = x1 + fl(pw) * bw + (fl(ix) + _f(0.5)) * bw / gw
    valid = (y >= _f(-1.0)) & (y <= _f(H)) & (x >= _f(-1.0)) & (x <= _f(W))
    y, x = y.maximum(0.0), x.maximum(0.0)
    ylo, xlo = y.trunc(), x.trunc()
    ytop, xtop = ylo >= _f(H - 1), xlo >= _f(W - 1)
    ylo, xlo = ytop.where(_f(H - 1), ylo), xtop.where(_f(W - 1), xlo)
    y, x = ytop.where(ylo, y), xtop.where(xlo, x)
    yhi, xhi = ytop.where(ylo, ylo + _f(1.0)), xtop.where(xlo, xlo + _f(1.0))
    ly, lx = y - ylo, x - xlo
    hy, hx = _f(1.0) - ly, _f(1.0) - lx
    # one image: no load (a load whose clamp folds to 0 would leave its parameter slot unused)
    b = kb.load(bidx, [n]).cast(dtypes.index).clamp(0, N - 1) if N > 1 else 0

    def px(yy, xx) -> UOp:
        return kb.load(X, [b, c, _idx(yy, H - 1), _idx(xx, W - 1)]).cast(F64)
    terms = [hy * hx * px(ylo, xlo), hy * lx * px(ylo, xhi), ly * hx * px(yhi, xlo), ly * lx * px(yhi, xhi)]
    terms = [valid.where(t, _f(0.0)) for t in terms]
    rr = [r for r in (iy, ix) if isr(r)]
    if mode == "avg":
        v = terms[0] + terms[1] + terms[2] + terms[3]
        if inside is not None:
            v = inside.where(v, _f(0.0))
        v = (v.reduce(*rr) if rr else v) / count
    else:
        v = terms[0].maximum(terms[1]).maximum(terms[2]).maximum(terms[3])
        if inside is not None:
            v = inside.where(v, _f(-math.inf))
        v = v.reduce(*rr, op=Ops.MAX) if rr else v
    kb.store(out, [n, c, ph, pw], v.cast(X.dtype))
    kb.run()
    return [keep_const(out, ins)]
