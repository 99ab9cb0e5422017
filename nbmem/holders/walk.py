"""Walking: from the notebook's roots to every live tensor, breadth first, without running user code.

A walk goes root by root (a variable, an output, a traceback frame's local, a module's attribute) and
reads objects only through ``reach``. It records, for every object it meets, the step that reached it
(``naming`` turns steps into text, only for the tensors found), and keeps every object alive until it
is dropped, so ids stay unique while it runs. Big containers of plain data are proven tensor-free at C
speed instead of being walked in Python. What to do with each type is decided once per type.
"""

from __future__ import annotations

import functools
import sys
import time
import types
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nbmem.holders import intent, reach
from nbmem.holders.naming import L_ATTR, L_INDEX, L_KEY, L_ROOT, L_TEXT, L_TKEY, MAX_HOLDERS, PathBuilder
from nbmem.records import HolderKind

#: Containers at least this long are first tried as a whole, at C speed.
BULK_MIN = 64
# Walk strategies, decided once per type.
(_SKIP, _TENSOR, _DICT, _SEQ, _SET, _NNMOD, _FUNC, _METHOD, _PARTIAL, _PYMOD, _CLASS, _GEN, _CELL, _EXC,
 _LRU, _REFS, _OBJ, _ARRAY, _FRAME) = range(19)
#: numpy's array and pandas' frames and series: libraries, but their object columns can hold tensors.
_ARRAY_BASE, _FRAME_BASE = ("numpy", "ndarray"), ("pandas.core.generic", "NDFrame")
#: The most elements of one object array read (a longer one is read up to here).
ARRAY_MAX = 1 << 20
#: C objects whose only way in is what they reference (gc.get_referents, C code): iterators over a
#: container (``iter(batches)``, ``zip(xs, ys)``, ``itertools.cycle(loader)``) and a dict's views.
_ITERATOR_MODULES = ("itertools", "_collections", "collections")
_VIEWS = frozenset({"zip", "map", "filter", "enumerate", "reversed", "dict_keys", "dict_values", "dict_items"})
#: A sparse tensor's parts, as labelled in paths.
SPARSE_LABELS = frozenset({".indices()", ".values()", ".crow_indices()", ".col_indices()", ".ccol_indices()",
                           ".row_indices()"})
_CELL_CONTENTS: Any = vars(types.CellType)["cell_contents"]
# Roles of a tensor, for hints.
ROLE_GRAD, ROLE_PARAM, ROLE_OPTIM = "grad", "param", "optimizer state"


@dataclass(frozen=True, slots=True)
class Root:
    """Where a walk starts: a path a user recognises, its kind, and the object (only during a scan)."""

    path: str
    kind: HolderKind
    obj: Any


_INERT_TYPES = (weakref.ProxyType, weakref.CallableProxyType, types.CodeType, types.FrameType,
                types.TracebackType, property, staticmethod, classmethod, types.BuiltinFunctionType,
                types.MethodDescriptorType, types.WrapperDescriptorType, types.GetSetDescriptorType,
                types.MemberDescriptorType, types.MappingProxyType)


@dataclass
class _TypeInfo:
    strategy: int
    layout: reach.Layout | None = None
    optimizer: bool = False
    state: str = ""  # intent.state_of the type: "model", "optimizer", ... or ""


def classify(t: type, tensor_base: type, module_base: type | None, optim_base: type | None) -> _TypeInfo:
    """How a walk reads instances of ``t``: decided once per type, from type-level data only."""
    info = _strategy(t, tensor_base, module_base, optim_base)
    if info.strategy not in (_SKIP, _TENSOR):
        info.state = intent.state_of(t)
    return info


def _strategy(t: type, tensor_base: type, module_base: type | None, optim_base: type | None) -> _TypeInfo:
    if reach.is_atom_type(t):
        return _TypeInfo(_SKIP)
    d = reach.derives
    if d(t, tensor_base):
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
    if module_base is not None and d(t, module_base):
        return _TypeInfo(_NNMOD, lay)
    for base, s in ((dict, _DICT), (list, _SEQ), (tuple, _SEQ), (deque, _SEQ), (set, _SET), (frozenset, _SET)):
        if d(t, base):
            return _TypeInfo(s, lay)
    if d(t, BaseException):
        return _TypeInfo(_EXC, lay)
    mod, name = reach.type_module(t), reach.type_name(t)
    bases = {(reach.type_module(c), reach.type_name(c)) for c in reach.mro(t)}
    if _ARRAY_BASE in bases:
        return _TypeInfo(_ARRAY)
    if _FRAME_BASE in bases:
        return _TypeInfo(_FRAME, lay)
    if mod == "functools" and name in ("partial", "_lru_cache_wrapper"):
        return _TypeInfo(_PARTIAL if name == "partial" else _LRU, lay)
    if not reach.is_heap(t) and (name in _VIEWS or (name.endswith("iterator") and mod == "builtins")
                                 or (mod in _ITERATOR_MODULES and not lay.slots and lay.dict_get is None)):
        return _TypeInfo(_REFS)
    if reach.is_library_module(mod) or (not reach.is_heap(t) and not lay.slots and lay.dict_get is None):
        return _TypeInfo(_SKIP)
    return _TypeInfo(_OBJ, lay, optimizer=optim_base is not None and d(t, optim_base))


class _Found:
    """A tensor met in the walk."""

    __slots__ = ("device", "ephemeral", "grad_fn", "node", "role", "span", "storage", "tensor")

    def __init__(self, tensor: Any, storage: Any, node: int, span: int, device: str, grad_fn: bool, role: str,
                 ephemeral: bool) -> None:
        self.tensor, self.storage, self.node, self.span = tensor, storage, node, span
        self.device, self.grad_fn, self.role, self.ephemeral = device, grad_fn, role, ephemeral


class Walk:
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
        # Every other way to a node, unbounded, as the parent's node (``~root`` for a root bound to it): what
        # the training state a root reaches is read from (``state_reached``); ``aliases`` keeps only a few.
        self.up: dict[int, list[int]] = {}
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
        return classify(t, self.TB, self._module_base, self._optim_base)

    # -- nodes ----------------------------------------------------------------------------------------
    def root(self, r: Root) -> None:
        self.roots.append(r)
        # numpy's arrays are not tracked by the collector, even those holding objects: as a root, one is walked
        array = self.info(type(r.obj)).strategy == _ARRAY
        self._add(r.obj, -1, L_ROOT, len(self.roots) - 1, len(self.roots) - 1, array)

    def _add(self, obj: Any, parent: int, lk: int, lv: Any, root: int, untracked: bool = False) -> int | None:
        if not untracked and not reach.is_tracked(obj):
            return None  # atoms, and containers of atoms only: nothing can hide there
        oid = id(obj)
        node = self.node_of.get(oid)
        if node is not None:
            # Another way to the same object (a second root bound to it counts too): a path, not a walk.
            if parent != self.parent[node] or lv is not self.lv[node]:
                self.up.setdefault(node, []).append(parent if parent >= 0 else ~lv)
                al = self.aliases.setdefault(node, [])
                # A name the user bound to it is always kept: a trainer's many ways to the model must not
                # crowd out `model` itself.
                if len(al) < MAX_HOLDERS or parent < 0:
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
    def _in_sys_modules(self, m: Any) -> bool:
        """Whether a module is one of ``sys.modules``: found under its own name first (``torch``, which a cell
        that names it walks each time), else among them all, gathered once per walk."""
        d = reach.module_dict(m)
        name = d.get("__name__") if d is not None else None
        if type(name) is str and sys.modules.get(name) is m:
            return True
        if self._sys_modules is None:
            self._sys_modules = {id(x) for x in list(sys.modules.values())}
        return id(m) in self._sys_modules

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
            label, kind = (L_INDEX, None) if s == _SEQ else (L_TEXT, "{…}")
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
                        add(v, node, L_ATTR, k, root)
                elif sub != "_modules" and inner is not None:  # a TorchScript module: they live in C++
                    for k, v in self._script_tensors(d, sub):
                        add(v, node, L_ATTR, k, root)
            for k, v in reach.dict_items(d):
                if type(k) is not str or k not in ("_parameters", "_buffers", "_modules"):  # no key's __eq__
                    add(v, node, L_ATTR, k, root)
        elif s == _FUNC:
            self._function(obj, node, root)
        elif s == _METHOD:
            add(types.MethodType.__self__.__get__(obj), node, L_ATTR, "__self__", root)
            add(types.MethodType.__func__.__get__(obj), node, L_ATTR, "__func__", root)
        elif s == _PARTIAL:
            p = functools.partial
            add(p.func.__get__(obj), node, L_ATTR, "func", root)
            for i, v in enumerate(p.args.__get__(obj) or ()):
                add(v, node, L_TEXT, f".args[{i}]", root)
            for k, v in reach.dict_items(p.keywords.__get__(obj) or {}):
                add(v, node, L_TEXT, f".keywords[{reach.key_label(k)}]", root)
        elif s == _LRU:  # a cache of results: in its own dict (maxsize=None), else linked from the wrapper
            own = reach.instance_dict(obj, info.layout) if info.layout else None
            for v in reach.referents(obj):
                if v is not own and type(v) is not type and type(v) is not types.FunctionType:
                    add(v, node, L_TEXT, ".<lru_cache>" if type(v) is dict else ".<lru_cache>[…]", root)
            self._instance(obj, node, root, info, plain=False)
        elif s == _REFS:
            for v in reach.referents(obj):
                if type(v) is not type:
                    add(v, node, L_TEXT, ".<iterator>", root)
        elif s == _PYMOD:
            if self._in_sys_modules(obj) or not reach.is_user_module(obj):
                return  # modules in sys.modules are roots of their own; libraries are not walked
            self._dict(reach.dict_items(reach.module_dict(obj) or {}), node, root, attrs=True)
        elif s == _CLASS:
            if reach.is_library_module(reach.type_module(obj)):
                return
            for k, v in reach.own_items(obj):
                if type(k) is str and not k.startswith("__"):
                    add(v, node, L_ATTR, k, root)
        elif s == _GEN:
            for v in reach.generator_locals(obj):
                add(v, node, L_TEXT, ".<suspended local>", root)
        elif s == _CELL:
            try:
                add(_CELL_CONTENTS.__get__(obj), node, L_TEXT, "", root)
            except ValueError:  # an empty cell
                pass
        elif s == _ARRAY:
            for v in self._array_objects(obj):
                add(v, node, L_TEXT, "[…]", root)
        elif s == _FRAME:
            for a in self._frame_arrays(obj, info):
                for v in self._array_objects(a):
                    add(v, node, L_TEXT, ".<values>[…]", root)
        elif s == _EXC:
            for i, v in enumerate(BaseException.__dict__["args"].__get__(obj)):
                add(v, node, L_TEXT, f".args[{i}]", root)
            self._instance(obj, node, root, info, plain=False)
        else:
            self._instance(obj, node, root, info, plain=False)

    def _script_tensors(self, d: dict[Any, Any], sub: str) -> list[tuple[str, Any]]:
        """A TorchScript module's parameters or buffers (``torch.jit.trace``, ``torch.jit.script``), read from its
        C++ module (``_c``) by torch's own accessors: compiled code, not the user's."""
        C = self.torch._C
        c = d.get("_c")
        if type(c) is not getattr(C, "ScriptModule", None):
            return []
        read = C.ParameterDict if sub == "_parameters" else C.BufferDict
        return [(k, v) for k, v in read(c).items() if type(k) is str]

    def _array_objects(self, arr: Any) -> list[Any]:
        """The objects in a numpy array of dtype object (numpy's own C methods; other dtypes hold no objects)."""
        np = sys.modules.get("numpy")
        if np is None:
            return []
        nd = np.ndarray
        if vars(nd)["dtype"].__get__(arr).kind != "O":
            return []
        # As a plain ndarray first: a subclass's view or copy would run its __array_finalize__.
        flat = nd.ravel(arr if type(arr) is nd else nd.view(arr, nd))
        items = nd.tolist(flat[:ARRAY_MAX] if int(vars(nd)["size"].__get__(flat)) > ARRAY_MAX else flat)
        return [] if len(items) >= BULK_MIN and self._inert(items) else items

    def _frame_arrays(self, obj: Any, info: _TypeInfo) -> list[Any]:
        """A pandas frame's or series' blocks of values: its manager (``_mgr``), the manager's blocks and their
        arrays, found by what each references (C-level; no pandas property runs)."""
        d = reach.instance_dict(obj, info.layout) if info.layout else None
        todo = [d.get("_mgr")] if d is not None else []
        arrays = []
        for _ in range(3):  # manager -> tuple of blocks -> block -> array
            nxt = []
            for x in todo:
                for r in reach.referents(x):
                    t = type(r)
                    if self.info(t).strategy == _ARRAY:
                        arrays.append(r)
                    elif t is tuple or reach.type_module(t).startswith("pandas.core.internals"):
                        nxt.append(r)
            todo = nxt
        return arrays

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
                    add(k, node, L_TEXT, ".keys()[…]", root)
                    add(v, node, L_TKEY, k, root)
                else:
                    add(k, node, L_TEXT, f".keys()[{reach.key_label(k)}]", root)
                    add(v, node, L_KEY, k, root)
            elif attrs:
                if type(k) is not str or not k.startswith("__"):
                    add(v, node, L_ATTR, k, root)
            else:
                add(v, node, L_KEY, k, root)

    def _instance(self, obj: Any, node: int, root: int, info: _TypeInfo, *, plain: bool) -> None:
        if plain or info.layout is None:
            return
        lay = info.layout
        d = reach.instance_dict(obj, lay)
        if d is not None:
            for k, v in reach.dict_items(d):
                self._add(v, node, L_ATTR, k, root)
        elif lay.dict_shadowed:
            for v in reach.referents(obj):  # the real dict is hidden behind user code: values only
                if type(v) is dict:
                    for k, x in reach.dict_items(v):
                        self._add(x, node, L_ATTR, k, root)
                elif type(v) is not type:
                    self._add(v, node, L_TEXT, ".<attribute>", root)
        for k, v in reach.slot_values(obj, lay):
            self._add(v, node, L_ATTR, k, root)

    def _function(self, f: types.FunctionType, node: int, root: int) -> None:
        F: dict[str, Any] = dict(vars(types.FunctionType))
        code = F["__code__"].__get__(f)
        closure = F["__closure__"].__get__(f) or ()
        for name, cell in zip(code.co_freevars, closure):
            try:
                v = _CELL_CONTENTS.__get__(cell)
            except ValueError:
                continue
            self._add(v, node, L_TEXT, f".<closure {name}>", root)
        for i, v in enumerate(F["__defaults__"].__get__(f) or ()):
            self._add(v, node, L_TEXT, f".__defaults__[{i}]", root)
        for k, v in reach.dict_items(F["__kwdefaults__"].__get__(f) or {}):
            self._add(v, node, L_TEXT, f".__kwdefaults__[{reach.key_label(k)}]", root)
        for k, v in reach.dict_items(F["__dict__"].__get__(f)):
            self._add(v, node, L_ATTR, k, root)

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
                ours = self.lk[node] == L_TEXT  # our own label text; other labels may be user objects
                # A Parameter is one whichever path reached it first (the optimizer's state is keyed by them).
                is_param = reach.derives(type(t), self.Param) or self._is_param(node)
                role = ROLE_PARAM if is_param else ROLE_GRAD if ours and self.lv[node] == ".grad" else ""
                if not role and self._under_optimizer_state(node):
                    role = ROLE_OPTIM
                span = int(TB.nbytes.__get__(t))
                # A sparse tensor's parts are new tensor objects at every access: not worth watching.
                ephemeral = ours and self.lv[node] in SPARSE_LABELS
                self.found.append(_Found(t, st, node, span, dev, TB.grad_fn.__get__(t) is not None, role, ephemeral))
        if TB.is_leaf.__get__(t):
            g = TB._grad.__get__(t) if hasattr(TB, "_grad") else None
            if g is not None:
                self._add(g, node, L_TEXT, ".grad", root)
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
            self._add(getattr(TB, meth)(t), node, L_TEXT, label, root)

    def is_module(self, node: int) -> bool:
        """Whether the node is an ``nn.Module``."""
        return self.info(type(self.keep[node])).strategy == _NNMOD

    def _is_param(self, node: int) -> bool:
        p = self.parent[node]
        return p >= 0 and self.lk[node] == L_ATTR and self.is_module(p)

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
            if parent >= 0 and lk == L_KEY and type(lv) is str and w.info(type(w.keep[parent])).strategy == _DICT:
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


def reachable_state(torch: Any, roots: Sequence[Root], types_: reach.TypeCache, *, budget_s: float | None = None,
                    kinds: tuple[type, ...] = ()) -> TrainingState:
    """The outermost ``nn.Module``s, every optimizer and every object of ``kinds`` reachable from ``roots``:
    the state a cell's code can change, which a fit copies and restores; and the iterators it could advance.
    Found by a walk (no user code runs); the caller holds the objects only while it needs them."""
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    w = Walk(torch, types_, deadline)
    with torch._C.DisableTorchFunction():
        for r in roots:
            if not w.run_root(r)[0]:
                break
    found = TrainingState([], [], [], [])
    paths = PathBuilder(w, lambda t: "")
    for node, obj in enumerate(w.keep):
        t = type(obj)
        info = w.info(t)
        if info.optimizer:
            found.optimizers.append(obj)
        elif info.strategy == _NNMOD:
            p = w.parent[node]
            if p < 0 or w.info(type(w.keep[p])).strategy != _NNMOD:
                found.modules.append(obj)
        elif any(reach.derives(t, k) for k in kinds):
            found.others.append(obj)
        elif info.strategy == _GEN or (info.strategy in (_REFS, _OBJ) and _is_iterator(t)):
            found.iterators.append(f"{paths.primary(node)[1]} ({reach.type_name(t)})")
    return found


def _is_iterator(t: type) -> bool:
    """An iterator (its type defines ``__next__``), read from the classes' own namespaces."""
    return any(type(k) is str and k == "__next__" for c in reach.mro(t) for k, _ in reach.own_items(c))
