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


def test_onnx_models_chart_draws_a_result_with_and_without_per_process_comparisons(tmp_path):
    """benchmarks/onnx_models.py's chart: a model compared in several processes (a median, a range, a dot each) and
    one compared once (an older record without `interleaved_processes`), each with its cold first run beside
    onnxruntime's; the PNG is written."""
    pytest.importorskip("matplotlib", reason="the chart needs matplotlib (the dev extra)")
    import onnx_models
    ort = {"available": True, "session_s": 0.4, "first_run_s": 0.01, "run_ms_median": 9.5}
    result = {"machine_kind": "cpu-test-2c", "processor": "a CPU", "cpus": 2, "commit": "abc1234", "date": "2026-11-30",
              "models": {
                  "resnet50": {"onnxruntime": ort, "morok_py[default]": {
                      "cold": {"first_run_s": 2.1}, "replay_vs_onnxruntime": 0.95,
                      "interleaved_processes": [{"ratio": r} for r in (0.94, 0.95, 0.98)]}},
                  "mlp": {"onnxruntime": {"available": False}, "morok_py[default]": {
                      "cold": {"first_run_s": 0.3}, "replay_vs_onnxruntime": 1.2}}}}
    png = tmp_path / "onnx_models.png"
    onnx_models.chart(result, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_save_result_writes_the_named_file_or_the_results_tree(tmp_path, monkeypatch):
    """--json PATH: the document as it is at PATH (its folder made); otherwise the results tree's file for the
    machine kind, with the benchmark's name, kind, commit and date first."""
    import json
    doc = {"results": [{"name": "x", "value": 1.5, "path": Path("a")}]}
    path = harness.save_result("demo_bench", doc, str(tmp_path / "sub" / "out.json"))
    assert path == tmp_path / "sub" / "out.json" and json.loads(path.read_text()) == {
        "results": [{"name": "x", "value": 1.5, "path": "a"}]}
    monkeypatch.setattr(harness, "RESULTS", tmp_path / "tree")
    monkeypatch.setattr(harness, "kind_of", lambda dev=None: "cpu-test-kind")
    path = harness.save_result("demo_bench", doc)
    assert path == tmp_path / "tree" / "cpu-test-kind" / "demo_bench.json"
    saved = json.loads(path.read_text())
    assert list(saved)[:4] == ["benchmark", "machine_kind", "commit", "date"] and saved["benchmark"] == "demo_bench"
    assert saved["results"][0]["value"] == 1.5
