"""Host memory the notebook's names hold: the biggest holders of RAM, for the flight recorder's capsule.

A kernel killed for host memory dies with it, so the capsule names what held it: CPU tensors, NumPy
arrays, pandas DataFrames and Series, ``bytes``/``bytearray``/``str`` and the plain containers of them,
each by its own size, counted once however many names reach it.

Nothing of a user object's code runs (``reach``'s rules): sizes are read through the base type's C
methods (``bytearray.__sizeof__(x)``, never the object's own ``__sizeof__``), NumPy's ``nbytes`` and
``base`` through ``ndarray``'s own getset descriptors, a DataFrame through the C fields of its block
manager (``_mgr`` → ``blocks`` → each block's ``values``), a tensor through ``TensorBase``'s. Anything
else is looked into only through its instance dict and slots. An object array's elements, a pyarrow
column or an unknown extension array are not counted: the row says so, since unknown is not zero.

One scan is bounded by ``BUDGET_S`` of time and ``MAX_OBJECTS`` objects; a scan cut short says where
(``HostHeld.reason``) and a name read in part is marked "at least".
"""

from __future__ import annotations

import sys
import time
import types
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import islice, repeat
from operator import is_
from typing import Any

from nbmem.holders import reach

#: One scan's time: it runs on the sampler thread, at most every ``flight.HOST_EVERY_S`` while a cell runs.
BUDGET_S = 0.05
MAX_OBJECTS = 2_000_000
#: Containers nested deeper than this are not looked into (a tree of lists is counted to this depth).
MAX_DEPTH = 8
#: Holders kept: the biggest few, and none smaller than this.
TOP = 8
MIN_BYTES = 1 << 20
_CHUNK = 65536  # a container's elements read per C call, so the deadline is checked every few milliseconds

_SEQS = (list, tuple, deque, set, frozenset)
_BUFS = (bytes, bytearray, str)
_BUF_IDS = frozenset(map(id, _BUFS))
#: Numbers are not counted: telling shared ones (``[0] * n``) from distinct ones costs a hash each, and
#: what kills kernels is buffers. A container's own pointer array is counted; its numbers are named.
_NUMBERS = (int, float, complex, bool, type(None))
_NUMBER_IDS = frozenset(map(id, _NUMBERS))

(_SKIP, _BUF, _SEQ, _DICT, _ND, _TENSOR, _FRAME, _EA, _MEMVIEW, _OBJ) = range(10)
(_NONE, _LEAF, _MORE) = range(3)  # a name's place in the scan's order (``_Sizer.holds``)


@dataclass(frozen=True)
class HostHolder:
    """One name and the host memory only it (or it first) reaches."""

    name: str
    what: str  # "list of 20 bytearray", "ndarray float64 (4000, 4000)", "DataFrame 1,000,000 × 8"
    bytes: int
    partial: bool = False  # the scan's budget ran out inside it: at least ``bytes``
    uncounted: str = ""  # what it holds that is not counted (an object array's elements), or ""


@dataclass(frozen=True)
class HostHeld:
    """A scan's result: the biggest holders, and how far the scan got."""

    holders: tuple[HostHolder, ...]
    names: int  # names read
    names_total: int | None  # None: the budget ran out before every name was listed
    objects: int
    elapsed_s: float
    reason: str = ""  # why not every name was read in full; "" when it was

    def to_json(self) -> dict[str, Any]:
        return {"holders": [{"name": h.name[:120], "what": h.what[:120], "bytes": h.bytes, "partial": h.partial,
                             "uncounted": h.uncounted[:200]} for h in self.holders],
                "names": self.names, "names_total": self.names_total, "objects": self.objects,
                "elapsed_s": round(self.elapsed_s, 4), "reason": self.reason}


def _module_attr(module: str, name: str) -> Any:
    """A class from a module already imported (never imported here: a notebook without pandas has no frame)."""
    m = sys.modules.get(module)
    if type(m) is not types.ModuleType:
        return None
    d = reach.module_dict(m)
    return None if d is None else next((v for k, v in reach.dict_items(d) if type(k) is str and k == name), None)


class _Sizer:
    """One scan: objects met are kept alive (so ids stay unique) and counted once."""

    def __init__(self, deadline: float, max_objects: int, clock: Callable[[], float]) -> None:
        self.deadline, self.max_objects, self.clock = deadline, max_objects, clock
        self.seen: set[int] = set()
        self.ptrs: set[int] = set()  # tensor storages, by address (a storage object is new at every access)
        self.keep: list[Any] = []
        self.objects = 0
        self._until_clock = 0
        self.total = 0
        self.types: dict[int, tuple[type, int, Any]] = {}
        self.ndarray = _module_attr("numpy", "ndarray")
        self.dtype = _module_attr("numpy", "dtype")
        self.TB: Any = _module_attr("torch._C", "TensorBase")
        self.NDFrame = _module_attr("pandas.core.generic", "NDFrame")
        self.Backed = _module_attr("pandas._libs.arrays", "NDArrayBacked")
        self.torch_off = _module_attr("torch._C", "DisableTorchFunction")

    # -- the budget ----------------------------------------------------------------------------------------
    def spend(self, n: int = 1) -> None:
        self.objects += n
        self._until_clock -= n

    def expired(self) -> bool:
        return self.objects > self.max_objects or self.clock() > self.deadline

    def due(self) -> bool:
        """Whether the budget is spent, the clock read every hundred objects or so rather than at each."""
        if self._until_clock > 0:
            return False
        self._until_clock = 128
        return self.expired()

    # -- per type --------------------------------------------------------------------------------------------
    def kind(self, t: type) -> int:
        hit = self.types.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        k = self._classify(t)
        bases = _BUFS if k == _BUF else _SEQS if k == _SEQ else (dict,) if k == _DICT else ()
        self.types[id(t)] = (t, k, next((b for b in bases if reach.derives(t, b)), None))  # kept: its id stays its own
        return k

    def base(self, t: type) -> Any:
        """The built-in base whose C methods read a buffer or container of type ``t`` (after ``kind``)."""
        return self.types[id(t)][2]

    def _classify(self, t: type) -> int:
        d = reach.derives
        if any(d(t, b) for b in _BUFS):
            return _BUF
        if t is memoryview:  # before the atoms, which list it: its buffer is another object's, read through it
            return _MEMVIEW
        if reach.is_atom_type(t) or d(t, type) or t is types.ModuleType or d(t, types.ModuleType):
            return _SKIP
        if self.TB is not None and d(t, self.TB):
            return _TENSOR
        if self.ndarray is not None and d(t, self.ndarray):
            return _ND
        if self.NDFrame is not None and d(t, self.NDFrame):
            return _FRAME
        if self.Backed is not None and d(t, self.Backed):
            return _EA
        if d(t, dict):
            return _DICT
        if any(d(t, b) for b in _SEQS):
            return _SEQ
        mod = reach.type_module(t)
        if not reach.is_heap(t) or reach.is_library_module(mod) or mod.split(".")[0] in ("torch", "numpy"):
            return _SKIP  # functions, frames, C objects, a library's own objects: no data of the notebook's
        return _OBJ

    def holds(self, obj: Any) -> int:
        """What a name's object is for the scan's order: ``_LEAF`` (an array, a tensor, a frame, a buffer:
        one read), ``_MORE`` (a container or an object to walk) or ``_NONE`` (numbers, functions, modules,
        empty containers: nothing to count)."""
        t = type(obj)
        k = self.kind(t)
        if k == _SEQ or k == _DICT:
            return _MORE if self.base(t).__len__(obj) else _NONE
        if k == _OBJ:
            return _MORE
        return _NONE if k == _SKIP else _LEAF

    # -- sizes -----------------------------------------------------------------------------------------------
    def first(self, obj: Any) -> bool:
        """Whether ``obj`` is met for the first time in this scan (and so is counted now)."""
        i = id(obj)
        if i in self.seen:
            return False
        self.seen.add(i)
        self.keep.append(obj)
        return True

    def run(self, r: _Root, quota: int) -> None:
        """Read ``r`` on from where it stopped, for about ``quota`` objects or to its end."""
        stop = self.objects + quota
        stack = r.stack
        before = self.total
        try:
            while stack:
                if self.objects >= stop or self.due():
                    return
                it, depth = stack[-1]
                chunk = list(islice(it, _CHUNK))
                if not chunk:
                    stack.pop()
                    continue
                if len(chunk) >= 64 and self.leaves(chunk, r.out):
                    continue
                for j, x in enumerate(chunk):
                    self.visit(x, depth, r.out, stack)
                    if j & 127 == 127 and self.due():
                        stack.append((iter(chunk[j + 1:]), depth))
                        return
        except Exception as e:  # an object changed under the sampler thread: the next scan sees it
            stack.clear()
            r.error = type(e).__name__
        finally:
            r.total += self.total - before

    def visit(self, obj: Any, depth: int, out: list[str], stack: list[tuple[Iterator[Any], int]]) -> None:
        """Count the bytes ``obj`` holds that nothing met before holds (``total``), and put what it contains
        on ``stack``; ``out`` collects what is not counted."""
        t = type(obj)
        k = self.kind(t)
        if k == _SKIP:
            return
        i = id(obj)
        if i in self.seen:
            return
        self.seen.add(i)
        self.keep.append(obj)
        self.spend()
        if k == _BUF:
            self.total += int(self.base(t).__sizeof__(obj))  # the base's C method: a subclass's __sizeof__ never runs
        elif k == _ND:
            self.total += self.array(obj, out)
        elif k == _TENSOR:
            self.total += self.tensor(obj)
        elif k == _FRAME:
            stack.append((iter(self.frame(obj, out)), depth + 1))
        elif k == _EA:
            found, nd = reach.c_field(obj, "_ndarray")
            if found:
                stack.append((iter((nd,)), depth + 1))
        elif k == _MEMVIEW:
            try:
                stack.append((iter((memoryview.obj.__get__(obj),)), depth + 1))
            except Exception:  # a released view holds nothing
                return
        elif depth >= MAX_DEPTH:
            return
        elif k == _SEQ:
            seq = self.base(t)
            self.total += int(seq.__sizeof__(obj))
            stack.append((seq.__iter__(obj), depth + 1))
        elif k == _DICT:
            self.total += int(dict.__sizeof__(obj))
            stack.append((dict.keys(obj).__iter__(), depth + 1))
            stack.append((dict.values(obj).__iter__(), depth + 1))
        else:
            lay = reach.layout(t)
            d = reach.instance_dict(obj, lay)
            inner = [v for _, v in reach.slot_values(obj, lay)]
            if d is not None:
                inner.append(d)
            stack.append((iter(inner), depth + 1))

    def leaves(self, chunk: list[Any], out: list[str]) -> bool:
        """Whether a long run of numbers or of one buffer type was counted at C speed (else: one by one)."""
        first = type(chunk[0])
        if all(map(is_, map(type, chunk), repeat(first))):  # one type: compared by identity, at C speed
            tids = {id(first)}
        else:
            tids = set(map(id, map(type, chunk)))  # ids: a set of the types would hash them through metaclasses
        if tids <= _NUMBER_IDS:
            self.spend(len(chunk))
            if not tids <= {id(bool), id(type(None))}:
                out.append("its numbers' objects")
            return True
        if len(tids) == 1 and tids <= _BUF_IDS:
            ids = list(map(id, chunk))
            if self.seen.isdisjoint(ids) and len(set(ids)) == len(ids):
                self.spend(len(chunk))
                self.seen.update(ids)
                self.keep.append(chunk)
                sizeof: Any = first.__sizeof__  # an exact built-in type's own C method
                self.total += sum(map(sizeof, chunk))
                return True
        return False

    def array(self, a: Any, out: list[str]) -> int:
        """An ndarray's buffer: the array that owns it (the end of the ``base`` chain), once."""
        nd = self.ndarray
        base_of = reach.c_descriptor(nd, "base")
        nbytes = reach.c_descriptor(nd, "nbytes")
        if base_of is None or nbytes is None:
            return 0
        owner = a
        for _ in range(64):
            b = base_of(owner)
            if b is None or not reach.derives(type(b), nd):
                break
            owner = b
        else:
            b = None
        if owner is not a and not self.first(owner):
            return 0
        n = int(nbytes(owner))
        if b is not None and self.kind(type(b)) == _BUF:  # a view of a bytes object: that, by its own size
            n = int(self.base(type(b)).__sizeof__(b)) if self.first(b) else 0
        if self._has_objects(owner):
            out.append("an object array's elements")
        return n

    def _has_objects(self, a: Any) -> bool:
        get = reach.c_descriptor(self.ndarray, "dtype")
        dt = get(a) if get is not None else None
        has = reach.c_descriptor(type(dt), "hasobject") if dt is not None else None
        return bool(has(dt)) if has is not None else False

    def tensor(self, t: Any) -> int:
        """A CPU tensor's storage, once by address; a GPU tensor holds no host memory of its own."""
        TB = self.TB
        off = self.torch_off
        try:
            with off() if off is not None else nullcontext():
                if str(TB.device.__get__(t)) != "cpu":
                    return 0
                st = TB.untyped_storage(t)
                ptr, n = int(st.data_ptr()), int(st.nbytes())
        except Exception:  # meta, functional or wrapper tensors have no plain storage
            return 0
        if ptr == 0 or ptr in self.ptrs:
            return 0
        self.ptrs.add(ptr)
        return n

    def frame(self, f: Any, out: list[str]) -> list[Any]:
        """A DataFrame's or Series's blocks' values (the index is not counted)."""
        found, mgr = reach.c_field(f, "_mgr")
        found, blocks = reach.c_field(mgr, "blocks") if found and mgr is not None else (False, None)
        if not found or type(blocks) is not tuple:
            out.append("a frame whose blocks could not be read")
            return []
        values = []
        for b in tuple.__iter__(blocks):
            found, v = reach.c_field(b, "values")
            if not found:
                continue
            if self.kind(type(v)) in (_ND, _EA):
                values.append(v)
            else:
                out.append(f"a {reach.type_name(type(v))} column")
        return values


# -- what a person reads -----------------------------------------------------------------------------------
def what(s: _Sizer, obj: Any) -> str:
    t = type(obj)
    name = reach.type_name(t)
    k = s.kind(t)
    try:
        if k == _ND:
            return f"{name} {_dtype(s, obj)} {_shape(s, obj, s.ndarray)}".strip()
        if k == _TENSOR:
            with s.torch_off() if s.torch_off is not None else nullcontext():
                dt = str(s.TB.dtype.__get__(obj)).removeprefix("torch.")
                shape = list(tuple.__iter__(s.TB.shape.__get__(obj)))
            return f"{name} {dt} {shape}"
        if k == _FRAME:
            return f"{name} {_frame_shape(s, obj)}".strip()
        if k == _SEQ or k == _DICT:
            base = s.base(t)
            count = int(base.__len__(obj))
            items = islice(dict.values(obj).__iter__() if k == _DICT else base.__iter__(obj), 1000)
            kinds = {id(type(x)): type(x) for x in items}
            of = f" {reach.type_name(next(iter(kinds.values())))}" if len(kinds) == 1 else ""
            return f"{name} of {count:,}{of}"
    except Exception:
        pass
    return name

def _dtype(s: _Sizer, a: Any) -> str:
    get = reach.c_descriptor(s.ndarray, "dtype")
    dt = get(a) if get is not None else None
    return str(s.dtype.__str__(dt)) if dt is not None and reach.derives(type(dt), s.dtype) else ""

def _shape(s: _Sizer, a: Any, base: type) -> str:
    get = reach.c_descriptor(base, "shape")
    shape = get(a) if get is not None else None
    return str(tuple(tuple.__iter__(shape))) if type(shape) is tuple else ""

def _frame_shape(s: _Sizer, f: Any) -> str:
    """"1,000,000 × 8" for a DataFrame, "1,000,000 float64" for a Series, from its blocks' arrays."""
    _, mgr = reach.c_field(f, "_mgr")
    found, blocks = reach.c_field(mgr, "blocks") if mgr is not None else (False, None)
    if not found or type(blocks) is not tuple:
        return ""
    rows, cols, dtype = None, 0, ""
    get = reach.c_descriptor(s.ndarray, "shape")
    for b in tuple.__iter__(blocks):
        _, v = reach.c_field(b, "values")
        if v is not None and s.kind(type(v)) == _EA:
            _, v = reach.c_field(v, "_ndarray")
        if v is None or get is None or s.kind(type(v)) != _ND:
            return ""
        shape = tuple(tuple.__iter__(get(v)))
        rows = shape[-1]
        cols += shape[0] if len(shape) == 2 else 1
        dtype = _dtype(s, v)
    if rows is None:
        return ""
    one_d = reach.type_name(type(f)) == "Series" or not any(
        reach.derives(type(f), c) for c in [_module_attr("pandas.core.frame", "DataFrame")] if c is not None)
    return f"{rows:,} {dtype}" if one_d else f"{rows:,} × {cols}"


class _Root:
    """A name being read: where its walk stands (a stack of iterators), and what it counted so far."""

    __slots__ = ("error", "name", "obj", "out", "stack", "total")

    def __init__(self, root: tuple[str, Any]) -> None:
        self.name, self.obj = root
        self.stack: list[tuple[Iterator[Any], int]] = [(iter(root[1:]), 0)]
        self.out: list[str] = []
        self.total = 0
        self.error = ""


#: Objects each name is read for in the first round; each later round reads four times as many.
FIRST_ROUND = 20_000


def scan_host(roots: Iterable[tuple[str, Any]], *, budget_s: float = BUDGET_S, max_objects: int = MAX_OBJECTS,
              top: int = TOP, min_bytes: int = MIN_BYTES, clock: Callable[[], float] = time.perf_counter
              ) -> HostHeld:
    """The biggest holders of host memory among ``roots`` (name, object): memory two names reach is
    counted under the first read. Bounded by ``budget_s`` and ``max_objects``, listing ``roots`` included;
    reads only (``reach``).

    Arrays, tensors, frames and buffers are read first (one read each), then containers and other objects
    in the notebook's order, in rounds: the first gives each name ``FIRST_ROUND`` objects, each later one
    four times as many to the names not read to their end, so a list of a million numbers does not use
    up the time that the list of twenty bytearrays after it needs."""
    t0 = clock()
    s = _Sizer(t0 + budget_s, max_objects, clock)
    everyone: list[_Root] = []
    pending: list[_Root] = []  # read in part: the next round goes on
    unread = 0  # names the budget left before their first read
    listed, listed_all = 0, False  # the names are listed as they are read: listing a namespace costs too
    try:
        later: list[tuple[str, Any]] = []
        half = t0 + budget_s / 2  # listing stops here, so the containers it put off get the other half
        for root in roots:
            listed += 1
            if listed & 127 == 0 and (s.expired() or clock() > half):
                unread = 1
                break
            try:
                k = s.holds(root[1])
            except Exception:  # changed while listed: the next scan sees it
                continue
            if k == _LEAF:
                r = _Root(root)
                everyone.append(r)
                s.run(r, FIRST_ROUND)
            elif k == _MORE:
                later.append(root)
        else:
            listed_all = True
        for j, root in enumerate(later):
            if s.expired():
                unread += len(later) - j
                break
            r = _Root(root)
            everyone.append(r)
            s.run(r, FIRST_ROUND)
        pending = [r for r in everyone if r.stack]
        quota = FIRST_ROUND * 4
        while pending and not s.expired():
            for r in pending:
                s.run(r, quota)
                if s.expired():
                    break
            pending = [r for r in pending if r.stack]
            quota *= 4
        rows = [HostHolder(r.name, what(s, r.obj), r.total, bool(r.stack), ", ".join(dict.fromkeys(r.out)))
                for r in everyone if r.total >= min_bytes]
        failed = [r.name for r in everyone if r.error]
    finally:
        s.keep.clear()
    rows.sort(key=lambda h: -h.bytes)
    left = len(pending) + unread
    reason = ""
    if not listed_all:
        reason = (f"the scan's budget ({budget_s * 1000:.0f} ms) ran out with {left:,} of the first {listed:,} names "
                  f"read in part or not at all, and the rest not listed")
    elif left:
        reason = (f"the scan's budget ({budget_s * 1000:.0f} ms) ran out with {left:,} of {listed:,} names read "
                  f"in part or not at all")
    if failed:
        reason += ("; " if reason else "") + f"{', '.join(failed[:3])} could not be read (changed while read)"
    return HostHeld(tuple(rows[:top]), listed - left, listed if listed_all else None, s.objects, clock() - t0, reason)
