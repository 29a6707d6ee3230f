"""PTX text of the warpgroup matrix instructions (sm_90a), shared by the CUDA C and NVPTX printers.

Both printers emit these as inline PTX (`asm` in CUDA C, `asm sideeffect` in LLVM IR) around the linear
kernel's WGMMA, SMEM_DESC, WG_SYNC and MBAR instructions (codegen/strategies/wgmma.py builds them). Operands are
numbered the same way in both: the accumulators first (%0 .. %n-1, read and written), then the two
descriptors, then the scale-d flag.
"""
from __future__ import annotations

SWIZZLE_128B = 1 << 62          # descriptor bits 62-63: 1 = the 128-byte swizzle


def desc_high(lbo: int, sbo: int) -> int:
    """The constant part of a 128-byte-swizzle shared-memory matrix descriptor: leading and stride byte
    offsets (bits 16-29 and 32-45, in 16-byte units) and the swizzle mode; the start address (bits 0-13,
    (address & 0x3FFFF) >> 4) is or-ed in at run time."""
    if lbo % 16 or sbo % 16 or not 0 < lbo < 1 << 18 or not 0 < sbo < 1 << 18:
        raise ValueError(f"descriptor offsets must be 16-byte multiples under 256 KiB, got {lbo}, {sbo}")
    return ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | SWIZZLE_128B


# PTX operand types of wgmma by the shared tiles' dtype names (the PTX names are accepted as they are)
WG_TYPES = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2",
            "f16": "f16", "bf16": "bf16", "e4m3": "e4m3", "e5m2": "e5m2"}
WG_8BIT = ("e4m3", "e5m2")


def wg_types(ab: "str | tuple[str, str]") -> tuple[str, str]:
    """The PTX types (A, B) of a WGMMA's `ab`: one dtype name for both operands, or a pair (float8 only:
    e4m3 and e5m2 mix)."""
    a, b = (ab, ab) if isinstance(ab, str) else ab
    if a not in WG_TYPES or b not in WG_TYPES:
        raise ValueError(f"no wgmma for operands {ab!r}")
    ta, tb = WG_TYPES[a], WG_TYPES[b]
    if ta != tb and not (ta in WG_8BIT and tb in WG_8BIT):
        raise ValueError(f"wgmma mixes only the 8-bit float types, got {ta} and {tb}")
    return ta, tb


def wg_k(ab: "str | tuple[str, str]") -> int:
    """k of one wgmma: 32 bytes of each operand row (16 for 16-bit types, 32 for 8-bit ones)."""
    return 32 if wg_types(ab)[0] in WG_8BIT else 16


def wgmma_text(n: int, ab: "str | tuple[str, str]", trans_a: int, trans_b: int, dollar: bool = False) -> str:
    """`wgmma.mma_async ... m64n{n}k{16|32}.f32.{a}.{b}` with D += A @ B (scale-d from the operand after the
    descriptors: 1 accumulates), A and B from descriptors. 16-bit operands (k16) may be transposed (MN-major)
    per the flags; 8-bit ones (e4m3, e5m2: k32) have no transpose operands and must be K-major."""
    ta, tb = wg_types(ab)
    k = wg_k(ab)
    if n % 8 or not 8 <= n <= 256 or trans_a not in (0, 1) or trans_b not in (0, 1) or (k == 32 and (trans_a or trans_b)):
        raise ValueError(f"no wgmma m64n{n}k{k} for {ta}.{tb} with transposes {trans_a}, {trans_b}")
    m = n // 2
    mark = "$" if dollar else "%"
    regs = ", ".join(f"{mark}{i}" for i in range(m))
    tail = "p, 1, 1" if k == 32 else f"p, 1, 1, {trans_a}, {trans_b}"
    return (f"{{ .reg .pred p; setp.ne.b32 p, {mark}{m + 2}, 0; "
            f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ta}.{tb} {{{regs}}}, {mark}{m}, {mark}{m + 1}, "
            f"{tail}; }}")


def wg_sync_text(arg: "str | int") -> str:
    """The PTX of a WG_SYNC: the register fence before wgmma, closing a group, waiting for all but `arg`
    groups, or the generic-to-async proxy fence for shared stores that wgmma reads."""
    fixed = {"fence": "wgmma.fence.sync.aligned;", "commit": "wgmma.commit_group.sync.aligned;",
             "proxy": "fence.proxy.async.shared::cta;"}
    if isinstance(arg, str):
        if arg not in fixed:
            raise ValueError(f"unknown warpgroup sync {arg!r}")
        return fixed[arg]
    if not isinstance(arg, int) or isinstance(arg, bool) or not 0 <= arg <= 7:
        raise ValueError(f"wgmma.wait_group takes 0..7 pending groups, got {arg!r}")
    return f"wgmma.wait_group.sync.aligned {arg};"


def mbar_text(op: str, dollar: bool = False) -> str:
    """The PTX of an MBAR (linear.L.MBAR) on the shared-window address operand 0: `init` (operand 1: the
    expected arrivals), `arrive`, `cp_arrive` (arrives when this thread's earlier cp.async copies have
    landed, without adding an expected arrival: the init count includes it) or `wait` (spins until the
    phase whose parity is operand 1 has completed)."""
    m = "$" if dollar else "%"
    texts = {"init": f"mbarrier.init.shared::cta.b64 [{m}0], {m}1;",
             "arrive": f"{{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [{m}0]; }}",
             "cp_arrive": f"cp.async.mbarrier.arrive.noinc.shared::cta.b64 [{m}0];",
             "wait": (f"{{ .reg .pred p; WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [{m}0], {m}1; "
                      f"@!p bra WAIT; }}")}
    if op not in texts:
        raise ValueError(f"unknown mbarrier operation {op!r}")
    return texts[op]


__all__ = ["SWIZZLE_128B", "WG_8BIT", "WG_TYPES", "desc_high", "mbar_text", "wg_k", "wg_sync_text", "wg_types", "wgmma_text"]
