"""Naming: a walk's parent links turned into paths a user can type (``opt.state[model.0.weight]['exp_avg']``).

A walk records, for every object it met, the step that reached it: an index, a key, an attribute, or a
text of nbmem's own (``.grad``, ``.<closure inner>``). Steps become text only for the tensors found,
here. Paths are ranked (which holder names a storage) and cut into their owner (the name a user typed)
and the rest. Labels of user objects come from ``reach`` (no user code runs).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any, Protocol

from nbmem.holders import reach
from nbmem.records import HOLDER_KINDS, ROTATING_OUTPUTS, HolderKind, is_output_name, root_name

#: Kinds of step, as a walk records them.
L_ROOT, L_INDEX, L_KEY, L_ATTR, L_TEXT, L_TKEY = range(6)
#: Holder order by kind: a variable names a storage before a module attribute, an output or a frame.
KIND_RANK = {kind: info.rank for kind, info in HOLDER_KINDS.items()}
#: Most paths kept per storage.
MAX_HOLDERS = 8
#: Steps kept at each end of a long path; the middle is counted ("…(1,497 more)").
HEAD_STEPS, TAIL_STEPS = 8, 7
#: A second way to the same tensor is followed only this deep (the first way, the walk's own, always is).
MAX_ALIAS_STEPS = 48
#: An optimizer's own path to a parameter: a name for it only when no module reaches it any more.
OPTIMIZER_STEP = re.compile(r"\.param_groups\[")


class Links(Protocol):
    """What a walk records: per node its first parent and step, the other ways to it, and the roots."""

    parent: list[int]
    lk: list[int]
    lv: list[Any]
    root_of: list[int]
    aliases: dict[int, list[tuple[int, int, Any]]]
    roots: list[Any]  # Root records: ``.path``


def label(lk: int, lv: Any, tensor_name: Callable[[Any], str]) -> str:
    """One step as text: ``[3]``, ``['key']``, ``.attr``, ``[model.0.weight]`` or nbmem's own text."""
    if lk == L_INDEX:
        return f"[{lv}]"
    if lk == L_KEY:
        return f"[{reach.key_label(lv)}]"
    if lk == L_ATTR:
        return f".{reach.attr_label(lv)}"
    if lk == L_TKEY:
        return f"[{tensor_name(lv)}]"
    return str(lv)


class PathBuilder:
    """Paths to the nodes of one walk. The walk's own way to a node (its breadth-first parents) always
    gives a path, however deep; a deep one keeps its first and last steps and counts the rest."""

    def __init__(self, links: Links, tensor_name: Callable[[Any], str]) -> None:
        self.w = links
        self.tensor_name = tensor_name
        self._head: dict[int, tuple[tuple[str, ...], int]] = {}  # node -> (first steps, depth)

    def _step(self, node: int) -> str:
        return label(self.w.lk[node], self.w.lv[node], self.tensor_name)

    def _head_of(self, node: int) -> tuple[tuple[str, ...], int]:
        """The first steps from the root to ``node`` and its depth, memoised along the chain."""
        chain: list[int] = []
        n = node
        while n >= 0 and n not in self._head:
            chain.append(n)
            n = self.w.parent[n]
        head, depth = self._head[n] if n >= 0 else ((), -1)
        for m in reversed(chain):
            depth += 1
            if self.w.parent[m] < 0:
                head = (self.w.roots[self.w.lv[m]].path,)
            elif len(head) < HEAD_STEPS:
                head = (*head, self._step(m))
            self._head[m] = (head, depth)
        return head, depth

    def primary(self, node: int) -> tuple[int, str]:
        """(root index, path) along the walk's own parents."""
        head, depth = self._head_of(node)
        whole = depth + 1 <= HEAD_STEPS + TAIL_STEPS + 1
        tail: list[str] = []
        n = node
        while (whole or len(tail) < TAIL_STEPS) and self.w.parent[n] >= 0:
            tail.append(self._step(n))
            n = self.w.parent[n]
        if whole:
            parts = [self.w.roots[self.w.lv[n]].path, *reversed(tail)]
        else:
            skipped = depth + 1 - len(head) - len(tail)
            parts = [*head, f"…({skipped:,} more)", *reversed(tail)]
        return self.w.root_of[node], "".join(parts)

    def paths(self, node: int, via: dict[str, int] | None = None) -> list[tuple[int, str]]:
        """(root index, path) pairs that reach ``node``: the walk's own, then the other ways, at most
        MAX_HOLDERS from any one root, so that every root reaching it is found (a trainer's many ways to a
        parameter must not hide that ``model`` reaches it too). ``via``, when given, gets each path's last
        container: the node the path's last step leaves from (-1 for a root bound to ``node`` itself)."""
        out = [self.primary(node)]
        if via is not None:
            via[out[0][1]] = self.w.parent[node]
        if not self.w.aliases:
            return out
        seen = {out[0][1]}
        per_root = {out[0][0]: 1}
        stack: list[tuple[int, list[str], bool, int]] = [(node, [], True, -1)]
        steps = 0
        while stack and len(out) < 4 * MAX_HOLDERS and steps < 4000:
            n, suffix, on_primary, last = stack.pop()
            steps += 1
            edges = [(self.w.parent[n], self.w.lk[n], self.w.lv[n], on_primary),
                     *((p, k, v, False) for p, k, v in self.w.aliases.get(n, ()))]
            for parent, lk, lv, primary in reversed(edges):
                if parent < 0:
                    if lk == L_ROOT and not primary and per_root.get(lv, 0) < MAX_HOLDERS:
                        path = render([self.w.roots[lv].path, *reversed(suffix)])
                        if path not in seen:
                            seen.add(path)
                            per_root[lv] = per_root.get(lv, 0) + 1
                            out.append((lv, path))
                            if via is not None:
                                via[path] = last
                    continue
                if len(suffix) >= MAX_ALIAS_STEPS:
                    continue  # a second way this deep is left out: the first way names the tensor
                step = label(lk, lv, self.tensor_name)
                stack.append((parent, [*suffix, step], primary, parent if n == node else last))
        return out


def render(parts: list[str]) -> str:
    if len(parts) > HEAD_STEPS + TAIL_STEPS + 1:
        parts = [*parts[:HEAD_STEPS], f"…({len(parts) - HEAD_STEPS - TAIL_STEPS:,} more)", *parts[-TAIL_STEPS:]]
    return "".join(parts)


def stability(path: str) -> int:
    """Among output holders, prefer names that do not move: ``Out[n]``, then ``_n``, then ``_``; among
    traceback frames, the user's own before a library's (``<traceback forward in torch>``)."""
    if path.startswith("<traceback "):
        return 1 if " in " in path else 0
    if path.startswith("Out["):
        return 0
    if is_output_name(path) and path not in ROTATING_OUTPUTS:
        return 1
    return 2 if path in ROTATING_OUTPUTS or path.startswith("<last result>") else 0


Rank = tuple[int, int, bool, bool, bool, bool, bool, int, str]


def is_bare(path: str) -> bool:
    """A variable bound to the tensor itself (``loss``, ``x``), with no step after the name."""
    return path.isidentifier()


def ranker(views: AbstractSet[str], modules: AbstractSet[str] = frozenset()
           ) -> Callable[[tuple[str, HolderKind]], Rank]:
    """Holder order: kind, stable names, then whole tensors before small views of them (the dataset's
    ``tensors[0]``, not ``x = dataset[0][0]``), a module's path before any other (``modules``: the paths whose
    last step is a module's attribute; a list of the parameters is not their owner) and an optimizer's after
    the rest, then a path through a container before a bare variable (``losses[4]`` before ``loss``, the loop's
    last-iteration name: the owner a person deletes is the container), then the shortest."""

    def rank(item: tuple[str, HolderKind]) -> Rank:
        path, kind = item
        return (KIND_RANK[kind], stability(root_name(path)), path in views, bool(modules) and path not in modules,
                ".keys()[" in path, bool(OPTIMIZER_STEP.search(path)), kind is HolderKind.NAMESPACE and is_bare(path),
                len(path), path)

    return rank


#: A step that takes an element out of a container: ``[4]``, ``['k']``, a ``Sequential``'s ``.2``.
ELEMENT_STEP = re.compile(r"\[|\.\d+(?=[.\[]|$)")


def container_first(ranked: list[tuple[str, HolderKind]], is_state: Callable[[str], bool] = lambda _r: False
                    ) -> list[tuple[str, HolderKind]]:
    """The ranked holders, with a loop's last-iteration name after the container it came from.

    ``for name, m in model.named_children()`` leaves ``m`` bound to ``model[2]``: ``m.weight`` is shorter than
    ``model.2.weight``, but the owner a person deletes is ``model``. The best path's rest after its root
    (``.weight``) ending another variable's path after an element step (``model`` ``.2`` ``.weight``) makes
    that path the best. A bare name (``loss`` for ``losses[4]``) is ranked after such paths already. Memory
    of the notebook's state (``is_state``: intent.py) never passes to a variable that is not state (a list
    of models is not the models' owner).
    """
    if len(ranked) < 2 or ranked[0][1] is not HolderKind.NAMESPACE:
        return ranked
    top = ranked[0][0]
    root = root_name(top)
    rest = top[len(root):]
    for i, (p, k) in enumerate(ranked[1:], 1):
        if k is not HolderKind.NAMESPACE:
            break
        r = root_name(p)
        if (r != root and p.endswith(rest) and ELEMENT_STEP.search(p[len(r):len(p) - len(rest)])
                and (is_state(r) or not is_state(root))):
            return [ranked[i], *ranked[:i], *ranked[i + 1:]]
    return ranked


def container(path: str) -> str:
    """The holder path without its last step: the container that holds it."""
    depth = 0
    for i in range(len(path) - 1, -1, -1):
        ch = path[i]
        if ch == "]":
            depth += 1
        elif ch == "[":
            depth -= 1
            if depth == 0:
                return path[:i]
        elif ch == "." and depth == 0:
            return path[:i]
    return path


def owner_of(root_path: str) -> str:
    """The owner a root belongs to: itself, except a traceback frame's locals (``<traceback f>.batch``),
    which belong to their frame."""
    return root_name(root_path) if root_path.startswith("<traceback ") else root_path
