"""The steps that build a cell's report, in one list: ``REPORT_STEPS``.

A measured cell's end makes a bare ``CellReport`` (the per-device records from the allocator's counters), then
hands it through each step in order. A step is a plain function ``(Closing, CellReport) -> CellReport`` that adds
one thing and returns the new report (records are frozen: ``dataclasses.replace``). ``Closing`` is what the cell's
end knows (its boundaries, its trace, the parts it may read); a step that learns something the watch keeps (the
holders changed, CUDA broke, the child processes seen) writes it back on the ``Closing``.

To make the report say something new, write a step and put it in its place in ``REPORT_STEPS``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from nbmem.cells import advice
from nbmem.cells.peaks import with_trace
from nbmem.holders import pools
from nbmem.holders.holdings import Baseline, Holdings, with_cpu_allocated
from nbmem.measure import processes
from nbmem.measure.sources import Probe, largest_free_block
from nbmem.options import Settings
from nbmem.recorder.deaths import with_pressure
from nbmem.records import Boundary, LineRecord
from nbmem.reports import CellReport
from nbmem.store import Store
from nbmem.trace.recording import Recording


@dataclass
class Closing:
    """One cell's end, as the report steps see it; the steps' findings for the watch go back on it."""

    cell: int
    before: Boundary
    after: Boundary
    base: Baseline
    source: str
    lines: bool
    scan: bool
    error: BaseException | None
    recording: Recording | None
    replays: dict[str, Any]
    settings: Settings
    probe: Probe
    holdings: Holdings
    store: Store
    adapter: Any
    children_seen: frozenset[Any]
    # what the steps found, for the watch to keep
    line_records: tuple[LineRecord, ...] = ()
    holders_changed: bool = False
    cuda_broken: bool = False
    children_now: frozenset[Any] = field(default_factory=frozenset)

    @property
    def oom(self) -> bool:
        return advice.is_oom(self.error)


def exact_peaks(c: Closing, r: CellReport) -> CellReport:
    """The allocator's event trace pins each device's peak inside the cell, where the counters cannot."""
    return replace(r, records=tuple(with_trace(list(r.records), c.replays)))


def line_figures(c: Closing, r: CellReport) -> CellReport:
    """With ``--lines``: memory per line of the cell, or why there is none."""
    if not c.lines:
        return r
    c.line_records = tuple(x for rp in c.replays.values() for x in rp.lines)
    return replace(r, lines=c.line_records, notes=(*r.notes, *_line_notes(c, r)))


def _line_notes(c: Closing, r: CellReport) -> list[str]:
    if not any(x.device.startswith("cuda") for x in r.records):
        return ["per-line figures need a CUDA device: this cell ran on the CPU only"]
    if not c.replays:
        why = c.probe.torch.trace_unsupported() or "Nbmem.trace_entries is 0"
        return [f"no per-line figures for this cell: {why}"]
    rec = c.recording
    if rec is not None and rec.full_at_us is not None:
        return [f"lines were followed for this cell's first {rec.max_marks:,} lines of Python "
                f"(Nbmem.trace_entries): its later allocations count toward its peak, not toward a line"]
    return []


def holders(c: Closing, r: CellReport) -> CellReport:
    """Who keeps what the cell added (a row per owner), the CPU tensors' bytes, and what no name reaches."""
    if not c.scan:
        return r
    cur, found, c.holders_changed = c.holdings.close_cell(c.cell, c.base, c.before, c.after, c.replays)
    records = with_cpu_allocated(list(r.records), c.base, c.holdings.tensor_bytes(cur))
    unnamed: pools.Unnamed = c.holdings.unattributed(records, cur)
    notes = r.notes
    if cur.truncated:
        more = " and others" if len(cur.unfinished) > 5 else ""
        notes = (*notes, f"the holder scan stopped at Nbmem.scan_budget ({c.settings.scan_budget_s:g} s) before "
                         f"finishing {', '.join(cur.unfinished[:5])}{more}: findings may be incomplete; "
                         f"nbmem.leaks() scans everything")
    return replace(r, records=tuple(records), findings=found.owners, unattributed=unnamed.gaps, notes=notes,
                   held_bytes=found.total_bytes, pools=unnamed.pools, compiled=unnamed.compiled,
                   unattributed_before=unnamed.before)


def second_copies(c: Closing, r: CellReport) -> CellReport:
    """State this cell made that is like state an earlier cell made and still holds (a model built again while the
    first is kept by a trainer): said with the earlier one's bytes, holders and what deletes it."""
    if not c.scan or not any(f.state and f.cell == c.cell for f in r.findings):
        return r
    lines = advice.second_copies(c.cell, r.findings, c.holdings.current().owners)
    return replace(r, notes=(*r.notes, *lines)) if lines else r


def child_processes(c: Closing, r: CellReport) -> CellReport:
    """This notebook's child processes: what they held on each GPU while the cell ran, and those it left running."""
    left = processes.left_running(c.after, c.children_seen)
    c.children_now = processes.on_gpus(c.after)
    use = processes.children_use(c.before, c.after, c.store.samples_between(c.before.t_wall, c.after.t_wall),
                                 threshold_bytes=c.settings.threshold_bytes)
    return replace(r, children=left, children_use=use)


def what_to_do(c: Closing, r: CellReport) -> CellReport:
    """After a broken context: restart. After an out-of-memory error: why, and what would help. Else, headroom."""
    c.cuda_broken = advice.breaks_cuda(c.error)
    if c.cuda_broken:
        return replace(r, advice=(advice.RESTART_ADVICE,))
    if c.oom and c.error is not None:
        return replace(r, advice=advice.oom_advice(
            list(r.records), c.error, source=c.source, lines_recorded=c.lines, replays=c.replays,
            cell_files=c.adapter.cell_files(c.cell), names=c.adapter.cell_names(),
            largest_free=_largest_free(c, r)))
    if c.error is None:
        return replace(r, notes=(*r.notes, *advice.headroom(list(r.records), c.after, c.settings.threshold_bytes)))
    return r


def _largest_free(c: Closing, r: CellReport) -> dict[str, int]:
    """Each GPU's largest free cached block, read after an out-of-memory error (the allocator's segments)."""
    segs = c.probe.torch.segments()
    if segs is None:
        return {}
    return {x.device: largest_free_block(segs, int(x.device.partition(":")[2]))
            for x in r.records if x.device.startswith("cuda:")}


def memory_pressure(c: Closing, r: CellReport) -> CellReport:
    """Where memory crossed 90 % of the limit that applies while the cell ran: what grew."""
    return with_pressure(r, c.store.last_samples(r.duration_s + 1.0, time.time()))


Step = Callable[[Closing, CellReport], CellReport]
#: The report of a measured cell is the bare report through these, in this order.
REPORT_STEPS: tuple[Step, ...] = (exact_peaks, line_figures, holders, second_copies, child_processes, what_to_do,
                                  memory_pressure)
