"""2-D convolutions as implicit GEMMs (`kernels.conv2d`) on a GPU: float16 and bfloat16 on the tensor cores,
beside PyTorch's convolution (cuDNN) on the same data, in TFLOP/s.

    python benchmarks/conv.py --device CUDA [--quick]

Shapes are ResNet-like 3x3 and 1x1 layers, batch 32, NCHW, unpadded (the input arrives padded, as
`kernels.conv2d` expects; PyTorch gets the same input with padding=0). Ours is the program's own
`wait=True` time on the raw launch path; PyTorch's is timed with its CUDA events. Each result is checked
against PyTorch's first (float32 accumulation on both sides).
"""
from __future__ import annotations

import numpy as np

import harness as H

SHAPES = [  # N, C, H, W, CO, KH, KW (input already padded: 3x3 layers of 56, 28, 14, 7 and a 1x1)
    (32, 64, 58, 58, 64, 3, 3),
    (32, 128, 30, 30, 128, 3, 3),
    (32, 256, 16, 16, 256, 3, 3),
    (32, 512, 9, 9, 512, 3, 3),
    (32, 256, 56, 56, 64, 1, 1),
]


def main() -> None:
    p = H.parser(__doc__.split("\n\n")[0])
    args = p.parse_args()
    from morok_py import Buffer, dtypes
    from morok_py import kernels as K
    from morok_py.dtypes import to_numpy

    dev = H.open_device(args.device)
    libs = H.gpu_peer_libs(dev)
    torch = libs.get("torch")
    if torch is None:
        raise SystemExit("conv.py compares with PyTorch on a GPU: none here")
    timer = H.event_timer("torch", torch)
    device = f"cuda:{dev.spec.ordinal}"
    mach = H.machine(dev)
    res = H.Results("conv", dev, args)
    rng = np.random.default_rng(0)
    rows = []
    shapes = [(4, c, h, w, co, kh, kw) for (_, c, h, w, co, kh, kw) in SHAPES[:2]] if args.quick else SHAPES
    for dname in ("float16", "bfloat16"):
        dt = getattr(dtypes, dname)
        tdt = getattr(torch, dname)
        for N, C, Hh, Ww, CO, KH, KW in shapes:
            OH, OW = Hh - KH + 1, Ww - KW + 1
            flop = 2.0 * N * OH * OW * CO * C * KH * KW
            tx = torch.randn(N, C, Hh, Ww, device=device).to(tdt)
            tw = (torch.randn(CO, C, KH, KW, device=device) / (C * KH * KW) ** 0.5).to(tdt)
            prog = dev.compile(K.conv2d(N, C, Hh, Ww, CO, KH, KW, dtype=dt), name=f"conv_{dname}")
            x = Buffer.from_dlpack(tx.contiguous())
            w = Buffer.from_dlpack(tw.contiguous())
            out = dev.buffer(N * CO * OH * OW, dt)
            prog(x, w, out)
            want = torch.nn.functional.conv2d(tx.float(), tw.float())
            got = torch.from_dlpack(out).view(N, CO, OH, OW).float()
            err = float((got - want).abs().max() / want.abs().max())
            if err > (2e-3 if dname == "float16" else 1.6e-2):
                raise SystemExit(f"conv {dname} {N}x{C}x{Hh}x{Ww} -> {CO}x{KH}x{KW}: relative error {err:.2e}")
            info = prog.launch
            gs, ls = info.launch_dims({})
            ptrs = [x.ptr, w.ptr, out.ptr]
            t = H.measure(lambda: prog.execute(ptrs, [], gs, ls, wait=True), warmup=3, repeats=10)
            t_peer = H.measure(lambda: timer(lambda: torch.nn.functional.conv2d(tx, tw)), warmup=3, repeats=10)
            label = f"{N}x{C}x{Hh}x{Ww} * {CO}x{C}x{KH}x{KW}"
            rec = res.add("conv2d", int(flop), "FLOP/s", flop / t, "torch", flop / t_peer, higher_is_better=True,
                          dtype=dname, label=f"{dname} {label}", max_rel_err=err,
                          schedule=str(getattr(prog.compiled, "schedule", "")) or None)
            rows.append([dname, label, f"{flop / t / 1e12:.1f}", f"{flop / t_peer / 1e12:.1f}", f"{rec['ratio']:.2f}x",
                         f"{err:.1e}"])
            del x, w, out
    H.table(rows, ["dtype", "conv (input padded)", "ours TFLOP/s", "torch TFLOP/s", "vs torch", "max rel err"],
            f"\nImplicit-GEMM convolutions on {mach['model']}")
    res.save()


if __name__ == "__main__":
    main()
