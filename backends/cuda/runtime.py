"""CUBIN loading and launching through the driver API of cuda-bindings.

Arguments are packed once per program: every kernel parameter gets an 8-byte slot in one ctypes
array, and the `void**` array pointing at the slots is built at load time. A launch only rewrites
the slots whose values changed and passes the `void**` address as an int, so cuda-bindings does no
per-call packing and a launch costs about what a bare `cuLaunchKernel` with pre-packed arguments does.
"""
from __future__ import annotations

import ctypes
import functools
import struct
import threading
from typing import Any, Callable, Sequence

from cuda.bindings import driver as cu

from morok_py.device import CompiledSpec
from morok_py.launch import Program
from morok_py.errors import ContextLostError, DeviceError, LaunchError

from .compiler import arch_number, normalize_arch


_SUCCESS = cu.CUresult.CUDA_SUCCESS

# the CUDA device whose context is current on each thread (set by CUDADevice.make_current, read inline
# by every launch); here, the lowest module of the backend, so the device and programs share it
_tls = threading.local()


def error_text(err) -> str:
    try:
        e2, s = cu.cuGetErrorString(err)
        if e2 == _SUCCESS and s:
            return s.decode() if isinstance(s, bytes) else str(s)
    except Exception:
        pass
    return ""


# errors the driver documents as sticky: the context is unusable afterwards and every later call
# returns the same code, until the process exits
STICKY = frozenset(name for name in (
    "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    "CUDA_ERROR_INVALID_PC", "CUDA_ERROR_ASSERT", "CUDA_ERROR_LAUNCH_TIMEOUT", "CUDA_ERROR_ECC_UNCORRECTABLE",
    "CUDA_ERROR_CONTEXT_IS_DESTROYED") if hasattr(cu.CUresult, name))


def device_error(call: str, err, detail: str = "") -> DeviceError:
    """The DeviceError for a failed driver call: a ContextLostError for a sticky error."""
    name = getattr(err, "name", str(err))
    return (ContextLostError if name in STICKY else DeviceError)(call, int(err), name, detail)


def check(result, call: str):
    """Unpack a cuda-bindings result tuple; a failure becomes DeviceError(call, code, CUresult name),
    a sticky one ContextLostError (which says the context is lost and the process must restart)."""
    err = result[0]
    if err != _SUCCESS:
        raise device_error(call, err, error_text(err))
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


# ---- CUBIN inspection (pure: usable without a GPU) -----------------------------------------------

def cubin_arch(data: bytes) -> str:
    """The `sm_XY` a CUBIN was built for, read from its ELF header (e_flags)."""
    if len(data) < 52 or data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not a 64-bit ELF CUBIN")
    abi_version = data[8]
    (e_flags,) = struct.unpack_from("<I", data, 48)
    sm = (e_flags >> 8) & 0xFF if abi_version >= 8 else e_flags & 0xFF
    return f"sm_{sm}"


def check_cubin_arch(name: str, data: bytes, compiled_arch: str, device_arch: str, device_name: str) -> None:
    """Refuse, at load time, a CUBIN that cannot run on this device, naming both archs.

    CUBIN runs on the arch it was built for and on later minor versions of the same major
    (sm_80 code on sm_86), never across majors; arch-specific targets (sm_90a) need that exact arch.
    """
    try:
        built = cubin_arch(data)
    except ValueError as e:
        raise DeviceError("cuModuleLoadData", 0, "INVALID_IMAGE", f"{name}: {e}") from None
    want = normalize_arch(device_arch)
    b, d = arch_number(built), arch_number(want)
    specific = compiled_arch.endswith(("a", "f"))
    ok = (b // 10 == d // 10 and b % 10 <= d % 10) and not (specific and arch_number(compiled_arch) != d)
    if not ok:
        shown = compiled_arch or built
        raise DeviceError("cuModuleLoadData", 0, "ARCH_MISMATCH",
                          f"{name} was compiled for {shown} but {device_name} is {want}; compile for {want} "
                          f"(unset MOROK_CUDA_ARCH, or set it to {want})")


def _nothing() -> None:
    return None


# ---- programs -----------------------------------------------------------------------------------

class CUDAProgram(Program):
    """One CUBIN kernel loaded into a device's primary context."""

    def __init__(self, device: "CUDADevice", compiled: CompiledSpec) -> None:
        super().__init__(device, compiled)
        if compiled.bytes is None:
            raise LaunchError(f"{compiled.name}: the CUDA runtime loads CUBIN bytes, got source only")
        check_cubin_arch(compiled.name, compiled.bytes, compiled.arch, device.arch, device.name)
        device.make_current()
        self._module = check(cu.cuModuleLoadData(compiled.bytes), "cuModuleLoadData")
        self.symbol = compiled.symbol
        self._fn = check(cu.cuModuleGetFunction(self._module, self.symbol.encode()), "cuModuleGetFunction")
        self._smem = self._dynamic_shared()         # bytes of dynamic shared memory every launch passes
        self._nbufs = compiled.buf_count
        self._nvars = len(compiled.var_names)
        self._hidden_ptrs = self.alloc_hidden()     # passed after the caller's buffers
        n = max(1, self._nbufs + len(self._hidden_ptrs) + self._nvars)
        # one 8-byte slot per parameter (pointers are 8 bytes; an int32 reads the low 4, little endian)
        self._slots = (ctypes.c_uint64 * n)()
        base = ctypes.addressof(self._slots)
        self._argv = (ctypes.c_void_p * n)(*[base + 8 * i for i in range(n)])
        self.kernel_params = ctypes.addressof(self._argv)   # the void** handed to cuLaunchKernel
        self._lb: list[int] | None = None      # the buffers and values now in the slots
        self._lv: list[int] | None = None
        self._launch = cu.cuLaunchKernel
        self._stream = device.stream
        self._events = None
        self._tls = _tls      # whose context is current on each thread: checked inline per launch

    def _dynamic_shared(self) -> int:
        """The module's DYN_SMEM_SYMBOL (renderer.py: kernels whose shared arrays pass the static 48 KiB
        carve them from dynamic shared memory), with the function opted in to that much; 0 without it."""
        from .renderer import DYN_SMEM_SYMBOL
        err, dptr, size = cu.cuModuleGetGlobal(self._module, DYN_SMEM_SYMBOL.encode())
        if err == cu.CUresult.CUDA_ERROR_NOT_FOUND:
            return 0
        check((err,), "cuModuleGetGlobal")
        word = ctypes.c_uint32(0)
        check(cu.cuMemcpyDtoH(ctypes.addressof(word), dptr, 4), "cuMemcpyDtoH")
        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(cu.cuFuncSetAttribute(self._fn, attr, int(word.value)), "cuFuncSetAttribute")
        return int(word.value)

    @property
    def function(self):
        """The CUfunction handle (for tools and the launch benchmark)."""
        return self._fn

    def _events_pair(self):
        if self._events is None:
            flags = cu.CUevent_flags.CU_EVENT_DEFAULT
            self._events = (check(cu.cuEventCreate(flags), "cuEventCreate"),
                            check(cu.cuEventCreate(flags), "cuEventCreate"))
        return self._events

    def execute(self, buffers: Sequence[int], vals: Sequence[int] = (),
                global_size: Sequence[int] | None = None, local_size: Sequence[int] | None = None,
                wait: bool = False) -> float | None:
        if wait or global_size is None or local_size is None:
            return self._execute_checked(buffers, vals, global_size, local_size, wait)
        # the hot path: same arguments as last time -> nothing to pack
        if buffers != self._lb or vals != self._lv:
            self._patch(buffers, vals)
        dev = self.device
        if getattr(self._tls, "device", None) is not dev:
            dev.make_current()
        if dev._pending:
            dev.order_imports()     # DLPack imports' producers first (StreamMarks)
        if 0 in global_size:
            return None          # nothing to do: CUDA refuses empty grids
        (err,) = self._launch(self._fn, global_size[0], global_size[1], global_size[2],
                              local_size[0], local_size[1], local_size[2], self._smem, self._stream, self.kernel_params, 0)
        dev._queued = None      # (CUDADevice.stream_used, inline)
        if err:
            self._launch_failed(err, global_size, local_size)
        return None

    def prepare(self, buffers: Sequence[int], vals: Sequence[int], global_size: Sequence[int],
                local_size: Sequence[int]) -> Callable[[], Any]:
        """This launch with its own packed arguments, for the checked call's replay of a passed check:
        `cuLaunchKernel` bound to every argument (the program's shared slots are left alone). It
        returns the driver's `(CUresult,)`; it does not make the context current first (a launch
        from a thread where it is not fails, and `prepared_failed` makes it current and retries)."""
        if len(buffers) != self._nbufs or len(vals) != self._nvars:
            raise LaunchError(f"{self.name} takes {self._nbufs} buffers and {self._nvars} values, "
                              f"got {len(buffers)} and {len(vals)}")
        gs, ls = tuple(global_size), tuple(local_size)
        if 0 in gs:
            return _nothing       # CUDA refuses empty grids
        args = [*buffers, *self._hidden_ptrs, *vals]
        n = max(1, len(args))
        slots = (ctypes.c_uint64 * n)(*[a & 0xFFFFFFFFFFFFFFFF for a in args])
        base = ctypes.addressof(slots)
        argv = (ctypes.c_void_p * n)(*[base + 8 * i for i in range(n)])
        args = (self._fn, *gs, *ls, self._smem, self._stream, ctypes.addressof(argv), 0)
        kernel, dev = self._launch, self.device

        def launch():
            if dev._pending:
                dev.order_imports()     # DLPack imports' producers first (StreamMarks)
            result = kernel(*args)
            dev._queued = None      # (CUDADevice.stream_used, inline)
            return result
        launch.args = args
        launch.keep = (slots, argv)     # the argument memory lives as long as the launch
        return launch

    def prepared_failed(self, result: tuple, launch: Callable[[], Any]) -> None:
        dev = self.device
        self._tls.device = None
        dev.make_current()
        (err,) = launch()
        if err:
            self._launch_failed(err, launch.args[1:4], launch.args[4:7])

    def _patch(self, buffers: Sequence[int], vals: Sequence[int]) -> None:
        if len(buffers) != self._nbufs or len(vals) != self._nvars:
            raise LaunchError(f"{self.name} takes {self._nbufs} buffers and {self._nvars} values, "
                              f"got {len(buffers)} and {len(vals)}")
        args = [*buffers, *self._hidden_ptrs, *vals]
        self._slots[0:len(args)] = [a & 0xFFFFFFFFFFFFFFFF for a in args]
        self._lb, self._lv = list(buffers), list(vals)

    def _launch_failed(self, err, global_size, local_size) -> None:
        raise device_error("cuLaunchKernel", err,
                           f"{self.name} grid={tuple(global_size)} block={tuple(local_size)}: {error_text(err)}")

    def _execute_checked(self, buffers, vals, global_size, local_size, wait: bool) -> float | None:
        if global_size is None:
            global_size = self.compiled.global_size
            if global_size is None:
                raise LaunchError(f"{self.name} has symbolic sizes: pass global_size from spec.launch_dims()")
        if local_size is None:
            local_size = self.compiled.local_size or (1, 1, 1)
        if not wait:
            return self.execute(buffers, vals, global_size, local_size)
        self._patch(buffers, vals)
        self.device.make_current()
        self.device.order_imports()
        if 0 in global_size:
            return 0.0
        stream = self._stream
        start, end = self._events_pair()
        check(cu.cuEventRecord(start, stream), "cuEventRecord")
        (err,) = self._launch(self._fn, global_size[0], global_size[1], global_size[2],
                              local_size[0], local_size[1], local_size[2], self._smem, stream, self.kernel_params, 0)
        self.device.stream_used()
        if err:
            self._launch_failed(err, global_size, local_size)
        check(cu.cuEventRecord(end, stream), "cuEventRecord")
        check(cu.cuEventSynchronize(end), "cuEventSynchronize")
        ms = check(cu.cuEventElapsedTime(start, end), "cuEventElapsedTime")
        return float(ms) * 1e-3

    def __del__(self) -> None:
        try:
            if getattr(self, "_events", None):
                for e in self._events:
                    cu.cuEventDestroy(e)
            if getattr(self, "_module", None) is not None:
                cu.cuModuleUnload(self._module)
            self.free_hidden()
        except Exception:
            pass


# ---- CUDA graphs ----------------------------------------------------------------------------------

class CUDAGraph:
    """An ExecutionPlan captured by stream capture: one `cuGraphLaunch` replays every kernel.

    Kernel arguments are copied into the graph at capture, so the programs' slots may change after.
    """

    def __init__(self, device: "CUDADevice", graph, graph_exec, kernels: int) -> None:
        self.device, self.graph, self.graph_exec, self.kernels = device, graph, graph_exec, kernels
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT
        self._start = check(cu.cuEventCreate(flags), "cuEventCreate")
        self._end = check(cu.cuEventCreate(flags), "cuEventCreate")

    def __call__(self, wait: bool = False) -> float | None:
        dev = self.device
        dev.make_current()
        stream = dev.stream     # (reading it orders pending DLPack imports first)
        if wait:
            check(cu.cuEventRecord(self._start, stream), "cuEventRecord")
        (err,) = cu.cuGraphLaunch(self.graph_exec, stream)
        dev.stream_used()
        if err:
            raise device_error("cuGraphLaunch", err, error_text(err))
        if wait:
            check(cu.cuEventRecord(self._end, stream), "cuEventRecord")
            check(cu.cuEventSynchronize(self._end), "cuEventSynchronize")
            return float(check(cu.cuEventElapsedTime(self._start, self._end), "cuEventElapsedTime")) * 1e-3
        return None

    def __del__(self) -> None:
        try:
            cu.cuGraphExecDestroy(self.graph_exec)
            cu.cuGraphDestroy(self.graph)
            cu.cuEventDestroy(self._start)
            cu.cuEventDestroy(self._end)
        except Exception:
            pass


def capture_plan(device: "CUDADevice", plan) -> CUDAGraph:
    """Record the plan's launches (already bound and checked by the plan) into a CUDA graph."""
    device.make_current()
    stream = device._stream
    # Pending DLPack imports are ordered before the capture, and none can be remembered during it (an
    # import waits for the lock): a launch inside the capture never orders one (an event recorded outside
    # a capture cannot be waited on inside it).
    with device.imports_held():
        check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(cu.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture")
        try:
            for st in plan.steps:
                st.program.execute(st.ptrs, st.ordered, st.gs, st.ls)
        except BaseException:
            cu.cuStreamEndCapture(stream)   # leave the stream usable; the launch error is what matters
            raise
        graph = check(cu.cuStreamEndCapture(stream), "cuStreamEndCapture")
    graph_exec = check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    return CUDAGraph(device, graph, graph_exec, len(plan.steps))
