"""float16/bfloat16 contractions on tensor cores against torch.matmul (cuBLAS), same run.

Rows: matmul 4096^3 and the fused dense layer relu(x @ W + b) at 4096^3 and 4000x3001x1023, each in float16 and
bfloat16, static sizes, plus the symbolic 4096^3 matmul; ours with the default schedule (tensor cores on
sm_80+), or with --no-tensor-cores the CUDA-core tiles for comparison. Times are GPU-event
medians (the checked call's wait=True time for ours, torch.cuda.Event for torch); every output is
checked against torch's (float32 accumulation) before it is timed.

--float8: float8 contractions instead (kernels_f8.matmul, float32 sums; rows `matmul_f8e4m3...`) beside
torch._scaled_mm with scales 1.0 and the same output dtype (torch is given B column-major, as it asks): e4m3
4096^3 (float32 and bfloat16 out), e4m3 x e5m2 4096^3, e4m3 4000x3008x1040 (no whole tiles), ours with B as
B^T [N, K] (K-major: cp.async fills) and, rows `..._bkn`, as B [K, N] row-major (kernels.matmul's layout:
the producer's transposed fill). torch's
use_fast_accum=False (its default: cuBLAS adds the tensor cores' partial sums into float32 every few k) is
the peer; its use_fast_accum=True time (one accumulator, as ours) is recorded beside it.

    python benchmarks/tensor_cores.py [--no-tensor-cores | --sweep | --float8 [--float8-candidates]]

writes benchmarks/results/<machine kind>/tensor_cores[-cuda-cores|-sweep|-float8]-<pair>.json (--json PATH:
there instead).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as H  # noqa: E402


def median_time(fn, warmup=3, repeats=15):
    for _ in range(warmup):
        fn()
    return statistics.median(fn() for _ in range(repeats))


def alternating(fa, fb, repeats=15, rounds=5):
    """Medians of fa and fb timed in alternating rounds (the GPU's clocks drift between processes and over
    seconds: torch alone measured 612-720 TFLOP/s for one product in one process), each the median over
    its rounds' medians."""
    for f in (fa, fb):
        for _ in range(3):
            f()
    per = max(3, repeats // rounds)
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(statistics.median(fa() for _ in range(per)))
        tb.append(statistics.median(fb() for _ in range(per)))
    return statistics.median(ta), statistics.median(tb)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None, help="write here instead of benchmarks/results/<machine kind>/")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--no-tensor-cores", action="store_true",
                    help="the CUDA-core tiles instead of tensor cores, for comparison")
    ap.add_argument("--beam", type=int, default=0, help="also search this many schedules of float16 4096^3")
    ap.add_argument("--beam-seconds", type=float, default=25.0)
    ap.add_argument("--sweep", action="store_true",
                    help="only time the tensor-core pipeline forms (tile x stages x swizzle) of 4096^3 float16/bfloat16")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--float8", action="store_true", help="only the float8 contractions beside torch._scaled_mm")
    ap.add_argument("--float8-candidates", action="store_true", help="with --float8: also every float8 tile")
    args = ap.parse_args()
    import torch
    dev = Device["CUDA"]
    if args.no_tensor_cores:
        import dataclasses
        for r, _c in dev.compilers:
            r.caps = dataclasses.replace(r.caps, tensor_cores=())
    rng = np.random.default_rng(0)
    if args.sweep:
        return sweep(dev, torch, rng, args)
    if args.float8:
        return float8(dev, torch, args)
    rows = []
    cases = [("matmul", 4096, 4096, 4096, True), ("matmul", 4096, 4096, 4096, False),
             ("dense", 4096, 4096, 4096, True), ("dense", 4000, 3001, 1023, True)]
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
            row = {"kernel": kind, "dtype": dt.name, "M": M, "N": N, "K": Kd, "static": static}
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
                tt, t = alternating(t_torch, lambda: prog(*bufs, out, wait=True, **vals), repeats=3 * args.repeats)
                row.update(torch_s=tt, torch_tflops=flops / tt / 1e12)
                row[label] = {"s": t, "tflops": flops / t / 1e12, "vs_torch": tt / t, "max_rel_err": err,
                              "compile_s": compile_s, "schedule": str(sched)}
            except Exception as e:  # noqa: BLE001 -- a row that fails is recorded, not fatal
                row[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                tt = median_time(t_torch, repeats=args.repeats)
                row.update(torch_s=tt, torch_tflops=flops / tt / 1e12)
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
    save(args, dev, "cuda-cores" if args.no_tensor_cores else "", {"machine": info, "rows": rows, "search": search})


def save(args, dev, mode: str, doc: dict) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    else:
        H.write_result(H.result_name("tensor_cores", dev, mode), doc, dev)


F8_CASES = [("matmul_f8e4m3", 4096, 4096, 4096, "float8_e4m3fn", "float8_e4m3fn", "float32", "nk"),
            ("matmul_f8e4m3_bf16out", 4096, 4096, 4096, "float8_e4m3fn", "float8_e4m3fn", "bfloat16", "nk"),
            ("matmul_f8e4m3xe5m2", 4096, 4096, 4096, "float8_e4m3fn", "float8_e5m2", "float32", "nk"),
            ("matmul_f8e4m3", 4000, 3008, 1040, "float8_e4m3fn", "float8_e4m3fn", "float32", "nk"),
            ("matmul_f8e4m3_bkn", 4096, 4096, 4096, "float8_e4m3fn", "float8_e4m3fn", "float32", "kn"),
            ("matmul_f8e4m3_bkn", 4000, 3008, 1040, "float8_e4m3fn", "float8_e4m3fn", "float32", "kn")]


def float8(dev, torch, args) -> None:
    """The F8_CASES rows: ours (default schedule) and torch._scaled_mm, timed in alternating rounds."""
    import ml_dtypes
    from morok_py import kernels_f8 as KF
    rows = []
    one = torch.ones((), device="cuda", dtype=torch.float32)
    for kind, M, N, Kd, an, bn, on, layout in F8_CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        ta = torch.randn(M, Kd, device="cuda", generator=g).to(getattr(torch, an))
        tb = torch.randn(N, Kd, device="cuda", generator=g).to(getattr(torch, bn))      # B^T [N, K]
        odt, tod = getattr(dtypes, on), getattr(torch, on)
        ref = ta.float() @ tb.float().t()
        flops = 2.0 * M * N * Kd
        host = [t.view(torch.uint8).cpu().numpy().view(getattr(ml_dtypes, n)) for t, n in ((ta, an), (tb, bn))]
        if layout == "kn":
            host[1] = np.ascontiguousarray(host[1].T)
        bufs = [dev.buffer(M * Kd, getattr(dtypes, an)), dev.buffer(Kd * N, getattr(dtypes, bn))]
        for b, h in zip(bufs, host):
            b.copyin(h.reshape(-1))
        out = dev.buffer(M * N, odt)
        row = {"kernel": kind, "dtype": f"{an} x {bn} -> {on}", "M": M, "N": N, "K": Kd, "static": True, "b_layout": layout}

        def timer(fast):
            def t_torch():
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(); torch._scaled_mm(ta, tb.t(), scale_a=one, scale_b=one, out_dtype=tod, use_fast_accum=fast)
                e.record(); e.synchronize()
                return s.elapsed_time(e) / 1e3
            return t_torch
        try:
            tref = torch._scaled_mm(ta, tb.t(), scale_a=one, scale_b=one, out_dtype=tod)
            row["torch_max_rel_err"] = float((tref.float() - ref).abs().max() / ref.abs().max())
            t_torch = timer(False)
        except Exception as e:  # noqa: BLE001 -- torch may not take a shape or type: ours is still timed
            row["torch_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            t_torch = None
        ast = KF.matmul(M, N, Kd, getattr(dtypes, an), getattr(dtypes, bn), out_dtype=odt, b_layout=layout)
        try:
            sched = dev.renderer.render(ast, "f8mm").linear.schedule
            t0 = time.perf_counter()
            prog = dev.compile(ast, "f8mm")
            compile_s = time.perf_counter() - t0
            prog(*bufs, out)
            dev.synchronize()
            got = torch.from_numpy(out.numpy().astype(np.float32).reshape(M, N)).cuda()
            err = float((got - ref).abs().max() / ref.abs().max())
            ours = lambda: prog(*bufs, out, wait=True)  # noqa: E731
            if t_torch is not None:
                tt, t = alternating(t_torch, ours, repeats=3 * args.repeats)
                tf = median_time(timer(True), repeats=args.repeats)
                row.update(torch_s=tt, torch_tflops=flops / tt / 1e12, torch_fast_accum_s=tf,
                           torch_fast_accum_tflops=flops / tf / 1e12)
            else:
                t = median_time(ours, repeats=args.repeats)
            row["default"] = {"s": t, "tflops": flops / t / 1e12, "max_rel_err": err, "compile_s": compile_s,
                              "schedule": str(sched)}
            if t_torch is not None:
                row["default"]["vs_torch"] = row["torch_s"] / t
                row["default"]["vs_torch_fast_accum"] = row["torch_fast_accum_s"] / t
        except Exception as e:  # noqa: BLE001 -- a row that fails is recorded, not fatal
            row["default"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del bufs, out
    cands = float8_candidates(dev, args) if args.float8_candidates else []
    info = {"device": str(dev.info()) if hasattr(dev, "info") else str(dev), "torch": torch.__version__,
            "compiler": dev.compiler.cache_key, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    save(args, dev, "float8", {"machine": info, "rows": rows, "candidates": cands})


def float8_candidates(dev, args) -> list:
    """Each warpgroup float8 tile (wgmma_f8.F8_CANDIDATES) of e4m3 4096^3 -> float32, both B layouts: TFLOP/s."""
    import ml_dtypes
    from morok_py import kernels_f8 as KF
    from morok_py.codegen.schedule import Schedule, using
    from morok_py.codegen.strategies.tensor_core import WGMMA, tc_threads
    from morok_py.codegen.strategies.wgmma_f8 import F8_CANDIDATES
    M = N = Kd = 4096
    flops = 2.0 * M * N * Kd
    rng = np.random.default_rng(0)
    f8 = ml_dtypes.float8_e4m3fn
    bufs = [dev.buffer(M * Kd, dtypes.float8_e4m3fn), dev.buffer(Kd * N, dtypes.float8_e4m3fn)]
    for b in bufs:
        b.copyin(rng.standard_normal(M * Kd).astype(np.float32).astype(f8))
    out = dev.buffer(M * N, dtypes.float32)
    rows = []
    for layout in ("nk", "kn"):
        for tile, stages in F8_CANDIDATES:
            sched = Schedule("tiled", group=tc_threads(tile, WGMMA), matmul_tile=tile, tensor_core=WGMMA,
                             tc_stages=stages, tc_swizzle=True)
            row = {"b_layout": layout, "schedule": str(sched)}
            try:
                with using(sched):
                    spec = dev.renderer.render(KF.matmul(M, N, Kd, b_layout=layout), "f8mm")
                prog = dev.runtime(dev.compiler.compile(spec))
                t = median_time(lambda: prog(*bufs, out, wait=True), repeats=args.repeats)
                row.update(s=t, tflops=flops / t / 1e12)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


SWEEP = [((128, 256, 32, 64, 64), 4, True), ((128, 256, 32, 64, 64), 3, True), ((128, 256, 64, 64, 64), 2, True),
         ((256, 128, 32, 64, 64), 4, True), ((128, 128, 32, 64, 64), 4, True), ((128, 128, 32, 64, 64), 3, True),
         ((128, 128, 64, 64, 64), 3, True), ((128, 128, 64, 64, 64), 2, True), ((128, 128, 32, 64, 32), 4, True),
         ((128, 128, 32, 64, 32), 0, False)]


def sweep(dev, torch, rng, args) -> None:
    """Each pipeline form of 4096^3 (the first is the default) beside torch.matmul: TFLOP/s and the error."""
    from morok_py.codegen.schedule import Schedule, using
    from morok_py.codegen.strategies.tensor_core import MMA_M16N8K16, WGMMA, tc_threads
    M = N = Kd = 4096
    forms = [(MMA_M16N8K16, t, st, sw) for t, st, sw in SWEEP]
    if WGMMA in dev.renderer.caps.tensor_cores:          # sm_90a: the warpgroup forms first
        from morok_py.codegen.strategies.wgmma import WG_CANDIDATES
        forms = [(WGMMA, t, st, True) for t, st in WG_CANDIDATES] + forms[:3]
    flops = 2.0 * M * N * Kd
    renderer, compiler = dev.renderer, dev.compiler
    rows = []
    for name in args.dtypes.split(","):
        dt = getattr(dtypes, name)
        tdt = getattr(torch, name)
        tx = torch.randn(M, Kd, device="cuda").to(tdt)
        tw = (torch.randn(Kd, N, device="cuda") / 64).to(tdt)
        ref = (tx @ tw).float()

        def t_torch():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); torch.matmul(tx, tw); e.record(); e.synchronize()
            return s.elapsed_time(e) / 1e3
        tt = median_time(t_torch, repeats=args.repeats)
        print(json.dumps({"dtype": name, "torch_tflops": flops / tt / 1e12}), flush=True)
        bufs = [dev.buffer(M * Kd, dt), dev.buffer(Kd * N, dt)]
        for b, t in zip(bufs, (tx, tw)):
            b.copyin(t.float().cpu().numpy().astype(to_numpy(dt)).reshape(-1))
        out = dev.buffer(M * N, dt)
        for mma, tile, stages, swz in forms:
            sched = Schedule("tiled", group=tc_threads(tile, mma), matmul_tile=tile, tensor_core=mma,
                             tc_stages=stages, tc_swizzle=swz)
            row = {"dtype": name, "schedule": str(sched), "torch_s": tt}
            try:
                with using(sched):
                    spec = renderer.render(K.matmul(M, N, Kd, dtype=dt), "mm")
                prog = dev.runtime(compiler.compile(spec))
                prog(*bufs, out, wait=True)
                got = torch.from_numpy(out.numpy().astype(np.float32).reshape(M, N)).cuda()
                err = float((got - ref).abs().max() / ref.abs().max())
                t = median_time(lambda: prog(*bufs, out, wait=True), repeats=args.repeats)
                row.update(s=t, tflops=flops / t / 1e12, vs_torch=tt / t, max_rel_err=err)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    save(args, dev, "sweep", {"machine": {"compiler": compiler.cache_key, "torch": torch.__version__,
                                          "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}, "sweep": rows})


if __name__ == "__main__":
    main()
