"""Whichever hiprtc is installed: hip-python's bindings where ROCm 6 or later ships libhiprtc.so,
else the HIP library itself through ctypes (ROCm 5, e.g. Debian 12's libamdhip64.so.5, which
exports the hiprtc calls). The archs it can compile for come from its code-object manager
(libamd_comgr's ISA list): an older ROCm aborts the whole process on a gfx it predates, so
`HIPRTC.compile` refuses those before hiprtc sees them.
"""
from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass, field
from typing import Callable

from morok_py.cache import file_identity
from morok_py.errors import DeviceUnavailableError

INSTALL = ("ROCm's hiprtc: ROCm 6 or later with `pip install morok-py[rocm]` (hip-python), or on Debian 12 "
           "`apt-get install libamdhip64-5 libamd-comgr2 libhiprtc-builtins5`")
WHO = "ROCM compiler hiprtc"

# the HIP libraries that export hiprtc*, newest first: ROCm >= 6 splits it into libhiprtc
_RTC_LIBS = ("libhiprtc.so", "libhiprtc.so.7", "libhiprtc.so.6", "libamdhip64.so.5", "libamdhip64.so")
_COMGR_LIBS = ("libamd_comgr.so", "libamd_comgr.so.3", "libamd_comgr.so.2")


class HiprtcFailed(Exception):
    """A hiprtc call that returned an error: the call, the error's name, the program log if any."""

    def __init__(self, call: str, error: str, log: str = "") -> None:
        self.call, self.error, self.log = call, error, log
        super().__init__(f"{call} failed with {error}")


@dataclass(frozen=True)
class HIPRTC:
    """One loaded hiprtc: its version, where it came from, and the gfx names it can target."""

    binding: str                      # "hip-python" or "ctypes"
    version: tuple[int, int]
    library: str                      # the file that provides hiprtc (for cache keys and messages)
    comgr: str                        # the code-object manager whose ISA list was read
    archs: frozenset[str]             # base gfx names, e.g. gfx90a
    _compile: Callable[[bytes, bytes, list[bytes]], bytes] = field(repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def identity(self) -> str:
        """For cache keys: the version, and both libraries by path, size and mtime."""
        return (f"hiprtc-{self.version[0]}.{self.version[1]}/{self.binding}/{_identity_of(self.library)}/"
                f"{_identity_of(self.comgr)}")

    def unsupported(self, arch: str) -> str | None:
        """Why this hiprtc cannot compile for `arch` (a base gfx name), or None."""
        if arch in self.archs:
            return None
        return (f"the installed hiprtc (version {self.version[0]}.{self.version[1]}, {os.path.basename(self.library)}) "
                f"does not support "
                f"{arch}; it supports {', '.join(sorted(self.archs, key=_gfx_order))}")

    def compile(self, src: bytes, name: bytes, options: list[bytes]) -> bytes:
        """The code object; HiprtcFailed with the program log when hiprtc rejects the source."""
        with self._lock:   # ROCm 5's hiprtc keeps process-wide state in its compile path
            return self._compile(src, name, options)


def _gfx_order(name: str) -> tuple[int, str]:
    return (len(name), name)


# ---- libamd_comgr: the ISA names this ROCm knows -------------------------------------------------

def _loaded_path(stem: str) -> str | None:
    """The path of an already-loaded shared library whose file name starts with `stem`."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ", 5)[-1].strip()
                if os.path.basename(path).startswith(stem):
                    return path
    except OSError:
        pass
    return None


def _open_first(names: tuple[str, ...], folders: list[str], symbol: str | None = None
                ) -> tuple[ctypes.CDLL, str] | None:
    """The first of `names` that loads from `folders` (then the loader's search), and exports
    `symbol` where one is named: (library, the path it loaded from)."""
    for folder in folders + [""]:
        for name in names:
            path = os.path.join(folder, name) if folder else name
            if folder and not os.path.exists(path):
                continue
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            if symbol is None or hasattr(lib, symbol):
                return lib, _loaded_path(name.split(".so")[0] + ".so") or path
    return None


def _rocm_lib_folders(near: str = "") -> list[str]:
    folders = [os.path.dirname(near)] if near and os.sep in near else []
    rocm = os.environ.get("ROCM_PATH", "")
    folders += [os.path.join(rocm, "lib")] if rocm else []
    return folders + ["/opt/rocm/lib"]


def comgr_isas(near: str = "") -> tuple[frozenset[str], str]:
    """Base gfx names from libamd_comgr's ISA list (names like 'amdgcn-amd-amdhsa--gfx90a:xnack+'),
    and the library read; searched beside `near` (the hiprtc library), under ROCm, then by soname."""
    found = _open_first(_COMGR_LIBS, _rocm_lib_folders(near))
    if found is None:
        raise DeviceUnavailableError(WHO, "libamd_comgr (which tells the archs hiprtc supports) was not found",
                                     INSTALL)
    lib, path = found
    count = ctypes.c_size_t()
    if lib.amd_comgr_get_isa_count(ctypes.byref(count)) != 0:
        raise DeviceUnavailableError(WHO, f"amd_comgr_get_isa_count failed in {path}", INSTALL)
    names = set()
    for i in range(count.value):
        p = ctypes.c_char_p()
        if lib.amd_comgr_get_isa_name(ctypes.c_size_t(i), ctypes.byref(p)) == 0 and p.value:
            isa = p.value.decode()
            names.add(isa.rpartition("--")[2].split(":")[0])
    if not names:
        raise DeviceUnavailableError(WHO, f"{path} lists no AMDGPU ISA", INSTALL)
    return frozenset(names), path


# ---- the two bindings ----------------------------------------------------------------------------

def _from_hip_python() -> HIPRTC | None:
    """hip-python's hiprtc where its libhiprtc.so loads (ROCm >= 6); None otherwise."""
    try:
        from hip import hiprtc
    except ImportError:
        return None
    try:
        err, major, minor = hiprtc.hiprtcVersion()
    except RuntimeError:      # hip-python raises this when dlopen('libhiprtc.so') fails
        return None
    if err != hiprtc.hiprtcResult.HIPRTC_SUCCESS:
        return None
    ok = hiprtc.hiprtcResult.HIPRTC_SUCCESS

    def log(prog) -> str:
        try:
            _, size = hiprtc.hiprtcGetProgramLogSize(prog)
            buf = ctypes.create_string_buffer(int(size) + 1)
            hiprtc.hiprtcGetProgramLog(prog, ctypes.addressof(buf))
            return buf.value.decode("utf-8", "replace")
        except Exception as e:
            return f"(no log: {e})"

    def compile_(src: bytes, name: bytes, options: list[bytes]) -> bytes:
        err, prog = hiprtc.hiprtcCreateProgram(src, name, 0, None, None)
        if err != ok:
            raise HiprtcFailed("hiprtcCreateProgram", err.name)
        try:
            (err,) = hiprtc.hiprtcCompileProgram(prog, len(options), options)
            if err != ok:
                raise HiprtcFailed("hiprtcCompileProgram", err.name, log(prog))
            err, size = hiprtc.hiprtcGetCodeSize(prog)
            if err != ok:
                raise HiprtcFailed("hiprtcGetCodeSize", err.name)
            code = ctypes.create_string_buffer(int(size))
            (err,) = hiprtc.hiprtcGetCode(prog, ctypes.addressof(code))
            if err != ok:
                raise HiprtcFailed("hiprtcGetCode", err.name)
            return code.raw
        finally:
            hiprtc.hiprtcDestroyProgram(prog)

    library = _loaded_path("libhiprtc.so") or "libhiprtc.so"
    archs, comgr = comgr_isas(library)
    return HIPRTC("hip-python", (int(major), int(minor)), library, comgr, archs, compile_)


def _from_ctypes() -> HIPRTC | str:
    """hiprtc straight from the HIP library (ROCm 5 exports it from libamdhip64); else why not."""
    found = _open_first(_RTC_LIBS, _rocm_lib_folders(), "hiprtcCompileProgram")
    if found is None:
        return f"no library providing hiprtc was found (tried {', '.join(_RTC_LIBS)})"
    lib, library = found
    P, SZ = ctypes.c_void_p, ctypes.c_size_t
    lib.hiprtcVersion.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    lib.hiprtcGetErrorString.argtypes, lib.hiprtcGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p
    lib.hiprtcCreateProgram.argtypes = [ctypes.POINTER(P), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, P, P]
    lib.hiprtcCompileProgram.argtypes = [P, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.hiprtcGetCodeSize.argtypes = [P, ctypes.POINTER(SZ)]
    lib.hiprtcGetCode.argtypes = [P, ctypes.c_char_p]
    lib.hiprtcGetProgramLogSize.argtypes = [P, ctypes.POINTER(SZ)]
    lib.hiprtcGetProgramLog.argtypes = [P, ctypes.c_char_p]
    lib.hiprtcDestroyProgram.argtypes = [ctypes.POINTER(P)]
    major, minor = ctypes.c_int(), ctypes.c_int()
    if lib.hiprtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
        return f"hiprtcVersion failed in {library}"

    def err_name(code: int) -> str:
        s = lib.hiprtcGetErrorString(code)
        return s.decode() if s else f"hiprtc error {code}"

    def log(prog) -> str:
        size = SZ()
        if lib.hiprtcGetProgramLogSize(prog, ctypes.byref(size)) != 0:
            return "(no log)"
        buf = ctypes.create_string_buffer(size.value + 1)
        lib.hiprtcGetProgramLog(prog, buf)
        return buf.value.decode("utf-8", "replace")

    def compile_(src: bytes, name: bytes, options: list[bytes]) -> bytes:
        prog = P()
        rc = lib.hiprtcCreateProgram(ctypes.byref(prog), src, name, 0, None, None)
        if rc != 0:
            raise HiprtcFailed("hiprtcCreateProgram", err_name(rc))
        try:
            opts = (ctypes.c_char_p * len(options))(*options)
            rc = lib.hiprtcCompileProgram(prog, len(options), opts)
            if rc != 0:
                raise HiprtcFailed("hiprtcCompileProgram", err_name(rc), log(prog))
            size = SZ()
            rc = lib.hiprtcGetCodeSize(prog, ctypes.byref(size))
            if rc != 0:
                raise HiprtcFailed("hiprtcGetCodeSize", err_name(rc))
            code = ctypes.create_string_buffer(size.value)
            rc = lib.hiprtcGetCode(prog, code)
            if rc != 0:
                raise HiprtcFailed("hiprtcGetCode", err_name(rc))
            return code.raw
        finally:
            lib.hiprtcDestroyProgram(ctypes.byref(prog))

    try:
        archs, comgr = comgr_isas(library)
    except DeviceUnavailableError as e:
        return e.reason
    return HIPRTC("ctypes", (major.value, minor.value), library, comgr, archs, compile_)


def _identity_of(path: str) -> str:
    try:
        return file_identity(path)
    except OSError:
        return path


_lock = threading.Lock()
_loaded: HIPRTC | str | None = None


def load_hiprtc() -> HIPRTC:
    """The installed hiprtc, loaded once per process: hip-python's first, then the HIP library through
    ctypes; DeviceUnavailableError saying why and what to install when there is none."""
    global _loaded
    with _lock:
        if _loaded is None:
            try:
                _loaded = _from_hip_python() or _from_ctypes()
            except DeviceUnavailableError as e:
                _loaded = e.reason
    if isinstance(_loaded, str):
        raise DeviceUnavailableError(WHO, _loaded, INSTALL)
    return _loaded
