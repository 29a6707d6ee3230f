"""Double-precision sin, exp2 and log2 as LLVM IR functions, for GPU targets (NVPTX, AMDGPU)
that have no instruction and no libm for them. Shared by the CUDA and ROCm LLVM renderers."""
from __future__ import annotations

import math
import struct

from ..ir import Ops


def _hex(v: float) -> str:
    """A double's exact LLVM literal (its IEEE bits in hex; llvm_ir.llvm_float's float64 form)."""
    return "0x%016X" % struct.unpack("<Q", struct.pack("<d", v))[0]


def _horner(z: str, coeffs: list[float], tag: str) -> tuple[list[str], str]:
    """Lines evaluating sum(c_i * z**i) by fused Horner steps; returns (lines, result name)."""
    lines, acc = [], _hex(coeffs[-1])
    for i, c in enumerate(reversed(coeffs[:-1])):
        nxt = f"%{tag}{i}"
        lines.append(f"{nxt} = call double @llvm.fma.f64(double {acc}, double {z}, double {_hex(c)})")
        acc = nxt
    return lines, acc


def _exp2_f64() -> str:
    ln2 = math.log(2)
    poly, p = _horner("%t", [1.0 / math.factorial(k) for k in range(15)], "e")  # |t| <= ln2/2
    body = [
        "%nan = fcmp uno double %x, 0.0",
        "%big = fcmp oge double %x, 1024.0",
        "%small = fcmp olt double %x, -1100.0",
        "%out = or i1 %nan, %big",
        "%out2 = or i1 %out, %small",
        "%xc = select i1 %out2, double 0.0, double %x",
        "%n = call double @llvm.rint.f64(double %xc)",
        "%f = fsub double %xc, %n",
        f"%t = fmul double %f, {_hex(ln2)}",
        *poly,
        "%ni = fptosi double %n to i32",
        # 2^n as two normal factors so results down to the denormal range are exact scalings
        "%a = ashr i32 %ni, 1",
        "%b = sub i32 %ni, %a",
        "%ea = add i32 %a, 1023", "%eb = add i32 %b, 1023",
        "%ea64 = zext i32 %ea to i64", "%eb64 = zext i32 %eb to i64",
        "%sa = shl i64 %ea64, 52", "%sb = shl i64 %eb64, 52",
        "%fa = bitcast i64 %sa to double", "%fb = bitcast i64 %sb to double",
        f"%r0 = fmul double {p}, %fa",
        "%r1 = fmul double %r0, %fb",
        "%r2 = select i1 %big, double 0x7FF0000000000000, double %r1",
        "%r3 = select i1 %small, double 0.0, double %r2",
        "%r = select i1 %nan, double %x, double %r3",
        "ret double %r",
    ]
    return _fn("__morok_exp2_f64", body)


def _log2_f64() -> str:
    # log(m) = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.1716 for m in [sqrt(1/2), sqrt(2))
    poly, p = _horner("%z", [1.0 / (2 * k + 1) for k in range(12)], "l")
    body = [
        "%den = fcmp olt double %x, 0x0010000000000000",
        "%xu = fmul double %x, 0x43F0000000000000",          # * 2^64 lifts denormals
        "%xs = select i1 %den, double %xu, double %x",
        "%eadj = select i1 %den, i64 -64, i64 0",
        "%bits = bitcast double %xs to i64",
        "%eraw = lshr i64 %bits, 52",
        "%eb = and i64 %eraw, 2047",
        "%mb = and i64 %bits, 4503599627370495",
        "%mb1 = or i64 %mb, 4607182418800017408",
        "%m = bitcast i64 %mb1 to double",
        f"%gt = fcmp ogt double %m, {_hex(math.sqrt(2.0))}",
        "%mh = fmul double %m, 0.5",
        "%m2 = select i1 %gt, double %mh, double %m",
        "%einc = zext i1 %gt to i64",
        "%e0 = sub i64 %eb, 1023",
        "%e1 = add i64 %e0, %eadj",
        "%e2 = add i64 %e1, %einc",
        "%e = sitofp i64 %e2 to double",
        "%num = fsub double %m2, 1.0",
        "%dnm = fadd double %m2, 1.0",
        "%s = fdiv double %num, %dnm",
        "%z = fmul double %s, %s",
        *poly,
        f"%ln = fmul double %s, {p}",
        f"%r0 = call double @llvm.fma.f64(double %ln, double {_hex(2.0 / math.log(2))}, double %e)",
        "%nan = fcmp uno double %x, 0.0",
        "%neg = fcmp olt double %x, 0.0",
        "%bad = or i1 %nan, %neg",
        "%zero = fcmp oeq double %x, 0.0",
        "%inf = fcmp oeq double %x, 0x7FF0000000000000",
        "%r1 = select i1 %inf, double 0x7FF0000000000000, double %r0",
        "%r2 = select i1 %zero, double 0xFFF0000000000000, double %r1",
        "%r = select i1 %bad, double 0x7FF8000000000000, double %r2",
        "ret double %r",
    ]
    return _fn("__morok_log2_f64", body)


_PIO2 = (1.5707963267948966, 6.123233995736766e-17, -1.4973849048591698e-33)


def _sin_f64() -> str:
    # Cody-Waite reduction by pi/2 in three parts with fma, then sin or cos on [-pi/4, pi/4]
    sin_poly, sp = _horner("%z", [(-1) ** k / math.factorial(2 * k + 1) for k in range(1, 11)], "s")
    cos_poly, cp = _horner("%z", [(-1) ** k / math.factorial(2 * k) for k in range(0, 11)], "c")
    body = [
        f"%q = fmul double %x, {_hex(2 / math.pi)}",
        "%k = call double @llvm.rint.f64(double %q)",
        "%nk = fneg double %k",
        f"%r0 = call double @llvm.fma.f64(double %nk, double {_hex(_PIO2[0])}, double %x)",
        f"%r1 = call double @llvm.fma.f64(double %nk, double {_hex(_PIO2[1])}, double %r0)",
        f"%r = call double @llvm.fma.f64(double %nk, double {_hex(_PIO2[2])}, double %r1)",
        "%z = fmul double %r, %r",
        *sin_poly,
        "%rz = fmul double %r, %z",
        f"%sn = call double @llvm.fma.f64(double %rz, double {sp}, double %r)",
        *cos_poly,
        "%ki = fptosi double %k to i64",
        "%quad = and i64 %ki, 3",
        "%odd = and i64 %quad, 1",
        "%useco = icmp ne i64 %odd, 0",
        f"%v = select i1 %useco, double {cp}, double %sn",
        "%neg = icmp uge i64 %quad, 2",
        "%nv = fneg double %v",
        "%v2 = select i1 %neg, double %nv, double %v",
        "%ax = call double @llvm.fabs.f64(double %x)",
        "%fin = fcmp olt double %ax, 0x7FF0000000000000",   # false for inf and NaN
        "%res = select i1 %fin, double %v2, double 0x7FF8000000000000",
        "%zero = fcmp oeq double %x, 0.0",                  # keeps the sign of -0.0
        "%out = select i1 %zero, double %x, double %res",
        "ret double %out",
    ]
    return _fn("__morok_sin_f64", body)


def _fn(name: str, body: list[str]) -> str:
    return "\n".join([f"define internal double @{name}(double %x) alwaysinline nounwind {{", "entry:"]
                     + ["  " + b for b in body] + ["}"])


F64_HELPERS = {Ops.SIN: ("__morok_sin_f64", _sin_f64), Ops.EXP2: ("__morok_exp2_f64", _exp2_f64),
               Ops.LOG2: ("__morok_log2_f64", _log2_f64)}
F64_HELPER_DECLS = {"llvm.fma.f64": "declare double @llvm.fma.f64(double, double, double)",
                    "llvm.rint.f64": "declare double @llvm.rint.f64(double)",
                    "llvm.fabs.f64": "declare double @llvm.fabs.f64(double)"}


# ---- the printer --------------------------------------------------------------------------------

