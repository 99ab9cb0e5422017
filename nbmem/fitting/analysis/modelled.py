"""The remedies modelled from a fit's own runs, nothing run again, and the record every remedy is reported in.

*Gradient accumulation*: the wanted value as the fewest micro-batches that each fit. *Expandable segments*: worth a
restart only where the cache's reserved-but-unused memory, not the allocated memory, is what does not fit. The
measured remedies (activation checkpointing, bf16 autocast: the runs again under each) are ``runs.remedies``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nbmem.fitting.analysis.search import largest_fitting
from nbmem.fitting.analysis.timeline import Timeline
from nbmem.formatting import fmt_bytes


@dataclass(frozen=True, slots=True)
class Remedy:
    """A way to run a wanted value that does not fit, and the largest value it allows."""

    name: str  # "gradient accumulation", "activation checkpointing", "bf16 autocast", "expandable_segments"
    largest_value: int
    setting: str  # what to do
    how: str  # how the value was established, and what it costs
    time_per_sample_ratio: float | None = None  # measured: its step's time over the plain step's, at one value


# -- modelled: from the fit's own runs, nothing run again -----------------------------------------------
#: What the allocator rounds to with expandable segments, kept free on top of the allocated peak: a 2 MiB page
#: for each of the small and large pools of a stream, twice.
EXPANDABLE_SLACK_BYTES = 8 << 20


def accumulation(name: str, largest: int, want: int) -> list[Remedy]:
    """Gradient accumulation: ``want`` as the fewest micro-batches that each fit (from the fit itself)."""
    steps = math.ceil(want / largest)
    micro = math.ceil(want / steps)
    last = want - micro * (steps - 1)
    split = f"{name}={micro:,} × {steps} steps" + ("" if last == micro else f" (the last {last:,})")
    return [Remedy("gradient accumulation", micro, f"{split}, loss / {steps}",
                   f"this fit: {micro:,} ≤ {largest:,} fits (if {name} is the batch size); "
                   f"the optimizer steps {steps}× less often")]


def expandable(tl: Timeline, name: str, largest: int, capacity: int, cap: int, notes: list[str]) -> list[Remedy]:
    """``expandable_segments``: worth a restart only where the cache's reserved-but-unused memory is what does
    not fit, i.e. where the allocated peak alone (and a page of rounding per pool) still fits."""
    def fits(v: int) -> bool:
        return tl.simulate(v, math.inf).peak_allocated_bytes + EXPANDABLE_SLACK_BYTES <= capacity

    unfragmented = largest_fitting(fits, largest, cap)
    if unfragmented is None or unfragmented <= largest:
        notes.append(f"expandable_segments would not help: at {name}={largest + 1:,} the allocated memory itself "
                     "does not fit, not the cache's reserved-but-unused memory")
        return []
    nxt = tl.simulate(largest + 1, math.inf)
    return [Remedy("expandable_segments", unfragmented,
                   "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, then restart the kernel",
                   f"this fit's model, not measured (+{100 * (unfragmented / largest - 1):.0f} %): at "
                   f"{largest + 1:,} the cache reserves {fmt_bytes(nxt.peak_reserved_bytes)} for "
                   f"{fmt_bytes(nxt.peak_allocated_bytes)} allocated")]


__all__ = ["EXPANDABLE_SLACK_BYTES", "Remedy", "accumulation", "expandable"]
