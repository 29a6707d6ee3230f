"""The README's Python examples run as written."""
from __future__ import annotations

import re

from conftest import ROOT


def test_readme_python_examples_run():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 2
    scope: dict = {}
    exec(compile("\n".join(blocks), "README.md", "exec"), scope)   # the blocks continue each other
    assert scope["program"].name == "add"
    assert scope["seconds"] > 0
