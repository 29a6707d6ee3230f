"""The launch layer: `Device` and `Program` as users and backends see them, above the contracts of
`morok_py.device`. It adds what needs buffers, caches and the registry: `Device["CUDA:1"]`,
`dev.compile(ast)` through the caches, `dev.buffer(n, dtype)`, and the checked call
`prog(*buffers, **vars)` with its memory of passed checks and the MOROK_VALIDATE_WITH_CPU hook.

Backends subclass these two classes; a program or device built on the bare contracts still works
with `execute`, plans and the caches, it only lacks the friendly calls."""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterable, Iterator

from . import config
from . import device as contracts
from .batch import compile_many
from .buffer import Buffer
from .cache import compile_through_caches
from .codegen.symbols import check_kernel_name
from .device import DeviceSpec
from .dtypes import as_dtype
from .errors import BufferFreedError, LaunchError
from .ir import UOp
from .registry import get_device
from .validate import validated_launch

__all__ = ["Device", "Program", "check_buffers", "check_launch"]

def check_buffers(program: contracts.Program, buffers: tuple) -> list[int]:
    """The launch checks that need no variable values: count, type, freed, device, dtype, aliasing of
    written buffers. Returns the buffer sizes; raises LaunchError (BufferFreedError for a freed one)."""
    info = program.launch
    name = program.name
    if info is None:
        raise LaunchError(f"{name}: compiled without launch information; use execute()")
    if len(buffers) != info.buf_count:
        raise LaunchError(f"{name} takes {info.buf_count} buffer(s), got {len(buffers)}")
    sizes = []
    dev = program.device
    for i, (b, p) in enumerate(zip(buffers, info.params)):
        if not isinstance(b, Buffer) and not (hasattr(b, "ptr") and hasattr(b, "dtype")):
            raise LaunchError(f"{name}: argument {i} must be a Buffer, got {type(b).__name__}")
        if getattr(b, "_ptr", 0) is None:
            raise BufferFreedError(f"{name}: buffer {i} ({b!r}) was freed")
        if b.device is not dev:
            raise LaunchError(f"{name}: buffer {i} lives on {b.device.name}, the program on {dev.name}")
        if b.dtype != p.dtype:
            raise LaunchError(f"{name}: buffer {i} holds {b.dtype.name}, the kernel expects {p.dtype.name}")
        sizes.append(b.size)
    for i, p in enumerate(info.params):
        if p.written:
            for j, b in enumerate(buffers):
                if j != i and b.same_memory(buffers[i]):
                    raise LaunchError(f"{name}: buffer {i} is written and also passed as buffer {j}; "
                                      f"kernels assume their buffers do not alias")
    return sizes


def check_launch(program: contracts.Program, buffers: tuple, values: dict) -> tuple:
    """Every launch check of `program(*buffers, **values)`: those of `check_buffers`, then variable
    names, types and bounds, index bounds against the buffer sizes. Returns (values by name, pointers,
    values in `var_names` order, global size, local size); raises LaunchError."""
    info = program.launch
    sizes = check_buffers(program, buffers)
    vals = info.values_from(values)
    gs, ls, bounds, _work = info.prepare(vals)
    info.check_sizes(bounds, sizes)
    ptrs = [b.ptr for b in buffers]
    return vals, ptrs, [vals[n] for n in info.var_names], gs, ls


_LAST = object()     # the key of the last buffer set that hit, in Program._checked beside the hashes


class _Seen:
    """The passed launch checks of one buffer set: weak proxies of its buffers, the prepared launch
    and check result per values (by `tuple(values.items())`), and the last values that hit."""
    __slots__ = ("bufs", "runs", "last_values", "last")

    def __init__(self, bufs: tuple) -> None:
        self.bufs = bufs
        self.runs: dict[tuple, tuple] = {}
        self.last_values: dict | None = None
        self.last: tuple | None = None


class Program(contracts.Program):
    """A loaded kernel with the checked call. `prog(*buffers, **vars)` checks every argument before
    the launch; a call with the same Buffer objects and the same int values as one that passed skips
    the checks and replays the launch the runtime prepared for it (`Program.prepare`).

    What a repeat re-checks is what can change: which buffers (by identity, compared with weak proxies
    of the remembered ones; a buffer's death or free() drops every remembered launch that used it),
    the values by name and their types (True and 16.0 equal 1 and 16). A Buffer's device, dtype and
    size never change and its memory goes only when it is freed or collected. MOROK_VALIDATE_WITH_CPU
    is read when a launch is checked: with it set, launches on a non-CPU device are not remembered
    (each is checked and validated)."""

    _CHECKED_MAX = 64

    def __init__(self, device: contracts.Device, compiled: contracts.CompiledSpec) -> None:
        super().__init__(device, compiled)
        # passed checks by the hash of the buffer tuple: a _Seen per buffer set, and under _LAST the set
        # that hit last; created on the first call
        self._checked: dict[Any, _Seen] | None = None
        self._on_cpu = device.spec.type == "CPU"     # validation with the CPU applies elsewhere only

    def __call__(self, *buffers: Buffer, wait: bool = False, **values: int) -> float | None:
        # The buffer set: the last one that hit, else by the tuple's hash. Identity is checked either way:
        # `buffers == seen.bufs` compares each Buffer with a weak proxy of a remembered one, True only
        # for that very object (Buffer keeps object's identity equality; a dead proxy raises).
        # Then the values: by name (dict equality; the last values first), then their types (True == 1
        # and 16.0 == 16, but the full check refuses them). Any miss, unhashable argument or stale
        # entry goes to the full check.
        try:
            checked = self._checked
            seen = checked[_LAST]
            if buffers != seen.bufs:
                seen = checked[hash(buffers)]
                if buffers != seen.bufs:
                    raise KeyError
                checked[_LAST] = seen
            if values:
                if values == seen.last_values:
                    hit = seen.last
                else:
                    hit = seen.runs[tuple(values.items())]
                    seen.last_values, seen.last = values, hit
                for v in values.values():
                    if v.__class__ is not int:
                        raise KeyError
            else:
                hit = seen.runs[()]
        except (AttributeError, KeyError, TypeError, ReferenceError):
            result = self._check(buffers, values)
            self._remember(buffers, values, result)
            return self._launch_checked(buffers, *result, wait)
        if wait:
            return self._launch_checked(buffers, *hit[1:], wait)
        r = hit[0]()
        if r is None or not r[0]:
            return None
        return self.prepared_failed(r, hit[0])

    def _check(self, buffers: tuple, values: dict) -> tuple:
        return check_launch(self, buffers, values)

    def _remember(self, buffers: tuple, values: dict, result: tuple) -> None:
        """Keep a passed check for plain Buffers and int values, until one of the buffers is freed or
        collected (weak proxies: a remembered launch never keeps a buffer alive)."""
        if any(type(b) is not Buffer for b in buffers) or any(type(v) is not int for v in values.values()):
            return
        if not self._on_cpu and config.validate_with_cpu():
            return
        checked = self._checked
        if checked is None:
            checked = self._checked = {}
        key = hash(buffers)
        seen = checked.get(key)
        if seen is None or buffers != seen.bufs:        # new, or another set with the same hash
            if len(checked) > self._CHECKED_MAX:
                checked.clear()
            forget = lambda _ref, key=key: checked.pop(key, None)   # noqa: E731
            seen = checked[key] = _Seen(tuple(weakref.proxy(b, forget) for b in buffers))
            # free() drops the set's entry and the shortcut to the last set (collection kills the proxies)
            for b in buffers:
                b.forget_on_free(checked, key)
                b.forget_on_free(checked, _LAST)
        elif len(seen.runs) >= self._CHECKED_MAX:
            seen.runs.clear()
        _vals, ptrs, ordered, gs, ls = result
        run = (self.prepare(ptrs, ordered, gs, ls),) + result
        seen.runs[tuple(values.items())] = run
        seen.last_values, seen.last = values, run
        checked[_LAST] = seen

    def _launch_checked(self, buffers, vals, ptrs, ordered, gs, ls, wait: bool) -> float | None:
        if not self._on_cpu and config.validate_with_cpu():
            return validated_launch(self, buffers, vals, lambda: self.execute(ptrs, ordered, gs, ls, wait=True))
        t = self.execute(ptrs, ordered, gs, ls, wait=wait)
        if wait and config.debug_level() >= 1:
            config.log(f"{self.device.name} {self.name}: {t * 1e6:.1f} us")
        return t


class _DeviceMeta(contracts._DeviceMeta):
    def __getitem__(cls, name: "str | DeviceSpec") -> contracts.Device:
        return get_device(name)


_NEVER = object()     # StreamMarks._idle before any check: no `_queued` value is it


class StreamMarks:
    """What is pending on a GPU device's one stream, known without a driver call where it can be.

    Every launch, copy or wait queued on the stream calls `stream_used()` after queuing it (the runtimes
    inline it as `_queued = None`). A check that finds the stream idle (`stream_idle`'s query, `synchronized`)
    first puts a fresh token in `_queued`, then on success copies it to `_idle`: `_queued is _idle` then
    means nothing was queued since a check that saw everything before it done. Lock-free: work queued while
    a check runs leaves `_queued` None (or another check's token), never the token that check confirms.
    A backend supplies `_stream_query()` (True: everything queued is done) and its synchronize.

    DLPack imports are ordered lazily: `dlpack_imported` only remembers the producer's stream (`_pending`,
    each handle once), and whatever next uses this device's stream or the memory through it orders the
    stream after every remembered one first (`order_imports`: the backend's `_order_after` queries each
    and makes our stream wait on an event where it is busy). Every such path tests `_pending` (one
    attribute, false when nothing is pending): the launches and graph replays, reading the device's
    `stream` (the copies, captures, user code queuing on it), `synchronized`, `stream_idle` and the
    exports' `dlpack_sync`. The remembered handles and the ordering share a lock, and a handle leaves
    `_pending` only after our stream waits on it, so a use that sees it empty is already ordered."""

    _queued: object = None
    _idle: object = _NEVER
    # producer stream handles of DLPack imports not yet ordered before this stream (a list once the first
    # import came; `_imports_lock` guards appending and ordering)
    _pending: "list | tuple" = ()
    _imports_lock: "threading.Lock | None" = None
    _STATE_LOCK = threading.Lock()      # makes a device's pending-imports list and lock, once

    _stream: Any = None

    @property
    def stream(self):
        """This device's stream (the backend's handle). Reading it orders pending DLPack imports first, so
        whatever queues work on it after reading it (the allocator's copies, graph replays and captures, user
        code) runs after the imported tensors' producers. The hot paths hold `_stream` and test `_pending`."""
        if self._pending:
            self.order_imports()
        return self._stream

    @stream.setter
    def stream(self, value) -> None:
        self._stream = value

    def _imports_state(self) -> "threading.Lock":
        """The lock and list of pending imports, made once per device (a device built without __init__ too)."""
        with StreamMarks._STATE_LOCK:
            d = self.__dict__
            if d.get("_imports_lock") is None:
                d["_pending"] = []
                d["_imports_lock"] = threading.Lock()
            return d["_imports_lock"]

    # DLPack's handle for the calling thread's default stream: which stream it names depends on the thread, so an
    # import from it is ordered at once
    PER_THREAD_STREAM = 2

    def import_pending(self, stream: Any) -> None:
        """Remember that this device's stream must wait for `stream` (a producer's raw stream handle, as the
        backend's `_order_after` takes it) before its next use; nothing is asked of the driver now (the
        per-thread default stream, PER_THREAD_STREAM, is ordered now)."""
        lock = self._imports_lock or self._imports_state()
        with lock:
            if stream == self.PER_THREAD_STREAM:
                self._order_after((stream,))
                return
            pending = self._pending
            if stream not in pending:
                pending.append(stream)

    def order_imports(self) -> None:
        """Order this device's stream after every pending import's producer stream, then forget them (the
        callers test `_pending` first; this is cheap when nothing is pending either way)."""
        if not self._pending:
            return
        with self._imports_lock or self._imports_state():
            self._order_pending()   # (none left if another thread ordered them while this one waited)

    @contextlib.contextmanager
    def imports_held(self) -> Iterator[None]:
        """Order every pending import, then hold the imports' lock for the block: no import is remembered
        until it ends (a CUDA graph capture, whose launches cannot wait on an event recorded outside it)."""
        with self._imports_lock or self._imports_state():
            self._order_pending()
            yield

    def _order_pending(self) -> None:
        """`_order_after` the pending imports, then forget them (the imports' lock held)."""
        pending = self._pending
        n = len(pending)
        if n:
            try:
                self._order_after(pending[:n])
            finally:
                del pending[:n]     # only now: a use that finds the list empty is ordered already

    def _order_after(self, streams: list) -> None:
        """Make this device's stream wait for the work queued so far on each producer stream (the
        backend's driver calls; a busy one marks our stream used). Runs under the imports lock: it must
        not read `stream` or call anything that orders imports."""
        raise NotImplementedError

    def stream_used(self) -> None:
        """Work was queued on the stream (the runtime calls this; so must code that queues on it itself)."""
        self._queued = None

    def stream_idle(self) -> bool:
        """Whether everything queued on the stream is done: known without a driver call when nothing was
        queued since the last check that found it idle, else one query (`_stream_query`)."""
        if self._pending:
            self.order_imports()
        if self._queued is self._idle:
            return True
        token = self._queued = object()
        if self._stream_query():
            self._idle = token
            return True
        return False

    def synchronized(self, wait) -> None:
        """Run `wait()` (a call that returns once the stream is idle) and remember the stream idle (pending
        imports are ordered first, so the wait covers their producers' work)."""
        if self._pending:
            self.order_imports()
        token = self._queued = object()
        wait()
        self._idle = token

    def _stream_query(self) -> bool:
        raise NotImplementedError


class Device(contracts.Device, metaclass=_DeviceMeta):
    """A device with the friendly path: `Device["CUDA:1"]` opens (once) and returns a device,
    `compile` goes through the method and disk caches, `buffer` allocates a Buffer."""

    def compile(self, ast: UOp, name: str | None = None, *, compiler: str | None = None) -> contracts.Program:
        """Render, compile and load through the method and disk caches."""
        if name is not None:
            check_kernel_name(name)     # before the name reaches a cache key (b"x" would hash fine)
        r, c = self.pair(compiler) if compiler else (self.renderer, self.compiler)
        return compile_through_caches(self, r, c, ast, name)

    def compile_many(self, items: Iterable[tuple[UOp, str | None]], *, compiler: str | None = None,
                     workers: int | None = None) -> list[contracts.Program]:
        """`compile` for many (ast, name) items: identical kernels once, the others in parallel across
        cores (morok_py.batch); one Program per item, in order."""
        return compile_many(self, items, compiler=compiler, workers=workers)

    def buffer(self, size: int, dtype: Any) -> Buffer:
        return Buffer(self, size, as_dtype(dtype))

