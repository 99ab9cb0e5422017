"""The records a person reads: the report under a cell, ``%cudamem leaks``, lines, cleanup and status.

Each renders itself: text for terminals (``__str__``, also what ``repr`` and IPython's pretty printer
show) and HTML for notebooks (``_repr_html_``). They hold numbers and names only (``records``), never the
objects they describe; human formatting comes from ``formatting``.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbmem.formatting import Column, esc, fmt_bytes, fmt_seconds, html_table, is_na, prose, text_table
from nbmem.records import (
    WARN_SHARE,
    CellRecord,
    ChildProcess,
    ChildrenUse,
    CleanupOf,
    CleanupStep,
    Fault,
    Finding,
    LineRecord,
    MemoryLimit,
    PoolUse,
    Sample,
    StillHeld,
    cleanup_text,
    known_sum,
    merge_cleanups,
)


class Shown:
    """A record a person reads: the shell and ``repr`` print its text (``__str__``); notebooks use its HTML."""

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def summary_cells(r: CellRecord) -> list[str]:
    """A cell record as the summary table's row."""
    peak = fmt_bytes(r.peak_allocated_bytes) if not is_na(r.peak_allocated_bytes) else (
        r.peak_note or "NA")
    if r.device == "cpu" and r.allocated_after_bytes is None:
        peak = "NA"
    return [r.device, fmt_bytes(r.delta_allocated_bytes, signed=True),
            fmt_bytes(r.delta_reserved_bytes, signed=True), peak,
            fmt_bytes(r.delta_process_used_bytes, signed=True), fmt_bytes(r.delta_rss_bytes, signed=True)]


SUMMARY_COLUMNS = (Column("device"), Column("Δallocated", numeric=True), Column("Δreserved", numeric=True),
                   Column("peak allocated", numeric=True), Column("Δ NVML process", numeric=True),
                   Column("Δ RSS", numeric=True))
#: The summary's columns a CPU cannot fill (it has no caching allocator and no NVML), and their fields.
CPU_BLANK = {"Δreserved": "delta_reserved_bytes", "peak allocated": "peak_allocated_bytes",
             "Δ NVML process": "delta_process_used_bytes"}
#: Said once a session, under the first report shown whose rows are all the CPU's.
CPU_CANNOT = ("on a CPU nbmem tells what tensors hold and the process's RSS, not reserved memory, NVML's figures or "
              "the peak inside a cell (no caching allocator): those columns are left out")


def summary_table(records: Sequence[CellRecord]) -> tuple[tuple[Column, ...], list[list[str]]]:
    """The summary's columns and rows; on a CPU only, without the columns no row can carry a number."""
    rows = [summary_cells(r) for r in records]
    if any(r.device != "cpu" for r in records):
        return SUMMARY_COLUMNS, rows
    keep = [c.title not in CPU_BLANK or any(not is_na(getattr(r, CPU_BLANK[c.title])) for r in records)
            for c in SUMMARY_COLUMNS]
    return (tuple(c for c, k in zip(SUMMARY_COLUMNS, keep) if k),
            [[v for v, k in zip(row, keep) if k] for row in rows])


def cpu_only(records: Sequence[CellRecord]) -> bool:
    return bool(records) and all(r.device == "cpu" for r in records)


#: ``%cudamem report``'s columns, chosen to fit 80 columns of a terminal; ``nbmem.report()`` has them all.
CELLS_GPU = (Column("cell", numeric=True), Column("device"), Column("time", numeric=True),
             Column("Δallocated", numeric=True), Column("Δreserved", numeric=True), Column("peak", numeric=True),
             Column("error"))
CELLS_CPU = (Column("cell", numeric=True), Column("device"), Column("time", numeric=True),
             Column("Δallocated", numeric=True), Column("Δ RSS", numeric=True), Column("peak RSS", numeric=True),
             Column("error"))
#: Rows ``%cudamem report`` shows, the latest; the DataFrame has every cell.
CELLS_ROWS = 40
ERROR_SHOWN = 18


def _short_peak(r: CellRecord) -> str:
    """The peak as a number, or the bound a note gives ("≤ 1.20 GiB"), without the note's explanation."""
    if not is_na(r.peak_allocated_bytes):
        return fmt_bytes(r.peak_allocated_bytes)
    return r.peak_note.split(" (")[0] if r.peak_note[:1] in ("≤", "≈") else "NA"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


@dataclass(frozen=True, repr=False)
class CellTable(Shown):
    """``%cudamem report``: a row per measured cell and device, in the columns a terminal has room for."""

    records: tuple[CellRecord, ...]

    def _table(self) -> tuple[tuple[Column, ...], list[list[str]]]:
        shown = self.records[-CELLS_ROWS:]
        if cpu_only(self.records):
            return CELLS_CPU, [[str(r.cell), r.device, fmt_seconds(r.duration_s),
                                fmt_bytes(r.delta_allocated_bytes, signed=True),
                                fmt_bytes(r.delta_rss_bytes, signed=True), fmt_bytes(r.peak_rss_bytes),
                                _cut(r.error, ERROR_SHOWN)] for r in shown]
        return CELLS_GPU, [[str(r.cell), r.device, fmt_seconds(r.duration_s),
                            fmt_bytes(r.delta_allocated_bytes, signed=True),
                            fmt_bytes(r.delta_reserved_bytes, signed=True), _short_peak(r),
                            _cut(r.error, ERROR_SHOWN)] for r in shown]

    def _foot(self) -> str:
        earlier = len(self.records) - CELLS_ROWS
        rows = f"the latest {CELLS_ROWS} of {len(self.records):,} rows; " if earlier > 0 else ""
        return f"{rows}all rows and columns: `nbmem.report()` (a DataFrame)"

    def __str__(self) -> str:
        if not self.records:
            return "nbmem: no cell measured yet: `%cudamem on` measures every cell, `%%cudamem` one"
        return "\n".join([text_table(*self._table()), self._foot()])

    def _repr_html_(self) -> str:
        if not self.records:
            return f"<div class='nbmem-report'>{prose(str(self))}</div>"
        return ("<div class='nbmem-report'>" + html_table(*self._table(), caption="nbmem: measured cells")
                + f"<div>{prose(self._foot())}</div></div>")


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
    note: str = "nothing above the threshold"  # why there are no findings (``Holdings.why_empty``)

    def _table(self) -> HolderTable:
        args = [f"cell={self.cell}"] if self.cell is not None else []
        call = f"nbmem.leaks({', '.join([*args, 'detail=True'] if self.detail else args)})"
        return HolderTable(self.findings, LEAKS_ROWS, call, with_cell=True)

    def _caption(self) -> str:
        total = f" ({fmt_bytes(self.total_bytes)} in all)" if self.total_bytes and not self.detail else ""
        return self.title + total

    def __str__(self) -> str:
        if not self.findings:
            return f"{self.title}: {self.note}"
        return "\n".join([self._caption(), *self._table().text()])

    def _repr_html_(self) -> str:
        if not self.findings:
            return f"<div class='nbmem-report'>{esc(self.title)}: {prose(self.note)}</div>"
        return "<div class='nbmem-report'>" + self._table().html(self._caption()) + "</div>"


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
                "first matrix multiply on a device makes, or tensors a C extension holds; what CUDA graphs hold is "
                "counted apart, from the allocator's pools")
#: How to stop a child process, said once under the processes a report names.
STOP_CHILD = ("nbmem never stops a process: when you are done, `.join()` or `.terminate()` what started it, or "
              "`import os, signal; os.kill(PID, signal.SIGTERM)`")
COMMAND_SHOWN = 120
#: A report line names this many of the child processes on a GPU, then says how many more.
PIDS_SHOWN = 8


def pool_text(p: PoolUse) -> str:
    """A device's CUDA-graph pools in words: how much, whose, and what gives it back."""
    where = "a private memory pool" if p.pools == 1 else f"{p.pools} private memory pools"
    names = ", ".join(f"`{n}`" for n in p.compiled)
    made = (f"the CUDA graphs torch.compile recorded for {names} (mode=\"reduce-overhead\")" if p.compiled
            else "CUDA graphs (torch.compile with mode=\"reduce-overhead\", or torch.cuda.graph)")
    free = ("`%cudamem clean --compiled` gives it back (torch._dynamo.reset() drops the graphs, then "
            f"torch.cuda.empty_cache()); {names} compile{'s' if len(p.compiled) == 1 else ''} again when next called"
            if p.compiled else "deleting the graphs (or the compiled function) frees it; `%cudamem clean --compiled` "
            "when torch.compile made them")
    return (f"CUDA graphs on {p.device}: {fmt_bytes(p.reserved_bytes)} reserved in {where} of {made}, "
            f"{fmt_bytes(p.allocated_bytes)} of it allocated ({fmt_bytes(p.unnamed_bytes)} reached by no name: the "
            f"graphs' own inputs, intermediates and outputs); {free}")


#: The short form, once the long one was said in this session.
UNATTRIBUTED_SHORT = "no name reaches it: `%cudamem status` says what that can be"


def _unattributed_rest(unattributed: Sequence[tuple[str, int]], pools: Sequence[PoolUse]
                       ) -> list[tuple[str, int, bool]]:
    """(device, bytes no pool explains, whether pools explained some) for each line the report says."""
    by_device = {p.device: p for p in pools}
    out = []
    for dev, b in unattributed:
        pool = by_device.get(dev)
        rest = b - (pool.unnamed_bytes if pool else 0)
        if rest <= 0 or (pool is not None and rest < 2**20):
            continue  # the pools explain it (a remainder under a MiB is older workspaces, told before)
        out.append((dev, rest, pool is not None))
    return out


def unnamed_texts(unattributed: Sequence[tuple[str, int]], pools: Sequence[PoolUse],
                  compiled: Sequence[str], *, explain: bool = True,
                  before: Sequence[tuple[str, int]] = ()) -> list[str]:
    """The report's lines on memory no name reaches: the CUDA-graph pools first, then the rest as unattributed,
    explained in full when ``explain`` (once a session), else in a short line that points to the status.
    ``before``: what earlier cells had left unnamed per device, so a line says what this cell added."""
    out = [pool_text(p) for p in pools]
    earlier = dict(before)
    for dev, rest, pooled in _unattributed_rest(unattributed, pools):
        old = earlier.get(dev, 0)
        amount = (f"{fmt_bytes(rest)}{' more' if pooled else ''}" if pooled or old <= 0 or old >= rest
                  else f"{fmt_bytes(rest - old)} more in this cell ({fmt_bytes(rest)} in all)")
        line = f"unattributed on {dev}: {amount} ({UNATTRIBUTED if explain else UNATTRIBUTED_SHORT})"
        if compiled and not pooled:
            line += (f"; torch.compile is in use ({', '.join(f'`{n}`' for n in compiled)}): its caches may hold some "
                     f"of it, and `%cudamem clean --compiled` drops them")
        out.append(line)
    return out


def _pids(pids: Sequence[int]) -> str:
    if not pids:
        return ""
    shown = ", ".join(map(str, pids[:PIDS_SHOWN])) + (
        f" and {len(pids) - PIDS_SHOWN} more" if len(pids) > PIDS_SHOWN else "")
    return f" (PID {shown})" if len(pids) == 1 else f" (PIDs {shown})"


def child_texts(use: Sequence[ChildrenUse], children: Sequence[ChildProcess]) -> list[str]:
    """The report's lines on this notebook's child processes: what they held on each GPU while the cell ran,
    and the ones it left running, by PID and command line."""
    out = [f"child processes of this notebook on {u.device}{_pids(u.pids)}: {fmt_bytes(u.after_bytes)} at the end, "
           f"at most {fmt_bytes(u.peak_bytes)} while the cell ran (sampled)" for u in use]
    for c in children:
        cmd = c.command if len(c.command) <= COMMAND_SHOWN else c.command[:COMMAND_SHOWN - 1] + "…"
        # psutil's start times count from the boot time in whole seconds: a clock time, not "in this cell".
        when = f", started {_dt.datetime.fromtimestamp(c.started_wall):%H:%M:%S}" if c.started_wall else ""
        out.append(f"PID {c.pid} is still running and holds {fmt_bytes(c.used_bytes)} on {c.device}{when}: `{cmd}`")
    if children:
        out.append(STOP_CHILD)
    return out


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
    pools: tuple[PoolUse, ...] = ()  # CUDA-graph pools on the devices where unnamed memory or the cache grew
    compiled: tuple[str, ...] = ()  # the notebook's compiled modules, when the report speaks of unnamed memory
    children: tuple[ChildProcess, ...] = ()  # child processes this cell left running with memory on a GPU
    children_use: tuple[ChildrenUse, ...] = ()  # what this notebook's child processes held per GPU in the cell
    explain_unattributed: bool = True  # the long explanation of unattributed memory (once a session)
    unattributed_before: tuple[tuple[str, int], ...] = ()  # what earlier cells had left unnamed, per device
    explain_cpu: bool = False  # say what a CPU cannot tell (once a session: until a report that said it is shown)

    @property
    def holders(self) -> HolderTable:
        """What the cell kept that it did not mean to (intent.py): the rows one click cleans."""
        return HolderTable(tuple(f for f in self.findings if not f.state), REPORT_ROWS,
                           f"nbmem.leaks(cell={self.cell})")

    @property
    def state(self) -> HolderTable:
        """What the cell made and meant to keep: its models, optimizers, datasets (deleted only by name)."""
        return HolderTable(tuple(f for f in self.findings if f.state), REPORT_ROWS, f"nbmem.leaks(cell={self.cell})")

    def last_report_cleanup(self) -> CleanupOf:
        """What ``%cudamem clean --last-report`` removes: exactly the owners the report shows, never its state."""
        return merge_cleanups(self.holders.shown)

    def _state_line(self) -> str:
        """How to delete the state too: by name, never in one click."""
        shown = self.state.shown
        if not shown:
            return ""
        names = merge_cleanups(shown)
        first = set(self.last_report_cleanup().names)
        rest = CleanupOf(tuple(n for n in names.names if n not in first), names.outputs, names.traceback)
        what = ", ".join(f"`{f.name}` ({f.state})" for f in shown)
        how = f"`{cleanup_text(rest)}` deletes it" if rest else "nothing more is needed to delete it"
        after = "after `%cudamem clean --last-report`, " if len(rest.names) < len(names.names) else ""
        return f"kept as the cell's state, not by `--last-report`: {what}; {after}{how}"

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

    @property
    def says_unattributed(self) -> bool:
        """Whether the report has an unattributed line (the session then explains it in short from now on)."""
        return bool(_unattributed_rest(self.unattributed, self.pools))

    def _unnamed(self) -> list[str]:
        return [*unnamed_texts(self.unattributed, self.pools, self.compiled, explain=self.explain_unattributed,
                               before=self.unattributed_before),
                *child_texts(self.children_use, self.children)]

    @property
    def says_cpu(self) -> bool:
        """Whether the report says what a CPU cannot tell: the first time it leaves a column out for that."""
        return self.explain_cpu and len(summary_table(self.records)[0]) < len(SUMMARY_COLUMNS)

    def __str__(self) -> str:
        parts = [self._head(), text_table(*summary_table(self.records)), *([CPU_CANNOT] if self.says_cpu else [])]
        for dev, rows in self._line_tables():
            parts += [f"lines ({dev}):", text_table(LINE_TABLE, rows)]
        if self.holders.findings:
            parts += [self._holders_caption() + ":", *self.holders.text()]
            if self._clean_line():
                parts.append(self._clean_line())
        if self.state.findings:
            parts += ["the cell's state:", *self.state.text(), self._state_line()]
        parts += self._unnamed()
        parts += [f"- {a}" for a in (*self.notes, *self.advice)]
        return "\n".join(parts)

    def _repr_html_(self) -> str:
        parts = [f"<div class='nbmem-report'><div style='font-weight:600'>{esc(self._head())}</div>",
                 html_table(*summary_table(self.records)),
                 *([f"<div>{prose(CPU_CANNOT)}</div>"] if self.says_cpu else [])]
        for dev, rows in self._line_tables():
            parts.append(html_table(LINE_TABLE, rows, caption=f"lines ({dev})"))
        if self.holders.findings:
            parts.append(self.holders.html(self._holders_caption()))
            if self._clean_line():
                parts.append(f"<div>{prose(self._clean_line())}</div>")
        if self.state.findings:
            parts += [self.state.html("the cell's state"), f"<div>{prose(self._state_line())}</div>"]
        parts += [f"<div>{prose(line)}</div>" for line in self._unnamed()]
        items = (*self.notes, *self.advice)
        if items:
            parts.append("<ul style='margin:2px 0'>" + "".join(f"<li>{prose(a)}</li>" for a in items) + "</ul>")
        parts.append("</div>")
        return "".join(parts)


CLEANUP_COLUMNS = (Column("step"), Column("target", code=True), Column("freed allocated", numeric=True),
                   Column("freed reserved", numeric=True), Column("note", wide=True))


@dataclass(frozen=True, repr=False)
class CleanupReport(Shown):
    """What a cleanup removed, step by step, and the bytes each step gave back."""

    steps: tuple[CleanupStep, ...]
    still_held: tuple[StillHeld, ...] = ()  # per deleted name whose memory is still alive: who keeps it

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
        return [x.text() for x in self.still_held]

    def __str__(self) -> str:
        return "\n".join([self._head(), text_table(CLEANUP_COLUMNS, self._rows()), *self._held_lines()])

    def _repr_html_(self) -> str:
        held = "".join(f"<div>{prose(x)}</div>" for x in self._held_lines())
        return ("<div class='nbmem-report'>" + html_table(CLEANUP_COLUMNS, self._rows(), caption=self._head())
                + held + "</div>")

    def row(self) -> dict[str, Any]:
        return {"freed_allocated_bytes": self.freed_allocated_bytes, "freed_reserved_bytes": self.freed_reserved_bytes}


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
    children: tuple[str, ...] = ()  # this notebook's child processes on each GPU, a line each
    pools: tuple[str, ...] = ()  # CUDA-graph pools per device, a line each
    memory: str = ""  # the memory limit that applies (records.MemoryLimit.text), or why it is unknown
    paged: tuple[str, ...] = ()  # paged (CUDA managed) memory the last scan found, a line per GPU

    def __str__(self) -> str:
        lines = [f"nbmem: sampling every {self.interval_s:g} s ({'running' if self.sampler_running else 'stopped'}); "
                 f"per-cell monitoring {'on' if self.monitoring else 'off'}",
                 "sees: " + (", ".join(self.devices) or "nothing")]
        lines += [self.memory] if self.memory else []
        lines += [f"cannot see: {c}" for c in self.cannot]
        lines += [f"scan: {s}" for s in self.scan]
        lines += [f"child process: {c}" for c in self.children]
        lines += [f"CUDA graphs: {p}" for p in self.pools]
        lines += [f"paged memory on {p}" for p in self.paged]
        lines += [f"fault in {f.where} (x{f.count}): {f.error}" for f in self.faults]
        lines.append(f"unattributed memory in reports: {UNATTRIBUTED}")
        return "\n".join(lines)


def memory_name(lim: MemoryLimit | None) -> str:
    """What the CPU row's total is, in the gauge's words: the host's RAM or the container's limit."""
    return "container memory limit" if lim is not None and lim.applies else "host RAM"


def near_limit(lim: MemoryLimit | None, rss_bytes: int | None = None) -> bool | None:
    """Whether memory is at or above ``WARN_SHARE`` of a limit that applies (None: no limit to be near)."""
    if lim is None or not lim.applies or not lim.limit_bytes:
        return None
    used = lim.usage_bytes if lim.usage_bytes is not None else rss_bytes
    return None if used is None else used >= WARN_SHARE * lim.limit_bytes


def limit_line(tick: Sequence[Sample]) -> str:
    """``%cudamem status``'s memory line from the latest sample: "RSS 3.1 GiB of a 4.00 GiB container limit"."""
    cpu = next((s for s in tick if s.device == "cpu"), None)
    if cpu is None or cpu.memory_limit is None:
        return ""
    lim = cpu.memory_limit
    if not lim.applies:
        return lim.text()
    return f"RSS {fmt_bytes(cpu.rss_bytes)} of a {lim.text()[len('memory limit: '):]}"
