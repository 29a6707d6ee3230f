"""Quantization: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear and the integer contractions
(MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv).

The contractions load int8/uint8 operands as they are stored and accumulate in int32 inside the kernel;
QLinear* requantize the int32 sum in the same kernel's epilogue (in float64, as the ONNX reference does).
"""
from __future__ import annotations

from typing import Callable, Sequence

from morok_py import AxisType, Ops, UOp, dtypes
from morok_py.dtypes import DType

from morok_py.onnx.errors import OnnxError
from morok_py.onnx.tensor import KB, View, contiguous_strides
from morok_py.onnx.ops.common import ONNX_DT, HALF, as_uop, isr, keep_const
from morok_py.onnx.ops.linalg import matmul_operands
from morok_py.onnx.ops.nn import _pool_geometry, _window
from morok_py.onnx.ops.reduce import reduce, reduce_min
from morok_py.onnx.ops.registry import op

# integer ranges of the quantized integer types
INT_RANGE: dict[DType, tuple[int, int]] = {
    dtypes.uint8: (0, 255), dtypes.int8: (-128, 127), dtypes.uint16: (0, 65535), dtypes.int16: (-32768, 32767),
    dtypes.uint4: (0, 15), dtypes.int4: (-8, 7), dtypes.uint2: (0, 3), dtypes.int2: (-2, 1)}


def _f32(x: UOp) -> UOp:
    return x if x.dtype == dtypes.float32 else x.cast(dtypes.float32)


def _i32(x: UOp) -> UOp:
    return x if x.dtype == dtypes.int32 else x.cast(dtypes.int32)


def qparam(kb: KB, v: View, idx: Sequence, axis: int, block: int = 0) -> UOp:
    """Load a scale or zero point for element `idx` of the quantized tensor: per tensor (one element),
    per axis (a vector along `axis`) or blocked (the tensor's rank, `block` elements per entry on `axis`)."""
    if v.size == 1:
        return kb.load(v, [0] * v.ndim)
    if block:
        src = list(idx)
        src[axis] = as_uop(idx[axis]) // block
        return kb.load(v, src)
    if v.ndim != 1:
        raise OnnxError(f"a per-axis scale or zero point is a vector, not shape {v.shape}")
    return kb.load(v, [idx[axis]])


def _divide(x: UOp, s: UOp, dt: DType | None) -> UOp:
    """x / scale in float32, rounded once to `dt` where that is a half type (numpy's float16 division)."""
    q = _f32(x) / _f32(s)
    return q.cast(dt).cast(dtypes.float32) if dt in HALF else q


def quantize(q: UOp, zp: UOp | None, out: DType, saturate: bool) -> UOp:
    """The quantized value of q = x / scale: round half to even, add the zero point, clamp (integers);
    a saturating or plain conversion (float8); add the zero point and convert (float4)."""
    if out in INT_RANGE:
        lo, hi = INT_RANGE[out]
        # rounded and clamped in float32 (exact below 2**24, and anything above clamps), so no float ->
        # int conversion ever sees a value outside the target's range
        v = q.round()
        if zp is not None:
            v = v + _f32(zp)
        return v.clamp(float(lo), float(hi)).cast(out)
    if out == dtypes.float4_e2m1fn:
        if zp is not None:
            q = q + _f32(zp)
        return q.cast(out)
    if out.is_float and out.storage_only:
        return q.cast(out, saturate=saturate)
    raise OnnxError(f"QuantizeLinear to {out} is not a quantized type")


def _block(a) -> int:
    return int(a.get("block_size", 0) or 0)


@op("QuantizeLinear")
def _quantize_linear(ctx, ins, a):
    x, scale = ins[0], ins[1]
    zp = ins[2] if len(ins) > 2 and ins[2] is not None else None
    axis = a.get("axis", 1) % max(x.ndim, 1)
    block = _block(a)
    out_dt = zp.dtype if zp is not None else ONNX_DT[a["output_dtype"]] if a.get("output_dtype") else dtypes.uint8
    prec = ONNX_DT[a["precision"]] if a.get("precision") else None
    # numpy divides in the promoted type: float16 / float16 stays float16
    div_dt = prec or (x.dtype if x.dtype == scale.dtype else None)
    out = ctx.k.empty(x.shape, out_dt)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    idx = [kb.rng(s) for s in x.shape]
    q = _divide(kb.load(x, idx), qparam(kb, scale, idx, axis, block), div_dt)
    z = qparam(kb, zp, idx, axis, block) if zp is not None and not (out_dt.is_float and out_dt != dtypes.float4_e2m1fn) \
        else None
    kb.store(out, idx, quantize(q, z, out_dt, bool(a.get("saturate", 1))))
    kb.run()
    return [keep_const(out, ins)]


@op("DequantizeLinear")
def _dequantize_linear(ctx, ins, a):
    x, scale = ins[0], ins[1]
    zp = ins[2] if len(ins) > 2 and ins[2] is not None else None
    if x.dtype.is_float:        # float8 / float4: the zero point is zero by definition
        zp = None
    axis = a.get("axis", 1) % max(x.ndim, 1)
    block = _block(a)
    out_dt = ONNX_DT[a["output_dtype"]] if a.get("output_dtype") else scale.dtype
    out = ctx.k.empty(x.shape, out_dt)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    idx = [kb.rng(s) for s in x.shape]
    v = _f32(kb.load(x, idx))
    if zp is not None:
        v = v - _f32(qparam(kb, zp, idx, axis, block))
    kb.store(out, idx, (v * _f32(qparam(kb, scale, idx, axis, block))).cast(out_dt))
    kb.run()
    return [keep_const(out, ins)]


@op("DynamicQuantizeLinear")
def _dynamic_quantize_linear(ctx, ins, a):
    """uint8 quantization with the scale and zero point taken from x's range (widened to include 0):
    two reductions, one kernel for the scalars and one for the quantized tensor."""
    x = ins[0]
    axes = list(range(x.ndim))
    hi = reduce(ctx, x, axes, Ops.MAX, suffix="max", keepdims=False)
    lo = reduce_min(ctx, x, axes, suffix="min", keepdims=False)
    scale, zp = ctx.k.empty((), x.dtype), ctx.k.empty((), dtypes.uint8)
    kb = KB(ctx.k, ctx.n("params"))
    mx = _f32(kb.load(hi, [])).maximum(0.0)
    mn = _f32(kb.load(lo, [])).minimum(0.0)
    s = (mx == mn).where(UOp.const(1.0, dtypes.float32), mx - mn) / UOp.const(255.0, dtypes.float32)
    z = (UOp.const(0.0, dtypes.float32) - mn / s).clamp(0.0, 255.0).round()
    kb.store(scale, [], s.cast(x.dtype))
    kb.store(zp, [], z.cast(dtypes.uint8))
    kb.run()
    y = ctx.k.empty(x.shape, dtypes.uint8)
    if y.size:
        kb = KB(ctx.k, ctx.n("quantize"))
        idx = [kb.rng(d) for d in x.shape]
        q = _f32(kb.load(x, idx)) / _f32(kb.load(scale, []))
        kb.store(y, idx, quantize(q, kb.load(zp, []), dtypes.uint8, True))
        kb.run()
    return [keep_const(y, ins), keep_const(scale, ins), keep_const(zp, ins)]


# ---- integer contractions ---------------------------------------------------------------------------
Epilogue = Callable[[UOp, KB, list, list], UOp]


def _shifted(kb: KB, v: View, idx: Sequence, zp: UOp | None) -> UOp:
    """An int8/uint8 operand loaded as stored, widened to int32, its zero point subtracted."""
    x = _i32(kb.load(v, idx))
    return x if zp is None else x - _i32(zp)


def int_matmul(ctx, A: View, B: View, azp: View | None, bzp: View | None, out_dt: DType,
               epilogue: Epilogue | None = None) -> View:
    """(A - a_zp) @ (B - b_zp) with int32 accumulation, numpy batching; a_zp per tensor or per row of A,
    b_zp per tensor or per column of B. epilogue(acc, kb, rows, cols) maps the int32 sum to the output."""
    A, B, a1, b1, batch = matmul_operands(A, B)
    M, K, N = A.shape[-2], A.shape[-1], B.shape[-1]
    oshape = list(batch) + [M, N]
    out = ctx.k.empty(oshape, out_dt)
    if out.size:
        kb = KB(ctx.k, ctx.n())
        bidx = [kb.rng(s) for s in batch]
        i, j = kb.rng(M), kb.rng(N)
        k = kb.rng(K, AxisType.REDUCE)
        if K == 0:
            acc = UOp.const(0, dtypes.int32)
        else:
            za = None if azp is None else qparam(kb, azp, [i], 0)
            zb = None if bzp is None else qparam(kb, bzp, [j], 0)
            acc = _shifted(kb, A, bidx + [i, k], za) * _shifted(kb, B, bidx + [k, j], zb)
            acc = acc.reduce(k) if isr(k) else acc
        if epilogue is not None:
            acc = epilogue(acc, kb, [i], [j])
        kb.store(out, bidx + [i, j], acc)
        kb.run()
    shape = list(batch) + ([] if a1 else [M]) + ([] if b1 else [N])
    return keep_const(out.with_(shape, contiguous_strides(shape)), [A, B])


def int_conv(ctx, x: View, w: View, xzp: View | None, wzp: View | None, bias: View | None, a, out_dt: DType,
             epilogue: Epilogue | None = None) -> View:
    """N-d grouped convolution of (x - x_zp) with (w - w_zp), int32 accumulation; padding reads as zero
    after the shift; w_zp per tensor or per output channel. epilogue(acc, kb, [co], []) as in int_matmul."""
    kshape = list(a.get("kernel_shape", w.shape[2:]))
    outs, strides, dil, pads = _pool_geometry(a, list(x.shape[2:]), kshape)
    G = a.get("group", 1)
    N = x.shape[0]
    CO, CI = w.shape[0], w.shape[1]
    COg = CO // G
    out = ctx.k.empty([N, CO] + outs, out_dt)
    if out.size == 0:
        return out
    kb = KB(ctx.k, ctx.n())
    n, co = kb.rng(N), kb.rng(CO)
    sp = [kb.rng(o) for o in outs]
    ci = kb.rng(CI, AxisType.REDUCE)
    kk = [kb.rng(s, AxisType.REDUCE) for s in kshape]
    cin = as_uop(co) // COg * CI + as_uop(ci) if G > 1 else ci
    coords, valid = _window(kb, x, sp, kk, strides, dil, pads)
    xv = _shifted(kb, x, [n, cin] + coords, None if xzp is None else kb.load(xzp, [0] * xzp.ndim))
    xv = valid.where(xv, UOp.const(0, dtypes.int32))
    wv = _shifted(kb, w, [co, ci] + kk, None if wzp is None else qparam(kb, wzp, [co], 0))
    v = xv * wv
    rr = [r for r in [ci] + kk if isr(r)]
    if rr:
        v = v.reduce(*rr)
    if bias is not None:
        v = v + _i32(kb.load(bias, [co]))
    if epilogue is not None:
        v = epilogue(v, kb, [co], [])
    kb.store(out, [n, co] + sp, v)
    kb.run()
    return out


@op("MatMulInteger")
def _matmul_integer(ctx, ins, a):
    A, B = ins[0], ins[1]
    azp = ins[2] if len(ins) > 2 else None
    bzp = ins[3] if len(ins) > 3 else None
    return [int_matmul(ctx, A, B, azp, bzp, dtypes.int32)]


@op("ConvInteger")
def _conv_integer(ctx, ins, a):
    x, w = ins[0], ins[1]
    xzp = ins[2] if len(ins) > 2 else None
    wzp = ins[3] if len(ins) > 3 else None
    return [keep_const(int_conv(ctx, x, w, xzp, wzp, None, a, dtypes.int32), ins)]


def _scale_mul(p: UOp, q: UOp, dt: DType) -> UOp:
    """p * q in the scales' own dtype (float32 compute, rounded to a half type after the op)."""
    r = _f32(p) * _f32(q)
    return r.cast(dt).cast(dtypes.float32) if dt in HALF else r


def _scale_div(p: UOp, q: UOp, dt: DType) -> UOp:
    r = _f32(p) / _f32(q)
    return r.cast(dt).cast(dtypes.float32) if dt in HALF else r


def requantize(kb: KB, acc: UOp, multiplier: UOp, yzp: View | None, out: DType) -> UOp:
    """round(int32 sum * multiplier + y_zp), clamped to the output type, in float64 as numpy promotes."""
    v = acc.cast(dtypes.float64) * multiplier.cast(dtypes.float64)
    if yzp is not None:
        v = v + kb.load(yzp, [0] * yzp.ndim).cast(dtypes.float64)
    lo, hi = INT_RANGE[out]
    return v.clamp(float(lo), float(hi)).round().cast(out)


@op("QLinearMatMul")
def _qlinear_matmul(ctx, ins, a):
    A, a_s, a_zp, B, b_s, b_zp, y_s = ins[:7]
    y_zp = ins[7] if len(ins) > 7 else None
    out_dt = y_zp.dtype if y_zp is not None else A.dtype

    def epi(acc, kb, rows, cols):
        m = _scale_mul(qparam(kb, a_s, rows, 0), qparam(kb, b_s, cols, 0), a_s.dtype)
        m = _scale_div(m, kb.load(y_s, [0] * y_s.ndim), a_s.dtype)
        return requantize(kb, acc, m, y_zp, out_dt)
    return [int_matmul(ctx, A, B, a_zp, b_zp, out_dt, epi)]


@op("QLinearConv")
def _qlinear_conv(ctx, ins, a):
    x, x_s, x_zp, w, w_s, w_zp, y_s = ins[:7]
    y_zp = ins[7] if len(ins) > 7 else None
    bias = ins[8] if len(ins) > 8 else None
    out_dt = y_zp.dtype if y_zp is not None else x.dtype

    def epi(acc, kb, co, _):
        m = _scale_mul(kb.load(x_s, [0] * x_s.ndim), qparam(kb, w_s, co, 0), x_s.dtype)
        m = _scale_div(m, kb.load(y_s, [0] * y_s.ndim), x_s.dtype)
        return requantize(kb, acc, m, y_zp, out_dt)
    return [keep_const(int_conv(ctx, x, w, x_zp, w_zp, bias, a, out_dt, epi), ins)]
