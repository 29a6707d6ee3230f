"""float8 contractions on warpgroup tensor cores (NVIDIA sm_90a): `out[i, j] = g(SUM_k float32(a[i, k]) *
float32(b[k, j]))` with a and b float8_e4m3fn or float8_e5m2 (mixed too), accumulated in float32 by
`wgmma.mma_async.m64nNk32.f32.{e4m3|e5m2}.{e4m3|e5m2}`.

The kernel is strategies/wgmma.py's (producer warpgroup, 128-byte-swizzled buffers, mbarriers) with 1-byte
elements: a k tile is one 128-byte row, 128 k; one wgmma takes 32 k (32 bytes a row, as the 16-bit k16
form), a 16-byte copy 16 elements. PTX gives the 8-bit forms no transpose: both operands must be K-major in
shared memory. An operand contiguous along k (A row-major [M, K], B given as B^T [N, K] --
`kernels_f8.matmul(..., b_layout="nk")`, the layout torch._scaled_mm asks for) is filled by cp.async; one
contiguous along its rows or columns (B [K, N] row-major: kernels.matmul's layout) by the producer's
transposed fill (`_WGMMABuilder.fill_transposed`: 16-byte loads along n, words of 4 k gathered in registers,
4-byte shared stores, a proxy fence and a plain mbarrier arrival). Every stride must be a multiple of 16
elements known when the kernel is built, and a transposed operand's row (column) count a constant multiple
of 16. Anything else (odd or symbolic strides, other targets) keeps the ordinary path, which widens each
element to float32.

The schedule names the form `tensor_core=wgmma_m64k16` like the 16-bit one (its k depth follows the operand
type); the tiles are (BM, BN, 128, 64, BN).

Measured on an H100 (benchmarks/results/nvidia-h100/tensor_cores-float8-{nvrtc,llvm-nvptx}.json, beside
torch._scaled_mm in the same process): e4m3 4096^3 -> float32 1116 / 1100 TFLOP/s (1.08x / 1.17x), e4m3 x e5m2
1104 / 1105, 4000x3008x1040 377 / 372; B [K, N] through the transposed fill 316 / 329 at 4096^3 (0.31x /
0.34x): the producer's load-then-store turns leave the global loads' latency exposed. The tensor cores' float8
sums are less exact than float32 ones: 4.0e-3 of max |C| at K = 4096 (cuBLAS without fast accumulation 1.7e-4).
"""
from __future__ import annotations

from ...dtypes import dtypes
from ...ir import Ops, UOp
from ..capabilities import Capabilities
from ..scan import KernelScan
from .tensor_core import WG_BARS, WG_PRODUCER, WG_ROWS, WG_SMEM, WGMMA, product_loads

F8_DTYPES = ("float8_e4m3fn", "float8_e5m2")     # PTX e4m3 and e5m2 (the fnuz variants are other encodings)
F8_K = 128                                        # k per tile: one 128-byte swizzled row of 1-byte elements
F8_TILE = (128, 256, F8_K, 64, 256)              # 2 consumer warpgroups of 64 x 256, 48 KiB a stage
F8_STAGES = 4
F8_TILE_MID = (128, 128, F8_K, 64, 128)          # 32 KiB a stage
F8_TILE_SMALL = (64, 128, F8_K, 64, 128)
F8_TILE_NARROW = (128, 64, F8_K, 64, 64)
F8_MIN_BLOCKS = 132                               # blocks that fill an H100/H200 once (wgmma.WG_MIN_BLOCKS)
# (tile, stages) a search times
F8_CANDIDATES = [(F8_TILE, 4), (F8_TILE, 3), (F8_TILE_MID, 6), (F8_TILE_MID, 4), ((256, 128, F8_K, 64, 128), 4),
                 (F8_TILE_SMALL, 6), ((128, 192, F8_K, 64, 192), 4), (F8_TILE_NARROW, 8)]


def f8_tile_ok(tile: tuple[int, int, int, int, int], stages: int, swizzle: bool, threads_max: int) -> bool:
    """64-row warpgroups spanning the block's columns (a multiple of 64, at most 256), 128-deep k tiles, at
    least 3 swizzled buffers of 1-byte elements within WG_SMEM."""
    BM, BN, BK, WM, WN = tile
    if BK != F8_K or WM != WG_ROWS or WN != BN or BM % WG_ROWS or BN % 64 or not 64 <= BN <= 256:
        return False
    if not swizzle or stages < 3 or stages * (BM + BN) * BK + WG_BARS > WG_SMEM:
        return False
    return (BM // WG_ROWS) * 128 + WG_PRODUCER <= threads_max


def _f8_load(unit: UOp) -> UOp | None:
    """The float8 load a unit float32(load) is made of: UOp.cast expands the widening into integer ops on
    the byte (ir._narrow_cast), so the unit is recognised as exactly that expansion of its one load."""
    loads = [n for n in unit.toposort() if n.op is Ops.LOAD]
    if len(loads) != 1 or loads[0].dtype.name not in F8_DTYPES or unit.dtype != dtypes.float32:
        return None
    return loads[0] if loads[0].cast(dtypes.float32) is unit else None


def f8_plan(ast: UOp, caps: Capabilities, scan: KernelScan | None, tile: tuple[int, int, int, int, int],
            stages: int = 0, swizzle: bool = False, mma: str | None = WGMMA):
    """gpu_tile's plan narrowed to the raw float8 loads when the kernel is a float32 sum of products of two
    float8 operands, both contiguous along k with 16-element-aligned constant strides, and the target has
    warpgroup tensor cores that take `tile`; else None."""
    from ..gpu_tile import _plan, _vector_aligned
    if mma != WGMMA or WGMMA not in caps.tensor_cores or not caps.has_shared:
        return None
    if not f8_tile_ok(tile, stages, swizzle, min(caps.max_threads_per_group, caps.local_max[0])):
        return None
    plan = _plan(ast, caps, scan, tile)
    if plan is None:
        return None
    loads = product_loads(plan, _f8_load)
    if loads is None:
        return None
    f = plan.red.src[0]
    for s in f.src:
        fast, var = plan.fast.get(s, "k"), plan.i if plan.units[s] == "A" else plan.j
        along, ext = (plan.k, None) if fast == "k" else (var, var.src[0])
        # 16-byte runs along k (cp.async), or along the rows (columns) for a transposed fill: then their
        # extent a constant multiple of 16 (a clamped run stays inside)
        if ext is not None and (ext.op is not Ops.CONST or ext.arg % 16):
            return None
        if not _vector_aligned(_f8_load(s).src[1], along, 16):
            return None
    plan.tile = tile
    plan.units = {loads["A"]: "A", loads["B"]: "B"}
    plan.fast = {_f8_load(s): plan.fast.get(s, "k") for s in f.src}
    plan.mma_operands = tuple(f.src)
    return plan


def choose_f8_tile(ast: UOp, caps: Capabilities, scan: KernelScan | None) -> tuple[tuple[int, int, int, int, int], int] | None:
    """The heuristic (tile, stages) of a float8 contraction the warpgroup form takes: for constant extents the
    first of 128x256 (4 deep), 128x128 and 64x128 (6 deep) no wider than N rounded up to 64 that makes
    F8_MIN_BLOCKS blocks, else the last of them (over at most 64 columns 128x64, 8 deep); None under 64
    rows or columns or where the kernel takes none."""
    plan = f8_plan(ast, caps, scan, F8_TILE, F8_STAGES, True)
    if plan is None:
        return None
    M, N = plan.i.src[0], plan.j.src[0]
    if M.op is not Ops.CONST or N.op is not Ops.CONST:
        return F8_TILE, F8_STAGES
    if min(M.arg, N.arg) < 64:
        return None
    order = [(F8_TILE, F8_STAGES), (F8_TILE_MID, 6), (F8_TILE_SMALL, 6)]
    order = [(t, s) for t, s in order if t[1] <= -(-N.arg // 64) * 64] or [(F8_TILE_NARROW, 8)]
    for tile, stages in order:
        if -(-M.arg // tile[0]) * -(-N.arg // tile[1]) >= F8_MIN_BLOCKS:
            return tile, stages
    return order[-1]


__all__ = ["F8_CANDIDATES", "F8_DTYPES", "F8_K", "F8_STAGES", "F8_TILE", "F8_TILE_MID", "F8_TILE_NARROW",
           "F8_TILE_SMALL", "choose_f8_tile", "f8_plan", "f8_tile_ok"]
