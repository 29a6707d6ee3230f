"""LLVM IR text for a LinearKernel, shared by the CPU, NVPTX and AMDGPU renderers.

Subclasses set the target (triple, pointer address space, calling convention, attributes) and
how work-item ids are read; everything else -- ALU ops, casts, loops, accumulators -- is here.
"""
from __future__ import annotations

import math
import struct

from ..dtypes import DType, dtypes
from ..ir import Ops
from .linear import If, Instr, L, LinearKernel, Loop


def llvm_float(value: float, dt: DType) -> str:
    """An exact LLVM literal for a float of type dt (hex forms are exact and cover inf/nan)."""
    if dt.name == "float64":
        return "0x%016X" % struct.unpack("<Q", struct.pack("<d", value))[0]
    if dt.name == "float32":
        f32 = struct.unpack("<f", struct.pack("<f", value))[0] if math.isfinite(value) and abs(value) < 3.5e38 \
            else value
        return "0x%016X" % struct.unpack("<Q", struct.pack("<d", f32))[0]
    if dt.name == "float16":
        return "0xH%04X" % struct.unpack("<H", struct.pack("<e", value))[0]
    if dt.name == "bfloat16":
        bits = struct.unpack("<I", struct.pack("<f", value))[0]
        if math.isnan(value):
            return "0xR7FC0"
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16   # round to nearest even
        return "0xR%04X" % (rounded & 0xFFFF)
    if dt.storage_only and value == 0 and math.copysign(1.0, value) > 0 and dt.name != "float8_e8m0fnu":
        return "0"          # +0.0 of a storage-only format (its byte, an i8): the zero fill of a float8 tile
    raise TypeError(dt)


_HALF = ("float16", "bfloat16")


class LLVMIRPrinter:
    """Prints one kernel; override the hooks for a target."""

    ptr = "ptr"                     # pointer type of buffer parameters
    triple = ""
    datalayout = ""
    param_attrs = "noalias"

    def __init__(self, kernel: LinearKernel) -> None:
        self.k = kernel
        self.lines: list[str] = []
        self.allocas: list[str] = []
        self.decls: dict[str, str] = {}
        self.block = "entry"
        self.label_id = 0
        self.metadata: list[str] = []
        self.globals: list[str] = []
        self.helpers: dict[str, str] = {}   # IR functions the kernel calls, printed after it
        self.defined_at: dict[int, int] = {}   # instruction id -> loop depth where it is printed

    # ---- target hooks ---------------------------------------------------------------------
    def signature(self) -> str:
        args = [f"{self.ptr} {self.param_attrs} %p{p.slot}".replace("  ", " ") for p in self.k.params]
        args += [f"i32 %var_{n}" for n in self.k.var_names]
        if self.k.thread_split:
            args += ["i32 %start", "i32 %end"]
        return f"define void @{self.k.symbol}({', '.join(args)}) #0"

    def attributes(self) -> str:
        return 'attributes #0 = { nounwind }'

    def special(self, ins: Instr) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no work-item ids")

    def trailer(self) -> list[str]:
        return list(self.helpers.values())

    def f64_helper(self, op: Ops, a: str) -> str:
        """A call of the double-precision IR helper for `op` (GPU targets: no libm)."""
        from .llvm_math import F64_HELPER_DECLS, F64_HELPERS
        name, build = F64_HELPERS[op]
        if name not in self.helpers:
            self.helpers[name] = build()
            self.decls.update(F64_HELPER_DECLS)
        return f"call double @{name}(double {a})"

    local_ptr = "ptr addrspace(3)"   # work-group shared memory (NVPTX and AMDGPU agree on 3)
    sync_scope = ""                  # atomics and fences: the target's device scope (system if empty)

    def barrier(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no work-group barrier")

    def shuffle_xor(self, ins: Instr) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no warp shuffles")

    # ---- helpers ----------------------------------------------------------------------------
    def declare(self, name: str, ret: str, *args: str) -> str:
        self.decls[name] = f"declare {ret} @{name}({', '.join(args)})"
        return name

    def ty(self, dt: DType | None) -> str:
        return "void" if dt is None else self.vt(dt)

    lanes = 1   # the lanes of the instruction being printed (register-tile vectors; 1: a scalar)

    def vt(self, dt: DType, llvm: str | None = None) -> str:
        """The LLVM type of a value of `dt` (or the given element type) in the current instruction's lanes."""
        t = dt.llvm if llvm is None else llvm
        return t if self.lanes <= 1 else f"<{self.lanes} x {t}>"

    # whether to round float32 -> bfloat16 in IR (integer round-to-nearest-even, vectorizable) rather than
    # with LLVM's fptrunc, which targets without a bf16 conversion (x86 before AVX512-BF16) turn into a
    # library call per element
    bf16_rounding_in_ir = False

    def fptrunc(self, r: str, v: str, to: DType) -> None:
        """`r` = the float32 value `v` rounded to `to` (float16 or bfloat16), in the current lanes."""
        f32 = self.vt(dtypes.float32)
        if to.name != "bfloat16" or not self.bf16_rounding_in_ir:
            self.emit(f"{r} = fptrunc {f32} {v} to {self.vt(to)}")
            return
        i32, c = self.vt(dtypes.int32), (lambda k: self.splat(str(k), dtypes.int32))   # noqa: E731
        self.emit(f"{r}.b = bitcast {f32} {v} to {i32}")
        self.emit(f"{r}.l = lshr {i32} {r}.b, {c(16)}")
        self.emit(f"{r}.o = and {i32} {r}.l, {c(1)}")
        self.emit(f"{r}.a = add {i32} {r}.b, {c(0x7FFF)}")
        self.emit(f"{r}.s = add {i32} {r}.a, {r}.o")
        self.emit(f"{r}.h = lshr {i32} {r}.s, {c(16)}")
        self.emit(f"{r}.n = fcmp uno {f32} {v}, {v}")
        self.emit(f"{r}.q = or {i32} {r}.l, {c(0x40)}")      # NaN: quiet, sign and top payload kept
        self.emit(f"{r}.m = select {self.vt(dtypes.bool)} {r}.n, {i32} {r}.q, {i32} {r}.h")
        self.emit(f"{r}.t = trunc {i32} {r}.m to {self.vt(dtypes.int16)}")
        self.emit(f"{r} = bitcast {self.vt(dtypes.int16)} {r}.t to {self.vt(to)}")

    def splat(self, text: str, dt: DType) -> str:
        """A constant operand (LLVM literal `text` of `dt`) in the current instruction's lanes."""
        return text if self.lanes <= 1 else f"splat ({dt.llvm} {text})"

    def mem_ty(self, dt: DType) -> str:
        return "i8" if dt.is_bool else dt.llvm

    def ref(self, ins: Instr) -> str:
        if ins.kind is L.CONST:
            v, dt = ins.arg, ins.dtype
            if dt.is_bool:
                return "true" if v else "false"
            if dt.is_float:
                return llvm_float(v, dt)
            if dt.is_unsigned and v >= 1 << (dt.bits - 1):
                v -= 1 << dt.bits   # LLVM prints integers as signed
            return str(int(v))
        if ins.kind is L.PARAM:
            return f"%p{ins.arg}"
        if ins.kind is L.VAR:
            return f"%var_{ins.arg}"
        if ins.kind is L.THREAD_RANGE:
            return f"%{ins.arg}"
        return f"%v{ins.id}"

    def emit(self, line: str) -> None:
        self.lines.append("  " + line)

    def label(self, prefix: str) -> str:
        self.label_id += 1
        return f"{prefix}{self.label_id}"

    def start_block(self, name: str) -> None:
        self.lines.append(f"{name}:")
        self.block = name

    # ---- program ----------------------------------------------------------------------------
    def render(self) -> str:
        self.items(self.k.body)
        self.emit("ret void")
        out = []
        if self.datalayout:
            out.append(f'target datalayout = "{self.datalayout}"')
        if self.triple:
            out.append(f'target triple = "{self.triple}"')
        out.extend(self.decls.values())
        out.extend(self.globals)
        out.append(self.signature() + " {")
        out.append("entry:")
        out.extend("  " + a for a in self.allocas)
        out.append("  br label %body")
        out.append("body:")
        out.extend(self.lines)
        out.append("}")
        out.append(self.attributes())
        out.extend(self.trailer())
        out.extend(self.metadata)
        return "\n".join(out) + "\n"

    def loop_md(self, prop: str = '!"llvm.loop.vectorize.enable", i1 false') -> int:
        """A distinct loop id carrying one property (default: no vectorization along the loop)."""
        n = len(self.metadata)
        self.metadata += [f"!{n} = distinct !{{!{n}, !{n + 1}}}", f"!{n + 1} = !{{{prop}}}"]
        return n

    loop_depth = 0

    def items(self, items) -> None:
        if self.block == "entry":
            self.block = "body"
        for it in items:
            if isinstance(it, Loop):
                self.defined_at[it.var.id] = self.loop_depth + 1
                self.loop_depth += 1
                self.loop(it)
                self.loop_depth -= 1
            elif isinstance(it, If):
                self.branch(it)
            else:
                self.defined_at[it.id] = self.loop_depth
                self.instr(it)

    def loop(self, lp: Loop) -> None:
        head, body, done = self.label("loop"), self.label("body"), self.label("exit")
        pred = self.block
        self.emit(f"br label %{head}")
        self.start_block(head)
        var = self.ref(lp.var)
        latch_val = f"%v{lp.var.id}.next"
        # the latch block is only known after the body; patch the phi afterwards
        phi_index = len(self.lines)
        self.emit("PHI")
        self.emit(f"%v{lp.var.id}.c = icmp slt i32 {var}, {self.ref(lp.end)}")
        self.emit(f"br i1 %v{lp.var.id}.c, label %{body}, label %{done}")
        self.start_block(body)
        self.items(lp.body)
        step = self.ref(lp.step) if lp.step is not None else "1"
        self.emit(f"{latch_val} = add nsw i32 {var}, {step}")
        # a loop carrying many accumulators is a register tile: vectorize across the tile's lanes
        # (SLP), not along the loop, which would turn the tile's row loads into gathers
        tile = sum(1 for it in lp.body if isinstance(it, Instr) and it.kind is L.ACC_STORE) >= 4 or any(
            isinstance(it, Instr) and it.kind is L.ACC_STORE and it.src[0].lanes > 1 for it in lp.body)
        md = ""
        if tile:
            md = f", !llvm.loop !{self.loop_md()}"
        elif lp.unroll > 1:
            prop = '!"llvm.loop.unroll.count", i32 ' + str(lp.unroll)
            md = f", !llvm.loop !{self.loop_md(prop)}"
        self.emit(f"br label %{head}" + md)
        self.lines[phi_index] = (f"  {var} = phi i32 [ {self.ref(lp.start)}, %{pred} ], "
                                 f"[ {latch_val}, %{self.block} ]")
        self.start_block(done)

    def branch(self, br: If) -> None:
        then, done = self.label("then"), self.label("endif")
        self.emit(f"br i1 {self.ref(br.cond)}, label %{then}, label %{done}")
        self.start_block(then)
        self.items(br.body)
        self.emit(f"br label %{done}")
        self.start_block(done)

    def instr(self, ins: Instr) -> None:
        k = ins.kind
        if k in (L.CONST, L.PARAM, L.VAR, L.THREAD_RANGE):
            return
        r = self.ref(ins)
        self.lanes = ins.lanes
        if ins.lanes > 1:
            self.lane_instr(ins, r)
            self.lanes = 1
            return
        if k is L.SPECIAL:
            self.emit(f"{r} = {self.special(ins)}")
        elif k is L.LOCAL:
            self.globals.append(f"@smem{ins.id} = internal addrspace(3) global [{ins.arg} x "
                                f"{self.mem_ty(ins.dtype)}] undef, align 16")
        elif k is L.BARRIER:
            self.emit(self.barrier())
        elif k is L.LOAD:
            buf, idx = ins.src
            mt = self.mem_ty(ins.dtype)
            pt = self.local_ptr if buf.kind is L.LOCAL else self.ptr
            base = f"@smem{buf.id}" if buf.kind is L.LOCAL else self.ref(buf)
            self.address(f"{r}.p", mt, pt, base, idx)
            vol = "volatile " if ins.volatile else ""
            if ins.arg:
                w = ins.arg
                self.emit(f"{r} = load {vol}<{w} x {mt}>, {pt} {r}.p, align {w * ins.dtype.itemsize}")
            elif ins.dtype.is_bool:
                self.emit(f"{r}.m = load {vol}i8, {pt} {r}.p, align 1")
                self.emit(f"{r} = icmp ne i8 {r}.m, 0")
            else:
                self.emit(f"{r} = load {vol}{mt}, {pt} {r}.p, align {ins.dtype.itemsize}")
        elif k is L.STORE:
            buf, idx, val = ins.src
            dt = val.dtype
            mt = self.mem_ty(dt)
            pt = self.local_ptr if buf.kind is L.LOCAL else self.ptr
            base = f"@smem{buf.id}" if buf.kind is L.LOCAL else self.ref(buf)
            self.address(f"%s{ins.id}.p", mt, pt, base, idx)
            v = self.ref(val)
            if ins.arg:
                w = ins.arg
                self.emit(f"store <{w} x {mt}> {v}, {pt} %s{ins.id}.p, align {w * dt.itemsize}")
                return
            if dt.is_bool:
                self.emit(f"%s{ins.id}.m = zext i1 {v} to i8")
                v = f"%s{ins.id}.m"
            self.emit(f"store {mt} {v}, {pt} %s{ins.id}.p, align {dt.itemsize}")
        elif k is L.PREFETCH:
            buf, idx = ins.src
            mt = self.mem_ty(buf.dtype)
            self.address(f"%f{ins.id}.p", mt, self.ptr, self.ref(buf), idx)
            fn = self.declare("llvm.prefetch.p0", "void", "ptr", "i32", "i32", "i32")
            write, locality = ins.arg
            self.emit(f"call void @{fn}(ptr %f{ins.id}.p, i32 {write}, i32 {locality}, i32 1)")
        elif k is L.VECTOR:
            t = self.ty(ins.dtype)
            w = len(ins.src)
            prev = "poison"
            for lane, x in enumerate(ins.src):
                name = r if lane == w - 1 else f"{r}.{lane}"
                self.emit(f"{name} = insertelement <{w} x {t}> {prev}, {t} {self.ref(x)}, i32 {lane}")
                prev = name
        elif k is L.EXTRACT:
            (vec,) = ins.src
            w, t = (vec.lanes, self.ty(ins.dtype)) if vec.lanes > 1 else (vec.arg, self.mem_ty(ins.dtype))
            self.emit(f"{r} = extractelement <{w} x {t}> {self.ref(vec)}, i32 {ins.arg}")
        elif k is L.ATOMIC_ADD:
            buf, idx, val = ins.src
            t = self.ty(ins.dtype)
            self.emit(f"{r}.p = getelementptr inbounds {t}, {self.ptr} {self.ref(buf)}, i32 {self.ref(idx)}")
            self.emit(f"{r} = atomicrmw add {self.ptr} {r}.p, {t} {self.ref(val)}{self.sync_scope} seq_cst")
        elif k is L.FENCE:
            self.emit(f"fence{self.sync_scope} seq_cst")
        elif k is L.SHUFFLE_XOR:
            self.shuffle_xor(ins)
        elif k is L.ACC:
            self.allocas.append(f"%acc{ins.id} = alloca {self.ty(ins.dtype)}")
            init = self.ref(Instr(L.CONST, ins.dtype, (), ins.arg, -1))
            self.emit(f"store {self.ty(ins.dtype)} {init}, ptr %acc{ins.id}")
        elif k is L.ACC_LOAD:
            self.emit(f"{r} = load {self.ty(ins.dtype)}, ptr %acc{ins.src[0].id}")
        elif k is L.ACC_STORE:
            acc, val = ins.src
            self.emit(f"store {self.ty(acc.dtype)} {self.ref(val)}, ptr %acc{acc.id}")
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

    split_addresses = False    # CPU: an index `outer + inner` becomes two 64-bit steps (see address)

    def address(self, name: str, mt: str, pt: str, base: str, idx: Instr) -> None:
        """`name` = &base[idx]. With split_addresses, an index that is an nsw sum of a value defined
        outside the current loop and one defined in it is two GEPs over sign-extended halves: the
        outer half's pointer is loop-invariant (the backend hoists it) and the inner one is the loop
        counter shared by every row (a symbolic-stride tile otherwise adds and sign-extends once per
        row and step)."""
        if self.split_addresses and idx.kind is L.ALU and idx.arg is Ops.ADD and idx.index_math:
            a, b = idx.src
            da, db = self.defined_at.get(a.id, 0), self.defined_at.get(b.id, 0)
            if da != db:
                outer, inner = (a, b) if da < db else (b, a)
                self.emit(f"{name}.o = sext i32 {self.ref(outer)} to i64")
                self.emit(f"{name}.q = getelementptr {mt}, {pt} {base}, i64 {name}.o")
                self.emit(f"{name}.i = sext i32 {self.ref(inner)} to i64")
                self.emit(f"{name} = getelementptr {mt}, {pt} {name}.q, i64 {name}.i")
                return
        self.emit(f"{name} = getelementptr inbounds {mt}, {pt} {base}, i32 {self.ref(idx)}")

    def lane_instr(self, ins: Instr, r: str) -> None:
        """An instruction on register-tile lanes (`ins.lanes` elements; codegen/strategies/tile_lanes.py):
        loads and stores of contiguous elements aligned to one element, accumulators and ALU ops on
        LLVM vectors."""
        k, dt, w = ins.kind, ins.dtype, ins.lanes
        if k is L.LOAD:
            buf, idx = ins.src
            mt = self.mem_ty(dt)
            self.address(f"{r}.p", mt, self.ptr, self.ref(buf), idx)
            if dt.is_bool:
                self.emit(f"{r}.m = load <{w} x i8>, {self.ptr} {r}.p, align 1")
                self.emit(f"{r} = icmp ne <{w} x i8> {r}.m, zeroinitializer")
            else:
                self.emit(f"{r} = load <{w} x {mt}>, {self.ptr} {r}.p, align {dt.itemsize}")
        elif k is L.STORE:
            buf, idx, val = ins.src
            dt = val.dtype
            mt = self.mem_ty(dt)
            self.address(f"%s{ins.id}.p", mt, self.ptr, self.ref(buf), idx)
            v = self.ref(val)
            if dt.is_bool:
                self.emit(f"%s{ins.id}.m = zext <{w} x i1> {v} to <{w} x i8>")
                v = f"%s{ins.id}.m"
            self.emit(f"store <{w} x {mt}> {v}, {self.ptr} %s{ins.id}.p, align {dt.itemsize}")
        elif k is L.BROADCAST:
            t = dt.llvm
            self.emit(f"{r}.i = insertelement <{w} x {t}> poison, {t} {self.ref(ins.src[0])}, i32 0")
            self.emit(f"{r} = shufflevector <{w} x {t}> {r}.i, <{w} x {t}> poison, <{w} x i32> zeroinitializer")
        elif k is L.VECTOR:
            t, prev = dt.llvm, "poison"
            for lane, x in enumerate(ins.src):
                name = r if lane == w - 1 else f"{r}.{lane}"
                self.emit(f"{name} = insertelement <{w} x {t}> {prev}, {t} {self.ref(x)}, i32 {lane}")
                prev = name
        elif k is L.ACC:
            self.allocas.append(f"%acc{ins.id} = alloca {self.ty(dt)}")
            init = self.splat(self.ref(Instr(L.CONST, dt, (), ins.arg, -1)), dt)
            self.emit(f"store {self.ty(dt)} {init}, ptr %acc{ins.id}")
        elif k is L.ACC_LOAD:
            self.emit(f"{r} = load {self.ty(dt)}, ptr %acc{ins.src[0].id}")
        elif k is L.ACC_STORE:
            acc, val = ins.src
            self.emit(f"store {self.ty(acc.dtype)} {self.ref(val)}, ptr %acc{acc.id}")
        elif k is L.ALU:
            self.alu(ins)
        else:
            raise NotImplementedError(f"{k} on {w} lanes")

    def ldmatrix(self, ins: Instr) -> None:
        """Tensor-core fragment load (codegen/strategies/tensor_core.py); targets with tensor cores print it."""
        raise NotImplementedError(f"{type(self).__name__} has no tensor-core fragment loads")

    def mma(self, ins: Instr) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no tensor-core instructions")

    def warpgroup(self, ins: Instr) -> None:
        """Warpgroup matrix instructions (codegen/strategies/wgmma.py); the NVPTX printer prints them."""
        raise NotImplementedError(f"{type(self).__name__} has no warpgroup matrix instructions")

    # ---- ALU --------------------------------------------------------------------------------
    def fmf(self, ins: Instr) -> str:
        # reductions may be reordered (vectorized); a*b+c may fuse into an FMA
        return "reassoc contract " if ins.reassoc else "contract "

    def alu(self, ins: Instr) -> None:
        op, r, dt = ins.arg, self.ref(ins), ins.dtype
        srcs = list(ins.src)
        if op is Ops.CAST:
            fr = srcs[0].dtype
            if fr.is_float and dt.is_float and fr.itemsize == dt.itemsize and fr != dt:
                # half <-> bfloat16 go through float32
                f32 = self.vt(dtypes.float32)
                self.emit(f"{r}.w = fpext {self.vt(fr)} {self.ref(srcs[0])} to {f32}")
                self.fptrunc(r, f"{r}.w", dt)
                return
            if fr.name == "float32" and dt.name in _HALF:
                self.fptrunc(r, self.ref(srcs[0]), dt)
                return
            self.emit(f"{r} = {self.cast(srcs[0], dt)}")
            return
        if op is Ops.BITCAST:
            self.emit(f"{r} = bitcast {self.ty(srcs[0].dtype)} {self.ref(srcs[0])} to {self.ty(dt)}")
            return
        if op is Ops.WHERE:
            c, a, b = srcs
            self.emit(f"{r} = select {self.vt(dtypes.bool)} {self.ref(c)}, {self.ty(dt)} {self.ref(a)}, "
                      f"{self.ty(dt)} {self.ref(b)}")
            return
        odt = srcs[0].dtype
        if odt.name in _HALF and op is Ops.NEG:     # exact on the 16-bit value (LLVM folds it through fpext)
            self.emit(f"{r} = fneg {self.vt(odt)} {self.ref(srcs[0])}")
            return
        if odt.name in _HALF and op is not Ops.NOT:
            # half and bfloat16 arithmetic is done in float32, rounded back once
            names = []
            f32 = self.vt(dtypes.float32)
            for i, s in enumerate(srcs):
                self.emit(f"{r}.x{i} = fpext {self.vt(odt)} {self.ref(s)} to {f32}")
                names.append(f"{r}.x{i}")
            res = self.alu_text(op, dtypes.float32, names, ins)
            if op in (Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE):
                self.emit(f"{r} = {res}")
            else:
                self.emit(f"{r}.f = {res}")
                self.fptrunc(r, f"{r}.f", odt)
            return
        self.emit(f"{r} = {self.alu_text(op, odt, [self.ref(s) for s in srcs], ins)}")

    def intrinsic(self, base: str, dt: DType, nargs: int) -> str:
        suffix = {"float": "f32", "double": "f64", "half": "f16", "bfloat": "bf16"}.get(dt.llvm, dt.llvm)
        if self.lanes > 1:
            suffix = f"v{self.lanes}{suffix}"
        name = f"llvm.{base}.{suffix}"
        self.declare(name, self.vt(dt), *([self.vt(dt)] * nargs))
        return name

    def unary_float(self, op: Ops, dt: DType, a: str) -> str:
        base = {Ops.EXP2: "exp2", Ops.LOG2: "log2", Ops.SQRT: "sqrt", Ops.SIN: "sin", Ops.TRUNC: "trunc"}[op]
        return f"call {self.vt(dt)} @{self.intrinsic(base, dt, 1)}({self.vt(dt)} {a})"

    def alu_text(self, op: Ops, dt: DType, a: list[str], ins: Instr) -> str:
        t = self.vt(dt)
        f = dt.is_float
        u = dt.is_unsigned or dt.is_bool
        nsw = "nsw " if ins.index_math else ""
        fm = self.fmf(ins)
        if op is Ops.ADD: return f"fadd {fm}{t} {a[0]}, {a[1]}" if f else f"add {nsw}{t} {a[0]}, {a[1]}"
        if op is Ops.SUB: return f"fsub {fm}{t} {a[0]}, {a[1]}" if f else f"sub {nsw}{t} {a[0]}, {a[1]}"
        if op is Ops.MUL: return f"fmul {fm}{t} {a[0]}, {a[1]}" if f else f"mul {nsw}{t} {a[0]}, {a[1]}"
        if op is Ops.FDIV: return f"fdiv {t} {a[0]}, {a[1]}"
        # all four divisions are plain: lowering (decompose.defined_division) made them trap-free, and
        # IDIV / MOD are left only where they equal truncation
        if op in (Ops.IDIV, Ops.CDIV): return f"{'udiv' if u else 'sdiv'} {t} {a[0]}, {a[1]}"
        if op in (Ops.MOD, Ops.CMOD): return f"{'urem' if u else 'srem'} {t} {a[0]}, {a[1]}"
        if op in (Ops.MAX, Ops.MIN):
            if f:
                # NaN-propagating like numpy.maximum / numpy.max
                name = self.intrinsic("maximum" if op is Ops.MAX else "minimum", dt, 2)
                return f"call {fm}{t} @{name}({t} {a[0]}, {t} {a[1]})"
            if dt.is_bool:
                return f"{'or' if op is Ops.MAX else 'and'} {t} {a[0]}, {a[1]}"
            base = ("u" if u else "s") + ("max" if op is Ops.MAX else "min")
            return f"call {t} @{self.intrinsic(base, dt, 2)}({t} {a[0]}, {t} {a[1]})"
        if op is Ops.CMPLT: return f"fcmp olt {t} {a[0]}, {a[1]}" if f else f"icmp {'ult' if u else 'slt'} {t} {a[0]}, {a[1]}"
        if op is Ops.CMPEQ: return f"fcmp oeq {t} {a[0]}, {a[1]}" if f else f"icmp eq {t} {a[0]}, {a[1]}"
        if op is Ops.CMPNE: return f"fcmp une {t} {a[0]}, {a[1]}" if f else f"icmp ne {t} {a[0]}, {a[1]}"
        if op is Ops.AND: return f"and {t} {a[0]}, {a[1]}"
        if op is Ops.OR: return f"or {t} {a[0]}, {a[1]}"
        if op is Ops.XOR: return f"xor {t} {a[0]}, {a[1]}"
        if op is Ops.SHL: return f"shl {t} {a[0]}, {a[1]}"
        if op is Ops.SHR: return f"{'lshr' if u else 'ashr'} {t} {a[0]}, {a[1]}"
        if op is Ops.NEG: return f"fneg {t} {a[0]}" if f else f"sub {t} {self.splat('0', dt)}, {a[0]}"
        if op is Ops.NOT: return f"xor {t} {a[0]}, {self.splat('true' if dt.is_bool else '-1', dt)}"
        if op is Ops.RECIP: return f"fdiv {t} {self.splat(llvm_float(1.0, dt), dt)}, {a[0]}"
        if op in (Ops.EXP2, Ops.LOG2, Ops.SQRT, Ops.SIN, Ops.TRUNC): return self.unary_float(op, dt, a[0])
        raise NotImplementedError(f"LLVM printer has no rule for {op}")

    def cast(self, src: Instr, to: DType) -> str:
        fr = src.dtype
        v = self.ref(src)
        ft, tt = self.vt(fr), self.vt(to)
        if fr.is_bool:
            if to.is_float:
                return f"uitofp {ft} {v} to {tt}"
            return f"zext {ft} {v} to {tt}"
        if to.is_bool:
            return (f"fcmp une {ft} {v}, {self.splat(llvm_float(0.0, fr), fr)}" if fr.is_float
                    else f"icmp ne {ft} {v}, {self.splat('0', fr)}")
        if fr.is_int and to.is_int:
            if fr.bits == to.bits:
                return f"bitcast {ft} {v} to {tt}"
            if fr.bits > to.bits:
                return f"trunc {ft} {v} to {tt}"
            return f"{'zext' if fr.is_unsigned else 'sext'} {ft} {v} to {tt}"
        if fr.is_int and to.is_float:
            return f"{'uitofp' if fr.is_unsigned else 'sitofp'} {ft} {v} to {tt}"
        if fr.is_float and to.is_int:
            return f"{'fptoui' if to.is_unsigned else 'fptosi'} {ft} {v} to {tt}"
        return f"{'fpext' if to.itemsize > fr.itemsize else 'fptrunc'} {ft} {v} to {tt}"
