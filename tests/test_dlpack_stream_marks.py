"""What a GPU device knows about its own stream: every launch, copy and wait queued on it marks it, and a
check that finds it idle (a query, a synchronize) remembers that, so a DLPack export whose buffer has
nothing pending on our side orders nothing and calls no driver function. The bookkeeping is checked on
CUDA and ROCm devices built without a GPU (fake driver calls), and on CUDA (marked `cuda`) against a
PyTorch consumer on a side stream, for each way of queuing a kernel."""
from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from morok_py import Buffer, dtypes, kernels as K
from morok_py import dlpack as D
from morok_py.dlpack import DLPackError
from test_dlpack import gpu, torch  # noqa: F401 -- fixtures shared with the DLPack tests


# ---- without a GPU: the devices' bookkeeping over fake driver calls --------------------------------

class FakeDriver:
    """Counts queries, records and waits; `busy` says what the next query answers, and `during_query`
    runs inside a query (work queued by another thread while the check runs)."""

    OK, BUSY = 0, 600

    def __init__(self) -> None:
        self.queries, self.records, self.waits = 0, 0, 0
        self.busy = False
        self.during_query = None

    def query(self, stream):
        self.queries += 1
        if self.during_query is not None:
            self.during_query()
        return (self.BUSY if self.busy else self.OK,)

    def record(self, event, stream):
        self.records += 1
        return (self.OK,)

    def wait(self, stream, event, flags):
        self.waits += 1
        return (self.OK,)


def fake_cuda(monkeypatch=None):
    from morok_py.backends.cuda import device as M
    drv = FakeDriver()
    dev = object.__new__(M.CUDADevice)
    dev._tls = types.SimpleNamespace(device=dev)
    dev.stream = "our stream"
    check = lambda result, call: None      # noqa: E731
    dev._dlpack_api = (drv.query, drv.record, drv.wait, FakeDriver.OK, "legacy", check, ("ev0", "ev1"),
                       {None: "legacy", 1: "legacy", 2: "per-thread"})
    return dev, drv


def fake_check(result, call):
    """rocm.runtime.check without hip-python's module (no HIP runtime here): the fakes always succeed."""
    return result[1] if len(result) == 2 else None


def fake_rocm(monkeypatch):
    from morok_py.backends.rocm import device as M, runtime as R
    monkeypatch.setattr(M, "check", fake_check)
    monkeypatch.setattr(R, "check", fake_check)
    drv = FakeDriver()
    dev = object.__new__(M.ROCMDevice)
    dev.ordinal = 0
    M._current.ordinal = 0
    dev.stream = None
    dev._hip = types.SimpleNamespace(
        hipStreamQuery=drv.query, hipEventRecord=drv.record, hipStreamWaitEvent=drv.wait,
        hipSetDevice=lambda ordinal: (FakeDriver.OK,),
        hipEventCreate=lambda: (FakeDriver.OK, "event"), hipError_t=types.SimpleNamespace(hipSuccess=FakeDriver.OK))
    return dev, drv


# the stream handle each device's export orders: CUDA's legacy default stream, a ROCm stream handle
DEVICES = {"cuda": (fake_cuda, 1), "rocm": (fake_rocm, 12345)}


@pytest.fixture(params=sorted(DEVICES))
def fake(request, monkeypatch):
    make, stream = DEVICES[request.param]
    dev, drv = make(monkeypatch)
    return dev, drv, stream


def test_an_export_queries_once_then_knows_the_stream_is_idle(fake):
    dev, drv, stream = fake
    dev.dlpack_sync(stream)
    assert (drv.queries, drv.records, drv.waits) == (1, 0, 0)
    for _ in range(3):
        dev.dlpack_sync(stream)
    assert (drv.queries, drv.records, drv.waits) == (1, 0, 0)       # known idle: no driver call


def test_work_queued_after_the_check_makes_the_next_export_look_again(fake):
    dev, drv, stream = fake
    dev.dlpack_sync(stream)
    dev.stream_used()
    drv.busy = True
    dev.dlpack_sync(stream)
    assert (drv.queries, drv.records, drv.waits) == (2, 1, 1)       # pending: the consumer waits on an event
    dev.dlpack_sync(stream)
    assert (drv.queries, drv.records, drv.waits) == (3, 2, 2)       # still not known idle
    drv.busy = False
    dev.dlpack_sync(stream)
    dev.dlpack_sync(stream)
    assert (drv.queries, drv.records, drv.waits) == (4, 2, 2)


def test_work_queued_while_a_check_runs_is_not_taken_for_idle(fake):
    """Another thread queues a kernel after the query looked but before the check stored its answer:
    the check must not call the stream idle."""
    dev, drv, stream = fake
    drv.during_query = dev.stream_used
    assert dev.stream_idle() is True          # everything queued before the query is done...
    drv.during_query = None
    assert dev.stream_idle() is True          # ...but the kernel queued meanwhile needs a look of its own
    assert drv.queries == 2
    dev.dlpack_sync(stream)
    assert drv.queries == 2


def test_the_known_idle_shortcut_still_refuses_what_the_protocol_forbids(monkeypatch):
    dev, drv = fake_cuda()
    dev.dlpack_sync(1)
    with pytest.raises(DLPackError, match="stream=0"):
        dev.dlpack_sync(0)
    rdev, _ = fake_rocm(monkeypatch)
    rdev.dlpack_sync(12345)
    for stream in (1, 2):
        with pytest.raises(DLPackError, match="CUDA's default-stream"):
            rdev.dlpack_sync(stream)


def test_stream_minus_one_and_our_own_stream_order_nothing(fake):
    dev, drv, _ = fake
    dev.dlpack_sync(-1)
    assert drv.queries == 0


def test_an_import_that_waits_marks_our_stream(fake):
    """Our stream waiting on a producer's pending work is work queued on it: an export after that orders."""
    dev, drv, stream = fake
    dev.dlpack_sync(stream)                  # known idle
    drv.busy = True
    dev.dlpack_imported(777)                 # remembered only: no driver call at the import
    assert (drv.queries, drv.waits) == (1, 0)
    dev.dlpack_sync(stream)                  # the producer's stream is busy: ours waits on it, the consumer on ours
    assert drv.queries == 3 and drv.waits == 2


def test_a_rocm_import_from_the_default_stream_marks_it(monkeypatch):
    """ROCm's device stream is HIP's default stream: a producer's pending work there is ours to order after."""
    dev, drv = fake_rocm(monkeypatch)
    dev.dlpack_sync(12345)
    dev.dlpack_imported(0)
    dev.dlpack_sync(12345)
    assert drv.queries == 2


def test_a_prepared_cuda_launch_marks_the_stream():
    """The checked call's replay (CUDAProgram.prepare) bypasses execute: it marks the stream itself,
    after queuing, and still exposes its arguments to prepared_failed."""
    from morok_py.backends.cuda.runtime import CUDAProgram
    dev, drv = fake_cuda()
    calls = []

    def launch(*args):
        calls.append((args, dev._queued))
        return (0,)
    prog = object.__new__(CUDAProgram)
    prog.device, prog._fn, prog._smem, prog._stream, prog._launch = dev, "fn", 0, dev.stream, launch
    prog._nbufs, prog._nvars, prog._hidden_ptrs = 2, 1, []
    run = prog.prepare([16, 32], [7], (3, 1, 1), (128, 1, 1))
    assert dev.stream_idle()
    assert run() == (0,)
    assert calls[0][0][:7] == ("fn", 3, 1, 1, 128, 1, 1) and run.args[1:4] == (3, 1, 1)
    assert calls[0][1] is not None           # the mark comes after the launch is queued
    assert dev._queued is None
    dev.dlpack_sync(1)
    assert drv.queries == 2


def test_a_cuda_execute_marks_the_stream():
    from morok_py.backends.cuda.runtime import CUDAProgram
    dev, drv = fake_cuda()
    prog = object.__new__(CUDAProgram)
    prog.device, prog._fn, prog._smem, prog._stream = dev, "fn", 0, dev.stream
    prog._launch = lambda *args: (0,)
    prog._nbufs, prog._nvars, prog._hidden_ptrs = 1, 0, []
    prog._slots = (np.zeros(1, np.uint64))
    prog._lb, prog._lv, prog.kernel_params, prog._tls = [16], [], 0, dev._tls
    assert dev.stream_idle()
    prog.execute([16], [], (1, 1, 1), (32, 1, 1))
    assert dev._queued is None


def test_a_rocm_launch_and_copies_mark_the_stream(monkeypatch):
    from morok_py.backends.rocm import allocator as A
    from morok_py.backends.rocm.allocator import HIPAllocator
    from morok_py.backends.rocm.runtime import HIPProgram
    dev, drv = fake_rocm(monkeypatch)
    monkeypatch.setattr(A, "check", fake_check)
    dev._hip.hipModuleLaunchKernel = lambda *args: (FakeDriver.OK,)
    dev._hip.hipMemcpyAsync = lambda *args: (FakeDriver.OK,)
    dev._hip.hipMemcpyKind = types.SimpleNamespace(hipMemcpyHostToDevice=1, hipMemcpyDeviceToHost=2)
    prog = object.__new__(HIPProgram)
    prog.device, prog._hip, prog._fn, prog.extra = dev, dev._hip, "fn", None
    prog._last_bufs, prog._last_vals, prog._nbufs, prog._nvars = [16], [], 1, 0
    assert dev.stream_idle()
    prog.execute([16], [], (1, 1, 1), (64, 1, 1))
    assert dev._queued is None
    alloc = object.__new__(HIPAllocator)
    alloc.device, alloc._hip = dev, dev._hip
    for copy in (alloc._copy_to_device_async, alloc._copy_to_host_async):
        assert dev.stream_idle()
        copy(16, 32, 4)
        assert dev._queued is None


def test_concurrent_checks_never_call_pending_work_idle(fake):
    """Exporting threads check while the main thread completes and queues work: once a kernel is queued
    (pending, then marked) no check may find the stream idle, however its query and its answer
    interleave with the mark (a check that looked before the kernel was queued answers after it)."""
    dev, drv, stream = fake
    drv.busy = True
    stop = threading.Event()
    errors = []

    def exporter():
        try:
            while not stop.is_set():
                dev.dlpack_sync(stream)
        except Exception as e:     # pragma: no cover - shown by the assert below
            errors.append(e)
    threads = [threading.Thread(target=exporter) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(3000):
            drv.busy = False          # everything done: checks may find it idle now
            drv.busy = True           # a kernel queued...
            dev.stream_used()         # ...and marked
            assert dev._queued is not dev._idle
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors and dev._queued is not dev._idle and drv.queries > 0


# ---- CUDA: a PyTorch consumer on a side stream after each way of queuing a kernel ---------------
# (fixtures: test_dlpack's `gpu`, the CUDA device on nvrtc, and `torch`)


@pytest.mark.cuda
def test_an_idle_stream_exports_without_a_driver_call(gpu, torch, monkeypatch):
    b = gpu.buffer(1001, dtypes.float32)
    gpu.synchronize()
    api = gpu._dlpack_api or gpu._dlpack_setup()
    queries = []
    monkeypatch.setattr(gpu, "_dlpack_api", (lambda s: queries.append(s) or api[0](s),) + api[1:])
    for _ in range(3):
        t = torch.from_dlpack(b)
        assert t.data_ptr() == b.ptr
    assert queries == []


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["execute", "checked call", "checked replay", "plan", "captured plan"])
def test_an_export_after_each_way_of_queuing_orders_the_consumer(gpu, torch, rng, path):
    """The stream is known idle, then 24 adds (about a millisecond) are queued one way; torch reads the
    result at once on a side stream: it must see the last add's values, not the poison before it."""
    from morok_py import ExecutionPlan
    n = 1 << 24
    x = rng.standard_normal(n).astype(np.float32)
    a = Buffer.from_numpy(x, gpu)
    out = Buffer.from_numpy(np.full(n, -7, np.float32), gpu)
    add = gpu.compile(K.add(), name="dlpack_marks_add")
    reps = 24
    gs, ls = add.launch.launch_dims({"n": n})
    if path == "execute":
        run = lambda: [add.execute([a.ptr, a.ptr, out.ptr], [n], gs, ls) for _ in range(reps)]   # noqa: E731
    elif path == "checked call":
        run = lambda: add(a, a, out, n=n)    # noqa: E731  (first call: the full check, then execute)
        reps = 1
    elif path == "checked replay":
        add(a, a, out, n=n)
        run = lambda: [add(a, a, out, n=n) for _ in range(reps)]    # noqa: E731
    else:
        plan = ExecutionPlan(gpu, capture=path == "captured plan")
        for _ in range(reps):
            plan.add(add, a, a, out, n=n)
        plan.run()
        plan.run()
        run = plan.run
    side = torch.cuda.Stream()
    for _ in range(2):
        out.copyin(np.full(n, -7, np.float32))
        gpu.synchronize()
        assert gpu.stream_idle() and gpu._queued is gpu._idle      # known idle: no query needed
        run()
        assert gpu._queued is None
        with torch.cuda.stream(side):
            got = (torch.from_dlpack(out) * 1).cpu().numpy()
        np.testing.assert_array_equal(got, 2 * x)
    if path == "captured plan":
        assert plan.captured


# ---- lazy import ordering: remembered at the import, ordered at the next use ------------------------

def _fake_cuda_program(dev):
    from morok_py.backends.cuda.runtime import CUDAProgram
    prog = object.__new__(CUDAProgram)
    launched = []
    prog.device, prog._fn, prog._smem, prog._stream = dev, "fn", 0, dev._stream
    prog._launch = lambda *args: launched.append(args) or (0,)
    prog._nbufs, prog._nvars, prog._hidden_ptrs = 1, 0, []
    prog._slots = (np.zeros(1, np.uint64))
    prog._lb, prog._lv, prog.kernel_params, prog._tls = [16], [], 0, dev._tls
    return prog, launched


def test_an_import_calls_no_driver_and_remembers_each_producer_once(fake):
    dev, drv, stream = fake
    drv.busy = True
    for producer in (777, 888, 777, 777, 888):
        dev.dlpack_imported(producer)
    assert (drv.queries, drv.records, drv.waits) == (0, 0, 0)
    assert dev._pending == [777, 888]
    dev.stream                                  # reading the stream (what the copies do) orders them
    assert (drv.queries, drv.records, drv.waits) == (2, 2, 2)
    assert dev._pending == [] and dev._queued is None
    dev.stream
    dev.order_imports()
    assert (drv.queries, drv.records, drv.waits) == (2, 2, 2)      # ordered once


def test_an_idle_producer_costs_one_query_at_the_next_use_and_no_wait(fake):
    dev, drv, stream = fake
    dev.dlpack_sync(stream)                     # known idle
    dev.dlpack_imported(777)
    dev.dlpack_sync(stream)
    assert (drv.queries, drv.records, drv.waits) == (2, 0, 0)       # the producer's query; ours known idle
    assert dev._pending == [] and dev._queued is dev._idle


def test_cuda_default_stream_names_are_one_producer_and_per_thread_is_ordered_at_once():
    dev, drv = fake_cuda()
    for producer in (None, 0, 1, None):
        dev.dlpack_imported(producer)
    assert dev._pending == [1] and drv.queries == 0         # the legacy default stream, once
    drv.busy = True
    dev.dlpack_imported(2)          # the per-thread default stream means this thread's: ordered now
    assert (drv.queries, drv.waits) == (1, 1) and dev._pending == [1]


def test_a_rocm_import_from_the_default_stream_pends_nothing(monkeypatch):
    dev, drv = fake_rocm(monkeypatch)
    dev.dlpack_imported(None)
    dev.dlpack_imported(0)
    assert not dev._pending and drv.queries == 0


def test_a_rocm_export_to_the_default_stream_orders_pending_imports(monkeypatch):
    """ROCm's consumer on HIP's default stream is on our stream: it must wait for the producers."""
    dev, drv = fake_rocm(monkeypatch)
    drv.busy = True
    dev.dlpack_imported(777)
    dev.dlpack_sync(None)
    assert (drv.queries, drv.records, drv.waits) == (1, 1, 1) and not dev._pending


USES = ["stream", "stream_idle", "dlpack_sync", "synchronized", "execute", "prepared launch"]


@pytest.mark.parametrize("use", USES)
def test_every_use_of_the_cuda_stream_orders_pending_imports_first(use):
    """The producer's stream is busy: our stream must wait on it before the launch is queued."""
    dev, drv = fake_cuda()
    calls = []
    drv.record = lambda event, stream: calls.append(("record", stream)) or (0,)
    drv.wait = lambda stream, event, flags: calls.append(("wait", stream)) or (0,)
    q, _r, _w, *rest = dev._dlpack_api
    dev._dlpack_api = (q, drv.record, drv.wait, *rest)
    drv.busy = True
    dev.dlpack_imported(777)
    prog, launched = _fake_cuda_program(dev)
    prog._launch = lambda *args: calls.append(("launch",)) or (0,)
    if use == "stream":
        dev.stream
    elif use == "stream_idle":
        dev.stream_idle()
    elif use == "dlpack_sync":
        dev.dlpack_sync(1)
    elif use == "synchronized":
        dev.synchronized(lambda: calls.append(("sync",)))
    elif use == "execute":
        prog.execute([16], [], (1, 1, 1), (32, 1, 1))
    else:
        prog.prepare([16], [], (1, 1, 1), (32, 1, 1))()
    assert [c[0] for c in calls[:2]] == ["record", "wait"]
    assert int(calls[0][1]) == 777 and calls[1][1] == "our stream"     # on the producer's; ours waits
    assert not dev._pending
    if use in ("execute", "prepared launch", "synchronized"):
        assert calls[2][0] in ("launch", "sync")     # after the wait


def test_a_rocm_launch_orders_pending_imports_first(monkeypatch):
    from morok_py.backends.rocm.runtime import HIPProgram
    dev, drv = fake_rocm(monkeypatch)
    calls = []
    dev._hip.hipStreamWaitEvent = lambda stream, event, flags: calls.append(("wait", stream)) or (0,)
    dev._hip.hipModuleLaunchKernel = lambda *args: calls.append(("launch", args[8])) or (0,)
    prog = object.__new__(HIPProgram)
    prog.device, prog._hip, prog._fn, prog.extra = dev, dev._hip, "fn", None
    prog._last_bufs, prog._last_vals, prog._nbufs, prog._nvars = [16], [], 1, 0
    drv.busy = True
    dev.dlpack_imported(777)
    prog.execute([16], [], (1, 1, 1), (64, 1, 1))
    assert calls == [("wait", None), ("launch", None)] and not dev._pending


def test_an_import_during_the_ordering_is_not_lost(fake):
    """A producer stream imported again while its ordering runs (between the event's record and the
    list's clearing) may have new work after that record: it must stay pending, and a use meanwhile must
    wait for the ordering instead of finding the list empty."""
    dev, drv, stream = fake
    drv.busy = True
    dev.dlpack_imported(777)
    seen = {}

    def during():
        drv.during_query = None
        assert dev._pending == [777]            # still listed while it is being ordered
        t = threading.Thread(target=dev.dlpack_imported, args=(777,))
        t.start()
        t.join(0.2)
        seen["blocked"] = t.is_alive()          # the import waits for the ordering's lock
        seen["thread"] = t
    drv.during_query = during
    dev.order_imports()
    seen["thread"].join()
    assert seen["blocked"] and dev._pending == [777]      # remembered again, ordered at the next use
    dev.stream
    assert drv.queries == 2 and not dev._pending


def test_an_ordering_that_fails_raises_and_forgets_the_producer(fake):
    dev, drv, stream = fake
    drv.busy = True
    dev.dlpack_imported(777)

    def fail():
        raise RuntimeError("driver error")
    drv.during_query = fail
    with pytest.raises(RuntimeError, match="driver error"):
        dev.stream_idle()
    drv.during_query = None
    assert not dev._pending


# ---- CUDA: a torch tensor written late on a side stream, imported, then used at once ---------------

def _late_tensor(torch, side, src):
    """A copy of `src` that a side stream writes after ~0.1 s of sleep: still pending when imported."""
    z = torch.full_like(src, -3.0)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        z.copy_(src)
    return z


@pytest.mark.cuda
@pytest.mark.parametrize("protocol", ["exchange", "__dlpack__"])
@pytest.mark.parametrize("use", ["kernel", "numpy", "torch on another stream", "copyin", "synchronize",
                                 "plan", "captured plan"])
def test_a_pending_producer_is_ordered_before_the_next_use(gpu, torch, rng, monkeypatch, protocol, use):
    from morok_py import ExecutionPlan
    if protocol == "__dlpack__":
        monkeypatch.setattr(D, "exchange_api", lambda tp: None)
    elif not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        pytest.skip("this PyTorch has no DLPack C exchange API")
    n = 1 << 20
    x = rng.standard_normal(n).astype(np.float32)
    src = torch.from_numpy(x).cuda()
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    add = gpu.compile(K.add(), name="dlpack_lazy_add")
    out = gpu.buffer(n, dtypes.float32)
    plan = None
    if use in ("plan", "captured plan"):
        # a plan bound to an imported buffer, run (and captured) before the late write below
        held = torch.zeros(n, device="cuda")
        hb = Buffer.from_dlpack(held)
        plan = ExecutionPlan(gpu, capture=use == "captured plan")
        plan.add(add, hb, hb, out, n=n)
        for _ in range(3):
            plan.run()
        gpu.synchronize()
        assert plan.captured == (use == "captured plan")
        held.fill_(-3.0)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)
            held.copy_(src)
        z = held
    else:
        z = _late_tensor(torch, side, src)
    with torch.cuda.stream(side):
        b = Buffer.from_dlpack(z)
    assert not side.query()                     # the producer's write is still pending
    if use == "kernel":
        add(b, b, out, n=n)
        np.testing.assert_array_equal(out.numpy(), 2 * x)
    elif use == "numpy":
        np.testing.assert_array_equal(b.numpy(), x)
    elif use == "torch on another stream":
        with torch.cuda.stream(other):
            got = (torch.from_dlpack(b) * 1).cpu().numpy()
        np.testing.assert_array_equal(got, x)
    elif use == "copyin":
        y = rng.standard_normal(n).astype(np.float32)
        b.copyin(y)                             # after the producer's write, not before it
        torch.cuda.synchronize()
        np.testing.assert_array_equal(z.cpu().numpy(), y)
    elif use == "synchronize":
        gpu.synchronize()                       # waits for the producer too: its write is done
        assert side.query()
        np.testing.assert_array_equal(b.numpy(), x)
    else:
        plan.run()
        np.testing.assert_array_equal(out.numpy(), 2 * x)
    assert not gpu._pending
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_many_imports_from_one_stream_pend_once_and_a_launch_orders_them(gpu, torch, rng):
    n = 1 << 18
    side = torch.cuda.Stream()
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    gpu.synchronize()
    bufs = []
    # (the sources stay alive: torch's allocator would reuse one freed on the default stream while the
    # side stream's pending copy still reads it)
    srcs = [torch.from_numpy(x).cuda() for x in xs]
    for x, src in zip(xs, srcs):
        z = _late_tensor(torch, side, src)
        with torch.cuda.stream(side):
            bufs.append((z, Buffer.from_dlpack(z)))
    assert list(gpu._pending) == [side.cuda_stream]       # four imports, one producer stream
    add = gpu.compile(K.add(), name="dlpack_lazy_add")
    outs = [gpu.buffer(n, dtypes.float32) for _ in xs]
    for (_, b), o in zip(bufs, outs):
        add(b, b, o, n=n)
    for x, o in zip(xs, outs):
        np.testing.assert_array_equal(o.numpy(), 2 * x)
