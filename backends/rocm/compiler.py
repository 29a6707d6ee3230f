"""AMDGPU code objects without ROCm: llvmlite emits a relocatable ELF for the gfx arch, `ld.lld
-shared` links it into the loadable code object (HSACO) that hipModuleLoadData takes."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass

from morok_py.device import CompiledSpec, Compiler, ProgramSpec
from morok_py.errors import CompileError, DeviceUnavailableError

from .renderer import CODE_OBJECT_VERSION, TRIPLE, parse_arch, wave_size

LLD_MIN_VERSION = 19
LLD_INSTALL = ("an ld.lld of version 19 or newer: `apt-get install lld-19` (Debian/Ubuntu), ROCm's "
               "/opt/rocm/llvm/bin/ld.lld, or set MOROK_LLD=/path/to/ld.lld")

_init_lock = threading.Lock()
_initialized = False


def llvm():
    """The llvmlite binding with every target (AMDGPU included) initialized once."""
    global _initialized
    try:
        import llvmlite.binding as binding
    except ImportError as e:
        raise DeviceUnavailableError("ROCM", f"llvmlite is not importable ({e})", "pip install llvmlite") from None
    with _init_lock:
        if not _initialized:
            binding.initialize_all_targets()
            binding.initialize_all_asmprinters()
            _initialized = True
    return binding


# ---- finding the linker ----------------------------------------------------------------------

@dataclass(frozen=True)
class Linker:
    path: str
    version: str
    found_by: str          # which rule of the search order picked it


_VERSION_RE = re.compile(r"LLD (\d+)\.(\d+)(?:\.(\d+))?")


def lld_version(path: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    m = _VERSION_RE.search(out.stdout + out.stderr)
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


_linker_lock = threading.Lock()
_linker_cache: dict[tuple, Linker | str] = {}


def find_lld() -> Linker:
    """The linker, searched in order: MOROK_LLD, $ROCM_PATH/llvm/bin/ld.lld, /opt/rocm/llvm/bin/ld.lld,
    then an ld.lld of version >= 19 on PATH (ld.lld, then ld.lld-NN newest first)."""
    env = (os.environ.get("MOROK_LLD", ""), os.environ.get("ROCM_PATH", ""), os.environ.get("PATH", ""))
    with _linker_lock:
        hit = _linker_cache.get(env)
        if hit is None:
            hit = _linker_cache[env] = _search_lld(*env)
    if isinstance(hit, str):
        raise DeviceUnavailableError("ROCM compiler llvm-amdgpu", hit, LLD_INSTALL)
    return hit


def _search_lld(morok_lld: str, rocm_path: str, path_env: str) -> Linker | str:
    def usable(p: str) -> bool:
        return os.path.isfile(p) and os.access(p, os.X_OK)

    if morok_lld:
        # an explicit choice is used as given or reported, never silently replaced
        if not usable(morok_lld):
            return f"MOROK_LLD={morok_lld!r} is not an executable file"
        v = lld_version(morok_lld)
        if v is None:
            return f"MOROK_LLD={morok_lld!r} does not report an LLD version (is it ld.lld?)"
        return Linker(morok_lld, ".".join(map(str, v)), "MOROK_LLD")
    for rule, p in ((f"$ROCM_PATH/llvm/bin/ld.lld", os.path.join(rocm_path, "llvm", "bin", "ld.lld") if rocm_path else ""),
                    ("/opt/rocm/llvm/bin/ld.lld", "/opt/rocm/llvm/bin/ld.lld")):
        if p and usable(p):
            v = lld_version(p)
            return Linker(p, ".".join(map(str, v)) if v else "rocm", rule)
    rejected = []
    names = ["ld.lld"] + [f"ld.lld-{n}" for n in range(40, LLD_MIN_VERSION - 1, -1)]
    for name in names:
        p = shutil.which(name, path=path_env or None)
        if not p:
            continue
        v = lld_version(p)
        if v is not None and v[0] >= LLD_MIN_VERSION:
            return Linker(p, ".".join(map(str, v)), f"PATH ({name})")
        rejected.append(f"{p} (version {'.'.join(map(str, v)) if v else 'unknown'})")
    why = "no ld.lld found (searched MOROK_LLD, $ROCM_PATH/llvm/bin, /opt/rocm/llvm/bin and PATH)"
    if rejected:
        why += f"; too old: {', '.join(rejected)}"
    return why


# ---- the compiler ----------------------------------------------------------------------------

def target_features(arch: str) -> str:
    """LLVM features for a `gcnArchName`: the wave size, plus sramecc/xnack when the name pins them."""
    name, rest = parse_arch(arch)
    feats = [f"+wavefrontsize{wave_size(name)}"]
    for part in filter(None, rest.split(":")):
        if part[:-1] in ("sramecc", "xnack") and part[-1] in "+-":
            feats.append(part[-1] + part[:-1])
    return ",".join(feats)


class AMDGPUCompiler(Compiler):
    """LLVM IR -> relocatable AMDGPU object (llvmlite) -> HSACO (ld.lld -shared); code object v5."""

    cache_key = "llvm-amdgpu"

    def __init__(self, arch: str, opt: int = 3) -> None:
        self.target_id = arch
        self.arch = parse_arch(arch)[0]
        self.features = target_features(arch)
        self.opt = opt
        self._tm = None
        self._lock = threading.Lock()

    def _target_machine(self):
        if self._tm is None:
            b = llvm()
            target = b.Target.from_triple(TRIPLE)
            self._tm = target.create_target_machine(cpu=self.arch, features=self.features, opt=self.opt,
                                                    reloc="pic")
        return self._tm

    def available(self) -> str | None:
        try:
            llvm()
            find_lld()
        except DeviceUnavailableError as e:
            return f"{e.reason} (install: {e.install})" if e.install else e.reason
        return None

    @property
    def linker(self) -> Linker:
        return find_lld()

    def identity(self) -> str:
        import llvmlite
        b = llvm()
        lld = find_lld()
        return (f"llvmlite-{llvmlite.__version__}/llvm-{'.'.join(map(str, b.llvm_version_info))}/"
                f"lld-{lld.version}/{TRIPLE}/{self.arch}/{self.features}/O{self.opt}/co{CODE_OBJECT_VERSION}")

    def _command(self) -> str:
        return (f"llc -mtriple={TRIPLE} -mcpu={self.arch} -mattr={self.features} -O{self.opt} -filetype=obj "
                f"kernel.ll -o kernel.o && ld.lld -shared kernel.o -o kernel.hsaco")

    def _module(self, src: str, name: str):
        """A freshly parsed, verified and optimized module (AMDGPU codegen mutates the module it emits)."""
        b = llvm()
        try:
            mod = b.parse_assembly(src)
            mod.verify()
        except RuntimeError as e:
            raise CompileError(f"LLVM rejected kernel {name}", log=str(e), src=src, command=self._command(),
                               kernel=name) from None
        tm = self._target_machine()
        mod.triple = TRIPLE
        mod.data_layout = str(tm.target_data)
        pto = b.create_pipeline_tuning_options(speed_level=self.opt)
        pto.loop_unrolling = True
        pb = b.create_pass_builder(tm, pto)
        pb.getModulePassManager().run(mod, pb)
        return mod

    def emit_object(self, src: str, name: str = "kernel") -> bytes:
        with self._lock:   # a TargetMachine is not safe to share between threads
            return self._target_machine().emit_object(self._module(src, name))

    def assembly(self, src: str, name: str = "kernel") -> str:
        with self._lock:
            return self._target_machine().emit_assembly(self._module(src, name))

    def link(self, obj: bytes, name: str = "kernel", src: str = "") -> bytes:
        lld = find_lld()
        with tempfile.TemporaryDirectory(prefix="morok-rocm-") as tmp:
            o, out = os.path.join(tmp, f"{name}.o"), os.path.join(tmp, f"{name}.hsaco")
            with open(o, "wb") as f:
                f.write(obj)
            cmd = [lld.path, "-shared", "--no-undefined", "-o", out, o]
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp)
            except (OSError, subprocess.SubprocessError) as e:
                raise CompileError(f"running {lld.path} for kernel {name} failed", log=str(e), src=src,
                                   command=" ".join(cmd), kernel=name) from None
            if res.returncode != 0:
                raise CompileError(f"ld.lld could not link kernel {name} (exit {res.returncode})",
                                   log=res.stdout + res.stderr, src=src, command=" ".join(cmd), kernel=name)
            with open(out, "rb") as f:
                return f.read()

    def compile(self, spec: ProgramSpec) -> CompiledSpec:
        find_lld()   # fail before the LLVM work when there is nothing to link with
        obj = self.emit_object(spec.src, spec.name)
        hsaco = self.link(obj, spec.name, spec.src)
        return CompiledSpec.from_bytes(spec, hsaco, arch=self.arch, compiler=self.cache_key)
