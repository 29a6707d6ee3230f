"""Bad input never reaches the device: every launch check raises LaunchError before the launch, on
every device. Each test also checks that the output buffer was left untouched."""
from __future__ import annotations

import numpy as np
import pytest

from morok_py import LaunchError, UOp, dtypes, kernels as K


@pytest.fixture
def add3(device, rng):
    """The symbolic add kernel, its inputs, and an output filled with a sentinel."""
    n = 1003
    a = device.buf(rng.standard_normal(n).astype(np.float32))
    b = device.buf(rng.standard_normal(n).astype(np.float32))
    c = device.buf(np.full(n, 7.0, np.float32))
    return device.compile(K.add()), a, b, c, n


def untouched(buf):
    return bool(np.all(buf.numpy() == 7.0))


def test_wrong_buffer_count(add3):
    prog, a, b, c, n = add3
    with pytest.raises(LaunchError, match="takes 3 buffer"):
        prog(a, b, n=n)
    assert untouched(c)


def test_wrong_dtype(device, add3):
    prog, a, b, c, n = add3
    wrong = device.empty(n, dtypes.float64)
    with pytest.raises(LaunchError, match="float64.*expects float32"):
        prog(a, wrong, c, n=n)
    assert untouched(c)


def test_buffer_too_small(device, add3):
    prog, a, b, c, n = add3
    small = device.buf(np.full(n - 1, 7.0, np.float32))
    with pytest.raises(LaunchError, match=r"store to buffer 2 may touch indices \[0, 1002\].*1002 element"):
        prog(a, b, small, n=n)
    assert untouched(small)


def test_variable_out_of_range(add3):
    prog, a, b, c, n = add3
    with pytest.raises(LaunchError, match=r"n=0 is outside its range \[1, "):
        prog(a, b, c, n=0)
    assert untouched(c)


def test_unknown_variable(add3):
    prog, a, b, c, n = add3
    with pytest.raises(LaunchError, match=r"unknown variable\(s\) \['m'\]"):
        prog(a, b, c, n=n, m=3)
    assert untouched(c)


def test_missing_variable(add3):
    prog, a, b, c, n = add3
    with pytest.raises(LaunchError, match=r"missing value\(s\) for variable\(s\) \['n'\]"):
        prog(a, b, c)
    assert untouched(c)


def test_non_integer_variable(add3):
    prog, a, b, c, n = add3
    with pytest.raises(LaunchError, match="must be an int"):
        prog(a, b, c, n=10.0)


def test_written_buffer_may_not_alias_an_input(add3):
    prog, a, b, c, n = add3
    with pytest.raises(LaunchError, match="alias"):
        prog(a, b, a, n=n)


def test_argument_must_be_a_buffer(add3):
    prog, a, b, c, n = add3
    with pytest.raises(LaunchError, match="must be a Buffer"):
        prog(a, b, np.zeros(n, np.float32), n=n)


def test_index_range_outside_the_buffer(device, rng):
    # out[i] = x[i + 1] reads one past the end of x when x holds exactly n elements
    x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)
    i = UOp.range(UOp.variable("n", 1, 1 << 20), 0)
    prog = device.compile(UOp.sink(out.store(i, x.load(i + 1))))
    n = 100
    o = device.buf(np.full(n, 7.0, np.float32))
    with pytest.raises(LaunchError, match=r"load from buffer 0 may touch indices \[1, 100\].*100 element"):
        prog(device.buf(rng.standard_normal(n).astype(np.float32)), o, n=n)
    assert untouched(o)
    prog(device.buf(rng.standard_normal(n + 1).astype(np.float32)), o, n=n)   # one more element is fine


def test_negative_index_is_refused(device, rng):
    x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)
    i = UOp.range(UOp.variable("n", 1, 1 << 20), 0)
    prog = device.compile(UOp.sink(out.store(i, x.load(i - 1))))
    with pytest.raises(LaunchError, match=r"indices \[-1, "):
        prog(device.buf(rng.standard_normal(8).astype(np.float32)), device.empty(8, dtypes.float32), n=8)


def test_int32_index_overflow(device, rng):
    x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)
    i = UOp.range(UOp.variable("n", 1, 1 << 30), 0)
    prog = device.compile(UOp.sink(out.store(i, x.load((i * 65536) % 7))))
    n = 70000   # i * 65536 passes 2**31 for i >= 32768
    with pytest.raises(LaunchError, match="outside int32"):
        prog(device.buf(rng.standard_normal(7).astype(np.float32)), device.empty(n, dtypes.float32), n=n)


def test_execute_checks_argument_counts(device, add3):
    prog, a, b, c, n = add3
    with pytest.raises(LaunchError):
        prog.execute([a.ptr, b.ptr], [n], *prog.launch.launch_dims({"n": n}))


def test_launch_dims_checks_variable_bounds(device):
    renderer, _ = device.pair()
    spec = renderer.render(K.add(), name="add")
    with pytest.raises(LaunchError, match="outside its range"):
        spec.launch_dims({"n": -5})
