"""Row cache: in a group-per-row kernel, a row that several passes read (softmax: max, sum, output) is
read from global memory once and kept in shared memory (Schedule.row_cache)."""
from __future__ import annotations

from ...ir import AxisType, Ops, UOp, substitute
from ..scan import KernelScan
from ..linear import If, Instr, Item, L, Loop
from ..scope import Scope

ROW_CACHE_BYTES = 24 * 1024    # shared memory a row kernel may spend keeping rows it reads more than once


def row_cache_plan(ast: UOp, globals_, scan: KernelScan, budget: int = ROW_CACHE_BYTES) -> dict[UOp, tuple[UOp, int]]:
    """LOAD -> (range, key): loads of one read-only buffer whose index differs only in the
    (constant-extent) range its group-strided loop runs over share a key, when at least two do and
    their row fits the shared-memory budget. Empty: nothing to cache."""
    read_only = {p.slot for p in scan.params if p.read and not p.written}
    groups: dict[tuple[int, UOp], list[tuple[UOp, UOp]]] = {}   # (buffer, canonical index) -> its loads
    gl = set(globals_)
    for n in ast.toposort():
        if n.op is not Ops.LOAD or n.src[0].arg not in read_only or n.dtype.is_bool:
            continue
        rs = [r for r in n.free_ranges if r not in gl]
        if len(rs) != 1 or rs[0].src[0].op is not Ops.CONST:
            continue
        r = rs[0]
        # the buffer is part of the key: loads of two buffers at the same index are two rows
        canon = (n.src[0].arg, substitute(n.src[1], {r: UOp.range(r.src[0], -1, AxisType.LOOP)}))
        groups.setdefault(canon, []).append((n, r))
    out: dict[UOp, tuple[UOp, int]] = {}
    for k, members in enumerate(groups.values()):
        if len(members) < 2:
            continue
        extent = members[0][1].src[0].arg
        nbytes = extent * members[0][0].dtype.itemsize
        if nbytes > budget:
            continue
        budget -= nbytes
        for n, r in members:
            out[n] = (r, k)
    return out


class RowCache:
    """Group mode: a row loaded by several passes (softmax reads it for the max, the sum and the
    output) is read from global memory once. The first pass stores what each work-item loaded into a
    shared array, later passes read it back. Every pass strides the same way, so each item reads
    only what it wrote: no barrier is needed."""

    def in_distributed_loop(self, chain: list[Scope], depth: int, r: UOp) -> bool:
        sc = chain[depth]
        return sc.range is r and isinstance(sc.owner, Loop) and sc.owner.step is not None and self.dist is None

    def emit_row_cached(self, node: UOp, srcs: list[Instr], cached: tuple[UOp, int], chain: list[Scope],
                        depth: int) -> Instr:
        """A global load marked with its cache key; `finish_row_cache` decides, in program order
        (not emission order: a pass's reduce may be emitted after the pass that uses it), which load
        fills the shared array and which ones read it."""
        r, key = cached
        if key not in self.row_cache_arrays:
            self.row_cache_arrays[key] = self.new(L.LOCAL, node.dtype, (), r.src[0].arg)
        ins = self.new(L.LOAD, node.dtype, srcs)
        ins.cache = (key, chain[depth].memo[r])   # the loop variable: this item's element of the row
        self.place(ins, chain, depth)
        return ins

    def finish_row_cache(self, body: list[Item]) -> None:
        if not self.row_cache_arrays:
            return
        filled: set[int] = set()
        used: set[int] = set()

        def walk(items: list[Item]) -> None:
            i = 0
            while i < len(items):
                it = items[i]
                if isinstance(it, (Loop, If)):
                    walk(it.body)
                elif it.cache is not None:
                    key, pos = it.cache
                    arr = self.row_cache_arrays[key]
                    if key not in filled:
                        filled.add(key)
                        items.insert(i + 1, self.new(L.STORE, None, (arr, pos, it)))
                        i += 1
                    else:
                        it.src = (arr, pos)
                        used.add(key)
                i += 1
        walk(body)
        for key, arr in self.row_cache_arrays.items():
            if key in used:
                body.insert(0, arr)
            else:       # a single pass survived: nothing reads the array back
                self.strip_fill(body, arr)

    def strip_fill(self, items: list[Item], arr: Instr) -> None:
        for it in list(items):
            if isinstance(it, (Loop, If)):
                self.strip_fill(it.body, arr)
            elif it.kind is L.STORE and it.src[0] is arr:
                items.remove(it)
