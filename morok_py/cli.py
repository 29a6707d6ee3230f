"""The `morok` command line: `devices`, `demo` and `compile`.

`devices` probes each GPU backend in its own subprocess (one GPU vendor stack per process), `demo`
runs a small model forward pass on `MOROK_DEVICE` and checks it against numpy, `compile` renders and
compiles a named kernel for any device and arch without needing the hardware.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from . import cache, config, kernels
from .device import Device, DeviceSpec
from .errors import MorokError, UnknownNameError

GPU_BACKENDS = ("CUDA", "ROCM")
MAX_ORDINALS = 16


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---- morok devices ---------------------------------------------------------------------------

def _describe(dev: Device) -> dict:
    info = dict(dev.info())
    pairs = []
    for r, c in dev.compilers:
        why = c.available()
        pairs.append(c.cache_key + ("" if why is None else f" (unavailable: {why})"))
    info["compilers"] = pairs
    info["default"] = dev.compiler.cache_key
    return info


def probe_backend(kind: str) -> list[dict]:
    """Open `kind`:0, :1, ... in this process until one fails; one dict per ordinal tried."""
    from .registry import get_device
    rows: list[dict] = []
    count = None
    try:
        import importlib
        mod = importlib.import_module(f"morok_py.backends.{kind.lower()}")
        fn = getattr(mod, "device_count", None)
        if fn is None:
            sub = importlib.import_module(f"morok_py.backends.{kind.lower()}.device")
            fn = getattr(sub, "device_count", None)
        count = int(fn()) if fn is not None else None
    except Exception:
        count = None
    for ordinal in range(count if count else MAX_ORDINALS):
        name = f"{kind}:{ordinal}" if kind != "CPU" else "CPU"
        try:
            dev = get_device(name)
            rows.append({"device": name, "available": True, **_describe(dev)})
        except (MorokError, ImportError, ValueError, OSError, RuntimeError) as e:
            if ordinal == 0 or count:
                rows.append({"device": name, "available": False,
                             "reason": f"{type(e).__name__}: {e}".splitlines()[0]})
            break
        if kind == "CPU":
            break
    return rows


def _probe_in_subprocess(kind: str, timeout: float = 120.0) -> list[dict]:
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    code = "import json,sys; from morok_py.cli import probe_backend; print(json.dumps(probe_backend(sys.argv[1])))"
    try:
        out = subprocess.run([sys.executable, "-c", code, kind], capture_output=True, text=True, env=env,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{"device": f"{kind}:0", "available": False, "reason": f"probe timed out after {timeout:.0f} s"}]
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("["):
            return json.loads(line)
    err = (out.stderr.strip().splitlines() or ["no output"])[-1]
    return [{"device": f"{kind}:0", "available": False, "reason": f"probe failed (exit {out.returncode}): {err}"}]


def cmd_devices(args: argparse.Namespace) -> int:
    from .registry import registered
    rows: list[dict] = probe_backend("CPU")
    for kind in GPU_BACKENDS:
        rows += _probe_in_subprocess(kind)
    for kind in registered():
        if kind not in ("CPU",) + GPU_BACKENDS:
            rows += _probe_in_subprocess(kind)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table, why = [], []
    for r in rows:
        if r["available"]:
            extra = r.get("name", "")
            table.append([r["device"], "yes", r.get("arch", ""), ", ".join(r.get("compilers", [])), extra])
        else:
            reason = r["reason"]
            short = reason if len(reason) <= 60 else reason[:57] + "..."
            table.append([r["device"], "no", "", "", "unavailable: " + short])
            if short != reason:
                why.append(f"{r['device']}: unavailable: {reason}")
    print(_table(["device", "available", "arch", "compiler pairs", "notes"], table))
    if why:
        print("\n" + "\n".join(why))
    print(f"\ndefault device (MOROK_DEVICE): {Device.DEFAULT}")
    return 0


# ---- morok demo -------------------------------------------------------------------------------

@dataclass
class DemoStep:
    """One kernel of the demo model: its AST, how to call it, and how much work it does."""

    name: str
    ast: Any
    inputs: list[str]
    output: str
    values: dict[str, int]
    flops: float
    nbytes: float


@contextlib.contextmanager
def _fresh_disk_cache() -> Iterator[str]:
    """Point MOROK_CACHE_DIR at an empty temp dir so that the first compile is a real (cold) one."""
    old = {k: os.environ.get(k) for k in ("MOROK_CACHE_DIR", "MOROK_CACHE")}
    with tempfile.TemporaryDirectory(prefix="morok-demo-") as d:
        os.environ["MOROK_CACHE_DIR"] = d
        os.environ["MOROK_CACHE"] = "1"
        try:
            yield d
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def build_model(batch: int, d_in: int, hidden: int, classes: int) -> list[DemoStep]:
    """A two-layer MLP classifier: logits = relu(x @ W1 + b1) @ W2, probs = softmax(logits),
    plus a row sum of probs (each must be 1) and a fused dense layer for comparison."""
    f = 4
    B, D, H, C = batch, d_in, hidden, classes
    return [
        DemoStep("matmul x@W1", kernels.matmul(), ["x", "W1"], "z1", {"M": B, "N": H, "K": D},
                 2.0 * B * H * D, f * (B * D + D * H + B * H)),
        DemoStep("bias+relu", kernels.bias_relu(), ["z1", "b1"], "h", {"M": B, "N": H},
                 2.0 * B * H, f * (2 * B * H + H)),
        DemoStep("matmul h@W2", kernels.matmul(), ["h", "W2"], "logits", {"M": B, "N": C, "K": H},
                 2.0 * B * C * H, f * (B * H + H * C + B * C)),
        DemoStep("softmax", kernels.softmax(), ["logits"], "probs", {"rows": B, "cols": C},
                 5.0 * B * C, f * 2 * B * C),
        DemoStep("row sum", kernels.reduce_axis("sum", [None, None], 1), ["probs"], "rowsum",
                 {"d0": B, "d1": C}, 1.0 * B * C, f * (B * C + B)),
        DemoStep("dense (fused)", kernels.matmul_bias_relu(), ["x", "W1", "b1"], "h_fused",
                 {"M": B, "N": H, "K": D}, 2.0 * B * H * D + 2.0 * B * H, f * (B * D + D * H + H + B * H)),
    ]


def numpy_reference(host: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    x, w1, b1, w2 = (host[k].astype(np.float64) for k in ("x", "W1", "b1", "W2"))
    z1 = x @ w1
    h = np.maximum(z1 + b1, 0)
    logits = h @ w2
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = e / e.sum(axis=1, keepdims=True)
    return {"z1": z1, "h": h, "logits": logits, "probs": probs, "rowsum": probs.sum(axis=1), "h_fused": h}


def _rate(step: DemoStep, seconds: float) -> str:
    if seconds <= 0:
        return "-"
    intensity = step.flops / step.nbytes
    if intensity >= 1.0:
        return f"{step.flops / seconds / 1e9:.2f} GFLOP/s"
    return f"{step.nbytes / seconds / 1e9:.2f} GB/s"


def cmd_demo(args: argparse.Namespace) -> int:
    from .buffer import Buffer
    from .registry import get_device
    dev = get_device(args.device or Device.DEFAULT)
    rng = np.random.default_rng(args.seed)
    B, D, H, C = args.batch, args.d_in, args.hidden, args.classes
    host = {
        "x": rng.standard_normal((B, D)).astype(np.float32),
        "W1": (rng.standard_normal((D, H)) / np.sqrt(D)).astype(np.float32),
        "b1": rng.standard_normal(H).astype(np.float32) * 0.1,
        "W2": (rng.standard_normal((H, C)) / np.sqrt(H)).astype(np.float32),
    }
    ref = numpy_reference(host)
    shapes = {"z1": B * H, "h": B * H, "logits": B * C, "probs": B * C, "rowsum": B, "h_fused": B * H}
    bufs = {k: Buffer.from_numpy(v, dev) for k, v in host.items()}
    bufs.update({k: dev.buffer(n, "float32") for k, n in shapes.items()})
    steps = build_model(B, D, H, C)

    print(f"morok demo on {dev.name} (arch {dev.arch}, compiler {dev.compiler.cache_key}): "
          f"MLP batch={B} in={D} hidden={H} classes={C}, float32")
    rows, failures = [], []
    for st in steps:
        with _fresh_disk_cache():
            cache.clear_memory_caches()
            t0 = time.perf_counter()
            prog = dev.compile(st.ast)                  # render + compile + load, empty caches
            cold = time.perf_counter() - t0
            cache.clear_memory_caches()
            t0 = time.perf_counter()
            prog = dev.compile(st.ast)                  # disk cache hit: render + read + load
            disk = time.perf_counter() - t0
            t0 = time.perf_counter()
            prog = dev.compile(st.ast)                  # method cache hit
            mem = time.perf_counter() - t0
            args_ = [bufs[k] for k in st.inputs] + [bufs[st.output]]
            prog(*args_, **st.values)                   # warm-up
            times = [prog(*args_, wait=True, **st.values) for _ in range(args.runs)]
            run = statistics.median(times)
            got = bufs[st.output].numpy().astype(np.float64)
            want = ref[st.output].reshape(-1)
            err = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
            ok = err < 1e-4
            if not ok:
                failures.append(f"{st.name}: max relative error {err:.3g}")
            rows.append([st.name, f"{cold * 1e3:.1f}", f"{disk * 1e3:.2f}", f"{mem * 1e6:.1f}",
                         f"{run * 1e6:.1f}", _rate(st, run), f"{err:.1e}", "ok" if ok else "MISMATCH"])
    print(_table(["kernel", "compile cold ms", "disk hit ms", "mem hit us", "run us (median)",
                  "throughput", "max err / max|ref|", "vs numpy"], rows))
    print(f"\ncold = render+compile+load with empty caches; disk hit = memory cache cleared, compiled bytes "
          f"read from disk; mem hit = method cache; run = median of {args.runs} launches with wait=True")
    top = np.argmax(bufs["probs"].numpy().reshape(B, C), axis=1)
    if np.array_equal(top, np.argmax(ref["probs"], axis=1)):
        print(f"predicted classes match numpy for all {B} rows")
    else:
        failures.append("argmax of probs differs from numpy")
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


# ---- morok compile ----------------------------------------------------------------------------

def compile_only_pairs(device: str, arch: str | None) -> list:
    """(renderer, compiler) pairs for `device` and `arch` that need no hardware."""
    spec = DeviceSpec.parse(device)
    if spec.type == "CPU":
        from .backends.cpu.compiler import CPUCompiler, llvm, mlir_pair
        from .backends.cpu.renderer import CPURenderer
        compiler = CPUCompiler(arch)      # the register tile follows the target's features, not the host's
        return [(CPURenderer(spec, llvm().get_process_triple(), compiler.renderer_features), compiler),
                mlir_pair(spec, compiler)]
    import importlib
    try:
        mod = importlib.import_module(f"morok_py.backends.{spec.type.lower()}.device")
    except ImportError as e:
        raise MorokError(f"{spec.type}: backend could not be imported ({e})") from None
    fn: Callable | None = getattr(mod, "compile_only_pairs", None)
    if fn is None:
        raise MorokError(f"{spec.type}: the backend offers no compile_only_pairs(arch); compile-only work is not "
                         f"supported for it yet")
    if not arch:
        raise MorokError(f"{spec.type}: pass --arch (e.g. sm_90 or gfx942) to compile without the hardware")
    return list(fn(arch))


def describe_binary(data: bytes) -> str:
    """A `file`-like summary of compiled bytes (ELF class, machine, type, symbols)."""
    import hashlib
    lines = [f"{len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:16]}"]
    if data[:4] == b"\x7fELF":
        cls = {1: "32-bit", 2: "64-bit"}.get(data[4], "?")
        order = "little" if data[5] == 1 else "big"
        etype = int.from_bytes(data[16:18], order)
        machine = int.from_bytes(data[18:20], order)
        machines = {62: "x86-64", 183: "AArch64", 190: "NVIDIA CUDA", 224: "AMD GPU", 243: "RISC-V"}
        types = {1: "relocatable", 2: "executable", 3: "shared object"}
        lines.insert(0, f"ELF {cls} {types.get(etype, etype)}, {machines.get(machine, f'machine {machine}')}")
        try:
            import io
            from elftools.elf.elffile import ELFFile
            elf = ELFFile(io.BytesIO(data))
            syms = elf.get_section_by_name(".symtab")
            if syms is not None:
                funcs = [s.name for s in syms.iter_symbols() if s["st_info"]["type"] == "STT_FUNC" and s.name]
                if funcs:
                    lines.append("functions: " + ", ".join(funcs))
            lines.append("sections: " + ", ".join(s.name for s in elf.iter_sections() if s.name))
        except Exception:
            pass
    else:
        lines.insert(0, "binary (not ELF)")
        lines.append("first bytes: " + data[:32].hex(" "))
    return "\n".join(lines)


def _text_payload(data: bytes) -> str | None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text.isprintable() or all(c.isprintable() or c in "\n\t\r" for c in text) else None


def cmd_compile(args: argparse.Namespace) -> int:
    ast = kernels.named(args.kernel)
    pairs = compile_only_pairs(args.device, args.arch)
    if args.compiler:
        chosen = [(r, c) for r, c in pairs if c.cache_key == args.compiler]
        if not chosen:
            raise UnknownNameError(f"{args.device} has no compiler {args.compiler!r}; "
                                   f"registered: {', '.join(c.cache_key for _, c in pairs)}")
        renderer, compiler = chosen[0]
    else:
        renderer, compiler = pairs[0]
    spec = renderer.render(ast, name=args.kernel)
    if args.emit == "source":
        out: str | bytes = spec.src
    else:
        compiled = compiler.compile(spec)
        out = compiled.src if compiled.src is not None else compiled.bytes
    if args.output:
        mode = "wb" if isinstance(out, bytes) else "w"
        with open(args.output, mode) as f:
            f.write(out)
        size = len(out.encode() if isinstance(out, str) else out)
        print(f"wrote {args.emit} of {args.kernel} for {args.device} {compiler.arch} ({compiler.cache_key}) "
              f"to {args.output} ({size} bytes)", file=sys.stderr)
        return 0
    if isinstance(out, bytes):
        text = _text_payload(out)
        if text is not None:         # PTX and other text targets
            print(text)
        else:
            print(f"{args.kernel} for {args.device} {compiler.arch} ({compiler.cache_key}), symbol {spec.symbol}:")
            print(describe_binary(out))
            print("(binary output: pass -o FILE to write it)")
    else:
        print(out)
    return 0


# ---- entry point ------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="morok", description="Render, compile, load and run UOp kernels on "
                                "CPU (LLVM), CUDA and ROCm devices.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("devices", help="list devices, their availability, arch and compiler pairs")
    d.add_argument("--json", action="store_true", help="print JSON instead of a table")
    d.set_defaults(fn=cmd_devices)
    m = sub.add_parser("demo", help="run a small MLP forward pass on MOROK_DEVICE and check it against numpy")
    m.add_argument("--device", default=None, help="device to run on (default: MOROK_DEVICE, else CPU)")
    m.add_argument("--batch", type=int, default=256)
    m.add_argument("--d-in", type=int, default=784)
    m.add_argument("--hidden", type=int, default=512)
    m.add_argument("--classes", type=int, default=10)
    m.add_argument("--runs", type=int, default=10, help="timed launches per kernel (median reported)")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(fn=cmd_demo)
    c = sub.add_parser("compile", help="render and compile a named kernel; needs no hardware")
    c.add_argument("kernel", help=f"one of: {', '.join(kernels.NAMED)}")
    c.add_argument("--device", default="CPU", help="CPU, CUDA or ROCM")
    c.add_argument("--arch", default=None, help="target arch, e.g. znver4, sm_90, gfx942 (CPU default: host)")
    c.add_argument("--compiler", default=None, help="pick a compiler pair by its cache_key, e.g. llvm-nvptx")
    c.add_argument("--emit", choices=("source", "compiled"), default="source")
    c.add_argument("-o", "--output", default=None, help="write to FILE instead of printing")
    c.set_defaults(fn=cmd_compile)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except (MorokError, ValueError) as e:
        print(f"morok {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:          # `morok compile ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
