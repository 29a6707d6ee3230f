"""Shape ops (views without a kernel where the strides allow), constants, Tile, Pad, Concat, Trilu."""
from __future__ import annotations

import math

import numpy as np
from onnx import numpy_helper

from morok_py import UOp, dtypes
from morok_py.dtypes import from_numpy

from morok_py.onnx.errors import OnnxError, UnsupportedOp
from morok_py.onnx.tensor import KB, bcast_shape, concat_in_place, copy, elementwise, fill, iconst, prod
from morok_py.onnx.ops.common import as_uop, keep_const, reshape
from morok_py.onnx.ops.registry import op


@op("Identity")
def _identity(ctx, ins, a):
    return [ins[0]]


@op("Dropout")
def _dropout(ctx, ins, a):
    x = ins[0]
    training = len(ins) > 2 and ins[2] is not None and bool(ctx.scalar(ins[2]))
    ratio = float(ctx.scalar(ins[1])) if len(ins) > 1 and ins[1] is not None else a.get("ratio", 0.5)
    if training and ratio > 0:
        raise UnsupportedOp("Dropout in training mode draws random numbers")
    mask = fill(ctx.k, ctx.n("mask"), x.shape, True, dtypes.bool)
    return [x, mask]


@op("Reshape")
def _reshape(ctx, ins, a):
    x = ins[0]
    shape = ctx.ints(ins[1]) if len(ins) > 1 else list(a["shape"])
    allow_zero = a.get("allowzero", 0)
    out = []
    for i, s in enumerate(shape):
        out.append(x.shape[i] if (s == 0 and not allow_zero) else s)
    if -1 in out:
        known = prod(s for s in out if s != -1)
        out[out.index(-1)] = x.size // known if known else 0
    return [reshape(ctx, x, out)]


@op("Flatten")
def _flatten(ctx, ins, a):
    x = ins[0]
    ax = a.get("axis", 1)
    ax = ax + x.ndim if ax < 0 else ax
    return [reshape(ctx, x, [prod(x.shape[:ax]), prod(x.shape[ax:])])]


def _axes(ctx, ins, a, pos=1):
    if len(ins) > pos and ins[pos] is not None:
        return ctx.ints(ins[pos])
    return list(a["axes"]) if "axes" in a else None


@op("Squeeze")
def _squeeze(ctx, ins, a):
    x = ins[0]
    axes = _axes(ctx, ins, a)
    axes = [i for i, s in enumerate(x.shape) if s == 1] if axes is None else [ax % x.ndim for ax in axes]
    keep = [i for i in range(x.ndim) if i not in axes]
    return [x.with_([x.shape[i] for i in keep], [x.strides[i] for i in keep])]


@op("Unsqueeze")
def _unsqueeze(ctx, ins, a):
    x = ins[0]
    axes = _axes(ctx, ins, a)
    nd = x.ndim + len(axes)
    axes = sorted(ax % nd for ax in axes)
    shape, strides = list(x.shape), list(x.strides)
    for ax in axes:
        shape.insert(ax, 1)
        strides.insert(ax, 0)
    v = x.with_(shape, strides)
    return [v]


@op("Transpose")
def _transpose(ctx, ins, a):
    x = ins[0]
    perm = a.get("perm", list(reversed(range(x.ndim))))
    return [x.permute(perm)]


@op("Expand")
def _expand(ctx, ins, a):
    x = ins[0]
    shape = bcast_shape(x.shape, ctx.ints(ins[1]))
    return [x.expand(shape)]


@op("Shape")
def _shape(ctx, ins, a):
    x = ins[0]
    nd = x.ndim
    start, end = a.get("start", 0), a.get("end", nd)
    start = max(0, min(nd, start + nd if start < 0 else start))
    end = max(0, min(nd, end + nd if end < 0 else end))
    return [ctx.const_view(np.array(x.shape[start:end], dtype=np.int64))]


@op("Size")
def _size(ctx, ins, a):
    return [ctx.const_view(np.array(ins[0].size, dtype=np.int64))]


def _slice_params(shape, starts, ends, axes, steps):
    nd = len(shape)
    axes = list(range(len(starts))) if axes is None else [ax % nd for ax in axes]
    steps = [1] * len(starts) if steps is None else steps
    res = [(0, s, 1) for s in shape]
    for st, en, ax, sp in zip(starts, ends, axes, steps):
        d = shape[ax]
        if sp == 0:
            raise OnnxError("Slice with step 0")
        if st < 0:
            st += d
        if en < 0:
            en += d
        if sp > 0:
            st, en = max(0, min(d, st)), max(0, min(d, en))
        else:
            st, en = max(-1, min(d - 1, st)), max(-1, min(d - 1, en))
        res[ax] = (st, en, sp)
    return res


@op("Slice")
def _slice(ctx, ins, a):
    x = ins[0]
    if len(ins) > 1:
        starts, ends = ctx.ints(ins[1]), ctx.ints(ins[2])
        axes = ctx.ints(ins[3]) if len(ins) > 3 and ins[3] is not None else None
        steps = ctx.ints(ins[4]) if len(ins) > 4 and ins[4] is not None else None
    else:
        starts, ends, axes, steps = list(a["starts"]), list(a["ends"]), a.get("axes"), None
    params = _slice_params(x.shape, starts, ends, axes, steps)
    shape, strides, off = [], [], x.offset
    for (st, en, sp), stride in zip(params, x.strides):
        n = max(0, -(-(en - st) // sp)) if sp > 0 else max(0, -(-(st - en) // -sp))
        shape.append(n)
        strides.append(stride * sp)
        if n:
            off += st * stride
    return [x.with_(shape, strides, off)]


@op("Split")
def _split(ctx, ins, a):
    x = ins[0]
    ax = a.get("axis", 0) % x.ndim
    split = ctx.ints(ins[1]) if len(ins) > 1 and ins[1] is not None else a.get("split")
    n_out = len(ctx.node.output)
    if not split:
        d = x.shape[ax]
        n = a.get("num_outputs", n_out)
        c = -(-d // n)
        split = [c] * (d // c) + ([d % c] if d % c else [])
        split = split + [0] * (n - len(split))
    outs, pos = [], 0
    for s in split:
        shape = list(x.shape)
        shape[ax] = s
        outs.append(x.with_(shape, x.strides, x.offset + pos * x.strides[ax]))
        pos += s
    return outs


# ---- constants --------------------------------------------------------------------------------------
@op("Constant")
def _constant(ctx, ins, a):
    if "value" in a:
        arr = numpy_helper.to_array(a["value"])
    elif "value_float" in a:
        arr = np.array(a["value_float"], np.float32)
    elif "value_floats" in a:
        arr = np.array(a["value_floats"], np.float32)
    elif "value_int" in a:
        arr = np.array(a["value_int"], np.int64)
    elif "value_ints" in a:
        arr = np.array(a["value_ints"], np.int64)
    else:
        raise UnsupportedOp(f"Constant with {sorted(a)}")
    return [ctx.const_view(arr)]


@op("ConstantOfShape")
def _constant_of_shape(ctx, ins, a):
    shape = ctx.ints(ins[0])
    val = numpy_helper.to_array(a["value"]).reshape(-1)[0] if "value" in a else np.float32(0)
    dt = from_numpy(val.dtype)
    out = fill(ctx.k, ctx.n(), shape, val.item(), dt)
    out.const = ins[0].const
    return [out]


@op("Range")
def _range(ctx, ins, a):
    start, limit, delta = (ctx.scalar(v) for v in ins)
    n = max(int(math.ceil((float(limit) - float(start)) / float(delta))), 0)
    dt = ins[0].dtype
    if n == 1:   # start + 0 * delta: the simplifier folds delta's load away and the kernel loses a param
        return [keep_const(copy(ctx.k, ctx.n(), ins[0].with_((1,), (0,))), ins)]

    def f(xs, idx):
        s, d = xs[0], xs[1]
        return s + idx[0].cast(dt) * d
    return [keep_const(elementwise(ctx.k, ctx.n(), [ins[0].with_((1,), (0,)), ins[2].with_((1,), (0,))], f, dt,
                                    shape=(n,), need_idx=True), ins)]


# ---- index-driven elementwise ---------------------------------------------------------------------
@op("Trilu")
def _trilu(ctx, ins, a):
    x = ins[0]
    k = int(ctx.scalar(ins[1])) if len(ins) > 1 and ins[1] is not None else 0
    upper = a.get("upper", 1)

    def f(xs, idx):
        i, j = idx[-2], idx[-1]
        i = i if isinstance(i, UOp) else iconst(i)
        j = j if isinstance(j, UOp) else iconst(j)
        keep = (j - i >= k) if upper else (j - i <= k)
        return keep.where(xs[0], UOp.const(0, x.dtype))
    return [elementwise(ctx.k, ctx.n(), [x], f, x.dtype, need_idx=True)]


@op("Tile")
def _tile(ctx, ins, a):
    x = ins[0]
    reps = ctx.ints(ins[1])
    shape = [s * r for s, r in zip(x.shape, reps)]
    kb = KB(ctx.k, ctx.n())
    out = ctx.k.empty(shape, x.dtype)
    if out.size:
        idx = [kb.rng(s) for s in shape]
        kb.store(out, idx, kb.load(x, [as_uop(i) % s if s != 1 else 0 for i, s in zip(idx, x.shape)]))
        kb.run()
    return [out]


@op("Pad")
def _pad(ctx, ins, a):
    x = ins[0]
    mode = a.get("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if len(ins) > 1 and ins[1] is not None:
        pads = ctx.ints(ins[1])
        cval = ins[2] if len(ins) > 2 and ins[2] is not None else None
        axes = ctx.ints(ins[3]) if len(ins) > 3 and ins[3] is not None else None
    else:
        pads, cval, axes = list(a["pads"]), None, None
        if "value" in a:
            cval = ctx.const_view(np.array(a["value"], dtype=x.dtype.np))
    nd = x.ndim
    axes = list(range(nd)) if axes is None else [ax % nd for ax in axes]
    before, after = [0] * nd, [0] * nd
    for j, ax in enumerate(axes):
        before[ax], after[ax] = pads[j], pads[j + len(axes)]
    shape = [s + b + e for s, b, e in zip(x.shape, before, after)]
    out = ctx.k.empty(shape, x.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    idx = [kb.rng(s) for s in shape]
    src, valid = [], None
    for i, s, b in zip(idx, x.shape, before):
        j = as_uop(i) - b
        if mode == "constant":
            ok = (j >= 0) & (j < s)
            valid = ok if valid is None else valid & ok
            src.append(j.clamp(0, s - 1))
        elif mode == "edge":
            src.append(j.clamp(0, s - 1))
        elif mode == "reflect":
            if s == 1:
                src.append(iconst(0))
                continue
            period = 2 * (s - 1)
            m = j % period
            m = (m < 0).where(m + period, m)
            src.append((m >= s).where(iconst(period) - m, m).clamp(0, s - 1))
        elif mode == "wrap":
            m = j % s
            src.append((m < 0).where(m + s, m).clamp(0, s - 1))
        else:
            raise UnsupportedOp(f"Pad mode {mode}")
    if x.size == 0:
        val = kb.load(cval, []) if cval is not None else UOp.const(0, x.dtype)
    else:
        val = kb.load(x, src)
        if valid is not None:
            c = kb.load(cval, []) if cval is not None else UOp.const(0, x.dtype)
            val = valid.where(val, c)
    kb.store(out, idx, val)
    kb.run()
    return [out]


@op("Concat")
def _concat(ctx, ins, a):
    """Copy kernels into the output's slices, except for the inputs whose producers can write their
    slice themselves (tensor.concat_in_place; MOROK_ONNX_CONCAT_VIEWS=0 turns that off)."""
    ins = [v for v in ins if v is not None]
    nd = ins[0].ndim
    ax = a["axis"] % nd
    shape = list(ins[0].shape)
    shape[ax] = sum(v.shape[ax] for v in ins)
    out = ctx.k.empty(shape, ins[0].dtype)
    todo = concat_in_place(ctx.k, out, ins, ax)
    if todo is None:
        return [keep_const(out, ins)]
    pos = 0
    for j, v in enumerate(ins):
        if v.size and j in todo:
            dst = out.with_(v.shape, out.strides, pos * out.strides[ax])
            kb = KB(ctx.k, ctx.n(str(j)))
            idx = [kb.rng(s) for s in v.shape]
            kb.store(dst, idx, kb.load(v, idx))
            kb.run()
        pos += v.shape[ax]
    return [keep_const(out, ins)]
