"""The native worker pool of split CPU launches (backends/cpu/pool.py): results identical to one thread for
every kernel arity, more threads than cores, idle workers that sleep at once, concurrent launches from
several Python threads, a forked child, and bad settings. Hang-prone cases run in a subprocess with a
time limit, so a deadlock fails the test instead of stopping the suite."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from morok_py import dtypes, kernels as K
from morok_py.backends.cpu import runtime as cpu_runtime
from morok_py.backends.cpu.pool import native_pool_error

from conftest import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the native pool is Linux-only")


@pytest.fixture
def split_everything(monkeypatch):
    for name in ("PARALLEL_MIN_WORK", "PARALLEL_SURE_WORK", "NATIVE_MIN_WORK", "NATIVE_SURE_WORK"):
        monkeypatch.setattr(cpu_runtime, name, 1)
    monkeypatch.setenv("MOROK_CPU_POOL", "native")


def _mlp(cpu, rng, M, Kd, N):
    """The fused dense layer with symbolic sizes: 4 buffers and 3 values (7-pointer trampolines with the
    hidden panel scratch of a packed tile, or 4 without)."""
    x, w, bias = (rng.standard_normal(s).astype(np.float32) for s in ((M, Kd), (Kd, N), (N,)))
    out = cpu.buf(np.full(M * N, np.nan, np.float32))
    cpu.compile(K.matmul_bias_relu(), name="pool_dense")(cpu.buf(x), cpu.buf(w), cpu.buf(bias), out, M=M, N=N, K=Kd)
    return out.numpy().reshape(M, N), np.maximum(x.astype(np.float64) @ w + bias, 0)


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_split_launches_on_native_workers_equal_one_thread(cpu, rng, monkeypatch, split_everything, threads):
    """8 threads on this 2-core machine too: more workers than cores must still finish (they yield)."""
    monkeypatch.setenv("MOROK_CPU_THREADS", str(threads))
    n = 100_003
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    out = cpu.empty(n, dtypes.float32)
    add = cpu.compile(K.add(), name="pool_add")
    for _ in range(50):
        add(cpu.buf(a), cpu.buf(b), out, n=n)
    np.testing.assert_array_equal(out.numpy(), a + b)
    assert add._native_pool() is not None, native_pool_error()
    assert add._native_pool().workers >= threads - 1
    got, want = _mlp(cpu, rng, 97, 70, 131)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("MOROK_CPU_THREADS", "1")
    one, _ = _mlp(cpu, np.random.default_rng(0), 97, 70, 131)
    many = _mlp(cpu, np.random.default_rng(0), 97, 70, 131)[0]
    np.testing.assert_array_equal(one, many)


@pytest.mark.parametrize("home", [True, False], ids=["home_blocks", "shared_counter"])
@pytest.mark.parametrize("threads", [2, 3, 8])
def test_every_chunk_runs_exactly_once_with_home_blocks_or_one_counter(cpu, rng, monkeypatch, split_everything,
                                                                        threads, home):
    """Each thread of a launch takes its own block of chunks first, then what is left of the others' (or every
    thread takes from one shared counter): an in-place add, launched 40 times, equals numpy's 40 sequential adds
    exactly, so no chunk ran twice or never, also with more threads than cores (home blocks of workers that did not
    join are taken by the others)."""
    monkeypatch.setenv("MOROK_CPU_THREADS", str(threads))
    n = 100_003
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    from morok_py.ir import UOp
    acc, db = cpu.buf(a), cpu.buf(b)
    x, y, i = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32), UOp.range(K.size(None, "n"), 0)
    add = cpu.compile(UOp.sink(x.store(i, x.load(i) + y.load(i))), name="pool_add_inplace")    # x[i] += y[i]
    pool = add._native_pool()
    assert pool is not None, native_pool_error()
    pool.set_home(home)
    try:
        assert pool.home is home
        want = a.copy()
        for _ in range(40):
            add(acc, db, n=n)
            want += b
        np.testing.assert_array_equal(acc.numpy(), want)
    finally:
        pool.set_home(True)


def test_a_launch_with_fewer_threads_than_workers_waits_only_for_the_ones_it_asks_for(cpu, rng, monkeypatch,
                                                                                     split_everything):
    """After 8-way launches made 7 workers, 2- and 3-way launches (a small kernel's split is capped by its
    work) take at most 1 and 2 of them (a worker that was still asleep when the work ran out is not waited
    for): each launch records the workers that joined; spinning workers do join; every
    result is exact, sleeping workers and spinning ones alike."""
    import ctypes
    n = 2_000_003       # ~1 ms alone: long enough that a spinning worker joins before the work runs out
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    out = cpu.empty(n, dtypes.float32)
    add = cpu.compile(K.add(), name="pool_add_cap")
    da, db = cpu.buf(a), cpu.buf(b)
    for threads, spin in (("8", "4096"), ("2", "4096"), ("3", "0"), ("8", "0"), ("2", "0"), ("3", "4096")):
        monkeypatch.setenv("MOROK_CPU_THREADS", threads)
        monkeypatch.setenv("MOROK_CPU_SPIN", spin)
        pool = add._native_pool()
        assert pool is not None, native_pool_error()
        joined = ctypes.c_int64.from_address(pool._engine.get_global_value_address("joined"))
        out.copyin(np.zeros(n, np.float32))
        seen = []
        for _ in range(20):     # back to back: a spinning worker is awake for the next launch
            add(da, db, out, n=n)
            seen.append(joined.value)
        np.testing.assert_array_equal(out.numpy(), a + b)
        assert max(seen) <= int(threads) - 1 and pool.workers >= 7
        if spin != "0":     # spinning workers join (how many before the work runs out: the host's cores)
            assert max(seen) >= 1, (threads, spin, seen)


def test_workers_that_sleep_at_once_still_take_every_launch(cpu, rng, monkeypatch, split_everything):
    monkeypatch.setenv("MOROK_CPU_SPIN", "0")
    monkeypatch.setenv("MOROK_CPU_THREADS", "3")
    x = rng.standard_normal(40_001).astype(np.float32)
    out = cpu.empty(x.size, dtypes.float32)
    neg = cpu.compile(K.unary("neg"), name="pool_neg_sleepy")
    assert neg._native_pool() is not None, native_pool_error()
    for i in range(30):
        out.copyin(np.zeros(x.size, np.float32))
        neg(cpu.buf(x * i), out, n=x.size)
        np.testing.assert_array_equal(out.numpy(), -(x * i))


def test_concurrent_launches_from_python_threads(cpu, rng, monkeypatch, split_everything):
    """Four Python threads launch split kernels at once; the pool takes one launch at a time."""
    monkeypatch.setenv("MOROK_CPU_THREADS", "2")
    n = 30_011
    add = cpu.compile(K.add(), name="pool_add_concurrent")
    errs: list[BaseException] = []

    def work(seed):
        try:
            r = np.random.default_rng(seed)
            for _ in range(40):
                a, b = r.standard_normal(n).astype(np.float32), r.standard_normal(n).astype(np.float32)
                out = cpu.empty(n, dtypes.float32)
                add(cpu.buf(a), cpu.buf(b), out, n=n)
                np.testing.assert_array_equal(out.numpy(), a + b)
        except BaseException as e:      # noqa: BLE001
            errs.append(e)
    ts = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts), "a launch never finished"
    assert not errs, errs[0]


# the subprocess scripts' start: every launch split, on the native pool
_PREAMBLE = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from morok_py import Device, Buffer, dtypes, kernels as K
    from morok_py.backends.cpu import runtime as rt
    for name in ("NATIVE_MIN_WORK", "NATIVE_SURE_WORK"):
        setattr(rt, name, 1)
    os.environ["MOROK_CPU_POOL"] = "native"
""")
_SCRIPT = _PREAMBLE + textwrap.dedent("""
    os.environ["MOROK_CPU_THREADS"] = "3"
    dev = Device["CPU"]
    add = dev.compile(K.add(), name="pool_fork_add")
    def launch(seed, reps):
        r = np.random.default_rng(seed)
        n = 50_021
        a, b = r.standard_normal(n).astype(np.float32), r.standard_normal(n).astype(np.float32)
        out = dev.buffer(n, dtypes.float32)
        for _ in range(reps):
            add(Buffer.from_numpy(a, dev), Buffer.from_numpy(b, dev), out, n=n)
        assert np.array_equal(out.numpy(), a + b)
    launch(1, 2000)                 # many back-to-back launches: no lost wake-up
    assert add._native_pool().workers == 2
    held = add._native_pool().lock
    held.acquire()                  # as if another thread were launching at the fork
    pid = os.fork()
    if pid != 0:
        held.release()
    if pid == 0:                    # the child has no workers until it launches: they are made again
        try:
            launch(2, 20)
            os._exit(0 if add._native_pool().workers == 2 else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    launch(3, 20)
    print("child", os.waitstatus_to_exitcode(status))
""")


def test_many_launches_and_a_forked_child(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=240, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "child 0" in r.stdout, (r.stdout, r.stderr[-2000:])


_ALTERNATING = _PREAMBLE + textwrap.dedent("""
    dev = Device["CPU"]
    add = dev.compile(K.add(), name="pool_alternating_add")
    r = np.random.default_rng(5)
    n = 4099
    a, b = r.standard_normal(n).astype(np.float32), r.standard_normal(n).astype(np.float32)
    da, db, out = Buffer.from_numpy(a, dev), Buffer.from_numpy(b, dev), dev.buffer(n, dtypes.float32)
    t0 = time.perf_counter()
    launches = 0
    while time.perf_counter() - t0 < float(sys.argv[1]):
        for threads in ("2", "16", "3", "16"):      # few workers asked, then many: the next launch's larger want
            os.environ["MOROK_CPU_THREADS"] = threads
            out.copyin(np.zeros(n, np.float32))
            add(da, db, out, n=n)
            assert np.array_equal(out.numpy(), a + b), launches
            launches += 1
    print("launches", launches, "workers", add._native_pool().workers)
""")


def test_launches_asking_few_then_many_workers_never_hang(tmp_path):
    """16-way launches after 2- and 3-way ones on this machine's few cores, back to back for 20 s: a worker that
    read a finished launch's closed ticket while the next launch had already stored its larger want must not join
    the finished one (it once counted itself done in the next launch's counter, which then waited forever: a
    resnet50 replay at 16 threads on 2 vCPUs hung within 50 replays). In a subprocess with a time limit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        r = subprocess.run([sys.executable, "-c", _ALTERNATING, "20"], capture_output=True, text=True, timeout=120,
                           env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the launches hung: {e.stdout!r} {e.stderr!r}")
    assert r.returncode == 0, r.stderr[-3000:]
    launches = int(r.stdout.split()[1])
    assert launches >= 1000 and "workers 15" in r.stdout, r.stdout


@pytest.mark.parametrize("var,value", [("MOROK_CPU_POOL", "pthreads"), ("MOROK_CPU_SPIN", "-1"),
                                       ("MOROK_CPU_SPIN", "lots"), ("MOROK_CPU_PIN", "yes")])
def test_bad_pool_settings_are_refused_before_any_launch(cpu, rng, monkeypatch, split_everything, var, value):
    monkeypatch.setenv(var, value)
    monkeypatch.setenv("MOROK_CPU_THREADS", "2")
    x = rng.standard_normal(1001).astype(np.float32)
    out = cpu.buf(np.zeros(1001, np.float32))
    prog = cpu.compile(K.unary("neg"), name=f"pool_bad_{var}_{value}")
    with pytest.raises(ValueError, match=var):
        prog(cpu.buf(x), out, n=1001)
    assert (out.numpy() == 0).all()      # nothing ran


_PIN_SCRIPT = _PREAMBLE + textwrap.dedent("""
    os.environ["MOROK_CPU_THREADS"] = "3"
    dev = Device["CPU"]
    add = dev.compile(K.add(), name="pool_pin_add")
    r = np.random.default_rng(5)
    n = 70_001
    a, b = r.standard_normal(n).astype(np.float32), r.standard_normal(n).astype(np.float32)
    out = dev.buffer(n, dtypes.float32)
    for _ in range(30):
        add(Buffer.from_numpy(a, dev), Buffer.from_numpy(b, dev), out, n=n)
    assert np.array_equal(out.numpy(), a + b)
    pool = add._native_pool()
    # each thread of this process and the CPUs it may run on
    tasks = {}
    for tid in os.listdir("/proc/self/task"):
        tasks[int(tid)] = sorted(os.sched_getaffinity(int(tid)))
    import json
    print(json.dumps({"workers": pool.workers, "pinned": pool.pinned, "tasks": list(tasks.values())}))
""")


def _run_pin_script(pin: str, tmp_path, cpus: list[int]):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MOROK_CPU_PIN": pin}
    r = subprocess.run(["taskset", "-c", ",".join(map(str, cpus)), sys.executable, "-c", _PIN_SCRIPT],
                       capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    return got["workers"], got["pinned"], got["tasks"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
                    reason="pinning needs at least 2 CPUs in this process's affinity set")
def test_workers_are_pinned_each_to_its_own_cpu_after_the_first(tmp_path):
    """With 3 threads on the process's CPUs c0 < c1 [< ...]: worker k runs on CPU number k + 1 of the set
    alone (wrapping round where there are fewer CPUs than threads); the launching thread keeps the whole set.
    MOROK_CPU_PIN=0 leaves every thread free."""
    import shutil
    if shutil.which("taskset") is None:
        pytest.skip("taskset (util-linux) is not installed")
    cpus = sorted(os.sched_getaffinity(0))[:4]
    workers, pinned, tasks = _run_pin_script("1", tmp_path, cpus)
    assert workers == 2
    assert pinned == [cpus[1 % len(cpus)], cpus[2 % len(cpus)]]
    singles = sorted(c[0] for c in tasks if len(c) == 1)
    assert singles == sorted(pinned), tasks
    whole = [c for c in tasks if c == cpus]
    assert whole, f"the launching thread lost its affinity set: {tasks}"
    workers, pinned, tasks = _run_pin_script("0", tmp_path, cpus)
    assert workers == 2 and pinned == []
    assert all(c == cpus for c in tasks), tasks


def test_one_program_launched_on_many_buffer_sets_keeps_a_block_for_each(cpu, rng, monkeypatch, split_everything):
    """A plan that runs one program for many layers (other buffers and values each time) keeps an argument
    block per launch; alternating launches each read and write their own memory, values included, and the
    kept blocks stay bounded (BLOCKS_KEPT)."""
    monkeypatch.setenv("MOROK_CPU_THREADS", "3")
    monkeypatch.setattr(cpu_runtime, "BLOCKS_KEPT", 4)
    prog = cpu.compile(K.add(), name="pool_blocks")
    sets = []
    for n in (1001, 517, 1001, 63, 2049, 777):
        a, b = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
        sets.append((cpu.buf(a), cpu.buf(b), cpu.buf(np.full(n, np.nan, np.float32)), a + b, n))
    for _ in range(3):
        for ba, bb, out, want, n in sets:
            out.copyin(np.full(n, np.nan, np.float32))
            prog(ba, bb, out, n=n)
            np.testing.assert_array_equal(out.numpy(), want)
    assert 1 <= len(prog._blocks) <= 4
