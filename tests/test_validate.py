"""MOROK_VALIDATE_WITH_CPU=1: launches on a non-CPU device are re-run on the CPU and compared.

CI has no GPU, so the "other device" is a CPU registered under another name through
register_backend: once unaltered (validation passes) and once with a renderer that prints every
float add as a subtract (validation must catch it and name the kernel and the largest error)."""
from __future__ import annotations

import numpy as np
import pytest

from morok_py import Device, DeviceSpec, ValidationError, dtypes, kernels as K, register_backend
from morok_py.backends.cpu.device import CPUDevice
from morok_py.backends.cpu.renderer import CPURenderer


class AddAsSubRenderer(CPURenderer):
    """A deliberately wrong renderer: float ADD is printed as SUB."""

    def render_kernel(self, kernel) -> str:
        return super().render_kernel(kernel).replace("fadd ", "fsub ")


def altered_cpu(spec: DeviceSpec) -> CPUDevice:
    dev = CPUDevice(spec)
    renderer, compiler = dev.compilers[0]
    wrong = AddAsSubRenderer(spec, renderer.triple)
    dev.compilers = [(wrong, compiler)]
    dev.renderer = wrong
    return dev


@pytest.fixture
def validating(monkeypatch, clean_registry):
    monkeypatch.setenv("MOROK_VALIDATE_WITH_CPU", "1")
    register_backend("OTHERCPU", CPUDevice)
    register_backend("BROKENCPU", altered_cpu)


def run_add(dev, rng, n=1003):
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    out = dev.buffer(n, dtypes.float32)
    dev.compile(K.add(), name="vadd")(dev.buffer(n, dtypes.float32).copyin(a), dev.buffer(n, dtypes.float32).copyin(b),
                                      out, n=n)
    return a, b, out


def test_the_altered_renderer_really_computes_a_difference(clean_registry, rng):
    register_backend("BROKENCPU", altered_cpu)
    a, b, out = run_add(Device["BROKENCPU"], rng)     # validation off: the wrong result goes through
    np.testing.assert_allclose(out.numpy(), a - b, rtol=1e-6)


def test_validation_catches_a_wrong_kernel(validating, rng):
    with pytest.raises(ValidationError, match=r"kernel vadd: output buffer 2 differs from the CPU in \d+ of 1003 "
                                              r"element\(s\); largest error [0-9.e+-]+ at index \d+"):
        run_add(Device["BROKENCPU"], rng)


def test_validation_reports_the_largest_error(validating, rng):
    n = 1003
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    dev = Device["BROKENCPU"]
    with pytest.raises(ValidationError) as exc:
        dev.compile(K.add(), name="vadd")(dev.buffer(n, dtypes.float32).copyin(a),
                                          dev.buffer(n, dtypes.float32).copyin(b), dev.buffer(n, dtypes.float32), n=n)
    largest = float(np.max(np.abs(2 * b.astype(np.float64))))
    reported = float(str(exc.value).split("largest error ")[1].split()[0])
    assert reported == pytest.approx(largest, rel=1e-5)


def test_validation_passes_for_a_correct_device(validating, rng):
    a, b, out = run_add(Device["OTHERCPU"], rng)
    np.testing.assert_allclose(out.numpy(), a + b, rtol=1e-6)


def test_validation_passes_for_reductions_and_matmul(validating, rng):
    dev = Device["OTHERCPU"]
    x = rng.standard_normal((13, 29)).astype(np.float32)
    s = dev.buffer(13, dtypes.float32)
    dev.compile(K.reduce_axis("sum", [None, None], 1))(dev.buffer(x.size, dtypes.float32).copyin(x.reshape(-1)),
                                                        s, d0=13, d1=29)
    np.testing.assert_allclose(s.numpy(), x.sum(axis=1), rtol=1e-5, atol=1e-5)


def test_validation_does_not_apply_to_the_cpu_itself(monkeypatch, rng):
    monkeypatch.setenv("MOROK_VALIDATE_WITH_CPU", "1")
    a, b, out = run_add(Device["CPU"], rng)
    np.testing.assert_allclose(out.numpy(), a + b, rtol=1e-6)
