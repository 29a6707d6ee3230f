"""ELF64 objects checked structurally before any loader sees them (pure Python, struct only): the header
(class, byte order, type, machine), the section and program header tables within the file, string and
symbol tables well formed, relocations pointing inside their sections, and the expected kernel symbol
defined in an executable section. Each backend names what its compiler emits (an `ObjectKind`)."""
from __future__ import annotations

import struct
from dataclasses import dataclass

from .errors import MorokError

EM_X86_64, EM_AARCH64, EM_CUDA, EM_AMDGPU = 62, 183, 190, 224
ET_REL, ET_EXEC, ET_DYN = 1, 2, 3

SHT_NULL, SHT_PROGBITS, SHT_SYMTAB, SHT_STRTAB, SHT_RELA = 0, 1, 2, 3, 4
SHT_NOTE, SHT_NOBITS, SHT_REL, SHT_DYNSYM = 7, 8, 9, 11
SHF_WRITE, SHF_ALLOC, SHF_EXECINSTR, SHF_MERGE, SHF_STRINGS, SHF_INFO_LINK = 0x1, 0x2, 0x4, 0x10, 0x20, 0x40
SHF_GROUP, SHF_X86_64_LARGE, SHF_EXCLUDE = 0x200, 0x10000000, 0x80000000
SHN_UNDEF, SHN_ABS, SHN_COMMON = 0, 0xFFF1, 0xFFF2
STT_OBJECT, STT_FUNC, STT_SECTION, STT_FILE = 1, 2, 3, 4
STB_LOCAL, STB_GLOBAL, STB_WEAK = 0, 1, 2

# the relocations LLVM's in-process loader (RuntimeDyld) applies on x86-64, with the bytes each patches;
# it aborts the process on any other type (R_X86_64_NONE, which patches nothing, LLVM never writes)
X86_64_RELOCATIONS = {1: 8, 2: 4, 4: 4, 9: 4, 10: 4, 11: 4, 24: 8, 25: 8, 26: 4, 27: 8, 29: 8, 31: 8, 41: 4, 42: 4}
X86_64_PC_RELATIVE = frozenset({2, 4, 24})       # S + A - P: the addend is the target offset less 4 (+ an immediate)
X86_64_ABSOLUTE = frozenset({1, 10, 11})         # S + A

_SECTION = struct.Struct("<IIQQQQIIQQ")
_SYMBOL = struct.Struct("<IBBHQQ")
_SEGMENT = struct.Struct("<IIQQQQQQ")


class ElfError(MorokError, ValueError):
    """Bytes that are not a well-formed object of the expected kind (a damaged disk-cache entry)."""


@dataclass(frozen=True)
class ObjectKind:
    """What a compiler emits: ELF type(s) and machine. `relocatable`: a relocatable object an
    in-process loader links (the CPU's): its layout must also be exactly what LLVM writes."""

    machine: int
    types: tuple[int, ...]
    relocatable: bool = False


@dataclass(frozen=True)
class Section:
    """One entry of the section table, with its name read from the section name table."""

    index: int
    name: str
    type: int
    flags: int
    addr: int
    offset: int
    size: int
    link: int
    info: int
    align: int
    entsize: int


def _fail(why: str) -> None:
    raise ElfError(why)


def _cstr(data: bytes, table: Section, off: int, what: str) -> bytes:
    if off >= table.size:
        _fail(f"{what}: name offset {off} is outside its string table ({table.size} bytes)")
    start = table.offset + off
    end = data.find(b"\0", start, table.offset + table.size)
    if end < 0:
        _fail(f"{what}: unterminated name")
    return data[start:end]


def sections(data: bytes) -> list[Section]:
    """The section table of a checked-size ELF64 little-endian file (ElfError when it is malformed)."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        _fail("not an ELF file")
    if data[4] != 2 or data[5] != 1 or data[6] != 1:
        _fail(f"not a little-endian ELF64 (class {data[4]}, data {data[5]}, version {data[6]})")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    ehsize, _, _, shentsize, shnum, shstrndx = struct.unpack_from("<HHHHHH", data, 0x34)
    if ehsize != 64:
        _fail(f"header size {ehsize}, not 64")
    if shoff == 0 or shentsize != _SECTION.size:
        _fail(f"no usable section table (offset {shoff}, entry size {shentsize})")
    if shoff < 64 or shoff + _SECTION.size > len(data):
        _fail(f"section table at {shoff} is outside the file ({len(data)} bytes)")
    first = _SECTION.unpack_from(data, shoff)
    if shnum == 0:                       # extended numbering: the count is in section 0's size
        shnum = first[5]
    if shstrndx == 0xFFFF:
        shstrndx = first[6]
    if not 2 <= shnum <= 4096 or shoff + shnum * _SECTION.size > len(data):
        _fail(f"{shnum} sections at {shoff} do not fit in the file ({len(data)} bytes)")
    if first[1] != SHT_NULL:
        _fail("section 0 is not the null section")
    raw = [_SECTION.unpack_from(data, shoff + i * _SECTION.size) for i in range(shnum)]
    table_end = shoff + shnum * _SECTION.size
    spans = []
    for i, (_, kind, _, _, off, size, _, _, align, _) in enumerate(raw):
        if align & (align - 1) or align > 1 << 16:
            _fail(f"section {i}: alignment {align} is not a power of two up to 65536")
        if kind != SHT_NOBITS and size and i:
            if off < 64 or off + size > len(data):
                _fail(f"section {i}: bytes [{off}, {off + size}) are outside the file ({len(data)} bytes)")
            if off < table_end and shoff < off + size:
                _fail(f"section {i} overlaps the section table")
            spans.append((off, off + size, i))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            _fail(f"sections {a} and {b} overlap in the file")
    if not 0 < shstrndx < shnum or raw[shstrndx][1] != SHT_STRTAB:
        _fail(f"section name table index {shstrndx} is not a string table")
    names_raw = raw[shstrndx]
    names = Section(shstrndx, "", *names_raw[1:])
    _check_strtab(data, names)
    out = []
    for i, r in enumerate(raw):
        name = _cstr(data, names, r[0], f"section {i}").decode("ascii", "replace") if i else ""
        out.append(Section(i, name, *r[1:]))
    return out


def _check_strtab(data: bytes, s: Section) -> None:
    if s.type != SHT_STRTAB:
        _fail(f"section {s.index} ({s.name}) is not a string table")
    if s.size and data[s.offset + s.size - 1] != 0:
        _fail(f"string table {s.name or s.index} does not end in NUL")


def _symbols(data: bytes, secs: list[Section], tab: Section) -> list[tuple[bytes, int, int, int, int, int]]:
    """(name, info, other, shndx, value, size) of every entry of a symbol table section."""
    if tab.entsize != _SYMBOL.size or tab.size % _SYMBOL.size:
        _fail(f"symbol table {tab.name}: entry size {tab.entsize}, size {tab.size}")
    if not 0 < tab.link < len(secs):
        _fail(f"symbol table {tab.name}: string table index {tab.link} is out of range")
    strings = secs[tab.link]
    _check_strtab(data, strings)
    count = tab.size // _SYMBOL.size
    if tab.info > count:
        _fail(f"symbol table {tab.name}: first global {tab.info} is past its {count} entries")
    out = []
    for k in range(count):
        name_off, info, other, shndx, value, size = _SYMBOL.unpack_from(data, tab.offset + k * _SYMBOL.size)
        if shndx >= len(secs) and shndx not in (SHN_ABS, SHN_COMMON):
            _fail(f"symbol {k} of {tab.name}: section index {shndx} is out of range")
        out.append((_cstr(data, strings, name_off, f"symbol {k} of {tab.name}"), info, other, shndx, value, size))
    return out


def check_object(data: bytes, kind: ObjectKind, symbol: str) -> None:
    """Raise ElfError unless `data` is a well-formed ELF64 object of `kind` defining function `symbol`."""
    secs = sections(data)
    e_type, e_machine, e_version = struct.unpack_from("<HHI", data, 0x10)
    if e_type not in kind.types:
        _fail(f"ELF type {e_type}, expected {' or '.join(map(str, kind.types))}")
    if e_machine != kind.machine:
        _fail(f"ELF machine {e_machine}, expected {kind.machine}")
    if e_version != 1:
        _fail(f"ELF version {e_version}")
    _check_segments(data)
    tables = {s.index: _symbols(data, secs, s) for s in secs if s.type in (SHT_SYMTAB, SHT_DYNSYM)}
    if not tables:
        _fail("no symbol table")
    for s in secs:
        if s.type == SHT_STRTAB:
            _check_strtab(data, s)
        elif s.type in (SHT_REL, SHT_RELA):
            _check_relocations(data, secs, tables, s, kind, e_type == ET_REL)
    if kind.relocatable:
        _check_relocatable(data, secs, tables)
    want = symbol.encode()
    found = False
    for syms in tables.values():
        for name, info, _, shndx, value, size in syms:
            if name != want:
                continue
            if shndx in (SHN_UNDEF, SHN_ABS, SHN_COMMON) or info & 0xF != STT_FUNC \
                    or info >> 4 not in (STB_GLOBAL, STB_WEAK):
                _fail(f"symbol {symbol!r} is not a defined global function")
            s = secs[shndx]
            base = 0 if e_type == ET_REL else s.addr
            if s.type != SHT_PROGBITS or s.flags & (SHF_ALLOC | SHF_EXECINSTR) != SHF_ALLOC | SHF_EXECINSTR:
                _fail(f"symbol {symbol!r} is in section {s.name!r}, which is not executable code")
            if not (base <= value and value + max(size, 1) <= base + s.size):
                _fail(f"symbol {symbol!r} at [{value}, {value + size}) is outside its section {s.name!r}")
            found = True
    if not found:
        _fail(f"no symbol {symbol!r}")


def _check_segments(data: bytes) -> None:
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    if phnum == 0:
        return
    if phentsize != _SEGMENT.size or phoff < 64 or phoff + phnum * _SEGMENT.size > len(data):
        _fail(f"program header table ({phnum} x {phentsize} at {phoff}) is outside the file")
    for i in range(phnum):
        _, _, off, _, _, filesz, memsz, align = _SEGMENT.unpack_from(data, phoff + i * _SEGMENT.size)
        if filesz and off + filesz > len(data):
            _fail(f"segment {i}: bytes [{off}, {off + filesz}) are outside the file")
        if filesz > memsz or align & (align - 1):
            _fail(f"segment {i}: file size {filesz}, memory size {memsz}, alignment {align}")


def _check_relocations(data: bytes, secs: list[Section], tables: dict, s: Section, kind: ObjectKind,
                       relocatable: bool) -> None:
    width = 24 if s.type == SHT_RELA else 16
    if s.entsize != width or s.size % width:
        _fail(f"relocation section {s.name}: entry size {s.entsize}, size {s.size}")
    if s.link not in tables:
        if s.link == 0 and not relocatable:
            return
        _fail(f"relocation section {s.name}: symbol table index {s.link} is not a symbol table")
    nsyms = len(tables[s.link])
    target = secs[s.info] if relocatable and 0 < s.info < len(secs) else None
    if relocatable and target is None:
        _fail(f"relocation section {s.name}: target section {s.info} is out of range")
    for at in range(s.offset, s.offset + s.size, width):
        r_offset, r_info = struct.unpack_from("<QQ", data, at)
        sym, rtype = r_info >> 32, r_info & 0xFFFFFFFF
        if sym >= nsyms:
            _fail(f"relocation in {s.name}: symbol {sym} is past the {nsyms} symbols")
        if target is not None:
            patch = X86_64_RELOCATIONS.get(rtype) if kind.machine == EM_X86_64 else 1
            if patch is None:
                _fail(f"relocation in {s.name}: type {rtype} is not one the loader applies")
            if r_offset + patch > target.size:
                _fail(f"relocation in {s.name} at {r_offset} is outside {target.name} ({target.size} bytes)")


_KNOWN_FLAGS = (SHF_WRITE | SHF_ALLOC | SHF_EXECINSTR | SHF_MERGE | SHF_STRINGS | SHF_INFO_LINK | SHF_GROUP
                | SHF_X86_64_LARGE | SHF_EXCLUDE)


def _family(name: str) -> str:
    """What a section of an LLVM relocatable object holds, by its name."""
    for prefix, fam in ((".rela", "rela"), (".rel", "rel"), (".text", "text"), (".ltext", "text"),
                        (".rodata", "rodata"), (".lrodata", "rodata"), (".data", "data"), (".ldata", "data"),
                        (".bss", "bss"), (".lbss", "bss")):
        if name == prefix or name.startswith(prefix + "."):
            return fam
    return {".symtab": "symtab", ".strtab": "strtab", ".shstrtab": "strtab", ".note.GNU-stack": "note",
            ".llvm_addrsig": "addrsig", ".comment": "comment", ".eh_frame": "eh_frame", ".group": "group",
            ".note.gnu.property": "property", ".llvm.call-graph-profile": "profile"}.get(name, "")


# family -> (section types, flags it must have, flags it may have)
_FAMILIES = {
    "text": ((SHT_PROGBITS,), SHF_ALLOC | SHF_EXECINSTR, SHF_GROUP | SHF_X86_64_LARGE),
    "rodata": ((SHT_PROGBITS,), SHF_ALLOC, SHF_MERGE | SHF_STRINGS | SHF_GROUP | SHF_X86_64_LARGE),
    "data": ((SHT_PROGBITS,), SHF_ALLOC | SHF_WRITE, SHF_GROUP | SHF_X86_64_LARGE),
    "bss": ((SHT_NOBITS,), SHF_ALLOC | SHF_WRITE, SHF_GROUP | SHF_X86_64_LARGE),
    "rela": ((SHT_RELA,), 0, SHF_INFO_LINK | SHF_GROUP),
    "rel": ((SHT_REL,), 0, SHF_INFO_LINK | SHF_GROUP),
    "symtab": ((SHT_SYMTAB,), 0, 0),
    "strtab": ((SHT_STRTAB,), 0, 0),
    "note": ((SHT_PROGBITS,), 0, 0),
    "addrsig": ((0x6FFF4C03,), 0, SHF_EXCLUDE),
    "comment": ((SHT_PROGBITS,), 0, SHF_MERGE | SHF_STRINGS),
    "eh_frame": ((SHT_PROGBITS, 0x70000001), SHF_ALLOC, 0),
    "group": ((17,), 0, 0),                     # a COMDAT group (the loader ignores it)
    "property": ((SHT_NOTE,), SHF_ALLOC, 0),
    "profile": ((0x6FFF4C09,), 0, SHF_EXCLUDE),
}


def _check_relocatable(data: bytes, secs: list[Section], tables: dict) -> None:
    """The stricter rules for a relocatable object linked in-process: the header, section kinds, flags,
    symbols and function layout exactly as LLVM writes them (a loader trusts each of them)."""
    entry, phoff = struct.unpack_from("<QQ", data, 0x18)
    flags, = struct.unpack_from("<I", data, 0x30)
    phnum, = struct.unpack_from("<H", data, 0x38)
    if data[7:16] != bytes(9) or entry or phoff or phnum or flags:
        _fail("a relocatable object's header has a nonzero OS ABI, entry, program header or flags field")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    if data[shoff:shoff + _SECTION.size] != bytes(_SECTION.size):
        _fail("section 0 is not all zeros")
    symtabs = [s for s in secs if s.type == SHT_SYMTAB]
    if len(symtabs) != 1 or symtabs[0].name != ".symtab" or any(s.type == SHT_DYNSYM for s in secs):
        _fail("a relocatable object needs exactly one symbol table, .symtab")
    symtab = symtabs[0]
    # LLVM writes the sections back to back after the header, each at its alignment, then the table
    end = 64
    for s in sorted((s for s in secs[1:] if s.type != SHT_NOBITS), key=lambda s: (s.offset, s.size, s.index)):
        at = end + (-end % max(s.align, 1))
        if s.offset != at:
            _fail(f"section {s.name!r} is at {s.offset}, not at {at} where the one before it ends")
        end = at + s.size
    if shoff != end + (-end % 8):
        _fail(f"the section table is at {shoff}, not where the last section ends ({end})")
    for s in secs[1:]:
        fam = _family(s.name)
        if not fam:
            _fail(f"unexpected section {s.name!r}")
        types, need, may = _FAMILIES[fam]
        if s.type not in types or s.flags & need != need or s.flags & ~(need | may) or s.flags & ~_KNOWN_FLAGS:
            _fail(f"section {s.name!r} has type {s.type:#x} and flags {s.flags:#x}")
        if s.addr:
            _fail(f"section {s.name!r} has an address in a relocatable object")
        if fam in ("rela", "rel"):
            if s.link != symtab.index or not 0 < s.info < len(secs):
                _fail(f"relocation section {s.name!r} links {s.link}, applies to {s.info}")
            if secs[s.info].name != s.name[len(".rela" if fam == "rela" else ".rel"):] \
                    or not secs[s.info].flags & SHF_ALLOC:
                _fail(f"relocation section {s.name!r} applies to section {secs[s.info].name!r}")
    syms = tables[symtab.index]
    if syms[0] != (b"", 0, 0, 0, 0, 0):
        _fail("symbol 0 is not the null symbol")
    seen_sections: set[int] = set()
    funcs: dict[int, list[tuple[int, int]]] = {}
    for k, (name, info, other, shndx, value, size) in enumerate(syms[1:], 1):
        bind, typ = info >> 4, info & 0xF
        if (bind == STB_LOCAL) != (k < symtab.info) or bind not in (STB_LOCAL, STB_GLOBAL, STB_WEAK) or other:
            _fail(f"symbol {k} ({name!r}): binding {bind}, visibility {other}, first global {symtab.info}")
        if typ == STT_SECTION:
            if value or size or not 0 < shndx < len(secs) or shndx in seen_sections \
                    or not secs[shndx].flags & SHF_ALLOC:
                _fail(f"section symbol {k} is malformed")
            seen_sections.add(shndx)
        elif typ == STT_FILE:
            if shndx != SHN_ABS or value or size:
                _fail(f"file symbol {k} is malformed")
        elif shndx == SHN_UNDEF:
            if value or size or bind == STB_LOCAL:
                _fail(f"undefined symbol {k} ({name!r}) is malformed")
        elif typ == 0 and 0 < shndx < len(secs):       # a label (a constant pool's, .LCPI0_0)
            if size or value > secs[shndx].size:
                _fail(f"label {k} ({name!r}) at {value} is outside section {secs[shndx].name!r}")
        elif typ in (STT_FUNC, STT_OBJECT) and 0 < shndx < len(secs):
            s = secs[shndx]
            if value + size > s.size or (typ == STT_FUNC) != bool(s.flags & SHF_EXECINSTR):
                _fail(f"symbol {k} ({name!r}) at [{value}, {value + size}) does not fit section {s.name!r}")
            if typ == STT_FUNC:
                funcs.setdefault(shndx, []).append((value, size))
        else:
            _fail(f"symbol {k} ({name!r}) has type {typ} in section {shndx}")
    for s in secs[1:]:
        if s.type == SHT_RELA and EM_X86_64 == struct.unpack_from("<H", data, 0x12)[0]:
            _check_section_targets(data, secs, syms, s)
    for shndx, spans in funcs.items():
        # functions tile their section in order, each aligned, with less than one alignment of padding
        align = max(1, min(secs[shndx].align, 16))
        end = 0
        for value, size in sorted(spans):
            if value % align or not end <= value < end + align or not size:
                _fail(f"a function in {secs[shndx].name!r} starts at {value}, after code ending at {end}")
            end = value + size
        if not end <= secs[shndx].size < end + align:
            _fail(f"the functions of {secs[shndx].name!r} end at {end}, its size is {secs[shndx].size}")


def _patches_an_operand(data: bytes, code: Section, r_offset: int, rtype: int) -> bool:
    """Whether the bytes before a relocation in x86-64 code are an instruction it can complete: a
    `movabs` (REX.W, B8+r) for a 64-bit absolute address, a call or jump (E8, E9) or a RIP-relative
    operand (ModRM mod 00, r/m 101) for a 32-bit relative one."""
    before = data[code.offset + max(0, r_offset - 2):code.offset + r_offset]
    if len(before) != 2:
        return False
    if rtype in (1, 25, 27, 29, 31):
        return before[0] & 0xF8 == 0x48 and before[1] & 0xF8 == 0xB8
    if rtype in (2, 4, 9, 41, 42):
        return before[1] & 0xC7 == 0x05 or (rtype in (2, 4) and before[1] in (0xE8, 0xE9))
    return True


def _check_section_targets(data: bytes, secs: list[Section], syms: list, rela: Section) -> None:
    """Relocations come in the order of the bytes they patch; in code, a 64-bit absolute one patches
    the immediate of a `movabs` (REX.W, B8+r), as LLVM's large code model emits them; one against a
    section symbol (constants, jump tables) points inside that section."""
    code = secs[rela.info]
    previous = -1
    for at in range(rela.offset, rela.offset + rela.size, 24):
        r_offset, r_info, addend = struct.unpack_from("<QQq", data, at)
        sym, rtype = r_info >> 32, r_info & 0xFFFFFFFF
        if r_offset <= previous or sym == 0:
            _fail(f"relocations in {rela.name} are out of order or name no symbol at {r_offset}")
        previous = r_offset
        if code.flags & SHF_EXECINSTR and not _patches_an_operand(data, code, r_offset, rtype):
            _fail(f"relocation type {rtype} in {rela.name} at {r_offset} does not patch an instruction's operand")
        _, info, _, shndx, _, _ = syms[sym]
        if info & 0xF != STT_SECTION:
            continue
        target = addend + 4 if rtype in X86_64_PC_RELATIVE else addend if rtype in X86_64_ABSOLUTE else None
        pool = secs[shndx]
        if target is not None and not 0 <= target <= pool.size - (rtype in X86_64_PC_RELATIVE):
            _fail(f"a relocation in {rela.name} points at {target} in {pool.name} ({pool.size} bytes)")
        if rtype in X86_64_ABSOLUTE and pool.flags & SHF_MERGE and not pool.flags & SHF_STRINGS \
                and pool.entsize and addend % pool.entsize:
            _fail(f"a relocation in {rela.name} points at {addend}, between the {pool.entsize}-byte "
                  f"constants of {pool.name}")


def check_text(payload: bytes, symbol: str) -> str:
    """A text entry (PTX, source): the decoded text, checked to name `symbol`; ElfError otherwise."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ElfError(f"text entry is not UTF-8 ({e})") from None
    if "\0" in text or symbol not in text:
        _fail(f"text entry does not define {symbol!r}")
    return text
