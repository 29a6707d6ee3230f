"""Warpgroup tensor cores (sm_90a wgmma, codegen/strategies/wgmma.py).

Hardware-free: which targets and kernels take the form, every candidate interpreted (tests/linear_interp.py
models the descriptors, the 128-byte swizzle, the proxy fence and the asynchronous reads and accumulators
independently of the lowering), both CUDA pairs compile it for sm_90a. On an sm_90 GPU (marker `cuda`):
every candidate and the default against a float32-accumulated reference.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from morok_py import dtypes, kernels as K
from morok_py.codegen.linear import L
from morok_py.ir import Ops
from morok_py.codegen.lower import lower, scan_kernel
from morok_py.codegen.schedule import Schedule, candidate_schedules, check_schedule, default_schedule
from morok_py.codegen.strategies.tensor_core import MMA_M16N8K16, WGMMA, tc_threads
from morok_py.codegen.strategies.wgmma import WG_CANDIDATES, WG_TILE, WG_TILE_SMALL
from morok_py.codegen.symbolic import simplify

import linear_interp as LI
from test_tensor_cores import GPU_PAIRS, HALVES, _reference, check, contraction, f32, operands

cuda_renderer = pytest.importorskip("morok_py.backends.cuda.renderer", reason="the cuda extra is not installed")
CAPS = cuda_renderer.cuda_caps("sm_90a")


def wg(tile, stages) -> Schedule:
    return Schedule("tiled", group=tc_threads(tile, WGMMA), matmul_tile=tile, tensor_core=WGMMA, tc_stages=stages,
                    tc_swizzle=True)


def sched_of(ast, caps=CAPS) -> Schedule:
    ast = simplify(ast)
    return default_schedule(ast, caps, scan_kernel(ast))


def interpret(ast, sched, bufs, out_count, dt, values=None):
    kernel, info = lower(simplify(ast), CAPS, "mm", schedule=sched)
    assert kernel.schedule == sched
    assert any(i.kind is L.WGMMA for i in kernel.walk())
    out = np.zeros(out_count, bufs[0].dtype)
    w = LI.run(kernel, info, [x.reshape(-1) for x in bufs] + [out], values or {})
    assert (w[-1] == 1).all(), "every output is stored exactly once"
    return out


# ---- which targets and kernels take it --------------------------------------------------------------

def test_only_sm90a_offers_the_warpgroup_form():
    assert WGMMA in CAPS.tensor_cores and CAPS.tensor_cores[0] == MMA_M16N8K16
    for arch in ("sm_80", "sm_89", "sm_90", "sm_100"):
        assert WGMMA not in cuda_renderer.cuda_caps(arch).tensor_cores, arch
    from morok_py.backends.cuda.compiler import device_compile_arch
    assert device_compile_arch("sm_90") == "sm_90a" and device_compile_arch("sm_80") == "sm_80"


@pytest.mark.parametrize("dt", HALVES, ids=lambda d: d.name)
def test_default_schedule_on_sm90a(dt):
    s = sched_of(K.matmul(4096, 4096, 4096, dtype=dt))
    assert s == wg(WG_TILE, 4) and "tensor_core=wgmma_m64k16" in str(s)
    assert sched_of(K.matmul(dtype=dt)).tensor_core == WGMMA                       # symbolic: checked at launch
    assert sched_of(K.matmul_bias_relu(4096, 4096, 4096, dtype=dt)).tensor_core == WGMMA
    assert sched_of(K.matmul(1024, 1024, 1024, dtype=dt)).matmul_tile == WG_TILE_SMALL   # too few big blocks
    # N = 3001: rows of B are not 16-byte aligned, so no cp.async fills: the warp-level form
    assert sched_of(K.matmul_bias_relu(4000, 3001, 1023, dtype=dt)).tensor_core == MMA_M16N8K16
    assert sched_of(K.matmul(8, 8, 8, dtype=dt)).tensor_core is None               # too small to tile
    assert sched_of(K.matmul(4096, 4096, 4096, dtype=dtypes.float32)).tensor_core is None


def test_candidates_and_refusals():
    ast = simplify(K.matmul(999, 520, 1000, dtype=dtypes.float16))
    cands = candidate_schedules(ast, CAPS, scan_kernel(ast))
    wgs = [c for c in cands if c.tensor_core == WGMMA]
    assert {(c.matmul_tile, c.tc_stages) for c in wgs} == set(WG_CANDIDATES) | {(WG_TILE_SMALL, 6)}
    assert cands[0] == wg(WG_TILE_SMALL, 6) and any(c.tensor_core == MMA_M16N8K16 for c in cands)
    for tile, stages in WG_CANDIDATES:
        check_schedule(wg(tile, stages), ast, CAPS, scan_kernel(ast))
    bad = [wg((128, 128, 32, 64, 128), 4), wg((128, 128, 64, 64, 128), 2), wg((128, 256, 64, 64, 256), 5),
           wg((128, 128, 64, 32, 128), 4), dataclasses.replace(wg(WG_TILE, 4), tc_swizzle=False)]
    for s in bad:
        with pytest.raises(ValueError):
            check_schedule(s, ast, CAPS, scan_kernel(ast))
    plain = cuda_renderer.cuda_caps("sm_90")
    with pytest.raises(ValueError):
        check_schedule(wg(WG_TILE, 4), ast, plain, scan_kernel(ast))


# ---- interpreted --------------------------------------------------------------------------------------

@pytest.mark.parametrize("tile,stages", WG_CANDIDATES)
def test_every_candidate_interpreted(rng, tile, stages):
    """Odd M, N a multiple of 8 but not of the tile, K = 424: several k tiles round the buffers, a tail."""
    dt, M, N, Kd = dtypes.float16, 136, 264, 424
    a, b = operands(rng, dt, (M, Kd), (Kd, N))
    out = interpret(K.matmul(M, N, Kd, dtype=dt), wg(tile, stages), [a, b], M * N, dt)
    check(out.reshape(M, N), (f32(a) @ f32(b)).astype(a.dtype), dt)


@pytest.mark.parametrize("dt", HALVES, ids=lambda d: d.name)
@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, False), (False, True), (True, True)])
def test_both_majors_of_both_operands(rng, dt, a_t, b_t):
    """K-major (row-major A, B^T) and MN-major (A^T, row-major B: `trans` set) shared layouts."""
    M, N, Kd = 136, 192, 200
    a, b = operands(rng, dt, (Kd, M) if a_t else (M, Kd), (N, Kd) if b_t else (Kd, N))
    out = interpret(contraction(dt, M, N, Kd, a_t=a_t, b_t=b_t), wg(WG_TILE, 4), [a, b], M * N, dt)
    A, B = (f32(a).T if a_t else f32(a)), (f32(b).T if b_t else f32(b))
    check(out.reshape(M, N), (A @ B).astype(a.dtype), dt)


@pytest.mark.parametrize("M,N,Kd", [(64, 64, 8), (70, 136, 64), (200, 64, 128), (129, 72, 40), (66, 130, 75)])
def test_symbolic_sizes(rng, M, N, Kd):
    """Symbolic sizes: the pipeline when N and K are multiples of 8 at launch, the scalar-fill loop when not
    (66 x 130 x 75); K under one tile (only the tail), exactly one, two."""
    dt = dtypes.bfloat16
    a, b = operands(rng, dt, (M, Kd), (Kd, N))
    out = interpret(K.matmul(dtype=dt), wg(WG_TILE_SMALL, 6), [a, b], M * N, dt, {"M": M, "N": N, "K": Kd})
    check(out.reshape(M, N), (f32(a) @ f32(b)).astype(a.dtype), dt)


def test_fused_dense_layer_interpreted(rng):
    from test_tensor_cores import check_dense
    dt, M, N, Kd = dtypes.float16, 72, 128, 136
    x, w, bias = operands(rng, dt, (M, Kd), (Kd, N), (N,))
    kernel, info = lower(simplify(K.matmul_bias_relu(M, N, Kd, dtype=dt)), CAPS, "dense", schedule=wg(WG_TILE_SMALL, 3))
    out = np.zeros(M * N, x.dtype)
    LI.run(kernel, info, [x.reshape(-1), w.reshape(-1), bias, out])
    check_dense(out.reshape(M, N), x, w, bias, dt)


def _drop(items, pred):
    out = []
    for it in items:
        if hasattr(it, "body"):
            it.body[:] = _drop(it.body, pred)
        if not (isinstance(it, LI.Instr) and pred(it)):
            out.append(it)
    return out


def _insert_before(items, at, new):
    out = []
    for it in items:
        if hasattr(it, "body"):
            it.body[:] = _insert_before(it.body, at, new)
        if it is at:
            out.append(new)
        out.append(it)
    return out


@pytest.mark.parametrize("what", ["proxy", "wait0", "wait1", "parity", "release"])
def test_interpreter_catches_missing_synchronization(rng, what):
    """The model is strict enough to fail a kernel without its proxy fences, without the final wait (the
    epilogue would read accumulators in flight), waiting for no group in the loop (a buffer refilled while
    a wgmma may still read it), waiting on the other parity of an mbarrier phase, or without the
    consumers' release of a buffer (the producer's wait would never end)."""
    dt, M, N, Kd = dtypes.float16, 64, 128, 512
    a, b = operands(rng, dt, (M, Kd), (Kd, N))
    kernel, info = lower(simplify(K.matmul(M, N, Kd, dtype=dt)), CAPS, "mm", schedule=wg(WG_TILE_SMALL, 3))
    if what == "proxy":
        kernel.body[:] = _drop(kernel.body, lambda i: i.kind is L.WG_SYNC and i.arg == "proxy")
    elif what == "wait0":
        kernel.body[:] = _drop(kernel.body, lambda i: i.kind is L.WG_SYNC and i.arg == 0)
    elif what == "parity":
        waits = [i for i in kernel.walk() if i.kind is L.MBAR and i.arg[0] == "wait"]
        assert len(waits) == 2
        one = LI.Instr(L.CONST, waits[0].src[2].dtype, (), 1, -2)
        waits[0].src = (*waits[0].src[:2], LI.Instr(L.ALU, waits[0].src[2].dtype, (one, waits[0].src[2]), Ops.SUB,
                                                    -1))
        kernel.body[:] = _insert_before(kernel.body, waits[0], waits[0].src[2])
    elif what == "release":
        kernel.body[:] = _drop(kernel.body, lambda i: i.kind is L.MBAR and i.arg[0] == "arrive")
    else:
        for i in kernel.walk():
            if i.kind is L.WG_SYNC and i.arg == 1:
                i.arg = 7
    with pytest.raises(LI.InterpError):
        LI.run(kernel, info, [a.reshape(-1), b.reshape(-1), np.zeros(M * N, a.dtype)])


# ---- compiled for sm_90a ----------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["nvrtc", "llvm-nvptx"])
@pytest.mark.parametrize("which", ["static", "symbolic", "dense"])
def test_both_pairs_compile_wgmma(key, which):
    from conftest import cuda_compile_pair
    from test_gpu_tile import cubin_resources
    r, c = cuda_compile_pair(key, "sm_90a")
    dt = dtypes.bfloat16 if which == "symbolic" else dtypes.float16
    ast = {"static": K.matmul(4096, 4096, 4096, dtype=dt), "symbolic": K.matmul(dtype=dt),
           "dense": K.matmul_bias_relu(4096, 4096, 4096, dtype=dt)}[which]
    spec = r.render(ast, f"wg_{which}")
    assert spec.linear.schedule.tensor_core == WGMMA
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32" in spec.src and "fence.proxy.async" in spec.src
    assert "mbarrier.try_wait.parity" in spec.src and "cp.async.mbarrier.arrive.noinc" in spec.src
    compiled = c.compile(spec)
    assert compiled.arch == "sm_90a" and compiled.bytes[:4] == b"\x7fELF"
    res = cubin_resources(compiled.payload)
    # 128 accumulators under the 168-register cap of 384 work-items: constant sizes spill nothing; symbolic
    # ones spill the producer's per-copy places (a 144-byte frame on nvrtc, 48 on llvm-nvptx)
    assert res["regs"] <= 168 and res.get("frame", 0) <= (160 if which == "symbolic" else 0), res


# ---- on an sm_90 GPU ----------------------------------------------------------------------------------

@pytest.fixture(params=GPU_PAIRS)
def hopper(request):
    from conftest import open_target
    t = open_target(*request.param)
    if t.dev.arch != "sm_90":
        pytest.skip(f"wgmma needs an sm_90 GPU, this one is {t.dev.arch}")
    if WGMMA not in t.pair()[0].caps.tensor_cores:
        pytest.skip(f"the device compiles for {t.pair()[1].arch} (MOROK_CUDA_ARCH?), not sm_90a")
    return t


@pytest.mark.parametrize("tile,stages", WG_CANDIDATES)
def test_device_every_candidate(hopper, rng, tile, stages):
    from morok_py.codegen.schedule import using
    dt, M, N, Kd = dtypes.float16, 999, 520, 1000
    a, b = operands(rng, dt, (M, Kd), (Kd, N))
    out = hopper.empty(M * N, dt)
    renderer, compiler = hopper.pair()
    with using(wg(tile, stages)):
        spec = renderer.render(K.matmul(M, N, Kd, dtype=dt), "mm")
    assert spec.linear.schedule == wg(tile, stages)
    hopper.dev.runtime(compiler.compile(spec))(hopper.buf(a), hopper.buf(b), out, wait=True)
    check(out.numpy().reshape(M, N), _reference(a, b), dt)


@pytest.mark.parametrize("dt", HALVES, ids=lambda d: d.name)
@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, False), (False, True), (True, True)])
def test_device_majors(hopper, rng, dt, a_t, b_t):
    M, N, Kd = 520, 384, 328
    a, b = operands(rng, dt, (Kd, M) if a_t else (M, Kd), (N, Kd) if b_t else (Kd, N))
    prog = hopper.compile(contraction(dt, M, N, Kd, a_t=a_t, b_t=b_t))
    out = hopper.empty(M * N, dt)
    prog(hopper.buf(a), hopper.buf(b), out)
    A, B = (a.T if a_t else a), (b.T if b_t else b)
    check(out.numpy().reshape(M, N), _reference(np.ascontiguousarray(A), np.ascontiguousarray(B)), dt)


@pytest.mark.parametrize("M,N,Kd", [(4096, 4096, 4096), (257, 136, 40), (999, 1032, 520), (1000, 1030, 515)])
def test_device_symbolic(hopper, rng, M, N, Kd):
    dt = dtypes.bfloat16
    a, b = operands(rng, dt, (M, Kd), (Kd, N))
    prog = hopper.compile(K.matmul(dtype=dt))
    out = hopper.empty(M * N, dt)
    prog(hopper.buf(a), hopper.buf(b), out, M=M, N=N, K=Kd)
    check(out.numpy().reshape(M, N), _reference(a, b), dt)
