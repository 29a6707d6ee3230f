"""float16 and bfloat16 elementwise GPU kernels move 16 bytes per access, as float32 ones do (the target:
half-precision kernels keep the float32 bandwidth). The default schedule widens the vector to 8 halves
when every vector access is 16-bit (`vectorize.widened`), 4 when 16- and 32-bit accesses mix; the C
printers keep half vectors as packed 32-bit words (uint1/uint2/uint4), the LLVM and MLIR printers as
<w x half>. Checked here by rendering and compiling for every GPU pair, by running the kernels in the
test interpreter on odd and misaligned sizes, and on a GPU against numpy."""
from __future__ import annotations

import numpy as np
import pytest

import linear_interp as LI
from conftest import compile_for_check, random_array
from test_gpu_lowering import gpu, renderers  # noqa: F401  (gpu: the CUDA/ROCm pairs fixture)
from morok_py import dtypes
from morok_py import kernels as K
from morok_py.dtypes import to_numpy

HALVES = ["float16", "bfloat16"]
PAIRS = ["nvrtc", "llvm-nvptx", "llvm-amdgpu"]


def _cast_add(dt):
    """out (float32) = float(a) + float(b): 16-bit loads, 32-bit stores."""
    from morok_py import UOp, AxisType
    a, b, o = UOp.param(0, dt), UOp.param(1, dt), UOp.param(2, dtypes.float32)
    i = UOp.range(K.size(None, "n"), 0, AxisType.GLOBAL)
    return UOp.sink(o.store(i, a.load(i).cast(dtypes.float32) + b.load(i).cast(dtypes.float32)))


def _vector_text(src: str, dt: str, w: int) -> bool:
    llvm_t = "half" if dt == "float16" else "bfloat"
    return f"uint{w // 2} " in src or f"<{w} x {llvm_t}>" in src or f"<{w} x i16>" in src


@pytest.mark.parametrize("pair", range(3), ids=PAIRS)
@pytest.mark.parametrize("dt", HALVES)
def test_half_elementwise_kernels_use_16_byte_accesses(pair, dt):
    r, c = renderers()[pair]
    d = getattr(dtypes, dt)
    spec = r.render(K.add(dtype=d), f"add_{dt}")
    assert spec.linear.schedule.vector_width == 8, spec.linear.schedule
    assert _vector_text(spec.src, dt, 8), spec.src[:3000]
    assert spec.launch_dims({"n": 1003})[0] == (-(-126 // 256), 1, 1)     # ceil(1003 / 8) items
    bspec = r.render(K.broadcast_binary("mul", [5, 1003], [1, 1003], dtype=d), f"bmul_{dt}")
    assert bspec.linear.schedule.vector_width == 8 and _vector_text(bspec.src, dt, 8)
    # 16-bit loads and a 32-bit store: 4 wide, so the float32 side stays a float4
    mixed = r.render(_cast_add(d), f"cast_add_{dt}")
    assert mixed.linear.schedule.vector_width == 4 and _vector_text(mixed.src, dt, 4)
    for s in (spec, bspec, mixed):
        assert compile_for_check(c, s).payload


def _bits(x: np.ndarray, dt: str) -> np.ndarray:
    return x.astype(to_numpy(getattr(dtypes, dt)))


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("shape", [(1, 1003), (3, 1001), (2, 9), (1, 8), (4, 3)])
def test_half_vectors_in_the_interpreter(dt, shape, rng):
    """Every lane lands where it belongs, misaligned rows and tails take the scalar path, each output
    element is stored exactly once (the renderer-independent half of the story)."""
    r, _ = renderers()[0]
    d = getattr(dtypes, dt)
    rows, cols = shape
    spec = r.render(K.broadcast_binary("add", [rows, cols], [1, cols], dtype=d), f"badd_{dt}")
    assert spec.linear.schedule.vector_width == 8
    a = _bits(random_array(rng, shape, np.float32), dt)
    b = _bits(random_array(rng, (1, cols), np.float32), dt)
    out = np.zeros(rows * cols, a.dtype)
    writes = LI.run(spec.linear, spec.launch, [a.ravel(), b.ravel(), out])
    assert (writes[2] == 1).all()
    want = _bits(a.astype(np.float32) + b.astype(np.float32), dt)
    np.testing.assert_array_equal(out.reshape(shape).view(np.uint16), want.view(np.uint16))


# ---- on a GPU ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("shape", [(1, 1_000_003), (3, 1003), (5, 17), (2, 6)])
def test_half_vector_kernels_on_the_gpu(gpu, rng, dt, shape):
    d = getattr(dtypes, dt)
    rows, cols = shape
    a = _bits(random_array(rng, shape, np.float32), dt)
    b = _bits(random_array(rng, (1, cols), np.float32), dt)
    out = gpu.empty(a.size, d)
    prog = gpu.compile(K.broadcast_binary("add", list(shape), [1, cols], dtype=d))
    prog(gpu.buf(a), gpu.buf(b), out)
    want = _bits(a.astype(np.float32) + b.astype(np.float32), dt)
    np.testing.assert_array_equal(out.numpy().reshape(shape).view(np.uint16), want.view(np.uint16))
    n = a.size
    f = gpu.empty(n, dtypes.float32)
    gpu.compile(_cast_add(d))(gpu.buf(a), gpu.buf(np.ascontiguousarray(np.broadcast_to(b, shape))), f, n=n)
    np.testing.assert_array_equal(f.numpy(), (a.astype(np.float32) + np.broadcast_to(b, shape).astype(np.float32)).ravel())
