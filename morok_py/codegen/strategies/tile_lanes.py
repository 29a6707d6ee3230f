"""Register-tile lanes as vectors (CPU, Schedule.tile_lanes).

opt.tile_with_lanes gives each run of w neighbouring columns of a register tile one store whose column
index is col0 + LANE, LANE a LOOP range of w that is never opened as a loop: every value that depends
on it is one w-lane vector. A load whose index steps by 1 along LANE is one w-wide load from the index
at LANE = 0 (aligned to one element only); any other index gathers w scalar loads. Values free of
LANE (the left operand's element, a row's bias) are broadcast where a vector needs them. A reduction
over a LANE-dependent value keeps a vector accumulator. The LLVM printer prints vector types
(<8 x float> accumulators, vector FMAs with a broadcast operand): a 6x16 tile is 12 vector
accumulators, not 96 scalars for LLVM's SLP vectorizer to re-pack, so the IR LLVM optimizes is several
times smaller.
"""
from __future__ import annotations

from ...dtypes import dtypes
from ...ir import Ops, UOp
from ..launch_check import Access
from ..linear import Instr, L
from ..scan import x_coefficient
from ..scope import Scope


def _substitute_lane(node: UOp, lane: UOp, memo: dict[UOp, UOp], built: set[int]) -> UOp:
    """`substitute(node, {lane: memo[lane]})`, rebuilding only the nodes that depend on `lane` (the
    others stay shared, as substitute leaves them). `memo` keeps the rebuilt nodes for the next index of
    the same lane value, `built` their ids."""
    hit = memo.get(node)
    if hit is not None:
        return hit
    order: list[UOp] = []
    stack: list[tuple[UOp, bool]] = [(node, False)]
    while stack:
        n, done = stack.pop()
        if done:
            order.append(n)
            continue
        if n in memo:
            continue
        stack.append((n, True))
        stack.extend((s, False) for s in reversed(n.src) if s not in memo and lane in s.free_ranges)
    for n in order:
        if n not in memo:
            new = memo[n] = UOp(n.op, n.dtype, tuple(memo.get(s, s) for s in n.src), n.arg)
            built.add(id(new))
    return memo[node]


def _add_lane_free_index_ids(node: UOp, lane: UOp, seen: set[UOp], ids: set[int]) -> None:
    """Add to `ids` the ids of the index-typed, non-LOAD nodes of `node` free of `lane` that its
    substitution keeps: reached without passing through the lane range itself (whose end the
    substitution drops). `seen` (holding `lane`) carries the nodes walked for earlier nodes of the same
    lane: what they reach was added then."""
    index = dtypes.index
    stack = [node]
    pop, extend, add = stack.pop, stack.extend, seen.add
    while stack:
        n = pop()
        if n in seen:
            continue
        add(n)
        if n.dtype is index and n.op is not Ops.LOAD and lane not in n.free_ranges:
            ids.add(id(n))
        extend(n.src)


def _add_built_index_ids(out: UOp, built: set[int], seen: set[int], ids: set[int]) -> None:
    """Add to `ids` the ids of the index-typed, non-LOAD nodes of `out` built for one lane value (its
    constant included): reached from `out` through built nodes only; the rest of `out` is the original's
    lane-free part. `seen` carries the built nodes walked for earlier nodes of the same lane value."""
    index = dtypes.index
    stack = [out]
    pop, extend = stack.pop, stack.extend
    while stack:
        n = pop()
        i = id(n)
        if i in seen or i not in built:
            continue
        seen.add(i)
        if n.dtype is index and n.op is not Ops.LOAD:
            ids.add(i)
        extend(n.src)


class TileLanes:
    lane_axes: dict[int, int] = {}      # axis of a lane range -> its width (set by the lowering)

    def lane_of(self, node: UOp) -> UOp | None:
        """The lane range `node` depends on (None: a scalar); once per node (this object lives for one
        kernel, and lane_axes does not change in it)."""
        if not self.lane_axes:
            return None
        memo = self.__dict__.get("_lane_of")
        if memo is None:
            memo = self.__dict__["_lane_of"] = {}
        hit = memo.get(node, memo)
        if hit is not memo:
            return hit
        out = None
        for r in node.free_ranges:
            if r.op is Ops.RANGE and r.arg[0] in self.lane_axes:
                out = r
                break
        memo[node] = out
        return out

    def at_lane(self, node: UOp, lane: UOp, k: int) -> UOp:
        """`node` at lane k (not simplified: simplify costs milliseconds per index and LLVM folds the
        `+ 0`). Index arithmetic stays marked as such: its values at lane k lie within the intervals
        the launch check proved for all lanes, so the renderer's nsw flags still hold."""
        if lane not in node.free_ranges:
            return node
        # per lowering (this object lives for one kernel): the nodes rebuilt for each lane value
        per_lane = self.__dict__.setdefault("_lane_memo", {})
        key = (id(lane), k)
        hit = per_lane.get(key)
        if hit is None:
            hit = per_lane[key] = ({}, set(), set())
        memo, built, built_seen = hit
        if not memo:
            c = memo[lane] = UOp.const(k, dtypes.index)
            built.add(id(c))
        out = _substitute_lane(node, lane, memo, built)
        if id(node) in self.index_nodes:
            # out.toposort()'s index nodes: the lane-free ones of `node` (the same objects in `out`) and
            # the ones built for lane k
            free_seen = self.__dict__.setdefault("_lane_free_seen", {})
            seen = free_seen.get(lane)
            if seen is None:
                seen = free_seen[lane] = {lane}
            _add_lane_free_index_ids(node, lane, seen, self.index_nodes)
            _add_built_index_ids(out, built, built_seen, self.index_nodes)
        return out

    def broadcast(self, ins: Instr, node: UOp, chain: list[Scope], w: int) -> Instr:
        """The scalar `ins` (the value of `node`) in all w lanes, placed where the scalar is."""
        key = ("lanes", node, w)
        hit = self.lookup(key, chain)
        if hit is not None:
            return hit
        depth = self.depth_of(node, chain) if node is not None else len(chain) - 1
        b = self.new(L.BROADCAST, ins.dtype, (ins,))
        b.lanes = w
        self.place(b, chain, depth)
        chain[depth].memo[key] = b
        return b

    def as_lanes(self, ins: Instr, node: UOp, chain: list[Scope], w: int) -> Instr:
        return ins if ins.lanes > 1 else self.broadcast(ins, node, chain, w)

    def emit_lanes(self, node: UOp, lane: UOp, chain: list[Scope], depth: int) -> Instr:
        """A value that depends on `lane` (not a REDUCE: emit_reduces keeps vector accumulators)."""
        w = self.lane_axes[lane.axis]
        if node.op is Ops.RANGE:            # the lane range itself: <0, 1, ..., w-1>
            consts = [self.emit(UOp.const(k, dtypes.index), chain[:1]) for k in range(w)]
            ins = self.new(L.VECTOR, dtypes.index, consts)
            ins.lanes = w
            self.place(ins, chain, 0)
            return ins
        if node.op is Ops.LOAD:
            buf, idx = node.src
            self.record(Access(buf.arg, False, idx, self.open_ranges(chain) + (lane,)))
            if x_coefficient(idx, lane) == 1:
                ins = self.new(L.LOAD, node.dtype, (self.emit(buf, chain), self.emit(self.at_lane(idx, lane, 0), chain)), w)
            else:                           # a gather
                ins = self.new(L.VECTOR, node.dtype, [self.emit(self.at_lane(node, lane, k), chain) for k in range(w)])
            ins.lanes = w
            self.place(ins, chain, depth)
            return ins
        srcs = [self.emit(s, chain) for s in node.src]
        srcs = [self.as_lanes(x, s, chain, w) for x, s in zip(srcs, node.src)]
        ins = self.new(L.ALU, node.dtype, srcs, node.op)
        ins.lanes = w
        ins.index_math = id(node) in self.index_nodes
        self.place(ins, chain, depth)
        return ins

    def merge_lane_groups(self, groups: list[list[UOp]]) -> list[list[UOp]]:
        """Consecutive store groups that differ only in their lane ranges (a tile row of 8 lanes and a
        4-lane remainder vector) share their loops and fused reductions, as store_groups allows for
        stores over the same ranges: none reads a buffer another one writes."""
        if not self.lane_axes:
            return groups
        strip = lambda st: frozenset(r for r in st.free_ranges if r.axis not in self.lane_axes)  # noqa: E731
        out: list[list[UOp]] = []
        for g in groups:
            prev = out[-1] if out else None
            if prev is not None and strip(prev[0]) == strip(g[0]):
                written = {st.src[0].arg for st in prev + g}
                reads = set().union(*(self.loads_from.get(id(st), frozenset()) for st in prev + g))
                if not written & reads:
                    prev.extend(g)
                    continue
            out.append(list(g))
        return out

    def store_lanes(self, store: UOp, lane: UOp, chain: list[Scope]) -> list[Instr]:
        """The STOREs of one lane-vector store: one w-wide store where the index steps by 1 along the
        lane, else one scalar store per lane."""
        buf, idx, val = store.src
        w = self.lane_axes[lane.axis]
        self.record(Access(buf.arg, True, idx, self.open_ranges(chain) + (lane,)))
        b = self.emit(buf, chain)
        v = self.emit(val, chain)
        if x_coefficient(idx, lane) == 1:
            st = self.new(L.STORE, None, (b, self.emit(self.at_lane(idx, lane, 0), chain), self.as_lanes(v, val, chain, w)), w)
            st.lanes = w
            return [st]
        out = []
        for k in range(w):
            x = v
            if v.lanes > 1:
                x = self.new(L.EXTRACT, val.dtype, (v,), k)
                chain[-1].insert(x)
            out.append(self.new(L.STORE, None, (b, self.emit(self.at_lane(idx, lane, k), chain), x)))
        return out
