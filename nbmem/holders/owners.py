"""Owners: a report's rows, one per name a user typed, with the tensors under it one call away.

A real model has hundreds of parameters; a list of losses has one tensor per step. A person reads the
first screen of a report, and it has to say *who* holds the memory. So the storages a cell added (or
everything held now) are grouped by their owner, the root of each storage's best path: a variable, an
``Out[n]``, a module's attribute, or the frame of the last exception. Each storage has exactly one
owner, so grouping changes rows, never totals; a graph several owners keep alive is counted under each
and marked. Other roots that reach an owner's memory are "also held by", which is what a cleanup needs
to know (``del model`` frees nothing while ``trainer.model`` is the same object).

Grouping comes before the threshold: 32 new adapter tensors of 64 KiB each under ``model`` are one row
of 2 MiB. The per-storage rows (``findings``) stay available as each owner's members and as the detail.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from nbmem.formatting import fmt_bytes, fmt_count, plural
from nbmem.holders import findings as judge
from nbmem.holders.freeing import Keepers, Needs
from nbmem.holders.graphs import Graph
from nbmem.holders.graphs import sharing as graph_sharing
from nbmem.holders.grouping import Grouped, Key, grouped
from nbmem.holders.naming import MAX_HOLDERS, container, owner_of
from nbmem.holders.scanner import Held, Scan
from nbmem.holders.walk import ROLE_GRAD, ROLE_OPTIM, ROLE_PARAM, ROLE_QUANT
from nbmem.records import HOLDER_KINDS, PAGED, Finding, HolderKind, kind_words, root_name

#: A row that keeps no graph storage: one shared empty mapping (a new one per row would be kept by ``set_of``).
NO_GRAPHS: dict[int, int] = {}

#: Members listed on an owner row (the rest are counted).
MEMBERS_SHOWN = 8
#: Most member paths an owner row's ``holders`` carries.
HOLDERS_KEPT = 16
_CONTAINERS = frozenset({"list", "tuple", "dict", "deque", "set", "frozenset", "OrderedDict", "defaultdict",
                         "ParameterList", "ModuleList", "ParameterDict", "ModuleDict"})


@dataclass(frozen=True)
class Rows:
    """What a scan says at two levels: a row per owner, and a row per storage (the detail)."""

    owners: tuple[Finding, ...]
    details: tuple[Finding, ...] | Callable[[], Sequence[Finding]] = ()  # or how to work them out
    total_bytes: int = 0  # the owners' storages and graphs together, a graph several owners keep counted once

    @cached_property
    def detail(self) -> tuple[Finding, ...]:
        """The per-storage rows, worked out when first asked for: most readers want the owner rows only."""
        d = self.details
        return tuple(d() if callable(d) else d)


def cell_rows(cur: Scan, prev: Scan | None, cell: int, *, threshold_bytes: int, graphs: Mapping[int, Graph],
              lines: Mapping[int, int], changed: Collection[int] | None = None,
              owners_before: Collection[str] | None = None) -> Rows:
    """What ``cell`` added: its owners over the threshold, and the per-storage rows behind them. ``changed``:
    the storages whose records differ between ``prev`` and ``cur`` (``Updates.changed``), when known;
    ``owners_before``: the owners ``prev`` held memory under, when known (both spare a pass over every storage)."""
    c = judge.changes(cur, prev, threshold_bytes=threshold_bytes, graphs=graphs, changed=changed)
    before = prev.storages if prev is not None else {}
    grown: set[str] = set(owners_before) if owners_before is not None else set()

    def added(owner: str, members: Sequence[Held]) -> bool:
        if not grown:  # the owners that held memory before: worked out only if a row asks
            grown.update(h.owner for h in before.values())
        return owner in grown and not any(h.sid in before for h in members)

    rows, total = group(c.candidates, lambda _hs: cell, threshold_bytes=threshold_bytes, graphs=graphs,
                        types=cur.root_types, lost=c.lost, gained=c.gained, lines=lines, added=added,
                        keepers=Keepers(cur.storages, graphs), states=cur.root_state)
    detail = detail_rows(rows, c.candidates, lambda _hs: cell, threshold_bytes=threshold_bytes, graphs=graphs,
                         lost=c.lost, gained=c.gained)
    return Rows(rows, tuple(_with_lines(detail, cur, lines)), total)


def current_rows(cur: Scan, *, threshold_bytes: int, graphs: Mapping[int, Graph],
                 cache: dict[int, Any] | None = None, row_cache: RowCache | None = None,
                 by_owner: Grouped | None = None, keepers: Keepers | None = None) -> Rows:
    """Everything held now, each owner with the cell its memory first appeared in. ``row_cache`` keeps each
    owner's row between calls, reused while its members are the same records; ``by_owner``: ``cur``'s storages
    already grouped (``grouping.Grouping``), so that a cell that changed one owner regroups only it (issue 38);
    ``keepers``: which graphs save each storage, made from these graphs."""
    rows, total = group(by_owner if by_owner is not None else list(cur.storages.values()),
                        lambda hs: min(h.first_cell for h in hs), threshold_bytes=threshold_bytes,
                        graphs=graphs, types=cur.root_types,
                        keepers=keepers if keepers is not None else Keepers(cur.storages, graphs),
                        states=cur.root_state, row_cache=row_cache)
    # Worked out only when asked for (``leaks(detail=True)``); what it reads is the scan the session keeps anyway.
    return Rows(rows, lambda: detail_rows(rows, list(cur.storages.values()), lambda hs: min(h.first_cell for h in hs),
                                          threshold_bytes=threshold_bytes, graphs=graphs, cache=cache), total)


#: An owner with more members than this lists those over the threshold and groups the rest.
DETAIL_MEMBERS = 20


def detail_rows(rows: Sequence[Finding], held: Sequence[Held], cell_of: Callable[[Sequence[Held]], int], *,
                threshold_bytes: int, graphs: Mapping[int, Graph], lost: Mapping[int, Sequence[str]] | None = None,
                gained: Mapping[int, Sequence[str]] | None = None, cache: dict[int, Any] | None = None
                ) -> list[Finding]:
    """The members of each owner row, in the rows' order: every storage of an owner with few, and for one
    with many its storages over the threshold, its containers of small ones, and what is left as one row
    under the owner's name. Together they hold exactly the owner rows' storages: never an empty table
    beneath a full one."""
    kept = {(r.owner, r.device): i for i, r in enumerate(rows)}
    by_row: list[list[Held]] = [[] for _ in rows]
    for h in held:
        i = kept.get((h.owner, h.device))
        if i is not None:
            by_row[i].append(h)
    out: list[Finding] = []
    for row, members in zip(rows, by_row):
        cut = 0 if len(members) <= DETAIL_MEMBERS else threshold_bytes
        rest: list[Held] = []
        found = judge.with_groups(members, cell_of, cut, graphs, lost or {}, cache, gained=gained, left_out=rest)
        if len(rest) == 1:
            found.append(judge.finding(rest[0], cell_of(rest), graphs))
        elif rest:
            f = judge.group_finding(rest, cell_of(rest), graphs)
            if len({h.container for h in rest}) > 1:
                # Small tensors in many places under the owner: one row by the owner's name, whose cleanup
                # is the owner's.
                f = replace(f, name=row.owner, holders=(row.owner,), hint=row.hint)
            found.append(replace(f, id=f"{row.device}:r:{row.owner}"))
        out += found
    return out


class RowCache(dict[tuple[str, str], tuple[tuple[list[Held], dict[int, int], str, Any], Finding]]):
    """(owner, device) -> the row's inputs (its members, kept so that their ids stay theirs; its graphs' saved
    storages; the owner's type; every graph of the scan, as a hint reads them) and the row made from them. And
    which rows share graphs, with the saved storages of each row it was worked out from (a kept list of losses
    and its outputs share thousands: worked out again only when those change)."""

    shared: tuple[dict[Key, set[int]], dict[Key, list[Key]]] | None = None
    graph_reads: tuple[Any, ...] | None = None  # (graphs, their holders' records, what ``_graph_reads`` gave)
    sets: dict[int, tuple[dict[int, int], set[int]]] | None = None  # id of a kept saved dict -> it, its keys

    def set_of(self, saved: dict[int, int]) -> set[int]:
        """The keys of a saved dict ``_graph_reads`` made, as a set, made once while the dict is kept."""
        if self.sets is None:
            self.sets = {}
        hit = self.sets.get(id(saved))
        if hit is None or hit[0] is not saved:
            hit = self.sets[id(saved)] = (saved, set(saved))
        return hit[1]


def _graph_reads(graphs: Mapping[int, Graph], by: Grouped, keepers: Keepers | None, kept: RowCache | None
                 ) -> tuple[Any, dict[Key, dict[int, int]]]:
    """What a hint reads beyond a row's own members (every graph, what it saves, and its holder's paths: by value,
    an id of a record the cache does not keep could be a new record's at the same address), and the graph
    storages each owner's members keep. ``kept``: where both are kept, while the graphs and their holders'
    records are the very same objects (a kept list of losses is not read again each cell)."""
    paths = keepers.storages if keepers is not None else {}
    records = [(by.storages.get(sid), paths.get(sid)) for sid in graphs]
    was = kept.graph_reads if kept is not None else None
    if (was is not None and was[0] is graphs and len(was[1]) == len(records)
            and all(a is c and b is d for (a, b), (c, d) in zip(was[1], records))):
        return was[2], was[3]
    saved_of: dict[Key, dict[int, int]] = {}
    for g, (h, _p) in zip(graphs.values(), records):
        if h is not None:
            saved_of.setdefault((h.owner, h.device), {}).update(g.saved)
    if kept is None:
        return None, saved_of
    key = frozenset((sid, frozenset(g.saved), g.named, _paths_of(p))
                    for (sid, g), (_h, p) in zip(graphs.items(), records))
    kept.graph_reads, kept.sets = (graphs, records, key, saved_of), None
    return key, saved_of


def _paths_of(h: Held | None) -> tuple[Any, ...]:
    """What a hint reads of a graph holder's record: its paths and their kinds."""
    return () if h is None else (h.holders, h.holder_kinds, h.reached_from, h.reached_kinds)


def _same_records(a: list[Held], b: list[Held]) -> bool:
    """Whether two member lists hold the very same records: the same list (a ``Grouping`` makes a new one
    whenever a member changes), or the same objects (``a`` is kept alive by the cache, so its ids are its own)."""
    return a is b or (len(a) == len(b) and frozenset(map(id, a)) == frozenset(map(id, b)))


def group(held: Sequence[Held] | Grouped, cell_of: Any, *, threshold_bytes: int, graphs: Mapping[int, Graph],
          types: Mapping[str, str], lost: Mapping[int, Sequence[str]] | None = None,
          gained: Mapping[int, Sequence[str]] | None = None, lines: Mapping[int, int] | None = None,
          added: Callable[[str, Sequence[Held]], bool] | None = None, keepers: Keepers | None = None,
          states: Mapping[str, str] | None = None,
          row_cache: RowCache | None = None) -> tuple[tuple[Finding, ...], int]:
    """One row per (owner, device) whose storages and graphs together reach the threshold, largest first, the
    state (a model, an optimizer: ``states``) after the rest, and their bytes together (a graph several rows
    keep, once). ``held``: the storages, or the same already grouped (``grouping.Grouping`` keeps a scan's
    groups between cells). ``added(owner, members)``: whether the members are new under an owner that held
    memory before (the words then say "new"); ``keepers``: every holder of the scan, so that hints say what
    else must go; ``states``: the roots that are state.
    ``row_cache`` (only without ``lost``, ``gained``, ``lines``, ``added``): a row whose members are the very
    same records as last time (the scanner makes a new ``Held`` for every storage whose paths changed), with
    the same graphs, type and every graph's saved tensors (what a hint's "what else must go" reads), is the
    same row; a model's thousands of members are not judged again each cell."""
    by = held if isinstance(held, Grouped) else grouped(held)
    graph_key, saved_of = _graph_reads(graphs, by, keepers, row_cache)
    rows: list[Finding] = []
    # (owner, device) -> the graph storages its row keeps, for the rows that keep any: keyed by owner, not by the
    # row's place, so that a row without a graph coming and going (``x`` made, then deleted) changes nothing.
    saved_by: dict[Key, set[int]] = {}
    place: dict[Key, int] = {}
    sizes: dict[int, int] = {}  # those storages' bytes
    for (owner, device), grp in by.groups.items():
        members = grp.members
        saved = saved_of.get((owner, device), NO_GRAPHS)
        if grp.nbytes + sum(saved.values()) < threshold_bytes:
            continue
        inputs = (members, saved, types.get(owner, ""), graph_key)
        was = row_cache.get((owner, device)) if row_cache is not None else None
        if was is not None and was[0][1:] == inputs[1:] and _same_records(was[0][0], members):
            row = was[1]
        else:
            row = _row(owner, device, members, saved, cell_of(members), graphs, types, lost or {}, gained or {},
                       lines or {}, added is not None and added(owner, members), keepers)
        if row_cache is not None:
            row_cache[owner, device] = (inputs, row)
        if states and states.get(owner):
            row = replace(row, state=states[owner])
        elif states and any(n in states for n in row.roots):
            # A leak only state also reaches (a hook's closure in a model): one click never deletes the state.
            kept = [n for n in row.roots if n in states]
            row = replace(row, roots=tuple(n for n in row.roots if n not in states),
                          hint=f"{row.hint} (`{'`, `'.join(kept)}`: the cell's state, which `--last-report` keeps)")
        if saved:
            saved_by[owner, device] = row_cache.set_of(saved) if row_cache is not None else set(saved)
            sizes.update(saved)
        place[owner, device] = len(rows)
        rows.append(row)
    if row_cache is not None:
        for key in [k for k in row_cache if k not in by.groups]:
            del row_cache[key]
    _mark_shared(rows, saved_by, place, row_cache)
    total = sum(r.storage_bytes for r in rows) + sum(sizes.values())
    # What no cell meant to keep comes first: a 13 GB model listed above a 600 MB leak hides the mistake.
    order = sorted(range(len(rows)), key=lambda i: (bool(rows[i].state), -rows[i].bytes))
    return tuple(rows[i] for i in order), total


def _row(owner: str, device: str, members: list[Held], saved: Mapping[int, int], cell: int,
         graphs: Mapping[int, Graph], types: Mapping[str, str], lost: Mapping[int, Sequence[str]],
         gained: Mapping[int, Sequence[str]], lines: Mapping[int, int], added: bool = False,
         keepers: Keepers | None = None) -> Finding:
    members.sort(key=lambda h: (-h.nbytes, h.sid))
    first = members[0]
    kind = first.kind
    # A finding for the members shown only: a model has thousands, and the rest are counted, not listed.
    order = sorted(members, key=lambda h: -(h.nbytes + judge.graph_bytes(graphs, h.sid)))
    rows = [_with_line(judge.finding(h, cell, graphs, lost.get(h.sid, ()), gained.get(h.sid, ())), lines.get(h.sid))
            for h in order[:MEMBERS_SHOWN]]
    shown = tuple(rows)
    also = _also(owner, members)
    roots = tuple(dict.fromkeys(n for h in members for n in judge.deletable(h)))
    if kind is HolderKind.NAMESPACE and owner.isidentifier():
        roots = (owner, *(n for n in roots if n != owner))
    holders = tuple(dict.fromkeys(p for f in rows for p in f.holders))[:HOLDERS_KEPT]
    graph_bytes = sum(saved.values())
    words = describe(owner, kind, members, graph_bytes, types.get(owner, ""), new=added)
    if len(members) == 1:
        hint = shown[0].hint
    else:
        hint = _hint(owner, kind, members, graph_bytes, also, lost, gained)
    needs = keepers.needs(owner, members) if keepers is not None and kind is HolderKind.NAMESPACE else None
    clears: tuple[str, ...] = ()
    if needs is not None and owner.isidentifier():
        roots = needs.names
        clears = tuple(w for w, on in (("outputs", needs.outputs), ("traceback", needs.traceback)) if on)
        shown_out = list(dict.fromkeys(n for h in members for n in gained.get(h.sid, ())))
        if shown_out and needs.outputs:  # an element was displayed: deleting the owner leaves the output
            hint = (f"displayed, so the output history ({', '.join(shown_out)}) now also holds it: `del {owner}` "
                    f"alone frees nothing; `%cudamem clean {_needs_args(needs)}` removes both")
        plain = not any(lost.get(h.sid) or gained.get(h.sid) for h in members) and not any(
            ".<lru_cache>" in h.name for h in members)
        if plain and not Keepers.owner_alone(owner, needs):
            hint = _needs_hint(owner, needs, also, graph_bytes, len(members))
        elif plain and any(k is HolderKind.OUTPUT for h in members for k in h.reached_kinds):
            # The output history binds the same tensor: nbmem's delete takes IPython's references with the name.
            outs = [o for o, k in also if k is HolderKind.OUTPUT] or ["Out"]
            hint = (f"the output history ({outs[0]}) also holds it: `del {owner}` alone frees nothing; "
                    f"`%cudamem clean {owner}` removes both")
        elif plain and graph_bytes and f"`del {owner}` frees it" not in hint:
            hint = f"{_graph_words(graph_bytes, len(members))}, or `del {owner}` frees it"
    if device.startswith(PAGED) and kind is HolderKind.NAMESPACE:
        hint = paged_hint(owner)
    line = next((lines[h.sid] for h in order if h.sid in lines), None)
    return Finding(cell, owner, holders, kind, device, sum(h.nbytes for h in members), graph_bytes,
                   any(h.holds_graph for h in members), len(members),
                   shown[0].view_bytes if len(members) == 1 else None, (), hint, roots, f"{device}:o:{owner}", line,
                   owner=owner, description=words, members=shown,
                   more_bytes=sum(h.nbytes + judge.graph_bytes(graphs, h.sid) for h in order[MEMBERS_SHOWN:]),
                   also_held_by=tuple(o for o, _k in also), also_clears=clears)


def _with_line(f: Finding, line: int | None) -> Finding:
    return replace(f, line=line) if line is not None else f


def _with_lines(found: Sequence[Finding], cur: Scan, lines: Mapping[int, int]) -> list[Finding]:
    if not lines:
        return list(found)
    out = []
    for f in found:
        _dev, _, sid = f.id.partition(":")
        out.append(_with_line(f, lines.get(int(sid)) if sid.isdigit() else None))
    return out


Also = tuple[tuple[str, HolderKind], ...]


def _also(owner: str, members: Sequence[Held]) -> Also:
    """Other owners reaching some of this memory, with their kinds: variables and module attributes first,
    then the output history's most lasting name, then the last exception's frames (each frame once)."""
    seen: dict[str, HolderKind] = {}
    for h in members:
        for r, k in zip(h.reached_from, h.reached_kinds):
            o = owner_of(r)
            if o != owner and o not in seen:
                seen[o] = k
    names = [(o, k) for o, k in seen.items() if k is HolderKind.NAMESPACE or k is HolderKind.MODULE]
    outputs = [(o, k) for o, k in seen.items() if k is HolderKind.OUTPUT]
    frames = [(o, k) for o, k in seen.items() if k is HolderKind.TRACEBACK]
    return tuple([*names, *outputs[:1], *frames])[:MAX_HOLDERS]


def _frees_alone(owner: str, members: Sequence[Held]) -> int:
    """Bytes that deleting the owner alone would free: members no other root reaches."""
    return sum(h.nbytes for h in members if all(owner_of(r) == owner for r in h.reached_from))


def _hint(owner: str, kind: HolderKind, members: Sequence[Held], graph_bytes: int, also: Also,
          lost: Mapping[int, Sequence[str]], gained: Mapping[int, Sequence[str]]) -> str:
    """What frees an owner's memory, in one line a user can act on."""
    gone = list(dict.fromkeys(n for h in members for n in lost.get(h.sid, ())))
    through = _common_prefix([h.name for h in members])
    if gone:
        return (f"{', '.join(f'`{n}`' for n in gone)} was deleted or rebound, but "
                f"{judge.still_holds(kind, through or owner)}")
    if kind is not HolderKind.NAMESPACE or all(".<lru_cache>" in h.name for h in members):
        return judge.hint_for(members[0], graph_bytes, group=len(members))
    shown = list(dict.fromkeys(n for h in members for n in gained.get(h.sid, ())))
    if shown:
        return (f"displayed, so the output history ({', '.join(shown)}) now also holds it: `del {owner}` alone "
                f"frees nothing; `%cudamem clean {owner}` removes both")
    alone = _frees_alone(owner, members)
    total = sum(h.nbytes for h in members)
    if also and alone < total:
        frees = "nothing" if alone == 0 else f"{fmt_bytes(alone)} of it"
        return f"`del {owner}` frees {frees}: {_also_text(also)} → `%cudamem clean {_clean_args(owner, also)}`"
    if graph_bytes:
        return (f"{len(members):,} tensors keep their autograd graphs ({fmt_bytes(graph_bytes)}): keep numbers "
                f"(`.item()`) or `.detach()` instead, or `del {owner}`")
    if any(ROLE_PARAM in h.roles for h in members):
        move = f", or `{owner}.cpu()` moves it" if members[0].device.startswith("cuda") else ""
        grads = "; `opt.zero_grad(set_to_none=True)` frees its gradients" if any(
            ROLE_GRAD in h.roles for h in members) else ""
        return f"`del {owner}` frees it{move}{grads}"
    return f"`del {owner}` frees it" if owner.isidentifier() else ""


def _needs_hint(owner: str, needs: Needs, also: Also, graph_bytes: int, count: int) -> str:
    """What frees a row that deleting its owner alone does not: each other holder named, the graphs that
    saved it included, and the one command that removes them all."""
    graph = f"{_graph_words(graph_bytes, count)}; " if graph_bytes else ""
    frees = "nothing" if needs.alone_bytes == 0 else f"only {fmt_bytes(needs.alone_bytes)} of it"
    why = [_also_text(also)] if also else []
    if needs.shared:
        more = f" and {plural(len(needs.shared) - 1, 'more tensor')}" if len(needs.shared) > 1 else ""
        why.append(f"its graph is shared with `{needs.shared[0]}`{more}, so it goes with "
                   f"`{owner_of(root_name(needs.shared[0]))}`")
    saved_by = [(m, k) for m, k in needs.saved_by
                if not any(root_name(k) == root_name(o) for o in needs.shared)]  # said already: "goes with"
    if saved_by:
        member, keeper = saved_by[0]
        # ``saved_by`` pairs each member with each graph that saved it: say how many tensors and graphs those are
        tensors, graphs = len({m for m, _k in saved_by}), len({k for _m, k in saved_by})
        more = (f" (and {plural(tensors - 1, 'more of its tensors', 'more of its tensors')}"
                f"{f', by {graphs:,} graphs in all' if graphs > 1 else ''})" if tensors > 1 else
                f" (and by {plural(graphs - 1, 'more graph')})" if graphs > 1 else "")
        why.append(f"`{member}` is also saved by the graph of `{keeper}`{more}, so it goes with "
                   f"`{owner_of(root_name(keeper))}`")
    if not why:  # a holder `also` leaves out (a second frame, a later output): the command still names it
        why.append("other holders keep it too")
    return f"{graph}`del {owner}` frees {frees}: {'; '.join(why)} → `%cudamem clean {_needs_args(needs)}`"


def _graph_words(graph_bytes: int, count: int) -> str:
    if count > 1:
        return (f"{count:,} tensors keep their autograd graphs ({fmt_bytes(graph_bytes)}): keep numbers (`.item()`) "
                f"or `.detach()` instead")
    return f"it holds its autograd graph ({fmt_bytes(graph_bytes)}): keep `.item()` or `.detach()` instead"


def _needs_args(needs: Needs) -> str:
    flags = [flag for flag, on in (("--outputs", needs.outputs), ("--traceback", needs.traceback)) if on]
    modules = [f"(and set {m} to None)" for m in needs.modules]
    return " ".join([*needs.names, *flags, *modules])


def _also_text(also: Also) -> str:
    """"also held by `trainer`, the output history (Out[5]) and the last exception's frames"."""
    # Each holder in its kind's words (records.HOLDER_KINDS), variables first, then one output, the frames once.
    words = list(dict.fromkeys(kind_words(k, "holds", o) for o, k in sorted(also, key=lambda a: a[1] is
                                                                             HolderKind.TRACEBACK)))
    return "also held by " + (", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else words[0])


def _clean_args(owner: str, also: Also) -> str:
    """What ``%cudamem clean`` needs to free all of it: the variables, and the hidden holders' flags."""
    cleans = [(o, HOLDER_KINDS[k].cleans) for o, k in also]
    names = [owner, *(o for o, c in cleans if c == "names" and o.isidentifier())]
    flags = [f"--{flag}" for flag in ("outputs", "traceback") if any(c == flag for _o, c in cleans)]
    modules = [f"(and set {o} to None)" for o, c in cleans if not c]
    return " ".join([*names, *flags, *modules])


def _common_prefix(paths: Sequence[str]) -> str:
    """The longest path every member path starts with, cut at a step (``trainer.model``)."""
    if not paths:
        return ""
    prefix = paths[0]
    for p in paths[1:]:
        while prefix and not (p == prefix or p.startswith(prefix + ".") or p.startswith(prefix + "[")):
            cut = container(prefix)
            prefix = "" if cut == prefix else cut
    return prefix


def describe(owner: str, kind: HolderKind, members: Sequence[Held], graph_bytes: int, type_name: str, *,
             new: bool = False) -> str:
    """What an owner holds, in words: "Sequential: 42M parameters", "list of 30 tensors + their graphs";
    ``new``: what a cell added to an owner that was there before ("PeftModel: 524K new parameters"); memory a
    paged optimizer keeps in CUDA managed memory says so."""
    words = _describe(owner, kind, members, graph_bytes, type_name, new=new)
    if members and members[0].device.startswith(PAGED):
        return f"{words}, in paged memory (CUDA managed memory, outside PyTorch's allocator)"
    return words


def paged_hint(owner: str) -> str:
    """What frees a paged optimizer's state: bitsandbytes makes it with ``cudaMallocManaged`` and never frees
    it (its tensors do not own the memory, and its page manager keeps them all), so deleting gives none back."""
    return (f"bitsandbytes never frees paged memory: `del {owner}` gives none of it back; restarting the kernel "
            f"does. Torch's figures leave it out; nvidia-smi counts it while it is on the GPU")


def _describe(owner: str, kind: HolderKind, members: Sequence[Held], graph_bytes: int, type_name: str, *,
              new: bool = False) -> str:
    fresh = "new " if new else ""
    graph = f" + their graphs ({fmt_bytes(graph_bytes)})" if graph_bytes and len(members) > 1 else (
        f" + its graph ({fmt_bytes(graph_bytes)})" if graph_bytes else "")
    if kind is HolderKind.TRACEBACK:
        names = sorted({p.split(">.", 1)[1] for h in members for p in h.holders
                        if owner_of(p) == owner and ">." in p})
        frame = owner.removeprefix("<traceback ").removesuffix(">")
        locals_ = f": {', '.join(names[:4])}{' …' if len(names) > 4 else ''}" if names else ""
        return f"locals of {frame} kept by the last exception{locals_}{graph}"
    params = [h for h in members if ROLE_PARAM in h.roles]
    if params:
        n = sum(h.elements for h in params)
        trainable = sum(h.elements for h in params if h.trainable)
        train = f" ({fmt_count(trainable)} trainable)" if 0 < trainable < 0.99 * n else (
            " (frozen)" if trainable == 0 and n else "")
        packed = {h.dtype for h in params if h.dtype in PACKED_4BIT}
        four = sum(h.elements for h in params if h.dtype in PACKED_4BIT)
        if four:
            fmt = "/".join(sorted(packed))
            train += f", in 4 bits ({fmt})" if four >= 0.99 * n else f", {fmt_count(four)} of them in 4 bits ({fmt})"
        extra = [w for w, role in (("gradients", ROLE_GRAD), ("optimizer state", ROLE_OPTIM))
                 if any(role in h.roles for h in members)]
        rest = len(members) - len(params) - sum(1 for h in members if h.roles & {ROLE_GRAD, ROLE_OPTIM, ROLE_QUANT}
                                                and ROLE_PARAM not in h.roles)
        if rest > 0:
            extra.append(f"{rest:,} other tensor{'s' if rest > 1 else ''}")
        head = f"{type_name}: " if type_name else ""
        return f"{head}{fmt_count(n)} {fresh}parameters{train}" + "".join(f", {e}" for e in extra) + graph
    optim = sum(1 for h in members if ROLE_OPTIM in h.roles)
    grads = sum(1 for h in members if ROLE_GRAD in h.roles and ROLE_OPTIM not in h.roles)
    if (optim or grads) and len(members) > 1:
        rest = len(members) - optim - grads
        parts = [f"{what} ({n:,} {fresh}tensor{'s' if n > 1 else ''})"
                 for what, n in (("optimizer state", optim), ("gradients", grads)) if n]
        parts += [f"{rest:,} other tensor{'s' if rest > 1 else ''}"] if rest else []
        return f"{type_name + ': ' if type_name else ''}{', '.join(parts)}{graph}"
    if type_name == "_lru_cache_wrapper":
        return f"results cached by {owner}(): {len(members):,} tensor{'s' if len(members) > 1 else ''}{graph}"
    if len(members) == 1:
        h = members[0]
        words = tensor_words(h)
        path = h.name
        return (f"`{path}`: {words}" if path != owner and root_name(path) == root_name(owner) else words) + graph
    noun = fresh + ("scalars" if all(h.elements <= 1 for h in members) else "tensors")
    if type_name in _CONTAINERS:
        return f"{type_name} of {len(members):,} {noun}{graph}"
    if type_name:
        return f"{type_name} holding {len(members):,} {noun}{graph}"
    return f"{len(members):,} {noun}{graph}"


#: The formats bitsandbytes packs two weights a byte in (``Params4bit``'s ``quant_type``).
PACKED_4BIT = frozenset({"nf4", "fp4"})


def tensor_words(h: Held) -> str:
    """One tensor as a person reads it: ``float32 [4096, 1024]``, or a view of a bigger storage."""
    if not h.dtype:
        shape = "tensor"
    elif not h.shape:
        shape = f"{h.dtype} scalar"
    else:
        shape = f"{h.dtype} [{', '.join(map(str, h.shape))}]"
    if judge.is_view(h):
        return f"{shape}: a {fmt_bytes(h.span_bytes)} view of a {fmt_bytes(h.nbytes)} storage"
    return shape


def _mark_shared(rows: list[Finding], saved_by: dict[Key, set[int]], place: Mapping[Key, int],
                 kept: RowCache | None = None) -> None:
    """A graph whose saved tensors several owners keep alive is named under each of them (``place``: each owner's
    row). ``kept``: where the last sharing worked out is kept, reused while the owners' saved storages are the
    same (rows without a graph may come and go)."""
    # In order too: each owner's others are listed in the rows' order, which can change while the sets do not.
    if kept is not None and kept.shared is not None and list(kept.shared[0].items()) == list(saved_by.items()):
        shared = kept.shared[1]
    else:
        shared = graph_sharing(saved_by)
        if kept is not None:
            kept.shared = (saved_by, shared)
    for key, others in shared.items():
        names = tuple(rows[place[k]].name for k in others)[:MAX_HOLDERS]
        rows[place[key]] = replace(rows[place[key]], graph_shared_with=names)
