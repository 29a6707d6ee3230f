"""Group reduction: one work-group per output row (at most one GLOBAL range), its work-items stride
over the row and combine their partial results in shared memory or through warp shuffles
(Schedule.reduce == "group"; also the combine step of "grid").

Schedule.row_groups > 0 launches that many work-groups instead of one per row; work-group g walks rows
g, g + row_groups, ... So only row_groups rows are in flight at once: a row that several passes read
(softmax: max, sum, output) and that is too long for the row cache stays in L2 between its passes
(row_groups x the row's bytes below the L2), and each row comes from DRAM once instead of once per pass."""
from __future__ import annotations

from ...dtypes import dtypes
from ...ir import AxisType, Ops, UOp
from ..launch_check import SteppedLoop
from ..linear import If, Instr, L, Loop
from ..scope import Scope

ROW_GROUPS = 128        # default row_groups: rows in flight (at 1024 work-items each, one per SM of an H100's
                        # 132); x a 201 KB vocabulary row = 26 MB of the H100's 50 MB L2
ROW_GROUPS_MIN_BYTES = 48 * 1024    # rows shorter than this are left one work-group per row by default


class GroupReduce:
    row_loop = None     # with Schedule.row_groups: the GLOBAL range the work-group walks in a loop
    def combine_in_group(self, part: Instr, op: Ops, chain: list[Scope], depth: int) -> Instr:
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

    def combine_with_shuffles(self, part: Instr, op: Ops, chain: list[Scope], depth: int, w: int,
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


    def map_to_group_per_row(self, globals_: list[UOp], chain: list[Scope], grid=None):
        """GPU row kernels: work-group g handles row g of the (at most one) GLOBAL range; its
        work-items share the row's loops and reductions. A grid reduction launches its group count."""
        top = chain[0]
        self.group_size = size = self.schedule.group
        self.gid = gid = self.new(L.SPECIAL, dtypes.index, (), ("group_id", 0))
        self.lid = self.new(L.SPECIAL, dtypes.index, (), ("local_id", 0))
        top.items.extend([gid, self.lid])
        self.gpu_ids.append(gid)
        inner = Scope([], None)
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
        inner = Scope(guard.body, None, guard)
        if globals_ and self.schedule.row_groups:
            # row_groups work-groups (fewer for fewer rows), group g walks rows g, g + row_groups, ...
            rows, n = globals_[0].src[0], self.schedule.row_groups
            dims = [rows.minimum(n) if rows.op is not Ops.CONST else UOp.const(min(rows.arg, n), dtypes.index)]
            step = UOp.const(n, dtypes.index)
            loop = Loop(self.new(L.LOOPVAR, dtypes.index), gid, self.emit(rows, chain + [inner]), AxisType.GLOBAL,
                        step=self.emit(step, chain + [inner]))
            inner.insert(loop)
            inner.open_children.append(loop)
            self.stepped.append(SteppedLoop(rows, step))     # starts: the group ids, all below row_groups
            self.row_loop = globals_[0]
            rows_scope = Scope(loop.body, globals_[0], loop)
            rows_scope.memo[globals_[0]] = loop.var
            return chain + [inner, rows_scope], dims, (size, 1, 1)
        for r in globals_:
            inner.memo[r] = gid
        return chain + [inner], dims, (size, 1, 1)



def row_groups_default(ast: UOp, globals_, scan) -> int:
    """The default Schedule.row_groups of a row kernel: ROW_GROUPS when some row is read by several passes
    and is too long for the row cache (at least ROW_GROUPS_MIN_BYTES) and there are more rows than that
    (or a symbolic count); else 0 (one work-group per row)."""
    from .row_cache import row_cache_plan
    if len(globals_) != 1:
        return 0
    rows = globals_[0].src[0]
    if rows.op is Ops.CONST and rows.arg <= ROW_GROUPS:
        return 0
    cached = row_cache_plan(ast, globals_, scan)
    for load, (r, _) in row_cache_plan(ast, globals_, scan, budget=1 << 62).items():
        if load not in cached and r.src[0].arg * load.dtype.itemsize >= ROW_GROUPS_MIN_BYTES:
            return ROW_GROUPS
    return 0
