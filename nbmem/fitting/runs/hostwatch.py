"""Host memory during a fit's runs: the room read now (``room_for``) and each run's host bytes (``HostWatch``).

What the numbers mean and how they limit a fit is ``analysis.hostroom``; this half reads them. Each run's host
bytes are measured: the CUDA host allocator's pinned pool from its statistics (read only once CUDA is initialized:
a fit has initialized it), and the peak of the C heap's bytes in use (glibc; elsewhere RSS less the pinned pool),
from a thread that samples it while the run runs. The room is ``host_limit`` where the caller set one, else the
container's memory limit (``measure.limits``), else the machine's available memory; less a margin.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from nbmem.fitting.analysis.hostroom import HostFit, HostRoom, HostUse, fit_host, host_margin_bytes, host_need
from nbmem.formatting import fmt_bytes
from nbmem.measure.host import HostSource, heap_bytes

#: How often the run's heap and RSS are read while it runs (the activations a step keeps on the host live from
#: its forward to its backward: far longer than this).
SAMPLE_S = 0.002


def room_for(host_limit: int | None, source: HostSource | None = None) -> tuple[HostRoom | None, str]:
    """The host room a fit's runs may add to, read now; or None and why it is unknown.

    ``host_limit`` (bytes): the memory this process may use, set by hand (its RSS now is in use). Otherwise the
    container's limit where one applies (what its cgroup charges is in use), else the machine's memory (all
    but what the kernel calls available is in use).
    """
    src = source or HostSource()
    if host_limit is not None:
        rss = src.rss_bytes()
        if rss is None:
            return None, "this process's RSS could not be read"
        return HostRoom(host_limit, rss, host_margin_bytes(host_limit), "host_limit"), ""
    total, used, lim = src.memory()
    if total is None or used is None:
        return None, lim.reason or "neither the container's limit nor the machine's memory could be read"
    what = f"the container's memory limit ({lim.source})" if lim.applies else "the machine's memory"
    return HostRoom(total, used, host_margin_bytes(total), what), ""


# -- the runs, measured --------------------------------------------------------------------------------------------
def _pinned_pool_bytes() -> int | None:
    """The CUDA host allocator's pool (blocks in use and cached), where CUDA is initialized; None elsewhere."""
    t = sys.modules.get("torch")
    try:
        if t is None or not t.cuda.is_initialized():
            return None
        return int(t.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    except Exception:
        return None


def empty_pinned_cache() -> bool:
    """Give the host allocator's cached pinned blocks back (the fit's own runs made them), where torch can."""
    t = sys.modules.get("torch")
    # torch 2.13's public name; torch 2.11 has only the binding under it
    empty = (getattr(getattr(t, "accelerator", None), "empty_host_cache", None)
             or getattr(getattr(t, "_C", None), "_host_emptyCache", None))
    if t is None or empty is None or not t.cuda.is_initialized():
        return False
    try:
        empty()
    except Exception:
        return False
    return True


class _Peaks:
    """A thread that reads the heap and RSS while a run runs and keeps the largest reading of each."""

    def __init__(self, reads: Sequence[Callable[[], int | None]]) -> None:
        self.reads = reads
        self.start = [r() or 0 for r in reads]
        self.peaks = list(self.start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nbmem-fit-host", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        self.peaks = [max(p, r() or 0) for p, r in zip(self.peaks, self.reads, strict=True)]

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._read()

    def stop(self) -> list[int]:
        """The growth of each over the run: its largest reading less its first."""
        self._stop.set()
        self._thread.join()
        self._read()
        return [p - s for p, s in zip(self.peaks, self.start, strict=True)]


@dataclass
class HostWatch:
    """A fit's host side: the room, read before the runs, and each run's host bytes (``before``/``after``)."""

    room: HostRoom | None
    reason: str = ""
    uses: list[HostUse] = field(default_factory=list)
    read_pageable: Callable[[], int | None] | None = None  # the C heap's bytes in use (glibc), by default
    read_rss: Callable[[], int | None] | None = None  # RSS, by default, off glibc
    read_pinned: Callable[[], int | None] = _pinned_pool_bytes
    empty_pinned: Callable[[], bool] = empty_pinned_cache
    _peaks: _Peaks | None = None
    _heap: bool = True  # the run's pageable bytes are the heap's (else RSS's)
    _pinned_start: int | None = None
    _pinned_floor: int | None = None  # the pool before the first run: what a run adds is over it

    def before(self) -> None:
        """Start measuring a run: the cached pinned blocks given back first, so its pool is its own."""
        emptied = self.empty_pinned()
        pool = self.read_pinned()
        if self._pinned_floor is None:
            self._pinned_floor = pool
        # Without a way to give cached blocks back, a run reuses the last ones: count what the pool holds
        # over what it held before the fit (all the runs' blocks so far: more than this run's, never less).
        self._pinned_start = pool if emptied else self._pinned_floor
        # The heap's bytes in use are exact (malloc's, untouched pages too) where glibc tells them; RSS, where it
        # does not, also moves with kernels loaded for new sizes and pages the heap keeps, and counts pinned pages.
        heap = self.read_pageable or heap_bytes
        self._heap = heap is not None
        self._peaks = _Peaks([heap] if heap is not None else [self.read_rss or HostSource().rss_bytes])

    def after(self, value: int, counted: bool, oom: bool) -> None:
        """Stop measuring the run at ``value``; its host bytes join the others'."""
        peaks, self._peaks = self._peaks, None
        grown = peaks.stop() if peaks is not None else [0]
        pool, start = self.read_pinned(), self._pinned_start
        pinned = max(0, pool - start) if pool is not None and start is not None else 0
        pageable = max(0, grown[0] if self._heap else grown[0] - pinned)
        self.uses.append(HostUse(value, pinned, pageable, counted, oom))

    def close(self) -> None:
        """After the fit: a sampler still running (a run that raised) stops, and the runs' pinned cache goes."""
        if self._peaks is not None:
            self._peaks.stop()
            self._peaks = None
        self.empty_pinned()

    def fresh(self) -> HostWatch:
        """The same room, for runs of their own (a remedy's)."""
        return HostWatch(self.room, self.reason, read_pageable=self.read_pageable, read_rss=self.read_rss,
                         read_pinned=self.read_pinned, empty_pinned=self.empty_pinned)

    def fit(self) -> HostFit | None:
        return fit_host(host_need(self.uses, "the C heap" if self._heap else "RSS"), self.room, self.reason)

    def over(self, value: int, name: str) -> str:
        """Why ``value`` is predicted not to fit into host memory ("" where it fits, or the runs cannot tell)."""
        need = host_need(self.uses, "the C heap" if self._heap else "RSS")
        if need is None or self.room is None or need.at(value) <= self.room.capacity_bytes:
            return ""
        return (f"the runs before it predict {fmt_bytes(need.at(value))} of {need.how} at {name}={value:,}, over "
                f"the host's {self.room.text()}")


__all__ = ["HostWatch", "empty_pinned_cache", "room_for"]
