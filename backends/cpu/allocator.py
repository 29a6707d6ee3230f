"""Host memory: 64-byte aligned blocks from posix_memalign, cached by size when freed."""
from __future__ import annotations

import ctypes
import ctypes.util
import errno

from morok_py.device import Allocator

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
_libc.posix_memalign.restype = ctypes.c_int
_libc.free.argtypes = [ctypes.c_void_p]
_libc.free.restype = None

ALIGN = 64


class HostAllocator(Allocator):
    host_memory = True

    def __init__(self, device_name: str = "CPU") -> None:
        super().__init__(device_name)

    def _alloc(self, nbytes: int) -> int:
        out = ctypes.c_void_p()
        rc = _libc.posix_memalign(ctypes.byref(out), ALIGN, nbytes)
        if rc == errno.ENOMEM or (rc == 0 and not out.value):
            raise MemoryError(f"posix_memalign({nbytes}) returned ENOMEM")
        if rc != 0:
            raise OSError(rc, f"posix_memalign({nbytes}) failed")
        return int(out.value)

    def _free(self, handle: int, nbytes: int) -> None:
        _libc.free(handle)

    def copyin(self, handle: int, src) -> None:
        ctypes.memmove(handle, src.ctypes.data, src.nbytes)

    def copyout(self, dst, handle: int) -> None:
        ctypes.memmove(dst.ctypes.data, handle, dst.nbytes)

    def transfer(self, dst: int, src: int, nbytes: int, src_allocator: Allocator) -> None:
        if not isinstance(src_allocator, HostAllocator):
            raise NotImplementedError("host transfer needs a host source")
        ctypes.memmove(dst, src, nbytes)
