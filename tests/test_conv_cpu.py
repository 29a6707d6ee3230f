"""The CPU convolution family (codegen/strategies/conv.py, `kernels.conv2d_kernels`): every plan gives
numpy's answer for odd sizes, strides, dilations, groups and asymmetric padding, at every x86-64 level
the host runs; the pooling kernels the same; the heuristic picks the family the geometry calls for."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from morok_py import dtypes, kernels as K
from morok_py.codegen.strategies.conv import (CPU_WINOGRAD_PARTIAL_MAX_THREADS, CPU_WINOGRAD_PARTIAL_MIN_SIDE,
                                              CPU_WINOGRAD_PARTIAL_MIN_VECTORS,
                                              CPU_WINOGRAD_TILE, ConvGeometry, ConvPlan,
                                              candidate_plans, check_plan, conv_plan, k_run)
from morok_py.errors import ArgumentError

from conftest import conv_ref, random_array, run_steps




GEOMETRIES = [
    # N, C, H, W, CO, KH, KW, stride, dilation, pads (top, left, bottom, right), groups
    ConvGeometry(2, 5, 7, 9, 11, 1, 1),                                        # pointwise
    ConvGeometry(1, 6, 5, 13, 9, 1, 1, groups=3),                              # grouped pointwise
    ConvGeometry(2, 3, 11, 10, 7, 3, 3, (2, 2), (1, 1), (1, 1, 1, 1)),         # strided, padded
    ConvGeometry(1, 4, 13, 12, 5, 3, 2, (1, 2), (2, 1), (2, 0, 1, 3)),         # dilated, asymmetric
    ConvGeometry(3, 6, 9, 9, 10, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1), groups=2),  # grouped
    ConvGeometry(2, 7, 9, 11, 5, 1, 1, (2, 2)),                                # 1x1 stride 2
    ConvGeometry(2, 7, 11, 9, 7, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1), groups=7),  # depthwise
    ConvGeometry(1, 5, 14, 13, 5, 5, 3, (2, 1), (2, 1), (2, 1, 3, 0), groups=5),  # depthwise, dilated
    ConvGeometry(2, 3, 8, 8, 6, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1), groups=3),   # channel multiplier 2
    # stride-1 depthwise keeping the width: one flat loop over a plane's inner rows, peeled borders
    ConvGeometry(3, 5, 13, 17, 5, 3, 3, (1, 1), (2, 2), (2, 2, 2, 2), groups=5),  # dilated
    ConvGeometry(2, 3, 9, 11, 3, 5, 3, (1, 1), (1, 1), (1, 1, 3, 1), groups=3),   # 5x3, asymmetric rows
    ConvGeometry(1, 4, 6, 5, 4, 3, 3, (1, 1), (1, 1), (2, 0, 0, 2), groups=4),    # padded on one side
    ConvGeometry(2, 3, 2, 7, 3, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1), groups=3),    # no inner row: masked taps
    ConvGeometry(1, 2, 19, 23, 2, 5, 5, (1, 1), (1, 1), (2, 2, 2, 2), groups=2),  # 5x5
    # grouped, stride 1, the width kept: one flat loop per (image, group) over its output planes
    ConvGeometry(2, 8, 29, 31, 12, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1), groups=4),  # 2 in, 3 out per group
    ConvGeometry(1, 6, 13, 12, 9, 3, 3, (1, 1), (2, 2), (2, 2, 2, 2), groups=3),  # dilated
]


def _gid(g: ConvGeometry) -> str:
    return (f"n{g.N}c{g.C}h{g.H}w{g.W}o{g.CO}k{g.KH}x{g.KW}s{g.stride[0]}{g.stride[1]}"
            f"d{g.dilation[0]}{g.dilation[1]}p{''.join(map(str, g.pads))}g{g.groups}")


@pytest.mark.parametrize("geo", GEOMETRIES, ids=_gid)
def test_every_plan_matches_numpy_at_every_level(cpu_level, rng, geo):
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32)
    w = random_array(rng, (geo.CO, geo.C // geo.groups, geo.KH, geo.KW), np.float32)
    want = conv_ref(x, w, None, geo)
    plans = candidate_plans(geo, cpu_level.dev.renderer.caps)
    assert plans[0] == conv_plan(geo, cpu_level.dev.renderer.caps) and len(plans) >= 1 + (geo.groups == 1 and geo.stride[0] == geo.stride[1])
    for plan in plans:
        got = run_steps(cpu_level, K.conv2d_kernels(geo, plan), {"x": x, "w": w})
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-4, err_msg=str(plan))


EPILOGUES = [
    (K.Epilogue.of("bias", "relu"), lambda v, b, r: np.maximum(v + b, 0)),
    (K.Epilogue.of("bias", ("clip", 0.0, 6.0)), lambda v, b, r: np.clip(v + b, 0, 6)),
    (K.Epilogue.of("bias", "add", "relu"), lambda v, b, r: np.maximum(v + b + r, 0)),
    (K.Epilogue.of("bias", "hardswish"), lambda v, b, r: (v + b) * np.clip((v + b) / 6 + 0.5, 0, 1)),
    (K.Epilogue.of("bias", "silu"), lambda v, b, r: (v + b) / (1 + np.exp(-(v + b)))),
    (K.Epilogue.of("sigmoid", "mul"), lambda v, b, r: r / (1 + np.exp(-v))),
]


@pytest.mark.parametrize("geo", [GEOMETRIES[0], GEOMETRIES[2], GEOMETRIES[6], GEOMETRIES[10], GEOMETRIES[14]], ids=_gid)
@pytest.mark.parametrize("case", range(len(EPILOGUES)))
def test_the_epilogue_runs_in_the_kernel_that_writes_the_output(cpu, rng, geo, case):
    epi, ref = EPILOGUES[case]
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32)
    w = random_array(rng, (geo.CO, geo.C // geo.groups, geo.KH, geo.KW), np.float32)
    b = random_array(rng, (geo.CO,), np.float32)
    r = random_array(rng, (geo.N, geo.CO, geo.OH, geo.OW), np.float32)
    operands = [{"bias": b, "add": r, "mul": r}[o] for o in epi.operands]
    want = ref(conv_ref(x, w, None, geo), b[None, :, None, None], r)
    steps = K.conv2d_kernels(geo, conv_plan(geo, cpu.dev.renderer.caps), epilogue=epi)
    assert sum(st.output == "out" for st in steps) == 1
    got = run_steps(cpu, steps, {"x": x, "w": w}, operands)
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-4)


def _pool_ref(kind, x, k, s, d, pads, include_pad):
    pt, pl, pb, pr = pads
    fill = -np.inf if kind == "max" else 0.0
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pt, pb), (pl, pr)), constant_values=fill)
    ones = np.pad(np.ones(x.shape[2:]), ((pt, pb), (pl, pr)))
    OH = (xp.shape[2] - (k[0] - 1) * d[0] - 1) // s[0] + 1
    OW = (xp.shape[3] - (k[1] - 1) * d[1] - 1) // s[1] + 1
    wins = [xp[:, :, a * d[0]: a * d[0] + (OH - 1) * s[0] + 1: s[0], b * d[1]: b * d[1] + (OW - 1) * s[1] + 1: s[1]]
            for a in range(k[0]) for b in range(k[1])]
    if kind == "max":
        return np.max(wins, axis=0)
    cnt = k[0] * k[1] if include_pad else sum(ones[a * d[0]: a * d[0] + (OH - 1) * s[0] + 1: s[0],
                                                   b * d[1]: b * d[1] + (OW - 1) * s[1] + 1: s[1]]
                                              for a in range(k[0]) for b in range(k[1]))
    return np.sum(wins, axis=0) / cnt


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("k,s,d,pads,include_pad", [((3, 3), (2, 2), (1, 1), (1, 1, 1, 1), False),
                                                     ((2, 3), (1, 2), (2, 1), (0, 1, 1, 0), True),
                                                     ((3, 3), (1, 1), (1, 1), (0, 0, 0, 0), False)])
def test_pooling_matches_numpy_at_every_level(cpu_level, rng, kind, k, s, d, pads, include_pad):
    N, C, H, W = 2, 3, 11, 13
    x = random_array(rng, (N, C, H, W), np.float32)
    want = _pool_ref(kind, x, k, s, d, pads, include_pad)
    ast = K.pool2d(kind, N, C, H, W, k[0], k[1], s, d, pads, include_pad)
    out = cpu_level.empty(want.size, dtypes.float32)
    cpu_level.compile(ast, f"pool_{kind}")(cpu_level.buf(x), out)
    np.testing.assert_allclose(out.numpy().reshape(want.shape), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_global_pooling_matches_numpy_at_every_level(cpu_level, rng, kind):
    x = random_array(rng, (3, 5, 7, 9), np.float32)
    out = cpu_level.empty(15, dtypes.float32)
    cpu_level.compile(K.global_pool(kind, 15, 63), f"gpool_{kind}")(cpu_level.buf(x), out)
    want = x.reshape(15, 63).max(1) if kind == "max" else x.reshape(15, 63).astype(np.float64).mean(1)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)


def test_the_heuristic_picks_the_family_the_geometry_calls_for(cpu):
    caps = cpu.dev.renderer.caps
    assert conv_plan(GEOMETRIES[0], caps).family == "pointwise"
    assert conv_plan(GEOMETRIES[2], caps).family == "im2col_gemm"      # strided
    assert conv_plan(replace(GEOMETRIES[2], stride=(1, 1), H=5, W=5), caps).family == "phases_flat"   # 48 flat columns
    assert conv_plan(replace(GEOMETRIES[2], stride=(1, 1)), caps).family == "im2col_gemm"     # 11x10: 144 columns
    assert conv_plan(GEOMETRIES[5], caps).family == "im2col_gemm"
    assert conv_plan(GEOMETRIES[6], caps).family == "depthwise_flat"
    assert conv_plan(GEOMETRIES[7], caps).family == "depthwise"
    assert {ConvPlan("depthwise"), ConvPlan("depthwise_padded")} <= set(candidate_plans(GEOMETRIES[6], caps))
    plan = conv_plan(GEOMETRIES[0], caps)
    assert plan.register_tile == caps.register_tile and str(plan).startswith("ConvPlan(pointwise")


@pytest.mark.parametrize("geo,blocks", [
    (ConvGeometry(2, 5, 23, 29, 7, 1, 1), 23),                                        # pointwise, blocks of 29
    (ConvGeometry(1, 6, 15, 21, 9, 1, 1, groups=3), 5),                               # grouped pointwise
    (ConvGeometry(3, 3, 29, 27, 5, 3, 3, (2, 2), (1, 1), (1, 1, 1, 1)), 14),          # strided stem, 15x14 out
    (ConvGeometry(2, 4, 13, 11, 6, 3, 3, (1, 1), (2, 1), (2, 1, 2, 1), groups=2), 11),  # dilated, grouped
], ids=lambda v: _gid(v) if isinstance(v, ConvGeometry) else str(v))
def test_pixel_blocks_split_each_image_and_match_numpy_at_every_level(cpu_level, rng, geo, blocks):
    caps = cpu_level.dev.renderer.caps
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32)
    w = random_array(rng, (geo.CO, geo.C // geo.groups, geo.KH, geo.KW), np.float32)
    b = random_array(rng, (geo.CO,), np.float32)
    want = conv_ref(x, w, b, geo)
    family = "pointwise" if geo.pointwise else "im2col_gemm"
    plan = ConvPlan(family, caps.register_tile, caps.tile_lanes, blocks)
    assert f"pixel_blocks={blocks}" in str(plan)
    for symbolic in (False, True):
        steps = K.conv2d_kernels(geo, plan, epilogue=K.Epilogue.of("bias"), symbolic_batch=symbolic)
        got = run_steps(cpu_level, steps, {"x": x, "w": w}, [b])
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-4, err_msg=f"{plan} {symbolic}")
    # a symbolic batch keeps whole images (blocks chosen for one batch size would change the kernel with it)
    from dataclasses import replace
    keys = {st.ast.key for n in (geo.N, geo.N + 1) for st in K.conv2d_kernels(replace(geo, N=n), plan, symbolic_batch=True)}
    whole = K.conv2d_kernels(geo, replace(plan, pixel_blocks=1), symbolic_batch=True)
    assert keys == {st.ast.key for st in whole}


@pytest.mark.parametrize("geo,plan", [(GEOMETRIES[10], ConvPlan("depthwise_flat")),
                                      (ConvGeometry(2, 5, 23, 29, 7, 1, 1), ConvPlan("pointwise", (6, 64), 16, 23))],
                         ids=["depthwise_flat", "pointwise_blocks"])
def test_the_cpu_forms_match_numpy_on_the_mlir_pair(rng, geo, plan):
    from conftest import open_target
    target = open_target("CPU", "mlir")
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32)
    w = random_array(rng, (geo.CO, geo.C // geo.groups, geo.KH, geo.KW), np.float32)
    got = run_steps(target, K.conv2d_kernels(geo, plan), {"x": x, "w": w})
    np.testing.assert_allclose(got.reshape(geo.N, geo.CO, geo.OH, geo.OW), conv_ref(x, w, None, geo), rtol=1e-4, atol=1e-4)


def test_the_contraction_cuts_a_small_batch_into_pixel_blocks_for_the_thread_split():
    from morok_py.codegen.strategies.conv import MIN_BLOCK_PIXELS, pixel_blocks
    assert pixel_blocks(8, 56 * 56, 64, threads=16) == 2          # 16 units of 25 column tiles, not 8 images
    assert pixel_blocks(8, 28 * 28, 64, threads=16) == 2
    assert pixel_blocks(8, 56 * 56, 64, threads=2) == pixel_blocks(8, 28 * 28, 64, threads=4) == 1
    assert pixel_blocks(1, 56 * 56, 64, threads=16) == pixel_blocks(1, 14 * 14, 64, threads=16) == 1
    assert pixel_blocks(8, 56 * 56, 64) == 7                      # workers unknown: 56 units of 448 pixels
    for n, p, t in ((1, 12544, 12), (3, 3136, 16), (8, 784, 6), (2, 1000, 3), (5, 49, 8), (8, 3136, 0)):
        d = pixel_blocks(n, p, 16, t)
        assert p % d == 0 and (d == 1 or p // d >= MIN_BLOCK_PIXELS)
    with pytest.raises(ArgumentError):
        check_plan(ConvPlan("pointwise", pixel_blocks=4), GEOMETRIES[0])       # 63 pixels
    with pytest.raises(ArgumentError):
        ConvPlan("depthwise", pixel_blocks=2)


def test_a_stride_1_depthwise_keeping_the_width_runs_as_a_flat_loop_with_peeled_borders(cpu):
    from morok_py.codegen.strategies.conv import flat_depthwise
    caps = cpu.dev.renderer.caps
    flat = (GEOMETRIES[6], GEOMETRIES[9], GEOMETRIES[10], GEOMETRIES[11], GEOMETRIES[13])
    for g in flat:
        assert flat_depthwise(g) and conv_plan(g, caps) == ConvPlan("depthwise_flat")
        (st,) = K.conv2d_kernels(g, ConvPlan("depthwise_flat"))
        assert len(st.ast.src) > 1          # the flat loop and the peeled borders, each a store
    for g in (GEOMETRIES[7], GEOMETRIES[12]):       # strided; no row with every tap inside
        assert not flat_depthwise(g) and conv_plan(g, caps) == ConvPlan("depthwise")
        with pytest.raises(ArgumentError):
            check_plan(ConvPlan("depthwise_flat"), g)


def test_a_grouped_convolution_with_few_channels_per_group_runs_as_flat_loops_on_the_cpu(cpu):
    from morok_py.codegen.capabilities import Capabilities
    from morok_py.codegen.strategies.conv import grouped_flat_applies
    caps = cpu.dev.renderer.caps
    assert conv_plan(GEOMETRIES[14], caps) == ConvPlan("grouped_flat")           # 29x31 outputs
    assert conv_plan(GEOMETRIES[4], caps).family == "im2col_gemm"                 # 9x9: the contraction
    assert ConvPlan("grouped_flat") in candidate_plans(GEOMETRIES[4], caps)
    assert not grouped_flat_applies(GEOMETRIES[2]) and not grouped_flat_applies(GEOMETRIES[6])   # dense; depthwise
    assert not grouped_flat_applies(ConvGeometry(1, 64, 30, 30, 64, 3, 3, pads=(1, 1, 1, 1), groups=2))  # 32 x 9 x 32 terms
    gpu = Capabilities(has_local=True, has_shared=True)
    assert ConvPlan("grouped_flat") not in candidate_plans(GEOMETRIES[14], gpu)
    with pytest.raises(ArgumentError):
        check_plan(ConvPlan("grouped_flat"), GEOMETRIES[3])                       # strided


def test_a_plan_the_geometry_cannot_take_is_refused():
    with pytest.raises(ArgumentError):
        check_plan(ConvPlan("pointwise"), GEOMETRIES[2])
    with pytest.raises(ArgumentError):
        check_plan(ConvPlan("depthwise"), GEOMETRIES[0])
    with pytest.raises(ArgumentError):
        check_plan(ConvPlan("depthwise_padded"), GEOMETRIES[2])
    with pytest.raises(ArgumentError):
        ConvPlan("winograd")
    with pytest.raises(ArgumentError):
        ConvGeometry(1, 6, 5, 5, 4, 3, 3, groups=4)


def test_an_unknown_epilogue_step_is_refused():
    from morok_py.errors import UnknownNameError
    with pytest.raises(UnknownNameError):
        K.Epilogue.of("softplus")
    with pytest.raises(ArgumentError):
        K.Epilogue.of(("bias", 1.0))


def test_a_plan_search_times_every_candidate_once_and_keeps_a_correct_one(cpu, rng):
    import time
    from morok_py.codegen.strategies.conv import search_plan
    geo = ConvGeometry(1, 4, 11, 9, 6, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1))
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32)
    w = random_array(rng, (geo.CO, geo.C, geo.KH, geo.KW), np.float32)
    timed: list[str] = []

    def time_plan(plan) -> float:
        timed.append(str(plan))
        t0 = time.perf_counter()
        run_steps(cpu, K.conv2d_kernels(geo, plan), {"x": x, "w": w})
        return time.perf_counter() - t0
    caps = cpu.dev.renderer.caps
    best, times = search_plan(geo, caps, time_plan, ("test", rng.integers(1 << 30)))
    assert sorted(timed) == sorted(str(p) for p in candidate_plans(geo, caps)) == sorted(times)
    assert best in candidate_plans(geo, caps)
    again, _ = search_plan(geo, caps, time_plan, ("test", "other key"))
    assert len(timed) == 2 * len(times)          # another key searches again; the same key would not
    got = run_steps(cpu, K.conv2d_kernels(geo, best), {"x": x, "w": w})
    np.testing.assert_allclose(got.reshape(geo.N, geo.CO, geo.OH, geo.OW), conv_ref(x, w, None, geo), rtol=1e-4, atol=1e-4)


def test_a_gpu_target_takes_the_implicit_gemm_where_it_applies():
    from morok_py.codegen.capabilities import Capabilities
    gpu = Capabilities(has_local=True, has_shared=True)
    assert conv_plan(GEOMETRIES[2], gpu, 2) == ConvPlan("direct_masked")   # 16-bit: the implicit GEMM, padding masked
    assert conv_plan(GEOMETRIES[6], gpu) == ConvPlan("grouped_direct")     # every position a work-item
    assert ConvPlan("depthwise_flat") not in candidate_plans(GEOMETRIES[6], gpu)
    assert conv_plan(GEOMETRIES[4], gpu).family == "grouped_direct"      # grouped: kernels.grouped_conv2d


@pytest.mark.parametrize("geo", [GEOMETRIES[2], GEOMETRIES[4], GEOMETRIES[6], GEOMETRIES[9], GEOMETRIES[14]], ids=_gid)
def test_a_symbolic_batch_serves_every_batch_size_with_the_same_kernels(cpu, rng, geo):
    from dataclasses import replace
    plan = conv_plan(geo, cpu.dev.renderer.caps)
    keys = None
    for N in (1, 3, 2):
        g = replace(geo, N=N)
        steps = K.conv2d_kernels(g, plan, symbolic_batch=True)
        assert keys is None or [st.ast.key for st in steps] == keys
        keys = [st.ast.key for st in steps]
        x = random_array(rng, (N, g.C, g.H, g.W), np.float32)
        w = random_array(rng, (g.CO, g.C // g.groups, g.KH, g.KW), np.float32)
        got = run_steps(cpu, steps, {"x": x, "w": w})
        np.testing.assert_allclose(got.reshape(N, g.CO, g.OH, g.OW), conv_ref(x, w, None, g), rtol=1e-4, atol=1e-4)


WINOGRAD_GEOMETRIES = [
    ConvGeometry(2, 5, 8, 12, 7, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1)),      # same padding, 8x12 out
    ConvGeometry(1, 13, 14, 6, 3, 3, 3, (1, 1), (1, 1), (2, 0, 0, 2)),     # asymmetric pads
    ConvGeometry(3, 3, 10, 6, 9, 3, 3),                                   # unpadded: 8x4 out
    ConvGeometry(1, 4, 4, 4, 5, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1)),      # no interior tile: all masked
    ConvGeometry(2, 6, 16, 12, 5, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1)),    # interior tiles and border rows/columns
    # the CPU form's partial last tiles: outputs m does not divide
    ConvGeometry(1, 9, 7, 7, 11, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1)),     # 7x7 out (resnet50's last stage)
    ConvGeometry(2, 5, 11, 9, 6, 3, 3, (1, 1), (1, 1), (1, 0, 0, 1)),     # 9x7 out, asymmetric pads, a batch of 2
    ConvGeometry(1, 3, 7, 13, 4, 3, 3),                                   # unpadded: 5x11 out
    ConvGeometry(1, 4, 4, 5, 3, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1)),      # 4x5 out: one partial column of tiles
]


@pytest.mark.parametrize("geo", WINOGRAD_GEOMETRIES, ids=_gid)
def test_winograd_tiles_match_numpy_with_an_epilogue_at_every_level(cpu_level, rng, geo):
    """F(2x2, 3x3) and F(4x4, 3x3): weights, input and output transforms around (m + 2)^2 contractions, the
    epilogue in the output transform; F(4x4)'s rounding stays within float32 noise of the direct sum. The
    CPU's candidates take the CPU form (interior tiles unmasked, border tiles masked, planes padded apart,
    a partial last row and column of tiles where m does not divide an output side); the plain form (the
    GPU's) matches too where m divides both, and refuses the others."""
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32)
    w = random_array(rng, (geo.CO, geo.C, 3, 3), np.float32)
    b = random_array(rng, (geo.CO,), np.float32)
    r = random_array(rng, (geo.N, geo.CO, geo.OH, geo.OW), np.float32)
    want = np.maximum(conv_ref(x, w, None, geo) + b.reshape(1, -1, 1, 1) + r, 0)
    plans = [p for p in candidate_plans(geo, cpu_level.dev.renderer.caps) if p.family == "winograd"]
    assert [p.winograd for p in plans] == [m for m in (4, 2) if geo.OH >= m and geo.OW >= m]
    assert all(p.cpu_form for p in plans)
    whole = [replace(p, cpu_form=False) for p in plans if geo.OH % p.winograd == 0 and geo.OW % p.winograd == 0]
    for p in plans:
        if replace(p, cpu_form=False) not in whole:
            with pytest.raises(ArgumentError, match="divides"):
                K.conv2d_kernels(geo, replace(p, cpu_form=False))
    for plan in plans + whole:
        steps = K.conv2d_kernels(geo, plan, epilogue=K.Epilogue.of("bias", "add", "relu"))
        assert [st.name for st in steps] == ["weights", "input", "gemm", "output"]
        got = run_steps(cpu_level, steps, {"x": x, "w": w}, (b, r))
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-4, err_msg=str(plan))



PIXEL_ROWS_GEOMETRIES = [
    # N, C, H, W, CO, KH, KW, stride, dilation, pads: pixels as rows, output channels as vector columns
    ConvGeometry(1, 72, 5, 7, 37, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1)),     # K 648: runs of 216, 35 pixels
    ConvGeometry(3, 40, 9, 11, 21, 1, 1),                                  # pointwise, a batch of 3
    ConvGeometry(2, 24, 11, 9, 19, 3, 3, (2, 2), (1, 1), (1, 0, 2, 1)),    # strided, asymmetric pads
]


@pytest.mark.parametrize("geo", PIXEL_ROWS_GEOMETRIES, ids=_gid)
def test_pixel_rows_match_numpy_with_an_epilogue_at_every_level(cpu_level, rng, geo):
    """Pixels as the register tile's rows: the transposed weights, the contraction in one run or in runs
    that add the last run's sums, then the channels-last sums put back in NCHW with the epilogue; a static
    and a symbolic batch."""
    caps = cpu_level.dev.renderer.caps
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32)
    w = random_array(rng, (geo.CO, geo.C, geo.KH, geo.KW), np.float32)
    b = random_array(rng, (geo.CO,), np.float32)
    r = random_array(rng, (geo.N, geo.CO, geo.OH, geo.OW), np.float32)
    want = np.maximum(conv_ref(x, w, None, geo) + b.reshape(1, -1, 1, 1) + r, 0)
    K_ = geo.C * geo.KH * geo.KW
    runs = [0] + [k for k in (k_run(K_), 8) if k and K_ % k == 0]
    family = "pointwise" if geo.pointwise else "im2col_gemm"
    for run in runs:
        plan = ConvPlan(family, caps.register_tile, caps.tile_lanes, pixel_rows=True, k_run=run)
        assert plan in candidate_plans(geo, caps) or run == 8
        for symbolic in (False, True):
            steps = K.conv2d_kernels(geo, plan, epilogue=K.Epilogue.of("bias", "add", "relu"), symbolic_batch=symbolic)
            gemms = [st for st in steps if st.name == "gemm"]
            assert steps[0].weights_only and steps[-1].name == "output"
            assert len(gemms) == (K_ // run if run else 1)
            assert all(st.inputs[-1] == prev.output for prev, st in zip(gemms, gemms[1:]))
            got = run_steps(cpu_level, steps, {"x": x, "w": w}, (b, r))
            np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-4,
                                       err_msg=f"{plan} symbolic={symbolic}")
    assert k_run(648) == 216 and k_run(4608) == 576 and k_run(2304) == 576 and k_run(512) == 0


def test_pixel_rows_layers_that_differ_only_in_input_channels_share_their_contraction():
    """densenet121's 7x7 1x1 layers (512-992 channels in, 128 out): one contraction program for them all,
    the channel count the variable K; rows the register tile packs (2048 channels out) keep a static K."""
    def gemm_keys(C, CO):
        geo = ConvGeometry(1, C, 7, 7, CO, 1, 1)
        steps = K.conv2d_kernels(geo, ConvPlan("pointwise", (6, 16), 8, pixel_rows=True))
        return [(st.ast.key, st.vars) for st in steps if st.name == "gemm"]
    (a, va), (b, vb) = gemm_keys(512, 128) + gemm_keys(544, 128)
    assert a == b and va == (("K", 512),) and vb == (("K", 544),)
    (c, vc), (d, vd) = gemm_keys(512, 2048) + gemm_keys(544, 2048)
    assert c != d and vc == vd == ()


def test_the_cpu_heuristic_takes_winograd_and_pixel_rows_where_they_were_measured_faster():
    """On an AVX2-sized target (8 lanes, 6x16 tiles) resnet50's stride-1 3x3 layers take F(2x2, 3x3) with a
    constant batch (not with a symbolic one), the 7x7 ones with a partial last row and column of tiles (not
    below CPU_WINOGRAD_PARTIAL_MIN_SIDE), also with 128 output channels; late layers of few
    pixels, long reductions and few output channels take pixel rows, in runs from K_RUN_MIN_K; a short
    reduction or many output channels keep pixels as columns. A 16-lane (AVX-512) target takes the same
    Winograd layers (F(4x4) measured slower in the model on the 16-core Xeon) except the 7x7 ones of one image
    (their 16 tiles one lane vector: CPU_WINOGRAD_PARTIAL_MIN_VECTORS) and keeps pixels as columns (pixel rows
    lost there)."""
    from morok_py.codegen.capabilities import Capabilities
    avx2 = Capabilities(has_threads=True, register_tile=(6, 16), tile_lanes=8)
    avx512 = Capabilities(has_threads=True, register_tile=(6, 64), tile_lanes=16)
    same = (1, 1, 1, 1)
    for C, side in ((64, 56), (128, 28), (256, 14)):
        geo = ConvGeometry(1, C, side, side, C, 3, 3, pads=same)
        assert conv_plan(geo, avx2) == ConvPlan("winograd", winograd=CPU_WINOGRAD_TILE, cpu_form=True)
        assert conv_plan(geo, avx2, static_batch=False).family == "im2col_gemm"
        assert conv_plan(geo, avx512) == ConvPlan("winograd", winograd=CPU_WINOGRAD_TILE, cpu_form=True)
        assert conv_plan(geo, avx512, static_batch=False).family == "im2col_gemm"
    assert CPU_WINOGRAD_TILE == 2
    assert conv_plan(ConvGeometry(1, 128, 28, 28, 32, 3, 3, pads=same), avx2).family == "im2col_gemm"
    # densenet121's 128 -> 32 at 56x56: Winograd by its pixels, F(2x2) on both (32 output channels)
    for caps in (avx2, avx512):
        assert conv_plan(ConvGeometry(1, 128, 56, 56, 32, 3, 3, pads=same), caps).winograd == 2
    for caps in (avx2, avx512):
        for co in (512, 128):
            # one 7x7 image's 16 tiles: two AVX2 vectors (Winograd), one AVX-512 vector (its 3x3 filters instead);
            # a batch of 8 fills eight AVX-512 vectors
            plan = conv_plan(ConvGeometry(1, 512, 7, 7, co, 3, 3, pads=same), caps)
            assert (plan == ConvPlan("winograd", winograd=CPU_WINOGRAD_TILE, cpu_form=True)) == (caps is avx2), plan
            assert conv_plan(ConvGeometry(8, 512, 7, 7, co, 3, 3, pads=same), caps).winograd == CPU_WINOGRAD_TILE
        assert 16 < CPU_WINOGRAD_PARTIAL_MIN_VECTORS * avx512.tile_lanes and 16 >= CPU_WINOGRAD_PARTIAL_MIN_VECTORS * 8
        # with many worker threads the 7x7 layers (a partial last row and column of tiles) read the 3x3 filters
        # through im2col instead of F(2x2)'s 1.78x larger transformed weights; the 14x14 ones stay Winograd
        many = replace(caps, threads=CPU_WINOGRAD_PARTIAL_MAX_THREADS + 8)
        # (AVX-512: as flat columns, one column tile; AVX2's four column tiles would read the 9.4 MB four times)
        assert conv_plan(ConvGeometry(1, 512, 7, 7, 512, 3, 3, pads=same), many).family == (
            "phases_flat" if caps is avx512 else "im2col_gemm")
        assert bool(conv_plan(ConvGeometry(1, 512, 7, 7, 512, 3, 3, pads=same), replace(caps, threads=2)).winograd) == (
            caps is avx2)
        assert conv_plan(ConvGeometry(1, 256, 14, 14, 256, 3, 3, pads=same), many).winograd == CPU_WINOGRAD_TILE
        odd = ConvGeometry(1, 64, CPU_WINOGRAD_PARTIAL_MIN_SIDE - 2, CPU_WINOGRAD_PARTIAL_MIN_SIDE - 2, 64, 3, 3,
                           pads=same)
        assert conv_plan(odd, caps).family == "phases_flat"      # no Winograd; 48 flat columns, 147 KB of weights
    late = ConvGeometry(1, 512, 7, 7, 48, 3, 3, pads=same)
    seven = conv_plan(late, avx2)
    assert seven.pixel_rows and seven.k_run == 576 and "pixel_rows, k_run=576" in str(seven)
    assert not conv_plan(late, avx512).pixel_rows and any(p.pixel_rows for p in candidate_plans(late, avx512))
    # densenet121's 7x7 3x3 layers: flat columns (small weights, read once per column tile)
    assert conv_plan(ConvGeometry(1, 128, 7, 7, 32, 3, 3, pads=same), avx2).family == "phases_flat"
    assert conv_plan(ConvGeometry(1, 992, 7, 7, 128, 1, 1), avx2).pixel_rows              # 49 pixels, K 992, 128 out
    # many output channels: pixels as columns, their misaligned rows packed (codegen/opt.py)
    assert not conv_plan(ConvGeometry(1, 512, 7, 7, 512, 3, 3, pads=same), avx2).pixel_rows
    assert not conv_plan(ConvGeometry(1, 512, 7, 7, 2048, 1, 1), avx2).pixel_rows
    assert not conv_plan(ConvGeometry(1, 256, 28, 28, 256, 3, 3, (2, 2), pads=same), avx2).pixel_rows
    assert not conv_plan(ConvGeometry(1, 256, 7, 7, 128, 1, 1), avx2).pixel_rows           # K 256
    assert not conv_plan(ConvGeometry(1, 512, 14, 14, 128, 1, 1), avx2).pixel_rows         # 196 pixels
    assert not conv_plan(ConvGeometry(1, 256, 28, 28, 256, 3, 3, pads=(0, 0, 0, 1)), avx2).pixel_rows
    with pytest.raises(ArgumentError):
        check_plan(ConvPlan("im2col_gemm", pixel_rows=True), ConvGeometry(1, 4, 6, 6, 4, 3, 3, groups=2))
    with pytest.raises(ArgumentError):
        check_plan(ConvPlan("im2col_gemm", pixel_rows=True, k_run=5), ConvGeometry(1, 4, 6, 6, 4, 3, 3))
    with pytest.raises(ArgumentError):
        ConvPlan("im2col_gemm", k_run=8)                    # runs belong to pixel rows
    with pytest.raises(ArgumentError):
        ConvPlan("depthwise", pixel_rows=True)

def test_winograd_refuses_what_it_cannot_tile():
    """Other kernels, strides, groups, output sides m does not divide, 16-bit candidates and a symbolic
    batch are refused with a reason."""
    from morok_py.codegen.capabilities import Capabilities
    ok = WINOGRAD_GEOMETRIES[0]
    for geo in (ConvGeometry(1, 4, 9, 9, 4, 3, 3, (2, 2), (1, 1), (1, 1, 1, 1)),     # stride 2
                ConvGeometry(1, 4, 9, 9, 4, 5, 5, pads=(2, 2, 2, 2)),                # 5x5
                ConvGeometry(1, 4, 9, 9, 4, 3, 3, pads=(1, 1, 1, 1), groups=2),      # groups
                ConvGeometry(1, 4, 9, 9, 4, 3, 3, pads=(1, 1, 1, 1))):               # 9x9 output
        with pytest.raises(ArgumentError, match="Winograd"):
            check_plan(ConvPlan("winograd", winograd=2), geo)
    with pytest.raises(ArgumentError, match="winograd=3"):
        ConvPlan("winograd", winograd=3)
    with pytest.raises(ArgumentError, match="winograd=2"):
        ConvPlan("im2col_gemm", winograd=2)
    assert not any(p.family == "winograd" for p in candidate_plans(ok, Capabilities(), itemsize=2))
    with pytest.raises(ArgumentError, match="static batch"):
        K.conv2d_kernels(ok, ConvPlan("winograd", winograd=4), symbolic_batch=True)


@pytest.mark.parametrize("N,peel", [(1, False), (2, False), (1, True), (2, True)])
def test_im2col_of_one_image_splits_over_channels_and_kernel_rows(cpu_level, N, peel):
    """One image's columns take (channel, kernel row) as the outermost range, so a 3-channel 7x7 stem has 21
    units for the workers, not 3 (peeled, cut into blocks of output rows: 63); a batch keeps the images outermost. Every column matches numpy (odd
    sizes, stride 2, padding). `peel` (the CPU plans' form: one image's padded columns peeled, unmasked
    inside) gives the same columns, also dilated, with asymmetric pads and where no column is inside."""
    rng = np.random.default_rng(3)
    cases = [(3, 23, 19, 7, 7, (2, 2), (1, 1), (3, 3, 3, 3))]
    if peel and N == 1:
        assert K.im2col_row_blocks(21, 12) == 3 and K.im2col_row_blocks(21, 112) == 4     # 63 and 84 units
        assert K.im2col_row_blocks(48, 112) == 1 and K.im2col_row_blocks(21, 7) == 1    # enough / too few rows
        assert K.im2col_row_blocks(5, 13) == 1 and K.im2col_row_blocks(5, 16) == 4      # (prime rows; 4 rows a block)
    if peel:
        cases += [(4, 13, 12, 3, 2, (1, 2), (2, 1), (2, 0, 1, 3)), (2, 9, 17, 5, 5, (2, 3), (1, 2), (0, 4, 1, 1)),
                  (3, 5, 3, 3, 5, (1, 1), (1, 1), (1, 3, 1, 3))]
    renderer, compiler = cpu_level.pair()
    for C, H, W, KH, KW, (sh, sw), (dh, dw), (pt, pl, pb, pr) in cases:
        OH, OW = (H + pt + pb - dh * (KH - 1) - 1) // sh + 1, (W + pl + pr - dw * (KW - 1) - 1) // sw + 1
        spec = renderer.render(K.im2col(N, C, H, W, KH, KW, (sh, sw), (dh, dw), (pt, pl, pb, pr), peel=peel),
                               f"stem_cols_{N}_{peel}_{C}")
        prog = cpu_level.dev.runtime(compiler.compile(spec))
        x = random_array(rng, (N, C, H, W), np.float32)
        bufs = [cpu_level.buf(x), cpu_level.buf(np.full(N * C * KH * KW * OH * OW, np.nan, np.float32))]
        gs, ls = prog.launch.launch_dims({})
        assert gs[0] == (N if N > 1 else C * KH * (K.im2col_row_blocks(C * KH, OH) if peel else 1))
        prog.execute([b.ptr for b in bufs], [], gs, ls, wait=True)
        xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
        want = np.stack([xp[:, :, kh * dh:kh * dh + sh * OH:sh, kw * dw:kw * dw + sw * OW:sw]
                         for kh in range(KH) for kw in range(KW)], 2)
        np.testing.assert_array_equal(bufs[1].numpy().reshape(N, C, KH * KW, OH, OW), want)


def test_an_onnx_convolution_under_morok_beam_times_each_candidate_plan_and_stays_right(monkeypatch, capfd):
    """The ONNX executor's convolution under MOROK_BEAM: each candidate plan is timed (its kernels built and
    compiled once, the launches alone timed) on a stand-in input of random normal values in the node's input
    layout, not on the node's input buffer (during a first run that one may not hold its values yet: left-over
    denormals and NaNs slowed the timed launches many times on Intel cores), the choice and the times are
    printed under MOROK_DEBUG, and the output matches numpy whichever plan won."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    from morok_py.onnx import OnnxExecutor
    rng = np.random.default_rng(11)
    N, C, H, W, CO = 2, 5, 13, 11, 7
    x = random_array(rng, (N, C, H, W), np.float32)
    w = random_array(rng, (CO, C, 3, 3), np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    graph = helper.make_graph([node], "beam_conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, C, H, W])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [N, CO, H, W])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    monkeypatch.setenv("MOROK_BEAM", "2")
    monkeypatch.setenv("MOROK_DEBUG", "1")
    import morok_py.onnx.fuse as fuse
    timed = []
    plan_timer = fuse._plan_timer

    def spy(ctx, plan, geo, epi, xv, *rest):
        timed.append((xv.shape, xv.strides, xv.buf.numpy()))
        return plan_timer(ctx, plan, geo, epi, xv, *rest)
    monkeypatch.setattr(fuse, "_plan_timer", spy)
    got = OnnxExecutor(model, "CPU").run({"x": x})[0]
    assert len(timed) >= 2
    for shape, strides, vals in timed:
        assert shape == (N, C, H, W) and strides == (C * H * W, H * W, W, 1)
        assert np.isfinite(vals).all() and 0.8 < vals.std() < 1.2 and not np.array_equal(vals, x.reshape(-1))
    geo = ConvGeometry(N, C, H, W, CO, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1), 1)
    np.testing.assert_allclose(got, conv_ref(x, w, None, geo), rtol=1e-4, atol=1e-4)
    err = capfd.readouterr().err
    assert "conv: ConvPlan(" in err and "; searched " in err
    searched = err.split("; searched ", 1)[1].splitlines()[0]
    assert searched.count(" ms") >= 2          # the default and at least one other candidate, each timed


@pytest.mark.parametrize("geo", [ConvGeometry(2, 3, 61, 135, 10, 7, 7, (2, 2), (1, 1), (3, 3, 3, 3)),   # a stem, odd sides
                                 ConvGeometry(1, 4, 40, 150, 7, 3, 5, (2, 3), (1, 2), (1, 2, 0, 1))],  # uneven strides
                         ids=_gid)
def test_a_strided_layer_sums_its_taps_from_phase_planes_at_every_level(cpu_level, rng, geo):
    """direct_phases: the padded input split into the stride's phases once, then the taps summed from them by the
    register tile (rows of output pixels wider than the tile: full tiles and a remainder), an epilogue in the
    same kernel, against numpy; the planes hold each input element once (no KH*KW-fold columns)."""
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32)
    w = random_array(rng, (geo.CO, geo.C, geo.KH, geo.KW), np.float32)
    b = random_array(rng, (geo.CO,), np.float32)
    want = np.maximum(conv_ref(x, w, b, geo), 0)
    for symbolic in (False, True):      # the batch a variable: one program for every batch size
        steps = K.conv2d_kernels(geo, ConvPlan("direct_phases"), epilogue=K.Epilogue.of("bias", "relu"),
                                 symbolic_batch=symbolic)
        assert [st.name for st in steps] == ["phases", "direct"]
        HQ, WQ = K.phase_planes(geo.H, geo.W, geo.stride, geo.pads)
        assert steps[0].elements == geo.N * geo.C * geo.stride[0] * geo.stride[1] * HQ * WQ
        assert steps[0].elements < 2 * (geo.H + 3) * (geo.W + 3) * geo.N * geo.C
        got = run_steps(cpu_level, steps, {"x": x, "w": w}, (b,))
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-4, err_msg=f"symbolic {symbolic}")
        spec = cpu_level.pair()[0].render(steps[1].ast, "phases_direct")
        assert spec.linear.schedule.register_tile is not None, spec.linear.schedule


def test_a_strided_layer_of_few_input_channels_and_wide_rows_takes_the_phase_planes():
    """The CPU default: resnet50's stem (3 channels, 7x7 stride 2, 112-pixel output rows) sums from phase planes on
    AVX2- and AVX-512-sized targets, a 5x5 one too; many input channels, a 3x3 kernel, stride 1 or rows narrower
    than the tile keep their plans."""
    from morok_py.codegen.capabilities import Capabilities
    from morok_py.codegen.strategies.conv import DIRECT_PHASES_MAX_CHANNELS
    avx2 = Capabilities(has_threads=True, register_tile=(6, 16), tile_lanes=8)
    avx512 = Capabilities(has_threads=True, register_tile=(6, 64), tile_lanes=16)
    stem = ConvGeometry(1, 3, 224, 224, 64, 7, 7, (2, 2), (1, 1), (3, 3, 3, 3))
    for caps in (avx2, avx512):
        assert conv_plan(stem, caps) == ConvPlan("direct_phases") and "direct_phases" in str(conv_plan(stem, caps))
        wide = ConvGeometry(1, DIRECT_PHASES_MAX_CHANNELS + 1, 224, 224, 64, 7, 7, (2, 2), (1, 1), (3, 3, 3, 3))
        assert conv_plan(wide, caps).family == "im2col_gemm"
        assert conv_plan(replace(stem, stride=(1, 1)), caps).family != "direct_phases"
        assert ConvPlan("direct_phases") in candidate_plans(wide, caps)
    small = ConvGeometry(8, 3, 112, 112, 16, 3, 3, (2, 2), (1, 1), (1, 1, 1, 1))        # 9 taps: columns win
    assert conv_plan(small, avx2).family == conv_plan(small, avx512).family == "im2col_gemm"
    assert conv_plan(replace(small, KH=5, KW=5, pads=(2, 2, 2, 2)), avx2).family == "direct_phases"
    narrow = ConvGeometry(1, 3, 60, 60, 64, 7, 7, (2, 2), (1, 1), (3, 3, 3, 3))          # 30-pixel output rows
    assert conv_plan(narrow, avx512).family == "im2col_gemm" and conv_plan(narrow, avx2).family == "direct_phases"
    assert conv_plan(stem, Capabilities(has_local=True)).family != "direct_phases"
    with pytest.raises(ArgumentError, match="one group"):
        check_plan(ConvPlan("direct_phases"), ConvGeometry(1, 4, 9, 9, 4, 3, 3, (2, 2), groups=2))


@pytest.mark.parametrize("geo", [ConvGeometry(3, 37, 7, 7, 21, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1)),      # resnet50's 7x7, odd
                                 ConvGeometry(2, 13, 13, 15, 19, 3, 3, (2, 2), (1, 1), (1, 1, 1, 1)),   # stride 2, odd sides
                                 ConvGeometry(1, 6, 11, 9, 5, 3, 2, (1, 2), (2, 1), (2, 0, 1, 3)),      # dilated, asymmetric
                                 ConvGeometry(2, 5, 9, 8, 7, 5, 5, (2, 1), (1, 2), (0, 3, 2, 1))],      # 5x5, uneven
                         ids=_gid)
def test_a_small_output_sums_its_taps_over_flat_columns_at_every_level(cpu_level, rng, geo):
    """phases_flat: the phase planes (with the zero rows below that the last columns' taps reach), one run of flat
    columns an image (each output row and the planes' padding after it) summed by the register tile, then the output
    pixels cropped from the columns with the epilogue (a bias, a residual operand in the output's layout, relu),
    against numpy, for a static and a variable batch."""
    from morok_py.codegen.strategies.conv import FLAT_COLUMN_MULTIPLE, phases_flat_geometry
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32)
    w = random_array(rng, (geo.CO, geo.C, geo.KH, geo.KW), np.float32)
    b = random_array(rng, (geo.CO,), np.float32)
    res = random_array(rng, (geo.N, geo.CO, geo.OH, geo.OW), np.float32)
    want = np.maximum(conv_ref(x, w, b, geo) + res, 0)
    grown, rows, row, cols = phases_flat_geometry(geo.H, geo.W, geo.KH, geo.KW, geo.stride, geo.dilation, geo.pads)
    assert cols % FLAT_COLUMN_MULTIPLE == 0 and geo.OH * row <= cols < geo.OH * row + FLAT_COLUMN_MULTIPLE
    # the farthest tap of the last column reads inside its plane: zero rows below the input, never the next plane
    reach = ((geo.KH - 1) * geo.dilation[0] // geo.stride[0]) * row + (geo.KW - 1) * geo.dilation[1] // geo.stride[1]
    assert reach + cols <= rows * row and grown[2] >= geo.pads[2] and grown[:2] + grown[3:] == geo.pads[:2] + geo.pads[3:]
    for symbolic in (False, True):
        steps = K.conv2d_kernels(geo, ConvPlan("phases_flat"), epilogue=K.Epilogue.of("bias", "add", "relu"),
                                 symbolic_batch=symbolic)
        assert [st.name for st in steps] == ["phases", "direct", "crop"]
        assert steps[0].elements == geo.N * geo.C * geo.stride[0] * geo.stride[1] * rows * row
        assert steps[1].elements == geo.N * geo.CO * cols
        got = run_steps(cpu_level, steps, {"x": x, "w": w}, (b, res))
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-4, err_msg=f"symbolic {symbolic}")
        spec = cpu_level.pair()[0].render(steps[1].ast, "phases_flat_direct")
        assert spec.linear.schedule.register_tile is not None, spec.linear.schedule


def test_small_outputs_of_many_taps_take_flat_columns_where_the_weights_allow():
    """The CPU default: resnet50's 3x3 layers at 7x7 (where Winograd is not taken: many threads) take phases_flat on
    AVX-512 (64 flat columns, one column tile); on AVX2 (four column tiles, each reading every weight) only where the
    weights are small (densenet121's 128 -> 32 at 7x7), 512 -> 512 keeps its columns. Strided and 1x1 layers, outputs
    of more flat columns, grouped layers and GPUs keep their plans (phases_flat stays a candidate)."""
    from morok_py.codegen.capabilities import Capabilities
    avx512 = Capabilities(has_threads=True, register_tile=(6, 64), tile_lanes=16, threads=16)
    avx2 = Capabilities(has_threads=True, register_tile=(6, 16), tile_lanes=8, threads=16)
    pads = (1, 1, 1, 1)
    s1_7 = ConvGeometry(1, 512, 7, 7, 512, 3, 3, (1, 1), (1, 1), pads)
    s2_14 = ConvGeometry(1, 512, 14, 14, 512, 3, 3, (2, 2), (1, 1), pads)
    dense = ConvGeometry(1, 128, 7, 7, 32, 3, 3, (1, 1), (1, 1), pads)
    assert conv_plan(s1_7, avx512) == conv_plan(dense, avx512) == ConvPlan("phases_flat")
    assert conv_plan(dense, avx2) == ConvPlan("phases_flat")
    assert conv_plan(s2_14, avx512).family == conv_plan(s2_14, avx2).family == "im2col_gemm"     # strided: columns
    assert ConvPlan("phases_flat") in candidate_plans(s2_14, avx512)
    assert "phases_flat" in str(conv_plan(s1_7, avx512))
    assert conv_plan(ConvGeometry(1, 256, 28, 28, 256, 3, 3, (2, 2), (1, 1), pads), avx512).family == "im2col_gemm"
    assert conv_plan(ConvGeometry(1, 1024, 14, 14, 2048, 1, 1, (2, 2)), avx512).family == "im2col_gemm"   # 1x1
    assert conv_plan(ConvGeometry(1, 512, 7, 7, 2048, 1, 1), avx512).family == "pointwise"
    assert conv_plan(s1_7, Capabilities(has_local=True)).family != "phases_flat"
    assert ConvPlan("phases_flat") in candidate_plans(ConvGeometry(1, 256, 28, 28, 256, 3, 3, (2, 2), (1, 1), pads), avx2)
    with pytest.raises(ArgumentError, match="one group"):
        check_plan(ConvPlan("phases_flat"), ConvGeometry(1, 4, 7, 7, 4, 3, 3, (1, 1), (1, 1), pads, groups=2))
