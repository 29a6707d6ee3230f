"""The ops of transformer blocks as kernels: RMSNormalization (one kernel), RotaryEmbedding (one kernel)
and Attention (scores, softmax and the weighted sum: three kernels, plus the KV-cache concatenation).

Attention's rarer modes (nonpad_kv_seqlen, sliding windows, the qk_matmul_output output, a
softmax_precision, half-precision inputs) run through the spec's function body instead."""
from __future__ import annotations

import math

from morok_py import AxisType, Ops, UOp, dtypes

from morok_py.onnx.errors import OnnxError

from morok_py.onnx.tensor import INDEX_MAX, KB, View
from morok_py.onnx.ops.common import ONNX_DT, as_uop, compute_dtype, isr, keep_const, reshape
from morok_py.onnx.ops.registry import op

F32 = dtypes.float32


@op("RMSNormalization")
def _rms_norm(ctx, ins, a):
    """y = cast(x / sqrt(mean(x^2 over axis..) + eps), T) * scale, in stash_type (float32) as the spec."""
    x, scale = ins[0], ins[1]
    eps = a.get("epsilon", 1e-5)
    ax = a.get("axis", -1) % x.ndim
    st = ONNX_DT[a.get("stash_type", 1)]
    out = ctx.k.empty(x.shape, x.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    outer = [kb.rng(s) for s in x.shape[:ax]]
    red = [kb.rng(s, AxisType.REDUCE) for s in x.shape[ax:]]
    loop = [kb.rng(s, AxisType.LOOP) for s in x.shape[ax:]]
    xr = kb.load(x, outer + red).cast(st)
    ss = xr * xr
    rr = [r for r in red if isr(r)]
    ss = ss.reduce(*rr) if rr else ss
    n = math.prod(x.shape[ax:])
    inv = (ss / UOp.const(float(n), st) + UOp.const(float(eps), st)).sqrt().reciprocal()
    y = (kb.load(x, outer + loop).cast(st) * inv).cast(x.dtype)
    sc = kb.load(scale, outer + loop)
    y = (compute_dtype(y) * compute_dtype(sc))
    kb.store(out, outer + loop, y)
    kb.run()
    return [keep_const(out, ins)]


def heads_view(ctx, v: View, nh: int) -> View:
    """A (batch, seq, heads, head_size) view of a 3-d (batch, seq, heads*head_size) or a 4-d
    (batch, heads, seq, head_size) tensor."""
    if v.ndim == 4:
        return v.permute([0, 2, 1, 3])
    B, S, E = v.shape
    return reshape(ctx, v, [B, S, nh, E // nh])


@op("RotaryEmbedding")
def _rotary(ctx, ins, a):
    x, cos, sin = ins[0], ins[1], ins[2]
    pos = ins[3] if len(ins) > 3 else None
    nh = a.get("num_heads", 0)
    if x.ndim == 3 and not nh:
        raise OnnxError("RotaryEmbedding of a 3-d input needs num_heads")
    out = ctx.k.empty(x.shape, x.dtype)
    if out.size == 0:
        return [out]
    xv, ov = heads_view(ctx, x, nh), heads_view(ctx, out, nh)
    B, S, NH, HD = xv.shape
    rd = a.get("rotary_embedding_dim", 0) or HD
    half = rd // 2
    inter = bool(a.get("interleaved", 0))
    kb = KB(ctx.k, ctx.n())
    b, s, h, d = kb.rng(B), kb.rng(S), kb.rng(NH), kb.rng(HD)
    du = as_uop(d)
    if inter:
        first = (du % 2) == 0
        ci = du // 2
        partner = first.where(du + 1, du - 1)
    else:
        first = du < half
        ci = first.where(du, du - half)
        partner = first.where(du + half, du - half)
    rot = du < rd
    ci = ci.clamp(0, max(half - 1, 0))
    partner = rot.where(partner, du).clamp(0, HD - 1)
    if pos is not None:
        p = kb.load(pos, [b, s]).cast(dtypes.index).clamp(0, cos.shape[0] - 1)
        cidx = [p, ci]
    else:
        cidx = [b, s, ci]
    xs = compute_dtype(kb.load(xv, [b, s, h, d]))
    xp = compute_dtype(kb.load(xv, [b, s, h, partner]))
    c = compute_dtype(kb.load(cos, cidx))
    sn = compute_dtype(kb.load(sin, cidx))
    y = first.where(xs * c - xp * sn, xs * c + xp * sn)
    kb.store(ov, [b, s, h, d], rot.where(y, xs))
    kb.run()
    return [keep_const(out, ins)]


def _function_body(ctx, ins, a):
    """Run this node as the spec's function of other ops (the modes the kernels here leave out)."""
    return ctx.ex.run_function_body(ctx.node, ins, ctx.opset, ctx.name)


def _rng(kb: KB, extent: int | UOp, kind: AxisType = AxisType.GLOBAL) -> UOp:
    """A range of a static extent (KB.rng) or of a symbolic one (the KV length of a cache)."""
    if isinstance(extent, int):
        return kb.rng(extent, kind)
    r = UOp.range(extent, kb.axis, kind)
    kb.axis += 1
    return r


class _Cache:
    """The key/value sequence axis: static, or, with a past cache, `past + new` with `past` and that
    total launch variables, so every decode step reuses the programs of the one before."""

    def __init__(self, P: int, S: int, symbolic: bool) -> None:
        self.P_val, self.S = P, S
        # two variables, not past + S: a range's extent stays a plain variable, which every device's
        # launch-size code takes (the launch passes both, consistent)
        self.past: int | UOp = UOp.variable("past", 0, INDEX_MAX) if symbolic else P
        self.total: int | UOp = UOp.variable("total", 1, INDEX_MAX) if symbolic else P + S
        self.vars = {"past": P, "total": P + S} if symbolic else {}

    def flat(self, b, h, j, d, heads: int, width: int) -> UOp:
        """Index of [b, h, j, d] in a contiguous (batch, heads, total, width) buffer."""
        return ((as_uop(b) * heads + as_uop(h)) * self.total + as_uop(j)) * width + as_uop(d)


def _present(ctx, past: View | None, new: View, cache: _Cache, suffix: str) -> View:
    """present = concat(past, new) along the sequence axis of (batch, heads, seq, head_size); new alone
    (made contiguous) without a past."""
    B, Hh, S, D = new.shape
    out = ctx.k.empty([B, Hh, cache.P_val + S, D], new.dtype)
    if past is not None and past.size:
        kb = KB(ctx.k, ctx.n(f"{suffix}0"))
        b, h, p, d = kb.rng(B), kb.rng(Hh), _rng(kb, cache.past), kb.rng(D)
        if isinstance(cache.past, int):     # a static past: any strides
            val = kb.load(past, [b, h, p, d])
        else:                               # a symbolic one is contiguous (checked by the caller)
            val = kb.param(past).load(((as_uop(b) * Hh + as_uop(h)) * cache.past + as_uop(p)) * D + as_uop(d)
                                      + past.offset)
        kb.store(out, cache.flat(b, h, p, d, Hh, D), val)
        kb.run(**cache.vars)
    kb = KB(ctx.k, ctx.n(f"{suffix}1"))
    b, h, s, d = kb.rng(B), kb.rng(Hh), kb.rng(S), kb.rng(D)
    kb.store(out, cache.flat(b, h, as_uop(s) + cache.past, d, Hh, D), kb.load(new, [b, h, s, d]))
    kb.run(**cache.vars)
    return out


@op("Attention")
def _attention(ctx, ins, a):
    Q, K, V = ins[0], ins[1], ins[2]
    opt = lambda i: ins[i] if len(ins) > i and ins[i] is not None else None  # noqa: E731
    mask, past_k, past_v, nonpad = opt(3), opt(4), opt(5), opt(6)
    outs = list(ctx.node.output) + [""] * 4      # Y, present_key, present_value, qk_matmul_output
    if (nonpad is not None or outs[3] or Q.dtype != F32
            or a.get("softmax_precision") is not None or a.get("left_window_size", -1) >= 0
            or a.get("right_window_size", -1) >= 0 or (past_k is None) != (past_v is None)):
        return _function_body(ctx, ins, a)
    H = a.get("q_num_heads") or (Q.shape[1] if Q.ndim == 4 else None)
    KVH = a.get("kv_num_heads") or (K.shape[1] if K.ndim == 4 else None)
    q, k, v = heads_view(ctx, Q, H), heads_view(ctx, K, KVH), heads_view(ctx, V, KVH)   # (B, S, heads, hd)
    B, Sq, _, hd = q.shape
    k4, v4 = k.permute([0, 2, 1, 3]), v.permute([0, 2, 1, 3])                             # (B, KVH, S, hd)
    vhd = v4.shape[3]
    P = past_k.shape[2] if past_k is not None else 0
    cache = _Cache(P, k4.shape[2], past_k is not None and past_k.is_contiguous() and past_v.is_contiguous())
    kp = _present(ctx, past_k, k4, cache, "present_key")
    vp = _present(ctx, past_v, v4, cache, "present_value")
    Skv = cache.P_val + cache.S
    rep = H // KVH
    scale = a.get("scale")
    scale = 1 / math.sqrt(hd) if scale is None else scale
    softcap = a.get("softcap", 0.0)
    causal = bool(a.get("is_causal", 0))
    ninf = UOp.const(-math.inf, F32)

    def rows(b, h, i, j) -> UOp:
        """Index of [b, h, i, j] in the (B, H, Sq, total) scores and probabilities."""
        return ((as_uop(b) * H + as_uop(h)) * Sq + as_uop(i)) * cache.total + as_uop(j)

    # scores with the additive bias: s[b, h, i, j] = q.k * scale (softcapped) + mask + causal
    s = ctx.k.empty([B, H, Sq, Skv], F32)
    kb = KB(ctx.k, ctx.n("scores"))
    b, h, i, j = kb.rng(B), kb.rng(H), kb.rng(Sq), _rng(kb, cache.total)
    d = kb.rng(hd, AxisType.REDUCE)
    kvh = as_uop(h) // rep if rep > 1 else h
    acc = kb.load(q, [b, i, h, d]) * kb.param(kp).load(cache.flat(b, kvh, j, d, KVH, hd))
    acc = acc.reduce(d) if isr(d) else acc
    acc = acc * UOp.const(float(scale), F32)
    if softcap:
        acc = (acc / UOp.const(float(softcap), F32)).tanh() * UOp.const(float(softcap), F32)
    bias = None
    if mask is not None:
        ml = mask.shape[-1]
        midx = [b, h, i, as_uop(j).minimum(ml - 1)][4 - mask.ndim:]
        mv = kb.load(mask, midx)
        inside = as_uop(j) < ml
        if mv.dtype == dtypes.bool:
            bias = (inside & mv).where(UOp.const(0.0, F32), ninf)
        else:
            bias = inside.where(mv.cast(F32), ninf)
    if causal:
        allowed = as_uop(j) <= as_uop(i) + cache.past
        bias = allowed.where(bias if bias is not None else UOp.const(0.0, F32), ninf)
    if bias is not None:
        acc = acc + bias
    kb.store(s, rows(b, h, i, j), acc)
    kb.run(**cache.vars)

    # softmax over j; a row whose every key is masked gives zeros, as the spec's guard
    p = ctx.k.empty([B, H, Sq, Skv], F32)
    kb = KB(ctx.k, ctx.n("softmax"))
    b, h, i = kb.rng(B), kb.rng(H), kb.rng(Sq)
    j1, j2 = _rng(kb, cache.total, AxisType.REDUCE), _rng(kb, cache.total, AxisType.REDUCE)
    jj = _rng(kb, cache.total, AxisType.LOOP)
    ps = kb.param(s)
    m = ps.load(rows(b, h, i, j1))
    m = m.reduce(j1, op=Ops.MAX) if isr(j1) else m
    dead = m == ninf
    msafe = dead.where(UOp.const(0.0, F32), m)
    e = (ps.load(rows(b, h, i, j2)) - msafe).exp()
    tot = e.reduce(j2) if isr(j2) else e
    tot = (tot == UOp.const(0.0, F32)).where(UOp.const(1.0, F32), tot)
    pv = (ps.load(rows(b, h, i, jj)) - msafe).exp() / tot
    kb.store(p, rows(b, h, i, jj), dead.where(UOp.const(0.0, F32), pv))
    kb.run(**cache.vars)

    # y = p @ v, written in the input's layout: (B, H, Sq, vhd) for 4-d, (B, Sq, H * vhd) for 3-d
    y = ctx.k.empty([B, H, Sq, vhd] if Q.ndim == 4 else [B, Sq, H * vhd], Q.dtype)
    yv = y if Q.ndim == 4 else y.try_reshape([B, Sq, H, vhd]).permute([0, 2, 1, 3])
    kb = KB(ctx.k, ctx.n("output"))
    b, h, i, e_ = kb.rng(B), kb.rng(H), kb.rng(Sq), kb.rng(vhd)
    j = _rng(kb, cache.total, AxisType.REDUCE)
    kvh = as_uop(h) // rep if rep > 1 else h
    acc = kb.param(p).load(rows(b, h, i, j)) * kb.param(vp).load(cache.flat(b, kvh, j, e_, KVH, vhd))
    acc = acc.reduce(j) if isr(j) else acc
    kb.store(yv, [b, h, i, e_], acc)
    kb.run(**cache.vars)
    return [keep_const(y, ins[:3]), kp if outs[1] else None, vp if outs[2] else None][:len(ctx.node.output)]
