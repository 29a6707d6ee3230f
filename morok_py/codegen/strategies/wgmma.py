"""Warpgroup tensor cores (NVIDIA sm_90a, PTX `wgmma.mma_async`): the tensor-core contraction of
strategies/tensor_core.py with the inner product issued by whole warpgroups from shared memory.

- The block is BM x BN outputs (BM a multiple of 64, BN of 64, at most 256), k walked 64 at a time; its
  BM / 64 warpgroups (128 work-items each) own 64 full-width rows each. Per 16 k a warpgroup issues one
  `wgmma.mma_async.m64n{BN}k16.f32` that reads both operands straight from shared memory through
  64-bit descriptors: no fragment loads, no registers but the float32 accumulators (BN / 2 per work-item,
  laid out like mma.sync's m16n8 C fragments, one 16-row slab per warp).
- Shared tiles use the hardware's 128-byte swizzle: every tile row is 128 bytes (64 halves), and 16-byte
  chunk c of row r sits at c ^ (r % 8) within 1024-byte atoms (the arrays start 1024-byte aligned,
  backends/cuda/renderer.py). An operand contiguous along k (row-major A, B^T) is [w][64] (K-major,
  descriptor stride 1024 bytes per 8 rows, a 16-k step is +32 bytes); one contiguous along its rows or
  columns is [w / 64][64 k][64 w] (MN-major, `trans` set: leading offset 64 * 128 bytes between 64-wide
  atoms, 1024 bytes per 8 k; a 16-k step is +2048 bytes).
- Warp specialization: the block has one more warpgroup, the producer (WG_PRODUCER work-items), which
  fills the tiles by cp.async 16-byte copies into S = the schedule's `tc_stages` >= 3 buffers (up to 227
  KiB of dynamic shared memory) while the consumer warpgroups multiply; they meet at mbarriers, not at
  block barriers: full[s] completes when the copies into buffer s landed (cp.async.mbarrier.arrive.noinc,
  one arrival per producer work-item), empty[s] when every consumer's wgmmas on it finished (one arrival
  per consumer warp). The
  consumers keep one group of wgmmas in flight while they wait for the next tile; the producer refills a
  buffer as soon as it is released, S - 1 tiles ahead (see `staged_loop`). Both roles branch inside one
  k loop (ptxas then keeps the wgmmas unserialized where their final wait is outside the branch), so
  the kernel runs under one register cap (64K / work-items: 168 for 384). Measured on an H200
  (benchmarks/results/nvidia-h200/tensor_cores-nvrtc.json, each row beside the same run's pipeline without
  the producer warpgroup): 4096^3 float16 628 TFLOP/s, 0.93x torch.matmul (before: 520, 0.80x), bfloat16
  644, 0.93x (529, 0.78x); symbolic 4096^3 0.70-0.75x (before 0.78x): the producer's clamped per-copy
  places and the symbolic strides spill (a 144-byte frame on nvrtc under the 168-register cap).
  Symbolic strides whose alignment is only known at launch keep the uniform branch of tensor_core.py:
  the pipeline when every size is a multiple of 8, else scalar fills tile by tile.
- Sizes stay arbitrary: rows and columns past the end are clamped, the k tail is zero-filled, and the
  epilogue and launch check are gpu_tile's.
- 1-byte operands (float8, strategies/wgmma_f8.py): 128-deep k tiles (one swizzled row), k32 steps, K-major
  only; an operand contiguous along its rows or columns is turned around by the producer (`fill_transposed`).
"""
from __future__ import annotations

from ...dtypes import dtypes
from ...ir import AxisType, Ops, UOp
from ..linear import If, Instr, Item, L, Loop
from .tensor_core import WG_BARS, WG_K, WG_PRODUCER, WG_ROWS, WG_SMEM, WGMMA, _MMABuilder, _Tile, wg_tile_ok  # noqa: F401

WG_TILE = (128, 256, 64, 64, 256)   # 2 warpgroups of 64 x 256 (128 accumulators a work-item)
WG_STAGES = 4                       # 4 x 48 KiB
WG_TILE_MID = (128, 128, 64, 64, 128)
WG_TILE_SMALL = (64, 128, 64, 64, 128)
# over at most 64 columns (N): 2 warpgroups of 64 x 64, the buffers 24 KiB a stage. The heuristic takes no
# block wider than N rounded up to 64 (WG_FIT_N): a 128x256 block over a convolution's 64 or 128 output
# channels (benchmarks/conv.py, im2col_rows and im2col_flat at 56x56x64 and 28x28x128, batch 32) computed
# 3/4 or 1/2 of its outputs past the end (H200, conv-variants-nvrtc.json: float16 28x28x128 im2col_flat
# 46.7 TFLOP/s, im2col_rows 43.6, beside 63.7 for the direct implicit GEMM)
WG_TILE_NARROW = (128, 64, 64, 64, 64)
WG_NARROW_STAGES = 8
WG_FIT_N = True
# (tile, stages) a search times
WG_CANDIDATES = [(WG_TILE, 4), (WG_TILE, 3), (WG_TILE_MID, 6), (WG_TILE_MID, 5), (WG_TILE_MID, 4),
                 ((256, 128, 64, 64, 128), 4), (WG_TILE_SMALL, 6),
                 ((128, 192, 64, 64, 192), 4), ((64, 256, 64, 64, 256), 4), (WG_TILE_NARROW, WG_NARROW_STAGES)]


WG_MIN_BLOCKS = 132             # blocks that fill an H100/H200 once (132 SMs): smaller problems take smaller tiles
# WG_TILE_MID from this many blocks: 98 blocks of 128x128 beat 196 of 64x128 over a convolution's columns
# (benchmarks/conv.py --variants, batch 32, float16 3x3 256 channels at 14x14 and stride 2 at 28x28: 6272 x 256;
# H100, benchmarks/results/nvidia-h100/conv-nvrtc.json: 101.6 against 92.4 TFLOP/s and 91.6 against 84.0;
# H200, nvidia-h200/conv-variants-nvrtc.json: 86.1 against 79.2, 81.1 against 74.2); 52 blocks (512 channels at
# 7x7) lost to 100 of 64x128 (103.8 against 125.1 on the H100)
WG_MID_MIN_BLOCKS = 96


def choose_wg_tile(ast: UOp, caps, scan) -> tuple[tuple[int, int, int, int, int], int] | None:
    """The heuristic warpgroup (tile, stages): 128x256 blocks 4 deep; for constant extents, the first of
    128x256, 128x128 (6 deep) and 64x128 no wider than N rounded up to 64 (WG_FIT_N) that makes
    WG_MIN_BLOCKS blocks (128x128: WG_MID_MIN_BLOCKS; else the last of them; over at most 64 columns
    WG_TILE_NARROW); None where the kernel takes none (no 16-byte fills, or under 64 rows or columns: tensor_core.py's tiles)."""
    from .tensor_core import WGMMA, tc_plan
    plan = tc_plan(ast, caps, scan, WG_TILE, WG_STAGES, True, WGMMA)
    if plan is None:
        return None
    M, N = plan.i.src[0], plan.j.src[0]
    if M.op is not Ops.CONST or N.op is not Ops.CONST:
        return WG_TILE, WG_STAGES
    if min(M.arg, N.arg) < 64:
        return None
    order = [(WG_TILE, WG_STAGES), (WG_TILE_MID, 6), (WG_TILE_SMALL, 6)]
    if WG_FIT_N:
        order = [(t, s) for t, s in order if t[1] <= -(-N.arg // 64) * 64] or [(WG_TILE_NARROW, WG_NARROW_STAGES)]
    for tile, stages in order:
        least = WG_MID_MIN_BLOCKS if tile == WG_TILE_MID else WG_MIN_BLOCKS
        if -(-M.arg // tile[0]) * -(-N.arg // tile[1]) >= least:
            return tile, stages
    return order[-1]


class _WGMMABuilder(_MMABuilder):
    """tensor_core.py's kernel skeleton (grid, clamped fills, cp.async passes, epilogue) with warpgroup
    instructions; `warp` and `lane` of the base are the warpgroup and the work-item within it. The last
    warpgroup is the producer: its full-tile passes are made for WG_PRODUCER work-items (`ptid`); the
    scalar passes (k tail, unaligned sizes) stay the whole group's."""

    mma = WGMMA

    def build(self):
        if self.stages < 3 or not self.swizzle:
            raise ValueError("the warpgroup form needs >= 3 cp.async stages in the swizzled layout")
        self.consumers = self.p.tile[0] // WG_ROWS * 128      # work-items of the consumer warpgroups
        # element bytes of the operands, elements a 16-byte copy moves and k one wgmma takes (32 bytes a row:
        # k16 for 16-bit types, k32 for 8-bit ones, strategies/wgmma_f8.py)
        self.esize = next(iter(self.p.units)).dtype.itemsize
        self.vec, self.ks = 16 // self.esize, 32 // self.esize
        if self.p.tile[2] * self.esize != 128:
            raise ValueError("the warpgroup form's k tile is one 128-byte swizzled row")
        kernel, info = super().build()
        if not self.staged:
            raise ValueError("the warpgroup form needs 16-byte (cp.async) fills of both tiles")
        # two blocks a SM where their shared memory fits and 64K registers / (2 x work-items) hold the
        # accumulators and addresses, else one
        smem = sum(self.stages * t.size * self.esize for t in self.tiles) + WG_BARS
        kernel.min_groups = 2 if 2 * smem <= WG_SMEM and 65536 // (2 * self.T) >= len(self.wg_accs) + 40 else 1
        return kernel, info

    def tile(self, unit: UOp, kind: str, width: int, tid: Instr, top: list[Item]) -> _Tile:
        """tensor_core.py's tile, its 16-byte passes for the producer's WG_PRODUCER work-items."""
        if not hasattr(self, "ptid"):
            self.ptid = self.op(top, Ops.MOD, tid, self.c(WG_PRODUCER))
        T, self.T = self.T, WG_PRODUCER
        try:
            t = super().tile(unit, kind, width, self.ptid, top) if self.esize == 2 else \
                self.byte_tile(unit, kind, width, self.ptid, top)
        finally:
            self.T = T
        t.transposed = getattr(t, "transposed", False)
        fast = self.p.fast.get(unit, "k")
        fill = self.fill_passes if t.kmajor else self.fill_passes_along_k
        t.make_passes = lambda out, t=t, width=width, fast=fast: fill(t, width, fast, 1, tid, out)
        t.prod = self.producer_passes(t, width, top) if t.vpasses and not t.transposed else None
        return t

    def byte_tile(self, unit: UOp, kind: str, width: int, tid: Instr, top: list[Item]) -> _Tile:
        """tensor_core.py's tile for 1-byte operands, which are K-major only ([width][128], one swizzled row
        of k each): 16-element (16-byte) passes where the strides prove 16-element runs aligned."""
        from ..gpu_tile import _Pass, _vector_aligned
        smem = self.new(L.LOCAL, unit.dtype, (), width * self.BK)
        top.append(smem)
        t = _Tile(unit, kind, smem, self.BK, width * self.BK)
        t.kmajor = False
        t.make_passes = lambda out, t=t, width=width: self.fill_passes_along_k(t, width, "k", 1, tid, out)
        t.vcond = []
        t.transposed = self.p.fast.get(unit, "k") != "k"
        if t.transposed:
            # contiguous along its rows (columns): `fill_transposed` turns 16 x 16 blocks around in registers;
            # one marker pass makes the tile staged (its place, swizzled by the builder, is unused)
            t.width = width
            t.vpasses = [_Pass(None, self.c(0), self.c(0), None, self.vec, "k")]
            return t
        aligned = unit.op is Ops.LOAD and _vector_aligned(unit.src[1], self.p.k, self.vec)
        t.vpasses = self.fill_passes_along_k(t, width, "k", self.vec, tid, top) if aligned else []
        return t

    def fill_transposed(self, out: list[Item], t: _Tile, k0: Instr, off: Instr | None,
                        k_rem: Instr | None = None) -> None:
        """The producer's fill of a 1-byte tile whose operand is contiguous along its rows (columns) -- B [K, N]
        row-major: 8-bit wgmma operands must be K-major. Work-item q (of 8 * width / 16) takes the 16 x 16
        block of k 16 (q % 8) .. + 16 and rows (columns) 16 (q / 8) .. + 16 in four turns of 4 k: four
        16-byte loads along the rows, then per row one 4-byte word of its 4 k (bytes gathered from the four
        loads) stored into the swizzled K-major tile. Four turns keep 16 registers of loads live: the
        consumers' accumulators hold the rest of the register cap. Consecutive work-items take the 8 k
        blocks of one 128-byte row, whose 16-byte chunks the swizzle spreads over 8 bank groups. With `k_rem`
        (the tail; a multiple of 16): blocks at k >= k_rem store zeros."""
        from ..gpu_tile import _terms
        from ..symbolic import simplify
        p = self.p
        nblk = 8 * (t.width // 16)
        blk = out
        if nblk < WG_PRODUCER:
            g = If(self.op(out, Ops.CMPLT, self.ptid, self.c(nblk)))
            out.append(g)
            blk = g.body
        kb = self.op(blk, Ops.MOD, self.ptid, self.c(8))
        wb = self.op(blk, Ops.MUL, self.op(blk, Ops.IDIV, self.ptid, self.c(8)), self.c(16))
        var = p.i if t.kind == "A" else p.j
        sk = simplify(_terms(t.unit.src[1])[p.k])             # the k stride: a constant (wgmma_f8.f8_plan)
        kc = self.op(blk, Ops.ADD, k0, self.op(blk, Ops.MUL, kb, self.c(16)))
        memo: dict[UOp, Instr] = {}
        env = {**self.bind, p.k: kc, var: self.clamped(blk, t.kind, wb, 16)}
        g0 = self.expr(t.unit.src[1], env, blk, memo)
        buf = self.expr(t.unit.src[0], env, blk, memo)
        base = self.op(blk, Ops.MUL, wb, self.c(self.BK))          # row wb of the tile
        if off is not None:
            base = self.op(blk, Ops.ADD, base, off)
        # row r's 16-byte chunk kb sits at chunk kb ^ (r % 8) = kb ^ (w % 8) (rows 16 apart share it)
        chunk = [self.op(blk, Ops.MUL, self.op(blk, Ops.XOR, kb, self.c(w)), self.c(16)) if w else
                 self.op(blk, Ops.MUL, kb, self.c(16)) for w in range(8)]
        if k_rem is not None:
            k16 = self.op(blk, Ops.MUL, kb, self.c(16))
            zeros = If(self.op(blk, Ops.CMPLT, self.op(blk, Ops.SUB, k_rem, self.c(1)), k16))
            blk.append(zeros)
            zero = self.zero_vector(zeros.body, t.unit.dtype, 4)
            for turn in range(4):
                for w in range(16):
                    at = self.op(zeros.body, Ops.ADD, base, self.c(w * self.BK + 4 * turn))
                    zeros.body.append(self.new(L.STORE, None, (t.smem, self.op(zeros.body, Ops.ADD, at, chunk[w % 8]),
                                                               zero), 4))
            live = If(self.op(blk, Ops.CMPLT, k16, k_rem))
            blk.append(live)
            blk = live.body
        for turn in range(4):
            rows = []
            for e in range(4):
                d = (4 * turn + e) * int(sk.arg)
                gi = self.op(blk, Ops.ADD, g0, self.c(d)) if d else g0
                v = self.new(L.LOAD, t.unit.dtype, (buf, gi), 16)
                blk.append(v)
                rows.append(v)
            for w in range(16):
                lanes = [self.new(L.EXTRACT, t.unit.dtype, (rows[e],), w) for e in range(4)]
                word = self.new(L.VECTOR, t.unit.dtype, tuple(lanes))
                at = self.op(blk, Ops.ADD, base, self.c(w * self.BK + 4 * turn))
                sidx = self.op(blk, Ops.ADD, at, chunk[w % 8])
                blk += lanes + [word, self.new(L.STORE, None, (t.smem, sidx, word), 4)]

    def zero_vector(self, out: list[Item], dt, width: int) -> Instr:
        z = self.leaf(L.CONST, dt, 0.0)
        v = self.new(L.VECTOR, dt, (z,) * width)
        out.append(v)
        return v

    def padded_tail(self, work: list[Item], K: Instr, k_full: Instr) -> None:
        """1-byte operands whose k extent is a constant multiple of 16 (so is the tail's k_rem): the producer
        fills the tail tile in 16-byte runs -- cp.async along k, the transposed fill along rows (columns) --
        and zeros past k_rem (whole runs), instead of tensor_core.py's element-by-element fill by every
        work-item (a 32 KiB B tile is 86 scalar loads a work-item). Else tensor_core.py's tail."""
        Ke = self.p.k.src[0]
        if self.esize != 1 or not self.staged or Ke.op is not Ops.CONST or Ke.arg % 16:
            return super().padded_tail(work, K, k_full)
        tail = If(self.op(work, Ops.CMPLT, k_full, K))
        work.append(tail)
        tb = tail.body
        k_rem = self.op(tb, Ops.SUB, K, k_full)
        pro = self.role(tb, producer=True)
        for t in self.tiles:
            if t.transposed:
                self.fill_transposed(pro.body, t, k_full, None, k_rem)
            else:
                self.fill_rows_tail(pro.body, t, k_full, k_rem)
        pro.body += [self.new(L.CP_COMMIT, None), self.new(L.CP_WAIT, None, (), 0)]
        tb += self.stores_visible()
        self.tail_steps(tb, k_rem)

    def fill_rows_tail(self, out: list[Item], t: _Tile, k0: Instr, k_rem: Instr) -> None:
        """The tail tile of a K-major 1-byte operand into buffer 0: the producer's 16-byte passes (one k chunk
        lk0 per work-item, t.prod), cp.async where lk0 < k_rem, zeros elsewhere."""
        lk0, lw0, swz0, passes = t.prod
        zeros = If(self.op(out, Ops.CMPLT, self.op(out, Ops.SUB, k_rem, self.c(1)), lk0))
        live = If(self.op(out, Ops.CMPLT, lk0, k_rem))
        out += [zeros, live]
        zero = self.zero_vector(zeros.body, t.unit.dtype, 16)
        kc = self.op(live.body, Ops.ADD, k0, lk0)
        for dk, dw, ds in passes:
            sz = self.op(zeros.body, Ops.ADD, swz0, self.c(ds)) if ds else swz0
            zeros.body.append(self.new(L.STORE, None, (t.smem, sz, zero), 16))
            sidx = self.op(live.body, Ops.ADD, swz0, self.c(ds)) if ds else swz0
            w = self.clamped(live.body, t.kind, self.op(live.body, Ops.ADD, lw0, self.c(dw)) if dw else lw0)
            self.copy(live.body, t, self.op(live.body, Ops.ADD, kc, self.c(dk)) if dk else kc, w, sidx)

    def arrivals(self) -> int:
        """Arrivals per producer work-item on a stage's full barrier: one when its cp.async copies land, one
        after its shared stores (transposed fills)."""
        return int(any(not t.transposed for t in self.tiles)) + int(any(t.transposed for t in self.tiles))

    def producer_arrive(self, out: list[Item], stage: Instr) -> None:
        """The producer's arrivals on full[stage] after filling it: cp.async arrival (counted when the copies
        land); after shared stores, the proxy fence (wgmma reads through the async proxy) and a plain arrival."""
        if any(not t.transposed for t in self.tiles):
            self.mbar(out, "cp_arrive", stage)
        if any(t.transposed for t in self.tiles):
            out.append(self.new(L.WG_SYNC, None, (), "proxy"))
            self.mbar(out, "arrive", stage)

    def producer_passes(self, t: _Tile, width: int, top: list[Item]):
        """The producer's 16-byte copies of a full tile as one base place and constant offsets that keep the
        swizzle (whole 8-row groups, whole 64-wide atoms): (lk0, lw0, swizzled base, [(dk, dw, offset)]),
        or None (a 192-wide MN-major tile: tensor_core.py's passes). One base register instead of one per
        pass: the producer runs under the consumers' 168-register cap, where 24 hoisted places spilled."""
        P, BK = WG_PRODUCER, self.BK
        if t.kmajor:                       # [BK][width] -> [width / 64][BK][64]: C columns x R k rows a pass
            C = 128 if width % 128 == 0 else 64 if width == 64 else 0
            if not C:
                return None
            per = C // 8
            R = P // per
            lw0 = self.op(top, Ops.MUL, self.op(top, Ops.MOD, self.ptid, self.c(per)), self.c(8))
            lk0 = self.op(top, Ops.IDIV, self.ptid, self.c(per))
            raw0 = self.op(top, Ops.ADD, self.op(top, Ops.MUL, lk0, self.c(t.ld)), lw0)
            passes = [(rb * R, cb * C, (cb * C // 64) * BK * 64 + rb * R * 64)
                      for cb in range(width // C) for rb in range(BK // R)]
        else:                              # [width][BK]: 16 rows of 8 16-byte chunks a pass
            per = BK // self.vec
            R = P // per
            lk0 = self.op(top, Ops.MUL, self.op(top, Ops.MOD, self.ptid, self.c(per)), self.c(self.vec))
            lw0 = self.op(top, Ops.IDIV, self.ptid, self.c(per))
            raw0 = self.op(top, Ops.ADD, self.op(top, Ops.MUL, lw0, self.c(t.ld)), lk0)
            passes = [(0, rb * R, rb * R * t.ld) for rb in range(width // R)]
        return lk0, lw0, self.swizzled(t, raw0, top), passes

    def fill_async(self, out: list[Item], k0: Instr, stage: "int | Instr") -> None:
        """The producer's cp.async of the full tiles at k0 into buffer `stage` (tensor_core.py's passes for a
        tile without producer_passes). Global places are the first pass's plus constants where the
        strides are constants and no row or column is clamped, else each pass's own."""
        from ..gpu_tile import _terms
        from ..symbolic import simplify
        p = self.p
        for t in self.tiles:
            off = (self.c(stage * t.size) if stage else None) if isinstance(stage, int) else \
                self.op(out, Ops.MUL, stage, self.c(t.size))
            if t.transposed:
                self.fill_transposed(out, t, k0, off)
                continue
            if t.prod is None:
                for ps in t.vpasses:
                    blk = out
                    if ps.guard is not None:
                        g = If(ps.guard)
                        out.append(g)
                        blk = g.body
                    self.copy(blk, t, self.op(blk, Ops.ADD, k0, ps.lk), ps.w,
                              self.op(blk, Ops.ADD, ps.sidx, off) if off is not None else ps.sidx)
                continue
            lk0, lw0, swz0, passes = t.prod
            base = self.op(out, Ops.ADD, swz0, off) if off is not None else swz0
            var = p.i if t.kind == "A" else p.j
            ext = var.src[0]
            form = _terms(t.unit.src[1]) or {}
            sk, sw = (simplify(form[v]) if v in form else None for v in (p.k, var))
            const = (ext.op is Ops.CONST and ext.arg % (p.tile[0] if t.kind == "A" else p.tile[1]) == 0
                     and sk is not None and sw is not None and sk.op is Ops.CONST and sw.op is Ops.CONST)
            span = 8 if t.kmajor else 1
            kc0 = self.op(out, Ops.ADD, k0, lk0)
            if const:
                memo: dict[UOp, Instr] = {}
                env = {**self.bind, p.k: kc0, var: self.clamped(out, t.kind, lw0, span)}
                g0 = self.expr(t.unit.src[1], env, out, memo)
                buf = self.expr(t.unit.src[0], env, out, memo)
            for dk, dw, ds in passes:
                sidx = self.op(out, Ops.ADD, base, self.c(ds)) if ds else base
                if const:
                    d = dk * int(sk.arg) + dw * int(sw.arg)
                    gidx = self.op(out, Ops.ADD, g0, self.c(d)) if d else g0
                    out.append(self.new(L.CP_ASYNC, None, (t.smem, sidx, buf, gidx), 16))
                    continue
                kc = self.op(out, Ops.ADD, kc0, self.c(dk)) if dk else kc0
                w = self.clamped(out, t.kind, self.op(out, Ops.ADD, lw0, self.c(dw)) if dw else lw0, span)
                self.copy(out, t, kc, w, sidx)

    def copy(self, out: list[Item], t: _Tile, kc: Instr, w: Instr, sidx: Instr) -> None:
        """One 16-byte cp.async of unit t at k = kc, row (column) w into shared place sidx."""
        p = self.p
        env = {**self.bind, p.k: kc, (p.i if t.kind == "A" else p.j): w}
        memo: dict[UOp, Instr] = {}
        gidx = self.expr(t.unit.src[1], env, out, memo)
        buf = self.expr(t.unit.src[0], env, out, memo)
        out.append(self.new(L.CP_ASYNC, None, (t.smem, sidx, buf, gidx), 16))

    def clamped(self, out: list[Item], kind: str, local: Instr, span: int = 1) -> Instr:
        """gpu_tile's clamped row (column), unclamped where the extent is a constant multiple of the block:
        one base register and constant offsets serve all the producer's passes (it runs under the
        consumers' register cap)."""
        ext = (self.p.i if kind == "A" else self.p.j).src[0]
        if ext.op is Ops.CONST and ext.arg % self.p.tile[0 if kind == "A" else 1] == 0:
            return self.op(out, Ops.ADD, self.side[kind][0], local)
        return super().clamped(out, kind, local, span)

    def role(self, out: list[Item], producer: bool) -> If:
        """An If (appended to out) that the producer warpgroup, or the consumer warpgroups, take."""
        cond = (self.op(out, Ops.CMPLT, self.c(self.consumers - 1), self.tid) if producer
                else self.op(out, Ops.CMPLT, self.tid, self.c(self.consumers)))
        g = If(cond)
        out.append(g)
        return g

    def mbar(self, out: list[Item], op: str, idx: Instr, parity: Instr | None = None, count: int = 0) -> None:
        src = (self.bars, idx) if parity is None else (self.bars, idx, parity)
        out.append(self.new(L.MBAR, None, src, (op, count)))

    # the hardware's 128-byte swizzle over [w][64] (K-major) or [w / 64][BK][64] (MN-major) tiles --------
    def phys(self, t: _Tile, sidx: Instr, out: list[Item]) -> Instr:
        """The unswizzled place of element `sidx` (row * ld + column of the logical tile)."""
        if not t.kmajor:
            return sidx                                  # [w][64]: ld = 64, already 128-byte rows
        k = self.op(out, Ops.IDIV, sidx, self.c(t.ld))
        w = self.op(out, Ops.MOD, sidx, self.c(t.ld))
        atom = self.op(out, Ops.MUL, self.op(out, Ops.IDIV, w, self.c(64)), self.c(self.BK * 64))
        return self.op(out, Ops.ADD, atom, self.op(out, Ops.ADD, self.op(out, Ops.MUL, k, self.c(64)),
                                                    self.op(out, Ops.MOD, w, self.c(64))))

    def swizzled(self, t: _Tile, sidx: Instr, out: list[Item]) -> Instr:
        """Element `sidx`'s place under the 128-byte swizzle: 128-byte rows of 128 / esize elements, 16-byte
        chunks of `vec`."""
        at = self.phys(t, sidx, out)
        row = self.op(out, Ops.MOD, self.op(out, Ops.IDIV, at, self.c(128 // self.esize)), self.c(8))
        chunk = self.op(out, Ops.MOD, self.op(out, Ops.IDIV, at, self.c(self.vec)), self.c(8))
        moved = self.op(out, Ops.XOR, chunk, row)
        return self.op(out, Ops.ADD, at, self.op(out, Ops.MUL, self.op(out, Ops.SUB, moved, chunk), self.c(self.vec)))

    # accumulators, descriptors ------------------------------------------------------------------------
    def fragments(self, top: list[Item], lane: Instr, wm0: Instr, wn0: Instr) -> None:
        """Work-item l of a warpgroup holds D rows 16 (l / 32) + (l % 32) / 4 (+ 8) and columns
        8 j + 2 (l % 4) (+ 1): PTX register 4 j + 2 h + e is accs[h][2 j + e]."""
        BN = self.p.tile[1]
        self.accs = [[self.new(L.ACC, dtypes.float32, (), 0.0) for _ in range(BN // 4)] for _ in range(2)]
        top.extend(a for row in self.accs for a in row)
        self.wg_accs = [self.accs[h][2 * j + e] for j in range(BN // 8) for h in (0, 1) for e in (0, 1)]
        self.offs = {"A": [0, 8], "B": [8 * (cc // 2) + cc % 2 for cc in range(BN // 4)]}
        w4 = self.op(top, Ops.IDIV, lane, self.c(32))
        l32 = self.op(top, Ops.MOD, lane, self.c(32))
        self.first = {"A": self.op(top, Ops.ADD, self.op(top, Ops.ADD, wm0, self.op(top, Ops.MUL, w4, self.c(16))),
                                   self.op(top, Ops.IDIV, l32, self.c(4))),
                      "B": self.op(top, Ops.MUL, self.op(top, Ops.MOD, l32, self.c(4)), self.c(2))}
        # the warpgroup's own rows of A: elements from a buffer's start (64 rows of 64 k, or atom wm0 / 64)
        self.wg_base = {t.kind: (self.op(top, Ops.MUL, wm0, self.c(self.BK)) if t.kind == "A" else None)
                        for t in self.tiles}
        # the pipeline's mbarriers: full[s] (s < S: the producer's copies of buffer s landed, WG_PRODUCER
        # arrivals) and empty[S + s] (every consumer warp finished reading buffer s), set up by work-item 0
        S = self.stages
        self.bars = self.new(L.LOCAL, dtypes.uint64, (), 2 * S)
        top.append(self.bars)
        first = If(self.op(top, Ops.CMPLT, self.tid, self.c(1)))
        top.append(first)
        for s in range(S):
            self.mbar(first.body, "init", self.c(s), count=WG_PRODUCER * self.arrivals())
            self.mbar(first.body, "init", self.c(S + s), count=self.consumers // 32)
        top.append(self.new(L.BARRIER, None))

    def descs(self, out: list[Item], rd: dict[str, Instr | None], step: int) -> list[Instr]:
        """The A and B descriptors of k step `step` (`ks` k, 32 bytes a row) of the buffers at element offsets rd."""
        got = []
        for t in self.tiles:
            base = self.wg_base[t.kind]
            # K-major: a step is ks elements (32 bytes) along the 128-byte row; MN-major: 16 rows of 64 elements
            const = self.ks * step * (64 if t.kmajor else 1)
            idx = base
            if rd.get(t.kind) is not None:
                idx = rd[t.kind] if idx is None else self.op(out, Ops.ADD, idx, rd[t.kind])
            if const:
                idx = self.c(const) if idx is None else self.op(out, Ops.ADD, idx, self.c(const))
            idx = self.c(0) if idx is None else idx
            lbo, sbo = (self.BK * 128, 1024) if t.kmajor else (16, 1024)
            d = self.new(L.SMEM_DESC, dtypes.uint64, (t.smem, idx), (lbo, sbo))
            out.append(d)
            got.append(d)
        return got

    def wg_steps(self, out: list[Item], rd: dict[str, Instr | None], steps: int, wait: int,
                 guard: Instr | None = None) -> None:
        """fence; `steps` wgmmas of `ks` k on the buffers at rd (step s >= 1 under `s * ks < guard` when a
        guard is given: the tail); commit; wait until at most `wait` groups are pending."""
        out.append(self.new(L.WG_SYNC, None, tuple(self.wg_accs), "fence"))
        names = tuple(t.smem.dtype.name for t in self.tiles)
        ab = names[0] if names[0] == names[1] else names      # a pair: mixed 8-bit operands
        trans = {t.kind: int(t.kmajor) for t in self.tiles}
        for s in range(steps):
            blk = out
            if guard is not None and s:
                g = If(self.op(out, Ops.CMPLT, self.c(self.ks * s), guard))
                out.append(g)
                blk = g.body
            da, db = self.descs(blk, rd, s)
            blk.append(self.new(L.WGMMA, None, (da, db, *self.wg_accs),
                                (self.p.tile[1], ab, trans["A"], trans["B"])))
        out.append(self.new(L.WG_SYNC, None, (), "commit"))
        out.append(self.new(L.WG_SYNC, None, tuple(self.wg_accs), wait))

    # the k loops --------------------------------------------------------------------------------------
    def staged_loop(self, work: list[Item], K: Instr) -> None:
        """Full tiles through S buffers: the producer warpgroup fills tile u into buffer u % S by cp.async
        (each copy arrives on full[u % S] when it lands) once the consumers released the tile there before;
        the consumer warpgroups wait for full, multiply, and release a buffer when its wgmmas finished.
        Both roles turn one loop, tile t per turn (so the turns also run in lock step, one valid order):

            producer: fill tiles 0 .. S-1
            for tile t:  consumers: wait full[t % S] (parity t / S); proxy fence; 4 wgmmas on buffer t % S;
                                    commit; wait until <= 1 group is pending (tile t-1's finished);
                                    lane 0 of each warp arrives on empty[(t-1) % S]
                         producer:  wait empty[(t-1) % S] (parity (t-1) / S); fill tile t-1+S there
            consumers: wait for every group; barrier; the zero-padded k tail

        The consumers never wait for a copy they did not need yet nor meet the producer at a barrier
        inside the loop; a refill starts as soon as the buffer is released (S-1 tiles ahead)."""
        BK, S, zero = self.BK, self.stages, self.c(0)
        steps = BK // self.ks
        k_full = self.op(work, Ops.SUB, K, self.op(work, Ops.MOD, K, self.c(BK)))
        from ..launch_check import SteppedLoop
        Ke = self.p.k.src[0]
        self.stepped = [SteppedLoop(Ke - Ke % BK, UOp.const(BK, dtypes.index), UOp.const(0, dtypes.index))]
        full = If(self.op(work, Ops.CMPLT, zero, k_full))
        work.append(full)
        fb = full.body
        pro = self.role(fb, producer=True)
        for s in range(S):
            blk = pro.body
            if s:
                g = If(self.op(blk, Ops.CMPLT, self.c(s * BK), k_full))
                blk.append(g)
                blk = g.body
            self.fill_async(blk, self.c(s * BK), s)
            self.producer_arrive(blk, self.c(s))
        main = Loop(self.new(L.LOOPVAR, dtypes.index), zero, k_full, AxisType.REDUCE, step=self.c(BK))
        fb.append(main)
        lb = main.body
        t_now = self.op(lb, Ops.IDIV, main.var, self.c(BK))
        con = self.role(lb, producer=False)
        cb = con.body
        stage = self.op(cb, Ops.MOD, t_now, self.c(S))
        self.mbar(cb, "wait", stage, self.op(cb, Ops.MOD, self.op(cb, Ops.IDIV, t_now, self.c(S)), self.c(2)))
        cb.append(self.new(L.WG_SYNC, None, (), "proxy"))
        rd = {t.kind: self.op(cb, Ops.MUL, stage, self.c(t.size)) for t in self.tiles}
        self.wg_steps(cb, rd, steps, 1)
        # lane 0 of each consumer warp releases the buffer of tile t-1 (its warpgroup's wgmmas on it finished:
        # wgmma groups complete for the whole warpgroup): 8 arrivals a tile instead of 256 on one word
        released = If(self.op(cb, Ops.CMPLT, zero, t_now))
        cb.append(released)
        lead = If(self.op(released.body, Ops.CMPLT, self.op(released.body, Ops.MOD, self.tid, self.c(32)), self.c(1)))
        released.body.append(lead)
        rb = lead.body
        prev = self.op(rb, Ops.SUB, t_now, self.c(1))
        self.mbar(rb, "arrive", self.op(rb, Ops.ADD, self.op(rb, Ops.MOD, prev, self.c(S)), self.c(S)))
        pro = self.role(lb, producer=True)
        later = If(self.op(pro.body, Ops.CMPLT, zero, t_now))
        pro.body.append(later)
        kp = self.op(later.body, Ops.ADD, main.var, self.c((S - 1) * BK))
        g = If(self.op(later.body, Ops.CMPLT, kp, k_full))
        later.body.append(g)
        pb = g.body
        prev = self.op(pb, Ops.SUB, t_now, self.c(1))
        sp = self.op(pb, Ops.MOD, prev, self.c(S))
        self.mbar(pb, "wait", self.op(pb, Ops.ADD, sp, self.c(S)),
                  self.op(pb, Ops.MOD, self.op(pb, Ops.IDIV, prev, self.c(S)), self.c(2)))
        self.fill_async(pb, kp, sp)
        self.producer_arrive(pb, sp)
        # every warpgroup (the producer has nothing pending): in a branch, ptxas serializes the wgmmas (C7518)
        fb += [self.new(L.WG_SYNC, None, tuple(self.wg_accs), 0), self.new(L.BARRIER, None)]
        self.padded_tail(work, K, k_full)

    # the synchronous loop and the zero-padded tail (tensor_core.py's) with the proxy fence and wgmmas,
    # which only the consumer warpgroups issue
    def stores_visible(self) -> list[Item]:
        return [self.new(L.WG_SYNC, None, (), "proxy"), self.new(L.BARRIER, None)]

    def full_tile_steps(self, out: list[Item]) -> None:
        self.wg_steps(self.role(out, producer=False).body, {}, self.BK // self.ks, 0)

    def tail_steps(self, out: list[Item], k_rem: Instr) -> None:
        self.wg_steps(self.role(out, producer=False).body, {}, self.BK // self.ks, 0, guard=k_rem)

    def main_loop(self, work: list[Item], K: Instr) -> None:
        raise ValueError("the warpgroup form has no register-staged loop")

    def epilogue(self, top: list[Item]) -> None:
        """gpu_tile's epilogue, for the consumers (the producer holds no results), each column's place
        computed under its row (not 128 places live at once: they spilled under the 168-register cap); a
        work-item's two adjacent columns 8 j + 2 (l % 4) + {0, 1} stored as one 4-byte (float32: 8-byte) vector
        where `paired_columns` holds."""
        body = self.role(top, producer=False).body
        p = self.p
        buf, out_idx, val = p.store.src
        row0, rem_m = self.side["A"][:2]
        col0, rem_n = self.side["B"][:2]
        width = 2 if self.paired_columns() else 1
        for r, off in enumerate(self.offs["A"]):
            lr = self.op(body, Ops.ADD, self.first["A"], self.c(off)) if off else self.first["A"]
            row_if = If(self.op(body, Ops.CMPLT, lr, rem_m))
            body.append(row_if)
            i_val = self.op(row_if.body, Ops.ADD, row0, lr)
            for cc in range(0, len(self.offs["B"]), width):
                off = self.offs["B"][cc]
                lc = self.op(row_if.body, Ops.ADD, self.first["B"], self.c(off)) if off else self.first["B"]
                col_if = If(self.op(row_if.body, Ops.CMPLT, lc, rem_n))   # paired: lc even, N even: lc + 1 < N
                row_if.body.append(col_if)
                blk = col_if.body
                j0 = self.op(blk, Ops.ADD, col0, lc)
                vals = []
                for e in range(width):
                    j = self.op(blk, Ops.ADD, j0, self.c(1)) if e else j0
                    acc_v = self.new(L.ACC_LOAD, self.accs[r][cc + e].dtype, (self.accs[r][cc + e],))
                    blk.append(acc_v)
                    env = {**self.bind, p.i: i_val, p.j: j, p.red: acc_v}
                    memo: dict[UOp, Instr] = {}
                    vals.append(self.expr(val, env, blk, memo))
                    if not e:
                        ix = self.expr(out_idx, env, blk, memo)
                        dst = self.expr(buf, env, blk, memo)
                if width == 1:
                    blk.append(self.new(L.STORE, None, (dst, ix, vals[0])))
                    continue
                vec = self.new(L.VECTOR, vals[0].dtype, tuple(vals))
                blk += [vec, self.new(L.STORE, None, (dst, ix, vec), 2)]

    def paired_columns(self) -> bool:
        """Whether outputs j and j + 1 (j even) are adjacent 16-bit (or float32) elements of a 4-byte (8-byte)
        aligned pair: the output index is 1 x j plus terms of even constant coefficients, and N is an even
        constant."""
        from ..gpu_tile import _terms
        from ..symbolic import simplify
        p = self.p
        buf, out_idx, val = p.store.src
        ext = p.j.src[0]
        if val.dtype.itemsize not in (2, 4) or ext.op is not Ops.CONST or ext.arg % 2:
            return False
        form = _terms(out_idx)
        if form is None or p.j not in form:
            return False
        for k, v in form.items():
            v = simplify(v)
            if v.op is not Ops.CONST or (int(v.arg) != 1 if k is p.j else int(v.arg) % 2):
                return False
        return True


__all__ = ["WG_CANDIDATES", "WG_FIT_N", "WG_MID_MIN_BLOCKS", "WG_NARROW_STAGES", "WG_STAGES", "WG_TILE", "WG_TILE_MID",
           "WG_TILE_NARROW", "WG_TILE_SMALL", "choose_wg_tile"]
