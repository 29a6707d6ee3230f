"""Half-precision bandwidth on a GPU: add, sum, row max and softmax in float32, float16 and bfloat16,
as bytes per second, beside PyTorch on the same data (the target: float16 elementwise kernels
and reductions keep >= 0.9x the float32 figures in bytes per second).

    python benchmarks/half_bandwidth.py --device CUDA [--quick]

Ours is the program's own `wait=True` time on the raw launch path (`Program.execute`, prepared once);
PyTorch's is timed with its CUDA events. Each of our results is checked against numpy first (halves:
bit-exact for add; to the type's precision for the reductions). Bytes are those the kernel must move:
add 3n, sum n, row max n + rows, softmax 2n elements.
"""
from __future__ import annotations

import numpy as np

import harness as H

KERNELS = ("add", "sum", "row_max", "softmax")
DTYPES = ("float32", "float16", "bfloat16")
TARGET = 0.9       # half bytes/s over float32 bytes/s


def main() -> None:
    p = H.parser(__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=0, help="elements per kernel (default 64M; --quick 1M)")
    args = p.parse_args()
    from morok_py import Buffer, dtypes
    from morok_py import kernels as K
    from morok_py.dtypes import to_numpy

    dev = H.open_device(args.device)
    if not H.is_gpu(dev):
        H.note("not a GPU: our side only, without peers (a smoke run of the script)")
    mach = H.machine(dev)
    res = H.Results("half_bandwidth", dev, args)
    libs = H.gpu_peer_libs(dev)
    torch = libs.get("torch")
    timer = H.event_timer("torch", torch) if torch is not None else None
    device = f"cuda:{dev.spec.ordinal}"
    n = args.n or ((1 << 20) if args.quick else (64 << 20))
    side = int(round(n ** 0.5))
    rng = np.random.default_rng(0)
    base = (rng.random(n, dtype=np.float32) * 2 - 1)
    rows_out: list[list] = []
    gbps: dict[tuple[str, str], float] = {}
    for kname in KERNELS:
        for dname in DTYPES:
            dt = getattr(dtypes, dname)
            npdt = to_numpy(dt)
            if kname == "add":
                a, b = base.astype(npdt), base[::-1].copy().astype(npdt)
                ast, vals, ins, shape_out = K.add(dtype=dt), {"n": n}, [a, b], (n,)
                want = (a.astype(np.float32) + b.astype(np.float32)).astype(npdt)
                nbytes = 3 * n * a.itemsize
                peer = (lambda ta, tb, to: torch.add(ta, tb, out=to))
            elif kname == "sum":
                a = base.astype(npdt)
                ast, vals, ins, shape_out = K.sum_all(dtype=dt), {"n": n}, [a], (1,)
                want = np.array([a.astype(np.float64).sum()])
                nbytes = n * a.itemsize
                peer = (lambda ta, to: torch.sum(ta))
            elif kname == "row_max":
                a = base[:side * side].reshape(side, side).astype(npdt)
                ast, vals, ins, shape_out = K.row_max(dtype=dt), {"d0": side, "d1": side}, [a], (side,)
                want = a.max(axis=1)
                nbytes = (side * side + side) * a.itemsize
                peer = (lambda ta, to: torch.amax(ta, dim=1, out=to))
            else:
                a = base[:side * side].reshape(side, side).astype(npdt)
                ast, vals, ins, shape_out = K.softmax(dtype=dt), {"rows": side, "cols": side}, [a], (side, side)
                x = a.astype(np.float64)
                e = np.exp(x - x.max(axis=1, keepdims=True))
                want = e / e.sum(axis=1, keepdims=True)
                nbytes = 2 * side * side * a.itemsize
                peer = (lambda ta, to: torch.softmax(ta, dim=1))
            prog = dev.compile(ast, name=f"halfbw_{kname}_{dname}")
            bufs = [Buffer.from_numpy(np.ascontiguousarray(x).ravel(), dev) for x in ins]
            out = dev.buffer(int(np.prod(shape_out)), dt)
            prog(*bufs, out, **vals)
            got = out.numpy().reshape(shape_out).astype(np.float64)
            tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dname]
            if kname == "add":
                np.testing.assert_array_equal(out.numpy().reshape(shape_out).view(np.uint8), want.view(np.uint8))
            elif kname == "sum":
                np.testing.assert_allclose(got, want, rtol=tol * 4, atol=1e-6 * np.abs(a.astype(np.float64)).sum())
            else:
                np.testing.assert_allclose(got, want.astype(np.float64), rtol=tol, atol=tol * 1e-3)
            info = prog.launch
            gs, ls = info.launch_dims(vals)
            ordered = [vals[k] for k in info.var_names]
            ptrs = [b.ptr for b in bufs] + [out.ptr]
            t = H.measure(lambda: prog.execute(ptrs, ordered, gs, ls, wait=True), warmup=3, repeats=15)
            ours = nbytes / t
            gbps[(kname, dname)] = ours
            t_peer = None
            if torch is not None:
                tdt = getattr(torch, dname)
                tins = [torch.from_numpy(np.ascontiguousarray(x).view(np.uint16) if x.itemsize == 2 and dname == "bfloat16"
                                         else np.ascontiguousarray(x)).to(device) for x in ins]
                if dname == "bfloat16":
                    tins = [t_.view(torch.bfloat16) for t_ in tins]
                tout = torch.empty(shape_out if kname != "sum" else (1,), dtype=tdt, device=device)
                t_peer = H.measure(lambda: timer(lambda: peer(*tins, tout)), warmup=3, repeats=15)
            rec = res.add(f"half_bw_{kname}", n, "B/s", ours, "torch" if t_peer else None,
                          nbytes / t_peer if t_peer else None, higher_is_better=True, dtype=dname, label=dname,
                          time=t, bytes=nbytes)
            rows_out.append([kname, dname, H.fmt_bytes(ours) + "/s",
                             (H.fmt_bytes(nbytes / t_peer) + "/s") if t_peer else "-",
                             f"{rec['ratio']:.2f}x" if rec["ratio"] else "-"])
            for b in bufs + [out]:
                b.free()
        f32 = gbps[(kname, "float32")]
        for dname in DTYPES[1:]:
            r = gbps[(kname, dname)] / f32
            res.add(f"half_bw_{kname}_vs_f32", n, "ratio", r, f"float32 {kname}", 1.0, higher_is_better=True,
                    dtype=dname, label=f"{dname} over float32", target=TARGET)
            rows_out.append([kname, f"{dname} / float32", f"{r:.2f}x", "", ("met" if r >= TARGET else "MISSED") +
                             f" (>= {TARGET}x)"])
    H.table(rows_out, ["kernel", "dtype", "ours", "torch", "vs torch"],
            f"\nHalf-precision bandwidth on {mach['model']} (n = {n})")
    res.save()


if __name__ == "__main__":
    main()
