"""Who holds what: a forward walk from the notebook's roots to every live tensor storage.

Pure analysis over objects handed in as roots; it knows nothing of IPython. A scan returns numbers
and path strings only, and drops every reference it took before it returns.
"""

from __future__ import annotations

import sys
import time
import types
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .formatting import esc, fmt_bytes, html_table, text_table

KIND_ORDER = {"namespace": 0, "output": 1, "traceback": 2}
#: Output-cache names that move every time something is displayed; a change among them is no news.
ROTATING = frozenset({"_", "__", "___", "<last result>"})

_ATOMIC = frozenset({int, float, complex, bool, str, bytes, bytearray, type(None), range, slice,
                     type(Ellipsis), memoryview})
# Library objects that cannot hold the user's tensors, or whose walk would only cost time.
_SKIP_MODULE_PREFIXES = ("IPython", "ipykernel", "nbmem", "traitlets", "zmq", "tornado", "asyncio",
                         "jupyter", "comm", "ipywidgets", "anywidget", "matplotlib", "pandas", "numpy",
                         "threading", "logging", "_thread", "pygments", "prompt_toolkit", "jedi",
                         "sidecar", "psutil", "pynvml", "concurrent", "socket", "ssl", "selectors",
                         "subprocess", "multiprocessing", "torch._C", "torch._ops", "torch.library",
                         "torch._tensor_str", "torch.fx", "torch._dynamo", "torch._inductor", "sympy")

# How a path step is written; kept as (kind, value) and formatted only for the paths reported.
_L_ROOT, _L_INDEX, _L_KEY, _L_ATTR, _L_TEXT, _L_TENSOR_KEY = range(6)

# Walk strategies, decided once per type.
_SKIP, _TENSOR, _DICT, _SEQ, _SET, _MODULE, _FUNC, _METHOD, _PARTIAL, _PYMOD, _CLASS, _OBJ = range(12)


@dataclass(frozen=True, slots=True)
class Held:
    """One live tensor storage and every path that reaches it."""

    key: tuple[str, int]
    device: str
    nbytes: int
    holders: tuple[str, ...]
    kind: str
    holds_graph: bool
    graph_bytes: int  # saved tensors kept alive only through this storage's autograd graph

    @property
    def bytes(self) -> int:
        return self.nbytes + self.graph_bytes

    @property
    def name(self) -> str:
        return self.holders[0] if self.holders else "?"


@dataclass(frozen=True)
class Scan:
    """The result of one walk: storages by (device, data_ptr), and totals per device."""

    storages: Mapping[tuple[str, int], Held]
    totals: Mapping[str, int]
    objects_visited: int
    truncated: bool
    seconds: float


@dataclass(frozen=True, slots=True)
class Finding:
    """A storage worth the user's attention, with the names that keep it alive and what to do."""

    cell: int
    name: str
    holders: tuple[str, ...]
    kind: str
    device: str
    bytes: int
    holds_graph: bool
    hint: str
    graph_bytes: int = 0
    roots: tuple[str, ...] = ()  # top-level names whose deletion this finding suggests
    id: str = ""  # stable handle the widget refers to

    def row(self) -> dict[str, object]:
        return {"cell": self.cell, "name": self.name, "holders": list(self.holders), "kind": self.kind,
                "device": self.device, "bytes": self.bytes, "holds_graph": self.holds_graph, "hint": self.hint}


FINDING_COLUMNS = ["cell", "name", "holders", "kind", "device", "bytes", "holds_graph", "hint"]


def _type_strategy(t: type, torch: Any) -> int:
    if t in _ATOMIC:
        return _SKIP
    if torch is not None and issubclass(t, torch.Tensor):
        return _TENSOR
    if issubclass(t, dict):
        return _DICT
    if issubclass(t, (list, tuple, deque)):
        return _SEQ
    if issubclass(t, (set, frozenset)):
        return _SET
    if torch is not None and issubclass(t, torch.nn.Module):
        return _MODULE
    if t is types.FunctionType:
        return _FUNC
    if t is types.MethodType:
        return _METHOD
    if t.__name__ == "partial" and t.__module__ == "functools":
        return _PARTIAL
    if t is types.ModuleType:
        return _PYMOD
    if issubclass(t, type):
        return _CLASS
    mod = getattr(t, "__module__", "") or ""
    if mod == "builtins" or mod.startswith(_SKIP_MODULE_PREFIXES):
        return _SKIP
    if torch is not None and (issubclass(t, (torch.device, torch.dtype, torch.Size))):
        return _SKIP
    return _OBJ


def _is_user_module(m: types.ModuleType) -> bool:
    """Modules the user wrote: walked for attributes. Library modules are not."""
    f = getattr(m, "__file__", None)
    if not f or m.__name__ in sys.builtin_module_names:
        return False
    return not any(f.startswith(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix} if p) and \
        "site-packages" not in f and "dist-packages" not in f


class _Walker:
    """Breadth-first walk; keeps every temporary alive until the end so ``id()``s stay unique."""

    def __init__(self, torch: Any, max_objects: int, max_holders: int) -> None:
        self.torch = torch
        self.max_objects = max_objects
        self.max_holders = max_holders
        self.keep: list[Any] = []
        self.node_of: dict[int, int] = {}  # id(obj) -> node
        self.parent: list[int] = []
        self.lk: list[int] = []  # label kind per node
        self.lv: list[Any] = []  # label value per node
        self.root_kind: list[int] = []  # per node: index of its root's kind
        self.aliases: dict[int, list[tuple[int, int, Any]]] = {}
        self.tensor_nodes: dict[tuple[str, int], list[int]] = {}
        self.nbytes: dict[tuple[str, int], int] = {}
        self.graph_keys: dict[tuple[str, int], list[tuple[str, int]]] = {}
        self.graph_seen: set[int] = set()
        self.saved_attrs: dict[type, tuple[str, ...]] = {}
        self.strategy: dict[type, int] = {}
        self.queue: deque[tuple[Any, int]] = deque()
        self.truncated = False

    # -- nodes and paths -------------------------------------------------------------------------
    def add(self, obj: Any, parent: int, lk: int, lv: Any, kind: int) -> None:
        t = type(obj)
        s = self.strategy.get(t)
        if s is None:
            s = self.strategy[t] = _type_strategy(t, self.torch)
        if s == _SKIP:
            return
        if (s == _SEQ or s == _SET) and len(obj) <= 16:
            for x in obj:
                if type(x) not in _ATOMIC:
                    break
            else:
                return  # nothing but numbers and strings: no tensor can hide here
        elif s == _DICT and len(obj) <= 16:
            for k, x in obj.items():
                if type(x) not in _ATOMIC or type(k) not in _ATOMIC:
                    break
            else:
                return
        oid = id(obj)
        node = self.node_of.get(oid)
        if node is not None:
            if parent != self.parent[node] or lv is not self.lv[node]:
                al = self.aliases.setdefault(node, [])
                if len(al) < self.max_holders:
                    al.append((parent, lk, lv))
            return
        if len(self.parent) >= self.max_objects:
            self.truncated = True
            return
        node = len(self.parent)
        self.node_of[oid] = node
        self.parent.append(parent)
        self.lk.append(lk)
        self.lv.append(lv)
        self.root_kind.append(kind)
        self.queue.append((obj, node))

    def label(self, lk: int, lv: Any) -> str:
        if lk == _L_INDEX:
            return f"[{lv}]"
        if lk == _L_KEY:
            return f"[{lv!r}]"
        if lk == _L_ATTR:
            return f".{lv}"
        if lk == _L_TENSOR_KEY:
            return f"[{self.path_of(lv) or '<tensor>'}]"
        return str(lv)

    def paths(self, node: int, limit: int, memo: dict[int, list[tuple[int, str]]]) -> list[tuple[int, str]]:
        """Up to ``limit`` (root kind, path) pairs that reach ``node``, through every alias."""
        got = memo.get(node)
        if got is not None:
            return got
        memo[node] = []  # cycle guard
        out: list[tuple[int, str]] = []
        for parent, lk, lv in [(self.parent[node], self.lk[node], self.lv[node]), *self.aliases.get(node, ())]:
            if parent < 0:
                out.append((self.root_kind[node], str(lv)))
            else:
                label = self.label(lk, lv)
                out.extend((k, p + label) for k, p in self.paths(parent, limit, memo))
            if len(out) >= limit:
                break
        memo[node] = out[:limit]
        return memo[node]

    def path_of(self, obj: Any) -> str | None:
        node = self.node_of.get(id(obj))
        return self.paths(node, 1, {})[0][1] if node is not None else None

    # -- tensors ---------------------------------------------------------------------------------
    def storage_key(self, t: Any) -> tuple[str, int] | None:
        try:
            st = t.untyped_storage()
            n = int(st.nbytes())
            ptr = int(st.data_ptr())
        except Exception:  # sparse, nested, meta or functional tensors have no plain storage
            return None
        if n == 0 or ptr == 0:
            return None
        key = (str(t.device), ptr)
        self.nbytes[key] = max(n, self.nbytes.get(key, 0))
        return key

    def visit_tensor(self, t: Any, node: int, kind: int) -> None:
        key = self.storage_key(t)
        if key is not None:
            self.tensor_nodes.setdefault(key, []).append(node)
            fn = getattr(t, "grad_fn", None)
            if fn is not None:
                self.graph_keys.setdefault(key, []).extend(self.graph_storages(fn))
        g = getattr(t, "grad", None) if t.is_leaf else None
        if g is not None:
            self.add(g, node, _L_TEXT, ".grad", kind)

    def graph_storages(self, fn: Any) -> list[tuple[str, int]]:
        """Storages saved for backward by the graph behind ``fn`` (nodes shared between graphs count once)."""
        out: list[tuple[str, int]] = []
        stack = [fn]
        while stack:
            f = stack.pop()
            self.keep.append(f)
            if id(f) in self.graph_seen:
                continue
            self.graph_seen.add(id(f))
            tf = type(f)
            names = self.saved_attrs.get(tf)
            if names is None:
                names = self.saved_attrs[tf] = tuple(a for a in dir(tf) if a.startswith("_saved_"))
            for a in names:
                try:
                    v = getattr(f, a)
                except Exception:  # freed by a backward pass already
                    continue
                for x in (v if isinstance(v, (tuple, list)) else (v,)):
                    if isinstance(x, self.torch.Tensor):
                        self.keep.append(x)
                        k = self.storage_key(x)
                        if k is not None:
                            out.append(k)
            try:
                nxt = f.next_functions
            except Exception:
                continue
            stack.extend(n for n, _ in nxt if n is not None)
        return out

    # -- the walk --------------------------------------------------------------------------------
    def out_of_time(self, deadline: float | None) -> bool:
        """Past the budget: the scan stops and says it is incomplete."""
        if deadline is None or time.perf_counter() <= deadline:
            return False
        self.truncated = True
        return True

    def run(self, deadline: float | None = None) -> int:
        q = self.queue
        strategy = self.strategy
        add = self.add
        visited = 0
        atomic = _ATOMIC
        while q:
            obj, node = q.popleft()
            visited += 1
            if not visited & 4095 and self.out_of_time(deadline):
                break
            kind = self.root_kind[node]
            s = strategy[type(obj)]
            try:
                if s == _TENSOR:
                    self.visit_tensor(obj, node, kind)
                elif s == _DICT:
                    for n, (k, v) in enumerate(list(obj.items())):
                        if n and not n & 65535 and self.out_of_time(deadline):
                            break  # one huge dict must not outlast the budget
                        tk = type(k)
                        if tk in atomic:
                            if type(v) not in atomic:
                                add(v, node, _L_KEY, k, kind)
                        elif tk is tuple:
                            add(v, node, _L_KEY, k, kind)
                        else:  # a tensor (optimizer state) or another object as the key
                            add(k, node, _L_TEXT, ".keys()[…]", kind)
                            add(v, node, _L_TENSOR_KEY, k, kind)
                elif s == _SEQ:
                    for i, v in enumerate(list(obj)):
                        if type(v) not in atomic:
                            add(v, node, _L_INDEX, i, kind)
                        if i and not i & 65535 and self.out_of_time(deadline):
                            break  # nor one huge list
                elif s == _SET:
                    for v in list(obj):
                        add(v, node, _L_TEXT, "{…}", kind)
                elif s == _MODULE:
                    d = obj.__dict__
                    for sub in ("_parameters", "_buffers", "_modules"):
                        for k, v in (d.get(sub) or {}).items():
                            if v is not None:
                                add(v, node, _L_ATTR, k, kind)
                    for k, v in d.items():
                        if k not in ("_parameters", "_buffers", "_modules") and not k.endswith("hooks"):
                            add(v, node, _L_ATTR, k, kind)
                elif s == _FUNC:
                    code = obj.__code__
                    for name, cell in zip(code.co_freevars, obj.__closure__ or ()):
                        try:
                            add(cell.cell_contents, node, _L_TEXT, f".<closure {name}>", kind)
                        except ValueError:  # an empty cell
                            pass
                    for i, v in enumerate(obj.__defaults__ or ()):
                        add(v, node, _L_TEXT, f".__defaults__[{i}]", kind)
                    for k, v in (obj.__kwdefaults__ or {}).items():
                        add(v, node, _L_TEXT, f".__kwdefaults__[{k!r}]", kind)
                    for k, v in obj.__dict__.items():
                        add(v, node, _L_ATTR, k, kind)
                elif s == _METHOD:
                    add(obj.__self__, node, _L_ATTR, "__self__", kind)
                    add(obj.__func__, node, _L_ATTR, "__func__", kind)
                elif s == _PARTIAL:
                    add(obj.func, node, _L_ATTR, "func", kind)
                    for i, v in enumerate(obj.args):
                        add(v, node, _L_TEXT, f".args[{i}]", kind)
                    for k, v in obj.keywords.items():
                        add(v, node, _L_TEXT, f".keywords[{k!r}]", kind)
                elif s == _PYMOD:
                    if _is_user_module(obj):
                        for k, v in list(vars(obj).items()):
                            if not k.startswith("__"):
                                add(v, node, _L_ATTR, k, kind)
                elif s == _CLASS:
                    mod = sys.modules.get(getattr(obj, "__module__", "") or "")
                    if obj.__module__ == "__main__" or (mod is not None and _is_user_module(mod)):
                        for k, v in list(vars(obj).items()):
                            if not k.startswith("__"):
                                add(v, node, _L_ATTR, k, kind)
                else:  # _OBJ
                    d = getattr(obj, "__dict__", None)
                    if isinstance(d, dict):
                        for k, v in list(d.items()):
                            add(v, node, _L_ATTR, k, kind)
                    for k in getattr(type(obj), "__slots__", ()) or ():
                        if isinstance(k, str) and hasattr(obj, k):
                            add(getattr(obj, k), node, _L_ATTR, k, kind)
            except ReferenceError:  # a dead weakproxy (memlab#40)
                continue
            except Exception:  # one odd object must not sink the scan
                continue
        return visited


def scan(roots: Iterable[tuple[str, str, Any]], *, torch: Any | None = None, max_objects: int = 50_000_000,
         max_holders: int = 8, budget_s: float | None = None) -> Scan:
    """Walk from ``roots`` — (path, kind, object) in priority order — to every tensor storage.

    ``torch`` is the user's torch module, or None when they never imported it (then nothing is found).
    """
    t0 = time.perf_counter()
    if torch is None:
        return Scan({}, {}, 0, False, time.perf_counter() - t0)
    w = _Walker(torch, max_objects, max_holders)
    kinds = list(KIND_ORDER)
    for path, kind, obj in roots:
        w.add(obj, -1, _L_ROOT, path, KIND_ORDER.get(kind, 0))
    visited = w.run(None if budget_s is None else t0 + budget_s)
    memo: dict[int, list[tuple[int, str]]] = {}
    direct = set(w.tensor_nodes)
    claimed: set[tuple[str, int]] = set()
    storages: dict[tuple[str, int], Held] = {}
    totals: dict[str, int] = {}
    for key, nodes in sorted(w.tensor_nodes.items(), key=lambda kv: min(kv[1])):
        found: dict[str, int] = {}
        for n in nodes:
            for k, p in w.paths(n, max_holders, memo):
                found.setdefault(p, k)
        ranked = sorted(found.items(), key=lambda pk: (pk[1], _stability(pk[0]), len(pk[0]), pk[0]))
        graph_bytes = 0
        for gk in w.graph_keys.get(key, ()):
            if gk not in direct and gk not in claimed and gk != key:
                claimed.add(gk)
                graph_bytes += w.nbytes[gk]
        held = Held(key, key[0], w.nbytes[key], tuple(p for p, _ in ranked[:max_holders]),
                    kinds[ranked[0][1]] if ranked else "namespace", key in w.graph_keys, graph_bytes)
        storages[key] = held
        totals[key[0]] = totals.get(key[0], 0) + held.bytes
    res = Scan(storages, totals, visited, w.truncated, time.perf_counter() - t0)
    w.keep.clear()
    w.queue.clear()
    return res


def _stability(path: str) -> int:
    """Among output holders, prefer names that do not move: ``Out[n]``, then ``_n``, then ``_``."""
    if path.startswith("Out["):
        return 0
    if path[:1] == "_" and path[1:2].isdigit():
        return 1
    return 2 if path in ROTATING else 0


# -- findings ------------------------------------------------------------------------------------
def root_name(path: str) -> str:
    """The top-level name a path starts from (``losses[3]`` → ``losses``)."""
    for i, ch in enumerate(path):
        if ch in ".[":
            return path[:i]
    return path


def hint_for(h: Held, lost: list[str] | None = None) -> str:
    """One line that says why the memory is held and what frees it."""
    if lost:
        return (f"{', '.join(lost)} was deleted or rebound, but {h.name} still holds it: "
                f"delete `{root_name(h.name)}` too to free it")
    if h.kind == "output":
        graph = f" (with its autograd graph, {fmt_bytes(h.graph_bytes)})" if h.graph_bytes else ""
        return f"kept by the output history{graph}: nbmem.cleanup(outputs=True), or end the line with `;`"
    if h.holds_graph and h.graph_bytes:
        return (f"holds its autograd graph ({fmt_bytes(h.graph_bytes)}): keep `loss.item()` or "
                f"`t.detach()` instead")
    if h.kind == "traceback":
        return "kept by the last exception's traceback: nbmem.cleanup(traceback=True) (ends %debug for it)"
    roots = sorted({root_name(p) for p in h.holders})
    if len(roots) > 1:
        return f"held by {len(roots)} names ({', '.join(roots)}): deleting one frees nothing"
    return f"`del {roots[0]}` or nbmem.cleanup(names=['{roots[0]}']) frees it" if roots else ""


_NOT_DELETABLE = frozenset({"Out", "_oh", "In", "_ih", "_", "__", "___"})


def _deletable_roots(h: Held) -> tuple[str, ...]:
    """Top-level user names among the holders: what ``del`` could remove (output names excluded)."""
    names = {root_name(p) for p in h.holders}
    return tuple(sorted(n for n in names if n.isidentifier() and n not in _NOT_DELETABLE
                        and not (n[:1] == "_" and n[1:].isdigit())))


def finding_id(h: Held) -> str:
    return f"{h.key[0]}:{h.key[1]:x}"


def findings(cur: Scan, prev: Scan | None, cell: int, *, threshold_bytes: int) -> list[Finding]:
    """What changed in ``cell``: new storages, new holders, and names gone while memory stays."""
    out: list[Finding] = []
    for key, h in cur.storages.items():
        if h.bytes < threshold_bytes:
            continue
        p = prev.storages.get(key) if prev is not None else None
        if p is not None and p.nbytes == h.nbytes:
            new = {root_name(x) for x in h.holders} - {root_name(x) for x in p.holders} - ROTATING
            lost = sorted({root_name(x) for x in p.holders} - {root_name(x) for x in h.holders} - ROTATING)
            lost = [n for n in lost if p.kind == "namespace"]
            if not new and not lost:
                continue
            hint = hint_for(h, lost or None)
        else:
            hint = hint_for(h)
        out.append(Finding(cell, h.name, h.holders, h.kind, h.device, h.bytes, h.holds_graph, hint,
                           h.graph_bytes, _deletable_roots(h), finding_id(h)))
    out.sort(key=lambda f: -f.bytes)
    return out


def current(cur: Scan, first_seen: Mapping[tuple[str, int], int], *, threshold_bytes: int) -> list[Finding]:
    """Everything held now above the threshold, with the cell each storage first appeared in."""
    out = [Finding(first_seen.get(k, -1), h.name, h.holders, h.kind, h.device, h.bytes, h.holds_graph,
                   hint_for(h), h.graph_bytes, _deletable_roots(h), finding_id(h))
           for k, h in cur.storages.items() if h.bytes >= threshold_bytes]
    out.sort(key=lambda f: -f.bytes)
    return out


@dataclass(frozen=True)
class Leaks:
    """A list of findings that renders itself (the DataFrame is ``nbmem.leaks()``)."""

    findings: tuple[Finding, ...] = field(default_factory=tuple)

    def _rows(self) -> list[list[str]]:
        return [[str(f.cell), f.name, ", ".join(f.holders[1:]), f.kind, f.device, fmt_bytes(f.bytes),
                 "yes" if f.holds_graph else "", f.hint] for f in self.findings]

    def __str__(self) -> str:
        return text_table(["cell", "name", "also held by", "kind", "device", "bytes", "graph", "hint"], self._rows())

    def _repr_html_(self) -> str:
        return html_table(["cell", "name", "also held by", "kind", "device", "bytes", "graph", "hint"], self._rows())


__all__ = ["Finding", "Held", "Scan", "current", "esc", "findings", "hint_for", "root_name", "scan"]
