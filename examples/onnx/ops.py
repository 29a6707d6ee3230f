"""The ONNX ops: each takes (ctx, inputs, attrs) and returns its outputs as Views.

Elementwise ops are one kernel; shape-only ops (Reshape, Flatten, Squeeze, Unsqueeze, Identity,
Shape, Size, Dropout, Transpose, Slice, Expand, Split) are views without a kernel where the strides
allow; everything else is a handful of kernels built with tensor.KB.
"""
from __future__ import annotations

import math
import string
from typing import Callable, Sequence

import numpy as np
from onnx import numpy_helper

from morok_py import AxisType, Ops, UOp, dtypes
from morok_py.dtypes import DType, from_numpy

from tensor import KB, View, bcast_shape, contiguous_strides, copy, elementwise, fill, iconst, prod

# ONNX element type -> morok_py dtype
ONNX_DT: dict[int, DType] = {1: dtypes.float32, 2: dtypes.uint8, 3: dtypes.int8, 4: dtypes.uint16, 5: dtypes.int16,
                             6: dtypes.int32, 7: dtypes.int64, 9: dtypes.bool, 10: dtypes.float16,
                             11: dtypes.float64, 12: dtypes.uint32, 13: dtypes.uint64, 16: dtypes.bfloat16,
                             17: dtypes.float8_e4m3fn, 18: dtypes.float8_e4m3fnuz, 19: dtypes.float8_e5m2,
                             20: dtypes.float8_e5m2fnuz, 21: dtypes.uint4, 22: dtypes.int4, 23: dtypes.float4_e2m1fn,
                             24: dtypes.float8_e8m0fnu, 25: dtypes.uint2, 26: dtypes.int2}
HAS_MIN_REDUCE = Ops.MIN in __import__("morok_py.ir", fromlist=["REDUCE_OPS"]).REDUCE_OPS


class Ctx:
    def __init__(self, ex, name: str, node, opset: int) -> None:
        self.ex, self.k, self.name, self.node, self.opset = ex, ex.k, name, node, opset

    def n(self, suffix: str = "") -> str:
        return self.name + (":" + suffix if suffix else "")

    def host(self, v: View) -> np.ndarray:
        return self.ex.host(v)

    def ints(self, v: View | None) -> list[int] | None:
        return None if v is None else [int(x) for x in np.asarray(self.host(v)).reshape(-1)]

    def scalar(self, v: View):
        return np.asarray(self.host(v)).reshape(-1)[0]

    def const_view(self, arr: np.ndarray) -> View:
        return self.k.from_numpy(np.asarray(arr), const=True)


def method(x: UOp, name: str, *args) -> UOp:
    """A UOp method another engineer is adding (tanh, erf, ...): a clear error until it lands."""
    fn = getattr(x, name, None)
    if fn is None:
        raise NotImplementedError(f"UOp.{name}() is not in this morok_py yet")
    return fn(*args)


def isr(r) -> bool:
    """A real range (KB.rng makes extent-1 ranges the constant 0)."""
    return isinstance(r, UOp) and r.op is Ops.RANGE


def fconst(x: UOp, v: float) -> UOp:
    return UOp.const(float(v), x.dtype)


def _keep_const(out: View, ins: Sequence[View | None]) -> View:
    out.const = all(v is None or v.const for v in ins)
    return out


HALF = (dtypes.float16, dtypes.bfloat16)


def _compute_dtype(x: UOp) -> UOp:
    """Half precision and the storage-only formats (float8, int4, ...) are computed on in float32/int32."""
    if x.dtype in HALF or (x.dtype.storage_only and x.dtype.is_float):
        return x.cast(dtypes.float32)
    return x.cast(dtypes.int32) if x.dtype.storage_only else x


def ew(ctx: Ctx, ins: Sequence[View], fn: Callable, dtype: DType | None = None, suffix: str = "") -> View:
    """One elementwise kernel. Half-precision operands are computed in float32 and rounded once at the
    store, as the ONNX reference (numpy + ml_dtypes) does within one op."""
    def body(xs, _):
        return fn(*[_compute_dtype(x) for x in xs])
    out = elementwise(ctx.k, ctx.n(suffix), ins, body, dtype or ins[0].dtype)
    return _keep_const(out, ins)


OPS: dict[str, Callable] = {}


def op(*names: str):
    def deco(fn):
        for n in names:
            OPS[n] = fn
        return fn
    return deco


def unary(name: str, fn: Callable[[UOp], UOp], attrs_fn=None):
    def impl(ctx, ins, a):
        if attrs_fn is not None:
            f = attrs_fn(a)
            return [ew(ctx, ins[:1], lambda x: f(x))]
        return [ew(ctx, ins[:1], fn)]
    OPS[name] = impl


def _abs(x: UOp) -> UOp:
    if x.dtype.is_unsigned or x.dtype.is_bool:
        return x
    return (x < UOp.const(0, x.dtype)).where(-x, x)


def _softplus(x: UOp) -> UOp:
    # log1p: log(exp(x) + 1) loses up to half an ulp of 1 relative to exp(x) where x << 0 (Mish's tail)
    return method(x.exp(), "log1p")


def _sign(x: UOp) -> UOp:
    z = UOp.const(0, x.dtype)
    one, mone = UOp.const(1, x.dtype), UOp.const(-1 if not x.dtype.is_unsigned else 0, x.dtype)
    return (x > z).where(one, (x < z).where(mone, z))


unary("Neg", lambda x: -x)
unary("Abs", _abs)
unary("Relu", lambda x: x.relu())
unary("Sigmoid", lambda x: method(x, "sigmoid"))
unary("Tanh", lambda x: method(x, "tanh"))
unary("Exp", lambda x: x.exp())
unary("Log", lambda x: x.log())
unary("Sqrt", lambda x: x.sqrt())
unary("Reciprocal", lambda x: x.reciprocal())
unary("Floor", lambda x: method(x, "floor"))
unary("Ceil", lambda x: method(x, "ceil"))
unary("Round", lambda x: method(x, "round"))
unary("Sign", _sign)
unary("Sin", lambda x: x.sin())
unary("Cos", lambda x: (x + fconst(x, math.pi / 2)).sin())
unary("Erf", lambda x: method(x, "erf"))
unary("Softplus", _softplus)
unary("Softsign", lambda x: x / (_abs(x) + fconst(x, 1.0)))
unary("Not", lambda x: x.logical_not())
unary("LeakyRelu", None, lambda a: (lambda x, al=a.get("alpha", 0.01): (x < fconst(x, 0)).where(x * fconst(x, al), x)))
unary("Elu", None, lambda a: (lambda x, al=a.get("alpha", 1.0):
                              (x < fconst(x, 0)).where((x.exp() - fconst(x, 1)) * fconst(x, al), x)))
unary("Selu", None, lambda a: (lambda x, al=a.get("alpha", 1.67326319217681884765625), g=a.get("gamma", 1.05070102214813232421875):
                               (x <= fconst(x, 0)).where((x.exp() * fconst(x, al) - fconst(x, al)), x) * fconst(x, g)))
unary("Celu", None, lambda a: (lambda x, al=a.get("alpha", 1.0):
                               x.maximum(fconst(x, 0)) + ((x / fconst(x, al)).exp() - fconst(x, 1)).minimum(fconst(x, 0)) * fconst(x, al)))
unary("HardSigmoid", None, lambda a: (lambda x, al=a.get("alpha", 0.2), b=a.get("beta", 0.5):
                                      (x * fconst(x, al) + fconst(x, b)).maximum(fconst(x, 0)).minimum(fconst(x, 1))))
unary("HardSwish", lambda x: x * (x * fconst(x, 1 / 6) + fconst(x, 0.5)).maximum(fconst(x, 0)).minimum(fconst(x, 1)))
unary("Mish", lambda x: x * method(_softplus(x), "tanh"))
unary("ThresholdedRelu", None, lambda a: (lambda x, al=a.get("alpha", 1.0): (x > fconst(x, al)).where(x, fconst(x, 0))))
@op("IsNaN")
def _isnan(ctx, ins, a):
    return [ew(ctx, ins[:1], lambda x: method(x, "isnan"), dtypes.bool)]


@op("IsInf")
def _isinf(ctx, ins, a):
    pos, neg = a.get("detect_positive", 1), a.get("detect_negative", 1)

    def f(x):
        if pos and neg:
            return method(x, "isinf")
        inf = fconst(x, math.inf if pos else -math.inf)
        if not pos and not neg:
            return (x != x) & (x == x)
        return x == inf
    return [ew(ctx, ins[:1], f, dtypes.bool)]


@op("Gelu")
def _gelu(ctx, ins, a):
    if a.get("approximate", b"none") in (b"tanh", "tanh"):
        f = lambda x: x * fconst(x, 0.5) * (fconst(x, 1) + method((x + x * x * x * fconst(x, 0.044715)) * fconst(x, math.sqrt(2 / math.pi)), "tanh"))
    else:
        f = lambda x: x * fconst(x, 0.5) * (fconst(x, 1) + method(x * fconst(x, 1 / math.sqrt(2)), "erf"))
    return [ew(ctx, ins[:1], f)]


# ---- binary / variadic -----------------------------------------------------------------------------
def _div(x: UOp, y: UOp) -> UOp:
    if x.dtype.is_float:
        return x / y
    return x.alu(Ops.IDIV, y)


def _mod(fmod: int):
    def f(x, y):
        if x.dtype.is_float:
            inf = fconst(x, math.inf)
            x_finite = (x == x) & (x != inf) & (x != -inf)
            r = ((y == inf) | (y == -inf)).where(x_finite.where(x, x - x), x - (x / y).trunc() * y)
            if fmod:
                return r
            z = fconst(x, 0)
            r = ((r != z) & ((r < z) != (y < z))).where(r + y, r)
            return (r == z).where((y < z).where(fconst(x, -0.0), z), r)
        r = x % y
        if fmod or x.dtype.is_unsigned:
            return r
        z = UOp.const(0, x.dtype)
        return ((r != z) & ((r < z) != (y < z))).where(r + y, r)
    return f


BIN = {"Add": lambda x, y: x + y, "Sub": lambda x, y: x - y, "Mul": lambda x, y: x * y, "Div": _div,
       "Equal": lambda x, y: x == y, "Less": lambda x, y: x < y, "Greater": lambda x, y: x > y,
       "LessOrEqual": lambda x, y: x <= y, "GreaterOrEqual": lambda x, y: x >= y,
       "And": lambda x, y: x & y, "Or": lambda x, y: x | y, "Xor": lambda x, y: x ^ y}
CMP = {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"}


def _binary(name):
    def impl(ctx, ins, a):
        return [ew(ctx, ins[:2], BIN[name], dtypes.bool if name in CMP else None)]
    OPS[name] = impl


for _n in BIN:
    _binary(_n)


@op("Mod")
def _mod_op(ctx, ins, a):
    return [ew(ctx, ins[:2], _mod(a.get("fmod", 0)))]


@op("Pow")
def _pow(ctx, ins, a):
    x, y = ins
    return [ew(ctx, [x, y], lambda u, v: method(u, "pow", v.cast(u.dtype)), x.dtype)]


@op("PRelu")
def _prelu(ctx, ins, a):
    return [ew(ctx, ins[:2], lambda x, s: (x < UOp.const(0, x.dtype)).where(x * s, x))]


@op("Where")
def _where(ctx, ins, a):
    return [ew(ctx, ins, lambda c, x, y: c.where(x, y), ins[1].dtype)]


def _variadic(fn, mean=False):
    def impl(ctx, ins, a):
        ins = [v for v in ins if v is not None]
        def f(*xs):
            acc = xs[0]
            for x in xs[1:]:
                acc = fn(acc, x)
            return acc / fconst(acc, len(xs)) if mean else acc
        return [ew(ctx, ins, f)]
    return impl


OPS["Max"] = _variadic(lambda x, y: x.maximum(y))
OPS["Min"] = _variadic(lambda x, y: x.minimum(y))
OPS["Sum"] = _variadic(lambda x, y: x + y)
OPS["Mean"] = _variadic(lambda x, y: x + y, mean=True)


@op("Clip")
def _clip(ctx, ins, a):
    x = ins[0]
    if ctx.opset < 11:
        lo, hi = a.get("min", -3.4028234663852886e38), a.get("max", 3.4028234663852886e38)
        return [ew(ctx, [x], lambda u: u.maximum(fconst(u, lo)).minimum(fconst(u, hi)))]
    lo = ins[1] if len(ins) > 1 else None
    hi = ins[2] if len(ins) > 2 else None
    vs = [x] + [v for v in (lo, hi) if v is not None]

    def f(u, *bounds):
        b = list(bounds)
        if lo is not None:
            u = u.maximum(b.pop(0))
        if hi is not None:
            u = u.minimum(b.pop(0))
        return u
    return [ew(ctx, vs, f)]


# Cast's saturate (float8 targets, default 1) and round_mode (float8e8m0, default "up") follow the spec
@op("Cast")
def _cast(ctx, ins, a):
    return [_cast_to(ctx, ins[0], ONNX_DT[a["to"]], a)]


@op("CastLike")
def _castlike(ctx, ins, a):
    return [_cast_to(ctx, ins[0], ins[1].dtype, a)]


def _cast_to(ctx, x: View, dt: DType, a=None) -> View:
    if x.dtype == dt:
        return x
    a = a or {}
    sat, mode = bool(a.get("saturate", 1)), a.get("round_mode", "up")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if dt.is_bool:
        return ew(ctx, [x], lambda u: u != UOp.const(0, u.dtype), dt)
    # the storage-only source itself, not a float32 copy of it: the library converts it exactly
    return _keep_const(elementwise(ctx.k, ctx.n(), [x], lambda xs, _: xs[0].cast(dt, saturate=sat, round_mode=mode),
                                   dt), [x])


# ---- shape-only ops: views --------------------------------------------------------------------------
def reshape(ctx, x: View, shape: Sequence[int]) -> View:
    v = x.try_reshape(shape)
    if v is None:
        v = copy(ctx.k, ctx.n("contiguous"), x).try_reshape(shape)
        v.const = x.const
    return v


@op("Identity")
def _identity(ctx, ins, a):
    return [ins[0]]


@op("Dropout")
def _dropout(ctx, ins, a):
    x = ins[0]
    training = len(ins) > 2 and ins[2] is not None and bool(ctx.scalar(ins[2]))
    ratio = float(ctx.scalar(ins[1])) if len(ins) > 1 and ins[1] is not None else a.get("ratio", 0.5)
    if training and ratio > 0:
        raise NotImplementedError("Dropout in training mode draws random numbers")
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
            raise ValueError("slice step 0")
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
        raise NotImplementedError(f"Constant with {sorted(a)}")
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
        return [_keep_const(copy(ctx.k, ctx.n(), ins[0].with_((1,), (0,))), ins)]

    def f(xs, idx):
        s, d = xs[0], xs[1]
        return s + idx[0].cast(dt) * d
    return [_keep_const(elementwise(ctx.k, ctx.n(), [ins[0].with_((1,), (0,)), ins[2].with_((1,), (0,))], f, dt,
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


def _u(i) -> UOp:
    return i if isinstance(i, UOp) else iconst(i)


@op("Tile")
def _tile(ctx, ins, a):
    x = ins[0]
    reps = ctx.ints(ins[1])
    shape = [s * r for s, r in zip(x.shape, reps)]
    kb = KB(ctx.k, ctx.n())
    out = ctx.k.empty(shape, x.dtype)
    if out.size:
        idx = [kb.rng(s) for s in shape]
        kb.store(out, idx, kb.load(x, [_u(i) % s if s != 1 else 0 for i, s in zip(idx, x.shape)]))
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
        j = _u(i) - b
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
            raise NotImplementedError(f"Pad mode {mode}")
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
    ins = [v for v in ins if v is not None]
    nd = ins[0].ndim
    ax = a["axis"] % nd
    shape = list(ins[0].shape)
    shape[ax] = sum(v.shape[ax] for v in ins)
    out = ctx.k.empty(shape, ins[0].dtype)
    pos = 0
    for j, v in enumerate(ins):
        if v.size:
            dst = out.with_(v.shape, out.strides, pos * out.strides[ax])
            kb = KB(ctx.k, ctx.n(str(j)))
            idx = [kb.rng(s) for s in v.shape]
            kb.store(dst, idx, kb.load(v, idx))
            kb.run()
        pos += v.shape[ax]
    return [_keep_const(out, ins)]


@op("Gather")
def _gather(ctx, ins, a):
    x, ind = ins
    ax = a.get("axis", 0) % x.ndim
    shape = list(x.shape[:ax]) + list(ind.shape) + list(x.shape[ax + 1:])
    out = ctx.k.empty(shape, x.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    idx = [kb.rng(s) for s in shape]
    d = x.shape[ax]
    j = kb.load(ind, idx[ax:ax + ind.ndim]) if ind.ndim else kb.load(ind, [])
    j = (j < 0).where(j + d, j).clamp(0, d - 1).cast(dtypes.index)
    kb.store(out, idx, kb.load(x, idx[:ax] + [j] + idx[ax + ind.ndim:]))
    kb.run()
    return [_keep_const(out, ins)]


@op("GatherElements")
def _gather_elements(ctx, ins, a):
    x, ind = ins
    ax = a.get("axis", 0) % x.ndim
    out = ctx.k.empty(ind.shape, x.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    idx = [kb.rng(s) for s in ind.shape]
    d = x.shape[ax]
    j = kb.load(ind, idx)
    j = (j < 0).where(j + d, j).clamp(0, d - 1).cast(dtypes.index)
    src = list(idx)
    src[ax] = j
    kb.store(out, idx, kb.load(x, src))
    kb.run()
    return [out]


@op("OneHot")
def _onehot(ctx, ins, a):
    ind, depth, values = ins
    depth = int(ctx.scalar(depth))
    nd = ind.ndim + 1
    ax = a.get("axis", -1) % nd
    shape = list(ind.shape[:ax]) + [depth] + list(ind.shape[ax:])
    out = ctx.k.empty(shape, values.dtype)
    kb = KB(ctx.k, ctx.n())
    idx = [kb.rng(s) for s in shape]
    j = kb.load(ind, idx[:ax] + idx[ax + 1:])
    if j.dtype.is_float:
        j = j.trunc()
    dcon = UOp.const(depth, j.dtype)
    j = (j < UOp.const(0, j.dtype)).where(j + dcon, j)
    hit = j == _u(idx[ax]).cast(j.dtype)
    kb.store(out, idx, hit.where(kb.load(values.with_((1,), (0,), values.offset + values.strides[0]), [0]),
                                 kb.load(values.with_((1,), (0,)), [0])))
    kb.run()
    return [out]


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
_reduce_op("ReduceMean", Ops.ADD, post=lambda v, c: v / _cnt(v, c) if v.dtype.is_float else v // _cnt(v, c))
_reduce_op("ReduceSumSquare", Ops.ADD, pre=lambda v: v * v)
_reduce_op("ReduceL1", Ops.ADD, pre=_abs)
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
    k = _u(idx[ax]).cast(dtypes.int64)
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


@op("CumSum")
def _cumsum(ctx, ins, a):
    x = ins[0]
    ax = int(ctx.scalar(ins[1])) % x.ndim
    excl, rev = a.get("exclusive", 0), a.get("reverse", 0)
    out = ctx.k.empty(x.shape, x.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    idx = [kb.rng(s) for s in x.shape]
    r = kb.rng(x.shape[ax], AxisType.REDUCE)
    src = list(idx)
    src[ax] = r
    i, j = _u(idx[ax]), _u(r)
    cond = {(0, 0): j <= i, (1, 0): j < i, (0, 1): j >= i, (1, 1): j > i}[(excl, rev)]
    v = cond.where(kb.load(x, src), UOp.const(0, x.dtype))
    if isr(r):
        v = v.reduce(r)
    kb.store(out, idx, v)
    kb.run()
    return [out]


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
            o = elementwise(ctx.k, ctx.n(), [am], lambda xs, idx: (_u(idx[ax]).cast(dtypes.int64) == xs[0]).where(
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
    beats = beats | ((xe == xi) & (_u(e) < _u(idx[ax])))
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
    hit = kb.load(rank, src) == _u(idx[ax])
    pos = hit.where(_u(i).cast(dtypes.int64), UOp.const(0, dtypes.int64))
    pos = pos.reduce(i) if isr(i) else pos
    src2 = list(idx)
    src2[ax] = pos.cast(dtypes.index).clamp(0, n - 1)
    kb.store(inds, idx, pos)
    kb.store(vals, idx, kb.load(x, src2))
    kb.run()
    return [vals, inds]


# ---- linear algebra ---------------------------------------------------------------------------------
def matmul(ctx, A: View, B: View, suffix="", epilogue=None, extra: Sequence[View] = ()) -> View:
    """Batched matmul with numpy broadcasting; epilogue(acc, kb, out_idx) may add bias etc."""
    a1, b1 = A.ndim == 1, B.ndim == 1
    if a1:
        A = A.with_((1,) + A.shape, (0,) + A.strides)
    if b1:
        B = B.with_(B.shape + (1,), B.strides + (0,))
    batch = bcast_shape(A.shape[:-2], B.shape[:-2])
    M, K, N = A.shape[-2], A.shape[-1], B.shape[-1]
    oshape = list(batch) + [M, N]
    out = ctx.k.empty(oshape, A.dtype)
    if out.size:
        kb = KB(ctx.k, ctx.n(suffix))
        bidx = [kb.rng(s) for s in batch]
        i, j = kb.rng(M), kb.rng(N)
        k = kb.rng(K, AxisType.REDUCE)
        if K == 0:
            acc = UOp.const(0, A.dtype)
        else:
            acc = kb.load(A, bidx + [i, k]) * kb.load(B, bidx + [k, j])
            acc = acc.reduce(k) if isr(k) else acc
        if epilogue is not None:
            acc = epilogue(acc, kb, bidx + [i, j])
        kb.store(out, bidx + [i, j], acc)
        kb.run()
    shape = list(batch) + ([] if a1 else [M]) + ([] if b1 else [N])
    return _keep_const(out.with_(shape, contiguous_strides(shape)), [A, B])


@op("MatMul")
def _matmul(ctx, ins, a):
    return [matmul(ctx, ins[0], ins[1])]


@op("Gemm")
def _gemm(ctx, ins, a):
    A, B = ins[0], ins[1]
    C = ins[2] if len(ins) > 2 else None
    if a.get("transA", 0):
        A = A.permute([1, 0])
    if a.get("transB", 0):
        B = B.permute([1, 0])
    alpha, beta = a.get("alpha", 1.0), a.get("beta", 1.0)

    def epi(acc, kb, idx):
        if alpha != 1.0:
            acc = acc * fconst(acc, alpha)
        if C is not None and beta != 0.0:
            c = kb.load(C, idx)
            acc = acc + (c * fconst(c, beta) if beta != 1.0 else c)
        return acc
    return [matmul(ctx, A, B, epilogue=epi)]


@op("Einsum")
def _einsum(ctx, ins, a):
    eq = a["equation"]
    eq = eq.decode() if isinstance(eq, bytes) else eq
    eq = eq.replace(" ", "")
    lhs, rhs = eq.split("->") if "->" in eq else (eq, None)
    terms = lhs.split(",")
    free = [c for c in string.ascii_letters if c not in eq]
    ell_nd = max((v.ndim - (len(t) - 3) for t, v in zip(terms, ins) if "..." in t), default=0)
    ell = "".join(free[:ell_nd])
    terms = [t.replace("...", ell[ell_nd - (v.ndim - (len(t) - 3)):]) if "..." in t else t for t, v in zip(terms, ins)]
    if rhs is None:
        cnt = {}
        for t in terms:
            for c in t:
                cnt[c] = cnt.get(c, 0) + 1
        rhs = ell + "".join(sorted(c for c in cnt if cnt[c] == 1 and c not in ell))
    else:
        rhs = rhs.replace("...", ell)
    sizes = {}
    for t, v in zip(terms, ins):
        for c, s in zip(t, v.shape):
            if sizes.get(c, 1) == 1:
                sizes[c] = s
    oshape = [sizes[c] for c in rhs]
    out = ctx.k.empty(oshape, ins[0].dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    rng = {c: kb.rng(sizes[c]) for c in rhs}
    red = [c for c in sizes if c not in rhs]
    for c in red:
        rng[c] = kb.rng(sizes[c], AxisType.REDUCE)
    val = None
    for t, v in zip(terms, ins):
        x = kb.load(v, [rng[c] if s != 1 else 0 for c, s in zip(t, v.shape)])
        val = x if val is None else val * x
    rr = [rng[c] for c in red if isr(rng[c])]
    if rr:
        val = val.reduce(*rr)
    kb.store(out, [rng[c] for c in rhs], val)
    kb.run()
    return [out]


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
        c = _u(spatial_idx[d]) * strides[d] + _u(kidx[d]) * dil[d] - pads[d]
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
    g = _u(co) // COg if G > 1 else iconst(0)
    cin = g * CI + _u(ci) if G > 1 else ci
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
                    flat = (_u(n2) * C + _u(c2)) * prod(sh) + flat
                else:
                    flat = _u(n2) * C + _u(c2)
                    for d in range(len(sh)):
                        flat = flat * sh[d] + coords2[d]
                # first hit in window order: max over (BIG - flat_window_pos) encoded as -pos
                pos = iconst(0)
                for r, s in zip(kk2, kshape):
                    pos = pos * s + _u(r)
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
                st = _u(sp[d]) * strides[d] - pads[d]
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
        raise NotImplementedError("BatchNormalization of rank < 2")
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
    xs = _cast_to(ctx, x, st) if x.dtype != st else x
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
    cc = _u(idx[1]) - lo + _u(r)
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
