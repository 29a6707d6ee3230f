"""The ROCm device: LLVM AMDGPU code objects (llvmlite + ld.lld) or HIP C through hiprtc, run with hip-python."""
from .device import compile_only_pairs, create_device

__all__ = ["create_device", "compile_only_pairs"]
