"""A measured cell from its start to its report: boundaries, recording, closing scan, advice.

``CellWatch.begin`` reads the allocator, NVML and the host at the cell's start (after the baseline scan,
so the scan's own allocations are not the cell's) and starts a recording when one is wanted;
``CellWatch.end`` reads them again and builds the ``CellReport``: per-device records with exact peaks
(``cells``, then ``recording``), per-line figures, the owners of what the cell added (``holdings``),
what no name reaches, and advice after an out-of-memory error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nbmem.cells import advice
from nbmem.cells.peaks import cell_records, with_trace
from nbmem.formatting import spans
from nbmem.holders import pools
from nbmem.holders.holdings import Baseline, Holdings, with_cpu_allocated
from nbmem.holders.owners import Rows
from nbmem.measure import processes
from nbmem.measure.sources import Probe, largest_free_block
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

    @property
    def in_cell(self) -> bool:
        return self._open is not None

    def begin(self, cell: int, *, source: str, reset_peak: bool | None, scan: bool | None, lines: bool | None,
              trace: bool | None, monitoring: bool) -> None:
        s = self._settings()
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
        oom = advice.is_oom(error)
        records = cell_records(o.cell, o.before, after, error=err, was_reset=o.reset)
        replays = rec.replays(cell=o.cell, before=o.before, after=after, records=records, need=o.lines or oom,
                              marks=marks, source=o.source, cell_files=self.adapter.cell_files(o.cell),
                              names=self.adapter.cell_names()) if rec is not None else {}
        records = with_trace(records, replays)
        found = Rows((), ())
        unnamed = pools.Unnamed((), (), ())
        notes: list[str] = []
        line_records: tuple[LineRecord, ...] = ()
        if o.lines:
            line_records = tuple(r for rp in replays.values() for r in rp.lines)
            self.lines[o.cell] = line_records
            notes += self._line_notes(records, replays, rec)
        changed = False
        if o.scan:
            cur, found, changed = self.holdings.close_cell(o.cell, o.base, o.before, after, replays)
            records = with_cpu_allocated(records, o.base, self.holdings.tensor_bytes(cur))
            unnamed = self.holdings.unattributed(records, cur)
            if cur.truncated:
                budget = self._settings().scan_budget_s
                notes.append(f"the holder scan stopped at Nbmem.scan_budget ({budget:g} s) before finishing "
                             f"{', '.join(cur.unfinished[:5])}{' and others' if len(cur.unfinished) > 5 else ''}: "
                             f"findings may be incomplete; nbmem.leaks() scans everything")
        # This notebook's child processes: what they held while the cell ran, and those it left running.
        children = processes.left_running(after, self.children_seen)
        self.children_seen = processes.on_gpus(after)
        children_use = processes.children_use(o.before, after,
                                              self.store.samples_between(o.before.t_wall, after.t_wall),
                                              threshold_bytes=self._settings().threshold_bytes)
        for r in records:
            self.store.add_cell(r)
        broken = advice.breaks_cuda(error)
        tips: tuple[str, ...] = ()
        if broken:
            tips = (advice.RESTART_ADVICE,)
        elif oom and error is not None:
            tips = advice.oom_advice(records, error, source=o.source, lines_recorded=o.lines, replays=replays,
                                     cell_files=self.adapter.cell_files(o.cell), names=self.adapter.cell_names(),
                                     largest_free=self._largest_free(records))
        elif not error:
            notes += advice.headroom(records, after, self._settings().threshold_bytes)
        report = CellReport(o.cell, records[0].duration_s, tuple(records), found.owners, unnamed.gaps, err,
                            tips, lines=line_records, notes=tuple(notes), held_bytes=found.total_bytes,
                            pools=unnamed.pools, compiled=unnamed.compiled, children=children,
                            children_use=children_use, explain_unattributed=not self.unattributed_explained,
                            unattributed_before=unnamed.before, explain_cpu=not self.cpu_explained)
        self.unattributed_explained |= report.says_unattributed
        return report, changed, broken

    def _largest_free(self, records: Any) -> dict[str, int]:
        """Each GPU's largest free cached block, read after an out-of-memory error (the allocator's segments)."""
        segs = self.probe.torch.segments()
        if segs is None:
            return {}
        return {r.device: largest_free_block(segs, int(r.device.partition(":")[2]))
                for r in records if r.device.startswith("cuda:")}

    def _line_notes(self, records: Any, replays: Any, rec: Recording | None) -> list[str]:
        if not any(r.device.startswith("cuda") for r in records):
            return ["per-line figures need a CUDA device: this cell ran on the CPU only"]
        if not replays:
            why = self.probe.torch.trace_unsupported() or "Nbmem.trace_entries is 0"
            return [f"no per-line figures for this cell: {why}"]
        if rec is not None and rec.full_at_us is not None:
            return [f"lines were followed for this cell's first {rec.max_marks:,} lines of Python "
                    f"(Nbmem.trace_entries): its later allocations count toward its peak, not toward a line"]
        return []

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
