"""Buffers: typed device memory with copies to and from numpy."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from . import dlpack as D
from .dtypes import DType, as_dtype, from_numpy
from .errors import ArgumentError, ArgumentTypeError, BufferFreedError

if TYPE_CHECKING:
    from .device import Device


# DLPack device types a Buffer can view, by the registry's device type
_DLPACK_DEVICES = {D.CPU: "CPU", D.CUDA: "CUDA", D.ROCM: "ROCM"}
# the lock of every view of another library's memory (free and exports of a view are rare and short)
_VIEW_LOCK = threading.Lock()
_registry_get_device = None     # registry.get_device, imported at the first from_dlpack (the registry imports us)


def _foreign(kind: int) -> str:
    return (f"the tensor lives in {D.DEVICE_NAMES.get(kind, f'device type {kind}')} memory; "
            f"a Buffer views CPU, CUDA or ROCM device memory (copy it to one first)")


# The two DLPack caches below are read without a lock (a dict read is atomic) and filled under this one.
_CACHE_LOCK = threading.Lock()

# (device, dtype name) -> (the dtype, DLPack device, DLPack (code, bits), the device's dlpack_sync or None):
# what every export of such a buffer needs, checked once. Keyed by the name because a DType's dataclass
# hash is Python code (a microsecond an export); the entry holds its dtype, and another one is looked up anew.
_EXPORTS: "dict[tuple[Device, str], tuple]" = {}


def _export_info(device: "Device", dtype: DType) -> tuple:
    spec = device.spec
    kind = D.DEVICE_TYPES.get(spec.type)
    if kind is None:
        raise D.DLPackError(f"{device.name} memory has no DLPack device type")
    info = (dtype, (kind, 0 if kind == D.CPU else spec.ordinal), D.code_bits(dtype),
            getattr(device, "dlpack_sync", None))
    with _CACHE_LOCK:
        if len(_EXPORTS) < 1024 and (device, dtype.name) not in _EXPORTS:
            _EXPORTS[(device, dtype.name)] = info
    return info


# (DLPack device type, id) -> (the Device, its dlpack_imported or None): the registry keeps every device
# it opened, so an import looks its device up once
_OPENED: "dict[tuple[int, int], tuple[Device, Any]]" = {}


def _open_for_import(kind: int, ordinal: int) -> "tuple[Device, Any]":
    name = _DLPACK_DEVICES.get(kind)
    if name is None:
        raise D.DLPackError(_foreign(kind))
    get_device = _registry_get_device or _load_get_device()
    dev = get_device("CPU:0" if kind == D.CPU else f"{name}:{ordinal}")
    opened = (dev, None if kind == D.CPU else getattr(dev, "dlpack_imported", None))
    with _CACHE_LOCK:
        if len(_OPENED) < 64:
            opened = _OPENED.setdefault((kind, ordinal), opened)
    return opened


def _load_get_device():
    global _registry_get_device
    from .registry import get_device
    _registry_get_device = get_device
    return get_device


class _Parent:
    """The owner of a view of another Buffer: keeps that buffer alive; releasing it frees nothing."""
    __slots__ = ("buffer",)

    def __init__(self, buffer: "Buffer") -> None:
        self.buffer = buffer

    def release(self) -> None:
        self.buffer = None


class Buffer:
    """`size` elements of `dtype` on `device`; freed back to the allocator's cache when dropped."""

    def __init__(self, device: "Device", size: int, dtype: DType) -> None:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
            raise ArgumentError(f"buffer size must be a non-negative int, got {size!r}")
        self.device = device
        self.size = int(size)
        self.dtype = as_dtype(dtype)
        self.nbytes = self.size * self.dtype.itemsize
        self._ptr: int | None = device.allocator.alloc(self.nbytes)
        self._lock = threading.Lock()

    # (dict, key) of remembered checked launches that used this buffer: dropped when it is freed
    _forget: "list[tuple[dict, object]] | None" = None
    # memory another library owns (a DLPack import): released instead of freed
    _owner: Any = None
    # DLPack exports not yet released by their consumers; a free() meanwhile waits for the last one
    _exports = 0
    _free_pending = False

    @property
    def ptr(self) -> int:
        if self._ptr is None:
            raise BufferFreedError(f"{self!r} was freed")
        return self._ptr

    def forget_on_free(self, table: dict, key: object) -> None:
        """Drop `table[key]` when this buffer is freed (a remembered launch check that used it)."""
        forget = self._forget
        if forget is None:
            forget = self._forget = []
        elif len(forget) >= 64:     # entries their tables already dropped, and repeats
            live = {(id(t), k): (t, k) for t, k in forget if k in t}
            forget[:] = live.values()
        forget.append((table, key))

    def same_memory(self, other: "Buffer") -> bool:
        """Whether the two buffers share a byte (views of one allocation may overlap without one
        pointer being the other's)."""
        if other is self:
            return True
        if other.device is not self.device:
            return False
        a, b = self._ptr, other._ptr
        return a == b or (a is not None and b is not None and a < b + other.nbytes and b < a + self.nbytes)

    VIEW_ALIGN = 16     # bytes: kernels load vectors that assume it (as from_dlpack requires)

    def view(self, offset: int, size: int, dtype: "DType | None" = None) -> "Buffer":
        """`size` elements of `dtype` (default: this buffer's) at byte `offset` of this buffer's memory,
        zero-copy: a memory plan's buffers are views of one arena. The view keeps this buffer alive and
        launches check their index bounds against the view's own size; freeing the view leaves the
        memory to this buffer (freeing this buffer first leaves the view dangling)."""
        dt = self.dtype if dtype is None else as_dtype(dtype)
        for what, v in (("offset", offset), ("size", size)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ArgumentError(f"view {what} must be a non-negative int, got {v!r}")
        offset, size = int(offset), int(size)
        if offset % self.VIEW_ALIGN:
            raise ArgumentError(f"view offset {offset} is not a multiple of {self.VIEW_ALIGN} bytes")
        if offset + size * dt.itemsize > self.nbytes:
            raise ArgumentError(f"a view of {dt.name}[{size}] at byte {offset} ends past {self!r} "
                                f"({self.nbytes} bytes)")
        return Buffer._view(self.device, size, dt, self.ptr + offset, _Parent(self))

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
            raise ArgumentTypeError(f"copyin of a {arr.dtype} array into a {self.dtype.name} buffer; "
                                    f"convert it first (array.astype({want.name!r}))")
        if arr.size != self.size:
            raise ArgumentError(f"copyin of {arr.size} element(s) into a buffer of {self.size}")
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
            raise ArgumentError(f"copy_to needs the same dtype and size: {self.dtype.name}[{self.size}] -> "
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
        """Give the memory back (an imported tensor: release it to its producer). While a DLPack
        consumer still views the memory, the buffer is unusable here at once and the memory goes when
        the last consumer lets go."""
        with self._lock:
            if self._ptr is None:
                return
            ptr, self._ptr = self._ptr, None
            forget = self._forget
            if forget is not None:
                self._forget = None
            if self._exports:
                self._free_pending, self._held_ptr = True, ptr
                ptr = None
        for table, key in forget or ():
            table.pop(key, None)
        if ptr is not None:
            self._release(ptr)

    def _release(self, ptr: int) -> None:
        owner = self._owner
        if owner is not None:
            self._owner = None
            owner.release()
        else:
            self.device.allocator.free(ptr, self.nbytes)

    # ---- DLPack -------------------------------------------------------------------------------------
    def __dlpack_device__(self) -> tuple[int, int]:
        """(DLPack device type, device id): kDLCPU, kDLCUDA or kDLROCM and the ordinal."""
        spec = self.device.spec
        kind = D.DEVICE_TYPES.get(spec.type)
        if kind is None:
            raise D.DLPackError(f"{self.device.name} memory has no DLPack device type")
        return kind, 0 if kind == D.CPU else spec.ordinal

    def __dlpack__(self, *, stream: Any = None, max_version: "tuple[int, int] | None" = None,
                   dl_device: "tuple[int, int] | None" = None, copy: "bool | None" = None) -> Any:
        """Export as a DLPack capsule, zero-copy (the array API's protocol). `stream` is the consumer's:
        on a GPU the producer's queued work is made to finish before anything queued on it later
        (CUDA: None = the legacy default stream, 1 legacy, 2 per-thread, -1 no synchronization, 0
        refused; ROCm: None or 0 the default stream). The buffer stays alive while the capsule or the
        consumer's view does. `copy=True` exports a copy; `dl_device=(kDLCPU, 0)` from a GPU copies
        to the host unless `copy=False`."""
        dtype = self.dtype
        info = _EXPORTS.get((self.device, dtype.name))
        if info is None or info[0] is not dtype:
            info = _export_info(self.device, dtype)
        _, here, code_bits, sync = info
        src = self
        if dl_device is not None or copy:
            src = self._export_source(here, dl_device, copy)
            if src is not self:
                _, here, code_bits, sync = _export_info(src.device, src.dtype)
        if stream is not None:
            if sync is None:
                if stream != -1:
                    raise D.DLPackError(f"{src.device.name} buffers take stream=None, got stream={stream!r}")
            elif isinstance(stream, bool) or not isinstance(stream, int):
                raise D.DLPackError(f"stream must be an int (a stream handle) or None, got {stream!r}")
        with src._lock:         # the pointer and the export count together: a free() waits for the export
            ptr = src._ptr
            if ptr is None:
                raise BufferFreedError(f"{src!r} was freed")
            src._exports += 1
        try:
            if sync is not None:
                sync(stream)
            return D.export_fast(ptr, src.size, code_bits, here, src,
                                 max_version is not None and max_version[0] >= 1, src is not self,
                                 src._export_released)
        except BaseException:
            src._export_released()
            raise

    def _export_source(self, here: tuple[int, int], dl_device: Any, copy: "bool | None") -> "Buffer":
        """The buffer an export with `dl_device` / `copy` hands out: this one, or a copy."""
        if dl_device is not None and tuple(dl_device) != here:
            want = tuple(dl_device)
            if copy is False:
                raise D.DLPackError(f"{self!r} lives on {self.device.name}, dl_device={want} asks for another "
                                    f"device, and copy=False forbids the copy that needs")
            if want[0] != D.CPU:
                raise D.DLPackError(f"{self!r} can be exported to {self.device.name} or copied to the CPU, "
                                    f"not to dl_device={want}")
            return self.to("CPU")
        if copy:
            return self.copy_to(Buffer(self.device, self.size, self.dtype))
        return self

    def _export_released(self) -> None:
        """A consumer let go of an export; the last one completes a free() that came meanwhile."""
        with self._lock:
            self._exports -= 1
            ptr = self.__dict__.pop("_held_ptr", None) if self._free_pending and not self._exports else None
        if ptr is not None:
            self._release(ptr)

    @staticmethod
    def from_dlpack(obj: Any) -> "Buffer":
        """A Buffer viewing another library's tensor (numpy, PyTorch, CuPy, JAX...), zero-copy: writes
        through either side are seen by the other. The tensor must be contiguous, writable, on a
        morok_py device (CPU, CUDA:n, ROCM:n), of a dtype the IR knows and 16-byte aligned (vector
        loads assume it). The producer keeps the memory alive until the buffer is freed or collected;
        on a GPU the producer's pending work is ordered before this device's stream: before its next use
        (a launch, copy, synchronize, export...), not during the import (launch.StreamMarks).

        A producer whose type carries DLPack's C exchange API (`__dlpack_c_exchange_api__`, PyTorch
        2.10+) hands its tensor over in one C call, unsynchronized, and names its current stream, which
        this device's stream is then ordered after; any other producer goes through `__dlpack__`, asked
        to order its work before this device's DLPack stream (`dlpack_stream`)."""
        tp = type(obj)
        known = D._exchange_apis.get(id(tp))     # (dlpack.exchange_api's cache, read inline: once per call)
        api = known[1] if known is not None and known[0]() is tp else D.exchange_api(tp)
        if api is not None and getattr(obj, "requires_grad", False) is not True:
            # (a tensor that requires grad goes through __dlpack__, which refuses it as its producer decides)
            imported = D.Imported.exchange(obj, api)
            try:
                place = imported.device
                opened = _OPENED.get(place)
                if opened is None:
                    opened = _open_for_import(*place)
                dev, after = opened
                if after is not None:
                    # the exchange is unsynchronized: this device's stream waits for the producer's current
                    # one, lazily (remembered, ordered at its next use) for PyTorch, whose streams are never
                    # destroyed; at once for a producer whose stream might be gone by then
                    raw = api.raw_stream     # (ExchangeAPI.current_stream, its shortcut inline; PyTorch's alone)
                    if raw is not None:
                        try:
                            stream = raw(place[1])
                        except Exception:
                            stream = None
                        after(stream if type(stream) is int and stream >= 0 else api.current_stream(*place))
                    else:
                        after(api.current_stream(*place))
                        order = getattr(dev, "order_imports", None)
                        if order is not None:
                            order()
                elif place[0] != D.CPU:     # no way to order this device after the producer: the handshake does
                    imported.release()
                    imported = None
                if imported is not None:
                    ptr = imported.ptr
                    if ptr % 16:
                        return Buffer._imported_view(dev, imported)     # (refused there, with the reason)
                    buf = object.__new__(Buffer)        # Buffer._view, inline
                    buf.device, buf.size, buf.dtype, buf.nbytes = dev, imported.count, imported.dtype, \
                        imported.count * imported.dtype.itemsize
                    buf._lock, buf._owner, buf._ptr = _VIEW_LOCK, imported, ptr
                    return buf
            except BaseException:
                if imported is not None:
                    imported.release()
                raise
        get_device = _registry_get_device or _load_get_device()
        try:
            kind, ordinal = obj.__dlpack_device__()
        except AttributeError:
            if not hasattr(obj, "__dlpack__") or not hasattr(obj, "__dlpack_device__"):
                raise D.DLPackError(f"{type(obj).__name__} does not speak DLPack (no __dlpack__/__dlpack_device__)") \
                    from None
            raise
        name = _DLPACK_DEVICES.get(kind)
        if name is None:
            raise D.DLPackError(_foreign(int(kind)))
        kind, ordinal = int(kind), int(ordinal)
        dev = get_device(f"{name}:{0 if kind == D.CPU else ordinal}")
        stream_of = getattr(dev, "dlpack_stream", None)
        stream = stream_of() if stream_of is not None else None
        after = getattr(dev, "dlpack_imported", None)
        # a producer that names its stream exports without the handshake; this device orders itself after it
        produced_on = D.producer_stream(obj, kind, ordinal) if after is not None else None
        if produced_on is not None:
            stream = -1
        try:
            try:
                capsule = obj.__dlpack__(stream=stream, max_version=D.VERSION)
            except TypeError:      # a producer older than DLPack 1.0 takes no max_version
                capsule = obj.__dlpack__(stream=stream)
        except BufferError as e:
            if isinstance(e, D.DLPackError):
                raise
            raise D.DLPackError(f"{type(obj).__name__} refused to export: {e}") from e
        imported = D.Imported(capsule)
        try:
            if after is not None:       # the device's stream waits for the one the producer ordered
                # (lazily: the legacy default stream, or PyTorch's current one; neither goes away)
                after(produced_on)
            if imported.device != (kind, ordinal):
                raise D.DLPackError(f"the capsule's device {imported.device} is not the {(kind, ordinal)} "
                                    f"that __dlpack_device__ said")
            return Buffer._imported_view(dev, imported)
        except BaseException:
            imported.release()
            raise

    @staticmethod
    def _imported_view(dev: "Device", imported: Any) -> "Buffer":
        if imported.ptr % 16:
            raise D.DLPackError(f"the tensor's data at {imported.ptr:#x} is not 16-byte aligned; kernels "
                                f"load vectors that assume it (pass a copy, e.g. numpy.array(x, copy=True))")
        return Buffer._view(dev, imported.count, imported.dtype, imported.ptr, imported)

    @staticmethod
    def _view(device: "Device", size: int, dtype: DType, ptr: int, owner: Any) -> "Buffer":
        """A Buffer over memory `owner` keeps alive; free() calls `owner.release()`."""
        buf = object.__new__(Buffer)
        buf.device, buf.size, buf.dtype = device, int(size), dtype
        buf.nbytes = buf.size * dtype.itemsize
        buf._lock = _VIEW_LOCK
        buf._owner = owner
        buf._ptr = ptr
        return buf

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<Buffer {self.device.name} {self.dtype.name}[{self.size}]>"
