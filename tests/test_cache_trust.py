"""The disk cache trusts nothing it reads back: entries damaged in ways their checksum still matches
(a buggy writer, another version, a hand edit) are caught before a loader or a launch sees them,
recompiled in the same call and healed for the next process; paths that are not usable files are
removed or bypassed with one warning; several processes fill one cache at once. Damage that could
crash the interpreter runs in child processes, whose exit code is checked."""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from morok_py import dtypes, elf
from morok_py import cache
from morok_py.cache import DiskCache, stats
from morok_py.codegen.symbols import symbol_for
from morok_py.device import kernel_name

def kernel(tag):
    """out[i] = exp(x[i] * tag): constants, a call and relocations in the CPU object."""
    from morok_py import UOp, dtypes
    x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)
    i = UOp.range(UOp.variable("n", 1, 1 << 20), 0)
    return UOp.sink(out.store(i, (x.load(i) * tag).exp()))


CHILD = inspect.getsource(kernel) + r'''
import json, os, sys, time, warnings
import numpy as np
from morok_py import Buffer, Device, MorokError
from morok_py.cache import stats

spec = json.loads(sys.argv[1])
go = spec.get("go")
while go and not os.path.exists(go):        # several children start compiling at the same moment
    time.sleep(0.002)
dev = Device[spec.get("device", "CPU")]
results = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for k in spec["kernels"]:
        print("kernel", k, file=sys.stderr, flush=True)   # the last one named is the one that crashed
        before = (stats.compiles, stats.disk_corrupt, stats.ast_hits, stats.disk_hits)
        prog = dev.compile(kernel(k["tag"]), k.get("name"), compiler=spec.get("compiler"))
        now = (stats.compiles, stats.disk_corrupt, stats.ast_hits, stats.disk_hits)
        n = k.get("n", 37)
        x = np.random.default_rng(k.get("seed", 5)).standard_normal(n).astype(np.float32)
        out = dev.buffer(k.get("out_n", n), "float32")
        try:
            prog(Buffer.from_numpy(x, dev), out, n=n)
            want = np.exp(x * np.float32(k["tag"]))
            ok, err = bool(np.allclose(out.numpy(), want, rtol=3e-5, atol=1e-6)), None
        except MorokError as e:
            ok, err = None, f"{type(e).__name__}: {e}"
        results.append({"ok": ok, "error": err, "compiles": now[0] - before[0], "corrupt": now[1] - before[1],
                        "ast_hits": now[2] - before[2], "disk_hits": now[3] - before[3]})
print(json.dumps({"kernels": results,
                  "warnings": [str(w.message) for w in caught if str(w.message).startswith("morok_py: disk cache")]}))
'''


def child_args(cache_dir: Path, kernels: list[dict], device: str = "CPU", compiler: str | None = None,
               go: Path | None = None) -> tuple[list[str], dict]:
    spec = {"kernels": kernels, "device": device, "compiler": compiler, "go": str(go) if go else None}
    env = dict(os.environ, MOROK_CACHE_DIR=str(cache_dir))
    env.pop("MOROK_DEBUG", None)
    return [sys.executable, "-c", CHILD, json.dumps(spec)], env


def run_child(cache_dir: Path, kernels: list[dict], device: str = "CPU", compiler: str | None = None) -> dict:
    """Compile and run `kernels` in a fresh interpreter; it must exit 0 (no crash), whatever the cache holds."""
    args, env = child_args(cache_dir, kernels, device, compiler)
    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"the child exited with {res.returncode}:\n{res.stderr[-4000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---- finding and damaging entries ------------------------------------------------------------------

def entry_files(root: Path, key: str) -> tuple[Path, Path]:
    return root / key[:2] / f"{key}.bin", root / key[:2] / f"{key}.json"


def keys_of(dev, compiler: str, ast, name=None) -> tuple[str, str]:
    """(source-level key, AST-level key) of a kernel, as a fresh process computes them."""
    cache._code_fingerprints.clear()
    r, c = dev.pair(compiler)
    return cache.disk_key(c, r.render(ast, name)), cache.ast_key(r, c, ast, kernel_name(ast, name))


def store_with_checksum(bin_path: Path, meta_path: Path, data: bytes) -> None:
    """Replace an entry's bytes and fix up its checksum: damage a checksum cannot see."""
    bin_path.write_bytes(data)
    meta = json.loads(meta_path.read_text())
    meta.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    meta_path.write_text(json.dumps(meta))


def garble(n: int, seed: int = 7) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _set_section_field(data: bytes, pick, field_offset: int, fmt: str, value) -> bytes:
    """Set a field of the section-table entries `pick(section)` selects."""
    out = bytearray(data)
    shoff, = struct.unpack_from("<Q", out, 0x28)
    for s in elf.sections(data):
        if pick(s):
            at = shoff + s.index * 64 + field_offset
            struct.pack_into(fmt, out, at, value(s) if callable(value) else value)
    return bytes(out)


def _kernel_symbol_binding_local(data: bytes, symbol: str) -> bytes:
    out = bytearray(data)
    secs = elf.sections(data)
    tab = next(s for s in secs if s.type == elf.SHT_SYMTAB)
    strings = secs[tab.link]
    for at in range(tab.offset, tab.offset + tab.size, 24):
        name_off, info = struct.unpack_from("<IB", data, at)
        end = data.index(b"\0", strings.offset + name_off)
        if data[strings.offset + name_off:end] == symbol.encode():
            out[at + 4] = info & 0xF          # STB_LOCAL
    return bytes(out)


OBJECT_DAMAGE = {
    # the bytes of another file: a segfault in the loader before the check
    "other bytes": lambda data, other, name: garble(len(data)),
    "another kernel's object": lambda data, other, name: other,
    "ELF header kept, the rest garbled": lambda data, other, name: data[:64] + garble(len(data) - 64),
    # a mangled section table: a crash, an abort or SYMBOL_NOT_FOUND in every process before the check
    "section table offset past the end": lambda data, other, name: (
        data[:0x28] + struct.pack("<Q", len(data) + 4096) + data[0x30:]),
    "section offsets past the end": lambda data, other, name: _set_section_field(
        data, lambda s: s.index > 0, 0x18, "<Q", lambda s: s.offset + (1 << 28)),
    "code section made NOBITS": lambda data, other, name: _set_section_field(
        data, lambda s: bool(s.flags & elf.SHF_EXECINSTR), 4, "<I", elf.SHT_NOBITS),
    "kernel symbol made local": lambda data, other, name: _kernel_symbol_binding_local(data, symbol_for(name)),
    "wrong machine": lambda data, other, name: data[:0x12] + struct.pack("<H", elf.EM_AARCH64) + data[0x14:],
    "truncated": lambda data, other, name: data[:len(data) // 2],
    "empty": lambda data, other, name: b"",
}


def populate(dev, compiler: str, tags: list[float], name: str | None = None) -> None:
    """Compile kernels into the cache from a fresh interpreter (what a user's earlier run leaves)."""
    got = run_child(Path(os.environ["MOROK_CACHE_DIR"]), [{"tag": t, "name": name} for t in tags], dev.name, compiler)
    assert all(k["ok"] for k in got["kernels"]), got


_TAG = iter(range(10_000))


def fresh_tag() -> float:
    """A constant no other kernel of this test run used (0.5 to 2.0: exp stays in range)."""
    return 0.5 + (next(_TAG) * 7919 + os.getpid()) % 15000 / 10000


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("MOROK_CACHE_DIR", str(d))
    monkeypatch.delenv("MOROK_CACHE", raising=False)
    monkeypatch.setattr(cache, "_warned_roots", set(), raising=False)
    return d


def _heals(dev, compiler: str, cache_dir: Path, damage, name: str | None = None) -> tuple[dict, dict]:
    """Populate, damage (`damage(ast, other_ast)`), then two fresh processes: the first must give the
    right result, the second must hit the entry the first repaired. Both kernels are called `name`
    (None: each its own). Retried when the source tree changes in between (the AST-level key follows
    the code's files)."""
    for _ in range(3):
        tag, other = fresh_tag(), fresh_tag()
        ast, other_ast = kernel(tag), kernel(other)
        before = keys_of(dev, compiler, ast, name)
        populate(dev, compiler, [tag, other], name)
        damage(ast, other_ast)
        first = run_child(cache_dir, [{"tag": tag, "name": name}], dev.name, compiler)
        second = run_child(cache_dir, [{"tag": tag, "name": name}], dev.name, compiler)
        if keys_of(dev, compiler, ast, name) == before:
            return first, second
    pytest.skip("the source tree kept changing under the test")


def damage_object(dev, compiler: str, cache_dir: Path, how):
    def damage(ast, other_ast):
        (skey, _), (okey, _) = keys_of(dev, compiler, ast), keys_of(dev, compiler, other_ast)
        bin_path, meta_path = entry_files(cache_dir, skey)
        other = entry_files(cache_dir, okey)[0].read_bytes()
        new = how(bin_path.read_bytes(), other, kernel_name(ast, None))
        assert new != bin_path.read_bytes()
        store_with_checksum(bin_path, meta_path, new)
    return damage


@pytest.mark.parametrize("how", list(OBJECT_DAMAGE))
def test_a_damaged_object_is_recompiled_and_healed_for_the_next_process(cpu, cache_dir, how):
    first, second = _heals(cpu.dev, "llvm", cache_dir, damage_object(cpu.dev, "llvm", cache_dir, OBJECT_DAMAGE[how]))
    k1, k2 = first["kernels"][0], second["kernels"][0]
    assert (k1["ok"], k1["compiles"], k1["corrupt"]) == (True, 1, 1), first
    assert (k2["ok"], k2["compiles"], k2["corrupt"], k2["ast_hits"]) == (True, 0, 0, 1), second


def test_an_emptied_access_list_does_not_switch_the_launch_check_off(cpu, cache_dir):
    """An AST-level entry carrying launch facts (with no accesses) is not believed: the check still
    refuses a too-small output, and accepts the exact size."""
    def damage(ast, other_ast):
        _, akey = keys_of(cpu.dev, "llvm", ast)
        bin_path, meta_path = entry_files(cache_dir, akey)
        entry = json.loads(bin_path.read_bytes())
        entry.setdefault("launch", {})["accesses"] = []
        store_with_checksum(bin_path, meta_path, json.dumps(entry).encode())

    for _ in range(3):
        tag = fresh_tag()
        ast = kernel(tag)
        before = keys_of(cpu.dev, "llvm", ast)
        populate(cpu.dev, "llvm", [tag])
        damage(ast, None)
        too_small = {"tag": tag, "n": 1000, "out_n": 3}
        first = run_child(cache_dir, [too_small, {"tag": tag, "n": 1000}], "CPU", "llvm")
        second = run_child(cache_dir, [too_small], "CPU", "llvm")
        if keys_of(cpu.dev, "llvm", ast) == before:
            break
    else:
        pytest.skip("the source tree kept changing under the test")
    refused, exact = first["kernels"]
    assert refused["ok"] is None and refused["error"].startswith("LaunchError"), first
    assert (refused["corrupt"], refused["compiles"]) == (1, 0), first      # the AST entry was rewritten
    assert exact["ok"] is True, first
    k = second["kernels"][0]
    assert k["error"].startswith("LaunchError") and (k["ast_hits"], k["corrupt"]) == (1, 0), second


@pytest.mark.parametrize("name", [None, "twin"], ids=["its own name", "the same name"])
def test_an_ast_entry_naming_another_kernels_bytes_is_not_believed(cpu, cache_dir, name):
    """The other kernel's bytes hold another symbol, or (same name) the same symbol for other work:
    the first is refused by the check, the second because the bytes were written for another AST."""
    def damage(ast, other_ast):
        (_, akey), (okey, _) = keys_of(cpu.dev, "llvm", ast, name), keys_of(cpu.dev, "llvm", other_ast, name)
        bin_path, meta_path = entry_files(cache_dir, akey)
        entry = json.loads(bin_path.read_bytes())
        entry["source_key"] = okey
        store_with_checksum(bin_path, meta_path, json.dumps(entry).encode())

    first, second = _heals(cpu.dev, "llvm", cache_dir, damage, name)
    k1, k2 = first["kernels"][0], second["kernels"][0]
    assert (k1["ok"], k1["corrupt"], k1["ast_hits"]) == (True, 1, 0), first
    assert (k2["ok"], k2["corrupt"], k2["ast_hits"], k2["compiles"]) == (True, 0, 1, 0), second


def test_entry_files_replaced_by_directories_are_removed_with_one_warning(cpu, cache_dir):
    def damage(ast, other_ast):
        for key in keys_of(cpu.dev, "llvm", ast):
            for p in entry_files(cache_dir, key):
                p.unlink()
                p.mkdir()
                (p / "inside").write_text("x")

    first, second = _heals(cpu.dev, "llvm", cache_dir, damage)
    k1, k2 = first["kernels"][0], second["kernels"][0]
    assert k1["ok"] is True and k1["compiles"] == 1, first
    assert len(first["warnings"]) == 1 and "removed" in first["warnings"][0], first["warnings"]
    assert (k2["ok"], k2["compiles"], k2["ast_hits"], second["warnings"]) == (True, 0, 1, []), second


# ---- unusable paths, in this process (nothing here can crash it) ------------------------------------

def _compile_and_check(cpu, tag: float, rng) -> None:
    from morok_py import Buffer
    prog = cpu.compile(kernel(tag))
    x = rng.standard_normal(29).astype(np.float32)
    out = cpu.empty(29, dtypes.float32)
    prog(Buffer.from_numpy(x, cpu.dev), out, n=29)
    np.testing.assert_allclose(out.numpy(), np.exp(x * np.float32(tag)), rtol=3e-5, atol=1e-6)


def ours(w: warnings.WarningMessage) -> bool:
    return str(w.message).startswith("morok_py: disk cache")


def _compiled_fresh(cpu, tag: float, rng) -> tuple[int, list[str]]:
    """(compiles, RuntimeWarnings) of compiling and running a kernel with the memory caches cleared."""
    cache.clear_memory_caches()
    before = stats.compiles
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compile_and_check(cpu, tag, rng)
    return stats.compiles - before, [str(w.message) for w in caught if ours(w)]


def test_a_pipe_or_a_link_where_an_entry_belongs_is_removed_never_read_through(cpu, cache_dir, rng, tmp_path):
    tag, other = fresh_tag(), fresh_tag()
    _compile_and_check(cpu, other, rng)
    _compile_and_check(cpu, tag, rng)
    skey, akey = keys_of(cpu.dev, "llvm", kernel(tag))
    okey, _ = keys_of(cpu.dev, "llvm", kernel(other))
    os.unlink(entry_files(cache_dir, akey)[1])
    os.mkfifo(entry_files(cache_dir, akey)[1])          # opening it for reading would block forever
    for p, q in zip(entry_files(cache_dir, skey), entry_files(cache_dir, okey)):
        p.unlink()
        p.symlink_to(q)                                  # another kernel's valid entry, through a link
    t0 = time.monotonic()
    compiles, warned = _compiled_fresh(cpu, tag, rng)
    assert time.monotonic() - t0 < 60 and compiles == 1 and len(warned) == 1, warned
    for key in (skey, akey):
        for p in entry_files(cache_dir, key):
            assert p.is_file() and not p.is_symlink(), p
    assert entry_files(cache_dir, okey)[0].is_file()      # the link's target is left alone
    assert _compiled_fresh(cpu, tag, rng) == (0, [])


def test_a_shard_folder_replaced_by_a_file_is_replaced(cpu, cache_dir, rng):
    tag = fresh_tag()
    _compile_and_check(cpu, tag, rng)
    skey, akey = keys_of(cpu.dev, "llvm", kernel(tag))
    shards = {cache_dir / skey[:2], cache_dir / akey[:2]}
    for shard in shards:
        for p in shard.iterdir():
            p.unlink()
        shard.rmdir()
        shard.write_text("not a folder")
    compiles, warned = _compiled_fresh(cpu, tag, rng)
    assert compiles == 1 and len(warned) == 1, warned
    assert all(s.is_dir() for s in shards)
    assert _compiled_fresh(cpu, tag, rng) == (0, [])


def test_unreadable_entries_are_replaced(cpu, cache_dir, rng):
    tag = fresh_tag()
    _compile_and_check(cpu, tag, rng)
    paths = [p for key in keys_of(cpu.dev, "llvm", kernel(tag)) for p in entry_files(cache_dir, key)]
    for p in paths:
        p.chmod(0)
    compiles, warned = _compiled_fresh(cpu, tag, rng)
    if os.geteuid() == 0:      # root reads any file: the entries are simply hit
        assert (compiles, warned) == (0, [])
    else:
        assert compiles == 1 and len(warned) == 1, warned
        assert _compiled_fresh(cpu, tag, rng) == (0, [])
    assert all(os.access(p, os.R_OK) for p in paths)


def test_paths_that_cannot_be_removed_are_bypassed_with_one_warning(cpu, cache_dir, rng, monkeypatch):
    """Three kernels whose entries are folders that stay (removal refused): each compiles, one warning."""
    tags = [fresh_tag() for _ in range(3)]
    for t in tags:
        _compile_and_check(cpu, t, rng)
        for key in keys_of(cpu.dev, "llvm", kernel(t)):
            for p in entry_files(cache_dir, key):
                p.unlink()
                p.mkdir()
    monkeypatch.setattr(cache, "remove_path", lambda path: False)
    results = [_compiled_fresh(cpu, t, rng) for t in tags + tags]
    assert [c for c, _ in results] == [1] * 6
    warned = [w for _, ws in results for w in ws]
    assert len(warned) == 1 and "cannot be removed" in warned[0], warned


def test_one_warning_per_cache_folder(cpu, cache_dir, rng):
    tags = [fresh_tag() for _ in range(3)]
    for t in tags:
        _compile_and_check(cpu, t, rng)
        for key in keys_of(cpu.dev, "llvm", kernel(t)):
            p = entry_files(cache_dir, key)[0]
            p.unlink()
            p.mkdir()
    warned = [w for t in tags for w in _compiled_fresh(cpu, t, rng)[1]]
    assert len(warned) == 1, warned


# ---- the structural checks themselves --------------------------------------------------------------

def _objects() -> list:
    """(label, bytes, kind, symbol) of real compiler outputs: both CPU pairs always, CUBIN and AMDGPU
    code objects where their compile-only toolchains are installed."""
    from morok_py import Device, kernels as K
    out = []
    dev = Device["CPU"]
    for r, c in dev.compilers:
        if c.available() is None:
            for nm in ("add", "softmax", "matmul"):
                obj = c.compile(r.render(K.named(nm), nm)).bytes
                out.append((f"cpu-{c.cache_key}-{nm}", obj, c.object_kind, f"k_{nm}"))
    try:
        from morok_py.backends.cuda import compile_only_pairs
        for r, c in compile_only_pairs("sm_90"):
            if c.available() is None:
                out.append((f"cubin-{c.cache_key}", c.compile(r.render(K.named("softmax"), "softmax")).bytes,
                            c.object_kind, "k_softmax"))
    except ImportError:
        pass
    try:
        from morok_py.backends.rocm import compile_only_pairs as rocm_pairs
        from morok_py.backends.rocm.compiler import find_lld
        find_lld()
        r, c = rocm_pairs("gfx942")[0]
        out.append(("hsaco-llvm-amdgpu", c.compile(r.render(K.named("add"), "add")).bytes, c.object_kind, "k_add"))
    except Exception:
        pass
    return out


_OBJECTS = None


def objects() -> list:
    global _OBJECTS
    if _OBJECTS is None:
        _OBJECTS = _objects()
    return _OBJECTS


def test_every_compiler_output_passes_its_check_and_fails_anothers():
    objs = objects()
    assert sum(label.startswith("cpu-") for label, *_ in objs) >= 3
    for label, data, kind, symbol in objs:
        elf.check_object(data, kind, symbol)
        with pytest.raises(elf.ElfError, match="no symbol"):
            elf.check_object(data, kind, symbol + "_x")
        for other in (elf.ObjectKind(elf.EM_CUDA, (elf.ET_EXEC,)), elf.ObjectKind(elf.EM_X86_64, (elf.ET_REL,)),
                      elf.ObjectKind(elf.EM_AMDGPU, (elf.ET_DYN,))):
            if (other.machine, other.types) != (kind.machine, kind.types):
                with pytest.raises(elf.ElfError, match="ELF (type|machine)"):
                    elf.check_object(data, other, symbol)
        for cut in (0, 3, 63, 64, len(data) // 2, len(data) - 1):
            with pytest.raises(elf.ElfError):
                elf.check_object(data[:cut], kind, symbol)


def test_text_entries_must_decode_and_name_the_kernel():
    assert elf.check_text(b".entry k_add(", "k_add") == ".entry k_add("
    for bad in (b"\xff\xfe", b".entry k_mul(", b"k_add\0"):
        with pytest.raises(elf.ElfError):
            elf.check_text(bad, "k_add")


def test_a_compiler_output_that_fails_its_check_is_not_stored(cpu, cache_dir, rng, monkeypatch):
    """A checker that refuses real output (a toolchain it does not know) costs the cache, said once,
    never a wrong result or an endless recompile without a word."""
    def refuse(*args):
        raise elf.ElfError("a layout this check does not know")
    monkeypatch.setattr(cache, "check_output", refuse)
    tag = fresh_tag()
    compiles, warned = _compiled_fresh(cpu, tag, rng)
    assert compiles == 1 and len(warned) == 1 and "not stored" in warned[0], warned
    skey, _ = keys_of(cpu.dev, "llvm", kernel(tag))
    assert not entry_files(cache_dir, skey)[1].exists()


# ---- several processes, one cache -----------------------------------------------------------------

def _assert_every_entry_is_valid(root: Path, dev, compiler: str) -> int:
    """Every entry in the folder reads back and passes its checks; the number of entries."""
    _, comp = dev.pair(compiler)
    dc = DiskCache(root)
    count = 0
    for meta_path in root.glob("??/*.json"):
        key = meta_path.stem
        hit = dc.get(key)
        assert hit is not None, meta_path
        data, meta = hit
        if meta["kind"] == "ast":
            entry = json.loads(data)
            assert set(entry) == cache.AST_ENTRY_FIELDS and dc.get(entry["source_key"]) is not None
        elif meta["kind"] in ("bytes", "src"):
            cache.check_output(comp, meta["name"], meta["kind"], data)
        count += 1
    assert not list(root.glob("??/.tmp-*")), "a writer left a temp file"
    return count


def several_processes_fill_one_cache(dev, compiler: str, cache_dir: Path, tmp_path: Path, procs: int = 4) -> None:
    """`procs` processes started at one moment each compile a shared kernel and one of their own, then
    all results are right, every entry is valid, and a later process hits them all."""
    shared = fresh_tag()
    own = [fresh_tag() for _ in range(procs)]
    go = tmp_path / "go"
    children = []
    for i in range(procs):
        ks = [{"tag": shared, "seed": i}, {"tag": own[i], "seed": i}, {"tag": shared, "name": "shared_named"}]
        args, env = child_args(cache_dir, ks, dev.name, compiler, go)
        children.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    time.sleep(0.5)
    go.write_text("go")
    outs = [c.communicate(timeout=300) for c in children]
    for c, (out, err) in zip(children, outs):
        assert c.returncode == 0, err[-4000:]
        got = json.loads(out.strip().splitlines()[-1])
        assert all(k["ok"] is True for k in got["kernels"]) and got["warnings"] == [], got
    # per kernel: an AST-level and a source-level entry, for the shared, the named and each own kernel
    assert _assert_every_entry_is_valid(cache_dir, dev, compiler) == 2 * (2 + procs)
    again = run_child(cache_dir, [{"tag": t} for t in [shared, *own]] + [{"tag": shared, "name": "shared_named"}],
                      dev.name, compiler)
    assert all(k["ok"] is True and k["compiles"] == 0 and k["corrupt"] == 0 for k in again["kernels"]), again


def test_several_processes_compile_into_one_cache_at_once_cpu(cpu, cache_dir, tmp_path):
    several_processes_fill_one_cache(cpu.dev, "llvm", cache_dir, tmp_path)


CUDA_PAIRS = ["nvrtc", "llvm-nvptx"]


@pytest.mark.cuda
@pytest.mark.parametrize("compiler", CUDA_PAIRS)
def test_several_processes_compile_into_one_cache_at_once_cuda(compiler, cache_dir, tmp_path):
    from conftest import open_target
    target = open_target("CUDA", compiler)
    several_processes_fill_one_cache(target.dev, compiler, cache_dir, tmp_path)


CUBIN_DAMAGE = {
    "other bytes": OBJECT_DAMAGE["other bytes"],
    "another kernel's CUBIN": OBJECT_DAMAGE["another kernel's object"],
    "section offsets past the end": OBJECT_DAMAGE["section offsets past the end"],
    "code section made NOBITS": OBJECT_DAMAGE["code section made NOBITS"],
    "a host object instead": lambda data, other, name: _host_object(name),
    "truncated": OBJECT_DAMAGE["truncated"],
}


def _host_object(name: str) -> bytes:
    """A CPU object of a kernel by the same name (so the same symbol): a valid ELF of the wrong machine."""
    from morok_py import Device
    r, c = Device["CPU"].pair("llvm")
    return c.compile(r.render(kernel(1.25), name)).bytes


@pytest.mark.cuda
@pytest.mark.parametrize("how", list(CUBIN_DAMAGE))
@pytest.mark.parametrize("compiler", CUDA_PAIRS)
def test_a_damaged_cubin_is_recompiled_and_healed_for_the_next_process(compiler, how, cache_dir):
    from conftest import open_target
    target = open_target("CUDA", compiler)
    first, second = _heals(target.dev, compiler, cache_dir,
                           damage_object(target.dev, compiler, cache_dir, CUBIN_DAMAGE[how]))
    k1, k2 = first["kernels"][0], second["kernels"][0]
    assert (k1["ok"], k1["compiles"], k1["corrupt"]) == (True, 1, 1), first
    assert (k2["ok"], k2["compiles"], k2["corrupt"], k2["ast_hits"]) == (True, 0, 0, 1), second


@pytest.mark.parametrize("how", list(CUBIN_DAMAGE))
@pytest.mark.parametrize("key", CUDA_PAIRS)
def test_each_cubin_damage_is_refused_by_the_check_without_a_gpu(key, how):
    """What the GPU test above damages, refused here already (compile-only: the cuda extra, no GPU)."""
    from conftest import cuda_compile_pair
    r, c = cuda_compile_pair(key)
    name = "trust_cubin"
    good = c.compile(r.render(kernel(1.5), name)).bytes
    other = c.compile(r.render(kernel(0.75), "trust_other")).bytes
    cache.check_output(c, name, "bytes", good)
    with pytest.raises(elf.ElfError):
        cache.check_output(c, name, "bytes", CUBIN_DAMAGE[how](good, other, name))


def test_a_remembered_paths_file_replaced_by_a_folder_is_replaced(cache_dir):
    cache_dir.mkdir(parents=True)
    memo = cache_dir / f"paths-{cache.environment_fingerprint()[:32]}.json"
    memo.mkdir()
    calls = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert cache.remembered_path("tool", lambda: calls.append(1) or sys.executable) == sys.executable
    assert len(calls) == 1 and memo.is_file()
    assert len([w for w in caught if ours(w)]) == 1


def test_an_ast_entry_naming_the_bytes_of_another_schedule_is_not_believed(cpu, cache_dir):
    """One kernel, one name, two schedules (a search's candidates): the AST-level entry of one that
    names the other's bytes is refused, since launch facts and bytes must come from one lowering."""
    from morok_py import kernels as K
    from morok_py.codegen.scan import scan_kernel
    from morok_py.codegen.schedule import candidate_schedules
    from morok_py.codegen.symbolic import simplify
    renderer, compiler = cpu.pair()
    ast = K.matmul(37, 53, 29)
    cands = candidate_schedules(simplify(ast), renderer.caps, scan_kernel(simplify(ast)))
    assert len(cands) >= 2
    first, second = (cache.compile_ast(renderer, compiler, ast, "two_schedules", s) for s in cands[:2])
    assert first.bytes != second.bytes
    nm = kernel_name(ast, "two_schedules")
    akey = cache.ast_key(renderer, compiler, ast, nm, cands[0])
    bin_path, meta_path = entry_files(cache_dir, akey)
    entry = json.loads(bin_path.read_bytes())
    other = json.loads(entry_files(cache_dir, cache.ast_key(renderer, compiler, ast, nm, cands[1]))[0].read_bytes())
    entry["source_key"] = other["source_key"]
    store_with_checksum(bin_path, meta_path, json.dumps(entry).encode())
    corrupt = stats.disk_corrupt
    again = cache.compile_ast(renderer, compiler, ast, "two_schedules", cands[0])
    assert again.bytes == first.bytes and stats.disk_corrupt == corrupt + 1
    assert json.loads(bin_path.read_bytes())["source_key"] != other["source_key"]      # rewritten
