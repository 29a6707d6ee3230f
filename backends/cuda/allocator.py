"""Device memory through `cuMemAlloc` (never managed memory), with the core allocator's cache of
freed blocks and its free-and-retry on out-of-memory. Host copies go through a pinned staging
buffer on the device's stream; device-to-device copies use peer copies where the GPUs allow."""
from __future__ import annotations

from cuda.bindings import driver as cu

from morok_py.device import Allocator
from morok_py.staging import STAGING_BYTES, PinnedStaging

from .runtime import check, error_text



class CUDAAllocator(PinnedStaging, Allocator):
    def __init__(self, device: "CUDADevice") -> None:
        super().__init__(device.name)
        self.device = device
        self._init_staging()
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

    # -- host copies: the chunked loop is PinnedStaging's; these are its driver calls ----------
    def _make_current(self) -> None:
        self.device.make_current()

    def _pinned_alloc(self, nbytes: int) -> int:
        return int(check(cu.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc"))

    def _pinned_free(self, ptr: int) -> None:
        check(cu.cuMemFreeHost(ptr), "cuMemFreeHost")

    def _copy_to_device_async(self, dst: int, src: int, nbytes: int) -> None:
        check(cu.cuMemcpyHtoDAsync(dst, src, nbytes, self.device.stream), "cuMemcpyHtoDAsync")
        self.device.stream_used()

    def _copy_to_host_async(self, dst: int, src: int, nbytes: int) -> None:
        check(cu.cuMemcpyDtoHAsync(dst, src, nbytes, self.device.stream), "cuMemcpyDtoHAsync")
        self.device.stream_used()

    def _sync_stream(self) -> None:
        self.device.synchronize()

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
        ddev.stream_used()
        ddev.synchronize()

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
        self.close_staging()


__all__ = ["CUDAAllocator", "STAGING_BYTES", "error_text"]
