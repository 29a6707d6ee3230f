"""Convolution as a scheduled family: which kernel sequence computes a 2-D convolution (NCHW).

A `ConvPlan` names a family and, for the contraction families, the register tile and vector lanes
the target's `Capabilities` give its contraction kernel (the kernel's own schedule, codegen/schedule.py,
derives the same from its AST; the plan records them so MOROK_DEBUG prints what the family runs as):

  pointwise    a 1x1, stride-1, unpadded convolution is a batched contraction of the weights
               [CO, C] with the input [C, H*W]: one `kernels.conv_gemm` kernel, output channels as
               the register tile's rows and pixels as its unit-stride vector columns; on the CPU
               (image, pixel block) is its outermost range, the threads' split (`pixel_blocks`).
  im2col_gemm  any other convolution: `kernels.im2col` writes the columns [C*KH*KW, OH*OW] (strides,
               dilations and zero padding applied there, once), then the same contraction; groups
               are a GLOBAL range of it.
  depthwise    one input channel per group and one output channel per input channel: the taps
               unrolled in one elementwise kernel over (n, c, oh, ow), masked at the borders; on the
               CPU the (n, c) planes split over threads and the rows along ow vectorized.
  depthwise_flat  (CPU) the same at stride 1 with the width kept (`flat_depthwise`): each plane's
               inner rows as one flat vectorized loop, borders peeled (`kernels.depthwise_conv2d`).
  depthwise_padded  depthwise after `kernels.pad2d` copies the input into a zero-bordered scratch, so
               the taps load without masks (a masked tap clamps its index: LLVM gathers).
  grouped_flat  (CPU) a grouped convolution with few channels per group, stride 1 and the width kept:
               each (image, group) sums its input planes into its output planes in one flat loop
               (`kernels.grouped_conv2d_flat`), no im2col columns.
  grouped_direct  (GPU) a grouped convolution as one kernel, a work-item summing its group's masked taps,
               loaded once, into a few output channels (`kernels.grouped_conv2d`): over (n, group, output block,
               oh, ow) where a group's taps unroll; where its channels are a loop, over (n, group, output
               block) and a tile of output pixels (`kernels.grouped_tile`), each weight loaded once for the
               tile; no im2col columns, no contraction over a group's few channels.
  im2col_flat  (GPU) `kernels.im2col_flat` writes the columns [C*KH*KW, N*OH*OW] (every image's pixels of
               a tap side by side), then `kernels.flat_gemm` contracts them with the weights as one matrix
               product whose tiles fill by contiguous (16-byte, asynchronous) copies; the direct implicit
               GEMM gathers its taps element by element. `split` runs of the reduction (`flat_split`,
               where the output's tiles are few) go to float32 partials that `kernels.split_sum` adds.
               The default for float32 3x3 (`gpu_plan`), and with runs for float32 1x1 layers whose tiles
               are few (FLAT_POINTWISE_MIN_ROWS).
  im2col_rows  (GPU) the same with the columns transposed, [N*OH*OW, C*KH*KW]: a pixel's taps contiguous,
               both operands of the contraction along k; the default for 16-bit 3x3 from
               IM2COL_FLAT_MIN_CO output channels.
  direct       `kernels.conv2d` after `kernels.pad2d`: the implicit GEMM (pixels as rows, output
               channels as columns) that a GPU's shared-memory tiles and tensor cores take, the
               default there for unpadded 16-bit layers narrower than IM2COL_FLAT_MIN_CO and for 1x1
               layers; on the CPU a generic loop nest the others are searched against.
  direct_masked  (GPU) the same implicit GEMM reading the unpadded input through masked taps
               (`kernels.conv2d` with pads): the tile fills load zero outside the image, so no pad
               kernel writes a padded copy; the default for padded 16-bit layers where `direct` would be.
               Input channels a multiple of 32 run the reduction tap-major (the weights reordered by a
               small kernel first), so a k tile holds one tap (`kernels.conv2d`).

  direct_phases  (CPU) `kernels.phase_pad` splits the zero-padded input into its stride's phases, then
               `kernels.conv2d_phases` sums the taps straight from them as a register-tiled contraction (output
               channels as the tile's rows, an output row's pixels as its vector columns): no im2col columns,
               KH*KW times the input. The default for strided layers of few input channels and large kernels
               whose output rows fill the tile's width (DIRECT_PHASES_MAX_CHANNELS, DIRECT_PHASES_MIN_TAPS;
               resnet50's stem).

  phases_flat  (CPU) `kernels.phase_pad` as for direct_phases (a few zero rows more below), then
               `kernels.conv2d_phases_flat` sums the taps over each image's output as one run of flat columns
               (an output row's pixels and the planes' padding after them, row after row): every tap's operand
               is contiguous however narrow the output, and `kernels.flat_crop` takes the output pixels from the
               columns with the epilogue. The default for one-group, stride-1 layers of more than one tap whose
               flat columns fill at most PHASES_FLAT_MAX_COLUMNS (resnet50's 7x7 3x3 layers where Winograd is not
               taken, densenet121's 7x7 3x3 layers), where im2col's columns are KH*KW times the input and their
               rows of 49 pixels split every vector load over two cache lines.

  winograd     Winograd F(m x m, 3 x 3) for a 3x3, stride-1 layer whose output sides m (4 or 2) divides:
               `kernels.winograd_weights` transforms the filters (a weights-only step, which the ONNX
               executor runs once), `kernels.winograd_input` the input tiles of every image side by side,
               then (m + 2)^2 contractions [CO, C] x [C, tiles] (`kernels.conv_gemm` with that many groups),
               and `kernels.winograd_output` with the epilogue: 4x (m = 4) or 2.25x fewer multiplies in the
               contraction, for the transforms' traffic. Float32 only (a candidate).

`conv_plan` is the heuristic choice; `candidate_plans` lists what a search (MOROK_BEAM) times;
`search_plan` times them through a caller's timer and keeps the fastest per geometry, target and
epilogue for the process.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from ...errors import ArgumentError
from ..capabilities import Capabilities

FAMILIES = ("pointwise", "im2col_gemm", "depthwise", "depthwise_flat", "depthwise_padded", "grouped_flat",
            "grouped_direct", "im2col_flat", "im2col_rows", "direct", "direct_masked", "direct_phases", "phases_flat",
            "winograd")


@dataclass(frozen=True)
class ConvGeometry:
    """A 2-D convolution's sizes: input [N, C, H, W], weights [CO, C/groups, KH, KW]; pads are
    (top, left, bottom, right)."""

    N: int
    C: int
    H: int
    W: int
    CO: int
    KH: int
    KW: int
    stride: tuple[int, int] = (1, 1)
    dilation: tuple[int, int] = (1, 1)
    pads: tuple[int, int, int, int] = (0, 0, 0, 0)
    groups: int = 1

    def __post_init__(self) -> None:
        sizes = (self.N, self.C, self.H, self.W, self.CO, self.KH, self.KW, self.groups) + self.stride + self.dilation
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes):
            raise ArgumentError(f"convolution sizes must be positive ints: {self}")
        if any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in self.pads):
            raise ArgumentError(f"convolution pads must be ints >= 0: {self.pads}")
        if self.C % self.groups or self.CO % self.groups:
            raise ArgumentError(f"{self.groups} groups do not divide {self.C} input or {self.CO} output channels")
        if self.OH < 1 or self.OW < 1:
            raise ArgumentError(f"a {self.KH}x{self.KW} kernel does not fit the padded {self.H}x{self.W} input")

    @property
    def OH(self) -> int:
        return (self.H + self.pads[0] + self.pads[2] - (self.KH - 1) * self.dilation[0] - 1) // self.stride[0] + 1

    @property
    def OW(self) -> int:
        return (self.W + self.pads[1] + self.pads[3] - (self.KW - 1) * self.dilation[1] - 1) // self.stride[1] + 1

    @property
    def pointwise(self) -> bool:
        """1x1, stride 1, unpadded: the input is already the contraction's right-hand matrix."""
        return (self.KH, self.KW) == (1, 1) and self.stride == (1, 1) and not any(self.pads)

    @property
    def depthwise(self) -> bool:
        return self.groups == self.C == self.CO and self.groups > 1

    @property
    def flops(self) -> int:
        return 2 * self.N * self.CO * self.OH * self.OW * (self.C // self.groups) * self.KH * self.KW


@dataclass(frozen=True)
class ConvPlan:
    """The family of kernels a convolution runs as; register_tile and lanes are its contraction's
    (None / 0 for the families without one); pixel_blocks the blocks each image's output pixels are cut
    into for the contraction's thread split (`pixel_blocks`; 1: whole images)."""

    family: str
    register_tile: tuple[int, int] | None = None
    lanes: int = 0
    pixel_blocks: int = 1
    split: int = 1          # im2col_flat / im2col_rows: runs the contraction's reduction is cut into (flat_split)
    winograd: int = 0       # winograd: the output tile's side m of F(m x m, 3 x 3) (2 or 4)
    pixel_rows: bool = False  # pointwise / im2col_gemm (CPU, one group): pixels as the register tile's rows
    k_run: int = 0          # pixel_rows: the reduction cut into runs of this many steps (0: one run)
    cpu_form: bool = False  # winograd (CPU): the input transform's interior tiles unmasked, the planes padded apart

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ArgumentError(f"convolution family {self.family!r}: one of {', '.join(FAMILIES)}")
        if self.pixel_blocks < 1 or (self.pixel_blocks > 1 and self.family not in ("pointwise", "im2col_gemm")):
            raise ArgumentError(f"{self.family}: pixel_blocks {self.pixel_blocks} (a contraction's, >= 1)")
        if self.split < 1 or (self.split > 1 and self.family not in ("im2col_flat", "im2col_rows")):
            raise ArgumentError(f"{self.family}: split {self.split} (the flat columns' reduction runs, >= 1)")
        if (self.family == "winograd") != (self.winograd in WINOGRAD_TILES):
            raise ArgumentError(f"{self.family}: winograd={self.winograd} (the winograd family's output tile, one "
                                f"of {WINOGRAD_TILES}; 0 for the others)")
        if self.pixel_rows and (self.family not in ("pointwise", "im2col_gemm") or self.pixel_blocks != 1):
            raise ArgumentError(f"{self.family}: pixel_rows (a CPU contraction's, without pixel blocks)")
        if self.k_run < 0 or (self.k_run and not self.pixel_rows):
            raise ArgumentError(f"{self.family}: k_run {self.k_run} (a pixel_rows contraction's run length, >= 0)")
        if self.cpu_form and self.family != "winograd":
            raise ArgumentError(f"{self.family}: cpu_form (the CPU layout of the winograd family's kernels)")

    def __str__(self) -> str:
        parts = [self.family]
        if self.register_tile is not None:
            parts.append(f"register_tile={self.register_tile[0]}x{self.register_tile[1]}")
        if self.lanes:
            parts.append(f"tile_lanes={self.lanes}")
        if self.pixel_blocks > 1:
            parts.append(f"pixel_blocks={self.pixel_blocks}")
        if self.split > 1:
            parts.append(f"split={self.split}")
        if self.winograd:
            parts.append(f"tile={self.winograd}x{self.winograd}")
        if self.pixel_rows:
            parts.append("pixel_rows")
        if self.k_run:
            parts.append(f"k_run={self.k_run}")
        if self.cpu_form:
            parts.append("cpu_form")
        return "ConvPlan(" + ", ".join(parts) + ")"


# the contraction's outermost range, (image, pixel block), is what the CPU splits over its workers; a
# block keeps at least MIN_BLOCK_PIXELS pixels (one column tile of AVX-512's 64). With the worker count
# unknown, the blocks aim at SPLIT_UNITS units (as codegen/opt.py's), balanced for any count up to 16.
SPLIT_UNITS = 48
MIN_BLOCK_PIXELS = 64


def _tiles(pixels: int, tile_width: int) -> float:
    """Column tiles of a block, as opt.tile_with_lanes walks them: full tiles, and for a remainder a
    narrow region (up to a quarter tile, counted half a tile) or an overlapping last tile."""
    if not tile_width:
        return pixels / 64
    full, rem = divmod(pixels, tile_width)
    return full + (0 if not rem else 0.5 if 4 * rem <= tile_width else 1)


def pixel_blocks(images: int, pixels: int, tile_width: int = 0, threads: int = 0) -> int:
    """Blocks per image of the contraction's pixels (a divisor of `pixels`, blocks of at least
    MIN_BLOCK_PIXELS). For `threads` workers: the count whose busiest worker walks the fewest column
    tiles (its units times each unit's tiles), the fewest blocks among equals, so a batch that already
    divides among the workers stays whole. One image stays whole (the register tile splits its rows). At batch 8 on 16 workers a 56x56 layer takes 2 blocks (16
    units of 25 tiles; whole images left 8 workers idle), 28x28 2, 14x14 2; on 2 workers all stay whole.
    With `threads` 0 (unknown): the fewest blocks, a multiple of `tile_width` where one exists, that
    reach SPLIT_UNITS units, else the most there are."""
    if images == 1:
        # one image: the register tile's own split (codegen/opt.py: row partitions x column tiles, balanced
        # for the workers) takes the outer range. Blocks here replace it with their count alone: resnet50 at
        # batch 1 on the 16-core Xeon (benchmarks/onnx_models.py) kept 2 of 16 workers busy on its 14x14
        # layers (2 blocks of 98 pixels) and replayed in 51.6 ms against 23 ms with whole images
        return 1
    cands = [d for d in range(1, pixels // MIN_BLOCK_PIXELS + 1) if pixels % d == 0] or [1]
    if threads > 0:
        return min(cands, key=lambda d: (-(-images * d // threads) * _tiles(pixels // d, tile_width), d))
    if images >= SPLIT_UNITS:
        return 1
    aligned = [d for d in cands if tile_width and (pixels // d) % tile_width == 0] or cands
    enough = [d for d in aligned if images * d >= SPLIT_UNITS]
    return min(enough) if enough else max(aligned)


# the most border rows (or columns) on one side a flat depthwise plane peels into stores of their own
MAX_PEEL = 4


def inner_span(n_in: int, n_out: int, k: int, dilation: int, lo: int) -> tuple[int, int] | None:
    """(first, last) output position at stride 1 whose every tap lies inside the input, or None."""
    first, last = max(lo, 0), min(n_in - 1 + lo - (k - 1) * dilation, n_out - 1)
    return (first, last) if first <= last else None


def flat_spans(H: int, W: int, OH: int, OW: int, KH: int, KW: int, stride: tuple[int, int],
               dilation: tuple[int, int], top: int, left: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The (rows, columns) whose every tap is inside, where a depthwise plane can run as one flat loop:
    stride 1, output rows as wide as the input's, a few border rows and columns a side; else None."""
    if stride != (1, 1) or OW != W:
        return None
    rows, cols = inner_span(H, OH, KH, dilation[0], top), inner_span(W, W, KW, dilation[1], left)
    if rows is None or cols is None or max(rows[0], OH - 1 - rows[1], cols[0], W - 1 - cols[1]) > MAX_PEEL:
        return None
    return rows, cols


def flat_depthwise(geo: "ConvGeometry") -> bool:
    return geo.depthwise and flat_spans(geo.H, geo.W, geo.OH, geo.OW, geo.KH, geo.KW, geo.stride, geo.dilation,
                                        geo.pads[0], geo.pads[1]) is not None


# grouped_flat: each output sums (C/groups) * KH * KW taps from vectors loaded once per (image, group), and
# the flat loop's IR (unrolled, once per peeled border too) grows with those taps times the group's outputs:
# past GROUPED_FLAT_MAX_TERMS its compile time runs to seconds (3x3: 8 in / 8 out per group 4.5 s, 8 / 16
# 12.5 s; 4 / 4 0.9 s). Below GROUPED_FLAT_MIN_PIXELS output pixels the im2col contraction wins. Measured
# on a 2-core AVX-512 EPYC, batch 8, 3x3, interleaved, loaded host: 128 channels in 32 groups at 28x28 1.1
# against 3.4-3.6 ms (im2col + gemm); 256 in 32 at 14x14 2.3-2.9 against 1.3-1.8 ms
GROUPED_FLAT_MAX_TERMS = 160
GROUPED_FLAT_MIN_PIXELS = 28 * 28


def grouped_flat_applies(geo: "ConvGeometry") -> bool:
    terms = (geo.C // geo.groups) * geo.KH * geo.KW * (geo.CO // geo.groups)
    return (1 < geo.groups and not geo.depthwise and terms <= GROUPED_FLAT_MAX_TERMS
            and flat_spans(geo.H, geo.W, geo.OH, geo.OW, geo.KH, geo.KW, geo.stride, geo.dilation,
                           geo.pads[0], geo.pads[1]) is not None)


# pixel_rows (CPU): a one-group contraction of at most PIXEL_ROWS_FEW_PIXELS output pixels per image, a reduction
# of at least PIXEL_ROWS_FEW_MIN_K steps and at most PIXEL_ROWS_MAX_CO output channels takes the pixels as the
# register tile's rows and the output channels as its vector columns; a reduction of at least K_RUN_MIN_K steps
# runs in pieces of at most K_RUN_MAX steps (a row tile's broadcasts and a packed 16-column weights panel of one
# run stay in L1 / L2). Since pixels-as-columns packs the columns of such layers (their rows, 196 or 784 bytes
# apart, split every vector load over two cache lines: codegen/opt.py PACK_LINE_BYTES), pixel rows win only
# where the output channels are few. One Conv + Relu node at batch 1 through morok_py.onnx on the 2-vCPU AVX2
# EPYC (Zen 3), two threads, interleaved rounds (medians of 9; noisy host, the same program varied 10-25%
# between processes): 1x1 2048 -> 512 at 7x7 1.32 ms as columns against 1.89 as pixel rows, 512 -> 2048 1.21
# against 1.63, 1024 -> 2048 stride 2 to 7x7 2.97 against 4.05, 3x3 512 stride 2 to 7x7 4.23 against 4.74,
# 3x3 256 stride 2 to 14x14 2.37 against 3.12, 3x3 512 -> 512 at 7x7 (runs of 576) 3.6-4.3 against 4.45; with
# 128 output channels they tie (1x1 544, 736, 992 -> 128 at 7x7) and with 32 pixel rows win (3x3 128 -> 32 at
# 7x7, densenet121's: 0.168 against 0.204 ms; one thread 0.24 against 0.27)
PIXEL_ROWS_FEW_PIXELS = 64
PIXEL_ROWS_FEW_MIN_K = 512
PIXEL_ROWS_MAX_CO = 128
# the widest register-tile lanes the CPU default takes pixel rows at: AVX2's 8. Targets with wider lanes
# (AVX-512's 16, a 6x64 tile) keep pixels as columns: on the 16-core AVX-512 Xeon, the light models' launches in
# order in one process (three rounds, the forms compiled side by side), with Winograd's CPU form on, pixel rows
# took resnet50 from 15.7-16.2 to 16.1-16.2 ms and densenet121 from 20.7-21.1 to 21.9-22.2; MOROK_BEAM times both
PIXEL_ROWS_MAX_LANES = 8
K_RUN_MIN_K = 4096
K_RUN_MAX = 576


def k_run(K: int, most: int = 0) -> int:
    """The run length of a reduction of K steps: K cut into the fewest equal runs of at most `most` steps
    (default K_RUN_MAX, pixel_rows'; a multiple of 8 each), or 0 (one run) where K is that short or no such
    cut exists."""
    most = most or K_RUN_MAX
    if K <= most:
        return 0
    for runs in range(2, K // 8 + 1):
        if K % runs == 0 and K // runs <= most and (K // runs) % 8 == 0:
            return K // runs
    return 0


def pixel_rows_applies(geo: "ConvGeometry", caps: Capabilities) -> bool:
    """Whether the CPU heuristic takes pixel rows for this one-group contraction (PIXEL_ROWS_FEW_PIXELS,
    PIXEL_ROWS_FEW_MIN_K; from two vector-column tiles of output channels to PIXEL_ROWS_MAX_CO;
    PIXEL_ROWS_MAX_LANES)."""
    tile = caps.register_tile
    P, K = geo.OH * geo.OW, geo.C * geo.KH * geo.KW
    return (not caps.has_local and tile is not None and 0 < caps.tile_lanes <= PIXEL_ROWS_MAX_LANES and geo.groups == 1
            and P <= PIXEL_ROWS_FEW_PIXELS and K >= PIXEL_ROWS_FEW_MIN_K and 2 * tile[1] <= geo.CO <= PIXEL_ROWS_MAX_CO)


def _contraction(family: str, caps: Capabilities, geo: "ConvGeometry | None" = None,
                 pixel_rows: bool | None = None) -> ConvPlan:
    """The contraction plan of `family` for the target; `pixel_rows` None: as the heuristic says."""
    tile = caps.register_tile if not caps.has_local else None
    lanes = caps.tile_lanes if tile is not None else 0
    if geo is not None and tile is not None:
        if pixel_rows is None:
            pixel_rows = pixel_rows_applies(geo, caps)
        if pixel_rows:
            K = geo.C * geo.KH * geo.KW
            return ConvPlan(family, tile, lanes, pixel_rows=True, k_run=k_run(K) if K >= K_RUN_MIN_K else 0)
    blocks = 1
    if geo is not None and tile is not None:
        blocks = pixel_blocks(geo.N, geo.OH * geo.OW, caps.tile_lanes and tile[1], caps.threads)
    return ConvPlan(family, tile, lanes, blocks)


# GPU plans, measured on an H200 (benchmarks/conv.py --variants, batch 32, NVRTC, beside cuDNN without TF32;
# benchmarks/results/nvidia-h200/conv-variants-nvrtc.json, TFLOP/s). The flat columns are KH*KW times the input's
# bytes and the contraction does 2*CO flops per column element. float32 3x3: im2col_flat beats the direct implicit
# GEMM (64 channels at 56x56 25.1 against 23.8, where direct_masked ties at 25.3; 128 at 28x28 29.9 against 21.0 and
# 25.5; stride 2 at 56x56 28.4 against 18.4 and 24.6) and im2col_rows (20.7, 25.5, 24.7), its reduction cut into
# flat_split runs where the tiles are few (256 at 14x14 2 runs: 29.1 against 24.0; 512 at 7x7 4 runs: 25.8 against
# 21.4; 256 at 28x28 stride 2, 2 runs: 27.9 against 23.1). 16-bit 3x3: im2col_rows from IM2COL_FLAT_MIN_CO output
# channels (512 at 7x7 156.2 against 97.7 for im2col_flat, 53.8 direct and 75.1 direct_masked; 256 at 14x14 133.7
# against 88.0, 71.5 and 106.4; stride 2 at 28x28 130.6 against 81.3, 53.0 and 92.6; runs cut only lose: 116.4,
# 108.9, 103.2), below it the direct implicit GEMM reading the padding through masked taps, direct_masked, no pad
# kernel (64 at 56x56 105.3 against 68.5 for im2col_flat, 43.4 im2col_rows and 59.7 pad + direct; 128 at 28x28 122.6
# against 85.0 im2col_rows; stride 2 at 56x56 112.6 against 75.0). float32 1x1 over at least POINTWISE_MIN_PIXELS
# pixels and with fewer than POINTWISE_MAX_CHANNEL_RATIO input channels per output channel: the batched contraction
# of the input itself. In one process on the H200 (batch 32, pointwise against direct, nvrtc / llvm-nvptx, us;
# cuDNN beside): 64 -> 256 at 56x56 118.8 / 117.2 against 218.3 / 225.4 (cuDNN 135.9), 64 -> 64 58.6 / 57.8
# against 63.7 / 63.6 (56.6), 256 -> 128 217.7 / 211.6 against 237.2 / 221.2 (186.4), but 256 -> 64 163.8 / 163.4
# against 130.3 / 119.6 (130.1) and 1024 -> 256 at 14x14 142.5 / 141.0 against 135.7 / 137.9 (127.1): the direct
# form. benchmarks/conv.py at d88fefb: 256 -> 64 at 56x56 0.90x / 0.87x -> 1.02x / 1.20x cuDNN (conv-nvrtc.json,
# conv-llvm-nvptx.json). Groups and depthwise: grouped_direct (depthwise float16 128 channels at 56x56
# 5.8 against 4.9 TFLOP/s for the elementwise depthwise kernel, float32 the same). On an H100
# (benchmarks/results/nvidia-h100/conv-variants-nvrtc.json) direct_masked took 64 at 56x56 95.9 against 57.4 for pad
# + direct, stride 2 at 56x56 104.3 against 52.6. float32 keeps im2col_flat (128 at 28x28 29.9 against 25.5 for
# direct_masked)
IM2COL_FLAT_MIN_CO = 256
POINTWISE_MIN_PIXELS = 1024
# float32 1x1 layers whose tiles are few take flat columns with runs (gpu_plan) from this many output pixels in
# all (measured at 6272: batch 32 at 14x14); fewer (a batch of one) keep the one-kernel implicit GEMM
FLAT_POINTWISE_MIN_ROWS = 4096
POINTWISE_MAX_CHANNEL_RATIO = 4
# the most bytes of flat columns a default plan writes (float32 64 channels 3x3 at 56x56, batch 32: 231 MB);
# past it the direct implicit GEMM, which needs no scratch
IM2COL_FLAT_MAX_BYTES = 1 << 28


# flat_split: the flat contraction's 64x64 tiles should make at least this many work-groups (4 per SM of an
# H100's 132) before its reduction is cut into runs, each run at least FLAT_SPLIT_MIN_K long, at most
# FLAT_SPLIT_MAX runs
FLAT_SPLIT_MIN_GROUPS = 528
FLAT_SPLIT_MIN_K = 256
FLAT_SPLIT_MAX = 8


def flat_split(geo: ConvGeometry) -> int:
    """Runs (a power of two) the flat contraction's reduction is cut into so that its 64x64 tiles make
    FLAT_SPLIT_MIN_GROUPS work-groups; 1 where the output alone makes them (or k is too short to cut)."""
    K = (geo.C // geo.groups) * geo.KH * geo.KW
    groups = -(-geo.N * geo.OH * geo.OW // 64) * -(-geo.CO // 64)
    s = 1
    while (groups * s < FLAT_SPLIT_MIN_GROUPS and s < FLAT_SPLIT_MAX and K % (2 * s) == 0
           and K // (2 * s) >= FLAT_SPLIT_MIN_K):
        s *= 2
    return s


# float32 3x3 stride-1 layers with at least WINOGRAD_MIN_CHANNELS input and output channels and a constant batch
# of at least WINOGRAD_MIN_TILES output tiles take Winograd (4x4 tiles where the output sides allow, else 2x2):
# on an H100, batch 32 (benchmarks/results/nvidia-h100/conv-winograd-nvrtc.json), 128 at 28x28 32.3 TFLOP/s
# against 28.7 for im2col_flat, 256 at 14x14 32.0 against 28.1; 64 at 56x56 it lost then (20.6 against 22.1), with
# the transforms four tiles per work-item. With one tile per work-item (WINOGRAD_GPU_CHANNEL_LOOP), 4x4 tiles from
# WINOGRAD_4X4_MIN_CHANNELS where they replace im2col_flat (its columns within IM2COL_FLAT_MAX_BYTES): on the H200,
# batch 32, 64 at 56x56 36.1 TFLOP/s against 25.1 for im2col_flat and 24.4 for 2x2 tiles (cuDNN 26.5;
# benchmarks/results/nvidia-h200/conv-variants-nvrtc.json at d88fefb); in one process 203.6 / 195.5 us against
# 293.5 / 293.4 and 307.3 / 301.7 (nvrtc / llvm-nvptx; cuDNN 280.0 / 275.0)
WINOGRAD_MIN_CHANNELS = 128
WINOGRAD_4X4_MIN_CHANNELS = 64
WINOGRAD_MIN_TILES = 1024
# The GPU form of the Winograd transforms (kernels.winograd_input / winograd_output / winograd_weights): one tile
# (one filter) per work-item, WINOGRAD_GPU_CHANNEL_LOOP channels in a loop, the input transform's tiles of every
# image one range. With every range GLOBAL and the products contiguous along the tile column, the default schedule
# took the elementwise vector plan: 4 tiles of 36 values per work-item, a quarter of the work-items, and stores
# aligned for one tile row in four. In one process on the H200, batch 32, float32 (nvrtc / llvm-nvptx, us), 128 at
# 28x28 F(4x4): input 69.7 / 68.2 -> 20.6 / 20.3, output 60.0 / 55.4 -> 25.8 / 25.8, the layer 219.9 / 209.8 ->
# 134.0 / 129.5 beside cuDNN's 169.3 / 161.8; 256 at 14x14 F(2x2) 221.7 / 213.6 -> 166.6 / 161.4 (cuDNN 285.8 /
# 273.2). A loop of 4 ran within 1% of 2 (135.2 / 131.0 and 166.1 / 162.6). benchmarks/conv.py at d88fefb
# (benchmarks/results/nvidia-h200/conv-nvrtc.json, conv-llvm-nvptx.json): 128 at 28x28 0.70x / 0.76x -> 1.13x /
# 1.27x cuDNN, 256 at 14x14 1.24x / 1.31x -> 1.67x / 1.80x
WINOGRAD_GPU_CHANNEL_LOOP = 2


def winograd_default(geo: ConvGeometry, itemsize: int, static_batch: bool) -> int:
    """The Winograd tile a GPU's default plan takes for this layer (0: none), by the rule above."""
    channels = min(geo.C, geo.CO)
    if itemsize < 4 or not static_batch or channels < WINOGRAD_4X4_MIN_CHANNELS:
        return 0
    cols = geo.N * geo.C * geo.KH * geo.KW * geo.OH * geo.OW * itemsize
    for m in WINOGRAD_TILES:
        if not winograd_applies(geo, m) or geo.N * (geo.OH // m) * (geo.OW // m) < WINOGRAD_MIN_TILES:
            continue
        if channels >= WINOGRAD_MIN_CHANNELS or (m == 4 and cols <= IM2COL_FLAT_MAX_BYTES):
            return m
    return 0


# the CPU: float32 3x3 stride-1 one-group layers with at least CPU_WINOGRAD_MIN_CO output channels, or with
# at least CPU_WINOGRAD_MIN_PIXELS output pixels, take Winograd F(2x2, 3x3) where the output sides are even.
# Measured at batch 1 on a 2-vCPU AVX2 EPYC (Zen 3), medians of 11 interleaved rounds against im2col_gemm
# (the filter transform run once, as the ONNX executor does): 64 -> 64 at 56x56 3.4 against 4.3 ms (F(4x4)
# 3.8), 128 -> 128 at 28x28 1.8 against 2.1 (F(4x4) 1.75), 256 -> 256 at 14x14 1.9 against 3.2,
# 128 -> 32 at 56x56 2.5 against 5.8 (F(4x4) 4.2); 128 -> 32 at 28x28 it lost (0.96 against 0.65 ms) and
# at 14x14 it tied. F(2x2) rounds less than F(4x4) (G's halves against its sixths). AVX-512 too since the CPU
# form (ConvPlan.cpu_form): on the 16-core Xeon, resnet50's launches in order in one process (three rounds, the
# forms compiled side by side) 16.8-17.6 ms with im2col_gemm for these layers against 15.7-16.2 (densenet121
# 22.1-22.9 against 20.7-21.1)
CPU_WINOGRAD_TILE = 2
CPU_WINOGRAD_MIN_CO = 64
CPU_WINOGRAD_MIN_PIXELS = 56 * 56
# output sides the tile does not divide, each at least CPU_WINOGRAD_PARTIAL_MIN_SIDE: a partial last row and
# column of tiles (kernels.winograd_tiles; 64 tiles' work for 49 outputs at 7x7). Batch 1, 7x7, kernels alone in
# interleaved rounds against im2col_gemm (im2col + contraction; for 512 -> 128 on AVX2 the pixel rows it had):
# 512 -> 512 (resnet50's) 2.47 against 2.86 ms on the 2-vCPU AVX2 EPYC, 0.37 against 0.49 on the 16-core Xeon;
# 512 -> 128 0.51 against 1.15 and 0.14 against 0.22. resnet50's captured replay, both forms in one process,
# medians of 11-31 rounds: 57.6 against 58.0 ms on the EPYC, 12.1 against 12.4 on the Xeon (its minima 11.2
# against 11.1: within that host's noise)
CPU_WINOGRAD_PARTIAL_MIN_SIDE = 7
# ... on hosts of at most CPU_WINOGRAD_PARTIAL_MAX_THREADS threads (a known count). With many threads a 7x7 layer is
# bound by reading its weights, which F(2x2)'s 16 transformed planes make 1.78x the 3x3 filters' (16.8 against 9.4
# MB for 512 -> 512): in resnet50 on the 16-core Xeon its two such contractions took 0.41 / 0.52 ms in launch order
# against 0.18 / 0.22 alone, where onnxruntime's direct convolutions took 0.27-0.37. resnet50's captured replay there,
# this rule against Winograd at 7x7 (the threshold 64), three executors of each in one process
# (benchmarks/model_variants.py): 10.79 against 11.37 ms, medians of 21 rounds
# (cpu-xeon-avx512-16c/model_variants-winograd7x7-threads.json), and 10.80 against 11.01 on another instance (15
# rounds); the 2-vCPU hosts, whose layers are bound by their multiplies, keep Winograd (measured above)
CPU_WINOGRAD_PARTIAL_MAX_THREADS = 8
# ... and where the contraction's columns (every image's tiles: 16 for one 7x7 image) fill at least this many of the
# target's lane vectors. On AVX-512 one 7x7 image's 16 tiles are a single 16-lane vector, so its 16 contractions ran
# as 6x16 register tiles, a vector load and six broadcasts for every six FMAs; through phases_flat instead resnet50's
# captured replay on the 2-vCPU AVX-512 Xeon, three executors of each rule in one process: 48.08 against 50.89 ms,
# faster in 16 of 21 rounds (benchmarks/model_variants.py, cpu-xeon-avx512-2c/model_variants-winograd7x7-lanes.json;
# an earlier run 50.68 against 51.77, 7 of 11), though the 512 -> 512 layer alone, hot, took 1.51 against 1.30 ms.
# AVX2's 8 lanes keep it (two vectors; the EPYC's measurement above)
CPU_WINOGRAD_PARTIAL_MIN_VECTORS = 2
# AVX-512 keeps F(2x2) too. F(4x4, 3x3) for resnet50's 3x3 layers from 14x14 up (64 channels or more; 14x14 with a
# partial last row and column of tiles), resnet50's captured replay on the 16-core Xeon, three executors of each rule
# in one process beside onnxruntime (benchmarks/model_variants.py; the last run, at cd424e9 with a constant
# CPU_WINOGRAD_4X4_MIN_CHANNELS added and that rule its default, is
# benchmarks/results/cpu-xeon-avx512-16c/model_variants-winograd4x4.json): 10.9 against 11.6 ms for F(2x2) on one
# instance, then 15.5 against 15.2 and 13.4 (13.2 with F(4x4) only from 256 channels) against 12.1 on another. The
# plan search, timed on random inputs, had F(4x4) ahead only for 256 channels at 14x14 (0.247 against 0.325 ms) and
# behind at 64 x 56x56 and 128 x 28x28 (0.361 / 0.304, 0.437 / 0.287)


def cpu_winograd_default(geo: ConvGeometry, itemsize: int, static_batch: bool, caps: Capabilities) -> int:
    """The Winograd tile the CPU's default plan takes for this layer (0: none), by the rule above."""
    if itemsize < 4 or not static_batch or not winograd_applies(geo, CPU_WINOGRAD_TILE, partial=True):
        return 0
    if not winograd_applies(geo, CPU_WINOGRAD_TILE):
        th, tw = -(-geo.OH // CPU_WINOGRAD_TILE), -(-geo.OW // CPU_WINOGRAD_TILE)
        if (min(geo.OH, geo.OW) < CPU_WINOGRAD_PARTIAL_MIN_SIDE or caps.threads > CPU_WINOGRAD_PARTIAL_MAX_THREADS
                or geo.N * th * tw < CPU_WINOGRAD_PARTIAL_MIN_VECTORS * caps.tile_lanes):
            return 0
    if geo.CO >= CPU_WINOGRAD_MIN_CO or geo.OH * geo.OW >= CPU_WINOGRAD_MIN_PIXELS:
        return CPU_WINOGRAD_TILE
    return 0


def gpu_plan(geo: ConvGeometry, itemsize: int = 4, static_batch: bool = True) -> ConvPlan:
    """The heuristic family on a GPU (a target with local memory) for elements of `itemsize` bytes;
    `static_batch` False: one plan for every batch size (no Winograd, whose tiles are laid out per batch)."""
    m = winograd_default(geo, itemsize, static_batch)
    if m:
        return ConvPlan("winograd", winograd=m)
    if geo.groups > 1:
        return ConvPlan("grouped_direct")
    if geo.pointwise:
        if itemsize >= 4 and flat_split(geo) > 1 and geo.N * geo.OH * geo.OW >= FLAT_POINTWISE_MIN_ROWS:
            # float32 whose 64x64 tiles are few: the flat columns (a copy of the input) with the reduction in
            # runs. 1024 -> 256 at 14x14, batch 32, on the H200 (nvrtc / llvm-nvptx, TFLOP/s; benchmarks/conv.py
            # --variants): 26.7 / 26.8 against 24.8 / 24.7 for direct, cuDNN 28.4 / 28.3 (conv-nvrtc.json and
            # conv-llvm-nvptx.json have the direct figures); at d88fefb 25.3 against 24.0 (conv-variants-nvrtc.json).
            # The implicit GEMM's own reduction cut in 2 runs (a variant tried) read 23.7 / 23.5
            return ConvPlan("im2col_flat", split=flat_split(geo))
        return ConvPlan("pointwise" if itemsize >= 4 and geo.OH * geo.OW >= POINTWISE_MIN_PIXELS
                        and geo.C < POINTWISE_MAX_CHANNEL_RATIO * geo.CO else "direct")
    cols = geo.N * geo.C * geo.KH * geo.KW * geo.OH * geo.OW * itemsize
    square = geo.stride[0] == geo.stride[1] and geo.dilation[0] == geo.dilation[1]
    if itemsize >= 4 and (cols <= IM2COL_FLAT_MAX_BYTES or not square):
        return ConvPlan("im2col_flat", split=flat_split(geo))
    if geo.CO >= IM2COL_FLAT_MIN_CO and (cols <= IM2COL_FLAT_MAX_BYTES or not square):
        return ConvPlan("im2col_rows")
    if square:
        # the implicit GEMM that the tiled and tensor-core contractions take; 16-bit padding read by masked
        # taps (the tensor-core fills take one division per k tile, tensor_core.k_parts; float32's tiles one
        # per element)
        return ConvPlan("direct_masked" if any(geo.pads) and itemsize < 4 else "direct")
    return ConvPlan("im2col_rows" if itemsize < 4 else "im2col_flat")


def conv_plan(geo: ConvGeometry, caps: Capabilities, itemsize: int = 4, static_batch: bool = True) -> ConvPlan:
    """The heuristic family: on a GPU `gpu_plan` (for elements of `itemsize` bytes); on the CPU depthwise
    where it applies, a 1x1 as a contraction of the input itself, the rest through columns. Measured on a
    2-core AVX-512 EPYC (batch 8, MobileNet sizes): a 24->72 pointwise layer 30.8 ms as the generic loop
    nest, 0.88 ms as a contraction (99 GFLOP/s); a stride-2 depthwise 3x3 over 72 channels 0.28 ms."""
    if caps.has_local:
        return gpu_plan(geo, itemsize, static_batch)
    if geo.depthwise:
        # the flat loop where it applies; no padded copy by default: at stride 1 the flat loop beats pad +
        # taps and masked taps (8x96x28x28 0.14 against 0.42 and 0.55 ms, 8x16x56x56 0.07 against 0.20 and
        # 0.34 ms, alone on a 2-core AVX-512 EPYC), and at stride 2 the masked taps beat pad + taps
        # (8x72x56x56 0.15 against 0.81 ms: the pad kernel's own masked loads gather); MOROK_BEAM times them all
        return ConvPlan("depthwise_flat" if flat_depthwise(geo) else "depthwise")
    if grouped_flat_applies(geo) and geo.OH * geo.OW >= GROUPED_FLAT_MIN_PIXELS:
        return ConvPlan("grouped_flat")
    m = cpu_winograd_default(geo, itemsize, static_batch, caps)
    if m:
        return ConvPlan("winograd", winograd=m, cpu_form=True)
    if direct_phases_default(geo, caps):
        return ConvPlan("direct_phases")
    if phases_flat_default(geo, caps, itemsize):
        return ConvPlan("phases_flat")
    return _contraction("pointwise" if geo.pointwise else "im2col_gemm", caps, geo)


# channels-last (kernels_nhwc.py): the forms of a one-group float32 layer whose activations are stored [N, H, W, C]
# on a CPU with a register tile of lane vectors: "pointwise" (an unpadded 1x1 layer over a channels-last input: the
# input itself is the contraction's left operand, a strided layer's rows every stride-th pixel's), "winograd" (F(2x2, 3x3) for stride-1 3x3 layers whose output
# sides are even and whose input has at least CHANNELS_LAST_WINOGRAD_MIN_CHANNELS channels), "taps" (a layer of
# several taps and few pixels, below) and "im2col" (every other layer: the [pixels, taps x channels] columns, then
# the contraction)
CHANNELS_LAST_WINOGRAD_MIN_CHANNELS = 16
# a strided 1x1 layer reads its input's pixels in place (a row's address computed once per row of the tile) instead
# of copying them into columns first
CHANNELS_LAST_STRIDED_POINTWISE = True
CHANNELS_LAST_FORMS = ("pointwise", "winograd", "im2col", "taps")
# ... a layer of several taps whose pixels fill fewer than CHANNELS_LAST_MIN_ROW_TILES rows of the register tile
# (resnet50's 7x7 stage: 49 pixels, 9 row tiles of 6, 4608 steps) does not contract its columns whole: few row tiles
# over a long reduction left most workers idle or re-reading their weight panel from L3 (on the 16-core Xeon, in
# launch order: the 512 -> 512 3x3 layers at 7x7 0.60 / 0.58 ms and the stride-2 one into 7x7 0.53 ms, profile_layers
# at b839d26). It takes "taps" where it has at most CHANNELS_LAST_RUN_MAX input channels: a zero-padded
# channels-last copy of its input, each tap's contraction over it read in place (every thread-split unit one tap of
# one column panel: a panel run of C steps that stays in the core's L2, every weight read once), the taps added by
# a last kernel with the epilogue; else (CHANNELS_LAST_TAPS off, or more channels) its columns are contracted in
# runs of at most CHANNELS_LAST_RUN_MAX steps the same way (`channels_last_runs`). benchmarks/model_variants.py,
# resnet50's replay on the 16-core Xeon (model_variants-runs.json, at 837cf5e): against CHANNELS_LAST_RUN_MAX 0 (the
# NCHW plans these layers had) 1.008x in 17 rounds (faster in 11; 1.056x and, at 068231a, 1.095x in 21 rounds on
# other instances), the columns in runs instead of taps 0.993x (a tie; 1.000x on the 2-vCPU Xeon, where RUN_MAX 0
# read 0.994x-1.010x). Per layer on the 16-core Xeon in launch order (profile_layers): the 3x3 512 -> 512 layers at
# 7x7 0.29 / 0.28 ms against onnxruntime's 0.31 / 0.33, the stride-2 one into 7x7 0.29 against 0.27 (NCHW before:
# 0.32-0.39). Up to 40 row tiles (the stride-2 layer into 14x14 as taps too) read as noise: at 837cf5e 40 took
# 0.979x of 16's time on the 16-core Xeon (17 rounds); at 068231a, 40 the default (model_variants-min-row-tiles.json
# for each Xeon), 16 took 0.976x of 40's there (21 rounds) and 0.956x on the 2-vCPU one (11 rounds, faster in 7), that
# layer alone and hot ran 1.09x-1.11x faster as taps there. A 1x1 layer's contraction stays one run: 4 runs took
# 0.989x of one on the 16-core Xeon (noise) and 1.038x on the 2-vCPU one (each of 8 column panels already a
# worker's; the runs' partial sums cost).
# CHANNELS_LAST_RUN_MAX 0: neither, such layers run NCHW
CHANNELS_LAST_MIN_ROW_TILES = 16
CHANNELS_LAST_RUN_MAX = 576
CHANNELS_LAST_TAPS = True
# the taps form's runs: a kernel row's taps one run (KH partial sums, not KH * KW: less to write and add) where its
# pixels are neighbours and the rows' units, column panels x KH, are at least CHANNELS_LAST_TAP_ROW_UNITS per worker;
# fewer, a run a tap (more units to balance). benchmarks/model_variants.py on the 16-core Xeon
# (model_variants-taps.json, at 112c5e6 where every taps layer took rows): a run a tap 0.978x of rows' time (17
# rounds, faster in 10; resnet50's 7x7 3x3 layers, 24 row units for 16 workers, alone and hot 0.195 against 0.224
# ms); on the 2-vCPU Xeon (two workers, 12 row units each), each layer's kernels alone and hot, interleaved, best of
# 9 (no file kept): rows 1.31 against 1.34 ms for the stride-2 512-channel layer into 7x7, 1.21 against 1.22 for a
# 7x7 one, 1.25 against 1.47 for the stride-2 256-channel one into 14x14
CHANNELS_LAST_TAP_ROWS = True
CHANNELS_LAST_TAP_ROW_UNITS = 2


def channels_last_plan(geo: ConvGeometry, caps: Capabilities, itemsize: int = 4,
                       input_channels_last: bool = True) -> "str | None":
    """The channels-last form of this layer (one of CHANNELS_LAST_FORMS), or None where there is none: a GPU,
    groups, 16-bit elements, output channels the register tile's width does not divide, a layer of several taps
    and few pixels (CHANNELS_LAST_MIN_ROW_TILES) where CHANNELS_LAST_RUN_MAX is 0. A pointwise layer over an NCHW
    input takes the columns (turning the input around), and so does a layer of few pixels whose taps the "taps"
    form does not take (`channels_last_runs` cuts its contraction into runs)."""
    if caps.has_local or not caps.register_tile or not caps.tile_lanes or itemsize != 4 or geo.groups != 1:
        return None
    if geo.CO % caps.register_tile[1]:
        return None
    if (geo.KH, geo.KW) == (1, 1) and not any(geo.pads) and input_channels_last and (
            geo.stride == (1, 1) or CHANNELS_LAST_STRIDED_POINTWISE):
        return "pointwise"
    if (geo.KH, geo.KW) == (3, 3) and geo.stride == (1, 1) and geo.dilation == (1, 1) and geo.OH % 2 == 0 \
            and geo.OW % 2 == 0 and geo.C >= CHANNELS_LAST_WINOGRAD_MIN_CHANNELS and input_channels_last:
        return "winograd"
    if _few_rows(geo, caps) and geo.KH * geo.KW > 1:
        if not CHANNELS_LAST_RUN_MAX:
            return None
        if CHANNELS_LAST_TAPS and geo.C <= CHANNELS_LAST_RUN_MAX:
            return "taps"
    return "im2col"


def _few_rows(geo: ConvGeometry, caps: Capabilities) -> bool:
    return -(-geo.N * geo.OH * geo.OW // caps.register_tile[0]) < CHANNELS_LAST_MIN_ROW_TILES


def channels_last_runs(geo: ConvGeometry, caps: Capabilities, form: str) -> int:
    """The runs a channels-last layer's contraction is cut into (1: none): for the columns of a layer of
    several taps and few pixels (CHANNELS_LAST_MIN_ROW_TILES), the fewest equal runs of at most
    CHANNELS_LAST_RUN_MAX steps (`k_run`); for the taps form KH (a kernel row each) or KH * KW (a tap each),
    CHANNELS_LAST_TAP_ROWS' rule for the target's workers."""
    if form == "taps":
        units = geo.CO // caps.register_tile[1] * geo.KH if caps.register_tile else 0
        rows = CHANNELS_LAST_TAP_ROWS and geo.dilation[1] == 1 and units >= CHANNELS_LAST_TAP_ROW_UNITS * caps.threads
        return geo.KH if rows else geo.KH * geo.KW
    if not CHANNELS_LAST_RUN_MAX or not caps.register_tile or form != "im2col" or geo.KH * geo.KW == 1 \
            or not _few_rows(geo, caps):
        return 1
    run = k_run(geo.C * geo.KH * geo.KW, CHANNELS_LAST_RUN_MAX)
    return geo.C * geo.KH * geo.KW // run if run else 1


def channels_last_candidates(geo: ConvGeometry, caps: Capabilities, itemsize: int = 4,
                             input_channels_last: bool = True) -> list[str]:
    """The channels-last forms MOROK_BEAM times for this layer, `channels_last_plan`'s first ([] where there is
    none): a Winograd or taps layer also through columns."""
    form = channels_last_plan(geo, caps, itemsize, input_channels_last)
    if form is None:
        return []
    return [form, "im2col"] if form in ("winograd", "taps") else [form]


# a strided one-group layer of at most DIRECT_PHASES_MAX_CHANNELS input channels and at least DIRECT_PHASES_MIN_TAPS
# taps whose output rows are at least the register tile's width: the direct sum over phase planes, whose copy of the input is its size where im2col's
# columns are KH*KW times it (resnet50's stem: 49x, 7.4 MB, written cold once an inference). resnet50's stem in the
# model, launch by launch: 0.34 ms against onnxruntime's 0.34 on the 16-core Xeon (im2col and the contraction had
# taken 0.47-0.49 against 0.29-0.33 on other instances), 1.5-1.8 against 2.5 ms on the 2-vCPU Xeon; the captured
# replay, the rule against DIRECT_PHASES_MAX_CHANNELS 0 in one process (benchmarks/model_variants.py,
# model_variants-direct-phases.json): 11.00 against 11.06 ms on the 16-core Xeon, 54.9 against 56.9 on the 2-vCPU
# one. With many channels the columns' one wide contraction wins: the stride-2 3x3 layers of 128-512 channels at
# 28x28 to 7x7 outputs took 1.5-4x longer as phase sums on two threads (rows of 28 or fewer pixels fill no tile).
# And only for kernels of at least DIRECT_PHASES_MIN_TAPS taps, whose columns multiply the input most: 3 channels
# stride 2, each form alone on the 2-vCPU Xeon's two threads, AVX2 code (x86-64-v3) / AVX-512 (v4), ms: 7x7 to 64
# channels at 224x224 2.96 / 2.19 against 3.57 / 2.53 through im2col, 5x5 to 32 0.89 / 0.61 against 1.06 / 0.83, but
# 3x3 to 64 0.97 / 0.60 against 0.92 / 0.57 and the MobileNet stack's first layer (3x3 to 16, batch 8 at 112x112)
# 0.77 against 0.64 on AVX2
DIRECT_PHASES_MAX_CHANNELS = 4
DIRECT_PHASES_MIN_TAPS = 25


def direct_phases_applies(geo: ConvGeometry) -> bool:
    """A one-group convolution (the family's kernels take one)."""
    return geo.groups == 1


def direct_phases_default(geo: ConvGeometry, caps: Capabilities) -> bool:
    """Whether the CPU heuristic takes direct_phases for this layer (the rule above)."""
    tile = caps.register_tile
    return (not caps.has_local and tile is not None and caps.tile_lanes > 0 and direct_phases_applies(geo)
            and max(geo.stride) > 1 and geo.C <= DIRECT_PHASES_MAX_CHANNELS and geo.KH * geo.KW >= DIRECT_PHASES_MIN_TAPS
            and geo.OW >= tile[1])


# a one-group, stride-1 layer of more than one tap whose output, as phases_flat's flat columns (each output row and
# the planes' padding after it, rounded up to whole lane vectors), fills at most PHASES_FLAT_MAX_COLUMNS columns an
# image, and either one column tile of the register tile or weights of at most PHASES_FLAT_REREAD_BYTES (each column
# tile reads all of them). On the 16-core AVX-512 Xeon (at 7dd8d27, where strided layers took it too), resnet50's
# captured replay 10.60 against 11.00 ms without the family (benchmarks/model_variants.py,
# cpu-xeon-avx512-16c/model_variants-phases-flat-resnet50.json), its 3x3 512 -> 512 layers at 7x7 in launch order
# (benchmarks/profile_layers.py's in-order timing of both plans in one process; no file kept) 357 / 351 against 442 /
# 428 us through im2col, the layer alone at 1.03x of onnxruntime's kernels (benchmarks/cpu_conv.py,
# cpu_conv-resnet50-3x3.json); but its stride-2 3x3 to 7x7 445 against 373 us, and on the 2-vCPU Xeon 1.76-1.91 ms
# against onnxruntime's 1.17-1.20 (cpu-xeon-avx512-2c/cpu_conv-resnet50-3x3.json): strided layers keep their columns.
# On the 2-vCPU hosts the 7x7 3x3 layers of many channels keep Winograd (taken first); densenet121's 128 -> 32 ones
# take the flat columns there: 48-59 us against onnxruntime's 51-58 as AVX-512 code, 68 against 49 as AVX2 (x86-64-v3,
# cpu_conv-resnet50-3x3-x86-64-v3.json), where pixel rows had them; the replays with and without the family sit within
# the host's noise there (model_variants-phases-flat-{resnet50,densenet121}.json: 45.8 against 45.1 ms, 38.0 against
# 37.4)
PHASES_FLAT_MAX_COLUMNS = 64
PHASES_FLAT_REREAD_BYTES = 512 << 10


def phase_planes(H: int, W: int, stride: tuple[int, int], pads: tuple[int, int, int, int]) -> tuple[int, int]:
    """(rows, columns) of each phase plane `kernels.phase_pad` writes: the zero-padded input's sides over the stride."""
    return -(-(H + pads[0] + pads[2]) // stride[0]), -(-(W + pads[1] + pads[3]) // stride[1])


# the flat columns of `kernels.conv2d_phases_flat` come in multiples of this many (AVX-512's 16 float lanes; AVX2's 8
# divide it): one image's columns are whole lane vectors, the last ones past the output reading zero rows below it
FLAT_COLUMN_MULTIPLE = 16


def phases_flat_geometry(H: int, W: int, KH: int, KW: int, stride: tuple[int, int], dilation: tuple[int, int],
                         pads: tuple[int, int, int, int]) -> tuple[tuple[int, int, int, int], int, int, int]:
    """(the phase planes' pads, their rows, their row length, the flat columns per image) of phases_flat: an output
    pixel (oy, ox) is flat column oy * row + ox of its image (the planes' row length, `phase_planes`), the columns
    run to a multiple of FLAT_COLUMN_MULTIPLE, and the bottom pad grows by whole plane rows until the farthest tap of
    the last column still reads inside its plane (zeros)."""
    (sh, sw), (dh, dw) = stride, dilation
    OH = (H + pads[0] + pads[2] - (KH - 1) * dh - 1) // sh + 1
    HQ, WQ = phase_planes(H, W, stride, pads)
    cols = -(-(OH * WQ) // FLAT_COLUMN_MULTIPLE) * FLAT_COLUMN_MULTIPLE
    reach = ((KH - 1) * dh // sh) * WQ + (KW - 1) * dw // sw + cols      # elements of a plane the taps read
    rows = max(HQ, -(-reach // WQ))
    return (pads[0], pads[1], max(pads[2], rows * sh - H - pads[0]), pads[3]), rows, WQ, cols


def phases_flat_columns(geo: ConvGeometry) -> int:
    """phases_flat's flat columns an image (`phases_flat_geometry`)."""
    return phases_flat_geometry(geo.H, geo.W, geo.KH, geo.KW, geo.stride, geo.dilation, geo.pads)[3]


def phases_flat_default(geo: ConvGeometry, caps: Capabilities, itemsize: int = 4) -> bool:
    """Whether the CPU heuristic takes phases_flat for this layer (the rule above)."""
    if (caps.has_local or caps.register_tile is None or caps.tile_lanes <= 0 or not direct_phases_applies(geo)
            or geo.KH * geo.KW == 1 or geo.stride != (1, 1)):
        return False
    cols = phases_flat_columns(geo)
    weights = geo.CO * geo.C * geo.KH * geo.KW * itemsize
    return cols <= PHASES_FLAT_MAX_COLUMNS and (cols <= caps.register_tile[1] or weights <= PHASES_FLAT_REREAD_BYTES)


def candidate_plans(geo: ConvGeometry, caps: Capabilities, itemsize: int = 4,
                    static_batch: bool = True) -> list[ConvPlan]:
    """The default plan first, then the valid alternatives a search times (Winograd only for a constant batch)."""
    out = [conv_plan(geo, caps, itemsize, static_batch)]
    for family in ("pointwise", "im2col_gemm") if geo.pointwise else ("im2col_gemm",):
        out.append(_contraction(family, caps, geo, pixel_rows=False))
        out.append(_contraction(family, caps))          # whole images
        if not caps.has_local and caps.register_tile is not None and caps.tile_lanes and geo.groups == 1:
            rows = _contraction(family, caps, geo, pixel_rows=True)
            K = geo.C * geo.KH * geo.KW
            out += [rows, replace(rows, k_run=0), replace(rows, k_run=k_run(K))]
    if geo.depthwise:
        out.append(ConvPlan("depthwise"))
        if not caps.has_local and flat_depthwise(geo):
            out.append(ConvPlan("depthwise_flat"))
        if any(geo.pads):
            out.append(ConvPlan("depthwise_padded"))
    if not caps.has_local and grouped_flat_applies(geo):
        out.append(ConvPlan("grouped_flat"))
    if not caps.has_local and direct_phases_applies(geo):
        out += [ConvPlan("direct_phases"), ConvPlan("phases_flat")]
    if caps.has_local and geo.groups > 1:
        out.append(ConvPlan("grouped_direct"))
    if caps.has_local and geo.groups == 1:
        out += [ConvPlan("im2col_flat"), ConvPlan("im2col_rows")]
        if flat_split(geo) > 1:
            out += [ConvPlan("im2col_flat", split=flat_split(geo)), ConvPlan("im2col_rows", split=flat_split(geo))]
    if caps.has_local and geo.pointwise:
        out.append(ConvPlan("pointwise"))
    out.append(ConvPlan("direct"))
    if caps.has_local and any(geo.pads):
        out.append(ConvPlan("direct_masked"))
    if itemsize >= 4 and static_batch:      # 16-bit elements would round the transformed tiles (G's sixths at m = 4)
        out += [ConvPlan("winograd", winograd=m, cpu_form=not caps.has_local) for m in WINOGRAD_TILES]
    seen: list[ConvPlan] = []
    for p in out:
        try:
            check_plan(p, geo)
        except ArgumentError:
            continue
        if p not in seen:
            seen.append(p)
    return seen


# Winograd F(m x m, 3 x 3): output tiles of these sides (kernels.WINOGRAD_MATRICES)
WINOGRAD_TILES = (4, 2)


def winograd_applies(geo: ConvGeometry, m: int, partial: bool = False) -> bool:
    """A 3x3, stride-1, undilated, one-group convolution whose output sides m divides; with `partial` (the
    CPU form's kernels: the last row and column of tiles masked) any output at least m a side."""
    fits = (geo.OH % m == 0 and geo.OW % m == 0) or (partial and geo.OH >= m and geo.OW >= m)
    return ((geo.KH, geo.KW) == (3, 3) and geo.stride == (1, 1) and geo.dilation == (1, 1) and geo.groups == 1
            and m in WINOGRAD_TILES and fits)


def check_plan(plan: ConvPlan, geo: ConvGeometry) -> None:
    """ArgumentError when the convolution cannot run as `plan`."""
    if plan.family == "pointwise" and not geo.pointwise:
        raise ArgumentError(f"{plan}: the convolution is not 1x1, stride 1 and unpadded")
    if plan.family in ("depthwise", "depthwise_flat", "depthwise_padded") and not geo.depthwise:
        raise ArgumentError(f"{plan}: the convolution is not depthwise")
    if plan.family == "depthwise_flat" and not flat_depthwise(geo):
        raise ArgumentError(f"{plan}: the flat loop takes stride 1, output rows as wide as the input's, a row "
                            f"and a column with every tap inside, at most {MAX_PEEL} border rows or columns a side")
    if plan.family in ("direct", "direct_masked") and (geo.groups != 1 or geo.stride[0] != geo.stride[1]
                                                       or geo.dilation[0] != geo.dilation[1]):
        raise ArgumentError(f"{plan}: the generic loop nest takes one group and square strides and dilations")
    if plan.family in ("im2col_flat", "im2col_rows") and geo.groups != 1:
        raise ArgumentError(f"{plan}: the flat columns take one group")
    if plan.family == "grouped_direct" and geo.groups == 1:
        raise ArgumentError(f"{plan}: the convolution has one group")
    if plan.family in ("direct_phases", "phases_flat") and not direct_phases_applies(geo):
        raise ArgumentError(f"{plan}: the sum over phase planes takes one group")
    if plan.family == "grouped_flat" and not grouped_flat_applies(geo):
        raise ArgumentError(f"{plan}: the flat loop takes groups of at most {GROUPED_FLAT_MAX_TERMS} terms (input "
                            f"channels x taps x output channels per group), stride 1 and the width kept")
    if plan.family == "winograd" and not winograd_applies(geo, plan.winograd, partial=plan.cpu_form):
        raise ArgumentError(f"{plan}: Winograd F({plan.winograd}x{plan.winograd}, 3x3) takes a 3x3 kernel, stride "
                            f"and dilation 1, one group and an output whose sides {plan.winograd} divides (the CPU "
                            f"form: at least {plan.winograd} a side)")
    if plan.pixel_rows and geo.groups != 1:
        raise ArgumentError(f"{plan}: pixel rows take one group")
    if plan.k_run and (geo.C * geo.KH * geo.KW) % plan.k_run:
        raise ArgumentError(f"{plan}: runs of {plan.k_run} do not divide the reduction of {geo.C * geo.KH * geo.KW}")
    if (geo.C // geo.groups * geo.KH * geo.KW) % plan.split:
        raise ArgumentError(f"{plan}: {plan.split} runs do not divide the reduction")
    if (geo.OH * geo.OW) % plan.pixel_blocks:
        raise ArgumentError(f"{plan}: {plan.pixel_blocks} blocks do not divide {geo.OH * geo.OW} output pixels")


# a candidate replaces the default only when this much faster (as codegen's schedule search: noise is no win)
PLAN_SWITCH_MARGIN = 0.03
_searched: dict[tuple, tuple[ConvPlan, dict[str, float]]] = {}
_searched_lock = threading.Lock()


def search_plan(geo: ConvGeometry, caps: Capabilities, time_plan: Callable[[ConvPlan], float],
                key: tuple = (), static_batch: bool = True, candidates: "Sequence | None" = None):
    """The fastest of `candidate_plans` (or of `candidates`, the default first: channels-last forms) by
    `time_plan` (seconds; it raises for a plan that cannot run) and every candidate's time, once per
    (geometry, target, `key`, candidates) in this process; the default stays unless a candidate is
    PLAN_SWITCH_MARGIN faster."""
    k = (geo, caps, key, static_batch, None if candidates is None else tuple(candidates))
    with _searched_lock:
        hit = _searched.get(k)
    if hit is not None:
        return hit
    plans = list(candidates) if candidates is not None else candidate_plans(geo, caps, static_batch=static_batch)
    times: dict[str, float] = {}
    for p in plans:
        try:
            times[str(p)] = time_plan(p)
        except ArgumentError:
            continue
    best = plans[0]
    for p in plans[1:]:
        if str(p) in times and times[str(p)] < times.get(str(best), float("inf")) * (1 - PLAN_SWITCH_MARGIN):
            best = p
    with _searched_lock:
        _searched[k] = (best, times)
    return best, times
