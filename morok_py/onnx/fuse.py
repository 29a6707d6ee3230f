"""Fusion at load: the graph rewritten so that fewer, larger kernels run, using the library's epilogues.

`fuse(model)` returns a new model in which
  - a BatchNormalization (inference) after a Conv is folded into the convolution's weights and bias;
  - a 2-D Conv with constant weights becomes `MorokConv`, a Gemm / MatMul with a constant right-hand
    matrix `MorokDense` (weights stored [K, N], alpha and beta folded), each computing its elementwise
    successors as an epilogue (kernels.Epilogue): bias, residual Add / Mul, Relu, Clip, HardSwish,
    HardSigmoid, Sigmoid, SiLU (x * Sigmoid(x)), Tanh, Gelu, LeakyRelu, scalar Mul / Add;
  - a BatchNormalization elsewhere becomes `MorokAffine` (x * scale[c] + shift[c]) with its successors;
  - any other run of two or more elementwise nodes becomes one `MorokElementwise` kernel;
  - 2-D MaxPool / AveragePool and global pooling become `MorokPool2d` / `MorokGlobalPool`;
  - a MorokConv of one group whose output only convolutions of this kind (as their input or residual operand)
    and global pooling read is marked `channels_last` (`_mark_channels_last`): on the CPU it then runs as a
    channels-last contraction (kernels_nhwc.py) and hands on its output stored [N, H, W, C], so a chain of
    such layers (a ResNet's bottlenecks) never turns its activations around.
The fused ops run the kernels of morok_py.kernels (convolutions as codegen/strategies/conv.py plans
them; MOROK_DEBUG=1 prints each node's plan and epilogue). A fused node takes the place of the last
node it absorbs, so a residual operand computed later in the original order is ready.
"""
from __future__ import annotations

import collections
import json
import math
import threading
import time
import weakref
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from morok_py import config, kernels as K, kernels_nhwc as KN
from morok_py.buffer import Buffer
from morok_py.codegen.capabilities import Capabilities
from morok_py.codegen.schedule import conv_plan, search_plan
from morok_py.codegen.strategies.conv import (ConvGeometry, channels_last_candidates, channels_last_plan,
                                             channels_last_runs)
from morok_py.dtypes import dtypes

from morok_py.onnx.errors import OnnxError
from morok_py.onnx.ops.registry import OPS
from morok_py.onnx.tensor import View, copy as copy_view

FUSED = ("MorokConv", "MorokDense", "MorokAffine", "MorokElementwise", "MorokPool2d", "MorokGlobalPool")
# unary ops an epilogue absorbs: op -> step built from the node's attributes
_UNARY = {
    "Relu": lambda a: ("relu",),
    "Sigmoid": lambda a: ("sigmoid",),
    "Tanh": lambda a: ("tanh",),
    "HardSwish": lambda a: ("hardswish",),
    "HardSigmoid": lambda a: ("hardsigmoid", a.get("alpha", 0.2), a.get("beta", 0.5)),
    "LeakyRelu": lambda a: ("leakyrelu", a.get("alpha", 0.01)),
}


def _attrs(node) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


class _Graph:
    """The model's nodes with producer / consumer maps, constant initializers and inferred shapes."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        g = model.graph
        self.nodes: list[Any] = list(g.node)
        self.inits = {i.name: i for i in g.initializer}
        self.outputs = {o.name for o in g.output}
        try:
            inferred = onnx.shape_inference.infer_shapes(model).graph
        except Exception:       # a model onnx cannot infer: fusion then leaves shape-dependent steps alone
            inferred = g
        self.shapes: dict[str, tuple] = {}     # static shapes
        self.ranks: dict[str, int] = {}        # ranks, also of shapes with symbolic dimensions
        self.types: dict[str, int] = {}
        for vi in list(inferred.value_info) + list(inferred.input) + list(inferred.output):
            tt = vi.type.tensor_type
            if vi.type.HasField("tensor_type"):
                self.types[vi.name] = tt.elem_type
                if tt.HasField("shape"):
                    self.ranks[vi.name] = len(tt.shape.dim)
                if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
                    self.shapes[vi.name] = tuple(d.dim_value for d in tt.shape.dim)
        for name, t in self.inits.items():
            self.shapes[name] = tuple(t.dims)
            self.ranks[name] = len(t.dims)
            self.types[name] = t.data_type
        self.consumers: dict[str, list[int]] = {}
        for i, n in enumerate(self.nodes):
            for x in n.input:
                if x:
                    self.consumers.setdefault(x, []).append(i)
        self.dead: set[int] = set()
        self.new: dict[str, np.ndarray] = {}    # constants this pass made (folded, fused weights)
        self._count = 0

    def const(self, name: str) -> np.ndarray | None:
        if name in self.new:
            return self.new[name]
        t = self.inits.get(name)
        return None if t is None else numpy_helper.to_array(t)

    def is_const(self, name: str) -> bool:
        return name in self.new or name in self.inits

    def set_const(self, name: str, arr: np.ndarray) -> None:
        arr = np.require(arr, requirements="C")     # ascontiguousarray would make a scalar shape (1,)
        self.new[name] = arr
        self.shapes[name] = tuple(arr.shape)
        self.types[name] = helper.np_dtype_to_tensor_dtype(arr.dtype)

    def users(self, name: str) -> list[int]:
        return [i for i in self.consumers.get(name, []) if i not in self.dead]

    def sole_user(self, name: str) -> int | None:
        """The index of the one node reading `name`, when it is the only reader and no graph output."""
        u = self.users(name)
        return u[0] if len(u) == 1 and name not in self.outputs else None

    def add_init(self, arr: np.ndarray, hint: str) -> str:
        self._count += 1
        name = f"morok_fused/{hint}/{self._count}"
        self.set_const(name, arr)
        return name

    def is_float32(self, name: str) -> bool:
        return self.types.get(name) == onnx.TensorProto.FLOAT


def _fold_constants(g: _Graph) -> None:
    """Constant and ConstantOfShape (of a constant shape) nodes become initializers, so the weights some
    exporters compute that way (the onnx wheel's light models) fold and fuse like stored ones."""
    for i, n in enumerate(g.nodes):
        if n.op_type not in ("Constant", "ConstantOfShape", "Unsqueeze", "Reshape") or len(n.output) != 1:
            continue
        a = _attrs(n)
        if n.op_type in ("Unsqueeze", "Reshape"):
            src = g.const(n.input[0])
            arg = g.const(n.input[1]) if len(n.input) > 1 and n.input[1] else None
            if src is None or (len(n.input) > 1 and n.input[1] and arg is None):
                continue
            if n.op_type == "Unsqueeze":
                axes = [int(v) for v in (arg.reshape(-1) if arg is not None else a.get("axes", []))]
                nd = src.ndim + len(axes)
                axes_set = {ax % nd for ax in axes}
                it = iter(src.shape)
                arr = src.reshape([1 if d in axes_set else next(it) for d in range(nd)])
            else:
                if arg is None or a.get("allowzero", 0) or -1 in arg:
                    continue
                arr = src.reshape([src.shape[k] if v == 0 else int(v) for k, v in enumerate(arg.reshape(-1))])
        elif n.op_type == "Constant":
            if "value" not in a:
                continue
            arr = numpy_helper.to_array(a["value"])
        else:
            shape = g.const(n.input[0]) if n.input else np.zeros(0, np.int64)
            if shape is None:
                continue
            fill = numpy_helper.to_array(a["value"]) if "value" in a else np.zeros(1, np.float32)
            arr = np.full([int(d) for d in shape.reshape(-1)], fill.reshape(-1)[0], fill.dtype)
        g.set_const(n.output[0], arr)
        g.dead.add(i)


def _scalar(arr: np.ndarray | None) -> float | None:
    return float(arr.reshape(-1)[0]) if arr is not None and arr.size == 1 else None


def _absorb(g: _Graph, out: str, shape: tuple | None, channels: int, channel_axis: int,
            bias: np.ndarray | None, steps: list, operands: list[str]):
    """Absorb the elementwise successors of `out` into `steps` (in place); returns the last output,
    the index of the last absorbed node (-1: none), the bias and the per-channel multiplier of the
    producer's output (constant per-channel Mul and Add before any step are folded; None: none)."""
    last, mult = -1, None
    while True:
        i = g.sole_user(out)
        if i is None:
            users = g.users(out)
            if len(users) == 2 and out not in g.outputs:          # x * Sigmoid(x)
                a, b = (g.nodes[u] for u in users)
                sig, mul = (a, b) if a.op_type == "Sigmoid" else (b, a)
                if (sig.op_type == "Sigmoid" and mul.op_type == "Mul" and set(mul.input) == {out, sig.output[0]}
                        and g.sole_user(sig.output[0]) is not None):
                    steps.append(("silu",))
                    g.dead.update(users)
                    out, last = mul.output[0], max(users)
                    continue
            return out, last, bias, mult
        n = g.nodes[i]
        a = _attrs(n)
        if n.op_type in _UNARY:
            steps.append(_UNARY[n.op_type](a))
        elif n.op_type == "Gelu" and a.get("approximate", b"none") in (b"none", "none"):
            steps.append(("gelu",))
        elif n.op_type == "Clip":
            lo = _scalar(g.const(n.input[1])) if len(n.input) > 1 and n.input[1] else a.get("min", -math.inf)
            hi = _scalar(g.const(n.input[2])) if len(n.input) > 2 and n.input[2] else a.get("max", math.inf)
            if lo is None or hi is None or (len(n.input) > 1 and n.input[1] and not g.is_const(n.input[1])) or \
                    (len(n.input) > 2 and n.input[2] and not g.is_const(n.input[2])):
                return out, last, bias, mult
            steps.append(("clip", lo, hi))
        elif n.op_type in ("Add", "Mul", "Sum") and len(n.input) == 2:
            other = n.input[1] if n.input[0] == out else n.input[0]
            if other == out:
                return out, last, bias, mult
            c = g.const(other)
            if c is not None and c.size == 1:
                steps.append(("scale" if n.op_type == "Mul" else "shift", float(c.reshape(-1)[0])))
            elif (c is not None and not steps and shape is not None
                  and _per_channel(c.shape, len(shape), channel_axis, channels)):
                cc = c.reshape(-1).astype(np.float64)
                if n.op_type == "Mul":
                    mult = cc if mult is None else mult * cc
                    bias = bias * cc if bias is not None else None
                else:
                    bias = (bias if bias is not None else 0) + cc
            elif (c is None and shape is not None and g.shapes.get(other) == shape and g.is_float32(other)
                  and g.shapes.get(n.output[0]) == shape):
                steps.append(("mul",) if n.op_type == "Mul" else ("add",))
                operands.append(other)
            else:
                return out, last, bias, mult
        else:
            return out, last, bias, mult
        g.dead.add(i)
        out, last = n.output[0], i


def _per_channel(cshape: tuple, rank: int, axis: int, channels: int) -> bool:
    """A constant that broadcasts as one value per channel along `axis` of a rank-`rank` tensor."""
    if len(cshape) > rank or int(np.prod(cshape)) != channels:
        return False
    full = (1,) * (rank - len(cshape)) + tuple(cshape)
    return all(d == (channels if k == axis else 1) for k, d in enumerate(full))


def _fold_bn(g: _Graph, bn, W: np.ndarray, b: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
    """Weights and bias of a convolution followed by inference BatchNormalization `bn`."""
    a = _attrs(bn)
    if a.get("training_mode", 0) or any(o for o in bn.output[1:]):
        return None
    params = [g.const(x) for x in bn.input[1:5]]
    if any(p is None for p in params):
        return None
    scale, shift, mean, var = (p.astype(np.float64) for p in params)
    s = scale / np.sqrt(var + a.get("epsilon", 1e-5))
    b0 = b.astype(np.float64) if b is not None else 0.0
    return (W.astype(np.float64) * s.reshape(-1, *([1] * (W.ndim - 1)))), (b0 - mean) * s + shift


def _emit(g: _Graph, at: int, op_type: str, inputs: list[str], output: str, name: str, **attrs) -> None:
    node = helper.make_node(op_type, inputs, [output], name=name, **attrs)
    g.nodes[at] = node
    g.dead.discard(at)


def _fuse_conv(g: _Graph, i: int) -> None:
    n = g.nodes[i]
    if len(n.input) < 2 or not g.is_float32(n.input[0]):
        return
    W, b = g.const(n.input[1]), (g.const(n.input[2]) if len(n.input) > 2 and n.input[2] else None)
    if W is None or W.ndim != 4 or W.dtype != np.float32 or (len(n.input) > 2 and n.input[2] and b is None):
        return
    out = n.output[0]
    u = g.sole_user(out)
    last = i
    if u is not None and g.nodes[u].op_type == "BatchNormalization":
        folded = _fold_bn(g, g.nodes[u], W, b)
        if folded is not None:
            W, b = folded
            g.dead.add(u)
            out, last = g.nodes[u].output[0], u
    steps: list = []
    operands: list[str] = []
    shape = g.shapes.get(out)
    out, absorbed, b, mult = _absorb(g, out, shape, W.shape[0], 1, b, steps, operands)
    last = max(last, absorbed)
    if mult is not None:
        W = W.astype(np.float64) * mult.reshape(-1, 1, 1, 1)
    a = _attrs(n)
    ins = [n.input[0], g.add_init(W.astype(np.float32), "w")]
    if b is not None:
        ins.append(g.add_init(np.asarray(b, np.float32).reshape(-1), "b"))
        steps.insert(0, ("bias",))
    keep = {k: v for k, v in a.items() if k in ("kernel_shape", "strides", "dilations", "pads", "group", "auto_pad")}
    g.dead.add(i)
    _emit(g, last, "MorokConv", ins + operands, out, n.name or f"Conv_{i}", epilogue=json.dumps(steps), **keep)


def _fuse_dense(g: _Graph, i: int) -> None:
    n = g.nodes[i]
    a = _attrs(n)
    if not g.is_float32(n.input[0]) or a.get("transA", 0):
        return
    B = g.const(n.input[1])
    if B is None or B.ndim != 2 or B.dtype != np.float32:
        return
    rank = g.ranks.get(n.input[0])     # the rows may be a dynamic batch: only the rank must be known
    if n.op_type == "MatMul":
        if rank is None or rank < 2:
            return
        Bkn, bias = B.astype(np.float64), None
    else:
        if rank != 2:
            return
        Bkn = (B.T if a.get("transB", 0) else B).astype(np.float64) * a.get("alpha", 1.0)
        bias = None
        if len(n.input) > 2 and n.input[2]:
            C = g.const(n.input[2])
            if C is None or not (C.size == 1 or _per_channel(C.shape, 2, 1, Bkn.shape[1])):
                return
            bias = np.broadcast_to(C.astype(np.float64).reshape(-1), (Bkn.shape[1],)) * a.get("beta", 1.0)
    out = n.output[0]
    steps: list = []
    operands: list[str] = []
    shape = g.shapes.get(out) or (None,) * rank     # unknown dimensions: no tensor operand matches it
    out, absorbed, bias, mult = _absorb(g, out, shape, Bkn.shape[1], rank - 1, bias, steps, operands)
    if mult is not None:
        Bkn = Bkn * mult.reshape(1, -1)
    columns = Bkn.shape[1]
    ldb = K.padded_ldb(columns)
    if ldb != columns:          # rows stored longer: no cache-set aliasing, no packing copy (kernels.padded_ldb)
        Bkn = np.concatenate([Bkn, np.zeros((Bkn.shape[0], ldb - columns))], axis=1)
    ins = [n.input[0], g.add_init(Bkn.astype(np.float32), "w")]
    if bias is not None:
        ins.append(g.add_init(np.asarray(bias, np.float32).reshape(-1), "b"))
        steps.insert(0, ("bias",))
    g.dead.add(i)
    _emit(g, max(i, absorbed), "MorokDense", ins + operands, out, n.name or f"{n.op_type}_{i}", epilogue=json.dumps(steps),
          columns=columns)


def _fuse_affine(g: _Graph, i: int) -> None:
    """An inference BatchNormalization (not after a convolution) as x * scale[c] + shift[c] with its successors."""
    n = g.nodes[i]
    shape = g.shapes.get(n.input[0])
    if not g.is_float32(n.input[0]) or shape is None or len(shape) < 2:
        return
    a = _attrs(n)
    if a.get("training_mode", 0) or any(o for o in n.output[1:]):
        return
    params = [g.const(x) for x in n.input[1:5]]
    if any(p is None for p in params):
        return
    scale, shift, mean, var = (p.astype(np.float64) for p in params)
    s = scale / np.sqrt(var + a.get("epsilon", 1e-5))
    t = shift - mean * s
    steps: list = []
    operands: list[str] = []
    out, absorbed, t, mult = _absorb(g, n.output[0], g.shapes.get(n.output[0]), shape[1], 1, t, steps, operands)
    if mult is not None:
        s = s * mult
    g.dead.add(i)
    ins = [n.input[0], g.add_init(s.astype(np.float32), "scale"), g.add_init(t.astype(np.float32), "shift")]
    _emit(g, max(i, absorbed), "MorokAffine", ins + operands, out, n.name or f"BatchNormalization_{i}", epilogue=json.dumps(steps))


def _first_step(g: _Graph, n, shape: tuple) -> tuple | None:
    """The epilogue step of a lone elementwise node on a tensor of `shape` and its operand (or None)."""
    a = _attrs(n)
    if n.op_type in _UNARY:
        return _UNARY[n.op_type](a), None
    if n.op_type == "Gelu" and a.get("approximate", b"none") in (b"none", "none"):
        return ("gelu",), None
    if n.op_type in ("Add", "Mul") and len(n.input) == 2:
        other = n.input[1]
        c = g.const(other)
        if c is not None and c.size == 1 and len(c.shape) <= len(shape):
            return ("scale" if n.op_type == "Mul" else "shift", float(c.reshape(-1)[0])), None
        if c is None and g.shapes.get(other) == shape and g.is_float32(other) and g.shapes.get(n.output[0]) == shape:
            return (("mul",) if n.op_type == "Mul" else ("add",)), other
    return None


def _fuse_chain(g: _Graph, i: int) -> None:
    """A run of two or more elementwise nodes (each output read only by the next) as one kernel."""
    n = g.nodes[i]
    shape = g.shapes.get(n.input[0]) if n.input else None
    if shape is None or not g.is_float32(n.input[0]):
        return
    first = _first_step(g, n, shape)
    if first is None:
        return
    steps, operands = [first[0]], ([first[1]] if first[1] else [])
    dead = set(g.dead)
    out, absorbed, _, _ = _absorb(g, n.output[0], shape, 0, 1, None, steps, operands)
    if len(steps) < 2:
        g.dead = dead
        return
    g.dead.add(i)
    _emit(g, max(i, absorbed), "MorokElementwise", [n.input[0]] + operands, out, n.name or f"{n.op_type}_{i}",
          epilogue=json.dumps(steps))


def _fuse_pool(g: _Graph, i: int) -> None:
    n = g.nodes[i]
    if not g.is_float32(n.input[0]) or g.ranks.get(n.input[0]) != 4:
        return
    a = _attrs(n)
    if n.op_type in ("GlobalAveragePool", "GlobalMaxPool"):
        g.nodes[i] = helper.make_node("MorokGlobalPool", [n.input[0]], [n.output[0]], name=n.name or f"{n.op_type}_{i}",
                                      kind="avg" if n.op_type == "GlobalAveragePool" else "max")
        return
    if len(n.output) > 1 and n.output[1] or a.get("ceil_mode", 0) or a.get("storage_order", 0):
        return
    shape = g.shapes.get(n.input[0])
    auto = a.get("auto_pad", b"NOTSET")
    if (shape is not None and tuple(a.get("kernel_shape", ())) == tuple(shape[2:]) and not any(a.get("pads", ()))
            and auto in (b"NOTSET", "NOTSET", b"VALID", "VALID") and all(d == 1 for d in a.get("dilations", (1, 1)))):
        # one window over the whole plane (resnet50's final 7x7 average): global pooling
        g.nodes[i] = helper.make_node("MorokGlobalPool", [n.input[0]], [n.output[0]], name=n.name or f"{n.op_type}_{i}",
                                      kind="max" if n.op_type == "MaxPool" else "avg")
        return
    keep = {k: v for k, v in a.items() if k in ("kernel_shape", "strides", "dilations", "pads", "auto_pad",
                                                  "count_include_pad")}
    g.nodes[i] = helper.make_node("MorokPool2d", [n.input[0]], [n.output[0]], name=n.name or f"{n.op_type}_{i}",
                                  kind="max" if n.op_type == "MaxPool" else "avg", **keep)


# convolutions whose activations can stay channels-last are marked so (the executor runs them so on a CPU with a
# register tile of lane vectors); MOROK_ONNX_CHANNELS_LAST=0 leaves every one NCHW
CHANNELS_LAST = True
# ... where a connected set of such layers has at least this many layers for each NCHW tensor its layers read (the
# model's input, a depthwise layer's output): on the 16-core Xeon the MobileNet stack's last two 1x1 layers (one
# input and one residual from NCHW layers) ran channels-last 0.889x as fast, slower in 11 of 11 rounds
# (benchmarks/model_variants.py, cpu-xeon-avx512-16c/model_variants-channels-last-mobilenet.json); resnet50's 52
# layers read the max pool's output twice
CHANNELS_LAST_LAYERS_PER_EDGE = 4


def _mark_channels_last(nodes: list, outputs: set[str], consts: set[str]) -> None:
    """Mark (attribute channels_last=1) each one-group 2-D MorokConv whose output is no graph output and is
    read only by marked convolutions (as input or epilogue operand) or global pooling: the largest such set,
    found by unmarking until nothing changes. The input of a marked layer may come from anywhere (its first
    kernel reads any layout); its output then needs no copy back to NCHW. Of those, the connected sets with
    CHANNELS_LAST_LAYERS_PER_EDGE layers for each NCHW tensor they read keep the mark."""
    readers: dict[str, list] = {}
    for n in nodes:
        for x in n.input:
            if x:
                readers.setdefault(x, []).append(n)

    def one_group(n) -> bool:
        return all(a.name != "group" or helper.get_attribute_value(a) == 1 for a in n.attribute)
    marked = {id(n) for n in nodes if n.op_type == "MorokConv" and one_group(n)}
    changed = True
    while changed:
        changed = False
        for n in nodes:
            if id(n) not in marked:
                continue
            out = n.output[0]
            ok = out not in outputs and bool(readers.get(out)) and all(
                id(r) in marked and r.input[1] != out or r.op_type == "MorokGlobalPool" for r in readers[out])
            if not ok:
                marked.discard(id(n))
                changed = True
    # a connected set of marked layers pays for the NCHW tensors it reads (each turned around by the layer that
    # reads it): kept where it has CHANNELS_LAST_LAYERS_PER_EDGE layers for each such read
    producer = {n.output[0]: n for n in nodes if id(n) in marked}
    parent = {k: k for k in marked}

    def root(k):
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k
    edges: dict[int, int] = {}
    for n in nodes:
        if id(n) not in marked:
            continue
        for x in [n.input[0]] + list(n.input[2:]):
            p = producer.get(x)
            if p is not None:
                parent[root(id(p))] = root(id(n))
    for n in nodes:
        if id(n) in marked:
            edges.setdefault(root(id(n)), 0)
            edges[root(id(n))] += sum(1 for x in [n.input[0]] + list(n.input[2:])
                                      if x and x not in producer and x not in consts)
    size = collections.Counter(root(k) for k in marked)
    for n in nodes:
        if id(n) in marked and size[root(id(n))] >= CHANNELS_LAST_LAYERS_PER_EDGE * edges[root(id(n))]:
            n.attribute.append(helper.make_attribute("channels_last", 1))


def fuse(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with convolutions, contractions, normalizations and pooling replaced by fused nodes;
    initializers no node reads any more are dropped. MOROK_ONNX_FUSE=0 returns the model as it is."""
    if config.getenv("MOROK_ONNX_FUSE", "1") == "0":
        return model
    g = _Graph(model)
    _fold_constants(g)
    for i in range(len(g.nodes)):
        if i in g.dead:
            continue
        op = g.nodes[i].op_type
        if op == "Conv":
            _fuse_conv(g, i)
        elif op in ("Gemm", "MatMul"):
            _fuse_dense(g, i)
    for i in range(len(g.nodes)):
        if i in g.dead:
            continue
        op = g.nodes[i].op_type
        if op == "BatchNormalization":
            _fuse_affine(g, i)
        elif op in _UNARY or op in ("Gelu", "Add", "Mul"):
            _fuse_chain(g, i)
        elif op in ("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"):
            _fuse_pool(g, i)
    nodes = [n for i, n in enumerate(g.nodes) if i not in g.dead]
    if CHANNELS_LAST and config.getenv("MOROK_ONNX_CHANNELS_LAST", "1") != "0":
        _mark_channels_last(nodes, g.outputs, set(g.inits) | set(g.new))
    used = {x for n in nodes for x in n.input} | g.outputs
    for n in nodes:         # names read inside subgraphs (If, Loop, Scan) count as used
        for attr in n.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                used |= {x for sn in sub.node for x in sn.input}
    # a new model: the caller's is left as it was, and the constants this pass dropped are never copied
    out = onnx.ModelProto()
    _copy_fields(model, out, ("graph",))
    _copy_fields(model.graph, out.graph, ("node", "initializer", "input"))
    dropped = {t.name for t in model.graph.initializer} - used
    out.graph.input.extend(vi for vi in model.graph.input if vi.name not in dropped)   # old IR lists initializers
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(t for t in model.graph.initializer if t.name in used and t.name not in g.new)
    for name in list(g.new):        # each folded array goes once serialized: one extra copy at a time
        a = g.new.pop(name)
        if name in used:
            out.graph.initializer.append(numpy_helper.from_array(a, name))
    return out


def _copy_fields(src, dst, skip: tuple[str, ...]) -> None:
    """Copy every set field of protobuf message `src` into `dst` except those named in `skip`."""
    for fd, value in src.ListFields():
        if fd.name in skip:
            continue
        if getattr(fd, "is_repeated", None) or getattr(fd, "label", None) == 3:      # 3: LABEL_REPEATED (older protobuf)
            getattr(dst, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


# ---- the fused ops ---------------------------------------------------------------------------------

def _caps(ctx) -> Capabilities:
    r = getattr(ctx.k.dev, "renderer", None)
    return getattr(r, "caps", None) or Capabilities()


def _dense(ctx, v: View) -> View:
    """`v` as a contiguous buffer from element 0 (a copy when it is a strided view)."""
    if v.is_contiguous() and v.offset == 0:
        return v
    return copy_view(ctx.k, ctx.n("contiguous"), v)


def _epilogue(a: dict) -> K.Epilogue:
    raw = a.get("epilogue", b"[]")
    return K.Epilogue(json.loads(raw.decode() if isinstance(raw, bytes) else raw))


def _operands(ctx, views: list[View], shape: tuple) -> list[View]:
    out = []
    for v in views:
        if tuple(v.shape) != tuple(shape):
            raise OnnxError(f"{ctx.name}: epilogue operand of shape {v.shape} for an output of shape {tuple(shape)}")
        out.append(_dense(ctx, v))
    return out


def _conv_geometry(x: View, w: View, a: dict) -> ConvGeometry:
    N, C, H, W = x.shape
    KH, KW = a.get("kernel_shape", w.shape[2:])
    s = tuple(a.get("strides", (1, 1)))
    d = tuple(a.get("dilations", (1, 1)))
    pads = list(a.get("pads", (0, 0, 0, 0)))
    auto = a.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        for k, (n, st, kk, dd) in enumerate(zip((H, W), s, (KH, KW), d)):
            total = max(0, (-(-n // st) - 1) * st + (kk - 1) * dd + 1 - n)
            lo = total // 2 if auto == "SAME_UPPER" else total - total // 2
            pads[k], pads[k + 2] = lo, total - lo
    elif auto == "VALID":
        pads = [0, 0, 0, 0]
    # ONNX pads are (begin..., end...): (top, left, bottom, right) for 2-D
    return ConvGeometry(N, C, H, W, w.shape[0], int(KH), int(KW), s, d, (pads[0], pads[1], pads[2], pads[3]),
                        int(a.get("group", 1)))


_said: set[str] = set()


def _say(name: str, what: str) -> None:
    if config.debug_level() >= 1 and name not in _said:
        _said.add(name)
        config.log(f"{name} {what}")


# scratch buffers (im2col columns, padded inputs) by (kernel builder, dtype): a model's convolutions run one
# after another on one device, so each reuses the largest scratch so far instead of holding its own
# (light resnet50: 16 column buffers of 0.4-7 MB); a larger request allocates a new one, and the launches
# recorded with the old one keep it alive
PLAN_SEARCH_RUNS = 5    # timed runs per candidate plan under MOROK_BEAM (the fastest counts)
_scratch: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_scratch_lock = threading.Lock()


def _scratch_buffer(k, elements: int, dtype, role: str = "col"):
    """The scratch of `role` (one plan's scratches are live together: a split contraction's columns and
    partial sums) and `dtype`, at least `elements` long."""
    with _scratch_lock:
        per = _scratch.setdefault(k, {})
        buf = per.get((role, dtype))
        if buf is None or buf.size < elements:
            buf = per[(role, dtype)] = k.empty([elements], dtype).buf
        return buf


# the outputs of a plan's weights-only steps (KernelStep.weights_only: a reorder, Winograd's filter transform)
# by weights buffer and kernel: a MorokConv's weights are an initializer, uploaded once and never written, so
# each such step runs once and every later run and replay reads its output
_weights_outputs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _weights_output(ctx, st, w_buf):
    """The output of weights-only step `st` on `w_buf`, computed at its first use."""
    with _scratch_lock:
        per = _weights_outputs.setdefault(w_buf, {})
        buf = per.get(st.ast.key)
    if buf is None:
        prog = ctx.k.programs.get(st.ast.key)
        if prog is None:
            prog = ctx.k.programs[st.ast.key] = ctx.k.dev.compile(st.ast, ctx.n(st.name))
        buf = Buffer(ctx.k.dev, st.elements, st.dtype or w_buf.dtype)     # not a run's buffer: no plan reuses it
        prog(w_buf, buf, **dict(st.vars))
        with _scratch_lock:
            buf = per.setdefault(st.ast.key, buf)
    return buf


def _plan_launches(ctx, plan, geo, epi, x: View, w: View, extra: list[View], out: View) -> list[tuple]:
    """(kernel step, its buffers) of a convolution plan on these views, its scratch buffers taken; a step that
    reads the weights alone runs once here (`_weights_output`) instead of at every run."""
    steps = K.conv2d_kernels(geo, plan, dtypes.float32, epi, symbolic_batch=ctx.k.symbolic_outer)
    return _step_launches(ctx, steps, x, w, extra, out)


def _step_launches(ctx, steps, x: View, w: View, extra: list[View], out: View) -> list[tuple]:
    """(kernel step, its buffers) of a convolution's steps: scratch buffers taken, weights-only steps run once."""
    bufs = {"x": x.buf, "w": w.buf, "out": out.buf}
    launches = []
    for st in steps:
        if st.weights_only:
            bufs[st.output] = _weights_output(ctx, st, w.buf)
            continue
        if st.output != "out":
            bufs[st.output] = _scratch_buffer(ctx.k, st.elements, st.dtype or x.dtype, st.output)
        args = []
        for role in st.inputs:
            args += [v.buf for v in extra] if role == "epilogue" else [bufs[role]]
        launches.append((st, args + [bufs[st.output]]))
    return launches


def _run_plan(ctx, plan, geo, epi, x: View, w: View, extra: list[View], out: View) -> None:
    for st, args in _plan_launches(ctx, plan, geo, epi, x, w, extra, out):
        ctx.k.launch(ctx.n(st.name), st.ast, args, **dict(st.vars))


def _plan_timer(ctx, plan, geo, epi, x: View, w: View, extra: list[View], out: View):
    """A function that runs the plan's kernels once and waits: its steps built and compiled once here, so
    that a search times the launches, not the Python that builds their kernels."""
    return _launches_timer(ctx, _plan_launches(ctx, plan, geo, epi, x, w, extra, out))


def _launches_timer(ctx, launches: list[tuple]):
    """A function that runs `launches` ((kernel step, buffers)) once and waits, each compiled here first."""
    calls = []
    for st, args in launches:
        prog = ctx.k.programs.get(st.ast.key)
        if prog is None:
            prog = ctx.k.programs[st.ast.key] = ctx.k.dev.compile(st.ast, ctx.n(st.name))
        calls.append((prog, args, dict(st.vars)))

    def run() -> None:
        for prog, args, vars_ in calls:
            prog(*args, wait=True, **vars_)
    return run


def _timing_copy(v: View, rng: np.random.Generator) -> View:
    """`v`'s layout over a new buffer of standard normal values (a plan search's stand-in input)."""
    arr = rng.standard_normal(v.buf.size).astype(v.dtype.np)
    return View(Buffer.from_numpy(arr, v.buf.device), v.shape, v.strides, v.offset, v.const)


def _time_runs(run) -> float:
    """The best of PLAN_SEARCH_RUNS timed runs of `run`, after one untimed."""
    run()       # warm
    best = float("inf")
    for _ in range(PLAN_SEARCH_RUNS):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def _stand_ins(x: View, extra: list[View]) -> tuple[View, list[View]]:
    """Random normal stand-ins, in their layouts, for a convolution's runtime inputs (a plan search's)."""
    # timed on random inputs, not on this node's: during the first run its input is still to be computed (the
    # launches wait in a queue), so the buffer holds whatever was there, denormals and NaNs included, which run
    # many times slower on Intel cores. The searched times (those MOROK_DEBUG=1 prints) of the light resnet50's
    # convolutions on the 16-core Xeon: its 1x1 256 -> 128 layer at 56x56 4.8 ms on the node's buffer, 0.27 on
    # random inputs (0.23 in the model, launch by launch)
    rng = np.random.default_rng(0)
    return _timing_copy(x, rng), [v if v.const else _timing_copy(v, rng) for v in extra]


def _choose_plan(ctx, geo, epi, x, w, extra, out):
    """The heuristic plan; under MOROK_BEAM the fastest of the candidates, timed on this node's weights and
    output with stand-ins for its runtime inputs."""
    caps = _caps(ctx)
    if config.getenv_int("MOROK_BEAM", 0) <= 0:
        return conv_plan(geo, caps, static_batch=not ctx.k.symbolic_outer), None
    tx, textra = _stand_ins(x, extra)

    def time_plan(plan) -> float:
        return _time_runs(_plan_timer(ctx, plan, geo, epi, tx, w, textra, out))
    return search_plan(geo, caps, time_plan, (str(epi), getattr(ctx.k.dev, "name", "")),
                       static_batch=not ctx.k.symbolic_outer)


def _choose_form(ctx, geo, epi, x: View, w: View, extra: list[View], out: View, width: int):
    """The channels-last form `channels_last_plan` names; under MOROK_BEAM the fastest of
    `channels_last_candidates`, timed as `_choose_plan` times NCHW plans. Returns (form, times or None)."""
    caps = _caps(ctx)
    forms = channels_last_candidates(geo, caps, 4, _is_nhwc(x))
    if config.getenv_int("MOROK_BEAM", 0) <= 0 or len(forms) < 2:
        return forms[0], None
    tx, textra = _stand_ins(x, extra)

    def time_form(form: str) -> float:
        steps = KN.conv2d_nhwc_kernels(geo, form, width, dtypes.float32, epi, tuple(tx.strides),
                                       channels_last_runs(geo, caps, form))
        return _time_runs(_launches_timer(ctx, _step_launches(ctx, steps, tx, w, textra, out)))
    return search_plan(geo, caps, time_form, ("channels-last", str(epi), getattr(ctx.k.dev, "name", "")),
                       candidates=forms)


def _is_nhwc(v: View) -> bool:
    """A 4-D view stored channels-last from its buffer's start (the layout `_conv_nhwc` writes)."""
    return v.ndim == 4 and v.offset == 0 and tuple(v.strides) == KN.nhwc_strides(*v.shape)


def _conv_nhwc(ctx, ins, a, geo, epi, has_bias: bool) -> list[View]:
    """A channels-last convolution (kernels_nhwc): the output an [N, C, OH, OW] view stored [N, OH, OW, C]."""
    x = ins[0]
    if not _is_nhwc(x):
        x = _dense(ctx, x)          # an NCHW input (a layout's edge): the columns read it through its strides
    strides = tuple(x.strides)
    out = ctx.k.empty([geo.N, geo.CO, geo.OH, geo.OW], x.dtype)
    out = out.with_(out.shape, KN.nhwc_strides(*out.shape))
    extra = ([ins[2]] if has_bias else []) + [_nhwc_operand(ctx, v, out.shape) for v in ins[2 + has_bias:]]
    width = _caps(ctx).register_tile[1]
    form, times = _choose_form(ctx, geo, epi, x, ins[1], extra, out, width)
    runs = channels_last_runs(geo, _caps(ctx), form)
    _say(ctx.name, f"conv: channels-last {form}" + (f" in {runs} runs" if runs > 1 else "") + f", epilogue {epi}" + (
        "" if _is_nhwc(ins[0]) else ", input NCHW") + (
        "; searched " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in times.items()) if times else ""))
    steps = KN.conv2d_nhwc_kernels(geo, form, width, dtypes.float32, epi, strides, runs)
    for st, args in _step_launches(ctx, steps, x, ins[1], extra, out):
        ctx.k.launch(ctx.n(st.name), st.ast, args, **dict(st.vars))
    return [out]


def _nhwc_operand(ctx, v: View, shape: tuple) -> View:
    """An epilogue's tensor operand for a channels-last output of `shape`: stored channels-last (a copy where
    it is not)."""
    if tuple(v.shape) != tuple(shape):
        raise OnnxError(f"{ctx.name}: epilogue operand of shape {v.shape} for an output of shape {tuple(shape)}")
    if _is_nhwc(v):
        return v
    t = copy_view(ctx.k, ctx.n("channels_last"), v.permute((0, 2, 3, 1)))      # [N, H, W, C], contiguous
    return t.with_(v.shape, KN.nhwc_strides(*v.shape), 0)


def _conv(ctx, ins, a):
    epi = _epilogue(a)
    if a.get("channels_last", 0) and not ctx.k.symbolic_outer and ins[0].ndim == 4 and ins[0].dtype == dtypes.float32:
        has_bias = len(ins) > 2 and epi.operands[:1] == ("bias",)
        geo = _conv_geometry(ins[0], ins[1], a)
        if channels_last_plan(geo, _caps(ctx), 4, _is_nhwc(ins[0])) is not None:
            return _conv_nhwc(ctx, ins, a, geo, epi, has_bias)
    x, w = _dense(ctx, ins[0]), ins[1]
    has_bias = len(ins) > 2 and epi.operands[:1] == ("bias",)
    geo = _conv_geometry(x, w, a)
    out = ctx.k.empty([geo.N, geo.CO, geo.OH, geo.OW], x.dtype)
    extra = ([ins[2]] if has_bias else []) + _operands(ctx, [v for v in ins[2 + has_bias:]], out.shape)
    plan, times = _choose_plan(ctx, geo, epi, x, w, extra, out)
    _say(ctx.name, f"conv: {plan}, epilogue {epi}" + (
        "; searched " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in times.items()) if times else ""))
    _run_plan(ctx, plan, geo, epi, x, w, extra, out)
    return [out]


def _dense_op(ctx, ins, a):
    x, w = _dense(ctx, ins[0]), ins[1]
    epi = _epilogue(a)
    has_bias = epi.operands[:1] == ("bias",)
    K_, ldb = w.shape
    N = a.get("columns", ldb)
    M = x.size // K_
    oshape = tuple(x.shape[:-1]) + (N,)
    out = ctx.k.empty(oshape, x.dtype)
    extra = ([ins[2]] if has_bias else []) + _operands(ctx, list(ins[2 + has_bias:]), oshape)
    sym = ctx.k.symbolic_outer          # a dynamic batch: the rows are the variable M, one program for every batch
    width = _panel_width(ctx, M, N, sym, K_, x.dtype.itemsize)
    _say(ctx.name, f"dense {M}x{N}x{K_}, epilogue {epi}" + (f", weights in {width}-column panels" if width else ""))
    if width:
        st = K.KernelStep("panels", K.column_panels(K_, N, width, ldb), ("w",), "panels", K_ * N)
        ctx.k.launch(ctx.n("gemm"), K.matmul_panels(M, N, K_, width, dtypes.float32, epi),
                     [x.buf, _weights_output(ctx, st, w.buf)] + [v.buf for v in extra] + [out.buf])
        return [out]
    ctx.k.launch(ctx.n("gemm"), K.matmul(None if sym else M, N, K_, dtypes.float32, epi, ldb=ldb),
                 [x.buf, w.buf] + [v.buf for v in extra] + [out.buf], **({"M": M} if sym else {}))
    return [out]


# a constant right-hand matrix of a dense layer is copied once into column panels of the register tile's width
# (kernels.column_panels) where its rows fill the tile and the width divides its columns: each unit of the CPU's
# thread split then reads one contiguous panel instead of B's rows in place, a step a row (4 KB) apart
DENSE_PANELS = True
# ... while the copy (held beside the weights as loaded) stays within this many bytes
DENSE_PANELS_MAX_BYTES = 256 << 20


def _panel_width(ctx, M: int, N: int, symbolic: bool, K: int, itemsize: int) -> int:
    """The column panels' width a dense layer's constant weights take (0: kept [K, N], read in place): the
    target's register tile width where it has lane vectors (the CPU), the rows static and at least the tile's
    (a GEMV's single row keeps B in place), the width dividing N and the copy within DENSE_PANELS_MAX_BYTES."""
    caps = _caps(ctx)
    if not DENSE_PANELS or symbolic or not caps.register_tile or not caps.tile_lanes:
        return 0
    rows, width = caps.register_tile
    fits = K * N * itemsize <= DENSE_PANELS_MAX_BYTES
    return width if M >= rows and N % width == 0 and fits else 0


def _affine(ctx, ins, a):
    x, s, t = _dense(ctx, ins[0]), ins[1], ins[2]
    epi = _epilogue(a)
    extra = _operands(ctx, list(ins[3:]), x.shape)
    C = x.shape[1]
    sizes = {"rows": x.shape[0] * C, "channels": C, "inner": x.size // (x.shape[0] * C)}
    out = ctx.k.empty(x.shape, x.dtype)
    # symbolic sizes: one program for every BatchNorm of a model (densenet121's 62 took 8 s to compile one by one)
    ctx.k.launch(ctx.n(), K.channel_affine(None, None, None, dtypes.float32, epi),
                 [x.buf, s.buf, t.buf] + [v.buf for v in extra] + [out.buf], **sizes)
    return [out]


def _pool2d(ctx, ins, a):
    x = _dense(ctx, ins[0])
    kind = a["kind"].decode() if isinstance(a["kind"], bytes) else a["kind"]
    kh, kw = a["kernel_shape"]
    fake_w = View(x.buf, (x.shape[1], 1, kh, kw), (0, 0, 0, 0))
    geo = _conv_geometry(x, fake_w, {**a, "group": x.shape[1]})
    out = ctx.k.empty([geo.N, geo.C, geo.OH, geo.OW], x.dtype)
    sym = ctx.k.symbolic_outer          # a dynamic batch: the variable N, one program for every batch size
    ast = K.pool2d(kind, None if sym else geo.N, geo.C, geo.H, geo.W, kh, kw, geo.stride, geo.dilation, geo.pads,
                   bool(a.get("count_include_pad", 0)))
    ctx.k.launch(ctx.n(), ast, [x.buf, out.buf], **({"N": geo.N} if sym else {}))
    return [out]


def _global_pool(ctx, ins, a):
    kind = a["kind"].decode() if isinstance(a["kind"], bytes) else a["kind"]
    if _is_nhwc(ins[0]) and not ins[0].is_contiguous() and not ctx.k.symbolic_outer:
        x = ins[0]
        N, C, H, W = x.shape
        out = ctx.k.empty([N, C, 1, 1], x.dtype)
        ctx.k.launch(ctx.n(), KN.global_pool_nhwc(kind, N, H * W, C, x.dtype), [x.buf, out.buf])
        return [out]
    x = _dense(ctx, ins[0])
    rows = x.shape[0] * x.shape[1]
    out = ctx.k.empty(list(x.shape[:2]) + [1] * (x.ndim - 2), x.dtype)
    sym = ctx.k.symbolic_outer
    ctx.k.launch(ctx.n(), K.global_pool(kind, None if sym else rows, x.size // rows), [x.buf, out.buf],
                 **({"rows": rows} if sym else {}))
    return [out]


def _elementwise(ctx, ins, a):
    x = _dense(ctx, ins[0])
    epi = _epilogue(a)
    extra = _operands(ctx, list(ins[1:]), x.shape)
    out = ctx.k.empty(x.shape, x.dtype)
    _say(ctx.name, f"elementwise: {epi}")
    ctx.k.launch(ctx.n(), K.elementwise_chain(None, dtypes.float32, epi), [x.buf] + [v.buf for v in extra] + [out.buf],
                 n=x.size)
    return [out]


OPS["MorokElementwise"] = _elementwise
OPS["MorokConv"] = _conv
OPS["MorokDense"] = _dense_op
OPS["MorokAffine"] = _affine
OPS["MorokPool2d"] = _pool2d
OPS["MorokGlobalPool"] = _global_pool
