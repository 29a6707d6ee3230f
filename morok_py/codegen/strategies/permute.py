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
"""
from __future__ import annotations

from dataclasses import dataclass

from ...dtypes import dtypes
from ...ir import AxisType, Ops, UOp
from ..capabilities import Capabilities
from ..gpu_tile import _alignment_at_launch, _Builder, _terms
from ..launch_check import Access, LaunchInfo
from ..linear import If, Instr, Item, L, LinearKernel
from ..scan import KernelScan
from ..symbolic import simplify

TILE = 32                  # the tile's edge (elements); 32 lanes of a warp read one padded row
GROUP = 256                # work-items per group: 4 elements each in a 32 x 32 tile
TILES = (32, 64)           # the edges a schedule may name
VECTOR = 4                 # lanes of a vector load or store
_VECTOR_DTYPES = ("float32", "int32", "uint32", "float16", "bfloat16")   # what the printers print as vectors


@dataclass(frozen=True)
class PermutePlan:
    """The permutation a kernel is: its store and load, the ranges along which each is contiguous, the
    other ranges (outermost first), and the launch-time sizes a vector load (store) needs to be multiples
    of VECTOR (None: never vectors)."""

    store: UOp
    load: UOp
    a: UOp
    b: UOp
    rest: tuple[UOp, ...]
    load_vec: "tuple[UOp, ...] | None"
    store_vec: "tuple[UOp, ...] | None"


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
    a, b = _unit_range(fl), _unit_range(fs)
    if a is None or b is None or a is b:
        return None
    rest = tuple(sorted((r for r in ranges if r is not a and r is not b), key=lambda r: r.axis))

    def vec(idx: UOp, along: UOp, dt) -> "tuple[UOp, ...] | None":
        if dt.name not in _VECTOR_DTYPES:
            return None
        conds = _alignment_at_launch(idx, along, VECTOR)
        return None if conds is None else tuple(conds)

    return PermutePlan(store, load, a, b, rest, vec(load.src[1], a, load.dtype), vec(sidx, b, val.dtype))


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
        A = self.expr(pp.a.src[0], {}, top, memo)
        B = self.expr(pp.b.src[0], {}, top, memo)
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
        ends = (pp.a.src[0], pp.b.src[0])
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
            env = {**env0, pp.a: ga, pp.b: self.op(blk, Ops.ADD, b0, lr)}
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
            env = {**env0, pp.a: self.op(blk, Ops.ADD, a0, lr), pp.b: gb}
            memo = {}
            vals = []
            for k in range(vs):      # lane k: b + k, tile row lc + k
                si = self.op(blk, Ops.ADD, self.op(blk, Ops.MUL, self.op(blk, Ops.ADD, lc, self.c(k)) if k else lc,
                                                   self.c(ld)), lr)
                x = self.new(L.LOAD, pp.load.dtype, (self.smem, si))
                blk.append(x)
                lane = {**env, pp.load: x}
                if k:
                    lane[pp.b] = self.op(blk, Ops.ADD, gb, self.c(k))
                vals.append(self.expr(val, lane, blk, {}))
            idx = self.expr(sidx, env, blk, memo)
            dst = self.expr(buf, env, blk, memo)
            if vs == 1:
                blk.append(self.new(L.STORE, None, (dst, idx, vals[0])))
            else:
                vec = self.new(L.VECTOR, val.dtype, tuple(vals))
                blk += [vec, self.new(L.STORE, None, (dst, idx, vec), vs)]

    def finish(self, body: list[Item]) -> "tuple[LinearKernel, LaunchInfo]":
        pp, scan, T = self.pp, self.scan, self.T
        accesses = [Access(pp.load.src[0].arg, False, pp.load.src[1], ()),
                    Access(pp.store.src[0].arg, True, pp.store.src[1], ())]
        groups = _cdiv(pp.a.src[0], T) * _cdiv(pp.b.src[0], T)
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
