"""What a CPU target requires of the host: LLVM feature names, so that code compiled for a CPU loads
wherever the host has every feature of that target (x86-64-v2 code on a znver1 host), and a real
mismatch (x86-64-v4 on an AVX2 host) fails at load naming the missing features.

llvmlite reports the host's features but not those of a named CPU, so the targets are tables:

  - the x86-64 micro-architecture levels as the x86-64 psABI defines them (LLVM's X86_64V1..V4
    feature lists in X86.td, with the features they imply spelled out, as the host list has them);
  - a few named CPUs: their level plus the instruction-set extensions LLVM may select from when it
    compiles our kernels (system features such as sgx or invpcid are left out: kernels never use them).

A CPU in neither table is known only by name: its code loads on a host of that name only.
"""
from __future__ import annotations

_V1 = frozenset("64bit cmov cx8 fxsr mmx sse sse2".split())
_V2 = _V1 | frozenset("cx16 sahf crc32 popcnt sse3 ssse3 sse4.1 sse4.2".split())
_V3 = _V2 | frozenset("avx avx2 bmi bmi2 f16c fma lzcnt movbe xsave".split())
_V4 = _V3 | frozenset("avx512f avx512bw avx512cd avx512dq avx512vl".split())

X86_64_LEVELS: dict[str, frozenset[str]] = {"x86-64": _V1, "x86-64-v2": _V2, "x86-64-v3": _V3, "x86-64-v4": _V4}

_HSW = _V3 | frozenset("aes pclmul".split())
_SKX = _V4 | _HSW | frozenset("adx prfchw rdseed".split())
_ICX = _SKX | frozenset("avx512vnni avx512ifma avx512vbmi avx512vbmi2 avx512bitalg avx512vpopcntdq gfni vaes "
                        "vpclmulqdq sha".split())
_ZN1 = _HSW | frozenset("adx prfchw rdseed sha sse4a".split())
_ZN4 = (_ZN1 | _V4 | frozenset("avx512vnni avx512ifma avx512vbmi avx512vbmi2 avx512bitalg avx512vpopcntdq "
                               "avx512bf16 gfni vaes vpclmulqdq".split()))

NAMED_CPUS: dict[str, frozenset[str]] = {
    "haswell": _HSW, "broadwell": _HSW | frozenset("adx prfchw rdseed".split()),
    "skylake": _HSW | frozenset("adx prfchw rdseed".split()),
    "skylake-avx512": _SKX, "cascadelake": _SKX | frozenset(["avx512vnni"]),
    "icelake-server": _ICX,
    "sapphirerapids": _ICX | frozenset("avx512bf16 avx512fp16 avxvnni amx-tile amx-int8 amx-bf16".split()),
    "znver1": _ZN1, "znver2": _ZN1, "znver3": _ZN1 | frozenset("vaes vpclmulqdq".split()), "znver4": _ZN4,
}


def parse_features(features: str) -> frozenset[str]:
    """The enabled features of an LLVM feature string ('+avx2,-avx512f,...' -> {'avx2'})."""
    return frozenset(f[1:] for f in features.split(",") if f.startswith("+"))


def target_features(cpu: str, host: str = "", host_features: str = "") -> frozenset[str] | None:
    """The features code compiled for `cpu` may use; None when they are not known here."""
    if host and cpu == host:
        return parse_features(host_features)
    return X86_64_LEVELS.get(cpu) or NAMED_CPUS.get(cpu)


def feature_string(features: frozenset[str]) -> str:
    """An LLVM feature string enabling exactly `features` (sorted: deterministic)."""
    return ",".join("+" + f for f in sorted(features))


def load_mismatch(cpu: str, host: str, host_features: str) -> str | None:
    """Why code compiled for `cpu` cannot run on this host (None: it can)."""
    if not cpu or cpu == host:
        return None
    need = target_features(cpu)
    if need is None:
        return (f"the features of cpu {cpu!r} are not known here, and this host is {host!r}; compile for the "
                f"host, or for an x86-64 level it runs ({', '.join(X86_64_LEVELS)})")
    missing = need - parse_features(host_features)
    if missing:
        return f"this host ({host!r}) lacks {', '.join(sorted(missing))}, which cpu {cpu!r} has"
    return None
