"""Buffers: typed device memory with copies to and from numpy."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from .dtypes import DType, as_dtype, from_numpy

if TYPE_CHECKING:
    from .device import Device


class Buffer:
    """`size` elements of `dtype` on `device`; freed back to the allocator's cache when dropped."""

    def __init__(self, device: "Device", size: int, dtype: DType) -> None:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
            raise ValueError(f"buffer size must be a non-negative int, got {size!r}")
        self.device = device
        self.size = int(size)
        self.dtype = as_dtype(dtype)
        self.nbytes = self.size * self.dtype.itemsize
        self._ptr: int | None = device.allocator.alloc(self.nbytes)
        self._lock = threading.Lock()

    # (dict, key) of remembered checked launches that used this buffer: dropped when it is freed
    _forget: "list[tuple[dict, object]] | None" = None

    @property
    def ptr(self) -> int:
        if self._ptr is None:
            raise ValueError("buffer was freed")
        return self._ptr

    def forget_on_free(self, table: dict, key: object) -> None:
        """Drop `table[key]` when this buffer is freed (a remembered launch check that used it)."""
        forget = self._forget
        if forget is None:
            forget = self._forget = []
        elif len(forget) >= 64:     # entries their tables already dropped
            forget[:] = [(t, k) for t, k in forget if k in t]
        forget.append((table, key))

    def same_memory(self, other: "Buffer") -> bool:
        return other is self or (other.device is self.device and other._ptr == self._ptr)

    @staticmethod
    def from_numpy(array: Any, device: "Device | str | None" = None) -> "Buffer":
        from .registry import get_device
        from .device import Device as _D
        dev = device if isinstance(device, _D) else get_device(device)
        arr = np.asarray(array)
        buf = Buffer(dev, arr.size, from_numpy(arr.dtype))
        return buf.copyin(arr)

    def copyin(self, array: Any) -> "Buffer":
        """Copy a numpy array of the same dtype and element count in; returns self."""
        arr = np.asarray(array)
        want = self.dtype.np
        if arr.dtype != want:
            raise TypeError(f"copyin of a {arr.dtype} array into a {self.dtype.name} buffer; "
                            f"convert it first (array.astype({want.name!r}))")
        if arr.size != self.size:
            raise ValueError(f"copyin of {arr.size} element(s) into a buffer of {self.size}")
        if self.nbytes:
            self.device.allocator.copyin(self.ptr, np.ascontiguousarray(arr).reshape(-1))
        return self

    def numpy(self) -> np.ndarray:
        out = np.empty(self.size, dtype=self.dtype.np)
        if self.nbytes:
            self.device.allocator.copyout(out, self.ptr)
        return out

    def copy_to(self, other: "Buffer") -> "Buffer":
        """Copy into `other` (same dtype and size), device to device where the allocator can."""
        if other.dtype != self.dtype or other.size != self.size:
            raise ValueError(f"copy_to needs the same dtype and size: {self.dtype.name}[{self.size}] -> "
                             f"{other.dtype.name}[{other.size}]")
        if not self.nbytes:
            return other
        try:
            other.device.allocator.transfer(other.ptr, self.ptr, self.nbytes, self.device.allocator)
        except NotImplementedError:
            other.copyin(self.numpy())
        return other

    def to(self, device: "Device | str") -> "Buffer":
        from .registry import get_device
        from .device import Device as _D
        dev = device if isinstance(device, _D) else get_device(device)
        return self.copy_to(Buffer(dev, self.size, self.dtype))

    def free(self) -> None:
        with self._lock:
            if self._ptr is not None:
                ptr, self._ptr = self._ptr, None
                forget, self._forget = self._forget, None
                for table, key in forget or ():
                    table.pop(key, None)
                self.device.allocator.free(ptr, self.nbytes)

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<Buffer {self.device.name} {self.dtype.name}[{self.size}]>"
