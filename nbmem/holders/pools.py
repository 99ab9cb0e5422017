"""The allocator's private pools: memory CUDA graphs keep, which no Python name reaches.

``torch.compile(model, mode="reduce-overhead")`` records CUDA graphs, and every graph allocates from a private
memory pool of the caching allocator, apart from the default pool: its static inputs, intermediates and
outputs. The allocator says which pool each segment belongs to (``torch.cuda.memory_snapshot()``'s
``segment_pool_id``; the default pool is ``(0, 0)``), so the bytes are counted, not guessed.

Pure: functions over the snapshot's segments (``TorchSource.segments``) and the addresses of the storages
the holder scan reached. Nothing here reads torch or changes anything.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nbmem.formatting import fmt_bytes
from nbmem.records import PoolUse

if TYPE_CHECKING:
    from nbmem.holders.scanner import Scan

DEFAULT_POOL = (0, 0)
#: The type ``torch.compile`` returns for a module (``torch._dynamo.eval_frame.OptimizedModule``).
COMPILED_MODULE = "OptimizedModule"


@dataclass(frozen=True)
class Unnamed:
    """What a cell left allocated that no name reaches: the gap per device, what the CUDA-graph pools hold on
    the devices where it (or the cache) grew, and the notebook's compiled modules."""

    gaps: tuple[tuple[str, int], ...]
    pools: tuple[PoolUse, ...]
    compiled: tuple[str, ...]
    before: tuple[tuple[str, int], ...] = ()  # each gap as the cell found it: what earlier cells left unnamed


def pool_of(segment: Mapping[str, Any]) -> tuple[int, int]:
    """A segment's pool id; a snapshot without the field (an old torch) has the default pool only."""
    raw = segment.get("segment_pool_id", DEFAULT_POOL)
    try:
        a, b = raw
        return int(a), int(b)
    except (TypeError, ValueError):
        return DEFAULT_POOL


def _blocks(segment: Mapping[str, Any]) -> Iterable[tuple[int, int, str]]:
    """(address, size, state) of each block; addresses follow the segment's where a block lacks its own."""
    addr = int(segment.get("address", 0))
    for b in segment.get("blocks", ()):
        size = int(b.get("size", 0))
        yield int(b.get("address", addr)), size, str(b.get("state", ""))
        addr = int(b.get("address", addr)) + size


def named_addresses(storages: Iterable[tuple[str, int]]) -> dict[int, list[int]]:
    """(device, data pointer) of the storages a scan reached, as sorted addresses per CUDA device index."""
    out: dict[int, list[int]] = {}
    for device, addr in storages:
        if device.startswith("cuda:") and addr:
            out.setdefault(int(device.partition(":")[2]), []).append(addr)
    for addrs in out.values():
        addrs.sort()
    return out


def _named(addrs: Sequence[int], start: int, size: int) -> bool:
    i = bisect.bisect_left(addrs, start)
    return i < len(addrs) and addrs[i] < start + size


def private_pools(segments: Iterable[Mapping[str, Any]], named: Mapping[int, Sequence[int]] | None = None,
                  compiled: Sequence[str] = ()) -> dict[str, PoolUse]:
    """Per device ("cuda:N"), what its private pools hold; devices without one are absent.

    ``named`` are the addresses of storages a name reaches (``named_addresses``): an allocated block that holds
    one is the user's (a compiled model's output kept in a variable), the rest is the graphs' own.
    """
    named = named or {}
    pools: dict[int, set[tuple[int, int]]] = {}
    reserved: dict[int, int] = {}
    allocated: dict[int, int] = {}
    unnamed: dict[int, int] = {}
    for seg in segments:
        pool = pool_of(seg)
        if pool == DEFAULT_POOL:
            continue
        dev = int(seg.get("device", 0))
        pools.setdefault(dev, set()).add(pool)
        reserved[dev] = reserved.get(dev, 0) + int(seg.get("total_size", 0))
        addrs = named.get(dev, ())
        for start, size, state in _blocks(seg):
            if state != "active_allocated":
                continue
            allocated[dev] = allocated.get(dev, 0) + size
            if not _named(addrs, start, size):
                unnamed[dev] = unnamed.get(dev, 0) + size
    return {f"cuda:{d}": PoolUse(f"cuda:{d}", len(ids), reserved.get(d, 0), allocated.get(d, 0), unnamed.get(d, 0),
                                 tuple(compiled)) for d, ids in sorted(pools.items())}


def compiled_modules(root_types: Mapping[str, str]) -> tuple[str, ...]:
    """The names whose object ``torch.compile`` made (a scan's root types), in order."""
    return tuple(sorted(name for name, t in root_types.items() if t == COMPILED_MODULE))


def pool_lines(segments: Iterable[Mapping[str, Any]] | None, scan: Scan | None) -> tuple[str, ...]:
    """What the CUDA-graph pools hold per device, a line each (``%cudamem status``); the storages the latest
    scan reached are the user's."""
    if not segments:
        return ()
    named = named_addresses((h.device, h.addr) for h in scan.storages.values()) if scan else {}
    found = private_pools(segments, named, compiled_modules(scan.root_types) if scan else ())
    return tuple(f"{u.device}: {fmt_bytes(u.reserved_bytes)} reserved in {u.pools} private pool(s), "
                 f"{fmt_bytes(u.allocated_bytes)} allocated ({fmt_bytes(u.unnamed_bytes)} reached by no name)"
                 + (f"; compiled modules: {', '.join(u.compiled)}" if u.compiled else "") for u in found.values())
