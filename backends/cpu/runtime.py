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

# below this many innermost iterations a kernel runs on the calling thread: handing work to the
# pool costs tens of microseconds, about what one core needs for a 1M-element memory-bound pass
PARALLEL_MIN_WORK = 1 << 20

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
        self._fn = ctypes.CFUNCTYPE(None, *argtypes)(addr)
        self.address = addr
        self._nvars = nvars
        self._nbuf = compiled.buf_count
        self._threads: dict[tuple, int] = {}

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
        threads = 1
        if extent > 1:
            key = (tuple(vals), os.environ.get("MOROK_CPU_THREADS"))
            threads = self._threads.get(key, 0)
            if not threads:
                threads = self._decide_threads(vals)
                if len(self._threads) > 1024:
                    self._threads.clear()
                self._threads[key] = threads
        if threads > 1:
            self._parallel(buffers, vals, extent, threads)
        else:
            self._fn(*buffers, *vals, 0, extent)
        return time.perf_counter() - t0 if wait else None

    def _decide_threads(self, vals: Sequence[int]) -> int:
        """Worker threads for these values: one unless the work pays for the hand-off."""
        n = config.cpu_threads()
        info = self.launch
        work = 1 << 62 if info is None else info.prepare(dict(zip(info.var_names, vals)))[3]
        return n if work >= PARALLEL_MIN_WORK else 1

    def _parallel(self, buffers, vals, extent: int, threads: int) -> None:
        chunks = min(threads, extent)
        step = -(-extent // chunks)
        fn = self._fn
        pool = worker_pool(threads)
        futures = [pool.submit(fn, *buffers, *vals, s, min(s + step, extent))
                   for s in range(step, extent, step)]
        fn(*buffers, *vals, 0, min(step, extent))   # the calling thread takes the first chunk
        for f in futures:
            f.result()
