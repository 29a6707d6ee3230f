"""A chain of pointwise (1x1) convolutions in two activation layouts on the CPU, each a captured plan, beside
onnxruntime's same chain: what keeping a convnet's activations channels-last would change.

    python benchmarks/cpu_layouts.py [--shapes 1024x256x14,2048x512x7,512x128x28] [--repeat 6] [--rounds 15]

writes benchmarks/results/<machine kind>/cpu_layouts.json (--json PATH: there instead).

A shape WIDExNARROWxSIDE is a bottleneck's pair of 1x1 layers at SIDE x SIDE pixels, WIDE -> NARROW -> WIDE, each
with a bias and relu, `--repeat` times in a row (resnet50's 14x14 stage: 1024x256x14, six blocks). Batch 1.
  nchw   what the executor runs today: `kernels.conv_gemm` (output channels the register tile's rows, pixels its
         vector columns) on [C, H*W] activations, the weights [CO, C] as stored;
  nhwc   the same layers on [H*W, C] activations: `kernels.matmul_panels` (pixels the tile's rows, output channels
         its vector columns), the weights laid out once in column panels of the tile's width;
  onnxruntime  the same chain as an ONNX model (Conv + Relu nodes) on its CPU provider, which runs it over
         channel-blocked (NCHWc) tensors.
Every chain is checked against numpy (float64) once, then the three replay in interleaved blocks (harness.block_times:
each block after the process's threads go quiet, 3 untimed runs, `--block` timed), the order reversed every other
round. A record per shape and layout: the median over rounds of the block medians, and onnxruntime's over it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402


def chain_weights(rng, wide: int, narrow: int, repeat: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(w [CO, C], bias [CO]) of each layer, WIDE -> NARROW -> WIDE `repeat` times (scaled to keep values O(1))."""
    out = []
    for _ in range(repeat):
        for c, co in ((wide, narrow), (narrow, wide)):
            out.append(((rng.standard_normal((co, c)) * np.sqrt(2.0 / c)).astype(np.float32),
                        (rng.standard_normal(co) * 0.1).astype(np.float32)))
    return out


def reference(x_chw: np.ndarray, layers) -> np.ndarray:
    h = x_chw.astype(np.float64)
    for w, b in layers:
        h = np.maximum(w.astype(np.float64) @ h + b[:, None], 0)
    return h


def onnx_chain(layers, C: int, side: int) -> bytes:
    from onnx import TensorProto, helper, numpy_helper
    nodes, inits, prev = [], [], "x"
    for i, (w, b) in enumerate(layers):
        inits += [numpy_helper.from_array(w.reshape(w.shape[0], w.shape[1], 1, 1), f"w{i}"),
                  numpy_helper.from_array(b, f"b{i}")]
        nodes += [helper.make_node("Conv", [prev, f"w{i}", f"b{i}"], [f"c{i}"]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        prev = f"r{i}"
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, side, side])],
                          [helper.make_tensor_value_info(prev, TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m.SerializeToString()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1024x256x14,2048x512x7,512x128x28")
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from morok_py import Buffer, Device, ExecutionPlan, dtypes, kernels as K
    dev = Device["CPU"]
    caps = dev.renderer.caps
    if not caps.register_tile or not caps.tile_lanes:
        raise SystemExit("the CPU renderer has no vector register tile: nothing to compare")
    width = caps.register_tile[1]
    ort = H.optional("onnxruntime")
    rng = np.random.default_rng(0)
    relu = K.Epilogue.of("bias", "relu")
    results = []
    for shape in a.shapes.split(","):
        wide, narrow, side = (int(v) for v in shape.split("x"))
        P = side * side
        if wide % width or narrow % width:
            H.note(f"{shape}: channels not a multiple of the tile width {width}: skipped")
            continue
        layers = chain_weights(rng, wide, narrow, a.repeat)
        x = rng.standard_normal((wide, P)).astype(np.float32)
        want = reference(x, layers)
        # NCHW: [C, P] activations, conv_gemm per layer
        acts = [Buffer.from_numpy(x, dev)] + [dev.buffer(w.shape[0] * P, dtypes.float32) for w, _ in layers]
        nchw = ExecutionPlan(dev)
        for i, (w, b) in enumerate(layers):
            prog = dev.compile(K.conv_gemm(1, 1, w.shape[0], w.shape[1], P, epilogue=relu), f"pw_nchw_{w.shape[0]}_{w.shape[1]}_{P}")
            nchw.add(prog, acts[i], Buffer.from_numpy(w, dev), Buffer.from_numpy(b, dev), acts[i + 1])
        # NHWC: [P, C] activations, matmul over column panels per layer
        hx = [Buffer.from_numpy(np.ascontiguousarray(x.T), dev)] + [dev.buffer(w.shape[0] * P, dtypes.float32)
                                                                     for w, _ in layers]
        nhwc = ExecutionPlan(dev)
        for i, (w, b) in enumerate(layers):
            co, c = w.shape
            panels = np.ascontiguousarray(w.T.reshape(c, co // width, width).transpose(1, 0, 2))
            prog = dev.compile(K.matmul_panels(P, co, c, width, epilogue=relu), f"pw_nhwc_{co}_{c}_{P}")
            nhwc.add(prog, hx[i], Buffer.from_numpy(panels, dev), Buffer.from_numpy(b, dev), hx[i + 1])
        nchw.run(wait=True)
        nhwc.run(wait=True)
        got_nchw = acts[-1].numpy().reshape(-1, P)
        got_nhwc = hx[-1].numpy().reshape(P, -1).T
        for label, got in (("nchw", got_nchw), ("nhwc", got_nhwc)):
            np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * float(np.abs(want).max()), err_msg=label)
        runs = {"nchw": lambda p=nchw: p.run(wait=True), "nhwc": lambda p=nhwc: p.run(wait=True)}
        if ort is not None:
            sess = ort.InferenceSession(onnx_chain(layers, wide, side), providers=["CPUExecutionProvider"])
            feed = {"x": x.reshape(1, wide, side, side)}
            np.testing.assert_allclose(sess.run(None, feed)[0].reshape(-1, P), want, rtol=2e-3,
                                       atol=2e-3 * float(np.abs(want).max()), err_msg="onnxruntime")
            runs["onnxruntime"] = lambda s=sess, f=feed: s.run(None, f)
        rounds: dict[str, list[float]] = {k: [] for k in runs}
        order = list(runs)
        for r in range(a.rounds):
            for k in (order if r % 2 == 0 else order[::-1]):
                rounds[k].append(statistics.median(H.block_times(runs[k], 3, a.block)[1]))
        med = {k: statistics.median(v) for k, v in rounds.items()}
        peer = med.get("onnxruntime")
        for k in ("nchw", "nhwc"):
            rec = {"name": f"cpu_layouts_{shape}", "label": k, "shape": shape, "layers": len(layers), "value": med[k],
                   "unit": "s", "better": "lower", "peer": "onnxruntime" if peer else None, "peer_value": peer,
                   "ratio": peer / med[k] if peer else None, "vs_nchw": med["nchw"] / med[k], "rounds_s": rounds[k]}
            results.append(rec)
            print(f"{shape:14s} {k:5s} {med[k] * 1e3:8.3f} ms  {med['nchw'] / med[k]:5.2f}x nchw"
                  + (f"  {peer / med[k]:5.2f}x onnxruntime ({peer * 1e3:.3f} ms)" if peer else ""), flush=True)
    doc = {"machine": H.machine(dev), "width": width, "repeat": a.repeat, "rounds": a.rounds, "block": a.block,
           "results": results}
    H.save_result("cpu_layouts", doc, a.json)


if __name__ == "__main__":
    main()
