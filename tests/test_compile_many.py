"""Batch compiles (morok_py.batch): identical kernels compile once, parallel results equal sequential
ones, a failing kernel is named, the same path serves compile-only CUDA and ROCm pairs, and the CPU's
cheap pipeline for small kernels computes what O3's code computes."""
from __future__ import annotations

import numpy as np
import pytest

from morok_py import Buffer, CompileError, ConfigError, UOp, dtypes, kernels as K
from morok_py import batch, cache
from morok_py.backends.cpu import compiler as cpu_compiler
from morok_py.registry import get_device

MODES = ["serial", "threads", "processes"]


@pytest.fixture
def cpu(tmp_path, monkeypatch):
    """The CPU device with an empty disk cache and empty memory caches."""
    monkeypatch.setenv("MOROK_CACHE_DIR", str(tmp_path))
    cache.clear_memory_caches()
    yield get_device("CPU")
    cache.clear_memory_caches()


def scaled_add(n: int, k: float) -> UOp:
    """out[i] = a[i] * k + b[i] over a static n: one distinct kernel per (n, k)."""
    a, b, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32), UOp.param(2, dtypes.float32)
    i = UOp.range(n, 0)
    return UOp.sink(out.store(i, a.load(i) * UOp.const(k, dtypes.float32) + b.load(i)))


def kernel_set() -> list[tuple[UOp, str]]:
    """More distinct kernels than PROCESS_MIN_KERNELS, of several families, odd sizes."""
    items = [(scaled_add(97 + 13 * j, 0.5 + j), f"scaled_add_{j}") for j in range(6)]
    items += [(K.add(), "add"), (K.softmax(), "softmax"), (K.unary("exp"), "exp"), (K.binary("mul"), "mul")]
    assert len(items) >= batch.PROCESS_MIN_KERNELS
    return items


def run_scaled_add(prog, dev, n: int, k: float) -> None:
    rng = np.random.default_rng(n)
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    out = dev.buffer(n, dtypes.float32)
    prog(Buffer.from_numpy(a, dev), Buffer.from_numpy(b, dev), out)
    np.testing.assert_allclose(out.numpy(), a * np.float32(k) + b, rtol=1e-5, atol=1e-6)   # FMA contraction


# ---- dedupe ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_identical_kernels_compile_once(cpu, monkeypatch, mode):
    monkeypatch.setenv("MOROK_COMPILE_MODE", mode)
    items = kernel_set()
    assert batch.plan_for(len(items)).mode == mode
    rebuilt = scaled_add(97, 0.5)        # built again: the same hash-consed AST as items[0]
    cache.stats.reset()
    progs = cpu.compile_many(items + [items[0], (rebuilt, "scaled_add_0"), items[7]])
    assert cache.stats.compiles == len(items)
    assert progs[len(items)] is progs[0] and progs[len(items) + 1] is progs[0]
    assert progs[len(items) + 2] is progs[7]
    assert [p.name for p in progs[:len(items)]] == [n for _, n in items]


def test_a_second_batch_is_served_from_memory(cpu):
    items = kernel_set()
    first = cpu.compile_many(items)
    cache.stats.reset()
    again = cpu.compile_many(items)
    assert cache.stats.compiles == 0 and all(a is b for a, b in zip(first, again))
    assert cpu.compile(*items[3]) is first[3]      # and dev.compile finds them too


@pytest.mark.parametrize("mode", ["threads", "processes"])
def test_concurrent_batches_share_programs(cpu, monkeypatch, mode):
    """Two threads compiling overlapping batches get the same Program for the same kernel."""
    import threading
    monkeypatch.setenv("MOROK_COMPILE_MODE", mode)
    items = kernel_set()
    got: dict[int, list] = {}
    threads = [threading.Thread(target=lambda j=j: got.__setitem__(j, cpu.compile_many(items[j * 3:]))) for j in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(a is b for a, b in zip(got[0][3:], got[1]))
    assert [p.name for p in got[0]] == [n for _, n in items]


# ---- parallel equals sequential ----------------------------------------------------------------

@pytest.mark.parametrize("mode", ["threads", "processes"])
def test_parallel_results_equal_sequential(cpu, monkeypatch, mode):
    items = kernel_set()
    monkeypatch.setenv("MOROK_CACHE", "0")
    sequential = [cpu.compile(ast, name).compiled for ast, name in items]
    cache.clear_memory_caches()
    monkeypatch.setenv("MOROK_COMPILE_MODE", mode)
    progs = cpu.compile_many(items, workers=3)
    for p, s in zip(progs, sequential):
        c = p.compiled
        assert (c.name, c.bytes, c.var_names, c.global_size, c.local_size, c.buf_count, c.param_dtypes) == \
            (s.name, s.bytes, s.var_names, s.global_size, s.local_size, s.buf_count, s.param_dtypes)
    for j in range(6):          # and they run: against numpy, random data, odd sizes
        run_scaled_add(progs[j], cpu, 97 + 13 * j, 0.5 + j)


def test_processes_hand_back_launch_information(cpu, monkeypatch):
    """A forked worker's result carries the launch record (launch_io): checked launches still refuse
    a wrong buffer before it reaches the kernel."""
    from morok_py import LaunchError
    monkeypatch.setenv("MOROK_COMPILE_MODE", "processes")
    progs = cpu.compile_many(kernel_set())
    n = 97
    with pytest.raises(LaunchError):
        progs[0](cpu.buffer(n, dtypes.float32), cpu.buffer(n - 1, dtypes.float32), cpu.buffer(n, dtypes.float32))
    run_scaled_add(progs[0], cpu, n, 0.5)


def test_a_forked_batch_that_stalls_is_killed_and_compiled_here(cpu, monkeypatch):
    """Forked workers that hand back nothing for MOROK_COMPILE_STALL seconds (here: every worker blocks, as one
    that inherited a lock held at the fork would) are killed with a warning, and the calling process compiles
    what they left: the batch finishes, every program runs, no worker process is left behind."""
    import multiprocessing as mp
    import os
    import threading
    import time
    monkeypatch.setenv("MOROK_COMPILE_MODE", "processes")
    monkeypatch.setenv("MOROK_COMPILE_STALL", "1.5")
    parent = os.getpid()
    real = cache.compile_scheduled

    def blocked_in_a_worker(*args, **kw):
        if os.getpid() != parent:
            threading.Event().wait()            # never set: the worker blocks for good
        return real(*args, **kw)
    monkeypatch.setattr(cache, "compile_scheduled", blocked_in_a_worker)
    items = kernel_set()
    t0 = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="MOROK_COMPILE_STALL"):
        progs = cpu.compile_many(items, workers=2)
    assert time.perf_counter() - t0 < 60
    assert len(progs) == len(items)
    for j in range(6):
        run_scaled_add(progs[j], cpu, 97 + 13 * j, 0.5 + j)
    deadline = time.time() + 10
    while mp.active_children() and time.time() < deadline:
        time.sleep(0.05)
    assert not [c for c in mp.active_children() if c.is_alive()]


@pytest.mark.parametrize("value", ["0", "-3", "soon", "inf", "nan"])
def test_a_bad_stall_setting_is_a_config_error(cpu, monkeypatch, value):
    monkeypatch.setenv("MOROK_COMPILE_MODE", "processes")
    monkeypatch.setenv("MOROK_COMPILE_STALL", value)
    with pytest.raises(ConfigError, match="MOROK_COMPILE_STALL"):
        cpu.compile_many(kernel_set(), workers=2)


def test_forked_workers_after_the_parent_used_mlir(cpu, monkeypatch):
    """The MLIR pair through forked workers after the parent compiled with it (each worker starts its
    own MLIR context): the objects equal the parent's, and they run."""
    r, c = cpu.pair("mlir")
    if c.available() is not None:
        pytest.skip(f"the mlir pair is not usable here: {c.available()}")
    items = [(scaled_add(97 + 13 * j, 0.5 + j), f"scaled_add_{j}") for j in range(6)] + [(K.add(), "add"),
                                                                                         (K.softmax(), "softmax")]
    monkeypatch.setenv("MOROK_CACHE", "0")
    sequential = [cpu.compile(ast, name, compiler="mlir").compiled.bytes for ast, name in items]
    cache.clear_memory_caches()
    monkeypatch.setenv("MOROK_COMPILE_MODE", "processes")
    progs = cpu.compile_many(items, compiler="mlir", workers=2)
    assert [p.compiled.bytes for p in progs] == sequential
    run_scaled_add(progs[2], cpu, 97 + 26, 2.5)


# ---- errors ------------------------------------------------------------------------------------

def two_dtypes_in_one_slot() -> UOp:
    """A malformed kernel: param slot 0 read as float32 and written as int32."""
    i = UOp.range(31, 0)
    src = UOp.param(0, dtypes.float32)
    return UOp.sink(UOp.param(0, dtypes.int32).store(i, src.load(i).cast(dtypes.int32)))


@pytest.mark.parametrize("mode", MODES)
def test_a_failing_kernel_is_named_and_the_others_are_compiled(cpu, monkeypatch, mode):
    monkeypatch.setenv("MOROK_COMPILE_MODE", mode)
    items = kernel_set()
    bad = (two_dtypes_in_one_slot(), "the broken one")
    with pytest.raises(CompileError, match="kernel 'the broken one' failed to compile") as e:
        cpu.compile_many(items[:4] + [bad] + items[4:])
    assert e.value.kernel == "the broken one" and e.value.__cause__ is not None
    cache.stats.reset()
    cpu.compile_many(items)
    assert cache.stats.compiles == 0        # the good ones were compiled and kept


def test_bad_settings_are_config_errors(cpu, monkeypatch):
    monkeypatch.setenv("MOROK_COMPILE_MODE", "fibers")
    with pytest.raises(ConfigError, match="MOROK_COMPILE_MODE"):
        cpu.compile_many(kernel_set())
    monkeypatch.delenv("MOROK_COMPILE_MODE")
    monkeypatch.setenv("MOROK_COMPILE_WORKERS", "-2")
    with pytest.raises(ConfigError, match="MOROK_COMPILE_WORKERS"):
        batch.compile_workers()


# ---- the rule ----------------------------------------------------------------------------------

def test_plan_rule(monkeypatch):
    monkeypatch.delenv("MOROK_COMPILE_MODE", raising=False)
    monkeypatch.delenv("MOROK_BEAM", raising=False)
    monkeypatch.setenv("MOROK_COMPILE_WORKERS", "1")
    assert batch.plan_for(50).mode == "serial"
    monkeypatch.setenv("MOROK_COMPILE_WORKERS", "4")
    assert batch.plan_for(1).mode == "serial"
    assert batch.plan_for(batch.PROCESS_MIN_KERNELS - 1) == batch.BatchPlan(
        "threads", 4, batch.PROCESS_MIN_KERNELS - 1, f"< {batch.PROCESS_MIN_KERNELS} kernels")
    big = batch.plan_for(100)
    assert (big.mode, big.workers) == ("processes", 4) and "processes x4" in str(big)
    monkeypatch.setenv("MOROK_BEAM", "2")
    assert batch.plan_for(100).mode == "threads"
    monkeypatch.delenv("MOROK_COMPILE_WORKERS")
    import os
    assert batch.compile_workers() == os.cpu_count()


def test_workers_fit_the_idle_cores(monkeypatch):
    """Unasked, the worker count is the cores less what other work keeps busy (1-minute load, which
    counts this process once); MOROK_COMPILE_WORKERS or `workers` is taken as it is."""
    import os
    monkeypatch.delenv("MOROK_COMPILE_MODE", raising=False)
    monkeypatch.delenv("MOROK_COMPILE_WORKERS", raising=False)
    monkeypatch.delenv("MOROK_BEAM", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.4, 3.0, 3.0))
    assert batch.idle_workers(16) == (16, 0.4)
    assert (batch.plan_for(100).mode, batch.plan_for(100).workers) == ("processes", 16)
    monkeypatch.setattr(os, "getloadavg", lambda: (7.2, 1.0, 1.0))
    plan = batch.plan_for(100)
    assert (plan.mode, plan.workers) == ("processes", 10) and "load 7.2 on 16 cores" in plan.why
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 1.0, 1.0))      # this process's own load: 2 workers
    assert batch.plan_for(100).workers == 2
    monkeypatch.setattr(os, "getloadavg", lambda: (5.6, 5.0, 5.0))
    assert batch.plan_for(100) == batch.BatchPlan("serial", 1, 100, "load 5.6 on 2 cores")
    assert batch.plan_for(100, workers=2).workers == 2
    monkeypatch.setenv("MOROK_COMPILE_MODE", "processes")     # a parallel mode by name: two workers at least
    assert (batch.plan_for(100).mode, batch.plan_for(100).workers) == ("processes", 2)
    monkeypatch.delenv("MOROK_COMPILE_MODE")
    monkeypatch.setenv("MOROK_COMPILE_WORKERS", "2")
    assert batch.plan_for(100).workers == 2


def test_debug_prints_the_plan(cpu, monkeypatch, capsys):
    monkeypatch.setenv("MOROK_DEBUG", "1")
    monkeypatch.setenv("MOROK_COMPILE_WORKERS", "2")
    cpu.compile_many(kernel_set())
    assert "compile_many on CPU/llvm: 10 distinct kernel(s): processes x2" in capsys.readouterr().err


# ---- compile-only GPU pairs -------------------------------------------------------------------

def gpu_pairs(kind: str, arch: str):
    if kind == "CUDA":
        pytest.importorskip("cuda.bindings", reason="the cuda extra is not installed (pip install morok-py[cuda])")
        from morok_py.backends.cuda import compile_only_pairs
    else:
        from morok_py.backends.rocm import compile_only_pairs
    return compile_only_pairs(arch)


@pytest.mark.parametrize("kind,arch", [("CUDA", "sm_90"), ("ROCM", "gfx90a")])
def test_compile_only_pairs_batch_like_sequential(tmp_path, monkeypatch, kind, arch):
    monkeypatch.setenv("MOROK_CACHE_DIR", str(tmp_path))
    pairs = gpu_pairs(kind, arch)
    usable = [(r, c) for r, c in pairs if c.available() is None]
    if not usable:
        pytest.skip(f"no {kind} compiler usable here: " + "; ".join(f"{c.cache_key}: {c.available()}" for _, c in pairs))
    items = kernel_set()
    for r, c in usable:
        monkeypatch.setenv("MOROK_CACHE", "0")
        sequential = [c.compile(r.render(ast, name)) for ast, name in items]
        monkeypatch.delenv("MOROK_CACHE")
        for mode in ("threads", "processes"):
            monkeypatch.setenv("MOROK_COMPILE_MODE", mode)
            got = batch.compile_specs(r, c, items + items[:2], workers=2)
            assert len(got) == len(items) + 2
            for g, s in zip(got, sequential + sequential[:2]):
                assert (g.name, g.payload, g.global_size, g.local_size, g.arch, g.compiler) == \
                    (s.name, s.payload, s.global_size, s.local_size, s.arch, s.compiler), (c.cache_key, mode, g.name)


# ---- the CPU's cheap pipeline for small kernels ------------------------------------------------

def test_small_kernel_rule():
    from morok_py.device import ProgramSpec
    cpu = get_device("CPU")
    small = cpu.renderer.render(scaled_add(1001, 2.0), "small")
    big = cpu.renderer.render(scaled_add(cpu_compiler.SMALL_KERNEL_WORK + 1, 2.0), "big")
    symbolic = cpu.renderer.render(K.add(), "symbolic")
    assert isinstance(small, ProgramSpec)
    assert cpu_compiler.kernel_work(small.ast) == 1001 and cpu_compiler.pipeline_for(small) == "small"
    assert cpu_compiler.pipeline_for(big) == "full"
    assert cpu_compiler.kernel_work(symbolic.ast) is None and cpu_compiler.pipeline_for(symbolic) == "full"


def test_small_pipeline_computes_what_o3_computes(cpu, monkeypatch):
    n, k = 1001, -1.25
    prog = cpu.compile(scaled_add(n, k), "small_one")
    run_scaled_add(prog, cpu, n, k)
    spec = cpu.renderer.render(scaled_add(n, k), "small_one")
    monkeypatch.setattr(cpu_compiler, "SMALL_KERNEL_WORK", -1)
    assert cpu_compiler.pipeline_for(spec) == "full"
    full = cpu.runtime(cpu.compiler.compile(spec))
    run_scaled_add(full, cpu, n, k)
