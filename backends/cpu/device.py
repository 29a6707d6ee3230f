"""The CPU device: host allocator, one LLVM compiler pair, in-process runtime."""
from __future__ import annotations

from morok_py import config
from morok_py.device import CompiledSpec, DeviceSpec
from morok_py.errors import UnknownNameError
from morok_py.launch import Device

from .allocator import HostAllocator
from .compiler import CPUCompiler, host_cpu, host_target_machine, llvm, mlir_pair
from .renderer import CPURenderer
from .runtime import CPUPlanCapture, CPUProgram


class CPUDevice(Device):
    def __init__(self, spec: DeviceSpec, arch: str | None = None) -> None:
        """`arch`: compile for this CPU or x86-64 level (default MOROK_CPU_ARCH, else the host)."""
        arch = arch or config.arch_override("CPU")
        compiler = CPUCompiler(arch)
        host, _ = host_cpu()
        self._tm = compiler.target_machine if compiler.arch == host else CPUCompiler(None).target_machine
        renderer = CPURenderer(spec, llvm().get_process_triple(), compiler.renderer_features)
        pairs = [(renderer, compiler), mlir_pair(spec, compiler)]
        super().__init__(spec, HostAllocator(str(spec)), pairs, self._load, arch=host)

    def _load(self, compiled: CompiledSpec) -> CPUProgram:
        # an MCJIT engine takes ownership of its TargetMachine and destroys it when collected, so each
        # program gets its own: sharing the compiler's one was a use-after-free once a program was dropped
        return CPUProgram(self, compiled, host_target_machine())

    # an ExecutionPlan replays its launches by one native call once captured (runtime.CPUPlanCapture), also
    # with other memory bound to its slots for a run
    capture_binds = True

    def capture_plan(self, plan) -> "CPUPlanCapture | None":
        """The plan's launches as one native replay; None while a launch of it still times whether to split
        (runtime.CPUProgram._trial: a capture keeps each launch's choice as it is when made)."""
        return CPUPlanCapture(self, plan) if CPUPlanCapture.ready(plan) else None

    def info(self) -> dict:
        import os
        return {"arch": self.arch, "name": cpu_model(), "cores": os.cpu_count(),
                "threads": config.cpu_threads(),
                "compilers": [c.cache_key + ("" if c.available() is None else f" (unavailable: {c.available()})")
                              for _, c in self.compilers]}


def cpu_model() -> str:
    """The host CPU's model name (/proc/cpuinfo), else what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def create_device(spec: DeviceSpec) -> CPUDevice:
    if spec.ordinal != 0:
        raise UnknownNameError(f"there is one CPU device; got {spec.type}:{spec.ordinal}")
    return CPUDevice(spec)
