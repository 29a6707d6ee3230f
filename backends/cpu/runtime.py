"""Loads a host object in-process (LLVM's RuntimeDyld through llvmlite) and calls it via ctypes,
splitting the outermost parallel axis over worker threads when the work pays for them."""
from __future__ import annotations

import ctypes
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from morok_py import config
from morok_py.device import CompiledSpec, Program
from morok_py.errors import DeviceError, LaunchError

from .compiler import llvm
from .renderer import STREAM_ALIGN, STREAM_SUFFIX

# below this many innermost iterations a kernel runs on the calling thread: handing work to the
# pool costs tens of microseconds, about what one core needs for a 1M-element memory-bound pass
PARALLEL_MIN_WORK = 1 << 20


def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache (sysfs), 32 MiB where it cannot be read."""
    best = 0
    try:
        root = "/sys/devices/system/cpu/cpu0/cache"
        for entry in os.listdir(root):
            if entry.startswith("index"):
                with open(f"{root}/{entry}/size") as f:
                    text = f.read().strip().upper()
                scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                best = max(best, int(text.rstrip("KMG")) * scale)
    except (OSError, ValueError):
        pass
    return best or 32 << 20


# a launch that touches more bytes than the last-level cache holds takes the streaming variant (its
# vector stores non-temporal: no read-for-ownership of the destination, 3 memory transfers per
# element of an add instead of 4); below that the output may still be in cache for the next kernel
STREAM_MIN_BYTES = last_level_cache_bytes()

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def worker_pool(n: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size != n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="morok-cpu")
            _pool_size = n
        return _pool


class CPUProgram(Program):
    def __init__(self, device, compiled: CompiledSpec, target_machine) -> None:
        super().__init__(device, compiled)
        if compiled.bytes is None:
            raise LaunchError(f"{compiled.name}: the CPU runtime loads object bytes, got source only")
        if compiled.arch and compiled.arch != device.arch:
            raise DeviceError("load", 0, "ARCH_MISMATCH",
                              f"{compiled.name} was compiled for cpu {compiled.arch!r}, this host is {device.arch!r}")
        b = llvm()
        try:
            self._engine = b.create_mcjit_compiler(b.parse_assembly(""), target_machine)
            self._engine.add_object_file(b.ObjectFileRef.from_data(compiled.bytes))
            self._engine.finalize_object()
            addr = self._engine.get_function_address(compiled.name)
        except RuntimeError as e:
            raise DeviceError("load object", 0, "LOAD_FAILED", f"{compiled.name}: {e}") from None
        if not addr:
            raise DeviceError("load object", 0, "SYMBOL_NOT_FOUND", f"no symbol {compiled.name!r} in the object")
        nvars = len(compiled.var_names)
        argtypes = [ctypes.c_void_p] * compiled.buf_count + [ctypes.c_int32] * (nvars + 2)
        proto = ctypes.CFUNCTYPE(None, *argtypes)
        self._fn = proto(addr)
        self.address = addr
        stream = self._engine.get_function_address(compiled.name + STREAM_SUFFIX)
        self._stream_fn = proto(stream) if stream else None
        info = compiled.launch
        self._stream_slots = [] if info is None else [p.slot for p in info.params if p.written]
        self._nvars = nvars
        self._nbuf = compiled.buf_count
        self._plans: dict[tuple, tuple[bool, bool]] = {}

    def execute(self, buffers: Sequence[int], vals: Sequence[int] = (),
                global_size: Sequence[int] | None = None, local_size: Sequence[int] | None = None,
                wait: bool = False) -> float | None:
        if len(buffers) != self._nbuf or len(vals) != self._nvars:
            raise LaunchError(f"{self.name} takes {self._nbuf} buffers and {self._nvars} values, "
                              f"got {len(buffers)} and {len(vals)}")
        if global_size is None:
            global_size = self.compiled.global_size
            if global_size is None:
                raise LaunchError(f"{self.name} has symbolic sizes: pass global_size from spec.launch_dims()")
        extent = global_size[0]
        t0 = time.perf_counter() if wait else 0.0
        threads, fn = 1, self._fn
        if extent > 1:
            plan = self._plans.get(tuple(vals))
            if plan is None:
                plan = self._plan(vals)
                if len(self._plans) > 1024:
                    self._plans.clear()
                self._plans[tuple(vals)] = plan
            split, stream = plan
            if split:   # the environment is read only where it matters: a lookup costs ~0.5 us
                threads = config.cpu_threads()
            # the streaming variant promises LLVM aligned output buffers (and aligned chunk starts)
            if stream and all(buffers[s] % STREAM_ALIGN == 0 for s in self._stream_slots):
                fn = self._stream_fn
        if threads > 1:
            self._parallel(fn, buffers, vals, extent, threads)
        else:
            fn(*buffers, *vals, 0, extent)
        return time.perf_counter() - t0 if wait else None

    def _plan(self, vals: Sequence[int]) -> tuple[bool, bool]:
        """(split over the worker threads, take the streaming variant) for these values: split when
        the work pays for the hand-off; stream where the bytes touched overflow the last-level cache."""
        n = config.cpu_threads()     # also rejects a bad MOROK_CPU_THREADS at the first launch
        info = self.launch
        if info is None:
            return True, False
        gs, _, bounds, work = info.prepare(dict(zip(info.var_names, vals)))
        # a register-tiled kernel does one store per output of its tile in each innermost iteration
        work *= max(1, sum(1 for b in bounds if b is not None and b[1]))
        stream = False
        # every thread's chunk must start on a multiple of STREAM_ALIGN of the outer axis
        if self._stream_fn is not None and gs[0] >= n * STREAM_ALIGN:
            spans: dict[int, tuple[int, int]] = {}
            for b in bounds:
                if b is not None:
                    slot, _, lo, hi = b
                    old = spans.get(slot, (lo, hi))
                    spans[slot] = (min(old[0], lo), max(old[1], hi))
            touched = sum((hi - lo + 1) * info.params[s].dtype.itemsize for s, (lo, hi) in spans.items())
            stream = touched > STREAM_MIN_BYTES
        return work >= PARALLEL_MIN_WORK, stream

    def _parallel(self, fn, buffers, vals, extent: int, threads: int) -> None:
        chunks = min(threads, extent)
        step = -(-extent // chunks)
        if fn is self._stream_fn:
            step = -(-step // STREAM_ALIGN) * STREAM_ALIGN
        pool = worker_pool(threads)
        futures = [pool.submit(fn, *buffers, *vals, s, min(s + step, extent))
                   for s in range(step, extent, step)]
        fn(*buffers, *vals, 0, min(step, extent))   # the calling thread takes the first chunk
        for f in futures:
            f.result()
