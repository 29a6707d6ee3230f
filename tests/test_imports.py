"""Imports point down the floors (DESIGN.md): no circle among the modules of morok_py/ and backends/.

Every import statement counts, those inside functions and under `if TYPE_CHECKING:` too: a lazy
import is still a dependency, only hidden from import time."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

# Circles owned by another change; each names where it is being undone. Nothing else may be added here.
KNOWN: set[frozenset[str]] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "backends":          # installed as morok_py.backends
        parts = ["morok_py"] + parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for folder in ("morok_py", "backends") for p in sorted((ROOT / folder).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `path` imports. `from pkg import sub` names the submodule, not the
    package (importing any submodule runs the package's __init__; that is no circle of ours)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known}
            out |= subs
            if len(subs) < len(node.names) and mod in known:
                out.add(mod)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_lazy_and_type_checking_imports():
    g = import_graph()
    assert "morok_py.device" in g["morok_py.launch"]
    assert "morok_py.cache" in g["morok_py.launch"]
    assert "morok_py.backends.cuda.runtime" in g["morok_py.backends.cuda.device"]   # imported in functions
    assert "morok_py.config" in g["morok_py.device"]                                 # `from . import config`
    assert "morok_py.device" in g["morok_py.buffer"]                                 # under TYPE_CHECKING


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back():
    found = [sorted(c) for c in circles(import_graph()) if c not in KNOWN]
    assert not found, f"import circles: {found}"


def test_the_contracts_import_only_modules_below_them():
    below = {"morok_py.config", "morok_py.dtypes", "morok_py.errors", "morok_py.ir"}
    g = import_graph()
    for dep in g["morok_py.device"]:
        assert dep in below or dep.startswith("morok_py.codegen."), dep
