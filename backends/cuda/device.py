"""The CUDA device: `CUDA` / `CUDA:n` over the primary context of GPU n.

Two compiler pairs, both to CUBIN for the device's compute capability (or `MOROK_CUDA_ARCH`):
CUDA C -> NVRTC ("nvrtc", the default) and NVPTX LLVM IR -> llvmlite -> nvJitLink ("llvm-nvptx").
Each device has one stream that every launch and copy goes through; `synchronize()` waits for it.
Whatever queues work on that stream marks it (`stream_used`), so a DLPack export can tell, without a
driver call, that nothing of ours is pending (`stream_idle`). A DLPack import only remembers the
producer's stream; the next use of ours orders our stream after it (launch.StreamMarks, `order_imports`).

Without a driver, `create_device` raises DeviceUnavailableError, unless `MOROK_CUDA_ARCH` is set:
then it returns a compile-only device (real renderers and compilers; allocating or loading raises
DeviceUnavailableError). `compile_only_pairs(arch)` gives the pairs without any device at all.
"""
from __future__ import annotations

from typing import Any

from morok_py import config
from morok_py.device import Allocator, CompiledSpec, Compiler, DeviceSpec, Renderer
from morok_py.launch import Device, StreamMarks
from morok_py.errors import DeviceError, DeviceUnavailableError

from .compiler import INSTALL, NVPTXCompiler, NVRTCCompiler, device_compile_arch, mlir_pair, normalize_arch
from .renderer import CUDARenderer, NVPTXRenderer



def compile_only_pairs(arch: str, device: "str | DeviceSpec" = "CUDA") -> list[tuple[Renderer, Compiler]]:
    """The (renderer, compiler) pairs of a CUDA device for `arch` (e.g. 'sm_90'), needing no GPU or
    driver: [(CUDA C, NVRTC), (NVPTX LLVM IR, llvmlite + nvJitLink)], both producing CUBIN."""
    a = normalize_arch(arch)
    spec = DeviceSpec.parse(device)
    # the MLIR pair's nvvm target takes the plain arch (it emits no arch-specific instructions)
    return [(CUDARenderer(spec, a), NVRTCCompiler(a)), (NVPTXRenderer(spec, a), NVPTXCompiler(a)),
            mlir_pair(spec, a.rstrip("af") if a.endswith(("a", "f")) else a)]


def driver_missing() -> str | None:
    """None when the NVIDIA driver library can be loaded, else why not (loads nothing else)."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as e:
        return f"cuda-bindings is not importable ({e})"
    try:
        err, version = cu.cuDriverGetVersion()
    except Exception as e:   # cuda.pathfinder's DynamicLibNotFoundError when libcuda is absent
        return f"no NVIDIA driver: {str(e).splitlines()[0]}"
    if err != cu.CUresult.CUDA_SUCCESS:
        return f"cuDriverGetVersion failed with {err.name}"
    return None


_NO_DRIVER_HINT = ("CUDA kernels can still be rendered and compiled without one: set MOROK_CUDA_ARCH=sm_90, "
                   "run `morok compile --device CUDA --arch sm_90 KERNEL`, or use "
                   "morok_py.backends.cuda.compile_only_pairs('sm_90')")


class CUDADevice(StreamMarks, Device):
    def __init__(self, spec: DeviceSpec) -> None:
        from cuda.bindings import driver as cu

        from morok_py.registry import claim_gpu_stack

        from .allocator import CUDAAllocator
        from .runtime import _tls, check

        self._tls = _tls    # the device whose context is current on each thread
        self.closed = False
        self.spec = spec
        claim_gpu_stack("CUDA")
        try:
            check(cu.cuInit(0), "cuInit")
            count = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        except DeviceError as e:
            raise DeviceUnavailableError(str(spec), f"the CUDA driver did not initialize ({e})") from None
        if spec.ordinal >= count:
            raise DeviceUnavailableError(str(spec), f"there {'is' if count == 1 else 'are'} {count} CUDA GPU(s); "
                                                    f"ordinals are 0..{count - 1}" if count else "no CUDA GPU found")
        self.handle = check(cu.cuDeviceGet(spec.ordinal), "cuDeviceGet")
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        _tls.device = self
        attr = cu.CUdevice_attribute
        major = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.handle), "cuDeviceGetAttribute")
        minor = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.handle), "cuDeviceGetAttribute")
        self.compute_capability = (int(major), int(minor))
        self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        device_arch = f"sm_{major}{minor}"
        override = config.arch_override("CUDA")
        compile_arch = normalize_arch(override) if override else device_compile_arch(device_arch)
        super().__init__(spec, CUDAAllocator(self), compile_only_pairs(compile_arch, spec), self._load,
                         arch=device_arch)

    # -- context, stream ----------------------------------------------------------------------
    def make_current(self) -> None:
        """Make this GPU's primary context current on the calling thread (cheap when it already is)."""
        if getattr(self._tls, "device", None) is not self:
            from cuda.bindings import driver as cu
            from .runtime import check
            check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
            self._tls.device = self

    def synchronize(self) -> None:
        from cuda.bindings import driver as cu
        from .runtime import check
        self.make_current()
        # (synchronized orders pending imports first: the wait covers their producers' work too)
        self.synchronized(lambda: check(cu.cuStreamSynchronize(self._stream), "cuStreamSynchronize"))

    def _stream_query(self) -> bool:
        """One cuStreamQuery (StreamMarks.stream_idle asks only when its marks cannot tell)."""
        query, _record, _wait, ok = (self._dlpack_api or self._dlpack_setup())[:4]
        self.make_current()
        return query(self._stream)[0] == ok     # (stream_idle, its caller, ordered pending imports first)

    # -- DLPack: the consumer's stream waits for ours ------------------------------------------
    def dlpack_stream(self) -> int:
        """The stream a producer orders an exported tensor's pending work before: the legacy default
        stream (1), which a producer on its default stream needs no event for (PyTorch makes and waits on
        one per call for any other stream); `dlpack_imported` then orders this device's stream after it."""
        return 1

    def dlpack_imported(self, producer: int | None = None) -> None:
        """This device's stream must wait for the producer's before its next use: the legacy default
        stream, where a producer asked with `dlpack_stream` ordered its work, or the raw stream handle
        `producer` its library named (its DLPack exchange API or dlpack.producer_stream; None and 0 are
        the legacy default stream). Lazy: the handle is remembered, once, and whatever next uses this
        device's stream orders it then (`order_imports` -> `_order_after`: a query, and an event our
        stream waits on if the producer's is busy; about 1.5 us a query on the H200 host, no longer paid
        per import). The per-thread default stream (2) names the calling thread's: ordered now.
        The handle must stay valid until that next use: the legacy stream and PyTorch's (pooled, never
        destroyed) do; buffer.py orders at once for a producer it cannot vouch for."""
        if producer is None or producer == 0:
            producer = 1
        self.import_pending(producer)

    def _order_after(self, streams) -> None:
        """StreamMarks' ordering: for each producer stream, one cuStreamQuery; a busy one gets an event
        recorded on it that our stream waits on (which marks our stream used)."""
        query, record, wait, ok, _legacy, check, events, handles = self._dlpack_api or self._dlpack_setup()
        self.make_current()
        for producer in streams:
            src = handles.get(producer)
            if src is None:
                from cuda.bindings import driver as cu
                src = cu.CUstream(producer)
                if len(handles) < 64:
                    handles[producer] = src
            if query(src)[0] == ok:
                continue
            check(record(events[0], src), "cuEventRecord")
            check(wait(self._stream, events[0], 0), "cuStreamWaitEvent")
            self._queued = None     # our stream now waits on the producer's work

    # (cuStreamQuery, cuEventRecord, cuStreamWaitEvent, CUDA_SUCCESS, the legacy stream, check, (import
    # event, export event), producer and consumer streams by handle): looked up once, not imported per DLPack call
    _dlpack_api: "tuple | None" = None

    def _dlpack_setup(self) -> tuple:
        from cuda.bindings import driver as cu
        from .runtime import check
        self.make_current()
        events = tuple(check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
                       for _ in range(2))
        legacy = cu.CUstream(1)      # CU_STREAM_LEGACY
        self._dlpack_api = (cu.cuStreamQuery, cu.cuEventRecord, cu.cuStreamWaitEvent, cu.CUresult.CUDA_SUCCESS,
                            legacy, check, events, {None: legacy, 1: legacy, 2: cu.CUstream(2)})
        return self._dlpack_api

    def dlpack_sync(self, stream: int | None) -> None:
        """Order the consumer's `stream` after the work queued on this device's stream (the DLPack
        rule): an event recorded here, waited on there. None is the legacy default stream (1), 2 the
        per-thread default, -1 asks for no synchronization; 0 is ambiguous and refused."""
        if stream == -1:
            return
        if stream == 0:
            from morok_py.dlpack import DLPackError
            raise DLPackError("stream=0 is ambiguous for CUDA (the DLPack protocol refuses it); pass 1 for the "
                              "legacy default stream, 2 for the per-thread one, or a stream handle")
        if self._pending:
            self.order_imports()    # an imported tensor's producer: our stream waits for it, the consumer for us
        if self._queued is self._idle:
            return          # nothing was queued here since the stream was last seen idle: nothing to order
        if self.stream_idle():
            return          # one query: nothing queued here is pending
        _query, record, wait, _ok, _legacy, check, events, streams = self._dlpack_api
        target = streams.get(stream)
        if target is None:
            from cuda.bindings import driver as cu
            target = cu.CUstream(stream)
        check(record(events[1], self._stream), "cuEventRecord")
        check(wait(target, events[1], 0), "cuStreamWaitEvent")

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        from cuda.bindings import driver as cu
        from .runtime import check
        self.make_current()
        free, total = check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def _load(self, compiled: CompiledSpec):
        from .runtime import CUDAProgram
        return CUDAProgram(self, compiled)

    # -- graphs -------------------------------------------------------------------------------
    def capture_plan(self, plan):
        """Capture an ExecutionPlan's launches into a CUDA graph; returns the replay callable."""
        from .runtime import capture_plan
        return capture_plan(self, plan)

    # -- what `morok devices` prints ----------------------------------------------------------
    def info(self) -> dict[str, Any]:
        from cuda.bindings import driver as cu
        from .runtime import check
        name = check(cu.cuDeviceGetName(256, self.handle), "cuDeviceGetName")
        name = name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)
        free, total = self.mem_info()
        sms = check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                            self.handle), "cuDeviceGetAttribute")
        drv = check(cu.cuDriverGetVersion(), "cuDriverGetVersion")
        pairs = {}
        for _, c in self.compilers:
            why = c.available()
            pairs[c.cache_key] = "ok" if why is None else why
        return {"name": name, "arch": self.arch, "compute_capability": "%d.%d" % self.compute_capability,
                "memory_total": total, "memory_free": free, "multiprocessors": int(sms),
                "driver": f"{drv // 1000}.{(drv % 1000) // 10}", "compile_arch": self.compiler.arch,
                "compilers": [k for k, v in pairs.items() if v == "ok"], "compiler_status": pairs}


class _NoMemory(Allocator):
    """The allocator of a compile-only device: every use says why there is no memory."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(name)
        self.reason = reason

    def _alloc(self, nbytes: int) -> int:
        raise DeviceUnavailableError(self.device_name, f"compile-only device, no driver ({self.reason})", INSTALL)

    def _free(self, handle: int, nbytes: int) -> None:
        pass

    def copyin(self, handle: int, src) -> None:
        self._alloc(0)

    def copyout(self, dst, handle: int) -> None:
        self._alloc(0)


class CUDACompileOnlyDevice(Device):
    """`Device["CUDA"]` on a machine without a driver when MOROK_CUDA_ARCH is set: the real renderers
    and compilers for that arch, so `dev.renderer.render` / `dev.compiler.compile` work; allocating
    memory or loading a program raises DeviceUnavailableError naming the missing driver."""

    compile_only = True

    def __init__(self, spec: DeviceSpec, arch: str, reason: str) -> None:
        self.reason = reason
        super().__init__(spec, _NoMemory(str(spec), reason), compile_only_pairs(arch, spec), self._load,
                         arch=normalize_arch(arch))

    def _load(self, compiled: CompiledSpec):
        raise DeviceUnavailableError(self.name, f"compile-only device: cannot load {compiled.name} ({self.reason})",
                                     INSTALL)

    def info(self) -> dict[str, Any]:
        return {"name": "compile-only (no driver)", "arch": self.arch, "compile_only": True, "reason": self.reason,
                "compilers": [c.cache_key for _, c in self.compilers if c.available() is None]}


def create_device(spec: DeviceSpec) -> Device:
    why = driver_missing()
    if why is not None:
        override = config.arch_override("CUDA")
        if override:
            return CUDACompileOnlyDevice(spec, override, why)
        raise DeviceUnavailableError(str(spec), f"{why.rstrip('.')}. {_NO_DRIVER_HINT}")
    return CUDADevice(spec)
