"""AST-level optimizations chosen from a renderer's capabilities, applied before lowering."""
from __future__ import annotations

import math

from ..dtypes import dtypes
from ..ir import AxisType, Ops, UOp, substitute
from .scan import is_column_reduction
from .symbolic import simplify


def _addends(idx: UOp) -> list[UOp]:
    if idx.op is Ops.ADD:
        return _addends(idx.src[0]) + _addends(idx.src[1])
    return [idx]


def _has_reduce(u: UOp) -> bool:
    return any(n.op is Ops.REDUCE for n in u.toposort())


def _const(u: UOp) -> int | None:
    """The value of an integer expression of constants (None when it involves variables)."""
    u = simplify(u)
    return u.arg if u.op is Ops.CONST else None


def _ceil_div(n: UOp, d: int) -> UOp:
    """ceil(n / d) for n >= 0, with no intermediate above n (sizes may be near the index maximum)."""
    return n // d + (n % d).minimum(1)


def _at_least(n: UOp, w: int) -> UOp:
    """1 if n >= w else 0 (n >= 0): the extent of a loop that guards a region."""
    return (n // w).minimum(1)


def _below(n: UOp, w: int) -> UOp:
    """1 if n < w else 0."""
    return (UOp.const(w, dtypes.index) - n).maximum(0).minimum(1)


# the narrowest lane vector: remainder columns of a static width run as one of these
LANE_REMAINDER = 4
# outer work units the tile walk aims for, so that up to this many threads share a narrow matrix. 48: a
# multiple of 2, 3, 4, 6, 8, 12 and 16 threads (16 left 4 of 12 threads idle on the H100 host's Xeon: the
# AVX-512 256x784x512 matmul had 16 column tiles, 8 chunks of 2; now 32 units, 11 chunks of 3)
SPLIT_UNITS = 48


class _Axes:
    """Fresh axis numbers for the ranges a rewrite adds."""

    def __init__(self, ast: UOp) -> None:
        axes = [n.axis for n in ast.toposort() if n.op is Ops.RANGE]
        self.next = (max(axes) + 1) if axes else 0

    def range(self, end, kind: AxisType = AxisType.LOOP) -> UOp:
        r = UOp.range(end, self.next, kind)
        self.next += 1
        return r


def _tile_roles(ast: UOp) -> "tuple[UOp, UOp | None, UOp] | None":
    """(store, i, j) of a kernel register_tile takes, else None. i is None for a column reduction over
    one GLOBAL range (a sum over axis 0): its tiles are one row of tj neighbouring columns."""
    stores = list(ast.src)
    if len(stores) != 1:
        return None     # one GLOBAL loop nest holds every store: tiles for one would repeat the others
    st = stores[0]
    _, idx, val = st.src
    free = st.free_ranges
    globals_ = sorted((r for r in free if r.axis_type is AxisType.GLOBAL), key=lambda r: r.axis)
    if not globals_ or any(r.axis_type is AxisType.LOOP for r in free) or not _has_reduce(val):
        return None
    adds = _addends(idx)
    unit = [r for r in globals_ if any(a is r for a in adds)]
    if not unit:
        return None
    j = unit[-1]
    if len(globals_) == 1:
        return (st, None, j) if is_column_reduction(ast, tuple(globals_)) else None
    return st, [r for r in globals_ if r is not j][-1], j


GEMV_TILE_VECTORS = 8     # fewer static rows than the tile's: its columns widened up to this many lane vectors in all
MERGED_MIN_VECTORS = 2    # a static N below the tile's width, of at least this many lane vectors and a remainder of at
                          # most LANE_REMAINDER columns: one tile of whole vectors with the remainder merged (tile_for)
GEMV_MIN_UNITS = 16       # while that leaves at least this many column tiles (the most threads BALANCE_THREADS splits)
MERGED_SPARE_REGISTERS = 0  # registers a tile with a merged remainder vector leaves free below the target tile's
                            # (`merged_rows`)


def merged_rows(tile: tuple[int, int], lanes: int, per_row: int) -> int:
    """Rows of a tile whose rows hold `per_row` vectors (whole lane vectors and a merged remainder's): its
    accumulators (rows x per_row) and B's vectors (per_row) within the registers the target tile fills (its rows
    + 1 times its vectors), less MERGED_SPARE_REGISTERS. The target's rows alone spilled accumulators to the stack
    in every K step where a remainder vector made the rows wider (rendered for matmul(512, N, 576): AVX-512's
    6 x (64 + 4) made 18 stack accesses a step, AVX2's 6 x (16 + 4) 20; 4 and 3 rows, this rule, none).
    benchmarks/cpu_tiles.py --tag merged-remainder, this rule's default against the 6-row tile: matmul(4096, 20,
    512) 2.58 against 3.35 ms on the 2-vCPU AVX2 EPYC (cpu-epyc-avx2-2c/cpu_tiles-merged-remainder.json; its
    smaller shapes sit within that host's noise), matmul(2048, 68, 512) 0.20 against 0.26 ms and matmul(1000, 66,
    333) 0.080 against 0.097 on the 16-core Xeon (cpu-xeon-avx512-16c/cpu_tiles-merged-remainder.json).
    AVX-512's 6 x (48 + 4) keeps its 6 rows with 3 stack accesses a step: a register spared (5 rows, none)
    ran resnet50's launches 13.82 against 13.63 ms and densenet121's 19.38 against 19.03 on the 16-core Xeon
    (benchmarks/onnx_models.py's light models, both forms in one process, medians of 15 rounds), though one
    thread ran matmul(2048, 49, 512) in 0.90 against 1.10 ms with it."""
    ti, tj = tile
    return max(1, min(ti, ((ti + 1) * (tj // lanes) - MERGED_SPARE_REGISTERS) // per_row - 1))


def tile_for(ast: UOp, tile: tuple[int, int], lanes: int = 0) -> tuple[int, int]:
    """The register tile a kernel gets from the target's `tile`: a static width N below the tile's is
    covered by the largest power-of-two width <= N (>= 4) plus a remainder, not by one N-wide tile
    (N = 10: 8 + 2 columns; a 10-wide tile made odd vectors, 2.1x slower on AVX2), with 2/3 of the
    rows when there is a remainder. A static M between the tile's rows and twice that is cut into two
    row tiles (M = 8 on AVX2: 2 x 4 rows, not 6 + 2 rows one at a time, each of which read all of B
    again: batch-8 GEMV 46 -> 16 ms as search found, and two tiles take packed panels)."""
    roles = _tile_roles(ast)
    if roles is None or roles[1] is None:
        return tile
    n, m = _const(roles[2].src[0]), _const(roles[1].src[0])
    ti, tj = tile
    if m is not None and n is not None and 0 < m < ti and lanes and n >= tj:
        # a GEMV-like contraction (a classifier at batch 1): each column tile walks every row of B, one short
        # run per step; wider runs let the prefetcher stream B (benchmarks/cpu_tiles.py --tag gemv on the
        # 2-vCPU AVX2 EPYC, cpu_tiles-gemv.json: matmul(1, 1000, 2048) 0.43 ms in 16-column tiles, 0.33 in
        # 64, 0.25 in 128; resnet50's classifier in the model 1.14 -> 0.69 ms at 64)
        while m * 2 * tj // lanes <= GEMV_TILE_VECTORS and -(-n // (2 * tj)) >= GEMV_MIN_UNITS:
            tj *= 2
        return m, tj
    if m is not None and ti < m < 2 * ti and m // 2 >= 2:
        ti = m // 2
    if lanes >= LANE_REMAINDER and n is not None and tj <= n < 2 * tj and 0 < n % tj <= LANE_REMAINDER \
            and 4 * (n % tj) <= tj and tj % lanes == 0:
        # one column tile and a remainder vector that tile_with_lanes merges into it
        return min(ti, merged_rows((ti, tj), lanes, tj // lanes + 1)), tj
    if n is None or n >= tj or n < 4:
        return ti, tj
    if lanes and n >= MERGED_MIN_VECTORS * lanes and n % lanes <= LANE_REMAINDER:
        # whole lane vectors and at most one 4-lane vector (merged): N = 49 on AVX-512 as 48 + 4 columns in one
        # tile, not two overlapping 32-wide tiles (64 columns computed, the left operand read twice); as many
        # rows as `merged_rows` keeps in registers. resnet50's 7x7 layers on the 16-core AVX-512 Xeon
        # (benchmarks/onnx_models.py's light model, launches in order, both forms in one process, medians of 15
        # rounds): 3.32 against 4.08 ms in all. Their B rows (196 bytes apart) stay in place: packed panels of
        # one 52-column tile, a copy per worker for 32 rows each, took 5.0 ms
        w = n - n % lanes
        return min(ti, merged_rows((ti, tj), lanes, w // lanes + (1 if n % lanes else 0))), w
    w = 1 << (n.bit_length() - 1)
    if _tile_width(n, w)[1]:
        # the remainder joins the tile as one more vector per row (register_tile's `merged`): fewer
        # rows keep the accumulators and operands in registers (6 rows x 2 vectors spilled on AVX2)
        ti = max(1, ti * 2 // 3)
    return ti, w


def register_tile_applies(ast: UOp) -> bool:
    """Whether `register_tile` rewrites this kernel (one store over >= 2 GLOBAL ranges of a reduction)."""
    return _tile_roles(ast) is not None


def register_tile(ast: UOp, tile: tuple[int, int]) -> UOp:
    """`tile_with_lanes` with scalar lanes: the tiled AST."""
    return tile_with_lanes(ast, tile, 0)[0]


# ---- packing the right-hand operand's column panel (CPU) ---------------------------------------------

PACK_ROW_BYTES = 1024       # B rows a multiple of this apart put a column panel in few cache sets
PACK_FAR_BYTES = 8192       # B rows this far apart put each step of a panel on a page of its own (rows closer, not a
                            # multiple of PACK_ROW_BYTES apart, stay unpacked: the MLP's padded 1040-float rows of
                            # benchmarks/onnx_models.py replayed at 0.68-0.69x onnxruntime packed against 0.84-0.88x
                            # read in place on the 16-core Xeon)
PACK_MAX_BYTES = 64 << 20   # a thread's scratch (one K x tj panel) at most this big
PACK_MIN_K = 64
PACK_LINE_BYTES = 64        # B rows not a multiple of this apart split every tj-wide vector load over two cache lines
# rows split over lines alone: packed where a unit's partition has at least this many rows per worker thread. Every
# partition copies its panels, so the copies grow with the partitions and run against the cache bandwidth all the
# workers share, while the work a copy serves (the partition's rows) runs at each core's own speed. The 16-core
# AVX-512 Xeon's 14x14 layers (about 50 rows a unit) ran faster in place: resnet50 12.07 against 12.40 ms and
# densenet121 19.96 against 20.48 (benchmarks/onnx_models.py's light models, launches in order, both forms in one
# process, medians of 15 rounds); on two AVX2 threads packing won down to densenet121's 32-row units (its 14x14
# 3x3 layers 6.2 against 6.6 ms)
PACK_LINE_ROWS_PER_THREAD = 8
PACK_CAP = 32 << 20         # symbolic sizes: scratch elements per thread (virtual until used); K * tj above runs unpacked


def _pack_plan(ast: UOp, tile: tuple[int, int], lanes: int, threads: int = 0):
    """(load, reduce range, tile width) of the operand a tile's units copy into contiguous panels, else
    None: static sizes with column tiles of lane vectors (a remainder region or an overlapping last tile reads
    B in place; not a remainder merged into a single tile), one sum over a range of >= PACK_MIN_K steps (or a
    variable one), and in it one load that runs along the tile's columns (unit stride) and the reduction but
    not the rows (B[k, j] of A @ B), its rows a multiple of PACK_ROW_BYTES, at least PACK_FAR_BYTES, or not a
    multiple of PACK_LINE_BYTES apart. Rows a multiple of PACK_ROW_BYTES apart put a K x tj
    panel in a few cache sets, so L1 and L2 keep only a fraction of it (1024^3 float32 on AVX2: 23 GFLOP/s
    per core, 33-36 with a small or narrow B); rows PACK_FAR_BYTES apart put every step of the panel on a
    page of its own, which the hardware prefetcher does not cross (a 1x1 convolution 64 -> 256 at 56x56,
    rows 12.5 KB apart, as `matmul(256, 3136, 64)` on one thread of the 2-vCPU AVX2 EPYC: 1.84 ms packed
    against 2.31; resnet50 on the 16-core Xeon, benchmarks/onnx_models.py interleaved with onnxruntime,
    twice each: 0.58x and 0.59x packed against 0.56x and 0.49x). Rows not a multiple of a cache line apart (the
    pixels of a 14x14 or 7x7 convolution: 784 or 196 bytes) split every vector load of a panel over two lines
    (benchmarks/cpu_tiles.py, one thread of the 2-vCPU AVX2 EPYC, 6x16 tiles, packed against in place:
    512x49x2048 1.78 against 2.71 ms, 512x49x4608 6.6 against 11.3, 256x196x2304 4.1 against 5.9,
    512x196x1024 3.4 against 4.4). Line-aligned rows 784 floats apart (28x28) stay in place: packed they lost
    (256x784x512 3.9 against 3.1 ms, 128x784x1152 4.7 against 4.1). With the workers known (`threads`), rows
    split over lines alone are packed only where a unit's partition keeps PACK_LINE_ROWS_PER_THREAD rows per thread."""
    roles = _tile_roles(ast)
    if roles is None or roles[1] is None or lanes < 4:
        return None
    st, i, j = roles
    M, N = _const(i.src[0]), _const(j.src[0])
    if N is None:           # symbolic columns: tile_with_lanes guards a packed region by the scratch's size
        tj = tile[1]
        if tj % lanes:
            return None
    else:
        tj, rem = _tile_width(N, tile[1])
        if M is None or tj % lanes or (rem and N < 2 * tj):     # (the latter: the remainder merged into the tile)
            return None
    reds = [n for n in st.src[2].toposort() if n.op is Ops.REDUCE]
    if len(reds) != 1 or len(reds[0].src) != 2:
        return None
    k = reds[0].src[1]
    K = _const(k.src[0])
    if N is not None and K is not None and K < PACK_MIN_K:
        return None
    if N is not None and K is None and _panel_steps(k) * tj > PACK_CAP:
        return None     # a variable reduction packs only where its bound keeps a panel within PACK_CAP
    from .scan import x_coefficient
    lds = [n for n in reds[0].src[0].toposort() if n.op is Ops.LOAD and j in n.free_ranges and k in n.free_ranges]
    if len(lds) != 1 or i in lds[0].free_ranges or lds[0].dtype.storage_only:
        return None
    ld = lds[0]
    if x_coefficient(ld.src[1], j) != 1:
        return None
    if N is None:
        return ld, k, tj
    row_bytes = (x_coefficient(ld.src[1], k) or 0) * ld.dtype.itemsize
    if row_bytes % PACK_ROW_BYTES and row_bytes < PACK_FAR_BYTES and not row_bytes % PACK_LINE_BYTES:
        return None
    ti = max(1, min(tile[0], M))
    if (K is not None and K * tj * ld.dtype.itemsize > PACK_MAX_BYTES) or M // ti < 2:
        return None
    if threads > 0 and row_bytes % PACK_LINE_BYTES and row_bytes < PACK_FAR_BYTES:
        col_tiles = N // tj if rem else -(-N // tj)
        if M / _partitions(M // ti, col_tiles, threads) < PACK_LINE_ROWS_PER_THREAD * threads:
            return None
    return ld, k, tj


def _panel_steps(k: UOp) -> int:
    """The most steps of reduction range `k`: its static length, or the upper bound of the variable it runs to
    (anything else: unbounded)."""
    end = k.src[0]
    if _const(end) is not None:
        return _const(end)
    return end.arg[2] if end.op is Ops.DEFINE_VAR else 1 << 62


def pack_applies(ast: UOp, tile: tuple[int, int], lanes: int, threads: int = 0) -> bool:
    return _pack_plan(ast, tile, lanes, threads) is not None


# ops the lanes of a register tile may compute as vectors (the LLVM printer's lane path prints them all)
_LANE_SAFE = frozenset({Ops.LOAD, Ops.REDUCE, Ops.RANGE, Ops.CONST, Ops.PARAM, Ops.DEFINE_VAR, Ops.CAST, Ops.BITCAST,
                        Ops.WHERE, Ops.ADD, Ops.SUB, Ops.MUL, Ops.FDIV, Ops.IDIV, Ops.MOD, Ops.CDIV, Ops.CMOD, Ops.MAX, Ops.MIN,
                        Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE, Ops.AND, Ops.OR, Ops.XOR, Ops.SHL, Ops.SHR, Ops.NEG,
                        Ops.NOT, Ops.RECIP, Ops.EXP2, Ops.LOG2, Ops.SQRT, Ops.TRUNC})


def lanes_apply(ast: UOp) -> bool:
    """Whether a register-tiled kernel's columns can be computed as vectors (`tile_with_lanes`): what
    depends on the tile's column range j is made of ops the lane path prints, on no storage-only
    dtype (those are bytes decoded by bit operations, left to the scalar path)."""
    roles = _tile_roles(ast)
    if roles is None:
        return False
    st, _, j = roles
    for n in st.src[2].toposort():
        if j in n.free_ranges and (n.op not in _LANE_SAFE or (n.dtype is not None and n.dtype.storage_only)):
            return False
    return True


def _tile_substitute(memo: dict[tuple, UOp], root: UOp, i: UOp, j: UOp, row: UOp, col: UOp) -> UOp:
    """`substitute(root, {i: row, j: col})` for the stores of one register tile, sharing work between
    them: a node that depends on i alone is rebuilt once per row, one on j alone once per column, one on
    neither is kept (`memo`: one tile walk's; its keys hold ids of nodes, rows and columns, which it
    keeps alive). i and j are GLOBAL ranges, which no REDUCE closes: free_ranges tells which nodes hold them."""
    memo.setdefault(("alive",), []).append((root, row, col))  # type: ignore[attr-defined]  # keeps key ids unique
    # node -> (whether it holds i, whether it holds j), shared by the walks over the same (i, j)
    holds: dict[UOp, tuple[bool, bool]] = memo.setdefault(("holds", i, j), {})  # type: ignore[assignment]
    rid, cid = id(row), id(col)

    def key(n: UOp) -> tuple | None:
        h = holds.get(n)
        if h is None:
            fr = n.free_ranges
            h = holds[n] = (i in fr, j in fr)
        fi, fj = h
        return (id(n), rid if fi else 0, cid if fj else 0) if fi or fj else None

    top = key(root)
    if top is None:
        return root
    stack: list[tuple[UOp, tuple, bool]] = [(root, top, False)]
    while stack:
        n, k, done = stack.pop()
        if k in memo:
            continue
        if n is i or n is j:
            memo[k] = row if n is i else col
            continue
        if not done:
            stack.append((n, k, True))
            for s in reversed(n.src):
                sk = key(s)
                if sk is not None and sk not in memo:
                    stack.append((s, sk, False))
            continue
        src = []
        for s in n.src:
            sk = key(s)
            src.append(s if sk is None else memo[sk])
        memo[k] = UOp(n.op, n.dtype, tuple(src), n.arg)
    return memo[top]


def tile_with_lanes(ast: UOp, tile: tuple[int, int], lanes: int, pack: bool = False, threads: int = 0):
    """Register blocking (below) where `lanes` > 1 computes each run of `lanes` neighbouring columns of
    a tile as one vector: the column index is col0 + LANE with LANE a LOOP range of `lanes` that the
    lowering never opens as a loop but prints as vector lanes (strategies/tile_lanes.py). Returns the
    AST, {axis of a lane range: its width} and the packing scratch (slot, dtype, elements) or None.
    Widths that `lanes` does not divide use the largest power of two >= 4 that does, else scalar lanes.

    `pack` (where _pack_plan finds an operand): each thread-split unit first copies its column panel
    of that operand (K x tj, B[k, col0:col0+tj]) into a contiguous scratch (a hidden kernel parameter
    after the caller's buffers; the CPU runtime gives each thread's chunk of units its own, so a
    thread's units reuse one panel) and its tiles read the panel from there.

    Register blocking for reductions like matmul (CPU).

    A kernel of one store over GLOBAL ranges (i, j) whose index has j as a plain addend (unit stride)
    and whose value reduces is rewritten into ti x tj output tiles: ti*tj stores whose reductions the
    lowering fuses into one loop with ti*tj accumulators, and whose tj consecutive lanes LLVM turns
    into vector FMAs. The only GLOBAL range (the thread split) walks column tiles (cut into row
    partitions when there are few), so every output is computed in parallel, tails included.

    Leftovers need no serial tail loops. Rows past the partitions' full row tiles run as 1 x tj tiles
    in the same column tile, spread over its partitions. When N % tj != 0 the last column tile starts at N - tj and overlaps its
    neighbour: a few outputs are computed twice, by the same instructions, and written twice with
    the same value. A static N below tj becomes the tile width; a symbolic N gets three guarded
    regions, of which one runs: tj-wide tiles (N >= tj), w-wide tiles (w <= N < tj), single columns.
    """
    roles = _tile_roles(ast)
    if roles is None:
        return ast, {}, None
    plan = _pack_plan(ast, tile, lanes) if pack else None
    st, i, j = roles
    axes = _Axes(ast)
    lane_ranges: dict[int, UOp] = {}

    def columns(col0: UOp, width: int) -> list[UOp]:
        """The column index of each store of a `width`-wide run from col0: one per lane vector or column."""
        w = lanes if lanes > 1 else 1
        while w > 1 and (width % w or w > width):
            w //= 2
        if w < 4:
            return [col0 + b for b in range(width)]
        if w not in lane_ranges:
            lane_ranges[w] = axes.range(w)
        return [col0 + v * w + lane_ranges[w] for v in range(width // w)]
    if i is None:       # a column reduction: one row of outputs, a stand-in row range of one
        i = axes.range(1, AxisType.GLOBAL)
    M, N = i.src[0], j.src[0]
    ti, tj = tile
    m_static, n_static = _const(M), _const(N)
    if m_static is not None:
        ti = max(1, min(ti, m_static))
    rem = 0
    if n_static is not None:
        tj, rem = _tile_width(n_static, tj)

    # the tile walk: the outer (thread-split) range takes column tiles, each cut into P partitions of
    # its full row tiles when there are few column tiles (a narrow matrix still splits); an inner
    # loop walks a partition's row tiles, so a thread reuses one panel of the right-hand matrix.
    # Row indices stay affine in the loop variables: a clamped row (min(row, M-1)) or a flat walk of
    # all tiles (t % Ci, t // Ci) made LLVM's SLP vectorizer fall back to 4- or 8-wide vectors.
    full = M // ti
    Cj = N // tj if rem else _ceil_div(N, tj)
    # the store's other GLOBAL ranges (a batch of images, groups) join the thread split: static sizes, known
    # workers. Left as outer loops, a batch of 8 7x7 images kept 8 of 16 workers busy (the pointwise 320 ->
    # 1280 layer of benchmarks/cpu_conv.py on the 16-core Xeon: 0.35x onnxruntime)
    others = sorted((r for r in st.free_ranges if r.axis_type is AxisType.GLOBAL and r is not i and r is not j),
                    key=lambda r: r.axis)
    extents = [_const(r.src[0]) for r in others]
    E = None if None in extents else math.prod(extents)
    batched = bool(others) and E is not None and threads > 0 and n_static is not None and m_static is not None
    if _const(full) is not None and _const(Cj) is not None:
        P = UOp.const(_partitions(_const(full), _const(Cj), -(-threads // E) if batched else threads,
                                  packed=plan is not None and n_static is not None), dtypes.index)
    else:
        P = (UOp.const(SPLIT_UNITS, dtypes.index) // Cj.maximum(1)).minimum(full // 4).maximum(1)
    Q = full // P
    fused: dict[UOp, UOp] = {}
    if batched:
        u_all = axes.range(E * Cj * P, AxisType.GLOBAL)
        u, outer = u_all % (Cj * P), u_all // (Cj * P)
        for r in reversed(others):
            fused[r] = outer % r.src[0] if r is not others[0] else outer
            outer = outer // r.src[0]
    else:
        u = axes.range(Cj * P, AxisType.GLOBAL)
    jo, p = u // P, u % P
    packs: list[UOp] = []
    scratch_info = None
    unpacked = st
    if plan is not None and n_static is not None:
        ld, k, _ = plan
        K = k.src[0]
        slot = 1 + max(n.arg for n in ast.toposort() if n.op is Ops.PARAM)
        scratch = UOp.param(slot, ld.dtype)
        kp = axes.range(K)
        c0 = jo * tj if n_static % tj == 0 or rem else (jo * tj).minimum(N - tj)
        packs = [scratch.store(kp * tj + off, substitute(ld, {k: kp, j: c0 + off}))
                 for off in columns(UOp.const(0, dtypes.index), tj)]
        st = substitute(st, {ld: scratch.load(k * tj + (j - c0))})
        # a variable reduction (one program for layers that differ in it): a scratch for its bound (_pack_plan
        # keeps that within PACK_CAP; virtual until used), which the launch check holds K to
        scratch_info = (slot, ld.dtype, _panel_steps(k) * tj)
    io = axes.range(Q)
    tile_rows = [(io + p * Q) * ti + a for a in range(ti)]
    # rows past the partitions' tiles. Static sizes: each partition's share as one tile (left = (full % P)
    # * ti + M % ti < P * ti, so a share is at most ti rows). One at a time with two accumulators, 1024 rows
    # on AVX2's 6-row tile left 4 rows that took 3% of the 1024^3 time (7.7x a tiled row's cost). Symbolic:
    # one row at a time, dealt round-robin to the partitions. Rows past M - 1 clamp to it (computed twice,
    # the same value).
    first = P * Q * ti
    left = M - first
    Lc, Pc = _const(left), _const(P)
    if Lc is not None and Pc is not None:
        h = -(-Lc // Pc)                        # rows per partition, <= ti
        ir = axes.range(1 if h else 0)          # a loop of one: the tile's sums fuse like a row tile's
        tail_rows = [first + p * h + ir + a for a in range(h)]
        if _const(first) + Pc * h > _const(M):
            tail_rows = [r.minimum(M - 1) for r in tail_rows]
    else:
        ir = axes.range((left + P - 1) // P)
        tail_rows = [(first + ir * P + p).minimum(M - 1)]

    # a narrow static matrix (one column tile) with a remainder: the remainder's 4-lane vector ending at
    # N joins the tile, so each row's element of the left matrix is loaded once for all N columns
    merged = bool(rem) and lanes >= LANE_REMAINDER and _const(Cj) == 1 and n_static >= LANE_REMAINDER
    # the remainder (up to tj/4 columns: 1-4 on AVX2's 16, 1-8 on AVX-512's 32) as 4 or 8 lanes ending at N,
    # overlapping the tile where it is narrower (those outputs written twice, the same value). It was
    # always 4 lanes: AVX-512's 5-8 column remainders (N = 37) left columns unwritten (tests/test_cpu.py on an AVX-512 Xeon)
    ew = LANE_REMAINDER * -(-rem // LANE_REMAINDER) if merged else 0
    # (+ jo, 0 here, keeps the thread-split range in every store of the tile, so the stores group and their sums
    # fuse into one loop even where a single row partition leaves the rows without it: without, one worker
    # thread ran a K loop per row and vector, tests/test_cpu.py's merged-remainder test)
    extra = columns(N - ew + jo, ew) if merged else []

    shared: dict[tuple, UOp] = {}      # the tile's stores share what depends on one of (row, column)

    def tile_stores(col0: UOp, width: int, store: UOp | None = None) -> list[UOp]:
        s_ = st if store is None else store
        cols = columns(col0, width) + extra
        main = [_tile_substitute(shared, s_, i, j, tile_rows[a], c) for a in range(ti) for c in cols]
        if _const(left) == 0:
            return main
        return main + [_tile_substitute(shared, s_, i, j, r, c) for r in tail_rows for c in cols]

    out: list[UOp] = []
    if n_static is not None:
        # the last column tile overlaps its neighbour when N % tj != 0 (and no remainder region)
        col0 = jo * tj if n_static % tj == 0 or rem else (jo * tj).minimum(N - tj)
        out += tile_stores(col0, tj)
        if rem and not merged:
            # with lanes, the last `rem` columns are one vector ending at N, of the fewest lanes (4, 8, ...,
            # up to the target's) that hold them: it overlaps its neighbour (those outputs are written twice,
            # the same value) instead of scalar columns (AVX-512's remainders of 5-7 and 9-15 columns of a
            # 64-wide tile were 6 rows of that many scalar accumulators)
            width = rem
            if lanes >= LANE_REMAINDER:
                width = next((w for w in _lane_widths(lanes) if w >= rem), rem)
                if width > n_static:
                    width = rem
            rest = unpacked
            if plan is not None:
                # the remainder's columns packed after the panel (each chunk of units packs them once, before its
                # loop: lower.py's scratch stores). Read in place, every step of a remainder row tile loaded a line
                # of its own: matmul(512, 49, 4608), a 7x7 layer's 3x3 contraction, took 6.8 ms on one thread of
                # the 2-vCPU AVX2 EPYC against 3.5 ms packed (2.27 against 1.79 on two), and resnet50's launches
                # (benchmarks/onnx_models.py's light model, in order in one process) 76 against 67.5 ms
                ld, k, _ = plan
                K, r0 = k.src[0], N - width
                packs += [scratch.store(K * tj + kp * width + off, substitute(ld, {k: kp, j: r0 + off}))
                          for off in columns(UOp.const(0, dtypes.index), width)]
                rest = substitute(unpacked, {ld: scratch.load(K * tj + k * width + (j - r0))})
                scratch_info = (slot, ld.dtype, _panel_steps(k) * (tj + width))
            out += _remainder_columns(rest, i, j, axes, u, Cj * P, ti, full, M, N - width, width, columns)
    else:
        # N >= tj: tj-wide tiles, the last one overlapping its neighbour
        col_base = (jo * tj).minimum(N - tj)
        if plan is not None:
            # packed panels where a thread's scratch holds one (K * tj <= PACK_CAP: one of the two loops
            # below runs once); past that, rows one at a time dealt to the column tile's partitions
            # (correct, compact IR; only K * tj > PACK_CAP, K > 2M steps, runs it)
            ld, k, _ = plan
            K = k.src[0]
            fits = ((PACK_CAP // tj) // K.maximum(1)).minimum(1)
            gp = axes.range(fits * _at_least(N, tj))
            slot = 1 + max(n.arg for n in ast.toposort() if n.op is Ops.PARAM)
            scratch = UOp.param(slot, ld.dtype)
            kp = axes.range(K)
            packs = [scratch.store(kp * tj + off, substitute(ld, {k: kp, j: col_base + gp + off}))
                     for off in columns(UOp.const(0, dtypes.index), tj)]
            packed = substitute(st, {ld: scratch.load(k * tj + (j - col_base))})
            out += tile_stores(col_base + gp, tj, packed)
            scratch_info = (slot, ld.dtype, PACK_CAP)
            g = axes.range((1 - fits) * _at_least(N, tj))
            r = axes.range((M + P - 1) // P)
            row = (r * P + p).minimum(M - 1)        # the partitions deal the rows (the last clamps)
            out += [substitute(st, {i: row, j: c}) for c in columns(col_base + g, tj)]
        else:
            g = axes.range(_at_least(N, tj))
            out += tile_stores(col_base + g, tj)
        # w <= N < tj (then Cj == 1): w-wide tiles along the row
        w = max(1, tj // 4)
        if 1 < w < tj:
            jn = axes.range(_ceil_div(N, w) * _at_least(N, w) * _below(N, tj))
            out += tile_stores((jn * w).minimum(N - w) + jo, w)      # jo == 0 here
        else:
            w = tj
        # N < w: one column at a time
        jc = axes.range(N * _below(N, w))
        out += tile_stores(jc + jo, 1)
    sink = UOp.sink(*packs, *out)
    if fused:
        sink = substitute(sink, fused)
    return sink, {r.axis: w for w, r in lane_ranges.items()}, scratch_info


def _lane_widths(lanes: int) -> list[int]:
    """The vector widths a remainder may take: LANE_REMAINDER, doubling, up to `lanes`."""
    out, w = [], LANE_REMAINDER
    while w <= lanes:
        out.append(w)
        w *= 2
    return out


def _tile_width(n: int, tj: int) -> tuple[int, int]:
    """(tile width, remainder columns) for a static N. Below tj the tile is N wide. A remainder of at
    most tj/4 columns gets a region of its own (narrow vectors, but no wasted columns); a larger one
    is covered by an overlapping last tile, tj or tj/2 wide, whichever computes fewer columns
    (a half-width tile counted 10% slower per column)."""
    if n < tj:
        return max(1, n), 0
    r = n % tj
    if r == 0 or 4 * r <= tj:
        return tj, r
    half = tj // 2
    cost = lambda w: -(-n // w) * w * (1.0 if w == tj else 1.1)   # noqa: E731
    return (half if half >= 8 and cost(half) < cost(tj) else tj), 0


def _remainder_columns(st: UOp, i: UOp, j: UOp, axes: _Axes, u: UOp, units: UOp, ti: int, full: UOp,
                       M: UOp, col0: UOp, width: int, columns) -> list[UOp]:
    """The last `width` columns (static sizes): their row tiles, then their leftover rows one at a
    time, dealt round-robin to the `units` outer iterations; the last round clamps (a few rows
    computed twice)."""
    U, F = _const(units), _const(full)
    k = axes.range(-(-F // U))
    tile = u + k * U
    if F % U:
        tile = tile.minimum(F - 1)
    cols = columns(col0, width)
    out = [substitute(st, {i: tile * ti + a, j: c}) for a in range(ti) for c in cols]
    left = _const(M) - F * ti
    if left:
        r = axes.range(-(-left // U))
        row = F * ti + r * U + u
        if left % U:
            row = row.minimum(M - 1)
        out += [substitute(st, {i: row, j: c}) for c in cols]
    return out


def _partitions(full: int | None, col_tiles: int | None, threads: int = 0, packed: bool = True) -> int:
    """Row partitions per column tile: a divisor of the full row tiles (so that no row is clamped)
    that brings the outer range near SPLIT_UNITS, keeping at least 4 row tiles per partition; with the
    workers known, a narrow matrix's count balances them (_narrow_partitions; `packed`: each partition
    copies its column panel first), and so does a wide matrix's (_balanced_partitions)."""
    if full is None or col_tiles is None or full < 2:
        return 1
    want = max(1, SPLIT_UNITS // max(col_tiles, 1))
    if threads > 0 and want > 3:
        return _narrow_partitions(full, col_tiles, threads, PACK_SHARE if packed else UNPACKED_SHARE)
    best = max(d for d in range(1, min(want, full) + 1) if full % d == 0 and (full // d >= 4 or d == 1))
    if 2 * best < want and full // 4 > best:
        # too few divisors (51 row tiles of the AVX-512 256x512x10 matmul: 3 partitions, 3 of 12 threads
        # busy): as many partitions of >= 4 tiles as wanted, their leftover rows dealt round-robin (clamped)
        return min(want, full // 4)
    if want <= 3:
        return _balanced_partitions(full, col_tiles, best, threads)
    return best


def _narrow_partitions(full: int, col_tiles: int, threads: int, share: float) -> int:
    """Row partitions of a narrow matrix (few column tiles) for `threads` workers: the count whose busiest
    worker does the least, its units (the runtime cuts the outer range into `threads` contiguous chunks)
    times each unit's row tiles (leftover rows dealt round-robin) and its `share` of fixed work (a packed
    panel's copy PACK_SHARE, else UNPACKED_SHARE), the fewest partitions among equals. Aiming at SPLIT_UNITS
    units instead left a round barely started: resnet50's 7x7 layers (512 rows, 49 pixels) took 34 units, 3
    for the busiest of 16 workers where 2.1 is even, and the 14x14 ones 30 (2 per worker, 15 partitions' panels
    copied twice). On the 2-vCPU EPYC those contractions ran 5-15% faster with the fewer, larger units too (conv_gemm alone, best of 60 launches)."""
    def cost(P: int) -> float:
        units = col_tiles * P
        return -(-units // min(threads, units)) * (-(-full // P) + share)
    return min(range(1, full + 1), key=lambda P: (cost(P), P))


# thread counts a split should divide well (CPU workers: MOROK_CPU_THREADS or the cores)
BALANCE_THREADS = (2, 3, 4, 6, 8, 12, 16)
WIDE_PARTITION_ROWS = 24    # row tiles a partition keeps at least when a wide matrix is cut (each partition
                            # repacks its column panel)
PACK_SHARE = 2.0            # a partition's panel copy, in row tiles of work: the cost factor 1 + PACK_SHARE / tiles
                            # (AVX2, 2 threads, 1024^3: 5 partitions of 34 row tiles ran 3-10% slower than one)
UNPACKED_SHARE = 0.5        # a narrow matrix's partition that reads B in place: its panel, pulled into the core's
                            # caches again, in row tiles of work. Counted as a copy (PACK_SHARE), resnet50's 128-row
                            # contractions at 28x28 (12 column tiles of 6x64) took 12 units for 16 workers, now 48:
                            # benchmarks/cpu_tiles.py --tag partitions on the 16-core Xeon (cpu_tiles-partitions.json,
                            # against UNPACKED_SHARE = 2.0 in the same rounds) 128x784x1152 0.261 against 0.413 ms
                            # (best rounds 0.218 / 0.253), 128x784x512 0.106 against 0.117; its shapes whose kernels
                            # are the same either way read 0.150 / 0.114, 0.132 / 0.123 and 0.287 / 0.258 (the noise)


def split_balance(units: int, threads: int = 0) -> float:
    """The busiest of `threads` workers' share of `units` against an even share (1.0: an even split); for
    an unknown count (0) the worst over BALANCE_THREADS."""
    return max(-(-units // t) * t / units for t in ((threads,) if threads > 0 else BALANCE_THREADS))


def _balanced_partitions(full: int, col_tiles: int, first: int, threads: int = 0) -> int:
    """Row partitions of a matrix with SPLIT_UNITS / 3 or more column tiles: of `first` (the divisor rule's)
    and the divisors P <= 6 of the full row tiles that leave WIDE_PARTITION_ROWS row tiles each, the one
    whose col_tiles x P units divide best among `threads` workers (the target's Capabilities.threads),
    each partition's panel copy counted (PACK_SHARE). The 1024^3 matmul's 16 AVX-512 column tiles (6x64)
    in 2 partitions leave the busiest of 12 threads 3 units where the average is 2.67 (1.125); 5 make 80
    units, 7 against 6.67. Two threads split 64 AVX2 column tiles evenly: one partition."""
    cost = lambda P: split_balance(col_tiles * P, threads) * (1 + PACK_SHARE / (full // P))  # noqa: E731
    cands = {first} | {P for P in range(2, 7) if full % P == 0 and full // P >= WIDE_PARTITION_ROWS}
    return min(sorted(cands), key=lambda P: cost(P) - 1e-9 * (P == first))


# ---- CPU column reductions that stream rows ------------------------------------------------------

STREAM_BLOCK = 1024     # columns of the output a thread accumulates while streaming the rows


def stream_applies(ast: UOp) -> bool:
    """One store over one GLOBAL range j of `REDUCE_r f(r, j)` itself (no cast or epilogue: the output
    holds the running value), f read along columns (a sum over axis 0), the output not read."""
    stores = list(ast.src)
    if len(stores) != 1:
        return False
    st = stores[0]
    buf, idx, val = st.src
    free = st.free_ranges
    if len(free) != 1 or next(iter(free)).axis_type is not AxisType.GLOBAL:
        return False
    j = next(iter(free))
    if val.op is not Ops.REDUCE or len(val.src) != 2 or val.arg not in (Ops.ADD, Ops.MAX, Ops.MIN):
        return False
    if val.dtype != buf.dtype or val.src[1].src[0].free_ranges:
        return False
    if any(n.op is Ops.LOAD and n.src[0].arg == buf.arg for n in ast.toposort()):
        return False
    from .scan import x_coefficient
    return x_coefficient(idx, j) == 1 and is_column_reduction(ast, (j,))


def stream_columns(ast: UOp, block: int) -> UOp:
    """out[j] = REDUCE_r f(r, j) as numpy sums over axis 0: the thread split takes blocks of `block`
    columns; a block's outputs start at the reduction's identity and each row r, in order, is added
    (maxed, mined) into them: contiguous loads of `block` columns per row, vectorized along j, instead
    of a column walk whose every step lands on another page. Columns past the last full block (fewer
    than `block`) are streamed the same way once, in the first worker."""
    from .scan import reduce_identity
    st = ast.src[0]
    buf, idx, val = st.src
    j = next(iter(st.free_ranges))
    r = val.src[1]
    N = j.src[0]
    axes = _Axes(ast)
    jb = axes.range(N // block, AxisType.GLOBAL)
    rr = axes.range(r.src[0])            # rows: LOOP, outside the columns (a smaller axis)
    jj = axes.range(block)
    col = jb * block + jj
    at = substitute(idx, {j: col})
    ident = UOp.const(reduce_identity(val.dtype, val.arg), val.dtype)
    step = substitute(val.src[0], {j: col, r: rr})
    running = buf.load(at)
    new = running + step if val.arg is Ops.ADD else running.maximum(step) if val.arg is Ops.MAX else running.minimum(step)
    # the last N % block columns the same way, run once (no GLOBAL range: the first worker)
    rt, jt = axes.range(r.src[0]), axes.range(N % block)
    tcol = (N // block) * block + jt
    t_at = substitute(idx, {j: tcol})
    t_step = substitute(val.src[0], {j: tcol, r: rt})
    t_run = buf.load(t_at)
    t_new = (t_run + t_step if val.arg is Ops.ADD else t_run.maximum(t_step) if val.arg is Ops.MAX
             else t_run.minimum(t_step))
    return UOp.sink(buf.store(at, ident), buf.store(at, new), buf.store(t_at, ident), buf.store(t_at, t_new))

