"""float8 matmuls (kernels_f8.matmul, kernels.matmul of a float8 dtype): float32 sums of float8_e4m3fn /
float8_e5m2 products, on every pair; on sm_90a the warpgroup tensor cores (`wgmma ... m64nNk32.f32.e4m3.e4m3`,
codegen/strategies/wgmma_f8.py) where the strides keep 16-byte runs aligned: B^T [N, K] filled by cp.async,
B [K, N] turned around in registers by the producer warpgroup.

Hardware-free: the CPU computes them; the sm_90a lowering is chosen, interpreted (tests/linear_interp.py models
the descriptors and the 128-byte swizzle) and compiled by both CUDA pairs; the other layouts, odd strides,
symbolic K and other archs take the ordinary path, also interpreted. On an sm_90 GPU (marker `cuda`): against
numpy on both CUDA pairs. The reference is float64 of the float8 values.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from morok_py import dtypes, kernels as K, kernels_f8 as KF
from morok_py.codegen.linear import L
from morok_py.codegen.lower import lower, scan_kernel
from morok_py.codegen.schedule import Schedule, default_schedule
from morok_py.codegen.strategies.tensor_core import WGMMA, tc_threads
from morok_py.codegen.strategies.wgmma_f8 import F8_CANDIDATES, F8_TILE, F8_TILE_NARROW, f8_plan
from morok_py.codegen.symbolic import simplify
from morok_py.codegen.wgmma_ptx import wg_k, wgmma_text
from morok_py.dtypes import to_numpy

import linear_interp as LI

ml_dtypes = pytest.importorskip("ml_dtypes", reason="numpy's float8 types come from ml_dtypes")
cuda_renderer = pytest.importorskip("morok_py.backends.cuda.renderer", reason="the cuda extra is not installed")
CAPS = cuda_renderer.cuda_caps("sm_90a")

E4M3, E5M2 = dtypes.float8_e4m3fn, dtypes.float8_e5m2
F8_PAIRS = [(E4M3, E4M3), (E5M2, E5M2), (E4M3, E5M2)]
PAIR_IDS = ["e4m3", "e5m2", "e4m3xe5m2"]


def f8(rng, shape, dt):
    """Random float8 values (normals, a few of which round to 0 or to the format's ends)."""
    return (rng.standard_normal(shape) * 2).astype(np.float32).astype(to_numpy(dt))


def reference(a, b_kn):
    """float64 sums of the float8 values, and the sums of their magnitudes (the error scale)."""
    A, B = a.astype(np.float64), b_kn.astype(np.float64)
    return A @ B, np.abs(A) @ np.abs(B)


def check(got, a, b_kn, rtol, out_dt=dtypes.float32):
    """|got - ref| within rtol of sum |a| |b| (the accumulation's error), plus the output's rounding."""
    want, scale = reference(a, b_kn)
    got = np.asarray(got, np.float64)
    ulp = {"float32": 2**-24, "bfloat16": 2**-8, "float16": 2**-11}[out_dt.name]
    err = np.abs(got - want)
    bound = rtol * scale + ulp * np.abs(want) + 1e-6
    assert (err <= bound).all(), f"max error {err.max()} at {np.unravel_index(np.argmax(err - bound), err.shape)}"


def operands(rng, M, N, Kd, adt, bdt, layout):
    """A [M, K], B as the kernel takes it ([K, N] or [N, K]) and B as [K, N] for the reference."""
    a = f8(rng, (M, Kd), adt)
    b = f8(rng, (Kd, N) if layout == "kn" else (N, Kd), bdt)
    return a, b, (b if layout == "kn" else b.T)


def wg(tile, stages) -> Schedule:
    return Schedule("tiled", group=tc_threads(tile, WGMMA), matmul_tile=tile, tensor_core=WGMMA, tc_stages=stages,
                    tc_swizzle=True)


def sched_of(ast, caps=CAPS) -> Schedule:
    ast = simplify(ast)
    return default_schedule(ast, caps, scan_kernel(ast))


def interpret(ast, bufs, out_count, out_dt, caps=CAPS, tile=None, values=None):
    """Lower for `caps` (the default schedule, or the warpgroup form under `tile` = (tile, stages)) and run
    the kernel on the interpreter; the kernel and its output."""
    ast = simplify(ast)
    if tile is None:
        kernel, info = lower(ast, caps, "mm")
    else:
        from morok_py.codegen.strategies.matrix_units import tile_mma
        kernel, info = tile_mma(ast, caps, "mm", scan_kernel(ast), tile[0], WGMMA, tile[1], True)
    out = np.zeros(out_count, to_numpy(out_dt))
    w = LI.run(kernel, info, [x.reshape(-1) for x in bufs] + [out], values or {})
    assert (w[-1] == 1).all(), "every output is stored exactly once"
    return kernel, out


def wgmmas(kernel) -> list:
    return [i for i in kernel.walk() if i.kind is L.WGMMA]


# ---- the PTX text -------------------------------------------------------------------------------------

def test_wgmma_text_8bit_forms():
    t = wgmma_text(256, "float8_e4m3fn", 0, 0)
    assert "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3" in t and t.endswith("p, 1, 1; }")
    assert ".m64n64k32.f32.e4m3.e5m2" in wgmma_text(64, ("float8_e4m3fn", "float8_e5m2"), 0, 0)
    assert ".m64n128k16.f32.f16.f16" in wgmma_text(128, "float16", 0, 1) and "p, 1, 1, 0, 1;" in wgmma_text(128, "f16", 0, 1)
    assert wg_k("float8_e5m2") == 32 and wg_k("bfloat16") == 16
    for bad in [(256, "float8_e4m3fn", 0, 1), (256, ("float16", "float8_e4m3fn"), 0, 0), (256, "float8_e4m3fnuz", 0, 0),
                (12, "float8_e5m2", 0, 0)]:
        with pytest.raises(ValueError):
            wgmma_text(*bad)


# ---- the CPU ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("adt,bdt", F8_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_cpu_computes_float8_matmul(cpu, rng, adt, bdt, layout):
    M, N, Kd = 37, 29, 45
    a, b, b_kn = operands(rng, M, N, Kd, adt, bdt, layout)
    prog = cpu.compile(KF.matmul(M, N, Kd, adt, bdt, b_layout=layout))
    out = cpu.empty(M * N, dtypes.float32)
    prog(cpu.buf(a), cpu.buf(b), out)
    check(out.numpy().reshape(M, N), a, b_kn, 1e-6)


@pytest.mark.parametrize("out_dt", [dtypes.bfloat16, dtypes.float16], ids=lambda d: d.name)
def test_cpu_half_outputs_and_symbolic_sizes(cpu, rng, out_dt):
    M, N, Kd = 23, 41, 67
    a, b, b_kn = operands(rng, M, N, Kd, E4M3, E5M2, "nk")
    prog = cpu.compile(KF.matmul(None, None, None, E4M3, E5M2, out_dtype=out_dt, b_layout="nk"))
    out = cpu.empty(M * N, out_dt)
    prog(cpu.buf(a), cpu.buf(b), out, M=M, N=N, K=Kd)
    check(out.numpy().reshape(M, N), a, b_kn, 1e-6, out_dt)


def test_cpu_matmul_with_epilogue(cpu, rng):
    M, N, Kd = 19, 33, 50
    a, b, b_kn = operands(rng, M, N, Kd, E4M3, E4M3, "kn")
    bias = rng.standard_normal(N).astype(np.float32)
    prog = cpu.compile(KF.matmul(M, N, Kd, E4M3, epilogue=K.Epilogue.of("bias", "relu")))
    out = cpu.empty(M * N, dtypes.float32)
    prog(cpu.buf(a), cpu.buf(b), cpu.buf(bias), out)
    want, scale = reference(a, b_kn)
    np.testing.assert_allclose(out.numpy().reshape(M, N), np.maximum(want + bias, 0), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_kernels_matmul_of_a_float8_dtype(cpu, rng, dt):
    """kernels.matmul(dtype=float8): float32 sums stored as float8 (one rounding of the float32 sum)."""
    M, N, Kd = 21, 35, 27
    a, b, b_kn = operands(rng, M, N, Kd, dt, dt, "kn")
    prog = cpu.compile(K.matmul(M, N, Kd, dtype=dt))
    out = cpu.empty(M * N, dt)
    prog(cpu.buf(a), cpu.buf(b), out)
    want, _ = reference(a, b_kn)
    got = out.numpy().reshape(M, N).astype(np.float64)
    half_ulp = 2.0 ** -(3 if dt == E4M3 else 2) / 2
    assert (np.abs(got - want) <= half_ulp * np.abs(want) * 1.01 + 2.0 ** -9).all()


def test_builder_refusals():
    from morok_py.errors import ArgumentError
    with pytest.raises(ArgumentError):
        KF.matmul(8, 8, 8, b_layout="mk")
    with pytest.raises(ArgumentError):
        KF.matmul(8, 8, 8, dtypes.int8)
    with pytest.raises(ArgumentError):
        KF.matmul(8, 8, 8, out_dtype=E4M3, epilogue=K.Epilogue.of("relu"))


# ---- which kernels take the warpgroup form (sm_90a) ---------------------------------------------------

def test_default_schedule_on_sm90a():
    assert sched_of(KF.matmul(4096, 4096, 4096, b_layout="nk")) == wg(F8_TILE, 4)
    assert sched_of(KF.matmul(4096, 4096, 4096, E5M2, E4M3, out_dtype=dtypes.bfloat16, b_layout="nk")) == wg(F8_TILE, 4)
    assert sched_of(KF.matmul(4096, 48, 4096, b_layout="nk")).tensor_core is None        # under 64 columns
    assert sched_of(KF.matmul(4096, 64, 4096, b_layout="nk")) == wg(F8_TILE_NARROW, 8)
    assert sched_of(KF.matmul(None, None, 4096, b_layout="nk")).tensor_core == WGMMA       # symbolic M, N: clamped
    # B [K, N] (kernels.matmul's layout): transposed fills
    assert sched_of(KF.matmul(4096, 4096, 4096)) == wg(F8_TILE, 4)
    assert sched_of(K.matmul(4096, 4096, 4096, dtype=E4M3)) == wg(F8_TILE, 4)
    # not the warpgroup form: B [K, N] with N not a multiple of 16, B^T with K not one, symbolic K (strides
    # unknown), targets without wgmma
    for ast, caps in [(KF.matmul(4096, 4100, 4096), CAPS), (KF.matmul(4096, 4096, 4104, b_layout="nk"), CAPS),
                      (KF.matmul(4096, 4096, None, b_layout="nk"), CAPS),
                      (KF.matmul(4096, 4096, 4096, b_layout="nk"), cuda_renderer.cuda_caps("sm_89"))]:
        assert sched_of(ast, caps).tensor_core is None
    # the fnuz formats are other encodings: no PTX type
    assert sched_of(KF.matmul(4096, 4096, 4096, dtypes.float8_e4m3fnuz, b_layout="nk")).tensor_core is None


def test_explicit_schedules_and_refusals():
    ast = simplify(KF.matmul(999, 520, 1008, b_layout="nk"))
    scan = scan_kernel(ast)
    for tile, stages in F8_CANDIDATES:
        assert f8_plan(ast, CAPS, scan, tile, stages, True) is not None, tile
    assert f8_plan(ast, CAPS, scan, F8_TILE, 5, True) is None                 # 5 x 48 KiB > 227 KiB
    assert f8_plan(ast, CAPS, scan, (128, 256, 64, 64, 256), 4, True) is None  # k tile of 64 bytes
    assert f8_plan(ast, CAPS, scan, F8_TILE, 4, False) is None                # unswizzled
    half = simplify(K.matmul(999, 520, 1008, dtype=dtypes.float16))
    assert f8_plan(half, CAPS, scan_kernel(half), F8_TILE, 4, True) is None


# ---- interpreted (sm_90a, hardware-free) --------------------------------------------------------------

@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("adt,bdt", F8_PAIRS, ids=PAIR_IDS)
def test_interpreted_odd_sizes(rng, adt, bdt, layout):
    M, N, Kd = 130, 208, 304           # a partial block of rows and columns, a k tail of 48 (1.5 wgmmas)
    a, b, b_kn = operands(rng, M, N, Kd, adt, bdt, layout)
    kernel, out = interpret(KF.matmul(M, N, Kd, adt, bdt, b_layout=layout), [a, b], M * N, dtypes.float32)
    ks = wgmmas(kernel)
    assert ks and all(i.arg[1] == (adt.name if adt == bdt else (adt.name, bdt.name)) for i in ks)
    check(out.reshape(M, N), a, b_kn, 1e-6)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("tile,stages", F8_CANDIDATES, ids=lambda x: str(x))
def test_interpreted_every_candidate(rng, tile, stages, layout):
    M, N, Kd = 136, 208, 400
    a, b, b_kn = operands(rng, M, N, Kd, E4M3, E4M3, layout)
    kernel, out = interpret(KF.matmul(M, N, Kd, b_layout=layout), [a, b], M * N, dtypes.float32, tile=(tile, stages))
    assert wgmmas(kernel)
    check(out.reshape(M, N), a, b_kn, 1e-6)


def test_interpreted_bfloat16_output_symbolic_rows(rng):
    M, N, Kd = 70, 130, 160
    a, b, b_kn = operands(rng, M, N, Kd, E5M2, E4M3, "nk")
    ast = KF.matmul(None, None, Kd, E5M2, E4M3, out_dtype=dtypes.bfloat16, b_layout="nk")
    kernel, out = interpret(ast, [a, b], M * N, dtypes.bfloat16, values={"M": M, "N": N})
    assert wgmmas(kernel)
    check(out.reshape(M, N), a, b_kn, 1e-6, dtypes.bfloat16)


def test_interpreted_kernels_matmul_float8_out(rng):
    """kernels.matmul(dtype=float8_e5m2), B [K, N]: transposed fills, float8 outputs (one rounding)."""
    M, N, Kd = 100, 96, 208
    a, b, _ = operands(rng, M, N, Kd, E5M2, E5M2, "kn")
    kernel, out = interpret(K.matmul(M, N, Kd, dtype=E5M2), [a, b], M * N, E5M2)
    assert wgmmas(kernel)
    want, _ = reference(a, b)
    np.testing.assert_array_equal(out.reshape(M, N), want.astype(np.float32).astype(to_numpy(E5M2)))


@pytest.mark.parametrize("case", ["kn_unaligned", "k_unaligned", "sm_80"])
def test_interpreted_ordinary_paths(rng, case):
    M, N, Kd = 67, 90, 100 if case == "k_unaligned" else 96
    layout = "kn" if case == "kn_unaligned" else "nk"
    a, b, b_kn = operands(rng, M, N, Kd, E4M3, E5M2, layout)
    caps = cuda_renderer.cuda_caps("sm_80") if case == "sm_80" else CAPS
    kernel, out = interpret(KF.matmul(M, N, Kd, E4M3, E5M2, b_layout=layout), [a, b], M * N, dtypes.float32, caps)
    assert not wgmmas(kernel)
    check(out.reshape(M, N), a, b_kn, 1e-6)


# ---- both CUDA pairs compile it for sm_90a (no GPU needed) ----------------------------------------------

@pytest.mark.parametrize("key", ["nvrtc", "llvm-nvptx"])
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("adt,bdt", F8_PAIRS, ids=PAIR_IDS)
def test_both_pairs_compile_float8_wgmma(key, adt, bdt, layout):
    from conftest import cuda_compile_pair
    from test_gpu_tile import cubin_resources
    r, c = cuda_compile_pair(key, "sm_90a")
    spec = r.render(KF.matmul(4096, 4096, 4096, adt, bdt, b_layout=layout), "f8mm")
    assert spec.linear.schedule == wg(F8_TILE, 4)
    names = {E4M3: "e4m3", E5M2: "e5m2"}
    assert set(re.findall(r"wgmma\.mma_async\.\S+", spec.src)) == \
        {f"wgmma.mma_async.sync.aligned.m64n256k32.f32.{names[adt]}.{names[bdt]}"}
    assert "mbarrier.try_wait.parity" in spec.src and "cp.async.mbarrier.arrive.noinc" in spec.src
    # the transposed fill stores 4-byte words of 4 k (packed float8 vectors)
    assert (("uint1" if key == "nvrtc" else "store <4 x i8>") in spec.src) == (layout == "kn")
    compiled = c.compile(spec)
    assert compiled.arch == "sm_90a" and compiled.bytes[:4] == b"\x7fELF"
    assert cubin_resources(compiled.payload)["regs"] <= 168


# ---- on an sm_90 GPU ----------------------------------------------------------------------------------

# Hopper's float8 tensor cores sum with fewer mantissa bits than float32: the bound is relative to sum |a b|
GPU_RTOL = 2**-10


@pytest.mark.parametrize("adt,bdt", F8_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_device_float8_matmul(device, rng, adt, bdt, layout):
    M, N, Kd = 999, 528, 1008
    a, b, b_kn = operands(rng, M, N, Kd, adt, bdt, layout)
    prog = device.compile(KF.matmul(M, N, Kd, adt, bdt, b_layout=layout))
    out = device.empty(M * N, dtypes.float32)
    prog(device.buf(a), device.buf(b), out)
    check(out.numpy().reshape(M, N), a, b_kn, GPU_RTOL)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("M,N,Kd", [(4096, 4096, 4096), (257, 144, 80), (1000, 1030, 520), (300, 200, 301)])
def test_device_sizes_and_bfloat16_output(device, rng, M, N, Kd, layout):
    if M * N * Kd > 1 << 30 and device.dev.name.upper().startswith("CPU"):
        pytest.skip("4096^3 is a GPU size (30-45 s on a 2-core CPU)")
    a, b, b_kn = operands(rng, M, N, Kd, E4M3, E4M3, layout)
    prog = device.compile(KF.matmul(M, N, Kd, out_dtype=dtypes.bfloat16, b_layout=layout))
    out = device.empty(M * N, dtypes.bfloat16)
    prog(device.buf(a), device.buf(b), out)
    check(out.numpy().reshape(M, N), a, b_kn, GPU_RTOL, dtypes.bfloat16)


def test_device_kernels_matmul_float8(device, rng):
    """The client spelling kernels.matmul(dtype=float8_e4m3fn): B [K, N], float8 out."""
    M, N, Kd = 520, 272, 1040
    a, b = ((rng.standard_normal(sh) * 0.3).astype(np.float32).astype(to_numpy(E4M3)) for sh in ((M, Kd), (Kd, N)))
    prog = device.compile(K.matmul(M, N, Kd, dtype=E4M3))    # sums well inside float8's range (448)
    out = device.empty(M * N, E4M3)
    prog(device.buf(a), device.buf(b), out)
    want, scale = reference(a, b)
    got = out.numpy().reshape(M, N).astype(np.float64)
    # one float8 rounding of a sum within GPU_RTOL of the exact one: at most one float8 step apart
    assert (np.abs(got - want) <= 2.0 ** -3 * np.abs(want) + GPU_RTOL * scale * 1.2 + 2.0 ** -9).all()


def test_device_symbolic_sizes(device, rng):
    M, N, Kd = 777, 300, 528
    a, b, b_kn = operands(rng, M, N, Kd, E5M2, E5M2, "nk")
    prog = device.compile(KF.matmul(None, None, None, E5M2, b_layout="nk"))
    out = device.empty(M * N, dtypes.float32)
    prog(device.buf(a), device.buf(b), out, M=M, N=N, K=Kd)
    check(out.numpy().reshape(M, N), a, b_kn, GPU_RTOL)


@pytest.fixture(params=[pytest.param(("CUDA", "nvrtc"), id="nvrtc", marks=pytest.mark.cuda),
                        pytest.param(("CUDA", "llvm-nvptx"), id="llvm-nvptx", marks=pytest.mark.cuda)])
def hopper(request):
    from conftest import open_target
    t = open_target(*request.param)
    if t.dev.arch != "sm_90":
        pytest.skip(f"wgmma needs an sm_90 GPU, this one is {t.dev.arch}")
    if WGMMA not in t.pair()[0].caps.tensor_cores:
        pytest.skip(f"the device compiles for {t.pair()[1].arch} (MOROK_CUDA_ARCH?), not sm_90a")
    return t


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("tile,stages", F8_CANDIDATES, ids=lambda x: str(x))
def test_device_every_candidate(hopper, rng, tile, stages, layout):
    from morok_py.codegen.schedule import using
    M, N, Kd = 999, 528, 1008
    a, b, b_kn = operands(rng, M, N, Kd, E4M3, E4M3, layout)
    renderer, compiler = hopper.pair()
    with using(wg(tile, stages)):
        spec = renderer.render(KF.matmul(M, N, Kd, b_layout=layout), "f8mm")
    assert spec.linear.schedule == wg(tile, stages) and ".m64n" in spec.src and "k32.f32.e4m3.e4m3" in spec.src
    out = hopper.empty(M * N, dtypes.float32)
    hopper.dev.runtime(compiler.compile(spec))(hopper.buf(a), hopper.buf(b), out, wait=True)
    check(out.numpy().reshape(M, N), a, b_kn, GPU_RTOL)


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_device_default_takes_wgmma(hopper, layout):
    spec = hopper.pair()[0].render(KF.matmul(4096, 4096, 4096, b_layout=layout), "f8mm")
    assert spec.linear.schedule.tensor_core == WGMMA and "m64n256k32.f32.e4m3.e4m3" in spec.src
