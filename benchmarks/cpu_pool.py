"""How the CPU's native pool deals a split launch's chunks (backends/cpu/pool.py): each thread's home block first,
against one shared counter in arrival order, on whole models replayed as a client replays them.

    python benchmarks/cpu_pool.py [--models resnet50,densenet121,mobilenet_stack,mlp] [--rounds 15] [--repeats 7]

writes benchmarks/results/<machine kind>/cpu_pool[-TAG].json.

Each model of benchmarks/onnx_models.py (the onnx wheel's light resnet50 and densenet121, the MobileNet-style
stack and the MLP, the same inputs) goes through morok_py.onnx's executor once; its recorded plan is captured
(one native call a replay). The same captured plans then replay under both dealings in interleaved rounds:
each round sets the dealing (`NativePool.set_home`), runs 3 untimed replays and times `--repeats`, the order
of the two alternating from round to round. A record keeps the median over rounds of each dealing's round
median (value: home blocks, peer_value: one counter, seconds) and their ratio (higher: home blocks faster).
Every replay's output is checked against the first.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness as H
from harness import np

os.environ.setdefault("MOROK_CACHE", "0")


def main() -> None:
    p = H.parser(__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet50,densenet121,mobilenet_stack,mlp")
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import onnx_models as OM
    from morok_py.backends.cpu import pool as native
    from morok_py.onnx import OnnxExecutor
    dev = H.open_device("CPU")
    res = H.Results("cpu_pool", dev, a)
    for name in a.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            path, feeds_path, _ = OM.prepare(name, Path(tmp), a.repeats)
            feeds = dict(np.load(feeds_path))
            ex = OnnxExecutor(str(path), dev)
            for _ in range(12):             # records the plan, then captures it
                first = [o.copy() for o in ex.run(feeds)]
        pool = native._pool
        if pool is None:
            raise SystemExit(f"no native CPU pool: {native.native_pool_error()}")
        times: dict[bool, list[float]] = {True: [], False: []}
        try:
            for r in range(a.rounds):
                for home in ((True, False) if r % 2 == 0 else (False, True)):
                    pool.set_home(home)
                    for _ in range(3):
                        ex.run(feeds)
                    block = []
                    for _ in range(a.repeats):
                        t0 = time.perf_counter()
                        out = ex.run(feeds)
                        block.append(time.perf_counter() - t0)
                    for o, f in zip(out, first):
                        np.testing.assert_allclose(o, f, rtol=1e-5, atol=1e-6)
                    times[home].append(statistics.median(block))
        finally:
            pool.set_home(True)
        home, shared = statistics.median(times[True]), statistics.median(times[False])
        print(f"{name:16s} home blocks {home * 1e3:8.3f} ms   one counter {shared * 1e3:8.3f} ms   "
              f"{shared / home:5.2f}x", flush=True)
        res.add(f"pool_home_blocks_{name}", 1, "s", home, peer="one shared counter", peer_value=shared,
                rounds_home=times[True], rounds_shared=times[False],
                note=f"captured replays: home blocks {home * 1e3:.3f} ms, one counter {shared * 1e3:.3f} ms")
    res.save()


if __name__ == "__main__":
    main()
