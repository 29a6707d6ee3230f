"""NonMaxSuppression: the pairwise suppression test of every two boxes is one kernel; the greedy pass
over boxes in score order is sequential and its output size depends on the data, so it runs on the host
over the kernel's result (the read-back makes the run's launch list unreplayable, as any data-dependent
shape does)."""
from __future__ import annotations

import numpy as np

from morok_py import UOp, dtypes

from morok_py.onnx.tensor import KB, View
from morok_py.onnx.ops.registry import op


def _extent(kb: KB, boxes: View, b, i, center: bool):
    """(x_min, x_max, y_min, y_max) of box i of batch b, in float32."""
    c = [kb.load(boxes, [b, i, k]).cast(dtypes.float32) for k in range(4)]
    if center:                                   # [x_center, y_center, width, height]
        hw, hh = c[2] / UOp.const(2.0, dtypes.float32), c[3] / UOp.const(2.0, dtypes.float32)
        return c[0] - hw, c[0] + hw, c[1] - hh, c[1] + hh
    return c[1].minimum(c[3]), c[1].maximum(c[3]), c[0].minimum(c[2]), c[0].maximum(c[2])   # [y1, x1, y2, x2]


def suppression(ctx, boxes: View, iou: View | None, center: bool) -> View:
    """S[b, i, j]: box j suppresses box i (IoU above the threshold), the ONNX reference's test."""
    B, N = boxes.shape[0], boxes.shape[1]
    out = ctx.k.empty((B, N, N), dtypes.bool)
    if out.size == 0:
        return out
    kb = KB(ctx.k, ctx.n("iou"))
    b, i, j = kb.rng(B), kb.rng(N), kb.rng(N)
    ax0, ax1, ay0, ay1 = _extent(kb, boxes, b, i, center)
    bx0, bx1, by0, by1 = _extent(kb, boxes, b, j, center)
    ix0, ix1, iy0, iy1 = ax0.maximum(bx0), ax1.minimum(bx1), ay0.maximum(by0), ay1.minimum(by1)
    zero = UOp.const(0.0, dtypes.float32)
    inter = (ix1 - ix0) * (iy1 - iy0)
    a1, a2 = (ax1 - ax0) * (ay1 - ay0), (bx1 - bx0) * (by1 - by0)
    union = a1 + a2 - inter
    thr = kb.load(iou, [0] * iou.ndim).cast(dtypes.float32) if iou is not None else zero
    ok = (ix0 < ix1) & (iy0 < iy1) & (zero < inter) & (zero < a1) & (zero < a2) & (zero < union)
    safe = ok.where(union, UOp.const(1.0, dtypes.float32))
    kb.store(out, [b, i, j], ok & (thr < inter / safe))
    kb.run()
    return out


def _given(v: View | None) -> bool:
    return v is not None and v.size > 0


@op("NonMaxSuppression")
def _nms(ctx, ins, a):
    boxes, scores = ins[0], ins[1]
    mx = ins[2] if len(ins) > 2 else None
    iou = ins[3] if len(ins) > 3 and _given(ins[3]) else None
    sthr = ins[4] if len(ins) > 4 and _given(ins[4]) else None
    max_out = max(int(ctx.scalar(mx)), 0) if _given(mx) else 0
    sup = ctx.host(suppression(ctx, boxes, iou, bool(a.get("center_point_box", 0))))
    sc = ctx.host(scores)
    thr = float(np.asarray(ctx.host(sthr), np.float32).reshape(-1)[0]) if sthr is not None else None
    sel: list[tuple[int, int, int]] = []
    for b in range(sc.shape[0]):
        for c in range(sc.shape[1]):
            s = sc[b, c]
            cand = np.arange(s.shape[0]) if thr is None else np.nonzero(s > thr)[0]
            order = cand[np.lexsort((cand, -s[cand]))]      # score descending, lower index first on ties
            kept: list[int] = []
            for i in order:
                if len(kept) >= max_out:
                    break
                if not any(sup[b, i, j] for j in kept):
                    kept.append(int(i))
                    sel.append((b, c, int(i)))
    res = np.array(sel, dtype=np.int64).reshape(-1, 3)
    return [ctx.k.from_numpy(res)]
