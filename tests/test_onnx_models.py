"""The nine `light_*` CNNs shipped in the onnx wheel (onnx/backend/test/data/light), end to end through
morok_py.onnx, against their shipped `*_output_0.pb` with ONNX's model-test tolerances (rtol 1e-3,
atol 1e-7), fed the way ONNX's backend runner feeds them (generate_dummy_data: arange(n)/n).

Device: CPU by default, `MOROK_ONNX_DEVICE=CUDA` for a GPU (skips with the reason without one).
Each test prints its first-run (compile included) and replay times.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed (pip install -e '.[onnx]')")
from onnx import numpy_helper  # noqa: E402

from morok_py.onnx import OnnxExecutor  # noqa: E402
from morok_py.onnx.run import dummy_input  # noqa: E402

DEVICE = os.environ.get("MOROK_ONNX_DEVICE", "CPU")
LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
MODELS = ["bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet",
          "squeezenet", "vgg19", "zfnet512"]


@pytest.mark.parametrize("name", MODELS)
def test_light_model(name):
    from morok_py import DeviceUnavailableError
    from morok_py.registry import get_device
    try:
        dev = get_device(DEVICE)
    except DeviceUnavailableError as e:
        pytest.skip(f"{DEVICE} unavailable: {e}")
    path = LIGHT / f"light_{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path} is not in this onnx wheel ({onnx.__version__})")
    model = onnx.load(str(path))
    want = numpy_helper.to_array(onnx.load_tensor(str(LIGHT / f"light_{name}_output_0.pb")))
    ex = OnnxExecutor(model, dev)
    feeds = {vi.name: dummy_input(vi) for vi in model.graph.input if vi.name in ex.input_names}
    t0 = time.perf_counter()
    got = ex.run(feeds)[0]
    first = time.perf_counter() - t0
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-7)
    again = ex.run(feeds)[0]      # replayed through the recorded ExecutionPlan
    np.testing.assert_allclose(again, want, rtol=1e-3, atol=1e-7)
    print(f"\n{name} on {DEVICE}: first run {first:.2f} s (compile {ex.k.compile_s:.2f} s, "
          f"{len(ex.k.programs)} programs, {len(ex.k.stats)} launches), replay {ex.last_run_s * 1e3:.1f} ms")


# ---- models as PyTorch exports them -----------------------------------------------------------------
# Each graph below is built with onnx.helper in the shape torch.onnx.export gives it (and, for the GPT
# block, the opset-23 ops a modern export uses: RMSNormalization, RotaryEmbedding, Attention with a KV
# cache) and compared with a numpy reference; tests/test_onnx_torch.py exports the same models from
# PyTorch where it is installed. Tiny shapes: these run in CI on two slow cores.
from onnx import TensorProto, helper  # noqa: E402

from morok_py.onnx import InferenceSession  # noqa: E402

RNG = np.random.default_rng(2024)
F32 = TensorProto.FLOAT


def rand(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def make(nodes, inputs, outputs, inits: dict[str, np.ndarray], opset: int):
    g = helper.make_graph(nodes, "model", inputs, outputs,
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def session(model) -> InferenceSession:
    return InferenceSession(model.SerializeToString(), providers=[DEVICE])


def close(got, want, rtol=1e-4, atol=1e-5):
    np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=atol)


# numpy references -----------------------------------------------------------------------------------
def np_layernorm(x, g, b, eps=1e-5):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * g + b


def np_softmax(x, axis=-1):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def np_gelu(x):
    from math import erf, sqrt
    return x * 0.5 * (1 + np.vectorize(erf)(x / sqrt(2)))


def np_sigmoid(x):
    return 1 / (1 + np.exp(-x))


def np_conv2d(x, w, b, pad):
    N, C, H, W = x.shape
    O, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    Ho, Wo = H + 2 * pad - kh + 1, W + 2 * pad - kw + 1
    y = np.zeros((N, O, Ho, Wo), np.float64)
    for i in range(kh):
        for j in range(kw):
            y += np.einsum("nchw,oc->nohw", xp[:, :, i:i + Ho, j:j + Wo], w[:, :, i, j])
    return y + b[None, :, None, None]


def np_conv_transpose2x2(x, w, b):
    """Kernel 2, stride 2: each input pixel writes its own 2x2 block."""
    N, C, H, W = x.shape
    y = np.einsum("nchw,cmij->nmhiwj", x, w).reshape(N, w.shape[1], 2 * H, 2 * W)
    return y + b[None, :, None, None]


def np_upsample_bilinear2(x):
    """Resize scale 2, linear, pytorch_half_pixel (nn.Upsample(mode='bilinear', align_corners=False))."""
    def axis(a, ax):
        n = a.shape[ax]
        src = np.clip((np.arange(2 * n) + 0.5) / 2 - 0.5, 0, None)
        lo = np.floor(src).astype(int)
        hi = np.minimum(lo + 1, n - 1)
        f = src - lo
        shape = [1] * a.ndim
        shape[ax] = 2 * n
        return np.take(a, lo, ax) * (1 - f).reshape(shape) + np.take(a, hi, ax) * f.reshape(shape)
    return axis(axis(x, 2), 3)


# a transformer encoder layer (post-norm, as nn.TransformerEncoderLayer(batch_first=True) exports) -------
def encoder_model(E=8, NH=2, FF=12):
    hd = E // NH
    w = {"Wqkv": rand(E, 3 * E, scale=0.4), "bqkv": rand(3 * E, scale=0.1), "Wo": rand(E, E, scale=0.4),
         "bo": rand(E, scale=0.1), "g1": 1 + rand(E, scale=0.1), "b1": rand(E, scale=0.1),
         "W1": rand(E, FF, scale=0.4), "c1": rand(FF, scale=0.1), "W2": rand(FF, E, scale=0.4),
         "c2": rand(E, scale=0.1), "g2": 1 + rand(E, scale=0.1), "b2": rand(E, scale=0.1),
         "split": np.array([E, E, E], np.int64), "heads": np.array([0, 0, NH, hd], np.int64),
         "merge": np.array([0, 0, E], np.int64), "scale": np.array(1 / np.sqrt(hd), np.float32),
         "sqrt2": np.array(np.sqrt(2), np.float32), "one": np.array(1, np.float32),
         "half": np.array(0.5, np.float32)}
    n = helper.make_node
    nodes = [
        n("MatMul", ["x", "Wqkv"], ["qkv0"]), n("Add", ["qkv0", "bqkv"], ["qkv"]),
        n("Split", ["qkv", "split"], ["q0", "k0", "v0"], axis=-1),
        *[n("Reshape", [f"{t}0", "heads"], [f"{t}1"]) for t in "qkv"],
        n("Transpose", ["q1"], ["q"], perm=[0, 2, 1, 3]), n("Transpose", ["k1"], ["kT"], perm=[0, 2, 3, 1]),
        n("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]),
        n("MatMul", ["q", "kT"], ["s0"]), n("Mul", ["s0", "scale"], ["s"]), n("Softmax", ["s"], ["p"], axis=-1),
        n("MatMul", ["p", "v"], ["a0"]), n("Transpose", ["a0"], ["a1"], perm=[0, 2, 1, 3]),
        n("Reshape", ["a1", "merge"], ["a"]), n("MatMul", ["a", "Wo"], ["o0"]), n("Add", ["o0", "bo"], ["o"]),
        n("Add", ["x", "o"], ["r1"]), n("LayerNormalization", ["r1", "g1", "b1"], ["h1"], axis=-1, epsilon=1e-5),
        n("MatMul", ["h1", "W1"], ["f0"]), n("Add", ["f0", "c1"], ["f1"]),
        # GELU as the opset-17 export spells it: x * 0.5 * (1 + erf(x / sqrt 2))
        n("Div", ["f1", "sqrt2"], ["f2"]), n("Erf", ["f2"], ["f3"]), n("Add", ["f3", "one"], ["f4"]),
        n("Mul", ["f1", "f4"], ["f5"]), n("Mul", ["f5", "half"], ["f6"]),
        n("MatMul", ["f6", "W2"], ["f7"]), n("Add", ["f7", "c2"], ["f8"]),
        n("Add", ["h1", "f8"], ["r2"]), n("LayerNormalization", ["r2", "g2", "b2"], ["y"], axis=-1, epsilon=1e-5),
    ]
    model = make(nodes, [helper.make_tensor_value_info("x", F32, ["batch", "seq", E])],
                 [helper.make_tensor_value_info("y", F32, ["batch", "seq", E])], w, 17)

    def ref(x):
        B, S, _ = x.shape
        qkv = x @ w["Wqkv"] + w["bqkv"]
        q, k, v = (qkv[..., i * E:(i + 1) * E].reshape(B, S, NH, hd).transpose(0, 2, 1, 3) for i in range(3))
        p = np_softmax(q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd))
        a = (p @ v).transpose(0, 2, 1, 3).reshape(B, S, E)
        h1 = np_layernorm(x + a @ w["Wo"] + w["bo"], w["g1"], w["b1"])
        f = np_gelu(h1 @ w["W1"] + w["c1"]) @ w["W2"] + w["c2"]
        return np_layernorm(h1 + f, w["g2"], w["b2"])
    return model, ref


def test_transformer_encoder_layer():
    """Two batch sizes; the batch is every kernel's outermost range, so the second compiles nothing."""
    model, ref = encoder_model()
    sess = session(model)
    programs = []
    for batch, seq in ((2, 5), (3, 5)):
        x = rand(batch, seq, 8)
        close(sess.run(None, {"x": x})[0], ref(x.astype(np.float64)))
        programs.append(len(sess.executor.k.programs))
    assert programs[0] == programs[1], f"programs after each batch size: {programs}"


# a causal GPT block (Llama-style) with a KV cache: RMSNormalization, RotaryEmbedding, grouped-query
# Attention taking past_key/past_value and returning the present ones, a SwiGLU MLP -------------------
def gpt_model(E=16, H=4, KVH=2, FF=24, MAXPOS=32):
    hd = E // H
    inv = 1.0 / (10000 ** (np.arange(0, hd, 2) / hd))
    ang = np.arange(MAXPOS)[:, None] * inv[None, :]
    w = {"g1": 1 + rand(E, scale=0.1), "Wq": rand(E, H * hd, scale=0.3), "Wk": rand(E, KVH * hd, scale=0.3),
         "Wv": rand(E, KVH * hd, scale=0.3), "Wo": rand(H * hd, E, scale=0.3), "g2": 1 + rand(E, scale=0.1),
         "Wg": rand(E, FF, scale=0.3), "Wu": rand(E, FF, scale=0.3), "Wd": rand(FF, E, scale=0.3),
         "cos": np.cos(ang).astype(np.float32), "sin": np.sin(ang).astype(np.float32)}
    n = helper.make_node
    nodes = [
        n("RMSNormalization", ["x", "g1"], ["h"], axis=-1, epsilon=1e-5),
        n("MatMul", ["h", "Wq"], ["q"]), n("MatMul", ["h", "Wk"], ["k"]), n("MatMul", ["h", "Wv"], ["v"]),
        n("RotaryEmbedding", ["q", "cos", "sin", "pos"], ["qr"], num_heads=H),
        n("RotaryEmbedding", ["k", "cos", "sin", "pos"], ["kr"], num_heads=KVH),
        n("Attention", ["qr", "kr", "v", "", "past_key", "past_value"], ["a", "present_key", "present_value"],
          is_causal=1, q_num_heads=H, kv_num_heads=KVH),
        n("MatMul", ["a", "Wo"], ["o"]), n("Add", ["x", "o"], ["x2"]),
        n("RMSNormalization", ["x2", "g2"], ["h2"], axis=-1, epsilon=1e-5),
        n("MatMul", ["h2", "Wg"], ["gt"]), n("Sigmoid", ["gt"], ["sg"]), n("Mul", ["gt", "sg"], ["silu"]),
        n("MatMul", ["h2", "Wu"], ["up"]), n("Mul", ["silu", "up"], ["m"]), n("MatMul", ["m", "Wd"], ["d"]),
        n("Add", ["x2", "d"], ["y"]),
    ]
    kv = ["batch", KVH, "past", hd]
    model = make(nodes, [helper.make_tensor_value_info("x", F32, ["batch", "seq", E]),
                         helper.make_tensor_value_info("pos", TensorProto.INT64, ["batch", "seq"]),
                         helper.make_tensor_value_info("past_key", F32, kv),
                         helper.make_tensor_value_info("past_value", F32, kv)],
                 [helper.make_tensor_value_info("y", F32, ["batch", "seq", E]),
                  helper.make_tensor_value_info("present_key", F32, ["batch", KVH, "total", hd]),
                  helper.make_tensor_value_info("present_value", F32, ["batch", KVH, "total", hd])], w, 23)

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g

    def rope(x, pos, nh):          # x (B, S, nh*hd), half-split (not interleaved)
        B, S, _ = x.shape
        x = x.reshape(B, S, nh, hd)
        c, s = w["cos"][pos][:, :, None, :], w["sin"][pos][:, :, None, :]
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], -1)          # B, S, nh, hd

    def ref(x, pos, pk, pv):
        B, S, _ = x.shape
        h = rms(x, w["g1"])
        q = rope(h @ w["Wq"], pos, H).transpose(0, 2, 1, 3)
        k = rope(h @ w["Wk"], pos, KVH).transpose(0, 2, 1, 3)
        v = (h @ w["Wv"]).reshape(B, S, KVH, hd).transpose(0, 2, 1, 3)
        K, V = np.concatenate([pk, k], 2), np.concatenate([pv, v], 2)
        P = pk.shape[2]
        rep = H // KVH
        Kh, Vh = np.repeat(K, rep, axis=1), np.repeat(V, rep, axis=1)
        s = q @ Kh.transpose(0, 1, 3, 2) / np.sqrt(hd)
        allowed = np.arange(P + S)[None, :] <= (np.arange(S)[:, None] + P)
        s = np.where(allowed, s, -np.inf)
        a = (np_softmax(s) @ Vh).transpose(0, 2, 1, 3).reshape(B, S, H * hd)
        x2 = x + a @ w["Wo"]
        h2 = rms(x2, w["g2"])
        g = h2 @ w["Wg"]
        return x2 + (g * np_sigmoid(g) * (h2 @ w["Wu"])) @ w["Wd"], K, V
    return model, ref


def test_gpt_block_with_kv_cache():
    """A prefill over a 3-token cache, then decode steps, each fed the previous present_key/value; the
    cache's length is a launch variable, so decode steps after the first compile nothing."""
    model, ref = gpt_model()
    sess = session(model)
    assert [i.name for i in sess.get_inputs()] == ["x", "pos", "past_key", "past_value"]
    B, P, S = 2, 3, 4
    pk, pv = rand(B, 2, P, 4), rand(B, 2, P, 4)
    x = rand(B, S, 16)
    pos = np.tile(np.arange(P, P + S), (B, 1)).astype(np.int64)
    programs = []
    for step in range(4):
        y, k, v = sess.run(None, {"x": x, "pos": pos, "past_key": pk, "past_value": pv})
        programs.append(len(sess.executor.k.programs))
        ry, rk, rv = ref(x.astype(np.float64), pos, pk.astype(np.float64), pv.astype(np.float64))
        close(y, ry)
        close(k, rk)
        close(v, rv)
        pk, pv = k, v
        x = rand(B, 1, 16)
        pos = np.full((B, 1), pk.shape[2], np.int64)
    assert programs[1] == programs[2] == programs[3], f"programs after each step: {programs}"


# a small U-Net: convolutions, max pooling, a transposed convolution up, a skip Concat, a bilinear Resize -
def unet_model():
    w = {"W1": rand(6, 3, 3, 3, scale=0.3), "b1": rand(6, scale=0.1), "W2": rand(8, 6, 3, 3, scale=0.3),
         "b2": rand(8, scale=0.1), "Wt": rand(8, 6, 2, 2, scale=0.3), "bt": rand(6, scale=0.1),
         "W3": rand(6, 12, 3, 3, scale=0.3), "b3": rand(6, scale=0.1), "W4": rand(2, 6, 1, 1, scale=0.3),
         "b4": rand(2, scale=0.1), "scales": np.array([1, 1, 2, 2], np.float32)}
    n = helper.make_node
    nodes = [
        n("Conv", ["x", "W1", "b1"], ["c1a"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]), n("Relu", ["c1a"], ["c1"]),
        n("MaxPool", ["c1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        n("Conv", ["p1", "W2", "b2"], ["c2a"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]), n("Relu", ["c2a"], ["c2"]),
        n("ConvTranspose", ["c2", "Wt", "bt"], ["u1"], kernel_shape=[2, 2], strides=[2, 2]),
        n("Concat", ["u1", "c1"], ["cat"], axis=1),
        n("Conv", ["cat", "W3", "b3"], ["c3a"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]), n("Relu", ["c3a"], ["c3"]),
        n("Resize", ["c3", "", "scales"], ["r"], mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
        n("Conv", ["r", "W4", "b4"], ["y"], kernel_shape=[1, 1]),
    ]
    model = make(nodes, [helper.make_tensor_value_info("x", F32, ["batch", 3, 10, 14])],
                 [helper.make_tensor_value_info("y", F32, ["batch", 2, 20, 28])], w, 17)

    def ref(x):
        relu = lambda t: np.maximum(t, 0)  # noqa: E731
        c1 = relu(np_conv2d(x, w["W1"], w["b1"], 1))
        N, C, H, W = c1.shape
        p1 = c1.reshape(N, C, H // 2, 2, W // 2, 2).max((3, 5))
        c2 = relu(np_conv2d(p1, w["W2"], w["b2"], 1))
        u1 = np_conv_transpose2x2(c2, w["Wt"], w["bt"])
        c3 = relu(np_conv2d(np.concatenate([u1, c1], 1), w["W3"], w["b3"], 1))
        return np_conv2d(np_upsample_bilinear2(c3), w["W4"], w["b4"], 0)
    return model, ref


def test_unet_with_conv_transpose_and_resize():
    model, ref = unet_model()
    sess = session(model)
    programs = []
    for batch in (2, 3, 1):       # a batch of 1 compiles its own kernels (its extent-1 dims are broadcasts)
        x = rand(batch, 3, 10, 14)
        close(sess.run(["y"], {"x": x})[0], ref(x.astype(np.float64)), rtol=1e-4, atol=1e-4)
        programs.append(len(sess.executor.k.programs))
    assert programs[0] == programs[1], f"programs after each batch size: {programs}"


# taggers: token ids -> embedding -> a bidirectional LSTM / a GRU -> per-token log-probabilities --------
def tagger_model(kind: str, V=11, E=6, H=5, T=4):
    D = 2 if kind == "LSTM" else 1
    G = 4 if kind == "LSTM" else 3
    w = {"emb": rand(V, E), "W": rand(D, G * H, E, scale=0.4), "R": rand(D, G * H, H, scale=0.4),
         "B": rand(D, 2 * G * H, scale=0.2), "Wout": rand(D * H, T, scale=0.4), "bout": rand(T, scale=0.1),
         "shape": np.array([0, 0, -1], np.int64)}
    n = helper.make_node
    rnn = (n("LSTM", ["xs", "W", "R", "B"], ["Y", "", ""], hidden_size=H, direction="bidirectional")
           if kind == "LSTM" else
           n("GRU", ["xs", "W", "R", "B"], ["Y", ""], hidden_size=H, linear_before_reset=1))
    nodes = [n("Gather", ["emb", "ids"], ["e"]), n("Transpose", ["e"], ["xs"], perm=[1, 0, 2]), rnn,
             n("Transpose", ["Y"], ["yt"], perm=[2, 0, 1, 3]), n("Reshape", ["yt", "shape"], ["feat"]),
             n("MatMul", ["feat", "Wout"], ["l0"]), n("Add", ["l0", "bout"], ["logits"]),
             n("LogSoftmax", ["logits"], ["out"], axis=-1)]
    model = make(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
                 [helper.make_tensor_value_info("out", F32, ["batch", "seq", T])], w, 17)

    def lstm_dir(x, d, reverse):
        S, B, _ = x.shape
        h, c = np.zeros((B, H)), np.zeros((B, H))
        Wb, Rb = w["B"][d, :G * H], w["B"][d, G * H:]
        out = np.zeros((S, B, H))
        for t in (range(S - 1, -1, -1) if reverse else range(S)):
            g = x[t] @ w["W"][d].T + h @ w["R"][d].T + Wb + Rb
            i, o, f, cc = (g[:, k * H:(k + 1) * H] for k in range(4))
            c = np_sigmoid(f) * c + np_sigmoid(i) * np.tanh(cc)
            h = np_sigmoid(o) * np.tanh(c)
            out[t] = h
        return out

    def gru(x):
        S, B, _ = x.shape
        h = np.zeros((B, H))
        Wb, Rb = w["B"][0, :G * H], w["B"][0, G * H:]
        out = np.zeros((S, B, H))
        for t in range(S):
            xw = x[t] @ w["W"][0].T + Wb
            hr = h @ w["R"][0].T + Rb
            z = np_sigmoid(xw[:, :H] + hr[:, :H])
            r = np_sigmoid(xw[:, H:2 * H] + hr[:, H:2 * H])
            hh = np.tanh(xw[:, 2 * H:] + r * hr[:, 2 * H:])
            h = (1 - z) * hh + z * h
            out[t] = h
        return out

    def ref(ids):
        x = w["emb"][ids].transpose(1, 0, 2).astype(np.float64)
        ys = [lstm_dir(x, 0, False), lstm_dir(x, 1, True)] if kind == "LSTM" else [gru(x)]
        feat = np.stack(ys, 2).transpose(1, 0, 2, 3).reshape(ids.shape[0], ids.shape[1], -1)
        logits = feat @ w["Wout"] + w["bout"]
        return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
    return model, ref


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_recurrent_tagger(kind):
    model, ref = tagger_model(kind)
    sess = session(model)
    for batch, seq in ((2, 7), (3, 4), (2, 7)):       # the third replays the first's recorded launches
        ids = RNG.integers(0, 11, size=(batch, seq)).astype(np.int64)
        close(sess.run(None, {"ids": ids})[0], ref(ids))
