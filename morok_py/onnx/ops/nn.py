"""Convolution, pooling and normalization."""
from __future__ import annotations

from morok_py import AxisType, Ops, UOp, dtypes

from morok_py.onnx.errors import UnsupportedOp
from morok_py.onnx.tensor import KB, View, elementwise, iconst, prod
from morok_py.onnx.ops.common import as_uop, cast_to, ew, fconst, isr, ONNX_DT
from morok_py.onnx.ops.registry import OPS, op
from morok_py.onnx.ops.reduce import reduce


# ---- convolution and pooling ------------------------------------------------------------------------
def _pool_geometry(a, spatial, kshape, ceil_mode=False):
    nd = len(spatial)
    strides = list(a.get("strides", [1] * nd))
    dil = list(a.get("dilations", [1] * nd))
    pads = list(a.get("pads", [0] * (2 * nd)))
    auto = a.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    outs = []
    for d in range(nd):
        ek = (kshape[d] - 1) * dil[d] + 1
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-spatial[d] // strides[d])
            total = max(0, (o - 1) * strides[d] + ek - spatial[d])
            lo = total // 2 if auto == "SAME_UPPER" else total - total // 2
            pads[d], pads[d + nd] = lo, total - lo
        elif auto == "VALID":
            pads[d] = pads[d + nd] = 0
        span = spatial[d] + pads[d] + pads[d + nd] - ek
        if ceil_mode:
            o = -(-span // strides[d]) + 1
            if (o - 1) * strides[d] >= spatial[d] + pads[d]:
                o -= 1
        else:
            o = span // strides[d] + 1
        outs.append(o)
    return outs, strides, dil, pads


def _window(kb, x: View, spatial_idx, kidx, strides, dil, pads):
    """Input coordinates of a window element and the mask of those inside the input."""
    coords, valid = [], None
    nd = len(spatial_idx)
    for d in range(nd):
        H = x.shape[2 + d]
        c = as_uop(spatial_idx[d]) * strides[d] + as_uop(kidx[d]) * dil[d] - pads[d]
        ok = (c >= 0) & (c < H)
        valid = ok if valid is None else valid & ok
        coords.append(c.clamp(0, H - 1))
    return coords, valid


@op("Conv")
def _conv(ctx, ins, a):
    x, w = ins[0], ins[1]
    b = ins[2] if len(ins) > 2 else None
    nd = x.ndim - 2
    kshape = list(a.get("kernel_shape", w.shape[2:]))
    outs, strides, dil, pads = _pool_geometry(a, list(x.shape[2:]), kshape)
    G = a.get("group", 1)
    N, C = x.shape[0], x.shape[1]
    CO, CI = w.shape[0], w.shape[1]
    COg = CO // G
    out = ctx.k.empty([N, CO] + outs, x.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    n, co = kb.rng(N), kb.rng(CO)
    sp = [kb.rng(o) for o in outs]
    ci = kb.rng(CI, AxisType.REDUCE)
    kk = [kb.rng(s, AxisType.REDUCE) for s in kshape]
    g = as_uop(co) // COg if G > 1 else iconst(0)
    cin = g * CI + as_uop(ci) if G > 1 else ci
    coords, valid = _window(kb, x, sp, kk, strides, dil, pads)
    need_mask = any(p > 0 for p in pads) or any((o - 1) * s + (k - 1) * d >= H
                                                  for o, s, k, d, H in zip(outs, strides, kshape, dil, x.shape[2:]))
    xv = kb.load(x, [n, cin] + coords)
    if need_mask:
        xv = valid.where(xv, UOp.const(0, x.dtype))
    v = xv * kb.load(w, [co, ci] + kk)
    rr = [r for r in [ci] + kk if isr(r)]
    if rr:
        v = v.reduce(*rr)
    if b is not None:
        v = v + kb.load(b, [co])
    kb.store(out, [n, co] + sp, v)
    kb.run()
    return [out]


def _pool(kind):
    def impl(ctx, ins, a):
        x = ins[0]
        kshape = list(a["kernel_shape"])
        outs, strides, dil, pads = _pool_geometry(a, list(x.shape[2:]), kshape, bool(a.get("ceil_mode", 0)))
        N, C = x.shape[0], x.shape[1]
        out = ctx.k.empty([N, C] + outs, x.dtype)
        kb = KB(ctx.k, ctx.n())
        n, c = kb.rng(N), kb.rng(C)
        sp = [kb.rng(o) for o in outs]
        kk = [kb.rng(s, AxisType.REDUCE) for s in kshape]
        coords, valid = _window(kb, x, sp, kk, strides, dil, pads)
        xv = kb.load(x, [n, c] + coords)
        rr = [r for r in kk if isr(r)]
        if kind == "max":
            v = valid.where(xv, UOp.const(x.dtype.min(), x.dtype))
            v = v.reduce(*rr, op=Ops.MAX) if rr else v
            kb.store(out, [n, c] + sp, v)
            kb.run()
            res = [out]
            if len(ctx.node.output) > 1 and ctx.node.output[1]:
                # Indices: flat index (row-major, or column-major with storage_order=1) of the max
                ind = ctx.k.empty(out.shape, dtypes.int64)
                kb2 = KB(ctx.k, ctx.n("indices"))
                n2, c2 = kb2.rng(N), kb2.rng(C)
                sp2 = [kb2.rng(o) for o in outs]
                kk2 = [kb2.rng(s, AxisType.REDUCE) for s in kshape]
                coords2, valid2 = _window(kb2, x, sp2, kk2, strides, dil, pads)
                hit = valid2 & (kb2.load(x, [n2, c2] + coords2) == kb2.load(out, [n2, c2] + sp2))
                sh = list(x.shape[2:])
                if a.get("storage_order", 0):
                    # column-major within one (n, c) plane, planes in row-major order
                    flat, mul = iconst(0), 1
                    for d in range(len(sh)):
                        flat = flat + coords2[d] * mul
                        mul *= sh[d]
                    flat = (as_uop(n2) * C + as_uop(c2)) * prod(sh) + flat
                else:
                    flat = as_uop(n2) * C + as_uop(c2)
                    for d in range(len(sh)):
                        flat = flat * sh[d] + coords2[d]
                # first hit in window order: max over (BIG - flat_window_pos) encoded as -pos
                pos = iconst(0)
                for r, s in zip(kk2, kshape):
                    pos = pos * s + as_uop(r)
                kbig = prod(kshape)
                key = hit.where((iconst(kbig) - pos).cast(dtypes.int64) * (1 << 40) + flat.cast(dtypes.int64),
                                UOp.const(-1, dtypes.int64))
                rr2 = [r for r in kk2 if isr(r)]
                key = key.reduce(*rr2, op=Ops.MAX) if rr2 else key
                kb2.store(ind, [n2, c2] + sp2, key % (1 << 40))
                kb2.run()
                res.append(ind)
            return res
        v = valid.where(xv, UOp.const(0, x.dtype))
        v = v.reduce(*rr) if rr else v
        if a.get("count_include_pad", 0):
            # padding counts, the part past the padded end (ceil_mode) does not
            cnt = None
            for d in range(len(outs)):
                H = x.shape[2 + d]
                st = as_uop(sp[d]) * strides[d] - pads[d]
                en = (st + (kshape[d] - 1) * dil[d] + 1).minimum(H + pads[d + len(outs)])
                c_d = (en - st + (dil[d] - 1)) // dil[d]
                cnt = c_d if cnt is None else cnt * c_d
            v = v / cnt.cast(x.dtype)
        else:
            kb_cnt = valid.where(UOp.const(1.0, x.dtype), UOp.const(0.0, x.dtype))
            kb_cnt = kb_cnt.reduce(*rr) if rr else kb_cnt
            v = v / kb_cnt
        kb.store(out, [n, c] + sp, v)
        kb.run()
        return [out]
    return impl


OPS["MaxPool"] = _pool("max")
OPS["AveragePool"] = _pool("avg")


@op("GlobalAveragePool")
def _gap(ctx, ins, a):
    x = ins[0]
    return [reduce(ctx, x, list(range(2, x.ndim)), Ops.ADD, post=lambda v, c: v / fconst(v, c))]


@op("GlobalMaxPool")
def _gmp(ctx, ins, a):
    x = ins[0]
    return [reduce(ctx, x, list(range(2, x.ndim)), Ops.MAX)]


# ---- normalization ----------------------------------------------------------------------------------
def _chan(v: View, nd: int) -> View:
    """A per-channel [C] vector as [C, 1, ..., 1] for broadcasting over N, C, spatial."""
    return v.with_(v.shape + (1,) * (nd - 2), v.strides + (0,) * (nd - 2))


@op("BatchNormalization")
def _batchnorm(ctx, ins, a):
    x, scale, bias, mean, var = ins[:5]
    eps = a.get("epsilon", 1e-5)
    nd = x.ndim
    if a.get("training_mode", 0):
        mom = a.get("momentum", 0.9)
        axes = [0] + list(range(2, nd))
        cnt = prod(x.shape[i] for i in axes)
        m = reduce(ctx, x, axes, Ops.ADD, post=lambda v, c: v / fconst(v, c), suffix="mean")
        vv = _variance(ctx, x, m, axes, "var")
        y = ew(ctx, [x, m, vv, _bshape(scale, nd), _bshape(bias, nd)],
               lambda u, mu, s2, sc, bi: (u - mu) / (s2 + fconst(u, eps)).sqrt() * sc + bi)
        msq, vsq = m.with_((x.shape[1],), (1,)), vv.with_((x.shape[1],), (1,))
        rm = ew(ctx, [mean, msq], lambda r, c: r * fconst(r, mom) + c * fconst(r, 1 - mom), suffix="running_mean")
        rv = ew(ctx, [var, vsq], lambda r, c: r * fconst(r, mom) + c * fconst(r, 1 - mom), suffix="running_var")
        return [y, rm, rv]
    if nd < 2:
        raise UnsupportedOp("BatchNormalization of rank < 2")
    vs = [x] + [_chan(v, nd) for v in (scale, bias, mean, var)]
    return [ew(ctx, vs, lambda u, sc, bi, mu, s2: (u - mu) * ((s2 + fconst(s2, eps)).sqrt().reciprocal() * sc) + bi)]


def _bshape(v: View, nd: int) -> View:
    return v.with_((1,) + v.shape + (1,) * (nd - 2), (0,) + v.strides + (0,) * (nd - 2))


def _variance(ctx, x: View, m: View, axes, suffix) -> View:
    """Population variance of x over axes given the mean m (keepdims)."""
    out = ctx.k.empty(m.shape, x.dtype)
    kb = KB(ctx.k, ctx.n(suffix))
    idx = [kb.rng(s, AxisType.REDUCE if i in axes else AxisType.GLOBAL) for i, s in enumerate(x.shape)]
    oidx = [0 if i in axes else r for i, r in enumerate(idx)]
    d = kb.load(x, idx) - kb.load(m, oidx)
    v = d * d
    rr = [r for i, r in enumerate(idx) if i in axes and isr(r)]
    v = v.reduce(*rr) if rr else v
    kb.store(out, oidx, v / fconst(v, prod(x.shape[i] for i in axes)))
    kb.run()
    return out


@op("InstanceNormalization")
def _instnorm(ctx, ins, a):
    x, scale, bias = ins
    eps = a.get("epsilon", 1e-5)
    nd = x.ndim
    axes = list(range(2, nd))
    m = reduce(ctx, x, axes, Ops.ADD, post=lambda v, c: v / fconst(v, c), suffix="mean")
    var = _variance(ctx, x, m, axes, "var")
    return [ew(ctx, [x, m, var, _chan(scale, nd), _chan(bias, nd)],
               lambda u, mu, s2, sc, bi: (u - mu) / (s2 + fconst(u, eps)).sqrt() * sc + bi)]


@op("LayerNormalization")
def _layernorm(ctx, ins, a):
    x, scale = ins[0], ins[1]
    bias = ins[2] if len(ins) > 2 else None
    eps = a.get("epsilon", 1e-5)
    nd = x.ndim
    ax = a.get("axis", -1) % nd
    axes = list(range(ax, nd))
    st = ONNX_DT[a.get("stash_type", 1)]
    xs = cast_to(ctx, x, st) if x.dtype != st else x
    m = reduce(ctx, xs, axes, Ops.ADD, post=lambda v, c: v / fconst(v, c), suffix="mean")
    var = _variance(ctx, xs, m, axes, "var")
    inv = ew(ctx, [var], lambda s2: (s2 + fconst(s2, eps)).sqrt().reciprocal(), suffix="invstd")
    vs = [xs, m, inv, scale] + ([bias] if bias is not None else [])
    y = elementwise(ctx.k, ctx.n("y"), vs, lambda v, _: ((v[0] - v[1]) * v[2]).cast(x.dtype) * v[3] +
                    (v[4] if bias is not None else UOp.const(0, x.dtype)), x.dtype)
    return [y, m, inv]


@op("LRN")
def _lrn(ctx, ins, a):
    x = ins[0]
    size = a["size"]
    alpha, beta, bias = a.get("alpha", 1e-4), a.get("beta", 0.75), a.get("bias", 1.0)
    lo, hi = (size - 1) // 2, -(-(size - 1) // 2)
    C = x.shape[1]
    out = ctx.k.empty(x.shape, x.dtype)
    kb = KB(ctx.k, ctx.n())
    idx = [kb.rng(s) for s in x.shape]
    r = kb.rng(size, AxisType.REDUCE)
    cc = as_uop(idx[1]) - lo + as_uop(r)
    ok = (cc >= 0) & (cc < C)
    src = list(idx)
    src[1] = cc.clamp(0, C - 1)
    xv = kb.load(x, src)
    sq = ok.where(xv * xv, UOp.const(0, x.dtype))
    sq = sq.reduce(r) if isr(r) else sq
    base = sq * fconst(sq, alpha / size) + fconst(sq, bias)
    kb.store(out, idx, kb.load(x, idx) * (base.log() * fconst(base, -beta)).exp())
    kb.run()
    return [out]
