"""The device registry and its environment: names, custom backends, entry points, missing
dependencies, compiler selection."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from morok_py import Device, DeviceSpec, DeviceUnavailableError, dtypes, kernels as K, register_backend
from morok_py.backends.cpu.device import CPUDevice, create_device
from morok_py.registry import get_device, registered

from conftest import ROOT


def test_device_is_opened_once_per_name():
    assert Device["CPU"] is Device["cpu"] is get_device(None)


def test_unknown_device_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown device 'TPU'; registered: .*CPU.*CUDA.*ROCM"):
        Device["TPU"]


def test_there_is_one_cpu():
    with pytest.raises(ValueError, match="one CPU device"):
        Device["CPU:1"]


def test_register_backend_adds_a_device(clean_registry, rng):
    opened = []

    def factory(spec: DeviceSpec) -> CPUDevice:
        opened.append(str(spec))
        return CPUDevice(spec)

    register_backend("myaccel", factory)
    assert "MYACCEL" in registered()
    dev = Device["MYACCEL:2"]
    assert opened == ["MYACCEL:2"] and dev.name == "MYACCEL:2"
    x = rng.standard_normal(7).astype(np.float32)
    out = dev.buffer(7, dtypes.float32)
    dev.compile(K.unary("neg"))(dev.buffer(7, dtypes.float32).copyin(x), out, n=7)
    np.testing.assert_array_equal(out.numpy(), -x)


def test_register_backend_validates_its_arguments(clean_registry):
    with pytest.raises(ValueError, match="identifier"):
        register_backend("my-accel", create_device)
    with pytest.raises(TypeError, match="callable"):
        register_backend("myaccel", None)


def test_entry_point_group_registers_a_backend(tmp_path):
    # a real installed-looking distribution: a dist-info folder with an entry_points.txt
    (tmp_path / "plugin_backend.py").write_text(textwrap.dedent("""
        from morok_py.backends.cpu.device import CPUDevice
        def create(spec):
            return CPUDevice(spec)
    """))
    info = tmp_path / "plugin_backend-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-backend\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[morok_py.backends]\nplugdev = plugin_backend:create\n")
    code = textwrap.dedent("""
        import numpy as np
        from morok_py import Device, Buffer, dtypes, kernels as K
        from morok_py.registry import registered
        dev = Device["PLUGDEV"]
        x = np.arange(1, 8, dtype=np.float32)
        out = dev.buffer(7, dtypes.float32)
        dev.compile(K.unary("square"))(Buffer.from_numpy(x, dev), out, n=7)
        print("PLUGDEV" in registered(), dev.name, out.numpy().sum())
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "PLUGDEV:0", str(float(np.sum(np.arange(1, 8) ** 2)))]


def test_missing_dependency_raises_device_unavailable_with_the_extra(clean_registry, monkeypatch):
    monkeypatch.setitem(clean_registry._BUILTIN, "FAKEGPU",
                        ("morok_py.backends.fakegpu_not_installed", "fakegpu", "pip install morok-py[fakegpu]"))
    with pytest.raises(DeviceUnavailableError, match=r"FAKEGPU is unavailable: .*No module named.*"
                                                     r"\(install: pip install morok-py\[fakegpu\]\)"):
        Device["FAKEGPU"]


def test_backend_whose_import_fails_raises_device_unavailable(clean_registry, monkeypatch, tmp_path):
    (tmp_path / "broken_backend.py").write_text("import a_vendor_package_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(clean_registry._BUILTIN, "BROKEN", ("broken_backend", "broken", "pip install morok-py[broken]"))
    with pytest.raises(DeviceUnavailableError, match="a_vendor_package_that_is_not_installed") as exc:
        Device["BROKEN"]
    assert exc.value.install == "pip install morok-py[broken]"


def test_unknown_compiler_env_lists_the_registered_pairs(monkeypatch):
    monkeypatch.setenv("MOROK_CPU_COMPILER", "gcc")
    with pytest.raises(ValueError, match=r"MOROK_CPU_COMPILER='gcc' is not a compiler of CPU; registered: llvm"):
        create_device(DeviceSpec.parse("CPU"))


def test_compiler_env_selects_a_pair_by_cache_key(monkeypatch):
    monkeypatch.setenv("MOROK_CPU_COMPILER", "llvm")
    assert create_device(DeviceSpec.parse("CPU")).compiler.cache_key == "llvm"


def test_device_pair_lookup_rejects_unknown_keys():
    with pytest.raises(ValueError, match="no compiler 'nvrtc'"):
        Device["CPU"].pair("nvrtc")


def test_gpu_stacks_exclude_each_other(monkeypatch):
    from morok_py import RuntimeStackConflictError, registry
    monkeypatch.setattr(registry, "_stack", None)
    registry.claim_gpu_stack("CUDA")
    registry.claim_gpu_stack("CUDA")     # the same stack again is fine
    with pytest.raises(RuntimeStackConflictError, match="already runs the CUDA stack"):
        registry.claim_gpu_stack("ROCM")
