"""The ROCm device. Tests marked `rocm` need an AMD GPU with ROCm and skip with the reason elsewhere;
the others (missing runtime, vendor-stack conflicts) run everywhere."""
from __future__ import annotations

import numpy as np
import pytest

from morok_py import (Buffer, DeviceError, DeviceSpec, DeviceUnavailableError, LaunchError, OutOfMemoryError,
                      RuntimeStackConflictError, dtypes)
from morok_py import kernels as K
from morok_py import registry
from morok_py.backends.rocm import compile_only_pairs
from morok_py.backends.rocm.device import create_device
from morok_py.backends.rocm.runtime import hip_module


def _rocm_problem() -> str | None:
    try:
        hip_module()
    except DeviceUnavailableError as e:
        return str(e)
    return None


# ---- everywhere ---------------------------------------------------------------------------------

def test_missing_runtime_is_device_unavailable_and_claims_no_stack(monkeypatch):
    why = _rocm_problem()
    if why is None:
        pytest.skip("the HIP runtime loads here and finds a GPU")
    monkeypatch.setattr(registry, "_stack", None)
    with pytest.raises(DeviceUnavailableError) as e:
        create_device(DeviceSpec("ROCM", 0))
    assert "libamdhip64" in str(e.value) or "hip-python" in str(e.value) or "GPU" in str(e.value)
    assert registry.active_gpu_stack() is None       # a failed open leaves CUDA free to open


def test_rocm_refuses_to_open_after_cuda(monkeypatch):
    monkeypatch.setattr(registry, "_stack", "CUDA")
    with pytest.raises(RuntimeStackConflictError, match="already runs the CUDA stack"):
        create_device(DeviceSpec("ROCM", 0))


def test_cuda_refuses_to_open_after_rocm(monkeypatch):
    monkeypatch.setattr(registry, "_stack", "ROCM")
    with pytest.raises(RuntimeStackConflictError, match="already runs the ROCM stack"):
        registry.claim_gpu_stack("CUDA")     # what the CUDA backend calls before opening its driver


# ---- on an AMD GPU ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rocm():
    why = _rocm_problem()
    if why is not None:
        pytest.skip(f"no usable AMD GPU: {why.splitlines()[0]}")
    try:
        return registry.get_device("ROCM")
    except (DeviceUnavailableError, RuntimeStackConflictError) as e:
        pytest.skip(str(e).splitlines()[0])


def _random_inputs(info, values, rng):
    """Buffers sized from the kernel's own access bounds for these values; random, never all zeros."""
    _, _, bounds, _ = info.prepare(values)
    sizes = [1] * info.buf_count
    for b in bounds:
        if b is not None:
            sizes[b[0]] = max(sizes[b[0]], b[3] + 1)
    arrays = []
    for p, n in zip(info.params, sizes):
        dt = p.dtype.np
        if np.dtype(dt).kind == "f":
            arrays.append(rng.standard_normal(n).astype(dt))
        else:
            arrays.append(rng.integers(-3, 60, size=n).astype(dt))
    return arrays


# odd sizes, not multiples of any vector or wave width
_VALUES = {"n": 1003, "rows": 37, "cols": 1001, "d0": 37, "d1": 333, "M": 33, "N": 47, "K": 65,
           "table_n": 50, "vocab": 51, "dim": 19}


@pytest.mark.rocm
@pytest.mark.parametrize("pair", ["llvm-amdgpu", "hiprtc"])
@pytest.mark.parametrize("kernel", list(K.NAMED))
def test_every_kernel_family_matches_the_cpu(rocm, pair, kernel, rng):
    """Each family with symbolic, odd sizes against the CPU device (itself checked against numpy)."""
    from morok_py.registry import get_device
    _, comp = rocm.pair(pair)
    if comp.available() is not None:
        pytest.skip(f"{pair} is unavailable: {comp.available()}")
    cpu = get_device("CPU")
    ast = K.named(kernel)
    gpu_prog = rocm.compile(ast, kernel, compiler=pair)
    cpu_prog = cpu.compile(ast, kernel)
    info = gpu_prog.launch
    values = {v: _VALUES[v] for v in info.var_names}
    arrays = _random_inputs(info, values, rng)
    gbufs = [Buffer.from_numpy(a, rocm) for a in arrays]
    cbufs = [Buffer.from_numpy(a, cpu) for a in arrays]
    gpu_prog(*gbufs, **values)
    cpu_prog(*cbufs, **values)
    for p, g, c in zip(info.params, gbufs, cbufs):
        if p.written:
            np.testing.assert_allclose(g.numpy(), c.numpy(), rtol=2e-5, atol=2e-5, err_msg=f"{kernel} buffer {p.slot}")


@pytest.mark.rocm
def test_wait_returns_the_kernel_time(rocm, rng):
    n = 1 << 20
    prog = rocm.compile(K.add(), "add")
    a, b = (Buffer.from_numpy(rng.standard_normal(n).astype(np.float32), rocm) for _ in range(2))
    c = rocm.buffer(n, dtypes.float32)
    t = prog(a, b, c, n=n, wait=True)
    assert isinstance(t, float) and 0 < t < 1
    np.testing.assert_array_equal(c.numpy(), a.numpy() + b.numpy())


@pytest.mark.rocm
def test_launch_errors_are_caught_before_the_device(rocm, rng):
    prog = rocm.compile(K.add(), "add")
    a, b, c = (Buffer.from_numpy(rng.standard_normal(10).astype(np.float32), rocm) for _ in range(3))
    with pytest.raises(LaunchError, match="takes 3 buffer"):
        prog(a, b, n=10)
    with pytest.raises(LaunchError, match="may touch indices"):
        prog(a, b, c, n=11)
    with pytest.raises(LaunchError, match="outside its range"):
        prog(a, b, c, n=0)
    with pytest.raises(LaunchError, match="holds int32"):
        prog(a, b, rocm.buffer(10, dtypes.int32), n=10)


@pytest.mark.rocm
def test_a_launch_the_device_refuses_is_a_device_error_with_the_hip_name(rocm, rng):
    prog = rocm.compile(K.add(), "add")
    a, b, c = (Buffer.from_numpy(rng.standard_normal(10).astype(np.float32), rocm) for _ in range(3))
    with pytest.raises(DeviceError) as e:
        prog.execute([a.ptr, b.ptr, c.ptr], [10], (1, 1, 1), (2048, 1, 1))   # over 1024 work-items
    assert e.value.name.startswith("hipError") and e.value.call == "hipModuleLaunchKernel"


@pytest.mark.rocm
def test_out_of_memory_frees_the_cache_retries_then_raises(rocm):
    alloc = rocm.allocator
    block = rocm.buffer(1 << 20, dtypes.uint8)
    block.free()
    assert alloc.cached_bytes >= 1 << 20
    huge = 1 << 50
    with pytest.raises(OutOfMemoryError, match=f"out of memory allocating {huge} bytes") as e:
        rocm.buffer(huge, dtypes.uint8)
    assert isinstance(e.value, MemoryError)
    assert alloc.cached_bytes == 0                      # the retry went through the cache first
    rocm.buffer(1024, dtypes.float32).copyin(np.ones(1024, np.float32))   # still usable


@pytest.mark.rocm
def test_code_object_for_another_arch_fails_at_load_naming_both(rocm):
    other = "gfx1100" if rocm.arch.startswith("gfx9") else "gfx942"
    r, c = compile_only_pairs(other)[0]
    compiled = c.compile(r.render(K.add(), name="add"))
    with pytest.raises(DeviceError) as e:
        rocm.runtime(compiled)
    assert other in str(e.value) and rocm.arch in str(e.value)


@pytest.mark.rocm
def test_opening_cuda_after_rocm_is_refused(rocm):
    try:
        registry.get_device("CUDA")
    except RuntimeStackConflictError as e:
        assert "ROCM" in str(e)
    except DeviceUnavailableError as e:
        pytest.skip(f"CUDA reports itself unavailable before reaching its stack check: {str(e).splitlines()[0]}")
    else:
        pytest.fail("CUDA opened in a process that runs the ROCm stack")


@pytest.mark.rocm
def test_copies_round_trip_through_pinned_staging(rocm, rng):
    from morok_py.backends.rocm.allocator import STAGING_BYTES
    x = rng.standard_normal(STAGING_BYTES // 4 * 2 + 7).astype(np.float32)    # more than one staging chunk
    buf = Buffer.from_numpy(x, rocm)
    np.testing.assert_array_equal(buf.numpy(), x)
    other = rocm.buffer(x.size, dtypes.float32)
    buf.copy_to(other)                                    # device to device
    np.testing.assert_array_equal(other.numpy(), x)


@pytest.mark.rocm
@pytest.mark.multigpu
def test_transfer_between_two_rocm_devices(rocm, rng):
    hip = hip_module()
    err, count = hip.hipGetDeviceCount()
    if count < 2:
        pytest.skip(f"needs two AMD GPUs, found {count}")
    dev1 = registry.get_device("ROCM:1")
    x = rng.standard_normal(100_003).astype(np.float32)
    moved = Buffer.from_numpy(x, rocm).to(dev1)
    assert moved.device is dev1
    np.testing.assert_array_equal(moved.numpy(), x)
    prog = dev1.compile(K.unary("relu"), "relu")
    out = dev1.buffer(x.size, dtypes.float32)
    prog(moved, out, n=x.size)
    np.testing.assert_array_equal(out.numpy(), np.maximum(x, 0))
