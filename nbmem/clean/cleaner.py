"""Cleanup: the one way back into the user's state, taken only on an explicit request.

A ``CleanupRequest`` (``request``) is the single door: ``nbmem.cleanup()``, ``%cudamem clean`` and
the gauge's buttons all build one, the engine checks all of it before anything changes, and ``Cleaner``
runs its steps in a fixed order, measuring the bytes each one gave back. A step that fails is recorded in
the report; the steps before it keep their results.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from functools import partial
from typing import Protocol

from nbmem.clean.request import CleanupRequest
from nbmem.formatting import fmt_bytes, plural
from nbmem.records import CleanupStep
from nbmem.reports import CleanupReport

#: (allocated, reserved) bytes per device; reserved is None where there is no caching allocator.
Measure = Callable[[], Mapping[str, tuple[int | None, int | None]]]


class Namespace(Protocol):
    """What the cleaner needs from the notebook (the IPython adapter provides it)."""

    def has(self, name: str) -> bool: ...
    def protected(self, name: str) -> str | None: ...
    def movable(self, name: str) -> str | None: ...
    def delete(self, name: str) -> tuple[str, ...]: ...
    def to_cpu(self, name: str) -> str: ...
    def clear_outputs(self) -> int: ...
    def clear_traceback(self) -> bool: ...


def _freed(before: Mapping[str, tuple[int | None, int | None]],
           after: Mapping[str, tuple[int | None, int | None]], *, skip: str = "") -> tuple[int | None, int | None]:
    """What the devices gave back between two measures (``skip``: a device left out of the sum)."""
    alloc: int | None = None
    res: int | None = None
    for dev, (a0, r0) in before.items():
        if dev == skip:
            continue
        a1, r1 = after.get(dev, (None, None))
        if a0 is not None and a1 is not None:
            alloc = (alloc or 0) + (a0 - a1)
        if r0 is not None and r1 is not None:
            res = (res or 0) + (r0 - r1)
    return alloc, res


class Cleaner:
    """Runs a checked request's steps in a fixed order, measuring around each one."""

    def __init__(self, ns: Namespace, measure: Measure, empty_cache: Callable[[], bool],
                 reset_compiled: Callable[[], str]) -> None:
        self.ns = ns
        self.measure = measure
        self._empty_cache = empty_cache
        self._reset_compiled = reset_compiled

    def run(self, req: CleanupRequest) -> CleanupReport:
        # The collector does not start on its own while the steps run: garbage from earlier cells that it happened
        # to collect inside a step would be counted as what that step freed. The gc step collects it, when asked.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run(req)
        finally:
            if collecting:
                gc.enable()

    def _run(self, req: CleanupRequest) -> CleanupReport:
        steps: list[CleanupStep] = []
        last = self.measure()

        def step(action: str, target: str, fn: Callable[[], str | None], *, moves_to_cpu: bool = False) -> None:
            # Nothing runs between two steps, so one step's "after" is the next one's "before".
            nonlocal last
            note, error = "", ""
            try:
                note = fn() or ""
            except Exception as e:  # recorded; the steps before it keep their results
                error = f"{type(e).__name__}: {e}"
            try:
                now = self.measure()
            except Exception as e:
                steps.append(CleanupStep(action, target, None, None, note, error or f"measuring failed: {e}"))
                return
            if moves_to_cpu:
                # What left the GPUs is not freed on the host: it arrived there. Summed with the CPU's growth,
                # a move would read as 0 B freed; the GPUs' bytes are the step's, the host's growth its note.
                a, r = _freed(last, now, skip="cpu")
                grew = -(_freed({"cpu": last.get("cpu", (None, None))}, now)[0] or 0)
                if grew > 0:
                    note = "; ".join(x for x in (note, f"{fmt_bytes(grew)} more on the CPU") if x)
            else:
                a, r = _freed(last, now)
            last = now
            steps.append(CleanupStep(action, target, a, r, note, error))

        for name in req.names:
            step("del", name, partial(_delete, self.ns, name))
        for name in req.to_cpu:
            step("to CPU", name, partial(self.ns.to_cpu, name), moves_to_cpu=True)
        if req.outputs:
            step("clear outputs", "Out, _N, _, last result",
                 lambda: f"{plural(self.ns.clear_outputs(), 'output')} cleared")
        if req.traceback:
            step("clear traceback", "last exception",
                 lambda: "%debug can no longer inspect it" if self.ns.clear_traceback() else "there was no traceback")
        if req.compiled:
            # Before gc and empty_cache: the graphs it drops free their pools, which those then give back.
            step("reset torch.compile", "compiled code, CUDA graphs", self._reset_compiled)
        if req.collect:
            step("gc.collect()", "", lambda: f"{plural(gc.collect(), 'object')} collected")
        if req.empty_cache:
            step("empty_cache()", "", lambda: None if self._empty_cache() else "CUDA not initialised: nothing cached")
        return CleanupReport(tuple(steps))


def _delete(ns: Namespace, name: str) -> str:
    removed = ns.delete(name)
    return f"also IPython's {', '.join(removed)}" if removed else ""
