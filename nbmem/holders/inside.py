"""What is inside objects a walk cannot read as plain containers, read through their types' C-level accessors:
a function's closure, defaults and attributes; a sparse tensor's parts; a TorchScript module's parameters and
buffers (they live in C++); the objects in a numpy array of dtype object and in a pandas frame's blocks. No
method of a user's object runs: a user's subclass is read as its library base.

Each reader returns what it found with the label a path shows for it; ``walk`` adds them as nodes.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

from nbmem.holders import reach
from nbmem.holders.naming import L_ATTR, L_TEXT

CELL_CONTENTS: Any = vars(types.CellType)["cell_contents"]
_F: dict[str, Any] = dict(vars(types.FunctionType))


def function_refs(f: types.FunctionType) -> list[tuple[Any, int, str]]:
    """A function's closure cells, defaults and ``__dict__``: (value, label kind, label)."""
    out: list[tuple[Any, int, str]] = []
    code = _F["__code__"].__get__(f)
    closure = _F["__closure__"].__get__(f) or ()
    for name, cell in zip(code.co_freevars, closure):
        try:
            v = CELL_CONTENTS.__get__(cell)
        except ValueError:
            continue
        out.append((v, L_TEXT, f".<closure {name}>"))
    for i, v in enumerate(_F["__defaults__"].__get__(f) or ()):
        out.append((v, L_TEXT, f".__defaults__[{i}]"))
    for k, v in reach.dict_items(_F["__kwdefaults__"].__get__(f) or {}):
        out.append((v, L_TEXT, f".__kwdefaults__[{reach.key_label(k)}]"))
    for k, v in reach.dict_items(_F["__dict__"].__get__(f)):
        out.append((v, L_ATTR, k))
    return out


def sparse_parts(torch: Any, TB: Any, t: Any, layout: Any) -> list[tuple[Any, str]]:
    """A sparse tensor's index and value tensors, labelled as the calls that give them."""
    parts: tuple[tuple[str, str], ...]
    if layout is torch.sparse_coo:
        parts = (("_indices", ".indices()"), ("_values", ".values()"))
    elif layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (("crow_indices", ".crow_indices()"), ("col_indices", ".col_indices()"), ("values", ".values()"))
    elif layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = (("ccol_indices", ".ccol_indices()"), ("row_indices", ".row_indices()"), ("values", ".values()"))
    else:
        return []
    return [(getattr(TB, meth)(t), label) for meth, label in parts]


def script_tensors(torch: Any, d: dict[Any, Any], sub: str) -> list[tuple[str, Any]]:
    """A TorchScript module's parameters (``sub`` "_parameters") or buffers (``torch.jit.trace``,
    ``torch.jit.script``), read from its C++ module (``_c`` in its instance dict ``d``) by torch's own
    accessors: compiled code, not the user's."""
    C = torch._C
    c = d.get("_c")
    if type(c) is not getattr(C, "ScriptModule", None):
        return []
    read = C.ParameterDict if sub == "_parameters" else C.BufferDict
    return [(k, v) for k, v in read(c).items() if type(k) is str]


def array_objects(arr: Any, most: int) -> list[Any]:
    """The objects in a numpy array of dtype object, the first ``most`` of them (numpy's own C methods; an
    array of another dtype holds no objects)."""
    np = sys.modules.get("numpy")
    if np is None:
        return []
    nd = np.ndarray
    if vars(nd)["dtype"].__get__(arr).kind != "O":
        return []
    # As a plain ndarray first: a subclass's view or copy would run its __array_finalize__.
    flat = nd.ravel(arr if type(arr) is nd else nd.view(arr, nd))
    items: list[Any] = nd.tolist(flat[:most] if int(vars(nd)["size"].__get__(flat)) > most else flat)
    return items


def frame_arrays(manager: Any, is_array: Callable[[type], bool]) -> list[Any]:
    """A pandas frame's or series' arrays of values: its block manager (``_mgr``), the manager's blocks and
    their arrays, found by what each references (C-level; no pandas property runs)."""
    todo = [] if manager is None else [manager]
    arrays = []
    for _ in range(3):  # manager -> tuple of blocks -> block -> array
        nxt = []
        for x in todo:
            for r in reach.referents(x):
                t = type(r)
                if is_array(t):
                    arrays.append(r)
                elif t is tuple or reach.type_module(t).startswith("pandas.core.internals"):
                    nxt.append(r)
        todo = nxt
    return arrays


#: Where bitsandbytes keeps its own layouts (read by value from instance dicts; nothing of it is imported).
_BNB = "bitsandbytes"


def quantized_shape(d: dict[Any, Any]) -> tuple[tuple[int, ...], str] | None:
    """A bitsandbytes 4-bit weight's logical shape and format (``((4096, 4096), "nf4")``), from its instance
    dict ``d``: its ``quant_state`` (a ``QuantState``) keeps the shape the packed bytes stand for, which
    ``numel()`` of the packed ``uint8`` tensor does not show (two weights a byte)."""
    qs = d.get("quant_state")
    if qs is None or not reach.type_module(type(qs)).startswith(_BNB):
        return None
    qd = reach.dict_of(qs)
    shape = qd.get("shape") if qd is not None else None
    if shape is None or not reach.derives(type(shape), tuple) or not all(type(x) is int for x in tuple.__iter__(shape)):
        return None
    kind = qd.get("quant_type") if qd is not None else None
    return tuple(tuple.__iter__(shape)), (kind if type(kind) is str else "4-bit")


def paged_device(d: dict[Any, Any]) -> int | None:
    """The GPU a bitsandbytes paged tensor's CUDA managed memory belongs to, from its instance dict: a paged
    optimizer's state is a CPU tensor over ``cudaMallocManaged`` memory, marked ``is_paged`` and
    ``page_deviceid`` (``bitsandbytes.functional.get_paged``)."""
    if d.get("is_paged") is not True:
        return None
    dev = d.get("page_deviceid")
    return dev if type(dev) is int and dev >= 0 else None
