"""morok_py.onnx.InferenceSession, the onnxruntime-style API: loading from a path, bytes or a ModelProto,
providers mapped to devices, get_inputs/get_outputs, run with output names, and a dynamic batch that
reuses the compiled programs. Numpy is the reference."""
from __future__ import annotations

import os

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed (pip install -e '.[onnx]')")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from morok_py.onnx import InferenceSession, OnnxError  # noqa: E402

DEVICE = os.environ.get("MOROK_ONNX_DEVICE", "CPU")
RNG = np.random.default_rng(7)
W = RNG.standard_normal((5, 7)).astype(np.float32)
B0 = RNG.standard_normal((7,)).astype(np.float32)


def mlp_model() -> onnx.ModelProto:
    """x[B, 3, 5] -> relu(x @ W + b) -> softmax over the last axis; also returns the pre-softmax."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]), helper.make_node("Softmax", ["r"], ["y"], axis=-1)]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 5])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, 7]),
                           helper.make_tensor_value_info("r", TensorProto.FLOAT, ["batch", 3, 7])],
                          [numpy_helper.from_array(W, "W"), numpy_helper.from_array(B0, "b")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r = np.maximum(x @ W + B0, 0)
    e = np.exp(r - r.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True), r


def providers() -> list[str]:
    return ["CUDAExecutionProvider", "CPUExecutionProvider"] if DEVICE.upper().startswith("CUDA") else [DEVICE]


def test_session_describes_inputs_and_outputs():
    sess = InferenceSession(mlp_model().SerializeToString(), providers=providers())
    (i,) = sess.get_inputs()
    assert (i.name, i.shape, i.type) == ("x", ["batch", 3, 5], "tensor(float)")
    assert [(o.name, o.shape) for o in sess.get_outputs()] == [("y", ["batch", 3, 7]), ("r", ["batch", 3, 7])]


def test_session_runs_named_outputs(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), str(path))
    sess = InferenceSession(str(path), providers=providers())
    x = RNG.standard_normal((2, 3, 5)).astype(np.float32)
    y, r = reference(x)
    got_r, got_y = sess.run(["r", "y"], {"x": x})
    np.testing.assert_allclose(got_y, y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_r, r, rtol=1e-5, atol=1e-6)
    (only_y,) = sess.run(["y"], {"x": x})
    np.testing.assert_allclose(only_y, y, rtol=1e-5, atol=1e-6)
    assert len(sess.run(None, {"x": x})) == 2


def test_a_new_batch_size_compiles_nothing():
    sess = InferenceSession(mlp_model(), providers=providers())
    k = sess.executor.k
    counts = []
    for batch in (2, 5, 3, 5):
        x = RNG.standard_normal((batch, 3, 5)).astype(np.float32)
        got = sess.run(["y"], {"x": x})[0]
        np.testing.assert_allclose(got, reference(x)[0], rtol=1e-5, atol=1e-6)
        counts.append(len(k.programs))
    assert counts[0] > 0 and counts == [counts[0]] * 4, f"programs compiled after each batch size: {counts}"


def test_providers_map_to_devices():
    sess = InferenceSession(mlp_model(), providers=["CPUExecutionProvider"])
    assert sess.device == "CPU" and sess.get_providers() == ["CPUExecutionProvider"]
    sess = InferenceSession(mlp_model(), providers=["cpu"])
    assert sess.device == "CPU"
    with pytest.raises(OnnxError, match="NoSuchExecutionProvider"):
        InferenceSession(mlp_model(), providers=["NoSuchExecutionProvider"])


def test_unknown_feeds_and_outputs_are_named():
    sess = InferenceSession(mlp_model(), providers=["CPUExecutionProvider"])
    x = RNG.standard_normal((1, 3, 5)).astype(np.float32)
    with pytest.raises(OnnxError, match="'z'"):
        sess.run(None, {"x": x, "z": x})
    with pytest.raises(OnnxError, match="nope"):
        sess.run(["nope"], {"x": x})


def test_importing_without_onnx_names_the_extra():
    import subprocess
    import sys
    code = ("import sys; sys.modules['onnx'] = None\n"
            "from morok_py.errors import DeviceUnavailableError\n"
            "try:\n    import morok_py.onnx\nexcept DeviceUnavailableError as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "OnnxUnavailableError" in out.stdout and "pip install morok-py[onnx]" in out.stdout, out.stdout + out.stderr
