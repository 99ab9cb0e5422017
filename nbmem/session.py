"""The engine: one per shell. Owns the sources, the sampler, the store, the holder scanner and the cleanup door.

It knows nothing of IPython: the magics adapter calls ``begin_cell``/``end_cell`` and the public API
with plain values and an adapter object. Consumers (the gauge, an exporter) ``subscribe`` to what it
produces (``Tick``, ``CellReport``, ``Holders``, ``CleanupReport``) and read it through its methods;
nothing outside reaches into its store, sampler or sources. Faults inside nbmem are recorded here and
reported once.
"""

from __future__ import annotations

import gc
import threading
import time
import traceback as _tb
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from . import holders
from .cells import cell_records, with_trace
from .cleaner import Cleaner, CleanupRequest
from .formatting import fmt_bytes
from .holders import Scan, Scanner
from .linetrace import Replay, line_of_exception, replay, with_marked_frames
from .options import Settings
from .records import (
    CELL_COLUMNS,
    FINDING_COLUMNS,
    Boundary,
    CellRecord,
    CellReport,
    CleanupReport,
    Fault,
    Finding,
    GpuDevice,
    Holders,
    Leaks,
    LineRecord,
    Lines,
    Sample,
    Status,
    Tick,
)
from .sampler import Sampler
from .sources import LineClock, Probe, Trace, heap_bytes
from .store import Store, records_frame, ticks_for

OOM_ADVICE = (
    "evaluate under torch.no_grad() (or torch.inference_mode()): no activations are kept for backward",
    "optimizer.zero_grad(set_to_none=True) frees gradients between steps",
    "a smaller batch, with gradient accumulation to keep the effective batch size",
    "mixed precision: torch.autocast(device_type='cuda', dtype=torch.bfloat16)",
    "activation checkpointing (torch.utils.checkpoint) trades compute for memory",
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before CUDA starts) reduces fragmentation",
)
RESTART_ADVICE = ("CUDA is in an error state (a device-side assert or an illegal access) and stays so for the "
                  "life of this process: restart the kernel. Cleanup cannot free GPU memory now.")
_CUDA_BROKEN = ("device-side assert", "illegal memory access", "unspecified launch failure",
                "cuda error: misaligned address")
#: Most cells whose findings are kept for ``nbmem.leaks(cell=N)``.
CELLS_KEPT = 10_000

Listener = Callable[[Any], None]


@dataclass
class _Open:
    cell: int
    before: Boundary
    reset: bool
    scan: bool
    baseline: Scan | None  # what the cell's findings are compared with
    baseline_bytes: dict[str, int] | None  # its bytes per device, taken while its storages' graphs were alive
    mentioned: frozenset[str]
    gen_collections: int
    heap_bytes: int | None
    trace: Trace | None
    lines: bool
    source: str
    clock: LineClock | None = None  # the lines' timestamps, when --lines places events by time (not stacks)


def as_compiled(source: str) -> str:
    """A cell's text as its code's line numbers count it: IPython drops leading blank lines before it
    compiles a cell (its ``leading_empty_lines`` transform), so line 1 is the first line with text."""
    lines = source.splitlines()
    first = next((i for i, ln in enumerate(lines) if ln.strip()), 0)
    return "\n".join(lines[first:])


class Session:
    """Everything nbmem holds for one shell; created on load, closed on unload."""

    def __init__(self, adapter: Any, settings: Settings = Settings(), probe: Probe | None = None,
                 notify: Callable[[str], None] = print) -> None:
        self.adapter = adapter
        self.settings = settings
        self.probe = probe or Probe()
        self.notify = notify
        self.store = Store(ticks=ticks_for(settings.history_s, settings.interval_s))
        self.sampler: Sampler[Sample] = Sampler(self.probe.samples, self._on_tick, interval_s=settings.interval_s,
                                                on_error=lambda e: self.fault("sampler", e))
        self.scanner = Scanner(self.probe.torch.torch)
        self.monitoring = False
        self.cuda_broken = False
        self._faults: dict[str, Fault] = {}
        self._told: set[str] = set()
        self._open: _Open | None = None
        self._last_scan: Scan | None = None
        self._closed_scan: Scan | None = None  # the last scan a measured cell closed with
        self._scan_mark: tuple[Any, ...] | None = None
        self._gaps: dict[str, int] = {}  # allocated bytes no name reached, per device, after the last scan
        self._findings: dict[int, tuple[Finding, ...]] = {}
        self._lines: dict[int, tuple[LineRecord, ...]] = {}
        self._totals_cache: list[tuple[Scan, dict[str, int]]] = []
        self._finding_cache: dict[int, Any] = {}
        self._finding_cells: deque[int] = deque()
        self._current: tuple[Finding, ...] = ()
        self._current_of: Scan | None = None  # the scan _current was computed from
        self.last_report: CellReport | None = None
        self.last_shown_report: CellReport | None = None  # what `--last-report` cleans: what the user saw
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        self.probe.start()
        self.sampler.sample_once()
        self.sampler.start()

    def close(self) -> None:
        self._abandon_cell()
        self.sampler.stop()
        self.probe.close()
        self.store.clear()
        self._findings.clear()
        self._last_scan = None
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
        return tuple(out)

    def status(self) -> Status:
        p = self.probe
        cannot = [r for r in (p.nvml.reason, p.nvml.process_reason) if r]
        if p.torch.torch() is None:
            cannot.append("torch is not imported yet: no tensors to track")
        elif not p.torch.cuda_initialized() and p.nvml.devices:
            cannot.append("CUDA is not initialised in this process yet: allocator numbers start when it is")
        devices = ["cpu (RSS, CPU tensors)"] + [f"{d.name} = {d.model} (NVML #{d.nvml_index})" for d in p.nvml.devices]
        scan = []
        s = self._last_scan
        if s is not None:
            scan.append(f"last holder scan: {s.objects:,} objects in {s.seconds * 1000:.1f} ms, walked "
                        f"{len(s.walked)} of the roots (the others were unchanged)")
            if s.errors:
                scan.append(f"{s.errors} objects could not be read and were skipped ({', '.join(s.error_types)})")
            if s.unfinished:
                scan.append("not finished within Nbmem.scan_budget: " + ", ".join(s.unfinished[:10]))
        return Status(tuple(devices), tuple(cannot), self.sampler.running, self.sampler.interval_s, self.monitoring,
                      self.faults, tuple(scan))

    def greeting(self) -> str:
        gpus = [f"{d.name} = {d.model}" for d in self.probe.nvml.devices]
        if gpus:
            return "nbmem: watching " + "; ".join(gpus) + ". %cudamem? for help."
        why = self.probe.nvml.reason or "no GPU found"
        return f"nbmem: no GPU seen: {why}. Tracking CPU tensors and RSS; %cudamem? for help."

    # -- cells -----------------------------------------------------------------------------------------
    def begin_cell(self, cell: int, *, source: str = "", reset_peak: bool | None = None,
                   scan: bool | None = None, lines: bool | None = None, trace: bool | None = None) -> None:
        reset = self.settings.reset_peak if reset_peak is None else reset_peak
        do_scan = self.settings.scan if scan is None else scan
        want_lines = self.settings.lines if lines is None else lines
        if do_scan and not self._baseline_fresh:
            # The previous cell's closing scan is this cell's baseline; without one (monitoring began
            # inside the previous cell, or it was not measured), what changed since is walked now.
            self._rescan(cell=0, walk="changed")
        if reset:
            for i in range(self.probe.torch.device_count()):
                self.probe.torch.reset_peak(i)
        mentioned = frozenset(self.adapter.mentioned(source)) if do_scan and source else frozenset()
        base = self._last_scan
        base_bytes = self._tensor_bytes(base) if do_scan and base is not None else None
        gen_collections, heap = _collections(), heap_bytes() if heap_bytes else None
        before = self.probe.boundary()
        # Recording starts last (after the boundary: the trace's events start from its allocated bytes),
        # and nothing that can fail stands between it and the open cell that will stop it.
        recording, clock = None, None
        if want_lines or (self.settings.trace if trace is None else trace):
            recording, clock = self._start_recording(want_lines)
        try:
            self._open = _Open(cell, before, reset, do_scan, base, base_bytes, mentioned, gen_collections, heap,
                               recording, want_lines, as_compiled(source), clock)
        except BaseException:
            self._stop_recording(recording, clock)
            raise

    def _start_recording(self, lines: bool) -> tuple[Trace | None, LineClock | None]:
        """The allocator's trace for one cell and, for --lines, where its lines come from: timestamps where
        this Python can take them (sys.monitoring), else a Python stack recorded with every allocator
        event, which costs a launch-bound loop more. Whatever fails, nothing is left running."""
        clock: LineClock | None = None
        recording: Trace | None = None
        try:
            if lines:
                clock = LineClock(max_marks=self.settings.trace_entries)
                if not clock.start():  # an older Python, or its tool ids taken: stacks instead
                    clock = None
            recording = self.probe.torch.start_trace(stacks=lines and clock is None,
                                                     max_entries=self.settings.trace_entries)
        except BaseException as e:
            self._stop_recording(recording, clock)
            if not isinstance(e, Exception):
                raise
            self.fault("the allocator trace", e)
            return None, None
        if recording is None and clock is not None:  # no trace (no CUDA yet, trace_entries 0): no lines either
            self._stop_recording(None, clock)
            clock = None
        return recording, clock

    def _stop_recording(self, recording: Trace | None, clock: LineClock | None) -> None:
        self._stop_clock(clock)
        try:
            if recording is not None and recording.owner == "nbmem":
                self.probe.torch.finish_trace(recording, read=False)
        except Exception as e:
            self.fault("the allocator trace", e)

    def _abandon_cell(self) -> None:
        """Forget a cell that will never end here (``%unload_ext nbmem`` inside a monitored cell): a recording
        nbmem started for it is stopped, or it would run on unread, and the next load would take it for the
        user's own and never stop it."""
        o, self._open = self._open, None
        if o is not None:
            self._stop_recording(o.trace, o.clock)

    def _stop_clock(self, clock: LineClock | None) -> list[tuple[int, Any, int]] | None:
        """The clock's marks, or None when there was none (or it failed: recorded, not raised)."""
        if clock is None:
            return None
        try:
            return clock.stop()
        except Exception as e:
            self.fault("the line clock", e)
            return None

    @property
    def in_cell(self) -> bool:
        return self._open is not None

    def end_cell(self, error: BaseException | None = None) -> CellReport | None:
        o, self._open = self._open, None
        if o is None:
            return None
        marks = self._stop_clock(o.clock)
        after = self.probe.boundary()
        err = type(error).__name__ if error is not None else ""
        oom = err == "OutOfMemoryError" or "out of memory" in f"{error}".lower()
        records = cell_records(o.cell, o.before, after, error=err, was_reset=o.reset)
        replays = self._finish_trace(o, after, records, oom, marks)
        records = with_trace(records, replays)
        found: tuple[Finding, ...] = ()
        unattributed: list[tuple[str, int]] = []
        notes: list[str] = []
        line_records: tuple[LineRecord, ...] = ()
        if o.lines:
            line_records = tuple(r for rp in replays.values() for r in rp.lines)
            self._lines[o.cell] = line_records
            if not any(r.device.startswith("cuda") for r in records):
                notes.append("per-line figures need a CUDA device: this cell ran on the CPU only")
            elif not replays:
                why = self.probe.torch.trace_unsupported() or "Nbmem.trace_entries is 0"
                notes.append(f"no per-line figures for this cell: {why}")
            elif o.clock is not None and o.clock.full_at_us is not None:
                notes.append(f"lines were followed for this cell's first {o.clock.max_marks:,} lines of Python "
                             f"(Nbmem.trace_entries): its later allocations count toward its peak, not toward "
                             f"a line")
        changed = False
        if o.scan:
            cur = self._scan_after_cell(o, after)
            self._closed_scan = cur
            prev = o.baseline
            changed = cur is not prev  # the same scan object: nothing could have changed, nothing to redo
            if changed:
                graphs = self.scanner.graphs(holders.graph_candidates(cur, prev), exclude=cur.storages,
                                             budget_s=self.settings.scan_budget_s)
                found = tuple(holders.findings(cur, prev, o.cell, threshold_bytes=self.settings.threshold_bytes,
                                               graphs=graphs))
                found = _with_lines(found, cur, replays)
                self._current_of = None  # everything held now: computed when someone looks
            self._remember(o.cell, found)
            # The CPU has no allocator counters: its "allocated" is the live CPU tensor storages the scan found.
            records = [replace(r, allocated_before_bytes=o.baseline_bytes.get("cpu", 0) if o.baseline_bytes is not None
                               else None,
                               allocated_after_bytes=self._tensor_bytes(cur).get("cpu", 0))
                       if r.device == "cpu" else r for r in records]
            unattributed = self._unattributed(records, cur)
            if cur.truncated:
                notes.append(f"the holder scan stopped at Nbmem.scan_budget ({self.settings.scan_budget_s:g} s) "
                             f"before finishing {', '.join(cur.unfinished[:5])}"
                             f"{' and others' if len(cur.unfinished) > 5 else ''}: findings may be incomplete; "
                             f"nbmem.leaks() scans everything")
        for r in records:
            self.store.add_cell(r)
        text = f"{err}: {error}".lower()
        advice: tuple[str, ...] = ()
        if any(s in text for s in _CUDA_BROKEN):
            self.cuda_broken = True
            advice = (RESTART_ADVICE,)
        elif oom and error is not None:
            advice = self._oom_advice(records, error, o, replays)
        report = CellReport(o.cell, records[0].duration_s, tuple(records), found, tuple(unattributed), err, advice,
                            lines=line_records, notes=tuple(notes))
        self.last_report = report
        self._publish(report)
        if changed and self.subscribers:
            self._publish(Holders(self.findings()))
        return report

    @property
    def _baseline_fresh(self) -> bool:
        """Whether the latest scan was a measured cell's closing scan, with monitoring still on."""
        return self._closed_scan is not None and self._closed_scan is self._last_scan and self.monitoring

    def _scan_after_cell(self, o: _Open, after: Boundary) -> Scan:
        """The cell's closing scan: changed roots first; everything else only if memory moved unexplained."""
        mark = self._mark(after.allocator)
        if not self._changed_since_scan(mark) and self._last_scan is not None:
            return self._last_scan
        budget = self.settings.scan_budget_s
        t0 = time.perf_counter()
        cur = self._rescan(cell=o.cell, walk="changed", mentioned=o.mentioned, budget_s=budget, validate=False,
                           mark=mark)
        prev = o.baseline
        # Then, only while memory grew more than what was found: cached roots whose tensors changed
        # (a gradient, a swapped storage), and at last every other root.
        for walk in ("invalid", "rest"):
            left = budget - (time.perf_counter() - t0)
            if left <= 0 or cur.truncated or not self._unexplained(o, after, prev, cur):
                break
            cur = self._rescan(cell=o.cell, walk=walk, budget_s=left, mark=mark)
        return cur

    def _unexplained(self, o: _Open, after: Boundary, prev: Scan | None, cur: Scan) -> bool:
        """Whether memory grew by at least the threshold more than the storages the scan found.

        CUDA's allocator says exactly what was allocated. The CPU has no such counter: the C heap is a
        proxy that also grows for non-tensor data, so it counts only while young tensors that no walked
        root reaches are alive, or when a collection promoted the cell's objects out of the young
        generations (then they cannot be checked).
        """
        t = self.settings.threshold_bytes
        self.scanner.graphs(holders.graph_candidates(cur, prev), exclude=cur.storages)
        now = self._tensor_bytes(cur)
        then = o.baseline_bytes or {}

        def found(dev: str) -> int:
            return now.get(dev, 0) - then.get(dev, 0)

        for dev, a1 in after.allocator.items():
            a0 = o.before.allocator.get(dev)
            if a1 is not None and a1.allocated_bytes - (a0.allocated_bytes if a0 else 0) - found(dev) >= t:
                return True
        h1 = heap_bytes() if heap_bytes else None
        if h1 is None or o.heap_bytes is None or h1 - o.heap_bytes - found("cpu") < t:
            return False
        if _collections() != o.gen_collections:
            return True
        return self.scanner.young_unlocated(cur).get("cpu", 0) >= t

    def _unattributed(self, records: Sequence[CellRecord], cur: Scan) -> list[tuple[str, int]]:
        """Allocated bytes no name reaches (cuBLAS workspaces, C++-held buffers), when this cell made them grow."""
        out = []
        tensors = self._tensor_bytes(cur)
        for r in records:
            if r.device == "cpu" or r.allocated_after_bytes is None:
                continue
            gap = r.allocated_after_bytes - tensors.get(r.device, 0)
            if gap - self._gaps.get(r.device, 0) >= self.settings.threshold_bytes:
                out.append((r.device, gap))
            self._gaps[r.device] = gap
        return out

    def _finish_trace(self, o: _Open, after: Boundary, records: Sequence[CellRecord],
                      oom: bool, marks: list[tuple[int, Any, int]] | None = None) -> dict[str, Replay]:
        """Read the cell's allocator events when something needs them, and stop a recording nbmem started.

        Needed for a peak the allocator's counter could not give, for --lines, and after an OOM.
        """
        tr = o.trace
        if tr is None:
            return {}
        need = o.lines or oom or any(r.device.startswith("cuda") and r.peak_allocated_bytes is None
                                     for r in records)
        try:
            traces = self.probe.torch.finish_trace(tr, read=need)
        except Exception as e:
            self.fault("the allocator trace", e)
            return {}
        out: dict[str, Replay] = {}
        files = self.adapter.cell_files(o.cell)
        names = self.adapter.cell_names()
        sources = dict(enumerate(o.source.splitlines(), start=1))
        until_us = o.clock.full_at_us if o.clock is not None else None
        for i, entries in enumerate(traces or ()):
            dev = f"cuda:{i}"
            a0, a1 = o.before.allocator.get(dev), after.allocator.get(dev)
            if a1 is None or not entries:
                continue
            if marks is not None:
                with_marked_frames(entries, marks, until_us)
            rp = replay(entries, device=dev, cell=o.cell, start_allocated=a0.allocated_bytes if a0 else 0,
                        end_allocated=a1.allocated_bytes, cell_files=files,
                        since_us=tr.since_us if tr.owner == "user" else None, sources=sources, names=names)
            if tr.owner == "nbmem" and len(entries) >= tr.max_entries:
                rp = replace(rp, exact=False)  # the ring was full: its oldest events are gone
            out[dev] = rp
        return out

    def _oom_advice(self, records: Sequence[CellRecord], error: BaseException, o: _Open,
                    replays: dict[str, Replay]) -> tuple[str, ...]:
        out = []
        line, user = line_of_exception(error, self.adapter.cell_files(o.cell), self.adapter.cell_names())
        where = f"line {line}: {o.source.splitlines()[line - 1].strip()}" if line and line <= len(
            o.source.splitlines()) else "this cell"
        out.append(f"the allocation that failed was asked for by {where}" + (f" (in {user})" if user else ""))
        for dev, rp in replays.items():
            if rp.oom is not None and any(ln is not None for ln, _b in rp.oom.live_by_line):
                live = ", ".join(f"{'before this cell' if ln is None else f'line {ln}'}: {fmt_bytes(b)}"
                                 for ln, b in rp.oom.live_by_line[:4])
                out.append(f"{dev}: live when it failed, by the line that allocated it: {live}")
        if not o.lines:
            out.append("%%cudamem --lines on this cell shows which line allocated what was live")
        for r in records:
            if r.reserved_after_bytes is not None and r.allocated_after_bytes is not None:
                cached = r.reserved_after_bytes - r.allocated_after_bytes
                out.append(f"{r.device}: allocated {fmt_bytes(r.allocated_after_bytes)}, reserved "
                             f"{fmt_bytes(r.reserved_after_bytes)} ({fmt_bytes(cached)} cached but free: "
                             f"fragmentation if large)")
        return (*out, *OOM_ADVICE)

    def shown(self, report: CellReport) -> None:
        """The adapter displayed ``report``; `%cudamem clean --last-report` now means this one."""
        self.last_shown_report = report

    def should_show(self, report: CellReport) -> bool:
        if self.settings.show == "never":
            return False
        if self.settings.show == "always" or report.findings or report.error or report.notes:
            return True
        t = self.settings.threshold_bytes
        return any(abs(r.delta_allocated_bytes or 0) >= t or abs(r.delta_reserved_bytes or 0) >= t
                   or (r.peak_allocated_bytes or 0) - (r.allocated_before_bytes or 0) >= t for r in report.records)

    # -- scanning --------------------------------------------------------------------------------------
    def _roots(self) -> list[holders.Root]:
        return list(self.adapter.roots())

    def _rescan(self, *, cell: int, walk: str, mentioned: frozenset[str] = frozenset(),
                budget_s: float | None = None, validate: bool = True, mark: tuple[Any, ...] | None = None) -> Scan:
        """Scan now and keep the result as the latest scan, together with the state it saw."""
        mark = self._mark() if mark is None else mark
        self._last_scan = self.scanner.update(self._roots(), cell=cell, walk=walk, mentioned=mentioned,
                                              budget_s=budget_s, validate=validate)
        self._scan_mark = mark
        return self._last_scan

    def _mark(self, allocator: Any = None) -> tuple[Any, ...]:
        readings = self.probe.allocator() if allocator is None else allocator
        alloc = tuple(sorted((d, r.allocated_bytes if r else None) for d, r in readings.items()))
        return alloc, heap_bytes() if heap_bytes else None, self.adapter.fingerprint()

    def _changed_since_scan(self, mark: tuple[Any, ...]) -> bool:
        """Whether a new scan could find something new: memory moved (CUDA allocated by any amount,
        exactly; the C heap, where CPU tensors live, by half the threshold), or a name was added,
        deleted or rebound, or an output or exception was kept."""
        if self._last_scan is None or self._scan_mark is None:
            return True
        alloc, heap, fp = mark
        alloc0, heap0, fp0 = self._scan_mark
        if alloc != alloc0 or fp != fp0:
            return True
        return heap is None or heap0 is None or abs(heap - heap0) >= max(1, self.settings.threshold_bytes // 2)

    def take_baseline(self) -> None:
        """Scan everything now: the state the next monitored cell is compared with."""
        self._rescan(cell=0, walk="all")
        self._refresh_current()

    def _current_findings(self, cur: Scan) -> tuple[Finding, ...]:
        graphs = self.scanner.graphs([s for s, h in cur.storages.items() if h.holds_graph], exclude=cur.storages,
                                     budget_s=self.settings.scan_budget_s)
        return tuple(holders.current(cur, threshold_bytes=self.settings.threshold_bytes, graphs=graphs,
                                     cache=self._finding_cache))

    def _refresh_current(self) -> None:
        self._current_of = None
        if self._last_scan is not None and self.subscribers:
            self._publish(Holders(self.findings()))

    def _tensor_bytes(self, scan: Scan) -> dict[str, int]:
        """Bytes per device of the storages a scan found, and of the walked graphs they keep.

        Kept for the last two scans. A scan's graphs are read from the live tensors, so a scan whose
        storages have since died reads smaller: a cell keeps its baseline's figure from when it opened.
        """
        for s, totals in self._totals_cache:
            if s is scan:
                return totals
        out = dict(scan.totals)
        for dev, n in self.scanner.graph_totals(scan.storages).items():
            out[dev] = out.get(dev, 0) + n
        self._totals_cache = [*self._totals_cache[-1:], (scan, out)]
        return out

    def _remember(self, cell: int, found: tuple[Finding, ...]) -> None:
        self._findings[cell] = found
        self._finding_cells.append(cell)
        while len(self._finding_cells) > CELLS_KEPT:
            old = self._finding_cells.popleft()
            self._findings.pop(old, None)
            self._lines.pop(old, None)

    def line_list(self, cell: int | None = None) -> tuple[int, tuple[LineRecord, ...]]:
        """A cell's per-line records: cell N, or (None) the last cell measured with lines."""
        if cell is None:
            if not self._lines:
                raise LookupError("no cell was measured with lines yet: put `%%cudamem --lines` on a cell, or "
                                  "`%config Nbmem.lines = True` with `%cudamem on`")
            cell = max(self._lines)
        if cell not in self._lines:
            raise LookupError(f"cell {cell} was not measured with lines (with lines: "
                              f"{_spans(sorted(self._lines)) or 'none'})")
        return cell, self._lines[cell]

    def lines(self, cell: int | None = None) -> Any:
        from .records import LINE_COLUMNS

        return records_frame(self.line_list(cell)[1], columns=LINE_COLUMNS)

    def lines_table(self, cell: int | None = None) -> Lines:
        n, recs = self.line_list(cell)
        peaks = {r.device: r.peak_line for r in self.store.cell_list() if r.cell == n}
        return Lines(n, recs, peaks)

    def measured_cells(self) -> list[int]:
        return sorted({r.cell for r in self.store.cell_list()})

    def leak_list(self, cell: int | None = None) -> list[Finding]:
        """What cell N added, or (None) everything held now after a full scan."""
        if cell is not None:
            if cell not in self._findings and cell not in self.measured_cells():
                measured = self.measured_cells()
                span = f"measured cells: {_spans(measured)}" if measured else "no cell has been measured yet"
                raise LookupError(f"cell {cell} was not measured ({span}); `%cudamem on` measures every cell")
            return list(self._findings.get(cell, ()))
        self._rescan(cell=0, walk="all")
        self._refresh_current()
        return list(self.findings())

    def leaks(self, cell: int | None = None) -> Any:
        return records_frame(self.leak_list(cell), columns=FINDING_COLUMNS)

    def leaks_table(self, cell: int | None = None) -> Leaks:
        found = tuple(self.leak_list(cell))
        title = f"holders of memory cell [{cell}] added" if cell is not None else "holders of memory now"
        return Leaks(found, title)

    def findings(self) -> tuple[Finding, ...]:
        """The holders above the threshold as of the latest scan (what the gauge lists)."""
        cur = self._last_scan
        if cur is None:
            return ()
        if self._current_of is not cur:
            self._current = self._current_findings(cur)
            self._current_of = cur
        return self._current

    def tensor_totals(self) -> dict[str, int] | None:
        """Bytes of live tensor storages per device, as the latest scan found them; None before a scan."""
        return None if self._last_scan is None else dict(self._tensor_bytes(self._last_scan))

    # -- cleanup: the one door ------------------------------------------------------------------------
    def _measure(self) -> dict[str, tuple[int | None, int | None]]:
        out: dict[str, tuple[int | None, int | None]] = {}
        t = self.probe.torch
        for i in range(t.device_count()):
            r = t.read(i)
            if r is not None:
                out[f"cuda:{i}"] = (r.allocated_bytes, r.reserved_bytes)
        # On the CPU, what tensors hold: an incremental scan (deleted names are the only change) is cheap.
        self._rescan(cell=0, walk="changed", validate=True)
        totals = self.tensor_totals() or {}
        out["cpu"] = (totals.get("cpu", 0), None)
        return out

    def _empty_cache(self) -> bool:
        if not self.probe.torch.cuda_initialized() or self.cuda_broken:
            return False
        torch = self.probe.torch.torch()
        assert torch is not None
        torch.cuda.empty_cache()
        return True

    def cleanup(self, request: CleanupRequest) -> CleanupReport:
        """Check the whole request (CleanupRefused, nothing removed), then run it and report each step."""
        request.check(self.adapter)
        if self.cuda_broken:
            self.notify(RESTART_ADVICE)
        held_by: dict[str, set[int]] = {}
        if request.names and self._last_scan is not None:
            for sid, h in self._last_scan.storages.items():
                for name in h.roots & set(request.names):
                    held_by.setdefault(name, set()).add(sid)
        rep = Cleaner(self.adapter, self._measure, self._empty_cache).run(request)
        self._rescan(cell=0, walk="changed")
        cur = self._last_scan
        still: list[tuple[str, tuple[str, ...]]] = []
        if cur is not None:
            for name, sids in held_by.items():
                others = sorted({p for s in sids if s in cur.storages for p in cur.storages[s].holders})
                if others:
                    still.append((name, tuple(others[:4])))
        rep = replace(rep, still_held=tuple(still))
        self._refresh_current()
        self._publish(rep)
        return rep

    # -- frames ------------------------------------------------------------------------------------------
    def samples(self) -> Any:
        return self.store.samples_frame()

    def report(self) -> Any:
        return records_frame(self.store.cell_list(), columns=CELL_COLUMNS, index="cell")

    def recent_samples(self, seconds: float) -> list[Sample]:
        return self.store.last_samples(seconds, time.time())

    def cell_list(self) -> list[CellRecord]:
        return self.store.cell_list()


def _with_lines(found: tuple[Finding, ...], cur: Scan, replays: dict[str, Replay]) -> tuple[Finding, ...]:
    """Each holder on a GPU with the cell line that allocated its storage, where the trace had stacks."""
    if not replays:
        return found
    by_id = {f"{h.device}:{h.sid}": h for h in cur.storages.values()}
    out = []
    for f in found:
        h, rp = by_id.get(f.id), replays.get(f.device)
        line = rp.alloc_line.get(h.addr) if h is not None and rp is not None else None
        out.append(replace(f, line=line) if line is not None else f)
    return tuple(out)


def _collections() -> int:
    """Collections of the older generations so far: when they ran, new objects left the young ones."""
    stats = gc.get_stats()
    return sum(s.get("collections", 0) for s in stats[1:])


def _spans(cells: list[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1–3, 7`` (the first and last few runs when there are many)."""
    runs: list[list[int]] = []
    for c in cells:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    text = [f"{a}–{b}" if b > a else str(a) for a, b in runs]
    return ", ".join(text if len(text) <= 6 else [*text[:3], "…", *text[-2:]])
