"""Cold first run of whole models: the onnx wheel's light resnet50 and densenet121 through morok_py.onnx
with an empty disk cache, so the first run renders, compiles and loads every kernel (in one batch:
Device.compile_many), then runs.

    python benchmarks/compile_models.py [--device CPU] [--models resnet50,densenet121] [--repeats 3]
                                        [--modes default,serial] [--workers N] [--no-save]

On a GPU machine, `--device CUDA` times the same on the GPU (NVRTC or MOROK_CUDA_COMPILER's pair).

Each run is a fresh process with a new, empty MOROK_CACHE_DIR (nothing in memory, nothing on disk);
`--repeats` runs per (model, mode), alternating models and modes so that load from other work falls
on all of them alike, median reported. Modes: `default` (the batch rule, batch.plan_for), or a
forced MOROK_COMPILE_MODE (`serial`, `threads`, `processes`). Every run's output is checked against
the model's shipped output (its input: the ONNX runner's dummy data; rtol 1e-3, atol 1e-5). The targets are the ones set for a cold first run:
resnet50 <= 3 s and densenet121 <= 6 s on 16 cores, 10 s and 20 s on 2 vCPUs (`target_s`, by cores).

Writes benchmarks/results/<machine kind>/compile_models.json (one record per model and mode: value =
median first-run seconds; each run's first-run, compile and process times, the batch plan, the load).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

MODELS = ("resnet50", "densenet121")
# cold first-run targets in seconds: (16-core host, 2-vCPU host)
TARGETS = {"resnet50": (3.0, 10.0), "densenet121": (6.0, 20.0)}


def target_s(model: str, cores: int) -> float | None:
    t = TARGETS.get(model)
    return None if t is None else (t[0] if cores >= 16 else t[1])


def child(model: str, device: str) -> dict:
    """One cold first run in this (fresh) process."""
    t_start = time.perf_counter()
    import numpy as np
    import onnx
    from onnx import numpy_helper
    from morok_py import batch, cache
    from morok_py.onnx.executor import OnnxExecutor
    from morok_py.onnx.run import dummy_input
    from morok_py.registry import get_device
    d = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
    m = onnx.load(str(d / f"light_{model}.onnx"))
    want = numpy_helper.to_array(onnx.load_tensor(str(d / f"light_{model}_output_0.pb")))
    inits = {i.name for i in m.graph.initializer}
    feeds = {vi.name: dummy_input(vi) for vi in m.graph.input if vi.name not in inits}   # the shipped output's input
    t_import = time.perf_counter() - t_start
    plans: list = []          # the plans compile_many chose (the load decides the workers, so read them here)
    chose = batch.plan_for
    batch.plan_for = lambda *a, **k: plans.append(chose(*a, **k)) or plans[-1]
    dev = get_device(device)
    t0 = time.perf_counter()
    ex = OnnxExecutor(m, dev)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = ex.run(feeds)[0]
    first = time.perf_counter() - t0
    ok = out.shape == want.shape and bool(np.allclose(out, want, rtol=1e-3, atol=1e-5))
    return {"first_run_s": first, "load_s": load_s, "import_s": t_import, "compile_s": ex.k.compile_s,
            "programs": len(ex.k.programs), "launches": len(ex.k.stats), "compiles": cache.stats.compiles,
            "plan": "; ".join(map(str, plans)) or "nothing compiled", "matches_shipped_output": ok}


def run_child(model: str, device: str, mode: str, workers: int | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="morok-cold-") as cache_dir:
        env = dict(os.environ, MOROK_CACHE_DIR=cache_dir)
        env.pop("MOROK_CACHE", None)
        env.pop("MOROK_COMPILE_MODE", None)
        if mode != "default":
            env["MOROK_COMPILE_MODE"] = mode
        if workers:
            env["MOROK_COMPILE_WORKERS"] = str(workers)
        load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--child", model, "--device", device], env=env,
                           capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise RuntimeError(f"{model} [{mode}]: the run failed\n{p.stderr[-3000:]}")
        rec = json.loads(p.stdout.strip().splitlines()[-1])
        rec["process_s"] = wall
        rec["load_before"] = load_before
        return rec


def main() -> int:
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        dev = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "CPU"
        print(json.dumps(child(sys.argv[i + 1], dev)))
        return 0
    ap = H.parser(__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--modes", default="default,serial", help="comma-separated: default, serial, threads, processes")
    ap.add_argument("--workers", type=int, default=0, help="MOROK_COMPILE_WORKERS for the runs (0: one per core)")
    ap.set_defaults(repeats=3)
    args = ap.parse_args()
    if args.quick:
        args.models, args.repeats = "resnet50", 1
    dev = H.open_device(args.device, args.wait_quiet)
    models = [m for m in args.models.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    cores = os.cpu_count() or 1
    runs: dict[tuple[str, str], list[dict]] = {(m, mode): [] for m in models for mode in modes}
    for r in range(args.repeats):
        for m in models:
            for mode in modes:
                rec = run_child(m, dev.name, mode, args.workers or None)
                runs[(m, mode)].append(rec)
                H.note(f"{m:12s} [{mode}] run {r + 1}/{args.repeats}: first run {rec['first_run_s']:.2f} s "
                       f"(compile {rec['compile_s']:.2f} s, {rec['programs']} programs; process "
                       f"{rec['process_s']:.2f} s; load {rec['load_before']:.2f}; {rec['plan']}; "
                       f"matches the shipped output: {rec['matches_shipped_output']})")
    res = H.Results("compile_models", dev, args)
    rows = []
    for (m, mode), recs in runs.items():
        first = statistics.median(r["first_run_s"] for r in recs)
        tgt = target_s(m, cores)
        res.add(f"{m} cold first run [{mode}]", recs[0]["programs"], "s", first,
                compile_s=statistics.median(r["compile_s"] for r in recs),
                process_s=statistics.median(r["process_s"] for r in recs),
                target_s=tgt, target_met=None if tgt is None else first <= tgt, cores=cores, mode=mode,
                workers=args.workers or cores, plan=recs[0]["plan"], launches=recs[0]["launches"],
                matches_shipped_output=all(r["matches_shipped_output"] for r in recs), runs=recs)
        rows.append((m, mode, recs[0]["programs"], f"{first:.2f}",
                     f"{statistics.median(r['compile_s'] for r in recs):.2f}",
                     f"{statistics.median(r['process_s'] for r in recs):.2f}",
                     "-" if tgt is None else f"{tgt:g} ({'met' if first <= tgt else 'missed'})"))
    H.table(rows, ["model", "mode", "programs", "first run s", "compile s", "process s", "target s"],
            f"cold first run on {dev.name}, {cores} cores, median of {args.repeats}")
    res.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
