"""ExecutionPlan: a prepared list of launches a graph executor replays many times."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .buffer import Buffer
from .device import Program
from .errors import LaunchError


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
    """Launches checked once at `add` time and replayed with little Python work.

    Variables may be bound to a fixed int or to a plan-level name: `plan.add(prog, a, b, n="N")`
    then `plan.run(N=1000)` rebinds them (re-checking bounds once per new value set).
    Devices may capture a plan natively (`capture()`); the default replays the launches.
    """

    def __init__(self, device=None) -> None:
        self.device = device
        self.steps: list[_Step] = []
        self.names: set[str] = set()
        self._bound: dict[str, int] | None = None
        self._native = None

    def add(self, program: Program, *buffers: Buffer, **vars: Any) -> "ExecutionPlan":
        if self.device is None:
            self.device = program.device
        elif program.device is not self.device:
            raise LaunchError(f"plan runs on {self.device.name}; {program.name} is loaded on {program.device.name}")
        info = program.launch
        if len(buffers) != info.buf_count:
            raise LaunchError(f"{program.name} takes {info.buf_count} buffer(s), got {len(buffers)}")
        for k, v in vars.items():
            if isinstance(v, str):
                self.names.add(v)
        self.steps.append(_Step(program, tuple(buffers), [b.ptr for b in buffers], dict(vars), (), (), []))
        self._bound = None
        self._native = None
        return self

    def _bind(self, values: Mapping[str, int]) -> None:
        missing = self.names - set(values)
        if missing:
            raise LaunchError(f"plan needs values for {sorted(missing)}")
        extra = set(values) - self.names
        if extra:
            raise LaunchError(f"plan has no variable(s) {sorted(extra)}; it takes {sorted(self.names)}")
        for st in self.steps:
            concrete = {k: (values[v] if isinstance(v, str) else v) for k, v in st.bindings.items()}
            # the full check of the friendly path, once per value set
            info = st.program.launch
            vals = info.values_from(concrete)
            gs, ls, bounds, _ = info.prepare(vals)
            p = st.program
            for i, (b, prm) in enumerate(zip(st.buffers, info.params)):
                if b.device is not p.device or b.dtype != prm.dtype:
                    raise LaunchError(f"{p.name}: buffer {i} must be {prm.dtype.name} on {p.device.name}")
            info.check_sizes(bounds, [b.size for b in st.buffers])
            st.gs, st.ls, st.ordered = gs, ls, [vals[n] for n in info.var_names]
        self._bound = dict(values)

    def run(self, wait: bool = False, **values: int) -> float | None:
        """Run every launch in order; with wait=True, block and return the elapsed seconds."""
        if self._bound != values:
            self._bind(values)
            self._native = None
        if self._native is not None:
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

    def capture(self, **values: int) -> "ExecutionPlan":
        """Ask the device to capture the plan for these values (CUDA graphs); a no-op elsewhere."""
        self._bind(values)
        cap = getattr(self.device, "capture_plan", None)
        self._native = cap(self) if cap is not None else None
        return self

    @property
    def captured(self) -> bool:
        return self._native is not None
