"""Quantization, scatter/gather, control flow and long-tail ONNX ops on random data of odd sizes, through
morok_py.onnx on the CPU, against onnx's reference evaluator (numpy): the modes ONNX's own node cases
leave out (per-axis and blocked scales at odd sizes, grouped padded QLinearConv with per-channel scales,
batched MatMulInteger with per-row zero points, scatter reductions over repeated indices, reversed Scan
axes, Loop scan outputs, NonMaxSuppression on random boxes).
"""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed (pip install -e '.[onnx]')")
from onnx import TensorProto, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from morok_py.onnx import OnnxExecutor  # noqa: E402


def _vi(name, arr):
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), arr.shape)


def check(nodes, feeds: dict, outputs, opset: int = 21, exact: bool = False, rtol=1e-5, atol=1e-5):
    """Build a graph of `nodes` over `feeds`, run it here and in the reference, compare every output."""
    nodes = nodes if isinstance(nodes, list) else [nodes]
    g = helper.make_graph(nodes, "g", [_vi(k, v) for k, v in feeds.items()],
                          [helper.make_value_info(o, onnx.TypeProto()) for o in outputs])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    want = ReferenceEvaluator(model).run(None, feeds)
    got = OnnxExecutor(model, "CPU").run(feeds)
    for o, gv, wv in zip(outputs, got, want):
        wv = np.asarray(wv)
        assert gv.shape == wv.shape, f"{o}: {gv.shape} != {wv.shape}"
        assert gv.dtype == wv.dtype, f"{o}: {gv.dtype} != {wv.dtype}"
        if exact or wv.dtype.kind in "biu":
            np.testing.assert_array_equal(gv, wv, err_msg=o)
        else:
            np.testing.assert_allclose(gv, wv, rtol=rtol, atol=atol, err_msg=o)
    return got


def run_here(nodes, feeds: dict, outputs, opset: int) -> list[np.ndarray]:
    """The graph run by morok_py.onnx only (for modes the reference evaluator gets wrong or lacks)."""
    nodes = nodes if isinstance(nodes, list) else [nodes]
    g = helper.make_graph(nodes, "g", [_vi(k, v) for k, v in feeds.items()],
                          [helper.make_value_info(o, onnx.TypeProto()) for o in outputs])
    return OnnxExecutor(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]), "CPU").run(feeds)


@pytest.fixture
def rng():
    return np.random.default_rng(2024)


# ---- quantization -----------------------------------------------------------------------------------
@pytest.mark.parametrize("zp_dtype", [np.uint8, np.int8, np.int16])
def test_quantize_per_axis_odd_sizes(rng, zp_dtype):
    x = (rng.standard_normal((3, 7, 5)) * 40).astype(np.float32)
    scale = rng.uniform(0.05, 0.5, 7).astype(np.float32)
    info = np.iinfo(zp_dtype)
    zp = rng.integers(max(info.min, -100), min(info.max, 100), 7).astype(zp_dtype)
    check(helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], axis=1), {"x": x, "s": scale, "z": zp}, ["y"])


def test_quantize_dequantize_blocked(rng):
    x = (rng.standard_normal((5, 11)) * 10).astype(np.float32)
    scale = rng.uniform(0.05, 0.5, (5, 3)).astype(np.float32)       # blocks of 4 along axis 1, the last short
    zp = rng.integers(-20, 20, (5, 3)).astype(np.int8)
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=1, block_size=4),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=1, block_size=4)]
    check(nodes, {"x": x, "s": scale, "z": zp}, ["q", "y"])


def test_dynamic_quantize_random(rng):
    x = (rng.standard_normal((9, 13)) * 3 + 1).astype(np.float32)
    check(helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"]), {"x": x}, ["y", "s", "z"], opset=11)


def test_matmul_integer_batched_per_row_zero_points(rng):
    a = rng.integers(0, 256, (2, 5, 19)).astype(np.uint8)
    b = rng.integers(-128, 128, (19, 7)).astype(np.int8)
    azp = rng.integers(0, 256, 5).astype(np.uint8)
    bzp = rng.integers(-128, 128, 7).astype(np.int8)
    # per-row a_zero_point (the spec's 1-D form): numpy here, the reference evaluator broadcasts it per column
    got = run_here(helper.make_node("MatMulInteger", ["a", "b", "az", "bz"], ["y"]),
                   {"a": a, "b": b, "az": azp, "bz": bzp}, ["y"], opset=10)[0]
    want = (a.astype(np.int32) - azp.astype(np.int32)[:, None]) @ (b.astype(np.int32) - bzp.astype(np.int32))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


def test_qlinear_conv_grouped_padded_per_channel(rng):
    x = rng.integers(0, 256, (2, 4, 9, 7)).astype(np.uint8)
    w = rng.integers(0, 256, (6, 2, 3, 3)).astype(np.uint8)
    feeds = {"x": x, "xs": np.float32(0.02), "xz": np.uint8(120), "w": w,
             "ws": rng.uniform(0.001, 0.01, 6).astype(np.float32), "wz": np.uint8(128),
             "ys": np.float32(0.05), "yz": np.uint8(100), "b": rng.integers(-500, 500, 6).astype(np.int32)}
    node = helper.make_node("QLinearConv", list(feeds), ["y"], group=2, pads=[1, 0, 1, 2], strides=[2, 1])
    check(node, feeds, ["y"], opset=10)


def test_conv_integer_strided(rng):
    x = rng.integers(0, 256, (1, 3, 8, 11)).astype(np.uint8)
    w = rng.integers(0, 256, (5, 3, 2, 3)).astype(np.uint8)
    node = helper.make_node("ConvInteger", ["x", "w", "xz"], ["y"], strides=[2, 2], pads=[0, 1, 1, 0])
    check(node, {"x": x, "w": w, "xz": np.uint8(77)}, ["y"], opset=10)


# ---- scatter and gather -----------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
def test_scatter_elements_repeated_indices(rng, reduction):
    data = rng.standard_normal((5, 7)).astype(np.float32)
    ind = rng.integers(-5, 5, (9, 4)).astype(np.int64)        # more updates than rows: repeats, negatives
    upd = rng.standard_normal((9, 4)).astype(np.float32)
    check(helper.make_node("ScatterElements", ["d", "i", "u"], ["y"], axis=0, reduction=reduction),
          {"d": data, "i": ind, "u": upd}, ["y"], opset=18)


@pytest.mark.parametrize("reduction", ["none", "add", "max"])
def test_scatter_nd_slices(rng, reduction):
    data = rng.standard_normal((6, 5, 3)).astype(np.float32)
    idx = rng.permutation(6)[:4] if reduction == "none" else rng.integers(0, 6, 4)
    ind = idx.reshape(4, 1).astype(np.int64)
    upd = rng.standard_normal((4, 5, 3)).astype(np.float32)
    check(helper.make_node("ScatterND", ["d", "i", "u"], ["y"], reduction=reduction),
          {"d": data, "i": ind, "u": upd}, ["y"], opset=18)


def test_gather_nd_batch_dims(rng):
    data = rng.standard_normal((3, 5, 4, 2)).astype(np.float32)
    ind = np.stack([rng.integers(0, 5, (3, 7)), rng.integers(-4, 4, (3, 7))], -1).astype(np.int64)
    check(helper.make_node("GatherND", ["d", "i"], ["y"], batch_dims=1), {"d": data, "i": ind}, ["y"], opset=13)


def test_cumprod_reverse_exclusive(rng):
    x = rng.uniform(0.5, 1.5, (4, 9)).astype(np.float32)
    check(helper.make_node("CumProd", ["x", "a"], ["y"], exclusive=1, reverse=1),
          {"x": x, "a": np.array(1, np.int64)}, ["y"], opset=26)


# ---- control flow -----------------------------------------------------------------------------------
def test_loop_with_scan_output_and_outer_scope(rng):
    w = rng.standard_normal((3, 3)).astype(np.float32)
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h_in", "w"], ["h1"]), helper.make_node("Tanh", ["h1"], ["h_out"]),
         helper.make_node("Identity", ["c_in"], ["c_out"]), helper.make_node("Identity", ["h_out"], ["scan"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("h_in", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("scan", TensorProto.FLOAT, [2, 3])])
    node = helper.make_node("Loop", ["n", "c", "h"], ["hf", "hs"], body=body)
    feeds = {"n": np.array(5, np.int64), "c": np.array(True), "h": rng.standard_normal((2, 3)).astype(np.float32),
             "w": w}
    # scan outputs stack along a new axis (as ONNX's loop cases expect; the reference evaluator concatenates)
    hf, hs = run_here(node, feeds, ["hf", "hs"], opset=13)
    h, rows = feeds["h"], []
    for _ in range(5):
        h = np.tanh(h @ w)
        rows.append(h)
    np.testing.assert_allclose(hf, h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hs, np.stack(rows), rtol=1e-5, atol=1e-6)


def test_scan_reverse_axis(rng):
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "x"], ["s_out"]), helper.make_node("Mul", ["s_out", "x"], ["y"])],
        "body", [helper.make_tensor_value_info("s_in", TensorProto.FLOAT, [3]),
                 helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("s_out", TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    node = helper.make_node("Scan", ["s", "xs"], ["sf", "ys"], body=body, num_scan_inputs=1,
                            scan_input_axes=[1], scan_input_directions=[1], scan_output_axes=[1],
                            scan_output_directions=[1])
    feeds = {"s": rng.standard_normal(3).astype(np.float32), "xs": rng.standard_normal((3, 7)).astype(np.float32)}
    sf, ys = run_here(node, feeds, ["sf", "ys"], opset=16)     # the reference evaluator has no reverse scans
    st, out = feeds["s"], np.zeros((3, 7), np.float32)
    for t in reversed(range(7)):        # step k reads column 6 - k and, output reversed, writes column 6 - k
        st = st + feeds["xs"][:, t]
        out[:, t] = st * feeds["xs"][:, t]
    np.testing.assert_allclose(sf, st, rtol=1e-6)
    np.testing.assert_allclose(ys, out, rtol=1e-6)


@pytest.mark.parametrize("cond", [True, False])
def test_if_reads_outer_scope(rng, cond):
    then = helper.make_graph([helper.make_node("Add", ["a", "b"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [4, 5])])
    other = helper.make_graph([helper.make_node("Sub", ["a", "b"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [4, 5])])
    node = helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)
    feeds = {"c": np.array(cond), "a": rng.standard_normal((4, 5)).astype(np.float32),
             "b": rng.standard_normal((4, 5)).astype(np.float32)}
    check(node, feeds, ["y"], opset=13)


# ---- long tail ----------------------------------------------------------------------------------------
def test_nonmaxsuppression_random_boxes(rng):
    c = rng.uniform(0, 10, (2, 23, 2))
    wh = rng.uniform(0.5, 4, (2, 23, 2))
    boxes = np.concatenate([c - wh / 2, c + wh / 2], -1)[..., [1, 0, 3, 2]].astype(np.float32)
    scores = rng.uniform(0, 1, (2, 3, 23)).astype(np.float32)
    feeds = {"b": boxes, "s": scores, "m": np.array([5], np.int64), "iou": np.array([0.3], np.float32),
             "st": np.array([0.2], np.float32)}
    check(helper.make_node("NonMaxSuppression", list(feeds), ["y"]), feeds, ["y"], opset=11)


@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
def test_bitshift_random(rng, direction):
    x = rng.integers(0, 2**32, 37, dtype=np.uint64).astype(np.uint32)
    s = rng.integers(0, 32, 37).astype(np.uint32)
    check(helper.make_node("BitShift", ["x", "s"], ["y"], direction=direction), {"x": x, "s": s}, ["y"], opset=11)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("pad", ["zeros", "border", "reflection"])
def test_grid_sample_random(rng, mode, pad):
    x = rng.standard_normal((2, 3, 5, 7)).astype(np.float32)
    grid = rng.uniform(-1.3, 1.3, (2, 4, 6, 2)).astype(np.float32)
    check(helper.make_node("GridSample", ["x", "g"], ["y"], mode=mode, padding_mode=pad, align_corners=0),
          {"x": x, "g": grid}, ["y"], opset=20, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["Tan", "Atan", "Asin", "Acos", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh"])
def test_trig_random(rng, name):
    lo, hi = {"Asin": (-1, 1), "Acos": (-1, 1), "Atanh": (-0.99, 0.99), "Acosh": (1, 9), "Tan": (-1.5, 1.5),
              "Sinh": (-5, 5), "Cosh": (-5, 5)}.get(name, (-9, 9))
    x = rng.uniform(lo, hi, 101).astype(np.float32)
    check(helper.make_node(name, ["x"], ["y"]), {"x": x}, ["y"], opset=13, rtol=2e-6, atol=2e-6)


def test_dft_odd_length(rng):
    x = rng.standard_normal((2, 13, 2)).astype(np.float32)
    check(helper.make_node("DFT", ["x", "", "a"], ["y"]), {"x": x, "a": np.array(1, np.int64)}, ["y"], opset=20,
          rtol=1e-5, atol=1e-5)


def test_det_random(rng):
    x = rng.standard_normal((3, 5, 5)).astype(np.float32)
    check(helper.make_node("Det", ["x"], ["y"]), {"x": x}, ["y"], opset=13, rtol=1e-5, atol=1e-5)
