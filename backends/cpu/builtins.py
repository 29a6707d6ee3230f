"""The compiler-runtime functions CPU kernels may call, and a check that every symbol an object needs
resolves before it is loaded.

LLVM lowers some conversions to calls into compiler-rt / libgcc: `fptrunc float to bfloat` on x86-64
without AVX512-BF16 becomes `__truncsfbf2`, half conversions on CPUs without F16C become
`__extendhfsf2` / `__truncsfhf2`. Debian 12's libgcc (GCC 12) has the half ones and no bfloat16 ones;
the in-process loader resolved a missing one to address 0, so a bfloat16 kernel crashed the
interpreter. Here the bfloat16 conversions are defined once per process (compiled from the LLVM IR
below, round to nearest even, NaN kept quiet) and registered with LLVM's symbol table; libgcc is made
globally visible for the half ones; and an object that still needs a symbol nobody provides is refused
at load with the symbol's name.
"""
from __future__ import annotations

import ctypes
import struct
import threading

_SUPPORT_IR = r"""
define internal i16 @bf16_bits_rne(float %x) {
  %i = bitcast float %x to i32
  %lsb = lshr i32 %i, 16
  %odd = and i32 %lsb, 1
  %bias = add i32 %odd, 32767
  %r = add i32 %i, %bias
  %hi = lshr i32 %r, 16
  %t = trunc i32 %hi to i16
  %top = trunc i32 %lsb to i16
  %q = or i16 %top, 64
  %nan = fcmp uno float %x, %x
  %out = select i1 %nan, i16 %q, i16 %t
  ret i16 %out
}

define bfloat @__truncsfbf2(float %x) {
  %b = call i16 @bf16_bits_rne(float %x)
  %r = bitcast i16 %b to bfloat
  ret bfloat %r
}

; double -> float rounding to odd, then to nearest even: one correct rounding (float keeps 16 more bits);
; a double beyond float's range stays infinite
define bfloat @__truncdfbf2(double %x) {
  %f = fptrunc double %x to float
  %back = fpext float %f to double
  %changed = fcmp one double %back, %x
  %abs = call float @llvm.fabs.f32(float %f)
  %finite = fcmp one float %abs, 0x7FF0000000000000
  %inexact = and i1 %changed, %finite
  %i = bitcast float %f to i32
  %odd = or i32 %i, 1
  %sel = select i1 %inexact, i32 %odd, i32 %i
  %g = bitcast i32 %sel to float
  %b = call i16 @bf16_bits_rne(float %g)
  %r = bitcast i16 %b to bfloat
  ret bfloat %r
}

declare float @llvm.fabs.f32(float)
"""
PROVIDED = ("__truncsfbf2", "__truncdfbf2")

_lock = threading.Lock()
_engine = None          # keeps the support code alive for the life of the process
_resolved: dict[str, bool] = {}


def ensure_builtins(llvm, new_target_machine) -> None:
    """Compile and register the support functions (once per process) on an engine of their own, with a
    TargetMachine of its own from `new_target_machine()` (an engine owns the one it is made with), and
    make libgcc's half conversions visible to the loader."""
    global _engine
    if _engine is not None:
        return
    with _lock:
        if _engine is not None:
            return
        try:
            ctypes.CDLL("libgcc_s.so.1", mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass    # then an object needing its half conversions is refused at load by name
        mod = llvm.parse_assembly(_SUPPORT_IR)
        target_machine = new_target_machine()
        mod.triple = target_machine.triple
        engine = llvm.create_mcjit_compiler(mod, target_machine)
        engine.finalize_object()
        for name in PROVIDED:
            llvm.add_symbol(name, engine.get_function_address(name))
        _engine = engine


def undefined_symbols(obj: bytes) -> list[str]:
    """Names of the undefined symbols of an ELF64 little-endian relocatable object ([] for anything
    else: other formats are left to the loader)."""
    if len(obj) < 64 or obj[:4] != b"\x7fELF" or obj[4] != 2 or obj[5] != 1:
        return []
    shoff, = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    if shentsize < 64 or shoff + shnum * shentsize > len(obj):
        return []
    sections = [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + i * shentsize) for i in range(shnum)]
    out: list[str] = []
    for _, kind, _, _, off, size, link, _, _, entsize in sections:
        if kind != 2 or entsize < 24 or link >= shnum or off + size > len(obj):   # SHT_SYMTAB
            continue
        stroff, strsize = sections[link][4], sections[link][5]
        for at in range(off + entsize, off + size, entsize):      # entry 0 is the null symbol
            name_off, info, _, shndx = struct.unpack_from("<IBBH", obj, at)
            if shndx == 0 and name_off and (info >> 4) != 0 and name_off < strsize:   # undefined, not local
                end = obj.index(b"\0", stroff + name_off)
                out.append(obj[stroff + name_off:end].decode("ascii", "replace"))
    return out


def unresolved(llvm, names: list[str]) -> list[str]:
    """The names the in-process loader would not find (registered with LLVM or in the process)."""
    missing = []
    for name in names:
        ok = _resolved.get(name)
        if ok is None:
            ok = bool(llvm.address_of_symbol(name))
            if not ok:
                try:
                    getattr(ctypes.CDLL(None), name)
                    ok = True
                except AttributeError:
                    ok = False
            _resolved[name] = ok
        if not ok:
            missing.append(name)
    return missing
