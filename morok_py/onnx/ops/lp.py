"""LpPool and LpNormalization: p-norms over pooling windows and along an axis, each one kernel per
reduction."""
from __future__ import annotations

from morok_py import AxisType, Ops, UOp, dtypes

from morok_py.onnx.tensor import KB
from morok_py.onnx.ops.common import abs_value, ew, fconst, isr, keep_const, method
from morok_py.onnx.ops.nn import _pool_geometry, _window
from morok_py.onnx.ops.reduce import reduce
from morok_py.onnx.ops.registry import op


def power(x: UOp, p: float) -> UOp:
    """x ** p: repeated products for small integer p, pow otherwise."""
    if float(p).is_integer() and 1 <= p <= 4:
        r = x
        for _ in range(int(p) - 1):
            r = r * x
        return r
    return method(x, "pow", fconst(x, p))


def root(x: UOp, p: float) -> UOp:
    """x ** (1/p)."""
    if p == 1:
        return x
    if p == 2:
        return x.sqrt()
    return method(x, "pow", fconst(x, 1.0 / p))


@op("LpPool")
def _lp_pool(ctx, ins, a):
    """(sum over the window of |x|^p) ** (1/p); padding contributes zeros (what ONNX's cases expect)."""
    x = ins[0]
    p = float(a.get("p", 2))
    kshape = list(a["kernel_shape"])
    outs, strides, dil, pads = _pool_geometry(a, list(x.shape[2:]), kshape, bool(a.get("ceil_mode", 0)))
    N, C = x.shape[0], x.shape[1]
    out = ctx.k.empty([N, C] + outs, x.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    n, c = kb.rng(N), kb.rng(C)
    sp = [kb.rng(o) for o in outs]
    kk = [kb.rng(s, AxisType.REDUCE) for s in kshape]
    coords, valid = _window(kb, x, sp, kk, strides, dil, pads)
    xv = kb.load(x, [n, c] + coords).cast(dtypes.float32)
    zero = UOp.const(0.0, dtypes.float32)
    v = valid.where(power(abs_value(xv), p), zero)
    rr = [r for r in kk if isr(r)]
    total = v.reduce(*rr) if rr else v
    kb.store(out, [n, c] + sp, root(total, p).cast(x.dtype))
    kb.run()
    return [keep_const(out, ins)]


@op("LpNormalization")
def _lp_normalization(ctx, ins, a):
    x = ins[0]
    p = int(a.get("p", 2))
    ax = a.get("axis", -1) % x.ndim
    norm = reduce(ctx, x, [ax], Ops.ADD, pre=lambda v: power(abs_value(v), p), post=lambda v, _: root(v, p),
                  suffix="norm")

    def f(v, nv):
        z = UOp.const(0, v.dtype)
        return (nv == z).where(z, v / nv)
    return [ew(ctx, [x, norm], f)]
