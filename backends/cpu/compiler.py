"""llvmlite: parse, verify, optimize (O3; a light pipeline for vector-tiled kernels, O2 with fast
instruction selection for small ones) with the new pass manager, emit a host object file."""
from __future__ import annotations

import functools

import re
import threading

from morok_py.device import CompiledSpec, Compiler, DeviceSpec, ProgramSpec
from morok_py.elf import EM_AARCH64, EM_X86_64, ET_REL, ObjectKind
from morok_py.codegen.llvm_binding import llvm_binding
from morok_py.codegen.mlir_binding import MLIRLowering
from morok_py.codegen.symbols import symbol_for
from morok_py.errors import CompileError

from .features import feature_string, target_features
from .renderer import LANES_MARK, STREAM_SUFFIX, CPULLVMPrinter, MLIRCPURenderer, streams_output

# bumped when the object code for the same source changes (part of the disk-cache identity)
CODEGEN_REVISION = "pack2-small1"
# kernels whose register tile the renderer printed as LLVM vectors (renderer.LANES_MARK) need no
# vectorizer, unroller or loop-invariant motion (the lowering hoists): this short pipeline makes their
# code (memory-to-register accumulators, folded index math; FMAs come from the `contract` flags in
# instruction selection) in a tenth of O3's time
LIGHT_PIPELINE = ("sroa", "instruction_combine", "simplify_cfg", "dead_code_elimination")
# Kernels with little work take a cheap pipeline: every loop static and at most SMALL_KERNEL_WORK
# iterations in all (a model's copies, concatenations, bias and normalization passes over small
# tensors). Their launch costs more than their code, and O3 spends 4x the O2 pipeline's time on them
# (46 vs 11 ms for a 49-wide add loop here) while fast instruction selection (codegen O0) emits their
# object in a quarter of the time. `pipeline_for` names the choice; MOROK_DEBUG=1 prints it.
SMALL_KERNEL_WORK = 1 << 16
SMALL_PIPELINE_OPT, SMALL_CODEGEN_OPT = 2, 0
_BYTES = {"i8": 1, "i16": 2, "half": 2, "bfloat": 2, "i32": 4, "float": 4, "i64": 8, "double": 8}
_VECTOR_STORE = re.compile(r"^\s*store <(\d+) x (\w+)> .*, align (\d+)(?=,|$)")
_METADATA_ID = re.compile(r"!(\d+)\b")

def llvm():
    """The llvmlite binding, initialized once (shared with the GPU backends)."""
    return llvm_binding("CPU")


def host_target_machine():
    """A TargetMachine for this host's CPU and features, as a JIT engine takes it: an MCJIT engine owns the
    TargetMachine it is made with and destroys it when collected, so each engine needs one of its own."""
    b = llvm()
    host, features = host_cpu()
    return b.Target.from_triple(b.get_process_triple()).create_target_machine(
        cpu=host, features=features, opt=3, codemodel="jitdefault")


def kernel_work(ast) -> int | None:
    """Iterations of every loop of the kernel together (the product of its ranges' extents); None
    when an extent is symbolic."""
    from morok_py.ir import Ops
    n = 1
    for u in ast.toposort():
        if u.op is Ops.RANGE:
            end = u.src[0]
            if end.op is not Ops.CONST:
                return None
            n *= max(int(end.arg), 1)
    return n


def pipeline_for(spec: ProgramSpec) -> str:
    """Which LLVM pipeline a kernel takes: 'lanes' (its register tile printed as vectors:
    LIGHT_PIPELINE), 'small' (kernel_work <= SMALL_KERNEL_WORK: the O2 pipeline, codegen O0), else
    'full' (O3)."""
    if LANES_MARK in spec.src:
        return "lanes"
    work = kernel_work(spec.ast) if spec.ast is not None else None
    return "small" if work is not None and work <= SMALL_KERNEL_WORK else "full"


@functools.lru_cache(maxsize=None)
def host_cpu() -> tuple[str, str]:
    """(name, features) of this host: asked once (building the feature string costs ~0.3 ms, paid by
    every program load otherwise)."""
    b = llvm()
    return b.get_host_cpu_name(), b.get_host_cpu_features().flatten()


class CPUCompiler(Compiler):
    cache_key = "llvm"

    def __init__(self, arch: str | None = None, opt: int = 3) -> None:
        b = llvm()
        host, host_features = host_cpu()
        self.arch = arch or host
        self.features = host_features if self.arch == host else ""    # the target machine's: a named CPU implies its own
        # what the code may use (None: unknown for this CPU name), for the renderer's register tile and the load check
        self.target_features = target_features(self.arch, host, host_features)
        self.opt = opt
        self.triple = b.get_process_triple()
        self._tm = self._new_target_machine()
        self._lock = threading.Lock()    # guards self._tm (the MLIR pair)
        # each compiling thread has its own TargetMachine and LLVMContext (neither is thread-safe): LLVM
        # releases the GIL, so a batch compile's threads optimize and emit in parallel
        self._local = threading.local()

    def _new_target_machine(self, opt: int | None = None):
        b = llvm()
        return b.Target.from_triple(self.triple).create_target_machine(
            cpu=self.arch, features=self.features, opt=self.opt if opt is None else opt, codemodel="jitdefault")

    def _thread_state(self, codegen_opt: int) -> tuple:
        """(target machine at `codegen_opt`, LLVM context) of the calling thread."""
        st = getattr(self._local, "state", None)
        if st is None:
            st = self._local.state = ({}, llvm().create_context())
        tm = st[0].get(codegen_opt)
        if tm is None:
            tm = st[0][codegen_opt] = self._new_target_machine(codegen_opt)
        return tm, st[1]

    def _levels(self, spec: ProgramSpec) -> tuple[int, int]:
        """(pipeline speed level, codegen opt level) for `spec`, by `pipeline_for`."""
        if self.opt >= 2 and pipeline_for(spec) == "small":
            return min(self.opt, SMALL_PIPELINE_OPT), SMALL_CODEGEN_OPT
        return self.opt, self.opt

    @property
    def object_kind(self) -> ObjectKind | None:
        """What `compile` emits, for the disk cache's check of bytes read back: a relocatable object
        for this process's machine (None on a machine the check does not know)."""
        machine = {"x86_64": EM_X86_64, "aarch64": EM_AARCH64}.get(self.triple.split("-")[0])
        return None if machine is None else ObjectKind(machine, (ET_REL,), relocatable=machine == EM_X86_64)

    @property
    def renderer_features(self) -> str:
        """The feature string the renderer sizes its register tile by: the target's, never the host's."""
        return feature_string(self.target_features) if self.target_features is not None else ""

    @property
    def target_machine(self):
        return self._tm

    def identity(self) -> str:
        import llvmlite
        b = llvm()
        return (f"llvmlite-{llvmlite.__version__}/llvm-{'.'.join(map(str, b.llvm_version_info))}/"
                f"{self.triple}/{self.arch}/{self.features}/O{self.opt}/{CODEGEN_REVISION}")

    def optimize_ir(self, src: str, name: str, symbol: str | None = None, tm=None, context=None,
                    speed: int | None = None):
        """Parse, verify and optimize; `name` is the user's (for errors), `symbol` the function's.
        `tm`, `context`: the caller's TargetMachine and LLVMContext (default: the shared ones, under
        the caller's hold of self._lock); `speed`: the pipeline's level (default self.opt)."""
        b = llvm()
        tm = self._tm if tm is None else tm
        speed = self.opt if speed is None else speed
        symbol = symbol_for(name) if symbol is None else symbol
        try:
            mod = b.parse_assembly(src, context=context)
            mod.verify()
        except RuntimeError as e:
            raise CompileError(f"LLVM rejected kernel {name}", log=str(e), src=src,
                               command=f"llc -O{self.opt} -mcpu={self.arch} -filetype=obj kernel.ll",
                               kernel=name) from None
        mod.triple = self.triple
        mod.data_layout = str(tm.target_data)
        pto = b.create_pipeline_tuning_options(speed_level=speed)
        pto.loop_vectorization = True
        pto.slp_vectorization = True
        pto.loop_unrolling = True
        pb = b.create_pass_builder(tm, pto)
        if self.opt >= 2 and LANES_MARK in src:
            mpm = b.create_new_module_pass_manager()
            for name in LIGHT_PIPELINE:
                getattr(mpm, f"add_{name}_pass")()
            mpm.run(mod, pb)
        else:
            pb.getModulePassManager().run(mod, pb)
        if f"@{symbol}{STREAM_SUFFIX}(" in src:
            text, marked = mark_streaming_stores(str(mod), symbol + STREAM_SUFFIX)
            if marked:
                mod = b.parse_assembly(text, context=context)
                mod.verify()
        return mod

    def compile(self, spec: ProgramSpec) -> CompiledSpec:
        speed, codegen = self._levels(spec)
        tm, context = self._thread_state(codegen)
        mod = self.optimize_ir(spec.src, spec.name, spec.symbol, tm, context, speed)
        obj = tm.emit_object(mod)
        return CompiledSpec.from_bytes(spec, obj, arch=self.arch, compiler=self.cache_key)

    def disassemble(self, spec: ProgramSpec) -> str:
        speed, codegen = self._levels(spec)
        tm, context = self._thread_state(codegen)
        return tm.emit_assembly(self.optimize_ir(spec.src, spec.name, spec.symbol, tm, context, speed))


# narrower non-temporal stores than this fill write-combining buffers in pieces: the im2col columns of an
# 8x64x56x56 3x3 convolution (58 MB) split over (image, channel) stored <2 x float> non-temporally and took
# 35 ms against 2.9 ms with plain stores (2-vCPU AVX-512 EPYC)
STREAM_MIN_STORE_BYTES = 16


def mark_streaming_stores(ir: str, fn: str) -> tuple[str, int]:
    """Mark `!nontemporal` the vector stores of optimized function `@fn` that LLVM proved aligned to
    their full width (an under-aligned one would be split into scalar non-temporal stores); returns
    the new text and how many stores were marked. Runs after vectorization: the loop vectorizer
    refuses scalar non-temporal stores that are less aligned than a vector."""
    lines = ir.split("\n")
    md = 1 + max((int(m) for m in _METADATA_ID.findall(ir)), default=-1)
    inside = marked = 0
    for i, line in enumerate(lines):
        if line.startswith("define ") and f"@{fn}(" in line:
            inside = 1
        elif inside and line == "}":
            break
        elif inside:
            m = _VECTOR_STORE.match(line)
            width = int(m.group(1)) * _BYTES.get(m.group(2), 0) if m else 0
            if m and width >= STREAM_MIN_STORE_BYTES and int(m.group(3)) >= width:
                lines[i] = line[:m.end()] + f", !nontemporal !{md}" + line[m.end():]
                marked += 1
    if marked:
        lines.append(f"!{md} = !{{i32 1}}")
    return "\n".join(lines), marked


# ---- MLIR: PassManager to the LLVM dialect, then the LLVM pair's back half ---------------------

# what lowers the CPU printer's dialects to the LLVM dialect; memref arguments become bare pointers
CPU_MLIR_PIPELINE = ("builtin.module(convert-scf-to-cf, convert-vector-to-llvm, convert-math-to-llvm, "
                     "convert-arith-to-llvm, finalize-memref-to-llvm, "
                     "convert-func-to-llvm{use-bare-ptr-memref-call-conv=1}, convert-cf-to-llvm, "
                     "reconcile-unrealized-casts)")


class MLIRCPUCompiler(Compiler):
    """MLIR -> (PassManager) LLVM dialect -> LLVM IR -> the llvm pair's O3 and object emission, for
    the same target machine: the MLIR pair differs in the front half only, and its objects load
    like the llvm pair's."""

    cache_key = "mlir"

    def __init__(self, backend: CPUCompiler) -> None:
        self.backend = backend
        self.arch = backend.arch
        self._lowering = MLIRLowering("CPU", CPU_MLIR_PIPELINE)

    @property
    def object_kind(self) -> ObjectKind | None:
        return self.backend.object_kind

    def available(self) -> str | None:
        return self._lowering.available()

    def identity(self) -> str:
        return f"{self._lowering.identity()}/{self.backend.identity()}"

    def llvm_ir(self, spec: ProgramSpec) -> str:
        """The kernel as LLVM IR, after the MLIR pipeline and translation (before LLVM's O3), with
        the llvm pair's streaming variant (`<symbol>__stream`, non-temporal stores) where it prints
        one: the CPU runtime takes it for outputs larger than the last-level cache."""
        ir = self._lowering.llvm_ir(spec)
        kernel = spec.linear
        if kernel is None or not self.backend.triple.startswith("x86_64") or not streams_output(kernel):
            return ir
        extra = [ln for ln in CPULLVMPrinter(kernel).stream_variant()
                 if not (ln.startswith("declare void @llvm.assume") and "@llvm.assume(" in ir)]
        if "attributes #0" not in ir:
            extra.append("attributes #0 = { nounwind }")
        return ir + "\n" + "\n".join(extra) + "\n"

    def compile(self, spec: ProgramSpec) -> CompiledSpec:
        ir = self.llvm_ir(spec)
        with self.backend._lock:
            mod = self.backend.optimize_ir(ir, spec.name, spec.symbol)
            obj = self.backend.target_machine.emit_object(mod)
        return CompiledSpec.from_bytes(spec, obj, arch=self.arch, compiler=self.cache_key)


def mlir_pair(spec: DeviceSpec, compiler: CPUCompiler) -> tuple[MLIRCPURenderer, MLIRCPUCompiler]:
    """The MLIR pair beside the llvm pair's `compiler` (its target machine and features); its
    `available()` says whether the `mlir` extra is installed."""
    return MLIRCPURenderer(spec, compiler.triple, compiler.renderer_features), MLIRCPUCompiler(compiler)
