"""What a renderer's target offers: the facts schedules and lowering read (renderers only print)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """What a renderer's target offers; lowering reads these, renderers only print."""

    has_local: bool = False            # GPU work-groups: GLOBAL ranges map to grid x block
    has_shared: bool = False           # work-group shared memory and barriers
    has_threads: bool = False          # CPU worker threads: outermost GLOBAL range is split
    max_dims: int = 3                  # launch dimensions available
    local_max: tuple[int, int, int] = (1024, 1024, 64)
    max_threads_per_group: int = 1024
    default_group: int = 256           # work-items per group for 1-D launches
    grid_max: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    warp_size: int = 1
    register_tile: tuple[int, int] | None = None   # CPU: (rows, columns) of a reduction's output tile
    tile_lanes: int = 0           # CPU: the register tile's columns as vectors of this many lanes (the
                                  # printer emits LLVM vector types); 0: scalar lanes only
    group_reduce: bool = False    # GPU: row kernels get one work-group per output row, reducing in shared memory
    grid_reduce: bool = False     # GPU: a full reduction is split over many work-groups in two stages
                                  # (partials in a hidden scratch buffer, the last group to finish combines)
    warp_shuffle: bool = False    # GPU: 32-bit lanes of a warp exchange values (group combines use it)
    vector_width: int = 1         # GPU: elementwise kernels load/store this many contiguous elements per item
    matmul_tile: tuple[int, int, int, int, int] | None = None
    # GPU: (BM, BN, BK, TM, TN) shared-memory tiles of a contraction, TM x TN outputs per work-item
    split_upcast: int = 0         # GPU: a split reduction with a small constant batch beside its columns (a
                                  # GEMV) computes up to this many batch outputs per work-item by default
                                  # (Schedule.upcast; schedule.GEMV_UPCAST_SPLIT); 0: the plain split
    threads: int = 0              # CPU: the worker threads a split launch uses (row partitions balance them,
                                  # opt._partitions); 0: unknown
    async_copy: bool = False      # GPU: asynchronous global -> shared copies that bypass registers (NVIDIA
                                  # cp.async, sm_80+): the tiled contraction's `async_fill`
    tensor_cores: tuple[str, ...] = ()
    # GPU: the matrix instructions of the target a contraction of float16/bfloat16 may use
    # (codegen/strategies/tensor_core.py), e.g. "mma_m16n8k16" (NVIDIA sm_80+)
