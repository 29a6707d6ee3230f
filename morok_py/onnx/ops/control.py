"""Control flow: If, Loop, Scan. The subgraphs run through the executor node by node, in an env that holds
the outer scope's names (`ctx.env`) plus the body's inputs; conditions and trip counts are read on the host.

Slices fed to a body and the rows of stacked outputs are copied by kernels whose position along the
scanned axis is a launch-time variable, so every iteration reuses the same compiled programs.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from onnx import numpy_helper

from morok_py import UOp, dtypes

from morok_py.onnx.errors import OnnxError, UnsupportedOp
from morok_py.onnx.tensor import KB, View, iconst
from morok_py.onnx.ops.common import ONNX_DT, keep_const
from morok_py.onnx.ops.registry import op


def run_graph(ctx, g, bound: dict[str, View], tag: str) -> list[View]:
    """The outputs of subgraph `g` with its inputs bound to `bound`, outer names taken from ctx.env."""
    env = dict(getattr(ctx, "env", None) or {})
    env[""] = None
    for init in g.initializer:
        env[init.name] = ctx.k.from_numpy(numpy_helper.to_array(init), const=True)
    env.update(bound)
    ctx.ex._run_nodes(g.node, env, ctx.opset, f"{ctx.name}/{tag}/")
    outs = []
    for o in g.output:
        if o.name not in env or env[o.name] is None:
            raise OnnxError(f"subgraph {g.name!r} of {ctx.name} does not compute its output {o.name!r}")
        outs.append(env[o.name])
    return outs


def _pos(n: int, pos: int) -> tuple[UOp, dict[str, int]]:
    """Position `pos` on an axis of extent n: a launch variable (a constant where n is 1, folded anyway)."""
    if n == 1:
        return iconst(0), {}
    return UOp.variable("pos", 0, n - 1), {"pos": pos}


def take(ctx, x: View, axis: int, pos: int) -> View:
    """x[..., pos, ...] along `axis` as a fresh contiguous tensor (the position is a launch variable)."""
    shape = x.shape[:axis] + x.shape[axis + 1:]
    out = ctx.k.empty(shape, x.dtype)
    if out.size == 0:
        return out
    kb = KB(ctx.k, ctx.n("take"))
    idx = [kb.rng(s) for s in shape]
    p, var = _pos(x.shape[axis], pos)
    kb.store(out, idx, kb.load(x, idx[:axis] + [p] + idx[axis:]))
    kb.run(**var)
    out.const = x.const
    return out


def stack(ctx, vs: Sequence[View], axis: int = 0, reverse: bool = False, empty_shape=None, dtype=None) -> View:
    """The views stacked along a new `axis` (in reverse order when `reverse`), one copy kernel per view."""
    if not vs:
        return ctx.k.empty(empty_shape if empty_shape is not None else (0,), dtype)
    shape, T = vs[0].shape, len(vs)
    if any(v.shape != shape for v in vs):
        raise UnsupportedOp(f"{ctx.name}: stacked values change shape across iterations")
    out = ctx.k.empty(shape[:axis] + (T,) + shape[axis:], vs[0].dtype)
    if out.size == 0:
        return out
    for t, v in enumerate(vs):
        kb = KB(ctx.k, ctx.n("stack"))
        idx = [kb.rng(s) for s in shape]
        p, var = _pos(T, T - 1 - t if reverse else t)
        kb.store(out, idx[:axis] + [p] + idx[axis:], kb.load(v, idx))
        kb.run(**var)
    return keep_const(out, vs)


def _elem_shape_dtype(vi):
    """The static shape and dtype a graph output declares (for the stack of zero iterations); float32
    where it declares no element type."""
    tt = vi.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else 0 for d in tt.shape.dim] if tt.HasField("shape") else []
    return tuple(dims), ONNX_DT.get(tt.elem_type, dtypes.float32)


@op("If")
def _if(ctx, ins, a):
    branch = a["then_branch"] if bool(ctx.scalar(ins[0])) else a["else_branch"]
    return run_graph(ctx, branch, {}, "then" if branch is a["then_branch"] else "else")


@op("Loop")
def _loop(ctx, ins, a):
    body = a["body"]
    M = ins[0] if len(ins) > 0 else None
    cond = ins[1] if len(ins) > 1 else None
    state = list(ins[2:])
    trip = int(ctx.scalar(M)) if M is not None else None
    go = bool(ctx.scalar(cond)) if cond is not None else True
    if trip is None and cond is None:
        raise UnsupportedOp(f"{ctx.name}: a Loop with neither a trip count nor a condition never ends")
    names = [i.name for i in body.input]
    n_state = len(state)
    n_scan = len(body.output) - 1 - n_state
    scans: list[list[View]] = [[] for _ in range(n_scan)]
    i = 0
    while go and (trip is None or i < trip):
        bound = {names[0]: ctx.const_view(np.array(i, np.int64)), names[1]: ctx.const_view(np.array(go))}
        bound.update(zip(names[2:], state))
        outs = run_graph(ctx, body, bound, f"iter{i}")
        go = bool(ctx.scalar(outs[0]))
        state = outs[1:1 + n_state]
        for s, v in zip(scans, outs[1 + n_state:]):
            s.append(v)
        i += 1
    res = list(state)
    for s, vi in zip(scans, body.output[1 + n_state:]):
        shp, dt = _elem_shape_dtype(vi)
        res.append(stack(ctx, s, empty_shape=(0,) + shp, dtype=dt))
    return res


def _scan(ctx, states: list[View], xs: list[View], body, a, tag: str = "") -> list[View]:
    """One Scan (opset 9+ semantics) over the scan inputs `xs`: final states, then the stacked outputs."""
    n_in = len(xs)
    in_axes = list(a.get("scan_input_axes", [0] * n_in))
    in_dirs = list(a.get("scan_input_directions", a.get("directions", [0] * n_in)))
    n_state = len(states)
    n_out = len(body.output) - n_state
    out_axes = list(a.get("scan_output_axes", [0] * n_out))
    out_dirs = list(a.get("scan_output_directions", [0] * n_out))
    in_axes = [ax % x.ndim for ax, x in zip(in_axes, xs)]
    lengths = {x.shape[ax] for x, ax in zip(xs, in_axes)}
    if len(lengths) != 1:
        raise OnnxError(f"{ctx.name}: scan inputs of different lengths {sorted(lengths)}")
    T = lengths.pop()
    names = [i.name for i in body.input]
    ys: list[list[View]] = [[] for _ in range(n_out)]
    for t in range(T):
        bound = dict(zip(names[:n_state], states))
        for name, x, ax, d in zip(names[n_state:], xs, in_axes, in_dirs):
            bound[name] = take(ctx, x, ax, T - 1 - t if d else t)
        outs = run_graph(ctx, body, bound, f"{tag}step{t}")
        states = outs[:n_state]
        for y, v in zip(ys, outs[n_state:]):
            y.append(v)
    res = list(states)
    for y, ax, d, vi in zip(ys, out_axes, out_dirs, body.output[n_state:]):
        shp, dt = _elem_shape_dtype(vi)
        nd = (y[0].ndim if y else len(shp)) + 1
        res.append(stack(ctx, y, ax % nd, bool(d), empty_shape=shp[:ax % nd] + (0,) + shp[ax % nd:], dtype=dt))
    return res


@op("Scan")
def _scan_op(ctx, ins, a):
    body = a["body"]
    n_in = a["num_scan_inputs"]
    if ctx.opset >= 9:
        n_state = len(ins) - n_in
        return _scan(ctx, list(ins[:n_state]), list(ins[n_state:]), body, a)
    # opset 8: a leading batch axis on every state and scan input, and optional sequence lengths
    seq_lens, rest = ins[0], list(ins[1:])
    n_state = len(rest) - n_in
    B = rest[0].shape[0]
    if seq_lens is not None:
        lens = ctx.ints(seq_lens)
        full = rest[n_state].shape[1]
        if any(n != full for n in lens):
            raise UnsupportedOp(f"{ctx.name}: Scan-8 with sequence_lens shorter than the sequence")
    a8 = dict(a)
    a8["scan_input_directions"] = list(a.get("directions", [0] * n_in))
    per_batch = [_scan(ctx, [take(ctx, v, 0, b) for v in rest[:n_state]],
                       [take(ctx, v, 0, b) for v in rest[n_state:]], body, a8, f"b{b}/") for b in range(B)]
    return [stack(ctx, [r[k] for r in per_batch]) for k in range(len(per_batch[0]))] if B else \
        [ctx.k.empty((0,), rest[0].dtype) for _ in body.output]

