"""DFT (forward, inverse, one-sided, real or complex input) as one kernel: every output frequency (or
sample) reduces over the input with twiddle angles taken as 2*pi*((k*m) mod n)/n, so large k*m keep
their precision."""
from __future__ import annotations

import math

from morok_py import AxisType, UOp, dtypes

from morok_py.onnx.errors import UnsupportedOp
from morok_py.onnx.tensor import KB
from morok_py.onnx.ops.common import as_uop, isr, keep_const
from morok_py.onnx.ops.registry import op

# computed in float64, as the reference (numpy.fft in complex128) does before rounding once to the output
F64 = dtypes.float64


def _f(v: float) -> UOp:
    return UOp.const(float(v), F64)


def twiddle(k, m, n: int) -> tuple[UOp, UOp]:
    """(cos, sin) of 2*pi*k*m/n, reduced in integers to a sine of an angle in [0, pi/2], so the values
    at multiples of pi/2 are exact (0 and 1) and large k*m lose no precision."""
    r = as_uop(k) * as_uop(m) % n
    rev = r > iconst_(n) - r                      # angle past pi: sin changes sign
    t = rev.where(iconst_(n) - r, r) * 2          # 2*angle/(2*pi/n), in [0, n]: the angle is pi*t/n
    past = t > iconst_(n) - t                     # angle past pi/2: cos changes sign
    tr = past.where(iconst_(n) - t, t)            # in [0, n/2]
    def sin_frac(num: UOp, den: int) -> UOp:      # sin(pi * num / den)
        return (num.cast(dtypes.int32).cast(F64) * _f(math.pi / den)).sin()
    sn = sin_frac(tr, n)
    cs = sin_frac(iconst_(n) - tr * 2, 2 * n)     # cos(pi*tr/n) = sin(pi*(n - 2tr)/(2n))
    return past.where(-cs, cs), rev.where(-sn, sn)


@op("DFT")
def _dft(ctx, ins, a):
    x = ins[0]
    n = int(ctx.scalar(ins[1])) if len(ins) > 1 and ins[1] is not None and ins[1].size else None
    if ctx.opset >= 20:
        axis = int(ctx.scalar(ins[2])) if len(ins) > 2 and ins[2] is not None else -2
    else:
        axis = a.get("axis", 1)
    axis %= x.ndim
    inverse, onesided = bool(a.get("inverse", 0)), bool(a.get("onesided", 0))
    if axis == x.ndim - 1:
        raise UnsupportedOp("DFT along the real/imaginary axis")
    L, comps = x.shape[axis], x.shape[-1]
    if n is None:
        n = 2 * (L - 1) if inverse and onesided else L
    if inverse and onesided:
        K, out_c = n, 1                 # irfft: a real signal of n samples
    else:
        K, out_c = (n // 2 + 1 if onesided else n), 2
    shape = list(x.shape[:-1]) + [out_c]
    shape[axis] = K
    out = ctx.k.empty(shape, x.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    idx = [kb.rng(s) for s in shape]
    k, comp = idx[axis], idx[-1]
    zero = _f(0.0)

    def component(src_pos, c: int) -> UOp:
        if c >= comps:
            return zero
        src = list(idx[:-1]) + [c]
        src[axis] = src_pos
        return kb.load(x, src).cast(F64)

    if inverse and onesided:
        # Hermitian extension of the one-sided spectrum: Y[j] = X[j] (j <= n/2), conj(X[n-j]) beyond
        j = kb.rng(n, AxisType.REDUCE)
        ju = as_uop(j)
        lower = ju <= n // 2
        jj = lower.where(ju, iconst_(n) - ju)
        inside = jj < min(L, n // 2 + 1)
        pos = jj.clamp(0, L - 1)
        re, im = component(pos, 0), component(pos, 1)
        im = lower.where(im, -im)
        c, sn = twiddle(k, j, n)
        v = inside.where(re * c - im * sn, zero)
        v = v.reduce(j) if isr(j) else v
        v = v * _f(1.0 / n)
    else:
        m = kb.rng(min(L, n), AxisType.REDUCE)
        re, im = component(m, 0), component(m, 1)
        c, s = twiddle(k, m, n)
        sgn = _f(1.0 if inverse else -1.0)       # e^{-i th} forward, e^{+i th} inverse
        first = as_uop(comp) == 0
        v = first.where(re * c - sgn * im * s, im * c + sgn * re * s)
        v = v.reduce(m) if isr(m) else v
        if inverse:
            v = v * _f(1.0 / n)
    kb.store(out, idx, v.cast(x.dtype))
    kb.run()
    return [keep_const(out, ins[:1])]


def iconst_(v: int) -> UOp:
    return UOp.const(int(v), dtypes.index)
