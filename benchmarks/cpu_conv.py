"""CPU convolutions, one ONNX node each, through morok_py.onnx beside onnxruntime's CPU provider in the
same process: depthwise 3x3 (stride 1 and 2) and 5x5, pointwise 1x1, dense 3x3, grouped 3x3 and the
strided stems, at batch 8 with MobileNetV2 and ResNet channel counts (NCHW float32, bias, 'same' pads).

    python benchmarks/cpu_conv.py [--cases depthwise,pointwise] [--rounds 5] [--repeats 7] [--quick]

writes benchmarks/results/<machine kind>/cpu_conv[-TAG].json (--json PATH: there instead).

Each case is a model of one Conv node (weights and bias as initializers). morok_py runs it through
`morok_py.onnx.InferenceSession` (the first run compiles and records the plan; the timed runs replay it
as a client does: on the CPU the kernels read the input array and write a fresh output array, no copies,
MOROK_ONNX_ZERO_COPY); onnxruntime through its InferenceSession with
the default options. The two are timed in interleaved rounds (harness.interleaved): each round runs a
block of `--repeats` of one, then of the other, after a pause while the other's worker threads stop
spinning; a record keeps the median over rounds of each side's round median (value, peer_value, in
seconds), the ratio onnxruntime / morok_py (higher is better), every round and the plan morok_py's
heuristic chose (codegen/strategies/conv.py). `kernels_s` times, in the same rounds, the plan the
executor recorded replayed alone on its own buffers: the kernels without the session's work around them
(with MOROK_ONNX_ZERO_COPY=0, copies of 2.4 MB each way at 8x96x28x28), and `kernels_ratio`
is onnxruntime's whole run over that. Outputs are checked against onnxruntime's first.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import harness as H
from harness import np

# after a block of one runtime, before the other's, the process's threads go quiet (harness.settle):
# onnxruntime spins its intra-op threads after each run (up to about 0.15 s on a 16-core Xeon);
# morok_py's workers wait on a futex after a short spin
RTOL, ATOL = 1e-3, 1e-4


@dataclass(frozen=True)
class Case:
    """One Conv node: input [N, C, H, W], CO output channels, a k x k kernel, `stride`, 'same'-style
    pads of k // 2 and `group` groups."""

    name: str
    C: int
    H: int
    CO: int
    k: int
    stride: int = 1
    group: int = 1
    batch: int = 8

    @property
    def out_hw(self) -> int:
        return (self.H + 2 * (self.k // 2) - self.k) // self.stride + 1

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.CO * self.out_hw ** 2 * (self.C // self.group) * self.k * self.k


CASES = [
    # MobileNetV2 / V3
    Case("conv_stem3x3s2_3to16_112", 3, 112, 16, 3, 2),
    Case("conv_depthwise3x3s1_16_56", 16, 56, 16, 3, 1, 16),
    Case("conv_depthwise3x3s1_96_28", 96, 28, 96, 3, 1, 96),
    Case("conv_depthwise3x3s1_384_14", 384, 14, 384, 3, 1, 384),
    Case("conv_depthwise3x3s2_72_56", 72, 56, 72, 3, 2, 72),
    Case("conv_depthwise3x3s2_144_56", 144, 56, 144, 3, 2, 144),
    Case("conv_depthwise5x5s1_120_28", 120, 28, 120, 5, 1, 120),
    Case("conv_pointwise_16to24_56", 16, 56, 24, 1),
    Case("conv_pointwise_24to72_56", 24, 56, 72, 1),
    Case("conv_pointwise_72to32_28", 72, 28, 32, 1),
    Case("conv_pointwise_32to128_28", 32, 28, 128, 1),
    Case("conv_pointwise_96to32_28", 96, 28, 32, 1),
    Case("conv_pointwise_320to1280_7", 320, 7, 1280, 1),
    # ResNet / ResNeXt
    Case("conv_stem7x7s2_3to64_224", 3, 224, 64, 7, 2),
    Case("conv_pointwise_256to64_56", 256, 56, 64, 1),
    Case("conv_pointwise_64to256_56", 64, 56, 256, 1),
    Case("conv_dense3x3_64_56", 64, 56, 64, 3),
    Case("conv_dense3x3_128_28", 128, 28, 128, 3),
    Case("conv_dense3x3s2_128_56", 128, 56, 128, 3, 2),
    Case("conv_grouped3x3_128g32_28", 128, 28, 128, 3, 1, 32),
    # resnet50's layers at batch 1 (benchmarks/onnx_models.py's light model): the contractions its replay spends
    # the most time in beside onnxruntime's
    Case("conv_resnet50_3x3s2_128_56_b1", 128, 56, 128, 3, 2, batch=1),
    Case("conv_resnet50_3x3s2_256_28_b1", 256, 28, 256, 3, 2, batch=1),
    Case("conv_resnet50_3x3_512_7_b1", 512, 7, 512, 3, batch=1),
    Case("conv_resnet50_3x3s2_512_14_b1", 512, 14, 512, 3, 2, batch=1),
    Case("conv_densenet121_3x3_128to32_7_b1", 128, 7, 32, 3, batch=1),
    Case("conv_resnet50_pointwise_512to128_28_b1", 512, 28, 128, 1, batch=1),
    Case("conv_resnet50_pointwise_1024to256_14_b1", 1024, 14, 256, 1, batch=1),
    Case("conv_resnet50_pointwise_256to1024_14_b1", 256, 14, 1024, 1, batch=1),
    Case("conv_resnet50_pointwise_2048to512_7_b1", 2048, 7, 512, 1, batch=1),
]
QUICK = ("conv_depthwise3x3s1_96_28", "conv_pointwise_24to72_56", "conv_stem3x3s2_3to16_112", "conv_grouped3x3_128g32_28")


def conv_model(case: Case, seed: int = 0):
    """(the one-node ONNX model, its input)."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(seed)
    cg = case.C // case.group
    w = (rng.standard_normal((case.CO, cg, case.k, case.k)) * (2.0 / (cg * case.k * case.k)) ** 0.5).astype(np.float32)
    b = rng.uniform(-0.2, 0.2, case.CO).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[case.k, case.k],
                            strides=[case.stride, case.stride], pads=[case.k // 2] * 4, group=case.group)
    o = case.out_hw
    graph = helper.make_graph(
        [node], case.name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [case.batch, case.C, case.H, case.H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [case.batch, case.CO, o, o])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    x = rng.standard_normal((case.batch, case.C, case.H, case.H)).astype(np.float32)
    return model, x


def plan_of(case: Case, caps) -> str:
    """The plan morok_py's heuristic takes for this node (what MOROK_DEBUG=1 prints)."""
    from morok_py.codegen.strategies.conv import ConvGeometry, conv_plan
    p = case.k // 2
    geo = ConvGeometry(case.batch, case.C, case.H, case.H, case.CO, case.k, case.k, (case.stride,) * 2, (1, 1),
                       (p, p, p, p), case.group)
    return str(conv_plan(geo, caps))


def _recorded_plan(session):
    """The ExecutionPlan morok_py's executor recorded at the first run (its kernels alone, without the
    session's input and output copies), or None where the executor keeps none."""
    plans = getattr(session.executor, "plans", None) or {}
    for entry in plans.values():
        plan = entry[0] if isinstance(entry, tuple) else entry
        if hasattr(plan, "run"):
            return plan
    return None


def main() -> None:
    p = H.parser(__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="", help="comma-separated substrings of case names (default: all)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each: a block of each runtime)")
    p.add_argument("--json", default=None, help="write the result here instead of benchmarks/results/")
    args = p.parse_args()
    try:
        import onnxruntime as ort
    except ImportError:
        raise SystemExit("cpu_conv.py compares with onnxruntime: pip install onnxruntime") from None
    from morok_py.onnx import InferenceSession

    dev = H.open_device("CPU", args.wait_quiet)
    caps = dev.renderer.caps
    res = H.Results("cpu_conv", dev, args)
    want = [s for s in args.cases.split(",") if s]
    cases = [c for c in CASES if (not want or any(s in c.name for s in want))
             and (not args.quick or c.name in QUICK)]
    rounds, repeats = (2, 3) if args.quick else (args.rounds, args.repeats)
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    rows = []

    def pause(label: str, prev: str | None) -> None:
        if prev is not None and prev != label:
            H.settle()

    for case in cases:
        model, x = conv_model(case)
        ours = InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        t0 = time.perf_counter()
        got = ours.run(None, {"x": x})[0]
        first_s = time.perf_counter() - t0
        ref = theirs.run(None, {"x": x})[0]
        err = float(np.abs(got.astype(np.float64) - ref).max())
        ok = bool(np.allclose(got, ref, rtol=RTOL, atol=ATOL))
        feeds = {"x": x}
        fns = [("onnxruntime", lambda: theirs.run(None, feeds)), ("morok_py", lambda: ours.run(None, feeds))]
        recorded = _recorded_plan(ours)
        if recorded is not None:
            fns.append(("morok_py kernels", recorded.run))
        out = H.interleaved(fns, rounds=rounds, repeats=repeats, warmup=args.warmup, before=pause)
        mine, peer = statistics.median(out["morok_py"]), statistics.median(out["onnxruntime"])
        kernels_s = statistics.median(out["morok_py kernels"]) if recorded is not None else None
        plan = plan_of(case, caps)
        rec = res.add(case.name, case.flops, "s", mine, "onnxruntime", peer, flops=case.flops,
                      gflops=case.flops / mine / 1e9, peer_gflops=case.flops / peer / 1e9, plan=plan,
                      kernels_s=kernels_s, kernels_rounds=out.get("morok_py kernels"),
                      kernels_ratio=peer / kernels_s if kernels_s else None,
                      geometry={"N": case.batch, "C": case.C, "H": case.H, "W": case.H, "CO": case.CO,
                                "kernel": case.k, "stride": case.stride, "pad": case.k // 2, "group": case.group},
                      first_run_s=first_s, max_abs_diff_vs_onnxruntime=err, matches_onnxruntime=ok,
                      **H.round_summary(out["morok_py"], out["onnxruntime"]))
        rows.append([case.name, H.fmt_time(mine), "-" if kernels_s is None else H.fmt_time(kernels_s),
                     H.fmt_time(peer), f"{rec['ratio']:.2f}x",
                     "-" if kernels_s is None else f"{rec['kernels_ratio']:.2f}x",
                     f"{rec['gflops']:.0f}", plan.replace("ConvPlan(", "").rstrip(")"), "ok" if ok else f"DIFF {err:.1e}"])
        del ours, theirs
    H.table(rows, ["case (NCHW float32, batch 8 or _b1: 1)", "morok_py", "its kernels", "onnxruntime", "ratio", "kernels' ratio", "GFLOP/s", "plan", "check"],
            title=f"CPU convolutions, interleaved ({rounds} rounds of {repeats}; ratio = onnxruntime / morok_py, higher is better)")
    doc_extra = {"threads": os.environ.get("MOROK_CPU_THREADS"), "cpus": len(os.sched_getaffinity(0))
                 if hasattr(os, "sched_getaffinity") else os.cpu_count(), "onnxruntime": ort.__version__,
                 "rounds": rounds, "repeats": repeats, "load_average_start": load_start,
                 "load_average_end": os.getloadavg() if hasattr(os, "getloadavg") else None}
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"machine": H.machine(dev), **doc_extra, "results": res.records}, indent=1,
                                   default=str) + "\n")
        H.note(f"wrote {path}")
    elif not (args.no_save or args.quick):
        mach = H.machine(dev)
        for r in res.records:
            r.setdefault("git", mach["git"])
        H.write_result(H.result_name("cpu_conv", dev, "", args.tag), {"machine": mach, **doc_extra,
                                                                     "results": res.records}, dev)


if __name__ == "__main__":
    sys.exit(main())
