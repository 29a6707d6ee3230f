"""Shared fixtures: a temp disk cache per test session, and the `device` parametrization that runs the
same correctness suite on every (device, compiler pair): CPU/llvm always, CUDA and ROCm pairs when the
hardware and toolchain are there, skipped with the reason otherwise."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run from a source checkout without installing
    sys.path.insert(0, str(ROOT))

# every run starts from an empty disk cache (what CI sees), unless MOROK_TEST_CACHE_DIR names a folder to
# keep between runs (to time a warm-cache run, e.g. of the ONNX conformance)
_KEPT_CACHE = os.environ.get("MOROK_TEST_CACHE_DIR")
_SESSION_CACHE = _KEPT_CACHE or tempfile.mkdtemp(prefix="morok-test-cache-")
os.environ["MOROK_CACHE_DIR"] = _SESSION_CACHE
os.environ.pop("MOROK_CACHE", None)
os.environ.pop("MOROK_DEBUG", None)
os.environ.pop("MOROK_VALIDATE_WITH_CPU", None)

from morok_py import Buffer, Device, DeviceUnavailableError, MorokError, RuntimeStackConflictError, dtypes  # noqa: E402
from morok_py.registry import get_device  # noqa: E402


# `-n auto` (pyproject's addopts): a worker per core this process may run on, at most this many (each worker
# holds LLVM, its compiled kernels and its own disk cache folder)
TEST_WORKERS_MAX = 8


def pytest_xdist_auto_num_workers(config) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, TEST_WORKERS_MAX))


def pytest_unconfigure(config) -> None:
    if not _KEPT_CACHE:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@dataclass
class Target:
    """One (device, compiler pair) under test; compiles through the friendly path with that pair."""

    dev: Device
    compiler: str

    @property
    def name(self) -> str:
        return f"{self.dev.name}/{self.compiler}"

    def compile(self, ast, name=None):
        return self.dev.compile(ast, name, compiler=self.compiler)

    def pair(self):
        return self.dev.pair(self.compiler)

    def buf(self, array) -> Buffer:
        return Buffer.from_numpy(np.ascontiguousarray(array).reshape(-1), self.dev)

    def empty(self, n: int, dtype) -> Buffer:
        return self.dev.buffer(int(n), dtype)


PAIRS = [
    pytest.param(("CPU", "llvm"), id="CPU-llvm"),
    pytest.param(("CUDA", "nvrtc"), id="CUDA-nvrtc", marks=pytest.mark.cuda),
    pytest.param(("CUDA", "llvm-nvptx"), id="CUDA-llvm-nvptx", marks=pytest.mark.cuda),
    pytest.param(("ROCM", "llvm-amdgpu"), id="ROCM-llvm-amdgpu", marks=pytest.mark.rocm),
    pytest.param(("ROCM", "hiprtc"), id="ROCM-hiprtc", marks=pytest.mark.rocm),
    pytest.param(("CPU", "mlir"), id="CPU-mlir"),
    pytest.param(("CUDA", "mlir"), id="CUDA-mlir", marks=pytest.mark.cuda),
    pytest.param(("ROCM", "mlir"), id="ROCM-mlir", marks=pytest.mark.rocm),
]


def open_target(kind: str, compiler: str) -> Target:
    """Open the device and check the pair, or skip with the reason it can't be used here."""
    try:
        dev = get_device(kind)
    except (DeviceUnavailableError, RuntimeStackConflictError) as e:
        pytest.skip(str(e).splitlines()[0])
    except ImportError as e:
        pytest.skip(f"{kind} backend could not be imported: {e}")
    except MorokError as e:
        pytest.skip(f"{kind} could not be opened: {str(e).splitlines()[0]}")
    try:
        _, comp = dev.pair(compiler)
    except ValueError as e:
        pytest.skip(str(e))
    why = comp.available()
    if why is not None:
        if compiler in os.environ.get("MOROK_TEST_REQUIRE", "").split(","):   # CI installed it: fail, not skip
            pytest.fail(f"MOROK_TEST_REQUIRE names {compiler} but {kind} compiler {compiler} is unavailable: {why}")
        pytest.skip(f"{kind} compiler {compiler} is unavailable: {why}")
    return Target(dev, compiler)


@pytest.fixture(params=PAIRS)
def device(request) -> Target:
    kind, compiler = request.param
    return open_target(kind, compiler)


@pytest.fixture
def cpu() -> Target:
    return Target(get_device("CPU"), "llvm")


# the x86-64 levels the CPU kernel-family tests run at (each the host can execute), so that an AVX-512
# machine also proves the AVX2 and SSE code paths
CPU_LEVELS = ["x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4"]
_level_devices: dict[str, Device] = {}


@pytest.fixture(params=CPU_LEVELS)
def cpu_level(request) -> Target:
    """A CPU device compiling for one x86-64 level (its renderer sized by that level's features);
    skipped where the host cannot run that level's code."""
    import platform
    from morok_py.backends.cpu.compiler import host_cpu
    from morok_py.backends.cpu.device import CPUDevice
    from morok_py.backends.cpu.features import load_mismatch
    from morok_py.device import DeviceSpec
    level = request.param
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"{level} is an x86-64 level; this host is {platform.machine()}")
    host, features = host_cpu()
    why = load_mismatch(level, host, features)
    if why is not None:
        pytest.skip(f"the host cannot run {level} code: {why}")
    dev = _level_devices.get(level)
    if dev is None:
        dev = _level_devices[level] = CPUDevice(DeviceSpec.parse("CPU"), arch=level)
    return Target(dev, "llvm")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def clean_registry(monkeypatch):
    """Snapshot the registry's tables so a test may register backends and leave no trace."""
    from morok_py import registry
    monkeypatch.setattr(registry, "_factories", dict(registry._factories))
    monkeypatch.setattr(registry, "_devices", dict(registry._devices))
    return registry


def conv_ref(x, w, b, geo) -> np.ndarray:
    """NCHW convolution in float64 by explicit taps (the reference of the convolution tests); `geo` is a
    strategies.conv.ConvGeometry, `b` a bias per output channel or None."""
    pt, pl, pb, pr = geo.pads
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    (sh, sw), (dh, dw), G = geo.stride, geo.dilation, geo.groups
    Cg, COg = geo.C // G, geo.CO // G
    out = np.zeros((geo.N, geo.CO, geo.OH, geo.OW))
    for kh in range(geo.KH):
        for kw in range(geo.KW):
            win = xp[:, :, kh * dh: kh * dh + (geo.OH - 1) * sh + 1: sh, kw * dw: kw * dw + (geo.OW - 1) * sw + 1: sw]
            for g in range(G):
                out[:, g * COg:(g + 1) * COg] += np.einsum("nchw,oc->nohw", win[:, g * Cg:(g + 1) * Cg],
                                                           w[g * COg:(g + 1) * COg, :, kh, kw].astype(np.float64))
    if b is not None:
        out += b.astype(np.float64)[None, :, None, None]
    return out


def random_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Random data that is never all zeros: normals for floats, a spread of non-zero values for ints."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return rng.standard_normal(shape).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(dt)
    info = np.iinfo(dt)
    lo, hi = max(info.min, -100), min(info.max, 100)
    a = rng.integers(lo, hi + 1, size=shape).astype(dt)
    a[a == 0] = 1
    return a


def amdgpu_llvm_pair(arch: str):
    """The llvm-amdgpu (renderer, compiler) for `arch`, compile-only (no GPU needed); skips with the reason
    where pyelftools or ld.lld >= 19 is missing."""
    pytest.importorskip("elftools", reason="pyelftools is needed (pip install pyelftools)")
    from morok_py.backends.rocm import compile_only_pairs
    from morok_py.backends.rocm import compiler as C
    from morok_py.errors import DeviceUnavailableError
    try:
        C.find_lld()
    except DeviceUnavailableError as e:
        pytest.skip(f"no ld.lld >= 19 here: {e}")
    renderer, compiler = compile_only_pairs(arch)[0]
    assert compiler.cache_key == "llvm-amdgpu"
    return renderer, compiler


def compile_for_check(compiler, spec):
    """`compiler.compile(spec)` of a compile-only pair; the llvm-amdgpu pair skips (after the caller's checks of
    the rendered kernel) where no ld.lld >= 19 links its code objects."""
    if compiler.cache_key == "llvm-amdgpu":
        from morok_py.backends.rocm import compiler as C
        from morok_py.errors import DeviceUnavailableError
        try:
            C.find_lld()
        except DeviceUnavailableError as e:
            pytest.skip(f"rendered and checked; not linked: no ld.lld >= 19 here: {e}")
    return compiler.compile(spec)


def cuda_compile_pair(key: str, arch: str = "sm_90"):
    """The CUDA (renderer, compiler) of pair `key` ('nvrtc', 'llvm-nvptx') for `arch`, compile-only (no GPU
    needed); skips with the reason where the cuda extra or that pair's compiler is missing."""
    cuda = pytest.importorskip("morok_py.backends.cuda", reason="the cuda extra is not installed")
    pairs = {c.cache_key: (r, c) for r, c in cuda.compile_only_pairs(arch)}
    if key not in pairs:
        pytest.skip(f"no {key} pair among {sorted(pairs)}")
    why = pairs[key][1].available()
    if why is not None:
        pytest.skip(f"{key} is not usable here: {why}")
    return pairs[key]


def run_steps(target, steps, arrays: dict, epilogue_arrays=()):
    """Launch a plan's kernels in order with scratch buffers between them; the output as numpy."""
    bufs = {k: target.buf(v) for k, v in arrays.items()}
    for st in steps:
        ins = []
        for role in st.inputs:
            ins += [target.buf(a) for a in epilogue_arrays] if role == "epilogue" else [bufs[role]]
        bufs[st.output] = target.empty(st.elements, dtypes.float32)
        target.compile(st.ast, f"conv_{st.name}")(*ins, bufs[st.output], **dict(st.vars))
    return bufs["out"].numpy()
