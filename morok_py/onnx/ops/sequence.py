"""Sequence and optional ops: values the executor holds on the host side (Seq, a list of tensor views;
Opt, a tensor, a sequence or nothing); only ConcatFromSequence and SplitToSequence touch the device."""
from __future__ import annotations

import numpy as np

from morok_py.onnx.errors import OnnxError
from morok_py.onnx.ops.common import ONNX_DT
from morok_py.onnx.ops.registry import OPS, op
from morok_py.onnx.values import Opt, Seq


def _pos(ctx, v, n: int, default: int, insert: bool = False) -> int:
    """A position input (negative counts from the end); `insert` allows n itself."""
    if v is None:
        return default
    p = int(ctx.scalar(v))
    p = p + n if p < 0 else p
    if not (0 <= p <= n if insert else 0 <= p < n):
        raise OnnxError(f"{ctx.node.op_type}: position {p} outside a sequence of {n}")
    return p


@op("SequenceEmpty")
def _sequence_empty(ctx, ins, a):
    return [Seq([], ONNX_DT[a.get("dtype", 1)])]


@op("SequenceConstruct")
def _sequence_construct(ctx, ins, a):
    return [Seq(ins)]


@op("SequenceInsert")
def _sequence_insert(ctx, ins, a):
    seq, x = ins[0], ins[1]
    p = _pos(ctx, ins[2] if len(ins) > 2 else None, len(seq), len(seq), insert=True)
    return [Seq(list(seq[:p]) + [x] + list(seq[p:]), seq.dtype or x.dtype)]


@op("SequenceAt")
def _sequence_at(ctx, ins, a):
    seq = ins[0]
    return [seq[_pos(ctx, ins[1], len(seq), 0)]]


@op("SequenceErase")
def _sequence_erase(ctx, ins, a):
    seq = ins[0]
    p = _pos(ctx, ins[1] if len(ins) > 1 else None, len(seq), len(seq) - 1)
    return [Seq(list(seq[:p]) + list(seq[p + 1:]), seq.dtype)]


@op("SequenceLength")
def _sequence_length(ctx, ins, a):
    return [ctx.const_view(np.array(len(ins[0]), np.int64))]


@op("SplitToSequence")
def _split_to_sequence(ctx, ins, a):
    x = ins[0]
    ax = a.get("axis", 0) % x.ndim
    d = x.shape[ax]
    split = ins[1] if len(ins) > 1 else None
    squeeze = False
    if split is None:
        sizes, squeeze = [1] * d, not a.get("keepdims", 1)
    else:
        s = np.asarray(ctx.host(split)).reshape(-1)
        if np.asarray(ctx.host(split)).ndim == 0:
            c = int(s[0])
            sizes = [c] * (d // c) + ([d % c] if d % c else [])
        else:
            sizes = [int(v) for v in s]
    parts, pos = [], 0
    for n in sizes:
        shape = list(x.shape)
        shape[ax] = n
        v = x.with_(shape, x.strides, x.offset + pos * x.strides[ax])
        if squeeze:
            keep = [i for i in range(x.ndim) if i != ax]
            v = v.with_([v.shape[i] for i in keep], [v.strides[i] for i in keep])
        parts.append(v)
        pos += n
    return [Seq(parts, x.dtype)]


@op("ConcatFromSequence")
def _concat_from_sequence(ctx, ins, a):
    seq = list(ins[0])
    ax = a["axis"]
    if a.get("new_axis", 0):
        nd = seq[0].ndim + 1
        ax = ax % nd
        seq = [v.with_(v.shape[:ax] + (1,) + v.shape[ax:], v.strides[:ax] + (0,) + v.strides[ax:]) for v in seq]
    return OPS["Concat"](ctx, seq, {"axis": ax})


@op("Optional")
def _optional(ctx, ins, a):
    return [Opt(ins[0] if ins else None)]


@op("OptionalHasElement")
def _optional_has_element(ctx, ins, a):
    x = ins[0] if ins else None
    has = x is not None and not (isinstance(x, Opt) and x.value is None)
    return [ctx.const_view(np.array(has))]


@op("OptionalGetElement")
def _optional_get_element(ctx, ins, a):
    x = ins[0]
    if isinstance(x, Opt):
        if x.value is None:
            raise OnnxError(f"{ctx.name}: OptionalGetElement of an empty optional")
        return [x.value]
    return [x]
