"""Cleanup: the one path back into the user's state, taken only on an explicit request.

Every step is measured: the bytes it freed, allocated and reserved, as the allocator (CUDA) or a
fresh scan of live tensors (CPU) sees them.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Mapping, Sequence

from .formatting import fmt_bytes, html_table, text_table

#: (allocated, reserved) bytes per device; reserved is None where there is no caching allocator.
Measure = Callable[[], Mapping[str, tuple[int | None, int | None]]]


@dataclass(frozen=True, slots=True)
class CleanupStep:
    """One action and what it freed."""

    action: str
    target: str
    freed_allocated_bytes: int | None
    freed_reserved_bytes: int | None
    note: str = ""


@dataclass(frozen=True)
class CleanupReport:
    """What a cleanup removed, step by step, and the bytes each step gave back."""

    steps: tuple[CleanupStep, ...]

    @property
    def freed_allocated_bytes(self) -> int | None:
        return _total(s.freed_allocated_bytes for s in self.steps)

    @property
    def freed_reserved_bytes(self) -> int | None:
        """None when no step could measure reserved memory (no CUDA): unknown, not zero."""
        return _total(s.freed_reserved_bytes for s in self.steps)

    def _rows(self) -> list[list[str]]:
        return [[s.action, s.target, fmt_bytes(s.freed_allocated_bytes), fmt_bytes(s.freed_reserved_bytes), s.note]
                for s in self.steps]

    def __str__(self) -> str:
        total = (f"freed {fmt_bytes(self.freed_allocated_bytes)} allocated, "
                 f"{fmt_bytes(self.freed_reserved_bytes)} reserved")
        return "nbmem cleanup: " + total + "\n" + text_table(
            ["step", "target", "freed allocated", "freed reserved", "note"], self._rows())

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))

    def _repr_html_(self) -> str:
        cap = (f"nbmem cleanup: freed {fmt_bytes(self.freed_allocated_bytes)} allocated, "
               f"{fmt_bytes(self.freed_reserved_bytes)} reserved")
        return html_table(["step", "target", "freed allocated", "freed reserved", "note"], self._rows(), caption=cap)

    def row(self) -> dict[str, object]:
        return {"freed_allocated_bytes": self.freed_allocated_bytes, "freed_reserved_bytes": self.freed_reserved_bytes}


def _total(values: Iterable[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _freed(before: Mapping[str, tuple[int | None, int | None]],
           after: Mapping[str, tuple[int | None, int | None]]) -> tuple[int | None, int | None]:
    alloc: int | None = None
    res: int | None = None
    for dev, (a0, r0) in before.items():
        a1, r1 = after.get(dev, (None, None))
        if a0 is not None and a1 is not None:
            alloc = (alloc or 0) + (a0 - a1)
        if r0 is not None and r1 is not None:
            res = (res or 0) + (r0 - r1)
    return alloc, res


class Cleaner:
    """Runs the requested steps in a fixed order, measuring around each one."""

    def __init__(self, adapter: Any, measure: Measure, empty_cache: Callable[[], bool]) -> None:
        self.adapter = adapter
        self.measure = measure
        self._empty_cache = empty_cache
        self._last: Mapping[str, tuple[int | None, int | None]] = {}

    def _step(self, steps: list[CleanupStep], action: str, target: str, fn: Callable[[], str | None]) -> None:
        # Nothing runs between two steps, so one step's "after" is the next one's "before": measuring
        # is a walk of the notebook on the CPU, worth doing once per boundary.
        before = self._last
        note = fn() or ""
        self._last = self.measure()
        a, r = _freed(before, self._last)
        steps.append(CleanupStep(action, target, a, r, note))

    def run(self, *, names: Sequence[str] = (), to_cpu: Sequence[str] = (), outputs: bool = False,
            traceback: bool = False, collect: bool = True, empty_cache: bool = True) -> CleanupReport:
        steps: list[CleanupStep] = []
        self._last = self.measure()
        for name in names:
            self._step(steps, "del", name, partial(self.adapter.delete, name))
        for name in to_cpu:
            self._step(steps, "to CPU", name, partial(self._to_cpu, name))
        if outputs:
            self._step(steps, "clear outputs", "Out, _N, _, last result",
                       lambda: f"{self.adapter.clear_outputs()} outputs cleared")
        if traceback:
            self._step(steps, "clear traceback", "last exception",
                       lambda: "%debug can no longer inspect it" if self.adapter.clear_traceback()
                       else "there was no traceback")
        if collect:
            self._step(steps, "gc.collect()", "", lambda: f"{gc.collect()} objects collected")
        if empty_cache:
            self._step(steps, "empty_cache()", "",
                       lambda: None if self._empty_cache() else "CUDA not initialised: nothing cached")
        return CleanupReport(tuple(steps))

    def _to_cpu(self, name: str) -> str:
        obj = self.adapter.get(name)
        if hasattr(obj, "parameters") and hasattr(obj, "cpu"):  # an nn.Module moves in place
            obj.cpu()
            return "module moved in place; optimizer state it had stays on its device"
        self.adapter.rebind(name, obj.cpu())
        return "rebound to a CPU copy; other names still hold the original"
