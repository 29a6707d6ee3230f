"""`kernels.conv2d`: a 2-D convolution (NCHW, unpadded) written as an implicit GEMM, so float16/bfloat16
convolutions take the tensor cores the way matmul does, float32 ones the tiled paths.
Checked against a numpy convolution in float64: on every device pair (CPU here, CUDA and ROCm where
present), in the test interpreter for the tensor-core lowering (mma.sync fragments, ldmatrix, the
implicit-GEMM fills), and compiled for NVIDIA and AMD matrix units."""
from __future__ import annotations

import numpy as np
import pytest

import linear_interp as LI
from conftest import random_array
from morok_py import dtypes
from morok_py import kernels as K
from morok_py.dtypes import to_numpy

ml_dtypes = pytest.importorskip("ml_dtypes")


def ref_conv(x, w, stride=1, dilation=1, b=None, relu=False):
    """float64 numpy convolution (NCHW, unpadded)."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    N, C, H, W = x.shape
    CO, _, KH, KW = w.shape
    OH, OW = (H - (KH - 1) * dilation - 1) // stride + 1, (W - (KW - 1) * dilation - 1) // stride + 1
    out = np.zeros((N, CO, OH, OW))
    for kh in range(KH):
        for kw in range(KW):
            h0, w0 = kh * dilation, kw * dilation
            patch = x[:, :, h0:h0 + (OH - 1) * stride + 1:stride, w0:w0 + (OW - 1) * stride + 1:stride]
            out += np.einsum("nchw,oc->nohw", patch, w[:, :, kh, kw])
    if b is not None:
        out += b.astype(np.float64)[None, :, None, None]
    return np.maximum(out, 0) if relu else out


def _close(got, ref, rtol):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * max(1.0, float(np.abs(ref).max())) * 0.1)


CASES = [  # N, C, H, W, CO, KH, KW, stride, dilation
    (2, 3, 9, 11, 5, 3, 3, 1, 1),
    (1, 16, 13, 13, 24, 3, 3, 2, 1),
    (3, 8, 12, 10, 17, 3, 2, 1, 2),
    (2, 7, 5, 5, 9, 1, 1, 1, 1),
    (1, 4, 6, 6, 3, 6, 6, 1, 1),       # the kernel covers the input: one output pixel
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("epilogue", [False, True], ids=["plain", "bias_relu"])
def test_conv2d_float32_matches_numpy(device, rng, case, epilogue):
    N, C, H, W, CO, KH, KW, s, d = case
    x = random_array(rng, (N, C, H, W), np.float32)
    w = random_array(rng, (CO, C, KH, KW), np.float32)
    b = random_array(rng, (CO,), np.float32) if epilogue else None
    ref = ref_conv(x, w, s, d, b, epilogue)
    out = device.empty(ref.size, dtypes.float32)
    prog = device.compile(K.conv2d(None, C, H, W, CO, KH, KW, s, d, bias=epilogue, relu=epilogue))
    args = [device.buf(x), device.buf(w)] + ([device.buf(b)] if epilogue else []) + [out]
    prog(*args, N=N)                                # the batch is symbolic
    _close(out.numpy().reshape(ref.shape), ref, 1e-5)


def test_conv2d_refuses_bad_geometry():
    with pytest.raises(ValueError, match="does not fit"):
        K.conv2d(1, 3, 4, 4, 8, 5, 5)
    with pytest.raises(ValueError, match="positive int"):
        K.conv2d(1, 3, 8, 8, 8, 3, 3, stride=0)


# the register-staged tensor-core form with the small tile: these interpreter-sized convolutions are
# below the default schedule's tiling threshold
TC_SMALL = dict(mapping="tiled", group=128, matmul_tile=(64, 64, 32, 32, 32), tensor_core="mma_m16n8k16")


def _tc_spec(ast, name):
    from morok_py.backends.cuda.device import compile_only_pairs
    from morok_py.codegen.schedule import Schedule, using
    r, c = compile_only_pairs("sm_90")[0]
    sched = Schedule(**TC_SMALL)
    with using(sched):
        spec = r.render(ast, name)
    assert spec.linear.schedule == sched
    return spec, c


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: "x".join(map(str, c)))
def test_half_conv2d_on_tensor_cores_in_the_interpreter(rng, dt, case):
    """The tensor-core lowering of the implicit GEMM, run by the interpreter's mma/ldmatrix model:
    float32 accumulation, rounded once to the output type."""
    N, C, H, W, CO, KH, KW, s, d = case
    d_t = getattr(dtypes, dt)
    npdt = to_numpy(d_t)
    x = random_array(rng, (N, C, H, W), np.float32).astype(npdt)
    w = random_array(rng, (CO, C, KH, KW), np.float32).astype(npdt)
    spec, _ = _tc_spec(K.conv2d(N, C, H, W, CO, KH, KW, s, d, dtype=d_t), f"conv_{dt}")
    ref = ref_conv(x, w, s, d)
    out = np.zeros(ref.size, npdt)
    writes = LI.run(spec.linear, spec.launch, [x.ravel(), w.ravel(), out])
    assert (writes[2] == 1).all()
    _close(out.astype(np.float64).reshape(ref.shape), ref.astype(npdt).astype(np.float64),
           1e-3 if dt == "float16" else 8e-3)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_half_conv2d_compiles_to_matrix_instructions(dt):
    from morok_py.backends.cuda.device import compile_only_pairs as cuda_pairs
    from conftest import amdgpu_llvm_pair
    ast = K.conv2d(None, 64, 30, 30, 128, 3, 3, bias=True, relu=True, dtype=getattr(dtypes, dt))
    for r, c in cuda_pairs("sm_90")[:2]:
        spec = r.render(ast, f"conv_{dt}")
        assert spec.linear.schedule.tensor_core == "mma_m16n8k16"      # the default schedule's choice
        assert "mma.sync.aligned.m16n8k16" in spec.src or "llvm.nvvm.mma.m16n8k16" in spec.src
        assert c.compile(spec).payload
    for arch, instr in (("gfx942", "mfma"), ("gfx1100", "wmma")):
        r, c = amdgpu_llvm_pair(arch)
        spec = r.render(ast, f"conv_{dt}")
        assert f"llvm.amdgcn.{instr}" in spec.src
        assert c.compile(spec).payload


# ---- half-precision convolutions on every device (the GPUs' default schedule is the tensor cores) ----

@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", [(4, 64, 18, 18, 96, 3, 3, 1, 1), (3, 8, 12, 10, 17, 3, 2, 2, 2)],
                         ids=["resnet_like", "odd"])
def test_half_conv2d_on_the_device(device, rng, dt, case):
    N, C, H, W, CO, KH, KW, s, d = case
    d_t = getattr(dtypes, dt)
    npdt = to_numpy(d_t)
    x = random_array(rng, (N, C, H, W), np.float32).astype(npdt)
    w = random_array(rng, (CO, C, KH, KW), np.float32).astype(npdt)
    b = random_array(rng, (CO,), np.float32).astype(npdt)
    ref = ref_conv(x, w, s, d, b, True)
    out = device.empty(ref.size, d_t)
    device.compile(K.conv2d(None, C, H, W, CO, KH, KW, s, d, bias=True, relu=True, dtype=d_t))(
        device.buf(x), device.buf(w), device.buf(b), out, N=N)
    _close(out.numpy().astype(np.float64).reshape(ref.shape), ref.astype(npdt).astype(np.float64),
           1e-3 if dt == "float16" else 8e-3)


@pytest.mark.parametrize("pair", [0, 1], ids=["nvrtc", "llvm-nvptx"])
def test_the_default_schedule_of_a_half_conv2d_in_the_interpreter(rng, pair):
    """What a GPU would run by default (the 128x128 tensor-core tile, 8 warps), interpreted: odd output
    channels (130: a partial column tile) and a symbolic batch."""
    from morok_py.backends.cuda.device import compile_only_pairs
    r, _ = compile_only_pairs("sm_90")[pair]
    N, C, H, W, CO = 2, 16, 10, 10, 130
    spec = r.render(K.conv2d(None, C, H, W, CO, 3, 3, dtype=dtypes.float16), "conv_default")
    assert spec.linear.schedule.tensor_core == "mma_m16n8k16", spec.linear.schedule
    x = random_array(rng, (N, C, H, W), np.float32).astype(np.float16)
    w = (random_array(rng, (CO, C, 3, 3), np.float32) / 8).astype(np.float16)
    ref = ref_conv(x, w)
    out = np.zeros(ref.size, np.float16)
    writes = LI.run(spec.linear, spec.launch, [x.ravel(), w.ravel(), out], {"N": N})
    assert (writes[2] == 1).all()
    _close(out.astype(np.float64).reshape(ref.shape), ref.astype(np.float16).astype(np.float64), 1e-3)


def test_a_convolutions_kernels_are_built_once_per_process_and_each_caller_gets_its_own_list():
    """conv2d_kernels builds a (geometry, plan, dtype, epilogue, batch)'s kernels once: a repeated layer gets the
    same ASTs (UOps are immutable), in a list of its own; another epilogue or plan builds anew, and
    cache.clear_memory_caches() forgets them."""
    from morok_py import cache
    from morok_py.codegen.strategies.conv import ConvGeometry, ConvPlan
    geo = ConvGeometry(1, 24, 10, 10, 24, 3, 3, pads=(1, 1, 1, 1))
    plan = ConvPlan("winograd", winograd=2, cpu_form=True)
    cache.clear_memory_caches()
    built = []
    real = K._conv2d_kernels
    try:
        K._conv2d_kernels = lambda *a: built.append(a) or real(*a)
        a = K.conv2d_kernels(geo, plan)
        b = K.conv2d_kernels(geo, plan)
        assert len(built) == 1 and a == b and a is not b
        assert [s.ast for s in a] == [s.ast for s in b] and all(x.ast is y.ast for x, y in zip(a, b))
        a.clear()
        assert K.conv2d_kernels(geo, plan) == b and len(built) == 1
        relu = K.conv2d_kernels(geo, plan, epilogue=K.Epilogue.of("relu"))
        assert len(built) == 2 and relu[-1].ast is not b[-1].ast
        K.conv2d_kernels(geo, ConvPlan("im2col_gemm"))
        assert len(built) == 3
        cache.clear_memory_caches()
        assert K.conv2d_kernels(geo, plan) == b and len(built) == 4
    finally:
        K._conv2d_kernels = real
