"""morok_py: render, compile, load and run UOp kernels on the CPU (LLVM), NVIDIA GPUs (CUDA)
and AMD GPUs (ROCm) through one API."""
from __future__ import annotations

import importlib.util as _ilu
import os as _os
import sys as _sys


def _mount_backends() -> None:
    """In a source tree the top-level `backends/` folder is `morok_py.backends` (an installed wheel
    ships it there already), the way Triton installs third_party/<vendor>/backend."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    if _os.path.isdir(_os.path.join(here, "backends")) or "morok_py.backends" in _sys.modules:
        return
    tree = _os.path.join(_os.path.dirname(here), "backends", "__init__.py")
    if not _os.path.exists(tree):
        try:
            if _ilu.find_spec("morok_py.backends") is not None:   # editable-install finders
                return
        except (ImportError, ValueError):
            pass
        raise ImportError("morok_py.backends is missing: reinstall morok-py")
    spec = _ilu.spec_from_file_location("morok_py.backends", tree,
                                        submodule_search_locations=[_os.path.dirname(tree)])
    mod = _ilu.module_from_spec(spec)
    _sys.modules["morok_py.backends"] = mod
    spec.loader.exec_module(mod)


_mount_backends()

from .cache import __version__  # noqa: E402
from .dtypes import DType, dtypes  # noqa: E402
from .errors import (ArgumentError, ArgumentTypeError, BufferFreedError, CompileError, ConfigError,  # noqa: E402
                     ContextLostError, DeviceError, DeviceUnavailableError, LaunchError, MorokError, OutOfMemoryError,
                     RuntimeStackConflictError, UnknownNameError, ValidationError)
from .ir import AxisType, Ops, UOp  # noqa: E402
from .codegen.lower import Capabilities, Variable  # noqa: E402
from .device import (Allocator, CompiledSpec, Compiler, DeviceSpec, ProgramSpec, Renderer,  # noqa: E402
                     RuntimeFactory)
from .launch import Device, Program  # noqa: E402
from .buffer import Buffer  # noqa: E402
from .registry import register_backend  # noqa: E402
from .plan import ExecutionPlan  # noqa: E402

__all__ = ["__version__", "DType", "dtypes", "UOp", "Ops", "AxisType", "Variable", "Capabilities",
           "DeviceSpec", "ProgramSpec", "CompiledSpec", "Renderer", "Compiler", "RuntimeFactory", "Program",
           "Allocator", "Device", "Buffer", "ExecutionPlan", "register_backend",
           "MorokError", "CompileError", "DeviceUnavailableError", "RuntimeStackConflictError", "LaunchError",
           "DeviceError", "OutOfMemoryError", "ValidationError", "BufferFreedError", "UnknownNameError",
           "ConfigError", "ArgumentError", "ArgumentTypeError", "ContextLostError"]
