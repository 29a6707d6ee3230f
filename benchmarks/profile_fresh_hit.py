"""Where a fresh process spends a disk-cache hit: fills the cache, then in new processes times
`dev.compile` piece by piece (cProfile top entries, and with the driver warmed by a raw
cuModuleLoadData of another cubin first). Diagnostic only: `python benchmarks/profile_fresh_hit.py --device CUDA`."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import compile as compile_bench  # noqa: E402

PYCACHE = tempfile.mkdtemp(prefix="morok-prof-pycache-")

CHILD = r"""
import cProfile, io, json, pstats, sys, time
sys.path.insert(0, {root!r})
t0 = time.perf_counter()
import morok_py
from morok_py import Device, kernels as K
t1 = time.perf_counter()
dev = Device[{device!r}]
t2 = time.perf_counter()
mode = {mode!r}
if mode == "warm_driver":
    # load some other module first: does the first cuModuleLoadData pay a one-time cost?
    from morok_py.cache import DiskCache
    c2 = dev.compile(K.named("add"), name="warmup_other").compiled
    t2 = time.perf_counter()
ast = K.named({kernel!r})
pieces = {{}}
if mode == "pieces":
    # the steps of a hit, one by one, each paying its first-call cost here
    from morok_py import cache as C
    r, c = dev.renderer, dev.compiler
    T = time.perf_counter
    t = T(); ident = C.compiler_identity(c); pieces["compiler_identity"] = T() - t
    t = T(); C.code_fingerprint(r, c); pieces["code_fingerprint"] = T() - t
    t = T(); ast.key; pieces["ast.key"] = T() - t
    t = T(); key = C.ast_key(r, c, ast, {name!r}); pieces["ast_key_rest"] = T() - t
    t = T(); compiled = C.compile_ast(r, c, ast, {name!r}); pieces["compile_ast"] = T() - t
    t = T(); prog = dev.runtime(compiled); pieces["load"] = T() - t
    t = T(); prog2 = dev.runtime(compiled); pieces["load_again"] = T() - t
    C.clear_memory_caches()
pr = cProfile.Profile() if mode == "profile" else None
t3 = time.perf_counter()
if pr: pr.enable()
prog = dev.compile(ast, name={name!r})
if pr: pr.disable()
t4 = time.perf_counter()
again = time.perf_counter(); dev.compile(ast, name={name!r}); again = time.perf_counter() - again
from morok_py.cache import stats
out = {{"mode": mode, "import_s": t1 - t0, "open_s": t2 - t1, "compile_s": t4 - t3, "again_s": again,
        "ast_hits": stats.ast_hits, "renders": stats.renders, "disk_hits": stats.disk_hits,
        "pieces_ms": {{k: round(v * 1e3, 3) for k, v in pieces.items()}}}}
if pr:
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(35)
    out["profile"] = s.getvalue()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(20)
    out["profile_tottime"] = s.getvalue()
print(json.dumps(out))
"""


def child(device, kernel, name, mode, cache, extra_env=None):
    code = CHILD.format(root=str(ROOT), device=device, kernel=kernel, name=name, mode=mode)
    # with Python's bytecode cache, as benchmarks/compile.py runs its children (the fill run writes it)
    env = compile_bench.child_env(PYCACHE, MOROK_CACHE_DIR=cache, MOROK_CACHE="1", **(extra_env or {}))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="CUDA")
    p.add_argument("--kernels", default="add,softmax,matmul")
    a = p.parse_args()
    cache = tempfile.mkdtemp(prefix="morok-prof-")
    for k in a.kernels.split(","):
        name = f"bench_{k}"
        print(f"== {k}: fill", json.dumps({x: y for x, y in child(a.device, k, name, "plain", cache).items()}))
        for mode in ("plain", "plain", "warm_driver", "pieces", "pieces"):
            print(f"== {k}: {mode}", json.dumps(child(a.device, k, name, mode, cache)))
        for env in ({"CUDA_MODULE_LOADING": "EAGER"}, {"CUDA_MODULE_LOADING": "LAZY"}):
            print(f"== {k}: plain {env}", json.dumps(child(a.device, k, name, "plain", cache, env)))
        r = child(a.device, k, name, "profile", cache)
        print(f"== {k}: profile compile_s={r['compile_s']:.4f}")
        print(r["profile"])
        print(r["profile_tottime"])


if __name__ == "__main__":
    main()
