"""GridSample (2-d and volumetric; nearest, linear, cubic; zeros, border, reflection padding) as one
kernel: each output element denormalizes its grid point and sums the weighted taps around it, the
interpolation separable over the spatial dims as in the ONNX reference."""
from __future__ import annotations

import itertools

from morok_py import UOp, dtypes

from morok_py.onnx.errors import UnsupportedOp
from morok_py.onnx.tensor import KB
from morok_py.onnx.ops.common import keep_const
from morok_py.onnx.ops.registry import op

F32 = dtypes.float32


def _f(v: float) -> UOp:
    return UOp.const(float(v), F32)


def reflect(x: UOp, lo: float, hi: float) -> UOp:
    """x reflected at the borders [lo, hi] until inside (the reference's _gs_reflect)."""
    rng = _f(hi - lo)

    def fold(dx: UOp):
        n = (dx / rng).trunc()
        r = dx - n * rng
        even = (n - (n * _f(0.5)).floor() * _f(2.0)) == _f(0.0)
        return even, r
    ev_lo, r_lo = fold(_f(lo) - x)
    ev_hi, r_hi = fold(x - _f(hi))
    below = ev_lo.where(_f(lo) + r_lo, _f(hi) - r_lo)
    above = ev_hi.where(_f(hi) - r_hi, _f(lo) + r_hi)
    return (x < _f(lo)).where(below, (x > _f(hi)).where(above, x))


def cubic_coeffs(t: UOp) -> list[UOp]:
    """Keys' cubic convolution weights (alpha = -0.75) of the four taps around t in [0, 1)."""
    a = -0.75

    def outer(x):        # |x| in [1, 2)
        return ((_f(a) * x - _f(5 * a)) * x + _f(8 * a)) * x - _f(4 * a)

    def inner(x):        # |x| in [0, 1)
        return ((_f(a + 2) * x - _f(a + 3)) * x) * x + _f(1.0)
    one = _f(1.0)
    return [outer(t + one), inner(t), inner(one - t), outer(_f(2.0) - t)]


@op("GridSample")
def _grid_sample(ctx, ins, a):
    X, grid = ins[0], ins[1]
    mode = a.get("mode", b"linear" if ctx.opset >= 20 else b"bilinear")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    pad = a.get("padding_mode", b"zeros")
    pad = pad.decode() if isinstance(pad, bytes) else pad
    align = bool(a.get("align_corners", 0))
    if mode not in ("nearest", "linear", "cubic") or pad not in ("zeros", "border", "reflection"):
        raise UnsupportedOp(f"GridSample mode {mode!r} padding {pad!r}")
    dims = list(X.shape[2:])
    k = len(dims)
    N, C = X.shape[0], X.shape[1]
    osp = list(grid.shape[1:-1])
    out = ctx.k.empty([N, C] + osp, X.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    n, c = kb.rng(N), kb.rng(C)
    o = [kb.rng(s) for s in osp]
    lo = [0.0 if align else -0.5 for _ in dims]
    hi = [d - 1.0 if align else d - 0.5 for d in dims]
    xs = []
    for i, d in enumerate(dims):
        g = kb.load(grid, [n] + o + [k - 1 - i]).cast(F32)     # the grid's last axis is (x, y, z): reversed
        x = (g + _f(1.0)) * _f(0.5 * (d - 1)) if align else ((g + _f(1.0)) * _f(d) - _f(1.0)) * _f(0.5)
        if mode == "nearest":
            x = x.round()
        if pad == "border":
            x = ((x < _f(lo[i])) | (x > _f(hi[i]))).where(x.clamp(0.0, float(d - 1)), x)
        elif pad == "reflection":
            x = reflect(x, lo[i], hi[i])
        xs.append(x)

    def tap(i: int, idx: UOp) -> tuple[UOp, UOp | None]:
        """The clamped index of tap `idx` (float, integral) on dim i, and its in-range mask (zeros padding)."""
        d = dims[i]
        if pad == "reflection":
            idx = reflect(idx, lo[i], hi[i]).trunc()
        ok = (idx >= _f(0.0)) & (idx <= _f(d - 1)) if pad == "zeros" else None
        # clamped as a float (no out-of-range conversion) and again as an index (for the bounds check)
        return idx.clamp(0.0, float(d - 1)).cast(dtypes.int32).cast(dtypes.index).clamp(0, d - 1), ok

    zero = UOp.const(0.0, X.dtype) if X.dtype.is_float else UOp.const(0, X.dtype)

    def pixel(taps: list[tuple[UOp, UOp | None]]) -> UOp:
        v = kb.load(X, [n, c] + [t[0] for t in taps])
        oks = [t[1] for t in taps if t[1] is not None]
        if oks:
            m = oks[0]
            for q in oks[1:]:
                m = m & q
            v = m.where(v, zero)
        return v.cast(F32)

    if mode == "nearest":
        val = pixel([tap(i, x) for i, x in enumerate(xs)])
    else:
        per_dim = []
        for i, x in enumerate(xs):
            x0 = x.floor()
            t = x - x0
            if mode == "linear":
                per_dim.append([(x0, _f(1.0) - t), (x0 + _f(1.0), t)])
            else:
                w = cubic_coeffs(t)
                per_dim.append([(x0 + _f(j - 1), w[j]) for j in range(4)])
        val = None
        for combo in itertools.product(*per_dim):
            w = combo[0][1]
            for _, wi in combo[1:]:
                w = w * wi
            term = w * pixel([tap(i, pos) for i, (pos, _) in enumerate(combo)])
            val = term if val is None else val + term
    kb.store(out, [n, c] + o, val.cast(X.dtype))
    kb.run()
    return [keep_const(out, ins)]
