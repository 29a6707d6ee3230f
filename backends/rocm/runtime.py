"""Code object loading and launching through hip-python (hipModuleLoadData / hipModuleLaunchKernel).

Arguments are packed once per program into one kernarg buffer laid out as the kernel's metadata
says (8-byte pointers, then 4-byte ints), and handed to HIP through the `extra` array
{HIP_LAUNCH_PARAM_BUFFER_POINTER, &buf, HIP_LAUNCH_PARAM_BUFFER_SIZE, &size, HIP_LAUNCH_PARAM_END},
whose address is passed as an int: a launch only rewrites the values that changed.

hip-python imports without ROCm and fails on its first call when it cannot dlopen libamdhip64;
`hip_module()` turns that into DeviceUnavailableError, so nothing crashes without ROCm.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Sequence

from morok_py.codegen.symbols import symbol_for
from morok_py.device import CompiledSpec
from morok_py.launch import Program
from morok_py.errors import ContextLostError, DeviceError, DeviceUnavailableError, LaunchError

from .compiler import code_object_header, code_object_metadata
from .renderer import parse_arch


ROCM_INSTALL = ("ROCm's HIP runtime (libamdhip64, e.g. the rocm-hip-runtime package or Debian's libamdhip64-dev) "
                "and pip install morok-py[rocm]")

HIP_LAUNCH_PARAM_BUFFER_POINTER = 0x01
HIP_LAUNCH_PARAM_BUFFER_SIZE = 0x02
HIP_LAUNCH_PARAM_END = 0x03

_probe_lock = threading.Lock()
_probe: Any = None          # the hip module, or the DeviceUnavailableError explaining why not


def hip_module():
    """hip-python's `hip` module once libamdhip64 is known to load; else DeviceUnavailableError."""
    global _probe
    with _probe_lock:
        if _probe is None:
            _probe = _load_hip()
    if isinstance(_probe, DeviceUnavailableError):
        raise _probe
    return _probe


def _load_hip():
    try:
        from hip import hip
    except ImportError as e:
        return DeviceUnavailableError("ROCM", f"hip-python is not installed ({e})", "pip install morok-py[rocm]")
    try:
        err, count = hip.hipGetDeviceCount()
    except RuntimeError as e:      # hip-python raises this when dlopen('libamdhip64.so') fails
        return DeviceUnavailableError("ROCM", f"libamdhip64 could not be loaded ({e})", ROCM_INSTALL)
    except Exception as e:  # a binding/runtime version skew shows up here too
        return DeviceUnavailableError("ROCM", f"the HIP runtime did not answer hipGetDeviceCount ({e!r})",
                                      ROCM_INSTALL)
    if err != hip.hipError_t.hipSuccess:
        name = getattr(err, "name", str(err))
        return DeviceUnavailableError("ROCM", f"hipGetDeviceCount failed with {name}: no usable AMD GPU "
                                      f"(is the amdgpu driver loaded and /dev/kfd accessible?)")
    if count == 0:
        return DeviceUnavailableError("ROCM", "the HIP runtime found no AMD GPU")
    return hip


def error_text(hip, err) -> str:
    try:
        r = hip.hipGetErrorString(err)     # hip-python returns (hipSuccess, CStr)
        s = r[-1] if isinstance(r, tuple) else r
        return s.decode() if hasattr(s, "decode") else str(s)
    except Exception:
        return ""


# errors after which HIP refuses every later call in the process (a kernel faulted or trapped)
STICKY = frozenset(("hipErrorIllegalAddress", "hipErrorLaunchFailure", "hipErrorMisalignedAddress",
                    "hipErrorIllegalInstruction", "hipErrorHardwareStackError", "hipErrorInvalidAddressSpace",
                    "hipErrorInvalidPc", "hipErrorAssert", "hipErrorLaunchTimeOut", "hipErrorECCNotCorrectable",
                    "hipErrorContextIsDestroyed"))


def device_error(call: str, err, detail: str = "") -> DeviceError:
    """The DeviceError for a failed HIP call: a ContextLostError for a sticky error."""
    name = getattr(err, "name", str(err))
    return (ContextLostError if name in STICKY else DeviceError)(call, int(err), name, detail)


def check(result, call: str):
    """Unpack a hip-python result tuple; a failure becomes DeviceError(call, code, hipError_t name),
    a sticky one ContextLostError (which says the context is lost and the process must restart)."""
    hip = hip_module()
    err = result[0]
    if err != hip.hipError_t.hipSuccess:
        raise device_error(call, err, error_text(hip, err))
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


# ---- code object checks (pure: usable without a GPU) ----------------------------------------------

_XNACK = {0x100: "any", 0x200: "-", 0x300: "+"}
_SRAMECC = {0x400: "any", 0x800: "-", 0xC00: "+"}


def check_code_object(name: str, data: bytes, device_target: str, device_name: str) -> None:
    """Refuse, at load time, a code object whose arch (or pinned xnack/sramecc mode) this device
    can't run, naming both; HIP itself would only say hipErrorNoBinaryForGpu."""
    try:
        hdr = code_object_header(data)
    except ValueError as e:
        raise DeviceError("hipModuleLoadData", 0, "hipErrorInvalidImage", f"{name}: {e}") from None
    if hdr["machine"] != 224:
        raise DeviceError("hipModuleLoadData", 0, "hipErrorInvalidImage",
                          f"{name} is an ELF for machine {hdr['machine']}, not an AMDGPU code object")
    want, rest = parse_arch(device_target)
    if hdr["arch"] != want:
        raise DeviceError("hipModuleLoadData", 0, "hipErrorNoBinaryForGpu",
                          f"{name} was compiled for {hdr['arch']} but {device_name} is {want}; compile for {want} "
                          f"(unset MOROK_ROCM_ARCH, or set it to {want})")
    modes = {p[:-1]: p[-1] for p in rest.split(":") if len(p) > 1 and p[-1] in "+-"}
    for feat, table, mask in (("xnack", _XNACK, 0x300), ("sramecc", _SRAMECC, 0xC00)):
        built = table.get(hdr["flags"] & mask, "any")
        dev = modes.get(feat)
        if built != "any" and dev is not None and built != dev:
            raise DeviceError("hipModuleLoadData", 0, "hipErrorNoBinaryForGpu",
                              f"{name} was compiled for {want}:{feat}{built} but {device_name} runs "
                              f"{want}:{feat}{dev}")


class _KernArgs(ctypes.Structure):
    pass


def kernarg_layout(nbufs: int, nvars: int) -> type[ctypes.Structure]:
    """The explicit kernel arguments as AMDGPU lays them out: 8-byte pointers, then 4-byte ints."""
    fields = [(f"p{i}", ctypes.c_uint64) for i in range(nbufs)] + [(f"v{i}", ctypes.c_int32) for i in range(nvars)]
    if not fields:
        fields = [("pad", ctypes.c_uint64)]
    return type("KernArgs", (ctypes.Structure,), {"_fields_": fields})


def check_kernarg_layout(name: str, data: bytes, layout: type[ctypes.Structure], nbufs: int, nvars: int,
                         symbol: str | None = None) -> None:
    """Compare the packed layout with the code object's metadata: a mismatch is caught at load, not as
    wrong results. `name` is the user's (for errors), `symbol` the kernel's in the code object."""
    symbol = symbol_for(name) if symbol is None else symbol
    try:
        meta = code_object_metadata(data)
    except ValueError:
        return    # no readable metadata note: HIP will refuse the image itself
    kern = next((k for k in meta.get("amdhsa.kernels", []) if k.get(".name") == symbol), None)
    if kern is None:
        raise DeviceError("hipModuleGetFunction", 0, "hipErrorNotFound",
                          f"{name}: no kernel {symbol!r} in the code object")
    args = [a for a in kern.get(".args", []) if not str(a.get(".value_kind", "")).startswith("hidden_")]
    want = [(getattr(layout, f).offset, getattr(layout, f).size) for f, _ in layout._fields_[:nbufs + nvars]]
    got = [(a.get(".offset"), a.get(".size")) for a in args]
    if got != want:
        raise DeviceError("hipModuleLoadData", 0, "KERNARG_LAYOUT",
                          f"{name}: the code object's arguments (offset, size) {got} differ from the packed "
                          f"layout {want}")


# ---- programs ------------------------------------------------------------------------------------

class HIPProgram(Program):
    """One code object kernel loaded on one ROCm device."""

    def __init__(self, device: "ROCMDevice", compiled: CompiledSpec) -> None:
        super().__init__(device, compiled)
        if compiled.bytes is None:
            raise LaunchError(f"{compiled.name}: the ROCm runtime loads code object bytes, got source only")
        hip = hip_module()
        self._hip = hip
        check_code_object(compiled.name, compiled.bytes, device.target_id, device.name)
        self._nbufs = compiled.buf_count
        self._nvars = len(compiled.var_names)
        nhidden = len(compiled.launch.hidden) if compiled.launch is not None else 0
        layout = kernarg_layout(self._nbufs + nhidden, self._nvars)
        check_kernarg_layout(compiled.name, compiled.bytes, layout, self._nbufs + nhidden, self._nvars,
                             compiled.symbol)
        device.make_current()
        # hand HIP a plain address: the image is copied during the load
        image = ctypes.create_string_buffer(compiled.bytes, len(compiled.bytes))
        self._module = check(hip.hipModuleLoadData(ctypes.addressof(image)), "hipModuleLoadData")
        self._fn = check(hip.hipModuleGetFunction(self._module, compiled.symbol.encode()), "hipModuleGetFunction")
        # the kernarg buffer, viewed as pointer slots and int slots over the same memory
        self._args = layout()
        base = ctypes.addressof(self._args)
        self._ptr_slots = (ctypes.c_uint64 * max(1, self._nbufs + nhidden)).from_address(base)
        self._var_slots = (ctypes.c_int32 * max(1, self._nvars)).from_address(base + 8 * (self._nbufs + nhidden))
        hidden = self.alloc_hidden()        # after the caller's buffers, set once
        if hidden:
            self._ptr_slots[self._nbufs:self._nbufs + nhidden] = hidden
        self._size = ctypes.c_size_t(ctypes.sizeof(layout))
        self._extra = (ctypes.c_void_p * 5)(HIP_LAUNCH_PARAM_BUFFER_POINTER, base, HIP_LAUNCH_PARAM_BUFFER_SIZE,
                                             ctypes.addressof(self._size), HIP_LAUNCH_PARAM_END)
        self.extra = ctypes.addressof(self._extra)      # the void** handed to hipModuleLaunchKernel
        self._last_bufs: list[int] | None = None
        self._last_vals: list[int] | None = None
        self._events = None

    @property
    def function(self):
        """The hipFunction_t handle (for tools and benchmarks)."""
        return self._fn

    def _events_pair(self):
        if self._events is None:
            hip = self._hip
            self._events = (check(hip.hipEventCreate(), "hipEventCreate"), check(hip.hipEventCreate(), "hipEventCreate"))
        return self._events

    def execute(self, buffers: Sequence[int], vals: Sequence[int] = (),
                global_size: Sequence[int] | None = None, local_size: Sequence[int] | None = None,
                wait: bool = False) -> float | None:
        if len(buffers) != self._nbufs or len(vals) != self._nvars:
            raise LaunchError(f"{self.name} takes {self._nbufs} buffers and {self._nvars} values, "
                              f"got {len(buffers)} and {len(vals)}")
        if global_size is None:
            global_size = self.compiled.global_size
            if global_size is None:
                raise LaunchError(f"{self.name} has symbolic sizes: pass global_size from spec.launch_dims()")
        if local_size is None:
            local_size = self.compiled.local_size or (1, 1, 1)
        bufs = list(buffers)
        if bufs != self._last_bufs:
            if bufs:
                self._ptr_slots[0:len(bufs)] = [b & 0xFFFFFFFFFFFFFFFF for b in bufs]
            self._last_bufs = bufs
        vs = list(vals)
        if vs != self._last_vals:
            if vs:
                self._var_slots[0:len(vs)] = vs
            self._last_vals = vs
        dev = self.device
        dev.make_current()
        if dev._pending:
            dev.order_imports()     # DLPack imports' producers first (StreamMarks)
        if not global_size[0] or not global_size[1] or not global_size[2]:
            return 0.0 if wait else None     # an empty grid: HIP refuses it, and there is nothing to do
        hip, stream = self._hip, dev._stream
        if wait:
            start, end = self._events_pair()
            check(hip.hipEventRecord(start, stream), "hipEventRecord")
        (err,) = hip.hipModuleLaunchKernel(self._fn, global_size[0], global_size[1], global_size[2],
                                           local_size[0], local_size[1], local_size[2], 0, stream, None, self.extra)
        dev._queued = None      # (ROCMDevice.stream_used, inline)
        if err != hip.hipError_t.hipSuccess:
            raise device_error("hipModuleLaunchKernel", err,
                               f"{self.name} grid={tuple(global_size)} block={tuple(local_size)}: "
                               f"{error_text(hip, err)}")
        if wait:
            check(hip.hipEventRecord(end, stream), "hipEventRecord")
            check(hip.hipEventSynchronize(end), "hipEventSynchronize")
            ms = check(hip.hipEventElapsedTime(start, end), "hipEventElapsedTime")
            return float(ms) * 1e-3
        return None

    def __del__(self) -> None:
        try:
            hip = self._hip
            if getattr(self, "_events", None):
                for e in self._events:
                    hip.hipEventDestroy(e)
            if getattr(self, "_module", None) is not None and not self.device.closed:
                hip.hipModuleUnload(self._module)
                self.free_hidden()
        except Exception:
            pass
