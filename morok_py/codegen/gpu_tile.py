"""GPU contractions (matmul-like kernels) lowered with shared-memory tiles and register blocking.

A kernel `out[b, i, j] = g(REDUCE_k f(...), ...)` -- one store over two GLOBAL ranges i, j (and an
optional outer batch range b), one REDUCE over one range k, where every load (or range) inside f
depends on {i, k} or on {k, j} -- is lowered as the classic tiled GEMM: work-group (x, y) owns a
BM x BN block of the output and each of its work-items a TM x TN block of accumulators in registers.
The k range is walked BK at a time: the work-items copy the operand tiles from global into shared
memory (coalesced along whichever index is contiguous), wait at a barrier, then every work-item
updates its accumulators from the tiles. The epilogue computes g and stores the in-range outputs.

Sizes may be symbolic, so the kernel is right for any size:
- tile rows/columns past the end of i or j (and k past the end of the last tile) are loaded from
  *clamped*, in-range coordinates: no load needs a guard, and every address read is one that the
  launch-time bounds check of the original load proved in bounds. Those rows and columns are computed
  and never stored.
- padded k must never reach an accumulator (f(pad) need not be 0): the k loop runs over full tiles
  (an inner loop of constant trip count BK, which compilers unroll) and then one tail tile whose
  inner loop runs over the valid k only.

Staging: f is split top-down into maximal sub-expressions ("units") that depend on {i, k} (A tiles,
stored transposed as As[kk][m] so that work-items read rows along m), {k, j} (B tiles, Bs[kk][n]),
{k} (a BK-vector), or on {i} / {j} / nothing (computed once per work-item, kept in registers).
What is left of f -- typically one multiply -- runs per accumulator in the inner loop.

Speed (float32 4096^3 on an H100: 0.76x cuBLAS -> about 0.9x, see benchmarks/results):
- constant strides that are multiples of 4 fill full tiles with 4-wide global loads (`fill_vector`);
- such kernels are double-buffered: the next tile's loads are issued before this tile is computed and
  stored into the other shared buffer after it, so global latency hides under the arithmetic and a
  tile costs one barrier. (Scalar fills need more registers for it than the cap below leaves.)
- a plain product (acc += a * b) asks for two work-groups per SM (`LinearKernel.min_groups`: CUDA's
  __launch_bounds__(256, 2), 128 registers) and has the kk loop of full tiles unrolled.

`tile_contraction` returns None for kernels it does not handle; `lower` then uses the general path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..dtypes import DType, dtypes
from ..ir import AxisType, Ops, UOp
from .capabilities import Capabilities
from .launch_check import Access, HiddenBuffer, LaunchInfo, SteppedLoop
from .linear import If, Instr, Item, L, LinearKernel, Loop, ParamInfo
from .scan import KernelScan, ast_fact, has_load as scan_has_load, reduce_identity, scan_kernel, x_coefficient
from .symbolic import simplify

PAD = 4               # elements added to each row of a shared tile: no bank conflicts when a tile is
                      # filled along k, and rows stay 16-byte aligned for vector reads
SMEM_LIMIT = 48 << 10  # static shared memory of one work-group (CUDA's limit without opt-in)
ASYNC_SMEM_LIMIT = 96 << 10  # async_fill (NVIDIA sm_80+): shared memory a tile may take, through the dynamic opt-in
                       # the CUDA renderers take past SMEM_LIMIT (sm_86/89 allow 99 KiB). The float32 decode
                       # candidate 32x32x128 double-buffered takes 72 KiB (strategies/small_shapes.py DECODE_CORE_BK)
_VECTOR_DTYPES = ("float32", "int32", "uint32")   # what the renderers print as float4/int4/uint4
UNROLL_FULL_TILES = True  # unroll the kk loop of full tiles in the kernel (see the note at compute)
MIN_GROUPS = 2        # occupancy hint (LinearKernel.min_groups): two work-groups per SM, so CUDA caps a
                      # 256-item group at 128 registers per item; 0: no hint
DOUBLE_BUFFER = 1     # two shared buffers per tile; the next tile is loaded into registers while this one
                      # is computed and stored after it: one barrier per tile, global latency hidden.
                      # 2: always; 1: only where every A/B tile has vector fills (fewer registers); 0: never
# async_fill: narrower copies stay register-staged. benchmarks/kernels.py on an H100, float32 4096^3: with A (along k,
# four 4-byte copies per vector) copied too, static 2.90 -> 3.27 ms and symbolic 3.05 -> 3.21 ms
ASYNC_MIN_BYTES = 16
VECTOR_FILL = True    # full tiles: 4-wide global loads where the index provably keeps them aligned
ALIGNED_VARIANT = True  # symbolic strides: a second, vector-filled (and double-buffered) k loop taken when
                        # the sizes are multiples of 4 at launch (a uniform branch; the scalar loop otherwise)
MIN_REUSE = 16        # constant i or j extents below this gain nothing from tiles: general path


# ---- recognition ---------------------------------------------------------------------------------

@dataclass
class _Plan:
    store: UOp
    red: UOp
    i: UOp
    j: UOp
    k: UOp
    b: UOp | None
    units: dict[UOp, str]            # staged sub-expression of f -> 'A' | 'B' | 'K' | 'I' | 'J' | 'S'
    tile: tuple[int, int, int, int, int]
    scan: "KernelScan"               # the kernel's params, variables, ranges and index arithmetic
    fast: dict[UOp, str] = field(default_factory=dict)   # A/B unit -> 'k' or 'w': contiguous index


def _stage(f: UOp, i: UOp, j: UOp, k: UOp, b: UOp | None) -> dict[UOp, str] | None:
    """Split f into units by the ranges they depend on; None if some load or range fits no unit."""
    units: dict[UOp, str] = {}
    done: set[UOp] = set()
    loads: dict[UOp, bool] = {}
    ik, kj = frozenset({i, k}), frozenset({k, j})

    def visit(node: UOp) -> bool:
        if node in done or node in units:
            return True
        rs = node.free_ranges - {b}
        has_load = scan_has_load(node, loads)
        if not rs and not has_load:
            done.add(node)      # constants and variables: computed where used
            return True
        kind = ("A" if rs == ik else "B" if rs == kj else "K" if rs == {k} else "I" if rs == {i}
                else "J" if rs == {j} else "S" if not rs else None)
        if kind is not None:
            units[node] = kind
            return True
        if node.op in (Ops.LOAD, Ops.RANGE, Ops.REDUCE):
            return False
        done.add(node)
        return all(visit(s) for s in node.src)

    return units if visit(f) else None


def _role_candidates(globals_: list[UOp], out_idx: UOp) -> list[tuple[UOp, UOp, UOp | None]]:
    """(i, j, b) assignments to try: j is the output's contiguous range where there is one."""
    out = []
    for b in ([None] if len(globals_) == 2 else globals_):
        rest = [r for r in globals_ if r is not b]
        unit = [r for r in rest if x_coefficient(out_idx, r) == 1]
        j = unit[-1] if unit else rest[-1]
        i = next(r for r in rest if r is not j)
        out.append((i, j, b))
    return out


def _choose_tile(caps: "Capabilities", M: UOp, N: UOp) -> tuple[int, int, int, int, int] | None:
    """The caps' tile; for small constant extents a half-size tile (more work-groups), or None (the
    general path) where an extent is too small for tiles to pay."""
    BM, BN, BK, TM, TN = caps.matmul_tile
    if M.op is Ops.CONST and N.op is Ops.CONST:
        if min(M.arg, N.arg) < MIN_REUSE:
            return None
        groups = -(-M.arg // BM) * -(-N.arg // BN)
        if groups < 16 and TM % 2 == 0 and TN % 2 == 0 and BM % 2 == 0 and BN % 2 == 0:
            return (BM // 2, BN // 2, BK, TM // 2, TN // 2)
    return (BM, BN, BK, TM, TN)


def _valid_tile(tile: tuple[int, int, int, int, int], caps: "Capabilities") -> bool:
    BM, BN, BK, TM, TN = tile
    if min(tile) < 1 or BM % TM or BN % TN:
        return False
    threads = (BM // TM) * (BN // TN)
    return threads <= min(caps.max_threads_per_group, caps.local_max[0])


def _contraction(ast: UOp) -> tuple | None:
    """(store, reduce, reduced range k, GLOBAL ranges, reduced value) of a kernel shaped like a
    contraction (one store of one single-range reduction over 2 or 3 GLOBAL ranges, nothing reading
    what it writes); None for any other kernel. The tile and tensor-core plans both ask, once per AST."""
    if len(ast.src) != 1:
        return None
    store = ast.src[0]
    out_buf, out_idx, val = store.src
    nodes = ast.toposort()
    reds = [n for n in nodes if n.op is Ops.REDUCE]
    if len(reds) != 1 or len(reds[0].src) != 2:
        return None
    red = reds[0]
    k = red.src[1]
    ranges = {n for n in nodes if n.op is Ops.RANGE}
    globals_ = sorted((r for r in ranges if r.axis_type is AxisType.GLOBAL), key=lambda r: r.axis)
    if ranges != set(globals_) | {k} or len(globals_) not in (2, 3) or store.free_ranges != frozenset(globals_):
        return None
    if any(u.op is Ops.RANGE for r in ranges for u in r.src[0].toposort()):
        return None   # a range end that reduces over another range
    if any(n.op is Ops.LOAD for n in out_idx.toposort()):
        return None
    f = red.src[0]
    slot = out_buf.arg
    if any(n.op is Ops.LOAD and n.src[0].arg == slot for n in f.toposort()):
        return None   # f reads what the kernel writes
    if any(n.op is Ops.LOAD and n.src[0].arg == slot and n.src[1] is not out_idx for n in val.toposort()):
        return None   # g reads outputs another work-item may write
    return store, red, k, tuple(globals_), f


def _plan(ast: UOp, caps: "Capabilities", scan: "KernelScan | None",
          tile: tuple[int, int, int, int, int] | None = None) -> _Plan | None:
    """The tiled plan of a contraction; `tile` None: chosen from the caps and the sizes."""
    shape = ast_fact(ast, "contraction", lambda: _contraction(ast))
    if shape is None:
        return None
    store, red, k, globals_, f = shape
    out_idx = store.src[1]
    if scan is None:
        try:
            scan = scan_kernel(ast)
        except ValueError:
            return None   # the general path reports what is wrong
    for i, j, b in _role_candidates(globals_, out_idx):
        units = _stage(f, i, j, k, b)
        if units is None:
            continue
        if tile is None:
            tile = _choose_tile(caps, i.src[0], j.src[0])
        if tile is None or not _valid_tile(tile, caps):
            return None
        plan = _Plan(store, red, i, j, k, b, units, tile, scan)
        for u, kind in units.items():
            if kind in "AB":   # fill the tile along k where its loads are contiguous in k only
                w = i if kind == "A" else j
                idxs = [n.src[1] for n in u.toposort() if n.op is Ops.LOAD]
                along_k = (any(x_coefficient(x, k) == 1 for x in idxs)
                           and not any(x_coefficient(x, w) == 1 for x in idxs))
                plan.fast[u] = "k" if along_k else "w"
        return plan
    return None


# ---- kernel --------------------------------------------------------------------------------------

@dataclass
class _Pass:
    """Where one work-item puts `vec` elements of a tile in one fill pass."""
    guard: Instr | None      # the element exists (the last pass of a tile that T does not divide)
    sidx: Instr              # shared index of the first element (buffer 0)
    lk: Instr                # local k of the first element
    w: Instr | None          # clamped global row (A) / column (B) coordinate; None for K tiles
    vec: int = 1             # contiguous global elements read at once (one vector load)
    along: str = "k"         # the direction of a vector: 'k' (A^T rows: one scalar store per lane) or 'w'


@dataclass
class _Tile:
    unit: UOp
    kind: str                # 'A', 'B' or 'K'
    smem: Instr
    ld: int                  # elements per k-row of the tile
    size: int                # elements of one buffer (16-byte multiple); two buffers when double-buffered
    passes: list = field(default_factory=list)   # scalar passes (any tile, the k tail too)
    vpasses: list = field(default_factory=list)  # vector passes for full tiles (empty: use `passes`)
    vcond: list = field(default_factory=list)    # sizes that must be multiples of the vector width for
                                                 # `vpasses` (checked in the kernel: the aligned variant)


def _outside(root: UOp, red: UOp) -> list[UOp]:
    """The nodes of root's graph reachable without passing through `red`."""
    seen: dict[UOp, None] = {}
    stack = [root]
    while stack:
        n = stack.pop()
        if n in seen or n is red:
            continue
        seen[n] = None
        stack.extend(n.src)
    return list(seen)


def _affine(node: UOp) -> dict | None:
    """{range or None (the constant): integer coefficient} when node is an integer affine form of ranges
    with constant coefficients, else None (variables, loads, anything else: nothing provable)."""
    op = node.op
    if op is Ops.CONST:
        return {None: int(node.arg)} if not isinstance(node.arg, float) else None
    if op is Ops.RANGE:
        return {node: 1}
    if op in (Ops.ADD, Ops.SUB):
        a, b = _affine(node.src[0]), _affine(node.src[1])
        if a is None or b is None:
            return None
        out = dict(a)
        for k, v in b.items():
            out[k] = out.get(k, 0) + (v if op is Ops.ADD else -v)
        return out
    if op is Ops.MUL:
        a, b = _affine(node.src[0]), _affine(node.src[1])
        if a is None or b is None:
            return None
        if set(a) == {None}:
            a, b = b, a
        if set(b) != {None}:
            return None
        return {k: v * b[None] for k, v in a.items()}
    if op is Ops.NEG:
        a = _affine(node.src[0])
        return None if a is None else {k: -v for k, v in a.items()}
    return None


def _vector_aligned(idx: UOp, along: UOp, width: int) -> bool:
    """idx = along + (a multiple of `width` for every value of the other ranges): `width` elements from
    an index whose `along` coordinate is a multiple of `width` are contiguous and width-aligned. `along` may
    also enter through `along // D` and `along % D` with D a constant multiple of `width` (an implicit GEMM's
    pixel row split into image, row and column: a run of `width` from a multiple of `width` stays in one
    block of D), as `_lane_form` proves."""
    form = _affine(idx)
    if form is not None:
        if form.get(along) != 1:
            return False
        return all(v % width == 0 for k, v in form.items() if k is not along)
    return _lane_form(idx, along, width) == (1, True)


def _lane_form(node: UOp, along: UOp, width: int) -> "tuple[int, bool] | None":
    """With along = width * q + l (0 <= l < width): (c, m) where node = c * l + R and m tells whether R is a
    multiple of `width` for every value of q and the other ranges; None where node depends on l otherwise."""
    if along not in node.free_ranges:
        return 0, _multiple_of(node, width)
    op = node.op
    if node is along:
        return 1, True
    if op in (Ops.IDIV, Ops.MOD):
        x, d = node.src
        a = None if along in d.free_ranges else _lane_form(x, along, width)
        if a is None:
            return None
        by_width = d.op is Ops.CONST and int(d.arg) > 0 and int(d.arg) % width == 0
        if a[0] == 0:           # the same for every l
            return 0, op is Ops.MOD and a[1] and by_width
        if a != (1, True) or not by_width:
            return None
        # x = width * q' + l: x // D is the same for every l, x % D = (width * q' % D) + l
        return (0, False) if op is Ops.IDIV else (1, True)
    if op in (Ops.ADD, Ops.SUB):
        a, b = _lane_form(node.src[0], along, width), _lane_form(node.src[1], along, width)
        if a is None or b is None:
            return None
        return (a[0] + b[0] if op is Ops.ADD else a[0] - b[0]), a[1] and b[1]
    if op is Ops.MUL:
        x, k = node.src
        if along in k.free_ranges:
            x, k = k, x
        if along in k.free_ranges or k.op is not Ops.CONST:
            return None
        a = _lane_form(x, along, width)
        if a is None:
            return None
        return a[0] * int(k.arg), a[1] or int(k.arg) % width == 0
    return None


def _multiple_of(node: UOp, width: int) -> bool:
    """Whether integer `node` is a multiple of `width` for every value of its ranges (False: not proven)."""
    op = node.op
    if op is Ops.CONST:
        return not isinstance(node.arg, float) and int(node.arg) % width == 0
    if op in (Ops.ADD, Ops.SUB):
        return _multiple_of(node.src[0], width) and _multiple_of(node.src[1], width)
    if op is Ops.MUL:
        return _multiple_of(node.src[0], width) or _multiple_of(node.src[1], width)
    if op is Ops.MOD:
        d = node.src[1]
        return d.op is Ops.CONST and int(d.arg) % width == 0 and _multiple_of(node.src[0], width)
    return False


def _terms(node: UOp) -> dict | None:
    """{range or None (the rest): coefficient} when node is an affine form of ranges whose coefficients are
    free of ranges and loads (constants, variables, their arithmetic), else None."""
    if not node.free_ranges:
        return None if any(n.op is Ops.LOAD for n in node.toposort()) else {None: node}
    op = node.op
    if op is Ops.RANGE:
        return {node: UOp.const(1, node.dtype)}
    if op in (Ops.ADD, Ops.SUB):
        a, b = _terms(node.src[0]), _terms(node.src[1])
        if a is None or b is None:
            return None
        out = dict(a)
        for k, v in b.items():
            v = v if op is Ops.ADD else -v
            out[k] = out[k] + v if k in out else v
        return out
    if op is Ops.MUL:
        x, c = node.src
        if x.free_ranges and c.free_ranges:
            return None
        if not x.free_ranges:
            x, c = c, x
        a = _terms(x)
        if a is None or any(n.op is Ops.LOAD for n in c.toposort()):
            return None
        return {k: v * c for k, v in a.items()}
    if op is Ops.NEG:
        a = _terms(node.src[0])
        return None if a is None else {k: -v for k, v in a.items()}
    return None


def _alignment_at_launch(idx: UOp, along: UOp, width: int) -> list[UOp] | None:
    """What `_vector_aligned` needs when strides are symbolic: the launch-time sizes (range-free
    expressions) that must be multiples of `width` for `width` elements from an index whose `along`
    coordinate is a multiple of `width` to be contiguous and aligned; [] when proven, None when never."""
    form = _terms(idx)
    if form is None or all(k is not along for k in form):
        return None
    lead = simplify(form[along])
    if lead.op is not Ops.CONST or lead.arg != 1:
        return None
    conds: list[UOp] = []
    for k, v in form.items():
        if k is along:
            continue
        v = simplify(v)
        if v.op is Ops.CONST:
            if int(v.arg) % width:
                return None
        elif all(v is not c for c in conds):
            conds.append(v)
    return conds


def _cdiv_groups(extent: UOp, block: int) -> UOp:
    """ceil(extent / block) groups, 0 for an empty extent, with no intermediate overflow."""
    return simplify(((extent - 1) // block + 1).minimum(extent))


class _Builder:
    aligned = True      # building the variant whose launch-time alignment conditions hold (see `conds`)
    conds: list = []

    def grid_prologue(self, p: "_Plan", top: list) -> tuple:
        """The work-group ids (x: columns, y: rows, z: the batch, bound to p.b), the work-item id and
        the M, N, K sizes, emitted at the top of a tiled kernel: (gx, gy, tid, M, N, K)."""
        gx = self.new(L.SPECIAL, dtypes.index, (), ("group_id", 0))
        gy = self.new(L.SPECIAL, dtypes.index, (), ("group_id", 1))
        tid = self.new(L.SPECIAL, dtypes.index, (), ("local_id", 0))
        top += [gx, gy, tid]
        self.bind: dict[UOp, Instr] = {}
        if p.b is not None:
            gz = self.new(L.SPECIAL, dtypes.index, (), ("group_id", 2))
            top.append(gz)
            self.bind[p.b] = gz
        memo: dict[UOp, Instr] = {}
        sizes = [self.expr(r.src[0], {}, top, memo) for r in (p.i, p.j, p.k)]
        return (gx, gy, tid, *sizes)

    def __init__(self, ast: UOp, caps: "Capabilities", name: str, plan: _Plan, async_fill: bool = False,
                 split_k: int = 1) -> None:
        self.ast, self.caps, self.name, self.p = ast, caps, name, plan
        self.async_fill = async_fill and caps.async_copy
        self.split_k = split_k          # work-groups per output tile, each over K / split_k (split_k_applies)
        self.kbeg: Instr | None = None  # split_k: the first k of this group's part
        self.hidden: list[HiddenBuffer] = []
        self.hidden_params: list[ParamInfo] = []
        self.next_id = 0
        self.leaves: dict[tuple, Instr] = {}
        # integer nodes of load/store indices and range ends may be printed with nsw (the launch check
        # proves them in range); arithmetic above a load is data, not proven (as in the general path)
        self.index_nodes = plan.scan.index_nodes
        self.later_passes: dict[int, object] = {}

    # instructions ---------------------------------------------------------------------------
    def new(self, kind: L, dtype: DType | None, src=(), arg=None) -> Instr:
        self.next_id += 1
        return Instr(kind, dtype, tuple(src), arg, self.next_id)

    def leaf(self, kind: L, dtype: DType, arg) -> Instr:
        """CONST, PARAM and VAR: printed inline, so one instruction serves every block."""
        key = (kind, dtype, type(arg).__name__, repr(arg))   # repr: -0.0 is not 0.0
        hit = self.leaves.get(key)
        if hit is None:
            hit = self.leaves[key] = self.new(kind, dtype, (), arg)
        return hit

    def c(self, v: int) -> Instr:
        return self.leaf(L.CONST, dtypes.index, v)

    def op(self, out: list[Item], op: Ops, *src: Instr, dtype: DType = dtypes.index) -> Instr:
        """Index arithmetic of the tiling: every value is bounded by a range end (see the comments at
        each use), so it is marked overflow-free."""
        ins = self.new(L.ALU, dtypes.bool if op is Ops.CMPLT else dtype, src, op)
        ins.index_math = dtype is dtypes.index and op is not Ops.CMPLT
        out.append(ins)
        return ins

    def expr(self, node: UOp, env: dict[UOp, Instr], out: list[Item], memo: dict[UOp, Instr]) -> Instr:
        """Emit `node` into `out` with ranges (and staged units, the reduce) bound by `env`."""
        hit = env.get(node)
        if hit is None:
            hit = memo.get(node)
        if hit is not None:
            return hit
        op = node.op
        if op is Ops.CONST:
            ins = self.leaf(L.CONST, node.dtype, node.arg)
        elif op is Ops.PARAM:
            ins = self.leaf(L.PARAM, node.dtype, node.arg)
        elif op is Ops.DEFINE_VAR:
            ins = self.leaf(L.VAR, node.dtype, node.arg[0])
        elif op in (Ops.RANGE, Ops.REDUCE):
            raise AssertionError(f"unbound {op.name} in a tiled contraction")
        else:
            srcs = [self.expr(s, env, out, memo) for s in node.src]
            if op is Ops.LOAD:
                ins = self.new(L.LOAD, node.dtype, srcs)
            else:
                ins = self.new(L.ALU, node.dtype, srcs, op)
                ins.index_math = id(node) in self.index_nodes
            out.append(ins)
        memo[node] = ins
        return ins

    # the kernel -------------------------------------------------------------------------------
    def build(self) -> "tuple[LinearKernel, LaunchInfo] | None":
        p = self.p
        BM, BN, BK, TM, TN = p.tile
        MT, NT = BM // TM, BN // TN          # work-items along rows and columns
        self.T, self.BK = MT * NT, BK
        # a plain product (acc += A * B, 4-byte values or smaller): the case whose register budget is known
        # -- 64 accumulators, two 8-value fragments and the prefetched tile fit 128 registers without
        # spills -- gets the occupancy hint and the unrolled kk loop. Heavier f (max, differences, more
        # units) or 8-byte values would spill under the cap: the compiler sizes them itself, as before.
        f = p.red.src[0]
        self.plain = (p.red.arg is Ops.ADD and f.op is Ops.MUL and p.red.dtype.itemsize <= 4
                      and sorted(p.units.get(s) or "" for s in f.src) == ["A", "B"])
        # a work-item's TM rows come in runs of VM contiguous rows, the runs MT*VM apart, so that
        # neighbouring work-items read neighbouring shared words (and a run is one vector read)
        VM = 4 if TM % 4 == 0 else 2 if TM % 2 == 0 else 1
        VN = 4 if TN % 4 == 0 else 2 if TN % 2 == 0 else 1
        self.runs = {"A": VM, "B": VN}
        self.offs = {"A": [(r // VM) * MT * VM + r % VM for r in range(TM)],
                     "B": [(c // VN) * NT * VN + c % VN for c in range(TN)]}
        body: list[Item] = []
        top = body
        gx, gy, tid, M, N, K = self.grid_prologue(p, top)
        if self.split_k > 1:        # group z: this group's part of k (p.b is None: z is free)
            gz = self.new(L.SPECIAL, dtypes.index, (), ("group_id", 2))
            top.append(gz)
            self.gz = gz
            self.kbeg = self.op(top, Ops.MUL, gz, self.c(int(p.k.src[0].arg) // self.split_k))
        tx = self.op(top, Ops.MOD, tid, self.c(NT))
        ty = self.op(top, Ops.IDIV, tid, self.c(NT))
        # the grid has exactly ceil(M / BM) x ceil(N / BN) groups: row0 <= M - 1, col0 <= N - 1
        row0 = self.op(top, Ops.MUL, gy, self.c(BM))
        col0 = self.op(top, Ops.MUL, gx, self.c(BN))
        rem_m = self.op(top, Ops.SUB, M, row0)       # >= 1: the rows of this group that exist
        rem_n = self.op(top, Ops.SUB, N, col0)
        # per side of the block (A: rows, B: columns): (first coordinate, how many exist, last local one)
        self.side = {"A": (row0, rem_m, self.op(top, Ops.SUB, rem_m, self.c(1))),
                     "B": (col0, rem_n, self.op(top, Ops.SUB, rem_n, self.c(1)))}
        self.tiles = [self.tile(u, kind, BM if kind == "A" else BN if kind == "B" else 1, tid, top)
                      for u, kind in p.units.items() if kind in "ABK"]
        smem_bytes = sum(t.size * t.smem.dtype.itemsize for t in self.tiles)
        limit = ASYNC_SMEM_LIMIT if self.async_fill else SMEM_LIMIT
        if smem_bytes > limit:
            return None
        # the aligned variant (symbolic strides that are multiples of 4 at launch) shares the shared tiles
        self.conds = [c for t in self.tiles for c in t.vcond]
        self.conds = list({id(c): c for c in self.conds}.values())
        self.aligned = True
        self.db = (2 * smem_bytes <= limit and
                   (DOUBLE_BUFFER >= 2 or DOUBLE_BUFFER == 1 and all(t.vpasses for t in self.tiles if t.kind in "AB")))
        if self.db:
            for t in self.tiles:
                t.smem.arg = 2 * t.size
        red = p.red
        ident = reduce_identity(red.dtype, red.arg)
        self.accs = [[self.new(L.ACC, red.dtype, (), ident) for _ in range(TN)] for _ in range(TM)]
        top.extend(a for row in self.accs for a in row)
        self.first = {"A": self.op(top, Ops.MUL, ty, self.c(VM)), "B": self.op(top, Ops.MUL, tx, self.c(VN))}

        # everything that reads the inputs runs only when K > 0: the launch check skips the loads of f
        # when the reduce has no iterations, so they may be out of bounds then
        zero = self.c(0)
        has_k = If(self.op(top, Ops.CMPLT, zero, K))
        top.append(has_k)
        work = has_k.body
        self.regs = self.register_units(work)
        # full tiles: k0 = 0, BK, ..., k_full - BK (split_k: kbeg, ..., kbeg + K / split_k - BK)
        if self.kbeg is not None:
            k_full = self.op(work, Ops.ADD, self.kbeg, self.c(int(p.k.src[0].arg) // self.split_k))
        else:
            k_full = self.op(work, Ops.SUB, K, self.op(work, Ops.MOD, K, self.c(BK)))
        # its last step reaches k_full <= K: it cannot wrap, but it is checked like every stepped loop
        Ke = p.k.src[0]
        self.stepped = [SteppedLoop(Ke - Ke % BK, UOp.const(BK, dtypes.index), UOp.const(0, dtypes.index))]
        if self.conds:
            # symbolic strides: the aligned variant when every size it needs is a multiple of 4 (a uniform
            # branch), else the scalar one; the k tail and the epilogue are shared
            memo: dict[UOp, Instr] = {}
            bits = None
            for cnd in self.conds:
                b = self.op(work, Ops.AND, self.expr(cnd, dict(self.bind), work, memo), self.c(3))
                bits = b if bits is None else self.op(work, Ops.ADD, bits, b)
            fast, slow = If(self.new(L.ALU, dtypes.bool, (bits, zero), Ops.CMPEQ)), If(self.op(work, Ops.CMPLT, zero, bits))
            work += [fast.cond, fast, slow]
            self.k_loop(fast.body, k_full, self.db)
            self.aligned = False
            self.scalar_passes_in(slow.body)
            self.k_loop(slow.body, k_full, self.db and all(not t.vcond for t in self.tiles))
        else:
            self.k_loop(work, k_full, self.db)
        if self.kbeg is None:
            # the tail: one partial tile of k_rem < BK valid k (a uniform condition: barriers are fine)
            tail = If(self.op(work, Ops.CMPLT, k_full, K))
            work.append(tail)
            self.scalar_passes_in(tail.body)
            k_rem = self.op(tail.body, Ops.SUB, K, k_full)
            self.k_step(tail.body, k_full, self.op(tail.body, Ops.SUB, k_rem, self.c(1)), k_rem)
            self.epilogue(top)
        else:
            self.epilogue(self.combine_parts(top))
        return self.finish(body)

    def combine_parts(self, top: list[Item]) -> list[Item]:
        """split_k: every group writes its accumulators to a hidden scratch (its tile's part), then takes a
        ticket from the tile's hidden counter; the group that takes the last one sums the parts (in part
        order) into its accumulators, resets the counter for the next launch, and runs the epilogue: the
        list returned. As strategies/grid_reduce.py combines a full reduction's partials."""
        p, S = self.p, self.split_k
        BM, BN = p.tile[:2]
        cols = -(-int(p.j.src[0].arg) // BN)
        tiles = cols * -(-int(p.i.src[0].arg) // BM)
        dt = p.red.dtype
        slot = len(p.scan.params)
        self.hidden = [HiddenBuffer(dt, tiles * S * BM * BN), HiddenBuffer(dtypes.uint32, tiles)]
        self.hidden_params = [ParamInfo(slot, dt, True, True), ParamInfo(slot + 1, dtypes.uint32, True, True)]
        scratch = self.new(L.PARAM, dt, (), slot)
        counter = self.new(L.PARAM, dtypes.uint32, (), slot + 1)
        gx, gy = (next(i for i in top if isinstance(i, Instr) and i.kind is L.SPECIAL and i.arg == ("group_id", d))
                  for d in (0, 1))
        tid = next(i for i in top if isinstance(i, Instr) and i.kind is L.SPECIAL and i.arg == ("local_id", 0))
        tile = self.op(top, Ops.ADD, self.op(top, Ops.MUL, gy, self.c(cols)), gx)
        first = self.op(top, Ops.MUL, tile, self.c(S * BM * BN))         # the tile's part 0
        mine = self.op(top, Ops.ADD, first, self.op(top, Ops.MUL, self.gz, self.c(BM * BN)))
        pos = {}
        for r, ro in enumerate(self.offs["A"]):
            lr = self.op(top, Ops.ADD, self.first["A"], self.c(ro)) if ro else self.first["A"]
            for c, co in enumerate(self.offs["B"]):
                lc = self.op(top, Ops.ADD, self.first["B"], self.c(co)) if co else self.first["B"]
                pos[r, c] = self.op(top, Ops.ADD, self.op(top, Ops.MUL, lr, self.c(BN)), lc)
                v = self.new(L.ACC_LOAD, dt, (self.accs[r][c],))
                top += [v, self.new(L.STORE, None, (scratch, self.op(top, Ops.ADD, mine, pos[r, c]), v))]
        # every item's parts are visible device-wide before item 0 takes the ticket
        top += [self.new(L.FENCE, None), self.new(L.BARRIER, None)]
        zero = self.c(0)
        flag = self.new(L.LOCAL, dtypes.int32, (), 1)
        top.append(flag)
        is0 = self.new(L.ALU, dtypes.bool, (tid, zero), Ops.CMPEQ)
        top.append(is0)
        taker = If(is0)
        ticket = self.new(L.ATOMIC_ADD, dtypes.uint32, (counter, tile, self.new(L.CONST, dtypes.uint32, (), 1)))
        got = self.new(L.ALU, dtypes.bool, (ticket, self.new(L.CONST, dtypes.uint32, (), S - 1)), Ops.CMPEQ)
        as_int = self.new(L.ALU, dtypes.int32, (got,), Ops.CAST)
        taker.body += [ticket, self.new(L.FENCE, None), got, as_int, self.new(L.STORE, None, (flag, zero, as_int))]
        top += [taker, self.new(L.BARRIER, None)]
        fv = self.new(L.LOAD, dtypes.int32, (flag, zero))
        last_cond = self.new(L.ALU, dtypes.bool, (fv, self.new(L.CONST, dtypes.int32, (), 0)), Ops.CMPNE)
        last = If(last_cond)
        top += [fv, last_cond, last]
        out = last.body
        for (r, c), at in pos.items():
            total = None
            for part in range(S):
                idx = self.op(out, Ops.ADD, self.op(out, Ops.ADD, first, self.c(part * BM * BN)) if part else first, at)
                v = self.new(L.LOAD, dt, (scratch, idx))
                v.volatile = True
                out.append(v)
                if total is None:
                    total = v
                else:
                    total = self.new(L.ALU, dt, (total, v), Ops.ADD)
                    out.append(total)
            out.append(self.new(L.ACC_STORE, None, (self.accs[r][c], total)))
        again = self.new(L.ALU, dtypes.bool, (tid, zero), Ops.CMPEQ)
        out += [again, If(again, [self.new(L.STORE, None, (counter, tile, self.new(L.CONST, dtypes.uint32, (), 0)))])]
        return out

    def k_loop(self, work: list[Item], k_full: Instr, db: bool) -> None:
        """The full tiles k0 = 0, BK, ..., k_full - BK, double-buffered or not."""
        zero, BK = self.c(0), self.BK
        start = zero if self.kbeg is None else self.kbeg
        main = Loop(self.new(L.LOOPVAR, dtypes.index), start, k_full, AxisType.REDUCE, step=self.c(BK))
        if db:
            # the first full tile into buffer 0; then step k0 computes from buffer (k0 / BK) % 2 while the
            # next tile is in flight into the other one (read in the step before, behind its barrier):
            # register-staged loads whose shared stores follow the arithmetic, or asynchronous copies
            # (async_fill) that land at the wait before the step's barrier
            asy = {id(t): self.async_fill and self.copies_async(t) for t in self.tiles}
            first = If(self.op(work, Ops.CMPLT, start, k_full))
            work.append(first)
            par = self.new(L.ACC, dtypes.index, (), 0)     # which buffer this step reads: 0, 1, 0, ...
            work.append(par)
            for t in self.tiles:
                if asy[id(t)]:
                    self.fill_async(t, start, None, first.body)
                else:
                    self.fill(t, self.full_passes(t), start, None, None, first.body, first.body)
            if any(asy.values()):
                first.body += [self.new(L.CP_COMMIT, None), self.new(L.CP_WAIT, None, (), 0)]
            first.body.append(self.new(L.BARRIER, None))
            work.append(main)
            lb = main.body
            # the tile after this one; the last step reloads its own tile (in range, never read)
            kn = self.op(lb, Ops.MIN, self.op(lb, Ops.ADD, main.var, self.c(BK)),
                         self.op(lb, Ops.SUB, k_full, self.c(BK)))
            now = self.new(L.ACC_LOAD, dtypes.index, (par,))
            lb.append(now)
            later: list[Item] = []
            rd: dict[int, Instr] = {}
            for t in self.tiles:
                rd[id(t)] = self.op(lb, Ops.MUL, now, self.c(t.size))
                wr = self.op(lb if asy[id(t)] else later, Ops.SUB, self.c(t.size), rd[id(t)])
                if asy[id(t)]:
                    self.fill_async(t, kn, wr, lb)
                else:
                    self.fill(t, self.full_passes(t), kn, None, wr, lb, later)
            if any(asy.values()):
                lb.append(self.new(L.CP_COMMIT, None))
            self.compute(lb, rd, self.c(BK), True)
            lb.extend(later)
            if any(asy.values()):
                lb.append(self.new(L.CP_WAIT, None, (), 0))
            lb.append(self.new(L.ACC_STORE, None, (par, self.op(lb, Ops.SUB, self.c(1), now))))
            lb.append(self.new(L.BARRIER, None))   # this buffer is read before the next fill of it
        else:
            work.append(main)
            self.k_step(main.body, main.var, None, self.c(BK))
            main.body.append(self.new(L.BARRIER, None))   # every tile is read before the next fill

    def finish(self, body: list[Item]) -> "tuple[LinearKernel, LaunchInfo]":
        """The kernel and its launch information, built the way the general path builds them."""
        p = self.p
        BM, BN = p.tile[:2]
        pinfo, var_list, ranges = p.scan.params, p.scan.variables, p.scan.ranges
        # one bounds check per load of f (inside the reduce: skipped when it has no iterations, as in the
        # general path), per load of g and for the store (always checked)
        red = p.red
        accesses = [Access(n.src[0].arg, False, n.src[1], (p.k,)) for n in red.src[0].toposort() if n.op is Ops.LOAD]
        accesses += [Access(n.src[0].arg, False, n.src[1], ()) for n in _outside(p.store, red) if n.op is Ops.LOAD]
        accesses.append(Access(p.store.src[0].arg, True, p.store.src[1], ()))
        dims = [_cdiv_groups(p.j.src[0], BN), _cdiv_groups(p.i.src[0], BM)]
        if p.b is not None:
            dims.append(p.b.src[0])
        elif self.split_k > 1:
            dims.append(UOp.const(self.split_k, dtypes.index))
        local = (self.T, 1, 1)
        # the hint caps registers (CUDA: 128 for 256 items; two groups must fit the 1024 threads of an SM
        # of any arch)
        occupancy = MIN_GROUPS if self.plain and self.T * MIN_GROUPS <= 1024 else 0
        kernel = LinearKernel(self.name, pinfo + self.hidden_params, [v.name for v in var_list], body, local,
                              thread_split=False, gpu=True, min_groups=occupancy)
        info = LaunchInfo(pinfo, var_list, dims, local, True, accesses,
                          [r.src[0] for r in ranges.values()], self.caps.grid_max, group_per_item=True,
                          hidden=self.hidden, stepped_loops=self.stepped)
        return kernel, info

    def tile(self, unit: UOp, kind: str, width: int, tid: Instr, top: list[Item]) -> _Tile:
        """A shared tile [BK][width + PAD] (two of them when double-buffered) and its fill passes."""
        BK = self.BK
        ld = width + PAD if kind != "K" else 1
        per16 = max(1, 16 // unit.dtype.itemsize)          # whole 16-byte rows: aligned neighbours
        size = -(-BK * ld // per16) * per16
        smem = self.new(L.LOCAL, unit.dtype, (), size)      # doubled in build() when double-buffered
        top.append(smem)
        t = _Tile(unit, kind, smem, ld, size)
        fast = self.p.fast.get(unit, "k")
        vec = self.fill_vector(t, width, fast)
        if vec == 1 and ALIGNED_VARIANT and _cuda_like(self.caps):
            vec, t.vcond = self.fill_vector_at_launch(t, width, fast)
        if t.vcond:     # the scalar passes are computed in the blocks that use them (fewer live registers)
            self.later_passes[id(t)] = lambda out, t=t, width=width, fast=fast: self.fill_passes(t, width, fast, 1, tid, out)
        else:
            t.passes = self.fill_passes(t, width, fast, 1, tid, top)
        if vec > 1:
            t.vpasses = self.fill_passes(t, width, fast, vec, tid, top)
        return t

    def scalar_passes_in(self, out: list[Item]) -> None:
        """The scalar fill passes of the tiles with an aligned variant, computed at the start of `out` (the
        scalar variant's k loop, the k tail): not live across the aligned variant's loop."""
        for t in self.tiles:
            make = self.later_passes.get(id(t))
            if make is not None:
                t.passes = make(out)

    def fill_vector_at_launch(self, t: _Tile, width: int, fast: str) -> tuple[int, list[UOp]]:
        """(4, sizes) when full tiles of t could be filled by 4-wide global loads if `sizes` (symbolic
        strides, and the extent for a fill along rows/columns) are multiples of 4 at launch: the kernel
        then holds an aligned variant beside the scalar one and picks it by a uniform branch. (1, []): no."""
        p, vec = self.p, 4
        u = t.unit
        if (not VECTOR_FILL or self.caps.vector_width < vec or t.kind == "K" or u.op is not Ops.LOAD
                or u.dtype.name not in _VECTOR_DTYPES):
            return 1, []
        rng = p.k if fast == "k" else p.i if t.kind == "A" else p.j
        conds = _alignment_at_launch(u.src[1], rng, vec)
        if conds is None or (fast == "k" and self.BK % vec) or (fast == "w" and width % vec):
            return 1, []
        if fast == "w":
            ext = rng.src[0]
            if ext.op is Ops.CONST:
                if ext.arg % vec:
                    return 1, []
            elif all(ext is not c for c in conds):
                conds.append(ext)
        return (vec, conds) if conds else (1, [])

    def full_passes(self, t: _Tile) -> list[_Pass]:
        """The passes that fill a full tile of t in the variant being built."""
        return t.vpasses if t.vpasses and (self.aligned or not t.vcond) else t.passes

    def fill_vector(self, t: _Tile, width: int, fast: str) -> int:
        """4 when full tiles of t can be filled by 4-wide global loads: the unit is one load of a vector
        dtype whose index moves by 1 along `fast` and keeps 4-element alignment (constant strides), and
        along rows/columns (fast 'w') the extent is a constant multiple of 4, so that a clamped vector
        stays in range. Else 1."""
        p, vec = self.p, 4
        u = t.unit
        if (not VECTOR_FILL or self.caps.vector_width < vec or t.kind == "K" or u.op is not Ops.LOAD
                or u.dtype.name not in _VECTOR_DTYPES):
            return 1
        rng = p.k if fast == "k" else p.i if t.kind == "A" else p.j
        if fast == "k":
            if self.BK % vec:
                return 1
        elif width % vec or rng.src[0].op is not Ops.CONST or rng.src[0].arg % vec:
            return 1
        return vec if _vector_aligned(u.src[1], rng, vec) else 1

    def fill_passes(self, t: _Tile, width: int, fast: str, vec: int, tid: Instr, top: list[Item]) -> list[_Pass]:
        """Per fill pass, where work-item tid puts its `vec` elements. Items of a last, partial pass past
        the tile's end load a clamped (real) element and skip the store."""
        BK, T = self.BK, self.T
        units = BK * width // vec
        per = BK // vec if fast == "k" else width // vec   # work-items along one tile row (column)
        out: list[_Pass] = []
        lw0: Instr | None = None     # pass 0's local row (column)
        for pas in range(-(-units // T)):
            guard = None
            if pas and T % per == 0 and (pas + 1) * T <= units and t.kind != "K":
                # pass 0 moved by a whole number of rows (columns): the same lk (lw), constant offsets,
                # so one base register serves every pass
                p0, step = out[0], pas * T // per
                if fast == "k":
                    lk, lw = p0.lk, self.op(top, Ops.ADD, lw0, self.c(step))
                    sidx = self.op(top, Ops.ADD, p0.sidx, self.c(step))
                else:
                    lk, lw = self.op(top, Ops.ADD, p0.lk, self.c(step)), lw0
                    sidx = self.op(top, Ops.ADD, p0.sidx, self.c(step * t.ld))
                lane_span = vec if fast == "w" else 1
                out.append(_Pass(None, sidx, lk, self.clamped(top, t.kind, lw, lane_span), vec, fast))
                continue
            e = self.op(top, Ops.ADD, tid, self.c(pas * T)) if pas else tid
            if (pas + 1) * T > units:
                guard = self.op(top, Ops.CMPLT, e, self.c(units))
                e = self.op(top, Ops.MIN, e, self.c(units - 1))
            if t.kind == "K":
                out.append(_Pass(guard, e, e, None))
                continue
            if fast == "k":     # consecutive work-items: consecutive k of one row
                lk = self.op(top, Ops.MOD, e, self.c(per))
                lk = self.op(top, Ops.MUL, lk, self.c(vec)) if vec > 1 else lk
                lw = self.op(top, Ops.IDIV, e, self.c(per))
            else:               # consecutive work-items: consecutive rows (columns) of one k
                lw = self.op(top, Ops.MOD, e, self.c(per))
                lw = self.op(top, Ops.MUL, lw, self.c(vec)) if vec > 1 else lw
                lk = self.op(top, Ops.IDIV, e, self.c(per))
            if not pas:
                lw0 = lw
            sidx = self.op(top, Ops.ADD, self.op(top, Ops.MUL, lk, self.c(t.ld)), lw)
            lane_span = vec if fast == "w" else 1
            out.append(_Pass(guard, sidx, lk, self.clamped(top, t.kind, lw, lane_span), vec, fast))
        return out

    def clamped(self, out: list[Item], kind: str, local: Instr, span: int = 1) -> Instr:
        """The coordinate of row (column) `local` of the group's block, clamped into the extent: rows
        past its end read the last row (their results are never stored). span > 1: the first of `span`
        contiguous ones, all in range (the extent is a multiple of span, checked by fill_vector)."""
        base, rem, last = self.side[kind]
        if span > 1:
            last = self.op(out, Ops.SUB, rem, self.c(span))
        return self.op(out, Ops.ADD, base, self.op(out, Ops.MIN, local, last))

    def register_units(self, out: list[Item]) -> dict[tuple, Instr]:
        """Units of f that do not depend on k: computed once, per output row (I), column (J) or once (S)."""
        p = self.p
        regs: dict[tuple, Instr] = {}
        for u, kind in p.units.items():
            if kind == "S":
                regs[(u, 0)] = self.expr(u, dict(self.bind), out, {})
            elif kind in "IJ":
                side, rng = ("A", p.i) if kind == "I" else ("B", p.j)
                for n, off in enumerate(self.offs[side]):
                    local = self.op(out, Ops.ADD, self.first[side], self.c(off))
                    regs[(u, n)] = self.expr(u, {**self.bind, rng: self.clamped(out, side, local)}, out, {})
        return regs

    def fill(self, t: _Tile, passes: list[_Pass], k0: Instr, k_last: Instr | None, off: Instr | None,
             loads: list[Item], stores: list[Item]) -> None:
        """Tile rows k0..k0+BK (k clamped to k_last in the tail) of t: the global loads go to `loads`, the
        rest of the unit and the shared stores (at buffer offset `off`) to `stores` -- later in the same
        block when the loads are prefetched. `k_parts` may bind parts of the unit's index to values taken
        from k0 (the tensor-core builder's k // D and k % D)."""
        p = self.p
        kmemo: dict = {}
        for ps in passes:
            lk = ps.lk if k_last is None else self.op(loads, Ops.MIN, ps.lk, k_last)
            kc = self.op(loads, Ops.ADD, k0, lk)
            env = {**self.bind, p.k: kc, **self.k_parts(t.unit, k0, lk, loads, kmemo)}
            if ps.w is not None:
                env[p.i if t.kind == "A" else p.j] = ps.w
            memo: dict[UOp, Instr] = {}
            if ps.vec > 1:
                idx = self.expr(t.unit.src[1], env, loads, memo)
                v = self.new(L.LOAD, t.unit.dtype, (self.expr(t.unit.src[0], env, loads, memo), idx), ps.vec)
                loads.append(v)
            else:
                for n in t.unit.toposort():      # the loads first: in flight while the tile is computed
                    if n.op is Ops.LOAD:
                        self.expr(n, env, loads, memo)
            blk = stores
            if ps.guard is not None:
                g = If(ps.guard)
                stores.append(g)
                blk = g.body
            sidx = ps.sidx if off is None else self.op(blk, Ops.ADD, ps.sidx, off)
            if ps.vec == 1:
                blk.append(self.new(L.STORE, None, (t.smem, sidx, self.expr(t.unit, env, blk, memo))))
            elif ps.along == "w":    # contiguous in the tile row too: one vector store
                blk.append(self.new(L.STORE, None, (t.smem, sidx, v), ps.vec))
            else:
                for lane in range(ps.vec):   # consecutive k: one tile row each
                    x = self.new(L.EXTRACT, t.unit.dtype, (v,), lane)
                    si = self.op(blk, Ops.ADD, sidx, self.c(lane * t.ld)) if lane else sidx
                    blk += [x, self.new(L.STORE, None, (t.smem, si, x))]

    def k_parts(self, unit: UOp, k0: Instr, lk: Instr, out: list[Item], memo: dict) -> dict[UOp, Instr]:
        """Parts of a tile unit's index computed once per k tile instead of per element: none here."""
        return {}

    def copies_async(self, t: _Tile) -> bool:
        """Whether the full tiles of t (in the variant being built) are filled by asynchronous copies: a
        row or column tile whose unit is one load, and each copy at least ASYNC_MIN_BYTES (of 4, 8 or 16:
        a vector along the tile row is one copy; along k, each element its own)."""
        size = t.unit.dtype.itemsize
        if t.kind not in "AB" or t.unit.op is not Ops.LOAD:
            return False
        return all(n in (4, 8, 16) and n >= ASYNC_MIN_BYTES
                   for n in (ps.vec * size if ps.along == "w" else size for ps in self.full_passes(t)))

    def fill_async(self, t: _Tile, k0: Instr, off: Instr | None, out: list[Item]) -> None:
        """A full tile at rows k0..k0+BK of t copied into its buffer at offset `off` by cp.async."""
        p = self.p
        size = t.unit.dtype.itemsize
        for ps in self.full_passes(t):
            blk = out
            if ps.guard is not None:        # the work-items past the tile's end copy nothing
                g = If(ps.guard)
                out.append(g)
                blk = g.body
            env = {**self.bind, p.k: self.op(blk, Ops.ADD, k0, ps.lk), (p.i if t.kind == "A" else p.j): ps.w}
            memo: dict[UOp, Instr] = {}
            gidx = self.expr(t.unit.src[1], env, blk, memo)
            buf = self.expr(t.unit.src[0], env, blk, memo)
            sidx = ps.sidx if off is None else self.op(blk, Ops.ADD, ps.sidx, off)
            if ps.along == "w" or ps.vec == 1:
                blk.append(self.new(L.CP_ASYNC, None, (t.smem, sidx, buf, gidx), ps.vec * size))
                continue
            for lane in range(ps.vec):      # consecutive k: one tile row each
                si = self.op(blk, Ops.ADD, sidx, self.c(lane * t.ld)) if lane else sidx
                gi = self.op(blk, Ops.ADD, gidx, self.c(lane)) if lane else gidx
                blk.append(self.new(L.CP_ASYNC, None, (t.smem, si, buf, gi), size))

    def k_step(self, out: list[Item], k0: Instr, k_last: Instr | None, kk_end: Instr) -> None:
        """Fill the tiles for k0..k0+BK (k clamped to k_last in the tail) into buffer 0, barrier,
        accumulate kk < kk_end."""
        for t in self.tiles:
            self.fill(t, self.full_passes(t) if k_last is None else t.passes, k0, k_last, None, out, out)
        out.append(self.new(L.BARRIER, None))
        self.compute(out, {}, kk_end, k_last is None)

    def compute(self, out: list[Item], rd: dict[int, Instr], kk_end: Instr, full: bool) -> None:
        """acc op= f(...) over tile rows kk < kk_end, reading each tile at buffer offset rd[id(tile)] (0)."""
        bases = {}
        for t in self.tiles:
            first = self.first.get(t.kind) if t.kind != "K" else None
            off = rd.get(id(t))
            if first is not None and off is not None:
                first = self.op(out, Ops.ADD, first, off)
            bases[id(t)] = (first, off)
        if full and UNROLL_FULL_TILES and self.plain:
            # full tiles: the kk loop unrolled here, so every shared read has a constant offset and the
            # reads of step kk+1 can be scheduled under the arithmetic of step kk
            for kk in range(self.BK):
                self.accumulate(out, self.c(kk), bases)
        else:
            inner = Loop(self.new(L.LOOPVAR, dtypes.index), self.c(0), kk_end, AxisType.REDUCE)
            out.append(inner)
            self.accumulate(inner.body, inner.var, bases)

    def accumulate(self, body: list[Item], kk: Instr, bases: dict[int, tuple]) -> None:
        """Read row kk of every tile into registers; acc[r][c] op= f(...) for the work-item's outputs.
        bases[id(tile)]: (the work-item's first element in row 0 of the buffer read, the buffer's offset)."""
        p = self.p
        vals: dict[tuple, Instr] = {}
        for t in self.tiles:
            first, off = bases[id(t)]
            if t.kind == "K":
                idx = kk if off is None else self.op(body, Ops.ADD, off, kk)
                v = self.new(L.LOAD, t.smem.dtype, (t.smem, idx))
                body.append(v)
                vals[(t.unit, 0)] = v
                continue
            offs, vw = self.offs[t.kind], self.runs[t.kind]
            if kk.kind is L.CONST:
                base = self.op(body, Ops.ADD, first, self.c(kk.arg * t.ld)) if kk.arg else first
            else:
                base = self.op(body, Ops.ADD, first, self.op(body, Ops.MUL, kk, self.c(t.ld)))
            vector = vw > 1 and t.smem.dtype.name in _VECTOR_DTYPES and t.ld % vw == 0
            for n0 in range(0, len(offs), vw if vector else 1):
                idx = self.op(body, Ops.ADD, base, self.c(offs[n0])) if offs[n0] else base
                if vector:
                    vec = self.new(L.LOAD, t.smem.dtype, (t.smem, idx), vw)
                    body.append(vec)
                    for lane in range(vw):
                        x = self.new(L.EXTRACT, t.smem.dtype, (vec,), lane)
                        body.append(x)
                        vals[(t.unit, n0 + lane)] = x
                else:
                    x = self.new(L.LOAD, t.smem.dtype, (t.smem, idx))
                    body.append(x)
                    vals[(t.unit, n0)] = x
        f = p.red.src[0]
        for r, row_accs in enumerate(self.accs):
            for c, acc in enumerate(row_accs):
                env = dict(self.bind)
                for u, kind in p.units.items():
                    n = r if kind in "AI" else c if kind in "BJ" else 0
                    env[u] = vals[(u, n)] if kind in "ABK" else self.regs[(u, n)]
                fv = self.expr(f, env, body, {})
                cur = self.new(L.ACC_LOAD, acc.dtype, (acc,))
                upd = self.new(L.ALU, acc.dtype, (cur, fv), p.red.arg)
                upd.reassoc = True
                body.extend([cur, upd, self.new(L.ACC_STORE, None, (acc, upd))])

    def epilogue(self, top: list[Item]) -> None:
        """out[i, j] = g(acc, ...) for the outputs that exist; i and j are computed under their guards."""
        p = self.p
        buf, out_idx, val = p.store.src
        row0, rem_m = self.side["A"][:2]
        col0, rem_n = self.side["B"][:2]
        cols = []
        for off in self.offs["B"]:
            lc = self.op(top, Ops.ADD, self.first["B"], self.c(off)) if off else self.first["B"]
            cols.append((lc, self.op(top, Ops.CMPLT, lc, rem_n)))
        for r, off in enumerate(self.offs["A"]):
            lr = self.op(top, Ops.ADD, self.first["A"], self.c(off)) if off else self.first["A"]
            row_if = If(self.op(top, Ops.CMPLT, lr, rem_m))
            top.append(row_if)
            i_val = self.op(row_if.body, Ops.ADD, row0, lr)          # <= M - 1 under the guard
            for c, (lc, ok) in enumerate(cols):
                col_if = If(ok)
                row_if.body.append(col_if)
                blk = col_if.body
                j_val = self.op(blk, Ops.ADD, col0, lc)
                acc_v = self.new(L.ACC_LOAD, self.accs[r][c].dtype, (self.accs[r][c],))
                blk.append(acc_v)
                env = {**self.bind, p.i: i_val, p.j: j_val, p.red: acc_v}
                memo: dict[UOp, Instr] = {}
                v = self.expr(val, env, blk, memo)
                ix = self.expr(out_idx, env, blk, memo)
                blk.append(self.new(L.STORE, None, (self.expr(buf, env, blk, memo), ix, v)))


def plan_tile(ast: UOp, caps: Capabilities, scan: KernelScan | None = None,
              tile: tuple[int, int, int, int, int] | None = None) -> tuple[int, int, int, int, int] | None:
    """The tile a matmul-like kernel takes (`tile`, or one chosen from the caps and its sizes), or None
    when the kernel is no contraction or the tile does not fit the target."""
    if not caps.has_local or not caps.has_shared or (tile is None and caps.matmul_tile is None):
        return None
    plan = _plan(ast, caps, scan, tile)
    return None if plan is None else plan.tile


def _cuda_like(caps: Capabilities) -> bool:
    """CUDA targets (32-lane warps and CUDA's 65535 grid limit in y and z tell them apart among the caps):
    the choices timed on an H100 only. AMD's tiles keep under 128 VGPRs (occupancy): a second, double-
    buffered k loop would not (163 on gfx90a, 131 on gfx1100)."""
    return caps.warp_size == 32 and caps.grid_max[1:] == (65535, 65535)


def deeper_tile(ast: UOp, caps: Capabilities, scan: KernelScan | None,
                tile: tuple[int, int, int, int, int]) -> tuple[int, int, int, int, int]:
    """`tile` with BK doubled when its A and B tiles, double-buffered, still fit the static shared
    memory (half the barriers per k step: measured on an H100, 4096^3 float32 0.91x -> 0.94x torch,
    256x784x512 0.46x -> 0.77x with 64x64 blocks); else `tile`. CUDA targets only (32-lane warps and
    CUDA's 65535 grid limit in y and z tell them apart among the caps): AMD's tiles keep their local
    data share under 16 KiB for occupancy, and no AMD timing backs a deeper tile."""
    BM, BN, BK, TM, TN = tile
    if not _cuda_like(caps):
        return tile
    plan = _plan(ast, caps, scan, (BM, BN, 2 * BK, TM, TN))
    if plan is None:
        return tile
    size = {"A": BM + PAD, "B": BN + PAD, "K": 1}
    smem = sum(2 * BK * size[kind] * u.dtype.itemsize for u, kind in plan.units.items() if kind in size)
    return plan.tile if 2 * smem <= SMEM_LIMIT else tile


def split_k_applies(ast: UOp, caps: Capabilities, scan: KernelScan | None, tile: tuple[int, int, int, int, int],
                    split: int) -> bool:
    """Whether a contraction can take `split` work-groups per output tile (Schedule.split_k): a GPU with shared
    memory, a sum over a float accumulator, constant M, N and K with K a multiple of split x BK, no batch range,
    and targets with device-scope atomics (the tickets; CUDA-like targets, where it was timed)."""
    if split < 2 or not caps.has_local or not caps.has_shared or not _cuda_like(caps):
        return False
    plan = _plan(ast, caps, scan, tile)
    if plan is None or plan.b is not None or plan.red.arg is not Ops.ADD or not plan.red.dtype.is_float:
        return False
    ends = [r.src[0] for r in (plan.i, plan.j, plan.k)]
    if any(e.op is not Ops.CONST for e in ends):
        return False
    return int(ends[2].arg) % (split * plan.tile[2]) == 0


def tile_contraction(ast: "UOp", caps: "Capabilities", name: str, scan: "KernelScan | None" = None,
                     tile: tuple[int, int, int, int, int] | None = None,
                     async_fill: bool = False, split_k: int = 1) -> "tuple[LinearKernel, LaunchInfo] | None":
    """The tiled lowering of a matmul-like kernel, or None for anything else (or a tile too big).
    `scan`: `lower`'s scan_kernel(ast), when it has one; `tile`: the schedule's (None: the caps');
    `async_fill`: the schedule's (full double-buffered tiles filled by cp.async where they allow it)."""
    if not caps.has_local or not caps.has_shared or (tile is None and caps.matmul_tile is None):
        return None
    plan = _plan(ast, caps, scan, tile)
    if plan is None:
        return None
    if split_k > 1 and not split_k_applies(ast, caps, scan, plan.tile, split_k):
        return None
    return _Builder(ast, caps, name, plan, async_fill, max(1, split_k)).build()
