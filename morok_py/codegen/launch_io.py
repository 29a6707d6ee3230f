"""LaunchInfo to and from JSON, so a disk-cache hit needs no lowering: `dump` gives a JSON-able
dict, `load` rebuilds a LaunchInfo whose UOps are the same hash-consed nodes. Never pickle.

Anything malformed, of another format or naming an unknown op or dtype is a `LaunchIOError`
(a ValueError); the disk cache treats it as a corrupt entry.
"""
from __future__ import annotations

from typing import Any

from ..dtypes import dtypes
from ..ir import UOp, uops_from_json, uops_to_json
from .linear import ParamInfo
from .launch_check import Access, HiddenBuffer, LaunchInfo, SteppedLoop, Variable

FORMAT = "morok-launch-4"

# every attribute a LaunchInfo has; `dump` refuses one with others (they would be lost silently)
STORED = frozenset({"params", "variables", "dims", "local_size", "gpu", "accesses", "range_ends", "grid_max",
                    "group_per_item", "hidden", "stepped_loops"})
RECORD_FIELDS = STORED | {"format", "uops", "nests"}
DERIVED = frozenset({"var_names", "buf_count", "symbolic"})     # recomputed by LaunchInfo.__init__
INTERNAL = frozenset({"_cache", "_lock", "_has_where"})
KNOWN = STORED | DERIVED | INTERNAL


class LaunchIOError(ValueError):
    """A launch record that cannot be written or read back."""


def unknown_attributes(info: LaunchInfo) -> set[str]:
    return set(vars(info)) - KNOWN


def dump(info: LaunchInfo) -> dict:
    if type(info) is not LaunchInfo:
        raise LaunchIOError(f"launch_io handles LaunchInfo, not {type(info).__name__}")
    extra = unknown_attributes(info)
    if extra:
        raise LaunchIOError(f"LaunchInfo has attribute(s) launch_io does not store: {sorted(extra)}")
    roots: list[UOp] = []
    index: dict[int, int] = {}

    def ref(u: UOp) -> int:
        if id(u) not in index:
            index[id(u)] = len(roots)
            roots.append(u)
        return index[id(u)]

    nests: dict[tuple[int, ...], int] = {}     # distinct enclosing-range tuples: accesses share a few
    accesses: list = []
    for a in info.accesses:                    # flat, 5 per access: a hit parses no list per access
        nest = tuple(ref(r) for r in a.enclosing)
        accesses += [a.slot, a.store, ref(a.index), nests.setdefault(nest, len(nests)), a.lanes]
    out = {
        "format": FORMAT,
        "params": [[p.slot, p.dtype.name, p.read, p.written] for p in info.params],
        "variables": [[v.name, v.min, v.max] for v in info.variables],
        "dims": [ref(d) for d in info.dims],
        "local_size": list(info.local_size),
        "gpu": info.gpu,
        "accesses": accesses,
        "nests": [list(n) for n in nests],
        "range_ends": [ref(r) for r in info.range_ends],
        "grid_max": list(info.grid_max),
        "group_per_item": info.group_per_item,
        "hidden": [[h.dtype.name, h.count] for h in info.hidden],
        # [end, step, start]: UOp references, start null where the work-items start at every value in [0, step)
        "stepped_loops": [[ref(lp.end), ref(lp.step), None if lp.start is None else ref(lp.start)]
                          for lp in info.stepped_loops],
    }
    try:
        out["uops"] = uops_to_json(roots)
    except TypeError as e:
        raise LaunchIOError(str(e)) from None
    return out


def load(d: Any) -> LaunchInfo:
    try:
        return _load(d)
    except LaunchIOError:
        raise
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise LaunchIOError(f"bad launch record: {e}") from None


def _int(x: Any) -> int:
    if type(x) is not int:
        raise LaunchIOError(f"expected an int, got {x!r}")
    return x


def _bool(x: Any) -> bool:
    if type(x) is not bool:
        raise LaunchIOError(f"expected a bool, got {x!r}")
    return x


def _str(x: Any) -> str:
    if type(x) is not str:
        raise LaunchIOError(f"expected a string, got {x!r}")
    return x


def _list(x: Any, n: int | None = None) -> list:
    if type(x) is not list or (n is not None and len(x) != n):
        raise LaunchIOError(f"expected a list{'' if n is None else f' of {n}'}, got {x!r}")
    return x


def _triple(x: Any) -> tuple[int, int, int]:
    a, b, c = (_int(v) for v in _list(x, 3))
    return (a, b, c)


def _load(d: Any) -> LaunchInfo:
    if type(d) is not dict or d.get("format") != FORMAT:
        raise LaunchIOError(f"not a {FORMAT} record")
    if set(d) != RECORD_FIELDS:
        raise LaunchIOError(f"launch record fields {sorted(d)} are not {sorted(RECORD_FIELDS)}")
    uops = uops_from_json(d["uops"])
    n = len(uops)

    def refs(xs: Any) -> list[UOp]:
        if not all(type(i) is int and 0 <= i < n for i in _list(xs)):
            raise LaunchIOError(f"UOp references {xs!r} are outside the table of {n}")
        return [uops[i] for i in xs]

    params = []
    for p in _list(d["params"]):
        slot, dt, read, written = _list(p, 4)
        params.append(ParamInfo(_int(slot), dtypes.from_name(_str(dt)), _bool(read), _bool(written)))
    variables = []
    for v in _list(d["variables"]):
        name, lo, hi = _list(v, 3)
        variables.append(Variable(_str(name), _int(lo), _int(hi)))
    nests = [tuple(refs(n)) for n in _list(d["nests"])]
    flat = _list(d["accesses"])
    if len(flat) % 5:
        raise LaunchIOError(f"the access list has {len(flat)} entries, not 5 per access")
    accesses = []
    for k in range(0, len(flat), 5):    # hundreds in a register-tiled matmul: kept lean
        slot, store, idx, nest, lanes = flat[k:k + 5]
        if type(slot) is not int or type(store) is not bool or type(idx) is not int or not 0 <= idx < n \
                or type(nest) is not int or not 0 <= nest < len(nests) or type(lanes) is not int or lanes < 1:
            raise LaunchIOError(f"bad access {flat[k:k + 5]!r}")
        accesses.append(Access(slot, store, uops[idx], nests[nest], lanes))
    hidden = []
    for h in _list(d["hidden"]):
        dt, count = _list(h, 2)
        hidden.append(HiddenBuffer(dtypes.from_name(_str(dt)), _int(count)))
    stepped = []
    for lp in _list(d["stepped_loops"]):
        end, step, start = _list(lp, 3)
        end_u, step_u = refs([end, step])
        stepped.append(SteppedLoop(end_u, step_u, None if start is None else refs([start])[0]))
    return LaunchInfo(params, variables, refs(d["dims"]), _triple(d["local_size"]), _bool(d["gpu"]), accesses,
                      refs(d["range_ends"]), _triple(d["grid_max"]), group_per_item=_bool(d["group_per_item"]),
                      hidden=hidden, merged=True, stepped_loops=stepped)
