"""resnet50 and densenet121 (the onnx wheel's `light_*` models) through morok_py.onnx, beside
onnxruntime in the same run.

    python benchmarks/onnx_models.py [--device CPU|CUDA] [--compiler nvrtc|llvm-nvptx] [--runs 10]
                                     [--models resnet50,densenet121] [--json OUT.json]

writes benchmarks/results/<machine kind>/onnx_models[-<pair>].json unless --json names a file.

For each model and each morok_py pair, two fresh processes:
  cold   an empty disk cache (XDG_CACHE_HOME set to a new folder): the first run renders, compiles and
         loads every kernel, then runs;
  warm   the same folder again: the first run finds every kernel in the disk cache.
Each then replays the recorded ExecutionPlan `--runs` times (median reported, input copied in and
outputs read back, as a client would). onnxruntime runs the same model in the parent process with the
matching provider (CPUExecutionProvider; CUDAExecutionProvider on CUDA where this onnxruntime has it,
otherwise recorded as unavailable): session creation, first run, median of `--runs`. Every run's
output is checked against the model's shipped output (rtol 1e-3, atol 1e-7) and against onnxruntime's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def light(name: str) -> tuple[Path, Path]:
    import onnx
    d = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
    return d / f"light_{name}.onnx", d / f"light_{name}_output_0.pb"


def feeds_for(model) -> dict[str, np.ndarray]:
    from morok_py.onnx.run import dummy_input
    inits = {i.name for i in model.graph.initializer}
    return {vi.name: dummy_input(vi) for vi in model.graph.input if vi.name not in inits}


def worker(args) -> None:
    """One process: load, first run (cold or warm disk cache, per XDG_CACHE_HOME), replays."""
    import onnx
    from onnx import numpy_helper
    from morok_py.registry import get_device
    from morok_py.onnx import OnnxExecutor
    path, want_path = light(args.worker)
    model = onnx.load(str(path))
    want = numpy_helper.to_array(onnx.load_tensor(str(want_path)))
    t0 = time.perf_counter()
    dev = get_device(args.device)
    ex = OnnxExecutor(model, dev)
    load_s = time.perf_counter() - t0
    feeds = feeds_for(model)
    t0 = time.perf_counter()
    got = ex.run(feeds)[0]
    first = time.perf_counter() - t0
    ok = bool(np.allclose(got, want, rtol=1e-3, atol=1e-7))
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        again = ex.run(feeds)[0]
        times.append(time.perf_counter() - t0)
        ok = ok and bool(np.allclose(again, want, rtol=1e-3, atol=1e-7))
    np.save(args.out_npy, got)
    print(json.dumps({"load_s": load_s, "first_run_s": first, "compile_s": ex.k.compile_s,
                      "programs": len(ex.k.programs), "launches": len(ex.k.stats),
                      "replay_ms_median": statistics.median(times) * 1e3,
                      "replay_ms_min": min(times) * 1e3, "matches_shipped_output": ok,
                      "max_abs_err_vs_shipped": float(np.abs(got.astype(np.float64) - want).max())}))


def run_worker(name, device, compiler, runs, cache) -> tuple[dict, np.ndarray]:
    env = dict(os.environ, XDG_CACHE_HOME=cache)
    if compiler:
        env[f"MOROK_{device.split(':')[0].upper()}_COMPILER"] = compiler
    with tempfile.TemporaryDirectory() as td:
        npy = os.path.join(td, "out.npy")
        p = subprocess.run([sys.executable, __file__, "--worker", name, "--device", device, "--runs", str(runs),
                            "--out-npy", npy], env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{name} on {device}/{compiler}: worker failed\n{p.stderr[-3000:]}")
        return json.loads(p.stdout.strip().splitlines()[-1]), np.load(npy)


def onnxruntime_run(name, device, runs) -> tuple[dict, np.ndarray | None]:
    try:
        import onnxruntime as ort
    except ImportError:
        return {"available": False, "why": "onnxruntime is not installed (pip install onnxruntime)"}, None
    import onnx
    path, _ = light(name)
    want = "CUDAExecutionProvider" if device.upper().startswith("CUDA") else "CPUExecutionProvider"
    if want not in ort.get_available_providers():
        return {"available": False, "version": ort.__version__,
                "why": f"this onnxruntime has no {want} (providers: {ort.get_available_providers()})"}, None
    model = onnx.load(str(path))
    feeds = feeds_for(model)
    t0 = time.perf_counter()
    sess = ort.InferenceSession(str(path), providers=[want])
    create = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = sess.run(None, feeds)[0]
    first = time.perf_counter() - t0
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return {"available": True, "version": ort.__version__, "provider": want, "session_s": create,
            "first_run_s": first, "run_ms_median": statistics.median(times) * 1e3,
            "run_ms_min": min(times) * 1e3}, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="CPU")
    ap.add_argument("--compiler", action="append", default=None,
                    help="pair(s) to run (repeatable); default: the device's default pair")
    ap.add_argument("--models", default="resnet50,densenet121")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out-npy", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    import onnx
    result = {"device": args.device, "host": platform.node(), "machine": platform.machine(),
              "processor": _cpu_name(), "cpus": os.cpu_count(), "onnx": onnx.__version__,
              "runs": args.runs, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "models": {}}
    compilers = args.compiler or [None]
    for name in args.models.split(","):
        entry = {}
        ort_res, ort_out = onnxruntime_run(name, args.device, args.runs)
        entry["onnxruntime"] = ort_res
        for comp in compilers:
            label = comp or "default"
            with tempfile.TemporaryDirectory() as cache:
                cold, out = run_worker(name, args.device, comp, args.runs, cache)
                warm, _ = run_worker(name, args.device, comp, args.runs, cache)
            res = {"cold": cold, "warm_cache": warm}
            if ort_out is not None:
                res["max_abs_diff_vs_onnxruntime"] = float(np.abs(out.astype(np.float64) - ort_out).max())
                res["replay_vs_onnxruntime"] = ort_res["run_ms_median"] / warm["replay_ms_median"]
            entry[f"morok_py[{label}]"] = res
            print(f"{name:12s} {args.device}/{label}: cold first run {cold['first_run_s']:.2f} s "
                  f"(compile {cold['compile_s']:.2f} s, {cold['programs']} programs), warm-cache first run "
                  f"{warm['first_run_s']:.2f} s, replay {warm['replay_ms_median']:.2f} ms"
                  + (f"; onnxruntime {ort_res['run_ms_median']:.2f} ms -> ratio "
                     f"{res['replay_vs_onnxruntime']:.2f}x (higher is better)" if ort_out is not None
                     else f"; onnxruntime: {ort_res.get('why')}"), flush=True)
        result["models"][name] = entry
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    else:       # benchmarks/results/<machine kind>/onnx_models[-<pair>].json
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import harness as H
        one = args.compiler[0] if args.compiler and len(args.compiler) == 1 else ""
        H.write_result("-".join(p for p in ("onnx_models", one) if p), result,
                       kind=H.machine_kind(args.device))
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())
