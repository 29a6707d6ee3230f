"""Run an ONNX model through morok_py and print its outputs and a per-kernel compile/run table.

    python -m morok_py.onnx.run MODEL.onnx [--device CPU|CUDA|CUDA:1|ROCM] [--compiler nvrtc|llvm-nvptx]
                                [--input NAME=file.npy ...] [--runs 3]

Inputs not given are generated the way ONNX's own backend runner feeds its model tests
(`generate_dummy_data`: arange(n)/n as float32, dims without a value taken as 1).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import onnx

from morok_py.onnx.executor import OnnxExecutor


def dummy_input(vi: onnx.ValueInfoProto) -> np.ndarray:
    """ONNX's runner (onnx/backend/test/runner: generate_dummy_data, random=False)."""
    shape = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in vi.type.tensor_type.shape.dim)
    n = int(np.prod(shape))
    return (np.arange(n).reshape(shape) / n).astype(np.float32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", default=None, help="CPU (default: MOROK_DEVICE), CUDA, CUDA:1, ROCM")
    ap.add_argument("--compiler", default=None, help="compiler pair key, e.g. nvrtc or llvm-nvptx")
    ap.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    ap.add_argument("--runs", type=int, default=3, help="warm replays to time (default 3)")
    ap.add_argument("--top", type=int, default=40, help="rows of the kernel table (default 40; 0 = all)")
    args = ap.parse_args(argv)

    model = onnx.load(args.model)
    t0 = time.perf_counter()
    ex = OnnxExecutor(model, args.device, compiler=args.compiler, profile=True)
    load_s = time.perf_counter() - t0
    given = dict(s.split("=", 1) for s in args.input)
    feeds = {}
    for vi in model.graph.input:
        if vi.name in ex.input_names:
            feeds[vi.name] = np.load(given[vi.name]) if vi.name in given else dummy_input(vi)

    t0 = time.perf_counter()
    outs = ex.run(feeds)
    first_s = time.perf_counter() - t0
    warm = []
    for _ in range(args.runs):
        ex.run(feeds)
        warm.append(ex.last_run_s)

    print(f"model {os.path.basename(args.model)} on {ex.dev.name} ({ex.k.compiler or ex.dev.compiler.cache_key}), "
          f"opset {ex.opset}, {len(model.graph.node)} nodes")
    print(f"load (weights uploaded) {load_s:.3f} s; first run {first_s:.3f} s of which compile {ex.k.compile_s:.3f} s "
          f"({len(ex.k.programs)} programs for {len(ex.k.stats)} launches); "
          + (f"warm replay (ExecutionPlan) best {min(warm) * 1e3:.2f} ms" if warm else ""))
    for o, v in zip(model.graph.output, outs):
        v = np.asarray(v)
        desc = f"min {v.min():.6g} max {v.max():.6g} mean {v.astype(np.float64).mean():.6g}" if v.size and v.dtype.kind in "fiub" else ""
        print(f"output {o.name}: {v.dtype}{list(v.shape)} {desc}"
              + (f" argmax {int(v.reshape(v.shape[0], -1).argmax(1)[0])}" if v.ndim == 2 and v.dtype.kind == "f" else ""))
    rows = sorted(ex.k.stats, key=lambda s: -(s.compile_s + s.run_s))
    if args.top:
        rows = rows[:args.top]
    print(f"\n{'kernel (node)':48} {'program':32} {'compile ms':>10} {'run ms':>9}")
    for s in rows:
        prog = "(same)" if s.program == s.node else s.program
        print(f"{s.node[:48]:48} {prog[:32]:32} {s.compile_s * 1e3:10.2f} {s.run_s * 1e3:9.3f}"
              + ("  cached" if s.cached else ""))
    tot_run = sum(s.run_s for s in ex.k.stats)
    print(f"{'total':48} {'':32} {ex.k.compile_s * 1e3:10.2f} {tot_run * 1e3:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
