"""Where a model's CPU replay spends its time, layer by layer, beside onnxruntime's own profiler: which layers lose,
and how much of each layer's time is its data arriving cold.

    python benchmarks/profile_layers.py [--model resnet50] [--rounds 15] [--tag TAG] [--json OUT.json] [--set M.NAME=V]

writes benchmarks/results/<machine kind>/profile_layers-<model>[-TAG].json (--json PATH: there instead).

The model and its inputs are benchmarks/onnx_models.py's (`load_model`). Every node is named after its first output
(so that both runtimes report it under one name). morok_py's executor records the model's launches (their
ExecutionPlan, on the memory plan's arena); each launch is timed three ways, `--rounds` rounds, medians:

  in_order        the launches in launch order, each timed alone (`Program.execute`, the replay's own call): what
                  a replay spends there, its inputs written by the launch before it and its weights and outputs
                  last touched a whole replay ago. The model's last TAIL_LAUNCHES launches run untimed first, as
                  the replay before ran them: after the quiet wait the pool's workers sleep, and the first launch
                  would pay their wake-up (the 16-core Xeon's resnet50 stem phase planes: 178 us in order, 15
                  repeated; 39 after the last three launches). The last launch alone did not wake them where it
                  runs on one thread (a softmax);
  hot             the same launch run twice at once, the second timed: its data in this core's caches;
  after_previous  the launch before it run again first: its inputs just written by that launch, its weights hot.

onnxruntime (CPU provider, default options) runs `--rounds` + 5 times with its profiler on; a node's time is the
median of its `*_kernel_time` events past the first 5 runs. Its fused nodes (a Conv that took the Add and Relu
after it) are counted under the first node of the fusion, and so are morok_py's (a convolution's epilogue).

A record per compute node (Conv, Gemm, MatMul, pooling, Softmax): `value` morok_py's in-order time of the node's
launches, `peer_value` onnxruntime's, `ratio` the peer's over ours (higher is better for morok_py), `hot_s`,
`after_previous_s`, the launches' parts. A summary record (`layers_total`) has the sums, and one more
(`replay`) the captured replay against onnxruntime's session.run in interleaved blocks (harness.block_times).
The profiler's times are onnxruntime's kernels alone; the sums do not add up to either runtime's whole run.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402
import onnx_models as OM  # noqa: E402

COMPUTE_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul", "MaxPool", "AveragePool", "GlobalAveragePool",
               "GlobalMaxPool", "Softmax")
ORT_SKIP_RUNS = 5       # onnxruntime's first runs (its arena and thread pool settling) left out of its medians


def _named(model):
    """The model with every node named after its first output (a name both runtimes report)."""
    for n in model.graph.node:
        n.name = n.output[0].replace("/", "_")
    return model


def _owners(model) -> dict[str, str]:
    """node name -> the compute node it is counted under: itself, or the compute node before it (an
    elementwise node fused into a convolution's epilogue by either runtime)."""
    out, last = {}, None
    for n in model.graph.node:
        if n.op_type in COMPUTE_OPS:
            last = n.name
        out[n.name] = last or n.name
    return out


def _describe(model) -> dict[str, str]:
    import onnx
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in list(inferred.graph.value_info) + list(inferred.graph.input)}
    inits = {t.name: list(t.dims) for t in model.graph.initializer}
    out = {}
    for n in model.graph.node:
        if n.op_type not in COMPUTE_OPS:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        text = f"{n.op_type} in {shapes.get(n.input[0])}"
        if len(n.input) > 1 and (n.input[1] in inits or shapes.get(n.input[1])):
            text += f" w {inits.get(n.input[1]) or shapes[n.input[1]]}"
        for key in ("strides", "group"):
            if key in attrs and attrs[key] not in ([1, 1], 1):
                text += f" {key} {attrs[key]}"
        out[n.name] = text
    return out


def onnxruntime_nodes(data: bytes, feeds: dict, runs: int) -> dict[str, float]:
    """node name -> onnxruntime's median kernel time (s) over `runs` profiled runs."""
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.enable_profiling = True
    opts.profile_file_prefix = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"morok-profile-{os.getpid()}")
    sess = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
    for _ in range(runs + ORT_SKIP_RUNS):
        sess.run(None, feeds)
    path = sess.end_profiling()
    events = json.loads(Path(path).read_text())
    os.remove(path)
    times = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            name = e["name"][:-len("_kernel_time")]
            times[name[:-len("_nchwc")] if name.endswith("_nchwc") else name].append(e["dur"] * 1e-6)
    return {k: statistics.median(v[ORT_SKIP_RUNS:] or v) for k, v in times.items()}


# launches of the model's end run untimed before each in-order pass (a classifier's pool, contraction and softmax)
TAIL_LAUNCHES = 3


def morok_launches(model, feeds: dict, rounds: int):
    """(node of each launch, its part, [in_order, hot, after_previous] medians (s), the executor)."""
    from morok_py.onnx.executor import OnnxExecutor
    ex = OnnxExecutor(model, "CPU", profile=True)
    for _ in range(3):
        ex.run(feeds)
    plan = next(iter(ex.plans.values()))[0]
    steps = plan.steps
    stats = ex.k.stats[-len(steps):]
    if len(stats) != len(steps):
        raise SystemExit(f"{len(stats)} launch records for {len(steps)} plan steps")

    def run(st) -> float:
        t0 = time.perf_counter()
        st.program.execute(st.ptrs, st.ordered, st.gs, st.ls)
        return time.perf_counter() - t0
    times = [[[], [], []] for _ in steps]
    for _ in range(rounds):
        H.settle()
        for st in steps[-TAIL_LAUNCHES:]:   # the replay before's last launches: the workers awake, as a replay finds them
            run(st)
        for i, st in enumerate(steps):
            times[i][0].append(run(st))
        for i, st in enumerate(steps):
            run(st)
            times[i][1].append(run(st))
        for i, st in enumerate(steps):
            if i:
                run(steps[i - 1])
            run(st)
            if i:
                run(steps[i - 1])
            times[i][2].append(run(st))
    # a launch's node: "<node>:<part>" (a convolution's im2col, gemm, ...) or "<node>"
    parts = [s.node.split(":", 1)[1] if ":" in s.node else "kernel" for s in stats]
    return [s.node.split(":", 1)[0] for s in stats], parts, [[statistics.median(t) for t in ts] for ts in times], ex


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50", help=", ".join(OM.LIGHT + OM.BUILT))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tag", default="")
    ap.add_argument("--json", default=None)
    ap.add_argument("--set", default="", help="';'-separated MODULE.NAME=VALUE (MODULE under morok_py): the executor "
                                              "built with those constants set (harness.constants)")
    a = ap.parse_args()
    import onnxruntime as ort

    model, feeds = OM.load_model(a.model)
    model = _named(model)
    data = model.SerializeToString()
    owners, described = _owners(model), _describe(model)
    with H.constants(a.set) if a.set else contextlib.nullcontext():
        nodes, parts, times, ex = morok_launches(model, feeds, a.rounds)
    peer = onnxruntime_nodes(data, feeds, a.rounds)

    ours: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    pieces: dict[str, list[str]] = collections.defaultdict(list)
    for node, part, t in zip(nodes, parts, times):
        owner = owners.get(node, node)
        for j in range(3):
            ours[owner][j] += t[j]
        pieces[owner].append(f"{part} {t[0] * 1e6:.0f}/{t[1] * 1e6:.0f}/{t[2] * 1e6:.0f} us")
    theirs: dict[str, float] = collections.defaultdict(float)
    for node, t in peer.items():
        theirs[owners.get(node, node)] += t

    results = []
    for owner in [n.name for n in model.graph.node if n.name in ours or n.name in theirs]:
        if owner not in ours and owner not in theirs:
            continue
        o = ours.get(owner)
        p = theirs.get(owner)
        results.append({"name": "layer", "label": f"{owner}: {described.get(owner, '')}".strip(),
                        "value": o[0] if o else None, "unit": "s", "better": "lower", "peer": "onnxruntime profiler",
                        "peer_value": p, "ratio": (p / o[0]) if o and p else None,
                        "hot_s": o[1] if o else None, "after_previous_s": o[2] if o else None,
                        "parts": pieces.get(owner, [])})
    sums = [sum(t[j] for t in times) for j in range(3)]
    peer_sum = sum(peer.values())
    results.append({"name": "layers_total", "label": f"{len(times)} launches", "value": sums[0], "unit": "s",
                    "better": "lower", "peer": "onnxruntime profiler", "peer_value": peer_sum,
                    "ratio": peer_sum / sums[0], "hot_s": sums[1], "after_previous_s": sums[2]})

    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    blocks: dict[str, list[float]] = {"morok_py": [], "onnxruntime": []}
    for r in range(a.rounds):
        order = [("morok_py", lambda: ex.run(feeds)), ("onnxruntime", lambda: sess.run(None, feeds))]
        for label, fn in (order if r % 2 == 0 else order[::-1]):
            blocks[label].append(statistics.median(H.block_times(fn, OM.AB_WARM, OM.AB_BLOCK)[1]))
    ours_run, peer_run = statistics.median(blocks["morok_py"]), statistics.median(blocks["onnxruntime"])
    results.append({"name": "replay", "label": "session run, interleaved blocks", "value": ours_run, "unit": "s",
                    "better": "lower", "peer": "onnxruntime", "peer_value": peer_run, "ratio": peer_run / ours_run})

    for r in results:
        o, p = r["value"], r["peer_value"]
        extra = f"  hot {r['hot_s'] * 1e3:7.3f}  after previous {r['after_previous_s'] * 1e3:7.3f}" if r.get("hot_s") else ""
        print(f"{r['label'][:70]:70s} {o * 1e3 if o else float('nan'):8.3f} ms  onnxruntime "
              f"{p * 1e3 if p else float('nan'):8.3f} ms  {r['ratio'] or float('nan'):5.2f}x{extra}", flush=True)

    from morok_py import Device
    doc = {"machine": H.machine(Device["CPU"]), "model": a.model, "rounds": a.rounds, "set": a.set or None,
           "threads": os.environ.get("MOROK_CPU_THREADS"), "cpus": len(os.sched_getaffinity(0)),
           "onnxruntime": ort.__version__, "results": results}
    H.save_result(H.result_name("profile_layers", tag="-".join(p for p in (a.model, a.tag) if p)), doc, a.json)


if __name__ == "__main__":
    main()
