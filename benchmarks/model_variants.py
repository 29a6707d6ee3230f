"""A whole model's captured replay under the default heuristics against the same model under other settings of
morok_py's constants, beside onnxruntime's CPU provider, in one process: which rule a host should default to.

    python benchmarks/model_variants.py --model resnet50 \\
        --set 'codegen.strategies.conv.CPU_WINOGRAD_4X4_MIN_LANES=99' --tag winograd4x4 [--rounds 15]

writes benchmarks/results/<machine kind>/model_variants[-TAG].json (--json PATH: there instead).

The models and their inputs are benchmarks/onnx_models.py's (`load_model`: the onnx wheel's light resnet50 and
densenet121, the built MobileNet-style stack and MLP). Each variant (`--set`, repeatable: ';'-separated
MODULE.NAME=VALUE, MODULE under morok_py) builds its own executor with those constants set while its
kernels are planned and compiled (the first run, which records the plan), then restored; its output is
checked against onnxruntime's (rtol 1e-3, atol 1e-5). `--instances` executors are built per variant, the
variants' order alternating (default, A, A, default, ...): two executors of the same plans in one process
replayed up to 6% apart (their buffers lie elsewhere), so one of each would measure where each landed. The
replays run in interleaved rounds: in each round a block of each executor and of onnxruntime (the order
reversed every other round) after this process's threads go quiet (harness.settle), 3 untimed runs and
`--block` timed; a variant's round is the mean of its executors' block medians, a record keeps the median
over rounds, the ratio onnxruntime / it (higher is better), and every round.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402
import onnx_models as OM  # noqa: E402


def block(fn, n: int) -> float:
    """The median of one interleaved block of `n` timed runs (onnx_models' warm-up before them)."""
    return statistics.median(H.block_times(fn, OM.AB_WARM, n)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--set", action="append", default=[], help="a variant: ';'-separated MODULE.NAME=VALUE")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--block", type=int, default=10, help="timed runs in each block")
    ap.add_argument("--instances", type=int, default=2,
                    help="executors built per variant, in alternating order (one process's executors of the same "
                         "plans replayed up to 6%% apart)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not a.set:
        raise SystemExit("give at least one --set variant")
    import onnxruntime as ort
    from morok_py.onnx.executor import OnnxExecutor

    model, feeds = OM.load_model(a.model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)
    labels = ["default"] + a.set
    runs: list[tuple[str, object]] = []
    for i in range(a.instances):
        for label in (labels if i % 2 == 0 else labels[::-1]):
            with H.constants("" if label == "default" else label):
                ex = OnnxExecutor(model, "CPU")
                got = ex.run(feeds)
            for o, w in zip(got, want):
                np.testing.assert_allclose(np.asarray(o), w, rtol=OM.RTOL, atol=OM.ATOL, err_msg=label)
            runs.append((label, lambda e=ex: e.run(feeds)))
    runs.append(("onnxruntime", lambda: sess.run(None, feeds)))
    order = labels + ["onnxruntime"]
    rounds: dict[str, list[float]] = {k: [] for k in order}
    for r in range(a.rounds):
        times: dict[str, list[float]] = {k: [] for k in order}
        for label, fn in (runs if r % 2 == 0 else runs[::-1]):
            times[label].append(block(fn, a.block))
        for k in order:
            rounds[k].append(statistics.fmean(times[k]))
    med = {k: statistics.median(v) for k, v in rounds.items()}
    peer = med["onnxruntime"]
    results = []
    for k in order[:-1]:
        results.append({"name": f"model_variants_{a.model}", "label": k, "value": med[k], "unit": "s",
                        "better": "lower", "peer": "onnxruntime", "peer_value": peer, "ratio": peer / med[k],
                        "vs_default": med["default"] / med[k], "rounds_s": rounds[k]})
        print(f"{a.model:12} {k:60} {med[k] * 1e3:8.3f} ms  {peer / med[k]:.3f}x onnxruntime  "
              f"{med['default'] / med[k]:.3f}x default")
    print(f"{a.model:12} {'onnxruntime':60} {peer * 1e3:8.3f} ms")
    from morok_py import Device
    doc = {"machine": H.machine(Device["CPU"]), "model": a.model, "rounds": a.rounds, "block": a.block,
           "instances": a.instances, "onnxruntime_rounds_s": rounds["onnxruntime"], "results": results}
    H.save_result(H.result_name("model_variants", tag=a.tag), doc, a.json)


if __name__ == "__main__":
    main()
