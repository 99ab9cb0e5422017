"""When each line of the user's own code ran, from ``sys.monitoring`` (Python 3.12+): where ``--lines`` events go.

Measurement, like ``sources``: it reads the interpreter, never the user's objects, and changes nothing
the user can see (its tool id is handed back as it was found).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from nbmem.measure import libraries


def _monitoring() -> Any:
    return getattr(sys, "monitoring", None)  # 3.12+; typed as Any so that 3.11's type checker accepts it


class LineClock:
    """When each line of the user's own code ran, on the thread that runs the cell (``sys.monitoring``).

    ``--lines`` places every allocator event on the line that was running at its ``time_us``: cheaper
    than the allocator's Python stack on every event. Library code (the standard library, installed
    packages, nbmem) is switched off at its first line with ``DISABLE``, so a training step pays for the
    user's own lines only (about 1.6 µs each). Marks are ``(time_us, code, line)``; ``line`` is -1 when
    the code returned, yielded or unwound. At most ``max_marks`` are kept, like the allocator's ring: a
    Python-heavy cell stops being marked there (``full_at_us``), and its later events have no line.
    """

    TOOL_IDS = (4, 3)  # the ids CPython leaves unassigned (0-2 and 5 are debugger, coverage, profiler, optimizer)

    def __init__(self, max_marks: int = 100_000) -> None:
        self.marks: list[tuple[int, Any, int]] = []
        self.max_marks = max_marks
        self.full_at_us: int | None = None  # when marking stopped at max_marks
        self._tool: int | None = None

    @staticmethod
    def unsupported() -> str | None:
        mon = _monitoring()
        if mon is None:
            return f"Python {sys.version_info[0]}.{sys.version_info[1]} has no sys.monitoring (3.12 does)"
        if all(mon.get_tool(t) is not None for t in LineClock.TOOL_IDS):
            return "another tool holds sys.monitoring's free tool ids"
        return None

    def start(self) -> bool:
        """Start marking lines; False when this Python cannot (the caller records stacks instead)."""
        if self.unsupported():
            return False
        mon = _monitoring()
        tool = next(t for t in self.TOOL_IDS if mon.get_tool(t) is None)
        mon.use_tool_id(tool, "nbmem")
        self._tool = tool
        known: dict[str, bool] = {}
        marks = self.marks
        mark = marks.append
        cap = self.max_marks
        now = time.time_ns
        thread = threading.get_ident()
        ident = threading.get_ident
        disable = mon.DISABLE

        def is_library(file: str) -> bool:
            got = known.get(file)
            if got is None:
                got = known[file] = libraries.is_library_file(file)
            return got

        def add(code: Any, line: int) -> None:
            if len(marks) < cap:
                mark((now() // 1000, code, line))
            elif self.full_at_us is None:
                self.full_at_us = now() // 1000
                mon.set_events(tool, 0)

        def on_line(code: Any, line: int) -> Any:
            if is_library(code.co_filename):
                return disable
            if ident() == thread:
                add(code, line)
            return None

        def on_leave(code: Any, offset: int, value: Any) -> Any:
            if is_library(code.co_filename):
                return disable
            if ident() == thread:
                add(code, -1)
            return None

        def on_unwind(code: Any, offset: int, exc: Any) -> None:  # a global event: DISABLE is not allowed
            if ident() == thread and not is_library(code.co_filename):
                add(code, -1)

        ev = mon.events
        mon.register_callback(tool, ev.LINE, on_line)
        mon.register_callback(tool, ev.PY_RETURN, on_leave)
        mon.register_callback(tool, ev.PY_YIELD, on_leave)
        mon.register_callback(tool, ev.PY_UNWIND, on_unwind)
        mon.set_events(tool, ev.LINE | ev.PY_RETURN | ev.PY_YIELD | ev.PY_UNWIND)
        return True

    def stop(self) -> list[tuple[int, Any, int]]:
        """Stop marking, give the tool id back as it was found, and hand over the marks (code objects and
        numbers, no frames)."""
        tool, self._tool = self._tool, None
        if tool is not None:
            mon = _monitoring()
            mon.set_events(tool, 0)
            for e in (mon.events.LINE, mon.events.PY_RETURN, mon.events.PY_YIELD, mon.events.PY_UNWIND):
                mon.register_callback(tool, e, None)
            # A DISABLE outlives the tool that returned it (3.12, 3.13): without this, the next tool on
            # this id would never see the library lines nbmem switched off.
            mon.restart_events()
            mon.free_tool_id(tool)
        marks, self.marks = self.marks, []
        return marks
