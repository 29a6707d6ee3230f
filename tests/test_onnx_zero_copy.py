"""The ONNX executor's replays on the CPU without copies: graph inputs the launches only read are bound to
the caller's arrays, and outputs are written straight into fresh arrays that are returned
(ExecutionPlan.slot). Every case runs beside the copy path (MOROK_ONNX_ZERO_COPY=0) on new random data
each run and must match it bit for bit, and numpy."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed (pip install -e '.[onnx]')")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from morok_py.onnx import InferenceSession, OnnxExecutor  # noqa: E402
from test_memplan import GRAPHS  # noqa: E402
from test_onnx_concat_views import Graph, dense_block, nested_concats, np_run  # noqa: E402
from test_onnx_session import mlp_model, reference as mlp_reference  # noqa: E402

F = TensorProto.FLOAT
RUNS = 4


def executor(model, monkeypatch, zero_copy: bool, **env: str) -> OnnxExecutor:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MOROK_ONNX_ZERO_COPY", "1" if zero_copy else "0")
    return OnnxExecutor(model, "CPU")


def run(ex: OnnxExecutor, feeds: dict, monkeypatch, zero_copy: bool) -> list[np.ndarray]:
    monkeypatch.setenv("MOROK_ONNX_ZERO_COPY", "1" if zero_copy else "0")
    return ex.run(feeds)


def compare(model, shapes: dict, monkeypatch, numpy_ref=None, feeds_of=None, **env: str) -> tuple[OnnxExecutor, list]:
    """Run `model` with and without copies (first run and RUNS - 1 replays, new random data each): the
    outputs match each other bitwise and numpy; the caller's inputs are unchanged. Returns the zero-copy
    executor and its outputs of every run (the caller checks they stayed as returned)."""
    zc, cp = executor(model, monkeypatch, True, **env), executor(model, monkeypatch, False, **env)
    rng = np.random.default_rng(3)
    kept = []
    for _ in range(RUNS):
        feeds = feeds_of(rng) if feeds_of else {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        before = {k: np.array(v, copy=True) for k, v in feeds.items()}
        got = run(zc, feeds, monkeypatch, True)
        want = run(cp, feeds, monkeypatch, False)
        for k, v in feeds.items():
            assert np.array_equal(np.asarray(v), before[k]), f"input {k} was written"
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype and g.tobytes() == w.tobytes()
            assert g.flags.c_contiguous and g.flags.writeable
        if numpy_ref is not None:
            for g, r in zip(got, numpy_ref(before)):
                np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5)
        kept.append((got, [np.array(g, copy=True) for g in got]))
    for got, snap in kept:        # no later run wrote into an array an earlier run returned
        for g, s in zip(got, snap):
            assert g.tobytes() == s.tobytes()
    return zc, [g for g, _ in kept]


def bound(ex: OnnxExecutor) -> tuple[list[str], list[bool]]:
    """The inputs the last recorded plan binds, and which outputs it writes in place."""
    (zc,) = ex.zero_copy.values()
    return sorted(zc.inputs), [o is not None for o in zc.outputs]


def model_of(nodes, inputs, outputs, inits=None):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, F, None) for n in outputs],
                          [numpy_helper.from_array(a, n) for n, a in (inits or {}).items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("memplan", ["1", "0"])
@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_memory_plan_graphs_match_the_copy_path(graph, memplan, monkeypatch):
    model, shapes, numpy_ref = GRAPHS[graph](np.random.default_rng(11))
    ex, _ = compare(model, shapes, monkeypatch, numpy_ref, MOROK_MEMPLAN=memplan)
    inputs, outputs = bound(ex)
    assert inputs == ["x"] and all(outputs)


def test_a_replay_copies_nothing(monkeypatch):
    from morok_py.backends.cpu.allocator import HostAllocator
    model, shapes, _ = GRAPHS["residual"](np.random.default_rng(2))
    ex = executor(model, monkeypatch, True)
    x = np.random.default_rng(1).standard_normal(shapes["x"]).astype(np.float32)
    ex.run({"x": x})
    calls = []
    monkeypatch.setattr(HostAllocator, "copyin", lambda self, *a: calls.append("in"))
    monkeypatch.setattr(HostAllocator, "copyout", lambda self, *a: calls.append("out"))
    (y,) = ex.run({"x": x})
    assert calls == [] and y.__array_interface__["data"][0] % 64 == 0


def test_returned_arrays_are_the_callers(monkeypatch):
    """Writing into a returned output changes neither the next run's result nor another output."""
    model, shapes, numpy_ref = GRAPHS["output_used_inside"](np.random.default_rng(4))
    ex = executor(model, monkeypatch, True)
    x = np.random.default_rng(5).standard_normal(shapes["x"]).astype(np.float32)
    ex.run({"x": x})
    h, y = ex.run({"x": x})
    h2, y2 = ex.run({"x": x})
    assert not np.shares_memory(h, h2) and not np.shares_memory(h, y)
    want = [a.tobytes() for a in (h, y)]
    h[:] = 1e9
    y[:] = -1e9
    assert [a.tobytes() for a in (h2, y2)] == want
    assert [a.tobytes() for a in ex.run({"x": x})] == want


def test_inputs_that_cannot_be_bound_are_copied(monkeypatch):
    """Strided and misaligned inputs are copied in; a read-only one is bound (the launches only read it)."""
    model, shapes, numpy_ref = GRAPHS["residual"](np.random.default_rng(6))
    n, d = shapes["x"]

    def feeds(rng):
        x = rng.standard_normal((n, d)).astype(np.float32)
        kind = int(rng.integers(0, 4))
        if kind == 0:       # a column-major copy: not C-contiguous
            return {"x": np.asfortranarray(x)}
        if kind == 1:       # 4 bytes past an aligned start
            raw = np.empty(x.size + 20, np.float32)
            off = (-raw.ctypes.data % 64) // 4 + 1
            y = raw[off:off + x.size].reshape(n, d)
            y[:] = x
            return {"x": y}
        if kind == 2:
            x.flags.writeable = False
            return {"x": x}
        return {"x": x}
    for _ in range(3):
        compare(model, shapes, monkeypatch, lambda f: numpy_ref({"x": np.asarray(f["x"], np.float32)}), feeds)


def test_an_output_that_is_an_input_or_a_weight(monkeypatch):
    """Identity of the input, of a weight and a Constant are outputs: they are copied (no launch writes
    them), the input shares its buffer with an output so it is copied in, and Relu(x) is still bound."""
    w = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    c = helper.make_tensor("cval", F, [2], [1.5, -2.5])
    nodes = [helper.make_node("Identity", ["x"], ["xi"]), helper.make_node("Identity", ["w"], ["wi"]),
             helper.make_node("Constant", [], ["k"], value=c), helper.make_node("Relu", ["x"], ["r"])]
    model = model_of(nodes, [("x", [3, 5])], ["xi", "wi", "k", "r"], {"w": w})
    ex, outs = compare(model, {"x": (3, 5)}, monkeypatch,
                       lambda f: [f["x"], w, np.array([1.5, -2.5], np.float32), np.maximum(f["x"], 0)])
    assert bound(ex) == ([], [False, False, False, True])
    assert not np.shares_memory(outs[1][1], outs[2][1])


def test_outputs_that_alias_each_other_or_are_views(monkeypatch):
    """y and its Reshape are one buffer (both copied out, each its own array); a Transpose is a strided
    view (copied); Relu of the transpose is bound."""
    nodes = [helper.make_node("Sigmoid", ["x"], ["y"]),
             helper.make_node("Reshape", ["y", "shape"], ["ry"]),
             helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
             helper.make_node("Relu", ["xt"], ["rt"])]
    model = model_of(nodes, [("x", [7, 3])], ["y", "ry", "rt", "xt"], {"shape": np.array([3, 7], np.int64)})
    ex, outs = compare(model, {"x": (7, 3)}, monkeypatch,
                       lambda f: [1 / (1 + np.exp(-f["x"].astype(np.float64))),
                                  (1 / (1 + np.exp(-f["x"].astype(np.float64)))).reshape(3, 7),
                                  np.maximum(f["x"].T, 0), f["x"].T])
    assert bound(ex) == ([], [False, False, True, False])
    y, ry = outs[-1][:2]
    assert not np.shares_memory(y, ry)


@pytest.mark.parametrize("views", ["1", "0"])
@pytest.mark.parametrize("memplan", ["1", "0"])
def test_concat_views_and_their_outputs(views, memplan, monkeypatch):
    """A dense block's inner Concat (a prefix of the last one's buffer with Concat views) and the last
    one are both outputs, beside a head convolution after the block."""
    g = Graph(2)
    c1, c2 = nested_concats(g)
    b2, c = dense_block(g, c2, 11, 3, 2)
    head = g.conv_relu(b2, c, 3, k=1)
    outputs = [c1, c2, head]
    inputs = {"X": (1, 2, 7, 4)}
    model = g.model(inputs, outputs)
    ex, _ = compare(model, inputs, monkeypatch, lambda f: np_run(g, f, outputs),
                    MOROK_ONNX_CONCAT_VIEWS=views, MOROK_MEMPLAN=memplan)
    ins, outs = bound(ex)
    assert ins == ["X"] and outs[2]
    if views == "0":
        assert all(outs)


def test_each_batch_size_has_its_own_bindings(monkeypatch):
    model = mlp_model()
    zc = executor(model, monkeypatch, True)
    rng = np.random.default_rng(8)
    seen = []
    for b in (2, 5, 2, 5, 1):
        x = rng.standard_normal((b, 3, 5)).astype(np.float32)
        y, r = zc.run({"x": x})
        wy, wr = mlp_reference(x)
        np.testing.assert_allclose(y, wy, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r, wr, rtol=1e-5, atol=1e-6)
        seen.append((y, np.array(y, copy=True)))
    assert len(zc.zero_copy) == 2        # batch 1 ran once: recorded, not replayed yet
    for a, s in seen:
        assert a.tobytes() == s.tobytes()


def test_a_device_without_host_memory_copies(monkeypatch):
    """Where the allocator's memory is not the host's, replays copy as before."""
    from morok_py.backends.cpu.allocator import HostAllocator
    monkeypatch.setattr(HostAllocator, "host_memory", False)
    model, shapes, numpy_ref = GRAPHS["residual"](np.random.default_rng(2))
    ex, _ = compare(model, shapes, monkeypatch, numpy_ref)
    assert bound(ex) == ([], [False])


def test_the_switch_off_copies(monkeypatch):
    model, shapes, numpy_ref = GRAPHS["branchy_concat"](np.random.default_rng(2))
    ex = executor(model, monkeypatch, False)
    x = np.random.default_rng(1).standard_normal(shapes["x"]).astype(np.float32)
    for _ in range(3):
        np.testing.assert_allclose(ex.run({"x": x})[0], numpy_ref({"x": x})[0], rtol=2e-5, atol=2e-5)
    assert not ex.zero_copy


def test_the_session_returns_bound_outputs(monkeypatch):
    monkeypatch.setenv("MOROK_ONNX_ZERO_COPY", "1")
    sess = InferenceSession(mlp_model().SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(9).standard_normal((4, 3, 5)).astype(np.float32)
    for _ in range(3):
        r, y = sess.run(["r", "y"], {"x": x})
    wy, wr = mlp_reference(x)
    np.testing.assert_allclose(y, wy, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r, wr, rtol=1e-5, atol=1e-6)
    assert bound(sess.executor) == (["x"], [True, True])


@pytest.mark.parametrize("views", ["1", "0"])
def test_a_concat_output_its_producers_write_into(views, monkeypatch):
    """With Concat views the producers write their slices of the output: the output's slot carries
    them at their offsets, so they write into the returned array."""
    g = Graph(5)
    a = g.conv_relu("X", 3, 5)
    b = g.conv_relu("X", 3, 7)
    cat = g.op("Concat", [a, b], axis=1)
    inputs = {"X": (1, 3, 5, 4)}       # 5x4 = 20 floats: 80 bytes per channel
    ex, _ = compare(g.model(inputs, [cat]), inputs, monkeypatch, lambda f: np_run(g, f, [cat]),
                    MOROK_ONNX_CONCAT_VIEWS=views)
    (zc,) = ex.zero_copy.values()
    slot = zc.outputs[0][0]
    assert slot.written and (max(off for _, _, off in slot.places) == 5 * 80) == (views == "1")


@pytest.mark.parametrize("zero_copy", [True, False])
def test_an_empty_input_replays(zero_copy, monkeypatch):
    """CastLike's second input only gives a dtype: fed empty, it is recorded and replayed (its buffer
    holds one unused element, nothing is copied into it)."""
    nodes = [helper.make_node("CastLike", ["x", "like"], ["y"]), helper.make_node("Neg", ["y"], ["z"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [3, 5]),
                                       helper.make_tensor_value_info("like", TensorProto.DOUBLE, [0])],
                          [helper.make_tensor_value_info("z", TensorProto.DOUBLE, [3, 5])])
    ex = executor(helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)]), monkeypatch, zero_copy)
    rng = np.random.default_rng(12)
    for _ in range(3):
        x = rng.standard_normal((3, 5)).astype(np.float32)
        (z,) = ex.run({"x": x, "like": np.zeros(0, np.float64)})
        assert z.dtype == np.float64 and z.tobytes() == (-x.astype(np.float64)).tobytes()


def test_the_switch_is_read_at_each_run(monkeypatch):
    """Turning it off and on between replays of one executor: every run is right."""
    model, shapes, numpy_ref = GRAPHS["output_used_inside"](np.random.default_rng(3))
    ex = executor(model, monkeypatch, True)
    rng = np.random.default_rng(4)
    for flag in (True, True, False, True, False, False, True):
        x = rng.standard_normal(shapes["x"]).astype(np.float32)
        for g, w in zip(run(ex, {"x": x}, monkeypatch, flag), numpy_ref({"x": x})):
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def addresses(arrays) -> set[int]:
    return {a.__array_interface__["data"][0] for a in arrays}


def test_an_output_nothing_holds_is_written_again(monkeypatch):
    """A result the caller dropped lends its memory to the next run; in `y = run(...)` two arrays take
    turns; results the caller keeps are never reused."""
    model, shapes, numpy_ref = GRAPHS["residual"](np.random.default_rng(7))
    ex = executor(model, monkeypatch, True)
    rng = np.random.default_rng(8)
    xs = [rng.standard_normal(shapes["x"]).astype(np.float32) for _ in range(8)]
    ex.run({"x": xs[0]})
    seen = []
    for x in xs:
        (y,) = ex.run({"x": x})      # the last run's y is alive while this one runs
        np.testing.assert_allclose(y, numpy_ref({"x": x})[0], rtol=2e-5, atol=2e-5)
        seen.append(y.__array_interface__["data"][0])
    assert len(set(seen)) == 2
    del y
    for x in xs[:3]:
        ex.run({"x": x})             # dropped at once: one array serves every run
    kept = [ex.run({"x": x})[0] for x in xs]
    assert len(addresses(kept)) == len(kept)
    for x, k in zip(xs, kept):
        np.testing.assert_allclose(k, numpy_ref({"x": x})[0], rtol=2e-5, atol=2e-5)


def test_a_view_of_a_dropped_output_keeps_it(monkeypatch):
    model, shapes, numpy_ref = GRAPHS["output_used_inside"](np.random.default_rng(7))
    ex = executor(model, monkeypatch, True)
    rng = np.random.default_rng(9)
    x0 = rng.standard_normal(shapes["x"]).astype(np.float32)
    ex.run({"x": x0})
    h, y = ex.run({"x": x0})
    row, flat = h[1:3], memoryview(y)
    want_row, want_y = row.copy(), bytes(flat)
    held = addresses([h, y])
    del h, y
    for _ in range(4):
        h2, y2 = ex.run({"x": rng.standard_normal(shapes["x"]).astype(np.float32)})
        assert not addresses([h2, y2]) & held
        del h2, y2
    assert row.tobytes() == want_row.tobytes() and bytes(flat) == want_y
