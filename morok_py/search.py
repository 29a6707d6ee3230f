"""Schedule search: time a kernel's candidate schedules on the device and keep the fastest.

`cache.beam_search(device, ast, beam=N)` (or MOROK_BEAM=N on any `Device.compile`) takes the kernel's
default schedule and the first N-1 alternatives of `codegen.schedule.candidate_schedules` (an ordered,
bounded list: work-group sizes, reduction splits and unrolls, register and shared-memory tiles), and
within a time budget (MOROK_BEAM_SECONDS, 60 s) compiles each, runs it on the same random inputs as
the default schedule, drops any whose outputs differ from the default's, and times the rest in ROUNDS
interleaved rounds (after untimed passes over all of them for WARM_SECONDS; each round a median of REPEATS runs per
candidate, starting at another candidate each round; at least MIN_ROUNDS even past the budget; a
candidate's time is its best round, so a burst of other load on a shared machine slows one round, not one
candidate). The default is
replaced only by a candidate at least SWITCH_MARGIN faster. The winner is stored beside the disk cache (`cache.store_schedule`, keyed
by the AST, renderer and arch); a later compile of the same kernel, in any process, uses it without
timing anything. Symbolic sizes are tuned at `values` (default: each variable at min(max, 1024)); the
stored entry names them.

Anchors: tinygrad's BEAM (time real candidates on the device, cache the winner by AST) and Triton's
autotune (a small explicit config list, benchmarked, best kept per key).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from .codegen.schedule import Schedule
from .dtypes import FLOAT_FORMATS, to_numpy

if TYPE_CHECKING:
    from .dtypes import DType
    from .device import Device, Program

TUNE_SIZE = 1024        # a symbolic size with no value given is tuned here (within its bounds)
REPEATS = 5             # timed runs per candidate and round (the median counts)
ROUNDS = 3              # interleaved rounds over all accepted candidates; each one's best round counts
MIN_ROUNDS = 2          # rounds taken even when compiling used up the time budget (one round decides nothing)
WARM_SECONDS = 0.25     # untimed passes over the accepted candidates before the rounds, at least this long
SWITCH_MARGIN = 0.03    # a candidate replaces the default only when this much faster (noise is not a win: on the
                        # H100 host's Xeon a search kept a 1024^3 tile 0.70x numpy that its timing had ranked first)


@dataclass
class SearchResult:
    schedule: Schedule                      # the fastest correct candidate (the default if none beat it)
    default: Schedule
    values: dict[str, int]                  # the sizes it was timed at
    times: dict[str, float] = field(default_factory=dict)      # str(schedule) -> best round's median seconds
    rejected: dict[str, str] = field(default_factory=dict)     # str(schedule) -> why (wrong output, error)

    @property
    def speedup(self) -> float:
        return self.times[str(self.default)] / self.times[str(self.schedule)]


def _inputs(info, values: Mapping[str, int], rng: np.random.Generator) -> list[np.ndarray]:
    """Random contents for every buffer, sized from the launch check's index ranges at `values`."""
    _, _, bounds, _ = info.prepare(dict(values))
    sizes = [1] * info.buf_count
    for b in bounds:
        if b is not None:
            sizes[b[0]] = max(sizes[b[0]], b[3] + 1)
    out = []
    for p, n in zip(info.params, sizes):
        dt = np.dtype(np.bool_) if p.dtype.is_bool else to_numpy(p.dtype)
        if dt.kind == "f":
            a = rng.uniform(-1, 1, n).astype(dt)
        elif dt.kind == "b":
            a = rng.integers(0, 2, n).astype(dt)
        else:       # small non-negative ints: index loads (gathers) stay near their tables
            a = rng.integers(1, 4, n).astype(dt)
        out.append(a)
    return out


_MANTISSA = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}


def _same(got: np.ndarray, want: np.ndarray, dt: "DType") -> bool:
    """Whether a candidate's output matches the default schedule's. Floats may differ by the reordering
    of their sums: within 1e-3 relative, or 2 units in the last place of the output type where that is
    coarser (float16 2e-3, bfloat16 1.6e-2, the float8s by their mantissa; sums accumulate in float32,
    so a reordering moves the rounded output by about an ulp). Others compare exactly. numpy sees
    bfloat16 and the float8s as opaque types: `dt` says what they are."""
    if not dt.is_float:
        return bool(np.array_equal(got, want))
    fmt = FLOAT_FORMATS.get(dt.name)
    mant = fmt.man if fmt is not None else _MANTISSA.get(dt.name, 23)
    rtol = max(1e-3, 2 * 2.0 ** -mant)
    g, w = got.astype(np.float64), want.astype(np.float64)
    scale = float(np.nanmax(np.abs(w))) if w.size and np.isfinite(w).any() else 1.0
    return bool(np.allclose(g, w, rtol=rtol, atol=0.1 * rtol * (1.0 + scale), equal_nan=True))


def time_schedules(device: "Device", cands: Sequence[Schedule], load: Callable[[Schedule], "Program"],
                   values: Mapping[str, int] | None = None, seconds: float = 60.0, seed: int = 0) -> SearchResult:
    """Run and time `cands` (the default schedule first) on `device`; `load` compiles and loads one.
    Every candidate runs on the same random inputs; one whose outputs differ from the first's, or that
    fails to compile or launch, is rejected. Candidates after the first are skipped once `seconds`
    have passed."""
    from .buffer import Buffer
    default = cands[0]
    t_start = time.perf_counter()
    prog = load(default)
    info = prog.launch
    want_vals = {k: v for k, v in (values or {}).items() if k in info.var_names}   # static kernels take none
    for v in info.variables:
        want_vals.setdefault(v.name, min(v.max, max(v.min, TUNE_SIZE)))
    vals = info.values_from(want_vals)
    host = _inputs(info, vals, np.random.default_rng(seed))
    bufs = [Buffer.from_numpy(a, device) for a in host]
    written = [p.slot for p in info.params if p.written]
    result = SearchResult(default, default, vals)
    reference: list[np.ndarray] = []
    accepted: list[tuple[Schedule, "Program"]] = []
    try:
        for n, sched in enumerate(cands):
            if n and time.perf_counter() - t_start > seconds:
                result.rejected[str(sched)] = "over the time budget"
                continue
            try:
                p = prog if n == 0 else load(sched)
                for b, a in zip(bufs, host):
                    b.copyin(a)
                p(*bufs, wait=True, **vals)
                outs = [bufs[s].numpy() for s in written]
                if n == 0:
                    reference = outs
                elif not all(_same(g, w, bufs[s].dtype) for g, w, s in zip(outs, reference, written)):
                    result.rejected[str(sched)] = "its outputs differ from the default schedule's"
                    continue
                p(*bufs, wait=True, **vals)
                accepted.append((sched, p))
            except Exception as e:     # a candidate that fails to compile or launch is skipped, not fatal
                if n == 0:
                    raise
                result.rejected[str(sched)] = f"{type(e).__name__}: {e}"[:200]
        # untimed passes over all of them back to back, for at least WARM_SECONDS: the device idled while the
        # later candidates compiled, and clocks ramp up over tens of milliseconds under load, so the first
        # rounds favoured whichever ran later (benchmarks/search_context.py: a search of the H100's 4096^3 matmul kept a candidate
        # its benchmark then measured 2% slower, with one warm pass of 12 ms)
        t_warm = time.perf_counter()
        while True:
            for sched, p in accepted:
                p(*bufs, wait=True, **vals)
            if time.perf_counter() - t_warm >= WARM_SECONDS:
                break
        for r in range(ROUNDS):
            if r >= MIN_ROUNDS and time.perf_counter() - t_start > seconds:
                break
            k = r % len(accepted) if accepted else 0
            for sched, p in accepted[k:] + accepted[:k]:      # each round starts at another candidate
                ts = [t for t in (p(*bufs, wait=True, **vals) for _ in range(REPEATS)) if t is not None]
                t = float(np.median(ts)) if ts else np.inf
                result.times[str(sched)] = min(result.times.get(str(sched), np.inf), t)
    finally:
        for b in bufs:
            b.free()
    best = min((s for s in cands if str(s) in result.times), key=lambda s: result.times[str(s)])
    keep = result.times[str(best)] > (1 - SWITCH_MARGIN) * result.times[str(default)]
    result.schedule = default if keep else best
    return result
