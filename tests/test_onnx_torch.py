"""Models exported from PyTorch (`torch.onnx.export`, opset 17, dynamic batch) and run through
morok_py.onnx.InferenceSession, against PyTorch's own outputs: a transformer encoder layer, a causal GPT
block with KV-cache inputs, a U-Net with ConvTranspose and Resize, an LSTM tagger and a GRU tagger.
Skipped where PyTorch is not installed (CI runs the same graphs built with onnx.helper in
tests/test_onnx_models.py)."""
from __future__ import annotations

import io
import os
import warnings

import numpy as np
import pytest

pytest.importorskip("onnx", reason="the onnx extra is not installed (pip install -e '.[onnx]')")
torch = pytest.importorskip("torch", reason="PyTorch is not installed: the exported-model tests need it")
nn = torch.nn

from morok_py.onnx import InferenceSession  # noqa: E402

DEVICE = os.environ.get("MOROK_ONNX_DEVICE", "CPU")
torch.manual_seed(0)


def export(model: nn.Module, args: tuple, inputs: list[str], outputs: list[str], dynamic: dict) -> bytes:
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), args, f, dynamo=False, opset_version=17, input_names=inputs,
                          output_names=outputs, dynamic_axes=dynamic)
    return f.getvalue()


def check(model: nn.Module, export_args: tuple, runs: list[tuple], inputs: list[str], outputs: list[str],
          dynamic: dict, rtol=1e-4, atol=1e-5) -> InferenceSession:
    sess = InferenceSession(export(model, export_args, inputs, outputs, dynamic), providers=[DEVICE])
    for args in runs:
        with torch.no_grad():
            want = model(*args)
        want = want if isinstance(want, tuple) else (want,)
        got = sess.run(None, {n: a.numpy() for n, a in zip(inputs, args)})
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w.numpy(), rtol=rtol, atol=atol)
    return sess


class Encoder(nn.Module):
    """nn.TransformerEncoderLayer called with is_causal given as a Python bool (the legacy exporter
    otherwise traces the default into a tensor that scaled_dot_product_attention refuses)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=12, dropout=0.0,
                                                batch_first=True)

    def forward(self, x):
        return self.layer(x, is_causal=False)


def test_transformer_encoder_layer():
    layer = Encoder()
    x = torch.randn(2, 5, 8)
    check(layer, (x,), [(x,), (torch.randn(3, 5, 8),)], ["x"], ["y"], {"x": {0: "batch"}, "y": {0: "batch"}})


class GPTBlock(nn.Module):
    """Pre-norm causal self-attention over a KV cache (past_key/past_value in, present out) and a GELU MLP."""

    def __init__(self, E=16, H=4):
        super().__init__()
        self.H, self.hd = H, E // H
        self.ln1, self.ln2 = nn.LayerNorm(E), nn.LayerNorm(E)
        self.qkv, self.proj = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.mlp = nn.Sequential(nn.Linear(E, 2 * E), nn.GELU(), nn.Linear(2 * E, E))

    def forward(self, x, past_key, past_value):
        B, S, E = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(E, dim=-1)
        q, k, v = (t.reshape(B, S, self.H, self.hd).transpose(1, 2) for t in (q, k, v))
        k = torch.cat([past_key, k], dim=2)
        v = torch.cat([past_value, v], dim=2)
        P = past_key.shape[2]
        s = q @ k.transpose(-2, -1) / self.hd ** 0.5
        i = torch.arange(S).unsqueeze(1)
        j = torch.arange(P + S).unsqueeze(0)
        s = s.masked_fill(j > i + P, float("-inf"))
        a = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, S, E)
        x = x + self.proj(a)
        return x + self.mlp(self.ln2(x)), k, v


def test_gpt_block_with_kv_cache():
    block = GPTBlock()
    x, pk, pv = torch.randn(2, 4, 16), torch.randn(2, 4, 3, 4), torch.randn(2, 4, 3, 4)
    dyn = {"x": {0: "batch", 1: "seq"}, "past_key": {0: "batch", 2: "past"}, "past_value": {0: "batch", 2: "past"},
           "y": {0: "batch", 1: "seq"}, "present_key": {0: "batch", 2: "total"},
           "present_value": {0: "batch", 2: "total"}}
    with torch.no_grad():
        _, k1, v1 = block(x, pk, pv)
    decode = (torch.randn(2, 1, 16), k1, v1)
    check(block, (x, pk, pv), [(x, pk, pv), decode], ["x", "past_key", "past_value"],
          ["y", "present_key", "present_value"], dyn)


class UNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU())
        self.down2 = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(6, 8, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(8, 6, 2, stride=2)
        self.fuse = nn.Sequential(nn.Conv2d(12, 6, 3, padding=1), nn.ReLU())
        self.resize = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.head = nn.Conv2d(6, 2, 1)

    def forward(self, x):
        c1 = self.down1(x)
        u = self.up(self.down2(c1))
        return self.head(self.resize(self.fuse(torch.cat([u, c1], 1))))


def test_unet_with_conv_transpose_and_resize():
    x = torch.randn(1, 3, 10, 14)
    check(UNet(), (x,), [(x,), (torch.randn(2, 3, 10, 14),)], ["x"], ["y"], {"x": {0: "batch"}, "y": {0: "batch"}},
          atol=1e-4)


class Tagger(nn.Module):
    def __init__(self, kind: str, V=11, E=6, H=5, T=4):
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.rnn = (nn.LSTM(E, H, batch_first=True, bidirectional=True) if kind == "LSTM"
                    else nn.GRU(E, H, batch_first=True))
        self.out = nn.Linear(H * (2 if kind == "LSTM" else 1), T)

    def forward(self, ids):
        y, _ = self.rnn(self.emb(ids))
        return self.out(y).log_softmax(-1)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_recurrent_tagger(kind):
    ids = torch.randint(0, 11, (2, 7))
    check(Tagger(kind), (ids,), [(ids,), (torch.randint(0, 11, (3, 4)),)], ["ids"], ["out"],
          {"ids": {0: "batch", 1: "seq"}, "out": {0: "batch", 1: "seq"}})
