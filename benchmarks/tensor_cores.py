"""Issue 13: float16/bfloat16 contractions on tensor cores against torch.matmul (cuBLAS), same run.

Rows: matmul 4096^3 and the fused dense layer relu(x @ W + b) at 4000x3001x1023, each in float16 and
bfloat16, static sizes, plus the symbolic 4096^3 matmul; ours with the default schedule (tensor cores on
sm_80+), or with --no-tensor-cores the CUDA-core tiles (the schedule before issue 13) for comparison. Times are GPU-event
medians (the checked call's wait=True time for ours, torch.cuda.Event for torch); every output is
checked against torch's (float32 accumulation) before it is timed.

    python benchmarks/tensor_cores.py --results benchmarks/results/cuda-h100-DATE-issue13
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from morok_py import Device, dtypes, kernels as K  # noqa: E402
from morok_py.dtypes import to_numpy  # noqa: E402


def median_time(fn, warmup=3, repeats=15):
    for _ in range(warmup):
        fn()
    return statistics.median(fn() for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default="tensor_cores")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--no-tensor-cores", action="store_true",
                    help="the CUDA-core tiles (the schedule before issue 13), for comparison")
    ap.add_argument("--beam", type=int, default=0, help="also search this many schedules of float16 4096^3")
    ap.add_argument("--beam-seconds", type=float, default=25.0)
    args = ap.parse_args()
    import torch
    dev = Device["CUDA"]
    if args.no_tensor_cores:
        import dataclasses
        for r, _c in dev.compilers:
            r.caps = dataclasses.replace(r.caps, tensor_cores=())
    rng = np.random.default_rng(0)
    rows = []
    cases = [("matmul", 4096, 4096, 4096, True), ("matmul", 4096, 4096, 4096, False),
             ("dense", 4000, 3001, 1023, True)]
    for dt in (dtypes.float16, dtypes.bfloat16):
        tdt = torch.float16 if dt.name == "float16" else torch.bfloat16
        for kind, M, N, Kd, static in cases:
            x = rng.standard_normal((M, Kd)).astype(np.float32)
            w = (rng.standard_normal((Kd, N)) / np.sqrt(Kd)).astype(np.float32)
            bias = rng.standard_normal(N).astype(np.float32)
            tx, tw, tb = (torch.from_numpy(v).cuda().to(tdt) for v in (x, w, bias))
            hx, hw, hb = (t.float().cpu().numpy().astype(to_numpy(dt)) for t in (tx, tw, tb))
            if kind == "matmul":
                ast = K.matmul(M, N, Kd, dtype=dt) if static else K.matmul(dtype=dt)
                torch_fn = lambda: torch.matmul(tx, tw)  # noqa: E731
                bufs = [dev.buffer(M * Kd, dt), dev.buffer(Kd * N, dt)]
                host = [hx, hw]
            else:
                ast = K.matmul_bias_relu(M, N, Kd, dtype=dt)
                torch_fn = lambda: torch.relu(torch.addmm(tb, tx, tw))  # noqa: E731
                bufs = [dev.buffer(M * Kd, dt), dev.buffer(Kd * N, dt), dev.buffer(N, dt)]
                host = [hx, hw, hb]
            for b, h in zip(bufs, host):
                b.copyin(np.ascontiguousarray(h).reshape(-1))
            out = dev.buffer(M * N, dt)
            vals = {} if static else {"M": M, "N": N, "K": Kd}
            ref = torch_fn().float()
            ref_np = ref.cpu().numpy()
            flops = 2.0 * M * N * Kd

            def t_torch():
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(); torch_fn(); e.record(); e.synchronize()
                return s.elapsed_time(e) / 1e3
            tt = median_time(t_torch, repeats=args.repeats)
            row = {"kernel": kind, "dtype": dt.name, "M": M, "N": N, "K": Kd, "static": static,
                   "torch_s": tt, "torch_tflops": flops / tt / 1e12}
            label = "cuda_cores" if args.no_tensor_cores else "default"
            try:
                sched = dev.renderer.render(ast, "mm").linear.schedule
                t0 = time.perf_counter()
                prog = dev.compile(ast)
                compile_s = time.perf_counter() - t0
                prog(*bufs, out, **vals)
                dev.synchronize()
                got = out.numpy().astype(np.float32).reshape(M, N)
                err = float(np.max(np.abs(got - ref_np)) / max(1e-6, float(np.max(np.abs(ref_np)))))
                t = median_time(lambda: prog(*bufs, out, wait=True, **vals), repeats=args.repeats)
                row[label] = {"s": t, "tflops": flops / t / 1e12, "vs_torch": tt / t, "max_rel_err": err,
                              "compile_s": compile_s, "schedule": str(sched)}
            except Exception as e:  # noqa: BLE001 -- a row that fails is recorded, not fatal
                row[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(json.dumps(row), flush=True)
            rows.append(row)
            del bufs, out
    search = None
    if args.beam and not args.no_tensor_cores:
        # the search over tensor-core tiles and the CUDA-core tiles (float16 only: search.py compares
        # candidates' outputs at rtol 1e-3, under one bfloat16 ulp)
        from morok_py.cache import beam_search
        t0 = time.perf_counter()
        res = beam_search(dev, K.matmul(4096, 4096, 4096, dtype=dtypes.float16), "mm_search", beam=args.beam,
                          seconds=args.beam_seconds, store=False)
        flops = 2.0 * 4096 ** 3
        search = {"kernel": "matmul 4096^3 float16", "seconds": time.perf_counter() - t0, "best": str(res.schedule),
                  "default": str(res.default), "speedup_over_default": res.speedup,
                  "tflops": {k: flops / v / 1e12 for k, v in res.times.items()}, "rejected": res.rejected}
        print(json.dumps(search), flush=True)
    info = {"device": str(dev.info()) if hasattr(dev, "info") else str(dev), "torch": torch.__version__,
            "compiler": dev.compiler.cache_key, "tensor_cores": not args.no_tensor_cores, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    with open(args.results + ".json", "w") as f:
        json.dump({"machine": info, "rows": rows, "search": search}, f, indent=1)


if __name__ == "__main__":
    main()
