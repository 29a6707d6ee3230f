"""DLPack both ways, zero-copy: Buffer.__dlpack__ / __dlpack_device__ and Buffer.from_dlpack, with numpy
on the CPU and PyTorch and CuPy on CUDA (marked `cuda`, skipped where absent)."""
from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest

from morok_py import Buffer, Device, LaunchError, MorokError, dtypes, kernels as K
from morok_py import dlpack as D
from morok_py.dlpack import DLPackError

from conftest import ROOT


@pytest.fixture
def cpu():
    return Device["CPU"]


@pytest.fixture
def add(cpu):
    return cpu.compile(K.add(), name="dlpack_add")


def rand(rng, n, dt=np.float32):
    return rng.standard_normal(n).astype(dt)


# ---- CPU: numpy ----------------------------------------------------------------------------------

def test_numpy_views_a_buffer_and_writes_go_both_ways(cpu, rng, add):
    n = 1003
    a, b = Buffer.from_numpy(rand(rng, n)), Buffer.from_numpy(rand(rng, n))
    out = cpu.buffer(n, dtypes.float32)
    view = np.from_dlpack(out)
    assert view.ctypes.data == out.ptr and view.shape == (n,) and view.dtype == np.float32
    add(a, b, out, n=n)
    np.testing.assert_array_equal(view, a.numpy() + b.numpy())     # a kernel's write, seen by numpy
    view[:5] = [1, 2, 3, 4, 5]
    np.testing.assert_array_equal(out.numpy()[:5], [1, 2, 3, 4, 5])  # numpy's write, seen by the buffer


def test_a_buffer_views_a_numpy_array_and_writes_go_both_ways(cpu, rng, add):
    n = 1003
    x, y, z = rand(rng, n), rand(rng, n), np.zeros(n, np.float32)
    bx, by, bz = Buffer.from_dlpack(x), Buffer.from_dlpack(y), Buffer.from_dlpack(z)
    assert bz.ptr == z.ctypes.data and bz.device is cpu and bz.size == n and bz.dtype == dtypes.float32
    add(bx, by, bz, n=n)
    np.testing.assert_array_equal(z, x + y)            # the kernel wrote into numpy's memory
    x[:] = 1.5
    add(bx, by, bz, n=n)                               # a remembered launch, numpy's new values
    np.testing.assert_array_equal(z, 1.5 + y)


def test_a_contiguous_nd_array_comes_in_flat(rng):
    x = rand(rng, 3 * 5 * 7).reshape(3, 5, 7)
    b = Buffer.from_dlpack(x)
    assert b.size == x.size
    np.testing.assert_array_equal(b.numpy(), x.reshape(-1))
    # size-1 dimensions carry any stride
    col = np.ascontiguousarray(rand(rng, 9))[:, None]
    assert Buffer.from_dlpack(col).size == 9


@pytest.mark.parametrize("dt", ["int8", "uint16", "int32", "int64", "float16", "float64", "bool"])
def test_dtypes_cross_both_ways(dt, rng):
    x = (rng.standard_normal(37) * 50).astype(dt)
    b = Buffer.from_dlpack(x)
    assert b.dtype.name == dt
    np.testing.assert_array_equal(b.numpy(), x)
    back = np.from_dlpack(Buffer.from_numpy(x))
    assert back.dtype == x.dtype
    np.testing.assert_array_equal(back, x)


def test_a_buffer_round_trips_through_its_own_protocol(cpu, rng):
    b = Buffer.from_numpy(rand(rng, 100))
    v = Buffer.from_dlpack(b)
    assert v.ptr == b.ptr and v.size == b.size and v.dtype == b.dtype
    v.copyin(np.arange(100, dtype=np.float32))
    np.testing.assert_array_equal(b.numpy(), np.arange(100, dtype=np.float32))


def test_the_dlpack_device_of_a_cpu_buffer(cpu):
    assert cpu.buffer(3, dtypes.float32).__dlpack_device__() == (D.CPU, 0)


def test_the_versioned_capsule_is_given_when_asked_for(cpu):
    b = cpu.buffer(4, dtypes.float32)
    legacy, versioned = b.__dlpack__(), b.__dlpack__(max_version=(1, 0))
    assert "dltensor" in repr(legacy) and "dltensor_versioned" not in repr(legacy)
    assert "dltensor_versioned" in repr(versioned)


@pytest.mark.parametrize("versioned", [False, True])
@pytest.mark.parametrize("dt", ["float16", "bfloat16", "int64", "uint8", "bool"])
def test_both_capsule_layouts_carry_every_field(cpu, versioned, dt):
    """An export read back as a consumer reads it: data pointer, device, dtype, shape, flags; then the
    consumer's release runs the deleter once (the export is no longer live)."""
    dtype = getattr(dtypes, dt)
    b = cpu.buffer(37, dtype)
    before = D.live_exports()
    imp = D.Imported(b.__dlpack__(max_version=(1, 0) if versioned else None))
    assert (imp.versioned, imp.ptr, imp.device, imp.dtype, imp.shape, imp.count) == \
        (versioned, b.ptr, (D.CPU, 0), dtype, (37,), 37)
    assert imp.flags == 0 and D.live_exports() == before + 1
    imp.release()
    imp.release()
    assert D.live_exports() == before


# ---- refusals --------------------------------------------------------------------------------------

def test_a_non_contiguous_array_is_refused(rng):
    x = rand(rng, 64)
    with pytest.raises(DLPackError, match="not contiguous"):
        Buffer.from_dlpack(x[::2])
    with pytest.raises(DLPackError, match="not contiguous"):
        Buffer.from_dlpack(x.reshape(8, 8).T)


def test_a_read_only_array_is_refused(rng):
    x = rand(rng, 64)
    x.setflags(write=False)
    with pytest.raises(DLPackError, match="read-only"):
        Buffer.from_dlpack(x)


def test_an_unsupported_dtype_is_refused(rng):
    with pytest.raises(DLPackError, match="complex.*no morok_py dtype"):
        Buffer.from_dlpack(np.zeros(8, np.complex64))


def test_memory_that_is_not_16_byte_aligned_is_refused():
    x = np.zeros(33, np.float32)          # numpy's data is 16-byte aligned: one element on is not
    with pytest.raises(DLPackError, match="16-byte aligned"):
        Buffer.from_dlpack(x[1:])


def test_a_tensor_on_a_device_morok_py_does_not_have_is_refused():
    class OnOpenCL:
        def __dlpack_device__(self):
            return (4, 0)

        def __dlpack__(self, **kw):
            raise AssertionError("never asked for: the device is refused first")

    with pytest.raises(DLPackError, match="OpenCL memory"):
        Buffer.from_dlpack(OnOpenCL())
    with pytest.raises(DLPackError, match="does not speak DLPack"):
        Buffer.from_dlpack([1.0, 2.0])


def test_export_to_another_device_is_refused_without_a_copy(cpu):
    b = cpu.buffer(4, dtypes.float32)
    with pytest.raises(DLPackError, match="copy=False"):
        b.__dlpack__(dl_device=(D.CUDA, 0), copy=False)
    with pytest.raises(DLPackError, match="not to dl_device"):
        b.__dlpack__(dl_device=(D.CUDA, 0))
    with pytest.raises(DLPackError, match="stream=None"):
        b.__dlpack__(stream=7)                       # a CPU buffer has no stream to order


def test_errors_are_morok_errors_and_buffer_errors():
    assert issubclass(DLPackError, MorokError) and issubclass(DLPackError, BufferError)


def test_a_freed_buffer_cannot_be_exported(cpu):
    b = cpu.buffer(4, dtypes.float32)
    b.free()
    with pytest.raises(ValueError, match="freed"):
        np.from_dlpack(b)


def test_a_capsule_is_consumed_once(cpu):
    cap = cpu.buffer(4, dtypes.float32).__dlpack__(max_version=(1, 0))

    class Once:
        def __dlpack_device__(self):
            return (D.CPU, 0)

        def __dlpack__(self, **kw):
            return cap

    v = Buffer.from_dlpack(Once())
    with pytest.raises(DLPackError, match="consumed once"):
        Buffer.from_dlpack(Once())
    v.free()


def test_copy_true_exports_a_copy(cpu, rng):
    x = rand(rng, 50)
    b = Buffer.from_numpy(x)
    c = np.from_dlpack(b, copy=True)
    c[:] = 0
    np.testing.assert_array_equal(b.numpy(), x)


# ---- lifetimes -------------------------------------------------------------------------------------

def test_an_export_keeps_the_buffer_alive_and_is_released_with_its_view(cpu, rng):
    gc.collect()
    before, in_use = D.live_exports(), cpu.allocator.in_use
    x = rand(rng, 1000)
    b = Buffer.from_numpy(x)
    view = np.from_dlpack(b)
    del b
    gc.collect()
    np.testing.assert_array_equal(view, x)          # the buffer lives on in the view
    assert D.live_exports() == before + 1 and cpu.allocator.in_use == in_use + 4000
    del view
    gc.collect()
    assert D.live_exports() == before and cpu.allocator.in_use == in_use


def test_free_while_viewed_waits_for_the_view(cpu, rng):
    x = rand(rng, 1000)
    b = Buffer.from_numpy(x)
    in_use = cpu.allocator.in_use
    view = np.from_dlpack(b)
    b.free()
    with pytest.raises(ValueError, match="freed"):
        b.numpy()                                    # gone for us at once ...
    assert cpu.allocator.in_use == in_use            # ... its memory kept for the view
    np.testing.assert_array_equal(view, x)
    del view
    gc.collect()
    assert cpu.allocator.in_use == in_use - 4000


def test_an_unconsumed_capsule_releases_its_buffer(cpu):
    gc.collect()
    before = D.live_exports()
    b = cpu.buffer(4, dtypes.float32)
    caps = [b.__dlpack__(), b.__dlpack__(max_version=(1, 0))]
    assert D.live_exports() == before + 2
    del caps
    gc.collect()
    assert D.live_exports() == before


def test_an_imported_view_keeps_the_array_alive(rng):
    x = rand(rng, 1000)
    want = x.copy()
    v = Buffer.from_dlpack(x)
    del x
    gc.collect()
    np.testing.assert_array_equal(v.numpy(), want)


def test_freeing_an_imported_view_drops_its_remembered_launches(cpu, rng, add):
    n = 100
    x, y, z = rand(rng, n), rand(rng, n), np.zeros(n, np.float32)
    bz = Buffer.from_dlpack(z)
    bx, by = Buffer.from_numpy(x), Buffer.from_numpy(y)
    add(bx, by, bz, n=n)
    bz.free()
    with pytest.raises(ValueError, match="freed"):
        add(bx, by, bz, n=n)
    with pytest.raises(LaunchError, match="may touch"):
        add(bx, by, Buffer.from_dlpack(z[:48]), n=n)    # a view too small is checked like any buffer


_LIFETIMES = r"""
import gc, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from morok_py import Buffer, Device, dtypes, kernels as K
from morok_py import dlpack as D
cpu = Device["CPU"]
rng = np.random.default_rng(1)
x = rng.standard_normal(4099).astype(np.float32)

# export, then drop the producer first / the consumer first
for producer_first in (True, False):
    b = Buffer.from_numpy(x)
    v = np.from_dlpack(b)
    if producer_first:
        del b; gc.collect(); assert (v == x).all(); v[:] = 2; del v
    else:
        del v; gc.collect(); assert (b.numpy() == x).all(); del b
    gc.collect()
# import, then drop the array first / the buffer first; a kernel writes through the view
add = cpu.compile(K.add(), name="lifetimes_add")
for array_first in (True, False):
    z = np.zeros(4099, np.float32)
    bz = Buffer.from_dlpack(z)
    a = Buffer.from_numpy(x)
    add(a, a, bz, n=4099)
    assert (z == 2 * x).all()
    if array_first:
        del z; gc.collect(); assert (bz.numpy() == 2 * x).all(); del bz
    else:
        del bz; gc.collect(); assert (z == 2 * x).all(); del z
    gc.collect()
# free() while viewed, capsules never consumed, chains of views, a view left alive at exit
b = Buffer.from_numpy(x); v = np.from_dlpack(b); b.free(); assert (v == x).all(); del v
caps = [Buffer.from_numpy(x).__dlpack__(max_version=(1, 0)) for _ in range(3)] + [Buffer.from_numpy(x).__dlpack__()]
del caps
chain = np.from_dlpack(Buffer.from_dlpack(np.from_dlpack(Buffer.from_numpy(x))))
assert (chain == x).all()
gc.collect()
leftover = np.from_dlpack(Buffer.from_numpy(x))
print("ok", D.live_exports())
"""


def test_deleting_either_side_first_never_crashes_under_dev_mode():
    out = subprocess.run([sys.executable, "-X", "dev", "-c", _LIFETIMES, str(ROOT)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # alive at the end: the chain holds two of our exports (its inner and outer Buffer), the leftover one
    assert out.stdout.split() == ["ok", "3"], out.stdout
    assert "Exception ignored" not in out.stderr and "Error" not in out.stderr, out.stderr[-3000:]


_ALIGNED16 = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from morok_py import Buffer, Device, kernels as K
cpu = Device["CPU"]
rng = np.random.default_rng(2)

def at16(n):
    # float32 memory 16 bytes past a 64-byte boundary: what numpy often hands out
    raw = np.zeros(n + 32, np.float32)
    skip = ((16 - raw.ctypes.data % 64) % 64) // 4
    x = raw[skip:skip + n]
    assert x.ctypes.data % 64 == 16
    x[:] = rng.standard_normal(n)
    return x

n = 100003
a, b, c = at16(n), at16(n), at16(n)
cpu.compile(K.add(), name="a16_add")(*map(Buffer.from_dlpack, (a, b, c)), n=n)
assert (c == a + b).all()
M, N, Kd = 67, 129, 63
x, w, o = at16(M * Kd), at16(Kd * N), at16(M * N)
cpu.compile(K.matmul(), name="a16_mm")(*map(Buffer.from_dlpack, (x, w, o)), M=M, N=N, K=Kd)
np.testing.assert_allclose(o.reshape(M, N), x.reshape(M, Kd) @ w.reshape(Kd, N), rtol=1e-4, atol=1e-4)
r, s = at16(301 * 333), at16(301)
cpu.compile(K.reduce_axis("sum", [None, None], 1), name="a16_sum")(Buffer.from_dlpack(r), Buffer.from_dlpack(s), d0=301, d1=333)
np.testing.assert_allclose(s, r.reshape(301, 333).sum(1), rtol=1e-4, atol=1e-3)
print("ok")
"""


def test_cpu_kernels_run_on_imports_aligned_to_16_bytes_only():
    # from_dlpack asks 16-byte alignment (numpy's), not the allocator's 64: vector loads and stores on
    # such memory must not fault (the streaming variant checks its 64-byte promise per launch)
    out = subprocess.run([sys.executable, "-c", _ALIGNED16, str(ROOT)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# ---- CUDA: PyTorch and CuPy --------------------------------------------------------------------------

@pytest.fixture
def gpu():
    from conftest import open_target
    dev = open_target("CUDA", "nvrtc").dev
    if getattr(dev, "compile_only", False):
        pytest.skip(f"CUDA is compile-only here: {dev.reason}")
    return dev


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="PyTorch is not installed")


@pytest.fixture
def cupy():
    return pytest.importorskip("cupy", reason="CuPy is not installed")


@pytest.mark.cuda
def test_torch_views_a_buffer_and_writes_go_both_ways(gpu, torch, rng):
    n = 4099
    add = gpu.compile(K.add(), name="dlpack_gpu_add")
    a, b = Buffer.from_numpy(rand(rng, n), gpu), Buffer.from_numpy(rand(rng, n), gpu)
    out = gpu.buffer(n, dtypes.float32)
    add(a, b, out, n=n)
    t = torch.from_dlpack(out)        # torch's current stream waits for our stream
    assert t.device.type == "cuda" and t.data_ptr() == out.ptr
    np.testing.assert_array_equal(t.cpu().numpy(), a.numpy() + b.numpy())
    t.mul_(2)                         # torch's write ...
    torch.cuda.synchronize()
    np.testing.assert_array_equal(out.numpy(), 2 * (a.numpy() + b.numpy()))   # ... seen by the buffer


@pytest.mark.cuda
def test_a_buffer_views_a_torch_tensor_and_writes_go_both_ways(gpu, torch, rng):
    n = 4099
    add = gpu.compile(K.add(), name="dlpack_gpu_add")
    x = torch.randn(n, device="cuda")
    z = torch.empty(n, device="cuda")
    z.fill_(7)                              # queued on torch's stream: the import orders it before ours
    bx, bz = Buffer.from_dlpack(x), Buffer.from_dlpack(z)
    assert bz.ptr == z.data_ptr() and bz.device is gpu
    np.testing.assert_array_equal(bz.numpy(), np.full(n, 7, np.float32))
    add(bx, bx, bz, n=n)
    gpu.synchronize()
    np.testing.assert_array_equal(z.cpu().numpy(), 2 * x.cpu().numpy())


def test_only_a_torch_gpu_tensor_names_its_stream(torch):
    """dlpack.producer_stream: PyTorch's current stream for its GPU tensors; None for a CPU tensor, for
    other libraries' objects and for a device type without streams (those take the protocol's handshake)."""
    from morok_py import dlpack as D
    assert D.producer_stream(torch.arange(4, dtype=torch.float32), D.CPU, 0) is None
    assert D.producer_stream(np.arange(4, dtype=np.float32), D.CUDA, 0) is None
    assert D.producer_stream(object(), D.CUDA, 0) is None


@pytest.mark.cuda
def test_an_import_waits_for_work_on_torchs_side_stream(gpu, torch):
    """A tensor written on a non-default torch stream behind a long sleep: the import orders this device's
    stream after that stream (torch exported with stream=-1), so our copy-out sees the write."""
    from morok_py import dlpack as D
    n = 1 << 20
    z = torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert D.producer_stream(z, D.CUDA, 0) == side.cuda_stream
        torch.cuda._sleep(200_000_000)       # ~0.1 s of GPU cycles before the write
        z.fill_(3)
        bz = Buffer.from_dlpack(z)
    out = gpu.buffer(n, dtypes.float32)
    gpu.compile(K.add(), name="dlpack_gpu_add")(bz, bz, out, n=n)     # on our stream, after the fill
    np.testing.assert_array_equal(out.numpy(), np.full(n, 6, np.float32))
    side.synchronize()


@pytest.mark.cuda
def test_torch_refusals(gpu, torch):
    x = torch.randn(64, device="cuda")
    with pytest.raises(DLPackError, match="not contiguous"):
        Buffer.from_dlpack(x[::2])
    with pytest.raises(DLPackError, match="no morok_py dtype"):
        Buffer.from_dlpack(torch.zeros(8, dtype=torch.complex64, device="cuda"))
    with pytest.raises(DLPackError, match="stream=0"):
        gpu.buffer(4, dtypes.float32).__dlpack__(stream=0)
    c = Buffer.from_dlpack(torch.arange(5, dtype=torch.float32))     # a CPU tensor becomes a CPU buffer
    assert c.device is Device["CPU"]


@pytest.mark.cuda
def test_cupy_both_ways(gpu, cupy, rng):
    n = 1003
    add = gpu.compile(K.add(), name="dlpack_gpu_add")
    x = cupy.asarray(rand(rng, n))
    out = gpu.buffer(n, dtypes.float32)
    bx = Buffer.from_dlpack(x)
    assert bx.ptr == x.data.ptr
    add(bx, bx, out, n=n)
    y = cupy.from_dlpack(out)
    assert y.data.ptr == out.ptr
    np.testing.assert_array_equal(cupy.asnumpy(y), 2 * cupy.asnumpy(x))
    y += 1
    cupy.cuda.Device().synchronize()
    np.testing.assert_array_equal(out.numpy(), 2 * cupy.asnumpy(x) + 1)


@pytest.mark.cuda
def test_gpu_lifetimes_in_either_order(gpu, torch, rng):
    x = rand(rng, 1000)
    b = Buffer.from_numpy(x, gpu)
    t = torch.from_dlpack(b)
    del b
    gc.collect()
    np.testing.assert_array_equal(t.cpu().numpy(), x)
    del t
    z = torch.ones(1000, device="cuda")
    v = Buffer.from_dlpack(z)
    del z
    gc.collect()
    np.testing.assert_array_equal(v.numpy(), np.ones(1000, np.float32))
    del v
    gc.collect()
    assert D.live_exports() == 0


# ---- export: stream argument, cached per (device, dtype) ---------------------------------------------

@pytest.mark.parametrize("stream", [True, 1.0, "1", 0, 2])
def test_a_cpu_export_refuses_any_stream_but_none_and_minus_one(cpu, stream):
    b = cpu.buffer(4, dtypes.float32)
    with pytest.raises(DLPackError, match="stream"):
        b.__dlpack__(stream=stream)
    assert b._exports == 0                   # a refused export leaves no count behind
    b.free()


def test_stream_minus_one_exports_without_ordering(cpu, rng):
    x = rand(rng, 33)
    b = Buffer.from_numpy(x)
    imp = D.Imported(b.__dlpack__(stream=-1, max_version=(1, 0)))
    assert imp.ptr == b.ptr and imp.count == 33
    imp.release()


def test_an_equal_dtype_object_exports_its_own_code(cpu):
    """The export cache is keyed by the dtype's name but holds the dtype: another object of that name
    is looked up for itself."""
    import dataclasses
    b = cpu.buffer(8, dtypes.float32)
    np.from_dlpack(b)                                      # the cache holds float32 now
    other = dataclasses.replace(dtypes.float32)            # equal, not the same object
    v = Buffer._view(cpu, 8, other, b.ptr, None)
    imp = D.Imported(v.__dlpack__(max_version=(1, 0)))
    assert imp.dtype == dtypes.float32 and imp.count == 8
    imp.release()
    v._owner = None
    v._ptr = None                                          # the view owns nothing: never freed here


@pytest.mark.parametrize("n", [1, 3, 17, 1001])
@pytest.mark.parametrize("dt", ["float32", "int16", "uint8", "float64"])
def test_odd_sizes_round_trip_both_ways(rng, n, dt):
    x = (rng.standard_normal(n) * 30).astype(dt)
    b = Buffer.from_dlpack(x)
    back = np.from_dlpack(b)
    assert back.ctypes.data == x.ctypes.data and back.shape == (n,) and back.dtype == x.dtype
    np.testing.assert_array_equal(back, x)


def test_a_zero_dimensional_array_comes_in_as_one_element(rng):
    raw = rand(rng, 4)
    b = Buffer.from_dlpack(np.array(raw[0]))
    assert b.size == 1 and b.numpy()[0] == raw[0]


def test_an_export_of_a_freed_buffer_names_it(cpu):
    from morok_py.errors import BufferFreedError
    b = cpu.buffer(4, dtypes.float32)
    b.free()
    with pytest.raises(BufferFreedError, match="freed"):
        b.__dlpack__(max_version=(1, 0))


@pytest.mark.cuda
def test_torch_hands_its_tensor_over_through_the_c_exchange_api(gpu, torch):
    """PyTorch 2.10+ carries __dlpack_c_exchange_api__: its current stream comes from the table, and a side
    stream's pending write is ordered before this device's stream."""
    if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        pytest.skip("this PyTorch has no DLPack C exchange API")
    api = D.exchange_api(torch.Tensor)
    assert api is not None
    assert api.current_stream(D.CUDA, 0) in (0, torch.cuda.current_stream().cuda_stream)
    # torch's raw-stream shortcut and its table's current_work_stream name the same stream
    table_only = D.ExchangeAPI(api.from_py, api.work_stream, api.capsule)
    n = 1 << 20
    z = torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert api.current_stream(D.CUDA, 0) == side.cuda_stream == table_only.current_stream(D.CUDA, 0)
        torch.cuda._sleep(200_000_000)
        z.fill_(5)
        bz = Buffer.from_dlpack(z)
    assert bz.ptr == z.data_ptr() and bz.size == n and bz.device is gpu
    out = gpu.buffer(n, dtypes.float32)
    gpu.compile(K.add(), name="dlpack_gpu_add")(bz, bz, out, n=n)
    np.testing.assert_array_equal(out.numpy(), np.full(n, 10, np.float32))
    side.synchronize()


@pytest.mark.cuda
def test_torch_through_the_protocol_alone_still_orders_streams(gpu, torch, monkeypatch):
    """With the exchange API hidden, from_dlpack takes torch's __dlpack__ and the same ordering holds."""
    monkeypatch.setattr(D, "exchange_api", lambda tp: None)
    n = 1 << 20
    z = torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        z.fill_(2)
        bz = Buffer.from_dlpack(z)
    out = gpu.buffer(n, dtypes.float32)
    gpu.compile(K.add(), name="dlpack_gpu_add")(bz, bz, out, n=n)
    np.testing.assert_array_equal(out.numpy(), np.full(n, 4, np.float32))
    side.synchronize()


@pytest.mark.cuda
def test_torch_tensors_the_exchange_does_not_take(gpu, torch):
    x = torch.randn(64, device="cuda", requires_grad=True)
    with pytest.raises(DLPackError, match="gradient"):        # torch's own refusal, through __dlpack__
        Buffer.from_dlpack(x)
    with pytest.raises(DLPackError, match="not contiguous"):
        Buffer.from_dlpack(torch.randn(8, 8, device="cuda").t())
    with pytest.raises(DLPackError, match="16-byte aligned"):
        Buffer.from_dlpack(torch.randn(64, device="cuda")[1:])
    with pytest.raises(DLPackError, match="read-only|no morok_py dtype|complex"):
        Buffer.from_dlpack(torch.zeros(4, dtype=torch.complex64, device="cuda"))
    ok = Buffer.from_dlpack(torch.randn(64, device="cuda")[4:])    # 16 bytes in: byte offset kept
    assert ok.size == 60
    for dt, name in ((torch.float16, "float16"), (torch.bfloat16, "bfloat16"), (torch.int64, "int64"),
                     (torch.uint8, "uint8"), (torch.bool, "bool")):
        assert Buffer.from_dlpack(torch.ones(37, dtype=dt, device="cuda")).dtype.name == name


@pytest.mark.cuda
def test_torch_from_a_buffer_orders_after_our_stream_on_any_torch_stream(gpu, torch, rng):
    n = 1 << 24                                   # long enough that our stream is still busy at the export
    x = rand(rng, n)
    a = Buffer.from_numpy(x, gpu)
    out = gpu.buffer(n, dtypes.float32)
    add = gpu.compile(K.add(), name="dlpack_gpu_add")
    side = torch.cuda.Stream()
    for _ in range(3):
        add(a, a, out, n=n)                       # queued on our stream
        with torch.cuda.stream(side):
            t = torch.from_dlpack(out)            # side waits for ours
            s = (t * 1).cpu().numpy()
        np.testing.assert_array_equal(s, 2 * x)
        del t


def test_both_gpu_devices_have_the_same_dlpack_shape():
    """CUDA and ROCm answer the same DLPack calls: the consumer's stream for an import handshake, the
    ordering after a producer's stream, the ordering of a consumer's stream after ours."""
    from morok_py.backends.cuda.device import CUDADevice
    from morok_py.backends.rocm.device import ROCMDevice
    public = {"dlpack_stream", "dlpack_imported", "dlpack_sync"}
    for cls in (CUDADevice, ROCMDevice):
        assert public <= {m for m in vars(cls) if not m.startswith("_")}, cls


_CYCLE_AT_EXIT = r"""
import sys
sys.path.insert(0, sys.argv[1])
from morok_py import Buffer, Device, dtypes
cpu = Device["CPU"]
unconsumed = cpu.buffer(4, dtypes.float32).__dlpack__(max_version=(1, 0))

class Holder:                     # a reference cycle: collected by the interpreter's last collection
    pass

Holder.me = Holder
cap = cpu.buffer(4, dtypes.float32).__dlpack__(max_version=(1, 0))
Holder.view = Buffer.from_dlpack(type("Once", (), {"__dlpack_device__": lambda s: (1, 0),
                                                    "__dlpack__": lambda s, **k: cap})())
Holder.cap = cap
Holder.legacy = cpu.buffer(4, dtypes.float32).__dlpack__()
del cap
print("ok")
"""


def test_capsules_and_views_left_in_a_cycle_at_exit_do_not_crash():
    out = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _CYCLE_AT_EXIT, str(ROOT)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-3000:]
