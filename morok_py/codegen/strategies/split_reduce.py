"""Split serial reduction (Schedule.split > 1): a column-like reduction keeps one output per work-item
column but lets `split` work-items share it.

The work-group is (group / split) outputs along x times `split` along y. Outputs are the GLOBAL ranges
merged into x (the store's contiguous range innermost), so the x lanes of a warp read neighbouring
addresses of each row: coalesced. Work-item y walks the reduced range from y in steps of `split`, so
a column of 8192 rows runs as 8 interleaved runs of 1024 with `unroll` loads in flight each; the
partials meet in shared memory and are added in y order (the same order for every launch). Items past
the last output compute a clamped (in-range) output and store nothing: every item reaches the barriers.

This gives a sum over axis 0 and a small-batch matrix-vector product (`x[b, k] * W[k, j]`, W rows
contiguous in j) many more loads in flight than one work-item per output, without a second launch.
"""
from __future__ import annotations

from ...dtypes import dtypes
from ...ir import AxisType, Ops, UOp, substitute
from ..launch_check import Access, SteppedLoop
from ..linear import Instr, L, Loop
from ..scan import KernelScan, merged_order, top_reduces, x_coefficient
from ..scope import Scope
from ..symbolic import simplify

UPCAST_MAX = 16     # Schedule.upcast: at most this many outputs of one work-item
# a split's partials take one group-sized shared array per reduction it combines (combine_split): at most
# 64 KiB, what an AMD work-group's LDS holds and every CUDA target from sm_80 gives a block (past 48 KiB as
# dynamic shared memory): a 16-row GEMV split over 1024 work-items takes exactly that. A grouped 1x1
# convolution of light shufflenet (272 channels at 7x7, 4 groups: 68 reductions, 7 rows each) asked for
# 1.9 MB and failed to load on an H200 (cuFuncSetAttribute: invalid value)
SPLIT_SHARED_MAX = 64 << 10


def split_shared_bytes(ast: UOp, group: int, upcast_by: int = 1) -> int:
    """Shared bytes a split schedule of `group` work-items takes for `ast` (its stores upcast_by times over)."""
    reds = top_reduces(list(ast.src))
    size = max((r.dtype.itemsize for r in reds), default=4)
    return len(reds) * max(1, upcast_by) * group * size


def upcast_plan(ast: UOp, scan: KernelScan) -> UOp | None:
    """Schedule.upcast: a GLOBAL range of constant extent (2..UPCAST_MAX) that no store is contiguous in,
    beside another GLOBAL range, such that some load inside the reductions does not depend on it (the
    batch of a GEMV: W[k, n] is the same for every b). Computing all of its outputs in one work-item reads
    that load once for all of them. None: no such range."""
    globals_ = sorted((r for r in scan.ranges.values() if r.axis_type is AxisType.GLOBAL), key=lambda r: r.axis)
    stores = list(ast.src)
    if len(globals_) < 2:
        return None
    reds = top_reduces(stores)
    for r in globals_:
        ext = r.src[0]
        if ext.op is not Ops.CONST or not 2 <= ext.arg <= UPCAST_MAX:
            continue
        if any(x_coefficient(st.src[1], r) == 1 for st in stores):
            continue
        if any(n.op is Ops.LOAD and r not in n.free_ranges and set(red.src[1:]) & n.free_ranges
               for red in reds for n in red.src[0].toposort()):
            return r
    return None


def lowering_unroll_applies(ast: UOp, split: int, unroll: int) -> bool:
    """Schedule.unrolled can apply: every top reduction runs over one range of constant extent, a multiple of
    split x unroll (every item then runs whole rounds of `unroll` copies)."""
    reds = top_reduces(list(ast.src))
    return bool(reds) and unroll >= 2 and all(
        len(r.src) == 2 and r.src[1].src[0].op is Ops.CONST and r.src[1].src[0].arg % (split * unroll) == 0 for r in reds)


def upcast(ast: UOp, r: UOp) -> UOp:
    """The kernel with range r unrolled into its stores: one store per value of r."""
    return UOp.sink(*[substitute(st, {r: UOp.const(i, r.dtype)}) for i in range(r.src[0].arg) for st in ast.src])


def split_applies(ast: UOp, scan: KernelScan) -> bool:
    """Every store is over all GLOBAL ranges and nothing else, and every REDUCE reachable from the
    stores without passing another is free of LOOP ranges (it runs once per output, at the top)."""
    globals_ = {r for r in scan.ranges.values() if r.axis_type is AxisType.GLOBAL}
    if not globals_ or any(r.axis_type is AxisType.LOOP for r in scan.ranges.values()):
        return False
    stores = list(ast.src)
    if any(st.free_ranges != globals_ for st in stores):
        return False
    reds = top_reduces(stores)
    return bool(reds) and all(r.free_ranges <= globals_ for r in reds)


class SplitReduce:
    unroll_copy = None      # (range, the chain of copy 0, {id(scope): copy number}) while copies are emitted

    def split_unroll(self, ranges: list[UOp]) -> int:
        """Schedule.unroll when the schedule asks for the split loop over `ranges` (one range of constant extent,
        a multiple of split x unroll, so every item runs whole rounds) to be unrolled by the lowering
        (Schedule.unrolled); else 0 (the loop carries an unroll hint). Why: the llvm-nvptx pair's own unrolling
        of `(k + 8u) * N + n` recomputed a 64-bit address per load (an IMAD.WIDE each, loads trickling between
        the FMAs); `base + 8uN` with one base per round gives [R + imm] loads, all in flight. Measured on an H100
        (benchmarks/schedule_variants.py): column sum 8192^2 108 -> 97 us, upcast GEMV 512/16/4 on llvm-nvptx 69 -> 49 us, but the
        plain split GEMV 64 -> 92 us on NVRTC (cause not found): a schedule choice, not a rule."""
        u, split = self.schedule.unroll, self.schedule.split
        if not self.schedule.unrolled or u < 2 or len(ranges) != 1:
            return 0
        end = ranges[0].src[0]
        return u if end.op is Ops.CONST and end.arg % (split * u) == 0 else 0

    def open_unrolled(self, r: UOp, chain: list[Scope], u: int) -> list[list[Scope]]:
        """Item y's loop over r: y, y + split*u, ...; one scope per copy c (r = var + c*split), all in the
        loop's body."""
        idx, split = dtypes.index, self.schedule.split
        depth = len(chain) - 1
        end = self.emit(r.src[0], chain)
        step_size = UOp.const(split * u, idx)
        step = self.emit(step_size, chain)
        self.stepped.append(SteppedLoop(r.src[0], step_size))     # starts: the items' y, all below the step
        loop = Loop(self.new(L.LOOPVAR, idx), self.lid, end, r.axis_type, step=step)
        self.place(loop, chain, depth)
        chain[depth].open_children.append(loop)
        copies, numbers = [], {}
        for c in range(u):
            sc = Scope(loop.body, r, loop)
            if c:
                at = self.new(L.ALU, idx, (loop.var, self.emit(UOp.const(c * split, idx), chain)), Ops.ADD)
                at.index_math = True
                sc.insert(at)
            sc.memo[r] = at if c else loop.var
            numbers[id(sc)] = c
            copies.append(chain[:depth + 1] + [sc])
        self.unroll_copy = (r, copies[0], numbers)
        return copies

    def emit_unrolled_load(self, node: UOp, chain: list[Scope]) -> Instr | None:
        """In copy c > 0: a load whose index is affine in the unrolled range (coefficient a) reads at copy 0's
        index + c * split * a. None: emit it the general way."""
        r, base, numbers = self.unroll_copy
        sc = chain[-1]
        c = numbers.get(id(sc), 0)
        if not c or r not in node.free_ranges:
            return None
        a = x_coefficient(node.src[1], r)
        if not a:
            return None
        first = self.emit(node.src[1], base)
        at = self.new(L.ALU, dtypes.index, (first, self.emit(UOp.const(c * self.schedule.split * a, dtypes.index), chain)),
                      Ops.ADD)
        at.index_math = True
        sc.insert(at)
        self.record(Access(node.src[0].arg, False, node.src[1], self.open_ranges(chain)))
        ins = self.new(L.LOAD, node.dtype, (self.emit(node.src[0], chain), at))
        sc.insert(ins)
        sc.memo[node] = ins
        return ins

    def map_to_split_groups(self, ast: UOp, globals_: list[UOp], chain: list[Scope]):
        """Launch dims and the clamped output coordinates of each work-item (see the module doc)."""
        split = self.schedule.split
        lx = self.schedule.group // split
        idx = dtypes.index
        top = chain[0]
        order = merged_order(ast, globals_)
        ext = order[0].src[0]
        for r in order[1:]:
            ext = ext * r.src[0]
        ext = simplify(ext)
        gid = self.new(L.SPECIAL, idx, (), ("group_id", 0))
        lidx = self.new(L.SPECIAL, idx, (), ("local_id", 0))
        self.lid = self.new(L.SPECIAL, idx, (), ("local_id", 1))
        self.lid_x = lidx
        self.group_size = split          # the distributed loops stride by the split
        top.items.extend([gid, lidx, self.lid])
        mul = self.new(L.ALU, idx, (gid, self.emit(UOp.const(lx, idx), chain)), Ops.MUL); mul.index_math = True
        out = self.new(L.ALU, idx, (mul, lidx), Ops.ADD); out.index_math = True
        end = self.emit(ext, chain)
        in_range = self.new(L.ALU, dtypes.bool, (out, end), Ops.CMPLT)
        last = self.new(L.ALU, idx, (end, self.emit(UOp.const(1, idx), chain)), Ops.SUB); last.index_math = True
        clamped = self.new(L.ALU, idx, (out, last), Ops.MIN); clamped.index_math = True
        first_y = self.new(L.ALU, dtypes.bool, (self.lid, self.emit(UOp.const(0, idx), chain)), Ops.CMPEQ)
        writes = self.new(L.ALU, dtypes.bool, (in_range, first_y), Ops.AND)
        top.items.extend([mul, out, in_range, last, clamped, first_y, writes])
        self.store_guard = writes
        rem = clamped
        for j, r in enumerate(order):      # split the merged coordinate back into its ranges
            if j == len(order) - 1:
                self.global_instr[id(r)] = rem
                break
            e = self.emit(r.src[0], chain)
            m = self.new(L.ALU, idx, (rem, e), Ops.MOD); m.index_math = True
            q = self.new(L.ALU, idx, (rem, e), Ops.IDIV); q.index_math = True
            top.items.extend([m, q])
            self.global_instr[id(r)] = m
            rem = q
        for r in order:
            top.memo[r] = self.global_instr[id(r)]
        return chain, [ext, UOp.const(split, idx)], (lx, split, 1)

    def combine_split(self, part: Instr, op: Ops, chain: list[Scope], depth: int) -> Instr:
        """Every item stores its partial at [y][x]; after a barrier each adds the `split` partials of its
        column in y order, so all items of the column hold the same total."""
        split, lx = self.schedule.split, self.schedule.group // self.schedule.split
        dt, idx = part.dtype, dtypes.index
        put = lambda it: self.place(it, chain, depth)  # noqa: E731
        smem = self.new(L.LOCAL, dt, (), split * lx)
        row = self.new(L.ALU, idx, (self.lid, self.emit(UOp.const(lx, idx), chain)), Ops.MUL)
        mine = self.new(L.ALU, idx, (row, self.lid_x), Ops.ADD)
        for it in (smem, row, mine, self.new(L.STORE, None, (smem, mine, part)), self.new(L.BARRIER, None)):
            put(it)
        total = None
        for y in range(split):
            at = self.new(L.ALU, idx, (self.lid_x, self.emit(UOp.const(y * lx, idx), chain)), Ops.ADD)
            v = self.new(L.LOAD, dt, (smem, at))
            put(at), put(v)
            if total is not None:
                v = self.new(L.ALU, dt, (total, v), op)
                v.reassoc = True
                put(v)
            total = v
        put(self.new(L.BARRIER, None))   # everyone has read the partials before the array is reused
        return total
