"""Reductions accumulate in their accumulation dtype: float16/bfloat16 in float32, int8/int16 in
int32, rounded once at the end; the kernel builders and the GPU tiled contraction honor it.

References are numpy in float32 (float64 for the sums) on the same half-precision inputs, rounded
to the output dtype once. Tolerances: one rounding of the result to float16 is at most 2**-11
relative (4.9e-4); float32 accumulation of up to a few thousand terms adds ~1e-6 relative. So
float16 results are compared with rtol = 1e-3 (about two half ulps) and an absolute term of
1e-3 * the reference's scale for sums that cancel; bfloat16 (8 bits) with rtol = 8e-3."""
from __future__ import annotations

import numpy as np
import pytest

from morok_py import AxisType, UOp, dtypes, kernels as K
from morok_py.codegen.lower import lower
from morok_py.dtypes import accumulation_dtype
from morok_py.ir import Ops

import linear_interp as LI
from test_gpu_tile import CAPS

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
HALVES = [pytest.param((dtypes.float16, np.float16, 1e-3), id="float16"),
          pytest.param((dtypes.bfloat16, BF16, 8e-3), id="bfloat16")]


def _close(got, ref, rtol):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    scale = max(1.0, float(np.abs(ref).max()))
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * scale * 1e-1)


def test_default_accumulation_dtypes():
    assert accumulation_dtype(dtypes.float16) is dtypes.float32
    assert accumulation_dtype(dtypes.bfloat16) is dtypes.float32
    assert accumulation_dtype(dtypes.int8) is dtypes.int32
    assert accumulation_dtype(dtypes.int16) is dtypes.int32
    assert accumulation_dtype(dtypes.uint8) is dtypes.uint32
    assert accumulation_dtype(dtypes.float32) is dtypes.float32
    # MAX/MIN are exact in any dtype: integers keep theirs, 16-bit floats take float32 all the same (no
    # rounding of the accumulator back to 16 bits at every step; the same result)
    assert accumulation_dtype(dtypes.float16, additive=False) is dtypes.float32
    assert accumulation_dtype(dtypes.bfloat16, additive=False) is dtypes.float32
    assert accumulation_dtype(dtypes.int8, additive=False) is dtypes.int8


def test_the_reduce_node_carries_its_accumulation_dtype_and_rounds_once():
    x = UOp.param(0, dtypes.float16)
    y = UOp.param(1, dtypes.float16)
    k = UOp.range(100, 0, AxisType.REDUCE)
    r = (x.load(k) * y.load(k)).reduce(k)
    assert r.op is Ops.CAST and r.dtype is dtypes.float16
    red = r.src[0]
    assert red.op is Ops.REDUCE and red.dtype is dtypes.float32
    # the product itself is computed in float32: the casts sit on the loads
    assert red.src[0].op is Ops.MUL and all(s.op is Ops.CAST and s.src[0].op is Ops.LOAD for s in red.src[0].src)
    # max is exact in any dtype, but a 16-bit float one runs in float32 too, and rounds (exactly) once
    m = x.load(k).reduce(k, op=Ops.MAX)
    assert m.op is Ops.CAST and m.src[0].op is Ops.REDUCE and m.src[0].dtype is dtypes.float32
    assert UOp.param(2, dtypes.int8).load(k).reduce(k, op=Ops.MAX).op is Ops.REDUCE
    # asked for explicitly
    assert x.load(k).reduce(k, acc_dtype=dtypes.float16).dtype is dtypes.float16
    assert x.load(k).reduce(k, acc_dtype=dtypes.float64).src[0].dtype is dtypes.float64


def test_an_accumulation_dtype_that_loses_range_is_refused():
    k = UOp.range(10, 0, AxisType.REDUCE)
    with pytest.raises(ValueError, match="cannot accumulate in float16"):
        UOp.param(0, dtypes.float32).load(k).reduce(k, acc_dtype=dtypes.float16)
    with pytest.raises(ValueError, match="cannot accumulate in int32"):
        UOp.param(0, dtypes.float16).load(k).reduce(k, acc_dtype=dtypes.int32)


@pytest.mark.parametrize("half", HALVES)
def test_half_sum_accumulates_in_float32(device, rng, half):
    dt, npdt, rtol = half
    n = 4099
    x = rng.random(n).astype(npdt)          # positive terms: half accumulation stalls near 2048
    ref = np.sum(x.astype(np.float64))
    out = device.empty(1, dt)
    device.compile(K.sum_all(dtype=dt))(device.buf(x), out, n=n)
    _close(out.numpy().astype(np.float64), ref, rtol)


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("sizes", [(67, 45, 1501), (4, 3, 2), (130, 129, 257)], ids=str)
@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
def test_half_matmul_matches_float32_accumulation(device, rng, half, sizes, symbolic):
    dt, npdt, rtol = half
    M, N, Kd = sizes
    a = rng.standard_normal((M, Kd)).astype(npdt)
    b = rng.standard_normal((Kd, N)).astype(npdt)
    ref = (a.astype(np.float32) @ b.astype(np.float32)).astype(npdt).astype(np.float64)
    out = device.empty(M * N, dt)
    if symbolic:
        device.compile(K.matmul(dtype=dt))(device.buf(a), device.buf(b), out, M=M, N=N, K=Kd)
    else:
        device.compile(K.matmul(M, N, Kd, dtype=dt))(device.buf(a), device.buf(b), out)
    _close(out.numpy().reshape(M, N), ref, rtol)


@pytest.mark.parametrize("half", HALVES[:1])
def test_half_dense_layer(device, rng, half):
    dt, npdt, rtol = half
    M, N, Kd = 33, 70, 515
    a, w = rng.standard_normal((M, Kd)).astype(npdt), rng.standard_normal((Kd, N)).astype(npdt)
    bias = rng.standard_normal(N).astype(npdt)
    acc = (a.astype(np.float32) @ w.astype(np.float32)).astype(npdt)
    ref = np.maximum(acc + bias, 0).astype(np.float64)
    out = device.empty(M * N, dt)
    device.compile(K.matmul_bias_relu(dtype=dt))(device.buf(a), device.buf(w), device.buf(bias), out, M=M, N=N, K=Kd)
    _close(out.numpy().reshape(M, N), ref, rtol)


@pytest.mark.parametrize("half", HALVES[:1])
@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("axis", [0, 1])
def test_half_reduce_axis(device, rng, half, op, axis):
    dt, npdt, rtol = half
    shape = (301, 1203) if axis == 1 else (1203, 301)
    x = rng.random(shape).astype(npdt)
    f = np.sum if op == "sum" else np.mean
    ref = f(x.astype(np.float64), axis=axis).astype(npdt).astype(np.float64)
    out = device.empty(301, dt)
    device.compile(K.reduce_axis(op, [None, None], axis, dtype=dt))(device.buf(x), out, d0=shape[0], d1=shape[1])
    _close(out.numpy(), ref, rtol)


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("op", ["max", "min"])
def test_half_max_and_min_are_exact(device, rng, half, op):
    """Run in float32 (the default accumulation of 16-bit floats), rounded once at the end: bit for bit
    numpy's answer, infinities and NaN rows included."""
    dt, npdt, _ = half
    x = (rng.standard_normal((67, 1001)) * 100).astype(npdt)
    x[3, 17], x[5, 0], x[9, 1000] = np.inf, -np.inf, np.nan
    x[11, :] = -np.inf
    out = device.empty(67, dt)
    device.compile(K.reduce_axis(op, [None, None], 1, dtype=dt))(device.buf(x), out, d0=67, d1=1001)
    got = out.numpy().astype(np.float32)
    ref = getattr(np, op)(x.astype(np.float32), axis=1)
    assert np.isnan(got[9]) and np.isnan(ref[9])
    keep = ~np.isnan(ref)
    assert np.array_equal(got[keep].view(np.uint32), ref.astype(npdt).astype(np.float32)[keep].view(np.uint32))


def test_half_softmax(device, rng):
    x = (rng.standard_normal((37, 1003)) * 4).astype(np.float16)
    xf = x.astype(np.float64)
    e = np.exp(xf - xf.max(axis=1, keepdims=True))
    ref = (e / e.sum(axis=1, keepdims=True)).astype(np.float16).astype(np.float64)
    out = device.empty(x.size, dtypes.float16)
    device.compile(K.softmax(dtype=dtypes.float16))(device.buf(x), out, rows=37, cols=1003)
    np.testing.assert_allclose(out.numpy().reshape(37, 1003), ref, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("dt", [dtypes.int8, dtypes.int16, dtypes.uint8], ids=lambda d: d.name)
def test_narrow_int_sums_accumulate_in_32_bits(device, rng, dt):
    """Summed in 32 bits then cast: the mean of int8 data is right even though the sum leaves int8."""
    npdt = dt.np
    info = np.iinfo(npdt)
    x = rng.integers(info.min, info.max, (13, 1001)).astype(npdt)
    xs, out = UOp.param(0, dt), UOp.param(1, dtypes.int32)
    i, k = UOp.range(13, 0), UOp.range(1001, 1, AxisType.REDUCE)
    acc = accumulation_dtype(dt)
    total = xs.load(i * 1001 + k).cast(acc).reduce(k).cast(dtypes.int32)
    o = device.empty(13, dtypes.int32)
    device.compile(UOp.sink(out.store(i, total)), name="int_sum")(device.buf(x), o)
    np.testing.assert_array_equal(o.numpy(), x.astype(np.int64).sum(axis=1))
    # the default result dtype is the input's: the 32-bit sum wraps once, at the end
    o8 = device.empty(13, dt)
    device.compile(K.reduce_axis("sum", [13, 1001], 1, dtype=dt))(device.buf(x), o8)
    np.testing.assert_array_equal(o8.numpy(), x.astype(np.int64).sum(axis=1).astype(npdt))


def test_gpu_tiled_contraction_accumulates_in_float32(rng):
    """The tiled path (lowering checked in the interpreter): float32 accumulators for float16 operands."""
    ast = K.matmul(dtype=dtypes.float16)
    kernel, info = lower(ast, CAPS, "mm16")
    assert kernel.gpu and any(i.kind is LI.L.LOCAL for i in kernel.walk())      # the tiled path was taken
    accs = [i for i in kernel.walk() if i.kind is LI.L.ACC]
    assert accs and all(a.dtype is dtypes.float32 for a in accs)
    M, N, Kd = 40, 36, 700
    a = rng.standard_normal((M, Kd)).astype(np.float16)
    b = rng.standard_normal((Kd, N)).astype(np.float16)
    out = np.zeros(M * N, np.float16)
    LI.run(kernel, info, [a.reshape(-1), b.reshape(-1), out], {"M": M, "N": N, "K": Kd})
    ref = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16).astype(np.float64)
    _close(out.reshape(M, N), ref, 1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("pair", ["nvrtc", "llvm-nvptx"])
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_half_matmul_4096_matches_torch(pair, dt):
    """The issue's case: 4096^3 in half precision against PyTorch's (cuBLAS, float32 accumulation).
    Both round a float32 sum of 4096 products once; summation orders differ, so allow two ulps of
    the output dtype (rtol 2**-9 for float16, 2**-6 for bfloat16) with atol for cancellation."""
    torch = pytest.importorskip("torch", reason="PyTorch is the reference for this test")
    from conftest import open_target
    t = open_target("CUDA", pair)
    n = 4096
    tdt = getattr(torch, dt)
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(tdt)
    b = torch.randn(n, n, generator=g).to(tdt)
    ref = (a.cuda() @ b.cuda()).float().cpu().numpy()
    mdt = getattr(dtypes, dt)
    out = t.empty(n * n, mdt)
    an, bn = a.view(torch.int16).numpy(), b.view(torch.int16).numpy()
    A, B = t.empty(n * n, mdt), t.empty(n * n, mdt)
    A.copyin(an.view(mdt.np).reshape(-1))
    B.copyin(bn.view(mdt.np).reshape(-1))
    t.compile(K.matmul(n, n, n, dtype=mdt))(A, B, out)
    got = out.numpy().astype(np.float32).reshape(n, n)
    rtol = 2**-9 if dt == "float16" else 2**-6
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * 8)


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("cols", [1003, 20011])
def test_half_max_and_min_gpu_lowering_in_the_interpreter(rng, op, cols):
    """The GPU group reduction of a float16 MAX/MIN (float32 accumulator in shared memory, rounded once),
    interpreted: bit for bit numpy's, with an inf and an all -inf row."""
    from morok_py.backends.cuda.device import compile_only_pairs
    r, _ = compile_only_pairs("sm_90")[0]
    spec = r.render(K.reduce_axis(op, [None, None], 1, dtype=dtypes.float16), "half_extreme")
    x = (rng.standard_normal((4, cols)) * 100).astype(np.float16)
    x[1, 7], x[2, :] = np.inf, -np.inf
    out = np.zeros(4, np.float16)
    LI.run(spec.linear, spec.launch, [x.ravel(), out], {"d0": 4, "d1": cols})
    assert np.array_equal(out.view(np.uint16), getattr(np, op)(x, axis=1).view(np.uint16))
