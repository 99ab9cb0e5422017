"""Per-cell analysis: what a cell changed, from the readings taken at its two boundaries."""

from __future__ import annotations

import datetime as _dt
from dataclasses import asdict, dataclass

from .formatting import esc, fmt_bytes, fmt_seconds, html_table, is_na, text_table
from .sources import Boundary

CELL_COLUMNS = ["cell", "started", "duration_s", "device", "allocated_before_bytes", "allocated_after_bytes",
                "delta_allocated_bytes", "reserved_before_bytes", "reserved_after_bytes", "delta_reserved_bytes",
                "peak_allocated_bytes", "peak_note", "process_used_before_bytes", "process_used_after_bytes",
                "delta_process_used_bytes", "rss_before_bytes", "rss_after_bytes", "delta_rss_bytes",
                "peak_rss_bytes", "error"]


@dataclass(frozen=True, slots=True)
class CellRecord:
    """What one monitored cell did on one device. Numbers and names only, never user objects."""

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

    def row(self) -> dict[str, object]:
        d = asdict(self)
        d["started"] = _dt.datetime.fromtimestamp(self.started, _dt.timezone.utc)
        d["delta_allocated_bytes"] = self.delta_allocated_bytes
        d["delta_reserved_bytes"] = self.delta_reserved_bytes
        d["delta_process_used_bytes"] = self.delta_process_used_bytes
        d["delta_rss_bytes"] = self.delta_rss_bytes
        return {c: d[c] for c in CELL_COLUMNS}

    def summary_cells(self) -> list[str]:
        """The row shown under a cell: device, Δallocated, Δreserved, peak, ΔNVML, ΔRSS."""
        peak = fmt_bytes(self.peak_allocated_bytes) if not is_na(self.peak_allocated_bytes) else (
            self.peak_note or "NA")
        return [self.device, fmt_bytes(self.delta_allocated_bytes, signed=True),
                fmt_bytes(self.delta_reserved_bytes, signed=True), peak,
                fmt_bytes(self.delta_process_used_bytes, signed=True), fmt_bytes(self.delta_rss_bytes, signed=True)]


SUMMARY_HEADERS = ["device", "Δallocated", "Δreserved", "peak allocated", "Δ NVML process", "Δ RSS"]


def _delta(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else b - a


def cell_peak(before: Boundary, after: Boundary, device: str, *, was_reset: bool) -> tuple[int | None, str]:
    """The exact peak allocated during the cell, from the allocator's own high-water counter.

    The counter is global (pytorch#16266), and nbmem does not reset it unless asked, so the
    cell's peak is known exactly only when the cell raised it (or it was reset for this cell).
    Otherwise the peak is unknown but bounded by the earlier high-water mark, and we say so.
    """
    a0 = before.allocator.get(device)
    a1 = after.allocator.get(device)
    if a1 is None:
        return None, "CUDA not initialised" if device.startswith("cuda") else ""
    if was_reset or a0 is None:
        return a1.peak_allocated_bytes, ""
    if a1.peak_allocated_bytes > a0.peak_allocated_bytes:
        return a1.peak_allocated_bytes, ""
    if a1.peak_allocated_bytes < a0.peak_allocated_bytes:
        return None, "peak counter was reset inside the cell"
    if a1.peak_allocated_bytes == max(a0.allocated_bytes, a1.allocated_bytes):
        # The cell's peak is at least what it started and ended with, and at most the old high-water
        # mark; when those meet, it is known exactly.
        return a1.peak_allocated_bytes, ""
    return None, f"≤ {fmt_bytes(a0.peak_allocated_bytes)} (below an earlier peak; %%cudamem --reset-peak for exact)"


def _rss_peak(before: Boundary, after: Boundary) -> int | None:
    """Exact RSS peak when the cell raised the process's high-water mark, else unknown."""
    m0, m1 = before.max_rss_bytes, after.max_rss_bytes
    if m0 is None or m1 is None or m1 <= m0:
        return None
    return m1


def cell_records(cell: int, before: Boundary, after: Boundary, *, error: str = "",
                 was_reset: bool = False) -> list[CellRecord]:
    """One record per CUDA device torch has memory on (at either boundary), or a single ``cpu`` record."""
    seen = sorted(set(before.allocator) | set(after.allocator))
    used = [d for d in seen if any(r is not None and (r.reserved_bytes or r.peak_reserved_bytes)
                                   for r in (before.allocator.get(d), after.allocator.get(d)))]
    devices = used or seen[:1] or ["cpu"]
    out = []
    for dev in devices:
        a0, a1 = before.allocator.get(dev), after.allocator.get(dev)
        g0, g1 = before.nvml.get(dev), after.nvml.get(dev)
        if dev.startswith("cuda") and a0 is None and a1 is not None:
            # CUDA came up inside this cell: before it, this process held nothing there.
            alloc0: int | None = 0
            res0: int | None = 0
        else:
            alloc0 = a0.allocated_bytes if a0 else None
            res0 = a0.reserved_bytes if a0 else None
        peak, note = cell_peak(before, after, dev, was_reset=was_reset) if dev != "cpu" else (
            None, "CPU has no allocator peak counter")
        out.append(CellRecord(
            cell=cell, started=before.t_wall, duration_s=after.t_monotonic - before.t_monotonic, device=dev,
            allocated_before_bytes=alloc0, allocated_after_bytes=a1.allocated_bytes if a1 else None,
            reserved_before_bytes=res0, reserved_after_bytes=a1.reserved_bytes if a1 else None,
            peak_allocated_bytes=peak, peak_note=note,
            process_used_before_bytes=g0.process_used_bytes if g0 else None,
            process_used_after_bytes=g1.process_used_bytes if g1 else None,
            rss_before_bytes=before.rss_bytes, rss_after_bytes=after.rss_bytes,
            peak_rss_bytes=_rss_peak(before, after), error=error))
    return out


@dataclass(frozen=True)
class CellReport:
    """What one cell did, shown under it: the cell records, findings and hints. Numbers only."""

    cell: int
    duration_s: float
    records: tuple[CellRecord, ...]
    findings: tuple = ()  # tuple[leaks.Finding, ...]; typed loosely to keep this module below leaks
    unattributed: tuple[tuple[str, int], ...] = ()
    error: str = ""
    advice: tuple[str, ...] = ()

    def _finding_rows(self) -> list[list[str]]:
        return [[f.name, f.kind, f.device, fmt_bytes(f.bytes), "yes" if f.holds_graph else "", f.hint]
                for f in self.findings]

    def __str__(self) -> str:
        head = f"nbmem [{self.cell}] {fmt_seconds(self.duration_s)}" + (f"  error: {self.error}" if self.error else "")
        parts = [head, text_table(SUMMARY_HEADERS, [r.summary_cells() for r in self.records])]
        if self.findings:
            parts += ["holders of memory this cell added:",
                      text_table(["name", "kind", "device", "bytes", "graph", "hint"], self._finding_rows())]
        for dev, b in self.unattributed:
            parts.append(f"unattributed on {dev}: {fmt_bytes(b)} (allocated but not reachable from a name)")
        parts += [f"- {a}" for a in self.advice]
        return "\n".join(parts)

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, p: object, cycle: bool) -> None:
        p.text(str(self))  # type: ignore[attr-defined]

    def _repr_html_(self) -> str:
        title = f"nbmem [{self.cell}] · {fmt_seconds(self.duration_s)}"
        if self.error:
            title += f" · error: {self.error}"
        parts = [f"<div class='nbmem-report'><div style='font-weight:600'>{esc(title)}</div>",
                 html_table(SUMMARY_HEADERS, [r.summary_cells() for r in self.records])]
        if self.findings:
            parts.append(html_table(["name", "kind", "device", "bytes", "graph", "hint"], self._finding_rows(),
                                    caption="holders of memory this cell added"))
        for dev, b in self.unattributed:
            parts.append(f"<div>unattributed on {esc(dev)}: {esc(fmt_bytes(b))}</div>")
        if self.advice:
            parts.append("<ul>" + "".join(f"<li>{esc(a)}</li>" for a in self.advice) + "</ul>")
        parts.append("</div>")
        return "".join(parts)
