"""The fit's model of a body: its runs lined up, each allocation's size as a function of the value (``sizes``),
and the whole timeline replayed through the allocator model at any value.

Pure analysis over the runs' allocator trace entries (``fit`` explains the method and says what it finds).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any, NamedTuple

from nbmem.fitting.analysis.allocator import CachingAllocatorModel, SegmentState
from nbmem.fitting.analysis.sizes import GROWTH_SLACK_BYTES, SizeModel, fit_size
from nbmem.formatting import fmt_bytes
from nbmem.records import block_bytes

#: The margin kept below the room: kernels CUDA loads for sizes not run yet, cuDNN/cuBLAS handles and other
#: processes take device memory outside the allocator while the user's run goes on.
MARGIN_FRACTION = 0.02
MIN_MARGIN_BYTES = 256 << 20
#: Runs whose event counts differ by more than this factor do not share one structure (a loop over the value);
#: below it, a few allocations more at larger values (a library workspace, a split-K matrix product) are
#: left to the alignment.
EVENT_COUNT_RATIO = 1.5


def margin_bytes_for(free_bytes: int, reserved_bytes: int, allocated_bytes: int = 0) -> int:
    """The default margin: ``MARGIN_FRACTION`` of the room the runs can use (free and reserved, less what the
    notebook holds: a margin of what it holds was 2.6 GiB of 8 GiB room beside 130 GiB of tensors on an H200),
    at least ``MIN_MARGIN_BYTES``."""
    return max(MIN_MARGIN_BYTES, int(MARGIN_FRACTION * (free_bytes + reserved_bytes - allocated_bytes)))



# -- the runs -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunTrace:
    """One run of the body at one value: the allocator's trace entries on one device while it ran."""

    value: int
    entries: Sequence[Mapping[str, Any]]
    counted: bool = True  # False: a warm-up run (its one-time allocations are kept; its sizes are not fitted)
    allocated_before_bytes: int | None = None
    reserved_before_bytes: int | None = None
    oom: bool = False  # the run stopped with CUDA out of memory; its trace ends there


@dataclass(frozen=True, slots=True)
class Room:
    """The device memory a fit has to stay inside, read before its first run."""

    device: str
    free_bytes: int  # what cudaMalloc can still get (cudaMemGetInfo)
    reserved_bytes: int  # this process's allocator segments: what it holds and caches
    allocated_bytes: int  # of which in use: what the notebook already holds
    margin_bytes: int
    total_bytes: int | None = None

    @property
    def capacity_bytes(self) -> int:
        """What the allocator's segments may add up to: free + reserved − margin."""
        return self.free_bytes + self.reserved_bytes - self.margin_bytes

    @property
    def others_bytes(self) -> int | None:
        """Other processes and CUDA contexts (this one's too): the device's total minus free and reserved."""
        return None if self.total_bytes is None else self.total_bytes - self.free_bytes - self.reserved_bytes


ALLOC, FREE, EXTERNAL = 0, 1, 2
Site = Hashable  # a cell line (int), a frame's text (str) or None where no stack was recorded


@dataclass(slots=True)
class Alloc:
    size: int
    stream: int
    addr: int
    born: int  # position among the run's events
    died: int | None  # position of its free; None: the run left it allocated
    site: Site


class Run:
    """A run's allocations and frees, in order; a free of a block allocated before the run is external."""

    def __init__(self, trace: RunTrace, site_of: Callable[[Sequence[Mapping[str, Any]] | None], Site]) -> None:
        self.value = trace.value
        self.counted = trace.counted
        self.oom = trace.oom
        self.events: list[tuple[int, int]] = []
        self.allocs: list[Alloc] = []
        self.externals: list[tuple[int, int, int, Site]] = []  # addr, size, stream, site
        live: dict[int, int] = {}
        level = peak = 0
        segments = seg_peak = 0
        self.peak_event = -1
        self.oom_request_bytes: int | None = None  # the request the device could not meet, where the trace has it
        for e in trace.entries:
            action = e.get("action")
            if action == "oom":
                self.oom_request_bytes = int(e.get("size", 0))
            if action == "segment_alloc" or action == "segment_map":
                segments += int(e.get("size", 0))
                seg_peak = max(seg_peak, segments)
                continue
            if action == "segment_free" or action == "segment_unmap":
                segments -= int(e.get("size", 0))
                continue
            if action != "alloc" and action != "free_requested":
                continue
            addr = int(e.get("addr", 0))
            size = int(e.get("size", 0))
            stream = int(e.get("stream", 0))
            pos = len(self.events)
            if action == "alloc":
                if size <= 0:
                    continue
                old = live.pop(addr, None)
                if old is not None:  # reused before its free was seen: the free was not recorded
                    self.allocs[old].died = pos
                live[addr] = len(self.allocs)
                self.events.append((ALLOC, len(self.allocs)))
                self.allocs.append(Alloc(size, stream, addr, pos, None, site_of(e.get("frames"))))
                level += block_bytes(size)
                if level > peak:
                    peak, self.peak_event = level, pos
            else:
                k = live.pop(addr, None)
                if k is None:
                    self.events.append((EXTERNAL, len(self.externals)))
                    self.externals.append((addr, size, stream, site_of(e.get("frames"))))
                    level -= block_bytes(size)
                else:
                    self.allocs[k].died = pos
                    self.events.append((FREE, k))
                    level -= block_bytes(self.allocs[k].size)
        self.peak_growth_bytes = peak
        self.segment_growth_bytes = seg_peak
        self.peak_allocated_bytes = (None if trace.allocated_before_bytes is None
                                     else trace.allocated_before_bytes + peak)
        self.peak_reserved_bytes = (None if trace.reserved_before_bytes is None
                                    else trace.reserved_before_bytes + seg_peak)


def _tokens(run: Run, exact: bool) -> list[tuple[Any, ...]]:
    """What an event is, whatever the value: action, stream, line and lifetime (and size, at one value)."""
    out: list[tuple[Any, ...]] = []
    for kind, i in run.events:
        if kind == EXTERNAL:
            _, size, stream, site = run.externals[i]
            out.append((kind, stream, site, 0, size if exact else 0))
            continue
        a = run.allocs[i]
        life = -1 if a.died is None else a.died - a.born
        out.append((kind, a.stream, a.site, life, a.size if exact else 0))
    return out


#: The size-aware alignment looks this far off the diagonal (beyond the runs' difference in allocations), and
#: fills at most this many cells before the runs are lined up by their events' shapes alone.
ALIGN_BAND = 64
ALIGN_MAX_CELLS = 4_000_000


def _size_score(sa: int, va: int, sb: int, vb: int) -> int:
    """How well ``sa`` bytes at ``va`` line up with ``sb`` bytes at ``vb``: 3 for the same size or the same size
    per unit, 1 for growth at most with the value's square, 0 where one cannot be the other."""
    if sa == sb or sa * vb == sb * va:
        return 3
    if va == vb:
        return 0
    (vs, ss), (vl, sl) = sorted(((va, sa), (vb, sb)))
    return 1 if ss < sl <= ss * (vl / vs) ** 2 + GROWTH_SLACK_BYTES else 0


def _align_sizes(a: Run, b: Run) -> dict[int, int] | None:
    """The order-keeping pairing of the two runs' allocations with the best total ``_size_score`` (same stream,
    line, and kept or not; a bonus for the same lifetime), by dynamic programming in a band around the diagonal;
    None when the band would be too large."""
    xa, xb = a.allocs, b.allocs
    n, m = len(xa), len(xb)
    band = abs(n - m) + ALIGN_BAND
    if n * (2 * band + 1) > ALIGN_MAX_CELLS:
        return None
    va, vb = a.value, b.value
    # This loop runs n × band times, for each of a fit's analyses: what must agree for a pairing (stream, line,
    # kept or not) is one small int per allocation, and B's sizes and lifetimes plain lists.
    keys: dict[tuple[Any, ...], int] = {}
    key_b = [keys.setdefault((x.stream, x.site, x.died is None), len(keys)) for x in xb]
    size_b = [x.size for x in xb]
    life_b = [-1 if x.died is None else x.died - x.born for x in xb]
    # Row i's scores for the columns lo - 1 .. hi of its band, the first always unreachable (-1); a column past
    # the row's end is unreachable too. The bands only move right, row by row.
    prev_lo, prev = 0, [-1] + [0] * (min(m, band) + 1)
    rows: list[tuple[int, bytearray]] = [(0, bytearray())]
    for i in range(1, n + 1):
        ai = xa[i - 1]
        ka = keys.get((ai.stream, ai.site, ai.died is None), -1)
        size_a, life_a = ai.size, -1 if ai.died is None else ai.died - ai.born
        c = i * m // max(1, n)
        lo, hi = max(0, c - band), min(m, c + band)
        short = hi - prev_lo + 2 - len(prev)
        if short > 0:
            prev.extend([-1] * short)
        cur = [-1] * (hi - lo + 2)
        how = bytearray(hi - lo + 1)
        shift = lo - prev_lo  # prev[k + shift + 1] is column lo + k of the row before
        left = -1
        start = lo
        if lo == 0:
            cur[1] = left = max(prev[shift + 1], 0)
            how[0] = 1  # A's allocation has no counterpart
            start = 1
        for j in range(start, hi + 1):
            k = j - lo
            best, move = prev[k + shift + 1], 1  # A's allocation has no counterpart
            if left > best:
                best, move = left, 2  # B's allocation has no counterpart
            # What one run keeps (state, a notebook variable) is never what another frees at once.
            if key_b[j - 1] == ka:
                diag = prev[k + shift]
                if diag >= 0:
                    w = _size_score(size_a, va, size_b[j - 1], vb)
                    if w and life_a >= 0 and life_a == life_b[j - 1]:
                        w += 1  # the same lifetime, in events: more likely the same tensor
                    if w and diag + w > best:
                        best, move = diag + w, 0
            cur[k + 1] = left = best
            how[k] = move
        rows.append((lo, how))
        prev_lo, prev = lo, cur
    pairs: dict[int, int] = {}
    i = n
    j = max(range(len(prev) - 1), key=lambda k: (prev[k + 1], k)) + prev_lo
    while i > 0 and j > 0:
        lo, how = rows[i]
        move = how[j - lo] if lo <= j < lo + len(how) else 1
        if move == 0:
            pairs[i - 1] = j - 1
            i, j = i - 1, j - 1
        elif move == 1:
            i -= 1
        else:
            j -= 1
    return pairs


def _align(a: Run, b: Run, *, exact: bool) -> tuple[dict[int, int], bool]:
    """Which allocation of ``b`` each allocation of ``a`` is (by index); ``exact``: both ran at one value.

    Runs of one shape (every event's action, stream, line and lifetime the same) line up one to one. Where
    they differ (a workspace one size asks for and another does not shifts every lifetime around it), the
    allocations are paired in order by size: the same bytes (fixed), the same bytes per unit (per sample),
    or growth that the values allow. Runs too long for that are paired where their events' shapes agree, and
    the second value says so (what is left unpaired is then taken to grow).
    """
    ta, tb = _tokens(a, exact), _tokens(b, exact)
    if ta == tb:
        return {i: i for i in range(len(a.allocs))}, True
    by_size = _align_sizes(a, b)
    if by_size is not None:
        return by_size, True
    pairs: dict[int, int] = {}
    for tag, i1, i2, j1, _ in SequenceMatcher(None, ta, tb, autojunk=False).get_opcodes():
        if tag == "equal":
            for k in range(i2 - i1):
                ea, eb = a.events[i1 + k], b.events[j1 + k]
                if ea[0] == ALLOC:
                    pairs[ea[1]] = eb[1]
    return pairs, False


# -- the timeline ------------------------------------------------------------------------------------------------
#: What a step of the timeline does. Allocations: one of the template run's (``ref``: its place in the largest
#: run, sized by the model), or one only the first run made (``ref`` into ``one_time``, its own size). Frees: of
#: this run's template allocation, of a one-time one, of what the run before left under an allocation's name
#: (``ref``: the template allocation it was), or of a block from before the runs (``ref``: its address; -1:
#: nothing to free).
ALLOC_TEMPLATE, ALLOC_ONE_TIME, FREE_TEMPLATE, FREE_ONE_TIME, FREE_LEFT, FREE_BEFORE = range(6)


class Op(NamedTuple):
    """One step of the timeline (a tuple: the simulation unpacks it at speed)."""

    code: int
    ref: int
    stream: int = 0  # an allocation's CUDA stream
    #: an allocation of the template: which allocation of the run before it replaces (what that run left bound to
    #: the same name, freed as this one is made), -1 none
    replaces: int = -1


@dataclass
class Sim:
    ok: bool
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_at: tuple[int, int]  # (phase, op) of the peak of allocated bytes
    failed_at: tuple[int, int] | None = None
    live: dict[Any, int] | None = None
    ties: int = 0  # large requests that had free blocks of one size to choose from: addresses decide only these


class Timeline:
    """The body's allocations as a program of the value: the first run, then the steady run (twice)."""

    def __init__(self, sizes: list[SizeModel], sites: list[Site], first_ops: list[Op],
                 steady_ops: list[Op], one_time: list[int], first_sizes: dict[int, int],
                 segments: Sequence[SegmentState], notes: list[str]) -> None:
        self.sizes = sizes
        self.sites = sites
        self.first_ops = first_ops
        self.steady_ops = steady_ops
        self.one_time = one_time
        self.first_sizes = first_sizes  # template index -> its size in the first run (never model below it)
        self.segments = segments
        self.notes = notes
        self.init_bytes = {addr: size for s in segments if s.usable for addr, size, alloc in s.blocks if alloc}
        self.one_time_sites: list[Site] = [None] * len(one_time)

    def simulate(self, value: int, capacity_bytes: float, *, phases: int = 3,
                 stop_at: tuple[int, int] | None = None, descending: bool = False) -> Sim:
        """Run the program at ``value`` through the allocator model; stops at the first failed request."""
        n = len(self.sizes)
        sizes = [m.at(value) for m in self.sizes]
        first = [max(s, self.first_sizes.get(j, 0)) for j, s in enumerate(sizes)]
        alloc = CachingAllocatorModel(capacity_bytes, self.segments, descending=descending)
        live: dict[Any, int] = {("i", a): a for a in self.init_bytes}
        peak, peak_at = alloc.allocated_bytes, (0, -1)
        for phase in range(phases):
            ops = self.first_ops if phase == 0 else self.steady_ops
            base, prev = phase * n, (phase - 1) * n
            for k, op in enumerate(ops):
                if stop_at is not None and (phase, k) == stop_at:
                    return Sim(True, peak, alloc.peak_reserved_bytes, peak_at, None, dict(live), alloc.ties)
                code, ref, stream, replaces = op
                if code == ALLOC_TEMPLATE or code == ALLOC_ONE_TIME:
                    if code == ALLOC_TEMPLATE:
                        key: Any = base + ref
                        size = first[ref] if phase == 0 else sizes[ref]
                    else:
                        key, size = -1 - ref, self.one_time[ref]
                    addr = alloc.malloc(size, stream)
                    if addr is None:
                        return Sim(False, peak, alloc.peak_reserved_bytes, peak_at, (phase, k), ties=alloc.ties)
                    live[key] = addr
                    if alloc.allocated_bytes > peak:
                        peak, peak_at = alloc.allocated_bytes, (phase, k)
                    if replaces >= 0 and phase > 0:
                        # What the last run left under this allocation's name is replaced by it now.
                        old = live.pop(prev + replaces, None)
                        if old is not None:
                            alloc.free(old)
                    continue
                if code == FREE_TEMPLATE:
                    got = live.pop(base + ref, None)
                elif code == FREE_ONE_TIME:
                    got = live.pop(-1 - ref, None)
                elif code == FREE_LEFT:
                    got = live.pop(prev + ref, None) if phase > 0 else None
                else:
                    got = live.pop(("i", ref), None)
                if got is not None:
                    alloc.free(got)
        return Sim(True, peak, alloc.peak_reserved_bytes, peak_at, None, dict(live) if stop_at else None, alloc.ties)

    def site_at(self, phase: int, op: int) -> Site:
        ops = self.first_ops if phase == 0 else self.steady_ops
        if 0 <= op < len(ops) and ops[op].code == ALLOC_TEMPLATE:
            return self.sites[ops[op].ref]
        if 0 <= op < len(ops) and ops[op].code == ALLOC_ONE_TIME:
            return self.one_time_sites[ops[op].ref]
        return None

    def decompose(self, live: Mapping[Any, int]) -> tuple[float, float, float, dict[Site, list[float]]]:
        """Fixed, per-unit and per-unit² bytes of what is live, and per line (per-unit, per-unit²)."""
        n = len(self.sizes)
        fixed = per = sq = 0.0
        lines: dict[Site, list[float]] = {}
        for key in live:
            if isinstance(key, tuple):
                fixed += self.init_bytes.get(key[1], 0)
            elif key < 0:
                fixed += self.one_time[-1 - key]
            else:
                m = self.sizes[key % n]
                fixed += m.fixed_bytes
                per += m.per_unit_bytes
                sq += m.per_unit_sq_bytes
                if m.per_unit_bytes > 0 or m.per_unit_sq_bytes > 0:
                    acc = lines.setdefault(self.sites[key % n], [0.0, 0.0])
                    acc[0] += m.per_unit_bytes
                    acc[1] += m.per_unit_sq_bytes
        return fixed, per, sq, lines


def _rebinding_heads(run: Run) -> dict[int, int]:
    """Names a run binds more than once (a loop over micro-batches: ``x = torch.randn(...)`` twice): where an
    allocation's very next event frees an earlier block of the same size made at the same line, the new block
    took the old one's name. For each block the run leaves allocated at the end of such a chain, the chain's
    first allocation maps to it: in the next run that allocation rebinds the name, and the block left by the
    run before goes then, not when the last link is made again. Only with stacks (a line to compare)."""
    before: dict[int, int] = {}  # allocation -> the one whose name it took
    events = run.events
    for pos, (kind, i) in enumerate(events[:-1]):
        if kind != ALLOC:
            continue
        nxt_kind, j = events[pos + 1]
        if nxt_kind != FREE or j == i:
            continue
        a, b = run.allocs[i], run.allocs[j]
        if a.site is not None and a.site == b.site and a.size == b.size and a.stream == b.stream and b.born < a.born:
            before[i] = j
    heads: dict[int, int] = {}
    for i, a in enumerate(run.allocs):
        if a.died is not None or i not in before:
            continue
        head, seen = i, {i}
        while head in before and before[head] not in seen:
            head = before[head]
            seen.add(head)
        heads[head] = i
    return heads


def build_timeline(runs: Sequence[Run], segments: Sequence[SegmentState]) -> Timeline | str:
    """The timeline from the runs (in the order they ran), or why the runs give none."""
    ok = [r for r in runs if not r.oom]
    counted = [r for r in ok if r.counted]
    if len({r.value for r in counted}) < 2:
        return "the fit needs runs at two values at least"
    first = ok[0]
    template = max(counted, key=lambda r: r.value)
    # A counted first run (no warm-up) made one-time allocations too: it is left out of the structure check,
    # but its sizes are points like any other run's where it lines up.
    later = [r for r in counted if r is not first]
    if len({r.value for r in later}) >= 2:
        counts = [len(r.events) for r in later]
    else:  # the first run is needed: what it made and kept (made once) is not counted
        counts = [len(r.events) - (sum(1 for a in r.allocs if a.died is None) if r is first else 0)
                  for r in counted]
    if max(counts) > EVENT_COUNT_RATIO * max(1, min(counts)):
        return "structure"
    steady = counted
    notes: list[str] = []
    maps: dict[int, dict[int, int]] = {id(template): {i: i for i in range(len(template.allocs))}}
    by_size = True  # every pairing was made by size (not by the events' shapes alone, for runs too long)
    for r in steady:
        if r is not template:
            maps[id(r)], ok_size = _align(r, template, exact=False)
            by_size &= ok_size
    if id(first) not in maps:
        twin = next((r for r in steady if r.value == first.value), None)
        if twin is not None:
            via = maps[id(twin)]
            pairs, ok_size = _align(first, twin, exact=True)
            maps[id(first)] = {i: via[j] for i, j in pairs.items() if j in via}
        else:
            maps[id(first)], ok_size = _align(first, template, exact=False)
        by_size &= ok_size
    n = len(template.allocs)
    points: list[list[tuple[int, int]]] = [[(template.value, a.size)] for a in template.allocs]
    for r in steady:
        if r is template:
            continue
        for i, j in maps[id(r)].items():
            points[j].append((r.value, r.allocs[i].size))
    sizes = [fit_size(p) for p in points]
    alone = [j for j in range(n) if len({v for v, _ in points[j]}) < 2]
    kept = [j for j in alone if template.allocs[j].died is None or not by_size]
    passing = [j for j in alone if template.allocs[j].died is not None and by_size]
    for j in passing:
        # A workspace only larger values ask for (another algorithm, a matrix product split in parts) lives for
        # a moment: it keeps its size, and the margin stands for how much more a larger value may ask.
        sizes[j] = SizeModel(float(template.allocs[j].size), 0.0, 0.0, "unmatched")
    if passing:
        notes.append(f"{len(passing):,} of {n:,} allocations of the largest run "
                     f"({fmt_bytes(sum(template.allocs[j].size for j in passing))}), each freed soon after it was "
                     "made, have no counterpart in the other runs (a library workspace or algorithm chosen by size): "
                     "they keep their size")
    if kept:
        notes.append(f"{len(kept):,} of {n:,} allocations of the largest run "
                     f"({fmt_bytes(sum(template.allocs[j].size for j in kept))}) have no counterpart in the other "
                     "runs: they are taken to grow in proportion to the value (an upper bound for growth that is at "
                     "most linear)")
    quadratic = sum(1 for m in sizes if m.kind == "quadratic")
    if quadratic:
        notes.append(f"{quadratic:,} allocations grow faster than linearly with the value (quadratic through the "
                     "last three values)")
    power = [m.power for m in sizes if m.kind == "power"]
    if power:
        notes.append(f"{len(power):,} allocations grow faster than the value's square (as the value to the power "
                     f"{max(power):.1f} at most); the per-unit figures leave them out")
    near = sum(1 for m in sizes if m.kind == "steepest near")
    if near:
        notes.append(f"{near:,} allocations grew faster between the small values than near the largest: each takes "
                     "the steepest growth the runs near the largest showed")
    irregular = sum(1 for m in sizes if m.kind in ("steepest", "largest seen"))
    if irregular:
        notes.append(f"{irregular:,} allocations change size irregularly between values (another algorithm or "
                     "workspace): each takes the steepest growth, or the largest size, it showed")

    init = {addr for s in segments if s.usable for addr, _, alloc in s.blocks if alloc}
    # The first run's allocations: those that line up follow the model, the rest are one-time, at their size.
    fmap = maps[id(first)]
    one_time: list[int] = []
    one_time_sites: list[Site] = []
    first_key: dict[int, tuple[int, int]] = {}  # first run allocation -> (code, ref)
    first_sizes: dict[int, int] = {}
    for i, a in enumerate(first.allocs):
        t = fmap.get(i)
        if t is None:
            first_key[i] = (ALLOC_ONE_TIME, len(one_time))
            one_time.append(a.size)
            one_time_sites.append(a.site)
        else:
            first_key[i] = (ALLOC_TEMPLATE, t)
            first_sizes[t] = max(first_sizes.get(t, 0), a.size)
    if one_time:
        notes.append(f"{len(one_time):,} allocations only the first run made ({fmt_bytes(sum(one_time))}, "
                     "such as optimizer state and library workspaces) are taken as fixed")

    # The steady run: a block it frees that the run before it left is that run's leftover, by address.
    unknown_frees = 0
    prev = ok[ok.index(template) - 1] if ok.index(template) > 0 else None
    left: dict[int, Op] = {}  # address -> the free of what the run before left there
    if prev is not None:
        pmap = maps.get(id(prev))
        for i, a in enumerate(prev.allocs):
            if a.died is not None:
                continue
            if prev is first:
                code, j = first_key[i]
                left[a.addr] = Op(FREE_LEFT, j) if code == ALLOC_TEMPLATE else Op(FREE_ONE_TIME, j)
            elif pmap is not None and i in pmap:
                left[a.addr] = Op(FREE_LEFT, pmap[i])
    steady_ops: list[Op] = []  # one per event of the template run
    for kind, i in template.events:
        if kind == ALLOC:
            steady_ops.append(Op(ALLOC_TEMPLATE, i, template.allocs[i].stream))
        elif kind == FREE:
            steady_ops.append(Op(FREE_TEMPLATE, i))
        else:
            addr = template.externals[i][0]
            if addr in left:
                steady_ops.append(left[addr])
            elif addr in init:
                steady_ops.append(Op(FREE_BEFORE, addr))
            else:
                steady_ops.append(Op(FREE_BEFORE, -1))  # nothing to free: kept as allocated
                unknown_frees += 1
    # Each allocation replaces what the run before left under its name (freed as it is made), unless a free of
    # that leftover was placed already; where two allocations claim one leftover, each replaces its own.
    freed_by_name = {op.ref for op in steady_ops if op.code == FREE_LEFT}
    heads = _rebinding_heads(template)
    if len(set(heads.values())) < len(heads):  # two heads for one leftover: not one name, trust neither
        heads = {}
    steady_ops = [op._replace(replaces=-1 if op.ref in freed_by_name else heads.get(op.ref, op.ref))
                  if op.code == ALLOC_TEMPLATE else op for op in steady_ops]

    # The first run at a larger value: the steady run's events, with what only the first run did put in where
    # it did it (the warm-up at the smallest value lacks what only larger values allocate, a workspace say).
    first_ops: list[Op] = []
    done = 0

    def upto(pos: int) -> None:
        nonlocal done
        while done <= pos:
            first_ops.append(steady_ops[done])
            done += 1

    for kind, i in first.events:
        if kind == EXTERNAL:
            addr = first.externals[i][0]
            if addr in init:
                first_ops.append(Op(FREE_BEFORE, addr))
            continue
        code, j = first_key[i]
        if code == ALLOC_ONE_TIME:
            first_ops.append(Op(ALLOC_ONE_TIME, j, first.allocs[i].stream) if kind == ALLOC else Op(FREE_ONE_TIME, j))
        elif kind == ALLOC:
            upto(template.allocs[j].born)
        else:
            died = template.allocs[j].died
            if died is None:  # the first run freed what later runs keep: it is freed here
                first_ops.append(Op(FREE_TEMPLATE, j))
            else:
                upto(died)
    upto(len(steady_ops) - 1)
    if unknown_frees:
        notes.append(f"{unknown_frees:,} frees of memory from before a run could not be placed: that memory is "
                     "kept as allocated")
    tl = Timeline(sizes, [a.site for a in template.allocs], first_ops, steady_ops, one_time, first_sizes,
                  segments, notes)
    tl.one_time_sites = one_time_sites
    return tl
