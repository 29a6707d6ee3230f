"""Every kernel family against numpy on random data, on every (device, compiler pair).

Sizes are deliberately not multiples of any vector width (1, 7, 1003, ...) and most kernels are
built with symbolic sizes, so one compiled program serves every size.
"""
from __future__ import annotations

import numpy as np
import pytest

from morok_py import AxisType, UOp, dtypes, kernels as K
from morok_py.dtypes import from_numpy

from conftest import random_array

ODD_SIZES = [1, 7, 1003]
TOL = {np.float16: (1e-2, 1e-2), np.float32: (1e-5, 1e-5), np.float64: (1e-12, 1e-12)}


def close(got, want, dtype=np.float32, rtol=None, atol=None):
    r, a = TOL.get(np.dtype(dtype).type, (0, 0))
    np.testing.assert_allclose(got, want, rtol=rtol if rtol is not None else r, atol=atol if atol is not None else a)


@pytest.mark.parametrize("n", ODD_SIZES)
def test_add_symbolic_size(device, rng, n):
    a, b = random_array(rng, n, np.float32), random_array(rng, n, np.float32)
    out = device.empty(n, dtypes.float32)
    device.compile(K.add())(device.buf(a), device.buf(b), out, n=n)
    close(out.numpy(), a + b)


def test_one_symbolic_program_serves_many_sizes(device, rng):
    prog = device.compile(K.add())
    for n in (1, 7, 1003, 4099):
        a, b = random_array(rng, n, np.float32), random_array(rng, n, np.float32)
        out = device.empty(n, dtypes.float32)
        prog(device.buf(a), device.buf(b), out, n=n)
        close(out.numpy(), a + b)


@pytest.mark.parametrize("op,ref", [("add", np.add), ("sub", np.subtract), ("mul", np.multiply),
                                    ("div", np.divide), ("max", np.maximum), ("min", np.minimum)])
def test_binary_float32(device, rng, op, ref):
    n = 1003
    a, b = random_array(rng, n, np.float32), random_array(rng, n, np.float32)
    out = device.empty(n, dtypes.float32)
    device.compile(K.binary(op))(device.buf(a), device.buf(b), out, n=n)
    close(out.numpy(), ref(a, b), rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                                   np.uint64])
@pytest.mark.parametrize("op,ref", [("add", np.add), ("sub", np.subtract), ("mul", np.multiply),
                                    ("max", np.maximum)])
def test_binary_integers_wrap_like_numpy(device, rng, dtype, op, ref):
    n = 1003
    a, b = random_array(rng, n, dtype), random_array(rng, n, dtype)
    out = device.empty(n, from_numpy(dtype))
    device.compile(K.binary(op, dtype=from_numpy(dtype)))(device.buf(a), device.buf(b), out, n=n)
    with np.errstate(over="ignore"):
        want = ref(a, b)
    np.testing.assert_array_equal(out.numpy(), want)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
@pytest.mark.parametrize("op,ref", [("add", np.add), ("mul", np.multiply), ("div", np.divide)])
def test_binary_float16_float64(device, rng, dtype, op, ref):
    n = 1003
    a = random_array(rng, n, dtype)
    b = (np.abs(random_array(rng, n, dtype)) + dtype(0.5)).astype(dtype)
    out = device.empty(n, from_numpy(dtype))
    device.compile(K.binary(op, dtype=from_numpy(dtype)))(device.buf(a), device.buf(b), out, n=n)
    close(out.numpy(), ref(a, b).astype(dtype), dtype)


UNARY_REF = {"neg": np.negative, "relu": lambda x: np.maximum(x, 0), "exp": np.exp, "log": np.log,
             "sqrt": np.sqrt, "sin": np.sin, "recip": lambda x: 1 / x, "exp2": np.exp2, "log2": np.log2,
             "trunc": np.trunc, "square": np.square}


@pytest.mark.parametrize("fn", sorted(UNARY_REF))
def test_unary_float32(device, rng, fn):
    n = 1003
    x = rng.uniform(0.1, 4.0, n).astype(np.float32) * np.where(rng.random(n) < 0.5, 1, -1).astype(np.float32)
    if fn in ("log", "sqrt", "log2"):
        x = np.abs(x)
    out = device.empty(n, dtypes.float32)
    device.compile(K.unary(fn))(device.buf(x), out, n=n)
    close(out.numpy(), UNARY_REF[fn](x), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
@pytest.mark.parametrize("fn", ["exp", "sqrt", "relu", "sin"])
def test_unary_float16_float64(device, rng, dtype, fn):
    n = 257
    x = rng.uniform(0.1, 3.0, n).astype(dtype)
    out = device.empty(n, from_numpy(dtype))
    device.compile(K.unary(fn, dtype=from_numpy(dtype)))(device.buf(x), out, n=n)
    want = UNARY_REF[fn](x.astype(np.float64)).astype(dtype)
    close(out.numpy(), want, dtype, rtol=2e-3 if dtype == np.float16 else 1e-12,
          atol=2e-3 if dtype == np.float16 else 1e-12)


@pytest.mark.parametrize("shape_a,shape_b", [((7, 1), (1, 13)), ((37, 1, 19), (5, 19)), ((1003,), (1,)),
                                             ((3, 1, 5), (3, 7, 1)), ((1,), (9, 4))])
def test_broadcast_add(device, rng, shape_a, shape_b):
    a, b = random_array(rng, shape_a, np.float32), random_array(rng, shape_b, np.float32)
    want = a + b
    out = device.empty(want.size, dtypes.float32)
    device.compile(K.broadcast_binary("add", shape_a, shape_b))(device.buf(a), device.buf(b), out)
    close(out.numpy().reshape(want.shape), want)


def test_broadcast_rejects_incompatible_shapes():
    with pytest.raises(ValueError, match="do not broadcast"):
        K.broadcast_binary("add", (3, 4), (5, 4))


REDUCE_REF = {"sum": np.sum, "max": np.max, "mean": np.mean, "prod": np.prod}


@pytest.mark.parametrize("op", ["sum", "max", "mean", "prod"])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_reduce_each_axis_of_3d(device, rng, op, axis):
    shape = (5, 7, 13)
    x = rng.uniform(0.8, 1.2, shape).astype(np.float32) if op == "prod" else random_array(rng, shape, np.float32)
    want = REDUCE_REF[op](x.astype(np.float64), axis=axis)
    out = device.empty(want.size, dtypes.float32)
    device.compile(K.reduce_axis(op, list(shape), axis))(device.buf(x), out)
    close(out.numpy().reshape(want.shape), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["sum", "max", "mean"])
@pytest.mark.parametrize("axis", [0, 1])
def test_reduce_symbolic_2d(device, rng, op, axis):
    rows, cols = 37, 1003
    x = random_array(rng, (rows, cols), np.float32)
    want = REDUCE_REF[op](x.astype(np.float64), axis=axis)
    out = device.empty(want.size, dtypes.float32)
    device.compile(K.reduce_axis(op, [None, None], axis))(device.buf(x), out, d0=rows, d1=cols)
    close(out.numpy(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_reduce_integers(device, rng, dtype):
    x = random_array(rng, (9, 31), dtype)
    for op in ("sum", "max"):
        out = device.empty(9, from_numpy(dtype))
        device.compile(K.reduce_axis(op, [9, 31], 1, dtype=from_numpy(dtype)))(device.buf(x), out)
        np.testing.assert_array_equal(out.numpy(), REDUCE_REF[op](x, axis=1))


@pytest.mark.parametrize("n", [1, 7, 1003, 100003])
def test_sum_all(device, rng, n):
    x = random_array(rng, n, np.float32)
    out = device.empty(1, dtypes.float32)
    device.compile(K.sum_all())(device.buf(x), out, n=n)
    close(out.numpy()[0], x.astype(np.float64).sum(), rtol=1e-4, atol=1e-3)


def test_sum_float64(device, rng):
    x = random_array(rng, 1003, np.float64)
    out = device.empty(1, dtypes.float64)
    device.compile(K.sum_all(dtype=dtypes.float64))(device.buf(x), out, n=1003)
    close(out.numpy()[0], x.sum(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("M,N,Kd", [(1, 1, 1), (7, 13, 5), (33, 47, 65), (64, 3, 129)])
def test_matmul(device, rng, M, N, Kd):
    a, b = random_array(rng, (M, Kd), np.float32), random_array(rng, (Kd, N), np.float32)
    out = device.empty(M * N, dtypes.float32)
    device.compile(K.matmul())(device.buf(a), device.buf(b), out, M=M, N=N, K=Kd)
    close(out.numpy().reshape(M, N), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)


def test_matmul_static_float64(device, rng):
    a, b = random_array(rng, (17, 23), np.float64), random_array(rng, (23, 11), np.float64)
    out = device.empty(17 * 11, dtypes.float64)
    device.compile(K.matmul(17, 11, 23, dtype=dtypes.float64))(device.buf(a), device.buf(b), out)
    close(out.numpy().reshape(17, 11), a @ b, np.float64)


@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 1003), (37, 10)])
def test_softmax(device, rng, rows, cols):
    x = random_array(rng, (rows, cols), np.float32) * 4
    e = np.exp(x - x.max(axis=1, keepdims=True))
    want = e / e.sum(axis=1, keepdims=True)
    out = device.empty(rows * cols, dtypes.float32)
    device.compile(K.softmax())(device.buf(x), out, rows=rows, cols=cols)
    close(out.numpy().reshape(rows, cols), want, rtol=1e-5, atol=1e-6)


def test_softmax_is_stable_for_large_inputs(device, rng):
    x = (random_array(rng, (3, 17), np.float32) + 1000).astype(np.float32)
    out = device.empty(x.size, dtypes.float32)
    device.compile(K.softmax())(device.buf(x), out, rows=3, cols=17)
    got = out.numpy().reshape(3, 17)
    assert np.all(np.isfinite(got))
    close(got.sum(axis=1), np.ones(3), rtol=1e-5)


def test_gather_clamps_indices(device, rng):
    table = random_array(rng, 50, np.float32)
    idx = rng.integers(-5, 60, size=77).astype(np.int32)
    out = device.empty(77, dtypes.float32)
    device.compile(K.gather())(device.buf(table), device.buf(idx), out, table_n=50, n=77)
    np.testing.assert_array_equal(out.numpy(), table[np.clip(idx, 0, 49)])


def test_embedding_gather_rows(device, rng):
    V, D, n = 31, 7, 13
    table = random_array(rng, (V, D), np.float32)
    idx = rng.integers(0, V, size=n).astype(np.int32)
    out = device.empty(n * D, dtypes.float32)
    device.compile(K.gather_rows())(device.buf(table), device.buf(idx), out, vocab=V, dim=D, n=n)
    np.testing.assert_array_equal(out.numpy().reshape(n, D), table[idx])


@pytest.mark.parametrize("relu", [True, False])
def test_dense_layer(device, rng, relu):
    M, N, Kd = 29, 17, 65
    x, w, b = (random_array(rng, s, np.float32) for s in ((M, Kd), (Kd, N), (N,)))
    want = x.astype(np.float64) @ w + b
    if relu:
        want = np.maximum(want, 0)
    out = device.empty(M * N, dtypes.float32)
    device.compile(K.matmul_bias_relu(relu=relu))(device.buf(x), device.buf(w), device.buf(b), out, M=M, N=N, K=Kd)
    close(out.numpy().reshape(M, N), want, rtol=1e-5, atol=1e-4)


def test_bias_relu_broadcasts_row_vector(device, rng):
    M, N = 13, 1003
    x, b = random_array(rng, (M, N), np.float32), random_array(rng, N, np.float32)
    out = device.empty(M * N, dtypes.float32)
    device.compile(K.bias_relu())(device.buf(x), device.buf(b), out, M=M, N=N)
    close(out.numpy().reshape(M, N), np.maximum(x + b, 0))


def test_cast_and_where_kernel(device, rng):
    n = 1003
    x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.int32)
    i = UOp.range(UOp.variable("n", 1, 1 << 20), 0)
    v = x.load(i)
    ast = UOp.sink(out.store(i, (v < 0.0).where(-v, v * 3.0).cast(dtypes.int32)))
    data = random_array(rng, n, np.float32) * 10
    o = device.empty(n, dtypes.int32)
    device.compile(ast)(device.buf(data), o, n=n)
    np.testing.assert_array_equal(o.numpy(), np.where(data < 0, -data, data * np.float32(3)).astype(np.int32))


def test_integer_division_and_shifts(device, rng):
    n = 1003
    a, b, out = UOp.param(0, dtypes.int32), UOp.param(1, dtypes.int32), UOp.param(2, dtypes.int32)
    i = UOp.range(n, 0)
    x, y = a.load(i), b.load(i)
    ast = UOp.sink(out.store(i, (x // y) + (x % y) * 1000 + ((x & 0xF) << 2) + (x ^ y)))
    av = rng.integers(0, 10000, n).astype(np.int32)
    bv = rng.integers(1, 100, n).astype(np.int32)
    o = device.empty(n, dtypes.int32)
    device.compile(ast)(device.buf(av), device.buf(bv), o)
    np.testing.assert_array_equal(o.numpy(), av // bv + (av % bv) * 1000 + ((av & 0xF) << 2) + (av ^ bv))


def test_loop_axis_runs_sequentially_inside_a_global_one(device, rng):
    rows, cols = 11, 7
    x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)
    r, c = UOp.range(rows, 0), UOp.range(cols, 1, AxisType.LOOP)
    ast = UOp.sink(out.store(c * rows + r, x.load(r * cols + c)))    # a transpose
    data = random_array(rng, (rows, cols), np.float32)
    o = device.empty(rows * cols, dtypes.float32)
    device.compile(ast)(device.buf(data), o)
    np.testing.assert_array_equal(o.numpy().reshape(cols, rows), data.T)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_float_max_and_min_are_numpys_at_every_cpu_level(cpu_level, rng, dtype):
    """Elementwise max / min on the CPU (backends/cpu/renderer.py: a compare and select, NaN checked) give
    numpy's values: NaN from either operand, infinities, ties; with a constant operand (relu) too. Which zero
    a tie of -0 and +0 gives is left open, as numpy's own dtypes differ (float32 gives `b`, float16 `a`)."""
    n = 1003
    a, b = random_array(rng, n, dtype), random_array(rng, n, dtype)
    special = np.array([np.nan, 0.0, -0.0, np.inf, -np.inf, 1.0, -1.0, np.nan], dtype)
    a[:64], b[:64] = np.repeat(special, 8), np.tile(special, 8)        # every pair of specials, both orders
    b[100:110] = a[100:110]                                             # ties
    for op, ref in (("max", np.maximum), ("min", np.minimum)):
        out = cpu_level.empty(n, from_numpy(dtype))
        cpu_level.compile(K.binary(op, dtype=from_numpy(dtype)))(cpu_level.buf(a), cpu_level.buf(b), out, n=n)
        got, want = out.numpy(), ref(a, b)
        np.testing.assert_array_equal(got, want, err_msg=op)
    relu = cpu_level.empty(n, from_numpy(dtype))
    cpu_level.compile(K.unary("relu", dtype=from_numpy(dtype)))(cpu_level.buf(a), relu, n=n)
    np.testing.assert_array_equal(relu.numpy(), np.where(np.isnan(a), a, np.maximum(a, 0)))


def test_a_max_pool_propagates_nan_and_matches_numpy_at_every_cpu_level(cpu_level, rng):
    """resnet50's 3x3 stride-2 max pool, padded, at an odd size with NaNs and infinities in the input."""
    C, H, W = 5, 23, 21
    x = random_array(rng, (1, C, H, W), np.float32)
    x.reshape(-1)[rng.choice(x.size, 12, replace=False)] = np.nan
    x.reshape(-1)[rng.choice(x.size, 6, replace=False)] = np.inf
    OH, OW = (H + 2 - 3) // 2 + 1, (W + 2 - 3) // 2 + 1
    out = cpu_level.empty(C * OH * OW, dtypes.float32)
    cpu_level.compile(K.pool2d("max", 1, C, H, W, 3, 3, (2, 2), (1, 1), (1, 1, 1, 1)))(cpu_level.buf(x), out)
    p = np.pad(x[0], ((0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
    want = np.stack([p[:, ky:ky + 2 * OH:2, kx:kx + 2 * OW:2] for ky in range(3) for kx in range(3)]).max(axis=0)
    np.testing.assert_array_equal(out.numpy().reshape(C, OH, OW), want)
