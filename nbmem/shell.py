"""The notebook's hiding places, read and cleared through IPython's own objects.

Duck-typed over an ``InteractiveShell`` (this module does not import IPython): the roots the leak
scan starts from, and the three ways cleanup reaches back into the shell.
"""

from __future__ import annotations

import re
import sys
import traceback as _tb
import types
from typing import Any, Iterator

_OUTPUT_NAME = re.compile(r"^_\d+$")
_INPUT_NAME = re.compile(r"^_i+\d*$")
_ROTATING = ("_", "__", "___")


def _output_cache_name(name: str) -> bool:
    """IPython's own input/output cache names (``_``, ``_12``, ``_i``, ``_i12``): not user variables."""
    return name in _ROTATING or bool(_OUTPUT_NAME.match(name) or _INPUT_NAME.match(name))


class ShellAdapter:
    """What nbmem needs from an IPython shell, in one place."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell

    # -- roots -----------------------------------------------------------------------------------
    def roots(self) -> Iterator[tuple[str, str, Any]]:
        """(path, kind, object) in priority order: user names, then outputs, then tracebacks."""
        sh = self.shell
        ns = sh.user_ns
        hidden = getattr(sh, "user_ns_hidden", {})
        for name, obj in list(ns.items()):
            if _output_cache_name(name):
                continue
            if name in hidden and hidden[name] is obj:
                continue  # IPython's own entries (In, Out, exit, get_ipython, …)
            if name.startswith("__") and name.endswith("__"):
                continue
            yield name, "namespace", obj
        yield from self.output_roots()
        yield from self.traceback_roots()

    def fingerprint(self) -> tuple[int, int, tuple[int, ...]]:
        """Cheap identity of the roots: (the set of names, what they are bound to, outputs and exceptions).

        Equal parts mean no name was added or deleted, rebound, no output kept and no exception kept.
        """
        sh = self.shell
        items = [(k, id(v)) for k, v in sh.user_ns.items() if not _output_cache_name(k)]
        hm = getattr(sh, "history_manager", None)
        kept = (len(getattr(hm, "output_hist", ())),
                id(getattr(getattr(sh, "last_execution_result", None), "result", None)),
                id(getattr(sys, "last_value", None)), id(getattr(sys, "last_exc", None)),
                id(getattr(getattr(sh, "InteractiveTB", None), "tb", None)))
        return hash(tuple(k for k, _ in items)), hash(tuple(items)), kept

    def output_roots(self) -> Iterator[tuple[str, str, Any]]:
        sh = self.shell
        hm = getattr(sh, "history_manager", None)
        for n, obj in list(getattr(hm, "output_hist", {}).items()):
            yield f"Out[{n}]", "output", obj
        for name, obj in list(sh.user_ns.items()):
            if _OUTPUT_NAME.match(name):
                yield name, "output", obj
        dh = getattr(sh, "displayhook", None)
        for name in _ROTATING:
            obj = sh.user_ns.get(name)
            if obj is None:
                obj = getattr(sh, "user_ns_hidden", {}).get(name)
            if obj is None and dh is not None:
                obj = getattr(dh, name, None)
            if obj is not None and not (isinstance(obj, str) and obj == ""):  # "" = nothing shown yet
                yield name, "output", obj
        res = getattr(getattr(sh, "last_execution_result", None), "result", None)
        if res is not None:
            yield "<last result>", "output", res

    def _tracebacks(self) -> list[Any]:
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
        return [t for t in tbs if isinstance(t, types.TracebackType)]

    def traceback_roots(self) -> Iterator[tuple[str, str, Any]]:
        frames: dict[int, Any] = {}
        for tb in self._tracebacks():
            while tb is not None:
                frames.setdefault(id(tb.tb_frame), tb.tb_frame)
                tb = tb.tb_next
        for frame in frames.values():
            code = frame.f_code
            if code.co_name == "<module>":
                continue  # the cell's own top level: its names are the namespace, already walked
            if "site-packages" in code.co_filename and "IPython" in code.co_filename:
                continue
            for var, obj in list(frame.f_locals.items()):
                yield f"<traceback {code.co_name}>.{var}", "traceback", obj
        for e in (getattr(sys, "last_value", None),):
            if isinstance(e, BaseException):
                yield "<last exception>", "traceback", e

    # -- the ways back in (explicit requests only) ---------------------------------------------------
    def user_names(self) -> set[str]:
        return set(self.shell.user_ns)

    def delete(self, name: str) -> None:
        """``del`` through IPython's own ``del_var``: also drops ``Out``, ``_`` and the last result."""
        self.shell.del_var(name)

    def get(self, name: str) -> Any:
        return self.shell.user_ns[name]

    def rebind(self, name: str, value: Any) -> None:
        self.shell.user_ns[name] = value

    def clear_outputs(self) -> int:
        """Empty the output history (``Out``, ``_N``, ``_``/``__``/``___``, the last result)."""
        sh = self.shell
        hm = getattr(sh, "history_manager", None)
        n = len(getattr(hm, "output_hist", {}))
        dh = sh.displayhook
        if getattr(dh, "do_full_cache", False):
            dh.flush()
        for ns in (sh.user_ns, getattr(sh, "user_ns_hidden", {})):
            for name in [k for k in ns if _OUTPUT_NAME.match(k)]:
                del ns[name]
            for name in _ROTATING:
                if name in ns:
                    ns[name] = ""  # what IPython itself binds when nothing was shown
        for name in _ROTATING:
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
        had = bool(tbs)
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
        return had
