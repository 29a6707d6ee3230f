"""Host copies through one pinned staging buffer per device, in chunks: the loop shared by the GPU
allocators. A backend supplies only its driver calls; this module imports no vendor library."""
from __future__ import annotations

import abc
import ctypes
import threading

import numpy as np

from .errors import ArgumentError

STAGING_BYTES = 16 << 20     # pinned host memory per device; larger copies go through it in chunks


class PinnedStaging(abc.ABC):
    """Mixin for an `Allocator`: `copyin` and `copyout` through a pinned host buffer of up to
    STAGING_BYTES, one chunk at a time on the device's stream, one copy at a time per allocator.
    Call `_init_staging()` in `__init__`; the hooks raise the backend's error on a failed call."""

    def _init_staging(self) -> None:
        self._staging = 0
        self._staging_size = 0
        self._copy_lock = threading.Lock()

    # ---- the driver calls a backend supplies ------------------------------------------------------
    @abc.abstractmethod
    def _make_current(self) -> None:
        """Bind the device's context to this thread."""

    @abc.abstractmethod
    def _pinned_alloc(self, nbytes: int) -> int:
        """Allocate pinned host memory; its address."""

    @abc.abstractmethod
    def _pinned_free(self, ptr: int) -> None:
        ...

    @abc.abstractmethod
    def _copy_to_device_async(self, dst: int, src: int, nbytes: int) -> None:
        """Queue a copy from pinned host memory to the device on the device's stream."""

    @abc.abstractmethod
    def _copy_to_host_async(self, dst: int, src: int, nbytes: int) -> None:
        """Queue a copy from the device to pinned host memory on the device's stream."""

    @abc.abstractmethod
    def _sync_stream(self) -> None:
        """Wait for everything queued on the device's stream (kernels included)."""

    # ---- the copies -------------------------------------------------------------------------------
    def _stage(self, nbytes: int) -> tuple[int, int]:
        want = min(STAGING_BYTES, max(nbytes, 1 << 20))
        if self._staging_size < want:
            if self._staging:
                self._pinned_free(self._staging)
                self._staging, self._staging_size = 0, 0
            self._staging = int(self._pinned_alloc(want))
            self._staging_size = want
        return self._staging, self._staging_size

    def copyin(self, handle: int, src: np.ndarray) -> None:
        src = np.ascontiguousarray(src)
        total = src.nbytes
        if not total:
            return
        with self._copy_lock:
            self._make_current()
            stage, size = self._stage(total)
            base = src.ctypes.data
            for off in range(0, total, size):
                n = min(size, total - off)
                # the previous chunk's copy must be done before the staging buffer is rewritten
                self._sync_stream()
                ctypes.memmove(stage, base + off, n)
                self._copy_to_device_async(handle + off, stage, n)
            self._sync_stream()

    def copyout(self, dst: np.ndarray, handle: int) -> None:
        if not dst.flags.c_contiguous:
            raise ArgumentError("copyout needs a C-contiguous destination array")
        total = dst.nbytes
        if not total:
            return
        with self._copy_lock:
            self._make_current()
            stage, size = self._stage(total)
            base = dst.ctypes.data
            for off in range(0, total, size):
                n = min(size, total - off)
                self._copy_to_host_async(stage, handle + off, n)
                self._sync_stream()      # also waits for the kernels queued before the copy
                ctypes.memmove(base + off, stage, n)

    def close_staging(self) -> None:
        """Free the staging buffer, ignoring errors (the context may already be gone)."""
        if self._staging:
            try:
                self._pinned_free(self._staging)
            except Exception:
                pass
            self._staging, self._staging_size = 0, 0
