"""DLPack's C exchange API (`__dlpack_c_exchange_api__`, dlpack.h 1.3) as Buffer.from_dlpack consumes it:
a producer type whose class carries the table hands its tensor over in one C call and names its current
stream. The producer here is made in Python through ctypes callbacks, so every field of the tensor it
hands over can be chosen: the data of numpy arrays, or any device, dtype, shape, strides and flags."""
from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest

from morok_py import Buffer, Device, dtypes, kernels as K
from morok_py import dlpack as D
from morok_py.dlpack import DLPackError

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

FROM_PY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
WORK_STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int32, ctypes.c_void_p)
DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class Table(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("prev", ctypes.c_void_p),
                ("allocator", ctypes.c_void_p), ("from_py", FROM_PY), ("to_py", ctypes.c_void_p),
                ("dltensor_from_py", ctypes.c_void_p), ("work_stream", WORK_STREAM)]


class Producer:
    """Tensors of one producer type: each call of its table's from_py makes a DLManagedTensorVersioned
    from the object's fields; the deleter counts its calls per tensor."""

    def __init__(self, major: int = 1, stream: int = 0):
        self.deleted: list[int] = []          # the addresses the deleter was called with, in order
        self.made: list[int] = []
        self.stream_asks: list[tuple[int, int]] = []
        self.stream = stream
        self.keep: dict[int, tuple] = {}
        self.deleter = DELETER(self._delete)
        self.table = Table(major=major, minor=3, from_py=FROM_PY(self._from_py),
                           work_stream=WORK_STREAM(self._work_stream))
        self.capsule = _api.PyCapsule_New(ctypes.addressof(self.table), b"dlpack_exchange_api", None)
        producer = self

        class Tensor:
            __dlpack_c_exchange_api__ = self.capsule

            def __init__(self, array=None, *, ptr=None, device=(D.CPU, 0), code_bits=None, shape=None,
                         strides=None, offset=0, flags=0, lanes=1, fail=None, requires_grad=False):
                self.array = array
                self.ptr = ptr if ptr is not None else array.ctypes.data
                self.device = device
                self.code_bits = code_bits or (D.dtype_code(dtypes.float32) if array is None else
                                               D.dtype_code(getattr(dtypes, str(array.dtype))))
                self.shape = shape if shape is not None else array.shape
                self.strides = None if strides == "null" else strides if strides is not None or array is None \
                    else tuple(s // array.itemsize for s in array.strides)
                self.offset, self.flags, self.lanes, self.fail = offset, flags, lanes, fail
                self.requires_grad = requires_grad

            def __dlpack_device__(self):
                return self.device

            def __dlpack__(self, **kw):       # the protocol's way, for what the exchange does not take
                raise BufferError("asked through __dlpack__")

        self.Tensor = Tensor

    def _from_py(self, obj_addr, out_addr):
        t = ctypes.cast(obj_addr, ctypes.py_object).value
        if t.fail is not None:      # (an exception set here would be raised in this callback by ctypes)
            return -1
        nd = len(t.shape)
        shape = (ctypes.c_int64 * max(nd, 1))(*t.shape)
        strides = (ctypes.c_int64 * max(nd, 1))(*t.strides) if t.strides is not None else None
        m = D.DLManagedTensorVersioned()
        m.version.major, m.version.minor = 1, 0
        m.deleter = ctypes.cast(self.deleter, ctypes.c_void_p).value
        m.flags = t.flags
        dl = m.dl_tensor
        dl.data, dl.ndim, dl.byte_offset = t.ptr, nd, t.offset
        dl.device.device_type, dl.device.device_id = t.device
        dl.dtype.code, dl.dtype.bits = t.code_bits
        dl.dtype.lanes = t.lanes
        dl.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        dl.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)) if strides is not None else None
        addr = ctypes.addressof(m)
        self.keep[addr] = (m, shape, strides, t.array)     # the array lives as long as the tensor
        self.made.append(addr)
        ctypes.c_void_p.from_address(out_addr).value = addr
        return 0

    def _work_stream(self, device_type, device_id, out_addr):
        self.stream_asks.append((device_type, device_id))
        ctypes.c_void_p.from_address(out_addr).value = self.stream or None
        return 0

    def _delete(self, addr):
        self.deleted.append(addr)
        self.keep.pop(addr, None)

    def balanced(self) -> bool:
        """Every tensor handed over was given back exactly once."""
        return sorted(self.made) == sorted(self.deleted) and not self.keep


@pytest.fixture
def producer():
    return Producer()


def rand(rng, n, dt=np.float32):
    return rng.standard_normal(n).astype(dt)


def test_the_table_is_read_once_per_type(producer):
    api = D.exchange_api(producer.Tensor)
    assert api is not None and D.exchange_api(producer.Tensor) is api
    assert D.exchange_api(np.ndarray) is None or hasattr(np.ndarray, "__dlpack_c_exchange_api__")
    assert D.exchange_api(list) is None


def test_a_table_of_another_major_version_is_not_used():
    assert D.exchange_api(Producer(major=2).Tensor) is None


def test_a_cpu_tensor_comes_in_through_the_table_and_writes_go_both_ways(producer, rng):
    n = 1003
    cpu = Device["CPU"]
    x, y, z = rand(rng, n), rand(rng, n), np.zeros(n, np.float32)
    bx, by, bz = (Buffer.from_dlpack(producer.Tensor(a)) for a in (x, y, z))
    assert len(producer.made) == 3 and not producer.deleted
    assert bz.ptr == z.ctypes.data and bz.device is cpu and bz.size == n and bz.dtype == dtypes.float32
    cpu.compile(K.add(), name="exchange_add")(bx, by, bz, n=n)
    np.testing.assert_array_equal(z, x + y)
    assert producer.stream_asks == []          # a CPU tensor has no stream to order after
    del bx, by, bz
    gc.collect()
    assert producer.balanced()


@pytest.mark.parametrize("dt", ["int8", "uint16", "int32", "int64", "float16", "float64", "bool"])
def test_dtypes_map_through_the_table(producer, dt, rng):
    x = (rng.standard_normal(37) * 50).astype(dt)
    b = Buffer.from_dlpack(producer.Tensor(x))
    assert b.dtype.name == dt
    np.testing.assert_array_equal(b.numpy(), x)
    b.free()
    assert producer.balanced()


def test_nd_and_byte_offset_and_size_one_strides(producer, rng):
    raw = rand(rng, 3 * 5 * 7 + 16)
    x = raw[16:].reshape(3, 5, 7)              # 64 bytes in: the offset keeps 16-byte alignment
    b = Buffer.from_dlpack(producer.Tensor(raw, shape=(3, 5, 7), strides=(35, 7, 1), offset=64))
    assert b.size == 105 and b.ptr == raw.ctypes.data + 64
    np.testing.assert_array_equal(b.numpy(), x.reshape(-1))
    col = Buffer.from_dlpack(producer.Tensor(raw, shape=(9, 1), strides=(1, 1000)))   # size-1 dims: any stride
    assert col.size == 9
    empty = Buffer.from_dlpack(producer.Tensor(raw, shape=(0, 4), strides=(0, 0)))
    assert empty.size == 0
    none = Buffer.from_dlpack(producer.Tensor(raw, shape=(4, 3), strides="null"))      # NULL strides: dense
    assert none.size == 12
    scalar = Buffer.from_dlpack(producer.Tensor(raw, shape=(), strides="null"))         # 0-d: one element
    assert scalar.size == 1 and scalar.numpy()[0] == raw[0]
    del b, col, empty, none, scalar
    gc.collect()
    assert producer.balanced()


@pytest.mark.parametrize("case, match", [
    (dict(shape=(8,), strides=(2,)), "not contiguous"),
    (dict(shape=(4, 4), strides=(1, 4)), "not contiguous"),
    (dict(flags=D.FLAG_READ_ONLY), "read-only"),
    (dict(code_bits=(5, 64)), "complex.*no morok_py dtype"),
    (dict(lanes=4), "lanes"),
    (dict(offset=4), "16-byte aligned"),
    (dict(device=(4, 0)), "OpenCL memory"),
    (dict(device=(D.CUDA_HOST, 0)), "CUDA host memory"),
    (dict(shape=(-3,), strides=(1,)), "negative size"),
])
def test_refusals_give_the_tensor_back_to_its_producer(producer, rng, case, match):
    x = rand(rng, 64)
    with pytest.raises(DLPackError, match=match):
        Buffer.from_dlpack(producer.Tensor(x, **case))
    assert len(producer.made) == 1 and producer.balanced()


def test_a_producer_failure_is_a_dlpack_error(producer, rng):
    with pytest.raises(DLPackError, match="exchange API returned -1 and no tensor"):
        Buffer.from_dlpack(producer.Tensor(rand(rng, 8), fail=True))
    assert producer.made == [] and producer.balanced()


def test_a_tensor_that_requires_grad_goes_through_the_protocol(producer, rng):
    """Its producer decides through __dlpack__ (PyTorch refuses one that requires grad); the table is not asked."""
    with pytest.raises(DLPackError, match="asked through __dlpack__"):
        Buffer.from_dlpack(producer.Tensor(rand(rng, 8), requires_grad=True))
    assert producer.made == []


def test_a_gpu_tensor_without_a_gpu_is_given_back(producer, rng, monkeypatch):
    """A CUDA tensor where no CUDA device opens: the error of opening it, and the tensor given back."""
    from morok_py.errors import MorokError
    monkeypatch.delenv("MOROK_CUDA_ARCH", raising=False)
    try:
        dev = Device["CUDA"]
    except MorokError:
        dev = None
    if dev is not None and not getattr(dev, "compile_only", False):
        pytest.skip("a CUDA GPU is here: the cuda-marked tests cover it")
    with pytest.raises((MorokError, BufferError)):
        Buffer.from_dlpack(producer.Tensor(rand(rng, 8), device=(D.CUDA, 0)))
    assert len(producer.made) == 1 and producer.balanced()


def test_buffer_lifetimes_either_order(producer, rng):
    x = rand(rng, 4099)
    t = producer.Tensor(x)
    b = Buffer.from_dlpack(t)
    del t, x
    gc.collect()
    assert not producer.deleted               # the buffer keeps the tensor (and its array) alive
    assert b.numpy().shape == (4099,)
    b.free()
    b.free()
    assert producer.balanced() and len(producer.deleted) == 1


def test_the_table_cache_does_not_keep_types_alive():
    """A type looked up (with or without a table) is not kept alive by the lookup: what its class holds
    goes with it, not at the interpreter's end."""
    import weakref
    p = Producer()
    T = p.Tensor
    assert D.exchange_api(T) is not None

    class Plain:
        pass

    assert D.exchange_api(Plain) is None
    refs = [weakref.ref(T), weakref.ref(Plain)]
    del T, Plain, p
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_the_torch_stream_shortcut_only_for_torch_types():
    assert D._torch_raw_stream(np.ndarray) is None
    assert D._torch_raw_stream(Producer().Tensor) is None
