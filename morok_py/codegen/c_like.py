"""C-style source for a LinearKernel, shared by the CUDA C and HIP C renderers.

Prints structured C: `for` loops, `if` guards, accumulators as local variables, one `const`
local per SSA value. What differs between dialects -- the kernel signature, work-item ids, the
types that hold half and bfloat16, helper functions -- are hooks a subclass overrides.

Semantics follow the LLVM printer (and so the CPU): signed integer add/sub/mul/neg/shl wrap
(computed in unsigned), half and bfloat16 arithmetic is done in float and rounded back after
every op, float max/min propagate NaN like numpy, float literals are exact (hex floats, bit
patterns for inf and NaN).
"""
from __future__ import annotations

import math
import struct

from ..dtypes import DType, dtypes
from ..ir import Ops
from .linear import If, Instr, L, LinearKernel, Loop

_HALF = ("float16", "bfloat16")


def _byte(dt: DType) -> bool:
    """An 8-bit storage-only type (float8, ...): packed four to a 32-bit word in a vector."""
    return dt.storage_only and dt.itemsize == 1


def half_bits(value: float, dt: DType) -> int:
    """The 16-bit pattern of `value` rounded to float16 or bfloat16 (round to nearest even)."""
    if dt.name == "float16":
        import numpy as np
        with np.errstate(over="ignore"):
            return int(np.array(value, dtype=np.float32).astype(np.float16).view(np.uint16))
    if math.isnan(value):
        return 0x7FC0
    bits = struct.unpack("<I", struct.pack("<f", value if abs(value) < 3.5e38 else math.copysign(math.inf, value)))[0]
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def c_float(value: float, dt: DType) -> str | None:
    """An exact C literal for a finite float32/float64 (hex float); None for inf and NaN."""
    if not math.isfinite(value):
        return None
    if dt.name == "float32":
        f32 = struct.unpack("<f", struct.pack("<f", value))[0] if abs(value) < 3.5e38 else math.inf
        if not math.isfinite(f32):
            return None
        text = f32.hex() + "f"
    else:
        text = value.hex()
    return f"({text})" if text.startswith("-") else text


class CStylePrinter:
    """Prints one kernel as C; override the hooks for a dialect (CUDA C, HIP C)."""

    restrict = "__restrict__"
    indent_unit = "  "

    def __init__(self, kernel: LinearKernel) -> None:
        self.k = kernel
        self.lines: list[str] = []
        self.acc_decls: list[str] = []
        self.depth = 1
        self.uses: set[str] = set()     # feature flags the prelude may need ('half', 'bfloat16')

    # ---- dialect hooks --------------------------------------------------------------------
    def prelude(self) -> list[str]:
        """Lines before the kernel: includes, typedefs, helpers (may read `self.uses`)."""
        return []

    def kernel_decl(self) -> str:
        """What goes before the kernel's name: `void`, or `extern "C" __global__ void ...` on a GPU."""
        return "void"

    def signature(self) -> str:
        args = []
        for p in self.k.params:
            const = "const " if p.read and not p.written else ""
            args.append(f"{const}{self.mem_type(p.dtype)}* {self.restrict} p{p.slot}".replace("  ", " "))
        args += [f"{self.index_type()} var_{n}" for n in self.k.var_names]
        if self.k.thread_split:
            args += [f"{self.index_type()} start", f"{self.index_type()} end"]
        return f"{self.kernel_decl()} {self.k.symbol}({', '.join(args)})"

    def special(self, ins: Instr) -> str:
        """An int expression for a work-item id: ins.arg is ('group_id'|'local_id', dim)."""
        raise NotImplementedError(f"{type(self).__name__} has no work-item ids")

    def shared_decl(self, ins: Instr) -> str:
        """A work-group shared array (CUDA and HIP spell it the same)."""
        # 16-byte aligned: tiles are read back as 4-wide vectors
        return f"__shared__ __align__(16) {self.mem_type(ins.dtype)} smem{ins.id}[{ins.arg}];"

    def barrier(self) -> str:
        return "__syncthreads();"

    def half_type(self, dt: DType) -> str:
        """The C type holding a float16/bfloat16 value (storage and registers alike)."""
        return "unsigned short"

    def half_to_float(self, expr: str, dt: DType) -> str:
        raise NotImplementedError(f"{type(self).__name__} cannot convert {dt.name} to float")

    def float_to_half(self, expr: str, dt: DType) -> str:
        raise NotImplementedError(f"{type(self).__name__} cannot convert float to {dt.name}")

    def half_literal(self, bits: int, dt: DType) -> str:
        return f"(({self.half_type(dt)})0x{bits:04X}u)"

    def float_from_bits(self, bits: int, dt: DType) -> str:
        """inf and NaN literals, by bit pattern (CUDA and HIP both have these intrinsics)."""
        if dt.name == "float32":
            return f"__uint_as_float(0x{bits:08X}u)"
        return f"__longlong_as_double(0x{bits:016X}ll)"

    def math_fn(self, op: Ops, dt: DType) -> str:
        base = {Ops.EXP2: "exp2", Ops.LOG2: "log2", Ops.SQRT: "sqrt", Ops.SIN: "sin", Ops.TRUNC: "trunc",
                Ops.MAX: "fmax", Ops.MIN: "fmin"}[op]
        return base + ("f" if dt.name == "float32" else "")

    # ---- types ----------------------------------------------------------------------------
    def index_type(self) -> str:
        return self.ctype(dtypes.index)

    def ctype(self, dt: DType) -> str:
        """The C type of a value of dt."""
        if dt.name in _HALF:
            self.uses.add(dt.name)
            return self.half_type(dt)
        return dt.c

    def mem_type(self, dt: DType) -> str:
        """The C type of a buffer element (bool is a byte, as in the LLVM printer)."""
        return "unsigned char" if dt.is_bool else self.ctype(dt)

    _VECTOR_BASE = {"float32": "float", "int32": "int", "uint32": "uint"}

    def vector_type(self, dt: DType, width: int) -> str:
        """The built-in vector type of `width` elements of dt (float4, int4, uint4)."""
        if dt.name in _HALF and width in (2, 4, 8):     # 16-bit elements packed in pairs into 32-bit words
            return f"uint{width // 2}"
        if _byte(dt) and width in (4, 8, 16):           # 8-bit storage-only elements (float8): 4 to a word
            return f"uint{width // 4}"
        base = self._VECTOR_BASE.get(dt.name)
        if base is None or width not in (2, 4):
            raise NotImplementedError(f"{type(self).__name__} has no {width}-wide vector of {dt.name}")
        return f"{base}{width}"

    @staticmethod
    def unsigned_of(dt: DType) -> str:
        return "unsigned long long" if dt.bits > 32 else "unsigned int"

    # ---- references -----------------------------------------------------------------------
    def ref(self, ins: Instr) -> str:
        k = ins.kind
        if k is L.CONST:
            return self.const(ins.arg, ins.dtype)
        if k is L.PARAM:
            return f"p{ins.arg}"
        if k is L.LOCAL:
            return f"smem{ins.id}"
        if k is L.VAR:
            return f"var_{ins.arg}"
        if k is L.THREAD_RANGE:
            return str(ins.arg)
        return f"v{ins.id}"

    def const(self, v, dt: DType) -> str:
        if dt.is_bool:
            return "true" if v else "false"
        if dt.name in _HALF:
            self.uses.add(dt.name)
            return self.half_literal(half_bits(float(v), dt), dt)
        if dt.is_float:
            lit = c_float(float(v), dt)
            if lit is not None:
                return lit
            if dt.name == "float32":
                bits = 0x7FC00000 if math.isnan(v) else (0x7F800000 if v > 0 else 0xFF800000)
            else:
                bits = 0x7FF8000000000000 if math.isnan(v) else (0x7FF0000000000000 if v > 0 else 0xFFF0000000000000)
            return self.float_from_bits(bits, dt)
        v = int(v)
        if dt.is_unsigned:
            suffix = "ull" if dt.bits == 64 else "u"
            text = f"{v}{suffix}"
        elif v == dt.min():
            text = f"({v + 1}{'ll' if dt.bits == 64 else ''} - 1)"
        else:
            text = f"{v}{'ll' if dt.bits == 64 else ''}"
            if v < 0:
                text = f"({text})"
        return text if dt.bits >= 32 else f"(({dt.c}){text})"

    # ---- program ----------------------------------------------------------------------------
    def emit(self, line: str) -> None:
        self.lines.append(self.indent_unit * self.depth + line)

    def render(self) -> str:
        self.items(self.k.body)
        body = [self.indent_unit + a for a in self.acc_decls] + self.lines
        out = list(self.prelude())
        out.append(self.signature() + " {")
        out.extend(body)
        out.append("}")
        return "\n".join(out) + "\n"

    def items(self, items) -> None:
        for it in items:
            if isinstance(it, Loop):
                self.loop(it)
            elif isinstance(it, If):
                self.branch(it)
            else:
                self.instr(it)

    def loop(self, lp: Loop) -> None:
        v = self.ref(lp.var)
        inc = f"{v}++" if lp.step is None else f"{v} += {self.ref(lp.step)}"
        if lp.unroll > 1:
            self.emit(f"#pragma unroll {lp.unroll}")
        self.emit(f"for ({self.index_type()} {v} = {self.ref(lp.start)}; {v} < {self.ref(lp.end)}; {inc}) {{")
        self.depth += 1
        self.items(lp.body)
        self.depth -= 1
        self.emit("}")

    def branch(self, br: If) -> None:
        self.emit(f"if ({self.ref(br.cond)}) {{")
        self.depth += 1
        self.items(br.body)
        self.depth -= 1
        self.emit("}")

    def define(self, ins: Instr, expr: str) -> None:
        self.emit(f"const {self.ctype(ins.dtype)} {self.ref(ins)} = {expr};")

    def instr(self, ins: Instr) -> None:
        k = ins.kind
        if k in (L.CONST, L.PARAM, L.VAR, L.THREAD_RANGE):
            return
        if k is L.SPECIAL:
            self.define(ins, self.special(ins))
        elif k is L.LOCAL:
            self.emit(self.shared_decl(ins))
        elif k is L.BARRIER:
            self.emit(self.barrier())
        elif k is L.LOAD:
            buf, idx = ins.src
            if ins.arg:
                vt = self.vector_type(ins.dtype, ins.arg)
                self.emit(f"{vt} v{ins.id} = *((const {vt}*)({self.ref(buf)} + {self.ref(idx)}));")
                return
            base = self.ref(buf)
            if ins.volatile:
                base = f"((volatile {self.mem_type(ins.dtype)}*){base})"
            val = f"{base}[{self.ref(idx)}]"
            self.define(ins, f"({val} != 0)" if ins.dtype.is_bool else val)
        elif k is L.STORE:
            buf, idx, val = ins.src
            v = self.ref(val)
            if ins.arg:
                vt = self.vector_type(val.dtype, ins.arg)
                self.emit(f"*(({vt}*)({self.ref(buf)} + {self.ref(idx)})) = {v};")
                return
            if val.dtype.is_bool:
                v = f"(unsigned char){v}"
            self.emit(f"{self.ref(buf)}[{self.ref(idx)}] = {v};")
        elif k is L.VECTOR:
            vt = self.vector_type(ins.dtype, len(ins.src))
            parts = [self.ref(x) for x in ins.src]
            if ins.dtype.name in _HALF:     # 16-bit patterns, two to a word, the lower index in the low half
                parts = [f"((unsigned){lo} | ((unsigned){hi} << 16))" for lo, hi in zip(parts[::2], parts[1::2])]
            elif _byte(ins.dtype):          # bytes, four to a word, the lowest index in the low byte
                parts = ["(" + " | ".join(f"((unsigned){x} << {8 * e})" if e else f"(unsigned){x}"
                                          for e, x in enumerate(parts[w:w + 4])) + ")" for w in range(0, len(parts), 4)]
            self.emit(f"{vt} v{ins.id} = make_{vt}({', '.join(parts)});")
        elif k is L.EXTRACT:
            if ins.dtype.name in _HALF:    # a lane of 16-bit elements packed into a uint4
                word = f"(&{self.ref(ins.src[0])}.x)[{ins.arg // 2}]"
                self.define(ins, f"({self.ctype(ins.dtype)})({word} >> {16 * (ins.arg % 2)})")
                return
            if _byte(ins.dtype):           # a byte of a packed vector
                word = f"(&{self.ref(ins.src[0])}.x)[{ins.arg // 4}]"
                self.define(ins, f"({self.ctype(ins.dtype)})({word} >> {8 * (ins.arg % 4)})")
                return
            self.define(ins, f"{self.ref(ins.src[0])}.{'xyzw'[ins.arg]}")
        elif k is L.ATOMIC_ADD:
            buf, idx, val = ins.src
            self.define(ins, f"atomicAdd({self.ref(buf)} + {self.ref(idx)}, {self.ref(val)})")
        elif k is L.FENCE:
            self.emit("__threadfence();")
        elif k is L.SHUFFLE_XOR:
            self.define(ins, self.shuffle_xor(self.ref(ins.src[0]), ins.arg[0]))
        elif k is L.ACC:
            self.acc_decls.append(f"{self.ctype(ins.dtype)} acc{ins.id};")
            self.emit(f"acc{ins.id} = {self.const(ins.arg, ins.dtype)};")
        elif k is L.ACC_LOAD:
            self.define(ins, f"acc{ins.src[0].id}")
        elif k is L.ACC_STORE:
            acc, val = ins.src
            self.emit(f"acc{acc.id} = {self.ref(val)};")
        elif k is L.ALU:
            self.alu(ins)
        elif k is L.LDMATRIX:
            self.ldmatrix(ins)
        elif k is L.MMA:
            self.mma(ins)
        elif k in (L.WGMMA, L.SMEM_DESC, L.WG_SYNC, L.MBAR):
            self.warpgroup(ins)
        else:
            raise NotImplementedError(k)

    def ldmatrix(self, ins: Instr) -> None:
        """Tensor-core fragment load (codegen/strategies/tensor_core.py); dialects with tensor cores print it."""
        raise NotImplementedError(f"{type(self).__name__} has no tensor-core fragment loads")

    def warpgroup(self, ins: Instr) -> None:
        """Warpgroup matrix instructions (codegen/strategies/wgmma.py); NVIDIA sm_90a dialects print them."""
        raise NotImplementedError(f"{type(self).__name__} has no warpgroup matrix instructions")

    def mma(self, ins: Instr) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no tensor-core instructions")

    # ---- ALU --------------------------------------------------------------------------------
    def alu(self, ins: Instr) -> None:
        op, dt, srcs = ins.arg, ins.dtype, list(ins.src)
        if op is Ops.CAST:
            self.define(ins, self.cast(self.ref(srcs[0]), srcs[0].dtype, dt))
            return
        if op is Ops.BITCAST:
            self.bitcast(ins)
            return
        if op is Ops.WHERE:
            c, a, b = srcs
            self.define(ins, f"({self.ref(c)} ? {self.ref(a)} : {self.ref(b)})")
            return
        odt = srcs[0].dtype
        if odt.name in _HALF and op is not Ops.NOT:
            # half and bfloat16 arithmetic is done in float32, rounded back once per op
            args = [self.half_to_float(self.ref(s), odt) for s in srcs]
            res = self.alu_expr(op, dtypes.float32, args, ins)
            self.define(ins, res if op in (Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE) else self.float_to_half(res, odt))
            return
        self.define(ins, self.alu_expr(op, odt, [self.ref(s) for s in srcs], ins))

    def alu_expr(self, op: Ops, dt: DType, a: list[str], ins: Instr) -> str:
        """A C expression for op on operands of type dt (never float16/bfloat16 here)."""
        f = dt.is_float
        if dt.is_int and not ins.index_math and op in (Ops.ADD, Ops.SUB, Ops.MUL, Ops.NEG, Ops.SHL):
            # fixed-width wrap-around, as in LLVM and numpy: signed overflow is undefined in C
            u = self.unsigned_of(dt)
            if op is Ops.NEG:
                return f"({dt.c})(0u - ({u}){a[0]})"
            sym = {Ops.ADD: "+", Ops.SUB: "-", Ops.MUL: "*", Ops.SHL: "<<"}[op]
            rhs = a[1] if op is Ops.SHL else f"({u}){a[1]}"
            return f"({dt.c})(({u}){a[0]} {sym} {rhs})"
        # the divisions are trap-free and truncating here (decompose.defined_division)
        binops = {Ops.ADD: "+", Ops.SUB: "-", Ops.MUL: "*", Ops.FDIV: "/", Ops.IDIV: "/", Ops.MOD: "%",
                  Ops.CDIV: "/", Ops.CMOD: "%",
                  Ops.CMPLT: "<", Ops.CMPEQ: "==", Ops.CMPNE: "!=", Ops.AND: "&", Ops.OR: "|", Ops.XOR: "^",
                  Ops.SHL: "<<", Ops.SHR: ">>"}
        if op in binops:
            expr = f"({a[0]} {binops[op]} {a[1]})"
            if dt.is_bool and op in (Ops.AND, Ops.OR, Ops.XOR):
                return f"(bool){expr}"
            return expr
        if op in (Ops.MAX, Ops.MIN):
            if f:
                # NaN-propagating like numpy.maximum / numpy.max (fmax/fmin drop NaNs)
                return f"(({a[0]} != {a[0]} || {a[1]} != {a[1]}) ? ({a[0]} + {a[1]}) : {self.math_fn(op, dt)}({a[0]}, {a[1]}))"
            if dt.is_bool:
                return f"({a[0]} {'|' if op is Ops.MAX else '&'} {a[1]})"
            return f"({a[0]} {'>' if op is Ops.MAX else '<'} {a[1]} ? {a[0]} : {a[1]})"
        if op is Ops.NEG:
            return f"(-{a[0]})"
        if op is Ops.NOT:
            return f"(!{a[0]})" if dt.is_bool else f"({dt.c})(~{a[0]})"
        if op is Ops.RECIP:
            return f"({self.const(1.0, dt)} / {a[0]})"
        if op in (Ops.EXP2, Ops.LOG2, Ops.SQRT, Ops.SIN, Ops.TRUNC):
            return f"{self.math_fn(op, dt)}({a[0]})"
        raise NotImplementedError(f"C printer has no rule for {op}")

    def cast(self, v: str, fr: DType, to: DType) -> str:
        if fr == to:
            return v
        if to.is_bool:
            if fr.name in _HALF:
                return f"({self.half_to_float(v, fr)} != 0.0f)"
            return f"({v} != {self.const(0.0 if fr.is_float else 0, fr)})"
        if fr.name in _HALF:
            wide = self.half_to_float(v, fr)
            return wide if to.name == "float32" else self.cast(wide, dtypes.float32, to)
        if to.name in _HALF:
            # via float32: a float64 source is rounded twice (documented difference from LLVM's fptrunc)
            narrow = v if fr.name == "float32" else f"(float){v}"
            return self.float_to_half(narrow, to)
        return f"({to.c}){v}"

    def bitcast(self, ins: Instr) -> None:
        src = ins.src[0]
        fr, to = src.dtype, ins.dtype
        r = self.ref(ins)
        # a union is the portable bit cast in CUDA and HIP C++
        self.emit(f"union {{ {self.ctype(fr)} a; {self.ctype(to)} b; }} {r}_u;")
        self.emit(f"{r}_u.a = {self.ref(src)};")
        self.define(ins, f"{r}_u.b")


# bfloat16 as 16 bits in CUDA and HIP C alike (both have __uint_as_float / __float_as_uint)
GPU_BF16_HELPERS = [
    "typedef unsigned short morok_bf16;  /* bfloat16 bits: the top half of a float32 */",
    "__device__ __forceinline__ float morok_bf2f(morok_bf16 b) { return __uint_as_float(((unsigned int)b) << 16); }",
    # round to nearest even, NaN stays a quiet NaN (what LLVM's fptrunc to bfloat does)
    "__device__ __forceinline__ morok_bf16 morok_f2bf(float f) { unsigned int u = __float_as_uint(f); "
    "if ((u & 0x7fffffffu) > 0x7f800000u) return (morok_bf16)0x7fc0u; "
    "return (morok_bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); }",
]


class GPUCPrinter(CStylePrinter):
    """The dialect CUDA C and HIP C share: `extern "C" __global__` with `__launch_bounds__`,
    blockIdx/threadIdx, and half/bfloat16 kept as 16-bit patterns converted by small helpers
    (`half_helpers`: dtype name -> source lines, set by each backend) so no vendor headers are needed."""

    half_helpers: dict[str, list[str]] = {}

    def kernel_decl(self) -> str:
        threads = max(1, math.prod(self.k.local_size))
        return f'extern "C" __global__ void __launch_bounds__({threads})'

    def special(self, ins: Instr) -> str:
        kind, dim = ins.arg
        base = {"group_id": "blockIdx", "local_id": "threadIdx"}[kind]
        return f"(int){base}.{'xyz'[dim]}"

    def half_type(self, dt: DType) -> str:
        return "morok_half" if dt.name == "float16" else "morok_bf16"

    def shuffle_xor(self, value: str, mask: int) -> str:
        return f"__shfl_xor_sync(0xffffffffu, {value}, {mask})"

    def half_to_float(self, expr: str, dt: DType) -> str:
        self.uses.add(dt.name)
        return f"{'morok_h2f' if dt.name == 'float16' else 'morok_bf2f'}({expr})"

    def float_to_half(self, expr: str, dt: DType) -> str:
        self.uses.add(dt.name)
        return f"{'morok_f2h' if dt.name == 'float16' else 'morok_f2bf'}({expr})"

    def prelude(self) -> list[str]:
        out: list[str] = []
        for name in ("float16", "bfloat16"):
            if name in self.uses:
                out.extend(self.half_helpers[name])
        return out
