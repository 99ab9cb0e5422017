"""nbmem's magics: where your GPU memory went, cell by cell, and how to get it back.

Load it once per kernel with ``%load_ext nbmem``.

``%%cudamem`` (first line of a cell) runs the cell and reports what it did: wall time, Δallocated,
Δreserved, the peak allocated inside the cell, Δ of this process's NVML usage, Δ RSS, and which names
keep the memory it added alive.

    %%cudamem [--lines] [--reset-peak] [--no-scan] [--quiet]
    %%cudamem --fit NAME=V1,V2[,...] [--no-restore] [--want N] [--on SIZE|GPU] [--host-limit SIZE]
                                             will it fit? the largest NAME this cell can run at

``%cudamem`` (a line) takes a command; each command accepts only its own options:

    %cudamem on [--lines] [--reset-peak] [--no-scan]
                                             measure every cell from now on
    %cudamem off                             stop measuring cells (the sampler and gauge keep running)
    %cudamem status                          what nbmem can and cannot see, and why
    %cudamem report                          one row per measured cell (nbmem.report(): every column)
    %cudamem leaks [--cell N] [--detail]     who holds memory now, or what cell N added: a row per owner
    %cudamem clean NAME ... [--outputs] [--traceback] [--last-report] [--to-cpu NAME] [--compiled]
                   [--no-collect] [--no-empty-cache]
    %cudamem gauge [--inline | --sidebar]    show the live gauge again
    %cudamem lines [--cell N]                the last --lines cell's lines, or cell N's (= nbmem.lines())
    %cudamem plot                            memory over time with cells shaded (= nbmem.plot())

A command shows what it finds and returns nothing (nothing of nbmem's lands in ``Out[]``), and a cell of
nbmem's own commands gets no cell report; a misspelled command or option is told the closest one.

Cleanup removes exactly what you name, and checks the whole request before it changes anything:

- ``clean x`` deletes the variable ``x`` and IPython's own hidden references to the same object
  (``Out[n]``, ``_n``, ``_``/``__``/``___``, the last result). Other variables bound to that object
  are never removed: the report names them ("still held by alias") and the bytes they keep count as
  not freed.
- ``--outputs`` clears the output history; ``--traceback`` drops the last exception's frames (then
  ``%debug`` cannot inspect it); ``--to-cpu NAME`` moves a tensor or module to the CPU.
- ``--compiled`` runs ``torch._dynamo.reset()``: what ``torch.compile`` made goes (compiled code, and with
  ``mode="reduce-overhead"`` the CUDA graphs and the private memory pool they keep, which a cell report
  names with its bytes); a compiled module compiles again when it is next called.
- ``--last-report`` does exactly what the most recent cell report listed under "would run": it deletes
  the variables that report showed as holders, clears the outputs or the traceback if it showed
  them, and nothing else.
- Then ``gc.collect()`` and ``torch.cuda.empty_cache()`` (``--no-collect``, ``--no-empty-cache`` skip
  them). Every step reports the bytes it freed; a step that fails is reported and the others stand.
- An unknown, protected (IPython's own, ``__name__``) or misspelled name is refused with every
  problem listed, and nothing at all is removed.

Peaks: the allocator keeps one global peak counter per device (pytorch#16266). nbmem never resets
it, so your own ``torch.cuda.max_memory_allocated()`` keeps its meaning. A cell's peak is exact when
the cell raised that counter, or when the allocator's cumulative counters pin it (no allocation, or
nothing the cell allocated was freed in it); otherwise the report gives "≤ X". For those cells the
allocator's own event trace gives the exact peak: ``%%cudamem`` records it for its cell, and
``%config Nbmem.trace = True`` for every monitored cell (about 3 µs per allocation while a cell
runs: 20% of a launch-bound training loop on an H100). A recording you started yourself
(``torch.cuda.memory._record_memory_history``) is read, never changed. ``--reset-peak`` resets the
counter for those who want that.

Lines: ``%%cudamem --lines`` also records each allocation's Python stack and reports, per line of
the cell, what it left allocated (Δ), the peak while it ran and the user frame that allocated the
largest blocks live then; holders get the line that allocated them, and an out-of-memory error
names the line that asked and what each line had live. GPU only; it costs a few microseconds per
allocation while the cell runs.

Will it fit: ``%%cudamem --fit batch=8,16,32`` on a cell whose code uses ``batch`` (any name, 2 to 5
values) runs the cell once per value (and once more at the smallest first, uncounted: a warm-up), with the
name bound, under the allocator's trace, and predicts the largest value that fits into this GPU's free
memory, never above it: a timeline of every allocation fitted to the value and replayed through a model
of the caching allocator (its blocks, segments and pools), from what the notebook already holds. It
prints fixed bytes, bytes per unit, the lines whose memory grows, the memory it fits into with the margin
stated, and the prediction with the power of two below it (``nbmem.fit()`` returns the same record;
``nbmem.plot_fit()`` draws it). The training state the cell reaches (parameters, buffers, gradients,
optimizers, LR schedulers, gradient scalers, train/eval flags) and the random generators are copied first
and put back bit for bit after, also after an error, so training goes on as if the fit never ran; the
report names what was restored and what could not be (an iterator the cell advanced), a line each
(``--no-restore`` skips that, and says the fit trained them); what the cell's runs bound is put back as it
was. A value predicted not to fit is never run; an out-of-memory in a run is caught and freed. With
``--want 512``, when 512 does not fit, remedies with the largest value each allows: gradient accumulation
(from the fit itself); checkpointing the model's repeated blocks and bf16 autocast, each measured by the runs
again under it (undone after; one that cannot apply says why); ``expandable_segments`` (it needs a
restart). GPU only: on a machine without CUDA it says so and the cell does not run.

Options: ``%config Nbmem.<name> = value``, or ``c.Nbmem.<name>`` in ipython_config.py; ``%config Nbmem``
lists them with their allowed values. A value outside those is refused with one line, and the old
value stays.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, Protocol

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from nbmem.clean.request import CleanupRefused, CleanupRequest
from nbmem.ipython.shell import compiled_as, semicolon_of
from nbmem.ipython.usage import command_refusal, option_refusal, own_command, unknown_options
from nbmem.options import OPTION_BY_NAME
from nbmem.reports import CellTable
from nbmem.session import Session

#: Which options each command takes; anything else given is a usage error and nothing runs.
COMMANDS: dict[str, frozenset[str]] = {
    "on": frozenset({"reset_peak", "no_scan", "lines"}),
    "off": frozenset(),
    "status": frozenset(),
    "report": frozenset(),
    "leaks": frozenset({"cell", "detail"}),
    "clean": frozenset({"names", "outputs", "traceback", "last_report", "to_cpu", "compiled", "no_collect",
                        "no_empty_cache"}),
    "gauge": frozenset({"inline", "sidebar"}),
    "plot": frozenset(),
    "lines": frozenset({"cell"}),
}
CELL_OPTIONS = frozenset({"reset_peak", "no_scan", "quiet", "lines", "fit", "no_restore", "want", "on_gpu",
                          "host_limit"})
#: What --fit goes with: it runs the cell several times, so a cell's own measurement options do not apply.
FIT_OPTIONS = frozenset({"fit", "no_restore", "quiet", "want", "on_gpu", "host_limit"})
_FIT = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*(\S+)\s*\Z")
_WHOLE = re.compile(r"[0-9]+(?:_[0-9]+)*")
_FLAG_NAMES = {"names": "NAME", "reset_peak": "--reset-peak", "no_scan": "--no-scan", "quiet": "--quiet",
               "lines": "--lines",
               "cell": "--cell", "outputs": "--outputs", "traceback": "--traceback", "last_report": "--last-report",
               "to_cpu": "--to-cpu", "compiled": "--compiled", "no_collect": "--no-collect",
               "no_empty_cache": "--no-empty-cache",
               "inline": "--inline", "sidebar": "--sidebar", "detail": "--detail", "fit": "--fit",
               "no_restore": "--no-restore", "want": "--want", "on_gpu": "--on", "host_limit": "--host-limit"}


def _set(value: Any) -> bool:
    """Whether an option was given (0 counts: `--cell 0` is a cell number)."""
    return value is not None and value is not False and value != []


class Root(Protocol):
    """What the magics delegate to: the composition root (``root.Loaded``)."""

    options: Any
    session: Session
    nested: bool

    def display(self, obj: Any) -> None: ...

    def show_gauge(self, where: str, *, explicit: bool = False) -> None: ...


@magics_class
class NbmemMagics(Magics):
    """The thin adapter between IPython and the session."""

    shell: Any  # always set: the adapter is created for a shell

    def __init__(self, shell: Any, root: Root) -> None:
        super().__init__(shell)
        self.root = root  # the composition root: the session, the gauge, the hooks (ipython/root.py)
        self.options = root.options
        self.session = root.session

    # -- the magic ---------------------------------------------------------------------------------
    @magic_arguments()
    @argument("command", nargs="?", default=None, help="Line form only: " + ", ".join(COMMANDS) + ".")
    @argument("names", nargs="*", default=[], help="With `clean`: the variables to delete.")
    @argument("--reset-peak", action="store_true",
              help="Cell form and `on`: reset the allocator's peak counter at the start of each measured cell "
                   "(your own torch.cuda.max_memory_allocated() then counts from there).")
    @argument("--no-scan", action="store_true", help="Cell form and `on`: skip finding which names hold memory.")
    @argument("-q", "--quiet", action="store_true", help="Cell form: record the report without showing it.")
    @argument("--lines", action="store_true",
              help="Cell form and `on`: record the Python stack of each CUDA allocation and report memory per "
                   "line of the cell (Δ allocated, peak while the line ran, where its largest blocks came from). "
                   "Costs a few microseconds per allocation while the cell runs.")
    @argument("--fit", default=None, metavar="NAME=V1,V2,...",
              help="Cell form: run the cell once per value with NAME bound (2 to 5 positive whole numbers) and "
                   "predict the largest NAME that fits in this GPU's free memory, never above it. GPU only.")
    @argument("--no-restore", action="store_true",
              help="With --fit: do not copy the model's and optimizer's state to host memory and back (the fit "
                   "then trains them).")
    @argument("--want", default=None, metavar="N",
              help="With --fit: the NAME you want; when it does not fit, remedies with the largest NAME each allows.")
    @argument("--on", dest="on_gpu", default=None, metavar="SIZE|GPU",
              help="With --fit: the answer for another GPU, from the same runs: a memory size (24GiB, 24GB) or a "
                   "GPU's name (T4, L4, \"A100 40GB\", ...), less a CUDA context as large as this one's.")
    @argument("--host-limit", dest="host_limit", default=None, metavar="SIZE",
              help="With --fit: the host memory this process may use (8GiB, 8GB), where the cell keeps memory on the "
                   "host (save_on_cpu, pinned buffers, .cpu()); default: the container's limit, else the machine's.")
    @argument("--cell", type=int, default=None, help="With `leaks`: what cell N added; with `lines`: cell N's lines.")
    @argument("--detail", action="store_true",
              help="With `leaks`: a row per tensor instead of a row per owner (the name you typed).")
    @argument("--outputs", action="store_true", help="With `clean`: clear the output history (Out, _N, _).")
    @argument("--traceback", action="store_true",
              help="With `clean`: drop the last exception's frames (ends %%debug for it).")
    @argument("--last-report", action="store_true",
              help="With `clean`: exactly what the last cell report listed under 'would run'.")
    @argument("--all-flagged", action="store_true", help=argparse.SUPPRESS)
    @argument("--to-cpu", action="append", default=[], metavar="NAME",
              help="With `clean`: move this tensor or module to the CPU instead of deleting it.")
    @argument("--compiled", action="store_true",
              help="With `clean`: torch._dynamo.reset(), dropping what torch.compile made (compiled code, CUDA graphs "
                   "and their memory pool); compiled modules compile again when next called.")
    @argument("--no-collect", action="store_true", help="With `clean`: skip gc.collect().")
    @argument("--no-empty-cache", action="store_true", help="With `clean`: skip torch.cuda.empty_cache().")
    @argument("--inline", action="store_true", help="With `gauge`: show it in the cell output.")
    @argument("--sidebar", action="store_true", help="With `gauge`: show it in JupyterLab's right sidebar.")
    @line_cell_magic
    def cudamem(self, line: str, cell: str | None = None) -> None:
        """Measure GPU memory per cell, find which names hold it, and give it back.

        As a cell magic, ``%%cudamem`` on a cell's first line runs the cell and reports wall time,
        Δallocated, Δreserved, the peak inside the cell, Δ NVML process usage, Δ RSS and the names
        that keep what the cell added. As a line magic it takes a command:

          on / off            measure every cell from now on / stop
          status              what nbmem can and cannot see, and why
          report              one row per measured cell (nbmem.report(): every column, a DataFrame)
          leaks [--cell N]    who holds memory now, or what cell N added, a row per owner (the name
                              you typed); --detail, a row per tensor (= nbmem.leaks(detail=True))
          clean NAME ...      delete exactly these variables (and IPython's hidden references
                              to their objects, never another variable); --outputs, --traceback,
                              --last-report, --to-cpu NAME, --compiled (torch._dynamo.reset():
                              compiled code and CUDA graphs); then gc.collect() and empty_cache().
                              The whole request is checked first: one bad name, nothing removed.
          gauge               show the live gauge again (--inline or --sidebar)
          lines [--cell N]    memory per line of the last cell measured with --lines (= nbmem.lines())
          plot                memory over time, measured cells shaded (= nbmem.plot())

        %%cudamem gives the cell's exact peak from the allocator's event trace, without ever resetting
        your peak counter (%config Nbmem.trace = True does so for every monitored cell, at a cost);
        --lines adds memory per line of the cell.

        Will it fit? `%%cudamem --fit batch=8,16,32` runs the cell at those values (a cell that uses
        `batch`), puts your training state back, and answers the largest value that fits on every GPU the
        cell uses, from the allocator's real allocations; with --want N, a value that does not fit gets
        remedies, each with the largest value it allows. --on SIZE|GPU answers for another GPU from the
        same runs (--on 24GiB, --on L4, --on "A100 40GB"); --host-limit SIZE caps host memory for a cell
        that keeps memory there; --no-restore leaves the state as the runs left it. Needs CUDA. The same
        in Python: nbmem.fit(body, "batch", [8, 16, 32], on="L4").

        Options: %config Nbmem (interval, history, threshold, scan, scan_budget, show, reset_peak,
        trace, lines, trace_entries, gauge).
        """
        try:
            args = parse_argstring(self.cudamem, line)
        except (UsageError, SystemExit, ValueError) as e:  # argparse's refusal or exit; shlex on an unclosed quote
            raise UsageError(_unreadable(self.cudamem.parser, line, cell, e)) from None
        if args.all_flagged:
            raise UsageError("%cudamem clean: --all-flagged is now --last-report, which removes exactly the holders "
                             "the last cell report listed (its 'would run' line).")
        if cell is not None:
            if args.command is not None or args.names:
                if args.on_gpu is not None or args.host_limit is not None:
                    # `--on A100 40GB`: the name's second word came apart from it, as a shell splits it.
                    raise UsageError(f"%%cudamem: --on and --host-limit take one value each, not {args.command!r} "
                                     "after it: quote a name with a space (`--on \"A100 40GB\"`). Nothing was run.")
                raise UsageError(f"%%cudamem takes options only, not {args.command!r}: put `%%cudamem` alone "
                                 f"on the first line, or use the line form `%cudamem {args.command}`. "
                                 "Nothing was run.")
            self._only(args, CELL_OPTIONS, "%%cudamem")
            if (args.fit is not None or args.no_restore or args.want is not None or args.on_gpu is not None
                    or args.host_limit is not None):
                return self._fit_cell(cell, args)
            return self._measure_cell(cell, args)
        if args.command is None:
            raise UsageError("%cudamem needs a command: " + ", ".join(COMMANDS) + ". Example: `%cudamem on`. "
                             "To measure one cell, put `%%cudamem` on its first line.")
        if args.command not in COMMANDS:
            raise UsageError(command_refusal(args.command, COMMANDS))
        self._only(args, COMMANDS[args.command], f"%cudamem {args.command}")
        getattr(self, f"_cmd_{args.command}")(args)

    def _only(self, args: Any, allowed: frozenset[str], what: str) -> None:
        given = [k for k in _FLAG_NAMES if _set(getattr(args, k))]
        wrong = [k for k in given if k not in allowed]
        if wrong:
            takes = ", ".join(_FLAG_NAMES[k] for k in sorted(allowed) if k != "names") or "no options"
            extra = " and names" if "names" in allowed else ""
            shown = ", ".join(_FLAG_NAMES[k] if k != "names" else " ".join(args.names) for k in wrong)
            raise UsageError(f"{what} does not take {shown}; it takes {takes}{extra}. Nothing was run.")

    def _measure_cell(self, body: str, args: Any) -> None:
        s = self.session
        sh = self.shell
        if self.root.nested:
            raise UsageError("%%cudamem cannot be nested inside another %%cudamem cell. The inner cell did not run.")
        if s.in_cell:  # monitoring began this cell before we knew it was ours
            self._guarded("%%cudamem", s.end_cell)
        number = sh.execution_count - 1
        # nbmem failing to open its measurement must not keep the user's cell from running.
        self._guarded("%%cudamem", lambda: s.begin_cell(
            number, source=body, reset_peak=args.reset_peak or None, scan=False if args.no_scan else None,
            lines=args.lines or None, trace=True))  # one cell, measured on purpose: its exact peak
        outer = getattr(sh.displayhook, "exec_result", None)  # this cell's result, which IPython fills in
        self.root.nested = True
        result = None
        try:
            with compiled_as(sh, number), semicolon_of(sh, body):
                result = sh.run_cell(body, store_history=False)
        finally:
            self.root.nested = False
            sh.displayhook.exec_result = outer  # the inner run cleared it
            error = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
            report = self._guarded("%%cudamem", lambda: s.end_cell(error))
        if report is not None and not args.quiet:
            self.root.display(report)
            s.shown(report)
        if error is not None:
            # The body's own run already showed the traceback (through any showtraceback you installed)
            # and set sys.last_* for %debug; failing this cell's result stops Run All here.
            if outer is not None:
                outer.error_in_exec = error
            else:
                raise error

    def _guarded(self, where: str, step: Any) -> Any:
        """Run one of nbmem's own steps around a cell; a failure is recorded (and told once), never raised."""
        try:
            return step()
        except Exception as e:
            self.session.fault(where, e)
            return None

    def _fit_cell(self, body: str, args: Any) -> None:
        # "Will it fit?" is imported when a fit is asked for: %load_ext does not pay for it.
        from nbmem.fitting.analysis.devices import parse_on
        from nbmem.fitting.analysis.hostroom import parse_host_limit
        from nbmem.fitting.runs.progress import progress_line
        from nbmem.fitting.runs.state import FitRefused

        name, values, want = fit_args(args)
        self._only(args, FIT_OPTIONS, "%%cudamem --fit")
        try:
            on = None if args.on_gpu is None else parse_on(args.on_gpu)
        except ValueError as e:
            raise UsageError(f"%%cudamem --on {e}. Nothing was run.") from None
        try:
            host_limit = None if args.host_limit is None else parse_host_limit(args.host_limit)
        except ValueError as e:
            raise UsageError(f"%%cudamem --host-limit {e}. Nothing was run.") from None
        if name not in self.session.adapter.mentioned(body):
            raise UsageError(f"%%cudamem --fit: the cell does not use `{name}`: a fit binds {name} to each value "
                             f"and runs the cell, so its code must read it (e.g. `x = torch.randn({name}, 512)`). "
                             "Nothing was run.")
        try:
            result = self.session.fit(body, name, values, cell=self.shell.execution_count - 1,
                                      restore=not args.no_restore, want=want, on=on, host_limit=host_limit,
                                      show=progress_line(  # in place
                                          display if getattr(self.shell, "kernel", None) is not None else None,
                                          lambda e: self.session.fault("fit progress", e)))
        except FitRefused as e:
            ran = "The cell ran once, no more." if e.ran else "Nothing was run."
            raise UsageError(f"%%cudamem --fit: {e}. {ran}") from None
        except KeyboardInterrupt as e:
            # Where it stopped and what it put back is said (the line, the note): the way there is nbmem's insides.
            raise e.with_traceback(None) from None
        if not args.quiet:
            self.root.display(result)
        return None

    # -- line commands -----------------------------------------------------------------------------
    def _set(self, name: str, value: Any) -> None:
        setattr(self.options, name, OPTION_BY_NAME[name].check(value))

    def _cmd_on(self, args: Any) -> None:
        s = self.session
        if args.reset_peak:
            self._set("reset_peak", True)
        if args.no_scan:
            self._set("scan", False)
        if args.lines:
            self._set("lines", True)
        s.monitoring = True
        if s.settings.scan:
            s.take_baseline()
        from nbmem.formatting import fmt_bytes

        print(f"nbmem: measuring every cell from now on; a report shows under cells that change memory by "
              f"{fmt_bytes(s.settings.threshold_bytes)} or more, find a holder or fail. `%cudamem off` stops.")

    def _cmd_off(self, args: Any) -> None:
        self.session.monitoring = False
        print("nbmem: no longer measuring cells (the sampler and the gauge keep running). `%cudamem on` resumes.")

    # What a command shows is displayed, never returned: nbmem adds nothing to the output history (Out[n]).
    def _cmd_status(self, args: Any) -> None:
        self.root.display(self.session.status())

    def _cmd_report(self, args: Any) -> None:
        self.root.display(CellTable(tuple(self.session.cell_list(own=False))))

    def _cmd_leaks(self, args: Any) -> None:
        if args.cell is not None and args.cell < 0:
            raise UsageError(f"--cell takes a cell number (the N of In[N]), got {args.cell}.")
        try:
            table = self.session.leaks_table(args.cell, detail=args.detail)
        except LookupError as e:
            raise UsageError(f"%cudamem leaks: {e}") from None
        self.root.display(table)

    def _cmd_lines(self, args: Any) -> None:
        try:
            lines = self.session.lines_table(args.cell)
        except LookupError as e:
            raise UsageError(f"%cudamem lines: {e}") from None
        self.root.display(lines)

    def _cmd_plot(self, args: Any) -> None:
        from nbmem.ui.plotting import plot

        self.root.display(plot(self.session))

    def _cmd_gauge(self, args: Any) -> None:
        if args.inline and args.sidebar:
            raise UsageError("%cudamem gauge: choose one of --inline or --sidebar.")
        self.root.show_gauge("inline" if args.inline else "sidebar" if args.sidebar else "auto", explicit=True)

    def _cmd_clean(self, args: Any) -> None:
        try:
            report = self.session.cleanup(_cleanup_request(args, self.session.last_shown_report))
        except CleanupRefused as e:
            raise UsageError(f"%cudamem clean: {e}") from None
        self.root.display(report)


def _unreadable(parser: Any, line: str, cell: str | None, e: BaseException) -> str:
    """Why ``line`` could not be read: an unknown command or option, with the ones it could have been."""
    command = own_command("%cudamem " + line) if cell is None else None
    if command and command not in COMMANDS:
        return command_refusal(command, COMMANDS)
    unknown = unknown_options(line, parser._option_string_actions)
    if unknown and cell is None and not command:
        return f"%cudamem: the command comes first, then its options: {', '.join(COMMANDS)}. Nothing was run."
    if unknown:
        what, allowed = (f"%cudamem {command}", COMMANDS[command]) if command else ("%%cudamem", CELL_OPTIONS)
        return option_refusal(what, unknown, [_FLAG_NAMES[k] for k in sorted(allowed) if k != "names"])
    why = f" ({e})" if str(e) and not isinstance(e, SystemExit) else ""
    what = "%cudamem" if cell is None else "%%cudamem"
    return f"{what}: could not read {line[:80]!r}{why}; `%cudamem?` lists the options. Nothing was run."


def _cleanup_request(args: Any, last: Any) -> CleanupRequest:
    """What ``%cudamem clean ...`` asks for (``last``: the last report shown); a UsageError if nothing."""
    req = CleanupRequest.of(args.names, args.to_cpu, args.outputs, args.traceback, not args.no_collect,
                            not args.no_empty_cache, args.compiled)
    if args.last_report:
        if last is None:
            raise UsageError("%cudamem clean --last-report: no report has been shown yet. Nothing was removed.")
        listed = last.last_report_cleanup()
        if not listed and not req:
            raise UsageError(f"%cudamem clean --last-report: the last report shown (cell [{last.cell}]) "
                             "listed nothing to remove. Nothing was run.")
        req = req.plus(listed)
    if not req and not args.last_report:
        raise UsageError("%cudamem clean: say what goes: names (`%cudamem clean x`), --outputs, "
                         "--traceback, --to-cpu NAME, --compiled or --last-report. Nothing was removed.")
    return req


def parse_fit(spec: str) -> tuple[str, tuple[int, ...]]:
    """``batch=8,16,32`` as (``batch``, (8, 16, 32)); a UsageError that names the fix otherwise."""
    m = _FIT.match(spec)
    if not m:
        raise UsageError(f"%%cudamem --fit takes NAME=V1,V2,... (e.g. --fit batch=8,16,32), not {spec[:60]!r}. "
                         "Nothing was run.")
    name, raw = m.group(1), [_whole_number(v) for v in m.group(2).split(",")]
    if not all(raw):  # None: not a number; 0: not positive
        raise UsageError(f"%%cudamem --fit {name}=...: the values must be positive whole numbers, comma-separated "
                         f"(e.g. {name}=8,16,32), not {m.group(2)[:60]!r}. Nothing was run.")
    values = tuple(sorted({v for v in raw if v}))
    if len(values) < 2:
        raise UsageError(f"%%cudamem --fit {name}=...: give 2 to 5 different values (e.g. {name}=8,16,32): one "
                         "value shows no growth. Nothing was run.")
    if len(values) > 5:
        raise UsageError(f"%%cudamem --fit {name}=...: give 2 to 5 different values: each one runs the cell. "
                         "Nothing was run.")
    return name, values


def fit_args(args: Any) -> tuple[str, tuple[int, ...], int | None]:
    """The name, values and wanted value of ``%%cudamem --fit ... [--want N]``; a UsageError otherwise."""
    if args.fit is None:
        flag = ("--no-restore" if args.no_restore else "--want" if args.want is not None else
                "--on" if args.on_gpu is not None else "--host-limit")
        raise UsageError(f"%%cudamem: {flag} goes with --fit NAME=V1,V2,... Nothing was run.")
    name, values = parse_fit(args.fit)
    return name, values, None if args.want is None else parse_want(args.want, name)


def parse_want(spec: str, name: str) -> int:
    """``--want 512`` (or ``512_000``) as a whole number; a one-line UsageError that names the fix otherwise."""
    value = _whole_number(spec)
    if not value:
        raise UsageError(f"%%cudamem --want takes the {name} you want to run at, a positive whole number "
                         f"(e.g. --want 512), not {spec[:40]!r}. Nothing was run.")
    return value


def _whole_number(text: str) -> int | None:
    """``512`` or ``512_000`` (ASCII digits, as Python writes an int) as an int; None for anything else."""
    # Not str.isdigit: it takes "²", which int() refuses, and digits of other scripts, which no one means here.
    if not _WHOLE.fullmatch(text.strip()):
        return None
    try:
        return int(text)
    except ValueError:  # more digits than int() reads (sys.get_int_max_str_digits)
        return None
