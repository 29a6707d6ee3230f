"""The kernel IR: immutable, hash-consed UOps.

Building the same structure twice gives the same object, and `uop.key` is a digest that
is identical in every process, so it can key the method and disk caches.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import threading
import weakref
from functools import cached_property
from operator import is_not
from typing import Any, Iterable, Iterator, Union

from .dtypes import FLOAT_FORMATS, DType, accumulation_dtype, dtypes, as_dtype
from .errors import ArgumentError, ArgumentTypeError


class Ops(enum.Enum):
    """Every op of the IR. ALU ops are the ones a renderer prints as one instruction."""

    # structure
    SINK = enum.auto(); PARAM = enum.auto(); DEFINE_VAR = enum.auto(); CONST = enum.auto()
    RANGE = enum.auto(); LOAD = enum.auto(); STORE = enum.auto(); REDUCE = enum.auto()
    # unary
    NEG = enum.auto(); EXP2 = enum.auto(); LOG2 = enum.auto(); SQRT = enum.auto(); SIN = enum.auto()
    RECIP = enum.auto(); TRUNC = enum.auto(); CAST = enum.auto(); BITCAST = enum.auto(); NOT = enum.auto()
    # binary
    ADD = enum.auto(); SUB = enum.auto(); MUL = enum.auto(); IDIV = enum.auto(); MOD = enum.auto()
    FDIV = enum.auto(); MAX = enum.auto(); MIN = enum.auto(); CMPLT = enum.auto(); CMPEQ = enum.auto()
    CMPNE = enum.auto(); AND = enum.auto(); OR = enum.auto(); XOR = enum.auto(); SHL = enum.auto()
    SHR = enum.auto(); CDIV = enum.auto(); CMOD = enum.auto()
    # ternary
    WHERE = enum.auto()

    def __repr__(self) -> str:
        return f"Ops.{self.name}"


class AxisType(enum.Enum):
    """How a range is executed: GLOBAL is parallel, LOOP sequential, REDUCE closed by a REDUCE."""

    GLOBAL = "global"
    LOOP = "loop"
    REDUCE = "reduce"


UNARY = frozenset({Ops.NEG, Ops.EXP2, Ops.LOG2, Ops.SQRT, Ops.SIN, Ops.RECIP, Ops.TRUNC, Ops.NOT})
BINARY = frozenset({Ops.ADD, Ops.SUB, Ops.MUL, Ops.IDIV, Ops.MOD, Ops.FDIV, Ops.MAX, Ops.MIN,
                    Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE, Ops.AND, Ops.OR, Ops.XOR, Ops.SHL, Ops.SHR,
                    Ops.CDIV, Ops.CMOD})
COMPARE = frozenset({Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE})
INT_DIVISION = frozenset({Ops.IDIV, Ops.MOD, Ops.CDIV, Ops.CMOD})
"""Integer division, defined for every pair of operands (no input traps the process).

  IDIV, MOD  (x // y, x % y): floor division and modulo as in Python and numpy; the remainder
             takes the divisor's sign (-7 // 2 == -4, -7 % 2 == 1).
  CDIV, CMOD (x.cdiv(y), x.cmod(y)): truncating division and remainder as in C and ONNX; the
             remainder takes the dividend's sign (-7 cdiv 2 == -3, -7 cmod 2 == -1).
  y == 0 gives 0 for all four (numpy's integer result). The one quotient that overflows,
  INT_MIN // -1 (and cdiv), wraps to INT_MIN; its remainder is 0. On unsigned dtypes floor and
  truncation agree. Lowering (codegen/decompose.defined_division) adds the guards, and only where
  range analysis cannot prove them unnecessary, so renderers print plain machine division."""
ALU = UNARY | BINARY | {Ops.WHERE, Ops.CAST, Ops.BITCAST}
# the same sets by op name, for membership tests on hot paths (a str hashes in C, an Ops member in Python)
_BINARY_NAMES = frozenset(o.name for o in BINARY)
_COMPARE_NAMES = frozenset(o.name for o in COMPARE)
_INT_DIVISION_NAMES = frozenset(o.name for o in INT_DIVISION)
REDUCE_OPS = (Ops.ADD, Ops.MUL, Ops.MAX, Ops.MIN)

ConstLike = Union[int, float, bool]


def _normalize_const(value: Any, dtype: DType) -> ConstLike:
    if isinstance(value, UOp):
        raise ArgumentTypeError("UOp.const takes a Python number, not a UOp")
    if dtype.is_bool:
        return bool(value)
    if dtype.is_int:
        if isinstance(value, float) and not value.is_integer():
            raise ArgumentTypeError(f"constant {value!r} is not an integer but the dtype is {dtype.name}")
        v = int(value)
        if not dtype.min() <= v <= dtype.max():
            raise ArgumentError(f"constant {v} does not fit {dtype.name} [{dtype.min()}, {dtype.max()}]")
        return v
    if dtype.storage_only:
        raise ArgumentTypeError(f"no {dtype.name} constants: a storage-only dtype is never computed on; use a "
                                f"float32 constant and .cast(dtypes.{dtype.name})")
    return float(value)


def _arg_key(arg: Any) -> Any:
    # floats by repr so that 0.0 and -0.0 (equal and same hash) stay different nodes; NaN by repr
    if isinstance(arg, float):
        return ("f", repr(arg))
    if isinstance(arg, tuple):
        return tuple(_arg_key(a) for a in arg)
    return (type(arg).__name__, arg)


_cons_lock = threading.Lock()
_cons: "weakref.WeakValueDictionary[tuple, UOp]" = weakref.WeakValueDictionary()
_NONE_KEY = _arg_key(None)


# id of a DType -> (the DType, its token); holds the DTypes it names (a few: dtypes' constants and any
# equal copies, e.g. unpickled), at most _DTYPE_TOKENS_MAX
_dtype_tokens: dict[int, tuple[DType, tuple]] = {}
_DTYPE_TOKENS_MAX = 256


def _dtype_token(dtype: Any) -> Any:
    """What UOp.__new__'s key holds for `dtype`: a DType as its class and fields (equal exactly where the
    DTypes are, as the dataclass compares them), anything else (None) as itself."""
    if type(dtype) is not DType:
        return dtype
    tok = (DType,) + tuple(getattr(dtype, f.name) for f in dataclasses.fields(DType))
    if len(_dtype_tokens) < _DTYPE_TOKENS_MAX:
        _dtype_tokens[id(dtype)] = (dtype, tok)
    return tok


class _computed_once:
    """functools.cached_property without its lock (the value is computed again only where two threads
    ask at once, and both get the same value): a node's first `free_ranges` is asked for on every
    node the lowering builds."""

    def __init__(self, func) -> None:
        self.func = func
        self.name = func.__name__
        self.__doc__ = func.__doc__

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.func(obj)
        return value


class UOp:
    """One node of a kernel graph. Create with the constructors, never directly."""

    __slots__ = ("op", "dtype", "src", "arg", "__weakref__", "__dict__")

    op: Ops
    dtype: DType | None
    src: tuple["UOp", ...]
    arg: Any

    def __new__(cls, op: Ops, dtype: DType | None, src: tuple["UOp", ...] = (), arg: Any = None) -> "UOp":
        # an Ops member by its name and a DType by its fields (_dtype_token): tuples of strs and ints hash in
        # C, an Ops member and a DType in Python; both compare as the op and the dtype do
        tok = _dtype_tokens.get(id(dtype))
        key = (op._name_ if type(op) is Ops else (op,),
               tok[1] if tok is not None and tok[0] is dtype else _dtype_token(dtype), tuple(map(id, src)),
               _NONE_KEY if arg is None else _arg_key(arg))
        # an existing node without the lock (a lookup only reads; a miss takes the locked path, which looks again)
        hit = _cons.get(key)
        if hit is not None:
            return hit
        with _cons_lock:
            hit = _cons.get(key)
            if hit is not None:
                return hit
            node = object.__new__(cls)
            object.__setattr__(node, "op", op)
            object.__setattr__(node, "dtype", dtype)
            object.__setattr__(node, "src", tuple(src))
            object.__setattr__(node, "arg", arg)
            _cons[key] = node
            return node

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("op", "dtype", "src", "arg"):
            raise AttributeError("UOp is immutable")
        object.__setattr__(self, name, value)

    def __reduce__(self):  # pickling rebuilds through the hash-consing constructor
        return (UOp, (self.op, self.dtype, self.src, self.arg))

    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        raise ArgumentTypeError("a UOp has no truth value; use .where() or compare in the kernel")

    # ---- identity -------------------------------------------------------------------------
    @cached_property
    def key(self) -> str:
        """A hex digest of the structure, identical across processes."""
        h = hashlib.sha256()
        h.update(self.op.name.encode())
        h.update(b"|" + (self.dtype.name.encode() if self.dtype else b"void"))
        h.update(b"|" + repr(_stable_arg(self.arg)).encode())
        for s in self.src:
            h.update(b"|" + s.key.encode())
        return h.hexdigest()

    def __repr__(self) -> str:
        return self.pretty(max_depth=3)

    def pretty(self, max_depth: int = 99, _depth: int = 0) -> str:
        pad = "  " * _depth
        head = f"{pad}UOp({self.op.name}, {self.dtype!r}, arg={_stable_arg(self.arg)!r}"
        if not self.src:
            return head + ")"
        if _depth >= max_depth:
            return head + ", src=(...))"
        inner = ",\n".join(s.pretty(max_depth, _depth + 1) for s in self.src)
        return head + ", src=(\n" + inner + "))"

    def toposort(self) -> list["UOp"]:
        """All nodes reachable from this one, each after its sources."""
        return toposort_outside(self, _NOTHING)

    # ---- constructors ---------------------------------------------------------------------
    @staticmethod
    def param(slot: int, dtype: Any) -> "UOp":
        """Buffer argument number `slot` holding elements of `dtype`."""
        if not isinstance(slot, int) or slot < 0:
            raise ArgumentError(f"param slot must be a non-negative int, got {slot!r}")
        return UOp(Ops.PARAM, as_dtype(dtype), (), slot)

    @staticmethod
    def variable(name: str, min: int, max: int) -> "UOp":
        """A symbolic integer, bound at launch time to a value in [min, max]."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ArgumentError(f"variable name must be an identifier, got {name!r}")
        if not (isinstance(min, int) and isinstance(max, int)) or min > max:
            raise ArgumentError(f"variable {name}: need int bounds with min <= max, got [{min}, {max}]")
        lo, hi = dtypes.index.min(), dtypes.index.max()
        if min < lo or max > hi:
            raise ArgumentError(f"variable {name}: bounds [{min}, {max}] exceed the index type {dtypes.index.name}")
        return UOp(Ops.DEFINE_VAR, dtypes.index, (), (name, min, max))

    @staticmethod
    def const(value: ConstLike, dtype: Any = None) -> "UOp":
        if dtype is None:
            dtype = dtypes.bool if isinstance(value, bool) else dtypes.index if isinstance(value, int) else dtypes.float32
        dt = as_dtype(dtype)
        return UOp(Ops.CONST, dt, (), _normalize_const(value, dt))

    @staticmethod
    def range(end: "UOp | int", axis: int, kind: AxisType = AxisType.GLOBAL) -> "UOp":
        """The loop variable of axis `axis` running over [0, end)."""
        if not isinstance(kind, AxisType):
            raise ArgumentTypeError(f"range kind must be an AxisType, got {kind!r}")
        end_u = end if isinstance(end, UOp) else UOp.const(int(end), dtypes.index)
        if end_u.dtype != dtypes.index:
            raise ArgumentTypeError(f"range end must be {dtypes.index.name}, got {end_u.dtype}")
        if end_u.op is Ops.CONST and end_u.arg < 0:
            raise ArgumentError(f"range end must be >= 0, got {end_u.arg}")
        return UOp(Ops.RANGE, dtypes.index, (end_u,), (int(axis), kind))

    @staticmethod
    def sink(*stores: "UOp") -> "UOp":
        """The kernel root: every STORE the kernel performs."""
        flat: list[UOp] = []
        for s in stores:
            flat.extend(s if isinstance(s, (list, tuple)) else [s])
        if not flat:
            raise ArgumentError("a kernel needs at least one store")
        for s in flat:
            if not isinstance(s, UOp) or s.op is not Ops.STORE:
                raise ArgumentTypeError(f"UOp.sink takes STOREs, got {s!r}")
        return UOp(Ops.SINK, None, tuple(flat), None)

    # ---- memory ---------------------------------------------------------------------------
    def load(self, index: "UOp | int") -> "UOp":
        if self.op is not Ops.PARAM:
            raise ArgumentTypeError("load() is called on a buffer (UOp.param)")
        return UOp(Ops.LOAD, self.dtype, (self, _as_index(index)), None)

    def store(self, index: "UOp | int", value: "UOp | ConstLike") -> "UOp":
        if self.op is not Ops.PARAM:
            raise ArgumentTypeError("store() is called on a buffer (UOp.param)")
        v = value if isinstance(value, UOp) else UOp.const(value, self.dtype)
        if v.dtype != self.dtype:
            raise ArgumentTypeError(f"storing {v.dtype} into a {self.dtype} buffer; cast it first")
        return UOp(Ops.STORE, None, (self, _as_index(index), v), None)

    def reduce(self, *ranges: "UOp", op: Ops = Ops.ADD, acc_dtype: Any = None) -> "UOp":
        """Reduce this value over `ranges` (REDUCE ranges) with `op` (see REDUCE_OPS).

        The REDUCE node accumulates in `acc_dtype` (default: float16 and
        bfloat16 sum in float32, int8/int16 in int32) and the result is rounded once to this value's
        dtype. The widening cast is pushed through ADD, SUB, NEG and MUL, so a half-precision dot
        product multiplies in float32 as well (as cuBLAS does). To keep working at the accumulation
        precision after the reduction (a mean, a norm), cast the input instead: x.cast(f32).reduce(k)."""
        if op not in REDUCE_OPS:
            raise ArgumentError(f"reduce op must be one of {[o.name for o in REDUCE_OPS]}, got {op!r}")
        if not ranges:
            raise ArgumentError("reduce needs at least one range")
        for r in ranges:
            if not isinstance(r, UOp) or r.op is not Ops.RANGE:
                raise ArgumentTypeError(f"reduce takes RANGE UOps, got {r!r}")
            if r.arg[1] is not AxisType.REDUCE:
                raise ArgumentError(f"range of axis {r.arg[0]} is {r.arg[1].name}; reduce needs AxisType.REDUCE ranges")
        dt = self.dtype
        if acc_dtype is None:
            acc = accumulation_dtype(dt, additive=op in (Ops.ADD, Ops.MUL))
        else:
            acc = as_dtype(acc_dtype)
            if acc.kind != dt.kind and not (dt.is_int and acc.is_int) or acc.itemsize < dt.itemsize:
                raise ArgumentError(f"a {dt.name} reduction cannot accumulate in {acc.name}: use a dtype of the same "
                                    f"kind at least as wide, or cast the input first")
        if acc.storage_only:
            raise ArgumentError(f"a reduction cannot accumulate in the storage-only {acc.name}")
        if acc == dt:
            return UOp(Ops.REDUCE, dt, (self, *ranges), op)
        return UOp(Ops.REDUCE, acc, (_widen(self, acc), *ranges), op).cast(dt)

    # ---- properties used by lowering ------------------------------------------------------
    @property
    def axis(self) -> int:
        return self.arg[0]

    @property
    def axis_type(self) -> AxisType:
        return self.arg[1]

    @property
    def var_name(self) -> str:
        return self.arg[0]

    @_computed_once
    def free_ranges(self) -> frozenset["UOp"]:
        """RANGEs this value depends on that no REDUCE inside it closes."""
        if self.op is Ops.RANGE:
            return frozenset({self}) | self.src[0].free_ranges
        out: frozenset[UOp] = frozenset()
        for s in self.src:
            out |= s.free_ranges
        if self.op is Ops.REDUCE:
            out -= frozenset(self.src[1:])
            for r in self.src[1:]:
                out |= r.src[0].free_ranges
        return out

    # ---- ALU ------------------------------------------------------------------------------
    def alu(self, op: Ops, *others: "UOp | ConstLike") -> "UOp":
        if op is Ops.WHERE:
            # the arms' constants take their type from the other arm (or from the value), never from
            # the bool condition: mask.where(36, x) must not store True
            a, b = others
            if not isinstance(a, UOp):
                a = UOp.const(a) if not isinstance(b, UOp) else _lift(a, b)
            if not isinstance(b, UOp):
                b = _lift(b, a)
            cond = self
            if cond.dtype != dtypes.bool:
                raise ArgumentTypeError(f"where() condition must be bool, got {cond.dtype}")
            a, b = _promote(a, b)
            return UOp(Ops.WHERE, a.dtype, (cond, a, b), None)
        srcs = [self] + [o if isinstance(o, UOp) else UOp.const(o, self._const_dtype(o)) for o in others]
        for u in srcs:
            if u.dtype is not None and u.dtype.storage_only:
                raise ArgumentTypeError(f"{op.name} on {u.dtype.name}: a storage-only dtype is loaded, stored, selected "
                                        f"and cast, never computed on; cast it first (x.cast(dtypes.float32))")
        name = op._name_ if type(op) is Ops else None
        if name in _BINARY_NAMES:
            a, b = srcs
            if op in (Ops.SHL, Ops.SHR):
                if not a.dtype.is_int:
                    raise ArgumentTypeError(f"{op.name} needs integers, got {a.dtype}")
                b = b if b.dtype == a.dtype else b.cast(a.dtype)
            else:
                a, b = _promote(a, b)
            if op in (Ops.AND, Ops.OR, Ops.XOR) and a.dtype.is_float:
                raise ArgumentTypeError(f"{op.name} needs integers or bools, got {a.dtype}")
            if name in _INT_DIVISION_NAMES and not a.dtype.is_int:
                raise ArgumentTypeError(f"{op.name} needs integers, got {a.dtype}; use / for floats")
            if op is Ops.FDIV and not a.dtype.is_float:
                raise ArgumentTypeError(f"FDIV needs floats, got {a.dtype}")
            dt = dtypes.bool if name in _COMPARE_NAMES else a.dtype
            return UOp(op, dt, (a, b), None)
        if op in UNARY:
            if op in (Ops.EXP2, Ops.LOG2, Ops.SQRT, Ops.SIN, Ops.RECIP, Ops.TRUNC) and not self.dtype.is_float:
                raise ArgumentTypeError(f"{op.name} needs a float, got {self.dtype}")
            if op is Ops.NOT and not (self.dtype.is_int or self.dtype.is_bool):
                raise ArgumentTypeError(f"NOT needs an integer or bool, got {self.dtype}")
            return UOp(op, self.dtype, (self,), None)
        raise ArgumentError(f"{op!r} is not an ALU op")

    def _const_dtype(self, value: Any) -> DType:
        if isinstance(value, float) and not self.dtype.is_float:
            return dtypes.float32
        return self.dtype

    def __add__(self, o): return self.alu(Ops.ADD, o)
    def __radd__(self, o): return _lift(o, self).alu(Ops.ADD, self)
    def __sub__(self, o): return self.alu(Ops.SUB, o)
    def __rsub__(self, o): return _lift(o, self).alu(Ops.SUB, self)
    def __mul__(self, o): return self.alu(Ops.MUL, o)
    def __rmul__(self, o): return _lift(o, self).alu(Ops.MUL, self)
    def __floordiv__(self, o): return self.alu(Ops.IDIV, o)
    def __rfloordiv__(self, o): return _lift(o, self).alu(Ops.IDIV, self)
    def __mod__(self, o): return self.alu(Ops.MOD, o)
    def __rmod__(self, o): return _lift(o, self).alu(Ops.MOD, self)
    def cdiv(self, o) -> "UOp":
        """Truncating integer division (C, ONNX): -7 cdiv 2 == -3; by 0 gives 0, INT_MIN cdiv -1 wraps."""
        return self.alu(Ops.CDIV, o)

    def cmod(self, o) -> "UOp":
        """The remainder of cdiv (C's %, ONNX Mod fmod=1 on ints): sign of the dividend; by 0 gives 0."""
        return self.alu(Ops.CMOD, o)

    def __and__(self, o): return self.alu(Ops.AND, o)
    def __rand__(self, o): return _lift(o, self).alu(Ops.AND, self)
    def __or__(self, o): return self.alu(Ops.OR, o)
    def __ror__(self, o): return _lift(o, self).alu(Ops.OR, self)
    def __xor__(self, o): return self.alu(Ops.XOR, o)
    def __rxor__(self, o): return _lift(o, self).alu(Ops.XOR, self)
    def __lshift__(self, o): return self.alu(Ops.SHL, o)
    def __rshift__(self, o): return self.alu(Ops.SHR, o)
    def __lt__(self, o): return self.alu(Ops.CMPLT, o)
    def __gt__(self, o): return _lift(o, self).alu(Ops.CMPLT, self)
    def __le__(self, o): return _lift(o, self).alu(Ops.CMPLT, self).logical_not()
    def __ge__(self, o): return self.alu(Ops.CMPLT, o).logical_not()
    def __eq__(self, o): return self.alu(Ops.CMPEQ, o)  # type: ignore[override]
    def __ne__(self, o): return self.alu(Ops.CMPNE, o)  # type: ignore[override]
    def __neg__(self): return self.alu(Ops.NEG)
    def __invert__(self): return self.alu(Ops.NOT)

    def __truediv__(self, o):
        a = self if self.dtype.is_float else self.cast(dtypes.float32)
        b = o if not isinstance(o, UOp) or o.dtype.is_float else o.cast(dtypes.float32)
        return a.alu(Ops.FDIV, b)

    def __rtruediv__(self, o):
        a = self if self.dtype.is_float else self.cast(dtypes.float32)
        return _lift(o, a).alu(Ops.FDIV, a)

    def logical_not(self) -> "UOp":
        if self.dtype != dtypes.bool:
            raise ArgumentTypeError("logical_not needs a bool")
        return self.alu(Ops.NOT)

    def maximum(self, o) -> "UOp": return self.alu(Ops.MAX, o)
    def minimum(self, o) -> "UOp": return self.alu(Ops.MIN, o)
    def where(self, a, b) -> "UOp": return self.alu(Ops.WHERE, a, b)
    def exp2(self) -> "UOp": return self.alu(Ops.EXP2)
    def log2(self) -> "UOp": return self.alu(Ops.LOG2)
    def sqrt(self) -> "UOp": return self.alu(Ops.SQRT)
    def sin(self) -> "UOp": return self.alu(Ops.SIN)
    def reciprocal(self) -> "UOp": return self.alu(Ops.RECIP)
    def trunc(self) -> "UOp": return self.alu(Ops.TRUNC)
    def exp(self) -> "UOp": return (self * (1.0 / math.log(2))).exp2()
    def log(self) -> "UOp": return self.log2() * math.log(2)
    def relu(self) -> "UOp": return self.maximum(0.0 if self.dtype.is_float else 0)
    def clamp(self, lo, hi) -> "UOp": return self.maximum(lo).minimum(hi)

    # ---- math a graph executor needs: compositions of the ops above, so every renderer has them ----
    # Transcendentals run in float32 for float16/bfloat16 (rounded once) and in float32 for ints.
    def abs(self) -> "UOp": return self.maximum(-self) if self.dtype.is_float else (self < 0).where(-self, self)
    def floor(self) -> "UOp": return _floor(self)
    def ceil(self) -> "UOp": return _ceil(self)
    def round(self) -> "UOp":
        """Round half to even (numpy.round / numpy.rint)."""
        return _round_half_even(self)
    def isnan(self) -> "UOp": return self != self
    def isinf(self) -> "UOp":
        if not self.dtype.is_float:
            return self != self
        return (self == math.inf) | (self == -math.inf)
    def log1p(self) -> "UOp": return _log1p(self)
    def tanh(self) -> "UOp": return _tanh(self)
    def sigmoid(self) -> "UOp": return _sigmoid(self)
    def erf(self) -> "UOp": return _erf(self)
    def pow(self, exponent: "UOp | ConstLike") -> "UOp":
        """self ** exponent like numpy.power for a float base: a negative base with an integer-valued
        exponent gives the signed result, with any other exponent NaN; x ** 0 == 1 (also for NaN).
        An int base computes in float32. Small integer constants multiply; other exponents go
        through exp2(y * log2|x|) in float64 for float32/float64 bases (float32 for half bases)."""
        return _pow(self, exponent)
    def __pow__(self, o): return self.pow(o)
    def __rpow__(self, o): return _lift(o, self).pow(self)

    def cast(self, dtype: Any, saturate: bool = False, round_mode: str = "nearest") -> "UOp":
        """This value converted to `dtype`. Floats round to nearest even. To and from the
        storage-only formats (float8, float4, int4, int2; see DType.storage_only) the conversion is
        composed from integer ops, so every renderer gets it: float -> narrow float rounds to nearest
        even and overflows to infinity where the format has one, else to NaN (float4: saturates), as
        ml_dtypes does; `saturate=True` clamps finite overflow and infinities to the largest finite
        value instead (ONNX Cast's default). `round_mode` ('nearest', 'up', 'down') applies to
        float8_e8m0fnu only, with ONNX's definitions. Narrow integers wrap, like C's integer casts."""
        dt = as_dtype(dtype)
        if round_mode not in ("nearest", "up", "down"):
            raise ArgumentError(f"round_mode must be 'nearest', 'up' or 'down', got {round_mode!r}")
        if dt == self.dtype:
            return self
        if dt.storage_only or self.dtype.storage_only:
            return _narrow_cast(self, dt, saturate, round_mode)
        return UOp(Ops.CAST, dt, (self,), None)

    def bitcast(self, dtype: Any) -> "UOp":
        dt = as_dtype(dtype)
        if dt.itemsize != self.dtype.itemsize or dt.is_bool or self.dtype.is_bool:
            raise ArgumentTypeError(f"bitcast needs types of the same size, got {self.dtype} -> {dt}")
        return UOp(Ops.BITCAST, dt, (self,), None)


def _widen(x: UOp, acc: DType) -> UOp:
    """x cast to `acc`, the cast pushed below ADD/SUB/NEG/MUL so that their arithmetic is done at the
    accumulation precision (products of two float16 values are exact in float32)."""
    memo: dict[int, UOp] = {}
    def go(u: UOp) -> UOp:
        hit = memo.get(id(u))
        if hit is None:
            if u.op in (Ops.ADD, Ops.SUB, Ops.MUL, Ops.NEG) and u.dtype == x.dtype:
                hit = UOp(u.op, acc, tuple(go(s) for s in u.src), None)
            elif u.op is Ops.CONST:
                hit = UOp.const(u.arg, acc)
            else:
                hit = u.cast(acc)
            memo[id(u)] = hit
        return hit
    return go(x)


def _lift(value: Any, like: UOp) -> UOp:
    return value if isinstance(value, UOp) else UOp.const(value, like._const_dtype(value))


_RANK = {"b": 0, "u": 1, "i": 2, "f": 3}


def _promote(a: UOp, b: UOp) -> tuple[UOp, UOp]:
    """Implicit promotion: bool < ints < floats, then the wider type; consts adopt the other side."""
    if a.dtype is b.dtype or a.dtype == b.dtype:
        return a, b
    if b.op is Ops.CONST and not (b.dtype.is_float and not a.dtype.is_float):
        return a, UOp.const(b.arg, a.dtype)
    if a.op is Ops.CONST and not (a.dtype.is_float and not b.dtype.is_float):
        return UOp.const(a.arg, b.dtype), b
    ka, kb = (_RANK[a.dtype.kind], a.dtype.itemsize), (_RANK[b.dtype.kind], b.dtype.itemsize)
    target = a.dtype if ka >= kb else b.dtype
    return a.cast(target), b.cast(target)


def _as_index(index: "UOp | int") -> UOp:
    u = index if isinstance(index, UOp) else UOp.const(int(index), dtypes.index)
    if u.dtype is None or not u.dtype.is_int:
        raise ArgumentTypeError(f"an index must be an integer UOp, got {u.dtype}")
    return u if u.dtype == dtypes.index else u.cast(dtypes.index)


def _stable_arg(arg: Any) -> Any:
    if isinstance(arg, enum.Enum):
        return f"{type(arg).__name__}.{arg.name}"
    if isinstance(arg, tuple):
        return tuple(_stable_arg(a) for a in arg)
    if isinstance(arg, float):
        return ("float", repr(arg))
    return arg


def iter_nodes(root: UOp, op: Ops) -> Iterator[UOp]:
    return (u for u in root.toposort() if u.op is op)


def params_of(root: UOp) -> list[UOp]:
    return sorted(iter_nodes(root, Ops.PARAM), key=lambda u: u.arg)


def variables_of(root: UOp) -> list[UOp]:
    return sorted(iter_nodes(root, Ops.DEFINE_VAR), key=lambda u: u.arg[0])


def toposort_outside(root: UOp, stop) -> list[UOp]:
    """The nodes reachable from `root` without passing through a member of `stop` (a set or dict of nodes),
    each after its sources: `UOp.toposort` with those nodes, and what only they reach, left out."""
    seen: set[UOp] = set()
    order: list[UOp] = []
    stack: list[tuple[UOp, bool]] = [(root, False)]
    pop, push, add, append = stack.pop, stack.append, seen.add, order.append
    while stack:
        node, done = pop()
        if done:
            append(node)
            continue
        if node in seen or node in stop:
            continue
        add(node)
        push((node, True))
        for s in reversed(node.src):
            if s not in seen and s not in stop:
                push((s, False))
    return order


_NOTHING: frozenset = frozenset()


def substitute(root: UOp, mapping: dict[UOp, UOp]) -> UOp:
    """Rebuild `root` with the nodes in `mapping` replaced (identity-keyed)."""
    memo: dict[UOp, UOp] = dict(mapping)
    if root in memo:
        return memo[root]
    get = memo.get
    # the nodes to rebuild, each after its sources: the mapped ones and what only they reach are left out
    for node in toposort_outside(root, mapping):
        src = node.src
        new_src = tuple([get(s, s) for s in src])
        memo[node] = UOp(node.op, node.dtype, new_src, node.arg) if any(map(is_not, new_src, src)) else node
    return memo[root]


def as_uops(xs: Iterable[Any]) -> tuple[UOp, ...]:
    return tuple(xs)


# ---- JSON (de)serialization: the disk cache stores launch information as UOp graphs --------------

UOPS_FORMAT = "morok-uops-2"


def _arg_to_json(arg: Any) -> Any:
    # exact types only: a subclass (np.float64, a str enum) is a different hash-consed node
    t = type(arg)
    if arg is None or t in (bool, int, str):
        return arg
    if t is float:
        return {"f": arg.hex()}     # exact, and covers inf, nan and -0.0
    if t is tuple:
        return [_arg_to_json(a) for a in arg]
    if t is Ops:
        return {"op": arg.name}
    if t is AxisType:
        return {"axis": arg.name}
    if t is DType:
        return {"dtype": arg.name}
    raise ArgumentTypeError(f"a UOp arg of type {t.__name__} ({arg!r}) has no JSON form")


_FROM_TAG = {"op": Ops.__members__, "axis": AxisType.__members__}


def _arg_from_json(x: Any) -> Any:
    t = type(x)
    if x is None or t is int or t is str or t is bool:
        return x
    if t is list:
        return tuple(_arg_from_json(a) for a in x)
    if t is dict and len(x) == 1:
        (tag, v), = x.items()
        if type(v) is str:
            if tag == "f":
                return float.fromhex(v)
            if tag == "dtype":
                return dtypes.from_name(v)
            members = _FROM_TAG.get(tag)
            if members is not None and v in members:
                return members[v]
    raise ArgumentError(f"bad UOp arg {x!r}")


def uops_to_json(roots: Iterable[UOp]) -> dict:
    """A JSON-able table of every node reachable from `roots`, each node once, sources before their
    users and named by their index in the table; `uops_from_json` rebuilds the same hash-consed nodes.

    The table is one flat list, a node after another as `op name, dtype name or None, number of
    sources, the sources' indices..., arg`: a cache hit parses it without a list per node."""
    index: dict[int, int] = {}
    nodes: list = []
    root_ids: list[int] = []
    for root in roots:
        if not isinstance(root, UOp):
            raise ArgumentTypeError(f"uops_to_json takes UOps, got {type(root).__name__}")
        for u in root.toposort():
            if id(u) not in index:
                index[id(u)] = len(index)
                nodes += [u.op.name, u.dtype.name if u.dtype is not None else None, len(u.src),
                          *(index[id(s)] for s in u.src), _arg_to_json(u.arg)]
        root_ids.append(index[id(root)])
    return {"format": UOPS_FORMAT, "nodes": nodes, "roots": root_ids}


def uops_from_json(d: Any) -> list[UOp]:
    """The roots of a `uops_to_json` table; ValueError for anything malformed or unknown."""
    if type(d) is not dict or d.get("format") != UOPS_FORMAT:
        raise ArgumentError(f"not a {UOPS_FORMAT} UOp table")
    nodes, roots = d.get("nodes"), d.get("roots")
    if type(nodes) is not list or type(roots) is not list:
        raise ArgumentError("a UOp table needs 'nodes' and 'roots' lists")
    ops, dts = Ops.__members__, _dtype_names()
    built: list[UOp] = []
    i, end = 0, len(nodes)
    while i < end:
        try:
            op, dt, n = ops[nodes[i]], nodes[i + 1], nodes[i + 2]
            dt = None if dt is None else dts[dt]
            if type(n) is not int or not 0 <= n <= end - i - 4:
                raise ValueError
            src = nodes[i + 3:i + 3 + n]
            for s in src:   # a source is always built before its users
                if type(s) is not int or not 0 <= s < len(built):
                    raise ValueError
            arg = _arg_from_json(nodes[i + 3 + n])
        except (ValueError, TypeError, KeyError, IndexError):
            raise ArgumentError(f"bad UOp table entry {len(built)} at position {i}") from None
        built.append(UOp(op, dt, tuple([built[s] for s in src]), arg))
        i += 4 + n
    if not all(type(r) is int and 0 <= r < len(built) for r in roots):
        raise ArgumentError(f"bad root indices {roots!r}")
    return [built[r] for r in roots]


def _dtype_names() -> dict[str, DType]:
    from .dtypes import BY_NAME
    return BY_NAME


# ---- math compositions (UOp.tanh, .erf, .pow, ...) ---------------------------------------------
# Built only from IR ops, so CPU, CUDA and ROCm renderers all get them. Polynomial coefficients are
# least-squares fits on Chebyshev nodes against 40-digit references (mpmath); the errors quoted are
# the fits' own, measured in float64 (float32 rounding adds ~1e-7 relative).


def _math_in(x: UOp) -> tuple[UOp, DType]:
    """(x in the float type the math runs in, the result dtype): half types and ints widen to float32."""
    dt = x.dtype
    if dt.is_float and dt.itemsize >= 4:
        return x, dt
    return x.cast(dtypes.float32), dt if dt.is_float else dtypes.float32


def _poly(x: UOp, coeffs: "tuple[float, ...]") -> UOp:
    """c0 + c1*x + c2*x**2 + ... by Horner."""
    p = UOp.const(coeffs[-1], x.dtype)
    for c in reversed(coeffs[:-1]):
        p = p * x + c
    return p


def _floor(x: UOp) -> UOp:
    if not x.dtype.is_float:
        return x
    t = x.trunc()       # exact; below zero trunc rounds up, step down once
    return (x < t).where(t - 1.0, t)


def _ceil(x: UOp) -> UOp:
    if not x.dtype.is_float:
        return x
    t = x.trunc()
    return (t < x).where(t + 1.0, t)


def _round_half_even(x: UOp) -> UOp:
    if not x.dtype.is_float:
        return x
    t = x.trunc()
    d = (x - t).abs()                       # exact: x and t share their exponent (or t is 0)
    half = t * 0.5
    odd = half.trunc() != half              # false for inf: an integer that large is even
    up = (d > 0.5) | ((d == 0.5) & odd)     # false for NaN and inf (d is NaN there)
    return up.where((x < 0.0).where(t - 1.0, t + 1.0), t)


# tanh(x) = x * (1 + z*(c1 + c2*z + ...)), z = x*x: Taylor coefficients
_TANH_TAYLOR = (1.0, -1 / 3, 2 / 15, -17 / 315, 62 / 2835, -1382 / 155925, 21844 / 6081075)


def _tanh(x: UOp) -> UOp:
    xc, out = _math_in(x)
    f64 = xc.dtype.name == "float64"
    # below the switch the series (truncation 5e-8 at 0.3 with 5 terms; 2e-17 at 0.1 with 7) beats
    # 1 - 2/(e^2a + 1), whose cancellation costs about eps / (2a) relative
    switch, terms = (0.1, 7) if f64 else (0.3, 5)
    a = xc.abs()
    series = xc * _poly(xc * xc, _TANH_TAYLOR[:terms])
    big = 1.0 - 2.0 / ((a * 2.0).exp() + 1.0)    # exp overflow -> inf -> exactly 1
    res = (a < switch).where(series, (xc < 0.0).where(-big, big))
    return res.cast(out)


def _log1p(x: UOp) -> UOp:
    """log(1 + x) without the rounding of 1 + x: a series below |x| = 0.01 (8 terms, truncation
    1.2e-17 relative), above it log(w) * x / (w - 1) with w = 1 + x (Goldberg's correction)."""
    xc, out = _math_in(x)
    series = xc * _poly(xc, tuple((-1.0) ** k / (k + 1) for k in range(8)))
    w = xc + 1.0
    d = w - 1.0
    ratio = (d == xc).where(1.0, xc / d)          # also keeps log1p(inf) = inf
    return (xc.abs() < 0.01).where(series, w.log() * ratio).cast(out)


def _sigmoid(x: UOp) -> UOp:
    xc, out = _math_in(x)
    return (1.0 / ((-xc).exp() + 1.0)).cast(out)     # exp(-x) = inf for x << 0 gives 0, never NaN


# erf(x) / x as a polynomial in x*x on |x| < 1: degree 6 (fit error 1.4e-9), degree 10 (6e-16)
_ERF_SMALL_F32 = (1.1283791658815026, -0.3761262690358044, 0.11283597463488053, -0.026854328796067244,
                  0.005189311942686617, -0.0008018854992786387, 7.882497110086663e-05)
_ERF_SMALL_F64 = (1.1283791670955121, -0.37612638903174545, 0.11283791670585167, -0.026866170587102625,
                  0.0052239771580349795, -0.0008548305018244803, 0.00012054685242167439,
                  -1.4913347600220913e-05, 1.6310752968714664e-06, -1.5190145066332113e-07,
                  9.432321288548624e-09)
# erfc(x) * exp(x*x) as a polynomial in 1/x on [1, 4] (float32: erf rounds to 1 beyond) and [1, 6]
# (float64), fitted for absolute error of erfc: 5e-9 and 1.7e-15
_ERF_LARGE_F32 = (-0.0016291630327307921, 0.5775986388100108, -0.03296978160617251, -0.3117650827011527,
                  0.310490466113024, -0.13973773386413868, 0.025596243848975252)
_ERF_LARGE_F64 = (-4.036289671338892e-05, 0.5652375771161967, -0.012526612348092468, -0.19116068049481869,
                  -0.44369434240823435, 1.9339126344747117, -3.559265513070711, 4.303154390954974,
                  -3.727996859967116, 2.343980117268935, -1.0415187605246592, 0.3035512005616398,
                  -0.047561952911086405, 0.000920464443111848, 0.0005922759576717842)


def _erf(x: UOp) -> UOp:
    xc, out = _math_in(x)
    f64 = xc.dtype.name == "float64"
    small = xc * _poly(xc * xc, _ERF_SMALL_F64 if f64 else _ERF_SMALL_F32)
    a = xc.abs().minimum(6.0 if f64 else 4.0)       # erf is exactly 1 beyond; inf -> 1, NaN stays
    large = 1.0 - (-(a * a)).exp() * _poly(1.0 / a, _ERF_LARGE_F64 if f64 else _ERF_LARGE_F32)
    res = (a < 1.0).where(small, (xc < 0.0).where(-large, large))
    return res.cast(out)


_SIGNED_OF_SIZE = {2: dtypes.int16, 4: dtypes.int32, 8: dtypes.int64}


def _signbit(x: UOp) -> UOp:
    return x.bitcast(_SIGNED_OF_SIZE[x.dtype.itemsize]) < 0


def _pow_int(x: UOp, n: int) -> UOp:
    """x ** n for a small integer constant: square and multiply (error about |n| * eps / 2)."""
    acc: UOp | None = None
    base, k = x, abs(n)
    while k:
        if k & 1:
            acc = base if acc is None else acc * base
        k >>= 1
        if k:
            base = base * base
    assert acc is not None
    return 1.0 / acc if n < 0 else acc


def _pow(x: UOp, y: "UOp | ConstLike") -> UOp:
    out = x.dtype if x.dtype.is_float else dtypes.float32
    # half types compute in float32; float32 in float64: y * log2|x| reaches 128 where float32's
    # product alone would cost 128 * ln2 * 2**-24 ~ 5e-6 relative
    cdt = dtypes.float32 if out.itemsize < 4 else dtypes.float64
    if not isinstance(y, UOp):
        if isinstance(y, bool) or not isinstance(y, (int, float)):
            raise ArgumentTypeError(f"pow exponent must be a UOp or a number, got {y!r}")
        if y == 0:    # 1 everywhere, NaN included; still a function of x so the kernel keeps its input
            return x.isnan().where(1.0, 1.0).cast(out) if x.dtype.is_float else x.cast(out).isnan().where(1.0, 1.0)
        if float(y).is_integer() and abs(y) <= 16:
            xs = x.cast(dtypes.float32) if out.itemsize < 4 else x.cast(out)
            return _pow_int(xs, int(y)).cast(out)
        if y == 0.5:
            xs = x.cast(dtypes.float32) if out.itemsize < 4 else x.cast(out)
            r = (xs == -math.inf).where(math.inf, xs.sqrt())
            return (xs == 0.0).where(0.0, r).cast(out)       # pow(-0, 0.5) is +0, sqrt(-0) is -0
    xc = x.cast(cdt)
    if isinstance(y, UOp) and not y.dtype.is_float:
        yi = y.cast(dtypes.int32) if y.dtype.is_bool else y
        yc = yi.cast(cdt)
        odd = (yi & 1) != 0
        non_int = None
    else:
        if isinstance(y, UOp):
            yc = y.cast(cdt)
            half = yc * 0.5
            non_int = yc.trunc() != yc                      # NaN counts as non-integer, inf does not
            odd = non_int.logical_not() & (half.trunc() != half)    # false for inf
        else:
            yc = UOp.const(float(y), cdt)
            fy = float(y)
            is_int = math.isinf(fy) or fy.is_integer()
            odd = UOp.const(is_int and not math.isinf(fy) and int(fy) % 2 == 1)
            non_int = None if is_int else UOp.const(True)
    mag = (yc * xc.abs().log2()).exp2()
    res = (_signbit(xc) & odd).where(-mag, mag)
    if non_int is not None:    # a finite negative base with a non-integer exponent
        res = ((xc < 0.0) & (xc != -math.inf) & non_int).where(math.nan, res)
    # 0 * inf and inf * 0 in the exponent: pow(x, 0) = pow(1, y) = pow(-1, +-inf) = 1
    one = (yc == 0.0) | (xc == 1.0) | ((xc == -1.0) & yc.isinf())
    return one.where(1.0, res).cast(out)


# ---- storage-only formats: float8 / float4 / int4 / int2 conversions -----------------------------
# Composed from integer ops on the IEEE bits (BITCAST, shifts, masks, WHERE), so every renderer
# prints them without knowing the formats; the formats themselves are data (dtypes.FLOAT_FORMATS).

def _narrow_cast(x: UOp, dt: DType, saturate: bool, round_mode: str) -> UOp:
    src = x.dtype
    if src.storage_only and src.is_float:
        return _decode_float(x).cast(dt, saturate, round_mode)
    if src.storage_only:        # int4/int2: the value's low bits in a byte, as ml_dtypes holds them
        b = x.bitcast(dtypes.uint8).cast(dtypes.int32) & ((1 << src.narrow) - 1)
        if not src.is_unsigned:
            half = 1 << (src.narrow - 1)
            b = (b ^ half) - half
        return b.cast(dt, saturate, round_mode)
    if dt.is_float:
        if dt.name == "float8_e8m0fnu":            # ONNX defines it on the float32 bits
            return _encode_e8m0(x.cast(dtypes.float32), saturate, round_mode)
        wide = src == dtypes.float64 or (src.is_int and src.itemsize >= 4)
        # a NaN's sign from the source's own bits: GPUs' half -> float conversion makes NaNs canonical
        sign = (x.bitcast(dtypes.uint16) >> 15).cast(dtypes.int32) if src.is_float and src.itemsize == 2 else None
        return _encode_float(x.cast(dtypes.float64 if wide else dtypes.float32), dt, saturate, sign)
    # narrow integers: C semantics, the value's low bits
    v = x if src.is_int else x.cast(dtypes.int32)
    return (v & ((1 << dt.narrow) - 1)).cast(dtypes.uint8).bitcast(dt)


def _encode_float(x: UOp, dt: DType, saturate: bool, sign: UOp | None = None) -> UOp:
    """float32/float64 -> the narrow float `dt`, rounded to nearest even (see UOp.cast); `sign`
    (0/1, int32) overrides x's sign bit."""
    f = FLOAT_FORMATS[dt.name]
    wide = x.dtype == dtypes.float64
    ut, it = (dtypes.uint64, dtypes.int64) if wide else (dtypes.uint32, dtypes.int32)
    w, ms, bs = (64, 52, 1023) if wide else (32, 23, 127)
    u = x.bitcast(ut)
    if sign is None:
        sign = (u >> (w - 1)).cast(dtypes.int32)
    a = u & ((1 << (w - 1)) - 1)
    inf_bits = ((1 << (w - 1 - ms)) - 1) << ms
    is_nan, is_inf = a > inf_bits, a == inf_bits
    e_src = (a >> ms).cast(dtypes.int32)
    man = (a & ((1 << ms) - 1)).cast(it)
    normal = e_src != 0
    sig = normal.where(man | (1 << ms), man)                   # with the implicit bit
    e = normal.where(e_src, 1) - bs                              # unbiased exponent
    below = ((1 - f.bias) - e).maximum(0)                        # a target subnormal shifts further
    shift = (below + (ms - f.man)).minimum(ms + 2).cast(it)     # beyond ms+1 everything rounds to 0
    one = UOp.const(1, it)
    q = sig >> shift
    rem = sig & ((one << shift) - 1)
    halfway = one << (shift - 1)
    up = (rem > halfway) | ((rem == halfway) & ((q & 1) == 1))
    q = (q + up.cast(it)).cast(dtypes.int32)
    code = ((e + (f.bias - 1)).maximum(0) << f.man) + q        # a carry out of q moves the exponent up
    over = is_inf | (code > f.max_code)
    if saturate or (f.nan is None and f.inf is None):
        over_code = f.max_code
    else:
        over_code = f.inf if f.inf is not None else f.nan
    mag = over.where(UOp.const(over_code, dtypes.int32), code)
    sbit = 1 << (dt.narrow - 1)
    out = (sign * sbit) | mag
    if f.nan is None:                    # float4 has no NaN: ml_dtypes gives the zero of the other sign
        out = is_nan.where((1 - sign) * sbit, out)
    else:
        nan = UOp.const(f.nan, dtypes.int32)
        out = is_nan.where((sign * sbit) | nan if f.signed_nan else nan, out)
        if not f.signed_nan:                                     # fnuz: the sign bit alone is NaN
            out = (mag == f.nan).where(nan, out)
    if f.unsigned_zero:
        out = (mag == 0).where(UOp.const(0, dtypes.int32), out)
    return out.cast(dtypes.uint8).bitcast(dt)


def _encode_e8m0(x: UOp, saturate: bool, round_mode: str) -> UOp:
    """float32 -> float8_e8m0fnu (2**(e-127), 0xFF NaN), ONNX's definition: the float32 exponent,
    rounded by the mantissa per `round_mode`; NaN and infinity become 0xFF; the sign is ignored."""
    u = x.bitcast(dtypes.uint32)
    e = ((u >> 23) & 0xFF).cast(dtypes.int32)
    man = u & 0x7FFFFF
    if round_mode != "down":
        if round_mode == "up":
            up = (man != 0) & (e != 0xFF)
        else:   # nearest, ties up (except below the smallest normal float32 exponent)
            up = ((man & 0x400000) != 0) & (((man & 0x3FFFFF) != 0) | (e > 0)) & (e != 0xFF)
        if saturate:
            up = up & (e != 0xFE)
        e = e + up.cast(dtypes.int32)
    return e.cast(dtypes.uint8).bitcast(dtypes.float8_e8m0fnu)


def _decode_float(x: UOp) -> UOp:
    """A narrow float -> float32, exactly."""
    f = FLOAT_FORMATS[x.dtype.name]
    c = x.bitcast(dtypes.uint8).cast(dtypes.uint32)
    if not f.has_sign:                                           # e8m0: 2**(c-127); 0 is 2**-127
        bits = (c == 0).where(UOp.const(1 << 22, dtypes.uint32), c << 23)
        bits = (c == 0xFF).where(UOp.const(0x7FC00000, dtypes.uint32), bits)
        return bits.bitcast(dtypes.float32)
    sbit = x.dtype.narrow - 1
    sign = (c >> sbit) << 31
    mag = c & ((1 << sbit) - 1)
    e = mag >> f.man
    m = mag & ((1 << f.man) - 1)
    normal_bits = ((e + (127 - f.bias)) << 23) | (m << (23 - f.man))
    sub = (m.cast(dtypes.float32) * (2.0 ** (1 - f.bias - f.man))).bitcast(dtypes.uint32)
    bits = (e == 0).where(sub, normal_bits) | sign
    if f.inf is not None:                                        # e5m2: IEEE infinities and NaNs
        bits = (mag == f.inf).where(sign | 0x7F800000, bits)
        bits = (mag > f.inf).where(sign | 0x7FC00000, bits)
    elif f.nan is not None and f.signed_nan:
        bits = (mag == f.nan).where(sign | 0x7FC00000, bits)
    elif f.nan is not None:
        bits = (c == f.nan).where(UOp.const(0x7FC00000, dtypes.uint32), bits)
    return bits.bitcast(dtypes.float32)
