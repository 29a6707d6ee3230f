"""The LLVM-CPU device: LLVM IR -> llvmlite object -> loaded in-process, called through ctypes."""
from .device import create_device

__all__ = ["create_device"]
