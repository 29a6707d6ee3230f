"""32-bit loop counters never wrap.

Loops that step by more than 1 -- group-strided loops of row kernels, grid-strided loops of two-stage
reductions, the k loop of a tiled matmul -- are printed as `i += step` (`add nsw i32`) and exit on
`i < end`: an end within one step of the int32 maximum overflows the counter (undefined behaviour; on
a GPU an endless loop or an out-of-bounds access). The launch check refuses such sizes with a
LaunchError before anything reaches the device, and lets every size below the limit through. Loop ends
are computed in the kernel too, so an end that does not fit int32 is refused as well.

Everything here renders with the real CUDA and ROCm renderers (no GPU, no compiler needed) and the CPU's.
"""
from __future__ import annotations

import json

import pytest

from morok_py import AxisType, LaunchError, Ops, UOp, dtypes, kernels as K
from morok_py.codegen import launch_io
from morok_py.ir import uops_from_json
from morok_py.codegen.linear import Loop
from morok_py.codegen.lower import GRID_REDUCE_GROUPS, Capabilities, Schedule, SteppedLoop, lower
from morok_py.codegen.symbolic import evaluate
from morok_py.device import DeviceSpec

INT_MAX = 2**31 - 1
WRAP = "32-bit counter limit"


def gpu_renderers():
    """(id, renderer): both CUDA pairs and every ROCm pair that renders here (a wave-64 and a wave-32 arch)."""
    from backends.cuda.device import compile_only_pairs as cuda_pairs
    from backends.rocm.device import compile_only_pairs as rocm_pairs
    out = [(f"CUDA-{c.cache_key}", r) for r, c in cuda_pairs("sm_90")]
    out += [(f"ROCM-{c.cache_key}-{arch}", r) for arch in ("gfx942", "gfx1100") for r, c in rocm_pairs(arch)]
    return out


GPU = gpu_renderers()
GPU_IDS = [g[0] for g in GPU]


def cpu_renderer():
    from backends.cpu.renderer import CPURenderer
    return CPURenderer(DeviceSpec.parse("CPU"))


def stepped(items) -> list[Loop]:
    """Every loop of a linear kernel with a step, in program order."""
    out = []
    for it in items:
        if isinstance(it, Loop):
            if it.step is not None:
                out.append(it)
            out += stepped(it.body)
        elif hasattr(it, "body"):
            out += stepped(it.body)
    return out


def refused(info, values) -> str | None:
    """The LaunchError message for these values (from launch_dims and from prepare), or None."""
    try:
        info.launch_dims(values)
    except LaunchError as e:
        with pytest.raises(LaunchError) as again:
            info.prepare(info.values_from(values))
        assert str(again.value) == str(e)
        return str(e)
    info.prepare(info.values_from(values))
    return None


def count_kernel(end: UOp) -> UOp:
    """out[0] = number of iterations of a loop up to `end` (the range is used in no index)."""
    out = UOp.param(0, dtypes.float32)
    k = UOp.range(end, 0, AxisType.REDUCE)
    return UOp.sink(out.store(0, UOp.const(1.0).reduce(k)))


KERNELS = {**{f"named-{n}": f for n, f in K.NAMED.items()},
           "sum_i32": lambda: K.sum_all(dtype=dtypes.int32), "softmax_static": lambda: K.softmax(7, 1000),
           "row_max_cols": lambda: K.row_max(None, 4099), "matmul_odd": lambda: K.matmul(37, 53, 29),
           "matmul_mixed": lambda: K.matmul(None, 61, None)}


# ---- which loops are recorded ----------------------------------------------------------------------

@pytest.mark.parametrize("rid,renderer", GPU, ids=GPU_IDS)
def test_every_stepped_loop_of_a_gpu_kernel_is_recorded(rid, renderer):
    for name, make in KERNELS.items():
        spec = renderer.render(make(), "k")
        # loops over the same bounds (the aligned and scalar variants of a symbolic matmul's k loop share
        # their end, step and start) need one record
        # loops over the same bounds (the aligned and scalar variants of a symbolic matmul's k loop share
        # their end, step and start instructions) may share one record
        loops = stepped(spec.linear.body)
        distinct = {(id(lp.start), id(lp.end), id(lp.step)) for lp in loops}
        assert len(distinct) <= len(spec.launch.stepped_loops) <= len(loops), name
    # the kernels with strided loops have them (the check is not vacuous)
    assert len(renderer.render(K.sum_all(), "s").launch.stepped_loops) == 2     # stage 1 and stage 2
    assert len(renderer.render(K.softmax(), "s").launch.stepped_loops) == 3     # max, sum, output passes
    assert len(renderer.render(K.matmul(), "m").launch.stepped_loops) == 1      # the k loop over full tiles


def test_cpu_kernels_have_no_stepped_loops_and_typical_sizes_launch():
    r = cpu_renderer()
    for name, make in KERNELS.items():
        spec = r.render(make(), "k")
        assert stepped(spec.linear.body) == [] and spec.launch.stepped_loops == (), name
        info = spec.launch
        for pick in (lambda v: v.min, lambda v: min(v.max, max(v.min, 61)), lambda v: min(v.max, max(v.min, 1001))):
            assert refused(info, {v.name: pick(v) for v in info.variables}) is None, name


def test_cpu_sum_still_launches_at_the_largest_size():
    info = cpu_renderer().render(K.sum_all(), "s").launch     # a loop stepping by 1: i + 1 <= n fits
    assert refused(info, {"n": INT_MAX}) is None


# ---- the grid sum (two-stage reduction) ------------------------------------------------------------

@pytest.mark.parametrize("rid,renderer", GPU, ids=GPU_IDS)
def test_grid_sum_refuses_a_size_that_would_wrap_its_counter(rid, renderer):
    info = renderer.render(K.sum_all(), "sum").launch
    stride = GRID_REDUCE_GROUPS * renderer.caps.default_group      # every group's items stride the range
    msg = refused(info, {"n": INT_MAX})
    assert msg is not None and WRAP in msg and "n = 2147483647" in msg and f"steps of {stride}" in msg
    assert "use smaller sizes" in msg
    largest = INT_MAX + 1 - stride                                  # its last step reaches exactly INT_MAX
    assert WRAP in refused(info, {"n": largest + 1})
    assert refused(info, {"n": largest}) is None
    assert info.launch_dims({"n": largest})[0] == (GRID_REDUCE_GROUPS, 1, 1)
    for n in (1, 1003, 10**6, 2**28, 2**30):
        assert refused(info, {"n": n}) is None, n


@pytest.mark.parametrize("rid,renderer", GPU, ids=GPU_IDS)
def test_grid_stride_is_bounded_by_the_group_count_it_launches(rid, renderer):
    """The grid loop's step is the kernel's own expression of n: fewer groups, a smaller stride."""
    info = renderer.render(K.sum_all(), "sum").launch
    grid = next(lp for lp in info.stepped_loops if lp.end.op is Ops.DEFINE_VAR)
    for n in (1, 5000, 10**6, INT_MAX):
        groups = evaluate(info.dims[0], {"n": n})       # what the launch would use
        assert groups <= GRID_REDUCE_GROUPS
        assert grid.peak({"n": n}) == n - 1 + groups * renderer.caps.default_group


# ---- a row kernel (one work-group per row, its items striding the row) -----------------------------

@pytest.mark.parametrize("rid,renderer", GPU, ids=GPU_IDS)
def test_softmax_refuses_a_row_length_that_would_wrap_its_counter(rid, renderer):
    info = renderer.render(K.softmax(), "softmax").launch
    group = renderer.caps.default_group
    msg = refused(info, {"rows": 1, "cols": INT_MAX})
    assert msg is not None and WRAP in msg and "cols = 2147483647" in msg and f"steps of {group}" in msg
    largest = INT_MAX + 1 - group
    assert WRAP in refused(info, {"rows": 1, "cols": largest + 1})
    assert refused(info, {"rows": 1, "cols": largest}) is None
    for rows, cols in ((1, 1), (3, 1000), (4096, 4099), (1000, 10**6)):
        assert refused(info, {"rows": rows, "cols": cols}) is None, (rows, cols)


@pytest.mark.parametrize("rid,renderer", GPU, ids=GPU_IDS)
def test_row_reduction_refuses_a_row_length_that_would_wrap_its_counter(rid, renderer):
    info = renderer.render(K.row_max(1, None), "row_max").launch
    (cols,) = info.var_names
    group = renderer.caps.default_group
    assert WRAP in refused(info, {cols: INT_MAX})
    assert refused(info, {cols: INT_MAX + 1 - group}) is None


# ---- the tiled matmul ------------------------------------------------------------------------------

@pytest.mark.parametrize("rid,renderer", GPU, ids=GPU_IDS)
def test_tiled_matmul_k_loop_cannot_wrap_and_launches_at_the_largest_k(rid, renderer):
    spec = renderer.render(K.matmul(), "mm")
    BK = spec.linear.schedule.matmul_tile[2]     # the caps' BK, doubled on CUDA by the default schedule
    (lp,) = spec.launch.stepped_loops
    assert lp.start is not None and lp.step.arg == BK          # every item starts at 0; full tiles only
    loops = stepped(spec.linear.body)      # symbolic strides: an aligned and a scalar variant of the k loop
    assert 1 <= len(loops) <= 2 and all(lp_.step.arg == BK for lp_ in loops)
    assert len({id(lp_.end) for lp_ in loops}) == 1                   # over the same full tiles
    info = spec.launch
    assert refused(info, {"M": 1, "N": 1, "K": INT_MAX}) is None
    for k in (1, BK - 1, BK, 1000, INT_MAX - BK, INT_MAX):
        assert lp.peak({"M": 1, "N": 1, "K": k}) in (None, k - k % BK)     # the last step lands on k_full <= K
    for m, n, k in ((37, 53, 29), (1000, 999, 97), (4096, 4096, 4096)):
        assert refused(info, {"M": m, "N": n, "K": k}) is None


def test_tiled_matmul_with_a_tile_depth_that_does_not_divide_2_31():
    """BK = 12: the largest multiple of 12 below 2**31 is 2**31 - 8, so `end + step - 1` would refuse
    K >= 2**31 - 8; the counter's real last step (k_full <= K) never passes the limit."""
    caps = Capabilities(has_local=True, has_shared=True, local_max=(1024, 1024, 64), default_group=256,
                        grid_max=(2**31 - 1, 65535, 65535), warp_size=32, group_reduce=True,
                        matmul_tile=(48, 32, 12, 3, 2))
    kernel, info = lower(K.matmul(), caps, "mm", schedule=Schedule("tiled", group=256, matmul_tile=(48, 32, 12, 3, 2)))
    (lp,) = info.stepped_loops
    assert lp.step.arg == 12 and len(stepped(kernel.body)) == 1
    for k in (2**31 - 8, INT_MAX - 1, INT_MAX):
        assert refused(info, {"M": 1, "N": 1, "K": k}) is None
        k_full = k - k % 12
        assert k_full == 2**31 - 8 and k_full + 12 - 1 > INT_MAX      # end + step - 1 alone would refuse it
        assert lp.peak({"M": 1, "N": 1, "K": k}) == k_full


# ---- the exact condition ---------------------------------------------------------------------------

def test_peak_is_the_last_value_the_counter_takes():
    n = UOp.variable("n", -5, INT_MAX)
    spread = SteppedLoop(n, UOp.const(256))              # items start at every value of [0, 256)
    fixed = SteppedLoop(n, UOp.const(12), UOp.const(0))  # every item starts at 0
    for end in (1, 2, 255, 256, 257, 1000):
        last = {s + ((end - 1 - s) // 256) * 256 for s in range(min(256, end))}   # per start, simulated
        assert spread.peak({"n": end}) == max(last) + 256
        assert fixed.peak({"n": end}) == max(range(0, end, 12)) + 12
    for end in (0, -5):
        assert spread.peak({"n": end}) is None and fixed.peak({"n": end}) is None    # no iteration, no step
    assert spread.peak({"n": INT_MAX + 1 - 256}) == INT_MAX
    assert fixed.peak({"n": INT_MAX}) == INT_MAX + 5     # 2**31 + 4: the last multiple of 12 plus 12


# ---- loop ends computed in the kernel --------------------------------------------------------------

def test_a_loop_end_that_does_not_fit_int32_is_refused_on_every_target():
    """n*m is computed in the kernel in int32: 65536 * 32768 = 2**31 would wrap to a negative end (the
    loop would not run: a silently wrong count) -- even though no index uses the range."""
    n, m = UOp.variable("n", 1, INT_MAX), UOp.variable("m", 1, INT_MAX)
    for rid, r in [("CPU", cpu_renderer())] + GPU:
        info = r.render(count_kernel(n * m), "count").launch
        msg = refused(info, {"n": 65536, "m": 32768})
        assert msg is not None and "the loop end n*m = 2147483648 (m=32768, n=65536)" in msg, rid
        assert "outside int32" in msg, rid
        assert refused(info, {"n": 3, "m": 1001}) is None, rid
    assert refused(cpu_renderer().render(count_kernel(n * m), "count").launch, {"n": 65536, "m": 32767}) is None


# ---- launch records --------------------------------------------------------------------------------

def round_trip(info):
    return launch_io.load(json.loads(json.dumps(launch_io.dump(info))))


@pytest.mark.parametrize("rid,renderer", GPU, ids=GPU_IDS)
def test_launch_records_keep_the_stepped_loops(rid, renderer):
    for ast, big in ((K.sum_all(), {"n": INT_MAX}), (K.softmax(), {"rows": 1, "cols": INT_MAX}),
                     (K.matmul(), None)):
        info = renderer.render(ast, "k").launch
        back = round_trip(info)
        assert len(back.stepped_loops) == len(info.stepped_loops) > 0
        for a, b in zip(info.stepped_loops, back.stepped_loops):
            assert a.end is b.end and a.step is b.step               # the same hash-consed UOps
            assert (a.start is None) == (b.start is None) and (a.start is None or a.start is b.start)
        if big is not None:
            assert refused(back, big) == refused(info, big) and WRAP in refused(back, big)
    assert launch_io.FORMAT == "morok-launch-4"


def test_cpu_launch_records_have_no_stepped_loops():
    d = launch_io.dump(cpu_renderer().render(K.sum_all(), "s").launch)
    assert d["stepped_loops"] == []
    assert round_trip(cpu_renderer().render(K.sum_all(), "s").launch).stepped_loops == ()


def corruptions(d: dict):
    """(what, a copy of the record d with its stepped_loops field broken that way)."""
    n = len(uops_from_json(d["uops"]))      # the size of the record's UOp table
    good = d["stepped_loops"][0]
    bad = {
        "not a list": "nope",
        "an entry of 2": [good[:2]],
        "an entry of 4": [good + [None]],
        "an entry that is a dict": [{"end": good[0]}],
        "end just outside the table": [[n, good[1], good[2]]],
        "negative step reference": [[good[0], -1, good[2]]],
        "a bool reference": [[True, good[1], good[2]]],
        "a float reference": [[float(good[0]), good[1], good[2]]],
        "a string start": [[good[0], good[1], "0"]],
        "start outside the table": [[good[0], good[1], n + 7]],
    }
    for what, v in bad.items():
        c = json.loads(json.dumps(d))
        c["stepped_loops"] = v
        yield what, c
    c = json.loads(json.dumps(d))
    del c["stepped_loops"]
    yield "field missing", c
    c = json.loads(json.dumps(d))
    c["format"] = "morok-launch-3"
    yield "the previous format", c


@pytest.mark.parametrize("kernel", ["sum", "matmul"])
def test_a_corrupt_stepped_loop_record_is_a_launch_io_error(kernel):
    from backends.cuda.device import compile_only_pairs
    r = compile_only_pairs("sm_90")[0][0]
    d = launch_io.dump(r.render(K.named(kernel), kernel).launch)
    assert d["stepped_loops"] and (kernel != "matmul" or d["stepped_loops"][0][2] is not None)
    launch_io.load(json.loads(json.dumps(d)))       # the intact record loads
    for what, c in corruptions(d):
        with pytest.raises(launch_io.LaunchIOError):
            launch_io.load(c)
            pytest.fail(f"a record with {what} was accepted")


def test_stepped_loops_are_a_stored_attribute():
    info = cpu_renderer().render(K.add(), "add").launch
    assert "stepped_loops" in launch_io.STORED and not launch_io.unknown_attributes(info)
