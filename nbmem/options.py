"""nbmem's options, each declared once: its name, default, allowed values and help.

``Settings`` is what the engine reads; the IPython adapter builds its ``%config Nbmem`` class from
``OPTIONS``. A value is checked here, in one place, whether it comes from ``%config``, from
``ipython_config.py`` or from a flag; a refused value leaves the old one in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from nbmem.formatting import fmt_bytes, read_size


class OptionError(ValueError):
    """A refused option value; the message is one line that names the allowed values."""


@dataclass(frozen=True)
class Option:
    """One user-facing option: ``Nbmem.<name>``, stored in ``Settings.<attr>``."""

    name: str
    attr: str
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    size: bool = False  # a number of bytes, also typed with its unit ("2 MiB", as ``formatting.read_size`` reads)

    @property
    def kind(self) -> type:
        return type(self.default)

    def allowed(self) -> str:
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.kind is bool:
            return "True or False"
        if self.size:
            return (f"a size in bytes, {self.low:g} to {fmt_bytes(self.high)}: a whole number such as 2097152 or "
                    "`2 * 2**20`, or a string with KiB, MiB, GiB or TiB such as '2 MiB'")
        what = "a whole number" if self.kind is int else "a number"
        return f"{what} from {self.low:g} to {self.high:g}"

    def check(self, value: Any) -> Any:
        """The value in its canonical type, or OptionError saying what is allowed."""
        ok: Any = None
        typed = read_size(value) if self.size and isinstance(value, str) else None
        if typed is not None:
            value = typed.size_bytes
        if self.choices:
            ok = value if isinstance(value, str) and value in self.choices else None
        elif self.kind is bool:
            ok = value if isinstance(value, bool) else None
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if self.kind is int and isinstance(value, float) and value.is_integer():
                value = int(value)
            if self.kind is int and not isinstance(value, int):
                ok = None
            elif math.isfinite(value) and self.low is not None and self.high is not None \
                    and self.low <= value <= self.high:
                ok = self.kind(value)
        if ok is None:
            raise OptionError(f"Nbmem.{self.name} must be {self.allowed()}; got {value!r:.60}")
        return ok


def option(name: str, default: Any, help: str, *, low: float | None = None, high: float | None = None,
           choices: tuple[str, ...] = (), size: bool = False) -> Any:
    """A ``Settings`` field that is also a user option (the attribute name is filled in below)."""
    return field(default=default, metadata={"option": Option(name, "", default, help, low, high, choices, size)})


@dataclass(frozen=True)
class Settings:
    """The options as the engine reads them; units in the names."""

    interval_s: float = option("interval", 0.5, "Seconds between background samples. NVML memory queries cost "
                               "about 10 µs, so the default 2 Hz is free.", low=0.01, high=60)
    history_s: float = option("history", 3600.0, "Seconds of samples kept in memory (a bounded ring; a change "
                              "keeps the newest samples).", low=1, high=7 * 86400)
    threshold_bytes: int = option("threshold", 2**20, "Smallest holder, in bytes, that a report lists (a "
                                  "container of many smaller tensors counts as one holder); 0 lists every holder.",
                                  low=0, high=2**60, size=True)
    scan: bool = option("scan", True, "Find which names hold the memory a monitored cell added.")
    scan_budget_s: float = option("scan_budget", 0.5, "Seconds a monitored cell's holder scan may take before it "
                                  "stops and says which roots it did not finish (nbmem.leaks() scans fully).",
                                  low=0.001, high=3600)
    show: str = option("show", "auto", "When to show the report under a monitored cell: 'auto' when it changed "
                       "memory by at least `threshold`, found a holder or failed.",
                       choices=("auto", "always", "never"))
    reset_peak: bool = option("reset_peak", False, "Reset the allocator's peak counter at the start of each "
                              "monitored cell (your own max_memory_allocated() then counts from that cell). "
                              "Not needed for exact peaks on a GPU: nbmem reads the allocator's event trace.")
    trace: bool = option("trace", False, "Record the CUDA allocator's events in every monitored cell, for an exact "
                         "peak also when the allocator's counters cannot tell (a cell that freed some of what it "
                         "allocated, below an earlier peak). Costs time per allocation while the cell runs: a "
                         "launch-bound training loop (1.5 ms steps) ran at 0.87–0.93× of plain, a compute-bound one "
                         "at 0.99× (an H100, benchmarks/RESULTS.md); %%cudamem always records.")
    lines: bool = option("lines", False, "Record Python stacks of CUDA allocations in monitored cells, for the "
                         "per-line table (%%cudamem --lines does this for one cell). Costs time per allocation.")
    trace_entries: int = option("trace_entries", 100_000, "Most CUDA allocator events recorded while a monitored "
                                "cell runs, for its exact peak and its lines (bounds the trace's memory; a cell with "
                                "more events gets its peak from the allocator's counter when it can). 0 records none.",
                                low=0, high=10_000_000)
    gauge: str = option("gauge", "auto", "Where %load_ext shows the live gauge: 'auto' is JupyterLab's right "
                        "sidebar, inline in VS Code and Colab, none in a terminal.",
                        choices=("auto", "sidebar", "inline", "none"))

    def option(self, name: str) -> Any:
        return getattr(self, OPTION_BY_NAME[name].attr)


OPTIONS: tuple[Option, ...] = tuple(replace(f.metadata["option"], attr=f.name) for f in fields(Settings))
OPTION_BY_NAME = {o.name: o for o in OPTIONS}
