"""ScatterND, ScatterElements (and the older Scatter), GatherND.

A plain scatter (reduction "none") copies the data and then stores each update at its index, one kernel
over the updates; where indices repeat ONNX leaves the result undefined. A scatter with a reduction is
computed per output element instead: every output reduces over the updates whose index hits it, so
repeated indices need no atomics and the result does not depend on launch order (the cost is outputs times
candidate updates: the updates along the axis for ScatterElements, all index rows for ScatterND).
"""
from __future__ import annotations

from typing import Sequence

from morok_py import AxisType, Ops, UOp, dtypes

from morok_py.onnx.errors import UnsupportedOp
from morok_py.onnx.tensor import KB, View, copy, iconst, prod
from morok_py.onnx.ops.common import as_uop, isr, keep_const
from morok_py.onnx.ops.registry import op


def _reduction(a) -> str:
    r = a.get("reduction", "none")
    return r.decode() if isinstance(r, bytes) else r


def norm_index(j: UOp, d: int) -> UOp:
    """An index read from a tensor, negative counting from the end, clamped into [0, d) as an index."""
    j = (j < UOp.const(0, j.dtype)).where(j + UOp.const(d, j.dtype), j)
    return j.clamp(0, d - 1).cast(dtypes.index)


def load_index(kb: KB, ind: View, idx: Sequence, d: int) -> UOp:
    """norm_index of ind[idx]; on an axis of extent 1 the constant 0 without a load (the clamp would fold
    the load away and leave its parameter slot unused)."""
    return iconst(0) if d == 1 else norm_index(kb.load(ind, idx), d)


_COMBINE = {"add": (Ops.ADD, 0), "mul": (Ops.MUL, 1), "max": (Ops.MAX, None), "min": (Ops.MIN, None)}


def _identity(red: str, dt):
    ident = _COMBINE[red][1]
    if ident is None:
        ident = dt.min() if red == "max" else dt.max()
    return UOp.const(float(ident) if dt.is_float else ident, dt)


def _combine(red: str, a: UOp, b: UOp) -> UOp:
    return {"add": lambda: a + b, "mul": lambda: a * b, "max": lambda: a.maximum(b),
            "min": lambda: a.minimum(b)}[red]()


def _reduced_scatter(ctx, data: View, upd_shape: Sequence[int], hit_and_src, red: str, suffix: str = "") -> View:
    """out[p] = data[p] (op) reduce over u of (updates[u] where u's target is p); hit_and_src(kb, p, u)
    gives (the condition that u targets p, the load of updates[u])."""
    if red not in _COMBINE:
        raise UnsupportedOp(f"scatter reduction {red!r}")
    out = ctx.k.empty(data.shape, data.dtype)
    if out.size == 0:
        return out
    kb = KB(ctx.k, ctx.n(suffix))
    p = [kb.rng(s) for s in data.shape]
    u = [kb.rng(s, AxisType.REDUCE) for s in upd_shape]
    hit, val = hit_and_src(kb, p, u)
    v = hit.where(val, _identity(red, data.dtype))
    rr = [r for r in u if isr(r)]
    if rr:
        v = v.reduce(*rr, op=_COMBINE[red][0])
    kb.store(out, p, _combine(red, kb.load(data, p), v))
    kb.run()
    return out


def _plain_scatter(ctx, data: View, upd: View, target) -> View:
    """A copy of data with updates[u] stored at target(kb, u) (the output's full index)."""
    out = copy(ctx.k, ctx.n("copy"), data)
    if upd.size == 0:
        return out
    kb = KB(ctx.k, ctx.n())
    u = [kb.rng(s) for s in upd.shape]
    kb.store(out, target(kb, u), kb.load(upd, u))
    kb.run()
    return out


@op("ScatterElements", "Scatter")
def _scatter_elements(ctx, ins, a):
    data, ind, upd = ins
    ax = a.get("axis", 0) % data.ndim
    d = data.shape[ax]
    red = _reduction(a)
    if ind.size == 0:
        return [data]
    if red == "none":
        def target(kb, u):
            t = list(u)
            t[ax] = load_index(kb, ind, u, d)
            return t
        return [keep_const(_plain_scatter(ctx, data, upd, target), ins)]

    def hit_and_src(kb, p, u):
        # the candidates for output p: the updates at p's coordinates off the axis, any position along it
        src, inside = list(p), None
        src[ax] = u[0]
        for i in range(data.ndim):
            if i != ax and upd.shape[i] < data.shape[i]:
                ok = as_uop(p[i]) < upd.shape[i]
                inside = ok if inside is None else inside & ok
                src[i] = as_uop(p[i]).minimum(upd.shape[i] - 1)
        hit = load_index(kb, ind, src, d) == as_uop(p[ax])
        return (hit if inside is None else hit & inside), kb.load(upd, src)
    return [keep_const(_reduced_scatter(ctx, data, [upd.shape[ax]], hit_and_src, red), ins)]


@op("ScatterND")
def _scatter_nd(ctx, ins, a):
    data, ind, upd = ins
    K = ind.shape[-1]
    lead = list(ind.shape[:-1])
    red = _reduction(a)
    if prod(lead) == 0:
        return [data]

    def coords(kb, ui):
        return [load_index(kb, ind, list(ui) + [j], data.shape[j]) for j in range(K)]

    if red == "none":
        def target(kb, u):
            return coords(kb, u[:len(lead)]) + list(u[len(lead):])
        return [keep_const(_plain_scatter(ctx, data, upd, target), ins)]

    def hit_and_src(kb, p, u):
        hit = None
        for j, c in enumerate(coords(kb, u)):
            h = c == as_uop(p[j])
            hit = h if hit is None else hit & h
        return hit, kb.load(upd, list(u) + list(p[K:]))
    return [keep_const(_reduced_scatter(ctx, data, lead, hit_and_src, red), ins)]


@op("GatherND")
def _gather_nd(ctx, ins, a):
    data, ind = ins
    b = a.get("batch_dims", 0)
    K = ind.shape[-1]
    shape = list(ind.shape[:-1]) + list(data.shape[b + K:])
    out = ctx.k.empty(shape, data.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    idx = [kb.rng(s) for s in shape]
    nlead = ind.ndim - 1
    lead = idx[:nlead]
    src = list(lead[:b]) + [load_index(kb, ind, list(lead) + [j], data.shape[b + j]) for j in range(K)] \
        + list(idx[nlead:])
    kb.store(out, idx, kb.load(data, src))
    kb.run()
    return [keep_const(out, ins)]
