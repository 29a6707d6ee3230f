"""Det: one kernel, one matrix per output element, Gaussian elimination with partial pivoting unrolled in
the kernel (in float64) for matrices up to MAX_N on a side."""
from __future__ import annotations

from morok_py import UOp, dtypes

from morok_py.onnx.errors import UnsupportedOp
from morok_py.onnx.tensor import KB
from morok_py.onnx.ops.common import keep_const
from morok_py.onnx.ops.registry import op

MAX_N = 8       # the unrolled elimination has O(n^3) nodes
F64 = dtypes.float64


def determinant(m: list[list[UOp]]) -> UOp:
    """det of the n x n matrix of UOps: conditional row swaps bring the largest remaining pivot up."""
    n = len(m)
    m = [list(r) for r in m]
    zero, one = UOp.const(0.0, F64), UOp.const(1.0, F64)
    det = one
    for col in range(n):
        for r in range(col + 1, n):
            a, b = m[col][col], m[r][col]
            swap = (b < zero).where(-b, b) > (a < zero).where(-a, a)
            m[col], m[r] = [swap.where(y, x) for x, y in zip(m[col], m[r])], \
                [swap.where(x, y) for x, y in zip(m[col], m[r])]
            det = swap.where(-det, det)
        piv = m[col][col]
        det = det * piv
        safe = (piv == zero).where(one, piv)
        for r in range(col + 1, n):
            f = m[r][col] / safe
            m[r] = [m[r][j] - f * m[col][j] if j > col else zero for j in range(n)]
    return det


@op("Det")
def _det(ctx, ins, a):
    x = ins[0]
    n = x.shape[-1]
    if n > MAX_N:
        raise UnsupportedOp(f"Det of {n}x{n} matrices: the unrolled kernel goes to {MAX_N}x{MAX_N}")
    out = ctx.k.empty(x.shape[:-2], x.dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    b = [kb.rng(s) for s in x.shape[:-2]]
    if n == 0:
        v = UOp.const(1.0, F64)
    else:
        v = determinant([[kb.load(x, b + [i, j]).cast(F64) for j in range(n)] for i in range(n)])
    kb.store(out, b, v.cast(x.dtype))
    kb.run()
    return [keep_const(out, ins)]
