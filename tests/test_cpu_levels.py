"""Every x86-64 level the host can run: code compiled for a CPU loads wherever the host has all of that
target's features, a real mismatch fails at load naming the missing features, and the representative
kernel families (elementwise, reductions, softmax, matmul static and symbolic) give numpy's answers at
each level (`cpu_level` in conftest), so an AVX-512 machine also proves the AVX2 and SSE paths."""
from __future__ import annotations

import platform

import numpy as np
import pytest

from morok_py import DeviceError, DeviceSpec, dtypes, kernels as K
from morok_py.backends.cpu.compiler import CPUCompiler, host_cpu
from morok_py.backends.cpu.device import CPUDevice
from morok_py.backends.cpu.features import (NAMED_CPUS, X86_64_LEVELS, load_mismatch, parse_features,
                                            target_features)
from morok_py.backends.cpu.renderer import register_tile_for

import test_kernels as TK
from conftest import random_array

x86_only = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 levels need an x86-64 host")


# ---- which targets load ---------------------------------------------------------------------------

def test_levels_nest_and_each_lists_what_its_psabi_level_adds():
    v1, v2, v3, v4 = (X86_64_LEVELS[k] for k in ("x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4"))
    assert v1 < v2 < v3 < v4
    assert {"sse2", "cmov"} <= v1 and {"sse4.2", "popcnt", "cx16"} <= v2 - v1
    assert {"avx2", "fma", "bmi2"} <= v3 - v2 and v4 - v3 == {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


def test_a_target_loads_exactly_when_the_host_has_all_its_features():
    avx2_host = "+sse2,+avx,+avx2,-avx512f"
    assert load_mismatch("x86-64-v3", "myhost", ",".join("+" + f for f in X86_64_LEVELS["x86-64-v3"])) is None
    why = load_mismatch("x86-64-v4", "myhost", ",".join("+" + f for f in X86_64_LEVELS["x86-64-v3"]))
    assert "avx512f" in why and "avx512bw" in why and "avx2" not in why
    assert "lacks" in load_mismatch("x86-64-v3", "myhost", avx2_host)        # no fma, bmi, ... listed
    assert load_mismatch("myhost", "myhost", "") is None                      # the host itself, by name
    assert "not known" in load_mismatch("some-future-cpu", "myhost", avx2_host)
    assert target_features("skylake-avx512") == NAMED_CPUS["skylake-avx512"] >= X86_64_LEVELS["x86-64-v4"]


@x86_only
@pytest.mark.parametrize("target", ["x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4", "znver1", "skylake-avx512"])
def test_code_for_a_cpu_loads_and_runs_when_the_host_has_its_features(target, rng):
    host, features = host_cpu()
    dev = CPUDevice(DeviceSpec.parse("CPU"), arch=target)
    assert dev.compiler.arch == target
    why = load_mismatch(target, host, features)
    ast = K.add()
    if why is not None:       # a real mismatch: compiles (no hardware needed), fails at load, names the features
        missing = sorted(target_features(target) - parse_features(features))
        compiled = dev.compiler.compile(dev.renderer.render(ast, "add"))
        with pytest.raises(DeviceError, match="ARCH_MISMATCH") as e:
            dev.runtime(compiled)
        assert all(f in str(e.value) for f in missing) and target in str(e.value)
        return
    n = 1003
    a, b = random_array(rng, n, np.float32), random_array(rng, n, np.float32)
    out = dev.buffer(n, dtypes.float32)
    from morok_py import Buffer
    dev.compile(ast, "add")(Buffer.from_numpy(a, dev), Buffer.from_numpy(b, dev), out, n=n)
    np.testing.assert_allclose(out.numpy(), a + b, rtol=1e-6)


@x86_only
def test_the_host_rejects_a_level_it_lacks_through_the_friendly_path():
    host, features = host_cpu()
    lacking = [lv for lv in X86_64_LEVELS if load_mismatch(lv, host, features) is not None]
    if not lacking:
        pytest.skip("this host runs every x86-64 level")
    dev = CPUDevice(DeviceSpec.parse("CPU"), arch=lacking[0])
    with pytest.raises(DeviceError, match=r"ARCH_MISMATCH.*lacks .*avx512f"):
        dev.compile(K.binary("mul"))


@pytest.mark.parametrize("level,tile", [("x86-64", (4, 8)), ("x86-64-v2", (4, 8)), ("x86-64-v3", (6, 16)),
                                        ("x86-64-v4", (6, 64))])
def test_the_register_tile_follows_the_targets_features_not_the_hosts(level, tile):
    c = CPUCompiler(level)
    assert register_tile_for(c.renderer_features) == tile
    if platform.machine() in ("x86_64", "AMD64"):
        assert CPUDevice(DeviceSpec.parse("CPU"), arch=level).renderer.caps.register_tile == tile


# ---- the kernel families at every level the host runs ----------------------------------------------

def test_elementwise(cpu_level, rng):
    TK.test_add_symbolic_size(cpu_level, rng, 1003)
    TK.test_binary_float32(cpu_level, rng, "mul", np.multiply)


def test_reductions(cpu_level, rng):
    TK.test_reduce_symbolic_2d(cpu_level, rng, "sum", 1)
    TK.test_reduce_symbolic_2d(cpu_level, rng, "max", 0)
    TK.test_sum_all(cpu_level, rng, 100003)


def test_softmax(cpu_level, rng):
    TK.test_softmax(cpu_level, rng, 7, 1003)


def _matmul(target, rng, M, N, Kd, static: bool):
    a, b = random_array(rng, (M, Kd), np.float32), random_array(rng, (Kd, N), np.float32)
    out = target.empty(M * N, dtypes.float32)
    if static:
        target.compile(K.matmul(M, N, Kd))(target.buf(a), target.buf(b), out)
    else:
        target.compile(K.matmul())(target.buf(a), target.buf(b), out, M=M, N=N, K=Kd)
    np.testing.assert_allclose(out.numpy().reshape(M, N), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape", [(66, 130, 257), (7, 13, 5)], ids=lambda s: "x".join(map(str, s)))
def test_matmul_static(cpu_level, rng, shape):
    _matmul(cpu_level, rng, *shape, static=True)


# few columns, below the level's tile width: whole lane vectors with a remainder of 0-4 columns merged into the one
# tile (49: a 7x7 layer's pixels; 48 + 4 on AVX-512), a wider remainder, and K long enough to take packed panels
@pytest.mark.parametrize("shape", [(70, 49, 300), (13, 33, 130), (50, 36, 70), (31, 52, 97), (19, 57, 150)],
                         ids=lambda s: "x".join(map(str, s)))
def test_matmul_narrow_static(cpu_level, rng, shape):
    _matmul(cpu_level, rng, *shape, static=True)


@pytest.mark.parametrize("shape", [(66, 130, 257), (64, 128, 256), (7, 13, 5)], ids=lambda s: "x".join(map(str, s)))
def test_matmul_symbolic(cpu_level, rng, shape):
    _matmul(cpu_level, rng, *shape, static=False)
