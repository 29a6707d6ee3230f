"""Kernel names to symbols. A kernel's name is the user's (any non-empty string: `and`, `/layer1/conv/Conv`,
`kernel.v2`, 300 characters); its symbol is what the compiled output defines and the runtime looks
up. Every renderer, compiler and runtime derives the symbol here, so they always agree.

  - a name of at most 64 ASCII letters, digits and single underscores (none leading) is kept:
    `k_<name>`
    (the prefix keeps it off every C/C++/CUDA keyword and builtin, and off a leading digit);
  - any other name is sanitized (other characters to `_`, runs of `_` folded, at most 64 kept) and
    a hash of the exact name appended: `kh_<sanitized>_<12 hex digits>`.

The two forms start differently (`k_` and `kh_`), so two names get the same symbol only if their
48-bit hashes collide; no symbol contains `__`, which C++ reserves and the CPU's streaming variant
(`<symbol>__stream`) uses. The same name always gives the same symbol, so compiled bytes read back
from the disk cache are looked up under the symbol they were built with.
"""
from __future__ import annotations

import functools
import hashlib
import re

from ..errors import ArgumentError

__all__ = ["check_kernel_name", "symbol_for", "SYMBOL_MAX_BODY"]

SYMBOL_MAX_BODY = 64            # characters of the name kept in the symbol
_HASH_DIGITS = 12
_CLEAN = re.compile(r"[A-Za-z0-9_]+")
_OTHER = re.compile(r"[^A-Za-z0-9]+")


def check_kernel_name(name: object) -> str:
    """`name` if it is a valid kernel name (any non-empty str), else a ValueError saying why."""
    if not isinstance(name, str):
        raise ArgumentError(f"a kernel name must be a non-empty str, got {type(name).__name__} {name!r}")
    if not name:
        raise ArgumentError("a kernel name must be a non-empty str, got ''")
    return name


@functools.lru_cache(maxsize=4096)
def symbol_for(name: str) -> str:
    """The symbol of the kernel named `name`: `[A-Za-z_][A-Za-z0-9_]*`, at most 83 characters."""
    check_kernel_name(name)
    if len(name) <= SYMBOL_MAX_BODY and _CLEAN.fullmatch(name) and "__" not in "k_" + name:
        return "k_" + name
    body = _OTHER.sub("_", name)
    body = re.sub(r"_+", "_", body)[:SYMBOL_MAX_BODY].strip("_")
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_DIGITS]
    return f"kh_{body}_{digest}" if body else f"kh_{digest}"
