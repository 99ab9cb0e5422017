"""A scan's storages by owner, kept between scans: a cell that changed a few storages regroups those few.

A notebook that holds a 48-layer encoder and its optimizer has thousands of storages under two owners; a
cell that appends one tensor to a list changes one of them. ``owners.group`` reads each owner's members,
their bytes and the graphs among them; ``Grouping`` keeps those from one scan to the next and redoes only
the owners whose members changed (issue 38). Records only: a ``Held`` names a storage, it holds no object.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from nbmem.holders.held import Held, Scan

#: (owner, device): the key of an owner row.
Key = tuple[str, str]


class Group:
    """One owner's storages on one device, with what every reader of them sums."""

    __slots__ = ("first", "members", "nbytes")

    def __init__(self, members: list[Held]) -> None:
        self.members = members  # a new list whenever a member changes: a reader may keep it to compare
        self.nbytes = sum(h.nbytes for h in members)
        self.first = min(h.sid for h in members)  # its oldest storage: owners come in the order they appeared


@dataclass(frozen=True)
class Grouped:
    """Storages grouped by owner, oldest owner first, and every member by its id (to place a graph's holder)."""

    groups: Mapping[Key, Group]
    storages: Mapping[int, Held]


def grouped(held: Iterable[Held]) -> Grouped:
    """Some storages, grouped now."""
    lists: dict[Key, list[Held]] = {}
    by_sid: dict[int, Held] = {}
    for h in held:
        lists.setdefault((h.owner, h.device), []).append(h)
        by_sid[h.sid] = h
    return Grouped(_ordered({k: Group(v) for k, v in lists.items()}), by_sid)


def _ordered(groups: Mapping[Key, Group]) -> dict[Key, Group]:
    """Oldest owner first, however the groups were made: rows of equal bytes, and the names a shared graph
    lists, come out the same from a regrouping and from a fresh grouping."""
    return dict(sorted(groups.items(), key=lambda kv: kv[1].first))


class Grouping:
    """Every storage of the latest scan it was given, by owner; brought up to a newer scan from the storage ids
    whose records changed in between (``Updates.changed``), or regrouped whole when those are not known."""

    def __init__(self) -> None:
        self.scan: Scan | None = None
        self._members: dict[Key, dict[int, Held]] = {}
        self._groups: dict[Key, Group] = {}
        self._grouped = Grouped({}, {})

    def of(self, cur: Scan, changed: Collection[int] | None) -> Grouped:
        """``cur``'s storages by owner. ``changed``: the storages whose records differ between the scan this
        grouping was last given and ``cur`` (None: not known, so everything is regrouped)."""
        if self.scan is cur:
            return self._grouped
        if self.scan is None or changed is None:
            self._members = {}
            for sid, h in cur.storages.items():
                self._members.setdefault((h.owner, h.device), {})[sid] = h
            self._groups = {k: Group(list(d.values())) for k, d in self._members.items()}
        else:
            prev = self.scan.storages
            # Until this edit is done, the members are half-way: an interrupt (Ctrl-C as a cell ends) must leave a
            # grouping that regroups everything next time, not one that replays these changes on top of them.
            self.scan = None
            dirty: set[Key] = set()
            for sid in changed:
                old, new = prev.get(sid), cur.storages.get(sid)
                if old is new:
                    continue
                if old is not None:
                    k = (old.owner, old.device)
                    d = self._members[k]
                    del d[sid]
                    if not d:
                        del self._members[k]
                    dirty.add(k)
                if new is not None:
                    k = (new.owner, new.device)
                    self._members.setdefault(k, {})[sid] = new
                    dirty.add(k)
            for k in dirty:
                now = self._members.get(k)
                if now:
                    self._groups[k] = Group(list(now.values()))
                else:
                    self._groups.pop(k, None)
        self.scan = cur
        self._grouped = Grouped(_ordered(self._groups), cur.storages)
        return self._grouped
