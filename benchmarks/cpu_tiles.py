"""CPU register tiles of a matmul timed side by side with numpy, in interleaved rounds (the CPU
1024^3 target): which (rows x columns) tile a host should default to.

Each shape is compiled under the host's default schedule and under forced tiles (packed panels, the host's
lane width), checked against numpy, then timed in `--rounds` rounds; every round times each variant and
numpy `--reps` times (median), so drift of the machine over the run lands on all of them alike. Reported:
the median over rounds of each variant's round median and its ratio to numpy's, and the same for the best
round (on a shared host other tenants slow whole rounds: round medians of one kernel moved 2x). A tile "RxC" is packed
(B's column panels copied, where the shape allows), "RxCu" the same tile unpacked. `--set MODULE.NAME=VALUE` (;-separated)
adds the host's default schedule compiled with those constants of morok_py's modules set (a heuristic's rule
against its alternative, in the same rounds), labelled by the setting. `--torch` adds torch.mm (where torch is
installed) as a second peer, on MOROK_CPU_THREADS threads or every core.

    OPENBLAS_NUM_THREADS=12 taskset -c 4-15 python benchmarks/cpu_tiles.py --tag 12threads

writes benchmarks/results/<machine kind>/cpu_tiles[-TAG].json (--json PATH: there instead).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("MOROK_CACHE", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from morok_py import Device, dtypes, kernels as K  # noqa: E402
from morok_py.codegen.schedule import Schedule, using  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as H  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1024x1024x1024,256x784x512,1000x751x333")
    ap.add_argument("--tiles", default="8x32,12x32,6x64,4x32,14x32,6x16,12x16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tag", default="", help="appended to the result's name (e.g. the thread count)")
    ap.add_argument("--torch", action="store_true", help="time torch.mm (its CPU threads: MOROK_CPU_THREADS or the "
                                                         "cores) in the same rounds as a second peer, where torch is installed")
    ap.add_argument("--set", default="", help="';'-separated MODULE.NAME=VALUE (e.g. codegen.opt.UNPACKED_SHARE=2.0): "
                                              "the default schedule compiled with those constants set, as one more variant")
    a = ap.parse_args()
    dev = Device["CPU"]
    r, c = dev.renderer, dev.compiler
    lanes = r.caps.tile_lanes
    rng = np.random.default_rng(0)
    torch = H.optional("torch") if a.torch else None
    if torch is not None:
        torch.set_num_threads(int(os.environ.get("MOROK_CPU_THREADS") or os.cpu_count()))
    out = {"cpu": c.arch, "features_tile": r.caps.register_tile, "lanes": lanes, "threads": os.environ.get("MOROK_CPU_THREADS"),
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "shapes": {}}
    for shape in a.shapes.split(","):
        M, N, Kd = (int(x) for x in shape.split("x"))
        x = rng.standard_normal((M, Kd)).astype(np.float32)
        w = rng.standard_normal((Kd, N)).astype(np.float32)
        want = x.astype(np.float64) @ w
        o = np.empty((M, N), np.float32)
        bufs = [dev.buffer(M * Kd, dtypes.float32), dev.buffer(Kd * N, dtypes.float32)]
        bufs[0].copyin(x.reshape(-1))
        bufs[1].copyin(w.reshape(-1))
        res = dev.buffer(M * N, dtypes.float32)
        variants = [("default", None)]
        for setting in filter(None, a.set.split(";")):
            variants.append((setting, setting))
        for t in filter(None, a.tiles.split(",")):
            tr, tc = (int(v) for v in t.split("x"))
            if tc % lanes == 0:
                variants.append((t, Schedule("threads", register_tile=(tr, tc), tile_lanes=lanes, pack=True)))
                variants.append((t + "u", Schedule("threads", register_tile=(tr, tc), tile_lanes=lanes)))
        progs = []
        for label, sched in variants:
            try:
                if isinstance(sched, str):
                    with H.constants(sched):
                        spec = r.render(K.matmul(M, N, Kd), f"mm_set{len(progs)}_{shape}")
                else:
                    with using(sched):
                        spec = r.render(K.matmul(M, N, Kd), f"mm_{label}_{shape}")
                prog = dev.runtime(c.compile(spec))
                prog(*bufs, res)
                err = float(np.max(np.abs(res.numpy().reshape(M, N) - want)) / np.max(np.abs(want)))
                if err > 1e-4:
                    raise AssertionError(f"max relative error {err}")
                progs.append((label, str(spec.linear.schedule), prog))
            except ValueError as e:
                if "packed panels" not in str(e):        # unpacked ("u") variants cover the unpackable shapes
                    print(f"{shape} {label}: ValueError: {str(e)[:200]}", flush=True)
            except Exception as e:  # noqa: BLE001 -- a variant that fails is reported, not fatal
                print(f"{shape} {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)

        def t_numpy():
            t0 = time.perf_counter()
            np.matmul(x, w, out=o)
            return time.perf_counter() - t0

        def timer(prog):
            def run():
                t0 = time.perf_counter()
                prog(*bufs, res)
                return time.perf_counter() - t0
            return run
        peers = ["numpy"]
        fns = [("numpy", t_numpy)]
        if torch is not None:
            tx, tw, to = torch.from_numpy(x), torch.from_numpy(w), torch.empty(M, N)

            def t_torch():
                t0 = time.perf_counter()
                torch.mm(tx, tw, out=to)
                return time.perf_counter() - t0
            peers.append("torch")
            fns.append(("torch", t_torch))
        fns += [(lab, timer(p)) for lab, _, p in progs]
        for _, f in fns:
            for _ in range(3):
                f()
        rounds = {lab: [] for lab, _ in fns}
        order_rng = np.random.default_rng(1)
        for _ in range(a.rounds):
            # each round times the variants in another order: the one timed right after numpy ran slower
            # (512x49x2048 on the 2-vCPU EPYC: 1.73 ms there, 1.10 ms for the same code compiled again and
            # timed next), so no variant keeps that place
            order = [fns[i] for i in order_rng.permutation(len(fns))]
            for lab, f in order:
                if lab not in peers:
                    f()          # untimed: wakes the pool's threads after a peer's turn or the pause below
                rounds[lab].append(statistics.median(f() for _ in range(a.reps)))
                if lab in peers:
                    time.sleep(0.3)      # OpenBLAS's (and OpenMP's) threads spin 0.1-0.2 s after a call, taking cores from ours
        med = {lab: statistics.median(v) for lab, v in rounds.items()}
        rows = []
        for lab, sched, _ in progs:
            best = min(rounds[lab])
            rows.append({"variant": lab, "schedule": sched, "s": med[lab], "vs_numpy": med["numpy"] / med[lab],
                         "best_s": best, "best_vs_numpy": min(rounds["numpy"]) / best,
                         "gflop_s": 2 * M * N * Kd / med[lab] / 1e9, "rounds": rounds[lab]})
            if torch is not None:
                rows[-1]["vs_torch"] = med["torch"] / med[lab]
            print(f"{shape:16s} {lab:8s} {med[lab] * 1e3:8.3f} ms  {med['numpy'] / med[lab]:5.2f}x numpy   best round "
                  f"{best * 1e3:8.3f} ms  {min(rounds['numpy']) / best:5.2f}x   {sched}", flush=True)
        for peer in peers:
            print(f"{shape:16s} {peer:8s} {med[peer] * 1e3:8.3f} ms              best round {min(rounds[peer]) * 1e3:8.3f} ms",
                  flush=True)
        out["shapes"][shape] = {"numpy_s": med["numpy"], "numpy_rounds": rounds["numpy"], "variants": rows}
        if torch is not None:
            out["shapes"][shape].update({"torch_s": med["torch"], "torch_rounds": rounds["torch"], "torch": torch.__version__})
    H.save_result(H.result_name("cpu_tiles", None, a.tag), out, a.json)


if __name__ == "__main__":
    main()
