"""The CPU device: arch override, compile errors, the host allocator, worker threads."""
from __future__ import annotations

import ctypes
import dataclasses
import platform

import time

import numpy as np
import pytest

from morok_py import (AxisType, CompileError, DeviceError, DeviceSpec, Ops, OutOfMemoryError, UOp, dtypes,
                      kernels as K)
from morok_py.backends.cpu import runtime as cpu_runtime
from morok_py.backends.cpu.allocator import ALIGN, HostAllocator
from morok_py.backends.cpu.compiler import CPUCompiler, host_cpu
from morok_py.backends.cpu.device import create_device
from morok_py.backends.cpu.features import load_mismatch


def other_cpu() -> str:
    """A CPU whose code this host cannot run: one with features the host lacks (x86-64-v4 on an AVX2
    host), else one whose features are not known here."""
    host, features = host_cpu()
    if platform.machine() in ("aarch64", "arm64"):
        return "cortex-a53" if host != "cortex-a53" else "neoverse-n1"
    for cpu in ("x86-64-v4", "skylake-avx512", "sapphirerapids"):
        if cpu != host and load_mismatch(cpu, host, features) is not None:
            return cpu
    return "bonnell" if host != "bonnell" else "atom"


def test_arch_override_compiles_for_another_cpu_and_fails_at_load(monkeypatch):
    monkeypatch.setenv("MOROK_CPU_ARCH", other_cpu())
    dev = create_device(DeviceSpec.parse("CPU"))
    spec = dev.renderer.render(K.add(), name="add")
    compiled = dev.compiler.compile(spec)           # compile-only work needs no matching host
    assert compiled.arch == other_cpu() and compiled.bytes[:4] == b"\x7fELF"
    with pytest.raises(DeviceError, match=rf"ARCH_MISMATCH.*compiled for cpu '{other_cpu()}': .*'{host_cpu()[0]}'"):
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


def split_at(monkeypatch, lo: int, hi: int) -> None:
    """Split thresholds (in memory accesses) for both pools: the Python executor's and the native one's."""
    for name, v in (("PARALLEL_MIN_WORK", lo), ("PARALLEL_SURE_WORK", hi), ("NATIVE_MIN_WORK", lo),
                    ("NATIVE_SURE_WORK", hi)):
        monkeypatch.setattr(cpu_runtime, name, v)


def lane_tiles_on_threads(cpu, monkeypatch, threads: int = 3, render_threads: int = 0):
    """(renderer, compiler) of the host pair for a register-tile test: every kernel split over `threads`
    threads; `render_threads`: the workers the renderer's split balances (Capabilities.threads; 0: the
    host's, as the device read them); skipped where the pair prints no tile lanes."""
    split_at(monkeypatch, 1, 1)
    monkeypatch.setenv("MOROK_CPU_THREADS", str(threads))
    renderer, compiler = cpu.pair()
    if not renderer.caps.tile_lanes:
        pytest.skip("this pair prints no tile lanes")
    if render_threads:
        import dataclasses
        monkeypatch.setattr(renderer, "caps", dataclasses.replace(renderer.caps, threads=render_threads))
    return renderer, compiler


@pytest.fixture(params=["native", "python"])
def pool(request, monkeypatch):
    """Each split launch on the native workers (backends/cpu/pool.py) and on the Python executor."""
    monkeypatch.setenv("MOROK_CPU_POOL", request.param)
    return request.param


def test_one_and_two_threads_give_identical_results(cpu, rng, monkeypatch, pool):
    x = rng.standard_normal((4099, 257)).astype(np.float32)
    a, b = rng.standard_normal((301, 203)).astype(np.float32), rng.standard_normal((203, 299)).astype(np.float32)
    monkeypatch.setenv("MOROK_CPU_THREADS", "1")
    s1, c1 = run_sum_rows_and_matmul(cpu, x, a, b)
    monkeypatch.setenv("MOROK_CPU_THREADS", "2")
    s2, c2 = run_sum_rows_and_matmul(cpu, x, a, b)
    np.testing.assert_array_equal(s1, s2)
    np.testing.assert_array_equal(c1, c2)
    np.testing.assert_allclose(c2.reshape(301, 299), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


def test_large_kernels_run_on_the_worker_pool(cpu, rng, monkeypatch, pool):
    monkeypatch.setenv("MOROK_CPU_THREADS", "3")
    split_at(monkeypatch, cpu_runtime.PARALLEL_MIN_WORK, cpu_runtime.PARALLEL_MIN_WORK)   # no trial zone
    n = cpu_runtime.PARALLEL_MIN_WORK * 4 + 3
    x = rng.standard_normal(n).astype(np.float32)
    out = cpu.empty(n, dtypes.float32)
    prog = cpu.compile(K.unary("neg"))
    prog(cpu.buf(x), out, n=n)
    if pool == "python":
        assert cpu_runtime._pool_size == 3 and prog._native_pool() is None
    else:
        from morok_py.backends.cpu.pool import native_pool_error
        assert prog._native_pool() is not None, native_pool_error()
        assert prog._native_pool().workers >= 2
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
    assert f"@{spec.symbol}__stream(" in spec.src
    asm = compiler.disassemble(spec)
    plain, stream = asm.split(f"{spec.symbol}__stream:", 1)
    assert "movnt" in stream and "movnt" not in plain


def test_only_vector_stores_of_16_bytes_or_more_are_made_non_temporal():
    """Narrow non-temporal stores fill write-combining buffers in pieces (an im2col whose rows came out as
    <2 x float> stores took 35 ms instead of 3 for 58 MB): they stay plain, as do under-aligned ones."""
    from morok_py.backends.cpu.compiler import STREAM_MIN_STORE_BYTES, mark_streaming_stores
    assert STREAM_MIN_STORE_BYTES == 16
    ir = "\n".join([
        "define void @k(ptr %p) {",
        "  store <2 x float> %a, ptr %p, align 8",
        "  store <4 x float> %b, ptr %p, align 16",
        "  store <8 x float> %c, ptr %p, align 32",
        "  store <8 x float> %d, ptr %p, align 4",
        "  store <16 x i8> %e, ptr %p, align 16",
        "  store <4 x i16> %f, ptr %p, align 8",
        "}"])
    out, n = mark_streaming_stores(ir, "k")
    marked = [line for line in out.split("\n") if "!nontemporal" in line]
    assert n == 3 and [m.split(",")[0].split()[1:3] for m in marked] == [["<4", "x"], ["<8", "x"], ["<16", "x"]]
    assert "align 8, !nontemporal" not in out and "align 4, !nontemporal" not in out


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
def test_streaming_variant_matches_numpy(cpu, rng, monkeypatch, n, threads, symbolic, pool):
    monkeypatch.setattr(cpu_runtime, "STREAM_MIN_BYTES", 0)      # stream at any size
    split_at(monkeypatch, 1, 1)     # and split whatever can be split
    monkeypatch.setenv("MOROK_CPU_THREADS", str(threads))
    prog = cpu.compile(K.add(None if symbolic else n), name=f"stream_add_{n}_{threads}_{int(symbolic)}")
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    out = cpu.empty(n, dtypes.float32)
    prog(cpu.buf(a), cpu.buf(b), out, **({"n": n} if symbolic else {}))
    assert prog._plan([n] if symbolic else [])[:2] == [cpu_runtime._SPLIT, n >= threads * 64]
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


# ---- register tiles (codegen/opt.py) ----------------------------------------------------------

def matmul_into_nan(cpu, prog, a, b, **sizes):
    """C = A @ B into a buffer prefilled with NaN: an output the kernel never writes stays NaN."""
    M, N = a.shape[0], b.shape[1]
    out = cpu.buf(np.full(M * N, np.nan, np.float32))
    prog(cpu.buf(a), cpu.buf(b), out, **sizes)
    return out.numpy().reshape(M, N)


# (M, K, N): sizes below, at and above the tile (8 x 32 with AVX-512, 6 x 16 with AVX2), not multiples
TILE_SHAPES = [(1, 5, 1), (7, 3, 9), (13, 17, 10), (9, 31, 33), (33, 20, 65), (100, 64, 47), (8, 5, 32),
               (17, 9, 8), (65, 13, 4), (129, 40, 100), (16, 16, 31), (512, 64, 10),
               # row tiles with no useful divisor (53 on AVX2's 4-row narrow tile, 51 on AVX-512's 5): as
               # many partitions as wanted, the leftover rows dealt round-robin and clamped
               (215, 37, 10), (256, 40, 10), (433, 9, 20)]


@pytest.mark.parametrize("M,Kd,N", TILE_SHAPES)
@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
def test_register_tiled_matmul_matches_numpy(cpu, rng, monkeypatch, M, Kd, N, symbolic):
    split_at(monkeypatch, 1, 1)     # split even small ones over threads
    monkeypatch.setenv("MOROK_CPU_THREADS", "3")
    a, b = rng.standard_normal((M, Kd)).astype(np.float32), rng.standard_normal((Kd, N)).astype(np.float32)
    if symbolic:
        prog = cpu.compile(K.matmul(), name="tile_mm_symbolic")
        got = matmul_into_nan(cpu, prog, a, b, M=M, N=N, K=Kd)
    else:
        got = matmul_into_nan(cpu, cpu.compile(K.matmul(M, N, Kd), name=f"tile_mm_{M}_{Kd}_{N}"), a, b)
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4 * np.sqrt(Kd))


def test_one_symbolic_tiled_program_serves_every_region(cpu, rng):
    # one program, N above, between and below the tile widths (each runs a different guarded region)
    prog = cpu.compile(K.matmul(), name="tile_mm_regions")
    for M, Kd, N in [(50, 7, 100), (50, 7, 33), (50, 7, 20), (50, 7, 9), (50, 7, 3), (3, 7, 50)]:
        a, b = rng.standard_normal((M, Kd)).astype(np.float32), rng.standard_normal((Kd, N)).astype(np.float32)
        got = matmul_into_nan(cpu, prog, a, b, M=M, N=N, K=Kd)
        np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sizes", [(512, 10, 512), (1000, 1000, 1000), (513, 33, 257), None],
                         ids=["narrow", "square", "odd", "symbolic"])
def test_register_tiles_leave_no_serial_tail(cpu, sizes):
    """Every store of the output sits inside the thread-split loop: no leftover rows or columns run on one
    thread. Before it, each call may only fill its own packing scratch (a remainder region's columns)."""
    renderer, _ = cpu.pair()
    spec = renderer.render(K.matmul(*(sizes or (None,) * 3)))
    kernel = spec.linear
    from morok_py.codegen.linear import L, Loop
    hidden = {p.slot for p in spec.launch.params} ^ {p.slot for p in kernel.params}

    def stores(items):
        for it in items:
            if isinstance(it, Loop):
                yield from stores(it.body)
            elif getattr(it, "kind", None) is L.STORE:
                yield it
    outer = [it for it in kernel.body if isinstance(it, Loop) and it.kind is AxisType.GLOBAL]
    assert len(outer) == 1
    for loop in (it for it in kernel.body if isinstance(it, Loop) and it.kind is not AxisType.GLOBAL):
        assert all(st.src[0].arg in hidden for st in stores(loop.body)), "a loop before the split writes the output"
    assert not [it for it in kernel.body if not isinstance(it, Loop) and getattr(it, "kind", None) is L.STORE]
    assert not [it for it in kernel.body if not isinstance(it, (Loop,)) and hasattr(it, "body")]   # no If


@pytest.mark.parametrize("N,G,COg,Kg,P,blocks", [(8, 1, 130, 40, 49, 1), (3, 2, 70, 37, 101, 1), (5, 3, 13, 7, 50, 1),
                                                  (4, 1, 40, 24, 196, 2)])
def test_a_batched_contraction_splits_its_images_and_tiles_over_the_threads_together(cpu, rng, monkeypatch, N, G,
                                                                                      COg, Kg, P, blocks):
    """conv_gemm over a batch (and groups): the store's other GLOBAL ranges join the register tile's units in
    one thread-split range (opt.tile_with_lanes), so for twice as many workers as (image, group, block)
    units, 8 images of 49 pixels are more than 8 units on every tile width (AVX-512's 6x64 tile makes one
    column tile of them: for 2 or 3 workers whole images are the balanced split there); every output
    written once (NaN-filled) and equal to numpy's, on that many threads, with a remainder of columns, tail
    rows, packed and unpacked panels."""
    T = 2 * N * G * blocks
    renderer, compiler = lane_tiles_on_threads(cpu, monkeypatch, threads=T, render_threads=T)
    spec = renderer.render(K.conv_gemm(N, G, COg, Kg, P, pixel_blocks=blocks), f"batched_{N}_{G}_{P}")
    from morok_py.codegen.linear import Loop
    from morok_py.ir import AxisType
    loops = [it for it in spec.linear.body if isinstance(it, Loop) and it.kind is AxisType.GLOBAL]
    assert len(loops) == 1
    units = spec.launch_dims({})[0][0]
    assert units % (N * G * blocks) == 0 and units > N * G * blocks, units      # images x groups x tile units
    x = rng.standard_normal((N, G * Kg, P)).astype(np.float32)
    w = rng.standard_normal((G * COg, Kg)).astype(np.float32)
    out = cpu.buf(np.full(N * G * COg * P, np.nan, np.float32))
    cpu.dev.runtime(compiler.compile(spec))(cpu.buf(x), cpu.buf(w), out)
    want = np.concatenate([np.einsum("ok,nkp->nop", w[g * COg:(g + 1) * COg].astype(np.float64),
                                     x[:, g * Kg:(g + 1) * Kg].astype(np.float64)) for g in range(G)], axis=1)
    np.testing.assert_allclose(out.numpy().reshape(want.shape), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("rem,width", [(1, 4), (4, 4), (5, 8), (8, 8), (9, 16), (16, 16)])
def test_a_remainder_region_is_one_vector_of_the_fewest_lanes_that_hold_it(cpu, rng, monkeypatch, rem, width):
    """AVX-512's 64-wide tile leaves remainders of up to 16 columns: each is one vector ending at N of 4, 8 or
    16 lanes (not scalar columns), overlapping the last tile; every output written once more with the same
    value (NaN-filled), on several threads, against numpy."""
    from morok_py.codegen.schedule import Schedule, using
    renderer, compiler = lane_tiles_on_threads(cpu, monkeypatch)
    N, M = 3 * 64 + rem, 50
    with using(Schedule("threads", register_tile=(6, 64), tile_lanes=16, prefetch=True)):
        spec = renderer.render(K.matmul(M, N, 70), f"rem_lanes_{rem}")
    assert "fadd reassoc contract float " not in spec.src         # no scalar accumulator
    assert f"<{width} x float>" in spec.src
    a = rng.standard_normal((M, 70)).astype(np.float32)
    b = rng.standard_normal((70, N)).astype(np.float32)
    out = cpu.buf(np.full(M * N, np.nan, np.float32))
    cpu.dev.runtime(compiler.compile(spec))(cpu.buf(a), cpu.buf(b), out)
    np.testing.assert_allclose(out.numpy().reshape(M, N), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("tile,lanes,M,N,want", [
    ((6, 16), 8, 1, 1000, (1, 64)), ((6, 16), 8, 2, 1000, (2, 32)), ((6, 16), 8, 5, 1000, (5, 16)),
    ((6, 16), 8, 1, 200, (1, 16)), ((6, 64), 16, 1, 1000, (1, 64)), ((6, 64), 16, 1, 4096, (1, 128)),
    ((6, 16), 8, 6, 1000, (6, 16)), ((6, 16), 8, None, 1000, (6, 16))])
def test_a_contraction_of_few_static_rows_gets_wider_column_tiles(cpu, rng, monkeypatch, tile, lanes, M, N, want):
    """opt.tile_for: fewer static rows than the target's tile (a classifier at batch 1) widen the columns, up
    to GEMV_TILE_VECTORS lane vectors in all while GEMV_MIN_UNITS column tiles remain; AVX2's and AVX-512's
    tiles alike (explicit here), a symbolic M untouched. The widened kernel matches numpy on several threads,
    every output written (NaN-filled), N not a multiple of the tile."""
    from morok_py.codegen.opt import GEMV_MIN_UNITS, GEMV_TILE_VECTORS, tile_for
    from morok_py.codegen.schedule import Schedule, using
    got = tile_for(K.matmul(M, N, 300), tile, lanes)
    assert got == want, got
    if got != (tile[0] if M is None else M, tile[1]):
        assert got[0] * got[1] // lanes <= GEMV_TILE_VECTORS and -(-N // got[1]) >= GEMV_MIN_UNITS
    if M is None:
        return
    renderer, compiler = lane_tiles_on_threads(cpu, monkeypatch)
    with using(Schedule("threads", register_tile=got, tile_lanes=lanes, prefetch=True)):
        spec = renderer.render(K.matmul(M, N + 3, 300), f"gemv_{M}_{got[1]}")
    a = rng.standard_normal((M, 300)).astype(np.float32)
    b = rng.standard_normal((300, N + 3)).astype(np.float32)
    out = cpu.buf(np.full(M * (N + 3), np.nan, np.float32))
    cpu.dev.runtime(compiler.compile(spec))(cpu.buf(a), cpu.buf(b), out)
    np.testing.assert_allclose(out.numpy().reshape(M, N + 3), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("tile,lanes,N,want", [
    ((6, 64), 16, 49, (6, 48)), ((6, 64), 16, 36, (6, 32)), ((6, 64), 16, 52, (6, 48)), ((6, 64), 16, 48, (6, 48)),
    ((6, 64), 16, 57, (6, 32)), ((6, 64), 16, 20, (4, 16)), ((6, 16), 8, 10, (4, 8)), ((6, 16), 8, 16, (6, 16)),
    ((6, 64), 16, 68, (4, 64)), ((6, 64), 16, 64, (6, 64)), ((6, 16), 8, 20, (3, 16)), ((6, 16), 8, 17, (3, 16))])
def test_few_columns_take_whole_lane_vectors_and_a_merged_remainder(cpu, rng, monkeypatch, tile, lanes, N, want):
    """opt.tile_for: a static N below the target's tile width, of MERGED_MIN_VECTORS lane vectors or more and a
    remainder of at most LANE_REMAINDER columns, is one tile of whole vectors with the remainder merged (a 7x7
    layer's 49 pixels: 48 + 4 on AVX-512, not two overlapping 32-wide tiles), rows as many as the target
    tile's registers hold (`opt.merged_rows`: its rows plus one times its vectors, less MERGED_SPARE_REGISTERS),
    and a remainder merged into a single full-width tile (N = 68 on AVX-512, 20 on AVX2) takes
    as few rows; other widths keep the power-of-two rule. Tiles given explicitly (AVX2's and
    AVX-512's), so any host checks both; the chosen tile's kernel matches numpy on several threads with every
    output written (NaN-filled); 16 lanes on an AVX2 host are two registers each."""
    from morok_py.codegen.opt import LANE_REMAINDER, MERGED_MIN_VECTORS, MERGED_SPARE_REGISTERS, tile_for
    from morok_py.codegen.schedule import Schedule, using
    got = tile_for(K.matmul(96, N, 300), tile, lanes)
    assert got == want, got
    if N >= MERGED_MIN_VECTORS * lanes and N % lanes <= LANE_REMAINDER:
        per_row = got[1] // lanes + (N % lanes > 0)
        assert got[1] == N - N % lanes and got[0] * per_row <= tile[0] * tile[1] // lanes
        if N % lanes:       # accumulators and B's vectors within the target tile's registers, less the spare
            assert (got[0] + 1) * per_row <= (tile[0] + 1) * tile[1] // lanes - MERGED_SPARE_REGISTERS
    renderer, compiler = lane_tiles_on_threads(cpu, monkeypatch)
    M = 97
    with using(Schedule("threads", register_tile=got, tile_lanes=lanes, prefetch=True)):
        spec = renderer.render(K.matmul(M, N, 300), f"narrow_{N}_{got[1]}")
    a = rng.standard_normal((M, 300)).astype(np.float32)
    b = rng.standard_normal((300, N)).astype(np.float32)
    out = cpu.buf(np.full(M * N, np.nan, np.float32))
    cpu.dev.runtime(compiler.compile(spec))(cpu.buf(a), cpu.buf(b), out)
    np.testing.assert_allclose(out.numpy().reshape(M, N), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)
    # the same tile with the rows and the reduction symbolic (one program, several sizes)
    assert tile_for(K.matmul(None, N, None), tile, lanes) == got
    with using(Schedule("threads", register_tile=got, tile_lanes=lanes, prefetch=True)):
        prog = cpu.dev.runtime(compiler.compile(renderer.render(K.matmul(None, N, None), f"narrow_sym_{N}_{got[1]}")))
    for m, kd in [(1, 7), (13, 130)]:
        a = rng.standard_normal((m, kd)).astype(np.float32)
        b = rng.standard_normal((kd, N)).astype(np.float32)
        out = cpu.buf(np.full(m * N, np.nan, np.float32))
        prog(cpu.buf(a), cpu.buf(b), out, M=m, K=kd)
        np.testing.assert_allclose(out.numpy().reshape(m, N), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("threads", [1, 2, 16])
@pytest.mark.parametrize("tile,lanes,N", [((6, 48), 16, 49), ((4, 8), 8, 10), ((6, 32), 16, 35)])
def test_a_merged_remainder_sums_in_the_tiles_loop_at_any_thread_count(cpu, rng, monkeypatch, threads, tile, lanes, N):
    """A tile with its remainder merged (48 + 4 columns for N = 49 on AVX-512) computes all its sums in one
    reduction loop, whatever the thread count: one row partition (a single worker) once left the remainder's
    stores without the thread-split range, so they formed groups of their own and every row and vector got a
    K loop of its own (matmul(512, 49, 576) on one thread of the 16-core AVX-512 Xeon, 4.5x slower). Counted in
    the rendered loops over K (a static 300: the row tiles' loop and the leftover rows' one), then run against
    numpy with every output written (NaN-filled)."""
    import re
    from morok_py.codegen.schedule import Schedule, using
    renderer, compiler = lane_tiles_on_threads(cpu, monkeypatch)
    monkeypatch.setattr(renderer, "caps", dataclasses.replace(renderer.caps, threads=threads))
    M, Kd = 97, 300
    with using(Schedule("threads", register_tile=tile, tile_lanes=lanes, prefetch=True)):
        spec = renderer.render(K.matmul(M, N, Kd), f"merged_{N}_{threads}")
    k_loops = re.findall(r"icmp slt i32 %\w+, 300\b", spec.src)
    assert len(k_loops) == 2, (len(k_loops), spec.linear.schedule)
    a = rng.standard_normal((M, Kd)).astype(np.float32)
    b = rng.standard_normal((Kd, N)).astype(np.float32)
    out = cpu.buf(np.full(M * N, np.nan, np.float32))
    cpu.dev.runtime(compiler.compile(spec))(cpu.buf(a), cpu.buf(b), out)
    np.testing.assert_allclose(out.numpy().reshape(M, N), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("M,tail", [(1020, 0), (1024, 4), (1023, 3), (1001, 5)])
def test_leftover_rows_of_a_static_matmul_form_one_tile(M, tail):
    """M % 6 leftover rows of AVX2's 6 x 16 tile (two 8-lane vectors a row) are one tile of that many rows,
    not rows one at a time with two accumulators each (1024^3, one thread: 4 such rows cost 1.8 ms of 60)."""
    from morok_py.codegen.opt import tile_with_lanes
    sink, _, _ = tile_with_lanes(K.matmul(M, 1024, 1024), (6, 16), 8, threads=2)
    assert sum(1 for n in sink.toposort() if n.op is Ops.STORE) == (6 + tail) * 2


def test_work_counts_every_load_and_store_a_launch_executes(cpu):
    add = cpu.compile(K.add(), name="work_add")
    assert cpu_runtime.memory_accesses(add.launch, {"n": 1000}) == 3000
    # sizes from the pair's own register tile (6x16 on AVX2, 6x64 on AVX-512, 4x8 otherwise): whole
    # tiles, 8 row tiles by 4 column tiles, so no overlapping column tile and no tail rows; K under
    # opt.PACK_MIN_K, so that no panel is packed (the copies are not counted: AVX-512's 256 columns are
    # 1 KiB rows, which a K of 64 would pack)
    ti, tj = cpu.pair()[0].caps.register_tile
    M, N, Kd = 8 * ti, 4 * tj, 48
    mm = cpu.compile(K.matmul(M, N, Kd), name="work_mm")
    # per k step of a tile: ti loads of A (one per row) and tj of B (one per column); one store an output
    assert cpu_runtime.memory_accesses(mm.launch, {}) == M * N * Kd // tj + M * N * Kd // ti + M * N


def test_between_the_thresholds_the_faster_of_alone_and_split_is_measured(cpu, rng, monkeypatch):
    split_at(monkeypatch, 1, 1 << 62)
    monkeypatch.setenv("MOROK_CPU_THREADS", "2")
    monkeypatch.setattr(cpu_runtime, "RETRIAL_EVERY", 4)
    monkeypatch.setattr(cpu_runtime, "RETRIAL_FIRST", 4)
    n = 100_003
    prog = cpu.compile(K.add(), name="trial_add")
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    da, db, out = cpu.buf(a), cpu.buf(b), cpu.empty(n, dtypes.float32)
    for _ in range(2 * cpu_runtime.SPLIT_TRIALS + 1):
        out.copyin(np.zeros(n, np.float32))
        prog(da, db, out, n=n)
        np.testing.assert_array_equal(out.numpy(), a + b)
    plan = prog._plans[(n,)]
    assert plan[0] in (cpu_runtime._ONE, cpu_runtime._SPLIT)
    assert len(plan[2]) == len(plan[3]) == cpu_runtime.SPLIT_TRIALS
    # the order holds two splits in a row (one of them with warm workers) and SPLIT_TRIALS of each
    order = cpu_runtime.TRIAL_ORDER
    assert "SS" in order and order.count("S") == order.count("A") == cpu_runtime.SPLIT_TRIALS
    # the verdict is retried after RETRIAL_EVERY (split) or RETRIAL_FIRST (one thread) launches: the trial
    # starts over, then decides again
    seen_trial = False
    for _ in range(4 + len(order)):
        prog(da, db, out, n=n)
        seen_trial |= plan[0] is cpu_runtime._TRIAL
    np.testing.assert_array_equal(out.numpy(), a + b)
    assert seen_trial and plan[0] in (cpu_runtime._ONE, cpu_runtime._SPLIT)
    assert len(plan[2]) == len(plan[3]) == cpu_runtime.SPLIT_TRIALS


def _add_logging_splits(cpu, rng, monkeypatch, name: str, n: int):
    """An add program over n random floats whose split launches log their thread counts: (program, the log,
    the inputs, their buffers and the output's)."""
    prog = cpu.compile(K.add(), name=name)
    seen: list[int] = []
    real = prog._parallel
    monkeypatch.setattr(prog, "_parallel", lambda fn, b, v, e, threads, *rest: (seen.append(threads), real(fn, b, v, e, threads, *rest)))
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    return prog, seen, (a, b), (cpu.buf(a), cpu.buf(b), cpu.empty(n, dtypes.float32))


def test_a_split_between_the_thresholds_takes_one_thread_per_share_of_work(cpu, rng, monkeypatch):
    """Between the thresholds a split takes at most one thread per SPLIT_WORK_PER_THREAD accesses (at
    least two), however many MOROK_CPU_THREADS allows; past the upper threshold it takes them all. (The
    rule by time alone is set out of reach here; the next test takes it.)"""
    monkeypatch.setenv("MOROK_CPU_THREADS", "8")
    monkeypatch.setattr(cpu_runtime, "SPLIT_MIN_CHUNK_S", 1e9)
    n = 100_003                 # 300K accesses
    prog, seen, (a, b), (da, db, out) = _add_logging_splits(cpu, rng, monkeypatch, "cap_add", n)
    for lo, hi, want in ((1, 1 << 62, max(2, 3 * n // cpu_runtime.SPLIT_WORK_PER_THREAD)), (1, 2, 8)):
        split_at(monkeypatch, lo, hi)
        prog._plans.clear()
        seen.clear()
        for _ in range(len(cpu_runtime.TRIAL_ORDER) + 2):
            prog(da, db, out, n=n)
        np.testing.assert_array_equal(out.numpy(), a + b)
        assert seen and set(seen) == {min(8, want)}, (seen, want)


def test_a_trial_raises_the_split_by_the_launch_time_alone(cpu, rng, monkeypatch):
    """A trial's runs alone raise the most threads a split takes to one per SPLIT_MIN_CHUNK_S of the fastest
    of them, never below the rule by counted accesses: with a chunk of a microsecond the 300K-access add (its
    accesses' rule: 2 threads) splits over every allowed thread from the first split on, with right sums."""
    monkeypatch.setenv("MOROK_CPU_THREADS", "8")
    split_at(monkeypatch, 1, 1 << 62)
    n = 100_003
    prog, seen, (a, b), (da, db, out) = _add_logging_splits(cpu, rng, monkeypatch, "cap_time_add", n)
    by_accesses = max(2, 3 * n // cpu_runtime.SPLIT_WORK_PER_THREAD)
    for chunk in (1e-6, 1e9):
        monkeypatch.setattr(cpu_runtime, "SPLIT_MIN_CHUNK_S", chunk)
        prog._plans.clear()
        seen.clear()
        for _ in range(len(cpu_runtime.TRIAL_ORDER)):
            prog(da, db, out, n=n)
            np.testing.assert_array_equal(out.numpy(), a + b)
        plan = next(iter(prog._plans.values()))
        alone = min(plan[2])
        want = max(by_accesses, int(alone / chunk))
        assert plan[6] == want and plan[7] == by_accesses, (plan, want)
        assert seen and set(seen) == {min(8, want)}, (seen, want, alone)


def test_a_native_split_cuts_chunks_per_thread_and_packed_chunks_share_their_threads_scratch(cpu, rng, monkeypatch):
    """On the native pool a split over t threads runs t * CHUNKS_PER_THREAD chunks, claimed as threads finish one;
    a packed register tile's chunks run on the scratch set of the thread that claimed them (pool.py's trampoline
    table), so a split over 3 threads in 12 chunks makes 3 sets, and its sums stay right launch after launch."""
    monkeypatch.setenv("MOROK_CPU_THREADS", "3")
    monkeypatch.setattr(cpu_runtime, "CHUNKS_PER_THREAD", 4)
    split_at(monkeypatch, 1, 1)
    n = 100_003
    prog = cpu.compile(K.add(), name="chunks_add")
    if prog._native_pool() is None:
        pytest.skip(f"no native pool here: {cpu_runtime.native_pool_error()}")
    native = prog._native_pool()
    rows = []
    real = native.run
    monkeypatch.setattr(native, "run", lambda tramp, block, count, threads: (rows.append(count), real(tramp, block, count, threads)))
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    da, db, out = cpu.buf(a), cpu.buf(b), cpu.empty(n, dtypes.float32)
    prog(da, db, out, n=n)
    np.testing.assert_array_equal(out.numpy(), a + b)
    assert rows == [12]
    M, Kd, N = 200, 300, 256             # B rows 1 KB apart: a packed register tile on every x86-64 level and core count
    mm = cpu.compile(K.matmul(M, N, Kd), name="chunks_mm")
    assert mm._nhidden
    extent = mm.launch.launch_dims({})[0][0]
    dy = cpu.empty(M * N, dtypes.float32)
    for _ in range(4):
        x, w = rng.standard_normal((M, Kd)).astype(np.float32), rng.standard_normal((Kd, N)).astype(np.float32)
        rows.clear()
        mm(cpu.buf(x), cpu.buf(w), dy)
        np.testing.assert_allclose(dy.numpy().reshape(M, N), x @ w, rtol=1e-4, atol=1e-3)
        assert rows == [len(range(0, extent, mm._chunk_step(extent, 12, False)))] and rows[0] > 3
    assert len(mm._hidden_sets) == 3


def test_a_verdict_of_one_thread_is_retaken_sooner_and_backs_off(cpu, rng, monkeypatch):
    """A trial whose splits ran slow (here each split is made 5 ms slower: the effect of other threads
    spinning on the cores) keeps the kernel on one thread, and retakes the trial after RETRIAL_FIRST
    launches, then twice as many each time the verdict holds, up to RETRIAL_EVERY."""
    split_at(monkeypatch, 1, 1 << 62)
    monkeypatch.setenv("MOROK_CPU_THREADS", "2")
    monkeypatch.setattr(cpu_runtime, "RETRIAL_FIRST", 2)
    monkeypatch.setattr(cpu_runtime, "RETRIAL_EVERY", 8)
    n = 50_001
    prog = cpu.compile(K.add(), name="retrial_add")
    real = prog._parallel

    def slow_split(*args):
        real(*args)
        time.sleep(0.005)
    monkeypatch.setattr(prog, "_parallel", slow_split)
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    da, db, out = cpu.buf(a), cpu.buf(b), cpu.empty(n, dtypes.float32)
    waits = []
    trial = len(cpu_runtime.TRIAL_ORDER)
    for _ in range(5):
        for i in range(trial):     # the trial's launches; the last one decides
            prog(da, db, out, n=n)
            assert (prog._plans[(n,)][0] is cpu_runtime._TRIAL) == (i < trial - 1)
        plan = prog._plans[(n,)]
        assert plan[0] is cpu_runtime._ONE
        waits.append(plan[4])
        for _ in range(plan[4]):
            prog(da, db, out, n=n)
            assert plan[0] is cpu_runtime._ONE
    np.testing.assert_array_equal(out.numpy(), a + b)
    assert waits == [2, 4, 8, 8, 8]


# ---- Program.__call__ remembers a passed launch check ------------------------------------------

@pytest.fixture
def checked_add(cpu, rng):
    """A symbolic add called once (its checks passed and were remembered), its buffers and n."""
    n = 1003
    a, b = cpu.buf(rng.standard_normal(n).astype(np.float32)), cpu.buf(rng.standard_normal(n).astype(np.float32))
    c = cpu.empty(n, dtypes.float32)
    prog = cpu.compile(K.add(), name="checked_add")
    prog(a, b, c, n=n)
    return prog, a, b, c, n


def test_a_repeated_call_skips_the_checks_and_still_runs(checked_add, monkeypatch):
    prog, a, b, c, n = checked_add
    monkeypatch.setattr(type(prog), "_check", lambda *args: pytest.fail("checked again"))
    c.copyin(np.zeros(n, np.float32))
    prog(a, b, c, n=n)
    np.testing.assert_array_equal(c.numpy(), a.numpy() + b.numpy())


def test_a_freed_buffer_is_caught_after_a_remembered_call(checked_add):
    prog, a, b, c, n = checked_add
    b.free()
    with pytest.raises(ValueError, match="freed"):
        prog(a, b, c, n=n)


def test_other_values_and_other_buffers_are_checked_again(cpu, checked_add):
    from morok_py import LaunchError
    prog, a, b, c, n = checked_add
    small = cpu.empty(n - 1, dtypes.float32)
    with pytest.raises(LaunchError, match="may touch indices"):
        prog(a, b, small, n=n)                 # another buffer, too small
    with pytest.raises(LaunchError, match="outside its range"):
        prog(a, b, c, n=0)                     # other values
    with pytest.raises(LaunchError, match="alias"):
        prog(a, b, a, n=n)
    with pytest.raises(LaunchError, match="must be an int"):
        prog(a, b, c, n=float(n))              # equal to n, and hashes alike, but not an int
    with pytest.raises(LaunchError, match="must be an int"):
        prog(a, b, c, n=[n])                   # unhashable
    prog(a, b, c, n=1)
    with pytest.raises(LaunchError, match="must be an int"):
        prog(a, b, c, n=True)                  # == 1 and hash(True) == hash(1)


def test_a_collected_buffer_drops_its_entry_so_a_new_one_at_its_id_is_checked(cpu, checked_add):
    import gc
    import weakref
    from morok_py import LaunchError
    from morok_py.launch import _LAST
    prog, a, b, _, n = checked_add
    sets = lambda: [k for k in prog._checked if k is not _LAST]   # noqa: E731
    out = cpu.empty(n, dtypes.float32)
    prog(a, b, out, n=n)
    assert len(sets()) == 2 and prog._checked[_LAST].bufs[2] == out
    alive = weakref.ref(out)
    del out
    gc.collect()
    assert alive() is None                   # neither the entry nor the last-set shortcut keeps it alive
    assert len(sets()) == 1                  # no entry outlives its buffers
    with pytest.raises(LaunchError, match="may touch indices"):
        prog(a, b, cpu.empty(n - 1, dtypes.float32), n=n)
    c = cpu.empty(n, dtypes.float32)
    prog(a, b, c, n=n)                       # the shortcut's dead proxies fall through to a full check
    np.testing.assert_array_equal(c.numpy(), a.numpy() + b.numpy())


def test_a_freed_buffer_of_the_last_set_is_caught(cpu, checked_add):
    """The last set that hit is tried first: free() of one of its buffers drops that shortcut too."""
    prog, a, b, c, n = checked_add
    prog(a, b, c, n=n)
    c.free()
    with pytest.raises(ValueError, match="freed"):
        prog(a, b, c, n=n)


def test_a_buffer_used_in_many_sets_keeps_a_bounded_forget_list(cpu, checked_add):
    prog, a, b, _, n = checked_add
    for _ in range(300):
        prog(a, b, cpu.empty(n, dtypes.float32), n=n)   # a new output each time, collected at once
    assert len(a._forget) <= 64


def test_each_new_buffers_and_values_pair_is_checked_once(cpu, checked_add, monkeypatch):
    prog, a, b, c, n = checked_add
    prog(a, b, c, n=n - 2)                     # a second value for the same buffers: checked, remembered
    calls = []
    real = type(prog)._check
    monkeypatch.setattr(type(prog), "_check", lambda *args: calls.append(args[2]) or real(*args))
    for m in (n, n - 2, n, n - 2):             # alternating values: no check runs again
        c.copyin(np.full(n, -1.0, np.float32))
        prog(a, b, c, n=m)
        want = np.full(n, -1.0, np.float32)
        want[:m] = a.numpy()[:m] + b.numpy()[:m]
        np.testing.assert_array_equal(c.numpy(), want)
    assert calls == []
    prog(b, a, c, n=n)                         # the same buffers in another order are another set
    assert calls == [{"n": n}]


def test_values_are_matched_by_name_not_by_position(cpu, rng):
    """Two variables: the same values with the names in another order hit; the values swapped between
    the names are another launch (7x13 instead of 13x7), checked and run as such."""
    from morok_py import LaunchError
    prog = cpu.compile(K.row_max(), name="checked_rowmax")
    x = rng.standard_normal(13 * 7).astype(np.float32)
    dx, out = cpu.buf(x), cpu.empty(13, dtypes.float32)
    rows, cols = prog.launch.var_names
    for vals in ({rows: 13, cols: 7}, {cols: 7, rows: 13}):
        out.copyin(np.zeros(13, np.float32))
        prog(dx, out, **vals)
        np.testing.assert_array_equal(out.numpy(), x.reshape(13, 7).max(axis=1))
    for vals in ({rows: 7, cols: 13}, {cols: 13, rows: 7}):
        out.copyin(np.zeros(13, np.float32))
        prog(dx, out, **vals)
        np.testing.assert_array_equal(out.numpy()[:7], x.reshape(7, 13).max(axis=1))
        np.testing.assert_array_equal(out.numpy()[7:], 0)
    with pytest.raises(LaunchError, match="may touch indices"):
        prog(dx, out, **{rows: 7, cols: 14})    # 98 elements of a 91-element buffer


# ---- the pinned-staging copy loop of the GPU allocators (morok_py/staging.py), on a fake driver -----

class FakeStagingDriver:
    """PinnedStaging's hooks on host memory, logging each call; copies happen at once."""

    def __init__(self):
        from morok_py.staging import PinnedStaging

        log, pinned = [], {}

        class Driver(PinnedStaging):
            def _make_current(self):
                log.append("current")

            def _pinned_alloc(self, nbytes):
                buf = ctypes.create_string_buffer(nbytes)
                pinned[ctypes.addressof(buf)] = buf
                log.append(("alloc", nbytes))
                return ctypes.addressof(buf)

            def _pinned_free(self, ptr):
                del pinned[ptr]
                log.append("free")

            def _copy_to_device_async(self, dst, src, nbytes):
                ctypes.memmove(dst, src, nbytes)
                log.append(("to_device", nbytes))

            def _copy_to_host_async(self, dst, src, nbytes):
                ctypes.memmove(dst, src, nbytes)
                log.append(("to_host", nbytes))

            def _sync_stream(self):
                log.append("sync")

        self.driver, self.log, self.pinned = Driver(), log, pinned
        self.driver._init_staging()


def test_staged_copies_go_in_chunks_and_sync_before_the_staging_buffer_is_reused(monkeypatch, rng):
    from morok_py import staging
    monkeypatch.setattr(staging, "STAGING_BYTES", 4096)
    fake = FakeStagingDriver()
    x = rng.standard_normal(2500).astype(np.float32)          # 10000 bytes: chunks of 4096, 4096, 1808
    device_mem = np.zeros_like(x)
    fake.driver.copyin(device_mem.ctypes.data, x)
    np.testing.assert_array_equal(device_mem, x)
    assert fake.log == ["current", ("alloc", 4096), "sync", ("to_device", 4096), "sync", ("to_device", 4096),
                        "sync", ("to_device", 1808), "sync"]
    fake.log.clear()
    back = np.empty_like(x)
    fake.driver.copyout(back, device_mem.ctypes.data)
    np.testing.assert_array_equal(back, x)
    assert fake.log == ["current", ("to_host", 4096), "sync", ("to_host", 4096), "sync", ("to_host", 1808), "sync"]
    fake.driver.close_staging()
    assert fake.log[-1] == "free" and not fake.pinned


def test_staged_copyout_needs_a_contiguous_destination():
    fake = FakeStagingDriver()
    with pytest.raises(ValueError, match="C-contiguous"):
        fake.driver.copyout(np.empty((4, 4), np.float32)[:, ::2], 0)
    fake.driver.copyin(0, np.empty(0, np.float32))              # nothing to copy: no driver call at all
    assert fake.log == []


def _matmul_bt(M, N, Kd, dt):
    """C = A @ B.T with B stored [N, K]: the register tile's column index strides by K (gathered lanes)."""
    a, b, c = UOp.param(0, dt), UOp.param(1, dt), UOp.param(2, dt)
    i, j = UOp.range(M, 0), UOp.range(N, 1)
    k = UOp.range(Kd, 2, AxisType.REDUCE)
    return UOp.sink(c.store(i * N + j, (a.load(i * Kd + k) * b.load(j * Kd + k)).reduce(k)))


@pytest.mark.parametrize("dt", ["float32", "float64", "float16", "bfloat16", "int32"])
@pytest.mark.parametrize("kind", ["matmul", "bias_relu", "b_transposed", "symbolic"])
def test_register_tile_lanes_match_numpy_for_every_dtype(cpu, rng, dt, kind):
    """The register tile's columns as LLVM vectors (Schedule.tile_lanes): contiguous lanes are vector
    loads, strided ones gathers, a row's bias a broadcast; odd sizes leave narrower and scalar regions."""
    from morok_py.backends.cpu.renderer import LANES_MARK
    if dt == "bfloat16":
        pytest.importorskip("ml_dtypes")
    dtype = getattr(dtypes, dt)
    M, Kd, N = 29, 13, 37
    renderer, _ = cpu.pair()
    if not renderer.caps.tile_lanes:
        pytest.skip("this pair prints no tile lanes")
    if kind == "matmul":
        ast = K.matmul(M, N, Kd, dtype=dtype)
    elif kind == "bias_relu":
        ast = K.matmul_bias_relu(M, N, Kd, dtype=dtype)
    elif kind == "b_transposed":
        ast = _matmul_bt(M, N, Kd, dtype)
    else:
        ast = K.matmul(dtype=dtype)
    spec = renderer.render(ast, f"lanes_{kind}_{dt}")
    assert spec.linear.schedule.tile_lanes == renderer.caps.tile_lanes and spec.src.startswith(LANES_MARK)
    ints = dtype.is_int
    draw = (lambda s: rng.integers(-4, 5, s)) if ints else (lambda s: rng.standard_normal(s))
    a, b, bias = draw((M, Kd)), draw((Kd, N)), draw(N)
    a, b, bias = (x.astype(dtype.np).astype(np.float64) for x in (a, b, bias))    # the values the kernel sees
    want = a @ b
    ins = [a, b.T.copy() if kind == "b_transposed" else b]
    if kind == "bias_relu":
        want = np.maximum(want + bias, 0)
        ins.append(bias)
    out = cpu.empty(M * N, dtype)
    prog = cpu.compile(ast, name=f"lanes_{kind}_{dt}")
    prog(*[cpu.buf(x.astype(dtype.np)) for x in ins], out, **({"M": M, "N": N, "K": Kd} if kind == "symbolic" else {}))
    got = out.numpy().astype(np.float64).reshape(M, N)
    tol = {"float32": 1e-4, "float64": 1e-9, "float16": 2e-2, "bfloat16": 8e-2, "int32": 0}[dt]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.sqrt(Kd) * 4)


@pytest.mark.parametrize("tile,lanes", [((6, 64), 16), ((8, 32), 16), ((6, 16), 8), ((5, 32), 16)],
                         ids=["6x64", "8x32", "6x16", "5x32"])
@pytest.mark.parametrize("N", [33, 36, 37, 39, 40, 41, 45, 69, 10, 21, 77, 80, 130])
@pytest.mark.parametrize("dt", ["float32", "int32"])
def test_every_remainder_of_every_host_tile_shape(cpu, rng, tile, lanes, N, dt):
    """The AVX-512 and AVX2 register tiles forced on whatever host runs this (LLVM splits 16-lane vectors on
    AVX2), so their lowering runs everywhere: every remainder width (N % tj of 1 to tj/4 joins a one-column-
    tile matrix as lanes ending at N; AVX-512's 5-8 once left columns unwritten), outputs pre-filled NaN."""
    from morok_py.codegen.schedule import Schedule, using
    dtype = getattr(dtypes, dt)
    M, Kd = 29, 13
    renderer, compiler = cpu.pair()
    if not renderer.caps.tile_lanes:
        pytest.skip("this pair prints no tile lanes")
    with using(Schedule("threads", register_tile=tile, tile_lanes=lanes)):
        spec = renderer.render(K.matmul(M, N, Kd, dtype=dtype), f"rem_{tile[0]}x{tile[1]}_{N}_{dt}")
    prog = cpu.dev.runtime(compiler.compile(spec))
    draw = (lambda s: rng.integers(-9, 10, s)) if dtype.is_int else (lambda s: rng.standard_normal(s))
    a, b = draw((M, Kd)).astype(dtype.np), draw((Kd, N)).astype(dtype.np)
    out = cpu.buf(np.full(M * N, -7 if dtype.is_int else np.nan, dtype.np))
    gs, ls = prog.launch.launch_dims({})
    ins = [cpu.buf(a), cpu.buf(b)]              # held: a bare .ptr of a temporary is freed before the launch
    prog.execute([ins[0].ptr, ins[1].ptr, out.ptr], [], gs, ls, wait=True)
    want = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(out.numpy().astype(np.float64).reshape(M, N), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dt,kind,M,Kd,N", [
    ("float32", "matmul", 37, 70, 256), ("float32", "matmul", 100, 64, 512), ("float32", "bias_relu", 61, 96, 256),
    ("float64", "matmul", 29, 65, 128), ("int32", "matmul", 25, 64, 256), ("float16", "matmul", 20, 64, 512),
    ("float32", "matmul", 64, 64, 256)])
@pytest.mark.parametrize("tile", [None, (4, 32)], ids=["default", "4x32"])
def test_packed_panels_match_numpy(cpu, rng, monkeypatch, dt, kind, M, Kd, N, tile, pool):
    """Schedule.pack: every thread-split unit copies its K x tj column panel of B into a hidden scratch
    and its tiles read it from there; several threads (and row partitions with the 4 x 32 tile)."""
    from morok_py.codegen.schedule import Schedule, using
    renderer, compiler = lane_tiles_on_threads(cpu, monkeypatch)
    dtype = getattr(dtypes, dt)
    ast = K.matmul(M, N, Kd, dtype=dtype) if kind == "matmul" else K.matmul_bias_relu(M, N, Kd, dtype=dtype)
    sched = None if tile is None else Schedule("threads", register_tile=tile, tile_lanes=8, pack=True)
    with using(sched):
        spec = renderer.render(ast, f"packed_{dt}_{kind}_{M}_{N}")
    assert spec.linear.schedule.pack and spec.launch.hidden, spec.linear.schedule
    prog = cpu.dev.runtime(compiler.compile(spec))
    draw = (lambda s: rng.integers(-4, 5, s)) if dtype.is_int else (lambda s: rng.standard_normal(s))
    a, b, bias = (x.astype(dtype.np) for x in (draw((M, Kd)), draw((Kd, N)), draw(N)))
    want = a.astype(np.float64) @ b.astype(np.float64)
    ins = [a, b] + ([bias] if kind == "bias_relu" else [])
    if kind == "bias_relu":
        want = np.maximum(want + bias, 0)
    bufs = [cpu.buf(x) for x in ins] + [cpu.buf(np.full(M * N, 7, dtype.np))]
    gs, ls = prog.launch.launch_dims({})
    for _ in range(2):      # the scratch is reused: the second launch repacks it
        prog.execute([x.ptr for x in bufs], [], gs, ls, wait=True)
        got = bufs[-1].numpy().astype(np.float64).reshape(M, N)
        tol = {"float32": 1e-4, "float64": 1e-9, "float16": 2e-2, "int32": 0}[dt]
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.sqrt(Kd) * 4)


@pytest.mark.parametrize("pixels", [2112, 3136])
def test_a_convolution_contraction_with_a_variable_reduction_packs_its_far_apart_rows(cpu, rng, monkeypatch, pixels):
    """conv_gemm's columns operand (a 1x1 convolution's input, or im2col's columns) has rows a pixel plane
    apart (>= opt.PACK_FAR_BYTES at 56x56): the default schedule copies its column panels, also with the
    reduction a variable (one program for the layers that differ in it; the scratch is PACK_CAP elements);
    one program serves two channel counts on several threads, a batch of 2 and 70 output channels (tail
    rows), and matches numpy. Rows closer (not a multiple of PACK_ROW_BYTES apart) stay unpacked."""
    from morok_py.codegen.opt import PACK_CAP, PACK_FAR_BYTES, PACK_ROW_BYTES
    renderer, compiler = lane_tiles_on_threads(cpu, monkeypatch)
    tj = renderer.caps.register_tile[1]
    if pixels % tj:
        pytest.skip(f"{pixels} pixels are no whole number of this target's {tj}-wide column tiles")
    N_, CO = 2, 70
    spec = renderer.render(K.conv_gemm(N_, 1, CO, None, pixels), f"conv_gemm_packed_{pixels}")
    # the scratch holds a panel of the variable's bound (K.CONV_MAX_K steps), within PACK_CAP
    assert spec.linear.schedule.pack and [h.count for h in spec.launch.hidden] == [K.CONV_MAX_K * tj], spec.linear.schedule
    assert K.CONV_MAX_K * tj <= PACK_CAP
    prog = cpu.dev.runtime(compiler.compile(spec))
    for C in (37, 130):
        x = rng.standard_normal((N_, C, pixels)).astype(np.float32)
        w = rng.standard_normal((CO, C)).astype(np.float32)
        out = cpu.buf(np.full(N_ * CO * pixels, np.nan, np.float32))
        bx, bw = cpu.buf(x), cpu.buf(w)
        gs, ls = prog.launch.launch_dims({"K": C})
        prog.execute([bx.ptr, bw.ptr, out.ptr], [C], gs, ls, wait=True)
        want = np.einsum("ok,nkp->nop", w.astype(np.float64), x.astype(np.float64))
        np.testing.assert_allclose(out.numpy().reshape(want.shape), want, rtol=1e-4, atol=1e-3)
    from morok_py import LaunchError
    with pytest.raises(LaunchError, match="K"):      # past the bound the scratch is sized for: refused
        prog.launch.launch_dims({"K": K.CONV_MAX_K + 1})
    assert pixels * 4 >= PACK_FAR_BYTES
    # rows under PACK_ROW_BYTES apart; 1024 + tj floats apart (whole tiles, an MLP's padded weights rows of
    # kernels.padded_ldb: 1040 on AVX2)
    for near in (PACK_ROW_BYTES // 4 - tj, 1024 + tj):
        spec = renderer.render(K.conv_gemm(1, 1, CO, None, near), f"conv_gemm_near_{near}")
        assert not spec.linear.schedule.pack and not spec.launch.hidden, near


def test_columns_a_cache_line_misaligned_apart_are_packed_beside_a_remainder(cpu, rng, monkeypatch):
    """B rows not a multiple of 64 bytes apart (a 7x7 or 14x14 convolution's pixels: 196, 784 bytes) are
    packed, also where the columns end in a remainder region (3 tj + 1, 12 tj + 4 columns) or an overlapping
    last tile (4 tj - 4). A remainder region's columns are packed after the panel (the scratch holds K x (tj
    + 4) then), by every chunk of a split launch before its loop: each thread's chunk has a scratch of its own.
    Static and variable reductions, several threads, rows past the row tiles; every output written
    (NaN-filled) and equal to numpy's."""
    from morok_py.codegen.opt import PACK_LINE_BYTES, pack_applies, tile_for
    from morok_py.codegen.schedule import Schedule, using
    renderer, compiler = lane_tiles_on_threads(cpu, monkeypatch)
    caps = renderer.caps
    tj, lanes = caps.register_tile[1], caps.tile_lanes
    M = 70
    for n in (3 * tj + 1, 12 * tj + 4, 4 * tj - 4):
        assert (n * 4) % PACK_LINE_BYTES, n
        ast = K.matmul(M, n, 300)
        tile = tile_for(ast, caps.register_tile, lanes)
        # the default packs these rows where its partitions keep enough rows per thread (the host's count)
        default = renderer.render(ast, f"mm_misaligned_default_{n}")
        assert default.linear.schedule.pack == pack_applies(ast, tile, lanes, caps.threads), default.linear.schedule
        with using(Schedule("threads", register_tile=tile, tile_lanes=lanes, pack=True, prefetch=True)):
            spec = renderer.render(ast, f"mm_misaligned_{n}")
        assert spec.linear.schedule.pack and spec.launch.hidden, (n, spec.linear.schedule)
        region = n % tj and 4 * (n % tj) <= tj         # opt._tile_width: a remainder region, not an overlapping tile
        assert [h.count for h in spec.launch.hidden] == [300 * (tj + 4 if region else tj)], (n, spec.launch.hidden)
        prog = cpu.dev.runtime(compiler.compile(spec))
        a = rng.standard_normal((M, 300)).astype(np.float32)
        b = rng.standard_normal((300, n)).astype(np.float32)
        out = cpu.buf(np.full(M * n, np.nan, np.float32))
        prog(cpu.buf(a), cpu.buf(b), out)
        np.testing.assert_allclose(out.numpy().reshape(M, n), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)
        with using(Schedule("threads", register_tile=tile, tile_lanes=lanes, pack=True, prefetch=True)):
            spec = renderer.render(K.conv_gemm(1, 1, M, None, n), f"conv_gemm_misaligned_{n}")
        assert spec.linear.schedule.pack, (n, spec.linear.schedule)
        prog = cpu.dev.runtime(compiler.compile(spec))
        for C in (37, 130):
            x = rng.standard_normal((C, n)).astype(np.float32)
            w = rng.standard_normal((M, C)).astype(np.float32)
            out = cpu.buf(np.full(M * n, np.nan, np.float32))
            prog(cpu.buf(x), cpu.buf(w), out, K=C)
            np.testing.assert_allclose(out.numpy().reshape(M, n), w.astype(np.float64) @ x, rtol=1e-4, atol=1e-3)
    # line-aligned rows closer than opt.PACK_ROW_BYTES stay in place (a 28x28 layer's 784 floats, AVX2)
    aligned = renderer.render(K.matmul(M, 12 * tj + 16, 300), "mm_aligned")
    assert not aligned.linear.schedule.pack or (12 * tj + 16) * 4 % 1024 == 0


@pytest.mark.parametrize("tile,lanes", [((6, 16), 8), ((6, 64), 16)])
def test_rows_split_over_cache_lines_are_packed_where_each_partition_has_rows_for_its_workers(tile, lanes):
    """opt._pack_plan with the workers known: B rows a cache line does not divide (a 14x14 layer's 784 bytes) are
    packed only where a unit's partition keeps PACK_LINE_ROWS_PER_THREAD rows per thread (every partition copies
    its panels against the cache bandwidth the workers share); without a thread count, as before. Other reasons to
    pack (rows a page apart) do not depend on it. AVX2's and AVX-512's tiles given explicitly."""
    from morok_py.codegen import opt
    for M, N, Kd in [(256, 196, 2304), (32, 196, 1152), (1024, 196, 256), (70, 49, 300)]:
        ast = K.matmul(M, N, Kd)
        t = opt.tile_for(ast, tile, lanes)
        tj, rem = opt._tile_width(N, t[1])
        if not opt.pack_applies(ast, t, lanes):
            continue
        for threads in (1, 2, 3, 8, 16):
            P = opt._partitions(M // t[0], N // tj if rem else -(-N // tj), threads)
            want = M / P >= opt.PACK_LINE_ROWS_PER_THREAD * threads
            assert opt.pack_applies(ast, t, lanes, threads) == want, (M, N, Kd, t, threads, P)
    assert opt.pack_applies(K.matmul(256, 196, 2304), tile, lanes, 2)
    assert not opt.pack_applies(K.matmul(256, 196, 2304), opt.tile_for(K.matmul(256, 196, 2304), tile, lanes), lanes, 16)
    far = K.matmul(64, 3136, 256)            # rows 12.5 KB apart (a 56x56 layer): packed at any thread count
    assert all(opt.pack_applies(far, opt.tile_for(far, tile, lanes), lanes, th) for th in (0, 2, 16))


def test_a_register_tile_prefetches_its_epilogue_lines_before_its_reduction_loop(cpu, rng, monkeypatch):
    """The default CPU tile schedule prefetches (codegen/prefetch.py): in the block of each reduction loop,
    PREFETCH instructions for the tile's vector stores and its residual's vector loads come before the loop,
    their addresses computed there; none for the scalar bias loads. The kernel's result matches numpy with and
    without them (NaN-filled output, a tail of rows and a remainder of columns, several threads), and a
    schedule that asks for prefetches without vector lanes is refused."""
    from morok_py.codegen.linear import L, Loop
    from morok_py.codegen.schedule import Schedule, using
    from morok_py.ir import AxisType
    from morok_py.errors import ArgumentError
    renderer, compiler = lane_tiles_on_threads(cpu, monkeypatch)
    CO, C, P = 70, 37, 3 * renderer.caps.register_tile[1] + 5
    ast = K.conv_gemm(1, 1, CO, None, P, dtypes.float32, K.Epilogue.of("bias", "add", "relu"))
    spec = renderer.render(ast, "tile_prefetch")
    assert spec.linear.schedule.prefetch, spec.linear.schedule
    seen = {"before": 0, "loops": 0}

    def walk(block):
        for pos, it in enumerate(block):
            if isinstance(it, Loop):
                if it.kind is AxisType.REDUCE:
                    seen["loops"] += 1
                    before = [x for x in block[:pos] if not isinstance(x, Loop) and x.kind is L.PREFETCH]
                    after = [x for x in block[pos + 1:] if not isinstance(x, Loop) and x.kind in (L.LOAD, L.STORE)
                             and (x.arg or x.lanes > 1)]
                    # (a loop with no vector access after it, scalar columns, has nothing to prefetch)
                    assert len(before) >= len({(x.src[0].id, x.src[1].id) for x in after})
                    assert {x.src[0].arg for x in before} == {x.src[0].arg for x in after}   # residual and output
                    seen["before"] += len(before)
                walk(it.body)
    walk(spec.linear.body)
    assert seen["loops"] and seen["before"] and "@llvm.prefetch" in spec.src
    x = rng.standard_normal((C, P)).astype(np.float32)
    w = rng.standard_normal((CO, C)).astype(np.float32)
    b = rng.standard_normal(CO).astype(np.float32)
    res = rng.standard_normal((CO, P)).astype(np.float32)
    want = np.maximum(w.astype(np.float64) @ x + b[:, None] + res, 0)
    plain = Schedule("threads", register_tile=spec.linear.schedule.register_tile,
                     tile_lanes=spec.linear.schedule.tile_lanes, pack=spec.linear.schedule.pack)
    with using(plain):
        bare = renderer.render(ast, "tile_no_prefetch")
    assert "@llvm.prefetch" not in bare.src
    for sp in (spec, bare):
        out = cpu.buf(np.full(CO * P, np.nan, np.float32))
        cpu.dev.runtime(compiler.compile(sp))(cpu.buf(x), cpu.buf(w), cpu.buf(b), cpu.buf(res), out, K=C)
        np.testing.assert_allclose(out.numpy().reshape(CO, P), want, rtol=1e-4, atol=1e-3)
    with pytest.raises(ArgumentError, match="prefetch"):
        Schedule("threads", register_tile=(6, 16), prefetch=True)


def test_wide_matrices_split_into_units_that_divide_among_threads():
    """A wide matrix (many column tiles) is cut into row partitions where that balances the thread split
    (the target's thread count; unknown: 2-16): the AVX-512 1024^3 matmul (6x64 tiles: 170 row tiles, 16
    column tiles) makes 80 units for 12 threads, not 32 (7 for the busiest against 6.67, not 3 against
    2.67); with 8x32 tiles 128, not 32; two threads split AVX2's 64 column tiles evenly as they are (the
    repacked panels cost more than nothing gained); narrower matrices keep their partitions; a partition
    keeps >= 24 row tiles."""
    from morok_py.codegen.opt import _partitions, split_balance
    assert _partitions(170, 16, 12) == 5 and split_balance(80, 12) < 1.06 < split_balance(32, 12)
    assert _partitions(170, 16) == 5 and _partitions(170, 16, 16) == 2 and _partitions(170, 64, 2) == 1
    assert _partitions(128, 32) == 4 and split_balance(128) < 1.04
    assert _partitions(42, 8) == 6 and _partitions(32, 16) == 2 and _partitions(32, 1) == 8   # MLP-like shapes
    assert _partitions(40, 32) == 1                                    # 20 row tiles a half: too few to repack
    assert _partitions(127, 32) == 1                                   # no divisor: no clamped row tail


def test_narrow_partitions_count_a_panel_copy_only_where_the_panel_is_packed():
    """resnet50's 128-row contractions at 28x28 (21 row tiles of 6x64 and 12 column tiles on 16 workers): a
    partition that copies its panel first costs PACK_SHARE row tiles more, so one partition a column tile (12
    units: 4 workers idle); read in place, 4 partitions (48 units, 3 each) leave no worker idle."""
    from morok_py.codegen.opt import PACK_SHARE, UNPACKED_SHARE, _partitions
    assert UNPACKED_SHARE < PACK_SHARE
    assert _partitions(21, 12, 16) == _partitions(21, 12, 16, packed=True) == 1
    assert _partitions(21, 12, 16, packed=False) == 4
    assert _partitions(42, 3, 16, packed=False) == _partitions(42, 3, 16) == 5     # 14x14: 15 units either way


@pytest.mark.parametrize("tile", [(8, 32), (6, 64)], ids=["8x32", "6x64"])
@pytest.mark.parametrize("threads", ["3", "12"])
def test_row_partitions_of_a_wide_packed_matmul_match_numpy(cpu, rng, monkeypatch, threads, tile):
    """The AVX-512 tiles forced on any host over 264 and 1024 rows of a 1024-column matrix, packed, split over
    several threads: 8 x 32 makes 33 row tiles (no partitions) and 128 (4 partitions for 12 threads); 6 x 64
    makes 44 (2) and 170 (5 for 12 threads, plus 4 leftover rows dealt to them one at a time)."""
    import dataclasses
    from morok_py.codegen.opt import _partitions
    n = int(threads)
    assert _partitions(33, 32, n) == 1 and _partitions(128, 32, 12) == 4
    assert _partitions(44, 16, n) == 2 and _partitions(170, 16, 12) == 5
    from morok_py.codegen.schedule import Schedule, using
    split_at(monkeypatch, 1, 1)
    monkeypatch.setenv("MOROK_CPU_THREADS", threads)
    renderer, compiler = cpu.pair()
    if not renderer.caps.tile_lanes:
        pytest.skip("this pair prints no tile lanes")
    monkeypatch.setattr(renderer, "caps", dataclasses.replace(renderer.caps, threads=n))   # partitions for n
    for M in (264, 1024):
        Kd, N = 128, 1024
        with using(Schedule("threads", register_tile=tile, tile_lanes=16, pack=True)):
            spec = renderer.render(K.matmul(M, N, Kd), f"wide_{M}_{threads}_{tile[0]}x{tile[1]}")
        prog = cpu.dev.runtime(compiler.compile(spec))
        a, b = rng.standard_normal((M, Kd)).astype(np.float32), rng.standard_normal((Kd, N)).astype(np.float32)
        bufs = [cpu.buf(a), cpu.buf(b), cpu.buf(np.full(M * N, np.nan, np.float32))]   # held through the launch
        gs, ls = prog.launch.launch_dims({})
        prog.execute([x.ptr for x in bufs], [], gs, ls, wait=True)
        np.testing.assert_allclose(bufs[2].numpy().reshape(M, N), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threads", ["2", "5", "16"])
def test_row_partitions_of_a_narrow_matrix_balance_the_workers_and_match_numpy(cpu_level, rng, monkeypatch, threads):
    """A narrow matrix (a 7x7 or 14x14 layer's pixels as columns) takes the partition count whose busiest
    worker does least: 512 rows (85 tiles of 6) over 49 columns make 15 units for 16 workers, not 34 (3
    for the busiest); on 2 workers 2. Odd row counts leave rows dealt round-robin; every output matches
    numpy for each worker count and x86-64 level, the AVX-512 tile forced on any host."""
    import dataclasses
    from morok_py.codegen.opt import _partitions
    assert _partitions(85, 1, 16) == 15 and _partitions(85, 1, 2) == 2 and _partitions(42, 3, 16) == 5
    assert _partitions(85, 1) == 21                                  # workers unknown: near SPLIT_UNITS units
    from morok_py.codegen.schedule import Schedule, using
    split_at(monkeypatch, 1, 1)
    n = int(threads)
    monkeypatch.setenv("MOROK_CPU_THREADS", threads)
    renderer, compiler = cpu_level.pair()
    if not renderer.caps.tile_lanes:
        pytest.skip("this pair prints no tile lanes")
    monkeypatch.setattr(renderer, "caps", dataclasses.replace(renderer.caps, threads=n))
    for M, Kd, N in ((512, 96, 49), (259, 37, 196), (101, 64, 20)):
        with using(Schedule("threads", register_tile=(6, 64), tile_lanes=16)):
            spec = renderer.render(K.matmul(M, N, Kd), f"narrow_{M}_{N}_{threads}")
        prog = cpu_level.dev.runtime(compiler.compile(spec))
        a, b = rng.standard_normal((M, Kd)).astype(np.float32), rng.standard_normal((Kd, N)).astype(np.float32)
        bufs = [cpu_level.buf(a), cpu_level.buf(b), cpu_level.buf(np.full(M * N, np.nan, np.float32))]
        gs, ls = prog.launch.launch_dims({})
        if M == 512:
            assert gs[0] == _partitions(85, 1, n)                   # the outer range: one column tile's partitions
        prog.execute([x.ptr for x in bufs], [], gs, ls, wait=True)
        np.testing.assert_allclose(bufs[2].numpy().reshape(M, N), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


def test_a_packed_matmul_through_the_checked_call(cpu, rng):
    """The hidden scratch is the runtime's: the caller passes A, B, C only, from several Python threads."""
    import threading
    M, Kd, N = 48, 64, 512
    renderer, _ = cpu.pair()
    prog = cpu.compile(K.matmul(M, N, Kd), name="packed_checked")
    if renderer.caps.tile_lanes:
        assert prog.linear.schedule.pack if getattr(prog, "linear", None) is not None else True
    a, b = rng.standard_normal((M, Kd)).astype(np.float32), rng.standard_normal((Kd, N)).astype(np.float32)
    outs, errs = [cpu.empty(M * N, dtypes.float32) for _ in range(4)], []

    def run(out):
        try:
            for _ in range(5):
                prog(cpu.buf(a), cpu.buf(b), out)
        except Exception as e:     # noqa: BLE001
            errs.append(e)
    threads = [threading.Thread(target=run, args=(o,)) for o in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errs
    for o in outs:
        np.testing.assert_allclose(o.numpy().reshape(M, N), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4 * 8)


def test_a_symbolic_packed_matmul_runs_packed_or_not_by_the_scratchs_size(cpu, rng, monkeypatch):
    """Symbolic sizes: the packed region runs when a thread's K x tj panel fits the fixed scratch
    (opt.PACK_CAP elements), the row-at-a-time fallback otherwise (K = 100 here); one program, all exact."""
    from morok_py.codegen import opt
    monkeypatch.setattr(opt, "PACK_CAP", 1024)
    renderer, compiler = lane_tiles_on_threads(cpu, monkeypatch)
    spec = renderer.render(K.matmul(), "packed_symbolic_cap")
    assert spec.linear.schedule.pack and spec.launch.hidden[0].count == 1024
    prog = cpu.dev.runtime(compiler.compile(spec))
    tj = renderer.caps.register_tile[1]
    for M, Kd, N in [(37, 20, 3 * tj), (37, 100, 3 * tj), (50, 7, 2 * tj + 5), (9, 64, tj - 3), (40, 1, 2 * tj)]:
        a, b = rng.standard_normal((M, Kd)).astype(np.float32), rng.standard_normal((Kd, N)).astype(np.float32)
        out = cpu.buf(np.full(M * N, np.nan, np.float32))
        vals = {"M": M, "N": N, "K": Kd}
        gs, ls = prog.launch.launch_dims(vals)
        prog.launch.check_sizes(prog.launch.prepare(prog.launch.values_from(vals))[2], [M * Kd, Kd * N, M * N])
        ins = [cpu.buf(a), cpu.buf(b)]
        prog.execute([x.ptr for x in ins] + [out.ptr], [vals[k] for k in prog.launch.var_names], gs, ls, wait=True)
        np.testing.assert_allclose(out.numpy().reshape(M, N), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4,
                                   err_msg=str((M, Kd, N)))


def test_a_program_engine_holds_its_object_alone(cpu, rng):
    """A CPU program's MCJIT engine holds the object file and no module: the empty module an engine is made
    with is removed before it finalizes (finalizing compiles every module it holds, and setting up that
    codegen was most of a small program's load). The program still runs, here against numpy."""
    from conftest import random_array
    prog = cpu.compile(K.named("softmax"), name="engine_alone")
    assert not prog._engine._modules
    x = random_array(rng, (7, 37), np.float32)
    out = cpu.empty(x.size, dtypes.float32)
    prog(cpu.buf(x), out, rows=7, cols=37)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out.numpy().reshape(7, 37), e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)
