"""The two caches.

Method cache (memory): (base device type, compiler cache_key, arch, ast key, name) -> CompiledSpec,
shared by every ordinal of a device type; loaded Programs stay per device instance.

Disk cache: sha256(package version, compiler identity, arch, options, rendered source) -> raw
bytes plus JSON metadata with the bytes' sha256. Never pickle. Writes are atomic; a corrupt entry
is reported as a miss, removed, and rewritten by the caller.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from . import config
from .errors import MorokError

if TYPE_CHECKING:
    from .device import CompiledSpec, Compiler, Device, Program, ProgramSpec, Renderer
    from .ir import UOp

__version__ = "0.1.0"


@dataclass
class CacheStats:
    compiles: int = 0            # real compiler invocations
    method_hits: int = 0
    disk_hits: int = 0
    disk_corrupt: int = 0
    loads: int = 0
    compile_seconds: float = 0.0
    by_key: dict = field(default_factory=dict)

    def reset(self) -> None:
        self.__init__()


stats = CacheStats()
_lock = threading.RLock()
_method_cache: dict[tuple, "CompiledSpec"] = {}
_programs: dict[tuple, "Program"] = {}
_key_locks: dict[tuple, threading.Lock] = {}


def cache_dir() -> Path:
    d = config.getenv("MOROK_CACHE_DIR")
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "morok_py"


class DiskCache:
    """Compiled bytes on disk, keyed by a sha256 the caller computes."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else cache_dir()

    @staticmethod
    def key(*parts: str) -> str:
        h = hashlib.sha256()
        for p in parts:
            h.update(p.encode("utf-8", "surrogatepass"))
            h.update(b"\0")
        return h.hexdigest()

    def _paths(self, key: str) -> tuple[Path, Path]:
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(f"disk cache key must be a sha256 hex digest, got {key!r}")
        d = self.root / key[:2]
        return d / f"{key}.bin", d / f"{key}.json"

    def get(self, key: str) -> tuple[bytes, dict] | None:
        bin_path, meta_path = self._paths(key)
        try:
            raw_meta = meta_path.read_bytes()
            data = bin_path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError:
            return None
        try:
            meta = json.loads(raw_meta)
            ok = (isinstance(meta, dict) and meta.get("key") == key
                  and meta.get("sha256") == hashlib.sha256(data).hexdigest() and meta.get("size") == len(data))
        except (ValueError, UnicodeDecodeError):
            ok = False
        if not ok:
            with _lock:
                stats.disk_corrupt += 1
            for p in (bin_path, meta_path):
                try:
                    p.unlink()
                except OSError:
                    pass
            if config.debug_level() >= 1:
                config.log(f"disk cache entry {key[:12]} is corrupt; recompiling")
            return None
        return data, meta

    def put(self, key: str, data: bytes, meta: dict) -> None:
        bin_path, meta_path = self._paths(key)
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.root, 0o700)
            bin_path.parent.mkdir(exist_ok=True, mode=0o700)
            full = dict(meta, key=key, sha256=hashlib.sha256(data).hexdigest(), size=len(data))
            # bytes first, metadata last: a reader that sees the metadata sees the whole entry
            for path, payload in ((bin_path, data), (meta_path, json.dumps(full, sort_keys=True).encode())):
                fd, tmp = tempfile.mkstemp(dir=bin_path.parent, prefix=".tmp-")
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(payload)
                    os.replace(tmp, path)
                except BaseException:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
                    raise
        except OSError as e:
            if config.debug_level() >= 1:
                config.log(f"disk cache write failed ({e}); continuing without it")


def disk_key(compiler: "Compiler", spec: "ProgramSpec") -> str:
    return DiskCache.key(f"morok_py-{__version__}", compiler.identity(), compiler.arch, spec.name, spec.src)


def compile_spec(compiler: "Compiler", spec: "ProgramSpec") -> "CompiledSpec":
    """Compile through the disk cache (when enabled)."""
    from .device import CompiledSpec
    use_disk = config.cache_enabled()
    if use_disk:
        dc = DiskCache()
        key = disk_key(compiler, spec)
        hit = dc.get(key)
        if hit is not None:
            data, meta = hit
            with _lock:
                stats.disk_hits += 1
            if meta.get("kind") == "src":
                return CompiledSpec.from_source(spec, data.decode(), arch=compiler.arch, compiler=compiler.cache_key)
            return CompiledSpec.from_bytes(spec, data, arch=compiler.arch, compiler=compiler.cache_key)
    t0 = time.perf_counter()
    compiled = compiler.compile(spec)
    dt = time.perf_counter() - t0
    with _lock:
        stats.compiles += 1
        stats.compile_seconds += dt
    if config.debug_level() >= 1:
        config.log(f"compiled {spec.name} with {compiler.cache_key} for {compiler.arch} in {dt * 1e3:.1f} ms")
    if use_disk:
        kind = "bytes" if compiled.bytes is not None else "src"
        dc.put(key, compiled.payload, {"name": spec.name, "compiler": compiler.cache_key, "arch": compiler.arch,
                                       "kind": kind, "identity": compiler.identity()})
    return compiled


def method_key(device: "Device", compiler: "Compiler", ast: "UOp", name: str | None) -> tuple:
    return (device.base_device_key, compiler.cache_key, compiler.arch, ast.key, name)


def compile_through_caches(device: "Device", renderer: "Renderer", compiler: "Compiler", ast: "UOp",
                           name: str | None) -> "Program":
    mkey = method_key(device, compiler, ast, name)
    pkey = (device.name,) + mkey
    prog = _programs.get(pkey)
    # a device re-created under the same name (register_backend, a fresh create_device) must not get
    # programs loaded into the old instance
    if prog is not None and prog.device is device:
        with _lock:
            stats.method_hits += 1
        return prog
    with _lock:
        klock = _key_locks.setdefault(mkey, threading.Lock())
    with klock:   # one compile per key even when threads race
        prog = _programs.get(pkey)
        if prog is not None and prog.device is device:
            return prog
        compiled = _method_cache.get(mkey)
        if compiled is None:
            spec = renderer.render(ast, name)
            if config.debug_level() >= 4 and spec.linear is not None:
                config.log(f"{spec.name} linear IR:\n{spec.linear.dump()}")
            if config.debug_level() >= 2:
                config.log(f"{spec.name} source ({renderer.device}):\n{spec.src}")
            compiled = compile_spec(compiler, spec)
            if config.debug_level() >= 3:
                config.log(f"{spec.name} compiled:\n{_compiled_text(compiler, spec, compiled)}")
            with _lock:
                _method_cache[mkey] = compiled
        else:
            with _lock:
                stats.method_hits += 1
        prog = device.runtime(compiled)
        with _lock:
            stats.loads += 1
            _programs[pkey] = prog
        return prog


def _compiled_text(compiler: "Compiler", spec: "ProgramSpec", compiled: "CompiledSpec") -> str:
    """What MOROK_DEBUG=3 prints: text output as is, binaries as the compiler's disassembly if it has one."""
    if compiled.src is not None:
        return compiled.src
    disassemble = getattr(compiler, "disassemble", None)
    if disassemble is not None:
        try:
            return disassemble(spec)
        except Exception as e:  # debug output must never break a compile
            return f"<{len(compiled.payload)} bytes; disassembly failed: {e}>"
    return f"<{len(compiled.payload)} bytes of {compiled.compiler or 'compiled'} output>"


def clear_memory_caches() -> None:
    with _lock:
        _method_cache.clear()
        _programs.clear()
        _key_locks.clear()
