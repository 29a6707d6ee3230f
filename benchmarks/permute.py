"""Permutations and DLPack on a GPU, beside PyTorch (and CuPy for DLPack) and the device's memcpy.

    python benchmarks/permute.py --device CUDA [--quick] [--variants]

transpose...: a permutation written in the IR (`out[j, i] = x[i, j]` and 3-D to 5-D ones, static and
symbolic sizes), which the default schedule moves through shared-memory tiles (codegen/strategies/
permute.py), as bytes read + written per second; PyTorch's `x.permute(...).contiguous()` and a
device-to-device copy of the same bytes (`dst.copy_(src)`, the memcpy ceiling) timed with CUDA events in
the same run. Ours is the program's own `wait=True` time on the raw launch path. Every result is checked
against numpy first. `--variants` also times every permute candidate schedule of the 2-D cases (8192^2 and the
odd 8191 x 8193), and two static 2-D cases with one odd side each (SIDES: odd rows read and aligned rows written,
then the reverse; no target), which tell which side of the odd transpose costs its bandwidth.

dlpack...: microseconds per call, perf_counter over many calls: `Buffer.from_dlpack(torch tensor)` (the
Buffer dropped after each), `buffer.__dlpack__(stream=1)` (what torch.from_dlpack asks), the round trip
torch -> Buffer -> torch, beside CuPy's (`cupy.from_dlpack`, and torch -> CuPy -> torch), plus the parts:
torch's own `__dlpack__` for each stream argument, and the device's stream ordering calls.
"""
from __future__ import annotations

import time

import numpy as np

import harness as H

TARGET_MEMCPY = 0.85       # transpose bytes/s over memcpy bytes/s
DLPACK_TARGET_US = 5.0

CASES = [  # name, input shape, perm (output axis k is input axis perm[k]), symbolic
    ("transpose_2d", (8192, 8192), (1, 0), False),
    ("transpose_2d_sym", (8192, 8192), (1, 0), True),
    ("transpose_2d_odd", (8191, 8193), (1, 0), True),
    ("transpose_3d", (64, 512, 1024), (0, 2, 1), False),
    ("transpose_3d_rev", (256, 256, 512), (2, 1, 0), False),
    ("transpose_4d_nhwc_nchw", (64, 64, 64, 128), (0, 3, 1, 2), False),
    ("transpose_4d_sym", (64, 64, 64, 128), (0, 3, 1, 2), True),
    ("transpose_4d_nchw_nhwc_7x7", (1024, 512, 7, 7), (0, 2, 3, 1), False),
    ("transpose_5d", (16, 32, 32, 32, 64), (0, 4, 1, 2, 3), False),
]
SIDES = [  # --variants: static sizes, so each side is vector-wide or scalar on its own (strategies/permute.py)
    ("transpose_2d_odd_reads", (8192, 8193), (1, 0), False),     # rows of 8193 read, rows of 8192 written
    ("transpose_2d_odd_writes", (8193, 8192), (1, 0), False),    # rows of 8192 read, rows of 8193 written
]


def permuted(shape, perm, symbolic):
    from morok_py import UOp, dtypes
    nd = len(shape)
    ends = [UOp.variable(f"d{i}", 1, 1 << 20) if symbolic else s for i, s in enumerate(shape)]
    x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)
    rs = [UOp.range(ends[perm[k]], k) for k in range(nd)]
    at = {perm[k]: rs[k] for k in range(nd)}
    idx = at[0]
    for i in range(1, nd):
        idx = idx * ends[i] + at[i]
    oidx = rs[0]
    for k in range(1, nd):
        oidx = oidx * ends[perm[k]] + rs[k]
    return UOp.sink(out.store(oidx, x.load(idx)))


def transposes(dev, res, args, torch, timer, rows) -> None:
    from morok_py import Buffer, dtypes
    from morok_py import cache
    rng = np.random.default_rng(0)
    for name, shape, perm, sym in CASES + (SIDES if args.variants else []):
        side = any(name == c[0] for c in SIDES)
        if args.quick:
            shape = tuple(max(2, s // 16) for s in shape)
        x = rng.random(shape, dtype=np.float32) * 2 - 1
        n = x.size
        nbytes = 2 * 4 * n
        vals = {f"d{i}": s for i, s in enumerate(shape)} if sym else {}
        ast = permuted(shape, perm, sym)
        want = x.transpose(perm)
        progs = [("default", dev.compile(ast, name=name))]
        if args.variants and name in ("transpose_2d", "transpose_2d_odd"):
            from morok_py.codegen.scan import scan_kernel
            from morok_py.codegen.schedule import candidate_schedules
            spec = dev.renderer.render(ast, name)
            for s in candidate_schedules(spec.ast, dev.renderer.caps, scan_kernel(spec.ast))[1:]:
                comp = cache.compile_ast(dev.renderer, dev.compiler, ast, f"{name}_v{len(progs)}", s)
                progs.append((str(s), dev.runtime(comp)))
        src = Buffer.from_numpy(x.reshape(-1), dev)
        out = dev.buffer(n, dtypes.float32)
        for label, prog in progs:
            info = prog.launch
            gs, ls = info.launch_dims(vals)
            ordered = [vals[k] for k in info.var_names]
            ptrs = [src.ptr, out.ptr]
            prog.execute(ptrs, ordered, gs, ls, wait=True)
            got = out.numpy().reshape(want.shape)
            if not np.array_equal(got, want):
                raise SystemExit(f"{name} ({label}): result differs from numpy; not timing a wrong kernel")
            t = H.measure(lambda: prog.execute(ptrs, ordered, gs, ls, wait=True), warmup=3, repeats=args.repeats)
            if label != "default":
                res.add(f"{name}_variant", n, "B/s", nbytes / t, label=label, time=t, bytes=nbytes,
                        higher_is_better=True)
                rows.append([f"{name} {label}", H.fmt_bytes(nbytes / t) + "/s", "", "", ""])
                continue
            ours = nbytes / t
            t_torch = t_copy = None
            if torch is not None:
                tx = torch.from_numpy(x).cuda()
                tdst = torch.empty_like(tx)
                got_t = tx.permute(*perm).contiguous()
                assert np.array_equal(got_t.cpu().numpy(), want)
                t_torch = H.measure(lambda: timer(lambda: tx.permute(*perm).contiguous()), warmup=3,
                                    repeats=args.repeats)
                t_copy = H.measure(lambda: timer(lambda: tdst.copy_(tx)), warmup=3, repeats=args.repeats)
                del tx, tdst, got_t
            sched = str(dev.renderer.render(ast, name).linear.schedule)
            res.add(name, n, "B/s", ours, "torch", nbytes / t_torch if t_torch else None, higher_is_better=True,
                    label="x".join(map(str, shape)) + f" perm {perm}" + (" symbolic" if sym else ""), time=t,
                    bytes=nbytes, schedule=sched)
            rec = res.add(name, n, "B/s", ours, "memcpy", nbytes / t_copy if t_copy else None, higher_is_better=True,
                          label="x".join(map(str, shape)) + f" perm {perm}", time=t, bytes=nbytes,
                          target=None if side else TARGET_MEMCPY)
            rows.append([name, H.fmt_bytes(ours) + "/s",
                         H.fmt_bytes(nbytes / t_torch) + "/s" if t_torch else "-",
                         H.fmt_bytes(nbytes / t_copy) + "/s" if t_copy else "-",
                         f"{rec['ratio']:.2f}x" if rec["ratio"] else "-"])
        src.free()
        out.free()


def per_call(fn, n: int) -> float:
    """Mean seconds per call over n calls, best of 5 rounds."""
    for _ in range(min(n, 200)):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def dlpack(dev, res, args, torch, cupy, rows) -> None:
    from morok_py import Buffer, dtypes
    n = 1 << 20
    calls = 200 if args.quick else 5000
    t = torch.randn(n, device=f"cuda:{dev.spec.ordinal}")
    buf = dev.buffer(n, dtypes.float32)
    torch.cuda.synchronize()
    b = Buffer.from_dlpack(t)
    assert b.ptr == t.data_ptr() and b.size == n
    del b
    back = torch.from_dlpack(buf)
    assert back.data_ptr() == buf.ptr
    del back

    def add(name, fn, peer=None, peer_fn=None, target=None):
        us = per_call(fn, calls) * 1e6
        pus = per_call(peer_fn, calls) * 1e6 if peer_fn is not None else None
        rec = res.add(name, n, "us", us, peer, pus, target_value=target)     # a time to reach, not a ratio
        extra = f"{rec['ratio']:.2f}x" if rec["ratio"] else "-"
        if target is not None:
            extra += f" ({'met' if us <= target else 'MISSED'} <= {target:g} us)"
        rows.append([name, f"{us:.2f} us", peer or "-", f"{pus:.2f} us" if pus is not None else "-", extra])

    add("dlpack_from_torch", lambda: Buffer.from_dlpack(t), "cupy" if cupy else None,
        (lambda: cupy.from_dlpack(t)) if cupy else None, target=DLPACK_TARGET_US)
    add("dlpack_export", lambda: buf.__dlpack__(stream=1, max_version=(1, 0)), "torch",
        lambda: t.__dlpack__(stream=1, max_version=(1, 0)), target=DLPACK_TARGET_US)
    add("dlpack_export_legacy", lambda: buf.__dlpack__(stream=1), "torch", lambda: t.__dlpack__(stream=1))
    add("dlpack_torch_from_buffer", lambda: torch.from_dlpack(buf), "torch from cupy" if cupy else None,
        (lambda c=cupy.asarray(t): torch.from_dlpack(c)) if cupy else None)
    add("dlpack_round_trip", lambda: torch.from_dlpack(Buffer.from_dlpack(t)), "cupy" if cupy else None,
        (lambda: torch.from_dlpack(cupy.from_dlpack(t))) if cupy else None)
    # the parts: the producer's own export for each stream argument, and our stream ordering
    ours = dev.dlpack_stream() if hasattr(dev, "dlpack_stream") else None
    add("dlpack_part_torch_export_stream_-1", lambda: t.__dlpack__(stream=-1, max_version=(1, 0)))
    add("dlpack_part_torch_export_stream_1", lambda: t.__dlpack__(stream=1, max_version=(1, 0)))
    add("dlpack_part_torch_export_device_stream", lambda s=int(dev.stream): t.__dlpack__(stream=s, max_version=(1, 0)))
    if hasattr(dev, "dlpack_imported"):
        add("dlpack_part_imported_order", dev.dlpack_imported)
    if hasattr(dev, "dlpack_sync"):
        add("dlpack_part_export_order", lambda: dev.dlpack_sync(1))
    from morok_py import dlpack as D
    add("dlpack_part_import_capsule", lambda: D.Imported(t.__dlpack__(stream=-1, max_version=(1, 0))).release())
    res.add("dlpack_stream_argument", 0, "", ours)
    buf.free()


def main() -> None:
    p = H.parser(__doc__.split("\n\n")[0])
    p.add_argument("--variants", action="store_true", help="time every permute candidate schedule of the 2-D cases")
    p.add_argument("--only", default="", help="transpose or dlpack (default: both)")
    args = p.parse_args()
    dev = H.open_device(args.device)
    if not H.is_gpu(dev):
        raise SystemExit("permute.py measures a GPU (the CPU keeps its permutations as they are)")
    mach = H.machine(dev)
    res = H.Results("permute", dev, args)
    libs = H.gpu_peer_libs(dev)
    torch, cupy = libs.get("torch"), libs.get("cupy")
    timer = H.event_timer("torch", torch) if torch is not None else None
    rows: list[list] = []
    if args.only in ("", "transpose"):
        transposes(dev, res, args, torch, timer, rows)
        H.table(rows, ["kernel", "ours", "torch", "memcpy", "vs memcpy"], f"\nPermutations on {mach['model']}")
    rows = []
    if args.only in ("", "dlpack") and torch is not None:
        dlpack(dev, res, args, torch, cupy, rows)
        H.table(rows, ["call", "ours", "peer", "peer's", "ratio"], f"\nDLPack on {mach['model']}")
    res.save()


if __name__ == "__main__":
    main()
