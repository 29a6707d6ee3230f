"""Concat without copies in the ONNX executor: where every input's slice of the output is one byte range
(all dims before the axis are 1), the producers of a Concat's inputs write their slices of its output and
the Concat launches nothing for them; anything else is copied. Each case is checked against numpy,
bitwise against the copy path (MOROK_ONNX_CONCAT_VIEWS=0), replayed with new random inputs, and by its
launch count."""
from __future__ import annotations

import os

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed (pip install -e '.[onnx]')")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from morok_py.onnx.executor import OnnxExecutor  # noqa: E402

DEVICE = os.environ.get("MOROK_ONNX_DEVICE", "CPU")
REPLAYS = 3


class Graph:
    """A small graph builder: Conv+Relu producers (weights random), Concat, and a few elementwise ops."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self.weights = [], [], {}
        self.n = 0

    def name(self, p: str) -> str:
        self.n += 1
        return f"{p}{self.n}"

    def conv_relu(self, x: str, cin: int, cout: int, k: int = 3) -> str:
        w = (self.rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
        b = self.rng.standard_normal(cout).astype(np.float32) * 0.1
        wn, bn, c, r = self.name("w"), self.name("b"), self.name("c"), self.name("r")
        self.inits += [numpy_helper.from_array(w, wn), numpy_helper.from_array(b, bn)]
        self.weights[wn], self.weights[bn] = w, b
        self.nodes += [helper.make_node("Conv", [x, wn, bn], [c], pads=[k // 2] * 4),
                       helper.make_node("Relu", [c], [r])]
        return r

    def op(self, op_type: str, ins: list[str], **attrs) -> str:
        out = self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, ins, [out], **attrs))
        return out

    def model(self, inputs: dict[str, tuple], outputs: list[str]) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s))
                                                for n, s in inputs.items()],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                              self.inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


# ---- numpy reference of the same graphs --------------------------------------------------------------
def np_conv(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    k = w.shape[-1]
    p = k // 2
    n, c, h, wd = x.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (p, p), (p, p)))
    out = np.zeros((n, w.shape[0], h, wd))
    for i in range(k):
        for j in range(k):
            out += np.einsum("nchw,oc->nohw", xp[:, :, i:i + h, j:j + wd], w[:, :, i, j])
    return out + b[None, :, None, None]


def np_run(g: Graph, feeds: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]:
    env = {**feeds, **g.weights}
    for n in g.nodes:
        x = [env[i] for i in n.input]
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == "Conv":
            y = np_conv(*x)
        elif n.op_type == "Relu":
            y = np.maximum(x[0], 0)
        elif n.op_type == "Concat":
            y = np.concatenate(x, axis=attrs["axis"])
        elif n.op_type == "Sigmoid":
            y = 1 / (1 + np.exp(-x[0]))
        elif n.op_type == "Add":
            y = x[0] + x[1]
        elif n.op_type == "Range":
            y = np.arange(x[0], x[1], x[2])
        else:
            raise NotImplementedError(n.op_type)
        env[n.output[0]] = y
    return [env[o] for o in outputs]


def executor(model: onnx.ModelProto, views: bool, monkeypatch) -> OnnxExecutor:
    monkeypatch.setenv("MOROK_ONNX_CONCAT_VIEWS", "1" if views else "0")
    return OnnxExecutor(model, DEVICE)


def check(g: Graph, inputs: dict[str, tuple], outputs: list[str], monkeypatch, seed: int = 1) -> tuple[int, int]:
    """Run the graph with and without Concat views (first run and replays, new random inputs each time):
    both match numpy and each other bit for bit, and every memory plan is sound. Returns the launch
    counts (views, copies)."""
    model = g.model(inputs, outputs)
    on, off = executor(model, True, monkeypatch), executor(model, False, monkeypatch)
    assert on.concat_views and not off.concat_views
    rng = np.random.default_rng(seed)
    counts = []
    for rep in range(1 + REPLAYS):
        feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs.items()}
        want = np_run(g, feeds, outputs)
        got_on, got_off = on.run(feeds), off.run(feeds)
        for w, a, b in zip(want, got_on, got_off):
            np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-4)
            assert a.shape == w.shape and np.array_equal(a, b)
        if rep == 0:
            counts = [len(ex.k.launches) for ex in (on, off)]
            for ex in (on, off):
                if ex.memory_plan is not None:
                    ex.memory_plan.check()
    return counts[0], counts[1]


def dense_block(g: Graph, x: str, c: int, growth: int, layers: int) -> tuple[str, int]:
    """DenseNet's block: each layer convolves the running concatenation and appends its features."""
    for _ in range(layers):
        y = g.conv_relu(x, c, growth)
        x = g.op("Concat", [x, y], axis=1)
        c += growth
    return x, c


# ---- cases ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("memplan", ["1", "0"])
def test_dense_blocks_write_into_the_concat(monkeypatch, memplan):
    """Two dense blocks (odd channel counts, 6x6 maps) joined by a 1x1 transition: every Concat input is a
    Conv+Relu output or an earlier Concat, so no Concat launches a copy."""
    monkeypatch.setenv("MOROK_MEMPLAN", memplan)
    g = Graph()
    x0 = g.conv_relu("X", 3, 5)
    b1, c = dense_block(g, x0, 5, 3, 4)
    t = g.conv_relu(b1, c, 7, k=1)
    b2, c = dense_block(g, t, 7, 5, 3)
    head = g.conv_relu(b2, c, 3, k=1)
    on, off = check(g, {"X": (1, 3, 6, 6)}, [head], monkeypatch)
    assert off - on == 2 * (4 + 3)        # each Concat had two copy kernels


def nested_concats(g: Graph) -> tuple[str, str]:
    """Two Concats over 2 input channels, the first an input of the second (so a prefix of its buffer with
    Concat views): 3 + 5 channels, then those 8 + 3."""
    x0 = g.conv_relu("X", 2, 3)
    y1 = g.conv_relu(x0, 3, 5)
    c1 = g.op("Concat", [x0, y1], axis=1)
    y2 = g.conv_relu(c1, 8, 3)
    return c1, g.op("Concat", [c1, y2], axis=1)


def test_block_output_and_inner_concat_as_graph_outputs(monkeypatch):
    """An inner Concat (a prefix of the block's buffer) and the last one are both graph outputs."""
    g = Graph(2)
    c1, c2 = nested_concats(g)
    on, off = check(g, {"X": (1, 2, 7, 4)}, [c1, c2], monkeypatch)   # 7x4 = 28 floats: 112 bytes per channel
    assert off - on == 4


def test_input_read_by_another_node(monkeypatch):
    """A Concat input that another node also reads (before and after the Concat) is read from its slice."""
    g = Graph(3)
    a = g.conv_relu("X", 3, 5)
    b = g.conv_relu("X", 3, 3)
    early = g.op("Sigmoid", [b])
    c = g.op("Concat", [a, b], axis=1)
    late = g.op("Add", [b, early])
    head = g.conv_relu(c, 8, 2)
    on, off = check(g, {"X": (1, 3, 6, 6)}, [head, late, early], monkeypatch)
    assert off - on == 2


def test_graph_input_is_copied(monkeypatch):
    """A graph input has no producer in the run: it is copied; the Conv output beside it still moves."""
    g = Graph(4)
    y = g.conv_relu("X", 3, 5)
    c = g.op("Concat", ["X", y], axis=1)
    head = g.conv_relu(c, 8, 3)
    on, off = check(g, {"X": (1, 3, 6, 6)}, [head], monkeypatch)
    assert off - on == 1


def test_batch_two_on_axis_one_copies(monkeypatch):
    """With a batch of 2 each input's slice is two byte ranges: every input is copied."""
    g = Graph(5)
    b1, c = dense_block(g, g.conv_relu("X", 3, 5), 5, 3, 3)
    head = g.conv_relu(b1, c, 2, k=1)
    on, off = check(g, {"X": (2, 3, 6, 6)}, [head], monkeypatch)
    assert on == off


def test_axis_zero(monkeypatch):
    """Concat on axis 0: the slices are byte ranges at any shape."""
    g = Graph(6)
    a = g.op("Sigmoid", ["X"])
    b = g.conv_relu("Y", 3, 3)
    c = g.op("Concat", [a, b], axis=0)
    out = g.op("Add", [c, c])
    on, off = check(g, {"X": (3, 3, 4, 5), "Y": (2, 3, 4, 5)}, [out], monkeypatch)
    assert off - on == 2


def test_misaligned_slices_are_copied(monkeypatch):
    """5x5 maps: 100 bytes per channel, so a slice after 5 channels does not start on a view's 16-byte
    alignment; those inputs are copied (the one at offset 0 still moves)."""
    g = Graph(7)
    b1, c = dense_block(g, g.conv_relu("X", 3, 5), 5, 3, 3)
    head = g.conv_relu(b1, c, 2, k=1)
    on, off = check(g, {"X": (1, 3, 5, 5)}, [head], monkeypatch)
    assert 0 < off - on < 6


def test_every_earlier_feature_concatenated_again(monkeypatch):
    """torchvision's DenseNet export: layer i concatenates all earlier maps again (Concat(x0, y1),
    Concat(x0, y1, y2), ...). A value lives in one place: the first Concat takes the maps, and each later
    one takes the earlier Concat's buffer whole, so nothing is copied."""
    g = Graph(8)
    feats = [g.conv_relu("X", 3, 5)]
    c = 5
    cat = feats[0]
    for _ in range(3):
        feats.append(g.conv_relu(cat, c, 3))
        c += 3
        cat = g.op("Concat", list(feats), axis=1)
    head = g.conv_relu(cat, c, 2, k=1)
    on, off = check(g, {"X": (1, 3, 6, 6)}, [head], monkeypatch)
    assert off - on == 2 + 3 + 4


def test_a_later_concat_of_a_prefix_is_a_view(monkeypatch):
    """Concat(a, b, c) first, then Concat(a, b): the second is the first's leading range, no launch."""
    g = Graph(9)
    a, b, c = g.conv_relu("X", 3, 3), g.conv_relu("X", 3, 5), g.conv_relu("X", 3, 2)
    abc = g.op("Concat", [a, b, c], axis=1)
    ab = g.op("Concat", [a, b], axis=1)
    bc = g.op("Concat", [b, c], axis=1)       # a range inside, not at the start
    h1, h2, h3 = g.conv_relu(abc, 10, 2), g.conv_relu(ab, 8, 2), g.conv_relu(bc, 7, 2)
    on, off = check(g, {"X": (1, 3, 6, 6)}, [h1, h2, h3], monkeypatch)
    assert off - on == 3 + 2 + 2


def test_the_same_input_twice(monkeypatch):
    """Concat(y, y): a copy kernel writes the whole output, so it cannot read y from inside it: both copy."""
    g = Graph(10)
    y = g.conv_relu("X", 3, 3)
    c = g.op("Concat", [y, y], axis=1)
    head = g.conv_relu(c, 6, 2)
    on, off = check(g, {"X": (1, 3, 6, 6)}, [head], monkeypatch)
    assert off == on


def test_switch_off_keeps_the_copies(monkeypatch):
    """MOROK_ONNX_CONCAT_VIEWS=0: every Concat input is one copy kernel, named after the node."""
    g = Graph(11)
    b1, c = dense_block(g, g.conv_relu("X", 3, 5), 5, 3, 2)
    model = g.model({"X": (1, 3, 6, 6)}, [b1])
    for views, copies in ((False, 4), (True, 0)):
        ex = executor(model, views, monkeypatch)
        ex.run({"X": np.random.default_rng(0).standard_normal((1, 3, 6, 6)).astype(np.float32)})
        names = [s.node for s in ex.k.stats]
        assert sum(":" in n and n.split(":")[0].startswith("Concat") for n in names) == copies, names


def test_memory_plan_places_the_root_of_views():
    """plan_launches plans a view of a Buffer as that root buffer: the root is placed whole, its views keep
    their offsets inside it, and nothing live beside the root overlaps it."""
    from types import SimpleNamespace
    from morok_py import Buffer, dtypes
    from morok_py.memplan import plan_launches
    from morok_py.registry import get_device

    def prog(*written):
        return SimpleNamespace(launch=SimpleNamespace(params=[SimpleNamespace(written=w) for w in written]))

    dev = get_device("CPU")
    x, out = Buffer(dev, 37, dtypes.float32), Buffer(dev, 5, dtypes.float32)
    root = Buffer(dev, 40, dtypes.float32)
    a, b = root.view(0, 16), root.view(64, 24)
    t = Buffer(dev, 50, dtypes.float32)
    launches = [(prog(False, True), (x, a)), (prog(False, True), (a, b)), (prog(False, False, True), (a, b, t)),
                (prog(False, True), (t, out))]
    arena = plan_launches(launches, [x, out])
    plan = arena.plan
    plan.check()
    assert len(plan.offsets) == 2          # the root and t; a and b are not buffers of their own
    va, vb = arena.launches[1][1]
    assert vb.ptr - va.ptr == 64 and va.ptr == arena.launches[0][1][1].ptr
    root_off = va.ptr - arena.arena.ptr
    t_off = arena.launches[2][1][2].ptr - arena.arena.ptr
    assert t_off >= root_off + root.nbytes or t_off + t.nbytes <= root_off


def test_a_value_read_back_mid_run_stays_put(monkeypatch):
    """Range reads its limit (a graph input) on the host, so the launches queued before it run then: a
    Concat input made before that read is copied, one made after it moves. Such a run records no plan
    and every run goes node by node."""
    g = Graph(12)
    a = g.conv_relu("X", 3, 3)
    for name, v in (("zero", 0), ("one", 1)):
        g.weights[name] = np.array(v, np.int64)
        g.inits.append(numpy_helper.from_array(g.weights[name], name))
    g.nodes.append(helper.make_node("Range", ["zero", "n", "one"], ["r"]))
    b = g.conv_relu("X", 3, 5)
    c = g.op("Concat", [a, b], axis=1)
    head = g.conv_relu(c, 8, 2)
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 3, 6, 6]),
              helper.make_tensor_value_info("n", TensorProto.INT64, [])]
    model = helper.make_model(helper.make_graph(g.nodes, "g", inputs, [
        helper.make_tensor_value_info(head, TensorProto.FLOAT, None),
        helper.make_tensor_value_info("r", TensorProto.INT64, None)], g.inits),
        opset_imports=[helper.make_opsetid("", 17)])
    on, off = executor(model, True, monkeypatch), executor(model, False, monkeypatch)
    rng = np.random.default_rng(3)
    for n in (4, 7, 5):
        x = rng.standard_normal((1, 3, 6, 6)).astype(np.float32)
        want = np_run(g, {"X": x, "n": np.array(n, np.int64)}, [head])[0]
        got_on, got_off = on.run({"X": x, "n": np.array(n, np.int64)}), off.run({"X": x, "n": np.array(n, np.int64)})
        np.testing.assert_allclose(got_on[0], want, rtol=1e-4, atol=1e-4)
        assert np.array_equal(got_on[0], got_off[0]) and np.array_equal(got_on[1], np.arange(n))
        assert len(off.k.launches) - len(on.k.launches) == 1
    assert not on.plans and not off.plans


def test_a_dynamic_batch_moves_at_one_and_copies_at_two(monkeypatch):
    """A symbolic batch (kernels with a symbolic outer range): batch 1 writes into the Concats, batch 2
    copies, and going back to batch 1 replays its own plan."""
    g = Graph(13)
    b1, c = dense_block(g, g.conv_relu("X", 3, 5), 5, 3, 3)
    head = g.conv_relu(b1, c, 2, k=1)
    model = g.model({"X": ("batch", 3, 6, 6)}, [head, b1])
    on, off = executor(model, True, monkeypatch), executor(model, False, monkeypatch)
    rng = np.random.default_rng(4)
    counts: list[int] = []
    for batch in (1, 2, 1, 2):
        x = rng.standard_normal((batch, 3, 6, 6)).astype(np.float32)
        want = np_run(g, {"X": x}, [head, b1])
        got_on, got_off = on.run({"X": x}), off.run({"X": x})
        for w, a, b in zip(want, got_on, got_off):
            np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-4)
            assert np.array_equal(a, b)
        if len(counts) < 2:         # the recording runs: the launches of this batch size
            counts.append(len(off.k.launches) - len(on.k.launches))
    assert len(on.plans) == len(off.plans) == 2
    assert counts == [6, 0] and on.k.symbolic_outer
