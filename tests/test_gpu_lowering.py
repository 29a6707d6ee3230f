"""The GPU lowering paths: two-stage grid reductions, 4-wide vector loads/stores with a
scalar tail, and rows kept in shared memory by multi-pass row kernels.

The structural tests render with the real CUDA and ROCm renderers and compile with the real
compilers (no GPU needed); the `cuda` tests run the kernels on a GPU against numpy.
"""
from __future__ import annotations

import numpy as np
import pytest

from morok_py import AxisType, UOp, dtypes, kernels as K
from morok_py.codegen.lower import GRID_REDUCE_GROUPS

from conftest import compile_for_check, open_target, random_array

GPU_PAIRS = [
    pytest.param(("CUDA", "nvrtc"), id="CUDA-nvrtc", marks=pytest.mark.cuda),
    pytest.param(("CUDA", "llvm-nvptx"), id="CUDA-llvm-nvptx", marks=pytest.mark.cuda),
    pytest.param(("ROCM", "llvm-amdgpu"), id="ROCM-llvm-amdgpu", marks=pytest.mark.rocm),
]


@pytest.fixture(params=GPU_PAIRS)
def gpu(request):
    return open_target(*request.param)


def renderers():
    from backends.cuda.device import compile_only_pairs as cuda_pairs
    from backends.rocm.device import compile_only_pairs as rocm_pairs
    # ROCm's second pair (HIP C + hiprtc) has no compiler on this platform; its printer is the CUDA C
    # dialect's (GPUCPrinter), which the nvrtc pair compiles
    return cuda_pairs("sm_90")[:2] + rocm_pairs("gfx942")[:1]     # the MLIR pairs: tests/test_mlir.py


def two_reductions(n=None):
    """out0[0] = sum(x), out1[0] = max(x): two reductions over one range, one grid pass."""
    x, s, m = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32), UOp.param(2, dtypes.float32)
    k = UOp.range(K.size(n, "n"), 0, AxisType.REDUCE)
    v = x.load(k)
    return UOp.sink(s.store(0, v.reduce(k)), m.store(0, v.reduce(k, op=__import__("morok_py").Ops.MAX)))


def normalize(n=None):
    """out[i] = x[i] / sum(x): the pass after the grid reduction runs in the last work-group."""
    x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)
    k = UOp.range(K.size(n, "n"), 0, AxisType.REDUCE)
    i = UOp.range(K.size(n, "n"), 1, AxisType.LOOP)
    return UOp.sink(out.store(i, x.load(i) / x.load(k).reduce(k)))


# ---- structure (no GPU) ----------------------------------------------------------------------------

@pytest.mark.parametrize("pair", range(3), ids=["nvrtc", "llvm-nvptx", "llvm-amdgpu"])
def test_full_reduction_is_split_over_groups_with_hidden_scratch(pair):
    r, c = renderers()[pair]
    spec = r.render(K.sum_all(), "sum")
    info = spec.launch
    assert [(h.dtype, h.count) for h in info.hidden] == [(dtypes.float32, GRID_REDUCE_GROUPS), (dtypes.uint32, 1)]
    assert info.buf_count == 2                     # the caller still passes x and out only
    per_group = r.caps.default_group * 4
    for n, groups in [(1, 1), (per_group, 1), (per_group + 1, 2), (10**6, -(-10**6 // per_group)),
                      (2**28, GRID_REDUCE_GROUPS),
                      # the largest n whose grid-strided loop counter cannot wrap (test_loop_counters.py)
                      (2**31 - GRID_REDUCE_GROUPS * r.caps.default_group, GRID_REDUCE_GROUPS)]:
        gs, ls = info.launch_dims({"n": n})
        assert gs == (groups, 1, 1) and ls == (r.caps.default_group, 1, 1), n
    out = compile_for_check(c, spec)
    assert out.payload


@pytest.mark.parametrize("pair", range(3), ids=["nvrtc", "llvm-nvptx", "llvm-amdgpu"])
def test_elementwise_kernels_use_4_wide_accesses(pair):
    r, c = renderers()[pair]
    spec = r.render(K.add(), "add")
    src = spec.src
    assert ("float4" in src) or ("<4 x float>" in src)
    assert spec.launch_dims({"n": 1003})[0] == (-(-251 // 256), 1, 1)     # ceil(1003 / 4) items
    # a broadcast operand (coefficient 0 along x) stays scalar; the contiguous ones are vectors
    bspec = r.render(K.broadcast_binary("add", [5, 1003], [1, 1003]), "badd")
    assert ("float4" in bspec.src) or ("<4 x float>" in bspec.src)
    compile_for_check(c, spec), compile_for_check(c, bspec)


@pytest.mark.parametrize("pair", range(3), ids=["nvrtc", "llvm-nvptx", "llvm-amdgpu"])
def test_softmax_reads_each_row_from_global_memory_once(pair):
    r, c = renderers()[pair]
    spec = r.render(K.softmax(64, 4096), "softmax")
    loads = [i for i in spec.linear.walk() if i.kind.value == "load" and i.src[0].kind.value == "param"]
    assert len(loads) == 1, spec.linear.dump()
    compile_for_check(c, spec)
    # symbolic columns: the row length is unknown, so no cache (and still three passes over global)
    sym = r.render(K.softmax(), "softmax_sym")
    loads = [i for i in sym.linear.walk() if i.kind.value == "load" and i.src[0].kind.value == "param"]
    assert len(loads) == 3


# ---- on a GPU ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 1023, 1024 * 256 * 4 + 7, 3_000_001])
def test_grid_sum_is_right_on_every_launch(gpu, rng, n):
    """The ticket counter is reset by the last group: the same program stays right launch after launch."""
    prog = gpu.compile(K.sum_all())
    out = gpu.empty(1, dtypes.float32)
    for _ in range(3):
        x = random_array(rng, n, np.float32)
        prog(gpu.buf(x), out, n=n)
        np.testing.assert_allclose(out.numpy()[0], x.astype(np.float64).sum(), rtol=1e-4, atol=1e-3)


def test_grid_reductions_of_int_and_max(gpu, rng):
    n = 2_000_003
    xi = rng.integers(-1000, 1000, size=n).astype(np.int32)
    out = gpu.empty(1, dtypes.int32)
    gpu.compile(K.sum_all(dtype=dtypes.int32))(gpu.buf(xi), out, n=n)
    assert out.numpy()[0] == xi.sum(dtype=np.int64).astype(np.int32)
    x = random_array(rng, n, np.float32)
    outm = gpu.empty(1, dtypes.float32)
    gpu.compile(K.reduce_axis("max", [None], 0))(gpu.buf(x), outm, d0=n)
    assert outm.numpy()[0] == x.max()


def test_two_grid_reductions_in_one_kernel(gpu, rng):
    n = 1_500_017
    x = random_array(rng, n, np.float32)
    s, m = gpu.empty(1, dtypes.float32), gpu.empty(1, dtypes.float32)
    prog = gpu.compile(two_reductions())
    assert len(prog.launch.hidden) == 3          # two partial arrays, one counter
    prog(gpu.buf(x), s, m, n=n)
    np.testing.assert_allclose(s.numpy()[0], x.astype(np.float64).sum(), rtol=1e-4, atol=1e-3)
    assert m.numpy()[0] == x.max()


@pytest.mark.parametrize("n", [5, 300_001])
def test_pass_after_a_grid_reduction(gpu, rng, n):
    x = np.abs(random_array(rng, n, np.float32)) + 0.5
    out = gpu.empty(n, dtypes.float32)
    gpu.compile(normalize())(gpu.buf(x), out, n=n)
    np.testing.assert_allclose(out.numpy(), x / x.astype(np.float64).sum(), rtol=1e-4)


@pytest.mark.parametrize("shape", [(3, 1003), (5, 17), (1, 4), (2, 6)])
def test_vector_path_with_misaligned_rows_and_tails(gpu, rng, shape):
    """Rows of odd length start off a multiple of 4: those items take the scalar path."""
    a = random_array(rng, shape, np.float32)
    b = random_array(rng, (1, shape[1]), np.float32)
    out = gpu.empty(a.size, dtypes.float32)
    gpu.compile(K.broadcast_binary("add", list(shape), [1, shape[1]]))(gpu.buf(a), gpu.buf(b), out)
    np.testing.assert_array_equal(out.numpy().reshape(shape), a + b)


@pytest.mark.parametrize("rows,cols", [(3, 4096), (9, 1000), (2, 1)])
def test_softmax_with_cached_rows(gpu, rng, rows, cols):
    x = random_array(rng, (rows, cols), np.float32) * 4
    e = np.exp(x - x.max(axis=1, keepdims=True))
    out = gpu.empty(rows * cols, dtypes.float32)
    gpu.compile(K.softmax(rows, cols))(gpu.buf(x), out)
    np.testing.assert_allclose(out.numpy().reshape(rows, cols), e / e.sum(axis=1, keepdims=True),
                               rtol=1e-5, atol=1e-6)
