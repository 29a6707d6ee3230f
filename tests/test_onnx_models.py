"""The nine `light_*` CNNs shipped in the onnx wheel (onnx/backend/test/data/light), end to end through
morok_py.onnx, against their shipped `*_output_0.pb` with ONNX's model-test tolerances (rtol 1e-3,
atol 1e-7), fed the way ONNX's backend runner feeds them (generate_dummy_data: arange(n)/n).

Device: CPU by default, `MOROK_ONNX_DEVICE=CUDA` for a GPU (skips with the reason without one).
Each test prints its first-run (compile included) and replay times.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed (pip install -e '.[onnx]')")
from onnx import numpy_helper  # noqa: E402

from morok_py.onnx import OnnxExecutor  # noqa: E402
from morok_py.onnx.run import dummy_input  # noqa: E402

DEVICE = os.environ.get("MOROK_ONNX_DEVICE", "CPU")
LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
MODELS = ["bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet",
          "squeezenet", "vgg19", "zfnet512"]


@pytest.mark.parametrize("name", MODELS)
def test_light_model(name):
    from morok_py import DeviceUnavailableError
    from morok_py.registry import get_device
    try:
        dev = get_device(DEVICE)
    except DeviceUnavailableError as e:
        pytest.skip(f"{DEVICE} unavailable: {e}")
    path = LIGHT / f"light_{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path} is not in this onnx wheel ({onnx.__version__})")
    model = onnx.load(str(path))
    want = numpy_helper.to_array(onnx.load_tensor(str(LIGHT / f"light_{name}_output_0.pb")))
    ex = OnnxExecutor(model, dev)
    feeds = {vi.name: dummy_input(vi) for vi in model.graph.input if vi.name in ex.input_names}
    t0 = time.perf_counter()
    got = ex.run(feeds)[0]
    first = time.perf_counter() - t0
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-7)
    again = ex.run(feeds)[0]      # replayed through the recorded ExecutionPlan
    np.testing.assert_allclose(again, want, rtol=1e-3, atol=1e-7)
    print(f"\n{name} on {DEVICE}: first run {first:.2f} s (compile {ex.k.compile_s:.2f} s, "
          f"{len(ex.k.programs)} programs, {len(ex.k.stats)} launches), replay {ex.last_run_s * 1e3:.1f} ms")
