"""MatMul, Gemm and Einsum."""
from __future__ import annotations

import string
from typing import Sequence

from morok_py import AxisType, UOp

from morok_py.onnx.tensor import KB, View, bcast_shape, contiguous_strides
from morok_py.onnx.ops.common import fconst, isr, keep_const
from morok_py.onnx.ops.registry import op


# ---- linear algebra ---------------------------------------------------------------------------------
def matmul_operands(A: View, B: View) -> tuple[View, View, bool, bool, tuple]:
    """numpy's matmul promotion: a 1-D A becomes one row, a 1-D B one column (a1, b1 say which, for the
    output's shape); returns (A, B, a1, b1, the broadcast batch shape)."""
    a1, b1 = A.ndim == 1, B.ndim == 1
    if a1:
        A = A.with_((1,) + A.shape, (0,) + A.strides)
    if b1:
        B = B.with_(B.shape + (1,), B.strides + (0,))
    return A, B, a1, b1, bcast_shape(A.shape[:-2], B.shape[:-2])


def matmul(ctx, A: View, B: View, suffix="", epilogue=None, extra: Sequence[View] = ()) -> View:
    """Batched matmul with numpy broadcasting; epilogue(acc, kb, out_idx) may add bias etc."""
    A, B, a1, b1, batch = matmul_operands(A, B)
    M, K, N = A.shape[-2], A.shape[-1], B.shape[-1]
    oshape = list(batch) + [M, N]
    out = ctx.k.empty(oshape, A.dtype)
    if out.size:
        kb = KB(ctx.k, ctx.n(suffix))
        bidx = [kb.rng(s) for s in batch]
        i, j = kb.rng(M), kb.rng(N)
        k = kb.rng(K, AxisType.REDUCE)
        if K == 0:
            acc = UOp.const(0, A.dtype)
        else:
            acc = kb.load(A, bidx + [i, k]) * kb.load(B, bidx + [k, j])
            acc = acc.reduce(k) if isr(k) else acc
        if epilogue is not None:
            acc = epilogue(acc, kb, bidx + [i, j])
        kb.store(out, bidx + [i, j], acc)
        kb.run()
    shape = list(batch) + ([] if a1 else [M]) + ([] if b1 else [N])
    return keep_const(out.with_(shape, contiguous_strides(shape)), [A, B])


@op("MatMul")
def _matmul(ctx, ins, a):
    return [matmul(ctx, ins[0], ins[1])]


@op("Gemm")
def _gemm(ctx, ins, a):
    A, B = ins[0], ins[1]
    C = ins[2] if len(ins) > 2 else None
    if a.get("transA", 0):
        A = A.permute([1, 0])
    if a.get("transB", 0):
        B = B.permute([1, 0])
    alpha, beta = a.get("alpha", 1.0), a.get("beta", 1.0)

    def epi(acc, kb, idx):
        if alpha != 1.0:
            acc = acc * fconst(acc, alpha)
        if C is not None and beta != 0.0:
            c = kb.load(C, idx)
            acc = acc + (c * fconst(c, beta) if beta != 1.0 else c)
        return acc
    return [matmul(ctx, A, B, epilogue=epi)]


@op("Einsum")
def _einsum(ctx, ins, a):
    eq = a["equation"]
    eq = eq.decode() if isinstance(eq, bytes) else eq
    eq = eq.replace(" ", "")
    lhs, rhs = eq.split("->") if "->" in eq else (eq, None)
    terms = lhs.split(",")
    free = [c for c in string.ascii_letters if c not in eq]
    ell_nd = max((v.ndim - (len(t) - 3) for t, v in zip(terms, ins) if "..." in t), default=0)
    ell = "".join(free[:ell_nd])
    terms = [t.replace("...", ell[ell_nd - (v.ndim - (len(t) - 3)):]) if "..." in t else t for t, v in zip(terms, ins)]
    if rhs is None:
        cnt = {}
        for t in terms:
            for c in t:
                cnt[c] = cnt.get(c, 0) + 1
        rhs = ell + "".join(sorted(c for c in cnt if cnt[c] == 1 and c not in ell))
    else:
        rhs = rhs.replace("...", ell)
    sizes = {}
    for t, v in zip(terms, ins):
        for c, s in zip(t, v.shape):
            if sizes.get(c, 1) == 1:
                sizes[c] = s
    oshape = [sizes[c] for c in rhs]
    out = ctx.k.empty(oshape, ins[0].dtype)
    if out.size == 0:
        return [out]
    kb = KB(ctx.k, ctx.n())
    rng = {c: kb.rng(sizes[c]) for c in rhs}
    red = [c for c in sizes if c not in rhs]
    for c in red:
        rng[c] = kb.rng(sizes[c], AxisType.REDUCE)
    val = None
    for t, v in zip(terms, ins):
        x = kb.load(v, [rng[c] if s != 1 else 0 for c, s in zip(t, v.shape)])
        val = x if val is None else val * x
    rr = [rng[c] for c in red if isr(rng[c])]
    if rr:
        val = val.reduce(*rr)
    kb.store(out, [rng[c] for c in rhs], val)
    kb.run()
    return [out]
