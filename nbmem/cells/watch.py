"""A measured cell from its start to its report: boundaries, recording, closing scan, advice.

``CellWatch.begin`` reads the allocator, NVML and the host at the cell's start (after the baseline scan,
so the scan's own allocations are not the cell's) and starts a recording when one is wanted;
``CellWatch.end`` reads them again, makes the bare ``CellReport`` (per-device records from the allocator's
counters, ``peaks``) and hands it through ``steps.REPORT_STEPS``: exact peaks from the trace, per-line figures,
the owners of what the cell added, child processes, advice, memory pressure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nbmem.cells import advice
from nbmem.cells.peaks import cell_records
from nbmem.cells.steps import REPORT_STEPS, Closing
from nbmem.formatting import spans
from nbmem.holders.holdings import Baseline, Holdings
from nbmem.measure import processes
from nbmem.measure.sources import Probe
from nbmem.options import Settings
from nbmem.records import Boundary, LineRecord
from nbmem.reports import CellReport
from nbmem.store import Store
from nbmem.trace.recording import Recording


@dataclass
class _Open:
    cell: int
    before: Boundary
    reset: bool
    scan: bool
    base: Baseline
    lines: bool
    source: str
    recording: Recording | None


def as_compiled(source: str) -> str:
    """A cell's text as its code's line numbers count it: IPython drops leading blank lines before it
    compiles a cell (its ``leading_empty_lines`` transform), so line 1 is the first line with text."""
    lines = source.splitlines()
    first = next((i for i, ln in enumerate(lines) if ln.strip()), 0)
    return "\n".join(lines[first:])


class CellWatch:
    """The one cell being measured, and the per-line figures of the cells that had them."""

    def __init__(self, adapter: Any, probe: Probe, holdings: Holdings, store: Store,
                 settings: Callable[[], Settings], fault: Callable[[str, BaseException], None]) -> None:
        self.adapter = adapter
        self.probe = probe
        self.holdings = holdings
        self.store = store
        self._settings = settings
        self.fault = fault
        self._open: _Open | None = None
        self.lines: dict[int, tuple[LineRecord, ...]] = {}
        self.children_seen: frozenset[processes.ChildKey] = frozenset()  # on the GPUs when the last cell ended
        self.unattributed_explained = False  # the long text is said once a session, then a pointer to the status
        self.cpu_explained = False  # what a CPU cannot tell, said under the first CPU report shown
        self.own: set[int] = set()  # nbmem's own cells (`%cudamem clean`): measured, so the records add up; not listed

    @property
    def in_cell(self) -> bool:
        return self._open is not None

    def begin(self, cell: int, *, source: str, reset_peak: bool | None, scan: bool | None, lines: bool | None,
              trace: bool | None, monitoring: bool, own: bool = False) -> None:
        s = self._settings()
        if own:
            self.own.add(cell)
        reset = s.reset_peak if reset_peak is None else reset_peak
        do_scan = s.scan if scan is None else scan
        want_lines = s.lines if lines is None else lines
        base = self.holdings.baseline(source, scan=do_scan, monitoring=monitoring)
        if reset:
            for i in range(self.probe.torch.device_count()):
                self.probe.torch.reset_peak(i)
        before = self.probe.boundary()
        # Recording starts last (after the boundary: the trace's events start from its allocated bytes),
        # and nothing that can fail stands between it and the open cell that will stop it.
        rec = None
        if want_lines or (s.trace if trace is None else trace):
            rec = Recording.start(self.probe.torch, self.fault, lines=want_lines, max_entries=s.trace_entries)
        try:
            self._open = _Open(cell, before, reset, do_scan, base, want_lines, as_compiled(source), rec)
        except BaseException:
            if rec is not None:
                rec.stop()
            raise

    def abandon(self) -> None:
        """Forget a cell that will never end here (``%unload_ext nbmem`` inside a monitored cell): a recording
        nbmem started for it is stopped, or it would run on unread, and the next load would take it for the
        user's own and never stop it."""
        o, self._open = self._open, None
        if o is not None and o.recording is not None:
            o.recording.stop()

    def end(self, error: BaseException | None) -> tuple[CellReport, bool, bool] | None:
        """The cell's report, whether its holders may have changed, and whether CUDA broke in it."""
        o, self._open = self._open, None
        if o is None:
            return None
        try:
            return self._end(o, error)
        finally:
            if o.recording is not None:
                o.recording.stop()  # whatever failed on the way: nbmem's recording never outlives its cell

    def _end(self, o: _Open, error: BaseException | None) -> tuple[CellReport, bool, bool]:
        rec = o.recording
        marks = rec.stop_clock() if rec is not None else None
        after = self.probe.boundary()
        err = type(error).__name__ if error is not None else ""
        records = cell_records(o.cell, o.before, after, error=err, was_reset=o.reset)
        replays = rec.replays(cell=o.cell, before=o.before, after=after, records=records,
                              need=o.lines or advice.is_oom(error), marks=marks, source=o.source,
                              cell_files=self.adapter.cell_files(o.cell),
                              names=self.adapter.cell_names()) if rec is not None else {}
        c = Closing(o.cell, o.before, after, o.base, o.source, o.lines, o.scan, error, rec, replays,
                    self._settings(), self.probe, self.holdings, self.store, self.adapter, self.children_seen)
        report = CellReport(o.cell, records[0].duration_s, tuple(records), error=err,
                            explain_unattributed=not self.unattributed_explained,
                            explain_cpu=not self.cpu_explained)
        for step in REPORT_STEPS:
            report = step(c, report)
        for r in report.records:
            self.store.add_cell(r)
        if o.lines:
            self.lines[o.cell] = c.line_records
        self.children_seen = c.children_now
        self.unattributed_explained |= report.says_unattributed
        return report, c.holders_changed, c.cuda_broken

    def line_list(self, cell: int | None = None) -> tuple[int, tuple[LineRecord, ...]]:
        """A cell's per-line records: cell N, or (None) the last cell measured with lines."""
        if cell is None:
            if not self.lines:
                raise LookupError("no cell was measured with lines yet: put `%%cudamem --lines` on a cell, or "
                                  "`%config Nbmem.lines = True` with `%cudamem on`")
            cell = max(self.lines)
        if cell not in self.lines:
            have = spans(sorted(self.lines)) or "none"
            raise LookupError(f"cell {cell} was not measured with lines (with lines: {have})")
        return cell, self.lines[cell]
