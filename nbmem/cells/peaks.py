"""Per-cell analysis: what a cell changed, from the readings taken at its two boundaries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from nbmem.formatting import fmt_bytes
from nbmem.records import Boundary, CellRecord
from nbmem.trace.linetrace import Replay


def cell_peak(before: Boundary, after: Boundary, device: str, *, was_reset: bool) -> tuple[int | None, str]:
    """The exact peak allocated during the cell, from the allocator's own counters, never reset by nbmem.

    The peak is at least what the cell started and ended with. It is at most the global high-water
    mark (pytorch#16266: one counter for everyone), and at most what it started with plus every byte
    the cell allocated (the cumulative counter). When the bounds meet, or the cell raised the
    high-water mark, the peak is exact; otherwise it is NA with the tighter bound, and the
    allocator's event trace (``%%cudamem``, ``Nbmem.trace``) gives it exactly.
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
    low = max(a0.allocated_bytes, a1.allocated_bytes)
    high = min(a1.peak_allocated_bytes, a0.allocated_bytes + a1.allocated_total_bytes - a0.allocated_total_bytes)
    if high <= low:
        return low, ""
    return None, f"≤ {fmt_bytes(high)} (the cell freed some of what it allocated; %%cudamem gives the exact peak)"


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


def with_trace(records: Sequence[CellRecord], replays: Mapping[str, Replay]) -> list[CellRecord]:
    """Peaks from the allocator's trace where its counter could not tell, and the line of each peak.

    The counter's peak, when known, is exact by definition and stays; the trace's is used when the
    replay ended exactly where the allocator did, and otherwise shown as "≈" with the difference.
    """
    out = []
    for r in records:
        rp = replays.get(r.device)
        if rp is None:
            out.append(r)
            continue
        if r.peak_allocated_bytes is not None:
            out.append(replace(r, peak_line=rp.peak_line))
        elif rp.exact:
            out.append(replace(r, peak_allocated_bytes=rp.peak_bytes, peak_note="", peak_line=rp.peak_line))
        else:
            out.append(replace(r, peak_note=f"≈ {fmt_bytes(rp.peak_bytes)} {rp.note()[2:]}", peak_line=rp.peak_line))
    return out
