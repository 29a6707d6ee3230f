"""ROCm compile path, proven without an AMD GPU: every kernel family rendered to AMDGPU LLVM IR,
compiled by llvmlite, linked by ld.lld and checked as a code object with pyelftools (machine, arch
in e_flags, kernel symbol and .kd descriptor, code object v5, the metadata note's arguments)."""
from __future__ import annotations

import ctypes
import dataclasses
import io
import math
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from morok_py import CompileError, DeviceSpec, DeviceUnavailableError, DeviceError, dtypes
from morok_py import kernels as K
from morok_py.backends.rocm import compile_only_pairs
from morok_py.backends.rocm import compiler as C
from morok_py.backends.rocm import renderer as R
from morok_py.codegen import llvm_math
from morok_py.codegen.symbols import symbol_for
from morok_py.backends.rocm.runtime import check_code_object, check_kernarg_layout, kernarg_layout

elftools = pytest.importorskip("elftools", reason="pyelftools checks the code objects (pip install pyelftools)")
from elftools.elf.elffile import ELFFile  # noqa: E402

ARCHS = {"gfx90a": (0x3F, 64), "gfx942": (0x4C, 64), "gfx1100": (0x41, 32)}

try:
    C.find_lld()
    _NO_LLD = None
except DeviceUnavailableError as e:
    _NO_LLD = str(e)
needs_lld = pytest.mark.skipif(_NO_LLD is not None, reason=f"no ld.lld >= 19 here: {_NO_LLD}")


def llvm_pair(arch):
    renderer, compiler = compile_only_pairs(arch)[0]
    assert compiler.cache_key == "llvm-amdgpu"
    return renderer, compiler


_compiled: dict = {}


def compiled(arch: str, kernel: str):
    key = (arch, kernel)
    if key not in _compiled:
        r, c = llvm_pair(arch)
        spec = r.render(K.named(kernel), name=kernel)
        _compiled[key] = (spec, c.compile(spec))
    return _compiled[key]


# ---- every kernel family, every arch ------------------------------------------------------------

@needs_lld
@pytest.mark.parametrize("kernel", list(K.NAMED))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_code_object_is_a_valid_hsaco(arch, kernel):
    spec, out = compiled(arch, kernel)
    assert out.bytes is not None and out.arch == arch and out.compiler == "llvm-amdgpu"
    check_hsaco(spec, out.bytes, arch, kernel, ARCHS[arch], abi_version=3)


def check_hsaco(spec, data: bytes, arch: str, kernel: str, mach_wave: tuple[int, int], abi_version: int) -> None:
    """Read a code object back with pyelftools: machine, arch in e_flags, code object version, the
    kernel symbol and its 64-byte descriptor, and the metadata note's kernel, wave size, work-group
    size and arguments against the spec and the runtime's packed argument layout."""
    mach, wave = mach_wave
    elf = ELFFile(io.BytesIO(data))
    assert elf.header.e_machine == "EM_AMDGPU"
    assert elf.header.e_type == "ET_DYN"                   # a linked, loadable shared object
    assert elf.header.e_flags & 0xFF == mach               # EF_AMDGPU_MACH_AMDGCN_<arch>
    assert elf.header.e_ident["EI_ABIVERSION"] == abi_version   # 2: code object v4, 3: v5
    assert data[7] == C.ELFOSABI_AMDGPU_HSA
    syms = {s.name: s for s in elf.get_section_by_name(".dynsym").iter_symbols()}
    sym = symbol_for(kernel)
    assert syms[sym]["st_info"]["type"] == "STT_FUNC" and syms[sym]["st_size"] > 0
    kd = syms[f"{sym}.kd"]
    assert kd["st_info"]["type"] == "STT_OBJECT" and kd["st_size"] == 64   # the kernel descriptor
    notes = [n for sec in elf.iter_sections() if sec["sh_type"] == "SHT_NOTE" for n in sec.iter_notes()]
    meta_notes = [n for n in notes if n["n_name"] == "AMDGPU" and n["n_type"] == C.NT_AMDGPU_METADATA]
    assert len(meta_notes) == 1
    desc = meta_notes[0]["n_descdata"]
    meta = C.msgpack_decode(bytes(desc))
    assert meta["amdhsa.version"] == [1, abi_version - 1]  # [1, 1]: code object v4, [1, 2]: v5
    assert meta["amdhsa.target"].startswith(f"amdgcn-amd-amdhsa--{arch}")
    (kmeta,) = meta["amdhsa.kernels"]
    assert kmeta[".name"] == sym and kmeta[".symbol"] == f"{sym}.kd"
    assert kmeta[".wavefront_size"] == wave
    assert kmeta[".max_flat_workgroup_size"] == math.prod(spec.launch.local_size)
    args = [a for a in kmeta[".args"] if not a[".value_kind"].startswith("hidden_")]
    assert len(args) == spec.buf_count + len(spec.launch.hidden) + len(spec.var_names)
    nptr = spec.buf_count + len(spec.launch.hidden)   # hidden scratch buffers follow the caller's
    for a in args[:nptr]:
        assert (a[".value_kind"], a[".address_space"], a[".size"]) == ("global_buffer", "global", 8)
    for a, var in zip(args[nptr:], spec.var_names):
        # hiprtc's code objects leave argument names out; where there is one, it is the variable's
        assert (a[".value_kind"], a[".size"], a.get(".name", f"var_{var}")) == ("by_value", 4, f"var_{var}")
    # the runtime's packed argument buffer matches the metadata's offsets
    layout = kernarg_layout(nptr, len(spec.var_names))
    check_kernarg_layout(kernel, data, layout, nptr, len(spec.var_names))
    assert C.code_object_metadata(data) == meta           # the runtime's own ELF reader agrees


@pytest.mark.parametrize("arch", list(ARCHS))
def test_rendered_ir_targets_amdgpu(arch):
    r, _ = llvm_pair(arch)
    spec = r.render(K.named("softmax"), name="softmax")
    src = spec.src
    assert 'target triple = "amdgcn-amd-amdhsa"' in src
    assert "define amdgpu_kernel void @k_softmax(ptr addrspace(1) noalias %p0" in src
    assert "@llvm.amdgcn.workgroup.id.x()" in src and "@llvm.amdgcn.workitem.id.x()" in src
    assert f'"amdgpu-flat-work-group-size"="1,{math.prod(spec.launch.local_size)}"' in src
    assert '!{i32 1, !"amdhsa_code_object_version", i32 500}' in src
    assert "alloca float, addrspace(5)" in src     # accumulators live in private memory


def test_wave_size_follows_the_arch():
    assert [R.wave_size(a) for a in ("gfx90a", "gfx942", "gfx1100", "gfx1030", "gfx1201")] == [64, 64, 32, 32, 32]
    assert C.target_features("gfx942") == "+wavefrontsize64"
    assert C.target_features("gfx1100") == "+wavefrontsize32"
    assert C.target_features("gfx90a:sramecc+:xnack-") == "+wavefrontsize64,+sramecc,-xnack"
    # lowering sees the wave: a 2-D launch gets a full wave along x
    ast = K.broadcast_binary("add", (7, 1, 300), (5, 300))
    for arch, wave in (("gfx942", 64), ("gfx1100", 32)):
        r, _ = llvm_pair(arch)
        assert r.caps.warp_size == wave
        assert r.render(ast, name="b").launch.local_size[0] == wave


def test_unknown_arch_is_refused():
    with pytest.raises(ValueError, match="gfx941"):
        compile_only_pairs("gfx941")          # LLVM 22 dropped it and would silently emit generic code
    with pytest.raises(ValueError):
        compile_only_pairs("sm_90")


@needs_lld
def test_every_dtype_selects_on_every_arch():
    """LLVM aborts the process on an op AMDGPU can't select (f64 sin/exp2/log2 have no instruction
    and no libm): every unary and binary op on every dtype must compile."""
    for arch in ARCHS:
        r, c = llvm_pair(arch)
        for dt in (dtypes.float64, dtypes.float16, dtypes.bfloat16, dtypes.float32):
            for u in K.UNARY:
                c.emit_object(r.render(K.unary(u, dtype=dt), name="u").src)
            for b in K.BINARY:
                c.emit_object(r.render(K.binary(b, dtype=dt), name="b").src)
        for dt in (dtypes.int8, dtypes.uint8, dtypes.int32, dtypes.uint32, dtypes.int64, dtypes.uint64):
            for b in ("add", "sub", "mul", "max", "min"):
                c.emit_object(r.render(K.binary(b, dtype=dt), name="b").src)
            c.emit_object(r.render(K.sum_all(dtype=dt), name="s").src)


# ---- the double-precision helpers, run on the host ---------------------------------------------

def _host_helper(name, build):
    import llvmlite.binding as llvm
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    ir = "\n".join(llvm_math.F64_HELPER_DECLS.values()) + "\n" + build() + f"""
define void @run(ptr %i, ptr %o, i64 %n) {{
entry:
  br label %loop
loop:
  %k = phi i64 [0, %entry], [%k1, %loop]
  %pi = getelementptr double, ptr %i, i64 %k
  %x = load double, ptr %pi
  %y = call double @{name}(double %x)
  %po = getelementptr double, ptr %o, i64 %k
  store double %y, ptr %po
  %k1 = add i64 %k, 1
  %c = icmp slt i64 %k1, %n
  br i1 %c, label %loop, label %done
done:
  ret void
}}"""
    mod = llvm.parse_assembly(ir)
    mod.verify()
    engine = llvm.create_mcjit_compiler(mod, llvm.Target.from_default_triple().create_target_machine())
    engine.finalize_object()
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(engine.get_function_address("run"))

    def call(x):
        x = np.ascontiguousarray(x, dtype=np.float64)
        out = np.empty_like(x)
        fn(x.ctypes.data, out.ctypes.data, len(x))
        return out
    call.engine = engine
    return call


def _ulps(got, ref):
    fin = np.isfinite(ref)
    assert np.array_equal(np.isnan(got), np.isnan(ref)), "NaN where numpy has none (or the reverse)"
    assert np.array_equal(got[np.isinf(ref)], ref[np.isinf(ref)]), "infinities differ"
    scale = np.spacing(np.maximum(np.abs(ref[fin]), np.finfo(np.float64).tiny))
    return float(np.max(np.abs(got[fin] - ref[fin]) / scale))


@pytest.mark.parametrize("op,ref,inputs,max_ulp", [
    ("SIN", np.sin, lambda g: np.concatenate([g.uniform(-7, 7, 20000), g.uniform(-1e5, 1e5, 20000),
                                                [0.0, -0.0, np.pi, 1e-300, np.inf, -np.inf, np.nan]]), 2),
    ("EXP2", np.exp2, lambda g: np.concatenate([g.uniform(-20, 20, 20000), g.uniform(-1074, 1024, 20000),
                                                  [0.0, 1023.99, 1024.0, -1074.0, -1100.0, np.inf, -np.inf,
                                                   np.nan]]), 2),
    ("LOG2", np.log2, lambda g: np.concatenate([g.uniform(0, 10, 20000), np.exp(g.uniform(-700, 700, 20000)),
                                                  [1.0, 0.0, -1.0, 5e-324, 1e-310, np.inf, -np.inf, np.nan]]), 4),
])
def test_f64_helpers_match_numpy(op, ref, inputs, max_ulp, rng):
    from morok_py.ir import Ops
    name, build = llvm_math.F64_HELPERS[getattr(Ops, op)]
    f = _host_helper(name, build)
    x = inputs(rng)
    with np.errstate(all="ignore"):
        want = ref(x)
    assert _ulps(f(x), want) <= max_ulp
    if op == "SIN":
        assert np.signbit(f(np.array([-0.0]))[0])


# ---- the code object checks the runtime does at load -------------------------------------------

@needs_lld
def test_arch_mismatch_is_refused_at_load_naming_both():
    _, out = compiled("gfx942", "add")
    check_code_object("add", out.bytes, "gfx942:sramecc+:xnack-", "ROCM:0")   # same arch: fine
    with pytest.raises(DeviceError, match=r"compiled for gfx942 but ROCM:0 is gfx90a") as e:
        check_code_object("add", out.bytes, "gfx90a:sramecc+:xnack-", "ROCM:0")
    assert e.value.name == "hipErrorNoBinaryForGpu"
    with pytest.raises(DeviceError, match="not an ELF"):
        check_code_object("add", b"not a code object" * 8, "gfx942", "ROCM:0")


@needs_lld
def test_pinned_xnack_mode_mismatch_is_refused():
    r, c = compile_only_pairs("gfx90a:xnack+")[0]
    out = c.compile(r.render(K.named("add"), name="add"))
    assert C.code_object_header(out.bytes)["flags"] & 0x300 == 0x300        # xnack on, pinned
    with pytest.raises(DeviceError, match="xnack"):
        check_code_object("add", out.bytes, "gfx90a:sramecc+:xnack-", "ROCM:0")


def test_msgpack_decoder():
    # {"a": [1, -1, 300, "xy"], "b": {"c": true, "d": None}, "e": 70000}
    data = (b"\x83\xa1a\x94\x01\xff\xcd\x01\x2c\xa2xy\xa1b\x82\xa1c\xc3\xa1d\xc0\xa1e\xce\x00\x01\x11\x70")
    assert C.msgpack_decode(data) == {"a": [1, -1, 300, "xy"], "b": {"c": True, "d": None}, "e": 70000}
    with pytest.raises(ValueError):
        C.msgpack_decode(data + b"\x00")


# ---- compile errors and the linker search -------------------------------------------------------

@needs_lld
def test_bad_ir_is_a_compile_error_with_source_and_command():
    r, c = llvm_pair("gfx942")
    spec = r.render(K.named("add"), name="add")
    bad = dataclasses.replace(spec, src=spec.src.replace("ret void", "ret i32 7"))
    with pytest.raises(CompileError) as e:
        c.compile(bad)
    assert "LLVM rejected kernel add" in str(e.value) and "ld.lld -shared" in e.value.command
    assert "ret i32 7" in str(e.value)


@needs_lld
def test_link_error_is_a_compile_error_with_the_linker_log():
    r, c = llvm_pair("gfx942")
    spec = r.render(K.named("add"), name="add")
    src = spec.src.replace("ret void", "call void @morok_missing()\n  ret void") + "declare void @morok_missing()\n"
    with pytest.raises(CompileError) as e:
        c.compile(dataclasses.replace(spec, src=src))
    assert "morok_missing" in e.value.log and "ld.lld" in str(e.value)


@needs_lld
def test_temporary_files_stay_out_of_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r, c = llvm_pair("gfx1100")
    c.compile(r.render(K.named("sum"), name="sum"))
    assert list(tmp_path.iterdir()) == []


def _fake_lld(path, version_line):
    path.write_text(f"#!/bin/sh\necho '{version_line}'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _search(monkeypatch, **env):
    for k in ("MOROK_LLD", "ROCM_PATH", "PATH"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return C.find_lld()


def test_linker_search_order(tmp_path, monkeypatch):
    rocm = tmp_path / "rocm" / "llvm" / "bin"
    rocm.mkdir(parents=True)
    rocm_lld = _fake_lld(rocm / "ld.lld", "AMD LLD 18.0.0 (compatible with GNU linkers)")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _fake_lld(bindir / "ld.lld", "LLD 17.0.6 (compatible with GNU linkers)")     # too old
    new = _fake_lld(bindir / "ld.lld-21", "Debian LLD 21.1.0 (compatible with GNU linkers)")
    explicit = _fake_lld(tmp_path / "my-lld", "LLD 20.1.0")
    lk = _search(monkeypatch, MOROK_LLD=explicit, ROCM_PATH=str(tmp_path / "rocm"), PATH=str(bindir))
    assert (lk.path, lk.found_by) == (explicit, "MOROK_LLD")
    lk = _search(monkeypatch, ROCM_PATH=str(tmp_path / "rocm"), PATH=str(bindir))
    assert (lk.path, lk.found_by) == (rocm_lld, "$ROCM_PATH/llvm/bin/ld.lld")
    lk = _search(monkeypatch, PATH=str(bindir))
    if not os.path.exists("/opt/rocm/llvm/bin/ld.lld"):
        assert (lk.path, lk.version, lk.found_by) == (new, "21.1.0", "PATH (ld.lld-21)")


def test_no_linker_is_device_unavailable_saying_what_to_install(tmp_path, monkeypatch):
    if os.path.exists("/opt/rocm/llvm/bin/ld.lld"):
        pytest.skip("/opt/rocm/llvm/bin/ld.lld exists here, so a linker is always found")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _fake_lld(bindir / "ld.lld", "LLD 15.0.7")
    with pytest.raises(DeviceUnavailableError) as e:
        _search(monkeypatch, PATH=str(bindir))
    assert "too old" in str(e.value) and "lld-19" in str(e.value)
    r, c = llvm_pair("gfx942")
    assert "lld-19" in c.available()
    with pytest.raises(DeviceUnavailableError):
        c.compile(r.render(K.named("add"), name="add"))
    with pytest.raises(DeviceUnavailableError, match="not an executable"):
        _search(monkeypatch, MOROK_LLD=str(tmp_path / "nope"))


@needs_lld
def test_morok_compile_cli_needs_no_rocm(tmp_path):
    out = tmp_path / "softmax.hsaco"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(C.__file__).rsplit("/backends/", 1)[0],
                                                          os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-m", "morok_py", "compile", "--device", "ROCM", "--arch", "gfx942",
                          "--emit", "compiled", "softmax", "-o", str(out)], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert C.code_object_header(out.read_bytes())["arch"] == "gfx942"


# ---- pair 2: HIP C through hiprtc ---------------------------------------------------------------

def hip_pair(arch):
    pairs = compile_only_pairs(arch)
    assert [c.cache_key for _, c in pairs] == ["llvm-amdgpu", "hiprtc", "mlir"]
    return pairs[1]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_hip_c_renders_every_kernel_family(arch):
    r, _ = hip_pair(arch)
    assert r.caps.warp_size == ARCHS[arch][1]
    for kernel in K.NAMED:
        spec = r.render(K.named(kernel), name=kernel)
        threads = math.prod(spec.launch.local_size)
        assert f'extern "C" __global__ void __launch_bounds__({threads}) {symbol_for(kernel)}(' in spec.src
        assert "__restrict__" in spec.src
        assert ("blockIdx.x" in spec.src) == (threads > 1)    # a full reduction runs as one work-item


def test_hiprtc_says_why_it_is_unavailable():
    _, c = hip_pair("gfx942")
    why = c.available()
    if why is None:
        pytest.skip("hiprtc is usable here")
    assert "hiprtc" in why or "hip-python" in why


# the archs the hiprtc of ROCm 5.2 (Debian 12's libamdhip64-5) supports; its code objects are v4
HIPRTC_ARCHS = {"gfx90a": (0x3F, 64), "gfx1030": (0x36, 32)}


def usable_hip_pair(arch):
    """The hiprtc pair, or a skip with the reason; a failure instead where MOROK_TEST_REQUIRE names
    hiprtc (CI installs it, so a skip there would hide a broken install)."""
    r, c = hip_pair(arch)
    why = c.available()
    if why is not None:
        if "hiprtc" in os.environ.get("MOROK_TEST_REQUIRE", "").split(","):
            pytest.fail(f"MOROK_TEST_REQUIRE names hiprtc but it is unavailable: {why}")
        pytest.skip(f"hiprtc unavailable: {why}")
    return r, c


_hiprtc_compiled: dict = {}


@pytest.mark.parametrize("kernel", list(K.NAMED))
@pytest.mark.parametrize("arch", list(HIPRTC_ARCHS))
def test_hiprtc_code_object(arch, kernel):
    r, c = usable_hip_pair(arch)
    spec = r.render(K.named(kernel), name=kernel)
    out = c.compile(spec)
    assert out.arch == arch and out.compiler == "hiprtc"
    version = C.code_object_metadata(out.bytes)["amdhsa.version"]
    assert version in ([1, 1], [1, 2]), version                    # code object v4 (ROCm 5) or v5
    check_hsaco(spec, out.bytes, arch, kernel, HIPRTC_ARCHS[arch], abi_version=version[1] + 1)
    check_code_object(kernel, out.bytes, arch, "ROCM:0")            # what the runtime checks at load


def test_hiprtc_refuses_an_arch_it_predates_before_calling_it():
    """ROCm 5.2's hiprtc aborts the interpreter on gfx942/gfx1100: the compiler must refuse first,
    from comgr's ISA list, with an error naming the arch and what it supports."""
    from morok_py.backends.rocm.hiprtc import load_hiprtc
    usable_hip_pair("gfx90a")
    rtc = load_hiprtc()
    missing = [a for a in ("gfx942", "gfx1100", "gfx1201", "gfx950") if a not in rtc.archs]
    if not missing:
        pytest.skip(f"this hiprtc ({rtc.version}) supports every arch the test would refuse")
    arch = missing[0]
    r, c = hip_pair(arch)
    assert f"does not support {arch}" in c.available() and "gfx90a" in c.available()
    with pytest.raises(DeviceUnavailableError, match=f"does not support {arch}"):
        c.compile(r.render(K.named("add"), name="add"))


def test_hiprtc_rejection_is_a_compile_error_with_the_log():
    r, c = usable_hip_pair("gfx90a")
    spec = r.render(K.named("add"), name="add")
    bad = dataclasses.replace(spec, src=spec.src + "\nstatic int morok_broken = undeclared_name;\n")
    with pytest.raises(CompileError) as e:
        c.compile(bad)
    assert "hiprtc rejected kernel add" in str(e.value) and "undeclared_name" in e.value.log
    assert "--offload-arch=gfx90a" in e.value.command


def test_hiprtc_identity_names_the_library_and_arch():
    _, c = usable_hip_pair("gfx1030")
    ident = c.identity()
    assert ident.startswith("hiprtc-") and "gfx1030" in ident and "comgr" in ident


# ---- pair 3: MLIR (gpu + rocdl) -> LLVM IR -> llvmlite -> ld.lld -----------------------------------

def usable_mlir_pair(arch):
    """The MLIR pair, or a skip with the reason (a failure where MOROK_TEST_REQUIRE names mlir)."""
    r, c = compile_only_pairs(arch)[2]
    assert c.cache_key == "mlir"
    why = c.available()
    if why is not None:
        if "mlir" in os.environ.get("MOROK_TEST_REQUIRE", "").split(",") and _NO_LLD is None:
            pytest.fail(f"MOROK_TEST_REQUIRE names mlir but it is unavailable: {why}")
        pytest.skip(f"the MLIR pair is unavailable: {why}")
    return r, c


@pytest.mark.parametrize("kernel", list(K.NAMED))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_mlir_code_object_is_a_valid_hsaco(arch, kernel):
    r, c = usable_mlir_pair(arch)
    spec = r.render(K.named(kernel), name=kernel)
    assert f'#rocdl.target<chip = "{arch}">' in spec.src
    out = c.compile(spec)
    assert out.arch == arch and out.compiler == "mlir"
    check_hsaco(spec, out.bytes, arch, kernel, ARCHS[arch], abi_version=3)
    check_code_object(kernel, out.bytes, arch, "ROCM:0")


def test_mlir_pair_links_the_double_helpers():
    """sin/exp2/log2 on float64 have no AMDGPU instruction: the MLIR kernel calls the LLVM printer's
    IR helpers, defined after translation (LLVM would abort the process on an unresolved one)."""
    r, c = usable_mlir_pair("gfx90a")
    for fn in ("sin", "exp2", "log2"):
        spec = r.render(K.unary(fn, dtype=dtypes.float64), name=fn)
        assert "llvm.call @__morok_" in spec.src
        ir = c.llvm_ir(spec)
        assert "define internal double @__morok_" in ir and "declare double @__morok_" not in ir
        assert C.code_object_header(c.compile(spec).bytes)["arch"] == "gfx90a"
