"""Both cache levels: the in-memory method cache and the disk cache of compiled bytes."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from morok_py import UOp, dtypes
from morok_py import cache
from morok_py.cache import DiskCache, disk_key, stats

from conftest import ROOT


def unique_kernel(tag: float | None = None) -> UOp:
    """out[i] = x[i] * c with a constant no other test uses, so no cache has seen it."""
    c = tag if tag is not None else float(uuid.uuid4().int % 10**9) + 0.5
    x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)
    i = UOp.range(UOp.variable("n", 1, 1 << 20), 0)
    return UOp.sink(out.store(i, x.load(i) * c))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("MOROK_CACHE_DIR", str(d))
    monkeypatch.delenv("MOROK_CACHE", raising=False)
    return d


def entry_paths(cpu, ast, name=None) -> tuple[Path, Path, str]:
    renderer, compiler = cpu.pair()
    key = disk_key(compiler, renderer.render(ast, name))
    root = Path(os.environ["MOROK_CACHE_DIR"])
    return root / key[:2] / f"{key}.bin", root / key[:2] / f"{key}.json", key


def run_times_two(cpu, prog, rng):
    x = rng.standard_normal(7).astype(np.float32)
    out = cpu.empty(7, dtypes.float32)
    prog(cpu.buf(x), out, n=7)
    return x, out.numpy()


def test_second_compile_is_a_method_cache_hit(cpu, cache_dir):
    ast = unique_kernel()
    before = (stats.compiles, stats.method_hits)
    p1 = cpu.compile(ast)
    p2 = cpu.compile(ast)
    assert p2 is p1
    assert (stats.compiles - before[0], stats.method_hits - before[1]) == (1, 1)


def test_different_kernel_names_are_different_entries(cpu, cache_dir):
    ast = unique_kernel()
    assert cpu.compile(ast, "first") is not cpu.compile(ast, "second")


def test_memory_cleared_compile_hits_the_disk_cache(cpu, cache_dir, rng):
    ast = unique_kernel(3.25)
    cpu.compile(ast)
    cache.clear_memory_caches()
    before = (stats.compiles, stats.disk_hits)
    prog = cpu.compile(ast)
    assert (stats.compiles - before[0], stats.disk_hits - before[1]) == (0, 1)
    x, got = run_times_two(cpu, prog, rng)
    np.testing.assert_allclose(got, x * np.float32(3.25))


def test_a_second_process_hits_the_disk_cache(cpu, cache_dir):
    tag = 17.5 + (uuid.uuid4().int % 1000)
    cpu.compile(unique_kernel(tag))
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import numpy as np\n"
        "from morok_py import Device, Buffer, UOp, dtypes\n"
        "from morok_py.cache import stats\n"
        "x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)\n"
        "i = UOp.range(UOp.variable('n', 1, 1 << 20), 0)\n"
        "ast = UOp.sink(out.store(i, x.load(i) * float(sys.argv[2])))\n"
        "dev = Device['CPU']\n"
        "prog = dev.compile(ast)\n"
        "out = dev.buffer(3, dtypes.float32)\n"
        "prog(Buffer.from_numpy(np.array([1, 2, 3], np.float32), dev), out, n=3)\n"
        "print(stats.compiles, stats.disk_hits, *out.numpy())\n")
    res = subprocess.run([sys.executable, "-c", code, str(ROOT), repr(tag)], capture_output=True, text=True,
                         env=dict(os.environ), check=True)
    compiles, disk_hits, *vals = res.stdout.split()
    assert (int(compiles), int(disk_hits)) == (0, 1)
    np.testing.assert_allclose([float(v) for v in vals], np.array([1, 2, 3], np.float32) * np.float32(tag))


def test_disk_entry_is_raw_bytes_plus_json_not_pickle(cpu, cache_dir):
    ast = unique_kernel()
    cpu.compile(ast)
    bin_path, meta_path, key = entry_paths(cpu, ast)
    renderer, compiler = cpu.pair()
    assert bin_path.read_bytes() == compiler.compile(renderer.render(ast)).bytes   # deterministic object bytes
    meta = json.loads(meta_path.read_text())
    assert meta["key"] == key and meta["size"] == bin_path.stat().st_size and meta["compiler"] == "llvm"
    assert {p.suffix for p in bin_path.parent.iterdir()} == {".bin", ".json"}


def test_cache_dir_is_private(cpu, cache_dir):
    cpu.compile(unique_kernel())
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700


def test_disk_key_is_deterministic_and_depends_on_source(cpu):
    renderer, compiler = cpu.pair()
    a, b = unique_kernel(1.5), unique_kernel(2.5)
    assert disk_key(compiler, renderer.render(a)) == disk_key(compiler, renderer.render(a))
    assert disk_key(compiler, renderer.render(a)) != disk_key(compiler, renderer.render(b))


def test_disk_key_includes_toolchain_version(cpu):
    import llvmlite
    _, compiler = cpu.pair()
    assert llvmlite.__version__ in compiler.identity()


@pytest.mark.parametrize("damage", ["flip a byte of .bin", "garbage .json", "truncate .bin"])
def test_corrupt_entry_is_recompiled_and_rewritten(cpu, cache_dir, rng, damage):
    tag = 100.5 + (uuid.uuid4().int % 1000)
    ast = unique_kernel(tag)
    cpu.compile(ast)
    bin_path, meta_path, key = entry_paths(cpu, ast)
    good = bin_path.read_bytes()
    if damage.startswith("flip"):
        data = bytearray(good)
        data[len(data) // 2] ^= 0xFF
        bin_path.write_bytes(bytes(data))
    elif damage.startswith("garbage"):
        meta_path.write_text("{not json")
    else:
        bin_path.write_bytes(good[:100])
    cache.clear_memory_caches()
    before = (stats.compiles, stats.disk_corrupt, stats.disk_hits)
    prog = cpu.compile(ast)
    assert (stats.compiles - before[0], stats.disk_corrupt - before[1], stats.disk_hits - before[2]) == (1, 1, 0)
    assert bin_path.read_bytes() == good                    # rewritten
    assert DiskCache().get(key) is not None                 # and valid again
    x, got = run_times_two(cpu, prog, rng)
    np.testing.assert_allclose(got, x * np.float32(tag))


def test_morok_cache_0_writes_nothing(cpu, cache_dir, monkeypatch):
    monkeypatch.setenv("MOROK_CACHE", "0")
    ast = unique_kernel()
    cpu.compile(ast)
    cache.clear_memory_caches()
    before = stats.compiles
    cpu.compile(ast)
    assert stats.compiles - before == 1        # no disk hit either
    assert not cache_dir.exists() or not any(cache_dir.rglob("*"))


def test_unwritable_cache_dir_still_compiles(cpu, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MOROK_CACHE_DIR", str(blocker / "cache"))
    assert cpu.compile(unique_kernel()) is not None


def test_disk_cache_rejects_non_digest_keys(tmp_path):
    with pytest.raises(ValueError, match="sha256"):
        DiskCache(tmp_path).get("../../etc/passwd")


def test_a_recreated_device_gets_its_own_programs(clean_registry, rng):
    from morok_py import Device, register_backend
    from morok_py.backends.cpu.device import CPUDevice
    register_backend("RECREATED", CPUDevice)
    old = Device["RECREATED"]
    ast = unique_kernel(5.5)
    assert old.compile(ast).device is old
    register_backend("RECREATED", CPUDevice)       # replaces the backend and drops the opened device
    new = Device["RECREATED"]
    assert new is not old
    prog = new.compile(ast)
    assert prog.device is new
    x = rng.standard_normal(7).astype(np.float32)
    out = new.buffer(7, dtypes.float32)
    prog(new.buffer(7, dtypes.float32).copyin(x), out, n=7)
    np.testing.assert_allclose(out.numpy(), x * np.float32(5.5))
