"""What deleting names frees: every holder of a row's memory, the autograd graphs that save it included.

A hint that says "`del x` frees it" must be true when it is printed. ``x`` may also be reached from other
names (``alias = x``), from the output history or the last exception's frames, and, out of sight of any
name, from the graph of a tensor that saved it for backward (``loss = model(x).sum()`` saves ``x``: it lives
as long as ``loss`` does). ``needs`` follows all of these to a fixed point: the names, flags and module
attributes that must all go for every byte of a row (its storages and the graph storages it alone keeps)
to come back, and how much deleting the owner alone gives back. Pure: over the scan's records and graphs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nbmem.holders.graphs import Graph
from nbmem.holders.scanner import Held
from nbmem.records import HOLDER_KINDS, HolderKind, is_output_name, root_name


@dataclass(frozen=True)
class Needs:
    """Everything that must go for a row's memory to be freed, the owner first."""

    names: tuple[str, ...]  # top-level variables to delete
    outputs: bool = False  # the output history holds some of it
    traceback: bool = False  # the last exception's frames do
    modules: tuple[str, ...] = ()  # module attributes to set to None (no cleanup step removes them)
    saved_by: tuple[tuple[str, str], ...] = ()  # (a member's name, a tensor whose graph saves it)
    shared: tuple[str, ...] = ()  # other tensors whose graphs keep the same saved tensors as the members'
    alone_bytes: int = 0  # what deleting the owner alone frees


class Keepers:
    """For one scan: which tensors' graphs save each storage."""

    def __init__(self, storages: Mapping[int, Held], graphs: Mapping[int, Graph],
                 saved_in: dict[int, list[int]] | None = None) -> None:
        """``saved_in``: the index below, as it was made from these very graphs before (it is kept between cells)."""
        self.storages = storages
        self.graphs = graphs
        self.saved_in: dict[int, list[int]] = {} if saved_in is None else saved_in
        for holder, g in graphs.items() if saved_in is None else ():
            for s in (*g.saved, *g.named):
                self.saved_in.setdefault(s, []).append(holder)

    def needs(self, owner: str, members: Sequence[Held]) -> Needs:
        """What must go for all of ``members`` (and the graph storages they keep) to be freed."""
        must: dict[int, Held] = {h.sid: h for h in members}
        mine = set(must)
        todo = list(members)
        saved_by: dict[tuple[str, str], None] = {}
        shared: dict[str, None] = {}
        for h in members:  # a graph another tensor shares keeps its saved storages until both go
            g = self.graphs.get(h.sid)
            for u in g.saved if g is not None else ():
                for k in self.saved_in.get(u, ()):
                    kh = self.storages.get(k)
                    if kh is not None and k not in must:
                        must[k] = kh
                        todo.append(kh)
                        shared.setdefault(kh.name)
        names: dict[str, None] = {owner: None} if owner.isidentifier() else {}
        outputs = traceback = False
        modules: dict[str, None] = {}
        i = 0
        while i < len(todo):  # in order: the names come out as the rows' own holders rank them
            h = todo[i]
            i += 1
            # A variable bound to the very tensor an output holds takes that output with it when nbmem deletes
            # it (IPython's references to the same object go too): no flag is needed for it.
            bare = any(k is HolderKind.NAMESPACE and p.isidentifier() for p, k in zip(h.holders, h.holder_kinds))
            for r, kind in zip(h.reached_from, h.reached_kinds):
                cleans = HOLDER_KINDS[kind].cleans  # what frees a holder of this kind
                if cleans == "names":
                    n = root_name(r)
                    if n.isidentifier() and not is_output_name(n):
                        names.setdefault(n)
                elif cleans == "outputs":
                    outputs = outputs or not (bare and r in h.holders)
                elif cleans == "traceback":
                    traceback = True
                else:  # nothing nbmem deletes: a module's attribute, set to None by the user
                    modules.setdefault(r)
            for k in self.saved_in.get(h.sid, ()):
                kh = self.storages.get(k)
                if kh is None or k == h.sid:
                    continue
                if h.sid in mine and kh.owner != owner:
                    saved_by.setdefault((h.name, kh.name))
                if k not in must:
                    must[k] = kh
                    todo.append(kh)
        return Needs(tuple(names), outputs, traceback, tuple(modules), tuple(saved_by), tuple(shared),
                     self.alone(owner, members))

    def alone(self, owner: str, members: Sequence[Held]) -> int:
        """Bytes ``del owner`` alone frees: members only the owner reaches and no graph outside them saves,
        and the graph storages only those members' graphs keep."""
        freed = {h.sid: h for h in members
                 if h.reached_from and all(k is HolderKind.NAMESPACE and root_name(r) == owner
                                           for r, k in zip(h.reached_from, h.reached_kinds))}
        changed = True
        while changed:  # a member saved by the graph of a member that stays, stays
            changed = False
            for sid in list(freed):
                if any(k not in freed for k in self.saved_in.get(sid, ()) if k != sid):
                    del freed[sid]
                    changed = True
        total = sum(h.nbytes for h in freed.values())
        counted: set[int] = set()
        for sid in freed:
            g = self.graphs.get(sid)
            for u, n in (g.saved.items() if g is not None else ()):
                if u not in counted and all(k in freed for k in self.saved_in.get(u, ())):
                    counted.add(u)
                    total += n
        return total

    @staticmethod
    def owner_alone(owner: str, n: Needs) -> bool:
        """Whether ``del owner`` alone frees every byte of a row with these needs."""
        return n.names == (owner,) and not (n.outputs or n.traceback or n.modules)
