"""The benchmark harness's wait for a quiet process (benchmarks/harness.py settle), used between two
runtimes' interleaved blocks."""
import sys
import threading
import time
from pathlib import Path

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
