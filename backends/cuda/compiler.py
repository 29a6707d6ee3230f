"""The two CUDA compilers, both producing CUBIN for one `sm_XY` arch (never PTX for the run path:
PTX from a newer toolchain than the driver is rejected by the driver):

- `NVRTCCompiler` (cache_key "nvrtc"): CUDA C -> NVRTC -> CUBIN.
- `NVPTXCompiler` (cache_key "llvm-nvptx"): NVPTX LLVM IR -> llvmlite -> PTX -> nvJitLink -> CUBIN.

Neither needs a GPU or a driver: NVRTC and nvJitLink come from the nvidia-cuda-nvrtc and
nvidia-nvjitlink wheels, found through cuda-pathfinder.
"""
from __future__ import annotations

import functools
import re
import threading

from morok_py.cache import file_identity, llvmlite_identity, remembered_path
from morok_py.device import CompiledSpec, Compiler, DeviceSpec, ProgramSpec
from morok_py.elf import EM_CUDA, ET_EXEC, ObjectKind
from morok_py.codegen.llvm_binding import llvm_binding
from morok_py.codegen.mlir import link_llvm_helpers
from morok_py.codegen.mlir_binding import MLIRFrontHalf, MLIRLowering
from morok_py.codegen.symbols import symbol_for
from morok_py.errors import ArgumentTypeError, CompileError, DeviceUnavailableError, UnknownNameError

from .renderer import MLIRNVVMRenderer

INSTALL = "pip install morok-py[cuda]"
_ARCH_RE = re.compile(r"^(?:sm_|compute_)?(\d)(\d{1,2})([af]?)$")


def normalize_arch(arch: "str | tuple[int, int]") -> str:
    """'sm_90', '90', 'compute_90', (9, 0) -> 'sm_90'; keeps the 'a'/'f' suffix of sm_90a / sm_100f."""
    if isinstance(arch, tuple):
        return f"sm_{arch[0]}{arch[1]}"
    if not isinstance(arch, str):
        raise ArgumentTypeError(f"a CUDA arch is a string like 'sm_90', got {arch!r}")
    m = _ARCH_RE.match(arch.strip().lower())
    if not m:
        raise UnknownNameError(f"{arch!r} is not a CUDA arch; expected sm_XY like sm_80 or sm_90 (or sm_90a)")
    return f"sm_{m.group(1)}{m.group(2)}{m.group(3)}"


# devices whose own arch-specific variant (sm_90a: wgmma, setmaxnreg) a cubin built for that exact chip may use
ARCH_SPECIFIC = {"sm_90": "sm_90a"}


def device_compile_arch(device_arch: str) -> str:
    """The arch a device compiles its own kernels for: the arch-specific variant of its chip where one
    exists (the cubin runs on that chip only, which is the device at hand), else the device's arch."""
    a = normalize_arch(device_arch)
    return ARCH_SPECIFIC.get(a, a)


def arch_number(arch: str) -> int:
    """'sm_90a' -> 90."""
    m = _ARCH_RE.match(normalize_arch(arch))
    return int(m.group(1) + m.group(2))


def load_library(name: str) -> str:
    """Load libnvrtc / libnvJitLink from the pip wheels (or a toolkit) through cuda-pathfinder."""
    try:
        import cuda.pathfinder as pathfinder
    except ImportError as e:
        raise DeviceUnavailableError("CUDA", f"cuda-pathfinder is not importable ({e})", INSTALL) from None
    try:
        path = pathfinder.load_nvidia_dynamic_lib(name).abs_path or name
    except Exception as e:  # DynamicLibNotFoundError and friends
        raise DeviceUnavailableError("CUDA", f"lib{name} was not found ({e})", INSTALL) from None
    _loaded_from[name] = path
    return path


_loaded_from: dict[str, str] = {}     # lib name -> the file this process loaded it from


def locate_library(name: str) -> str | None:
    """Where `load_library(name)` would load lib<name> from, found without loading it: a copy already
    loaded into the process (RTLD_NOLOAD), else the pip wheels or conda, as cuda-pathfinder searches
    them. None when only loading can tell (a system install found by the dynamic loader). This uses
    cuda-pathfinder internals: any change there is a None, never a wrong answer."""
    try:
        from cuda.pathfinder._dynamic_libs.lib_descriptor import LIB_DESCRIPTORS
        from cuda.pathfinder._dynamic_libs.platform_loader import LOADER
        from cuda.pathfinder._dynamic_libs.search_steps import EARLY_FIND_STEPS, SearchContext, run_find_steps
        desc = LIB_DESCRIPTORS[name]
        loaded = LOADER.check_if_already_loaded_from_elsewhere(desc)
        if loaded is not None:
            return loaded.abs_path
        found = run_find_steps(SearchContext(desc), EARLY_FIND_STEPS)
        return found.abs_path if found is not None else None
    except Exception:
        return None


@functools.lru_cache(maxsize=None)
def _remembered(name: str) -> str:
    return remembered_path(f"cuda/lib{name}", lambda: locate_library(name) or load_library(name))


@functools.lru_cache(maxsize=None)
def _file_identity(path: str, name: str) -> str:
    try:
        return file_identity(path)
    except OSError:
        return f"{name}:{path}"


def library_identity(name: str) -> str:
    """lib<name> for disk-cache keys: its file by path, size and mtime.

    Before this process loads the library (a cache hit never does), it is the file cuda-pathfinder
    would load, found without loading it (loading libnvrtc costs 60-150 ms, importing
    cuda-pathfinder 20-80 ms: more than a whole hit may take) and remembered per environment
    (`remembered_path`). Once loaded (by a compile), it is the file actually loaded, and the compile's
    entries are written under it (the cache computes write keys after compiling): a copy another
    package loaded first (torch, CuPy), picked by cuda-pathfinder over the remembered file, never
    labels its output as the remembered library's. A lookup made before that load names the
    remembered file, and finds that library's output: valid code for the same arch."""
    path = _loaded_from.get(name)
    return _file_identity(path if path is not None else _remembered(name), name)


def _nvrtc():
    load_library("nvrtc")
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise DeviceUnavailableError("CUDA", f"cuda-bindings is not importable ({e})", INSTALL) from None
    return nvrtc


def _nvjitlink():
    load_library("nvJitLink")
    try:
        from cuda.bindings import nvjitlink
    except ImportError as e:
        raise DeviceUnavailableError("CUDA", f"cuda-bindings is not importable ({e})", INSTALL) from None
    return nvjitlink


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    err, major, minor = nvrtc.nvrtcVersion()
    return int(major), int(minor)


@functools.lru_cache(maxsize=None)
def nvrtc_supported_archs() -> tuple[int, ...]:
    nvrtc = _nvrtc()
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    return tuple(int(a) for a in archs)


CUBIN = ObjectKind(EM_CUDA, (ET_EXEC,))


class NVRTCCompiler(Compiler):
    """CUDA C -> CUBIN with NVRTC."""

    cache_key = "nvrtc"
    object_kind = CUBIN     # what the disk cache checks bytes read back against

    def __init__(self, arch: str) -> None:
        self.arch = normalize_arch(arch)
        self.options = (f"--gpu-architecture={self.arch}",)

    def available(self) -> str | None:
        try:
            supported = nvrtc_supported_archs()
        except DeviceUnavailableError as e:
            return e.reason
        if arch_number(self.arch) not in supported:
            return f"NVRTC {'.'.join(map(str, nvrtc_version()))} cannot target {self.arch} (it supports sm_" \
                   f"{', sm_'.join(map(str, supported))})"
        return None

    def identity(self) -> str:
        major, minor = nvrtc_version()
        return f"nvrtc-{major}.{minor}/{self.arch}/{' '.join(self.options)}"

    def cache_identity(self) -> str:
        """`identity()` for the disk-cache key, with libnvrtc told by its file instead of its version."""
        return f"nvrtc/{library_identity('nvrtc')}/{self.arch}/{' '.join(self.options)}"

    def command(self, name: str) -> str:
        return f"nvcc -cubin -arch={self.arch} -o {name}.cubin {name}.cu"

    def compile(self, spec: ProgramSpec) -> CompiledSpec:
        why = self.available()
        if why is not None:
            raise CompileError(f"cannot compile {spec.name} for {self.arch}: {why}", src=spec.src,
                               command=self.command(spec.symbol), kernel=spec.name)
        nvrtc = _nvrtc()
        err, prog = nvrtc.nvrtcCreateProgram(spec.src.encode(), f"{spec.symbol}.cu".encode(), 0, [], [])
        _check_nvrtc(nvrtc, err, "nvrtcCreateProgram")
        try:
            (err,) = nvrtc.nvrtcCompileProgram(prog, len(self.options), [o.encode() for o in self.options])
            log = _nvrtc_log(nvrtc, prog)
            if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
                raise CompileError(f"NVRTC rejected kernel {spec.name} ({err.name}) for {self.arch}", log=log,
                                   src=spec.src, command=self.command(spec.symbol), kernel=spec.name)
            err, size = nvrtc.nvrtcGetCUBINSize(prog)
            _check_nvrtc(nvrtc, err, "nvrtcGetCUBINSize")
            cubin = b" " * size
            (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
            _check_nvrtc(nvrtc, err, "nvrtcGetCUBIN")
        finally:
            nvrtc.nvrtcDestroyProgram(prog)
        return CompiledSpec.from_bytes(spec, cubin, arch=self.arch, compiler=self.cache_key)


def _check_nvrtc(nvrtc, err, call: str) -> None:
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{call} failed with {err.name}")


def _nvrtc_log(nvrtc, prog) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return ""
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    return log.rstrip(b"\0").decode(errors="replace")


# ---- LLVM NVPTX + nvJitLink ---------------------------------------------------------------------

def _llvm():
    return llvm_binding("CUDA")


class NVPTXCompiler(Compiler):
    """NVPTX LLVM IR -> PTX (llvmlite, O3) -> CUBIN (nvJitLink)."""

    cache_key = "llvm-nvptx"
    object_kind = CUBIN     # what the disk cache checks bytes read back against

    def __init__(self, arch: str, opt: int = 3) -> None:
        self.arch = normalize_arch(arch)
        self.opt = opt
        self._tm = None
        self._lock = threading.Lock()

    def available(self) -> str | None:
        try:
            self.target_machine()
            nvjitlink = _nvjitlink()
            nvjitlink.version()
        except DeviceUnavailableError as e:
            return e.reason
        except Exception as e:   # e.g. an LLVM without the NVPTX target
            return f"{type(e).__name__}: {e}"
        return None

    def target_machine(self):
        if self._tm is None:
            b = _llvm()
            target = b.Target.from_triple("nvptx64-nvidia-cuda")
            self._tm = target.create_target_machine(cpu=self.arch, features="", opt=self.opt)
        return self._tm

    def identity(self) -> str:
        import llvmlite
        b = _llvm()
        major, minor = _nvjitlink().version()
        return (f"llvmlite-{llvmlite.__version__}/llvm-{'.'.join(map(str, b.llvm_version_info))}/"
                f"nvjitlink-{major}.{minor}/{self.arch}/O{self.opt}")

    def cache_identity(self) -> str:
        """`identity()` for the disk-cache key: llvmlite and libnvJitLink told by their files, so that a
        hit neither initializes LLVM nor loads nvJitLink."""
        return f"{llvmlite_identity()}/nvjitlink/{library_identity('nvJitLink')}/{self.arch}/O{self.opt}"

    def command(self, name: str) -> str:
        # ptxas is the toolkit's equivalent of nvJitLink's PTX -> CUBIN step
        return (f"llc -O{self.opt} -mtriple=nvptx64-nvidia-cuda -mcpu={self.arch} {name}.ll -o {name}.ptx && "
                f"ptxas -O{self.opt} -arch={self.arch} {name}.ptx -o {name}.cubin")

    def ptx(self, spec: ProgramSpec) -> str:
        """Optimized PTX text (also what `MOROK_DEBUG=3` and `morok compile --emit` can show)."""
        b = _llvm()
        with self._lock:   # a TargetMachine is not safe to share between threads
            tm = self.target_machine()
            try:
                mod = b.parse_assembly(spec.src)
                mod.verify()
            except RuntimeError as e:
                raise CompileError(f"LLVM rejected kernel {spec.name}", log=str(e), src=spec.src,
                                   command=self.command(spec.symbol), kernel=spec.name) from None
            mod.data_layout = str(tm.target_data)
            pto = b.create_pipeline_tuning_options(speed_level=self.opt)
            pb = b.create_pass_builder(tm, pto)
            pb.getModulePassManager().run(mod, pb)
            return tm.emit_assembly(mod)

    def link(self, ptx: str, name: str, src: str = "") -> bytes:
        nvjitlink = _nvjitlink()
        opts = [f"-arch={self.arch}", f"-O{self.opt}"]
        handle = nvjitlink.create(len(opts), opts)
        try:
            data = ptx.encode()
            try:
                nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), f"{symbol_for(name)}.ptx")
                nvjitlink.complete(handle)
            except nvjitlink.nvJitLinkError as e:
                log = _jitlink_log(nvjitlink, handle)
                raise CompileError(f"nvJitLink rejected kernel {name} for {self.arch} ({e})", log=log + "\nPTX:\n" + ptx,
                                   src=src, command=self.command(symbol_for(name)), kernel=name) from None
            size = nvjitlink.get_linked_cubin_size(handle)
            cubin = bytearray(size)
            nvjitlink.get_linked_cubin(handle, cubin)
            return bytes(cubin)
        finally:
            nvjitlink.destroy(handle)

    def compile(self, spec: ProgramSpec) -> CompiledSpec:
        why = self.available()
        if why is not None:
            raise CompileError(f"cannot compile {spec.name} for {self.arch}: {why}", src=spec.src,
                               command=self.command(spec.symbol), kernel=spec.name)
        cubin = self.link(self.ptx(spec), spec.name, spec.src)
        return CompiledSpec.from_bytes(spec, cubin, arch=self.arch, compiler=self.cache_key)


def _jitlink_log(nvjitlink, handle) -> str:
    try:
        size = nvjitlink.get_error_log_size(handle)
        if size <= 1:
            return ""
        log = bytearray(size)
        nvjitlink.get_error_log(handle, log)
        return log.rstrip(b"\0").decode(errors="replace")
    except Exception:
        return ""


# ---- MLIR (gpu + nvvm) -> LLVM IR -> the llvm-nvptx pair's PTX and nvJitLink -------------------

def mlir_pipeline(index_bits: int = 64) -> str:
    """The gpu.module lowered to the LLVM and NVVM dialects; memref arguments become bare pointers."""
    return ("builtin.module(gpu.module(convert-scf-to-cf, "
            f"convert-gpu-to-nvvm{{use-bare-ptr-memref-call-conv=1 index-bitwidth={index_bits}}}), "
            "reconcile-unrealized-casts)")


class MLIRCUDACompiler(MLIRFrontHalf, Compiler):
    """MLIR (gpu + nvvm) -> (PassManager) LLVM/NVVM dialects -> LLVM IR -> PTX (llvmlite, O3) ->
    CUBIN (nvJitLink): the llvm-nvptx pair's back half behind MLIR's GPU lowering."""

    cache_key = "mlir"
    object_kind = CUBIN     # what the disk cache checks bytes read back against

    def __init__(self, arch: str, opt: int = 3) -> None:
        self.backend = NVPTXCompiler(arch, opt)
        self.arch = self.backend.arch
        self._lowering = MLIRLowering("CUDA", mlir_pipeline(), gpu=True)

    def llvm_ir(self, spec: ProgramSpec) -> str:
        return link_llvm_helpers(self._lowering.llvm_ir(spec), "nvptx64-nvidia-cuda")

    def ptx(self, spec: ProgramSpec) -> str:
        import dataclasses
        return self.backend.ptx(dataclasses.replace(spec, src=self.llvm_ir(spec)))

    def compile(self, spec: ProgramSpec) -> CompiledSpec:
        cubin = self.backend.link(self.ptx(spec), spec.name, spec.src)
        return CompiledSpec.from_bytes(spec, cubin, arch=self.arch, compiler=self.cache_key)


def mlir_pair(spec: DeviceSpec, arch: str) -> tuple[MLIRNVVMRenderer, MLIRCUDACompiler]:
    """The MLIR pair for `arch`; its `available()` says whether the `mlir` extra is installed."""
    return MLIRNVVMRenderer(spec, arch), MLIRCUDACompiler(arch)
