"""Channels-last (NHWC) convolution kernels: activations stored [N, H, W, C], the channels the contiguous axis.

A channels-last convolution is a contraction whose rows are pixels and whose unit-stride columns are output
channels: the CPU register tile broadcasts a pixel's input channel and multiplies a vector of output channels,
the weights stored as column panels of the tile's width (`kernels.matmul_panels`). A thread's block of pixels
is then the block the next layer reads (benchmarks/cpu_layouts.py), where in NCHW every unit of a narrow layer
reads the channel planes every partition of the last layer wrote. The kernels here:

  - `conv_weights_panels`: w [CO, C, KH, KW] as the panels of B [(kh, kw, c), co] (a weights-only step);
  - `pointwise_nhwc`: a strided 1x1 layer reading its input's pixels in place;
  - `im2col_nhwc`: the [pixels, (kh, kw, c)] left operand of any convolution, from an input of any strides
    (NHWC, or NCHW at a layout's edge), copying runs of contiguous channels;
  - `winograd_input_nhwc`, `winograd_weights_panels`, `winograd_output_nhwc`: Winograd F(2x2, 3x3) whose
    (m + 2)^2 contractions are [tiles, C] x [C, CO] (`kernels.matmul_panels` with a batch of planes), every
    transform vectorized over channels;
  - `global_pool_nhwc`: global pooling of [N, H*W, C].

The executor's choice of form is `codegen/strategies/conv.py`'s `channels_last_plan`. Buffers are params in
slot order, inputs first and the output last, as in `kernels`.
"""
from __future__ import annotations

from .dtypes import as_dtype, dtypes
from .errors import ArgumentError, UnknownNameError
from .ir import AxisType, UOp
from .codegen.strategies.conv import CHANNELS_LAST_FORMS, ConvGeometry
from .kernels import (Epilogue, KernelStep, _Axes, _out_size, _sandwich, _winograd, matmul_panels, pool_reduce,
                      split_rows_sum, winograd_plane_pad)

__all__ = ["nhwc_strides", "conv2d_nhwc_kernels", "conv_weights_panels", "pointwise_nhwc", "im2col_nhwc",
           "winograd_input_nhwc", "winograd_weights_panels", "winograd_output_nhwc", "global_pool_nhwc",
           "winograd_plane_pad", "pad_nhwc", "taps_nhwc"]


def nhwc_strides(N: int, C: int, H: int, W: int) -> tuple[int, int, int, int]:
    """The (n, c, h, w) element strides of an [N, C, H, W] tensor stored channels-last."""
    return (H * W * C, 1, W * C, C)


def conv_weights_panels(CO: int, C: int, KH: int, KW: int, width: int, dtype=dtypes.float32) -> UOp:
    """panels[p, (kh * KW + kw) * C + c, j] = w[p * width + j, c, kh, kw]: a convolution's weights as the column
    panels (`kernels.column_panels`) of B [(kh, kw, c), co], the right-hand operand of a channels-last
    contraction over `im2col_nhwc`'s columns (for a 1x1 layer, over the input itself). Params: w, panels."""
    if width < 1 or CO % width:
        raise ArgumentError(f"conv_weights_panels: a width of {width} does not divide {CO} output channels")
    dt = as_dtype(dtype)
    ax = _Axes()
    K = KH * KW * C
    p, t, c, j = ax(CO // width), ax(KH * KW), ax(C), ax(width)
    w, out = UOp.param(0, dt), UOp.param(1, dt)
    co = p * width + j
    return UOp.sink(out.store((p * K + t * C + c) * width + j, w.load((co * C + c) * (KH * KW) + t)))


def im2col_nhwc(N: int, C: int, H: int, W: int, KH: int, KW: int, stride: tuple[int, int] = (1, 1),
                dilation: tuple[int, int] = (1, 1), pads: tuple[int, int, int, int] = (0, 0, 0, 0),
                in_strides: tuple[int, int, int, int] | None = None, dtype=dtypes.float32) -> UOp:
    """col[(n, oh, ow), (kh * KW + kw) * C + c] = x[n, c, oh*sh + kh*dh - top, ow*sw + kw*dw - left], zero in the
    padding: the left operand [N*OH*OW, KH*KW*C] of a channels-last contraction. x is read through
    `in_strides` (its (n, c, h, w) element strides; default channels-last), so the same kernel copies a
    channels-last input's runs of channels or turns an NCHW input around at a layout's edge. The (image,
    output row) pairs are the outermost range (the CPU's thread split), the channels the innermost.
    Params: x, col."""
    dt = as_dtype(dtype)
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = stride, dilation, pads
    OH, OW = _out_size(H, KH, sh, dh, pt, pb), _out_size(W, KW, sw, dw, pl, pr)
    if OH < 1 or OW < 1:
        raise ArgumentError(f"im2col_nhwc: a {KH}x{KW} window leaves no output of a {H}x{W} input")
    sn, sc, shh, sww = in_strides if in_strides is not None else nhwc_strides(N, C, H, W)
    ax = _Axes()
    q, ow, kh, kw, c = ax(N * OH), ax(OW), ax(KH), ax(KW), ax(C)
    n, oh = (q // OH, q % OH) if N > 1 else (UOp.const(0, dtypes.index), q)
    y, xx = oh * sh + kh * dh - pt, ow * sw + kw * dw - pl
    ok = None
    if pt > 0 or (OH - 1) * sh + (KH - 1) * dh - pt >= H:
        ok = (y >= 0) & (y < H)
        y = y.clamp(0, H - 1)
    if pl > 0 or (OW - 1) * sw + (KW - 1) * dw - pl >= W:
        okx = (xx >= 0) & (xx < W)
        ok = okx if ok is None else ok & okx
        xx = xx.clamp(0, W - 1)
    x, col = UOp.param(0, dt), UOp.param(1, dt)
    v = x.load(n * sn + c * sc + y * shh + xx * sww)
    if ok is not None:
        v = ok.where(v, UOp.const(0, dt))
    K = KH * KW * C
    return UOp.sink(col.store((q * OW + ow) * K + (kh * KW + kw) * C + c, v))


def pad_nhwc(N: int, C: int, H: int, W: int, pads: tuple[int, int, int, int],
             in_strides: tuple[int, int, int, int] | None = None, dtype=dtypes.float32) -> UOp:
    """xp[n, y, x, c] = x[n, c, y - top, x - left], zero outside x: a channels-last copy of x with its
    padding, [N, H + top + bottom, W + left + right, C], x read through `in_strides` (its (n, c, h, w)
    element strides; default channels-last). The (image, row) pairs are the outermost range, the channels
    the innermost. Params: x, xp."""
    dt = as_dtype(dtype)
    pt, pl, pb, pr = pads
    HP, WP = H + pt + pb, W + pl + pr
    sn, sc, shh, sww = in_strides if in_strides is not None else nhwc_strides(N, C, H, W)
    ax = _Axes()
    q, xx, c = ax(N * HP), ax(WP), ax(C)
    n, y = (q // HP, q % HP) if N > 1 else (UOp.const(0, dtypes.index), q)
    yi, xi = y - pt, xx - pl
    ok = (yi >= 0) & (yi < H) & (xi >= 0) & (xi < W)
    v = UOp.param(0, dt).load(n * sn + c * sc + yi.clamp(0, H - 1) * shh + xi.clamp(0, W - 1) * sww)
    return UOp.sink(UOp.param(1, dt).store((q * WP + xx) * C + c, ok.where(v, UOp.const(0, dt))))


def taps_nhwc(N: int, C: int, HP: int, WP: int, KH: int, KW: int, CO: int, stride: tuple[int, int],
              dilation: tuple[int, int], width: int, dtype=dtypes.float32, runs: int = 0) -> UOp:
    """part[t, (n, oy, ox), co] = sum over c of xp[n, oy * sh + kh * dh, ox * sw + kw * dw, c] *
    panels[co // width, t * C + c, co % width], t = kh * KW + kw: each tap's contraction over a padded
    channels-last input ([N, HP, WP, C], `pad_nhwc`) read in place (the row's address computed once per row of
    a register tile, as `pointwise_nhwc`'s), the weights as `conv_weights_panels` lays them out. The taps are
    the outermost range: each thread-split unit one tap of one column panel. `runs` KH (a horizontal dilation
    of 1): a kernel row's taps are one run, part[kh, ...] the sum over (kw, c), KW * C neighbouring input
    elements; 0 or KH * KW: a run a tap. `kernels.split_rows_sum` adds the runs. Params: xp, panels, part."""
    if width < 1 or CO % width:
        raise ArgumentError(f"taps_nhwc: a width of {width} does not divide {CO} output channels")
    dt = as_dtype(dtype)
    (sh, sw), (dh, dw) = stride, dilation
    OH, OW = _out_size(HP, KH, sh, dh, 0, 0), _out_size(WP, KW, sw, dw, 0, 0)
    if OH < 1 or OW < 1:
        raise ArgumentError(f"taps_nhwc: a {KH}x{KW} window leaves no output of a {HP}x{WP} input")
    T = runs or KH * KW
    if T not in (KH * KW, KH) or (T != KH * KW and dilation[1] != 1):
        raise ArgumentError(f"taps_nhwc: {T} runs of a {KH}x{KW} kernel (a tap each, or a kernel row each where the "
                            f"row's taps are neighbours)")
    run = KH * KW * C // T
    ax = _Axes()
    t, p, i, c = ax(T), ax(CO // width), ax(N * OH * OW), ax(width)
    k = ax(run, AxisType.REDUCE)
    n, oy, ox = i // (OH * OW), (i // OW) % OH, i % OW
    kh, kw = (t, 0) if T == KH and KW > 1 else (t // KW, t % KW)
    a, b = UOp.param(0, dt), UOp.param(1, dt)
    at = ((n * HP + oy * sh + kh * dh) * WP + ox * sw + kw * dw) * C + k
    acc = (a.load(at) * b.load((p * (KH * KW * C) + t * run + k) * width + c)).reduce(k)
    return UOp.sink(UOp.param(2, dt).store((t * (N * OH * OW) + i) * CO + p * width + c, acc))


def winograd_weights_panels(CO: int, C: int, m: int, width: int, dtype=dtypes.float32) -> UOp:
    """u[s, p, c, j] = (G g G^T)[s // (m + 2), s % (m + 2)] for the 3x3 filter g = w[p * width + j, c]: the
    weights of the channels-last Winograd contractions, each plane s as the column panels of its [C, CO]
    matrix. Params: w [CO, C, 3, 3], u."""
    if width < 1 or CO % width:
        raise ArgumentError(f"winograd_weights_panels: a width of {width} does not divide {CO} output channels")
    dt = as_dtype(dtype)
    _, G, _ = _winograd(m)
    a = m + 2
    ax = _Axes()
    p, c, j = ax(CO // width), ax(C), ax(width)
    co = p * width + j
    w = UOp.param(0, dt)
    g = [[w.load((co * C + c) * 9 + k * 3 + l) for l in range(3)] for k in range(3)]
    u = _sandwich(G, g, G, dt)
    out = UOp.param(1, dt)
    P = CO // width
    return UOp.sink(*[out.store((((i * a + j2) * P + p) * C + c) * width + j, u[i][j2])
                      for i in range(a) for j2 in range(a)])


def winograd_nhwc_tiles(N: int, OH: int, OW: int, m: int) -> int:
    """The output tiles of the channels-last Winograd form: m must divide both sides."""
    if OH % m or OW % m:
        raise ArgumentError(f"channels-last Winograd takes whole {m}x{m} tiles; the output is {OH}x{OW}")
    return N * (OH // m) * (OW // m)


def winograd_input_nhwc(N: int, C: int, H: int, W: int, pads: tuple[int, int, int, int], m: int,
                        plane_pad: int = 0, dtype=dtypes.float32) -> UOp:
    """v[s, t, c] = (B^T d B)[s // (m + 2), s % (m + 2)], d the (m + 2) x (m + 2) patch of channel c of a
    channels-last input under output tile t = (n, tile row, tile column), zero in the padding: plane s, at
    s * (T * C + plane_pad), is the [T, C] left operand of Winograd contraction s. The (image, tile row) pairs
    are the outermost range, the channels the innermost (each tap a vector load of neighbouring channels).
    Params: x, v."""
    dt = as_dtype(dtype)
    BT, _, _ = _winograd(m)
    a = m + 2
    pt, pl, pb, pr = pads
    OH, OW = H + pt + pb - 2, W + pl + pr - 2
    T = winograd_nhwc_tiles(N, OH, OW, m)
    TH, TW = OH // m, OW // m
    ax = _Axes()
    q, tx, c = ax(N * TH), ax(TW), ax(C)
    n, ty = (q // TH, q % TH) if N > 1 else (UOp.const(0, dtypes.index), q)
    x, out = UOp.param(0, dt), UOp.param(1, dt)
    d = []
    for k in range(a):
        row = []
        for l in range(a):
            y, xx = ty * m + k - pt, tx * m + l - pl
            ok = None
            if k - pt < 0 or (TH - 1) * m + k - pt >= H:
                ok = (y >= 0) & (y < H)
                y = y.clamp(0, H - 1)
            if l - pl < 0 or (TW - 1) * m + l - pl >= W:
                okx = (xx >= 0) & (xx < W)
                ok = okx if ok is None else ok & okx
                xx = xx.clamp(0, W - 1)
            v = x.load(((n * H + y) * W + xx) * C + c)
            row.append(v if ok is None else ok.where(v, UOp.const(0, dt)))
        d.append(row)
    v = _sandwich(BT, d, BT, dt)
    t = q * TW + tx
    return UOp.sink(*[out.store((i * a + j) * (T * C + plane_pad) + t * C + c, v[i][j])
                      for i in range(a) for j in range(a)])


def winograd_output_nhwc(N: int, CO: int, OH: int, OW: int, m: int, dtype=dtypes.float32,
                         epilogue: Epilogue | None = None, plane_pad: int = 0) -> UOp:
    """out[n, ty * m + i, tx * m + j, co] = (A^T M A)[i, j], M the (m + 2) x (m + 2) products of output tile
    t = (n, ty, tx) and channel co (mm[s, t, co], plane s at s * (T * CO + plane_pad)), then `epilogue` (bias
    per channel, tensor operands channels-last like the output). Params: mm, the epilogue's operands, out."""
    dt = as_dtype(dtype)
    _, _, AT = _winograd(m)
    a = m + 2
    T = winograd_nhwc_tiles(N, OH, OW, m)
    TH, TW = OH // m, OW // m
    epi = epilogue or Epilogue()
    ax = _Axes()
    q, tx, co = ax(N * TH), ax(TW), ax(CO)
    t = q * TW + tx
    mm = UOp.param(0, dt)
    M = [[mm.load((i * a + j) * (T * CO + plane_pad) + t * CO + co) for j in range(a)] for i in range(a)]
    y = _sandwich(AT, M, AT, dt)
    stores, nxt = [], 1
    for i in range(m):
        for j in range(m):
            # (n * TH + ty) * m + i is n * OH + ty * m + i: the output row of image n
            at = ((q * m + i) * OW + tx * m + j) * CO + co
            v, nxt = epi.apply(y[i][j], 1, dt, co, at)
            stores.append((at, v))
    out = UOp.param(nxt, dt)
    return UOp.sink(*[out.store(at, v) for at, v in stores])


def global_pool_nhwc(kind: str, N: int, P: int, C: int, dtype=dtypes.float32) -> UOp:
    """out[n, c] = mean or max ("avg", "max") of x[n, 0:P, c]: global pooling of a channels-last [N, P, C]
    input (P = H * W), the channels vectorized. Params: x, out."""
    dt = as_dtype(dtype)
    if kind not in ("max", "avg"):
        raise UnknownNameError(f"unknown pooling {kind!r}; known: max, avg")
    ax = _Axes()
    n, c = ax(N), ax(C)
    k = ax(P, AxisType.REDUCE)
    x, out = UOp.param(0, dt), UOp.param(1, dt)
    return UOp.sink(out.store(n * C + c, pool_reduce(kind, x.load((n * P + k) * C + c), k, P, dt)))


NHWC_WINOGRAD_TILE = 2      # F(2x2, 3x3), the CPU's NCHW tile (codegen/strategies/conv.py, CPU_WINOGRAD_TILE)


def conv2d_nhwc_kernels(geo: ConvGeometry, form: str, width: int, dtype=dtypes.float32,
                        epilogue: Epilogue | None = None,
                        in_strides: tuple[int, int, int, int] | None = None, runs: int = 1) -> list[KernelStep]:
    """The kernels of a one-group 2-D convolution whose output is stored channels-last ([N, OH, OW, CO]), in
    `form` (codegen/strategies/conv.py's CHANNELS_LAST_FORMS; `channels_last_plan` chooses), the register
    tile `width` columns wide (it divides CO). The input is read through `in_strides` (default
    channels-last; "pointwise" and "winograd" take only that). `epilogue`'s tensor operands are channels-last
    like the output. Steps as `kernels.conv2d_kernels`'s: a weights-only step first (the weights as column
    panels, or Winograd's transformed panels). `runs` > 1 (`channels_last_runs`; the columns form and the stride-1
    pointwise one): the contraction's reduction cut into that many runs, added by a last step with the epilogue;
    the taps form's partial sums (`taps_nhwc`: KH, one a kernel row, or 1 or KH * KW, one a tap)."""
    g = geo
    if form not in CHANNELS_LAST_FORMS:
        raise UnknownNameError(f"unknown channels-last form {form!r}; known: {', '.join(CHANNELS_LAST_FORMS)}")
    if g.groups != 1:
        raise ArgumentError(f"channels-last convolution of one group, got {g.groups}")
    dt = as_dtype(dtype)
    epi = epilogue or Epilogue()
    nhwc = nhwc_strides(g.N, g.C, g.H, g.W)
    strides = tuple(in_strides) if in_strides is not None else nhwc
    if form == "pointwise" and ((g.KH, g.KW) != (1, 1) or any(g.pads)):
        raise ArgumentError(f"channels-last pointwise is for unpadded 1x1 layers, not {g}")
    if form in ("pointwise", "winograd") and strides != nhwc:
        raise ArgumentError(f"channels-last {form} reads a channels-last input; strides {strides} are not {nhwc}")
    P, out_n = g.N * g.OH * g.OW, g.N * g.CO * g.OH * g.OW
    if form == "winograd":
        if (g.KH, g.KW) != (3, 3) or g.stride != (1, 1) or g.dilation != (1, 1):
            raise ArgumentError(f"channels-last Winograd is for stride-1 3x3 layers, not {g}")
        m = NHWC_WINOGRAD_TILE
        a2 = (m + 2) ** 2
        T = winograd_nhwc_tiles(g.N, g.OH, g.OW, m)
        pin, pout = winograd_plane_pad(T * g.C), winograd_plane_pad(T * g.CO)
        return [KernelStep("weights", winograd_weights_panels(g.CO, g.C, m, width, dt), ("w",), "wt", a2 * g.CO * g.C),
                KernelStep("input", winograd_input_nhwc(g.N, g.C, g.H, g.W, g.pads, m, pin, dt), ("x",), "col",
                           a2 * (T * g.C + pin)),
                KernelStep("gemm", matmul_panels(T, g.CO, g.C, width, dt, batch=a2, plane_pads=(pin, pout)),
                           ("col", "wt"), "prod", a2 * (T * g.CO + pout)),
                KernelStep("output", winograd_output_nhwc(g.N, g.CO, g.OH, g.OW, m, dt, epi, pout),
                           ("prod", "epilogue"), "out", out_n)]
    K = g.C * g.KH * g.KW
    steps = [KernelStep("weights", conv_weights_panels(g.CO, g.C, g.KH, g.KW, width, dt), ("w",), "wt", g.CO * K)]
    if form == "taps":
        T = runs if runs > 1 else g.KH * g.KW
        HP, WP = g.H + g.pads[0] + g.pads[2], g.W + g.pads[1] + g.pads[3]
        pad = KernelStep("pad", pad_nhwc(g.N, g.C, g.H, g.W, g.pads, strides, dt), ("x",), "pad", g.N * HP * WP * g.C)
        gemm = taps_nhwc(g.N, g.C, HP, WP, g.KH, g.KW, g.CO, g.stride, g.dilation, width, dt, T)
        return steps + [pad] + _runs_added(gemm, "pad", T, P, g.CO, dt, epi)
    src = "x"
    if form == "im2col":
        steps.append(KernelStep("im2col", im2col_nhwc(g.N, g.C, g.H, g.W, g.KH, g.KW, g.stride, g.dilation, g.pads,
                                                      strides, dt), ("x",), "col", P * K))
        src = "col"
    if runs > 1:
        if form == "pointwise" and g.stride != (1, 1):
            raise ArgumentError(f"channels-last: a strided pointwise layer's contraction is one run, not {runs}")
        return steps + _runs_added(matmul_panels(P, g.CO, K, width, dt, splits=runs), src, runs, P, g.CO, dt, epi)
    if form == "pointwise" and g.stride != (1, 1):
        gemm = pointwise_nhwc(g.N, g.C, g.H, g.W, g.CO, g.stride, width, dt, epi)
    else:
        gemm = matmul_panels(P, g.CO, K, width, dt, epi)
    return steps + [KernelStep("gemm", gemm, (src, "wt", "epilogue"), "out", out_n)]


def _runs_added(gemm: UOp, src: str, runs: int, P: int, CO: int, dt, epi: Epilogue) -> list[KernelStep]:
    """A contraction of `src` and the weight panels into `runs` partial sums [runs, P, CO] ("part"), then their
    sum with the epilogue into the output (`kernels.split_rows_sum`)."""
    return [KernelStep("gemm", gemm, (src, "wt"), "part", runs * P * CO),
            KernelStep("sum", split_rows_sum(P, CO, runs, dt, epi), ("part", "epilogue"), "out", P * CO)]


def pointwise_nhwc(N: int, C: int, H: int, W: int, CO: int, stride: tuple[int, int], width: int,
                   dtype=dtypes.float32, epilogue: Epilogue | None = None) -> UOp:
    """out[(n, oy, ox), co] = sum over c of x[n, oy * sh, ox * sw, c] * panels[co // width, c, co % width], then
    `epilogue`: an unpadded strided 1x1 convolution over a channels-last input read in place (`kernels.matmul_panels`
    whose row i is output pixel i's input pixel: its address is computed once per row of a register tile, outside
    the reduction), the weights as `conv_weights_panels` lays them out. Params: x, panels, the epilogue's
    operands, out."""
    if width < 1 or CO % width:
        raise ArgumentError(f"pointwise_nhwc: a width of {width} does not divide {CO} output channels")
    dt = as_dtype(dtype)
    sh, sw = stride
    OH, OW = _out_size(H, 1, sh, 1, 0, 0), _out_size(W, 1, sw, 1, 0, 0)
    epi = epilogue or Epilogue()
    a, b = UOp.param(0, dt), UOp.param(1, dt)
    ax = _Axes()
    p, i, c = ax(CO // width), ax(N * OH * OW), ax(width)
    k = ax(C, AxisType.REDUCE)
    n, oy, ox = i // (OH * OW), (i // OW) % OH, i % OW
    acc = (a.load(((n * H + oy * sh) * W + ox * sw) * C + k) * b.load((p * C + k) * width + c)).reduce(k)
    col = p * width + c
    at = i * CO + col
    v, nxt = epi.apply(acc, 2, dt, col, at)
    return UOp.sink(UOp.param(nxt, dt).store(at, v))
