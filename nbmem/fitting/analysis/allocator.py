"""A model of PyTorch's CUDA caching allocator: what it will *reserve* for a sequence of requests.

Out-of-memory is decided by the allocator's segments, not by allocated bytes: 512-byte blocks, a small pool
of 2 MiB segments for requests up to 1 MiB, a large pool of 20 MiB segments (below 10 MiB) or 2 MiB-rounded
ones, best fit with its splitting rules, and on a failed cudaMalloc every whole cached segment given back and
one retry. ``CachingAllocatorModel`` replays requests through those rules from a snapshot of the real
segments (``segments_from_snapshot``), so what a notebook already holds, and its fragmentation, count.
Pure: no torch import. Constants from c10/cuda/CUDACachingAllocator.cpp, default settings.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nbmem.records import block_bytes

# -- the caching allocator's constants (c10/cuda/CUDACachingAllocator.cpp, default settings) ----------------
SMALL_REQUEST_BYTES = 1 << 20  # kSmallSize: blocks up to 1 MiB come from the small pool
SMALL_SEGMENT_BYTES = 2 << 20  # kSmallBuffer: the small pool's segments
LARGE_SEGMENT_BYTES = 20 << 20  # kLargeBuffer: blocks of 1-10 MiB get a 20 MiB segment to share
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc: from here a segment is the block, rounded up
LARGE_ROUND_BYTES = 2 << 20  # kRoundLarge
MIN_BLOCK_BYTES = 512  # kMinBlockSize: a small block is split when at least this much is left


def segment_bytes(block: int) -> int:
    """The segment cudaMalloc is asked for when no cached block can take a block of ``block`` bytes."""
    if block <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if block < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-block // LARGE_ROUND_BYTES) * LARGE_ROUND_BYTES



# -- the allocator's state before the fit ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SegmentState:
    """One cudaMalloc'd segment as a snapshot shows it; ``blocks`` are (address, bytes, allocated)."""

    address: int
    total_bytes: int
    stream: int
    small: bool
    blocks: tuple[tuple[int, int, bool], ...]
    usable: bool = True  # False: a CUDA graph's private pool, counted as reserved but never allocated from


def segments_from_snapshot(snapshot: Iterable[Mapping[str, Any]], device: int) -> tuple[SegmentState, ...]:
    """``torch.cuda.memory_snapshot()``'s segments on one device, as the allocator model takes them."""
    out = []
    for s in snapshot:
        if int(s.get("device", device)) != device:
            continue
        blocks = tuple((int(b["address"]), int(b["size"]), b.get("state") != "inactive") for b in s.get("blocks", ()))
        pool = tuple(s.get("segment_pool_id", (0, 0)) or (0, 0))
        out.append(SegmentState(int(s["address"]), int(s["total_size"]), int(s.get("stream", 0)),
                                s.get("segment_type") == "small", blocks, usable=pool == (0, 0)))
    return tuple(out)



# -- the allocator model -------------------------------------------------------------------------------------------
class _Block:
    __slots__ = ("addr", "allocated", "next", "pool", "prev", "size")

    def __init__(self, addr: int, size: int, pool: tuple[bool, int], prev: _Block | None = None,
                 nxt: _Block | None = None, allocated: bool = False) -> None:
        self.addr = addr
        self.size = size
        self.pool = pool
        self.prev = prev
        self.next = nxt
        self.allocated = allocated


class CachingAllocatorModel:
    """PyTorch's CUDA caching allocator (native backend, default settings), for one device, in bytes only.

    Blocks are 512-byte multiples; blocks up to 1 MiB come from a small pool of 2 MiB segments, larger ones
    from a large pool (blocks under 10 MiB get a 20 MiB segment, larger ones their size rounded up to 2 MiB).
    A request takes the smallest free block of its pool and stream that is big enough (lowest address on a
    tie) and splits it when what is left is at least 512 bytes (small pool) or more than 1 MiB (large pool);
    a freed block merges with free neighbours in its segment. When no free block fits, a new segment must fit
    under ``capacity_bytes``; if it does not, every whole cached segment is given back and it is tried once
    more (``release_cached_blocks``), and only then is it out of memory.

    Ties between free blocks of one size go to the lowest address, and real addresses are cudaMalloc's: the
    model places new segments above all others (the snapshot's too), or with ``descending`` below them, the two
    ends of what the driver may do.
    """

    def __init__(self, capacity_bytes: float, segments: Sequence[SegmentState] = (), *,
                 descending: bool = False) -> None:
        self.capacity_bytes = capacity_bytes
        self.descending = descending
        self.reserved_bytes = 0
        self.allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self.peak_allocated_bytes = 0
        self.segment_allocs = 0
        self.releases = 0
        # Large requests with more than one free block of the best size. Without one, the large pool's choices
        # are the same in either order; the small pool's ties are not counted (they decide which 2 MiB segments
        # stay, and through the reserved total, rarely, when the cache is released: well inside the margin).
        self.ties = 0
        self._pools: dict[tuple[bool, int], list[tuple[int, int]]] = {}
        self._free: dict[int, _Block] = {}
        self._live: dict[int, _Block] = {}
        self._next_addr = (1 << 62) if descending else (1 << 60)  # above any real device address
        for seg in segments:
            self._adopt(seg)
        if descending and segments:
            self._next_addr = min(seg.address for seg in segments)  # real addresses: ~2^47, room below
        self.peak_reserved_bytes = self.reserved_bytes
        self.peak_allocated_bytes = self.allocated_bytes

    def _adopt(self, seg: SegmentState) -> None:
        self.reserved_bytes += seg.total_bytes
        if not seg.usable:
            self.allocated_bytes += seg.total_bytes  # never handed out, never released: as good as allocated
            return
        pool = (seg.small, seg.stream)
        prev: _Block | None = None
        for addr, size, allocated in seg.blocks:
            b = _Block(addr, size, pool, prev, allocated=allocated)
            if prev is not None:
                prev.next = b
            prev = b
            if allocated:
                self._live[addr] = b
                self.allocated_bytes += size
            else:
                self._free[addr] = b
                insort(self._pools.setdefault(pool, []), (size, addr))

    def malloc(self, size: int, stream: int = 0) -> int | None:
        """The address of a new block for a request of ``size`` bytes, or None: out of memory."""
        need = block_bytes(size)
        small = need <= SMALL_REQUEST_BYTES
        key = (small, stream)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = []
        i = bisect_left(pool, (need, -1))
        n = len(pool)
        if i < n:
            if not small and i + 1 < n and pool[i + 1][0] == pool[i][0]:
                self.ties += 1
            _, addr = pool.pop(i)
            b = self._free.pop(addr)
        else:
            seg = segment_bytes(need)
            if self.reserved_bytes + seg > self.capacity_bytes:
                self.release_cached()
                if self.reserved_bytes + seg > self.capacity_bytes:
                    return None
            if self.descending:
                self._next_addr -= seg + LARGE_ROUND_BYTES
            b = _Block(self._next_addr, seg, key)
            if not self.descending:
                self._next_addr += seg + LARGE_ROUND_BYTES
            self.reserved_bytes += seg
            self.segment_allocs += 1
            if self.reserved_bytes > self.peak_reserved_bytes:
                self.peak_reserved_bytes = self.reserved_bytes
        rest = b.size - need
        if rest >= MIN_BLOCK_BYTES if small else rest > SMALL_REQUEST_BYTES:
            r = _Block(b.addr + need, rest, key, b, b.next)
            if b.next is not None:
                b.next.prev = r
            b.next = r
            b.size = need
            self._free[r.addr] = r
            insort(pool, (rest, r.addr))
        b.allocated = True
        self._live[b.addr] = b
        self.allocated_bytes += b.size
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        return b.addr

    def free(self, addr: int) -> None:
        """Give a block back to its pool, merged with the free blocks beside it."""
        b = self._live.pop(addr)
        b.allocated = False
        self.allocated_bytes -= b.size
        pool = self._pools[b.pool]
        p = b.prev
        if p is not None and not p.allocated:
            self._unpool(p, pool)
            p.size += b.size
            p.next = b.next
            if b.next is not None:
                b.next.prev = p
            b = p
        n = b.next
        if n is not None and not n.allocated:
            self._unpool(n, pool)
            b.size += n.size
            b.next = n.next
            if n.next is not None:
                n.next.prev = b
        self._free[b.addr] = b
        insort(pool, (b.size, b.addr))

    def _unpool(self, b: _Block, pool: list[tuple[int, int]]) -> None:
        del self._free[b.addr]
        del pool[bisect_left(pool, (b.size, b.addr))]

    def release_cached(self) -> int:
        """Give back every segment that is one whole free block (``empty_cache``); the bytes released."""
        released = 0
        for pool in self._pools.values():
            keep = []
            for size, addr in pool:
                b = self._free[addr]
                if b.prev is None and b.next is None:
                    del self._free[addr]
                    released += size
                else:
                    keep.append((size, addr))
            pool[:] = keep
        self.reserved_bytes -= released
        self.releases += 1
        return released
