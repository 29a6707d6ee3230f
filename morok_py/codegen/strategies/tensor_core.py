"""Tensor cores: float16/bfloat16 contractions accumulated in float32 on the GPU's matrix units.

A contraction `out[i, j] = g(SUM_k float32(a[i, k]) * float32(b[k, j]))` whose a and b are float16 or
bfloat16 (the library widens such products to float32, see ir._widen) takes the shared-memory tiling of
codegen/gpu_tile.py with the inner product replaced by warp-wide matrix instructions:

- the block is BM x BN outputs, k walked BK at a time; its (BM / WM) x (BN / WN) warps own WM x WN
  outputs each, as (WM / 16) x (WN / 8) m16n8 float32 accumulator fragments;
- the A and B tiles hold the raw 16-bit inputs, laid out like the operand in global memory: an operand
  contiguous along k (row-major A, B^T) as [m][k] (k contiguous: a 16-byte global load is one 16-byte
  shared store), one contiguous along its rows or columns as [k][m] (gpu_tile's k-major tiles). Rows are
  padded by 8 elements (16 bytes) so that the 8 rows an `ldmatrix` reads hit distinct banks and every row
  address stays 16-byte aligned;
- per 16 k: one `ldmatrix.x4` per 16 rows of A (the m16k16 A fragment), one per 16 columns of B (two
  k16n8 B fragments) -- `.trans` for the k-major tiles -- then one `mma.sync.m16n8k16.row.col.f32` per
  accumulator fragment;
- sizes stay arbitrary (symbolic too): rows and columns past the end are clamped like gpu_tile's, and the
  k tail is filled with zeros past K (an mma step cannot skip single k; 0 * 0 adds nothing).

Staging (NVIDIA; the schedule's `tc_stages`, `tc_swizzle`): where every full tile can be filled by 16-byte
runs -- strides proven multiples of 8, or (symbolic strides) checked at launch by one uniform branch, with
a synchronous scalar-fill loop as the other side -- the tiles go through `tc_stages` shared buffers filled
by `cp.async` copies S tiles ahead (`staged_loop`: one wait_group and one barrier per tile; the loop turns
between a tile's first and second mma step so every warp keeps mma in flight across the barrier). With
`tc_swizzle` the rows are unpadded and each 16-byte chunk c of row r sits at c ^ ((r // g) % min(C, 8))
(C chunks a row, g = max(1, 8 // C)): the 8 rows of an ldmatrix and 8 consecutive 16-byte stores hit 8
distinct bank groups. Shared memory past the static 48 KiB comes from the dynamic opt-in (the CUDA
renderers and runtime; TC_DYN_SMEM). Elsewhere: gpu_tile's register-staged double buffer with 16-byte
global loads where the strides prove alignment, padded rows.

`MMA_M16N8K16` is the NVIDIA shape (sm_80 and later: PTX mma.sync, in CUDA C as inline PTX and in NVPTX
LLVM IR as llvm.nvvm.ldmatrix / llvm.nvvm.mma intrinsics). The epilogue (g, guarded stores) and the
launch check are gpu_tile's.
"""
from __future__ import annotations


from ...dtypes import dtypes
from ...ir import AxisType, Ops, UOp
from ..capabilities import Capabilities
from ..gpu_tile import SMEM_LIMIT, _Builder, _Pass, _plan, _terms, _Tile, _vector_aligned
from ..linear import If, Instr, Item, L, Loop
from ..scan import KernelScan

MMA_M16N8K16 = "mma_m16n8k16"          # NVIDIA sm_80+: mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}
MFMA_32X32X8 = "mfma_32x32x8"          # AMD gfx90a/gfx942 (wave64): v_mfma_f32_32x32x8{f16,bf16_1k}
WMMA_16X16X16 = "wmma_16x16x16"        # AMD gfx11 (wave32): v_wmma_f32_16x16x16_{f16,bf16}
WGMMA = "wgmma_m64k16"                 # NVIDIA sm_90a: wgmma.mma_async.m64nNk16.f32 (strategies/wgmma.py)
# per instruction: (wave size, rows of A per fragment, columns of B per fragment load, k per instruction)
MMAS = {MMA_M16N8K16: (32, 16, 16, 16), MFMA_32X32X8: (64, 32, 32, 8), WMMA_16X16X16: (32, 16, 16, 16),
        WGMMA: (128, 64, 8, 16)}
TC_PAD = 8                             # elements added to each tile row: 16 bytes (see the module doc)
TC_TILE = (128, 128, 64, 64, 64)       # (BM, BN, BK, WM, WN): 4 warps of 64x64 outputs (NVIDIA, staged)
TC_TILE_STATIC = (128, 128, 32, 64, 32)  # 8 warps of 64x32: the register-staged tile (no cp.async fills)
TC_STAGES = 4                          # NVIDIA: shared-memory stages of the cp.async pipeline (0: register-
                                       # staged double buffering, the only form where 16-byte fills are unproven)
TC_SWIZZLE = True                      # NVIDIA: XOR-swizzled 16-byte chunks instead of padded rows
TC_DYN_SMEM = 96 << 10                 # NVIDIA sm_80+: shared memory a group may take with the dynamic opt-in
                                       # (sm_86/sm_89 allow 99 KiB, sm_80 163 KiB, sm_90 227 KiB)
TC_SMALL_TILE = (64, 64, 32, 32, 32)   # 4 warps of 32x32: more blocks for small problems
# NVIDIA mma.sync tiles fitted to the columns (N), measured on an H200 (benchmarks/conv.py --variants, batch 32,
# NVRTC, benchmarks/results/nvidia-h200/conv-variants-nvrtc.json: implicit-GEMM convolutions, whose pixel rows
# are gathered, so register-staged): a 128-wide block over N <= TC_NARROW_N columns computes half its outputs
# past the end. float16 3x3 64 -> 64 channels at 56x56 (N 64): TC_SMALL_TILE 60.6 TFLOP/s against 50.1 for
# TC_TILE_STATIC (128x64 blocks 57.9); 1x1 256 -> 64 at 56x56: 77.9 against 65.3. Up to TC_WIDE_N columns
# the register-staged 128x128 block takes 4 warps of 64x64 (TC_TILE_STATIC_WIDE) once it makes
# TC_STATIC_WIDE_MIN_BLOCKS blocks: 3x3 128 -> 128 at 28x28 (196 blocks) 76.5 against 63.7 for TC_SMALL_TILE,
# stride 2 at 56x56 55.2 against 52.6; over more columns where the blocks are fewer than the 264 of the 64x32
# warps' tile: 1x1 1024 -> 256 at 14x14 (98 blocks) 101.4 against 93.7 for TC_SMALL_TILE on an H100
# (nvidia-h100/conv-nvrtc.json), 98.2 against 95.5 on the H200
TC_NARROW_N = 64
# a masked operand (direct_masked: the padding read by masked fills, one tap per k tile) over at most TC_NARROW_N
# columns: 128x64 blocks of 64x32 warps, 100.1 TFLOP/s against 94.0 for TC_SMALL_TILE (float16 3x3 64 -> 64
# channels at 56x56, batch 32, on an H100: benchmarks/results/nvidia-h100/conv-variants-nvrtc.json)
TC_MASKED_NARROW_TILE = (128, 64, 32, 64, 32)
TC_WIDE_N = 128
TC_TILE_STATIC_WIDE = (128, 128, 32, 64, 64)
TC_STATIC_WIDE_MIN_BLOCKS = 96
TC_TILE_MFMA = (128, 128, 32, 64, 64)  # 4 waves of 64 lanes, 2x2 32x32 fragments each
TC_TILE_CANDIDATES = [TC_TILE, (128, 256, 64, 64, 64), (128, 128, 32, 64, 64), (128, 256, 32, 64, 64), TC_TILE_STATIC,
                      TC_SMALL_TILE, (256, 128, 32, 64, 64), (128, 64, 32, 64, 32), (64, 128, 32, 32, 64),
                      (64, 64, 64, 32, 32), (128, 128, 16, 64, 32), (64, 64, 32, 32, 16)]   # what a search times
TC_PIPELINES = [(4, True), (3, True), (2, True), (0, True), (0, False), (3, False)]   # (stages, swizzle) searched
TC_DTYPES = ("float16", "bfloat16")


def _raw_load(unit: UOp) -> UOp | None:
    """The 16-bit operand under a staged unit float32(x) (or x itself): a load, or a masked load
    where(mask, load, 0) whose mask reads no memory (a convolution's zero padding, kernels.conv2d): its
    tiles are filled element by element, the mask applied in the fill."""
    if unit.op is Ops.CAST and unit.dtype == dtypes.float32:
        unit = unit.src[0]
    if unit.dtype.name not in TC_DTYPES:
        return None
    if unit.op is Ops.LOAD:
        return unit
    if unit.op is Ops.WHERE and _masked_load(unit):
        return unit
    return None


def _masked_load(unit: UOp) -> bool:
    """where(mask, load, 0) with a mask that loads nothing."""
    cond, val, zero = unit.src
    return (val.op is Ops.LOAD and zero.op is Ops.CONST and zero.arg == 0
            and not any(n.op is Ops.LOAD for n in cond.toposort()))


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def tc_smem_bytes(tile: tuple[int, int, int, int, int], stages: int = 0, swizzle: bool = False) -> int:
    """Shared memory of the A and B tiles: `stages` buffers (0: two, register-staged) of 2-byte elements,
    rows padded by TC_PAD elements unless swizzled (the larger of the two layouts)."""
    BM, BN, BK = tile[:3]
    pad = 0 if swizzle else TC_PAD
    per = sum(max(BK * (W + pad), W * (BK + pad)) for W in (BM, BN))
    return max(2, stages) * per * 2


def valid_tc_tile(tile: tuple[int, int, int, int, int], caps: Capabilities, mma: str | None = None,
                  stages: int = 0, swizzle: bool = False) -> bool:
    mma = mma or caps.tensor_cores[0]
    BM, BN, BK, WM, WN = tile
    _, fm, fn, _ = MMAS[mma]
    if min(tile) < 1 or BM % WM or BN % WN or WM % fm or WN % fn or BK % 16:
        return False
    if mma == WGMMA:
        return wg_tile_ok(tile, stages, swizzle, min(caps.max_threads_per_group, caps.local_max[0]))
    if (stages or swizzle) and mma != MMA_M16N8K16:
        return False                   # cp.async and the swizzled ldmatrix layout are NVIDIA's
    if stages == 1 or stages < 0 or (swizzle and not all(_pow2(x) for x in (BM, BN, BK))):
        return False
    # more than the static 48 KiB only through the dynamic opt-in (the CUDA renderers, the staged form)
    limit = TC_DYN_SMEM if stages and mma == MMA_M16N8K16 else SMEM_LIMIT
    if tc_smem_bytes(tile, stages, swizzle) > limit:
        return False
    return tc_threads(tile, mma) <= min(caps.max_threads_per_group, caps.local_max[0])


WG_K = 64                       # wgmma: k per tile, one 128-byte row of 16-bit elements (the swizzle's row)
WG_ROWS = 64                    # wgmma: rows of A per warpgroup instruction (m64)
WG_SMEM = 227 << 10             # sm_90 dynamic shared memory a block may opt into
WG_PRODUCER = 128               # wgmma: the producer warpgroup's work-items (fills the tiles, strategies/wgmma.py)
WG_BARS = 1024                  # wgmma: the stages' mbarriers, one more 1024-byte-aligned shared array


def wg_tile_ok(tile: tuple[int, int, int, int, int], stages: int, swizzle: bool, threads_max: int) -> bool:
    """Whether the warpgroup form (strategies/wgmma.py) takes this tile: 64-row warpgroups spanning the
    block's columns (a multiple of 64, at most 256), k tiles of 64, at least 3 swizzled buffers within
    WG_SMEM."""
    BM, BN, BK, WM, WN = tile
    if BK != WG_K or WM != WG_ROWS or WN != BN or BM % WG_ROWS or BN % 64 or not 64 <= BN <= 256:
        return False
    if not swizzle or stages < 3 or stages * (BM + BN) * BK * 2 + WG_BARS > WG_SMEM:
        return False
    return (BM // WG_ROWS) * 128 + WG_PRODUCER <= threads_max


def tc_threads(tile: tuple[int, int, int, int, int], mma: str) -> int:
    """Work-items of a tile: its warps (BM / WM) x (BN / WN) times the instruction's wave size (wgmma: and
    the producer warpgroup)."""
    BM, BN, _, WM, WN = tile
    return (BM // WM) * (BN // WN) * MMAS[mma][0] + (WG_PRODUCER if mma == WGMMA else 0)


def product_loads(plan, narrow) -> "dict[str, UOp] | None":
    """{"A": load, "B": load}: `narrow` of each factor where gpu_tile's `plan` reduces a float32 sum of
    products of one A unit and one B unit (the tensor-core forms' operands); None otherwise."""
    red, f = plan.red, plan.red.src[0]
    if red.arg is not Ops.ADD or red.dtype != dtypes.float32 or f.op is not Ops.MUL:
        return None
    if sorted(plan.units.get(s) or "" for s in f.src) != ["A", "B"] or len(plan.units) != 2:
        return None
    loads = {plan.units[s]: narrow(s) for s in f.src}
    return None if any(v is None for v in loads.values()) else loads


def tc_plan(ast: UOp, caps: Capabilities, scan: KernelScan | None, tile: tuple[int, int, int, int, int],
            stages: int = 0, swizzle: bool = False, mma: str | None = None):
    """gpu_tile's plan, its units narrowed to the raw 16-bit loads, when the kernel is a plain float32 sum of
    products of two float16 (or two bfloat16) operands and `mma` (default: the target's first) takes the
    tile; else None. The warpgroup form (WGMMA) also needs 16-byte fills of both operands (staged_fills)."""
    if not caps.tensor_cores or not caps.has_shared or (mma is not None and mma not in caps.tensor_cores):
        return None
    if not valid_tc_tile(tile, caps, mma, stages, swizzle):
        return None
    BM, BN, BK, WM, WN = tile
    # gpu_tile's recognition with a tile it accepts (one work-item per warp: same block, same k depth)
    plan = _plan(ast, caps, scan, (BM, BN, BK, WM, WN))
    if plan is None:
        return None
    loads = product_loads(plan, _raw_load)
    if loads is None or loads["A"].dtype != loads["B"].dtype:
        return None
    f = plan.red.src[0]
    plan.tile = tile
    plan.units = {loads["A"]: "A", loads["B"]: "B"}
    plan.fast = {u: plan.fast.get(s, "k") for s in f.src for u in (_raw_load(s),)}
    plan.mma_operands = tuple(f.src)      # the float32(...) units the product is formed of
    if mma == WGMMA and not staged_fills(plan):
        return None
    return plan


def tc_pipeline(caps: Capabilities, tile: tuple[int, int, int, int, int], ast: UOp | None = None,
                scan: KernelScan | None = None) -> tuple[int, bool]:
    """The heuristic (stages, swizzle) of a tile: NVIDIA's cp.async pipeline TC_STAGES deep (fewer where the
    shared memory would not hold them), swizzled; a kernel (`ast`) whose fills cannot be 16-byte copies
    and AMD: (0, False), the register-staged padded tiles (swizzled scalar fills would each hold an
    address register)."""
    if not caps.tensor_cores or caps.tensor_cores[0] != MMA_M16N8K16:
        return 0, False
    if ast is not None:
        plan = next((pl for st in range(TC_STAGES, 1, -1) for pl in (tc_plan(ast, caps, scan, tile, st, TC_SWIZZLE),)
                     if pl is not None), None)
        if plan is None or not staged_fills(plan):
            return 0, False
    for stages in range(TC_STAGES, 1, -1):
        if valid_tc_tile(tile, caps, None, stages, TC_SWIZZLE):
            return stages, TC_SWIZZLE
    return 0, TC_SWIZZLE and valid_tc_tile(tile, caps, None, 0, True)


def choose_tc_tile(ast: UOp, caps: Capabilities, scan: KernelScan | None) -> tuple[int, int, int, int, int] | None:
    """The heuristic tensor-core tile: NVIDIA 128x128 blocks of 4 64x64 warps (staged by cp.async: see
    `staged_fills`; 128x128 of 64x32 warps where the fills cannot be); for constant extents 64x64 over at
    most TC_NARROW_N columns, register-staged 128x128 of 64x64 warps (TC_TILE_STATIC_WIDE) where they make
    TC_STATIC_WIDE_MIN_BLOCKS blocks over at most TC_WIDE_N columns (over more: up to 264 blocks), else 64x64
    where 128x128 blocks would leave fewer than 2 per SM (about 264 blocks on an H100); None when the kernel
    cannot take one (a masked operand over at most TC_NARROW_N columns: TC_MASKED_NARROW_TILE). MFMA's 32x32
    fragments: 64x64 per wave (4 waves of 64)."""
    mfma = caps.tensor_cores and caps.tensor_cores[0] != MMA_M16N8K16
    big = TC_TILE_MFMA if caps.tensor_cores and caps.tensor_cores[0] == MFMA_32X32X8 else TC_TILE
    if mfma and big == TC_TILE:
        big = TC_TILE_STATIC
    plan = tc_plan(ast, caps, scan, big, *tc_pipeline(caps, big))
    if plan is None:
        return None
    M, N = plan.i.src[0], plan.j.src[0]
    if M.op is Ops.CONST and N.op is Ops.CONST:
        if min(M.arg, N.arg) < 16:
            return None          # too small for a 16-row fragment to pay: the general path
        small = tc_plan(ast, caps, scan, TC_SMALL_TILE) is not None
        blocks = -(-M.arg // 128) * -(-N.arg // 128)
        if not mfma and N.arg <= TC_NARROW_N and small:
            if (any(u.op is Ops.WHERE for u in plan.units)
                    and tc_plan(ast, caps, scan, TC_MASKED_NARROW_TILE) is not None):
                return TC_MASKED_NARROW_TILE    # a masked operand's fill: 128 rows a block
            return TC_SMALL_TILE                # a 128-wide block would compute half its columns past N
        if (not mfma and big == TC_TILE and (N.arg <= TC_WIDE_N or blocks < 264)
                and blocks >= TC_STATIC_WIDE_MIN_BLOCKS and not staged_fills(plan)
                and tc_plan(ast, caps, scan, TC_TILE_STATIC_WIDE) is not None):
            return TC_TILE_STATIC_WIDE
        if blocks < 264 and small:
            return TC_SMALL_TILE
    if big == TC_TILE and not staged_fills(plan):
        return TC_TILE_STATIC    # register-staged fills: 64x64 warps would spill under their registers
    return big


def launch_alignment(plan, unit: UOp, kind: str, width: int, BK: int) -> list[UOp] | None:
    """The launch-time sizes (range-free UOps) that must be multiples of 8 for 8-element (16-byte) fills of
    `unit`'s full tiles: every stride but the contiguous range's, the offset, and for a fill along rows or
    columns their extent (a clamped run of 8 must stay inside); None when no sizes make them aligned."""
    from ..symbolic import simplify
    if unit.op is not Ops.LOAD:
        return None          # a masked load: element by element
    fast = plan.fast.get(unit, "k")
    along = plan.k if fast == "k" else plan.i if kind == "A" else plan.j
    if (fast == "k" and BK % 8) or (fast != "k" and width % 8):
        return None
    form = _terms(unit.src[1])
    if form is None or along not in form:
        return None
    lead = simplify(form[along])
    if lead.op is not Ops.CONST or lead.arg != 1:
        return None
    conds: list[UOp] = []
    extra = [(None, along.src[0])] if fast != "k" else []
    for k, v in list(form.items()) + extra:
        if k is along:
            continue
        v = simplify(v)
        if v.op is Ops.CONST:
            if int(v.arg) % 8:
                return None
        elif all(v is not c for c in conds):
            conds.append(v)
    return conds


def staged_fills(plan) -> bool:
    """Whether full tiles of both operands can be filled by 16-byte copies (cp.async): constant strides
    that keep 8-element runs aligned, as _MMABuilder.fill_vector decides."""
    BK = plan.tile[2]
    for u, kind in plan.units.items():
        if u.op is not Ops.LOAD:
            return False     # a masked load (zero padding): no 16-byte copies
        fast = plan.fast.get(u, "k")
        rng = plan.k if fast == "k" else plan.i if kind == "A" else plan.j
        width = plan.tile[0] if kind == "A" else plan.tile[1]
        if fast == "k":
            if BK % 8:
                return False
        elif width % 8 or (rng.src[0].op is Ops.CONST and rng.src[0].arg % 8):
            return False
        if not _vector_aligned(u.src[1], rng, 8) and not launch_alignment(plan, u, kind, width, BK):
            return False
    return True


class _MMABuilder(_Builder):
    """gpu_tile's kernel skeleton (clamped fills, double buffering, epilogue, launch check) around warp
    matrix instructions. NVIDIA mma.sync: accumulator (r, c) of a work-item is fragment (r // 2, c // 2)'s
    register 2 * (r % 2) + c % 2: row first_A + offs_A[r], column first_B + offs_B[c] (PTX's m16n8 C
    layout). Subclasses replace `fragments` and `mma_step` for other instructions."""

    mma = MMA_M16N8K16

    def __init__(self, ast: UOp, caps: Capabilities, name: str, plan, stages: int = 0, swizzle: bool = False) -> None:
        super().__init__(ast, caps, name, plan)
        self.stages, self.swizzle = stages, swizzle

    def build(self):
        p = self.p
        BM, BN, BK, WM, WN = p.tile
        self.WM, self.WN = WM, WN
        warps_n = BN // WN
        self.T, self.BK = tc_threads(p.tile, self.mma), BK
        WARP = MMAS[self.mma][0]
        self.plain = True
        body: list[Item] = []
        top = body
        gx, gy, tid, M, N, K = self.grid_prologue(p, top)
        self.tid = tid
        warp = self.op(top, Ops.IDIV, tid, self.c(WARP))
        lane = self.op(top, Ops.MOD, tid, self.c(WARP))
        wm0 = self.op(top, Ops.MUL, self.op(top, Ops.IDIV, warp, self.c(warps_n)), self.c(WM))
        wn0 = self.op(top, Ops.MUL, self.op(top, Ops.MOD, warp, self.c(warps_n)), self.c(WN))
        row0 = self.op(top, Ops.MUL, gy, self.c(BM))
        col0 = self.op(top, Ops.MUL, gx, self.c(BN))
        rem_m = self.op(top, Ops.SUB, M, row0)
        rem_n = self.op(top, Ops.SUB, N, col0)
        self.side = {"A": (row0, rem_m, self.op(top, Ops.SUB, rem_m, self.c(1))),
                     "B": (col0, rem_n, self.op(top, Ops.SUB, rem_n, self.c(1)))}
        self.tiles = [self.tile(u, kind, BM if kind == "A" else BN, tid, top) for u, kind in p.units.items()]
        self.tiles.sort(key=lambda t: t.kind)
        self.db = True
        # the cp.async pipeline where every full tile is filled by 16-byte runs (proven, or `conds` at launch);
        # else register staging
        self.staged = self.stages >= 2 and all(t.vpasses for t in self.tiles)
        conds = list({id(c): c for t in self.tiles for c in t.vcond}.values()) if self.staged else []
        if not self.staged:
            for t in self.tiles:
                t.vpasses = [] if t.vcond else t.vpasses
                t.passes = t.make_passes(top)
        for t in self.tiles:
            t.smem.arg = (self.stages if self.staged else 2) * t.size
            # swizzled places: the 16-byte passes here; scalar ones here only where the main loop fills
            # with them, else in the tail (fill_zero_padded), where they are not live across the loop
            t.swizzled_passes = self.swizzle and not self.staged and not t.vpasses
            if self.swizzle:
                for ps in t.vpasses + (t.passes if t.swizzled_passes else []):
                    ps.sidx = self.swizzled(t, ps.sidx, top)
        self.fragments(top, lane, wm0, wn0)

        zero = self.c(0)
        has_k = If(self.op(top, Ops.CMPLT, zero, K))
        top.append(has_k)
        work = has_k.body
        if self.staged and conds:
            # symbolic strides: the pipeline when every size it needs is a multiple of 8 (a uniform branch),
            # else a synchronous loop of scalar fills
            bits = None
            memo: dict[UOp, Instr] = {}
            for cnd in conds:
                b = self.op(work, Ops.AND, self.expr(cnd, dict(self.bind), work, memo), self.c(7))
                bits = b if bits is None else self.op(work, Ops.OR, bits, b)
            fast = If(self.new(L.ALU, dtypes.bool, (bits, zero), Ops.CMPEQ))
            slow = If(self.op(work, Ops.CMPLT, zero, bits))
            work += [fast.cond, fast, slow]
            self.staged_loop(fast.body, K)
            self.sync_loop(slow.body, K)
        elif self.staged:
            self.staged_loop(work, K)
        else:
            self.main_loop(work, K)
        self.epilogue(top)
        kernel, info = self.finish(body)
        # occupancy hint: two groups per SM (gpu_tile's, 128 registers for 256 items) while a work-item's
        # accumulators leave room for its fragments; 64x64 warp tiles (128 accumulators) take 255
        accs = sum(len(r) for r in self.accs)
        kernel.min_groups = 2 if accs <= 64 and self.T * 2 <= 1024 else 1
        return kernel, info

    # the swizzled layout: a tile row of C 16-byte chunks keeps chunk c at c ^ ((row // g) % min(C, 8)),
    # g = max(1, 8 // C): the 8 rows an ldmatrix reads (and 8 consecutive 16-byte stores) fall in 8
    # distinct 16-byte bank groups. Rows 8 apart share the pattern, so row offsets of 8 keep it.
    def swz_consts(self, t: _Tile) -> tuple[int, int]:
        C = t.ld // 8
        return max(1, 8 // C), min(C, 8)

    def swz_term(self, t: _Tile, row: Instr, out: list[Item]) -> Instr:
        g, m = self.swz_consts(t)
        r = self.op(out, Ops.IDIV, row, self.c(g)) if g > 1 else row
        return self.op(out, Ops.MOD, r, self.c(m))

    def swz_col(self, t: _Tile, col: Instr, term: Instr | None, out: list[Item]) -> Instr:
        """Column `col` (a multiple of 8) of a row with swizzle term `term` (None: unswizzled)."""
        if term is None:
            return col
        chunk = self.op(out, Ops.IDIV, col, self.c(8))
        return self.op(out, Ops.MUL, self.op(out, Ops.XOR, chunk, term), self.c(8))

    def swizzled(self, t: _Tile, sidx: Instr, out: list[Item]) -> Instr:
        """The swizzled place of element `sidx` (row * ld + column) of a buffer."""
        row = self.op(out, Ops.IDIV, sidx, self.c(t.ld))
        col = self.op(out, Ops.MOD, sidx, self.c(t.ld))
        c8 = self.op(out, Ops.SUB, col, self.op(out, Ops.MOD, col, self.c(8)))
        moved = self.swz_col(t, c8, self.swz_term(t, row, out), out)
        return self.op(out, Ops.ADD, sidx, self.op(out, Ops.SUB, moved, c8))

    def fragments(self, top: list[Item], lane: Instr, wm0: Instr, wn0: Instr) -> None:
        """The lane's fragment addresses, its accumulators and the epilogue's view of them."""
        WM, WN = self.WM, self.WN
        # the lane's row address of each ldmatrix.x4.trans (matrix q = lane // 8, its row r = lane % 8):
        # A (m16 x k16): q -> (k + 8 * (q // 2), m + 8 * (q % 2)); B (k16 x n16): q -> (k + 8 * (q % 2), n + 8 * (q // 2))
        q, r = self.op(top, Ops.IDIV, lane, self.c(8)), self.op(top, Ops.MOD, lane, self.c(8))
        q_lo, q_hi = self.op(top, Ops.MOD, q, self.c(2)), self.op(top, Ops.IDIV, q, self.c(2))
        # [w][k] tiles (no .trans): A q -> (m + 8 * (q % 2), k + 8 * (q // 2)); B q -> (n + 8 * (q // 2), k + 8 * (q % 2))
        # the lane's address per ldmatrix: lm_at[kind][j] + a constant, j the 16-k step along a [w][k] row
        # (16 more rows: + 16 ld) or the 16-wide column block of a k-major row (16 more k: + 16 ld)
        self.lm_at = {}
        for t in self.tiles:
            k_sel, w_sel, w0 = (q_hi, q_lo, wm0) if t.kind == "A" else (q_lo, q_hi, wn0)
            k8 = self.op(top, Ops.MUL, k_sel, self.c(8))
            w8 = self.op(top, Ops.ADD, self.op(top, Ops.MUL, w_sel, self.c(8)), w0)
            row, col = (self.op(top, Ops.ADD, k8, r), w8) if t.kmajor else (self.op(top, Ops.ADD, w8, r), k8)
            rowb = self.op(top, Ops.MUL, row, self.c(t.ld))
            term = self.swz_term(t, row, top) if self.swizzle else None
            n = ((self.WM if t.kind == "A" else self.WN) if t.kmajor else self.BK) // 16
            self.lm_at[t.kind] = [self.op(top, Ops.ADD, rowb, self.swz_col(t, self.op(top, Ops.ADD, col, self.c(16 * j))
                                                                            if j else col, term, top))
                                  for j in range(n)]
        # accumulators and the epilogue's view of them (PTX m16n8 C fragment: row lane / 4 (+8),
        # columns 2 * (lane % 4) + {0, 1})
        TM, TN = 2 * (WM // 16), 2 * (WN // 8)
        self.accs = [[self.new(L.ACC, dtypes.float32, (), 0.0) for _ in range(TN)] for _ in range(TM)]
        top.extend(a for row in self.accs for a in row)
        self.offs = {"A": [16 * (rr // 2) + 8 * (rr % 2) for rr in range(TM)],
                     "B": [8 * (cc // 2) + cc % 2 for cc in range(TN)]}
        self.first = {"A": self.op(top, Ops.ADD, wm0, self.op(top, Ops.IDIV, lane, self.c(4))),
                      "B": self.op(top, Ops.ADD, wn0, self.op(top, Ops.MUL, self.op(top, Ops.MOD, lane, self.c(4)),
                                                                   self.c(2)))}

    def main_loop(self, work: list[Item], K: Instr) -> None:
        """Full tiles double-buffered, then the zero-padded k tail."""
        p, BK, zero = self.p, self.BK, self.c(0)
        KS = MMAS[self.mma][3]
        k_full = self.op(work, Ops.SUB, K, self.op(work, Ops.MOD, K, self.c(BK)))
        main = Loop(self.new(L.LOOPVAR, dtypes.index), zero, k_full, AxisType.REDUCE, step=self.c(BK))
        from ..launch_check import SteppedLoop
        Ke = p.k.src[0]
        self.stepped = [SteppedLoop(Ke - Ke % BK, UOp.const(BK, dtypes.index), UOp.const(0, dtypes.index))]
        # double-buffered full tiles, as gpu_tile: buffer (k0 / BK) % 2 is read while the next tile loads
        first = If(self.op(work, Ops.CMPLT, zero, k_full))
        work.append(first)
        par = self.new(L.ACC, dtypes.index, (), 0)
        work.append(par)
        for t in self.tiles:
            self.fill(t, t.vpasses or t.passes, zero, None, None, first.body, first.body)
        first.body.append(self.new(L.BARRIER, None))
        work.append(main)
        lb = main.body
        kn = self.op(lb, Ops.MIN, self.op(lb, Ops.ADD, main.var, self.c(BK)), self.op(lb, Ops.SUB, k_full, self.c(BK)))
        now = self.new(L.ACC_LOAD, dtypes.index, (par,))
        lb.append(now)
        later: list[Item] = []
        rd: dict[str, Instr] = {}
        for t in self.tiles:
            rd[t.kind] = self.op(lb, Ops.MUL, now, self.c(t.size))
            wr = self.op(later, Ops.SUB, self.c(t.size), rd[t.kind])
            self.fill(t, t.vpasses or t.passes, kn, None, wr, lb, later)
        self.mma_steps(lb, rd, BK // KS)
        lb.extend(later)
        lb.append(self.new(L.ACC_STORE, None, (par, self.op(lb, Ops.SUB, self.c(1), now))))
        lb.append(self.new(L.BARRIER, None))
        # the k tail: k_rem < BK valid rows, the rest of the tile zero; ceil(k_rem / 16) mma steps
        tail = If(self.op(work, Ops.CMPLT, k_full, K))
        work.append(tail)
        k_rem = self.op(tail.body, Ops.SUB, K, k_full)
        for t in self.tiles:
            self.fill_zero_padded(t, k_full, k_rem, tail.body)
        tail.body.append(self.new(L.BARRIER, None))
        self.tail_steps(tail.body, k_rem)

    def tail_steps(self, out: list[Item], k_rem: Instr) -> None:
        """The ceil(k_rem / KS) steps of the zero-padded tail tile in buffer 0: each step under a uniform guard."""
        KS = MMAS[self.mma][3]
        for s in range(self.BK // KS):
            g = If(self.op(out, Ops.CMPLT, self.c(s * KS), k_rem)) if s else None
            if g is not None:
                out.append(g)
            self.mma_step(g.body if g is not None else out, {t.kind: None for t in self.tiles}, self.c(s))

    def staged_loop(self, work: list[Item], K: Instr) -> None:
        """Full tiles through a cp.async pipeline of S = `stages` shared buffers, then the zero-padded k tail.
        Tile t lives in buffer t % S; f(t, s) are the warp's fragments of its 16-k step s (ldmatrix), of
        `steps` per tile:

            issue tiles 0 .. S-1 (one group each, committed even when empty); wait for tile 0; barrier
            f(0, 0); mma f(0, 0)
            for tile t:  f(t, 1 .. steps-1), each mma'd after the next one's ldmatrix is issued
                         wait for tile t+1 (S-2 younger groups may be in flight); barrier (tile t+1
                         visible, and every warp done reading buffer t % S)
                         issue tile t+S into buffer t % S; commit
                         f(t+1, 0) (buffer t % S on the last tile: read, never used); mma f(t, steps-1)
                         mma f(t+1, 0) unless t is the last tile
            wait for every group; barrier (the tail refills buffer 0)

        The loop turns between the first and second mma step of a tile, so each warp has a step of mma in
        flight while it waits at the barrier and while the next tile's first fragments load; the global
        loads stay in flight under S-1 tiles of mma and take no registers."""
        BK, S, zero = self.BK, self.stages, self.c(0)
        steps = BK // MMAS[self.mma][3]
        k_full, fb = self.pipeline_prologue(work, K, S)
        fb += [self.new(L.CP_WAIT, None, (), S - 1), self.new(L.BARRIER, None)]
        self.mma_issue(fb, self.mma_frags(fb, {}, self.c(0)))
        main = Loop(self.new(L.LOOPVAR, dtypes.index), zero, k_full, AxisType.REDUCE, step=self.c(BK))
        fb.append(main)
        lb = main.body
        t_now = self.op(lb, Ops.IDIV, main.var, self.c(BK))
        stage = self.op(lb, Ops.MOD, t_now, self.c(S))
        rd = {t.kind: self.op(lb, Ops.MUL, stage, self.c(t.size)) for t in self.tiles}
        cur = None
        for s in range(1, steps):
            nxt = self.mma_frags(lb, rd, self.c(s))
            if cur is not None:
                self.mma_issue(lb, cur)
            cur = nxt
        lb += [self.new(L.CP_WAIT, None, (), S - 2), self.new(L.BARRIER, None)]
        kp = self.op(lb, Ops.ADD, main.var, self.c(S * BK))
        g = If(self.op(lb, Ops.CMPLT, kp, k_full))
        lb.append(g)
        self.fill_async(g.body, kp, stage)
        lb.append(self.new(L.CP_COMMIT, None))
        k_next = self.op(lb, Ops.ADD, main.var, self.c(BK))
        more = self.op(lb, Ops.CMPLT, k_next, k_full)
        nstage = self.op(lb, Ops.MOD, self.op(lb, Ops.ADD, t_now, self.c(1)), self.c(S))
        nstage = self.new(L.ALU, dtypes.index, (more, nstage, stage), Ops.WHERE)
        lb.append(nstage)
        nrd = {t.kind: self.op(lb, Ops.MUL, nstage, self.c(t.size)) for t in self.tiles}
        first = self.mma_frags(lb, nrd, self.c(0))
        if cur is not None:
            self.mma_issue(lb, cur)
        g2 = If(more)
        lb.append(g2)
        self.mma_issue(g2.body, first)
        fb += [self.new(L.CP_WAIT, None, (), 0), self.new(L.BARRIER, None)]
        self.padded_tail(work, K, k_full)

    def pipeline_prologue(self, work: list[Item], K: Instr, ahead: int) -> tuple[Instr, list[Item]]:
        """(k_full, the block that runs when there is a full tile): K rounded down to whole tiles, the
        launch check's stepped k loop, and the cp.async of tiles 0 .. ahead-1 into buffers 0 .. ahead-1,
        one committed group each (committed even when the tile does not exist)."""
        BK = self.BK
        k_full = self.op(work, Ops.SUB, K, self.op(work, Ops.MOD, K, self.c(BK)))
        from ..launch_check import SteppedLoop
        Ke = self.p.k.src[0]
        self.stepped = [SteppedLoop(Ke - Ke % BK, UOp.const(BK, dtypes.index), UOp.const(0, dtypes.index))]
        full = If(self.op(work, Ops.CMPLT, self.c(0), k_full))
        work.append(full)
        fb = full.body
        for s in range(ahead):
            blk = fb
            if s:
                g = If(self.op(fb, Ops.CMPLT, self.c(s * BK), k_full))
                fb.append(g)
                blk = g.body
            self.fill_async(blk, self.c(s * BK), s)
            fb.append(self.new(L.CP_COMMIT, None))
        return k_full, fb

    def padded_tail(self, work: list[Item], K: Instr, k_full: Instr) -> None:
        """The last k_rem = K - k_full < BK rows of k, zero-padded into buffer 0 (scalar passes made here)."""
        tail = If(self.op(work, Ops.CMPLT, k_full, K))
        work.append(tail)
        self.scalar_passes_in(tail.body)
        k_rem = self.op(tail.body, Ops.SUB, K, k_full)
        for t in self.tiles:
            self.fill_zero_padded(t, k_full, k_rem, tail.body)
        tail.body += self.stores_visible()
        self.tail_steps(tail.body, k_rem)

    def stores_visible(self) -> list[Item]:
        """What makes this block's shared stores visible to the matrix instructions of every warp: a barrier
        (the warpgroup form puts the proxy fence before it)."""
        return [self.new(L.BARRIER, None)]

    def full_tile_steps(self, out: list[Item]) -> None:
        """The matrix instructions of a whole tile in buffer 0 (the synchronous loop)."""
        self.mma_steps(out, {}, self.BK // MMAS[self.mma][3])

    def sync_loop(self, work: list[Item], K: Instr) -> None:
        """The fallback of a pipelined kernel whose sizes are not 16-byte aligned at launch: each full tile
        filled by scalar loads (no registers held across the mma), barrier, mma, barrier; then the tail."""
        BK = self.BK
        k_full = self.op(work, Ops.SUB, K, self.op(work, Ops.MOD, K, self.c(BK)))
        main = Loop(self.new(L.LOOPVAR, dtypes.index), self.c(0), k_full, AxisType.REDUCE, step=self.c(BK))
        work.append(main)
        lb = main.body
        for t in self.tiles:
            self.fill_loop(t, main.var, lb)
        lb += self.stores_visible()
        self.full_tile_steps(lb)
        lb.append(self.new(L.BARRIER, None))
        self.padded_tail(work, K, k_full)

    def fill_loop(self, t: _Tile, k0: Instr, out: list[Item]) -> None:
        """A full tile at k0 by scalar loads in a run-time loop over the fill passes (element e = tid + pass *
        T: few registers, unlike unrolled passes, whose loads the compilers hoist all at once)."""
        p, BK, T = self.p, self.BK, self.T
        width = self.p.tile[0] if t.kind == "A" else self.p.tile[1]
        units = BK * width
        lp = Loop(self.new(L.LOOPVAR, dtypes.index), self.c(0), self.c(-(-units // T)), AxisType.REDUCE)
        out.append(lp)
        body = lp.body
        tid = self.tid
        e = self.op(body, Ops.ADD, tid, self.op(body, Ops.MUL, lp.var, self.c(T)))
        g = If(self.op(body, Ops.CMPLT, e, self.c(units)))
        body.append(g)
        b = g.body
        per = width if t.kmajor else BK
        inner, outer = self.op(b, Ops.MOD, e, self.c(per)), self.op(b, Ops.IDIV, e, self.c(per))
        lk, lw = (outer, inner) if t.kmajor else (inner, outer)
        sidx = self.op(b, Ops.ADD, self.op(b, Ops.MUL, outer, self.c(t.ld)), inner)
        if self.swizzle:
            sidx = self.swizzled(t, sidx, b)
        env = {**self.bind, p.k: self.op(b, Ops.ADD, k0, lk), (p.i if t.kind == "A" else p.j): self.clamped(b, t.kind, lw)}
        v = self.expr(t.unit, env, b, {})
        b.append(self.new(L.STORE, None, (t.smem, sidx, v)))

    def fill_async(self, out: list[Item], k0: Instr, stage: "int | Instr") -> None:
        """cp.async of the full tiles at k0 .. k0 + BK into buffer `stage`: one 16-byte copy per vector pass."""
        p = self.p
        for t in self.tiles:
            off = (self.c(stage * t.size) if stage else None) if isinstance(stage, int) else \
                self.op(out, Ops.MUL, stage, self.c(t.size))
            for ps in t.vpasses:
                blk = out
                if ps.guard is not None:
                    g = If(ps.guard)
                    out.append(g)
                    blk = g.body
                kc = self.op(blk, Ops.ADD, k0, ps.lk)
                env = {**self.bind, p.k: kc, (p.i if t.kind == "A" else p.j): ps.w}
                memo: dict[UOp, Instr] = {}
                gidx = self.expr(t.unit.src[1], env, blk, memo)
                buf = self.expr(t.unit.src[0], env, blk, memo)
                sidx = self.op(blk, Ops.ADD, ps.sidx, off) if off is not None else ps.sidx
                blk.append(self.new(L.CP_ASYNC, None, (t.smem, sidx, buf, gidx), 16))

    def tile(self, unit: UOp, kind: str, width: int, tid: Instr, top: list[Item]) -> _Tile:
        """A shared tile of the raw 16-bit inputs, [width][BK + TC_PAD] for an operand contiguous along k,
        else [BK][width + TC_PAD], and its fill passes."""
        fast = self.p.fast.get(unit, "k")
        kmajor = fast != "k"
        ld = (width if kmajor else self.BK) + (0 if self.swizzle else TC_PAD)
        size = (self.BK if kmajor else width) * ld
        smem = self.new(L.LOCAL, unit.dtype, (), size)
        top.append(smem)
        t = _Tile(unit, kind, smem, ld, size)
        t.kmajor = kmajor
        fill = self.fill_passes if kmajor else self.fill_passes_along_k
        # scalar passes: made where they are used (build decides: top, or only the blocks that fill with them)
        t.make_passes = lambda out, t=t, width=width, fast=fast: fill(t, width, fast, 1, tid, out)
        t.vcond = []
        if self.fill_vector(t, width, fast) > 1:
            t.vpasses = fill(t, width, fast, 8, tid, top)
        elif self.stages >= 2:
            conds = launch_alignment(self.p, unit, kind, width, self.BK)
            if conds:            # 16-byte fills when these sizes are multiples of 8 at launch
                t.vcond = conds
                t.vpasses = fill(t, width, fast, 8, tid, top)
        return t

    def scalar_passes_in(self, out: list[Item]) -> None:
        """The tiles' scalar fill passes, computed at the start of `out` (the block that fills with them)."""
        for t in self.tiles:
            t.passes = t.make_passes(out)

    def fill_passes_along_k(self, t: _Tile, width: int, fast: str, vec: int, tid: Instr, top: list[Item]) -> list[_Pass]:
        """Fill passes of a [w][k] tile: consecutive work-items take consecutive `vec`-element runs of one
        row along k, so a run is one global load and one shared store (`along` 'w': contiguous in the tile
        row). Items of a last, partial pass load a clamped element and skip the store."""
        BK, T = self.BK, self.T
        per = BK // vec
        units = per * width
        out: list[_Pass] = []
        lw0: Instr | None = None
        for pas in range(-(-units // T)):
            if pas and T % per == 0 and (pas + 1) * T <= units:
                # pass 0 moved down by whole rows: same lk, constant offsets from one base register
                p0, step = out[0], pas * T // per
                sidx = self.op(top, Ops.ADD, p0.sidx, self.c(step * t.ld))
                w = self.clamped(top, t.kind, self.op(top, Ops.ADD, lw0, self.c(step)))
                out.append(_Pass(None, sidx, p0.lk, w, vec, "w"))
                continue
            e = self.op(top, Ops.ADD, tid, self.c(pas * T)) if pas else tid
            guard = None
            if (pas + 1) * T > units:
                guard = self.op(top, Ops.CMPLT, e, self.c(units))
                e = self.op(top, Ops.MIN, e, self.c(units - 1))
            lk = self.op(top, Ops.MOD, e, self.c(per))
            lk = self.op(top, Ops.MUL, lk, self.c(vec)) if vec > 1 else lk
            lw = self.op(top, Ops.IDIV, e, self.c(per))
            lw0 = lw if not pas else lw0
            sidx = self.op(top, Ops.ADD, self.op(top, Ops.MUL, lw, self.c(t.ld)), lk)
            out.append(_Pass(guard, sidx, lk, self.clamped(top, t.kind, lw), vec, "w"))
        return out

    def fill_vector(self, t: _Tile, width: int, fast: str) -> int:
        """8 (16-byte loads) where gpu_tile would allow 4-wide ones of a 4-byte type: aligned constant strides."""
        p, vec = self.p, 8
        if t.unit.op is not Ops.LOAD:
            return 1         # a masked load: element by element
        rng = p.k if fast == "k" else p.i if t.kind == "A" else p.j
        if fast == "k":
            if self.BK % vec:
                return 1
        elif width % vec or rng.src[0].op is not Ops.CONST or rng.src[0].arg % vec:
            return 1
        return vec if _vector_aligned(t.unit.src[1], rng, vec) else 1

    def k_parts(self, unit: UOp, k0: Instr, lk: Instr, out: list[Item], memo: dict) -> dict[UOp, Instr]:
        """The unit's k // D and k % D at k = k0 + lk, for constants D that are multiples of BK: k0 // D and
        k0 % D + lk. Every fill starts at a whole tile (k0 a multiple of BK) and 0 <= lk < BK, so k0 % D + lk
        < D. The quotient (a tap-major convolution's tap, kernels.conv2d) is then one value per tile for all of
        a work-item's elements, and what depends on it and on the row alone (the tap's mask and offset) too,
        instead of a division per element. `memo` keeps k0's quotients and remainders across passes."""
        k, BK = self.p.k, self.BK
        parts: dict[UOp, Instr] = {}
        for n in unit.toposort():
            if (n.op in (Ops.IDIV, Ops.MOD) and n.src[0] is k and n.src[1].op is Ops.CONST
                    and n.src[1].arg > 0 and n.src[1].arg % BK == 0):
                key = (id(k0), n.op, n.src[1].arg)
                if key not in memo:
                    memo[key] = self.op(out, n.op, k0, self.c(n.src[1].arg))
                parts[n] = memo[key] if n.op is Ops.IDIV else self.op(out, Ops.ADD, memo[key], lk)
        return parts

    def fill_zero_padded(self, t: _Tile, k0: Instr, k_rem: Instr, out: list[Item]) -> None:
        """The tail tile into buffer 0: rows k0 + lk for lk < k_rem, zeros below them (clamped loads)."""
        p = self.p
        k_last = self.op(out, Ops.SUB, k_rem, self.c(1))
        kmemo: dict = {}
        for ps in t.passes:
            blk = out
            if ps.guard is not None:
                g = If(ps.guard)
                out.append(g)
                blk = g.body
            lk = self.op(blk, Ops.MIN, ps.lk, k_last)
            kc = self.op(blk, Ops.ADD, k0, lk)
            env = {**self.bind, p.k: kc, (p.i if t.kind == "A" else p.j): ps.w,
                   **self.k_parts(t.unit, k0, lk, blk, kmemo if blk is out else {})}
            v = self.expr(t.unit, env, blk, {})
            ok = self.op(blk, Ops.CMPLT, ps.lk, k_rem)
            z = self.leaf(L.CONST, t.unit.dtype, 0.0)
            vz = self.new(L.ALU, t.unit.dtype, (ok, v, z), Ops.WHERE)
            sidx = self.swizzled(t, ps.sidx, blk) if self.swizzle and not t.swizzled_passes else ps.sidx
            blk += [vz, self.new(L.STORE, None, (t.smem, sidx, vz))]

    def mma_steps(self, out: list[Item], rd: dict[str, Instr], steps: int) -> None:
        """Every 16-k step of a full tile; staged (cp.async) kernels load the fragments of step s + 1 before
        step s's mma (the register-staged ones hold the next tile's loads instead: no registers for both)."""
        if not self.staged:
            for s in range(steps):
                self.mma_step(out, rd, self.c(s))
            return
        nxt = self.mma_frags(out, rd, self.c(0))
        for s in range(steps):
            cur = nxt
            if s + 1 < steps:
                nxt = self.mma_frags(out, rd, self.c(s + 1))
            self.mma_issue(out, cur)

    def mma_step(self, out: list[Item], rd: dict[str, Instr | None], step: Instr) -> None:
        """16 k of the tiles (k rows 16 * step ...) into every accumulator fragment of the warp."""
        self.mma_issue(out, self.mma_frags(out, rd, step))

    def mma_frags(self, out: list[Item], rd: dict[str, Instr | None], step: Instr) -> dict[str, list[Instr]]:
        """The warp's A and B fragments of 16-k step `step` (a constant) of the buffers at offsets rd."""
        frags: dict[str, list[Instr]] = {}
        s = step.arg
        for t in self.tiles:
            at = self.lm_at[t.kind]
            frags[t.kind] = []
            for n16 in range((self.WM if t.kind == "A" else self.WN) // 16):
                base, const = (at[n16], 16 * s * t.ld) if t.kmajor else (at[s], 16 * n16 * t.ld)
                if rd.get(t.kind) is not None:
                    base = self.op(out, Ops.ADD, base, rd[t.kind])
                idx = self.op(out, Ops.ADD, base, self.c(const)) if const else base
                fr = self.new(L.LDMATRIX, t.smem.dtype, (t.smem, idx), (4, t.kmajor))
                out.append(fr)
                frags[t.kind].append(fr)
        return frags

    def mma_issue(self, out: list[Item], frags: dict[str, list[Instr]]) -> None:
        for mi, a in enumerate(frags["A"]):
            for ni in range(self.WN // 8):
                b = frags["B"][ni // 2]
                accs = [self.accs[2 * mi + h][2 * ni + e] for h in (0, 1) for e in (0, 1)]
                out.append(self.new(L.MMA, None, (a, b, *accs), ("m16n8k16", ni % 2)))


class _AMDBuilder(_MMABuilder):
    """AMD matrix instructions, whose fragments are per-lane vectors along k (no ldmatrix): each lane loads
    its own row of A and column of B from shared memory -- one vector load from an [m][k] tile, scalar
    loads gathered into a vector from a k-major one -- and the instruction takes the accumulators as one
    vector (LLVM IR llvm.amdgcn.mfma / llvm.amdgcn.wmma).

    MFMA 32x32x8 (wave64): lane l holds A[l % 32][4 (l / 32) + e] and B[4 (l / 32) + e][l % 32], e < 4; its
    16 accumulators r are D[8 (r / 4) + 4 (l / 32) + r % 4][l % 32].
    WMMA 16x16x16 (gfx11, wave32): lane l holds row l % 16 of A and column l % 16 of B, all 16 k (lanes
    16-31 repeat 0-15); its 8 accumulators r are D[2 r + l / 16][l % 16]."""

    def fragments(self, top: list[Item], lane: Instr, wm0: Instr, wn0: Instr) -> None:
        WM, WN = self.WM, self.WN
        _, F, _, KS = MMAS[self.mma]                 # F x F output fragments, KS k per instruction
        mfma = self.mma == MFMA_32X32X8
        self.elems = 4 if mfma else 16               # k elements per lane per instruction
        rows = 16 if mfma else 8                     # accumulators per lane per fragment
        idx = self.op(top, Ops.MOD, lane, self.c(F))                   # the lane's row of A / column of B
        grp = self.op(top, Ops.IDIV, lane, self.c(F))                  # MFMA: which 4 k of 8; WMMA: row parity
        k0 = self.op(top, Ops.MUL, grp, self.c(4)) if mfma else self.c(0)
        self.lm_base = {}
        for t in self.tiles:
            w = self.op(top, Ops.ADD, idx, wm0 if t.kind == "A" else wn0)
            row, col = (k0, w) if t.kmajor else (w, k0)
            self.lm_base[t.kind] = self.op(top, Ops.ADD, self.op(top, Ops.MUL, row, self.c(t.ld)), col)
        TM, TN = (WM // F) * rows, WN // F
        self.accs = [[self.new(L.ACC, dtypes.float32, (), 0.0) for _ in range(TN)] for _ in range(TM)]
        top.extend(a for row in self.accs for a in row)
        if mfma:
            self.offs = {"A": [F * (rr // 16) + 8 * (rr % 16 // 4) + rr % 4 for rr in range(TM)],
                         "B": [F * cc for cc in range(TN)]}
            first_a = self.op(top, Ops.ADD, wm0, self.op(top, Ops.MUL, grp, self.c(4)))
        else:
            self.offs = {"A": [F * (rr // 8) + 2 * (rr % 8) for rr in range(TM)], "B": [F * cc for cc in range(TN)]}
            first_a = self.op(top, Ops.ADD, wm0, grp)
        self.first = {"A": first_a, "B": self.op(top, Ops.ADD, wn0, idx)}

    def mma_steps(self, out: list[Item], rd: dict[str, Instr], steps: int) -> None:
        for s in range(steps):
            self.mma_step(out, rd, self.c(s))

    def mma_step(self, out: list[Item], rd: dict[str, Instr | None], step: Instr) -> None:
        """KS k of the tiles (k rows KS * step ...) into every accumulator fragment of the wave."""
        _, F, _, KS = MMAS[self.mma]
        rows = len(self.accs) // (self.WM // F)
        frags: dict[str, list[Instr]] = {}
        for t in self.tiles:
            base = self.lm_base[t.kind]
            if rd.get(t.kind) is not None:
                base = self.op(out, Ops.ADD, base, rd[t.kind])
            kstride, wstride = (t.ld, 1) if t.kmajor else (1, t.ld)      # one k, one row (column)
            kofs = (self.c(KS * kstride * step.arg) if step.arg else None) if step.kind is L.CONST \
                else self.op(out, Ops.MUL, step, self.c(KS * kstride))
            if kofs is not None:
                base = self.op(out, Ops.ADD, base, kofs)
            frags[t.kind] = []
            for n in range((self.WM if t.kind == "A" else self.WN) // F):
                at = self.op(out, Ops.ADD, base, self.c(F * wstride * n)) if n else base
                frags[t.kind].append(self.fragment(out, t, at, kstride))
        for mi, a in enumerate(frags["A"]):
            for ni, b in enumerate(frags["B"]):
                accs = [self.accs[mi * rows + r][ni] for r in range(rows)]
                out.append(self.new(L.MMA, None, (a, b, *accs), (self.mma, 0)))

    def fragment(self, out: list[Item], t: _Tile, at: Instr, kstride: int) -> Instr:
        """`elems` consecutive k of one row (column) from `at`: 8-element vector loads along a [w][k] row,
        scalar loads down a k-major column; one vector value."""
        dt, n = t.smem.dtype, self.elems
        if not t.kmajor and n <= 8:
            v = self.new(L.LOAD, dt, (t.smem, at), n)
            out.append(v)
            return v
        lanes: list[Instr] = []
        for e0 in range(0, n, 8 if not t.kmajor else 1):
            i = self.op(out, Ops.ADD, at, self.c(e0 * kstride)) if e0 else at
            if t.kmajor:
                x = self.new(L.LOAD, dt, (t.smem, i))
                out.append(x)
                lanes.append(x)
            else:
                v = self.new(L.LOAD, dt, (t.smem, i), 8)
                out.append(v)
                for e in range(8):
                    x = self.new(L.EXTRACT, dt, (v,), e)
                    out.append(x)
                    lanes.append(x)
        vec = self.new(L.VECTOR, dt, tuple(lanes))
        out.append(vec)
        return vec


class _MFMABuilder(_AMDBuilder):
    mma = MFMA_32X32X8


class _WMMABuilder(_AMDBuilder):
    mma = WMMA_16X16X16


_BUILDERS = {MMA_M16N8K16: _MMABuilder, MFMA_32X32X8: _MFMABuilder, WMMA_16X16X16: _WMMABuilder}


__all__ = ["MFMA_32X32X8", "MMA_M16N8K16", "WGMMA", "WMMA_16X16X16", "TC_PIPELINES", "TC_TILE", "TC_TILE_CANDIDATES",
           "WG_BARS", "WG_PRODUCER", "WG_SMEM", "TC_NARROW_N", "TC_MASKED_NARROW_TILE", "TC_WIDE_N", "TC_TILE_STATIC_WIDE",
           "TC_STATIC_WIDE_MIN_BLOCKS", "choose_tc_tile", "tc_pipeline", "tc_plan", "tc_smem_bytes", "tc_threads", "valid_tc_tile",
           "wg_tile_ok"]
