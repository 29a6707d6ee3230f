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

from .kernels import widened_matmul as matmul

__all__ = ["matmul"]
