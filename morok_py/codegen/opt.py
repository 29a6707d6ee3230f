"""AST-level optimizations chosen from a renderer's capabilities, applied before lowering."""
from __future__ import annotations

from ..dtypes import dtypes
from ..ir import AxisType, Ops, UOp, substitute


def _addends(idx: UOp) -> list[UOp]:
    if idx.op is Ops.ADD:
        return _addends(idx.src[0]) + _addends(idx.src[1])
    return [idx]


def _has_reduce(u: UOp) -> bool:
    return any(n.op is Ops.REDUCE for n in u.toposort())


def register_tile(ast: UOp, tile: tuple[int, int]) -> UOp:
    """Register blocking for reductions like matmul (CPU).

    A store over GLOBAL ranges (i, j) whose index has j as a plain addend (unit stride) and whose
    value reduces is split into a main region of ti x tj output tiles -- ti*tj stores whose
    reductions the lowering fuses into one loop with ti*tj accumulators, and whose tj consecutive
    lanes LLVM turns into vector FMAs -- plus two tail regions (leftover columns, leftover rows)
    that run as plain loops. The tile loop over columns is outermost, so each thread keeps its panel
    of the right-hand matrix in cache while it walks the rows.
    """
    ti, tj = tile
    stores = list(ast.src)
    axes = [n.axis for n in ast.toposort() if n.op is Ops.RANGE]
    next_axis = (max(axes) + 1) if axes else 0
    out: list[UOp] = []
    changed = False
    for st in stores:
        buf, idx, val = st.src
        free = st.free_ranges
        globals_ = sorted((r for r in free if r.axis_type is AxisType.GLOBAL), key=lambda r: r.axis)
        if len(globals_) < 2 or any(r.axis_type is AxisType.LOOP for r in free) or not _has_reduce(val):
            out.append(st)
            continue
        adds = _addends(idx)
        unit = [r for r in globals_ if any(a is r for a in adds)]
        if not unit:
            out.append(st)
            continue
        j = unit[-1]
        i = [r for r in globals_ if r is not j][-1]
        M, N = i.src[0], j.src[0]
        base = next_axis
        next_axis += 8
        jo = UOp.range(N // tj, base, AxisType.GLOBAL)      # outermost: the thread split
        io = UOp.range(M // ti, base + 1, AxisType.GLOBAL)
        for a in range(ti):
            for b in range(tj):
                out.append(substitute(st, {i: io * ti + a, j: jo * tj + b}))
        # leftover columns, every row
        il = UOp.range(M, base + 2, AxisType.LOOP)
        jr = UOp.range(N % tj, base + 3, AxisType.LOOP)
        out.append(substitute(st, {i: il, j: (N // tj) * tj + jr}))
        # leftover rows, the tiled columns
        ir = UOp.range(M % ti, base + 4, AxisType.LOOP)
        jl = UOp.range((N // tj) * tj, base + 5, AxisType.LOOP)
        out.append(substitute(st, {i: (M // ti) * ti + ir, j: jl}))
        changed = True
    return UOp.sink(*out) if changed else ast
