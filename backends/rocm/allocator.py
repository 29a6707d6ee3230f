"""Device memory through `hipMalloc` (never managed memory), with the core allocator's cache of
freed blocks and its free-and-retry on out-of-memory. Host copies go through a pinned staging
buffer (hipHostMalloc); device-to-device copies use peer copies between ROCm devices."""
from __future__ import annotations


from morok_py.device import Allocator
from morok_py.staging import STAGING_BYTES, PinnedStaging

from .runtime import check, hip_module



class HIPAllocator(PinnedStaging, Allocator):
    def __init__(self, device: "ROCMDevice") -> None:
        super().__init__(device.name)
        self.device = device
        self._hip = hip_module()
        self._init_staging()
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

    # -- host copies: the chunked loop is PinnedStaging's; these are its driver calls ----------
    def _make_current(self) -> None:
        self.device.make_current()

    def _pinned_alloc(self, nbytes: int) -> int:
        return int(check(self._hip.hipHostMalloc(nbytes, 0), "hipHostMalloc"))

    def _pinned_free(self, ptr: int) -> None:
        check(self._hip.hipHostFree(ptr), "hipHostFree")

    def _copy_to_device_async(self, dst: int, src: int, nbytes: int) -> None:
        hip = self._hip
        check(hip.hipMemcpyAsync(dst, src, nbytes, hip.hipMemcpyKind.hipMemcpyHostToDevice, self.device.stream),
              "hipMemcpyAsync(HtoD)")
        self.device.stream_used()

    def _copy_to_host_async(self, dst: int, src: int, nbytes: int) -> None:
        hip = self._hip
        check(hip.hipMemcpyAsync(dst, src, nbytes, hip.hipMemcpyKind.hipMemcpyDeviceToHost, self.device.stream),
              "hipMemcpyAsync(DtoH)")
        self.device.stream_used()

    def _sync_stream(self) -> None:
        check(self._hip.hipStreamSynchronize(self.device.stream), "hipStreamSynchronize")

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
        ddev.stream_used()
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
        self.close_staging()


__all__ = ["HIPAllocator", "STAGING_BYTES"]
