"""The kernel IR: hash-consing, process-stable keys, operators, dtype promotion, construction errors."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from morok_py import AxisType, Ops, UOp, dtypes, kernels as K
from morok_py.dtypes import ALL, as_dtype, from_numpy

from conftest import ROOT

f32 = dtypes.float32


def test_same_structure_is_the_same_object():
    a = UOp.param(0, f32).load(UOp.range(10, 0)) + 1.0
    b = UOp.param(0, f32).load(UOp.range(10, 0)) + 1.0
    assert a is b


def test_different_structure_is_a_different_object():
    assert UOp.const(1.0) is not UOp.const(2.0)
    assert UOp.param(0, f32) is not UOp.param(0, dtypes.float64)


def test_zero_and_negative_zero_are_different_constants():
    assert UOp.const(0.0) is not UOp.const(-0.0)
    assert UOp.const(0.0).key != UOp.const(-0.0).key


def test_uops_are_immutable():
    u = UOp.const(1)
    with pytest.raises(AttributeError):
        u.arg = 2


def test_uop_has_no_truth_value():
    with pytest.raises(TypeError, match="truth value"):
        bool(UOp.const(1) < 2)


def test_key_is_a_sha256_hex_digest():
    key = K.matmul().key
    assert len(key) == 64 and all(c in "0123456789abcdef" for c in key)


def test_key_is_stable_across_processes():
    code = "from morok_py import kernels as K; print(K.matmul().key, K.softmax().key)"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == [K.matmul().key, K.softmax().key]


def test_key_differs_for_different_kernels():
    assert len({K.add().key, K.binary("sub").key, K.matmul().key, K.add(dtype=dtypes.float64).key}) == 4


@pytest.mark.parametrize("expr,op", [
    (lambda a, b: a + b, Ops.ADD), (lambda a, b: a - b, Ops.SUB), (lambda a, b: a * b, Ops.MUL),
    (lambda a, b: a // b, Ops.IDIV), (lambda a, b: a % b, Ops.MOD), (lambda a, b: a < b, Ops.CMPLT),
    (lambda a, b: a == b, Ops.CMPEQ), (lambda a, b: a != b, Ops.CMPNE), (lambda a, b: a & b, Ops.AND),
    (lambda a, b: a | b, Ops.OR), (lambda a, b: a ^ b, Ops.XOR), (lambda a, b: a << b, Ops.SHL),
    (lambda a, b: a >> b, Ops.SHR), (lambda a, b: a.maximum(b), Ops.MAX),
])
def test_integer_operators_build_their_op(expr, op):
    a = UOp.param(0, dtypes.int32).load(0)
    u = expr(a, a)
    assert u.op is op
    assert u.dtype == (dtypes.bool if op in (Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE) else dtypes.int32)


def test_float_operators_and_math_functions():
    x = UOp.param(0, f32).load(0)
    assert (x / x).op is Ops.FDIV
    assert (-x).op is Ops.NEG
    for fn, op in [("exp2", Ops.EXP2), ("log2", Ops.LOG2), ("sqrt", Ops.SQRT), ("sin", Ops.SIN),
                   ("reciprocal", Ops.RECIP), ("trunc", Ops.TRUNC)]:
        assert getattr(x, fn)().op is op
    assert (x < 0.0).where(x, -x).op is Ops.WHERE
    assert x.cast(dtypes.int32).op is Ops.CAST
    assert x.bitcast(dtypes.uint32).dtype == dtypes.uint32


def test_reflected_operators_put_the_constant_first():
    x = UOp.param(0, f32).load(0)
    u = 2.0 - x
    assert u.op is Ops.SUB and u.src[0].op is Ops.CONST and u.src[0].arg == 2.0


def test_python_constants_adopt_the_uop_dtype():
    x = UOp.param(0, dtypes.int16).load(0)
    assert (x + 3).dtype == dtypes.int16
    assert (UOp.param(0, dtypes.float16).load(0) * 2.0).dtype == dtypes.float16


def test_float_constant_promotes_an_int_value_to_float():
    x = UOp.param(0, dtypes.int32).load(0)
    assert (x + 1.5).dtype.is_float


def test_mixed_dtypes_promote_to_the_wider_or_float_type():
    i8 = UOp.param(0, dtypes.int8).load(0)
    i64 = UOp.param(1, dtypes.int64).load(0)
    f16 = UOp.param(2, dtypes.float16).load(0)
    f64 = UOp.param(3, dtypes.float64).load(0)
    assert (i8 + i64).dtype == dtypes.int64
    assert (i64 + f16).dtype == dtypes.float16
    assert (f16 + f64).dtype == dtypes.float64


def test_true_division_of_ints_gives_float():
    x = UOp.param(0, dtypes.int32).load(0)
    assert (x / x).dtype == f32


def test_every_dtype_maps_to_numpy_and_back():
    for dt in ALL:
        if dt.name == "bfloat16":
            continue   # needs ml_dtypes
        assert from_numpy(dt.np) == dt
        assert as_dtype(dt.name) is dt


def test_bfloat16_exists_in_the_ir():
    assert dtypes.bfloat16.itemsize == 2 and dtypes.bfloat16.is_float


def test_unknown_numpy_dtype_is_rejected():
    with pytest.raises(TypeError, match="no morok_py dtype"):
        from_numpy(np.complex64)


def test_unknown_dtype_name_is_rejected():
    with pytest.raises(ValueError, match="unknown dtype"):
        dtypes.from_name("float8")


# ---- bad construction -----------------------------------------------------------------------

def test_param_slot_must_be_non_negative():
    with pytest.raises(ValueError):
        UOp.param(-1, f32)


def test_variable_bounds_must_be_ordered():
    with pytest.raises(ValueError, match="min <= max"):
        UOp.variable("n", 10, 1)


def test_variable_bounds_must_fit_the_index_type():
    with pytest.raises(ValueError, match="index type"):
        UOp.variable("n", 0, 1 << 40)


def test_variable_name_must_be_an_identifier():
    with pytest.raises(ValueError, match="identifier"):
        UOp.variable("not a name", 0, 1)


def test_int_constant_must_fit_its_dtype():
    with pytest.raises(ValueError, match="does not fit"):
        UOp.const(300, dtypes.uint8)


def test_int_constant_must_be_integral():
    with pytest.raises(TypeError):
        UOp.const(1.5, dtypes.int32)


def test_range_end_must_be_non_negative():
    with pytest.raises(ValueError):
        UOp.range(-1, 0)


def test_range_kind_must_be_an_axis_type():
    with pytest.raises(TypeError):
        UOp.range(4, 0, kind="global")


def test_store_requires_matching_dtype():
    with pytest.raises(TypeError, match="cast it first"):
        UOp.param(0, f32).store(0, UOp.param(1, dtypes.int32).load(0))


def test_load_only_from_a_param():
    with pytest.raises(TypeError):
        UOp.const(1).load(0)


def test_index_must_be_an_integer():
    with pytest.raises(TypeError, match="integer"):
        UOp.param(0, f32).load(UOp.const(1.0))


def test_sink_takes_stores_only():
    with pytest.raises(TypeError):
        UOp.sink(UOp.const(1))
    with pytest.raises(ValueError):
        UOp.sink()


def test_reduce_needs_reduce_ranges():
    x = UOp.param(0, f32)
    with pytest.raises(ValueError, match="AxisType.REDUCE"):
        x.load(UOp.range(4, 0)).reduce(UOp.range(4, 0))
    with pytest.raises(ValueError, match="reduce op"):
        r = UOp.range(4, 0, AxisType.REDUCE)
        x.load(r).reduce(r, op=Ops.SUB)


def test_bitwise_ops_reject_floats():
    x = UOp.param(0, f32).load(0)
    with pytest.raises(TypeError):
        x & x


def test_float_math_rejects_integers():
    with pytest.raises(TypeError, match="needs a float"):
        UOp.param(0, dtypes.int32).load(0).sqrt()


def test_where_needs_a_bool_condition():
    x = UOp.param(0, f32).load(0)
    with pytest.raises(TypeError, match="bool"):
        x.where(x, x)


def test_bitcast_needs_equal_sizes():
    with pytest.raises(TypeError, match="same size"):
        UOp.param(0, f32).load(0).bitcast(dtypes.int64)
