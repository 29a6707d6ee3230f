"""STFT (windowed frames of the signal through the DFT, one float64 reduction kernel) and MelWeightMatrix."""
from __future__ import annotations

import numpy as np

from morok_py import AxisType, UOp, dtypes

from morok_py.onnx.tensor import KB
from morok_py.onnx.ops.common import ONNX_DT, as_uop, isr, keep_const
from morok_py.onnx.ops.dft import twiddle
from morok_py.onnx.ops.registry import op

F64 = dtypes.float64


@op("STFT")
def _stft(ctx, ins, a):
    x, step = ins[0], int(ctx.scalar(ins[1]))
    window = ins[2] if len(ins) > 2 and ins[2] is not None else None
    flen = ins[3] if len(ins) > 3 and ins[3] is not None else None
    n = int(ctx.scalar(flen)) if flen is not None else window.shape[0] if window is not None else x.shape[-2]
    onesided = bool(a.get("onesided", 1))
    B, L, comps = x.shape
    frames = 1 + (L - n) // step
    bins = n // 2 + 1 if onesided else n
    out = ctx.k.empty((B, frames, bins, 2), x.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    b, f, k, comp = kb.rng(B), kb.rng(frames), kb.rng(bins), kb.rng(2)
    m = kb.rng(n, AxisType.REDUCE)
    pos = (as_uop(f) * step + as_uop(m)).clamp(0, L - 1)
    re = kb.load(x, [b, pos, 0]).cast(F64)
    im = kb.load(x, [b, pos, 1]).cast(F64) if comps > 1 else UOp.const(0.0, F64)
    if window is not None:
        w = kb.load(window, [m]).cast(F64)
        re, im = re * w, im * w
    c, s = twiddle(k, m, n)
    v = (as_uop(comp) == 0).where(re * c + im * s, im * c - re * s)     # times e^{-i theta}
    v = v.reduce(m) if isr(m) else v
    kb.store(out, [b, f, k, comp], v.cast(x.dtype))
    kb.run()
    return [keep_const(out, ins)]


@op("MelWeightMatrix")
def _mel_weight_matrix(ctx, ins, a):
    """Triangular mel filters: the bin edges from the scalar inputs on the host (as the reference computes
    them, in float64), the [dft_length // 2 + 1, num_mel_bins] table by one kernel."""
    mels, dft, rate = (int(ctx.scalar(v)) for v in ins[:3])
    lo_hz, hi_hz = (float(ctx.scalar(v)) for v in ins[3:5])
    dt = ONNX_DT[a["output_datatype"]] if a.get("output_datatype") else dtypes.float32
    bins = np.arange(0, mels + 2)
    lo_mel = 2595 * np.log1p(lo_hz / 700) / np.log(10)
    hi_mel = 2595 * np.log1p(hi_hz / 700) / np.log(10)
    f = bins * ((hi_mel - lo_mel) / bins.shape[0]) + lo_mel
    edges = (((dft + 1) * (700 * np.expm1(f / 2595 * np.log(10)))) // rate).astype(np.int64)
    ev = ctx.const_view(edges)
    out = ctx.k.empty((dft // 2 + 1, mels), dt)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    j, i = kb.rng(out.shape[0]), kb.rng(mels)
    lo, c, hi = (kb.load(ev, [as_uop(i) + d]).cast(F64) for d in range(3))
    jf = as_uop(j).cast(dtypes.int32).cast(F64)
    zero, one = UOp.const(0.0, F64), UOp.const(1.0, F64)
    rise = (c == lo).where((jf == c).where(one, zero), ((jf >= lo) & (jf <= c)).where((jf - lo) / (c - lo), zero))
    fall = (hi - jf) / (hi - c).maximum(one)
    v = ((jf >= c) & (jf < hi)).where(fall, rise)
    kb.store(out, [j, i], v.cast(dt))
    kb.run()
    out.const = all(v.const for v in ins[:5])
    return [out]
