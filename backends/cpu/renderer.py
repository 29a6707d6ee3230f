"""LLVM IR for the host CPU: noalias buffers, a (start, end) thread split of the outer axis."""
from __future__ import annotations

from morok_py.codegen.decompose import vector_friendly_math
from morok_py.codegen.linear import Instr, L, LinearKernel
from morok_py.codegen.llvm_ir import LLVMIRPrinter
from morok_py.codegen.lower import Capabilities
from morok_py.device import DeviceSpec, Renderer
from morok_py.dtypes import DType, dtypes
from morok_py.ir import Ops


# suffix of the streaming variant of a kernel: the same loop, its aligned vector stores non-temporal
STREAM_SUFFIX = "__stream"
# the streaming variant's contract with the runtime: written buffers are aligned to this many bytes
# and every thread's `start` is a multiple of this many elements (so also of 64 bytes for any dtype)
STREAM_ALIGN = 64
# first line of a kernel whose register tile is printed as LLVM vectors (the compiler's light pipeline)
LANES_MARK = "; morok: register-tile lanes"


def streams_output(kernel: LinearKernel) -> bool:
    """Whether non-temporal stores can only help: a thread-split kernel with no reduction whose stored
    buffers it never reads back, so every line it writes leaves the core untouched (x86-64 only)."""
    if not kernel.thread_split or kernel.gpu:
        return False
    stored, loaded = set(), set()
    for ins in kernel.walk():
        if ins.kind in (L.ACC, L.LOCAL, L.ATOMIC_ADD):
            return False
        if ins.kind is L.STORE:
            if ins.src[0].kind is not L.PARAM:
                return False
            stored.add(ins.src[0].arg)
        elif ins.kind is L.LOAD:
            loaded.add(ins.src[0].arg)
    return bool(stored) and not stored & loaded


class CPULLVMPrinter(LLVMIRPrinter):
    param_attrs = "noalias nocapture"
    split_addresses = True
    bf16_rounding_in_ir = True      # x86 without AVX512-BF16 (and other CPUs) would call __truncsfbf2 per element

    def alu_text(self, op: Ops, dt: DType, a: list[str], ins: Instr) -> str:
        """Float MAX / MIN as numpy computes them, `a > b ? a : b` (`<` for MIN) with a NaN in either operand
        propagated: x86's one-instruction max (the comparison and select) and a NaN check of `a`, where
        LLVM's `llvm.maximum` also orders -0 below +0 (numpy does not: which zero a tie gives depends on its
        dtype) in six instructions a vector on AVX-512 (two sign tests and blends besides). Not for a reduction's
        accumulation (`reassoc`): LLVM vectorizes a loop's `llvm.maximum` chain as a reduction, not the
        selects. Two threads of the 2-vCPU AVX-512 Xeon, each form compiled in one process: resnet50's 3x3
        stride-2 max pool over 64 x 112 x 112 (eight of them a vector of output) 0.21 against 0.42 ms; a row
        max over 256 x 4099 with the selects in the reduction 1.24 against 0.11 ms. Nor with a constant
        operand (a clamp, relu): LLVM lowers `llvm.maximum` by a constant to the bare instruction (exp2's
        clamps through the selects made a softmax over 512 x 4099 2.2 against 1.9 ms). Nor for `max(x, -x)`
        (UOp.abs), whose +0 for a zero of either sign is `llvm.maximum`'s ordering of the zeros."""
        if (op in (Ops.MAX, Ops.MIN) and dt.is_float and not ins.reassoc and not any(map(_constant, ins.src))
                and not _negation_pair(ins)):
            t, c, p = self.vt(dt), self.vt(dtypes.bool), f"{self.ref(ins)}.{'mx' if op is Ops.MAX else 'mn'}"
            self.emit(f"{p}.c = fcmp {'ogt' if op is Ops.MAX else 'olt'} {t} {a[0]}, {a[1]}")
            self.emit(f"{p}.s = select {c} {p}.c, {t} {a[0]}, {t} {a[1]}")
            self.emit(f"{p}.n = fcmp uno {t} {a[0]}, {a[0]}")
            return f"select {c} {p}.n, {t} {a[0]}, {t} {p}.s"
        return super().alu_text(op, dt, a, ins)

    def trailer(self) -> list[str]:
        out = super().trailer()
        if self.triple.startswith("x86_64") and streams_output(self.k):
            out += self.stream_variant()
        return out

    def stream_variant(self) -> list[str]:
        """`@<symbol>__stream`: the kernel inlined under the runtime's alignment promises, so that LLVM
        proves its vector stores aligned; the compiler then marks those non-temporal. The closing fence
        orders the write-combined stores before the thread reports its chunk done."""
        k = self.k
        written = {p.slot for p in k.params if p.written}
        params = [(f"ptr noalias nocapture{f' align {STREAM_ALIGN}' if p.slot in written else ''}", f"%p{p.slot}")
                  for p in k.params]
        params += [("i32", f"%var_{n}") for n in k.var_names] + [("i32", "%start"), ("i32", "%end")]
        return [
            f"define void @{k.symbol}{STREAM_SUFFIX}({', '.join(f'{t} {n}' for t, n in params)}) #0 {{",
            "entry:",
            f"  %start.low = and i32 %start, {STREAM_ALIGN - 1}",
            "  %start.aligned = icmp eq i32 %start.low, 0",
            "  call void @llvm.assume(i1 %start.aligned)",
            f"  call void @{k.symbol}({', '.join(f'{t.split()[0]} {n}' for t, n in params)}) #1",
            "  fence seq_cst",
            "  ret void",
            "}",
            *([] if "llvm.assume" in self.decls else ["declare void @llvm.assume(i1 noundef)"]),
            "attributes #1 = { alwaysinline }",
        ]


def _constant(ins: Instr) -> bool:
    """A constant, or a constant broadcast over a register tile's lanes."""
    return ins.kind is L.CONST or (ins.kind is L.BROADCAST and ins.src[0].kind is L.CONST)


def _negation_pair(ins: Instr) -> bool:
    """A two-operand instruction whose operands are x and -x."""
    a, b = ins.src
    neg = lambda u, v: u.kind is L.ALU and u.arg is Ops.NEG and u.src[0] is v
    return neg(a, b) or neg(b, a)


def register_tile_for(features: str) -> tuple[int, int]:
    """Output tile of a register-blocked reduction (matmul), sized to the vector register file:
    32 zmm registers hold 6x64 float32 accumulators (24 registers) plus 4 column vectors and a broadcast;
    16 ymm hold 6x16. AVX-512's 6x64 beats 8x32 (16 accumulators): per k 8x32 loads 8 broadcasts and
    2 vectors for 16 FMAs, 6x64 loads 6 and 4 for 24; on the H100 host's Xeon 6x64 ran 1024^3 in 1.90 /
    2.66 ms (16 / 12 threads, best rounds) against 8x32's 2.11 / 3.01 (benchmarks/cpu_tiles.py,
    benchmarks/results/cpu-xeon-avx512-16c/cpu_tiles-{16,12}threads.json)."""
    feats = set(features.split(","))
    if "+avx512f" in feats:
        return (6, 64)
    if "+avx2" in feats or "+avx" in feats:
        return (6, 16)
    return (4, 8)


def tile_lanes_for(features: str) -> int:
    """Lanes of the register tile's column vectors: one vector register of float32 (LLVM splits wider
    element types into several registers)."""
    feats = set(features.split(","))
    return 16 if "+avx512f" in feats else 8 if ("+avx2" in feats or "+avx" in feats) else 4


class CPURenderer(Renderer):
    caps = Capabilities(has_threads=True, register_tile=(4, 8), tile_lanes=4)
    lane_vectors = True     # the printer emits the register tile's lanes as LLVM vectors

    def __init__(self, device: DeviceSpec, triple: str = "", features: str = "") -> None:
        super().__init__(device)
        self.triple = triple
        from morok_py import config
        self.caps = Capabilities(has_threads=True, register_tile=register_tile_for(features),
                                 tile_lanes=tile_lanes_for(features) if self.lane_vectors else 0,
                                 threads=config.cpu_threads())

    def decompositor(self):
        return vector_friendly_math

    def render_kernel(self, kernel: LinearKernel) -> str:
        p = CPULLVMPrinter(kernel)
        p.triple = self.triple
        src = p.render()
        if any(ins.lanes > 1 for ins in kernel.walk()):
            src = LANES_MARK + "\n" + src
        return src


class MLIRCPURenderer(CPURenderer):
    """MLIR (func/scf/arith/math/memref/vector) for the MLIR pair; the same lowering and register
    tile as the LLVM IR renderer (its columns scalar: the MLIR printer has no lane vectors), only the
    printer differs."""

    lane_vectors = False

    def render_kernel(self, kernel: LinearKernel) -> str:
        from morok_py.codegen.mlir import MLIRPrinter
        return MLIRPrinter(kernel).render()
