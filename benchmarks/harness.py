"""The shared benchmark harness: device selection, warm-up and repeats with the median, timers
(the program's own `wait=True` time; CUDA events for GPU peers; `perf_counter` on the CPU), a
progress bar, a terminal table, the machine record, and the result files.

Records are flat: one per (benchmark, size, peer), so that a reader filters them with one
comprehension. A measurement with no peer is one record with `peer: null`. `ratio` is ours over
the peer's, oriented so that higher is better (for times: peer_time / our_time).

A result is a current fact: each benchmark writes `benchmarks/results/<machine kind>/<name>.json`
(and `<name>.png`), replacing the last run of the same benchmark on the same kind of machine, with the
commit and the date inside; git keeps the history. The name is the script's, then its mode
(`kernels-suite`), a `--tag`, and on a GPU the compiler pair (`kernels-suite-nvrtc`).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import datetime as _dt
import importlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
# the results root; MOROK_RESULTS_DIR moves it (the GPU runner writes a copy of the tree elsewhere)
RESULTS = Path(os.environ.get("MOROK_RESULTS_DIR") or Path(__file__).resolve().parent / "results")

# a source checkout runs without installing: put the repository root on the path
try:
    import morok_py  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))

# OpenMP runtimes (numba's default threading layer) spin-wait after each parallel region; on a
# machine with few cores those spinning threads steal the cores from whatever is timed next.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_kind  # noqa: E402
from report import fmt_time, target_value_mark  # noqa: E402  (report.py stays light: no numpy, no morok_py)

# ---------------------------------------------------------------------------------------------
# command line and device


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default=os.environ.get("MOROK_DEVICE", "CPU"),
                   help="CPU, CUDA, CUDA:1, ROCM (default: $MOROK_DEVICE or CPU)")
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats (a smoke run)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs before timing")
    p.add_argument("--repeats", type=int, default=7, help="timed runs; the median is reported")
    p.add_argument("--no-save", action="store_true", help="print only: write no JSON or PNG (--quick implies it)")
    p.add_argument("--results", default=str(RESULTS),
                   help="results root: the JSON and PNG go to ROOT/<machine kind>/<name>.json")
    p.add_argument("--tag", default="", help="appended to the result's name (a variant of the run)")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="first wait up to SECONDS for the 1-minute load average to drop below 0.5")
    return p


@contextlib.contextmanager
def constants(settings: str):
    """';'-separated MODULE.NAME=VALUE (MODULE under morok_py, or a `backends.` module; VALUE a Python literal)
    set for the block, then restored: a heuristic's constant against its alternative in one process. The disk
    cache is off inside the block (MOROK_CACHE=0): its AST-level key holds the kernel and the library's files,
    not the values of their constants, so a kernel whose lowering a setting changes (a register tile's rows,
    codegen/opt.py's MERGED_SPARE_REGISTERS) would load the code compiled under the other setting."""
    olds = []
    cache = os.environ.get("MOROK_CACHE")
    try:
        for setting in filter(None, settings.split(";")):
            key, value = setting.split("=", 1)
            mod_name, name = key.strip().rsplit(".", 1)
            full = mod_name if mod_name.startswith("backends.") else "morok_py." + mod_name
            mod = importlib.import_module(full)
            if not hasattr(mod, name):
                raise SystemExit(f"{setting}: {full} has no {name}")
            olds.append((mod, name, getattr(mod, name)))
            setattr(mod, name, ast.literal_eval(value.strip()))
        os.environ["MOROK_CACHE"] = "0"
        yield
    finally:
        for mod, name, old in reversed(olds):
            setattr(mod, name, old)
        if cache is None:
            os.environ.pop("MOROK_CACHE", None)
        else:
            os.environ["MOROK_CACHE"] = cache


def block_times(fn, warm: int, timed: int) -> tuple[float, list[float]]:
    """One interleaved block of a runtime's runs: `settle()` (the seconds it waited), then `warm` untimed runs
    (they wake the runtime's thread pool) and the times of `timed` runs."""
    waited = settle()
    for _ in range(warm):
        fn()
    times = []
    for _ in range(timed):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return waited, times


def wait_quiet(seconds: float, below: float = 0.5) -> None:
    """Other work on the machine skews every number: optionally wait for it to settle."""
    if seconds <= 0 or not hasattr(os, "getloadavg"):
        return
    end = time.time() + seconds
    while os.getloadavg()[0] >= below and time.time() < end:
        time.sleep(5)
    load = os.getloadavg()[0]
    if load >= below:
        note(f"load average still {load:.2f} after {seconds:g}s: numbers may be skewed by other work")


def settle(max_s: float = 3.0, window: float = 0.05, busy_share: float = 0.1) -> float:
    """Wait until this process's threads go quiet: its CPU time over the last `window` seconds under
    `busy_share` of one core, at least one window and at most `max_s`; returns the seconds waited. Between
    two runtimes' blocks in one process: onnxruntime's intra-op threads spin on after a run (on the H100
    host's 16-core Xeon its MLP session burned 0.88 CPU-seconds in the 0.2 s after a run; this wait ended
    within 0.15 s there), and the other runtime's run right after one of its runs took up to 6x longer."""
    import resource

    def used() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    start = time.perf_counter()
    while True:
        c0 = used()
        time.sleep(window)
        if used() - c0 < busy_share * window or time.perf_counter() - start >= max_s:
            return time.perf_counter() - start


def open_device(name: str, wait: float = 0.0):
    wait_quiet(wait)
    from morok_py import Device, MorokError
    try:
        dev = Device[name]
    except (MorokError, ValueError) as e:
        raise SystemExit(f"cannot benchmark {name}: {e}") from None
    try:
        compile_only = bool((dev.info() or {}).get("compile_only"))
    except Exception:
        compile_only = False
    if compile_only:
        raise SystemExit(f"{name} is open for compiling only (no driver here): nothing can be timed")
    return dev


def is_gpu(dev) -> bool:
    return dev.spec.type in ("CUDA", "ROCM")


def optional(module: str):
    """Import a peer library if it is installed (and usable), else None."""
    try:
        return importlib.import_module(module)
    except Exception:
        return None


def gpu_peer_libs(dev) -> dict[str, Any]:
    """The GPU peers that are installed and see a GPU of this device's vendor: {'cupy': cp, 'torch': torch}."""
    out: dict[str, Any] = {}
    if not is_gpu(dev):
        return out
    cp = optional("cupy")
    if cp is not None:
        try:
            cp.cuda.Device(dev.spec.ordinal).use()
            cp.cuda.runtime.getDeviceCount()
            out["cupy"] = cp
        except Exception as e:
            note(f"cupy is installed but unusable here ({type(e).__name__}: {e}); skipping it")
    torch = optional("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():   # ROCm builds of torch answer here too
                torch.cuda.set_device(dev.spec.ordinal)
                out["torch"] = torch
        except Exception as e:
            note(f"torch is installed but unusable here ({type(e).__name__}: {e}); skipping it")
    return out


def note(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# timing


def measure(fn: Callable[[], float | None], warmup: int = 2, repeats: int = 7,
            min_time: float = 0.0, max_repeats: int = 2000, budget: float = 15.0) -> float:
    """Median seconds of `fn`. `fn` returns its own time (a program's `wait=True` time, an event
    time, a float) or anything else (None, a result), in which case it is timed with perf_counter. With `min_time`, short runs are
    repeated until about that much time was spent (at most `max_repeats`), which steadies tiny sizes.
    A slow `fn` stops after 3 runs once `budget` seconds are spent (warm-up drops to one run)."""
    t0 = time.perf_counter()
    for i in range(warmup):
        fn()
        if time.perf_counter() - t0 > budget / 4:
            break
    times: list[float] = []
    spent = 0.0
    while True:
        t0 = time.perf_counter()
        t = fn()
        wall = time.perf_counter() - t0
        times.append(float(t) if isinstance(t, (float, np.floating)) else wall)   # anything else is a result
        spent += wall
        if len(times) >= min(3, repeats) and spent >= budget:
            break
        if len(times) >= repeats and (spent >= min_time or len(times) >= max_repeats):
            break
    return statistics.median(times)


def interleaved(fns: Sequence[tuple[str, Callable[[], float | None]]], rounds: int = 1, repeats: int = 7,
                warmup: int = 2, before: Callable[[str, str | None], None] | None = None) -> dict[str, list[float]]:
    """Each label's round medians. Every round runs each `fn` `repeats` times in turn (its median is the
    round's value), so drift of a shared machine over the run lands on all of them alike instead of on
    whichever was timed during a burst of other load. `fn` returns its own time or anything else (then
    perf_counter times it), as in `measure`. `before(label, previous label)` runs before each block (the
    CPU benchmarks pause there while a peer's BLAS threads stop spinning). One round is the plain
    sequential measurement: each fn's block after the previous one's."""
    def once(fn) -> float:
        t0 = time.perf_counter()
        t = fn()
        wall = time.perf_counter() - t0
        return float(t) if isinstance(t, (float, np.floating)) else wall

    prev: str | None = None
    for label, fn in fns:
        if before is not None:
            before(label, prev)
        for _ in range(warmup):
            fn()
        prev = label
    out: dict[str, list[float]] = {label: [] for label, _ in fns}
    for _ in range(max(1, rounds)):
        for label, fn in fns:
            if before is not None:
                before(label, prev)
            out[label].append(statistics.median(once(fn) for _ in range(max(1, repeats))))
            prev = label
    return out


def round_summary(ours: list[float], peer: list[float] | None = None) -> dict[str, Any]:
    """The fields a record keeps of interleaved rounds: every round median, the best round, and (against
    a peer timed in the same rounds) the best rounds' ratio and the range of per-round ratios."""
    d: dict[str, Any] = {"rounds": ours, "best_s": min(ours)}
    if peer:
        d["peer_rounds"] = peer
        d["best_ratio"] = min(peer) / min(ours)
        per = [p / o for o, p in zip(ours, peer)]
        d["round_ratio_range"] = [min(per), max(per)]
    return d


def event_timer(lib_name: str, lib) -> Callable[[Callable[[], Any]], float]:
    """A function that runs `fn` between two GPU events of the peer library and returns seconds."""
    if lib_name == "cupy":
        cp = lib

        def run(fn):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return cp.cuda.get_elapsed_time(start, end) / 1e3
        return run
    if lib_name == "torch":
        torch = lib

        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return run
    raise ValueError(lib_name)


def gpu_sync(lib_name: str, lib) -> None:
    if lib_name == "cupy":
        lib.cuda.get_current_stream().synchronize()
    elif lib_name == "torch":
        lib.cuda.synchronize()


def cache_bytes() -> int:
    """The host's last-level cache in bytes (for rotating inputs that would otherwise stay cached)."""
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for idx in base.glob("index*"):
            s = (idx / "size").read_text().strip()
            m = re.match(r"(\d+)([KMG]?)", s)
            if m:
                best = max(best, int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)])
    except OSError:
        pass
    return best or (32 << 20)


def rotations(nbytes: int, cache: int, cap: int = 64) -> int:
    """How many input sets to cycle through so that their total is at least twice the cache."""
    if nbytes <= 0 or nbytes >= cache:
        return 1
    return max(1, min(cap, math.ceil(2 * cache / nbytes)))


class Cycle:
    """Calls `fns[i % len(fns)]`: the same work on rotating input sets."""

    def __init__(self, fns: Sequence[Callable[[], Any]]) -> None:
        self.fns, self.i = list(fns), 0

    def __call__(self):
        f = self.fns[self.i % len(self.fns)]
        self.i += 1
        return f()


# ---------------------------------------------------------------------------------------------
# progress bar


class Progress:
    """tqdm when installed, else a plain text bar on stderr (one line per step when not a terminal)."""

    def __init__(self, total: int, desc: str = "") -> None:
        self.total, self.desc, self.n = max(total, 1), desc, 0
        self.t0 = time.perf_counter()
        tqdm = optional("tqdm")
        self._tqdm = tqdm.tqdm(total=total, desc=desc, file=sys.stderr, leave=False) if tqdm else None
        self._tty = sys.stderr.isatty()
        self.label = ""

    def step(self, label: str = "") -> None:
        """Announce the step about to run."""
        self.label = label
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(label)
            return
        self._draw()

    def advance(self) -> None:
        self.n += 1
        if self._tqdm is not None:
            self._tqdm.update(1)

    def _draw(self) -> None:
        width = 28
        filled = int(width * self.n / self.total)
        bar = "#" * filled + "-" * (width - filled)
        line = f"{self.desc} [{bar}] {self.n}/{self.total} {time.perf_counter() - self.t0:6.1f}s {self.label}"
        if self._tty:
            sys.stderr.write("\r" + line[:160].ljust(160))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        elif self._tty:
            sys.stderr.write("\r" + " " * 160 + "\r")
            sys.stderr.flush()


# ---------------------------------------------------------------------------------------------
# results


@dataclass
class Results:
    """Collects records for one script and writes them into the day's JSON file."""

    script: str
    device: Any
    args: argparse.Namespace
    records: list[dict] = field(default_factory=list)

    def add(self, name: str, size: int, unit: str, value: float, peer: str | None = None,
            peer_value: float | None = None, higher_is_better: bool = False, **extra: Any) -> dict:
        """One record. `unit` is the unit of value and peer_value; the ratio is oriented so that
        higher is better for us whatever the unit."""
        rec: dict[str, Any] = {"script": self.script, "name": name, "size": size, "unit": unit,
                               "value": value, "peer": peer, "peer_value": peer_value, "ratio": None}
        if peer_value is not None and value and peer_value:
            rec["ratio"] = (value / peer_value) if higher_is_better else (peer_value / value)
        rec["better"] = "higher" if higher_is_better else "lower"
        rec.update(extra)
        self.records.append(rec)
        return rec

    def save(self, chart: Callable[[Path], None] | None = None, mode: str = "") -> Path | None:
        """Write `<results>/<machine kind>/<name>.json` (and the chart's `<name>.png`), replacing the last."""
        if self.args.no_save or self.args.quick:
            return None
        mach = machine(self.device)
        name = result_name(self.script, self.device, mode, getattr(self.args, "tag", ""))
        for r in self.records:
            r.setdefault("git", mach["git"])
        path = write_result(name, {"machine": mach, "results": self.records}, self.device, Path(self.args.results))
        if chart is not None:
            png = path.with_suffix(".png")
            if optional("matplotlib") is None:
                note("matplotlib is not installed: skipping the chart (pip install matplotlib)")
            else:
                chart(png)
                note(f"wrote {_show(png)}")
        return path


def result_name(script: str, dev=None, mode: str = "", tag: str = "") -> str:
    """`script[-mode][-tag]`, then the compiler pair on a GPU or a CPU pair other than the default."""
    parts = [script, mode, tag]
    if dev is not None:
        key = dev.compiler.cache_key
        if is_gpu(dev) or key != dev.compilers[0][1].cache_key:
            parts.append(key)
    return "-".join(p for p in parts if p)


def kind_of(dev=None) -> str:
    """The machine kind of a device (None: the CPU)."""
    if dev is None or not is_gpu(dev):
        return machine_kind("CPU")
    return machine_kind(dev.name, _gpu_name(dev))


def commit() -> str | None:
    """The commit measured: MOROK_BENCH_GIT where the tree is a copy whose .git is not its own (the GPU
    machines get a working tree over an older checkout); else HEAD, "-dirty" with uncommitted changes."""
    git = os.environ.get("MOROK_BENCH_GIT") or None
    if git is None:
        try:
            git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, timeout=10).stdout.strip() or None
            dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no",
                                    "--", ".", ":!benchmarks/results", ":!tests/results"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            if git and dirty:
                git += "-dirty"
        except Exception:
            git = None
    return git


def write_result(name: str, doc: dict, dev=None, root: Path | str | None = None, kind: str | None = None) -> Path:
    """Write one benchmark's result to `<root>/<kind>/<name>.json`, replacing the last, with the benchmark's
    name, the machine kind, the commit and the date first in the file."""
    kind = kind or kind_of(dev)
    folder = Path(root or RESULTS) / kind
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    head = {"benchmark": name, "machine_kind": kind, "commit": commit(), "date": _dt.date.today().isoformat()}
    out = {**head, **{k: v for k, v in doc.items() if k not in head}}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out, indent=1, default=_json_default) + "\n")
    os.replace(tmp, path)
    note(f"wrote {_show(path)}")
    return path


def save_result(name: str, doc: dict, json_path: str | None = None, dev=None) -> Path:
    """A benchmark's result: to `json_path` as it is where the caller names a file (--json), else
    `write_result(name, doc, dev)` (the results tree, the current file for this machine kind)."""
    if not json_path:
        return write_result(name, doc, dev)
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    note(f"wrote {_show(path)}")
    return path


def _show(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    return str(o)


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(module)
    except Exception:
        mod = optional(module)
        return getattr(mod, "__version__", None) if mod else None


def _gpu_name(dev) -> str | None:
    info: dict = {}
    try:
        info = dev.info() or {}
    except Exception:
        pass
    for k in ("name", "gpu", "device_name"):
        if info.get(k):
            return str(info[k])
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader",
                              f"--id={dev.spec.ordinal}"], capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except Exception:
        pass
    return None


_MACHINE: dict | None = None


def machine(dev) -> dict:
    """The machine record: device, model (GPU name or CPU model), cores, library versions."""
    global _MACHINE
    if _MACHINE is not None:
        return _MACHINE
    import morok_py
    from morok_py import config
    from machine import cpu_model
    cpu = cpu_model()
    gpu = _gpu_name(dev) if is_gpu(dev) else None
    info: dict = {}
    try:
        info = {k: v for k, v in (dev.info() or {}).items() if isinstance(v, (str, int, float, bool, list))}
    except Exception:
        pass
    libs = {"morok_py": morok_py.__version__}
    for name, dist in (("numpy", "numpy"), ("llvmlite", "llvmlite"), ("cuda-bindings", "cuda-bindings"),
                       ("cupy", None), ("torch", "torch"), ("numba", "numba"), ("hip-python", "hip-python")):
        if dist is None:   # cupy ships under several distribution names
            v = next((_version(d) for d in ("cupy", "cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x")
                      if _version(d)), None)
        else:
            v = _version(dist)
        if v:
            libs[name] = v
    git = commit()
    _MACHINE = {
        "device": dev.name, "kind": kind_of(dev), "model": gpu or cpu, "gpu": gpu, "cpu": cpu, "cores": os.cpu_count(),
        "cpu_threads": config.cpu_threads(), "arch": getattr(dev, "arch", ""),
        "compiler": dev.compiler.cache_key, "device_info": info,
        "python": platform.python_version(), "platform": platform.platform(), "libraries": libs,
        "git": git, "date": _dt.date.today().isoformat(),
        # other work on the machine skews the numbers: the 1-minute load average when the run began
        "loadavg_at_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "env": {k: v for k, v in os.environ.items()
                if k.startswith("MOROK_") or k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                                   "NUMBA_NUM_THREADS")},
    }
    return _MACHINE


# ---------------------------------------------------------------------------------------------
# terminal output




def fmt_bytes(n: float) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        scale = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}[unit]
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.0f} B"


def fmt_value(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if unit == "s":
        return fmt_time(v)
    if isinstance(v, float):
        return f"{v:.4g}" + (f" {unit}" if unit else "")
    return str(v) + (f" {unit}" if unit else "")


def table(rows: Iterable[Sequence[Any]], headers: Sequence[str], title: str = "") -> str:
    rows = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    line = "  ".join("-" * w for w in widths)
    out = [title] if title else []
    out.append("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    out.append(line)
    for r in rows:
        out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    text = "\n".join(out)
    print(text, flush=True)
    return text


def results_table(records: Sequence[dict], title: str = "") -> str:
    rows = []
    for r in records:
        ratio = r.get("ratio")
        tgt = r.get("target")
        mark = ""
        if tgt is not None and ratio is not None:
            mark = f"{'met' if ratio >= tgt else 'MISSED'} (>= {tgt:g}x)"
        elif r.get("target_value") is not None:
            mark = target_value_mark(r)
        rows.append([r["name"], r.get("label", r["size"]), fmt_value(r["value"], r["unit"]), r["peer"] or "-",
                     fmt_value(r["peer_value"], r["unit"]), "-" if ratio is None else f"{ratio:.2f}x", mark])
    return table(rows, ["benchmark", "size", "ours", "peer", "peer's", "ratio", "target"], title)


def check_close(name: str, got: np.ndarray, want: np.ndarray, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Correctness before speed: stop the run if a kernel's answer is wrong."""
    got = np.asarray(got, dtype=np.float64).reshape(want.shape)
    want = np.asarray(want, dtype=np.float64)
    if not np.allclose(got, want, rtol=rtol, atol=atol):
        err = np.max(np.abs(got - want))
        raise SystemExit(f"{name}: result differs from numpy (max abs error {err:.3g}); not timing a wrong kernel")
