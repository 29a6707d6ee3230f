"""Any non-empty str names a kernel on every pair: keywords and builtins of C, C++ and CUDA, dots, dashes,
slashes, spaces, non-ASCII, leading digits, 300 characters. The symbol is derived deterministically
(`codegen.symbols.symbol_for`); the user's name is what specs, debug output and errors show."""
from __future__ import annotations

import io
import re
import uuid

import numpy as np
import pytest

from morok_py import LaunchError, UOp, cache, dtypes, kernels as K
from morok_py.cache import disk_key, stats
from morok_py.codegen.symbols import SYMBOL_MAX_BODY, check_kernel_name, symbol_for

from conftest import open_target, random_array

TRICKY = ["and", "or", "not", "xor", "int", "float", "main", "threadIdx", "__global__", "exp", "return",
          "printf", "/layer1/conv/Conv", "kernel.v2", "my-kernel", "Add_3", "with space", "Ünïcødé ✓", "核",
          "3d_conv", "_leading", "k_add", "kh_add", "x" * 300]
BAD = ["", None, 3, b"x", 1.5, True]
SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
N = 1003     # not a multiple of any vector width


def unique_add() -> UOp:
    """out[i] = a[i] + b[i] * c with a constant no other test uses, so no cache has seen it."""
    c = float(uuid.uuid4().int % 10**6) + 0.5
    a, b, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32), UOp.param(2, dtypes.float32)
    i = UOp.range(UOp.variable("n", 1, 1 << 20), 0)
    return UOp.sink(out.store(i, a.load(i) + b.load(i) * c)), np.float32(c)


def run_add(target, prog, rng, c=np.float32(1.0)):
    a, b = random_array(rng, N, np.float32), random_array(rng, N, np.float32)
    out = target.empty(N, dtypes.float32)
    prog(target.buf(a), target.buf(b), out, n=N)
    np.testing.assert_allclose(out.numpy(), a + b * c, rtol=1e-6)


# ---- the symbol ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TRICKY, ids=lambda n: n[:20])
def test_every_name_gets_a_valid_bounded_deterministic_symbol(name):
    sym = symbol_for(name)
    assert SYMBOL.fullmatch(sym) and "__" not in sym
    assert sym.startswith(("k_", "kh_"))            # never a keyword or builtin, never a leading digit
    assert len(sym) <= 3 + SYMBOL_MAX_BODY + 13
    assert symbol_for(name) == sym


def test_clean_names_keep_their_spelling_and_changed_ones_get_a_hash():
    assert symbol_for("softmax") == "k_softmax" and symbol_for("and") == "k_and"
    assert re.fullmatch(r"kh_layer1_conv_Conv_[0-9a-f]{12}", symbol_for("/layer1/conv/Conv"))
    assert re.fullmatch(r"kh_x{64}_[0-9a-f]{12}", symbol_for("x" * 300))       # truncated: hashed


def test_names_that_sanitize_alike_get_distinct_symbols():
    alike = ["a.b", "a-b", "a b", "a/b", "a__b", "a_b", "a..b", "a.b.", "x" * 65, "x" * 66]
    assert len({symbol_for(n) for n in alike}) == len(alike)


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_bad_names_raise_a_clear_value_error(bad, cpu):
    with pytest.raises(ValueError, match="non-empty str"):
        symbol_for(bad)
    with pytest.raises(ValueError, match="non-empty str"):
        check_kernel_name(bad)
    if bad is not None:       # None asks the device to derive a name from the AST
        with pytest.raises(ValueError, match="non-empty str"):
            cpu.compile(K.add(), bad)
        with pytest.raises(ValueError, match="non-empty str"):
            cpu.pair()[0].render(K.add(), bad)


# ---- the CPU: compile and run -------------------------------------------------------------------

@pytest.mark.parametrize("name", TRICKY, ids=lambda n: n[:20])
def test_cpu_runs_a_kernel_of_any_name(cpu, rng, name):
    prog = cpu.compile(K.add(), name)
    assert prog.name == name and prog.compiled.name == name and prog.compiled.symbol == symbol_for(name)
    run_add(cpu, prog, rng)


def test_names_that_sanitize_alike_run_their_own_kernels_in_one_process(cpu, rng):
    (ast1, c1), (ast2, c2) = unique_add(), unique_add()
    p1, p2 = cpu.compile(ast1, "layer.1"), cpu.compile(ast2, "layer-1")
    assert p1.compiled.symbol != p2.compiled.symbol
    run_add(cpu, p1, rng, c1)
    run_add(cpu, p2, rng, c2)
    # the same AST under the two names: two entries in every cache, each loading its own symbol
    q1, q2 = cpu.compile(ast1, "layer-1"), cpu.compile(ast1, "layer.1")
    assert q1 is not q2 and q2 is p1
    r, c = cpu.pair()
    assert disk_key(c, r.render(ast1, "layer.1")) != disk_key(c, r.render(ast1, "layer-1"))
    assert cache.ast_key(r, c, ast1, "layer.1") != cache.ast_key(r, c, ast1, "layer-1")
    run_add(cpu, q1, rng, c1)


def test_a_disk_cache_hit_loads_the_symbol_of_its_name(cpu, rng, tmp_path, monkeypatch):
    monkeypatch.setenv("MOROK_CACHE_DIR", str(tmp_path / "cache"))
    ast, c = unique_add()
    for name in ("/layer1/conv/Conv", "kernel.v2"):
        cpu.compile(ast, name)
    cache.clear_memory_caches()
    before = (stats.compiles, stats.disk_hits)
    progs = [cpu.compile(ast, name) for name in ("/layer1/conv/Conv", "kernel.v2")]
    assert (stats.compiles - before[0], stats.disk_hits - before[1]) == (0, 2)
    for p in progs:
        run_add(cpu, p, rng, c)


def test_debug_output_and_errors_show_the_users_name(cpu, rng, monkeypatch, capfd):
    monkeypatch.setenv("MOROK_DEBUG", "2")
    ast, _ = unique_add()
    prog = cpu.compile(ast, "/layer1/conv/Conv")
    err = capfd.readouterr().err
    assert "compiled /layer1/conv/Conv with llvm" in err and "/layer1/conv/Conv source (CPU)" in err
    assert f"define void @{symbol_for('/layer1/conv/Conv')}(" in err
    monkeypatch.delenv("MOROK_DEBUG")
    with pytest.raises(LaunchError, match="/layer1/conv/Conv takes 3 buffer"):
        prog(cpu.empty(N, dtypes.float32), n=N)


# ---- GPU pairs: compile for an explicit arch, no GPU needed --------------------------------------

def _pair(pairs, key, usable=True):
    for r, c in pairs:
        if c.cache_key == key:
            why = c.available() if usable else None
            if why is not None:
                pytest.skip(f"{key} is not usable here: {why}")
            return r, c
    pytest.skip(f"no {key} pair")


def _cubin_functions(data: bytes) -> set[str]:
    from elftools.elf.elffile import ELFFile
    syms = ELFFile(io.BytesIO(data)).get_section_by_name(".symtab")
    return {s.name for s in syms.iter_symbols() if s["st_info"]["type"] == "STT_FUNC"}


@pytest.mark.parametrize("key", ["nvrtc", "llvm-nvptx"])
def test_cuda_pairs_compile_kernels_of_any_name(key):
    pytest.importorskip("cuda.bindings", reason="the cuda extra is not installed (pip install morok-py[cuda])")
    pytest.importorskip("elftools", reason="pyelftools reads the CUBINs")
    from morok_py.backends.cuda import compile_only_pairs
    r, c = _pair(compile_only_pairs("sm_90"), key)
    for name in TRICKY:
        spec = r.render(K.add(), name)
        out = c.compile(spec)
        assert out.name == name and spec.symbol in _cubin_functions(out.bytes), name


def _amdgpu_kernel_names(data: bytes) -> set[str]:
    from morok_py.backends.rocm import compiler as C
    return {k[".name"] for k in C.code_object_metadata(data)["amdhsa.kernels"]}


@pytest.mark.parametrize("key", ["llvm-amdgpu", "hiprtc"])
def test_rocm_pairs_compile_kernels_of_any_name(key):
    from morok_py.backends.rocm import compile_only_pairs
    from morok_py.backends.rocm.runtime import check_kernarg_layout, kernarg_layout
    r, c = _pair(compile_only_pairs("gfx942"), key, usable=False)
    specs = [r.render(K.add(), name) for name in TRICKY]       # rendering needs no toolchain
    assert all(f"{s.symbol}(" in s.src and s.name == name for s, name in zip(specs, TRICKY))
    why = c.available()
    if why is not None:
        pytest.skip(f"{key} is not usable here: {why}")
    if key == "llvm-amdgpu":
        from morok_py.backends.rocm.compiler import find_lld
        from morok_py import DeviceUnavailableError
        try:
            find_lld()
        except DeviceUnavailableError as e:
            pytest.skip(f"no ld.lld >= 19 here: {e}")
    for name, spec in zip(TRICKY, specs):
        out = c.compile(spec)
        assert out.name == name and _amdgpu_kernel_names(out.bytes) == {spec.symbol}, name
        nptr = spec.buf_count + len(spec.launch.hidden)
        check_kernarg_layout(name, out.bytes, kernarg_layout(nptr, len(spec.var_names)), nptr, len(spec.var_names))


# ---- on the GPU ---------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("key", ["nvrtc", "llvm-nvptx"])
def test_cuda_runs_kernels_of_any_name(key, rng):
    target = open_target("CUDA", key)
    for name in TRICKY:
        prog = target.compile(K.add(), name)
        assert prog.name == name
        run_add(target, prog, rng)


@pytest.mark.rocm
@pytest.mark.parametrize("key", ["llvm-amdgpu", "hiprtc"])
def test_rocm_runs_kernels_of_any_name(key, rng):
    target = open_target("ROCM", key)
    for name in TRICKY:
        run_add(target, target.compile(K.add(), name), rng)
