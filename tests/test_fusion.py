"""Fusion as a library facility: `kernels.matmul` computes each epilogue step in the kernel that writes
the output (every x86-64 level the host runs), and `morok_py.onnx.fuse` rewrites a graph into fewer
nodes (BatchNorm folded into the convolution, activations and residual adds as epilogues, pooling as
its kernels) whose results match onnx's reference evaluator on random data with odd sizes."""
from __future__ import annotations

import numpy as np
import pytest

from morok_py import dtypes, kernels as K

from conftest import random_array

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed (pip install -e '.[onnx]')")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from morok_py.onnx import OnnxExecutor  # noqa: E402
from morok_py.onnx.fuse import fuse  # noqa: E402


def _gelu(v):
    from math import erf
    return 0.5 * v * (1 + np.vectorize(erf)(v / np.sqrt(2)))


STEPS = [
    (("bias", "relu"), lambda v, b, r: np.maximum(v + b, 0)),
    (("bias", ("clip", -0.5, 0.75)), lambda v, b, r: np.clip(v + b, -0.5, 0.75)),
    (("bias", "silu"), lambda v, b, r: (v + b) / (1 + np.exp(-(v + b)))),
    (("gelu",), lambda v, b, r: _gelu(v)),
    (("bias", "add", "hardswish"), lambda v, b, r: (v + b + r) * np.clip((v + b + r) / 6 + 0.5, 0, 1)),
    (("tanh", "mul"), lambda v, b, r: np.tanh(v) * r),
    ((("hardsigmoid", 0.2, 0.5), ("scale", 3.0), ("shift", -1.0)), lambda v, b, r: np.clip(0.2 * v + 0.5, 0, 1) * 3 - 1),
    ((("leakyrelu", 0.1), "sigmoid"), lambda v, b, r: 1 / (1 + np.exp(-np.where(v < 0, 0.1 * v, v)))),
]


@pytest.mark.parametrize("case", range(len(STEPS)))
def test_matmul_epilogue_matches_numpy_at_every_level(cpu_level, rng, case):
    steps, ref = STEPS[case]
    epi = K.Epilogue(steps)
    M, N, Kd = 37, 45, 29
    a, b = random_array(rng, (M, Kd), np.float32), random_array(rng, (Kd, N), np.float32)
    bias, res = random_array(rng, (N,), np.float32), random_array(rng, (M, N), np.float32)
    operands = [{"bias": bias, "add": res, "mul": res}[o] for o in epi.operands]
    out = cpu_level.empty(M * N, dtypes.float32)
    cpu_level.compile(K.matmul(M, N, Kd, epilogue=epi), f"mm_epi{case}")(
        cpu_level.buf(a), cpu_level.buf(b), *[cpu_level.buf(o) for o in operands], out)
    want = ref(a.astype(np.float64) @ b, bias, res)
    np.testing.assert_allclose(out.numpy().reshape(M, N), want, rtol=1e-4, atol=1e-4)


# ---- the graph pass --------------------------------------------------------------------------------

class _Builder:
    """A small ONNX graph under construction with random float32 initializers."""

    def __init__(self, rng) -> None:
        self.rng, self.nodes, self.inits, self.k = rng, [], [], 0

    def name(self, p: str) -> str:
        self.k += 1
        return f"{p}{self.k}"

    def init(self, arr) -> str:
        n = self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(arr, np.float32), n))
        return n

    def node(self, op: str, ins: list[str], **attrs) -> str:
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, ins, [out], **attrs))
        return out

    def conv(self, x, ci, co, k, stride=1, group=1, pads=None, bias=True):
        w = self.init(self.rng.standard_normal((co, ci // group, k, k)) * 0.3)
        ins = [x, w] + ([self.init(self.rng.standard_normal(co))] if bias else [])
        return self.node("Conv", ins, kernel_shape=[k, k], strides=[stride, stride],
                         pads=pads if pads is not None else [k // 2] * 4, group=group)

    def bn(self, x, c):
        r = self.rng
        return self.node("BatchNormalization", [x, self.init(r.uniform(0.5, 1.5, c)), self.init(r.uniform(-1, 1, c)),
                                                self.init(r.uniform(-1, 1, c)), self.init(r.uniform(0.5, 2, c))],
                         epsilon=1e-3)

    def model(self, inputs: dict, outputs: list[str]) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, "t", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
                                                for n, s in inputs.items()],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])     # 20: Gelu
        m.ir_version = 9
        return m


def _check(model, feeds, fused_ops: dict[str, int], rtol=1e-4, atol=1e-4):
    """The fused graph has the expected fused nodes and its outputs match onnx's reference evaluator."""
    f = fuse(model)
    counts: dict[str, int] = {}
    for n in f.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    for op, n in fused_ops.items():
        assert counts.get(op, 0) == n, (op, counts)
    want = ReferenceEvaluator(model).run(None, feeds)
    got = OnnxExecutor(model, "CPU").run(feeds)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
    return f


def test_batchnorm_and_relu6_fold_into_the_convolution(rng):
    b = _Builder(rng)
    y = b.node("Clip", [b.bn(b.conv("x", 5, 7, 3, stride=2), 7), b.init(0.0), b.init(6.0)])
    f = _check(b.model({"x": [2, 5, 13, 11]}, [y]), {"x": random_array(rng, (2, 5, 13, 11), np.float32)},
               {"MorokConv": 1, "BatchNormalization": 0, "Clip": 0})
    assert len(f.graph.node) == 1


def test_depthwise_hardswish_and_pointwise_with_a_residual_computed_later(rng):
    b = _Builder(rng)
    x = b.conv("x", 6, 6, 1, pads=[0, 0, 0, 0])
    h = b.node("HardSwish", [b.bn(b.conv(x, 6, 6, 3, group=6, bias=False), 6)])
    main = b.bn(b.conv(h, 6, 9, 1, pads=[0, 0, 0, 0]), 9)
    skip = b.conv(x, 6, 9, 1, pads=[0, 0, 0, 0])          # after `main` in node order
    y = b.node("Relu", [b.node("Add", [main, skip])])
    _check(b.model({"x": [3, 6, 9, 7]}, [y]), {"x": random_array(rng, (3, 6, 9, 7), np.float32)},
           {"MorokConv": 4, "Add": 0, "Relu": 0, "HardSwish": 0})


def test_a_plans_weights_only_step_runs_once_and_every_run_matches(monkeypatch, rng):
    """A plan whose first kernel reads the weights alone (Winograd's filter transform, forced here on two
    convolutions with a residual add) runs that kernel once per weights buffer: it is not among a run's
    launches, and three runs with new inputs each match onnx's reference evaluator."""
    from morok_py.codegen.strategies.conv import ConvPlan
    from morok_py.onnx import fuse as F
    monkeypatch.setattr(F, "_choose_plan", lambda ctx, geo, *a: (ConvPlan("winograd", winograd=2), None))
    b = _Builder(rng)
    h = b.node("Relu", [b.conv("x", 5, 7, 3)])
    y = b.node("Relu", [b.node("Add", [b.conv(h, 7, 7, 3), h])])
    model = b.model({"x": [2, 5, 8, 10]}, [y])
    ex = OnnxExecutor(model, "CPU")
    for run in range(3):
        feeds = {"x": random_array(rng, (2, 5, 8, 10), np.float32)}
        np.testing.assert_allclose(ex.run(feeds)[0], ReferenceEvaluator(model).run(None, feeds)[0], rtol=1e-4, atol=1e-4)
        if run == 0:        # the first run's recorded launches: each convolution's input, gemm and output kernels
            names = [prog.name for prog, *_ in ex.k.launches]
            assert sum("input" in n for n in names) == 2 and sum("output" in n for n in names) == 2, names
            assert not any("weights" in n for n in names), names
    assert sum(len(v) for v in F._weights_outputs.values()) >= 2      # both transformed filters, kept


def test_a_convolution_output_read_elsewhere_keeps_its_node(rng):
    b = _Builder(rng)
    c = b.conv("x", 3, 4, 3)
    r = b.node("Relu", [c])
    _check(b.model({"x": [1, 3, 7, 9]}, [r, c]), {"x": random_array(rng, (1, 3, 7, 9), np.float32)},
           {"MorokConv": 1, "Relu": 1})


def test_gemm_with_silu_and_matmul_with_gelu_become_dense_kernels(rng):
    b = _Builder(rng)
    h = b.node("Gemm", ["x", b.init(rng.standard_normal((33, 19)) * 0.3), b.init(rng.standard_normal(33))],
               transB=1, alpha=0.7, beta=1.3)
    s = b.node("Mul", [h, b.node("Sigmoid", [h])])
    z = b.node("Gelu", [b.node("MatMul", [s, b.init(rng.standard_normal((33, 21)) * 0.3)])])
    y = b.node("Softmax", [z], axis=-1)
    _check(b.model({"x": [11, 19]}, [y]), {"x": random_array(rng, (11, 19), np.float32)},
           {"MorokDense": 2, "Sigmoid": 0, "Mul": 0, "Gelu": 0, "Softmax": 1})


def test_batchnorm_scale_shift_relu_without_a_convolution_is_one_affine_kernel(rng):
    b = _Builder(rng)
    y = b.node("Relu", [b.node("Add", [b.node("Mul", [b.bn("x", 5), b.init(rng.standard_normal((5, 1, 1)))]),
                                       b.init(rng.standard_normal((5, 1, 1)))])])
    _check(b.model({"x": [2, 5, 7, 3]}, [y]), {"x": random_array(rng, (2, 5, 7, 3), np.float32)},
           {"MorokAffine": 1, "Mul": 0, "Add": 0, "Relu": 0})


@pytest.mark.parametrize("op,attrs", [("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
                                      ("AveragePool", dict(kernel_shape=[3, 2], strides=[1, 2], pads=[1, 0, 1, 1])),
                                      ("AveragePool", dict(kernel_shape=[2, 2], pads=[1, 1, 0, 0], count_include_pad=1)),
                                      ("GlobalAveragePool", {}), ("GlobalMaxPool", {})])
def test_pooling_nodes_become_pooling_kernels(rng, op, attrs):
    b = _Builder(rng)
    y = b.node(op, ["x"], **attrs)
    kind = "MorokGlobalPool" if op.startswith("Global") else "MorokPool2d"
    _check(b.model({"x": [2, 3, 11, 9]}, [y]), {"x": random_array(rng, (2, 3, 11, 9), np.float32)}, {kind: 1, op: 0})


def test_weights_computed_by_constant_nodes_fold_and_fuse(rng):
    b = _Builder(rng)
    shape = b.init(np.array([4, 3, 3, 3]))
    b.inits[-1] = numpy_helper.from_array(np.array([4, 3, 3, 3], np.int64), shape)
    w = b.node("ConstantOfShape", [shape], value=numpy_helper.from_array(np.array([0.25], np.float32)))
    y = b.node("Relu", [b.node("Conv", ["x", w], kernel_shape=[3, 3], pads=[1, 1, 1, 1])])
    _check(b.model({"x": [1, 3, 6, 5]}, [y]), {"x": random_array(rng, (1, 3, 6, 5), np.float32)},
           {"MorokConv": 1, "ConstantOfShape": 0, "Relu": 0})


def test_fusion_can_be_turned_off(monkeypatch, rng):
    b = _Builder(rng)
    y = b.node("Relu", [b.conv("x", 3, 4, 3)])
    m = b.model({"x": [1, 3, 5, 5]}, [y])
    monkeypatch.setenv("MOROK_ONNX_FUSE", "0")
    assert [n.op_type for n in fuse(m).graph.node] == ["Conv", "Relu"]


# ---- ONNX's own node cases, their weights made constants so that the fused path runs them -----------

def _node_cases():
    import warnings
    from onnx.backend.test.case.node import collect_testcases
    prefixes = ("test_conv", "test_basic_conv", "test_batchnorm_example", "test_batchnorm_epsilon", "test_maxpool_2d",
                "test_averagepool_2d", "test_globalaveragepool", "test_globalmaxpool")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = [c for c in collect_testcases() if c.name.startswith(prefixes) and len(c.model.graph.node) == 1]
    return [pytest.param(c, id=c.name) for c in cases if "training" not in c.name]


@pytest.mark.parametrize("case", _node_cases())
def test_node_cases_with_constant_weights_run_fused(case):
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    inputs, outputs = case.data_sets[0]
    g = model.graph
    node = g.node[0]
    names = [vi.name for vi in g.input]
    feeds = {names[0]: inputs[0]}
    consts = {n: np.asarray(v) for n, v in zip(names[1:], inputs[1:])}
    kept = [vi for vi in g.input if vi.name not in consts]
    del g.input[:]
    g.input.extend(kept)
    g.initializer.extend(numpy_helper.from_array(v, n) for n, v in consts.items())
    fused = fuse(model)
    if node.op_type == "Conv" and np.ndim(inputs[1]) == 4 and len(node.output) == 1:
        assert [n.op_type for n in fused.graph.node] == ["MorokConv"]
    if node.op_type in ("MaxPool", "AveragePool") and len(node.output) == 1 and np.ndim(inputs[0]) == 4 \
            and np.asarray(inputs[0]).dtype == np.float32 \
            and not any(a.name in ("ceil_mode", "storage_order") and a.i for a in node.attribute):
        assert [n.op_type for n in fused.graph.node] == ["MorokPool2d"]
    got = OnnxExecutor(model, "CPU").run(feeds)
    for gv, wv in zip(got, outputs):
        np.testing.assert_allclose(gv, np.asarray(wv), rtol=case.rtol, atol=max(case.atol, 1e-6), err_msg=case.name)


def test_a_chain_of_elementwise_nodes_is_one_kernel(rng):
    b = _Builder(rng)
    s = b.node("Sigmoid", [b.node("Mul", ["x", b.init(1.5)])])
    y = b.node("Add", [b.node("HardSwish", [b.node("Mul", [s, "r"])]), "r"])
    shape = [3, 5, 7]
    _check(b.model({"x": shape, "r": shape}, [y]),
           {"x": random_array(rng, shape, np.float32), "r": random_array(rng, shape, np.float32)},
           {"MorokElementwise": 1, "Sigmoid": 0, "Mul": 0, "HardSwish": 0, "Add": 0})


def test_a_lone_elementwise_node_is_left_alone(rng):
    b = _Builder(rng)
    y = b.node("Tanh", ["x"])
    _check(b.model({"x": [4, 9]}, [y]), {"x": random_array(rng, (4, 9), np.float32)}, {"MorokElementwise": 0, "Tanh": 1})


def test_symbolic_affine_and_chain_builders_serve_every_shape_at_every_level(cpu_level, rng):
    epi = K.Epilogue.of("bias", "add", ("clip", -1.0, 1.5))
    prog = cpu_level.compile(K.channel_affine(epilogue=epi), "affine_sym")
    chain = cpu_level.compile(K.elementwise_chain(epilogue=K.Epilogue.of("silu", "mul", ("scale", 0.5))), "chain_sym")
    for N, C, P in ((2, 5, 13), (1, 7, 3), (3, 3, 1)):
        x, r = random_array(rng, (N, C, P), np.float32), random_array(rng, (N, C, P), np.float32)
        s, t, b = (random_array(rng, (C,), np.float32) for _ in range(3))
        out = cpu_level.empty(x.size, dtypes.float32)
        prog(*[cpu_level.buf(v) for v in (x, s, t, b, r)], out, rows=N * C, channels=C, inner=P)
        want = np.clip(x * s[:, None] + t[:, None] + b[:, None] + r, -1.0, 1.5)
        np.testing.assert_allclose(out.numpy().reshape(x.shape), want, rtol=1e-5, atol=1e-5)
        chain(cpu_level.buf(x), cpu_level.buf(r), out, n=x.size)
        np.testing.assert_allclose(out.numpy().reshape(x.shape), x / (1 + np.exp(-x)) * r * 0.5, rtol=1e-5, atol=1e-5)


def test_a_fused_model_with_a_dynamic_batch_compiles_nothing_for_a_new_batch_size(rng):
    b = _Builder(rng)
    h = b.node("Clip", [b.bn(b.conv("x", 4, 8, 3, stride=2), 8), b.init(0.0), b.init(6.0)])
    h = b.node("HardSwish", [b.conv(h, 8, 8, 3, group=8)])
    y = b.node("GlobalAveragePool", [b.node("MaxPool", [b.conv(h, 8, 6, 1, pads=[0, 0, 0, 0])], kernel_shape=[2, 2])])
    model = b.model({"x": ["batch", 4, 11, 9]}, [y])
    ex = OnnxExecutor(model, "CPU")
    assert {"MorokConv", "MorokPool2d", "MorokGlobalPool"} <= {n.op_type for n in ex.graph.node}
    counts = []
    for n in (2, 3, 1, 3):
        x = random_array(rng, (n, 4, 11, 9), np.float32)
        want = ReferenceEvaluator(model).run(None, {"x": x})[0]
        np.testing.assert_allclose(ex.run({"x": x})[0], want, rtol=1e-4, atol=1e-4)
        counts.append(len(ex.k.programs))
    assert counts == [counts[0]] * 4, counts


def test_a_dense_layer_with_a_dynamic_batch_fuses_and_compiles_once(rng):
    b = _Builder(rng)
    h = b.node("Relu", [b.node("Add", [b.node("MatMul", ["x", b.init(rng.standard_normal((9, 13)))]),
                                       b.init(rng.standard_normal(13))])])
    y = b.node("Gemm", [h, b.init(rng.standard_normal((5, 13))), b.init(rng.standard_normal(5))], transB=1)
    model = b.model({"x": ["batch", 9]}, [y])
    ex = OnnxExecutor(model, "CPU")
    assert [n.op_type for n in ex.graph.node] == ["MorokDense", "MorokDense"]
    counts = []
    for n in (3, 7, 1, 7):
        x = random_array(rng, (n, 9), np.float32)
        np.testing.assert_allclose(ex.run({"x": x})[0], ReferenceEvaluator(model).run(None, {"x": x})[0],
                                   rtol=1e-4, atol=1e-4)
        counts.append(len(ex.k.programs))
    assert counts == [counts[0]] * 4, counts


def test_weights_whose_rows_would_alias_cache_sets_are_stored_padded(rng):
    assert K.padded_ldb(256) == 256 + K.LDB_PAD and K.padded_ldb(250) == 250
    b = _Builder(rng)
    y = b.node("Gemm", ["x", b.init(rng.standard_normal((256, 37)) * 0.3), b.init(rng.standard_normal(256))],
               transB=1)
    f = _check(b.model({"x": [13, 37]}, [y]), {"x": random_array(rng, (13, 37), np.float32)}, {"MorokDense": 1})
    w = next(t for t in f.graph.initializer if t.name.startswith("morok_fused/w"))
    assert list(w.dims) == [37, 256 + K.LDB_PAD]


def test_matmul_with_a_row_stride_matches_numpy_at_every_level(cpu_level, rng):
    M, N, Kd, ldb = 19, 40, 23, 53
    a, b = random_array(rng, (M, Kd), np.float32), random_array(rng, (Kd, ldb), np.float32)
    out = cpu_level.empty(M * N, dtypes.float32)
    cpu_level.compile(K.matmul(M, N, Kd, ldb=ldb), "mm_ldb")(cpu_level.buf(a), cpu_level.buf(b), out)
    np.testing.assert_allclose(out.numpy().reshape(M, N), a.astype(np.float64) @ b[:, :N], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("width", [8, 16, 64])
def test_column_panels_and_the_panel_matmul_match_numpy_at_every_level(cpu_level, rng, width):
    """B copied into column panels (`column_panels`, from a padded row stride) and `matmul_panels` over them with
    an epilogue: rows past the register tile's (37), an odd reduction (29), one panel and several, every output
    written (NaN-filled)."""
    epi = K.Epilogue([("bias",), ("add",), ("silu",)])
    for M, panels, Kd in ((37, 3, 29), (6, 1, 300)):
        N, ldb = panels * width, panels * width + 5
        a, b = random_array(rng, (M, Kd), np.float32), random_array(rng, (Kd, ldb), np.float32)
        bias, res = random_array(rng, (N,), np.float32), random_array(rng, (M, N), np.float32)
        packed = cpu_level.empty(Kd * N, dtypes.float32)
        cpu_level.compile(K.column_panels(Kd, N, width, ldb), f"panels_{width}_{N}")(cpu_level.buf(b), packed)
        want_panels = b[:, :N].reshape(Kd, panels, width).transpose(1, 0, 2)
        np.testing.assert_array_equal(packed.numpy().reshape(panels, Kd, width), want_panels)
        out = cpu_level.buf(np.full((M, N), np.nan, np.float32))
        cpu_level.compile(K.matmul_panels(M, N, Kd, width, epilogue=epi), f"mm_panels_{width}_{M}_{N}")(
            cpu_level.buf(a), packed, cpu_level.buf(bias), cpu_level.buf(res), out)
        v = a.astype(np.float64) @ b[:, :N] + bias + res
        np.testing.assert_allclose(out.numpy().reshape(M, N), v / (1 + np.exp(-v)), rtol=1e-4, atol=1e-4)


def test_column_panels_refuse_a_width_that_does_not_divide_the_columns():
    from morok_py import ArgumentError
    with pytest.raises(ArgumentError, match="does not divide 100"):
        K.column_panels(8, 100, 64)
    with pytest.raises(ArgumentError, match="does not divide 100"):
        K.matmul_panels(4, 100, 8, 64)


def test_dense_weights_take_column_panels_of_the_tile_width_where_they_fill_it(rng):
    """A dense layer whose rows fill the CPU's register tile and whose columns are whole tile widths (its copy within
    DENSE_PANELS_MAX_BYTES) runs on its weights copied once into column panels (the copy's program compiled once, its output kept across runs); a
    layer of fewer rows (a GEMV), or columns the width does not divide, reads them in place. Every output matches
    onnx's reference evaluator on every run."""
    from morok_py import Device
    from morok_py.onnx import fuse as F
    rows, width = Device["CPU"].renderer.caps.register_tile
    for M, N, panels in ((rows + 7, 3 * width, True), (rows - 1 if rows > 1 else 1, 2 * width, rows <= 1),
                         (rows + 7, 3 * width + 4, False)):
        b = _Builder(rng)
        y = b.node("Gemm", ["x", b.init(rng.standard_normal((N, 41)) * 0.3), b.init(rng.standard_normal(N))], transB=1)
        model = b.model({"x": [M, 41]}, [y])
        ex = OnnxExecutor(model, "CPU")
        for _ in range(3):
            x = random_array(rng, (M, 41), np.float32)
            np.testing.assert_allclose(ex.run({"x": x})[0], ReferenceEvaluator(model).run(None, {"x": x})[0],
                                       rtol=1e-4, atol=1e-4)
        copies = [k for k in ex.k.programs if N % width == 0 and k == K.column_panels(41, N, width, K.padded_ldb(N)).key]
        assert len(copies) == panels, (M, N, panels)
        if panels:
            kept = [per[copies[0]] for per in list(F._weights_outputs.values()) if copies[0] in per]
            assert len(kept) == 1 and kept[0].size == 41 * N      # one copy, kept for every run
            ctx = type("Ctx", (), {"k": ex.k})()
            assert F._panel_width(ctx, M, N, False, 41, 4) == width
            assert F._panel_width(ctx, M, N, True, 41, 4) == 0     # a dynamic batch: read in place
            # a copy past DENSE_PANELS_MAX_BYTES: read in place
            assert F._panel_width(ctx, M, N, False, F.DENSE_PANELS_MAX_BYTES // (4 * N) + 1, 4) == 0
