"""nbmem's magics: where your GPU memory went, cell by cell, and how to get it back.

Load it once per kernel::

    %load_ext nbmem

``%%cudamem`` (first line of a cell) runs the cell and reports what it did: wall time, Δallocated,
Δreserved, the exact peak allocated inside the cell (from the allocator's own counter), Δ of this
process's NVML usage, Δ RSS, and which names keep the memory it added alive.

    %%cudamem [--reset-peak] [--no-scan] [--quiet]

``%cudamem`` (a line) takes a command:

    %cudamem on [--reset-peak] [--no-scan]   monitor every cell from now on
    %cudamem off                             stop monitoring cells (the sampler keeps running)
    %cudamem status                          what nbmem can and cannot see, and why
    %cudamem report                          one row per monitored cell (= nbmem.report())
    %cudamem leaks [--cell N]                who holds memory now, or what cell N added
    %cudamem clean NAME ... [--outputs] [--traceback] [--all-flagged] [--to-cpu NAME]
                                             delete names (through IPython's del_var), clear the
                                             output history or the last traceback, then gc.collect()
                                             and torch.cuda.empty_cache(); reports the bytes freed
    %cudamem gauge [--inline | --sidebar]    show the live gauge again
    %cudamem plot                            memory over time with cells shaded (= nbmem.plot())

Peaks: the allocator keeps one global peak counter per device (pytorch#16266). nbmem never resets
it on its own, so your own ``torch.cuda.max_memory_allocated()`` keeps its meaning. A cell's peak is
exact whenever the cell raised that counter; otherwise the report says it stayed below an earlier
peak. ``--reset-peak`` (or ``%config Nbmem.reset_peak = True``) resets the counter at the start of
each measured cell for an exact peak every time: your own peak reading then starts at that cell.

Options (``%config Nbmem.<name> = value``, or ``c.Nbmem.<name>`` in ipython_config.py): interval,
history, threshold, scan, show, reset_peak, gauge. ``%config Nbmem`` lists them with their help.
"""

from __future__ import annotations

import weakref
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Enum, Float, Int, TraitError, validate
from traitlets.config import Configurable

from .session import Session, Settings
from .shell import ShellAdapter

_ACTIVE: weakref.WeakKeyDictionary[Any, NbmemMagics] = weakref.WeakKeyDictionary()
_COMMANDS = ("on", "off", "status", "report", "leaks", "clean", "gauge", "plot")


class Nbmem(Configurable):
    """nbmem's options."""

    interval = Float(0.5, help="Seconds between background samples (0.01 to 60). NVML memory queries "
                               "cost ~10 µs, so the default 2 Hz is free.").tag(config=True)
    history = Float(3600.0, help="Seconds of samples kept in memory (a bounded ring).").tag(config=True)
    threshold = Int(2**20, help="Smallest storage, in bytes, that a leak report lists.").tag(config=True)
    scan = Bool(True, help="Find which names hold the memory a monitored cell added.").tag(config=True)
    show = Enum(["auto", "always", "never"], "auto",
                help="When to show the report under a monitored cell: 'auto' when it changed memory "
                     "by at least `threshold`, found a holder or failed.").tag(config=True)
    scan_budget = Float(0.5, help="Seconds a monitored cell's holder scan may take before it stops and says "
                                  "its findings may be incomplete (nbmem.leaks() always scans fully)."
                        ).tag(config=True)
    reset_peak = Bool(False, help="Reset the allocator's peak counter at the start of each monitored cell "
                                  "for exact per-cell peaks (your own max_memory_allocated() then "
                                  "counts from that cell).").tag(config=True)
    gauge = Enum(["auto", "sidebar", "inline", "none"], "auto",
                 help="Where %load_ext shows the live gauge: 'auto' is the JupyterLab sidebar, inline in "
                      "VS Code and Colab, none in a terminal.").tag(config=True)

    @validate("interval")
    def _check_interval(self, proposal: Any) -> float:
        v = proposal["value"]
        if not 0.01 <= v <= 60:
            raise TraitError(f"Nbmem.interval must be between 0.01 and 60 seconds, got {v!r}")
        return float(v)

    @validate("history")
    def _check_history(self, proposal: Any) -> float:
        v = proposal["value"]
        if not 1 <= v <= 7 * 86400:
            raise TraitError(f"Nbmem.history must be between 1 second and 7 days (in seconds), got {v!r}")
        return float(v)

    @validate("scan_budget")
    def _check_budget(self, proposal: Any) -> float:
        v = proposal["value"]
        if not 0 < v <= 3600:
            raise TraitError(f"Nbmem.scan_budget is in seconds, > 0 and <= 3600, got {v!r}")
        return float(v)

    @validate("threshold")
    def _check_threshold(self, proposal: Any) -> int:
        v = proposal["value"]
        if v < 0:
            raise TraitError(f"Nbmem.threshold is a number of bytes >= 0, got {v!r}")
        return int(v)

    def settings(self) -> Settings:
        return Settings(interval_s=self.interval, history_s=self.history, threshold_bytes=self.threshold,
                        scan=self.scan, show=self.show, reset_peak=self.reset_peak, scan_budget_s=self.scan_budget)


class _AlreadyShown(Exception):
    """Fails a ``%%cudamem`` cell whose body's error IPython has already shown."""

    def _render_traceback_(self) -> list[str]:
        return []


def _defer_traceback(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``shell.showtraceback`` while a ``%%cudamem`` body runs."""


@magics_class
class NbmemMagics(Magics):
    """The thin adapter between IPython and the session."""

    shell: Any  # always set: the adapter is created for a shell

    def __init__(self, shell: Any, options: Nbmem, session: Session) -> None:
        super().__init__(shell)
        self.options = options
        self.session = session
        self._nested = False
        self.gauge: Any = None

    # -- events ----------------------------------------------------------------------------------
    def pre_run_cell(self, info: Any) -> None:
        try:
            s = self.session
            if self._nested or not s.monitoring or s.in_cell:
                return
            if getattr(info, "silent", False) or not getattr(info, "store_history", False):
                return
            if (getattr(info, "raw_cell", "") or "").lstrip().startswith("%%cudamem"):
                return  # the cell magic measures this cell itself
            s.begin_cell(self.shell.execution_count - 1)
        except Exception as e:
            self.session.fault("pre_run_cell", e)

    def post_run_cell(self, result: Any) -> None:
        try:
            if self._nested or not self.session.in_cell:
                return
            report = self.session.end_cell(getattr(result, "error_in_exec", None))
            if report is not None and self.session.should_show(report):
                self._display(report)
        except Exception as e:
            self.session.fault("post_run_cell", e)

    def _display(self, obj: Any) -> None:
        from IPython.display import display

        display(obj)

    # -- the magic -------------------------------------------------------------------------------
    @magic_arguments()
    @argument("command", nargs="?", default=None,
              help="Line form only: on, off, status, report, leaks, clean, gauge, plot.")
    @argument("names", nargs="*", default=[], help="With `clean`: the top-level names to delete.")
    @argument("--reset-peak", action="store_true",
              help="Reset the allocator's peak counter at the start of the cell(s) for an exact peak. "
                   "Your own torch.cuda.max_memory_allocated() then counts from there.")
    @argument("--no-scan", action="store_true", help="Skip finding which names hold the memory.")
    @argument("-q", "--quiet", action="store_true", help="Record the report without showing it.")
    @argument("--cell", type=int, default=None, help="With `leaks`: what cell N added.")
    @argument("--outputs", action="store_true", help="With `clean`: clear the output history (Out, _N, _).")
    @argument("--traceback", action="store_true",
              help="With `clean`: drop the last exception's frames (ends %%debug for it).")
    @argument("--all-flagged", action="store_true",
              help="With `clean`: everything the last report flagged (names, outputs, traceback).")
    @argument("--to-cpu", action="append", default=[], metavar="NAME",
              help="With `clean`: move this tensor or module to the CPU instead of deleting it.")
    @argument("--no-collect", action="store_true", help="With `clean`: skip gc.collect().")
    @argument("--no-empty-cache", action="store_true", help="With `clean`: skip torch.cuda.empty_cache().")
    @argument("--inline", action="store_true", help="With `gauge`: show it in the cell output.")
    @argument("--sidebar", action="store_true", help="With `gauge`: show it in JupyterLab's right sidebar.")
    @line_cell_magic
    def cudamem(self, line: str, cell: str | None = None) -> Any:
        """Measure GPU memory per cell, find which names hold it, and give it back.

        As a cell magic, ``%%cudamem`` on a cell's first line runs the cell and reports wall time,
        Δallocated, Δreserved, the exact peak inside the cell, Δ NVML process usage, Δ RSS and the
        names that keep what the cell added. As a line magic it takes a command:

          on / off            measure every cell from now on / stop
          status              what nbmem can and cannot see, and why
          report              one row per measured cell (= nbmem.report())
          leaks [--cell N]    who holds memory now, or what cell N added (= nbmem.leaks())
          clean NAME ...      delete names via IPython's del_var; --outputs, --traceback,
                              --all-flagged, --to-cpu NAME; then gc.collect() and empty_cache()
          gauge               show the live gauge again (--inline or --sidebar)
          plot                memory over time, measured cells shaded (= nbmem.plot())

        nbmem never resets the allocator's peak counter unless you pass --reset-peak: without it a
        cell's peak is exact when the cell raised the high-water mark, and reported as "≤ X" otherwise.
        Options: %config Nbmem (interval, history, threshold, scan, scan_budget, show, reset_peak, gauge).
        """
        __tracebackhide__ = True  # a failing %%cudamem body shows the user's traceback, not ours
        args = parse_argstring(self.cudamem, line)
        if cell is not None:
            if args.command is not None or args.names:
                raise UsageError(f"%%cudamem takes options only, not {args.command!r}: put `%%cudamem` alone "
                                 f"on the first line, or use the line form `%cudamem {args.command}`.")
            return self._measure_cell(cell, args)
        if args.command is None:
            raise UsageError("%cudamem needs a command: " + ", ".join(_COMMANDS) + ". Example: `%cudamem on`. "
                             "To measure one cell, put `%%cudamem` on its first line.")
        if args.command not in _COMMANDS:
            raise UsageError(f"%cudamem: unknown command {args.command!r}; use one of: {', '.join(_COMMANDS)}.")
        if args.names and args.command != "clean":
            raise UsageError(f"%cudamem {args.command} takes no names (got {' '.join(args.names)}).")
        return getattr(self, f"_cmd_{args.command}")(args)

    def _measure_cell(self, cell: str, args: Any) -> None:
        s = self.session
        if self._nested:
            raise UsageError("%%cudamem cannot be nested inside another %%cudamem cell.")
        if s.in_cell:  # monitoring began this cell before we knew it was ours
            s.end_cell()
        s.begin_cell(self.shell.execution_count - 1, reset_peak=args.reset_peak or None,
                     scan=False if args.no_scan else None)
        self._nested = True
        result = None
        shell = self.shell
        # The body's exception is re-raised below so the cell fails (Run All stops, %debug works);
        # showing it here as well would print the traceback twice.
        shell.showtraceback = _defer_traceback
        # IPython decides "ends with ;" from the outer cell (the magic call): ask about the body instead.
        dh = shell.displayhook
        dh.quiet = lambda: dh.semicolon_at_end_of_expression(cell)
        try:
            result = shell.run_cell(cell, store_history=False)
        finally:
            del shell.showtraceback
            del dh.quiet
            self._nested = False
            error = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
            report = s.end_cell(error)
        if report is not None and not args.quiet:
            self._display(report)
        if isinstance(error, SyntaxError) and error is getattr(result, "error_before_exec", None):
            raise _AlreadyShown() from None  # IPython printed it while compiling; fail the cell quietly
        if error is not None:
            __tracebackhide__ = True  # IPython hides this frame: the traceback starts in the user's code
            raise error

    # -- line commands ---------------------------------------------------------------------------
    def _cmd_on(self, args: Any) -> None:
        s = self.session
        s.monitoring = True
        if args.reset_peak:
            self.options.reset_peak = True
        if args.no_scan:
            self.options.scan = False
        if s.settings.scan:
            s.take_baseline()

    def _cmd_off(self, args: Any) -> None:
        self.session.monitoring = False

    def _cmd_status(self, args: Any) -> Any:
        return self.session.status()

    def _cmd_report(self, args: Any) -> Any:
        return self.session.report()

    def _cmd_leaks(self, args: Any) -> Any:
        if args.cell is not None and args.cell < 0:
            raise UsageError(f"--cell takes a cell number (the N of In[N]), got {args.cell}.")
        return self.session.leaks(args.cell)

    def _cmd_plot(self, args: Any) -> Any:
        from .plotting import plot

        return plot(self.session)

    def _cmd_gauge(self, args: Any) -> None:
        if args.inline and args.sidebar:
            raise UsageError("%cudamem gauge: choose one of --inline or --sidebar.")
        self.show_gauge("inline" if args.inline else "sidebar" if args.sidebar else "auto", explicit=True)

    def _cmd_clean(self, args: Any) -> Any:
        names, to_cpu = list(args.names), list(args.to_cpu)
        outputs, traceback = args.outputs, args.traceback
        if args.all_flagged:
            for f in self.session.flagged():
                if f.kind == "output":
                    outputs = True
                elif f.kind == "traceback":
                    traceback = True
                else:
                    names += [r for r in f.roots if r not in names]
        if not (names or to_cpu or outputs or traceback or args.all_flagged):
            raise UsageError("%cudamem clean: say what goes: names (`%cudamem clean x`), --outputs, --traceback, "
                             "--to-cpu NAME or --all-flagged. Nothing was removed.")
        try:  # cleanup() checks every name before it removes anything; here its refusal is a usage error
            return cleanup(names=names, to_cpu=to_cpu, outputs=outputs, traceback=traceback,
                           collect=not args.no_collect, empty_cache=not args.no_empty_cache, shell=self.shell)
        except (ValueError, NameError, TypeError) as e:
            raise UsageError(f"%cudamem clean: {e}") from None

    # -- gauge -----------------------------------------------------------------------------------
    def show_gauge(self, where: str, *, explicit: bool = False) -> None:
        try:
            from .widget import show_gauge

            self.gauge = show_gauge(self.session, where, previous=self.gauge, shell=self.shell, explicit=explicit)
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


def _magics(shell: Any = None) -> NbmemMagics:
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    m = _ACTIVE.get(shell) if shell is not None else None
    if m is None:
        raise RuntimeError("nbmem is not loaded in this shell: run `%load_ext nbmem` first.")
    return m


def cleanup(names: Any = (), outputs: bool = False, traceback: bool = False, collect: bool = True,
            empty_cache: bool = True, to_cpu: Any = (), shell: Any = None) -> Any:
    """Delete the named variables and clear what you ask for; report the bytes each step freed.

    Nothing is removed that the call does not name. Names go through IPython's ``del_var``, which
    also drops them from ``Out``, ``_`` and the last result.
    """
    m = _magics(shell)
    names = [names] if isinstance(names, str) else list(names)
    to_cpu = [to_cpu] if isinstance(to_cpu, str) else list(to_cpu)
    for group, what in ((names, "names"), (to_cpu, "to_cpu")):
        for n in group:
            if not isinstance(n, str) or not n.isidentifier():
                raise ValueError(f"nbmem.cleanup({what}=...): {n!r} is not a variable name; pass top-level names "
                                 f"such as ['x', 'losses'] (to drop one element, do it yourself, e.g. "
                                 f"`losses.clear()`). Nothing was removed.")
    user = m.shell.user_ns
    missing = [n for n in names + to_cpu if n not in user]
    if missing:
        raise NameError(f"nbmem.cleanup: no variable named {', '.join(map(repr, missing))} in this notebook. "
                        f"Nothing was removed.")
    for n in to_cpu:
        if not hasattr(user[n], "cpu"):
            raise TypeError(f"nbmem.cleanup(to_cpu=[{n!r}]): {type(user[n]).__name__} has no .cpu(); only tensors "
                            f"and modules move. Nothing was removed.")
    return m.session.cleanup(names=names, to_cpu=to_cpu, outputs=bool(outputs), traceback=bool(traceback),
                             collect=bool(collect), empty_cache=bool(empty_cache))


def load_ipython_extension(shell: Any) -> None:
    """``%load_ext nbmem``: start the sampler, register the cell hooks and show the gauge."""
    if shell in _ACTIVE:
        return
    options = Nbmem(parent=shell)
    session = Session(ShellAdapter(shell), options.settings())
    magics = NbmemMagics(shell, options, session)
    session.start()

    def _changed(change: Any) -> None:
        try:
            session.reconfigure(options.settings())
        except Exception as e:
            session.fault("config", e)

    options.observe(_changed)
    shell.configurables.append(options)
    shell.register_magics(magics)
    shell.events.register("pre_run_cell", magics.pre_run_cell)
    shell.events.register("post_run_cell", magics.post_run_cell)
    _ACTIVE[shell] = magics
    print(session.greeting())
    if options.gauge != "none":
        magics.show_gauge(options.gauge)


def unload_ipython_extension(shell: Any) -> None:
    """``%unload_ext nbmem``: unregister everything, join the thread, close the gauge, forget records."""
    magics = _ACTIVE.pop(shell, None)
    if magics is None:
        return
    for event, fn in (("pre_run_cell", magics.pre_run_cell), ("post_run_cell", magics.post_run_cell)):
        try:
            shell.events.unregister(event, fn)
        except ValueError:
            pass
    if magics.options in shell.configurables:
        shell.configurables.remove(magics.options)
    magics.options.unobserve_all()
    mm = shell.magics_manager
    for kind in ("line", "cell"):
        if mm.magics[kind].get("cudamem") == magics.cudamem:
            del mm.magics[kind]["cudamem"]
    mm.registry.pop(type(magics).__name__, None)
    magics.close()
