"""Will it fit? The largest value of one variable a cell's body can run at, from a few small runs.

Pure analysis over plain data: each run's allocator trace entries for one device (the dicts of
``torch.cuda.memory._snapshot()["device_traces"][i]``: ``action``, ``addr``, ``size``, ``stream`` and,
with stacks, ``frames``), the allocator's segments before the first run (``torch.cuda.memory_snapshot()``)
and the memory there is (``Room``). No torch, no IPython: ``fitting`` runs the body and hands the data here.

How, in four steps:

1. *Align.* The same code allocates in the same order whatever the value. Runs of one shape (every event's
   action, stream, line and lifetime the same) line up one to one. Where they differ (a workspace one size
   asks for and another does not, which shifts every lifetime around it), the allocations are paired in
   order by size: the same bytes (fixed), the same bytes per unit (per sample), or growth the values allow.
   A transient allocation only larger values make (a library workspace, an algorithm chosen by size) keeps
   its size; one a run keeps, without a counterpart, is taken to grow in proportion. If the runs' event
   counts grow with the value (a loop over it), no pairing is trusted and the largest run's peak is scaled.
2. *Model* each aligned allocation's size as fixed + per-unit × value; quadratic where three or more values
   show the growth speeding up with non-negative terms (attention scores in the sequence length); a power
   law where it speeds up faster at one steady rate; a line with the steepest slope seen where a size jumped.
   Allocations only the first run makes (optimizer state, cuBLAS workspaces) keep the size they had.
3. *Simulate* the whole timeline at a candidate value through a model of PyTorch's CUDA caching allocator
   (512-byte blocks, a small pool of 2 MiB segments, a large pool of 20 MiB or 2 MiB-rounded segments, best
   fit with its splitting rules, and on a failed cudaMalloc every whole cached segment given back and one
   retry), starting from the allocator's segments as they are: the first run (the steady run's events with
   the first run's one-time allocations put in where it made them), then the steady run twice, so what one
   run leaves is there while the next runs (a notebook variable is freed when the next run rebinds it). It
   is reserved memory, not allocated, that must fit. On an H100 the model, fed the real events of three
   training steps at the measured out-of-memory boundary, fitted and failed exactly where CUDA did.
4. *Search* the largest value whose simulation never needs more than the room (free plus what this
   process's allocator holds, minus a stated margin). The peak can move between phases as the value
   grows (the optimizer step at small batches, the forward's activations at large ones): the maximum is
   taken over the whole timeline at each candidate, never a line through peaks.

What it cannot see errs low, never high: kernels that at very large sizes switch to chunked work with smaller
buffers (a matrix product over a huge batch, attention backward's split accumulation) and buffers sized by
the data (an embedding's backward, by the distinct rows a batch touches) are modelled from the small runs,
larger than they turn out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from nbmem.fitting.analysis.allocator import CachingAllocatorModel, SegmentState, segment_bytes
from nbmem.fitting.analysis.devices import DeviceFit
from nbmem.fitting.analysis.model import ALLOC, FREE, MARGIN_FRACTION, Checked, Room, Run, RunTrace, Site
from nbmem.fitting.analysis.modelled import Remedy, accumulation
from nbmem.fitting.analysis.modelled import expandable as expandable_segments
from nbmem.fitting.analysis.search import SEARCH_CAP, below_failure, largest_fitting
from nbmem.fitting.analysis.sizes import fit_size
from nbmem.fitting.analysis.timeline import Built, Sim, Timeline
from nbmem.formatting import Column, esc, fmt_bytes, fmt_seconds, html_table, prose, text_table
from nbmem.records import block_bytes
from nbmem.reports import Shown
from nbmem.trace.linetrace import cell_line, deepest_user_frame

if TYPE_CHECKING:
    from nbmem.fitting.analysis.hostroom import HostFit


def power_of_two_below(value: int) -> int:
    """The largest power of two not above ``value``."""
    return 1 << (value.bit_length() - 1)


# -- the result ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FitPoint:
    """One run of the fit: its value and the peaks its trace shows."""

    value: int
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    counted: bool = True  # False: the warm-up run
    oom: bool = False
    skipped: bool = False  # not run: predicted not to fit


@dataclass(frozen=True, slots=True)
class GrowthLine:
    """A line whose memory live at the peak grows with the value."""

    line: int | None  # the cell's line; None for code outside the cell (``where`` names it)
    where: str  # the line's source, or the frame outside the cell
    bytes_per_unit: float
    bytes_per_unit_sq: float
    bytes_at_largest: int | None


@dataclass(frozen=True, repr=False)
class FitResult(Shown):
    """``%%cudamem --fit``: the largest value that fits, the model behind it, and what it assumes."""

    name: str
    device: str
    values: tuple[int, ...]
    points: tuple[FitPoint, ...]
    room: Room | None
    largest_value: int | None = None
    power_of_two: int | None = None
    reason: str = ""  # why there is no prediction; "" when there is one
    method: str = ""  # "timeline", "scaled peak", or "" when nothing was fitted
    fixed_bytes: float | None = None  # at the peak: what does not grow (weights, gradients, optimizer state, ...)
    bytes_per_unit: float | None = None
    bytes_per_unit_sq: float | None = None
    peak_allocated_at_largest_bytes: int | None = None
    peak_reserved_at_largest_bytes: int | None = None
    peak_where: tuple[str, str] = ("", "")  # where the peak is at the smallest value and at the prediction
    lines: tuple[GrowthLine, ...] = ()
    curve: tuple[tuple[int, int, int], ...] = ()  # (value, modelled peak allocated bytes, peak reserved bytes)
    notes: tuple[str, ...] = ()
    want: int | None = None  # the value asked about (``--want``)
    remedies: tuple[Remedy, ...] = ()  # when ``want`` does not fit: what would let it run
    restored_bytes: int | None = None
    restored: tuple[str, ...] = ()  # what was put back after the fit, a line each
    not_restored: tuple[str, ...] = ()  # what the body may have changed that could not be put back, a line each
    steps_run: int = 0
    duration_s: float | None = None
    devices: tuple[DeviceFit, ...] = ()  # each device the runs allocated on, with its own answer
    capped: str = ""  # what capped the answer below the model's own, said with it ("" when nothing did)
    host: HostFit | None = None  # host memory, where the runs keep memory there (``hostroom``)
    failure: str = ""  # where the value above the answer runs out in the model, what the allocator held then

    # -- for code -----------------------------------------------------------------------------------------------
    def row(self) -> dict[str, Any]:
        """The prediction and its model as one flat row."""
        room = self.room
        return {"name": self.name, "device": self.device, "values": list(self.values),
                "largest_value": self.largest_value, "power_of_two": self.power_of_two, "reason": self.reason,
                "method": self.method, "fixed_bytes": self.fixed_bytes, "bytes_per_unit": self.bytes_per_unit,
                "bytes_per_unit_sq": self.bytes_per_unit_sq,
                "peak_allocated_at_largest_bytes": self.peak_allocated_at_largest_bytes,
                "peak_reserved_at_largest_bytes": self.peak_reserved_at_largest_bytes,
                "capacity_bytes": room.capacity_bytes if room else None,
                "free_bytes": room.free_bytes if room else None,
                "reserved_bytes": room.reserved_bytes if room else None,
                "held_bytes": room.allocated_bytes if room else None,
                "margin_bytes": room.margin_bytes if room else None,
                "want": self.want,
                "remedies": [{"remedy": r.name, "largest_value": r.largest_value, "setting": r.setting,
                              "time_per_sample_ratio": r.time_per_sample_ratio} for r in self.remedies],
                "restored_bytes": self.restored_bytes, "restored": list(self.restored),
                "not_restored": list(self.not_restored), "steps_run": self.steps_run, "duration_s": self.duration_s,
                "limited_by": self.limited_by.device if self.limited_by else None,
                "host_limits": bool(self.host and self.host.limits),
                "host_largest_value": (self.host.largest_value if self.host and self.host.room and
                                       (self.host.largest_value or 0) < SEARCH_CAP else None),
                "host_capacity_bytes": self.host.room.capacity_bytes if self.host and self.host.room else None,
                "devices": {f.device: f.largest_value for f in self.devices}}

    def to_frame(self) -> Any:
        """One row per run and per modelled value (``kind``: run, warm-up, model), as a pandas DataFrame."""
        import pandas as pd

        rows = [{"kind": "warm-up" if not p.counted else "run", **asdict(p)} for p in self.points]
        rows += [{"kind": "model", "value": v, "peak_allocated_bytes": a, "peak_reserved_bytes": r, "counted": False,
                  "oom": False, "skipped": False} for v, a, r in self.curve]
        return pd.DataFrame(rows, columns=["kind", "value", "peak_allocated_bytes", "peak_reserved_bytes", "counted",
                                           "oom", "skipped"])

    @property
    def limited_by(self) -> DeviceFit | None:
        """The device whose answer is the fit's, where the runs used several (None with one)."""
        return next((f for f in self.devices if f.limits), None) if len(self.devices) > 1 else None

    # -- for people ----------------------------------------------------------------------------------------------
    def _head(self) -> str:
        return f"nbmem fit · {self.name} · {self.device}"

    def answer(self) -> str:
        """The answer in one line: the largest value that fits, or why there is none."""
        if self.largest_value is None:
            return f"no prediction: {self.reason}"
        pow2 = "" if self.power_of_two in (None, self.largest_value) else (
            f" (power of two below: {self.power_of_two:,})")
        wanted = "" if self.want is None else (f"; {self.want:,} fits" if self.want <= self.largest_value else
                                               f"; {self.want:,} does not fit")
        by = "" if self.limited_by is None else f"; limited by {self.limited_by.label}"
        capped = f"; {self.capped}" if self.capped else ""
        return f"largest {self.name} that fits: {self.largest_value:,}{pow2}{wanted}{by}{capped}"

    def _room(self) -> str:
        r = self.room
        if r is None:
            return ""
        pct = 100 * r.margin_bytes / max(1, r.free_bytes + r.reserved_bytes - r.allocated_bytes)
        others = "" if r.others_bytes is None else (
            f"; other processes and CUDA contexts take {fmt_bytes(r.others_bytes)} of {fmt_bytes(r.total_bytes)}")
        share = f"{pct:.0f} %" if pct >= 1 else f"{pct:.1g} %"  # a margin set by hand can be a sliver
        on = f" on {r.device}" if len(self.devices) > 1 else ""  # the device that limits the answer
        return (f"fits into {fmt_bytes(r.capacity_bytes)}{on}: {fmt_bytes(r.free_bytes)} free + "
                f"{fmt_bytes(r.reserved_bytes)} this process's allocator holds − {fmt_bytes(r.margin_bytes)} margin "
                f"({share}); the notebook already holds {fmt_bytes(r.allocated_bytes)}{others}")

    def _model(self) -> str:
        if self.fixed_bytes is None or self.bytes_per_unit is None:
            return ""
        sq = f" + {fmt_bytes(self.bytes_per_unit_sq)} per {self.name}²" if self.bytes_per_unit_sq else ""
        at = ""
        if self.largest_value is not None and self.peak_reserved_at_largest_bytes is not None:
            at = (f"; at {self.largest_value:,}: peak {fmt_bytes(self.peak_allocated_at_largest_bytes)} allocated, "
                  f"{fmt_bytes(self.peak_reserved_at_largest_bytes)} reserved")
        return (f"at the peak: {fmt_bytes(self.fixed_bytes)} fixed + {fmt_bytes(self.bytes_per_unit)} per {self.name}"
                f"{sq}{at}")

    def _where(self) -> str:
        small, large = self.peak_where
        if not small and not large:
            return ""
        if small == large:
            return f"the peak is at {small}"
        lo = self.values[0] if self.values else "the smallest value"
        hi = f"{self.largest_value:,}" if self.largest_value is not None else "the largest"
        return f"the peak moves: at {self.name}={lo} it is at {small or 'another moment'}, at {hi} at {large}"

    def _line_rows(self) -> list[list[str]]:
        return [["" if g.line is None else str(g.line), g.where[:80], fmt_bytes(g.bytes_per_unit),
                 fmt_bytes(g.bytes_per_unit_sq) if g.bytes_per_unit_sq else "", fmt_bytes(g.bytes_at_largest)]
                for g in self.lines]

    def _line_columns(self) -> tuple[Column, ...]:
        return (Column("line", numeric=True), Column("source", code=True), Column(f"per {self.name}", numeric=True),
                Column(f"per {self.name}²", numeric=True),
                Column(f"at {self.largest_value:,}" if self.largest_value else "at the largest", numeric=True))

    def _point_rows(self) -> list[list[str]]:
        rows = []
        for p in self.points:
            what = "warm-up (not counted)" if not p.counted else ("out of memory" if p.oom else (
                "not run: predicted not to fit" if p.skipped else ""))
            rows.append([f"{p.value:,}", fmt_bytes(p.peak_allocated_bytes), fmt_bytes(p.peak_reserved_bytes), what])
        return rows

    _POINT_COLUMNS = (Column("value", numeric=True), Column("peak allocated", numeric=True),
                      Column("peak reserved", numeric=True), Column("run"))

    def _facts(self) -> list[str]:
        facts = [f.line(self.name) for f in self.devices] if len(self.devices) > 1 else []
        facts += [self._room(), self._model(), self.failure, self._where()]
        if self.host is not None:
            facts.append(self.host.line(self.name, self.largest_value))
        if self.restored_bytes is not None:
            facts.append(f"put back after the fit ({fmt_bytes(self.restored_bytes)} copied to host and back):")
            facts += [f"  restored: {r}" for r in self.restored]
        facts += [f"  not restored: {r}" for r in self.not_restored]
        if self.duration_s is not None:
            facts.append(f"took {fmt_seconds(self.duration_s)}")
        return [f for f in facts if f]

    def _remedy_rows(self) -> list[list[str]]:
        return [[r.name, f"{r.largest_value:,}", "" if r.time_per_sample_ratio is None else
                 f"{r.time_per_sample_ratio:.2f}×", r.setting, r.how] for r in self.remedies]

    def _remedy_columns(self) -> tuple[Column, ...]:
        return (Column("remedy"), Column(f"largest {self.name}", numeric=True),
                Column("time per sample", numeric=True), Column("setting", code=True),
                Column("how it was established"))

    def __str__(self) -> str:
        parts = [self._head(), self.answer(), *self._facts()]
        if self.remedies:
            parts += [f"to run {self.name}={self.want:,}:", text_table(self._remedy_columns(), self._remedy_rows())]
        if self.lines:
            parts += ["lines whose memory grows:", text_table(self._line_columns(), self._line_rows())]
        if self.points:
            parts += ["runs:", text_table(self._POINT_COLUMNS, self._point_rows())]
        parts += [f"- {n}" for n in self.notes]
        return "\n".join(parts)

    def _repr_html_(self) -> str:
        parts = [f"<div class='nbmem-report'><div style='font-weight:600'>{esc(self._head())}</div>",
                 f"<div style='font-size:1.1em'>{esc(self.answer())}</div>"]
        parts += [f"<div>{esc(f)}</div>" for f in self._facts()]
        if self.remedies:
            parts.append(html_table(self._remedy_columns(), self._remedy_rows(),
                                    caption=f"to run {self.name}={self.want:,}"))
        if self.lines:
            parts.append(html_table(self._line_columns(), self._line_rows(), caption="lines whose memory grows"))
        if self.points:
            parts.append(html_table(self._POINT_COLUMNS, self._point_rows(), caption="runs"))
        if self.notes:
            parts.append("<ul style='margin:2px 0'>" + "".join(f"<li>{prose(n)}</li>" for n in self.notes) + "</ul>")
        parts.append("</div>")
        return "".join(parts)


#: What every prediction assumes, said with each result.
ASSUMPTIONS = (
    "the body is representative: it allocates the same way at larger values (no other algorithm with a larger "
    "workspace, no loop over the value)",
    "other processes do not take more of the device later",
)


def _site_of(cell_files: frozenset[str]) -> Callable[[Sequence[Mapping[str, Any]] | None], Site]:
    def site(frames: Sequence[Mapping[str, Any]] | None) -> Site:
        if not frames:
            return None
        if cell_files:
            ln = cell_line(frames, cell_files)
            if ln is not None:
                return ln
        return deepest_user_frame(frames, cell_files) or None
    return site


def _site_text(site: Site, sources: Mapping[int, str]) -> tuple[int | None, str]:
    if isinstance(site, int):
        return site, sources.get(site, "").strip()
    return None, "" if site is None else str(site)


def _place(site: Site, sources: Mapping[int, str]) -> str:
    if isinstance(site, int):
        src = sources.get(site, "").strip()
        return f"line {site}" + (f" (`{src[:60]}`)" if src else "")
    return "" if site is None else str(site)


def analyse(runs: Sequence[RunTrace], room: Room, *, name: str = "value", segments: Sequence[SegmentState] = (),
            cell_files: frozenset[str] = frozenset(), sources: Mapping[int, str] | None = None,
            max_value: int | None = None, notes: Sequence[str] = (), skipped: Sequence[int] = (),
            want: int | None = None, expandable: bool = False, measured: Sequence[Remedy] = (),
            remedy_notes: Sequence[str] = (), largest_only: bool = False, memo: Built | None = None,
            checked: Checked | None = None) -> FitResult:
    """The largest value that fits into ``room``, from the runs' traces in the order they ran.

    ``segments`` is the allocator's state before the first run (``segments_from_snapshot``); without it
    the allocator is taken to start empty. ``cell_files`` and ``sources`` name the cell's lines where the
    traces have stacks. ``max_value`` caps the search; ``skipped`` are values not run (predicted not to fit).
    ``want``: a value asked about; where it does not fit, ``remedies`` says what would let it run
    (``expandable``: the allocator already uses expandable segments, so that is no remedy); ``measured`` are
    remedies the runner measured with runs of their own, and ``remedy_notes`` says which it left out and why.
    ``largest_only``: the largest value (and the method, or why there is none) without what the report draws
    from it (lines, the curve, remedies): what the runner asks between runs. ``memo``: the runs as the fit's
    last analysis left them (``Built``). ``checked``: a value run past the model's answer with the allocator held to
    ``room`` (``nearby.beyond``), which the answer is then, with that run's peaks.
    """
    sources = sources or {}
    parsed, built = (memo or Built()).get(runs, segments, cell_files, _site_of(cell_files))
    points = tuple(FitPoint(p.value, p.peak_allocated_bytes, p.peak_reserved_bytes, p.counted, p.oom)
                   for p in parsed) + tuple(FitPoint(v, None, None, skipped=True) for v in skipped)
    values = tuple(sorted({r.value for r in runs if r.counted and not r.oom}))
    all_notes = list(notes)
    failed = min((r.value for r in runs if r.oom), default=None)
    cap = min([SEARCH_CAP] + ([failed - 1] if failed is not None else []) + ([max_value] if max_value else []))
    base = FitResult(name=name, device=room.device, values=values, points=points, room=room, want=want)
    capacity = room.capacity_bytes
    if built == "structure":
        scaled = _scaled_peak(parsed, segments, capacity, cap, base, all_notes, failed)
        if want is not None and scaled.largest_value is not None and want > scaled.largest_value:
            scaled = replace(scaled, remedies=(*accumulation(name, scaled.largest_value, want), *measured),
                             notes=(*scaled.notes, *remedy_notes))
        return scaled
    if isinstance(built, str):
        if failed is not None:
            all_notes.append(f"{name}={failed:,} ran out of memory in its run")
        return replace(base, reason=built, notes=tuple(all_notes))
    tl = built
    capped, below = "", SEARCH_CAP  # the cap a failed run puts on the answer, and the clause that says so
    if failed is not None:
        got, capped = _below_failure(lambda v: tl.simulate(v, math.inf).peak_reserved_bytes, failed, room, name,
                                       all_notes, _asked(parsed, failed))
        if got is None:
            return replace(base, method="timeline", reason=capped, notes=tuple(all_notes))
        below = got
        cap = min(cap, below)
    all_notes += tl.notes
    if len(values) == 2:
        all_notes.append("two values show linear growth only: a third value would show growth that speeds up "
                         "(such as attention scores in the sequence length)")

    def fits_up(v: int) -> bool:
        return tl.simulate(v, capacity).ok  # the timeline keeps each replay: asking again costs nothing

    def fits(v: int) -> bool:
        # Among free blocks of one size the allocator takes the lowest address, and where cudaMalloc puts a new
        # segment is the driver's choice: a value fits only if it fits with new segments above all others and
        # with them below (where blocks are a sixth of the GPU, that choice alone decided a real OOM). Without
        # a tie in the large pool on the way up, the other order makes the same choices there.
        up = tl.simulate(v, capacity)
        return up.ok and (not up.ties or tl.simulate(v, capacity, descending=True).ok)

    # The search runs with one order and checks the answer, and below it, with both: over 30 recorded rows the
    # analysis takes 12 % longer than with one order, where both at every step took 29 %.
    largest = largest_fitting(fits_up, values[-1], cap)
    if largest is not None and largest < SEARCH_CAP:
        largest = largest_fitting(fits, largest, largest)
    timeline = replace(base, method="timeline")
    if largest is not None and largest >= SEARCH_CAP:
        return replace(timeline, notes=tuple(all_notes),
                       reason=f"its memory does not grow with {name} in these runs: any value fits, as far as "
                       "they tell")
    if largest is None:
        why = f"even {name}=1 does not fit into {fmt_bytes(capacity)}" if cap >= 1 else "no value is left below the cap"
        return replace(timeline, reason=why, notes=tuple(all_notes))
    if max_value is not None and largest >= max_value:
        all_notes.append(f"{name}={max_value:,}, the largest value asked about, fits: larger ones were not searched")
    capped = capped if largest >= below else ""
    past = checked if checked is not None and largest < checked.value <= cap else None
    # A run whose reserved memory never passed ``need`` runs the same under any cap at or above it: the room may
    # have shrunk since (kernels the later runs loaded) below the cap, not below that.
    need = None if past is None else past.cap_bytes if past.peak_reserved_bytes is None else past.peak_reserved_bytes
    if past is not None and need is not None and need > capacity:
        all_notes.append(f"{name}={past.value:,} ran past the model's answer, its peak at {fmt_bytes(need)} reserved, "
                         f"and the room is {fmt_bytes(capacity)} now: the answer is the model's")
        past = None
    if past is not None:
        all_notes.append(past.note(name, largest))
        largest = past.value
    if largest_only:
        return replace(timeline, largest_value=largest, notes=tuple(all_notes), capped=capped)
    # Past the model's answer its replay in the room fails: the report's peaks are the checked run's.
    at = tl.simulate(largest, capacity if past is None else math.inf)
    peaks = ((at.peak_allocated_bytes, at.peak_reserved_bytes) if past is None else
             (past.peak_allocated_bytes, past.peak_reserved_bytes))
    if at.ties and past is None:  # the report's reserved peak is the larger of the two orders'
        at = max(at, tl.simulate(largest, capacity, descending=True), key=lambda s: s.peak_reserved_bytes)
    small = tl.simulate(values[0], math.inf)
    failure = _failure(tl, largest + 1, capacity, sources) if largest < cap and past is None else ""
    live = tl.simulate(largest, math.inf, stop_at=_after(at.peak_at, tl)).live or {}
    fixed, per, sq, by_line = tl.decompose(live)
    lines = []
    for site, (b, c) in by_line.items():
        if site is None:
            continue
        ln, where = _site_text(site, sources)
        lines.append(GrowthLine(ln, where, b, c, math.ceil(b * largest + c * largest * largest)))
    lines.sort(key=lambda g: -(g.bytes_at_largest or 0))
    if all(s is None for s in tl.sites):
        all_notes.append("the traces have no stacks: record them with stacks to see which lines grow")
    curve = _curve(lambda v: tl.simulate(v, math.inf), values[0], max(largest, values[-1]))
    remedies: list[Remedy] = []
    if want is not None and want > largest:
        remedies += accumulation(name, largest, want)
        remedies += measured
        all_notes += remedy_notes
        if not expandable:
            remedies += expandable_segments(tl, name, largest, capacity, cap, all_notes)
    return replace(timeline, remedies=tuple(remedies), largest_value=largest, power_of_two=power_of_two_below(largest),
                   capped=capped,
                   fixed_bytes=fixed, bytes_per_unit=per, bytes_per_unit_sq=sq,
                   peak_allocated_at_largest_bytes=peaks[0], peak_reserved_at_largest_bytes=peaks[1],
                   peak_where=(_phase_place(tl, small.peak_at, sources), _phase_place(tl, at.peak_at, sources)),
                   failure=failure,
                   lines=tuple(lines[:8]), curve=curve, notes=(*all_notes, *ASSUMPTIONS))


def _asked(parsed: Sequence[Run], failed: int) -> int | None:
    """The largest single request the run that failed could not get (where its trace says)."""
    return max((r.oom_request_bytes for r in parsed if r.oom and r.value == failed and r.oom_request_bytes is not None),
               default=None)


def _below_failure(peak: Callable[[int], float], failed: int, room: Room, name: str,
                   notes: list[str], asked: int | None = None) -> tuple[int | None, str]:
    """The cap a run that failed at ``failed`` puts on the answer, and the clause that says so (or, with no
    value under it, why there is no answer).

    The failed run says the room is no larger than what the model gives that value (the model was wrong there, and
    errs the same way below it), unless it failed on one request larger than all the room (``asked``), which says
    nothing of the values below it; the answer keeps the margin a prediction keeps below the room, below that:
    the room's margin, and never less than ``MARGIN_FRACTION``
    (a margin set by hand can be nil, and the model was wrong at that value).
    """
    if asked is not None and asked > room.capacity_bytes:
        # One request larger than all the room there is: that run failed on it whatever else was held, which says
        # nothing of the room the values below it need (the model answers for those, against the room).
        why = (f"{name}={failed:,} asked for {fmt_bytes(asked)} at once, more than the device's whole room "
               f"({fmt_bytes(room.capacity_bytes)}): the answer stays below it")
        notes.append(why)
        return failed - 1, f"below the failed run at {failed:,}"
    at = peak(failed)
    margin = max(room.margin_bytes, math.ceil(MARGIN_FRACTION * at))
    below = below_failure(peak, failed, margin)
    share = f"{100 * margin / max(1.0, at):.0f} %"
    if below is None:
        why = (f"{name}={failed:,} ran out of memory in its run, and no smaller {name} is modelled to need "
               f"{fmt_bytes(margin)} ({share}) less")
        notes.append(why)
        return None, why
    notes.append(f"{name}={failed:,} ran out of memory in its run: the answer stays under what the model gives it "
                 f"({fmt_bytes(at)} reserved) by the margin a prediction keeps, {fmt_bytes(margin)} ({share}): "
                 f"at most {below:,}")
    return below, f"capped below the failed run at {failed:,}, with the {share} margin"


def _after(at: tuple[int, int], tl: Timeline) -> tuple[int, int]:
    """The op just after ``at``: what is live then is what was live at the peak."""
    phase, op = at
    n = len(tl.first_ops if phase == 0 else tl.steady_ops)
    return (phase, op + 1) if op + 1 < n else (phase + 1, 0)


def _failure(tl: Timeline, value: int, capacity: float, sources: Mapping[int, str]) -> str:
    """Where ``value`` (the one above the answer) runs out in the model, and what the allocator held then: the
    figure an out-of-memory error would print, where the peak reserved is what stood before the cache was given
    back. "" where it does not run out in either order (fragmentation or a failed run capped the answer)."""
    s = tl.simulate(value, capacity)
    if s.ok and s.ties:
        s = tl.simulate(value, capacity, descending=True)
    if s.ok or s.failed_at is None:
        return ""
    seg = segment_bytes(block_bytes(s.request_bytes))
    return (f"at {value:,}, {_phase_place(tl, s.failed_at, sources)} runs out: a request for "
            f"{fmt_bytes(s.request_bytes)} needs a new segment of {fmt_bytes(seg)}, and "
            f"{fmt_bytes(max(0, capacity - s.reserved_at_failure_bytes))} of the {fmt_bytes(capacity)} room is left "
            f"({fmt_bytes(s.reserved_at_failure_bytes)} reserved, {fmt_bytes(s.allocated_at_failure_bytes)} of it "
            "allocated, the cache given back)")


def _phase_place(tl: Timeline, at: tuple[int, int], sources: Mapping[int, str]) -> str:
    phase, op = at
    site = tl.site_at(phase, op)
    run = "the first run" if phase == 0 else "a later run"
    place = _place(site, sources)
    return f"{place} of {run}" if place else run


def _curve(sim: Callable[[int], Sim], lo: int, hi: int, points: int = 12) -> tuple[tuple[int, int, int], ...]:
    """The model's peaks over a geometric grid from the smallest value to a quarter past the prediction."""
    top = max(hi + hi // 4, lo + 1)
    grid = sorted({max(1, round(lo * (top / lo) ** (k / (points - 1)))) for k in range(points)} | {hi})
    out = []
    for v in grid:
        s = sim(v)
        out.append((v, s.peak_allocated_bytes, s.peak_reserved_bytes))
    return tuple(out)


def _scaled_peak(runs: Sequence[Run], segments: Sequence[SegmentState], capacity: int, cap: int,
                 base: FitResult, notes: list[str], failed: int | None) -> FitResult:
    """When the runs do not share one structure: the largest run's peak, scaled conservatively."""
    steady = [r for r in runs if r.counted and not r.oom]
    model = fit_size((r.value, r.peak_growth_bytes) for r in steady)
    template = max(steady, key=lambda r: r.value)
    vn, gn = template.value, template.peak_growth_bytes
    # What the allocator reserves for the largest run as recorded, over what it allocated: its overhead.
    alloc = CachingAllocatorModel(math.inf, segments)
    start_reserved = alloc.reserved_bytes
    live: dict[int, int] = {}
    for kind, i in template.events:
        if kind == ALLOC:
            a = template.allocs[i]
            got = alloc.malloc(a.size, a.stream)
            if got is not None:
                live[i] = got
        elif kind == FREE and i in live:
            alloc.free(live.pop(i))
    overhead = max(1.0, (alloc.peak_reserved_bytes - start_reserved) / gn) if gn > 0 else 1.0

    def growth(v: int) -> float:
        return model.at(v) if model.kind == "quadratic" else max(model.at(v), gn * v / vn)

    notes.append(f"the runs do not share one structure (their event counts differ: "
                 f"{', '.join(f'{len(r.events):,}' for r in steady)}), so no allocation could be followed from one "
                 "value to the next: the prediction scales the largest run's peak in proportion to the value "
                 "(conservative)")
    scaled = replace(base, method="scaled peak", notes=tuple(notes))
    capped, below = "", SEARCH_CAP
    if failed is not None and base.room is not None:
        got, capped = _below_failure(lambda v: start_reserved + overhead * growth(v), failed, base.room, base.name,
                                       notes, _asked(runs, failed))
        if got is None:
            return replace(scaled, reason=capped, notes=tuple(notes))
        below = got
        cap = min(cap, below)
    largest = largest_fitting(lambda v: start_reserved + overhead * growth(v) <= capacity, vn, cap)
    if largest is None:
        return replace(scaled, reason=f"even {base.name}=1 does not fit into {fmt_bytes(capacity)}")
    if largest >= SEARCH_CAP:
        return replace(scaled, reason=f"its memory does not grow with {base.name} in these runs")
    lo = steady[0].value
    grid = sorted({max(1, round(lo * (1.25 * largest / lo) ** (k / 23))) for k in range(24)})
    curve = tuple((v, int(start_reserved + growth(v)), int(start_reserved + overhead * growth(v))) for v in grid)
    return replace(scaled, largest_value=largest, power_of_two=power_of_two_below(largest),
                   capped=capped if largest >= below else "", fixed_bytes=float(start_reserved),
                   bytes_per_unit=gn / vn, bytes_per_unit_sq=0.0,
                   peak_reserved_at_largest_bytes=int(start_reserved + overhead * growth(largest)), curve=curve,
                   notes=(*notes, *ASSUMPTIONS))


def proportional_bound(run: RunTrace, value: int) -> int | None:
    """An upper bound on a run's peak allocated bytes at a larger ``value``, from one run: its growth
    scaled in proportion (exact for growth without a fixed part, above it with one). None: unknown start."""
    if run.allocated_before_bytes is None:
        return None
    r = Run.sizes(run)
    return run.allocated_before_bytes + math.ceil(r.peak_growth_bytes * value / max(1, run.value))


__all__ = ["ASSUMPTIONS", "FitPoint", "FitResult", "GrowthLine", "analyse",
           "power_of_two_below", "proportional_bound"]
