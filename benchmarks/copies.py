"""Host/device copy bandwidth against the peer, over sizes (a few KiB to 1 GiB).

    python benchmarks/copies.py --device CPU|CUDA|ROCM [--quick]

Directions, ours -> peer:
- host->device: `Buffer.copyin(ndarray)` from pageable numpy memory -> CPU: `np.copyto`;
  CUDA: CuPy `ndarray.set(host)`, PyTorch `tensor.copy_(torch.from_numpy(host))` (pageable too).
- device->host: `allocator.copyout(ndarray, buf.ptr)` into a preallocated array (what
  `Buffer.numpy()` does after allocating) -> CPU: `np.copyto`; CUDA: CuPy `ndarray.get(out=host)`,
  PyTorch `host_tensor.copy_(device_tensor)`.
- device->device: `Buffer.copy_to(other)` (the allocator's transfer) -> CPU: `np.copyto`;
  CUDA: CuPy `copy_from_device_async`, PyTorch `copy_`.
All wall-timed with perf_counter, synchronized after each copy (our copies block). Bandwidth is
the bytes copied per second (one direction, the usual convention for transfers; the kernel
benchmark's memcpy ceiling counts read + written). On the CPU, arrays that fit in the last-level
cache are rotated through several sets so that the numbers are memory, not cache.
"""
from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, Callable

import harness as H
from harness import np


def sizes_for(args) -> list[int]:
    top = (1 << 22) if args.quick else (1 << 30)
    step = 4 if args.quick else 4
    out, s = [], 4 << 10
    while s <= top:
        out.append(s)
        s *= step
    return out


def ours_fns(dev, host: list[np.ndarray], outs: list[np.ndarray]):
    from morok_py import Buffer, dtypes
    n = host[0].size
    src = [Buffer.from_numpy(h, dev) for h in host]
    dst = [dev.buffer(n, dtypes.float32) for _ in host]
    alloc = dev.allocator
    sync = dev.synchronize

    def h2d(i):
        src[i].copyin(host[i])
        sync()

    def d2h(i):
        alloc.copyout(outs[i], src[i].ptr)

    def d2d(i):
        src[i].copy_to(dst[i])
        sync()

    # correctness before speed
    d2h(0)
    if not np.array_equal(outs[0], host[0]):
        raise SystemExit("device->host copy returned different bytes")
    d2d(0)
    if not np.array_equal(dst[0].numpy(), host[0]):
        raise SystemExit("device->device copy returned different bytes")
    return {"host->device": h2d, "device->host": d2h, "device->device": d2d}, src + dst


def peer_fns(name: str, lib, host: list[np.ndarray], outs: list[np.ndarray]) -> dict[str, Callable[[int], Any]]:
    if name == "numpy":
        mid = [np.empty_like(h) for h in host]
        return {"host->device": lambda i: np.copyto(mid[i], host[i]),
                "device->host": lambda i: np.copyto(outs[i], host[i]),
                "device->device": lambda i: np.copyto(mid[i], host[i])}
    if name == "cupy":
        cp = lib
        dev_a = [cp.asarray(h) for h in host]
        dev_b = [cp.empty_like(a) for a in dev_a]
        sync = cp.cuda.get_current_stream().synchronize

        def h2d(i):
            dev_a[i].set(host[i])
            sync()

        def d2h(i):
            dev_a[i].get(out=outs[i])
            sync()

        def d2d(i):
            dev_b[i].data.copy_from_device_async(dev_a[i].data, dev_a[i].nbytes)
            sync()
        return {"host->device": h2d, "device->host": d2h, "device->device": d2d}
    torch = lib
    host_t = [torch.from_numpy(h) for h in host]
    out_t = [torch.from_numpy(o) for o in outs]
    dev_a = [t.cuda() for t in host_t]
    dev_b = [torch.empty_like(a) for a in dev_a]
    sync = torch.cuda.synchronize

    def h2d(i):
        dev_a[i].copy_(host_t[i])
        sync()

    def d2h(i):
        out_t[i].copy_(dev_a[i])
        sync()

    def d2d(i):
        dev_b[i].copy_(dev_a[i])
        sync()
    return {"host->device": h2d, "device->host": d2h, "device->device": d2d}


def chart(res: H.Results, dev) -> Callable[[Path], None]:
    def draw(png: Path) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        mach = H.machine(dev)
        dirs = ["host->device", "device->host", "device->device"]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
        for ax, d in zip(axes, dirs):
            recs = [r for r in res.records if r["direction"] == d]
            series: dict[str, dict[int, float]] = {}
            for r in recs:
                series.setdefault("morok_py", {})[r["size"]] = r["value"]
                if r["peer"]:
                    series.setdefault(r["peer"], {})[r["size"]] = r["peer_value"]
            for name, pts in series.items():
                xs = sorted(pts)
                ax.semilogx(xs, [pts[x] for x in xs], marker="o", label=name,
                            linewidth=2.4 if name == "morok_py" else 1.4)
            ax.set_title(d)
            ax.set_xlabel("bytes")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        axes[0].set_ylabel("GB/s (bytes copied)")
        fig.suptitle(f"copies on {mach['device']} ({mach['model']}) - {mach['date']}")
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        plt.close(fig)
    return draw


def main() -> None:
    p = H.parser(__doc__.split("\n\n")[0])
    p.add_argument("--min-time", type=float, default=0.2, help="seconds to spend per point at least")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.warmup, args.min_time = min(args.repeats, 3), 1, 0.05
    dev = H.open_device(args.device, args.wait_quiet)
    gpu = H.is_gpu(dev)
    mach = H.machine(dev)
    libs = H.gpu_peer_libs(dev) if gpu else {"numpy": np}
    if gpu and not libs:
        H.note("neither cupy nor torch is usable: measuring ours only")
    res = H.Results("copies", dev, args)
    sizes = sizes_for(args)
    cache = H.cache_bytes()
    bar = H.Progress(len(sizes) * 3 * (1 + len(libs)), "copies")
    rng = np.random.default_rng(0)
    for nbytes in sizes:
        n = nbytes // 4
        sets = 1 if gpu else H.rotations(2 * nbytes, cache)
        host = [rng.random(n, dtype=np.float32) for _ in range(sets)]
        outs = [np.empty_like(h) for h in host]
        mine, keep = ours_fns(dev, host, outs)
        peers = {name: peer_fns(name, lib, host, outs) for name, lib in libs.items()}
        label = H.fmt_bytes(nbytes)
        for direction, fn in mine.items():
            bar.step(f"{label} {direction}: ours")
            t = H.measure(H.Cycle([lambda i=i: fn(i) for i in range(sets)]), args.warmup, args.repeats,
                          min_time=args.min_time)
            bar.advance()
            common = {"label": f"{label} {direction}", "direction": direction, "input_sets": sets}
            if not peers:
                res.add("copy", nbytes, "GB/s", nbytes / t / 1e9, higher_is_better=True, time_s=t, **common)
            for pname, pf in peers.items():
                bar.step(f"{label} {direction}: {pname}")
                tp = H.measure(H.Cycle([lambda i=i: pf[direction](i) for i in range(sets)]), args.warmup,
                               args.repeats, min_time=args.min_time)
                bar.advance()
                res.add("copy", nbytes, "GB/s", nbytes / t / 1e9, pname, nbytes / tp / 1e9, higher_is_better=True,
                        time_s=t, peer_time_s=tp, **common)
        for b in keep:
            b.free()
        del host, outs, mine, keep, peers
        gc.collect()
        if "cupy" in libs:
            libs["cupy"].get_default_memory_pool().free_all_blocks()
        if "torch" in libs:
            libs["torch"].cuda.empty_cache()
    bar.close()
    H.results_table(res.records, f"\ncopies on {mach['device']} ({mach['model']}), GB/s of bytes copied; "
                                 f"ratio = ours / peer's")
    res.save(chart(res, dev))


if __name__ == "__main__":
    main()
