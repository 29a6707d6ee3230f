"""The schedule: the named optimizations a kernel is lowered with, chosen before lowering.

A `Schedule` says how a kernel maps to the target, in terms that do not depend on one AST's node
identities (so a choice can be stored and applied again): which launch structure its GLOBAL ranges
take (`mapping`), how its reductions are split (`reduce`), the work-group size, the vector width of
elementwise accesses, the unroll of per-work-item reduction loops (rows in flight), whether a row
kernel keeps rows in shared memory, the register tile of a CPU reduction (upcast) and the
shared-memory tile of a GPU contraction. `default_schedule` derives one from the kernel's shape and the
target's `Capabilities` (the heuristics); `candidate_schedules` lists the valid alternatives a search
times; `check_schedule` refuses one the kernel cannot take. Lowering (codegen/lower.py) applies a
schedule mechanically, each strategy in its own module (codegen/strategies/, opt.py, gpu_tile.py).

Tensor cores are the "tiled" mapping's `tensor_core` field (an MMA shape), staged by `tc_stages` cp.async
buffers in an optionally swizzled layout (`tc_swizzle`): strategies/tensor_core.py.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
from dataclasses import asdict, dataclass, fields, replace
from typing import Iterator

from ..errors import ArgumentError
from ..ir import AxisType, Ops, UOp
from .capabilities import Capabilities
from .scan import KernelScan, is_column_reduction
from .strategies.split_reduce import split_applies

MAPPINGS = ("threads", "groups", "group_per_row", "tiled")
REDUCES = ("serial", "group", "grid", "stream")


@dataclass(frozen=True)
class Schedule:
    """How one kernel is lowered. Fields (defaults are "off"):

    mapping        "threads": CPU, the outermost GLOBAL range is split over worker threads, the rest are
                   loops. "groups": GPU, GLOBAL ranges -> grid x work-group, one output per work-item.
                   "group_per_row": GPU, one work-group per output of the (at most one) GLOBAL range.
                   "tiled": GPU contraction with shared-memory tiles (`matmul_tile`).
    reduce         "serial": each output's reduction runs in order inside one work-item (a column
                   reduction: neighbouring work-items read neighbouring columns, coalesced).
                   "group": across the work-group (group_per_row). "grid": a full reduction in two
                   stages over many work-groups (group_per_row, no GLOBAL range). "stream" (CPU): a
                   column reduction accumulated into the output row by row, `stream_block` columns
                   per thread-split unit (opt.stream_columns).
    group          work-items per work-group (GPU; 0 on the CPU).
    vector_width   elementwise GPU kernels: contiguous elements per work-item (w-wide loads/stores). group_per_row:
                   a cooperative reduction's contiguous 32-bit row loads as w-wide vectors (strategies/small_shapes.py).
    unroll         GPU: unroll count of a work-item's serial reduction loops (loads in flight).
    split          "groups" with a serial reduce: work-items per output sharing its reduction (the
                   group is group/split outputs x split; strategies/split_reduce.py). 1: one.
    row_cache      group_per_row: rows read by several passes are kept in shared memory.
    row_groups     group_per_row over a GLOBAL range: launch this many work-groups, each walking rows g,
                   g + row_groups, ... (strategies/group_reduce.py): rows too long for the row cache that
                   several passes read stay in L2 between passes. 0: one work-group per row.
    min_groups     GPU, general path: work-groups the compiler should fit on one SM at once (it caps
                   registers per item: CUDA's __launch_bounds__ second argument); 0: no hint.
    unrolled       split: the loop over the reduced range is unrolled by the lowering (`unroll` copies, each
                   load at copy 0's index + a constant: strategies/split_reduce.py) instead of an unroll hint to
                   the compiler; only where the trip count is a constant multiple of split x unroll.
    upcast         split: each work-item computes every output along the GLOBAL range of this constant
                   extent (strategies/split_reduce.upcast_plan: a GEMV's batch), its accumulators in
                   registers, so a load that does not depend on that range (W) is read once for all. 0: off.
    register_tile  CPU: (rows, columns) of outputs a reduction computes per iteration (upcast).
    tile_lanes     CPU: the register tile's columns computed as vectors of this many lanes (accumulators,
                   loads, FMAs printed as LLVM vectors; strategies/tile_lanes.py); 0: one scalar per
                   column, which LLVM's SLP vectorizer packs (several times the IR and compile time).
    pack           CPU register tile: each thread-split unit copies its column panel of the right-hand
                   operand into a contiguous scratch first (opt._pack_plan: rows a multiple of 1 KB apart
                   map a panel onto a few cache sets).
    prefetch       CPU register tile (with tile_lanes): the vector loads and stores after a tile's reduction
                   loop (its outputs, an epilogue's residual) are prefetched into L2 before the loop
                   (codegen/prefetch.py).
    matmul_tile    tiled: (BM, BN, BK, TM, TN), block and per-work-item outputs, BK deep.
    tensor_core    tiled: the matrix instruction of the inner product (strategies/tensor_core.py), e.g.
                   "mma_m16n8k16"; matmul_tile is then (BM, BN, BK, WM, WN), WM x WN outputs per warp.
                   "wgmma_m64k16" (sm_90a, strategies/wgmma.py): WM = 64 rows per warpgroup, WN = BN,
                   BK = 64, tc_stages >= 3 and tc_swizzle (the hardware's 128-byte swizzle).
    tc_stages      tensor_core (NVIDIA): shared-memory buffers of the cp.async pipeline (>= 2); 0: the
                   register-staged double buffer (also what a kernel without provably aligned fills runs).
    tc_swizzle     tensor_core (NVIDIA): XOR-swizzled 16-byte chunks in the shared tiles instead of padded rows.
    async_fill     tiled without a tensor_core (targets with `async_copy`: NVIDIA sm_80+): the double-buffered
                   full tiles whose units are plain loads are filled by asynchronous copies (cp.async) straight
                   into shared memory, the next tile's copies in flight under the whole k step, instead of
                   through registers (whose loads the compiler may schedule late: codegen/gpu_tile.py).
    stream_block   reduce "stream": output columns per block.
    permute        "groups": a permutation moved through shared-memory tiles of this edge (strategies/permute.py); 0: off.
    block_permute  "threads": a permutation walked in blocks of this edge (strategies/permute.cpu_block_permute); 0: off.
    row_split      reduce "grid" over one GLOBAL range of constant rows: each row on this many work-groups (a power
                   of two), the last of them combining the row's partials (strategies/grid_reduce.py); 0: off.
    split_k        tiled without a tensor_core: each output tile on this many work-groups, each over K / split_k,
                   the last of them summing the parts from a hidden scratch (gpu_tile.split_k_applies); 0: off.
    """

    mapping: str
    reduce: str = "serial"
    group: int = 0
    vector_width: int = 1
    unroll: int = 0
    split: int = 1
    row_cache: bool = False
    register_tile: tuple[int, int] | None = None
    tile_lanes: int = 0
    pack: bool = False
    matmul_tile: tuple[int, int, int, int, int] | None = None
    tensor_core: str | None = None
    tc_stages: int = 0
    tc_swizzle: bool = False
    stream_block: int = 0
    row_groups: int = 0
    min_groups: int = 0
    upcast: int = 0
    unrolled: bool = False
    async_fill: bool = False
    permute: int = 0
    block_permute: int = 0
    row_split: int = 0
    split_k: int = 0
    prefetch: bool = False

    def __post_init__(self) -> None:
        if self.row_split and (self.row_split < 2 or self.row_split & (self.row_split - 1) or self.reduce != "grid"):
            raise ArgumentError("row_split needs reduce 'grid' and is a power of two >= 2")
        if self.permute:
            from .strategies.permute import valid_permute
            if self.mapping != "groups" or self.vector_width != 1 or self.split != 1 or not valid_permute(self.permute, self.group):
                raise ArgumentError(f"permute={self.permute} needs mapping 'groups' and a group that moves its tiles in whole passes")
        if self.block_permute and (self.mapping != "threads" or self.block_permute < 2 or self.register_tile is not None
                                   or self.reduce != "serial"):
            raise ArgumentError(f"block_permute={self.block_permute} is a CPU ('threads') schedule's block edge (>= 2), "
                                "without a register tile or a reduction")
        if self.mapping not in MAPPINGS:
            raise ArgumentError(f"schedule mapping {self.mapping!r}: one of {', '.join(MAPPINGS)}")
        if self.reduce not in REDUCES:
            raise ArgumentError(f"schedule reduce {self.reduce!r}: one of {', '.join(REDUCES)}")
        if self.reduce == "stream":
            if self.mapping != "threads" or self.stream_block < 1 or self.register_tile is not None:
                raise ArgumentError("reduce 'stream' is a CPU ('threads') schedule with a stream_block, no register tile")
        elif self.stream_block:
            raise ArgumentError("stream_block needs reduce 'stream'")
        elif self.reduce != "serial" and self.mapping != "group_per_row":
            raise ArgumentError(f"reduce={self.reduce!r} needs mapping 'group_per_row'")
        if self.mapping == "group_per_row" and self.reduce == "serial":
            raise ArgumentError("mapping 'group_per_row' reduces across the group: reduce 'group' or 'grid'")
        if (self.mapping == "tiled") != (self.matmul_tile is not None):
            raise ArgumentError("mapping 'tiled' and matmul_tile go together")
        if self.tensor_core is not None and self.mapping != "tiled":
            raise ArgumentError("tensor_core needs mapping 'tiled'")
        if (self.tc_stages or self.tc_swizzle) and self.tensor_core is None:
            raise ArgumentError("tc_stages and tc_swizzle need a tensor_core")
        if self.split_k and (self.split_k < 2 or self.mapping != "tiled" or self.tensor_core is not None):
            raise ArgumentError("split_k is a field of the tiled mapping without a tensor_core, at least 2")
        if self.async_fill and (self.mapping != "tiled" or self.tensor_core is not None):
            raise ArgumentError("async_fill is a field of the tiled mapping without a tensor_core (which stages by tc_stages)")
        if self.register_tile is not None and self.mapping != "threads":
            raise ArgumentError("register_tile is a CPU ('threads') schedule")
        if self.tile_lanes and (self.register_tile is None or self.tile_lanes < 4
                                or self.tile_lanes & (self.tile_lanes - 1)):
            raise ArgumentError("tile_lanes needs a register_tile and is a power of two >= 4")
        if self.pack and not self.tile_lanes:
            raise ArgumentError("pack needs a register_tile with tile_lanes")
        if self.prefetch and not self.tile_lanes:
            raise ArgumentError("prefetch needs a register_tile with tile_lanes")
        if self.row_cache and self.reduce != "group":
            raise ArgumentError("row_cache needs reduce 'group'")
        if self.row_groups < 0 or self.row_groups and self.reduce != "group":
            raise ArgumentError("row_groups needs reduce 'group' (and is not negative)")
        if self.min_groups < 0 or self.min_groups and self.mapping in ("threads", "tiled"):
            raise ArgumentError("min_groups is a hint of the general GPU path (the tiled path sets its own)")
        if self.upcast and (self.split < 2 or self.upcast < 2):
            raise ArgumentError("upcast needs a split reduction and an extent of at least 2")
        if self.unrolled and (self.split < 2 or self.unroll < 2):
            raise ArgumentError("unrolled needs a split reduction and an unroll of at least 2")
        if self.split > 1 and (self.mapping != "groups" or self.vector_width != 1 or self.group % self.split
                               or self.split & (self.split - 1)):
            raise ArgumentError("split needs mapping 'groups', no vector width and a power of two dividing group")
        if self.group < 0 or self.vector_width < 1 or self.unroll < 0 or self.split < 1:
            raise ArgumentError(f"bad sizes in {self}")
        if self.mapping == "threads" and (self.group or self.vector_width != 1 or self.unroll or self.split != 1):
            raise ArgumentError("group, vector_width and unroll are GPU fields")
        # tensor cores: whole warpgroups (the wgmma form adds a producer warpgroup: 384 work-items)
        pow2 = self.group >= 1 and not self.group & (self.group - 1)
        if self.mapping != "threads" and not pow2 and not (self.tensor_core is not None and self.group % 128 == 0
                                                           and self.group > 0):
            raise ArgumentError(f"a GPU schedule needs a power-of-two group size (tensor cores: a multiple of "
                                f"128), got {self.group}")

    def __str__(self) -> str:
        parts = [self.mapping]
        for f in fields(self)[1:]:
            v = getattr(self, f.name)
            if v != f.default:
                parts.append(f"{f.name}={'x'.join(map(str, v)) if isinstance(v, tuple) else v}")
        return "Schedule(" + ", ".join(parts) + ")"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Schedule":
        """The schedule `to_json` wrote; ValueError for anything else (a corrupt stored choice)."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ArgumentError(f"not a schedule: {e}") from None
        names = {f.name for f in fields(Schedule)}
        if not isinstance(d, dict) or set(d) - names or "mapping" not in d:
            raise ArgumentError(f"not a schedule: {text[:80]!r}")
        for k in ("register_tile", "matmul_tile"):
            if d.get(k) is not None:
                if not isinstance(d[k], list) or not all(isinstance(x, int) and x > 0 for x in d[k]):
                    raise ArgumentError(f"bad {k} {d[k]!r}")
                d[k] = tuple(d[k])
        for k in ("group", "vector_width", "unroll", "split", "stream_block", "row_groups", "min_groups", "upcast", "tile_lanes", "permute", "block_permute", "row_split", "split_k"):
            if k in d and (not isinstance(d[k], int) or isinstance(d[k], bool)):
                raise ArgumentError(f"bad {k} {d[k]!r}")
        if "pack" in d and not isinstance(d["pack"], bool):
            raise ArgumentError(f"bad pack {d['pack']!r}")
        for k in ("unrolled", "async_fill"):
            if k in d and not isinstance(d[k], bool):
                raise ArgumentError(f"bad {k} {d[k]!r}")
        if d.get("tensor_core") is not None and not isinstance(d["tensor_core"], str):
            raise ArgumentError(f"bad tensor_core {d['tensor_core']!r}")
        if "tc_stages" in d and (not isinstance(d["tc_stages"], int) or isinstance(d["tc_stages"], bool)):
            raise ArgumentError(f"bad tc_stages {d['tc_stages']!r}")
        if "tc_swizzle" in d and not isinstance(d["tc_swizzle"], bool):
            raise ArgumentError(f"bad tc_swizzle {d['tc_swizzle']!r}")
        try:
            return Schedule(**d)
        except TypeError as e:
            raise ArgumentError(str(e)) from None


# -- which schedule a render uses when its caller names one ----------------------------------------

_chosen: contextvars.ContextVar["Schedule | None"] = contextvars.ContextVar("morok_schedule", default=None)


@contextlib.contextmanager
def using(schedule: "Schedule | None") -> Iterator[None]:
    """Within the block, `lower` uses `schedule` instead of the default (None: the default). The
    renderer's `render(ast)` knows no schedule argument; search and the cache pass theirs this way."""
    token = _chosen.set(schedule)
    try:
        yield
    finally:
        _chosen.reset(token)


def chosen() -> "Schedule | None":
    return _chosen.get()


# -- the kernel's shape ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """What the heuristics look at."""

    globals_: tuple[UOp, ...]       # GLOBAL ranges by axis
    has_reduce: bool
    only_globals: bool              # every range is GLOBAL (elementwise)


def shape_of(scan: KernelScan) -> Shape:
    rs = scan.ranges.values()
    globals_ = tuple(sorted((r for r in rs if r.axis_type is AxisType.GLOBAL), key=lambda r: r.axis))
    return Shape(globals_, any(r.axis_type is AxisType.REDUCE for r in rs),
                 all(r.axis_type is AxisType.GLOBAL for r in rs))


SPLIT_UNROLL = 8       # column reductions: rows in flight per work-item
SPLIT = 8              # ... and work-items per output column
SPLIT_RESIDENT = 2048  # split reductions ask for this many work-items per SM (a CUDA SM's most, sm_80/90):
                       # 32 registers per item. The llvm-nvptx pair's batch-8 GEMV took 40 without it, so
                       # only 6 of its 256-item groups fit an SM: 1024 groups were 1.3 waves (89.5 us
                       # against NVRTC's 31 registers, one wave, 68.5 us, on an H100)


# Schedule.upcast is a candidate, not a default: measured on an H100 by benchmarks/schedule_variants.py
# (benchmarks/results/nvidia-h100/schedule_variants-*.json) the batch-8 GEMV took
# 210 / 122 us (nvrtc / llvm-nvptx) with group 256 x split 8 (too few items: 128 groups of 256), 60 / 85 us with
# 1024 x 32 (llvm-nvptx spills: LLVM sinks the combine's adds below every reduce's shared loads), against the
# plain split's 66 / 86 us.


# The upcast default of a printer whose capabilities set split_upcast (caps.split_upcast >= the batch): group
# 512, split 16, unroll 4 unrolled by the lowering. Timed on an H100, batch-8 GEMV 8x4096x4096 on llvm-nvptx:
# 49 us (benchmarks/schedule_variants.py) and 53 us (as search's winner) against the plain split's 87-95 us. The same
# shape took 111 us on NVRTC, whose plain split runs 64-66 us: so only the NVPTX printer sets it.
GEMV_UPCAST_SPLIT = dict(group=512, unroll=4, split=16)
# The upcast default of the other CUDA printer (NVRTC, no split_upcast): GEMV_UPCAST_SPLIT with an occupancy hint
# of GEMV_UPCAST_RESIDENT groups per SM (__launch_bounds__(512, 2)). Without it ptxas fits NVRTC's PTX of that
# schedule in 32 registers and issues each of the 4 unrolled W loads after the previous one's FMAs (one W load in
# flight per item: 111 us on an H100), where the NVPTX pair's PTX takes 128 registers and issues all 36 loads
# before the first FMA (49 us); with the hint ptxas takes 64 registers and issues all 36 first (SASS of both,
# ptxas 13.0, sm_90a). The hint on the NVPTX pair spills (316 bytes), so only NVRTC takes it.
# Measured on an H100 (benchmarks/decode.py, nvrtc): 46.1 us, 0.97x torch (was 57 us, 0.79x).
GEMV_UPCAST_RESIDENT = 2      # 0: no upcast default on NVRTC (the plain split)
# NVRTC's upcast default where the lowering can unroll it (K a multiple of split x unroll = 128): group 1024, split 32,
# unroll 4 unrolled, with __launch_bounds__(1024, 1) (ptxas: 64 registers, all 36 loads before the first FMA; without
# the hint 70.9 us). Batch-8 GEMV 8x4096x4096 on an H100 (benchmarks/decode.py --variants, nvrtc): 41.2 us against
# 50.2 us for GEMV_UPCAST_SPLIT with GEMV_UPCAST_RESIDENT in the same run; the hint form without the lowering's
# unroll (the NVRTC default before) 61 us. As the default: 37.4 us, 1.19x torch (benchmarks/results/nvidia-h100/
# decode-nvrtc.json). Its NVPTX twin spills (856-byte frame).
GEMV_UPCAST_WIDE = dict(group=1024, unroll=4, split=32)
# tiled contractions on targets with asynchronous copies: fill the double-buffered tiles by cp.async. benchmarks/kernels.py
# on an H100: float32 4096^3 with symbolic sizes ran 0.950x its static twin (3.04 vs 2.89 ms, interleaved) because
# ptxas issued the register-staged loads of the next tile ~200 instructions before their shared stores (SASS),
# not enough to cover their latency. With B's 16-byte runs copied asynchronously (gpu_tile.ASYNC_MIN_BYTES):
# static 2.91 -> 2.85 ms, symbolic 3.04 -> 2.82 ms on nvrtc; 2.95 -> 2.77 and 3.06 -> 2.87 on llvm-nvptx
ASYNC_FILL_DEFAULT = True


def tc_threads_of(tile: tuple[int, int, int, int, int], mma: str) -> int:
    from .strategies.tensor_core import tc_threads
    return tc_threads(tile, mma)


def load_strategies(caps: Capabilities) -> None:
    """Import the strategy modules the default schedule consults for a target with `caps`. The schedule
    imports them inside the functions that use them (a CPU process never loads the GPU ones), so without
    this a process's first lowering for a GPU, often a disk-cache hit, loaded them inside its call; a device
    calls it when it opens."""
    if caps.has_local:
        from .strategies import matrix_units, permute, small_shapes  # noqa: F401


def split_min_groups(group: int) -> int:
    return max(1, SPLIT_RESIDENT // group)


def split_default(ast: UOp, scan: KernelScan, group: int, cuda: bool = True, split_upcast: int = 0,
                  max_group: int = 1024) -> Schedule:
    """The split schedule of a column-like reduction, as measured on an H100 (benchmarks/schedule_variants.py): one load per step (a
    column sum) with the occupancy hint and the loop unrolled by the lowering where its trip count allows
    (8192^2: 108 -> 97 us); several (a GEMV: x and W) the plain split, which ran 64-66 us on NVRTC where the
    hint and the lowering's unroll took 92; on a printer with `split_upcast` (llvm-nvptx, 86-95 us plain) a
    GEMV whose batch is at most that computes the whole batch per work-item (GEMV_UPCAST_SPLIT); on the other
    CUDA printer (NVRTC) too, with an occupancy hint (GEMV_UPCAST_WIDE where K allows, else GEMV_UPCAST_SPLIT with
    GEMV_UPCAST_RESIDENT)."""
    from .scan import top_reduces
    from .strategies.split_reduce import lowering_unroll_applies, upcast, upcast_plan
    loads = {n for red in top_reduces(list(ast.src)) for n in red.src[0].toposort() if n.op is Ops.LOAD}
    base = Schedule("groups", group=group, unroll=SPLIT_UNROLL, split=SPLIT)
    if len(loads) != 1:
        up = upcast_plan(ast, scan) if split_upcast and GEMV_UPCAST_SPLIT["group"] <= max_group else None
        if up is not None and up.src[0].arg <= split_upcast:
            sh = GEMV_UPCAST_SPLIT
            return Schedule("groups", **sh, upcast=up.src[0].arg,
                            unrolled=lowering_unroll_applies(upcast(ast, up), sh["split"], sh["unroll"]))
        up = (upcast_plan(ast, scan) if cuda and not split_upcast and GEMV_UPCAST_RESIDENT
              and GEMV_UPCAST_SPLIT["group"] <= max_group else None)
        if up is not None:
            wide = GEMV_UPCAST_WIDE
            if wide["group"] <= max_group and lowering_unroll_applies(upcast(ast, up), wide["split"], wide["unroll"]):
                return Schedule("groups", **wide, upcast=up.src[0].arg, min_groups=1, unrolled=True)
            sh = GEMV_UPCAST_SPLIT
            return Schedule("groups", **sh, upcast=up.src[0].arg, min_groups=GEMV_UPCAST_RESIDENT,
                            unrolled=lowering_unroll_applies(upcast(ast, up), sh["split"], sh["unroll"]))
        return base
    return replace(base, min_groups=split_min_groups(group),
                   unrolled=cuda and lowering_unroll_applies(ast, SPLIT, SPLIT_UNROLL))


def default_schedule(ast: UOp, caps: Capabilities, scan: KernelScan) -> Schedule:
    """The heuristic schedule of a (simplified, decomposed) kernel for a target."""
    shape = shape_of(scan)
    if not caps.has_local:
        from .opt import STREAM_BLOCK, register_tile_applies, stream_applies
        if stream_applies(ast):
            return Schedule("threads", reduce="stream", stream_block=STREAM_BLOCK)
        from .strategies.permute import CPU_BLOCK, cpu_block_plan
        if cpu_block_plan(ast, scan) is not None:
            return Schedule("threads", block_permute=CPU_BLOCK)
        tile = caps.register_tile if caps.register_tile is not None and register_tile_applies(ast) else None
        if tile is not None and len(shape.globals_) == 1:
            tile = (1, 2 * tile[1])        # a column reduction: one row of 2x the vector tile's columns
        elif tile is not None:
            from .opt import tile_for
            tile = tile_for(ast, tile, caps.tile_lanes)
        lanes = default_lanes(ast, caps, tile)
        from .opt import pack_applies
        return Schedule("threads", register_tile=tile, tile_lanes=lanes,
                        pack=bool(lanes) and pack_applies(ast, tile, lanes, caps.threads), prefetch=bool(lanes))
    from .strategies.permute import TILE, permute_applies, permute_group, permute_plan
    if permute_applies(ast, caps, scan):
        return Schedule("groups", group=permute_group(caps, TILE, permute_plan(ast, scan)), permute=TILE)
    from .strategies import small_shapes
    if caps.tensor_cores and caps.has_shared:
        dec = small_shapes.decode_tc(ast, caps, scan)
        if dec is not None:     # a decoding step: skinny blocks stream the weight matrix
            mma, tile, stages, swizzle = dec
            return Schedule("tiled", group=tc_threads_of(tile, mma), matmul_tile=tile,
                            tensor_core=mma, tc_stages=stages, tc_swizzle=swizzle)
        from .strategies.matrix_units import choose_tc
        from .strategies.tensor_core import tc_threads
        tc = choose_tc(ast, caps, scan)
        if tc is not None:
            mma, tile, stages, swizzle = tc
            return Schedule("tiled", group=tc_threads(tile, mma), matmul_tile=tile,
                            tensor_core=mma, tc_stages=stages, tc_swizzle=swizzle)
    if caps.matmul_tile is not None and caps.has_shared:
        from .gpu_tile import deeper_tile, plan_tile
        tile = small_shapes.decode_core(ast, caps, scan) or plan_tile(ast, caps, scan)
        if tile is not None and tile == plan_tile(ast, caps, scan):
            tile = deeper_tile(ast, caps, scan, small_shapes.few_block_tile(ast, caps, scan, tile))
        if tile is not None:
            # timed on float accumulators; an int32 product spilled 8 bytes under the 128-register cap (nvrtc)
            floats = all(u.dtype.is_float for u in ast.toposort() if u.op is Ops.REDUCE)
            return Schedule("tiled", group=_tile_threads(tile), matmul_tile=tile,
                            async_fill=caps.async_copy and ASYNC_FILL_DEFAULT and floats,
                            split_k=small_shapes.decode_split_k(ast, caps, scan, tile))
    group = caps.default_group
    if (caps.has_shared and shape.has_reduce and is_column_reduction(ast, shape.globals_)
            and split_applies(ast, scan)):
        from .gpu_tile import _cuda_like
        from .strategies.split_reduce import SPLIT_SHARED_MAX, split_shared_bytes
        # AMD: no timing backs the lowering's unroll
        split = split_default(ast, scan, group, _cuda_like(caps), caps.split_upcast,
                              min(caps.max_threads_per_group, caps.local_max[0]))
        if split_shared_bytes(ast, split.group, split.upcast) <= SPLIT_SHARED_MAX:
            return split        # else too many reductions to combine in shared memory: the paths below
    if caps.group_reduce and len(shape.globals_) <= 1 and shape.has_reduce:
        if not shape.globals_ and caps.grid_reduce:
            from .strategies.grid_reduce import grid_plan
            if grid_plan(ast, shape.globals_, group) is not None:
                return Schedule("group_per_row", reduce="grid", group=group)
        row_cache = False
        if caps.has_shared:
            from .strategies.row_cache import row_cache_plan
            row_cache = bool(row_cache_plan(ast, shape.globals_, scan))
        from .strategies.group_reduce import row_groups_default
        from .gpu_tile import _cuda_like
        # timed on an H100 (50 MB of L2) only: 128 vocabulary rows are 26 MB, more than an MI250X's 8 MB
        row_groups = row_groups_default(ast, shape.globals_, scan) if _cuda_like(caps) else 0
        if row_groups:      # long rows, few in flight: a full-size group per row keeps its loads in flight
            return Schedule("group_per_row", reduce="group", group=min(1024, caps.max_threads_per_group,
                            caps.local_max[0]), row_cache=row_cache, row_groups=row_groups)
        split = small_shapes.row_split_default(ast, shape.globals_, caps, group)
        wide = small_shapes.wide_rows_default(ast, shape.globals_, caps)
        if split:               # few long rows, reduced only: each row on several work-groups
            return Schedule("group_per_row", reduce="grid", group=group, row_split=split, vector_width=wide)
        few = small_shapes.few_rows_group(ast, shape.globals_, caps)   # few long rows: full-size groups
        return Schedule("group_per_row", reduce="group", group=few or group, row_cache=row_cache,
                        vector_width=wide if few and not row_cache else 1)
    if caps.vector_width > 1:
        from .strategies.vectorize import vector_plan, widened
        if vector_plan(ast, shape.globals_, scan, caps.vector_width) is not None:
            return Schedule("groups", group=group, vector_width=widened(ast, shape.globals_, scan, caps.vector_width))
    return Schedule("groups", group=group)


def default_lanes(ast: UOp, caps: Capabilities, tile: "tuple[int, int] | None") -> int:
    """The register tile's vector lanes: the target's (at most the tile's width) where the kernel's
    columns can be vectors, else 0."""
    if tile is None or caps.tile_lanes < 4 or tile[1] < 4:
        return 0
    from .opt import lanes_apply
    if not lanes_apply(ast):
        return 0
    lanes = caps.tile_lanes
    while lanes > tile[1]:
        lanes //= 2
    return lanes


def _tile_threads(tile: tuple[int, int, int, int, int]) -> int:
    BM, BN, _, TM, TN = tile
    return (BM // TM) * (BN // TN)


def check_schedule(schedule: Schedule, ast: UOp, caps: Capabilities, scan: KernelScan) -> None:
    """ValueError when the kernel or the target cannot take `schedule`."""
    shape = shape_of(scan)
    gpu = caps.has_local
    if gpu == (schedule.mapping == "threads"):
        raise ArgumentError(f"{schedule} is not a schedule for a {'GPU' if gpu else 'CPU'} target")
    if gpu and schedule.group > min(caps.max_threads_per_group, caps.local_max[0]):
        raise ArgumentError(f"{schedule}: group of {schedule.group} is over the target's limit")
    if schedule.reduce == "stream":
        from .opt import stream_applies
        if not stream_applies(ast):
            raise ArgumentError(f"{schedule}: the kernel is no plain column reduction")
    if schedule.register_tile is not None:
        from .opt import register_tile_applies
        if not register_tile_applies(ast):
            raise ArgumentError(f"{schedule}: the kernel has no register-tileable reduction")
    if schedule.pack:
        from .opt import pack_applies
        if not pack_applies(ast, schedule.register_tile, schedule.tile_lanes):
            raise ArgumentError(f"{schedule}: no operand of the kernel takes packed panels")
    if schedule.tile_lanes:
        from .opt import lanes_apply
        if not caps.tile_lanes or not lanes_apply(ast):
            raise ArgumentError(f"{schedule}: the target prints no tile lanes or the kernel's columns are no vectors")
    if schedule.permute:
        from .strategies.permute import permute_applies
        if not permute_applies(ast, caps, scan):
            raise ArgumentError(f"{schedule}: the kernel is no permutation or the target has no shared memory")
    if schedule.block_permute:
        from .strategies.permute import cpu_block_plan
        if caps.has_local or cpu_block_plan(ast, scan) is None:
            raise ArgumentError(f"{schedule}: the kernel is no permutation of static sizes or the target is no CPU")
    if schedule.tensor_core is not None:
        from .strategies.matrix_units import mma_plan
        from .strategies.tensor_core import tc_threads
        if (schedule.tensor_core not in caps.tensor_cores or tc_threads(schedule.matmul_tile, schedule.tensor_core) != schedule.group
                or mma_plan(ast, caps, scan, schedule.matmul_tile, schedule.tc_stages, schedule.tc_swizzle,
                            schedule.tensor_core) is None):
            raise ArgumentError(f"{schedule}: the target or the kernel cannot take these tensor-core tiles")
    elif schedule.mapping == "tiled":
        from .gpu_tile import plan_tile
        if not caps.has_shared or plan_tile(ast, caps, scan, schedule.matmul_tile) is None:
            raise ArgumentError(f"{schedule}: the kernel is not a contraction these tiles fit")
        if schedule.async_fill and not caps.async_copy:
            raise ArgumentError(f"{schedule}: the target has no asynchronous copies (async_fill)")
        if schedule.split_k:
            from .gpu_tile import split_k_applies
            if not split_k_applies(ast, caps, scan, schedule.matmul_tile, schedule.split_k):
                raise ArgumentError(f"{schedule}: the kernel or target cannot take split_k={schedule.split_k}")
    if schedule.mapping == "group_per_row":
        if not caps.has_shared and schedule.group > 1:
            raise ArgumentError(f"{schedule}: the target has no shared memory")
        if len(shape.globals_) > 1 or not shape.has_reduce:
            raise ArgumentError(f"{schedule}: group_per_row takes a reduction over at most one GLOBAL range")
        if schedule.reduce == "grid":
            from .strategies.grid_reduce import grid_plan
            if grid_plan(ast, shape.globals_, schedule.group, schedule.row_split) is None:
                raise ArgumentError(f"{schedule}: not a full reduction (row_split: not a reduction of few constant rows)")
        if schedule.row_groups and len(shape.globals_) != 1:
            raise ArgumentError(f"{schedule}: row_groups needs one GLOBAL range (the rows)")
    if schedule.upcast:
        from .strategies.split_reduce import upcast, upcast_plan
        up = upcast_plan(ast, scan)
        if up is None or up.src[0].arg != schedule.upcast:
            raise ArgumentError(f"{schedule}: the kernel has no GLOBAL range of extent {schedule.upcast} to upcast")
        from .scan import scan_kernel
        ast = upcast(ast, up)
        scan = scan_kernel(ast)
    if schedule.split > 1 and (not gpu or not caps.has_shared or not split_applies(ast, scan)):
        raise ArgumentError(f"{schedule}: split reductions need shared memory and stores over every GLOBAL range")
    if schedule.split > 1:
        from .strategies.split_reduce import SPLIT_SHARED_MAX, split_shared_bytes
        need = split_shared_bytes(ast, schedule.group)      # ast is upcast above
        if need > SPLIT_SHARED_MAX:
            raise ArgumentError(f"{schedule}: its partials take {need} bytes of shared memory, over {SPLIT_SHARED_MAX}")
    if schedule.unrolled:
        from .strategies.split_reduce import lowering_unroll_applies
        if not lowering_unroll_applies(ast, schedule.split, schedule.unroll):
            raise ArgumentError(f"{schedule}: the split loop's trip count is no constant multiple of split x unroll")
    if schedule.vector_width > 1 and schedule.mapping == "group_per_row":
        from .strategies.small_shapes import wide_rows_apply
        if schedule.row_cache or not wide_rows_apply(ast, schedule.vector_width):
            raise ArgumentError(f"{schedule}: no contiguous 32-bit row loads in the kernel's reductions")
    elif schedule.vector_width > 1:
        from .strategies.vectorize import vector_plan
        if schedule.mapping != "groups" or vector_plan(ast, shape.globals_, scan, schedule.vector_width) is None:
            raise ArgumentError(f"{schedule}: the kernel has no vectorizable elementwise access")


def candidate_schedules(ast: UOp, caps: Capabilities, scan: KernelScan) -> list[Schedule]:
    """The default schedule first, then valid alternatives a search may time (bounded: a few dozen)."""
    base = default_schedule(ast, caps, scan)
    shape = shape_of(scan)
    out = [base]
    if not caps.has_local:
        if base.reduce == "stream":
            out += [replace(base, stream_block=b) for b in (128, 256, 512, 1024, 2048)]
            base = replace(base, reduce="serial", stream_block=0, register_tile=caps.register_tile)
            out.append(Schedule("threads"))
        if base.register_tile is not None:
            rows, cols = base.register_tile
            tiles = [(rows, cols), (4, cols), (2, cols), (rows, cols // 2), (8, cols // 2), (1, cols)]
            if len(shape.globals_) == 1:
                tiles = [(1, cols // 4), (1, cols // 2), (1, 2 * cols)]
            from .opt import pack_applies
            for t in tiles:
                if t[0] >= 1 and t[1] >= 1:
                    lanes = default_lanes(ast, caps, t)
                    out.append(replace(base, register_tile=t, tile_lanes=lanes,
                                       pack=bool(lanes) and pack_applies(ast, t, lanes), prefetch=bool(lanes)))
            if base.pack:
                out.append(replace(base, pack=False))
            if base.prefetch:
                out.append(replace(base, prefetch=False))
            if base.tile_lanes:
                out.append(replace(base, tile_lanes=0, pack=False, prefetch=False))     # scalar lanes, packed by LLVM
            out.append(replace(base, register_tile=None, tile_lanes=0, pack=False, prefetch=False))
    else:
        from .strategies import small_shapes
        limit = min(caps.max_threads_per_group, caps.local_max[0])
        groups = [g for g in (64, 128, 256, 512, 1024) if g <= limit]
        if base.permute:        # other tiles and groups, then the general path
            from .strategies.permute import permute_candidates
            out += [Schedule("groups", group=g, permute=t) for t, g in permute_candidates(ast, caps, scan)]
            out += [Schedule("groups", group=g) for g in groups]
        elif base.tensor_core is not None:
            from .strategies.tensor_core import TC_PIPELINES, TC_TILE_CANDIDATES, WGMMA, tc_pipeline, tc_threads
            # decode tiles first (a search times the first few); then their pipelines
            decs = small_shapes.decode_tc(ast, caps, scan, every=True)
            out += [Schedule("tiled", group=tc_threads(t, m), matmul_tile=t, tensor_core=m, tc_stages=st,
                             tc_swizzle=sw) for m, t, st, sw in decs]
            out += [replace(base, tc_stages=st, tc_swizzle=sw) for _, t, _, _ in decs[:1] for st, sw in TC_PIPELINES
                    if base.matmul_tile == t]
            if WGMMA in caps.tensor_cores:
                from .strategies.wgmma import WG_CANDIDATES
                from .strategies.wgmma_f8 import F8_CANDIDATES
                out += [Schedule("tiled", group=tc_threads(t, WGMMA), matmul_tile=t, tensor_core=WGMMA, tc_stages=st,
                                 tc_swizzle=True) for t, st in WG_CANDIDATES + F8_CANDIDATES]
            first = caps.tensor_cores[0]      # the warp-level instruction (mma.sync on NVIDIA)
            if base.tensor_core == first:
                out += [replace(base, tc_stages=st, tc_swizzle=sw) for st, sw in TC_PIPELINES]
            for t in TC_TILE_CANDIDATES:
                st, sw = tc_pipeline(caps, t, ast, scan)
                out.append(Schedule("tiled", group=tc_threads(t, first), matmul_tile=t, tensor_core=first,
                                    tc_stages=st, tc_swizzle=sw))
            out += candidate_schedules(ast, replace(caps, tensor_cores=()), scan)   # the CUDA-core tiles
        elif base.mapping == "tiled":
            decs = small_shapes.decode_core(ast, caps, scan, every=True)
            if base.split_k:        # the other parts counts of the default tile, then the tiles unsplit
                out += [replace(base, split_k=k) for k in small_shapes.DECODE_SPLITS if k != base.split_k]
                out += [Schedule("tiled", group=_tile_threads(t), matmul_tile=t, async_fill=base.async_fill, split_k=k)
                        for t, k in small_shapes.decode_wide_split(ast, caps, scan)]
                out.append(replace(base, split_k=0))
            out += [Schedule("tiled", group=_tile_threads(t), matmul_tile=t, async_fill=base.async_fill)
                    for t in decs]
            if small_shapes.contraction_rows(ast, caps, scan) is not None and caps.split_upcast >= 0:
                out.append(Schedule("groups", group=256, unroll=8, split=8))       # the GEMV's split
            BM, BN, BK, TM, TN = base.matmul_tile
            for t in [(BM, BN, BK // 2, TM, TN), (BM // 2, BN // 2, BK, TM // 2, TN // 2), (BM // 2, BN, BK, TM // 2, TN),
                      (BM, BN // 2, BK, TM, TN // 2), (32, 32, 16, 2, 2), (64, 64, 16, 4, 4), (128, 64, 16, 8, 4),
                      (64, 128, 16, 4, 8), (32, 64, 16, 2, 4), (128, 128, 32, 8, 8)]:
                if min(t) >= 1 and t[0] % t[3] == 0 and t[1] % t[4] == 0 and _tile_threads(t) <= limit:
                    out.append(Schedule("tiled", group=_tile_threads(t), matmul_tile=t, async_fill=base.async_fill))
            if caps.async_copy:      # the default tile filled the other way, first after the default (at 0 it
                # became the search's default: the H100's static 4096^3 search kept the register fill, 1.6%
                # slower by its own timings, since the real default had to beat it by SWITCH_MARGIN; benchmarks/search_context.py)
                out.insert(1, replace(base, async_fill=not base.async_fill))
            out.append(Schedule("groups", group=caps.default_group))
        elif shape.has_reduce and len(shape.globals_) <= 1 and caps.group_reduce:
            for g in groups:
                for u in (0, 4, 8, 16):
                    out.append(Schedule("groups", group=g, unroll=u))
                    for sp in (2, 4, 8, 16, 32):
                        if sp < g and u in (4, 8):
                            out.append(Schedule("groups", group=g, unroll=u, split=sp))
                            out.append(Schedule("groups", group=g, unroll=u, split=sp, min_groups=split_min_groups(g)))
                if caps.has_shared:
                    out.append(Schedule("group_per_row", reduce="group", group=g))
                    if base.row_cache:
                        out.append(Schedule("group_per_row", reduce="group", group=g, row_cache=True))
                    if base.row_groups and g >= 256:
                        out += [Schedule("group_per_row", reduce="group", group=g, row_cache=base.row_cache,
                                         row_groups=n) for n in (64, 128, 256)]
                if base.reduce == "grid" and not base.row_split:
                    out.append(Schedule("group_per_row", reduce="grid", group=g))
                if base.row_split or base.group == small_shapes.FEW_ROWS_GROUP:
                    out += [Schedule("group_per_row", reduce="grid", group=g, row_split=p)
                            for p in small_shapes.ROW_SPLITS]
                    out += [replace(s, vector_width=w) for s in out[-len(small_shapes.ROW_SPLITS):] + [
                            Schedule("group_per_row", reduce="group", group=g)] for w in (2, 4)]
            if base.row_split or base.group == small_shapes.FEW_ROWS_GROUP:
                # the few-rows forms first after the default (a search times the first few)
                few = [s for s in out[1:] if s.mapping == "group_per_row" and s.group >= 256]
                out = [out[0]] + few + [s for s in out[1:] if s not in few]
        else:
            from .strategies.split_reduce import upcast_plan
            up = upcast_plan(ast, scan) if base.split > 1 else None
            for g in groups:
                out.append(replace(base, group=g))
                if shape.has_reduce:
                    out.append(replace(base, group=g, unroll=8))
                    for sp in (4, 8, 16):
                        out.append(Schedule("groups", group=g, unroll=8, split=sp))
                        out.append(Schedule("groups", group=g, unroll=8, split=sp, min_groups=split_min_groups(g)))
                if up is not None:      # each item all of a GEMV's batch rows (split g/32: 32 columns a group)
                    for sp, u in ((g // 32, 4), (g // 32, 8)):
                        if sp >= 2:
                            out.append(Schedule("groups", group=g, unroll=u, split=sp, upcast=up.src[0].arg))
            if up is not None:
                # first after the default (a search times the first few): the upcast shapes measured best on
                # an H100 (llvm-nvptx: 512/16/4 unrolled 49 us, 1.2x torch; NVRTC: 1024/32/4 60 us)
                n = up.src[0].arg
                first = [Schedule("groups", group=512, unroll=4, split=16, upcast=n, unrolled=True),
                         Schedule("groups", group=512, unroll=4, split=16, upcast=n, unrolled=True, min_groups=2),
                         Schedule("groups", group=1024, unroll=4, split=32, upcast=n),
                         Schedule("groups", group=1024, unroll=4, split=32, upcast=n, unrolled=True, min_groups=1),
                         Schedule("groups", group=256, unroll=4, split=8, upcast=n, unrolled=True, min_groups=4),
                         Schedule("groups", group=512, unroll=8, split=16, upcast=n, unrolled=True, min_groups=2),
                         Schedule("groups", group=1024, unroll=4, split=32, upcast=n, unrolled=True)]
                # a skinny CUDA-core tile streaming W through shared memory (strategies/small_shapes.py)
                first += [Schedule("tiled", group=_tile_threads(t), matmul_tile=t, async_fill=caps.async_copy)
                          for t in small_shapes.gemv_core_tiles(ast, caps, scan)]
                out[1:1] = first
            if base.vector_width > 1:
                out += [replace(base, vector_width=1), replace(base, vector_width=2)]
    out += [replace(s, unrolled=not s.unrolled) for s in out if s.split > 1 and s.unroll >= 2]
    seen, uniq = set(), []
    for s in out:
        if s not in seen:
            try:
                check_schedule(s, ast, caps, scan)
            except ValueError:
                continue
            seen.add(s)
            uniq.append(s)
    return uniq


# -- convolutions ---------------------------------------------------------------------------------------
# A convolution is a family of kernels, not one AST: strategies/conv.py plans which (pointwise or im2col
# contraction, depthwise, direct) from the same Capabilities, searchable under MOROK_BEAM; each kernel of
# a plan then gets its Schedule above.
from .strategies.conv import ConvPlan, candidate_plans as candidate_conv_plans, conv_plan, search_plan  # noqa: E402,F401
