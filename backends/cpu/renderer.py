"""LLVM IR for the host CPU: noalias buffers, a (start, end) thread split of the outer axis."""
from __future__ import annotations

from morok_py.codegen.decompose import vector_friendly_math
from morok_py.codegen.linear import LinearKernel
from morok_py.codegen.llvm_ir import LLVMIRPrinter
from morok_py.codegen.lower import Capabilities
from morok_py.device import DeviceSpec, Renderer


class CPULLVMPrinter(LLVMIRPrinter):
    param_attrs = "noalias nocapture"


class CPURenderer(Renderer):
    caps = Capabilities(has_threads=True, register_tile=(4, 16))

    def __init__(self, device: DeviceSpec, triple: str = "") -> None:
        super().__init__(device)
        self.triple = triple

    def decompositor(self):
        return vector_friendly_math

    def render_kernel(self, kernel: LinearKernel) -> str:
        p = CPULLVMPrinter(kernel)
        p.triple = self.triple
        return p.render()
