"""The two ways to run a kernel, exactly as the issue writes them: the layered path (render, compile,
load, execute on raw addresses) and the friendly path (compile through the caches, call with Buffers)."""
from __future__ import annotations

import numpy as np
import pytest

import morok_py
from morok_py import (Buffer, CompiledSpec, Device, DeviceSpec, ProgramSpec, UOp, dtypes)


def add_ast():
    n = UOp.variable("n", 1, 1 << 28)
    a, b, c = (UOp.param(i, dtypes.float32) for i in range(3))
    i = UOp.range(n, 0)
    return UOp.sink(c.store(i, a.load(i) + b.load(i)))


def test_layered_path(device, rng):
    dev = device.dev
    renderer, compiler = device.pair()
    ast, n = add_ast(), 1003
    np_a, np_b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    a = dev.buffer(n, dtypes.float32).copyin(np_a)
    b = dev.buffer(n, dtypes.float32).copyin(np_b)
    c = dev.buffer(n, dtypes.float32)

    spec = renderer.render(ast, name="add")
    compiled = compiler.compile(spec)
    program = dev.runtime(compiled)
    gs, ls = spec.launch_dims({"n": n})
    program.execute([a.ptr, b.ptr, c.ptr], [n], gs, ls)
    dev.synchronize()

    np.testing.assert_allclose(c.numpy(), np_a + np_b, rtol=1e-6)


def test_layered_path_on_the_default_pair(rng):
    dev = Device["CPU"]
    ast, n = add_ast(), 7
    a = Buffer.from_numpy(rng.standard_normal(n).astype(np.float32), dev)
    b = Buffer.from_numpy(rng.standard_normal(n).astype(np.float32), dev)
    c = dev.buffer(n, dtypes.float32)
    spec = dev.renderer.render(ast, name="add")
    compiled = dev.compiler.compile(spec)
    program = dev.runtime(compiled)
    gs, ls = spec.launch_dims({"n": n})
    program.execute([a.ptr, b.ptr, c.ptr], [n], gs, ls)
    np.testing.assert_allclose(c.numpy(), a.numpy() + b.numpy(), rtol=1e-6)


def test_render_gives_a_program_spec_with_the_seed_fields():
    dev = Device["CPU"]
    spec = dev.renderer.render(add_ast(), name="add")
    assert isinstance(spec, ProgramSpec)
    assert spec.name == "add" and "add" in spec.src and spec.device == DeviceSpec("CPU")
    assert spec.var_names == ("n",) and spec.vars[0].min == 1 and spec.vars[0].max == 1 << 28
    assert spec.buf_count == 3 and spec.globals == (0, 1, 2) and spec.outs == (2,) and spec.ins == (0, 1)
    assert spec.global_size is None   # symbolic: sizes come from launch_dims(values)


def test_compile_gives_object_bytes_on_cpu():
    dev = Device["CPU"]
    compiled = dev.compiler.compile(dev.renderer.render(add_ast(), name="add"))
    assert isinstance(compiled, CompiledSpec)
    assert compiled.bytes[:4] == b"\x7fELF" and compiled.src is None
    assert compiled.var_names == ("n",) and compiled.buf_count == 3


def test_friendly_path(device, rng):
    dev = device.dev
    n = 1003
    np_a, np_b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    prog = device.compile(add_ast(), name="add")
    a = dev.buffer(n, dtypes.float32).copyin(np_a)
    b = Buffer.from_numpy(np_b, dev)
    c = dev.buffer(n, dtypes.float32)
    seconds = prog(a, b, c, n=n, wait=True)
    assert isinstance(seconds, float) and seconds > 0
    np.testing.assert_allclose(c.numpy(), np_a + np_b, rtol=1e-6)


def test_default_device_is_cpu_unless_morok_device_says_otherwise(monkeypatch):
    monkeypatch.delenv("MOROK_DEVICE", raising=False)
    assert Device.DEFAULT == "CPU"
    monkeypatch.setenv("MOROK_DEVICE", "cuda:1")
    assert Device.DEFAULT == "CUDA:1"


@pytest.mark.parametrize("text,kind,ordinal", [("CPU", "CPU", 0), ("cuda", "CUDA", 0), ("CUDA:1", "CUDA", 1),
                                               ("rocm:0", "ROCM", 0), (" Cuda : 3 ", "CUDA", 3)])
def test_device_spec_parses_case_insensitively(text, kind, ordinal):
    spec = DeviceSpec.parse(text)
    assert (spec.type, spec.ordinal, spec.base_type()) == (kind, ordinal, kind)


def test_device_spec_rejects_garbage():
    with pytest.raises(ValueError, match="cannot parse device"):
        DeviceSpec.parse("CUDA:x")


def test_buffer_round_trips_numpy(device, rng):
    x = rng.standard_normal(1003).astype(np.float32)
    np.testing.assert_array_equal(device.buf(x).numpy(), x)


def test_buffer_copyin_checks_dtype_and_size(cpu):
    buf = cpu.empty(7, dtypes.float32)
    with pytest.raises(TypeError, match="astype"):
        buf.copyin(np.ones(7, np.float64))
    with pytest.raises(ValueError, match="7"):
        buf.copyin(np.ones(8, np.float32))


def test_buffer_to_another_device_copies(cpu, rng):
    x = rng.standard_normal(9).astype(np.float32)
    np.testing.assert_array_equal(cpu.buf(x).to("CPU").numpy(), x)


def test_public_names_are_importable_from_the_package():
    for name in ["DeviceSpec", "Variable", "ProgramSpec", "CompiledSpec", "Renderer", "Compiler", "RuntimeFactory",
                 "Program", "Allocator", "Device", "Buffer", "UOp", "Ops", "AxisType", "dtypes", "ExecutionPlan",
                 "register_backend", "MorokError", "CompileError", "DeviceUnavailableError",
                 "RuntimeStackConflictError", "LaunchError", "DeviceError", "OutOfMemoryError"]:
        assert hasattr(morok_py, name), name
