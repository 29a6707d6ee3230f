"""TfIdfVectorizer over integer tokens: one kernel per n-gram length of the pool, each output (row, pool
n-gram) counting its matches over start positions and skip distances; TF, IDF or TFIDF weighting in the
same kernel."""
from __future__ import annotations

import numpy as np

from morok_py import AxisType, UOp, dtypes

from morok_py.onnx.errors import UnsupportedOp
from morok_py.onnx.tensor import KB, fill
from morok_py.onnx.ops.common import as_uop, isr, keep_const
from morok_py.onnx.ops.registry import op

F32 = dtypes.float32


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else v


@op("TfIdfVectorizer")
def _tfidf(ctx, ins, a):
    x = ins[0]
    if a.get("pool_strings"):
        raise UnsupportedOp("TfIdfVectorizer over strings")
    mode = _s(a["mode"])
    lo_n, hi_n, skip = a["min_gram_length"], a["max_gram_length"], a["max_skip_count"]
    counts, indexes = list(a["ngram_counts"]), list(a["ngram_indexes"])
    pool = list(a.get("pool_int64s", []))
    weights = list(a.get("weights", []))
    if len(set(indexes)) != len(indexes):
        raise UnsupportedOp("TfIdfVectorizer with two pool n-grams on one output column")
    O = max(indexes) + 1
    rows = x if x.ndim == 2 else x.with_((1,) + x.shape, (0,) + x.strides)
    B, L = rows.shape
    out = fill(ctx.k, ctx.n("zeros"), (B, O), 0.0, F32)
    bounds = counts + [len(pool)]
    first = 0                                   # index of the group's first n-gram in ngram_indexes
    for n in range(1, len(counts) + 1):
        grams = np.array(pool[bounds[n - 1]:bounds[n]], np.int64).reshape(-1, n)
        P = grams.shape[0]
        if P and lo_n <= n <= hi_n and L:
            cols = np.array(indexes[first:first + P], np.int64)
            w = np.array([weights[c] for c in cols] if weights else [1.0] * P, np.float32)
            _count(ctx, rows, out, grams, cols, w, n, 1 if n == 1 else skip + 1, mode)
        first += P
    res = out if x.ndim == 2 else out.with_((O,), (1,))
    return [keep_const(res, ins)]


def _count(ctx, x, out, grams, cols, w, n: int, D: int, mode: str) -> None:
    B, L = x.shape
    P = grams.shape[0]
    gv, cv, wv = ctx.const_view(grams.astype(x.dtype.np)), ctx.const_view(cols), ctx.const_view(w)
    kb = KB(ctx.k, ctx.n(f"{n}gram"))
    b, p = kb.rng(B), kb.rng(P)
    s, d = kb.rng(L, AxisType.REDUCE), kb.rng(D, AxisType.REDUCE)
    match = None
    for t in range(n):
        pos = as_uop(s) + (as_uop(d) + 1) * t
        ok = (pos < L) & (kb.load(x, [b, pos.clamp(0, L - 1)]) == kb.load(gv, [p, t]))
        match = ok if match is None else match & ok
    one, zero = UOp.const(1.0, F32), UOp.const(0.0, F32)
    v = match.where(one, zero)
    rr = [r for r in (s, d) if isr(r)]
    if rr:
        v = v.reduce(*rr)
    if mode == "IDF":
        v = (v > zero).where(kb.load(wv, [p]), zero)
    elif mode == "TFIDF":
        v = v * kb.load(wv, [p])
    col = kb.load(cv, [p]).cast(dtypes.index).clamp(0, out.shape[1] - 1) if out.shape[1] > 1 else 0
    kb.store(out, [b, col], v)
    kb.run()
