"""Native worker threads for split CPU launches.

Python's ThreadPoolExecutor hands a chunk to a worker through a queue, a condition variable and the GIL:
measured on this project's 2-vCPU CI machine, one extra chunk costs 58 us per launch and 11 extra chunks
316 us, which is more than a 256x512x10 matmul takes on one core. Here the workers are native threads
(pthreads) that run JIT-compiled code only and never touch the interpreter:

- the launching thread writes the job (a trampoline, its argument block, the chunk count), bumps a
  generation counter and wakes sleeping workers with one futex call;
- a launch asks for `threads - 1` workers: the first that many to see the new generation join it (a ticket
  that holds the generation and the count joined; the others go back to waiting at once), so a launch that
  takes fewer threads than the pool has waits only for those, not for every worker to wake;
- every thread taking part, the launching one included, claims chunks with an atomic add until none is left:
  first from its own home block (the launch's chunks cut into one contiguous block per thread; the launching
  thread owns block 0 and worker k block k + 1, modulo the launch's threads), then from the others' blocks in
  turn. A thread so takes the same share of every launch's outer range: the pixels a layer's unit wrote are
  the pixels the next layer's unit on that core reads, still in the core's own cache. One shared counter
  (`set_home(False)`) dealt chunks in arrival order. benchmarks/cpu_pool.py on the 16-core Xeon
  (cpu-xeon-avx512-16c/cpu_pool.json; the same captured plans, interleaved), home blocks against one counter:
  resnet50 10.48 against 11.15 ms, densenet121 15.36 against 15.51, the MobileNet stack 0.646 against 0.762,
  the MLP 0.137 against 0.147;
- once every chunk is claimed the launching thread closes the ticket (its count all ones: no worker joins
  after that, whatever a later launch asks for) and waits
  (spinning, then yielding) for the workers that joined to finish theirs. A worker still asleep or
  descheduled when the work ran out is not waited for: the launch is never slower than its own thread
  plus the hand-off (benchmarks/kernels.py on the 2-vCPU EPYC: the first split launch after an idle spell took 250-320 us
  waiting for its woken worker, where the kernel alone takes 112 us).

Idle workers spin for `MOROK_CPU_SPIN` pause instructions (default POOL_SPIN, some tens of microseconds)
before they sleep on the futex, so back-to-back launches (a graph executor's plan) find them awake.

Worker k is pinned to CPU k + 1 of the process's affinity set (the launching thread, not pinned, has the
rest; `MOROK_CPU_PIN=0` turns this off). Unpinned, a worker woken after an idle spell was often placed on
the launching thread's own CPU, which then ran every chunk itself: on the 2-vCPU EPYC the MLP of
benchmarks/onnx_models.py replayed in 1.05-1.16 ms after a 0.2 s pause against 0.55 ms back to back, and
0.61 ms pinned (the interleaved onnxruntime comparison pauses between blocks, so it measured the slow case).

A trampoline per kernel arity (B buffer pointers, H scratch pointers, V int32 values with start and end) reads
chunk c's arguments from row c of the block and the scratch of the thread that claimed it from a table of one set
per thread: `void tramp(i64 *block, i64 c, i64 slot)`, block = [kernel, table offset, rows..., table...], slot 0
the launching thread and 1.. the workers in the order they joined the launch. So a split's chunks may outnumber
its threads without a scratch set each.
One launch at a time uses the pool (a lock); Linux on x86-64 and AArch64 only (the futex call's number).
Elsewhere, or with MOROK_CPU_POOL=python, the runtime keeps the Python executor.
"""
from __future__ import annotations

import ctypes
import os
import platform
import threading

from morok_py import config

POOL_SPIN = 4096           # pause instructions an idle worker spins before it sleeps (a sched_yield every 64,
                           # so an oversubscribed or loaded machine still runs the others): ~10-600 us
QUEUES = 256              # the most threads of a launch that take home blocks of chunks (more: one shared counter)
# futex system call number, and the spin-wait hint (an intrinsic: MCJIT has no inline-asm parser)
_X86 = (202, "call void @llvm.x86.sse2.pause()", "declare void @llvm.x86.sse2.pause()")
_ARM = (98, "call void @llvm.aarch64.hint(i32 1)", "declare void @llvm.aarch64.hint(i32)")
_FUTEX = {"x86_64": _X86, "amd64": _X86, "aarch64": _ARM, "arm64": _ARM}


def _pool_ir(futex: int, pause: str, declare: str) -> str:
    return f"""
{declare}
@gen = internal global i32 0, align 64
@ticket = global i64 0, align 64            ; (generation << 32) | workers joined (all ones: closed)
@want = internal global i64 0                ; workers the launch asks for
@joined = global i64 0                       ; workers that joined the last launch (read by a test)
@fin = internal global i64 0, align 64       ; joined workers done with the launch
@next = internal global i64 0, align 64
@jfn = internal global ptr null, align 64
@jarg = internal global ptr null
@jn = internal global i64 0
@spin = global i64 {POOL_SPIN}
@home = global i64 1                         ; 1: threads take their own block of chunks first (NativePool.set_home)
@jt = internal global i64 0                  ; the launch's threads where it runs home blocks, else 0
@qnext = internal global [{QUEUES} x [8 x i64]] zeroinitializer, align 64   ; chunks claimed of each home block

declare i64 @syscall(i64, ...)
declare i32 @sched_yield()

define internal void @drain(i64 %slot, i64 %id) {{
entry:
  %fn = load ptr, ptr @jfn
  %arg = load ptr, ptr @jarg
  %n = load i64, ptr @jn
  %t = load i64, ptr @jt
  %homed = icmp ne i64 %t, 0
  br i1 %homed, label %start, label %loop
loop:
  %i = atomicrmw add ptr @next, i64 1 monotonic
  %more = icmp ult i64 %i, %n
  br i1 %more, label %run, label %done
run:
  call void %fn(ptr %arg, i64 %i, i64 %slot)
  br label %loop
start:
  ; each of the launch's t threads owns the block of chunks [q * n / t, (q + 1) * n / t) of queue q = its identity
  ; (mod t): it takes its own block first, then what is left of the others', in turn from the next
  %q0 = urem i64 %id, %t
  br label %queue
queue:
  %j = phi i64 [ 0, %start ], [ %j1, %spent ]
  %qs = add i64 %q0, %j
  %wrap = icmp uge i64 %qs, %t
  %qw = sub i64 %qs, %t
  %q = select i1 %wrap, i64 %qw, i64 %qs
  %lo0 = mul i64 %q, %n
  %lo = udiv i64 %lo0, %t
  %q1 = add i64 %q, 1
  %hi0 = mul i64 %q1, %n
  %hi = udiv i64 %hi0, %t
  %len = sub i64 %hi, %lo
  %cp = getelementptr [8 x i64], ptr @qnext, i64 %q
  br label %peek
peek:
  %seen = load atomic i64, ptr %cp monotonic, align 64
  %open = icmp ult i64 %seen, %len
  br i1 %open, label %claim, label %spent
claim:
  %c = atomicrmw add ptr %cp, i64 1 monotonic
  %mine = icmp ult i64 %c, %len
  br i1 %mine, label %own, label %spent
own:
  %ci = add i64 %lo, %c
  call void %fn(ptr %arg, i64 %ci, i64 %slot)
  br label %claim
spent:
  %j1 = add i64 %j, 1
  %again = icmp ult i64 %j1, %t
  br i1 %again, label %queue, label %done
done:
  ret void
}}

; a worker: wait for a generation other than the one it last saw, join it if it still asks for workers
; (drain it, count itself done), else go back to waiting
define ptr @morok_pool_worker(ptr %start) {{
entry:
  %st64 = ptrtoint ptr %start to i64
  %g0 = trunc i64 %st64 to i32
  %me = lshr i64 %st64, 32
  br label %wait
wait:
  %seen = phi i32 [ %g0, %entry ], [ %cur, %full ], [ %cur, %done ]
  br label %poll
poll:
  %k = phi i64 [ 0, %wait ], [ %k1, %pause ], [ %k1, %yield ], [ %k, %sleep ]
  %cur = load atomic i32, ptr @gen acquire, align 4
  %changed = icmp ne i32 %cur, %seen
  br i1 %changed, label %work, label %idle
idle:
  %lim = load atomic i64, ptr @spin monotonic, align 8
  %under = icmp ult i64 %k, %lim
  br i1 %under, label %pause, label %sleep
pause:
  {pause}
  %k1 = add i64 %k, 1
  %nth = and i64 %k1, 63
  %give = icmp eq i64 %nth, 0
  br i1 %give, label %yield, label %poll
yield:
  %y = call i32 @sched_yield()
  br label %poll
sleep:
  %s64 = zext i32 %seen to i64
  %r = call i64 (i64, ...) @syscall(i64 {futex}, ptr @gen, i64 128, i64 %s64, ptr null)
  br label %poll
work:
  ; the ticket is written before the generation is published, so it names %cur or a later generation
  %t = load atomic i64, ptr @ticket acquire, align 8
  %tg = lshr i64 %t, 32
  %tg32 = trunc i64 %tg to i32
  %same = icmp eq i32 %tg32, %cur
  br i1 %same, label %room, label %full
room:
  %cnt = and i64 %t, 4294967295
  %w = load i64, ptr @want
  %open = icmp ult i64 %cnt, %w
  br i1 %open, label %join, label %full
join:
  %t1 = add i64 %t, 1
  %pair = cmpxchg ptr @ticket, i64 %t, i64 %t1 acq_rel acquire
  %ok = extractvalue {{ i64, i1 }} %pair, 1
  br i1 %ok, label %done, label %work
done:
  %slot = and i64 %t1, 4294967295
  call void @drain(i64 %slot, i64 %me)
  %old = atomicrmw add ptr @fin, i64 1 release
  br label %wait
full:
  br label %wait
}}

; one launch: publish the job, wake the workers, take chunks too; once every chunk is claimed, close the
; ticket (no worker joins after that) and wait for the workers that joined
define void @morok_pool_run(ptr %fn, ptr %arg, i64 %n, i64 %workers) {{
entry:
  store ptr %fn, ptr @jfn
  store ptr %arg, ptr @jarg
  store i64 %n, ptr @jn
  store atomic i64 0, ptr @next monotonic, align 8
  store atomic i64 0, ptr @fin monotonic, align 8
  store i64 %workers, ptr @want
  ; home blocks for up to {QUEUES} threads where @home asks for them: their counters zeroed before publishing
  %hm = load i64, ptr @home
  %tt = add i64 %workers, 1
  %fits = icmp ule i64 %tt, {QUEUES}
  %hon = icmp ne i64 %hm, 0
  %use = and i1 %fits, %hon
  %jt = select i1 %use, i64 %tt, i64 0
  store i64 %jt, ptr @jt
  br label %zero
zero:
  %qz = phi i64 [ 0, %entry ], [ %qz1, %zero ]
  %zp = getelementptr [8 x i64], ptr @qnext, i64 %qz
  store i64 0, ptr %zp, align 64
  %qz1 = add i64 %qz, 1
  %zmore = icmp ult i64 %qz1, %jt
  br i1 %zmore, label %zero, label %publish
publish:
  %g = load atomic i32, ptr @gen monotonic, align 4
  %g1 = add i32 %g, 1
  %g64 = zext i32 %g1 to i64
  %tk = shl i64 %g64, 32
  store atomic i64 %tk, ptr @ticket release, align 8
  %old = atomicrmw add ptr @gen, i32 1 seq_cst
  %w = call i64 (i64, ...) @syscall(i64 {futex}, ptr @gen, i64 129, i64 %workers)
  call void @drain(i64 0, i64 0)
  br label %close
close:
  ; closed: the count all ones, which no worker reads as room. Closed as full (the count %workers), a worker
  ; that saw this generation's ticket after the next launch had stored its larger @want (but not yet its ticket)
  ; joined this finished launch: it ran chunks of the half-published next job and counted itself done in @fin
  ; after that launch zeroed it, so the next launch waited forever for @fin to equal its workers (16 threads
  ; on 2 vCPUs: a resnet50 replay hung within 50 replays)
  %t = load atomic i64, ptr @ticket acquire, align 8
  %cnt = and i64 %t, 4294967295
  %hi = sub i64 %t, %cnt
  %shut = or i64 %hi, 4294967295
  %pair = cmpxchg ptr @ticket, i64 %t, i64 %shut acq_rel acquire
  %ok = extractvalue {{ i64, i1 }} %pair, 1
  br i1 %ok, label %closed, label %close
closed:
  store i64 %cnt, ptr @joined
  br label %wait
wait:
  %k = phi i64 [ 0, %closed ], [ %k1, %pause ], [ 0, %yield ]
  %f = load atomic i64, ptr @fin acquire, align 8
  %z = icmp eq i64 %f, %cnt
  br i1 %z, label %done, label %spinning
spinning:
  %short = icmp ult i64 %k, 64
  br i1 %short, label %pause, label %yield
pause:
  {pause}
  %k1 = add i64 %k, 1
  br label %wait
yield:
  %y = call i32 @sched_yield()
  br label %wait
done:
  ret void
}}

; a captured plan (CPUPlanCapture): steps[i] = (trampoline, argument block, chunks, workers) as i64s; a step of
; no workers runs its chunks here, one after another, without publishing a job or waking anyone
define void @morok_pool_run_plan(ptr %steps, i64 %count) {{
entry:
  br label %loop
loop:
  %i = phi i64 [ 0, %entry ], [ %i1, %next ]
  %more = icmp ult i64 %i, %count
  br i1 %more, label %body, label %done
body:
  %base = mul i64 %i, 4
  %p0 = getelementptr i64, ptr %steps, i64 %base
  %fn = load ptr, ptr %p0, align 8
  %p1 = getelementptr i64, ptr %p0, i64 1
  %arg = load ptr, ptr %p1, align 8
  %p2 = getelementptr i64, ptr %p0, i64 2
  %n = load i64, ptr %p2, align 8
  %p3 = getelementptr i64, ptr %p0, i64 3
  %w = load i64, ptr %p3, align 8
  %alone = icmp eq i64 %w, 0
  br i1 %alone, label %chunks, label %split
chunks:
  %c = phi i64 [ 0, %body ], [ %c1, %chunk ]
  %cm = icmp ult i64 %c, %n
  br i1 %cm, label %chunk, label %next
chunk:
  call void %fn(ptr %arg, i64 %c, i64 0)
  %c1 = add i64 %c, 1
  br label %chunks
split:
  call void @morok_pool_run(ptr %fn, ptr %arg, i64 %n, i64 %w)
  br label %next
next:
  %i1 = add i64 %i, 1
  br label %loop
done:
  ret void
}}

define i32 @morok_pool_generation() {{
  %g = load atomic i32, ptr @gen acquire, align 4
  ret i32 %g
}}
"""


def _trampoline_ir(nbuf: int, nhidden: int, nval: int) -> str:
    """`void morok_tramp(i64 *block, i64 c, i64 slot)`: calls block[0] with row c's nbuf pointers, then the
    nhidden scratch pointers of the thread that runs the chunk (its `slot`: 0 the launching thread, 1.. the
    workers in the order they joined) from the table at word block[1], then row c's nval int32s. Rows start
    at word 2, nbuf + nval words each; the table holds nhidden words per slot."""
    row = nbuf + nval
    loads, args = [], []
    for i in range(nbuf):
        loads.append(f"  %b{i}p = getelementptr i64, ptr %row, i64 {i}")
        loads.append(f"  %b{i} = load ptr, ptr %b{i}p, align 8")
        args.append(f"ptr %b{i}")
    if nhidden:
        loads.append("  %tp = getelementptr i64, ptr %block, i64 1")
        loads.append("  %toff = load i64, ptr %tp, align 8")
        loads.append(f"  %soff = mul i64 %slot, {nhidden}")
        loads.append("  %tstart = add i64 %toff, %soff")
        loads.append("  %table = getelementptr i64, ptr %block, i64 %tstart")
    for h in range(nhidden):
        loads.append(f"  %h{h}p = getelementptr i64, ptr %table, i64 {h}")
        loads.append(f"  %h{h} = load ptr, ptr %h{h}p, align 8")
        args.append(f"ptr %h{h}")
    for i in range(nbuf, row):
        loads.append(f"  %v{i}p = getelementptr i64, ptr %row, i64 {i}")
        loads.append(f"  %w{i} = load i64, ptr %v{i}p, align 8")
        loads.append(f"  %v{i} = trunc i64 %w{i} to i32")
        args.append(f"i32 %v{i}")
    body = "\n".join(loads)
    return f"""
define void @morok_tramp(ptr %block, i64 %c, i64 %slot) {{
  %fn = load ptr, ptr %block, align 8
  %off = mul i64 %c, {row}
  %start = add i64 %off, 2
  %row = getelementptr i64, ptr %block, i64 %start
{body}
  call void %fn({", ".join(args)})
  ret void
}}
"""


class NativePool:
    """The process's native workers (created on demand, never stopped: they sleep when idle and end with
    the process; a forked child makes its own)."""

    def __init__(self, llvm) -> None:
        arch = platform.machine().lower()
        if os.name != "posix" or platform.system() != "Linux" or arch not in _FUTEX:
            raise OSError(f"no native CPU pool on {platform.system()} {arch}: Linux on x86-64 or AArch64 only")
        self._llvm = llvm
        self._engine = self._jit(_pool_ir(*_FUTEX[arch]))
        # never freed: a worker may still be spinning in this code while the interpreter shuts down
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._engine))
        self._run = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)(
            self._engine.get_function_address("morok_pool_run"))
        self._run_plan = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)(
            self._engine.get_function_address("morok_pool_run_plan"))
        self._generation = ctypes.CFUNCTYPE(ctypes.c_int32)(self._engine.get_function_address("morok_pool_generation"))
        self._worker = self._engine.get_function_address("morok_pool_worker")
        self._spin = ctypes.c_int64.from_address(self._engine.get_global_value_address("spin"))
        self._home = ctypes.c_int64.from_address(self._engine.get_global_value_address("home"))
        libc = ctypes.CDLL(None, use_errno=True)
        self._create = libc.pthread_create
        self._create.argtypes = [ctypes.POINTER(ctypes.c_ulong), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._create.restype = ctypes.c_int
        self._detach = libc.pthread_detach
        self._detach.argtypes = [ctypes.c_ulong]
        self._attr_init, self._attr_destroy = libc.pthread_attr_init, libc.pthread_attr_destroy
        self._setaffinity = getattr(libc, "pthread_attr_setaffinity_np", None)
        if self._setaffinity is not None:
            self._setaffinity.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.pinned: list[int] = []          # the CPU of each pinned worker, in creation order
        self._trampolines: dict[tuple[int, int, int], tuple[object, int]] = {}
        self.workers = 0
        self.lock = threading.Lock()
        self._pid = os.getpid()
        # a child forked while another thread held the lock (or ran a launch) starts with a free lock and
        # no workers: the parent's threads did not come along
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self.lock = threading.Lock()
        self.workers, self._pid = 0, os.getpid()
        self.pinned = []

    def _jit(self, ir: str):
        """An execution engine of `ir`, with a target machine of its own (an engine owns and frees its
        target machine: one shared with a program would dangle once the program is dropped)."""
        llvm = self._llvm
        triple = llvm.get_process_triple()
        tm = llvm.Target.from_triple(triple).create_target_machine(codemodel="jitdefault")
        mod = llvm.parse_assembly(ir)
        mod.triple = triple
        mod.verify()
        engine = llvm.create_mcjit_compiler(mod, tm)
        engine.finalize_object()
        return engine

    def trampoline(self, nbuf: int, nhidden: int, nval: int) -> int:
        """The address of the trampoline for kernels of nbuf buffer pointers, nhidden scratch pointers (one set
        per thread, `_trampoline_ir`) and nval int32 values (compiled once)."""
        key = (nbuf, nhidden, nval)
        got = self._trampolines.get(key)
        if got is None:
            with self.lock:
                got = self._trampolines.get(key)
                if got is None:
                    engine = self._jit(_trampoline_ir(nbuf, nhidden, nval))
                    got = self._trampolines[key] = (engine, engine.get_function_address("morok_tramp"))
        return got[1]

    def _grow(self, n: int) -> None:
        """At least n workers (called with the lock held, no launch in flight)."""
        if os.getpid() != self._pid:        # a forked child: the parent's workers did not come along
            self.workers, self._pid, self.pinned = 0, os.getpid(), []
        while self.workers < n:
            tid = ctypes.c_ulong()
            # the worker starts from the current generation (passed in, not read by it: a worker that
            # starts late must still take part in the next launch, which counts it)
            attr = self._attr(self._cpu_for(self.workers))
            # ... and its identity above it (the home block of chunks it takes first: 1.., the launching thread 0)
            start = (self._generation() & 0xFFFFFFFF) | ((self.workers + 1) << 32)
            err = self._create(ctypes.byref(tid), attr, self._worker, start)
            if attr is not None:
                self._attr_destroy(attr)
            if err:
                raise OSError(err, f"pthread_create failed: {os.strerror(err)}")
            self._detach(tid.value)
            self.workers += 1

    def _cpu_for(self, k: int) -> int | None:
        """The CPU worker k is pinned to (None: not pinned): the (k + 1)-th of the process's affinity set, so
        the launching thread keeps the first to itself while the workers fit."""
        if not config.cpu_pin():
            return None
        try:
            cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return None
        if len(cpus) < 2:
            return None
        return cpus[(k + 1) % len(cpus)]

    def _attr(self, cpu: int | None):
        """A pthread_attr_t asking for CPU `cpu` alone (None where not pinned, or the call is missing)."""
        if cpu is None or self._setaffinity is None:
            return None
        attr = ctypes.create_string_buffer(256)         # pthread_attr_t: 56 bytes (x86-64 glibc), 64 (AArch64)
        if self._attr_init(attr) != 0:
            return None
        words = max(16, cpu // 64 + 1)
        mask = (ctypes.c_ulong * words)()
        mask[cpu // 64] |= 1 << (cpu % 64)
        if self._setaffinity(attr, ctypes.sizeof(mask), mask) != 0:
            self._attr_destroy(attr)
            return None
        self.pinned.append(cpu)
        return attr

    def set_spin(self, n: int) -> None:
        """Pause instructions idle workers spin before sleeping (read by them at their next wait)."""
        if self._spin.value != n:
            self._spin.value = n

    def set_home(self, on: bool) -> None:
        """Whether the threads of a launch take their own block of chunks first (read at the next launch)."""
        self._home.value = 1 if on else 0

    @property
    def home(self) -> bool:
        return bool(self._home.value)

    def ensure(self, threads: int) -> None:
        """Workers for `threads`-way launches, made now (a launch that times itself should not count the
        pthread_create calls: a split trial that did kept a 12-thread matmul on one thread)."""
        if self.workers < threads - 1 or os.getpid() != self._pid:
            with self.lock:
                self._grow(threads - 1)

    def run_plan(self, steps, count: int, threads: int) -> None:
        """Run `count` launches of a captured plan in one call: `steps` an array of (trampoline, block, chunks,
        workers) quads (a step of 0 workers runs its chunks on the calling thread alone), workers for `threads`-way
        splits made first."""
        with self.lock:
            self._grow(threads - 1)
            self._run_plan(ctypes.addressof(steps), count)

    def run(self, trampoline: int, block, chunks: int, threads: int) -> None:
        """Run `chunks` rows of `block` on the launching thread and threads - 1 workers (blocks until done;
        the pool's other workers stay out of it)."""
        with self.lock:
            if self.workers < threads - 1 or os.getpid() != self._pid:
                self._grow(threads - 1)
            self._run(trampoline, ctypes.addressof(block), chunks, max(0, threads - 1))


_pool_lock = threading.Lock()
_pool: NativePool | None = None
_pool_error: str | None = None


def native_pool(llvm) -> NativePool | None:
    """The process's pool, or None where it cannot exist (the reason is kept in `native_pool_error()`)."""
    global _pool, _pool_error
    if _pool is not None or _pool_error is not None:
        return _pool
    with _pool_lock:
        if _pool is None and _pool_error is None:
            try:
                _pool = NativePool(llvm)
            except (OSError, RuntimeError, AttributeError) as e:
                _pool_error = str(e)
    return _pool


def native_pool_error() -> str | None:
    return _pool_error
