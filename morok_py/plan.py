"""ExecutionPlan: a prepared list of launches a graph executor replays many times."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from . import config
from .buffer import Buffer
from .device import Program
from .errors import BufferFreedError, LaunchError, MorokError
from .launch import check_buffers, check_launch


# keyword arguments of ExecutionPlan.run itself, which no plan-level variable may be named
RUN_ARGS = frozenset({"wait", "bind"})


@contextmanager
def _naming_step(index: int, program: Program) -> Iterator[None]:
    """Re-raise a LaunchError (same class) with the plan step it came from in front of its message."""
    try:
        yield
    except LaunchError as e:
        msg = str(e)
        where = f"plan step {index}" if msg.startswith(program.name) else f"plan step {index} ({program.name})"
        raise type(e)(f"{where}: {msg}") from None


@dataclass
class _Step:
    program: Program
    buffers: tuple[Buffer, ...]
    ptrs: list[int]
    bindings: dict[str, Any]      # variable -> int, or plan-level name (str) bound at run()
    gs: tuple
    ls: tuple
    ordered: list[int]


@dataclass(frozen=True, eq=False)
class BufferSlot:
    """Where a plan's launches pass one buffer's memory, found once by `ExecutionPlan.slot`: `places`
    are (step, argument, byte offset from the buffer's start) for the buffer and for every plan buffer
    that lies inside its memory (views of it, such as a memory plan's or a Concat's). `written`: some
    launch writes through one of them. Slots compare and hash by identity."""
    plan: "ExecutionPlan" = field(repr=False)
    generation: int
    buffer: Buffer
    start: int          # the buffer's address (fixed while it lives; the plan holds it)
    nbytes: int
    places: tuple[tuple[int, int, int], ...]
    written: bool


def _memory_of(mem: Any) -> tuple[int, int, bool]:
    """(address, bytes, writable) of what a slot is bound to: a C-contiguous numpy array, a Buffer, or
    a (pointer, nbytes) pair the caller vouches for."""
    if isinstance(mem, np.ndarray):
        flags = mem.flags
        if not flags.c_contiguous:
            raise LaunchError(f"a bound array must be C-contiguous; got strides {mem.strides} for shape {mem.shape}")
        return mem.__array_interface__["data"][0], mem.nbytes, flags.writeable
    if isinstance(mem, Buffer):
        if not getattr(mem.device.allocator, "host_memory", False):
            raise LaunchError(f"{mem!r} is not host memory; a slot is bound to host memory")
        return mem.ptr, mem.nbytes, True
    if isinstance(mem, tuple) and len(mem) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in mem):
        return mem[0], mem[1], True
    raise LaunchError(f"a slot is bound to a numpy array, a Buffer or a (pointer, nbytes) pair, "
                      f"not {type(mem).__name__}")


class ExecutionPlan:
    """Launches checked once per value set and replayed with little Python work.

    Variables may be bound to a fixed int or to a plan-level name: `plan.add(prog, a, b, n="N")`
    then `plan.run(N=1000)` rebinds them (re-checking bounds once per new value set). Where the
    device can capture a plan (CUDA graphs), `run` captures it by itself the second time it runs
    with one value set (a value set seen once is not worth a capture) and replays the capture from
    then on; up to CAPTURES value sets keep their capture. `capture=False` always replays the
    launches one by one.

    A rebind is transactional: every step is checked before any changes, so a run whose values one
    step refuses leaves the plan bound as before. The plan holds its buffers (they live as long as it
    does); freeing one explicitly is allowed, and the next `run` raises BufferFreedError (a
    LaunchError) naming the step that uses it. `add` runs every check of the direct call.

    On a device whose buffers are host memory (`allocator.host_memory`: the CPU), a run may stand other
    memory in for a plan buffer: `slot = plan.slot(buf)` finds once where the launches pass it, and
    `plan.run(bind={slot: array})` runs them on the array's memory instead (a graph executor's inputs
    and outputs without copies). A binding is checked for size, 16-byte alignment and (arrays) C order
    and writability; that it holds the buffer's dtype is the caller's to see to. Every binding is
    checked before any pointer changes and the plan's own buffers are back in place when the run
    returns, raised or not. A bound run replays the launches one by one: a capture holds the pointers
    it was made with (no host-memory device captures today).
    """

    CAPTURES = 8
    CAPTURE_AFTER = 2     # runs of one value set before it is captured

    def __init__(self, device=None, *, capture: bool = True) -> None:
        self.device = device
        self.steps: list[_Step] = []
        self.names: set[str] = set()
        self.auto_capture = capture
        self._bound: dict[str, int] | None = None
        self._native: Callable[[bool], float | None] | None = None
        # per value set (sorted items): a capture, or how often it ran uncaptured
        self._captures: dict[tuple, Any] = {}
        self._runs: dict[tuple, int] = {}
        self._valid: dict[str, bool] = {}   # emptied by Buffer.free of any buffer of the plan
        self._capture_failed = False
        self._generation = 0                # steps added so far: a slot found before a later add is stale
        self._slots: dict[int, BufferSlot] = {}     # id(buffer) -> its slot (the plan holds the buffer)

    def add(self, program: Program, *buffers: Buffer, **vars: Any) -> "ExecutionPlan":
        """Append a launch; runs every check of the direct call `program(*buffers, **vars)` that its
        values allow now (all of them when every variable is an int; plan-level names at `run`)."""
        if self.device is not None and program.device is not self.device:
            raise LaunchError(f"plan runs on {self.device.name}; {program.name} is loaded on {program.device.name}")
        step = len(self.steps)
        with _naming_step(step, program):
            if any(isinstance(v, str) for v in vars.values()):
                check_buffers(program, buffers)
                # names, types and ranges of the fixed values (a plan-level name stands in as its variable's min)
                lows = {v.name: v.min for v in program.launch.variables}
                program.launch.values_from({k: (lows.get(k, 0) if isinstance(v, str) else v) for k, v in vars.items()})
            else:
                check_launch(program, buffers, vars)
        if self.device is None:
            self.device = program.device
        for v in vars.values():
            if isinstance(v, str):
                if v in RUN_ARGS:
                    raise LaunchError(f"{program.name}: {v!r} names an argument of run(); pick another plan-level name")
                self.names.add(v)
        self.steps.append(_Step(program, tuple(buffers), [b.ptr for b in buffers], dict(vars), (), (), []))
        self._forget_bindings()
        self._generation += 1
        self._slots.clear()
        return self

    def _forget_bindings(self) -> None:
        self._bound = None
        self._native = None
        self._captures.clear()
        self._runs.clear()
        self._valid.clear()

    def _bind(self, values: Mapping[str, int]) -> None:
        missing = self.names - set(values)
        if missing:
            raise LaunchError(f"plan needs values for {sorted(missing)}")
        extra = set(values) - self.names
        if extra:
            raise LaunchError(f"plan has no variable(s) {sorted(extra)}; it takes {sorted(self.names)}")
        if not self._valid:       # first bind, or a buffer was freed: every capture holds old pointers
            self._forget_bindings()
        # validate every step, then commit: a step that fails its check leaves every step as it was
        bound = []
        for i, st in enumerate(self.steps):
            concrete = {k: (values[v] if isinstance(v, str) else v) for k, v in st.bindings.items()}
            with _naming_step(i, st.program):
                vals, ptrs, ordered, gs, ls = check_launch(st.program, st.buffers, concrete)
            bound.append((ptrs, gs, ls, ordered))
        for st, (ptrs, gs, ls, ordered) in zip(self.steps, bound):
            st.ptrs, st.gs, st.ls, st.ordered = ptrs, gs, ls, ordered
        if not self._valid:
            self._valid["bound"] = True
            seen: set[int] = set()
            for st in self.steps:
                for b in st.buffers:
                    if id(b) not in seen and hasattr(b, "forget_on_free"):
                        seen.add(id(b))
                        b.forget_on_free(self._valid, "bound")
        self._bound = dict(values)

    def run(self, wait: bool = False, bind: Mapping[BufferSlot | Buffer, Any] | None = None,
            **values: int) -> float | None:
        """Run every launch in order; with wait=True, block and return the elapsed seconds. `bind` maps
        slots (or plan buffers) to the memory that stands for them in this run (see `slot`)."""
        if bind:
            return self._run_bound(bind, wait, values)
        if self._bound != values or not self._valid:
            self._bind(values)
            self._native = self._captures.get(tuple(sorted(values.items())))
        native = self._captured(values)
        if native is not None:
            return native(wait)
        return self._launch(self.steps, wait)

    def _captured(self, values: Mapping[str, int]):
        """The capture for these (bound) values: the one made, or one made now where this value set has run
        CAPTURE_AFTER times uncaptured; else None."""
        native = self._native
        if native is not None:
            if not getattr(native, "expired", False):
                return native
            # a capture that asks to be made again (the CPU's keep their launches' choices for so many replays)
            native.expire()
            self._captures = {k: v for k, v in self._captures.items() if v is not native}
            self._native = None
            return None
        if self.auto_capture and not self._capture_failed and self._can_capture():
            key = tuple(sorted(values.items()))
            runs = self._runs[key] = self._runs.get(key, 0) + 1
            if runs >= self.CAPTURE_AFTER:
                return self._auto_capture(key)
        return None

    @property
    def host_memory(self) -> bool:
        """Whether the plan's buffers are host memory, so that `slot` and `run(bind=...)` can rebind them."""
        return bool(getattr(getattr(self.device, "allocator", None), "host_memory", False))

    def slot(self, buffer: Buffer) -> BufferSlot:
        """Where the launches pass `buffer`'s memory, found once for `run(bind={slot: memory})`: every
        argument that is `buffer` or a plan buffer inside its memory (at its byte offset there). Raises
        LaunchError where the plan's buffers are not host memory, where no launch passes the memory, or
        where a launch passes a buffer that overlaps it only in part (it cannot move with it)."""
        got = self._slots.get(id(buffer))
        if got is not None and got.buffer is buffer:
            return got
        if not isinstance(buffer, Buffer):
            raise LaunchError(f"a slot is found for a Buffer of the plan, not {type(buffer).__name__}")
        if not self.host_memory:
            where = self.device.name if self.device is not None else "no device (an empty plan)"
            raise LaunchError(f"plan on {where}: its buffers are not host memory, so a run cannot rebind them")
        if buffer.device is not self.device:
            raise LaunchError(f"{buffer!r} lives on {buffer.device.name}, the plan on {self.device.name}")
        base = buffer.ptr
        end = base + buffer.nbytes
        places: list[tuple[int, int, int]] = []
        written = False
        for i, st in enumerate(self.steps):
            params = st.program.launch.params
            for j, b in enumerate(st.buffers):
                if b is not buffer:
                    p = b._ptr
                    if p is None:
                        raise BufferFreedError(f"plan step {i} ({st.program.name}): buffer {j} ({b!r}) was freed")
                    if b.device is not buffer.device or p >= end or p + b.nbytes <= base:
                        continue
                    if p < base or p + b.nbytes > end:
                        raise LaunchError(f"plan step {i} ({st.program.name}) passes {b!r} as buffer {j}, which "
                                          f"overlaps {buffer!r} in part: the memory cannot be rebound")
                else:
                    p = base
                places.append((i, j, p - base))
                written = written or bool(params[j].written)
        if not places:
            raise LaunchError(f"{buffer!r} is not passed to any step of the plan (nor is memory inside it)")
        slot = self._slots[id(buffer)] = BufferSlot(self, self._generation, buffer, base, buffer.nbytes,
                                                    tuple(places), written)
        return slot

    def _run_bound(self, bind: Mapping[BufferSlot | Buffer, Any], wait: bool, values: dict) -> float | None:
        """`run` with memory standing in for slots: checked, pointers swapped, the launches one by one (a
        capture holds the pointers it was made with), the plan's own pointers put back."""
        if self._bound != values or not self._valid:
            self._bind(values)
            self._native = self._captures.get(tuple(sorted(values.items())))
        entries: list[tuple[BufferSlot, int, int]] = []
        for key, mem in bind.items():
            slot = key if isinstance(key, BufferSlot) else self.slot(key)
            if slot.plan is not self or slot.generation != self._generation:
                raise LaunchError(f"the slot of {slot.buffer!r} was found in "
                                  f"{'another plan' if slot.plan is not self else 'this plan before a step was added'}")
            ptr, nbytes, writable = _memory_of(mem)
            if nbytes < slot.nbytes:
                raise LaunchError(f"{slot.buffer!r} ({slot.nbytes} bytes) bound to {nbytes} bytes")
            if ptr % Buffer.VIEW_ALIGN:
                raise LaunchError(f"{slot.buffer!r} bound to memory at {ptr:#x}, not {Buffer.VIEW_ALIGN}-byte "
                                  f"aligned (kernels load vectors that assume it)")
            if slot.written and not writable:
                raise LaunchError(f"{slot.buffer!r} is written by the plan and bound to a read-only array")
            entries.append((slot, ptr, nbytes))
        if len(entries) > 1:
            for a in range(len(entries)):
                sa, pa, na = entries[a]
                for b in range(a):
                    sb, pb, nb = entries[b]
                    if sa.start < sb.start + sb.nbytes and sb.start < sa.start + sa.nbytes:
                        raise LaunchError(f"{sa.buffer!r} and {sb.buffer!r} share memory in the plan: bind one of them")
                    if (sa.written or sb.written) and pa < pb + nb and pb < pa + na:
                        raise LaunchError(f"{sa.buffer!r} and {sb.buffer!r} are bound to overlapping memory "
                                          f"and the plan writes one of them")
        if getattr(self.device, "capture_binds", False):
            # a capture that takes other memory for given arguments of one replay (the CPU's)
            native = self._captured(values)
            if native is not None:
                patches = [(i, j, ptr + off) for slot, ptr, _ in entries for i, j, off in slot.places]
                if native.accepts(patches):
                    return native.run(wait, patches)
        steps = self.steps
        saved: list[tuple[list[int], int, int]] = []
        try:
            for slot, ptr, _ in entries:
                for i, j, off in slot.places:
                    ptrs = steps[i].ptrs
                    saved.append((ptrs, j, ptrs[j]))
                    ptrs[j] = ptr + off
            return self._launch(steps, wait)
        finally:
            for ptrs, j, p in reversed(saved):
                ptrs[j] = p

    def _launch(self, steps: list, wait: bool) -> float | None:
        """Run the bound launches of `steps` in order; with wait, block and return the seconds taken."""
        t0 = time.perf_counter()
        for st in steps:
            st.program.execute(st.ptrs, st.ordered, st.gs, st.ls)
        if wait:
            if self.device is not None:
                self.device.synchronize()
            return time.perf_counter() - t0
        return None

    def _can_capture(self) -> bool:
        return bool(self.steps) and getattr(self.device, "capture_plan", None) is not None

    def _auto_capture(self, key: tuple):
        """Capture the bound launches for this value set; a device that refuses leaves the plan
        replaying its launches (said under MOROK_DEBUG=1). A device that answers None is not ready yet (the CPU
        while a launch still times its split): asked again after CAPTURE_AFTER more runs."""
        try:
            native = self.device.capture_plan(self)
        except MorokError as e:
            self._capture_failed = True
            if config.debug_level() >= 1:
                config.log(f"plan on {self.device.name}: not captured, replaying launches ({e})")
            return None
        if native is None:
            self._runs.pop(key, None)
            return None
        describe = getattr(native, "describe", None)
        if describe is not None and config.debug_level() >= 1:
            config.log(f"plan on {self.device.name}: {describe()}")
        if len(self._captures) >= self.CAPTURES:
            self._captures.pop(next(iter(self._captures)))
        self._captures[key] = self._native = native
        self._runs.pop(key, None)
        return native

    def capture(self, **values: int) -> "ExecutionPlan":
        """Capture the plan for these values now (CUDA graphs); a no-op where the device cannot."""
        self._bind(values)
        cap = getattr(self.device, "capture_plan", None)
        if cap is None:
            self._native = None
            return self
        key = tuple(sorted(values.items()))
        self._native = self._captures[key] = cap(self)
        return self

    @property
    def captured(self) -> bool:
        return self._native is not None
