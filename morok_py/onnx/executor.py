"""An ONNX graph executor on morok_py's public API.

`OnnxExecutor(model, device)` uploads the initializers once; `run(inputs)` walks the graph in order,
turning each node into kernels with static shapes (known exactly, since it runs node by node) and
returns numpy arrays. Shape-only ops are views on the same buffer. The launches of a run are recorded
into a morok_py ExecutionPlan; `run` replays that plan when the input shapes repeat and no launch
depended on a value read back from the inputs.

Intermediate buffers share one arena by a memory plan (morok_py.memplan.plan_launches): a buffer the
run's launches write is placed where buffers not live at the same time also live; graph inputs and
outputs, weights and values filled from the host keep their own memory. A run that launches nothing
before its end (a static graph) runs on the arena from its first launch; otherwise the recorded plan
moves onto one. MOROK_MEMPLAN=0 keeps every intermediate in its own buffer.

A Concat whose inputs' slices are contiguous byte ranges of its output (all dims before the axis are 1)
has its inputs' producers write their slices directly where that is safe (tensor.concat_in_place): the
moved buffers' launches are rewritten onto views of the buffer they end up in (the root), and the memory
plan places roots, never their views. MOROK_ONNX_CONCAT_VIEWS=0 keeps the copy kernels.

A replay on a device whose buffers are host memory (the CPU) copies nothing (MOROK_ONNX_ZERO_COPY=0
turns that off): a graph input the launches only read is bound to the caller's array where that array
is C-contiguous, of the recorded dtype and 16-byte aligned (else it is copied in), and a graph output
that is a whole buffer the launches write, shared with no other input, output or weight, is written
straight into an array that is returned (ExecutionPlan.slot); the other outputs are copied out. That
array is fresh, or one an earlier replay returned that nothing else holds any more (CPython's reference
counts say so; SPARE_OUTPUTS are kept per output): a new allocation's pages fault in at the first write,
which cost more than the copies did where the allocator maps each large block anew.
"""
from __future__ import annotations

import copy
import os
import sys
import time
from collections.abc import Mapping as AbcMapping
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from morok_py import Buffer, Device, ExecutionPlan, LaunchError, config
from morok_py.dtypes import from_numpy
from morok_py.memplan import LaunchArena, MemoryPlan, plan_launches
from morok_py.plan import BufferSlot
from morok_py.registry import get_device

from morok_py.onnx import ops as O
from morok_py.onnx.fuse import fuse
from morok_py.onnx.errors import OnnxError, UnsupportedDtype, UnsupportedOp
from morok_py.onnx.tensor import Kernels, View
from morok_py.onnx.values import Opt, Seq


# ONNX element types morok_py can hold (numpy dtype of each)
SUPPORTED = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64,
             9: np.bool_, 10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64}
# bfloat16 and the storage-only formats (float8, float4, int4, int2): numpy holds them through ml_dtypes,
# one element per byte (ONNX packs int4/int2/float4 in files; numpy_helper unpacks them)
NARROW = {16: "bfloat16", 17: "float8_e4m3fn", 18: "float8_e4m3fnuz", 19: "float8_e5m2", 20: "float8_e5m2fnuz",
          21: "uint4", 22: "int4", 23: "float4_e2m1fn", 24: "float8_e8m0fnu", 25: "uint2", 26: "int2"}


PREVIEW = "ai.onnx.preview"     # the domain of ops not yet in the standard one; run as their function bodies
MAX_PLANS = 8      # input shapes whose launch lists are kept for replay
# initializers larger than this keep no host copy once uploaded (ops read only small constants, shapes
# and indices, on the host; a larger one is read back if an op asks)
HOST_COPY_MAX_BYTES = 16 << 10


def memplan_enabled() -> bool:
    """MOROK_MEMPLAN (default 1): intermediate buffers share one arena by a memory plan; 0 gives each its own."""
    return config.getenv("MOROK_MEMPLAN", "1") not in ("0", "false", "False", "")


def concat_views_enabled() -> bool:
    """MOROK_ONNX_CONCAT_VIEWS (default 1): a Concat's producers write into its output's slices where safe;
    0 copies every input."""
    return config.getenv("MOROK_ONNX_CONCAT_VIEWS", "1") not in ("0", "false", "False", "")


# arrays an output's replays returned that the executor keeps to reuse once the caller lets go of them: two
# serve `y = session.run(...)` in a loop (the last result is still held while the next run starts)
SPARE_OUTPUTS = 2


@dataclass(frozen=True)
class ZeroCopy:
    """How the replays of one recorded plan skip the copies (host-memory devices): the graph inputs
    the launches only read, by name (their slot and the dtype an array must have to be bound); per
    graph output its slot, shape and numpy dtype, or None where it is copied out; and per output the
    arrays recent replays returned (`SPARE_OUTPUTS`, newest last)."""
    plan: ExecutionPlan
    inputs: dict[str, tuple[BufferSlot, np.dtype]]
    outputs: list[tuple[BufferSlot, tuple[int, ...], np.dtype] | None]
    spare: list[list[np.ndarray]]


def fresh_array(shape: tuple[int, ...], dtype: np.dtype, nbytes: int, align: int) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an `align`-byte boundary (the CPU's
    streaming stores need 64; numpy's own allocations are 16-byte aligned). Its `base` owns the memory."""
    raw = np.empty(nbytes + align - 1, np.uint8)
    off = -raw.__array_interface__["data"][0] % align
    return raw[off:off + nbytes].view(dtype).reshape(shape)


def _holders(arrays: list[np.ndarray], i: int) -> tuple[int, int]:
    """The reference counts of `arrays[i]` and of the array owning its memory (numpy points every view's
    `base` at the owner), as seen from here."""
    return sys.getrefcount(arrays[i]), sys.getrefcount(arrays[i].base)


_UNHELD: tuple[int, int] | None = None


def unheld(arrays: list[np.ndarray], i: int) -> bool:
    """Whether nothing but `arrays` holds `arrays[i]`, a view of it or its memory's owner (then its memory
    can be written again). The counts of an array no one holds are taken once, through the same call, so
    the interpreter's own references are the same on both sides; any other holder adds to them. False
    outside CPython (no reference counts)."""
    global _UNHELD
    if sys.implementation.name != "cpython":
        return False
    if _UNHELD is None:
        probe = [fresh_array((1,), np.dtype(np.uint8), 1, 64)]
        _UNHELD = _holders(probe, 0)
    return _holders(arrays, i) == _UNHELD


def elem_type_name(t: int) -> str:
    return onnx.TensorProto.DataType.Name(t)


def check_dtype(t: int) -> None:
    if t in SUPPORTED or t in NARROW:
        return
    raise UnsupportedDtype(f"element type {elem_type_name(t)} has no morok_py dtype")


def attrs_of(node) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def load_model(model: onnx.ModelProto | str | os.PathLike | bytes) -> onnx.ModelProto:
    """A ModelProto from a path, serialized bytes or a ModelProto."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray, memoryview)):
        return onnx.load_from_string(bytes(model))
    if isinstance(model, (str, os.PathLike)):
        return onnx.load(os.fspath(model))
    raise OnnxError(f"a model is a path, bytes or an onnx.ModelProto, not {type(model).__name__}")


def dynamic_dims(graph) -> bool:
    """Whether an input of the graph has a dimension without a fixed value (a dim_param or none)."""
    for vi in graph.input:
        tt = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and tt.HasField("shape"):
            if any(not d.HasField("dim_value") for d in tt.shape.dim):
                return True
    return False


class OnnxExecutor:
    """Runs one model on one device, node by node, replaying recorded launches when input shapes repeat.

    `symbolic_outer` (default: whether an input has a dynamic dimension) gives every kernel's outermost
    parallel range a symbolic extent, so a new batch size reuses the compiled programs."""

    def __init__(self, model: onnx.ModelProto | str | os.PathLike | bytes, device: Device | str | None = None,
                 compiler: str | None = None, profile: bool = False, symbolic_outer: bool | None = None) -> None:
        given = load_model(model)
        loaded_here = given is not model     # read from a path or bytes: no one else holds the message
        model = fuse(given)      # BatchNorm folding, epilogues, pooling kernels (onnx/fuse.py)
        owned = model is not given or loaded_here
        if loaded_here and model is not given:
            del given            # its weights are copied into fuse's model: the peak holds one copy, not two
            given = None
        self.model = model
        self.graph = model.graph
        self.dev = device if isinstance(device, Device) else get_device(device)
        self.k = Kernels(self.dev, compiler, profile,
                         dynamic_dims(self.graph) if symbolic_outer is None else symbolic_outer)
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
        for vi in list(self.graph.input) + list(self.graph.output):
            check_type(vi.type, vi.name)
        self.input_types = {vi.name: vi.type for vi in self.graph.input}
        for n in self.graph.node:
            if n.domain not in ("", "ai.onnx", PREVIEW):
                raise UnsupportedOp(f"domain {n.domain!r} of node {n.name or n.op_type}")
            if not supported(n.op_type, self.opset):
                raise UnsupportedOp(f"op {n.op_type} is not implemented")
            for a in n.attribute:
                if a.name == "to" and n.op_type == "Cast":
                    check_dtype(a.i)
                if a.type == onnx.AttributeProto.TENSOR:
                    check_dtype(a.t.data_type)
        self.weights: dict[str, View] = {}
        for init in self.graph.initializer:
            check_dtype(init.data_type)
            v = self.weights[init.name] = self.k.from_numpy(numpy_helper.to_array(init), const=True)
            if v.host is not None and v.host.nbytes > HOST_COPY_MAX_BYTES:
                v.host = None
            if owned and v.host is None:
                # uploaded: the message's bytes go now, so loading holds about one extra copy of one tensor
                # at a time rather than of every weight (light resnet50: 97 MB of weights)
                for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                    init.ClearField(field)
        self.input_names = [i.name for i in self.graph.input if i.name not in self.weights]
        # every graph input a tensor (no sequence or optional): a run converts each feed without asking its type
        self._tensor_inputs = all(_is_tensor(tp) for tp in self.input_types.values())
        if owned:
            # fuse's own copy (or the message read here): its initializers now live on the device. A protobuf
            # message's memory goes with the whole message, so the graph is kept as a copy without them
            del model.graph.initializer[:]
            slim = onnx.ModelProto()
            slim.CopyFrom(model)
            self.model, self.graph = slim, slim.graph
        # recorded launches per input-shape key: (plan, input views, output views, the env it points at)
        self.plans: dict[tuple, tuple[ExecutionPlan, dict, list, dict]] = {}
        self.dynamic = False
        self.last_run_s = 0.0
        self.memory_plan: MemoryPlan | None = None     # of the last run that recorded a plan on an arena
        self.concat_views = concat_views_enabled()
        self.zero_copy: dict[tuple, ZeroCopy] = {}      # per recorded plan's key, found at its first replay

    # ---- host values ------------------------------------------------------------------------
    def _value(self, v, tp: onnx.TypeProto, name: str):
        """A fed sequence (a list of arrays) or optional (None or its value) as the graph holds it."""
        kind = tp.WhichOneof("value")
        if kind == "optional_type":
            return Opt(None if v is None else self._value(v, tp.optional_type.elem_type, name))
        if kind == "sequence_type":
            et = tp.sequence_type.elem_type
            dt = O.common.ONNX_DT.get(et.tensor_type.elem_type) if et.HasField("tensor_type") else None
            return Seq([self._value(x, et, name) for x in v], dt)
        arr = numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else np.asarray(v)
        try:
            from_numpy(arr.dtype)
        except TypeError:
            raise UnsupportedDtype(f"input {name} holds {arr.dtype}") from None
        return self.k.from_numpy(arr)

    def _host_value(self, v):
        """An output on the host: a numpy array, a list of them (a sequence), or None (an empty optional)."""
        if isinstance(v, Opt):
            return None if v.value is None else self._host_value(v.value)
        if isinstance(v, Seq):
            return [self._host_value(x) for x in v]
        return self.k.numpy(v) if v.host is None else np.array(v.host)

    def host(self, v: View) -> np.ndarray:
        """The value of `v` on the host (a sync); reading one that depends on the runtime inputs makes
        the run's launch list unreplayable."""
        if not v.const:
            self.dynamic = True
        if v.host is None:
            v.host = self.k.numpy(v)
        return v.host

    # ---- running ----------------------------------------------------------------------------
    def run_function_body(self, node, ins: list, opset: int, name: str, env: dict | None = None) -> list:
        """Run `node` as the function of other ops the spec defines it by (an op implemented here may
        call this for the modes it leaves out); returns its outputs, also written into `env` if given."""
        schema = function_of(node.op_type, opset)
        if schema is None:
            raise UnsupportedOp(f"op {node.op_type} has no function body at opset {opset}")
        types = [onnx_type(v) if v is not None else onnx.TypeProto() for v in ins]
        body, body_opset = expand(node, schema, opset, types, name + "/")
        scope = {n: v for n, v in zip(node.input, ins) if n}
        scope[""] = None
        if env is not None:
            scope = {**env, **scope}
        self._run_nodes(body, scope, body_opset, name + "/")
        outs = [scope.get(o) if o else None for o in node.output]
        if env is not None:
            env.update({o: v for o, v in zip(node.output, outs) if o})
        return outs

    def _run_nodes(self, nodes, env: dict, opset: int, prefix: str) -> None:
        """Run `nodes` in order, reading and writing `env`; an op without an implementation here runs as
        the function the ONNX spec defines it by."""
        for idx, node in enumerate(nodes):
            ins = [env[i] if i in env else _missing(i, node) for i in node.input]
            name = prefix + (node.name or f"{node.op_type}_{idx}")
            impl = O.OPS.get(node.op_type)
            if impl is None:
                if function_of(node.op_type, opset) is None:
                    raise UnsupportedOp(f"op {node.op_type} is not implemented")
                self.run_function_body(node, ins, opset, name, env)
                continue
            ctx = O.Ctx(self, name, node, opset)
            ctx.env = env      # the names in scope: If, Loop and Scan run subgraphs that read outer names
            outs = impl(ctx, ins, attrs_of(node))
            for oname, v in zip(node.output, outs):
                if oname:
                    env[oname] = v

    def run(self, inputs: Mapping[str, np.ndarray] | Sequence[np.ndarray]) -> list[np.ndarray]:
        if not isinstance(inputs, AbcMapping):     # (collections.abc's: typing.Mapping's isinstance takes 3x as long)
            inputs = dict(zip(self.input_names, inputs))
        t0 = time.perf_counter()
        every = self._tensor_inputs
        tensors = every or all(_is_tensor(self.input_types.get(n)) for n in self.input_names)
        inputs = {n: _as_array(v) if every or _is_tensor(self.input_types.get(n)) else v for n, v in inputs.items()}
        key = tuple((n, inputs[n].shape, inputs[n].dtype.str) for n in self.input_names if n in inputs) \
            if tensors else None
        if key in self.plans:
            out = self._replay(key, inputs)
            self.last_run_s = time.perf_counter() - t0
            return out
        self.k.begin_run()        # also drops launches a failed run left queued
        self.k.concat_views = self.concat_views
        self.dynamic = False
        env: dict[str, View | None] = dict(self.weights)
        env[""] = None
        feeds = {}
        for n in self.input_names:
            if n not in inputs:
                raise OnnxError(f"missing input {n!r}")
            if not _is_tensor(self.input_types.get(n)):        # a sequence or an optional
                env[n] = self._value(inputs[n], self.input_types[n], n)
                continue
            arr = inputs[n]
            if isinstance(arr, onnx.TensorProto):
                arr = numpy_helper.to_array(arr)
            arr = np.asarray(arr)
            try:
                from_numpy(arr.dtype)
            except TypeError:
                raise UnsupportedDtype(f"input {n} holds {arr.dtype}") from None
            env[n] = feeds[n] = self.k.from_numpy(arr)
        self._run_nodes(self.graph.node, env, self.opset, "")
        outs = [env[o.name] for o in self.graph.output]
        tensor_outs = tensors and all(isinstance(v, View) for v in outs)
        if tensor_outs:     # an output a Concat moved is read from its root (which the memory plan keeps)
            outs = [v if v.host is not None else
                    View(self.k.resolve(v.buf), v.shape, v.strides, v.offset, v.const) for v in outs]
        arena: LaunchArena | None = None
        keep: list = []
        if tensor_outs and memplan_enabled():
            # what the launches must not move: weights, inputs, outputs, values filled from the host
            keep = [v.buf for v in self.weights.values()] + [v.buf for v in feeds.values()] + \
                [v.buf for v in outs] + list(self.k.host_filled)
        if keep and not self.k.launches:      # nothing ran yet: this run's launches go onto the arena
            def place(queue: list[tuple]) -> list[tuple]:
                nonlocal arena
                arena = plan_launches([(self.k.programs[ast.key], bufs) for _, ast, bufs, _ in queue], keep,
                                      align=self._arena_align())
                return [(name, ast, arena.replace(bufs), vars) for name, ast, bufs, vars in queue]
            self.k.flush(place)   # the run's kernels compile together, then launch (tensor.Kernels.flush)
        else:
            self.k.flush()
        result = [self._host_value(v) for v in outs]
        if not self.dynamic and tensor_outs:
            if keep and arena is None and self.k.launches:     # launches ran mid-run: the replay moves
                arena = plan_launches(self.k.launches, keep, align=self._arena_align())
                self.k.launches[:] = arena.launches
            plan = ExecutionPlan(self.dev)
            for prog, bufs, vars in self.k.launches:
                plan.add(prog, *bufs, **vars)
            if len(self.plans) >= MAX_PLANS:
                self.zero_copy.pop(next(iter(self.plans)), None)
                self.plans.pop(next(iter(self.plans)))
            # what the plan points at stays alive: the plan holds its buffers (the arena's views hold the
            # arena); without an arena, every buffer of the run
            self.plans[key] = (plan, feeds, outs, env if arena is None else arena)
            if arena is not None:
                self.memory_plan = arena.plan
                if config.debug_level() >= 1:
                    config.log(arena.plan.describe(limit=0))
        self.last_run_s = time.perf_counter() - t0
        return result

    def _replay(self, key: tuple, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Run the plan recorded for `key` on these inputs: without copies where `ZeroCopy` allows,
        else copying each input in and each output out."""
        plan, plan_inputs, plan_outputs, _ = self.plans[key]
        zc = None
        if config.onnx_zero_copy():
            zc = self.zero_copy.get(key)
            if zc is None or zc.plan is not plan:
                zc = self.zero_copy[key] = self._zero_copy_of(plan, plan_inputs, plan_outputs)
        bind: dict[BufferSlot, np.ndarray | tuple[int, int]] = {}
        for n, v in plan_inputs.items():
            arr = inputs[n]
            got = zc.inputs.get(n) if zc is not None else None
            if got is not None and arr.dtype == got[1] and arr.flags.c_contiguous:
                ptr = arr.__array_interface__["data"][0]
                if ptr % Buffer.VIEW_ALIGN == 0:
                    # (address, bytes): checked here, and the plan never writes a bound input (`_zero_copy_of`), so
                    # the plan need not take the array's address again
                    bind[got[0]] = (ptr, arr.nbytes)
                    continue
            if arr.size:        # an empty input's buffer holds one unused element
                v.buf.copyin(np.ascontiguousarray(arr).reshape(-1))
        fresh: list[np.ndarray | None] = [None] * len(plan_outputs)
        if zc is not None:
            for i, o in enumerate(zc.outputs):
                if o is not None:
                    fresh[i] = bind[o[0]] = self._output_array(zc.spare[i], o)
        if bind:
            plan.run(bind=bind)
        else:
            plan.run()
        return [a if a is not None else np.array(v.host) if v.host is not None else self.k.numpy(v)
                for a, v in zip(fresh, plan_outputs)]

    def _output_array(self, spare: list[np.ndarray], out: tuple[BufferSlot, tuple[int, ...], np.dtype]) -> np.ndarray:
        """The array an output is written into: a spare one nothing else holds, else a fresh one (kept
        as a spare, the oldest spare dropped)."""
        for i in range(len(spare)):
            if unheld(spare, i):
                arr = spare.pop(i)
                spare.append(arr)
                return arr
        slot, shape, dt = out
        arr = fresh_array(shape, dt, slot.nbytes, self._arena_align())
        if arr.base is None or arr.base.base is not None:   # not a view of its memory's owner: not kept
            return arr
        if len(spare) >= SPARE_OUTPUTS:
            del spare[0]
        if SPARE_OUTPUTS:
            spare.append(arr)
        return arr

    def _zero_copy_of(self, plan: ExecutionPlan, feeds: dict, outs: list) -> ZeroCopy:
        """Which inputs and outputs of a recorded plan its replays bind to arrays (see the module's
        docstring): an input the launches never write and no output shares; an output that is a whole
        contiguous buffer some launch writes, sharing memory with no input, weight, value filled from
        the host or other output."""
        none = ZeroCopy(plan, {}, [None] * len(outs), [[] for _ in outs])
        if not plan.host_memory or not plan.steps:
            return none

        def slot_of(buf: Buffer) -> BufferSlot | None:
            try:
                return plan.slot(buf)
            except LaunchError:      # no launch passes it, or one passes memory overlapping it in part
                return None

        inputs: dict[str, tuple[BufferSlot, np.dtype]] = {}
        for n, v in feeds.items():
            if v.size == 0 or any(v.buf.same_memory(o.buf) for o in outs):
                continue
            slot = slot_of(v.buf)
            if slot is not None and not slot.written:
                inputs[n] = (slot, np.dtype(v.dtype.np))
        held = [w.buf for w in self.weights.values()] + [f.buf for f in feeds.values()]
        outputs: list[tuple[BufferSlot, tuple[int, ...], np.dtype] | None] = []
        for i, v in enumerate(outs):
            whole = (v.host is None and v.size > 0 and v.offset == 0 and v.buf.size == v.size and v.is_contiguous()
                     and v.buf not in self.k.host_filled and not any(v.buf.same_memory(b) for b in held)
                     and not any(j != i and v.buf.same_memory(o.buf) for j, o in enumerate(outs)))
            slot = slot_of(v.buf) if whole else None
            dt = np.dtype(v.dtype.np)
            if slot is None or not slot.written or dt.itemsize * v.size != slot.nbytes:
                outputs.append(None)
            else:
                outputs.append((slot, tuple(v.shape), dt))
        return ZeroCopy(plan, inputs, outputs, [[] for _ in outs])

    def _arena_align(self) -> int:
        """Bytes each arena buffer is aligned to: 64 on the CPU (the streaming stores' promise, a cache
        line), 256 elsewhere (what cuMemAlloc and hipMalloc give a buffer of its own)."""
        return 64 if self.dev.spec.type == "CPU" else 256

    def memory_report(self) -> dict[str, int] | None:
        """Bytes of the last recorded plan's arena beside what its intermediates take each in its own
        buffer (and the most live at one launch); None when no run recorded a plan on an arena."""
        mp = self.memory_plan
        if mp is None:
            return None
        return {"arena_bytes": mp.arena_bytes, "naive_bytes": mp.naive_bytes, "live_peak_bytes": mp.live_peak_bytes,
                "buffers": len(mp.offsets), "pinned": len(mp.pinned), "launches": mp.steps}


def onnx_type(v) -> onnx.TypeProto:
    """The TypeProto of a value: a tensor view (element type and static shape), a Seq or an Opt."""
    if isinstance(v, Opt):
        return helper.make_optional_type_proto(onnx_type(v.value) if v.value is not None else onnx.TypeProto())
    if isinstance(v, Seq):
        elem = onnx_type(v[0]) if v else helper.make_tensor_type_proto(O.common.ONNX_ELEM[v.dtype], None)
        return helper.make_sequence_type_proto(elem)
    return helper.make_tensor_type_proto(O.common.ONNX_ELEM[v.dtype], list(v.shape))


def _as_array(v: Any) -> np.ndarray:
    """A tensor feed as a numpy array: an array as it is, a TensorProto decoded, anything else through np.asarray."""
    if type(v) is np.ndarray:
        return v
    return numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else np.asarray(v)


def _is_tensor(tp: onnx.TypeProto | None) -> bool:
    return tp is None or tp.WhichOneof("value") in (None, "tensor_type")


def check_type(tp: onnx.TypeProto, name: str) -> None:
    """Refuse a graph input or output whose type the executor cannot hold: tensors of a morok_py dtype,
    sequences of them and optionals of either are held; maps and sparse tensors are not."""
    kind = tp.WhichOneof("value")
    if kind is None:                # no type given: whatever the graph computes
        return
    if kind == "tensor_type":
        check_dtype(tp.tensor_type.elem_type)
    elif kind == "sequence_type":
        check_type(tp.sequence_type.elem_type, name)
    elif kind == "optional_type":
        check_type(tp.optional_type.elem_type, name)
    else:
        raise UnsupportedDtype(f"{name} is not a tensor, sequence or optional ({kind})")


def function_of(op_type: str, opset: int) -> onnx.defs.OpSchema | None:
    """The schema of an op (default domain, else ai.onnx.preview) the spec defines as a function of other ops."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        try:        # ops still in the preview domain (FlexAttention), at their newest version
            schema = onnx.defs.get_schema(op_type, domain=PREVIEW)
        except onnx.defs.SchemaError:
            return None
    if schema.function_opset_versions or schema.context_dependent_function_opset_versions:
        return schema
    return None


def supported(op_type: str, opset: int) -> bool:
    """Whether the executor runs a default-domain op: implemented here, or defined by a function of ops."""
    return op_type in O.OPS or function_of(op_type, opset) is not None


def expand(node, schema, opset: int, in_types: list[onnx.TypeProto], prefix: str) -> tuple[list, int]:
    """The node replaced by its schema's function body (its internal names prefixed), and the body's
    default-domain opset. Context-dependent bodies (Attention, RMSNormalization, ...) see the input types."""
    from onnx.backend.test.case.node import function_expand_helper   # onnx's own inliner for these bodies
    node = copy.deepcopy(node)
    have = {a.name for a in node.attribute}
    for name, attr in schema.attributes.items():
        if name not in have and attr.default_value and attr.default_value.name:
            node.attribute.append(attr.default_value)
    # the body of the newest version at or below the model's opset; an op whose body was written later
    # than the op (Shrink: op 9, body 18) takes its first body, which computes the same function
    plain = [v for v in schema.function_opset_versions if v <= opset] or sorted(schema.function_opset_versions)[:1]
    ctx = ([v for v in schema.context_dependent_function_opset_versions if v <= opset]
           or sorted(schema.context_dependent_function_opset_versions)[:1])
    fn = onnx.FunctionProto()
    if ctx and (not plain or max(ctx) >= max(plain)):
        fn.ParseFromString(schema.get_context_dependent_function_with_opset_version(
            max(ctx), node.SerializeToString(), [t.SerializeToString() for t in in_types]))
    elif plain:
        fn.ParseFromString(schema.get_function_with_opset_version(max(plain)))
    else:
        raise UnsupportedOp(f"op {node.op_type} has no function body at opset {opset}")
    body_opset = next((o.version for o in fn.opset_import if o.domain in ("", "ai.onnx")), opset)
    return function_expand_helper(node, fn, prefix), body_opset


def _missing(name: str, node):
    raise OnnxError(f"input {name!r} of node {node.name or node.op_type} is not computed")
