"""Permutations on a GPU through shared-memory tiles (Schedule.permute), and on the CPU in blocks
(Schedule.block_permute, `cpu_block_permute` below).

A kernel `out[idx_s] = g(x[idx_l])` whose ranges are all GLOBAL and whose load and store indices are
affine forms of the same ranges (constant or symbolic strides) with a different contiguous range --
`a` moves the load by 1, `b` the store -- is a permutation: the general path reads or writes with a
stride along whichever of the two it does not walk. Here one work-group moves a T x TB tile of the
(a, b) plane (every other range is fixed per group; TB = max(T, ITEM_ELEMENTS x group / T), within
SMEM_LIMIT): it reads rows along a into shared memory `tile[b][a]` (rows padded to an odd length, so the
column reads below hit 32 different banks), waits at a barrier, and writes rows along b from the tile's
columns. Both global sides are coalesced; each work-item moves T*TB/group elements, as `vec`-wide loads and
stores where the contiguous axis allows. A constant run along a shorter than T (NCHW -> NHWC at 7 x 7: 49)
makes the tile exactly that wide, read flat: work-item t takes elements t, t + group, ... of the TB x 49
tile, which is one contiguous run of the input where b is the next axis out (then read as aligned vectors).

Groups are numbered along b, then a, then the other ranges (one grid dimension: no y/z limit). A full
tile whose indices are provably (or at launch) vector-aligned takes the vector path; every other tile
(edges of sizes that the tile does not divide, unaligned symbolic strides) the scalar path with its elements
guarded. Nothing is clamped or read out of range: the launch check proves the original load and store.

Unaligned full tiles stay scalar and guarded because wider forms measured no faster on an H100 (8191 x 8193
float32, benchmarks/permute.py, benchmarks/results/nvidia-h100/permute-*.json): unguarded scalars 0.68x / 0.71x
memcpy against 0.72x / 0.71x guarded, and shifted rows (each row read and written as the aligned 16-byte vectors
inside it, head and tail as scalars, all loads in flight; commit 5081ec1) 1800 / 1833 GiB/s against 1820 / 1855
GiB/s guarded (nvrtc / llvm-nvptx), 1902 against 2064 GiB/s as group 1024. On an H200, with the groups
numbered along b, unguarded scalars in whole tiles moved 0.79x / 0.90x (64 x 64, 512 items) and 0.85x / 0.92x
(64 x 128) against 0.87x / 0.85x and 0.88x / 0.92x guarded (hand-written CuPy variants and the
strategy's candidates timed side by side; the scripts and their log are in git at commit 3d551ba). What bounded the odd case there was the order of the
groups and the length of the rows each tile writes (ITEM_ELEMENTS, the b-first order in _PermuteBuilder.build);
a plain scalar copy of the same bytes (one float per thread) runs at 0.65-0.69x memcpy on the H200.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...dtypes import dtypes
from ...ir import AxisType, Ops, UOp, substitute
from ..capabilities import Capabilities
from ..gpu_tile import _Builder, _terms
from ..launch_check import Access, LaunchInfo
from ..linear import If, Instr, Item, L, LinearKernel
from ..scan import KernelScan
from ..symbolic import simplify

TILE = 64                  # the tile's edge along a (elements): on an H100, 8192^2 float32 moved at 0.98x memcpy with
                           # 64 x 64 tiles (groups of 128-512 within 2%), 0.94x with 32 x 32 (benchmarks/permute.py --variants)
GROUP = 256                # work-items per group: 16 elements each in a 64 x 64 tile
GROUP_PLANE = 512          # ... and of a plain 2-D permutation (no other range): a 64 x 128 tile (see ITEM_ELEMENTS)
ITEM_ELEMENTS = 16         # elements each work-item moves: a tile is T along a and max(T, 16 G / T) along b (within
                           # SMEM_LIMIT), so a larger group writes longer rows instead of fewer elements each. On an
                           # H200 (8191 x 8193 float32, symbolic, groups numbered along b first; variants timed side
                           # by side by a script kept in git at commit 3d551ba) 64 x 128
                           # tiles of 512 items moved 0.88x / 0.92x memcpy (nvrtc / llvm-nvptx), 32 x 128 of 256
                           # items 0.86x / 0.90x, 64 x 64 of 512 items (8 each) 0.87x / 0.85x, of 256 items 0.74x /
                           # 0.86x, 64 x 128 of 256 items (32 each) 0.77x / 0.78x; 8192^2 (symbolic) 1.00x / 1.02x
                           # with 64 x 128 of 512 items
SMEM_LIMIT = 48 << 10      # the tile's shared memory (static: CUDA's limit without opt-in)
MERGE_BELOW = 32           # a contiguous run shorter than this takes the next range out (PermutePlan)
TILES = (32, 64)           # the edges a schedule may name
VECTOR = 4                 # lanes of a vector load or store
_VECTOR_DTYPES = ("float32", "int32", "uint32", "float16", "bfloat16")   # what the printers print as vectors


@dataclass(frozen=True)
class PermutePlan:
    """The permutation a kernel is: its store and load, the ranges along which each is contiguous (a chain,
    outermost first: an inner extent below a tile is merged with the next range whose stride continues it,
    so NCHW -> NHWC with 7 x 7 images reads runs of 49), the other ranges (outermost first), and the
    launch-time sizes a vector load (store) needs to be multiples of VECTOR (None: never vectors)."""

    store: UOp
    load: UOp
    a: tuple[UOp, ...]
    b: tuple[UOp, ...]
    rest: tuple[UOp, ...]
    load_vec: "tuple[UOp, ...] | None"
    store_vec: "tuple[UOp, ...] | None"

    @property
    def a_end(self) -> UOp:
        return _span(self.a)

    @property
    def b_end(self) -> UOp:
        return _span(self.b)


def _span(chain: tuple[UOp, ...]) -> UOp:
    end = chain[0].src[0]
    for r in chain[1:]:
        end = end * r.src[0]
    return simplify(end)


def _chain(form: dict, first: UOp, taken: set[int]) -> tuple[UOp, ...]:
    """`first` and, while the run is a constant shorter than a tile, the range whose coefficient in `form`
    is the run's length (the next axis out, contiguous with it); `taken`: ids of ranges it may not take."""
    chain = [first]
    span = first.src[0]
    while span.op is Ops.CONST and span.arg < MERGE_BELOW:
        nxt = None
        for k, v in form.items():
            if k is not None and id(k) not in taken and all(k is not c for c in chain):
                v = simplify(v)
                if v.op is Ops.CONST and v.arg == span.arg:
                    nxt = k
                    break
        if nxt is None:
            break
        chain.insert(0, nxt)
        span = simplify(span * nxt.src[0])
    return tuple(chain)


def _vector_conds(form: dict, chain: tuple[UOp, ...]) -> "tuple[UOp, ...] | None":
    """The launch-time sizes that must be multiples of VECTOR for VECTOR consecutive elements of the chain
    (starting at a multiple of VECTOR) to be one aligned run: every other coefficient and the constant
    term; None when a constant one is not."""
    conds: list[UOp] = []
    for k, v in form.items():
        if k is not None and any(k is c for c in chain):
            continue
        v = simplify(v)
        if v.op is Ops.CONST:
            if int(v.arg) % VECTOR:
                return None
        elif all(v is not c for c in conds):
            conds.append(v)
    return tuple(conds)


def _unit_range(form: dict) -> "UOp | None":
    """The range whose coefficient in an affine form is the constant 1 (the last such one), else None."""
    unit = None
    for k, v in form.items():
        if k is not None:
            v = simplify(v)
            if v.op is Ops.CONST and v.arg == 1:
                unit = k
    return unit


def permute_plan(ast: UOp, scan: KernelScan) -> "PermutePlan | None":
    """The plan when the kernel is one store of g(one load) over GLOBAL ranges only (at least two), both
    indices affine in all of them and contiguous along different ranges; else None."""
    if ast.op is not Ops.SINK or len(ast.src) != 1 or ast.src[0].op is not Ops.STORE:
        return None
    ranges = list(scan.ranges.values())
    if len(ranges) < 2 or any(r.axis_type is not AxisType.GLOBAL for r in ranges):
        return None
    store = ast.src[0]
    buf, sidx, val = store.src
    loads = [n for n in val.toposort() if n.op is Ops.LOAD]
    if len(loads) != 1 or loads[0].src[0].arg == buf.arg:
        return None
    load = loads[0]
    if any(n.op is Ops.LOAD for n in sidx.toposort()) or any(n.op is Ops.LOAD for n in load.src[1].toposort()):
        return None
    everything = frozenset(ranges)
    if sidx.free_ranges != everything or load.src[1].free_ranges != everything:
        return None
    fs, fl = _terms(sidx), _terms(load.src[1])
    if fs is None or fl is None:
        return None
    a1, b1 = _unit_range(fl), _unit_range(fs)
    if a1 is None or b1 is None or a1 is b1:
        return None
    a = _chain(fl, a1, {id(b1)})
    b = _chain(fs, b1, {id(r) for r in a})
    chained = {id(r) for r in a + b}
    rest = tuple(sorted((r for r in ranges if id(r) not in chained), key=lambda r: r.axis))
    lv = _vector_conds(fl, a) if load.dtype.name in _VECTOR_DTYPES else None
    sv = _vector_conds(fs, b) if val.dtype.name in _VECTOR_DTYPES else None
    return PermutePlan(store, load, a, b, rest, lv, sv)


def permute_applies(ast: UOp, caps: Capabilities, scan: KernelScan) -> bool:
    """A GPU target with shared memory and a kernel that is a permutation (`permute_plan`)."""
    return caps.has_local and caps.has_shared and permute_plan(ast, scan) is not None


def permute_group(caps: Capabilities, tile: int = TILE, plan: "PermutePlan | None" = None) -> int:
    """The default work-items of a permutation with tiles `tile` along a: GROUP_PLANE for a plan with no range but
    its two chains, else GROUP, within the target's limits."""
    group = GROUP_PLANE if plan is not None and not plan.rest else GROUP
    return min(group, caps.max_threads_per_group, caps.local_max[0], tile * tile // VECTOR)


def tile_rows(tile: int, group: int, itemsize: int, ld: int) -> int:
    """The tile's extent along b: `tile`, or more where the group has more than ITEM_ELEMENTS per item to move
    (ITEM_ELEMENTS each), halved while its shared rows of `ld` elements pass SMEM_LIMIT."""
    tb = tile * max(1, group * ITEM_ELEMENTS // (tile * tile))
    while tb > tile and tb * ld * itemsize > SMEM_LIMIT:
        tb //= 2
    return tb


def valid_permute(tile: int, group: int) -> bool:
    """Whether a group of `group` work-items can move a `tile` x `tile` tile in whole passes, scalar and
    VECTOR-wide: at least one tile row per pass, at most the tile."""
    return (tile in TILES and group >= tile and group * VECTOR <= tile * tile
            and (tile * tile) % (group * VECTOR) == 0)


def permute_candidates(ast: UOp, caps: Capabilities, scan: KernelScan) -> list[tuple[int, int]]:
    """(tile, group) pairs a search may time; the default first."""
    if not permute_applies(ast, caps, scan):
        return []
    limit = min(caps.max_threads_per_group, caps.local_max[0])
    out = [(TILE, permute_group(caps, TILE, permute_plan(ast, scan)))]
    out += [(t, g) for t in TILES for g in (64, 128, 256, 512, 1024)
            if g <= limit and valid_permute(t, g) and (t, g) not in out]
    return out


# ---- the kernel --------------------------------------------------------------------------------------

class _PermuteBuilder(_Builder):
    """The tiled kernel of a PermutePlan; the instruction helpers (new, op, expr, c) are gpu_tile's."""

    def __init__(self, ast: UOp, caps: Capabilities, name: str, plan: PermutePlan, scan: KernelScan,
                 tile: int, group: int) -> None:
        self.ast, self.caps, self.name, self.pp, self.scan = ast, caps, name, plan, scan
        self.T, self.G = tile, group
        # a constant run along a shorter than the tile (NCHW -> NHWC at 7 x 7: runs of 49) is one tile wide: the
        # tile holds TB whole runs, read flat (work-item t takes elements t, t + G, ... of the TB x TA tile)
        # instead of as TB rows of T lanes with T - A of them idle
        A = plan.a_end
        self.TA = int(A.arg) if A.op is Ops.CONST and A.arg < tile else tile
        self.flat = self.TA != tile
        self.ld = self.TA + (self.TA % 2 == 0)          # shared row length: odd, so column reads hit 32 banks
        self.TB = tile_rows(tile, group, plan.load.dtype.itemsize, self.ld)
        self.contig = False                             # the tile is one contiguous run of the load
        self.flat_vec: "tuple[UOp, ...] | None" = None  # ... and read as aligned vectors under these conditions
        if self.flat:
            fl = _terms(plan.load.src[1])
            coef = simplify(fl.get(plan.b[0])) if fl is not None and len(plan.b) == 1 else None
            self.contig = coef is not None and coef.op is Ops.CONST and coef.arg == self.TA
            if (self.contig and plan.load.dtype.name in _VECTOR_DTYPES
                    and (self.TA * self.TB) % VECTOR == 0):
                self.flat_vec = _vector_conds(fl, plan.a + plan.b)
        self.next_id = 0
        self.leaves = {}
        self.index_nodes = scan.index_nodes

    def build(self) -> "tuple[LinearKernel, LaunchInfo]":
        pp, T = self.pp, self.T
        top: list[Item] = []
        gx = self.new(L.SPECIAL, dtypes.index, (), ("group_id", 0))
        tid = self.new(L.SPECIAL, dtypes.index, (), ("local_id", 0))
        top += [gx, tid]
        memo: dict[UOp, Instr] = {}
        A = self.expr(pp.a_end, {}, top, memo)
        B = self.expr(pp.b_end, {}, top, memo)
        TA, TB = self.TA, self.TB
        # the grid has exactly ceil(A/TA) * ceil(B/TB) * (the other extents) groups, all >= 1 when launched
        nA = self.op(top, Ops.ADD, self.op(top, Ops.IDIV, self.op(top, Ops.SUB, A, self.c(1)), self.c(TA)), self.c(1))
        env: dict[UOp, Instr] = {}
        nB = self.op(top, Ops.ADD, self.op(top, Ops.IDIV, self.op(top, Ops.SUB, B, self.c(1)), self.c(TB)), self.c(1))
        # groups along b first: neighbouring groups write neighbouring parts of the same output rows, so a row's
        # sectors that two tiles share are completed together (8191 x 8193 float32 on an H200, 64 x 64 tiles:
        # 0.74x / 0.86x memcpy against 0.66x / 0.69x numbered along a; 8192^2 1.00x / 1.02x against 0.97x / 0.98x;
        # the 3-D to 5-D cases within 2%: variants timed side by side, the script in git at commit 3d551ba)
        tb = self.op(top, Ops.MOD, gx, nB)
        left = self.op(top, Ops.IDIV, gx, nB)
        if pp.rest:
            ta = self.op(top, Ops.MOD, left, nA)
            left = self.op(top, Ops.IDIV, left, nA)
            for k, r in enumerate(reversed(pp.rest)):       # innermost first; the outermost takes what is left
                if k == len(pp.rest) - 1:
                    env[r] = left
                else:
                    ext = self.expr(r.src[0], {}, top, memo)
                    env[r] = self.op(top, Ops.MOD, left, ext)
                    left = self.op(top, Ops.IDIV, left, ext)
        else:
            ta = left
        a0 = self.op(top, Ops.MUL, ta, self.c(TA))
        b0 = self.op(top, Ops.MUL, tb, self.c(TB))
        self.rem = (self.op(top, Ops.SUB, A, a0), self.op(top, Ops.SUB, B, b0))   # >= 1: what exists of the tile
        self.base = (a0, b0, env, tid)
        self.smem = self.new(L.LOCAL, pp.load.dtype, (), TB * self.ld)
        top.append(self.smem)

        load_vec = self.flat_vec if self.flat else pp.load_vec
        vl = VECTOR if load_vec is not None else 1
        vs = VECTOR if pp.store_vec is not None else 1
        full = self.op(top, Ops.AND, self.op(top, Ops.CMPLT, self.c(TA - 1), self.rem[0]),
                       self.op(top, Ops.CMPLT, self.c(TB - 1), self.rem[1]), dtype=dtypes.bool)
        conds = [c for c in (load_vec or ()) + (pp.store_vec or ())]
        conds = list({id(c): c for c in conds}.values())
        if conds:       # symbolic strides: vectors only when each is a multiple of VECTOR at launch
            bits = None
            for cnd in conds:
                x = self.op(top, Ops.AND, self.expr(cnd, {}, top, memo), self.c(VECTOR - 1))
                bits = x if bits is None else self.op(top, Ops.OR, bits, x)
            aligned = self.new(L.ALU, dtypes.bool, (bits, self.c(0)), Ops.CMPEQ)
            top.append(aligned)
            full = self.op(top, Ops.AND, full, aligned, dtype=dtypes.bool)
        ends = (pp.a_end, pp.b_end)
        if not conds and all(e.op is Ops.CONST and e.arg % t == 0 for e, t in zip(ends, (TA, TB))):
            self.move(top, vl, vs, guarded=False)      # every tile is full and aligned
            return self.finish(top)
        fast = If(full)
        slow_cond = self.new(L.ALU, dtypes.bool, (full, self.leaf(L.CONST, dtypes.bool, True)), Ops.XOR)
        slow = If(slow_cond)
        top += [fast, slow_cond, slow]
        self.move(fast.body, vl, vs, guarded=False)
        self.move(slow.body, 1, 1, guarded=True)
        return self.finish(top)

    def move(self, out: list[Item], vl: int, vs: int, guarded: bool) -> None:
        """Read the tile into shared memory (`vl` elements along a per access), barrier, write it out (`vs`
        along b); `guarded`: elements past the extents are skipped."""
        pp, TA, TB = self.pp, self.TA, self.TB
        a0, b0, env0, tid = self.base
        ld = self.ld
        if self.flat:
            self.read_flat(out, vl, guarded)
        else:
            self.read_rows(out, vl, guarded)
        out.append(self.new(L.BARRIER, None))
        # the write: consecutive work-items along b, reading a column of the tile
        buf, sidx, val = pp.store.src
        rows, lc, lr0 = self.split_items(out, tid, TB, vs)
        gb = self.op(out, Ops.ADD, b0, lc)
        for p in range(-(-TA // rows)):
            lr = self.op(out, Ops.ADD, lr0, self.c(p * rows)) if p else lr0
            blk = out
            tail = (p + 1) * rows > TA         # a pass past the tile's rows (TA not a multiple of them)
            if guarded or tail:
                ok = self.op(out, Ops.CMPLT, lr, self.rem[0] if guarded and not self.flat else self.c(TA))
                if guarded:
                    ok = self.op(out, Ops.AND, ok, self.op(out, Ops.CMPLT, lc, self.rem[1]), dtype=dtypes.bool)
                g = If(ok)
                out.append(g)
                blk = g.body
            env = dict(env0)
            self.bind(env, pp.a, self.op(blk, Ops.ADD, a0, lr), blk)
            self.bind(env, pp.b, gb, blk)
            memo = {}
            vals = []
            for k in range(vs):      # lane k: b + k, tile row lc + k
                si = self.op(blk, Ops.ADD, self.op(blk, Ops.MUL, self.op(blk, Ops.ADD, lc, self.c(k)) if k else lc,
                                                   self.c(ld)), lr)
                x = self.new(L.LOAD, pp.load.dtype, (self.smem, si))
                blk.append(x)
                lane = {**env, pp.load: x}
                if k:
                    self.bind(lane, pp.b, self.op(blk, Ops.ADD, gb, self.c(k)), blk)
                vals.append(self.expr(val, lane, blk, {}))
            idx = self.expr(sidx, env, blk, memo)
            dst = self.expr(buf, env, blk, memo)
            if vs == 1:
                blk.append(self.new(L.STORE, None, (dst, idx, vals[0])))
            else:
                vec = self.new(L.VECTOR, val.dtype, tuple(vals))
                blk += [vec, self.new(L.STORE, None, (dst, idx, vec), vs)]

    def split_items(self, out: list[Item], tid: Instr, run: int, w: int) -> "tuple[int, Instr, Instr]":
        """The group's items over tile rows `run` elements long, `w` per access: (rows covered per pass, the
        item's element offset along the run, its first row)."""
        per = run // w
        lc = self.op(out, Ops.MOD, tid, self.c(per))
        if w > 1:
            lc = self.op(out, Ops.MUL, lc, self.c(w))
        return self.G // per, lc, self.op(out, Ops.IDIV, tid, self.c(per))

    def read_rows(self, out: list[Item], vl: int, guarded: bool) -> None:
        """The tile's read as rows along a: consecutive work-items along a (one tile row of b each), G / (TA /
        vl) rows per pass."""
        pp, T = self.pp, self.TA
        a0, b0, env0, tid = self.base
        ld = self.ld
        rows, lc, lr0 = self.split_items(out, tid, T, vl)
        ga = self.op(out, Ops.ADD, a0, lc)
        for p in range(self.TB // rows):
            lr = self.op(out, Ops.ADD, lr0, self.c(p * rows)) if p else lr0
            blk = out
            if guarded:
                ok = self.op(out, Ops.AND, self.op(out, Ops.CMPLT, lc, self.rem[0]),
                             self.op(out, Ops.CMPLT, lr, self.rem[1]), dtype=dtypes.bool)
                g = If(ok)
                out.append(g)
                blk = g.body
            env = dict(env0)
            self.bind(env, pp.a, ga, blk)
            self.bind(env, pp.b, self.op(blk, Ops.ADD, b0, lr), blk)
            memo: dict[UOp, Instr] = {}
            idx = self.expr(pp.load.src[1], env, blk, memo)
            src = self.expr(pp.load.src[0], env, blk, memo)
            s0 = self.op(blk, Ops.ADD, self.op(blk, Ops.MUL, lr, self.c(ld)), lc)
            self.load_into(blk, src, idx, s0, vl)

    def read_flat(self, out: list[Item], vl: int, guarded: bool) -> None:
        """The tile's read as one flat run of TB x TA elements (TA = the whole run along a, a0 = 0): work-item
        t takes elements vl * (t + k G) .. + vl - 1; a contiguous tile (`contig`) is read at the tile's first
        index + the element's offset, as `vl`-wide vectors where the schedule found them aligned."""
        pp, TA, TB, G = self.pp, self.TA, self.TB, self.G
        a0, b0, env0, tid = self.base
        ld = self.ld
        n = TA * TB
        src = self.expr(pp.load.src[0], env0, out, {})
        first = None
        if self.contig:
            env = dict(env0)
            self.bind(env, pp.a, a0, out)
            self.bind(env, pp.b, b0, out)
            first = self.expr(pp.load.src[1], env, out, {})
        t0 = self.op(out, Ops.MUL, tid, self.c(vl)) if vl > 1 else tid
        for p in range(-(-n // (G * vl))):
            f = self.op(out, Ops.ADD, t0, self.c(p * G * vl)) if p else t0
            blk = out
            tail = (p + 1) * G * vl > n
            lr = None
            if guarded or tail:
                ok = self.op(out, Ops.CMPLT, f, self.c(n)) if tail else None
                if guarded:     # rows of b past its extent
                    lr = self.op(out, Ops.IDIV, f, self.c(TA))
                    inb = self.op(out, Ops.CMPLT, lr, self.rem[1])
                    ok = inb if ok is None else self.op(out, Ops.AND, ok, inb, dtype=dtypes.bool)
                g = If(ok)
                out.append(g)
                blk = g.body
            if first is not None:
                idx = self.op(blk, Ops.ADD, first, f)
            else:
                env = dict(env0)
                lr = lr if lr is not None else self.op(blk, Ops.IDIV, f, self.c(TA))
                self.bind(env, pp.a, self.op(blk, Ops.ADD, a0, self.op(blk, Ops.MOD, f, self.c(TA))), blk)
                self.bind(env, pp.b, self.op(blk, Ops.ADD, b0, lr), blk)
                idx = self.expr(pp.load.src[1], env, blk, {})
            if ld == TA:
                s0 = f
            else:
                lr = lr if lr is not None else self.op(blk, Ops.IDIV, f, self.c(TA))
                s0 = self.op(blk, Ops.ADD, self.op(blk, Ops.MUL, lr, self.c(ld)), self.op(blk, Ops.MOD, f, self.c(TA)))
            self.load_into(blk, src, idx, s0, vl, f)

    def load_into(self, blk: list[Item], src: Instr, idx: Instr, s0: Instr, vl: int, f: "Instr | None" = None) -> None:
        """Load `vl` elements at `idx` into shared slots s0, s0 + 1, ... (flat element f + k of a tile whose
        shared rows are padded: its own slot)."""
        pp = self.pp
        if vl == 1:
            v = self.new(L.LOAD, pp.load.dtype, (src, idx))
            blk += [v, self.new(L.STORE, None, (self.smem, s0, v))]
            return
        v = self.new(L.LOAD, pp.load.dtype, (src, idx), vl)
        blk.append(v)
        for k in range(vl):
            x = self.new(L.EXTRACT, pp.load.dtype, (v,), k)
            if k == 0:
                sk = s0
            elif f is None or self.ld == self.TA:
                sk = self.op(blk, Ops.ADD, s0, self.c(k))
            else:
                fk = self.op(blk, Ops.ADD, f, self.c(k))
                sk = self.op(blk, Ops.ADD, self.op(blk, Ops.MUL, self.op(blk, Ops.IDIV, fk, self.c(self.TA)),
                                                   self.c(self.ld)), self.op(blk, Ops.MOD, fk, self.c(self.TA)))
            blk += [x, self.new(L.STORE, None, (self.smem, sk, x))]

    def bind(self, env: dict, chain: tuple[UOp, ...], at: Instr, out: list[Item]) -> None:
        """Bind the ranges of `chain` to position `at` along it (inner extents are constants)."""
        for r in reversed(chain[1:]):
            ext = self.c(int(r.src[0].arg))
            env[r] = self.op(out, Ops.MOD, at, ext)
            at = self.op(out, Ops.IDIV, at, ext)
        env[chain[0]] = at

    def finish(self, body: list[Item]) -> "tuple[LinearKernel, LaunchInfo]":
        pp, scan, T = self.pp, self.scan, self.T
        accesses = [Access(pp.load.src[0].arg, False, pp.load.src[1], ()),
                    Access(pp.store.src[0].arg, True, pp.store.src[1], ())]
        groups = _cdiv(pp.a_end, self.TA) * _cdiv(pp.b_end, self.TB)
        for r in pp.rest:
            groups = groups * r.src[0]
        local = (self.G, 1, 1)
        kernel = LinearKernel(self.name, scan.params, [v.name for v in scan.variables], body, local,
                              thread_split=False, gpu=True)
        info = LaunchInfo(scan.params, scan.variables, [simplify(groups)], local, True, accesses,
                          [r.src[0] for r in scan.ranges.values()], self.caps.grid_max, group_per_item=True)
        return kernel, info


def _cdiv(extent: UOp, block: int) -> UOp:
    """ceil(extent / block), 0 for an empty extent."""
    return ((extent - 1) // block + 1).minimum(extent)


def lower_permute(ast: UOp, caps: Capabilities, name: str, scan: KernelScan, tile: int,
                  group: int) -> "tuple[LinearKernel, LaunchInfo] | None":
    """The tiled lowering of a permutation (`tile` x `tile`, `group` work-items), or None when the kernel
    is none or the target has no shared memory."""
    if not caps.has_local or not caps.has_shared or not valid_permute(tile, group):
        return None
    plan = permute_plan(ast, scan)
    if plan is None:
        return None
    return _PermuteBuilder(ast, caps, name, plan, scan, tile, group).build()


__all__ = ["PermutePlan", "lower_permute", "permute_applies", "permute_candidates", "permute_group",
           "permute_plan", "valid_permute"]


# ---- the CPU: a permutation walked in blocks ---------------------------------------------------------------

# the edge of the blocks a CPU permutation walks (elements): a block's rows along the load's contiguous range and
# along the store's each stay in L1 while it is moved, where the plain walk read (or wrote) one element a cache line
# along its inner range
CPU_BLOCK = 16
# ... where the plain walk would come back to a line of the input only after this many others: it runs in the
# output's order, so consecutive elements of a load's line (along the load's contiguous range) are that range's
# stride in the output apart. NCHW -> NHWC (64 channels innermost) comes back after 64 lines, still in L1, and
# stays plain; NHWC -> NCHW at 56 x 56 after 3136. benchmarks/cpu_permute.py on the 2-vCPU AVX-512 Xeon
# (cpu-xeon-avx512-2c/cpu_permute.json), blocked against the plain walk: 56 x 56 x 64 NHWC -> NCHW 4.18x, 56 x 56 x 256
# 10.0x, 3136 x 256 6.4x, 1024 x 1024 4.9x; and in a one-off run, 64 x 56 x 56 NCHW -> NHWC blocked took 107 us
# against the plain walk's 85 (why it stays plain)
CPU_BLOCK_MIN_REUSE = 512


def cpu_block_plan(ast: UOp, scan: KernelScan) -> "PermutePlan | None":
    """The plan of a permutation the CPU walks in blocks: `permute_plan`'s, each side contiguous along one range
    (no merged chain), every size static and the load's contiguous range at least CPU_BLOCK_MIN_REUSE apart in the
    output; else None."""
    plan = permute_plan(ast, scan)
    if plan is None or len(plan.a) != 1 or len(plan.b) != 1:
        return None
    if any(r.src[0].op is not Ops.CONST for r in plan.a + plan.b + plan.rest):
        return None
    fs = _terms(plan.store.src[1])
    stride = simplify(fs[plan.a[0]]) if fs is not None and plan.a[0] in fs else None
    if stride is None or stride.op is not Ops.CONST or int(stride.arg) < CPU_BLOCK_MIN_REUSE:
        return None
    return plan


def cpu_block_permute(ast: UOp, plan: PermutePlan, edge: int) -> UOp:
    """The permutation as one GLOBAL range over (the other ranges, blocks along b, blocks along a), the thread split,
    and in each block a loop along b around a loop along a (the load's contiguous range innermost). Blocks are `edge`
    wide, or the whole range where it is shorter; the last block along a side starts `edge` before its end, so it
    overlaps its neighbour (those elements are moved twice, the same values) and no index is clamped."""
    ra, rb = plan.a[0], plan.b[0]
    A, B = int(ra.src[0].arg), int(rb.src[0].arg)
    ta, tb = min(edge, A), min(edge, B)
    na, nb = -(-A // ta), -(-B // tb)
    extents = [int(r.src[0].arg) for r in plan.rest]
    units = na * nb
    for e in extents:
        units *= e
    top = 1 + max(r.axis for r in plan.rest + plan.a + plan.b)
    g = UOp.range(units, top, AxisType.GLOBAL)
    bi, ai = UOp.range(tb, top + 1, AxisType.LOOP), UOp.range(ta, top + 2, AxisType.LOOP)
    t = g // na
    a0 = ((g % na) * ta).minimum(A - ta) if A % ta else (g % na) * ta
    b0 = ((t % nb) * tb).minimum(B - tb) if B % tb else (t % nb) * tb
    t = t // nb
    subs = {ra: a0 + ai, rb: b0 + bi}
    for r, e in reversed(list(zip(plan.rest, extents))):
        subs[r] = t % e
        t = t // e
    return UOp.sink(substitute(plan.store, subs))
