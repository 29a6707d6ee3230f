"""A wheel (not only an editable install) must carry every package: each folder with an __init__.py
under morok_py/ and backends/ is listed in pyproject's [tool.setuptools] packages, mapped where it lives."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _setuptools_table() -> tuple[list[str], dict[str, str]]:
    text = (ROOT / "pyproject.toml").read_text()
    packages = ast.literal_eval(re.search(r"^packages\s*=\s*(\[.*?\])", text, re.M | re.S).group(1))
    pdir = re.search(r"^package-dir\s*=\s*\{(.*?)\}", text, re.M | re.S).group(1)
    mapping = dict(re.findall(r'"([\w.]+)"\s*=\s*"([\w/]+)"', pdir))
    return packages, mapping


def _import_name(folder: Path) -> str:
    rel = folder.relative_to(ROOT).parts
    return ".".join(("morok_py",) + rel) if rel[0] == "backends" else ".".join(rel)


def test_every_package_folder_is_in_the_wheel():
    packages, mapping = _setuptools_table()
    found = {_import_name(p.parent) for top in ("morok_py", "backends") for p in (ROOT / top).rglob("__init__.py")}
    missing = sorted(found - set(packages))
    assert not missing, f"pyproject [tool.setuptools] packages lacks {missing}: a wheel install would not have them"
    stale = sorted(set(packages) - found)
    assert not stale, f"pyproject lists packages with no folder: {stale}"


def test_each_listed_package_resolves_to_its_folder():
    packages, mapping = _setuptools_table()
    for pkg in packages:
        parent = max((k for k in mapping if pkg == k or pkg.startswith(k + ".")), key=len)
        folder = ROOT / mapping[parent] / Path(*pkg[len(parent):].lstrip(".").split(".")) if pkg != parent \
            else ROOT / mapping[parent]
        assert (folder / "__init__.py").is_file(), f"{pkg} -> {folder} has no __init__.py"
