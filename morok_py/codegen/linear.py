"""The linear kernel: what lowering hands a renderer.

A tree of blocks holding SSA instructions, `Loop`s and `If`s. Renderers only print it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Union

from ..dtypes import DType
from ..ir import AxisType, Ops
from .symbols import symbol_for


class L(enum.Enum):
    """Instruction kinds of the linear kernel; ALU carries an `Ops` as its arg."""

    PARAM = "param"          # arg: slot; dtype: element dtype (the value is the buffer pointer)
    VAR = "var"              # arg: variable name
    CONST = "const"          # arg: python value
    SPECIAL = "special"      # arg: ('group_id'|'local_id', dim); GPU work-item ids
    THREAD_RANGE = "thread_range"  # arg: 'start'|'end'; CPU thread-split bounds
    LOOPVAR = "loopvar"      # the variable of a Loop
    LOAD = "load"            # src: (param or local, index); arg: None, or a vector width w: w contiguous
                             # elements from index (aligned to w elements), the value is a w-vector
    STORE = "store"          # src: (param or local, index, value); arg: None, or w for a w-vector value
    PREFETCH = "prefetch"    # src: (param, index); arg: (write, locality): a hint that the element's cache line is
                             # wanted soon, to be written (1) or read (0), kept in L1 (3) or L2 (2) (x86 prefetcht0 /
                             # prefetcht1); the CPU register tile's epilogue (codegen/prefetch.py)
    VECTOR = "vector"        # src: w scalars of dtype -> one w-vector (for a vector STORE)
    EXTRACT = "extract"      # src: (vector,); arg: lane -> the lane's scalar
    BROADCAST = "broadcast"  # src: (scalar,); lanes: w -> the w-vector with every lane the scalar
    ATOMIC_ADD = "atomic_add"  # src: (param, index, value); device-scope atomic add, the old value
    FENCE = "fence"          # device-scope memory fence (orders global stores before later atomics)
    SHUFFLE_XOR = "shuffle_xor"  # src: (value, local id); arg: (mask, warp size): the value of the lane
                                 # (lane ^ mask) of this warp; a 32-bit value, every lane of the warp active
    ACC = "acc"              # a mutable accumulator; arg: initial value
    ACC_LOAD = "acc_load"    # src: (acc,)
    ACC_STORE = "acc_store"  # src: (acc, value)
    LOCAL = "local"          # work-group shared array; arg: element count; dtype: element dtype
    BARRIER = "barrier"      # work-group barrier (after shared-memory stores)
    ALU = "alu"              # arg: Ops; src: operands
    # tensor cores (codegen/strategies/tensor_core.py); every lane of the warp takes part
    LDMATRIX = "ldmatrix"    # src: (local, index): this lane's row address (16 contiguous bytes of 16-bit
                             # elements) of 8x8 matrix lane // 8; arg: (count, trans); dtype: the element
                             # dtype; the value: `count` 32-bit registers, two elements each (PTX ldmatrix)
    MMA = "mma"              # src: (a, b, c0, c1, c2, c3): a, b LDMATRIX fragments, c* float32 ACCs updated
                             # in place; arg: (shape, b_pair): c += A @ B on the warp (b's registers
                             # 2*b_pair, 2*b_pair+1), e.g. "m16n8k16" (PTX mma.sync ... .row.col.f32)
    # asynchronous global -> shared copies (NVIDIA sm_80+, PTX cp.async): a copy lands at the CP_WAIT that
    # covers its group; a BARRIER after that wait makes it visible to the other work-items
    CP_ASYNC = "cp_async"    # src: (local, local index, param, global index); arg: bytes (4, 8 or 16): one
                             # aligned run of the param's elements into the shared array
    CP_COMMIT = "cp_commit"  # closes the group of this work-item's CP_ASYNCs issued since the last commit
    CP_WAIT = "cp_wait"      # arg: n: waits until at most n of this work-item's committed groups are pending
    # warpgroup matrix instructions (NVIDIA sm_90a, PTX wgmma; codegen/strategies/wgmma.py): the 128 work-items
    # of an aligned warpgroup take part; operands are read from shared memory through descriptors
    SMEM_DESC = "smem_desc"  # src: (local, index); arg: (leading byte offset, stride byte offset); dtype:
                             # uint64: the 128-byte-swizzle matrix descriptor of the operand at local[index]
    WGMMA = "wgmma"          # src: (desc a, desc b, *accs): the work-item's N / 2 float32 ACCs in PTX register
                             # order, updated in place; arg: (N, input dtype name, trans a, trans b): asynchronous
                             # D += A (64 x 16) @ B (16 x N)
    WG_SYNC = "wg_sync"      # arg: "fence" (before wgmma reads registers others wrote), "commit" (closes a
                             # group of wgmmas), "proxy" (shared stores before it are visible to wgmma
                             # reads after the next barrier), or n: wait until at most n groups are pending
    MBAR = "mbar"            # shared-memory barrier object (PTX mbarrier, sm_80+): src (local uint64, index[,
                             # parity]); arg: ("init", count) expected arrivals, ("arrive", 0), ("cp_arrive",
                             # 0): arrives once this work-item's earlier cp.async copies have landed (they are
                             # then visible to its waiters), ("wait", 0): until the phase of that parity completes


@dataclass(eq=False)
class Instr:
    kind: L
    dtype: DType | None
    src: tuple["Instr", ...]
    arg: Any
    id: int
    index_math: bool = False  # proven (by the launch check) not to overflow: renderers may add nsw
    reassoc: bool = False     # a reduction step: the renderer may reorder it (vectorized reductions)
    volatile: bool = False    # LOAD: read what other work-groups wrote in this launch (no stale cache)
    cache: Any = None         # lowering-internal: a row-cache mark (key, position); printers ignore it
    lanes: int = 1            # CPU register-tile lanes (strategies/tile_lanes.py): a value of `lanes` x dtype;
                              # a LOAD/STORE of lanes > 1 is w contiguous elements, aligned to one element only

    def __repr__(self) -> str:
        a = self.arg.name if isinstance(self.arg, Ops) else self.arg
        return f"%{self.id}={self.kind.value}{'' if a is None else f'[{a}]'}({', '.join(f'%{s.id}' for s in self.src)})"


@dataclass(eq=False)
class Loop:
    var: Instr
    start: Instr
    end: Instr
    kind: AxisType
    body: list["Item"] = field(default_factory=list)
    step: Instr | None = None   # None: 1; a work-group-strided loop steps by the group size
    unroll: int = 0             # a hint: unroll this many times (more loads in flight per work-item)


@dataclass(eq=False)
class If:
    cond: Instr
    body: list["Item"] = field(default_factory=list)


Item = Union[Instr, Loop, If]


@dataclass(frozen=True)
class ParamInfo:
    slot: int
    dtype: DType
    read: bool
    written: bool


@dataclass
class LinearKernel:
    name: str
    params: list[ParamInfo]
    var_names: list[str]
    body: list[Item]
    local_size: tuple[int, int, int]
    thread_split: bool          # CPU: the function takes (start, end) of the outermost global axis
    gpu: bool
    min_groups: int = 0         # GPU occupancy hint: this many work-groups should fit on one SM at once
                                # (CUDA: caps registers at regs_per_SM / (local size * min_groups)); 0: none
    schedule: Any = None        # the codegen.schedule.Schedule it was lowered with (shown by MOROK_DEBUG)

    @property
    def symbol(self) -> str:
        """The function's symbol in the rendered source (`name` is the user's, any string)."""
        return symbol_for(self.name)

    def walk(self):
        """Every instruction, depth first, in program order."""
        def go(items):
            for it in items:
                if isinstance(it, Instr):
                    yield it
                elif isinstance(it, Loop):
                    yield it.var; yield it.start; yield it.end
                    yield from go(it.body)
                else:
                    yield it.cond
                    yield from go(it.body)
        yield from go(self.body)

    def dump(self) -> str:
        lines: list[str] = []
        def go(items, pad):
            for it in items:
                if isinstance(it, Instr):
                    lines.append(pad + repr(it))
                elif isinstance(it, Loop):
                    lines.append(f"{pad}for %{it.var.id} in [%{it.start.id}, %{it.end.id}) ({it.kind.value}):")
                    go(it.body, pad + "  ")
                else:
                    lines.append(f"{pad}if %{it.cond.id}:")
                    go(it.body, pad + "  ")
        go(self.body, "")
        return "\n".join(lines)
