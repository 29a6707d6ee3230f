"""Vector loads and stores: an elementwise GPU kernel's work-item covers `width` contiguous elements
of the innermost axis, with w-wide accesses where aligned and a scalar tail (Schedule.vector_width)."""
from __future__ import annotations

from ...dtypes import dtypes
from ...ir import AxisType, Ops, UOp
from ..launch_check import Access
from ..linear import If, Instr, L
from ..scan import KernelScan, ast_fact, store_groups, x_coefficient
from ..scope import Scope

# 32-bit elements as w-vectors (float4 at w=4); 16-bit ones as w-vectors of halves, which the C printers
# keep as packed 32-bit words (uint2 / uint4)
_VECTOR_DTYPES = ("float32", "int32", "uint32", "float16", "bfloat16")


def vector_plan(ast: UOp, globals_, scan: KernelScan, w: int):
    """(x, width, vector loads, vector stores) when every range is GLOBAL, all stores use the
    innermost axis x, and some access is contiguous in x; else None. Once per (AST, globals, w): the
    schedule, its width and the lowering each ask."""
    key = ("vector_plan", w) + tuple(id(g) for g in globals_)
    plan = ast_fact(ast, key, lambda: _vector_plan(ast, globals_, scan, w))
    return None if plan is None else (plan[0], plan[1], list(plan[2]), list(plan[3]))


def _vector_plan(ast: UOp, globals_, scan: KernelScan, w: int):
    if w <= 1 or not globals_ or any(r.axis_type is not AxisType.GLOBAL for r in scan.ranges.values()):
        return None
    stores = list(ast.src)
    x = globals_[-1]
    if len(store_groups(stores, scan.loads_from)) != 1 or any(x not in st.free_ranges for st in stores):
        return None
    ok = lambda dt: dt is not None and dt.name in _VECTOR_DTYPES  # noqa: E731
    loads = [n for n in ast.toposort() if n.op is Ops.LOAD and ok(n.dtype) and x_coefficient(n.src[1], x) == 1]
    vstores = [st for st in stores if ok(st.src[2].dtype) and x_coefficient(st.src[1], x) == 1]
    if not loads and not vstores:
        return None
    return x, w, loads, vstores


def widened(ast: UOp, globals_, scan: KernelScan, w: int) -> int:
    """The vector width for a target whose 32-bit vectors are w wide: 2w when every vector access
    is to 16-bit elements (so each access still moves w * 4 bytes), else w."""
    plan = vector_plan(ast, globals_, scan, w)
    if plan is None:
        return w
    _, _, loads, stores = plan
    sizes = {n.dtype.itemsize for n in loads} | {st.src[2].dtype.itemsize for st in stores}
    return 2 * w if sizes == {2} else w


class Vectorize:

    def lane_scopes(self, owner, r: UOp, base: Instr, w: int, chain: list) -> list[list]:
        """Scope chains for lanes 0..w-1 of a w-wide access inside `owner` (an If or a Loop): lane k sees
        range r as base + k (index math placed in owner's body). Used by the vector plan and by the group
        and grid reductions' 16-byte half loads."""
        idx = dtypes.index
        lanes = []
        for k in range(w):
            sc = Scope(owner.body, r, owner)
            if k == 0:
                sc.memo[r] = base
            else:
                xk = self.new(L.ALU, idx, (base, self.emit(UOp.const(k, idx), chain)), Ops.ADD)
                xk.index_math = True
                owner.body.append(xk)
                sc.memo[r] = xk
            lanes.append(chain + [sc])
        return lanes
    def emit_vectorized(self, stores: list[UOp], chain: list[Scope], plan) -> None:
        """Work-item t covers x in [w*t, w*t + w): when all w lanes are in range and every vector access
        starts on a multiple of w, contiguous accesses are w-wide loads/stores; otherwise each lane runs
        as a scalar (the tail, and rows whose start is not aligned)."""
        x, w, vloads, vstores = plan
        idx = dtypes.index
        g = chain[-1]
        t = self.global_instr[id(x)]
        wc = self.emit(UOp.const(w, idx), chain)
        t4 = self.new(L.ALU, idx, (t, wc), Ops.MUL); t4.index_math = True
        g.insert(t4)
        end = self.emit(x.src[0], chain)
        bscope = Scope(g.items, x)
        bscope.memo[x] = t4
        bchain = chain + [bscope]
        full_end = self.new(L.ALU, idx, (end, self.emit(UOp.const(w - 1, idx), chain)), Ops.SUB)
        cond = self.new(L.ALU, dtypes.bool, (t4, full_end), Ops.CMPLT)
        g.insert(full_end); g.insert(cond)
        mask = self.emit(UOp.const(w - 1, idx), chain)
        zero = self.emit(UOp.const(0, idx), chain)
        bases: dict[UOp, Instr] = {}
        for node in [*vloads, *vstores]:
            b = bases[node] = self.emit(node.src[1], bchain)
            if b is not t4:
                m = self.new(L.ALU, idx, (b, mask), Ops.AND)
                c = self.new(L.ALU, dtypes.bool, (m, zero), Ops.CMPEQ)
                both = self.new(L.ALU, dtypes.bool, (cond, c), Ops.AND)
                for it in (m, c, both):
                    g.insert(it)
                cond = both
        vec_if = If(cond)
        g.insert(vec_if)
        g.open_children.append(vec_if)
        for node in vloads:
            v = self.new(L.LOAD, node.dtype, (self.emit(node.src[0], chain), bases[node]), w)
            vec_if.body.append(v)
            self.vec_loads[node] = v
        lanes = self.lane_scopes(vec_if, x, t4, w, chain)
        vset = set(vstores)
        for st in stores:
            buf, index, val = st.src
            self.record(Access(buf.arg, True, index, self.open_ranges(lanes[0])))
            if st in vset:
                vals = []
                for k in range(w):
                    self.vec_lane = k
                    vals.append(self.emit(val, lanes[k]))
                self.vec_lane = None
                vec = self.new(L.VECTOR, val.dtype, tuple(vals))
                vec_if.body.extend([vec, self.new(L.STORE, None, (self.emit(buf, chain), bases[st], vec), w)])
            else:
                for k in range(w):
                    self.vec_lane = k
                    srcs = (self.emit(buf, chain), self.emit(index, lanes[k]), self.emit(val, lanes[k]))
                    vec_if.body.append(self.new(L.STORE, None, srcs))
                self.vec_lane = None
        g.open_children.pop()
        # the tail: lanes one by one, each guarded
        not_full = self.new(L.ALU, dtypes.bool, (cond, self.new(L.CONST, dtypes.bool, (), True)), Ops.XOR)
        tail = If(not_full)
        g.insert(not_full)
        g.insert(tail)
        g.open_children.append(tail)
        for k in range(w):
            lim = self.new(L.ALU, idx, (end, self.emit(UOp.const(k, idx), chain)), Ops.SUB)
            ck = self.new(L.ALU, dtypes.bool, (t4, lim), Ops.CMPLT)
            lane_if = If(ck)
            tail.body.extend([lim, ck, lane_if])
            sc = Scope(lane_if.body, x, lane_if)
            if k == 0:
                sc.memo[x] = t4
            else:
                xk = self.new(L.ALU, idx, (t4, self.emit(UOp.const(k, idx), chain)), Ops.ADD)
                xk.index_math = True
                lane_if.body.append(xk)
                sc.memo[x] = xk
            lane = chain + [sc]
            for st in stores:
                buf, index, val = st.src
                srcs = (self.emit(buf, chain), self.emit(index, lane), self.emit(val, lane))
                lane_if.body.append(self.new(L.STORE, None, srcs))
        g.open_children.pop()

