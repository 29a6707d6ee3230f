"""LLVM IR for the host CPU: noalias buffers, a (start, end) thread split of the outer axis."""
from __future__ import annotations

from morok_py.codegen.decompose import vector_friendly_math
from morok_py.codegen.linear import LinearKernel
from morok_py.codegen.llvm_ir import LLVMIRPrinter
from morok_py.codegen.lower import Capabilities
from morok_py.device import DeviceSpec, Renderer


class CPULLVMPrinter(LLVMIRPrinter):
    param_attrs = "noalias nocapture"


def register_tile_for(features: str) -> tuple[int, int]:
    """Output tile of a register-blocked reduction (matmul), sized to the vector register file:
    32 zmm registers hold 8x32 float32 accumulators plus operands; 16 ymm hold 6x16."""
    feats = set(features.split(","))
    if "+avx512f" in feats:
        return (8, 32)
    if "+avx2" in feats or "+avx" in feats:
        return (6, 16)
    return (4, 8)


class CPURenderer(Renderer):
    caps = Capabilities(has_threads=True, register_tile=(4, 8))

    def __init__(self, device: DeviceSpec, triple: str = "", features: str = "") -> None:
        super().__init__(device)
        self.triple = triple
        self.caps = Capabilities(has_threads=True, register_tile=register_tile_for(features))

    def decompositor(self):
        return vector_friendly_math

    def render_kernel(self, kernel: LinearKernel) -> str:
        p = CPULLVMPrinter(kernel)
        p.triple = self.triple
        return p.render()
