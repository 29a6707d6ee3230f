"""The ONNX op table: `OPS[op_type](ctx, inputs, attrs) -> outputs`, filled by `@op` in the family modules."""
from __future__ import annotations

from typing import Callable

OPS: dict[str, Callable] = {}


def op(*names: str) -> Callable[[Callable], Callable]:
    """Register the decorated function as the implementation of the ONNX ops `names`."""
    def deco(fn: Callable) -> Callable:
        for n in names:
            OPS[n] = fn
        return fn
    return deco
