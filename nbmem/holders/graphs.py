"""Autograd graphs: the saved tensors a kept tensor's ``grad_fn`` keeps alive, read without running hooks.

A loss appended to a list keeps its whole forward graph: every activation the backward pass would need.
The graph is walked once per tensor, from its ``grad_fn`` through ``next_functions``; saved tensors are
read through the nodes' ``_raw_saved_*`` attributes and their ``.data`` (the packed tensor: no
saved-tensor unpack hook runs). Later scans re-check the saved storages by weak reference only.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from nbmem.records import block_bytes

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Graph:
    """The autograd graph a storage's tensor keeps alive: saved tensors not held by any name.

    Two holders share a graph when they keep the same saved tensors alive (a loss computed from the
    outputs); two outputs of one model only meet at its parameters, which free nothing.
    """

    saved: Mapping[int, int]  # storage id -> bytes
    # Storages it saves that names hold anyway (``x``, a model's weights): they are not its bytes, but they
    # live as long as it does, so ``del x`` frees nothing while this graph is kept.
    named: frozenset[int] = frozenset()

    @property
    def nbytes(self) -> int:
        return sum(self.saved.values())


@dataclass(eq=False)
class GraphState:
    """A walked graph, kept by the scanner between scans. Compared by identity (a graph walked again is another
    one): by value, comparing its tensor's weak references would call the tensors' ``__eq__``."""

    tensor: weakref.ref[Any]  # the tensor whose grad_fn was walked
    saved: dict[int, tuple[str, int]]  # storage id -> (device, bytes)
    leaves: frozenset[int] = frozenset()  # those reached as a leaf's gradient sink (a parameter), not saved


#: Gives the scanner's id for a storage object: (storage, device, bytes, first cell) -> id.
SidOf = Callable[[Any, str, int, int], int]


def walk_graph(torch: Any, t: Any, sid: int, first_cell: int, sid_of: SidOf,
               deadline: float | None) -> GraphState | None:
    """The storages saved by ``t``'s graph (all but its own), or None when ``t`` has no graph."""
    TB = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase
    fn = TB.grad_fn.__get__(t)
    if fn is None:
        return None
    nodes: set[int] = set()
    saved: dict[int, tuple[str, int]] = {}
    leaves: set[int] = set()
    keep: list[Any] = []  # every node and saved tensor stays alive until the walk ends: ids stay unique
    names: dict[int, tuple[str, ...]] = {}
    stack = [fn]
    while stack:
        node = stack.pop()
        if id(node) in nodes:
            continue
        nodes.add(id(node))
        keep.append(node)
        if deadline is not None and not len(nodes) & 255 and time.perf_counter() > deadline:
            break
        for x, leaf in _saved(node, names, keep):
            try:
                s = TB.untyped_storage(x)
                n = int(s.nbytes())
                ptr = int(s.data_ptr())
                dev = str(TB.device.__get__(x))
            except Exception:
                continue
            if n == 0 or ptr == 0:
                continue
            if dev.startswith("cuda"):
                n = block_bytes(n)
            g = sid_of(s, dev, n, first_cell)
            if g != sid:
                saved[g] = (dev, n)
                if leaf:
                    leaves.add(g)
        try:
            nxt = node.next_functions
        except Exception:
            continue
        stack.extend(n for n, _ in nxt if n is not None)
    return GraphState(weakref.ref(t), saved, frozenset(leaves))


def _saved(node: Any, names: dict[int, tuple[str, ...]], keep: list[Any]) -> list[tuple[Any, bool]]:
    """A node's saved tensors, each with whether it is a leaf its gradient sink holds; autograd nodes are torch's
    C++ objects, not the user's."""
    t = type(node)
    attrs = names.get(id(t))
    if attrs is None:
        attrs = names[id(t)] = tuple(a for a in dir(t) if a.startswith("_raw_saved_"))
    out: list[tuple[Any, bool]] = []
    for a in attrs:
        try:
            raw = getattr(node, a)
        except Exception:  # released by a backward pass
            continue
        for r in raw if isinstance(raw, (list, tuple)) else (raw,):
            try:
                x = r.data  # the packed tensor: no unpack hook runs
            except Exception:
                continue
            keep.append(x)
            out.append((x, False))
    if attrs == () and t.__name__ == "AccumulateGrad":
        # A leaf's gradient sink holds the leaf itself (a parameter): the graph keeps it alive as surely as a
        # saved tensor, so `del model` frees nothing while a loss that used it is kept.
        try:
            x = node.variable
        except Exception:
            return out
        keep.append(x)
        out.append((x, True))
    return out


def sharing(saved_by: Mapping[K, Iterable[int]]) -> dict[K, list[K]]:
    """For rows (keyed by their index or their owner), each with the saved storages its graphs keep: which other
    rows keep some of the same ones (a graph they share, counted under each)."""
    keepers: dict[int, list[K]] = {}  # saved storage -> the rows that keep it
    for i, saved in saved_by.items():
        for s in saved:
            keepers.setdefault(s, []).append(i)
    shared: dict[K, dict[K, None]] = {}
    for idx in keepers.values():
        if len(idx) > 1:
            for i in idx:
                shared.setdefault(i, {}).update(dict.fromkeys(j for j in idx if j != i))
    return {i: list(others) for i, others in shared.items()}
