"""DLPack capsules through ctypes: export device memory to a consumer (numpy, PyTorch, CuPy, JAX)
and take in another library's tensor, zero-copy both ways. Knows pointers, dtypes and DLPack devices
only; `Buffer.__dlpack__` / `Buffer.from_dlpack` (buffer.py) hold the device and stream glue.

The structs follow dlpack.h (v1.x): DLManagedTensorVersioned in a "dltensor_versioned" capsule for a
consumer that asks for max_version >= (1, 0), the legacy DLManagedTensor in a "dltensor" capsule
otherwise. A consumer renames the capsule to "used_..." and calls the deleter when done; a capsule
nobody consumed calls it from its destructor. Either way the deleter runs exactly once."""
from __future__ import annotations

import ctypes
import struct
import sys
import threading
import weakref
from typing import Any, Callable

from .dtypes import DType, dtypes
from .errors import MorokError

# DLDeviceType
CPU, CUDA, CUDA_HOST, ROCM, ROCM_HOST, CUDA_MANAGED = 1, 2, 3, 10, 11, 13
DEVICE_TYPES = {"CPU": CPU, "CUDA": CUDA, "ROCM": ROCM}
DEVICE_NAMES = {CPU: "CPU", CUDA: "CUDA", CUDA_HOST: "CUDA host", ROCM: "ROCM", ROCM_HOST: "ROCM host",
                CUDA_MANAGED: "CUDA managed", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI", 12: "ExtDev",
                14: "oneAPI", 15: "WebGPU", 16: "Hexagon", 17: "MAIA"}
VERSION = (1, 0)
FLAG_READ_ONLY, FLAG_IS_COPIED = 1 << 0, 1 << 1

# DLDataTypeCode: int 0, uint 1, float 2, bfloat 4, bool 6
_CODES = {"i": 0, "u": 1, "f": 2, "b": 6}


class DLPackError(MorokError, BufferError):
    """A tensor cannot cross DLPack as asked: another device, a dtype or layout a Buffer cannot
    hold, read-only memory, or a stream the protocol forbids. A BufferError, as the protocol says."""


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


# The same layouts as struct formats (native alignment, as C lays them out): an export packs its
# managed tensor with one pack_into, an import reads one with one unpack. Each is checked against the
# ctypes structures above when this module loads.
_TENSOR = "PiiiBBHPPQ"                    # DLTensor: data, device (type, id), ndim, dtype, shape, strides, offset
_V_HEAD = struct.Struct("@IIPPQ" + _TENSOR)      # DLManagedTensorVersioned
_L_HEAD = struct.Struct("@" + _TENSOR + "PP")    # DLManagedTensor: the tensor, manager_ctx, deleter
# an export: the managed tensor, then its one-element shape and strides
_V_EXPORT = struct.Struct(_V_HEAD.format + "qq")
_L_EXPORT = struct.Struct(_L_HEAD.format + "qq")
for _s, _c in ((_V_HEAD, DLManagedTensorVersioned), (_L_HEAD, DLManagedTensor)):
    if _s.size != ctypes.sizeof(_c):
        raise ImportError(f"DLPack layout mismatch: {_s.format} is {_s.size} bytes, {_c.__name__} {ctypes.sizeof(_c)}")
if DLManagedTensorVersioned.dl_tensor.offset != struct.calcsize("@IIPPQ") or DLManagedTensor.deleter.offset != \
        struct.calcsize("@" + _TENSOR + "P"):
    raise ImportError("DLPack layout mismatch between the struct formats and the ctypes structures")

_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_NAME, _NAME_V = b"dltensor", b"dltensor_versioned"
_USED, _USED_V = b"used_dltensor", b"used_dltensor_versioned"

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# capsule names must outlive their capsules: module constants, never freed
_NAMES = {n: ctypes.c_char_p(n) for n in (_NAME, _NAME_V, _USED, _USED_V)}
_NAME_ADDRS = {ctypes.cast(v, ctypes.c_void_p).value: k for k, v in _NAMES.items()}
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", _api))
_capsule_new = _api.PyCapsule_New

# Reads of producer structs at known addresses, without a ctypes call each: one buffer over the address
# space, read by struct.unpack_from at an address (what ctypes.string_at does, at a sixth of the cost).
# Only addresses a capsule handed over are read, as string_at would.
_MEMORY = memoryview((ctypes.c_char * sys.maxsize).from_address(0)).cast("B")     # every user-space address
_ADDR = struct.Struct("@P")

def _capsule_layout() -> tuple[type, int, int]:
    """The capsule type and the byte offsets of a PyCapsule's pointer and name fields, found on a probe
    capsule (so another object header leaves them right): the capsule destructor reads both without
    a ctypes call."""
    probe_ptr, name = 0x5EED0, _NAMES[_USED]
    probe = _capsule_new(probe_ptr, name, None)
    name_addr = ctypes.cast(name, ctypes.c_void_p).value
    words = struct.unpack_from(f"@{type(probe).__basicsize__ // _ADDR.size}P", _MEMORY, id(probe))
    at = words.index(probe_ptr) if probe_ptr in words else -1
    if at < 0 or at + 1 >= len(words) or words[at + 1] != name_addr:
        raise ImportError("PyCapsule layout: no pointer field followed by the name field")
    return type(probe), at * _ADDR.size, (at + 1) * _ADDR.size


_CAPSULE, _CAP_PTR, _CAP_NAME = _capsule_layout()

# ---- the producer's own stream --------------------------------------------------------------------

def producer_stream(obj: Any, device_type: int, ordinal: int) -> "int | None":
    """The raw stream handle a GPU tensor's producer queues its work on, where the producer can say so
    without the protocol's handshake, else None. A consumer that knows it exports with stream=-1 (no
    synchronization) and orders its own stream after that one itself: the same ordering the producer
    would make, without its per-call cost. PyTorch: the current stream of the tensor's device
    (`torch._C._cuda_getCurrentRawStream`, 0 for the legacy default stream; HIP's under ROCm). Its
    `__dlpack__(stream=1)` makes Python stream objects to compare them, 19 us of a 37 us import on an
    H100 host against 3.4 us for stream=-1 (benchmarks/permute.py's dlpack_part_torch_export_*,
    benchmarks/results/nvidia-h100/permute-nvrtc.json)."""
    if device_type not in (CUDA, ROCM) or type(obj).__module__ != "torch":
        return None
    torch = sys.modules.get("torch")
    raw = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
    if raw is None:
        return None
    try:
        stream = raw(ordinal)
    except Exception:       # an older or unusual build: the protocol's handshake still works
        return None
    return stream if isinstance(stream, int) and stream >= 0 else None


# ---- export ---------------------------------------------------------------------------------------

_exports: dict[int, tuple] = {}    # managed tensor address -> (its memory, owner, on_release)


def _release_export(addr: int | None) -> None:
    """The deleter of every tensor we export: drops the struct and the owner it kept alive. (dict.pop is
    atomic: of two racing calls one gets the entry.)"""
    if not addr:
        return
    entry = _exports.pop(addr, None)
    if entry is not None and entry[2] is not None:
        entry[2]()


_deleter = _DELETER(_release_export)
_DELETER_ADDR = ctypes.cast(_deleter, ctypes.c_void_p).value


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule: int | None) -> None:
    """A capsule is being collected: if no consumer took it (its name is still unused), release
    the tensor here; a consumer that renamed it owns the deleter call."""
    if not capsule:
        return
    # still named by us (a consumer renames it with its own string): nobody took the tensor
    if _ADDR.unpack_from(_MEMORY, capsule + _CAP_NAME)[0] in _OUR_UNUSED:
        _release_export(_ADDR.unpack_from(_MEMORY, capsule + _CAP_PTR)[0])


_DESTRUCTOR_ADDR = ctypes.cast(_capsule_destructor, ctypes.c_void_p).value
# Both C entry points outlive this module: a capsule or a consumer's view held in a reference cycle is
# collected by the interpreter's last garbage collection, after module globals are gone, and calling a
# freed ctypes thunk then crashes the process. One reference each, never dropped, keeps them.
for _entry in (_deleter, _capsule_destructor):
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_entry))
_USED_ADDRS = {True: ctypes.cast(_NAMES[_USED_V], ctypes.c_void_p).value,
               False: ctypes.cast(_NAMES[_USED], ctypes.c_void_p).value}
_OUR_UNUSED = frozenset(a for a, n in _NAME_ADDRS.items() if n in (_NAME, _NAME_V))
_V_MEM = ctypes.c_char * _V_EXPORT.size      # the array types of an export's memory, made once
_L_MEM = ctypes.c_char * _L_EXPORT.size
_V_NAME, _L_NAME = _NAMES[_NAME_V], _NAMES[_NAME]
_V_SHAPE_AT, _L_SHAPE_AT = _V_HEAD.size, _L_HEAD.size
_addressof = ctypes.addressof


def dtype_code(dt: DType) -> tuple[int, int]:
    if dt.name == "bfloat16":
        return 4, 16
    code = _CODES.get(dt.kind)
    if code is None:
        raise DLPackError(f"{dt.name} has no DLPack type code")
    return code, 8 if dt.kind == "b" else dt.itemsize * 8


def code_bits(dt: DType) -> tuple[int, int]:
    """DLPack's (type code, bits) of `dt`; DLPackError for a dtype it has none for."""
    cb = _CODE_BITS.get(dt)
    return cb if cb is not None else dtype_code(dt)


def export(ptr: int, count: int, dt: DType, device: tuple[int, int], owner: Any, *, versioned: bool,
           read_only: bool = False, copied: bool = False,
           on_release: Callable[[], None] | None = None) -> Any:
    """A capsule for the 1-D tensor of `count` elements at `ptr`. `owner` stays referenced until the
    consumer's deleter runs (or the unconsumed capsule is collected); then `on_release()` is called."""
    if read_only and not versioned:
        raise DLPackError("a read-only tensor needs the versioned DLPack capsule (max_version >= (1, 0))")
    return export_fast(ptr, count, code_bits(dt), device, owner, versioned, copied, on_release, read_only)


def export_fast(ptr: int, count: int, code_bits: tuple[int, int], device: tuple[int, int], owner: Any,
                versioned: bool, copied: bool, on_release: "Callable[[], None] | None",
                read_only: bool = False) -> Any:
    """`export` with the dtype's (code, bits) already looked up (Buffer.__dlpack__ caches them per dtype)."""
    code, bits = code_bits
    if versioned:
        mem = _V_MEM()
        addr = _addressof(mem)
        shape = addr + _V_SHAPE_AT
        _V_EXPORT.pack_into(mem, 0, VERSION[0], VERSION[1], addr, _DELETER_ADDR,
                            (FLAG_IS_COPIED if copied else 0) | (FLAG_READ_ONLY if read_only else 0), ptr or 0,
                            device[0], device[1], 1, code, bits, 1, shape, shape + 8, 0, count, 1)
        name = _V_NAME
    else:
        mem = _L_MEM()
        addr = _addressof(mem)
        shape = addr + _L_SHAPE_AT
        _L_EXPORT.pack_into(mem, 0, ptr or 0, device[0], device[1], 1, code, bits, 1, shape, shape + 8, 0,
                            addr, _DELETER_ADDR, count, 1)
        name = _L_NAME
    _exports[addr] = (mem, owner, on_release)
    try:
        return _capsule_new(addr, name, _DESTRUCTOR_ADDR)
    except BaseException:
        _release_export(addr)
        raise


def live_exports() -> int:
    """How many exported tensors no consumer has released yet (for tests and leak hunts)."""
    return len(_exports)


# ---- import ---------------------------------------------------------------------------------------

def dtype_of(code: int, bits: int, lanes: int) -> DType:
    dt = _DTYPES.get((code, bits, lanes))
    return dt if dt is not None else _dtype_of(code, bits, lanes)


def _dtype_of(code: int, bits: int, lanes: int) -> DType:
    if lanes != 1:
        raise DLPackError(f"vector elements ({lanes} lanes) are not supported; a Buffer holds scalars")
    kind = {0: "i", 1: "u", 2: "f", 6: "b"}.get(code)
    if code == 4 and bits == 16:
        return dtypes.bfloat16
    if kind == "b" and bits == 8:
        return dtypes.bool
    if kind is not None and kind != "b":
        name = {"i": "int", "u": "uint", "f": "float"}[kind] + str(bits)
        dt = getattr(dtypes, name, None)
        if isinstance(dt, DType):
            return dt
    what = {3: "opaque handle", 5: "complex"}.get(code, f"type code {code}")
    raise DLPackError(f"DLPack dtype ({what}, {bits} bits) has no morok_py dtype")


_release_lock = threading.Lock()     # one for every import: release() runs a deleter once
# this module's caches (_DIMS, _deleters, _exchange_apis) are read without a lock (a dict read is
# atomic) and filled under this one
_cache_lock = threading.Lock()
_DIMS: dict[int, struct.Struct] = {}


def _dims(ndim: int) -> struct.Struct:
    """The struct of `ndim` int64 values (a shape or strides array), made once per ndim."""
    s = _DIMS.get(ndim)
    if s is None:
        if ndim > 64:
            raise DLPackError(f"a tensor of {ndim} dimensions is not supported")
        with _cache_lock:
            s = _DIMS.setdefault(ndim, struct.Struct(f"@{ndim}q"))
    return s


# every dtype that crosses DLPack, by (code, bits, lanes): an import looks its dtype up once
_DTYPES: dict[tuple[int, int, int], DType] = {}
for _dt in vars(dtypes).values():
    if isinstance(_dt, DType) and not _dt.storage_only:
        try:
            _code, _bits = dtype_code(_dt)
        except DLPackError:
            continue
        if _dtype_of(_code, _bits, 1) is _dt:
            _DTYPES[(_code, _bits, 1)] = _dt


_deleters: dict[int, Any] = {}     # a producer's deleter address -> its ctypes function (made once)


class Imported:
    """A consumed DLPack tensor: its data pointer, element count, dtype and device. `release()` calls
    the producer's deleter (once); until then the producer keeps the memory alive."""

    __slots__ = ("versioned", "device", "dtype", "shape", "count", "ptr", "flags", "_managed", "_deleter")

    def __init__(self, capsule: Any) -> None:
        self._managed = None
        if type(capsule) is not _CAPSULE:
            raise DLPackError("not an unconsumed DLPack capsule (a capsule is consumed once)")
        cname = _capsule_name(capsule)
        if cname == _NAME_V:
            versioned = True
        elif cname == _NAME:
            versioned = False
        else:
            raise DLPackError("not an unconsumed DLPack capsule (a capsule is consumed once)")
        addr = _ADDR.unpack_from(_MEMORY, id(capsule) + _CAP_PTR)[0]
        if not addr:
            raise DLPackError("the DLPack capsule holds no tensor")
        # checks first: a refused capsule stays unconsumed, so its own destructor releases the tensor
        deleter = self._read(addr, versioned)
        # consumed: the capsule's name field now points at our "used_" constant (what PyCapsule_SetName does
        # after checking the capsule, which type() and the name read above did)
        _ADDR.pack_into(_MEMORY, id(capsule) + _CAP_NAME, _USED_ADDRS[versioned])
        self._own(addr, deleter)

    @classmethod
    def exchange(cls, obj: Any, api: "ExchangeAPI") -> "Imported":
        """Take `obj`'s tensor through its type's C exchange API (no capsule, no stream synchronization:
        the caller orders its stream after `api.work_stream`). Refused tensors are released at once."""
        out = _Out()
        try:
            rc = api.from_py(id(obj), _addressof(out))
        except DLPackError:
            raise
        except Exception as e:      # the producer's exception (ctypes raises what it set)
            raise DLPackError(f"{type(obj).__name__} refused to export: {e}") from e
        addr = out.value
        if rc != 0 or not addr:
            raise DLPackError(f"{type(obj).__name__}'s DLPack exchange API returned {rc} and no tensor")
        self = object.__new__(cls)
        self._managed = None
        (major, _minor, _ctx, deleter, flags, data, dev_type, dev_id, ndim, code, bits, lanes, shape_at, strides_at,
         offset) = _V_HEAD.unpack_from(_MEMORY, addr)
        dt = _DTYPES.get((code, bits, lanes))
        # the common case inline (a dense 1-D writable tensor of a known dtype: what _read accepts without a
        # question); anything else goes through _read, which checks and explains
        if (ndim == 1 and major == VERSION[0] and dt is not None and shape_at and not flags & FLAG_READ_ONLY
                and (not strides_at or _ONE.unpack_from(_MEMORY, strides_at)[0] == 1)
                and (count := _ONE.unpack_from(_MEMORY, shape_at)[0]) >= 0):
            self.versioned, self.device, self.dtype, self.shape, self.count = True, (dev_type, dev_id), dt, (count,), count
            self.ptr, self.flags = data + offset, flags
        else:
            try:
                self._read(addr, True)
            except BaseException:
                if deleter:     # ours now: a refused tensor goes back to its producer here
                    _deleter_fn(deleter)(addr)
                raise
        self._managed = addr
        self._deleter = (_deleters.get(deleter) or _deleter_fn(deleter)) if deleter else None
        return self

    def _read(self, addr: int, versioned: bool) -> int:
        """Check and read the managed tensor at `addr`; returns its deleter's address."""
        if versioned:
            (major, _minor, _ctx, deleter, flags, data, dev_type, dev_id, ndim, code, bits, lanes, shape_at,
             strides_at, offset) = _V_HEAD.unpack_from(_MEMORY, addr)
            if major != VERSION[0]:
                raise DLPackError(f"DLPack major version {major} is not supported (this reads {VERSION[0]})")
        else:
            (data, dev_type, dev_id, ndim, code, bits, lanes, shape_at, strides_at, offset, _ctx,
             deleter) = _L_HEAD.unpack_from(_MEMORY, addr)
            flags = 0
        self.versioned = versioned
        if flags & FLAG_READ_ONLY:
            raise DLPackError("the tensor is read-only; kernels write their buffers, so a Buffer cannot view "
                              "it (pass a writable tensor, or a copy)")
        self.device = (dev_type, dev_id)
        self.dtype = dtype_of(code, bits, lanes)
        if ndim == 1 and shape_at:          # the common case, without the general loop
            count = _ONE.unpack_from(_MEMORY, shape_at)[0]
            shape = (count,)
            if strides_at and count > 1 and _ONE.unpack_from(_MEMORY, strides_at)[0] != 1:
                self._not_contiguous(shape, _ONE.unpack_from(_MEMORY, strides_at))
        else:
            if ndim < 0 or (ndim and not shape_at):
                raise DLPackError(f"the capsule's tensor has ndim {ndim} and shape pointer {shape_at:#x}")
            shape = _dims(ndim).unpack_from(_MEMORY, shape_at) if ndim else ()
            count = 1
            for n in shape:
                count *= n
            if strides_at and count > 1:
                strides = _dims(ndim).unpack_from(_MEMORY, strides_at)
                want = 1
                for i in reversed(range(ndim)):
                    if shape[i] != 1 and strides[i] != want:
                        self._not_contiguous(shape, strides)
                    want *= shape[i]
        if count < 0:
            raise DLPackError(f"the tensor's shape {tuple(shape)} has a negative size")
        self.shape = tuple(shape)
        self.count = count
        self.ptr = data + offset
        self.flags = flags
        return deleter

    @staticmethod
    def _not_contiguous(shape: tuple, strides: tuple) -> None:
        raise DLPackError(f"the tensor is not contiguous (shape {tuple(shape)}, strides {tuple(strides)} "
                          f"elements); a Buffer is one dense run of elements: pass a contiguous copy")

    def _own(self, addr: int, deleter: int) -> None:
        self._managed = addr
        self._deleter = _deleter_fn(deleter) if deleter else None

    def release(self) -> None:
        with _release_lock:
            addr, self._managed = self._managed, None
        if addr is not None and self._deleter is not None:
            self._deleter(addr)

    def __del__(self) -> None:
        if self._managed is not None:       # (released already: the usual case, nothing to do)
            try:
                self.release()
            except Exception:
                pass


def _deleter_fn(addr: int) -> Any:
    """The callable of a producer's deleter at `addr`, made once per address. Called with the GIL held
    (a producer's deleter that needs it takes it again; one that does not never waits for it)."""
    fn = _deleters.get(addr)
    if fn is None:
        with _cache_lock:
            fn = _deleters.setdefault(addr, _PY_DELETER(addr))
    return fn


# ---- the C exchange API: DLPack 1.3's `__dlpack_c_exchange_api__` -----------------------------------
# A producer type may carry a capsule named "dlpack_exchange_api" holding a table of C functions; a
# consumer takes a tensor through one call (no Python __dlpack__, no capsule) and asks another for the
# producer's current stream, which it then orders itself after. PyTorch's __dlpack__ costs 3 to 5 us on
# an H200 host even with stream=-1 (benchmarks/results/nvidia-h200/permute-*.json); this path is one
# ctypes call. The table is read once per type.

_EXCHANGE_NAME = b"dlpack_exchange_api"
_API_TABLE = struct.Struct("@IIPPPPPP")   # header (version major, minor, prev_api), then 5 function pointers
_FROM_PY = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_WORK_STREAM = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int32, ctypes.c_void_p)
_PY_DELETER = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)
_Out = ctypes.c_void_p
_ONE = struct.Struct("@q")


class ExchangeAPI:
    """A producer type's exchange table: `from_py(PyObject*, DLManagedTensorVersioned**)` and
    `work_stream(device_type, device_id, void**)`, both returning 0 on success."""
    __slots__ = ("from_py", "work_stream", "capsule", "raw_stream")

    def __init__(self, from_py: Any, work_stream: Any, capsule: Any, raw_stream: Any = None) -> None:
        self.from_py, self.work_stream, self.capsule, self.raw_stream = from_py, work_stream, capsule, raw_stream

    def current_stream(self, device_type: int, device_id: int) -> int:
        """The producer's current work stream on that GPU, as a raw handle (0: the default stream).
        PyTorch's own `_cuda_getCurrentRawStream(device)` gives the same handle as its table's
        current_work_stream without a ctypes call (0.09 against 0.70 us on an H200 host)."""
        raw = self.raw_stream
        if raw is not None:
            try:
                stream = raw(device_id)
            except Exception:
                stream = None
            if type(stream) is int and stream >= 0:
                return stream
        out = _Out()
        rc = self.work_stream(device_type, device_id, _addressof(out))
        if rc != 0:
            raise DLPackError(f"the producer's current_work_stream returned {rc}")
        return out.value or 0


# id(type) -> (a weak reference to the type, its ExchangeAPI or None): looked up once per type, and
# dropped with the type (a strong reference would keep every class ever passed in alive, and what its
# instances hold, to the interpreter's end)
_exchange_apis: dict[int, tuple] = {}


def exchange_api(tp: type) -> "ExchangeAPI | None":
    """The DLPack C exchange API of objects of type `tp`, or None when it has none this module can use."""
    entry = _exchange_apis.get(id(tp))
    if entry is not None and entry[0]() is tp:
        return entry[1]
    try:
        api = _read_exchange_api(tp)
    except Exception:       # an attribute that is not the table: the protocol's __dlpack__ still works
        api = None
    key = id(tp)
    try:
        ref = weakref.ref(tp, lambda _, key=key: _exchange_apis.pop(key, None))
    except TypeError:       # a type without weak references: looked up on every call
        return api
    with _cache_lock:
        if len(_exchange_apis) < 1024:
            _exchange_apis[key] = (ref, api)
    return api


def _torch_raw_stream(tp: type) -> Any:
    """PyTorch's current-raw-stream function, for its own tensor types (CUDA and HIP builds alike)."""
    if not (tp.__module__ == "torch" or tp.__module__.startswith("torch.")):
        return None
    return getattr(getattr(sys.modules.get("torch"), "_C", None), "_cuda_getCurrentRawStream", None)


def _read_exchange_api(tp: type) -> "ExchangeAPI | None":
    cap = getattr(tp, "__dlpack_c_exchange_api__", None)     # on the type, as dlpack.h says
    if type(cap) is not _CAPSULE or _capsule_name(cap) != _EXCHANGE_NAME:
        return None
    addr, seen = _ADDR.unpack_from(_MEMORY, id(cap) + _CAP_PTR)[0], 0
    while addr and seen < 8:        # a newer major version may chain to an older table
        major, _minor, prev, _alloc, from_py, _to_py, _dltensor, work_stream = _API_TABLE.unpack_from(_MEMORY, addr)
        if major == VERSION[0]:
            if not from_py or not work_stream:
                return None
            return ExchangeAPI(_FROM_PY(from_py), _WORK_STREAM(work_stream), cap, _torch_raw_stream(tp))
        addr, seen = prev, seen + 1
    return None


# every exportable dtype's (code, bits), looked up once per export
_CODE_BITS: dict[DType, tuple[int, int]] = {dt: cb for cb, dt in ((k[:2], v) for k, v in _DTYPES.items())}
