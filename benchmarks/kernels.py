"""Kernel speed against the peers a user would pick instead, measured in the same run.

    python benchmarks/kernels.py --device CPU|CUDA|ROCM [--quick] [--only add,sum] [--no-sweep]

Kernels: elementwise add, sum of all elements, row max, softmax over rows, matmul (float32).
Peers: numpy (and numba if installed) on the CPU; CuPy and PyTorch on a GPU; and the device's own
memcpy bandwidth as the memory ceiling (bytes read + written / time). Every result is checked
against numpy once before it is timed. A size sweep of add (a few KiB to ~1 GiB per array) shows
where launch cost ends and bandwidth begins; it is drawn to a PNG beside the JSON.

Our time is the program's own `wait=True` time on the raw launch path (`Program.execute` with
addresses and launch sizes prepared once, as an ExecutionPlan replays it): perf_counter around the
call on the CPU, device events on a GPU. Peers on the CPU are timed with perf_counter, GPU peers
with their library's CUDA events.
"""
from __future__ import annotations

import gc
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import harness as H
from harness import np

CPU_TARGETS = {("add", "numpy"): 1.3, ("sum", "numpy"): 1.0, ("softmax", "numpy"): 1.5, ("matmul", "numpy"): 1.0,
               ("mlp1", "numpy"): 0.8, ("mlp2", "numpy"): 0.5}
GPU_TARGETS = {("add", "memcpy"): 0.95, ("sum", "memcpy"): 0.9, ("softmax", "memcpy"): 0.8,
               ("matmul", "cupy"): 0.5, ("matmul", "torch"): 0.5,
               ("sum_cols", "torch"): 0.9, ("gemv8", "torch"): 0.8, ("softmax_vocab", "torch"): 1.0,
               ("matmul_odd", "torch"): 0.85}
SYMBOLIC_TARGET = 0.95      # symbolic-size matmul time / static: within 5%
BLAS_SPIN_S = 0.3           # CPU: pause before timing ours, while a peer's BLAS threads stop spinning
COLD_COMPILE_TARGET_S = 0.150   # CPU: cold compile (render + compile + load, no cache) of a matmul
ALL = ("add", "sum", "row_max", "softmax", "matmul")
# the general suite: shapes one step off the tuned five (`--suite`)
SUITE = ("sum_cols", "gemv8", "softmax_vocab", "matmul", "matmul_sym", "matmul_odd", "mlp1", "mlp2")
KNOWN = ALL + tuple(n for n in SUITE if n not in ALL)


# ---------------------------------------------------------------------------------------------
# the cases


@dataclass
class Case:
    name: str
    label: str
    size: int                       # elements of the main input (M*N*K for matmul)
    shape: list[int]
    inputs: list[np.ndarray]
    out_shape: tuple[int, ...]
    ast: Any
    vals: dict[str, int]
    reference: Callable[..., np.ndarray]
    nbytes: int                     # minimal bytes read + written
    flops: int = 0
    rtol: float = 1e-4
    atol: float = 1e-5
    extra: dict = field(default_factory=dict)
    op: str = ""                    # the peers' operation when it is not `name` (a matmul shape, ...)

    @property
    def peer_op(self) -> str:
        return self.op or self.name


def _rand(rng, shape) -> np.ndarray:
    # uniform in [-1, 1): random (never zeros), fast to make at GiB sizes
    x = rng.random(shape, dtype=np.float32)
    x *= 2
    x -= 1
    return x


def make_case(name: str, args, gpu: bool, rng) -> Case:
    from morok_py import kernels as K
    sym = args.symbolic
    q = args.quick
    if name in ("add", "sum"):
        n = args.n or ((1 << 20) if q else (256 << 20 if gpu else 64 << 20))
        if name == "add":
            a, b = _rand(rng, n), _rand(rng, n)
            return Case("add", f"{n >> 20}M" if n >= 1 << 20 else str(n), n, [n], [a, b], (n,),
                        K.add(None if sym else n), {"n": n}, lambda a, b: a + b, 3 * 4 * n, n)
        a = _rand(rng, n)
        # float32 accumulation: allow an error relative to the sum of magnitudes
        return Case("sum", f"{n >> 20}M" if n >= 1 << 20 else str(n), n, [n], [a], (1,),
                    K.sum_all(None if sym else n), {"n": n}, lambda a: np.array([a.sum(dtype=np.float64)]),
                    4 * n + 4, n, rtol=0, atol=2e-6 * float(np.abs(a).sum(dtype=np.float64)))
    if name in ("row_max", "softmax"):
        r = c = 512 if q else 4096
        if name == "row_max" and gpu and not q:
            r = c = 8192
        x = _rand(rng, (r, c))
        if name == "row_max":
            return Case("row_max", f"{r}x{c}", r * c, [r, c], [x], (r,),
                        K.row_max(None if sym else r, None if sym else c), {"d0": r, "d1": c},
                        lambda x: x.max(axis=1), 4 * r * c + 4 * r, r * c)

        def ref(x):
            e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
            return e / e.sum(axis=1, keepdims=True)
        return Case("softmax", f"{r}x{c}", r * c, [r, c], [x], (r, c),
                    K.softmax(None if sym else r, None if sym else c), {"rows": r, "cols": c},
                    ref, 2 * 4 * r * c, 5 * r * c, rtol=1e-4, atol=1e-7)
    if name == "matmul":
        m = 256 if q else (4096 if gpu else 1024)
        a, b = _rand(rng, (m, m)), _rand(rng, (m, m))
        return Case("matmul", f"{m}^3", m * m * m, [m, m, m], [a, b], (m, m),
                    K.matmul(*((None,) * 3 if sym else (m, m, m))), {"M": m, "N": m, "K": m},
                    lambda a, b: a.astype(np.float64) @ b.astype(np.float64), 3 * 4 * m * m, 2 * m * m * m,
                    rtol=1e-3, atol=1e-3 * math.sqrt(m))
    if name == "sum_cols":
        r = c = 512 if q else (8192 if gpu else 4096)
        x = _rand(rng, (r, c))
        return Case("sum_cols", f"{r}x{c}", r * c, [r, c], [x], (c,),
                    K.reduce_axis("sum", [None if sym else r, None if sym else c], 0), {"d0": r, "d1": c},
                    lambda x: x.astype(np.float64).sum(0), 4 * r * c + 4 * c, r * c, rtol=1e-4,
                    atol=2e-6 * r, op="sum_cols")
    if name == "softmax_vocab":
        r, c = (64, 5000) if q else ((1000 if gpu else 256), 50257)
        x = _rand(rng, (r, c))

        def ref(x):
            e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
            return e / e.sum(axis=1, keepdims=True)
        return Case("softmax_vocab", f"{r}x{c}", r * c, [r, c], [x], (r, c),
                    K.softmax(None if sym else r, None if sym else c), {"rows": r, "cols": c},
                    ref, 2 * 4 * r * c, 5 * r * c, rtol=1e-4, atol=1e-7, op="softmax")
    shapes = {"gemv8": (8, 4096, 4096), "matmul_sym": (4096, 4096, 4096) if gpu else (1024, 1024, 1024),
              "matmul_odd": (4000, 3001, 1023) if gpu else (1000, 751, 333),
              "mlp1": (256, 784, 512), "mlp2": (256, 512, 10)}
    if name in shapes:
        m, kd, n = (min(x, 256) for x in shapes[name]) if q else shapes[name]
        a, b = _rand(rng, (m, kd)), _rand(rng, (kd, n))
        static = not sym and name != "matmul_sym"
        return Case(name, f"{m}x{kd}x{n}", m * kd * n, [m, kd, n], [a, b], (m, n),
                    K.matmul(*((m, n, kd) if static else (None,) * 3)), {"M": m, "N": n, "K": kd},
                    lambda a, b: a.astype(np.float64) @ b.astype(np.float64), 4 * (m * kd + kd * n + m * n),
                    2 * m * n * kd, rtol=1e-3, atol=1e-3 * math.sqrt(kd), op="matmul")
    raise ValueError(f"unknown kernel {name!r}; known: {', '.join(KNOWN)}")


# ---------------------------------------------------------------------------------------------
# ours


class Ours:
    """One compiled kernel on device buffers, launched through the raw path. On a GPU each timed launch has an
    untimed one queued ahead of it (`queue_ahead`), as each GPU peer's call has (gpu_peers): the device is busy
    when the start event is recorded, so the time is the kernel's own and not the host's ~4 us of launch call
    after that event on an idle device (the H200 host: 40.7 us for softmax 4096x4096 timed alone, 36.2 us
    back to back)."""
    queue_ahead = False

    def __init__(self, dev, ast, name: str, inputs: list[np.ndarray], out_size: int, vals: dict[str, int]):
        from morok_py import Buffer, dtypes
        self.dev = dev
        self.queue_ahead = H.is_gpu(dev)
        self.prog = dev.compile(ast, name=name)
        self.bufs = [Buffer.from_numpy(np.ascontiguousarray(x).reshape(-1), dev) for x in inputs]
        self.out = dev.buffer(out_size, dtypes.float32)
        info = self.prog.launch
        mine = {k: vals[k] for k in info.var_names}
        self.gs, self.ls = info.launch_dims(mine)
        self.vals = [mine[k] for k in info.var_names]
        self.ptrs = [b.ptr for b in self.bufs] + [self.out.ptr]

    def __call__(self) -> float:
        if self.queue_ahead:
            self.prog.execute(self.ptrs, self.vals, self.gs, self.ls)
        return self.prog.execute(self.ptrs, self.vals, self.gs, self.ls, wait=True)

    def result(self) -> np.ndarray:
        self.dev.synchronize()
        return self.out.numpy()

    def free(self) -> None:
        for b in self.bufs + [self.out]:
            b.free()


# ---------------------------------------------------------------------------------------------
# peers: each returns {peer name: (callable returning seconds or None, result getter)}


def xp_ops(xp) -> dict[str, Callable]:
    """The numpy spelling of each kernel, also valid for CuPy (same names, `out=` everywhere)."""

    def softmax(x, o):
        m = xp.max(x, axis=1, keepdims=True)
        xp.subtract(x, m, out=o)
        xp.exp(o, out=o)
        s = xp.sum(o, axis=1, keepdims=True)
        xp.divide(o, s, out=o)
        return o

    return {
        "add": lambda a, b, o: xp.add(a, b, out=o),
        "sum": lambda a, o: a.sum(),
        "row_max": lambda x, o: xp.max(x, axis=1, out=o),
        "softmax": softmax,
        "matmul": lambda a, b, o: xp.matmul(a, b, out=o),
        "sum_cols": lambda x, o: xp.sum(x, axis=0, out=o),
    }


def torch_ops(torch) -> dict[str, Callable]:
    return {
        "add": lambda a, b, o: torch.add(a, b, out=o),
        "sum": lambda a, o: a.sum(),
        "row_max": lambda x, o: torch.amax(x, dim=1, out=o),
        "softmax": lambda x, o: torch.softmax(x, dim=1),
        "matmul": lambda a, b, o: torch.matmul(a, b, out=o),
        "sum_cols": lambda x, o: torch.sum(x, dim=0, out=o),
    }


_NUMBA: dict | None = None


def numba_ops() -> dict[str, Callable] | None:
    """Hand-written parallel loops, as a numba user would write them (fastmath lets reductions vectorize)."""
    global _NUMBA
    if _NUMBA is not None:
        return _NUMBA
    nb = H.optional("numba")
    if nb is None:
        return None
    from numba import njit, prange

    @njit(parallel=True, fastmath=True, cache=False)
    def add(a, b, o):
        for i in prange(a.shape[0]):
            o[i] = a[i] + b[i]
        return o

    @njit(parallel=True, fastmath=True)
    def total(a, o):
        s = np.float32(0)
        for i in prange(a.shape[0]):
            s += a[i]
        o[0] = s
        return o

    @njit(parallel=True, fastmath=True)
    def row_max(x, o):
        for r in prange(x.shape[0]):
            m = x[r, 0]
            for j in range(1, x.shape[1]):
                m = max(m, x[r, j])
            o[r] = m
        return o

    @njit(parallel=True, fastmath=True)
    def softmax(x, o):
        for r in prange(x.shape[0]):
            m = x[r, 0]
            for j in range(1, x.shape[1]):
                m = max(m, x[r, j])
            s = np.float32(0)
            for j in range(x.shape[1]):
                e = np.exp(x[r, j] - m)
                o[r, j] = e
                s += e
            inv = np.float32(1) / s
            for j in range(x.shape[1]):
                o[r, j] *= inv
        return o

    @njit(parallel=True, fastmath=True)
    def sum_cols(x, o):
        # columns split over the threads, rows in order: each thread streams its own column strip
        n = x.shape[1]
        strip = 256
        for s in prange((n + strip - 1) // strip):
            lo, hi = s * strip, min(n, s * strip + strip)
            for j in range(lo, hi):
                o[j] = 0
            for r in range(x.shape[0]):
                for j in range(lo, hi):
                    o[j] += x[r, j]
        return o

    # matmul: numba's np.dot calls the same BLAS as numpy, so it is no separate peer
    _NUMBA = {"add": add, "sum": total, "row_max": row_max, "softmax": softmax, "sum_cols": sum_cols}
    return _NUMBA


def cpu_peers(case: Case, use_numba: bool) -> dict[str, tuple[Callable, Callable]]:
    out_np = np.empty(case.out_shape, np.float32)
    ins = case.inputs
    peers: dict[str, tuple[Callable, Callable]] = {}
    f = xp_ops(np)[case.peer_op]
    holder: dict[str, Any] = {}

    def run_np():
        holder["np"] = f(*ins, out_np)

    peers["numpy"] = (run_np, lambda: holder.get("np"))
    nb = numba_ops() if use_numba else None
    if nb and case.peer_op in nb:
        g = nb[case.peer_op]
        out_nb = np.empty(case.out_shape, np.float32)

        def run_nb():
            g(*ins, out_nb)
        peers["numba"] = (run_nb, lambda: out_nb)
    return peers


def gpu_peers(case: Case, libs: dict[str, Any]) -> dict[str, tuple[Callable, Callable]]:
    peers: dict[str, tuple[Callable, Callable]] = {}
    for lib_name, lib in libs.items():
        timer = H.event_timer(lib_name, lib)
        holder: dict[str, Any] = {}
        if lib_name == "cupy":
            cp = lib
            ins = [cp.asarray(x) for x in case.inputs]
            out = cp.empty(case.out_shape, cp.float32)
            f = xp_ops(cp)[case.peer_op]
            tonp = cp.asnumpy
        else:
            torch = lib
            ins = [torch.from_numpy(x).cuda() for x in case.inputs]
            out = torch.empty(case.out_shape, dtype=torch.float32, device="cuda")
            f = torch_ops(torch)[case.peer_op]
            tonp = lambda t: t.detach().cpu().numpy()   # noqa: E731

        def run(f=f, ins=ins, out=out, timer=timer, holder=holder):
            f(*ins, out)        # queued ahead, untimed, as Ours does
            return timer(lambda: holder.__setitem__("r", f(*ins, out)))

        peers[lib_name] = (run, lambda holder=holder, tonp=tonp: tonp(holder["r"]))
    return peers


def free_gpu_peers(libs: dict[str, Any]) -> None:
    gc.collect()
    if "cupy" in libs:
        libs["cupy"].get_default_memory_pool().free_all_blocks()
    if "torch" in libs:
        libs["torch"].cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# the memory ceiling


def memcpy_bandwidth(dev, nbytes: int, args, libs: dict[str, Any]) -> tuple[float, str]:
    """The device's own copy bandwidth (bytes read + written per second) and who measured it."""
    n = nbytes // 4
    if not H.is_gpu(dev):
        src = np.ones(n, np.float32)
        dst = np.empty_like(src)
        t = H.measure(lambda: np.copyto(dst, src), args.warmup, args.repeats)
        return 2 * nbytes / t, "numpy.copyto"
    best, who = 0.0, ""
    for lib_name, lib in libs.items():
        timer = H.event_timer(lib_name, lib)
        if lib_name == "cupy":
            src, dst = lib.ones(n, lib.float32), lib.empty(n, lib.float32)
            fn = lambda: timer(lambda: dst.data.copy_from_device_async(src.data, src.nbytes))  # noqa: E731
        else:
            src = lib.ones(n, dtype=lib.float32, device="cuda")
            dst = lib.empty_like(src)
            fn = lambda: timer(lambda: dst.copy_(src))  # noqa: E731
        t = H.measure(fn, args.warmup, args.repeats)
        if 2 * nbytes / t > best:
            best, who = 2 * nbytes / t, f"{lib_name} device-to-device copy"
        del src, dst
    if not best:   # no peer library: the backend's own device-to-device transfer, wall-timed
        from morok_py import dtypes
        a, b = dev.buffer(n, dtypes.float32), dev.buffer(n, dtypes.float32)

        def copy():
            a.copy_to(b)
            dev.synchronize()
        dev.synchronize()
        t = H.measure(copy, args.warmup, args.repeats)
        best, who = 2 * nbytes / t, "morok transfer (wall time)"
    free_gpu_peers(libs)
    return best, who


# ---------------------------------------------------------------------------------------------
# runs


def run_case(case: Case, dev, args, res: H.Results, ceiling: float, libs, bar: H.Progress) -> float:
    """Ours (the default schedule; with --beam also the searched one) and every peer, each checked against
    the reference, then timed together: `--rounds` interleaved rounds (one round: each block after the
    previous one). Returns our time (the median of our round medians)."""
    gpu = H.is_gpu(dev)
    targets = GPU_TARGETS if gpu else CPU_TARGETS
    common = {"label": case.label, "shape": case.shape, "symbolic": args.symbolic or case.name == "matmul_sym"}

    bar.step(f"{case.name} {case.label}: ours")
    want = case.reference(*case.inputs)
    ours = Ours(dev, case.ast, f"bench_{case.name}", case.inputs, int(np.prod(case.out_shape)), case.vals)
    ours()
    common["schedule"] = str(dev.renderer.render(case.ast, "schedule").linear.schedule)   # the default's
    H.check_close(f"{case.name} {case.label} (ours)", ours.result(), want, case.rtol, case.atol)
    mine = {case.name: (ours, common)}
    bar.advance()
    if args.beam:
        from morok_py import cache
        bar.step(f"{case.name} {case.label}: search (beam {args.beam})")
        found = cache.beam_search(dev, case.ast, f"bench_{case.name}", beam=args.beam, values=case.vals,
                                  seconds=args.beam_seconds)
        cache.clear_memory_caches()
        searched = Ours(dev, case.ast, f"bench_{case.name}", case.inputs, int(np.prod(case.out_shape)), case.vals)
        searched()
        H.check_close(f"{case.name} {case.label} (ours, searched)", searched.result(), want, case.rtol, case.atol)
        mine[case.name + "+beam"] = (searched, dict(common, schedule=str(found.schedule),
                                                    candidates_timed=len(found.times)))
        bar.advance()

    peers = gpu_peers(case, libs) if gpu else cpu_peers(case, not args.no_numba)
    for pname, (run, result) in peers.items():
        bar.step(f"{case.name} {case.label}: {pname} (check)")
        run()
        H.check_close(f"{case.name} {case.label} ({pname})", result(), want, case.rtol, case.atol)

    def before(label: str, prev: str | None) -> None:
        # a numpy matmul leaves OpenBLAS's threads spinning for ~0.1-0.2 s: on two cores that took one
        # from ours (256x784x512: 5.9 ms right after numpy, 3.0 ms 0.2 s later)
        if not gpu and label in mine and (prev is None or prev not in mine):
            import time
            time.sleep(BLAS_SPIN_S)

    bar.step(f"{case.name} {case.label}: timing ({args.rounds} round{'s' * (args.rounds > 1)})")
    fns = [(label, prog) for label, (prog, _) in mine.items()] + [(p, run) for p, (run, _) in peers.items()]
    rounds = H.interleaved(fns, args.rounds, args.repeats, args.warmup, before)
    med = {label: statistics.median(v) for label, v in rounds.items()}
    bar.advance()
    for pname in peers:
        for label, (_, extra) in mine.items():
            t_mine, t = med[label], med[pname]
            res.add(label, case.size, "s", t_mine, pname, t, gb_s=case.nbytes / t_mine / 1e9,
                    peer_gb_s=case.nbytes / t / 1e9,
                    gflop_s=case.flops / t_mine / 1e9 if case.flops else None,
                    peer_gflop_s=case.flops / t / 1e9 if case.flops else None,
                    target=targets.get((case.name, pname)), **extra,
                    **H.round_summary(rounds[label], rounds[pname]))
    had_peers = bool(peers)
    del peers
    for prog, _ in mine.values():
        prog.free()
    if gpu:
        free_gpu_peers(libs)
    for label, (_, extra) in mine.items():
        t_mine = med[label]
        if case.peer_op != "matmul":
            res.add(label, case.size, "GB/s", case.nbytes / t_mine / 1e9, "memcpy", ceiling / 1e9,
                    higher_is_better=True, target=targets.get((case.name, "memcpy")), bytes=case.nbytes, **extra,
                    **H.round_summary(rounds[label]))
        elif not had_peers:
            res.add(label, case.size, "s", t_mine, None, None,
                    gflop_s=case.flops / t_mine / 1e9 if case.flops else None, **extra,
                    **H.round_summary(rounds[label]))
    return med[case.name]


def symbolic_vs_static(dev, args, res: H.Results, rng) -> None:
    """matmul_sym's shape compiled with symbolic and with static sizes, on the same inputs, timed in the
    same interleaved rounds (ratio = static time / symbolic time, higher is better)."""
    from morok_py import kernels as K
    case = make_case("matmul_sym", args, H.is_gpu(dev), rng)
    m, kd, n = case.shape
    want = case.reference(*case.inputs)
    progs = {}
    for label, ast in (("symbolic", case.ast), ("static", K.matmul(m, n, kd))):
        progs[label] = Ours(dev, ast, f"bench_matmul_{label}", case.inputs, m * n, case.vals)
        progs[label]()
        H.check_close(f"matmul {case.label} ({label})", progs[label].result(), want, case.rtol, case.atol)
    rounds = H.interleaved(list(progs.items()), args.rounds, args.repeats, args.warmup)
    for p in progs.values():
        p.free()
    med = {k: statistics.median(v) for k, v in rounds.items()}
    res.add("matmul_sym_vs_static", case.size, "s", med["symbolic"], "static", med["static"], label=case.label,
            shape=case.shape, target=SYMBOLIC_TARGET, **H.round_summary(rounds["symbolic"], rounds["static"]))


def cold_compile(dev, res: H.Results, repeats: int) -> None:
    """The CPU target: a matmul compiled cold (memory caches cleared, disk cache off), render +
    compile + load, median of `repeats` after one warm-up compile of another kernel (library loads and
    LLVM initialization are paid once per process). The symbolic matmul is `morok compile`'s and
    benchmarks/compile.py's kernel; the static 1024^3 is the suite's."""
    import os
    import statistics
    import time
    from morok_py import cache
    from morok_py import kernels as K
    old = os.environ.get("MOROK_CACHE")
    os.environ["MOROK_CACHE"] = "0"
    try:
        dev.compile(K.named("add"), name="bench_warmup")
        for label, ast in (("matmul symbolic", K.matmul()), ("matmul 1024^3", K.matmul(1024, 1024, 1024))):
            times, parts = [], []
            for _ in range(repeats):
                cache.clear_memory_caches()
                t0 = time.perf_counter()
                spec = dev.renderer.render(ast, "bench_cold_matmul")
                t1 = time.perf_counter()
                compiled = dev.compiler.compile(spec)
                t2 = time.perf_counter()
                dev.runtime(compiled)
                times.append(time.perf_counter() - t0)
                parts.append((t1 - t0, t2 - t1))
            i = times.index(sorted(times)[len(times) // 2])
            res.add("compile_cold", 0, "s", statistics.median(times), f"target {COLD_COMPILE_TARGET_S * 1e3:g} ms",
                    COLD_COMPILE_TARGET_S, target=1.0, label=label, render_s=parts[i][0], compile_s=parts[i][1],
                    ir_bytes=len(spec.src), schedule=str(spec.linear.schedule) if spec.linear is not None else None)
    finally:
        if old is None:
            os.environ.pop("MOROK_CACHE", None)
        else:
            os.environ["MOROK_CACHE"] = old


def sweep(dev, args, res: H.Results, libs, bar: H.Progress, sizes: list[int], rng) -> None:
    """add over sizes: time and bandwidth for ours, each peer, and memcpy of the same arrays."""
    from morok_py import Buffer, dtypes
    from morok_py import kernels as K
    gpu = H.is_gpu(dev)
    cache = (128 << 20) if gpu else H.cache_bytes()
    for n in sizes:
        nbytes = 4 * n
        sets = H.rotations(3 * nbytes, cache) if not args.no_rotate else 1
        label = H.fmt_bytes(nbytes)
        host = [(_rand(rng, n), _rand(rng, n), np.empty(n, np.float32)) for _ in range(sets)]
        common = {"label": label, "bytes_per_array": nbytes, "input_sets": sets, "symbolic": args.symbolic}

        bar.step(f"sweep {label}: ours")
        prog = dev.compile(K.add(None if args.symbolic else n), name="bench_add")
        info = prog.launch
        vals = [n for _ in info.var_names]
        gs, ls = info.launch_dims({k: n for k in info.var_names})
        bufs = [[Buffer.from_numpy(a, dev), Buffer.from_numpy(b, dev), dev.buffer(n, dtypes.float32)]
                for a, b, _ in host]
        prog.execute([x.ptr for x in bufs[0]], vals, gs, ls, wait=True)
        H.check_close(f"add sweep {label} (ours)", bufs[0][2].numpy(), host[0][0] + host[0][1])
        calls = [lambda p=[x.ptr for x in bs]: prog.execute(p, vals, gs, ls, wait=True) for bs in bufs]
        t_ours = H.measure(H.Cycle(calls), args.warmup, args.repeats, min_time=args.min_time)
        bar.advance()
        for bs in bufs:
            for x in bs:
                x.free()
        del bufs

        peer_fns: dict[str, Callable] = {}
        copy_fns: list[Callable] = []
        if not gpu:
            peer_fns["numpy"] = H.Cycle([lambda a=a, b=b, c=c: np.add(a, b, out=c) for a, b, c in host])
            nb = numba_ops() if not args.no_numba else None
            if nb:
                nb["add"](*host[0])
                peer_fns["numba"] = H.Cycle([lambda a=a, b=b, c=c: nb["add"](a, b, c) for a, b, c in host])
            copy_fns = [lambda a=a, c=c: np.copyto(c, a) for a, b, c in host]
        else:
            for lib_name, lib in libs.items():
                timer = H.event_timer(lib_name, lib)
                if lib_name == "cupy":
                    dsets = [(lib.asarray(a), lib.asarray(b), lib.empty(n, lib.float32)) for a, b, _ in host]
                    # bind lib and timer now: the loop rebinds both for the next peer
                    peer_fns["cupy"] = H.Cycle([lambda a=a, b=b, c=c, lib=lib, timer=timer:
                                                timer(lambda: lib.add(a, b, out=c)) for a, b, c in dsets])
                    if not copy_fns:
                        copy_fns = [lambda a=a, c=c, timer=timer:
                                    timer(lambda: c.data.copy_from_device_async(a.data, a.nbytes))
                                    for a, b, c in dsets]
                else:
                    dsets = [(lib.from_numpy(a).cuda(), lib.from_numpy(b).cuda(),
                              lib.empty(n, dtype=lib.float32, device="cuda")) for a, b, _ in host]
                    peer_fns["torch"] = H.Cycle([lambda a=a, b=b, c=c, lib=lib, timer=timer:
                                                 timer(lambda: lib.add(a, b, out=c)) for a, b, c in dsets])
                    if not copy_fns:
                        copy_fns = [lambda a=a, c=c, timer=timer: timer(lambda: c.copy_(a)) for a, b, c in dsets]
        for pname, fn in peer_fns.items():
            bar.step(f"sweep {label}: {pname}")
            t = H.measure(fn, args.warmup, args.repeats, min_time=args.min_time)
            bar.advance()
            res.add("add_sweep", n, "s", t_ours, pname, t, gb_s=3 * nbytes / t_ours / 1e9,
                    peer_gb_s=3 * nbytes / t / 1e9, **common)
        if copy_fns:
            bar.step(f"sweep {label}: memcpy")
            t = H.measure(H.Cycle(copy_fns), args.warmup, args.repeats, min_time=args.min_time)
            bar.advance()
            res.add("add_sweep", n, "GB/s", 3 * nbytes / t_ours / 1e9, "memcpy", 2 * nbytes / t / 1e9,
                    higher_is_better=True, time_s=t_ours, peer_time_s=t, **common)
        if not peer_fns and not copy_fns:
            res.add("add_sweep", n, "s", t_ours, None, None, gb_s=3 * nbytes / t_ours / 1e9, **common)
        del host, peer_fns, copy_fns
        if gpu:
            free_gpu_peers(libs)
        gc.collect()


def chart(res: H.Results, dev) -> Callable[[Path], None]:
    def draw(png: Path) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        recs = [r for r in res.records if r["name"] == "add_sweep"]
        mach = H.machine(dev)
        fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.8))
        series: dict[str, dict[int, tuple[float, float]]] = {}
        for r in recs:
            nbytes = r["bytes_per_array"]
            if r["unit"] == "s":
                series.setdefault("morok_py", {})[nbytes] = (r["value"], r["gb_s"])
                if r["peer"]:
                    series.setdefault(r["peer"], {})[nbytes] = (r["peer_value"], r["peer_gb_s"])
            else:   # memcpy: a copy of one array (2 x bytes moved), drawn as bandwidth
                series.setdefault("morok_py", {})[nbytes] = (r["time_s"], r["value"])
                series.setdefault("memcpy (ceiling)", {})[nbytes] = (r["peer_time_s"], r["peer_value"])
        for name, pts in series.items():
            xs = sorted(pts)
            style = dict(marker="o", linewidth=2.4 if name == "morok_py" else 1.4)
            if name.startswith("memcpy"):
                style.update(linestyle="--", color="gray")
            ax_t.loglog(xs, [pts[x][0] * 1e6 for x in xs], label=name, **style)
            ax_b.semilogx(xs, [pts[x][1] for x in xs], label=name, **style)
        ax_t.set_xlabel("bytes per array")
        ax_t.set_ylabel("time per add (us)")
        ax_t.set_title("time: flat = launch cost, rising = bandwidth")
        ax_b.set_xlabel("bytes per array")
        ax_b.set_ylabel("GB/s (bytes read + written)")
        ax_b.set_title("bandwidth")
        for ax in (ax_t, ax_b):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.suptitle(f"float32 add on {mach['device']} ({mach['model']}, {mach['cores']} cores) - {mach['date']}")
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        plt.close(fig)
    return draw


def main() -> None:
    p = H.parser(__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(ALL), help=f"comma-separated subset of {','.join(KNOWN)}")
    p.add_argument("--suite", action="store_true", help=f"the general suite: {','.join(SUITE)}")
    p.add_argument("--beam", type=int, default=0, help="also search N candidate schedules per kernel (MOROK_BEAM) "
                   "and time the winner")
    p.add_argument("--beam-seconds", type=float, default=60.0, help="time budget of one search")
    p.add_argument("--n", type=int, default=0, help="elements for add and sum (default 64M CPU, 256M GPU)")
    p.add_argument("--no-sweep", action="store_true", help="skip the add size sweep")
    p.add_argument("--sweep-max", type=int, default=0, help="largest sweep size in elements (default 256M = 1 GiB)")
    p.add_argument("--min-time", type=float, default=0.2, help="seconds to spend per sweep point at least")
    p.add_argument("--no-numba", action="store_true", help="leave numba out even if installed")
    p.add_argument("--no-rotate", action="store_true", help="sweep: reuse one input set even when it fits in cache")
    p.add_argument("--symbolic", action="store_true", help="compile with symbolic sizes instead of static ones")
    p.add_argument("--rounds", type=int, default=1, help="time ours and the peers in this many interleaved rounds "
                   "(each `--repeats` runs; the median of the round medians is reported, the best round beside it)")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.warmup = min(args.repeats, 3), 1

    dev = H.open_device(args.device, args.wait_quiet)
    gpu = H.is_gpu(dev)
    libs = H.gpu_peer_libs(dev)
    if gpu and not libs:
        H.note("neither cupy nor torch is usable: only the memcpy ceiling (the backend's transfer) is compared")
    names = list(SUITE) if args.suite else [n.strip() for n in args.only.split(",") if n.strip()]
    for n in names:
        if n not in KNOWN:
            raise SystemExit(f"unknown kernel {n!r}; known: {', '.join(KNOWN)}")
    res = H.Results("kernels", dev, args)
    rng = np.random.default_rng(0)
    mach = H.machine(dev)
    H.note(f"{mach['device']} on {mach['model']} ({mach['cores']} cores, {mach['cpu_threads']} morok threads)")
    nb = None if gpu or args.no_numba else H.optional("numba")
    if nb is not None:
        mach["numba_threads"] = nb.get_num_threads()

    top = args.sweep_max or ((1 << 20) if args.quick else (256 << 20))
    sizes = [1 << k for k in range(10, 64, 2) if (1 << k) <= top]
    npeers = len(libs) if gpu else 1 + (nb is not None)          # peers besides memcpy
    steps = len(names) * (2 + bool(args.beam)) + ("matmul_sym" in names and not args.symbolic)
    steps += 0 if args.no_sweep else len(sizes) * (2 + npeers)
    steps += bool(args.suite and not gpu)          # the cold compile
    bar = H.Progress(steps, "kernels")

    bar.step("memcpy ceiling")
    ceil_bytes = 4 * (args.n or ((1 << 20) if args.quick else (256 << 20 if gpu else 64 << 20)))
    ceiling, who = memcpy_bandwidth(dev, ceil_bytes, args, libs)
    mach["memcpy_ceiling"] = {"gb_s": ceiling / 1e9, "bytes": ceil_bytes, "by": who}

    ours_times: dict[str, float] = {}
    for name in names:
        case = make_case(name, args, gpu, rng)
        ours_times[name] = run_case(case, dev, args, res, ceiling, libs, bar)
        del case
        gc.collect()
    if "matmul_sym" in ours_times and not args.symbolic:
        # the same shape with symbolic sizes against static ones, interleaved (ratio = static / symbolic time)
        bar.step("matmul: symbolic against static sizes")
        symbolic_vs_static(dev, args, res, rng)
        bar.advance()
    if args.suite and not gpu:
        bar.step("cold matmul compile")
        cold_compile(dev, res, 7)
        bar.advance()
    if not args.no_sweep:
        sweep(dev, args, res, libs, bar, sizes, rng)
    bar.close()

    print(f"\nmemcpy ceiling: {ceiling / 1e9:.1f} GB/s ({who}, {H.fmt_bytes(ceil_bytes)} per array)")
    main_recs = [r for r in res.records if r["name"] != "add_sweep"]
    H.results_table(main_recs, f"\nkernels on {mach['device']} ({mach['model']})  ratio: higher is better for us")
    sw = [r for r in res.records if r["name"] == "add_sweep"]
    if sw:
        print()
        H.results_table(sw, "add size sweep (rows with unit GB/s compare against memcpy of the same bytes)")
    mode = "-".join(m for m in ("suite" if args.suite else "", "beam" if args.beam else "",
                                "symbolic" if args.symbolic else "") if m)
    res.save(chart(res, dev) if sw else None, mode)


if __name__ == "__main__":
    main()
