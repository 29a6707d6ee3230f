"""Concat without copies in the ONNX executor: replay time of the onnx wheel's light models with the
Concat producers writing into their slices (MOROK_ONNX_CONCAT_VIEWS=1, the default) beside the copy
kernels (=0), in one process, alternating blocks of replays (harness.interleaved), round medians; with
the memory plan (MOROK_MEMPLAN=1, the default) and without it (each intermediate its own buffer).

    python benchmarks/onnx_concat_views.py [--models densenet121,inception_v1] [--rounds 7] [--repeats 5]

Each executor's first run is checked against the model's shipped output and the two replays against each
other bit for bit. Writes benchmarks/results/<machine kind>/onnx_concat_views.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402
from onnx_models import feeds_for, light  # noqa: E402


def executors(name: str, memplan: str):
    import onnx
    from onnx import numpy_helper
    from morok_py.onnx.executor import OnnxExecutor
    path, ref = light(name)
    model = onnx.load(str(path))
    feeds = feeds_for(model)
    t = onnx.TensorProto()
    t.ParseFromString(Path(ref).read_bytes())
    want = numpy_helper.to_array(t)
    exs, info = {}, {}
    for label, flag in (("views", "1"), ("copies", "0")):
        os.environ["MOROK_ONNX_CONCAT_VIEWS"] = flag
        os.environ["MOROK_MEMPLAN"] = memplan       # read by the first run, which records the replayed plan
        ex = OnnxExecutor(model)
        out = ex.run(feeds)[0]
        err = float(np.abs(out.astype(np.float64) - want).max())
        H.check_close(f"{name} {label}", out, want, rtol=1e-3, atol=1e-4)
        info[label] = {"launches": len(ex.k.launches), "max_abs_diff_vs_shipped": err,
                       "memory": ex.memory_report()}
        exs[label] = ex
    os.environ.pop("MOROK_ONNX_CONCAT_VIEWS", None)
    os.environ.pop("MOROK_MEMPLAN", None)
    a, b = exs["views"].run(feeds)[0], exs["copies"].run(feeds)[0]
    info["replays_bitwise_equal"] = bool(np.array_equal(a, b))
    return exs, feeds, info


def kernel_sums(exs: dict, rounds: int) -> dict:
    """Each executor's recorded launches run one by one, each waited for (so the sum has no launch overlap
    or Python between kernels), alternating executors each round: the median sums, and by node how the
    kernels both paths launch changed (the ones that read a Concat's output pay the reads the copies did)."""
    per: dict[str, list[dict[str, float]]] = {label: [] for label in exs}
    for _ in range(rounds):
        for label, ex in exs.items():
            times: dict[str, float] = {}
            for (prog, bufs, vars), st in zip(ex.k.launches, ex.k.stats):
                times[st.node] = times.get(st.node, 0.0) + prog(*bufs, wait=True, **vars)
            per[label].append(times)
    med = {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for label, rs in per.items()}
    v, c = med["views"], med["copies"]
    common = {k: (v[k] - c[k]) * 1e3 for k in v if k in c}
    return {"views_ms": sum(v.values()) * 1e3, "copies_ms": sum(c.values()) * 1e3,
            "concat_copy_kernels_ms": sum(t for k, t in c.items() if k not in v) * 1e3,
            "common_kernels_change_ms": sum(common.values()),
            "most_slowed_ms": dict(sorted(common.items(), key=lambda kv: -kv[1])[:6])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="densenet121")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    doc: dict = {"machine": H.machine(H.open_device("CPU")), "rounds": args.rounds, "repeats": args.repeats,
                 "load_average_start": os.getloadavg(), "models": {}}
    for name in args.models.split(","):
        doc["models"][name] = {}
        for memplan in ("1", "0"):
            exs, feeds, info = executors(name, memplan)
            rounds = H.interleaved([(label, lambda ex=ex: ex.run(feeds)) for label, ex in exs.items()],
                                   rounds=args.rounds, repeats=args.repeats)
            v, c = rounds["views"], rounds["copies"]
            info["views_ms_rounds"] = [x * 1e3 for x in v]
            info["copies_ms_rounds"] = [x * 1e3 for x in c]
            info["views_ms_median"] = statistics.median(v) * 1e3
            info["copies_ms_median"] = statistics.median(c) * 1e3
            info["speedup_median_rounds"] = statistics.median(cc / vv for vv, cc in zip(v, c))
            info.update(H.round_summary(v, c))
            info["kernel_sums"] = ks = kernel_sums(exs, args.rounds)
            doc["models"][name][f"memplan={memplan}"] = info
            print(f"{name} MOROK_MEMPLAN={memplan}: launches {info['views']['launches']} with views, "
                  f"{info['copies']['launches']} with copies; replay median {info['views_ms_median']:.2f} ms vs "
                  f"{info['copies_ms_median']:.2f} ms (per-round ratio median {info['speedup_median_rounds']:.3f}x, "
                  f"range {info['round_ratio_range'][0]:.3f}-{info['round_ratio_range'][1]:.3f}); bitwise equal "
                  f"{info['replays_bitwise_equal']}; kernels one by one: {ks['views_ms']:.2f} vs {ks['copies_ms']:.2f} ms "
                  f"(copies {ks['concat_copy_kernels_ms']:.2f} ms, the kernels both launch "
                  f"{ks['common_kernels_change_ms']:+.2f} ms with views)", flush=True)
    doc["load_average_end"] = os.getloadavg()
    H.write_result("onnx_concat_views", doc, kind=H.machine_kind("CPU"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
