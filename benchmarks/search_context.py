"""Why a search's winner can lose in the benchmark: two schedules of one kernel timed under different
loads, in one process (the H100's static 4096^3 float32 matmul on nvrtc: a search that timed candidates
before the default kept the register fill, which the benchmark times 1.7% slower than the default cp.async fill).

Modes, each interleaving the two programs in rounds (CUDA events through Program.execute):
  search   blocks of search.REPEATS runs back to back, nothing else on the GPU (what time_schedules does)
  bench    blocks of 7 runs, each round also running torch's matmul 7 times (what kernels.py --rounds does)
  long     blocks of 30 runs, nothing else
then the search itself (cache.beam_search, 4 candidates) with its own timings. With --smi, nvidia-smi samples
the SM clock and power every 50 ms into the log, with the mode boundaries marked.

    MOROK_CUDA_COMPILER=nvrtc python benchmarks/search_context.py --case matmul

writes benchmarks/results/<machine kind>/search_context-<case>-<pair>.json (--json PATH: there instead).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ["MOROK_CACHE"] = "0"

import harness as H  # noqa: E402
from harness import np  # noqa: E402
import kernels as KB  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--case", default="matmul")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--smi", default=None, help="file for nvidia-smi samples")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from dataclasses import replace
    from morok_py import Buffer, cache, dtypes
    from morok_py import search as S
    from morok_py.registry import get_device
    dev = get_device("CUDA")
    import torch
    rng = np.random.default_rng(0)
    case = KB.make_case(a.case, argparse.Namespace(symbolic=False, quick=False, n=None), True, rng)
    want = case.reference(*case.inputs)
    default = dev.renderer.render(case.ast, "s").linear.schedule
    scheds = {"default": default, "flipped": replace(default, async_fill=not default.async_fill)}
    progs = {}
    for label, sched in scheds.items():
        compiled = cache.compile_ast(dev.renderer, dev.compiler, case.ast, f"ctx_{label}", sched)
        ours = KB.Ours.__new__(KB.Ours)
        ours.dev, ours.prog = dev, dev.runtime(compiled)
        ours.bufs = [Buffer.from_numpy(np.ascontiguousarray(x).reshape(-1), dev) for x in case.inputs]
        ours.out = dev.buffer(int(np.prod(case.out_shape)), dtypes.float32)
        ours.gs, ours.ls = compiled.launch.launch_dims({})
        ours.vals, ours.ptrs = [], [b.ptr for b in ours.bufs] + [ours.out.ptr]
        ours()
        H.check_close(f"{a.case} {label}", ours.result(), want, case.rtol, case.atol)
        progs[label] = ours
    peers = KB.gpu_peers(case, {"torch": torch})
    trun = peers["torch"][0]
    smi = None
    if a.smi:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                                "--format=csv,noheader", "-lms", "50"], stdout=open(a.smi, "w"))
    marks = []
    out = {"case": a.case, "schedules": {k: str(v) for k, v in scheds.items()}, "modes": {}}

    def mode(name: str, block: int, with_torch: bool) -> None:
        marks.append((name, time.time()))
        for lab in progs:                      # warm, as the search does
            for _ in range(10):
                progs[lab]()
        rounds = {lab: [] for lab in progs}
        for r in range(a.rounds):
            order = list(progs) if r % 2 == 0 else list(progs)[::-1]
            for lab in order:
                rounds[lab].append(statistics.median(progs[lab]() for _ in range(block)))
            if with_torch:
                statistics.median(trun() for _ in range(block))
        row = {lab: {"min_round_us": min(v) * 1e6, "median_round_us": statistics.median(v) * 1e6,
                     "rounds_us": [x * 1e6 for x in v]} for lab, v in rounds.items()}
        row["flipped_over_default_min"] = min(rounds["flipped"]) / min(rounds["default"])
        row["flipped_over_default_median"] = statistics.median(rounds["flipped"]) / statistics.median(rounds["default"])
        out["modes"][name] = row
        print(f"{name:7s} block {block:2d} torch {with_torch!s:5s}  default {row['default']['median_round_us']:8.1f} us "
              f"(best {row['default']['min_round_us']:8.1f})  flipped {row['flipped']['median_round_us']:8.1f} "
              f"(best {row['flipped']['min_round_us']:8.1f})  flipped/default median {row['flipped_over_default_median']:.4f} "
              f"best {row['flipped_over_default_min']:.4f}", flush=True)

    mode("search", S.REPEATS, False)
    mode("bench", 7, True)
    mode("long", 30, False)
    mode("search2", S.REPEATS, False)
    marks.append(("beam", time.time()))
    os.environ["MOROK_CACHE_DIR"] = tempfile.mkdtemp()
    os.environ["MOROK_CACHE"] = "1"
    found = cache.beam_search(dev, case.ast, "ctx_beam", beam=4, seconds=8)
    out["search"] = {"chosen": str(found.schedule), "times_us": {k: v * 1e6 for k, v in found.times.items()}}
    print("search chose", found.schedule)
    for k, v in found.times.items():
        print(f"   {v * 1e6:9.1f} us  {k}")
    marks.append(("end", time.time()))
    out["marks"] = marks
    if smi is not None:
        smi.terminate()
    H.save_result(H.result_name("search_context", dev, a.case), out, a.json, dev)


if __name__ == "__main__":
    sys.exit(main())
