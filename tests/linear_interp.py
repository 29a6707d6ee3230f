"""A test-only interpreter of GPU LinearKernels on numpy arrays: a lowering test, not a device test.

Each work-group runs its work-items in lock step, one numpy lane per work-item, masked by `If`
conditions and per-lane loop bounds. Lock step would hide missing barriers, so the interpreter checks
what a GPU run might not show:

- a BARRIER that only some work-items of the group reach (divergent barrier);
- shared memory read before anything wrote it, or written by one work-item and read or written by
  another with no BARRIER in between (a race);
- global loads and stores outside their buffers, and misaligned vector accesses.

It also counts the stores to every global element, so a test can check that each output is written
exactly once.
"""
from __future__ import annotations

import itertools
import math
from typing import Mapping

import numpy as np

from morok_py.codegen.linear import If, Instr, L, LinearKernel, Loop
from morok_py.dtypes import DType, to_numpy
from morok_py.ir import Ops


class InterpError(AssertionError):
    """The kernel did something a GPU would not do reliably (or at all)."""


def _np(dt: DType) -> np.dtype:
    return np.dtype(np.bool_) if dt.is_bool else to_numpy(dt)


class _Shared:
    """One LOCAL array of a work-group, with the race bookkeeping of the current barrier interval."""

    def __init__(self, dt: DType, count: int) -> None:
        self.data = np.zeros(count, _np(dt))
        self.init = np.zeros(count, bool)
        self.writer = np.full(count, -1, np.int64)     # lane that wrote since the last barrier
        self.reader = np.full(count, -1, np.int64)     # lane that read since then (-2: several)
        self.pending = np.zeros(count, bool)           # a cp.async copy to it has not landed yet
        self.unfenced = np.zeros(count, bool)          # written since the last proxy fence (wgmma may not read)
        self.wg_read = np.full(count, -1, np.int64)    # group number of an unfinished wgmma read (-1: none)

    def barrier(self) -> None:
        self.writer[:] = -1
        self.reader[:] = -1


class _Group:
    def __init__(self, kernel: LinearKernel, bufs: list[np.ndarray], writes: list[np.ndarray],
                 values: Mapping[str, int], group: tuple[int, int, int]) -> None:
        self.k, self.bufs, self.writes = kernel, bufs, writes
        self.values = values
        self.group = group
        ls = kernel.local_size
        self.n = n = math.prod(ls)
        lane = np.arange(n)
        self.local_ids = (lane % ls[0], (lane // ls[0]) % ls[1], lane // (ls[0] * ls[1]))
        self.lane = lane
        self.vals: dict[int, np.ndarray] = {}
        self.accs: dict[int, np.ndarray] = {}
        self.shared: dict[int, _Shared] = {}
        # cp.async: each work-item's committed groups (cp_done) and its copies not landed yet, as records
        # [shared array, lanes, group of each lane, span (lanes x elements), values]
        self.cp_done = np.zeros(n, np.int64)
        self.cp_pending: list[list] = []
        # wgmma: descriptors ({id: (local id, leading, stride)}, the value is the start element), each
        # warpgroup's committed groups, accumulators of unfinished wgmmas, and unfinished reads
        self.descs: dict[int, tuple[int, int, int]] = {}
        self.wg_done = np.zeros(max(1, n // 128), np.int64)
        self.wg_issued: list[tuple[int, int, list[int], object, np.ndarray]] = []
        self.acc_busy: dict[int, np.ndarray] = {}
        # mbarriers: {(local id, element): [expected, arrivals left, completed phases, copies of the current
        # phase, copies of completed phases]}
        self.mbars: dict[tuple[int, int], list] = {}

    # -- values ------------------------------------------------------------------------------------
    def val(self, ins: Instr) -> np.ndarray:
        try:
            return self.vals[ins.id]
        except KeyError:
            pass
        k = ins.kind
        if k not in (L.CONST, L.VAR):
            raise InterpError(f"{ins!r} is used before it is defined")
        v = np.full(self.n, ins.arg if k is L.CONST else self.values[ins.arg], _np(ins.dtype))
        self.vals[ins.id] = v   # leaves are never redefined
        return v

    def run(self) -> None:
        with np.errstate(all="ignore"):
            self.items(self.k.body, np.ones(self.n, bool))

    def items(self, items, mask: np.ndarray) -> None:
        for it in items:
            if isinstance(it, Loop):
                var = self.val(it.start).copy()
                end = self.val(it.end)
                step = self.val(it.step) if it.step is not None else 1
                while True:
                    m = mask & (var < end)
                    if not m.any():
                        break
                    self.vals[it.var.id] = var
                    self.items(it.body, m)
                    var = np.where(m, var + step, var)
            elif isinstance(it, If):
                m = mask & self.val(it.cond)
                if m.any():
                    self.items(it.body, m)
            else:
                self.instr(it, mask)

    # -- instructions -------------------------------------------------------------------------------
    def instr(self, ins: Instr, mask: np.ndarray) -> None:
        k = ins.kind
        if k in (L.CONST, L.VAR, L.PARAM):
            return
        if k is L.SPECIAL:
            kind, dim = ins.arg
            v = np.full(self.n, self.group[dim]) if kind == "group_id" else self.local_ids[dim]
            self.vals[ins.id] = v.astype(_np(ins.dtype))
        elif k is L.LOCAL:
            if ins.id not in self.shared:
                self.shared[ins.id] = _Shared(ins.dtype, ins.arg)
        elif k is L.BARRIER:
            if not mask.all():
                raise InterpError(f"barrier %{ins.id} reached by {int(mask.sum())} of {self.n} work-items")
            for s in self.shared.values():
                s.barrier()
        elif k is L.LOAD:
            self.vals[ins.id] = self.load(ins, mask)
        elif k is L.STORE:
            self.store(ins, mask)
        elif k is L.ACC:
            acc = self.accs.setdefault(ins.id, np.zeros(self.n, _np(ins.dtype)))
            acc[mask] = ins.arg
        elif k is L.ACC_LOAD:
            busy = self.acc_busy.get(ins.src[0].id)
            if busy is not None and (busy & mask).any():
                raise InterpError(f"acc_load %{ins.id} reads an accumulator of a wgmma not waited for")
            self.vals[ins.id] = self.accs[ins.src[0].id].copy()
        elif k is L.ACC_STORE:
            acc, v = ins.src
            self.accs[acc.id][mask] = self.val(v)[mask]
        elif k is L.EXTRACT:
            self.vals[ins.id] = self.val(ins.src[0])[:, ins.arg].copy()
        elif k is L.VECTOR:
            self.vals[ins.id] = np.stack([self.val(s) for s in ins.src], axis=1)
        elif k is L.FENCE:
            pass
        elif k is L.SHUFFLE_XOR:
            # lane l reads lane l ^ m of its warp; every lane of the warp must take part
            v, (m, w) = self.val(ins.src[0]), ins.arg
            if self.n % w or not all(mask[i:i + w].all() or not mask[i:i + w].any() for i in range(0, self.n, w)):
                raise InterpError("a warp shuffle that only part of a warp reaches")
            self.vals[ins.id] = v[np.arange(self.n) ^ m]
        elif k is L.CP_ASYNC:
            self.cp_async(ins, mask)
        elif k is L.CP_COMMIT:
            self.cp_done[mask] += 1
        elif k is L.CP_WAIT:
            self.cp_wait(ins.arg, mask)
        elif k is L.LDMATRIX:
            self.vals[ins.id] = self.ldmatrix(ins, mask)
        elif k is L.MMA:
            self.mma(ins, mask)
        elif k is L.SMEM_DESC:
            (local, idx), (lbo, sbo) = ins.src, ins.arg
            self.descs[ins.id] = (local.id, lbo, sbo)
            self.vals[ins.id] = self.val(idx).astype(np.int64)
        elif k is L.WGMMA:
            self.wgmma(ins, mask)
        elif k is L.WG_SYNC:
            self.wg_sync(ins, mask)
        elif k is L.MBAR:
            self.mbar(ins, mask)
        elif k is L.ATOMIC_ADD:
            buf, idx, v = ins.src
            data = self.bufs[buf.arg]
            ix, vv = self.val(idx), self.val(v)
            old = np.zeros(self.n, data.dtype)
            for lane in np.flatnonzero(mask):   # one at a time, in lane order
                self.check_bounds(buf.arg, ix[lane:lane + 1], data.size, "atomic on")
                old[lane] = data[ix[lane]]
                data[ix[lane]] = data[ix[lane]] + vv[lane]
            self.vals[ins.id] = old
        elif k is L.ALU:
            self.vals[ins.id] = alu(ins.arg, ins.dtype, [self.val(s) for s in ins.src], [s.dtype for s in ins.src])
        else:
            raise InterpError(f"the interpreter has no rule for {k}")

    def whole_warps(self, mask: np.ndarray, what: str, w: int = 32) -> None:
        if self.n % w or not all(mask[i:i + w].all() or not mask[i:i + w].any() for i in range(0, self.n, w)):
            raise InterpError(f"{what} that only part of a warp reaches")

    def amd_matrix(self, ins: Instr, mask: np.ndarray) -> None:
        """AMD v_mfma_f32_32x32x8 (wave64) and v_wmma_f32_16x16x16 (gfx11, wave32): D = A @ B + C in
        float32 with the ISA's lane layouts (see codegen/strategies/tensor_core.py)."""
        a, b, *accs = ins.src
        mfma = ins.arg[0] == "mfma_32x32x8"
        w, F, KS = (64, 32, 8) if mfma else (32, 16, 16)
        self.whole_warps(mask, f"{ins.arg[0]} %{ins.id}", w)
        av, bv = self.val(a).astype(np.float32), self.val(b).astype(np.float32)
        t = np.arange(w)
        for w0 in range(0, self.n, w):
            if not mask[w0]:
                continue
            A, B, C = np.zeros((F, KS), np.float32), np.zeros((KS, F), np.float32), np.zeros((F, F), np.float32)
            fa, fb = av[w0:w0 + w], bv[w0:w0 + w]
            if mfma:
                for e in range(4):
                    A[t % 32, 4 * (t // 32) + e] = fa[:, e]
                    B[4 * (t // 32) + e, t % 32] = fb[:, e]
                rows = [8 * (r // 4) + 4 * (t // 32) + r % 4 for r in range(16)]
            else:
                if (fa[:16] != fa[16:]).any() or (fb[:16] != fb[16:]).any():
                    raise InterpError(f"wmma %{ins.id}: lanes 16-31 must repeat the fragments of lanes 0-15")
                A[:, :] = fa[:16]
                B[:, :] = fb[:16].T
                rows = [2 * r + t // 16 for r in range(8)]
            cols = t % F
            for r, acc in enumerate(accs):
                C[rows[r], cols] = self.accs[acc.id][w0:w0 + w]
            D = A @ B + C
            for r, acc in enumerate(accs):
                self.accs[acc.id][w0:w0 + w] = D[rows[r], cols]

    def cp_async(self, ins: Instr, mask: np.ndarray) -> None:
        """PTX cp.async (16 bytes): the global elements are read now (inputs), and land in shared memory
        at the CP_WAIT that covers the lane's group. Until then the destination is pending: a read of it,
        or a second write, is a race; a read of it by other lanes before a barrier after the wait is one too."""
        local, sidx, buf, gidx = ins.src
        sh = self.shared[local.id]
        width = ins.arg // sh.data.itemsize
        lanes = np.flatnonzero(mask)
        si, gi = self.val(sidx).astype(np.int64)[lanes], self.val(gidx).astype(np.int64)[lanes]
        if (si % width).any() or (gi % width).any():
            raise InterpError(f"cp.async %{ins.id}: a 16-byte copy at an index that is not a multiple of {width}")
        span, gspan = (si[:, None] + np.arange(width)), (gi[:, None] + np.arange(width))
        data = self.bufs[buf.arg]
        self.check_bounds(buf.arg, gspan.reshape(-1), data.size, f"cp.async %{ins.id} from")
        self.check_bounds(-1, span.reshape(-1), sh.data.size, f"cp.async %{ins.id} to shared")
        who = np.repeat(lanes, width)
        flat = span.reshape(-1)
        w, r = sh.writer[flat], sh.reader[flat]
        if ((w != -1) & (w != who)).any() or ((r != -1) & (r != who)).any() or sh.pending[flat].any():
            raise InterpError(f"race: cp.async %{ins.id} writes shared memory used with no barrier in between")
        self.wg_race(sh, flat, f"cp.async %{ins.id}")
        sh.pending[flat] = True
        self.cp_pending.append([sh, lanes, self.cp_done[lanes].copy(), span, data[gspan].astype(sh.data.dtype)])

    def cp_wait(self, n: int, mask: np.ndarray) -> None:
        """cp.async.wait_group n: the copies of every group but the lane's newest n land."""
        keep = []
        for rec in self.cp_pending:
            sh, lanes, group, span, vals = rec
            done = mask[lanes] & (group < self.cp_done[lanes] - n)
            if done.any():
                flat = span[done].reshape(-1)
                sh.data[flat] = vals[done].reshape(-1)
                sh.init[flat] = True
                sh.unfenced[flat] = True
                sh.pending[flat] = False
                sh.writer[flat] = np.repeat(lanes[done], span.shape[1])
            if not done.all():
                keep.append([sh, lanes[~done], group[~done], span[~done], vals[~done]])
        self.cp_pending = keep

    def ldmatrix(self, ins: Instr, mask: np.ndarray) -> np.ndarray:
        """PTX ldmatrix.m8n8.x<count>[.trans].b16: lane 8q + r gives row r of matrix q (8 elements);
        lane t gets, per matrix, the pair (row t/4, columns 2(t%4) + {0, 1}), transposed with .trans.
        The value: (lanes, count, 2) elements."""
        self.whole_warps(mask, f"ldmatrix %{ins.id}")
        (buf, idx), (count, trans) = ins.src, ins.arg
        sh = self.shared[buf.id]
        ix = self.val(idx).astype(np.int64)
        lanes = np.flatnonzero(mask)
        if (ix[lanes] % 8).any():
            raise InterpError(f"ldmatrix %{ins.id}: a row address that is not 16-byte aligned")
        span = (ix[lanes, None] + np.arange(8)).reshape(-1)
        self.check_bounds(-1, span, sh.data.size, f"ldmatrix %{ins.id} from shared")
        if sh.pending[span].any():
            raise InterpError(f"race: ldmatrix %{ins.id} reads shared memory a cp.async has not landed in")
        if not sh.init[span].all():
            raise InterpError(f"ldmatrix %{ins.id} reads shared memory that nothing wrote")
        if (sh.writer[span] != -1).any():
            raise InterpError(f"race: ldmatrix %{ins.id} reads shared memory written with no barrier in between")
        sh.reader[span] = -2          # read by the warp: any write before the next barrier is a race
        out = np.zeros((self.n, count, 2), sh.data.dtype)
        t = np.arange(32)
        for w0 in range(0, self.n, 32):
            if not mask[w0]:
                continue
            rows = sh.data[ix[w0:w0 + 32, None] + np.arange(8)]          # [lane providing the row, 8]
            for q in range(count):
                m = rows[8 * q:8 * q + 8]
                for e in (0, 1):
                    out[w0:w0 + 32, q, e] = m[2 * (t % 4) + e, t // 4] if trans else m[t // 4, 2 * (t % 4) + e]
        return out

    def mma(self, ins: Instr, mask: np.ndarray) -> None:
        """PTX mma.sync.m16n8k16.row.col.f32: D = A (16x16) @ B (16x8) + C in float32, fragments as PTX
        lays them out (g = lane / 4, c = 2 (lane % 4)): a: (g, c), (g+8, c), (g, c+8), (g+8, c+8);
        b: (k c, n g), (k c+8, n g); c/d: (g, c), (g+8, c), two columns each."""
        a, b, *accs = ins.src
        shape, pair = ins.arg
        if shape in ("mfma_32x32x8", "wmma_16x16x16"):
            return self.amd_matrix(ins, mask)
        self.whole_warps(mask, f"mma %{ins.id}")
        if shape != "m16n8k16":
            raise InterpError(f"the interpreter has no mma shape {shape}")
        av, bv = self.val(a).astype(np.float32), self.val(b).astype(np.float32)
        t = np.arange(32)
        g, c = t // 4, 2 * (t % 4)
        for w0 in range(0, self.n, 32):
            if not mask[w0]:
                continue
            A, B, C = np.zeros((16, 16), np.float32), np.zeros((16, 8), np.float32), np.zeros((16, 8), np.float32)
            fa, fb = av[w0:w0 + 32], bv[w0:w0 + 32]
            for e in (0, 1):
                A[g, c + e], A[g + 8, c + e], A[g, c + 8 + e], A[g + 8, c + 8 + e] = (fa[:, r, e] for r in range(4))
                B[c + e, g], B[c + 8 + e, g] = fb[:, 2 * pair, e], fb[:, 2 * pair + 1, e]
                C[g, c + e] = self.accs[accs[e].id][w0:w0 + 32]
                C[g + 8, c + e] = self.accs[accs[2 + e].id][w0:w0 + 32]
            D = A @ B + C
            for e in (0, 1):
                self.accs[accs[e].id][w0:w0 + 32] = D[g, c + e]
                self.accs[accs[2 + e].id][w0:w0 + 32] = D[g + 8, c + e]

    # -- wgmma (sm_90a): a hardware model of descriptors and the 128-byte swizzle ---------------------------
    @staticmethod
    def swizzle128(byte: np.ndarray) -> np.ndarray:
        """The hardware's 128-byte swizzle of a byte offset from a 1024-byte-aligned array: address bits 4-6
        (the 16-byte chunk) xor bits 7-9 (the 128-byte row within 1024 bytes)."""
        return byte ^ (((byte >> 7) & 7) << 4)

    def operand(self, desc: Instr, start: int, rows: int, trans: int, itemsize: int) -> np.ndarray:
        """Element indices of a (rows x k) operand (A: rows = 64; B: rows = N; k: 32 bytes, 16 of 16-bit and 32
        of 8-bit types) read through a descriptor whose start element is `start`. K-major (trans 0): 8-row
        groups `stride` bytes apart, 128-byte rows, k along a row. MN-major (trans 1): 64-element atoms along
        rows `leading` bytes apart, 8-k groups `stride` bytes apart, 128-byte k rows."""
        _, lbo, sbo = self.descs[desc.id]
        r, kk = np.meshgrid(np.arange(rows), np.arange(32 // itemsize), indexing="ij")   # 32 bytes of k
        if trans:
            byte = (r // 64) * lbo + (kk // 8) * sbo + (kk % 8) * 128 + (r % 64) * itemsize
        else:
            byte = (r // 8) * sbo + (r % 8) * 128 + kk * itemsize
        byte = self.swizzle128(start * itemsize + byte)
        if (byte % itemsize).any():
            raise InterpError("wgmma: an operand element that is not element-aligned")
        return byte // itemsize

    def wgmma(self, ins: Instr, mask: np.ndarray) -> None:
        """wgmma.mma_async.m64nNk16.f32: D = A (64 x 16) @ B (16 x N) + D per warpgroup, operands from shared
        memory through descriptors; work-item l's registers 4 j + 2 h + e hold D[16 (l / 32) + (l % 32) / 4
        + 8 h][8 j + 2 (l % 4) + e]. The reads stay pending (a write to them is a race) and the accumulators
        busy (reading them is a race) until a wait covers the warpgroup's group."""
        self.whole_warps(mask, f"wgmma %{ins.id}", 128)
        da, db, *accs = ins.src
        n, _, ta, tb = ins.arg
        if len(accs) != n // 2:
            raise InterpError(f"wgmma %{ins.id}: {len(accs)} accumulators for N = {n}")
        shs = [self.shared[self.descs[d.id][0]] for d in (da, db)]
        l = np.arange(128)
        for g0 in range(0, self.n, 128):
            if not mask[g0]:
                continue
            wg = g0 // 128
            mats = []
            for d, sh, rows, tr in ((da, shs[0], 64, ta), (db, shs[1], n, tb)):
                st = self.val(d)[g0:g0 + 128]
                if (st != st[0]).any():
                    raise InterpError(f"wgmma %{ins.id}: a descriptor that differs across the warpgroup")
                ix = self.operand(d, int(st[0]), rows, tr, sh.data.itemsize)
                flat = ix.reshape(-1)
                self.check_bounds(-1, flat, sh.data.size, f"wgmma %{ins.id} from shared")
                if sh.pending[flat].any():
                    raise InterpError(f"race: wgmma %{ins.id} reads shared memory a cp.async has not landed in")
                if not sh.init[flat].all():
                    raise InterpError(f"wgmma %{ins.id} reads shared memory that nothing wrote")
                if (sh.writer[flat] != -1).any():
                    raise InterpError(f"race: wgmma %{ins.id} reads shared memory written with no barrier in between")
                if sh.unfenced[flat].any():
                    raise InterpError(f"wgmma %{ins.id} reads shared stores with no proxy fence after them")
                sh.reader[flat] = -2
                sh.wg_read[flat] = np.maximum(sh.wg_read[flat], self.wg_done[wg])
                self.wg_issued.append((wg, int(self.wg_done[wg]), [], sh, flat))
                mats.append(sh.data[ix].astype(np.float32))
            A, B = mats[0], mats[1].T                    # (64 x k), (k x n)
            rows = 16 * (l // 32) + (l % 32) // 4
            D = np.zeros((64, n), np.float32)
            for j in range(n // 8):
                for h in (0, 1):
                    for e in (0, 1):
                        D[rows + 8 * h, 8 * j + 2 * (l % 4) + e] = self.accs[accs[4 * j + 2 * h + e].id][g0:g0 + 128]
            D = A @ B + D
            for j in range(n // 8):
                for h in (0, 1):
                    for e in (0, 1):
                        acc = accs[4 * j + 2 * h + e]
                        self.accs[acc.id][g0:g0 + 128] = D[rows + 8 * h, 8 * j + 2 * (l % 4) + e]
                        self.acc_busy.setdefault(acc.id, np.zeros(self.n, bool))[g0:g0 + 128] = True

    def wg_sync(self, ins: Instr, mask: np.ndarray) -> None:
        what = ins.arg
        if what == "proxy":
            for sh in self.shared.values():
                sh.unfenced[:] = False
            return
        self.whole_warps(mask, f"wgmma {what} %{ins.id}", 128)
        groups = np.unique(np.flatnonzero(mask) // 128)
        if what == "commit":
            self.wg_done[groups] += 1
        elif isinstance(what, int):
            # every group of these warpgroups but their newest `what` is finished
            keep = []
            for rec in self.wg_issued:
                wg, grp, _, sh, flat = rec
                if wg in groups and grp < self.wg_done[wg] - what:
                    sh.wg_read[flat] = -1
                else:
                    keep.append(rec)
            for wg, grp, _, sh, flat in keep:         # reads of other warpgroups still pending
                sh.wg_read[flat] = np.maximum(sh.wg_read[flat], grp)
            self.wg_issued = keep
            for wg in groups:
                if not any(r[0] == wg for r in self.wg_issued):
                    for busy in self.acc_busy.values():
                        busy[wg * 128:(wg + 1) * 128] = False
        elif what != "fence":
            raise InterpError(f"unknown wg_sync {what!r}")

    def mbar(self, ins: Instr, mask: np.ndarray) -> None:
        """PTX mbarrier: init (expected arrivals), arrive (the lane's shared stores since the last barrier
        become visible to a lane whose wait sees the phase complete), cp.async arrive (the lane's copies not
        landed yet belong to the current phase, and land for a lane whose wait sees that phase complete) and wait on
        a phase parity. Lock step runs the roles of a warp-specialized loop one after the other, so a wait
        whose phase has not completed here is an error (the order would deadlock, or the parity is wrong)."""
        (op, count), (local, idx, *par) = ins.arg, ins.src
        ix = self.val(idx).astype(np.int64)
        lanes = np.flatnonzero(mask)
        if op == "init":
            for e in np.unique(ix[lanes]):
                self.mbars[(local.id, int(e))] = [count, count, 0, [], []]
            return
        pv = self.val(par[0]).astype(np.int64) if par else None
        for lane in lanes:
            key = (local.id, int(ix[lane]))
            bar = self.mbars.get(key)
            if bar is None:
                raise InterpError(f"mbarrier %{ins.id}: element {key[1]} used before its init")
            if op == "wait":
                if (bar[2] & 1) == pv[lane]:
                    raise InterpError(f"mbarrier %{ins.id}: lane {lane} waits for parity {pv[lane]} of element "
                                      f"{key[1]}, {bar[2]} phase(s) completed: it would block")
                if bar[2] == 0:
                    raise InterpError(f"mbarrier %{ins.id}: lane {lane} waits for parity 1 of element {key[1]} "
                                      f"before any phase completed: it would not wait")
                for sh, span in bar[4]:
                    flat = span.reshape(-1)
                    sh.writer[flat] = -1
                if not bar[4]:        # a release (plain arrivals): finished wgmma reads are ordered before
                    for sh in self.shared.values():
                        sh.reader[(sh.reader == -2) & (sh.wg_read == -1)] = -1
                continue
            if op == "cp_arrive":
                keep = []
                for rec in self.cp_pending:
                    sh, ls, group, span, vals = rec
                    mine = ls == lane
                    if mine.any():
                        bar[3].append([sh, span[mine], vals[mine]])
                    if not mine.all():
                        keep.append([sh, ls[~mine], group[~mine], span[~mine], vals[~mine]])
                self.cp_pending = keep
            elif op == "arrive":
                # a release: the lane's shared stores since the last barrier are visible to a lane whose wait
                # sees this phase complete
                for sh in self.shared.values():
                    span = np.flatnonzero(sh.writer == lane)
                    if span.size:
                        bar[3].append([sh, span, None])
            else:
                raise InterpError(f"unknown mbarrier operation {op!r}")
            bar[1] -= 1
            if bar[1] == 0:          # the phase completes: its copies land
                for sh, span, vals in bar[3]:
                    flat = span.reshape(-1)
                    if vals is not None:          # copies land (stores arrived with were made already)
                        sh.data[flat] = vals.reshape(-1)
                        sh.init[flat] = True
                        sh.unfenced[flat] = True
                        sh.pending[flat] = False
                    sh.writer[flat] = -2          # visible only to a lane whose wait sees this phase
                bar[4] = [(sh, span) for sh, span, _ in bar[3]]
                bar[3] = []
                bar[1] = bar[0]
                bar[2] += 1

    def wg_race(self, sh: "_Shared", span: np.ndarray, what: str) -> None:
        if (sh.wg_read[span] >= 0).any():
            raise InterpError(f"race: {what} writes shared memory an unfinished wgmma reads")
        sh.unfenced[span] = True

    def check_bounds(self, slot: int, ix: np.ndarray, size: int, what: str) -> None:
        if ix.size and (ix.min() < 0 or ix.max() >= size):
            raise InterpError(f"{what} buffer {slot} at [{ix.min()}, {ix.max()}] outside its {size} element(s) "
                              f"(group {self.group})")

    def load(self, ins: Instr, mask: np.ndarray) -> np.ndarray:
        buf, idx = ins.src
        width = ins.arg or 1
        ix = self.val(idx).astype(np.int64)
        lanes = np.flatnonzero(mask)
        span = (ix[lanes, None] + np.arange(width)).reshape(-1)   # every element the active lanes read
        who = np.repeat(lanes, width)
        if width > 1 and (ix[lanes] % width).any():
            raise InterpError(f"vector load %{ins.id} of {width} at an index that is not a multiple of {width}")
        if buf.kind is L.LOCAL:
            sh = self.shared[buf.id]
            self.check_bounds(-1, span, sh.data.size, f"load %{ins.id} from shared")
            if sh.pending[span].any():
                raise InterpError(f"race: load %{ins.id} reads shared memory a cp.async has not landed in")
            if not sh.init[span].all():
                raise InterpError(f"load %{ins.id} reads shared memory that nothing wrote")
            w = sh.writer[span]
            if ((w != -1) & (w != who)).any():
                raise InterpError(f"race: load %{ins.id} reads shared memory another work-item wrote with no "
                                  f"barrier in between")
            r = sh.reader[span]
            sh.reader[span] = np.where((r == -1) | (r == who), who, -2)
            data = sh.data
        else:
            data = self.bufs[buf.arg]
            self.check_bounds(buf.arg, span, data.size, f"load %{ins.id} from")
        out = np.zeros((self.n, width), data.dtype)
        out[lanes] = data[span].reshape(len(lanes), width)
        out = out.astype(_np(ins.dtype)) if ins.dtype.is_bool else out
        return out if ins.arg else out[:, 0]

    def store(self, ins: Instr, mask: np.ndarray) -> None:
        buf, idx, v = ins.src
        width = ins.arg or 1
        ix = self.val(idx).astype(np.int64)
        vv = self.val(v).reshape(self.n, width)
        lanes = np.flatnonzero(mask)
        span = (ix[lanes, None] + np.arange(width)).reshape(-1)
        who = np.repeat(lanes, width)
        vals = vv[lanes].reshape(-1)
        if width > 1 and (ix[lanes] % width).any():
            raise InterpError(f"vector store %{ins.id} of {width} at an index that is not a multiple of {width}")
        if buf.kind is L.LOCAL:
            sh = self.shared[buf.id]
            self.check_bounds(-1, span, sh.data.size, f"store %{ins.id} to shared")
            if len(np.unique(span)) != len(span):
                raise InterpError(f"race: store %{ins.id}: two work-items write one shared element")
            w, r = sh.writer[span], sh.reader[span]
            if ((w != -1) & (w != who)).any() or ((r != -1) & (r != who)).any() or sh.pending[span].any():
                raise InterpError(f"race: store %{ins.id} writes shared memory another work-item used with no "
                                  f"barrier in between")
            self.wg_race(sh, span, f"store %{ins.id}")
            sh.writer[span] = who
            sh.init[span] = True
            sh.data[span] = vals
        else:
            data = self.bufs[buf.arg]
            self.check_bounds(buf.arg, span, data.size, f"store %{ins.id} to")
            data[span] = vals.astype(data.dtype)
            np.add.at(self.writes[buf.arg], span, 1)


def _c_idiv(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    b = np.where(b == 0, 1, b)
    if a.dtype.kind == "u":
        return a // b
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q).astype(a.dtype)


def alu(op: Ops, dt: DType, a: list[np.ndarray], src_dts: list[DType]) -> np.ndarray:
    """One ALU op on lanes, with the semantics of the renderers: C-truncating integer division,
    wrapping integers, NaN-propagating float max/min."""
    out = _np(dt)
    x = a[0]
    if op is Ops.CAST:
        if dt.is_bool:
            return x != 0
        return x.astype(out)
    if op is Ops.BITCAST:
        return x.astype(_np(src_dts[0])).view(out)
    if op is Ops.WHERE:
        return np.where(a[0], a[1], a[2]).astype(out)
    unary = {Ops.EXP2: np.exp2, Ops.LOG2: np.log2, Ops.SQRT: np.sqrt, Ops.SIN: np.sin, Ops.TRUNC: np.trunc}
    if op in unary:
        return unary[op](x).astype(out)
    if op is Ops.RECIP:
        return (np.ones_like(x) / x).astype(out)
    if op is Ops.NEG:
        return (np.zeros_like(x) - x).astype(out)
    if op is Ops.NOT:
        return np.logical_not(x) if x.dtype == np.bool_ else np.invert(x)
    y = a[1]
    if op is Ops.ADD: r = x + y
    elif op is Ops.SUB: r = x - y
    elif op is Ops.MUL: r = x * y
    elif op is Ops.FDIV: r = x / y
    elif op in (Ops.IDIV, Ops.CDIV): r = _c_idiv(x, y)      # all four print as machine division
    elif op in (Ops.MOD, Ops.CMOD): r = x - _c_idiv(x, y) * np.where(y == 0, 1, y)
    elif op is Ops.MAX: r = (x | y) if x.dtype == np.bool_ else np.maximum(x, y)
    elif op is Ops.MIN: r = (x & y) if x.dtype == np.bool_ else np.minimum(x, y)
    elif op is Ops.CMPLT: r = x < y
    elif op is Ops.CMPEQ: r = x == y
    elif op is Ops.CMPNE: r = x != y
    elif op is Ops.AND: r = x & y
    elif op is Ops.OR: r = x | y
    elif op is Ops.XOR: r = x ^ y
    elif op is Ops.SHL: r = np.left_shift(x, y)
    elif op is Ops.SHR: r = np.right_shift(x, y)
    else:
        raise InterpError(f"the interpreter has no rule for {op}")
    return np.asarray(r).astype(out)


def run(kernel: LinearKernel, info, bufs: list[np.ndarray], values: Mapping[str, int] | None = None
        ) -> list[np.ndarray]:
    """Launch `kernel` over the grid its LaunchInfo gives for `values`, on flat numpy buffers (changed
    in place, after the same launch-time checks a device runs). Returns, per buffer, how many times
    each element was stored."""
    if not kernel.gpu:
        raise ValueError("the interpreter runs GPU kernels (work-groups and work-items)")
    vals = info.values_from(values or {})
    gs, ls, bounds, _ = info.prepare(vals)
    info.check_sizes(bounds, [b.size for b in bufs])
    all_bufs = list(bufs) + [np.zeros(h.count, _np(h.dtype)) for h in getattr(info, "hidden", ())]
    writes = [np.zeros(b.size, np.int64) for b in all_bufs]
    for z, y, x in itertools.product(range(gs[2]), range(gs[1]), range(gs[0])):
        _Group(kernel, all_bufs, writes, vals, (x, y, z)).run()
    return writes[:len(bufs)]
