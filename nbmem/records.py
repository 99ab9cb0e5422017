"""The records every layer shares: readings, samples, cell records, findings, cleanup reports.

Small frozen dataclasses with units in their field names. They hold numbers and names, never the
objects they describe, and render themselves (text for terminals, HTML for notebooks). ``None``
means unknown; it is shown as NA, never as 0.
"""

from __future__ import annotations

import datetime as _dt
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from .formatting import Column, esc, fmt_bytes, fmt_seconds, html_table, is_na, prose, text_table


class HolderKind(StrEnum):
    """What keeps a storage alive, which decides how it is freed (``cleanup_of``)."""

    NAMESPACE = "namespace"  # a variable of the notebook, or something inside one
    OUTPUT = "output"  # IPython's output history: Out[n], _n, _, __, ___, the last result
    TRACEBACK = "traceback"  # the frames of the last exception
    MODULE = "module"  # an attribute of a module the notebook made (in sys.modules)



#: The output names IPython moves on every displayed result; a change among them is no news.
ROTATING_OUTPUTS = ("_", "__", "___")
LAST_RESULT = "<last result>"
_OUTPUT_N = re.compile(r"_\d+\Z")
_INPUT_N = re.compile(r"_i+\d*\Z")


def is_output_name(name: str) -> bool:
    """IPython's output-cache names: ``_``, ``__``, ``___`` and ``_<n>``."""
    return name in ROTATING_OUTPUTS or bool(_OUTPUT_N.match(name))


def is_cache_name(name: str) -> bool:
    """Output- and input-cache names (``_i``, ``_ii``, ``_i12``): IPython's, not the user's."""
    return is_output_name(name) or bool(_INPUT_N.match(name))


def root_name(path: str) -> str:
    """The top-level name a holder path starts from (``losses[3]`` → ``losses``)."""
    for i, ch in enumerate(path):
        if ch in ".[":
            return path[:i]
    return path


# -- readings -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A process on a GPU, as NVML lists it; ``name`` is what the machine could tell about it."""

    pid: int
    used_bytes: int | None
    name: str


@dataclass(frozen=True, slots=True)
class GpuReading:
    """NVML's view of one visible device; ``None`` where NVML could not say."""

    used_bytes: int | None
    total_bytes: int | None
    process_used_bytes: int | None
    other_processes_bytes: int | None
    processes: tuple[GpuProcess, ...] = ()


#: The CUDA caching allocator's block granularity: ``memory_allocated()`` counts whole blocks.
CUDA_BLOCK_BYTES = 512


def block_bytes(size: int) -> int:
    """The allocator's block for a request of ``size`` bytes (default settings: whole 512-byte blocks)."""
    return CUDA_BLOCK_BYTES if size < CUDA_BLOCK_BYTES else -(-size // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


@dataclass(frozen=True, slots=True)
class AllocatorReading:
    """The torch caching allocator's counters for one device."""

    allocated_bytes: int
    reserved_bytes: int
    active_bytes: int
    inactive_split_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    allocated_total_bytes: int = 0  # every byte ever allocated (cumulative; never reset by nbmem)
    allocations: int = 0  # every allocation ever made (cumulative)


@dataclass(frozen=True, slots=True)
class GpuDevice:
    """A CUDA device this process can see, with its NVML identity."""

    name: str  # "cuda:0" in this process's numbering
    nvml_index: int
    uuid: str
    model: str


@dataclass(frozen=True, slots=True)
class Sample:
    """One device at one instant, with the process list it was read with; ``None`` is unknown."""

    t_wall: float
    device: str
    allocated_bytes: int | None
    reserved_bytes: int | None
    active_bytes: int | None
    inactive_split_bytes: int | None
    nvml_used_bytes: int | None
    nvml_total_bytes: int | None
    process_used_bytes: int | None
    other_processes_bytes: int | None
    rss_bytes: int | None
    host_total_bytes: int | None = None  # host RAM, on the cpu row only
    host_used_bytes: int | None = None
    peak_bytes: int | None = None  # the high-water mark: peak RSS (cpu), the allocator's peak (cuda)
    processes: tuple[GpuProcess, ...] = ()  # other processes on this GPU, named where possible


#: Sample fields that become columns of ``nbmem.samples()`` (t_wall becomes ``time``).
SAMPLE_COLUMNS = ("time", "device", "allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
                  "nvml_used_bytes", "nvml_total_bytes", "process_used_bytes", "other_processes_bytes", "rss_bytes",
                  "host_used_bytes", "host_total_bytes", "peak_bytes")


@dataclass(frozen=True, slots=True)
class Boundary:
    """Everything read at a cell boundary: allocator counters (exact), NVML and RSS."""

    t_wall: float
    t_monotonic: float
    rss_bytes: int | None
    max_rss_bytes: int | None
    allocator: dict[str, AllocatorReading | None]
    nvml: dict[str, GpuReading]


# -- cells -----------------------------------------------------------------------------------------------
CELL_COLUMNS = ("cell", "started", "duration_s", "device", "allocated_before_bytes", "allocated_after_bytes",
                "delta_allocated_bytes", "reserved_before_bytes", "reserved_after_bytes", "delta_reserved_bytes",
                "peak_allocated_bytes", "peak_note", "peak_line", "process_used_before_bytes",
                "process_used_after_bytes", "delta_process_used_bytes", "rss_before_bytes", "rss_after_bytes",
                "delta_rss_bytes", "peak_rss_bytes", "error")


def _delta(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else b - a


@dataclass(frozen=True, slots=True)
class CellRecord:
    """What one monitored cell did on one device."""

    cell: int
    started: float  # epoch seconds
    duration_s: float
    device: str
    allocated_before_bytes: int | None
    allocated_after_bytes: int | None
    reserved_before_bytes: int | None
    reserved_after_bytes: int | None
    peak_allocated_bytes: int | None
    peak_note: str
    process_used_before_bytes: int | None
    process_used_after_bytes: int | None
    rss_before_bytes: int | None
    rss_after_bytes: int | None
    peak_rss_bytes: int | None
    error: str
    peak_line: int | None = None  # the cell's line running at the peak, where the allocator's trace tells

    @property
    def delta_allocated_bytes(self) -> int | None:
        return _delta(self.allocated_before_bytes, self.allocated_after_bytes)

    @property
    def delta_reserved_bytes(self) -> int | None:
        return _delta(self.reserved_before_bytes, self.reserved_after_bytes)

    @property
    def delta_process_used_bytes(self) -> int | None:
        return _delta(self.process_used_before_bytes, self.process_used_after_bytes)

    @property
    def delta_rss_bytes(self) -> int | None:
        return _delta(self.rss_before_bytes, self.rss_after_bytes)

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        d["started"] = _dt.datetime.fromtimestamp(self.started, _dt.UTC)
        for k in ("delta_allocated_bytes", "delta_reserved_bytes", "delta_process_used_bytes", "delta_rss_bytes"):
            d[k] = getattr(self, k)
        return {c: d[c] for c in CELL_COLUMNS}

    def summary_cells(self) -> list[str]:
        peak = fmt_bytes(self.peak_allocated_bytes) if not is_na(self.peak_allocated_bytes) else (
            self.peak_note or "NA")
        if self.device == "cpu" and self.allocated_after_bytes is None:
            peak = "NA"
        return [self.device, fmt_bytes(self.delta_allocated_bytes, signed=True),
                fmt_bytes(self.delta_reserved_bytes, signed=True), peak,
                fmt_bytes(self.delta_process_used_bytes, signed=True), fmt_bytes(self.delta_rss_bytes, signed=True)]


SUMMARY_COLUMNS = (Column("device"), Column("Δallocated", numeric=True), Column("Δreserved", numeric=True),
                   Column("peak allocated", numeric=True), Column("Δ NVML process", numeric=True),
                   Column("Δ RSS", numeric=True))


# -- findings -------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Finding:
    """Memory worth the user's attention: the names that keep it alive, how much, and what frees it.

    One storage, or a group (``tensors`` > 1: a container of many small tensors that together pass
    the threshold). ``graph_bytes`` are the saved tensors of the autograd graphs it keeps alive; a
    graph several holders share is counted under each of them (``graph_shared_with`` names the others).
    """

    cell: int  # where it appeared; 0 = before nbmem was watching
    name: str
    holders: tuple[str, ...]
    kind: HolderKind
    device: str
    storage_bytes: int
    graph_bytes: int = 0
    holds_graph: bool = False
    tensors: int = 1
    view_bytes: int | None = None  # a view: the bytes its tensor spans, of a storage of storage_bytes
    graph_shared_with: tuple[str, ...] = ()
    hint: str = ""
    roots: tuple[str, ...] = ()  # top-level names `del` removes to free it
    id: str = ""  # a handle the gauge refers to
    line: int | None = None  # the cell's line that allocated it, where the allocator's trace tells
    owner: str = ""  # the owner it belongs to (on an owner row, its own name)
    description: str = ""  # an owner row's "what", in words ("Sequential: 42M parameters")
    members: tuple[Finding, ...] = ()  # an owner row's biggest members: a row per storage (or small group)
    more_bytes: int = 0  # an owner row's bytes in members not listed
    also_held_by: tuple[str, ...] = ()  # other owners that reach some of its memory

    @property
    def bytes(self) -> int:
        return self.storage_bytes + self.graph_bytes

    @property
    def more(self) -> int:
        """An owner row's members not listed (tensors counts them all)."""
        return max(0, self.tensors - sum(m.tensors for m in self.members)) if self.members else 0

    def what(self) -> str:
        """The size, as a person reads it: views, groups and graphs said in words ("tensor" when it is
        just one tensor's storage: the bytes column says how big); an owner row says what it is."""
        if self.description:
            shared = f"; graph shared with {', '.join(self.graph_shared_with)}" if self.graph_shared_with else ""
            return self.description + shared
        parts = [fmt_bytes(self.storage_bytes)]
        if self.tensors == 1 and self.view_bytes is None and not self.graph_bytes:
            return "tensor"
        if self.tensors > 1:
            parts = [f"{self.tensors:,} tensors, {fmt_bytes(self.storage_bytes)}"]
        if self.view_bytes is not None:
            parts = [f"a {fmt_bytes(self.view_bytes)} view of a {fmt_bytes(self.storage_bytes)} storage"]
        if self.graph_bytes:
            shared = f", shared with {', '.join(self.graph_shared_with)}" if self.graph_shared_with else ""
            parts.append(f"graph {fmt_bytes(self.graph_bytes)}{shared}")
        return " + ".join(parts)

    def row(self) -> dict[str, Any]:
        return {"cell": self.cell, "name": self.name, "holders": list(self.holders), "kind": self.kind.value,
                "device": self.device, "bytes": self.bytes, "storage_bytes": self.storage_bytes,
                "graph_bytes": self.graph_bytes, "holds_graph": self.holds_graph, "tensors": self.tensors,
                "view_bytes": self.view_bytes, "line": self.line, "what": self.what(),
                "also_held_by": list(self.also_held_by), "owner": self.owner, "hint": self.hint,
                "action": cleanup_text(self)}


FINDING_COLUMNS = ("cell", "name", "holders", "kind", "device", "bytes", "storage_bytes", "graph_bytes",
                   "holds_graph", "tensors", "view_bytes", "line", "what", "also_held_by", "owner", "hint", "action")


@dataclass(frozen=True, slots=True)
class CleanupOf:
    """What frees a finding: the one mapping from holder kinds to cleanup steps."""

    names: tuple[str, ...] = ()
    outputs: bool = False
    traceback: bool = False

    def __bool__(self) -> bool:
        return bool(self.names or self.outputs or self.traceback)


def cleanup_of(f: Finding) -> CleanupOf:
    if f.kind is HolderKind.OUTPUT:
        return CleanupOf(outputs=True)
    if f.kind is HolderKind.TRACEBACK:
        return CleanupOf(traceback=True)
    if f.kind is HolderKind.NAMESPACE:
        return CleanupOf(names=f.roots)
    return CleanupOf()


def cleanup_text(f: Finding | CleanupOf) -> str:
    """The cleanup a finding (or several, merged) asks for, as ``%cudamem clean`` would be typed."""
    c = cleanup_of(f) if isinstance(f, Finding) else f
    parts = list(c.names) + (["--outputs"] if c.outputs else []) + (["--traceback"] if c.traceback else [])
    return ("%cudamem clean " + " ".join(parts)) if parts else ""


def merge_cleanups(findings: Iterable[Finding]) -> CleanupOf:
    names: dict[str, None] = {}
    outputs = traceback = False
    for f in findings:
        c = cleanup_of(f)
        names.update(dict.fromkeys(c.names))
        outputs |= c.outputs
        traceback |= c.traceback
    return CleanupOf(tuple(names), outputs, traceback)


FINDING_TABLE = (Column("name", code=True), Column("kind"), Column("device"), Column("bytes", numeric=True),
                 Column("what"), Column("line", code=True), Column("hint", wide=True))


def finding_cells(f: Finding) -> list[str]:
    return [f.name, f.kind.value, f.device, fmt_bytes(f.bytes), f.what(), "" if f.line is None else str(f.line),
            f.hint]


LEAK_TABLE = (Column("cell", numeric=True), *FINDING_TABLE)


def finding_table(columns: tuple[Column, ...], findings: Sequence[Finding],
                  rows: list[list[str]]) -> tuple[tuple[Column, ...], list[list[str]]]:
    """The columns and rows to show: the line column only when some finding has a line (a --lines cell)."""
    if any(f.line is not None for f in findings):
        return columns, rows
    keep = [c.title != "line" for c in columns]
    return (tuple(c for c, k in zip(columns, keep) if k),
            [[v for v, k in zip(row, keep) if k] for row in rows])


class Shown:
    """A record a person reads: the shell and ``repr`` print its text (``__str__``); notebooks use its HTML."""

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


#: Owner rows a cell report shows; the rest are counted, and ``nbmem.leaks(cell=N)`` lists them all.
REPORT_ROWS = 8
#: Rows ``%cudamem leaks`` shows.
LEAKS_ROWS = 50
MEMBER_TABLE = (Column("tensor", code=True), Column("bytes", numeric=True), Column("what"))


def members_html(f: Finding) -> str | None:
    """An owner row's "what", expanding (a ``<details>``, no JavaScript) into its biggest members; None
    when it is one tensor under its own name."""
    if not f.members or (len(f.members) == 1 and f.members[0].name == f.name and not f.more):
        return None
    rows = [[m.name, fmt_bytes(m.bytes), m.what()] for m in f.members]
    more = f"<div>and {f.more:,} more ({esc(fmt_bytes(f.more_bytes))})</div>" if f.more else ""
    return (f"<details><summary style='cursor:pointer'>{esc(f.what())}</summary>"
            f"{html_table(MEMBER_TABLE, rows)}{more}</details>")


@dataclass(frozen=True)
class HolderTable:
    """Owner rows (or detail rows) as a report shows them: the first ``limit``, then how many more."""

    findings: tuple[Finding, ...]
    limit: int
    more_call: str  # where the rest are: "nbmem.leaks(cell=5)"
    with_cell: bool = False

    @property
    def shown(self) -> tuple[Finding, ...]:
        return self.findings[:self.limit]

    def more_line(self) -> str:
        rest = self.findings[self.limit:]
        if not rest:
            return ""
        return f"and {len(rest):,} more ({fmt_bytes(sum(f.bytes for f in rest))}): `{self.more_call}` lists them all"

    def _table(self) -> tuple[tuple[Column, ...], list[list[str]]]:
        cols = LEAK_TABLE if self.with_cell else FINDING_TABLE
        rows = [[str(f.cell), *finding_cells(f)] if self.with_cell else finding_cells(f) for f in self.shown]
        return finding_table(cols, self.shown, rows)

    def text(self) -> list[str]:
        return [text_table(*self._table()), *filter(None, [self.more_line()])]

    def html(self, caption: str) -> str:
        more = self.more_line()
        columns, rows = self._table()
        what = next(i for i, c in enumerate(columns) if c.title == "what")
        expand = [{what: x} if (x := members_html(f)) is not None else {} for f in self.shown]
        return (html_table(columns, rows, caption=caption, html=expand)
                + (f"<div>{prose(more)}</div>" if more else ""))


@dataclass(frozen=True, repr=False)
class Leaks(Shown):
    """``%cudamem leaks``: a row per owner (or per tensor with ``detail``); the DataFrame is ``nbmem.leaks()``."""

    findings: tuple[Finding, ...]
    title: str
    cell: int | None = None
    detail: bool = False
    total_bytes: int = 0

    def _table(self) -> HolderTable:
        args = [f"cell={self.cell}"] if self.cell is not None else []
        call = f"nbmem.leaks({', '.join([*args, 'detail=True'] if self.detail else args)})"
        return HolderTable(self.findings, LEAKS_ROWS, call, with_cell=True)

    def _caption(self) -> str:
        total = f" ({fmt_bytes(self.total_bytes)} in all)" if self.total_bytes and not self.detail else ""
        return self.title + total

    def __str__(self) -> str:
        if not self.findings:
            return f"{self.title}: nothing above the threshold"
        return "\n".join([self._caption(), *self._table().text()])

    def _repr_html_(self) -> str:
        if not self.findings:
            return f"<div class='nbmem-report'>{esc(self.title)}: nothing above the threshold</div>"
        return "<div class='nbmem-report'>" + self._table().html(self._caption()) + "</div>"


# -- the report under a cell -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LineRecord:
    """One line of a cell, from the allocator's event trace: what it left allocated and its peak."""

    cell: int
    device: str
    line: int
    source: str
    delta_allocated_bytes: int
    peak_allocated_bytes: int
    events: int
    top_frame: str = ""  # the deepest user frame that allocated the largest blocks live at the peak

    def row(self) -> dict[str, Any]:
        return asdict(self)


LINE_COLUMNS = ("cell", "device", "line", "source", "delta_allocated_bytes", "peak_allocated_bytes", "events",
                "top_frame")
LINE_TABLE = (Column("line", numeric=True), Column("source", code=True), Column("Δallocated", numeric=True),
              Column("peak", numeric=True), Column("allocated at", code=True))


def line_cells(r: LineRecord, peak_line: int | None) -> list[str]:
    mark = " ◀ peak" if r.line == peak_line else ""
    return [str(r.line), r.source.strip()[:80], fmt_bytes(r.delta_allocated_bytes, signed=True),
            fmt_bytes(r.peak_allocated_bytes) + mark, r.top_frame]


@dataclass(frozen=True, repr=False)
class Lines(Shown):
    """``%cudamem lines``: a cell's lines (the DataFrame is ``nbmem.lines()``)."""

    cell: int
    records: tuple[LineRecord, ...]
    peak_lines: Mapping[str, int | None]

    def _tables(self) -> list[tuple[str, list[list[str]]]]:
        devs = dict.fromkeys(r.device for r in self.records)
        return [(d, [line_cells(r, self.peak_lines.get(d)) for r in self.records if r.device == d]) for d in devs]

    def __str__(self) -> str:
        parts = [f"nbmem [{self.cell}] lines"]
        for dev, rows in self._tables():
            parts += [f"{dev}:", text_table(LINE_TABLE, rows)]
        return "\n".join(parts)

    def _repr_html_(self) -> str:
        return ("<div class='nbmem-report'>" + "".join(
            html_table(LINE_TABLE, rows, caption=f"nbmem [{self.cell}] lines ({dev})") for dev, rows in self._tables())
            + "</div>")


UNATTRIBUTED = ("allocated, but no name reaches it: memory torch keeps in C++, such as the cuBLAS workspaces the "
                "first matrix multiply on a device makes, or tensors a C extension holds")


@dataclass(frozen=True, repr=False)
class CellReport(Shown):
    """What one cell did, shown under it: the cell records, findings, lines and advice."""

    cell: int
    duration_s: float
    records: tuple[CellRecord, ...]
    findings: tuple[Finding, ...] = ()
    unattributed: tuple[tuple[str, int], ...] = ()
    error: str = ""
    advice: tuple[str, ...] = ()
    lines: tuple[LineRecord, ...] = ()
    notes: tuple[str, ...] = ()
    held_bytes: int = 0  # the owners' bytes together (a graph several keep, once)

    @property
    def holders(self) -> HolderTable:
        return HolderTable(self.findings, REPORT_ROWS, f"nbmem.leaks(cell={self.cell})")

    def last_report_cleanup(self) -> CleanupOf:
        """What ``%cudamem clean --last-report`` removes: exactly the owners the report shows."""
        return merge_cleanups(self.holders.shown)

    def _peak_line(self, device: str) -> int | None:
        return next((r.peak_line for r in self.records if r.device == device), None)

    def _line_tables(self) -> list[tuple[str, list[list[str]]]]:
        out = []
        for dev in dict.fromkeys(r.device for r in self.lines):
            peak = self._peak_line(dev)
            out.append((dev, [line_cells(r, peak) for r in self.lines if r.device == dev]))
        return out

    def _head(self) -> str:
        err = f" · error: {self.error}" if self.error else ""
        return f"nbmem [{self.cell}] · {fmt_seconds(self.duration_s)}{err}"

    def _holders_caption(self) -> str:
        total = f" ({fmt_bytes(self.held_bytes)} in all)" if self.held_bytes and len(self.findings) > 1 else ""
        return f"holders of memory this cell added{total}"

    def _clean_line(self) -> str:
        c = self.last_report_cleanup()
        return f"`%cudamem clean --last-report` would run: {cleanup_text(c)[len('%cudamem clean '):]}" if c else ""

    def __str__(self) -> str:
        parts = [self._head(), text_table(SUMMARY_COLUMNS, [r.summary_cells() for r in self.records])]
        for dev, rows in self._line_tables():
            parts += [f"lines ({dev}):", text_table(LINE_TABLE, rows)]
        if self.findings:
            parts += [self._holders_caption() + ":", *self.holders.text()]
            if self._clean_line():
                parts.append(self._clean_line())
        for dev, b in self.unattributed:
            parts.append(f"unattributed on {dev}: {fmt_bytes(b)} ({UNATTRIBUTED})")
        parts += [f"- {a}" for a in (*self.notes, *self.advice)]
        return "\n".join(parts)

    def _repr_html_(self) -> str:
        parts = [f"<div class='nbmem-report'><div style='font-weight:600'>{esc(self._head())}</div>",
                 html_table(SUMMARY_COLUMNS, [r.summary_cells() for r in self.records])]
        for dev, rows in self._line_tables():
            parts.append(html_table(LINE_TABLE, rows, caption=f"lines ({dev})"))
        if self.findings:
            parts.append(self.holders.html(self._holders_caption()))
            if self._clean_line():
                parts.append(f"<div>{prose(self._clean_line())}</div>")
        for dev, b in self.unattributed:
            parts.append(f"<div>unattributed on {esc(dev)}: {esc(fmt_bytes(b))} ({esc(UNATTRIBUTED)})</div>")
        items = (*self.notes, *self.advice)
        if items:
            parts.append("<ul style='margin:2px 0'>" + "".join(f"<li>{prose(a)}</li>" for a in items) + "</ul>")
        parts.append("</div>")
        return "".join(parts)


# -- cleanup -------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CleanupStep:
    """One action and what it freed; ``error`` when the step itself failed."""

    action: str
    target: str
    freed_allocated_bytes: int | None
    freed_reserved_bytes: int | None
    note: str = ""
    error: str = ""


def known_sum(values: Iterable[int | None]) -> int | None:
    """Sum of the known values; None (unknown) when none is known, rather than a made-up 0."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


CLEANUP_COLUMNS = (Column("step"), Column("target", code=True), Column("freed allocated", numeric=True),
                   Column("freed reserved", numeric=True), Column("note", wide=True))


@dataclass(frozen=True, repr=False)
class CleanupReport(Shown):
    """What a cleanup removed, step by step, and the bytes each step gave back."""

    steps: tuple[CleanupStep, ...]
    still_held: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (deleted name, names still holding its memory)

    @property
    def freed_allocated_bytes(self) -> int | None:
        return known_sum(s.freed_allocated_bytes for s in self.steps)

    @property
    def freed_reserved_bytes(self) -> int | None:
        """None when no step could measure reserved memory (no CUDA): unknown, not zero."""
        return known_sum(s.freed_reserved_bytes for s in self.steps)

    @property
    def errors(self) -> tuple[str, ...]:
        return tuple(f"{s.action}: {s.error}" for s in self.steps if s.error)

    def _rows(self) -> list[list[str]]:
        return [[s.action, s.target, fmt_bytes(s.freed_allocated_bytes), fmt_bytes(s.freed_reserved_bytes),
                 "; ".join(x for x in (s.note, f"failed: {s.error}" if s.error else "") if x)] for s in self.steps]

    def _head(self) -> str:
        return (f"nbmem cleanup: freed {fmt_bytes(self.freed_allocated_bytes)} allocated, "
                f"{fmt_bytes(self.freed_reserved_bytes)} reserved")

    def _held_lines(self) -> list[str]:
        return [f"{name}: its memory is still held by {', '.join(others)} "
                f"({'not named' if len(others) == 1 else 'none of them named'}, so not removed)"
                for name, others in self.still_held]

    def __str__(self) -> str:
        return "\n".join([self._head(), text_table(CLEANUP_COLUMNS, self._rows()), *self._held_lines()])

    def _repr_html_(self) -> str:
        held = "".join(f"<div>{esc(x)}</div>" for x in self._held_lines())
        return ("<div class='nbmem-report'>" + html_table(CLEANUP_COLUMNS, self._rows(), caption=self._head())
                + held + "</div>")

    def row(self) -> dict[str, Any]:
        return {"freed_allocated_bytes": self.freed_allocated_bytes, "freed_reserved_bytes": self.freed_reserved_bytes}


# -- what the engine tells its subscribers ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Tick:
    """One sampler tick: a sample per device (``cpu`` first), all read at the same moment."""

    samples: tuple[Sample, ...]


@dataclass(frozen=True, slots=True)
class Holders:
    """The current holders above the threshold, after a scan (a cell, a cleanup, ``%cudamem on``)."""

    findings: tuple[Finding, ...]


# -- status ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Fault:
    """An exception inside nbmem, recorded (and shown once); the user's cell was not affected."""

    where: str
    error: str
    count: int


@dataclass(frozen=True, repr=False)
class Status(Shown):
    """What nbmem can and cannot see, and why; shown by ``%cudamem status``."""

    devices: tuple[str, ...]
    cannot: tuple[str, ...]
    sampler_running: bool
    interval_s: float
    monitoring: bool
    faults: tuple[Fault, ...] = ()
    scan: tuple[str, ...] = field(default=())  # how the last holder scans went (skipped objects, unfinished roots)

    def __str__(self) -> str:
        lines = [f"nbmem: sampling every {self.interval_s:g} s ({'running' if self.sampler_running else 'stopped'}); "
                 f"per-cell monitoring {'on' if self.monitoring else 'off'}",
                 "sees: " + (", ".join(self.devices) or "nothing")]
        lines += [f"cannot see: {c}" for c in self.cannot]
        lines += [f"scan: {s}" for s in self.scan]
        lines += [f"fault in {f.where} (x{f.count}): {f.error}" for f in self.faults]
        return "\n".join(lines)

