"""2-D convolutions on a GPU as ONNX gives them (NCHW, pads, strides, groups), through the kernel sequence
`kernels.conv2d_kernels` plans for the device (codegen/strategies/conv.py), beside PyTorch's convolution
(cuDNN) on the same data, in TFLOP/s.

    python benchmarks/conv.py --device CUDA [--compiler nvrtc|llvm-nvptx] [--dtypes float32,float16]
                              [--only conv3x3,conv_grouped] [--variants N] [--quick]

Cases (batch 32): ResNet 3x3 stages (pad 1), 3x3 stride 2, 1x1 projections, depthwise 3x3 and grouped 3x3
(32 groups, ResNeXt). float32 on both sides runs without TF32 (torch.backends.cudnn.allow_tf32 = False);
float16 and bfloat16 accumulate in float32 on both sides. cuDNN picks its algorithm by its heuristics
(torch.backends.cudnn.benchmark off; --cudnn-benchmark times its algorithms first): in that mode its float16
times differed up to 2x between processes on one H200 (32x512x7x7 3x3: 68 and 142 TFLOP/s), so compare
ratios across runs. Ours is the sum of the plan's per-run kernels' own `wait=True` times on the raw launch path (a
pad kernel included where the plan has one); the steps that read the weights alone (`KernelStep.weights_only`:
direct_masked's weights reorder, Winograd's filter transform) run once before the timing, as the ONNX executor
runs them once for a model's constant weights, and are timed apart: a record keeps their time (`weights_us`)
and the ratio with them counted in every run (`ratio_with_weights`; the reorder of 64x64x3x3 float16 weights,
74 KB, takes 6.5 us on an H200). PyTorch's is timed with its CUDA events. On a GPU each
timed kernel of ours and each timed PyTorch call has an untimed copy queued ahead of it, so the device is busy
when the start event is recorded and the time is the device's, not the host's launch call after that event
(as benchmarks/kernels.py times).
Each result is checked against PyTorch's float32 convolution first. Records are named after the case
(conv3x3, conv3x3_s2, conv1x1, conv_depthwise, conv_grouped) with a target of 0.9 of cuDNN. --variants N
also times the plan's main kernel under the first N candidate schedules with other tiles (records `<name>_variant`, no target)
and the other candidate plans (records `<name>_plan`). Each record of a plan keeps its kernels' own median
times (`kernel_us`), so a plan's columns, contraction and sum of runs show apart.
"""
from __future__ import annotations

import os
import time

import numpy as np

import harness as H

TARGET = 0.9

# name, N, C, H, W, CO, KH, KW, stride, pad, groups (the input unpadded: pads go to the plan, as ONNX's Conv)
CASES = [
    ("conv3x3", 32, 64, 56, 56, 64, 3, 3, 1, 1, 1),
    ("conv3x3", 32, 128, 28, 28, 128, 3, 3, 1, 1, 1),
    ("conv3x3", 32, 256, 14, 14, 256, 3, 3, 1, 1, 1),
    ("conv3x3", 32, 512, 7, 7, 512, 3, 3, 1, 1, 1),
    ("conv3x3_s2", 32, 128, 56, 56, 128, 3, 3, 2, 1, 1),
    ("conv3x3_s2", 32, 256, 28, 28, 256, 3, 3, 2, 1, 1),
    ("conv1x1", 32, 256, 56, 56, 64, 1, 1, 1, 0, 1),
    ("conv1x1", 32, 1024, 14, 14, 256, 1, 1, 1, 0, 1),
    ("conv_depthwise", 32, 128, 56, 56, 128, 3, 3, 1, 1, 128),
    ("conv_depthwise", 32, 256, 28, 28, 256, 3, 3, 2, 1, 256),
    ("conv_grouped", 32, 128, 56, 56, 128, 3, 3, 1, 1, 32),
    ("conv_grouped", 32, 256, 28, 28, 256, 3, 3, 1, 1, 32),
]
TOL = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 2e-2}


def main_step(steps) -> int:
    """The index of a plan's contraction (or only) kernel: the last but a split plan's sum of runs."""
    return len(steps) - 2 if len(steps) > 1 and steps[-1].name == "sum" else len(steps) - 1


class Sequence:
    """A plan's kernels compiled for `dev` on device buffers: x and w given, the rest allocated; `main` the
    contraction (or only) kernel (`main_step`), compiled with `schedule` where given."""

    def __init__(self, dev, steps, x, w, dt, schedule=None, tag=""):
        from morok_py import cache
        self.bufs = {"x": x, "w": w}
        self.calls = []             # the per-run kernels, timed
        self.setup = []             # the weights-only steps: run once here (and by run_checked), timed apart
        self.checked = []           # (step, program, buffers) of every step in order
        self.runs: list[list[float]] = []
        self.main = None
        for i, st in enumerate(steps):
            main = i == main_step(steps)
            if main and schedule is not None:
                prog = dev.runtime(cache.compile_ast(dev.renderer, dev.compiler, st.ast, f"conv_{st.name}{tag}",
                                                     schedule))
            else:
                prog = dev.compile(st.ast, name=f"conv_{st.name}{tag}")
            if st.output not in self.bufs:
                self.bufs[st.output] = dev.buffer(st.elements, st.dtype or dt)
            names = [n for n in st.inputs if n != "epilogue"] + [st.output]
            info = prog.launch
            vals = dict(st.vars)
            mine = {k: vals[k] for k in info.var_names}
            gs, ls = info.launch_dims(mine)
            ptrs = [self.bufs[n].ptr for n in names]
            call = (prog, ptrs, [mine[k] for k in info.var_names], gs, ls)
            (self.setup if st.weights_only and not main else self.calls).append(call)
            self.checked.append((st, prog, [self.bufs[n] for n in names]))
            if main:
                self.main = prog
        self.steps = steps
        self.queue_ahead = H.is_gpu(dev)
        for prog, ptrs, vals, gs, ls in self.setup:
            prog.execute(ptrs, vals, gs, ls, wait=True)

    def run_checked(self) -> None:
        """Every step in order through the checked call, the weights-only ones included."""
        for st, prog, bufs in self.checked:
            prog(*bufs, **dict(st.vars))

    def weights_s(self, repeats: int = 5) -> float:
        """The weights-only steps' time, as if run every time (median of `repeats`; 0 without them)."""
        import statistics
        if not self.setup:
            return 0.0
        return statistics.median(sum(prog.execute(ptrs, vals, gs, ls, wait=True) for prog, ptrs, vals, gs, ls
                                     in self.setup) for _ in range(repeats))

    def __call__(self) -> float:
        times = []
        for prog, ptrs, vals, gs, ls in self.calls:
            if self.queue_ahead:
                prog.execute(ptrs, vals, gs, ls)
            times.append(prog.execute(ptrs, vals, gs, ls, wait=True))
        self.runs.append(times)
        return sum(times)

    def kernel_us(self) -> dict[str, float]:
        """Each kernel's median time (us) over the runs so far: where a plan's time goes (columns, contraction,
        sum of runs)."""
        import statistics
        out: dict[str, float] = {}
        for i, (prog, *_) in enumerate(self.calls):
            out[f"{i}:{prog.name}"] = round(statistics.median(r[i] for r in self.runs) * 1e6, 2) if self.runs else 0.0
        return out

    @property
    def out(self):
        return self.bufs["out"]


def main() -> None:
    p = H.parser(__doc__.split("\n\n")[0])
    p.add_argument("--compiler", default=None, help="the CUDA pair (nvrtc, llvm-nvptx; default: MOROK_CUDA_COMPILER)")
    p.add_argument("--dtypes", default="float32,float16", help="comma-separated: float32, float16, bfloat16")
    p.add_argument("--only", default="", help="comma-separated case names (default: all)")
    p.add_argument("--cudnn-benchmark", action="store_true", help="let cuDNN time its algorithms (cudnn.benchmark)")
    p.add_argument("--variants", type=int, default=0, help="also time the main kernel's first N candidate schedules")
    args = p.parse_args()
    if args.compiler:
        os.environ["MOROK_CUDA_COMPILER"] = args.compiler
    from morok_py import Buffer, dtypes
    from morok_py import kernels as K
    from morok_py.codegen.scan import scan_kernel
    from morok_py.codegen.schedule import candidate_schedules
    from morok_py.codegen.strategies.conv import ConvGeometry, candidate_plans, conv_plan

    dev = H.open_device(args.device, args.wait_quiet)
    if H.is_gpu(dev):
        torch = H.gpu_peer_libs(dev).get("torch")
        if torch is None:
            raise SystemExit("conv.py compares with PyTorch on a GPU: none here")
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.benchmark = args.cudnn_benchmark
        timer = H.event_timer("torch", torch)
        device = f"cuda:{dev.spec.ordinal}"
    else:       # a smoke run of the script itself (--quick): PyTorch on the CPU, timed by the wall clock
        torch = H.optional("torch")
        if torch is None:
            raise SystemExit("conv.py compares with PyTorch: not installed")
        timer, device = (lambda fn: (lambda t0: (fn(), time.perf_counter() - t0)[1])(time.perf_counter())), "cpu"
    mach = H.machine(dev)
    caps = dev.renderer.caps
    res = H.Results("conv", dev, args)
    rows = []
    only = {s for s in args.only.split(",") if s}
    cases = [c for c in CASES if not only or c[0] in only]
    if args.quick:
        cases = [(c[0], 2) + c[2:] for c in cases]
    reps = dict(warmup=args.warmup + 1, repeats=max(args.repeats, 10))
    for dname in [d for d in args.dtypes.split(",") if d]:
        dt = getattr(dtypes, dname)
        tdt = getattr(torch, dname)
        for name, N, C, Hh, Ww, CO, KH, KW, s, pad, groups in cases:
            geo = ConvGeometry(N, C, Hh, Ww, CO, KH, KW, (s, s), (1, 1), (pad,) * 4, groups)
            flop = float(geo.flops)
            label = f"{dname} {N}x{C}x{Hh}x{Ww} * {CO}x{C // groups}x{KH}x{KW} s{s} p{pad}" + (
                f" g{groups}" if groups > 1 else "")
            tx = torch.randn(N, C, Hh, Ww, device=device).to(tdt).contiguous()
            tw = (torch.randn(CO, C // groups, KH, KW, device=device) / (C // groups * KH * KW) ** 0.5).to(tdt).contiguous()
            x, w = Buffer.from_dlpack(tx), Buffer.from_dlpack(tw)
            want = torch.nn.functional.conv2d(tx.float(), tw.float(), stride=s, padding=pad, groups=groups)

            def check(seq: Sequence) -> float:
                seq.run_checked()
                got = torch.from_dlpack(seq.out).view(want.shape).float()
                return float((got - want).abs().max() / want.abs().max())

            plan = conv_plan(geo, caps, dt.itemsize)
            try:
                steps = K.conv2d_kernels(geo, plan, dt, caps=caps)
                seq = Sequence(dev, steps, x, w, dt)
                err = check(seq)
            except Exception as e:      # a case that fails is recorded as an error; the others still run
                res.add(name, int(flop), "FLOP/s", 0.0, "torch", None, higher_is_better=True, dtype=dname,
                        label=label, error=f"{type(e).__name__}: {e}"[:400], target=TARGET, plan=str(plan))
                rows.append([label, str(plan), "error", "", "", str(e)[:60]])
                continue
            if not err <= TOL[dname]:
                res.add(name, int(flop), "FLOP/s", 0.0, "torch", None, higher_is_better=True, dtype=dname,
                        label=label, error=f"relative error {err:.2e}", target=TARGET, plan=str(plan))
                rows.append([label, str(plan), "wrong", "", "", f"{err:.1e}"])
                continue
            t = H.measure(seq, **reps)
            seq.runs = []
            H.measure(seq, warmup=0, repeats=reps["repeats"])

            def peer() -> None:
                torch.nn.functional.conv2d(tx, tw, stride=s, padding=pad, groups=groups)

            # (queued ahead, untimed, as each kernel of ours is)
            t_peer = H.measure(lambda: (peer(), timer(peer))[1] if H.is_gpu(dev) else timer(peer), **reps)
            sched = dev.renderer.render(steps[main_step(steps)].ast, "schedule").linear.schedule
            t_w = seq.weights_s()
            rec = res.add(name, int(flop), "FLOP/s", flop / t, "torch", flop / t_peer, higher_is_better=True,
                          dtype=dname, label=label, max_rel_err=err, target=TARGET, plan=str(plan),
                          kernels=[st.name for st in steps], schedule=str(sched) if sched else None,
                          kernel_us=seq.kernel_us(), weights_us=round(t_w * 1e6, 2),
                          ratio_with_weights=t_peer / (t + t_w))
            rows.append([label, str(plan), f"{flop / t / 1e12:.1f}", f"{flop / t_peer / 1e12:.1f}",
                         f"{rec['ratio']:.2f}x", f"{err:.1e}"])
            H.note(" | ".join(rows[-1] + [str(sched)]))

            def candidate(suffix: str, what, make, **fields) -> None:
                """Time one candidate (a plan or a schedule) beside the peer, or note why it did not run."""
                try:
                    cseq = make()
                    cerr = check(cseq)
                    tc = H.measure(cseq, **reps) if cerr <= TOL[dname] else None
                    fields = {k: (v(cseq) if callable(v) else v) for k, v in fields.items()}
                except Exception as e:
                    H.note(f"{label} {what}: {type(e).__name__}: {str(e)[:200]}")
                    return
                if tc is None:
                    H.note(f"{label} {what}: relative error {cerr:.2e}")
                    return
                res.add(f"{name}_{suffix}", int(flop), "FLOP/s", flop / tc, "torch", flop / t_peer,
                        higher_is_better=True, dtype=dname, label=f"{label} {what}", **fields)
                rows.append([label, str(what), f"{flop / tc / 1e12:.1f}", f"{flop / t_peer / 1e12:.1f}",
                             f"{flop / tc / (flop / t_peer):.2f}x", f"{cerr:.1e}"])
                H.note(" | ".join(rows[-1]))

            def main_schedule(cseq: Sequence) -> str | None:
                sc = dev.renderer.render(cseq.steps[main_step(cseq.steps)].ast, "schedule").linear.schedule
                return str(sc) if sc else None

            if args.variants:
                for alt in candidate_plans(geo, caps, dt.itemsize)[1:]:
                    candidate("plan", alt,
                              lambda alt=alt: Sequence(dev, K.conv2d_kernels(geo, alt, dt, caps=caps), x, w, dt, tag="_alt"),
                              plan=str(alt), schedule=main_schedule, kernel_us=lambda cs: cs.kernel_us())
                spec = dev.renderer.render(steps[main_step(steps)].ast, "variants")
                cands = candidate_schedules(spec.ast, caps, scan_kernel(spec.ast))
                tiles = {(cands[0].matmul_tile, cands[0].tensor_core)}
                picked = []
                for sc in cands[1:]:        # the first of each other tile (the pipelines of one tile are alike)
                    if (sc.matmul_tile, sc.tensor_core) not in tiles and len(picked) < args.variants:
                        tiles.add((sc.matmul_tile, sc.tensor_core))
                        picked.append(sc)
                for sc in picked:
                    candidate("variant", sc, lambda sc=sc: Sequence(dev, steps, x, w, dt, schedule=sc, tag="_v"),
                              schedule=str(sc))
            del seq
            res.save()          # each case as it ends: a run cut short keeps what it measured
    H.table(rows, ["convolution", "plan / schedule", "ours TFLOP/s", "cuDNN TFLOP/s", "vs cuDNN", "max rel err"],
            f"\nConvolutions on {mach['model']} ({dev.compiler.cache_key}); target {TARGET}x cuDNN")
    res.save()


if __name__ == "__main__":
    main()
