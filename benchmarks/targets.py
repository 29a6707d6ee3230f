"""Print a result file's targets as a markdown table: each measured, met or missed.

    python benchmarks/targets.py benchmarks/results/nvidia-h100/kernels-nvrtc.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import harness as H


def rows(doc: dict) -> list[list[str]]:
    out = []
    for r in doc["results"]:
        tgt = r.get("target")
        if tgt is None or r.get("ratio") is None:
            continue
        ratio = r["ratio"]
        if r["name"].startswith(("cpu_launch", "cuda_launch")):   # ratio = bare / ours; the target reads "<= 3x bare"
            need, got = f"<= {1 / tgt:.3g}x {r['peer']}", f"{1 / ratio:.2f}x bare ({H.fmt_time(r['value'])})"
        elif str(r.get("peer", "")).startswith("target"):   # absolute time targets
            need, got = f"<= {H.fmt_time(r['peer_value'])}", H.fmt_time(r["value"])
        else:
            need, got = f">= {tgt:g}x {r['peer']}", f"{ratio:.2f}x ({H.fmt_value(r['value'], r['unit'])} vs " \
                                                   f"{H.fmt_value(r['peer_value'], r['unit'])})"
        out.append([f"{r['name']} {r.get('label', r['size'])}", need, got, "met" if ratio >= tgt else "**missed**"])
    return out


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    doc = json.loads(Path(sys.argv[1]).read_text())
    m = doc.get("machine", {})
    print(f"{m.get('device')} on {m.get('model')} ({m.get('cores')} cores), {m.get('date')}, git {m.get('git')}\n")
    print("| benchmark | target | measured | |\n|---|---|---|---|")
    for r in rows(doc):
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
