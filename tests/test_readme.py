"""The README is a guide that works as written: its Python examples run, it stays short, and its two
commands are the ones CI runs."""
from __future__ import annotations

import re

from conftest import ROOT

README = (ROOT / "README.md").read_text()


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(blocks) >= 2
    scope: dict = {}
    exec(compile("\n".join(blocks), "README.md", "exec"), scope)   # the blocks continue each other
    assert scope["program"].name == "add"
    assert scope["seconds"] > 0


def test_readme_is_a_short_guide_with_its_sections():
    assert len(README.splitlines()) <= 300
    for section in ("## Install", "## The two commands", "## A tour", "## What a graph executor can rely on",
                    "## Configuration", "## Errors"):
        assert section in README, section


def test_the_two_commands_are_the_ones_ci_runs():
    two = README.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```sh\n(.*?)\n```", two, re.S)
    assert commands == ["pip install -e . && morok demo", "pip install -e '.[dev,cuda,rocm,mlir]' && python -m pytest -q"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e \'.[dev,cuda,rocm,mlir]\' && python -m pytest -q "$@"' in ci
