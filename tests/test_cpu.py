"""The CPU device: arch override, compile errors, the host allocator, worker threads."""
from __future__ import annotations

import dataclasses
import platform

import numpy as np
import pytest

from morok_py import (CompileError, DeviceError, DeviceSpec, OutOfMemoryError, UOp, dtypes,
                      kernels as K)
from morok_py.backends.cpu import runtime as cpu_runtime
from morok_py.backends.cpu.allocator import ALIGN, HostAllocator
from morok_py.backends.cpu.compiler import CPUCompiler, host_cpu
from morok_py.backends.cpu.device import create_device


def other_cpu() -> str:
    host, _ = host_cpu()
    if platform.machine() in ("aarch64", "arm64"):
        return "cortex-a53" if host != "cortex-a53" else "neoverse-n1"
    return "skylake" if host != "skylake" else "znver3"


def test_arch_override_compiles_for_another_cpu_and_fails_at_load(monkeypatch):
    monkeypatch.setenv("MOROK_CPU_ARCH", other_cpu())
    dev = create_device(DeviceSpec.parse("CPU"))
    spec = dev.renderer.render(K.add(), name="add")
    compiled = dev.compiler.compile(spec)           # compile-only work needs no matching host
    assert compiled.arch == other_cpu() and compiled.bytes[:4] == b"\x7fELF"
    with pytest.raises(DeviceError, match=rf"compiled for cpu '{other_cpu()}', this host is '{host_cpu()[0]}'"):
        dev.runtime(compiled)


def test_arch_mismatch_also_fails_through_the_friendly_path(monkeypatch):
    monkeypatch.setenv("MOROK_CPU_ARCH", other_cpu())
    dev = create_device(DeviceSpec.parse("CPU"))
    with pytest.raises(DeviceError, match="ARCH_MISMATCH"):
        dev.compile(K.binary("mul"))


def test_compile_error_carries_log_numbered_source_and_command(cpu):
    renderer, compiler = cpu.pair()
    spec = renderer.render(K.add(), name="add")
    broken = dataclasses.replace(spec, src=spec.src.replace("fadd", "fadd_not_an_instruction", 1))
    with pytest.raises(CompileError) as exc:
        compiler.compile(broken)
    e = exc.value
    assert e.kernel == "add" and e.log and "fadd_not_an_instruction" in e.src
    assert "llc" in e.command
    assert " 1 | target triple" in str(e)       # the source, with line numbers
    assert "compiler log:" in str(e)


def test_compiler_is_deterministic(cpu):
    renderer, compiler = cpu.pair()
    spec = renderer.render(K.softmax(), name="softmax")
    assert compiler.compile(spec).bytes == compiler.compile(spec).bytes


def test_compiler_for_another_arch_needs_no_device():
    c = CPUCompiler(other_cpu())
    assert c.arch == other_cpu() and other_cpu() in c.identity()


# ---- the host allocator ----------------------------------------------------------------------

def test_allocations_are_64_byte_aligned():
    alloc = HostAllocator()
    handles = [alloc.alloc(n) for n in (1, 3, 100, 4097)]
    assert ALIGN == 64 and all(h % 64 == 0 for h in handles)


def test_freed_blocks_are_reused_by_size():
    alloc = HostAllocator()
    h = alloc.alloc(1000)
    alloc.free(h, 1000)
    assert alloc.cached_bytes == 1000
    assert alloc.alloc(1000) == h
    assert alloc.cached_bytes == 0


def test_buffers_reuse_cached_memory(cpu):
    a = cpu.empty(12345, dtypes.float32)
    ptr = a.ptr
    a.free()
    assert cpu.empty(12345, dtypes.float32).ptr == ptr


def test_out_of_memory_frees_the_cache_retries_then_raises():
    alloc = HostAllocator()
    h = alloc.alloc(1 << 20)
    alloc.free(h, 1 << 20)
    assert alloc.cached_bytes == 1 << 20
    with pytest.raises(OutOfMemoryError, match="out of memory allocating 1125899906842624 bytes") as exc:
        alloc.alloc(1 << 50)
    assert isinstance(exc.value, MemoryError)
    assert alloc.cached_bytes == 0                     # the cache was freed before the retry
    assert alloc.alloc(16) > 0                          # and the allocator still works


def test_out_of_memory_through_a_buffer(cpu):
    with pytest.raises(OutOfMemoryError):
        cpu.empty(1 << 48, dtypes.float32)


def test_negative_allocation_is_rejected():
    with pytest.raises(ValueError):
        HostAllocator().alloc(-1)


# ---- worker threads ---------------------------------------------------------------------------

def run_sum_rows_and_matmul(cpu, x, a, b):
    rows, cols = x.shape
    s = cpu.empty(rows, dtypes.float32)
    cpu.compile(K.reduce_axis("sum", [None, None], 1))(cpu.buf(x), s, d0=rows, d1=cols)
    M, Kd = a.shape
    N = b.shape[1]
    c = cpu.empty(M * N, dtypes.float32)
    cpu.compile(K.matmul())(cpu.buf(a), cpu.buf(b), c, M=M, N=N, K=Kd)
    return s.numpy(), c.numpy()


def test_one_and_two_threads_give_identical_results(cpu, rng, monkeypatch):
    x = rng.standard_normal((4099, 257)).astype(np.float32)
    a, b = rng.standard_normal((301, 203)).astype(np.float32), rng.standard_normal((203, 299)).astype(np.float32)
    monkeypatch.setenv("MOROK_CPU_THREADS", "1")
    s1, c1 = run_sum_rows_and_matmul(cpu, x, a, b)
    monkeypatch.setenv("MOROK_CPU_THREADS", "2")
    s2, c2 = run_sum_rows_and_matmul(cpu, x, a, b)
    np.testing.assert_array_equal(s1, s2)
    np.testing.assert_array_equal(c1, c2)
    np.testing.assert_allclose(c2.reshape(301, 299), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


def test_large_kernels_run_on_the_worker_pool(cpu, rng, monkeypatch):
    monkeypatch.setenv("MOROK_CPU_THREADS", "3")
    n = cpu_runtime.PARALLEL_MIN_WORK * 4 + 3
    x = rng.standard_normal(n).astype(np.float32)
    out = cpu.empty(n, dtypes.float32)
    cpu.compile(K.unary("neg"))(cpu.buf(x), out, n=n)
    assert cpu_runtime._pool_size == 3
    np.testing.assert_array_equal(out.numpy(), -x)


def test_negative_thread_count_is_rejected(cpu, rng, monkeypatch):
    monkeypatch.setenv("MOROK_CPU_THREADS", "-2")
    x = rng.standard_normal(5).astype(np.float32)
    with pytest.raises(ValueError, match="MOROK_CPU_THREADS"):   # at the first launch with these values
        cpu.compile(K.unary("neg"), name="neg_bad_threads")(cpu.buf(x), cpu.empty(5, dtypes.float32), n=5)


def test_dropping_programs_does_not_break_later_compiles(cpu, rng):
    # regression: each loaded program's JIT engine owned the compiler's TargetMachine and freed it
    from morok_py import cache
    for i in range(5):
        cache.clear_memory_caches()
        x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)
        r = UOp.range(9, 0)
        prog = cpu.compile(UOp.sink(out.store(r, x.load(r) + float(i) + 0.25)))
        data = rng.standard_normal(9).astype(np.float32)
        o = cpu.empty(9, dtypes.float32)
        prog(cpu.buf(data), o)
        del prog
        np.testing.assert_allclose(o.numpy(), data + np.float32(i + 0.25), rtol=1e-6)


# ---- streaming (non-temporal) stores ---------------------------------------------------------

x86_only = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                              reason="the streaming variant is built for x86-64 only")


@x86_only
def test_elementwise_kernels_get_a_streaming_variant_with_non_temporal_stores(cpu):
    renderer, compiler = cpu.pair()
    spec = renderer.render(K.add(), name="add")
    assert "@add__stream(" in spec.src
    asm = compiler.disassemble(spec)
    plain, stream = asm.split("add__stream:", 1)
    assert "movnt" in stream and "movnt" not in plain


def test_kernels_that_reduce_or_read_their_output_have_no_streaming_variant(cpu):
    renderer, _ = cpu.pair()
    x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)
    i = UOp.range(UOp.variable("n", 1, 1 << 30), 0)
    accumulate = UOp.sink(out.store(i, out.load(i) + x.load(i)))
    for ast in (K.sum_all(), K.matmul(), K.softmax(), accumulate):
        assert "__stream" not in renderer.render(ast).src


@x86_only
@pytest.mark.parametrize("n,threads", [(10007, 3), (64 * 5 + 1, 2), (100, 1)])
@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
def test_streaming_variant_matches_numpy(cpu, rng, monkeypatch, n, threads, symbolic):
    monkeypatch.setattr(cpu_runtime, "STREAM_MIN_BYTES", 0)      # stream at any size
    monkeypatch.setattr(cpu_runtime, "PARALLEL_MIN_WORK", 1)     # and split whatever can be split
    monkeypatch.setenv("MOROK_CPU_THREADS", str(threads))
    prog = cpu.compile(K.add(None if symbolic else n), name=f"stream_add_{n}_{threads}_{int(symbolic)}")
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    out = cpu.empty(n, dtypes.float32)
    prog(cpu.buf(a), cpu.buf(b), out, **({"n": n} if symbolic else {}))
    assert prog._plan([n] if symbolic else []) == (True, n >= threads * 64)
    np.testing.assert_array_equal(out.numpy(), a + b)


@x86_only
def test_misaligned_output_takes_the_plain_variant(cpu, rng, monkeypatch):
    monkeypatch.setattr(cpu_runtime, "STREAM_MIN_BYTES", 0)
    n = 4099
    prog = cpu.compile(K.add(), name="stream_add_misaligned")
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    da, db, out = cpu.buf(a), cpu.buf(b), cpu.buf(np.full(n + 1, 7.0, np.float32))
    gs, ls = prog.launch.launch_dims({"n": n})
    prog.execute([da.ptr, db.ptr, out.ptr + 4], [n], gs, ls)   # 4 bytes past a 64-byte line
    got = out.numpy()
    assert got[0] == 7.0
    np.testing.assert_array_equal(got[1:], a + b)
