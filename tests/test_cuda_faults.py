"""Faults on a CUDA GPU: out-of-memory under load goes through the allocator's free-and-retry and the
device works again after, and a kernel that faults through the raw `Program.execute` path (which skips
the launch check) surfaces as a DeviceError whose message says the context is lost (a sticky error).

The GPU tests carry the `cuda` marker and skip with the reason where there is no NVIDIA GPU; the
mapping of driver codes to ContextLostError is checked everywhere the cuda-bindings package imports."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from morok_py import (Buffer, DeviceError, DeviceUnavailableError, OutOfMemoryError, RuntimeStackConflictError,
                      dtypes, kernels as K)
from morok_py.errors import ContextLostError
from morok_py.registry import get_device

ROOT = Path(__file__).resolve().parent.parent


def open_gpu():
    try:
        dev = get_device("CUDA")
    except ImportError as e:
        pytest.skip(f"CUDA backend could not be imported: {e}")
    except (DeviceUnavailableError, RuntimeStackConflictError) as e:
        pytest.skip(str(e).splitlines()[0])
    if getattr(dev, "compile_only", False):
        pytest.skip(f"CUDA is compile-only here: {dev.reason}")
    return dev


# ---- the driver codes that lose the context (no GPU needed) ---------------------------------------

def test_sticky_cuda_errors_become_context_lost_errors():
    runtime = pytest.importorskip("morok_py.backends.cuda.runtime", reason="the cuda extra is not installed")
    cu = runtime.cu
    for name in ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_MISALIGNED_ADDRESS"):
        err = runtime.device_error("cuStreamSynchronize", getattr(cu.CUresult, name), "detail")
        assert isinstance(err, ContextLostError) and isinstance(err, DeviceError)
        assert err.name == name and "context is lost" in str(err) and "new one" in str(err)
        with pytest.raises(ContextLostError, match="context is lost"):
            runtime.check((getattr(cu.CUresult, name),), "cuMemcpyDtoH")
    plain = runtime.device_error("cuMemAlloc", cu.CUresult.CUDA_ERROR_INVALID_VALUE)
    assert type(plain) is DeviceError and "context is lost" not in str(plain)


def test_sticky_hip_errors_become_context_lost_errors():
    runtime = pytest.importorskip("morok_py.backends.rocm.runtime", reason="the rocm extra is not installed")
    hip_errors = pytest.importorskip("hip.hip", reason="hip-python is not installed").hipError_t
    err = runtime.device_error("hipStreamSynchronize", hip_errors.hipErrorIllegalAddress)
    assert isinstance(err, ContextLostError) and "context is lost" in str(err)
    assert type(runtime.device_error("hipMalloc", hip_errors.hipErrorInvalidValue)) is DeviceError


# ---- out of memory under load ---------------------------------------------------------------------

@pytest.mark.cuda
def test_out_of_memory_under_load_frees_the_cache_retries_and_recovers():
    """Fill the GPU in 1 GiB blocks while kernels run, with blocks of another size in the allocator's
    cache: the allocation that fails has freed the cache and retried first; after freeing, the same
    allocation succeeds and kernels give numpy's results."""
    gpu = open_gpu()
    alloc = gpu.allocator
    rng = np.random.default_rng(11)
    n = 1_000_003
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    prog = gpu.compile(K.add())
    X, Y, Z = (Buffer.from_numpy(v, gpu) for v in (x, y, np.zeros(n, np.float32)))
    calls: list[int] = []
    real_alloc = alloc._alloc

    def counted(nbytes: int) -> int:          # the driver's cuMemAlloc, counted
        calls.append(nbytes)
        return real_alloc(nbytes)

    alloc._alloc = counted
    held: list[Buffer] = []
    chunk = 1 << 30
    try:
        for _ in range(4):                    # 4 x 192 MiB blocks, freed into the cache
            held.append(gpu.buffer(192 << 20, dtypes.uint8))
        for b in held:
            b.free()
        held.clear()
        assert alloc.cached_bytes >= 4 * (192 << 20)
        err = None
        for _ in range(4096):
            prog(X, Y, Z, n=n)                # keep the GPU busy between allocations
            try:
                held.append(gpu.buffer(chunk, dtypes.uint8))
            except OutOfMemoryError as e:
                err = e
                break
        assert err is not None, "the GPU never ran out of memory"
        assert isinstance(err, MemoryError) and err.nbytes == chunk
        assert "cache already freed and retried" in str(err)
        assert calls[-2:] == [chunk, chunk], "the failed allocation was not retried"
        assert alloc.cached_bytes == 0, "the allocator's cache was not freed before the retry"
        gpu.synchronize()
        np.testing.assert_allclose(Z.numpy(), x + y, rtol=1e-6)
    finally:
        alloc._alloc = real_alloc
        for b in held:
            b.free()
        held.clear()
        alloc.free_cache()
    again = gpu.buffer(chunk, dtypes.uint8)   # the size that failed fits again
    again.free()
    alloc.free_cache()
    W = gpu.buffer(n, dtypes.float32)
    prog(Y, X, W, n=n)
    np.testing.assert_allclose(W.numpy(), x + y, rtol=1e-6)


# ---- a kernel that faults ------------------------------------------------------------------------

FAULT_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from morok_py import Buffer, DeviceError, kernels as K
    from morok_py.registry import get_device

    gpu = get_device("CUDA")
    prog = gpu.compile(K.add())
    rng = np.random.default_rng(3)
    n = 4099
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    a, b, c = (Buffer.from_numpy(v, gpu) for v in (x, y, np.zeros(n, np.float32)))
    gs, ls = prog.launch.launch_dims({"n": n})
    out = {}
    try:
        # the raw path skips the launch check: the output pointer is an unmapped address
        prog.execute([a.ptr, b.ptr, 0x10], [n], gs, ls)
        gpu.synchronize()
        out["fault"] = None
    except DeviceError as e:
        out["fault"] = [type(e).__name__, e.name, str(e)]
    try:
        prog(a, b, c, n=n)
        got = c.numpy()
        out["next"] = ["ok", bool(np.allclose(got, x + y, rtol=1e-6))]
    except DeviceError as e:
        out["next"] = [type(e).__name__, e.name, str(e)]
    print("RESULT " + json.dumps(out), flush=True)
""")


@pytest.mark.cuda
def test_a_faulting_kernel_is_a_device_error_and_the_next_launch_works_or_says_the_context_is_lost():
    open_gpu()      # skip here (not in the child) where there is no GPU
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", FAULT_SCRIPT], capture_output=True, text=True, timeout=300,
                         env=env, cwd=ROOT)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"the child printed no result (rc {run.returncode}):\n{run.stdout}\n{run.stderr[-4000:]}"
    assert run.returncode == 0, f"the child crashed (rc {run.returncode}):\n{run.stderr[-4000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    fault = out["fault"]
    assert fault is not None, "a write to an unmapped address raised nothing"
    kind, name, message = fault
    assert kind == "ContextLostError" and name in ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED"), fault
    assert "context is lost" in message and "start a new one" in message, message
    nxt = out["next"]
    if nxt[0] == "ok":
        assert nxt[1], "the launch after the fault gave a wrong result"
    else:
        assert nxt[0] == "ContextLostError" and "context is lost" in nxt[2], nxt
