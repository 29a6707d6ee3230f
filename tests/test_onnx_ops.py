"""Single ONNX ops through morok_py.onnx on random data against numpy, for behaviour the ONNX node
cases leave out: integer Div and Mod with negative operands, recurrent nets with sequence_lens,
bidirectional and batch-first layouts, ConvTranspose with groups and strides, Resize on odd sizes."""
from __future__ import annotations

import os

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed (pip install -e '.[onnx]')")
from onnx import TensorProto, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from morok_py.onnx import OnnxExecutor  # noqa: E402

DEVICE = os.environ.get("MOROK_ONNX_DEVICE", "CPU")
RNG = np.random.default_rng(11)


def one_node(op: str, inputs: dict[str, np.ndarray], outputs: list[str], opset: int = 22, **attrs):
    node = helper.make_node(op, list(inputs), outputs, **attrs)
    vis = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for n, v in inputs.items()]
    outs = [helper.make_empty_tensor_value_info(o) for o in outputs]
    return helper.make_model(helper.make_graph([node], op, vis, outs),
                             opset_imports=[helper.make_opsetid("", opset)])


def run_both(model, feeds):
    got = OnnxExecutor(model, DEVICE).run(feeds)
    want = ReferenceEvaluator(model).run(None, feeds)
    return got, want


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_div_and_mod_with_negative_operands(dtype):
    a = RNG.integers(-50, 50, size=(7, 5)).astype(dtype)
    b = RNG.integers(1, 9, size=(7, 5)).astype(dtype) * RNG.choice([-1, 1], size=(7, 5)).astype(dtype)
    div = OnnxExecutor(one_node("Div", {"a": a, "b": b}, ["y"]), DEVICE).run({"a": a, "b": b})[0]
    np.testing.assert_array_equal(div, (np.trunc(a / b)).astype(dtype))
    fmod = OnnxExecutor(one_node("Mod", {"a": a, "b": b}, ["y"], fmod=1), DEVICE).run({"a": a, "b": b})[0]
    np.testing.assert_array_equal(fmod, np.fmod(a, b))
    pymod = OnnxExecutor(one_node("Mod", {"a": a, "b": b}, ["y"], fmod=0), DEVICE).run({"a": a, "b": b})[0]
    np.testing.assert_array_equal(pymod, np.mod(a, b))


def _rnn_inputs(kind: str, S: int, B: int, I: int, H: int, D: int, layout: int):
    G = {"RNN": 1, "GRU": 3, "LSTM": 4}[kind]
    x = RNG.standard_normal((B, S, I) if layout else (S, B, I)).astype(np.float32)
    feeds = {"X": x, "W": (RNG.standard_normal((D, G * H, I)) * 0.5).astype(np.float32),
             "R": (RNG.standard_normal((D, G * H, H)) * 0.5).astype(np.float32),
             "B": (RNG.standard_normal((D, 2 * G * H)) * 0.3).astype(np.float32)}
    return feeds


@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("direction,layout", [("bidirectional", 0), ("reverse", 1), ("forward", 1)])
def test_recurrent_nets_against_the_reference(kind, direction, layout):
    S, B, I, H = 5, 3, 4, 6
    D = 2 if direction == "bidirectional" else 1
    feeds = _rnn_inputs(kind, S, B, I, H, D, layout)
    outs = ["Y", "Y_h"] + (["Y_c"] if kind == "LSTM" else [])
    extra = {"linear_before_reset": 1} if kind == "GRU" and direction == "reverse" else {}
    model = one_node(kind, feeds, outs, hidden_size=H, direction=direction, layout=layout, **extra)
    got, want = run_both(model, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
def test_sequence_lens_stop_each_batch_entry(kind):
    """Past its length an entry's outputs are 0 and its last state is the one at its length (spec)."""
    S, B, I, H = 6, 3, 4, 5
    feeds = _rnn_inputs(kind, S, B, I, H, 1, 0)
    lens = np.array([6, 2, 4], np.int32)
    model = one_node(kind, {**feeds, "L": lens}, ["Y", "Y_h"], hidden_size=H)
    y, yh = OnnxExecutor(model, DEVICE).run({**feeds, "L": lens})
    for b, n in enumerate(lens):          # entry b alone, run for its own length
        sub = {k: v for k, v in feeds.items()}
        sub["X"] = feeds["X"][:n, b:b + 1]
        y1, yh1 = ReferenceEvaluator(one_node(kind, sub, ["Y", "Y_h"], hidden_size=H)).run(None, sub)
        np.testing.assert_allclose(y[:n, :, b:b + 1], y1, rtol=1e-4, atol=1e-5)
        assert not y[n:, :, b].any()
        np.testing.assert_allclose(yh[:, b:b + 1], yh1, rtol=1e-4, atol=1e-5)


def conv_transpose_numpy(x, w, b, group, strides, pads, dil, opad):
    """Scatter form: every input element adds its weighted kernel window into the output."""
    N, C, H, W_ = x.shape
    Cg, Mg, kh, kw = C // group, w.shape[1], w.shape[2], w.shape[3]
    full = [strides[0] * (H - 1) + opad[0] + (kh - 1) * dil[0] + 1,
            strides[1] * (W_ - 1) + opad[1] + (kw - 1) * dil[1] + 1]
    y = np.zeros((N, Mg * group, full[0], full[1]), np.float64)
    for ci in range(C):
        g = ci // Cg
        for ki in range(kh):
            for kj in range(kw):
                contrib = x[:, ci, :, :, None].astype(np.float64) * w[ci, :, ki, kj]       # N, H, W, Mg
                ys = slice(ki * dil[0], ki * dil[0] + strides[0] * (H - 1) + 1, strides[0])
                xs = slice(kj * dil[1], kj * dil[1] + strides[1] * (W_ - 1) + 1, strides[1])
                y[:, g * Mg:(g + 1) * Mg, ys, xs] += contrib.transpose(0, 3, 1, 2)
    y = y[:, :, pads[0]:full[0] - pads[2], pads[1]:full[1] - pads[3]]
    return (y + b[None, :, None, None]).astype(np.float32)


@pytest.mark.parametrize("group,strides,pads,dil", [(1, [2, 3], [1, 0, 2, 1], [1, 1]), (3, [2, 1], [0, 1, 0, 0], [2, 1])])
def test_conv_transpose_against_numpy(group, strides, pads, dil):
    C = 2 * group + 1 if group == 1 else 2 * group
    x = RNG.standard_normal((2, C, 5, 7)).astype(np.float32)
    w = RNG.standard_normal((C, 2, 3, 2)).astype(np.float32)
    b = RNG.standard_normal((2 * group,)).astype(np.float32)
    model = one_node("ConvTranspose", {"x": x, "w": w, "b": b}, ["y"], group=group, strides=strides, pads=pads,
                     dilations=dil, output_padding=[1, 0])
    got = OnnxExecutor(model, DEVICE).run({"x": x, "w": w, "b": b})[0]
    np.testing.assert_allclose(got, conv_transpose_numpy(x, w, b, group, strides, pads, dil, [1, 0]),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode,ctm", [("linear", "half_pixel"), ("cubic", "align_corners"),
                                      ("nearest", "asymmetric"), ("linear", "pytorch_half_pixel")])
def test_resize_odd_sizes_against_the_reference(mode, ctm):
    x = RNG.standard_normal((1, 2, 5, 7)).astype(np.float32)
    sizes = np.array([1, 2, 9, 4], np.int64)
    roi = np.array([], np.float32)
    scales = np.array([], np.float32)
    model = one_node("Resize", {"x": x, "roi": roi, "scales": scales, "sizes": sizes}, ["y"], opset=19,
                     mode=mode, coordinate_transformation_mode=ctm)
    feeds = {"x": x, "roi": roi, "scales": scales, "sizes": sizes}
    got, want = run_both(model, feeds)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("transposed_past", [False, True])
def test_attention_with_a_past_cache_against_the_reference(transposed_past):
    """Grouped-query causal attention over a past cache given contiguous (its length a launch variable)
    or as a transposed view (static), with a float mask shorter than the keys (padded with -inf)."""
    B, H, KVH, S, P, D = 2, 4, 2, 3, 5, 6
    vi = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    nodes = [helper.make_node("Transpose", ["pk_in"], ["pk"], perm=[0, 1, 3, 2]) if transposed_past
             else helper.make_node("Identity", ["pk_in"], ["pk"]),
             helper.make_node("Attention", ["q", "k", "v", "mask", "pk", "pv"], ["y", "k2", "v2"], is_causal=1)]
    pk_shape = (B, KVH, D, P) if transposed_past else (B, KVH, P, D)
    shapes = {"q": (B, H, S, D), "k": (B, KVH, S, D), "v": (B, KVH, S, D), "mask": (S, P + S - 1),
              "pk_in": pk_shape, "pv": (B, KVH, P, D)}
    g = helper.make_graph(nodes, "attention", [vi(n, s) for n, s in shapes.items()],
                          [vi("y", None), vi("k2", None), vi("v2", None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    feeds = {n: RNG.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    got, want = run_both(model, feeds)
    for g_, w in zip(got, want):
        np.testing.assert_allclose(g_, w, rtol=1e-4, atol=1e-5)
