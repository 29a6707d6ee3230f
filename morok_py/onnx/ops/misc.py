"""EyeLike, ReverseSequence, TensorScatter (a KV-cache write) and Col2Im, each one gather or scatter kernel."""
from __future__ import annotations

from morok_py import AxisType, UOp, dtypes

from morok_py.onnx.tensor import KB, copy
from morok_py.onnx.ops.common import ONNX_DT, as_uop, isr, keep_const
from morok_py.onnx.ops.registry import op


@op("EyeLike")
def _eye_like(ctx, ins, a):
    x = ins[0]
    dt = ONNX_DT[a["dtype"]] if a.get("dtype") else x.dtype
    k = int(a.get("k", 0))
    shape = x.shape if x.ndim == 2 else (x.shape[0], x.shape[0])
    out = ctx.k.empty(shape, dt)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    i, j = kb.rng(shape[0]), kb.rng(shape[1])
    one, zero = (UOp.const(1.0, dt), UOp.const(0.0, dt)) if dt.is_float else (UOp.const(1, dt), UOp.const(0, dt))
    kb.store(out, [i, j], (as_uop(j) - as_uop(i) == k).where(one, zero))
    kb.run()
    out.const = True
    return [out]


@op("ReverseSequence")
def _reverse_sequence(ctx, ins, a):
    x, lens = ins
    bax, tax = a.get("batch_axis", 1), a.get("time_axis", 0)
    out = ctx.k.empty(x.shape, x.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    idx = [kb.rng(s) for s in x.shape]
    T = x.shape[tax]
    if T == 1:              # nothing to reverse
        kb.store(out, idx, kb.load(x, idx))
        kb.run()
        return [keep_const(out, ins[:1])]
    n = kb.load(lens, [idx[bax]]).cast(dtypes.index).clamp(0, T)
    t = as_uop(idx[tax])
    src = list(idx)
    src[tax] = (t < n).where(n - 1 - t, t).clamp(0, T - 1)
    kb.store(out, idx, kb.load(x, src))
    kb.run()
    return [keep_const(out, ins)]


@op("TensorScatter")
def _tensor_scatter(ctx, ins, a):
    """present = past with update written at write_indices[batch] + s along `axis` (mod its length when
    mode is circular): a copy, then one kernel over the update's elements."""
    past, upd = ins[0], ins[1]
    wi = ins[2] if len(ins) > 2 else None
    mode = a.get("mode", "linear")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    ax = a.get("axis", -2) % past.ndim
    out = copy(ctx.k, ctx.n("copy"), past)
    if upd.size == 0:
        return [out]
    L = past.shape[ax]
    kb = KB(ctx.k, ctx.n())
    u = [kb.rng(s) for s in upd.shape]
    pos = as_uop(u[ax])
    if wi is not None:
        w = kb.load(wi, [u[0]])
        # reduced or clamped in its own type first, so the index arithmetic stays within int32
        w = w % UOp.const(L, w.dtype) if mode == "circular" else w.clamp(0, L)
        pos = pos + w.cast(dtypes.index).clamp(0, L)
    pos = pos % L if mode == "circular" else pos
    dst = list(u)
    dst[ax] = pos.clamp(0, L - 1)
    kb.store(out, dst, kb.load(upd, u))
    kb.run()
    return [keep_const(out, ins)]


@op("Col2Im")
def _col2im(ctx, ins, a):
    """Each image element sums the column entries of the blocks that cover it (a gather over the kernel
    window: block position = (pixel + pad - k * dilation) / stride where that divides exactly)."""
    x = ins[0]
    image, block = ctx.ints(ins[1]), ctx.ints(ins[2])
    nd = len(image)
    dil = list(a.get("dilations", [1] * nd))
    pads = list(a.get("pads", [0] * (2 * nd)))
    strides = list(a.get("strides", [1] * nd))
    nblocks = [(image[d] + pads[d] + pads[d + nd] - dil[d] * (block[d] - 1) - 1) // strides[d] + 1
               for d in range(nd)]
    K = 1
    for b in block:
        K *= b
    N, C = x.shape[0], x.shape[1] // K
    out = ctx.k.empty([N, C] + image, x.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    n, c = kb.rng(N), kb.rng(C)
    px = [kb.rng(s) for s in image]
    kk = [kb.rng(s, AxisType.REDUCE) for s in block]
    ok, col, pos = None, as_uop(c), None
    for d in range(nd):
        num = as_uop(px[d]) + pads[d] - as_uop(kk[d]) * dil[d]
        q = num // strides[d]
        good = (num >= 0) & (num % strides[d] == 0) & (q < nblocks[d]) if strides[d] > 1 else \
            (num >= 0) & (num < nblocks[d])
        ok = good if ok is None else ok & good
        col = col * block[d] + as_uop(kk[d])
        qc = q.clamp(0, nblocks[d] - 1)
        pos = qc if pos is None else pos * nblocks[d] + qc
    zero = UOp.const(0.0, x.dtype) if x.dtype.is_float else UOp.const(0, x.dtype)
    v = ok.where(kb.load(x, [n, col, pos]), zero)
    rr = [r for r in kk if isr(r)]
    if rr:
        v = v.reduce(*rr)
    kb.store(out, [n, c] + px, v)
    kb.run()
    return [keep_const(out, ins[:1])]
