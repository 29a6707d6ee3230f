"""Lowering errors: malformed kernels are refused at render time with a message that says why."""
from __future__ import annotations

import pytest

from morok_py import AxisType, UOp, dtypes

f32 = dtypes.float32
x, out = UOp.param(0, f32), UOp.param(1, f32)
i = UOp.range(4, 0)


def render(cpu, ast, name=None):
    renderer, _ = cpu.pair()
    return renderer.render(ast, name)


def test_param_slots_must_have_no_gaps(cpu):
    with pytest.raises(ValueError, match=r"param slots must be 0..1 with none missing, got \[0, 2\]"):
        render(cpu, UOp.sink(UOp.param(2, f32).store(i, x.load(i))))


def test_a_slot_has_one_dtype(cpu):
    ast = UOp.sink(out.store(i, UOp.param(0, dtypes.int32).load(i).cast(f32) + x.load(i)))
    with pytest.raises(ValueError, match="param slot 0 is declared with two dtypes"):
        render(cpu, ast)


def test_an_axis_has_one_range(cpu):
    with pytest.raises(ValueError, match="axis 0 is used by two different ranges"):
        render(cpu, UOp.sink(out.store(i, x.load(UOp.range(5, 0)))))


def test_a_variable_has_one_set_of_bounds(cpu):
    a = UOp.range(UOp.variable("n", 1, 5), 0)
    b = UOp.range(UOp.variable("n", 1, 6), 1)
    with pytest.raises(ValueError, match="variable 'n' is declared twice"):
        render(cpu, UOp.sink(out.store(a, x.load(b))))


def test_range_end_may_not_load_memory(cpu):
    sizes = UOp.param(2, dtypes.int32)
    ast = UOp.sink(out.store(i, x.load(UOp.range(sizes.load(0), 1, AxisType.LOOP))))
    with pytest.raises(ValueError, match="end of range 1 must depend only on variables and constants"):
        render(cpu, ast)


def test_reduce_range_must_be_closed_by_a_reduce(cpu):
    with pytest.raises(ValueError, match="REDUCE range"):
        render(cpu, UOp.sink(out.store(i, x.load(UOp.range(4, 1, AxisType.REDUCE)))))


def test_root_must_be_a_sink(cpu):
    with pytest.raises(TypeError, match="UOp.sink"):
        render(cpu, out.store(i, x.load(i)))


def test_kernel_name_may_be_any_non_empty_string(cpu):
    spec = render(cpu, UOp.sink(out.store(i, x.load(i))), name="1 odd/name")
    assert spec.name == "1 odd/name" and f"@{spec.symbol}(" in spec.src
    for bad in ("", 3, b"x"):
        with pytest.raises(ValueError, match="non-empty str"):
            render(cpu, UOp.sink(out.store(i, x.load(i))), name=bad)


def test_unnamed_kernels_get_a_name_from_their_key(cpu):
    ast = UOp.sink(out.store(i, x.load(i)))
    assert render(cpu, ast).name == "k_" + ast.key[:10]


def test_static_kernels_have_concrete_launch_sizes(cpu):
    spec = render(cpu, UOp.sink(out.store(i, x.load(i))))
    assert spec.global_size is not None and spec.var_names == ()


def test_constant_index_arithmetic_is_folded(cpu):
    # (i + 0) * 1 + 2 * 3 - 6 is just i: the rendered kernel has no multiply left
    idx = (i + 0) * 1 + UOp.const(2) * 3 - 6
    src = render(cpu, UOp.sink(out.store(i, x.load(idx)))).src
    assert " mul " not in src and "mul nsw" not in src


def test_index_bounds_are_known_for_every_access(cpu):
    n = UOp.variable("n", 1, 100)
    r = UOp.range(n, 0)
    spec = render(cpu, UOp.sink(out.store(r, x.load(r * 2 + 1))))
    _, _, bounds, _ = spec.launch.prepare({"n": 10})
    assert sorted(b[1:] for b in bounds) == [(False, 1, 19), (True, 0, 9)]


def test_register_tile_lanes_keep_only_their_extreme_bounds_checks(cpu):
    """Lanes x[base + c] of one buffer in the same loops keep the smallest and largest c: a tiled
    matmul has hundreds, and each costs launch-check and cache-load time."""
    from morok_py.codegen.lower import Access, merge_accesses
    n = UOp.variable("n", 1, 100)
    r = UOp.range(n, 0)
    lanes = [Access(0, False, r * 8 + c, (r,)) for c in (3, 0, 7, 5)]
    other = Access(0, True, r * 8 + 2, (r,))          # a store: its own group
    scaled = [Access(1, False, (r + c) * 4, (r,)) for c in (2, 1, 6)]
    merged = merge_accesses(lanes + [other] + scaled)
    assert [(a.slot, a.store, a.index) for a in merged] == [
        (0, False, r * 8 + 0), (0, False, r * 8 + 7), (0, True, r * 8 + 2), (1, False, (r + 1) * 4),
        (1, False, (r + 6) * 4)]
    assert [a.lanes for a in merged] == [3, 1, 1, 2, 1]        # every lane stays counted
    assert merge_accesses(merged) == merged                    # merging again changes nothing


def test_a_grid_of_tile_lanes_keeps_its_corners_and_a_partial_one_stays_whole(cpu):
    """Rows x columns of a register tile (two constants in one index) keep the four corners; lanes
    that do not fill a grid keep every access; a multiplier known >= 0 (a size variable) keeps the
    bounds monotone, one of unknown sign does not merge."""
    from morok_py.codegen.lower import Access, merge_accesses
    n = UOp.variable("n", 1, 100)
    r = UOp.range(n, 0)
    grid = [Access(0, True, (r * 4 + i) * n + r + j, (r,)) for i in range(4) for j in range(8)]
    merged = merge_accesses(grid)
    assert [a.index for a in merged] == [(r * 4 + i) * n + r + j for i, j in ((0, 0), (0, 7), (3, 0), (3, 7))]
    assert sum(a.lanes for a in merged) == 32
    partial = [Access(0, False, r * 4 + i * n + j, (r,)) for i, j in ((1, 1), (2, 5), (3, 1))]
    assert merge_accesses(partial) == partial
    signed = UOp.variable("s", -5, 5)
    mixed = [Access(1, False, (r + c) * signed, (r,)) for c in range(4)]
    assert merge_accesses(mixed) == mixed


@pytest.mark.parametrize("kernel", ["matmul", "dense", "softmax", "sum_cols", "embedding"])
def test_merged_bounds_checks_decide_as_the_full_set(cpu, monkeypatch, kernel):
    """The merged checks give the same extremes per buffer as every access checked one by one, for
    random variable values, and overflow is found by both."""
    import random
    from morok_py import kernels as K
    from morok_py.codegen import launch_check as LC
    from morok_py.errors import LaunchError
    ast = K.named(kernel)
    merged = render(cpu, ast, "m").launch
    monkeypatch.setattr(LC, "merge_accesses", list)
    full = render(cpu, ast, "f").launch
    assert len(merged.accesses) <= len(full.accesses)
    rng = random.Random(5)
    outcomes = set()

    def extremes(info, values):
        out = {}
        for b in info.prepare(values)[2]:
            if b is not None:
                lo, hi = out.get(b[:2], (b[2], b[3]))
                out[b[:2]] = (min(lo, b[2]), max(hi, b[3]))
        return out

    for trial in range(30):
        big = trial % 10 == 9
        values = {v.name: rng.randint(v.min, min(v.max, 2**20 if big else 300)) for v in full.variables}
        try:
            want = extremes(full, values)
        except LaunchError as e:
            with pytest.raises(LaunchError, match="outside"):
                extremes(merged, values)
            outcomes.add("overflow")
            continue
        assert extremes(merged, values) == want, values
        outcomes.add("checked")
    assert "checked" in outcomes
