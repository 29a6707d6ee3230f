"""Two-stage grid reduction: a full reduction (no GLOBAL range) split over many work-groups; each
writes a partial to a hidden buffer, the last group to finish combines them (Schedule.reduce == "grid").

Split rows (Schedule.row_split = P > 1): a reduction over one GLOBAL range of few constant rows (fewer than
the GPU has SMs: 8 rows of 128k columns) runs each row on P work-groups: group g takes row g / P and strides
part g % P of it; each row has its own partials and ticket counter, and the last of its P groups to finish
combines them and runs the rest of the kernel for that row (the stores)."""
from __future__ import annotations

from ...dtypes import DType, dtypes
from ...ir import AxisType, Ops, UOp
from ..launch_check import HiddenBuffer, SteppedLoop
from ..linear import If, Instr, L, Loop, ParamInfo
from ..scan import reduce_identity, top_reduces
from ..scope import Scope
from ..symbolic import simplify

GRID_REDUCE_GROUPS = 1024      # work-groups of a two-stage full reduction (at most)
GRID_ITEMS_PER_WORKER = 4      # fewer groups when the range is small: >= this many elements per work-item


def grid_plan(ast: UOp, globals_, group: int, row_split: int = 0) -> "tuple[list[UOp], UOp] | None":
    """A full reduction (no GLOBAL range) whose top-level REDUCEs share their ranges is split over
    up to GRID_REDUCE_GROUPS work-groups of `group` items: (the reduces, the group count as a UOp of
    the sizes); None for any other kernel. `row_split` P > 1: a reduction over one GLOBAL range of
    constant R rows (R x P <= GRID_REDUCE_GROUPS, P a power of two), every store over that range only:
    (the reduces, P, the groups of one row)."""
    if row_split > 1:
        return row_grid_plan(ast, globals_, row_split)
    if globals_:
        return None
    reds = top_reduces(list(ast.src))
    if not reds or any(r.free_ranges for r in reds):
        return None
    keys = {tuple(sorted((id(x) for x in r.src[1:]))) for r in reds}
    if len(keys) != 1:
        return None
    outer = min(reds[0].src[1:], key=lambda r: r.axis)
    per_group = group * GRID_ITEMS_PER_WORKER
    # max(1, min(G, ceil(E / per_group))), written so that no intermediate overflows
    groups = ((outer.src[0] - 1) // per_group + 1).minimum(GRID_REDUCE_GROUPS).maximum(1)
    return reds, simplify(groups)


def row_grid_plan(ast: UOp, globals_, parts: int) -> "tuple[list[UOp], UOp] | None":
    """`grid_plan` with split rows: (the reduces, the constant P as a UOp); None where the kernel is not a
    reduction over one GLOBAL range of constant rows, all its top REDUCEs over the same ranges and free of
    any range but the row's, every store over the row range only, R x P within GRID_REDUCE_GROUPS."""
    if len(globals_) != 1 or parts < 2 or parts & (parts - 1):
        return None
    row = globals_[0]
    if row.src[0].op is not Ops.CONST or row.src[0].arg * parts > GRID_REDUCE_GROUPS:
        return None
    stores = list(ast.src)
    if any(st.free_ranges != {row} for st in stores):
        return None
    reds = top_reduces(stores)
    if not reds or any(not r.free_ranges <= {row} for r in reds):
        return None
    if len({tuple(sorted((id(x) for x in r.src[1:]))) for r in reds}) != 1:
        return None
    return reds, UOp.const(parts, dtypes.index)


class GridReduce:
    grid_rows: "tuple[Instr, Instr, int] | None" = None    # split rows: (row, part, P) of this work-group

    def hidden_param(self, dt: DType, count: int) -> Instr:
        slot = self.n_params + len(self.hidden)
        self.hidden.append(HiddenBuffer(dt, count))
        self.hidden_params.append(ParamInfo(slot, dt, True, True))
        return self.new(L.PARAM, dt, (), slot)

    def emit_grid_reduces(self, plan: "tuple[list[UOp], UOp]", chain: list[Scope]) -> list[Scope]:
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
        rows = self.grid_rows
        part = self.gid if rows is None else rows[1]     # this group's part of the range (of its row)
        base = self.new(L.ALU, idx, (part, gsize), Ops.MUL); base.index_math = True
        start = self.new(L.ALU, idx, (base, self.lid), Ops.ADD); start.index_math = True
        step = self.new(L.ALU, idx, (n_groups, gsize), Ops.MUL); step.index_math = True
        for it in (base, start, step):
            put(it)
        self.dist = (start, step, groups_expr * self.group_size)
        self.emit_reduces(reds, chain, depth, cooperative=True)
        self.dist = None
        parts = [top.memo.pop(r) for r in reds]
        n_rows = 1 if rows is None else GRID_REDUCE_GROUPS // rows[2]
        scratch = [self.hidden_param(r.dtype, GRID_REDUCE_GROUPS) for r in reds]
        counter = self.hidden_param(dtypes.uint32, n_rows)
        slot_of = self.gid          # the partial's slot: the group id (row x P + part)
        row_at = zero               # the row's counter, and the first of its P partials
        if rows is not None:
            row_at = rows[0]
            first_slot = self.new(L.ALU, idx, (row_at, n_groups), Ops.MUL); first_slot.index_math = True
            put(first_slot)
        one_u = self.new(L.CONST, dtypes.uint32, (), 1)
        one = self.emit(UOp.const(1, idx), chain)
        last_ticket = self.new(L.ALU, idx, (n_groups, one), Ops.SUB); last_ticket.index_math = True
        last_u = self.new(L.ALU, dtypes.uint32, (last_ticket,), Ops.CAST)
        flag = self.new(L.LOCAL, dtypes.int32, (), 1)
        is0 = self.new(L.ALU, dtypes.bool, (self.lid, zero), Ops.CMPEQ)
        first = If(is0)
        for buf, p in zip(scratch, parts):
            first.body.append(self.new(L.STORE, None, (buf, slot_of, p)))
        ticket = self.new(L.ATOMIC_ADD, dtypes.uint32, (counter, row_at, one_u))
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
        scope = Scope(last.body, None, last)
        chain = chain + [scope]
        self.min_depth = len(chain) - 1
        accs = [self.new(L.ACC, r.dtype, (), reduce_identity(r.dtype, r.arg)) for r in reds]
        scope.items.extend(accs)
        loop = Loop(self.new(L.LOOPVAR, idx), self.lid, n_groups, AxisType.REDUCE, step=gsize)
        self.stepped.append(SteppedLoop(groups_expr, UOp.const(self.group_size, idx)))   # starts: lid
        at = loop.var
        if rows is not None:
            at = self.new(L.ALU, idx, (first_slot, loop.var), Ops.ADD); at.index_math = True
            loop.body.append(at)
        for acc, buf, r in zip(accs, scratch, reds):
            v = self.new(L.LOAD, r.dtype, (buf, at)); v.volatile = True
            cur = self.new(L.ACC_LOAD, r.dtype, (acc,))
            upd = self.new(L.ALU, r.dtype, (cur, v), r.arg); upd.reassoc = True
            loop.body.extend([v, cur, upd, self.new(L.ACC_STORE, None, (acc, upd))])
        scope.items.append(loop)
        for acc, r in zip(accs, reds):
            res = self.new(L.ACC_LOAD, r.dtype, (acc,))
            scope.items.append(res)
            scope.memo[r] = self.combine_in_group(res, r.arg, chain, len(chain) - 1)
        again = self.new(L.ALU, dtypes.bool, (self.lid, zero), Ops.CMPEQ)
        reset = self.new(L.STORE, None, (counter, row_at, self.new(L.CONST, dtypes.uint32, (), 0)))
        scope.items.extend([again, If(again, [reset])])
        return chain
