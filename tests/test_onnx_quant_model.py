"""A dynamically quantized int8 MLP through morok_py.onnx, on the CPU and both CUDA pairs:
- built with onnx.helper (DynamicQuantizeLinear + MatMulInteger + scales), matched against a numpy
  reference of the same quantized arithmetic and, where installed, onnxruntime;
- a float MLP quantized by onnxruntime.quantization.quantize_dynamic, matched against onnxruntime
  running the same quantized model (skipped with the reason where onnxruntime is not installed).
The integer matmuls read the uint8/int8 tensors as stored and write int32: no float copy of them.
"""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed (pip install -e '.[onnx]')")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from morok_py import dtypes  # noqa: E402
from morok_py.onnx import OnnxExecutor  # noqa: E402
from conftest import open_target  # noqa: E402

PAIRS = [
    pytest.param(("CPU", "llvm"), id="CPU-llvm"),
    pytest.param(("CUDA", "nvrtc"), id="CUDA-nvrtc", marks=pytest.mark.cuda),
    pytest.param(("CUDA", "llvm-nvptx"), id="CUDA-llvm-nvptx", marks=pytest.mark.cuda),
]
SIZES = [37, 29, 11]        # in, hidden, out: none a multiple of a vector width


def _weights(rng, bound: int = 127):
    """Per-layer int8 weights in [-bound, bound] with a per-tensor scale and a float32 bias."""
    layers = []
    for k, n in zip(SIZES[:-1], SIZES[1:]):
        w = rng.integers(-bound, bound + 1, size=(k, n)).astype(np.int8)
        layers.append((w, np.float32(rng.uniform(0.002, 0.01)), rng.standard_normal(n).astype(np.float32)))
    return layers


def quantized_mlp(layers) -> onnx.ModelProto:
    """x -> [DynamicQuantizeLinear -> MatMulInteger -> Cast -> * (x_scale * w_scale) -> + bias -> Relu]*"""
    nodes, inits = [], []
    cur = "x"
    for i, (w, ws, b) in enumerate(layers):
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(np.array(ws, np.float32), f"ws{i}"),
                  numpy_helper.from_array(np.int8(0).reshape(()), f"wzp{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes += [
            helper.make_node("DynamicQuantizeLinear", [cur], [f"q{i}", f"qs{i}", f"qzp{i}"]),
            helper.make_node("MatMulInteger", [f"q{i}", f"w{i}", f"qzp{i}", f"wzp{i}"], [f"acc{i}"]),
            helper.make_node("Cast", [f"acc{i}"], [f"accf{i}"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [f"qs{i}", f"ws{i}"], [f"s{i}"]),
            helper.make_node("Mul", [f"accf{i}", f"s{i}"], [f"y{i}"]),
            helper.make_node("Add", [f"y{i}", f"b{i}"], [f"z{i}"]),
        ]
        cur = f"z{i}"
        if i < len(layers) - 1:
            nodes.append(helper.make_node("Relu", [cur], [f"h{i}"]))
            cur = f"h{i}"
    nodes.append(helper.make_node("Identity", [cur], ["out"]))
    g = helper.make_graph(nodes, "qmlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", SIZES[0]])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", SIZES[-1]])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)  # onnxruntime 1.30 reads IR <= 13


def _dynamic_quantize(x: np.ndarray):
    """ONNX DynamicQuantizeLinear in numpy (uint8, range widened to include 0)."""
    mx, mn = np.float32(max(0.0, x.max())), np.float32(min(0.0, x.min()))
    scale = np.float32((mx - mn) if mx != mn else 1.0) / np.float32(255)
    zp = np.rint(np.clip(np.float32(0) - mn / scale, 0, 255))
    q = np.clip(np.rint(x / scale) + zp, 0, 255).astype(np.uint8)
    return q, scale, np.uint8(zp)


def reference(layers, x: np.ndarray) -> np.ndarray:
    for i, (w, ws, b) in enumerate(layers):
        q, s, zp = _dynamic_quantize(x)
        acc = (q.astype(np.int32) - np.int32(zp)) @ w.astype(np.int32)
        x = acc.astype(np.float32) * (s * ws) + b
        if i < len(layers) - 1:
            x = np.maximum(x, 0)
    return x


def _matmul_integer_launches(ex):
    """The launches that read uint8 and int8 buffers and write int32: the integer matmuls."""
    out = []
    for _, bufs, _ in ex.k.launches:
        dts = [b.dtype for b in bufs]
        if dts[-1] == dtypes.int32 and dtypes.uint8 in dts[:-1] and dtypes.int8 in dts[:-1]:
            out.append(dts)
    return out


@pytest.mark.parametrize("pair", PAIRS)
def test_quantized_mlp_matches_numpy(pair):
    target = open_target(*pair)
    rng = np.random.default_rng(7)
    layers = _weights(rng)
    model = quantized_mlp(layers)
    ex = OnnxExecutor(model, target.dev, compiler=target.compiler)
    for batch in (5, 3):
        x = rng.standard_normal((batch, SIZES[0])).astype(np.float32) * 2
        got = ex.run({"x": x})[0]
        want = reference(layers, x)
        assert got.shape == want.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert len(_matmul_integer_launches(ex)) == len(layers)
    # quantization error against the float MLP stays small: the int8 path is computing the same network
    f = x
    for i, (w, ws, b) in enumerate(layers):
        f = f @ (w.astype(np.float32) * ws) + b
        f = np.maximum(f, 0) if i < len(layers) - 1 else f
    assert np.abs(got - f).max() < 0.05 * np.abs(f).max()


@pytest.mark.parametrize("pair", PAIRS)
def test_quantized_mlp_matches_onnxruntime(pair):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
    target = open_target(*pair)
    rng = np.random.default_rng(11)
    # 7-bit weights: onnxruntime's u8s8 kernel on hosts without AVX-512 VNNI (vpmaddubsw) adds pairs of
    # uint8 x int8 products in int16 with saturation, so full-range weights (255 * 127 * 2 > 32767) give it
    # wrong sums there (on the 2-vCPU AVX2 EPYC: 44 of 44 outputs off, up to 1.85); 63 keeps every pair exact
    model = quantized_mlp(_weights(rng, bound=63))
    x = rng.standard_normal((4, SIZES[0])).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = OnnxExecutor(model, target.dev, compiler=target.compiler).run({"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def float_mlp(rng) -> onnx.ModelProto:
    nodes, inits, cur = [], [], "x"
    for i, (k, n) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        inits += [numpy_helper.from_array((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [cur, f"w{i}"], [f"m{i}"]), helper.make_node("Add", [f"m{i}", f"b{i}"],
                                                                                         [f"a{i}"])]
        cur = f"a{i}"
        if i < len(SIZES) - 2:
            nodes.append(helper.make_node("Relu", [cur], [f"r{i}"]))
            cur = f"r{i}"
    nodes.append(helper.make_node("Identity", [cur], ["out"]))
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", SIZES[0]])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", SIZES[-1]])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)  # onnxruntime 1.30 reads IR <= 13


@pytest.mark.parametrize("pair", PAIRS)
def test_quantize_dynamic_mlp_matches_onnxruntime(pair, tmp_path):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
    quant = pytest.importorskip("onnxruntime.quantization", reason="onnxruntime.quantization is not installed")
    target = open_target(*pair)
    rng = np.random.default_rng(5)
    src, dst = tmp_path / "mlp.onnx", tmp_path / "mlp.int8.onnx"
    onnx.save(float_mlp(rng), str(src))
    quant.quantize_dynamic(str(src), str(dst), weight_type=quant.QuantType.QInt8)
    model = onnx.load(str(dst))
    ops = {n.op_type for n in model.graph.node}
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= ops, ops
    x = rng.standard_normal((6, SIZES[0])).astype(np.float32)
    want = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    ex = OnnxExecutor(model, target.dev, compiler=target.compiler)
    got = ex.run({"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert len(_matmul_integer_launches(ex)) == len(SIZES) - 1
