"""The GPU convolution families of codegen/strategies/conv.py: grouped_direct (`kernels.grouped_conv2d`),
im2col_flat and im2col_rows (`kernels.im2col_flat` + `kernels.flat_gemm`), beside direct and depthwise. Which plan a GPU
target takes; the kernels rendered for both CUDA pairs and run by the test interpreter (no GPU needed);
then on the device (marker `cuda`, both CUDA pairs) against a float64 numpy convolution: odd channel counts
and sizes, strides, padding, groups, epilogues, a symbolic batch, and the launch check refusing a short
buffer."""
from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

import linear_interp as LI
from conftest import PAIRS, conv_ref, open_target, random_array
from morok_py import dtypes
from morok_py import kernels as K
from morok_py.codegen.capabilities import Capabilities
from morok_py.codegen.strategies.conv import ConvGeometry, ConvPlan, candidate_plans, check_plan, conv_plan
from morok_py.dtypes import to_numpy
from morok_py.errors import ArgumentError
from morok_py.ir import AxisType, Ops

GPU = Capabilities(has_local=True, has_shared=True)




GROUPED = [
    ConvGeometry(2, 12, 7, 9, 18, 3, 3, (2, 1), (1, 1), (1, 1, 1, 1), groups=3),       # strided, 4 -> 6 a group
    ConvGeometry(1, 10, 6, 5, 15, 3, 2, (1, 2), (2, 1), (2, 0, 1, 3), groups=5),       # dilated, asymmetric
    ConvGeometry(2, 66, 5, 6, 6, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1), groups=2),        # 33 x 9 taps: a REDUCE range
    ConvGeometry(2, 16, 6, 7, 16, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1), groups=2),       # 8 in / 8 out: REDUCE, 8 outputs
    ConvGeometry(3, 6, 9, 7, 12, 1, 1, (1, 1), (1, 1), (0, 0, 0, 0), groups=3),        # grouped 1x1
]
DENSE = [
    ConvGeometry(2, 5, 9, 11, 7, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1)),
    ConvGeometry(1, 16, 13, 13, 24, 3, 3, (2, 2), (1, 1), (1, 1, 1, 1)),                # stride 2
    ConvGeometry(3, 8, 12, 10, 17, 3, 2, (1, 2), (2, 1), (2, 0, 1, 3)),                # dilated, asymmetric
    ConvGeometry(2, 7, 5, 5, 9, 1, 1, (2, 2)),                                         # 1x1 stride 2
]


def _gid(g: ConvGeometry) -> str:
    return f"{g.N}x{g.C}x{g.H}x{g.W}-{g.CO}x{g.KH}x{g.KW}-s{g.stride[0]}{g.stride[1]}-g{g.groups}"


# ---- plans --------------------------------------------------------------------------------------------

def test_a_gpu_takes_grouped_direct_for_groups_and_im2col_flat_for_wide_layers():
    assert conv_plan(GROUPED[0], GPU) == ConvPlan("grouped_direct")
    assert conv_plan(ConvGeometry(2, 8, 9, 9, 8, 3, 3, pads=(1, 1, 1, 1), groups=8), GPU) == ConvPlan("grouped_direct")
    wide, narrow = ConvGeometry(2, 64, 9, 9, 512, 3, 3, pads=(1, 1, 1, 1)), ConvGeometry(2, 64, 9, 9, 64, 3, 3)
    assert conv_plan(wide, GPU) == ConvPlan("im2col_flat", split=2)           # 64x64 tiles: 3 x 8 groups, k 576
    assert conv_plan(wide, GPU, 2) == ConvPlan("im2col_rows")
    assert conv_plan(narrow, GPU).family == "im2col_flat"                     # float32: columns at any width
    assert conv_plan(narrow, GPU, 2) == ConvPlan("direct")                    # 16-bit: the implicit GEMM
    padded = ConvGeometry(2, 64, 9, 9, 64, 3, 3, pads=(1, 1, 1, 1))
    assert conv_plan(padded, GPU, 2) == ConvPlan("direct_masked")            # ... its padding read masked
    assert {ConvPlan("direct"), ConvPlan("direct_masked")} <= set(candidate_plans(padded, GPU, 2))
    assert ConvPlan("direct_masked") not in candidate_plans(padded, Capabilities())       # a GPU family
    small = ConvGeometry(32, 512, 7, 7, 512, 3, 3, pads=(1, 1, 1, 1))
    assert conv_plan(small, GPU) == ConvPlan("im2col_flat", split=4)
    assert conv_plan(small, GPU, 2) == ConvPlan("im2col_rows")
    assert conv_plan(ConvGeometry(2, 16, 9, 9, 16, 3, 3, (1, 2)), GPU, 2) == ConvPlan("im2col_rows")   # non-square
    assert conv_plan(ConvGeometry(2, 64, 9, 9, 512, 1, 1), GPU) == ConvPlan("direct")     # 1x1, few pixels
    # float32 1x1 whose tiles are few (98 x 4 groups of 64x64): flat columns, the reduction in 2 runs
    assert conv_plan(ConvGeometry(32, 1024, 14, 14, 256, 1, 1), GPU) == ConvPlan("im2col_flat", split=2)
    assert conv_plan(ConvGeometry(32, 1024, 14, 14, 256, 1, 1), GPU, 2) == ConvPlan("direct")
    assert conv_plan(ConvGeometry(1, 1024, 14, 14, 256, 1, 1), GPU) == ConvPlan("direct")     # one image
    assert conv_plan(ConvGeometry(2, 64, 32, 32, 64, 1, 1), GPU) == ConvPlan("pointwise")
    assert conv_plan(ConvGeometry(2, 64, 32, 32, 64, 1, 1), GPU, 2) == ConvPlan("direct")
    # float32 1x1 over many pixels: the direct form from POINTWISE_MAX_CHANNEL_RATIO input channels per output one
    from morok_py.codegen.strategies.conv import POINTWISE_MAX_CHANNEL_RATIO
    assert POINTWISE_MAX_CHANNEL_RATIO == 4
    assert conv_plan(ConvGeometry(32, 256, 56, 56, 64, 1, 1), GPU) == ConvPlan("direct")
    assert conv_plan(ConvGeometry(32, 255, 56, 56, 64, 1, 1), GPU) == ConvPlan("pointwise")
    assert conv_plan(ConvGeometry(32, 256, 56, 56, 128, 1, 1), GPU) == ConvPlan("pointwise")
    assert conv_plan(ConvGeometry(32, 64, 56, 56, 256, 1, 1), GPU) == ConvPlan("pointwise")
    assert candidate_plans(narrow, GPU, 2)[0] == ConvPlan("direct")
    huge = ConvGeometry(256, 64, 56, 56, 64, 3, 3, pads=(1, 1, 1, 1))             # 1.8 GB of float32 columns
    assert conv_plan(huge, GPU) == ConvPlan("direct")
    assert {"im2col_flat", "im2col_rows", "direct"} <= {p.family for p in candidate_plans(DENSE[0], GPU)}
    assert ConvPlan("grouped_direct") in candidate_plans(GROUPED[0], GPU)
    cpu = Capabilities()
    assert ConvPlan("grouped_direct") not in candidate_plans(GROUPED[0], cpu)
    assert ConvPlan("im2col_flat") not in candidate_plans(DENSE[0], cpu)
    with pytest.raises(ArgumentError, match="one group"):
        check_plan(ConvPlan("grouped_direct"), DENSE[0])
    with pytest.raises(ArgumentError, match="one group"):
        check_plan(ConvPlan("im2col_flat"), GROUPED[0])


def test_flat_split_cuts_the_reduction_where_the_tiles_are_few():
    from morok_py.codegen.strategies.conv import flat_split
    assert flat_split(ConvGeometry(32, 512, 7, 7, 512, 3, 3, pads=(1, 1, 1, 1))) == 4      # 200 groups -> 800
    assert flat_split(ConvGeometry(32, 256, 14, 14, 256, 3, 3, pads=(1, 1, 1, 1))) == 2    # 392 -> 784
    assert flat_split(ConvGeometry(32, 64, 56, 56, 64, 3, 3, pads=(1, 1, 1, 1))) == 1      # 1568 groups
    assert flat_split(ConvGeometry(1, 8, 5, 5, 8, 3, 3)) == 1                              # k = 72: too short
    with pytest.raises(ArgumentError, match="split"):
        ConvPlan("direct", split=2)
    with pytest.raises(ArgumentError, match="divide"):
        check_plan(ConvPlan("im2col_flat", split=4), DENSE[0])                             # k = 45


def test_grouped_outputs_per_work_item():
    assert K.grouped_outputs(4, 4, 3, 3) == 4           # 36 taps unrolled x 4 outputs
    assert K.grouped_outputs(4, 12, 3, 3) == 6
    assert K.grouped_outputs(8, 8, 3, 3) == 8           # ResNeXt 32x8d: channels a REDUCE range, 9 taps x 8
    assert K.grouped_outputs(33, 3, 3, 3) == 3
    assert K.grouped_outputs(1, 1, 3, 3) == 1           # depthwise
    with pytest.raises(ArgumentError):
        K.grouped_conv2d(1, 66, 5, 5, 6, 3, 3, 2, per=4)


def test_grouped_tiles_per_work_item():
    assert K.grouped_tile(8, 8, 3, 3, 28, 28) == (4, 2)       # ResNeXt 32x8d: 8 outputs x 8 pixels
    assert K.grouped_tile(8, 8, 3, 3, 14, 14) == (2, 2)       # the largest divisors up to 4 rows, 2 columns
    assert K.grouped_tile(8, 8, 3, 3, 7, 13) == (1, 1)        # prime sides: one pixel
    assert K.grouped_tile(4, 4, 3, 3, 28, 28) == (1, 1)       # 36 taps unrolled: the schedule vectorizes the pixels
    assert K.grouped_tile(32, 32, 3, 3, 28, 28) == (2, 1)     # 32 outputs: at most 64 accumulators
    assert K.grouped_tile(16, 16, 3, 3, 12, 12) == (4, 1)
    with pytest.raises(ArgumentError):
        K.grouped_conv2d(1, 16, 6, 6, 16, 3, 3, 2, pads=(1, 1, 1, 1), tile=(4, 1))     # 4 rows do not divide 6


# grouped convolutions whose channels are a REDUCE range, each in an explicit tile of output pixels (rows,
# columns): odd sides, a stride, a dilation, fewer outputs per work-item than a group has
TILED = [
    (ConvGeometry(2, 24, 12, 10, 24, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1), groups=3), (4, 2), None),
    (ConvGeometry(3, 20, 9, 15, 10, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1), groups=2), (3, 5), None),
    (ConvGeometry(2, 18, 13, 11, 12, 3, 3, (2, 1), (1, 1), (1, 1, 1, 1), groups=2), (7, 1), 3),
    (ConvGeometry(1, 14, 10, 9, 14, 3, 2, (1, 2), (2, 1), (2, 0, 1, 3), groups=2), (3, 3), None),
]


def _tiled_step(geo: ConvGeometry, tile, per, dt, N=None):
    ast = K.grouped_conv2d(N, geo.C, geo.H, geo.W, geo.CO, geo.KH, geo.KW, geo.groups, geo.stride, geo.dilation,
                           geo.pads, dt, per=per, tile=tile)
    return [K.KernelStep("grouped", ast, ("x", "w"), "out", geo.N * geo.CO * geo.OH * geo.OW,
                         (("N", geo.N),) if N is None else ())]


def _tid(case) -> str:
    return f"{_gid(case[0])}-t{case[1][0]}x{case[1][1]}-per{case[2]}"


@pytest.mark.parametrize("pair", [0, 1], ids=["nvrtc", "llvm-nvptx"])
@pytest.mark.parametrize("case", TILED, ids=_tid)
def test_grouped_tiles_in_the_interpreter(rng, pair, case):
    geo, tile, per = case
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32)
    w = random_array(rng, (geo.CO, geo.C // geo.groups, geo.KH, geo.KW), np.float32)
    steps = _tiled_step(geo, tile, per, dtypes.float32)
    got = _interpret(steps, {"x": x, "w": w}, pair, np.float32, geo.N)
    np.testing.assert_allclose(got.reshape(geo.N, geo.CO, geo.OH, geo.OW), conv_ref(x, w, None, geo),
                               rtol=1e-4, atol=1e-4)


# ---- the test interpreter, both CUDA pairs ------------------------------------------------------------

def _interpret(steps, arrays: dict, pair: int, npdt, N: int, schedules: dict | None = None,
               arch: str = "sm_90") -> np.ndarray:
    """Each step rendered for `arch` by `pair` and run by the test interpreter; `schedules` (step name ->
    Schedule) replace a step's default schedule."""
    from morok_py.backends.cuda.device import compile_only_pairs
    from morok_py.codegen.schedule import using
    r, _ = compile_only_pairs(arch)[pair]
    bufs = dict(arrays)
    for st in steps:
        sched = (schedules or {}).get(st.name)
        with using(sched):
            spec = r.render(st.ast, f"conv_{st.name}")
        if sched is not None:
            assert spec.linear.schedule == sched
        out = np.zeros(st.elements, to_numpy(st.dtype) if st.dtype is not None else npdt)
        ins = [bufs[n].ravel() for n in st.inputs if n != "epilogue"]
        vals = {k: v for k, v in st.vars}
        writes = LI.run(spec.linear, spec.launch, ins + [out], vals)
        assert (writes[len(ins)] == 1).all(), f"{st.name}: not every output written once"
        bufs[st.output] = out
    return bufs["out"]


@pytest.mark.parametrize("pair", [0, 1], ids=["nvrtc", "llvm-nvptx"])
def test_rows_columns_store_a_pixels_taps_as_vectors(rng, pair):
    """im2col_rows' columns: a work-item writes 8 halves (16 bytes) of a pixel's taps and gathers them, in
    flight together. Where the channels come in blocks (48 channels: 3 blocks of 16, 32 bytes) the columns
    are tap-major, col[(n, oh, ow), (kh, kw, c)], the block's channels innermost and the batch's pixels
    next, so a vector's lanes differ in the channel alone and share the tap's divisions; the weights step
    reorders the filters to match. Otherwise (5 channels: 45 taps) the (c, kh, kw) taps keep the lanes and
    the unaligned rows run lane by lane. Symbolic batch, against numpy."""
    from morok_py.backends.cuda.device import compile_only_pairs
    from morok_py.ir import Ops
    r, _ = compile_only_pairs("sm_90")[pair]
    for geo, block in ((ConvGeometry(3, 48, 9, 11, 8, 3, 3, (2, 2), (1, 1), (1, 1, 1, 1)), 16), (DENSE[0], 0)):
        assert K.im2col_channel_block(geo.C, dtypes.float16) == block
        steps = K.conv2d_kernels(geo, ConvPlan("im2col_rows"), dtypes.float16, symbolic_batch=True)
        names = [(st.name, st.inputs) for st in steps]
        assert names == ([("weights", ("w",))] if block else []) + [
            ("im2col", ("x",)), ("gemm", ("col", "wt" if block else "w", "epilogue"))]
        step = steps[-2]
        ranges = sorted((u for u in step.ast.toposort() if u.op is Ops.RANGE), key=lambda u: u.arg[0])
        ends = [u.src[0].arg if u.src[0].op is Ops.CONST else "N" for u in ranges]
        # tap-major: (tap, channel block, the batch's pixels N*OH*OW, a block's channels); else (N, OH*OW, taps)
        assert ends == ([9, geo.C // block, "N", block] if block else ["N", geo.OH * geo.OW, geo.C * 9]), ends
        spec = r.render(step.ast, "cols")
        assert spec.linear.schedule.vector_width == 8
        divisions = len(re.findall(r" [/%] \d+\)|[su](?:div|rem) i32", spec.src))
        if block:       # the work-item's grid, pixel and tap splits, none a lane: the (c, kh, kw) taps take 4 a lane
            assert divisions <= 8, spec.src
        else:
            assert divisions >= 8 * 4
        x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32).astype(np.float16)
        got = _interpret([replace(step, output="out")], {"x": x}, pair, np.float16, geo.N)
        xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
        want = np.stack([xp[:, :, kh:kh + geo.stride[0] * geo.OH:geo.stride[0], kw:kw + geo.stride[1] * geo.OW:geo.stride[1]]
                         for kh in range(3) for kw in range(3)], axis=2)              # [N, C, 9, OH, OW]
        order = (0, 3, 4, 2, 1) if block else (0, 3, 4, 1, 2)                        # (tap, c) or (c, tap)
        np.testing.assert_array_equal(got.reshape(geo.N * geo.OH * geo.OW, -1),
                                      want.transpose(*order).reshape(geo.N * geo.OH * geo.OW, -1))


@pytest.mark.parametrize("pair", [0, 1], ids=["nvrtc", "llvm-nvptx"])
@pytest.mark.parametrize("geo", GROUPED[:4], ids=_gid)
def test_grouped_direct_in_the_interpreter(rng, pair, geo):
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32)
    w = random_array(rng, (geo.CO, geo.C // geo.groups, geo.KH, geo.KW), np.float32)
    steps = K.conv2d_kernels(geo, ConvPlan("grouped_direct"), symbolic_batch=True)
    Cg, COg = geo.C // geo.groups, geo.CO // geo.groups
    rows, cols = K.grouped_tile(Cg, COg, geo.KH, geo.KW, geo.OH, geo.OW)
    assert len(steps[0].ast.src) == K.grouped_outputs(Cg, COg, geo.KH, geo.KW) * rows * cols
    got = _interpret(steps, {"x": x, "w": w}, pair, np.float32, geo.N)
    np.testing.assert_allclose(got.reshape(geo.N, geo.CO, geo.OH, geo.OW), conv_ref(x, w, None, geo),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pair", [0, 1], ids=["nvrtc", "llvm-nvptx"])
@pytest.mark.parametrize("dt", ["float32", "float16"])
@pytest.mark.parametrize("plan", [ConvPlan("im2col_flat"), ConvPlan("im2col_rows"), ConvPlan("im2col_flat", split=3),
                                  ConvPlan("im2col_rows", split=9)], ids=str)
@pytest.mark.parametrize("geo", DENSE[:2], ids=_gid)
def test_flat_columns_in_the_interpreter(rng, pair, dt, plan, geo):
    d_t = getattr(dtypes, dt)
    npdt = to_numpy(d_t)
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32).astype(npdt)
    w = (random_array(rng, (geo.CO, geo.C, geo.KH, geo.KW), np.float32) / 4).astype(npdt)
    steps = K.conv2d_kernels(geo, plan, d_t, symbolic_batch=True)
    got = _interpret(steps, {"x": x, "w": w}, pair, npdt, geo.N)
    ref = conv_ref(x, w, None, geo)
    tol = 1e-4 if dt == "float32" else 2e-3
    np.testing.assert_allclose(got.astype(np.float64).reshape(ref.shape), ref, rtol=tol, atol=tol * np.abs(ref).max())


# ---- tensor-core tiles fitted to the output channels (sm_90a) ------------------------------------------

def _main_schedule(geo: ConvGeometry, plan: ConvPlan, arch: str = "sm_90a"):
    from morok_py.backends.cuda.device import compile_only_pairs
    r, _ = compile_only_pairs(arch)[0]
    steps = K.conv2d_kernels(geo, plan, dtypes.float16)
    main = [st for st in steps if st.name in ("direct", "gemm")][-1]
    return r.render(main.ast, "s").linear.schedule


def test_the_tensor_core_tile_fits_the_output_channels():
    """A block no wider than the output channels: 64x64 mma.sync blocks over 64 channels, 128x128 blocks of
    64x64 warps over 128 (where they make TC_STATIC_WIDE_MIN_BLOCKS blocks), wgmma blocks 64 or 128 wide
    over the columns' 64 or 128 channels; sm_80 keeps mma.sync."""
    from morok_py.codegen.strategies.tensor_core import (MMA_M16N8K16, TC_SMALL_TILE, TC_TILE_STATIC,
                                                         TC_TILE_STATIC_WIDE, WGMMA)
    from morok_py.codegen.strategies.wgmma import WG_TILE_MID, WG_TILE_NARROW
    c64 = ConvGeometry(32, 64, 56, 56, 64, 3, 3, pads=(1, 1, 1, 1))
    c128 = ConvGeometry(32, 128, 28, 28, 128, 3, 3, pads=(1, 1, 1, 1))
    s = _main_schedule(c64, ConvPlan("direct"))
    assert (s.tensor_core, s.matmul_tile) == (MMA_M16N8K16, TC_SMALL_TILE)
    from morok_py.codegen.strategies.tensor_core import TC_MASKED_NARROW_TILE
    s = _main_schedule(c64, ConvPlan("direct_masked"))                        # masked fills: 128 rows a block
    assert (s.tensor_core, s.matmul_tile) == (MMA_M16N8K16, TC_MASKED_NARROW_TILE)
    assert _main_schedule(c128, ConvPlan("direct_masked")).matmul_tile == TC_TILE_STATIC_WIDE
    s = _main_schedule(c128, ConvPlan("direct"))
    assert (s.tensor_core, s.matmul_tile) == (MMA_M16N8K16, TC_TILE_STATIC_WIDE)
    few = ConvGeometry(2, 128, 28, 28, 128, 3, 3, pads=(1, 1, 1, 1))           # 13 blocks of 128x128
    assert _main_schedule(few, ConvPlan("direct")).matmul_tile == TC_SMALL_TILE
    wide = ConvGeometry(32, 256, 28, 28, 256, 3, 3, pads=(1, 1, 1, 1))
    assert _main_schedule(wide, ConvPlan("direct")).matmul_tile == TC_TILE_STATIC      # over 128 columns: unchanged
    for geo, tile in ((c64, WG_TILE_NARROW), (c128, WG_TILE_MID)):
        for family in ("im2col_rows", "im2col_flat"):
            s = _main_schedule(geo, ConvPlan(family))
            assert (s.tensor_core, s.matmul_tile) == (WGMMA, tile), (family, geo.CO)
    s = _main_schedule(c64, ConvPlan("direct"), "sm_80")
    assert (s.tensor_core, s.matmul_tile) == (MMA_M16N8K16, TC_SMALL_TILE)
    s = _main_schedule(c128, ConvPlan("im2col_rows"), "sm_80")
    assert s.tensor_core == MMA_M16N8K16


def test_block_counts_pick_the_wider_tiles():
    """98 blocks of 128x128 take them over 196 of 64x128 (wgmma) or 64x64 (mma.sync); 52 do not."""
    from morok_py.codegen.strategies.tensor_core import TC_TILE_STATIC_WIDE
    from morok_py.codegen.strategies.wgmma import WG_TILE_MID, WG_TILE_SMALL
    s14 = ConvGeometry(32, 256, 14, 14, 256, 3, 3, pads=(1, 1, 1, 1))
    assert _main_schedule(s14, ConvPlan("im2col_rows")).matmul_tile == WG_TILE_MID
    s7 = ConvGeometry(32, 512, 7, 7, 512, 3, 3, pads=(1, 1, 1, 1))
    assert _main_schedule(s7, ConvPlan("im2col_rows")).matmul_tile == WG_TILE_SMALL
    p14 = ConvGeometry(32, 1024, 14, 14, 256, 1, 1)
    assert _main_schedule(p14, ConvPlan("direct")).matmul_tile == TC_TILE_STATIC_WIDE


def test_float32_contractions_over_few_columns_take_half_width_blocks():
    """float32 flat columns' contraction over 64 or 128 output channels: 128 x 64 blocks (small_shapes.FEW_COLUMNS);
    over 256 the usual tiles."""
    from morok_py.backends.cuda.device import compile_only_pairs
    r, _ = compile_only_pairs("sm_90a")[0]
    for co, want in ((64, (128, 64, 16, 8, 4)), (128, (128, 64, 16, 8, 4))):
        geo = ConvGeometry(32, co, 56, 56, co, 3, 3, pads=(1, 1, 1, 1))
        steps = K.conv2d_kernels(geo, ConvPlan("im2col_flat"), dtypes.float32)
        assert r.render(steps[-1].ast, "s").linear.schedule.matmul_tile == want, co
    geo = ConvGeometry(32, 256, 28, 28, 256, 3, 3, pads=(1, 1, 1, 1))
    steps = K.conv2d_kernels(geo, ConvPlan("im2col_flat"), dtypes.float32)
    assert r.render(steps[-1].ast, "s").linear.schedule.matmul_tile[1] == 128


@pytest.mark.parametrize("pair", [0, 1], ids=["nvrtc", "llvm-nvptx"])
def test_half_width_float32_blocks_in_the_interpreter(rng, pair):
    """The 128 x 64 float32 tile over 70 output channels (clamped columns, a k tail), both pairs, against numpy."""
    from morok_py.codegen.schedule import Schedule
    geo = ConvGeometry(2, 7, 9, 11, 70, 3, 3, pads=(1, 1, 1, 1))
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32)
    w = random_array(rng, (geo.CO, geo.C, geo.KH, geo.KW), np.float32)
    steps = K.conv2d_kernels(geo, ConvPlan("im2col_flat"), dtypes.float32)
    sched = Schedule("tiled", group=256, matmul_tile=(128, 64, 16, 8, 4), async_fill=True)
    got = _interpret(steps, {"x": x, "w": w}, pair, np.float32, geo.N, {"gemm": sched}, "sm_90a")
    np.testing.assert_allclose(got.reshape(geo.N, geo.CO, geo.OH, geo.OW), conv_ref(x, w, None, geo),
                               rtol=1e-4, atol=1e-4)


def _tc_schedule(tile, mma):
    from morok_py.codegen.schedule import Schedule
    from morok_py.codegen.strategies.tensor_core import tc_threads
    stages, swizzle = (8, True) if mma == "wgmma_m64k16" else (0, False)
    return Schedule("tiled", group=tc_threads(tile, mma), matmul_tile=tile, tensor_core=mma, tc_stages=stages,
                    tc_swizzle=swizzle)


@pytest.mark.parametrize("pair", [0, 1], ids=["nvrtc", "llvm-nvptx"])
@pytest.mark.parametrize("which", ["direct-small", "direct-static-wide", "rows-wgmma-narrow"])
def test_the_fitted_tiles_in_the_interpreter(rng, pair, which):
    """float16 under the tiles the heuristic now takes, odd sizes (the blocks clamped at every edge, a k tail),
    rendered by both pairs and interpreted against numpy."""
    from morok_py.codegen.strategies.tensor_core import MMA_M16N8K16, TC_SMALL_TILE, TC_TILE_STATIC_WIDE, WGMMA
    from morok_py.codegen.strategies.wgmma import WG_TILE_NARROW
    if which == "rows-wgmma-narrow":
        geo, plan, step, sched = (ConvGeometry(2, 8, 9, 11, 72, 3, 3, pads=(1, 1, 1, 1)), ConvPlan("im2col_rows"),
                                  "gemm", _tc_schedule(WG_TILE_NARROW, WGMMA))
    else:
        tile = TC_SMALL_TILE if which == "direct-small" else TC_TILE_STATIC_WIDE
        geo, plan, step, sched = (ConvGeometry(2, 5, 9, 11, 21, 3, 3, pads=(1, 1, 1, 1)), ConvPlan("direct"),
                                  "direct", _tc_schedule(tile, MMA_M16N8K16))
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32).astype(np.float16)
    w = (random_array(rng, (geo.CO, geo.C, geo.KH, geo.KW), np.float32) / 4).astype(np.float16)
    steps = K.conv2d_kernels(geo, plan, dtypes.float16)
    got = _interpret(steps, {"x": x, "w": w}, pair, np.float16, geo.N, {step: sched}, "sm_90a")
    ref = conv_ref(x, w, None, geo)
    np.testing.assert_allclose(got.astype(np.float64).reshape(ref.shape), ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())


# an unpadded 1x1 implicit GEMM whose pixels per image are a multiple of 8: its rows (image, row, column) split by
# // and % keep 8-element runs in one image, so both tiles fill by 16-byte copies (the pipelined forms); 144 and
# 72 pixels an image put images apart inside one 64- or 128-row tile
PIPELINED = [ConvGeometry(3, 72, 12, 12, 64, 1, 1), ConvGeometry(5, 40, 6, 12, 72, 1, 1)]


@pytest.mark.parametrize("pair", [0, 1], ids=["nvrtc", "llvm-nvptx"])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("geo", PIPELINED, ids=_gid)
def test_a_pipelined_1x1_implicit_gemm_in_the_interpreter(rng, pair, arch, geo):
    """The float16 direct plan of a 1x1 layer may take 16-byte (cp.async) fills where the pixels per image are a
    multiple of 8: warpgroup tensor cores on sm_90a, mma.sync with a cp.async pipeline on sm_80 (the schedules a
    search times; resnet50's 56x56 layer takes the warpgroup form by default); tiles whose rows span two images;
    against numpy. 7 x 7 pixels an image keep the unstaged fills by default."""
    from morok_py.backends.cuda.device import compile_only_pairs
    from morok_py.codegen.scan import scan_kernel
    from morok_py.codegen.schedule import candidate_schedules
    r, _ = compile_only_pairs(arch)[pair]
    mma = "wgmma_m64k16" if arch == "sm_90a" else "mma_m16n8k16"

    def pipelined(g):
        ast = r.render(K.conv2d_kernels(g, ConvPlan("direct"), dtypes.float16)[-1].ast, "p").ast
        return [sc for sc in candidate_schedules(ast, r.caps, scan_kernel(ast)) if sc.tc_stages >= 2
                and sc.tensor_core == mma]
    def default(g):
        return r.render(K.conv2d_kernels(g, ConvPlan("direct"), dtypes.float16)[-1].ast, "d").linear.schedule
    big = default(ConvGeometry(32, 256, 56, 56, 64, 1, 1))
    assert big.tc_stages >= 2 and big.tensor_core == mma
    assert not default(ConvGeometry(32, 256, 7, 7, 64, 1, 1)).tc_stages
    steps = K.conv2d_kernels(geo, ConvPlan("direct"), dtypes.float16)
    sched = pipelined(geo)[0]
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32).astype(np.float16)
    w = (random_array(rng, (geo.CO, geo.C, 1, 1), np.float32) / 4).astype(np.float16)
    got = _interpret(steps, {"x": x, "w": w}, pair, np.float16, geo.N, {"direct": sched}, arch=arch)
    ref = conv_ref(x, w, None, geo)
    np.testing.assert_allclose(got.astype(np.float64).reshape(ref.shape), ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())


@pytest.mark.parametrize("pair", [0, 1], ids=["nvrtc", "llvm-nvptx"])
@pytest.mark.parametrize("geo", [ConvGeometry(3, 20, 6, 6, 24, 1, 1), ConvGeometry(3, 40, 12, 12, 72, 1, 1)], ids=_gid)
def test_a_float32_1x1_implicit_gemm_with_vector_fills_in_the_interpreter(rng, pair, geo):
    """float32 1x1 layers whose images have a multiple of 4 pixels (36, 144): the shared-memory tiles fill
    4-element runs of pixel i % P as one copy (the default schedule's cp.async fills), 64-row tiles spanning
    images; against numpy."""
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32)
    w = random_array(rng, (geo.CO, geo.C, 1, 1), np.float32) / 4
    steps = K.conv2d_kernels(geo, ConvPlan("direct"), dtypes.float32)
    got = _interpret(steps, {"x": x, "w": w}, pair, np.float32, geo.N, arch="sm_80")
    ref = conv_ref(x, w, None, geo)
    np.testing.assert_allclose(got.astype(np.float64).reshape(ref.shape), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


# direct_masked: the zero padding read by masked tile fills. Input channels a multiple of 32 run tap-major (a
# weights step first; a k tile holds one tap), others keep (c, kh, kw); odd sizes, a k tail, stride 2, dilation,
# asymmetric pads
MASKED = [ConvGeometry(2, 32, 7, 9, 21, 3, 3, pads=(1, 1, 1, 1)),
          ConvGeometry(1, 64, 9, 9, 24, 3, 3, (2, 2), (1, 1), (1, 1, 1, 1)),
          ConvGeometry(1, 32, 8, 7, 17, 3, 2, (1, 1), (2, 2), (2, 0, 1, 3)),
          ConvGeometry(2, 5, 9, 11, 21, 3, 3, pads=(1, 1, 1, 1))]


def test_direct_masked_reorders_the_weights_where_the_channels_allow():
    for geo in MASKED:
        steps = K.conv2d_kernels(geo, ConvPlan("direct_masked"), dtypes.float16, symbolic_batch=True)
        assert [st.name for st in steps] == (["weights", "direct"] if geo.C % K.TAP_MAJOR_CHANNELS == 0 else ["direct"])
        assert steps[-1].inputs[1] == ("wt" if geo.C % K.TAP_MAJOR_CHANNELS == 0 else "w")
        assert dict(steps[0].vars) == ({} if len(steps) == 2 else {"N": geo.N})    # the weights take no batch


def test_direct_masked_takes_the_tensor_cores_and_one_division_per_k_tile():
    """The masked 16-bit operand fills the tensor-core tiles; tap-major, the tap (k // C) is computed from the
    tile's first k, not per element: the nvrtc source of a 32-channel layer divides by 32 a few times, where
    the (c, kh, kw) order divides every element's k by 9."""
    from morok_py.backends.cuda.device import compile_only_pairs
    r, _ = compile_only_pairs("sm_90a")[0]
    geo = ConvGeometry(32, 64, 56, 56, 64, 3, 3, pads=(1, 1, 1, 1))
    steps = K.conv2d_kernels(geo, ConvPlan("direct_masked"), dtypes.float16)
    spec = r.render(steps[-1].ast, "masked")
    assert spec.linear.schedule.tensor_core == "mma_m16n8k16"
    assert len(re.findall(r"/ 64\)", spec.src)) <= 8 and "/ 9)" not in spec.src
    assert "/ 9)" in r.render(K.conv2d(32, 64, 56, 56, 64, 3, 3, dtype=dtypes.float16, pads=(1, 1, 1, 1)), "cm").src


@pytest.mark.parametrize("pair", [0, 1], ids=["nvrtc", "llvm-nvptx"])
@pytest.mark.parametrize("tile", [None, "small", "masked-narrow", "static-wide"])
@pytest.mark.parametrize("geo", MASKED, ids=_gid)
def test_direct_masked_in_the_interpreter(rng, pair, tile, geo):
    """float16 under the default schedule (symbolic batch) and the fitted tiles (64x64, 128x64 of 64x32 warps,
    128x128 of 64x64 warps), float32 under the default; both pairs against numpy."""
    from morok_py.codegen.strategies.tensor_core import (MMA_M16N8K16, TC_MASKED_NARROW_TILE, TC_SMALL_TILE,
                                                         TC_TILE_STATIC_WIDE)
    for dt in ("float16", "float32") if tile is None else ("float16",):
        d_t, npdt = getattr(dtypes, dt), np.dtype(dt)
        x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32).astype(npdt)
        w = (random_array(rng, (geo.CO, geo.C, geo.KH, geo.KW), np.float32) / 4).astype(npdt)
        steps = K.conv2d_kernels(geo, ConvPlan("direct_masked"), d_t, symbolic_batch=tile is None)
        sched = None if tile is None else {
            "direct": _tc_schedule({"small": TC_SMALL_TILE, "masked-narrow": TC_MASKED_NARROW_TILE,
                                    "static-wide": TC_TILE_STATIC_WIDE}[tile], MMA_M16N8K16)}
        got = _interpret(steps, {"x": x, "w": w}, pair, npdt, geo.N, sched, "sm_90a")
        ref = conv_ref(x, w, None, geo)
        tol = 1e-4 if dt == "float32" else 3e-3
        np.testing.assert_allclose(got.astype(np.float64).reshape(ref.shape), ref, rtol=tol,
                                   atol=tol * np.abs(ref).max())


WINOGRAD = [ConvGeometry(2, 20, 12, 16, 24, 3, 3, pads=(1, 1, 1, 1)),      # both tiles
            ConvGeometry(1, 9, 10, 6, 5, 3, 3, pads=(0, 1, 2, 1)),          # 10x6 out: 2x2 tiles only
            ConvGeometry(3, 6, 8, 12, 7, 3, 3, pads=(1, 1, 1, 1))]          # input channels looped, output ones not


def test_a_gpu_takes_winograd_for_wide_float32_3x3_layers_of_a_constant_batch():
    """float32 3x3 stride-1 layers with >= WINOGRAD_MIN_CHANNELS channels and enough output tiles: 4x4 tiles where
    the sides allow, else 2x2 (4x4 also from WINOGRAD_4X4_MIN_CHANNELS where the flat columns fit); not for fewer
    channels, 16-bit elements, few tiles or a symbolic batch (whose plan then is the flat columns), and a Winograd
    plan asked for a symbolic batch is refused."""
    from morok_py.codegen.strategies.conv import WINOGRAD_MIN_CHANNELS
    l28 = ConvGeometry(32, 128, 28, 28, 128, 3, 3, pads=(1, 1, 1, 1))
    l14 = ConvGeometry(32, 256, 14, 14, 256, 3, 3, pads=(1, 1, 1, 1))
    assert WINOGRAD_MIN_CHANNELS == 128
    assert conv_plan(l28, GPU) == ConvPlan("winograd", winograd=4)
    assert conv_plan(l14, GPU) == ConvPlan("winograd", winograd=2)
    assert conv_plan(l28, GPU, static_batch=False).family == "im2col_flat"
    assert all(p.family != "winograd" for p in candidate_plans(l28, GPU, static_batch=False))
    assert conv_plan(l28, GPU, 2).family != "winograd"
    # 4x4 tiles from WINOGRAD_4X4_MIN_CHANNELS where the flat columns would fit; 2x2 tiles not below 128 channels
    from morok_py.codegen.strategies.conv import WINOGRAD_4X4_MIN_CHANNELS
    assert WINOGRAD_4X4_MIN_CHANNELS == 64
    assert conv_plan(ConvGeometry(32, 64, 56, 56, 64, 3, 3, pads=(1, 1, 1, 1)), GPU) == ConvPlan("winograd", winograd=4)
    assert conv_plan(ConvGeometry(32, 64, 56, 56, 63, 3, 3, pads=(1, 1, 1, 1)), GPU).family == "im2col_flat"
    assert conv_plan(ConvGeometry(32, 64, 54, 54, 64, 3, 3, pads=(1, 1, 1, 1)), GPU).family == "im2col_flat"  # 2x2 only
    assert conv_plan(ConvGeometry(256, 64, 56, 56, 64, 3, 3, pads=(1, 1, 1, 1)), GPU).family == "direct"  # 1.8 GB
    assert conv_plan(ConvGeometry(4, 64, 56, 56, 64, 3, 3, pads=(1, 1, 1, 1)), GPU).family == "im2col_flat"  # 784 tiles
    assert conv_plan(ConvGeometry(1, 128, 28, 28, 128, 3, 3, pads=(1, 1, 1, 1)), GPU).family == "im2col_flat"
    assert [st.name for st in K.conv2d_kernels(l28, caps=GPU, symbolic_batch=True)][-1] == "gemm"
    with pytest.raises(ArgumentError, match="static batch"):
        K.conv2d_kernels(l28, ConvPlan("winograd", winograd=4), symbolic_batch=True)


@pytest.mark.parametrize("pair", [0, 1], ids=["nvrtc", "llvm-nvptx"])
def test_the_gpu_winograd_transforms_take_one_tile_per_work_item(pair):
    """The GPU form of the transforms: no elementwise vector plan (it took 4 tiles per work-item), one tile or filter
    per work-item with WINOGRAD_GPU_CHANNEL_LOOP channels in a loop, the input transform's work-items of a warp on
    neighbouring tiles (the x dimension spans every image's tiles)."""
    from morok_py.backends.cuda.device import compile_only_pairs
    from morok_py.codegen.strategies.conv import WINOGRAD_GPU_CHANNEL_LOOP
    r, _ = compile_only_pairs("sm_90")[pair]
    for geo, m in ((ConvGeometry(32, 128, 28, 28, 128, 3, 3, pads=(1, 1, 1, 1)), 4),
                   (ConvGeometry(32, 256, 14, 14, 256, 3, 3, pads=(1, 1, 1, 1)), 2)):
        T = geo.N * (geo.OH // m) * (geo.OW // m)
        for st in K.conv2d_kernels(geo, ConvPlan("winograd", winograd=m)):
            if st.name == "gemm":
                continue
            spec = r.render(st.ast, st.name)
            assert spec.linear.schedule.vector_width == 1, st.name
            loops = [u for u in st.ast.toposort() if u.op is Ops.RANGE and u.arg[1] is AxisType.LOOP]
            assert [u.src[0].arg for u in loops] == [WINOGRAD_GPU_CHANNEL_LOOP], st.name
            if st.name == "input":
                assert spec.global_size[0] * spec.local_size[0] == T


@pytest.mark.parametrize("pair", [0, 1], ids=["nvrtc", "llvm-nvptx"])
@pytest.mark.parametrize("geo", WINOGRAD, ids=_gid)
def test_winograd_in_the_interpreter(rng, pair, geo):
    """Each Winograd tile the geometry takes, its four kernels rendered by both pairs under their default GPU
    schedules (every output written once) against numpy, a bias/relu epilogue in the output transform."""
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32)
    w = random_array(rng, (geo.CO, geo.C, 3, 3), np.float32) / 4
    b = random_array(rng, (geo.CO,), np.float32)
    ref = np.maximum(conv_ref(x, w, None, geo) + b.reshape(1, -1, 1, 1), 0)
    plans = [p for p in candidate_plans(geo, GPU) if p.family == "winograd"]
    assert plans
    for plan in plans:
        steps = K.conv2d_kernels(geo, plan, epilogue=K.Epilogue.of("bias", "relu"))
        # _interpret reads each input by its role: the epilogue's one operand (the bias) gets the role "b"
        steps = [st if "epilogue" not in st.inputs else K.KernelStep(st.name, st.ast, tuple(
            "b" if r == "epilogue" else r for r in st.inputs), st.output, st.elements, st.vars, st.dtype)
            for st in steps]
        got = _interpret(steps, {"x": x, "w": w, "b": b}, pair, np.float32, geo.N, None, "sm_90a")
        np.testing.assert_allclose(got.reshape(ref.shape), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(),
                                   err_msg=str(plan))


# ---- on the device ------------------------------------------------------------------------------------

CUDA_PAIRS = [p for p in PAIRS if p.values[0][0] == "CUDA" and p.values[0][1] != "mlir"]


@pytest.fixture(params=CUDA_PAIRS)
def gpu(request):
    return open_target(*request.param)


def _run(target, steps, arrays: dict, dt, epilogue_arrays=()):
    bufs = {k: target.buf(v) for k, v in arrays.items()}
    for st in steps:
        ins = []
        for role in st.inputs:
            ins += [target.buf(a) for a in epilogue_arrays] if role == "epilogue" else [bufs[role]]
        bufs[st.output] = target.empty(st.elements, st.dtype or dt)
        target.compile(st.ast, f"conv_{st.name}")(*ins, bufs[st.output], **dict(st.vars))
    return bufs["out"].numpy()


FAMILY_CASES = ([("grouped_direct", g) for g in GROUPED] + [("im2col_flat", g) for g in DENSE]
                + [("im2col_rows", g) for g in DENSE] + [(ConvPlan("im2col_flat", split=3), g) for g in DENSE[:2]]
                + [(ConvPlan("im2col_rows", split=9), DENSE[1])]
                + [("direct", g) for g in DENSE if g.stride[0] == g.stride[1] and g.dilation[0] == g.dilation[1]]
                + [("direct_masked", g) for g in DENSE[:2] + MASKED]
                + [("depthwise", ConvGeometry(2, 7, 11, 9, 7, 3, 3, (2, 1), (1, 1), (1, 1, 1, 1), groups=7))])


@pytest.mark.cuda
@pytest.mark.parametrize("dt", ["float32", "float16"])
@pytest.mark.parametrize("case", FAMILY_CASES, ids=lambda c: f"{c[0]}-{_gid(c[1])}")
def test_each_gpu_family_on_the_device(gpu, rng, dt, case):
    plan, geo = case
    plan = ConvPlan(plan) if isinstance(plan, str) else plan
    d_t = getattr(dtypes, dt)
    npdt = to_numpy(d_t)
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32).astype(npdt)
    w = (random_array(rng, (geo.CO, geo.C // geo.groups, geo.KH, geo.KW), np.float32) / 4).astype(npdt)
    steps = K.conv2d_kernels(geo, plan, d_t, symbolic_batch=True)
    got = _run(gpu, steps, {"x": x, "w": w}, d_t)
    ref = conv_ref(x, w, None, geo)
    tol = 1e-4 if dt == "float32" else 3e-3
    np.testing.assert_allclose(got.astype(np.float64).reshape(ref.shape), ref, rtol=tol, atol=tol * np.abs(ref).max())


@pytest.mark.cuda
@pytest.mark.parametrize("dt", ["float32", "float16"])
@pytest.mark.parametrize("case", TILED, ids=_tid)
def test_grouped_tiles_on_the_device(gpu, rng, dt, case):
    """Explicit tiles of output pixels, a symbolic batch, float32 accumulation for float16."""
    geo, tile, per = case
    d_t = getattr(dtypes, dt)
    npdt = to_numpy(d_t)
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32).astype(npdt)
    w = (random_array(rng, (geo.CO, geo.C // geo.groups, geo.KH, geo.KW), np.float32) / 4).astype(npdt)
    got = _run(gpu, _tiled_step(geo, tile, per, d_t), {"x": x, "w": w}, d_t)
    ref = conv_ref(x, w, None, geo)
    tol = 1e-4 if dt == "float32" else 3e-3
    np.testing.assert_allclose(got.astype(np.float64).reshape(ref.shape), ref, rtol=tol, atol=tol * np.abs(ref).max())


@pytest.mark.cuda
@pytest.mark.parametrize("geo", WINOGRAD, ids=_gid)
def test_winograd_on_the_device(gpu, rng, geo):
    """Every Winograd tile the geometry takes, float32, a constant batch, a bias/residual/relu epilogue."""
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32)
    w = random_array(rng, (geo.CO, geo.C, 3, 3), np.float32) / 4
    b = random_array(rng, (geo.CO,), np.float32)
    r = random_array(rng, (geo.N, geo.CO, geo.OH, geo.OW), np.float32)
    ref = np.maximum(conv_ref(x, w, None, geo) + b.reshape(1, -1, 1, 1) + r, 0)
    for plan in [p for p in candidate_plans(geo, gpu.dev.renderer.caps) if p.family == "winograd"]:
        steps = K.conv2d_kernels(geo, plan, epilogue=K.Epilogue.of("bias", "add", "relu"))
        got = _run(gpu, steps, {"x": x, "w": w}, dtypes.float32, (b, r))
        np.testing.assert_allclose(got.reshape(ref.shape), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(),
                                   err_msg=str(plan))


# a constant batch takes the fitted tiles by default: float16 64x64 over 40 channels, 128x128 of 64x64 warps over
# 100 (132 blocks of 128x128), wgmma 128x64 over the columns' 64 (on sm_90a); float32 128x64 over 100
FITTED_CASES = [("direct", ConvGeometry(2, 24, 41, 37, 40, 3, 3, pads=(1, 1, 1, 1)), "float16"),
                ("direct", ConvGeometry(3, 24, 75, 75, 100, 3, 3, pads=(1, 1, 1, 1)), "float16"),
                ("im2col_rows", ConvGeometry(3, 16, 41, 39, 64, 3, 3, pads=(1, 1, 1, 1)), "float16"),
                ("im2col_flat", ConvGeometry(3, 16, 41, 39, 100, 3, 3, pads=(1, 1, 1, 1)), "float32"),
                ("direct_masked", ConvGeometry(2, 32, 41, 37, 40, 3, 3, pads=(1, 1, 1, 1)), "float16"),
                ("direct_masked", ConvGeometry(3, 64, 45, 43, 100, 3, 3, (2, 2), (1, 1), (1, 1, 1, 1)), "float16")]


@pytest.mark.cuda
@pytest.mark.parametrize("case", FITTED_CASES, ids=lambda c: f"{c[0]}-{_gid(c[1])}-{c[2]}")
def test_the_fitted_tiles_on_the_device(gpu, rng, case):
    family, geo, dt = case
    d_t, npdt = getattr(dtypes, dt), np.dtype(dt)
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32).astype(npdt)
    w = (random_array(rng, (geo.CO, geo.C, geo.KH, geo.KW), np.float32) / 4).astype(npdt)
    steps = K.conv2d_kernels(geo, ConvPlan(family), d_t)
    sched = gpu.dev.renderer.render(steps[-1].ast, "s").linear.schedule
    assert sched is not None and sched.mapping == "tiled" and (sched.tensor_core is not None) == (dt == "float16"), sched
    got = _run(gpu, steps, {"x": x, "w": w}, d_t)
    ref = conv_ref(x, w, None, geo)
    tol = 1e-4 if dt == "float32" else 3e-3
    np.testing.assert_allclose(got.astype(np.float64).reshape(ref.shape), ref, rtol=tol, atol=tol * np.abs(ref).max())


@pytest.mark.cuda
@pytest.mark.parametrize("geo", [GROUPED[0], ConvGeometry(3, 9, 10, 11, 260, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1))],
                         ids=_gid)
def test_the_default_plan_with_an_epilogue_and_every_batch(gpu, rng, geo):
    """The plan the device picks (grouped_direct; im2col_flat from 256 output channels), bias + relu in the
    kernel that writes the output, one set of kernels for batches 1, 3 and 2."""
    from dataclasses import replace
    plan = conv_plan(geo, gpu.dev.renderer.caps)
    assert plan.family in ("grouped_direct", "im2col_flat")
    epi = K.Epilogue.of("bias", "relu")
    for N in (1, 3, 2):
        g = replace(geo, N=N)
        steps = K.conv2d_kernels(g, plan, dtypes.float32, epi, symbolic_batch=True)
        x = random_array(rng, (N, g.C, g.H, g.W), np.float32)
        w = random_array(rng, (g.CO, g.C // g.groups, g.KH, g.KW), np.float32)
        b = random_array(rng, (g.CO,), np.float32)
        got = _run(gpu, steps, {"x": x, "w": w}, dtypes.float32, [b])
        np.testing.assert_allclose(got.reshape(N, g.CO, g.OH, g.OW), np.maximum(conv_ref(x, w, b, g), 0),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("family,geo", [("grouped_direct", GROUPED[0]), ("im2col_flat", DENSE[0]),
                                        ("im2col_rows", DENSE[1]), ("direct_masked", MASKED[0])])
def test_the_launch_check_guards_every_buffer(gpu, rng, family, geo):
    from morok_py.errors import LaunchError
    steps = K.conv2d_kernels(geo, ConvPlan(family), dtypes.float32, symbolic_batch=True)
    st = steps[-1]
    prog = gpu.compile(st.ast, f"conv_{st.name}")
    ins = {"x": geo.N * geo.C * geo.H * geo.W, "w": geo.CO * (geo.C // geo.groups) * geo.KH * geo.KW,
           "col": geo.N * geo.C * geo.KH * geo.KW * geo.OH * geo.OW, "wt": geo.CO * geo.C * geo.KH * geo.KW}
    names = [n for n in st.inputs if n != "epilogue"] + [st.output]
    sizes = [ins.get(n, st.elements) for n in names]
    for short in range(len(names)):
        bufs = [gpu.empty(n - (1 if i == short else 0), dtypes.float32) for i, n in enumerate(sizes)]
        with pytest.raises(LaunchError):
            prog(*bufs, **dict(st.vars))


def test_the_onnx_executor_keeps_a_split_plans_scratches_apart(monkeypatch):
    """A split plan has two scratches live at once (the columns and the partial sums): the executor's
    scratch per (role, dtype) must not hand both the same buffer. Run on the CPU with the plan forced."""
    onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed")
    from onnx import helper
    from morok_py.onnx import OnnxExecutor
    from morok_py.onnx import fuse
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 16, 6, 7)).astype(np.float32)
    w = rng.standard_normal((12, 16, 3, 3)).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", 1, x.shape)],
                              [helper.make_empty_tensor_value_info("y")],
                              [onnx.numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    monkeypatch.setattr(fuse, "conv_plan", lambda geo, caps, *a, **k: ConvPlan("im2col_flat", split=4))
    got = OnnxExecutor(model, "CPU").run({"x": x})[0]
    geo = ConvGeometry(2, 16, 6, 7, 12, 3, 3, pads=(1, 1, 1, 1))
    np.testing.assert_allclose(got, conv_ref(x, w, None, geo), rtol=1e-4, atol=1e-4)


# a grouped 1x1 convolution of light shufflenet (68 channels a group): many reductions per work-item, whose
# split schedule asked for 1.9 MB of shared memory and failed to load on an H200
SHUFFLE = ConvGeometry(1, 272, 7, 7, 272, 1, 1, groups=4)


@pytest.mark.parametrize("pair", [0, 1], ids=["nvrtc", "llvm-nvptx"])
def test_many_reductions_per_item_keep_within_the_split_shared_memory(rng, pair):
    from morok_py.backends.cuda.device import compile_only_pairs
    from morok_py.codegen.strategies.split_reduce import SPLIT_SHARED_MAX
    r, _ = compile_only_pairs("sm_90a")[pair]
    steps = K.conv2d_kernels(SHUFFLE, conv_plan(SHUFFLE, r.caps))
    assert conv_plan(SHUFFLE, r.caps).family == "grouped_direct"
    for st in steps:
        spec = r.render(st.ast, f"conv_{st.name}")
        dyn = [int(m) for m in re.findall(r"morok_dyn_smem = (?:addrspace\(1\) global i32 )?(\d+)", spec.src)]
        assert all(d <= SPLIT_SHARED_MAX for d in dyn), f"{st.name}: {dyn} bytes of dynamic shared memory"
    x = random_array(rng, (SHUFFLE.N, SHUFFLE.C, SHUFFLE.H, SHUFFLE.W), np.float32)
    w = random_array(rng, (SHUFFLE.CO, SHUFFLE.C // SHUFFLE.groups, 1, 1), np.float32)
    got = _interpret(steps, {"x": x, "w": w}, pair, np.float32, SHUFFLE.N)
    np.testing.assert_allclose(got.reshape(1, SHUFFLE.CO, 7, 7), conv_ref(x, w, None, SHUFFLE), rtol=1e-4, atol=1e-4)


def test_a_split_over_the_shared_memory_bound_is_refused():
    from morok_py.codegen.schedule import Schedule, check_schedule, default_schedule
    from morok_py.codegen.scan import scan_kernel
    from morok_py.backends.cuda.device import compile_only_pairs
    r, _ = compile_only_pairs("sm_90a")[0]
    ast = K.conv2d_kernels(SHUFFLE, ConvPlan("grouped_direct"))[0].ast
    caps = r.caps
    assert default_schedule(ast, caps, scan_kernel(ast)).split <= 1
    with pytest.raises(ArgumentError, match="shared memory"):
        check_schedule(Schedule("groups", group=1024, unroll=4, split=32, upcast=7), ast, caps, scan_kernel(ast))


def test_rows_columns_past_the_grid_are_refused_by_name():
    """im2col_rows' tap-major columns put the batch's pixels on the grid's y (64 a work-group): a symbolic batch
    whose pixels need more than CUDA's 65535 groups there is refused by the launch check, naming the dimension
    and the limit, before anything reaches a device; a batch within it gets its dims."""
    from morok_py.backends.cuda.device import compile_only_pairs
    from morok_py.errors import LaunchError
    r, _ = compile_only_pairs("sm_90")[0]
    geo = ConvGeometry(1, 256, 56, 56, 256, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1))
    step = [st for st in K.conv2d_kernels(geo, ConvPlan("im2col_rows"), dtypes.float16, symbolic_batch=True)
            if st.name == "im2col"][0]
    info = r.render(step.ast, "cols").launch
    gs, ls = info.launch_dims({"N": 32})
    assert gs[1] * ls[1] >= 32 * 56 * 56 and gs[1] <= 65535
    with pytest.raises(LaunchError, match=r"dimension 1, over the device limit 65535"):
        info.launch_dims({"N": 2048})          # 2048 * 3136 pixels: 100352 groups of 64
