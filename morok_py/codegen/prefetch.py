"""Software prefetches for the CPU register tile's epilogue: a pass over the linear kernel (`Schedule.prefetch`).

A register tile sums over its reduction loop, then reads its epilogue's tensor operands (a residual added in)
and writes its outputs: `ti` rows of `tj` columns, the rows a plane of pixels apart, so each row of the tile
is a cache line of its own on a page of its own. The tile walk goes down the rows of a column panel, which no
hardware prefetcher follows: those lines came from L3 after the loop, with nothing left to overlap their
latency. This pass puts a prefetch of each such line just before the tile's reduction loop (the address
computation cloned there), into L2 (PREFETCH_LOCALITY), so it arrives while the loop runs.

Measured on the 2-vCPU AVX2 EPYC (Zen 3), two threads:
- `kernels.conv_gemm` with a bias, a residual and relu, all buffers warm in L3, alone (into L1): 64 -> 256 at
  56x56 1.68 -> 1.04 ms (bias and relu alone 0.95), 128 -> 512 at 28x28 1.16 -> 0.94, 256 -> 1024 at 14x14
  0.97 -> 0.90. Prefetching the residual's loads alone: 1.34 ms.
- resnet50 (the onnx wheel's light model) in launch order, one process, the two forms compiled side by side,
  sums of the per-launch medians: 92.0 / 92.8 ms without, 87.5 / 88.8 ms into L2, 89.5 / 86.5 into L1. Into
  L1 the 7x7 stage lost 3% (its long reductions stream more than L1 holds past the prefetched lines), into L2
  it tied, and the 56x56 and 28x28 layers gained 7%. densenet121: 76.7 / 78.5 -> 75.7 / 77.2 ms.
"""
from __future__ import annotations

from ..ir import AxisType, Ops
from .linear import If, Instr, L, LinearKernel, Loop

PREFETCH_LOCALITY = 2       # LLVM's locality hint: 2 is L2 (x86 prefetcht1), 3 would be L1 (prefetcht0)

_DIVISIONS = (Ops.IDIV, Ops.MOD, Ops.CDIV, Ops.CMOD, Ops.FDIV)


def prefetch_tile_epilogues(kernel: LinearKernel) -> int:
    """Insert the prefetches described above into `kernel` (a CPU kernel); returns how many."""
    if kernel.gpu:
        return 0
    next_id = [1 + max((ins.id for ins in kernel.walk()), default=0)]
    count = [0]

    def fresh(kind: L, dtype, src: tuple, arg, like: Instr | None = None) -> Instr:
        ins = Instr(kind, dtype, src, arg, next_id[0], index_math=bool(like is not None and like.index_math))
        next_id[0] += 1
        return ins

    def visit(block: list, available: set[int]) -> None:
        avail = available       # each call's own set: the callers pass a new one
        out: list = []
        for pos, it in enumerate(block):
            if isinstance(it, Loop):
                if it.kind is AxisType.REDUCE:
                    found = _prefetches(block[pos + 1:], avail, fresh)
                    count[0] += sum(1 for ins in found if ins.kind is L.PREFETCH)
                    out += found
                visit(it.body, avail | {it.var.id, it.start.id, it.end.id})
            elif isinstance(it, If):
                visit(it.body, avail | {it.cond.id})
            else:
                avail.add(it.id)
            out.append(it)
        block[:] = out

    visit(kernel.body, set())
    return count[0]


def _prefetches(after: list, available: set[int], fresh) -> list[Instr]:
    """Cloned index computations and PREFETCH instructions for the vector loads and stores among `after` (the
    items that follow a reduction loop in its block) whose address needs only what is `available` before the
    loop: the loop's sums, another load, or a division (whose guards stay where they are) rule one out."""
    out: list[Instr] = []
    clones: dict[int, Instr] = {}
    seen: set[tuple[int, int]] = set()

    def clone(ins: Instr) -> Instr | None:
        if ins.id in available:
            return ins
        if ins.id in clones:
            return clones[ins.id]
        if ins.kind is not L.ALU or ins.arg in _DIVISIONS:
            return None
        src = []
        for s in ins.src:
            c = clone(s)
            if c is None:
                return None
            src.append(c)
        c = clones[ins.id] = fresh(ins.kind, ins.dtype, tuple(src), ins.arg, ins)
        out.append(c)
        return c

    for it in after:
        if not isinstance(it, Instr) or it.kind not in (L.LOAD, L.STORE):
            continue
        buf, idx = it.src[0], it.src[1]
        if buf.kind is not L.PARAM or not (it.arg or it.lanes > 1):
            continue        # scalar accesses (a bias per row) are one line for many tiles
        if (buf.id, idx.id) in seen:
            continue
        seen.add((buf.id, idx.id))
        c = clone(idx)
        if c is not None:
            out.append(fresh(L.PREFETCH, None, (buf, c), (1 if it.kind is L.STORE else 0, PREFETCH_LOCALITY)))
    return out
