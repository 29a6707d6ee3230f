"""MOROK_VALIDATE_WITH_CPU=1: run every launch on a non-CPU device also on the CPU, on copies of
its inputs, and compare the outputs. Device-generic: it only uses Buffers and Device.compile."""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from .dtypes import DType
from .errors import ValidationError


def tolerance(dt: DType) -> tuple[float, float]:
    """(rtol, atol) by dtype; GPU transcendental units are allowed a few ulp more than libm."""
    if not dt.is_float:
        return 0.0, 0.0
    return {"float16": (1e-2, 1e-2), "bfloat16": (2e-2, 2e-2), "float32": (1e-4, 1e-5),
            "float64": (1e-10, 1e-12)}[dt.name]


def compare(name: str, slot: int, got: np.ndarray, want: np.ndarray, dt: DType) -> None:
    rtol, atol = tolerance(dt)
    if dt.is_float:
        g, w = got.astype(np.float64), want.astype(np.float64)
        bad = ~np.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
        err = np.abs(g - w)
        err = np.where(np.isnan(g) ^ np.isnan(w), np.inf, np.nan_to_num(err, nan=0.0))
    else:
        bad = got != want
        err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    if bad.any():
        i = int(np.argmax(np.where(bad, err, -1)))
        raise ValidationError(
            f"kernel {name}: output buffer {slot} differs from the CPU in {int(bad.sum())} of {bad.size} element(s); "
            f"largest error {float(err[i]):.6g} at index {i} (device {got[i]!r}, cpu {want[i]!r}; "
            f"rtol={rtol}, atol={atol})")


def validated_launch(program, buffers: Sequence, values: Mapping[str, int],
                     launch: Callable[[], float | None]) -> float | None:
    from .buffer import Buffer
    from .registry import get_device
    cpu = get_device("CPU")
    info = program.launch
    snapshots = [b.numpy() for b in buffers]
    t = launch()
    program.device.synchronize()
    ref = cpu.compile(program.compiled.ast, program.name)
    cpu_bufs = [Buffer(cpu, b.size, b.dtype).copyin(s) for b, s in zip(buffers, snapshots)]
    ref(*cpu_bufs, **values)
    for p in info.params:
        if p.written:
            compare(program.name, p.slot, buffers[p.slot].numpy(), cpu_bufs[p.slot].numpy(), p.dtype)
    return t
