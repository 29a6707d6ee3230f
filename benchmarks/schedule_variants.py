"""Named schedules of one kernel timed side by side, with torch in the same process.

Each case compiles the kernel under its default schedule and under a list of alternatives (the ones a
change should beat, or the one it replaces), checks every output against numpy, and times them in
interleaved rounds (best round of each, CUDA events through Program.execute; torch through its events).
A `flag` variant flips a module switch of the lowering before compiling (e.g. gpu_tile.ALIGNED_VARIANT)
to time what a change replaced. The disk cache is off (a flag is no part of a cache key).

    MOROK_CUDA_COMPILER=llvm-nvptx python benchmarks/schedule_variants.py --device CUDA

writes benchmarks/results/<machine kind>/schedule_variants-<pair>.json (--json PATH: there instead).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ["MOROK_CACHE"] = "0"

import harness as H  # noqa: E402
from harness import np  # noqa: E402
import kernels as KB  # noqa: E402


def variants(name: str, default=None):
    """(label, schedule or None for the default, (module, flag, value) or None) per variant; `default`: the
    kernel's default schedule."""
    from morok_py.codegen.schedule import Schedule as S
    gpr = lambda **k: S("group_per_row", reduce="group", **k)  # noqa: E731
    if name == "softmax_vocab":
        return [("default", None, None), ("one group per row, 256", gpr(group=256), None),
                ("rows 132 x 1024", gpr(group=1024, row_groups=132), None),
                ("rows 256 x 1024", gpr(group=1024, row_groups=256), None)]
    if name == "softmax":
        return [("default", None, None)] + [(f"group {g}{', row cache' * rc}", gpr(group=g, row_cache=rc), None)
                                            for g in (128, 256, 512, 1024) for rc in (True, False)]
    if name == "gemv8":
        up = lambda g, sp, u, **k: S("groups", group=g, unroll=u, split=sp, upcast=8, **k)  # noqa: E731
        return [("default", None, None),
                ("split 8, unrolled by the lowering", S("groups", group=256, unroll=8, split=8, unrolled=True), None),
                ("upcast, 512/16/4, unrolled", up(512, 16, 4, unrolled=True), None),
                ("upcast, 1024/32/4", up(1024, 32, 4), None), ("upcast, 1024/32/4, unrolled", up(1024, 32, 4, unrolled=True), None)]
    if name in ("matmul", "matmul_sym"):
        from morok_py.codegen import gpu_tile
        from dataclasses import replace
        out = [("default", None, None)]
        if default is not None and default.mapping == "tiled" and default.tensor_core is None:
            other = replace(default, async_fill=not default.async_fill)
            out.append(("cp.async fill" if other.async_fill else "register fill", other, None))
        if name == "matmul_sym":
            out.append(("no aligned variant (before)", None, (gpu_tile, "ALIGNED_VARIANT", False)))
        return out
    raise ValueError(name)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="CUDA")
    p.add_argument("--cases", default="softmax_vocab,gemv8,matmul,matmul_sym")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="small sizes, default schedules (a CPU smoke test)")
    a = p.parse_args()
    from morok_py import cache
    from morok_py.registry import get_device
    dev = get_device(a.device)
    gpu = H.is_gpu(dev)
    comp = dev.compiler
    libs = {}
    try:
        import torch
        if torch.cuda.is_available():
            libs["torch"] = torch
    except ImportError:
        pass
    cargs = argparse.Namespace(symbolic=False, quick=a.quick, n=None)
    rng = np.random.default_rng(0)
    out = {"device": str(dev.device), "compiler": comp.cache_key, "cases": {}}
    for name in a.cases.split(","):
        case = KB.make_case(name, cargs, True, rng)
        want = case.reference(*case.inputs)
        progs = []
        for label, sched, flag in variants(name, dev.renderer.render(case.ast, "s").linear.schedule if gpu else None):
            if sched is not None and not gpu:
                continue
            old = None
            if flag is not None:
                old = getattr(flag[0], flag[1])
                setattr(flag[0], flag[1], flag[2])
            try:
                t0 = time.perf_counter()
                compiled = cache.compile_ast(dev.renderer, comp, case.ast, f"v_{name}_{len(progs)}", sched)
                ct = time.perf_counter() - t0
            finally:
                if flag is not None:
                    setattr(flag[0], flag[1], old)
            prog = dev.runtime(compiled)
            ours = KB.Ours.__new__(KB.Ours)
            from morok_py import Buffer, dtypes
            ours.dev, ours.prog, ours.queue_ahead = dev, prog, gpu
            ours.bufs = [Buffer.from_numpy(np.ascontiguousarray(x).reshape(-1), dev) for x in case.inputs]
            ours.out = dev.buffer(int(np.prod(case.out_shape)), dtypes.float32)
            mine = {k: case.vals[k] for k in compiled.launch.var_names}
            ours.gs, ours.ls = compiled.launch.launch_dims(mine)
            ours.vals = [mine[k] for k in compiled.launch.var_names]
            ours.ptrs = [b.ptr for b in ours.bufs] + [ours.out.ptr]
            ours()
            H.check_close(f"{name} {label}", ours.result(), want, case.rtol, case.atol)
            sched_s = str(compiled.launch and (sched or dev.renderer.render(case.ast, "s").linear.schedule))
            progs.append((label, sched_s, ours, ct))
        peers = KB.gpu_peers(case, libs)
        best = {lab: float("inf") for lab, *_ in progs}
        best_t = float("inf")
        for _ in range(a.rounds):
            for lab, _, ours, _ in progs:
                best[lab] = min(best[lab], min(ours() for _ in range(3)))
            if "torch" in peers:
                run, _ = peers["torch"]
                run()
                best_t = min(best_t, min(run() for _ in range(3)))
        rows = []
        for lab, sched_s, ours, ct in progs:
            rows.append({"variant": lab, "schedule": sched_s, "us": best[lab] * 1e6, "compile_s": ct,
                         "vs_torch": best_t / best[lab] if best_t < float("inf") else None,
                         "gb_s": case.nbytes / best[lab] / 1e9})
            print(f"{name:14s} {lab:38s} {best[lab]*1e6:9.1f} us  x{(best_t / best[lab]):.3f} torch  "
                  f"{case.nbytes / best[lab] / 1e9:7.0f} GB/s  {sched_s}", flush=True)
            ours.free()
        print(f"{name:14s} {'torch':38s} {best_t*1e6:9.1f} us", flush=True)
        out["cases"][name] = {"torch_us": best_t * 1e6, "variants": rows}
        del peers
        KB.free_gpu_peers(libs)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    elif not a.quick:
        H.write_result(H.result_name("schedule_variants", dev), out, dev)


if __name__ == "__main__":
    sys.exit(main())
