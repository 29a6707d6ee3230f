"""Memory plans (morok_py.memplan): the planner on random step graphs, Buffer.view, and the ONNX
executor running its intermediates on one arena, bitwise as without the plan and as numpy."""
from __future__ import annotations

import numpy as np
import pytest

from morok_py import ArgumentError, Buffer, dtypes
from morok_py.memplan import GREEDY_BY_SIZE, MemoryPlan, Step, plan_memory


# ---- the planner --------------------------------------------------------------------------------------

def live_overlaps(plan: MemoryPlan, steps: list[Step]) -> list[tuple]:
    """Pairs of planned buffers live at one step whose byte ranges meet, found step by step (apart from
    MemoryPlan.check's sweep), in-place pairs left out."""
    aliased = {frozenset(p) for p in plan.aliases}
    bad = []
    for i in range(len(steps)):
        live = [k for k, (a, b) in plan.lifetimes.items() if a <= i <= b]
        for x in range(len(live)):
            for y in range(x + 1, len(live)):
                p, q = live[x], live[y]
                if frozenset((p, q)) in aliased:
                    continue
                p0, q0 = plan.offsets[p], plan.offsets[q]
                if p0 < q0 + max(plan.sizes[q], 1) and q0 < p0 + max(plan.sizes[p], 1):
                    bad.append((i, p, q))
    return bad


def random_steps(rng: np.random.Generator, n_steps: int, inplace: bool = False):
    """A random DAG of steps: each reads 1-3 earlier values (or a graph input) and writes 1-2 new ones."""
    steps, values, sizes = [], [], {}
    for i in range(3):
        sizes[f"in{i}"] = int(rng.integers(1, 5000))
        values.append(f"in{i}")
    for s in range(n_steps):
        reads = tuple(dict.fromkeys(values[int(j)] for j in rng.integers(max(0, len(values) - 6), len(values),
                                                                       int(rng.integers(1, 4)))))
        writes = tuple(f"v{s}_{j}" for j in range(int(rng.integers(1, 3))))
        for w in writes:
            sizes[w] = int(rng.integers(1, 100_000))
        pairs = ((writes[0], reads[0]),) if inplace and rng.random() < 0.5 else ()
        steps.append(Step(reads, writes, pairs))
        values.extend(writes)
    return steps, sizes, values


@pytest.mark.parametrize("seed", range(25))
def test_random_graphs_no_live_overlap(seed):
    rng = np.random.default_rng(seed)
    steps, sizes, values = random_steps(rng, int(rng.integers(1, 60)), inplace=seed % 2 == 1)
    pinned = {v for v in values if v.startswith("in")} | {values[-1]} | \
        {v for v in values if rng.random() < 0.1}
    align = int(rng.choice([16, 64, 256]))
    plan = plan_memory(steps, sizes, pinned=pinned, align=align)
    plan.check()
    assert live_overlaps(plan, steps) == []
    assert plan.arena_bytes <= plan.naive_bytes
    assert plan.arena_bytes >= plan.live_peak_bytes
    assert not (set(plan.offsets) & pinned), "a pinned buffer got an arena offset"
    assert all(off % align == 0 for off in plan.offsets.values())
    assert set(plan.offsets) == {v for v in values if v not in pinned and any(v in s.writes for s in steps)}


def test_chain_needs_two_buffers():
    """a -> b -> c -> d, every size 1000: two buffers alternate, and no step writes over its own input."""
    steps = [Step(("x",), ("a",)), Step(("a",), ("b",)), Step(("b",), ("c",)), Step(("c",), ("d",)),
             Step(("d",), ("y",))]
    sizes = dict.fromkeys("xabcdy", 1000)
    plan = plan_memory(steps, sizes, pinned={"x", "y"})
    plan.check()
    assert plan.arena_bytes == 1024 + 1000 and plan.naive_bytes == 4 * 1024
    assert plan.offsets["a"] == plan.offsets["c"] != plan.offsets["b"] == plan.offsets["d"]


def test_inplace_pair_shares_the_offset_only_when_asked():
    steps = [Step(("x",), ("a",)), Step(("a",), ("b",), inplace=(("b", "a"),)), Step(("b",), ("y",))]
    sizes = {"x": 64, "a": 4000, "b": 4000, "y": 64}
    plan = plan_memory(steps, sizes, pinned={"x", "y"})
    plan.check()
    assert plan.offsets["a"] == plan.offsets["b"] and plan.aliases == (("b", "a"),)
    assert plan.arena_bytes == 4000
    plain = plan_memory([Step(s.reads, s.writes) for s in steps], sizes, pinned={"x", "y"})
    assert plain.offsets["a"] != plain.offsets["b"] and not plain.aliases


def test_inplace_refused_while_the_input_lives_on():
    """`a` is read again after step 1, so `b` cannot be written over it."""
    steps = [Step(("x",), ("a",)), Step(("a",), ("b",), inplace=(("b", "a"),)), Step(("a", "b"), ("y",))]
    plan = plan_memory(steps, {"x": 8, "a": 512, "b": 512, "y": 8}, pinned={"x", "y"})
    plan.check()
    assert not plan.aliases and plan.offsets["a"] != plan.offsets["b"]


def test_read_before_written_is_pinned():
    steps = [Step(("w", "x"), ("a",)), Step(("a",), ("y",))]
    plan = plan_memory(steps, {"w": 300, "x": 10, "a": 77, "y": 5}, pinned={"y"})
    assert plan.auto_pinned == {"w", "x"} and set(plan.offsets) == {"a"}


def test_check_catches_an_overlap():
    steps = [Step(("x",), ("a", "b")), Step(("a", "b"), ("y",))]
    plan = plan_memory(steps, {"x": 8, "a": 100, "b": 100, "y": 8}, pinned={"x", "y"})
    plan.check()
    plan.offsets["b"] = plan.offsets["a"] + 64
    with pytest.raises(AssertionError, match="live together"):
        plan.check()


def test_describe_names_the_strategy_and_the_sizes():
    steps = [Step(("x",), ("a",)), Step(("a",), ("b",)), Step(("b",), ("y",))]
    plan = plan_memory(steps, {"x": 4, "a": 3 << 20, "b": 5 << 20, "y": 4}, pinned={"x", "y"},
                       names={"a": "conv1", "b": "relu1"})
    text = str(plan)
    assert GREEDY_BY_SIZE.name in text and "conv1" in text and "relu1" in text and "8.00 MB" in text
    assert GREEDY_BY_SIZE.name in str(GREEDY_BY_SIZE)


def test_unknown_buffer_size_is_an_error():
    with pytest.raises(KeyError):
        plan_memory([Step(("x",), ("a",))], {"x": 4})


# ---- Buffer.view ----------------------------------------------------------------------------------------

def test_view_reads_and_writes_the_parent():
    rng = np.random.default_rng(3)
    data = rng.standard_normal(101).astype(np.float32)
    parent = Buffer.from_numpy(data, "CPU")
    v = parent.view(16, 37)
    np.testing.assert_array_equal(v.numpy(), data[4:41])
    new = rng.standard_normal(37).astype(np.float32)
    v.copyin(new)
    np.testing.assert_array_equal(parent.numpy()[4:41], new)
    i = parent.view(64, 5, dtypes.int32)
    assert i.dtype == dtypes.int32 and i.numpy().tobytes() == parent.numpy()[16:21].tobytes()


def test_view_bounds_and_alignment():
    parent = Buffer.from_numpy(np.arange(33, dtype=np.float32), "CPU")
    with pytest.raises(ArgumentError, match="ends past"):
        parent.view(128, 2)
    with pytest.raises(ArgumentError, match="multiple"):
        parent.view(4, 2)
    parent.view(128, 1)


def test_view_overlap_is_same_memory():
    parent = Buffer(__import__("morok_py.registry", fromlist=["get_device"]).get_device("CPU"), 64, dtypes.float32)
    a, b, c = parent.view(0, 20), parent.view(64, 4), parent.view(80, 4)
    assert a.same_memory(b) and b.same_memory(a)
    assert not b.same_memory(c) and not a.same_memory(c)
    assert a.same_memory(parent)


def test_view_keeps_the_parent_alive():
    import gc
    parent = Buffer.from_numpy(np.arange(7, 23, dtype=np.float32), "CPU")
    v = parent.view(32, 4)
    del parent
    gc.collect()
    np.testing.assert_array_equal(v.numpy(), np.arange(15, 19, dtype=np.float32))
    v.free()


# ---- the ONNX executor on an arena ---------------------------------------------------------------------

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed (pip install -e '.[onnx]')")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, F, s) for n, s in outputs],
                          [numpy_helper.from_array(a, n) for n, a in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def residual_block(rng, n=7, d=13, h=29):
    """x -> MatMul W1 + b1 -> Relu -> MatMul W2 + b2 -> + x -> Relu, twice (two blocks)."""
    inits, nodes, ref = {}, [], []
    x = "x"
    for blk in range(2):
        w1 = rng.standard_normal((d, h)).astype(np.float32) / 4
        b1 = rng.standard_normal(h).astype(np.float32)
        w2 = rng.standard_normal((h, d)).astype(np.float32) / 4
        b2 = rng.standard_normal(d).astype(np.float32)
        p = f"b{blk}_"
        inits.update({p + "w1": w1, p + "b1": b1, p + "w2": w2, p + "b2": b2})
        nodes += [helper.make_node("MatMul", [x, p + "w1"], [p + "m1"]), helper.make_node("Add", [p + "m1", p + "b1"], [p + "a1"]),
                  helper.make_node("Relu", [p + "a1"], [p + "r1"]), helper.make_node("MatMul", [p + "r1", p + "w2"], [p + "m2"]),
                  helper.make_node("Add", [p + "m2", p + "b2"], [p + "a2"]), helper.make_node("Add", [p + "a2", x], [p + "s"]),
                  helper.make_node("Relu", [p + "s"], [p + "out"])]
        ref.append((w1, b1, w2, b2))
        x = p + "out"

    def numpy_ref(feeds):
        v = feeds["x"].astype(np.float64)
        for w1, b1, w2, b2 in ref:
            v = np.maximum(np.maximum(v @ w1 + b1, 0) @ w2 + b2 + v, 0)
        return [v]
    return _model(nodes, [("x", [n, d])], [(x, [n, d])], inits), {"x": (n, d)}, numpy_ref


def branchy_concat(rng, n=5, c=11):
    """Two branches of x (Sigmoid; Tanh of 2x) and a third (Exp of -|x|) concatenated on axis 1, times a weight."""
    w = rng.standard_normal((1, 3 * c)).astype(np.float32)
    two = np.array([2.0], np.float32)
    nodes = [helper.make_node("Sigmoid", ["x"], ["a"]), helper.make_node("Mul", ["x", "two"], ["x2"]),
             helper.make_node("Tanh", ["x2"], ["b"]), helper.make_node("Abs", ["x"], ["ax"]),
             helper.make_node("Neg", ["ax"], ["nax"]), helper.make_node("Exp", ["nax"], ["e"]),
             helper.make_node("Concat", ["a", "b", "e"], ["cat"], axis=1), helper.make_node("Mul", ["cat", "w"], ["y"])]

    def numpy_ref(feeds):
        x = feeds["x"].astype(np.float64)
        return [np.concatenate([1 / (1 + np.exp(-x)), np.tanh(2 * x), np.exp(-np.abs(x))], axis=1) * w]
    return _model(nodes, [("x", [n, c])], [("y", [n, 3 * c])], {"w": w, "two": two}), {"x": (n, c)}, numpy_ref


def output_used_inside(rng, n=9, d=17):
    """h = Relu(x W) is an output and is read by the rest: t = Tanh(h W2), y = Sigmoid(t W3) * h + h."""
    w, w2, w3 = (rng.standard_normal((d, d)).astype(np.float32) / 3 for _ in range(3))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["h"]),
             helper.make_node("MatMul", ["h", "w2"], ["m2"]), helper.make_node("Tanh", ["m2"], ["t"]),
             helper.make_node("MatMul", ["t", "w3"], ["m3"]), helper.make_node("Sigmoid", ["m3"], ["s"]),
             helper.make_node("Mul", ["s", "h"], ["sh"]), helper.make_node("Add", ["sh", "h"], ["y"])]

    def numpy_ref(feeds):
        h = np.maximum(feeds["x"].astype(np.float64) @ w, 0)
        s = 1 / (1 + np.exp(-(np.tanh(h @ w2) @ w3)))
        return [h, s * h + h]
    return _model(nodes, [("x", [n, d])], [("h", [n, d]), ("y", [n, d])], {"w": w, "w2": w2, "w3": w3}), \
        {"x": (n, d)}, numpy_ref


def reshape_by_computed_shape(rng, n=6, d=10):
    """The shape of a Reshape is a kernel's result (Add of two constants), read back in the middle of the
    run: the run's first launches ran before the end, so the recorded plan moves onto the arena."""
    w = rng.standard_normal((d, d)).astype(np.float32) / 3
    s1 = np.array([n * 2, d // 2 - 1], np.int64)
    s2 = np.array([0, 1], np.int64)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["r"]),
             helper.make_node("Add", ["s1", "s2"], ["shape"]), helper.make_node("Reshape", ["r", "shape"], ["rs"]),
             helper.make_node("Exp", ["rs"], ["e"]), helper.make_node("Neg", ["e"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [n, d])],
                          [helper.make_tensor_value_info("y", F, [n * 2, d // 2])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(s1, "s1"),
                           numpy_helper.from_array(s2, "s2")])

    def numpy_ref(feeds):
        return [-np.exp(np.maximum(feeds["x"].astype(np.float64) @ w, 0).reshape(n * 2, d // 2))]
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), {"x": (n, d)}, numpy_ref


GRAPHS = {"residual": residual_block, "branchy_concat": branchy_concat, "output_used_inside": output_used_inside,
          "computed_shape": reshape_by_computed_shape}


def _runs(model, shapes, monkeypatch, memplan: str, feeds_list):
    from morok_py.onnx import OnnxExecutor
    monkeypatch.setenv("MOROK_MEMPLAN", memplan)
    ex = OnnxExecutor(model, "CPU")
    return ex, [ex.run(f) for f in feeds_list]


@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_executor_arena_matches_numpy_and_the_unplanned_run(graph, monkeypatch):
    rng = np.random.default_rng(11)
    model, shapes, numpy_ref = GRAPHS[graph](rng)
    # the first run records, then replays: new data each time and the first data again
    feeds_list = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()} for _ in range(4)]
    feeds_list.append(feeds_list[0])
    ex, planned = _runs(model, shapes, monkeypatch, "1", feeds_list)
    _, plain = _runs(model, shapes, monkeypatch, "0", feeds_list)
    mp = ex.memory_plan
    assert mp is not None and mp.offsets, "no intermediate went onto an arena"
    mp.check()
    rep = ex.memory_report()
    assert rep["arena_bytes"] == mp.arena_bytes <= rep["naive_bytes"] == mp.naive_bytes
    for feeds, got, base in zip(feeds_list, planned, plain):
        want = numpy_ref(feeds)
        assert len(got) == len(want)
        for g, b, w in zip(got, base, want):
            assert g.tobytes() == b.tobytes(), "the arena run differs from the unplanned one"
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
    for g, b in zip(planned[0], planned[-1]):
        assert g.tobytes() == b.tobytes()
    # the arena's views are what the plan launches: no intermediate of the run kept its own buffer
    arena = ex.plans[next(iter(ex.plans))][3].arena
    planned_ptrs = {b.ptr for _, bufs, _ in ex.k.launches for b in bufs if b.same_memory(arena)}
    assert len(planned_ptrs) >= 1


def test_executor_without_the_plan_records_no_arena(monkeypatch):
    rng = np.random.default_rng(5)
    model, shapes, _ = residual_block(rng)
    ex, _ = _runs(model, shapes, monkeypatch, "0", [{"x": rng.standard_normal(shapes["x"]).astype(np.float32)}])
    assert ex.memory_plan is None and ex.memory_report() is None


def test_run_with_a_mid_run_read_plans_the_recorded_launches(monkeypatch):
    """A value read back mid-run launches the kernels queued before it on their own buffers; the plan
    recorded for replay is moved onto the arena after the run."""
    import morok_py.onnx.executor as E
    calls = []
    real = E.plan_launches

    def spy(launches, keep, **kw):
        calls.append(len(launches[0]) if launches else 0)
        return real(launches, keep, **kw)
    monkeypatch.setattr(E, "plan_launches", spy)
    rng = np.random.default_rng(9)
    model, shapes, numpy_ref = reshape_by_computed_shape(rng)
    ex, outs = _runs(model, shapes, monkeypatch, "1",
                     [{"x": rng.standard_normal(shapes["x"]).astype(np.float32)} for _ in range(3)])
    assert calls == [3], "expected one plan of the recorded (program, buffers, vars) launches"
    assert ex.memory_plan is not None and ex.memory_plan.offsets


def test_session_reports_the_arena(monkeypatch):
    from morok_py.onnx import InferenceSession
    monkeypatch.setenv("MOROK_MEMPLAN", "1")
    rng = np.random.default_rng(2)
    model, shapes, numpy_ref = residual_block(rng)
    sess = InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal(shapes["x"]).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], numpy_ref({"x": x})[0], rtol=2e-5, atol=2e-5)
    rep = sess.executor.memory_report()
    assert rep is not None and 0 < rep["arena_bytes"] <= rep["naive_bytes"]
