"""Builders for the kernels a graph executor needs: elementwise with broadcasting, reductions
over any axis, matmul, softmax, gather, symbolic sizes. Used by the demo, tests and benchmarks.

Each builder returns a kernel AST (a UOp.sink). Buffers are params in slot order: inputs first,
output last. Sizes are ints (static) or None, which makes them symbolic variables.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

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


def matmul(M=None, N=None, K=None, dtype=dtypes.float32) -> UOp:
    """C[M,N] = A[M,K] @ B[K,N], row-major."""
    dt = as_dtype(dtype)
    M, N, K = size(M, "M"), size(N, "N"), size(K, "K")
    a, b, c = UOp.param(0, dt), UOp.param(1, dt), UOp.param(2, dt)
    i, j = UOp.range(M, 0), UOp.range(N, 1)
    k = UOp.range(K, 2, AxisType.REDUCE)
    acc = (a.load(i * _end(K) + k) * b.load(k * _end(N) + j)).reduce(k)
    return UOp.sink(c.store(i * _end(N) + j, acc))


def matmul_bias_relu(M=None, N=None, K=None, relu: bool = True, dtype=dtypes.float32) -> UOp:
    """out[M,N] = max(A @ W + bias[N], 0): a fused dense layer."""
    dt = as_dtype(dtype)
    M, N, K = size(M, "M"), size(N, "N"), size(K, "K")
    a, w, bias, out = (UOp.param(s, dt) for s in range(4))
    i, j = UOp.range(M, 0), UOp.range(N, 1)
    k = UOp.range(K, 2, AxisType.REDUCE)
    v = (a.load(i * _end(K) + k) * w.load(k * _end(N) + j)).reduce(k) + bias.load(j)
    return UOp.sink(out.store(i * _end(N) + j, v.relu() if relu else v))


def conv2d(N, C: int, H: int, W: int, CO: int, KH: int, KW: int, stride: int = 1, dilation: int = 1,
           bias: bool = False, relu: bool = False, dtype=dtypes.float32) -> UOp:
    """out[N, CO, OH, OW] = sum over (c, kh, kw) of x[n, c, oh*stride + kh*dilation, ow*stride + kw*dilation]
    * w[co, c, kh, kw] (NCHW, unpadded: pad the input first for a 'same' convolution), then + b[co] and
    max(., 0) when asked. Params: x, w, (b,) out.

    Written as an implicit GEMM: the output pixels (n, oh, ow) are the rows of a matmul, the output
    channels its columns and the taps (c, kh, kw) its k. No im2col buffer exists: each A element's
    input address is computed where the tile is filled. The contraction has matmul's shape, so a
    float16/bfloat16 convolution takes the tensor cores where matmul does (float32 accumulation) and
    a float32 one the shared-memory tiles. The batch N may be symbolic (None); the rest is static."""
    dt = as_dtype(dtype)
    geo = {"C": C, "H": H, "W": W, "CO": CO, "KH": KH, "KW": KW, "stride": stride, "dilation": dilation}
    for k, v in geo.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ArgumentError(f"conv2d: {k} must be a positive int, got {v!r}")
    OH = (H - (KH - 1) * dilation - 1) // stride + 1
    OW = (W - (KW - 1) * dilation - 1) // stride + 1
    if OH < 1 or OW < 1:
        raise ArgumentError(f"conv2d: a {KH}x{KW} kernel (dilation {dilation}) does not fit a {H}x{W} input; "
                            f"pad the input first")
    N = size(N, "N")
    params = [UOp.param(s, dt) for s in range(4 if bias else 3)]
    x, w, out = params[0], params[1], params[-1]
    P, K = OH * OW, C * KH * KW
    i = UOp.range(_end(N) * P, 0)                  # (n, oh, ow)
    j = UOp.range(CO, 1)                           # co
    k = UOp.range(K, 2, AxisType.REDUCE)           # (c, kh, kw)
    n, oh, ow = i // P, (i // OW) % OH, i % OW
    c, kh, kw = k // (KH * KW), (k // KW) % KH, k % KW
    xi = ((n * C + c) * H + oh * stride + kh * dilation) * W + ow * stride + kw * dilation
    v = (x.load(xi) * w.load(j * K + k)).reduce(k)
    if bias:
        v = v + params[2].load(j)
    if relu:
        v = v.relu()
    return UOp.sink(out.store((n * CO + j) * P + oh * OW + ow, v))


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
