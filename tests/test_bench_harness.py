"""The benchmark harness (benchmarks/harness.py): its wait for a quiet process (settle), used between two
runtimes' interleaved blocks, and its constants block (a heuristic's setting against its alternative)."""
import os
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import harness  # noqa: E402


def test_settle_returns_after_one_window_when_nothing_runs():
    waited = harness.settle(max_s=2.0, window=0.05)
    assert 0.05 <= waited < 0.5


def test_settle_waits_while_another_thread_spins_and_stops_at_its_cap():
    stop = time.perf_counter() + 0.4

    def spin():
        while time.perf_counter() < stop:
            pass
    t = threading.Thread(target=spin)
    t.start()
    waited = harness.settle(max_s=3.0, window=0.05)
    t.join()
    assert 0.3 <= waited < 2.5                  # released by the spinner's end, not by the cap
    stop2 = time.perf_counter() + 5.0

    def spin2():
        while time.perf_counter() < stop2:
            pass
    t2 = threading.Thread(target=spin2, daemon=True)
    t2.start()
    try:
        waited = harness.settle(max_s=0.3, window=0.05)
        assert 0.3 <= waited < 1.0              # a thread that never stops: the cap
    finally:
        stop2 = 0.0
        t2.join(timeout=6)


def test_constants_sets_and_restores_and_turns_the_disk_cache_off(monkeypatch):
    import morok_py.codegen.opt as opt
    import backends.cpu.runtime as rt
    monkeypatch.setenv("MOROK_CACHE", "1")
    before, stream = opt.MERGED_SPARE_REGISTERS, rt.STREAM_MIN_BYTES
    with harness.constants(f"codegen.opt.MERGED_SPARE_REGISTERS={before + 3};backends.cpu.runtime.STREAM_MIN_BYTES=12345"):
        assert opt.MERGED_SPARE_REGISTERS == before + 3 and rt.STREAM_MIN_BYTES == 12345
        # an AST-level disk hit would bring code lowered under the other setting
        assert os.environ["MOROK_CACHE"] == "0"
    assert (opt.MERGED_SPARE_REGISTERS, rt.STREAM_MIN_BYTES) == (before, stream)
    assert os.environ["MOROK_CACHE"] == "1"
    monkeypatch.delenv("MOROK_CACHE")
    with pytest.raises(SystemExit, match="has no NOT_A_CONSTANT"):
        with harness.constants(f"codegen.opt.MERGED_SPARE_REGISTERS={before + 1};codegen.opt.NOT_A_CONSTANT=1"):
            pass
    assert opt.MERGED_SPARE_REGISTERS == before and "MOROK_CACHE" not in os.environ
