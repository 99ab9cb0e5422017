"""Judging: which storages are worth a user's attention, and what to say about them.

Pure functions over scans. ``findings`` is what a cell added (new storages, and memory whose name was
deleted while something else keeps it); ``current`` is everything held now. Each storage over the
threshold is a finding with a hint fitted to its holder; containers of small tensors are grouped, and a
graph several findings keep alive is named under each of them. ``owners`` groups these per owner.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from nbmem.formatting import fmt_bytes
from nbmem.holders.graphs import Graph, sharing
from nbmem.holders.naming import MAX_HOLDERS, OPTIMIZER_STEP, container
from nbmem.holders.scanner import Held, Scan
from nbmem.holders.walk import ROLE_GRAD, ROLE_OPTIM, ROLE_PARAM
from nbmem.records import (
    CUDA_BLOCK_BYTES,
    ROTATING_OUTPUTS,
    Finding,
    HolderKind,
    is_output_name,
    kind_words,
    root_name,
)


def deletable(h: Held) -> tuple[str, ...]:
    """The top-level variables among the holders: what ``del`` would remove to free the storage."""
    names = {root_name(p) for p, k in (*zip(h.holders, h.holder_kinds), *zip(h.reached_from, h.reached_kinds))
             if k is HolderKind.NAMESPACE}
    return tuple(sorted(n for n in names if n.isidentifier() and not is_output_name(n)))


def hint_for(h: Held, graph_bytes: int, *, lost: Sequence[str] = (), shared: Sequence[str] = (),
             group: int = 0, gained: Sequence[str] = ()) -> str:
    """One line that says why the memory is held and what frees it, fitted to the kind of holder."""
    name = h.name
    if lost:
        return f"{', '.join(f'`{n}`' for n in lost)} was deleted or rebound, but {still_holds(h.kind, name)}"
    if gained:
        names = [n for n in deletable(h) if n.isidentifier()]
        what = f"`del {names[0]}` alone frees nothing; `%cudamem clean {names[0]}` removes both" if names else (
            "`%cudamem clean --outputs` frees it")
        return f"displayed, so the output history ({', '.join(gained)}) now also holds it: {what}"
    if ".<lru_cache>" in name:
        fn = name.split(".<lru_cache>", 1)[0]
        return f"a result cached by `{fn}` (functools.lru_cache): `{fn}.cache_clear()` frees it"
    if h.kind is not HolderKind.NAMESPACE:  # an output, a frame, a module's attribute: each kind's own words
        graph = f" (with its autograd graph, {fmt_bytes(graph_bytes)})" if graph_bytes else ""
        return kind_words(h.kind, "kept", name, graph)
    if shared:
        return (f"its autograd graph is shared with {', '.join(shared)}: free both (keep `.item()` or "
                f"`.detach()` instead) or little comes back")
    if group:
        where = container(name)
        if graph_bytes:
            return (f"{group:,} small tensors and their graphs ({fmt_bytes(graph_bytes)}) in `{where}`: keep "
                    f"numbers (`.item()`) or `.detach()` instead, or clear it")
        return f"{group:,} small tensors in `{where}`: clear it, or `del {root_name(where)}`"
    if ROLE_GRAD in h.roles and name.endswith(".grad"):
        return "a gradient: `opt.zero_grad(set_to_none=True)` frees gradients between steps"
    roots = sorted({root_name(p) for p in h.holders})
    if ROLE_PARAM in h.roles:
        if OPTIMIZER_STEP.search(name):  # no module path reaches it: its model is gone, the optimizer is not
            return (f"a parameter only `{root_name(name)}` still holds (its model was deleted or rebound): "
                    f"delete `{root_name(name)}` or make it again for the new model")
        others = [r for r in deletable(h) if r != root_name(name)]
        also = f", also held by {', '.join(others)}" if others else ""
        if HolderKind.TRACEBACK in h.holder_kinds:
            also += " and the last exception's frames (`%cudamem clean --traceback`)"
        move = f", or `{root_name(name)}.cpu()` moves it" if h.device.startswith("cuda") else ""
        return f"part of `{root_name(name)}`{also}: deleting {'them' if also else 'it'} frees it{move}"
    if ROLE_OPTIM in h.roles:
        return f"optimizer state: it lives as long as `{root_name(name)}` does"
    if graph_bytes:
        return f"holds its autograd graph ({fmt_bytes(graph_bytes)}): keep `.item()` or `.detach()` instead"
    if len(roots) > 1:
        return f"held by {len(roots)} names ({', '.join(roots)}): deleting one frees nothing"
    return f"`del {roots[0]}` frees it" if roots and roots[0].isidentifier() else ""


def still_holds(kind: HolderKind, path: str) -> str:
    """"… but X still holds it: <what frees it>", for each kind of holder, with a step a user can take."""
    return kind_words(kind, "still", path)


def is_view(h: Held) -> bool:
    """Whether its tensors span less than the storage (a slice of a bigger tensor keeps all of it)."""
    slack = CUDA_BLOCK_BYTES if h.device.startswith("cuda") else 1
    return h.span_bytes + slack <= h.nbytes


def graph_bytes(graphs: Mapping[int, Graph], sid: int) -> int:
    """The bytes of the autograd graph a storage keeps alive (0 when it keeps none)."""
    g = graphs.get(sid)
    return g.nbytes if g else 0


def finding(h: Held, cell: int, graphs: Mapping[int, Graph], lost: Sequence[str] = (),
            gained: Sequence[str] = ()) -> Finding:
    """One storage as a row: its best name, its bytes (and its graph's), and a hint."""
    gb = graph_bytes(graphs, h.sid)
    return Finding(cell, h.name, h.holders, h.kind, h.device, h.nbytes, gb, h.holds_graph, 1,
                   h.span_bytes if is_view(h) else None, (), hint_for(h, gb, lost=lost, gained=gained), deletable(h),
                   f"{h.device}:{h.sid}", owner=h.owner)


def group_finding(members: Sequence[Held], cell: int, graphs: Mapping[int, Graph]) -> Finding:
    """A container of small tensors, as one finding; a graph its members share is counted once."""
    first = min(members, key=lambda h: h.sid)
    container = first.container
    saved: dict[int, int] = {}
    for h in members:
        g = graphs.get(h.sid)
        if g is not None:
            saved.update(g.saved)
    gb = sum(saved.values())
    return Finding(cell, container, (container,), first.kind, first.device, sum(h.nbytes for h in members), gb,
                   any(h.holds_graph for h in members), len(members), None, (), hint_for(first, gb, group=len(members)),
                   deletable(first), f"{first.device}:g{first.sid}", owner=first.owner)


def with_groups(candidates: Sequence[Held], cell: Callable[[Sequence[Held]], int], threshold: int,
                 graphs: Mapping[int, Graph], lost: Mapping[int, Sequence[str]],
                 cache: dict[int, tuple[Held, int, Finding]] | None = None, *,
                 gained: Mapping[int, Sequence[str]] | None = None, left_out: list[Held] | None = None
                 ) -> list[Finding]:
    """Findings for storages over the threshold, and for containers of small ones that together pass it.

    ``cache`` keeps the finding of a storage whose record and graph did not change since the last call;
    ``left_out``, when given, receives the candidates no finding covers.
    """
    out: list[Finding] = []
    members: dict[int, Held] = {}
    small: dict[tuple[str, str, HolderKind], list[Held]] = {}
    rest: list[Held] = [] if left_out is None else left_out
    for h in candidates:
        gb = graph_bytes(graphs, h.sid)
        if h.nbytes + gb >= threshold:
            hit = cache.get(h.sid) if cache is not None else None
            if hit is not None and hit[0] is h and hit[1] == gb:
                f = hit[2]
            else:
                f = finding(h, cell([h]), graphs, lost.get(h.sid, ()), (gained or {}).get(h.sid, ()))
                if cache is not None:
                    cache[h.sid] = (h, gb, f)
            members[id(f)] = h
            out.append(f)
        elif h.holders and h.container != h.name:
            small.setdefault((h.container, h.device, h.kind), []).append(h)
        else:
            rest.append(h)
    for group in small.values():
        gf = group_finding(group, cell(group), graphs) if len(group) > 1 else None
        if gf is not None and gf.bytes >= threshold:
            out.append(gf)
        else:
            rest += group
    _mark_shared(out, members, graphs)
    out.sort(key=lambda f: -f.bytes)
    return out


def _mark_shared(out: list[Finding], members: Mapping[int, Held], graphs: Mapping[int, Graph]) -> None:
    """A graph whose saved tensors several findings keep alive is named under each of them."""
    saved_by: dict[int, Iterable[int]] = {}
    for i, f in enumerate(out):
        h = members.get(id(f))
        g = graphs.get(h.sid) if h is not None else None
        if g is not None:
            saved_by[i] = g.saved
    shared = sharing(saved_by)
    for i, others in shared.items():
        f = out[i]
        names = tuple(out[j].name for j in others)[:MAX_HOLDERS]
        out[i] = replace(f, graph_shared_with=names, hint=hint_for(members[id(f)], f.graph_bytes, shared=names))


@dataclass(frozen=True)
class Changes:
    """The storages a cell changed, and why each is news."""

    candidates: list[Held]
    lost: dict[int, list[str]]  # storage id -> names deleted or rebound while something else keeps it
    gained: dict[int, list[str]]  # storage id -> output-history names it gained (``Out[5]``, ``_5``)


def changes(cur: Scan, prev: Scan | None, *, threshold_bytes: int, graphs: Mapping[int, Graph],
            changed: Collection[int] | None = None) -> Changes:
    """What a cell changed: new storages; memory whose variable was deleted while something else keeps it;
    memory the output history now also keeps (``x`` displayed: ``del x`` alone no longer frees it).

    A new storage that took the place of a freed one under the same path, no larger (a rebinding to a
    same-size tensor, a gradient re-created by the next step), is not news, unless it keeps an autograd
    graph of ``threshold_bytes`` or more (``loss`` of an evaluation run without ``no_grad``); nor is a
    new name for memory that was already there (a loop variable bound to the last batch): it adds
    nothing. A variable that reached the memory only through an object another name still holds (an
    iterator over a dataset still named) kept nothing of its own: losing it is not news either.

    ``changed``, when known (``Updates.changed``): the storages whose records differ between the two scans;
    the others are the same records, so only these are looked at (a model's thousands are not, issue 38).
    """
    prev_storages = prev.storages if prev is not None else {}
    looked = _looked(cur.storages, changed)
    # What was under a new storage's paths and is gone now (what it may have replaced): a path names one object
    # in a scan, and a storage gone since ``prev`` is one whose record changed, so only those are looked up.
    new_paths = {p for sid, h in looked if sid not in prev_storages for p in h.holders}
    prev_at: dict[str, Held] = {}
    gone = (prev_storages.values() if changed is None else
            (prev_storages[sid] for sid in changed if sid in prev_storages and sid not in cur.storages))
    for r in gone if new_paths else ():
        for p in r.holders:
            if p in new_paths:
                prev_at.setdefault(p, r)
    out = Changes([], {}, {})
    for sid, h in looked:
        before = prev_storages.get(sid)
        if before is h:
            continue  # a storage nobody re-walked: the same record, nothing new
        if before is None:
            replaced = [prev_at[x] for x in h.holders if x in prev_at]
            g = graphs.get(sid)
            if g is not None and g.nbytes >= threshold_bytes:  # `loss` rebound to a loss that keeps its graph
                out.candidates.append(h)
            elif not any(r.sid not in cur.storages and r.nbytes >= h.nbytes for r in replaced):
                out.candidates.append(h)
            continue
        lost = [r for r in sorted(set(deletable(before)) - h.roots)
                if not all(_through_kept(p, h.holders) for p in before.holders if root_name(p) == r)]
        gained = [r for r in _kept_outputs(h) if r not in _kept_outputs(before)]
        if lost:
            out.lost[sid] = lost
        if gained and h.kind is not HolderKind.OUTPUT:
            out.gained[sid] = gained
        if lost or sid in out.gained:
            out.candidates.append(h)
    return out


def _kept_outputs(h: Held) -> list[str]:
    """The output history's lasting names for a storage: ``Out[n]`` and ``_n`` (``_`` moves on by itself)."""
    return [r for r, k in zip(h.reached_from, h.reached_kinds)
            if k is HolderKind.OUTPUT and (r.startswith("Out[") or (is_output_name(r) and r not in ROTATING_OUTPUTS))]


def findings(cur: Scan, prev: Scan | None, cell: int, *, threshold_bytes: int,
             graphs: Mapping[int, Graph], found: Changes | None = None) -> list[Finding]:
    """What ``cell`` added, a row per storage over the threshold (containers of small ones grouped)."""
    c = found or changes(cur, prev, threshold_bytes=threshold_bytes, graphs=graphs)
    return with_groups(c.candidates, lambda _hs: cell, threshold_bytes, graphs, c.lost, gained=c.gained)


def _through_kept(lost: str, kept: Sequence[str]) -> bool:
    """Whether ``lost`` went through an object a kept holder starts from.

    ``dataiter._dataset.tensors[0]`` and ``trainset.tensors[0]``: ``dataiter._dataset`` is ``trainset``
    (the same steps from there reach the same storage), so deleting ``dataiter`` could never free it.
    """
    start = len(root_name(lost))
    for k in kept:
        rest = k[len(root_name(k)):]
        if rest and lost.endswith(rest) and len(lost) - len(rest) > start:
            return True
    return False


def _looked(storages: Mapping[int, Held], changed: Collection[int] | None) -> list[tuple[int, Held]]:
    """The records to look at, oldest storage first (a cell's rows come out in one order however they were
    found): those of ``changed`` still in ``storages``, or every one when that is not known."""
    return [(sid, storages[sid]) for sid in sorted(storages if changed is None else changed) if sid in storages]


def graph_candidates(cur: Scan, prev: Scan | None, changed: Collection[int] | None = None) -> list[int]:
    """Storages whose graphs a cell's findings may need: new ones, and those whose holders changed.
    ``changed``: as for ``changes``."""
    prev_storages = prev.storages if prev is not None else {}
    out = []
    for sid, h in _looked(cur.storages, changed):
        before = prev_storages.get(sid)
        if h.holds_graph and before is not h and (before is None or before.roots != h.roots):
            out.append(sid)
    return out


def current(cur: Scan, *, threshold_bytes: int, graphs: Mapping[int, Graph],
            cache: dict[int, tuple[Held, int, Finding]] | None = None) -> list[Finding]:
    """Everything held now above the threshold (containers of small tensors as groups), with its cell."""
    if cache is not None:
        for sid in [s for s in cache if s not in cur.storages]:
            del cache[sid]
    return with_groups(list(cur.storages.values()), lambda hs: min(h.first_cell for h in hs), threshold_bytes,
                        graphs, {}, cache)
