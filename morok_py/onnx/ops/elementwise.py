"""Elementwise ops: unary math and activations, binary arithmetic and comparisons, Clip, Cast, Where."""
from __future__ import annotations

import math
from typing import Callable

from morok_py import UOp, dtypes
from morok_py.onnx.ops.common import abs_value, cast_to, ew, fconst, method, ONNX_DT
from morok_py.onnx.ops.registry import OPS, op


def unary(name: str, fn: Callable[[UOp], UOp], attrs_fn=None):
    def impl(ctx, ins, a):
        if attrs_fn is not None:
            f = attrs_fn(a)
            return [ew(ctx, ins[:1], lambda x: f(x))]
        return [ew(ctx, ins[:1], fn)]
    OPS[name] = impl


def _softplus(x: UOp) -> UOp:
    # log1p: log(exp(x) + 1) loses up to half an ulp of 1 relative to exp(x) where x << 0 (Mish's tail)
    return method(x.exp(), "log1p")


def _sign(x: UOp) -> UOp:
    z = UOp.const(0, x.dtype)
    one, mone = UOp.const(1, x.dtype), UOp.const(-1 if not x.dtype.is_unsigned else 0, x.dtype)
    return (x > z).where(one, (x < z).where(mone, z))


unary("Neg", lambda x: -x)
unary("Abs", abs_value)
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
unary("Softsign", lambda x: x / (abs_value(x) + fconst(x, 1.0)))
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
    """ONNX's integer Div truncates toward zero (C), not toward -inf (Python's //)."""
    if x.dtype.is_float:
        return x / y
    return x.cdiv(y)


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
        # fmod=1: C's remainder (the dividend's sign); fmod=0: the divisor's sign, Python's %
        return x.cmod(y) if fmod else x % y
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
    return [cast_to(ctx, ins[0], ONNX_DT[a["to"]], a)]


@op("CastLike")
def _castlike(ctx, ins, a):
    return [cast_to(ctx, ins[0], ins[1].dtype, a)]
