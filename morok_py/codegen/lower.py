"""Lowering: a scheduled kernel AST -> LinearKernel, shared by every renderer.

`lower` simplifies the AST (and rewrites what the target lacks), picks the schedule
(codegen/schedule.py: the caller's, or the heuristic default) and applies it mechanically: the CPU
register tile (opt.py) and GPU shared-memory tiles (gpu_tile.py) rewrite or replace the lowering;
otherwise GLOBAL ranges become launch dimensions (GPU) or the thread split (CPU), REDUCE becomes an
accumulator loop (or a group / two-stage grid reduction, codegen/strategies/), index arithmetic is
simplified, and every load and store is recorded with its index expression so that launches can be
bounds-checked for concrete variable values (launch_check.LaunchInfo).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable

from ..errors import ArgumentError, ArgumentTypeError
from ..dtypes import DType, dtypes
from ..ir import AxisType, Ops, UOp
from .capabilities import Capabilities
from .decompose import defined_division
from .launch_check import (Access, HiddenBuffer, LaunchInfo, SteppedLoop, Variable,  # noqa: F401 (re-exported)
                           merge_accesses)
from .linear import If, Instr, Item, L, LinearKernel, Loop, ParamInfo
from .scan import KernelScan, reduce_identity, scan_kernel, store_groups, top_reduces, x_coefficient  # noqa: F401
from .schedule import Schedule, check_schedule, chosen, default_schedule
from .scope import Scope
from .strategies.grid_reduce import GRID_REDUCE_GROUPS, GridReduce, grid_plan  # noqa: F401 (re-exported)
from .strategies.group_reduce import GroupReduce
from .strategies.row_cache import ROW_CACHE_BYTES, RowCache, row_cache_plan  # noqa: F401 (re-exported)
from .strategies.split_reduce import SplitReduce
from .strategies.tile_lanes import TileLanes
from .strategies.vectorize import Vectorize, vector_plan
from .symbolic import rewrite, simplify

__all__ = ["Access", "Capabilities", "GRID_REDUCE_GROUPS", "HiddenBuffer", "KernelScan", "LaunchInfo",
           "ROW_CACHE_BYTES", "Schedule", "SteppedLoop", "Variable", "lower", "merge_accesses", "reduce_identity",
           "scan_kernel", "x_coefficient"]

GPU_STRIDED_UNROLL = 4         # group-strided loops: unroll hint, so each item has several loads in flight
GPU_STRIDED_UNROLL_MAX = 16    # ... up to this many when the trip count is known


class _Lowerer(GroupReduce, GridReduce, RowCache, SplitReduce, Vectorize, TileLanes):
    """Emits the linear kernel of one AST under one schedule: the core (placement of values in loops,
    reductions as accumulator loops, stores) lives here, the strategies in their mixins."""

    def __init__(self, ast: UOp, caps: Capabilities, name: str, schedule: Schedule,
                 lane_axes: dict[int, int] | None = None, scratch: tuple | None = None) -> None:
        self.ast, self.caps, self.name, self.schedule = ast, caps, name, schedule
        self.lane_axes = lane_axes or {}           # register-tile lane ranges (strategies/tile_lanes)
        self.scratch = scratch                     # (slot, dtype, elements): packed panels (opt.tile_with_lanes)
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
        self.split_mode = False                    # Schedule.split > 1 (strategies/split_reduce)
        self.store_guard: Instr | None = None      # split mode: the items that store
        self.lid_x: Instr | None = None
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
    def depth_of(self, node: UOp, chain: list[Scope]) -> int:
        """The innermost scope of `chain` whose range `node` depends on (at least min_depth)."""
        d = min(self.min_depth, len(chain) - 1)
        rs = node.free_ranges
        if rs:
            for i in range(len(chain) - 1, d, -1):
                r = chain[i].range
                if r is not None and r in rs:
                    return i
        return d

    def place(self, instr: Item, chain: list[Scope], depth: int) -> None:
        chain[depth].insert(instr)

    def lookup(self, node: UOp, chain: list[Scope]) -> Instr | None:
        for sc in reversed(chain):
            hit = sc.memo.get(node)
            if hit is not None:
                return hit
        return None

    # emission -----------------------------------------------------------------------------
    def emit(self, node: UOp, chain: list[Scope]) -> Instr:
        for sc in reversed(chain):      # self.lookup, inline: the hot path
            hit = sc.memo.get(node)
            if hit is not None:
                return hit
        if self.unroll_copy is not None and node.op is Ops.LOAD:    # split loops unrolled here (split_reduce)
            hit = self.emit_unrolled_load(node, chain)
            if hit is not None:
                return hit
        if self.lane_axes and node.op is not Ops.REDUCE:
            lane = self.lane_of(node)
            if lane is not None:
                depth = self.depth_of(node, chain)
                out = self.emit_lanes(node, lane, chain, depth)
                chain[depth].memo[node] = out
                return out
        if node.op is Ops.RANGE:
            if id(node) in self.global_instr:
                return self.global_instr[id(node)]
            raise ArgumentError(f"range of axis {node.axis} ({node.axis_type.name}) is used outside the loop that "
                                f"defines it")
        depth = self.depth_of(node, chain)
        if node.op is Ops.REDUCE:
            if (self.group_mode or self.split_mode) and self.at_group_top(chain, depth):
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

    def record(self, a: Access) -> None:
        """One bounds check per distinct access (vector lanes emit the same access several times)."""
        key = (a.slot, a.store, id(a.index), tuple(id(r) for r in a.enclosing))
        if self.scratch is not None and a.slot == self.scratch[0]:
            return      # the hidden scratch: indexed within its size by construction, not the caller's
        if key not in self.access_keys:
            self.access_keys.add(key)
            self.accesses.append(a)

    def open_ranges(self, chain: list[Scope]) -> tuple[UOp, ...]:
        return tuple(sc.range for sc in chain if sc.range is not None)

    def strided_unroll(self, extent: int | None) -> int:
        """The unroll hint of a group-strided loop over `extent` elements: a known trip count is unrolled
        whole (up to GPU_STRIDED_UNROLL_MAX) so all of an item's loads are in flight; None (unknown, or
        grid-strided) gets GPU_STRIDED_UNROLL."""
        if extent is None:
            return GPU_STRIDED_UNROLL
        trips = -(-extent // self.group_size)
        return min(GPU_STRIDED_UNROLL_MAX, trips) if trips > 1 else 0

    def open_loop(self, rng: UOp, chain: list[Scope], depth: int, distributed: bool = False,
                  unroll: int = 0) -> list[Scope]:
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
        if distributed:
            unroll = self.strided_unroll(rng.src[0].arg if self.dist is None and rng.src[0].op is Ops.CONST else None)
            if self.split_mode:
                unroll = self.schedule.unroll
        loop = Loop(self.new(L.LOOPVAR, dtypes.index), start, end, rng.axis_type, step=step, unroll=unroll)
        self.place(loop, chain, depth)
        chain[depth].open_children.append(loop)
        new_chain = chain[:depth + 1] + [Scope(loop.body, rng, loop)]
        new_chain[-1].memo[rng] = loop.var
        return new_chain

    @staticmethod
    def close_loops(chain: list[Scope], count: int) -> None:
        for sc_parent, sc in list(zip(chain[:-1], chain[1:]))[::-1][:count]:
            popped = sc_parent.open_children.pop()
            assert popped is sc.owner

    def emit_reduce(self, node: UOp, chain: list[Scope], depth: int) -> Instr:
        self.emit_reduces([node], chain, depth)
        return chain[depth].memo[node]

    def at_group_top(self, chain: list[Scope], depth: int) -> bool:
        """In group mode: no loop is open between the group's top and `depth` (but the loop over the rows
        of Schedule.row_groups, whose trip count is the same for the whole group)."""
        return all(sc.range is None or sc.range is self.row_loop for sc in chain[:depth + 1])

    def emit_reduces(self, nodes: list[UOp], chain: list[Scope], depth: int, cooperative: bool = False) -> None:
        """REDUCEs over the same ranges share one loop nest, one accumulator each. A cooperative
        reduce strides its outermost range over the work-group, then combines the partial results
        through shared memory; every work-item gets the result."""
        ranges = sorted(nodes[0].src[1:], key=lambda r: r.axis)
        accs = []
        for node in nodes:
            acc = self.new(L.ACC, node.dtype, (), reduce_identity(node.dtype, node.arg))
            lane = self.lane_of(node)
            if lane is not None:                    # a vector accumulator (strategies/tile_lanes)
                acc.lanes = self.lane_axes[lane.axis]
            self.place(acc, chain, depth)
            accs.append(acc)
        inner = chain[:depth + 1]
        serial_unroll = self.schedule.unroll if not cooperative else 0
        by = self.split_unroll(ranges) if cooperative and self.split_mode else 0
        vplan = self.vector_reduce_plan(nodes, ranges) if cooperative else None
        if vplan is not None:   # 16-bit loads as 16-byte vectors (strategies/group_reduce.py)
            self.emit_vector_reduces(nodes, accs, vplan, chain, depth)
            copies = None
        elif by:    # unrolled by the lowering (strategies/split_reduce.py): one scope per copy
            copies = self.open_unrolled(ranges[0], inner, by)
        else:
            for n_r, r in enumerate(ranges):
                inner = self.open_loop(r, inner, len(inner) - 1, distributed=cooperative and n_r == 0,
                                       unroll=serial_unroll if n_r == len(ranges) - 1 else 0)
            copies = [inner]
        for inner in copies or ():
            for node, acc in zip(nodes, accs):
                val = self.emit(node.src[0], inner)
                if acc.lanes > 1:
                    val = self.as_lanes(val, node.src[0], inner, acc.lanes)
                cur = self.new(L.ACC_LOAD, node.dtype, (acc,))
                upd = self.new(L.ALU, node.dtype, (cur, val), node.arg)
                upd.reassoc = True
                put = self.new(L.ACC_STORE, None, (acc, upd))
                cur.lanes = upd.lanes = put.lanes = acc.lanes
                for ins in (cur, upd, put):
                    self.place(ins, inner, len(inner) - 1)
        self.unroll_copy = None
        if copies is not None:
            self.close_loops(copies[0], len(ranges))
        for node, acc in zip(nodes, accs):
            res = self.new(L.ACC_LOAD, node.dtype, (acc,))
            res.lanes = acc.lanes
            self.place(res, chain, depth)
            if cooperative:
                res = (self.combine_split if self.split_mode else self.combine_in_group)(res, node.arg, chain, depth)
            chain[depth].memo[node] = res


    def emit_group(self, stores: list[UOp], chain: list[Scope]) -> None:
        """Stores over the same ranges share their loops; their reductions are fused."""
        for store in stores:
            bad = [r for r in store.free_ranges if r.axis_type is AxisType.REDUCE]
            if bad:
                raise ArgumentError(f"store to buffer {store.src[0].arg} uses REDUCE range(s) of axis "
                                    f"{sorted(r.axis for r in bad)} outside a reduce(); reduce them or make them "
                                    f"LOOP ranges")
        loops = sorted((r for r in stores[0].free_ranges if r.axis_type is AxisType.LOOP
                        and r.axis not in self.lane_axes), key=lambda r: r.axis)
        for n_r, r in enumerate(loops):
            chain = self.open_loop(r, chain, len(chain) - 1, distributed=self.group_mode and n_r == 0)
        if len(stores) > 1:
            buckets: dict[tuple, list[UOp]] = {}
            coop: dict[tuple, list[UOp]] = {}     # split mode (upcast): cooperative reduces share one loop too
            for red in top_reduces(stores):
                if self.lookup(red, chain) is None and not ((self.group_mode or self.split_mode) and
                                                          self.at_group_top(chain, self.depth_of(red, chain))):
                    key = (tuple(sorted(red.src[1:], key=lambda r: r.axis)), self.depth_of(red, chain))
                    buckets.setdefault(key, []).append(red)
                elif self.lookup(red, chain) is None and self.split_mode:
                    key = (tuple(sorted(red.src[1:], key=lambda r: r.axis)), self.depth_of(red, chain))
                    coop.setdefault(key, []).append(red)
            for (_, depth), reds in buckets.items():
                if len(reds) > 1:
                    self.emit_reduces(reds, chain, depth)
            for (_, depth), reds in coop.items():
                if len(reds) > 1:
                    self.emit_reduces(reds, chain, depth, cooperative=True)
        for store in stores:
            buf, idx, val = store.src
            lane = self.lane_of(store) if self.lane_axes else None
            if lane is not None:
                for st in self.store_lanes(store, lane, chain):
                    chain[-1].insert(st)
                continue
            self.record(Access(buf.arg, True, idx, self.open_ranges(chain)))
            srcs = [self.emit(buf, chain), self.emit(idx, chain), self.emit(val, chain)]
            st = self.new(L.STORE, None, srcs)
            if self.group_mode and not loops:
                # one output per work-group: work-item 0 writes it
                zero = self.emit(UOp.const(0, dtypes.index), chain)
                cond = self.new(L.ALU, dtypes.bool, (self.lid, zero), Ops.CMPEQ)
                chain[-1].insert(cond)
                chain[-1].insert(If(cond, [st]))
            elif self.store_guard is not None:
                chain[-1].insert(If(self.store_guard, [st]))
            else:
                chain[-1].insert(st)
        self.close_loops(chain, len(loops))

    def invalidate(self, chain: list[Scope], slot: int) -> None:
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
        if self.scratch is not None:       # a hidden buffer after the caller's (the runtime allocates it)
            slot, dt, count = self.scratch
            pinfo = [p for p in pinfo if p.slot != slot]
            self.hidden.append(HiddenBuffer(dt, count))
            self.hidden_params.append(ParamInfo(slot, dt, True, True))
        globals_ = sorted((r for r in ranges.values() if r.axis_type is AxisType.GLOBAL), key=lambda r: r.axis)

        body: list[Item] = []
        top = Scope(body, None)
        chain = [top]
        dims: list[UOp] = []
        local = (1, 1, 1)
        sched = self.schedule
        self.group_mode = sched.mapping == "group_per_row"
        self.n_params = len(pinfo)
        vector = None
        if self.group_mode:
            grid = grid_plan(ast, globals_, sched.group, sched.row_split) if sched.reduce == "grid" else None
            if sched.row_cache:
                self.row_cache = row_cache_plan(ast, globals_, scan)
            chain, dims, local = self.map_to_group_per_row(globals_, chain, grid)
            self.min_depth = len(chain) - 1
            if grid is not None:
                chain = self.emit_grid_reduces(grid, chain)
        elif caps.has_local and sched.split > 1:
            self.split_mode = True
            chain, dims, local = self.map_to_split_groups(ast, globals_, chain)
        elif caps.has_local:
            if sched.vector_width > 1:
                vector = vector_plan(ast, globals_, scan, sched.vector_width)
            chain, dims, local = self.map_to_groups(globals_, chain, vector)
            self.min_depth = len(chain) - 1
        else:
            chain, dims = self.map_to_loops(globals_, chain)
        for group in ([] if vector is not None else self.merge_lane_groups(store_groups(list(ast.src), self.loads_from))):
            gchain, guarded = chain, False
            if globals_ and not any(r.axis_type is AxisType.GLOBAL for r in group[0].free_ranges):
                if self._into_scratch(group):
                    gchain = chain[:1]      # each chunk's own scratch (CPU): filled in every call, before its loop
                else:
                    gchain, guarded = self.first_worker_chain(chain, caps), True
            self.emit_group(group, gchain)
            if guarded:
                gchain[0].open_children.pop()
            for store in group:
                self.invalidate(chain, store.src[0].arg)
        if vector is not None:
            self.emit_vectorized(list(ast.src), chain, vector)
        self.finish_row_cache(body)
        kernel = LinearKernel(self.name, pinfo + self.hidden_params, [v.name for v in var_list], body, local,
                              thread_split=not caps.has_local, gpu=caps.has_local, schedule=sched,
                              min_groups=sched.min_groups)
        info = LaunchInfo(pinfo, var_list, dims, local, caps.has_local, self.accesses,
                          [r.src[0] for r in ranges.values()], caps.grid_max, group_per_item=self.group_mode,
                          hidden=self.hidden, stepped_loops=self.stepped)
        return kernel, info


    def _into_scratch(self, group: list[UOp]) -> bool:
        """Whether every store of `group` writes the hidden scratch (a thread's own packed panel)."""
        if self.scratch is None:
            return False
        return all(s.src[0].op is Ops.PARAM and s.src[0].arg == self.scratch[0] for s in group)

    def first_worker_chain(self, chain: list[Scope], caps: Capabilities) -> list[Scope]:
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
        return [top, Scope(guard.body, None, guard)]

    def map_to_loops(self, globals_: list[UOp], chain: list[Scope]):
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
                chain = chain + [Scope(loop.body, r, loop)]
                chain[-1].memo[r] = loop.var
            else:
                chain = self.open_loop(r, chain, len(chain) - 1)
        return chain, [globals_[0].src[0]]

    def map_to_groups(self, globals_: list[UOp], chain: list[Scope], vector=None):
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
        inner = Scope(guard.body, None, guard)
        # values of the global ranges are defined at the top: make them visible in the guarded body
        for g in groups:
            for r in g:
                if vector is None or r is not vector[0]:
                    inner.memo[r] = self.global_instr[id(r)]
        return chain + [inner], dims, local

    def choose_local(self, dims: list[UOp]) -> tuple[int, int, int]:
        caps = self.caps
        budget = self.schedule.group
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




def lower(ast: UOp, caps: Capabilities, name: str,
          decompose: Callable[[UOp], UOp | None] | None = None,
          schedule: Schedule | None = None) -> tuple[LinearKernel, LaunchInfo]:
    """Lower a SINK of STOREs for a target with `caps`; `decompose` rewrites ops it lacks. `schedule`
    (or, when None, the one `schedule.using` names, else `default_schedule`) says how; ValueError
    when the kernel cannot take a given schedule."""
    if not isinstance(ast, UOp) or ast.op is not Ops.SINK:
        raise ArgumentTypeError("a kernel AST is a UOp.sink(...) of stores")
    ast = rewrite(ast, decompose) if decompose is not None else simplify(ast)
    if ast.op is not Ops.SINK:
        raise ArgumentTypeError("decomposition must keep the SINK root")
    ast = defined_division(ast)     # integer division that cannot trap; what lowering adds is index math
    scan = scan_kernel(ast)
    given = schedule if schedule is not None else chosen()
    if given is not None:
        check_schedule(given, ast, caps, scan)
    schedule = given if given is not None else default_schedule(ast, caps, scan)
    lane_axes: dict[int, int] = {}
    scratch = None
    if schedule.register_tile is not None:
        from .opt import tile_with_lanes
        ast, lane_axes, scratch = tile_with_lanes(ast, schedule.register_tile, schedule.tile_lanes, schedule.pack,
                                                  caps.threads)
        ast = simplify(ast)
        scan = scan_kernel(ast)
    elif schedule.reduce == "stream":
        from .opt import stream_columns
        ast = simplify(stream_columns(ast, schedule.stream_block))
        scan = scan_kernel(ast)
    elif schedule.block_permute:
        from .strategies.permute import cpu_block_permute, cpu_block_plan
        ast = simplify(cpu_block_permute(ast, cpu_block_plan(ast, scan), schedule.block_permute))
        scan = scan_kernel(ast)
    elif schedule.upcast:
        from .strategies.split_reduce import upcast, upcast_plan
        ast = simplify(upcast(ast, upcast_plan(ast, scan)))
        scan = scan_kernel(ast)
    if schedule.permute:
        from .strategies.permute import lower_permute
        moved = lower_permute(ast, caps, name, scan, schedule.permute, schedule.group)
        if moved is not None:
            moved[0].schedule = schedule
            return moved
    if schedule.mapping == "tiled":
        from .gpu_tile import tile_contraction
        if schedule.tensor_core is not None:
            from .strategies.matrix_units import tile_mma
            tiled = tile_mma(ast, caps, name, scan, schedule.matmul_tile, schedule.tensor_core,
                             schedule.tc_stages, schedule.tc_swizzle)
        else:
            tiled = tile_contraction(ast, caps, name, scan, schedule.matmul_tile, schedule.async_fill, schedule.split_k)
        if tiled is not None:
            tiled[0].schedule = schedule
            return tiled
        if given is not None:
            raise ArgumentError(f"{schedule}: the tiles do not fit the target's shared memory")
        schedule = default_schedule(ast, replace(caps, matmul_tile=None), scan)   # the general path
    kernel, info = _Lowerer(ast, caps, name, schedule, lane_axes, scratch).run(scan)
    if schedule.prefetch and not kernel.gpu:
        from .prefetch import prefetch_tile_epilogues
        prefetch_tile_epilogues(kernel)
    return kernel, info
