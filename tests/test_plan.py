"""ExecutionPlan: prepared launches replayed many times, with variables rebound between runs."""
from __future__ import annotations

import numpy as np
import pytest

from morok_py import ExecutionPlan, LaunchError, dtypes, kernels as K
from morok_py.errors import BufferFreedError


def mlp_plan(device, rng, D, H):
    """h = relu(x @ W + b); s = rowsum(h): two launches sharing buffers, batch bound at run time."""
    cap = 64
    x = rng.standard_normal((cap, D)).astype(np.float32)
    w = rng.standard_normal((D, H)).astype(np.float32)
    b = rng.standard_normal(H).astype(np.float32)
    bx, bw, bb = device.buf(x), device.buf(w), device.buf(b)
    h, s = device.empty(cap * H, dtypes.float32), device.empty(cap, dtypes.float32)
    plan = ExecutionPlan()
    plan.add(device.compile(K.matmul_bias_relu()), bx, bw, bb, h, M="B", N=H, K=D)
    plan.add(device.compile(K.reduce_axis("sum", [None, None], 1)), h, s, d0="B", d1=H)
    return plan, (x, w, b), (h, s)


def reference(x, w, b, B):
    h = np.maximum(x[:B].astype(np.float64) @ w + b, 0)
    return h, h.sum(axis=1)


def test_plan_runs_many_times_and_matches_numpy(device, rng):
    plan, (x, w, b), (h, s) = mlp_plan(device, rng, 33, 19)
    for _ in range(20):
        plan.run(B=17)
    device.dev.synchronize()
    want_h, want_s = reference(x, w, b, 17)
    np.testing.assert_allclose(h.numpy()[:17 * 19].reshape(17, 19), want_h, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(s.numpy()[:17], want_s, rtol=1e-5, atol=1e-3)


def test_plan_rebinds_variables_between_runs(device, rng):
    plan, (x, w, b), (h, s) = mlp_plan(device, rng, 33, 19)
    for B in (1, 64, 7):
        plan.run(B=B, wait=True)
        np.testing.assert_allclose(s.numpy()[:B], reference(x, w, b, B)[1], rtol=1e-5, atol=1e-3)


def test_plan_run_with_wait_returns_seconds(device, rng):
    plan, *_ = mlp_plan(device, rng, 33, 19)
    t = plan.run(B=5, wait=True)
    assert isinstance(t, float) and t > 0


def test_plan_checks_bounds_when_binding(device, rng):
    plan, *_ = mlp_plan(device, rng, 33, 19)
    with pytest.raises(LaunchError, match="may touch indices"):
        plan.run(B=65)      # the buffers hold 64 rows


def test_plan_requires_every_plan_variable(device, rng):
    plan, *_ = mlp_plan(device, rng, 33, 19)
    with pytest.raises(LaunchError, match=r"plan needs values for \['B'\]"):
        plan.run()


def test_plan_rejects_unknown_variables(device, rng):
    plan, *_ = mlp_plan(device, rng, 33, 19)
    with pytest.raises(LaunchError, match="plan has no variable"):
        plan.run(B=3, C=4)


def test_plan_add_checks_buffer_count(device):
    with pytest.raises(LaunchError, match="takes 3 buffer"):
        ExecutionPlan().add(device.compile(K.add()), device.empty(3, dtypes.float32))


def test_plan_capture_keeps_results_right(device, rng):
    plan, (x, w, b), (h, s) = mlp_plan(device, rng, 33, 19)
    plan.capture(B=9)
    plan.run(B=9, wait=True)
    np.testing.assert_allclose(s.numpy()[:9], reference(x, w, b, 9)[1], rtol=1e-5, atol=1e-3)


def test_freeing_a_buffer_of_the_plan_makes_the_next_run_check_again(device, rng):
    plan, _, (h, s) = mlp_plan(device, rng, 33, 19)
    plan.run(B=5)
    plan.run(B=5)
    s.free()
    with pytest.raises(ValueError, match="freed"):
        plan.run(B=5)


def test_a_plan_whose_buffer_was_freed_refuses_to_run_and_names_the_step(device, rng):
    plan, _, (h, s) = mlp_plan(device, rng, 33, 19)
    plan.run(B=5)
    s.free()
    with pytest.raises(BufferFreedError, match=r"plan step 1\b.*buffer 1 .*was freed"):
        plan.run(B=5)
    assert isinstance(BufferFreedError("x"), LaunchError)


def test_a_refused_rebind_leaves_every_step_bound_as_before(device, rng):
    """Step 0 accepts N=1013, step 1 refuses it: the run that follows with the old N=1003 sums 1003."""
    x = rng.standard_normal(1013).astype(np.float32)
    a, s, small = device.buf(x), device.empty(1, dtypes.float32), device.empty(1003, dtypes.float32)
    plan = ExecutionPlan()
    plan.add(device.compile(K.sum_all()), a, s, n="N")
    plan.add(device.compile(K.unary("neg")), a, small, n="N")
    plan.run(N=1003, wait=True)
    np.testing.assert_allclose(s.numpy()[0], x[:1003].astype(np.float64).sum(), rtol=1e-4, atol=1e-3)
    with pytest.raises(LaunchError, match=r"plan step 1\b.*buffer 1 may touch indices \[0, 1012\]"):
        plan.run(N=1013)
    s.copyin(np.full(1, 7.5, np.float32))
    plan.run(N=1003, wait=True)
    np.testing.assert_allclose(s.numpy()[0], x[:1003].astype(np.float64).sum(), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(small.numpy(), -x[:1003])


def test_plan_add_refuses_an_output_that_aliases_an_input(device, rng):
    a = device.buf(rng.standard_normal(37).astype(np.float32))
    prog = device.compile(K.add())
    with pytest.raises(LaunchError, match="do not alias"):
        prog(a, device.empty(37, dtypes.float32), a, n=37)     # the direct call
    for bufs in ((a, a, a), (a, device.empty(37, dtypes.float32), a)):
        with pytest.raises(LaunchError, match=r"plan step 0.*buffer 2 is written and also passed as buffer 0"):
            ExecutionPlan().add(prog, *bufs, n="N")
        with pytest.raises(LaunchError, match="do not alias"):
            ExecutionPlan().add(prog, *bufs, n=37)


def test_plan_add_refuses_a_freed_buffer(device, rng):
    a, b, c = (device.buf(rng.standard_normal(11).astype(np.float32)) for _ in range(3))
    c.free()
    with pytest.raises(BufferFreedError, match=r"plan step 0.*buffer 2 .*was freed"):
        ExecutionPlan().add(device.compile(K.add()), a, b, c, n="N")


def test_plan_add_runs_the_direct_calls_checks_of_fixed_values(device, rng):
    """With int values, add refuses what the direct call refuses: sizes, dtypes, names, ranges."""
    prog = device.compile(K.add())
    a, b = (device.buf(rng.standard_normal(11).astype(np.float32)) for _ in range(2))
    out = device.empty(11, dtypes.float32)
    with pytest.raises(LaunchError, match="may touch indices"):
        ExecutionPlan().add(prog, a, b, out, n=12)
    with pytest.raises(LaunchError, match="holds int32"):
        ExecutionPlan().add(prog, a, b, device.empty(11, dtypes.int32), n=11)
    with pytest.raises(LaunchError, match="unknown variable"):
        ExecutionPlan().add(prog, a, b, out, n=11, m=3)
    with pytest.raises(LaunchError, match="unknown variable"):
        ExecutionPlan().add(prog, a, b, out, n="N", m="M")
    with pytest.raises(LaunchError, match="outside its range"):
        ExecutionPlan().add(prog, a, b, out, n=0)
    with pytest.raises(LaunchError, match="must be an int"):
        ExecutionPlan().add(prog, a, b, out, n=1.5)
    plan = ExecutionPlan().add(prog, a, b, out, n=11)
    plan.run(wait=True)
    np.testing.assert_allclose(out.numpy(), a.numpy() + b.numpy())


def test_a_plan_captures_itself_on_the_second_run_of_a_value_set(device, rng):
    plan, (x, w, b), (h, s) = mlp_plan(device, rng, 33, 19)
    can = getattr(device.dev, "capture_plan", None) is not None
    for B, runs in ((9, 3), (4, 2), (9, 1)):
        for i in range(runs):
            s.copyin(np.zeros(64, np.float32))
            plan.run(B=B, wait=True)
            # a value set is replayed launch by launch the first time, captured from its second run
            assert plan.captured == (can and (i >= 1 or B == 9 and runs == 1))
            np.testing.assert_allclose(s.numpy()[:B], reference(x, w, b, B)[1], rtol=1e-5, atol=1e-3)
            assert not s.numpy()[B:].any()


def test_a_plan_made_with_capture_false_never_captures(device, rng):
    plan, *_ = mlp_plan(device, rng, 33, 19)
    plan.auto_capture = False
    for _ in range(3):
        plan.run(B=3)
    assert not plan.captured
