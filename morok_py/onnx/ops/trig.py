"""Tan, the inverse trigonometric and the hyperbolic functions, composed from sin, exp, log and sqrt;
atan is Cephes' single-precision polynomial with its range reduction (about 1e-7 relative error)."""
from __future__ import annotations

import math

from morok_py import UOp

from morok_py.onnx.ops.common import ew, fconst
from morok_py.onnx.ops.registry import OPS


def _sqrt1m(x: UOp) -> UOp:
    """sqrt(1 - x*x) without the cancellation of 1 - x*x near |x| = 1."""
    one = fconst(x, 1.0)
    return ((one - x) * (one + x)).sqrt()


def atan(x: UOp) -> UOp:
    ax = (x < fconst(x, 0)).where(-x, x)
    big, mid = ax > fconst(x, 2.414213562373095), ax > fconst(x, 0.4142135623730950)
    # reduce |x| to [0, tan(pi/8)]: atan(t) = pi/2 - atan(1/t) = pi/4 + atan((t-1)/(t+1))
    one = fconst(x, 1.0)
    safe = big.where(ax, one)
    t = big.where(-one / safe, mid.where((ax - one) / (ax + one), ax))
    base = big.where(fconst(x, math.pi / 2), mid.where(fconst(x, math.pi / 4), fconst(x, 0.0)))
    z = t * t
    p = ((fconst(x, 8.05374449538e-2) * z - fconst(x, 1.38776856032e-1)) * z + fconst(x, 1.99777106478e-1)) * z \
        - fconst(x, 3.33329491539e-1)
    r = base + (p * z * t + t)
    return (x < fconst(x, 0)).where(-r, r)


def asin(x: UOp) -> UOp:
    return atan(x / _sqrt1m(x))


def acos(x: UOp) -> UOp:
    one = fconst(x, 1.0)
    return fconst(x, 2.0) * atan(((one - x) / (one + x)).sqrt())


def _cos(x: UOp) -> UOp:
    return (x + fconst(x, math.pi / 2)).sin()


def asinh(x: UOp) -> UOp:
    ax = (x < fconst(x, 0)).where(-x, x)
    r = (ax + (ax * ax + fconst(x, 1.0)).sqrt()).log()
    return (x < fconst(x, 0)).where(-r, r)


FUNCS = {
    "Tan": lambda x: x.sin() / _cos(x),
    "Atan": atan,
    "Asin": asin,
    "Acos": acos,
    "Sinh": lambda x: (x.exp() - (-x).exp()) * fconst(x, 0.5),
    "Cosh": lambda x: (x.exp() + (-x).exp()) * fconst(x, 0.5),
    "Asinh": asinh,
    "Acosh": lambda x: (x + (x * x - fconst(x, 1.0)).sqrt()).log(),
    "Atanh": lambda x: ((fconst(x, 1.0) + x) / (fconst(x, 1.0) - x)).log() * fconst(x, 0.5),
}


def _register(name: str) -> None:
    fn = FUNCS[name]
    OPS[name] = lambda ctx, ins, a: [ew(ctx, ins[:1], fn)]


for _name in FUNCS:
    _register(_name)
