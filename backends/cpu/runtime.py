"""Loads a host object in-process (LLVM's RuntimeDyld through llvmlite) and calls it via ctypes,
splitting the outermost parallel axis over worker threads when the work pays for them."""
from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np

from morok_py import config
from morok_py.device import CompiledSpec
from morok_py.launch import Program
from morok_py.errors import DeviceError, LaunchError

from .builtins import ensure_builtins, undefined_symbols, unresolved
from .compiler import host_cpu, host_target_machine, llvm
from .features import load_mismatch
from .pool import POOL_SPIN, NativePool, native_pool, native_pool_error
from .renderer import STREAM_ALIGN, STREAM_SUFFIX

# The work of a launch is counted in memory accesses executed (each load and store, times the
# iterations of the loops around it): 3 per element of an add, ti + tj per k step of a register tile.
# Handing work to the pool costs 30-70 us on a small VM, what one core needs for about 1M accesses.
PARALLEL_MIN_WORK = 1 << 20     # below: the calling thread alone
PARALLEL_SURE_WORK = 32 << 20   # from here: split over the worker threads without asking
# The native pool (pool.py) hands work over in 1-10 us (2-vCPU CI machine: 8.9 us for a 2-way split of a
# 4096-element add against 85 us through the executor), what one core needs for ~32K accesses
NATIVE_MIN_WORK = 1 << 15
# from here a launch splits without a trial. A trial times the kernel alone right after its own last run; in a
# model its input was just written by a launch split over every core, which one thread then reads from the others'
# caches. 4M accesses left densenet121's and resnet50's mid-size launches to trials that kept some on one thread:
# on the 16-core Xeon (cpu-xeon-avx512-16c) their launches in order took 17.63 / 12.29 ms against 16.38 / 12.04
# from 512K (the same with no trials at all: 16.41 / 12.01), in one process, each form's trials run under it; on
# the 2-vCPU AVX2 EPYC 46.10 / 77.34 against 45.22 / 77.35
NATIVE_SURE_WORK = 1 << 19
SPLIT_TRIALS = 3                # in between: time this many launches each way, then keep the faster
# in between, a split takes at most one thread per this many accesses (at least two): a split waits for its
# slowest thread, and on a shared host every thread more is one more chance of a descheduled core (benchmarks/kernels.py
# --suite on the H100 host's Xeon, 12 threads: 256x512x10, 0.5M accesses, split 12 ways ran 25-360 us per round against 115-157 us alone)
SPLIT_WORK_PER_THREAD = 1 << 17
# ... or one thread per this much of the launch's time alone (its trial's fastest run on one thread), where that
# allows more: counted accesses miss the arithmetic between them. The Winograd transforms (a tile's 16 loads and
# 16 stores around ~64 scalar adds) count 0.26-0.38M accesses at 14x14, which gave them 2 of the 16 cores. On the
# 16-core Xeon (cpu-xeon-avx512-16c), in one process, interleaved: 256 channels at 14x14, input 0.094 -> 0.021 ms
# and output 0.056 -> 0.017 split 16 ways. The models' launches in order (medians of 15 rounds in one process,
# each form's trials run under it), 20 / 5 / 2 us a thread: resnet50 14.04 / 13.54 / 12.72 ms, densenet121 19.55 /
# 18.87 / 18.41, the MobileNet stack 0.954 / 0.932 / 0.913. With 2 us the 256x512x10 matmul above (115 us alone)
# splits over every core again: the models' kernels, whose workers run back to back, gained from each thread more
SPLIT_MIN_CHUNK_S = 2e-6
# the order of the trial launches (A alone, S split): two splits in a row, so that one split runs with the
# workers still spinning from the last, as back-to-back launches find them. Alternating A S A S only timed
# splits whose workers had gone to sleep during the alone run: on the H100 host's Xeon, 12 futex wake-ups
# made the 256x512x10 matmul's splits slower than one thread in some processes (115-157 us on one thread
# where a warm split takes 19-24 us)
TRIAL_ORDER = "ASSASA"
# a trial's verdict is timed under the load of its moment: it is taken again after this many launches (6 of
# them run the trial's way), so a kernel kept on one thread during a burst of other load splits again later
RETRIAL_EVERY = 256
# a verdict of one thread is retaken sooner: after RETRIAL_FIRST launches, then twice as many each time it
# holds, up to RETRIAL_EVERY. Other load slows the splits, never the thread alone, so that verdict is the one
# a burst of load gets wrong, and the wrong one costs the most (benchmarks/kernels.py --suite on the Xeon host: 256x512x10 kept on
# one thread at 171 us, where a split takes 20-50 us, after its trial's splits ran beside OpenBLAS's
# spinning threads); a retrial costs three split launches
RETRIAL_FIRST = 16


# argument blocks a program keeps for the native pool, one per launch it makes (its buffers, values and
# split): a plan that launches one program for many layers (a DenseNet's contractions share one program
# over their input channels) reuses each layer's block instead of building it again (16 chunks: 13.5 us of
# Python on the 2-vCPU EPYC)
BLOCKS_KEPT = 256


def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache (sysfs), 32 MiB where it cannot be read."""
    best = 0
    try:
        root = "/sys/devices/system/cpu/cpu0/cache"
        for entry in os.listdir(root):
            if entry.startswith("index"):
                with open(f"{root}/{entry}/size") as f:
                    text = f.read().strip().upper()
                scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                best = max(best, int(text.rstrip("KMG")) * scale)
    except (OSError, ValueError):
        pass
    return best or 32 << 20


# a launch that touches more bytes than the last-level cache holds takes the streaming variant (its
# vector stores non-temporal: no read-for-ownership of the destination, 3 memory transfers per
# element of an add instead of 4); below that the output may still be in cache for the next kernel
STREAM_MIN_BYTES = last_level_cache_bytes()

_ONE, _SPLIT, _TRIAL = "one thread", "split", "trial"
# a split launch on the native pool is cut into threads * CHUNKS_PER_THREAD chunks, which the threads claim as they
# finish one (a packed program's chunks share their thread's scratch set). More than one lets the others take over
# from a thread that joined late or whose CPU was taken: on the 2-vCPU AVX2 EPYC with a busy loop on its second CPU
# resnet50's launches took 113 ms at 4 against 121 at 1 (75 / 76 ms without it). On the 16-core Xeon
# (cpu-xeon-avx512-16c), the executor's captured replays, each form captured in one process and replayed
# interleaved (chunks per thread for programs without scratch, for packed ones, whose chunks then had a scratch set
# each): resnet50 13.96 (1, 1) / 13.73 (2, 1) / 13.98 (4, 1) / 13.49 ms (4, 4), densenet121 15.63 / 15.07 / 14.89 /
# 14.41, the MobileNet stack 0.808 / 0.765 / 0.781 / 0.743; on another instance resnet50 11.83 (1) / 10.53 (4); with
# a scratch set per thread, 1 against 4: resnet50 12.08 / 11.66, densenet121 15.81 / 15.10, MobileNet 0.893 / 0.858
CHUNKS_PER_THREAD = 4


def memory_accesses(info, values) -> int:
    """Loads and stores a launch executes: per distinct access, the product of its loops' extents
    (times the lanes a merged bounds check stands for)."""
    from morok_py.codegen.symbolic import evaluate
    ends: dict[int, int] = {}
    total = 0
    for a in info.accesses:
        n = 1
        for r in a.enclosing:
            e = ends.get(id(r))
            if e is None:
                e = ends[id(r)] = max(0, evaluate(r.src[0], values))
            n *= e
        total += n * a.lanes
    return total


_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def worker_pool(n: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size != n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="morok-cpu")
            _pool_size = n
        return _pool


class CPUProgram(Program):
    def __init__(self, device, compiled: CompiledSpec, target_machine) -> None:
        super().__init__(device, compiled)
        if compiled.bytes is None:
            raise LaunchError(f"{compiled.name}: the CPU runtime loads object bytes, got source only")
        why = load_mismatch(compiled.arch, device.arch, host_cpu()[1])
        if why is not None:
            raise DeviceError("load", 0, "ARCH_MISMATCH", f"{compiled.name} was compiled for cpu {compiled.arch!r}: {why}")
        b = llvm()
        needs = undefined_symbols(compiled.bytes)
        if needs:   # the support functions only for an object that calls out (~13 ms of a fresh process's first load)
            ensure_builtins(b, host_target_machine)
        missing = unresolved(b, needs)
        if missing:     # the loader would bind them to address 0: a crash at the first call
            raise DeviceError("load object", 0, "UNRESOLVED_SYMBOL",
                              f"{compiled.name} calls {', '.join(missing)}, which nothing in this process provides")
        try:
            empty = b.parse_assembly("")
            self._engine = b.create_mcjit_compiler(empty, target_machine)
            # MCJIT compiles the modules it holds when it finalizes: the empty one an engine is made with
            # took a codegen pipeline's setup, 1.2 of a small program's 1.6 ms of loading on the 2-vCPU CI
            # host (finalize_object 1.18 -> 0.015 ms); only the object file is wanted
            self._engine.remove_module(empty)
            self._engine.add_object_file(b.ObjectFileRef.from_data(compiled.bytes))
            self._engine.finalize_object()
            addr = self._engine.get_function_address(compiled.symbol)
        except RuntimeError as e:
            raise DeviceError("load object", 0, "LOAD_FAILED", f"{compiled.name}: {e}") from None
        if not addr:
            raise DeviceError("load object", 0, "SYMBOL_NOT_FOUND",
                              f"{compiled.name}: no symbol {compiled.symbol!r} in the object")
        nvars = len(compiled.var_names)
        info = compiled.launch
        nhidden = len(info.hidden) if info is not None else 0
        argtypes = [ctypes.c_void_p] * (compiled.buf_count + nhidden) + [ctypes.c_int32] * (nvars + 2)
        proto = ctypes.CFUNCTYPE(None, *argtypes)
        self._fn = proto(addr)
        self.address = addr
        stream = self._engine.get_function_address(compiled.symbol + STREAM_SUFFIX)
        self._stream_fn = proto(stream) if stream else None
        self._stream_addr = stream
        # split launches on the native workers (pool.py): argument blocks by launch (BLOCKS_KEPT)
        self._pool_checked = False
        self._pool_kind = ""
        self._pool: NativePool | None = None
        self._trampoline = 0
        self._blocks: dict[tuple, tuple] = {}      # a launch's argument block by (variant, buffers, values, extent, step)
        info = compiled.launch
        self._stream_slots = [] if info is None else [p.slot for p in info.params if p.written]
        self._nvars = nvars
        self._nbuf = compiled.buf_count
        self._plans: dict[tuple, list] = {}
        # hidden buffers (a packed matmul's panel scratch) follow the caller's: one set per thread of a split
        # launch on the native pool (the chunks a thread claims run on its set one after another; pool.py's
        # trampolines), per chunk on the Python executor, one launch at a time. Allocated when a launch first
        # needs them, not zero-filled (the kernel writes a panel before reading it): loading the program (a
        # disk-cache hit) stays a few ms whatever their size
        self._nhidden = nhidden
        self._hidden_sets: list[list[int]] = []
        self._hidden_lock = threading.Lock()

    def execute(self, buffers: Sequence[int], vals: Sequence[int] = (),
                global_size: Sequence[int] | None = None, local_size: Sequence[int] | None = None,
                wait: bool = False) -> float | None:
        if len(buffers) != self._nbuf or len(vals) != self._nvars:
            raise LaunchError(f"{self.name} takes {self._nbuf} buffers and {self._nvars} values, "
                              f"got {len(buffers)} and {len(vals)}")
        if global_size is None:
            global_size = self.compiled.global_size
            if global_size is None:
                raise LaunchError(f"{self.name} has symbolic sizes: pass global_size from spec.launch_dims()")
        extent = global_size[0]
        if self._nhidden:
            with self._hidden_lock:
                return self._execute(buffers, vals, extent, wait)
        return self._execute(buffers, vals, extent, wait)

    def __del__(self) -> None:
        try:
            if self._hidden:
                self.free_hidden()
        except Exception:
            pass

    def _native_pool(self, settings: "tuple[int, str, int, bool] | None" = None) -> NativePool | None:
        """The native pool and this kernel's trampoline, unless MOROK_CPU_POOL=python or none can exist here.
        `settings`: config.cpu_launch's, where the caller read them for this launch (they are read at every
        split launch; a bad MOROK_CPU_PIN is refused there, not when a worker starts)."""
        _threads, kind, spin, _pin = settings or config.cpu_launch(POOL_SPIN)
        if not self._pool_checked or self._pool_kind != kind:
            self._pool_kind = kind
            self._pool = native_pool(llvm()) if kind == "native" else None
            if self._pool is not None:
                self._trampoline = self._pool.trampoline(self._nbuf, self._nhidden, self._nvars + 2)
            self._pool_checked = True
        if self._pool is not None:
            self._pool.set_spin(spin)
        return self._pool

    def _args(self, buffers: Sequence[int], chunk: int) -> Sequence[int]:
        """The caller's buffers, then hidden set `chunk` (a chunk's on the Python executor, a thread's on the
        native pool)."""
        if not self._nhidden:
            return buffers
        while len(self._hidden_sets) <= chunk:
            one = []
            for h in self.launch.hidden:
                nbytes = h.count * h.dtype.itemsize
                ptr = self.device.allocator.alloc(nbytes)
                self._hidden.append((ptr, nbytes))
                one.append(ptr)
            self._hidden_sets.append(one)
        return [*buffers, *self._hidden_sets[chunk]]

    def _execute(self, buffers: Sequence[int], vals: Sequence[int], extent: int, wait: bool) -> float | None:
        t0 = time.perf_counter() if wait else 0.0
        threads, fn, plan, settings = 1, self._fn, None, None
        if extent > 1:
            plan = self._plan_for(vals)
            if plan[3] and plan[0] is not _TRIAL:        # decided by a trial: count down to the next one
                if plan[4] <= 0:
                    plan[0], plan[2], plan[3] = _TRIAL, [], []
                plan[4] -= 1
            if plan[0] is not _ONE:   # the environment is read only where it matters
                settings = config.cpu_launch(POOL_SPIN)
                threads = min(settings[0], plan[6])
            # the streaming variant promises LLVM aligned output buffers (and aligned chunk starts)
            if plan[1] and all(buffers[s] % STREAM_ALIGN == 0 for s in self._stream_slots):
                fn = self._stream_fn
        if threads > 1 and plan[0] is _TRIAL:
            self._trial(plan, fn, buffers, vals, extent, threads, settings)
        elif threads > 1:
            self._parallel(fn, buffers, vals, extent, threads, settings)
        else:
            fn(*(self._args(buffers, 0) if self._nhidden else buffers), *vals, 0, extent)
        return time.perf_counter() - t0 if wait else None

    def prepare(self, buffers: Sequence[int], vals: Sequence[int], global_size: Sequence[int],
                local_size: Sequence[int]) -> Callable[[], Any]:
        """A launch that runs on the calling thread is the ctypes call with every argument bound
        (`execute`'s choice of variant made once); one that may split over threads goes through
        `execute`, which decides per call."""
        if len(buffers) != self._nbuf or len(vals) != self._nvars:
            raise LaunchError(f"{self.name} takes {self._nbuf} buffers and {self._nvars} values, "
                              f"got {len(buffers)} and {len(vals)}")
        extent = global_size[0]
        fn = self._fn
        if self._nhidden:           # through execute: its lock keeps concurrent launches off the scratch
            return super().prepare(buffers, vals, global_size, local_size)
        if extent > 1:
            plan = self._plan_for(vals)
            if plan[0] is not _ONE:
                return super().prepare(buffers, vals, global_size, local_size)
            if plan[1] and all(buffers[s] % STREAM_ALIGN == 0 for s in self._stream_slots):
                fn = self._stream_fn
        return functools.partial(fn, *buffers, *vals, 0, extent)

    def _plan_for(self, vals: Sequence[int]) -> list:
        plan = self._plans.get(tuple(vals))
        if plan is None:
            plan = self._plan(vals)
            if len(self._plans) > 1024:
                self._plans.clear()
            self._plans[tuple(vals)] = plan
        return plan

    def _plan(self, vals: Sequence[int]) -> list:
        """[threads: _ONE, _SPLIT or _TRIAL, take the streaming variant, trial times alone, trial
        times split, launches until the verdict is retried, the wait after the next verdict of one thread,
        the most threads a split takes, that most by the counted accesses alone] for these values (a trial
        raises the most by its time alone, SPLIT_MIN_CHUNK_S). Streaming where the bytes touched
        overflow the last-level cache."""
        n = config.cpu_threads()     # also rejects a bad MOROK_CPU_THREADS at the first launch
        info = self.launch
        if info is None:
            return [_SPLIT, False, [], [], 0, RETRIAL_FIRST, 1 << 30, 1 << 30]
        values = dict(zip(info.var_names, vals))
        gs, _, bounds, _ = info.prepare(values)
        work = memory_accesses(info, values)
        lo, hi = (NATIVE_MIN_WORK, NATIVE_SURE_WORK) if self._native_pool() else (PARALLEL_MIN_WORK, PARALLEL_SURE_WORK)
        mode = _ONE if work < lo else _SPLIT if work >= hi else _TRIAL
        if mode is _TRIAL and self._nhidden:
            # a packed register tile (the only CPU kernel with a hidden scratch): its panel reads are not
            # among the counted accesses and each counted one feeds a tile row of FMAs, so it is compute-
            # bound well before PARALLEL_SURE_WORK; a trial under other load could keep it on one thread
            mode = _SPLIT
        stream = False
        # every thread's chunk must start on a multiple of STREAM_ALIGN of the outer axis
        if self._stream_fn is not None and gs[0] >= n * STREAM_ALIGN:
            spans: dict[int, tuple[int, int]] = {}
            for b in bounds:
                if b is not None:
                    slot, _, lo, hi = b
                    old = spans.get(slot, (lo, hi))
                    spans[slot] = (min(old[0], lo), max(old[1], hi))
            touched = sum((hi - lo + 1) * info.params[s].dtype.itemsize for s, (lo, hi) in spans.items())
            stream = touched > STREAM_MIN_BYTES
        cap = 1 << 30 if mode is not _TRIAL else max(2, work // SPLIT_WORK_PER_THREAD)
        return [mode, stream, [], [], 0, RETRIAL_FIRST, cap, cap]

    def _trial(self, plan: list, fn, buffers, vals, extent: int, threads: int, settings=None) -> None:
        """Run alone or split in TRIAL_ORDER, timing each; after SPLIT_TRIALS of both keep the faster by
        their best times (split only when it saves 10%: the pool's hand-off cost varies)."""
        alone, split = plan[2], plan[3]
        native = self._native_pool(settings)
        if native is not None:
            native.ensure(threads)        # made before the clock starts
        t0 = time.perf_counter()
        if TRIAL_ORDER[(len(alone) + len(split)) % len(TRIAL_ORDER)] == "S":
            self._parallel(fn, buffers, vals, extent, threads, settings)
            split.append(time.perf_counter() - t0)
        else:
            fn(*(self._args(buffers, 0) if self._nhidden else buffers), *vals, 0, extent)
            alone.append(time.perf_counter() - t0)
            plan[6] = max(plan[7], int(min(alone) / SPLIT_MIN_CHUNK_S))
        if len(split) >= SPLIT_TRIALS and len(alone) >= SPLIT_TRIALS:
            plan[0] = _SPLIT if min(split) < 0.9 * min(alone) else _ONE
            if plan[0] is _SPLIT:
                plan[4], plan[5] = RETRIAL_EVERY, RETRIAL_FIRST
            else:
                plan[4], plan[5] = plan[5], min(2 * plan[5], RETRIAL_EVERY)

    @staticmethod
    def _chunks(threads: int) -> int:
        """The chunks a split over `threads` threads of the native pool is cut into."""
        return threads * CHUNKS_PER_THREAD

    @staticmethod
    def _chunk_step(extent: int, chunks: int, stream: bool) -> int:
        """Items per chunk of a launch over `extent` cut into at most `chunks` (a streaming variant's chunks start
        on multiples of STREAM_ALIGN)."""
        step = max(1, -(-extent // max(1, min(chunks, extent))))
        return -(-step // STREAM_ALIGN) * STREAM_ALIGN if stream else step

    def _block_words(self, address: int, buffers, vals, extent: int, step: int, threads: int) -> list[int]:
        """A native launch's argument block (pool.py's trampolines): the kernel's address, the table's offset,
        per chunk its buffers, values and (start, end), then the table: the hidden buffers of each of `threads`
        threads (the chunks a thread claims run one after another on its set)."""
        rows = len(range(0, extent, step))
        words = [address, 2 + rows * (self._nbuf + len(vals) + 2)]
        for s in range(0, extent, step):
            words += buffers
            words += vals
            words += (s, min(s + step, extent))
        if self._nhidden:
            for t in range(threads):
                words += self._args((), t)
        return words

    def _parallel(self, fn, buffers, vals, extent: int, threads: int, settings=None) -> None:
        native = self._native_pool(settings)
        step = self._chunk_step(extent, self._chunks(threads) if native is not None else threads,
                                fn is self._stream_fn)
        if native is not None:
            key = (fn is self._stream_fn, tuple(buffers), tuple(vals), extent, step, threads)
            cached = self._blocks.get(key)    # (block, chunks), never changed once built: concurrent
            if cached is None:                # launches of this program each keep the block they took
                words = self._block_words(self._stream_addr if key[0] else self.address, buffers, vals, extent, step,
                                          threads)
                if len(self._blocks) >= BLOCKS_KEPT:
                    self._blocks.clear()
                cached = self._blocks[key] = ((ctypes.c_int64 * len(words))(*words), len(range(0, extent, step)))
            native.run(self._trampoline, cached[0], cached[1], threads)
            return
        pool = worker_pool(threads)
        if self._nhidden:     # each chunk its own hidden buffers
            futures = [pool.submit(fn, *self._args(buffers, c), *vals, s, min(s + step, extent))
                       for c, s in enumerate(range(step, extent, step), 1)]
            fn(*self._args(buffers, 0), *vals, 0, min(step, extent))
        else:
            futures = [pool.submit(fn, *buffers, *vals, s, min(s + step, extent))
                       for s in range(step, extent, step)]
            fn(*buffers, *vals, 0, min(step, extent))   # the calling thread takes the first chunk
        for f in futures:
            f.result()


# a captured plan keeps its launches' split choices for this many replays, then the plan replays launch by launch
# again with every choice a trial made open to a new trial (the host's load may have changed since), and captures
# itself anew once they are decided
RECAPTURE_AFTER = 1024


class CPUPlanCapture:
    """An ExecutionPlan's launches replayed by one native call (`NativePool.run_plan`): each step an argument
    block built once, with its split chosen as `CPUProgram._execute` chooses it (a plan is captured once no
    launch of it is still timing its split, and keeps those choices: no retrials while captured). A replay then
    spends no Python between launches: a split launch costs ~9 us of it on the 2-vCPU CI machine, against ~3 for
    the kernel call alone (resnet50's 88 launches, densenet121's 253).

    Its blocks name the programs' own hidden buffers (a packed matmul's panels, one set per thread, as a launch by
    launch replay uses them), whose locks a replay holds: a direct launch of such a program on another thread
    waits for it. It follows the plan's bound pointers as they were when captured; `run(wait, patches)` writes
    other memory into given arguments for one replay (a plan's `run(bind=...)`) and puts them back. The CPU
    settings (config.cpu_launch) are compared at every replay: a change rebuilds the blocks. After
    RECAPTURE_AFTER replays it expires: the plan replays launch by launch, the launches whose split a trial chose
    try again, and the plan captures itself anew."""

    @staticmethod
    def ready(plan) -> bool:
        """Whether every launch of the plan has its split decided (none still in its trial)."""
        for st in plan.steps:
            prog = st.program
            if (isinstance(prog, CPUProgram) and st.gs and st.gs[0] > 1
                    and prog._plan_for(list(st.ordered))[0] is _TRIAL):
                return False
        return True

    def __init__(self, device, plan) -> None:
        self.device = device
        self._replays = 0
        self._steps = list(plan.steps)
        self._settings = None
        self._build()

    def _build(self) -> None:
        settings = config.cpu_launch(POOL_SPIN)
        if settings[1] != "native":
            raise LaunchError("plan on CPU: MOROK_CPU_POOL=python, so its launches are not captured")
        quads: list[int] = []
        scratch: dict[int, CPUProgram] = {}      # the programs whose hidden buffers the blocks name
        self._blocks: list = []
        self._words: list[np.ndarray] = []       # per step: its block as int64s (a view: patches write through it)
        self._stream: list[frozenset] = []      # per step: the output slots its streaming variant needs aligned
        self._rows: list[tuple[int, int, int]] = []     # per step: (chunks, words per row, first row's offset)
        most = 1
        for st in self._steps:
            prog = st.program
            if not isinstance(prog, CPUProgram):
                raise LaunchError(f"plan on CPU: step {prog.name} is not a CPU program")
            native = prog._native_pool(settings)
            if native is None:
                raise LaunchError(f"plan on CPU: no native pool ({native_pool_error()})")
            buffers, vals, extent = list(st.ptrs), list(st.ordered), int(st.gs[0]) if st.gs else 1
            threads, address = 1, prog.address
            if extent > 1:
                plan = prog._plan_for(vals)
                if plan[0] is not _ONE:
                    threads = min(settings[0], plan[6], extent)
                if plan[1] and prog._stream_addr and all(buffers[s] % STREAM_ALIGN == 0 for s in prog._stream_slots):
                    address = prog._stream_addr
            step = prog._chunk_step(extent, prog._chunks(threads) if threads > 1 else 1,
                                    address == prog._stream_addr)
            if prog._nhidden:
                scratch[id(prog)] = prog
            workers = max(0, min(threads, len(range(0, extent, step))) - 1)
            with prog._hidden_lock:     # the program's own per-thread scratch (its lock held at replays)
                words = prog._block_words(address, buffers, vals, extent, step, workers + 1)
            block = (ctypes.c_int64 * len(words))(*words)
            self._blocks.append(block)
            self._words.append(np.frombuffer(block, dtype=np.int64))
            self._stream.append(frozenset(prog._stream_slots) if address == prog._stream_addr else frozenset())
            chunks = len(range(0, extent, step))
            self._rows.append((chunks, len(buffers) + len(vals) + 2, 2))
            most = max(most, workers + 1)
            quads += [prog._trampoline, ctypes.addressof(block), chunks, workers]
        # the hidden-buffer locks of the programs whose scratch the blocks name, taken in one order at every replay:
        # a direct launch of one of them on another thread waits, as it does for another launch
        self._locks = [scratch[k]._hidden_lock for k in sorted(scratch)]
        self._quads = (ctypes.c_int64 * max(1, len(quads)))(*quads)
        self._count = len(self._steps)
        self._threads = most
        self._native = native_pool(llvm())
        self._settings = settings

    def accepts(self, patches: Sequence[tuple[int, int, int]]) -> bool:
        """Whether `run` can take these patches: a step captured with its streaming variant (aligned stores)
        keeps STREAM_ALIGN-aligned outputs; other memory there replays launch by launch (the plain variant)."""
        return all(ptr % STREAM_ALIGN == 0 for i, j, ptr in patches if j in self._stream[i])

    def run(self, wait: bool = False, patches: Sequence[tuple[int, int, int]] = ()) -> float | None:
        """Replay every launch; `patches` (step, argument, address): memory standing in for that argument in
        every chunk of that step, for this replay only."""
        t0 = time.perf_counter()
        if config.cpu_launch(POOL_SPIN) != self._settings:
            self._build()
        self._replays += 1
        saved = []
        held = 0
        try:
            for lock in self._locks:
                lock.acquire()
                held += 1
            # one strided write per patch (argument j of every chunk's row). Written chunk by chunk in Python, the
            # MLP of benchmarks/onnx_models.py, whose input and output are bound, replayed in 0.20 ms against 0.15
            # now on the 16-core Xeon (cpu-xeon-avx512-16c/onnx_models.json: 0c506ca, listed in the file, and 99c4442; two
            # instances of that machine, 0.17 ms at 62f91a0 on a third)
            for i, j, ptr in patches:
                chunks, row, first = self._rows[i]
                column = self._words[i][first + j:first + j + chunks * row:row]
                saved.append((column, column.copy()))
                column[:] = ptr
            self._native.run_plan(self._quads, self._count, self._threads)
        finally:
            for column, old in reversed(saved):
                column[:] = old
            for lock in self._locks[:held]:
                lock.release()
        return time.perf_counter() - t0 if wait else None

    def __call__(self, wait: bool = False) -> float | None:
        return self.run(wait)

    def describe(self) -> str:
        """What the capture replays, as MOROK_DEBUG=1 prints it when it is made."""
        split = [q for q in range(self._count) if self._quads[4 * q + 3] > 0]
        return (f"captured {self._count} launches into one native call: {len(split)} split over up to "
                f"{self._threads} threads, {self._count - len(split)} on the calling thread")

    @property
    def expired(self) -> bool:
        """Replayed RECAPTURE_AFTER times: the plan should drop it (`expire`) and replay its launches."""
        return self._replays >= RECAPTURE_AFTER

    def expire(self) -> None:
        """Every launch of the plan whose split a trial chose times itself again at its next launch."""
        for st in self._steps:
            prog = st.program
            plans = getattr(prog, "_plans", None)
            plan = plans.get(tuple(st.ordered)) if plans is not None else None
            if plan is not None and plan[3] and plan[0] is not _TRIAL:
                plan[4] = 0
