"""The CUDA device: CUDA C -> NVRTC or NVPTX LLVM IR -> llvmlite + nvJitLink, both to CUBIN, run
through the driver API of cuda-bindings. Rendering and compiling need no GPU."""
from .device import compile_only_pairs, create_device

__all__ = ["create_device", "compile_only_pairs"]
