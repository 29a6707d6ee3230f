"""Memory plans: one arena for the intermediate buffers of a sequence of kernel launches.

A graph executor describes its launches as `Step`s (the logical buffers each reads and writes) with
the size of every buffer; `plan_memory` computes each buffer's lifetime (first to last step that
touches it) and gives buffers whose lifetimes overlap disjoint byte ranges of one arena, so buffers
that are never live together share memory. Pinned buffers (graph inputs and outputs, weights, anything
the caller keeps or fills from the host) stay out of the arena; a buffer read before any step writes it
holds a value from outside the steps, so it is pinned too. Two buffers of one step never share memory
unless the step says its kernel may write an output over a dead input (`Step.inplace`).

Device-independent: keys are any hashable values, sizes are bytes; the caller maps offsets to memory.
`plan_launches` does that for a list of recorded launches (program, buffers): one arena Buffer, the
planned buffers as its views (`Buffer.view`), the launches rewritten onto them. A launch buffer that is a
view of another Buffer (`Buffer.view`, e.g. a Concat input written into its slice of the output) is
planned as that root buffer: the root is placed whole, its views keep their offsets inside it. `MemoryPlan.check()`
verifies a plan (tests use it on every plan they make).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Iterable, Mapping, Sequence

from .dtypes import dtypes

if TYPE_CHECKING:
    from .buffer import Buffer

__all__ = ["Step", "Strategy", "GREEDY_BY_SIZE", "STRATEGIES", "MemoryPlan", "plan_memory", "LaunchArena",
           "plan_launches"]

Key = Hashable


@dataclass(frozen=True)
class Step:
    """One launch: the buffers it reads and writes, and the (output, input) pairs its kernel may
    compute in place (the output written over the input's memory, at the same offset, when this step
    is the input's last use). Kernels that assume no aliasing give no pairs (the default)."""

    reads: tuple[Key, ...] = ()
    writes: tuple[Key, ...] = ()
    inplace: tuple[tuple[Key, Key], ...] = ()


@dataclass(frozen=True)
class Strategy:
    """A named placement heuristic."""

    name: str
    why: str

    def __str__(self) -> str:
        return f"{self.name} ({self.why})"


# The one strategy: the largest buffers are placed first (they decide the arena's size), each at the
# smallest gap left between the already placed buffers whose lifetimes overlap its own (best fit), or
# above them all when no gap holds it. TFLite's "greedy by size" planner is the model.
GREEDY_BY_SIZE = Strategy("greedy-by-size", "largest first, each into the smallest gap among the buffers live "
                                            "with it (best fit), else above them")
STRATEGIES = {GREEDY_BY_SIZE.name: GREEDY_BY_SIZE}


def _align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MB" if n >= 2**20 else f"{n / 1024:.1f} KB" if n >= 1024 else f"{n} B"


@dataclass
class MemoryPlan:
    """Where each planned buffer lives in the arena.

    `offsets[key]` is a byte offset (a multiple of the buffer's alignment); `lifetimes[key]` the first
    and last step that touch it (inclusive); `naive_bytes` what the planned buffers take each in its own
    allocation (sizes rounded up to their alignment, as an aligned allocator hands them out); `live_peak_bytes` the most bytes live at one step (no placement does
    better); `pinned` the buffers left out of the arena, `auto_pinned` those among them pinned because a
    step reads them before any step writes them; `aliases` the in-place (output, input) pairs that
    share an offset."""

    strategy: Strategy
    steps: int
    offsets: dict[Key, int]
    sizes: dict[Key, int]
    aligns: dict[Key, int]
    lifetimes: dict[Key, tuple[int, int]]
    arena_bytes: int
    naive_bytes: int
    live_peak_bytes: int
    pinned: frozenset
    auto_pinned: frozenset
    aliases: tuple[tuple[Key, Key], ...] = ()
    names: dict[Key, str] = field(default_factory=dict)

    def name(self, key: Key) -> str:
        return self.names.get(key) or str(key)

    def describe(self, limit: int = 12) -> str:
        """A summary line and the `limit` largest buffers: size, offset, lifetime."""
        n = len(self.offsets)
        saved = 1 - self.arena_bytes / self.naive_bytes if self.naive_bytes else 0.0
        lines = [f"memory plan, {self.strategy.name}: {n} buffer(s) over {self.steps} step(s) in a "
                 f"{_mb(self.arena_bytes)} arena (each its own: {_mb(self.naive_bytes)}, {saved:.0%} saved; "
                 f"most live at one step: {_mb(self.live_peak_bytes)}); {len(self.pinned)} pinned"
                 + (f" ({len(self.auto_pinned)} read before written)" if self.auto_pinned else "")
                 + (f"; {len(self.aliases)} in place" if self.aliases else "")]
        if n and limit:
            order = sorted(self.offsets, key=lambda k: (-self.sizes[k], self.lifetimes[k]))[:limit]
            width = max(len(self.name(k)) for k in order)
            lines.append(f"  {'buffer':{width}s}  {'bytes':>12s}  {'offset':>12s}  steps")
            for k in order:
                a, b = self.lifetimes[k]
                lines.append(f"  {self.name(k):{width}s}  {self.sizes[k]:12d}  {self.offsets[k]:12d}  {a}-{b}")
            if n > limit:
                lines.append(f"  ... {n - limit} smaller")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    def check(self) -> None:
        """Raise AssertionError unless the plan is sound: every planned buffer aligned and inside the
        arena, no pinned buffer in it, and no two buffers live at one step overlapping in memory (an
        in-place pair shares exactly one offset, the input dying at the step the output is born)."""
        aliased = {frozenset(p) for p in self.aliases}
        for k, off in self.offsets.items():
            if k in self.pinned:
                raise AssertionError(f"pinned buffer {self.name(k)} has an arena offset")
            if off < 0 or off % self.aligns[k] or off + self.sizes[k] > self.arena_bytes:
                raise AssertionError(f"{self.name(k)} at {off} (+{self.sizes[k]} bytes, align {self.aligns[k]}) "
                                     f"does not fit the {self.arena_bytes}-byte arena")
        for out, inp in self.aliases:
            if self.offsets[out] != self.offsets[inp] or self.lifetimes[inp][1] != self.lifetimes[out][0]:
                raise AssertionError(f"in-place pair {self.name(out)} over {self.name(inp)} does not share "
                                     f"one offset at one step")
        # sweep the steps: buffers sorted by first step; compare each with those still live
        keys = sorted(self.offsets, key=lambda k: self.lifetimes[k])
        live: list[Key] = []
        for k in keys:
            a, b = self.lifetimes[k]
            live = [j for j in live if self.lifetimes[j][1] >= a]
            lo, hi = self.offsets[k], self.offsets[k] + max(self.sizes[k], 1)
            for j in live:
                jlo, jhi = self.offsets[j], self.offsets[j] + max(self.sizes[j], 1)
                if lo < jhi and jlo < hi and frozenset((j, k)) not in aliased:
                    raise AssertionError(f"{self.name(j)} (steps {self.lifetimes[j]}, bytes {jlo}-{jhi}) and "
                                         f"{self.name(k)} (steps {(a, b)}, bytes {lo}-{hi}) are live together "
                                         f"and overlap")
            live.append(k)


def plan_memory(steps: Sequence[Step], sizes: Mapping[Key, int], *, pinned: Iterable[Key] = (),
                align: int | Mapping[Key, int] = 64, strategy: Strategy = GREEDY_BY_SIZE,
                names: Mapping[Key, str] | None = None) -> MemoryPlan:
    """Offsets in one arena for every buffer the steps touch that is not pinned. `sizes` gives every
    buffer's bytes; `align` one alignment for all (bytes, a power of two) or one per buffer (64 when
    missing). Buffers no step touches are left out of the plan."""
    if strategy.name not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy.name!r}; known: {sorted(STRATEGIES)}")
    pinned_set = set(pinned)
    first: dict[Key, int] = {}
    last: dict[Key, int] = {}
    written: set[Key] = set()
    auto: set[Key] = set()
    for i, st in enumerate(steps):
        for k in st.reads:
            if k not in written and k not in pinned_set:
                auto.add(k)        # its value comes from before the steps
        for k in tuple(st.reads) + tuple(st.writes):
            if k not in sizes:
                raise KeyError(f"step {i} uses buffer {k!r}, which has no size")
            first.setdefault(k, i)
            last[k] = i
        written.update(st.writes)
    pinned_set |= auto
    aligns: dict[Key, int] = {}
    for k in first:
        a = align.get(k, 64) if isinstance(align, Mapping) else align
        if a <= 0 or a & (a - 1):
            raise ValueError(f"alignment of {k!r} must be a power of two, got {a}")
        aligns[k] = a
    planned = [k for k in first if k not in pinned_set]
    size = {k: int(sizes[k]) for k in planned}
    for k, n in size.items():
        if n < 0:
            raise ValueError(f"buffer {k!r} has a negative size {n}")
    life = {k: (first[k], last[k]) for k in planned}

    # in-place pairs: the output joins the input's group when this step is the input's last use and the
    # output's first, neither is pinned and the output fits (groups are placed as one block)
    group: dict[Key, Key] = {k: k for k in planned}
    members: dict[Key, list[Key]] = {k: [k] for k in planned}
    aliases: list[tuple[Key, Key]] = []
    joined_at: dict[Key, int] = {}        # group -> the step its newest member joined
    for i, st in enumerate(steps):
        for out, inp in st.inplace:
            if out not in life or inp not in life or out == inp:
                continue
            if inp not in st.reads or out not in st.writes or inp in st.writes:
                raise ValueError(f"step {i}: in-place pair ({out!r}, {inp!r}) must be one of its writes and "
                                 f"one of its reads (and not written)")
            g = group[inp]
            if (life[inp][1] != i or life[out][0] != i or group[out] != out or len(members[out]) != 1
                    or size[out] > size[g] or aligns[out] > aligns[g]
                    or members[g][-1] != inp       # only the group's newest member can be written over
                    or joined_at.get(g) == i):     # and only once per step
                continue
            group[out] = g
            joined_at[g] = i
            members[g].append(out)
            del members[out]
            aliases.append((out, inp))
    glife = {g: (min(life[m][0] for m in ms), max(life[m][1] for m in ms)) for g, ms in members.items()}
    gsize = {g: max(max(size[m] for m in ms), 1) for g, ms in members.items()}
    galign = {g: max(aligns[m] for m in ms) for g, ms in members.items()}

    # greedy by size, best fit
    position = {k: i for i, k in enumerate(planned)}
    order = sorted(members, key=lambda g: (-gsize[g], glife[g][0], position[g]))
    placed: list[tuple[int, int, int, int]] = []       # (offset, end, first step, last step)
    goff: dict[Key, int] = {}
    arena = 0
    for g in order:
        a, b = glife[g]
        n, al = gsize[g], galign[g]
        busy = sorted((o, e) for o, e, fa, fb in placed if fa <= b and a <= fb)
        best, best_gap, cursor = None, None, 0
        for o, e in busy:
            start = _align_up(cursor, al)
            if o - start >= n and (best_gap is None or o - start < best_gap):
                best, best_gap = start, o - start
            cursor = max(cursor, e)
        off = best if best is not None else _align_up(cursor, al)
        goff[g] = off
        placed.append((off, off + n, a, b))
        arena = max(arena, off + n)
    offsets = {k: goff[group[k]] for k in planned}

    # the most bytes live at one step (a lower bound on any arena)
    delta = [0] * (len(steps) + 1)
    for g in members:
        a, b = glife[g]
        delta[a] += gsize[g]
        delta[b + 1] -= gsize[g]
    peak = cur = 0
    for d in delta:
        cur += d
        peak = max(peak, cur)
    naive = sum(_align_up(max(n, 1), aligns[k]) for k, n in size.items())
    return MemoryPlan(strategy, len(steps), offsets, size, {k: aligns[k] for k in planned}, life, arena, naive,
                      peak, frozenset(pinned_set), frozenset(auto), tuple(aliases), dict(names or {}))


@dataclass
class LaunchArena:
    """A memory plan applied to launches: `arena` (None when nothing was planned) and, by the id of each
    planned buffer, the view of the arena that replaces it; `launches` the launches on the views."""

    plan: MemoryPlan
    arena: "Buffer | None"
    views: dict[int, "Buffer"]
    launches: list[tuple]

    def replace(self, buffers: Sequence["Buffer"]) -> tuple:
        views = self.views
        return tuple(views.get(id(b), b) for b in buffers)


def _root_of(b: "Buffer") -> tuple["Buffer", int]:
    """The Buffer that `b` is a view of (through `Buffer.view`, any depth), and `b`'s byte offset in it."""
    from .buffer import _Parent
    off = 0
    while isinstance(b._owner, _Parent) and b._owner.buffer is not None and b._ptr is not None:
        parent = b._owner.buffer
        off += b._ptr - parent.ptr
        b = parent
    return b, off


def plan_launches(launches: Sequence[tuple], keep: Iterable["Buffer"], *, align: int = 64,
                  strategy: Strategy = GREEDY_BY_SIZE) -> LaunchArena:
    """Plan the buffers of `launches` ((program, buffers, ...) each, in launch order) into one arena on
    their device: a buffer a launch writes (the program's written params) is planned unless it is in
    `keep` (what the caller reads or fills outside the launches) or read before written. Returns the
    arena, the views and the launches with each planned buffer replaced by its view (the rest of each
    tuple as it was); their values match the original launches' once every launch has run."""
    ids: dict[int, int] = {}
    bufs: list[Buffer] = []            # the roots
    inner: dict[int, tuple[Buffer, int, int]] = {}     # id(launch buffer) -> (it, root key, byte offset)

    def key_of(b: "Buffer") -> int:
        got = inner.get(id(b))
        if got is not None:
            return got[1]
        root, off = _root_of(b)
        k = ids.get(id(root))
        if k is None:
            k = ids[id(root)] = len(bufs)
            bufs.append(root)
        inner[id(b)] = (b, k, off)
        return k

    steps: list[Step] = []
    for launch in launches:
        program, buffers = launch[0], launch[1]
        info = getattr(program, "launch", None)
        params = getattr(info, "params", None)
        reads, writes = [], []
        for i, b in enumerate(buffers):
            k = key_of(b)
            written = params[i].written if params is not None and i < len(params) else None
            if written is None:         # unknown: read and written (read first, so never planned)
                reads.append(k)
                writes.append(k)
            elif written:
                writes.append(k)
            else:
                reads.append(k)
        steps.append(Step(tuple(reads), tuple(writes)))
    pinned = [k for k in (ids.get(id(_root_of(b)[0])) for b in keep) if k is not None]
    names = {k: f"{b.dtype.name}[{b.size}]#{k}" for k, b in enumerate(bufs)}
    plan = plan_memory(steps, {k: b.nbytes for k, b in enumerate(bufs)}, pinned=pinned, align=align,
                       strategy=strategy, names=names)
    arena = None
    views: dict[int, Buffer] = {}
    if plan.offsets:
        from .buffer import Buffer
        devices = {bufs[k].device for k in plan.offsets}
        if len(devices) != 1:
            raise ValueError(f"planned buffers live on {len(devices)} devices; plan each device's launches apart")
        arena = Buffer(devices.pop(), plan.arena_bytes, dtypes.uint8)
        for b, k, off in inner.values():
            if k in plan.offsets:
                views[id(b)] = arena.view(plan.offsets[k] + off, b.size, b.dtype)
    out = [(launch[0], tuple(views.get(id(b), b) for b in launch[1])) + tuple(launch[2:]) for launch in launches]
    return LaunchArena(plan, arena, views, out)
