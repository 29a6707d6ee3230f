"""Resize (nearest, linear, cubic; every coordinate transformation, antialias, exclude_outside, axes,
keep_aspect_ratio_policy, tf_crop_and_resize's extrapolation) as one gather kernel.

Resize is separable: along each resized axis, output position o reads a few input positions with
weights that depend on o only. Those (index, weight) tables are computed on the host, as the ONNX
reference computes them, uploaded as constants, and the kernel sums the product of the taps.
"""
from __future__ import annotations

import math

import numpy as np

from morok_py import AxisType, UOp, dtypes

from morok_py.onnx.errors import UnsupportedOp
from morok_py.onnx.tensor import KB
from morok_py.onnx.ops.common import isr, keep_const
from morok_py.onnx.ops.registry import op


def _s(v, default: str) -> str:
    v = default if v is None else v
    return v.decode() if isinstance(v, bytes) else v


def _nearest(ratio: float, mode: str) -> list[float]:
    if float(ratio).is_integer():
        return [0, 1]
    if mode == "round_prefer_floor":
        return [ratio <= 0.5, ratio > 0.5]
    if mode == "round_prefer_ceil":
        return [ratio < 0.5, ratio >= 0.5]
    if mode == "floor":
        return [1, 0]
    if mode == "ceil":
        return [0, 1]
    raise UnsupportedOp(f"Resize nearest_mode {mode!r}")


def _cubic(ratio: float, A: float) -> list[float]:
    r, q = ratio, 1 - ratio
    return [((A * (r + 1) - 5 * A) * (r + 1) + 8 * A) * (r + 1) - 4 * A,
            ((A + 2) * r - (A + 3)) * r * r + 1,
            ((A + 2) * q - (A + 3)) * q * q + 1,
            ((A * (q + 1) - 5 * A) * (q + 1) + 8 * A) * (q + 1) - 4 * A]


def _cubic_aa(ratio: float, scale: float, A: float) -> list[float]:
    scale = min(scale, 1.0)

    def c(x: float) -> float:
        x = abs(x)
        if x <= 1:
            return (A + 2) * x ** 3 - (A + 3) * x * x + 1
        if x < 2:
            return A * x ** 3 - 5 * A * x * x + 8 * A * x - 4 * A
        return 0.0
    start = int(np.floor(-2 / scale) + 1)
    cs = [c(scale * (i - ratio)) for i in range(start, 2 - start)]
    return [v / sum(cs) for v in cs]


def _linear_aa(ratio: float, scale: float) -> list[float]:
    scale = min(scale, 1.0)
    start = int(np.floor(-1 / scale) + 1)
    args = (np.arange(start, start + 2 - 2 * start) - ratio) * scale
    cs = np.clip(1 - np.abs(args), 0, 1)
    return list(cs / cs.sum())


def _source_coords(mode: str, out_n: int, in_n: int, scale: float, roi: tuple[float, float] | None):
    """Input coordinate of each output position, and which ones fall outside (tf_crop_and_resize)."""
    y = np.arange(out_n, dtype=np.float64)
    out_w = scale * in_n
    outside = None
    if mode == "align_corners":
        x = np.zeros(out_n) if out_w == 1 else y * (in_n - 1) / (out_w - 1)
    elif mode == "asymmetric":
        x = y / scale
    elif mode == "tf_crop_and_resize":
        lo, hi = roi
        x = np.full(out_n, (hi - lo) * (in_n - 1) / 2) if out_w == 1 else y * (hi - lo) * (in_n - 1) / (out_w - 1)
        x = x + lo * (in_n - 1)
        outside = (x < 0) | (x > in_n - 1)
    elif mode == "pytorch_half_pixel":
        x = np.full(out_n, -0.5) if out_w == 1 else (y + 0.5) / scale - 0.5
    elif mode == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    elif mode == "half_pixel_symmetric":
        x = in_n / 2 * (1 - out_n / out_w) + (y + 0.5) / scale - 0.5
    else:
        raise UnsupportedOp(f"Resize coordinate_transformation_mode {mode!r}")
    return x, outside


def axis_table(in_n: int, out_n: int, scale: float, coeffs, ctm: str, roi, exclude_outside: bool):
    """(indices [out, taps], weights [out, taps], outside [out] or None) for one axis, as the reference."""
    x, outside = _source_coords(ctm, out_n, in_n, scale, roi)
    xi = np.floor(x).astype(np.int64)
    ratios = np.where(x == xi, 1.0, x - xi)
    w = np.array([coeffs(float(r), scale) for r in ratios], dtype=np.float64).reshape(out_n, -1)
    n = w.shape[1]
    pad = int(np.ceil(n / 2))
    xp = x + pad
    p = np.floor(xp).astype(np.int64)
    frac = xp - p
    if n % 2 == 0:
        off = np.where(frac == 0, -(n // 2), -(n // 2) + 1)
    else:
        off = np.where(frac <= 0.5, -((n - 1) // 2), -((n - 1) // 2) + 1)
    idx = (p + off)[:, None] + np.arange(n)[None, :] - pad
    if exclude_outside:
        w = np.where((idx < 0) | (idx >= in_n), 0.0, w)
        s = w.sum(-1, keepdims=True)
        w = w / np.where(s == 0, 1.0, s)
    idx = np.clip(idx, 0, in_n - 1)
    if np.all((w == 0) | (w == 1)) and np.all(w.sum(-1) == 1):      # nearest: one tap
        idx, w = idx[np.arange(out_n), w.argmax(-1)][:, None], None
    return idx.astype(np.int32), w, outside


@op("Resize")
def _resize(ctx, ins, a):
    x = ins[0]
    roi = ctx.host(ins[1]).astype(np.float64).reshape(-1) if len(ins) > 1 and ins[1] is not None else None
    scales = ctx.host(ins[2]).astype(np.float64).reshape(-1) if len(ins) > 2 and ins[2] is not None else None
    sizes = ctx.ints(ins[3]) if len(ins) > 3 and ins[3] is not None else None
    if ctx.opset < 11:          # Resize-10: (X, scales), asymmetric coordinates, nearest rounds down
        scales, roi = (ctx.host(ins[1]).astype(np.float64).reshape(-1), None)
        a = dict(a, coordinate_transformation_mode=b"asymmetric", nearest_mode=b"floor")
    if scales is not None and scales.size == 0:
        scales = None
    if roi is not None and roi.size == 0:
        roi = None
    r = x.ndim
    axes = [ax % r for ax in a.get("axes", range(r))]
    mode = _s(a.get("mode"), "nearest")
    ctm = _s(a.get("coordinate_transformation_mode"), "half_pixel")
    nearest_mode = _s(a.get("nearest_mode"), "round_prefer_floor")
    policy = _s(a.get("keep_aspect_ratio_policy"), "stretch")
    A = a.get("cubic_coeff_a", -0.75)
    antialias = bool(a.get("antialias", 0))
    excl = bool(a.get("exclude_outside", 0))
    extrap = a.get("extrapolation_value", 0.0)

    scale = [1.0] * r
    out = list(x.shape)
    if sizes is not None:
        for i, d in enumerate(axes):
            out[d] = sizes[i]
        scale = [out[i] / x.shape[i] for i in range(r)]
        if policy != "stretch":
            pick = min if policy == "not_larger" else max
            s = pick(scale[d] for d in axes)
            scale = [s if i in axes else 1.0 for i in range(r)]
            out = [int(s * x.shape[i] + 0.5) if i in axes else x.shape[i] for i in range(r)]
    else:
        for i, d in enumerate(axes):
            scale[d] = float(scales[i])
        out = [int(scale[i] * x.shape[i]) for i in range(r)]
    full_roi = None
    if roi is not None:
        full_roi = [0.0] * r + [1.0] * r
        for i, d in enumerate(axes):
            full_roi[d], full_roi[r + d] = roi[i], roi[len(axes) + i]

    if mode == "nearest":
        coeffs = lambda ratio, s: _nearest(ratio, nearest_mode)  # noqa: E731
    elif mode == "linear":
        coeffs = _linear_aa if antialias else (lambda ratio, s: [1 - ratio, ratio])
    elif mode == "cubic":
        coeffs = (lambda ratio, s: _cubic_aa(ratio, s, A)) if antialias else (lambda ratio, s: _cubic(ratio, A))
    else:
        raise UnsupportedOp(f"Resize mode {mode!r}")

    res = ctx.k.empty(out, x.dtype)
    if res.size == 0:
        return [res]
    wdt = dtypes.float64 if x.dtype == dtypes.float64 else dtypes.float32
    kb = KB(ctx.k, ctx.n())
    oidx = [kb.rng(s) for s in out]
    src = list(oidx)
    weight, outside, taps = None, None, []
    for d in range(r):
        lo_hi = None if full_roi is None else (full_roi[d], full_roi[d + r])
        same = math.isclose(scale[d], 1.0) and out[d] == x.shape[d] and (
            lo_hi is None or (math.isclose(lo_hi[0], 0.0) and math.isclose(lo_hi[1], 1.0)))
        if same:
            continue
        idx, w, ext = axis_table(x.shape[d], out[d], scale[d], coeffs, ctm, lo_hi, excl)
        t = kb.rng(idx.shape[1], AxisType.REDUCE)
        taps.append(t)
        src[d] = kb.load(ctx.const_view(idx), [oidx[d], t]).cast(dtypes.index).clamp(0, x.shape[d] - 1)
        if w is not None:
            wv = kb.load(ctx.const_view(w.astype(wdt.np)), [oidx[d], t])
            weight = wv if weight is None else weight * wv
        if ext is not None and ext.any():
            ev = kb.load(ctx.const_view(ext), [oidx[d]])
            outside = ev if outside is None else outside | ev
    v = kb.load(x, src)
    if weight is not None:
        v = (v.cast(wdt) if v.dtype != wdt else v) * weight
    rr = [t for t in taps if isr(t)]
    if rr:
        v = v.reduce(*rr)
    if outside is not None:
        v = outside.where(UOp.const(float(extrap), v.dtype), v)
    if v.dtype != x.dtype:
        v = _to_dtype(v, x.dtype)
    kb.store(res, oidx, v)
    kb.run()
    return [keep_const(res, ins[:1])]


def _to_dtype(v: UOp, dt) -> UOp:
    """Round and saturate a float result into an integer dtype (numpy's saturate_cast), or cast."""
    if dt.is_float:
        return v.cast(dt)
    lo, hi = float(dt.min()), float(dt.max())
    return v.round().maximum(UOp.const(lo, v.dtype)).minimum(UOp.const(hi, v.dtype)).cast(dt)
