"""Strided views on morok_py Buffers and the kernel builder the ONNX ops are written with.

A `View` is (buffer, shape, strides, offset): transposes, slices, expands, squeezes and most
reshapes are new views on the same Buffer, no copy. Every kernel reads its inputs through their
views and writes a fresh contiguous buffer (or a view of one, for Concat).

Concat without copies (`Kernels.concat_views`): a buffer `empty` made in this run whose launches are
all still queued can be *moved* into a slice of another buffer (a Concat's output); the queued and
later launches that name it are rewritten onto a view of that slice when they are flushed, so its
producer writes straight into the Concat's output and the Concat launches nothing for it.

Only the public morok_py API is used: Device, Buffer, UOp, dtypes, AxisType, Ops.
"""
from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from morok_py import AxisType, Buffer, UOp, dtypes
from morok_py.dtypes import DType, from_numpy
from morok_py.ir import variables_of
from morok_py.onnx.errors import OnnxError

INDEX_MAX = 2**31 - 1


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(out))


def prod(xs) -> int:
    return int(math.prod(int(x) for x in xs))


@dataclass
class View:
    buf: Buffer
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0
    const: bool = False          # the value does not depend on the graph's runtime inputs
    host: np.ndarray | None = None   # the value, when known on the host (constants, Shape)

    @property
    def dtype(self) -> DType:
        return self.buf.dtype

    @property
    def size(self) -> int:
        return prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def is_contiguous(self) -> bool:
        return all(st == c for s, st, c in zip(self.shape, self.strides, contiguous_strides(self.shape)) if s != 1)

    # ---- views, no copy -----------------------------------------------------------------------
    def with_(self, shape, strides, offset=None) -> "View":
        return View(self.buf, tuple(int(s) for s in shape), tuple(int(s) for s in strides),
                    self.offset if offset is None else int(offset), self.const, None)

    def permute(self, perm: Sequence[int]) -> "View":
        return self.with_([self.shape[p] for p in perm], [self.strides[p] for p in perm])

    def expand(self, shape: Sequence[int]) -> "View":
        shape = tuple(int(s) for s in shape)
        nd = len(shape)
        ss = (1,) * (nd - self.ndim) + self.shape
        st = (0,) * (nd - self.ndim) + self.strides
        strides = [0 if (a == 1 and b != 1) else s for a, b, s in zip(ss, shape, st)]
        return self.with_(shape, strides)

    def try_reshape(self, shape: Sequence[int]) -> "View | None":
        """A view with `shape` over the same elements, or None when the strides do not allow one."""
        shape = tuple(int(s) for s in shape)
        if prod(shape) != self.size:
            raise OnnxError(f"cannot reshape {self.shape} to {shape}")
        if self.is_contiguous():
            return self.with_(shape, contiguous_strides(shape))
        # group old dims into chunks that are each contiguous, then split the chunks
        old = [(s, st) for s, st in zip(self.shape, self.strides) if s != 1]
        new_strides: list[int] = []
        i = 0
        for s in shape:
            if s == 1:
                new_strides.append(0)
                continue
            # take old dims until their product reaches s
            acc, chunk = 1, []
            while acc < s and i < len(old):
                chunk.append(old[i]); acc *= old[i][0]; i += 1
            if acc != s:
                return None
            for (a, sa), (b, sb) in zip(chunk, chunk[1:]):
                if sa != sb * b:
                    return None
            new_strides.append(chunk[-1][1])
        return self.with_(shape, new_strides)


def bcast_shape(*shapes: Sequence[int]) -> tuple[int, ...]:
    nd = max((len(s) for s in shapes), default=0)
    out = [1] * nd
    for s in shapes:
        s = [1] * (nd - len(s)) + list(s)
        for i, d in enumerate(s):
            if d != 1:
                if out[i] not in (1, d):
                    raise OnnxError(f"shapes {shapes} do not broadcast")
                out[i] = d
    return tuple(out)


def iconst(v: int) -> UOp:
    return UOp.const(int(v), dtypes.index)


@dataclass
class KernelStat:
    node: str          # the node the kernel belongs to (the name it was asked for)
    program: str       # the name of the program that ran (the first node that built this AST)
    compile_s: float
    run_s: float = 0.0
    runs: int = 0
    cached: bool = False


class Kernels:
    """Builds, compiles (once per AST) and launches kernels on one device; keeps a time table and an
    optional record of every launch for replay through an ExecutionPlan."""

    def __init__(self, device, compiler: str | None = None, profile: bool = False,
                 symbolic_outer: bool = False) -> None:
        self.dev = device
        self.compiler = compiler
        self.profile = profile
        # the outermost parallel range of every kernel gets a symbolic extent, bound at launch: a model
        # with a dynamic dimension (the batch) then reuses its programs for every value of it
        self.symbolic_outer = symbolic_outer
        self.programs: dict[str, object] = {}     # ast.key -> Program
        self.var_names: dict[str, frozenset[str]] = {}   # ast.key -> the variables the kernel takes
        self.stats: list[KernelStat] = []
        self.launches: list[tuple] = []           # (program, buffers, vars)
        self.pending: list[tuple] = []            # (name, ast, buffers, vars) queued for `flush`
        self.compile_s = 0.0
        # buffers whose value came from the host (from_numpy): a memory plan must leave them in place
        self.host_filled: "weakref.WeakSet[Buffer]" = weakref.WeakSet()
        self.concat_views = False       # Concat may move its inputs into its output (see `move`)
        self.begin_run()

    # ---- buffers moved into slices of others (Concat without copies) ------------------------------
    def begin_run(self) -> None:
        """Forget the moves and launch records of the last run (the executor calls this as a run starts)."""
        self.launches.clear()
        self.pending = []
        self.queued = 0                 # launches queued in this run: a move's seal is this count
        self.fresh: "weakref.WeakSet[Buffer]" = weakref.WeakSet()   # made by `empty` in this run
        self.touched: set[int] = set()  # ids of buffers a flushed launch of this run used (they stay put)
        # id(buffer) -> (buffer, the buffer it moved into, byte offset there, seal): launches queued from
        # the seal on must not write it (its value is final once a Concat took it)
        self.moved: dict[int, tuple[Buffer, Buffer, int, int]] = {}
        self.resolved: dict[int, Buffer] = {}      # id(moved buffer) -> its view of its root buffer

    def movable(self, buf: Buffer) -> bool:
        """Whether `buf` can still be moved: made by `empty` in this run, not filled from the host, not
        moved already and used by no launch that ran (all its writers are queued)."""
        return (buf in self.fresh and buf not in self.host_filled and id(buf) not in self.moved
                and id(buf) not in self.touched)

    def move(self, buf: Buffer, into: Buffer, byte_offset: int) -> None:
        """Place `buf`'s memory at `byte_offset` of `into` (which may itself move later). Its memory goes
        back now: every launch that names it is rewritten onto the slice at flush."""
        if not self.movable(buf):
            raise OnnxError("internal: moving a buffer that is not movable")
        if byte_offset % Buffer.VIEW_ALIGN or byte_offset + buf.nbytes > into.nbytes:
            raise OnnxError(f"internal: a move to byte {byte_offset} of {into!r}")
        self.moved[id(buf)] = (buf, into, int(byte_offset), self.queued)
        buf.free()

    def root_of(self, buf: Buffer) -> tuple[Buffer, int]:
        """The buffer `buf`'s memory lives in after its moves, and the byte offset there."""
        off = 0
        while (m := self.moved.get(id(buf))) is not None and m[0] is buf:
            off += m[2]
            buf = m[1]
        return buf, off

    def resolve(self, buf: Buffer) -> Buffer:
        """The buffer to launch with in place of `buf`: itself, or the view of its root it moved into."""
        if not self.moved:
            return buf
        v = self.resolved.get(id(buf))
        if v is not None:
            return v
        m = self.moved.get(id(buf))
        if m is None or m[0] is not buf:
            return buf
        root, off = self.root_of(buf)
        v = self.resolved[id(buf)] = root.view(off, buf.size, buf.dtype)
        return v

    def _touch(self, buf: Buffer) -> None:
        while True:
            self.touched.add(id(buf))
            m = self.moved.get(id(buf))
            if m is None or m[0] is not buf:
                return
            buf = m[1]

    def empty(self, shape: Sequence[int], dtype: DType) -> View:
        shape = tuple(int(s) for s in shape)
        buf = Buffer(self.dev, max(prod(shape), 1), dtype)
        self.fresh.add(buf)
        return View(buf, shape, contiguous_strides(shape), 0)

    def from_numpy(self, arr: np.ndarray, const: bool = False) -> View:
        arr = np.asarray(arr)
        dt = from_numpy(arr.dtype)
        v = self.empty(arr.shape, dt)
        if arr.size:
            v.buf.copyin(np.ascontiguousarray(arr).reshape(-1))
        self.host_filled.add(v.buf)
        v.const = const
        v.host = arr if const else None
        return v

    def numpy(self, v: View) -> np.ndarray:
        if v.host is not None:
            return v.host
        self.flush()
        npdt = v.dtype.np
        if v.size == 0:
            return np.zeros(v.shape, npdt)
        flat = self.resolve(v.buf).numpy()
        if v.offset == 0 and flat.size == v.size and v.is_contiguous():
            return flat.reshape(v.shape)     # the whole buffer, in order: the copy out is the result
        item = flat.itemsize
        # through a plain unsigned view: as_strided cannot take ml_dtypes' types (bfloat16, float8, int4)
        base = flat[v.offset:].view(np.dtype(f"u{item}"))
        out = np.lib.stride_tricks.as_strided(base, v.shape, [s * item for s in v.strides]).copy()
        return out.view(flat.dtype)

    # ---- batched first runs: launches wait until a value is read back, so a run's new kernels compile
    # together (Device.compile_many: identical ones once, the others across the cores) -------------
    def launch(self, name: str, ast: UOp, bufs: Sequence[Buffer], **vars) -> None:
        """Queue a launch; `flush` (run by `numpy` and at the end of a run) compiles and launches."""
        self.pending.append((name, ast, tuple(bufs), vars))
        self.queued += 1

    def flush(self, before_launch: "Callable[[list[tuple]], list[tuple]] | None" = None) -> None:
        """Compile the queued launches' new kernels in one batch, then launch all of them in order.
        `before_launch(queue)`, given, sees the compiled queue ((name, ast, buffers, vars) each; the
        programs in `programs[ast.key]`) and returns the one to launch (a memory plan's buffers)."""
        pending, self.pending = self.pending, []
        new: dict[str, tuple] = {}
        for name, ast, _, _ in pending:
            if ast.key not in self.programs and ast.key not in new:
                new[ast.key] = (ast, name)
        share = 0.0
        if new:
            t0 = time.perf_counter()
            progs = self.dev.compile_many(list(new.values()), compiler=self.compiler)
            self.programs.update(zip(new, progs))
            share = (time.perf_counter() - t0) / len(new)       # the batch's time, split evenly
        if self.moved and pending:
            pending = self._onto_moved(pending)
        for _, _, bufs, _ in pending:
            for b in bufs:
                self._touch(b)
        if before_launch is not None and pending:
            pending = before_launch(pending)
        for name, ast, bufs, vars in pending:
            first = ast.key in new and new.pop(ast.key) is not None
            self._launch(name, ast, bufs, share if first else 0.0, not first, **vars)

    def _onto_moved(self, pending: list[tuple]) -> list[tuple]:
        """The queued launches with every moved buffer replaced by its slice of its root; refuses a launch
        that writes a moved buffer after the move (values are final when a Concat takes them)."""
        first = self.queued - len(pending)
        out = []
        for i, (name, ast, bufs, vars) in enumerate(pending):
            params = None
            for j, b in enumerate(bufs):
                m = self.moved.get(id(b))
                if m is None or m[0] is not b or first + i < m[3]:
                    continue
                if params is None:
                    info = getattr(self.programs[ast.key], "launch", None)
                    params = getattr(info, "params", None) or ()
                if j >= len(params) or params[j].written is not False:
                    raise OnnxError(f"internal: {name} writes a buffer a Concat already took")
            out.append((name, ast, tuple(self.resolve(b) for b in bufs), vars))
        return out

    def _launch(self, name: str, ast: UOp, bufs: Sequence[Buffer], ct: float, cached: bool, **vars) -> None:
        key = ast.key
        prog = self.programs[key]
        self.compile_s += ct
        st = KernelStat(name, prog.name, ct, cached=cached)
        if vars:        # a variable the simplifier folded away (a range of one value) is not the kernel's
            used = self.var_names.get(key)
            if used is None:
                used = self.var_names[key] = frozenset(v.arg[0] for v in variables_of(ast))
            vars = {n: v for n, v in vars.items() if n in used}
        rt = prog(*bufs, wait=self.profile, **vars)
        st.run_s, st.runs = (rt or 0.0), 1
        self.stats.append(st)
        self.launches.append((prog, tuple(bufs), dict(vars)))


class KB:
    """One kernel being built: inputs become params in the order they are first loaded, the output
    param comes last. Ranges get fresh axis numbers; extent-1 ranges are the constant 0."""

    def __init__(self, k: Kernels, name: str) -> None:
        self.k, self.name = k, name
        self.inputs: list[View] = []
        self.params: list[UOp] = []
        self.axis = 0
        self.stores: list[tuple[View, list, UOp]] = []
        self.vars: dict[str, int] = {}

    def rng(self, n: int, kind: AxisType = AxisType.GLOBAL) -> UOp:
        n = int(n)
        if self.k.symbolic_outer and self.axis == 0 and kind is AxisType.GLOBAL and n >= 1:
            self.vars["outer"] = n
            r = UOp.range(UOp.variable("outer", 1, INDEX_MAX), 0, kind)
            self.axis += 1
            return r
        if n == 1:
            return iconst(0)
        r = UOp.range(n, self.axis, kind)
        self.axis += 1
        return r

    def param(self, v: View) -> UOp:
        for i, x in enumerate(self.inputs):
            if x.buf is v.buf:
                return self.params[i]
        self.inputs.append(v)
        p = UOp.param(len(self.params), v.dtype)
        self.params.append(p)
        return p

    @staticmethod
    def index(v: View, idx: Sequence[UOp | int]) -> UOp:
        """The flat index of element `idx` of view `v` (broadcast dims have stride 0)."""
        out = iconst(v.offset)
        for i, st in zip(idx, v.strides):
            if st != 0:
                out = out + (i if isinstance(i, UOp) else iconst(i)) * st
        return out

    def load(self, v: View, idx: Sequence[UOp | int]) -> UOp:
        """Load v at idx, where idx has v's rank (or more: leading extra dims are dropped, numpy
        broadcasting rules with the broadcast dims reading index 0)."""
        idx = list(idx)[len(idx) - v.ndim:] if len(idx) >= v.ndim else [0] * (v.ndim - len(idx)) + list(idx)
        idx = [0 if s == 1 else i for s, i in zip(v.shape, idx)]
        if v.size == 0:
            raise OnnxError("load from an empty tensor")
        return self.param(v).load(self.index(v, idx))

    def store(self, out: View, idx: Sequence[UOp | int] | UOp, value: UOp) -> None:
        self.stores.append((out, idx if isinstance(idx, UOp) else list(idx), value))

    def run(self, **vars) -> None:
        outs: list[View] = []
        sts = []
        n_in = len(self.inputs)
        for out, idx, value in self.stores:
            slot = None
            for j, o in enumerate(outs):
                if o.buf is out.buf:
                    slot = j
            if slot is None:
                outs.append(out)
                slot = len(outs) - 1
            p = UOp.param(n_in + slot, out.dtype)
            if value.dtype != out.dtype:
                value = value.cast(out.dtype)
            # idx: one index per dim of `out`, or the flat element index itself (symbolic strides)
            sts.append(p.store(idx if isinstance(idx, UOp) else self.index(out, idx), value))
        ast = UOp.sink(*sts)
        self.k.launch(self.name, ast, [v.buf for v in self.inputs] + [o.buf for o in outs], **self.vars, **vars)


def elementwise(k: Kernels, name: str, inputs: Sequence[View], fn: Callable, out_dtype: DType,
                shape: Sequence[int] | None = None, need_idx: bool = False) -> View:
    """out[i] = fn([x[i] for x in inputs], i) with numpy broadcasting. Without need_idx the dims are
    collapsed where every operand allows it, and a fully contiguous kernel gets a symbolic size, so one
    program serves every shape."""
    shape = tuple(shape) if shape is not None else bcast_shape(*[v.shape for v in inputs])
    out = k.empty(shape, out_dtype)
    if out.size == 0:
        return out
    kb = KB(k, name)
    if need_idx:
        idx = [kb.rng(s) for s in shape]
        vals = [kb.load(v, idx) for v in inputs]
        kb.store(out, idx, fn(vals, idx))
        kb.run()
        return out
    views = [v.expand(shape) for v in inputs] + [out]
    dims = [(s, [v.strides[i] for v in views]) for i, s in enumerate(shape) if s != 1]
    merged: list[tuple[int, list[int]]] = []
    for s, sts in dims:
        if merged and all(ps == st * s for ps, st in zip(merged[-1][1], sts)):
            merged[-1] = (merged[-1][0] * s, sts)
        else:
            merged.append((s, sts))
    cviews = [View(v.buf, tuple(m[0] for m in merged), tuple(m[1][j] for m in merged), v.offset)
              for j, v in enumerate(views)]
    vars = {}
    if len(merged) == 1 and all(v.offset == 0 and v.strides[0] in (0, 1) for v in cviews):
        n = UOp.variable("n", 1, INDEX_MAX)
        r = UOp.range(n, 0)
        idx = [r]
        vars = {"n": merged[0][0]}
    else:
        idx = [kb.rng(m[0]) for m in merged]
    vals = []
    for v in cviews[:-1]:
        vals.append(kb.param(v).load(kb.index(v, idx)))
    kb.store(cviews[-1], idx, fn(vals, None))
    kb.run(**vars)
    return out


def fill(k: Kernels, name: str, shape: Sequence[int], value, dtype: DType) -> View:
    out = k.empty(shape, dtype)
    if out.size == 0:
        return out
    kb = KB(k, name)
    n = UOp.variable("n", 1, INDEX_MAX)
    r = UOp.range(n, 0)
    kb.store(View(out.buf, (out.size,), (1,)), [r], UOp.const(value, dtype))
    kb.run(n=out.size)
    return out


def copy(k: Kernels, name: str, v: View) -> View:
    return elementwise(k, name, [v], lambda xs, _: xs[0], v.dtype)


def concat_in_place(k: Kernels, out: View, ins: Sequence[View], ax: int) -> list[int] | None:
    """Move what it can of a Concat's inputs into their slices of `out` (a fresh buffer); returns the
    indices of the inputs still to copy, or None when `out` itself became a slice of a buffer that
    already holds the inputs in order.

    Only where every input's slice is one byte range (all dims before `ax` are 1). An input moves when
    it is a whole contiguous buffer of this run whose launches are all queued (`Kernels.movable`) and
    its slice starts on a view's alignment; a value lives in one place, so an input some Concat already
    took is copied, unless the inputs that sit side by side in one buffer fill it (then that buffer
    moves, as for DenseNet blocks that concatenate every earlier feature map again) or are all the
    inputs (then `out` is that range of it)."""
    if not k.concat_views or out.size == 0 or prod(out.shape[:ax]) != 1 or not k.movable(out.buf):
        return list(range(len(ins)))
    item = out.dtype.itemsize
    # [buffer (None: not a whole contiguous buffer), bytes, input indices]
    items: list[list] = []
    for i, v in enumerate(ins):
        if v.size == 0:
            continue
        whole = v.offset == 0 and v.is_contiguous() and v.buf.size == v.size and v.dtype == out.dtype
        items.append([v.buf if whole else None, v.size * item, [i]])

    def home(b):
        m = k.moved.get(id(b)) if b is not None else None
        return m if m is not None and m[0] is b else None

    def run_from(j: int) -> tuple[int, int]:
        """The end of the run of items from j moved side by side into one buffer, and its bytes."""
        m = home(items[j][0])
        end, pos = j, m[2]
        while end < len(items):
            mm = home(items[end][0])
            if mm is None or mm[1] is not m[1] or mm[2] != pos:
                break
            pos += items[end][1]
            end += 1
        return end, pos - m[2]

    changed = True
    while changed:          # runs that fill the buffer they moved into stand for that buffer
        changed = False
        for j in range(len(items)):
            m = home(items[j][0])
            if m is None or m[2] != 0:
                continue
            end, nbytes = run_from(j)
            if nbytes == m[1].nbytes:
                items[j:end] = [[m[1], nbytes, [i for it in items[j:end] for i in it[2]]]]
                changed = True
                break
    if items and home(items[0][0]) is not None and run_from(0)[0] == len(items):
        m = home(items[0][0])
        k.move(out.buf, m[1], m[2])
        return None
    moves: dict[int, tuple[Buffer, int, list[int]]] = {}
    copies: list[int] = []
    pos = 0
    for b, nbytes, idx in items:
        if (b is not None and b is not out.buf and id(b) not in moves and pos % Buffer.VIEW_ALIGN == 0
                and k.movable(b)):
            moves[id(b)] = (b, pos, idx)
        else:
            copies += idx
        pos += nbytes

    def moving_holder(b) -> int | None:
        """The buffer this call moves that `b`'s memory would then be inside (itself included)."""
        while b is not None:
            if id(b) in moves:
                return id(b)
            m = home(b)
            b = m[1] if m is not None else None
        return None

    # a copy writes `out` whole, so it must not read what sits inside `out` (Concat(y, y) copies y's
    # second use): the move that would put it there is dropped
    while True:
        held = next((h for h in (moving_holder(ins[i].buf) for i in copies) if h is not None), None)
        if held is None:
            break
        copies += moves.pop(held)[2]
    for b, at, _ in moves.values():
        k.move(b, out.buf, at)
    return sorted(copies)
