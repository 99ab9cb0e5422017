"""Host memory as a fit's limit: what each run adds on the host, the room there, and the largest value it allows.

A body that moves memory to the host (``torch.autograd.graph.save_on_cpu``, pinned buffers, ``.cpu()`` in the step,
a DataLoader with ``pin_memory``) can run out of host memory before the GPU's: pinned memory fails in
``cudaHostAlloc`` ("CUDA error: out of memory"), pageable memory brings the kernel's OOM killer. Each run's host
bytes are measured (``HostWatch``): the CUDA host allocator's pinned pool from its statistics (read only once CUDA
is initialized: a fit has initialized it), and the peak of the C heap's bytes in use (glibc; elsewhere RSS less the
pinned pool), from a thread that samples it while the run runs. The room (``room_for``) is ``host_limit`` where the
caller set one, else the container's memory limit (``measure.limits``), else the machine's available memory; less a
margin. The model (``host_need``) errs high: the pinned pool rounds each block up to a power of two, so a value up
to twice a run's may need twice its pinned bytes; heap growth is a size model (``sizes.fit_size``) through the runs.
Growth below noise (a body that keeps nothing on the host) is no limit, and nothing is said about it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from nbmem.fitting.analysis.search import SEARCH_CAP, largest_fitting
from nbmem.fitting.analysis.sizes import fit_size
from nbmem.formatting import fmt_bytes, read_size

#: Heap (or RSS) growth with the value below this, between the smallest and the largest run, is noise: Python
#: objects, autograd's graph, kernels loaded for new sizes. Pinned bytes are exact: any growth counts.
HOST_NOISE_BYTES = 8 << 20
#: A pinned buffer of the same size at every value, smaller than this, is no limit worth a line.
PINNED_FIXED_BYTES = 1 << 20
#: The margin kept below the host room: other processes, the page cache the kernel will not give up, and
#: what the notebook allocates after the fit.
HOST_MARGIN_FRACTION = 0.05
MIN_HOST_MARGIN_BYTES = 256 << 20


# -- the room and the model (pure) ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HostRoom:
    """The host memory a fit's runs may add to: the limit that applies, what is in use before them, a margin."""

    limit_bytes: int
    used_bytes: int
    margin_bytes: int
    source: str  # which limit, as a person reads it

    @property
    def capacity_bytes(self) -> int:
        return self.limit_bytes - self.used_bytes - self.margin_bytes

    def text(self) -> str:
        pct = 100 * self.margin_bytes / max(1, self.limit_bytes)
        return (f"{fmt_bytes(self.capacity_bytes)} room: {self.source} {fmt_bytes(self.limit_bytes)} − "
                f"{fmt_bytes(self.used_bytes)} in use − {fmt_bytes(self.margin_bytes)} margin ({pct:.0f} %)")


def host_margin_bytes(limit_bytes: int) -> int:
    return max(MIN_HOST_MARGIN_BYTES, int(HOST_MARGIN_FRACTION * limit_bytes))


@dataclass(frozen=True, slots=True)
class HostUse:
    """What one run added on the host: the pinned pool's growth and the heap's (or RSS's) peak growth."""

    value: int
    pinned_bytes: int  # 0 where torch has no pinned statistics
    pageable_bytes: int
    counted: bool = True
    oom: bool = False


@dataclass(frozen=True, slots=True)
class HostNeed:
    """The model of a body's host bytes over the value: ``at(v)`` errs high."""

    pinned: tuple[tuple[int, int], ...]  # (value, pinned bytes) of each run; () where pinned does not grow
    pageable: Any  # a ``SizeModel`` through the heap growth, or None where it does not grow
    pinned_fixed: bool  # the pool was the same at values spanning 2× or more: a buffer, not growth
    how: str
    pinned_floor_bytes: int = 0  # of each run's pool, the part that does not grow (``pinned_floor``)

    def at(self, value: int) -> int:
        pinned = 0
        if self.pinned:
            floor = self.pinned_floor_bytes
            pinned = (max(b for _, b in self.pinned) if self.pinned_fixed else
                      floor + min((b - floor) * _pow2_ceil(value / v) for v, b in self.pinned))
        return pinned + (self.pageable.at(value) if self.pageable is not None else 0)


#: Runs a power of two apart agree on the pool's fixed part to within this fraction of the smaller pools.
FLOOR_AGREEMENT = 0.01


def pinned_floor(points: Sequence[tuple[int, int]]) -> int:
    """The part of the pinned pool that does not grow with the value (``save_on_cpu`` packs the weights a layer
    saves too: 384 MiB of an MLP's 592 MiB at 1,024), which the power-of-two bound must not scale.

    Blocks proportional to the value, each rounded up to a power of two, double exactly when the value doubles:
    between runs at v and 2^j × v the pool grows by (2^j − 1) × its growing part at v, and what is left is fixed.
    It is taken only where two or more pairs of runs a power of two apart agree on it, and every run at a larger
    value shows the growing part of the smallest such run scaled by exactly that bound (``FLOOR_AGREEMENT``):
    else 0. A block of a × v + c grows by less than the bound, and one that has not grown yet looks fixed: a run
    where it has started to grow, or where blocks are not powers of two at the smallest value, shows it; where
    no run reaches that value, the host margin is what is left (save_on_cpu packs activations, a × v, and
    weights, c: not such blocks)."""
    est = []
    for i, (va, ba) in enumerate(points):
        for vb, bb in points[i + 1:]:
            j = (vb // va).bit_length() - 1 if va > 0 and vb % va == 0 else 0
            if j >= 1 and va << j == vb:
                est.append((((1 << j) * ba - bb) / ((1 << j) - 1), va, min(ba, bb)))
    if len(est) < 2:
        return 0
    floors = [f for f, _, _ in est]
    if min(floors) < 0 or max(floors) - min(floors) > FLOOR_AGREEMENT * min(b for _, _, b in est):
        return 0
    floor = min(min(floors), min(b for _, b in points))
    base = min(v for _, v, _ in est)
    grows = dict(points)[base] - floor
    for v, b in points:
        if v >= base and abs(b - floor - grows * _pow2_ceil(v / base)) > FLOOR_AGREEMENT * b:
            return 0
    return int(floor)


def _pow2_ceil(ratio: float) -> int:
    """The power of two at or above ``ratio``, 1 at or below 1: a block of b bytes at v is at most
    b × this at ``ratio`` × v, once rounded up to a power of two (b is one)."""
    return 1 if ratio <= 1 else 1 << math.ceil(math.log2(ratio) - 1e-12)


def host_need(uses: Sequence[HostUse], pageable: str = "the C heap") -> HostNeed | None:
    """The host bytes the runs show, as a model over the value; None where they do not grow beyond noise."""
    ok = [u for u in uses if not u.oom]
    if not ok:
        return None
    vals = sorted({u.value for u in ok})
    pinned: dict[int, int] = {}
    for u in ok:
        pinned[u.value] = max(u.pinned_bytes, pinned.get(u.value, 0))
    fixed = len(set(pinned.values())) == 1 and vals[-1] >= 2 * vals[0]
    # Pinned bytes are exact, and a few at small values can be a lot at the answer: any growth counts, and a
    # pinned buffer the same at every value only where it is not a sliver (a scalar copied to the host).
    grows_pinned = any(b > 0 for b in pinned.values()) and not (fixed and max(pinned.values()) < PINNED_FIXED_BYTES)
    heap: dict[int, int] = {}
    for u in ok:
        heap[u.value] = max(u.pageable_bytes, heap.get(u.value, 0))
    counted = {u.value for u in ok if u.counted}
    points = [(v, heap[v]) for v in vals if v in counted] or [(v, heap[v]) for v in vals]
    grows_heap = (points[-1][1] - points[0][1] >= HOST_NOISE_BYTES if len(points) >= 2
                  else points[0][1] >= 4 * HOST_NOISE_BYTES)
    if not grows_pinned and not grows_heap:
        return None
    hows = (["pinned memory (the CUDA host allocator's statistics)"] if grows_pinned else []) + (
        [f"pageable memory ({pageable})"] if grows_heap else [])
    return HostNeed(tuple(sorted(pinned.items())) if grows_pinned else (),
                    fit_size(points) if grows_heap else None, fixed, " and ".join(hows),
                    pinned_floor(sorted(pinned.items())) if grows_pinned and not fixed else 0)


@dataclass(frozen=True, slots=True)
class HostFit:
    """The host side of a fit's answer: the room there, and the largest value it allows."""

    room: HostRoom | None  # None: the room is unknown
    need: HostNeed
    largest_value: int | None  # None: not even the smallest value; SEARCH_CAP or more: no limit
    gpu_largest_value: int | None = None  # the answer on the GPU alone, where the host limits it
    reason: str = ""  # why the room is unknown

    @property
    def limits(self) -> bool:
        return self.gpu_largest_value is not None

    def line(self, name: str, at: int | None) -> str:
        """One line for the report: what the runs add on the host and whether it limits the answer."""
        per = ""
        top = max((v for v, _ in self.need.pinned), default=None)
        if top is not None and not self.need.pinned_fixed:
            per = f"{fmt_bytes(self.need.at(top) / top)} per {name}"
        elif self.need.pageable is not None:
            per = f"{fmt_bytes(self.need.pageable.per_unit_bytes)} per {name}"
        grows = f"the runs add {per or 'a fixed amount'} on the host, in {self.need.how}"
        if self.room is None:
            return f"host memory not checked: {grows}, and the room there is unknown ({self.reason})"
        if self.limits and self.largest_value is not None:
            on_gpu = (f"{self.gpu_largest_value:,}" if self.gpu_largest_value is not None and
                      self.gpu_largest_value < SEARCH_CAP else "any value")
            need = fmt_bytes(self.need.at(self.largest_value))
            return (f"limited by host memory: {self.room.text()}; {grows}, {need} at {self.largest_value:,} (the GPU "
                    f"alone would allow {on_gpu})")
        if at is None:
            return f"host memory: {self.room.text()}; {grows}"
        return f"host memory: {self.room.text()}; {grows}, {fmt_bytes(self.need.at(at))} at {at:,}: it fits"

    def over(self, value: int) -> bool:
        return self.room is not None and self.need.at(value) > self.room.capacity_bytes


def fit_host(need: HostNeed | None, room: HostRoom | None, reason: str = "") -> HostFit | None:
    """The largest value whose host bytes fit ``room`` (None where the runs keep nothing on the host)."""
    if need is None:
        return None
    if room is None:
        return HostFit(None, need, SEARCH_CAP, reason=reason or "unknown")
    capacity = room.capacity_bytes
    start = max((v for v, _ in need.pinned), default=1)
    return HostFit(room, need, largest_fitting(lambda v: need.at(v) <= capacity, start))


def with_host(result: Any, host: HostFit | None, name: str) -> Any:
    """A ``FitResult`` whose answer is the largest value that fits on the GPU and on the host, saying which
    limits it (``host``: the host side; None leaves the result as it is)."""
    if host is None or host.room is None:
        return result if host is None else replace(result, host=host)
    gpu = result.largest_value
    if gpu is None and not result.reason.startswith("its memory does not grow"):
        return replace(result, host=host)  # no answer on the GPU: its reason stands
    if host.largest_value is None:
        return replace(result, largest_value=None, power_of_two=None, capped="",
                       host=replace(host, gpu_largest_value=gpu),
                       reason=f"not even {name}=1 fits into host memory ({host.room.text()})")
    if gpu is None and host.largest_value < SEARCH_CAP:
        gpu = SEARCH_CAP  # the GPU sets no limit: the host's is the answer
    if gpu is None or host.largest_value >= gpu:
        return replace(result, host=host)
    largest = host.largest_value
    return replace(result, largest_value=largest, power_of_two=1 << (largest.bit_length() - 1), reason="",
                   capped="limited by host memory", host=replace(host, gpu_largest_value=gpu))


# -- the limit a user gives -----------------------------------------------------------------------------------
def parse_host_limit(spec: object) -> int:
    """``host_limit`` in bytes: a size (``"8GiB"``, ``"8GB"``, ``"8000MiB"``) or a whole number of bytes (an int or
    a NumPy integer), above 0; a ValueError in one line, ``takes ...``, that names the fix otherwise."""
    if isinstance(spec, numbers.Integral) and not isinstance(spec, bool):
        nbytes: int | None = int(spec)
    else:
        size = read_size(spec) if isinstance(spec, str) else None
        nbytes = None if size is None else size.size_bytes
    if nbytes is None or nbytes < 1:
        # A bare number in a string ("8") is refused: 8 bytes is never what was meant.
        ints = "" if isinstance(spec, str) else ", or a whole number of bytes"
        raise ValueError(f"takes a memory size above 0, such as '8GiB', '8GB' or '8000MiB'{ints}; not {spec!r:.40}")
    return nbytes


__all__ = ["HOST_NOISE_BYTES", "HostFit", "HostNeed", "HostRoom", "HostUse", "fit_host", "host_margin_bytes",
           "host_need", "parse_host_limit", "pinned_floor", "with_host"]
