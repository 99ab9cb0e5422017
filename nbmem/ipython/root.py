"""The composition root: what ``%load_ext nbmem`` makes for a shell, and takes back on ``%unload_ext``.

One ``Loaded`` per shell holds the session and everything wired to it (the options, the cell hooks, the flight
recorder, the gauge, the route a reloaded page takes mid-cell). ``load`` builds and registers it, ``unload`` takes
every piece back symmetrically. ``session_of`` is how ``nbmem.fit()``, ``nbmem.leaks()`` and the other functions
reach the session of the shell they run in; the magics (``magics.py``) only parse and delegate to it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError

from nbmem.ipython.config import Nbmem
from nbmem.ipython.magics import NbmemMagics
from nbmem.ipython.reconnect import BetweenCells, ReconnectRoute, reconnect_route
from nbmem.ipython.shell import ShellAdapter
from nbmem.ipython.usage import own_command
from nbmem.recorder.flight import FlightRecorder, open_flight
from nbmem.session import Session
from nbmem.ui.frontend import NO_FRONT_END, in_kernel  # stdlib only: the gauge is imported where it can be drawn

_ACTIVE: weakref.WeakKeyDictionary[Any, Loaded] = weakref.WeakKeyDictionary()


class Loaded:
    """nbmem loaded in one shell: the session, its cell hooks, and what shows it."""

    def __init__(self, shell: Any, options: Any, session: Session) -> None:
        self.shell = shell
        self.options = options
        self.session = session
        self.nested = False  # inside a %%cudamem cell's own run of its body
        self._quiet = False  # the measured cell is a `%cudamem clean`: its own table is its report
        self.gauge: Any = None
        self.flight: FlightRecorder | None = None  # this kernel's capsule on disk, fed by the session
        self.reconnect: ReconnectRoute | None = None  # a page reloaded mid-cell gets its widgets (reconnect.py)
        self.between = BetweenCells(getattr(shell, "kernel", None))  # where a gauge click waits for the cell
        self.magics = NbmemMagics(shell, self)

    # -- the cell hooks: nbmem's one pair, told of every run (nested ones too), passed on to each part ------
    def pre_run_cell(self, info: Any) -> None:
        if self.flight is not None:  # every user cell, measured or not: the capsule names it
            self._pass_on("the flight recorder", self.flight.pre_run_cell, info, self.shell.execution_count - 1)
        self._pass_on("the reconnect route", self.between.pre_run_cell, info)  # is a cell running now?
        self._pass_on("pre_run_cell", self._begin, info)

    def post_run_cell(self, result: Any) -> None:
        if self.flight is not None:
            self._pass_on("the flight recorder", self.flight.post_run_cell, result)
        self._pass_on("the reconnect route", self.between.post_run_cell, result)
        self._pass_on("post_run_cell", self._end, result)

    def _pass_on(self, part: str, hook: Callable[..., object], *args: Any) -> None:
        """One part's hook; a failure there is that part's fault, and the parts after it are still told."""
        try:
            hook(*args)
        except Exception as e:
            self.session.fault(part, e)

    def _begin(self, info: Any) -> None:
        """A measured cell begins, unless this run is not one (nested, silent, nbmem's own command)."""
        s = self.session
        if self.nested or not s.monitoring or s.in_cell:
            return
        if getattr(info, "silent", False) or not getattr(info, "store_history", False):
            return
        raw = getattr(info, "raw_cell", "") or ""
        if raw.lstrip().startswith("%%cudamem"):
            return  # the cell magic measures this cell itself
        own = own_command(raw)
        if own is not None and own != "clean":
            return  # nbmem's own command (or its refusal) moves no memory: nothing to report
        # A cleanup is measured, so the records add up, but its own table already said what it freed, and
        # `%cudamem report` and the measured cells a refusal lists leave it out.
        s.begin_cell(self.shell.execution_count - 1, source=raw, own=own == "clean")
        self._quiet = own == "clean"

    def _end(self, result: Any) -> None:
        """The measured cell ends: its report, shown where it says something."""
        if self.nested:
            return
        if not self.session.in_cell:  # a cell nobody measured: the gauge's holder list follows it
            if self.gauge is not None and not getattr(getattr(result, "info", None), "silent", False):
                self.session.refresh_holders()
            return
        report = self.session.end_cell(getattr(result, "error_in_exec", None))
        quiet, self._quiet = self._quiet, False
        if report is not None and not quiet and self.session.should_show(report):
            self.display(report)
            self.session.shown(report)

    def display(self, obj: Any) -> None:
        from IPython.display import display

        display(obj)

    # -- the gauge -------------------------------------------------------------------------------------
    def show_gauge(self, where: str, *, explicit: bool = False) -> None:
        if not in_kernel(self.shell):  # terminal IPython, an embedded shell: nowhere to draw it (nor to import it)
            if explicit:
                raise UsageError(f"%cudamem gauge: {NO_FRONT_END}.")
            return
        try:
            from nbmem.ui.widget import show_gauge
        except ImportError as e:  # anywidget (or its front-end packages) not installed
            msg = (f"the live gauge needs anywidget and ipywidgets ({e}); `pip install anywidget`. "
                   f"Everything else works without it.")
            if explicit:
                raise UsageError(f"%cudamem gauge: {msg}") from None
            self.session.tell_once("no-gauge", f"nbmem: {msg}")
            return
        try:
            self.gauge = show_gauge(self.session, where, previous=self.gauge, shell=self.shell, explicit=explicit)
            if self.gauge is not None:
                self.gauge.between_cells = self.between
        except Exception as e:
            if explicit:
                raise UsageError(f"%cudamem gauge: the gauge cannot be shown here ({e}).") from None
            self.session.fault("gauge", e)

    def close(self) -> None:
        if self.gauge is not None:
            try:
                self.gauge.close()
            except Exception:
                pass
            self.gauge = None
        self.session.close()


def root_of(shell: Any = None) -> Loaded:
    """What nbmem made for ``shell`` (the running one by default); a RuntimeError saying how to load it."""
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    loaded = _ACTIVE.get(shell) if shell is not None else None
    if loaded is None:
        raise RuntimeError("nbmem is not loaded in this shell: run `%load_ext nbmem` first.")
    return loaded


def session_of(shell: Any = None) -> Session:
    """The engine of the shell nbmem is loaded in (the Python API's way in)."""
    return root_of(shell).session


def load(shell: Any) -> None:
    """``%load_ext nbmem``: start the sampler, register the cell hooks and show the gauge."""
    if shell in _ACTIVE:
        return
    options = Nbmem(parent=shell)
    session = Session(ShellAdapter(shell), options.settings())
    loaded = Loaded(shell, options, session)
    try:
        loaded.flight = open_flight(session.subscribe, roots=session.adapter.roots)
    except Exception as e:
        session.fault("the flight recorder", e)
    session.start()
    loaded.reconnect = reconnect_route(shell, session.cannot, session.fault, loaded.between)

    def _changed(change: Any) -> None:
        try:
            session.reconfigure(options.settings())
        except Exception as e:
            session.fault("config", e)

    options.observe(_changed)
    shell.configurables.append(options)
    shell.register_magics(loaded.magics)
    shell.events.register("pre_run_cell", loaded.pre_run_cell)
    shell.events.register("post_run_cell", loaded.post_run_cell)
    _ACTIVE[shell] = loaded
    if loaded.flight is not None and loaded.flight.last_death is not None:
        loaded.display(loaded.flight.last_death)  # the story of the last kernel's death first
    print(session.greeting())
    if options.gauge != "none":
        loaded.show_gauge(options.gauge)


def unload(shell: Any) -> None:
    """``%unload_ext nbmem``: unregister everything, join the thread, close the gauge, forget records."""
    loaded = _ACTIVE.pop(shell, None)
    if loaded is None:
        return
    magics = loaded.magics
    for event, fn in (("pre_run_cell", loaded.pre_run_cell), ("post_run_cell", loaded.post_run_cell)):
        with contextlib.suppress(ValueError):
            shell.events.unregister(event, fn)
    for configurable in (loaded.options, magics):  # IPython's Magics.__init__ adds itself there too
        while configurable in shell.configurables:
            shell.configurables.remove(configurable)
    loaded.options.unobserve_all()
    mm = shell.magics_manager
    for kind in ("line", "cell"):
        if mm.magics[kind].get("cudamem") == magics.cudamem:
            del mm.magics[kind]["cudamem"]
    mm.registry.pop(type(magics).__name__, None)
    loaded.close()
    loaded.between.close()
    if loaded.reconnect is not None:
        loaded.reconnect.close()
    if loaded.flight is not None:
        loaded.flight.close()  # a clean end: no capsule is left to tell of a death
