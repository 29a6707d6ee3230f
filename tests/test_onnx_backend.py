"""morok_py.onnx.MorokBackend driven by ONNX's own runner (`onnx.backend.test.BackendTest`), on a bounded
selection of node cases (one or two per op family, the new ops included) so it stays short; the full
node conformance run is tests/test_onnx_nodes.py. Also run_node and supports_device directly."""
from __future__ import annotations

import os
import unittest

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed (pip install -e '.[onnx]')")
from onnx import helper  # noqa: E402

from morok_py.onnx.backend import MorokBackend  # noqa: E402

DEVICE = os.environ.get("MOROK_ONNX_DEVICE", "CPU")

# node cases, one regex: elementwise, broadcasting, shapes, reductions, linear algebra, conv/pool,
# normalization, softmax, attention, RMS norm, rotary embedding, resize, transposed conv, recurrent nets
SELECTED = [
    "test_add_bcast", "test_relu", "test_gelu_tanh_1", "test_where_example", "test_cast_FLOAT_to_FLOAT16",
    "test_reshape_negative_dim", "test_transpose_all_permutations_3", "test_slice_neg_steps", "test_concat_3d_axis_1",
    "test_gather_1", "test_reduce_mean_keepdims_example", "test_argmax_keepdims_random",
    "test_matmul_3d", "test_gemm_all_attributes", "test_einsum_batch_matmul",
    "test_conv_with_strides_padding", "test_maxpool_2d_pads", "test_averagepool_2d_pads",
    "test_batchnorm_example", "test_layer_normalization_4d_axis1", "test_softmax_axis_1",
    "test_attention_4d_gqa", "test_attention_4d_causal", "test_attention_4d_gqa_with_past_and_present",
    "test_rms_normalization_3d_axis2_epsilon", "test_rotary_embedding", "test_mvn",
    "test_resize_upsample_scales_linear", "test_resize_downsample_scales_cubic", "test_convtranspose_pads",
    "test_lstm_defaults", "test_gru_defaults", "test_simple_rnn_defaults",
]
PATTERN = "^(" + "|".join(SELECTED) + f")_{DEVICE.split(':')[0].lower()}$"


def test_onnx_backend_test_runner():
    from onnx.backend.test import BackendTest
    if not MorokBackend.supports_device(DEVICE):
        pytest.skip(f"{DEVICE} does not open here")
    runner = BackendTest(MorokBackend, __name__).include(PATTERN)
    suite = runner.test_suite
    result = unittest.TestResult()
    suite.run(result)
    ran = result.testsRun - len(result.skipped)
    problems = [f"{t.id()}: {tb.strip().splitlines()[-1]}" for t, tb in result.failures + result.errors]
    assert not problems, "\n".join(problems)
    assert ran == len(SELECTED), f"{ran} of {len(SELECTED)} selected cases ran (a name no longer matches?)"


def test_run_node_on_numpy_inputs():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((4, 5)).astype(np.float32)
    node = helper.make_node("Gemm", ["a", "b"], ["y"], alpha=0.5)
    (y,) = MorokBackend.run_node(node, [a, b], device=DEVICE)
    np.testing.assert_allclose(y, 0.5 * a @ b, rtol=1e-5, atol=1e-6)


def test_supports_device():
    assert MorokBackend.supports_device("CPU")
    assert not MorokBackend.supports_device("NOSUCHDEVICE")
