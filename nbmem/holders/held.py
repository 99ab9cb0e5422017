"""The records a scan is made of: one ``Held`` per live storage, a ``Scan`` of them all, and what changed.

Records hold numbers and names, never the objects they describe. ``Records`` is the scanner's live set: it
keeps the per-device totals as records come and go, and ``Updates`` which records each update replaced or
dropped, so that a cell's findings look at those and not at a model's thousands that stayed the same (issue 38).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from nbmem.holders.naming import owner_of
from nbmem.records import HolderKind, root_name

CHANGES_KEPT = 16  # updates whose changed storages a scanner remembers (a cell takes one to three)
_SCANNERS = itertools.count(1)  # each scanner's serial: a scan of one is never compared as another's


@dataclass(frozen=True, slots=True)
class Held:
    """One live storage and the paths that reach it, best first."""

    sid: int  # the scanner's identity for the storage object
    device: str
    nbytes: int  # what the allocator counts: 512-byte blocks on CUDA
    holders: tuple[str, ...]
    holder_kinds: tuple[HolderKind, ...]  # the kind of each holder path
    kind: HolderKind
    holds_graph: bool
    span_bytes: int  # the largest holder tensor's own size; less than nbytes for a view
    roles: frozenset[str] = frozenset()
    first_cell: int = 0
    addr: int = 0  # the storage's data pointer when first seen (CUDA: matches the allocator's trace)
    container: str = ""  # the first holder without its last step: where a group of small tensors lives
    reached_from: tuple[str, ...] = ()  # every root with a path to it, the owner (the best path's root) first
    reached_kinds: tuple[HolderKind, ...] = ()  # the kind of each of those roots
    elements: int = 0  # elements of its largest tensor
    trainable: bool = False  # its tensor requires grad (a parameter being trained)
    shape: tuple[int, ...] = ()  # its largest tensor's shape and dtype, for words ("float32 [4096, 1024]")
    dtype: str = ""
    # Worked out once, with the record (each cell reads them for a model's thousands of records, issue 38):
    # the name a user typed that reaches it best: a variable, ``Out[4]``, a module attribute, or the frame of
    # the last exception (``<traceback f>``: its locals are one owner); and every root name that reaches it, from
    # all its paths, not only the few kept as holders (a model also reached through a trainer is the model's).
    owner: str = field(init=False, repr=False, compare=False)
    roots: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "owner", owner_of(self.reached_from[0] if self.reached_from else self.name))
        object.__setattr__(self, "roots", frozenset(root_name(p) for p in (*self.holders, *self.reached_from)))

    @property
    def name(self) -> str:
        return self.holders[0] if self.holders else "?"


@dataclass(frozen=True)
class Scan:
    """The state of the notebook at one moment: live storages by id, with totals per device."""

    storages: Mapping[int, Held]
    totals: Mapping[str, int]
    objects: int = 0
    seconds: float = 0.0
    walked: tuple[str, ...] = ()  # roots walked this time (the rest came from the cache)
    unfinished: tuple[str, ...] = ()  # roots the time budget stopped
    errors: int = 0  # objects skipped because reading them failed
    error_types: tuple[str, ...] = ()
    root_types: Mapping[str, str] = field(default_factory=dict)  # root path -> its object's type name
    root_state: Mapping[str, str] = field(default_factory=dict)  # root path -> what state it is ("model", ...)
    serial: tuple[int, int] = (0, 0)  # (its scanner, its update): what ``Updates.changed`` compares; 0: unknown
    graph_holders: tuple[int, ...] | None = None  # the storages that hold a graph, in ``storages``' order; None: ask

    def holding_graphs(self) -> list[int]:
        """The storages whose tensors keep an autograd graph, in the scan's order."""
        if self.graph_holders is not None:
            return list(self.graph_holders)
        return [sid for sid, h in self.storages.items() if h.holds_graph]

    @property
    def truncated(self) -> bool:
        return bool(self.unfinished)


class Updates:
    """Which storages each of a scanner's last updates replaced or dropped: what two scans differ by."""

    def __init__(self) -> None:
        self.serial = next(_SCANNERS)
        self.count = 0
        self._touched: deque[tuple[int, frozenset[int]]] = deque(maxlen=CHANGES_KEPT)  # (update, its storages)

    def record(self, sids: Iterable[int]) -> tuple[int, int]:
        """One more update, which changed the records of ``sids``; its serial, for its ``Scan``."""
        self.count += 1
        self._touched.append((self.count, frozenset(sids)))
        return self.serial, self.count

    def changed(self, prev: Scan | None, cur: Scan) -> frozenset[int] | None:
        """The storages whose records may differ between two of this scanner's scans (every other storage has
        the very same ``Held`` in both), or None when that is not known: a scan of another scanner, or one
        older than the last ``CHANGES_KEPT`` updates."""
        (s0, u0), (s1, u1) = prev.serial if prev is not None else (0, 0), cur.serial
        if s0 != self.serial or s1 != self.serial or u0 > u1:
            return None
        steps = [t for u, t in self._touched if u0 < u <= u1]
        return frozenset().union(*steps) if len(steps) == u1 - u0 else None


class Records:
    """The latest record of every live storage, by id, with the bytes per device kept as records change."""

    def __init__(self) -> None:
        self.held: dict[int, Held] = {}  # read freely; changed only through put and drop
        self._totals: dict[str, list[int]] = {}  # device -> [bytes, records]
        self._changed: set[int] = set()
        self._graphed: set[int] = set()  # the records that hold a graph
        self._since: dict[int, int] = {}  # when each record came into ``held``: its place in the dict's order
        self._puts = 0

    def put(self, h: Held) -> None:
        """Set a storage's record; one equal to the record it has leaves that one in place (a list walked again
        because it grew: its old elements keep their records, and nothing downstream judges them again)."""
        old = self.held.get(h.sid)
        if old is not None:
            if old == h:
                return
            self._count(old, -1)
        else:
            self._puts += 1
            self._since[h.sid] = self._puts
        (self._graphed.add if h.holds_graph else self._graphed.discard)(h.sid)
        self.held[h.sid] = h  # a storage seen before keeps its place: scans list storages in the order first seen
        self._count(h, 1)
        self._changed.add(h.sid)

    def drop(self, sid: int) -> None:
        h = self.held.pop(sid, None)
        if h is not None:
            self._count(h, -1)
            self._changed.add(sid)
            self._graphed.discard(sid)
            del self._since[sid]

    def graph_holders(self) -> tuple[int, ...]:
        """The records that hold a graph, in ``held``'s order (each record's place is when it came in)."""
        return tuple(sorted(self._graphed, key=self._since.__getitem__))

    def take_changed(self) -> set[int]:
        """The storages whose records were set or dropped since the last call."""
        out, self._changed = self._changed, set()
        return out

    def _count(self, h: Held, sign: int) -> None:
        t = self._totals.setdefault(h.device, [0, 0])
        t[0] += sign * h.nbytes
        t[1] += sign
        if not t[1]:
            del self._totals[h.device]

    def totals(self) -> dict[str, int]:
        """Bytes per device of every record (a device with a record has an entry, even of 0 bytes)."""
        return {dev: t[0] for dev, t in self._totals.items()}
