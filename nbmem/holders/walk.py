"""Walking: from the notebook's roots to every live tensor, breadth first, without running user code.

A walk goes root by root (a variable, an output, a traceback frame's local, a module's attribute) and
reads objects only through ``reach``. It records, for every object it meets, the step that reached it
(``naming`` turns steps into text, only for the tensors found), and keeps every object alive until it
is dropped, so ids stay unique while it runs. Big containers of plain data are proven tensor-free at C
speed instead of being walked in Python. What to do with each type is decided once per type.
"""

from __future__ import annotations

import enum
import functools
import sys
import time
import types
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nbmem.holders import inside, intent, reach
from nbmem.holders.naming import L_ATTR, L_INDEX, L_KEY, L_ROOT, L_TEXT, L_TKEY, MAX_HOLDERS
from nbmem.records import PAGED, HolderKind

#: Containers at least this long are first tried as a whole, at C speed.
BULK_MIN = 64


class Strategy(enum.Enum):
    """How a walk reads an object, decided once per type (``classify``); ``Walk._visit`` has a branch for each."""

    SKIP = "nothing in it can hold a tensor: atoms, descriptors, weak references, a library's objects"
    TENSOR = "a tensor: its storage, a sparse tensor's parts, its gradient, a subclass's attributes"
    DICT = "a dict's items, then its attributes"
    SEQ = "a list, tuple or deque's elements, then its attributes"
    SET = "a set's elements, then its attributes"
    NNMOD = "an nn.Module's parameters, buffers, submodules and attributes"
    FUNC = "a function's closure cells, defaults and attributes"
    METHOD = "a bound method's object and function"
    PARTIAL = "a functools.partial's function and arguments"
    PYMOD = "a user's own module's attributes (sys.modules' are roots of their own)"
    CLASS = "a user class's own attributes (a library's class is not walked)"
    GEN = "a suspended generator's or coroutine's locals"
    CELL = "a closure cell's contents"
    EXC = "an exception's args and attributes"
    LRU = "an lru_cache's cached results"
    REFS = "what a C iterator or a dict view references"
    OBJ = "an instance's attributes and slots"
    ARRAY = "the objects in a numpy array of dtype object"
    FRAME = "the object columns of a pandas frame or series"


# The strategies as module globals, tested by identity in ``Walk._visit``'s chain: as fast as comparing plain
# ints, where ``Strategy.DICT`` would look the member up on the class at every object (tests/test_holders.py
# checks each name is its member).
(_SKIP, _TENSOR, _DICT, _SEQ, _SET, _NNMOD, _FUNC, _METHOD, _PARTIAL, _PYMOD, _CLASS, _GEN, _CELL, _EXC,
 _LRU, _REFS, _OBJ, _ARRAY, _FRAME) = Strategy
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
_CELL_CONTENTS: Any = inside.CELL_CONTENTS
# Roles of a tensor, for hints.
ROLE_GRAD, ROLE_PARAM, ROLE_OPTIM = "grad", "param", "optimizer state"
#: A quantized weight's statistics (bitsandbytes' absmax and code tables): part of the weight, not another tensor.
ROLE_QUANT = "quantization state"


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
    strategy: Strategy
    layout: reach.Layout | None = None
    optimizer: bool = False
    state: str = ""  # intent.state_of the type: "model", "optimizer", ... or ""

    @property
    def module(self) -> bool:
        return self.strategy is _NNMOD

    @property
    def dict(self) -> bool:
        return self.strategy is _DICT

    @property
    def generator(self) -> bool:
        return self.strategy is _GEN

    @property
    def object_(self) -> bool:
        """An object a walk reads by its attributes or its references (an iterator may be one)."""
        return self.strategy in (_REFS, _OBJ)


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

    __slots__ = ("device", "ephemeral", "grad_fn", "logical", "node", "role", "span", "storage", "tensor")

    def __init__(self, tensor: Any, storage: Any, node: int, span: int, device: str, grad_fn: bool, role: str,
                 ephemeral: bool, logical: tuple[tuple[int, ...], str] | None = None) -> None:
        self.tensor, self.storage, self.node, self.span = tensor, storage, node, span
        self.device, self.grad_fn, self.role, self.ephemeral = device, grad_fn, role, ephemeral
        self.logical = logical  # a quantized weight's shape and format, where its bytes pack several


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
        array = self.info(type(r.obj)).strategy is _ARRAY
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
        if s is _SKIP:
            return
        if s is _TENSOR:
            self._tensor(obj, node, root, info)
        elif s is _DICT:
            plain = reach.is_plain(obj)
            if plain and dict.__len__(obj) >= BULK_MIN and self._inert(obj):
                return
            self._dict(reach.dict_items(obj), node, root)
            self._instance(obj, node, root, info, plain=plain)
        elif s is _SEQ or s is _SET:
            plain = reach.is_plain(obj)
            if plain and len(obj) >= BULK_MIN and self._inert(obj):
                return
            items = obj if type(obj) is list or type(obj) is tuple else reach.seq_items(obj)
            label, kind = (L_INDEX, None) if s is _SEQ else (L_TEXT, "{…}")
            for i, v in enumerate(items):
                if i and not i & 4095 and self.out_of_time():
                    return
                add(v, node, label, i if kind is None else kind, root)
            self._instance(obj, node, root, info, plain=plain)
        elif s is _NNMOD:
            d = reach.instance_dict(obj, info.layout) if info.layout else None
            if d is None:
                return
            for sub in ("_parameters", "_buffers", "_modules"):
                inner = d.get(sub)
                if type(inner) is dict:
                    for k, v in reach.dict_items(inner):
                        add(v, node, L_ATTR, k, root)
                elif sub != "_modules" and inner is not None:  # a TorchScript module: they live in C++
                    for k, v in inside.script_tensors(self.torch, d, sub):
                        add(v, node, L_ATTR, k, root)
            for k, v in reach.dict_items(d):
                if type(k) is not str or k not in ("_parameters", "_buffers", "_modules"):  # no key's __eq__
                    add(v, node, L_ATTR, k, root)
        elif s is _FUNC:
            for v, lk, lv in inside.function_refs(obj):
                add(v, node, lk, lv, root)
        elif s is _METHOD:
            add(types.MethodType.__self__.__get__(obj), node, L_ATTR, "__self__", root)
            add(types.MethodType.__func__.__get__(obj), node, L_ATTR, "__func__", root)
        elif s is _PARTIAL:
            p = functools.partial
            add(p.func.__get__(obj), node, L_ATTR, "func", root)
            for i, v in enumerate(p.args.__get__(obj) or ()):
                add(v, node, L_TEXT, f".args[{i}]", root)
            for k, v in reach.dict_items(p.keywords.__get__(obj) or {}):
                add(v, node, L_TEXT, f".keywords[{reach.key_label(k)}]", root)
        elif s is _LRU:  # a cache of results: in its own dict (maxsize=None), else linked from the wrapper
            own = reach.instance_dict(obj, info.layout) if info.layout else None
            for v in reach.referents(obj):
                if v is not own and type(v) is not type and type(v) is not types.FunctionType:
                    add(v, node, L_TEXT, ".<lru_cache>" if type(v) is dict else ".<lru_cache>[…]", root)
            self._instance(obj, node, root, info, plain=False)
        elif s is _REFS:
            for v in reach.referents(obj):
                if type(v) is not type:
                    add(v, node, L_TEXT, ".<iterator>", root)
        elif s is _PYMOD:
            if self._in_sys_modules(obj) or not reach.is_user_module(obj):
                return  # modules in sys.modules are roots of their own; libraries are not walked
            self._dict(reach.dict_items(reach.module_dict(obj) or {}), node, root, attrs=True)
        elif s is _CLASS:
            if reach.is_library_module(reach.type_module(obj)):
                return
            for k, v in reach.own_items(obj):
                if type(k) is str and not k.startswith("__"):
                    add(v, node, L_ATTR, k, root)
        elif s is _GEN:
            for v in reach.generator_locals(obj):
                add(v, node, L_TEXT, ".<suspended local>", root)
        elif s is _CELL:
            try:
                add(_CELL_CONTENTS.__get__(obj), node, L_TEXT, "", root)
            except ValueError:  # an empty cell
                pass
        elif s is _ARRAY:
            for v in self._objects(obj):
                add(v, node, L_TEXT, "[…]", root)
        elif s is _FRAME:
            d = reach.instance_dict(obj, info.layout) if info.layout else None
            for a in inside.frame_arrays(d.get("_mgr") if d is not None else None, self._is_array):
                for v in self._objects(a):
                    add(v, node, L_TEXT, ".<values>[…]", root)
        elif s is _EXC:
            for i, v in enumerate(BaseException.__dict__["args"].__get__(obj)):
                add(v, node, L_TEXT, f".args[{i}]", root)
            self._instance(obj, node, root, info, plain=False)
        else:
            self._instance(obj, node, root, info, plain=False)

    def _is_array(self, t: type) -> bool:
        return self.info(t).strategy is _ARRAY

    def _objects(self, arr: Any) -> list[Any]:
        """The objects in a numpy array of dtype object; a long run of plain data proven inert is none."""
        items = inside.array_objects(arr, ARRAY_MAX)
        return [] if len(items) >= BULK_MIN and self._inert(items) else items

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
                if self.info(type(k)).strategy is _TENSOR:
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
        if not plain and info.layout is not None:
            self._attrs(obj, reach.instance_dict(obj, info.layout), node, root, info.layout)

    def _attrs(self, obj: Any, d: dict[Any, Any] | None, node: int, root: int, lay: reach.Layout, *,
               tensor: bool = False) -> None:
        """An object's attributes: its instance dict ``d`` (read already), a shadowed dict's values, its slots."""
        if d is not None:
            for k, v in reach.dict_items(d):
                # A weight's attribute back to a module already walked (bitsandbytes' ``weight.module``) adds
                # no memory, only a second path to every tensor of that module.
                if not (tensor and id(v) in self.node_of and self.info(type(v)).module):
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

    def _tensor(self, t: Any, node: int, root: int, info: _TypeInfo) -> None:
        TB = self.TB
        layout = TB.layout.__get__(t)
        lay = info.layout if info.layout is not None and reach.is_heap(type(t)) else None
        d = reach.instance_dict(t, lay) if lay is not None else None  # read once: its marks, then its attributes
        if layout is not self.torch.strided:
            for part, label in inside.sparse_parts(self.torch, TB, t, layout):
                self._add(part, node, L_TEXT, label, root)
        else:
            try:
                st = TB.untyped_storage(t)
                n = int(st.nbytes())
                ptr = int(st.data_ptr())
            except Exception:  # meta, functional or wrapper tensors have no plain storage
                st, n, ptr = None, 0, 0
            if st is not None and n > 0 and ptr != 0:
                paged = inside.paged_device(d) if d else None
                dev = str(TB.device.__get__(t)) if paged is None else f"{PAGED}cuda:{paged}"
                ours = self.lk[node] == L_TEXT  # our own label text; other labels may be user objects
                # A Parameter is one whichever path reached it first (the optimizer's state is keyed by them).
                is_param = reach.derives(type(t), self.Param) or self._is_param(node)
                role = ROLE_PARAM if is_param else ROLE_GRAD if ours and self.lv[node] == ".grad" else ""
                # opt.state[param]['exp_avg']: the tensor's dict is a value keyed by a tensor in the optimizer's state
                if not role and _ancestor(self, node, 3, lambda t: self.info(t).optimizer):
                    role = ROLE_OPTIM
                elif not role and _ancestor(self, node, 2, _is_quant_state):  # weight.quant_state(.state2).absmax
                    role = ROLE_QUANT
                span = int(TB.nbytes.__get__(t))
                # A sparse tensor's parts are new tensor objects at every access: not worth watching.
                ephemeral = ours and self.lv[node] in SPARSE_LABELS
                self.found.append(_Found(t, st, node, span, dev, TB.grad_fn.__get__(t) is not None, role, ephemeral,
                                         inside.quantized_shape(d) if d else None))
        if TB.is_leaf.__get__(t):
            g = TB._grad.__get__(t) if hasattr(TB, "_grad") else None
            if g is not None:
                self._add(g, node, L_TEXT, ".grad", root)
        if lay is not None:
            self._attrs(t, d, node, root, lay, tensor=True)

    def is_module(self, node: int) -> bool:
        """Whether the node is an ``nn.Module``."""
        return self.info(type(self.keep[node])).module

    def _is_param(self, node: int) -> bool:
        p = self.parent[node]
        return p >= 0 and self.lk[node] == L_ATTR and self.is_module(p)


def _ancestor(w: Walk, node: int, steps: int, test: Callable[[type], bool]) -> bool:
    """Whether one of the node's first ``steps`` parents is of a type ``test`` accepts."""
    p = w.parent[node]
    for _ in range(steps):
        if p < 0:
            return False
        if test(type(w.keep[p])):
            return True
        p = w.parent[p]
    return False


def _is_quant_state(t: type) -> bool:
    """bitsandbytes' statistics of a 4-bit weight (its absmax and code tables)."""
    return reach.type_name(t) == "QuantState" and reach.type_module(t).startswith("bitsandbytes")
