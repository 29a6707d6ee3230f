"""RNN, GRU and LSTM: the input projection of every time step is one matmul; each step is then one
kernel (two for GRU) whose time index is a launch variable, so a sequence of any length runs the
same few programs. Directions, layouts, sequence_lens, activations, clip, peepholes, input_forget
and linear_before_reset follow the ONNX spec."""
from __future__ import annotations

from typing import Callable

from morok_py import AxisType, UOp, dtypes

from morok_py.onnx.errors import UnsupportedOp
from morok_py.onnx.tensor import KB, View, fill, iconst
from morok_py.onnx.ops.common import as_uop, fconst, isr, reshape
from morok_py.onnx.ops.linalg import matmul
from morok_py.onnx.ops.registry import op


def _act(name: str, alpha: float | None, beta: float | None) -> Callable[[UOp], UOp]:
    n = name.decode() if isinstance(name, bytes) else name
    key = n.lower()
    if key == "sigmoid":
        return lambda x: x.sigmoid()
    if key == "tanh":
        return lambda x: x.tanh()
    if key == "relu":
        return lambda x: x.maximum(fconst(x, 0))
    if key == "affine":
        return lambda x: x * fconst(x, 1.0 if alpha is None else alpha) + fconst(x, 0.0 if beta is None else beta)
    if key == "leakyrelu":
        return lambda x: (x < fconst(x, 0)).where(x * fconst(x, 0.01 if alpha is None else alpha), x)
    if key == "thresholdedrelu":
        return lambda x: (x > fconst(x, 1.0 if alpha is None else alpha)).where(x, fconst(x, 0))
    if key == "scaledtanh":
        return lambda x: (x * fconst(x, 1.0 if beta is None else beta)).tanh() * fconst(x, 1.0 if alpha is None else alpha)
    if key == "hardsigmoid":
        return lambda x: (x * fconst(x, 0.2 if alpha is None else alpha)
                          + fconst(x, 0.5 if beta is None else beta)).maximum(fconst(x, 0)).minimum(fconst(x, 1))
    if key == "elu":
        return lambda x: (x < fconst(x, 0)).where((x.exp() - fconst(x, 1)) * fconst(x, 1.0 if alpha is None else alpha), x)
    if key == "softsign":
        return lambda x: x / ((x < fconst(x, 0)).where(-x, x) + fconst(x, 1))
    if key == "softplus":
        return lambda x: x.exp().log1p()
    raise UnsupportedOp(f"recurrent activation {n!r}")


def _activations(a, defaults: list[str], D: int) -> list[list[Callable[[UOp], UOp]]]:
    names = list(a.get("activations", [])) or defaults * D
    alphas, betas = list(a.get("activation_alpha", [])), list(a.get("activation_beta", []))
    fns = [_act(nm, alphas[i] if i < len(alphas) else None, betas[i] if i < len(betas) else None)
           for i, nm in enumerate(names)]
    k = len(defaults)
    return [fns[d * k:(d + 1) * k] for d in range(D)]


def _sub(v: View, i: int) -> View:
    """v[i] of the leading axis, as a view."""
    return v.with_(v.shape[1:], v.strides[1:], v.offset + i * v.strides[0])


class _Step:
    """What one recurrent step kernel needs: the time variable, the batch entry's sequence length, the
    input time it reads, whether it is inside the sequence and where its Y row goes. The length is
    loaded only by a kernel that uses it (a param loaded and then unused would leave a gap)."""

    def __init__(self, kb: KB, S: int, b: UOp, lens: View | None, reverse: bool) -> None:
        self.kb, self.S, self.b, self.lens, self.reverse = kb, S, b, lens, reverse
        self.t = UOp.variable("t", 0, max(S - 1, 1))    # not folded away where S == 1
        self._L: UOp | None = None

    @property
    def L(self) -> UOp:
        if self._L is None:
            self._L = (self.kb.load(self.lens, [self.b]).cast(dtypes.index).clamp(0, self.S)
                       if self.lens is not None else iconst(self.S))
        return self._L

    @property
    def valid(self) -> UOp:
        return self.t < self.L

    @property
    def xt(self) -> UOp:
        return ((self.L - 1 - self.t) if self.reverse else self.t).clamp(0, self.S - 1)

    @property
    def yt(self) -> UOp:
        # steps past the sequence write zeros at their own position, so every row is written once
        if self.lens is None:
            return self.xt
        return self.valid.where(self.xt, self.t).clamp(0, self.S - 1)


def _gate(kb: KB, xw: View, R: View, hprev: View, st: _Step, b, h, k: int, H: int, clip: float | None) -> UOp:
    """xw[t, b, k*H + h] + sum_j hprev[b, j] * R[k*H + h, j], clipped."""
    j = kb.rng(H, AxisType.REDUCE)
    kh = as_uop(h) + k * H
    rec = kb.load(hprev, [b, j]) * kb.load(R, [kh, j])
    rec = rec.reduce(j) if isr(j) else rec
    g = kb.load(xw, [st.xt, b, kh]) + rec
    if clip is not None:
        g = g.maximum(fconst(g, -clip)).minimum(fconst(g, clip))
    return g


def _recurrent(ctx, ins, a, kind: str):
    X, W, R = ins[0], ins[1], ins[2]
    opt = lambda i: ins[i] if len(ins) > i and ins[i] is not None else None  # noqa: E731
    Bias, lens, h0 = opt(3), opt(4), opt(5)
    c0, P = (opt(6), opt(7)) if kind == "LSTM" else (None, None)
    layout = a.get("layout", 0)
    if layout:
        X = X.permute([1, 0, 2])
        h0 = h0.permute([1, 0, 2]) if h0 is not None else None
        c0 = c0.permute([1, 0, 2]) if c0 is not None else None
    S, Bt, I = X.shape
    D, GH = W.shape[0], W.shape[1]
    H = a.get("hidden_size", R.shape[-1])
    direction = a.get("direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    clip = a.get("clip")
    lbr = bool(a.get("linear_before_reset", 0))
    acts = _activations(a, {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}[kind], D)
    dt = X.dtype
    Y = ctx.k.empty([S, D, Bt, H], dt)
    Yh = ctx.k.empty([D, Bt, H], dt)
    Yc = ctx.k.empty([D, Bt, H], dt) if kind == "LSTM" else None
    Xf = reshape(ctx, X, [S * Bt, I])
    for d in range(D):
        reverse = direction == "reverse" or (direction == "bidirectional" and d == 1)
        Wd, Rd = _sub(W, d), _sub(R, d)
        bd = _sub(Bias, d) if Bias is not None else None

        def epi(acc, kb, idx, bd=bd):
            if bd is None:
                return acc
            j = as_uop(idx[-1])
            wb = kb.load(bd.with_((GH,), (bd.strides[0],), bd.offset), [j])
            rb = kb.load(bd.with_((GH,), (bd.strides[0],), bd.offset + GH * bd.strides[0]), [j])
            if kind == "GRU":        # the hidden gate's recurrent bias goes inside the cell
                return acc + wb + (j < 2 * H).where(rb, fconst(rb, 0))
            return acc + wb + rb
        xw = matmul(ctx, Xf, Wd.permute([1, 0]), suffix=f"input{d}", epilogue=epi)
        xw = xw.with_((S, Bt, GH), (Bt * GH, GH, 1))
        # the state, ping-ponged between two buffers so every step runs the same program
        hs = [_state(ctx, h0, d, Bt, H, dt, f"h{d}"), ctx.k.empty([Bt, H], dt)]
        cs = [_state(ctx, c0, d, Bt, H, dt, f"c{d}"), ctx.k.empty([Bt, H], dt)] if kind == "LSTM" else None
        yd = Y.with_((S, Bt, H), (Y.strides[0], Y.strides[2], Y.strides[3]), d * Y.strides[1])
        f_act = acts[d]
        tmp = [ctx.k.empty([Bt, H], dt), ctx.k.empty([Bt, H], dt)] if kind == "GRU" else None
        for step in range(S):
            hp, hn = hs[step % 2], hs[(step + 1) % 2]
            if kind == "GRU":
                _gru_step(ctx, d, xw, Rd, bd, hp, hn, yd, tmp, lens, reverse, S, H, GH, clip, lbr, f_act, step)
                continue
            kb = KB(ctx.k, ctx.n(f"step{d}"))
            b, h = kb.rng(Bt), kb.rng(H)
            st = _Step(kb, S, b, lens, reverse)
            hprev = kb.load(hp, [b, h])
            if kind == "RNN":
                hnew = f_act[0](_gate(kb, xw, Rd, hp, st, b, h, 0, H, clip))
            else:
                cp, cn = cs[step % 2], cs[(step + 1) % 2]
                cprev = kb.load(cp, [b, h])
                # clip bounds each activation's input, peephole terms included
                cl = (lambda g: g) if clip is None else (lambda g: g.maximum(fconst(g, -clip)).minimum(fconst(g, clip)))
                gi, go, gf, gc = (_gate(kb, xw, Rd, hp, st, b, h, k, H, None) for k in range(4))
                if P is not None:
                    pd = _sub(P, d)
                    pi, po, pf = (kb.load(pd, [as_uop(h) + k * H]) for k in range(3))
                    gi, gf = gi + pi * cprev, gf + pf * cprev
                i = f_act[0](cl(gi))
                f = fconst(i, 1) - i if a.get("input_forget", 0) else f_act[0](cl(gf))
                c = f * cprev + i * f_act[1](cl(gc))
                if P is not None:
                    go = go + po * c
                hnew = f_act[0](cl(go)) * f_act[2](c)
                kb.store(cn, [b, h], st.valid.where(c, cprev))
            kb.store(hn, [b, h], st.valid.where(hnew, hprev))
            kb.store(yd, [st.yt, b, h], st.valid.where(hnew, fconst(hnew, 0)))
            kb.run(t=step)
        _copy_into(ctx, Yh, d, hs[S % 2], f"yh{d}")
        if kind == "LSTM":
            _copy_into(ctx, Yc, d, cs[S % 2], f"yc{d}")
    if layout:
        Y, Yh = Y.permute([2, 0, 1, 3]), Yh.permute([1, 0, 2])
        Yc = Yc.permute([1, 0, 2]) if Yc is not None else None
    return [Y, Yh] + ([Yc] if kind == "LSTM" else [])


def _gru_step(ctx, d, xw, Rd, bd, hp, hn, yd, tmp, lens, reverse, S, H, GH, clip, lbr, f_act, step):
    """z and r (and r * h_prev) in one kernel, the new state in a second."""
    zb, rb_ = tmp
    kb = KB(ctx.k, ctx.n(f"gates{d}"))
    Hb = hp.shape[0]
    b, h = kb.rng(Hb), kb.rng(H)
    st = _Step(kb, S, b, lens, reverse)
    z = f_act[0](_gate(kb, xw, Rd, hp, st, b, h, 0, H, clip))
    r = f_act[0](_gate(kb, xw, Rd, hp, st, b, h, 1, H, clip))
    kb.store(zb, [b, h], z)
    kb.store(rb_, [b, h], r if lbr else r * kb.load(hp, [b, h]))
    kb.run(t=step)
    kb = KB(ctx.k, ctx.n(f"step{d}"))
    b, h = kb.rng(Hb), kb.rng(H)
    st = _Step(kb, S, b, lens, reverse)
    rbh = bd.with_((H,), (bd.strides[0],), bd.offset + (GH + 2 * H) * bd.strides[0]) if bd is not None else None
    if lbr:
        # x Wh + r * (h Rh + Rbh) + Wbh
        j = kb.rng(H, AxisType.REDUCE)
        rec = kb.load(hp, [b, j]) * kb.load(Rd, [as_uop(h) + 2 * H, j])
        rec = rec.reduce(j) if isr(j) else rec
        if rbh is not None:
            rec = rec + kb.load(rbh, [h])
        g = kb.load(xw, [st.xt, b, as_uop(h) + 2 * H]) + kb.load(rb_, [b, h]) * rec
    else:
        # x Wh + (r * h) Rh + Rbh + Wbh
        g = _gate(kb, xw, Rd, rb_, st, b, h, 2, H, clip=None)
        if rbh is not None:
            g = g + kb.load(rbh, [h])
    if clip is not None:
        g = g.maximum(fconst(g, -clip)).minimum(fconst(g, clip))
    hh = f_act[1](g)
    z = kb.load(zb, [b, h])
    hprev = kb.load(hp, [b, h])
    hnew = (fconst(z, 1) - z) * hh + z * hprev
    kb.store(hn, [b, h], st.valid.where(hnew, hprev))
    kb.store(yd, [st.yt, b, h], st.valid.where(hnew, fconst(hnew, 0)))
    kb.run(t=step)


def _state(ctx, init: View | None, d: int, Bt: int, H: int, dt, name: str) -> View:
    """The initial state of direction d in a fresh contiguous buffer (zeros without one)."""
    if init is None:
        return fill(ctx.k, ctx.n(name), [Bt, H], 0.0, dt)
    out = ctx.k.empty([Bt, H], dt)
    _copy_to(ctx, out, _sub(init, d), name)
    return out


def _copy_to(ctx, dst: View, src: View, name: str) -> None:
    kb = KB(ctx.k, ctx.n(name))
    idx = [kb.rng(s) for s in dst.shape]
    kb.store(dst, idx, kb.load(src, idx))
    kb.run()


def _copy_into(ctx, dst: View, d: int, src: View, name: str) -> None:
    _copy_to(ctx, _sub(dst, d), src, name)


@op("RNN")
def _rnn(ctx, ins, a):
    return _recurrent(ctx, ins, a, "RNN")


@op("GRU")
def _gru(ctx, ins, a):
    return _recurrent(ctx, ins, a, "GRU")


@op("LSTM")
def _lstm(ctx, ins, a):
    return _recurrent(ctx, ins, a, "LSTM")
