"""Reductions, ArgMax/ArgMin, CumSum, the softmax family and TopK."""
from __future__ import annotations

from typing import Sequence

from morok_py import AxisType, Ops, UOp, dtypes

from morok_py.onnx.tensor import KB, View, elementwise, prod
from morok_py.onnx.ops.common import abs_value, as_uop, ew, isr, reshape, HAS_MIN_REDUCE
from morok_py.onnx.ops.registry import OPS, op


# ---- reductions -------------------------------------------------------------------------------------
def reduce(ctx, x: View, axes: Sequence[int], rop: Ops, pre=None, post=None, dtype=None, suffix="",
           keepdims=True) -> View:
    """out[kept] = post(reduce(pre(x[...]) over axes), count); reduced dims kept as 1."""
    nd = x.ndim
    axes = sorted(set(ax % nd for ax in axes)) if nd else []
    oshape = [1 if i in axes else s for i, s in enumerate(x.shape)]
    dt = dtype or x.dtype
    out = ctx.k.empty(oshape, dt)
    count = prod(x.shape[i] for i in axes)
    if out.size:
        kb = KB(ctx.k, ctx.n(suffix))
        idx = [kb.rng(s, AxisType.REDUCE if i in axes else AxisType.GLOBAL) if not (i in axes and s == 0) else None
               for i, s in enumerate(x.shape)]
        if x.size == 0:
            ident = {Ops.ADD: 0, Ops.MUL: 1, Ops.MAX: dt.min(), Ops.MIN: dt.max()}[rop]
            v = UOp.const(float(ident) if dt.is_float else ident, dt)
        else:
            v = kb.load(x, idx)
            if pre is not None:
                v = pre(v)
            rr = [r for i, r in enumerate(idx) if i in axes and isr(r)]
            if rr:
                v = v.reduce(*rr, op=rop)
        if post is not None:
            v = post(v, count)
        kb.store(out, [0 if i in axes else r for i, r in enumerate(idx)], v)
        kb.run()
    out.const = x.const
    if not keepdims:
        keep = [i for i in range(nd) if i not in axes]
        out = out.with_([oshape[i] for i in keep], [out.strides[i] for i in keep])
        out.const = x.const
    return out


def _neg_for_min(v: UOp) -> UOp:
    return -v if v.dtype.is_float else ~v


def reduce_min(ctx, x, axes, pre=None, post=None, suffix="", keepdims=True):
    if HAS_MIN_REDUCE:
        return reduce(ctx, x, axes, Ops.MIN, pre, post, suffix=suffix, keepdims=keepdims)
    p = (lambda v: _neg_for_min(pre(v))) if pre else _neg_for_min
    q = (lambda v, c: post(_neg_for_min(v), c)) if post else (lambda v, c: _neg_for_min(v))
    return reduce(ctx, x, axes, Ops.MAX, p, q, suffix=suffix, keepdims=keepdims)


def _reduce_axes(ctx, ins, a, x):
    if ctx.node.op_type == "ReduceSum" and ctx.opset >= 13 or ctx.opset >= 18:
        axes = ctx.ints(ins[1]) if len(ins) > 1 and ins[1] is not None else None
    else:
        axes = list(a["axes"]) if "axes" in a else None
    if not axes:
        if a.get("noop_with_empty_axes", 0):
            return []
        return list(range(x.ndim))
    return axes


def _reduce_op(name, rop, pre=None, post=None):
    def impl(ctx, ins, a):
        x = ins[0]
        axes = _reduce_axes(ctx, ins, a, x)
        kd = bool(a.get("keepdims", 1))
        if not axes:
            return [ew(ctx, [x], (lambda v: post(pre(v) if pre else v, 1)) if post else (pre or (lambda v: v)))]
        if rop == "min":
            return [reduce_min(ctx, x, axes, pre, post, keepdims=kd)]
        return [reduce(ctx, x, axes, rop, pre, post, keepdims=kd)]
    OPS[name] = impl


def _cnt(v: UOp, c: int) -> UOp:
    return UOp.const(float(c), v.dtype) if v.dtype.is_float else UOp.const(c, v.dtype)


_reduce_op("ReduceSum", Ops.ADD)
_reduce_op("ReduceMax", Ops.MAX)
_reduce_op("ReduceMin", "min")
_reduce_op("ReduceProd", Ops.MUL)
_reduce_op("ReduceMean", Ops.ADD, post=lambda v, c: v / _cnt(v, c) if v.dtype.is_float else v.cdiv(_cnt(v, c)))
_reduce_op("ReduceSumSquare", Ops.ADD, pre=lambda v: v * v)
_reduce_op("ReduceL1", Ops.ADD, pre=abs_value)
_reduce_op("ReduceL2", Ops.ADD, pre=lambda v: v * v,
           post=lambda v, c: v.sqrt() if v.dtype.is_float else v.cast(dtypes.float32).sqrt().cast(v.dtype))
_reduce_op("ReduceLogSum", Ops.ADD, post=lambda v, c: v.log())


@op("ReduceLogSumExp")
def _rlse(ctx, ins, a):
    x = ins[0]
    axes = _reduce_axes(ctx, ins, a, x)
    kd = bool(a.get("keepdims", 1))
    if x.size == 0 or not axes:
        return [reduce(ctx, x, axes or [], Ops.ADD, lambda v: v.exp(), lambda v, c: v.log(), keepdims=kd)]
    m = reduce(ctx, x, axes, Ops.MAX, suffix="max")
    shp = m.shape
    # sum(exp(x - m)) then log + m
    out = ctx.k.empty(shp, x.dtype)
    kb = KB(ctx.k, ctx.n())
    axes = [ax % x.ndim for ax in axes]
    idx = [kb.rng(s, AxisType.REDUCE if i in axes else AxisType.GLOBAL) for i, s in enumerate(x.shape)]
    oidx = [0 if i in axes else r for i, r in enumerate(idx)]
    mv = kb.load(m, oidx)
    s = (kb.load(x, idx) - mv).exp()
    rr = [r for i, r in enumerate(idx) if i in axes and isr(r)]
    if rr:
        s = s.reduce(*rr)
    kb.store(out, oidx, s.log() + mv)
    kb.run()
    if not kd:
        keep = [i for i in range(x.ndim) if i not in axes]
        out = out.with_([shp[i] for i in keep], [out.strides[i] for i in keep])
    return [out]


def _arg(ctx, x: View, ax: int, largest: bool, last: bool, keepdims: bool = True, suffix="") -> View:
    """Index (int64) of the max/min along ax: first occurrence, or last with `last`."""
    m = reduce(ctx, x, [ax], Ops.MAX, suffix=suffix + "max") if largest else reduce_min(ctx, x, [ax], suffix=suffix + "min")
    out = ctx.k.empty(m.shape, dtypes.int64)
    kb = KB(ctx.k, ctx.n(suffix + "arg"))
    idx = [kb.rng(s, AxisType.REDUCE if i == ax else AxisType.GLOBAL) for i, s in enumerate(x.shape)]
    oidx = [0 if i == ax else r for i, r in enumerate(idx)]
    hit = kb.load(x, idx) == kb.load(m, oidx)
    k = as_uop(idx[ax]).cast(dtypes.int64)
    n = x.shape[ax]
    if last:
        v = hit.where(k, UOp.const(-1, dtypes.int64))
        v = v.reduce(idx[ax], op=Ops.MAX) if isr(idx[ax]) else v
    else:   # first: max of (n - 1 - k) where hit, then n - 1 - that
        v = hit.where(UOp.const(n - 1, dtypes.int64) - k, UOp.const(-1, dtypes.int64))
        v = v.reduce(idx[ax], op=Ops.MAX) if isr(idx[ax]) else v
        v = UOp.const(n - 1, dtypes.int64) - v
    kb.store(out, oidx, v)
    kb.run()
    if not keepdims:
        keep = [i for i in range(x.ndim) if i != ax]
        out = out.with_([m.shape[i] for i in keep], [out.strides[i] for i in keep])
    return out


def _argop(largest):
    def impl(ctx, ins, a):
        x = ins[0]
        return [_arg(ctx, x, a.get("axis", 0) % x.ndim, largest, bool(a.get("select_last_index", 0)),
                     bool(a.get("keepdims", 1)))]
    return impl


OPS["ArgMax"] = _argop(True)
OPS["ArgMin"] = _argop(False)


# ---- softmax family ---------------------------------------------------------------------------------
def _softmax_axes(ctx, x, a):
    if ctx.opset >= 13:
        return [a.get("axis", -1) % x.ndim]
    ax = a.get("axis", 1) % x.ndim if x.ndim else 0
    return list(range(ax, x.ndim))


def _softmax(kind):
    def impl(ctx, ins, a):
        x = ins[0]
        axes = _softmax_axes(ctx, x, a)
        if kind == "hardmax":
            flat = reshape(ctx, x, list(x.shape[:axes[0]]) + [prod(x.shape[axes[0]:])]) if len(axes) > 1 else x
            ax = axes[0]
            am = _arg(ctx, flat, ax, True, False)
            o = elementwise(ctx.k, ctx.n(), [am], lambda xs, idx: (as_uop(idx[ax]).cast(dtypes.int64) == xs[0]).where(
                UOp.const(1, x.dtype), UOp.const(0, x.dtype)), x.dtype, shape=flat.shape, need_idx=True)
            return [reshape(ctx, o, x.shape)]
        out = ctx.k.empty(x.shape, x.dtype)
        if out.size == 0:
            return [out]
        kb = KB(ctx.k, ctx.n())
        outer = [kb.rng(s) if i not in axes else None for i, s in enumerate(x.shape)]
        k1 = [kb.rng(x.shape[i], AxisType.REDUCE) for i in axes]
        k2 = [kb.rng(x.shape[i], AxisType.REDUCE) for i in axes]
        jj = [kb.rng(x.shape[i], AxisType.LOOP) for i in axes]

        def at(ks):
            idx, it = [], iter(ks)
            for i in range(x.ndim):
                idx.append(next(it) if i in axes else outer[i])
            return idx
        r1 = [r for r in k1 if isr(r)]
        r2 = [r for r in k2 if isr(r)]
        m = kb.load(x, at(k1))
        m = m.reduce(*r1, op=Ops.MAX) if r1 else m
        s = (kb.load(x, at(k2)) - m).exp()
        s = s.reduce(*r2) if r2 else s
        e = kb.load(x, at(jj)) - m
        kb.store(out, at(jj), e - s.log() if kind == "log" else e.exp() / s)
        kb.run()
        return [out]
    return impl


OPS["Softmax"] = _softmax("soft")
OPS["LogSoftmax"] = _softmax("log")
OPS["Hardmax"] = _softmax("hardmax")


@op("TopK")
def _topk(ctx, ins, a):
    x = ins[0]
    K = int(ctx.scalar(ins[1])) if len(ins) > 1 else a["k"]
    ax = a.get("axis", -1) % x.ndim
    largest = a.get("largest", 1)
    n = x.shape[ax]
    # rank[i] = #{e : x[e] beats x[i]} (ties: the lower index wins)
    rank = ctx.k.empty(x.shape, dtypes.int32)
    kb = KB(ctx.k, ctx.n("rank"))
    idx = [kb.rng(s) for s in x.shape]
    e = kb.rng(n, AxisType.REDUCE)
    src = list(idx)
    src[ax] = e
    xe, xi = kb.load(x, src), kb.load(x, idx)
    beats = (xe > xi) if largest else (xe < xi)
    beats = beats | ((xe == xi) & (as_uop(e) < as_uop(idx[ax])))
    v = beats.where(UOp.const(1, dtypes.int32), UOp.const(0, dtypes.int32))
    kb.store(rank, idx, v.reduce(e) if isr(e) else v)
    kb.run()
    oshape = list(x.shape)
    oshape[ax] = K
    vals, inds = ctx.k.empty(oshape, x.dtype), ctx.k.empty(oshape, dtypes.int64)
    if vals.size == 0:
        return [vals, inds]
    kb = KB(ctx.k, ctx.n("select"))
    idx = [kb.rng(s) for s in oshape]
    i = kb.rng(n, AxisType.REDUCE)
    src = list(idx)
    src[ax] = i
    hit = kb.load(rank, src) == as_uop(idx[ax])
    pos = hit.where(as_uop(i).cast(dtypes.int64), UOp.const(0, dtypes.int64))
    pos = pos.reduce(i) if isr(i) else pos
    src2 = list(idx)
    src2[ax] = pos.cast(dtypes.index).clamp(0, n - 1)
    kb.store(inds, idx, pos)
    kb.store(vals, idx, kb.load(x, src2))
    kb.run()
    return [vals, inds]
