"""The holder scan over time: what each root held, and every live storage by identity.

Between scans the ``Scanner`` keeps, per root, what it held (storage ids and paths) and, per storage, a
weak reference to the storage object itself: that is the identity, so an address the allocator reuses
is not mistaken for the old tensor. A monitored cell re-walks only the roots it could have changed
(new or rebound names, containers whose size changed, names its code mentions); the engine's allocator
accounting asks for more when memory moved that those walks do not explain.

Walking is ``walk``'s, naming ``naming``'s and judging ``findings``'s; this module keeps state, and a
scan keeps no strong reference to a user object once it returns.
"""

from __future__ import annotations

import functools
import gc
import math
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import compress
from typing import Any

from nbmem.holders import intent, reach
from nbmem.holders.graphs import Graph, GraphState, walk_graph
from nbmem.holders.held import Held, Records, Scan, Updates
from nbmem.holders.naming import MAX_HOLDERS, PathBuilder, container, container_first, ranker
from nbmem.holders.reached import module_names, state_reached
from nbmem.holders.walk import ROLE_OPTIM, ROLE_PARAM, Root, Walk
from nbmem.records import HolderKind, block_bytes, root_name


@dataclass
class _RootState:
    sig: tuple[int, int, int]
    kind: HolderKind
    type_name: str
    state: str  # intent.py: "model", "optimizer", ..., "holds a model, an optimizer" (what it reaches), or ""
    holds: dict[int, list[str]]  # storage id -> paths from this root
    tensors: list[tuple[weakref.ref[Any], int, int]]  # (tensor, its storage's id, id of its grad storage or 0)
    objects: int
    seconds: float
    finished: bool


@dataclass
class _StorageState:
    ref: weakref.ref[Any]
    device: str
    nbytes: int
    first_cell: int
    addr: int = 0
    span: int = 0
    elements: int = 0
    trainable: bool = False
    shape: tuple[int, ...] = ()
    dtype: str = ""
    roles: set[str] = field(default_factory=set)
    graph_tensor: weakref.ref[Any] | None = None
    graph: GraphState | None = None  # walked once, on demand; saved storages are re-checked weakly
    view_paths: set[str] = field(default_factory=set)  # paths to a tensor spanning less than the storage
    module_paths: set[str] = field(default_factory=set)  # paths whose last step is a module's attribute
    obj_id: int = 0  # id() of the storage object: its ``Storages.by_obj`` entry, dropped when it ends


def _gone(died: deque[int], sid: int, _ref: Any) -> None:
    died.append(sid)


class Storages:
    """Every storage seen, by identity: an id per storage object, checked through a weak reference."""

    def __init__(self) -> None:
        self.states: dict[int, _StorageState] = {}
        self.by_obj: dict[int, int] = {}  # id(storage object) -> sid
        self._next = 1
        self._died: deque[int] = deque()  # storages whose objects went, as their weak references tell
        self._told = 0  # how many of those were taken from the queue
        self._graph_totals: tuple[Any, ...] | None = None  # (scan, what it read, the storages that was, the totals)
        self.graphed: set[int] = set()  # storages whose graphs were walked (``_StorageState.graph``)

    def sid(self, storage: Any, device: str, nbytes: int, cell: int) -> int:
        sid = self.by_obj.get(id(storage))
        if sid is not None:
            st = self.states.get(sid)
            if st is not None and st.ref() is storage:
                return sid
        sid = self._next
        self._next += 1
        try:
            addr = int(storage.data_ptr())
        except Exception:
            addr = 0
        tell = functools.partial(_gone, self._died, sid)  # keeps the queue, not these storages
        self.states[sid] = _StorageState(weakref.ref(storage, tell), device, nbytes, cell, addr, obj_id=id(storage))
        self.by_obj[id(storage)] = sid
        return sid

    def known(self, storage: Any) -> int | None:
        """The id of a storage seen before and still alive, or None."""
        sid = self.by_obj.get(id(storage))
        st = self.states.get(sid) if sid is not None else None
        return sid if st is not None and st.ref() is storage else None

    def ends(self) -> int:
        """How many storages have ended so far, told or not yet: equal counts, no storage ended in between."""
        return self._told + len(self._died)

    def alive(self, sid: int) -> bool:
        st = self.states.get(sid)
        return st is not None and st.ref() is not None

    def graph_totals(self, scan: Scan, updates: Updates | None = None) -> dict[str, int]:
        """Bytes per device of the walked graphs still alive that no storage of ``scan`` is, each storage once.
        With ``updates`` (the scanner's), the last answer stands while no storage ended, no graph was walked
        again, and none of the graphs' storages or those they save came into or left a scan since (issue 38)."""
        key = (self.ends(), {sid: self.states[sid].graph for sid in self.graphed})
        was = self._graph_totals
        if was is not None and updates is not None and was[1] == key:
            changed = updates.changed(was[0], scan)
            if changed is not None and was[2].isdisjoint(changed):
                self._graph_totals = (scan, *was[1:])
                return dict(was[3])
        held = scan.storages
        seen: set[int] = set()
        out: dict[str, int] = {}
        for sid in [s for s in self.graphed if s in held]:  # not every storage: those with a graph
            st = self.states.get(sid)
            if st is None or st.graph is None:
                continue
            for g, (dev, n) in st.graph.saved.items():
                if g in seen or g in held or not self.alive(g):
                    continue
                seen.add(g)
                out[dev] = out.get(dev, 0) + n
        read = frozenset(self.graphed).union(*(gs.saved for gs in key[1].values() if gs is not None))
        self._graph_totals = (scan, key, read, out)
        return dict(out)

    def forget_dead(self, everything: bool = False) -> list[int]:
        """Drop the storages whose objects are gone: those their weak references told of (a cell that freed
        nothing costs nothing here, however many storages there are), or, with ``everything``, all checked."""
        dead = []
        while self._died:
            sid = self._died.popleft()
            self._told += 1
            st = self.states.get(sid)
            if st is not None and st.ref() is None:
                dead.append(sid)
        if everything:
            dead = [sid for sid, st in self.states.items() if st.ref() is None]
        for sid in dead:
            k = self.states.pop(sid).obj_id
            self.graphed.discard(sid)
            if self.by_obj.get(k) == sid:  # not a later storage's at the same address
                del self.by_obj[k]
        return dead


class Scanner:
    """The holder scan over time: what each root held, and every storage by identity (weakly)."""

    def __init__(self, torch: Callable[[], Any]) -> None:
        self._torch = torch
        self.type_cache = reach.TypeCache()  # per type: how a walk reads it (shared with fits' walks)
        self.known_names = intent.KnownNames()  # the state_dict keys of the modules walked so far
        self._sig_types = reach.TypeCache()  # per type: how `signature` reads an instance's size
        self._roots: dict[str, _RootState] = {}
        self.storages = Storages()
        self._paths: dict[int, dict[str, tuple[HolderKind, str]]] = {}  # sid -> path -> (kind, root path)
        self._records = Records()
        self._held = self._records.held  # every storage's latest record (changed through _records)
        self._walked_this_cell: set[str] = set()  # roots walked since the last update that was not a follow-up
        self._watchers: dict[int, dict[str, weakref.ref[Any]]] = {}  # id(tensor) -> roots that reach it
        self.last: Scan | None = None
        self.updates = Updates()  # which storages each update changed: ``scanner.updates.changed(prev, cur)``

    # -- roots ------------------------------------------------------------------------------------------
    def _set_root(self, path: str, rs: _RootState | None) -> set[int]:
        """Replace what one root holds; returns the storages whose holder lists changed."""
        dirty: set[int] = set()
        old = self._roots.pop(path, None)
        if old is not None:
            for sid, ps in old.holds.items():
                d = self._paths.get(sid)
                if d is not None:
                    for p in ps:
                        d.pop(p, None)
                dirty.add(sid)
            for ref, _sid, _g in old.tensors:
                t = ref()
                watching = self._watchers.get(id(t)) if t is not None else None
                if watching is not None:
                    watching.pop(path, None)
                    if not watching:
                        del self._watchers[id(t)]
        if rs is not None:
            self._roots[path] = rs
            for sid, ps in rs.holds.items():
                d = self._paths.setdefault(sid, {})
                for p in ps:
                    d[p] = (rs.kind, path)
                dirty.add(sid)
            for ref, _sid, _g in rs.tensors:
                t = ref()
                if t is not None:
                    self._watchers.setdefault(id(t), {})[path] = ref
        return dirty

    def _also_reaching(self, w: Walk, now: Mapping[str, tuple[Root, tuple[int, int, int]]],
                       done: set[str]) -> list[Root]:
        """Roots not walked yet that also reach a tensor under which this walk found a new storage.

        ``model.weight.grad`` appears under ``model`` and, through the same parameter, under ``opt``:
        walking the root the cell mentioned must not leave the other one's paths out.
        """
        out: dict[str, Root] = {}
        for f in w.found:
            p = w.parent[f.node]
            sid = self.storages.by_obj.get(id(f.storage))
            if p < 0 or (sid is not None and sid in self._held):
                continue
            parent = w.keep[p]
            for path, ref in self._watchers.get(id(parent), {}).items():
                if ref() is parent and path not in done and path in now:
                    out[path] = now[path][0]
        return list(out.values())

    # -- the update ------------------------------------------------------------------------------------
    def update(self, roots: Sequence[Root], *, cell: int, walk: str = "changed", mentioned: Iterable[str] = (),
               budget_s: float | None = None, validate: bool = True) -> Scan:
        """Scan the notebook now and keep the result.

        ``walk``: "all" re-walks every root; "changed" only new, rebound or resized roots, roots the
        cell's code mentions, and (with ``validate``) cached roots whose tensors changed storage or
        gradient; "invalid" only those cached roots; "rest" every root the previous update did not walk
        (each later mode is what the engine asks for when the earlier one left memory unexplained).
        """
        t0 = time.perf_counter()
        deadline = None if budget_s is None else t0 + budget_s
        torch = self._torch()
        if torch is None:
            self.last = Scan({}, {}, seconds=time.perf_counter() - t0)
            return self.last
        TB = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase
        dead = self.storages.forget_dead(everything=walk == "all")
        for sid in dead:
            self._paths.pop(sid, None)
            self._records.drop(sid)
        mentioned = set(mentioned)
        walked_before = set(self._walked_this_cell) if walk == "rest" else set()
        now: dict[str, tuple[Root, tuple[int, int, int]]] = {}
        for r in roots:
            if r.path not in now:
                now[r.path] = (r, signature(r.obj, self._sig_types))
        dirty: set[int] = set()
        for gone in [p for p in self._roots if p not in now]:
            dirty |= self._set_root(gone, None)
        with torch._C.DisableTorchFunction():
            todo = self._todo(now, walk, mentioned, walked_before, validate, TB)
            w = Walk(torch, self.type_cache, deadline)
            unfinished: list[str] = []
            walked: list[str] = []
            per_root: dict[int, tuple[bool, int, float]] = {}
            while todo:
                for r in todo:
                    if w.stopped:
                        unfinished.append(r.path)
                        continue
                    ts = time.perf_counter()
                    done, n = w.run_root(r)
                    per_root[len(w.roots) - 1] = (done, n, time.perf_counter() - ts)
                    (walked if done else unfinished).append(r.path)
                todo = [] if w.stopped else self._also_reaching(w, now, {*walked, *unfinished})
            for path, rs in self._absorb(w, now, per_root, cell).items():
                dirty |= self._set_root(path, rs)
        for path in unfinished:
            if path in self._roots:
                self._roots[path].finished = False  # what the last full walk of it knew, marked as such
        self._remerge(dirty)
        serial = self.updates.record(self._records.take_changed())
        if walk in ("all", "changed"):
            self._walked_this_cell = set()
        self._walked_this_cell.update(walked)
        kinds = tuple(f"{k} x{n}" for k, n in sorted(w.error_types.items()))
        types_ = {p: rs.type_name for p, rs in self._roots.items() if rs.holds}
        state = {p: rs.state for p, rs in self._roots.items() if rs.state}
        self.last = Scan(dict(self._held), self._records.totals(), w.objects, time.perf_counter() - t0, tuple(walked),
                         tuple(unfinished), w.errors, kinds, types_, state, serial, self._records.graph_holders())
        return self.last

    def _todo(self, now: Mapping[str, tuple[Root, tuple[int, int, int]]], walk: str, mentioned: set[str],
              walked_before: set[str], validate: bool, TB: Any) -> list[Root]:
        """The roots this update walks, cheapest first (a budget spent on one huge root must not starve
        the rest)."""
        todo: list[Root] = []
        for path, (r, sig) in now.items():
            rs = self._roots.get(path)
            if walk == "all" or rs is None or not rs.finished or rs.sig != sig or rs.kind != r.kind:
                todo.append(r)
            elif walk == "rest":
                if path not in walked_before:
                    todo.append(r)
            elif walk == "invalid":
                if not still_valid(rs, self.storages, TB):
                    todo.append(r)
            elif root_name(path) in mentioned or (validate and not still_valid(rs, self.storages, TB)):
                todo.append(r)
        todo.sort(key=lambda r: (root_name(r.path) not in mentioned,
                                 self._roots[r.path].seconds if r.path in self._roots else 0.0))
        return todo

    def _absorb(self, w: Walk, now: Mapping[str, tuple[Root, tuple[int, int, int]]],
                per_root: Mapping[int, tuple[bool, int, float]], cell: int) -> dict[str, _RootState]:
        """The walk's tensors as per-root state: storage ids, paths, and handles to re-check them by."""
        sid_of_node: dict[int, int] = {}
        partial: set[int] = set()  # nodes of tensors that span less than their storage
        for f in w.found:
            n = int(f.storage.nbytes())
            if f.span < n:
                partial.add(f.node)
            if f.device.startswith("cuda"):
                n = block_bytes(n)
            sid = self.storages.sid(f.storage, f.device, n, cell)
            sid_of_node[f.node] = sid
            st = self.storages.states[sid]
            if st.nbytes != n:  # resized in place (`resize_`, an `out=` that grew it): the same storage, bigger
                st.nbytes = n
            if f.span > st.span or not st.dtype:
                st.span = max(st.span, f.span)
                _describe(st, f.tensor, w.TB)
            elif f.role == ROLE_PARAM:
                st.trainable = _requires_grad(f.tensor, w.TB)  # frozen or unfrozen since (a LoRA wrapper)
            if f.logical is not None:  # a 4-bit weight: the weights its packed bytes stand for
                st.shape, st.dtype = f.logical
                st.elements = math.prod(st.shape)
            if f.role:
                st.roles.add(f.role)
            if f.grad_fn and (st.graph_tensor is None or st.graph_tensor() is None):
                st.graph_tensor = weakref.ref(f.tensor)
        fresh = _fresh_roots(w, now, per_root, self.storages.states, sid_of_node, self.known_names)

        def tensor_name(t: Any) -> str:
            node = w.node_of.get(id(t))
            sid = sid_of_node.get(node) if node is not None else None
            held = self._held.get(sid) if sid is not None else None
            if held is not None and held.holders:  # the name it already has (model.0.weight)
                return held.holders[0]
            if node is not None:
                got = [(p, w.roots[i].kind) for i, p in PathBuilder(w, lambda _t: "<tensor>").paths(node)]
                if got:
                    return min(got, key=ranker(set()))[0]
            return "<tensor>"

        names = PathBuilder(w, tensor_name)
        for f in w.found:
            sid = sid_of_node[f.node]
            watch = None if f.ephemeral else (weakref.ref(f.tensor), sid, self._grad_sid(f.tensor, w.TB))
            watched: set[int] = set()
            views = self.storages.states[sid].view_paths
            modules = self.storages.states[sid].module_paths
            via: dict[str, int] = {}
            for i, path in names.paths(f.node, via):
                rs = fresh.get(i)
                if rs is None:
                    continue
                ps = rs.holds.setdefault(sid, [])
                if path not in ps and len(ps) < MAX_HOLDERS:
                    ps.append(path)
                views.add(path) if f.node in partial else views.discard(path)
                last = via.get(path, -1)
                by_module = last >= 0 and w.is_module(last)
                modules.add(path) if by_module else modules.discard(path)
                # Every root that reaches the tensor watches it: a gradient or a new storage appearing
                # under it (model.weight.grad is also opt's) makes each of them walk again.
                if watch is not None and i not in watched:
                    watched.add(i)
                    rs.tensors.append(watch)
        return {w.roots[i].path: rs for i, rs in fresh.items()}

    def _grad_sid(self, t: Any, TB: Any) -> int:
        try:
            if not TB.is_leaf.__get__(t):
                return 0
            g = TB._grad.__get__(t)
            return 0 if g is None else self.storages.by_obj.get(id(TB.untyped_storage(g)), 0)
        except Exception:
            return 0

    def _remerge(self, dirty: set[int]) -> None:
        """Rebuild the merged view of the storages whose holders changed."""
        for sid in dirty:
            found = self._paths.get(sid)
            st = self.storages.states.get(sid)
            if not found or st is None or st.ref() is None:
                self._records.drop(sid)
                self._paths.pop(sid, None) if not found else None
                continue
            rank = ranker(st.view_paths, st.module_paths)
            ranked = container_first(sorted(((p, k) for p, (k, _r) in found.items()), key=rank), self._is_state)
            reached = dict.fromkeys((found[p][1], k) for p, k in ranked)
            roots = list(reached)[:2 * MAX_HOLDERS]
            top = ranked[:MAX_HOLDERS]
            self._records.put(Held(sid, st.device, st.nbytes, tuple(p for p, _ in top), tuple(k for _, k in top),
                                   top[0][1], st.graph_tensor is not None and st.graph_tensor() is not None,
                                   st.span or st.nbytes, frozenset(st.roles), st.first_cell, st.addr,
                                   container(top[0][0]), tuple(r for r, _k in roots), tuple(k for _r, k in roots),
                                   st.elements, st.trainable, st.shape, st.dtype))

    def _is_state(self, root: str) -> bool:
        rs = self._roots.get(root)
        return rs is not None and bool(rs.state)

    # -- graphs -----------------------------------------------------------------------------------------
    def graphs(self, sids: Iterable[int], *, exclude: Iterable[int] = (), budget_s: float | None = None,
               truncated: bool = False) -> dict[int, Graph]:
        """The autograd graph behind each storage's tensor: its saved tensors not held by names anyway. After a
        ``truncated`` scan the leaves (parameters) count as named: the model's root may be one it did not reach."""
        torch = self._torch()
        out: dict[int, Graph] = {}
        if torch is None:
            return out
        excluded = exclude if isinstance(exclude, (Mapping, AbstractSet)) else set(exclude)  # a scan's: not copied
        deadline = None if budget_s is None else time.perf_counter() + budget_s
        states = self.storages.states
        with torch._C.DisableTorchFunction():
            for sid in sids:
                st = states.get(sid)
                t = st.graph_tensor() if st is not None and st.graph_tensor is not None else None
                if st is None or t is None:
                    continue
                if st.graph is None or st.graph.tensor() is not t:
                    if deadline is not None and time.perf_counter() > deadline:
                        continue
                    st.graph = walk_graph(torch, t, sid, st.first_cell, self.storages.sid, deadline)
                    (self.storages.graphed.discard if st.graph is None else self.storages.graphed.add)(sid)
                    if st.graph is None:
                        continue
                named = {g for g in st.graph.saved if g in excluded or (truncated and g in st.graph.leaves)}
                saved = {g: n for g, (_d, n) in st.graph.saved.items() if g not in named and self.storages.alive(g)}
                out[sid] = Graph(saved, frozenset(named))
        return out

    def young_unlocated(self, scan: Scan) -> dict[str, int]:
        """Bytes per device of tensors in the young GC generations that no root or walked graph reaches.

        Tensors a cell made and kept are young until a collection of an older generation promotes
        them; the engine asks this only when none ran during the cell.
        """
        torch = self._torch()
        if torch is None:
            return {}
        located = set(scan.storages)
        for sid in scan.storages:
            st = self.storages.states.get(sid)
            if st is not None and st.graph is not None:
                located.update(st.graph.saved)
        return _young_unlocated(torch, self.storages, located)


def _fresh_roots(w: Walk, now: Mapping[str, tuple[Root, tuple[int, int, int]]],
                 per_root: Mapping[int, tuple[bool, int, float]], states: Mapping[int, _StorageState],
                 sid_of_node: Mapping[int, int], known: intent.KnownNames) -> dict[int, _RootState]:
    """The roots a walk finished, each with the state it is (intent.py): its own type's, else, for a variable
    or a module's attribute, what it reaches. A tensor is a parameter or optimizer state by the roles its
    storage had in any walk (``sd = opt.state_dict()`` walked alone still reaches them)."""
    known.add(module_names(w))
    tensor_words = {}
    for f in w.found:
        roles = states[sid_of_node[f.node]].roles
        if ROLE_PARAM in roles or ROLE_OPTIM in roles:
            tensor_words[f.node] = "parameters" if ROLE_PARAM in roles else "optimizer state"
    reached = state_reached(w, tensor_words, known)
    fresh: dict[int, _RootState] = {}
    for i, (done, n, secs) in per_root.items():
        if done:
            r = w.roots[i]
            state = intent.state_of(type(r.obj))
            if not state and r.kind in (HolderKind.NAMESPACE, HolderKind.MODULE):
                state = reached.get(i, "")
            fresh[i] = _RootState(now[r.path][1], r.kind, reach.type_name(type(r.obj)), state, {}, [], n, secs, True)
    return fresh


def signature(obj: Any, sig_types: reach.TypeCache) -> tuple[int, int, int]:
    """Identity and size of a root: equal signatures mean the same object of the same length."""
    t = type(obj)
    size = -1
    try:
        how = sig_types.get(t)
        if how is None:  # per type, once: which container length, or where the instance dict is
            base = next((b for b in (dict, list, tuple, deque, set, frozenset) if reach.derives(t, b)), None)
            how = (base, None if base is not None or reach.is_atom_type(t) else reach.layout(t))
            sig_types.put(t, how)
        base, lay = how
        if base is not None:
            size = base.__len__(obj)
        elif lay is not None and reach.is_tracked(obj):
            d = reach.instance_dict(obj, lay)
            if d is not None:
                size = len(d)
                for sub in ("_parameters", "_buffers", "_modules", "state"):
                    inner = d.get(sub)
                    if inner is not None and reach.derives(type(inner), dict):
                        size += 1_000_003 * dict.__len__(inner)
    except Exception:
        size = -2
    return id(obj), id(t), size


def still_valid(rs: _RootState, storages: Storages, TB: Any) -> bool:
    """Whether the tensors a cached root held still have the storages (and grads) they had."""
    states = storages.states
    for ref, sid, grad_sid in rs.tensors:
        t = ref()
        st = states.get(sid)
        if t is None or st is None:
            return False
        try:
            if TB.untyped_storage(t) is not st.ref():
                return False
            if TB.is_leaf.__get__(t):
                g = TB._grad.__get__(t)
                gs = states.get(grad_sid)
                if (g is None) != (gs is None):
                    return False
                if g is not None and gs is not None and TB.untyped_storage(g) is not gs.ref():
                    return False
        except Exception:
            return False
    return True


def _describe(st: _StorageState, t: Any, TB: Any) -> None:
    """Shape, dtype, elements and whether it trains, from the storage's largest tensor (C getters only)."""
    try:
        st.shape = tuple(int(x) for x in TB.shape.__get__(t))
        st.dtype = str(TB.dtype.__get__(t)).removeprefix("torch.")
        st.elements = int(TB.numel(t))
    except Exception:
        pass
    st.trainable = _requires_grad(t, TB)


def _requires_grad(t: Any, TB: Any) -> bool:
    try:
        return bool(TB.requires_grad.__get__(t))
    except Exception:
        return False


def _young_unlocated(torch: Any, storages: Storages, located: set[int]) -> dict[str, int]:
    TB = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase
    objs = gc.get_objects(generation=0) + gc.get_objects(generation=1)
    types_by_id = dict(zip(map(id, map(type, objs)), map(type, objs)))
    tensor_type_ids = {i for i, t in types_by_id.items() if reach.derives(t, TB)}
    if not tensor_type_ids:
        return {}
    tensors = list(compress(objs, map(tensor_type_ids.__contains__, map(id, map(type, objs)))))
    del objs
    out: dict[str, int] = {}
    seen: set[int] = set()
    with torch._C.DisableTorchFunction():
        for t in tensors:
            try:
                if TB.layout.__get__(t) is not torch.strided:
                    continue
                s = TB.untyped_storage(t)
                if id(s) in seen:
                    continue
                seen.add(id(s))
                known = storages.known(s)
                if known is not None and known in located:
                    continue
                dev = str(TB.device.__get__(t))
                out[dev] = out.get(dev, 0) + int(s.nbytes())
            except Exception:
                continue
    return out
