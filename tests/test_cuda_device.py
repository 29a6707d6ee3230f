"""The CUDA device on real hardware: the layered path, timing, memory (OOM recovery, pinned copies,
transfers), arch checks at load, CUDA graphs, CPU validation, the method cache across two GPUs,
and the one-vendor-stack rule. Every test carries the `cuda` marker and skips with the reason when
there is no NVIDIA GPU or driver. (The kernel-family correctness suite, tests/test_kernels.py, runs
on both CUDA compiler pairs through the shared `device` fixture.)
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from morok_py import (Buffer, DeviceError, DeviceUnavailableError, ExecutionPlan, LaunchError, OutOfMemoryError,
                      RuntimeStackConflictError, UOp, ValidationError, dtypes, kernels as K)
from morok_py import cache
from morok_py.registry import get_device

pytestmark = pytest.mark.cuda

PAIRS = ["nvrtc", "llvm-nvptx"]


def open_cuda(name: str = "CUDA"):
    try:
        return get_device(name)
    except ImportError as e:
        pytest.skip(f"CUDA backend could not be imported: {e}")
    except (DeviceUnavailableError, RuntimeStackConflictError) as e:
        pytest.skip(str(e).splitlines()[0])


@pytest.fixture
def gpu():
    dev = open_cuda()
    if getattr(dev, "compile_only", False):
        pytest.skip(f"CUDA is compile-only here: {dev.reason}")
    return dev


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def fbuf(dev, a):
    return Buffer.from_numpy(np.ascontiguousarray(a).reshape(-1), dev)


@pytest.mark.parametrize("key", PAIRS)
def test_layered_path_runs_and_times_with_events(gpu, rng, key):
    r, c = gpu.pair(key)
    spec = r.render(K.add(), name="add")
    compiled = c.compile(spec)
    program = gpu.runtime(compiled)
    n = 100_003
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    A, B, C = fbuf(gpu, a), fbuf(gpu, b), gpu.buffer(n, dtypes.float32)
    gs, ls = spec.launch_dims({"n": n})
    t = program.execute([A.ptr, B.ptr, C.ptr], [n], gs, ls, wait=True)
    assert isinstance(t, float) and 0 < t < 1
    np.testing.assert_array_equal(C.numpy(), a + b)


@pytest.mark.parametrize("key", PAIRS)
def test_symbolic_program_reused_across_sizes_patches_only_arguments(gpu, rng, key):
    prog = gpu.compile(K.binary("mul"), compiler=key)
    for n in (1, 255, 256, 257, 70_001):
        a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        out = gpu.buffer(n, dtypes.float32)
        prog(fbuf(gpu, a), fbuf(gpu, b), out, n=n)
        np.testing.assert_array_equal(out.numpy(), a * b)


def test_empty_launch_is_a_no_op(gpu):
    prog = gpu.compile(K.add())
    e = gpu.buffer(0, dtypes.float32)
    r = gpu.renderer.render(K.add(), None)
    gs, ls = r.launch_dims({"n": 1})
    assert prog.execute([e.ptr, e.ptr, e.ptr], [1], (0, 0, 0), ls, wait=True) == 0.0


def test_info_names_the_gpu_and_working_pairs(gpu):
    info = gpu.info()
    assert info["name"] and info["arch"].startswith("sm_")
    assert info["compute_capability"] == "%d.%d" % gpu.compute_capability
    assert info["memory_total"] > info["memory_free"] > 0
    assert set(info["compilers"]) == {"nvrtc", "llvm-nvptx"}, info["compiler_status"]


# ---- memory -------------------------------------------------------------------------------------

def test_large_copies_go_through_pinned_staging_in_chunks(gpu, rng):
    n = (40 << 20) // 4 + 3     # 40 MiB: more than the 16 MiB staging buffer, not a multiple of it
    a = rng.standard_normal(n).astype(np.float32)
    buf = fbuf(gpu, a)
    np.testing.assert_array_equal(buf.numpy(), a)


def test_device_to_device_copy(gpu, rng):
    a = rng.standard_normal(1003).astype(np.float32)
    src = fbuf(gpu, a)
    dst = gpu.buffer(1003, dtypes.float32)
    src.copy_to(dst)
    np.testing.assert_array_equal(dst.numpy(), a)


def test_out_of_memory_frees_the_cache_retries_then_raises(gpu):
    alloc = gpu.allocator
    free, total = gpu.mem_info()
    old_limit = alloc.cache_limit
    alloc.cache_limit = total       # let a huge freed block sit in the cache
    try:
        big = int(free * 0.6) // 4 * 4
        b1 = gpu.buffer(big // 4, dtypes.float32)
        b1.free()
        assert alloc.cached_bytes >= big
        # a different size misses the cache; only freeing the cached block makes room for it
        b2 = gpu.buffer(big // 4 + 1024, dtypes.float32)
        assert alloc.cached_bytes == 0
        b2.free()
        alloc.free_cache()
        with pytest.raises(OutOfMemoryError) as ei:
            gpu.buffer(total // 4 * 2, dtypes.float32)   # twice the card
        e = ei.value
        assert isinstance(e, MemoryError) and e.nbytes == total // 4 * 2 * 4 and e.in_use >= 0
        assert "out of memory" in str(e)
    finally:
        alloc.cache_limit = old_limit
        alloc.free_cache()
    # the device still works after the failure
    out = gpu.buffer(10, dtypes.float32)
    gpu.compile(K.add())(fbuf(gpu, np.ones(10, np.float32)), fbuf(gpu, np.ones(10, np.float32)), out, n=10)
    np.testing.assert_array_equal(out.numpy(), np.full(10, 2, np.float32))


# ---- launch checks reach the device never -------------------------------------------------------

def test_launch_checks_refuse_bad_input_before_the_device(gpu, rng):
    prog = gpu.compile(K.add())
    a, b = fbuf(gpu, rng.standard_normal(10).astype(np.float32)), fbuf(gpu, rng.standard_normal(10).astype(np.float32))
    c = fbuf(gpu, np.full(10, 7.0, np.float32))
    with pytest.raises(LaunchError, match="holds 10 element"):
        prog(a, b, c, n=11)
    with pytest.raises(LaunchError, match="takes 3 buffer"):
        prog(a, b, n=10)
    with pytest.raises(LaunchError, match="float64"):
        prog(a, b, gpu.buffer(10, dtypes.float64), n=10)
    with pytest.raises(LaunchError, match="takes 3 buffers and 1 values"):
        prog.execute([a.ptr, b.ptr], [10], (1, 1, 1), (256, 1, 1))
    cpu = get_device("CPU")
    with pytest.raises(LaunchError, match="lives on CPU"):
        prog(a, b, Buffer.from_numpy(np.zeros(10, np.float32), cpu), n=10)
    np.testing.assert_array_equal(c.numpy(), np.full(10, 7.0, np.float32))


# ---- arch at load -------------------------------------------------------------------------------

def test_cubin_for_another_arch_fails_at_load_naming_both(gpu):
    from morok_py.backends.cuda import compile_only_pairs
    other = "sm_80" if gpu.arch != "sm_80" and not gpu.arch.startswith("sm_8") else "sm_90"
    r, c = compile_only_pairs(other)[0]
    compiled = c.compile(r.render(K.add(), "add"))
    with pytest.raises(DeviceError, match=f"compiled for {other} but {gpu.name} is {gpu.arch}"):
        gpu.runtime(compiled)


# ---- graphs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", PAIRS)
def test_plan_captured_as_a_cuda_graph_replays_the_same_result(gpu, rng, key):
    n, steps = 4099, 64
    add = gpu.compile(K.add(), compiler=key)
    x0 = rng.standard_normal(n).astype(np.float32)
    one = rng.standard_normal(n).astype(np.float32)
    bufs = [fbuf(gpu, x0)] + [gpu.buffer(n, dtypes.float32) for _ in range(steps)]
    inc = fbuf(gpu, one)
    plan = ExecutionPlan(gpu)
    for i in range(steps):
        plan.add(add, bufs[i], inc, bufs[i + 1], n="N")
    want = x0.copy()
    for _ in range(steps):
        want = want + one
    plan.run(N=n)
    gpu.synchronize()
    np.testing.assert_array_equal(bufs[-1].numpy(), want)
    bufs[-1].copyin(np.zeros(n, np.float32))
    plan.capture(N=n)
    assert plan.captured
    t = plan.run(wait=True, N=n)
    assert t is not None and t > 0
    np.testing.assert_array_equal(bufs[-1].numpy(), want)


def test_graph_replay_costs_well_under_a_launch_per_kernel(gpu, rng):
    n, steps, reps = 256, 200, 20
    add = gpu.compile(K.add())
    a = fbuf(gpu, rng.standard_normal(n).astype(np.float32))
    outs = [gpu.buffer(n, dtypes.float32) for _ in range(steps)]
    plan = ExecutionPlan(gpu, capture=False)      # launches replayed one by one
    for o in outs:
        plan.add(add, a, a, o, n=n)
    plan.run()
    gpu.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        plan.run()
    gpu.synchronize()
    eager = (time.perf_counter() - t0) / (reps * steps)
    plan.capture()
    plan.run()
    gpu.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        plan.run()
    gpu.synchronize()
    graph = (time.perf_counter() - t0) / (reps * steps)
    print(f"per kernel: eager {eager * 1e6:.2f} us, graph replay {graph * 1e6:.2f} us")
    assert graph < eager
    np.testing.assert_array_equal(outs[-1].numpy(), a.numpy() * 2)


# ---- validation ---------------------------------------------------------------------------------

def test_validate_with_cpu_catches_a_wrong_kernel_and_names_it(gpu, rng, monkeypatch):
    r, c = gpu.pair("nvrtc")
    add_bin = c.compile(r.render(K.add(), "add"))
    # the CUBIN of `add` presented as the kernel `a - b`: the CPU reference disagrees
    wrong = dataclasses.replace(add_bin, ast=K.binary("sub"))
    prog = gpu.runtime(wrong)
    n = 1003
    a, b = fbuf(gpu, rng.standard_normal(n).astype(np.float32)), fbuf(gpu, rng.standard_normal(n).astype(np.float32))
    out = gpu.buffer(n, dtypes.float32)
    monkeypatch.setenv("MOROK_VALIDATE_WITH_CPU", "1")
    with pytest.raises(ValidationError, match="kernel add"):
        prog(a, b, out, n=n)
    right = gpu.compile(K.add(), "add_ok")
    right(a, b, out, n=n)     # a correct kernel passes validation


# ---- one vendor stack, two GPUs -----------------------------------------------------------------

def test_opening_rocm_after_cuda_is_a_stack_conflict(gpu):
    from morok_py import registry
    assert registry.active_gpu_stack() == "CUDA"
    with pytest.raises(RuntimeStackConflictError, match="CUDA"):
        registry.claim_gpu_stack("ROCM")
    try:
        get_device("ROCM")
    except RuntimeStackConflictError as e:
        assert "CUDA" in str(e)
    except (DeviceUnavailableError, ImportError, ValueError):
        pass   # no ROCm backend here: the claim above is the rule under test


def _gpu_count() -> int:
    try:
        from cuda.bindings import driver as cu
        cu.cuInit(0)
        err, n = cu.cuDeviceGetCount()
        return int(n) if err == cu.CUresult.CUDA_SUCCESS else 0
    except Exception:
        return 0


@pytest.mark.multigpu
@pytest.mark.parametrize("key", PAIRS)
def test_two_gpus_share_compiled_bytes_and_compile_once(gpu, rng, key, monkeypatch):
    if _gpu_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    monkeypatch.setenv("MOROK_CACHE", "0")     # count real compiles, not disk hits
    g1 = open_cuda("CUDA:1")
    ast = K.binary("sub", dtype=dtypes.float32)
    name = f"two_gpu_sub_{key.replace('-', '_')}"
    before = cache.stats.compiles
    p0 = gpu.compile(ast, name, compiler=key)
    p1 = g1.compile(ast, name, compiler=key)
    assert cache.stats.compiles - before == 1
    assert p0 is not p1 and p0.device is gpu and p1.device is g1
    n = 1003
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    for dev, prog in ((gpu, p0), (g1, p1)):
        out = dev.buffer(n, dtypes.float32)
        prog(fbuf(dev, a), fbuf(dev, b), out, n=n)
        np.testing.assert_array_equal(out.numpy(), a - b)
    # peer transfer CUDA:0 -> CUDA:1
    moved = fbuf(gpu, a).to(g1)
    np.testing.assert_array_equal(moved.numpy(), a)


def test_a_remembered_launch_from_a_new_thread_makes_the_context_current(gpu, rng):
    import threading
    n = 1003
    add = gpu.compile(K.add())
    a, b = fbuf(gpu, rng.standard_normal(n).astype(np.float32)), fbuf(gpu, rng.standard_normal(n).astype(np.float32))
    out = gpu.buffer(n, dtypes.float32)
    add(a, b, out, n=n)                      # checked and remembered on this thread
    errors = []

    def other():
        try:
            add(a, b, out, n=n)              # no context is current on a new thread
            gpu.synchronize()
        except Exception as e:               # noqa: BLE001 - reported below
            errors.append(e)

    out.copyin(np.zeros(n, np.float32))
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert not errors, errors
    np.testing.assert_array_equal(out.numpy(), a.numpy() + b.numpy())
