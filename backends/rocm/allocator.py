"""Device memory through `hipMalloc` (never managed memory), with the core allocator's cache of
freed blocks and its free-and-retry on out-of-memory. Host copies go through a pinned staging
buffer (hipHostMalloc); device-to-device copies use peer copies between ROCm devices."""
from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING

import numpy as np

from morok_py.device import Allocator

from .runtime import check, hip_module

if TYPE_CHECKING:
    from .device import ROCMDevice

STAGING_BYTES = 16 << 20     # pinned host memory per device; larger copies go through it in chunks


class HIPAllocator(Allocator):
    def __init__(self, device: "ROCMDevice") -> None:
        super().__init__(device.name)
        self.device = device
        self._hip = hip_module()
        self._staging = 0
        self._staging_size = 0
        self._copy_lock = threading.Lock()
        self._peers: set[int] = set()

    # -- memory -------------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> int:
        hip = self._hip
        self.device.make_current()
        err, ptr = hip.hipMalloc(nbytes)
        if err == hip.hipError_t.hipErrorOutOfMemory:
            free, total = self.device.mem_info()
            raise MemoryError(f"hipMalloc({nbytes}) returned hipErrorOutOfMemory "
                              f"({free} of {total} bytes free on the device)")
        check((err, ptr), f"hipMalloc({nbytes})")
        return int(ptr)

    def _free(self, handle: int, nbytes: int) -> None:
        if self.device.closed:
            return
        self.device.make_current()
        check(self._hip.hipFree(handle), "hipFree")

    # -- host copies --------------------------------------------------------------------------
    def _stage(self, nbytes: int) -> tuple[int, int]:
        hip = self._hip
        want = min(STAGING_BYTES, max(nbytes, 1 << 20))
        if self._staging_size < want:
            if self._staging:
                check(hip.hipHostFree(self._staging), "hipHostFree")
                self._staging, self._staging_size = 0, 0
            self._staging = int(check(hip.hipHostMalloc(want, 0), "hipHostMalloc"))
            self._staging_size = want
        return self._staging, self._staging_size

    def copyin(self, handle: int, src: np.ndarray) -> None:
        src = np.ascontiguousarray(src)
        total = src.nbytes
        if not total:
            return
        hip, dev = self._hip, self.device
        kind = hip.hipMemcpyKind.hipMemcpyHostToDevice
        with self._copy_lock:
            dev.make_current()
            stage, size = self._stage(total)
            base = src.ctypes.data
            for off in range(0, total, size):
                n = min(size, total - off)
                # the previous chunk's copy must be done before the staging buffer is rewritten
                check(hip.hipStreamSynchronize(dev.stream), "hipStreamSynchronize")
                ctypes.memmove(stage, base + off, n)
                check(hip.hipMemcpyAsync(handle + off, stage, n, kind, dev.stream), "hipMemcpyAsync(HtoD)")
            check(hip.hipStreamSynchronize(dev.stream), "hipStreamSynchronize")

    def copyout(self, dst: np.ndarray, handle: int) -> None:
        if not dst.flags.c_contiguous:
            raise ValueError("copyout needs a C-contiguous destination array")
        total = dst.nbytes
        if not total:
            return
        hip, dev = self._hip, self.device
        kind = hip.hipMemcpyKind.hipMemcpyDeviceToHost
        with self._copy_lock:
            dev.make_current()
            stage, size = self._stage(total)
            base = dst.ctypes.data
            for off in range(0, total, size):
                n = min(size, total - off)
                check(hip.hipMemcpyAsync(stage, handle + off, n, kind, dev.stream), "hipMemcpyAsync(DtoH)")
                check(hip.hipStreamSynchronize(dev.stream), "hipStreamSynchronize")
                ctypes.memmove(base + off, stage, n)

    # -- device to device ---------------------------------------------------------------------
    def transfer(self, dst: int, src: int, nbytes: int, src_allocator: Allocator) -> None:
        if not isinstance(src_allocator, HIPAllocator):
            raise NotImplementedError("ROCm transfers need a ROCm source")
        if not nbytes:
            return
        hip = self._hip
        sdev, ddev = src_allocator.device, self.device
        sdev.synchronize()            # the source's producers are done
        ddev.make_current()
        if sdev is ddev:
            check(hip.hipMemcpyAsync(dst, src, nbytes, hip.hipMemcpyKind.hipMemcpyDeviceToDevice, ddev.stream),
                  "hipMemcpyAsync(DtoD)")
        else:
            self._enable_peer(sdev)
            # direct over xGMI/PCIe when peer access is on, else HIP stages it through the host
            check(hip.hipMemcpyPeerAsync(dst, ddev.ordinal, src, sdev.ordinal, nbytes, ddev.stream),
                  "hipMemcpyPeerAsync")
        check(hip.hipStreamSynchronize(ddev.stream), "hipStreamSynchronize")

    def _enable_peer(self, src_dev: "ROCMDevice") -> bool:
        key = src_dev.ordinal
        if key in self._peers:
            return True
        hip = self._hip
        can = check(hip.hipDeviceCanAccessPeer(self.device.ordinal, key), "hipDeviceCanAccessPeer")
        if not can:
            return False
        self.device.make_current()
        (err,) = hip.hipDeviceEnablePeerAccess(key, 0)
        if err not in (hip.hipError_t.hipSuccess, hip.hipError_t.hipErrorPeerAccessAlreadyEnabled):
            check((err,), "hipDeviceEnablePeerAccess")
        self._peers.add(key)
        return True

    def peer_enabled(self, src_dev: "ROCMDevice") -> bool:
        return src_dev.ordinal in self._peers

    def close(self) -> None:
        if self._staging:
            try:
                self._hip.hipHostFree(self._staging)
            except Exception:
                pass
            self._staging, self._staging_size = 0, 0
