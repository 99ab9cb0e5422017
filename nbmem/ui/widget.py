"""The live gauge: an anywidget fed by one throttled publisher, and where it is shown.

Presentation only. The gauge subscribes to the engine (``Session.subscribe``) and reads it through
its public methods; a single publisher thread turns what arrives into compact columns of raw bytes (the
JS formats them) and writes every data trait, at most ``MAX_UPDATES_PER_S`` times a second, one
``hold_sync`` batch per update. The front end writes no trait. Its messages, each typed, come through
one handler: a cleanup request, which becomes a ``CleanupRequest`` for a finding the session lists at that
moment, through the same door as ``nbmem.cleanup``; "rescan", which walks the notebook for the holder list;
and "placed", a JupyterLab page saying it has shown an automatically placed gauge in its own right sidebar.
The page does that itself, without waiting for the kernel (js/gauge.js ``initialize``): a message to the
kernel waits behind every queued cell, and the sidebar is most wanted while a long one runs.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

try:
    import anywidget
except ImportError as e:  # the magics turn this into "the gauge cannot be shown here (...)"
    raise ImportError(f"nbmem's gauge needs anywidget: pip install anywidget ({e})") from e
import traitlets

from nbmem.clean.request import CleanupRefused, CleanupRequest
from nbmem.records import HOLDER_KINDS, CellRecord, Finding, HolderKind, Holders, Sample, Tick, kind_words
from nbmem.reports import CellReport, CleanupReport, memory_name, near_limit
from nbmem.ui.frontend import GAUGE_COLUMNS, NO_FRONT_END, ROW_COLUMNS, SAMPLED_COLUMNS, bundle, in_kernel, scan_bytes

if TYPE_CHECKING:
    from nbmem.session import Session

log = logging.getLogger(__name__)

MAX_UPDATES_PER_S = 4.0
WINDOW_S = 300.0  # the sparkline's "last minutes"
BUCKETS = 150  # sparkline points: about two pixels each in the sidebar
HISTORY_EVERY_S = 1.0  # the sparkline moves a bucket every 2 s; rebuilding it faster only costs bytes
TOP_HOLDERS = 8
THREAD_NAME = "nbmem-gauge"
ACTIONS = ("del", "to_cpu", "outputs", "traceback", "gc")
_REFUSED_KEPT = 100

# -- what the publisher sends: pure functions of the engine's records --------------------------------
def snapshot_columns(batch: Sequence[Sample], *, models: Mapping[str, str], peaks: Mapping[str, int],
                     cpu_tensors_bytes: int | None, paged_bytes: Mapping[str, int] | None = None) -> dict[str, Any]:
    """One column per quantity, one entry per device (``cpu`` first); None where unknown (``scan_bytes``)."""
    cols: dict[str, Any] = {k: [] for k in GAUGE_COLUMNS}
    cols["t"] = batch[0].t_wall if batch else time.time()
    for s in batch:
        cpu = s.device == "cpu"
        cols["device"].append(s.device)
        cols["model"].append(memory_name(s.memory_limit) if cpu else models.get(s.device, ""))
        source = ROW_COLUMNS["cpu" if cpu else "gpu"]
        for c in SAMPLED_COLUMNS:
            cols[c].append(getattr(s, source[c]) if c in source else None)
        cols["tensors"].append(cpu_tensors_bytes if cpu else None)
        cols["paged"].append(None if cpu or paged_bytes is None else _on_gpu(paged_bytes.get(s.device, 0), s))
        cols["peak"].append(peaks.get(s.device))
        lim = s.memory_limit if cpu and s.memory_limit is not None and s.memory_limit.applies else None
        cols["limit"].append(lim.source if lim else None)  # cpu: `total` is this container limit, not host RAM
        cols["near_limit"].append(near_limit(lim, s.rss_bytes) if lim else None)  # cpu: >= 90 % of it: warn
    return cols


def _on_gpu(paged: int, s: Sample) -> int:
    """The scan's paged bytes, at most what NVML counts here beyond reserved (managed memory may be on the host)."""
    used, reserved = s.process_used_bytes, s.reserved_bytes
    return paged if used is None or reserved is None else min(paged, max(0, used - reserved))


def _main_value(s: Sample) -> int | None:
    return s.rss_bytes if s.device == "cpu" else s.allocated_bytes


def history_columns(samples: Iterable[Sample], now: float, *, window_s: float = WINDOW_S,
                    buckets: int = BUCKETS) -> dict[str, Any]:
    """The sparkline's data: per time bucket the largest value (so short spikes survive).

    ``main`` is RSS (cpu) or torch allocated (cuda), ``aux`` torch reserved. Times are seconds
    relative to ``t0`` (= now); buckets sit on fixed multiples of the bucket width, so a rebuild a
    moment later gives the same points instead of jittering.
    """
    width = window_s / buckets
    start = now - window_s
    slots: dict[int, float] = {}
    main: dict[str, dict[int, int | None]] = {}
    aux: dict[str, dict[int, int | None]] = {}
    for s in samples:
        if s.t_wall < start or s.t_wall > now:
            continue
        b = int(s.t_wall // width)
        slots[b] = max(slots.get(b, s.t_wall), s.t_wall)
        for series, v in ((main, _main_value(s)), (aux, None if s.device == "cpu" else s.reserved_bytes)):
            col = series.setdefault(s.device, {})
            old = col.get(b)
            col[b] = v if old is None else old if v is None else max(old, v)
    order = sorted(slots)
    return {
        "t0": now,
        "window": window_s,
        "t": [round(slots[b] - now, 2) for b in order],
        "main": {d: [col.get(b) for b in order] for d, col in main.items()},
        "aux": {d: [col.get(b) for b in order] for d, col in aux.items() if d != "cpu"},
    }


def cell_spans(records: Iterable[CellRecord], now: float, *, window_s: float = WINDOW_S) -> list[dict[str, Any]]:
    """Monitored cells that end inside the window, once each (a cell has one record per device)."""
    out: dict[int, dict[str, Any]] = {}
    for r in records:
        end = r.started + r.duration_s
        if end >= now - window_s:
            out.setdefault(r.cell, {"cell": r.cell, "start": r.started, "end": end})
    return sorted(out.values(), key=lambda c: c["start"])


def last_cell_row(report: CellReport) -> dict[str, Any]:
    """The last monitored cell: Δ and peak per device.

    On a GPU, Δ torch allocated and the allocator's peak. On the CPU, Δ of the CPU tensors the scan
    found (what the engine records as the CPU's "allocated"), or Δ RSS when the cell was not scanned,
    and the RSS peak when the cell raised it.
    """
    rows = []
    for r in report.records:
        if r.device != "cpu":
            rows.append({"device": r.device, "what": "allocated", "delta": r.delta_allocated_bytes,
                         "peak": r.peak_allocated_bytes, "peak_note": r.peak_note,
                         "peak_line": _line_text(report, r.peak_line)})
            continue
        tensors = r.delta_allocated_bytes is not None
        rows.append({"device": "cpu", "what": "CPU tensors" if tensors else "RSS",
                     "delta": r.delta_allocated_bytes if tensors else r.delta_rss_bytes,
                     "peak": r.peak_rss_bytes, "peak_note": "≤ session peak RSS"})
    return {"cell": report.cell, "duration_s": report.duration_s, "error": report.error, "rows": rows}


def _line_text(report: CellReport, line: int | None) -> str:
    """"line 3: loss = model(x)" where the trace knew the peak's line."""
    if line is None:
        return ""
    src = next((r.source.strip() for r in report.lines if r.line == line), "")
    return f"line {line}: {src}" if src else f"line {line}"


def can_move_to_cpu(f: Finding) -> bool:
    """"to CPU" rebinds a top-level name to ``obj.cpu()``: only for a variable, the owner row's own name."""
    return f.device.startswith("cuda") and f.kind is HolderKind.NAMESPACE and f.name in f.roots


def request_for(f: Finding, action: str) -> CleanupRequest | None:
    """What a holder's button does, exactly: the same request ``nbmem.cleanup`` would make. *del* deletes
    the names that free the row (the owner first, then the aliases and the tensors whose graphs saved it, as
    its hint says), never the notebook's state (intent.py: a model, an optimizer...), which only a name typed
    into ``%cudamem clean`` deletes."""
    if action == "del":
        ok = f.kind is HolderKind.NAMESPACE and f.name in f.roots and not f.state
        return CleanupRequest(names=f.roots, outputs="outputs" in f.also_clears,
                              traceback="traceback" in f.also_clears) if ok else None
    if action == "to_cpu":
        return CleanupRequest(to_cpu=(f.name,)) if can_move_to_cpu(f) else None
    return None


def no_del(f: Finding) -> str:
    """Why a holder has no *del* button, and what frees it instead (the gauge shows it as the button's tooltip)."""
    if f.state:
        return f"the notebook's state ({f.state}): delete it by name, %cudamem clean {' '.join(f.roots) or f.name}"
    return kind_words(f.kind, "no_del", f.name)


def holder_rows(findings: Sequence[Finding], limit: int = TOP_HOLDERS) -> list[dict[str, Any]]:
    """The biggest owners of the last scan, with their members and what their buttons do, in the buttons'
    own words."""
    top = sorted(findings, key=lambda f: -f.bytes)[:limit]
    rows = []
    for f in top:
        d = request_for(f, "del")
        rows.append({"id": f.id, "name": f.name, "kind": f.kind.value, "kind_label": HOLDER_KINDS[f.kind].label,
                     "no_del": "" if d is not None else no_del(f), "device": f.device, "bytes": f.bytes,
                     "what": f.what(), "graph": f.holds_graph, "roots": list(f.roots), "to_cpu": can_move_to_cpu(f),
                     "state": f.state, "del_label": d.describe() if d is not None else "",
                     "hint": f.hint,
                     "members": [{"name": m.name, "bytes": m.bytes, "what": m.what()} for m in f.members],
                     "more": f.more, "more_bytes": f.more_bytes, "also": list(f.also_held_by)})
    return rows


def freed(report: CleanupReport) -> tuple[int | None, int | None]:
    """(allocated, reserved) bytes a cleanup gave back, NA where no step could measure it."""
    return report.freed_allocated_bytes, report.freed_reserved_bytes


# -- the publisher ---------------------------------------------------------------------------------
class Publisher:
    """The gauge's only writer: a thread that pushes what changed, at most ``rate_hz`` times a second.

    ``put`` hands over trait values computed elsewhere (the main thread: cell reports, clicks);
    ``poke`` says new samples arrived, and ``build`` turns them into traits at flush time, so the
    sampler thread never waits on the widget. Every flush is one ``hold_sync`` batch.
    """

    def __init__(self, widget: Any, build: Callable[[], dict[str, Any]], *, rate_hz: float = MAX_UPDATES_PER_S,
                 clock: Callable[[], float] = time.monotonic,
                 on_error: Callable[[BaseException], None] = lambda e: None) -> None:
        self._widget = widget
        self._build = build
        self.min_interval_s = 1.0 / rate_hz
        self._clock = clock
        self._on_error = on_error
        self._lock = threading.Lock()
        self._pending: dict[str, Any] = {}
        self._stale = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last = float("-inf")
        self.flushes = 0

    def put(self, **traits: Any) -> None:
        with self._lock:
            self._pending.update(traits)
        self._wake.set()

    def poke(self) -> None:
        with self._lock:
            self._stale = True
        self._wake.set()

    def flush(self) -> None:
        """Write everything pending now, as one batch."""
        with self._lock:
            traits, self._pending = self._pending, {}
            stale, self._stale = self._stale, False
        if stale:
            traits = {**self._build(), **traits}
        if not traits:
            return
        with self._widget.hold_sync():
            for name, value in traits.items():
                setattr(self._widget, name, value)
        self.flushes += 1

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            atexit.register(self._stop_at_exit)  # as the sampler's: not inside a C++ call when the interpreter ends
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()

    def _stop_at_exit(self) -> None:
        self.stop(timeout_s=2.0)

    def stop(self, timeout_s: float = 5.0) -> None:
        atexit.unregister(self._stop_at_exit)
        self._stop.set()
        self._wake.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            if self._stop.is_set():
                return
            delay = self._last + self.min_interval_s - self._clock()
            if delay > 0 and self._stop.wait(delay):
                return
            self._wake.clear()  # before the flush: whatever arrives during it wakes the next round
            try:
                self.flush()
            except Exception as e:
                self._on_error(e)
            self._last = self._clock()


# -- the widget ------------------------------------------------------------------------------------
class Gauge(anywidget.AnyWidget):
    """Live memory per device, the last cell, the top holders and cleanup buttons."""

    _esm = bundle()

    # Written by Python only (the publisher thread); the front end never sets a trait.
    snapshot: traitlets.Dict[str, Any] = traitlets.Dict().tag(sync=True)
    history: traitlets.Dict[str, Any] = traitlets.Dict().tag(sync=True)
    cells: traitlets.List[dict[str, Any]] = traitlets.List().tag(sync=True)
    processes: traitlets.Dict[str, Any] = traitlets.Dict().tag(sync=True)
    children: traitlets.Dict[str, Any] = traitlets.Dict().tag(sync=True)  # this notebook's child processes
    last_cell: traitlets.Dict[str, Any] = traitlets.Dict().tag(sync=True)
    holders: traitlets.List[dict[str, Any]] = traitlets.List().tag(sync=True)
    holders_note = traitlets.Unicode("").tag(sync=True)  # shown in place of an empty list: why it is empty
    action: traitlets.Dict[str, Any] = traitlets.Dict().tag(sync=True)
    holders_at = traitlets.Float(None, allow_none=True).tag(sync=True)  # when the holder scan ran (epoch s)
    note = traitlets.Unicode("").tag(sync=True)
    # "auto": a JupyterLab page shows it in its own right sidebar, other front ends under the cell
    # (js/layout.js pageSidebar); "sidebar": in the kernel's sidecar panel; "inline": under the cell.
    placement = traitlets.Unicode("inline").tag(sync=True)
    # The model's own id, so the page can show this model in a panel it makes (anywidget hides the id).
    gauge_id = traitlets.Unicode("").tag(sync=True)

    def __init__(self, session: Session, *, start: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("model_id", uuid.uuid4().hex)
        super().__init__(gauge_id=kwargs["model_id"], **kwargs)
        self.session = session
        self.refused: list[str] = []  # front-end requests turned down, newest last
        self.sidecar: Any = None
        self.in_page_sidebar = False  # a JupyterLab page said it shows this gauge in its right sidebar
        self._latest: Sequence[Sample] = ()
        self._tensors: int | None = None
        self._paged: dict[str, int] | None = None  # by GPU, as of the last scan
        self._peaks: dict[str, int] = {}
        self._peaks_lock = threading.Lock()
        self._history_at = float("-inf")
        self._publisher = Publisher(self, self._build, on_error=lambda e: session.fault("gauge", e))
        self.between_cells: Any = None  # the adapter's BetweenCells: where a click waits for the running cell
        self._unsubscribe: Callable[[], None] | None = None
        self._closed = False
        try:
            self._seed()
            self.on_msg(self._on_msg)
            self._unsubscribe = session.subscribe(self._on_event)
            if start:
                self._publisher.start()
        except BaseException:
            self.close()  # a half-made gauge must not stay subscribed or keep its comm open
            raise

    def __repr__(self) -> str:
        # What a front end that draws no widgets shows (text/plain, cut at 110 characters): one useful line.
        return ("nbmem gauge: this front end does not draw widgets; `%cudamem status`, `report`, `leaks` give the "
                "numbers")

    def _seed(self) -> None:
        """Fill the gauge from what the session already has, so it opens with numbers."""
        s = self.session
        samples = s.recent_samples(WINDOW_S)
        for sample in samples:
            self._raise_peak(sample.device, _main_value(sample))
        records = s.cell_list()
        for r in records:
            self._raise_peak_from(r)
        latest_t = samples[-1].t_wall if samples else None
        self._latest = [x for x in samples if x.t_wall == latest_t]
        self._read_scan()
        self._publisher.put(holders=holder_rows(s.findings()), holders_note=s.holders_note(),
                            holders_at=s.holders_scanned_at(), cells=cell_spans(records, time.time()),
                            last_cell=last_cell_row(s.last_report) if s.last_report else {})
        if self._latest:
            self._publisher.poke()
        self._publisher.flush()

    # -- what the engine sends (its threads) -------------------------------------------------------
    def _on_event(self, event: Any) -> None:
        if isinstance(event, Tick):  # the sampler thread: keep the newest batch; the publisher builds from it
            self._latest = event.samples
            self._publisher.poke()
        elif isinstance(event, CellReport):
            for r in event.records:
                self._raise_peak_from(r)
            self._read_scan()
            self._publisher.put(last_cell=last_cell_row(event),
                                cells=cell_spans(self.session.cell_list(), time.time()))
            self._publisher.poke()
        elif isinstance(event, Holders):
            self._read_scan()
            self._publisher.put(holders=holder_rows(event.findings), holders_note=self.session.holders_note(),
                                holders_at=self.session.holders_scanned_at())
            self._publisher.poke()

    def _read_scan(self) -> None:
        self._tensors, self._paged = scan_bytes(self.session.tensor_totals())

    def _raise_peak(self, device: str, value: int | None) -> None:
        if value is not None:
            with self._peaks_lock:
                if value > self._peaks.get(device, -1):
                    self._peaks[device] = value

    def _raise_peak_from(self, r: CellRecord) -> None:
        self._raise_peak(r.device, r.peak_rss_bytes if r.device == "cpu" else r.peak_allocated_bytes)

    # -- building (publisher thread) ------------------------------------------------------------------
    def _build(self) -> dict[str, Any]:
        batch = list(self._latest)
        if not batch:
            return {}
        for x in batch:
            self._raise_peak(x.device, _main_value(x))
            self._raise_peak(x.device, x.peak_bytes)  # read by the sampler with the rest of the sample
        with self._peaks_lock:
            peaks = dict(self._peaks)
        models = {d.name: d.model for d in self.session.devices()}
        now = batch[0].t_wall
        procs = {x.device: [{"pid": p.pid, "name": p.name, "bytes": p.used_bytes} for p in x.processes]
                 for x in batch if x.device != "cpu"}
        kids = {x.device: [{"pid": p.pid, "name": p.name, "command": p.command, "bytes": p.used_bytes}
                           for p in x.children] for x in batch if x.device != "cpu"}
        out: dict[str, Any] = {
            "snapshot": snapshot_columns(batch, models=models, peaks=peaks, cpu_tensors_bytes=self._tensors,
                                         paged_bytes=self._paged),
            "processes": procs,
            "children": kids,
            "note": " · ".join(self.session.notes()),
            # Read each time (cheap): "torch is not imported yet" ends with the import, not with the next scan.
            "holders_note": self.session.holders_note(),
            "holders_at": self.session.holders_scanned_at(),
        }
        if time.monotonic() - self._history_at >= HISTORY_EVERY_S:
            self._history_at = time.monotonic()
            out["history"] = history_columns(self.session.recent_samples(WINDOW_S), now)
        return out

    # -- clicks (main thread, between cells) ------------------------------------------------------------
    def _on_msg(self, _widget: Any, content: Any, _buffers: Any) -> None:
        """Every message from the front end, by its type; anything else is refused."""
        handlers = {"cleanup": self._request, "rescan": self._rescan, "placed": self._placed}
        kind = content.get("type") if isinstance(content, dict) else None
        try:
            handle = handlers.get(kind) if isinstance(kind, str) else None
            if handle is None:
                self._refuse("", "not a request the gauge sends", content)
            elif kind != "placed" and self._not_now(content, lambda: self._on_msg(_widget, content, _buffers)):
                return  # it runs between cells
            else:
                handle(content)
        except Exception as e:
            self.session.fault("gauge click", e)

    def _not_now(self, content: dict[str, Any], fn: Callable[[], None]) -> bool:
        """Whether a click must wait: a cleanup or a rescan never runs beside the user's code. JupyterLab may
        deliver it on a subshell thread while a cell runs; ``between_cells`` (the adapter's) then runs it on the
        kernel's main thread between cells. Where nothing can wait for the cell, a click off the main thread is
        refused with a message."""
        b = self.between_cells
        if threading.current_thread() is threading.main_thread() and (b is None or not b.busy):
            return False
        if b is not None and b.later(lambda: None if self._closed else fn()):
            return True
        self._refuse(_req_of(content), "the notebook is running a cell: click again when it ends", content)
        return True

    def _placed(self, content: dict[str, Any]) -> None:
        """A JupyterLab page has shown this gauge in its right sidebar (it makes that panel itself, at once;
        this message waits behind queued cells). Recorded only: placement stays "auto", so a page loaded later
        makes its own panel again, and the kernel makes none."""
        if content.get("where") != "sidebar":
            self._refuse("", f"unknown place {content.get('where')!r:.40}", content)
        elif self.placement == "auto":
            self.in_page_sidebar = True

    def _rescan(self, content: dict[str, Any]) -> None:
        """The holder list's "rescan": every root walked again, and the list follows."""
        req = _req_of(content)
        t0 = time.perf_counter()
        self.session.take_baseline()  # every root walked again, and the subscribers told
        n = len(self.session.findings())
        text = (f"{n} holder{'' if n == 1 else 's'} listed" if n else self.session.holders_note()) + \
            f" ({(time.perf_counter() - t0) * 1000:.0f} ms)"
        self._publisher.put(action={"req": req, "label": "rescan", "ok": True, "text": text})
        self._publisher.poke()

    def to_sidebar(self) -> None:
        """Show the gauge in JupyterLab's right sidebar (a sidecar panel); a view under a cell then points there."""
        try:
            from sidecar import Sidecar
        except ImportError as e:
            raise RuntimeError(f"the sidebar needs the sidecar package (pip install sidecar), or use "
                               f"`%cudamem gauge --inline` ({e})") from e
        self.sidecar = Sidecar(title="nbmem")
        self.sidecar.append_display_data(self)  # its outputs: no cell's output context is needed
        self.placement = "sidebar"

    def _refuse(self, req: str, why: str, content: Any) -> None:
        entry = f"{why}: {content!r:.300}"
        self.refused = [*self.refused[-(_REFUSED_KEPT - 1):], entry]
        log.warning("nbmem gauge refused a front-end request (%s)", entry)
        self._publisher.put(action={"req": req, "label": "request", "ok": False, "error": f"refused: {why}"})

    def _request(self, content: Any) -> None:
        """A cleanup request from the front end; acts only on a finding the session lists now."""
        req = _req_of(content)
        action = content.get("action")
        if action not in ACTIONS:
            self._refuse(req, f"unknown action {action!r:.40}", content)
            return
        if action in ("del", "to_cpu"):
            fid = content.get("id")
            f = next((f for f in self.session.findings() if isinstance(fid, str) and f.id == fid), None)
            if f is None:
                self._refuse(req, "not a holder the gauge lists now (it may have been freed already)", content)
                return
            request = request_for(f, action)
            if request is None:
                self._refuse(req, f"{f.name} cannot be {'deleted by name' if action == 'del' else 'moved'} "
                                  f"from here", content)
                return
        else:
            request = CleanupRequest(outputs=action == "outputs", traceback=action == "traceback")
        label = request.describe()
        try:
            rep = self.session.cleanup(request)
        except CleanupRefused as e:  # the user changed the name since the scan
            result: dict[str, Any] = {"req": req, "label": label, "ok": False, "error": str(e)}
        else:
            a, r = freed(rep)
            result = {"req": req, "label": label, "ok": not rep.errors, "freed": a, "freed_reserved": r}
            if rep.errors:
                result["error"] = "; ".join(rep.errors)
            if rep.still_held:
                result["still"] = "; ".join(x.text() for x in rep.still_held)
        self._publisher.put(action=result)
        self._publisher.poke()

    # -- lifecycle ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Unsubscribe, stop the publisher, close the sidebar panel and the widget."""
        if self._closed:
            return
        self._closed = True
        if self._unsubscribe is not None:
            self._unsubscribe()
        self._publisher.stop()
        if self.sidecar is not None:
            self.sidecar.close()
            self.sidecar = None
        super().close()


def _req_of(content: dict[str, Any]) -> str:
    """A request's id, echoed back so the view that sent it can match the answer ("" when malformed)."""
    req = content.get("req")
    return req if isinstance(req, str) and len(req) <= 64 else ""


# -- where it appears ------------------------------------------------------------------------------
def auto_place(environ: Mapping[str, str] | None = None) -> str:
    """Where "auto" shows the gauge: "inline" where no page will ask for the sidebar (VS Code, Colab), else
    "auto": under the cell until a JupyterLab page asks for the sidebar (Notebook 7 does not ask).

    The kernel cannot tell JupyterLab from Notebook 7, or a browser from VS Code connected to a remote
    server; the page can (js/layout.js ``asksForSidebar``).
    """
    env = os.environ if environ is None else environ
    if "VSCODE_PID" in env or "VSCODE_CWD" in env or "google.colab" in sys.modules:
        return "inline"
    return "auto" if importlib.util.find_spec("sidecar") is not None else "inline"


def warn_old_ipykernel(session: Session) -> None:
    """ipykernel 7.0.x misroutes output sent from background threads (fixed in 7.1, ipykernel#1451)."""
    v = str(getattr(sys.modules.get("ipykernel"), "__version__", ""))
    if re.match(r"7\.0(\.|$)", v):
        session.tell_once("ipykernel-7.0", f"nbmem: ipykernel {v} can lose output sent from background threads, so "
                                           f"the gauge may freeze while a cell runs; `pip install -U ipykernel` "
                                           f"(7.1 or later) fixes it.")


def show_gauge(session: Session, where: str, *, previous: Gauge | None = None, shell: Any = None,
               explicit: bool = False) -> Gauge | None:
    """Show a new gauge ("auto", "sidebar" or "inline") and close ``previous``.

    Outside a Jupyter kernel there is nowhere to draw it: None, or an error when asked for by name.
    """
    if where not in ("auto", "sidebar", "inline"):
        raise ValueError(f"where must be 'auto', 'sidebar' or 'inline', not {where!r}")
    if previous is not None:
        previous.close()
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    if not in_kernel(shell):
        if explicit:
            raise RuntimeError(NO_FRONT_END)
        return None
    warn_old_ipykernel(session)
    from IPython.display import display

    # Placed from the start: a JupyterLab page makes its sidebar panel when the model arrives (js/gauge.js).
    gauge = Gauge(session, placement=auto_place() if where == "auto" else "inline")
    try:
        if where == "sidebar":
            gauge.to_sidebar()
        else:
            display(gauge)
    except BaseException:
        gauge.close()
        raise
    return gauge
