"""One cell's allocator recording: the event trace (exact peaks) and, for ``--lines``, which line ran when.

Where per-cell peaks come from: the allocator's cumulative counters first (``cells.peaks.cell_peak``), and
when they cannot pin the peak, this recording, replayed (``linetrace.replay``). A recording the user
started themselves is only read. Whatever fails, nothing nbmem started is left running, and failures
are recorded through ``fault`` (never raised into the user's cell).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nbmem.measure.sources import TorchSource, Trace
from nbmem.records import Boundary, CellRecord
from nbmem.trace.lineclock import LineClock
from nbmem.trace.linetrace import Replay, replay, with_marked_frames

Fault = Callable[[str, BaseException], None]
Marks = list[tuple[int, Any, int]]


@dataclass
class Recording:
    """The allocator's trace for one cell and, for --lines, the clock that places its events on lines."""

    torch: TorchSource
    fault: Fault
    trace: Trace | None = None
    clock: LineClock | None = None
    full_at_us: int | None = None  # when the clock stopped marking lines (its max_marks reached)
    max_marks: int = 0

    @classmethod
    def start(cls, torch: TorchSource, fault: Fault, *, lines: bool, max_entries: int) -> Recording:
        """Start recording; lines come from timestamps where this Python can take them (sys.monitoring),
        else from a Python stack recorded with every allocator event, which costs a launch-bound loop more."""
        rec = cls(torch, fault)
        try:
            if lines:
                rec.clock = LineClock(max_marks=max_entries)
                if not rec.clock.start():  # an older Python, or its tool ids taken: stacks instead
                    rec.clock = None
            rec.trace = torch.start_trace(stacks=lines and rec.clock is None, max_entries=max_entries)
        except BaseException as e:
            rec.stop()
            if not isinstance(e, Exception):
                raise
            fault("the allocator trace", e)
            return cls(torch, fault)
        if rec.trace is None and rec.clock is not None:  # no trace (no CUDA yet, trace_entries 0): no lines
            rec.stop_clock()
        return rec

    def stop_clock(self) -> Marks | None:
        """The clock's marks, or None when there was none (or it failed: recorded, not raised)."""
        clock, self.clock = self.clock, None
        if clock is None:
            return None
        self.max_marks = clock.max_marks
        try:
            return clock.stop()
        except Exception as e:
            self.fault("the line clock", e)
            return None
        finally:
            self.full_at_us = clock.full_at_us

    def stop(self) -> None:
        """Stop without reading (a cell that will never end here, a failed start)."""
        self.stop_clock()
        trace, self.trace = self.trace, None
        try:
            if trace is not None and trace.owner == "nbmem":
                self.torch.finish_trace(trace, read=False)
        except Exception as e:
            self.fault("the allocator trace", e)

    def replays(self, *, cell: int, before: Boundary, after: Boundary, records: Sequence[CellRecord], need: bool,
                marks: Marks | None, source: str, cell_files: frozenset[str],
                names: Mapping[str, str]) -> dict[str, Replay]:
        """Each device's events replayed, when something needs them (a peak the counters could not give,
        --lines, an OOM); a recording nbmem started is stopped either way."""
        tr, self.trace = self.trace, None
        if tr is None:
            return {}
        need = need or any(r.device.startswith("cuda") and r.peak_allocated_bytes is None for r in records)
        try:
            traces = self.torch.finish_trace(tr, read=need)
        except Exception as e:
            self.fault("the allocator trace", e)
            return {}
        out: dict[str, Replay] = {}
        sources = dict(enumerate(source.splitlines(), start=1))
        for i, entries in enumerate(traces or ()):
            dev = f"cuda:{i}"
            a0, a1 = before.allocator.get(dev), after.allocator.get(dev)
            if a1 is None or not entries:
                continue
            if marks is not None:
                with_marked_frames(entries, marks, self.full_at_us)
            rp = replay(entries, device=dev, cell=cell, start_allocated=a0.allocated_bytes if a0 else 0,
                        end_allocated=a1.allocated_bytes, cell_files=cell_files,
                        since_us=tr.since_us if tr.owner == "user" else None, sources=sources, names=names)
            if tr.owner == "nbmem" and len(entries) >= tr.max_entries:
                rp = replace(rp, exact=False)  # the ring was full: its oldest events are gone
            out[dev] = rp
        return out
