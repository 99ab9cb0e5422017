"""The fit's model of a body's runs: each run's allocations read from its allocator trace (``Run``) and paired
with another run's (``align``), the room a fit has (``Room``) and its margin. ``timeline`` makes the runs a program
of the value and replays it through the allocator model.

Pure analysis over the runs' allocator trace entries (``fit`` explains the method and says what it finds).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any

from nbmem.fitting.analysis.sizes import GROWTH_SLACK_BYTES
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
class Checked:
    """A value run past the model's answer on one device (``nearby.beyond``): ``steps`` steps in a row with the
    allocator held to ``cap_bytes`` (the room less the margin), which ran; its peaks there. The answer is at
    least its value, in a room no smaller than its peak reserved (than that cap, where the peak is unknown)."""

    value: int
    steps: int
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    cap_bytes: int

    def note(self, name: str, model_value: int) -> str:
        return (f"checked past the model: {self.steps} steps in a row at {name}={self.value:,} ran with the allocator "
                f"held to {fmt_bytes(self.cap_bytes)} (the room less the margin), so the answer is "
                f"{self.value:,}, above the model's {model_value:,} (near the limit these runs took less than the "
                "model keeps: a buffer that stops growing, a workspace given up for another algorithm)")


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

    @classmethod
    def sizes(cls, trace: RunTrace) -> Run:
        """The run read for its sizes and peaks alone: no allocation's site is looked up."""
        return cls(trace, _no_site)


def _no_site(frames: Sequence[Mapping[str, Any]] | None) -> None:
    return None


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


def _align_sizes(a: Run, b: Run) -> dict[int, int] | None:
    """The order-keeping pairing of the two runs' allocations with the best total score (same stream, line, and
    kept or not; a bonus for the same lifetime), by dynamic programming in a band around the diagonal; None when
    the band would be too large. A pair scores 3 for the same size or the same size per unit of the value, 1 for
    growth at most with the value's square, 0 where one cannot be the other."""
    xa, xb = a.allocs, b.allocs
    n, m = len(xa), len(xb)
    band = abs(n - m) + ALIGN_BAND
    if n * (2 * band + 1) > ALIGN_MAX_CELLS:
        return None
    va, vb = a.value, b.value
    # The score is worked out inline: this loop runs n × band times, for each of a fit's analyses. The growth
    # bound's ratio is the same for every pair; ``a_small``: A's value is the smaller one, ``same``: the values are
    # equal (then only equal sizes pair).
    same, a_small = va == vb, va < vb
    ratio2 = 0.0 if same else (max(va, vb) / min(va, vb)) ** 2
    # What must agree for a pairing (stream, line, kept or not) is one small int per allocation, and B's sizes
    # and lifetimes plain lists.
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
                    sb = size_b[j - 1]
                    if size_a == sb or size_a * vb == sb * va:
                        w = 3
                    elif same:
                        w = 0
                    elif a_small:
                        w = 1 if size_a < sb <= size_a * ratio2 + GROWTH_SLACK_BYTES else 0
                    else:
                        w = 1 if sb < size_a <= sb * ratio2 + GROWTH_SLACK_BYTES else 0
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


def align(a: Run, b: Run, *, exact: bool) -> tuple[dict[int, int], bool]:
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
