"""Builders for the kernels a graph executor needs: elementwise with broadcasting, reductions
over any axis, matmul, softmax, gather, symbolic sizes. Used by the demo, tests and benchmarks.

Each builder returns a kernel AST (a UOp.sink). Buffers are params in slot order: inputs first,
output last. Sizes are ints (static) or None, which makes them symbolic variables.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from .codegen.capabilities import Capabilities
from .codegen.opt import PACK_ROW_BYTES
from .codegen.strategies.conv import (WINOGRAD_GPU_CHANNEL_LOOP, ConvGeometry, ConvPlan, check_plan, conv_plan,
                                      flat_spans, phase_planes, phases_flat_geometry)
from .dtypes import DType, accumulation_dtype, as_dtype, dtypes
from .errors import ArgumentError, UnknownNameError
from .ir import AxisType, Ops, UOp

Size = "int | UOp | None"


def size(value, name: str, lo: int = 1, hi: int = 2**31 - 1) -> UOp | int:
    """An int stays static; None becomes the variable `name` in [lo, hi]; a UOp is kept."""
    if value is None:
        return UOp.variable(name, lo, hi)
    return value


def _end(x) -> UOp:
    return x if isinstance(x, UOp) else UOp.const(int(x))


def _strides(shape: Sequence) -> list:
    out, acc = [], UOp.const(1)
    for d in reversed(shape):
        out.append(acc)
        acc = acc * _end(d)
    return list(reversed(out))


def _index(ranges: Sequence[UOp], shape: Sequence, strides: Sequence | None = None) -> UOp:
    strides = strides if strides is not None else _strides(shape)
    idx = UOp.const(0)
    for r, s in zip(ranges, strides):
        idx = idx + r * s
    return idx


BINARY: dict[str, Callable[[UOp, UOp], UOp]] = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b, "max": lambda a, b: a.maximum(b), "min": lambda a, b: a.minimum(b),
    "pow": lambda a, b: a.pow(b),
}
UNARY: dict[str, Callable[[UOp], UOp]] = {
    "neg": lambda a: -a, "relu": lambda a: a.relu(), "exp": lambda a: a.exp(), "log": lambda a: a.log(),
    "sqrt": lambda a: a.sqrt(), "sin": lambda a: a.sin(), "recip": lambda a: a.reciprocal(),
    "exp2": lambda a: a.exp2(), "log2": lambda a: a.log2(), "trunc": lambda a: a.trunc(),
    "square": lambda a: a * a, "abs": lambda a: a.abs(), "tanh": lambda a: a.tanh(),
    "sigmoid": lambda a: a.sigmoid(), "erf": lambda a: a.erf(), "floor": lambda a: a.floor(),
    "ceil": lambda a: a.ceil(), "round": lambda a: a.round(), "isnan": lambda a: a.isnan(),
    "isinf": lambda a: a.isinf(), "log1p": lambda a: a.log1p(),
}


# ---- epilogues: what a contraction or convolution computes on each output before storing it ---------

# steps that read an operand: "bias" one value per output channel (column), "add" / "mul" a tensor of the
# output's shape (a residual); the rest are pure functions of the value, with constant arguments
EPILOGUE_OPERANDS = ("bias", "add", "mul")
EPILOGUE_STEPS: dict[str, Callable[..., UOp]] = {
    "relu": lambda v: v.relu(),
    "clip": lambda v, lo, hi: v.maximum(UOp.const(lo, v.dtype)).minimum(UOp.const(hi, v.dtype)),
    "scale": lambda v, c: v * UOp.const(c, v.dtype),
    "shift": lambda v, c: v + UOp.const(c, v.dtype),
    "sigmoid": lambda v: v.sigmoid(),
    "silu": lambda v: v * v.sigmoid(),
    "tanh": lambda v: v.tanh(),
    "gelu": lambda v: v * UOp.const(0.5, v.dtype) * ((v * UOp.const(1 / math.sqrt(2), v.dtype)).erf()
                                                      + UOp.const(1.0, v.dtype)),
    "hardsigmoid": lambda v, a=1 / 6, b=0.5: (v * UOp.const(a, v.dtype) + UOp.const(b, v.dtype)).maximum(
        UOp.const(0.0, v.dtype)).minimum(UOp.const(1.0, v.dtype)),
    "hardswish": lambda v: v * (v * UOp.const(1 / 6, v.dtype) + UOp.const(0.5, v.dtype)).maximum(
        UOp.const(0.0, v.dtype)).minimum(UOp.const(1.0, v.dtype)),
    "leakyrelu": lambda v, a=0.01: (v < UOp.const(0.0, v.dtype)).where(v * UOp.const(a, v.dtype), v),
}


class Epilogue:
    """The steps applied, in order, to each output of a contraction or convolution in the kernel that
    computes it (bias, residual add, activations), so no second kernel reads the output back. A step is
    a name and its constant arguments: ("bias",), ("add",), ("clip", 0.0, 6.0), ("hardswish",), ...
    Operand steps ("bias", "add", "mul") each take the next param after the kernel's inputs."""

    __slots__ = ("steps",)

    def __init__(self, steps: Sequence[Sequence] = ()) -> None:
        out = []
        for st in steps:
            st = (st,) if isinstance(st, str) else tuple(st)
            if not st or (st[0] not in EPILOGUE_OPERANDS and st[0] not in EPILOGUE_STEPS):
                raise UnknownNameError(f"unknown epilogue step {st!r}; known: "
                                       f"{', '.join(EPILOGUE_OPERANDS + tuple(EPILOGUE_STEPS))}")
            if st[0] in EPILOGUE_OPERANDS and len(st) != 1:
                raise ArgumentError(f"epilogue step {st[0]!r} takes no constant arguments")
            out.append((st[0],) + tuple(float(a) for a in st[1:]))
        self.steps: tuple[tuple, ...] = tuple(out)

    @staticmethod
    def of(*steps) -> "Epilogue":
        return Epilogue(steps)

    @property
    def operands(self) -> tuple[str, ...]:
        """The operand steps in param order."""
        return tuple(st[0] for st in self.steps if st[0] in EPILOGUE_OPERANDS)

    def __bool__(self) -> bool:
        return bool(self.steps)

    def __eq__(self, other) -> bool:
        return isinstance(other, Epilogue) and other.steps == self.steps

    def __hash__(self) -> int:
        return hash(self.steps)

    def __add__(self, other: "Epilogue") -> "Epilogue":
        return Epilogue(self.steps + other.steps)

    def __str__(self) -> str:
        return "+".join(st[0] + (f"({','.join(f'{a:g}' for a in st[1:])})" if len(st) > 1 else "")
                        for st in self.steps) or "none"

    __repr__ = __str__

    def apply(self, v: UOp, slot: int, dtype: DType, channel: UOp, at: UOp) -> tuple[UOp, int]:
        """(the value after every step, the next free param slot): operand steps load param `slot`,
        `slot + 1`, ... at `channel` (bias) or `at` (the output's flat index)."""
        for st in self.steps:
            if st[0] == "bias":
                v = v + UOp.param(slot, dtype).load(channel)
                slot += 1
            elif st[0] in ("add", "mul"):
                o = UOp.param(slot, dtype).load(at)
                v = v + o if st[0] == "add" else v * o
                slot += 1
            else:
                v = EPILOGUE_STEPS[st[0]](v, *st[1:])
        return v, slot


def _pick(table: dict, name: str, what: str):
    """`table[name]`, or UnknownNameError listing the names `table` knows."""
    try:
        return table[name]
    except (KeyError, TypeError):
        raise UnknownNameError(f"unknown {what} {name!r}; known: {', '.join(table)}") from None


def unary(fn: str, n=None, dtype=dtypes.float32) -> UOp:
    """out[i] = fn(x[i]) over n elements; out has fn's result dtype (bool for isnan and isinf)."""
    dt = as_dtype(dtype)
    x = UOp.param(0, dt)
    i = UOp.range(size(n, "n"), 0)
    val = _pick(UNARY, fn, "unary op")(x.load(i))
    return UOp.sink(UOp.param(1, val.dtype).store(i, val))


def add(n=None, dtype=dtypes.float32) -> UOp:
    """c[i] = a[i] + b[i] over n elements (symbolic when n is None)."""
    return binary("add", n, dtype=dtype)


def binary(op: str, n=None, dtype=dtypes.float32) -> UOp:
    dt = as_dtype(dtype)
    a, b, c = UOp.param(0, dt), UOp.param(1, dt), UOp.param(2, dt)
    i = UOp.range(size(n, "n"), 0)
    return UOp.sink(c.store(i, _pick(BINARY, op, "binary op")(a.load(i), b.load(i))))


def broadcast_shape(sa: Sequence[int], sb: Sequence[int]) -> tuple[int, ...]:
    nd = max(len(sa), len(sb))
    pa, pb = [1] * (nd - len(sa)) + list(sa), [1] * (nd - len(sb)) + list(sb)
    out = []
    for x, y in zip(pa, pb):
        if x != y and 1 not in (x, y):
            raise ArgumentError(f"shapes {tuple(sa)} and {tuple(sb)} do not broadcast")
        out.append(max(x, y))
    return tuple(out)


def broadcast_binary(op: str, shape_a: Sequence[int], shape_b: Sequence[int], dtype=dtypes.float32) -> UOp:
    """numpy-style broadcasting: out = op(a, b) with out's shape the broadcast of both."""
    dt = as_dtype(dtype)
    shape = broadcast_shape(shape_a, shape_b)
    nd = len(shape)
    a, b, c = UOp.param(0, dt), UOp.param(1, dt), UOp.param(2, dt)
    ranges = [UOp.range(d, ax) for ax, d in enumerate(shape)]

    def bstrides(s):
        s = [1] * (nd - len(s)) + list(s)
        st = _strides(s)
        return [UOp.const(0) if dim == 1 and full != 1 else stride for dim, full, stride in zip(s, shape, st)]

    ia = _index(ranges, shape, bstrides(shape_a))
    ib = _index(ranges, shape, bstrides(shape_b))
    return UOp.sink(c.store(_index(ranges, shape), _pick(BINARY, op, "binary op")(a.load(ia), b.load(ib))))


def reduce_axis(op: str, shape: Sequence, axis: int, dtype=dtypes.float32) -> UOp:
    """out = x.op(axis) for op in sum, max, min, mean, prod; shape entries may be None (symbolic)."""
    dt = as_dtype(dtype)
    nd = len(shape)
    if not -nd <= axis < nd:
        raise ArgumentError(f"axis {axis} out of range for {nd} dimensions")
    axis %= nd
    shape = [size(d, f"d{i}") for i, d in enumerate(shape)]
    x, out = UOp.param(0, dt), UOp.param(1, dt)
    ranges = [UOp.range(d, ax, AxisType.REDUCE if ax == axis else AxisType.GLOBAL) for ax, d in enumerate(shape)]
    rop = _pick({"sum": Ops.ADD, "mean": Ops.ADD, "max": Ops.MAX, "min": Ops.MIN, "prod": Ops.MUL}, op, "reduction")
    v = x.load(_index(ranges, shape))
    if op == "mean":    # summed and divided at the accumulation precision, rounded once
        acc = accumulation_dtype(dt)
        red = (v.cast(acc).reduce(ranges[axis]) / _end(shape[axis]).cast(acc)).cast(dt)
    else:
        red = v.reduce(ranges[axis], op=rop)
    keep = [r for ax, r in enumerate(ranges) if ax != axis]
    oshape = [d for ax, d in enumerate(shape) if ax != axis]
    return UOp.sink(out.store(_index(keep, oshape) if keep else UOp.const(0), red))


def sum_all(n=None, dtype=dtypes.float32) -> UOp:
    """out[0] = sum of x[0:n]."""
    dt = as_dtype(dtype)
    x, out = UOp.param(0, dt), UOp.param(1, dt)
    k = UOp.range(size(n, "n"), 0, AxisType.REDUCE)
    return UOp.sink(out.store(0, x.load(k).reduce(k)))


def row_max(rows=None, cols=None, dtype=dtypes.float32) -> UOp:
    return reduce_axis("max", [rows, cols], 1, dtype)


def matmul(M=None, N=None, K=None, dtype=dtypes.float32, epilogue: "Epilogue | None" = None,
           ldb: int | None = None) -> UOp:
    """C[M,N] = A[M,K] @ B[K,N], row-major, then `epilogue` (its per-channel operands are per column,
    length N; its tensor operands [M, N]). `ldb`: B's row stride in elements (default N; see
    `padded_ldb`). Params: A, B, the epilogue's operands, C. A storage-only dtype (float8, ...) is widened to
    float32 per element, summed in float32 and stored in that dtype (`widened_matmul`: other output dtypes,
    B^T)."""
    dt = as_dtype(dtype)
    if dt.storage_only:
        return widened_matmul(M, N, K, dt, dt, dt, "kn", epilogue, ldb)
    M, N, K = size(M, "M"), size(N, "N"), size(K, "K")
    epi = epilogue or Epilogue()
    a, b = UOp.param(0, dt), UOp.param(1, dt)
    i, j = UOp.range(M, 0), UOp.range(N, 1)
    k = UOp.range(K, 2, AxisType.REDUCE)
    acc = (a.load(i * _end(K) + k) * b.load(k * _end(N if ldb is None else ldb) + j)).reduce(k)
    at = i * _end(N) + j
    v, nxt = epi.apply(acc, 2, dt, j, at)
    return UOp.sink(UOp.param(nxt, dt).store(at, v))


def widened_matmul(M=None, N=None, K=None, a_dtype=dtypes.float8_e4m3fn, b_dtype=None, out_dtype=dtypes.float32,
           b_layout: str = "kn", epilogue: "Epilogue | None" = None, ldb: int | None = None) -> UOp:
    """C[M, N] = out_dtype(sum_k float32(A[M, K]) * float32(B[K, N])): a matmul of storage-only floats
    (float8_e4m3fn, float8_e5m2, ...) or any float dtypes (`b_dtype` default: `a_dtype`), each element widened
    to float32, then `epilogue` (computed in float32, its operands of `out_dtype`), stored as `out_dtype`.
    `b_layout` "kn" takes B as [K, N] row-major (`matmul`'s layout); "nk" as B^T [N, K] row-major (B
    column-major, what torch._scaled_mm asks for); `ldb`: the row stride of B's layout in elements (default N
    for "kn", K for "nk"). On sm_90a GPUs a float8_e4m3fn / float8_e5m2 contraction whose strides are multiples
    of 16 (K, and N for "kn") runs on the warpgroup tensor cores (codegen/strategies/wgmma_f8.py: "nk" filled
    by cp.async, "kn" turned around by the producer); every other case is correct on the ordinary path.
    Params: A, B, the epilogue's operands, C. Also `kernels_f8.matmul`."""
    adt = as_dtype(a_dtype)
    bdt = adt if b_dtype is None else as_dtype(b_dtype)
    odt = as_dtype(out_dtype)
    if b_layout not in ("kn", "nk"):
        raise ArgumentError(f"b_layout is 'kn' (B [K, N]) or 'nk' (B^T [N, K]), got {b_layout!r}")
    if not (adt.is_float and bdt.is_float):
        raise ArgumentError(f"matmul of float operands, got {adt.name} and {bdt.name}")
    if odt.storage_only and epilogue:
        raise ArgumentError(f"an epilogue's operands cannot be of the storage-only {odt.name}")
    M, N, K = size(M, "M"), size(N, "N"), size(K, "K")
    epi = epilogue or Epilogue()
    a, b = UOp.param(0, adt), UOp.param(1, bdt)
    i, j = UOp.range(M, 0), UOp.range(N, 1)
    k = UOp.range(K, 2, AxisType.REDUCE)
    bx = k * _end(N if ldb is None else ldb) + j if b_layout == "kn" else j * _end(K if ldb is None else ldb) + k
    acc = (a.load(i * _end(K) + k).cast(dtypes.float32) * b.load(bx).cast(dtypes.float32)).reduce(k)
    at = i * _end(N) + j
    v, nxt = epi.apply(acc, 2, dtypes.float32 if odt.storage_only else odt, j, at)
    if v.dtype != odt:
        v = v.cast(odt)
    return UOp.sink(UOp.param(nxt, odt).store(at, v))


__all__ = ["matmul"]


LDB_ALIGN_BYTES = 1024      # weight rows a multiple of this apart map a column panel onto a few cache sets
LDB_PAD = 32                # ... so such rows are stored this many elements longer


def padded_ldb(N: int, itemsize: int = 4) -> int:
    """The row stride to store a constant [K, N] right-hand matrix with: N, or N + LDB_PAD where rows
    of N would be a multiple of LDB_ALIGN_BYTES apart (the register tile then reads the panel in place
    instead of packing it first: MLP layers 64x512x1024 0.91 -> 0.82 ms, 64x1024x256 0.45 -> 0.39 ms
    on a 2-core AVX-512 EPYC)."""
    return N + LDB_PAD if N * itemsize % LDB_ALIGN_BYTES == 0 else N


def column_panels(K: int, N: int, width: int, ldb: int | None = None, dtype=dtypes.float32) -> UOp:
    """B [K, N] (row stride `ldb`, default N) copied as N / width column panels, each [K, width] contiguous:
    panels[p, k, c] = B[k, p * width + c], the layout `matmul_panels` reads. Params: B, panels."""
    if width < 1 or N % width:
        raise ArgumentError(f"column_panels: a width of {width} does not divide {N} columns")
    dt = as_dtype(dtype)
    ax = _Axes()
    p, k, c = ax(N // width), ax(K), ax(width)
    b, out = UOp.param(0, dt), UOp.param(1, dt)
    return UOp.sink(out.store((p * K + k) * width + c, b.load(k * (N if ldb is None else ldb) + p * width + c)))


def matmul_panels(M: int, N: int, K: int, width: int, dtype=dtypes.float32, epilogue: "Epilogue | None" = None,
                  batch: int = 1, plane_pads: tuple[int, int] = (0, 0), splits: int = 1) -> UOp:
    """`matmul` with B stored as column panels ([N / width, K, width], `column_panels`): out[i, p * width + c]
    = sum over k of A[i, k] * panels[p, k, c], then `epilogue` as `matmul`'s. On the CPU `width` is the register
    tile's width: each thread-split unit's tiles read one contiguous panel, a constant right-hand matrix laid out
    so once, where `matmul` reads B's rows in place (a step a row apart) or copies each panel first at every
    launch. `batch` > 1: that many independent products, the outermost range (channels-last Winograd's planes):
    A's planes `plane_pads[0]` elements apart beyond [M, K], the panels' [N / width, K, width] planes adjacent,
    the outputs' `plane_pads[1]` apart beyond [M, N] (an epilogue then takes no operands). `splits` > 1: the
    reduction cut into that many equal runs, part[s, i, col] the sum over run s (the outermost range: each
    thread-split unit one run of one panel, where a few rows leave fewer panels than workers), no epilogue;
    `split_rows_sum` adds the runs. Params: A, panels, the epilogue's operands, C (part)."""
    if width < 1 or N % width:
        raise ArgumentError(f"matmul_panels: a width of {width} does not divide {N} columns")
    if batch < 1:
        raise ArgumentError(f"matmul_panels: a batch of {batch}")
    if splits > 1:
        if batch > 1 or epilogue:
            raise ArgumentError(f"matmul_panels: {splits} runs of the reduction take no batch and no epilogue")
        if not isinstance(K, int) or K % splits:
            raise ArgumentError(f"matmul_panels: {splits} runs do not divide the reduction of {K}")
        return _matmul_panels_split(M, N, K, width, as_dtype(dtype), splits)
    if splits < 1:
        raise ArgumentError(f"matmul_panels: {splits} runs of the reduction")
    epi = epilogue or Epilogue()
    if batch > 1 and epi.operands:
        raise ArgumentError(f"matmul_panels: a batch of products takes an epilogue without operands, got {epi}")
    dt = as_dtype(dtype)
    M, K = size(M, "M"), size(K, "K")
    a, b = UOp.param(0, dt), UOp.param(1, dt)
    ax = _Axes()
    if batch == 1:
        p, i, c = ax(N // width), ax(M), ax(width)
        k = ax(K, AxisType.REDUCE)
        acc = (a.load(i * _end(K) + k) * b.load((p * _end(K) + k) * width + c)).reduce(k)
        col = p * width + c
        at = i * N + col
    else:
        s, p, i, c = ax(batch), ax(N // width), ax(M), ax(width)
        k = ax(K, AxisType.REDUCE)
        a_at = s * (_end(M) * _end(K) + plane_pads[0]) + i * _end(K) + k
        acc = (a.load(a_at) * b.load(((s * (N // width) + p) * _end(K) + k) * width + c)).reduce(k)
        col = p * width + c
        at = s * (_end(M) * N + plane_pads[1]) + i * N + col
    v, nxt = epi.apply(acc, 2, dt, col, at)
    return UOp.sink(UOp.param(nxt, dt).store(at, v))


def _matmul_panels_split(M: int, N: int, K: int, width: int, dt, splits: int) -> UOp:
    """part[s, i, col] = sum over k in run s of A[i, k] * panels[col // width, k, col % width] (`matmul_panels`)."""
    M = size(M, "M")
    Ks = K // splits
    a, b = UOp.param(0, dt), UOp.param(1, dt)
    ax = _Axes()
    s, p, i, c = ax(splits), ax(N // width), ax(M), ax(width)
    k = ax(Ks, AxisType.REDUCE)
    kk = s * Ks + k
    acc = (a.load(i * K + kk) * b.load((p * K + kk) * width + c)).reduce(k)
    return UOp.sink(UOp.param(2, dt).store((s * _end(M) + i) * N + p * width + c, acc))


def split_rows_sum(M: int, N: int, splits: int, dtype=dtypes.float32, epilogue: "Epilogue | None" = None) -> UOp:
    """out[i, col] = sum over s of part[s, i, col], then `epilogue` (bias per column, tensor operands of out's
    shape [M, N]): the runs of `matmul_panels(splits=)` added, each row's columns contiguous. Params: part,
    the epilogue's operands, out."""
    if splits < 1:
        raise ArgumentError(f"split_rows_sum: {splits} runs")
    dt = as_dtype(dtype)
    M = size(M, "M")
    ax = _Axes()
    i, col = ax(M), ax(N)
    part = UOp.param(0, dt)
    v = None
    for s in range(splits):
        t = part.load((s * _end(M) + i) * N + col)
        v = t if v is None else v + t
    at = i * N + col
    v, nxt = (epilogue or Epilogue()).apply(v, 1, dt, col, at)
    return UOp.sink(UOp.param(nxt, dt).store(at, v))


def matmul_bias_relu(M=None, N=None, K=None, relu: bool = True, dtype=dtypes.float32) -> UOp:
    """out[M,N] = max(A @ W + bias[N], 0): a fused dense layer."""
    return matmul(M, N, K, dtype, Epilogue.of("bias", "relu") if relu else Epilogue.of("bias"))


def conv2d(N, C: int, H: int, W: int, CO: int, KH: int, KW: int, stride: int = 1, dilation: int = 1,
           bias: bool = False, relu: bool = False, dtype=dtypes.float32, epilogue: "Epilogue | None" = None,
           pads: tuple[int, int, int, int] = (0, 0, 0, 0), tap_major: bool = False) -> UOp:
    """out[N, CO, OH, OW] = sum over (c, kh, kw) of x[n, c, oh*stride + kh*dilation - top,
    ow*stride + kw*dilation - left] * w[co, c, kh, kw] (NCHW), then + b[co] and max(., 0) when asked, then
    `epilogue`. `pads` (top, left, bottom, right): zero padding read through masked taps (`_conv_tap`), no
    padded copy of the input. `tap_major`: the reduction runs over (kh, kw, c), the channel fastest, and
    w is given as [CO, KH, KW, C] (`conv_weights_tap_major`): where C is a multiple of a tile's k depth, each
    k tile then holds one tap, whose coordinates and mask a tile fill computes once per row (see
    codegen/strategies/tensor_core.py, `k_parts`). Params: x, w, (b,) the epilogue's operands, out.

    Written as an implicit GEMM: the output pixels (n, oh, ow) are the rows of a matmul, the output
    channels its columns and the taps (c, kh, kw) its k. No im2col buffer exists: each A element's
    input address is computed where the tile is filled. The contraction has matmul's shape, so a
    float16/bfloat16 convolution takes the tensor cores where matmul does (float32 accumulation) and
    a float32 one the shared-memory tiles. The batch N may be symbolic (None); the rest is static.
    On the CPU, codegen/strategies/conv.py plans faster kernel sequences (pointwise, im2col, depthwise)."""
    dt = as_dtype(dtype)
    geo = {"C": C, "H": H, "W": W, "CO": CO, "KH": KH, "KW": KW, "stride": stride, "dilation": dilation}
    for k, v in geo.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ArgumentError(f"conv2d: {k} must be a positive int, got {v!r}")
    if len(pads) != 4 or any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in pads):
        raise ArgumentError(f"conv2d: pads must be 4 ints >= 0 (top, left, bottom, right), got {pads!r}")
    pt, pl, pb, pr = pads
    OH = _out_size(H, KH, stride, dilation, pt, pb)
    OW = _out_size(W, KW, stride, dilation, pl, pr)
    if OH < 1 or OW < 1:
        raise ArgumentError(f"conv2d: a {KH}x{KW} kernel (dilation {dilation}) does not fit a {H}x{W} input "
                            f"padded by {pads}")
    steps = (("bias",) if bias else ()) + (("relu",) if relu else ())
    epi = Epilogue(steps + (epilogue.steps if epilogue is not None else ()))
    N = size(N, "N")
    x, w = UOp.param(0, dt), UOp.param(1, dt)
    P, K = OH * OW, C * KH * KW
    i = UOp.range(_end(N) * P, 0)                  # (n, oh, ow)
    j = UOp.range(CO, 1)                           # co
    k = UOp.range(K, 2, AxisType.REDUCE)           # (c, kh, kw)
    n, oh, ow = i // P, (i // OW) % OH, i % OW
    if tap_major:
        tap, c = k // C, k % C
        kh, kw = tap // KW, tap % KW
    else:
        c, kh, kw = k // (KH * KW), (k // KW) % KH, k % KW
    masked = (_needs_mask(H, OH, KH, stride, dilation, pt), _needs_mask(W, OW, KW, stride, dilation, pl))
    if (KH, KW) == (1, 1) and stride == 1 and not any(pads):
        # a 1x1 layer reads pixel i % P of channel k: one division (the GPU's tile fills prove 8-element runs
        # of it contiguous where 8 divides P, codegen/gpu_tile._lane_form, where (row, column) needs 8 | OW).
        # 256 -> 64 at 56x56, batch 32, on the H200 (nvrtc / llvm-nvptx; benchmarks/conv.py, conv-nvrtc.json and
        # conv-llvm-nvptx.json at 559d406): float16 82.8 / 81.9 -> 109.7 / 112.9 TFLOP/s (the warpgroup pipeline;
        # cuDNN 118), float32 25.8 / 28.1 -> 30.1 / 29.3
        xv = x.load((n * C + k) * P + i % P)
    elif any(masked):
        xv = _conv_tap(x, n * (C * H * W) + c * (H * W), H, W, (oh * stride - pt, kh * dilation),
                       (ow * stride - pl, kw * dilation), dt, masked)
    else:
        xv = x.load(((n * C + c) * H + oh * stride + kh * dilation - pt) * W + ow * stride + kw * dilation - pl
                    if any(pads) else ((n * C + c) * H + oh * stride + kh * dilation) * W + ow * stride + kw * dilation)
    at = (n * CO + j) * P + oh * OW + ow
    v, nxt = epi.apply((xv * w.load(j * K + k)).reduce(k), 2, dt, j, at)
    return UOp.sink(UOp.param(nxt, dt).store(at, v))


def conv_weights_tap_major(CO: int, C: int, KH: int, KW: int, dtype=dtypes.float32) -> UOp:
    """wt[co, kh, kw, c] = w[co, c, kh, kw]: the weights as `conv2d(..., tap_major=True)` reads them. One
    flat range over the output (contiguous, vectorized stores; the loads gather): as (co, tap, c) ranges the
    GPU schedule took the tiled transpose, one 9 x C tile per output channel (64 work-groups for 64 channels,
    7.4 us on an H100 beside a 67.5 us convolution, benchmarks/results/nvidia-h100/conv-nvrtc.json). Params: w, wt."""
    dt = as_dtype(dtype)
    T = KH * KW
    e = UOp.range(CO * T * C, 0)
    co, t, c = e // (T * C), (e // C) % T, e % C
    w, wt = UOp.param(0, dt), UOp.param(1, dt)
    return UOp.sink(wt.store(e, w.load((co * C + c) * T + t)))


def _conv_tap(x: UOp, base: UOp, H: int, W: int, y: tuple[UOp, UOp], xx: tuple[UOp, UOp], dt: DType,
              masked: tuple[bool, bool]) -> UOp:
    """x[base + y*W + xx], zero where (y, xx) falls outside the H x W plane: the implicit GEMM's masked
    tap, each coordinate given as (the output pixel's part, the tap's part) so that the pixel's share of
    the offset is one value a tile fill computes once per row. The load's in-plane offset is clamped as
    one value (two operations; `_tap` clamps each coordinate, four): outside the plane it reads some
    element of the plane, and the mask discards it (codegen/strategies/tensor_core.py takes
    where(mask, load, 0) as an operand and applies the mask where it fills a tile)."""
    (py, ty), (px, tx) = y, xx
    ok = None
    # 0 <= y < H as one unsigned comparison (a negative y wraps past H)
    if masked[0]:
        ok = (py + ty).cast(dtypes.uint32) < UOp.const(H, dtypes.uint32)
    if masked[1]:
        okx = (px + tx).cast(dtypes.uint32) < UOp.const(W, dtypes.uint32)
        ok = okx if ok is None else ok & okx
    v = x.load(base + ((py * W + px) + (ty * W + tx)).clamp(0, H * W - 1))
    return ok.where(v, UOp.const(0, dt))


# ---- the CPU convolution family (NCHW): codegen/strategies/conv.py chooses among these -------------

class _Axes:
    """Ranges with fresh axis numbers; an extent of 1 is the constant 0 (no range); an extent may be a
    UOp (a symbolic size)."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self, extent, kind: AxisType = AxisType.GLOBAL) -> UOp:
        if isinstance(extent, int) and extent == 1:
            return UOp.const(0, dtypes.index)
        r = UOp.range(extent, self.next, kind)
        self.next += 1
        return r


# the longest reduction a convolution contraction with the variable `K` takes (4096 channels of 11x11 taps are
# 495,616 steps): bounded, so that the register tile's packed panel of K steps fits a scratch sized from it
# (codegen/opt.py, PACK_CAP); a longer one is refused by the launch check as a bad value of K
CONV_MAX_K = 1 << 19


def _k_variable() -> UOp:
    return UOp.variable("K", 1, CONV_MAX_K)


def conv_gemm(N: int | None, G: int, COg: int, Kg: int | None, P: int, dtype=dtypes.float32,
              epilogue: Epilogue | None = None, pixel_blocks: int = 1,
              plane_pads: tuple[int, int] = (0, 0)) -> UOp:
    """out[n, g*COg + co, p] = sum over k of w[g*COg + co, k] * x[n, g*Kg + k, p], then `epilogue`
    (bias per output channel, tensor operands of out's shape [N, G*COg, P]): a 1x1 convolution
    (x the input, Kg its channels per group) or any convolution after `im2col` (x the columns), as
    batched contractions. The output channels are the rows and the pixels the unit-stride columns
    of the CPU register tile: a column of x is loaded once for a tile's rows. `pixel_blocks` (a
    divisor of P) cuts each image's pixels into that many blocks and makes (image, block) the outermost
    range, which the CPU splits over threads (a batch of 8 alone kept 8 of 16 cores busy). Kg None is
    the variable `K` (one program for the layers that differ only in their input channels, as a
    DenseNet's do); N None is the variable `N` (a dynamic batch). `plane_pads` (one image only): elements
    added between consecutive groups' planes of x and of out (the Winograd planes, `winograd_plane_pad`).
    Params: x, w, the epilogue's operands, out."""
    if pixel_blocks < 1 or P % pixel_blocks:
        raise ArgumentError(f"conv_gemm: {pixel_blocks} pixel blocks do not divide {P} pixels")
    if any(plane_pads) and N != 1:
        raise ArgumentError(f"conv_gemm: plane pads {plane_pads} lay out the planes of one image, not N={N}")
    dt = as_dtype(dtype)
    ax = _Axes()
    B = P // pixel_blocks
    if pixel_blocks == 1:
        n, g, co, p = ax(_batch(N)), ax(G), ax(COg), ax(P)
    else:
        t, g, co, pi = ax(_batch(N) * pixel_blocks if N is None else N * pixel_blocks), ax(G), ax(COg), ax(B)
        n, p = t // pixel_blocks, (t % pixel_blocks) * B + pi
    Kg = _k_variable() if Kg is None else Kg
    k = ax(Kg, AxisType.REDUCE)
    x, w = UOp.param(0, dt), UOp.param(1, dt)
    ch = g * COg + co
    at_x = (n * (G * Kg) + g * Kg + k) * P + p
    prod_ = x.load(at_x + g * plane_pads[0] if plane_pads[0] else at_x) * w.load(ch * Kg + k)
    acc = prod_.reduce(k) if k.op is Ops.RANGE else prod_
    at = (n * (G * COg) + ch) * P + p
    if plane_pads[1]:
        at = at + g * plane_pads[1]
    v, nxt = (epilogue or Epilogue()).apply(acc, 2, dt, ch, at)
    return UOp.sink(UOp.param(nxt, dt).store(at, v))


def conv_weights_t(CO: int, Kg: int | None = None, dtype=dtypes.float32) -> UOp:
    """wt[k, co] = w[co, k]: a one-group convolution's weights [CO, C*KH*KW] transposed, so that
    `conv_gemm_pixel_rows` loads a row of output channels as one vector (a weights-only step: an executor
    whose weights stay the same runs it once). Kg None is the variable `K`. Params: w, wt."""
    dt = as_dtype(dtype)
    ax = _Axes()
    Kg = _k_variable() if Kg is None else Kg
    k, co = ax(Kg), ax(CO)
    w, wt = UOp.param(0, dt), UOp.param(1, dt)
    return UOp.sink(wt.store(k * CO + co, w.load(co * Kg + k)))


def conv_gemm_pixel_rows(N: int | None, CO: int, Kg: int | None, P: int, dtype=dtypes.float32,
                         run: int | None = None, accumulate: bool = False) -> UOp:
    """tmp[n, p, co] = sum over k of x[n, k, p] * wt[k, co]: `conv_gemm` with the roles of its operands
    swapped for layers of few pixels and many output channels (resnet50's 7x7 and 14x14 stages). The
    pixels are the CPU register tile's rows (their broadcasts are neighbours in one row of x) and the
    output channels its unit-stride vector columns (`conv_weights_t`'s rows), so the large operand, the
    weights, streams once per row tile of pixels instead of once per column tile of a few pixels; the
    output lands channels-last for `conv_output_t`.

    `run` (a static length): the sum covers k0 <= k < k0 + run only, k0 the variable `k0`, and with
    `accumulate` adds the previous run's tmp (a param before the output): a long reduction cut into runs
    whose operand tiles stay in the core's caches (the register tile walks every row tile over one run).
    Kg None is the variable `K` (x's channels per image), N None the variable `N`.
    Params: x (the input of a 1x1 convolution or `im2col`'s columns), wt, [the previous run's tmp], tmp."""
    dt = as_dtype(dtype)
    ax = _Axes()
    n, p, co = ax(_batch(N)), ax(P), ax(CO)
    Kg = _k_variable() if Kg is None else Kg
    if run is not None and run < 1:
        raise ArgumentError(f"conv_gemm_pixel_rows: a run of {run} steps")
    k = ax(Kg if run is None else run, AxisType.REDUCE)
    kk = k if run is None else UOp.variable("k0", 0, 2**31 - 1) + k
    x, wt = UOp.param(0, dt), UOp.param(1, dt)
    prod_ = x.load((n * Kg + kk) * P + p) * wt.load(kk * CO + co)
    acc = prod_.reduce(k) if k.op is Ops.RANGE else prod_
    at = (n * P + p) * CO + co
    if accumulate:
        acc = acc + UOp.param(2, dt).load(at)
    return UOp.sink(UOp.param(3 if accumulate else 2, dt).store(at, acc))


def conv_output_t(N: int | None, CO: int, P: int, dtype=dtypes.float32, epilogue: Epilogue | None = None) -> UOp:
    """out[n, co, p] = tmp[n, p, co], then `epilogue` (bias per output channel, tensor operands of out's
    shape [N, CO, P]): `conv_gemm_pixel_rows`' channels-last result put back in NCHW. N None is the
    variable `N`. Params: tmp, the epilogue's operands, out."""
    dt = as_dtype(dtype)
    ax = _Axes()
    # the channels innermost: contiguous loads, stores P apart. The reverse (pixels innermost, loads CO apart)
    # took 0.29 against 0.086 ms at 2048 x 49 and 0.41 against 0.11 ms at 1024 x 196 with a bias and relu
    # (alone on a 2-vCPU AVX2 EPYC)
    n, p, co = ax(_batch(N)), ax(P), ax(CO)
    at = (n * CO + co) * P + p
    v, nxt = (epilogue or Epilogue()).apply(UOp.param(0, dt).load((n * P + p) * CO + co), 1, dt, co, at)
    return UOp.sink(UOp.param(nxt, dt).store(at, v))


def _batch(N: int | None):
    """A static batch, or the variable `N` for None."""
    return UOp.variable("N", 1, 2**31 - 1) if N is None else N


def _out_size(n: int, k: int, stride: int, dilation: int, lo: int, hi: int) -> int:
    return (n + lo + hi - (k - 1) * dilation - 1) // stride + 1


def _tap(x: UOp, base: UOp, H: int, W: int, y: UOp, xx: UOp, dt: DType, masked: tuple[bool, bool]) -> UOp:
    """x[base + y*W + xx], zero where (y, xx) falls outside the H x W plane (padding); a coordinate
    that provably stays inside is not checked."""
    ok = None
    if masked[0]:
        ok = (y >= 0) & (y < H)
        y = y.clamp(0, H - 1)
    if masked[1]:
        okx = (xx >= 0) & (xx < W)
        ok = okx if ok is None else ok & okx
        xx = xx.clamp(0, W - 1)
    v = x.load(base + y * W + xx)
    return v if ok is None else ok.where(v, UOp.const(0, dt))


def _needs_mask(n_in: int, n_out: int, k: int, stride: int, dilation: int, lo: int) -> bool:
    return lo > 0 or (n_out - 1) * stride + (k - 1) * dilation - lo >= n_in


def im2col(N: int | None, C: int, H: int, W: int, KH: int, KW: int, stride: tuple[int, int] = (1, 1),
           dilation: tuple[int, int] = (1, 1), pads: tuple[int, int, int, int] = (0, 0, 0, 0),
           dtype=dtypes.float32, peel: bool = False) -> UOp:
    """col[n, (c, kh, kw), (oh, ow)] = x[n, c, oh*sh + kh*dh - top, ow*sw + kw*dw - left], zero in the
    padding (pads: top, left, bottom, right): the columns `conv_gemm` contracts with the weights
    [CO, C*KH*KW]. N None is the variable `N`. `peel` (the CPU's plans, one image): each kernel column kw
    is a store of its own whose output columns with every tap inside the row run unmasked along the row
    (`_im2col_rows`). Params: x, col."""
    dt = as_dtype(dtype)
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = stride, dilation, pads
    OH, OW = _out_size(H, KH, sh, dh, pt, pb), _out_size(W, KW, sw, dw, pl, pr)
    if peel and N == 1 and _needs_mask(W, OW, KW, sw, dw, pl):
        return _im2col_rows(C, H, W, KH, KW, OH, OW, (sh, sw), (dh, dw), (pt, pl), dt)
    ax = _Axes()
    # the batch alone is the outermost range (the CPU's thread split): with (n, c, kh) there, columns larger
    # than the last-level cache took the runtime's streaming variant, whose non-temporal stores came out
    # 8-byte and misaligned (8x64x56x56 3x3 columns, 58 MB: 7.2 -> 105 ms on a 2-core AVX-512 EPYC)
    # One image: (channel, kernel row) is the outermost range instead, else a 3-channel stem left 3 units for
    # the workers (resnet50's 7x7 stem columns took 0.61 ms on the H100 host's 16-core Xeon, 3 workers busy)
    if N == 1:
        n, t = 0, ax(C * KH)
        c, kh = t // KH, t % KH
        kw, oh, ow = ax(KW), ax(OH), ax(OW)
    else:
        n, c, kh, kw, oh, ow = ax(_batch(N)), ax(C), ax(KH), ax(KW), ax(OH), ax(OW)
    x, col = UOp.param(0, dt), UOp.param(1, dt)
    masked = (_needs_mask(H, OH, KH, sh, dh, pt), _needs_mask(W, OW, KW, sw, dw, pl))
    v = _tap(x, (n * C + c) * (H * W), H, W, oh * sh + kh * dh - pt, ow * sw + kw * dw - pl, dt, masked)
    at = (((n * C + c) * KH + kh) * KW + kw) * (OH * OW) + oh * OW + ow
    return UOp.sink(col.store(at, v))


def _im2col_rows(C: int, H: int, W: int, KH: int, KW: int, OH: int, OW: int, stride: tuple[int, int],
                 dilation: tuple[int, int], lo: tuple[int, int], dt: DType) -> UOp:
    """`im2col` of one image with the padding's column checks peeled: (channel, kernel row), cut into blocks of
    output rows where those units are few (`im2col_row_blocks`), is the GLOBAL range; for each kernel column kw the output columns whose tap lies inside the row (`_tap_span`) run
    as a loop with only the row checked (one select per row, loop-invariant), the few columns either
    side of it masked. The masked form clamped every element's column, so LLVM gathered scalars: resnet50's
    7x7 stride-2 stem columns (3 x 224^2 -> 147 x 112^2) took 2.6-2.7 ms alone on the 2-vCPU AVX2 EPYC,
    one or two threads."""
    (sh, sw), (dh, dw), (pt, pl) = stride, dilation, lo
    ax = _Axes()
    blocks = im2col_row_blocks(C * KH, OH)
    t = ax(C * KH * blocks)
    c, kh, ob = t // (KH * blocks), (t // blocks) % KH, t % blocks
    x, col = UOp.param(0, dt), UOp.param(1, dt)
    row_masked = _needs_mask(H, OH, KH, sh, dh, pt)
    stores = []
    for kw in range(KW):
        first, last = _tap_span(W, OW, sw, kw * dw - pl)
        for a, b, col_masked in ((0, first - 1, True), (first, last, False), (last + 1, OW - 1, True)):
            if a > b:
                continue
            oh = ax(OH // blocks, AxisType.LOOP) + ob * (OH // blocks) if blocks > 1 else ax(OH, AxisType.LOOP)
            ow = ax(b - a + 1, AxisType.LOOP) + a if b > a else UOp.const(a, dtypes.index)
            v = _tap(x, c * (H * W), H, W, oh * sh + kh * dh - pt, ow * sw + kw * dw - pl, dt, (row_masked, col_masked))
            stores.append(col.store(((c * KH + kh) * KW + kw) * (OH * OW) + oh * OW + ow, v))
    return UOp.sink(*stores)


# the fewest units the peeled im2col's thread split (channel, kernel row[, block of output rows]) takes: resnet50's
# 7x7 stem over 3 channels is 21 (channel, kernel row) units, which 16 workers took 2 and 1 at a time
IM2COL_MIN_UNITS = 48
IM2COL_MIN_BLOCK_ROWS = 4   # output rows a block keeps at least


def im2col_row_blocks(units: int, OH: int) -> int:
    """Blocks of output rows each unit of a copy kernel's thread split is cut into (the peeled im2col's (channel,
    kernel row), `phase_pad`'s (image and channel, row phase)): the fewest that divide OH and bring the units to
    IM2COL_MIN_UNITS, of at least IM2COL_MIN_BLOCK_ROWS rows each (else the most such blocks; 1: uncut)."""
    best = 1
    for b in range(2, OH // IM2COL_MIN_BLOCK_ROWS + 1):
        if units * best >= IM2COL_MIN_UNITS:
            break
        if OH % b == 0:
            best = b
    return best


def _tap_span(n_in: int, n_out: int, stride: int, offset: int) -> tuple[int, int]:
    """(first, last) output position o with 0 <= o*stride + offset < n_in (first > last: none)."""
    first = max(0, -(-(-offset) // stride))
    last = min(n_out - 1, (n_in - 1 - offset) // stride)
    return first, max(last, first - 1)


def depthwise_conv2d(N: int | None, C: int, H: int, W: int, KH: int, KW: int, stride: tuple[int, int] = (1, 1),
                     dilation: tuple[int, int] = (1, 1), pads: tuple[int, int, int, int] = (0, 0, 0, 0),
                     dtype=dtypes.float32, epilogue: Epilogue | None = None, flat: bool = False) -> UOp:
    """out[n, c, oh, ow] = sum over (kh, kw) of w[c, kh, kw] * x[n, c, oh*sh + kh*dh - top,
    ow*sw + kw*dw - left] (zero padding), then `epilogue`: a convolution with one input channel per
    group and one output channel per input channel. The taps are unrolled (no reduction loop); every
    (n, c, oh, ow) is a GLOBAL range (a GPU's work-items; the CPU splits the (n, c) planes over threads
    and LLVM vectorizes the rows along ow, masked taps at the borders). `flat` (the CPU's
    depthwise_flat plan; stride 1, the width kept: strategies/conv.flat_spans) runs each plane's inner
    rows as one flat loop instead (`_flat_planes`). N None is the variable `N`. Params: x, w, the
    epilogue's operands, out."""
    dt = as_dtype(dtype)
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = stride, dilation, pads
    OH, OW = _out_size(H, KH, sh, dh, pt, pb), _out_size(W, KW, sw, dw, pl, pr)
    ax = _Axes()
    q = ax(_batch(N) * C if N is None else N * C)
    c = q % C if N is None or N > 1 else q
    epi = epilogue or Epilogue()
    if flat:
        spans = flat_spans(H, W, OH, OW, KH, KW, stride, dilation, pt, pl)
        if spans is None:
            raise ArgumentError(f"depthwise_conv2d: no flat loop for a {KH}x{KW} kernel at stride {stride}, "
                                f"pads {pads} over {H}x{W}")
        w = UOp.param(1, dt)
        wts = [[[w.load(c * (KH * KW) + kh * KW + kw) for kw in range(KW)] for kh in range(KH)]]
        return _flat_planes([q * (H * W)], [(c, q * (OH * OW), wts)], H, W, OH, KH, KW, (dh, dw), (pt, pl),
                            spans[0], spans[1], dt, epi, ax)
    oh, ow = ax(OH), ax(OW)
    x, w = UOp.param(0, dt), UOp.param(1, dt)
    masked = (_needs_mask(H, OH, KH, sh, dh, pt), _needs_mask(W, OW, KW, sw, dw, pl))
    acc = None
    for kh in range(KH):
        for kw in range(KW):
            t = _tap(x, q * (H * W), H, W, oh * sh + kh * dh - pt, ow * sw + kw * dw - pl, dt, masked)
            term = t * w.load(c * (KH * KW) + kh * KW + kw)
            acc = term if acc is None else acc + term
    at = q * (OH * OW) + oh * OW + ow
    v, nxt = epi.apply(acc, 2, dt, c, at)
    return UOp.sink(UOp.param(nxt, dt).store(at, v))


def _flat_planes(bases: list[UOp], outs: list[tuple[UOp, UOp, list]], H: int, W: int, OH: int, KH: int, KW: int,
                 dilation: tuple[int, int], lo: tuple[int, int], rows: tuple[int, int], cols: tuple[int, int],
                 dt: DType, epi: Epilogue, ax: "_Axes") -> UOp:
    """Output planes of a stride-1 convolution whose output rows are as wide as its input rows (OW == W):
    each of `outs` (its channel, its plane's offset, weights[input plane][kh][kw]) sums the input planes
    at `bases`; output f = oh*W + ow reads input f + (kh*dh - top)*W + kw*dw - left for tap (kh, kw).
    The rows `rows` (whose every vertical tap is inside) run as one flat loop over f that computes every
    output plane from the same loads: unit-stride loads at KH*KW constant offsets per input plane, one
    long vectorized loop however short a row is. A column of taps that would wrap into the neighbouring
    row near the border (outside `cols`) is summed first and zeroed by one select on ow = f % W; its
    loads stay inside the plane. The few positions at the loop's two ends whose taps would leave the
    plane, and the rows above and below `rows`, are stores of their own with the taps that fall outside
    dropped at build time (a border row: a loop over `cols` between peeled corners). Measured on a 2-core
    AVX-512 EPYC, depthwise 3x3 alone: 8x96x28x28 0.55 -> 0.14 ms, 8x16x56x56 0.34 -> 0.07 ms against
    the masked loop over ow."""
    (dh, dw), (pt, pl) = dilation, lo
    x = UOp.param(0, dt)
    zero = UOp.const(0.0, dt)
    stores: list[UOp] = []

    def emit(c: UOp, acc: UOp | None, at: UOp) -> None:
        v, nxt = epi.apply(acc if acc is not None else zero, 2, dt, c, at)
        stores.append(UOp.param(nxt, dt).store(at, v))

    def tap_ok(o: int, k: int, d: int, p: int, n: int) -> bool:
        return 0 <= o + k * d - p < n

    def region(oh, ow, khs, kws) -> None:
        loads = {(b, kh, kw): x.load(base + (oh + kh * dh - pt) * W + ow + kw * dw - pl)
                 for b, base in enumerate(bases) for kh in khs for kw in kws}
        for c, base_out, wts in outs:
            acc = None
            for (b, kh, kw), v in loads.items():
                t = v * wts[b][kh][kw]
                acc = t if acc is None else acc + t
            emit(c, acc, base_out + oh * W + ow)

    def point(oh: int, ow: int) -> None:
        region(oh, ow, [kh for kh in range(KH) if tap_ok(oh, kh, dh, pt, H)],
               [kw for kw in range(KW) if tap_ok(ow, kw, dw, pl, W)])

    def edge_row(oh: int) -> None:
        for ow in range(cols[0]):
            point(oh, ow)
        n = cols[1] - cols[0] + 1
        ow = ax(n, AxisType.LOOP) + cols[0] if n > 1 else UOp.const(cols[0], dtypes.index)
        region(oh, ow, [kh for kh in range(KH) if tap_ok(oh, kh, dh, pt, H)], range(KW))
        for ow in range(cols[1] + 1, W):
            point(oh, ow)

    for oh in range(rows[0]):
        edge_row(oh)
    offs = [(kh * dh - pt) * W + kw * dw - pl for kh in range(KH) for kw in range(KW)]
    f0, f1 = max(rows[0] * W, -min(offs)), min((rows[1] + 1) * W, H * W - max(offs))
    for f in range(rows[0] * W, f0):
        point(*divmod(f, W))
    if f1 > f0:
        f = ax(f1 - f0, AxisType.LOOP) + f0 if f1 - f0 > 1 else UOp.const(f0, dtypes.index)
        ow = f % W
        loads = {(b, kh, kw): x.load(base + f + ((kh * dh - pt) * W + kw * dw - pl))
                 for b, base in enumerate(bases) for kh in range(KH) for kw in range(KW)}
        for c, base_out, wts in outs:
            acc = None
            for kw in range(KW):
                col = None
                for b in range(len(bases)):
                    for kh in range(KH):
                        t = loads[(b, kh, kw)] * wts[b][kh][kw]
                        col = t if col is None else col + t
                first, last = max(0, pl - kw * dw), min(W - 1, W - 1 + pl - kw * dw)    # ow this column reads inside
                ok = None
                if first > 0:
                    ok = ow >= first
                if last < W - 1:
                    ok = (ow <= last) if ok is None else ok & (ow <= last)
                col = col if ok is None else ok.where(col, zero)
                acc = col if acc is None else acc + col
            emit(c, acc, base_out + f)
    for f in range(max(f1, f0), (rows[1] + 1) * W):
        point(*divmod(f, W))
    for oh in range(rows[1] + 1, OH):
        edge_row(oh)
    return UOp.sink(*stores)


def grouped_conv2d_flat(N: int | None, C: int, H: int, W: int, CO: int, KH: int, KW: int, groups: int,
                        dilation: tuple[int, int] = (1, 1), pads: tuple[int, int, int, int] = (0, 0, 0, 0),
                        dtype=dtypes.float32, epilogue: Epilogue | None = None) -> UOp:
    """A stride-1 grouped convolution that keeps the width (strategies/conv.flat_spans) with few
    channels per group: each (image, group) sums its C/groups input planes into its CO/groups output
    planes in one flat loop (`_flat_planes`: every input vector loaded once for all of them), the
    (image, group) units split over threads; no im2col columns (a ResNeXt layer's are 9x its input).
    N None is the variable `N`. Params: x, w [CO, C/groups, KH, KW], the epilogue's operands, out."""
    dt = as_dtype(dtype)
    pt, pl, pb, pr = pads
    OH, OW = _out_size(H, KH, 1, dilation[0], pt, pb), _out_size(W, KW, 1, dilation[1], pl, pr)
    spans = flat_spans(H, W, OH, OW, KH, KW, (1, 1), dilation, pt, pl)
    if spans is None or C % groups or CO % groups:
        raise ArgumentError(f"grouped_conv2d_flat: no flat loop for a {KH}x{KW} kernel, {groups} groups of "
                            f"{C} -> {CO} channels, pads {pads} over {H}x{W}")
    Cg, COg = C // groups, CO // groups
    ax = _Axes()
    u = ax(_batch(N) * groups if N is None else N * groups)        # (n, g)
    w = UOp.param(1, dt)
    bases = [(u * Cg + ci) * (H * W) for ci in range(Cg)]
    g = u % groups if N is None or N > 1 else u
    outs = []
    for co in range(COg):
        c = g * COg + co
        outs.append((c, (u * COg + co) * (OH * OW),
                     [[[w.load(c * (Cg * KH * KW) + (ci * KH + kh) * KW + kw) for kw in range(KW)] for kh in range(KH)]
                      for ci in range(Cg)]))
    return _flat_planes(bases, outs, H, W, OH, KH, KW, dilation, (pt, pl), spans[0], spans[1], dt,
                        epilogue or Epilogue(), ax)


def im2col_flat(N: int | None, C: int, H: int, W: int, KH: int, KW: int, stride: tuple[int, int] = (1, 1),
                dilation: tuple[int, int] = (1, 1), pads: tuple[int, int, int, int] = (0, 0, 0, 0),
                dtype=dtypes.float32, rows: bool = False) -> UOp:
    """col[(c, kh, kw), (n, oh, ow)] = x[n, c, oh*sh + kh*dh - top, ow*sw + kw*dw - left], zero in the
    padding: `im2col`'s columns with every image's pixels side by side in one row per tap (the GPU form,
    ConvPlan family im2col_flat), so that `flat_gemm` is one contraction over all the batch's pixels whose
    rows are contiguous. `rows` (family im2col_rows): the transpose, a pixel's taps contiguous (both of
    the contraction's operands then run along k, as a tensor core's fragments do): tap-major,
    col[(n, oh, ow), (kh, kw, c)], where the channels come in blocks of `im2col_channel_block` (the
    weights then as `conv_weights_tap_major` gives them), else col[(n, oh, ow), (c, kh, kw)]. N None is
    the variable `N`. Params: x, col."""
    dt = as_dtype(dtype)
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = stride, dilation, pads
    OH, OW = _out_size(H, KH, sh, dh, pt, pb), _out_size(W, KW, sw, dw, pl, pr)
    ax = _Axes()
    cin = im2col_channel_block(C, dt) if rows else 0
    if cin:
        # a block of cin channels innermost (a GPU's x: a few work-items, each writing a 16-byte vector of
        # one tap), the batch's pixels next (y: the rest of a warp, neighbouring pixels), (tap, channel
        # block) outermost (z). A warp's load of one lane reads a few channel planes at neighbouring
        # pixels, and a vector's lanes differ in the channel alone, sharing one tap's row and column checks
        tap, cb = ax(KH * KW), ax(C // cin)
        q = ax(_batch(N) * (OH * OW) if N is None else N * OH * OW)
        c = cb * cin + ax(cin)
        n, p = q // (OH * OW), q % (OH * OW)
        oh, ow, kh, kw = p // OW, p % OW, tap // KW, tap % KW
        t = tap * C + c
    elif rows:      # the taps innermost (a GPU's x: neighbouring work-items write neighbouring elements), the
        # pixels one range (y) under the batch (z): CUDA's grid allows 65535 in y and z
        n, p, t = ax(_batch(N)), ax(OH * OW), ax(C * KH * KW)
        oh, ow, c, kh, kw = p // OW, p % OW, t // (KH * KW), (t // KW) % KH, t % KW
    else:
        c, kh, kw, n, oh, ow = ax(C), ax(KH), ax(KW), ax(_batch(N)), ax(OH), ax(OW)
    x, col = UOp.param(0, dt), UOp.param(1, dt)
    masked = (_needs_mask(H, OH, KH, sh, dh, pt), _needs_mask(W, OW, KW, sw, dw, pl))
    v = _tap(x, (n * C + c) * (H * W), H, W, oh * sh + kh * dh - pt, ow * sw + kw * dw - pl, dt, masked)
    pix = (n * OH + oh) * OW + ow
    # rows: the store's index is contiguous in the innermost range (the channels of a block, or the taps) as
    # the vector plan sees it (codegen/strategies/vectorize.py): 16-byte stores of 8 halves and a
    # work-item's 8 gathered loads in flight
    at = pix * (C * KH * KW) + t if rows else ((c * KH + kh) * KW + kw) * (_end(_batch(N)) * (OH * OW)) + pix
    return UOp.sink(col.store(at, v))


# im2col_rows' tap-major columns: a warp's row of work-items covers this many bytes of a tap's channels (4
# 16-byte vectors: 32 halves), the rest of the warp neighbouring pixels; a layer whose channels come in
# blocks of at least IM2COL_MIN_BLOCK_BYTES takes the largest such block (narrower rows left a warp few pixels'
# worth of lines to share). On the H200 (benchmarks/conv.py, batch 32 float16, nvrtc; the columns' kernel in
# benchmarks/results/nvidia-h200/conv-nvrtc.json, kernel_us): 256 channels at 14x14 15.0 us, 512 at 7x7 9.5,
# 256 at 28x28 stride 2 22.1, where the (c, kh, kw) taps on the lanes took 25.1, 12.7 and 27.2
IM2COL_BLOCK_BYTES = 64
IM2COL_MIN_BLOCK_BYTES = 32


def im2col_channel_block(C: int, dt: DType) -> int:
    """The channels of one block in im2col_rows' tap-major columns (`im2col_flat(rows=True)`), or 0 where C
    has no block of at least IM2COL_MIN_BLOCK_BYTES (the columns then keep the (c, kh, kw) order, the taps
    on the lanes)."""
    size = IM2COL_BLOCK_BYTES
    while size >= IM2COL_MIN_BLOCK_BYTES:
        if size % dt.itemsize == 0 and C % (size // dt.itemsize) == 0:
            return size // dt.itemsize
        size //= 2
    return 0


def flat_gemm(N: int | None, CO: int, K: int, P: int, dtype=dtypes.float32, epilogue: Epilogue | None = None,
              rows: bool = False) -> UOp:
    """out[n, co, p] = sum over k of w[co, k] * col[k, n*P + p], then `epilogue`: the contraction of
    `im2col_flat`'s columns [K, N*P] with the weights [CO, K], the batch's pixels as one range of rows (a
    GPU's tiles see N*P rows whose loads are contiguous, however few pixels one image has). `rows`: the
    columns transposed, col[n*P + p, k]. N None is the variable `N`. Params: col, w, the epilogue's
    operands, out."""
    dt = as_dtype(dtype)
    NP = _end(_batch(N)) * P
    i = UOp.range(NP, 0)                           # (n, p)
    j = UOp.range(CO, 1)                           # co
    k = UOp.range(K, 2, AxisType.REDUCE)
    col, w = UOp.param(0, dt), UOp.param(1, dt)
    at = (i // P) * (CO * P) + j * P + i % P
    a = col.load(i * K + k) if rows else col.load(k * NP + i)
    v, nxt = (epilogue or Epilogue()).apply((a * w.load(j * K + k)).reduce(k), 2, dt, j, at)
    return UOp.sink(UOp.param(nxt, dt).store(at, v))


def flat_gemm_split(N: int | None, CO: int, K: int, P: int, split: int, dtype=dtypes.float32,
                    rows: bool = False) -> UOp:
    """part[s, co, n*P + p] = sum over the s-th of `split` runs of k of w[co, k] * col[k, n*P + p] (`rows`:
    col[n*P + p, k]), in float32 for 16-bit inputs: `flat_gemm` with its reduction cut into `split` runs
    (the run a GLOBAL range: the tiles' batch), where the output alone makes too few work-groups for the
    GPU; `split_sum` adds the runs. N None is the variable `N`. Params: col, w, part."""
    dt = as_dtype(dtype)
    if split < 1 or K % split:
        raise ArgumentError(f"flat_gemm_split: {split} runs do not divide the reduction of {K}")
    acc = accumulation_dtype(dt)
    NP, Ks = _end(_batch(N)) * P, K // split
    s = UOp.range(split, 0)
    i = UOp.range(NP, 1)                           # (n, p)
    j = UOp.range(CO, 2)                           # co
    k = UOp.range(Ks, 3, AxisType.REDUCE)
    col, w = UOp.param(0, dt), UOp.param(1, dt)
    kk = s * Ks + k
    a, b = (col.load(i * K + kk) if rows else col.load(kk * NP + i)), w.load(j * K + kk)
    if acc != dt:
        a, b = a.cast(acc), b.cast(acc)
    return UOp.sink(UOp.param(2, acc).store((s * CO + j) * NP + i, (a * b).reduce(k)))


def split_sum(N: int | None, CO: int, P: int, split: int, dtype=dtypes.float32,
              epilogue: Epilogue | None = None) -> UOp:
    """out[n, co, p] = sum over s of part[s, co, n*P + p] (float32 for 16-bit outputs), rounded to `dtype`,
    then `epilogue`: the runs of `flat_gemm_split` added. N None is the variable `N`. Params: part, the
    epilogue's operands, out."""
    dt = as_dtype(dtype)
    acc = accumulation_dtype(dt)
    ax = _Axes()
    n, co, p = ax(_batch(N)), ax(CO), ax(P)
    NP = _end(_batch(N)) * P
    part = UOp.param(0, acc)
    v = None
    for s in range(split):
        t = part.load((s * CO + co) * NP + n * P + p)
        v = t if v is None else v + t
    v = v.cast(dt) if acc != dt else v
    at = (n * CO + co) * P + p
    v, nxt = (epilogue or Epilogue()).apply(v, 1, dt, co, at)
    return UOp.sink(UOp.param(nxt, dt).store(at, v))


# grouped_conv2d: a group's input channels unrolled (every tap loaded once per work-item for all its outputs)
# up to this many taps; past it the channels are a REDUCE range and each step loads one channel's KH*KW taps.
# A GPU schedule computes 4-8 neighbouring pixels per work-item on top, each with its own taps: 72 unrolled
# float16 taps x 8 pixels spilled (32x256x28x28, 32 groups of 8: 0.7 TFLOP/s on an H200, conv-variants-nvrtc.json)
GROUPED_UNROLL_MAX_TAPS = 36
# the outputs of a group one work-item computes: the most whose products per step (taps x outputs) stay
# within this (8 outputs x 72 taps x 8 pixels of float16 took NVRTC 10 s to compile)
GROUPED_MAX_TERMS = 288
# grouped_tile: the output pixels (rows, columns) one work-item of a grouped convolution with its channels a
# REDUCE range computes, each weight loaded once for all of them and each input tap once for the pixels that
# share it; at most GROUPED_TILE_ACCS accumulators. Measured on an H200 (32x256x28x28 * 256x8x3x3 g32, 8 outputs
# per work-item, nvrtc / llvm-nvptx, us, medians of 3 interleaved rounds; torch 74 float16, 221 float32):
# float16 1x1 103 / 111, 4x1 58 / 61, 2x2 56 / 70, 7x1 63 / 52, 4x2 57 / 60, 7x2 54 / 50, 14x1 64 / 43; float32
# 1x1 108 / 117, 4x1 70 / 71, 2x2 69 / 75, 4x2 55 / 65, 7x2 70 / 49, 14x1 85 / 44. 32x256x56x56 g32 (8 outputs):
# float16 1x1 372 / 411, 4x2 155 / 172, 8x1 185 / 175, 8x2 161 / 158, 7x2 213 / 145; float32 1x1 371 / 421, 4x2
# 154 / 182. 32x512x14x14 g32 (16 outputs): float16 1x1 99 / 148, 2x2 56 / 61, 7x1 47 / 42 (torch 51); float32
# 1x1 101 / 114, 2x2 63 / 59, 7x1 48 / 41. 32x1024x7x7 g32 (32 outputs): 7x1 took twice 1x1's time
GROUPED_TILE = (4, 2)
GROUPED_TILE_ACCS = 64
# (n, group, output block) is one GLOBAL range and a plane's tiles another: tile rows and tile columns as two
# ranges took work-groups of 32 x 8 items over 28 x 7 of them (4x1 tiles 60 against 58 us, float16, nvrtc)


def grouped_outputs(Cg: int, COg: int, KH: int, KW: int) -> int:
    """Output channels per work-item of `grouped_conv2d`: the largest divisor of COg whose products per
    step (taps unrolled at once x outputs) stay within GROUPED_MAX_TERMS."""
    taps = Cg * KH * KW if Cg * KH * KW <= GROUPED_UNROLL_MAX_TAPS else KH * KW
    return max(d for d in range(1, COg + 1) if COg % d == 0 and d * taps <= GROUPED_MAX_TERMS or d == 1)


def grouped_tile(Cg: int, COg: int, KH: int, KW: int, OH: int, OW: int, per: int | None = None) -> tuple[int, int]:
    """(rows, columns) of output pixels one work-item of `grouped_conv2d` computes: (1, 1) where a group's
    taps are unrolled; with the channels a REDUCE range, the largest divisors of OH and OW up to
    GROUPED_TILE, columns then rows cut to their next smaller divisor until the accumulators (outputs x
    pixels) are at most GROUPED_TILE_ACCS."""
    if Cg * KH * KW <= GROUPED_UNROLL_MAX_TAPS:
        return (1, 1)
    per = per if per is not None else grouped_outputs(Cg, COg, KH, KW)
    rows, cols = (max(d for d in range(1, min(n, t) + 1) if n % d == 0) for n, t in zip((OH, OW), GROUPED_TILE))
    while per * rows * cols > GROUPED_TILE_ACCS and rows * cols > 1:
        if cols > 1:
            cols = max(d for d in range(1, cols) if OW % d == 0)
        else:
            rows = max(d for d in range(1, rows) if OH % d == 0)
    return (rows, cols)


def grouped_conv2d(N: int | None, C: int, H: int, W: int, CO: int, KH: int, KW: int, groups: int,
                   stride: tuple[int, int] = (1, 1), dilation: tuple[int, int] = (1, 1),
                   pads: tuple[int, int, int, int] = (0, 0, 0, 0), dtype=dtypes.float32,
                   epilogue: Epilogue | None = None, per: int | None = None,
                   tile: tuple[int, int] | None = None) -> UOp:
    """A grouped convolution (GPU form, ConvPlan family grouped_direct; depthwise too): every (n, group,
    output block, oh, ow) is a GLOBAL range (a work-item); a work-item loads its group's input taps
    (masked at the borders, zero padding) once for the `per` output channels it sums them into (default
    `grouped_outputs`), in the accumulation dtype (float32 for 16-bit floats). A group's channels are
    unrolled up to GROUPED_UNROLL_MAX_TAPS taps, else a REDUCE range. `tile` (rows, columns; default
    `grouped_tile`, both dividing the output's sides): output pixels per work-item, each input tap they
    share loaded once and each weight once for all of them; with a tile other than (1, 1) the GLOBAL ranges
    are (n, group, output block) and (tile row, tile column). N None is the variable `N`.
    Params: x, w [CO, C/groups, KH, KW], the epilogue's operands, out."""
    dt = as_dtype(dtype)
    if C % groups or CO % groups:
        raise ArgumentError(f"grouped_conv2d: {groups} groups do not divide {C} -> {CO} channels")
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = stride, dilation, pads
    OH, OW = _out_size(H, KH, sh, dh, pt, pb), _out_size(W, KW, sw, dw, pl, pr)
    Cg, COg = C // groups, CO // groups
    unrolled = Cg * KH * KW <= GROUPED_UNROLL_MAX_TAPS
    per = per if per is not None else grouped_outputs(Cg, COg, KH, KW)
    if per < 1 or COg % per:
        raise ArgumentError(f"grouped_conv2d: {per} outputs per work-item for {COg} per group")
    th, tw = tile if tile is not None else grouped_tile(Cg, COg, KH, KW, OH, OW, per)
    if th < 1 or tw < 1 or OH % th or OW % tw:
        raise ArgumentError(f"grouped_conv2d: a {th}x{tw} tile of pixels does not divide a {OH}x{OW} output")
    blocks = COg // per
    acc_dt = accumulation_dtype(dt)
    ax = _Axes()
    u = ax(_batch(N) * (groups * blocks) if N is None else N * groups * blocks)      # (n, g, output block)
    if (th, tw) == (1, 1):
        oh0, ow0 = ax(OH), ax(OW)
    else:       # (tile row, tile column) one GLOBAL range: see GROUPED_TILE
        OHt, OWt = OH // th, OW // tw
        q = ax(OHt * OWt)
        oh0, ow0 = (q // OWt) * th, (q % OWt) * tw
    n, gb = u // (groups * blocks), u % (groups * blocks)
    g, b = gb // blocks, gb % blocks
    x, w = UOp.param(0, dt), UOp.param(1, dt)
    masked = (_needs_mask(H, OH, KH, sh, dh, pt), _needs_mask(W, OW, KW, sw, dw, pl))
    ci_r = None if unrolled else ax(Cg, AxisType.REDUCE)
    chans = range(Cg) if unrolled else [ci_r]
    taps: dict[tuple, UOp] = {}      # (channel, input row offset, input column offset) -> the tap, loaded once

    def tap(ci, ry: int, rx: int) -> UOp:
        key = (ci, ry, rx)
        if key not in taps:
            base = (n * C + g * Cg + ci) * (H * W)
            t = _tap(x, base, H, W, oh0 * sh + ry - pt, ow0 * sw + rx - pl, dt, masked)
            taps[key] = t if acc_dt == dt else t.cast(acc_dt)
        return taps[key]

    epi = epilogue or Epilogue()
    stores = []
    for o in range(per):
        co = g * COg + b * per + o
        wts = {}
        for i in range(th):
            for j in range(tw):
                acc = None
                for ci in chans:
                    for kh in range(KH):
                        for kw in range(KW):
                            k = (ci, kh, kw)
                            if k not in wts:
                                wv = w.load(co * (Cg * KH * KW) + (ci * KH + kh) * KW + kw)
                                wts[k] = wv if acc_dt == dt else wv.cast(acc_dt)
                            term = tap(ci, i * sh + kh * dh, j * sw + kw * dw) * wts[k]
                            acc = term if acc is None else acc + term
                if ci_r is not None:
                    acc = acc.reduce(ci_r)
                if acc_dt != dt:
                    acc = acc.cast(dt)
                at = ((n * CO + co) * OH + (oh0 + i if i else oh0)) * OW + (ow0 + j if j else ow0)
                v, nxt = epi.apply(acc, 2, dt, co, at)
                stores.append(UOp.param(nxt, dt).store(at, v))
    return UOp.sink(*stores)


# Winograd F(m x m, 3 x 3) (Lavin and Gray, 2015): an m x m tile of a stride-1 3x3 convolution is
# A^T [(G g G^T) . (B^T d B)] A, d the (m + 2) x (m + 2) input patch and g the 3x3 filter: per output
# 2.25x (m = 2) or 4x (m = 4) fewer multiplies in the contraction, which becomes (m + 2)^2 independent
# [CO, C] x [C, tiles] products. The matrices (B^T, G, A^T) by m; G's fractions are exact in binary
# only for m = 2 (m = 4's sixths and twelfths round once, in the weights).
WINOGRAD_MATRICES = {
    2: (((1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1)),
        ((1, 0, 0), (0.5, 0.5, 0.5), (0.5, -0.5, 0.5), (0, 0, 1)),
        ((1, 1, 1, 0), (0, 1, -1, -1))),
    4: (((4, 0, -5, 0, 1, 0), (0, -4, -4, 1, 1, 0), (0, 4, -4, -1, 1, 0), (0, -2, -1, 2, 1, 0),
         (0, 2, -1, -2, 1, 0), (0, 4, 0, -5, 0, 1)),
        ((1 / 4, 0, 0), (-1 / 6, -1 / 6, -1 / 6), (-1 / 6, 1 / 6, -1 / 6), (1 / 24, 1 / 12, 1 / 6),
         (1 / 24, -1 / 12, 1 / 6), (0, 0, 1)),
        ((1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 0), (0, 1, 1, 4, 4, 0), (0, 1, -1, 8, -8, 1))),
}


def _winograd(m: int):
    if m not in WINOGRAD_MATRICES:
        raise ArgumentError(f"Winograd output tiles are {sorted(WINOGRAD_MATRICES)} wide, got {m}")
    return WINOGRAD_MATRICES[m]


def _combine(coefs: Sequence[float], vals: Sequence[UOp], dt: DType) -> UOp:
    """sum of coefs[i] * vals[i], zero coefficients skipped and +-1 without a multiply."""
    out = None
    for c, v in zip(coefs, vals):
        if c == 0:
            continue
        term = v if abs(c) == 1 else v * UOp.const(float(abs(c)), dt)
        out = (term if c > 0 else -term) if out is None else (out + term if c > 0 else out - term)
    return out if out is not None else UOp.const(0.0, dt)


def _sandwich(L: Sequence[Sequence[float]], X: list[list[UOp]], R: Sequence[Sequence[float]], dt: DType) -> list[list[UOp]]:
    """L X R^T for constant matrices L and R and a matrix X of values."""
    LX = [[_combine([L[i][k] for k in range(len(X))], [X[k][c] for k in range(len(X))], dt)
           for c in range(len(X[0]))] for i in range(len(L))]
    return [[_combine(R[j], LX[i], dt) for j in range(len(R))] for i in range(len(L))]


def winograd_tiles(geo_out: tuple[int, int], m: int, partial: bool = False) -> tuple[int, int]:
    """(tile rows, tile columns) of an OH x OW output in m x m tiles (both must divide; with `partial` the
    last row and column of tiles may reach past the output, which the kernels mask)."""
    OH, OW = geo_out
    if partial and OH >= m and OW >= m:
        return -(-OH // m), -(-OW // m)
    if OH % m or OW % m:
        raise ArgumentError(f"a {OH}x{OW} output does not split into {m}x{m} Winograd tiles")
    return OH // m, OW // m


def _channel_loop(ax: _Axes, extent: int, loop: int) -> tuple[UOp, int]:
    """(a GLOBAL range over extent // loop, loop), or (one over extent, 1) where `loop` does not divide it: the
    channel is range * loop + a LOOP range that `_close_loop` numbers after the GLOBAL ranges that follow."""
    if loop <= 1 or extent % loop:
        return ax(extent), 1
    return ax(extent // loop), loop


def _close_loop(ax: _Axes, hi: UOp, loop: int) -> UOp:
    return hi if loop == 1 else hi * loop + ax(loop, AxisType.LOOP)


def winograd_weights(CO: int, C: int, m: int, dtype=dtypes.float32, channel_loop: int = 1) -> UOp:
    """u[s, co, c] = (G g G^T)[s // (m + 2), s % (m + 2)] for the 3x3 filter g = w[co, c]: the weights of
    the (m + 2)^2 contractions of `winograd_conv2d_kernels`. `channel_loop` > 1 (the GPU form, strategies/conv.py's
    WINOGRAD_GPU_CHANNEL_LOOP): each work-item runs that many output channels in a loop. Params: w [CO, C, 3, 3], u."""
    dt = as_dtype(dtype)
    _, G, _ = _winograd(m)
    a = m + 2
    ax = _Axes()
    co_hi, co_lo = _channel_loop(ax, CO, channel_loop)
    c = ax(C)
    co = _close_loop(ax, co_hi, co_lo)
    w = UOp.param(0, dt)
    g = [[w.load((co * C + c) * 9 + k * 3 + l) for l in range(3)] for k in range(3)]
    u = _sandwich(G, g, G, dt)
    out = UOp.param(1, dt)
    return UOp.sink(*[out.store(((i * a + j) * CO + co) * C + c, u[i][j]) for i in range(a) for j in range(a)])


def winograd_input(N: int, C: int, H: int, W: int, pads: tuple[int, int, int, int], m: int,
                   dtype=dtypes.float32, peel: bool = False, plane_pad: int = 0, channel_loop: int = 1) -> UOp:
    """v[s, c, t] = (B^T d B)[s // (m + 2), s % (m + 2)], d the (m + 2) x (m + 2) patch of x[n, c] (zero in the
    padding) under output tile t = (n, tile row, tile column), the tiles of every image side by side: the
    right-hand operands of the Winograd contractions, plane s at s * (C * T + plane_pad) (`winograd_plane_pad`).
    `channel_loop` > 1 (the GPU form, strategies/conv.py's WINOGRAD_GPU_CHANNEL_LOOP): one range over every
    image's tiles (the stores' own index) and each work-item runs that many channels of its tile in a loop.
    `peel` (the CPU's plans): the (image, channel) planes
    are the only GLOBAL range and each plane's tiles run as loops, those whose patch lies inside the input
    unmasked (`_winograd_tile_span`) and the border rows and columns of tiles as stores of their own with
    masked taps: the interior's loads are then plain strided loads that LLVM vectorizes, not clamped scalar
    loads; an output side m does not divide gets a partial last tile (`winograd_tiles`), its taps past the
    input masked. Params: x, v."""
    dt = as_dtype(dtype)
    BT, _, _ = _winograd(m)
    a = m + 2
    pt, pl, pb, pr = pads
    OH, OW = H + pt + pb - 2, W + pl + pr - 2
    TH, TW = winograd_tiles((OH, OW), m, partial=peel)
    T = N * TH * TW
    ax = _Axes()
    x, out = UOp.param(0, dt), UOp.param(1, dt)

    def tiles(c: UOp, n: UOp, ty, tx, masked: tuple[bool, bool], t: UOp | None = None) -> list[UOp]:
        base = (n * C + c) * (H * W)
        d = [[_tap(x, base, H, W, ty * m + k - pt, tx * m + l - pl, dt, masked) for l in range(a)] for k in range(a)]
        v = _sandwich(BT, d, BT, dt)
        if t is None:
            t = (n * TH + ty) * TW + tx
        return [out.store(((i * a + j) * C + c) * T + t + (i * a + j) * plane_pad if plane_pad else
                          ((i * a + j) * C + c) * T + t, v[i][j]) for i in range(a) for j in range(a)]
    # a partial last tile (peel: OH or OW not a multiple of m) reads past the input: masked like the padding
    masks = (pt > 0 or pb > 0 or TH * m != OH, pl > 0 or pr > 0 or TW * m != OW)
    if not peel and channel_loop > 1:
        c_hi, c_lo = _channel_loop(ax, C, channel_loop)
        t = ax(T)
        c = _close_loop(ax, c_hi, c_lo)
        n, ty, tx = t // (TH * TW), (t // TW) % TH, t % TW
        return UOp.sink(*tiles(c, n, ty, tx, masks, t))
    rows, cols = _winograd_tile_span(H, TH, m, a, pt), _winograd_tile_span(W, TW, m, a, pl)
    if not peel or rows is None or cols is None:
        c, n, ty, tx = ax(C), ax(N), ax(TH), ax(TW)
        return UOp.sink(*tiles(c, n, ty, tx, masks))
    q = ax(N * C)
    n, c = (q // C, q % C) if N > 1 else (UOp.const(0, dtypes.index), q)

    def span(lo: int, hi: int):
        return ax(hi - lo + 1, AxisType.LOOP) + lo if hi > lo else UOp.const(lo, dtypes.index)
    stores = tiles(c, n, span(*rows), span(*cols), (False, False))
    border_rows = [r for r in range(TH) if not rows[0] <= r <= rows[1]]
    border_cols = [t for t in range(TW) if not cols[0] <= t <= cols[1]]
    for r in border_rows:           # whole rows of tiles above and below, masked both ways
        stores += tiles(c, n, UOp.const(r, dtypes.index), span(0, TW - 1), (True, True))
    for t in border_cols:           # the interior rows' first and last tiles, masked along the row
        stores += tiles(c, n, span(*rows), UOp.const(t, dtypes.index), (False, True))
    return UOp.sink(*stores)


def winograd_plane_pad(elements: int) -> int:
    """Elements between the Winograd planes of `elements` each (C * T or CO * T) so that a plane's start is
    an odd number of 64-byte lines after the last one (float32): a tile's (m + 2)^2 loads or stores, one per
    plane, then land in as many L1 sets. Planes a multiple of 4 KB apart put them all in one set (64 channels
    of 784 tiles, resnet50's 56x56 layers: each plane 196 KB). One 3x3 layer's transforms alone on the
    2-vCPU AVX2 EPYC, two threads, 64 channels at 56x56: input 0.42 -> 0.20 ms, output 0.84 -> 0.39."""
    return (16 - elements % 32) % 32


def _winograd_tile_span(n_in: int, tiles: int, m: int, a: int, lo: int) -> "tuple[int, int] | None":
    """(first, last) tile index along one side whose a-wide patch (from t*m - lo) lies inside the input, or None:
    the tiles whose first and last taps both are (`_tap_span`)."""
    first, last = _tap_span(n_in, tiles, m, -lo)[0], _tap_span(n_in, tiles, m, a - 1 - lo)[1]
    return (first, last) if first <= last else None


def winograd_output(N: int, CO: int, OH: int, OW: int, m: int, dtype=dtypes.float32,
                    epilogue: Epilogue | None = None, plane_pad: int = 0, channel_loop: int = 1,
                    partial: bool = False) -> UOp:
    """out[n, co, ty * m + i, tx * m + j] = (A^T M A)[i, j], M the (m + 2) x (m + 2) products of output tile
    t = (n, ty, tx) and channel co (mm[s, co, t], plane s at s * (CO * T + plane_pad)), then `epilogue`.
    `channel_loop` > 1 (the GPU form, strategies/conv.py's WINOGRAD_GPU_CHANNEL_LOOP): each work-item runs that
    many channels of its tile in a loop (one GLOBAL range of all where it does not divide CO). `partial` (the
    CPU form) where m does not divide an output side: the tiles of each (image, channel) plane run as loops,
    the whole ones, then the last row and column of tiles storing only their rows and columns inside the
    output. Params: mm, the epilogue's operands, out."""
    dt = as_dtype(dtype)
    _winograd(m)                # (an m without matrices is refused here)
    TH, TW = winograd_tiles((OH, OW), m, partial=partial)
    T = N * TH * TW
    epi = epilogue or Epilogue()
    if TH * m != OH or TW * m != OW:
        return _winograd_output_partial(N, CO, OH, OW, m, dt, epi, plane_pad, TH, TW)
    ax = _Axes()
    n = ax(N)
    co_hi, co_lo = _channel_loop(ax, CO, channel_loop)
    ty, tx = ax(TH), ax(TW)
    co = _close_loop(ax, co_hi, co_lo)
    mm = UOp.param(0, dt)
    stores, nxt = _winograd_tile_out(mm, m, CO, T, n, co, OH, OW, ty, tx, TH, TW, plane_pad, m, m, epi, dt)
    out = UOp.param(nxt, dt)
    return UOp.sink(*[out.store(at, v) for at, v in stores])


def _winograd_tile_out(mm: UOp, m: int, CO: int, T: int, n: UOp, co: UOp, OH: int, OW: int, ty: UOp, tx: UOp,
                       TH: int, TW: int, plane_pad: int, rows: int, cols: int, epi: Epilogue,
                       dt: DType) -> tuple[list[tuple[UOp, UOp]], int]:
    """The (index, value) stores of the first `rows` x `cols` outputs of output tile (n, ty, tx) and channel co,
    the epilogue applied, and the epilogue's next parameter slot."""
    _, _, AT = _winograd(m)
    a = m + 2
    t = (n * TH + ty) * TW + tx
    M = [[mm.load(((i * a + j) * CO + co) * T + t + (i * a + j) * plane_pad if plane_pad else
                  ((i * a + j) * CO + co) * T + t) for j in range(a)] for i in range(a)]
    y = _sandwich(AT, M, AT, dt)
    stores, nxt = [], 1
    for i in range(rows):
        for j in range(cols):
            at = ((n * CO + co) * OH + ty * m + i) * OW + tx * m + j
            v, nxt = epi.apply(y[i][j], 1, dt, co, at)
            stores.append((at, v))
    return stores, nxt


def _winograd_output_partial(N: int, CO: int, OH: int, OW: int, m: int, dt: DType, epi: Epilogue, plane_pad: int,
                             TH: int, TW: int) -> UOp:
    """`winograd_output` where the last row or column of tiles reaches past the output: the (image, channel)
    planes the only GLOBAL range, each region of tiles (whole, last column, last row, corner) a loop nest of
    its own whose stores are the outputs inside."""
    T = N * TH * TW
    ax = _Axes()
    q = ax(N * CO)
    n, co = (q // CO, q % CO) if N > 1 else (UOp.const(0, dtypes.index), q)
    mm = UOp.param(0, dt)
    full_h, full_w = OH // m, OW // m

    def tiles(full: int, last: int) -> UOp:
        """The whole tiles along a side (a loop of its own in each region) or the partial last one, `last`."""
        if last >= 0:
            return UOp.const(last, dtypes.index)
        return ax(full, AxisType.LOOP) if full > 1 else UOp.const(0, dtypes.index)
    # (the last tile's index or -1 for the whole ones, the outputs a tile has along that side)
    rows = [(-1, m)] + ([(full_h, OH - full_h * m)] if full_h < TH else [])
    cols = [(-1, m)] + ([(full_w, OW - full_w * m)] if full_w < TW else [])
    stores, nxt = [], 1
    for r, hi in rows:
        for c, wi in cols:
            ty, tx = tiles(full_h, r), tiles(full_w, c)
            region, nxt = _winograd_tile_out(mm, m, CO, T, n, co, OH, OW, ty, tx, TH, TW, plane_pad, hi, wi, epi, dt)
            stores += region
    out = UOp.param(nxt, dt)
    return UOp.sink(*[out.store(at, v) for at, v in stores])


def pad2d(N: int | None, C: int, H: int, W: int, pads: tuple[int, int, int, int], value: float = 0.0,
          dtype=dtypes.float32) -> UOp:
    """out[n, c, y, x] = x[n, c, y - top, x - left] inside, `value` in the border. Params: x, out."""
    dt = as_dtype(dtype)
    pt, pl, pb, pr = pads
    HP, WP = H + pt + pb, W + pl + pr
    ax = _Axes()
    q, y, xx = ax(_batch(N) * C if N is None else N * C), ax(HP), ax(WP)
    x, out = UOp.param(0, dt), UOp.param(1, dt)
    sy, sx = y - pt, xx - pl
    ok = (sy >= 0) & (sy < H) & (sx >= 0) & (sx < W)
    v = ok.where(x.load(q * (H * W) + sy.clamp(0, H - 1) * W + sx.clamp(0, W - 1)), UOp.const(value, dt))
    return UOp.sink(out.store(q * (HP * WP) + y * WP + xx, v))


def phase_pad(N: int | None, C: int, H: int, W: int, stride: tuple[int, int], pads: tuple[int, int, int, int],
              dtype=dtypes.float32) -> UOp:
    """out[n, c, py, px, a, b] = xpad[n, c, a*sh + py, b*sw + px], xpad the input zero-padded by `pads`: each plane
    split into its sh x sw phases (`phase_planes` rows and columns each), so that a strided convolution's taps
    read neighbouring outputs from neighbouring elements (`conv2d_phases`). Stride 1 is a plain zero pad.
    N None is the variable `N`. Params: x, out."""
    dt = as_dtype(dtype)
    (sh, sw), (pt, pl, _, _) = stride, pads
    HQ, WQ = phase_planes(H, W, stride, pads)
    ax = _Axes()
    # (image and channel, row phase, block of plane rows) is the outermost range, the CPU's thread split: by
    # (image and channel) alone resnet50's stem at batch 1 made 3 units, so 3 of the 16-core Xeon's workers read
    # the input and wrote the planes (the step took 0.165 ms in launch order there, 0.035 with its data in
    # cache; benchmarks/profile_layers.py, cpu-xeon-avx512-16c/profile_layers-resnet50.json)
    blocks = im2col_row_blocks((N or 1) * C * sh, HQ)
    u = ax((_batch(N) * C if N is None else N * C) * (sh * blocks))
    q, py, a_block = u // (sh * blocks), (u // blocks) % sh, u % blocks
    px, a_in, b = ax(sw), ax(HQ // blocks), ax(WQ)
    a = a_block * (HQ // blocks) + a_in if blocks > 1 else a_in
    x, out = UOp.param(0, dt), UOp.param(1, dt)
    v = _tap(x, q * (H * W), H, W, a * sh + py - pt, b * sw + px - pl, dt, (True, True))
    return UOp.sink(out.store((((q * sh + py) * sw + px) * HQ + a) * WQ + b, v))


def conv2d_phases(N: int | None, C: int, H: int, W: int, CO: int, KH: int, KW: int, stride: tuple[int, int] = (1, 1),
                  dilation: tuple[int, int] = (1, 1), pads: tuple[int, int, int, int] = (0, 0, 0, 0),
                  dtype=dtypes.float32, epilogue: Epilogue | None = None) -> UOp:
    """out[n, co, oy, ox] = sum over (c, ky, kx) of w[co, c, ky, kx] * xpad[n, c, oy*sh + ky*dh, ox*sw + kx*dw],
    then `epilogue`: a one-group convolution read straight from `phase_pad`'s phase planes, no im2col columns.
    Output channels are the CPU register tile's rows and the output row's pixels its unit-stride vector
    columns (the ranges ordered so: n, oy, co, ox); the sum runs over (c, ky) with the kx taps unrolled.
    N None is the variable `N`. Params: the phase planes, w [CO, C, KH, KW], the epilogue's operands, out."""
    dt = as_dtype(dtype)
    (sh, sw), (dh, dw) = stride, dilation
    HQ, WQ = phase_planes(H, W, stride, pads)
    OH, OW = _out_size(H, KH, sh, dh, pads[0], pads[2]), _out_size(W, KW, sw, dw, pads[1], pads[3])
    ax = _Axes()
    n, oy, co, ox = ax(_batch(N)), ax(OH), ax(CO), ax(OW)
    c, ky = ax(C, AxisType.REDUCE), ax(KH, AxisType.REDUCE)
    x, w = UOp.param(0, dt), UOp.param(1, dt)
    row = ky * dh
    plane_row = ((n * C + c) * sh + row % sh) * sw
    terms = None
    for kx in range(KW):
        col = kx * dw
        at = ((plane_row + col % sw) * HQ + oy + row // sh) * WQ + ox + col // sw
        t = x.load(at) * w.load(((co * C + c) * KH + ky) * KW + kx)
        terms = t if terms is None else terms + t
    sums = [r for r in (c, ky) if r.op is Ops.RANGE]
    acc = terms.reduce(*sums) if sums else terms
    at = ((n * CO + co) * OH + oy) * OW + ox
    v, nxt = (epilogue or Epilogue()).apply(acc, 2, dt, co, at)
    return UOp.sink(UOp.param(nxt, dt).store(at, v))


def conv2d_phases_flat(N: int | None, C: int, H: int, W: int, CO: int, KH: int, KW: int,
                       stride: tuple[int, int] = (1, 1), dilation: tuple[int, int] = (1, 1),
                       pads: tuple[int, int, int, int] = (0, 0, 0, 0), dtype=dtypes.float32) -> UOp:
    """sums[n, co, q] = sum over (c, ky, kx) of w[co, c, ky, kx] * planes[n, c, phase(ky, kx), q + offset(ky, kx)]:
    a one-group convolution read straight from `phase_pad`'s planes (padded as `phases_flat_geometry` says), each
    image's output pixels one run of flat columns q = oy * row + ox over the planes' row length, so that every
    tap's operand is a contiguous run whatever the output's width: the output channels are the CPU register tile's
    rows and the flat columns its vector columns, the sum runs over (c, ky, kx) with no im2col columns. The
    columns past an output row (ox >= OW) and past the output (q >= OH * row) are computed and left unread;
    `flat_crop` takes the output from the sums. N None is the variable `N`. Params: the phase planes,
    w [CO, C, KH, KW], sums [N, CO, columns]."""
    dt = as_dtype(dtype)
    (sh, sw), (dh, dw) = stride, dilation
    _, HQ, WQ, cols = phases_flat_geometry(H, W, KH, KW, stride, dilation, pads)
    ax = _Axes()
    n, co, q = ax(_batch(N)), ax(CO), ax(cols)
    c, ky, kx = ax(C, AxisType.REDUCE), ax(KH, AxisType.REDUCE), ax(KW, AxisType.REDUCE)
    x, w = UOp.param(0, dt), UOp.param(1, dt)
    row, col = ky * dh, kx * dw
    plane = ((n * C + c) * sh + row % sh) * sw + col % sw
    prod_ = x.load(plane * (HQ * WQ) + (row // sh) * WQ + col // sw + q) * w.load(((co * C + c) * KH + ky) * KW + kx)
    sums = [r for r in (c, ky, kx) if r.op is Ops.RANGE]
    acc = prod_.reduce(*sums) if sums else prod_
    return UOp.sink(UOp.param(2, dt).store((n * CO + co) * cols + q, acc))


def flat_crop(N: int | None, CO: int, OH: int, OW: int, row: int, cols: int, dtype=dtypes.float32,
              epilogue: Epilogue | None = None) -> UOp:
    """out[n, co, oy, ox] = sums[n, co, oy * row + ox], then `epilogue` (bias per output channel, tensor operands of
    out's shape): `conv2d_phases_flat`'s output pixels taken from its flat columns. N None is the variable `N`.
    Params: sums, the epilogue's operands, out."""
    dt = as_dtype(dtype)
    ax = _Axes()
    n, co, oy, ox = ax(_batch(N)), ax(CO), ax(OH), ax(OW)
    at = ((n * CO + co) * OH + oy) * OW + ox
    v, nxt = (epilogue or Epilogue()).apply(UOp.param(0, dt).load((n * CO + co) * cols + oy * row + ox), 1, dt, co, at)
    return UOp.sink(UOp.param(nxt, dt).store(at, v))


def pool2d(kind: str, N: int | None, C: int, H: int, W: int, KH: int, KW: int, stride: tuple[int, int] = (1, 1),
           dilation: tuple[int, int] = (1, 1), pads: tuple[int, int, int, int] = (0, 0, 0, 0),
           count_include_pad: bool = False, dtype=dtypes.float32) -> UOp:
    """Max or average pooling ("max", "avg") over KH x KW windows, the taps unrolled like
    `depthwise_conv2d` (rows along ow, vectorized); padding is ignored by max and, unless
    `count_include_pad`, by the average's count. N None is the variable `N`. Params: x, out."""
    dt = as_dtype(dtype)
    if kind not in ("max", "avg"):
        raise UnknownNameError(f"unknown pooling {kind!r}; known: max, avg")
    (sh, sw), (dh, dw), (pt, pl, pb, pr) = stride, dilation, pads
    OH, OW = _out_size(H, KH, sh, dh, pt, pb), _out_size(W, KW, sw, dw, pl, pr)
    ax = _Axes()
    q, oh, ow = ax(_batch(N) * C if N is None else N * C), ax(OH), ax(OW)
    x, out = UOp.param(0, dt), UOp.param(1, dt)
    masked = (_needs_mask(H, OH, KH, sh, dh, pt), _needs_mask(W, OW, KW, sw, dw, pl))
    acc, cnt = None, None
    for kh in range(KH):
        for kw in range(KW):
            y, xx = oh * sh + kh * dh - pt, ow * sw + kw * dw - pl
            ok = None
            if masked[0]:
                ok = (y >= 0) & (y < H)
            if masked[1]:
                okx = (xx >= 0) & (xx < W)
                ok = okx if ok is None else ok & okx
            v = x.load(q * (H * W) + (y.clamp(0, H - 1) if masked[0] else y) * W + (xx.clamp(0, W - 1) if masked[1] else xx))
            if kind == "max":
                v = v if ok is None else ok.where(v, UOp.const(dt.min(), dt))
                acc = v if acc is None else acc.maximum(v)
            else:
                v = v if ok is None else ok.where(v, UOp.const(0, dt))
                acc = v if acc is None else acc + v
                if not count_include_pad:
                    one = UOp.const(1.0, dt) if ok is None else ok.where(UOp.const(1.0, dt), UOp.const(0.0, dt))
                    cnt = one if cnt is None else cnt + one
    if kind == "avg":
        if count_include_pad:
            acc = acc * UOp.const(1.0 / (KH * KW), dt)
        else:
            acc = acc / cnt
    return UOp.sink(out.store(q * (OH * OW) + oh * OW + ow, acc))


def global_pool(kind: str, rows: int | None, cols: int, dtype=dtypes.float32) -> UOp:
    """out[r] = mean or max ("avg", "max") of x[r, 0:cols]: global pooling of [N*C, H*W] planes; rows
    None is the variable `rows`. Params: x, out."""
    dt = as_dtype(dtype)
    if kind not in ("max", "avg"):
        raise UnknownNameError(f"unknown pooling {kind!r}; known: max, avg")
    ax = _Axes()
    r = ax(size(rows, "rows"))
    k = ax(cols, AxisType.REDUCE)
    x, out = UOp.param(0, dt), UOp.param(1, dt)
    return UOp.sink(out.store(r, pool_reduce(kind, x.load(r * cols + k), k, cols, dt)))


def pool_reduce(kind: str, v: UOp, k: UOp, count: int, dt: DType) -> UOp:
    """The max or mean ("max", "avg") of `v` over reduce range `k` of `count` steps (a constant k: v itself),
    the mean summed in the accumulation dtype."""
    if not (isinstance(k, UOp) and k.op is Ops.RANGE):
        return v
    if kind == "max":
        return v.reduce(k, op=Ops.MAX)
    acc = accumulation_dtype(dt)
    return (v.cast(acc).reduce(k) * UOp.const(1.0 / count, acc)).cast(dt)


# direct_masked: input channels a multiple of this (every tensor-core and tile k depth up to 32 divides it) run
# the reduction tap-major (`conv2d(tap_major=True)`): a k tile then holds one tap
TAP_MAJOR_CHANNELS = 32


@dataclass(frozen=True)
class KernelStep:
    """One kernel of a convolution's plan: its AST, the buffers it reads by role ("x" the input,
    "w" the weights, "col" / "pad" a scratch an earlier step wrote, "epilogue" the epilogue's
    operands in order), the role of the buffer it writes ("out" or a scratch) and that buffer's size."""

    name: str
    ast: UOp
    inputs: tuple[str, ...]
    output: str
    elements: int
    vars: tuple[tuple[str, int], ...] = ()     # the values of the AST's variables at launch
    dtype: DType | None = None                 # the written buffer's element type; None: the convolution's

    @property
    def weights_only(self) -> bool:
        """It reads the weights alone (a reorder, Winograd's filter transform): a caller whose weights stay
        the same runs it once and keeps its output."""
        return self.inputs == ("w",)


def conv2d_kernels(geo: ConvGeometry, plan: ConvPlan | None = None, dtype=dtypes.float32,
                   epilogue: Epilogue | None = None, caps: Capabilities | None = None,
                   symbolic_batch: bool = False) -> list[KernelStep]:
    """The kernels of a 2-D convolution (NCHW, weights [CO, C/groups, KH, KW]) as `plan` says (default:
    `conv_plan` for `caps`), `epilogue` applied in the kernel that writes the output. With
    `symbolic_batch` the batch is the variable `N` in every kernel (a new batch size compiles nothing),
    and a contraction keeps whole images whatever the plan's pixel_blocks (a count chosen for one batch
    size: another batch would change the kernel)."""
    plan = plan if plan is not None else conv_plan(geo, caps or Capabilities(), as_dtype(dtype).itemsize,
                                                   static_batch=not symbolic_batch)
    if symbolic_batch and plan.pixel_blocks != 1:
        plan = replace(plan, pixel_blocks=1)
    check_plan(plan, geo)
    steps = _conv2d_kernels_once(geo, plan, as_dtype(dtype), epilogue or Epilogue(), None if symbolic_batch else geo.N)
    if symbolic_batch:
        steps = [KernelStep(st.name, st.ast, st.inputs, st.output, st.elements,
                            st.vars + ((("N", geo.N),) if _uses_variable(st.ast, "N") else ()), st.dtype)
                 for st in steps]
    return steps


# the kernels of each (geometry, plan, dtype, epilogue, batch) built once per process: a model's repeated layers
# built the same ASTs again (resnet50's 11 Winograd layers are 3 geometries; an input transform's AST takes ~25 ms).
# On the 2-vCPU AVX2 EPYC, resnet50's cold first run (session and first run, empty caches, separate processes
# alternated) 4.19-4.23 -> 4.04-4.19 s, densenet121's 2.90-3.34 -> 2.74-2.98 s. UOps are immutable, so every
# caller shares them; cache.clear_memory_caches() empties this too
_CONV_STEPS: dict[tuple, tuple[KernelStep, ...]] = {}
_CONV_STEPS_MAX = 512
_conv_steps_lock = threading.Lock()


def _conv2d_kernels_once(geo: ConvGeometry, plan: ConvPlan, dtype: DType, epi: Epilogue,
                         N: int | None) -> list[KernelStep]:
    key = (geo, plan, dtype, epi, N)
    with _conv_steps_lock:
        hit = _CONV_STEPS.get(key)
    if hit is None:
        hit = tuple(_conv2d_kernels(geo, plan, dtype, epi, N))
        with _conv_steps_lock:
            if len(_CONV_STEPS) >= _CONV_STEPS_MAX:
                _CONV_STEPS.clear()
            _CONV_STEPS[key] = hit
    return list(hit)


def clear_conv_steps() -> None:
    """Forget the convolution kernels built so far (cache.clear_memory_caches)."""
    with _conv_steps_lock:
        _CONV_STEPS.clear()


def _pixel_rows_kernels(g: ConvGeometry, plan: ConvPlan, dtype, epi: Epilogue, N: int | None) -> list[KernelStep]:
    """A one-group pointwise or im2col_gemm plan with pixel rows: the weights transposed (a weights-only
    step), the columns (im2col_gemm), `conv_gemm_pixel_rows` once or once per run of `plan.k_run` steps
    (each adding the last run's channels-last sums: scratches acc0 / acc1 in turn), then `conv_output_t`
    puts the sums back in NCHW with the epilogue. A run's start is the variable `k0`: one program serves
    every run."""
    P, K_ = g.OH * g.OW, g.C * g.KH * g.KW
    # the channel count is the variable K (one program for layers that differ only in it: densenet121's 7x7
    # stage), except where it is no part of the program: one image in runs (x's index drops it), or one run
    # whose weights rows are PACK_ROW_BYTES apart (timed with a static K when packing needed one; a variable K
    # is packed too now, codegen/opt.py, but that form was not timed against it)
    packed = not plan.k_run and (g.CO * as_dtype(dtype).itemsize) % PACK_ROW_BYTES == 0
    Kg = K_ if N == 1 and (plan.k_run or packed) else None
    steps = [KernelStep("weights", conv_weights_t(g.CO, None, dtype), ("w",), "wt", g.CO * K_, (("K", K_),))]
    src = "x"
    if plan.family == "im2col_gemm":
        steps.append(KernelStep("im2col", im2col(N, g.C, g.H, g.W, g.KH, g.KW, g.stride, g.dilation, g.pads, dtype,
                                                 peel=True), ("x",), "col", g.N * K_ * P))
        src = "col"
    runs = K_ // plan.k_run if plan.k_run else 1
    prev = None
    for r in range(runs):
        ast = conv_gemm_pixel_rows(N, g.CO, Kg, P, dtype, plan.k_run or None, prev is not None)
        vars_ = tuple((v, val) for v, val in (("K", K_), ("k0", r * plan.k_run)) if _uses_variable(ast, v))
        role = f"acc{r % 2}"
        steps.append(KernelStep("gemm", ast, (src, "wt") + ((prev,) if prev else ()), role, g.N * P * g.CO, vars_))
        prev = role
    steps.append(KernelStep("output", conv_output_t(N, g.CO, P, dtype, epi), (prev, "epilogue"), "out",
                            g.N * g.CO * P))
    return steps


def _phases_step(g: ConvGeometry, pads: tuple[int, int, int, int], N: int | None, dtype) -> KernelStep:
    """The step that splits the input, zero-padded by `pads`, into its stride's phase planes (role "pad")."""
    HQ, WQ = phase_planes(g.H, g.W, g.stride, pads)
    return KernelStep("phases", phase_pad(N, g.C, g.H, g.W, g.stride, pads, dtype), ("x",), "pad",
                      g.N * g.C * g.stride[0] * g.stride[1] * HQ * WQ)


def _uses_variable(ast: UOp, name: str) -> bool:
    return any(n.op is Ops.DEFINE_VAR and n.arg[0] == name for n in ast.toposort())


def _conv2d_kernels(geo: ConvGeometry, plan: ConvPlan, dtype, epi: Epilogue, N: int | None) -> list[KernelStep]:
    g = geo
    P, Kg = g.OH * g.OW, (g.C // g.groups) * g.KH * g.KW
    out_n = g.N * g.CO * P
    if plan.pixel_rows:
        return _pixel_rows_kernels(g, plan, dtype, epi, N)
    # the contraction's length is a variable: one program per (groups, rows, pixels, epilogue)
    if plan.family == "pointwise":
        return [KernelStep("gemm", conv_gemm(N, g.groups, g.CO // g.groups, None, P, dtype, epi, plan.pixel_blocks),
                           ("x", "w", "epilogue"), "out", out_n, (("K", g.C // g.groups),))]
    if plan.family == "depthwise_padded":
        pt, pl, pb, pr = g.pads
        HP, WP = g.H + pt + pb, g.W + pl + pr
        return [KernelStep("pad", pad2d(N, g.C, g.H, g.W, g.pads, 0.0, dtype), ("x",), "pad", g.N * g.C * HP * WP),
                KernelStep("depthwise", depthwise_conv2d(N, g.C, HP, WP, g.KH, g.KW, g.stride, g.dilation,
                                                         (0, 0, 0, 0), dtype, epi), ("pad", "w", "epilogue"), "out", out_n)]
    if plan.family == "grouped_flat":
        return [KernelStep("grouped", grouped_conv2d_flat(N, g.C, g.H, g.W, g.CO, g.KH, g.KW, g.groups, g.dilation,
                                                          g.pads, dtype, epi), ("x", "w", "epilogue"), "out", out_n)]
    if plan.family in ("im2col_flat", "im2col_rows"):
        K_, rows = g.C * g.KH * g.KW, plan.family == "im2col_rows"
        steps = [KernelStep("im2col", im2col_flat(N, g.C, g.H, g.W, g.KH, g.KW, g.stride, g.dilation, g.pads, dtype,
                                                  rows), ("x",), "col", g.N * K_ * P)]
        wname = "w"
        if rows and im2col_channel_block(g.C, as_dtype(dtype)):     # tap-major columns: the weights to match
            steps.insert(0, KernelStep("weights", conv_weights_tap_major(g.CO, g.C, g.KH, g.KW, dtype), ("w",), "wt",
                                       g.CO * K_))
            wname = "wt"
        if plan.split > 1:
            acc = accumulation_dtype(as_dtype(dtype))
            return steps + [KernelStep("gemm", flat_gemm_split(N, g.CO, K_, P, plan.split, dtype, rows), ("col", wname),
                                       "part", plan.split * g.CO * g.N * P, dtype=acc),
                            KernelStep("sum", split_sum(N, g.CO, P, plan.split, dtype, epi), ("part", "epilogue"), "out",
                                       out_n)]
        return steps + [KernelStep("gemm", flat_gemm(N, g.CO, K_, P, dtype, epi, rows), ("col", wname, "epilogue"),
                                   "out", out_n)]
    if plan.family == "grouped_direct":
        return [KernelStep("grouped", grouped_conv2d(N, g.C, g.H, g.W, g.CO, g.KH, g.KW, g.groups, g.stride,
                                                     g.dilation, g.pads, dtype, epi), ("x", "w", "epilogue"), "out", out_n)]
    if plan.family in ("depthwise", "depthwise_flat"):
        return [KernelStep("depthwise", depthwise_conv2d(N, g.C, g.H, g.W, g.KH, g.KW, g.stride, g.dilation,
                                                         g.pads, dtype, epi, plan.family == "depthwise_flat"),
                           ("x", "w", "epilogue"), "out", out_n)]
    if plan.family == "im2col_gemm":
        # a register tile: a CPU plan, whose columns peel their padding checks
        cols = im2col(N, g.C, g.H, g.W, g.KH, g.KW, g.stride, g.dilation, g.pads, dtype, peel=plan.register_tile is not None)
        return [KernelStep("im2col", cols, ("x",), "col", g.N * g.C * g.KH * g.KW * P),
                KernelStep("gemm", conv_gemm(N, g.groups, g.CO // g.groups, None, P, dtype, epi, plan.pixel_blocks),
                           ("col", "w", "epilogue"), "out", out_n, (("K", Kg),))]
    if plan.family == "winograd":
        if N is None:
            raise ArgumentError(f"{plan}: the Winograd tiles of every image sit side by side; it takes a static batch")
        m, a2 = plan.winograd, (plan.winograd + 2) ** 2
        TH, TW = winograd_tiles((g.OH, g.OW), m, partial=plan.cpu_form)
        T = g.N * TH * TW
        # the CPU form: the input's interior tiles unmasked, the planes padded apart (winograd_plane_pad)
        pin, pout = (winograd_plane_pad(g.C * T), winograd_plane_pad(g.CO * T)) if plan.cpu_form else (0, 0)
        # the GPU form: one tile (one filter) per work-item, channels in a loop
        loop = 1 if plan.cpu_form else WINOGRAD_GPU_CHANNEL_LOOP
        return [KernelStep("weights", winograd_weights(g.CO, g.C, m, dtype, loop), ("w",), "wt", a2 * g.CO * g.C),
                KernelStep("input", winograd_input(g.N, g.C, g.H, g.W, g.pads, m, dtype, plan.cpu_form, pin, loop),
                           ("x",), "col", a2 * (g.C * T + pin)),
                KernelStep("gemm", conv_gemm(1, a2, g.CO, None, T, dtype, plane_pads=(pin, pout)), ("col", "wt"), "prod",
                           a2 * (g.CO * T + pout), (("K", g.C),)),
                KernelStep("output", winograd_output(g.N, g.CO, g.OH, g.OW, m, dtype, epi, pout, loop, plan.cpu_form),
                           ("prod", "epilogue"), "out", out_n)]
    if plan.family == "direct_phases":
        return [_phases_step(g, g.pads, N, dtype),
                KernelStep("direct", conv2d_phases(N, g.C, g.H, g.W, g.CO, g.KH, g.KW, g.stride, g.dilation, g.pads,
                                                   dtype, epi), ("pad", "w", "epilogue"), "out", out_n)]
    if plan.family == "phases_flat":
        grown, _, WQ, cols = phases_flat_geometry(g.H, g.W, g.KH, g.KW, g.stride, g.dilation, g.pads)
        return [_phases_step(g, grown, N, dtype),
                KernelStep("direct", conv2d_phases_flat(N, g.C, g.H, g.W, g.CO, g.KH, g.KW, g.stride, g.dilation, g.pads,
                                                        dtype), ("pad", "w"), "sums", g.N * g.CO * cols),
                KernelStep("crop", flat_crop(N, g.CO, g.OH, g.OW, WQ, cols, dtype, epi), ("sums", "epilogue"), "out",
                           out_n)]
    if plan.family == "direct_masked":
        # channels a multiple of TAP_MAJOR_CHANNELS: taps outermost in k, the weights reordered to match
        tm = g.C % TAP_MAJOR_CHANNELS == 0
        steps = [KernelStep("weights", conv_weights_tap_major(g.CO, g.C, g.KH, g.KW, dtype), ("w",), "wt",
                            g.CO * g.C * g.KH * g.KW)] if tm else []
        return steps + [KernelStep("direct", conv2d(N, g.C, g.H, g.W, g.CO, g.KH, g.KW, g.stride[0], g.dilation[0],
                                                    dtype=dtype, epilogue=epi, pads=g.pads, tap_major=tm),
                                   ("x", "wt" if tm else "w", "epilogue"), "out", out_n)]
    pt, pl, pb, pr = g.pads
    steps, src = [], "x"
    if any(g.pads):
        steps.append(KernelStep("pad", pad2d(N, g.C, g.H, g.W, g.pads, 0.0, dtype), ("x",), "pad",
                                g.N * g.C * (g.H + pt + pb) * (g.W + pl + pr)))
        src = "pad"
    ast = conv2d(N, g.C, g.H + pt + pb, g.W + pl + pr, g.CO, g.KH, g.KW, g.stride[0], g.dilation[0],
                 dtype=dtype, epilogue=epi)
    return steps + [KernelStep("direct", ast, (src, "w", "epilogue"), "out", out_n)]


def channel_affine(rows=None, channels=None, inner=None, dtype=dtypes.float32,
                   epilogue: Epilogue | None = None) -> UOp:
    """out[r, p] = x[r, p] * scale[r % channels] + shift[r % channels], then `epilogue` (its bias per
    channel, tensor operands of x's shape): an inference BatchNorm over [N*C, H*W] planes. Sizes left
    None are symbolic (`rows`, `channels`, `inner`), so one program serves every layer. Params: x,
    scale, shift, the epilogue's operands, out."""
    dt = as_dtype(dtype)
    R, C, P = size(rows, "rows"), size(channels, "channels"), size(inner, "inner")
    q, p = UOp.range(R, 0), UOp.range(P, 1)
    c = q % _end(C)
    at = q * _end(P) + p
    v = UOp.param(0, dt).load(at) * UOp.param(1, dt).load(c) + UOp.param(2, dt).load(c)
    v, nxt = (epilogue or Epilogue()).apply(v, 3, dt, c, at)
    return UOp.sink(UOp.param(nxt, dt).store(at, v))


def elementwise_chain(n=None, dtype=dtypes.float32, epilogue: Epilogue | None = None) -> UOp:
    """out[i] = `epilogue` applied to x[i] (its tensor operands read at i): a chain of elementwise ops in
    one kernel; n None is symbolic. Params: x, the epilogue's operands, out."""
    dt = as_dtype(dtype)
    i = UOp.range(size(n, "n"), 0)
    v, nxt = (epilogue or Epilogue()).apply(UOp.param(0, dt).load(i), 1, dt, i, i)
    return UOp.sink(UOp.param(nxt, dt).store(i, v))


def bias_relu(M=None, N=None, dtype=dtypes.float32) -> UOp:
    """out[i,j] = max(x[i,j] + b[j], 0): broadcasting a row vector."""
    dt = as_dtype(dtype)
    M, N = size(M, "M"), size(N, "N")
    x, b, out = UOp.param(0, dt), UOp.param(1, dt), UOp.param(2, dt)
    i, j = UOp.range(M, 0), UOp.range(N, 1)
    return UOp.sink(out.store(i * _end(N) + j, (x.load(i * _end(N) + j) + b.load(j)).relu()))


def softmax(rows=None, cols=None, dtype=dtypes.float32) -> UOp:
    """out = softmax(x, axis=1) for a rows x cols matrix, numerically stable (max subtracted)."""
    dt = as_dtype(dtype)
    R, C = size(rows, "rows"), size(cols, "cols")
    x, out = UOp.param(0, dt), UOp.param(1, dt)
    r = UOp.range(R, 0)
    base = r * _end(C)
    acc = accumulation_dtype(dt)      # half precision: exp, sum and scale in float32, rounded once
    k1 = UOp.range(C, 1, AxisType.REDUCE)
    m = x.load(base + k1).reduce(k1, op=Ops.MAX).cast(acc)
    k2 = UOp.range(C, 2, AxisType.REDUCE)
    s = (x.load(base + k2).cast(acc) - m).exp().reduce(k2)
    j = UOp.range(C, 3, AxisType.LOOP)
    inv = s.reciprocal()
    return UOp.sink(out.store(base + j, ((x.load(base + j).cast(acc) - m).exp() * inv).cast(dt)))


def gather(table_n=None, n=None, dtype=dtypes.float32) -> UOp:
    """out[i] = table[clamp(idx[i], 0, table_n - 1)] with int32 indices; the clamp makes every read
    provably in bounds, so the launch check accepts it."""
    dt = as_dtype(dtype)
    T = size(table_n, "table_n")
    table, idx, out = UOp.param(0, dt), UOp.param(1, dtypes.int32), UOp.param(2, dt)
    i = UOp.range(size(n, "n"), 0)
    j = idx.load(i).clamp(0, _end(T) - 1)
    return UOp.sink(out.store(i, table.load(j)))


def gather_rows(vocab=None, dim=None, n=None, dtype=dtypes.float32) -> UOp:
    """An embedding lookup: out[i, :] = table[idx[i], :] (index clamped to the table)."""
    dt = as_dtype(dtype)
    V, D = size(vocab, "vocab"), size(dim, "dim")
    table, idx, out = UOp.param(0, dt), UOp.param(1, dtypes.int32), UOp.param(2, dt)
    i, d = UOp.range(size(n, "n"), 0), UOp.range(D, 1)
    row = idx.load(i).clamp(0, _end(V) - 1)
    return UOp.sink(out.store(i * _end(D) + d, table.load(row * _end(D) + d)))


# the named kernels of `morok compile`, each built with symbolic sizes
NAMED: dict[str, Callable[[], UOp]] = {
    "add": lambda: add(),
    "mul": lambda: binary("mul"),
    "relu": lambda: unary("relu"),
    "exp": lambda: unary("exp"),
    "sum": lambda: sum_all(),
    "sum_rows": lambda: reduce_axis("sum", [None, None], 1),
    "sum_cols": lambda: reduce_axis("sum", [None, None], 0),
    "mean_rows": lambda: reduce_axis("mean", [None, None], 1),
    "row_max": lambda: row_max(),
    "softmax": lambda: softmax(),
    "matmul": lambda: matmul(),
    "dense": lambda: matmul_bias_relu(),
    "bias_relu": lambda: bias_relu(),
    "conv2d": lambda: conv2d(None, 16, 18, 18, 32, 3, 3, bias=True, relu=True),
    "broadcast_add": lambda: broadcast_binary("add", (37, 1, 19), (5, 19)),
    "gather": lambda: gather(),
    "embedding": lambda: gather_rows(),
}


def named(name: str) -> UOp:
    try:
        return NAMED[name]()
    except KeyError:
        raise UnknownNameError(f"unknown kernel {name!r}; known: {', '.join(NAMED)}") from None
