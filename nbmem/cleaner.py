"""Cleanup: the one way back into the user's state, taken only on an explicit request.

``CleanupRequest`` is the single door: ``nbmem.cleanup()``, ``%cudamem clean`` and the gauge's buttons all
build one, the engine checks all of it before anything changes (``check``), and ``Cleaner`` runs its
steps in a fixed order, measuring the bytes each one gave back. A step that fails is recorded in the
report; the steps before it keep their results.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from .records import CleanupReport, CleanupStep, Finding, merge_cleanups

#: (allocated, reserved) bytes per device; reserved is None where there is no caching allocator.
Measure = Callable[[], Mapping[str, tuple[int | None, int | None]]]


class CleanupRefused(ValueError):
    """A request that was not carried out, with every problem it had; nothing was removed."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(self.problems) + ". Nothing was removed.")


class Namespace(Protocol):
    """What the cleaner needs from the notebook (the IPython adapter provides it)."""

    def has(self, name: str) -> bool: ...
    def protected(self, name: str) -> str | None: ...
    def movable(self, name: str) -> str | None: ...
    def delete(self, name: str) -> tuple[str, ...]: ...
    def to_cpu(self, name: str) -> str: ...
    def clear_outputs(self) -> int: ...
    def clear_traceback(self) -> bool: ...


def _names(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    try:
        items = list(value)
    except TypeError:
        raise CleanupRefused([f"{what} takes a list of variable names, not {type(value).__name__}"]) from None
    bad = [x for x in items if not isinstance(x, str) or not x.isidentifier()]
    if bad:
        shown = ", ".join(repr(x)[:40] for x in bad)
        raise CleanupRefused([f"{what}: {shown} is not a variable name; pass top-level names such as ['x', "
                              f"'losses'] (to drop one element, do it yourself, e.g. `losses.clear()`)"])
    return tuple(dict.fromkeys(items))  # a name given twice is deleted once


@dataclass(frozen=True)
class CleanupRequest:
    """What a user asked to free. Names are top-level variables; nothing else is ever removed."""

    names: tuple[str, ...] = ()
    to_cpu: tuple[str, ...] = ()
    outputs: bool = False
    traceback: bool = False
    collect: bool = True
    empty_cache: bool = True

    @classmethod
    def of(cls, names: Any = (), to_cpu: Any = (), outputs: Any = False, traceback: Any = False,
           collect: Any = True, empty_cache: Any = True) -> CleanupRequest:
        """A request from loosely typed arguments (``nbmem.cleanup``): names deduplicated, flags checked."""
        problems = []
        flags = {"outputs": outputs, "traceback": traceback, "collect": collect, "empty_cache": empty_cache}
        for k, v in flags.items():
            if not isinstance(v, bool):
                problems.append(f"{k} must be True or False, not {v!r:.40}")
        if problems:
            raise CleanupRefused(problems)
        return cls(_names(names, "names"), _names(to_cpu, "to_cpu"), outputs, traceback, collect, empty_cache)

    @classmethod
    def for_findings(cls, findings: Iterable[Finding], *, collect: bool = True,
                     empty_cache: bool = True) -> CleanupRequest:
        """Exactly what frees these findings: their top-level names, the outputs, the traceback."""
        c = merge_cleanups(findings)
        return cls(c.names, (), c.outputs, c.traceback, collect, empty_cache)

    def __bool__(self) -> bool:
        return bool(self.names or self.to_cpu or self.outputs or self.traceback)

    def describe(self) -> str:
        """What it will do, as a person would say it ("del model, opt; clear outputs")."""
        parts = []
        if self.names:
            parts.append("del " + ", ".join(self.names))
        if self.to_cpu:
            parts.append(", ".join(self.to_cpu) + " to CPU")
        if self.outputs:
            parts.append("clear outputs")
        if self.traceback:
            parts.append("clear traceback")
        if parts:
            return "; ".join(parts)
        return " + ".join(s for s, on in (("gc", self.collect), ("empty cache", self.empty_cache)) if on)

    def check(self, ns: Namespace) -> None:
        """Every problem at once, or nothing: CleanupRefused before any change is made."""
        problems = []
        for n in self.names + self.to_cpu:
            if not ns.has(n):
                problems.append(f"no variable named {n!r} in this notebook")
                continue
            why = ns.protected(n)
            if why:
                problems.append(f"{n!r} {why}")
        for n in self.to_cpu:
            if n in self.names:
                problems.append(f"{n!r} is both deleted and moved to the CPU: choose one")
            elif ns.has(n) and not ns.protected(n):
                why = ns.movable(n)
                if why:
                    problems.append(f"{n!r} {why}")
        if problems:
            raise CleanupRefused(problems)


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
    """Runs a checked request's steps in a fixed order, measuring around each one."""

    def __init__(self, ns: Namespace, measure: Measure, empty_cache: Callable[[], bool]) -> None:
        self.ns = ns
        self.measure = measure
        self._empty_cache = empty_cache

    def run(self, req: CleanupRequest) -> CleanupReport:
        steps: list[CleanupStep] = []
        last = self.measure()

        def step(action: str, target: str, fn: Callable[[], str | None]) -> None:
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
            a, r = _freed(last, now)
            last = now
            steps.append(CleanupStep(action, target, a, r, note, error))

        for name in req.names:
            step("del", name, partial(_delete, self.ns, name))
        for name in req.to_cpu:
            step("to CPU", name, partial(self.ns.to_cpu, name))
        if req.outputs:
            step("clear outputs", "Out, _N, _, last result", lambda: f"{self.ns.clear_outputs()} outputs cleared")
        if req.traceback:
            step("clear traceback", "last exception",
                 lambda: "%debug can no longer inspect it" if self.ns.clear_traceback() else "there was no traceback")
        if req.collect:
            step("gc.collect()", "", lambda: f"{gc.collect()} objects collected")
        if req.empty_cache:
            step("empty_cache()", "", lambda: None if self._empty_cache() else "CUDA not initialised: nothing cached")
        return CleanupReport(tuple(steps))


def _delete(ns: Namespace, name: str) -> str:
    removed = ns.delete(name)
    return f"also IPython's {', '.join(removed)}" if removed else ""
