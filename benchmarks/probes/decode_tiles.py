"""Float32 decode tiles (32 x 4096 x 4096, benchmarks/decode.py's decode_f32) timed one after another
beside torch's matmul (no TF32) in interleaved rounds: which tile and split the default should take.

    python benchmarks/probes/decode_tiles.py [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import harness as H  # noqa: E402
import decode as D  # noqa: E402
from harness import np  # noqa: E402

TILES = [  # (BM, BN, BK, TM, TN), group, split_k
    ((32, 32, 64, 4, 2), 128, 4), ((32, 128, 64, 4, 8), 128, 8), ((32, 64, 64, 4, 4), 128, 2),
]


def main() -> None:
    from morok_py.codegen.schedule import Schedule
    p = argparse.ArgumentParser()
    p.add_argument("--json", default="")
    p.add_argument("--device", default="CUDA")
    args = p.parse_args()
    dev = H.open_device(args.device)
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    case = D.make_case("decode_f32", np.random.default_rng(0), False)
    tin = [torch.from_numpy(np.asarray(x, np.float32)).cuda() for x in case.inputs]
    timer = H.event_timer("torch", torch)
    progs = [("default", D.Ours(dev, case))]
    for tile, group, split in TILES:
        s = Schedule("tiled", group=group, matmul_tile=tile, async_fill=True, split_k=split)
        try:
            o = D.Ours(dev, case, s)
            o()
            D.check(str(s), o.result(), case.reference, case.rtol, case.atol)
        except (SystemExit, Exception) as e:     # noqa: BLE001 -- a schedule the kernel does not take
            print(f"{s}: {type(e).__name__}: {str(e)[:160]}")
            continue
        progs.append((str(s), o))
    fns = [(k, o) for k, o in progs] + [("torch", lambda: timer(lambda: torch.matmul(*tin)))]
    rounds = H.interleaved(fns, 3, 20, 3)
    med = {k: statistics.median(v) for k, v in rounds.items()}
    rows = []
    for k, t in sorted(med.items(), key=lambda kv: kv[1]):
        rows.append(dict(schedule=k, us=t * 1e6, vs_torch=med["torch"] / t))
        print(f"{t * 1e6:8.2f} us  {med['torch'] / t:.3f}x torch  {k}")
    print("default schedule:", dev.renderer.render(case.ast, "s").linear.schedule)
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
