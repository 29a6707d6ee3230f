"""Small and skinny GPU shapes: the schedules of kernels whose usual tiles or row groups would leave most of
the GPU's SMs idle (benchmarks/decode.py). Three named choices, each a plain Schedule the search can time:

- decode tiles: a contraction of at most DECODE_ROWS constant rows (a decoding step: 32 rows against a 4096 x
  4096 weight matrix) takes a skinny block, as few rows as the kernel has and DECODE_COLS columns, so the
  weight matrix is streamed by about one block per SM with a deep k step in flight; 16-bit operands on the
  warp-level tensor cores (strategies/tensor_core.py), float32 on the CUDA-core tiles (gpu_tile.py).
- split k: a float32 decode tile whose blocks number fewer than FEW_BLOCKS runs each output tile on
  DECODE_SPLIT_K work-groups over a part of K each (Schedule.split_k), the last summing the parts; such a tile
  of at most 32 rows is DECODE_SPLIT_COLS wide.
- few-block tiles: a float32 contraction whose 128 x 128 blocks would number fewer than FEW_BLOCKS (a constant
  1000^3, or symbolic sizes bounded by 1024) takes blocks of half the rows (or half the rows and columns); a
  symbolic extent counts at its variable's upper bound.
- few columns: a float32 contraction over at most FEW_COLUMNS constant columns takes 128 x 64 blocks (half the
  columns; CUDA targets, where it was timed): a convolution's 64 or 128 output channels (benchmarks/conv.py,
  batch 32, H100, benchmarks/results/nvidia-h100/conv-nvrtc.json, the flat columns' contraction: 3x3 64 channels
  at 56x56 22.9 against 16.9 TFLOP/s for 128 x 128, 128 at 28x28 29.2 against 26.3, stride 2 at 56x56 27.5
  against 25.2).
- split rows: a reduction over fewer constant rows than FEW_BLOCKS, nothing but its stores after the reductions
  (8 rows of 128k columns summed), runs each row on several work-groups (Schedule.row_split,
  strategies/grid_reduce.py), about ROW_SPLIT_GROUPS in all.
- wide rows: the few-rows and split-row kernels load their 32-bit rows as WIDE_ROWS-wide vectors (16 bytes per
  load, as the 16-bit rows already are: strategies/group_reduce.py), where the row's start is aligned.
- few rows: a row kernel with fewer rows than FEW_BLOCKS whose rows are long takes full-size work-groups
  (FEW_ROWS_GROUP items), the most loads in flight each of its few SMs can hold.
"""
from __future__ import annotations

from ...ir import Ops, UOp
from ..capabilities import Capabilities
from ..scan import KernelScan
from ..symbolic import static_intervals

DECODE_ROWS = 64        # a contraction of at most this many constant rows is a decoding step
DECODE_MIN_ROWS = 16    # ... and at least this many (fewer: a GEMV, strategies/split_reduce.py's split)
DECODE_COLS = 32        # columns of a decode block: 4096 / 32 = 128 blocks, about one per SM of an H100 (132)
DECODE_BK = 128         # k depth of a 16-bit decode tile: 4 cp.async stages of (32 + 32) x 128 halves in flight
DECODE_CORE_BK = 128    # k depth of the deep float32 decode tiles a search may time where tiles are filled by cp.async
                        # (async_fill; 72 KiB double-buffered, gpu_tile.ASYNC_SMEM_LIMIT): 16 KiB of the weight matrix
                        # in flight per block, twice the 64-deep tile's. Not the default: on an H100 (32x4096x4096,
                        # benchmarks/decode.py --variants) 32x32x128 ran 92.6-95.4 us against 88 us 64 deep, so the
                        # 64-deep tile is not bound by the weight bytes in flight
DECODE_SPLIT_K = 4      # float32 decode tiles: each output tile on this many work-groups over a quarter of K each
                        # (Schedule.split_k): 512 groups, 4 per SM of an H100, where the 128 unsplit ones (one per
                        # SM, 4 warps) read the weight matrix at 0.76-0.79 TB/s (88 us for 32x4096x4096 whether 32,
                        # 64 or 128 deep: benchmarks/decode.py --variants), bound by one tile's latency per k step.
                        # Split in 4 on an H100: 66.8 us nvrtc, 68.1 us llvm-nvptx (0.89x / 0.87x torch's 59 us);
                        # 2 parts 66.1 and 8 parts 69.3 against 67.3 for 4 in one --variants run, unsplit 84.6
                        # (benchmarks/results/nvidia-h100/decode-*.json, tests/results/nvidia-h100/bench-decode-*.log)
DECODE_SPLIT_COLS = 64  # ... and such a tile of at most 32 rows takes this many columns, 4 x 4 outputs per work-item
                        # (half the A tile copies per weight column, 16 FMAs per two 16-byte shared reads): on an
                        # H200 (32x4096x4096 float32, tiles timed side by side beside torch; the script in git at
                        # commit 3d551ba) 52.8 us nvrtc and 53.2 us llvm-nvptx (1.09x / 1.11x torch's
                        # 57-59 us in the same run) against 66.9 / 68.6 us for 32 columns split in 4 (0.86x);
                        # 32x128 (4 x 8 outputs) in 8 parts ran 50.7 / 53.4 us, 32x64 in 8 parts 55.2 / 59.0 us,
                        # in 16 parts 65.8 / 71.4 us
DECODE_SPLITS = (2, 4, 8)   # the parts counts a search times
DECODE_WIDE_SPLIT = 8   # a search candidate: decode tiles of 2 x DECODE_COLS columns, 4 x 4 outputs per work-item, K in
                        # this many parts (512 groups for 32x4096x4096, as the default's): each group reads the 32 rows
                        # of A once per 64 columns instead of per 32 (half the A tile copies, 64 MiB -> 32 MiB from L2),
                        # two 16-byte shared reads per 16 FMAs. Not yet timed
FEW_BLOCKS = 132        # an H100's SMs: fewer blocks than this leave SMs idle
FEW_COLUMNS = 128       # a float32 contraction over at most this many constant columns: 128 x 64 blocks
FEW_ROWS_GROUP = 1024   # work-items per row of a row kernel with few long rows
FEW_ROWS_MIN = 16384    # ... "long": at least this many elements per row
ROW_SPLIT_GROUPS = 512  # split rows: about this many work-groups in all (4 per SM of an H100)
ROW_SPLIT_ITEMS = 4     # ... each work-item reducing at least this many elements
ROW_SPLITS = (8, 16, 32, 64, 128)   # the parts per row a search times
WIDE_ROWS = 4           # 32-bit row loads of few-rows kernels: 4-wide (16 bytes)


def _upper(ext: UOp) -> int | None:
    """The largest value of an extent: a constant's, or a symbolic one's from its variables' bounds."""
    if ext.op is Ops.CONST:
        return int(ext.arg)
    try:
        hi = static_intervals(ext)[id(ext)][1]
    except Exception:       # noqa: BLE001 -- an expression the interval analysis does not take
        return None
    return int(hi) if isinstance(hi, int) else None


def _pow2_at_least(x: int, lo: int) -> int:
    p = lo
    while p < x:
        p *= 2
    return p


def contraction_rows(ast: UOp, caps: Capabilities, scan: KernelScan | None) -> tuple[int, int] | None:
    """(M, N) of a contraction with constant DECODE_MIN_ROWS <= M <= DECODE_ROWS and constant N of at least
    4 x DECODE_COLS, else None."""
    from ..gpu_tile import _plan
    plan = _plan(ast, caps, scan, (16, 16, 16, 1, 1))
    if plan is None:
        return None
    M, N = plan.i.src[0], plan.j.src[0]
    if M.op is not Ops.CONST or N.op is not Ops.CONST or not DECODE_MIN_ROWS <= M.arg <= DECODE_ROWS or N.arg < 4 * DECODE_COLS:
        return None
    return int(M.arg), int(N.arg)


def decode_tc_tiles(M: int) -> list[tuple[int, int, int, int, int]]:
    """Tensor-core decode tiles (BM, BN, BK, WM, WN) for M rows, the default first: BM the rows rounded up
    to the 16-row fragment, warps of 16 x 16 outputs."""
    BM = _pow2_at_least(M, 16)
    out = []
    for BN, BK in ((DECODE_COLS, DECODE_BK), (DECODE_COLS, 64), (16, DECODE_BK), (64, 64), (DECODE_COLS, 256)):
        WM = 16 if BM <= 32 else 32
        out.append((BM, BN, BK, WM, 16))
    return out


def decode_tc(ast: UOp, caps: Capabilities, scan: KernelScan | None, every: bool = False):
    """The decode tile of a 16-bit contraction on warp-level tensor cores: (mma, tile, stages, swizzle), or
    None. `every`: all that the kernel takes, as a list."""
    from .tensor_core import MMA_M16N8K16, tc_pipeline, tc_plan
    if not caps.tensor_cores or caps.tensor_cores[0] != MMA_M16N8K16 or not caps.has_shared:
        return [] if every else None
    rows = contraction_rows(ast, caps, scan)
    if rows is None:
        return [] if every else None
    out = []
    for tile in decode_tc_tiles(rows[0]):
        stages, swizzle = tc_pipeline(caps, tile, ast, scan)
        if tc_plan(ast, caps, scan, tile, stages, swizzle) is not None:
            out.append((MMA_M16N8K16, tile, stages, swizzle))
            if not every:
                return out[0]
    return out if every else None


def decode_core_tiles(M: int, deep: bool = False) -> list[tuple[int, int, int, int, int]]:
    """CUDA-core decode tiles (BM, BN, BK, TM, TN), the default first: 8 work-items along the rows, each
    BM / 8 x 2 outputs (4 warps a block), 64 deep; `deep` (tiles filled by cp.async, which may take the dynamic
    shared memory) adds DECODE_CORE_BK-deep candidates. On an H200 (benchmarks/decode.py, 32 x 4096 x 4096 float32)
    the 64-deep tile ran 84-86 us, as 2 x 2 outputs per item 64 deep (84-85 us), against 90-92 us 32 deep and
    252-398 us with the 128 x 128 blocks: all short of torch's 57-69 us (shared reads are not what bounds them)."""
    BM = _pow2_at_least(M, 8)
    TM = max(1, BM // 8)
    half = max(1, TM // 2)
    deeper = [(BM, DECODE_COLS, DECODE_CORE_BK, TM, 2), (BM, DECODE_COLS, DECODE_CORE_BK, half, 2)] if deep else []
    return [(BM, DECODE_COLS, 64, TM, 2), (BM, DECODE_COLS, 64, half, 2)] + deeper + [
        (BM, DECODE_COLS, 32, TM, 2), (BM, DECODE_COLS, 64, TM, 4), (BM, DECODE_COLS, 32, half, 2), (BM, 16, 64, TM, 2)]


def decode_core(ast: UOp, caps: Capabilities, scan: KernelScan | None, every: bool = False):
    """The CUDA-core decode tile of a contraction (float32), or None (`every`: all it takes)."""
    from ..gpu_tile import plan_tile
    if caps.matmul_tile is None or not caps.has_shared:
        return [] if every else None
    rows = contraction_rows(ast, caps, scan)
    if rows is None:
        return [] if every else None
    # the deep tiles need the cp.async fill, which the default schedule gives float accumulators
    deep = caps.async_copy and all(u.dtype.is_float for u in ast.toposort() if u.op is Ops.REDUCE)
    out = [t for t in decode_core_tiles(rows[0], deep) if plan_tile(ast, caps, scan, t) == t]
    if every:
        return out
    if not out:
        return None
    return _split_wide_tile(ast, caps, scan, rows, out[0]) or out[0]


def _split_wide_tile(ast: UOp, caps: Capabilities, scan: KernelScan | None, rows: tuple[int, int],
                     tile: tuple[int, int, int, int, int]) -> "tuple[int, int, int, int, int] | None":
    """`tile` (BM <= 32) with DECODE_SPLIT_COLS columns and 4 outputs per work-item along them, where the kernel
    takes it and splits it in DECODE_SPLIT_K parts, where `tile` has fewer blocks than FEW_BLOCKS; else None."""
    from ..gpu_tile import plan_tile, split_k_applies
    BM, BN, BK, TM, _ = tile
    wide = (BM, DECODE_SPLIT_COLS, BK, TM, 4)
    if BM > 32 or -(-rows[0] // BM) * -(-rows[1] // BN) >= FEW_BLOCKS:      # `tile` itself would not be split
        return None
    if plan_tile(ast, caps, scan, wide) != wide or not split_k_applies(ast, caps, scan, wide, DECODE_SPLIT_K):
        return None
    return wide


def decode_wide_split(ast: UOp, caps: Capabilities, scan: KernelScan | None) -> list[tuple[tuple[int, int, int, int, int], int]]:
    """(tile, parts) of the wide split-k decode candidate (DECODE_WIDE_SPLIT) where the kernel takes it: a float32
    decode tile that the default splits (decode_split_k), its columns doubled; else []."""
    from ..gpu_tile import plan_tile, split_k_applies
    tile = decode_core(ast, caps, scan)
    if tile is None or not decode_split_k(ast, caps, scan, tile):
        return []
    wide = (tile[0], 2 * DECODE_COLS, tile[2], tile[3], 4)
    if plan_tile(ast, caps, scan, wide) != wide or not split_k_applies(ast, caps, scan, wide, DECODE_WIDE_SPLIT):
        return []
    return [(wide, DECODE_WIDE_SPLIT)]


def decode_split_k(ast: UOp, caps: Capabilities, scan: KernelScan | None, tile: tuple[int, int, int, int, int]) -> int:
    """DECODE_SPLIT_K for a float32 decode tile (decode_core's default) the kernel can split (constant sizes, K a
    multiple of the parts x BK: gpu_tile.split_k_applies), with fewer blocks than FEW_BLOCKS unsplit; else 0."""
    from ..gpu_tile import split_k_applies
    if decode_core(ast, caps, scan) != tile:
        return 0
    rows = contraction_rows(ast, caps, scan)
    if rows is None or -(-rows[0] // tile[0]) * -(-rows[1] // tile[1]) >= FEW_BLOCKS:
        return 0
    return DECODE_SPLIT_K if split_k_applies(ast, caps, scan, tile, DECODE_SPLIT_K) else 0


def few_block_tile(ast: UOp, caps: Capabilities, scan: KernelScan | None,
                   tile: tuple[int, int, int, int, int]) -> tuple[int, int, int, int, int]:
    """`tile` with half the columns over at most FEW_COLUMNS constant columns; else with fewer rows when its
    blocks over the contraction's largest extents would number fewer than
    FEW_BLOCKS: BM halved (TM too) where that gives at least 3/4 of FEW_BLOCKS blocks, else BM and BN halved
    where that gives at least 16 (symbolic extents count at their variables' bounds; unbounded ones keep
    `tile`). On an H200, float32 1000^3 with sizes bounded by 1024 (benchmarks/decode.py): 128 x 128 blocks
    106 us, 64 x 64 75 us, 64 x 128 66-67 us (128 x 64: 67-70 us)."""
    from ..gpu_tile import _cuda_like, _plan
    BM, BN, BK, TM, TN = tile
    if BM < 128 or BN < 128 or TM % 2 or TN % 2:     # the full-size tile only (gpu_tile halves it below 16 blocks)
        return tile
    plan = _plan(ast, caps, scan, tile)
    if plan is None:
        return tile
    cols = plan.j.src[0]
    if cols.op is Ops.CONST and cols.arg <= FEW_COLUMNS and _cuda_like(caps):   # few columns: half-width blocks
        narrow = (BM, BN // 2, BK, TM, TN // 2)
        got = _plan(ast, caps, scan, narrow)
        if got is not None and got.tile == narrow:
            return narrow
    M, N = _upper(plan.i.src[0]), _upper(plan.j.src[0])
    if M is None or N is None or M >= 1 << 20 or N >= 1 << 20:
        return tile
    if -(-M // BM) * -(-N // BN) >= FEW_BLOCKS:
        return tile
    for smaller, least in (((BM // 2, BN, BK, TM // 2, TN), 3 * FEW_BLOCKS // 4),
                           ((BM // 2, BN // 2, BK, TM // 2, TN // 2), 16)):
        if -(-M // smaller[0]) * -(-N // smaller[1]) >= least:
            got = _plan(ast, caps, scan, smaller)
            if got is not None and got.tile == smaller:
                return smaller
    return tile


def few_rows_group(ast: UOp, globals_, caps: Capabilities) -> int:
    """FEW_ROWS_GROUP for a row kernel (one GLOBAL range) with a constant count of rows below FEW_BLOCKS whose
    reduced rows have at least FEW_ROWS_MIN elements (constant, or bounded below by it); else 0."""
    from ..scan import top_reduces
    if len(globals_) != 1 or FEW_ROWS_GROUP > min(caps.max_threads_per_group, caps.local_max[0]):
        return 0
    rows = globals_[0].src[0]
    if rows.op is not Ops.CONST or rows.arg >= FEW_BLOCKS:
        return 0
    reds = top_reduces(list(ast.src))
    if not reds:
        return 0
    for red in reds:
        n = 1
        for r in red.src[1:]:
            ext = r.src[0]
            if ext.op is not Ops.CONST:
                return 0
            n *= ext.arg
        if n < FEW_ROWS_MIN:
            return 0
    return FEW_ROWS_GROUP


def row_split_default(ast: UOp, globals_, caps: Capabilities, group: int) -> int:
    """Schedule.row_split of a reduction over few long rows (few_rows_group's kernels) that the split-row grid
    reduction takes: the power of two P with rows x P nearest ROW_SPLIT_GROUPS from below, each item still
    reducing ROW_SPLIT_ITEMS elements; 0 for any other kernel or target."""
    from .grid_reduce import row_grid_plan
    if not caps.grid_reduce or not few_rows_group(ast, globals_, caps):
        return 0
    rows = globals_[0].src[0].arg
    plan = row_grid_plan(ast, globals_, 2)
    if plan is None:
        return 0
    n = 1
    for r in plan[0][0].src[1:]:
        n *= r.src[0].arg
    p = 2
    while rows * p * 2 <= ROW_SPLIT_GROUPS and n >= p * 2 * group * ROW_SPLIT_ITEMS:
        p *= 2
    return p if row_grid_plan(ast, globals_, p) is not None else 0


def wide_rows_apply(ast: UOp, width: int) -> bool:
    """Some top REDUCE over one range loads a 32-bit row contiguously from a buffer (what the group reduction
    loads as `width`-wide vectors)."""
    from ..scan import top_reduces, x_coefficient
    if width < 2 or width & (width - 1):
        return False
    for red in top_reduces(list(ast.src)):
        if len(red.src) != 2:
            continue
        r = red.src[1]
        for n in red.src[0].toposort():
            if (n.op is Ops.LOAD and n.dtype is not None and n.dtype.name in ("float32", "int32", "uint32")
                    and n.src[0].op is Ops.PARAM and r in n.free_ranges and x_coefficient(n.src[1], r) == 1):
                return True
    return False


def wide_rows_default(ast: UOp, globals_, caps: Capabilities) -> int:
    """WIDE_ROWS for a few-rows kernel (few_rows_group) with 32-bit row loads on a target with vector loads; else 1."""
    if caps.vector_width < WIDE_ROWS or not few_rows_group(ast, globals_, caps) or not wide_rows_apply(ast, WIDE_ROWS):
        return 1
    return WIDE_ROWS


def gemv_core_tiles(ast: UOp, caps: Capabilities, scan: KernelScan | None) -> list[tuple[int, int, int, int, int]]:
    """Skinny CUDA-core tiles a small-batch GEMV (fewer than DECODE_MIN_ROWS constant rows) can take, for the
    search: the batch rounded up to a power of two, DECODE_COLS columns, 64 deep."""
    from ..gpu_tile import _plan, plan_tile
    if caps.matmul_tile is None or not caps.has_shared:
        return []
    plan = _plan(ast, caps, scan, (16, 16, 16, 1, 1))
    if plan is None or plan.i.src[0].op is not Ops.CONST or plan.i.src[0].arg >= DECODE_MIN_ROWS:
        return []
    BM = _pow2_at_least(int(plan.i.src[0].arg), 2)
    return [t for t in ((BM, DECODE_COLS, 64, 1, 2), (BM, DECODE_COLS, 64, 2, 2), (BM, 64, 64, 1, 4))
            if BM % t[3] == 0 and plan_tile(ast, caps, scan, t) == t]
