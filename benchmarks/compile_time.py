"""Compile time per kernel and compiler pair, with no hardware: every named kernel rendered and
compiled on each pair the machine can run (CPU: llvm, mlir; CUDA sm_90: nvrtc, llvm-nvptx, mlir;
ROCm gfx90a: llvm-amdgpu, hiprtc, mlir). Each pair is warmed up on one kernel first (library loads
and LLVM initialization are paid once per process, not per kernel); the time is the best of
`--repeat` compiles, the pairs taking turns (no disk cache involved: `Compiler.compile` is called directly).

    python benchmarks/compile_time.py [--repeat 3] [--no-save]

writes benchmarks/results/<machine kind>/compile_time.json (--json PATH: there instead).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from morok_py import kernels as K  # noqa: E402
from morok_py.cli import compile_only_pairs  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as H  # noqa: E402


def targets() -> list[tuple[str, str]]:
    return [("CPU", ""), ("CUDA", "sm_90"), ("ROCM", "gfx90a")]


def measure(repeat: int) -> dict:
    """{"DEVICE/pair": {kernel: ms}}; the pairs of a device take turns kernel by kernel, round by round,
    so that load from other work on the machine falls on all of them alike."""
    out: dict = {}
    for device, arch in targets():
        usable = []
        for r, c in compile_only_pairs(device, arch or None):
            why = c.available()
            key = f"{device}/{c.cache_key}"
            if why is not None:
                out[key] = {"unavailable": why}
                continue
            c.compile(r.render(K.named("add"), name="warmup"))
            usable.append((key, r, c))
            out[key] = {}
        for name in K.NAMED:
            specs = {key: r.render(K.named(name), name=name) for key, r, _ in usable}
            for _ in range(repeat):
                for key, _, c in usable:
                    t = time.perf_counter()
                    c.compile(specs[key])
                    ms = (time.perf_counter() - t) * 1e3
                    out[key][name] = round(min(out[key].get(name, ms), ms), 2)
    return out


def table(res: dict) -> str:
    keys = [k for k in res if "unavailable" not in res[k]]
    lines = ["| kernel | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    for name in K.NAMED:
        lines.append(f"| {name} | " + " | ".join(f"{res[k][name]:.1f}" for k in keys) + " |")
    lines.append("| **total** | " + " | ".join(f"**{sum(res[k].values()):.0f}**" for k in keys) + " |")
    for k in res:
        if "unavailable" in res[k]:
            lines.append(f"\n{k}: unavailable ({res[k]['unavailable']})")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default="")
    ap.add_argument("--no-save", action="store_true", help="print only")
    args = ap.parse_args()
    res = measure(args.repeat)
    print(f"compile time per kernel in ms (best of {args.repeat}), {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs")
    print(table(res))
    doc = {"unit": "ms", "repeat": args.repeat, "results": res}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    elif not args.no_save:
        H.write_result("compile_time", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
