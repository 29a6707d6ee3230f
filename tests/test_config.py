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


def test_split_launch_settings_follow_the_environment_at_every_call(monkeypatch):
    """config.cpu_launch (read by every split CPU launch) keeps its parsed settings only while their raw values
    stay the same: a change is seen at the next call, a bad value is refused at every call (also after a good
    one was kept), and the default thread count is the affinity set's, re-read at most every AFFINITY_RECHECK_S."""
    for name in ("MOROK_CPU_THREADS", "MOROK_CPU_POOL", "MOROK_CPU_SPIN", "MOROK_CPU_PIN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(config, "AFFINITY_RECHECK_S", 0.0)
    assert config.cpu_launch(77) == (len(os.sched_getaffinity(0)), "native", 77, True)
    assert config.cpu_launch(78)[2] == 78
    monkeypatch.setenv("MOROK_CPU_THREADS", "3")
    monkeypatch.setenv("MOROK_CPU_POOL", "python")
    monkeypatch.setenv("MOROK_CPU_SPIN", "5")
    monkeypatch.setenv("MOROK_CPU_PIN", "0")
    assert config.cpu_launch(77) == (3, "python", 5, False)
    monkeypatch.setenv("MOROK_CPU_THREADS", "9")
    assert config.cpu_launch(77) == (9, "python", 5, False)
    for name, bad, message in (("MOROK_CPU_THREADS", "-1", ">= 0"), ("MOROK_CPU_THREADS", "two", "integer"),
                               ("MOROK_CPU_POOL", "fast", "'native' or 'python'"), ("MOROK_CPU_SPIN", "-4", ">= 0"),
                               ("MOROK_CPU_PIN", "2", "'0' or '1'")):
        good = os.environ[name]
        monkeypatch.setenv(name, bad)
        for _ in range(2):
            with pytest.raises(config.ConfigError, match=message):
                config.cpu_launch(77)
        monkeypatch.setenv(name, good)
        assert config.cpu_launch(77) == (9, "python", 5, False)
    # the default count: the affinity set now (recheck 0), then held for AFFINITY_RECHECK_S
    monkeypatch.delenv("MOROK_CPU_THREADS")
    monkeypatch.setattr(config, "_affinity_count", lambda: 6)
    assert config.cpu_launch(77)[0] == 6
    monkeypatch.setattr(config, "AFFINITY_RECHECK_S", 3600.0)
    monkeypatch.setattr(config, "_affinity_count", lambda: 2)
    assert config.cpu_launch(77)[0] == 6
    monkeypatch.setattr(config, "AFFINITY_RECHECK_S", 0.0)
    assert config.cpu_launch(77)[0] == 2
