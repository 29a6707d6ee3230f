"""Small and skinny shapes on a GPU beside PyTorch (and CuPy where it has the operation), in one run.

    python benchmarks/decode.py --device CUDA [--quick] [--only decode_f16,...] [--variants] [--rounds N]

decode_...: a decoding step's contraction, M = 32 (or 64) rows against a 4096 x 4096 weight matrix, float16,
bfloat16 or float32 (float32 peers without TF32): the weight read is the whole cost, so the ceiling is the
device's memory bandwidth. gemv8: a batch-8 float32 GEMV called through the checked call
(`Program.__call__`, buffers and values checked), timed as the wall time per call of a loop of calls with
one synchronization at the end, beside the same loop of `torch.matmul(..., out=)`. matmul_sym: float32
1000^3 whose sizes are DEFINE_VAR variables bounded by 1024. softmax_rows / sum_rows: 8 rows of 128k
columns, fewer rows than the GPU has SMs. Every result is checked against numpy (or the peer, for the
16-bit contractions) before it is timed; the rest are timed on the raw launch path (the program's own
`wait=True` time against the peers' CUDA events) in `--rounds` interleaved rounds. `--variants` also times
the named candidate schedules of each kernel (a record `<name>_variant` each).
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import harness as H
from harness import np

TARGET_TORCH = {"decode_f16": 0.9, "decode_f16_m64": 0.9, "decode_bf16": 0.9, "decode_f32": 0.9, "gemv8": 0.9,
                "matmul_sym": 0.8, "softmax_rows": 0.9, "sum_rows": 0.9}
ALL = tuple(TARGET_TORCH)
CHECKED_CALLS = 200         # gemv8: calls per timed loop of the checked call


@dataclass
class Case:
    name: str
    label: str
    ast: Any
    inputs: list[np.ndarray]        # host arrays in the kernel's dtype (bfloat16 through ml_dtypes)
    out_shape: tuple[int, ...]
    out_dtype: Any                  # morok dtype of the output
    vals: dict[str, int]
    reference: np.ndarray
    torch_op: Callable              # (torch, inputs as tensors) -> tensor
    cupy_op: Callable | None = None
    nbytes: int = 0
    rtol: float = 1e-4
    atol: float = 1e-5
    extra: dict = field(default_factory=dict)


def _rand(rng, shape, scale=1.0) -> np.ndarray:
    return ((rng.random(shape, dtype=np.float32) * 2 - 1) * scale).astype(np.float32)


def make_case(name: str, rng, quick: bool) -> Case:
    from morok_py import UOp, dtypes
    from morok_py import kernels as K
    from morok_py.dtypes import to_numpy
    if name.startswith("decode_"):
        dt = {"f16": dtypes.float16, "bf16": dtypes.bfloat16, "f32": dtypes.float32}[name.split("_")[1]]
        M = 64 if name.endswith("m64") else 32
        Kd = N = 512 if quick else 4096
        a = _rand(rng, (M, Kd))
        w = _rand(rng, (Kd, N), 1 / np.sqrt(Kd))
        a, w = a.astype(to_numpy(dt)), w.astype(to_numpy(dt))
        want = a.astype(np.float64) @ w.astype(np.float64)
        half = dt is not dtypes.float32
        tol = {"float16": (2 ** -9, 2e-3), "bfloat16": (2 ** -6, 1e-2), "float32": (1e-4, 1e-4)}[dt.name]
        return Case(name, f"{M}x{Kd}x{N} {dt.name}", K.matmul(M, N, Kd, dtype=dt), [a, w], (M, N), dt, {},
                    want, lambda t, a, w: t.matmul(a, w), lambda cp, a, w: cp.matmul(a, w) if not half or
                    dt is dtypes.float16 else None, nbytes=(M * Kd + Kd * N + M * N) * dt.itemsize,
                    rtol=tol[0], atol=tol[1], extra={"dtype": dt.name, "M": M, "N": N, "K": Kd})
    if name == "gemv8":
        M, Kd, N = (8, 512, 512) if quick else (8, 4096, 4096)
        a, w = _rand(rng, (M, Kd)), _rand(rng, (Kd, N), 1 / np.sqrt(Kd))
        return Case(name, f"{M}x{Kd}x{N} float32, checked call", K.matmul(M, N, Kd), [a, w], (M, N), dtypes.float32,
                    {}, a.astype(np.float64) @ w.astype(np.float64), lambda t, a, w: t.matmul(a, w),
                    nbytes=4 * (M * Kd + Kd * N + M * N), rtol=1e-4, atol=1e-4)
    if name == "matmul_sym":
        n = 200 if quick else 1000
        a, w = _rand(rng, (n, n)), _rand(rng, (n, n), 1 / np.sqrt(n))
        ast = K.matmul(UOp.variable("M", 1, 1024), UOp.variable("N", 1, 1024), UOp.variable("K", 1, 1024))
        return Case(name, f"{n}^3 float32, sizes <= 1024 symbolic", ast, [a, w], (n, n), dtypes.float32,
                    {"M": n, "N": n, "K": n}, a.astype(np.float64) @ w.astype(np.float64),
                    lambda t, a, w: t.matmul(a, w), lambda cp, a, w: cp.matmul(a, w), nbytes=3 * 4 * n * n,
                    rtol=1e-4, atol=1e-4)
    if name in ("softmax_rows", "sum_rows"):
        r, c = (8, 4099) if quick else (8, 131072)
        x = _rand(rng, (r, c), 4.0)
        if name == "sum_rows":
            return Case(name, f"{r}x{c} float32", K.reduce_axis("sum", [r, c], 1), [x], (r,), dtypes.float32, {},
                        x.astype(np.float64).sum(1), lambda t, x: t.sum(x, dim=1), lambda cp, x: cp.sum(x, axis=1),
                        nbytes=4 * (r * c + r), rtol=1e-4, atol=1e-3)
        e = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
        return Case(name, f"{r}x{c} float32", K.softmax(r, c), [x], (r, c), dtypes.float32, {},
                    e / e.sum(1, keepdims=True), lambda t, x: t.softmax(x, dim=1), nbytes=2 * 4 * r * c,
                    rtol=1e-4, atol=1e-8)
    raise SystemExit(f"unknown case {name!r}; known: {', '.join(ALL)}")


class Ours:
    """A compiled kernel (the default schedule, or `schedule`) on device buffers."""

    def __init__(self, dev, case: Case, schedule=None):
        from morok_py import Buffer, cache
        self.dev = dev
        if schedule is None:
            self.prog = dev.compile(case.ast, name=f"bench_{case.name}")
        else:
            self.prog = dev.runtime(cache.compile_ast(dev.renderer, dev.compiler, case.ast, f"bench_{case.name}_v",
                                                      schedule))
        self.bufs = [Buffer.from_numpy(np.ascontiguousarray(x).reshape(-1), dev) for x in case.inputs]
        self.out = dev.buffer(int(np.prod(case.out_shape)), case.out_dtype)
        info = self.prog.launch
        mine = {k: case.vals[k] for k in info.var_names}
        self.gs, self.ls = info.launch_dims(mine)
        self.vals = [mine[k] for k in info.var_names]
        self.named = mine
        self.ptrs = [b.ptr for b in self.bufs] + [self.out.ptr]

    def __call__(self) -> float:
        return self.prog.execute(self.ptrs, self.vals, self.gs, self.ls, wait=True)

    def checked(self) -> None:
        self.prog(*self.bufs, self.out, **self.named)

    def result(self) -> np.ndarray:
        self.dev.synchronize()
        return self.out.numpy().astype(np.float64)

    def free(self) -> None:
        for b in self.bufs + [self.out]:
            b.free()


def check(label: str, got, want, rtol, atol) -> None:
    got = np.asarray(got, np.float64).reshape(want.shape)
    if not np.allclose(got, want, rtol=rtol, atol=atol):
        raise SystemExit(f"{label}: differs from the reference (max abs error {np.max(np.abs(got - want)):.3g}); "
                         "not timing a wrong kernel")


def loop_time(call: Callable[[], Any], sync: Callable[[], Any], n: int, rounds: int) -> float:
    """Wall seconds per call of `n` back-to-back calls and one synchronization, median of `rounds`."""
    for _ in range(10):
        call()
    sync()
    ts = []
    for _ in range(max(3, rounds)):
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        sync()
        ts.append((time.perf_counter() - t0) / n)
    return statistics.median(ts)


def variant_schedules(dev, case: Case) -> list:
    """The search's first candidates after the default (the small-shape strategies put theirs first)."""
    from morok_py.codegen.scan import scan_kernel
    from morok_py.codegen.schedule import candidate_schedules
    spec = dev.renderer.render(case.ast, "variants")
    return candidate_schedules(spec.ast, dev.renderer.caps, scan_kernel(spec.ast))[1:13]


def baseline_schedule(dev, case: Case):
    """The default schedule without the small-shape strategies (codegen/strategies/small_shapes.py) and the NVRTC
    upcast GEMV (schedule.GEMV_UPCAST_RESIDENT 0): what the kernel ran before them, timed beside the default with
    --variants."""
    from morok_py.codegen import schedule as S
    from morok_py.codegen.scan import scan_kernel
    from morok_py.codegen.strategies import small_shapes as SS
    spec = dev.renderer.render(case.ast, "baseline")
    off = {"decode_tc": lambda *a, **k: None, "decode_core": lambda *a, **k: None,
           "few_block_tile": lambda ast, caps, scan, tile: tile, "row_split_default": lambda *a, **k: 0,
           "few_rows_group": lambda *a, **k: 0, "wide_rows_default": lambda *a, **k: 1}
    saved = {k: getattr(SS, k) for k in off}
    resident = S.GEMV_UPCAST_RESIDENT
    try:
        for k, f in off.items():
            setattr(SS, k, f)
        S.GEMV_UPCAST_RESIDENT = 0      # and no NVRTC upcast GEMV
        return S.default_schedule(spec.ast, dev.renderer.caps, scan_kernel(spec.ast))
    finally:
        for k, f in saved.items():
            setattr(SS, k, f)
        S.GEMV_UPCAST_RESIDENT = resident


def run_case(dev, case: Case, args, res: H.Results, libs: dict, rows: list) -> None:
    torch, cupy = libs.get("torch"), libs.get("cupy")
    sched = str(dev.renderer.render(case.ast, "schedule").linear.schedule)
    ours = Ours(dev, case)
    ours.checked()
    check(f"{case.name} (ours)", ours.result(), case.reference, case.rtol, case.atol)
    peers: dict[str, Callable] = {}
    if torch is not None:
        tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[case.out_dtype.name]
        tin = [torch.from_numpy(np.asarray(x, np.float32)).cuda().to(tdt) for x in case.inputs]
        tout = torch.empty(case.out_shape, dtype=tdt, device="cuda")
        got = case.torch_op(torch, *tin)
        check(f"{case.name} (torch)", got.float().cpu().numpy(), case.reference, case.rtol, case.atol)
        timer = H.event_timer("torch", torch)
        if case.name == "gemv8":
            peers["torch"] = lambda: torch.matmul(*tin, out=tout)
        else:
            peers["torch"] = lambda: timer(lambda: case.torch_op(torch, *tin))
    if cupy is not None and case.cupy_op is not None and case.out_dtype.name != "bfloat16" and case.name != "gemv8":
        cin = [cupy.asarray(np.asarray(x)) for x in case.inputs]
        if case.cupy_op(cupy, *cin) is not None:
            check(f"{case.name} (cupy)", cupy.asnumpy(case.cupy_op(cupy, *cin)).astype(np.float64), case.reference,
                  case.rtol, case.atol)
            ctimer = H.event_timer("cupy", cupy)
            peers["cupy"] = lambda: ctimer(lambda: case.cupy_op(cupy, *cin))
    common = {"label": case.label, "schedule": sched, "bytes": case.nbytes, **case.extra}
    if case.name == "gemv8":        # the checked call against torch's call, both wall time per call in a loop
        t_ours = loop_time(ours.checked, dev.synchronize, CHECKED_CALLS, args.rounds)
        t_raw = H.measure(ours, args.warmup, args.repeats)
        for pname, call in peers.items():
            t = loop_time(call, torch.cuda.synchronize, CHECKED_CALLS, args.rounds)
            rec = res.add(case.name, case.nbytes, "s", t_ours, pname, t, target=TARGET_TORCH.get(case.name),
                          kernel_s=t_raw, gb_s=case.nbytes / t_ours / 1e9, timing="checked call, wall per call",
                          **common)
            rows.append([case.name, case.label, H.fmt_time(t_ours), pname, H.fmt_time(t), f"{rec['ratio']:.2f}x",
                         sched])
    else:
        fns = [("ours", ours)] + list(peers.items())
        rounds = H.interleaved(fns, args.rounds, args.repeats, args.warmup)
        med = {k: statistics.median(v) for k, v in rounds.items()}
        for pname in peers:
            rec = res.add(case.name, case.nbytes, "s", med["ours"], pname, med[pname],
                          target=TARGET_TORCH.get(case.name) if pname == "torch" else None,
                          gb_s=case.nbytes / med["ours"] / 1e9, peer_gb_s=case.nbytes / med[pname] / 1e9, **common,
                          **H.round_summary(rounds["ours"], rounds[pname]))
            rows.append([case.name, case.label, H.fmt_time(med["ours"]), pname, H.fmt_time(med[pname]),
                         f"{rec['ratio']:.2f}x", sched])
        if not peers:
            res.add(case.name, case.nbytes, "s", med["ours"], None, None, gb_s=case.nbytes / med["ours"] / 1e9,
                    **common)
    t_default = H.measure(ours, args.warmup, args.repeats)
    ours.free()
    if args.variants:
        base = baseline_schedule(dev, case)
        for s in [base] + [v for v in variant_schedules(dev, case) if v != base]:
            kind = "_before" if s == base else "_variant"
            try:
                v = Ours(dev, case, s)
                v()
                check(f"{case.name} {s}", v.result(), case.reference, case.rtol, case.atol)
            except (SystemExit, Exception) as e:      # noqa: BLE001 -- a candidate that fails is recorded
                res.add(case.name + kind, case.nbytes, "s", None, None, None, label=str(s),
                        error=f"{type(e).__name__}: {str(e)[:200]}")
                rows.append([case.name + kind, str(s), "error", "", "", "", str(e)[:60]])
                continue
            t = H.measure(v, args.warmup, args.repeats)
            v.free()
            res.add(case.name + kind, case.nbytes, "s", t, "default", t_default, label=str(s),
                    gb_s=case.nbytes / t / 1e9)
            rows.append([case.name + kind, str(s), H.fmt_time(t), "default", H.fmt_time(t_default),
                         f"{t_default / t:.2f}x", ""])
    gc.collect()
    if torch is not None:
        torch.cuda.empty_cache()


def main() -> None:
    p = H.parser(__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(ALL), help=f"comma-separated subset of {','.join(ALL)}")
    p.add_argument("--variants", action="store_true", help="also time each kernel's named candidate schedules")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of ours and the peers")
    p.add_argument("--compiler", default=None, help="the CUDA pair (nvrtc, llvm-nvptx; default: MOROK_CUDA_COMPILER)")
    args = p.parse_args()
    if args.compiler:
        import os
        os.environ["MOROK_CUDA_COMPILER"] = args.compiler
    if args.quick:
        args.repeats, args.warmup = min(args.repeats, 3), 1
    dev = H.open_device(args.device, args.wait_quiet)
    if not H.is_gpu(dev):
        raise SystemExit("decode.py measures a GPU")
    libs = H.gpu_peer_libs(dev)
    torch = libs.get("torch")
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = False     # float32 peers in float32
        torch.backends.cudnn.allow_tf32 = False
    res = H.Results("decode", dev, args)
    mach = H.machine(dev)
    rng = np.random.default_rng(0)
    rows: list[list] = []
    for name in [n.strip() for n in args.only.split(",") if n.strip()]:
        case = make_case(name, rng, args.quick)
        try:
            run_case(dev, case, args, res, libs, rows)
        except SystemExit as e:       # a wrong result: recorded, the other cases still run
            H.note(str(e))
            res.add(name, case.nbytes, "s", None, None, None, label=case.label, error=str(e)[:300])
            rows.append([name, case.label, "error", "", "", "", str(e)[:80]])
    H.table(rows, ["kernel", "shape", "ours", "peer", "peer's", "ratio", "schedule"],
            f"\nsmall shapes on {mach['model']} ({dev.compiler.cache_key}); ratio: higher is better for us")
    for r in res.records:
        if r.get("target") is not None and r.get("ratio") is not None:
            print(f"{r['name']}: {r['ratio']:.2f}x torch, target {r['target']:g}x: "
                  f"{'met' if r['ratio'] >= r['target'] else 'MISSED'}")
    res.save()


if __name__ == "__main__":
    main()
