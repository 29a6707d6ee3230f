"""The two CUDA renderers: CUDA C (for NVRTC) and LLVM IR for the NVPTX target (for llvmlite).

Both print the same lowered kernel. CUDA C keeps half and bfloat16 as 16-bit patterns converted with
`cvt` (NVRTC ships no cuda_fp16.h without a toolkit, and the kernel needs nothing else from it).
NVPTX has no instruction for sin or log2 that LLVM selects without a libm (and LLVM aborts the
process on an unselectable op), so those go through nvvm intrinsics or small IR helpers.
"""
from __future__ import annotations

import math
from dataclasses import replace

from morok_py.codegen.c_like import GPU_BF16_HELPERS, GPUCPrinter
from morok_py.codegen.linear import Instr, L, LinearKernel
from morok_py.codegen.llvm_ir import LLVMIRPrinter
from morok_py.codegen.lower import Capabilities
from morok_py.codegen.wgmma_ptx import desc_high, mbar_text, wg_sync_text, wgmma_text
from morok_py.device import DeviceSpec, Renderer
from morok_py.dtypes import DType
from morok_py.ir import Ops

# what every NVIDIA GPU since Kepler offers; lowering picks 256-thread blocks for 1-D launches and
# gives row kernels (softmax, row reductions) one block per row, combining in shared memory
# contractions: 128x128 output tiles, k in steps of 8, 8x8 outputs per thread (256 threads, <= 128
# registers each, so two blocks share an SM)
MATMUL_TILE = (128, 128, 8, 8, 8)
CUDA_CAPS = Capabilities(has_local=True, has_shared=True, max_dims=3, local_max=(1024, 1024, 64),
                         max_threads_per_group=1024, default_group=256, grid_max=(2**31 - 1, 65535, 65535),
                         warp_size=32, group_reduce=True, grid_reduce=True, vector_width=4, warp_shuffle=True,
                         matmul_tile=MATMUL_TILE)


def cuda_caps(arch: str) -> Capabilities:
    """CUDA_CAPS plus the tensor cores of `arch` ('sm_80' and later: mma.sync m16n8k16 for float16 and
    bfloat16, see codegen/strategies/tensor_core.py; 'sm_90a' also wgmma, strategies/wgmma.py); an unknown
    arch gets none."""
    from dataclasses import replace
    from morok_py.codegen.strategies.tensor_core import MMA_M16N8K16, WGMMA
    digits = "".join(ch for ch in arch.removeprefix("sm_") if ch.isdigit())
    if arch == "sm_90a":
        # the arch-specific sm_90 features: warpgroup MMA (wgmma.mma_async) besides mma.sync
        return replace(CUDA_CAPS, tensor_cores=(MMA_M16N8K16, WGMMA), async_copy=True)
    if digits and int(digits) >= 80:
        return replace(CUDA_CAPS, tensor_cores=(MMA_M16N8K16,), async_copy=True)
    return CUDA_CAPS


# ---- shared memory past the static limit -------------------------------------------------------

STATIC_SMEM = 48 << 10          # a group's static shared memory; more only as dynamic shared memory
DYN_SMEM_SYMBOL = "morok_dyn_smem"   # a 4-byte global in the module: the dynamic shared bytes a launch passes
                                     # (runtime.py reads it at load and opts the function in)


WGMMA_ALIGN = 1024              # wgmma's 128-byte swizzle repeats every 1024 bytes: its tiles start on one


def shared_align(kernel: LinearKernel) -> int:
    """The alignment of each shared array: 1024 bytes in a kernel with warpgroup matrix instructions (their
    descriptors assume 1024-byte-aligned swizzle atoms), else 16."""
    return WGMMA_ALIGN if any(ins.kind is L.WGMMA for ins in kernel.walk()) else 16


def shared_layout(kernel: LinearKernel) -> tuple[dict[int, int], int]:
    """({LOCAL id: byte offset}, total bytes) when the kernel's shared arrays exceed the static limit or it
    has warpgroup matrix instructions (the arrays are then carved out of one dynamic array, each aligned to
    `shared_align`); ({}, 0) otherwise."""
    offs, total = {}, 0
    align = shared_align(kernel)
    for ins in kernel.walk():
        if ins.kind is L.LOCAL and ins.id not in offs:
            offs[ins.id] = total
            total += -(-ins.arg * ins.dtype.itemsize // align) * align
    return (offs, total) if total > STATIC_SMEM or align > 16 else ({}, 0)


# ---- CUDA C ----------------------------------------------------------------------------------

_CUDA_HALF_HELPERS = {
    "float16": [
        "typedef unsigned short morok_half;  /* IEEE float16 bits */",
        "__device__ __forceinline__ float morok_h2f(morok_half h) "
        "{ float f; asm(\"cvt.f32.f16 %0, %1;\" : \"=f\"(f) : \"h\"(h)); return f; }",
        "__device__ __forceinline__ morok_half morok_f2h(float f) "
        "{ morok_half h; asm(\"cvt.rn.f16.f32 %0, %1;\" : \"=h\"(h) : \"f\"(f)); return h; }",
    ],
    "bfloat16": GPU_BF16_HELPERS,
}


class CUDACPrinter(GPUCPrinter):
    """CUDA C: `extern "C" __global__`, `__launch_bounds__`, `__restrict__`, blockIdx/threadIdx; tensor
    cores as inline PTX (ldmatrix, mma.sync)."""

    half_helpers = _CUDA_HALF_HELPERS

    def render(self) -> str:
        self.dyn, self.dyn_bytes = shared_layout(self.k)
        text = super().render()
        if self.dyn:
            text = text.replace(self.signature() + " {",
                                f'extern "C" __device__ unsigned {DYN_SMEM_SYMBOL} = {self.dyn_bytes}u;\n'
                                + self.signature() + " {", 1)
        return text

    def shared_decl(self, ins: Instr) -> str:
        t = self.mem_type(ins.dtype)
        if self.dyn:
            # one dynamic array (the launch passes its size), carved 16-byte aligned
            head = (f"extern __shared__ __align__({shared_align(self.k)}) unsigned char morok_dyn[]; "
                    if self.dyn[ins.id] == 0 else "")
            decl = f"{head}{t}* smem{ins.id} = ({t}*)(morok_dyn + {self.dyn[ins.id]});"
        else:
            decl = super().shared_decl(ins)
        # the array's 32-bit shared-window address, for ldmatrix and cp.async
        return (decl + f' unsigned smem{ins.id}_sa; asm("{{ .reg .u64 t; cvta.to.shared.u64 t, %1; '
                f'cvt.u32.u64 %0, t; }}" : "=r"(smem{ins.id}_sa) : "l"(smem{ins.id}));')

    def shared_addr(self, buf: Instr, idx: Instr) -> str:
        return f"({self.ref(buf)}_sa + {self.ref(idx)} * {buf.dtype.itemsize}u)"

    def instr(self, ins: Instr) -> None:
        k = ins.kind
        if k is L.CP_ASYNC:
            local, sidx, buf, gidx = ins.src
            # .cg (L2 only) takes 16-byte copies; 4 and 8 bytes go through .ca
            level = "cg" if ins.arg == 16 else "ca"
            self.emit(f'asm volatile("{{ .reg .u64 g; cvta.to.global.u64 g, %1; cp.async.{level}.shared.global [%0], [g], '
                      f'{ins.arg}; }}" :: "r"({self.shared_addr(local, sidx)}), "l"({self.ref(buf)} + {self.ref(gidx)}) '
                      f': "memory");')
        elif k is L.CP_COMMIT:
            self.emit('asm volatile("cp.async.commit_group;" ::: "memory");')
        elif k is L.CP_WAIT:
            self.emit(f'asm volatile("cp.async.wait_group {int(ins.arg)};" ::: "memory");')
        else:
            super().instr(ins)

    def ldmatrix(self, ins: Instr) -> None:
        (buf, idx), (count, trans) = ins.src, ins.arg
        r = self.ref(ins)
        regs = [f"{r}_{n}" for n in range(count)]
        self.emit(f"unsigned {', '.join(regs)};")
        outs = ", ".join(f'"=r"({x})' for x in regs)
        dst = ", ".join(f"%{n}" for n in range(count))
        self.emit(f'asm volatile("ldmatrix.sync.aligned.m8n8.x{count}{".trans" if trans else ""}.shared.b16 '
                  f'{{{dst}}}, [%{count}];" : {outs} : "r"({self.shared_addr(buf, idx)}) : "memory");')

    def mma(self, ins: Instr) -> None:
        a, b, *accs = ins.src
        shape, pair = ins.arg
        ab = "f16" if a.dtype.name == "float16" else "bf16"
        ra, rb = self.ref(a), self.ref(b)
        outs = ", ".join(f'"+f"(acc{c.id})' for c in accs)
        ins_ = ", ".join([f'"r"({ra}_{n})' for n in range(4)] + [f'"r"({rb}_{2 * pair + n})' for n in range(2)])
        self.emit(f'asm("mma.sync.aligned.{shape}.row.col.f32.{ab}.{ab}.f32 {{%0, %1, %2, %3}}, '
                  f'{{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};" : {outs} : {ins_});')

    def warpgroup(self, ins: Instr) -> None:
        k, r = ins.kind, self.ref(ins)
        if k is L.SMEM_DESC:
            (buf, idx), (lbo, sbo) = ins.src, ins.arg
            self.emit(f"const unsigned long long {r} = (unsigned long long)(({self.shared_addr(buf, idx)} & 0x3FFFFu) "
                      f">> 4) | {desc_high(lbo, sbo)}ull;")
        elif k is L.MBAR:
            (op, count), (buf, idx, *par) = ins.arg, ins.src
            extra = f', "r"({count})' if op == "init" else f', "r"({self.ref(par[0])})' if op == "wait" else ""
            self.emit(f'asm volatile("{mbar_text(op)}" :: "r"({self.shared_addr(buf, idx)}){extra} : "memory");')
        elif k is L.WG_SYNC:
            # the accumulators (if any) as read-write operands: the compiler keeps them in place across it
            outs = ", ".join(f'"+f"(acc{c.id})' for c in ins.src)
            self.emit(f'asm volatile("{wg_sync_text(ins.arg)}" : {outs} :: "memory");')
        else:
            da, db, *accs = ins.src
            n, ab, ta, tb = ins.arg
            outs = ", ".join(f'"+f"(acc{c.id})' for c in accs)
            text = wgmma_text(n, ab, ta, tb)
            self.emit(f'asm volatile("{text}" : {outs} : "l"({self.ref(da)}), "l"({self.ref(db)}), "r"(1) : "memory");')

    def kernel_decl(self) -> str:
        decl = super().kernel_decl()
        if self.k.min_groups > 0:
            # __launch_bounds__(threads, min blocks per SM): ptxas keeps registers within 64K / (threads *
            # blocks). CUDA's meaning only: HIP's second argument counts waves per EU.
            decl = decl[:-1] + f", {self.k.min_groups})"
        return decl


class CUDARenderer(Renderer):
    """CUDA C for NVRTC."""

    caps = CUDA_CAPS

    def __init__(self, device: DeviceSpec, arch: str = "") -> None:
        super().__init__(device)
        self.arch = arch
        self.caps = cuda_caps(arch)

    def render_kernel(self, kernel: LinearKernel) -> str:
        return CUDACPrinter(kernel).render()


# ---- NVPTX LLVM IR ---------------------------------------------------------------------------

NVPTX_TRIPLE = "nvptx64-nvidia-cuda"
# LLVM 22's layout for nvptx64 (the compiler re-sets it from its target machine)
NVPTX_DATALAYOUT = "e-p6:32:32-i64:64-i128:128-i256:256-v16:16-v32:32-n16:32:64"



class NVPTXPrinter(LLVMIRPrinter):
    """LLVM IR for nvptx64: `ptx_kernel` entry, global-address-space buffers, nvvm special registers."""

    ptr = "ptr addrspace(1)"
    triple = NVPTX_TRIPLE
    datalayout = NVPTX_DATALAYOUT
    param_attrs = "noalias"

    def signature(self) -> str:
        args = [f"{self.ptr} {self.param_attrs} %p{p.slot}" for p in self.k.params]
        args += [f"i32 %var_{n}" for n in self.k.var_names]
        return f"define ptx_kernel void @{self.k.symbol}({', '.join(args)}) #0"

    def attributes(self) -> str:
        threads = max(1, math.prod(self.k.local_size))
        # nvvm.minctasm: PTX .minnctapersm, the occupancy hint ptxas sizes registers by (__launch_bounds__'s
        # second argument in CUDA C)
        occ = f' "nvvm.minctasm"="{self.k.min_groups}"' if self.k.min_groups > 0 else ""
        return f'attributes #0 = {{ nounwind "nvvm.maxntid"="{threads}"{occ} }}'

    def shuffle_xor(self, ins: Instr) -> None:
        t = self.ty(ins.dtype)
        name = f"llvm.nvvm.shfl.sync.bfly.{'f32' if t == 'float' else 'i32'}"
        self.declare(name, t, "i32", t, "i32", "i32")
        self.emit(f"{self.ref(ins)} = call {t} @{name}(i32 -1, {t} {self.ref(ins.src[0])}, i32 {ins.arg[0]}, i32 31)")

    _FRAG = "{i32, i32, i32, i32}"

    def render(self) -> str:
        import re
        self.dyn, dyn_bytes = shared_layout(self.k)
        text = super().render()
        if not self.dyn:
            return text
        # shared arrays past the static limit: offsets into one external (dynamic) array; the module's
        # DYN_SMEM_SYMBOL tells the runtime how many bytes to pass
        def at(m: re.Match) -> str:
            off = self.dyn[int(m.group(1))]
            return "@morok_dyn" if off == 0 else f"getelementptr (i8, {self.local_ptr} @morok_dyn, i32 {off})"
        text = re.sub(r"@smem(\d+)\b", at, text)
        head = (f"@morok_dyn = external addrspace(3) global [0 x i8], align {shared_align(self.k)}\n"
                f"@{DYN_SMEM_SYMBOL} = addrspace(1) global i32 {dyn_bytes}, align 4\n")
        i = text.index("define ptx_kernel")
        return text[:i] + head + text[i:]

    def instr(self, ins: Instr) -> None:
        k = ins.kind
        if k is L.LOCAL and self.dyn:
            return                      # carved out of @morok_dyn (see render)
        if k is L.CP_ASYNC:
            local, sidx, buf, gidx = ins.src
            r = f"%cp{ins.id}"
            name = f"llvm.nvvm.cp.async.{'cg' if ins.arg == 16 else 'ca'}.shared.global.{ins.arg}"
            self.declare(name, "void", self.local_ptr, self.ptr)
            self.emit(f"{r}.s = getelementptr inbounds {self.mem_ty(local.dtype)}, {self.local_ptr} @smem{local.id}, "
                      f"i32 {self.ref(sidx)}")
            self.emit(f"{r}.g = getelementptr inbounds {self.mem_ty(local.dtype)}, {self.ptr} {self.ref(buf)}, "
                      f"i32 {self.ref(gidx)}")
            self.emit(f"call void @{name}({self.local_ptr} {r}.s, {self.ptr} {r}.g)")
        elif k is L.CP_COMMIT:
            self.declare("llvm.nvvm.cp.async.commit.group", "void")
            self.emit("call void @llvm.nvvm.cp.async.commit.group()")
        elif k is L.CP_WAIT:
            self.declare("llvm.nvvm.cp.async.wait.group", "void", "i32")
            self.emit(f"call void @llvm.nvvm.cp.async.wait.group(i32 {int(ins.arg)})")
        else:
            super().instr(ins)

    def ldmatrix(self, ins: Instr) -> None:
        (buf, idx), (count, trans) = ins.src, ins.arg
        assert count == 4, "ldmatrix .x4 only"
        r = self.ref(ins)
        name = f"llvm.nvvm.ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.b16"
        self.declare(name, self._FRAG, self.local_ptr)
        self.emit(f"{r}.p = getelementptr inbounds {self.mem_ty(ins.dtype)}, {self.local_ptr} @smem{buf.id}, "
                  f"i32 {self.ref(idx)}")
        self.emit(f"{r} = call {self._FRAG} @{name}({self.local_ptr} {r}.p)")

    def mma(self, ins: Instr) -> None:
        a, b, *accs = ins.src
        shape, pair = ins.arg
        m = f"%mma{ins.id}"
        # f16 inputs: llvm.nvvm.mma.<shape>.row.col.<d>.<c> with <2 x half> registers; bf16: i32 registers
        half = a.dtype.name == "float16"
        name = f"llvm.nvvm.mma.{shape}.row.col.{'f32.f32' if half else 'bf16'}"
        rt = "<2 x half>" if half else "i32"
        args = []
        for tag, frag, regs in (("a", a, range(4)), ("b", b, (2 * pair, 2 * pair + 1))):
            for n in regs:
                self.emit(f"{m}.{tag}{n} = extractvalue {self._FRAG} {self.ref(frag)}, {n}")
                if half:
                    self.emit(f"{m}.{tag}{n}.h = bitcast i32 {m}.{tag}{n} to <2 x half>")
                args.append(f"{rt} {m}.{tag}{n}{'.h' if half else ''}")
        for n, c in enumerate(accs):
            self.emit(f"{m}.c{n} = load float, ptr %acc{c.id}")
            args.append(f"float {m}.c{n}")
        ret = "{float, float, float, float}"
        self.declare(name, ret, *(x.split(" %")[0] for x in args))
        self.emit(f"{m} = call {ret} @{name}({', '.join(args)})")
        for n, c in enumerate(accs):
            self.emit(f"{m}.d{n} = extractvalue {ret} {m}, {n}")
            self.emit(f"store float {m}.d{n}, ptr %acc{c.id}")

    def warpgroup(self, ins: Instr) -> None:
        k, r = ins.kind, self.ref(ins)
        if k is L.SMEM_DESC:
            (buf, idx), (lbo, sbo) = ins.src, ins.arg
            self.emit(f"{r}.p = getelementptr inbounds {self.mem_ty(buf.dtype)}, {self.local_ptr} @smem{buf.id}, "
                      f"i32 {self.ref(idx)}")
            self.emit(f"{r}.a = ptrtoint {self.local_ptr} {r}.p to i32")
            self.emit(f"{r}.m = and i32 {r}.a, 262143")
            self.emit(f"{r}.s = lshr i32 {r}.m, 4")
            self.emit(f"{r}.z = zext i32 {r}.s to i64")
            self.emit(f"{r} = or i64 {r}.z, {desc_high(lbo, sbo)}")
            return
        if k is L.MBAR:
            (op, count), (buf, idx, *par) = ins.arg, ins.src
            a = f"%mb{ins.id}"
            self.emit(f"{a}.p = getelementptr inbounds {self.mem_ty(buf.dtype)}, {self.local_ptr} @smem{buf.id}, "
                      f"i32 {self.ref(idx)}")
            self.emit(f"{a} = ptrtoint {self.local_ptr} {a}.p to i32")
            args = [f"i32 {a}"] + ([f"i32 {count}"] if op == "init" else [f"i32 {self.ref(par[0])}"] if op == "wait" else [])
            cons = ",".join(["r"] * len(args))
            self.emit(f'call void asm sideeffect "{mbar_text(op, dollar=True)}", "{cons},~{{memory}}"({", ".join(args)})')
            return
        if k is L.WG_SYNC:
            accs, ins_args, head = list(ins.src), [], wg_sync_text(ins.arg)
        else:
            da, db, *accs = ins.src
            n, ab, ta, tb = ins.arg
            head = wgmma_text(n, ab, ta, tb, dollar=True)
            ins_args = [f"i64 {self.ref(da)}", f"i64 {self.ref(db)}", "i32 1"]
        m = len(accs)
        tag = f"%wg{ins.id}"
        if not m:
            self.emit(f'call void asm sideeffect "{head}", "~{{memory}}"()')
            return
        # the accumulators as tied in-out operands ($0 .. $m-1), read back from the returned struct
        ret = "{" + ", ".join(["float"] * m) + "}"
        cons = ",".join(["=f"] * m + [c for c in ("l", "l", "r")[:len(ins_args)]] + [str(i) for i in range(m)])
        args = list(ins_args)
        for n_, c in enumerate(accs):
            self.emit(f"{tag}.c{n_} = load float, ptr %acc{c.id}")
            args.append(f"float {tag}.c{n_}")
        self.emit(f'{tag} = call {ret} asm sideeffect "{head}", "{cons},~{{memory}}"({", ".join(args)})')
        for n_, c in enumerate(accs):
            self.emit(f"{tag}.d{n_} = extractvalue {ret} {tag}, {n_}")
            self.emit(f"store float {tag}.d{n_}, ptr %acc{c.id}")

    def special(self, ins: Instr) -> str:
        kind, dim = ins.arg
        reg = {"group_id": "ctaid", "local_id": "tid"}[kind]
        name = f"llvm.nvvm.read.ptx.sreg.{reg}.{'xyz'[dim]}"
        self.declare(name, "i32")
        return f"call i32 @{name}()"

    def barrier(self) -> str:
        # bar.sync 0: every thread of the block arrives, and shared-memory writes before it are visible after
        self.declare("llvm.nvvm.barrier.cta.sync.aligned.all", "void", "i32")
        return "call void @llvm.nvvm.barrier.cta.sync.aligned.all(i32 0)"

    def unary_float(self, op: Ops, dt: DType, a: str) -> str:
        if dt.name == "float64" and op in (Ops.SIN, Ops.EXP2, Ops.LOG2):
            return self.f64_helper(op, a)
        if dt.name == "float32":
            if op is Ops.LOG2:
                # llvm.log2.f32 has no NVPTX lowering; lg2.approx is within 2^-22 absolute
                self.declare("llvm.nvvm.lg2.approx.f", "float", "float")
                return f"call float @llvm.nvvm.lg2.approx.f(float {a})"
            if op is Ops.SIN:
                # sin.approx loses accuracy outside [-pi, pi]: go through the double helper, rounded once
                tmp = f"%sin{len(self.lines)}"
                self.emit(f"{tmp}.d = fpext float {a} to double")
                self.emit(f"{tmp}.r = {self.f64_helper(op, f'{tmp}.d')}")
                return f"fptrunc double {tmp}.r to float"
        return super().unary_float(op, dt, a)


class NVPTXRenderer(Renderer):
    """LLVM IR for llvmlite's NVPTX backend. Its split GEMVs default to the upcast form (capabilities'
    split_upcast): LLVM recomputes a 64-bit address per load of the plain split, which 8 outputs per load of
    the weights amortize (H100, batch-8 GEMV: 53 us against 91; NVRTC's plain split is already 66 us)."""

    caps = replace(CUDA_CAPS, split_upcast=8)

    def __init__(self, device: DeviceSpec, arch: str = "") -> None:
        super().__init__(device)
        self.arch = arch
        self.caps = replace(cuda_caps(arch), split_upcast=8)

    def render_kernel(self, kernel: LinearKernel) -> str:
        return NVPTXPrinter(kernel).render()


# ---- MLIR (gpu + nvvm) -------------------------------------------------------------------------

from morok_py.codegen.mlir import MLIRGPUPrinter  # noqa: E402


class MLIRNVVMPrinter(MLIRGPUPrinter):
    """A gpu.module for `#nvvm.target`; math as the NVPTX LLVM printer does it (no libdevice)."""

    def __init__(self, kernel: LinearKernel, arch: str) -> None:
        super().__init__(kernel)
        self.target = f'#nvvm.target<chip = "{arch}">'

    def unary_float(self, op: Ops, t: str, a: str, r: str) -> None:
        if t == "f64" and op in (Ops.SIN, Ops.EXP2, Ops.LOG2):
            return self.f64_helper(op, a, r)
        if t == "f32" and op is Ops.LOG2:
            # llvm.log2.f32 has no NVPTX lowering; lg2.approx is within 2^-22 absolute
            return self.emit(f'{r} = llvm.call_intrinsic "llvm.nvvm.lg2.approx.f"({a}) : (f32) -> f32')
        if t == "f32" and op is Ops.SIN:
            # sin.approx loses accuracy outside [-pi, pi]: the double helper, rounded once
            self.emit(f"{r}.d = arith.extf {a} : f32 to f64")
            self.f64_helper(op, f"{r}.d", f"{r}.r")
            return self.emit(f"{r} = arith.truncf {r}.r : f64 to f32")
        super().unary_float(op, t, a, r)


class MLIRNVVMRenderer(Renderer):
    """MLIR (gpu dialect, NVVM target) for the MLIR pair."""

    caps = CUDA_CAPS

    def __init__(self, device: DeviceSpec, arch: str = "sm_90") -> None:
        super().__init__(device)
        self.arch = arch

    def render_kernel(self, kernel: LinearKernel) -> str:
        return MLIRNVVMPrinter(kernel, self.arch).render()
