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


def wgmma_text(n: int, ab: str, trans_a: int, trans_b: int, dollar: bool = False) -> str:
    """`wgmma.mma_async ... m64n{n}k16.f32.{ab}.{ab}` with D += A @ B (scale-d from the operand after the
    descriptors: 1 accumulates), A and B from descriptors, transposed (MN-major) per the flags."""
    if n % 8 or not 8 <= n <= 256 or ab not in ("f16", "bf16") or trans_a not in (0, 1) or trans_b not in (0, 1):
        raise ValueError(f"no wgmma m64n{n}k16 for {ab} with transposes {trans_a}, {trans_b}")
    m = n // 2
    mark = "$" if dollar else "%"
    regs = ", ".join(f"{mark}{i}" for i in range(m))
    return (f"{{ .reg .pred p; setp.ne.b32 p, {mark}{m + 2}, 0; "
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab} {{{regs}}}, {mark}{m}, {mark}{m + 1}, "
            f"p, 1, 1, {trans_a}, {trans_b}; }}")


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


__all__ = ["SWIZZLE_128B", "desc_high", "mbar_text", "wg_sync_text", "wgmma_text"]
