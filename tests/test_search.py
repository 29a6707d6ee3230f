"""Schedule search (morok_py/search.py, cache.beam_search, MOROK_BEAM): candidates are timed on the
device and checked against the default schedule's outputs, the winner is stored, a later compile (in a
fresh process too) uses it without timing, and a corrupt stored choice is ignored with a warning."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from morok_py import UOp, cache, dtypes, kernels as K
from morok_py.codegen.schedule import Schedule
from morok_py.search import time_schedules

from conftest import ROOT, random_array


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("MOROK_CACHE_DIR", str(d))
    monkeypatch.delenv("MOROK_CACHE", raising=False)
    monkeypatch.delenv("MOROK_BEAM", raising=False)
    cache.clear_memory_caches()
    return d


def fresh_matmul(M=37, N=29, Kd=23) -> UOp:
    """A matmul no cache has seen: out = (a @ b) * c with a unique c."""
    c = 1.0 + (uuid.uuid4().int % 10**6) / 1e6
    a, b, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32), UOp.param(2, dtypes.float32)
    i, j = UOp.range(M, 0), UOp.range(N, 1)
    from morok_py import AxisType
    k = UOp.range(Kd, 2, AxisType.REDUCE)
    return UOp.sink(out.store(i * N + j, (a.load(i * Kd + k) * b.load(k * N + j)).reduce(k) * c)), c


def check_matmul(cpu, prog, rng, c, M=37, N=29, Kd=23):
    a, b = random_array(rng, (M, Kd), np.float32), random_array(rng, (Kd, N), np.float32)
    out = cpu.empty(M * N, dtypes.float32)
    prog(cpu.buf(a), cpu.buf(b), out, wait=True)
    np.testing.assert_allclose(out.numpy().reshape(M, N), (a.astype(np.float64) @ b) * c, rtol=1e-5, atol=1e-3)


def test_search_times_candidates_and_stores_the_fastest(cpu, cache_dir, rng):
    ast, c = fresh_matmul()
    res = cache.beam_search(cpu.dev, ast, "mm", beam=4, compiler="llvm")
    assert len(res.times) >= 2 and str(res.default) in res.times
    # the fastest, unless it is within the switch margin of the default (then the default stays)
    from morok_py.search import SWITCH_MARGIN
    fastest = min(res.times.values())
    if fastest > (1 - SWITCH_MARGIN) * res.times[str(res.default)]:
        assert res.schedule == res.default
    else:
        assert res.times[str(res.schedule)] == fastest
    renderer, compiler = cpu.pair()
    assert cache.stored_schedule(renderer, compiler, ast) == res.schedule
    # a later compile uses the stored choice: no search, the schedule counted as a hit
    cache.clear_memory_caches()
    searches, hits = cache.stats.searches, cache.stats.schedule_hits
    prog = cpu.compile(ast, "mm")
    assert cache.stats.searches == searches and cache.stats.schedule_hits == hits + 1
    check_matmul(cpu, prog, rng, c)


def test_morok_beam_searches_once_then_uses_the_stored_choice(cpu, cache_dir, rng, monkeypatch):
    ast, c = fresh_matmul()
    monkeypatch.setenv("MOROK_BEAM", "3")
    searches = cache.stats.searches
    check_matmul(cpu, cpu.compile(ast, "mm"), rng, c)
    assert cache.stats.searches == searches + 1
    cache.clear_memory_caches()
    check_matmul(cpu, cpu.compile(ast, "mm"), rng, c)
    assert cache.stats.searches == searches + 1


def test_a_fresh_process_uses_the_stored_choice_without_timing(cpu, cache_dir):
    ast, c = fresh_matmul()
    res = cache.beam_search(cpu.dev, ast, "mm", beam=3, compiler="llvm")
    forced = Schedule("threads", register_tile=(2, 8))       # store a choice no heuristic makes
    renderer, compiler = cpu.pair()
    cache.store_schedule(renderer, compiler, ast, forced, {"values": res.values})
    script = f"""
import json
from morok_py import UOp, AxisType, dtypes, cache
from morok_py.registry import get_device
a, b, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32), UOp.param(2, dtypes.float32)
i, j = UOp.range(37, 0), UOp.range(29, 1)
k = UOp.range(23, 2, AxisType.REDUCE)
ast = UOp.sink(out.store(i * 29 + j, (a.load(i * 23 + k) * b.load(k * 29 + j)).reduce(k) * {c!r}))
get_device("CPU").compile(ast, "mm")
print(json.dumps({{"searches": cache.stats.searches, "hits": cache.stats.schedule_hits}}))
"""
    env = dict(os.environ, MOROK_DEBUG="1", MOROK_BEAM="5", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"searches": 0, "hits": 1}
    assert "mm schedule: Schedule(threads, register_tile=2x8)" in p.stderr


def _stored_paths(cpu, ast) -> tuple[Path, Path]:
    renderer, compiler = cpu.pair()
    key = cache.schedule_key(renderer, compiler, ast)
    root = Path(os.environ["MOROK_CACHE_DIR"])
    return root / key[:2] / f"{key}.bin", root / key[:2] / f"{key}.json"


@pytest.mark.parametrize("how", ["bytes", "text", "refused"])
def test_a_corrupt_stored_schedule_is_ignored_with_a_warning(cpu, cache_dir, rng, how):
    ast, c = fresh_matmul()
    renderer, compiler = cpu.pair()
    if how == "refused":    # a well-formed choice this kernel cannot take (a GPU schedule on the CPU)
        cache.store_schedule(renderer, compiler, ast, Schedule("groups", group=64), {})
    else:
        cache.store_schedule(renderer, compiler, ast, Schedule("threads"), {})
        bin_path, meta_path = _stored_paths(cpu, ast)
        if how == "bytes":
            bin_path.write_bytes(b"\x00garbage")
        else:               # checksum right, content not a schedule
            cache.DiskCache().put(meta_path.stem, b'{"mapping": 3}', {"kind": "schedule",
                                                                      "format": cache.SCHEDULE_FORMAT})
    with pytest.warns(RuntimeWarning, match="schedule"):
        prog = cpu.compile(ast, "mm")
    check_matmul(cpu, prog, rng, c)


def test_a_candidate_whose_outputs_differ_is_rejected(cpu, rng):
    right = cpu.compile(K.add(), "add")
    wrong = cpu.compile(K.binary("mul"), "mul")
    a, b = Schedule("threads"), Schedule("threads", register_tile=(1, 8))   # labels only
    res = time_schedules(cpu.dev, [a, b], lambda s: right if s == a else wrong, {"n": 1001})
    assert res.schedule == a and "differ" in res.rejected[str(b)]


def test_the_time_budget_bounds_the_search(cpu):
    prog = cpu.compile(K.add(), "add")
    cands = [Schedule("threads"), Schedule("threads", register_tile=(1, 8)), Schedule("threads", register_tile=(2, 8))]
    res = time_schedules(cpu.dev, cands, lambda s: prog, {"n": 1 << 12}, seconds=0.0)
    assert list(res.times) == [str(cands[0])]
    assert all(res.rejected[str(s)] == "over the time budget" for s in cands[1:])


@pytest.mark.parametrize("dt,close,far", [
    ("float32", 1 + 5e-4, 1 + 5e-3),
    ("float16", 1 + 2 ** -10, 1 + 2 ** -6),     # an ulp passes, 16 fail
    ("bfloat16", 1 + 2 ** -7, 1 + 2 ** -4),     # likewise in bfloat16's ulps of 2^-7
    ("float8_e4m3fn", 1.125, 1.5),
])
def test_output_comparison_tolerates_reordered_sums_by_the_output_type(dt, close, far):
    """A candidate that sums in another order may differ from the default by a few units in the last
    place of its output type: the comparison scales with that type (numpy sees bfloat16 and the float8s
    as opaque, so the morok dtype decides), and integers compare exactly."""
    from morok_py.search import _same
    from morok_py.dtypes import to_numpy
    d = getattr(dtypes, dt)
    npdt = to_numpy(d)
    base = np.linspace(1, 2, 33, dtype=np.float32)
    want = base.astype(npdt)
    assert _same((base * close).astype(npdt), want, d)
    assert not _same((base * far).astype(npdt), want, d)
    ints = np.arange(10, dtype=np.int32)
    assert _same(ints.copy(), ints, dtypes.int32) and not _same(ints + (ints == 3), ints, dtypes.int32)


class _Clocked:
    """A real program whose reported times come from a script: each call runs the kernel (so outputs are
    checked) and returns the next scripted time, or `base` when the script is used up."""

    def __init__(self, prog, base: float, script=()):
        self.prog, self.launch, self.base, self.script = prog, prog.launch, base, list(script)

    def __call__(self, *args, **kw):
        self.prog(*args, **kw)
        return self.script.pop(0) if self.script else self.base


@pytest.mark.parametrize("cand_time,switch", [(0.99, False), (0.95, True)])
def test_the_default_is_kept_unless_a_candidate_beats_it_by_the_margin(cpu, cand_time, switch):
    from morok_py import search
    prog = cpu.compile(K.add(), "add")
    a, b = Schedule("threads"), Schedule("threads", register_tile=(1, 8))   # labels only
    progs = {str(a): _Clocked(prog, 1.0), str(b): _Clocked(prog, cand_time)}
    res = time_schedules(cpu.dev, [a, b], lambda s: progs[str(s)], {"n": 1001})
    assert res.times == {str(a): 1.0, str(b): cand_time}
    assert res.schedule == (b if switch else a) and 1 - search.SWITCH_MARGIN < 0.99


def test_a_slow_round_does_not_decide(cpu):
    """Rounds interleave the candidates and each keeps its best round: a burst of load during the default's
    first round (every run 5x slower) leaves it the winner it is in the other rounds."""
    from morok_py import search
    prog = cpu.compile(K.add(), "add")
    a, b = Schedule("threads"), Schedule("threads", register_tile=(1, 8))
    # the default's first call checks outputs, the second warms up; then its first round of REPEATS is slow
    slow = [1.0, 1.0] + [5.0] * search.REPEATS
    progs = {str(a): _Clocked(prog, 1.0, slow), str(b): _Clocked(prog, 1.2)}
    res = time_schedules(cpu.dev, [a, b], lambda s: progs[str(s)], {"n": 1001})
    assert search.ROUNDS >= 2 and res.times[str(a)] == 1.0 and res.schedule == a


def test_rounds_follow_a_warm_pass_and_start_at_another_candidate_each_time(cpu):
    """After the outputs are checked, untimed passes run every candidate back to back for WARM_SECONDS (the
    device idled while later candidates compiled); then round r starts at candidate r, so no candidate is
    always timed first; and MIN_ROUNDS rounds run even when the budget is used up."""
    from morok_py import search
    prog = cpu.compile(K.add(), "add")
    a, b = Schedule("threads"), Schedule("threads", register_tile=(1, 8))
    log: list[str] = []

    class Logged(_Clocked):
        def __init__(self, label):
            super().__init__(prog, 1.0)
            self.label = label

        def __call__(self, *args, **kw):
            log.append(self.label)
            return super().__call__(*args, **kw)
    progs = {str(a): Logged("a"), str(b): Logged("b")}
    import time
    t0 = time.perf_counter()
    time_schedules(cpu.dev, [a, b], lambda s: progs[str(s)], {"n": 1001})
    assert time.perf_counter() - t0 >= search.WARM_SECONDS
    R = search.REPEATS
    rounds = sum(([["a"] * R + ["b"] * R, ["b"] * R + ["a"] * R] * search.ROUNDS)[:search.ROUNDS], [])
    warm = log[4:len(log) - len(rounds)]
    assert log[:4] == ["a", "a", "b", "b"] and log[len(log) - len(rounds):] == rounds
    assert warm and warm == ["a", "b"] * (len(warm) // 2)        # whole passes, in order
    log.clear()
    time_schedules(cpu.dev, [a, b], lambda s: progs[str(s)], {"n": 1001}, seconds=0.0)
    rounds = ["a"] * R * search.MIN_ROUNDS
    assert log[:1] == ["a"] and log[len(log) - len(rounds):] == rounds and search.MIN_ROUNDS >= 2
    assert set(log) == {"a"} and len(log) > 1 + len(rounds)
