"""MLIR text for a LinearKernel: the same lowered kernel the LLVM IR and C printers print, in the
upstream dialects. The CPU gets a `func.func` of `scf`/`arith`/`math`/`memref`; GPUs get a
`gpu.module` holding a `gpu.func` kernel (work-item ids, barriers, shuffles and shared memory from
the `gpu` dialect), which the compiler lowers with the NVVM or ROCDL conversions.

Buffers are `memref<2147483647xT>`: the kernel's index math is 32-bit, so that static shape covers
every element it can address, and a static shape lets the bare-pointer calling convention
(`use-bare-ptr-memref-call-conv`) give the function the runtime's ABI: one pointer per buffer, then
the i32 variables (then `start`, `end` for a thread-split CPU kernel). Printing needs no MLIR
installed; parsing and lowering it is the compiler's job.
"""
from __future__ import annotations

import math
import struct

from ..dtypes import DType, dtypes
from ..ir import Ops
from .linear import If, Instr, L, LinearKernel, Loop

# every element a 32-bit index reaches
MAX_ELEMENTS = 2**31 - 1
_HALF = ("float16", "bfloat16")
_LLVM_FLOATS = {"float": "f32", "double": "f64", "half": "f16", "bfloat": "bf16"}


def mlir_type(dt: DType) -> str:
    """The MLIR type of a value of dt: floats by width, integers signless (signedness is in the ops)."""
    # by the LLVM type: storage-only formats (float8, int4, ...) are their byte, as in the LLVM printer
    return _LLVM_FLOATS.get(dt.llvm, dt.llvm)


def mlir_mem_type(dt: DType) -> str:
    """The element type of a buffer of dt (a bool is a byte, as in the other printers)."""
    return "i8" if dt.is_bool else mlir_type(dt)


def mlir_float(value: float, dt: DType) -> str:
    """An exact float attribute: the bit pattern in hex (covers inf, NaN and -0.0)."""
    if dt.name == "float64":
        return "0x%016X" % struct.unpack("<Q", struct.pack("<d", value))[0]
    if dt.name == "float32":
        if math.isfinite(value) and abs(value) >= 3.5e38:
            value = math.copysign(math.inf, value)
        return "0x%08X" % struct.unpack("<I", struct.pack("<f", value))[0]
    if dt.name == "float16":
        return "0x%04X" % struct.unpack("<H", struct.pack("<e", value))[0]
    if dt.name == "bfloat16":
        if math.isnan(value):
            return "0x7FC0"
        bits = struct.unpack("<I", struct.pack("<f", value))[0]
        return "0x%04X" % (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF)   # round to nearest even
    raise TypeError(dt)


class MLIRPrinter:
    """Prints one kernel as a `func.func` (the CPU); override the hooks for a GPU target."""

    memory_space = ""            # of buffer memrefs, e.g. ", #gpu.address_space<global>"
    # the CPU: an index `outer + inner` is the sum of two 64-bit halves (see index), the outer one
    # loop-invariant, as in the llvm pair's IR, so that LLVM gives both pairs' loops one shape. With one
    # sign extension of the 32-bit sum, O3 for znver4 (which unrolls loops at run time) left
    # broadcast_add's row loop whole, while the llvm pair's got an unrolled body and a one-row
    # prologue at the 64-byte aligned `start`, whose stores only its streaming variant marked
    split_addresses = True

    def __init__(self, kernel: LinearKernel) -> None:
        self.k = kernel
        self.lines: list[str] = []
        self.depth = 1
        self.consts: dict[tuple[str, str], str] = {}   # (type, literal) -> SSA name, hoisted to the entry
        self.alias: dict[int, str] = {}                # instructions that print as another value
        self.decls: dict[str, str] = {}                # module-level declarations (llvm.func)
        self.acc: dict[int, str] = {}                  # accumulator id -> the SSA value it holds now
        self.defined_at: dict[int, int] = {}           # instruction id -> loop depth where it is printed
        self.loop_depth = 0

    # ---- target hooks ---------------------------------------------------------------------
    def memref(self, dt: DType, count: int = MAX_ELEMENTS, space: str | None = None) -> str:
        return f"memref<{count}x{mlir_mem_type(dt)}{self.memory_space if space is None else space}>"

    def arguments(self) -> list[tuple[str, str, str]]:
        """(name, type, attributes) of the function's arguments in the runtime's order."""
        args = [(f"%p{p.slot}", self.memref(p.dtype), " {llvm.noalias}") for p in self.k.params]
        args += [(f"%var_{n}", "i32", "") for n in self.k.var_names]
        if self.k.thread_split:
            args += [("%start", "i32", ""), ("%end", "i32", "")]
        return args

    def wrap(self, body: list[str]) -> list[str]:
        """The module around the function body (indented by one level)."""
        args = ", ".join(f"{n}: {t}{a}" for n, t, a in self.arguments())
        return ["module {", *self.decls.values(),
                f"  func.func @{self.k.symbol}({args}) {{", *body, "    return", "  }", "}"]

    def special(self, ins: Instr) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no work-item ids")

    def barrier(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no work-group barrier")

    def shuffle_xor(self, ins: Instr) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no warp shuffles")

    def local(self, ins: Instr) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no shared memory")

    def fence(self) -> None:
        self.emit("llvm.fence seq_cst")

    def unary_float(self, op: Ops, t: str, a: str, r: str) -> None:
        name = {Ops.EXP2: "exp2", Ops.LOG2: "log2", Ops.SQRT: "sqrt", Ops.SIN: "sin", Ops.TRUNC: "trunc"}[op]
        self.emit(f"{r} = math.{name} {a} : {t}")

    # ---- helpers ----------------------------------------------------------------------------
    def emit(self, line: str) -> None:
        self.lines.append("  " * (self.depth + 1) + line)

    def const(self, value, dt: DType | None) -> str:
        """An SSA constant (hoisted to the entry); dt None: an `index`."""
        if dt is None:
            t, lit = "index", str(int(value))
            return self.consts.setdefault((t, lit), f"%c{len(self.consts)}")
        t = mlir_type(dt)
        if dt.is_bool:
            lit = "true" if value else "false"
        elif dt.is_float:
            lit = mlir_float(float(value), dt)
        else:
            v, bits = int(value), int(t[1:])
            if v >= 1 << (bits - 1):
                v -= 1 << bits           # signless: print the two's complement value signed
            lit = str(v)
        key = (t, lit)
        name = self.consts.get(key)
        if name is None:
            name = self.consts[key] = f"%c{len(self.consts)}"
        return name

    def ref(self, ins: Instr) -> str:
        k = ins.kind
        if k is L.CONST:
            return self.const(ins.arg, ins.dtype)
        if k is L.PARAM:
            return f"%p{ins.arg}"
        if k is L.VAR:
            return f"%var_{ins.arg}"
        if k is L.THREAD_RANGE:
            return f"%{ins.arg}"
        if k is L.LOCAL:
            return f"%smem{ins.id}"
        return self.alias.get(ins.id, f"%v{ins.id}")

    def index(self, ins: Instr, tag: str) -> str:
        """The i32 index as an `index` value (sign-extended, as the LLVM printers' GEPs do); with
        split_addresses, an nsw sum of a value defined outside the current loop and one defined in it
        is the sum of its sign-extended halves, as the CPU LLVM printer's two GEPs (address)."""
        name = f"%{tag}.i"
        if self.split_addresses and ins.kind is L.ALU and ins.arg is Ops.ADD and ins.index_math:
            a, b = ins.src
            da, db = self.defined_at.get(a.id, 0), self.defined_at.get(b.id, 0)
            if da != db:
                outer, inner = (a, b) if da < db else (b, a)
                self.emit(f"{name}o = arith.index_cast {self.ref(outer)} : i32 to index")
                self.emit(f"{name}i = arith.index_cast {self.ref(inner)} : i32 to index")
                self.emit(f"{name} = arith.addi {name}o, {name}i overflow<nsw> : index")
                return name
        self.emit(f"{name} = arith.index_cast {self.ref(ins)} : i32 to index")
        return name

    def buffer_type(self, buf: Instr) -> str:
        if buf.kind is L.LOCAL:
            return self.local_type(buf)
        return self.memref(buf.dtype)

    def local_type(self, buf: Instr) -> str:
        return self.memref(buf.dtype, buf.arg, ", #gpu.address_space<workgroup>")

    # ---- program ----------------------------------------------------------------------------
    def render(self) -> str:
        self.items(self.k.body)
        # `true`/`false` carry their type (i1); other literals are typed
        body = [f"    {n} = arith.constant {lit}{'' if t == 'i1' else f' : {t}'}" for (t, lit), n in self.consts.items()]
        body += self.lines
        return "\n".join(self.wrap(body)) + "\n"

    def items(self, items) -> None:
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

    def carried(self, body) -> list[Instr]:
        """Accumulators that `body` updates and that live on after it (defined before it): the
        values a loop carries (iter_args) or an if yields. An accumulator is an SSA value here, not
        memory: every load is the value of its last store."""
        stored: dict[int, Instr] = {}
        defined: set[int] = set()

        def go(items):
            for it in items:
                if isinstance(it, Loop):
                    go(it.body)
                elif isinstance(it, If):
                    go(it.body)
                elif it.kind is L.ACC:
                    defined.add(it.id)
                elif it.kind is L.ACC_STORE:
                    stored.setdefault(it.src[0].id, it.src[0])
        go(body)
        return [a for i, a in stored.items() if i not in defined and i in self.acc]

    def results(self, name: str, accs: list[Instr]) -> None:
        """After a loop or if named `name`: each carried accumulator holds its result."""
        for i, a in enumerate(accs):
            self.acc[a.id] = name if len(accs) == 1 else f"{name}#{i}"

    def forget_inner(self, body) -> None:
        """Accumulators defined inside a region are out of scope after it."""
        inner = [it for it in self.k_walk(body) if it.kind is L.ACC]
        for a in inner:
            self.acc.pop(a.id, None)

    @staticmethod
    def k_walk(items):
        for it in items:
            if isinstance(it, (Loop, If)):
                yield from MLIRPrinter.k_walk(it.body)
            else:
                yield it

    def loop(self, lp: Loop) -> None:
        step = self.ref(lp.step) if lp.step is not None else self.const(1, dtypes.int32)
        head = f"scf.for {self.ref(lp.var)} = {self.ref(lp.start)} to {self.ref(lp.end)} step {step}"
        accs = self.carried(lp.body)
        name = f"%l{lp.var.id}"
        if accs:
            init = ", ".join(f"{name}.a{i} = {self.acc[a.id]}" for i, a in enumerate(accs))
            types = ", ".join(mlir_type(a.dtype) for a in accs)
            self.emit(f"{name}{'' if len(accs) == 1 else f':{len(accs)}'} = {head} iter_args({init}) "
                      f"-> ({types}) : i32 {{")
            for i, a in enumerate(accs):
                self.acc[a.id] = f"{name}.a{i}"
        else:
            self.emit(f"{head} : i32 {{")
        self.depth += 1
        self.items(lp.body)
        if accs:
            self.emit(f"scf.yield {', '.join(self.acc[a.id] for a in accs)} : "
                      f"{', '.join(mlir_type(a.dtype) for a in accs)}")
        self.depth -= 1
        self.forget_inner(lp.body)
        self.results(name, accs)
        # the LLVM printer's loop hints, carried to the back edge by scf-to-cf: a loop carrying many
        # accumulators is a register tile, vectorized across its lanes (SLP), not along the loop
        if sum(1 for it in lp.body if isinstance(it, Instr) and it.kind is L.ACC_STORE) >= 4:
            self.emit("} {loop_annotation = #llvm.loop_annotation<vectorize = <disable = true>>}")
        elif lp.unroll > 1:
            self.emit(f"}} {{loop_annotation = #llvm.loop_annotation<unroll = <count = {lp.unroll}>>}}")
        else:
            self.emit("}")

    def branch(self, br: If) -> None:
        accs = self.carried(br.body)
        if not accs:
            self.emit(f"scf.if {self.ref(br.cond)} {{")
            self.depth += 1
            self.items(br.body)
            self.depth -= 1
            self.forget_inner(br.body)
            self.emit("}")
            return
        name = f"%i{br.cond.id}_{len(self.lines)}"
        before = [self.acc[a.id] for a in accs]
        types = ", ".join(mlir_type(a.dtype) for a in accs)
        self.emit(f"{name}{'' if len(accs) == 1 else f':{len(accs)}'} = scf.if {self.ref(br.cond)} -> ({types}) {{")
        self.depth += 1
        self.items(br.body)
        self.emit(f"scf.yield {', '.join(self.acc[a.id] for a in accs)} : {types}")
        self.depth -= 1
        self.emit("} else {")
        self.depth += 1
        self.emit(f"scf.yield {', '.join(before)} : {types}")
        self.depth -= 1
        self.emit("}")
        self.forget_inner(br.body)
        self.results(name, accs)

    def instr(self, ins: Instr) -> None:
        k = ins.kind
        if k in (L.CONST, L.PARAM, L.VAR, L.THREAD_RANGE, L.LOOPVAR):
            return
        r = self.ref(ins)
        if k is L.SPECIAL:
            self.special(ins)
        elif k is L.LOCAL:
            self.local(ins)
        elif k is L.BARRIER:
            self.barrier()
        elif k is L.LOAD:
            buf, idx = ins.src
            mt, bt = mlir_mem_type(ins.dtype), self.buffer_type(buf)
            i = self.index(idx, r[1:])
            if ins.arg:
                w = ins.arg
                self.emit(f"{r} = vector.load {self.ref(buf)}[{i}] {{alignment = {w * ins.dtype.itemsize} : i64}} : "
                          f"{bt}, vector<{w}x{mt}>")
            elif ins.dtype.is_bool:
                self.emit(f"{r}.m = memref.load {self.ref(buf)}[{i}] : {bt}")
                self.emit(f"{r} = arith.cmpi ne, {r}.m, {self.const(0, dtypes.int8)} : i8")
            else:
                self.emit(f"{r} = memref.load {self.ref(buf)}[{i}] : {bt}")
        elif k is L.STORE:
            buf, idx, val = ins.src
            bt, tag = self.buffer_type(buf), f"s{ins.id}"
            i = self.index(idx, tag)
            v = self.ref(val)
            if ins.arg:
                self.emit(f"vector.store {v}, {self.ref(buf)}[{i}] {{alignment = {ins.arg * val.dtype.itemsize} : i64}}"
                          f" : {bt}, vector<{ins.arg}x{mlir_mem_type(val.dtype)}>")
                return
            if val.dtype.is_bool:
                self.emit(f"%{tag}.m = arith.extui {v} : i1 to i8")
                v = f"%{tag}.m"
            self.emit(f"memref.store {v}, {self.ref(buf)}[{i}] : {bt}")
        elif k is L.VECTOR:
            t = mlir_mem_type(ins.dtype)
            self.emit(f"{r} = vector.from_elements {', '.join(self.ref(x) for x in ins.src)} : "
                      f"vector<{len(ins.src)}x{t}>")
        elif k is L.EXTRACT:
            (vec,) = ins.src
            mt = mlir_mem_type(ins.dtype)
            if ins.dtype.is_bool:
                self.emit(f"{r}.m = vector.extract {self.ref(vec)}[{ins.arg}] : i8 from vector<{vec.arg}xi8>")
                self.emit(f"{r} = arith.cmpi ne, {r}.m, {self.const(0, dtypes.int8)} : i8")
            else:
                self.emit(f"{r} = vector.extract {self.ref(vec)}[{ins.arg}] : {mt} from vector<{vec.arg}x{mt}>")
        elif k is L.ATOMIC_ADD:
            buf, idx, val = ins.src
            t = mlir_type(ins.dtype)
            i = self.index(idx, r[1:])
            kind = "addf" if ins.dtype.is_float else "addi"
            self.emit(f"{r} = memref.atomic_rmw {kind} {self.ref(val)}, {self.ref(buf)}[{i}] : "
                      f"({t}, {self.buffer_type(buf)}) -> {t}")
        elif k is L.FENCE:
            self.fence()
        elif k is L.SHUFFLE_XOR:
            self.shuffle_xor(ins)
        elif k is L.ACC:
            self.acc[ins.id] = self.const(ins.arg, ins.dtype)
        elif k is L.ACC_LOAD:
            (acc,) = ins.src
            if acc.id not in self.acc:
                raise NotImplementedError(f"accumulator %{acc.id} read outside the region that defines it")
            self.alias[ins.id] = self.acc[acc.id]
        elif k is L.ACC_STORE:
            acc, val = ins.src
            self.acc[acc.id] = self.ref(val)
        elif k is L.ALU:
            self.alu(ins)
        else:
            raise NotImplementedError(k)

    # ---- ALU --------------------------------------------------------------------------------
    def fmf(self, ins: Instr) -> str:
        # reductions may be reordered (vectorized); a*b+c may fuse into an FMA
        return " fastmath<reassoc,contract>" if ins.reassoc else " fastmath<contract>"

    def alu(self, ins: Instr) -> None:
        op, r, dt = ins.arg, self.ref(ins), ins.dtype
        srcs = list(ins.src)
        if op is Ops.CAST:
            fr = srcs[0].dtype
            if fr.is_float and dt.is_float and fr.itemsize == dt.itemsize and fr != dt:
                # half <-> bfloat16 go through float32
                self.emit(f"{r}.w = arith.extf {self.ref(srcs[0])} : {mlir_type(fr)} to f32")
                self.emit(f"{r} = arith.truncf {r}.w : f32 to {mlir_type(dt)}")
            else:
                self.cast(srcs[0], dt, r)
            return
        if op is Ops.BITCAST:
            self.emit(f"{r} = arith.bitcast {self.ref(srcs[0])} : {mlir_type(srcs[0].dtype)} to {mlir_type(dt)}")
            return
        if op is Ops.WHERE:
            c, a, b = srcs
            self.emit(f"{r} = arith.select {self.ref(c)}, {self.ref(a)}, {self.ref(b)} : {mlir_type(dt)}")
            return
        odt = srcs[0].dtype
        if odt.name in _HALF and op is not Ops.NOT:
            # half and bfloat16 arithmetic is done in float32, rounded back once
            names = []
            for i, s in enumerate(srcs):
                self.emit(f"{r}.x{i} = arith.extf {self.ref(s)} : {mlir_type(odt)} to f32")
                names.append(f"{r}.x{i}")
            if op in (Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE):
                self.alu_op(op, dtypes.float32, names, ins, r)
            else:
                self.alu_op(op, dtypes.float32, names, ins, f"{r}.f")
                self.emit(f"{r} = arith.truncf {r}.f : f32 to {mlir_type(odt)}")
            return
        self.alu_op(op, odt, [self.ref(s) for s in srcs], ins, r)

    def alu_op(self, op: Ops, dt: DType, a: list[str], ins: Instr, r: str) -> None:
        t = mlir_type(dt)
        f = dt.is_float
        u = dt.is_unsigned or dt.is_bool
        fm = self.fmf(ins)
        nsw = " overflow<nsw>" if ins.index_math else ""
        e = self.emit
        if op in (Ops.ADD, Ops.SUB, Ops.MUL):
            base = {Ops.ADD: "add", Ops.SUB: "sub", Ops.MUL: "mul"}[op]
            e(f"{r} = arith.{base}f {a[0]}, {a[1]}{fm} : {t}" if f else f"{r} = arith.{base}i {a[0]}, {a[1]}{nsw} : {t}")
        elif op is Ops.FDIV:
            e(f"{r} = arith.divf {a[0]}, {a[1]} : {t}")
        elif op in (Ops.IDIV, Ops.CDIV):    # trap-free and truncating after decompose.defined_division
            e(f"{r} = arith.{'divui' if u else 'divsi'} {a[0]}, {a[1]} : {t}")
        elif op in (Ops.MOD, Ops.CMOD):
            e(f"{r} = arith.{'remui' if u else 'remsi'} {a[0]}, {a[1]} : {t}")
        elif op in (Ops.MAX, Ops.MIN):
            big = op is Ops.MAX
            if f:   # NaN-propagating like numpy.maximum / numpy.max
                e(f"{r} = arith.{'maximumf' if big else 'minimumf'} {a[0]}, {a[1]}{fm} : {t}")
            elif dt.is_bool:
                e(f"{r} = arith.{'ori' if big else 'andi'} {a[0]}, {a[1]} : {t}")
            else:
                e(f"{r} = arith.{'max' if big else 'min'}{'u' if u else 's'}i {a[0]}, {a[1]} : {t}")
        elif op in (Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE):
            if f:
                pred = {Ops.CMPLT: "olt", Ops.CMPEQ: "oeq", Ops.CMPNE: "une"}[op]
                e(f"{r} = arith.cmpf {pred}, {a[0]}, {a[1]} : {t}")
            else:
                pred = {Ops.CMPLT: "ult" if u else "slt", Ops.CMPEQ: "eq", Ops.CMPNE: "ne"}[op]
                e(f"{r} = arith.cmpi {pred}, {a[0]}, {a[1]} : {t}")
        elif op in (Ops.AND, Ops.OR, Ops.XOR):
            e(f"{r} = arith.{ {Ops.AND: 'andi', Ops.OR: 'ori', Ops.XOR: 'xori'}[op]} {a[0]}, {a[1]} : {t}")
        elif op is Ops.SHL:
            e(f"{r} = arith.shli {a[0]}, {a[1]} : {t}")
        elif op is Ops.SHR:
            e(f"{r} = arith.{'shrui' if u else 'shrsi'} {a[0]}, {a[1]} : {t}")
        elif op is Ops.NEG:
            e(f"{r} = arith.negf {a[0]} : {t}" if f else f"{r} = arith.subi {self.const(0, dt)}, {a[0]} : {t}")
        elif op is Ops.NOT:
            e(f"{r} = arith.xori {a[0]}, {self.const(True if dt.is_bool else -1, dt)} : {t}")
        elif op is Ops.RECIP:
            e(f"{r} = arith.divf {self.const(1.0, dt)}, {a[0]} : {t}")
        elif op in (Ops.EXP2, Ops.LOG2, Ops.SQRT, Ops.SIN, Ops.TRUNC):
            self.unary_float(op, t, a[0], r)
        else:
            raise NotImplementedError(f"MLIR printer has no rule for {op}")

    def cast(self, src: Instr, to: DType, r: str) -> None:
        fr = src.dtype
        v, ft, tt = self.ref(src), mlir_type(fr), mlir_type(to)
        e = self.emit
        if fr.is_bool:
            e(f"{r} = arith.uitofp {v} : i1 to {tt}" if to.is_float else f"{r} = arith.extui {v} : i1 to {tt}")
        elif to.is_bool:
            if fr.is_float:
                e(f"{r} = arith.cmpf une, {v}, {self.const(0.0, fr)} : {ft}")
            else:
                e(f"{r} = arith.cmpi ne, {v}, {self.const(0, fr)} : {ft}")
        elif fr.is_int and to.is_int:
            # by the registers' widths: a storage-only int4 lives in an i8
            if ft == tt:
                self.alias[ins_id(r)] = v        # signless: the same value
            elif int(ft[1:]) > int(tt[1:]):
                e(f"{r} = arith.trunci {v} : {ft} to {tt}")
            else:
                e(f"{r} = arith.{'extui' if fr.is_unsigned else 'extsi'} {v} : {ft} to {tt}")
        elif fr.is_int and to.is_float:
            e(f"{r} = arith.{'uitofp' if fr.is_unsigned else 'sitofp'} {v} : {ft} to {tt}")
        elif fr.is_float and to.is_int:
            e(f"{r} = arith.{'fptoui' if to.is_unsigned else 'fptosi'} {v} : {ft} to {tt}")
        elif to.itemsize > fr.itemsize:
            e(f"{r} = arith.extf {v} : {ft} to {tt}")
        elif to.itemsize < fr.itemsize:
            e(f"{r} = arith.truncf {v} : {ft} to {tt}")
        else:
            self.alias[ins_id(r)] = v


def ins_id(name: str) -> int:
    """The instruction id of an SSA name `%v<id>`."""
    return int(name[2:])


# ---- GPUs ------------------------------------------------------------------------------------

class MLIRGPUPrinter(MLIRPrinter):
    """A `gpu.module` with one `gpu.func` kernel: buffers in the global address space, shared arrays
    as workgroup attributions, ids from `gpu.block_id` and
    `gpu.thread_id`. Subclasses give the module's target attribute and the target's math."""

    memory_space = ", #gpu.address_space<global>"
    split_addresses = False         # as the GPU LLVM printers: one index per access
    target = ""                     # e.g. '#nvvm.target<chip = "sm_90">'

    def __init__(self, kernel: LinearKernel) -> None:
        super().__init__(kernel)
        self.workgroup: list[str] = []
        self.module_ops: list[str] = []     # ops beside the kernel in the gpu.module

    def arguments(self) -> list[tuple[str, str, str]]:
        args = [(f"%p{p.slot}", self.memref(p.dtype), " {llvm.noalias}") for p in self.k.params]
        return args + [(f"%var_{n}", "i32", "") for n in self.k.var_names]

    def kernel_attributes(self) -> str:
        x, y, z = (max(1, d) for d in self.k.local_size)
        return f"known_block_size = array<i32: {x}, {y}, {z}>"

    def wrap(self, body: list[str]) -> list[str]:
        args = ", ".join(f"{n}: {t}{a}" for n, t, a in self.arguments())
        attribs = ""
        if self.workgroup:
            attribs += f" workgroup({', '.join(self.workgroup)})"
        target = f" [{self.target}]" if self.target else ""
        return ["module attributes {gpu.container_module} {",
                f"  gpu.module @morok{target} {{", *["    " + d for d in self.decls.values()],
                *["    " + op for op in self.module_ops],
                f"    gpu.func @{self.k.symbol}({args}){attribs} kernel attributes {{{self.kernel_attributes()}}} {{",
                *["    " + line for line in body], "      gpu.return", "    }", "  }", "}"]

    def special(self, ins: Instr) -> None:
        kind, dim = ins.arg
        op = {"group_id": "gpu.block_id", "local_id": "gpu.thread_id"}[kind]
        r = self.ref(ins)
        self.emit(f"{r}.x = {op} {'xyz'[dim]}")
        self.emit(f"{r} = arith.index_cast {r}.x : index to i32")

    def barrier(self) -> None:
        self.emit("gpu.barrier")

    def local(self, ins: Instr) -> None:
        self.workgroup.append(f"%smem{ins.id} : {self.local_type(ins)}")

    def shuffle_xor(self, ins: Instr) -> None:
        value, _lid = ins.src
        mask, width = ins.arg
        r, t = self.ref(ins), mlir_type(ins.dtype)
        m, w = self.const(mask, dtypes.int32), self.const(width, dtypes.int32)
        self.emit(f"{r}, {r}.ok = gpu.shuffle xor {self.ref(value)}, {m}, {w} : {t}")

    sync_scope = ""                 # of fences: the target's device scope (system if empty)

    def fence(self) -> None:
        scope = f' syncscope("{self.sync_scope}")' if self.sync_scope else ""
        self.emit(f"llvm.fence{scope} seq_cst")

    def call_helper(self, name: str, t: str, a: str, r: str) -> None:
        """A call of an LLVM IR helper the compiler links in after translation (declared here)."""
        self.decls[name] = f"llvm.func @{name}({t}) -> {t}"
        self.emit(f"{r} = llvm.call @{name}({a}) : ({t}) -> {t}")

    def unary_float(self, op: Ops, t: str, a: str, r: str) -> None:
        # LLVM's intrinsics by name, as the LLVM IR printers call them: the GPU conversions would
        # turn math ops and llvm.intr ops into libdevice/ocml calls, which need those linked in
        name = {Ops.EXP2: "exp2", Ops.LOG2: "log2", Ops.SQRT: "sqrt", Ops.SIN: "sin", Ops.TRUNC: "trunc"}[op]
        self.emit(f'{r} = llvm.call_intrinsic "llvm.{name}.{t}"({a}) : ({t}) -> {t}')

    def f64_helper(self, op: Ops, a: str, r: str) -> None:
        """Double sin/exp2/log2 as the LLVM printers' IR helpers (GPUs have no libm for them)."""
        from .llvm_math import F64_HELPERS
        self.call_helper(F64_HELPERS[op][0], "f64", a, r)


def link_llvm_helpers(llvm_ir: str, triple: str) -> str:
    """Translated LLVM IR made whole for the llvmlite back halves: the target triple set, and the
    double-precision helpers the kernel declares (`__morok_*_f64`) defined, with what they call."""
    from .llvm_math import F64_HELPER_DECLS, F64_HELPERS
    lines = llvm_ir.split("\n")
    helpers = {name: build for name, build in F64_HELPERS.values()}
    used = [n for n in helpers if any(ln.startswith("declare") and f"@{n}(" in ln for ln in lines)]
    lines = [ln for ln in lines if not (ln.startswith("declare") and any(f"@{n}(" in ln for n in used))]
    if not any(ln.startswith("target triple") for ln in lines):
        lines.insert(0, f'target triple = "{triple}"')
    text = "\n".join(lines)
    if used:
        text += "\n" + "\n".join(d for n, d in F64_HELPER_DECLS.items() if f"@{n}(" not in text)
        text += "\n" + "\n".join(helpers[n]() for n in used) + "\n"
    return text
