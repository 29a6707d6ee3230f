"""The two caches.

Method cache (memory): (base device type, compiler cache_key, arch, ast key, name) -> CompiledSpec,
shared by every ordinal of a device type; loaded Programs stay per device instance.

Disk cache, two levels, both entries raw bytes plus JSON metadata with the bytes' sha256 (never pickle;
atomic writes; a corrupt or unreadable entry is a miss, counted, removed and rewritten):
- by AST (looked up first, before any rendering): sha256(package version, the code that renders,
  renderer fingerprint, cheap compiler identity, arch, kernel name, ast key) -> the key of the entry
  below. A hit skips rendering and compiling; what the launch check relies on (accesses, ranges,
  dtypes, launch sizes) is lowered again from the kernel, never read back.
- by source: sha256(package version, cheap compiler identity, arch, kernel name, rendered source) ->
  the compiled bytes. It outlives edits of the code that renders: when they leave a kernel's source
  unchanged, the compile is saved.

A checksum only catches accidents. Compiled bytes read back are checked structurally (morok_py.elf:
the compiler's `object_kind`, the kernel's symbol) before any loader sees them; an entry that fails
is recompiled and rewritten in the same call. A path that is not a usable file (a directory, no
permission) is removed, or else bypassed, with one warning per cache folder.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from . import config, elf
from .codegen.symbols import symbol_for

if TYPE_CHECKING:
    from .codegen.launch_check import LaunchInfo
    from .codegen.schedule import Schedule
    from .search import SearchResult
    from .device import CompiledSpec, Compiler, Device, Program, ProgramSpec, Renderer
    from .ir import UOp

__version__ = "0.1.0"


@dataclass
class CacheStats:
    compiles: int = 0            # real compiler invocations
    method_hits: int = 0
    disk_hits: int = 0
    disk_corrupt: int = 0
    ast_hits: int = 0            # disk hits by AST (no lowering, no rendering); also counted in disk_hits
    renders: int = 0             # Renderer.render calls made by compile_through_caches
    schedule_hits: int = 0       # compiles that used a stored searched schedule (no timing)
    searches: int = 0            # schedule searches run (MOROK_BEAM or search.beam_search)
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


def write_atomically(path: Path, payload: bytes) -> None:
    """Write a file so that a reader sees the old content or the whole new one, never a part: a temp
    file beside it, then os.replace. OSError when it cannot."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
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


_warned_roots: set[str] = set()
MAX_ENTRY_BYTES = 1 << 30


def warn_once(root: Path, what: str) -> None:
    """One RuntimeWarning per cache folder and process: a cache that cannot work as it should is said
    once, never silently recompiled around forever, never an error."""
    with _lock:
        if str(root) in _warned_roots:
            return
        _warned_roots.add(str(root))
    warnings.warn(f"morok_py: disk cache {root}: {what} (further problems with this folder are not reported)",
                  RuntimeWarning, stacklevel=3)


class UnusablePath(OSError):
    """A cache path that exists but is not a regular file this process can read."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path
        self.why = why


def read_file(path: Path) -> bytes | None:
    """The bytes of a regular file; None when nothing is there. UnusablePath for anything else: a
    directory, a link, a pipe, a file this process may not read, a parent that is not a folder. A pipe
    or a link is never opened through (no blocking, no reading outside the cache)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return _parent_problem(path)
    except OSError as e:
        raise UnusablePath(path, e.strerror or type(e).__name__) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnusablePath(path, "not a regular file")
        if st.st_size > MAX_ENTRY_BYTES:
            raise UnusablePath(path, f"{st.st_size} bytes")
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    except UnusablePath:
        raise
    except OSError as e:
        raise UnusablePath(path, e.strerror or type(e).__name__) from None
    finally:
        os.close(fd)


def _parent_problem(path: Path) -> None:
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise UnusablePath(parent, "not a folder")
    return None


def remove_path(path: Path) -> bool:
    """Remove a file, link or folder that sits where a cache file belongs (a link is removed, never
    followed); whether it is gone."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        return True
    except OSError:
        return not os.path.lexists(path)
    return not os.path.lexists(path)


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
        """The entry's bytes and metadata; None when it is missing or unusable (then removed, counted)."""
        bin_path, meta_path = self._paths(key)
        for _ in range(2):      # a mismatch is read again once: a writer may be between its two renames
            try:
                raw_meta = read_file(meta_path)
                data = read_file(bin_path) if raw_meta is not None else None
            except UnusablePath as e:
                self.unusable(e.path, e.why)
                return None
            if raw_meta is None or data is None:
                return None
            try:
                meta = json.loads(raw_meta)
                ok = (isinstance(meta, dict) and meta.get("key") == key and meta.get("size") == len(data)
                      and meta.get("sha256") == hashlib.sha256(data).hexdigest())
            except (ValueError, UnicodeDecodeError, RecursionError):
                ok = False
            if ok:
                return data, meta
        self.discard(key, "its bytes do not match their checksum")
        return None

    def unusable(self, path: Path, why: str) -> None:
        """A path where a cache file belongs that is not one: counted, removed (or else bypassed), and
        said once per cache folder. Nothing outside the cache folder is ever removed."""
        if self.root not in path.parents:
            warn_once(self.root, f"{path} is not usable ({why}); compiling without the disk cache")
            return
        with _lock:
            stats.disk_corrupt += 1
        if remove_path(path):
            warn_once(self.root, f"removed {path}, which was not a usable cache file ({why})")
        else:
            warn_once(self.root, f"{path} is not a usable cache file ({why}) and cannot be removed; "
                                 f"kernels stored there are compiled without the disk cache")

    def discard(self, key: str, why: str) -> None:
        """Count and remove a corrupt or unreadable entry (the caller then recompiles and rewrites it)."""
        with _lock:
            stats.disk_corrupt += 1
        for p in self._paths(key):
            try:
                p.unlink()
            except OSError:
                pass
        if config.debug_level() >= 1:
            config.log(f"disk cache entry {key[:12]} is unusable ({why}); recompiling")

    def put(self, key: str, data: bytes, meta: dict) -> None:
        """Write an entry; a folder that cannot take it is said once (warn_once), never an error."""
        bin_path, meta_path = self._paths(key)
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.root, 0o700)
            shard = bin_path.parent
            if os.path.lexists(shard) and (shard.is_symlink() or not shard.is_dir()):
                remove_path(shard)
            shard.mkdir(exist_ok=True, mode=0o700)
            full = dict(meta, key=key, sha256=hashlib.sha256(data).hexdigest(), size=len(data))
            # bytes first, metadata last: a reader that sees the metadata sees the whole entry
            for path, payload in ((bin_path, data), (meta_path, json.dumps(full, sort_keys=True).encode())):
                if os.path.lexists(path) and (path.is_symlink() or not path.is_file()):
                    remove_path(path)      # a folder or a link in the way: os.replace cannot replace it
                write_atomically(path, payload)
        except OSError as e:
            warn_once(self.root, f"cannot write to it ({e}); compiling without the disk cache")
            if config.debug_level() >= 1:
                config.log(f"disk cache write failed ({e}); continuing without it")


# ---- identities for the keys: cheap, because a hit must not load any toolchain -----------------

DISK_FORMAT = "disk-3"      # bump when the layout of entries changes: old entries are then never looked up


def file_identity(path: str) -> str:
    """A file by resolved path, size and mtime: a stand-in for its content in cache keys that costs one
    stat (hashing a 100 MB compiler library would cost more than the compile it saves)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    return f"{real}:{st.st_size}:{st.st_mtime_ns}"


@functools.lru_cache(maxsize=None)
def llvmlite_identity() -> str:
    """llvmlite's version file and its compiled library (which holds LLVM), by path, size and mtime,
    found without importing llvmlite (its version lookup costs 0.4-0.7 ms) or llvmlite.binding (that
    import loads the library, and initializing its targets costs ~100 ms). Reinstalling llvmlite
    rewrites both files."""
    import importlib.util
    spec = importlib.util.find_spec("llvmlite")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        for lib in ("libllvmlite.so", "libllvmlite.dylib", "llvmlite.dll"):
            path = os.path.join(folder, "binding", lib)
            if os.path.isfile(path):
                try:
                    version = file_identity(os.path.join(folder, "_version.py"))
                except OSError:
                    import llvmlite
                    version = llvmlite.__version__
                return f"llvmlite/{version}/{file_identity(path)}"
    # an unusual layout: ask the library itself (loads it)
    import llvmlite
    from .codegen.llvm_binding import llvm_binding
    return f"llvmlite-{llvmlite.__version__}/llvm-{'.'.join(map(str, llvm_binding().llvm_version_info))}"


def environment_fingerprint() -> str:
    """What decides where a toolchain library is found, cheaply: the interpreter, sys.path, the
    mtimes of the folders packages are installed in (installing, upgrading or removing one changes its
    folder: site-packages, the user site, PYTHONPATH folders), the dynamic loader's cache and the
    search variables. sys.path[0], the script's folder or the working directory, counts by name only:
    its mtime changes whenever a file is saved beside the script."""
    import site
    parts = [sys.executable, sys.prefix, repr(sys.path)]
    folders = list(sys.path[1:])
    try:
        folders += site.getsitepackages()
    except AttributeError:      # an old virtualenv's site module
        pass
    if site.ENABLE_USER_SITE:
        folders.append(site.getusersitepackages())
    for p in [*dict.fromkeys(folders), "/etc/ld.so.cache"]:
        try:
            parts.append(f"{p}:{os.stat(p or '.').st_mtime_ns}")
        except OSError:
            parts.append(f"{p}:-")
    for var in ("LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "CONDA_PREFIX", "ROCM_PATH", "HIP_PATH", "PATH"):
        parts.append(f"{var}={os.environ.get(var, '')}")
    return DiskCache.key(*parts)


def remembered_path(what: str, find: Callable[[], str]) -> str:
    """`find()` once per environment: finding a toolchain library can cost 50-150 ms (importing the
    package that searches for it, or loading it), more than a whole disk-cache hit may take. The
    answers are kept in one small JSON file per `environment_fingerprint()` in the cache folder
    ({what: path}; anything else in it, or a path that is no longer a file, means finding again) and
    written atomically. The caller still identifies the file itself (`file_identity`), so a library
    replaced in place changes the key."""
    if not config.cache_enabled():
        return find()
    root = cache_dir()
    memo = root / f"paths-{environment_fingerprint()[:32]}.json"
    try:
        known = json.loads(read_file(memo) or b"{}")
    except UnusablePath as e:
        DiskCache(root).unusable(e.path, e.why)
        known = {}
    except (ValueError, RecursionError):
        known = {}
    if not isinstance(known, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in known.items()):
        known = {}
    path = known.get(what)
    if path and os.path.isfile(path):
        return path
    path = find()
    known[what] = path
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomically(memo, json.dumps(known).encode("utf-8", "surrogateescape"))
    except OSError as e:
        warn_once(root, f"cannot write to it ({e}); compiling without the disk cache")
        if config.debug_level() >= 1:
            config.log(f"could not remember where {what} is ({e}); continuing without it")
    return path


def compiler_identity(compiler: "Compiler") -> str:
    """What keys a compiler's output: `cache_identity()` where the compiler has one (cheap: paths and
    stats of its libraries), else `identity()` (which may load the toolchain to read its version)."""
    cheap = getattr(compiler, "cache_identity", None)
    return cheap() if cheap is not None else compiler.identity()


_code_fingerprints: dict[tuple, str] = {}


def code_fingerprint(renderer: "Renderer", compiler: "Compiler") -> str:
    """Path, size and mtime of every module file in morok_py, morok_py/codegen and the folders that
    define the renderer's and compiler's classes. The AST-level key needs it: an edit of lowering or
    of a printer changes what an AST compiles to, and the package version does not change with it."""
    from .device import Compiler, Renderer
    classes = (type(renderer), type(compiler))
    hit = _code_fingerprints.get(classes)
    if hit is not None:
        return hit
    here = os.path.dirname(os.path.abspath(__file__))
    folders = {here, os.path.join(here, "codegen"), os.path.join(here, "codegen", "strategies")}
    for cls in classes:
        for k in cls.__mro__:
            if issubclass(k, (Renderer, Compiler)):
                f = getattr(sys.modules.get(k.__module__), "__file__", None)
                if f:
                    folders.add(os.path.dirname(os.path.abspath(f)))
    h = hashlib.sha256()
    for folder in sorted(folders):
        try:
            entries = sorted((e for e in os.scandir(folder) if e.name.endswith(".py")), key=lambda e: e.name)
            for e in entries:
                st = e.stat()
                h.update(f"{e.path}\0{st.st_size}\0{st.st_mtime_ns}\0".encode("utf-8", "surrogatepass"))
        except OSError as err:
            h.update(f"{folder}\0{err}\0".encode("utf-8", "surrogatepass"))
    with _lock:
        _code_fingerprints[classes] = hit = h.hexdigest()
    return hit


def renderer_fingerprint(renderer: "Renderer") -> str | None:
    """The renderer's class, capabilities (every field) and other settings (triple, arch, ...): all
    that changes its output besides the code. None when a setting has no stable text (a repr with an
    address): such a renderer gets no AST-level entries, only source-level ones."""
    cls = type(renderer)
    settings = sorted((k, v) for k, v in vars(renderer).items() if k != "device")   # ordinals render alike
    text = f"{cls.__module__}.{cls.__qualname__}|caps={renderer.caps!r}|{settings!r}"
    return None if " at 0x" in text else text


def disk_key(compiler: "Compiler", spec: "ProgramSpec") -> str:
    """The source-level key."""
    return DiskCache.key(f"morok_py-{__version__}", DISK_FORMAT, "source", compiler_identity(compiler),
                         compiler.arch, spec.name, spec.src)


def ast_key(renderer: "Renderer", compiler: "Compiler", ast: "UOp", name: str,
            schedule: "Schedule | None" = None) -> str | None:
    """The AST-level key (None: this renderer cannot have one, see `renderer_fingerprint`). A kernel
    rendered with a schedule other than its default (a searched one) has its own key."""
    fingerprint = renderer_fingerprint(renderer)
    if fingerprint is None:
        return None
    extra = () if schedule is None else ("schedule", schedule.to_json())
    return DiskCache.key(f"morok_py-{__version__}", DISK_FORMAT, "ast", code_fingerprint(renderer, compiler),
                         fingerprint, compiler_identity(compiler), compiler.arch, name, ast.key, *extra)


# ---- searched schedules (morok_py/search.py) -----------------------------------------------------

SCHEDULE_FORMAT = "morok-schedule-1"


def schedule_key(renderer: "Renderer", compiler: "Compiler", ast: "UOp") -> str | None:
    """Where the searched schedule of a kernel lives: its AST (static sizes are part of it; a symbolic
    kernel has one entry, tuned at the sizes its metadata names), the renderer and the target arch.
    Not the code fingerprint: a choice outlives edits; one the lowering no longer accepts is dropped."""
    fingerprint = renderer_fingerprint(renderer)
    if fingerprint is None:
        return None
    return DiskCache.key(f"morok_py-{__version__}", SCHEDULE_FORMAT, fingerprint, compiler.cache_key, compiler.arch,
                         ast.key)


def store_schedule(renderer: "Renderer", compiler: "Compiler", ast: "UOp", schedule: "Schedule",
                   meta: dict) -> None:
    key = schedule_key(renderer, compiler, ast)
    if key is not None and config.cache_enabled():
        DiskCache().put(key, schedule.to_json().encode(), dict(meta, kind="schedule", format=SCHEDULE_FORMAT))


def stored_schedule(renderer: "Renderer", compiler: "Compiler", ast: "UOp") -> "Schedule | None":
    """The searched schedule stored for this kernel, or None. An entry that does not read back as a
    schedule is removed with a warning (never an error): the kernel then gets its default."""
    from .codegen.schedule import Schedule
    key = schedule_key(renderer, compiler, ast) if config.cache_enabled() else None
    if key is None:
        return None
    dc = DiskCache()
    corrupt = stats.disk_corrupt
    hit = dc.get(key)
    if hit is None:
        if stats.disk_corrupt > corrupt:
            warnings.warn("morok_py: ignoring a corrupt stored schedule (checksum mismatch); using the default",
                          RuntimeWarning, stacklevel=3)
        return None
    try:
        if hit[1].get("format") != SCHEDULE_FORMAT:
            raise ValueError(f"format {hit[1].get('format')!r}")
        return Schedule.from_json(hit[0].decode())
    except (ValueError, UnicodeDecodeError) as e:
        warnings.warn(f"morok_py: ignoring a corrupt stored schedule ({e}); using the default", RuntimeWarning,
                      stacklevel=3)
        dc.discard(key, f"not a schedule: {e}")
        return None


# ---- compiling through the disk cache ------------------------------------------------------------

def compile_spec(compiler: "Compiler", spec: "ProgramSpec") -> "CompiledSpec":
    """Compile through the source-level disk cache (when enabled)."""
    return _compile_spec(compiler, spec, config.cache_enabled())[0]


def check_output(compiler: "Compiler", name: str, kind: object, payload: bytes) -> None:
    """ElfError unless `payload` can be what `compiler` emits for kernel `name`: an object of the
    compiler's `object_kind` (class, machine, tables) defining the kernel's symbol, or text ("src")
    that names it. A compiler without an `object_kind` has its bytes taken as they are."""
    symbol = symbol_for(name)
    if kind == "src":
        elf.check_text(payload, symbol)
    elif kind != "bytes":
        raise elf.ElfError(f"unknown output kind {kind!r}")
    else:
        object_kind = getattr(compiler, "object_kind", None)
        if object_kind is not None:
            elf.check_object(payload, object_kind, symbol)


def checked_entry(dc: DiskCache, key: str, compiler: "Compiler", name: str) -> tuple[bytes, dict] | None:
    """A source-level entry's (payload, metadata) when it is there and passes `check_output` for this
    compiler and kernel; an entry that fails is discarded (the caller compiles and rewrites it)."""
    hit = dc.get(key)
    if hit is None:
        return None
    payload, meta = hit
    try:
        if (meta.get("name"), meta.get("compiler"), meta.get("arch")) != (name, compiler.cache_key, compiler.arch):
            raise elf.ElfError(f"the entry is for {meta.get('name')!r} by {meta.get('compiler')!r} "
                               f"for {meta.get('arch')!r}")
        check_output(compiler, name, meta.get("kind"), payload)
    except elf.ElfError as e:
        dc.discard(key, str(e))
        return None
    return payload, meta


def made_from(ast: "UOp", linear: object) -> str:
    """What compiled bytes were made from, as source-level entries record it: the kernel's AST and the
    schedule it was lowered with (two kernels of one name, or two schedules of one kernel, differ)."""
    schedule = getattr(linear, "schedule", None)
    return DiskCache.key(ast.key, schedule.to_json() if schedule is not None else "")


def _compile_spec(compiler: "Compiler", spec: "ProgramSpec", use_disk: bool) -> tuple["CompiledSpec", str | None]:
    """The compiled spec and its source-level key (None with the disk cache off)."""
    from .device import CompiledSpec
    dc = DiskCache()
    key = disk_key(compiler, spec) if use_disk else None
    if key is not None:
        hit = checked_entry(dc, key, compiler, spec.name)
        if hit is not None:
            data, meta = hit
            with _lock:
                stats.disk_hits += 1
            if meta["kind"] == "src":
                return CompiledSpec.from_source(spec, data.decode(), arch=compiler.arch,
                                                compiler=compiler.cache_key), key
            return CompiledSpec.from_bytes(spec, data, arch=compiler.arch, compiler=compiler.cache_key), key
    t0 = time.perf_counter()
    compiled = compiler.compile(spec)
    dt = time.perf_counter() - t0
    with _lock:
        stats.compiles += 1
        stats.compile_seconds += dt
    if config.debug_level() >= 1:
        config.log(f"compiled {spec.name} with {compiler.cache_key} for {compiler.arch} in {dt * 1e3:.1f} ms")
    if key is not None:
        # compiling may have shown which toolchain really ran (a library loaded only now, from
        # somewhere other than where a lookup expected it): the entry goes under that identity
        key = disk_key(compiler, spec)
        kind = "bytes" if compiled.bytes is not None else "src"
        try:        # what could not be read back is not written
            check_output(compiler, spec.name, kind, compiled.payload)
        except elf.ElfError as e:
            warn_once(dc.root, f"the output of {compiler.cache_key} for {spec.name} fails its check ({e}); "
                               f"it is not stored")
            return compiled, None
        dc.put(key, compiled.payload, {"name": spec.name, "compiler": compiler.cache_key, "arch": compiler.arch,
                                       "kind": kind, "identity": compiler.identity(),
                                       "made_from": made_from(spec.ast, spec.linear)})
    return compiled, key


AST_ENTRY_FORMAT = "morok-ast-entry-2"
AST_ENTRY_FIELDS = frozenset({"format", "ast", "name", "source_key"})


def _ast_entry(ast: "UOp", name: str, source_key: str) -> bytes:
    """What an AST-level entry holds: which kernel it is for and where its compiled output lives.
    Nothing a launch check relies on: that is lowered again from the kernel on every hit."""
    entry = {"format": AST_ENTRY_FORMAT, "ast": ast.key, "name": name, "source_key": source_key}
    return json.dumps(entry, sort_keys=True, separators=(",", ":")).encode()


def _source_key_of(data: bytes, ast: "UOp", name: str) -> str:
    """The source-level key an AST-level entry names, after checking the entry is exactly one for this
    kernel; ValueError otherwise."""
    e = json.loads(data)
    if not isinstance(e, dict) or set(e) != AST_ENTRY_FIELDS or e["format"] != AST_ENTRY_FORMAT:
        raise ValueError(f"not a {AST_ENTRY_FORMAT} entry")
    if e["ast"] != ast.key or e["name"] != name:
        raise ValueError(f"the entry is for kernel {e['name']!r} ({str(e['ast'])[:12]}), not {name!r} ({ast.key[:12]})")
    key = e["source_key"]
    if not (isinstance(key, str) and len(key) == 64 and all(c in "0123456789abcdef" for c in key)):
        raise ValueError(f"bad source key {key!r}")
    return key


def _lowered_spec(compiler: "Compiler", ast: "UOp", name: str, info: "LaunchInfo", payload: bytes,
                  kind: str) -> "CompiledSpec":
    """The CompiledSpec of a hit: the compiled output read back (and checked), everything else from
    the kernel lowered again (`info`), the way `Renderer.render` derives it."""
    from .device import CompiledSpec
    gs = ls = None
    if not info.symbolic:
        gs, ls = info.launch_dims({})
    src, out = (payload.decode(), None) if kind == "src" else (None, payload)
    return CompiledSpec(name, src, out, ast, tuple(info.var_names), gs, ls, info.buf_count, info, compiler.arch,
                        compiler.cache_key, tuple(p.dtype for p in info.params))


def compile_ast(renderer: "Renderer", compiler: "Compiler", ast: "UOp", name: str | None,
                schedule: "Schedule | None" = None) -> "CompiledSpec":
    """Render and compile through both disk-cache levels: a hit by AST skips rendering and compiling
    (the launch facts are lowered again from the kernel). `schedule`: render with it instead of the
    kernel's default (ValueError if the kernel refuses it)."""
    from .codegen.lower import lower
    from .codegen.schedule import using
    from .device import CompiledSpec, kernel_name
    nm = kernel_name(ast, name)
    use_disk = config.cache_enabled()
    debug = config.debug_level()
    dc = DiskCache()
    akey = ast_key(renderer, compiler, ast, nm, schedule) if use_disk else None
    spec = None

    def render() -> "ProgramSpec":
        with using(schedule):
            out = renderer.render(ast, name)
        with _lock:
            stats.renders += 1
        return out

    # MOROK_DEBUG >= 2 prints the rendered source: render even when the AST entry would hit
    if akey is not None and debug < 2:
        hit = dc.get(akey)
        source_key = None
        if hit is not None:
            try:
                source_key = _source_key_of(hit[0], ast, nm)
            except Exception as e:   # whatever an entry holds, it is never worse than a miss
                dc.discard(akey, f"{type(e).__name__}: {e}")
        output = checked_entry(dc, source_key, compiler, nm) if source_key is not None else None
        info = None
        if output is not None:
            with using(schedule):
                linear, info = lower(ast, renderer.caps, nm, renderer.decompositor())
            if output[1].get("made_from") != made_from(ast, linear):
                # bytes written for another kernel of this name or schedule, or for one that renders
                # alike: only the rendered source, which keys them, can tell
                spec = render()
                if disk_key(compiler, spec) != source_key:
                    dc.discard(akey, "it names the compiled bytes of another kernel")
                    output = None
        if output is not None:
            payload, kind = output[0], output[1]["kind"]
            if spec is None:
                compiled = _lowered_spec(compiler, ast, nm, info, payload, kind)
            elif kind == "src":
                compiled = CompiledSpec.from_source(spec, payload.decode(), arch=compiler.arch,
                                                    compiler=compiler.cache_key)
            else:
                compiled = CompiledSpec.from_bytes(spec, payload, arch=compiler.arch, compiler=compiler.cache_key)
            with _lock:
                stats.disk_hits += 1
                stats.ast_hits += 1
            return compiled
    if spec is None:
        spec = render()
    if debug >= 1 and spec.linear is not None and spec.linear.schedule is not None:
        config.log(f"{spec.name} schedule: {spec.linear.schedule}")
    if debug >= 4 and spec.linear is not None:
        config.log(f"{spec.name} linear IR:\n{spec.linear.dump()}")
    if debug >= 2:
        config.log(f"{spec.name} source ({renderer.device}):\n{spec.src}")
    compiled, skey = _compile_spec(compiler, spec, use_disk)
    if debug >= 3:
        config.log(f"{spec.name} compiled:\n{_compiled_text(compiler, spec, compiled)}")
    if akey is not None and skey is not None:
        akey = ast_key(renderer, compiler, ast, nm, schedule)     # after the compile, as the source-level key
        dc.put(akey, _ast_entry(ast, nm, skey), {"name": spec.name, "compiler": compiler.cache_key,
                                                 "arch": compiler.arch, "kind": "ast"})
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
            compiled = compile_scheduled(device, renderer, compiler, ast, name)
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


def load_compiled(device: "Device", compiler: "Compiler", ast: "UOp", name: str | None,
                  compiled: "CompiledSpec") -> "Program":
    """compile_through_caches for a kernel compiled elsewhere (a batch compile's worker): `compiled`
    goes into the method cache, unless the key has an entry already, and is loaded like a hit."""
    mkey = method_key(device, compiler, ast, name)
    with _lock:
        _method_cache.setdefault(mkey, compiled)
    return compile_through_caches(device, None, compiler, ast, name)    # type: ignore[arg-type]


def beam_search(device: "Device", ast: "UOp", name: str | None = None, *, beam: int = 8,
                values: "dict[str, int] | None" = None, compiler: str | None = None,
                seconds: float | None = None, store: bool = True, seed: int = 0) -> "SearchResult":
    """Time the default and up to `beam`-1 other candidate schedules of `ast` on `device` (search.py),
    within `seconds` (MOROK_BEAM_SECONDS, default 60); store the fastest correct one for this kernel,
    renderer and arch unless `store` is False. Later compiles of the kernel use it without timing."""
    from .codegen.scan import scan_kernel
    from .codegen.schedule import candidate_schedules
    from .codegen.symbolic import rewrite, simplify
    from .search import time_schedules
    renderer, comp = device.pair(compiler) if compiler else (device.renderer, device.compiler)
    budget = seconds if seconds is not None else float(config.getenv("MOROK_BEAM_SECONDS", "60"))
    decompose = renderer.decompositor()
    sast = rewrite(ast, decompose) if decompose is not None else simplify(ast)
    cands = candidate_schedules(sast, renderer.caps, scan_kernel(sast))[:max(1, beam)]
    with _lock:
        stats.searches += 1
    result = time_schedules(device, cands, lambda s: device.runtime(compile_ast(renderer, comp, ast, name, s)),
                            values, budget, seed)
    best, default = result.schedule, result.default
    if config.debug_level() >= 1:
        config.log(f"search {name or 'kernel'}: {len(result.times)} timed, {len(result.rejected)} rejected; "
                   f"{best} {result.times[str(best)] * 1e6:.1f} us vs default {default} "
                   f"{result.times[str(default)] * 1e6:.1f} us")
    if store:
        store_schedule(renderer, comp, ast, best, {
            "values": result.values, "default": str(default), "speedup": result.speedup,
            "times_us": {k: round(v * 1e6, 3) for k, v in result.times.items()}})
    return result


def compile_scheduled(device: "Device", renderer: "Renderer", compiler: "Compiler", ast: "UOp",
                      name: str | None) -> "CompiledSpec":
    """compile_ast with the kernel's stored searched schedule; without one, a search first when
    MOROK_BEAM=N asks for it (N: candidates timed), else the default schedule."""
    sched = stored_schedule(renderer, compiler, ast)
    if sched is not None:
        with _lock:
            stats.schedule_hits += 1
    else:
        beam = config.getenv_int("MOROK_BEAM", 0)
        if beam > 0:
            sched = beam_search(device, ast, name, beam=beam, compiler=compiler.cache_key).schedule
    if sched is not None:
        try:
            return compile_ast(renderer, compiler, ast, name, sched)
        except ValueError as e:     # a stored choice the lowering no longer takes
            warnings.warn(f"morok_py: stored schedule {sched} does not fit this kernel any more ({e}); "
                          f"using the default", RuntimeWarning, stacklevel=2)
    return compile_ast(renderer, compiler, ast, name)


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
    from .kernels import clear_conv_steps
    with _lock:
        _method_cache.clear()
        _programs.clear()
        _key_locks.clear()
    clear_conv_steps()
