"""Permutations on the CPU: the default schedule (blocks where strategies/permute.cpu_block_plan takes them) against
the plain walk in the output's order, beside numpy and (where installed) PyTorch, in interleaved rounds.

    python benchmarks/cpu_permute.py [--rounds 9] [--reps 15]

writes benchmarks/results/<machine kind>/cpu_permute.json (--json PATH: there instead).

Each case is a permutation written in the IR (`out = x.transpose(perm)`, float32, static sizes), compiled under the
default schedule and under Schedule("threads") (the plain walk), both checked against numpy; each round times every
variant `--reps` times (median), the peers after a pause (their threads spin on after a call). Reported: the median
over rounds, as bytes read + written per second, and the default's speed-up over the plain walk and over numpy.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("MOROK_CACHE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402
from permute import permuted  # noqa: E402  (benchmarks/permute.py: the GPU cases' IR permutation)

CASES = [  # name, input shape, perm (output axis k is input axis perm[k])
    ("nhwc_to_nchw_56x56x64", (1, 56, 56, 64), (0, 3, 1, 2)),
    ("nhwc_to_nchw_56x56x256", (1, 56, 56, 256), (0, 3, 1, 2)),
    ("nhwc_to_nchw_28x28x128", (1, 28, 28, 128), (0, 3, 1, 2)),
    ("nchw_to_nhwc_64x56x56", (1, 64, 56, 56), (0, 2, 3, 1)),
    ("nchw_to_nhwc_512x7x7", (1, 512, 7, 7), (0, 2, 3, 1)),
    ("transpose_3136x256", (3136, 256), (1, 0)),
    ("transpose_1024x1024", (1024, 1024), (1, 0)),
    ("heads_8x197x12x64", (8, 197, 12, 64), (0, 2, 1, 3)),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from morok_py import Buffer, Device, dtypes
    from morok_py.codegen.schedule import Schedule, using
    dev = Device["CPU"]
    torch = H.optional("torch")
    if torch is not None:
        torch.set_num_threads(int(os.environ.get("MOROK_CPU_THREADS") or os.cpu_count()))
    rng = np.random.default_rng(0)
    results = []
    for name, shape, perm in CASES:
        x = rng.standard_normal(shape).astype(np.float32)
        want = np.ascontiguousarray(x.transpose(perm))
        X, O = Buffer.from_numpy(x, dev), dev.buffer(x.size, dtypes.float32)
        spec = dev.renderer.render(permuted(shape, perm, False), f"perm_{name}")
        default = dev.runtime(dev.compiler.compile(spec))
        with using(Schedule("threads")):
            plain = dev.runtime(dev.compiler.compile(dev.renderer.render(permuted(shape, perm, False), f"perm_plain_{name}")))
        for prog in (default, plain):
            prog(X, O)
            np.testing.assert_array_equal(O.numpy().reshape(want.shape), want, err_msg=name)
        runs = {"default": lambda: default(X, O, wait=True), "plain": lambda: plain(X, O, wait=True),
                "numpy": lambda: np.ascontiguousarray(x.transpose(perm))}
        if torch is not None:
            tx = torch.from_numpy(x)
            runs["torch"] = lambda: tx.permute(*perm).contiguous()
        rounds: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(a.rounds):
            for k, f in runs.items():
                f()
                ts = []
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    f()
                    ts.append(time.perf_counter() - t0)
                rounds[k].append(statistics.median(ts))
                if k in ("numpy", "torch"):
                    time.sleep(0.2)
        med = {k: statistics.median(v) for k, v in rounds.items()}
        moved = 2 * x.nbytes
        rec = {"name": f"cpu_permute_{name}", "shape": list(shape), "perm": list(perm),
               "schedule": str(spec.linear.schedule), "value": med["default"], "unit": "s", "better": "lower",
               "peer": "numpy", "peer_value": med["numpy"], "ratio": med["numpy"] / med["default"],
               "plain_s": med["plain"], "vs_plain": med["plain"] / med["default"], "gb_s": moved / med["default"] / 1e9,
               "rounds_s": rounds}
        if torch is not None:
            rec["torch_s"] = med["torch"]
            rec["vs_torch"] = med["torch"] / med["default"]
        results.append(rec)
        print(f"{name:26s} {med['default'] * 1e6:9.1f} us {rec['gb_s']:6.2f} GB/s  {rec['vs_plain']:5.2f}x plain  "
              f"{rec['ratio']:5.2f}x numpy" + (f"  {rec['vs_torch']:5.2f}x torch" if torch is not None else "")
              + f"   {spec.linear.schedule}", flush=True)
    doc = {"machine": H.machine(dev), "rounds": a.rounds, "reps": a.reps, "results": results}
    H.save_result("cpu_permute", doc, a.json)


if __name__ == "__main__":
    main()
