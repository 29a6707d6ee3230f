"""The MLIR pair's CUBINs on a real GPU, where the `mlir` extra cannot go.

The extra's three wheels (~226 MB) exceed what travels to the GPU machine (64 MiB), so its pair cannot
compile there. This script splits the work at the pair's own boundary instead:

    python tests/mlir_cuda_replay.py build DIR [--arch sm_90]   # here: render + compile with the CUDA mlir pair
    python tests/mlir_cuda_replay.py run DIR                    # on the GPU: load, run, compare with the CPU

`build` renders every named kernel family plus every unary and binary op (float32, float16, int32) with the
CUDA `mlir` pair (MLIR -> PassManager -> LLVM IR -> PTX -> nvJitLink CUBIN), exactly what
`MOROK_CUDA_COMPILER=mlir` would load, and pickles the CompiledSpecs (CUBIN, launch information, AST).
`run` loads each CUBIN through the CUDA runtime (`device.runtime(compiled)`: the checked call, the launch
bounds check), runs it on random inputs sized from its own launch check, and compares every buffer with
the same AST compiled by the CPU's llvm pair on the same inputs (the CPU pair is itself tested against
numpy). Exit status 1 if any kernel differs.
"""
from __future__ import annotations

import argparse
import hashlib
import pickle
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def kernels():
    from morok_py import dtypes, kernels as K
    out = [(name, K.named(name)) for name in K.NAMED]
    for dt in (dtypes.float32, dtypes.float16):
        out += [(f"unary_{fn}_{dt.name}", K.unary(fn, dtype=dt)) for fn in K.UNARY if fn not in ("isnan", "isinf")]
        out += [(f"binary_{op}_{dt.name}", K.binary(op, dtype=dt)) for op in K.BINARY]
    out += [(f"binary_{op}_int32", K.binary(op, dtype=dtypes.int32)) for op in ("add", "sub", "mul", "max")]
    out += [("matmul_float16", K.matmul(dtype=dtypes.float16)), ("softmax_float16", K.softmax(dtype=dtypes.float16))]
    return out


def build(folder: Path, arch: str) -> int:
    from morok_py.backends.cuda import compile_only_pairs
    pairs = [(r, c) for r, c in compile_only_pairs(arch) if c.cache_key == "mlir"]
    if not pairs:
        raise SystemExit("no CUDA mlir pair")
    r, c = pairs[0]
    why = c.available()
    if why is not None:
        raise SystemExit(f"the CUDA mlir pair is unavailable here: {why}")
    bundle, t0 = [], time.perf_counter()
    for name, ast in kernels():
        try:
            compiled = c.compile(r.render(ast, name))
        except TypeError as e:          # a kernel family that refuses this dtype (e.g. an integer-only op)
            print(f"skip {name}: {e}")
            continue
        assert compiled.bytes[:4] == b"\x7fELF" and compiled.arch == arch
        # the AST and the CUBIN travel; the launch information is rendered again there (printing MLIR
        # needs no extra) and the MLIR text's digest proves it is the same kernel
        bundle.append((name, ast, compiled.bytes, hashlib.sha256(compiled.src.encode() if compiled.src else
                                                                 r.render(ast, name).src.encode()).hexdigest()))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bundle.pkl").write_bytes(pickle.dumps({"arch": arch, "identity": c.identity(),
                                                      "kernels": bundle}))
    print(f"built {len(bundle)} CUBINs with the CUDA mlir pair for {arch} in {time.perf_counter() - t0:.1f} s "
          f"({c.identity()})")
    return 0


def _values(info) -> dict[str, int]:
    # every variable at a size that is no multiple of a vector or tile width, within its bounds
    prefer = [1003, 37, 129, 19, 5]
    return {v.name: max(v.min, min(v.max, prefer[i % len(prefer)])) for i, v in enumerate(info.variables)}


def run(folder: Path) -> int:
    from morok_py import Buffer
    from morok_py.backends.cuda import compile_only_pairs
    from morok_py.device import CompiledSpec
    from morok_py.registry import get_device
    from morok_py.search import _inputs
    data = pickle.loads((folder / "bundle.pkl").read_bytes())
    gpu, cpu = get_device("CUDA"), get_device("CPU")
    print(f"{gpu} ({gpu.info()['name']}); CUBINs built for {data['arch']} by {data['identity']}")
    renderer = next(r for r, c in compile_only_pairs(data["arch"]) if c.cache_key == "mlir")
    rng = np.random.default_rng(0)
    bad = 0
    for name, ast, cubin, digest in data["kernels"]:
        spec = renderer.render(ast, name)
        if hashlib.sha256(spec.src.encode()).hexdigest() != digest:
            raise SystemExit(f"{name}: the MLIR rendered here differs from the one compiled into the CUBIN")
        compiled = CompiledSpec.from_bytes(spec, cubin, arch=data["arch"], compiler="mlir")
        prog = gpu.runtime(compiled)
        ref = cpu.compile(compiled.ast, name)
        values = _values(compiled.launch)
        arrays = _inputs(compiled.launch, values, rng)
        gbufs = [Buffer.from_numpy(a, gpu) for a in arrays]
        cbufs = [Buffer.from_numpy(a, cpu) for a in arrays]
        prog(*gbufs, **values)
        gpu.synchronize()
        ref(*cbufs, **values)
        worst = 0.0
        ok = True
        for g, c in zip(gbufs, cbufs):
            got, want = g.numpy(), c.numpy()
            if got.dtype.kind == "f":
                g64, w64 = got.astype(np.float64), want.astype(np.float64)
                tol = 2e-3 if got.dtype == np.float16 else 2e-5
                scale = float(np.nanmax(np.abs(w64))) if np.isfinite(w64).any() else 1.0
                err = np.abs(g64 - w64)
                fin = np.isfinite(w64)
                ok &= bool(np.array_equal(np.isnan(g64), np.isnan(w64)) and np.array_equal(g64[~fin & ~np.isnan(w64)],
                                                                                             w64[~fin & ~np.isnan(w64)]))
                ok &= bool((err[fin] <= tol * np.abs(w64[fin]) + tol * 1e-2 * (1 + scale)).all())
                worst = max(worst, float((err[fin] / (np.abs(w64[fin]) + 1e-30)).max(initial=0.0)))
            else:
                ok &= bool(np.array_equal(got, want))
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name:28s} {values}  worst relative error {worst:.2e}")
    print(f"{len(data['kernels']) - bad} of {len(data['kernels'])} MLIR-compiled CUBINs match the CPU's llvm pair")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["build", "run"])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--arch", default="sm_90")
    a = ap.parse_args()
    return build(a.folder, a.arch) if a.mode == "build" else run(a.folder)


if __name__ == "__main__":
    raise SystemExit(main())
