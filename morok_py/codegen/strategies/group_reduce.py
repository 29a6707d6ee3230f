"""Group reduction: one work-group per output row (at most one GLOBAL range), its work-items stride
over the row and combine their partial results in shared memory or through warp shuffles
(Schedule.reduce == "group"; also the combine step of "grid").

Schedule.row_groups > 0 launches that many work-groups instead of one per row; work-group g walks rows
g, g + row_groups, ... So only row_groups rows are in flight at once: a row that several passes read
(softmax: max, sum, output) and that is too long for the row cache stays in L2 between its passes
(row_groups x the row's bytes below the L2), and each row comes from DRAM once instead of once per pass."""
from __future__ import annotations

from ...dtypes import dtypes
from ...ir import AxisType, Ops, UOp, substitute
from ..launch_check import SteppedLoop
from ..linear import If, Instr, L, Loop
from ..scan import x_coefficient
from ..scope import Scope
from ..symbolic import simplify

ROW_GROUPS = 128        # default row_groups: rows in flight (at 1024 work-items each, one per SM of an H100's
                        # 132); x a 201 KB vocabulary row = 26 MB of the H100's 50 MB L2
ROW_GROUPS_MIN_BYTES = 48 * 1024    # rows shorter than this are left one work-group per row by default


_HALF_DTYPES = ("float16", "bfloat16")
_WIDE_DTYPES = ("float32", "int32", "uint32")    # Schedule.vector_width on group_per_row: w-wide row loads


class GroupReduce:
    row_loop = None     # with Schedule.row_groups: the GLOBAL range the work-group walks in a loop

    def vector_reduce_plan(self, nodes: list[UOp], ranges: list[UOp]):
        """A cooperative (group or grid) reduction over one range r whose loads of r are all 16-bit and
        contiguous in r: each work-item takes chunks of w = 2 x the target's 32-bit vector width (8 halves,
        16 bytes: as many bytes per load as a float4) in one vector load per buffer (benchmarks/half_bandwidth.py: scalar half
        loads moved 2 bytes where float32 moves 4, at 0.8x its bytes/s). (r, w, loads, their row bases
        with r = 0); None for any other reduction, which keeps the scalar group-strided loop."""
        wide = self.schedule.vector_width if self.group_mode else 1     # 32-bit rows as vectors (small_shapes)
        if (self.split_mode or self.lane_axes or len(ranges) != 1 or self.caps.vector_width < 2
                or self.unroll_copy is not None):
            return None
        r, w = ranges[0], 2 * self.caps.vector_width
        if wide > 1 and any(n.op is Ops.LOAD and n.dtype is not None and n.dtype.name in _WIDE_DTYPES
                            and r in n.free_ranges for node in nodes for n in node.src[0].toposort()):
            w = wide
            allowed = _WIDE_DTYPES
        else:
            allowed = _HALF_DTYPES
        loads = []
        for node in nodes:
            for n in node.src[0].toposort():
                if r not in n.free_ranges:
                    continue
                if n.op is Ops.REDUCE:
                    return None
                if n.op is Ops.LOAD:
                    if (n.dtype is None or n.dtype.name not in allowed or n.src[0].op is not Ops.PARAM
                            or x_coefficient(n.src[1], r) != 1 or n in self.row_cache):
                        return None
                    if n not in loads:
                        loads.append(n)
        if not loads:
            return None
        bases = [simplify(substitute(n.src[1], {r: UOp.const(0, dtypes.index)})) for n in loads]
        if any(b.op is Ops.CONST and b.arg % w for b in bases):
            return None      # every row starts misaligned: the scalar loop
        return r, w, loads, bases

    def emit_vector_reduces(self, nodes: list[UOp], accs: list[Instr], plan, chain: list[Scope], depth: int) -> None:
        """The reduction loop of `vector_reduce_plan`: chunk c of w elements (c from the item's start, by
        the group's or grid's stride, below nvec = E / w, or 0 when some row base is no multiple of w) is
        one w-wide load per buffer, its lanes combined pairwise in the accumulation dtype and then into the
        accumulator; the elements [nvec * w, E) (the tail, or the whole row when misaligned) follow in the
        scalar strided loop."""
        r, w, loads, bases = plan
        idx = dtypes.index
        put = lambda it: self.place(it, chain, depth)  # noqa: E731
        inner = chain[:depth + 1]
        end = self.emit(r.src[0], inner)
        if self.dist is not None:    # grid: the whole grid strides over the range
            start, step, step_size = self.dist
        else:
            start, step_size = self.lid, UOp.const(self.group_size, idx)
            step = self.emit(step_size, inner)
        self.stepped.append(SteppedLoop(r.src[0], step_size))   # both loops' counters stay below end + step
        wc = self.emit(UOp.const(w, idx), inner)
        shift = self.emit(UOp.const(w.bit_length() - 1, idx), inner)
        nvec = self.new(L.ALU, idx, (end, shift), Ops.SHR); nvec.index_math = True
        put(nvec)
        checked = [b for b in bases if b.op is not Ops.CONST]
        if checked:
            mask = self.emit(UOp.const(w - 1, idx), inner)
            zero = self.emit(UOp.const(0, idx), inner)
            cond = None
            for b in checked:
                bi = self.emit(b, inner)
                m = self.new(L.ALU, idx, (bi, mask), Ops.AND)
                c = self.new(L.ALU, dtypes.bool, (m, zero), Ops.CMPEQ)
                put(m), put(c)
                if cond is not None:
                    c = self.new(L.ALU, dtypes.bool, (cond, c), Ops.AND)
                    put(c)
                cond = c
            nvec = self.new(L.ALU, idx, (cond, nvec, zero), Ops.WHERE)
            put(nvec)
        static = self.dist is None and r.src[0].op is Ops.CONST

        vloop = Loop(self.new(L.LOOPVAR, idx), start, nvec, AxisType.REDUCE, step=step,
                     unroll=self.strided_unroll(r.src[0].arg // w if static else None))
        put(vloop)
        chain[depth].open_children.append(vloop)
        xv = self.new(L.ALU, idx, (vloop.var, wc), Ops.MUL); xv.index_math = True
        vloop.body.append(xv)
        lanes = self.lane_scopes(vloop, r, xv, w, inner)       # strategies/vectorize.py
        for ld in loads:
            v = self.new(L.LOAD, ld.dtype, (self.emit(ld.src[0], inner), self.emit(ld.src[1], lanes[0])), w)
            vloop.body.append(v)
            self.vec_loads[ld] = v
        for node, acc in zip(nodes, accs):
            vals = []
            for k in range(w):
                self.vec_lane = k
                vals.append(self.emit(node.src[0], lanes[k]))
            self.vec_lane = None
            while len(vals) > 1:     # pairwise: a short dependency chain, in the accumulation dtype
                nxt = []
                for a, b in zip(vals[::2], vals[1::2]):
                    v = self.new(L.ALU, node.dtype, (a, b), node.arg); v.reassoc = True
                    vloop.body.append(v)
                    nxt.append(v)
                vals = nxt
            cur = self.new(L.ACC_LOAD, node.dtype, (acc,))
            upd = self.new(L.ALU, node.dtype, (cur, vals[0]), node.arg); upd.reassoc = True
            vloop.body.extend([cur, upd, self.new(L.ACC_STORE, None, (acc, upd))])
        for ld in loads:
            del self.vec_loads[ld]
        chain[depth].open_children.pop()
        # the tail (or a misaligned row, whole): the scalar strided loop from nvec * w
        done = self.new(L.ALU, idx, (nvec, wc), Ops.MUL); done.index_math = True
        tstart = self.new(L.ALU, idx, (done, start), Ops.ADD); tstart.index_math = True
        put(done), put(tstart)
        tloop = Loop(self.new(L.LOOPVAR, idx), tstart, end, AxisType.REDUCE, step=step,
                     unroll=0 if not checked else self.strided_unroll(r.src[0].arg if static else None))
        put(tloop)
        chain[depth].open_children.append(tloop)
        tail = inner + [Scope(tloop.body, r, tloop)]
        tail[-1].memo[r] = tloop.var
        for node, acc in zip(nodes, accs):
            val = self.emit(node.src[0], tail)
            cur = self.new(L.ACC_LOAD, node.dtype, (acc,))
            upd = self.new(L.ALU, node.dtype, (cur, val), node.arg); upd.reassoc = True
            for ins in (cur, upd, self.new(L.ACC_STORE, None, (acc, upd))):
                self.place(ins, tail, len(tail) - 1)
        chain[depth].open_children.pop()
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
        split = self.schedule.row_split if grid is not None and globals_ else 0
        if split > 1:
            # split rows (strategies/grid_reduce.py): group g takes part g % P of row g / P
            shift = self.new(L.CONST, dtypes.index, (), split.bit_length() - 1)
            mask = self.new(L.CONST, dtypes.index, (), split - 1)
            row = self.new(L.ALU, dtypes.index, (gid, shift), Ops.SHR); row.index_math = True
            part = self.new(L.ALU, dtypes.index, (gid, mask), Ops.AND); part.index_math = True
            top.items.extend([shift, mask, row, part])
            self.grid_rows = (row, part, split)
            self.global_instr[id(globals_[0])] = row
            dims = [simplify(globals_[0].src[0] * split)]
            guard = If(self.emit(UOp.const(True, dtypes.bool), chain))
            top.items.append(guard)
            top.open_children.append(guard)
            inner = Scope(guard.body, None, guard)
            inner.memo[globals_[0]] = row
            return chain + [inner], dims, (size, 1, 1)
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
