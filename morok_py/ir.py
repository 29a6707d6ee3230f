"""The kernel IR: immutable, hash-consed UOps.

Building the same structure twice gives the same object, and `uop.key` is a digest that
is identical in every process, so it can key the method and disk caches.
"""
from __future__ import annotations

import enum
import hashlib
import math
import threading
import weakref
from functools import cached_property
from typing import Any, Iterable, Iterator, Union

from .dtypes import DType, dtypes, as_dtype


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
    SHR = enum.auto()
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
                    Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE, Ops.AND, Ops.OR, Ops.XOR, Ops.SHL, Ops.SHR})
COMPARE = frozenset({Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE})
ALU = UNARY | BINARY | {Ops.WHERE, Ops.CAST, Ops.BITCAST}
REDUCE_OPS = (Ops.ADD, Ops.MUL, Ops.MAX)

ConstLike = Union[int, float, bool]


def _normalize_const(value: Any, dtype: DType) -> ConstLike:
    if isinstance(value, UOp):
        raise TypeError("UOp.const takes a Python number, not a UOp")
    if dtype.is_bool:
        return bool(value)
    if dtype.is_int:
        if isinstance(value, float) and not value.is_integer():
            raise TypeError(f"constant {value!r} is not an integer but the dtype is {dtype.name}")
        v = int(value)
        if not dtype.min() <= v <= dtype.max():
            raise ValueError(f"constant {v} does not fit {dtype.name} [{dtype.min()}, {dtype.max()}]")
        return v
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


class UOp:
    """One node of a kernel graph. Create with the constructors, never directly."""

    __slots__ = ("op", "dtype", "src", "arg", "__weakref__", "__dict__")

    op: Ops
    dtype: DType | None
    src: tuple["UOp", ...]
    arg: Any

    def __new__(cls, op: Ops, dtype: DType | None, src: tuple["UOp", ...] = (), arg: Any = None) -> "UOp":
        key = (op, dtype, tuple(id(s) for s in src), _arg_key(arg))
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
        raise TypeError("a UOp has no truth value; use .where() or compare in the kernel")

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
        seen: set[int] = set()
        order: list[UOp] = []
        stack: list[tuple[UOp, bool]] = [(self, False)]
        while stack:
            node, done = stack.pop()
            if done:
                order.append(node)
                continue
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.append((node, True))
            for s in reversed(node.src):
                if id(s) not in seen:
                    stack.append((s, False))
        return order

    # ---- constructors ---------------------------------------------------------------------
    @staticmethod
    def param(slot: int, dtype: Any) -> "UOp":
        """Buffer argument number `slot` holding elements of `dtype`."""
        if not isinstance(slot, int) or slot < 0:
            raise ValueError(f"param slot must be a non-negative int, got {slot!r}")
        return UOp(Ops.PARAM, as_dtype(dtype), (), slot)

    @staticmethod
    def variable(name: str, min: int, max: int) -> "UOp":
        """A symbolic integer, bound at launch time to a value in [min, max]."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"variable name must be an identifier, got {name!r}")
        if not (isinstance(min, int) and isinstance(max, int)) or min > max:
            raise ValueError(f"variable {name}: need int bounds with min <= max, got [{min}, {max}]")
        lo, hi = dtypes.index.min(), dtypes.index.max()
        if min < lo or max > hi:
            raise ValueError(f"variable {name}: bounds [{min}, {max}] exceed the index type {dtypes.index.name}")
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
            raise TypeError(f"range kind must be an AxisType, got {kind!r}")
        end_u = end if isinstance(end, UOp) else UOp.const(int(end), dtypes.index)
        if end_u.dtype != dtypes.index:
            raise TypeError(f"range end must be {dtypes.index.name}, got {end_u.dtype}")
        if end_u.op is Ops.CONST and end_u.arg < 0:
            raise ValueError(f"range end must be >= 0, got {end_u.arg}")
        return UOp(Ops.RANGE, dtypes.index, (end_u,), (int(axis), kind))

    @staticmethod
    def sink(*stores: "UOp") -> "UOp":
        """The kernel root: every STORE the kernel performs."""
        flat: list[UOp] = []
        for s in stores:
            flat.extend(s if isinstance(s, (list, tuple)) else [s])
        if not flat:
            raise ValueError("a kernel needs at least one store")
        for s in flat:
            if not isinstance(s, UOp) or s.op is not Ops.STORE:
                raise TypeError(f"UOp.sink takes STOREs, got {s!r}")
        return UOp(Ops.SINK, None, tuple(flat), None)

    # ---- memory ---------------------------------------------------------------------------
    def load(self, index: "UOp | int") -> "UOp":
        if self.op is not Ops.PARAM:
            raise TypeError("load() is called on a buffer (UOp.param)")
        return UOp(Ops.LOAD, self.dtype, (self, _as_index(index)), None)

    def store(self, index: "UOp | int", value: "UOp | ConstLike") -> "UOp":
        if self.op is not Ops.PARAM:
            raise TypeError("store() is called on a buffer (UOp.param)")
        v = value if isinstance(value, UOp) else UOp.const(value, self.dtype)
        if v.dtype != self.dtype:
            raise TypeError(f"storing {v.dtype} into a {self.dtype} buffer; cast it first")
        return UOp(Ops.STORE, None, (self, _as_index(index), v), None)

    def reduce(self, *ranges: "UOp", op: Ops = Ops.ADD) -> "UOp":
        """Reduce this value over `ranges` (REDUCE ranges) with ADD, MUL or MAX."""
        if op not in REDUCE_OPS:
            raise ValueError(f"reduce op must be one of {[o.name for o in REDUCE_OPS]}, got {op!r}")
        if not ranges:
            raise ValueError("reduce needs at least one range")
        for r in ranges:
            if not isinstance(r, UOp) or r.op is not Ops.RANGE:
                raise TypeError(f"reduce takes RANGE UOps, got {r!r}")
            if r.arg[1] is not AxisType.REDUCE:
                raise ValueError(f"range of axis {r.arg[0]} is {r.arg[1].name}; reduce needs AxisType.REDUCE ranges")
        return UOp(Ops.REDUCE, self.dtype, (self, *ranges), op)

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

    @cached_property
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
                raise TypeError(f"where() condition must be bool, got {cond.dtype}")
            a, b = _promote(a, b)
            return UOp(Ops.WHERE, a.dtype, (cond, a, b), None)
        srcs = [self] + [o if isinstance(o, UOp) else UOp.const(o, self._const_dtype(o)) for o in others]
        if op in BINARY:
            a, b = srcs
            if op in (Ops.SHL, Ops.SHR):
                if not a.dtype.is_int:
                    raise TypeError(f"{op.name} needs integers, got {a.dtype}")
                b = b if b.dtype == a.dtype else b.cast(a.dtype)
            else:
                a, b = _promote(a, b)
            if op in (Ops.AND, Ops.OR, Ops.XOR) and a.dtype.is_float:
                raise TypeError(f"{op.name} needs integers or bools, got {a.dtype}")
            if op in (Ops.IDIV, Ops.MOD) and not a.dtype.is_int:
                raise TypeError(f"{op.name} needs integers, got {a.dtype}; use / for floats")
            if op is Ops.FDIV and not a.dtype.is_float:
                raise TypeError(f"FDIV needs floats, got {a.dtype}")
            dt = dtypes.bool if op in COMPARE else a.dtype
            return UOp(op, dt, (a, b), None)
        if op in UNARY:
            if op in (Ops.EXP2, Ops.LOG2, Ops.SQRT, Ops.SIN, Ops.RECIP, Ops.TRUNC) and not self.dtype.is_float:
                raise TypeError(f"{op.name} needs a float, got {self.dtype}")
            if op is Ops.NOT and not (self.dtype.is_int or self.dtype.is_bool):
                raise TypeError(f"NOT needs an integer or bool, got {self.dtype}")
            return UOp(op, self.dtype, (self,), None)
        raise ValueError(f"{op!r} is not an ALU op")

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
            raise TypeError("logical_not needs a bool")
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

    def cast(self, dtype: Any) -> "UOp":
        dt = as_dtype(dtype)
        if dt == self.dtype:
            return self
        return UOp(Ops.CAST, dt, (self,), None)

    def bitcast(self, dtype: Any) -> "UOp":
        dt = as_dtype(dtype)
        if dt.itemsize != self.dtype.itemsize or dt.is_bool or self.dtype.is_bool:
            raise TypeError(f"bitcast needs types of the same size, got {self.dtype} -> {dt}")
        return UOp(Ops.BITCAST, dt, (self,), None)


def _lift(value: Any, like: UOp) -> UOp:
    return value if isinstance(value, UOp) else UOp.const(value, like._const_dtype(value))


_RANK = {"b": 0, "u": 1, "i": 2, "f": 3}


def _promote(a: UOp, b: UOp) -> tuple[UOp, UOp]:
    """Implicit promotion: bool < ints < floats, then the wider type; consts adopt the other side."""
    if a.dtype == b.dtype:
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
        raise TypeError(f"an index must be an integer UOp, got {u.dtype}")
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


def substitute(root: UOp, mapping: dict[UOp, UOp]) -> UOp:
    """Rebuild `root` with the nodes in `mapping` replaced (identity-keyed)."""
    memo: dict[int, UOp] = {id(k): v for k, v in mapping.items()}
    for node in root.toposort():
        if id(node) in memo:
            continue
        new_src = tuple(memo.get(id(s), s) for s in node.src)
        memo[id(node)] = node if all(a is b for a, b in zip(new_src, node.src)) else UOp(node.op, node.dtype, new_src, node.arg)
    return memo[id(root)]


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
    raise TypeError(f"a UOp arg of type {t.__name__} ({arg!r}) has no JSON form")


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
    raise ValueError(f"bad UOp arg {x!r}")


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
            raise TypeError(f"uops_to_json takes UOps, got {type(root).__name__}")
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
        raise ValueError(f"not a {UOPS_FORMAT} UOp table")
    nodes, roots = d.get("nodes"), d.get("roots")
    if type(nodes) is not list or type(roots) is not list:
        raise ValueError("a UOp table needs 'nodes' and 'roots' lists")
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
            raise ValueError(f"bad UOp table entry {len(built)} at position {i}") from None
        built.append(UOp(op, dt, tuple([built[s] for s in src]), arg))
        i += 4 + n
    if not all(type(r) is int and 0 <= r < len(built) for r in roots):
        raise ValueError(f"bad root indices {roots!r}")
    return [built[r] for r in roots]


def _dtype_names() -> dict[str, DType]:
    from .dtypes import BY_NAME
    return BY_NAME
