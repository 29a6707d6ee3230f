"""Environment configuration, read when asked (so tests can change it)."""
from __future__ import annotations

import os
import sys
import time

from .errors import ConfigError


# os.environ.get of an unset name costs ~2 us on the 2-vCPU CI machine (Mapping.get raises and catches a
# KeyError inside), and a split CPU launch read three settings (24 us per launch against 6.5 on one thread).
# On POSIX CPython os.environ keeps its bytes in `_data`, updated by every os.environ write (monkeypatch's
# included): a lookup there reads the same values in ~0.1 us. Elsewhere, os.environ.get.
_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None
if not isinstance(_ENV_DATA, dict):
    _ENV_DATA = None
_ENV_KEYS: dict[str, bytes] = {}


def _raw(name: str) -> str | None:
    if _ENV_DATA is None:
        return os.environ.get(name)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.fsencode(name)
    value = _ENV_DATA.get(key)
    return None if value is None else os.fsdecode(value)


def getenv(name: str, default: str = "") -> str:
    raw = _raw(name)
    return default if raw is None else raw


def getenv_int(name: str, default: int) -> int:
    raw = _raw(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None


def debug_level() -> int:
    """MOROK_DEBUG: 1 kernel names and times, 2 rendered source, 3 compiled output, 4 linear IR."""
    return getenv_int("MOROK_DEBUG", 0)


def cache_enabled() -> bool:
    return getenv("MOROK_CACHE", "1") not in ("0", "false", "False", "")


def validate_with_cpu() -> bool:
    return getenv("MOROK_VALIDATE_WITH_CPU", "0") not in ("0", "false", "False", "")


def compiler_choice(backend: str) -> str | None:
    return _raw(f"MOROK_{backend.upper()}_COMPILER") or None


def arch_override(backend: str) -> str | None:
    return _raw(f"MOROK_{backend.upper()}_ARCH") or None


def _explicit_threads() -> int:
    """MOROK_CPU_THREADS as given (0: the process's CPUs)."""
    n = getenv_int("MOROK_CPU_THREADS", 0)
    if n < 0:
        raise ConfigError(f"MOROK_CPU_THREADS must be >= 0, got {n}")
    return n


def _affinity_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_threads() -> int:
    """MOROK_CPU_THREADS, or the CPUs of the process's affinity set (read now)."""
    return max(1, _explicit_threads() or _affinity_count())


# A split CPU launch reads its settings every time (so they can change between launches). Parsing them and asking
# the kernel for the affinity set cost ~3.5 us a launch on the 2-vCPU CI machine (sched_getaffinity alone ~1.5),
# against ~3.5 us for the rest of the launch's Python side: `cpu_launch` keeps the parsed settings for as long
# as their raw values stay the same, and re-reads the affinity set at most every AFFINITY_RECHECK_S.
AFFINITY_RECHECK_S = 0.1
_launch_cache: "tuple | None" = None        # (raw values, (threads or 0, pool, spin, pin))
_affinity_cache: "tuple[float, int]" = (float("-inf"), 1)


def cpu_launch(spin_default: int) -> "tuple[int, str, int, bool]":
    """(threads, pool kind, spin, pin) for a split CPU launch: MOROK_CPU_THREADS (else the affinity set's
    CPUs, re-read at most every AFFINITY_RECHECK_S), MOROK_CPU_POOL, MOROK_CPU_SPIN (default `spin_default`)
    and MOROK_CPU_PIN, each validated as its own reader does; a bad value is refused at every call."""
    global _launch_cache, _affinity_cache
    if _ENV_DATA is not None:       # the raw bytes (compared, not decoded)
        get = _ENV_DATA.get
        raw = (get(b"MOROK_CPU_THREADS"), get(b"MOROK_CPU_POOL"), get(b"MOROK_CPU_SPIN"), get(b"MOROK_CPU_PIN"),
               spin_default)
    else:
        raw = (_raw("MOROK_CPU_THREADS"), _raw("MOROK_CPU_POOL"), _raw("MOROK_CPU_SPIN"), _raw("MOROK_CPU_PIN"),
               spin_default)
    cached = _launch_cache
    if cached is None or cached[0] != raw:
        cached = _launch_cache = (raw, (_explicit_threads(), cpu_pool(), cpu_spin(spin_default), cpu_pin()))
    threads, pool, spin, pin = cached[1]
    if not threads:
        now = time.monotonic()
        seen, threads = _affinity_cache
        if now - seen >= AFFINITY_RECHECK_S:
            threads = _affinity_count()
            _affinity_cache = (now, threads)
    return max(1, threads), pool, spin, pin


def cpu_pool() -> str:
    """MOROK_CPU_POOL: 'native' (default; backends/cpu/pool.py, where the platform has it) or 'python'."""
    raw = getenv("MOROK_CPU_POOL") or "native"
    if raw not in ("native", "python"):
        raise ConfigError(f"MOROK_CPU_POOL must be 'native' or 'python', got {raw!r}")
    return raw


def cpu_spin(default: int) -> int:
    """MOROK_CPU_SPIN: pause instructions an idle native CPU worker spins before it sleeps (>= 0)."""
    n = getenv_int("MOROK_CPU_SPIN", default)
    if n < 0:
        raise ConfigError(f"MOROK_CPU_SPIN must be >= 0, got {n}")
    return n


def compile_stall(default: float) -> float:
    """MOROK_COMPILE_STALL: seconds a forked compile batch may go without a result (> 0)."""
    raw = _raw("MOROK_COMPILE_STALL")
    if raw is None or raw.strip() == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        raise ConfigError(f"MOROK_COMPILE_STALL must be a number of seconds, got {raw!r}") from None
    if not 0 < v < float("inf"):        # NaN fails both comparisons
        raise ConfigError(f"MOROK_COMPILE_STALL must be a finite number of seconds > 0, got {raw!r}")
    return v


def cpu_pin() -> bool:
    """MOROK_CPU_PIN: '1' (default) pins each native CPU worker to its own CPU of the process's affinity set;
    '0' leaves placement to the OS scheduler (several processes sharing one machine's CPUs may want that)."""
    raw = getenv("MOROK_CPU_PIN") or "1"
    if raw not in ("0", "1"):
        raise ConfigError(f"MOROK_CPU_PIN must be '0' or '1', got {raw!r}")
    return raw == "1"


def onnx_zero_copy() -> bool:
    """MOROK_ONNX_ZERO_COPY (default 1): on a device whose buffers are host memory, the ONNX executor's
    replays read the caller's input arrays and write the output arrays they return in place; 0 copies both."""
    return getenv("MOROK_ONNX_ZERO_COPY", "1") not in ("0", "false", "False", "")


def log(msg: str) -> None:
    print(f"[morok] {msg}", file=sys.stderr, flush=True)
