"""The ONNX executor's errors, all MorokErrors."""
from __future__ import annotations

from morok_py.errors import MorokError


class OnnxError(MorokError):
    """A model the executor cannot run as given (bad feeds, a node input never computed)."""


class UnsupportedDtype(OnnxError):
    """The model needs a tensor element type morok_py has no dtype for."""


class UnsupportedOp(OnnxError, NotImplementedError):
    """The model uses an op, a domain or an op mode the executor does not implement."""
