"""The machine kind a result belongs to, derived from the hardware so that a later run on the same
kind of machine replaces the file: `nvidia-h100`, `nvidia-h200`, `amd-mi300x`, `cpu-xeon-avx512-16c`,
`cpu-epyc-avx2-2c`. Results live under `benchmarks/results/<kind>/` and `tests/results/<kind>/`.

    python benchmarks/machine.py            # the CPU's kind
    python benchmarks/machine.py CUDA       # the GPU's kind (nvidia-smi, else the device's own name)
"""
from __future__ import annotations

import os
import platform
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from morok_py.backends.cpu.device import cpu_model  # noqa: E402  (the one reading of the model name)

# words a GPU name carries that are not the model: the vendor, product lines, memory and form factor
_GPU_NOISE = {"nvidia", "amd", "ati", "geforce", "tesla", "quadro", "instinct", "radeon", "pro", "graphics"}
_GPU_STOP = re.compile(r"^(\d+gb|hbm\d*e?|pcie|sxm\d*|nvl|oam|mxm)$")
# CPU brand words, in the order they are looked for in the model name
_CPU_BRANDS = ("xeon", "epyc", "threadripper", "ryzen", "opteron", "core", "atom", "graviton", "neoverse")


def gpu_kind(name: str, vendor: str = "") -> str:
    """`NVIDIA H100 80GB HBM3` -> `nvidia-h100`; `AMD Instinct MI300X` -> `amd-mi300x`."""
    words = re.sub(r"\(r\)|\(tm\)", "", name.lower()).replace("-", " ").split()
    vend = vendor or next((w for w in words if w in ("nvidia", "amd")), "gpu")
    model: list[str] = []
    for w in words:
        if _GPU_STOP.match(w) or len(model) == 2:
            break
        if w not in _GPU_NOISE:
            model.append(re.sub(r"[^a-z0-9]", "", w))
    return "-".join([vend] + [m for m in model if m]) if model else vend


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _llvm_cpu_name() -> str:
    try:
        import llvmlite.binding as llvm
        return llvm.get_host_cpu_name() or ""
    except Exception:
        return ""


def cpu_kind(model: str | None = None, flags: set[str] | None = None, cores: int | None = None) -> str:
    """`cpu-<brand>-<widest vector ISA>-<logical cores>c`, e.g. `cpu-xeon-avx512-16c`."""
    model = (model if model is not None else cpu_model()).lower()
    flags = flags if flags is not None else _cpu_flags()
    cores = cores if cores is not None else (os.cpu_count() or 1)
    brand = next((b for b in _CPU_BRANDS if re.search(rf"\b{b}\b", model)), "") or _llvm_cpu_name() \
        or platform.machine().lower()
    isa = ("avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "avx" if "avx" in flags
           else "sve" if "sve" in flags else "neon" if ("asimd" in flags or "neon" in flags) else "scalar")
    return f"cpu-{re.sub(r'[^a-z0-9]+', '-', brand).strip('-')}-{isa}-{cores}c"


def _nvidia_smi_name(ordinal: int) -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", f"--id={ordinal}"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except Exception:
        return ""


def machine_kind(device: str = "CPU", gpu_name: str | None = None) -> str:
    """The kind of machine behind `device` (`CPU`, `CUDA`, `CUDA:1`, `ROCM`): the GPU's for a GPU device."""
    base, _, ordinal = device.upper().partition(":")
    if base == "CPU":
        return cpu_kind()
    vendor = {"CUDA": "nvidia", "ROCM": "amd"}.get(base, base.lower())
    name = gpu_name or (_nvidia_smi_name(int(ordinal or 0)) if base == "CUDA" else "")
    if not name:
        try:
            from morok_py import Device
            name = str((Device[device].info() or {}).get("name", ""))
        except Exception:
            name = ""
    return gpu_kind(name, vendor) if name else f"{vendor}-unknown"


if __name__ == "__main__":
    print(machine_kind(sys.argv[1] if len(sys.argv) > 1 else "CPU"))
