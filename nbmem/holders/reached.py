"""What a finished walk reached: the training state each root reaches (``intent``'s rule, for the report), the
names of the modules' parameters (to tell a checkpoint), and the training state a fit copies and puts back.

A walk's nodes and their every parent (``Walk.up``) are read after it ends; nothing here reads a user object
again, beyond its type.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nbmem.holders import intent, reach
from nbmem.holders.naming import L_ATTR, L_KEY, PathBuilder
from nbmem.holders.walk import ROLE_PARAM, Root, Walk
from nbmem.records import PAGED


def state_reached(w: Walk, tensor_words: dict[int, str], known: intent.KnownNames) -> dict[int, str]:
    """Per root (its index in ``w.roots``), the training state its walk reached, in words (intent.py's rule):
    objects of a state type, the tensors in ``tensor_words`` (node: "parameters", "optimizer state"), and
    dicts of tensors keyed like a module's ``state_dict`` (``known``). Reached through attributes, items,
    closures and bound methods, every way to a node counted; never through an autograd graph, which a walk
    does not enter."""
    marks = dict(tensor_words)
    for node, obj in enumerate(w.keep):
        word = w.info(type(obj)).state
        if word:
            marks[node] = word
    keys_of: dict[int, list[str]] = {}
    for f in w.found:
        edges = [(w.parent[f.node], w.lk[f.node], w.lv[f.node]), *w.aliases.get(f.node, ())]
        for parent, lk, lv in edges:
            if parent >= 0 and lk == L_KEY and type(lv) is str and w.info(type(w.keep[parent])).dict:
                keys_of.setdefault(parent, []).append(lv)
    for d, keys in keys_of.items():
        if d not in marks and known.like_state_dict(keys):
            marks[d] = "checkpoint"
    found: dict[int, set[str]] = {}
    for word in set(marks.values()):
        seen: set[int] = set()
        todo = [n for n, m in marks.items() if m == word]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            p = w.parent[n]
            if p < 0:
                found.setdefault(w.lv[n], set()).add(word)
            else:
                todo.append(p)
            for q in w.up.get(n, ()):
                if q < 0:
                    found.setdefault(~q, set()).add(word)
                else:
                    todo.append(q)
    return {i: intent.words(ws) for i, ws in found.items()}


def module_names(w: Walk) -> list[str]:
    """The ``state_dict`` keys of the modules this walk found: each parameter's or buffer's path from its
    outermost module (``0.weight``, ``base_model.model.layers.0.mlp.up_proj.weight``)."""
    out = []
    for f in w.found:
        if f.role != ROLE_PARAM:
            continue
        parts: list[str] = []
        n = f.node
        while (p := w.parent[n]) >= 0 and w.lk[n] == L_ATTR and type(w.lv[n]) is str and w.is_module(p):
            parts.append(w.lv[n])
            n = p
        if parts:
            out.append(".".join(reversed(parts)))
    return out


@dataclass
class TrainingState:
    """What a cell's code can change, found by a walk: held only while a fit needs the objects."""

    modules: list[Any]  # the outermost nn.Modules
    optimizers: list[Any]
    others: list[Any]  # objects of the kinds asked for (LR schedulers, gradient scalers)
    iterators: list[str]  # paths to iterators and generators: the code may advance them, nothing puts them back
    # GPU index -> bytes of paged (CUDA managed) memory the state holds (bitsandbytes' paged optimizers): memory
    # PyTorch's allocator does not count, which a fit counts as taken
    paged_bytes: dict[int, int] = field(default_factory=dict)
    # None: the walk reached everything; else how many objects it had visited when its time ran out (what it did
    # not reach may hold more state)
    stopped_after: int | None = None


def reachable_state(torch: Any, roots: Sequence[Root], types_: reach.TypeCache, *, budget_s: float | None = None,
                    kinds: tuple[type, ...] = ()) -> TrainingState:
    """The outermost ``nn.Module``s, every optimizer and every object of ``kinds`` reachable from ``roots``:
    the state a cell's code can change, which a fit copies and restores; and the iterators it could advance.
    Found by a walk (no user code runs); the caller holds the objects only while it needs them. Where
    ``budget_s`` runs out first, ``stopped_after`` says so: what was found is then not all there is."""
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    w = Walk(torch, types_, deadline)
    finished = True
    with torch._C.DisableTorchFunction():
        for r in roots:
            if not w.run_root(r)[0]:
                finished = False
                break
    found = TrainingState([], [], [], [], stopped_after=None if finished else w.objects)
    paths = PathBuilder(w, lambda t: "")
    for node, obj in enumerate(w.keep):
        t = type(obj)
        info = w.info(t)
        if info.optimizer:
            found.optimizers.append(obj)
        elif info.module:
            p = w.parent[node]
            if p < 0 or not w.is_module(p):
                found.modules.append(obj)
        elif any(reach.derives(t, k) for k in kinds):
            found.others.append(obj)
        elif info.generator or (info.object_ and _is_iterator(t)):
            found.iterators.append(f"{paths.primary(node)[1]} ({reach.type_name(t)})")
    seen: set[int] = set()
    for f in w.found:
        if f.device.startswith(PAGED) and id(f.storage) not in seen:
            seen.add(id(f.storage))
            gpu = int(f.device.rpartition(":")[2])
            found.paged_bytes[gpu] = found.paged_bytes.get(gpu, 0) + int(f.storage.nbytes())
    return found


def _is_iterator(t: type) -> bool:
    """An iterator (its type defines ``__next__``), read from the classes' own namespaces."""
    return any(type(k) is str and k == "__next__" for c in reach.mro(t) for k, _ in reach.own_items(c))
