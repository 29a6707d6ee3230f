"""One pass over a kernel AST before any lowering: its buffers, variables, ranges and index arithmetic,
checked well-formed; and the small AST queries every strategy shares."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable, Hashable, Iterator, TypeVar

from ..errors import ArgumentError
from ..dtypes import DType
from ..ir import Ops, UOp, toposort_outside
from .launch_check import Variable
from .linear import ParamInfo


@dataclass
class KernelScan:
    """What both lowering paths (the general one and gpu_tile's) know of a kernel AST before emitting
    anything: its buffers, variables and ranges, checked well-formed, and its index arithmetic."""

    nodes: list[UOp]                        # the AST, sources first
    params: list[ParamInfo]                 # by slot
    variables: list[Variable]               # by name
    ranges: dict[int, UOp]                  # axis -> range, in order of first appearance
    loads_from: dict[int, frozenset[int]]   # id(node) -> slots of the loads it depends on (none: absent)
    index_nodes: set[int]                   # ids of the integer nodes of indices and range ends that
                                            # depend on no load: the launch check proves them in range


# ---- per-AST facts, derived once ------------------------------------------------------------------
# Choosing a schedule and lowering ask the same questions of one kernel several times (its scan, whether
# its reductions read columns, its vector plan): `ast_fact` answers each once per AST object, in the
# node's own __dict__ (where its cached properties live). UOps are immutable and hash-consed, so a fact
# of an AST never changes, and it goes when the AST goes.
_memo_on = True
T = TypeVar("T")
_MISSING = object()


def ast_fact(ast: UOp, key: Hashable, compute: Callable[[], T]) -> T:
    """`compute()`'s answer for (`ast`, `key`), computed once per AST object (an exception is not
    kept). Callers must not mutate what it returns."""
    if not _memo_on:
        return compute()
    facts = ast.__dict__.get("_facts")
    if facts is None:
        facts = ast.__dict__.setdefault("_facts", {})
    hit = facts.get(key, _MISSING)
    if hit is _MISSING:
        hit = facts[key] = compute()
    return hit


@contextlib.contextmanager
def facts_not_remembered() -> Iterator[None]:
    """Every fact computed afresh inside (tests compare rendering with and without the memo)."""
    global _memo_on
    was, _memo_on = _memo_on, False
    try:
        yield
    finally:
        _memo_on = was


def scan_kernel(ast: UOp) -> KernelScan:
    """One pass over `ast` (once per AST: `ast_fact`); ValueError for a kernel no lowering can take (a
    param slot missing or with two dtypes, a variable with two bounds, an axis with two ranges, a range
    end that is not a function of variables and constants). The containers are the caller's own
    copies: the lowering adds the index nodes it builds, a LaunchInfo keeps the params."""
    s = ast_fact(ast, "scan", lambda: _scan_kernel(ast))
    return replace(s, nodes=list(s.nodes), params=list(s.params), variables=list(s.variables),
                   ranges=dict(s.ranges), loads_from=dict(s.loads_from), index_nodes=set(s.index_nodes))


def _scan_kernel(ast: UOp) -> KernelScan:
    nodes = ast.toposort()
    params: dict[int, UOp] = {}
    variables: dict[str, UOp] = {}
    ranges: dict[int, UOp] = {}
    reads, writes = set(), set()
    loads_from: dict[int, frozenset[int]] = {}
    end_loads: dict[UOp, bool] = {}
    for n in nodes:
        if n.op is Ops.PARAM:
            if n.arg in params and params[n.arg] is not n:
                raise ArgumentError(f"param slot {n.arg} is declared with two dtypes: "
                                    f"{params[n.arg].dtype.name} and {n.dtype.name}")
            params[n.arg] = n
        elif n.op is Ops.DEFINE_VAR:
            if n.arg[0] in variables and variables[n.arg[0]] is not n:
                raise ArgumentError(f"variable {n.arg[0]!r} is declared twice with different bounds")
            variables[n.arg[0]] = n
        elif n.op is Ops.RANGE:
            if n.axis in ranges and ranges[n.axis] is not n:
                raise ArgumentError(f"axis {n.axis} is used by two different ranges")
            ranges[n.axis] = n
            if n.src[0].free_ranges or has_load(n.src[0], end_loads):
                raise ArgumentError(f"the end of range {n.axis} must depend only on variables and constants")
        elif n.op is Ops.LOAD:
            reads.add(n.src[0].arg)
        elif n.op is Ops.STORE:
            writes.add(n.src[0].arg)
        loads = frozenset({n.src[0].arg}) if n.op is Ops.LOAD else None
        for src in n.src:
            more = loads_from.get(id(src))
            if more is not None:
                loads = more if loads is None else loads | more
        if loads:
            loads_from[id(n)] = loads
    if sorted(params) != list(range(len(params))):
        raise ArgumentError(f"param slots must be 0..{len(params) - 1} with none missing, got {sorted(params)}")
    # the integer nodes of every load's and store's index and all nodes of every range's end (one walk
    # each, over the union of those subgraphs)
    index_nodes: set[int] = set()
    idx_seen: set[UOp] = set()
    end_seen: set[UOp] = set()
    for n in nodes:
        if n.op is Ops.LOAD or n.op is Ops.STORE:
            new = toposort_outside(n.src[1], idx_seen)
            idx_seen.update(new)
            index_nodes.update(id(u) for u in new if u.dtype is not None and u.dtype.is_int)
        if n.op is Ops.RANGE:
            new = toposort_outside(n.src[0], end_seen)
            end_seen.update(new)
            index_nodes.update(id(u) for u in new)
    # loads inside an index are data: arithmetic above a load is not proven overflow-free
    index_nodes.difference_update(loads_from)
    return KernelScan(nodes,
                      [ParamInfo(s, params[s].dtype, s in reads, s in writes) for s in sorted(params)],
                      [Variable(*variables[k].arg) for k in sorted(variables)],
                      ranges, loads_from, index_nodes)



def has_load(node: UOp, memo: dict[UOp, bool]) -> bool:
    """Whether `node` or a node below it is a LOAD; `memo` keeps the answer of every node walked."""
    hit = memo.get(node)
    if hit is not None:
        return hit
    stack: list[tuple[UOp, bool]] = [(node, False)]
    while stack:
        n, done = stack.pop()
        if done:
            memo[n] = n.op is Ops.LOAD or any(memo[s] for s in n.src)
            continue
        if n in memo:
            continue
        stack.append((n, True))
        stack.extend((s, False) for s in n.src if s not in memo)
    return memo[node]


def x_coefficient(index: UOp, x: UOp) -> int | None:
    """c when index == c*x + (terms free of x), else None."""
    if index is x:
        return 1
    if x not in index.free_ranges:
        return 0
    op = index.op
    if op in (Ops.ADD, Ops.SUB):
        a, b = x_coefficient(index.src[0], x), x_coefficient(index.src[1], x)
        if a is None or b is None:
            return None
        return a + b if op is Ops.ADD else a - b
    if op is Ops.MUL:
        for v, c in (index.src, index.src[::-1]):
            if c.op is Ops.CONST:
                a = x_coefficient(v, x)
                return None if a is None else a * int(c.arg)
        return None
    if op is Ops.NEG:
        a = x_coefficient(index.src[0], x)
        return None if a is None else -a
    return None


def reduce_identity(dt: DType, op: Ops):
    """The value a reduction's accumulator starts from."""
    if op is Ops.ADD:
        ident = 0
    elif op is Ops.MUL:
        ident = 1
    elif op is Ops.MAX:
        ident = dt.min()    # -inf for floats
    elif op is Ops.MIN:
        ident = dt.max()    # +inf for floats
    else:
        raise KeyError(op)
    if dt.is_float:
        return float(ident)
    if dt.is_bool:
        return bool(ident)      # MAX is any (from False), MIN is all (from True)
    return ident


def top_reduces(stores: list[UOp]) -> list[UOp]:
    """REDUCE nodes reachable from the stores without passing through another REDUCE."""
    out: list[UOp] = []
    seen: set[UOp] = set()
    stack = [s for st in stores for s in st.src[1:]]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op is Ops.REDUCE:
            out.append(n)
            continue
        stack.extend(n.src)
    out.reverse()
    return out


def store_groups(stores: list[UOp], loads_from: dict[int, frozenset[int]]) -> list[list[UOp]]:
    """Consecutive stores over the same ranges, none reading a buffer another one writes."""
    groups: list[list[UOp]] = []
    written: set[int] = set()
    read: set[int] = set()
    for st in stores:
        g = groups[-1] if groups else None
        st_reads = loads_from.get(id(st), frozenset())
        if g is not None and g[0].free_ranges == st.free_ranges:
            slot = st.src[0].arg
            if slot not in read and slot not in st_reads and not (written & st_reads):
                g.append(st)
                written.add(slot)
                read |= st_reads
                continue
        groups.append([st])
        written, read = {st.src[0].arg}, set(st_reads)
    return groups


def merged_order(ast: UOp, globals_: list[UOp]) -> list[UOp]:
    """GLOBAL ranges innermost first: the range contiguous in the first store's index, then the others
    from the last axis down."""
    idx = ast.src[0].src[1]
    unit = [r for r in globals_ if x_coefficient(idx, r) == 1]
    inner = unit[-1] if unit else globals_[-1]
    return [inner] + [r for r in reversed(globals_) if r is not inner]


def is_column_reduction(ast: UOp, globals_: tuple[UOp, ...]) -> bool:
    """`_is_column_reduction`, once per (AST, globals)."""
    key = ("column_reduction",) + tuple(id(g) for g in globals_)    # ids: a tuple of UOps compares with ==
    return ast_fact(ast, key, lambda: _is_column_reduction(ast, tuple(globals_)))


def _is_column_reduction(ast: UOp, globals_: tuple[UOp, ...]) -> bool:
    """The kernel's reductions read along columns: with x the GLOBAL range contiguous in the output,
    every load inside a reduction that depends on a reduced range is either contiguous in x and not in
    the reduced ranges (a sum over axis 0; W[k, j] of x @ W) or independent of x (x[b, k]: the same
    address for a whole warp), and at least one is of the first kind. One output per work-item column
    then reads rows in order, neighbouring items neighbouring addresses; a group per output would
    stride across rows."""
    if not globals_:
        return False
    x = merged_order(ast, list(globals_))[0]
    reds = top_reduces(list(ast.src))
    if not reds:
        return False
    columns = 0
    for red in reds:
        for n in red.src[0].toposort():
            if n.op is not Ops.LOAD:
                continue
            rs = [r for r in red.src[1:] if r in n.src[1].free_ranges]
            if not rs:
                continue
            if x not in n.src[1].free_ranges:
                continue                                      # a broadcast along x
            if x_coefficient(n.src[1], x) != 1 or any(x_coefficient(n.src[1], r) == 1 for r in rs):
                return False
            columns += 1
    return columns > 0
