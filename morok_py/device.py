"""The device contracts, spelled after morok's traits: DeviceSpec, ProgramSpec, CompiledSpec,
Renderer, Compiler, RuntimeFactory, Program, Allocator and Device."""
from __future__ import annotations

import abc
import functools
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from . import config
from .codegen.linear import LinearKernel
from .codegen.lower import Capabilities, LaunchInfo, Variable, lower
from .codegen.symbols import check_kernel_name, symbol_for
from .dtypes import DType
from .errors import (ArgumentError, ArgumentTypeError, ConfigError, DeviceError, DeviceUnavailableError,
                     OutOfMemoryError, UnknownNameError)
from .ir import UOp

if TYPE_CHECKING:
    import numpy as np

__all__ = ["DeviceSpec", "Variable", "ProgramSpec", "CompiledSpec", "Renderer", "Compiler",
           "RuntimeFactory", "Program", "Allocator", "Device", "Capabilities"]

_SPEC_RE = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_]*)\s*(?::\s*(\d+))?\s*$")


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed device string: `CPU`, `CUDA`, `CUDA:1`, `ROCM:0` (case-insensitive)."""

    type: str
    ordinal: int = 0

    @staticmethod
    def parse(text: "str | DeviceSpec") -> "DeviceSpec":
        if isinstance(text, DeviceSpec):
            return text
        if not isinstance(text, str):
            raise ArgumentTypeError(f"a device is named by a string like 'CUDA:1', got {text!r}")
        m = _SPEC_RE.match(text)
        if not m:
            raise UnknownNameError(f"cannot parse device {text!r}; expected NAME or NAME:ORDINAL, e.g. 'CPU', 'CUDA:1'")
        return DeviceSpec(m.group(1).upper(), int(m.group(2) or 0))

    def base_type(self) -> str:
        return self.type

    def __str__(self) -> str:
        return self.type if self.type == "CPU" else f"{self.type}:{self.ordinal}"


@dataclass(frozen=True)
class ProgramSpec:
    """Renderer output: the source plus everything a launch needs to know."""

    name: str
    src: str
    device: DeviceSpec
    ast: UOp
    global_size: tuple[int, int, int] | None
    local_size: tuple[int, int, int] | None
    vars: tuple[Variable, ...]
    var_names: tuple[str, ...]
    globals: tuple[int, ...]
    outs: tuple[int, ...]
    ins: tuple[int, ...]
    buf_count: int
    launch: LaunchInfo = field(repr=False, compare=False)
    linear: LinearKernel | None = field(default=None, repr=False, compare=False)
    param_dtypes: tuple[DType, ...] = ()

    @property
    def symbol(self) -> str:
        """The kernel's symbol in `src` (derived from `name` by `codegen.symbols.symbol_for`)."""
        return symbol_for(self.name)

    def launch_dims(self, values: Mapping[str, int] | Sequence[int] | None = None):
        """(global_size, local_size) for these variable values (checked against their bounds)."""
        return self.launch.launch_dims(values)


@dataclass(frozen=True)
class CompiledSpec:
    """Compiler output: `src` for JIT-style backends, `bytes` for AOT ones."""

    name: str
    src: str | None
    bytes: bytes | None
    ast: UOp
    var_names: tuple[str, ...]
    global_size: tuple[int, int, int] | None
    local_size: tuple[int, int, int] | None
    buf_count: int
    launch: LaunchInfo | None = field(default=None, repr=False, compare=False)
    arch: str = ""
    compiler: str = ""
    param_dtypes: tuple[DType, ...] = ()

    @staticmethod
    def from_source(spec: ProgramSpec, src: str, *, arch: str = "", compiler: str = "") -> "CompiledSpec":
        return CompiledSpec(spec.name, src, None, spec.ast, spec.var_names, spec.global_size, spec.local_size,
                            spec.buf_count, spec.launch, arch, compiler, spec.param_dtypes)

    @staticmethod
    def from_bytes(spec: ProgramSpec, data: bytes, *, arch: str = "", compiler: str = "") -> "CompiledSpec":
        return CompiledSpec(spec.name, None, bytes(data), spec.ast, spec.var_names, spec.global_size,
                            spec.local_size, spec.buf_count, spec.launch, arch, compiler, spec.param_dtypes)

    @property
    def symbol(self) -> str:
        """The symbol the runtime looks up: recomputed from `name`, the way the renderer derived it, so
        bytes read back from the disk cache are found too."""
        return symbol_for(self.name)

    @property
    def payload(self) -> bytes:
        return self.bytes if self.bytes is not None else (self.src or "").encode()


def kernel_name(ast: UOp, name: str | None) -> str:
    """The user's name for a kernel (any non-empty str; None: one derived from the AST). The symbol in
    the compiled output is `symbol_for(name)`; the name is what debug output, errors and profiles show."""
    if name is None:
        return "k_" + ast.key[:10]
    return check_kernel_name(name)


class Renderer(abc.ABC):
    """Turns a kernel AST into source text for one target; lowering is shared, this only prints."""

    caps: Capabilities = Capabilities()

    def __init__(self, device: DeviceSpec) -> None:
        self.device = device

    def decompositor(self) -> Callable[[UOp], UOp | None] | None:
        """A rewrite for ops this target lacks (None: it has them all)."""
        return None

    @abc.abstractmethod
    def render_kernel(self, kernel: LinearKernel) -> str:
        """Print a lowered kernel."""

    def render(self, ast: UOp, name: str | None = None) -> ProgramSpec:
        nm = kernel_name(ast, name)
        linear, info = lower(ast, self.caps, nm, self.decompositor())
        src = self.render_kernel(linear)
        gs = ls = None
        if not info.symbolic:
            gs, ls = info.launch_dims({})
        ins = tuple(p.slot for p in info.params if p.read and not p.written)
        return ProgramSpec(nm, src, self.device, ast, gs, ls, tuple(info.variables), tuple(info.var_names),
                           tuple(p.slot for p in info.params), tuple(p.slot for p in info.params if p.written),
                           ins, info.buf_count, info, linear, tuple(p.dtype for p in info.params))


class Compiler(abc.ABC):
    """Turns a ProgramSpec into a CompiledSpec; needs no device."""

    cache_key: str = ""
    arch: str = ""

    @abc.abstractmethod
    def compile(self, spec: ProgramSpec) -> CompiledSpec:
        ...

    def identity(self) -> str:
        """Toolchain identity for the disk cache key: versions, arch, features, options."""
        return f"{self.cache_key}/{self.arch}"

    def available(self) -> str | None:
        """None when usable here, else why not."""
        return None


RuntimeFactory = Callable[[CompiledSpec], "Program"]


class Program(abc.ABC):
    """A loaded kernel: `execute` takes raw addresses and variable values. The checked call
    `prog(*buffers, **vars)` is the launch layer's (`morok_py.launch.Program`), above the contracts."""

    def __init__(self, device: "Device", compiled: CompiledSpec) -> None:
        self.device = device
        self.compiled = compiled
        self.launch = compiled.launch
        self._dtypes = compiled.param_dtypes
        self._hidden: list[tuple[int, int]] = []

    def alloc_hidden(self) -> list[int]:
        """Allocate the kernel's hidden buffers (`LaunchInfo.hidden`, e.g. the partials and ticket
        counter of a two-stage reduction) on this device, zero-filled; the runtime passes them after
        the caller's buffers. They live as long as the program."""
        info = self.launch
        if info is None or not info.hidden:
            return []
        import numpy as np
        alloc = self.device.allocator
        for h in info.hidden:
            nbytes = h.count * h.dtype.itemsize
            ptr = alloc.alloc(nbytes)
            self._hidden.append((ptr, nbytes))
            alloc.copyin(ptr, np.zeros(h.count, dtype=h.dtype.np))
        return [p for p, _ in self._hidden]

    def free_hidden(self) -> None:
        hidden, self._hidden = self._hidden, []
        for ptr, nbytes in hidden:
            self.device.allocator.free(ptr, nbytes)

    @property
    def name(self) -> str:
        return self.compiled.name

    @abc.abstractmethod
    def execute(self, buffers: Sequence[int], vals: Sequence[int] = (),
                global_size: Sequence[int] | None = None, local_size: Sequence[int] | None = None,
                wait: bool = False) -> float | None:
        """Launch on raw buffer addresses with variable values in `var_names` order; with
        `wait=True` block until done and return the kernel's time in seconds."""

    def prepare(self, buffers: Sequence[int], vals: Sequence[int], global_size: Sequence[int],
                local_size: Sequence[int]) -> Callable[[], Any]:
        """A callable that repeats exactly this launch (not waiting), for a caller that replays one
        checked launch many times; runtimes override it to bind their arguments once. It returns
        None, or a tuple whose first item is a driver status, nonzero when the launch failed: then
        the caller hands both to `prepared_failed`."""
        return functools.partial(self.execute, list(buffers), list(vals), tuple(global_size), tuple(local_size))

    def prepared_failed(self, result: tuple, launch: Callable[[], Any]) -> None:
        """A prepared launch returned a nonzero status: raise it as a DeviceError (runtimes may first
        retry, e.g. after making their context current)."""
        raise DeviceError(f"{self.name} launch", int(result[0]), getattr(result[0], "name", str(result[0])))


class Allocator(abc.ABC):
    """Device memory with a cache of freed blocks by size, free-and-retry on OOM.

    Backends implement `_alloc`, `_free`, `copyin` and `copyout`; `transfer` is optional.
    Handles are integer addresses.
    """

    # handles are addresses of this process's host memory, which its kernels read and write: a plan may
    # then run on memory it did not allocate, such as a numpy array's (ExecutionPlan.slot)
    host_memory = False

    def __init__(self, device_name: str, cache_limit: int = 1 << 30) -> None:
        self.device_name = device_name
        self._cache: dict[int, list[int]] = {}
        self._cached_bytes = 0
        self.cache_limit = cache_limit
        self.in_use = 0
        self._lock = threading.Lock()

    @abc.abstractmethod
    def _alloc(self, nbytes: int) -> int:
        """Allocate fresh memory; raise MemoryError when the device is out of it."""

    @abc.abstractmethod
    def _free(self, handle: int, nbytes: int) -> None:
        ...

    @abc.abstractmethod
    def copyin(self, handle: int, src: "np.ndarray") -> None:
        """Copy a C-contiguous host array into the allocation (blocking)."""

    @abc.abstractmethod
    def copyout(self, dst: "np.ndarray", handle: int) -> None:
        """Copy the allocation into a C-contiguous host array (blocking)."""

    def transfer(self, dst: int, src: int, nbytes: int, src_allocator: "Allocator") -> None:
        raise NotImplementedError(f"{self.device_name} has no direct device-to-device transfer")

    def alloc(self, nbytes: int) -> int:
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ArgumentError(f"allocation size must be a non-negative int, got {nbytes!r}")
        size = max(nbytes, 1)
        with self._lock:
            bucket = self._cache.get(size)
            if bucket:
                handle = bucket.pop()
                self._cached_bytes -= size
                self.in_use += size
                return handle
        try:
            handle = self._alloc(size)
        except MemoryError:
            self.free_cache()
            try:
                handle = self._alloc(size)
            except MemoryError as e:
                raise OutOfMemoryError(self.device_name, size, self.in_use, str(e)) from None
        with self._lock:
            self.in_use += size
        return handle

    def free(self, handle: int, nbytes: int) -> None:
        size = max(nbytes, 1)
        with self._lock:
            self.in_use -= size
            if self._cached_bytes + size <= self.cache_limit:
                self._cache.setdefault(size, []).append(handle)
                self._cached_bytes += size
                return
        self._free(handle, size)

    def free_cache(self) -> int:
        """Return every cached block to the device; the number of bytes released."""
        with self._lock:
            items = [(h, s) for s, hs in self._cache.items() for h in hs]
            self._cache.clear()
            released, self._cached_bytes = self._cached_bytes, 0
        for h, s in items:
            self._free(h, s)
        return released

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes


class _DeviceMeta(abc.ABCMeta):
    @property
    def DEFAULT(cls) -> str:
        """`MOROK_DEVICE`, else CPU."""
        raw = config.getenv("MOROK_DEVICE", "CPU") or "CPU"
        try:
            return str(DeviceSpec.parse(raw))
        except UnknownNameError as e:
            raise ConfigError(f"MOROK_DEVICE={raw!r}: {e}") from None


class Device(metaclass=_DeviceMeta):
    """A device: an allocator, (renderer, compiler) pairs and a runtime factory. `Device.DEFAULT` is
    `MOROK_DEVICE` or CPU. Opening by name (`Device["CUDA:1"]`), compiling through the caches and
    allocating Buffers are the launch layer's (`morok_py.launch.Device`), above the contracts."""

    def __init__(self, spec: DeviceSpec, allocator: Allocator, compilers: list[tuple[Renderer, Compiler]],
                 runtime: RuntimeFactory, *, arch: str = "") -> None:
        if not compilers:
            raise ArgumentError(f"{spec}: a device needs at least one (renderer, compiler) pair")
        self.spec = spec
        self.device = spec
        self.allocator = allocator
        self.compilers = list(compilers)
        self.runtime = runtime
        self.arch = arch
        self.renderer, self.compiler = self._select_pair()
        from .codegen.schedule import load_strategies
        load_strategies(self.renderer.caps)

    @property
    def name(self) -> str:
        return str(self.spec)

    @property
    def base_device_key(self) -> str:
        return self.spec.base_type()

    def _select_pair(self) -> tuple[Renderer, Compiler]:
        want = config.compiler_choice(self.spec.type)
        if want is None:
            return self.compilers[0]
        for r, c in self.compilers:
            if c.cache_key == want:
                why = c.available()
                if why is not None:
                    raise DeviceUnavailableError(f"{self.name} compiler {want!r}", why)
                return r, c
        raise ConfigError(f"MOROK_{self.spec.type}_COMPILER={want!r} is not a compiler of {self.name}; "
                          f"registered: {', '.join(c.cache_key for _, c in self.compilers)}")

    def pair(self, cache_key: str) -> tuple[Renderer, Compiler]:
        for r, c in self.compilers:
            if c.cache_key == cache_key:
                return r, c
        raise UnknownNameError(f"{self.name} has no compiler {cache_key!r}; "
                               f"registered: {', '.join(c.cache_key for _, c in self.compilers)}")

    def synchronize(self) -> None:
        """Wait for all work queued on this device."""

    def info(self) -> dict[str, Any]:
        """What `morok devices` prints."""
        return {"arch": self.arch, "compilers": [c.cache_key for _, c in self.compilers]}

    def __repr__(self) -> str:
        return f"<Device {self.name} arch={self.arch} compiler={self.compiler.cache_key}>"
