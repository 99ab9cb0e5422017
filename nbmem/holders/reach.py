"""Reading objects without running their code: the only way the holder scan looks at user objects.

Every object in a notebook may be hostile, huge or deeply nested. So nothing here calls an
object's ``__getattr__``, ``__getattribute__``, ``__len__``, ``__iter__``, ``__eq__``, ``__hash__``,
``__repr__`` or properties, nor ``isinstance`` (which asks ``__class__``):

- types are read through ``type``'s own descriptors (``__mro__``, ``__dict__``, ``__name__``);
- instance state through the C descriptors found on the class: the ``__dict__`` getset and the
  slot members of every class in the MRO;
- containers through their base type's C methods (``list.__iter__(x)``, ``dict.items(x)``), never
  a subclass's override;
- labels through a bounded repr of exact built-in types only (anything else is ``<TypeName>``).
"""

from __future__ import annotations

import enum
import gc
import sys
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

from nbmem.measure import libraries

_mro: Callable[[type], tuple[type, ...]] = type.__dict__["__mro__"].__get__
_own_dict: Callable[[type], Any] = type.__dict__["__dict__"].__get__
_name: Callable[[type], Any] = type.__dict__["__name__"].__get__
_module: Callable[[type], Any] = type.__dict__["__module__"].__get__
_flags: Callable[[type], int] = type.__dict__["__flags__"].__get__
_HEAPTYPE = 1 << 9

GETSET = types.GetSetDescriptorType
MEMBER = types.MemberDescriptorType
is_tracked = gc.is_tracked
referents = gc.get_referents

#: Exact types that hold no references worth following.
ATOMS = frozenset({int, float, complex, bool, str, bytes, bytearray, type(None), range, slice, type(Ellipsis),
                   type(NotImplemented), memoryview})
_ATOM_IDS = frozenset(map(id, ATOMS))
#: Exact built-in containers whose children ``gc.get_referents`` lists completely (bulk descent).
PLAIN = (dict, list, tuple, set, frozenset, deque)
_PLAIN_IDS = frozenset(map(id, PLAIN))


def is_atom_type(t: type) -> bool:
    """By identity: a membership test on a set would hash ``t`` through its metaclass."""
    return id(t) in _ATOM_IDS


def is_plain(obj: Any) -> bool:
    return id(type(obj)) in _PLAIN_IDS


def is_one_of(t: type, choices: tuple[type, ...]) -> bool:
    return any(t is c for c in choices)

#: Libraries whose objects cannot hold the notebook's tensors, or whose walk would only cost time.
SKIP_MODULES = ("IPython", "ipykernel", "nbmem", "traitlets", "zmq", "tornado", "asyncio", "jupyter", "comm",
                "ipywidgets", "anywidget", "matplotlib", "pandas", "numpy", "threading", "logging", "_thread",
                "pygments", "prompt_toolkit", "jedi", "sidecar", "psutil", "pynvml", "concurrent", "socket", "ssl",
                "selectors", "subprocess", "multiprocessing", "torch._C", "torch._ops", "torch.library",
                "torch._tensor_str", "torch.fx", "torch._dynamo", "torch._inductor", "sympy", "typing",
                "enum", "abc", "inspect", "importlib", "collections.abc", "re")


def type_name(t: type) -> str:
    n = _name(t)
    return n if type(n) is str else "?"


def type_module(t: type) -> str:
    try:
        m = _module(t)
    except Exception:  # a heap type whose __module__ was deleted
        return ""
    return m if type(m) is str else ""


def mro(t: type) -> tuple[type, ...]:
    return _mro(t)


def derives(t: type, base: type) -> bool:
    """``issubclass`` by identity over the MRO (no metaclass ``__subclasscheck__``)."""
    return any(c is base for c in _mro(t))


def own_items(t: type) -> list[tuple[Any, Any]]:
    """The class's own namespace, as a list (C iteration of the underlying dict)."""
    return list(_own_dict(t).items())


def is_heap(t: type) -> bool:
    return bool(_flags(t) & _HEAPTYPE)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where an instance of a type keeps its state, found once per type."""

    dict_get: Callable[[Any], Any] | None  # the C __dict__ getter, or None (no dict, or a Python override)
    dict_shadowed: bool  # a Python-level __dict__ (a property, say): the real dict is not safely reachable
    slots: tuple[tuple[str, Callable[[Any], Any]], ...]  # member descriptors of heap classes in the MRO


def layout(t: type) -> Layout:
    dict_get: Callable[[Any], Any] | None = None
    shadowed = False
    seen_dict = False
    slots: list[tuple[str, Callable[[Any], Any]]] = []
    seen_names: set[str] = set()
    for c in _mro(t):
        for k, d in own_items(c):
            if type(k) is not str:
                continue
            if k == "__dict__" and not seen_dict:
                seen_dict = True
                # A C getter, or a C type's slot for its dict (types.SimpleNamespace): no user code either way.
                if type(d) is GETSET or (type(d) is MEMBER and not is_heap(c)):
                    dict_get = d.__get__
                else:
                    shadowed = True  # e.g. a lazy proxy's property: reading it would run its code
            elif type(d) is MEMBER and is_heap(c) and k not in seen_names:
                seen_names.add(k)
                slots.append((k, d.__get__))
    if shadowed:
        # The class hides the C getter; a base class that does not may still have it.
        for c in _mro(t)[1:]:
            d = _own_dict(c).get("__dict__")
            if type(d) is GETSET:
                dict_get, shadowed = d.__get__, False
                break
    return Layout(dict_get, shadowed, tuple(slots))


def instance_dict(obj: Any, lay: Layout) -> dict[Any, Any] | None:
    if lay.dict_get is None:
        return None
    try:
        d = lay.dict_get(obj)
    except Exception:
        return None
    return d if type(d) is dict else None


def dict_of(obj: Any) -> dict[Any, Any] | None:
    """``obj``'s instance dict, read without running its code (its type's layout looked up now); None without."""
    return instance_dict(obj, layout(type(obj)))


def slot_values(obj: Any, lay: Layout) -> Iterator[tuple[str, Any]]:
    for name, get in lay.slots:
        try:
            yield name, get(obj)
        except Exception:  # an unset slot raises AttributeError in C, without __getattr__
            continue


def dict_items(d: Any) -> list[tuple[Any, Any]]:
    return list(dict.items(d))


def seq_items(obj: Any) -> list[Any]:
    """A list, tuple, deque, set or frozenset's elements through the base type's C iterator."""
    for base in (list, tuple, deque, set, frozenset):
        if derives(type(obj), base):
            return list(base.__iter__(obj))
    return []


_STEP = 65536  # children per C call: a few milliseconds, so a deadline is checked often
_DEPTH = 64  # plain containers nested deeper than this (or in a cycle) are left to the ordinary walk


def _children(level: list[Any]) -> Iterator[list[Any]]:
    """The children of plain containers, about ``_STEP`` at a time; a huge container is sliced."""
    lens = list(map(len, level))  # exact built-in types only: C lengths, no user code
    if not lens:
        return
    if max(lens) <= _STEP:
        per = max(1, sum(lens) // len(lens))
        k = max(1, _STEP // per)
        for i in range(0, len(level), k):
            yield referents(*level[i:i + k])
        return
    batch: list[Any] = []
    for c, n in zip(level, lens):
        if n <= _STEP:
            batch.append(c)
            continue
        parts = (dict.keys(c), dict.values(c)) if type(c) is dict else (c,)
        for part in parts:
            it = iter(part)
            while chunk := list(islice(it, _STEP)):
                yield chunk
    if batch:
        yield from _children(batch)


def plain_subtree_is_inert(root: Any, *, max_objects: int, deadline: Callable[[], bool]) -> tuple[bool, int]:
    """Whether everything below a plain container is plain containers and atoms (no tensor can hide).

    A breadth-first descent at C speed: each step is one ``gc.get_referents`` call (or one slice of a
    huge container) of about 64k children, filtered to GC-tracked objects, so the caller's deadline is
    checked every few milliseconds. Returns (inert, objects looked at); not inert as soon as any other
    kind of object appears, the subtree is larger than ``max_objects`` or deeper than ``_DEPTH``
    (a cycle), or time runs out. Shared objects are counted each time they are met.
    """
    level = [root]
    count = 0
    for _ in range(_DEPTH):
        nxt: list[Any] = []
        for children in _children(level):
            count += len(children)
            if count > max_objects or deadline():
                return False, count
            tracked = list(filter(is_tracked, children))
            if tracked:
                if not set(map(id, map(type, tracked))) <= _PLAIN_IDS:
                    return False, count
                nxt += tracked
        if not nxt:
            return True, count
        level = nxt
    return False, count


# -- labels ---------------------------------------------------------------------------------------------
LABEL_MAX = 80


def _clip(s: str, n: int = LABEL_MAX) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


_qualname: Callable[[type], Any] = type.__dict__["__qualname__"].__get__
_KEY_ATOMS = (bool, float, complex, type(None))


def key_label(k: Any, depth: int = 0) -> str:
    """A dict key as a user would type it: exact built-in types, tuples and frozensets of them, and enum
    members (``Split.TRAIN``, from the member's own ``_name_`` and its class's qualified name); else
    ``<TypeName>``. Nothing of the key's own code runs: its type is compared by identity, containers are
    read through their base type's C methods, and no ``__repr__`` but the built-in types' is called."""
    t = type(k)
    try:
        if t is str:
            return _clip(repr(k[:LABEL_MAX]))
        if t is int:
            return str(k) if -(10**30) < k < 10**30 else "<int>"
        if is_one_of(t, _KEY_ATOMS):
            return repr(k)
        if t is bytes:
            return _clip(repr(k[:LABEL_MAX]))
        if (t is tuple or t is frozenset) and depth < 2:
            items = tuple.__iter__(k) if t is tuple else frozenset.__iter__(k)
            parts = [key_label(x, depth + 1) for x in islice(items, 5)]
            if t.__len__(k) > 5:
                parts.append("…")
            if t is frozenset:
                return _clip("frozenset({" + ", ".join(parts) + "})") if parts else "frozenset()"
            return _clip("(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")")
        if derives(t, weakref.ref):  # a WeakKeyDictionary's key: name what it points to, if it still lives
            target = weakref.ref.__call__(k)
            return "<dead weakref>" if target is None else f"<weakref to {type_name(type(target))}>"
        if derives(t, enum.Enum):
            d = instance_dict(k, layout(t))
            name = d.get("_name_") if d is not None else None
            qual = _qualname(t)
            if type(name) is str and type(qual) is str:
                return _clip(f"{qual.rpartition('<locals>.')[2]}.{name}")  # as typed where it is in scope
    except Exception:
        pass
    return f"<{type_name(t)}>"


def attr_label(name: Any) -> str:
    return _clip(name) if type(name) is str else "<attribute>"


# -- identity of types, without hashing them ------------------------------------------------------------
class TypeCache:
    """Per-type facts keyed by ``id(type)``, validated by a weak reference (ids are reused)."""

    def __init__(self) -> None:
        self._d: dict[int, tuple[weakref.ref[type] | None, Any]] = {}

    def get(self, t: type) -> Any:
        hit = self._d.get(id(t))
        if hit is None:
            return None
        ref, value = hit
        if ref is not None and ref() is not t:
            return None
        return value

    def put(self, t: type, value: Any) -> None:
        try:
            ref: weakref.ref[type] | None = weakref.ref(t)
        except TypeError:
            ref = None  # static types live forever
        self._d[id(t)] = (ref, value)


_SKIP = frozenset(SKIP_MODULES)


def is_library_module(modname: str) -> bool:
    """A module of the libraries above or one of their submodules (``torch._C``), never a module that merely
    starts with the same letters (``replay_buffer`` is not ``re``, ``common`` not ``comm``)."""
    if modname == "builtins":
        return True
    head = modname
    while True:
        if head in _SKIP:
            return True
        cut = head.rfind(".")
        if cut < 0:
            return False
        head = head[:cut]


_MODULE_DICT: Any = vars(types.ModuleType)["__dict__"]


def module_dict(m: types.ModuleType) -> dict[Any, Any] | None:
    try:
        d = _MODULE_DICT.__get__(m)
    except Exception:
        return None
    return d if type(d) is dict else None


def is_user_module(m: types.ModuleType) -> bool:
    """A module the user wrote or made (``types.ModuleType(...)``), not a library or the standard library."""
    d = module_dict(m)
    if d is None:
        return False
    name = d.get("__name__")
    if type(name) is not str or name in sys.builtin_module_names or name == "__main__" or is_library_module(name):
        return False
    f = d.get("__file__")
    if f is None:
        spec = d.get("__spec__")
        return spec is None  # made by hand; a namespace package or frozen module has a spec
    return type(f) is str and not libraries.is_library_file(f)


def frame_locals(frame: types.FrameType) -> list[tuple[str, Any]]:
    """A finished frame's local variables with their names.

    On 3.13+ ``f_locals`` is a live view; before, reading it stores a snapshot dict on the frame, which
    is harmless for the frames of a traceback (they have finished and die with it).
    """
    try:
        return [(k, v) for k, v in list(frame.f_locals.items()) if type(k) is str]
    except Exception:
        return []


def generator_locals(gen: Any) -> list[Any]:
    """A suspended generator's or coroutine's locals, values only: naming them would mean reading
    ``f_locals``, which before 3.13 stores a snapshot that keeps old values alive."""
    return [x for x in referents(gen) if type(x) is not types.CodeType and type(x) is not types.FrameType
            and type(x) is not str]


# -- C-level fields ---------------------------------------------------------------------------------------
_c_fields = TypeCache()


def c_descriptor(t: type, name: str) -> Callable[[Any], Any] | None:
    """The getter of a field ``name`` defined in C (a getset or member descriptor, which only C code makes,
    in ``t``'s MRO), or None. A Python subclass's property of that name is passed over: its code never
    runs, and the C value under it is what the object really holds."""
    fields = _c_fields.get(t)
    if fields is None:
        fields = {}
        for c in reversed(_mro(t)):  # nearest class last, so it wins
            for k, d in own_items(c):
                if type(k) is str and (type(d) is GETSET or type(d) is MEMBER):
                    fields[k] = d.__get__
        _c_fields.put(t, fields)
    return fields.get(name)


def c_field(obj: Any, name: str) -> tuple[bool, Any]:
    """(found, value) of the C-level field ``name`` of ``obj`` (``c_descriptor``), then of the key ``name``
    in its instance dict read through the C getter (keys compared as exact strings, so no key's ``__eq__``
    runs). Never a property, ``__getattr__`` or ``__getattribute__``."""
    get = c_descriptor(type(obj), name)
    if get is not None:
        try:
            return True, get(obj)
        except Exception:
            return False, None
    d = dict_of(obj)
    if d is not None:
        for k, v in dict_items(d):
            if type(k) is str and k == name:
                return True, v
    return False, None
