"""Scalar dtypes of the kernel IR and their mapping to numpy, LLVM and C."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ArgumentTypeError, UnknownNameError


@dataclass(frozen=True, eq=True)
class DType:
    """A scalar type: `kind` is 'b' (bool), 'i' (signed), 'u' (unsigned) or 'f' (float)."""

    name: str
    itemsize: int
    kind: str
    llvm: str
    c: str
    narrow: int = 0   # storage-only formats: the value's bits (8, 4, 2), held one element per byte

    def __repr__(self) -> str:
        return f"dtypes.{self.name}"

    @property
    def storage_only(self) -> bool:
        """float8/float4/int4/int2 formats: loaded, stored, selected and cast, never computed on
        directly (cast to float32, float16 or int32 first). One element per byte, as in ml_dtypes."""
        return self.narrow != 0

    @property
    def is_float(self) -> bool:
        return self.kind == "f"

    @property
    def is_int(self) -> bool:
        return self.kind in ("i", "u")

    @property
    def is_unsigned(self) -> bool:
        return self.kind == "u"

    @property
    def is_bool(self) -> bool:
        return self.kind == "b"

    @property
    def bits(self) -> int:
        return 1 if self.kind == "b" else self.narrow or self.itemsize * 8

    @property
    def np(self) -> np.dtype:
        """The numpy dtype with the same bits (bfloat16 needs the ml_dtypes package)."""
        return to_numpy(self)

    def min(self) -> int | float:
        if self.kind == "b":
            return 0
        if self.kind == "u":
            return 0
        if self.kind == "i":
            return -(1 << (self.bits - 1))
        return float("-inf")

    def max(self) -> int | float:
        if self.kind == "b":
            return 1
        if self.kind == "u":
            return (1 << self.bits) - 1
        if self.kind == "i":
            return (1 << (self.bits - 1)) - 1
        return float("inf")


class dtypes:
    """Namespace of the dtypes the IR knows."""

    bool = DType("bool", 1, "b", "i1", "bool")
    int8 = DType("int8", 1, "i", "i8", "signed char")
    int16 = DType("int16", 2, "i", "i16", "short")
    int32 = DType("int32", 4, "i", "i32", "int")
    int64 = DType("int64", 8, "i", "i64", "long long")
    uint8 = DType("uint8", 1, "u", "i8", "unsigned char")
    uint16 = DType("uint16", 2, "u", "i16", "unsigned short")
    uint32 = DType("uint32", 4, "u", "i32", "unsigned int")
    uint64 = DType("uint64", 8, "u", "i64", "unsigned long long")
    float16 = DType("float16", 2, "f", "half", "half")
    bfloat16 = DType("bfloat16", 2, "f", "bfloat", "__nv_bfloat16")
    float32 = DType("float32", 4, "f", "float", "float")
    float64 = DType("float64", 8, "f", "double", "double")
    # storage-only formats (see DType.storage_only and FLOAT_FORMATS)
    float8_e4m3fn = DType("float8_e4m3fn", 1, "f", "i8", "unsigned char", 8)
    float8_e4m3fnuz = DType("float8_e4m3fnuz", 1, "f", "i8", "unsigned char", 8)
    float8_e5m2 = DType("float8_e5m2", 1, "f", "i8", "unsigned char", 8)
    float8_e5m2fnuz = DType("float8_e5m2fnuz", 1, "f", "i8", "unsigned char", 8)
    float8_e8m0fnu = DType("float8_e8m0fnu", 1, "f", "i8", "unsigned char", 8)
    float4_e2m1fn = DType("float4_e2m1fn", 1, "f", "i8", "unsigned char", 4)
    int4 = DType("int4", 1, "i", "i8", "signed char", 4)
    uint4 = DType("uint4", 1, "u", "i8", "unsigned char", 4)
    int2 = DType("int2", 1, "i", "i8", "signed char", 2)
    uint2 = DType("uint2", 1, "u", "i8", "unsigned char", 2)

    # the integer type of ranges, variables and index arithmetic
    index = int32

    @staticmethod
    def all() -> tuple[DType, ...]:
        return ALL

    @staticmethod
    def from_name(name: str) -> DType:
        try:
            return BY_NAME[name]
        except KeyError:
            raise UnknownNameError(f"unknown dtype {name!r}; known: {', '.join(BY_NAME)}") from None

    @staticmethod
    def from_numpy(dt: Any) -> DType:
        return from_numpy(dt)


ALL: tuple[DType, ...] = (
    dtypes.bool, dtypes.int8, dtypes.int16, dtypes.int32, dtypes.int64,
    dtypes.uint8, dtypes.uint16, dtypes.uint32, dtypes.uint64,
    dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64,
    dtypes.float8_e4m3fn, dtypes.float8_e4m3fnuz, dtypes.float8_e5m2, dtypes.float8_e5m2fnuz,
    dtypes.float8_e8m0fnu, dtypes.float4_e2m1fn, dtypes.int4, dtypes.uint4, dtypes.int2, dtypes.uint2,
)
BY_NAME: dict[str, DType] = {d.name: d for d in ALL}


@dataclass(frozen=True)
class FloatFormat:
    """The encoding of a storage-only float: sign bit (or none), `exp` exponent bits with `bias`,
    `man` mantissa bits. `max_code`: the largest finite magnitude's code; `nan`: the code of NaN
    (with the sign bit where `signed_nan`); `inf`: the code of +infinity where the format has one;
    `unsigned_zero`: no negative zero (the sign bit alone is NaN: the *fnuz formats)."""

    exp: int
    man: int
    bias: int
    max_code: int
    nan: int | None
    inf: int | None = None
    signed_nan: bool = True
    unsigned_zero: bool = False
    has_sign: bool = True


FLOAT_FORMATS: dict[str, FloatFormat] = {
    "float8_e4m3fn": FloatFormat(4, 3, 7, 0x7E, 0x7F),
    "float8_e4m3fnuz": FloatFormat(4, 3, 8, 0x7F, 0x80, signed_nan=False, unsigned_zero=True),
    "float8_e5m2": FloatFormat(5, 2, 15, 0x7B, 0x7E, inf=0x7C),
    "float8_e5m2fnuz": FloatFormat(5, 2, 16, 0x7F, 0x80, signed_nan=False, unsigned_zero=True),
    # no sign, no zero: 2**(e - 127), 0xFF is NaN
    "float8_e8m0fnu": FloatFormat(8, 0, 127, 0xFE, 0xFF, signed_nan=False, has_sign=False),
    # no NaN, no infinity: ml_dtypes turns NaN into -0 and saturates overflow
    "float4_e2m1fn": FloatFormat(2, 1, 1, 0x7, None),
}


def _bfloat16_numpy() -> np.dtype:
    try:
        import ml_dtypes  # optional: numpy has no bfloat16 of its own
    except ImportError:
        raise ArgumentTypeError("bfloat16 has no numpy dtype without the ml_dtypes package "
                                "(pip install ml_dtypes)") from None
    return np.dtype(ml_dtypes.bfloat16)


def _ml_dtypes_numpy(name: str) -> np.dtype:
    try:
        import ml_dtypes  # optional: numpy has no bfloat16, float8 or int4 of its own
    except ImportError:
        raise ArgumentTypeError(f"{name} has no numpy dtype without the ml_dtypes package "
                                "(pip install ml_dtypes)") from None
    try:
        return np.dtype(getattr(ml_dtypes, name))
    except AttributeError:
        raise ArgumentTypeError(f"{name} needs ml_dtypes >= 0.5 (installed: {ml_dtypes.__version__})") from None


def to_numpy(dt: DType) -> np.dtype:
    if dt is dtypes.bfloat16 or dt.name == "bfloat16":
        return _bfloat16_numpy()
    if dt.storage_only:
        return _ml_dtypes_numpy(dt.name)
    return np.dtype(dt.name if dt.name != "bool" else np.bool_)


def from_numpy(dt: Any) -> DType:
    """The IR dtype for a numpy dtype (or anything `np.dtype` accepts)."""
    try:
        npdt = np.dtype(dt)
    except TypeError as e:
        raise ArgumentTypeError(f"{dt!r} is no dtype ({e}); known: {', '.join(BY_NAME)}") from None
    if npdt == np.bool_:
        return dtypes.bool
    if npdt.name in BY_NAME:
        return BY_NAME[npdt.name]
    if npdt.name == "bfloat16":
        return dtypes.bfloat16
    raise ArgumentTypeError(f"numpy dtype {npdt} has no morok_py dtype; known: {', '.join(BY_NAME)}")


def as_dtype(x: Any) -> DType:
    """Accept a DType, a dtype name, or a numpy dtype."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str) and x in BY_NAME:
        return BY_NAME[x]
    return from_numpy(x)


def accumulation_dtype(dt: DType, additive: bool = True) -> DType:
    """The dtype a reduction of `dt` values accumulates in by default: float16 and bfloat16 in
    float32, int8/int16 in int32 and uint8/uint16 in uint32 (sums and products of narrow values leave
    their range, or their precision, after a few terms). MAX and MIN (`additive=False`) are exact in
    any dtype: integers keep theirs, float16/bfloat16 take float32 all the same (the result is the
    same, and no target has to round an accumulator back to 16 bits at every step); storage-only
    formats (float8, int4, ...) are always widened, since nothing computes on them directly."""
    if dt.storage_only:
        return dtypes.float32 if dt.is_float else (dtypes.uint32 if dt.is_unsigned else dtypes.int32)
    if dt.itemsize >= 4 or dt.is_bool or (not additive and not dt.is_float):
        return dt
    if dt.is_float:
        return dtypes.float32
    return dtypes.uint32 if dt.is_unsigned else dtypes.int32
