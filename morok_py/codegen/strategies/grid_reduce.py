"""Two-stage grid reduction: a full reduction (no GLOBAL range) split over many work-groups; each
writes a partial to a hidden buffer, the last group to finish combines them (Schedule.reduce == "grid")."""
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


def grid_plan(ast: UOp, globals_, group: int) -> "tuple[list[UOp], UOp] | None":
    """A full reduction (no GLOBAL range) whose top-level REDUCEs share their ranges is split over
    up to GRID_REDUCE_GROUPS work-groups of `group` items: (the reduces, the group count as a UOp of
    the sizes); None for any other kernel."""
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


class GridReduce:
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
        scope = Scope(last.body, None, last)
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
