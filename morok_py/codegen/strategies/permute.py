"""Permutations on a GPU through shared-memory tiles (Schedule.permute).

A kernel `out[idx_s] = g(x[idx_l])` whose ranges are all GLOBAL and whose load and store indices are
affine forms of the same ranges (constant or symbolic strides) with a different contiguous range --
`a` moves the load by 1, `b` the store -- is a permutation: the general path reads or writes with a
stride along whichever of the two it does not walk. Here one work-group moves a T x T tile of the
(a, b) plane (every other range is fixed per group): it reads rows along a into shared memory
`tile[b][a]` (rows padded by one element, so the column reads below hit 32 different banks), waits at
a barrier, and writes rows along b from the tile's columns. Both global sides are coalesced; each
work-item moves T*T/group elements, as `vec`-wide loads and stores where the contiguous axis allows.

Groups are numbered along a, then b, then the other ranges (one grid dimension: no y/z limit). A full
tile whose indices are provably (or at launch) vector-aligned takes the vector path; every other tile
(edges of sizes that T does not divide, unaligned symbolic strides) the scalar path with its elements
guarded. Nothing is clamped or read out of range: the launch check proves the original load and store.

Unaligned full tiles stay scalar because wider forms measured no faster on an H100 (8191 x 8193 float32,
benchmarks/permute.py, benchmarks/results/nvidia-h100/permute-*.json): unguarded scalars 0.68x / 0.71x memcpy
against 0.72x / 0.71x guarded, and shifted rows (each row read and written as the aligned 16-byte vectors
inside it, head and tail as scalars, all loads in flight; commit 5081ec1) 1800 / 1833 GiB/s against
1820 / 1855 GiB/s guarded (nvrtc / llvm-nvptx), 1902 against 2064 GiB/s as group 1024. What bounds the odd
case (0.69-0.75x) is not the width of its accesses.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...dtypes import dtypes
from ...ir import AxisType, Ops, UOp
from ..capabilities import Capabilities
from ..gpu_tile import _Builder, _terms
from ..launch_check import Access, LaunchInfo
from ..linear import If, Instr, Item, L, LinearKernel
from ..scan import KernelScan
from ..symbolic import simplify

TILE = 64                  # the tile's edge (elements): on an H100, 8192^2 float32 moved at 0.98x memcpy with 64 x 64
                           # tiles (groups of 128-512 within 2%), 0.94x with 32 x 32 (benchmarks/permute.py --variants)
GROUP = 256                # work-items per group: 16 elements each in a 64 x 64 tile
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


def permute_group(caps: Capabilities, tile: int = TILE) -> int:
    """The default work-items of a `tile` x `tile` permutation: GROUP, within the target's limits."""
    return min(GROUP, caps.max_threads_per_group, caps.local_max[0], tile * tile // VECTOR)


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
    out = [(TILE, permute_group(caps))]
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
        # the grid has exactly ceil(A/T) * ceil(B/T) * (the other extents) groups, all >= 1 when launched
        nA = self.op(top, Ops.ADD, self.op(top, Ops.IDIV, self.op(top, Ops.SUB, A, self.c(1)), self.c(T)), self.c(1))
        env: dict[UOp, Instr] = {}
        ta = self.op(top, Ops.MOD, gx, nA)
        left = self.op(top, Ops.IDIV, gx, nA)
        if pp.rest:
            nB = self.op(top, Ops.ADD, self.op(top, Ops.IDIV, self.op(top, Ops.SUB, B, self.c(1)), self.c(T)),
                         self.c(1))
            tb = self.op(top, Ops.MOD, left, nB)
            left = self.op(top, Ops.IDIV, left, nB)
            for k, r in enumerate(reversed(pp.rest)):       # innermost first; the outermost takes what is left
                if k == len(pp.rest) - 1:
                    env[r] = left
                else:
                    ext = self.expr(r.src[0], {}, top, memo)
                    env[r] = self.op(top, Ops.MOD, left, ext)
                    left = self.op(top, Ops.IDIV, left, ext)
        else:
            tb = left
        a0 = self.op(top, Ops.MUL, ta, self.c(T))
        b0 = self.op(top, Ops.MUL, tb, self.c(T))
        self.rem = (self.op(top, Ops.SUB, A, a0), self.op(top, Ops.SUB, B, b0))   # >= 1: what exists of the tile
        self.base = (a0, b0, env, tid)
        self.smem = self.new(L.LOCAL, pp.load.dtype, (), T * (T + 1))
        top.append(self.smem)

        vl = VECTOR if pp.load_vec is not None else 1
        vs = VECTOR if pp.store_vec is not None else 1
        last = self.c(T - 1)
        full = self.op(top, Ops.AND, self.op(top, Ops.CMPLT, last, self.rem[0]),
                       self.op(top, Ops.CMPLT, last, self.rem[1]), dtype=dtypes.bool)
        conds = [c for c in (pp.load_vec or ()) + (pp.store_vec or ())]
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
        if not conds and all(e.op is Ops.CONST and e.arg % T == 0 for e in ends):
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
        pp, T, G = self.pp, self.T, self.G
        a0, b0, env0, tid = self.base
        ld = T + 1
        # the read: consecutive work-items along a (one tile row of b each), `rows` rows per pass
        per = T // vl
        rows = G // per
        lc = self.op(out, Ops.MOD, tid, self.c(per))
        if vl > 1:
            lc = self.op(out, Ops.MUL, lc, self.c(vl))
        lr0 = self.op(out, Ops.IDIV, tid, self.c(per))
        ga = self.op(out, Ops.ADD, a0, lc)
        buf, sidx, val = pp.store.src
        for p in range(T // rows):
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
            if vl == 1:
                v = self.new(L.LOAD, pp.load.dtype, (src, idx))
                blk += [v, self.new(L.STORE, None, (self.smem, s0, v))]
            else:
                v = self.new(L.LOAD, pp.load.dtype, (src, idx), vl)
                blk.append(v)
                for k in range(vl):
                    x = self.new(L.EXTRACT, pp.load.dtype, (v,), k)
                    sk = self.op(blk, Ops.ADD, s0, self.c(k)) if k else s0
                    blk += [x, self.new(L.STORE, None, (self.smem, sk, x))]
        out.append(self.new(L.BARRIER, None))
        # the write: consecutive work-items along b, reading a column of the tile
        per = T // vs
        rows = G // per
        lc = self.op(out, Ops.MOD, tid, self.c(per))
        if vs > 1:
            lc = self.op(out, Ops.MUL, lc, self.c(vs))
        lr0 = self.op(out, Ops.IDIV, tid, self.c(per))
        gb = self.op(out, Ops.ADD, b0, lc)
        for p in range(T // rows):
            lr = self.op(out, Ops.ADD, lr0, self.c(p * rows)) if p else lr0
            blk = out
            if guarded:
                ok = self.op(out, Ops.AND, self.op(out, Ops.CMPLT, lr, self.rem[0]),
                             self.op(out, Ops.CMPLT, lc, self.rem[1]), dtype=dtypes.bool)
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
        groups = _cdiv(pp.a_end, T) * _cdiv(pp.b_end, T)
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
