"""llvmlite: parse, verify, optimize at O3 with the new pass manager, emit a host object file."""
from __future__ import annotations

import threading

from morok_py.device import CompiledSpec, Compiler, ProgramSpec
from morok_py.codegen.llvm_binding import llvm_binding
from morok_py.errors import CompileError

def llvm():
    """The llvmlite binding, initialized once (shared with the GPU backends)."""
    return llvm_binding("CPU")


def host_cpu() -> tuple[str, str]:
    b = llvm()
    return b.get_host_cpu_name(), b.get_host_cpu_features().flatten()


class CPUCompiler(Compiler):
    cache_key = "llvm"

    def __init__(self, arch: str | None = None, opt: int = 3) -> None:
        b = llvm()
        host, host_features = host_cpu()
        self.arch = arch or host
        self.features = host_features if self.arch == host else ""
        self.opt = opt
        self.triple = b.get_process_triple()
        target = b.Target.from_triple(self.triple)
        self._tm = target.create_target_machine(cpu=self.arch, features=self.features, opt=opt,
                                                codemodel="jitdefault")
        self._lock = threading.Lock()

    @property
    def target_machine(self):
        return self._tm

    def identity(self) -> str:
        import llvmlite
        b = llvm()
        return (f"llvmlite-{llvmlite.__version__}/llvm-{'.'.join(map(str, b.llvm_version_info))}/"
                f"{self.triple}/{self.arch}/{self.features}/O{self.opt}")

    def optimize_ir(self, src: str, name: str):
        b = llvm()
        try:
            mod = b.parse_assembly(src)
            mod.verify()
        except RuntimeError as e:
            raise CompileError(f"LLVM rejected kernel {name}", log=str(e), src=src,
                               command=f"llc -O{self.opt} -mcpu={self.arch} -filetype=obj kernel.ll",
                               kernel=name) from None
        mod.triple = self.triple
        mod.data_layout = str(self._tm.target_data)
        pto = b.create_pipeline_tuning_options(speed_level=self.opt)
        pto.loop_vectorization = True
        pto.slp_vectorization = True
        pto.loop_unrolling = True
        pb = b.create_pass_builder(self._tm, pto)
        pb.getModulePassManager().run(mod, pb)
        return mod

    def compile(self, spec: ProgramSpec) -> CompiledSpec:
        with self._lock:   # a TargetMachine is not safe to share between threads
            mod = self.optimize_ir(spec.src, spec.name)
            obj = self._tm.emit_object(mod)
        return CompiledSpec.from_bytes(spec, obj, arch=self.arch, compiler=self.cache_key)

    def disassemble(self, spec: ProgramSpec) -> str:
        with self._lock:
            mod = self.optimize_ir(spec.src, spec.name)
            return self._tm.emit_assembly(mod)
