"""ExecutionPlan.slot and run(bind=...): on a device whose buffers are host memory (the CPU), a run stands a
numpy array's memory in for a plan buffer, checked, and leaves the plan's own buffers in place after."""
from __future__ import annotations

import numpy as np
import pytest

from morok_py import Buffer, ExecutionPlan, LaunchError, dtypes, kernels as K
from morok_py.plan import BufferSlot


def aligned(n: int, dtype=np.float32, misalign: int = 0, align: int = 64) -> np.ndarray:
    """n elements starting `misalign` bytes past an `align`-byte boundary."""
    item = np.dtype(dtype).itemsize
    raw = np.empty(n * item + align + misalign, np.uint8)
    off = (-raw.ctypes.data % align) + misalign
    return raw[off:off + n * item].view(dtype)


def chain(cpu, rng, n: int):
    """y = x + w; z = -y: the input x, the weight w, the output z and an intermediate y."""
    x, w = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    bx, bw = cpu.buf(x), cpu.buf(w)
    y, z = cpu.empty(n, dtypes.float32), cpu.empty(n, dtypes.float32)
    plan = ExecutionPlan()
    plan.add(cpu.compile(K.add()), bx, bw, y, n=n)
    plan.add(cpu.compile(K.unary("neg")), y, z, n=n)
    return plan, (bx, bw, y, z), (x, w)


def test_a_bound_run_reads_and_writes_the_arrays_bitwise_like_the_plan(cpu, rng):
    n = 1037
    plan, (bx, bw, y, z), (x, w) = chain(cpu, rng, n)
    plan.run(wait=True)
    want = z.numpy()
    x2 = rng.standard_normal(n).astype(np.float32)
    out = np.full(n, np.nan, np.float32)
    plan.run(bind={plan.slot(bx): x2, plan.slot(z): out}, wait=True)
    np.testing.assert_array_equal(out, -(x2 + w))
    # the plan's own buffers were left alone, and the next plain run uses them again
    np.testing.assert_array_equal(z.numpy(), want)
    bx.copyin(x2)
    plan.run(wait=True)
    np.testing.assert_array_equal(z.numpy(), out)


def test_a_buffer_key_finds_its_slot(cpu, rng):
    n = 333
    plan, (bx, bw, y, z), (x, w) = chain(cpu, rng, n)
    out = np.empty(n, np.float32)
    plan.run(bind={z: out})
    np.testing.assert_array_equal(out, -(x + w))
    assert plan.slot(z) is plan.slot(z)


def test_a_slot_knows_whether_the_plan_writes_it(cpu, rng):
    plan, (bx, bw, y, z), _ = chain(cpu, rng, 97)
    assert not plan.slot(bx).written and not plan.slot(bw).written
    assert plan.slot(y).written and plan.slot(z).written
    assert plan.slot(y).places == ((0, 2, 0), (1, 0, 0))


def test_an_intermediate_bound_to_caller_memory(cpu, rng):
    n = 211
    plan, (bx, bw, y, z), (x, w) = chain(cpu, rng, n)
    scratch = np.empty(n, np.float32)
    plan.run(bind={y: scratch}, wait=True)
    np.testing.assert_array_equal(scratch, x + w)
    np.testing.assert_array_equal(z.numpy(), -(x + w))


def test_a_root_carries_the_views_inside_it(cpu, rng):
    """Two views of one buffer written by two launches: binding the root moves both, at their offsets."""
    n = 37            # 148 bytes: the second view starts at byte 160
    a, b = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    ba, bb = cpu.buf(a), cpu.buf(b)
    root = cpu.empty(80, dtypes.float32)
    lo, hi = root.view(0, n), root.view(160, n)
    plan = ExecutionPlan()
    plan.add(cpu.compile(K.add()), ba, bb, lo, n=n)
    plan.add(cpu.compile(K.unary("neg")), ba, hi, n=n)
    slot = plan.slot(root)
    assert sorted(p[2] for p in slot.places) == [0, 160] and slot.written
    out = np.full(80, 7.0, np.float32)
    plan.run(bind={slot: out}, wait=True)
    np.testing.assert_array_equal(out[:n], a + b)
    np.testing.assert_array_equal(out[40:40 + n], -a)
    np.testing.assert_array_equal(out[n:40], 7.0)
    # a view alone cannot move while a launch passes the root it lies in
    plan.add(cpu.compile(K.unary("neg")), root, cpu.empty(80, dtypes.float32), n=80)
    with pytest.raises(LaunchError, match="overlaps .* in part"):
        plan.slot(lo)


def test_an_unaligned_output_takes_the_plain_variant(cpu, rng, monkeypatch):
    """The streaming variant is taken only for 64-byte aligned outputs: one 16 bytes past that is
    still written right (any output counts as large here)."""
    from morok_py.backends.cpu import runtime
    monkeypatch.setattr(runtime, "STREAM_MIN_BYTES", 0)
    n = 4099
    a, b = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    plan = ExecutionPlan()
    ba, bb, out = cpu.buf(a), cpu.buf(b), cpu.empty(n, dtypes.float32)
    plan.add(cpu.compile(K.add()), ba, bb, out, n=n)
    for misalign in (16, 0, 48):
        got = aligned(n, misalign=misalign)
        got[:] = np.nan
        plan.run(bind={out: got}, wait=True)
        np.testing.assert_array_equal(got, a + b)
    prog = plan.steps[0].program
    if prog._stream_fn is not None:      # the runtime's choice for this launch: its streaming variant
        assert prog._plan(list(plan.steps[0].ordered))[1]     # derived afresh (the program may be shared)


def test_bad_binds_are_refused_with_the_reason(cpu, rng):
    n = 101
    plan, (bx, bw, y, z), (x, w) = chain(cpu, rng, n)
    with pytest.raises(LaunchError, match=r"\(404 bytes\) bound to 400 bytes"):
        plan.run(bind={z: np.empty(n - 1, np.float32)})
    with pytest.raises(LaunchError, match="not passed to any step"):
        plan.slot(cpu.empty(n, dtypes.float32))
    with pytest.raises(LaunchError, match="C-contiguous"):
        plan.run(bind={z: np.empty(2 * n, np.float32)[::2]})
    with pytest.raises(LaunchError, match="not 16-byte aligned"):
        plan.run(bind={z: aligned(n, misalign=4)})
    ro = np.empty(n, np.float32)
    ro.flags.writeable = False
    with pytest.raises(LaunchError, match="read-only"):
        plan.run(bind={z: ro})
    plan.run(bind={bx: ro})          # a read-only array stands in for a buffer the plan only reads
    with pytest.raises(LaunchError, match="numpy array, a Buffer or a"):
        plan.run(bind={z: z.ptr})
    shared = np.empty(n, np.float32)
    with pytest.raises(LaunchError, match="overlapping memory"):
        plan.run(bind={bx: shared, z: shared})
    root = cpu.empty(64, dtypes.float32)
    p2 = ExecutionPlan().add(cpu.compile(K.add()), bx, bw, root.view(0, 16), n=16)
    with pytest.raises(LaunchError, match="share memory in the plan"):
        p2.run(bind={root: np.empty(64, np.float32), root.view(0, 16): np.empty(16, np.float32)})


def test_a_refused_bind_changes_no_pointer(cpu, rng):
    """The second binding is refused: the first was not applied, and the plan runs on its buffers."""
    n = 55
    plan, (bx, bw, y, z), (x, w) = chain(cpu, rng, n)
    plan.run()
    before = [list(st.ptrs) for st in plan.steps]
    out = np.full(n, 3.0, np.float32)
    with pytest.raises(LaunchError, match="bound to"):
        plan.run(bind={y: out, z: np.empty(3, np.float32)})
    assert [st.ptrs for st in plan.steps] == before
    np.testing.assert_array_equal(out, 3.0)
    plan.run(wait=True)
    np.testing.assert_array_equal(z.numpy(), -(x + w))


def test_pointers_come_back_when_a_bound_run_raises(cpu, rng, monkeypatch):
    n = 55
    plan, (bx, bw, y, z), (x, w) = chain(cpu, rng, n)
    plan.auto_capture = False       # the launch by launch replay (a captured one: tests/test_cpu_capture.py)
    plan.run()
    before = [list(st.ptrs) for st in plan.steps]
    prog = plan.steps[1].program

    def boom(*a, **k):
        raise RuntimeError("launch failed")
    monkeypatch.setattr(prog, "execute", boom)
    with pytest.raises(RuntimeError, match="launch failed"):
        plan.run(bind={z: np.empty(n, np.float32)})
    assert [st.ptrs for st in plan.steps] == before


def test_a_slot_found_before_a_step_was_added_is_stale(cpu, rng):
    n = 64
    plan, (bx, bw, y, z), _ = chain(cpu, rng, n)
    slot = plan.slot(z)
    plan.add(cpu.compile(K.unary("neg")), z, cpu.empty(n, dtypes.float32), n=n)
    with pytest.raises(LaunchError, match="before a step was added"):
        plan.run(bind={slot: np.empty(n, np.float32)})
    other, (_, _, _, z2), _ = chain(cpu, rng, n)
    with pytest.raises(LaunchError, match="another plan"):
        plan.run(bind={other.slot(z2): np.empty(n, np.float32)})


def test_bound_runs_rebind_variables_too(cpu, rng):
    """A plan-level size with memory bound: each run's values are checked against the plan's buffers."""
    cap = 300
    a = rng.standard_normal(cap).astype(np.float32)
    ba, out = cpu.buf(a), cpu.empty(cap, dtypes.float32)
    plan = ExecutionPlan().add(cpu.compile(K.unary("neg")), ba, out, n="N")
    for N in (7, 299, 1):
        got = np.full(cap, 5.0, np.float32)
        plan.run(N=N, bind={out: got})
        np.testing.assert_array_equal(got[:N], -a[:N])
        np.testing.assert_array_equal(got[N:], 5.0)
    with pytest.raises(LaunchError, match="may touch indices"):
        plan.run(N=301, bind={out: np.empty(cap, np.float32)})


def test_a_buffer_binds_another_buffer(cpu, rng):
    n = 91
    plan, (bx, bw, y, z), (x, w) = chain(cpu, rng, n)
    dst = cpu.empty(n, dtypes.float32)
    plan.run(bind={z: dst}, wait=True)
    np.testing.assert_array_equal(dst.numpy(), -(x + w))


def test_run_arguments_are_not_plan_level_names(cpu):
    for name in ("bind", "wait"):
        with pytest.raises(LaunchError, match="argument of run"):
            ExecutionPlan().add(cpu.compile(K.unary("neg")), cpu.empty(4, dtypes.float32),
                                cpu.empty(4, dtypes.float32), n=name)


def test_a_device_without_host_memory_refuses_slots(cpu, rng, monkeypatch):
    plan, (bx, bw, y, z), _ = chain(cpu, rng, 17)
    assert plan.host_memory
    monkeypatch.setattr(type(cpu.dev.allocator), "host_memory", False)
    assert not plan.host_memory
    with pytest.raises(LaunchError, match="not host memory"):
        plan.slot(z)
    with pytest.raises(LaunchError, match="not host memory"):
        ExecutionPlan().slot(z)
    assert isinstance(BufferSlot, type) and Buffer.VIEW_ALIGN == 16
