"""Hand-written CUDA transposes (CuPy RawKernel) that tell what bounds the odd 2-D transpose
(8191 x 8193 float32, benchmarks/permute.py): tile shape, block order, misaligned row segments.

    python benchmarks/probes/transpose_layouts.py [--json FILE]

Every probe is checked against numpy (or the copy it is), then timed with CUDA events (median of 50)
as bytes read + written per second, beside a device-to-device copy of the same bytes. `--morok-only`:
the permute strategy's kernels (strategies/permute.py) of a few shapes under its candidate schedules.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

SRC = r"""
extern "C" __global__ void __launch_bounds__(G) k(const float* __restrict__ x, float* __restrict__ out, int R, int C) {
  // x: R rows of C; out: C rows of R (MODE 0) or R rows of C (MODE 1: a tiled copy, no transpose)
  __shared__ float tile[TB][TA + 1];
  const int nA = (C + TA - 1) / TA, nB = (R + TB - 1) / TB;
  const int g = blockIdx.x;
#if BFIRST
  const int tb = g % nB, ta = g / nB;
#else
  const int ta = g % nA, tb = g / nA;
#endif
  const int a0 = ta * TA, b0 = tb * TB, t = threadIdx.x;
  const bool full = (a0 + TA <= C) && (b0 + TB <= R);
#if MODE == 1
  #pragma unroll
  for (int f = t; f < TA * TB; f += G) {
    int la = f % TA, lb = f / TA, a = a0 + la, b = b0 + lb;
    if (full || (a < C && b < R)) out[(long long)b * C + a] = x[(long long)b * C + a];
  }
#else
  #pragma unroll
  for (int f = t; f < TA * TB; f += G) {
    int la = f % TA, lb = f / TA, a = a0 + la, b = b0 + lb;
    if (full || (a < C && b < R)) tile[lb][la] = x[(long long)b * C + a];
  }
  __syncthreads();
  #pragma unroll
  for (int f = t; f < TA * TB; f += G) {
    int lb = f % TB, la = f / TB, a = a0 + la, b = b0 + lb;
    if (full || (a < C && b < R)) out[(long long)a * R + b] = tile[lb][la];
  }
#endif
}
"""

FLAT = r"""
extern "C" __global__ void flat(const float* __restrict__ x, float* __restrict__ out, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i];
}
"""


MOROK = [  # (name, input shape, perm, symbolic)
    ("odd", (8191, 8193), (1, 0), True), ("even_sym", (8192, 8192), (1, 0), True),
    ("nchw_nhwc_7x7", (1024, 512, 7, 7), (0, 2, 3, 1), False), ("3d", (64, 512, 1024), (0, 2, 1), False),
    ("3d_rev", (256, 256, 512), (2, 1, 0), False), ("5d", (16, 32, 32, 32, 64), (0, 4, 1, 2, 3), False),
]
SCHEDULES = [(64, 256), (64, 512), (64, 1024), (32, 256), (32, 128)]     # (Schedule.permute, group)


def morok_probes(rows) -> None:
    """The permute strategy's own kernels under each (tile, group) schedule."""
    import cupy as cp
    from morok_py import Buffer, Device, cache, dtypes
    from morok_py.codegen.schedule import Schedule
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from permute import permuted
    dev = Device["CUDA"]
    pair = dev.compiler.cache_key
    rng = np.random.default_rng(2)
    for name, shape, perm, sym in MOROK:
        x = rng.random(shape, dtype=np.float32)
        want = x.transpose(perm)
        n = x.size
        nbytes = 8 * n
        vals = {f"d{i}": s for i, s in enumerate(shape)} if sym else {}
        src = Buffer.from_numpy(x.reshape(-1), dev)
        out = dev.buffer(n, dtypes.float32)
        cx = cp.asarray(x.reshape(-1))
        cy = cp.empty_like(cx)
        t_copy = timeit(cp, lambda: cy.__setitem__(slice(None), cx))
        for tile, group in [(0, 0)] + SCHEDULES:
            try:
                s = Schedule("groups", group=group, permute=tile) if tile else None
                comp = cache.compile_ast(dev.renderer, dev.compiler, permuted(shape, perm, sym), f"t_{name}", s)
                prog = dev.runtime(comp)
                gs, ls = prog.launch.launch_dims(vals)
                ordered = [vals[k] for k in prog.launch.var_names]
                ptrs = [src.ptr, out.ptr]
                prog.execute(ptrs, ordered, gs, ls, wait=True)
                ok = bool(np.array_equal(out.numpy().reshape(want.shape), want))
                ts = sorted(prog.execute(ptrs, ordered, gs, ls, wait=True) for _ in range(40))
                t = ts[len(ts) // 2]
                rows.append(dict(probe=f"morok_{pair}_{name}_" + (f"t{tile}_g{group}" if tile else "default"),
                                 shape="x".join(map(str, shape)), ok=ok, t=t, gbs=nbytes / t / 1e9,
                                 vs_memcpy=t_copy / t))
            except Exception as e:      # noqa: BLE001 -- a schedule the kernel does not take
                print(name, tile, group, type(e).__name__, str(e)[:200])
        src.free()
        out.free()
        del cx, cy


def timeit(cp, fn, reps=50):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(reps):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
    return statistics.median(ts)


def main() -> None:
    import cupy as cp
    p = argparse.ArgumentParser()
    p.add_argument("--json", default="")
    p.add_argument("--morok-only", action="store_true")
    args = p.parse_args()
    rows = []
    if args.morok_only:
        morok_probes(rows)
        report(rows, args.json)
        return

    def timeit(fn, reps=50):
        for _ in range(5):
            fn()
        ts = []
        for _ in range(reps):
            s, e = cp.cuda.Event(), cp.cuda.Event()
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
        return statistics.median(ts)

    rng = np.random.default_rng(1)
    cache = {}
    for R, C in ((8192, 8192), (8191, 8193), (8192, 8193), (8193, 8192)):
        x = cp.asarray(rng.random((R, C), dtype=np.float32))
        out = cp.empty(R * C + 64, dtype=cp.float32)
        nbytes = 8 * R * C
        t_copy = timeit(lambda: out[:R * C].__setitem__(slice(None), x.reshape(-1)))
        rows.append(dict(probe="memcpy", shape=f"{R}x{C}", t=t_copy, gbs=nbytes / t_copy / 1e9))
        # a flat copy whose stores start one element past alignment
        fk = cache.setdefault("flat", cp.RawKernel(FLAT, "flat"))
        for off in (0, 1):
            o = out[off:off + R * C]
            fn = lambda o=o: fk(((R * C + 255) // 256,), (256,), (x, o, np.int64(R * C)))
            fn()
            assert cp.array_equal(o, x.reshape(-1))
            t = timeit(fn)
            rows.append(dict(probe=f"flat_copy_store_offset{off}", shape=f"{R}x{C}", t=t, gbs=nbytes / t / 1e9,
                             vs_memcpy=t_copy / t))
        want = cp.ascontiguousarray(x.T).reshape(-1)
        configs = [(64, 64, 256, 0, 0), (64, 64, 256, 1, 0), (64, 64, 1024, 0, 0), (128, 64, 512, 0, 0),
                   (64, 128, 512, 0, 0), (128, 32, 256, 0, 0), (32, 128, 256, 0, 0), (64, 128, 512, 1, 0),
                   (32, 32, 256, 0, 0), (64, 64, 256, 0, 1), (128, 64, 512, 0, 1)]
        if (R, C) != (8191, 8193):
            configs = [(64, 64, 256, 0, 0), (64, 64, 256, 1, 0), (64, 64, 256, 0, 1)]
        for TA, TB, G, bfirst, mode in configs:
            key = (TA, TB, G, bfirst, mode)
            if key not in cache:
                src = f"#define TA {TA}\n#define TB {TB}\n#define G {G}\n#define BFIRST {bfirst}\n#define MODE {mode}\n" + SRC
                cache[key] = cp.RawKernel(src, "k", options=("-std=c++17",))
            kern = cache[key]
            groups = -(-R // TB) * -(-C // TA)
            fn = lambda kern=kern, G=G, groups=groups: kern((groups,), (G,), (x, out, np.int32(R), np.int32(C)))
            out[:] = -7
            try:
                fn()
            except Exception as e:      # noqa: BLE001 -- a tile the device does not take
                print(key, type(e).__name__, str(e)[-200:])
                continue
            got = out[:R * C]
            ok = bool(cp.array_equal(got, x.reshape(-1) if mode else want))
            t = timeit(fn)
            rows.append(dict(probe=("tiled_copy" if mode else "transpose") + f"_a{TA}_b{TB}_g{G}" +
                             ("_bfirst" if bfirst else ""), shape=f"{R}x{C}", ok=ok, t=t, gbs=nbytes / t / 1e9,
                             vs_memcpy=t_copy / t))
        del x, out, want
        cp.get_default_memory_pool().free_all_blocks()
    report(rows, args.json)


def report(rows, path) -> None:
    for r in rows:
        print(f"{r['probe']:<34} {r['shape']:<10} {r['t'] * 1e6:8.1f} us {r['gbs']:7.0f} GB/s "
              f"{r.get('vs_memcpy', 1):.3f}x {'' if r.get('ok', True) else 'WRONG'}")
    if path:
        json.dump(rows, open(path, "w"), indent=1)


if __name__ == "__main__":
    main()
