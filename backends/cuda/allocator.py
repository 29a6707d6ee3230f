"""Device memory through `cuMemAlloc` (never managed memory), with the core allocator's cache of
freed blocks and its free-and-retry on out-of-memory. Host copies go through a pinned staging
buffer on the device's stream; device-to-device copies use peer copies where the GPUs allow."""
from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING

import numpy as np
from cuda.bindings import driver as cu

from morok_py.device import Allocator

from .runtime import check, error_text

if TYPE_CHECKING:
    from .device import CUDADevice

STAGING_BYTES = 16 << 20     # pinned host memory per device; larger copies go through it in chunks


class CUDAAllocator(Allocator):
    def __init__(self, device: "CUDADevice") -> None:
        super().__init__(device.name)
        self.device = device
        self._staging = 0
        self._staging_size = 0
        self._copy_lock = threading.Lock()
        self._peers: set[int] = set()

    # -- memory -------------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> int:
        self.device.make_current()
        err, ptr = cu.cuMemAlloc(nbytes)
        if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            free, total = self.device.mem_info()
            raise MemoryError(f"cuMemAlloc({nbytes}) returned CUDA_ERROR_OUT_OF_MEMORY "
                              f"({free} of {total} bytes free on the device)")
        check((err, ptr), f"cuMemAlloc({nbytes})")
        return int(ptr)

    def _free(self, handle: int, nbytes: int) -> None:
        if self.device.closed:
            return
        self.device.make_current()
        check(cu.cuMemFree(handle), "cuMemFree")

    # -- host copies --------------------------------------------------------------------------
    def _stage(self, nbytes: int) -> tuple[int, int]:
        want = min(STAGING_BYTES, max(nbytes, 1 << 20))
        if self._staging_size < want:
            if self._staging:
                check(cu.cuMemFreeHost(self._staging), "cuMemFreeHost")
                self._staging, self._staging_size = 0, 0
            self._staging = int(check(cu.cuMemHostAlloc(want, 0), "cuMemHostAlloc"))
            self._staging_size = want
        return self._staging, self._staging_size

    def copyin(self, handle: int, src: np.ndarray) -> None:
        src = np.ascontiguousarray(src)
        total = src.nbytes
        if not total:
            return
        dev = self.device
        with self._copy_lock:
            dev.make_current()
            stage, size = self._stage(total)
            base = src.ctypes.data
            for off in range(0, total, size):
                n = min(size, total - off)
                # the previous chunk's copy must be done before the staging buffer is rewritten
                check(cu.cuStreamSynchronize(dev.stream), "cuStreamSynchronize")
                ctypes.memmove(stage, base + off, n)
                check(cu.cuMemcpyHtoDAsync(handle + off, stage, n, dev.stream), "cuMemcpyHtoDAsync")
            check(cu.cuStreamSynchronize(dev.stream), "cuStreamSynchronize")

    def copyout(self, dst: np.ndarray, handle: int) -> None:
        if not dst.flags.c_contiguous:
            raise ValueError("copyout needs a C-contiguous destination array")
        total = dst.nbytes
        if not total:
            return
        dev = self.device
        with self._copy_lock:
            dev.make_current()
            stage, size = self._stage(total)
            base = dst.ctypes.data
            for off in range(0, total, size):
                n = min(size, total - off)
                check(cu.cuMemcpyDtoHAsync(stage, handle + off, n, dev.stream), "cuMemcpyDtoHAsync")
                check(cu.cuStreamSynchronize(dev.stream), "cuStreamSynchronize")   # also waits for kernels
                ctypes.memmove(base + off, stage, n)

    # -- device to device ---------------------------------------------------------------------
    def transfer(self, dst: int, src: int, nbytes: int, src_allocator: Allocator) -> None:
        if not isinstance(src_allocator, CUDAAllocator):
            raise NotImplementedError("CUDA transfers need a CUDA source")
        if not nbytes:
            return
        sdev, ddev = src_allocator.device, self.device
        sdev.synchronize()            # the source's producers are done
        ddev.make_current()
        if sdev is ddev:
            check(cu.cuMemcpyDtoDAsync(dst, src, nbytes, ddev.stream), "cuMemcpyDtoDAsync")
        else:
            self._enable_peer(sdev)
            # a peer copy goes over NVLink/PCIe directly when peer access is on, else via the host
            check(cu.cuMemcpyPeerAsync(dst, ddev.context, src, sdev.context, nbytes, ddev.stream),
                  "cuMemcpyPeerAsync")
        check(cu.cuStreamSynchronize(ddev.stream), "cuStreamSynchronize")

    def _enable_peer(self, src_dev: "CUDADevice") -> bool:
        key = src_dev.spec.ordinal
        if key in self._peers:
            return True
        can = check(cu.cuDeviceCanAccessPeer(self.device.handle, src_dev.handle), "cuDeviceCanAccessPeer")
        if not can:
            return False
        self.device.make_current()
        (err,) = cu.cuCtxEnablePeerAccess(src_dev.context, 0)
        if err not in (cu.CUresult.CUDA_SUCCESS, cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
            check((err,), "cuCtxEnablePeerAccess")
        self._peers.add(key)
        return True

    def peer_enabled(self, src_dev: "CUDADevice") -> bool:
        return src_dev.spec.ordinal in self._peers

    def close(self) -> None:
        if self._staging:
            try:
                cu.cuMemFreeHost(self._staging)
            except Exception:
                pass
            self._staging, self._staging_size = 0, 0


__all__ = ["CUDAAllocator", "error_text"]
