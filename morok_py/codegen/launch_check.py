"""What a launch must check before the kernel runs: the buffers' index ranges, loop counters and launch
sizes for concrete variable values (LaunchInfo), from the accesses the lowering recorded."""
from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

from ..dtypes import DType, dtypes
from ..errors import LaunchError
from ..ir import Ops, UOp
from .linear import ParamInfo
from .symbolic import evaluate, interval_of, narrowed_interval


@dataclass(frozen=True)
class Variable:
    """A symbolic integer bound at launch time to a value in [min, max]."""

    name: str
    min: int
    max: int


@dataclass(frozen=True)
class HiddenBuffer:
    """A buffer the kernel needs but the caller never sees (e.g. the partials of a two-stage
    reduction). The runtime allocates it once per loaded program, zero-filled, and passes it after
    the caller's buffers; the kernel leaves it in the state it found it where that matters."""

    dtype: DType
    count: int


@dataclass(frozen=True)
class Access:
    slot: int
    store: bool
    index: UOp
    enclosing: tuple[UOp, ...]  # the ranges the access is nested in
    lanes: int = 1              # the accesses of the kernel this check stands for (merge_accesses)


@dataclass(frozen=True)
class SteppedLoop:
    """A loop `for (i = start; i < end; i += step)` of the kernel (32-bit index type) whose step may be
    more than 1, for the launch check: the counter's last `i += step` must not pass the type's maximum
    (with `add nsw` / C `int` the overflow is undefined: in practice an endless or out-of-bounds loop).

    `start` None: the work-items start at every value in [0, step) (group- and grid-strided loops), so
    one of them runs i = end - 1 and its last step computes end - 1 + step. A UOp: every work-item
    starts there, and the last step computes start + ceil((end - start) / step) * step. A loop with no
    iteration (end <= start) steps never. `end` and `step` are expressions of the variables, evaluated
    as the kernel computes them."""

    end: UOp
    step: UOp
    start: UOp | None = None

    def peak(self, values: Mapping[str, int]) -> int | None:
        """The largest value the counter takes (its last step) for these values; None: no iteration."""
        end, step = evaluate(self.end, values), evaluate(self.step, values)
        if step < 1:
            raise LaunchError(f"a loop up to {_describe(self.end, values)} steps by {step}: it would never end")
        if self.start is None:
            return end - 1 + step if end > 0 else None
        start = evaluate(self.start, values)
        return start + -(-(end - start) // step) * step if end > start else None


def _describe(size: UOp, values: Mapping[str, int]) -> str:
    """A size expression for an error message: 'n*m = 4294967296 (n=65536, m=65536)'."""
    def text(u: UOp) -> str:
        if u.op is Ops.CONST:
            return str(u.arg)
        if u.op is Ops.DEFINE_VAR:
            return u.arg[0]
        infix = {Ops.ADD: "+", Ops.SUB: "-", Ops.MUL: "*", Ops.IDIV: "//", Ops.MOD: "%"}
        if u.op in infix and len(u.src) == 2:
            return f"({text(u.src[0])}{infix[u.op]}{text(u.src[1])})"
        return f"{u.op.name.lower()}({', '.join(text(x) for x in u.src)})"
    t = text(size)
    if size.op is Ops.CONST:
        return t
    t = t[1:-1] if t.startswith("(") and t.endswith(")") else t
    names = sorted({u.arg[0] for u in size.toposort() if u.op is Ops.DEFINE_VAR})
    given = "" if size.op is Ops.DEFINE_VAR else f" ({', '.join(f'{n}={values[n]}' for n in names)})"
    return f"{t} = {evaluate(size, values)}{given}"


def _nonnegative(u: UOp) -> bool:
    """Whether a node is >= 0 for every value of the variables, known without evaluating anything."""
    return u.op is Ops.RANGE or (u.op is Ops.DEFINE_VAR and u.arg[1] >= 0)


_Split = tuple[Any, tuple[int, ...]]      # (shape, constants): what _offset_split gives


def _offset_split(index: UOp, memo: dict[UOp, _Split] | None = None) -> _Split:
    """(shape, cs): `index` as a shape plus the integer constants cs at its leaves that are reached
    from the root through nodes whose interval bounds are each monotone in every such constant: ADD,
    MIN, MAX, and MUL by a constant or by a node known >= 0 (a range, a size variable). The shape
    names every other node by identity (UOps are hash-consed) and an op by its name, so indices of one
    shape differ in those constants only. (The node, ()) when there is no such leaf. `memo` (node -> its
    split; the keys keep the nodes their ids name alive) shares the splits of common subtrees between
    calls."""
    if memo is None:
        memo = {}
    hit = memo.get(index)
    if hit is not None:
        return hit
    out = memo[index] = _split_node(index, memo)
    return out


def _split_node(index: UOp, memo: dict[UOp, _Split]) -> _Split:
    op = index.op
    if op is Ops.CONST and index.dtype.is_int:
        return ("const", index.dtype), (index.arg,)
    if op is Ops.MUL and len(index.src) == 2:
        a, b = index.src
        for i, (u, other) in enumerate(((a, b), (b, a))):
            if other.op is Ops.CONST or _nonnegative(other):
                ku, cu = _offset_split(u, memo)
                if cu:
                    return (op._name_, index.dtype, i, ku, id(other)), cu
        return id(index), ()
    if op in (Ops.ADD, Ops.MIN, Ops.MAX) and len(index.src) == 2:
        (ka, ca), (kb, cb) = _offset_split(index.src[0], memo), _offset_split(index.src[1], memo)
        if ca or cb:
            return (op._name_, index.dtype, ka, kb), ca + cb
    return id(index), ()


def merge_accesses(accesses: Sequence[Access]) -> list[Access]:
    """The accesses the launch check must evaluate. Accesses of one buffer, in the same loops, whose
    indices have one shape and differ only in its constants (`_offset_split`: the lanes of a
    register tile, rows x columns, hundreds in a tiled matmul) and whose constants form a full grid
    keep the corners of that grid: every node's interval bounds are monotone in each constant, so
    over a grid they are extreme at its corners, intermediate overflow included. Any other group is
    kept whole. Order of first appearance is kept; every access stays counted in `lanes` (the CPU
    runtime weighs a launch by its accesses)."""
    groups: dict[Any, list[tuple[tuple[int, ...], Access]]] = {}
    memo: dict[UOp, _Split] = {}
    for a in accesses:
        shape, cs = _offset_split(a.index, memo)
        key = (a.slot, a.store, tuple(id(r) for r in a.enclosing), shape if cs else id(a.index))
        groups.setdefault(key, []).append((cs, a))
    out: list[Access] = []
    for members in groups.values():
        if len(members) <= 2:
            out += [a for _, a in members]
            continue
        points = {cs: a for cs, a in members}
        axes = [sorted({cs[d] for cs in points}) for d in range(len(members[0][0]))]
        if math.prod(len(v) for v in axes) != len(points):   # not a full grid: keep every access
            out += [a for _, a in members]
            continue
        corners: list[Access] = []
        for corner in itertools.product(*[(v[0], v[-1]) if len(v) > 1 else (v[0],) for v in axes]):
            if all(points[corner] is not a for a in corners):
                corners.append(points[corner])
        kept = sum(a.lanes for a in corners[1:])
        total = sum(a.lanes for _, a in members)
        out.append(replace(corners[0], lanes=total - kept))
        out += corners[1:]
    return out



class LaunchInfo:
    """Everything a launch needs beyond the binary: launch sizes and bounds checks per values."""

    def __init__(self, params: list[ParamInfo], variables: list[Variable], dims: list[UOp],
                 local_size: tuple[int, int, int], gpu: bool, accesses: list[Access],
                 range_ends: list[UOp], grid_max: tuple[int, int, int], group_per_item: bool = False,
                 hidden: Sequence[HiddenBuffer] = (), merged: bool = False,
                 stepped_loops: Sequence[SteppedLoop] = ()) -> None:
        self.group_per_item = group_per_item
        self.hidden = tuple(hidden)     # kernel params after the caller's buffers (slots buf_count...)
        self.params = params
        self.variables = variables
        self.var_names = [v.name for v in variables]
        self.dims = dims
        self.local_size = local_size
        self.gpu = gpu
        self.accesses = list(accesses) if merged else merge_accesses(accesses)   # merged: read back
        self.range_ends = range_ends
        self.stepped_loops = tuple(stepped_loops)   # every loop of the kernel with a step (see prepare)
        self.grid_max = grid_max
        self.buf_count = len(params)
        self._cache: dict[tuple, tuple] = {}
        self._has_where: dict[int, bool] = {}     # id(access index) -> whether a WHERE may narrow it
        self._lock = threading.Lock()
        self.symbolic = bool(variables)

    # -- values -------------------------------------------------------------------------------
    def values_from(self, vals: Sequence[int] | Mapping[str, int]) -> dict[str, int]:
        if isinstance(vals, Mapping):
            unknown = set(vals) - set(self.var_names)
            if unknown:
                raise LaunchError(f"unknown variable(s) {sorted(unknown)}; this kernel takes {self.var_names}")
            missing = [n for n in self.var_names if n not in vals]
            if missing:
                raise LaunchError(f"missing value(s) for variable(s) {missing}")
            out = {n: vals[n] for n in self.var_names}
        else:
            if len(vals) != len(self.var_names):
                raise LaunchError(f"expected {len(self.var_names)} variable value(s) for {self.var_names}, got {len(vals)}")
            out = dict(zip(self.var_names, vals))
        for v in self.variables:
            x = out[v.name]
            if isinstance(x, bool) or not isinstance(x, int):
                try:
                    import numpy as np
                    if isinstance(x, np.integer):
                        out[v.name] = x = int(x)
                    else:
                        raise TypeError
                except TypeError:
                    raise LaunchError(f"variable {v.name} must be an int, got {type(x).__name__}") from None
            if not v.min <= x <= v.max:
                raise LaunchError(f"variable {v.name}={x} is outside its range [{v.min}, {v.max}]")
        return out

    # -- launch sizes and bounds, cached per values -------------------------------------------
    def prepare(self, values: Mapping[str, int]) -> tuple:
        """(global_size, local_size, bounds) for these values; raises LaunchError on overflow."""
        key = tuple(values[n] for n in self.var_names)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        ends = {}
        def range_end(r: UOp) -> int:
            e = ends.get(id(r))
            if e is None:
                e = ends[id(r)] = evaluate(r.src[0], values)
            return e
        extents = [evaluate(d, values) for d in self.dims]
        if self.gpu:
            gs = [1, 1, 1]
            for i, e in enumerate(extents):
                gs[i] = max(1, e if self.group_per_item else -(-max(e, 0) // self.local_size[i]))
                if gs[i] > self.grid_max[i]:
                    raise LaunchError(f"launch needs {gs[i]} groups in dimension {i}, over the device limit {self.grid_max[i]}")
            if any(e <= 0 for e in extents):
                gs = [0, 0, 0]
            global_size, local_size = tuple(gs), self.local_size
        else:
            global_size, local_size = (max(0, extents[0]) if extents else 1, 1, 1), (1, 1, 1)
        bounds = tuple(self._bounds(a, values, range_end) for a in self.accesses)
        # 32-bit loop counters never wrap. The kernel computes every range end in the index type, so
        # each node of each end must fit it (an end no checked index uses is not seen by _bounds). A
        # loop stepping by 1 is then safe: its body runs with i < end <= the type's maximum, so i + 1
        # cannot wrap. A loop stepping by more can: its last step must stay within the type too.
        hi = dtypes.index.max()
        work = 1
        for r in self.range_ends:
            _checked_intervals(r, values, range_end, lambda: f"the loop end {_describe(r, values)}")
            work *= max(1, evaluate(r, values))
        for lp in self.stepped_loops:
            peak = lp.peak(values)
            if peak is not None and peak > hi:
                raise LaunchError(f"the loop up to {_describe(lp.end, values)} in steps of {evaluate(lp.step, values)}: "
                                  f"the end plus the loop step passes the 32-bit counter limit {hi} (its last step "
                                  f"reaches {peak}); use smaller sizes")
        out = (global_size, local_size, bounds, work)
        with self._lock:
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = out
        return out

    def _bounds(self, a: Access, values: Mapping[str, int], range_end) -> tuple[int, bool, int, int] | None:
        for r in a.enclosing:
            if range_end(r) <= 0:
                return None  # the access sits in a loop with no iterations
        memo: dict[int, tuple] = {}
        lo, hi = _checked_intervals(a.index, values, range_end, lambda: (
            f"index arithmetic of the {'store to' if a.store else 'load from'} buffer {a.slot}"), memo)
        has_where = self._has_where.get(id(a.index))
        if has_where is None:
            has_where = self._has_where[id(a.index)] = any(n.op is Ops.WHERE for n in a.index.toposort())
        if has_where:
            lo, hi = narrowed_interval(a.index, memo, values, range_end)
        return (a.slot, a.store, lo, hi)

    def check_sizes(self, bounds, sizes: Sequence[int]) -> None:
        for b in bounds:
            if b is None:
                continue
            slot, store, lo, hi = b
            if lo < 0 or hi >= sizes[slot]:
                what = "store to" if store else "load from"
                raise LaunchError(f"{what} buffer {slot} may touch indices [{lo}, {hi}] but the buffer holds "
                                  f"{sizes[slot]} element(s)")

    def launch_dims(self, values: Mapping[str, int] | Sequence[int] | None = None):
        vals = self.values_from(values if values is not None else {})
        gs, ls, _, _ = self.prepare(vals)
        return gs, ls


def _checked_intervals(root: UOp, values: Mapping[str, int], range_end: Callable[[UOp], int],
                       what: Callable[[], str], memo: dict[int, tuple] | None = None) -> tuple:
    """The interval of `root` for these values; LaunchError (naming `what`) when a node of index type
    leaves the type. Loads and casts from floats are data, not index arithmetic: not checked. `memo`
    receives every node's interval (id -> (lo, hi))."""
    memo = {} if memo is None else memo
    lo_lim, hi_lim = dtypes.index.min(), dtypes.index.max()
    for node in root.toposort():
        iv = interval_of(node, [memo[id(s)] for s in node.src], values, range_end)
        if node.dtype is dtypes.index and (iv[0] < lo_lim or iv[1] > hi_lim) and node.op is not Ops.LOAD \
                and not (node.op is Ops.CAST and not node.src[0].dtype.is_int):
            raise LaunchError(f"{what()} reaches [{iv[0]}, {iv[1]}], outside {dtypes.index.name}; use smaller sizes")
        memo[id(node)] = iv
    return memo[id(root)]

