"""The ONNX ops, one module per family, each registering its ops in `OPS` with `@op("Name")`.

Every module of this package is imported here, so a new family is a new file and nothing else:
`from morok_py.onnx.ops.registry import op` and decorate.
"""
from __future__ import annotations

import importlib
import pkgutil

from morok_py.onnx.ops.common import Ctx
from morok_py.onnx.ops.registry import OPS, op

for _m in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _m not in ("common", "registry"):
        importlib.import_module(f"{__name__}.{_m}")

__all__ = ["OPS", "Ctx", "op"]
