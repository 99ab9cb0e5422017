"""The host side: this process's RSS and high-water mark, the C heap's bytes, and the memory it may use.

One choke point each (psutil, ``getrusage``, glibc's ``mallinfo2``); a value the machine does not give is None,
never 0. The limit that applies comes from ``limits`` (the cgroup's, where it is below the host's RAM).
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nbmem.measure.limits import Cgroup, applied
from nbmem.records import MemoryLimit


@dataclass
class HostSource:
    """This process's resident memory, and the memory it may use: the host's, or its container's limit."""

    _proc: Any = field(default=None, repr=False)
    limits: Cgroup = field(default_factory=Cgroup, repr=False)

    def rss_bytes(self) -> int | None:
        try:
            if self._proc is None:
                import psutil

                self._proc = psutil.Process()
            return int(self._proc.memory_info().rss)
        except Exception:
            return _statm_rss()

    def memory(self) -> tuple[int | None, int | None, MemoryLimit]:
        """(total, used) of the memory this process may use, and the limit read: host RAM (used is total
        minus what the kernel calls available), or the cgroup's limit and its usage where that is lower."""
        total: int | None = None
        used: int | None = None
        try:
            import psutil

            vm = psutil.virtual_memory()
            total, used = int(vm.total), int(vm.total - vm.available)
        except Exception:
            pass
        lim = self.limits.read(total)
        return (*applied(lim, total, used), lim)

    @staticmethod
    def max_rss_bytes() -> int | None:
        """The kernel's high-water mark of RSS (exact, unlike polling)."""
        try:
            import resource  # Unix only

            kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        except Exception:
            return None
        return int(kb) * (1 if sys.platform == "darwin" else 1024)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2() -> Callable[[], int] | None:
    try:
        fn = ctypes.CDLL(None).mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError, TypeError):
        return None
    fn.restype = _MallInfo2

    def heap_bytes() -> int:
        r = fn()
        return int(r.hblkhd + r.uordblks)
    return heap_bytes


#: Bytes the C heap has handed out (glibc's mallinfo2: 1-2 µs in a fresh process, milliseconds where the heap has
#: 100,000 free chunks), or None off glibc. CPU tensors come from malloc, and torch.empty pages are untouched, so
#: RSS would not see them: this does.
heap_bytes = _mallinfo2()


class HeapWatch:
    """The C heap in use, plus what full garbage collections gave back while installed.

    A full collection frees garbage made long before (a cycle made cells ago, a closed shell's namespace), and in the
    heap's plain reading that can cancel what a cell kept in the same moment. Added back, that cannot happen; garbage
    the cell itself made and a collection freed counts as growth then, which only sends the scan further. Only full
    collections are watched: reading the heap walks glibc's free chunks (milliseconds where there are 100,000 of
    them), and the younger generations are collected many times a second in a busy loop; the older garbage is
    what lives until a full one.
    """

    def __init__(self, read: Callable[[], int] | None = heap_bytes) -> None:
        self._read = read
        self.collected_bytes = 0
        self._at_start: int | None = None

    def install(self) -> None:
        if self._read is not None and self._on_collection not in gc.callbacks:
            gc.callbacks.append(self._on_collection)

    def remove(self) -> None:
        while self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def bytes(self) -> int | None:
        """The heap in use with what collections gave back added; None off glibc."""
        return None if self._read is None else self._read() + self.collected_bytes

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        # Runs inside the collector, on whichever thread triggered it: it must never raise.
        try:
            if info.get("generation", 0) < 2 or self._read is None:
                return
            if phase == "start":
                self._at_start = self._read()
            elif self._at_start is not None:
                self.collected_bytes += max(0, self._at_start - self._read())
                self._at_start = None
        except Exception:
            self._at_start = None


def _statm_rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except Exception:
        return None
