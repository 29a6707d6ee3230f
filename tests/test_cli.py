"""The `morok` command line: devices, demo, compile."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from morok_py import register_backend
from morok_py.cli import main
from morok_py.codegen.symbols import symbol_for

from conftest import ROOT
from test_cpu import other_cpu
from test_validate import altered_cpu

SMALL = ["--batch", "9", "--d-in", "31", "--hidden", "17", "--classes", "5", "--runs", "2"]


def test_devices_lists_cpu_and_gpu_backends(capsys):
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "yes" in lines["CPU"] and "llvm" in lines["CPU"]
    for gpu in ("CUDA:0", "ROCM:0"):
        assert gpu in lines
        assert "yes" in lines[gpu] or "unavailable:" in lines[gpu]


def test_devices_json(capsys):
    import json
    assert main(["devices", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    cpu = next(r for r in rows if r["device"] == "CPU")
    # the llvm pair first; the mlir pair beside it (with why not, where the extra is missing)
    assert cpu["available"] and [c.split()[0] for c in cpu["compilers"]] == ["llvm", "mlir"]
    assert all(r["available"] or r["reason"] for r in rows)


def test_demo_checks_against_numpy_and_prints_a_table(capsys):
    assert main(["demo", *SMALL]) == 0
    out = capsys.readouterr().out
    for col in ("compile cold ms", "disk hit ms", "run us (median)", "throughput"):
        assert col in out
    for kernel in ("matmul x@W1", "bias+relu", "softmax", "row sum", "dense (fused)"):
        assert kernel in out
    assert "MISMATCH" not in out and "GFLOP/s" in out


def test_demo_exits_nonzero_on_a_mismatch(clean_registry, capsys):
    register_backend("BROKENCPU", altered_cpu)
    assert main(["demo", "--device", "BROKENCPU", *SMALL]) == 1
    captured = capsys.readouterr()
    assert "MISMATCH" in captured.out and "FAILED" in captured.err


def test_demo_runs_on_morok_device_via_python_m(tmp_path):
    env = dict(os.environ, MOROK_DEVICE="cpu", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", "morok_py", "demo", *SMALL], capture_output=True, text=True,
                         env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "morok demo on CPU" in res.stdout


@pytest.mark.parametrize("kernel", ["add", "sum", "softmax", "matmul"])
def test_compile_emits_llvm_source(kernel, capsys):
    assert main(["compile", "--emit", "source", kernel]) == 0
    assert f"define void @{symbol_for(kernel)}(" in capsys.readouterr().out


def test_compile_emits_an_object_file(tmp_path, capsys):
    out = tmp_path / "matmul.o"
    assert main(["compile", "--emit", "compiled", "matmul", "-o", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x7fELF"


def test_compile_summarizes_binary_output(capsys):
    assert main(["compile", "--emit", "compiled", "softmax"]) == 0
    out = capsys.readouterr().out
    assert "softmax for CPU" in out and "symbol k_softmax:" in out
    assert "ELF 64-bit relocatable" in out and "functions: k_softmax" in out


def test_compile_for_another_cpu_arch(capsys):
    assert main(["compile", "--arch", other_cpu(), "--emit", "compiled", "add"]) == 0
    assert f"add for CPU {other_cpu()}" in capsys.readouterr().out


def test_compile_unknown_kernel_fails_with_the_known_names(capsys):
    assert main(["compile", "nope"]) == 2
    assert "unknown kernel 'nope'; known: add" in capsys.readouterr().err


def test_compile_unknown_compiler_lists_the_pairs(capsys):
    assert main(["compile", "--compiler", "gcc", "add"]) == 2
    assert "registered: llvm" in capsys.readouterr().err


def test_compile_unknown_device_fails_cleanly(capsys):
    assert main(["compile", "--device", "TPU", "--arch", "v5", "add"]) == 2
    assert "TPU" in capsys.readouterr().err
