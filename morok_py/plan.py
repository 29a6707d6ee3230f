"""ExecutionPlan: a prepared list of launches a graph executor replays many times."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from . import config
from .buffer import Buffer
from .device import Program
from .errors import LaunchError, MorokError
from .launch import check_buffers, check_launch


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
                self.names.add(v)
        self.steps.append(_Step(program, tuple(buffers), [b.ptr for b in buffers], dict(vars), (), (), []))
        self._forget_bindings()
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

    def run(self, wait: bool = False, **values: int) -> float | None:
        """Run every launch in order; with wait=True, block and return the elapsed seconds."""
        if self._bound != values or not self._valid:
            self._bind(values)
            self._native = self._captures.get(tuple(sorted(values.items())))
        native = self._native
        if native is not None:
            return native(wait)
        if self.auto_capture and not self._capture_failed and self._can_capture():
            key = tuple(sorted(values.items()))
            runs = self._runs[key] = self._runs.get(key, 0) + 1
            if runs >= self.CAPTURE_AFTER and self._auto_capture(key) is not None:
                return self._native(wait)
        import time
        t0 = time.perf_counter()
        for st in self.steps:
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
        replaying its launches (said under MOROK_DEBUG=1)."""
        try:
            native = self.device.capture_plan(self)
        except MorokError as e:
            self._capture_failed = True
            if config.debug_level() >= 1:
                config.log(f"plan on {self.device.name}: not captured, replaying launches ({e})")
            return None
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
