"""Channels-last convolutions (kernels_nhwc.py, `channels_last_plan`): every form gives numpy's answer for odd
sizes, strides, dilations, padding, batches and an NCHW input at a layout's edge, at every x86-64 level the host
runs, with the epilogue's bias and a channels-last residual; the choice of form and its refusals; the batched
`matmul_panels` the Winograd form runs; the executor's marking of the layers whose activations stay
channels-last, and models through it against the NCHW executor and numpy."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from morok_py import dtypes, kernels as K, kernels_nhwc as KN
from morok_py.codegen.capabilities import Capabilities
from morok_py.codegen.strategies import conv as conv_strategy
from morok_py.codegen.strategies.conv import (CHANNELS_LAST_FORMS, ConvGeometry, channels_last_candidates,
                                             channels_last_plan, channels_last_runs)
from morok_py.errors import ArgumentError, UnknownNameError

from conftest import conv_ref, random_array, run_steps


def _width(target) -> int:
    return target.dev.renderer.caps.register_tile[1]


def _nchw_strides(g: ConvGeometry) -> tuple[int, int, int, int]:
    return (g.C * g.H * g.W, g.H * g.W, g.W, 1)


def run_nhwc(target, geo: ConvGeometry, form: str, x: np.ndarray, w: np.ndarray, epilogue=None, operands=(),
             nchw_input: bool = False, runs: int = 1) -> np.ndarray:
    """The form's kernels launched in order (conftest.run_steps); the output as NCHW numpy."""
    xs = x if nchw_input else np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    steps = KN.conv2d_nhwc_kernels(geo, form, _width(target), dtypes.float32, epilogue,
                                   _nchw_strides(geo) if nchw_input else None, runs)
    out = run_steps(target, steps, {"x": xs, "w": w}, operands)
    return out.reshape(geo.N, geo.OH, geo.OW, geo.CO).transpose(0, 3, 1, 2)


# (geometry builder from the register tile's width, form, NCHW input): output channels are whole tile widths
CASES = [
    (lambda wd: ConvGeometry(2, 5, 7, 9, wd, 1, 1), "pointwise", False),
    (lambda wd: ConvGeometry(1, 37, 13, 11, 2 * wd, 1, 1), "pointwise", False),
    (lambda wd: ConvGeometry(2, 7, 9, 11, wd, 1, 1, (2, 2)), "im2col", False),                  # 1x1 stride 2
    (lambda wd: ConvGeometry(2, 7, 9, 11, wd, 1, 1, (2, 2)), "pointwise", False),               # ... in place
    (lambda wd: ConvGeometry(1, 13, 10, 7, 2 * wd, 1, 1, (3, 2)), "pointwise", False),
    (lambda wd: ConvGeometry(2, 5, 7, 9, wd, 1, 1), "im2col", True),                            # NCHW input
    (lambda wd: ConvGeometry(2, 3, 11, 10, wd, 3, 3, (2, 2), (1, 1), (1, 1, 1, 1)), "im2col", False),
    (lambda wd: ConvGeometry(1, 4, 13, 12, wd, 3, 2, (1, 2), (2, 1), (2, 0, 1, 3)), "im2col", False),
    (lambda wd: ConvGeometry(1, 3, 23, 21, wd, 7, 7, (2, 2), (1, 1), (3, 3, 3, 3)), "im2col", True),  # a stem
    (lambda wd: ConvGeometry(2, 17, 10, 6, wd, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1)), "winograd", False),
    (lambda wd: ConvGeometry(1, 19, 14, 14, 2 * wd, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1)), "winograd", False),
    (lambda wd: ConvGeometry(1, 16, 9, 13, wd, 3, 3, (1, 1), (1, 1), (0, 1, 1, 0)), "winograd", False),
    (lambda wd: ConvGeometry(3, 16, 8, 8, wd, 3, 3, (1, 1), (1, 1), (0, 0, 0, 0)), "winograd", False),
    # each tap's contraction over a padded copy, the taps added (resnet50's 7x7 stage)
    (lambda wd: ConvGeometry(1, 37, 7, 7, 2 * wd, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1)), "taps", False),
    (lambda wd: ConvGeometry(2, 21, 13, 13, wd, 3, 3, (2, 2), (1, 1), (1, 1, 1, 1)), "taps", False),
    (lambda wd: ConvGeometry(1, 9, 11, 10, wd, 3, 2, (2, 1), (2, 1), (2, 0, 1, 3)), "taps", True),
    (lambda wd: ConvGeometry(1, 11, 5, 6, wd, 2, 2), "taps", False),
    (lambda wd: ConvGeometry(1, 37, 7, 7, 2 * wd, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1)), "taps", False, 3),  # a row a run
    (lambda wd: ConvGeometry(2, 21, 13, 13, wd, 3, 3, (2, 2), (1, 1), (1, 1, 1, 1)), "taps", False, 3),
    (lambda wd: ConvGeometry(1, 9, 11, 10, wd, 3, 2, (2, 1), (2, 1), (2, 0, 1, 3)), "taps", True, 3),
    (lambda wd: ConvGeometry(1, 6, 9, 12, wd, 2, 3, (1, 2), (1, 2), (1, 2, 0, 2)), "taps", False, 6),
    # the contraction in runs of its reduction, added with the epilogue
    (lambda wd: ConvGeometry(1, 24, 7, 7, wd, 3, 3, (1, 1), (1, 1), (1, 1, 1, 1)), "im2col", False, 3),
    (lambda wd: ConvGeometry(2, 40, 5, 3, 2 * wd, 1, 1), "pointwise", False, 5),
    (lambda wd: ConvGeometry(1, 16, 9, 7, wd, 3, 3, (2, 2), (1, 1), (0, 1, 1, 0)), "im2col", True, 2),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_form_matches_numpy_at_every_level(cpu_level, rng, case):
    build, form, nchw_input, *runs = CASES[case]
    geo = build(_width(cpu_level))
    x = random_array(rng, (geo.N, geo.C, geo.H, geo.W), np.float32)
    w = random_array(rng, (geo.CO, geo.C, geo.KH, geo.KW), np.float32)
    b = random_array(rng, (geo.CO,), np.float32)
    r = random_array(rng, (geo.N, geo.CO, geo.OH, geo.OW), np.float32)
    want = np.maximum(conv_ref(x, w, None, geo) + b.reshape(1, -1, 1, 1) + r, 0)
    got = run_nhwc(cpu_level, geo, form, x, w, K.Epilogue.of("bias", "add", "relu"),
                   (b, np.ascontiguousarray(r.transpose(0, 2, 3, 1))), nchw_input, *runs)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_plan_choice_and_refusals(monkeypatch):
    cpu = Capabilities(register_tile=(6, 64), tile_lanes=16)
    assert channels_last_plan(ConvGeometry(1, 64, 56, 56, 256, 1, 1), cpu) == "pointwise"
    assert channels_last_plan(ConvGeometry(1, 64, 56, 56, 256, 1, 1), cpu, input_channels_last=False) == "im2col"
    assert channels_last_plan(ConvGeometry(1, 64, 56, 56, 64, 3, 3, pads=(1, 1, 1, 1)), cpu) == "winograd"
    # odd output sides, a stride, few channels: the columns
    assert channels_last_plan(ConvGeometry(1, 128, 17, 17, 128, 3, 3, pads=(1, 1, 1, 1)), cpu) == "im2col"
    assert channels_last_plan(ConvGeometry(1, 128, 56, 56, 128, 3, 3, (2, 2), pads=(1, 1, 1, 1)), cpu) == "im2col"
    # several taps over few pixels (resnet50's 7x7 3x3 layers: 9 row tiles; the stride-2 one into 7x7):
    # each tap's contraction, the taps added; past CHANNELS_LAST_RUN_MAX input channels the columns in runs;
    # pointwise ones stay one run
    few7 = ConvGeometry(1, 512, 7, 7, 512, 3, 3, pads=(1, 1, 1, 1))
    few14 = ConvGeometry(1, 512, 14, 14, 512, 3, 3, (2, 2), pads=(1, 1, 1, 1))
    assert channels_last_plan(few7, cpu) == channels_last_plan(few14, cpu) == "taps"
    assert channels_last_plan(ConvGeometry(1, 256, 28, 28, 256, 3, 3, (2, 2), pads=(1, 1, 1, 1)), cpu) == "im2col"
    assert channels_last_plan(ConvGeometry(2, 512, 7, 7, 512, 3, 3, pads=(1, 1, 1, 1)), cpu) == "im2col"
    assert channels_last_candidates(few7, cpu) == ["taps", "im2col"]
    assert channels_last_runs(few7, cpu, "taps") == 3 and channels_last_runs(few7, cpu, "im2col") == 8
    # a kernel row a run where its units (8 panels x 3 rows) are at least 2 per worker; else a tap a run
    assert channels_last_runs(few7, replace(cpu, threads=12), "taps") == 3
    assert channels_last_runs(few7, replace(cpu, threads=16), "taps") == 9
    assert channels_last_runs(ConvGeometry(1, 64, 7, 7, 64, 3, 3, dilation=(1, 2), pads=(1, 2, 1, 2)), cpu, "taps") == 9
    wide = ConvGeometry(1, 1024, 7, 7, 512, 3, 3, pads=(1, 1, 1, 1))
    assert channels_last_plan(wide, cpu) == "im2col" and channels_last_runs(wide, cpu, "im2col") == 16
    assert channels_last_runs(ConvGeometry(1, 2048, 7, 7, 512, 1, 1), cpu, "pointwise") == 1
    many = ConvGeometry(1, 128, 56, 56, 128, 3, 3, (2, 2), pads=(1, 1, 1, 1))       # 784 pixels: 131 row tiles
    assert channels_last_plan(many, cpu) == "im2col" and channels_last_runs(many, cpu, "im2col") == 1
    with monkeypatch.context() as m:
        m.setattr(conv_strategy, "CHANNELS_LAST_TAPS", False)
        assert channels_last_plan(few7, cpu) == "im2col"
    with monkeypatch.context() as m:
        m.setattr(conv_strategy, "CHANNELS_LAST_TAP_ROWS", False)
        assert channels_last_runs(few7, cpu, "taps") == 9
    with monkeypatch.context() as m:
        m.setattr(conv_strategy, "CHANNELS_LAST_RUN_MAX", 0)
        assert channels_last_plan(few7, cpu) is None and channels_last_plan(few14, cpu) is None
        assert channels_last_runs(few7, cpu, "im2col") == 1
    assert channels_last_plan(ConvGeometry(1, 512, 7, 7, 2048, 1, 1), cpu) == "pointwise"
    assert channels_last_plan(ConvGeometry(1, 512, 7, 7, 2048, 1, 1), cpu, input_channels_last=False) == "im2col"
    assert channels_last_plan(ConvGeometry(1, 1024, 14, 14, 2048, 1, 1, (2, 2)), cpu) == "pointwise"
    assert channels_last_plan(ConvGeometry(1, 1024, 14, 14, 2048, 1, 1, (2, 2)), cpu, input_channels_last=False) == "im2col"
    assert channels_last_plan(ConvGeometry(1, 64, 14, 14, 64, 1, 1, pads=(1, 1, 1, 1)), cpu) == "im2col"
    assert channels_last_plan(ConvGeometry(1, 8, 16, 16, 64, 3, 3, pads=(1, 1, 1, 1)), cpu) == "im2col"
    # none: a GPU, no register tile, groups, 16-bit elements, output channels the tile width does not divide
    assert channels_last_plan(ConvGeometry(1, 64, 8, 8, 64, 1, 1), Capabilities(has_local=True)) is None
    assert channels_last_plan(ConvGeometry(1, 64, 8, 8, 64, 1, 1), Capabilities()) is None
    assert channels_last_plan(ConvGeometry(1, 64, 8, 8, 64, 3, 3, groups=2), cpu) is None
    assert channels_last_plan(ConvGeometry(1, 64, 8, 8, 64, 1, 1), cpu, itemsize=2) is None
    assert channels_last_plan(ConvGeometry(1, 64, 8, 8, 96, 1, 1), cpu) is None
    assert set(CHANNELS_LAST_FORMS) == {"pointwise", "winograd", "im2col", "taps"}


def test_kernel_arguments_are_checked():
    g = ConvGeometry(1, 8, 8, 8, 64, 3, 3, pads=(1, 1, 1, 1))
    with pytest.raises(UnknownNameError, match="channels-last form"):
        KN.conv2d_nhwc_kernels(g, "direct", 64)
    with pytest.raises(ArgumentError, match="does not divide"):
        KN.conv2d_nhwc_kernels(g, "im2col", 48)
    with pytest.raises(ArgumentError, match="reads a channels-last input"):
        KN.conv2d_nhwc_kernels(g, "winograd", 64, in_strides=_nchw_strides(g))
    with pytest.raises(ArgumentError, match="whole 2x2 tiles"):
        KN.conv2d_nhwc_kernels(ConvGeometry(1, 8, 7, 7, 64, 3, 3, pads=(1, 1, 1, 1)), "winograd", 64)
    with pytest.raises(ArgumentError, match="unpadded 1x1"):
        KN.conv2d_nhwc_kernels(g, "pointwise", 64)
    with pytest.raises(ArgumentError, match="does not divide"):
        KN.conv2d_nhwc_kernels(g, "taps", 48)
    with pytest.raises(ArgumentError, match="a kernel row each where"):
        KN.conv2d_nhwc_kernels(ConvGeometry(1, 8, 8, 8, 64, 3, 3, dilation=(1, 2), pads=(1, 2, 1, 2)), "taps", 64, runs=3)
    with pytest.raises(ArgumentError, match="one run"):
        KN.conv2d_nhwc_kernels(ConvGeometry(1, 8, 8, 8, 64, 1, 1, (2, 2)), "pointwise", 64, runs=2)
    with pytest.raises(ArgumentError, match="3 runs do not divide"):
        K.matmul_panels(4, 64, 8, 64, splits=3)
    with pytest.raises(ArgumentError, match="no batch and no epilogue"):
        K.matmul_panels(4, 64, 8, 64, splits=2, epilogue=K.Epilogue.of("relu"))
    with pytest.raises(ArgumentError, match="0 runs"):
        K.matmul_panels(4, 64, 8, 64, splits=0)
    with pytest.raises(ArgumentError, match="stride-1 3x3"):
        KN.conv2d_nhwc_kernels(ConvGeometry(1, 8, 8, 8, 64, 1, 1), "winograd", 64)
    with pytest.raises(ArgumentError, match="one group"):
        KN.conv2d_nhwc_kernels(ConvGeometry(1, 8, 8, 8, 64, 3, 3, groups=2), "im2col", 64)
    with pytest.raises(ArgumentError, match="without operands"):
        K.matmul_panels(4, 64, 8, 64, batch=2, epilogue=K.Epilogue.of("bias"))
    with pytest.raises(UnknownNameError, match="pooling"):
        KN.global_pool_nhwc("min", 1, 4, 8)


def test_batched_matmul_panels(cpu_level, rng):
    """`matmul_panels` over a batch of planes, A's and the output's planes padded apart."""
    wd = _width(cpu_level)
    B, M, N, Kd, pa, po = 3, 13, 2 * wd, 19, 5, 7
    a = random_array(rng, (B, M, Kd), np.float32)
    b = random_array(rng, (B, Kd, N), np.float32)
    a_buf = np.concatenate([np.concatenate([a[s].reshape(-1), np.full(pa, np.nan, np.float32)]) for s in range(B)])
    panels = b.reshape(B, Kd, N // wd, wd).transpose(0, 2, 1, 3).reshape(-1)
    out = cpu_level.empty(B * (M * N + po), dtypes.float32)
    cpu_level.compile(K.matmul_panels(M, N, Kd, wd, batch=B, plane_pads=(pa, po)), "bmm_panels")(
        cpu_level.buf(a_buf), cpu_level.buf(np.ascontiguousarray(panels)), out)
    got = out.numpy().reshape(B, M * N + po)[:, :M * N].reshape(B, M, N)
    np.testing.assert_allclose(got, a @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["avg", "max"])
def test_global_pool_nhwc(cpu_level, rng, kind):
    x = random_array(rng, (2, 37, 5, 7), np.float32)
    out = cpu_level.empty(2 * 37, dtypes.float32)
    cpu_level.compile(KN.global_pool_nhwc(kind, 2, 35, 37), f"gp_nhwc_{kind}")(
        cpu_level.buf(np.ascontiguousarray(x.transpose(0, 2, 3, 1))), out)
    want = x.mean(axis=(2, 3)) if kind == "avg" else x.max(axis=(2, 3))
    np.testing.assert_allclose(out.numpy().reshape(2, 37), want, rtol=1e-5, atol=1e-5)


# ---- the executor ------------------------------------------------------------------------------------

def _conv_node(name, x, w, out, **attrs):
    return helper.make_node("Conv", [x, w], [out], name=name, **attrs)


def _bottleneck_model(rng, wide=64, narrow=64, hw=10, tail="pool"):
    """A stem, two bottlenecks (1x1 -> 3x3 -> 1x1 + residual, relu) at `hw` x `hw` with a strided projection,
    then `tail`: "pool" (a whole-plane AveragePool, flattened), "output" (the last block is the output) or
    "concat" (the last block concatenated with its input, channels)."""
    inits, nodes = [], []

    def weight(name, co, ci, k):
        inits.append(numpy_helper.from_array((rng.standard_normal((co, ci, k, k)) * np.sqrt(2 / (ci * k * k)))
                                             .astype(np.float32), name))
        return name

    def conv(x, co, ci, k, out, stride=1, relu=True):
        pad = k // 2
        nodes.append(_conv_node(out, x, weight(out + "_w", co, ci, k), out + ("_c" if relu else ""),
                                kernel_shape=[k, k], pads=[pad] * 4, strides=[stride, stride]))
        if relu:
            nodes.append(helper.make_node("Relu", [out + "_c"], [out]))
        return out
    x = conv("x", wide, 3, 3, "stem", stride=2)
    for blk in range(2):
        stride = 2 if blk == 1 else 1
        a = conv(x, narrow, wide, 1, f"b{blk}a")
        b = conv(a, narrow, narrow, 3, f"b{blk}b", stride=stride)
        c = conv(b, wide, narrow, 1, f"b{blk}c", relu=False)
        res = conv(x, wide, wide, 1, f"b{blk}p", stride=2, relu=False) if stride == 2 else x
        nodes.append(helper.make_node("Add", [c, res], [f"b{blk}s"]))
        nodes.append(helper.make_node("Relu", [f"b{blk}s"], [f"b{blk}"]))
        x = f"b{blk}"
    side = hw // 2
    if tail == "pool":
        nodes.append(helper.make_node("AveragePool", [x], ["pool"], kernel_shape=[side, side]))
        nodes.append(helper.make_node("Flatten", ["pool"], ["y"]))
        out_shape = [1, wide]
    elif tail == "concat":
        nodes.append(helper.make_node("Concat", [x, x], ["y"], axis=1))
        out_shape = [1, 2 * wide, side, side]
    else:
        nodes.append(helper.make_node("Identity", [x], ["y"]))
        out_shape = [1, wide, side, side]
    g = helper.make_graph(nodes, "bottlenecks", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2 * hw, 2 * hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _marked(model) -> dict[str, bool]:
    from morok_py.onnx.fuse import fuse
    return {n.name: any(a.name == "channels_last" for a in n.attribute)
            for n in fuse(model).graph.node if n.op_type == "MorokConv"}


def test_marking_follows_the_readers(rng):
    m = _marked(_bottleneck_model(rng, tail="pool"))
    # the stem's output goes to a 1x1 conv and a residual Add: both layers of the first block are marked
    assert all(m.values()), m
    # a graph output or a Concat reader (no channels-last form) keeps the last block's output NCHW; the layers
    # whose outputs that block reads (its input, residual and projection) then stay NCHW too, and so on up
    # the chain: no layer is marked whose output some NCHW reader would have to turn around
    for tail in ("concat", "output"):
        m = _marked(_bottleneck_model(rng, tail=tail))
        assert not any(m.values()), (tail, m)


def test_short_chains_from_nchw_layers_stay_nchw(rng):
    """Two 1x1 layers after a depthwise one (NCHW: no channels-last form), the second with the depthwise
    layer's input as its residual: two NCHW reads for two layers, fewer than CHANNELS_LAST_LAYERS_PER_EDGE each."""
    from morok_py.onnx.fuse import CHANNELS_LAST_LAYERS_PER_EDGE
    assert CHANNELS_LAST_LAYERS_PER_EDGE > 1
    C = 64
    w = lambda co, ci, k: numpy_helper.from_array(rng.standard_normal((co, ci, k, k)).astype(np.float32) * 0.1)  # noqa: E731
    inits = [w(C, 1, 3), w(C, C, 1), w(C, C, 1)]
    for t, name in zip(inits, ("wd", "w1", "w2")):
        t.name = name
    nodes = [helper.make_node("Conv", ["x", "wd"], ["d"], name="dw", group=C, kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Conv", ["d", "w1"], ["p1"], name="p1", kernel_shape=[1, 1]),
             helper.make_node("Conv", ["p1", "w2"], ["p2c"], name="p2", kernel_shape=[1, 1]),
             helper.make_node("Add", ["p2c", "x"], ["p2"]),
             helper.make_node("GlobalAveragePool", ["p2"], ["y"])]
    g = helper.make_graph(nodes, "short", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, 9, 9])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, C, 1, 1])], inits)
    assert not any(_marked(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])).values())


def test_whole_plane_average_pool_is_global(rng):
    from morok_py.onnx.fuse import fuse
    ops = [n.op_type for n in fuse(_bottleneck_model(rng, tail="pool")).graph.node]
    assert "MorokGlobalPool" in ops and "MorokPool2d" not in ops


@pytest.mark.parametrize("tail, wide", [("pool", 64), ("pool", 36), ("concat", 64), ("output", 64)])
def test_models_match_the_nchw_executor(rng, monkeypatch, tail, wide):
    """Each model against onnx's reference and the NCHW executor; 36 wide layers are marked, but no register
    tile width (8, 16 or 64) divides 36: they run NCHW at run time, reading their channels-last neighbours'
    outputs and handing them theirs."""
    from morok_py.onnx.executor import OnnxExecutor
    from onnx.reference import ReferenceEvaluator
    model = _bottleneck_model(rng, wide=wide, tail=tail)
    x = rng.standard_normal((1, 3, 20, 20)).astype(np.float32)
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    ex = OnnxExecutor(model, "CPU")
    got = [np.asarray(ex.run({"x": x})[0]) for _ in range(2)]     # the recording run and a replay
    monkeypatch.setenv("MOROK_ONNX_CHANNELS_LAST", "0")
    nchw = np.asarray(OnnxExecutor(model, "CPU").run({"x": x})[0])
    for g in got + [nchw]:
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4)


def test_morok_beam_times_the_channels_last_forms(rng, monkeypatch, capfd):
    """Under MOROK_BEAM a channels-last stride-1 3x3 layer times its Winograd and columns forms, and a layer of
    few pixels its taps and columns (stand-in inputs, as the NCHW plans' search), MOROK_DEBUG prints both times,
    and the model still matches."""
    from onnx.reference import ReferenceEvaluator

    from morok_py.codegen.strategies.conv import channels_last_candidates
    from morok_py.onnx.executor import OnnxExecutor
    cpu = Capabilities(register_tile=(6, 64), tile_lanes=16)
    assert channels_last_candidates(ConvGeometry(1, 64, 14, 14, 64, 3, 3, pads=(1, 1, 1, 1)), cpu) == ["winograd", "im2col"]
    assert channels_last_candidates(ConvGeometry(1, 64, 14, 14, 64, 1, 1), cpu) == ["pointwise"]
    assert channels_last_candidates(ConvGeometry(1, 64, 14, 14, 96, 1, 1), cpu) == []
    model = _bottleneck_model(rng, tail="pool")
    x = rng.standard_normal((1, 3, 20, 20)).astype(np.float32)
    monkeypatch.setenv("MOROK_BEAM", "2")
    monkeypatch.setenv("MOROK_DEBUG", "1")
    got = np.asarray(OnnxExecutor(model, "CPU").run({"x": x})[0])
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, {"x": x})[0], rtol=1e-4, atol=1e-4)
    err = capfd.readouterr().err
    line = next(ln for ln in err.splitlines() if "b0b conv: channels-last" in ln)
    assert "; searched winograd " in line and " ms, im2col " in line, line
    # the stride-2 3x3 layer into 5x5 (a few row tiles of pixels): its taps against its columns in runs
    line = next(ln for ln in err.splitlines() if "b1b conv: channels-last" in ln)
    assert "; searched taps " in line and " ms, im2col " in line, line


def test_a_dynamic_batch_keeps_nchw(rng, monkeypatch):
    """A model whose batch is a dynamic dimension compiles one program for every batch size: its marked layers
    run their NCHW plans (the channels-last forms are built for a static batch), at two batch sizes."""
    from onnx.reference import ReferenceEvaluator

    from morok_py.onnx.executor import OnnxExecutor
    C, inits, nodes, x = 64, [], [], "x"
    for i, (ci, k) in enumerate([(3, 3), (C, 1), (C, 3), (C, 1)]):
        inits.append(numpy_helper.from_array((rng.standard_normal((C, ci, k, k)) * np.sqrt(2 / (ci * k * k)))
                                             .astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], name=f"c{i}", kernel_shape=[k, k], pads=[k // 2] * 4),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        x = f"r{i}"
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["y"]))
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 12, 12])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", C, 1, 1])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert all(_marked(model).values())
    import morok_py.onnx.fuse as fuse
    ran = []
    conv_nhwc = fuse._conv_nhwc
    monkeypatch.setattr(fuse, "_conv_nhwc", lambda *a, **k: (ran.append(1), conv_nhwc(*a, **k))[1])
    ex = OnnxExecutor(model, "CPU")
    assert ex.k.symbolic_outer
    for n in (1, 3):
        x = rng.standard_normal((n, 3, 12, 12)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(ex.run({"x": x})[0]), ReferenceEvaluator(model).run(None, {"x": x})[0],
                                   rtol=1e-4, atol=1e-4)
    assert not ran
    # the same model with a static batch runs its layers channels-last
    OnnxExecutor(model, "CPU", symbolic_outer=False).run({"x": x})
    assert len(ran) == 4
