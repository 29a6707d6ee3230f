"""Which matrix-unit form a float16/bfloat16 contraction takes, and its lowering: the warp-level forms of
strategies/tensor_core.py (NVIDIA mma.sync, AMD MFMA/WMMA) or the warpgroup form of strategies/wgmma.py
(NVIDIA sm_90a). This module sits above both (wgmma.py builds on tensor_core.py's kernel skeleton), so
neither imports the other back.
"""
from __future__ import annotations

from ...ir import UOp
from ..capabilities import Capabilities
from ..scan import KernelScan
from .tensor_core import _BUILDERS, MMA_M16N8K16, WGMMA, choose_tc_tile, tc_pipeline, tc_plan
from .wgmma import _WGMMABuilder, choose_wg_tile
from .wgmma_f8 import choose_f8_tile, f8_plan


def choose_tc(ast: UOp, caps: Capabilities, scan: KernelScan | None) -> tuple[str, tuple, int, bool] | None:
    """The heuristic tensor-core schedule fields (instruction, tile, stages, swizzle): the warpgroup form
    where the target has it and the kernel takes it, else the target's first (warp-level) instruction with
    `choose_tc_tile` and `tc_pipeline`; None when no tile applies."""
    if WGMMA in caps.tensor_cores:
        got = choose_wg_tile(ast, caps, scan) or choose_f8_tile(ast, caps, scan)
        if got is not None:
            return WGMMA, got[0], got[1], True
    tile = choose_tc_tile(ast, caps, scan)
    if tile is None:
        return None
    return (caps.tensor_cores[0], tile, *tc_pipeline(caps, tile, ast, scan))


def tile_mma(ast: UOp, caps: Capabilities, name: str, scan: KernelScan | None, tile, mma: str,
             stages: int = 0, swizzle: bool = False):
    """The tensor-core lowering of a contraction under `tile` ((BM, BN, BK, WM, WN)), `stages` cp.async
    buffers (0: register-staged double buffering) and the swizzled (else padded) layout; or None."""
    builder = _WGMMABuilder if mma == WGMMA else _BUILDERS.get(mma)
    if builder is None or mma not in caps.tensor_cores:
        return None
    plan = mma_plan(ast, caps, scan, tile, stages, swizzle, mma)
    if plan is None:
        return None
    if mma not in (MMA_M16N8K16, WGMMA):
        return builder(ast, caps, name, plan).build()
    return builder(ast, caps, name, plan, stages, swizzle).build()


def mma_plan(ast: UOp, caps: Capabilities, scan: KernelScan | None, tile, stages: int = 0, swizzle: bool = False,
             mma: str | None = None):
    """The tensor-core plan of `tile` under instruction `mma`: the 16-bit one (tensor_core.tc_plan) or, for
    the warpgroup form, the float8 one (strategies/wgmma_f8.py); None when neither takes the kernel."""
    plan = tc_plan(ast, caps, scan, tile, stages, swizzle, mma)
    if plan is None and mma == WGMMA:
        plan = f8_plan(ast, caps, scan, tile, stages, swizzle, mma)
    return plan


__all__ = ["choose_tc", "mma_plan", "tile_mma"]
