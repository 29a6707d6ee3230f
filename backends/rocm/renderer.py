"""LLVM IR for AMDGPU (amdgcn-amd-amdhsa): `amdgpu_kernel` entry points, buffers in the global
address space, work-group and work-item ids through the amdgcn intrinsics, and the flat
work-group size attribute taken from the launch's local size.

AMDGPU has no instructions for double-precision sin, exp2 and log2 (and no libm to call:
LLVM aborts the process on them), so those are printed as small IR functions here.
"""
from __future__ import annotations

import math
import re

from morok_py.codegen.c_like import GPU_BF16_HELPERS, GPUCPrinter
from morok_py.codegen.linear import Instr, L, LinearKernel
from morok_py.codegen.llvm_ir import LLVMIRPrinter
from morok_py.codegen.lower import Capabilities
from morok_py.device import DeviceSpec, Renderer
from morok_py.dtypes import DType
from morok_py.errors import UnknownNameError
from morok_py.ir import Ops

TRIPLE = "amdgcn-amd-amdhsa"
# LLVM 22's layout for amdgcn-amd-amdhsa (A5: allocas live in the private address space 5)
DATALAYOUT = ("e-m:e-p:64:64-p1:64:64-p2:32:32-p3:32:32-p4:64:64-p5:32:32-p6:32:32-p7:160:256:256:32-"
              "p8:128:128:128:48-p9:192:256:256:32-i64:64-v16:16-v24:32-v32:32-v48:64-v96:128-v192:256-"
              "v256:256-v512:512-v1024:1024-v2048:2048-n32:64-S32-A5-G1-ni:7:8:9")
CODE_OBJECT_VERSION = 500

_ARCH_RE = re.compile(r"^gfx[0-9]{1,2}[0-9a-f]{2}$")

def parse_arch(arch: str) -> tuple[str, str]:
    """Split a `gcnArchName` like 'gfx90a:sramecc+:xnack-' into ('gfx90a', ':sramecc+:xnack-')."""
    name, _, rest = arch.strip().partition(":")
    name = name.lower()
    if not _ARCH_RE.match(name):
        raise UnknownNameError(f"{arch!r} is not an AMDGPU arch like gfx90a, gfx942 or gfx1100")
    return name, (":" + rest if rest else "")

def wave_size(arch: str) -> int:
    """Wavefront width: 32 on RDNA (gfx10, gfx11, gfx12), 64 on GCN/CDNA (gfx9 and older)."""
    name, _ = parse_arch(arch)
    major = int(name[3:-2])
    return 32 if major >= 10 else 64

def capabilities(arch: str) -> Capabilities:
    return Capabilities(has_local=True, has_shared=True, local_max=(1024, 1024, 1024),
                        max_threads_per_group=1024, default_group=256,
                        grid_max=(2**31 - 1, 2**31 - 1, 2**31 - 1), warp_size=wave_size(arch),
                        group_reduce=True, grid_reduce=True, vector_width=4, warp_shuffle=True,
                        matmul_tile=(128, 128, 8, 8, 8))

from morok_py.codegen.llvm_math import F64_HELPERS  # noqa: E402

class AMDGPULLVMPrinter(LLVMIRPrinter):
    ptr = "ptr addrspace(1)"
    triple = TRIPLE
    datalayout = DATALAYOUT
    param_attrs = "noalias"
    acc_ptr = "ptr addrspace(5)"
    sync_scope = ' syncscope("agent")'   # the device: global atomics and fences of a grid reduction

    def signature(self) -> str:
        args = [f"{self.ptr} {self.param_attrs} %p{p.slot}" for p in self.k.params]
        args += [f"i32 %var_{n}" for n in self.k.var_names]
        return f"define amdgpu_kernel void @{self.k.symbol}({', '.join(args)}) #0"

    def attributes(self) -> str:
        threads = max(1, math.prod(self.k.local_size))
        # launches always cover whole work-groups (the grid is counted in groups), hence uniform
        return (f'attributes #0 = {{ nounwind "amdgpu-flat-work-group-size"="1,{threads}" '
                f'"uniform-work-group-size"="true" }}')

    def special(self, ins: Instr) -> str:
        kind, dim = ins.arg
        base = {"group_id": "workgroup.id", "local_id": "workitem.id"}[kind]
        name = f"llvm.amdgcn.{base}.{'xyz'[dim]}"
        self.declare(name, "i32")
        return f"call i32 @{name}()"

    def shuffle_xor(self, ins: Instr) -> None:
        """ds_bpermute: read the 32-bit value of lane (lane ^ mask); lane = local id % wave size."""
        value, lid = ins.src
        mask, width = ins.arg
        r, t = self.ref(ins), self.ty(ins.dtype)
        self.declare("llvm.amdgcn.ds.bpermute", "i32", "i32", "i32")
        self.emit(f"{r}.l = and i32 {self.ref(lid)}, {width - 1}")
        self.emit(f"{r}.x = xor i32 {r}.l, {mask}")
        self.emit(f"{r}.a = shl i32 {r}.x, 2")
        bits = self.ref(value)
        if t != "i32":
            self.emit(f"{r}.b = bitcast {t} {bits} to i32")
            bits = f"{r}.b"
        if t != "i32":
            self.emit(f"{r}.s = call i32 @llvm.amdgcn.ds.bpermute(i32 {r}.a, i32 {bits})")
            self.emit(f"{r} = bitcast i32 {r}.s to {t}")
        else:
            self.emit(f"{r} = call i32 @llvm.amdgcn.ds.bpermute(i32 {r}.a, i32 {bits})")

    def barrier(self) -> str:
        # LDS writes must be visible to the work-group after s_barrier: release/acquire fences
        self.declare("llvm.amdgcn.s.barrier", "void")
        return ('fence syncscope("workgroup") release\n  call void @llvm.amdgcn.s.barrier()\n'
                '  fence syncscope("workgroup") acquire')

    def trailer(self) -> list[str]:
        out = super().trailer()
        n = len(self.metadata)   # after the kernel's own metadata (loop hints)
        out += [f"!llvm.module.flags = !{{!{n}}}",
                f'!{n} = !{{i32 1, !"amdhsa_code_object_version", i32 {CODE_OBJECT_VERSION}}}']
        return out

    # accumulators are allocas, which live in the private address space (5) on AMDGPU
    def instr(self, ins: Instr) -> None:
        k = ins.kind
        if k is L.ACC:
            self.allocas.append(f"%acc{ins.id} = alloca {self.ty(ins.dtype)}, addrspace(5)")
            init = self.ref(Instr(L.CONST, ins.dtype, (), ins.arg, -1))
            self.emit(f"store {self.ty(ins.dtype)} {init}, {self.acc_ptr} %acc{ins.id}")
        elif k is L.ACC_LOAD:
            self.emit(f"{self.ref(ins)} = load {self.ty(ins.dtype)}, {self.acc_ptr} %acc{ins.src[0].id}")
        elif k is L.ACC_STORE:
            acc, val = ins.src
            self.emit(f"store {self.ty(acc.dtype)} {self.ref(val)}, {self.acc_ptr} %acc{acc.id}")
        else:
            super().instr(ins)

    def unary_float(self, op: Ops, dt: DType, a: str) -> str:
        if dt.name == "float64" and op in F64_HELPERS:
            return self.f64_helper(op, a)
        return super().unary_float(op, dt, a)

    # matrix cores (codegen/strategies/tensor_core.py): fragments are vectors of 16-bit values, the
    # accumulators one <n x float>; bfloat16 goes in as i16 bits
    _MATRIX = {("mfma_32x32x8", "float16"): ("llvm.amdgcn.mfma.f32.32x32x8f16", 4, 16, True),
               ("mfma_32x32x8", "bfloat16"): ("llvm.amdgcn.mfma.f32.32x32x8bf16.1k", 4, 16, True),
               ("wmma_16x16x16", "float16"): ("llvm.amdgcn.wmma.f32.16x16x16.f16.v8f32.v16f16", 16, 8, False),
               ("wmma_16x16x16", "bfloat16"): ("llvm.amdgcn.wmma.f32.16x16x16.bf16.v8f32.v16i16", 16, 8, False)}

    def mma(self, ins: Instr) -> None:
        a, b, *accs = ins.src
        name, n, nacc, mfma = self._MATRIX[(ins.arg[0], a.dtype.name)]
        m = f"%mx{ins.id}"
        et = "half" if a.dtype.name == "float16" else "i16"
        ops = []
        for tag, frag in (("a", a), ("b", b)):
            v = self.ref(frag)
            if a.dtype.name == "bfloat16":
                self.emit(f"{m}.{tag} = bitcast <{n} x bfloat> {v} to <{n} x i16>")
                v = f"{m}.{tag}"
            ops.append(f"<{n} x {et}> {v}")
        ct = f"<{nacc} x float>"
        prev = "poison"
        for r, c in enumerate(accs):
            self.emit(f"{m}.l{r} = load float, {self.acc_ptr} %acc{c.id}")
            self.emit(f"{m}.c{r} = insertelement {ct} {prev}, float {m}.l{r}, i32 {r}")
            prev = f"{m}.c{r}"
        ops.append(f"{ct} {prev}")
        if mfma:
            ops += ["i32 0", "i32 0", "i32 0"]    # cbsz, abid, blgp: no broadcast
        self.declare(name, ct, *(o.rsplit(" ", 1)[0] for o in ops))
        self.emit(f"{m} = call {ct} @{name}({', '.join(ops)})")
        for r, c in enumerate(accs):
            self.emit(f"{m}.d{r} = extractelement {ct} {m}, i32 {r}")
            self.emit(f"store float {m}.d{r}, {self.acc_ptr} %acc{c.id}")


def matrix_cores(arch: str) -> tuple[str, ...]:
    """The matrix instructions the LLVM pair uses for `arch`: MFMA 32x32x8 on gfx90a/gfx942 (CDNA2/3),
    WMMA 16x16x16 on gfx11 (RDNA3); none elsewhere (and none for hiprtc and MLIR, which do not print them)."""
    name, _ = parse_arch(arch)
    if name in ("gfx90a", "gfx940", "gfx941", "gfx942", "gfx950"):
        return ("mfma_32x32x8",)
    if name.startswith("gfx11"):
        return ("wmma_16x16x16",)
    return ()

class AMDGPURenderer(Renderer):
    """LLVM IR for one gfx arch; the arch sets the wave size and the matrix cores lowering sees."""

    def __init__(self, device: DeviceSpec, arch: str) -> None:
        super().__init__(device)
        self.arch = parse_arch(arch)[0]
        from dataclasses import replace
        self.caps = replace(capabilities(self.arch), tensor_cores=matrix_cores(self.arch))

    def render_kernel(self, kernel: LinearKernel) -> str:
        return AMDGPULLVMPrinter(kernel).render()

# ---- HIP C (for hiprtc) --------------------------------------------------------------------------

_HIP_HALF_HELPERS = {
    "float16": [
        "typedef unsigned short morok_half;  /* IEEE float16 bits */",
        "__device__ __forceinline__ float morok_h2f(morok_half h) { return (float)__builtin_bit_cast(_Float16, h); }",
        "__device__ __forceinline__ morok_half morok_f2h(float f) "
        "{ return __builtin_bit_cast(morok_half, (_Float16)f); }",
    ],
    "bfloat16": GPU_BF16_HELPERS,
}

class HIPCPrinter(GPUCPrinter):
    """HIP C: `extern "C" __global__`, `__launch_bounds__`, `__restrict__`, blockIdx/threadIdx.
    hiprtc provides the HIP device headers itself; half values stay 16-bit patterns converted
    through clang's _Float16, so no hip_fp16.h is needed."""

    half_helpers = _HIP_HALF_HELPERS

    def shuffle_xor(self, value: str, mask: int) -> str:
        return f"__shfl_xor({value}, {mask})"


class HIPRenderer(Renderer):
    """HIP C for hiprtc; the arch sets the wave size lowering sees."""

    def __init__(self, device: DeviceSpec, arch: str) -> None:
        super().__init__(device)
        self.arch = parse_arch(arch)[0]
        self.caps = capabilities(self.arch)

    def render_kernel(self, kernel: LinearKernel) -> str:
        return HIPCPrinter(kernel).render()


# ---- MLIR (gpu + rocdl) ------------------------------------------------------------------------

from morok_py.codegen.mlir import MLIRGPUPrinter  # noqa: E402


class MLIRROCDLPrinter(MLIRGPUPrinter):
    """A gpu.module for `#rocdl.target`, code object v5 like the LLVM printer; double sin/exp2/log2
    through the same IR helpers (AMDGPU has neither instructions nor a libm for them)."""

    sync_scope = "agent"   # the device: fences of a grid reduction

    def __init__(self, kernel: LinearKernel, arch: str) -> None:
        super().__init__(kernel)
        self.target = f'#rocdl.target<chip = "{arch}">'
        self.module_ops.append('llvm.module_flags [#llvm.mlir.module_flag<error, "amdhsa_code_object_version", '
                               f'{CODE_OBJECT_VERSION} : i32>]')

    def unary_float(self, op: Ops, t: str, a: str, r: str) -> None:
        if t == "f64" and op in F64_HELPERS:
            return self.f64_helper(op, a, r)
        super().unary_float(op, t, a, r)


class MLIRROCDLRenderer(Renderer):
    """MLIR (gpu dialect, ROCDL target) for the MLIR pair; the arch sets the wave size."""

    def __init__(self, device: DeviceSpec, arch: str) -> None:
        super().__init__(device)
        self.arch = parse_arch(arch)[0]
        self.caps = capabilities(self.arch)

    def render_kernel(self, kernel: LinearKernel) -> str:
        return MLIRROCDLPrinter(kernel, self.arch).render()
