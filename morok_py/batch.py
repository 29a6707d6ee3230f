"""Compiling many kernels at once, as a model's first run needs: identical kernels compile once (one
entry per method-cache key), the distinct ones fan out across the machine's cores.

`compile_many(device, [(ast, name), ...])` returns one Program per item, in order, through the same
method and disk caches as `Device.compile`; `compile_specs(renderer, compiler, items)` does the same
for a compile-only pair (no device: CUDA or ROCm code built on a machine without the GPU).

Workers render and compile (the disk cache included); the calling thread loads what they hand back,
one program at a time, while they go on. How the work is spread is a named rule, `plan_for` (printed
by MOROK_DEBUG=1):
- `processes`: forked workers. Scheduling, lowering and printing are Python and hold the GIL, so only
  processes spread them; results come back as bytes plus the launch record's JSON (launch_io), never
  pickled objects. Needs fork (Linux), no MOROK_BEAM search (it launches kernels, which a forked
  child must not), and at least `PROCESS_MIN_KERNELS` distinct kernels to pay for the forks.
- `threads`: a thread pool; LLVM and NVRTC release the GIL while they run, the Python half stays
  serialized.
- `serial`: one worker, or one kernel.
MOROK_COMPILE_WORKERS sets the worker count (default: os.cpu_count(), less what other work keeps busy by
the load average: `idle_workers`); MOROK_COMPILE_MODE forces a mode.

A forked batch that hands back nothing for MOROK_COMPILE_STALL seconds (default STALL_SECONDS; a worker that
inherited a lock some other thread held at the fork waits forever) has its workers killed, and the calling
process compiles what they left, so a model's first run never hangs on them.
"""
from __future__ import annotations

import os
import sys
import threading
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, as_completed, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Sequence, TypeVar

from . import cache, config
from .codegen import launch_io
from .device import CompiledSpec, kernel_name
from .dtypes import dtypes
from .errors import CompileError, ConfigError, MorokError

if TYPE_CHECKING:
    from .device import Compiler, Device, Program, Renderer
    from .ir import UOp

__all__ = ["compile_many", "compile_specs", "compile_workers", "idle_workers", "plan_for", "BatchPlan", "MODES",
           "PROCESS_MIN_KERNELS"]

MODES = ("serial", "threads", "processes")
# below this many distinct kernels the forks cost more than they save (forking a worker and reading its
# result back take a few ms; rendering and compiling one CPU kernel 10-60 ms)
PROCESS_MIN_KERNELS = 8
# seconds a forked batch may go without a result before its workers are killed (one CPU kernel renders and
# compiles in 10-60 ms, the largest GPU ones in a few seconds)
STALL_SECONDS = 60.0

Item = tuple["UOp", "str | None"]
T = TypeVar("T")


def compile_workers() -> int:
    """MOROK_COMPILE_WORKERS, else os.cpu_count()."""
    n = config.getenv_int("MOROK_COMPILE_WORKERS", 0)
    if n < 0:
        raise ConfigError(f"MOROK_COMPILE_WORKERS must be >= 0 (0: one per core), got {n}")
    return n if n > 0 else (os.cpu_count() or 1)


@dataclass(frozen=True)
class BatchPlan:
    """How one batch is compiled: `mode` (one of MODES), `workers`, and why."""

    mode: str
    workers: int
    kernels: int
    why: str

    def __str__(self) -> str:
        return f"{self.kernels} distinct kernel(s): {self.mode} x{self.workers} ({self.why})"


def _fork_available() -> bool:
    import multiprocessing as mp
    return sys.platform.startswith("linux") and "fork" in mp.get_all_start_methods()


def idle_workers(cores: int) -> tuple[int, float | None]:
    """(workers the machine has room for, its 1-minute load average): the cores less the runnable work
    of others, plus this process (`cores + 2 - load`, floored: this process may have added up to one
    to the load). Measured on 2 vCPUs, densenet121's cold first run: at load 1-1.3 two forked workers
    2.6-3.8 s against 4.8-4.9 s in one process; at load 5-7 from other work, 12.5-13.9 s against
    9.8-11.7 s (6.0-6.7 s of CPU against 5.4-5.7 s): workers only add their own cost there."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return cores, None
    return max(1, min(cores, int(cores + 2 - load))), load


def plan_for(kernels: int, workers: int | None = None) -> BatchPlan:
    """The rule that picks serial, threads or forked processes for `kernels` distinct kernels: the
    workers asked for (`workers`, else MOROK_COMPILE_WORKERS), else as many as the machine has idle
    cores for (`idle_workers`)."""
    asked = workers if workers is not None else config.getenv_int("MOROK_COMPILE_WORKERS", 0) or None
    busy = ""
    if asked is not None:
        n = max(1, asked)
    else:
        cores = compile_workers()
        n, load = idle_workers(cores)
        if n < cores:
            busy = f"load {load:.1f} on {cores} cores"
    forced = config.getenv("MOROK_COMPILE_MODE", "").strip().lower()
    if forced and forced not in MODES:
        raise ConfigError(f"MOROK_COMPILE_MODE={forced!r}: one of {', '.join(MODES)}")
    if forced in ("threads", "processes") and asked is None:
        n = max(n, 2)           # a parallel mode asked for by name gets at least two workers
    n = min(n, max(kernels, 1))
    if n <= 1 or forced == "serial":
        why = ("MOROK_COMPILE_MODE=serial" if forced == "serial" else busy or "one worker" if kernels > 1
               else "one kernel")
        return BatchPlan("serial", 1, kernels, why)
    blocker = None
    if not _fork_available():
        blocker = "no fork on this platform"
    elif config.getenv_int("MOROK_BEAM", 0) > 0:
        blocker = "MOROK_BEAM searches launch kernels, which a forked worker must not"
    if forced == "processes":
        if blocker is not None:
            return BatchPlan("threads", n, kernels, f"processes asked for, but {blocker}")
        return BatchPlan("processes", n, kernels, "MOROK_COMPILE_MODE=processes")
    if forced == "threads":
        return BatchPlan("threads", n, kernels, "MOROK_COMPILE_MODE=threads")
    note = f"; {busy}" if busy else ""
    if blocker is None and kernels >= PROCESS_MIN_KERNELS:
        return BatchPlan("processes", n, kernels, f">= {PROCESS_MIN_KERNELS} kernels: render in parallel{note}")
    return BatchPlan("threads", n, kernels, (blocker or f"< {PROCESS_MIN_KERNELS} kernels") + note)


def _named(err: BaseException, name: str) -> MorokError:
    """`err` as an error that names kernel `name`: a CompileError for `name` as it is, else a
    CompileError that says which kernel failed, with the original as its cause."""
    if isinstance(err, CompileError) and err.kernel == name:
        return err
    if isinstance(err, CompileError):
        wrapped = CompileError(f"kernel {name!r} failed to compile: {err}", kernel=name)
    else:
        wrapped = CompileError(f"kernel {name!r} failed to compile: {type(err).__name__}: {err}", kernel=name)
    wrapped.__cause__ = err
    return wrapped


# ---- results across a process boundary: plain data only ---------------------------------------

def _pack(c: CompiledSpec) -> tuple:
    """A CompiledSpec without its AST (the parent has it) as plain data; the launch record as JSON."""
    launch = None if c.launch is None else launch_io.dump(c.launch)
    return (c.name, c.src, c.bytes, c.var_names, c.global_size, c.local_size, c.buf_count, launch, c.arch,
            c.compiler, tuple(d.name for d in c.param_dtypes))


def _unpack(p: tuple, ast: "UOp") -> CompiledSpec:
    name, src, out, var_names, gs, ls, buf_count, launch, arch, comp, dts = p
    return CompiledSpec(name, src, out, ast, var_names, gs, ls, buf_count,
                        None if launch is None else launch_io.load(launch), arch, comp,
                        tuple(dtypes.from_name(d) for d in dts))


# ---- the forked workers -------------------------------------------------------------------------

# (compile item i -> CompiledSpec, the items): set by the parent before it forks, read by the workers
_JOB: "tuple[Callable[[int], CompiledSpec], Sequence[Item]] | None" = None
_fork_lock = threading.Lock()      # one forked batch at a time per process (they share _JOB)
_INHERITED: list = []             # in a worker: objects of the parent's that must never be destroyed
_RLOCK = type(threading.RLock())
_LOCK_TYPES = (type(threading.Lock()), _RLOCK)


def _after_fork(holders: tuple) -> None:
    """In a new worker: fresh copies of the locks the compile path takes. Another thread of the parent
    may have held one when it forked, and that thread does not exist here to release it."""
    from .codegen import llvm_binding
    from .codegen.mlir_binding import MLIRLowering
    cache._lock = threading.RLock()
    cache._key_locks.clear()
    llvm_binding._lock = threading.Lock()
    # the renderer and compiler, and what a compiler wraps (an MLIR front half, its LLVM back half)
    parts = [x for obj in holders for x in (obj, getattr(obj, "_lowering", None), getattr(obj, "backend", None))]
    for obj in parts:
        lock = getattr(obj, "_lock", None)
        if isinstance(lock, _LOCK_TYPES):
            obj._lock = threading.RLock() if isinstance(lock, _RLOCK) else threading.Lock()
        if isinstance(obj, MLIRLowering) and obj._context is not None:
            # an MLIR context runs passes on a thread pool whose threads did not come along: the worker
            # starts its own, and never destroys the inherited one (its pool would wait for them forever)
            _INHERITED.append((obj._context, obj._pm))
            obj._context = obj._pm = None


def _child(i: int) -> tuple[int, tuple | None, str | None, int, float]:
    """In a worker: (i, packed result or None, error text or None, compiles, compile seconds)."""
    assert _JOB is not None
    before = cache.stats.compiles, cache.stats.compile_seconds
    try:
        packed = _pack(_JOB[0](i))
    except BaseException as e:      # the parent compiles this one itself, to raise the real error
        return i, None, f"{type(e).__name__}: {e}", 0, 0.0
    return i, packed, None, cache.stats.compiles - before[0], cache.stats.compile_seconds - before[1]


def _cost(item: Item) -> int:
    """The size of a kernel's graph: workers take the largest kernels first."""
    return len(item[0].toposort())


def _run(plan: BatchPlan, items: Sequence[Item], compile_one: Callable[[int], CompiledSpec],
         finish: Callable[[int, CompiledSpec | None], T], holders: tuple) -> list[T]:
    """`compile_one(i)` on the workers; `finish(i, compiled)` on the calling thread as each completes
    (`compiled` None: compile it there, as for what a dead worker left or one that failed)."""
    order = sorted(range(len(items)), key=lambda i: -_cost(items[i]))
    results: dict[int, T] = {}
    errors: dict[int, BaseException] = {}

    def settle(i: int, compiled: CompiledSpec | None) -> None:
        try:
            results[i] = finish(i, compiled)
        except Exception as e:
            errors[i] = e

    if plan.mode == "processes":
        _run_forked(order, items, plan.workers, compile_one, settle, holders)
    elif plan.mode == "threads":
        with ThreadPoolExecutor(max_workers=plan.workers, thread_name_prefix="morok-compile") as pool:
            futures: dict[Future, int] = {pool.submit(compile_one, i): i for i in order}
            for fut in as_completed(futures):
                settle(futures[fut], None if fut.exception() is not None else fut.result())
    else:
        for i in order:
            settle(i, None)
    if errors:
        first = min(errors)
        raise _named(errors[first], kernel_name(*items[first])) from errors[first]
    return [results[i] for i in range(len(items))]


def _run_forked(order: list[int], items: Sequence[Item], workers: int, compile_one: Callable[[int], CompiledSpec],
                settle: Callable[[int, CompiledSpec | None], None], holders: tuple) -> None:
    import multiprocessing as mp
    global _JOB
    done: set[int] = set()
    stall = config.compile_stall(STALL_SECONDS)     # read before any fork
    with _fork_lock:
        _JOB = (compile_one, items)
        try:
            with warnings.catch_warnings():
                # Python 3.12+ warns that fork() in a threaded process may deadlock: the workers only
                # render and compile, and `_after_fork` renews the locks that path takes
                warnings.simplefilter("ignore", DeprecationWarning)
                pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("fork"),
                                           initializer=_after_fork, initargs=(holders,))
                futures = [pool.submit(_child, i) for i in order]     # the first submit forks the workers
            pending = set(futures)
            try:
                while pending:
                    finished, pending = wait(pending, timeout=stall, return_when=FIRST_COMPLETED)
                    if not finished:
                        _kill_workers(pool, stall)
                        break
                    for fut in finished:
                        try:
                            i, packed, _err, compiles, seconds = fut.result()
                        except BrokenProcessPool:
                            pending = set()
                            break
                        with cache._lock:
                            cache.stats.compiles += compiles
                            cache.stats.compile_seconds += seconds
                        done.add(i)
                        settle(i, None if packed is None else _unpack(packed, items[i][0]))
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
        finally:
            _JOB = None
    for i in order:             # what a dead worker left
        if i not in done:
            settle(i, None)


def _kill_workers(pool: ProcessPoolExecutor, stall: float) -> None:
    """Kill a forked batch's workers that stopped handing back results (their kernels compile in the caller)."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    warnings.warn(f"morok_py: compile workers handed back nothing for {stall:g} s (MOROK_COMPILE_STALL): killed "
                  f"{len(procs)} worker(s); the calling process compiles what they left", RuntimeWarning, stacklevel=3)
    for proc in procs:
        try:
            proc.kill()
        except (OSError, ValueError):
            pass


def _unique(keys: Iterable[tuple]) -> tuple[list[int], list[int]]:
    """(for each item, the slot of its distinct kernel; the index of each distinct kernel's first item)."""
    first: dict[tuple, int] = {}
    slot, distinct = [], []
    for i, k in enumerate(keys):
        j = first.get(k)
        if j is None:
            j = first[k] = len(distinct)
            distinct.append(i)
        slot.append(j)
    return slot, distinct


def compile_many(device: "Device", items: Iterable[Item], *, compiler: str | None = None,
                 workers: int | None = None) -> list["Program"]:
    """One Program per (ast, name) item, in order, through the method and disk caches: identical
    kernels (one method-cache key) compile once, distinct ones in parallel (`plan_for`). A kernel that
    fails raises CompileError naming it, after the others are compiled and cached."""
    from .codegen.symbols import check_kernel_name
    items = [(ast, name) for ast, name in items]
    for _, name in items:
        if name is not None:
            check_kernel_name(name)
    r, c = device.pair(compiler) if compiler else (device.renderer, device.compiler)
    slot, distinct = _unique(cache.method_key(device, c, ast, name) for ast, name in items)
    uniq = [items[i] for i in distinct]
    if not uniq:
        return []
    plan = plan_for(len(uniq), workers)
    if config.debug_level() >= 1:
        config.log(f"compile_many on {device.name}/{c.cache_key}: {plan}")

    def finish(i: int, compiled: CompiledSpec | None) -> "Program":
        if compiled is None:
            return cache.compile_through_caches(device, r, c, *uniq[i])
        return cache.load_compiled(device, c, *uniq[i], compiled)

    progs = _run(plan, uniq, lambda i: cache.compile_scheduled(device, r, c, *uniq[i]), finish, (r, c))
    return [progs[j] for j in slot]


def compile_specs(renderer: "Renderer", compiler: "Compiler", items: Iterable[Item], *,
                  workers: int | None = None) -> list[CompiledSpec]:
    """compile_many for a compile-only pair: one CompiledSpec per item, in order, through the disk
    cache with the default schedule; identical (ast, name) items compile once."""
    items = [(ast, name) for ast, name in items]
    slot, distinct = _unique((ast.key, kernel_name(ast, name)) for ast, name in items)
    uniq = [items[i] for i in distinct]
    if not uniq:
        return []
    plan = plan_for(len(uniq), workers)
    if config.debug_level() >= 1:
        config.log(f"compile_specs for {renderer.device}/{compiler.cache_key}: {plan}")

    def compile_one(i: int) -> CompiledSpec:
        return cache.compile_ast(renderer, compiler, *uniq[i])

    specs = _run(plan, uniq, compile_one, lambda i, c: compile_one(i) if c is None else c, (renderer, compiler))
    return [specs[j] for j in slot]
