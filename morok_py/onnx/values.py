"""The non-tensor values a graph passes between nodes: sequences of tensors and optionals."""
from __future__ import annotations

from typing import Any

from morok_py.dtypes import DType


class Seq(list):
    """An ONNX sequence: a list of tensor Views; `dtype` is its element type (needed when it is empty)."""

    def __init__(self, items: Any = (), dtype: DType | None = None) -> None:
        super().__init__(items)
        self.dtype = dtype if dtype is not None else (self[0].dtype if self else None)


class Opt:
    """An ONNX optional: a tensor View or a Seq, or nothing (`value` None)."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Opt({self.value!r})"
