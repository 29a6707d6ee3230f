"""Run ONNX models on any morok_py device: an onnxruntime-style session and an ONNX backend.

Needs the `onnx` extra (`pip install morok-py[onnx]`); importing this package without it raises
a DeviceUnavailableError that says so.
"""
from __future__ import annotations

from morok_py.errors import DeviceUnavailableError


class OnnxUnavailableError(DeviceUnavailableError, ImportError):
    """The onnx package (or ml_dtypes) is missing: names the extra to install."""


try:
    import ml_dtypes  # noqa: F401  (numpy's bfloat16/float8/int4 types, which onnx's helpers hand out)
    import onnx  # noqa: F401
except ImportError as _e:
    raise OnnxUnavailableError("ONNX executor", f"{_e}", "pip install morok-py[onnx]") from _e

from morok_py.onnx.errors import OnnxError, UnsupportedDtype, UnsupportedOp  # noqa: E402
from morok_py.onnx.executor import OnnxExecutor  # noqa: E402
from morok_py.onnx.session import InferenceSession, NodeArg  # noqa: E402
from morok_py.onnx.backend import MorokBackend  # noqa: E402

__all__ = ["InferenceSession", "MorokBackend", "NodeArg", "OnnxError", "OnnxExecutor", "OnnxUnavailableError",
           "UnsupportedDtype", "UnsupportedOp"]
