"""CPU launch overhead: one launch of a small cached kernel against a bare ctypes call of the
same function pointer with the same arguments.

    python benchmarks/cpu_launch.py [--quick]

(`benchmarks/launch.py` measures the same on CUDA against a bare cuLaunchKernel.)

Measured per launch, as the mean over a loop of calls, median over repeats:
- bare ctypes: `CFUNCTYPE(None, void* x3, int32 x3)(program.address)(a, b, c, n, 0, n)`
- `Program.execute(ptrs, vals, gs, ls)`: the raw path (target: <= 3x the bare call)
- `Program.__call__(a, b, c, n=n)`: the friendly path, with its launch checks (target: <= 2x the bare call)
- `ExecutionPlan.run()`: per launch, a plan of many launches replayed
- `InferenceSession.run` of a tiny ONNX model (Gemm 1x16x16 + Softmax) through morok_py.onnx, against
  onnxruntime's (where onnx and onnxruntime are installed): a graph executor's fixed cost per run
"""
from __future__ import annotations

import ctypes
import statistics
import time

import harness as H
from harness import np

TARGET = 3.0          # Program.execute / bare
CALL_TARGET = 2.0     # Program.__call__ / bare


def per_call(fn, calls: int, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def tiny_sessions(rng):
    """(morok_py's session.run, onnxruntime's) of a Gemm 1x16x16 + Softmax model, each checked against the other;
    None where onnx or onnxruntime is missing."""
    onnx, ort = H.optional("onnx"), H.optional("onnxruntime")
    if onnx is None or ort is None:
        return None
    from onnx import TensorProto, helper, numpy_helper
    from morok_py.onnx import InferenceSession
    w = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b")
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "w", "b"], ["h"], transB=1),
                               helper.make_node("Softmax", ["h"], ["y"], axis=-1)], "tiny",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])], [w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8        # what older onnxruntime wheels read
    data = model.SerializeToString()
    feeds = {"x": rng.standard_normal((1, 16)).astype(np.float32)}
    ours = InferenceSession(data)
    peer = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    H.check_close("tiny ONNX model", ours.run(None, feeds)[0], peer.run(None, feeds)[0])
    for _ in range(3):      # the plan recorded, then captured
        ours.run(None, feeds)
    return (lambda: ours.run(None, feeds)), (lambda: peer.run(None, feeds))


def main() -> None:
    p = H.parser(__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=16, help="elements of the tiny add")
    p.add_argument("--calls", type=int, default=20000, help="launches per timed loop")
    args = p.parse_args()
    if args.device.upper() != "CPU":
        raise SystemExit("cpu_launch.py measures the CPU device; use benchmarks/launch.py for CUDA")
    if args.quick:
        args.calls, args.repeats = 2000, 3
    args.repeats = max(args.repeats, 3)
    from morok_py import Buffer, ExecutionPlan
    from morok_py import kernels as K

    dev = H.open_device("CPU", args.wait_quiet)
    mach = H.machine(dev)
    res = H.Results("cpu_launch", dev, args)
    n = args.n
    rng = np.random.default_rng(0)
    a, b = (Buffer.from_numpy(rng.standard_normal(n).astype(np.float32), dev) for _ in range(2))
    c = dev.buffer(n, a.dtype)
    prog = dev.compile(K.add(), name="bench_launch_add")
    info = prog.launch
    gs, ls = info.launch_dims({"n": n})
    ptrs, vals = [a.ptr, b.ptr, c.ptr], [n]
    prog(a, b, c, n=n)
    H.check_close("tiny add", c.numpy(), a.numpy() + b.numpy())

    # the CPU ABI: buffers, variables, then the [start, end) of the outer parallel range
    proto = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * 3 + [ctypes.c_int32] * 3))
    bare = proto(prog.address)
    extent = gs[0]
    pa, pb, pc = ptrs
    plan_len = 100
    plan = ExecutionPlan(dev)
    for _ in range(plan_len):
        plan.add(prog, a, b, c, n=n)
    plan.run()

    cases = [
        ("bare ctypes call", lambda: bare(pa, pb, pc, n, 0, extent), 1),
        ("Program.execute", lambda: prog.execute(ptrs, vals, gs, ls), 1),
        ("Program.__call__", lambda: prog(a, b, c, n=n), 1),
        ("ExecutionPlan.run (per launch)", plan.run, plan_len),
    ]
    sessions = tiny_sessions(rng)
    if sessions is not None:
        ours, peer = sessions
        cases += [("InferenceSession.run", ours, 1), ("onnxruntime", peer, 1)]
    # interleaved rounds: each repeat times every case once, so drifting load hits all of them alike
    bar = H.Progress(args.repeats, "cpu launch")
    samples: dict[str, list[float]] = {label: [] for label, _, _ in cases}
    for _ in range(args.repeats):
        bar.step("round")
        for label, fn, per in cases:
            samples[label].append(per_call(fn, max(1, args.calls // per), 1) / per)
        bar.advance()
    bar.close()
    times = {label: statistics.median(v) for label, v in samples.items()}
    t_bare = times["bare ctypes call"]
    common = {"kernel": "add", "n": n}
    res.add("cpu_launch_bare_ctypes", n, "s", t_bare, label="bare ctypes", **common)
    for label, key, tgt in (("Program.execute", "cpu_launch_execute", 1 / TARGET),
                            ("Program.__call__", "cpu_launch_call", 1 / CALL_TARGET),
                            ("ExecutionPlan.run (per launch)", "cpu_launch_plan", None)):
        res.add(key, n, "s", times[label], "bare ctypes", t_bare, target=tgt, label=label,
                over_bare=times[label] / t_bare, **common)
    if sessions is not None:
        res.add("cpu_launch_onnx_session", 16, "s", times["InferenceSession.run"], "onnxruntime", times["onnxruntime"],
                label="InferenceSession.run, Gemm 1x16x16 + Softmax", model="gemm_softmax_16")
    limits = {"Program.execute": TARGET, "Program.__call__": CALL_TARGET}
    rows = [[label, H.fmt_time(t), f"{t / t_bare:.2f}x",
             ("met" if t / t_bare <= limits[label] else "MISSED") + f" (<= {limits[label]:g}x)" if label in limits else ""]
            for label, t in times.items()]
    H.table(rows, ["launch of a cached add (n=%d)" % n, "per launch", "vs bare ctypes", "target"],
            f"\nCPU launch overhead on {mach['model']} (a kernel this small runs on the calling thread)")
    res.save()


if __name__ == "__main__":
    main()
