"""Lowering: kernel AST -> LinearKernel, shared by every renderer and driven by its capabilities.

GLOBAL ranges become launch dimensions (GPU) or the thread split (CPU), REDUCE becomes an
accumulator loop, index arithmetic is simplified, and every load and store is recorded with its
index expression so that launches can be bounds-checked for concrete variable values.
"""
from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from ..dtypes import DType, dtypes
from ..errors import LaunchError
from ..ir import AxisType, Ops, UOp, REDUCE_OPS
from .linear import If, Instr, Item, L, LinearKernel, Loop, ParamInfo
from .symbolic import evaluate, interval_of, narrowed_interval, rewrite, simplify


@dataclass(frozen=True)
class Capabilities:
    """What a renderer's target offers; lowering reads these, renderers only print."""

    has_local: bool = False            # GPU work-groups: GLOBAL ranges map to grid x block
    has_shared: bool = False           # work-group shared memory and barriers
    has_threads: bool = False          # CPU worker threads: outermost GLOBAL range is split
    max_dims: int = 3                  # launch dimensions available
    local_max: tuple[int, int, int] = (1024, 1024, 64)
    max_threads_per_group: int = 1024
    default_group: int = 256           # work-items per group for 1-D launches
    grid_max: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    warp_size: int = 1
    register_tile: tuple[int, int] | None = None   # CPU: (rows, columns) of a reduction's output tile
    group_reduce: bool = False    # GPU: row kernels get one work-group per output row, reducing in shared memory
    grid_reduce: bool = False     # GPU: a full reduction is split over many work-groups in two stages
                                  # (partials in a hidden scratch buffer, the last group to finish combines)
    warp_shuffle: bool = False    # GPU: 32-bit lanes of a warp exchange values (group combines use it)
    vector_width: int = 1         # GPU: elementwise kernels load/store this many contiguous elements per item
    matmul_tile: tuple[int, int, int, int, int] | None = None
    # GPU: (BM, BN, BK, TM, TN) shared-memory tiles of a contraction, TM x TN outputs per work-item


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


def _offset_split(index: UOp) -> tuple[Any, tuple[int, ...]]:
    """(shape, cs): `index` as a shape plus the integer constants cs at its leaves that are reached
    from the root through nodes whose interval bounds are each monotone in every such constant: ADD,
    MIN, MAX, and MUL by a constant or by a node known >= 0 (a range, a size variable). The shape
    names every other node by identity (UOps are hash-consed), so indices of one shape differ in
    those constants only. (The node, ()) when there is no such leaf."""
    op = index.op
    if op is Ops.CONST and index.dtype.is_int:
        return ("const", index.dtype), (index.arg,)
    if op is Ops.MUL and len(index.src) == 2:
        a, b = index.src
        for i, (u, other) in enumerate(((a, b), (b, a))):
            if other.op is Ops.CONST or _nonnegative(other):
                ku, cu = _offset_split(u)
                if cu:
                    return (op, index.dtype, i, ku, id(other)), cu
        return id(index), ()
    if op in (Ops.ADD, Ops.MIN, Ops.MAX) and len(index.src) == 2:
        (ka, ca), (kb, cb) = _offset_split(index.src[0]), _offset_split(index.src[1])
        if ca or cb:
            return (op, index.dtype, ka, kb), ca + cb
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
    for a in accesses:
        shape, cs = _offset_split(a.index)
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


@dataclass
class KernelScan:
    """What both lowering paths (the general one and gpu_tile's) know of a kernel AST before emitting
    anything: its buffers, variables and ranges, checked well-formed, and its index arithmetic."""

    nodes: list[UOp]                        # the AST, sources first
    params: list[ParamInfo]                 # by slot
    variables: list[Variable]               # by name
    ranges: dict[int, UOp]                  # axis -> range, in order of first appearance
    loads_from: dict[int, frozenset[int]]   # id(node) -> slots of the loads it depends on (none: absent)
    index_nodes: set[int]                   # ids of the integer nodes of indices and range ends that
                                            # depend on no load: the launch check proves them in range


def scan_kernel(ast: UOp) -> KernelScan:
    """One pass over `ast`; ValueError for a kernel no lowering can take (a param slot missing or with
    two dtypes, a variable with two bounds, an axis with two ranges, a range end that is not a
    function of variables and constants)."""
    nodes = ast.toposort()
    params: dict[int, UOp] = {}
    variables: dict[str, UOp] = {}
    ranges: dict[int, UOp] = {}
    reads, writes = set(), set()
    loads_from: dict[int, frozenset[int]] = {}
    for n in nodes:
        if n.op is Ops.PARAM:
            if n.arg in params and params[n.arg] is not n:
                raise ValueError(f"param slot {n.arg} is declared with two dtypes: "
                                 f"{params[n.arg].dtype.name} and {n.dtype.name}")
            params[n.arg] = n
        elif n.op is Ops.DEFINE_VAR:
            if n.arg[0] in variables and variables[n.arg[0]] is not n:
                raise ValueError(f"variable {n.arg[0]!r} is declared twice with different bounds")
            variables[n.arg[0]] = n
        elif n.op is Ops.RANGE:
            if n.axis in ranges and ranges[n.axis] is not n:
                raise ValueError(f"axis {n.axis} is used by two different ranges")
            ranges[n.axis] = n
            if n.src[0].free_ranges or any(u.op is Ops.LOAD for u in n.src[0].toposort()):
                raise ValueError(f"the end of range {n.axis} must depend only on variables and constants")
        elif n.op is Ops.LOAD:
            reads.add(n.src[0].arg)
        elif n.op is Ops.STORE:
            writes.add(n.src[0].arg)
        loads = frozenset({n.src[0].arg}) if n.op is Ops.LOAD else frozenset()
        for src in n.src:
            loads |= loads_from.get(id(src), frozenset())
        if loads:
            loads_from[id(n)] = loads
    if sorted(params) != list(range(len(params))):
        raise ValueError(f"param slots must be 0..{len(params) - 1} with none missing, got {sorted(params)}")
    index_nodes: set[int] = set()
    for n in nodes:
        if n.op in (Ops.LOAD, Ops.STORE):
            index_nodes.update(id(u) for u in n.src[1].toposort() if u.dtype is not None and u.dtype.is_int)
        if n.op is Ops.RANGE:
            index_nodes.update(id(u) for u in n.src[0].toposort())
    # loads inside an index are data: arithmetic above a load is not proven overflow-free
    index_nodes.difference_update(loads_from)
    return KernelScan(nodes,
                      [ParamInfo(s, params[s].dtype, s in reads, s in writes) for s in sorted(params)],
                      [Variable(*variables[k].arg) for k in sorted(variables)],
                      ranges, loads_from, index_nodes)


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


# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Scope:
    items: list[Item]
    range: UOp | None
    owner: Loop | If | None = None      # the item of the parent's list that holds `items`
    memo: dict[UOp, Instr] = field(default_factory=dict)
    open_children: list[Item] = field(default_factory=list)  # hoisted code goes before the open one

    def insert(self, item: Item) -> None:
        if self.open_children:
            child = self.open_children[-1]
            idx = next(i for i, it in enumerate(self.items) if it is child)
            self.items.insert(idx, item)
        else:
            self.items.append(item)


class _Lowerer:
    def __init__(self, ast: UOp, caps: Capabilities, name: str) -> None:
        self.ast, self.caps, self.name = ast, caps, name
        self.next_id = 0
        self.accesses: list[Access] = []
        self.range_depth: dict[int, int] = {}
        self.loads_from: dict[int, frozenset[int]] = {}
        self.index_nodes: set[int] = set()
        self.global_instr: dict[int, Instr] = {}
        self.min_depth = 0   # GPU: everything lives inside the bounds guard
        self.first_worker: If | None = None
        self.thread_start: Instr | None = None
        self.gpu_ids: list[Instr] = []
        self.group_mode = False
        self.loaded_slots: set[int] = set()
        self.group_size = 1
        self.lid: Instr | None = None
        self.dist: tuple[Instr, Instr, UOp] | None = None   # grid mode: the distributed loop's start and step
                                                           # (and the step as an expression of the sizes)
        self.stepped: list[SteppedLoop] = []           # every loop with a step, for the launch check
        self.hidden: list[HiddenBuffer] = []
        self.hidden_params: list[ParamInfo] = []
        self.access_keys: set[tuple] = set()
        self.vec_loads: dict[UOp, Instr] = {}      # vector mode: LOAD node -> its w-wide load
        self.vec_lane: int | None = None           # vector mode: the lane being emitted
        self.row_cache: dict[UOp, tuple[UOp, int]] = {}    # group mode: LOAD -> (range, key) it caches under
        self.row_cache_arrays: dict[int, Instr] = {}        # key -> the shared array once filled

    def new(self, kind: L, dtype: DType | None, src=(), arg: Any = None) -> Instr:
        self.next_id += 1
        return Instr(kind, dtype, tuple(src), arg, self.next_id)

    # placement ----------------------------------------------------------------------------
    def depth_of(self, node: UOp, chain: list[_Scope]) -> int:
        d = min(self.min_depth, len(chain) - 1)
        rs = node.free_ranges
        for i, sc in enumerate(chain):
            if sc.range is not None and sc.range in rs:
                d = max(d, i)
        return d

    def place(self, instr: Item, chain: list[_Scope], depth: int) -> None:
        chain[depth].insert(instr)

    def lookup(self, node: UOp, chain: list[_Scope]) -> Instr | None:
        for sc in reversed(chain):
            hit = sc.memo.get(node)
            if hit is not None:
                return hit
        return None

    # emission -----------------------------------------------------------------------------
    def emit(self, node: UOp, chain: list[_Scope]) -> Instr:
        hit = self.lookup(node, chain)
        if hit is not None:
            return hit
        if node.op is Ops.RANGE:
            if id(node) in self.global_instr:
                return self.global_instr[id(node)]
            raise ValueError(f"range of axis {node.axis} ({node.axis_type.name}) is used outside the loop that "
                             f"defines it")
        depth = self.depth_of(node, chain)
        if node.op is Ops.REDUCE:
            if self.group_mode and self.at_group_top(chain, depth):
                self.emit_reduces([node], chain, depth, cooperative=True)
                return chain[depth].memo[node]
            out = self.emit_reduce(node, chain, depth)
        else:
            srcs = [self.emit(s, chain) for s in node.src]
            op = node.op
            if op is Ops.CONST:
                ins = self.new(L.CONST, node.dtype, (), node.arg)
            elif op is Ops.PARAM:
                ins = self.new(L.PARAM, node.dtype, (), node.arg)
            elif op is Ops.DEFINE_VAR:
                ins = self.new(L.VAR, node.dtype, (), node.arg[0])
            elif op is Ops.LOAD:
                self.record(Access(node.src[0].arg, False, node.src[1], self.open_ranges(chain)))
                vec = self.vec_loads.get(node) if self.vec_lane is not None else None
                cached = self.row_cache.get(node)
                if vec is not None:
                    ins = self.new(L.EXTRACT, node.dtype, (vec,), self.vec_lane)
                elif cached is not None and self.in_distributed_loop(chain, depth, cached[0]):
                    ins = self.emit_row_cached(node, srcs, cached, chain, depth)
                    chain[depth].memo[node] = ins
                    return ins
                else:
                    ins = self.new(L.LOAD, node.dtype, srcs)
            else:
                ins = self.new(L.ALU, node.dtype, srcs, op)
                ins.index_math = id(node) in self.index_nodes
            self.place(ins, chain, depth)
            out = ins
        chain[depth].memo[node] = out
        return out

    # ---- rows kept in shared memory ---------------------------------------------------------
    def plan_row_cache(self, ast: UOp, globals_: list[UOp], read_only: set[int]) -> None:
        """Group mode: a row loaded by several passes (softmax reads it for the max, the sum and the
        output) is read from global memory once. Loads of a read-only buffer whose index differs
        only in the (constant-extent) range its group-strided loop runs over share a key; the first
        pass stores what each work-item loaded into a shared array, later passes read it back. Every
        pass strides the same way, so each item reads only what it wrote: no barrier is needed."""
        budget = ROW_CACHE_BYTES
        groups: dict[int, list[UOp]] = {}
        keys: dict[int, UOp] = {}
        gl = set(globals_)
        for n in ast.toposort():
            if n.op is not Ops.LOAD or n.src[0].arg not in read_only or n.dtype.is_bool:
                continue
            rs = [r for r in n.free_ranges if r not in gl]
            if len(rs) != 1 or rs[0].src[0].op is not Ops.CONST:
                continue
            r = rs[0]
            from ..ir import substitute
            canon = substitute(n.src[1], {r: UOp.range(r.src[0], -1, AxisType.LOOP)})
            groups.setdefault(id(canon), []).append((n, r))
            keys[id(canon)] = canon
        for k, members in groups.items():
            if len(members) < 2:
                continue
            extent = members[0][1].src[0].arg
            nbytes = extent * members[0][0].dtype.itemsize
            if nbytes > budget:
                continue
            budget -= nbytes
            for n, r in members:
                self.row_cache[n] = (r, k)

    def in_distributed_loop(self, chain: list[_Scope], depth: int, r: UOp) -> bool:
        sc = chain[depth]
        return sc.range is r and isinstance(sc.owner, Loop) and sc.owner.step is not None and self.dist is None

    def emit_row_cached(self, node: UOp, srcs: list[Instr], cached: tuple[UOp, int], chain: list[_Scope],
                        depth: int) -> Instr:
        """A global load marked with its cache key; `finish_row_cache` decides, in program order
        (not emission order: a pass's reduce may be emitted after the pass that uses it), which load
        fills the shared array and which ones read it."""
        r, key = cached
        if key not in self.row_cache_arrays:
            self.row_cache_arrays[key] = self.new(L.LOCAL, node.dtype, (), r.src[0].arg)
        ins = self.new(L.LOAD, node.dtype, srcs)
        ins.cache = (key, chain[depth].memo[r])   # the loop variable: this item's element of the row
        self.place(ins, chain, depth)
        return ins

    def finish_row_cache(self, body: list[Item]) -> None:
        if not self.row_cache_arrays:
            return
        filled: set[int] = set()
        used: set[int] = set()

        def walk(items: list[Item]) -> None:
            i = 0
            while i < len(items):
                it = items[i]
                if isinstance(it, (Loop, If)):
                    walk(it.body)
                elif it.cache is not None:
                    key, pos = it.cache
                    arr = self.row_cache_arrays[key]
                    if key not in filled:
                        filled.add(key)
                        items.insert(i + 1, self.new(L.STORE, None, (arr, pos, it)))
                        i += 1
                    else:
                        it.src = (arr, pos)
                        used.add(key)
                i += 1
        walk(body)
        for key, arr in self.row_cache_arrays.items():
            if key in used:
                body.insert(0, arr)
            else:       # a single pass survived: nothing reads the array back
                self.strip_fill(body, arr)

    def strip_fill(self, items: list[Item], arr: Instr) -> None:
        for it in list(items):
            if isinstance(it, (Loop, If)):
                self.strip_fill(it.body, arr)
            elif it.kind is L.STORE and it.src[0] is arr:
                items.remove(it)

    def record(self, a: Access) -> None:
        """One bounds check per distinct access (vector lanes emit the same access several times)."""
        key = (a.slot, a.store, id(a.index), tuple(id(r) for r in a.enclosing))
        if key not in self.access_keys:
            self.access_keys.add(key)
            self.accesses.append(a)

    def open_ranges(self, chain: list[_Scope]) -> tuple[UOp, ...]:
        return tuple(sc.range for sc in chain if sc.range is not None)

    def open_loop(self, rng: UOp, chain: list[_Scope], depth: int, distributed: bool = False) -> list[_Scope]:
        end = self.emit(rng.src[0], chain)
        if distributed and self.dist is not None:   # the whole grid strides over the range
            start, step, step_size = self.dist
            self.stepped.append(SteppedLoop(rng.src[0], step_size))   # starts: gid * group + lid, all of [0, step)
        elif distributed:   # work-item lid takes lid, lid + group, lid + 2*group, ...
            start = self.lid
            step_size = UOp.const(self.group_size, dtypes.index)
            step = self.emit(step_size, chain)
            self.stepped.append(SteppedLoop(rng.src[0], step_size))   # starts: lid, all of [0, group)
        else:
            start, step = self.emit(UOp.const(0, dtypes.index), chain), None
        unroll = 0
        if distributed:
            unroll = GPU_STRIDED_UNROLL
            if self.dist is None and rng.src[0].op is Ops.CONST:
                # a known trip count: unroll it whole (up to 16) so all of an item's loads are in flight
                trips = -(-rng.src[0].arg // self.group_size)
                unroll = min(GPU_STRIDED_UNROLL_MAX, trips) if trips > 1 else 0
        loop = Loop(self.new(L.LOOPVAR, dtypes.index), start, end, rng.axis_type, step=step, unroll=unroll)
        self.place(loop, chain, depth)
        chain[depth].open_children.append(loop)
        new_chain = chain[:depth + 1] + [_Scope(loop.body, rng, loop)]
        new_chain[-1].memo[rng] = loop.var
        return new_chain

    @staticmethod
    def close_loops(chain: list[_Scope], count: int) -> None:
        for sc_parent, sc in list(zip(chain[:-1], chain[1:]))[::-1][:count]:
            popped = sc_parent.open_children.pop()
            assert popped is sc.owner

    def emit_reduce(self, node: UOp, chain: list[_Scope], depth: int) -> Instr:
        self.emit_reduces([node], chain, depth)
        return chain[depth].memo[node]

    def at_group_top(self, chain: list[_Scope], depth: int) -> bool:
        """In group mode: no loop is open between the group's top and `depth`."""
        return all(sc.range is None for sc in chain[:depth + 1])

    def emit_reduces(self, nodes: list[UOp], chain: list[_Scope], depth: int, cooperative: bool = False) -> None:
        """REDUCEs over the same ranges share one loop nest, one accumulator each. A cooperative
        reduce strides its outermost range over the work-group, then combines the partial results
        through shared memory; every work-item gets the result."""
        ranges = sorted(nodes[0].src[1:], key=lambda r: r.axis)
        accs = []
        for node in nodes:
            acc = self.new(L.ACC, node.dtype, (), reduce_identity(node.dtype, node.arg))
            self.place(acc, chain, depth)
            accs.append(acc)
        inner = chain[:depth + 1]
        for n_r, r in enumerate(ranges):
            inner = self.open_loop(r, inner, len(inner) - 1, distributed=cooperative and n_r == 0)
        for node, acc in zip(nodes, accs):
            val = self.emit(node.src[0], inner)
            cur = self.new(L.ACC_LOAD, node.dtype, (acc,))
            self.place(cur, inner, len(inner) - 1)
            upd = self.new(L.ALU, node.dtype, (cur, val), node.arg)
            upd.reassoc = True
            self.place(upd, inner, len(inner) - 1)
            self.place(self.new(L.ACC_STORE, None, (acc, upd)), inner, len(inner) - 1)
        self.close_loops(inner, len(ranges))
        for node, acc in zip(nodes, accs):
            res = self.new(L.ACC_LOAD, node.dtype, (acc,))
            self.place(res, chain, depth)
            if cooperative:
                res = self.combine_in_group(res, node.arg, chain, depth)
            chain[depth].memo[node] = res

    def combine_in_group(self, part: Instr, op: Ops, chain: list[_Scope], depth: int) -> Instr:
        """Combine one partial value per work-item; all items get the total. 32-bit values go through
        warp shuffles (two barriers), others through a shared-memory tree (one barrier per level)."""
        w = self.caps.warp_size
        size = self.group_size
        nw = size // w if w > 1 else 0
        if (self.caps.warp_shuffle and part.dtype.name in ("float32", "int32", "uint32") and size % w == 0
                and 1 <= nw <= w and nw & (nw - 1) == 0):
            return self.combine_with_shuffles(part, op, chain, depth, w, nw)
        size = self.group_size
        dt = part.dtype
        put = lambda it: self.place(it, chain, depth)  # noqa: E731
        smem = self.new(L.LOCAL, dt, (), size)
        put(smem)
        lid = self.lid
        put(self.new(L.STORE, None, (smem, lid, part)))
        put(self.new(L.BARRIER, None))
        s = size // 2
        while s >= 1:
            c = self.emit(UOp.const(s, dtypes.index), chain)
            cond = self.new(L.ALU, dtypes.bool, (lid, c), Ops.CMPLT)
            put(cond)
            br = If(cond)
            other = self.new(L.ALU, dtypes.index, (lid, c), Ops.ADD)
            other.index_math = True
            a = self.new(L.LOAD, dt, (smem, lid))
            b = self.new(L.LOAD, dt, (smem, other))
            v = self.new(L.ALU, dt, (a, b), op)
            v.reassoc = True
            br.body.extend([other, a, b, v, self.new(L.STORE, None, (smem, lid, v))])
            put(br)
            put(self.new(L.BARRIER, None))
            s //= 2
        zero = self.emit(UOp.const(0, dtypes.index), chain)
        res = self.new(L.LOAD, dt, (smem, zero))
        put(res)
        put(self.new(L.BARRIER, None))   # everyone has read the total before the array is reused
        return res

    def combine_with_shuffles(self, part: Instr, op: Ops, chain: list[_Scope], depth: int, w: int,
                              nw: int) -> Instr:
        """Butterfly within each warp; lane 0 of each warp writes its total to shared memory; after a
        barrier every warp butterflies over the nw warp totals, so every item ends with the total."""
        dt, idx, lid = part.dtype, dtypes.index, self.lid
        put = lambda it: self.place(it, chain, depth)  # noqa: E731

        def butterfly(v: Instr, width: int) -> Instr:
            m = width // 2
            while m >= 1:
                o = self.new(L.SHUFFLE_XOR, dt, (v, lid), (m, w))
                put(o)
                v = self.new(L.ALU, dt, (v, o), op)
                v.reassoc = True
                put(v)
                m //= 2
            return v

        v = butterfly(part, w)
        smem = self.new(L.LOCAL, dt, (), nw)
        put(smem)
        lane = self.new(L.ALU, idx, (lid, self.emit(UOp.const(w - 1, idx), chain)), Ops.AND)
        warp = self.new(L.ALU, idx, (lid, self.emit(UOp.const(w.bit_length() - 1, idx), chain)), Ops.SHR)
        first = self.new(L.ALU, dtypes.bool, (lane, self.emit(UOp.const(0, idx), chain)), Ops.CMPEQ)
        for it in (lane, warp, first, If(first, [self.new(L.STORE, None, (smem, warp, v))]),
                   self.new(L.BARRIER, None)):
            put(it)
        slot = self.new(L.ALU, idx, (lid, self.emit(UOp.const(nw - 1, idx), chain)), Ops.AND)
        tot = self.new(L.LOAD, dt, (smem, slot))
        put(slot), put(tot)
        res = butterfly(tot, nw)
        put(self.new(L.BARRIER, None))   # everyone has read the totals before the array is reused
        return res

    def emit_group(self, stores: list[UOp], chain: list[_Scope]) -> None:
        """Stores over the same ranges share their loops; their reductions are fused."""
        for store in stores:
            bad = [r for r in store.free_ranges if r.axis_type is AxisType.REDUCE]
            if bad:
                raise ValueError(f"store to buffer {store.src[0].arg} uses REDUCE range(s) of axis "
                                 f"{sorted(r.axis for r in bad)} outside a reduce(); reduce them or make them "
                                 f"LOOP ranges")
        loops = sorted((r for r in stores[0].free_ranges if r.axis_type is AxisType.LOOP), key=lambda r: r.axis)
        for n_r, r in enumerate(loops):
            chain = self.open_loop(r, chain, len(chain) - 1, distributed=self.group_mode and n_r == 0)
        if len(stores) > 1:
            buckets: dict[tuple, list[UOp]] = {}
            for red in _top_reduces(stores):
                if self.lookup(red, chain) is None and not (self.group_mode and
                                                          self.at_group_top(chain, self.depth_of(red, chain))):
                    key = (tuple(sorted(red.src[1:], key=lambda r: r.axis)), self.depth_of(red, chain))
                    buckets.setdefault(key, []).append(red)
            for (_, depth), reds in buckets.items():
                if len(reds) > 1:
                    self.emit_reduces(reds, chain, depth)
        for store in stores:
            buf, idx, val = store.src
            self.record(Access(buf.arg, True, idx, self.open_ranges(chain)))
            srcs = [self.emit(buf, chain), self.emit(idx, chain), self.emit(val, chain)]
            st = self.new(L.STORE, None, srcs)
            if self.group_mode and not loops:
                # one output per work-group: work-item 0 writes it
                zero = self.emit(UOp.const(0, dtypes.index), chain)
                cond = self.new(L.ALU, dtypes.bool, (self.lid, zero), Ops.CMPEQ)
                chain[-1].insert(cond)
                chain[-1].insert(If(cond, [st]))
            else:
                chain[-1].insert(st)
        self.close_loops(chain, len(loops))

    def invalidate(self, chain: list[_Scope], slot: int) -> None:
        """After a store to `slot`, values that loaded from it are stale."""
        if slot not in self.loaded_slots:
            return
        for sc in chain:
            for k in [k for k in sc.memo if slot in self.loads_from.get(id(k), ())]:
                del sc.memo[k]

    # driver -------------------------------------------------------------------------------
    def run(self, scan: KernelScan) -> tuple[LinearKernel, LaunchInfo]:
        ast, caps = self.ast, self.caps
        self.loads_from, self.index_nodes = scan.loads_from, scan.index_nodes
        pinfo, var_list, ranges = scan.params, scan.variables, scan.ranges
        self.loaded_slots = {p.slot for p in pinfo if p.read}
        globals_ = sorted((r for r in ranges.values() if r.axis_type is AxisType.GLOBAL), key=lambda r: r.axis)

        body: list[Item] = []
        top = _Scope(body, None)
        chain = [top]
        dims: list[UOp] = []
        local = (1, 1, 1)
        self.group_mode = (caps.has_local and caps.group_reduce and len(globals_) <= 1
                           and any(r.axis_type is AxisType.REDUCE for r in ranges.values()))
        self.n_params = len(pinfo)
        vector = None
        if self.group_mode:
            grid = self.grid_plan(ast, globals_)
            if grid is None and caps.has_shared:
                self.plan_row_cache(ast, globals_, {p.slot for p in pinfo if p.read and not p.written})
            chain, dims, local = self.map_to_group_per_row(globals_, chain, grid)
            self.min_depth = len(chain) - 1
            if grid is not None:
                chain = self.emit_grid_reduces(grid, chain)
        elif caps.has_local:
            vector = self.vector_plan(ast, globals_, ranges)
            chain, dims, local = self.map_to_groups(globals_, chain, vector)
            self.min_depth = len(chain) - 1
        else:
            chain, dims = self.map_to_loops(globals_, chain)
        for group in ([] if vector is not None else _store_groups(list(ast.src), self.loads_from)):
            gchain = chain
            if globals_ and not any(r.axis_type is AxisType.GLOBAL for r in group[0].free_ranges):
                gchain = self.first_worker_chain(chain, caps)
            self.emit_group(group, gchain)
            if gchain is not chain:
                gchain[0].open_children.pop()
            for store in group:
                self.invalidate(chain, store.src[0].arg)
        if vector is not None:
            self.emit_vectorized(list(ast.src), chain, vector)
        self.finish_row_cache(body)
        kernel = LinearKernel(self.name, pinfo + self.hidden_params, [v.name for v in var_list], body, local,
                              thread_split=not caps.has_local, gpu=caps.has_local)
        info = LaunchInfo(pinfo, var_list, dims, local, caps.has_local, self.accesses,
                          [r.src[0] for r in ranges.values()], caps.grid_max, group_per_item=self.group_mode,
                          hidden=self.hidden, stepped_loops=self.stepped)
        return kernel, info

    # ---- two-stage reductions over the whole grid ----------------------------------------------
    def grid_plan(self, ast: UOp, globals_: list[UOp]) -> "tuple[list[UOp], UOp] | None":
        """A full reduction (no GLOBAL range) whose top-level REDUCEs share their ranges is split over
        up to GRID_REDUCE_GROUPS work-groups: (the reduces, the group count as a UOp of the sizes)."""
        if globals_ or not self.caps.grid_reduce:
            return None
        reds = _top_reduces(list(ast.src))
        if not reds or any(r.free_ranges for r in reds):
            return None
        keys = {tuple(sorted((id(x) for x in r.src[1:]))) for r in reds}
        if len(keys) != 1:
            return None
        outer = min(reds[0].src[1:], key=lambda r: r.axis)
        per_group = self.caps.default_group * GRID_ITEMS_PER_WORKER
        # max(1, min(G, ceil(E / per_group))), written so that no intermediate overflows
        groups = ((outer.src[0] - 1) // per_group + 1).minimum(GRID_REDUCE_GROUPS).maximum(1)
        return reds, simplify(groups)

    def hidden_param(self, dt: DType, count: int) -> Instr:
        slot = self.n_params + len(self.hidden)
        self.hidden.append(HiddenBuffer(dt, count))
        self.hidden_params.append(ParamInfo(slot, dt, True, True))
        return self.new(L.PARAM, dt, (), slot)

    def emit_grid_reduces(self, plan: "tuple[list[UOp], UOp]", chain: list[_Scope]) -> list[_Scope]:
        """Stage 1: every work-group strides over the reduced range and combines its items in shared
        memory; item 0 writes the group's partial to a hidden scratch buffer, then takes a ticket from a
        hidden counter. Stage 2: the group that takes the last ticket combines the partials (and resets
        the counter for the next launch); the rest of the kernel runs in that group only."""
        reds, groups_expr = plan
        depth = len(chain) - 1
        top = chain[depth]
        put = top.insert
        idx = dtypes.index
        n_groups = self.emit(groups_expr, chain)
        gsize = self.emit(UOp.const(self.group_size, idx), chain)
        zero = self.emit(UOp.const(0, idx), chain)
        base = self.new(L.ALU, idx, (self.gid, gsize), Ops.MUL); base.index_math = True
        start = self.new(L.ALU, idx, (base, self.lid), Ops.ADD); start.index_math = True
        step = self.new(L.ALU, idx, (n_groups, gsize), Ops.MUL); step.index_math = True
        for it in (base, start, step):
            put(it)
        self.dist = (start, step, groups_expr * self.group_size)
        self.emit_reduces(reds, chain, depth, cooperative=True)
        self.dist = None
        parts = [top.memo.pop(r) for r in reds]
        scratch = [self.hidden_param(r.dtype, GRID_REDUCE_GROUPS) for r in reds]
        counter = self.hidden_param(dtypes.uint32, 1)
        one_u = self.new(L.CONST, dtypes.uint32, (), 1)
        one = self.emit(UOp.const(1, idx), chain)
        last_ticket = self.new(L.ALU, idx, (n_groups, one), Ops.SUB); last_ticket.index_math = True
        last_u = self.new(L.ALU, dtypes.uint32, (last_ticket,), Ops.CAST)
        flag = self.new(L.LOCAL, dtypes.int32, (), 1)
        is0 = self.new(L.ALU, dtypes.bool, (self.lid, zero), Ops.CMPEQ)
        first = If(is0)
        for buf, part in zip(scratch, parts):
            first.body.append(self.new(L.STORE, None, (buf, self.gid, part)))
        ticket = self.new(L.ATOMIC_ADD, dtypes.uint32, (counter, zero, one_u))
        got_last = self.new(L.ALU, dtypes.bool, (ticket, last_u), Ops.CMPEQ)
        as_int = self.new(L.ALU, dtypes.int32, (got_last,), Ops.CAST)
        first.body.extend([self.new(L.FENCE, None), ticket, self.new(L.FENCE, None), got_last, as_int,
                           self.new(L.STORE, None, (flag, zero, as_int))])
        zero32 = self.new(L.CONST, dtypes.int32, (), 0)
        flag_val = self.new(L.LOAD, dtypes.int32, (flag, zero))
        is_last = self.new(L.ALU, dtypes.bool, (flag_val, zero32), Ops.CMPNE)
        last = If(is_last)
        for it in (last_ticket, last_u, flag, is0, first, self.new(L.BARRIER, None), flag_val, is_last, last):
            put(it)
        top.open_children.append(last)
        scope = _Scope(last.body, None, last)
        chain = chain + [scope]
        self.min_depth = len(chain) - 1
        accs = [self.new(L.ACC, r.dtype, (), reduce_identity(r.dtype, r.arg)) for r in reds]
        scope.items.extend(accs)
        loop = Loop(self.new(L.LOOPVAR, idx), self.lid, n_groups, AxisType.REDUCE, step=gsize)
        self.stepped.append(SteppedLoop(groups_expr, UOp.const(self.group_size, idx)))   # starts: lid
        for acc, buf, r in zip(accs, scratch, reds):
            v = self.new(L.LOAD, r.dtype, (buf, loop.var)); v.volatile = True
            cur = self.new(L.ACC_LOAD, r.dtype, (acc,))
            upd = self.new(L.ALU, r.dtype, (cur, v), r.arg); upd.reassoc = True
            loop.body.extend([v, cur, upd, self.new(L.ACC_STORE, None, (acc, upd))])
        scope.items.append(loop)
        for acc, r in zip(accs, reds):
            res = self.new(L.ACC_LOAD, r.dtype, (acc,))
            scope.items.append(res)
            scope.memo[r] = self.combine_in_group(res, r.arg, chain, len(chain) - 1)
        again = self.new(L.ALU, dtypes.bool, (self.lid, zero), Ops.CMPEQ)
        reset = self.new(L.STORE, None, (counter, zero, self.new(L.CONST, dtypes.uint32, (), 0)))
        scope.items.extend([again, If(again, [reset])])
        return chain

    # ---- vector loads and stores of elementwise kernels ---------------------------------------
    def vector_plan(self, ast: UOp, globals_: list[UOp], ranges: dict[int, UOp]):
        """(x, width, vector loads, vector stores) when every range is GLOBAL, all stores use the
        innermost axis x, and some access is contiguous in x; else None."""
        w = self.caps.vector_width
        if w <= 1 or not globals_ or any(r.axis_type is not AxisType.GLOBAL for r in ranges.values()):
            return None
        stores = list(ast.src)
        x = globals_[-1]
        if len(_store_groups(stores, self.loads_from)) != 1 or any(x not in st.free_ranges for st in stores):
            return None
        ok = lambda dt: dt is not None and dt.name in _VECTOR_DTYPES  # noqa: E731
        loads = [n for n in ast.toposort() if n.op is Ops.LOAD and ok(n.dtype) and x_coefficient(n.src[1], x) == 1]
        vstores = [st for st in stores if ok(st.src[2].dtype) and x_coefficient(st.src[1], x) == 1]
        if not loads and not vstores:
            return None
        return x, w, loads, vstores

    def emit_vectorized(self, stores: list[UOp], chain: list[_Scope], plan) -> None:
        """Work-item t covers x in [w*t, w*t + w): when all w lanes are in range and every vector access
        starts on a multiple of w, contiguous accesses are w-wide loads/stores; otherwise each lane runs
        as a scalar (the tail, and rows whose start is not aligned)."""
        x, w, vloads, vstores = plan
        idx = dtypes.index
        g = chain[-1]
        t = self.global_instr[id(x)]
        wc = self.emit(UOp.const(w, idx), chain)
        t4 = self.new(L.ALU, idx, (t, wc), Ops.MUL); t4.index_math = True
        g.insert(t4)
        end = self.emit(x.src[0], chain)
        bscope = _Scope(g.items, x)
        bscope.memo[x] = t4
        bchain = chain + [bscope]
        full_end = self.new(L.ALU, idx, (end, self.emit(UOp.const(w - 1, idx), chain)), Ops.SUB)
        cond = self.new(L.ALU, dtypes.bool, (t4, full_end), Ops.CMPLT)
        g.insert(full_end); g.insert(cond)
        mask = self.emit(UOp.const(w - 1, idx), chain)
        zero = self.emit(UOp.const(0, idx), chain)
        bases: dict[UOp, Instr] = {}
        for node in [*vloads, *vstores]:
            b = bases[node] = self.emit(node.src[1], bchain)
            if b is not t4:
                m = self.new(L.ALU, idx, (b, mask), Ops.AND)
                c = self.new(L.ALU, dtypes.bool, (m, zero), Ops.CMPEQ)
                both = self.new(L.ALU, dtypes.bool, (cond, c), Ops.AND)
                for it in (m, c, both):
                    g.insert(it)
                cond = both
        vec_if = If(cond)
        g.insert(vec_if)
        g.open_children.append(vec_if)
        for node in vloads:
            v = self.new(L.LOAD, node.dtype, (self.emit(node.src[0], chain), bases[node]), w)
            vec_if.body.append(v)
            self.vec_loads[node] = v
        lanes = []
        for k in range(w):
            sc = _Scope(vec_if.body, x, vec_if)
            if k == 0:
                sc.memo[x] = t4
            else:
                xk = self.new(L.ALU, idx, (t4, self.emit(UOp.const(k, idx), chain)), Ops.ADD)
                xk.index_math = True
                vec_if.body.append(xk)
                sc.memo[x] = xk
            lanes.append(chain + [sc])
        vset = set(vstores)
        for st in stores:
            buf, index, val = st.src
            self.record(Access(buf.arg, True, index, self.open_ranges(lanes[0])))
            if st in vset:
                vals = []
                for k in range(w):
                    self.vec_lane = k
                    vals.append(self.emit(val, lanes[k]))
                self.vec_lane = None
                vec = self.new(L.VECTOR, val.dtype, tuple(vals))
                vec_if.body.extend([vec, self.new(L.STORE, None, (self.emit(buf, chain), bases[st], vec), w)])
            else:
                for k in range(w):
                    self.vec_lane = k
                    srcs = (self.emit(buf, chain), self.emit(index, lanes[k]), self.emit(val, lanes[k]))
                    vec_if.body.append(self.new(L.STORE, None, srcs))
                self.vec_lane = None
        g.open_children.pop()
        # the tail: lanes one by one, each guarded
        not_full = self.new(L.ALU, dtypes.bool, (cond, self.new(L.CONST, dtypes.bool, (), True)), Ops.XOR)
        tail = If(not_full)
        g.insert(not_full)
        g.insert(tail)
        g.open_children.append(tail)
        for k in range(w):
            lim = self.new(L.ALU, idx, (end, self.emit(UOp.const(k, idx), chain)), Ops.SUB)
            ck = self.new(L.ALU, dtypes.bool, (t4, lim), Ops.CMPLT)
            lane_if = If(ck)
            tail.body.extend([lim, ck, lane_if])
            sc = _Scope(lane_if.body, x, lane_if)
            if k == 0:
                sc.memo[x] = t4
            else:
                xk = self.new(L.ALU, idx, (t4, self.emit(UOp.const(k, idx), chain)), Ops.ADD)
                xk.index_math = True
                lane_if.body.append(xk)
                sc.memo[x] = xk
            lane = chain + [sc]
            for st in stores:
                buf, index, val = st.src
                srcs = (self.emit(buf, chain), self.emit(index, lane), self.emit(val, lane))
                lane_if.body.append(self.new(L.STORE, None, srcs))
        g.open_children.pop()

    def map_to_group_per_row(self, globals_: list[UOp], chain: list[_Scope], grid=None):
        """GPU row kernels: work-group g handles row g of the (at most one) GLOBAL range; its
        work-items share the row's loops and reductions. A grid reduction launches its group count."""
        top = chain[0]
        self.group_size = size = self.caps.default_group
        self.gid = gid = self.new(L.SPECIAL, dtypes.index, (), ("group_id", 0))
        self.lid = self.new(L.SPECIAL, dtypes.index, (), ("local_id", 0))
        top.items.extend([gid, self.lid])
        self.gpu_ids.append(gid)
        inner = _Scope([], None)
        if globals_:
            self.global_instr[id(globals_[0])] = gid
            dims = [globals_[0].src[0]]
        elif grid is not None:
            dims = [grid[1]]
        else:
            dims = [UOp.const(1, dtypes.index)]
        guard = If(self.emit(UOp.const(True, dtypes.bool), chain))
        top.items.append(guard)
        top.open_children.append(guard)
        inner = _Scope(guard.body, None, guard)
        for r in globals_:
            inner.memo[r] = gid
        return chain + [inner], dims, (size, 1, 1)

    def first_worker_chain(self, chain: list[_Scope], caps: Capabilities) -> list[_Scope]:
        """Stores that use no GLOBAL range run once: on CPU in the call whose chunk starts at 0,
        on GPU in work-item (0, 0, 0)."""
        top = chain[0]
        if True:  # a fresh guard per group: it must come after every value the group reuses
            zero = self.emit(UOp.const(0, dtypes.index), [top])
            if caps.has_local:
                cond = None
                for idx in self.gpu_ids:
                    c = self.new(L.ALU, dtypes.bool, (idx, zero), Ops.CMPEQ)
                    top.insert(c)
                    if cond is not None:
                        c2 = self.new(L.ALU, dtypes.bool, (cond, c), Ops.AND)
                        top.insert(c2)
                        c = c2
                    cond = c
            else:
                cond = self.new(L.ALU, dtypes.bool, (self.thread_start, zero), Ops.CMPEQ)
                top.insert(cond)
            guard = If(cond)
            top.insert(guard)
        top.open_children.append(guard)
        return [top, _Scope(guard.body, None, guard)]

    def map_to_loops(self, globals_: list[UOp], chain: list[_Scope]):
        """CPU: nested loops, the outermost over [start, end) given by the caller's thread split."""
        if not globals_:
            return chain, []
        for i, r in enumerate(globals_):
            if i == 0:
                start = self.new(L.THREAD_RANGE, dtypes.index, (), "start")
                self.thread_start = start
                end = self.new(L.THREAD_RANGE, dtypes.index, (), "end")
                chain[-1].items.extend([start, end])
                loop = Loop(self.new(L.LOOPVAR, dtypes.index), start, end, AxisType.GLOBAL)
                chain[-1].insert(loop)
                chain[-1].open_children.append(loop)
                chain = chain + [_Scope(loop.body, r, loop)]
                chain[-1].memo[r] = loop.var
            else:
                chain = self.open_loop(r, chain, len(chain) - 1)
        return chain, [globals_[0].src[0]]

    def map_to_groups(self, globals_: list[UOp], chain: list[_Scope], vector=None):
        """GPU: innermost global axis -> x; more than max_dims axes are merged into the last one.
        With a vector plan, x counts groups of `width` elements (emit_vectorized spreads them)."""
        caps = self.caps
        if not globals_:
            return chain, [UOp.const(1, dtypes.index)], (1, 1, 1)
        order = list(reversed(globals_))   # innermost first: x, y, z
        groups: list[list[UOp]] = [[r] for r in order[:caps.max_dims - 1]] + [order[caps.max_dims - 1:]]
        groups = [g for g in groups if g]
        dims = []
        for g in groups:
            e = g[0].src[0]
            if vector is not None and g[0] is vector[0]:
                e = (e - 1) // vector[1] + 1     # ceil(E / w) for E >= 1; no intermediate overflows
            for r in g[1:]:
                e = e * r.src[0]
            dims.append(simplify(e))
        local = self.choose_local(dims)
        conds = []
        top = chain[0]
        for d, (g, ext) in enumerate(zip(groups, dims)):
            gid = self.new(L.SPECIAL, dtypes.index, (), ("group_id", d))
            lid = self.new(L.SPECIAL, dtypes.index, (), ("local_id", d))
            top.items.extend([gid, lid])
            ls = self.emit(UOp.const(local[d], dtypes.index), chain)
            mul = self.new(L.ALU, dtypes.index, (gid, ls), Ops.MUL); mul.index_math = True
            idx = self.new(L.ALU, dtypes.index, (mul, lid), Ops.ADD); idx.index_math = True
            top.items.extend([mul, idx])
            self.gpu_ids.append(idx)
            end = self.emit(ext, chain)
            cond = self.new(L.ALU, dtypes.bool, (idx, end), Ops.CMPLT)
            top.items.append(cond)
            conds.append(cond)
            # split a merged dimension back into its ranges, innermost first
            rem = idx
            for j, r in enumerate(g):
                if j == len(g) - 1:
                    self.global_instr[id(r)] = rem
                    break
                e = self.emit(r.src[0], chain)
                m = self.new(L.ALU, dtypes.index, (rem, e), Ops.MOD); m.index_math = True
                q = self.new(L.ALU, dtypes.index, (rem, e), Ops.IDIV); q.index_math = True
                top.items.extend([m, q])
                self.global_instr[id(r)] = m
                rem = q
        cond = conds[0]
        for c in conds[1:]:
            nc = self.new(L.ALU, dtypes.bool, (cond, c), Ops.AND)
            top.items.append(nc)
            cond = nc
        guard = If(cond)
        top.items.append(guard)
        top.open_children.append(guard)
        inner = _Scope(guard.body, None, guard)
        # values of the global ranges are defined at the top: make them visible in the guarded body
        for g in groups:
            for r in g:
                if vector is None or r is not vector[0]:
                    inner.memo[r] = self.global_instr[id(r)]
        return chain + [inner], dims, local

    def choose_local(self, dims: list[UOp]) -> tuple[int, int, int]:
        caps = self.caps
        budget = caps.default_group
        local = [1, 1, 1]
        for d, e in enumerate(dims):
            ext = e.arg if e.op is Ops.CONST else None
            if d == 0:
                want = budget if len(dims) == 1 else min(budget, 32 if caps.warp_size <= 32 else caps.warp_size)
            else:
                want = max(1, budget // math.prod(local))
            if ext is not None:
                want = min(want, 1 << max(0, (ext - 1).bit_length()))
            local[d] = max(1, min(want, caps.local_max[d]))
        return (local[0], local[1], local[2])


ROW_CACHE_BYTES = 24 * 1024    # shared memory a row kernel may spend keeping rows it reads more than once
GPU_STRIDED_UNROLL = 4         # group-strided loops: unroll hint, so each item has several loads in flight
GPU_STRIDED_UNROLL_MAX = 16    # ... up to this many when the trip count is known
GRID_REDUCE_GROUPS = 1024      # work-groups of a two-stage full reduction (at most)
GRID_ITEMS_PER_WORKER = 4      # fewer groups when the range is small: >= this many elements per work-item
_VECTOR_DTYPES = ("float32", "int32", "uint32")


def x_coefficient(index: UOp, x: UOp) -> int | None:
    """c when index == c*x + (terms free of x), else None. (Shared with gpu_tile.)"""
    if index is x:
        return 1
    if x not in index.free_ranges:
        return 0
    op = index.op
    if op in (Ops.ADD, Ops.SUB):
        a, b = x_coefficient(index.src[0], x), x_coefficient(index.src[1], x)
        if a is None or b is None:
            return None
        return a + b if op is Ops.ADD else a - b
    if op is Ops.MUL:
        for v, c in (index.src, index.src[::-1]):
            if c.op is Ops.CONST:
                a = x_coefficient(v, x)
                return None if a is None else a * int(c.arg)
        return None
    if op is Ops.NEG:
        a = x_coefficient(index.src[0], x)
        return None if a is None else -a
    return None


def reduce_identity(dt: DType, op: Ops):
    """The value a reduction's accumulator starts from. (Shared with gpu_tile.)"""
    ident = {Ops.ADD: 0, Ops.MUL: 1, Ops.MAX: dt.min(), Ops.MIN: dt.max()}[op]   # +-inf for floats
    if dt.is_float:
        return float(ident)
    if dt.is_bool:
        return bool(ident)      # MAX is any (from False), MIN is all (from True)
    return ident


def _top_reduces(stores: list[UOp]) -> list[UOp]:
    """REDUCE nodes reachable from the stores without passing through another REDUCE."""
    out: list[UOp] = []
    seen: set[int] = set()
    stack = [s for st in stores for s in st.src[1:]]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if n.op is Ops.REDUCE:
            out.append(n)
            continue
        stack.extend(n.src)
    out.reverse()
    return out


def _store_groups(stores: list[UOp], loads_from: dict[int, frozenset[int]]) -> list[list[UOp]]:
    """Consecutive stores over the same ranges, none reading a buffer another one writes."""
    groups: list[list[UOp]] = []
    written: set[int] = set()
    read: set[int] = set()
    for st in stores:
        g = groups[-1] if groups else None
        st_reads = loads_from.get(id(st), frozenset())
        if g is not None and g[0].free_ranges == st.free_ranges:
            slot = st.src[0].arg
            if slot not in read and slot not in st_reads and not (written & st_reads):
                g.append(st)
                written.add(slot)
                read |= st_reads
                continue
        groups.append([st])
        written, read = {st.src[0].arg}, set(st_reads)
    return groups


def lower(ast: UOp, caps: Capabilities, name: str,
          decompose: Callable[[UOp], UOp | None] | None = None) -> tuple[LinearKernel, LaunchInfo]:
    """Lower a SINK of STOREs for a target with `caps`; `decompose` rewrites ops it lacks."""
    if not isinstance(ast, UOp) or ast.op is not Ops.SINK:
        raise TypeError("a kernel AST is a UOp.sink(...) of stores")
    ast = rewrite(ast, decompose) if decompose is not None else simplify(ast)
    if caps.register_tile is not None:
        from .opt import register_tile
        ast = simplify(register_tile(ast, caps.register_tile))
    if ast.op is not Ops.SINK:
        raise TypeError("decomposition must keep the SINK root")
    scan = scan_kernel(ast)
    if caps.matmul_tile is not None and caps.has_shared:
        from .gpu_tile import tile_contraction
        tiled = tile_contraction(ast, caps, name, scan)
        if tiled is not None:
            return tiled
    return _Lowerer(ast, caps, name).run(scan)
