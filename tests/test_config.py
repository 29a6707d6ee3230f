"""morok_py.config reads the environment at each call, through a fast path on POSIX CPython."""
from __future__ import annotations

import os

import pytest

from morok_py import config


def test_every_variable_reads_as_os_environ_has_it():
    for name, value in os.environ.items():
        assert config.getenv(name, "<unset>") == value
    assert config.getenv("MOROK_SURELY_UNSET_NAME", "dflt") == "dflt"


def test_changes_are_seen_at_the_next_read(monkeypatch):
    monkeypatch.setenv("MOROK_CPU_THREADS", "3")
    assert config.cpu_threads() == 3
    monkeypatch.setenv("MOROK_CPU_THREADS", "5")
    assert config.cpu_threads() == 5
    monkeypatch.delenv("MOROK_CPU_THREADS")
    assert config.cpu_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("MOROK_CPU_THREADS", "many")
    with pytest.raises(ValueError, match="MOROK_CPU_THREADS must be an integer, got 'many'"):
        config.cpu_threads()
    monkeypatch.setenv("MOROK_CPU_THREADS", "-2")
    with pytest.raises(ValueError, match="must be >= 0"):
        config.cpu_threads()


def test_values_outside_ascii_round_trip(monkeypatch):
    monkeypatch.setenv("MOROK_CACHE_DIR", "/tmp/caché-ü")
    assert config.getenv("MOROK_CACHE_DIR") == "/tmp/caché-ü" == os.environ["MOROK_CACHE_DIR"]
    monkeypatch.setenv("MOROK_CUDA_COMPILER", "")
    assert config.compiler_choice("cuda") is None
    monkeypatch.setenv("MOROK_CUDA_COMPILER", "nvrtc")
    assert config.compiler_choice("cuda") == "nvrtc"
