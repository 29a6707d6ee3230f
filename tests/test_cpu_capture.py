"""A CPU ExecutionPlan captured (backends/cpu/runtime.CPUPlanCapture): once no launch of it still times its
split, its replays are one native call over argument blocks built once (split launches on the native workers,
the others on the calling thread), also with other memory bound to its slots (run(bind=...))."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from morok_py import ExecutionPlan, dtypes, kernels as K
from morok_py.backends.cpu import runtime as cpu_runtime

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the native pool is Linux-only")


@pytest.fixture
def split_everything(monkeypatch):
    """Every launch over more than one item splits (no trials), on the native pool of 3 threads."""
    for name in ("NATIVE_MIN_WORK", "NATIVE_SURE_WORK"):
        monkeypatch.setattr(cpu_runtime, name, 1)
    monkeypatch.setenv("MOROK_CPU_POOL", "native")
    monkeypatch.setenv("MOROK_CPU_THREADS", "3")


def _model(cpu, rng, M: int, Kd: int, N: int):
    """h = relu(x @ w + b) (a register tile with packed panels: hidden scratch per chunk), then y = h + h (an
    elementwise kernel), then s = sum(y) (one item: the calling thread). Sizes as plan-level names."""
    x, w, b = (rng.standard_normal(shape).astype(np.float32) for shape in ((M, Kd), (Kd, N), (N,)))
    bx, bw, bb = cpu.buf(x), cpu.buf(w), cpu.buf(b)
    h = cpu.buf(np.full(M * N, np.nan, np.float32))
    y = cpu.buf(np.full(M * N, np.nan, np.float32))
    s = cpu.buf(np.full(1, np.nan, np.float32))
    plan = ExecutionPlan()
    plan.add(cpu.compile(K.matmul_bias_relu(), name="cap_dense"), bx, bw, bb, h, M="M", N=N, K=Kd)
    plan.add(cpu.compile(K.add(), name="cap_add"), h, h, y, n="MN")
    plan.add(cpu.compile(K.sum_all(), name="cap_sum"), y, s, n="MN")
    return plan, (x, w, b), (bx, h, y, s)


def _captured(cpu, rng, M: int, Kd: int, N: int):
    """`_model` run until captured (three runs of one value set); returns it and its capture."""
    plan, ins, bufs = _model(cpu, rng, M, Kd, N)
    for _ in range(3):
        plan.run(M=M, MN=M * N)
    assert isinstance(plan._native, cpu_runtime.CPUPlanCapture)
    return plan, ins, bufs, plan._native


def _trial_add(cpu, rng, monkeypatch, n: int, name: str):
    """A plan of one add whose launches sit between the split thresholds (each times itself alone and split
    before it keeps one), on 2 native threads: (plan, program, out, a + b)."""
    monkeypatch.setattr(cpu_runtime, "NATIVE_MIN_WORK", 1)
    monkeypatch.setattr(cpu_runtime, "NATIVE_SURE_WORK", 1 << 60)
    monkeypatch.setenv("MOROK_CPU_POOL", "native")
    monkeypatch.setenv("MOROK_CPU_THREADS", "2")
    a, b = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    out = cpu.empty(n, dtypes.float32)
    prog = cpu.compile(K.add(), name=name)
    return ExecutionPlan().add(prog, cpu.buf(a), cpu.buf(b), out, n=n), prog, out, a + b


def _want(x, w, b, M):
    h = np.maximum(x[:M].astype(np.float64) @ w + b, 0)
    return h, 2 * h, (2 * h).sum()


def test_a_captured_plan_replays_every_launch_like_the_launches(cpu, rng, split_everything):
    M, Kd, N = 203, 130, 37
    plan, (x, w, b), (bx, h, y, s) = _model(cpu, rng, M, Kd, N)
    for round_, m in enumerate((203, 77, 203)):
        for run in range(3):
            for buf in (h, y):
                buf.copyin(np.full(M * N, np.nan, np.float32))
            plan.run(M=m, MN=m * N, wait=True)
            # captured from the second run of a value set (every launch splits here: no trial to wait for); a
            # value set seen before takes its capture at once
            assert plan.captured == (run >= 1 or round_ == 2)
            wh, wy, ws = _want(x, w, b, m)
            np.testing.assert_allclose(h.numpy()[:m * N].reshape(m, N), wh, rtol=1e-4, atol=1e-3)
            np.testing.assert_allclose(y.numpy()[:m * N].reshape(m, N), wy, rtol=1e-4, atol=1e-3)
            assert np.isnan(h.numpy()[m * N:]).all()     # nothing past the bound sizes written
            np.testing.assert_allclose(s.numpy()[0], ws, rtol=1e-4)
    cap = plan._native
    assert isinstance(cap, cpu_runtime.CPUPlanCapture)
    # the dense step split over 3 threads' chunks, its block's table naming the program's own scratch set for
    # each of those threads (the chunks a thread claims run on its set)
    dense = plan.steps[0].program
    chunks = min(3 * cpu_runtime.CHUNKS_PER_THREAD, plan.steps[0].gs[0])
    threads = min(3, chunks)
    words = list(cap._blocks[0])
    assert dense._nhidden and cap._rows[0][0] == chunks and len(dense._hidden_sets) >= threads
    table = words[words[1]:]
    assert table == [ptr for t in range(threads) for ptr in dense._hidden_sets[t]]
    assert cap._locks == [dense._hidden_lock]
    assert cap._rows[2][0] == 1          # one item: one chunk on the calling thread


def test_debug_prints_what_a_capture_replays(cpu, rng, split_everything, monkeypatch, capsys):
    monkeypatch.setenv("MOROK_DEBUG", "1")
    plan, *_ = _captured(cpu, rng, 40, 30, 20)
    err = capsys.readouterr().err
    split = sum(1 for st in plan.steps if st.gs[0] > 1)      # every launch over more than one item splits here
    assert split >= 1
    assert f"plan on CPU: captured 3 launches into one native call: {split} split over up to 3 threads, " \
           f"{3 - split} on the calling thread" in err, err


def test_a_captured_plan_takes_bound_memory_and_keeps_its_own(cpu, rng, split_everything):
    M, Kd, N = 61, 70, 29
    plan, (x, w, b), (bx, h, y, s), _cap = _captured(cpu, rng, M, Kd, N)
    own = y.numpy().copy()
    blocks = [bytes(blk) for blk in plan._native._blocks]
    for _ in range(3):
        x2 = rng.standard_normal((M, Kd)).astype(np.float32)
        out = np.full(M * N, np.nan, np.float32)
        plan.run(bind={bx: x2, y: out}, M=M, MN=M * N, wait=True)
        np.testing.assert_allclose(out.reshape(M, N), _want(x2, w, b, M)[1], rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(s.numpy()[0], _want(x2, w, b, M)[2], rtol=1e-4)
    # the plan's own output untouched, the capture's blocks as captured, a plain run on its own buffers again
    np.testing.assert_array_equal(y.numpy(), own)
    assert [bytes(blk) for blk in plan._native._blocks] == blocks
    plan.run(M=M, MN=M * N, wait=True)
    np.testing.assert_allclose(y.numpy()[:M * N].reshape(M, N), _want(x, w, b, M)[1], rtol=1e-4, atol=1e-3)


def test_patches_come_back_when_a_captured_replay_raises(cpu, rng, split_everything, monkeypatch):
    M, Kd, N = 20, 40, 16
    plan, (x, w, b), (bx, h, y, s), cap = _captured(cpu, rng, M, Kd, N)
    blocks = [bytes(blk) for blk in cap._blocks]

    def boom(*a):
        raise RuntimeError("replay failed")
    monkeypatch.setattr(cap._native, "run_plan", boom)
    with pytest.raises(RuntimeError, match="replay failed"):
        plan.run(bind={y: np.empty(M * N, np.float32)}, M=M, MN=M * N)
    assert [bytes(blk) for blk in cap._blocks] == blocks


def test_a_settings_change_rebuilds_the_capture(cpu, rng, split_everything, monkeypatch):
    M, Kd, N = 97, 50, 33
    plan, (x, w, b), (bx, h, y, s), cap = _captured(cpu, rng, M, Kd, N)
    prog = plan.steps[1].program
    assert cap._rows[1][0] == min(prog._chunks(3), plan.steps[1].gs[0])
    monkeypatch.setenv("MOROK_CPU_THREADS", "2")
    y.copyin(np.full(M * N, np.nan, np.float32))
    plan.run(M=M, MN=M * N, wait=True)
    assert plan._native is cap and cap._rows[1][0] == min(prog._chunks(2), plan.steps[1].gs[0])
    np.testing.assert_allclose(y.numpy()[:M * N].reshape(M, N), _want(x, w, b, M)[1], rtol=1e-4, atol=1e-3)


def test_no_capture_while_a_launch_times_its_split(cpu, rng, monkeypatch):
    """Between the thresholds a launch times itself alone and split (TRIAL_ORDER) before it keeps one: the
    plan is captured only after that, with the choice made."""
    n = 40_003
    plan, prog, out, want = _trial_add(cpu, rng, monkeypatch, n, "cap_trial_add")
    trials = 2 * cpu_runtime.SPLIT_TRIALS
    for run in range(trials + ExecutionPlan.CAPTURE_AFTER + 1):
        plan.run(wait=True)
        decided = prog._plan_for([n])[0] is not cpu_runtime._TRIAL
        if not decided:
            assert not plan.captured
    assert decided and plan.captured
    out.copyin(np.full(n, np.nan, np.float32))
    plan.run(wait=True)
    np.testing.assert_array_equal(out.numpy(), want)


def test_the_python_pool_replays_launch_by_launch(cpu, rng, monkeypatch):
    monkeypatch.setenv("MOROK_CPU_POOL", "python")
    M, Kd, N = 33, 20, 17
    plan, (x, w, b), (bx, h, y, s) = _model(cpu, rng, M, Kd, N)
    for _ in range(3):
        plan.run(M=M, MN=M * N, wait=True)
    assert not plan.captured
    np.testing.assert_allclose(y.numpy()[:M * N].reshape(M, N), _want(x, w, b, M)[1], rtol=1e-4, atol=1e-3)


def test_a_capture_expires_and_its_trials_run_again(cpu, rng, monkeypatch):
    """After RECAPTURE_AFTER replays the plan drops its capture, replays launch by launch while the launches whose
    split a trial chose time themselves again, then captures itself anew; every run's output is right."""
    monkeypatch.setattr(cpu_runtime, "RECAPTURE_AFTER", 3)
    n = 30_011
    plan, prog, out, want = _trial_add(cpu, rng, monkeypatch, n, "cap_expire_add")
    seen, captures = [], []
    for _ in range(40):
        out.copyin(np.full(n, np.nan, np.float32))
        plan.run(wait=True)
        np.testing.assert_array_equal(out.numpy(), want)
        mode = prog._plan_for([n])[0]
        seen.append((plan.captured, mode is cpu_runtime._TRIAL))
        if plan.captured and (not captures or captures[-1] is not plan._native):
            captures.append(plan._native)
    assert len(captures) >= 2                      # captured, expired, captured again
    assert not any(c and trial for c, trial in seen)     # never captured while a trial runs
    first = next(i for i, (c, _) in enumerate(seen) if c)
    assert any(trial for _, trial in seen[first:])      # a trial ran again after the first capture


def test_direct_launches_of_a_captured_program_on_another_thread_stay_right(cpu, rng, split_everything):
    """The captured dense step names its program's scratch: a replay holds that program's lock, so the same
    program launched directly on another thread (other buffers, other sizes, on that thread alone with chunk 0's
    scratch) waits for it; both results right."""
    import threading
    M, Kd, N = 150, 96, 40
    plan, (x, w, b), (bx, h, y, s), cap = _captured(cpu, rng, M, Kd, N)
    dense = plan.steps[0].program
    m2 = 77
    x2, w2, b2 = (rng.standard_normal(shape).astype(np.float32) for shape in ((m2, Kd), (Kd, N), (N,)))
    want2 = np.maximum(x2.astype(np.float64) @ w2 + b2, 0)
    args2 = [cpu.buf(x2), cpu.buf(w2), cpu.buf(b2)]
    # the direct launches run on their own thread alone (chunk 0's scratch, which the replays' first chunk names)
    before = set(dense._plans)
    dense(*args2, cpu.buf(np.empty(m2 * N, np.float32)), M=m2, N=N, K=Kd)
    fresh = set(dense._plans) - before
    assert fresh
    for key in fresh:
        dense._plans[key][0], dense._plans[key][3] = cpu_runtime._ONE, []
    errors = []

    def direct():
        try:
            for _ in range(30):
                out2 = cpu.buf(np.full(m2 * N, np.nan, np.float32))
                dense(*args2, out2, M=m2, N=N, K=Kd)
                np.testing.assert_allclose(out2.numpy().reshape(m2, N), want2, rtol=1e-4, atol=1e-3)
        except Exception as e:      # noqa: BLE001 -- reported below
            errors.append(e)
    t = threading.Thread(target=direct)
    t.start()
    for _ in range(30):
        y.copyin(np.full(M * N, np.nan, np.float32))
        plan.run(M=M, MN=M * N, wait=True)
        np.testing.assert_allclose(y.numpy()[:M * N].reshape(M, N), _want(x, w, b, M)[1], rtol=1e-4, atol=1e-3)
    t.join()
    assert not errors, errors[0]
    assert plan._native is cap
