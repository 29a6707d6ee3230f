"""Every error the public API raises on purpose for bad input is a MorokError, and keeps the built-in
base (ValueError, TypeError, KeyError, BufferError) that `except` clauses written before it caught."""
from __future__ import annotations

import numpy as np
import pytest

from morok_py import (ArgumentError, ArgumentTypeError, Buffer, BufferFreedError, ConfigError, Device,
                      ExecutionPlan, LaunchError, MorokError, UOp, UnknownNameError, dtypes, kernels as K,
                      register_backend)
from morok_py import config
from morok_py.codegen.schedule import Schedule
from morok_py.dlpack import DLPackError
from morok_py.registry import get_device


def raised(fn, *args, **kwargs) -> BaseException:
    """The exception `fn(*args, **kwargs)` raises (failing the test when it returns)."""
    try:
        fn(*args, **kwargs)
    except Exception as e:      # noqa: BLE001 (the point is to look at any type)
        return e
    pytest.fail(f"{fn} returned instead of raising")


def check(err: BaseException, kind: type, *bases: type) -> None:
    assert isinstance(err, MorokError), f"{type(err).__mro__} is not a MorokError: {err}"
    assert isinstance(err, kind), f"{type(err).__name__} is not a {kind.__name__}: {err}"
    for b in bases:
        assert isinstance(err, b), f"{type(err).__name__} is not a {b.__name__}: {err}"


@pytest.fixture
def dev():
    return get_device("CPU")


@pytest.fixture
def rng():
    return np.random.default_rng(27)


# ---- device and compiler names --------------------------------------------------------------------

@pytest.mark.parametrize("name", ["NOPE", "CPU:1", "CUDA:x", "", "cpu:-1"])
def test_an_unknown_or_malformed_device_name_is_an_unknown_name_error(name):
    check(raised(get_device, name), UnknownNameError, ValueError)


def test_device_subscript_with_an_unknown_name(dev):
    check(raised(lambda: Device["NOPE"]), UnknownNameError, ValueError)
    check(raised(lambda: Device[3]), ArgumentTypeError, TypeError)


def test_an_unknown_compiler_is_an_unknown_name_error(dev):
    check(raised(dev.pair, "gcc"), UnknownNameError, ValueError)
    check(raised(dev.compile, K.add(), compiler="gcc"), UnknownNameError, ValueError)


def test_a_bad_default_device_setting_is_a_config_error(monkeypatch):
    for bad in ("NOPE", "CPU:x:y"):
        monkeypatch.setenv("MOROK_DEVICE", bad)
        check(raised(get_device), ConfigError, ValueError)


def test_a_compiler_setting_naming_no_pair_is_a_config_error(monkeypatch):
    from morok_py.backends.cpu.device import create_device
    from morok_py.device import DeviceSpec
    monkeypatch.setenv("MOROK_CPU_COMPILER", "gcc")
    check(raised(create_device, DeviceSpec("CPU", 0)), ConfigError, ValueError)


def test_register_backend_refuses_bad_names_and_factories():
    check(raised(register_backend, "1st", lambda spec: None), ArgumentError, ValueError)
    check(raised(register_backend, "X", 3), ArgumentTypeError, TypeError)


# ---- environment settings -------------------------------------------------------------------------

@pytest.mark.parametrize("var, value, read", [
    ("MOROK_DEBUG", "loud", config.debug_level),
    ("MOROK_CPU_THREADS", "many", config.cpu_threads),
    ("MOROK_CPU_THREADS", "-3", config.cpu_threads),
    ("MOROK_CPU_POOL", "fibers", config.cpu_pool),
    ("MOROK_CPU_SPIN", "-1", lambda: config.cpu_spin(10)),
])
def test_a_bad_setting_is_a_config_error(monkeypatch, var, value, read):
    monkeypatch.setenv(var, value)
    err = raised(read)
    check(err, ConfigError, ValueError)
    assert var in str(err)


# ---- buffers --------------------------------------------------------------------------------------

def test_buffer_errors(dev, rng):
    check(raised(dev.buffer, -1, dtypes.float32), ArgumentError, ValueError)
    check(raised(dev.buffer, 2.5, dtypes.float32), ArgumentError, ValueError)
    check(raised(dev.buffer, 3, "float33"), ArgumentTypeError, TypeError)
    b = dev.buffer(7, dtypes.float32)
    check(raised(b.copyin, rng.standard_normal(7)), ArgumentTypeError, TypeError)           # float64
    check(raised(b.copyin, rng.standard_normal(8).astype(np.float32)), ArgumentError, ValueError)
    check(raised(b.copy_to, dev.buffer(8, dtypes.float32)), ArgumentError, ValueError)
    check(raised(b.to, "NOPE"), UnknownNameError, ValueError)


def test_a_freed_buffer_is_a_buffer_freed_error_everywhere(dev, rng):
    b = Buffer.from_numpy(rng.standard_normal(9).astype(np.float32), dev)
    other = dev.buffer(9, dtypes.float32)
    b.free()
    for call in (b.numpy, lambda: b.copyin(np.ones(9, np.float32)), lambda: b.copy_to(other),
                 lambda: other.copy_to(b), lambda: b.ptr, b.__dlpack__, lambda: np.from_dlpack(b)):
        check(raised(call), BufferFreedError, LaunchError, ValueError)


# ---- launches and plans ---------------------------------------------------------------------------

def test_launch_errors(dev, rng):
    prog = dev.compile(K.add())
    a, b = (Buffer.from_numpy(rng.standard_normal(13).astype(np.float32), dev) for _ in range(2))
    out = dev.buffer(13, dtypes.float32)
    check(raised(prog, a, b, n=13), LaunchError, ValueError)                               # count
    check(raised(prog, a, b, np.zeros(13, np.float32), n=13), LaunchError, ValueError)     # not a Buffer
    check(raised(prog, a, b, dev.buffer(13, dtypes.int32), n=13), LaunchError, ValueError)  # dtype
    check(raised(prog, a, b, a, n=13), LaunchError, ValueError)                            # aliasing
    check(raised(prog, a, b, out, n=14), LaunchError, ValueError)                          # bounds
    check(raised(prog, a, b, out, n=2.0), LaunchError, ValueError)                         # value type
    check(raised(prog, a, b, out, m=3), LaunchError, ValueError)                           # name
    dead = dev.buffer(13, dtypes.float32)
    dead.free()
    check(raised(prog, a, b, dead, n=13), BufferFreedError, LaunchError, ValueError)


def test_plan_errors(dev, rng):
    prog = dev.compile(K.add())
    a, b = (Buffer.from_numpy(rng.standard_normal(13).astype(np.float32), dev) for _ in range(2))
    out = dev.buffer(13, dtypes.float32)
    check(raised(ExecutionPlan().add, prog, a, b, a, n="N"), LaunchError, ValueError)
    plan = ExecutionPlan().add(prog, a, b, out, n="N")
    check(raised(plan.run), LaunchError, ValueError)
    check(raised(plan.run, N=14), LaunchError, ValueError)
    check(raised(plan.run, N=13, M=1), LaunchError, ValueError)
    out.free()
    err = raised(plan.run, N=13)
    check(err, BufferFreedError, LaunchError, ValueError)
    assert "plan step 0" in str(err)


# ---- dtypes, DLPack -------------------------------------------------------------------------------

def test_dtype_errors():
    from morok_py.dtypes import as_dtype, from_numpy
    check(raised(dtypes.from_name, "float33"), UnknownNameError, ValueError, KeyError)
    check(raised(as_dtype, "float33"), ArgumentTypeError, TypeError)
    check(raised(as_dtype, object()), ArgumentTypeError, TypeError)
    check(raised(from_numpy, np.complex64), ArgumentTypeError, TypeError)


def test_dlpack_errors(dev, rng):
    check(raised(Buffer.from_dlpack, 3), DLPackError, BufferError)
    check(raised(Buffer.from_dlpack, rng.standard_normal((4, 6)).astype(np.float32)[:, ::2]), DLPackError)
    check(raised(Buffer.from_dlpack, np.zeros(3, np.complex64)), DLPackError)
    b = dev.buffer(5, dtypes.float32)
    check(raised(b.__dlpack__, stream=3), DLPackError, BufferError)


# ---- kernel builders, IR, schedules, kernel names -------------------------------------------------

@pytest.mark.parametrize("build, kind", [
    (lambda: K.named("transmogrify"), UnknownNameError),
    (lambda: K.unary("frobnicate"), UnknownNameError),
    (lambda: K.binary("frobnicate"), UnknownNameError),
    (lambda: K.reduce_axis("median", [3, 4], 1), UnknownNameError),
    (lambda: K.reduce_axis("sum", [3, 4], 2), ArgumentError),
    (lambda: K.broadcast_binary("add", [3, 4], [5]), ArgumentError),
    (lambda: K.conv2d(1, 3, 4, 4, 2, 5, 5), ArgumentError),
    (lambda: K.conv2d(1, 3, 8, 8, 2, 3, 3, stride=0), ArgumentError),
    (lambda: K.add(dtype="float33"), ArgumentTypeError),
])
def test_kernel_builder_errors(build, kind):
    check(raised(build), kind)


def test_ir_errors(dev):
    x = UOp.param(0, dtypes.float32)
    i = UOp.range(5, 0)
    check(raised(UOp.const, UOp.const(1)), ArgumentTypeError, TypeError)
    check(raised(UOp.const, 300, dtypes.int8), ArgumentError, ValueError)
    check(raised(UOp.variable, "1n", 1, 4), ArgumentError, ValueError)
    check(raised(UOp.variable, "n", 4, 1), ArgumentError, ValueError)
    check(raised(UOp.param, -1, dtypes.float32), ArgumentError, ValueError)
    check(raised(UOp.sink), ArgumentError, ValueError)
    check(raised(UOp.sink, x.load(i)), ArgumentTypeError, TypeError)
    check(raised(bool, x.load(i)), ArgumentTypeError, TypeError)
    check(raised(lambda: x.load(i) // x.load(i)), ArgumentTypeError, TypeError)
    two_dtypes = UOp.sink(UOp.param(1, dtypes.float32).store(i, UOp.param(0, dtypes.int32).load(i).cast(
        dtypes.float32)), UOp.param(0, dtypes.float32).store(i, UOp.const(1.0)))
    check(raised(dev.compile, two_dtypes), ArgumentError, ValueError)
    check(raised(dev.compile, x.load(i)), ArgumentTypeError, TypeError)
    check(raised(dev.compile, K.add(), ""), ArgumentError, ValueError)
    check(raised(dev.compile, K.add(), 7), ArgumentError, ValueError)


def test_schedule_errors():
    check(raised(Schedule.from_json, "{not json"), ArgumentError, ValueError)
    check(raised(Schedule.from_json, '{"mapping": "sideways"}'), ArgumentError, ValueError)


def test_arch_names_are_unknown_name_errors():
    from morok_py.backends.cuda.compiler import normalize_arch
    from morok_py.backends.rocm.compiler import check_arch
    from morok_py.backends.rocm.renderer import parse_arch
    check(raised(normalize_arch, "sm_x"), UnknownNameError, ValueError)
    check(raised(normalize_arch, 90), ArgumentTypeError, TypeError)
    check(raised(parse_arch, "gfx"), UnknownNameError, ValueError)
    check(raised(check_arch, "gfx9ff"), UnknownNameError, ValueError)
