"""The engine: one per shell. Owns the sources, the sampler, the store and the leak state.

It knows nothing of IPython; the magics adapter calls ``begin_cell``/``end_cell`` and the public
API. Faults inside nbmem are recorded here and reported once.
"""

from __future__ import annotations

import threading
import traceback as _tb
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from . import holders
from .cells import CELL_COLUMNS, CellRecord, CellReport, cell_records
from .cleaner import Cleaner, CleanupReport
from .formatting import fmt_bytes
from .sampler import Sampler
from .sources import Boundary, Probe, Sample, heap_bytes
from .store import Store, records_frame

OOM_ADVICE = (
    "evaluate under torch.no_grad() (or torch.inference_mode()): no activations are kept for backward",
    "optimizer.zero_grad(set_to_none=True) frees gradients between steps",
    "a smaller batch, with gradient accumulation to keep the effective batch size",
    "mixed precision: torch.autocast(device_type='cuda', dtype=torch.bfloat16)",
    "activation checkpointing (torch.utils.checkpoint) trades compute for memory",
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before CUDA starts) reduces fragmentation",
)


#: A walk this fast (a small namespace) is repeated after any rebinding; slower ones only when memory,
#: names, outputs or exceptions change, so a training cell that rebinds `loss` stays cheap.
CHEAP_SCAN_S = 0.005

RESTART_ADVICE = ("CUDA is in an error state (a device-side assert or an illegal access) and stays so for the "
                  "life of this process: restart the kernel. Cleanup cannot free GPU memory now.")
_CUDA_BROKEN = ("device-side assert", "illegal memory access", "unspecified launch failure",
                "cuda error: misaligned address")


@dataclass(frozen=True)
class Settings:
    """The options, as the ``Nbmem`` configurable sets them."""

    interval_s: float = 0.5
    history_s: float = 3600.0
    threshold_bytes: int = 2**20
    scan: bool = True
    show: str = "auto"  # auto | always | never
    reset_peak: bool = False
    scan_budget_s: float = 0.5


@dataclass
class Fault:
    where: str
    error: str
    count: int = 1


@dataclass
class _Open:
    cell: int
    before: Boundary
    reset: bool
    scan: bool
    baseline: holders.Scan | None  # what the cell's findings are compared with


@dataclass
class Status:
    """What nbmem can and cannot see, and why; shown by ``%cudamem status``."""

    devices: list[str]
    cannot: list[str]
    sampler_running: bool
    interval_s: float
    monitoring: bool
    faults: list[Fault] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"nbmem: sampling every {self.interval_s:g} s ({'running' if self.sampler_running else 'stopped'}); "
                 f"per-cell monitoring {'on' if self.monitoring else 'off'}",
                 "sees: " + (", ".join(self.devices) or "nothing")]
        lines += [f"cannot see: {c}" for c in self.cannot]
        lines += [f"fault in {f.where} (x{f.count}): {f.error}" for f in self.faults]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


class Session:
    """Everything nbmem holds for one shell; created on load, closed on unload."""

    def __init__(self, adapter: Any, settings: Settings = Settings(), probe: Probe | None = None,
                 notify: Callable[[str], None] = print) -> None:
        self.adapter = adapter
        self.settings = settings
        self.probe = probe or Probe()
        self.notify = notify
        self.store = Store(capacity=max(1, int(settings.history_s / settings.interval_s)) * 2)
        self.sampler: Sampler[Sample] = Sampler(self.probe.samples, self.store.add_samples,
                                                interval_s=settings.interval_s,
                                                on_error=lambda e: self.fault("sampler", e))
        self.monitoring = False
        self.cuda_broken = False
        self.faults: dict[str, Fault] = {}
        self._told: set[str] = set()
        self._open: _Open | None = None
        self._last_scan: holders.Scan | None = None
        self._scan_mark: tuple[Any, int | None, tuple[int, ...]] | None = None
        self._first_seen: dict[tuple[str, int], int] = {}
        self._findings: dict[int, tuple[holders.Finding, ...]] = {}
        self._finding_cells: deque[int] = deque()
        self.last_report: CellReport | None = None
        self.cell_listeners: list[Callable[[CellReport], None]] = []
        self._lock = threading.RLock()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self.probe.start()
        self.sampler.sample_once()
        self.sampler.start()

    def close(self) -> None:
        self.sampler.stop()
        self.probe.close()
        self.store.clear()
        self._findings.clear()
        self._last_scan = None
        self.cell_listeners.clear()
        self.sampler.listeners.clear()

    def reconfigure(self, settings: Settings) -> None:
        self.settings = settings
        if settings.interval_s != self.sampler.interval_s:
            self.sampler.stop()
            self.sampler.interval_s = settings.interval_s
            self.sampler.start()

    # -- faults: recorded always, told once ------------------------------------------------------------
    def fault(self, where: str, e: BaseException) -> None:
        msg = f"{type(e).__name__}: {e}"
        f = self.faults.get(where + msg)
        if f:
            f.count += 1
            return
        self.faults[where + msg] = Fault(where, msg + " | " + "".join(_tb.format_tb(e.__traceback__, limit=-2)).strip())
        self.tell_once(f"fault:{where}", f"nbmem: an internal error in {where} was recorded and will not be "
                       f"shown again ({msg}); your cell is unaffected. `%cudamem status` lists faults.")

    def tell_once(self, key: str, message: str) -> None:
        if key not in self._told:
            self._told.add(key)
            self.notify(message)

    def status(self) -> Status:
        p = self.probe
        cannot = [r for r in (p.nvml.reason, p.nvml.process_reason) if r]
        if p.torch.torch() is None:
            cannot.append("torch is not imported yet: no tensors to track")
        elif not p.torch.cuda_initialized() and p.nvml.devices:
            cannot.append("CUDA is not initialised in this process yet: allocator numbers start when it is")
        devices = ["cpu (RSS, CPU tensors)"] + [f"{d.name} = {d.model} (NVML #{d.nvml_index})" for d in p.nvml.devices]
        return Status(devices, cannot, self.sampler.running, self.sampler.interval_s, self.monitoring,
                      list(self.faults.values()))

    def greeting(self) -> str:
        st = self.status()
        gpus = [d for d in st.devices if d.startswith("cuda")]
        if gpus:
            return "nbmem: watching " + "; ".join(gpus) + ". %cudamem? for help."
        why = self.probe.nvml.reason or "no GPU found"
        return f"nbmem: no GPU seen ({why}); tracking CPU tensors and RSS. %cudamem? for help."

    # -- cells -----------------------------------------------------------------------------------
    def begin_cell(self, cell: int, *, reset_peak: bool | None = None, scan: bool | None = None) -> None:
        reset = self.settings.reset_peak if reset_peak is None else reset_peak
        do_scan = self.settings.scan if scan is None else scan
        if do_scan and (self._last_scan is None or not self.monitoring):
            # With monitoring on, the previous cell's closing scan is this cell's baseline.
            self._rescan()
        if reset:
            for i in range(self.probe.torch.device_count()):
                self.probe.torch.reset_peak(i)
        self._open = _Open(cell, self.probe.boundary(), reset, do_scan, self._last_scan)

    @property
    def in_cell(self) -> bool:
        return self._open is not None

    def end_cell(self, error: BaseException | None = None) -> CellReport | None:
        o, self._open = self._open, None
        if o is None:
            return None
        after = self.probe.boundary()
        err = type(error).__name__ if error is not None else ""
        records = cell_records(o.cell, o.before, after, error=err, was_reset=o.reset)
        found: tuple[holders.Finding, ...] = ()
        cur: holders.Scan | None = None
        unattributed: list[tuple[str, int]] = []
        if o.scan:
            prev = o.baseline  # not _last_scan: a cleanup inside the cell may have replaced it
            mark = self._mark(after.allocator)
            cur = (self._rescan(mark, budget_s=self.settings.scan_budget_s) if self._changed_since_scan(mark)
                   else self._last_scan)
            assert cur is not None
            # The CPU has no allocator counters: its "allocated" is the live CPU tensor storages the scan found.
            records = [replace(r, allocated_before_bytes=prev.totals.get("cpu", 0) if prev else None,
                               allocated_after_bytes=cur.totals.get("cpu", 0)) if r.device == "cpu" else r
                       for r in records]
            found = tuple(holders.findings(cur, prev, o.cell, threshold_bytes=self.settings.threshold_bytes))
            # Storages already there when watching began get cell 0: which cell made them is unknown.
            before = prev.storages if prev is not None else {}
            self._first_seen = {k: self._first_seen.get(k, 0 if k in before else o.cell) for k in cur.storages}
            self._remember(o.cell, found)
            for r in records:
                if r.allocated_after_bytes is None or r.device == "cpu":
                    continue
                # Allocated bytes no name reaches (cuBLAS workspaces, C++-held buffers, cycles): shown
                # when this cell made the gap grow, not under every report.
                gap = r.allocated_after_bytes - cur.totals.get(r.device, 0)
                gap0 = (r.allocated_before_bytes - prev.totals.get(r.device, 0)
                        if prev is not None and r.allocated_before_bytes is not None else 0)
                if gap - gap0 >= self.settings.threshold_bytes:
                    unattributed.append((r.device, gap))
        for r in records:
            self.store.add_cell(r)
        text = f"{err}: {error}".lower()
        if any(s in text for s in _CUDA_BROKEN):
            self.cuda_broken = True
            advice: tuple[str, ...] = (RESTART_ADVICE,)
        elif err == "OutOfMemoryError" or "out of memory" in text:
            advice = self._oom_advice(records)
        else:
            advice = ()
        if o.scan and cur is not None and cur.truncated:
            advice += (f"the holder scan stopped after {cur.objects_visited:,} objects ({cur.seconds:.2f} s, "
                       f"Nbmem.scan_budget): findings may be incomplete; nbmem.leaks() runs a full scan",)
        report = CellReport(o.cell, records[0].duration_s, tuple(records), found, tuple(unattributed), err, advice)
        self.last_report = report
        for listen in list(self.cell_listeners):
            try:
                listen(report)
            except Exception as e:
                self.fault("cell listener", e)
        return report

    def _oom_advice(self, records: Sequence[CellRecord]) -> tuple[str, ...]:
        lines = []
        for r in records:
            if r.reserved_after_bytes is not None and r.allocated_after_bytes is not None:
                cached = r.reserved_after_bytes - r.allocated_after_bytes
                lines.append(f"{r.device}: allocated {fmt_bytes(r.allocated_after_bytes)}, reserved "
                             f"{fmt_bytes(r.reserved_after_bytes)} ({fmt_bytes(cached)} cached but free: "
                             f"fragmentation if large)")
        return tuple(lines) + OOM_ADVICE

    def should_show(self, report: CellReport) -> bool:
        if self.settings.show == "never":
            return False
        if self.settings.show == "always" or report.findings or report.error:
            return True
        t = self.settings.threshold_bytes
        return any(abs(r.delta_allocated_bytes or 0) >= t or abs(r.delta_reserved_bytes or 0) >= t
                   or (r.peak_allocated_bytes or 0) - (r.allocated_before_bytes or 0) >= t for r in report.records)

    # -- leaks -----------------------------------------------------------------------------------
    def scan_now(self, *, budget_s: float | None = None) -> holders.Scan:
        """A walk of the notebook now; it changes no state (``leaks()`` and cleanup's measuring use it)."""
        return holders.scan(self.adapter.roots(), torch=self.probe.torch.torch(), budget_s=budget_s)

    def _rescan(self, mark: Any = None, *, budget_s: float | None = None) -> holders.Scan:
        """Walk now and keep the result as the latest scan, together with the state it saw."""
        mark = self._mark() if mark is None else mark
        self._last_scan = self.scan_now(budget_s=budget_s)
        self._scan_mark = mark
        return self._last_scan

    def _mark(self, allocator: Any = None) -> tuple[Any, int | None, Any]:
        readings = self.probe.allocator() if allocator is None else allocator
        alloc = tuple(sorted((d, r.allocated_bytes if r else None) for d, r in readings.items()))
        return alloc, heap_bytes() if heap_bytes else None, self.adapter.fingerprint()

    def _changed_since_scan(self, mark: Any) -> bool:
        """Whether a new walk could find something new.

        Yes when memory moved (CUDA allocated by any amount, exact; the C heap, where CPU tensors live,
        by half the report threshold), a name was added or deleted, an output or exception was kept,
        or a name was rebound while walks are cheap. A cell that only rebinds names in a namespace
        too big to walk quickly (a training loop's ``loss = ...``) is not walked again: nothing it
        could report has grown.
        """
        if self._last_scan is None or self._scan_mark is None:
            return True
        alloc, heap, (names, ids, kept) = mark
        alloc0, heap0, (names0, ids0, kept0) = self._scan_mark
        if alloc != alloc0 or names != names0 or kept != kept0:
            return True
        if ids != ids0 and self._last_scan.seconds < CHEAP_SCAN_S:
            return True
        return heap is None or heap0 is None or abs(heap - heap0) >= max(1, self.settings.threshold_bytes // 2)

    def tensor_totals(self) -> dict[str, int] | None:
        """Bytes of live tensor storages per device, as the latest scan found them; None before a scan."""
        return dict(self._last_scan.totals) if self._last_scan is not None else None

    def take_baseline(self) -> None:
        """Scan now: the state the next monitored cell is compared with."""
        self._rescan()

    def _remember(self, cell: int, found: tuple[holders.Finding, ...]) -> None:
        self._findings[cell] = found
        self._finding_cells.append(cell)
        while len(self._finding_cells) > 10_000:
            self._findings.pop(self._finding_cells.popleft(), None)

    def leak_list(self, cell: int | None = None) -> list[holders.Finding]:
        if cell is not None:
            return list(self._findings.get(cell, ()))
        cur = self.scan_now()
        return holders.current(cur, self._first_seen, threshold_bytes=self.settings.threshold_bytes)

    def leaks(self, cell: int | None = None) -> Any:
        return records_frame(self.leak_list(cell), columns=holders.FINDING_COLUMNS)

    def flagged(self) -> list[holders.Finding]:
        """Findings a front end may act on: those of the latest scan."""
        if self._last_scan is None:
            return []
        return holders.current(self._last_scan, self._first_seen, threshold_bytes=self.settings.threshold_bytes)

    # -- cleanup ---------------------------------------------------------------------------------
    def _measure(self) -> dict[str, tuple[int | None, int | None]]:
        out: dict[str, tuple[int | None, int | None]] = {}
        t = self.probe.torch
        for i in range(t.device_count()):
            r = t.read(i)
            if r is not None:
                out[f"cuda:{i}"] = (r.allocated_bytes, r.reserved_bytes)
        cpu = self.scan_now().totals.get("cpu")
        out["cpu"] = (cpu or 0, None)
        return out

    def _empty_cache(self) -> bool:
        if not self.probe.torch.cuda_initialized() or self.cuda_broken:
            return False
        torch = self.probe.torch.torch()
        assert torch is not None
        torch.cuda.empty_cache()
        return True

    def cleanup(self, **kw: Any) -> CleanupReport:
        if self.cuda_broken:
            self.notify(RESTART_ADVICE)
        rep = Cleaner(self.adapter, self._measure, self._empty_cache).run(**kw)
        self._rescan()
        return rep

    # -- frames ----------------------------------------------------------------------------------
    def samples(self) -> Any:
        return self.store.samples_frame()

    def report(self) -> Any:
        return records_frame(self.store.cell_list(), index="cell", columns=CELL_COLUMNS)
