"""What a user asked cleanup to free, checked whole before anything changes: a record, no state touched.

Built by ``nbmem.cleanup()``, ``%cudamem clean`` and the gauge's buttons; ``cleaner`` carries it out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from nbmem.formatting import did_you_mean, plural
from nbmem.records import CleanupOf

#: Problems, and names in one problem, a refusal lists before it counts the rest.
SHOWN = 5


class Names(Protocol):
    """What checking a request needs to know about the notebook's names (the IPython adapter answers)."""

    def has(self, name: str) -> bool: ...
    def protected(self, name: str) -> str | None: ...
    def movable(self, name: str) -> str | None: ...
    def names(self) -> Iterable[str]: ...  # the notebook's variables, for "did you mean" under a mistyped one


class CleanupRefused(ValueError):
    """A request that was not carried out, with every problem it had; nothing was removed."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(self.problems) + ". Nothing was removed.")


def _names(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    try:
        items = list(value)
    except TypeError:
        raise CleanupRefused([f"{what} takes a list of variable names, not {type(value).__name__}"]) from None
    bad = [x for x in items if not isinstance(x, str) or not x.isidentifier()]
    if bad:
        shown = ", ".join(repr(x)[:40] for x in bad[:SHOWN]) + (
            f" (and {len(bad) - SHOWN:,} more)" if len(bad) > SHOWN else "")
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
    compiled: bool = False  # torch._dynamo.reset(): what torch.compile made (compiled code, CUDA graphs, their pools)

    @classmethod
    def of(cls, names: Any = (), to_cpu: Any = (), outputs: Any = False, traceback: Any = False,
           collect: Any = True, empty_cache: Any = True, compiled: Any = False) -> CleanupRequest:
        """A request from loosely typed arguments (``nbmem.cleanup``): names deduplicated, flags checked."""
        problems = []
        flags = {"outputs": outputs, "traceback": traceback, "collect": collect, "empty_cache": empty_cache,
                 "compiled": compiled}
        for k, v in flags.items():
            if not isinstance(v, bool):
                problems.append(f"{k} must be True or False, not {v!r:.40}")
        if problems:
            raise CleanupRefused(problems)
        return cls(_names(names, "names"), _names(to_cpu, "to_cpu"), outputs, traceback, collect, empty_cache,
                   compiled)

    def plus(self, listed: CleanupOf) -> CleanupRequest:
        """This request and what a report listed (``--last-report``), each name once."""
        return CleanupRequest(tuple(dict.fromkeys(self.names + listed.names)), self.to_cpu,
                              self.outputs or listed.outputs, self.traceback or listed.traceback, self.collect,
                              self.empty_cache, self.compiled)

    def __bool__(self) -> bool:
        return bool(self.names or self.to_cpu or self.outputs or self.traceback or self.compiled)

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
        if self.compiled:
            parts.append("reset torch.compile")
        if parts:
            return "; ".join(parts)
        return " + ".join(s for s, on in (("gc", self.collect), ("empty cache", self.empty_cache)) if on)

    def check(self, ns: Names) -> None:
        """Every problem at once, or nothing: CleanupRefused before any change is made."""
        problems = []
        unknown = [n for n in dict.fromkeys(self.names + self.to_cpu) if not ns.has(n)]
        if unknown:
            problems.append(f"no variable named {_some(unknown, list(ns.names()))} in this notebook")
        for n in self.names + self.to_cpu:
            if n in unknown:
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
            raise CleanupRefused(problems[:SHOWN] + ([f"and {plural(len(problems) - SHOWN, 'more problem')}"]
                                                     if len(problems) > SHOWN else []))


def _some(names: Sequence[str], near: Sequence[str] = ()) -> str:
    """The first few names, and how many more: a refusal stays readable however many were given; each with the
    closest of ``near`` (the notebook's names) where one is close."""
    shown = ", ".join(repr(n)[:40] + did_you_mean(n, near) for n in names[:SHOWN])
    return shown + (f" (and {len(names) - SHOWN:,} more)" if len(names) > SHOWN else "")
