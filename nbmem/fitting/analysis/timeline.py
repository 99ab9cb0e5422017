"""The fit's timeline: a body's allocations as a program of the value, and that program replayed through the
allocator model at any value.

``build_timeline`` lines up the runs (``model``: each run's allocations, paired across runs), makes each allocation
of the largest run a size model of the value (``sizes``), keeps what only the first run made at its size, and
writes the steps of the first run and of the steady run; ``Timeline.simulate`` replays them through
``allocator.CachingAllocatorModel``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from nbmem.fitting.analysis.allocator import CachingAllocatorModel, SegmentState
from nbmem.fitting.analysis.model import ALLOC, EVENT_COUNT_RATIO, EXTERNAL, FREE, Run, RunTrace, Site, align
from nbmem.fitting.analysis.sizes import SizeModel, fit_size
from nbmem.formatting import fmt_bytes

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
    # where it failed: the request, and what the allocator held then (after giving back its cache, as torch's does
    # before it raises)
    request_bytes: int = 0
    reserved_at_failure_bytes: int = 0
    allocated_at_failure_bytes: int = 0


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
        self._replays: dict[tuple[int, float, int, bool], Sim] = {}

    def simulate(self, value: int, capacity_bytes: float, *, phases: int = 3,
                 stop_at: tuple[int, int] | None = None, descending: bool = False) -> Sim:
        """Run the program at ``value`` through the allocator model; stops at the first failed request. A replay
        to the end is kept: the search, the report and a fit's next analysis of the same runs ask for it again."""
        if stop_at is not None:
            return self._simulate(value, capacity_bytes, phases, stop_at, descending)
        key = (value, capacity_bytes, phases, descending)
        got = self._replays.get(key)
        if got is None:
            got = self._replays[key] = self._simulate(value, capacity_bytes, phases, None, descending)
        return got

    def _simulate(self, value: int, capacity_bytes: float, phases: int, stop_at: tuple[int, int] | None,
                  descending: bool) -> Sim:
        n = len(self.sizes)
        sizes = [m.at(value) for m in self.sizes]
        first = [max(s, self.first_sizes.get(j, 0)) for j, s in enumerate(sizes)]
        alloc = CachingAllocatorModel(capacity_bytes, self.segments, descending=descending)
        live: dict[Any, int] = {("i", a): a for a in self.init_bytes}
        peak, peak_at = alloc.allocated_bytes, (0, -1)
        malloc, free, one_time = alloc.malloc, alloc.free, self.one_time  # looked up once: the loop runs 10^4 times
        for phase in range(phases):
            ops = self.first_ops if phase == 0 else self.steady_ops
            now = first if phase == 0 else sizes
            base, prev = phase * n, (phase - 1) * n
            stop_k = stop_at[1] if stop_at is not None and stop_at[0] == phase else -1
            for k, op in enumerate(ops):
                if k == stop_k:
                    return Sim(True, peak, alloc.peak_reserved_bytes, peak_at, None, dict(live), alloc.ties)
                code, ref, stream, replaces = op
                if code == ALLOC_TEMPLATE or code == ALLOC_ONE_TIME:
                    if code == ALLOC_TEMPLATE:
                        key: Any = base + ref
                        size = now[ref]
                    else:
                        key, size = -1 - ref, one_time[ref]
                    addr = malloc(size, stream)
                    if addr is None:
                        return Sim(False, peak, alloc.peak_reserved_bytes, peak_at, (phase, k), ties=alloc.ties,
                                   request_bytes=size, reserved_at_failure_bytes=alloc.reserved_bytes,
                                   allocated_at_failure_bytes=alloc.allocated_bytes)
                    live[key] = addr
                    if alloc.allocated_bytes > peak:
                        peak, peak_at = alloc.allocated_bytes, (phase, k)
                    if replaces >= 0 and phase > 0:
                        # What the last run left under this allocation's name is replaced by it now.
                        old = live.pop(prev + replaces, None)
                        if old is not None:
                            free(old)
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
                    free(got)
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
    """The timeline from the runs (in the order they ran), or why the runs give none: each allocation of the
    largest run paired with its counterparts in the others (its size a model of the value), the first run's own
    allocations kept at their size, and the steps of the first run and of the steady run."""
    ok = [r for r in runs if not r.oom]
    counted = [r for r in ok if r.counted]
    if len({r.value for r in counted}) < 2:
        return "the fit needs runs at two values at least"
    first = ok[0]
    template = max(counted, key=lambda r: r.value)
    if not _one_structure(counted, first):
        return "structure"
    notes: list[str] = []
    maps, by_size = _pairings(first, template, counted)
    sizes = _size_models(template, counted, maps, by_size, notes)
    init = {addr for s in segments if s.usable for addr, _, alloc in s.blocks if alloc}
    first_key, first_sizes, one_time, one_time_sites = _first_run(first, maps[id(first)], notes)
    steady_ops = _steady_ops(ok, first, template, first_key, maps, init, notes)
    first_ops = _first_ops(first, template, first_key, steady_ops, init)
    tl = Timeline(sizes, [a.site for a in template.allocs], first_ops, steady_ops, one_time, first_sizes,
                  segments, notes)
    tl.one_time_sites = one_time_sites
    return tl


class Built:
    """One device's runs as an analysis last parsed them and made them a program, kept by a fit between its
    analyses: where the next is of the same runs (the report's, after the last check), it starts from here, and
    the program's replays (``Timeline.simulate``) are already made. It holds the runs' traces (numbers and code
    locations, no user object) for the fit's lifetime; a fit that fails lets go of them with its runs."""

    def __init__(self) -> None:
        self.key: tuple[Any, ...] = ()
        self.parsed: list[Run] = []
        self.built: Timeline | str = ""

    def get(self, runs: Sequence[RunTrace], segments: Sequence[SegmentState], cell_files: frozenset[str],
            site_of: Callable[[Sequence[Mapping[str, Any]] | None], Site]) -> tuple[list[Run], Timeline | str]:
        key = (segments, cell_files, *runs)  # the runs themselves, held: no id of theirs is reused meanwhile
        if (len(key) != len(self.key) or key[:2] != self.key[:2]
                or any(a is not b for a, b in zip(key[2:], self.key[2:]))):
            self.parsed = [Run(r, site_of) for r in runs]
            self.built = build_timeline(self.parsed, segments)
            self.key = key
        return self.parsed, self.built


def _one_structure(counted: Sequence[Run], first: Run) -> bool:
    """Whether the runs share one structure: their event counts within ``EVENT_COUNT_RATIO`` (a loop over the
    value does not). A counted first run (no warm-up) made one-time allocations too: it is left out of the check
    where two other values ran, and else counted without what it made and kept."""
    later = [r for r in counted if r is not first]
    if len({r.value for r in later}) >= 2:
        counts = [len(r.events) for r in later]
    else:
        counts = [len(r.events) - (sum(1 for a in r.allocs if a.died is None) if r is first else 0)
                  for r in counted]
    return max(counts) <= EVENT_COUNT_RATIO * max(1, min(counts))


def _pairings(first: Run, template: Run, steady: Sequence[Run]) -> tuple[dict[int, dict[int, int]], bool]:
    """Each run's allocations paired with the template's (by ``id`` of the run), and whether every pairing was
    made by size (not by the events' shapes alone, for runs too long). The first run goes through its twin at the
    same value where there is one (an exact pairing), else straight to the template."""
    maps: dict[int, dict[int, int]] = {id(template): {i: i for i in range(len(template.allocs))}}
    by_size = True
    for r in steady:
        if r is not template:
            maps[id(r)], ok_size = align(r, template, exact=False)
            by_size &= ok_size
    if id(first) not in maps:
        twin = next((r for r in steady if r.value == first.value), None)
        if twin is not None:
            via = maps[id(twin)]
            pairs, ok_size = align(first, twin, exact=True)
            maps[id(first)] = {i: via[j] for i, j in pairs.items() if j in via}
        else:
            maps[id(first)], ok_size = align(first, template, exact=False)
        by_size &= ok_size
    return maps, by_size


def _size_models(template: Run, steady: Sequence[Run], maps: Mapping[int, Mapping[int, int]], by_size: bool,
                 notes: list[str]) -> list[SizeModel]:
    """Each template allocation's size as a model of the value, from its counterparts; what the models assume
    said in ``notes``."""
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
    notes.extend(_growth_notes(sizes))
    return sizes


def _growth_notes(sizes: Sequence[SizeModel]) -> list[str]:
    """What the size models say about growth faster than the value, or irregular."""
    notes = []
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
    return notes


def _first_run(first: Run, fmap: Mapping[int, int], notes: list[str]
               ) -> tuple[dict[int, tuple[int, int]], dict[int, int], list[int], list[Site]]:
    """The first run's allocations: those that line up follow the model (``ALLOC_TEMPLATE``, the template's
    allocation, never below the size they had), the rest are one-time, at their size (``ALLOC_ONE_TIME``). Each
    one's (code, ref), the template's sizes in the first run, and the one-time sizes and sites."""
    one_time: list[int] = []
    one_time_sites: list[Site] = []
    first_key: dict[int, tuple[int, int]] = {}
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
    return first_key, first_sizes, one_time, one_time_sites


def _steady_ops(ok: Sequence[Run], first: Run, template: Run, first_key: Mapping[int, tuple[int, int]],
                maps: Mapping[int, Mapping[int, int]], init: set[int], notes: list[str]) -> list[Op]:
    """The steady run's steps, one per event of the template: a block it frees that the run before it left is
    that run's leftover, by address; each allocation replaces what the run before left under its name."""
    unknown_frees = 0
    at = ok.index(template)
    prev = ok[at - 1] if at > 0 else None
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
    ops: list[Op] = []
    for kind, i in template.events:
        if kind == ALLOC:
            ops.append(Op(ALLOC_TEMPLATE, i, template.allocs[i].stream))
        elif kind == FREE:
            ops.append(Op(FREE_TEMPLATE, i))
        else:
            addr = template.externals[i][0]
            if addr in left:
                ops.append(left[addr])
            elif addr in init:
                ops.append(Op(FREE_BEFORE, addr))
            else:
                ops.append(Op(FREE_BEFORE, -1))  # nothing to free: kept as allocated
                unknown_frees += 1
    if unknown_frees:
        notes.append(f"{unknown_frees:,} frees of memory from before a run could not be placed: that memory is "
                     "kept as allocated")
    # Each allocation replaces what the run before left under its name (freed as it is made), unless a free of
    # that leftover was placed already; where two allocations claim one leftover, each replaces its own.
    freed_by_name = {op.ref for op in ops if op.code == FREE_LEFT}
    heads = _rebinding_heads(template)
    if len(set(heads.values())) < len(heads):  # two heads for one leftover: not one name, trust neither
        heads = {}
    return [op._replace(replaces=-1 if op.ref in freed_by_name else heads.get(op.ref, op.ref))
            if op.code == ALLOC_TEMPLATE else op for op in ops]


def _first_ops(first: Run, template: Run, first_key: Mapping[int, tuple[int, int]], steady_ops: Sequence[Op],
               init: set[int]) -> list[Op]:
    """The first run at a larger value: the steady run's steps, with what only the first run did put in where it
    did it (the warm-up at the smallest value lacks what only larger values allocate, a workspace say)."""
    ops: list[Op] = []
    done = 0

    def upto(pos: int) -> None:
        nonlocal done
        while done <= pos:
            ops.append(steady_ops[done])
            done += 1

    for kind, i in first.events:
        if kind == EXTERNAL:
            addr = first.externals[i][0]
            if addr in init:
                ops.append(Op(FREE_BEFORE, addr))
            continue
        code, j = first_key[i]
        if code == ALLOC_ONE_TIME:
            ops.append(Op(ALLOC_ONE_TIME, j, first.allocs[i].stream) if kind == ALLOC else Op(FREE_ONE_TIME, j))
        elif kind == ALLOC:
            upto(template.allocs[j].born)
        else:
            died = template.allocs[j].died
            if died is None:  # the first run freed what later runs keep: it is freed here
                ops.append(Op(FREE_TEMPLATE, j))
            else:
                upto(died)
    upto(len(steady_ops) - 1)
    return ops


__all__ = [
    "ALLOC_ONE_TIME",
    "ALLOC_TEMPLATE",
    "FREE_BEFORE",
    "FREE_LEFT",
    "FREE_ONE_TIME",
    "FREE_TEMPLATE",
    "Built",
    "Op",
    "Sim",
    "Timeline",
    "build_timeline",
]
