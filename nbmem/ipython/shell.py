"""The notebook's hiding places, read and cleared through IPython's own objects.

Duck-typed over an ``InteractiveShell`` (this module does not import IPython): the roots the holder
scan starts from, the names a cell's code mentions, and the ways cleanup reaches back into the shell.
Deleting a name removes that name and IPython's own hidden references to the same object (``Out[n]``,
``_n``, ``_``/``__``/``___``, the last result), never another user name bound to it: IPython's
``del_var`` deletes every name bound to the object, ``None`` and ``0`` included.
"""

from __future__ import annotations

import ast
import contextlib
import sys
import traceback as _tb
import types
from collections.abc import Iterable, Iterator
from typing import Any

from nbmem.holders import reach
from nbmem.holders.walk import Root
from nbmem.measure import libraries
from nbmem.records import LAST_RESULT, ROTATING_OUTPUTS, HolderKind, is_cache_name, is_output_name

_IPYTHON_MODULE_NAMES = ("__main__", "__mp_main__")


class ShellAdapter:
    """What nbmem needs from an IPython shell, in one place."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self._user_modules: list[tuple[str, Any]] = []  # (name, weak ref) of the modules the user made
        self._modules_seen = -1  # len(sys.modules) when that list was made
        self._cache_name: dict[str, bool] = {}  # IPython adds _i<N> for every cell: classify each name once

    # -- roots -----------------------------------------------------------------------------------------
    def _is_cache(self, name: str) -> bool:
        got = self._cache_name.get(name)
        if got is None:
            got = self._cache_name[name] = name[:1] == "_" and is_cache_name(name)
        return got

    def _own(self, name: str, obj: Any) -> bool:
        """IPython's own entries (In, Out, get_ipython, exit, the caches), not the user's variables."""
        hidden = getattr(self.shell, "user_ns_hidden", {})
        return self._is_cache(name) or (name in hidden and hidden[name] is obj) or (
            name[:2] == "__" and name[-2:] == "__")

    def roots(self) -> Iterator[Root]:
        """Where the holder scan starts, most useful names first: variables, modules, outputs, tracebacks."""
        for name, obj in list(self.shell.user_ns.items()):
            if type(name) is str and not self._own(name, obj):
                yield Root(name, HolderKind.NAMESPACE, obj)
        yield from self.module_roots()
        yield from self.output_roots()
        yield from self.traceback_roots()

    def module_roots(self) -> Iterator[Root]:
        """Modules the notebook made or wrote (a ``types.ModuleType`` put in ``sys.modules``, a local file)."""
        import weakref

        if len(sys.modules) != self._modules_seen:  # looked for again only when modules come or go
            self._modules_seen = len(sys.modules)
            self._user_modules = [(name, weakref.ref(m)) for name, m in list(sys.modules.items())
                                  if isinstance(name, str) and name not in _IPYTHON_MODULE_NAMES
                                  and type(m) is types.ModuleType and reach.is_user_module(m)]
        for name, ref in self._user_modules:
            m = ref()
            if m is None:
                continue
            d = reach.module_dict(m) or {}
            for k, v in list(d.items()):
                if type(k) is str and not k.startswith("__") and type(v) is not types.ModuleType:
                    yield Root(f"{name}.{k}", HolderKind.MODULE, v)

    def output_roots(self) -> Iterator[Root]:
        sh = self.shell
        hm = getattr(sh, "history_manager", None)
        for n, obj in list(getattr(hm, "output_hist", {}).items()):
            yield Root(f"Out[{n}]", HolderKind.OUTPUT, obj)
        hidden = getattr(sh, "user_ns_hidden", {})
        # IPython binds _<n> beside Out[n] (in both namespaces); only those can exist.
        for n in list(getattr(hm, "output_hist", {})):
            for space in (sh.user_ns, hidden):
                obj = space.get(f"_{n}")
                if obj is not None:
                    yield Root(f"_{n}", HolderKind.OUTPUT, obj)
                    break
        dh = getattr(sh, "displayhook", None)
        for name in ROTATING_OUTPUTS:
            seen: list[Any] = []
            for where, obj in (("", sh.user_ns.get(name)), ("hidden ", hidden.get(name)),
                               ("displayhook ", getattr(dh, name, None))):
                if obj is None or (type(obj) is str and obj == "") or any(obj is s for s in seen):
                    continue  # "" is what IPython binds when nothing was shown
                seen.append(obj)
                yield Root(name if not seen[1:] else f"<{where}{name}>", HolderKind.OUTPUT, obj)
        res = getattr(getattr(sh, "last_execution_result", None), "result", None)
        if res is not None:
            yield Root(LAST_RESULT, HolderKind.OUTPUT, res)

    def _tracebacks(self) -> list[types.TracebackType]:
        sh = self.shell
        excs = [getattr(sys, "last_value", None), getattr(sys, "last_exc", None),
                getattr(getattr(sh, "last_execution_result", None), "error_in_exec", None)]
        tbs = [getattr(sys, "last_traceback", None), getattr(getattr(sh, "InteractiveTB", None), "tb", None)]
        seen: set[int] = set()
        while excs:
            e = excs.pop()
            if isinstance(e, BaseException) and id(e) not in seen:
                seen.add(id(e))
                tbs.append(e.__traceback__)
                excs += [e.__context__, e.__cause__]
        return [t for t in tbs if type(t) is types.TracebackType]

    def traceback_roots(self) -> Iterator[Root]:
        frames: dict[int, types.FrameType] = {}
        for first in self._tracebacks():
            tb: types.TracebackType | None = first
            while tb is not None:
                frames.setdefault(id(tb.tb_frame), tb.tb_frame)
                tb = tb.tb_next
        for frame in frames.values():
            code = frame.f_code
            if code.co_name == "<module>":
                continue  # the cell's own top level: its names are the namespace, already walked
            where = libraries.library_of(code.co_filename, dict.get(frame.f_globals, "__name__"))
            if where == "IPython":
                continue  # the shell's own frames, between the cell and the code it called
            # A library's frame is named as such, and ranks after the user's.
            for var, obj in reach.frame_locals(frame):
                yield Root(f"<traceback {code.co_name}{f' in {where}' if where else ''}>.{var}", HolderKind.TRACEBACK,
                           obj)
        e = getattr(sys, "last_value", None)
        if isinstance(e, BaseException):
            yield Root("<last exception>", HolderKind.TRACEBACK, e)

    def fingerprint(self) -> tuple[int, int, tuple[int, ...]]:
        """Cheap identity of the roots: equal means no name added, deleted or rebound, no output or exception kept."""
        sh = self.shell
        items = [(k, id(v)) for k, v in list(sh.user_ns.items()) if type(k) is str and not self._is_cache(k)]
        hm = getattr(sh, "history_manager", None)
        kept = (len(getattr(hm, "output_hist", ())),
                id(getattr(getattr(sh, "last_execution_result", None), "result", None)),
                id(getattr(sys, "last_value", None)), id(getattr(sys, "last_exc", None)),
                id(getattr(getattr(sh, "InteractiveTB", None), "tb", None)), len(sys.modules))
        return hash(tuple(k for k, _ in items)), hash(tuple(items)), kept

    def mentioned(self, source: str) -> set[str]:
        """Top-level names a cell's code reads, writes or calls: the roots it could have changed."""
        try:
            code = self.shell.transform_cell(source) if hasattr(self.shell, "transform_cell") else source
            tree = ast.parse(code)
        except Exception:  # not Python (yet): the engine's accounting decides what else to walk
            return set()
        return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}

    def cell_files(self, number: int) -> frozenset[str]:
        """The file names IPython compiled cell ``number`` under (its code's frames carry them)."""
        return frozenset(k for k, v in self.cell_names().items() if v == f"In[{number}]")

    def cell_names(self) -> dict[str, str]:
        """Every cell's file name, as people know the cell: ``In[3]``."""
        names = getattr(getattr(self.shell, "compile", None), "_filename_map", {})
        return {k: f"In[{v}]" for k, v in list(names.items()) if type(k) is str}

    # -- what cleanup asks (explicit requests only) ------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.shell.user_ns

    def names(self) -> list[str]:
        """The notebook's own variables (what `%who` lists), for a "did you mean" under a mistyped one."""
        hidden = getattr(self.shell, "user_ns_hidden", {})
        return [k for k in list(self.shell.user_ns) if type(k) is str and not k.startswith("_") and k not in hidden]

    def protected(self, name: str) -> str | None:
        """Why a name may not be deleted, or None."""
        if name.startswith("__") and name.endswith("__"):
            return "is Python's own (the notebook needs it)"
        if is_output_name(name):
            return "is IPython's output history: clear it with --outputs (outputs=True)"
        if is_cache_name(name) or self._own(name, self.shell.user_ns[name]):
            return "is IPython's own"
        return None

    def movable(self, name: str) -> str | None:
        """Why a name cannot be moved to the CPU, or None (only tensors and nn.Modules move)."""
        t = type(self.shell.user_ns[name])
        torch = sys.modules.get("torch")
        bases = [b for b in (getattr(getattr(torch, "_C", None), "TensorBase", None),
                             getattr(getattr(torch, "nn", None), "Module", None)) if b is not None]
        if any(reach.derives(t, b) for b in bases):
            return None
        return f"is a {reach.type_name(t)}: only tensors and torch.nn.Modules move to the CPU"

    def delete(self, name: str) -> tuple[str, ...]:
        """Remove ``name`` and IPython's hidden references to its object; returns those references."""
        sh = self.shell
        ns = sh.user_ns
        obj = ns.pop(name)
        hidden = getattr(sh, "user_ns_hidden", {})
        if name in hidden and hidden[name] is obj:
            del hidden[name]
        removed: list[str] = []
        hm = getattr(sh, "history_manager", None)
        out = getattr(hm, "output_hist", None)
        shown = [n for n, o in list(out.items()) if o is obj] if out is not None else []
        for n in shown:
            del out[n]  # type: ignore[union-attr]
            removed.append(f"Out[{n}]")
        for n in shown:
            for space in (ns, hidden):
                if space.get(f"_{n}") is obj:
                    del space[f"_{n}"]
            removed.append(f"_{n}")
        dh = getattr(sh, "displayhook", None)
        for u in ROTATING_OUTPUTS:
            hit = False
            for space in (ns, hidden):
                if space.get(u) is obj:
                    space[u] = ""  # what IPython binds when nothing was shown
                    hit = True
            if dh is not None and getattr(dh, u, None) is obj:
                setattr(dh, u, "")
                hit = True
            if hit:
                removed.append(u)
        res = getattr(sh, "last_execution_result", None)
        if res is not None and getattr(res, "result", None) is obj:
            res.result = None
            removed.append("the last result")
        return tuple(removed)

    def to_cpu(self, name: str) -> str:
        obj = self.shell.user_ns[name]
        torch = sys.modules["torch"]
        if reach.derives(type(obj), torch.nn.Module):
            obj.cpu()  # a module moves in place
            return "module moved in place; optimizer state it had stays on its device"
        self.shell.user_ns[name] = obj.cpu()
        return "rebound to a CPU copy; other names still hold the original"

    def clear_outputs(self) -> int:
        """Empty the output history (``Out``, ``_N``, ``_``/``__``/``___`` everywhere, the last result)."""
        sh = self.shell
        hm = getattr(sh, "history_manager", None)
        n = len(getattr(hm, "output_hist", {}))
        dh = sh.displayhook
        if getattr(dh, "do_full_cache", False):
            dh.flush()
        for space in (sh.user_ns, getattr(sh, "user_ns_hidden", {})):
            for name in [k for k in space if type(k) is str and is_output_name(k) and k not in ROTATING_OUTPUTS]:
                del space[name]
            for name in ROTATING_OUTPUTS:
                if name in space:
                    space[name] = ""
        for name in ROTATING_OUTPUTS:
            setattr(dh, name, "")
        if hm is not None:
            hm.output_hist.clear()
        res = getattr(sh, "last_execution_result", None)
        if res is not None and getattr(res, "result", None) is not None:
            res.result = None
        return n

    def clear_traceback(self) -> bool:
        """Drop the last exception and its frames everywhere IPython and ``sys`` keep them.

        Clearing only ``sys.last_*`` is not enough: ``InteractiveTB.tb`` keeps the traceback for
        ``%debug``, and the last ExecutionResult keeps the exception.
        """
        sh = self.shell
        tbs = self._tracebacks()
        for tb in tbs:
            try:
                _tb.clear_frames(tb)
            except Exception:
                pass
        for attr in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, attr):
                try:
                    delattr(sys, attr)
                except AttributeError:
                    pass
        itb = getattr(sh, "InteractiveTB", None)
        if itb is not None and hasattr(itb, "tb"):
            itb.tb = None
        res = getattr(sh, "last_execution_result", None)
        if res is not None and getattr(res, "error_in_exec", None) is not None:
            res.error_in_exec = None
        return bool(tbs)

    def namespace_items(self, names: Iterable[str]) -> list[tuple[str, Any]]:
        """The user's variables among ``names`` (a fit walks them for the state it must restore)."""
        ns = self.shell.user_ns
        return [(n, ns[n]) for n in names if n in ns and not self._own(n, ns[n])]

    def fit_namespace(self, body: str, name: str, cell: int) -> FitNamespace:
        """The namespace a fit runs ``body`` in, ``name`` bound to each value in turn."""
        return FitNamespace(self.shell, body, name, cell)


class FitNamespace:
    """The notebook's namespace during a fit. The body runs in it (compiled once, as IPython would transform
    it, its last value not displayed and so not kept in ``Out``) with one name bound; after each run it is put
    back as it was: names the body made are removed, names it rebound or deleted are bound again, and at
    the end the fit's name is what it was before (or gone, if it was not there)."""

    def __init__(self, shell: Any, body: str, name: str, cell: int) -> None:
        self.shell = shell
        self.name = name
        self.filename = f"<nbmem fit of In[{cell}]>"
        text = shell.transform_cell(body) if hasattr(shell, "transform_cell") else body
        self.code = compile(text, self.filename, "exec")
        self.sources = dict(enumerate(text.splitlines(), start=1))
        self._before: dict[str, Any] = dict(shell.user_ns)

    def run(self, value: int) -> None:
        self.shell.user_ns[self.name] = value
        exec(self.code, self.shell.user_ns)

    def clean(self) -> None:
        ns = self.shell.user_ns
        before = self._before
        for k in [k for k in ns if k not in before]:
            del ns[k]
        for k, v in before.items():
            if ns.get(k, _MISSING) is not v:
                ns[k] = v

    def close(self) -> None:
        """Put the namespace back and let go of it."""
        self.clean()
        self._before = {}


_MISSING = object()


# -- running a cell's body as that cell (``%%cudamem``) -----------------------------------------------
@contextlib.contextmanager
def _instance_attr(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``obj.name`` on the instance for the block; then restore what was there, unless someone replaced it."""
    had, previous = name in vars(obj), vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if vars(obj).get(name) is value:
            if had:
                setattr(obj, name, previous)
            else:
                delattr(obj, name)


def compiled_as(shell: Any, number: int) -> contextlib.AbstractContextManager[None]:
    """Compile cells run inside as cell ``number``, so their tracebacks say ``In[number]``.

    ``shell.run_cell`` names a cell by the execution count, which has already moved on to the next
    cell while this one runs.
    """
    original = shell.compile.cache

    def cache(transformed_code: str, number_: int = 0, raw_code: str | None = None) -> str:
        return original(transformed_code, number, raw_code=raw_code)

    return _instance_attr(shell.compile, "cache", cache)


def semicolon_of(shell: Any, body: str) -> contextlib.AbstractContextManager[None]:
    """IPython decides "ends with ;" from the outer cell (the magic call): ask about the body instead."""
    dh = shell.displayhook

    def quiet() -> bool:
        return bool(dh.semicolon_at_end_of_expression(body))

    return _instance_attr(dh, "quiet", quiet)

