"""MOROK_DEBUG levels: 1 kernel names and times, 2 rendered source, 3 compiled output, 4 linear IR.
Everything goes to stderr with a [morok] prefix."""
from __future__ import annotations

import uuid

import numpy as np
import pytest

from morok_py import UOp, dtypes


def fresh_kernel():
    c = float(uuid.uuid4().int % 10**6) + 0.5
    x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)
    i = UOp.range(UOp.variable("n", 1, 1 << 20), 0)
    return UOp.sink(out.store(i, x.load(i) + c))


def compile_and_run(cpu, rng, level, monkeypatch, capfd):
    monkeypatch.setenv("MOROK_DEBUG", str(level))
    prog = cpu.compile(fresh_kernel(), name="dbg")
    prog(cpu.buf(rng.standard_normal(5).astype(np.float32)), cpu.empty(5, dtypes.float32), n=5, wait=True)
    return capfd.readouterr()


def test_level_0_is_silent(cpu, rng, monkeypatch, capfd):
    out = compile_and_run(cpu, rng, 0, monkeypatch, capfd)
    assert "[morok]" not in out.err + out.out


def test_level_1_prints_compiles_and_launch_times(cpu, rng, monkeypatch, capfd):
    err = compile_and_run(cpu, rng, 1, monkeypatch, capfd).err
    assert "[morok] compiled dbg with llvm" in err
    assert "[morok] CPU dbg:" in err and " us" in err
    assert "define void" not in err


def test_level_1_prints_the_schedule(cpu, rng, monkeypatch, capfd):
    err = compile_and_run(cpu, rng, 1, monkeypatch, capfd).err
    assert "[morok] dbg schedule: Schedule(threads)" in err


def test_level_2_prints_the_rendered_source(cpu, rng, monkeypatch, capfd):
    err = compile_and_run(cpu, rng, 2, monkeypatch, capfd).err
    assert "dbg source (CPU)" in err and "define void @k_dbg(" in err   # the name shown, its symbol in the IR
    assert "dbg compiled:" not in err


def test_level_3_prints_the_compiled_output(cpu, rng, monkeypatch, capfd):
    err = compile_and_run(cpu, rng, 3, monkeypatch, capfd).err
    assert "dbg compiled:" in err and "dbg:" in err.split("dbg compiled:")[1]   # the assembly's label
    assert "linear IR" not in err


def test_level_4_prints_the_linear_ir(cpu, rng, monkeypatch, capfd):
    err = compile_and_run(cpu, rng, 4, monkeypatch, capfd).err
    assert "dbg linear IR:" in err and "param[0]" in err


def test_non_integer_level_is_an_error(cpu, rng, monkeypatch):
    monkeypatch.setenv("MOROK_DEBUG", "loud")
    with pytest.raises(ValueError, match="MOROK_DEBUG must be an integer"):
        cpu.compile(fresh_kernel())
