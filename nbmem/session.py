"""The engine: one per shell. Owns the sources, the sampler, the store, the holdings and the cleanup door.

It knows nothing of IPython: the IPython adapter (its cell hooks in ``ipython.root``, the ``%%cudamem`` magic)
calls ``begin_cell``/``end_cell`` and the public API with plain values and an adapter object. Consumers (the
gauge, an exporter) ``subscribe`` to what it produces (``Tick``, ``CellReport``, ``Holders``,
``CleanupReport``) and read it through its methods; nothing outside reaches into its store, sampler or
sources. Faults inside nbmem are recorded here and reported once.

The work is in rooms of its own: a measured cell in ``cells.watch``, the holder scans and findings in
``holders.holdings``, cleanup in ``clean.cleaner``; this class wires them and publishes what they make.
"""

from __future__ import annotations

import threading
import time
import traceback as _tb
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from nbmem.cells.advice import RESTART_ADVICE
from nbmem.cells.watch import CellWatch
from nbmem.clean.cleaner import Cleaner
from nbmem.clean.release import TorchRelease
from nbmem.clean.request import CleanupRequest
from nbmem.formatting import fmt_bytes, plural, spans
from nbmem.holders.holdings import REFRESH_BUDGET_S, Holdings
from nbmem.holders.owners import Rows
from nbmem.holders.pools import pool_lines
from nbmem.holders.scanner import Scan
from nbmem.measure.processes import child_lines
from nbmem.measure.sources import Probe
from nbmem.options import Settings
from nbmem.records import (
    CELL_COLUMNS,
    FINDING_COLUMNS,
    LINE_COLUMNS,
    PAGED,
    CellRecord,
    Fault,
    Finding,
    GpuDevice,
    Holders,
    Sample,
    Tick,
)
from nbmem.reports import CellReport, CleanupReport, Leaks, Lines, Status, limit_line
from nbmem.sampler import Sampler
from nbmem.store import Store, records_frame, ticks_for

if TYPE_CHECKING:
    from nbmem.fitting.analysis.prediction import FitResult

Listener = Callable[[Any], None]


def scan_lines(s: Scan | None) -> tuple[str, ...]:
    """How the last holder scan went, a line each (``%cudamem status``)."""
    if s is None:
        return ()
    out = [f"last holder scan: {plural(s.objects, 'object')} in {s.seconds * 1000:.1f} ms, walked "
           f"{len(s.walked)} of the roots (the others were unchanged)"]
    if s.errors:
        out.append(f"skipped {plural(s.errors, 'object')} that could not be read ({', '.join(s.error_types)})")
    if s.unfinished:
        out.append("not finished within Nbmem.scan_budget: " + ", ".join(s.unfinished[:10]))
    return tuple(out)


def paged_lines(s: Scan | None) -> tuple[str, ...]:
    """The paged memory the scan found (bitsandbytes' paged optimizers), a line per GPU: it is in nvidia-smi's
    figure while on the GPU and never in torch's, so without this line it reads as memory outside PyTorch."""
    per: dict[str, tuple[int, set[str]]] = {}
    for h in s.storages.values() if s is not None else ():
        if h.device.startswith(PAGED):
            n, owners = per.get(h.device, (0, set()))
            owners.add(h.owner)
            per[h.device] = (n + h.nbytes, owners)
    return tuple(f"{dev.removeprefix(PAGED)}: {fmt_bytes(n)} of CUDA managed memory held by "
                 f"{', '.join(f'`{o}`' for o in sorted(owners))} (a bitsandbytes paged optimizer's state), outside "
                 f"PyTorch's allocator; bitsandbytes never frees it"
                 for dev, (n, owners) in sorted(per.items()))


def worth_showing(report: CellReport, settings: Settings) -> bool:
    """Whether a monitored cell's report is shown: it moved memory by the threshold, named a holder, failed, ..."""
    if settings.show == "never":
        return False
    if (settings.show == "always" or report.findings or report.error or report.notes or report.children
            or report.children_use or report.pools):
        return True
    t = settings.threshold_bytes
    return any(abs(r.delta_allocated_bytes or 0) >= t or abs(r.delta_reserved_bytes or 0) >= t
               or (r.peak_allocated_bytes or 0) - (r.allocated_before_bytes or 0) >= t for r in report.records)


class Session:
    """Everything nbmem holds for one shell; created on load, closed on unload."""

    def __init__(self, adapter: Any, settings: Settings = Settings(), probe: Probe | None = None,
                 notify: Callable[[str], None] = print) -> None:
        self.adapter = adapter
        self.settings = settings
        self.probe = probe or Probe()
        self.release = TorchRelease()  # the one way torch's memory is given back: a cleanup's steps, a fit's runs
        self.notify = notify
        self.store = Store(ticks=ticks_for(settings.history_s, settings.interval_s))
        self.sampler: Sampler[Sample] = Sampler(self.probe.samples, self._on_tick, interval_s=settings.interval_s,
                                                on_error=lambda e: self.fault("sampler", e))
        self.holdings = Holdings(adapter, self.probe, lambda: self.settings)
        self.cells = CellWatch(adapter, self.probe, self.holdings, self.store, lambda: self.settings, self.fault)
        self.monitoring = self.cuda_broken = False
        self._faults: dict[str, Fault] = {}
        self._told: set[str] = set()
        self.cannot: list[str] = []  # what the adapter found this kernel cannot do, for `%cudamem status`
        self.last_report: CellReport | None = None
        self.last_shown_report: CellReport | None = None  # what `--last-report` cleans: what the user saw
        self.last_cleanup: CleanupReport | None = None
        self.last_fit: FitResult | None = None
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        self.probe.start()
        self.sampler.sample_once()
        self.sampler.start()
        if self.probe.torch.torch() is not None and self.settings.scan:
            # Tensors made before loading are held too: one bounded look, so the gauge opens knowing them.
            try:
                self.holdings.rescan(cell=0, walk="all", budget_s=self.settings.scan_budget_s)
            except Exception as e:
                self.fault("the first holder scan", e)

    def close(self) -> None:
        self.cells.abandon()
        self.sampler.stop()
        self.probe.close()
        self.store.clear()
        self.holdings.clear()
        with self._lock:
            self._listeners.clear()

    def reconfigure(self, settings: Settings) -> None:
        """Apply new options now: the sampling interval and the history's length take effect at once."""
        old, self.settings = self.settings, settings
        if (settings.history_s, settings.interval_s) != (old.history_s, old.interval_s):
            self.store.resize(ticks_for(settings.history_s, settings.interval_s))
        if settings.interval_s != old.interval_s:
            self.sampler.stop()
            self.sampler.interval_s = settings.interval_s
            self.sampler.start()

    # -- the one seam: subscribers get records, nothing else -----------------------------------------
    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with every ``Tick`` (sampler thread), ``CellReport``, ``Holders`` and
        ``CleanupReport`` (the thread that ran the cell or the cleanup). Returns the unsubscribe call."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)
        return unsubscribe

    @property
    def subscribers(self) -> int:
        with self._lock:
            return len(self._listeners)

    def _publish(self, event: Any) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listen in listeners:
            try:
                listen(event)
            except Exception as e:
                self.fault("a subscriber", e)

    def _on_tick(self, batch: Sequence[Sample]) -> None:
        self.store.add_tick(batch)
        self._publish(Tick(tuple(batch)))

    def _publish_holders(self) -> None:
        if self.holdings.last_scan is not None and self.subscribers:
            self._publish(Holders(self.findings()))

    # -- faults: recorded always, told once ----------------------------------------------------------
    def fault(self, where: str, e: BaseException) -> None:
        msg = f"{type(e).__name__}: {e}"
        key = where + msg
        f = self._faults.get(key)
        if f:
            self._faults[key] = replace(f, count=f.count + 1)
            return
        where_in_code = "".join(_tb.format_tb(e.__traceback__, limit=-2)).strip()
        self._faults[key] = Fault(where, f"{msg} | {where_in_code}", 1)
        self.tell_once(f"fault:{where}", f"nbmem: an internal error in {where} was recorded and will not be "
                       f"shown again ({msg}); your cell is unaffected. `%cudamem status` lists faults.")

    def tell_once(self, key: str, message: str) -> None:
        if key not in self._told:
            self._told.add(key)
            self.notify(message)

    @property
    def faults(self) -> tuple[Fault, ...]:
        return tuple(self._faults.values())

    # -- what the engine can see ---------------------------------------------------------------------
    def devices(self) -> tuple[GpuDevice, ...]:
        return tuple(self.probe.nvml.devices)

    def notes(self) -> tuple[str, ...]:
        """Why some numbers are unknown, in a line each (the gauge shows them)."""
        nv = self.probe.nvml
        if self.cuda_broken:
            return (RESTART_ADVICE,)
        out = []
        if not nv.devices:
            out.append(f"no GPU seen: {nv.reason or 'no GPU found'}; showing this machine's memory")
        elif nv.process_reason:
            out.append(f"per-process numbers unknown: {nv.process_reason}")
        elif nv.children_reason:
            out.append(f"child processes unknown: {nv.children_reason}")
        return tuple(out)

    def status(self) -> Status:
        p = self.probe
        cannot = [r for r in (p.nvml.reason, p.nvml.process_reason, p.nvml.children_reason) if r] + self.cannot
        if p.torch.torch() is None:
            cannot.append("torch is not imported yet: no tensors to track")
        elif not p.torch.cuda_initialized() and p.nvml.devices:
            cannot.append("CUDA is not initialised in this process yet: allocator numbers start when it is")
        devices = ("cpu (RSS, CPU tensors)", *(f"{d.name} = {d.model} (NVML #{d.nvml_index})" for d in p.nvml.devices))
        scan, tick, s = self.holdings.last_scan, self.store.latest_tick(), self.sampler
        return Status(devices, tuple(cannot), s.running, s.interval_s, self.monitoring, self.faults, scan_lines(scan),
                      child_lines(tick), pool_lines(p.torch.segments(), scan), limit_line(tick), paged_lines(scan))

    def greeting(self) -> str:
        gpus = [f"{d.name} = {d.model}" for d in self.probe.nvml.devices]
        if gpus:
            return "nbmem: watching " + "; ".join(gpus) + ". %cudamem? for help."
        why = self.probe.nvml.reason or "no GPU found"
        return f"nbmem: no GPU seen: {why}. Tracking CPU tensors and RSS; %cudamem? for help."

    # -- cells -----------------------------------------------------------------------------------------
    def begin_cell(self, cell: int, *, source: str = "", own: bool = False, reset_peak: bool | None = None,
                   scan: bool | None = None, lines: bool | None = None, trace: bool | None = None) -> None:
        self.cells.begin(cell, source=source, reset_peak=reset_peak, scan=scan, lines=lines, trace=trace,
                         monitoring=self.monitoring, own=own)

    @property
    def in_cell(self) -> bool:
        return self.cells.in_cell

    def end_cell(self, error: BaseException | None = None) -> CellReport | None:
        ended = self.cells.end(error)
        if ended is None:
            return None
        report, changed, broken = ended
        self.cuda_broken |= broken
        self.last_report = report
        self._publish(report)
        if changed:
            self._publish_holders()
        return report

    def shown(self, report: CellReport) -> None:
        """The adapter displayed ``report``; `%cudamem clean --last-report` now means this one."""
        self.last_shown_report = report
        self.cells.cpu_explained |= report.says_cpu  # said once: later reports just leave those columns out

    def should_show(self, report: CellReport) -> bool:
        return worth_showing(report, self.settings)

    def take_baseline(self) -> None:
        """Scan everything now: the state the next monitored cell is compared with."""
        self.holdings.scan_all()
        self._publish_holders()

    # -- lines ---------------------------------------------------------------------------------------------
    def lines(self, cell: int | None = None) -> Any:
        return records_frame(self.cells.line_list(cell)[1], columns=LINE_COLUMNS)

    def lines_table(self, cell: int | None = None) -> Lines:
        n, recs = self.cells.line_list(cell)
        peaks = {r.device: r.peak_line for r in self.store.cell_list() if r.cell == n}
        return Lines(n, recs, peaks)

    # -- holders ---------------------------------------------------------------------------------------------
    def measured_cells(self) -> list[int]:
        return sorted({r.cell for r in self.cell_list(own=False)})

    def leak_rows(self, cell: int | None = None) -> Rows:
        """What cell N added, or (None) everything held now after a full scan: owner rows and the detail."""
        if cell is not None:
            found = self.holdings.of_cell(cell)
            if found is None and cell not in (measured := self.measured_cells()):
                span = f"measured cells: {spans(measured)}" if measured else "no cell has been measured yet"
                raise LookupError(f"cell {cell} was not measured ({span}); `%cudamem on` measures every cell")
            return found or Rows((), ())
        self.holdings.scan_all()
        self._publish_holders()
        return self.holdings.current()

    def leak_list(self, cell: int | None = None, *, detail: bool = False) -> list[Finding]:
        rows = self.leak_rows(cell)
        return list(rows.detail if detail else rows.owners)

    def leaks(self, cell: int | None = None, *, detail: bool = False) -> Any:
        return records_frame(self.leak_list(cell, detail=detail), columns=FINDING_COLUMNS,
                             note=self.holdings.why_empty(cell))  # read after the scan the list made

    def leaks_table(self, cell: int | None = None, *, detail: bool = False) -> Leaks:
        rows = self.leak_rows(cell)
        title = f"holders of memory cell [{cell}] added" if cell is not None else "holders of memory now"
        return Leaks(rows.detail if detail else rows.owners, title, cell=cell, detail=detail,
                     total_bytes=rows.total_bytes, note=self.holdings.why_empty(cell))

    def findings(self) -> tuple[Finding, ...]:
        """The owners above the threshold as of the latest scan (what the gauge lists)."""
        return self.holdings.current().owners

    def refresh_holders(self) -> None:
        """After a cell nobody measured: walk what it changed (``REFRESH_BUDGET_S`` at most), tell the gauge."""
        if self.settings.scan and self.holdings.refresh(REFRESH_BUDGET_S) is not None:
            self._publish_holders()

    def holders_scanned_at(self) -> float | None:
        """When the latest holder scan ran (epoch seconds), None before one."""
        return self.holdings.scanned_at

    def holders_note(self) -> str:
        """What to say where no owner is listed: nothing passed the threshold, or why that is not known."""
        return self.holdings.note()

    def tensor_totals(self) -> dict[str, int] | None:
        """Bytes of live tensor storages per device, as the latest scan found them; None before a scan."""
        s = self.holdings.last_scan
        return None if s is None else dict(self.holdings.tensor_bytes(s))

    # -- cleanup: the one door ------------------------------------------------------------------------
    def _measure(self) -> dict[str, tuple[int | None, int | None]]:
        out: dict[str, tuple[int | None, int | None]] = {}
        t = self.probe.torch
        for i in range(t.device_count()):
            r = t.read(i)
            if r is not None:
                out[f"cuda:{i}"] = (r.allocated_bytes, r.reserved_bytes)
        # On the CPU, what tensors hold: an incremental scan (deleted names are the only change) is cheap.
        self.holdings.rescan(cell=0, walk="changed", validate=True)
        totals = self.tensor_totals() or {}
        out["cpu"] = (totals.get("cpu", 0), None)
        return out

    def _empty_cache(self) -> bool:
        return not self.cuda_broken and self.release.empty_cache()

    def cleanup(self, request: CleanupRequest) -> CleanupReport:
        """Check the whole request (CleanupRefused, nothing removed), then run it and report each step."""
        request.check(self.adapter)
        if self.cuda_broken:
            self.notify(RESTART_ADVICE)
        held_by = self.holdings.held_by(request.names)
        rep = Cleaner(self.adapter, self._measure, self._empty_cache, self.release.reset_compiled).run(request)
        self.holdings.rescan(cell=0, walk="changed")
        rep = replace(rep, still_held=self.holdings.still_held(held_by))
        self.holdings.forget_current()
        self._publish_holders()
        self._publish(rep)
        self.last_cleanup = rep  # the magic shows it; the function returns it
        return rep

    # -- will it fit? -------------------------------------------------------------------------------------
    def fit(self, body: str | Callable[[int], object], name: str, values: Sequence[int], *, cell: int = 0,
            warmup: bool = True, restore: bool = True, want: int | None = None, on: Any = None,
            show: Callable[[str, bool], None] | None = None, host_limit: int | None = None) -> FitResult:
        """Run ``body`` once per value (a cell's source, ``name`` bound; or a function of the value) and
        predict the largest value that fits (on ``on``, another GPU, where given); the modules and optimizers
        it reaches are restored after. ``show``: where the fit's progress line goes (``fitting.runs.progress``)."""
        from nbmem.fitting.runs.notebook import fit_in_notebook  # imported when a fit is asked for, not on load

        try:
            result = fit_in_notebook(self.adapter, self.release, self.holdings.scanner.type_cache, body, name,
                                     values, cell=cell, warmup=warmup, restore=restore, want=want, on=on,
                                     own_used=self.probe.nvml.own_used, show=show, host_limit=host_limit)
        finally:
            self.holdings.closed_scan = None  # the fit ran code: the next cell's baseline is scanned again
        self.last_fit = result
        return result

    # -- frames ------------------------------------------------------------------------------------------
    def samples(self) -> Any:
        return self.store.samples_frame()

    def report(self) -> Any:
        return records_frame(self.store.cell_list(), columns=CELL_COLUMNS, index="cell")

    def recent_samples(self, seconds: float) -> list[Sample]:
        return self.store.last_samples(seconds, time.time())

    def cell_list(self, *, own: bool = True) -> list[CellRecord]:  # own=False: without nbmem's `%cudamem clean`s
        return [r for r in self.store.cell_list() if own or r.cell not in self.cells.own]
