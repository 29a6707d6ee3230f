"""CUDA rendering and compiling without a GPU: both compiler pairs, every kernel family, sm_80 and sm_90.

These run in CI (they need the `cuda` extra: cuda-bindings, cuda-pathfinder and the NVRTC and nvJitLink
wheels, plus llvmlite); nothing here opens the driver.
"""
from __future__ import annotations

import dataclasses
import io
import math
import re

import numpy as np
import pytest

pytest.importorskip("cuda.bindings", reason="the cuda extra is not installed (pip install morok-py[cuda])")
elftools = pytest.importorskip("elftools", reason="pyelftools is needed to read CUBINs (pip install pyelftools)")
from elftools.elf.elffile import ELFFile  # noqa: E402

from morok_py import AxisType, CompileError, DeviceError, Ops, UOp, dtypes, kernels as K  # noqa: E402
from morok_py.backends.cuda import compile_only_pairs  # noqa: E402
from morok_py.backends.cuda.compiler import NVRTCCompiler, normalize_arch  # noqa: E402
from morok_py.codegen.symbols import symbol_for  # noqa: E402
from morok_py.backends.cuda.runtime import check_cubin_arch, cubin_arch  # noqa: E402

ARCHS = ["sm_80", "sm_90"]
PAIRS = ["nvrtc", "llvm-nvptx"]


def pair(arch: str, key: str):
    for r, c in compile_only_pairs(arch):
        if c.cache_key == key:
            why = c.available()
            if why is not None:
                pytest.fail(f"compiler {key} is not usable here: {why}")
            return r, c
    raise AssertionError(key)


def compile_ast(ast, arch="sm_90", key="nvrtc", name=None):
    r, c = pair(arch, key)
    spec = r.render(ast, name)
    return spec, c.compile(spec)


def elf_functions(cubin: bytes) -> dict[str, object]:
    elf = ELFFile(io.BytesIO(cubin))
    assert elf["e_machine"] in ("EM_CUDA", 190), elf["e_machine"]
    syms = elf.get_section_by_name(".symtab")
    return {s.name: s for s in syms.iter_symbols() if s["st_info"]["type"] == "STT_FUNC"}


@pytest.mark.parametrize("name", sorted(K.NAMED))
@pytest.mark.parametrize("key", PAIRS)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_named_kernel_compiles_to_a_cubin_with_its_symbol(arch, key, name):
    spec, compiled = compile_ast(K.NAMED[name](), arch, key, name)
    assert compiled.bytes[:4] == b"\x7fELF" and compiled.src is None
    assert compiled.arch == arch and compiled.compiler == key
    funcs = elf_functions(compiled.bytes)
    assert symbol_for(name) in funcs, sorted(funcs)
    assert cubin_arch(compiled.bytes) == arch


DTYPES = [dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64, dtypes.int8, dtypes.uint8,
          dtypes.int16, dtypes.uint16, dtypes.int32, dtypes.uint32, dtypes.int64, dtypes.uint64]


def _every_op_kernel(dt):
    """One kernel using every ALU op that applies to dt, plus casts both ways and a reduction."""
    a, b, out = UOp.param(0, dt), UOp.param(1, dt), UOp.param(2, dt)
    i = UOp.range(UOp.variable("n", 1, 1 << 24), 0)
    x, y = a.load(i), b.load(i)
    v = x + y * x - y
    v = v.maximum(x).minimum(y)
    v = (x < y).where(v, -v) if not dt.is_unsigned else (x < y).where(v, x)
    if dt.is_float:
        v = v / y + x.exp2() + x.log2() + x.sqrt() + x.sin() + x.reciprocal() + x.trunc()
        v = (x != y).where(v, v.cast(dtypes.int32).cast(dt))
    else:
        v = v // y + v % y + (x & y) + (x | y) + (x ^ y) + (x << 1) + (x >> 1) + ~x
        v = (x == y).where(v, v.cast(dtypes.float32).cast(dt))
    k = UOp.range(7, 1, AxisType.REDUCE)
    red = (x + k.cast(dt)).reduce(k, op=Ops.MAX)
    return UOp.sink(out.store(i, v + red))


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("key", PAIRS)
def test_every_alu_op_and_dtype_compiles(key, dt):
    spec, compiled = compile_ast(_every_op_kernel(dt), "sm_90", key, f"ops_{dt.name}")
    assert spec.symbol == f"k_ops_{dt.name}" and spec.symbol in elf_functions(compiled.bytes)


@pytest.mark.parametrize("key", PAIRS)
def test_bool_buffers_and_bitcasts_compile(key):
    f, u, m = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.uint32), UOp.param(2, dtypes.bool)
    h = UOp.param(3, dtypes.float16)
    i = UOp.range(1003, 0)
    x = f.load(i)
    bits = x.bitcast(dtypes.uint32)
    ast = UOp.sink(u.store(i, bits ^ 0x80000000), m.store(i, (x < 0.0) & m.load(i).logical_not()),
                   h.store(i, h.load(i).bitcast(dtypes.int16).bitcast(dtypes.float16) + x.cast(dtypes.float16)))
    spec, compiled = compile_ast(ast, "sm_90", key, "bits")
    assert "k_bits" in elf_functions(compiled.bytes)


# ---- what the renderers print -------------------------------------------------------------------

def test_cuda_c_has_the_kernel_qualifiers_and_exact_literals():
    x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)
    i = UOp.range(UOp.variable("n", 1, 1 << 20), 0)
    ast = UOp.sink(out.store(i, x.load(i) * 0.1 + float("inf") * 0.0 + x.load(i).maximum(float("-inf"))))
    r, _ = pair("sm_90", "nvrtc")
    src = r.render(ast, "scale").src
    assert 'extern "C" __global__ void __launch_bounds__(256) k_scale(' in src
    assert "const float* __restrict__ p0" in src and "float* __restrict__ p1" in src
    assert "blockIdx.x" in src and "threadIdx.x" in src
    lits = re.findall(r"(-?0x[0-9a-f.]+p[+-]\d+)f", src)
    assert float.fromhex(lits[0]) == float(np.float32(0.1))   # exact, not a rounded decimal
    assert "__uint_as_float(0xFF800000u)" in src               # -inf by its bit pattern


def test_nvptx_ir_uses_the_kernel_calling_convention_and_special_registers():
    r, _ = pair("sm_90", "llvm-nvptx")
    src = r.render(K.add(), "add").src
    assert 'target triple = "nvptx64-nvidia-cuda"' in src
    assert "define ptx_kernel void @k_add(ptr addrspace(1) noalias %p0" in src
    assert "@llvm.nvvm.read.ptx.sreg.ctaid.x()" in src and "@llvm.nvvm.read.ptx.sreg.tid.x()" in src


def test_half_and_bfloat16_compute_in_float_without_toolkit_headers():
    r, _ = pair("sm_90", "nvrtc")
    src = r.render(K.binary("mul", dtype=dtypes.bfloat16), "mulbf").src
    assert "#include" not in src
    assert "morok_f2bf(" in src and "morok_bf2f(" in src


def test_kernel_names_nvrtc_declares_get_a_prefixed_symbol():
    assert symbol_for("exp") == "k_exp" and symbol_for("softmax") == "k_softmax"
    for key in PAIRS:
        _, compiled = compile_ast(K.unary("exp"), "sm_90", key, "exp")
        assert compiled.name == "exp" and "k_exp" in elf_functions(compiled.bytes)


# ---- errors -------------------------------------------------------------------------------------

def test_nvrtc_error_carries_log_numbered_source_and_command():
    r, c = pair("sm_90", "nvrtc")
    spec = r.render(K.add(), "broken")
    bad = dataclasses.replace(spec, src=spec.src.replace("p0[", "undeclared_thing["))
    with pytest.raises(CompileError) as ei:
        c.compile(bad)
    e = ei.value
    assert "undeclared_thing" in e.log and "error" in e.log
    assert e.command == "nvcc -cubin -arch=sm_90 -o k_broken.cubin k_broken.cu"   # files named by the symbol
    assert re.search(r"^\s*\d+ \| .*undeclared_thing", str(e), re.M)
    assert e.kernel == "broken"


def test_nvptx_error_names_llvm_and_shows_source():
    r, c = pair("sm_90", "llvm-nvptx")
    spec = r.render(K.add(), "brokenir")
    bad = dataclasses.replace(spec, src=spec.src.replace("ret void", "ret i32 7"))
    with pytest.raises(CompileError, match="LLVM rejected kernel brokenir") as ei:
        c.compile(bad)
    assert "llc" in ei.value.command and "ptxas" in ei.value.command
    assert " | " in str(ei.value)


def test_unsupported_or_malformed_arch_is_a_clear_error():
    with pytest.raises(ValueError, match="not a CUDA arch"):
        normalize_arch("gfx90a")
    assert normalize_arch("90") == normalize_arch((9, 0)) == normalize_arch("compute_90") == "sm_90"
    old = NVRTCCompiler("sm_50")
    assert "cannot target sm_50" in old.available()
    r, _ = pair("sm_90", "nvrtc")
    with pytest.raises(CompileError, match="cannot target sm_50"):
        old.compile(r.render(K.add(), "add"))


# ---- arch at load -------------------------------------------------------------------------------

@pytest.mark.parametrize("key", PAIRS)
def test_cubin_for_another_arch_is_refused_at_load_naming_both(key):
    _, compiled = compile_ast(K.add(), "sm_80", key, "add")
    with pytest.raises(DeviceError, match="compiled for sm_80 but CUDA:0 is sm_90") as ei:
        check_cubin_arch("add", compiled.bytes, compiled.arch, "sm_90", "CUDA:0")
    assert ei.value.name == "ARCH_MISMATCH"
    # CUBIN is binary compatible with later minor versions of the same major
    check_cubin_arch("add", compiled.bytes, compiled.arch, "sm_86", "CUDA:0")
    check_cubin_arch("add", compiled.bytes, compiled.arch, "sm_80", "CUDA:0")


def test_arch_specific_cubin_loads_on_that_chip_only():
    """sm_90a code (wgmma) is what an H100 compiles for by default: it loads on sm_90 (devices report the plain
    arch) and nowhere else, not even on a later minor version."""
    _, compiled = compile_ast(K.add(), "sm_90a", "nvrtc", "add")
    assert compiled.arch == "sm_90a"
    check_cubin_arch("add", compiled.bytes, compiled.arch, "sm_90", "CUDA:0")
    for other in ("sm_80", "sm_100"):
        with pytest.raises(DeviceError, match=f"compiled for sm_90a but CUDA:0 is {other}"):
            check_cubin_arch("add", compiled.bytes, compiled.arch, other, "CUDA:0")


def test_garbage_is_not_a_cubin():
    with pytest.raises(DeviceError, match="not a 64-bit ELF"):
        check_cubin_arch("x", b"PTX text", "sm_90", "sm_90", "CUDA:0")


# ---- devices without a driver ------------------------------------------------------------------

def _driver_missing():
    from morok_py.backends.cuda.device import driver_missing
    return driver_missing()


@pytest.fixture
def fresh_registry(monkeypatch):
    from morok_py import registry
    monkeypatch.setattr(registry, "_devices", {})
    return registry


def test_without_a_driver_cuda_is_unavailable_and_says_how_to_compile(fresh_registry, monkeypatch):
    if _driver_missing() is None:
        pytest.skip("an NVIDIA driver is present here")
    monkeypatch.delenv("MOROK_CUDA_ARCH", raising=False)
    from morok_py import Device, DeviceUnavailableError
    with pytest.raises(DeviceUnavailableError, match="compile_only_pairs") as ei:
        Device["CUDA"]
    assert "driver" in ei.value.reason


def test_without_a_driver_the_arch_override_gives_a_compile_only_device(fresh_registry, monkeypatch):
    if _driver_missing() is None:
        pytest.skip("an NVIDIA driver is present here")
    monkeypatch.setenv("MOROK_CUDA_ARCH", "sm_90")
    monkeypatch.setenv("MOROK_CUDA_COMPILER", "llvm-nvptx")
    from morok_py import Device, DeviceUnavailableError
    dev = Device["CUDA"]
    assert dev.info()["compile_only"] and dev.compiler.cache_key == "llvm-nvptx"
    spec = dev.renderer.render(K.softmax(), name="softmax")
    compiled = dev.compiler.compile(spec)
    assert cubin_arch(compiled.bytes) == "sm_90"
    with pytest.raises(DeviceUnavailableError, match="compile-only"):
        dev.runtime(compiled)
    with pytest.raises(DeviceUnavailableError, match="compile-only"):
        dev.buffer(10, dtypes.float32)


def test_compiler_identity_names_the_toolchain_version():
    _, c = pair("sm_90", "nvrtc")
    assert re.match(r"nvrtc-\d+\.\d+/sm_90/", c.identity())
    _, c = pair("sm_80", "llvm-nvptx")
    assert re.match(r"llvmlite-[\d.]+/llvm-[\d.]+/nvjitlink-\d+\.\d+/sm_80/O3", c.identity())


def test_launch_dims_for_symbolic_sizes_use_256_thread_blocks():
    r, _ = pair("sm_90", "nvrtc")
    spec = r.render(K.add(), "add")
    gs, ls = spec.launch_dims({"n": 1003})
    # elementwise kernels cover 4 contiguous elements per work-item (float4 loads and stores)
    assert ls == (256, 1, 1) and gs == (math.ceil(math.ceil(1003 / 4) / 256), 1, 1)
