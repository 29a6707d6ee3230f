"""The ROCm device: hipMalloc memory, two compiler pairs (LLVM AMDGPU + ld.lld, HIP C + hiprtc),
code objects loaded and launched through hip-python.

`compile_only_pairs(arch)` gives the (renderer, compiler) pairs for an arch with no ROCm installed
and no AMD GPU present (for `morok compile --device ROCM --arch gfx942`).
"""
from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any

from morok_py import config
from morok_py.device import CompiledSpec, Compiler, DeviceSpec, Renderer
from morok_py.launch import Device, StreamMarks
from morok_py.errors import DeviceUnavailableError, UnknownNameError
from morok_py.registry import active_gpu_stack, claim_gpu_stack

from .compiler import AMDGPUCompiler, check_arch, mlir_pair
from .renderer import AMDGPURenderer, parse_arch, wave_size
from .runtime import HIPProgram, check, hip_module

_current = threading.local()     # the HIP device each thread last made current
_open: "weakref.WeakSet[ROCMDevice]" = weakref.WeakSet()


def compile_only_pairs(arch: str, device: DeviceSpec | None = None) -> list[tuple[Renderer, Compiler]]:
    """The (renderer, compiler) pairs for `arch` (e.g. 'gfx942' or 'gfx90a:xnack-'), needing no ROCm
    and no GPU: LLVM AMDGPU + ld.lld first, then HIP C + hiprtc (whose `available()` says whether
    hiprtc can be used here)."""
    spec = device or DeviceSpec("ROCM", 0)
    check_arch(arch)
    pairs: list[tuple[Renderer, Compiler]] = [(AMDGPURenderer(spec, arch), AMDGPUCompiler(arch))]
    hip_pair = _hip_pair(spec, arch)
    if hip_pair is not None:
        pairs.append(hip_pair)
    pairs.append(mlir_pair(spec, arch))
    return pairs


def _hip_pair(spec: DeviceSpec, arch: str) -> tuple[Renderer, Compiler] | None:
    try:
        from .renderer import HIPRenderer
        from .compiler import HIPRTCCompiler
    except ImportError:     # the shared C printer is not there: only the LLVM pair
        return None
    return HIPRenderer(spec, arch), HIPRTCCompiler(arch)


def ordered_pairs(pairs: list[tuple[Renderer, Compiler]]) -> list[tuple[Renderer, Compiler]]:
    """Usable pairs first (so hiprtc is the default when ld.lld is missing but ROCm is there); the
    relative order is kept otherwise."""
    usable = [p for p in pairs if p[1].available() is None]
    return usable + [p for p in pairs if p not in usable]


class ROCMDevice(StreamMarks, Device):
    """One AMD GPU: `ROCM` or `ROCM:n`."""

    def __init__(self, spec: DeviceSpec) -> None:
        hip = hip_module()
        count = check(hip.hipGetDeviceCount(), "hipGetDeviceCount")
        if not 0 <= spec.ordinal < count:
            raise UnknownNameError(f"{spec}: there are {count} ROCm device(s), ROCM:0..ROCM:{count - 1}")
        self._hip = hip
        self.spec = spec               # the allocator reads the name before Device.__init__ runs
        self.ordinal = spec.ordinal
        self.closed = False
        self.stream = None             # HIP's default (null) stream of this device
        self.make_current()
        props = check(hip.hipGetDeviceProperties(spec.ordinal), "hipGetDeviceProperties")
        self.props = props
        raw = props.gcnArchName
        self.target_id = (raw.decode() if isinstance(raw, bytes) else str(raw)).split("\0")[0]
        device_arch = parse_arch(self.target_id)[0]
        name = props.name
        self.gpu_name = (name.decode() if isinstance(name, bytes) else str(name)).split("\0")[0]
        self.total_memory = int(props.totalGlobalMem)
        self.compute_units = int(props.multiProcessorCount)
        self.wave_size = int(getattr(props, "warpSize", 0) or wave_size(device_arch))
        compile_arch = config.arch_override("ROCM") or self.target_id
        pairs = ordered_pairs(compile_only_pairs(compile_arch, spec))
        from .allocator import HIPAllocator
        super().__init__(spec, HIPAllocator(self), pairs, self._load, arch=device_arch)
        _open.add(self)

    # -- runtime --------------------------------------------------------------------------------
    def _load(self, compiled: CompiledSpec) -> HIPProgram:
        return HIPProgram(self, compiled)

    def make_current(self) -> None:
        if getattr(_current, "ordinal", None) != self.ordinal:
            check(self._hip.hipSetDevice(self.ordinal), "hipSetDevice")
            _current.ordinal = self.ordinal

    def synchronize(self) -> None:
        self.make_current()
        # (synchronized orders pending imports first: the wait covers their producers' work too)
        self.synchronized(lambda: check(self._hip.hipDeviceSynchronize(), "hipDeviceSynchronize"))

    def _stream_query(self) -> bool:
        """One hipStreamQuery (StreamMarks.stream_idle asks only when its marks cannot tell)."""
        self.make_current()
        hip = self._hip
        return hip.hipStreamQuery(self._stream)[0] == hip.hipError_t.hipSuccess   # (stream_idle ordered imports)

    # -- DLPack: the consumer's stream waits for ours ------------------------------------------
    def dlpack_stream(self) -> int:
        """The stream a tensor imported here is used on: HIP's default stream (0), which every launch
        and copy of this device goes through."""
        return 0

    def dlpack_imported(self, producer: int | None = None) -> None:
        """This device's stream must wait for the producer's before its next use: nothing to wait for on
        HIP's default stream (None or 0, the one this device uses), another raw stream handle (a
        producer's current stream, named by its exchange API or dlpack.producer_stream) is remembered,
        once, and ordered by whatever next uses this device's stream (`order_imports` -> `_order_after`:
        a query, and an event our stream waits on if it is busy). The per-thread default stream (2)
        names the calling thread's: ordered now. The handle must stay valid until that next use."""
        if not producer:
            # the producer's pending work is on our stream now: a later export orders after it
            self._queued = None
            return
        self.import_pending(producer)

    def _order_after(self, streams) -> None:
        """StreamMarks' ordering: for each producer stream, one hipStreamQuery; a busy one gets an event
        recorded on it that our stream waits on (which marks our stream used)."""
        self.make_current()
        hip = self._hip
        for producer in streams:
            if hip.hipStreamQuery(producer)[0] == hip.hipError_t.hipSuccess:
                continue
            event = getattr(self, "_dlpack_import_event", None)
            if event is None:
                event = self._dlpack_import_event = check(hip.hipEventCreate(), "hipEventCreate")
            check(hip.hipEventRecord(event, producer), "hipEventRecord")
            check(hip.hipStreamWaitEvent(self._stream, event, 0), "hipStreamWaitEvent")
            self._queued = None     # our stream now waits on the producer's work

    def dlpack_sync(self, stream: int | None) -> None:
        """Order the consumer's `stream` after the work queued on this device (the DLPack rule). Our
        work is on the default stream: None or 0 is that stream itself, -1 asks for no
        synchronization, 1 and 2 are CUDA's and refused; another stream waits on an event."""
        from morok_py.dlpack import DLPackError
        if stream is None or stream == 0:
            if self._pending:
                self.order_imports()    # the consumer uses our stream: it waits for imported tensors' producers
            return
        if stream == -1:
            return
        if stream in (1, 2):
            raise DLPackError(f"stream={stream} is CUDA's default-stream code; ROCm takes None or 0 for the "
                              f"default stream, or a stream handle")
        if self._pending:
            self.order_imports()    # an imported tensor's producer: our stream waits for it, the consumer for us
        if self._queued is self._idle or self.stream_idle():
            return          # nothing queued here is pending: nothing to order
        hip = self._hip
        event = getattr(self, "_dlpack_event", None)
        if event is None:
            event = self._dlpack_event = check(hip.hipEventCreate(), "hipEventCreate")
        check(hip.hipEventRecord(event, self._stream), "hipEventRecord")
        check(hip.hipStreamWaitEvent(stream, event, 0), "hipStreamWaitEvent")

    def mem_info(self) -> tuple[int, int]:
        try:
            self.make_current()
            free, total = check(self._hip.hipMemGetInfo(), "hipMemGetInfo")
            return int(free), int(total)
        except Exception:
            return -1, self.total_memory

    def info(self) -> dict[str, Any]:
        free, total = self.mem_info()
        return {"arch": self.arch, "target_id": self.target_id, "name": self.gpu_name,
                "memory": total, "memory_free": free, "compute_units": self.compute_units,
                "wave_size": self.wave_size,
                "compilers": [c.cache_key + ("" if c.available() is None else f" (unavailable: {c.available()})")
                              for _, c in self.compilers]}

    def close(self) -> None:
        if not self.closed:
            try:
                self.allocator.close()
            finally:
                self.closed = True


@atexit.register
def _close_all() -> None:
    # past this point HIP may already be torn down: frees become no-ops
    for dev in list(_open):
        try:
            dev.close()
        except Exception:
            pass


def create_device(spec: DeviceSpec) -> ROCMDevice:
    """Open `ROCM:n`. Refuses a second GPU vendor stack; DeviceUnavailableError when hip-python or
    libamdhip64 is missing or no AMD GPU is present (the CLI prints it)."""
    other = active_gpu_stack()
    if other not in (None, "ROCM"):
        claim_gpu_stack("ROCM")      # raises RuntimeStackConflictError naming the active stack
    hip_module()                     # hip-python + libamdhip64 + at least one GPU, else DeviceUnavailableError
    claim_gpu_stack("ROCM")
    return ROCMDevice(spec)


__all__ = ["ROCMDevice", "create_device", "compile_only_pairs", "DeviceUnavailableError"]
