"""The documentation cannot drift from the numbers: docs/performance.md is what benchmarks/report.py
makes of the result files, and every result file is a current fact in its place."""
from __future__ import annotations

import importlib.util
import json
import re

from conftest import ROOT

RESULTS = ROOT / "benchmarks" / "results"


def _report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_performance_page_matches_the_result_files():
    page = (ROOT / "docs" / "performance.md").read_text()
    assert page == _report().render(), "docs/performance.md is out of date: run python benchmarks/report.py"


def test_result_files_sit_under_their_machine_kind_with_commit_and_date():
    files = sorted(RESULTS.glob("*/*.json"))
    assert files
    assert not [p for p in RESULTS.iterdir() if p.is_file()], "result files belong in <machine kind>/ folders"
    for f in files:
        doc = json.loads(f.read_text())
        assert doc["benchmark"] == f.stem and doc["machine_kind"] == f.parent.name, f
        assert "commit" in doc and re.fullmatch(r"\d{4}-\d\d-\d\d", doc["date"]), f


def test_machine_kinds_come_from_the_hardware():
    spec = importlib.util.spec_from_file_location("machine", ROOT / "benchmarks" / "machine.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    assert m.gpu_kind("NVIDIA H100 80GB HBM3") == "nvidia-h100"
    assert m.gpu_kind("NVIDIA H200") == "nvidia-h200"
    assert m.gpu_kind("AMD Instinct MI300X", "amd") == "amd-mi300x"
    assert m.cpu_kind("Intel(R) Xeon(R) Processor", {"avx512f", "avx2"}, 16) == "cpu-xeon-avx512-16c"
    assert m.cpu_kind("AMD EPYC 7B12", {"avx2"}, 2) == "cpu-epyc-avx2-2c"
    assert re.fullmatch(r"cpu-[a-z0-9-]+-\d+c", m.machine_kind("CPU"))


def test_docs_links_point_at_files_that_exist():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"
