"""Fuzzing what the disk cache reads back (hypothesis, bounded in time). Entries are mutated byte by
byte (with and without their checksum fixed up) and structurally (truncated, ELF header, section
table and symbol table bytes flipped, swapped between kernels, JSON fields emptied, replaced by a
folder); every run must give the result a cold compile gives, or recompile, and no file may crash
the interpreter: the pure checks run in this process, loading and launching in child processes
whose exit code must be 0. MOROK_FUZZ_EXAMPLES=N runs N random examples instead of the fixed ones."""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is a dev dependency (pip install -e .[dev])")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from morok_py import Device, elf  # noqa: E402
from morok_py import cache  # noqa: E402
from morok_py.device import kernel_name  # noqa: E402

from test_cache_trust import entry_files, kernel, keys_of, objects, run_child  # noqa: E402

_EXAMPLES = int(os.environ.get("MOROK_FUZZ_EXAMPLES", "0"))


def fuzz_settings(examples: int):
    """Fixed examples in CI (derandomized: the same cases every run); MOROK_FUZZ_EXAMPLES asks for more,
    random ones."""
    return settings(max_examples=_EXAMPLES or examples, deadline=None, derandomize=not _EXAMPLES,
                    suppress_health_check=list(HealthCheck), database=None)


def regions(data: bytes) -> dict[str, tuple[int, int]]:
    """Byte ranges of an object's structure: header, section table, symbol table, relocations."""
    secs = elf.sections(data)
    shoff, = struct.unpack_from("<Q", data, 0x28)
    out = {"header": (0, 64), "sections": (shoff, shoff + 64 * len(secs)), "anywhere": (0, len(data))}
    for s in secs:
        if s.type in (elf.SHT_SYMTAB, elf.SHT_DYNSYM) and s.size:
            out["symtab"] = (s.offset, s.offset + s.size)
        elif s.type == elf.SHT_RELA and s.size:
            out["relocations"] = (s.offset, s.offset + s.size)
    return out


@st.composite
def mutated(draw, data: bytes) -> bytes:
    """A damaged copy of an object: flipped bytes in one of its structures, a field set to an edge
    value, a truncation, or bytes spliced in or out."""
    how = draw(st.sampled_from(["flip", "flip", "field", "truncate", "splice"]))
    out = bytearray(data)
    if how == "flip":
        lo, hi = regions(data)[draw(st.sampled_from(sorted(regions(data))))]
        for _ in range(draw(st.integers(1, 3))):
            out[draw(st.integers(lo, hi - 1))] ^= draw(st.integers(1, 255))
    elif how == "field":
        lo, hi = regions(data)[draw(st.sampled_from(["header", "sections", "symtab"]))]
        width = draw(st.sampled_from([1, 2, 4, 8]))
        at = draw(st.integers(lo, max(lo, hi - width)))
        value = draw(st.sampled_from([0, 1, 0x40, 0xFF, len(data), len(data) + 1, (1 << (8 * width)) - 1]))
        out[at:at + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
    elif how == "truncate":
        del out[draw(st.integers(0, len(data) - 1)):]
    else:
        at = draw(st.integers(0, len(data)))
        if draw(st.booleans()):
            del out[at:at + draw(st.integers(1, 64))]
        else:
            out[at:at] = bytes(draw(st.integers(1, 64)))
    return bytes(out)


# ---- in this process: the checks never fail in any way but ElfError / ValueError ---------------------

@fuzz_settings(300)
@given(st.data())
def test_the_object_check_refuses_with_an_elf_error_or_accepts(data):
    label, obj, kind, symbol = data.draw(st.sampled_from(objects()), label="object")
    bad = data.draw(mutated(obj), label="mutation")
    try:
        elf.check_object(bad, kind, symbol)
    except elf.ElfError:
        pass


def _ast_entry_values():
    return st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=70),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner,
                                                                                     max_size=3), max_leaves=6)


@fuzz_settings(100)
@given(st.data())
def test_an_ast_entry_is_read_back_only_when_it_is_exactly_this_kernels(data):
    ast = kernel(1.75)
    name = kernel_name(ast, None)
    good = json.loads(cache._ast_entry(ast, name, "ab" * 32))
    entry = dict(good)
    for field in data.draw(st.lists(st.sampled_from([*sorted(good), "launch", "extra"]), max_size=3), label="fields"):
        entry[field] = data.draw(_ast_entry_values(), label=field)
    raw = json.dumps(entry).encode()
    if data.draw(st.booleans(), label="flip a byte"):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw = raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255))]) + raw[at + 1:]
    try:
        key = cache._source_key_of(raw, ast, name)
    except (ValueError, RecursionError):
        return
    # read back means: exactly this kernel's entry. Only the source key may differ (a flipped hex digit is
    # another valid key; the source-level entry it names is checked against this kernel on its own)
    back = json.loads(raw)
    assert {k: v for k, v in back.items() if k != "source_key"} == {k: v for k, v in good.items() if k != "source_key"}
    assert key == back["source_key"] and set(back) == set(good)


# ---- in child processes: damaged entries, then two runs ----------------------------------------------

KERNELS = 8
OPS = ["flip", "flip fixed", "truncate fixed", "garbage fixed", "swap bytes fixed", "swap entry", "empty field",
       "directory", "delete"]
FIELDS = ["key", "name", "kind", "compiler", "arch", "sha256", "size", "format", "ast", "source_key"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A cache a cold process filled with KERNELS kernels: (folder, tags, [(source key, AST key)])."""
    root = tmp_path_factory.mktemp("pristine")
    tags = [0.55 + 0.17 * i for i in range(KERNELS)]
    got = run_child(root, [{"tag": t} for t in tags])
    assert all(k["ok"] is True for k in got["kernels"]), got
    dev = Device["CPU"]
    return root, tags, [keys_of(dev, "llvm", kernel(t)) for t in tags]


def _fix_checksum(bin_path: Path, meta_path: Path) -> None:
    data = bin_path.read_bytes()
    meta = json.loads(meta_path.read_text())
    meta.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    meta_path.write_text(json.dumps(meta))


def damage(root: Path, keys: tuple[str, str], other: tuple[str, str], m: dict) -> None:
    """Apply one drawn mutation `m` to one kernel's entries (`other`: a different kernel's keys)."""
    level = 0 if m["level"] == "source" else 1
    bin_path, meta_path = entry_files(root, keys[level])
    obin, ometa = entry_files(root, other[level])
    target = bin_path if m["file"] == "bin" else meta_path
    op = m["op"]
    if not bin_path.exists() or not meta_path.exists():
        return
    data = bin_path.read_bytes()
    if op == "flip":                        # the checksum sees it
        raw = bytearray(target.read_bytes())
        raw[m["pos"] % len(raw)] ^= m["xor"]
        target.write_bytes(bytes(raw))
    elif op == "flip fixed":                # the checksum does not
        raw = bytearray(data)
        lo, hi = regions(data)[m["region"]] if level == 0 else (0, len(data))
        for k in range(m["count"]):
            raw[lo + (m["pos"] + 7919 * k) % (hi - lo)] ^= m["xor"]
        bin_path.write_bytes(bytes(raw))
        _fix_checksum(bin_path, meta_path)
    elif op == "truncate fixed":
        bin_path.write_bytes(data[:m["pos"] % len(data)])
        _fix_checksum(bin_path, meta_path)
    elif op == "garbage fixed":
        bin_path.write_bytes(hashlib.sha256(str(m["pos"]).encode()).digest() * (len(data) // 32 + 1))
        _fix_checksum(bin_path, meta_path)
    elif op == "swap bytes fixed":
        bin_path.write_bytes(obin.read_bytes())
        _fix_checksum(bin_path, meta_path)
    elif op == "swap entry":
        shutil.copyfile(obin, bin_path)
        shutil.copyfile(ometa, meta_path)
    elif op == "empty field":
        if m["file"] == "json" or level == 0:
            meta = json.loads(meta_path.read_text())
            meta[m["field"]] = m["value"]
            meta_path.write_text(json.dumps(meta))
        else:
            entry = json.loads(data)
            entry[m["field"]] = m["value"]
            bin_path.write_bytes(json.dumps(entry).encode())
            _fix_checksum(bin_path, meta_path)
    elif op == "directory":
        target.unlink()
        target.mkdir()
        (target / "inside").write_bytes(b"x")
    elif op == "delete":
        target.unlink()


MUTATION = st.fixed_dictionaries({
    "level": st.sampled_from(["source", "source", "ast"]), "file": st.sampled_from(["bin", "bin", "json"]),
    "op": st.sampled_from(OPS), "region": st.sampled_from(["header", "sections", "symtab"]),
    "pos": st.integers(0, 1 << 30), "xor": st.integers(1, 255), "count": st.integers(1, 3),
    "field": st.sampled_from(FIELDS), "value": st.sampled_from(["", [], {}, None, 0, -1]),
})


@fuzz_settings(4)
@given(st.lists(MUTATION, min_size=KERNELS, max_size=KERNELS))
def test_damaged_entries_give_the_cold_result_and_heal(pristine, mutations):
    """Each of KERNELS kernels gets one mutation; a first process runs them all (right results, no
    crash, at most one warning), a second process finds every entry healed (no compile, nothing corrupt)."""
    root, tags, keys = pristine
    work = Path(tempfile.mkdtemp(prefix="morok-fuzz-"))
    try:
        cache_dir = work / "cache"
        shutil.copytree(root, cache_dir)
        for j, m in enumerate(mutations):
            damage(cache_dir, keys[j], keys[(j + 1) % KERNELS], m)
        first = run_child(cache_dir, [{"tag": t} for t in tags])
        assert all(k["ok"] is True for k in first["kernels"]), (mutations, first)
        assert len(first["warnings"]) <= 1, first["warnings"]
        second = run_child(cache_dir, [{"tag": t} for t in tags])
        assert all(k["ok"] is True and k["compiles"] == 0 and k["corrupt"] == 0 for k in second["kernels"]), \
            (mutations, second)
        assert second["warnings"] == [], second["warnings"]
    finally:
        shutil.rmtree(work, ignore_errors=True)


FLIPS_CHILD = inspect.getsource(kernel) + r'''
import hashlib, json, sys
from pathlib import Path
import numpy as np
from morok_py import Buffer, Device, MorokError, cache
from morok_py.cache import stats

tag, bin_path, meta_path, files = float(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
dev = Device["CPU"]
x = np.random.default_rng(3).standard_normal(37).astype(np.float32)
want = np.exp(x * np.float32(tag))
for f in files:
    data = Path(f).read_bytes()
    bin_path.write_bytes(data)
    meta = json.loads(meta_path.read_text())
    meta.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    meta_path.write_text(json.dumps(meta))
    print("object", f, file=sys.stderr, flush=True)     # the last one named is the one that crashed
    cache.clear_memory_caches()
    before = stats.compiles
    prog = dev.compile(kernel(tag))
    out = dev.buffer(37, "float32")
    try:
        prog(Buffer.from_numpy(x, dev), out, n=37)
        ok = bool(np.allclose(out.numpy(), want, rtol=3e-5, atol=1e-6))
    except MorokError as e:
        ok = f"{type(e).__name__}: {e}"
    print(json.dumps({"object": f, "ok": ok, "recompiled": stats.compiles - before}), flush=True)
'''

FLIPS = st.lists(st.tuples(st.sampled_from(["header", "sections", "symtab"]),
                           st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), min_size=1, max_size=3)),
                 min_size=30, max_size=30)


@fuzz_settings(2)
@given(FLIPS)
def test_structural_flips_never_crash_and_never_change_a_result(pristine, flips):
    """30 objects, each with 1-3 bytes of its ELF header, section table or symbol table flipped and its
    checksum fixed, loaded in turn by one child process: each run is refused and recompiled, or runs
    as the object it came from; none crashes the child."""
    root, tags, keys = pristine
    work = Path(tempfile.mkdtemp(prefix="morok-fuzz-"))
    try:
        cache_dir = work / "cache"
        shutil.copytree(root, cache_dir)
        bin_path, meta_path = entry_files(cache_dir, keys[0][0])
        good = bin_path.read_bytes()
        spans = regions(good)
        files = []
        for k, (region, hits) in enumerate(flips):
            lo, hi = spans[region]
            bad = bytearray(good)
            for pos, xor in hits:
                bad[lo + pos % (hi - lo)] ^= xor
            files.append(work / f"object{k:02d}.o")
            files[-1].write_bytes(bytes(bad))
        env = dict(os.environ, MOROK_CACHE_DIR=str(cache_dir))
        res = subprocess.run([sys.executable, "-c", FLIPS_CHILD, str(tags[0]), str(bin_path), str(meta_path),
                              *map(str, files)], env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, f"the child exited with {res.returncode}:\n{res.stderr[-2000:]}"
        runs = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
        assert len(runs) == len(files) and all(r["ok"] is True for r in runs), [r for r in runs if r["ok"] is not True]
    finally:
        shutil.rmtree(work, ignore_errors=True)
