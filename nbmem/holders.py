"""Who holds what: from the notebook's roots to every live tensor storage, cheaply and safely.

A walk goes root by root (a variable, an output, a traceback frame's local, a module's attribute),
breadth first, reading objects only through ``reach`` (no user code runs). Paths are recorded as
parent links and turned into strings (``opt.state[model.0.weight]['exp_avg']``) only for the tensors
found. Big containers of plain data are proven tensor-free at C speed instead of being walked in
Python.

Between scans the ``Scanner`` keeps, per root, what it held (storage ids and paths) and, per storage,
a weak reference to the storage object itself: that is the identity, so an address the allocator
reuses is not mistaken for the old tensor. A monitored cell re-walks only the roots it could have
changed (new or rebound names, containers whose size changed, names its code mentions); the engine's
allocator accounting asks for more when memory moved that those walks do not explain.

Nothing here knows IPython, and a scan keeps no strong reference once it returns.
"""

from __future__ import annotations

import gc
import re
import sys
import time
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import compress
from typing import Any

from . import reach
from .formatting import fmt_bytes
from .records import ROTATING_OUTPUTS, Finding, HolderKind, is_output_name, root_name

KIND_RANK = {HolderKind.NAMESPACE: 0, HolderKind.MODULE: 1, HolderKind.OUTPUT: 2, HolderKind.TRACEBACK: 3}
_KINDS = sorted(KIND_RANK, key=KIND_RANK.__getitem__)

#: A CUDA block is a multiple of 512 bytes; this is what ``memory_allocated()`` counts for a storage.
CUDA_BLOCK = 512
#: Containers at least this long are first tried as a whole, at C speed.
BULK_MIN = 64
#: Most paths kept per storage, and most steps shown in one path.
MAX_HOLDERS = 8
MAX_STEPS = 48

# Walk strategies, decided once per type.
(_SKIP, _TENSOR, _DICT, _SEQ, _SET, _NNMOD, _FUNC, _METHOD, _PARTIAL, _PYMOD, _CLASS, _GEN, _CELL, _EXC,
 _OBJ) = range(15)
#: A sparse tensor's parts, as labelled in paths.
_SPARSE_LABELS = frozenset({".indices()", ".values()", ".crow_indices()", ".col_indices()", ".ccol_indices()",
                            ".row_indices()"})
_CELL_CONTENTS: Any = vars(types.CellType)["cell_contents"]
# Roles of a tensor, for hints.
ROLE_GRAD, ROLE_PARAM, ROLE_OPTIM = "grad", "param", "optimizer state"
# An optimizer's own paths to a parameter: a name for it only when no module reaches it any more.
_OPTIMIZER_STEP = re.compile(r"\.param_groups\[")


@dataclass(frozen=True, slots=True)
class Root:
    """Where a walk starts: a path a user recognises, its kind, and the object (only during a scan)."""

    path: str
    kind: HolderKind
    obj: Any


@dataclass(frozen=True, slots=True)
class Held:
    """One live storage and the paths that reach it."""

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

    @property
    def name(self) -> str:
        return self.holders[0] if self.holders else "?"

    @property
    def roots(self) -> frozenset[str]:
        return frozenset(root_name(p) for p in self.holders)


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

    @property
    def truncated(self) -> bool:
        return bool(self.unfinished)


@dataclass(frozen=True, slots=True)
class Graph:
    """The autograd graph a storage's tensor keeps alive: saved tensors not held by any name.

    Two holders share a graph when they keep the same saved tensors alive (a loss computed from the
    outputs); two outputs of one model only meet at its parameters, which free nothing.
    """

    saved: Mapping[int, int]  # storage id -> bytes

    @property
    def nbytes(self) -> int:
        return sum(self.saved.values())


# -- the walk -------------------------------------------------------------------------------------------
_L_ROOT, _L_INDEX, _L_KEY, _L_ATTR, _L_TEXT, _L_TKEY = range(6)


_INERT_TYPES = (weakref.ProxyType, weakref.CallableProxyType, types.CodeType, types.FrameType,
                types.TracebackType, property, staticmethod, classmethod, types.BuiltinFunctionType,
                types.MethodDescriptorType, types.WrapperDescriptorType, types.GetSetDescriptorType,
                types.MemberDescriptorType, types.MappingProxyType)


@dataclass
class _TypeInfo:
    strategy: int
    layout: reach.Layout | None = None
    optimizer: bool = False


class _Found:
    """A tensor met in the walk."""

    __slots__ = ("device", "ephemeral", "grad_fn", "node", "role", "span", "storage", "tensor")

    def __init__(self, tensor: Any, storage: Any, node: int, span: int, device: str, grad_fn: bool, role: str,
                 ephemeral: bool) -> None:
        self.tensor, self.storage, self.node, self.span = tensor, storage, node, span
        self.device, self.grad_fn, self.role, self.ephemeral = device, grad_fn, role, ephemeral


class _Walk:
    """One breadth-first walk over some roots; keeps every object it met alive until it is dropped."""

    def __init__(self, torch: Any, types_: reach.TypeCache, deadline: float | None) -> None:
        self.torch = torch
        self.TB = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase
        self.Param = torch.nn.Parameter
        self.types = types_
        self.deadline = deadline
        self._sys_modules: set[int] | None = None
        self.keep: list[Any] = []
        self.node_of: dict[int, int] = {}
        self.parent: list[int] = []
        self.lk: list[int] = []
        self.lv: list[Any] = []
        self.root_of: list[int] = []
        self.aliases: dict[int, list[tuple[int, int, Any]]] = {}
        self.found: list[_Found] = []
        self.roots: list[Root] = []
        self.objects = 0
        self.errors = 0
        self.error_types: dict[str, int] = {}
        self.stopped = False
        self._optim_base = getattr(getattr(torch, "optim", None), "Optimizer", None)
        self._module_base = getattr(getattr(torch, "nn", None), "Module", None)

    def out_of_time(self) -> bool:
        # Time is kept back for turning what was found into paths afterwards (~20 µs a tensor).
        if self.deadline is not None and time.perf_counter() > self.deadline - 2e-5 * len(self.found):
            self.stopped = True
        return self.stopped

    # -- types ----------------------------------------------------------------------------------------
    def info(self, t: type) -> _TypeInfo:
        got = self.types.get(t)
        if got is None:
            got = self._classify(t)
            self.types.put(t, got)
        return got

    def _classify(self, t: type) -> _TypeInfo:
        if reach.is_atom_type(t):
            return _TypeInfo(_SKIP)
        d = reach.derives
        if d(t, self.TB):
            return _TypeInfo(_TENSOR, reach.layout(t))
        if t is types.FunctionType:
            return _TypeInfo(_FUNC)
        if t is types.MethodType:
            return _TypeInfo(_METHOD)
        if t is types.ModuleType or d(t, types.ModuleType):
            return _TypeInfo(_PYMOD)
        if d(t, type):
            return _TypeInfo(_CLASS)
        if reach.is_one_of(t, (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)):
            return _TypeInfo(_GEN)
        if t is types.CellType:
            return _TypeInfo(_CELL)
        if reach.is_one_of(t, _INERT_TYPES) or reach.derives(t, weakref.ref):
            return _TypeInfo(_SKIP)
        lay = reach.layout(t)
        if self._module_base is not None and d(t, self._module_base):
            return _TypeInfo(_NNMOD, lay)
        for base, s in ((dict, _DICT), (list, _SEQ), (tuple, _SEQ), (deque, _SEQ), (set, _SET), (frozenset, _SET)):
            if d(t, base):
                return _TypeInfo(s, lay)
        if d(t, BaseException):
            return _TypeInfo(_EXC, lay)
        mod = reach.type_module(t)
        if reach.type_name(t) == "partial" and mod == "functools":
            return _TypeInfo(_PARTIAL)
        if reach.is_library_module(mod) or (not reach.is_heap(t) and not lay.slots and lay.dict_get is None):
            return _TypeInfo(_SKIP)
        return _TypeInfo(_OBJ, lay, optimizer=self._optim_base is not None and d(t, self._optim_base))

    # -- nodes ----------------------------------------------------------------------------------------
    def root(self, r: Root) -> None:
        self.roots.append(r)
        self._add(r.obj, -1, _L_ROOT, len(self.roots) - 1, len(self.roots) - 1)

    def _add(self, obj: Any, parent: int, lk: int, lv: Any, root: int) -> int | None:
        if not reach.is_tracked(obj):
            return None  # atoms, and containers of atoms only: nothing can hide there
        oid = id(obj)
        node = self.node_of.get(oid)
        if node is not None:
            # Another way to the same object (a second root bound to it counts too): a path, not a walk.
            if parent != self.parent[node] or lv is not self.lv[node]:
                al = self.aliases.setdefault(node, [])
                if len(al) < MAX_HOLDERS:
                    al.append((parent, lk, lv))
            return None
        node = len(self.parent)
        self.node_of[oid] = node
        self.parent.append(parent)
        self.lk.append(lk)
        self.lv.append(lv)
        self.root_of.append(root)
        self.keep.append(obj)
        return node

    def run_root(self, r: Root) -> tuple[bool, int]:
        """Walk one root to the end or the deadline: (finished, objects visited)."""
        start_nodes = len(self.parent)
        self.root(r)
        q: deque[int] = deque(range(start_nodes, len(self.parent)))
        visited = 0
        while q:
            node = q.popleft()
            visited += 1
            if not visited & 127 and self.out_of_time():
                self.objects += visited
                return False, visited
            before = len(self.parent)
            try:
                self._visit(self.keep[node], node, self.root_of[node])
            except Exception as e:  # one odd object is skipped, never the whole scan
                self.errors += 1
                name = type(e).__name__
                self.error_types[name] = self.error_types.get(name, 0) + 1
            q.extend(range(before, len(self.parent)))
        self.objects += visited
        return True, visited

    # -- visiting ---------------------------------------------------------------------------------------
    def _visit(self, obj: Any, node: int, root: int) -> None:
        info = self.info(type(obj))
        s = info.strategy
        add = self._add
        if s == _SKIP:
            return
        if s == _TENSOR:
            self._tensor(obj, node, root, info)
        elif s == _DICT:
            plain = reach.is_plain(obj)
            if plain and dict.__len__(obj) >= BULK_MIN and self._inert(obj):
                return
            self._dict(reach.dict_items(obj), node, root)
            self._instance(obj, node, root, info, plain=plain)
        elif s == _SEQ or s == _SET:
            plain = reach.is_plain(obj)
            if plain and len(obj) >= BULK_MIN and self._inert(obj):
                return
            items = obj if type(obj) is list or type(obj) is tuple else reach.seq_items(obj)
            label, kind = (_L_INDEX, None) if s == _SEQ else (_L_TEXT, "{…}")
            for i, v in enumerate(items):
                if i and not i & 4095 and self.out_of_time():
                    return
                add(v, node, label, i if kind is None else kind, root)
            self._instance(obj, node, root, info, plain=plain)
        elif s == _NNMOD:
            d = reach.instance_dict(obj, info.layout) if info.layout else None
            if d is None:
                return
            for sub in ("_parameters", "_buffers", "_modules"):
                inner = d.get(sub)
                if type(inner) is dict:
                    for k, v in reach.dict_items(inner):
                        add(v, node, _L_ATTR, k, root)
            for k, v in reach.dict_items(d):
                if k not in ("_parameters", "_buffers", "_modules"):
                    add(v, node, _L_ATTR, k, root)
        elif s == _FUNC:
            self._function(obj, node, root)
        elif s == _METHOD:
            add(types.MethodType.__self__.__get__(obj), node, _L_ATTR, "__self__", root)
            add(types.MethodType.__func__.__get__(obj), node, _L_ATTR, "__func__", root)
        elif s == _PARTIAL:
            import functools

            p = functools.partial
            add(p.func.__get__(obj), node, _L_ATTR, "func", root)
            for i, v in enumerate(p.args.__get__(obj) or ()):
                add(v, node, _L_TEXT, f".args[{i}]", root)
            for k, v in reach.dict_items(p.keywords.__get__(obj) or {}):
                add(v, node, _L_TEXT, f".keywords[{reach.key_label(k)}]", root)
        elif s == _PYMOD:
            if self._sys_modules is None:
                self._sys_modules = {id(m) for m in list(sys.modules.values())}
            if id(obj) in self._sys_modules or not reach.is_user_module(obj):
                return  # modules in sys.modules are roots of their own; libraries are not walked
            self._dict(reach.dict_items(reach.module_dict(obj) or {}), node, root, attrs=True)
        elif s == _CLASS:
            if reach.is_library_module(reach.type_module(obj)):
                return
            for k, v in reach.own_items(obj):
                if type(k) is str and not k.startswith("__"):
                    add(v, node, _L_ATTR, k, root)
        elif s == _GEN:
            for v in reach.generator_locals(obj):
                add(v, node, _L_TEXT, ".<suspended local>", root)
        elif s == _CELL:
            try:
                add(_CELL_CONTENTS.__get__(obj), node, _L_TEXT, "", root)
            except ValueError:  # an empty cell
                pass
        elif s == _EXC:
            for i, v in enumerate(BaseException.__dict__["args"].__get__(obj)):
                add(v, node, _L_TEXT, f".args[{i}]", root)
            self._instance(obj, node, root, info, plain=False)
        else:
            self._instance(obj, node, root, info, plain=False)

    def _inert(self, obj: Any) -> bool:
        """A long plain container: skip it when nothing below it can hold a tensor, proven at C speed."""
        inert, n = reach.plain_subtree_is_inert(obj, max_objects=50_000_000, deadline=self.out_of_time)
        self.objects += n
        return inert

    def _dict(self, items: list[tuple[Any, Any]], node: int, root: int, attrs: bool = False) -> None:
        add = self._add
        tracked = reach.is_tracked
        for n, (k, v) in enumerate(items):
            if n and not n & 4095 and self.out_of_time():
                return
            if tracked(k):  # an object as the key: a tensor (optimizer state) is named by its own path
                if self.info(type(k)).strategy == _TENSOR:
                    add(k, node, _L_TEXT, ".keys()[…]", root)
                    add(v, node, _L_TKEY, k, root)
                else:
                    add(k, node, _L_TEXT, f".keys()[{reach.key_label(k)}]", root)
                    add(v, node, _L_KEY, k, root)
            elif attrs:
                if type(k) is not str or not k.startswith("__"):
                    add(v, node, _L_ATTR, k, root)
            else:
                add(v, node, _L_KEY, k, root)

    def _instance(self, obj: Any, node: int, root: int, info: _TypeInfo, *, plain: bool) -> None:
        if plain or info.layout is None:
            return
        lay = info.layout
        d = reach.instance_dict(obj, lay)
        if d is not None:
            for k, v in reach.dict_items(d):
                self._add(v, node, _L_ATTR, k, root)
        elif lay.dict_shadowed:
            for v in reach.referents(obj):  # the real dict is hidden behind user code: values only
                if type(v) is dict:
                    for k, x in reach.dict_items(v):
                        self._add(x, node, _L_ATTR, k, root)
                elif type(v) is not type:
                    self._add(v, node, _L_TEXT, ".<attribute>", root)
        for k, v in reach.slot_values(obj, lay):
            self._add(v, node, _L_ATTR, k, root)

    def _function(self, f: types.FunctionType, node: int, root: int) -> None:
        F: dict[str, Any] = dict(vars(types.FunctionType))
        code = F["__code__"].__get__(f)
        closure = F["__closure__"].__get__(f) or ()
        for name, cell in zip(code.co_freevars, closure):
            try:
                v = _CELL_CONTENTS.__get__(cell)
            except ValueError:
                continue
            self._add(v, node, _L_TEXT, f".<closure {name}>", root)
        for i, v in enumerate(F["__defaults__"].__get__(f) or ()):
            self._add(v, node, _L_TEXT, f".__defaults__[{i}]", root)
        for k, v in reach.dict_items(F["__kwdefaults__"].__get__(f) or {}):
            self._add(v, node, _L_TEXT, f".__kwdefaults__[{reach.key_label(k)}]", root)
        for k, v in reach.dict_items(F["__dict__"].__get__(f)):
            self._add(v, node, _L_ATTR, k, root)

    def _tensor(self, t: Any, node: int, root: int, info: _TypeInfo) -> None:
        TB = self.TB
        layout = TB.layout.__get__(t)
        if layout is not self.torch.strided:
            self._sparse(t, node, root, layout)
        else:
            try:
                st = TB.untyped_storage(t)
                n = int(st.nbytes())
                ptr = int(st.data_ptr())
            except Exception:  # meta, functional or wrapper tensors have no plain storage
                st, n, ptr = None, 0, 0
            if st is not None and n > 0 and ptr != 0:
                dev = str(TB.device.__get__(t))
                ours = self.lk[node] == _L_TEXT  # our own label text; other labels may be user objects
                # A Parameter is one whichever path reached it first (the optimizer's state is keyed by them).
                is_param = self.Param in type(t).__mro__ or self._is_param(node)
                role = ROLE_PARAM if is_param else ROLE_GRAD if ours and self.lv[node] == ".grad" else ""
                if not role and self._under_optimizer_state(node):
                    role = ROLE_OPTIM
                span = int(TB.nbytes.__get__(t))
                # A sparse tensor's parts are new tensor objects at every access: not worth watching.
                ephemeral = ours and self.lv[node] in _SPARSE_LABELS
                self.found.append(_Found(t, st, node, span, dev, TB.grad_fn.__get__(t) is not None, role, ephemeral))
        if TB.is_leaf.__get__(t):
            g = TB._grad.__get__(t) if hasattr(TB, "_grad") else None
            if g is not None:
                self._add(g, node, _L_TEXT, ".grad", root)
        if info.layout is not None and reach.is_heap(type(t)):
            self._instance(t, node, root, info, plain=False)

    def _sparse(self, t: Any, node: int, root: int, layout: Any) -> None:
        TB, torch = self.TB, self.torch
        parts: tuple[tuple[str, str], ...]
        if layout is torch.sparse_coo:
            parts = (("_indices", ".indices()"), ("_values", ".values()"))
        elif layout in (torch.sparse_csr, torch.sparse_bsr):
            parts = (("crow_indices", ".crow_indices()"), ("col_indices", ".col_indices()"), ("values", ".values()"))
        elif layout in (torch.sparse_csc, torch.sparse_bsc):
            parts = (("ccol_indices", ".ccol_indices()"), ("row_indices", ".row_indices()"), ("values", ".values()"))
        else:
            return
        for meth, label in parts:
            self._add(getattr(TB, meth)(t), node, _L_TEXT, label, root)


    def _is_param(self, node: int) -> bool:
        p = self.parent[node]
        return p >= 0 and self.lk[node] == _L_ATTR and self.info(type(self.keep[p])).strategy == _NNMOD

    def _under_optimizer_state(self, node: int) -> bool:
        # opt.state[param]['exp_avg']: the tensor's dict is a value keyed by a tensor in the optimizer's state
        p = self.parent[node]
        for _ in range(3):
            if p < 0:
                return False
            if self.info(type(self.keep[p])).optimizer:
                return True
            p = self.parent[p]
        return False

    # -- paths --------------------------------------------------------------------------------------------
    def label(self, lk: int, lv: Any, tensor_name: Callable[[Any], str]) -> str:
        if lk == _L_INDEX:
            return f"[{lv}]"
        if lk == _L_KEY:
            return f"[{reach.key_label(lv)}]"
        if lk == _L_ATTR:
            return f".{reach.attr_label(lv)}"
        if lk == _L_TKEY:
            return f"[{tensor_name(lv)}]"
        return str(lv)

    def paths(self, node: int, tensor_name: Callable[[Any], str]) -> list[tuple[int, list[str]]]:
        """Up to MAX_HOLDERS (root index, path parts) that reach ``node``, iteratively and bounded."""
        out: list[tuple[int, list[str]]] = []
        stack: list[tuple[int, list[str]]] = [(node, [])]
        steps = 0
        while stack and len(out) < MAX_HOLDERS and steps < 4000:
            n, suffix = stack.pop()
            steps += 1
            edges = [(self.parent[n], self.lk[n], self.lv[n]), *self.aliases.get(n, ())]
            for parent, lk, lv in reversed(edges):
                if parent < 0:
                    r = self.roots[lv] if lk == _L_ROOT else None
                    if r is not None:
                        out.append((lv, [r.path, *reversed(suffix)]))
                    continue
                if len(suffix) >= MAX_STEPS:
                    continue  # a chain this deep is shown through a shorter path, or not at all
                stack.append((parent, [*suffix, self.label(lk, lv, tensor_name)]))
        return out


def _render(parts: list[str]) -> str:
    if len(parts) > 16:
        parts = [*parts[:8], "…", *parts[-7:]]
    return "".join(parts)


def _stability(path: str) -> int:
    """Among output holders, prefer names that do not move: ``Out[n]``, then ``_n``, then ``_``; among
    traceback frames, the user's own before a library's (``<traceback forward in torch>``)."""
    if path.startswith("<traceback "):
        return 1 if " in " in path else 0
    if path.startswith("Out["):
        return 0
    if is_output_name(path) and path not in ROTATING_OUTPUTS:
        return 1
    return 2 if path in ROTATING_OUTPUTS or path.startswith("<last result>") else 0


def _ranker(views: set[str]) -> Callable[[tuple[str, HolderKind]], tuple[int, int, bool, bool, bool, int, str]]:
    """Holder order: kind, stable names, then whole tensors before small views of them (the dataset's
    ``tensors[0]``, not ``x = dataset[0][0]``), a module's path before an optimizer's, then the shortest."""

    def rank(item: tuple[str, HolderKind]) -> tuple[int, int, bool, bool, bool, int, str]:
        path, kind = item
        return (KIND_RANK[kind], _stability(root_name(path)), path in views, ".keys()[" in path,
                bool(_OPTIMIZER_STEP.search(path)), len(path), path)

    return rank


def _container(path: str) -> str:
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


# -- the scanner: state between scans ----------------------------------------------------------------
@dataclass
class _RootState:
    sig: tuple[int, int, int]
    kind: HolderKind
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
    roles: set[str] = field(default_factory=set)
    graph_tensor: weakref.ref[Any] | None = None
    graph: _GraphState | None = None  # walked once, on demand; saved storages are re-checked weakly
    view_paths: set[str] = field(default_factory=set)  # paths to a tensor spanning less than the storage


@dataclass
class _GraphState:
    tensor: weakref.ref[Any]  # the tensor whose grad_fn was walked
    saved: dict[int, tuple[str, int]]  # storage id -> (device, bytes)


class Scanner:
    """The holder scan over time: what each root held, and every storage by identity (weakly)."""

    def __init__(self, torch: Callable[[], Any]) -> None:
        self._torch = torch
        self._types = reach.TypeCache()
        self._sig_types = reach.TypeCache()  # per type: how _signature reads an instance's size
        self._roots: dict[str, _RootState] = {}
        self._storages: dict[int, _StorageState] = {}
        self._by_obj: dict[int, int] = {}  # id(storage object) -> sid, checked against the weak reference
        self._paths: dict[int, dict[str, HolderKind]] = {}  # sid -> every path that reaches it, from all roots
        self._held: dict[int, Held] = {}
        self._walked_this_cell: set[str] = set()  # roots walked since the last update that was not a follow-up
        self._watchers: dict[int, dict[str, weakref.ref[Any]]] = {}  # id(tensor) -> roots that reach it
        self._next_sid = 1
        self.last: Scan | None = None

    # -- identity ---------------------------------------------------------------------------------------
    def _sid(self, storage: Any, device: str, nbytes: int, cell: int) -> int:
        sid = self._by_obj.get(id(storage))
        if sid is not None:
            st = self._storages.get(sid)
            if st is not None and st.ref() is storage:
                return sid
        sid = self._next_sid
        self._next_sid += 1
        try:
            addr = int(storage.data_ptr())
        except Exception:
            addr = 0
        self._storages[sid] = _StorageState(weakref.ref(storage), device, nbytes, cell, addr)
        self._by_obj[id(storage)] = sid
        return sid

    def _forget_dead(self) -> None:
        dead = [sid for sid, st in self._storages.items() if st.ref() is None]
        for sid in dead:
            del self._storages[sid]
            self._paths.pop(sid, None)
            self._held.pop(sid, None)
        if dead:
            self._by_obj = {k: v for k, v in self._by_obj.items() if v in self._storages}

    # -- roots ------------------------------------------------------------------------------------------
    def _signature(self, obj: Any) -> tuple[int, int, int]:
        """Identity and size of a root: equal signatures mean the same object of the same length."""
        t = type(obj)
        size = -1
        try:
            how = self._sig_types.get(t)
            if how is None:  # per type, once: which container length, or where the instance dict is
                base = next((b for b in (dict, list, tuple, deque, set, frozenset) if reach.derives(t, b)), None)
                how = (base, None if base is not None or reach.is_atom_type(t) else reach.layout(t))
                self._sig_types.put(t, how)
            base, lay = how
            if base is not None:
                size = base.__len__(obj)
            elif lay is not None:
                if reach.is_tracked(obj):
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

    def _validate(self, rs: _RootState, TB: Any) -> bool:
        """Whether the tensors a cached root held still have the storages (and grads) they had."""
        for ref, sid, grad_sid in rs.tensors:
            t = ref()
            st = self._storages.get(sid)
            if t is None or st is None:
                return False
            try:
                if TB.untyped_storage(t) is not st.ref():
                    return False
                if TB.is_leaf.__get__(t):
                    g = TB._grad.__get__(t)
                    gs = self._storages.get(grad_sid)
                    if (g is None) != (gs is None):
                        return False
                    if g is not None and gs is not None and TB.untyped_storage(g) is not gs.ref():
                        return False
            except Exception:
                return False
        return True

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
                    d[p] = rs.kind
                dirty.add(sid)
            for ref, _sid, _g in rs.tensors:
                t = ref()
                if t is not None:
                    self._watchers.setdefault(id(t), {})[path] = ref
        return dirty

    def _also_reaching(self, w: _Walk, now: Mapping[str, tuple[Root, tuple[int, int, int]]],
                       done: set[str]) -> list[Root]:
        """Roots not walked yet that also reach a tensor under which this walk found a new storage.

        ``model.weight.grad`` appears under ``model`` and, through the same parameter, under ``opt``:
        walking the root the cell mentioned must not leave the other one's paths out.
        """
        out: dict[str, Root] = {}
        for f in w.found:
            p = w.parent[f.node]
            sid = self._by_obj.get(id(f.storage))
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
        self._forget_dead()
        mentioned = set(mentioned)
        walked_before = set(self._walked_this_cell) if walk == "rest" else set()
        now: dict[str, tuple[Root, tuple[int, int, int]]] = {}
        for r in roots:
            if r.path not in now:
                now[r.path] = (r, self._signature(r.obj))
        dirty: set[int] = set()
        for gone in [p for p in self._roots if p not in now]:
            dirty |= self._set_root(gone, None)
        todo: list[Root] = []
        with torch._C.DisableTorchFunction():
            for path, (r, sig) in now.items():
                rs = self._roots.get(path)
                if walk == "all" or rs is None or not rs.finished or rs.sig != sig or rs.kind != r.kind:
                    todo.append(r)
                elif walk == "rest":
                    if path not in walked_before:
                        todo.append(r)
                elif walk == "invalid":
                    if not self._validate(rs, TB):
                        todo.append(r)
                elif root_name(path) in mentioned or (validate and not self._validate(rs, TB)):
                    todo.append(r)
            # Cheapest first, so a budget spent on one huge root does not starve the rest.
            todo.sort(key=lambda r: (root_name(r.path) not in mentioned,
                                     self._roots[r.path].seconds if r.path in self._roots else 0.0))
            w = _Walk(torch, self._types, deadline)
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
        totals: dict[str, int] = {}
        for h in self._held.values():
            totals[h.device] = totals.get(h.device, 0) + h.nbytes
        if walk in ("all", "changed"):
            self._walked_this_cell = set()
        self._walked_this_cell.update(walked)
        kinds = tuple(f"{k} x{n}" for k, n in sorted(w.error_types.items()))
        self.last = Scan(dict(self._held), totals, w.objects, time.perf_counter() - t0, tuple(walked),
                         tuple(unfinished), w.errors, kinds)
        return self.last

    def _absorb(self, w: _Walk, now: Mapping[str, tuple[Root, tuple[int, int, int]]],
                per_root: Mapping[int, tuple[bool, int, float]], cell: int) -> dict[str, _RootState]:
        """The walk's tensors as per-root state: storage ids, paths, and handles to re-check them by."""
        fresh: dict[int, _RootState] = {}
        for i, (done, n, secs) in per_root.items():
            if done:
                r = w.roots[i]
                fresh[i] = _RootState(now[r.path][1], r.kind, {}, [], n, secs, True)
        sid_of_node: dict[int, int] = {}
        partial: set[int] = set()  # nodes of tensors that span less than their storage
        for f in w.found:
            n = int(f.storage.nbytes())
            if f.span < n:
                partial.add(f.node)
            if f.device.startswith("cuda"):
                n = -(-n // CUDA_BLOCK) * CUDA_BLOCK
            sid = self._sid(f.storage, f.device, n, cell)
            sid_of_node[f.node] = sid
            st = self._storages[sid]
            st.span = max(st.span, f.span)
            if f.role:
                st.roles.add(f.role)
            if f.grad_fn and (st.graph_tensor is None or st.graph_tensor() is None):
                st.graph_tensor = weakref.ref(f.tensor)

        def tensor_name(t: Any) -> str:
            node = w.node_of.get(id(t))
            sid = sid_of_node.get(node) if node is not None else None
            held = self._held.get(sid) if sid is not None else None
            if held is not None and held.holders:  # the name it already has (model.0.weight)
                return held.holders[0]
            if node is not None:
                got = [(_render(parts), w.roots[i].kind) for i, parts in w.paths(node, lambda _t: "<tensor>")]
                if got:
                    return min(got, key=_ranker(set()))[0]
            return "<tensor>"

        for f in w.found:
            sid = sid_of_node[f.node]
            watch = None if f.ephemeral else (weakref.ref(f.tensor), sid, self._grad_sid(f.tensor, w.TB))
            watched: set[int] = set()
            for i, parts in w.paths(f.node, tensor_name):
                rs = fresh.get(i)
                if rs is None:
                    continue
                ps = rs.holds.setdefault(sid, [])
                path = _render(parts)
                if path not in ps and len(ps) < MAX_HOLDERS:
                    ps.append(path)
                views = self._storages[sid].view_paths
                views.add(path) if f.node in partial else views.discard(path)
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
            return 0 if g is None else self._by_obj.get(id(TB.untyped_storage(g)), 0)
        except Exception:
            return 0

    def _remerge(self, dirty: set[int]) -> None:
        """Rebuild the merged view of the storages whose holders changed."""
        for sid in dirty:
            found = self._paths.get(sid)
            st = self._storages.get(sid)
            if not found or st is None or st.ref() is None:
                self._held.pop(sid, None)
                self._paths.pop(sid, None) if not found else None
                continue
            ranked = sorted(found.items(), key=_ranker(st.view_paths))[:MAX_HOLDERS]
            self._held[sid] = Held(sid, st.device, st.nbytes, tuple(p for p, _ in ranked),
                                   tuple(k for _, k in ranked), ranked[0][1],
                                   st.graph_tensor is not None and st.graph_tensor() is not None,
                                   st.span or st.nbytes, frozenset(st.roles), st.first_cell, st.addr,
                                   _container(ranked[0][0]))

    # -- graphs -----------------------------------------------------------------------------------------
    def graphs(self, sids: Iterable[int], *, exclude: Iterable[int] = (), budget_s: float | None = None
               ) -> dict[int, Graph]:
        """The autograd graph behind each storage's tensor: its saved tensors not held by names anyway.

        A graph is walked once per tensor (saved tensors through ``_raw_saved_*.data``, which runs no
        saved-tensor hooks); later calls re-check its saved storages by weak reference only.
        """
        torch = self._torch()
        out: dict[int, Graph] = {}
        if torch is None:
            return out
        excluded = set(exclude)
        deadline = None if budget_s is None else time.perf_counter() + budget_s
        with torch._C.DisableTorchFunction():
            for sid in sids:
                st = self._storages.get(sid)
                t = st.graph_tensor() if st is not None and st.graph_tensor is not None else None
                if st is None or t is None:
                    continue
                if st.graph is None or st.graph.tensor() is not t:
                    if deadline is not None and time.perf_counter() > deadline:
                        continue
                    st.graph = self._walk_graph(torch, t, sid, deadline)
                    if st.graph is None:
                        continue
                saved = {g: n for g, (_d, n) in st.graph.saved.items()
                         if g not in excluded and g in self._storages and self._storages[g].ref() is not None}
                out[sid] = Graph(saved)
        return out

    def _walk_graph(self, torch: Any, t: Any, sid: int, deadline: float | None) -> _GraphState | None:
        TB = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase
        fn = TB.grad_fn.__get__(t)
        if fn is None:
            return None
        nodes: set[int] = set()
        saved: dict[int, tuple[str, int]] = {}
        keep: list[Any] = []
        names: dict[int, tuple[str, ...]] = {}
        stack = [fn]
        first_cell = self._storages[sid].first_cell
        while stack:
            node = stack.pop()
            if id(node) in nodes:
                continue
            nodes.add(id(node))
            keep.append(node)
            if deadline is not None and not len(nodes) & 255 and time.perf_counter() > deadline:
                break
            for x in self._saved(node, names, keep):
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
                    n = -(-n // CUDA_BLOCK) * CUDA_BLOCK
                g = self._sid(s, dev, n, first_cell)
                if g != sid:
                    saved[g] = (dev, n)
            try:
                nxt = node.next_functions
            except Exception:
                continue
            stack.extend(n for n, _ in nxt if n is not None)
        return _GraphState(weakref.ref(t), saved)

    @staticmethod
    def _saved(node: Any, names: dict[int, tuple[str, ...]], keep: list[Any]) -> list[Any]:
        t = type(node)
        attrs = names.get(id(t))
        if attrs is None:
            attrs = names[id(t)] = tuple(a for a in dir(t) if a.startswith("_raw_saved_"))
        out: list[Any] = []
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
                out.append(x)
        return out

    def graph_totals(self, held: Mapping[int, Held]) -> dict[str, int]:
        """Bytes per device of the walked graphs still alive that no name holds, each storage once."""
        seen: set[int] = set()
        out: dict[str, int] = {}
        for sid in held:
            st = self._storages.get(sid)
            if st is None or st.graph is None:
                continue
            for g, (dev, n) in st.graph.saved.items():
                if g in seen or g in held:
                    continue
                gs = self._storages.get(g)
                if gs is None or gs.ref() is None:
                    continue
                seen.add(g)
                out[dev] = out.get(dev, 0) + n
        return out

    def young_unlocated(self, scan: Scan) -> dict[str, int]:
        """Bytes per device of tensors in the young GC generations that no root or walked graph reaches.

        Tensors a cell made and kept are young until a collection of an older generation promotes
        them; the engine asks this only when none ran during the cell.
        """
        torch = self._torch()
        if torch is None:
            return {}
        TB = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase
        objs = gc.get_objects(generation=0) + gc.get_objects(generation=1)
        types_by_id = dict(zip(map(id, map(type, objs)), map(type, objs)))
        tensor_type_ids = {i for i, t in types_by_id.items() if reach.derives(t, TB)}
        if not tensor_type_ids:
            return {}
        tensors = list(compress(objs, map(tensor_type_ids.__contains__, map(id, map(type, objs)))))
        del objs
        located = set(scan.storages)
        for sid in scan.storages:
            st = self._storages.get(sid)
            if st is not None and st.graph is not None:
                located.update(st.graph.saved)
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
                    known = self._by_obj.get(id(s))
                    if known is not None and known in located and self._storages[known].ref() is s:
                        continue
                    dev = str(TB.device.__get__(t))
                    out[dev] = out.get(dev, 0) + int(s.nbytes())
                except Exception:
                    continue
        return out


# -- findings: pure functions over scans ----------------------------------------------------------------
def deletable(h: Held) -> tuple[str, ...]:
    """The top-level variables among the holders: what ``del`` would remove to free the storage."""
    names = {root_name(p) for p, k in zip(h.holders, h.holder_kinds) if k is HolderKind.NAMESPACE}
    return tuple(sorted(n for n in names if n.isidentifier() and not is_output_name(n)))


def hint_for(h: Held, graph_bytes: int, *, lost: Sequence[str] = (), shared: Sequence[str] = (),
             group: int = 0) -> str:
    """One line that says why the memory is held and what frees it, fitted to the kind of holder."""
    name = h.name
    if lost:
        return (f"{', '.join(lost)} was deleted or rebound, but {name} still holds it: delete `{root_name(name)}` "
                f"too to free it")
    if h.kind is HolderKind.OUTPUT:
        graph = f" (with its autograd graph, {fmt_bytes(graph_bytes)})" if graph_bytes else ""
        return f"kept by the output history{graph}: %cudamem clean --outputs, or end the line with `;`"
    if h.kind is HolderKind.TRACEBACK:
        return "kept by the last exception's frames: %cudamem clean --traceback (ends %debug for it)"
    if h.kind is HolderKind.MODULE:
        return f"an attribute of the module `{root_name(name)}`: `del {name}` or set it to None"
    if shared:
        return (f"its autograd graph is shared with {', '.join(shared)}: free both (keep `.item()` or "
                f"`.detach()` instead) or little comes back")
    if group:
        where = _container(name)
        if graph_bytes:
            return (f"{group:,} small tensors and their graphs ({fmt_bytes(graph_bytes)}) in `{where}`: keep "
                    f"numbers (`.item()`) or `.detach()` instead, or clear it")
        return f"{group:,} small tensors in `{where}`: clear it, or `del {root_name(where)}`"
    if ROLE_GRAD in h.roles and name.endswith(".grad"):
        return "a gradient: opt.zero_grad(set_to_none=True) frees gradients between steps"
    roots = sorted({root_name(p) for p in h.holders})
    if ROLE_PARAM in h.roles:
        if _OPTIMIZER_STEP.search(name):  # no module path reaches it: its model is gone, the optimizer is not
            return (f"a parameter only `{root_name(name)}` still holds (its model was deleted or rebound): "
                    f"delete `{root_name(name)}` or make it again for the new model")
        others = [r for r in deletable(h) if r != root_name(name)]
        also = f", also held by {', '.join(others)}" if others else ""
        if HolderKind.TRACEBACK in h.holder_kinds:
            also += " and the last exception's frames (%cudamem clean --traceback)"
        move = f", or `{root_name(name)}.cpu()` moves it" if h.device.startswith("cuda") else ""
        return f"part of `{root_name(name)}`{also}: deleting {'them' if also else 'it'} frees it{move}"
    if ROLE_OPTIM in h.roles:
        return f"optimizer state: it lives as long as `{root_name(name)}` does"
    if graph_bytes:
        return f"holds its autograd graph ({fmt_bytes(graph_bytes)}): keep `.item()` or `.detach()` instead"
    if len(roots) > 1:
        return f"held by {len(roots)} names ({', '.join(roots)}): deleting one frees nothing"
    return f"`del {roots[0]}` frees it" if roots and roots[0].isidentifier() else ""


def _is_view(h: Held) -> bool:
    slack = CUDA_BLOCK if h.device.startswith("cuda") else 1
    return h.span_bytes + slack <= h.nbytes


def _finding(h: Held, cell: int, graphs: Mapping[int, Graph], lost: Sequence[str] = ()) -> Finding:
    g = graphs.get(h.sid)
    gb = g.nbytes if g else 0
    return Finding(cell, h.name, h.holders, h.kind, h.device, h.nbytes, gb, h.holds_graph, 1,
                   h.span_bytes if _is_view(h) else None, (), hint_for(h, gb, lost=lost), deletable(h),
                   f"{h.device}:{h.sid}")


def _group(members: list[Held], cell: int, graphs: Mapping[int, Graph]) -> Finding:
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
                   deletable(first), f"{first.device}:g{first.sid}")


def _with_groups(candidates: Sequence[Held], cell: Callable[[Sequence[Held]], int], threshold: int,
                 graphs: Mapping[int, Graph], lost: Mapping[int, Sequence[str]],
                 cache: dict[int, tuple[Held, int, Finding]] | None = None) -> list[Finding]:
    """Findings for storages over the threshold, and for containers of small ones that together pass it.

    ``cache`` keeps the finding of a storage whose record and graph did not change since the last call.
    """
    out: list[Finding] = []
    members: dict[int, Held] = {}
    small: dict[tuple[str, str, HolderKind], list[Held]] = {}
    for h in candidates:
        g = graphs.get(h.sid)
        gb = g.nbytes if g else 0
        if h.nbytes + gb >= threshold:
            hit = cache.get(h.sid) if cache is not None else None
            if hit is not None and hit[0] is h and hit[1] == gb:
                f = hit[2]
            else:
                f = _finding(h, cell([h]), graphs, lost.get(h.sid, ()))
                if cache is not None:
                    cache[h.sid] = (h, gb, f)
            members[id(f)] = h
            out.append(f)
        elif h.holders and h.container != h.name:
            small.setdefault((h.container, h.device, h.kind), []).append(h)
    for group in small.values():
        if len(group) > 1:
            f = _group(group, cell(group), graphs)
            if f.bytes >= threshold:
                out.append(f)
    _mark_shared(out, members, graphs)
    out.sort(key=lambda f: -f.bytes)
    return out


def _mark_shared(out: list[Finding], members: Mapping[int, Held], graphs: Mapping[int, Graph]) -> None:
    """A graph whose saved tensors several findings keep alive is named under each of them."""
    keepers: dict[int, list[int]] = {}  # saved storage -> findings (their index in out) that keep it
    for i, f in enumerate(out):
        h = members.get(id(f))
        g = graphs.get(h.sid) if h is not None else None
        if g is not None:
            for s in g.saved:
                keepers.setdefault(s, []).append(i)
    shared: dict[int, dict[int, None]] = {}
    for idx in keepers.values():
        if len(idx) > 1:
            for i in idx:
                shared.setdefault(i, {}).update(dict.fromkeys(j for j in idx if j != i))
    for i, others in shared.items():
        f = out[i]
        names = tuple(out[j].name for j in others)[:MAX_HOLDERS]
        out[i] = replace(f, graph_shared_with=names, hint=hint_for(members[id(f)], f.graph_bytes, shared=names))


def findings(cur: Scan, prev: Scan | None, cell: int, *, threshold_bytes: int,
             graphs: Mapping[int, Graph]) -> list[Finding]:
    """What ``cell`` added: new storages, and memory whose variable was deleted while something else keeps it.

    A new storage that took the place of a freed one under the same path, no larger (a rebinding to a
    same-size tensor, a gradient re-created by the next step), is not news, unless it keeps an autograd
    graph of ``threshold_bytes`` or more (``loss`` of an evaluation run without ``no_grad``); nor is a
    new name for memory that was already there (a loop variable bound to the last batch): it adds
    nothing. A variable that reached the memory only through an object another name still holds (an
    iterator over a dataset still named) kept nothing of its own: losing it is not news either.
    """
    prev_storages = prev.storages if prev is not None else {}
    prev_at: dict[str, Held] = {}
    for h in prev_storages.values():
        for p in h.holders:
            prev_at.setdefault(p, h)
    candidates: list[Held] = []
    lost_by: dict[int, Sequence[str]] = {}
    for sid, h in cur.storages.items():
        before = prev_storages.get(sid)
        if before is h:
            continue  # a storage nobody re-walked: the same record, nothing new
        if before is None:
            replaced = [prev_at[x] for x in h.holders if x in prev_at]
            g = graphs.get(sid)
            if g is not None and g.nbytes >= threshold_bytes:  # `loss` rebound to a loss that keeps its graph
                candidates.append(h)
            elif not any(r.sid not in cur.storages and r.nbytes >= h.nbytes for r in replaced):
                candidates.append(h)
            continue
        lost = [r for r in sorted(set(deletable(before)) - h.roots)
                if not all(_through_kept(p, h.holders) for p in before.holders if root_name(p) == r)]
        if lost:
            candidates.append(h)
            lost_by[sid] = lost
    return _with_groups(candidates, lambda _hs: cell, threshold_bytes, graphs, lost_by)


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


def graph_candidates(cur: Scan, prev: Scan | None) -> list[int]:
    """Storages whose graphs a cell's findings may need: new ones, and those whose holders changed."""
    prev_storages = prev.storages if prev is not None else {}
    out = []
    for sid, h in cur.storages.items():
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
    return _with_groups(list(cur.storages.values()), lambda hs: min(h.first_cell for h in hs), threshold_bytes,
                        graphs, {}, cache)


__all__ = ["Graph", "Held", "Root", "Scan", "Scanner", "current", "deletable", "findings", "graph_candidates",
           "hint_for"]
