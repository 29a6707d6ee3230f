"""Choosing a schedule analyses a kernel once (scan.ast_fact) and the CPU's lane substitution rebuilds
only what depends on the lane: neither may change what is rendered. Sources with the memo equal
sources without it, on every renderer that can run here, for the named kernels and model-shaped ones."""
from __future__ import annotations

import random

import pytest

from morok_py import AxisType, UOp, dtypes, kernels as K
from morok_py.codegen import scan as scan_mod
from morok_py.codegen.strategies.tile_lanes import _add_built_index_ids, _add_lane_free_index_ids, _substitute_lane
from morok_py.ir import Ops, substitute
from morok_py.registry import get_device


def kernel_set() -> list[tuple[UOp, str]]:
    """Every named kernel, static matmuls and convolutions (register tiles with lanes on the CPU,
    tiles and tensor cores on GPUs), reductions along rows and columns, odd sizes."""
    items = [(K.NAMED[n](), n) for n in sorted(K.NAMED)]
    items += [(K.matmul(67, 45, 29), "matmul_67x45x29"), (K.matmul(128, 96, 64), "matmul_128x96x64"),
              (K.matmul_bias_relu(33, 70, 19), "mm_bias_relu"),
              (K.conv2d(1, 5, 13, 11, 7, 3, 3), "conv_3x3"), (K.conv2d(2, 8, 9, 9, 6, 1, 1), "conv_1x1"),
              (K.reduce_axis("sum", (37, 23), 0), "sum_axis0"), (K.reduce_axis("max", (19, 41), 1), "max_axis1"),
              (K.softmax(7, 33), "softmax_7x33")]
    return items


def renderers():
    out = [pytest.param(lambda: get_device("CPU").renderer, id="CPU")]
    def cuda(i):
        def make():
            pytest.importorskip("cuda.bindings", reason="the cuda extra is not installed (pip install morok-py[cuda])")
            from morok_py.backends.cuda import compile_only_pairs
            return compile_only_pairs("sm_90")[i][0]
        return make
    def rocm():
        from morok_py.backends.rocm import compile_only_pairs
        return compile_only_pairs("gfx90a")[0][0]
    out += [pytest.param(cuda(0), id="CUDA-nvrtc"), pytest.param(cuda(1), id="CUDA-llvm-nvptx"),
            pytest.param(rocm, id="ROCM-llvm-amdgpu")]
    return out


@pytest.mark.parametrize("make", renderers())
def test_sources_with_and_without_the_memo_are_identical(make):
    r = make()
    items = kernel_set()
    with scan_mod.facts_not_remembered():
        plain = [r.render(ast, name).src for ast, name in items]
    cold = [r.render(ast, name).src for ast, name in items]     # facts computed now
    warm = [r.render(ast, name).src for ast, name in items]     # facts read back
    for (_, name), a, b, c in zip(items, plain, cold, warm):
        assert a == b == c, name


def test_a_fact_is_computed_once_per_ast():
    ast = K.softmax(7, 33)
    calls = []
    for _ in range(3):
        assert scan_mod.ast_fact(ast, "probe", lambda: calls.append(1) or 42) == 42
    assert len(calls) == 1
    with scan_mod.facts_not_remembered():
        scan_mod.ast_fact(ast, "probe", lambda: calls.append(1) or 42)
    assert len(calls) == 2


def test_scans_are_the_callers_own():
    """The lowering adds to a scan's index nodes: a second scan of the same AST starts clean."""
    ast = K.matmul(67, 45, 29)
    a = scan_mod.scan_kernel(ast)
    a.index_nodes.add(-1)
    a.params.clear()
    b = scan_mod.scan_kernel(ast)
    assert -1 not in b.index_nodes and b.params and b.nodes == ast.toposort()


def test_column_reduction_memo_matches_the_direct_answer():
    for shape, axis in (((37, 23), 0), ((19, 41), 1), ((5, 6, 7), 1)):
        ast = K.reduce_axis("sum", shape, axis)
        globals_ = tuple(sorted((n for n in ast.toposort() if n.op is Ops.RANGE and n.axis_type is AxisType.GLOBAL),
                                key=lambda r: r.axis))
        assert scan_mod.is_column_reduction(ast, globals_) == scan_mod._is_column_reduction(ast, globals_)


def _random_index(lane: UOp, others: list[UOp], rng: random.Random, depth: int) -> UOp:
    if depth == 0:
        pick = rng.randrange(4)
        if pick == 0:
            return lane
        if pick == 1:
            return UOp.const(rng.randrange(1, 50), dtypes.index)
        return rng.choice(others)
    a, b = _random_index(lane, others, rng, depth - 1), _random_index(lane, others, rng, depth - 1)
    return [a + b, a * UOp.const(rng.randrange(2, 9), dtypes.index), a - b][rng.randrange(3)]


def test_lane_substitution_equals_substitute():
    """The same nodes as ir.substitute, and the index nodes it reports built plus the lane-free ones
    are exactly out.toposort()'s index nodes (LOADs aside): the index nodes the renderer marks stay the
    same."""
    rng = random.Random(7)
    lane = UOp.range(8, 9, AxisType.LOOP)
    others = [UOp.range(n, i, AxisType.GLOBAL) for i, n in enumerate((13, 7, 29))]
    table = UOp.param(0, dtypes.int32)
    for k in range(8):
        memo, built = {}, set()
        c = memo[lane] = UOp.const(k, dtypes.index)
        built.add(id(c))
        for trial in range(40):
            node = _random_index(lane, others, rng, rng.randrange(1, 5))
            if trial % 3 == 0:       # an index that reads memory (a gather)
                node = node + table.load(node).cast(dtypes.index)
            if lane not in node.free_ranges:
                continue
            want = substitute(node, {lane: c})
            got = _substitute_lane(node, lane, memo, built)
            assert got is want
            ids: set[int] = set()
            _add_lane_free_index_ids(node, lane, {lane}, ids)
            _add_built_index_ids(got, built, set(), ids)
            assert ids == {id(n) for n in want.toposort() if n.dtype is dtypes.index and n.op is not Ops.LOAD}


def test_tile_substitution_equals_substitute(monkeypatch):
    """Register tiles share the rebuilt nodes of a row or a column across their stores: each store is
    the very node ir.substitute builds."""
    from morok_py.codegen import opt
    checked = []
    real = opt._tile_substitute

    def check(memo, root, i, j, row, col):
        got = real(memo, root, i, j, row, col)
        assert got is substitute(root, {i: row, j: col})
        checked.append(1)
        return got

    monkeypatch.setattr(opt, "_tile_substitute", check)
    r = get_device("CPU").renderer
    for ast, name in [(K.matmul(67, 45, 29), "mm"), (K.matmul(None, None, None), "mm_symbolic"),
                      (K.matmul_bias_relu(33, 70, 19), "mm_bias_relu"), (K.conv2d(1, 5, 13, 11, 7, 3, 3), "conv")]:
        r.render(ast, name)
    assert checked


def test_rendering_a_kernel_again_gives_the_same_source():
    """Lane substitution keeps what it builds alive for the whole lowering: index nodes are marked by
    the ids of live nodes only, so a freed node's id reused by another cannot add an nsw flag."""
    r = get_device("CPU").renderer
    kernels = [(K.matmul(67, 45, 29), "mm"), (K.matmul_bias_relu(33, 70, 19), "mm_bias_relu"),
               (K.conv2d(1, 5, 13, 11, 7, 3, 3), "conv_3x3"), (K.conv2d(2, 8, 9, 9, 6, 1, 1), "conv_1x1")]
    first = [r.render(ast, name).src for ast, name in kernels]
    for _ in range(3):
        assert [r.render(ast, name).src for ast, name in kernels] == first
