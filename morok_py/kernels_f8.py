"""Matmul of storage-only floats (float8_e4m3fn, float8_e5m2, ...): each element is widened to float32, the
products are summed in float32, and the result is stored in `out_dtype` (float32 by default).

    C[M, N] = out_dtype(sum_k float32(A[M, K]) * float32(B[K, N]))

`b_layout` "kn" takes B as [K, N] row-major (kernels.matmul's layout); "nk" as B^T [N, K] row-major (B
column-major, what torch._scaled_mm asks for). On sm_90a GPUs a float8_e4m3fn / float8_e5m2 contraction
whose strides are multiples of 16 (K, and N for "kn") runs on the warpgroup tensor cores
(codegen/strategies/wgmma_f8.py: "nk" filled by cp.async, "kn" turned around by the producer); every other
case is correct on the ordinary path.
Params: A, B, the epilogue's operands, C.
"""
from __future__ import annotations

from .dtypes import as_dtype, dtypes
from .errors import ArgumentError
from .ir import AxisType, UOp
from .kernels import Epilogue, _end, size


def matmul(M=None, N=None, K=None, a_dtype=dtypes.float8_e4m3fn, b_dtype=None, out_dtype=dtypes.float32,
           b_layout: str = "kn", epilogue: "Epilogue | None" = None, ldb: int | None = None) -> UOp:
    """C = A @ B accumulated in float32 over operands of any float dtype (`b_dtype` default: `a_dtype`), then
    `epilogue` (computed in float32, its operands of `out_dtype`), stored as `out_dtype`. `ldb`: the row stride
    of B's layout in elements (default N for "kn", K for "nk")."""
    adt = as_dtype(a_dtype)
    bdt = adt if b_dtype is None else as_dtype(b_dtype)
    odt = as_dtype(out_dtype)
    if b_layout not in ("kn", "nk"):
        raise ArgumentError(f"b_layout is 'kn' (B [K, N]) or 'nk' (B^T [N, K]), got {b_layout!r}")
    if not (adt.is_float and bdt.is_float):
        raise ArgumentError(f"matmul of float operands, got {adt.name} and {bdt.name}")
    if odt.storage_only and epilogue:
        raise ArgumentError(f"an epilogue's operands cannot be of the storage-only {odt.name}")
    M, N, K = size(M, "M"), size(N, "N"), size(K, "K")
    epi = epilogue or Epilogue()
    a, b = UOp.param(0, adt), UOp.param(1, bdt)
    i, j = UOp.range(M, 0), UOp.range(N, 1)
    k = UOp.range(K, 2, AxisType.REDUCE)
    bx = k * _end(N if ldb is None else ldb) + j if b_layout == "kn" else j * _end(K if ldb is None else ldb) + k
    acc = (a.load(i * _end(K) + k).cast(dtypes.float32) * b.load(bx).cast(dtypes.float32)).reduce(k)
    at = i * _end(N) + j
    v, nxt = epi.apply(acc, 2, dtypes.float32 if odt.storage_only else odt, j, at)
    if v.dtype != odt:
        v = v.cast(odt)
    return UOp.sink(UOp.param(nxt, odt).store(at, v))


__all__ = ["matmul"]
