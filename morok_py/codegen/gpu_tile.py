"""GPU contractions (matmul-like kernels) lowered with shared-memory tiles and register blocking.

`tile_contraction` returns None for kernels it does not handle; `lower` then uses the general path.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..ir import UOp
    from .linear import LinearKernel
    from .lower import Capabilities, LaunchInfo


def tile_contraction(ast: "UOp", caps: "Capabilities", name: str) -> "tuple[LinearKernel, LaunchInfo] | None":
    return None
