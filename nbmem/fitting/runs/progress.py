"""A fit you can watch: one line under the cell, updated in place while a fit runs the body, gone when it ends.

The runner makes a ``FitProgress`` per fit and runs the body through ``watch``, so every run (the warm-up, the
counted ones, those that check the growth near the answer, those under a remedy, the timed steps) is one
``step``: which run of about how many, at which value, and the time so far. Before a run that will take long
(its time scaled from the run at the largest value so far, as the runner's own budget for more runs does),
the line says how long. ``done`` erases the line, or leaves it final where the fit was interrupted, saying what
was put back; while the fit puts things back, a second Ctrl-C waits (``interrupts_held``), and the fit stops once
everything is back, saying so.

Where the line goes is the adapter's: it hands a ``show(text, final)`` callback (``progress_line``: IPython's
``display`` updated in place in a kernel, ``\r`` on a terminal's stdout otherwise; ``guarded``, so that a failing
display is recorded and never stops the fit). Nothing here imports IPython.
"""

from __future__ import annotations

import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from nbmem.formatting import fmt_seconds

#: ``show(text, final)``: the line as it stands now; ``final`` when the fit ended (``text`` is "" to erase it).
Show = Callable[[str, bool], None]

#: A fit shorter than this shows no line at all (most fits of small bodies) ...
QUIET_S = 1.0
#: ... and a run expected to take longer than this is said before it starts, with its time.
LONG_S = 15.0


def planned_runs(schedule: int, refine: int, remedies: int) -> tuple[int, int]:
    """The fewest and the most runs a fit may make: its ``schedule`` (warm-up and values), up to ``refine`` more
    near the answer, and where ``remedies`` may be measured, as many again under each and two timed steps each
    (the plain step's too)."""
    most = (schedule + refine) * (1 + remedies) + (2 * (remedies + 1) if remedies else 0)
    return schedule, most


class FitProgress:
    """A fit's progress line: ``step`` before each run of the body, ``done`` when the fit ends. ``least`` and
    ``most``: how many runs the fit may make (``planned_runs``); the time counts from its making."""

    def __init__(self, show: Show | None, name: str, least: int, most: int, *,
                 clock: Callable[[], float] = time.monotonic, compiled_model: bool = False,
                 graphs: Callable[[], int] = lambda: 0) -> None:
        self.show, self.name, self.least, self.most, self.clock = show, name, least, most, clock
        self.compiled_model = compiled_model  # a torch.compile'd model: its first run compiles, said at once
        self.graphs = graphs  # torch.compile's graph count (``torchcheck.graphs_compiled``)
        self.started = clock()
        self.runs = 0
        self.shown = False
        self.compile_s = 0.0  # the runs during which torch.compile made a graph, in all
        self._at: tuple[int, float] | None = None  # the run under way: its value, its start
        self._took: dict[int, float] = {}  # each value's last run, start to the next start
        self._ahead = ""  # what the runs about to come will take, where that is long
        self._compiling = ""  # what torch.compile's compiles will make the fit take, once the first was seen ...
        self._compiling_until = 0.0  # ... said until then
        self._compiles = 0
        self._ran: float | None = None  # the last watched run's own time (None: not watched, start to start)
        self._skip = False  # the last run's time is not a step's: it compiled, or it failed

    def watch(self, run: Callable[[int], object]) -> Callable[[int], object]:
        """``run`` that says each of its runs first, and times each: the run's own time, not the fit's analysis
        between runs, which does not grow with the value. A run that compiled or failed gives no step's time."""
        def watched(value: int) -> object:
            self.step(value)
            graphs, started = self.graphs(), self.clock()
            try:
                out = run(value)
            except BaseException:
                self._skip = True  # it stopped halfway
                raise
            took = self.clock() - started
            if self.graphs() != graphs:
                self._skip = True
                self._compiled(took)
            else:
                self._ran = took
            return out
        return watched

    def step(self, value: int) -> None:
        """A run at ``value`` starts: the line updated, with its expected time where that is long."""
        now = self.clock()
        if self._at is not None and not self._skip:
            self._took[self._at[0]] = self._ran if self._ran is not None else now - self._at[1]
        self._ran, self._skip = None, False
        self._at = (value, now)
        self.runs += 1
        expected = self.expected_s(value)
        if self.show is not None and self.runs == 1 and self.compiled_model:
            self.show(f"nbmem fit: run 1 of {self._of()} · {self.name}={value:,} · a torch.compile'd model: it "
                      f"compiles a graph first at each new range of {self.name}, often 10 s or more each", False)
            self.shown = True
            return
        if self.show is None or (now - self.started < QUIET_S and (expected is None or expected <= LONG_S)):
            return
        so_far = fmt_seconds(now - self.started)
        text = f"nbmem fit: run {self.runs} of {self._of()} · {self.name}={value:,} · {so_far} so far"
        if expected is not None and expected > LONG_S:
            text += f" · this run will take about {_about(expected)}"
        elif self._ahead:
            text += f" · {self._ahead}"
        elif self._compiling and now - self.started < self._compiling_until:
            text += f" · {self._compiling}"
        self.show(text, False)
        self.shown = True

    def ahead(self, values: list[int], what: str) -> None:
        """Runs at ``values`` come next: where together they will take longer than ``LONG_S``, the line says so
        before the first starts, and keeps saying it while they run."""
        times = [self.expected_s(v) for v in values]
        total = sum(t for t in times if t is not None)
        self._ahead = f"{what} will take about {_about(total)} in all" if total > LONG_S else ""
        if self._ahead and self.show is not None and self._at is not None:
            self.show(f"nbmem fit: run {self.runs} of {self._of()} · {fmt_seconds(self.clock() - self.started)} "
                      f"so far · {self._ahead}", False)
            self.shown = True

    def _compiled(self, run_s: float) -> None:
        """torch.compile made a graph in the run that just ended, which took ``run_s``: the compiler's time, not
        a step's. At the first: it compiles again at a second shape (one graph for every size) and may once more
        at sizes far from the first ones, each about as long; where that adds up to long, the line says so from
        the next run on, until that time is up."""
        self.compile_s += run_s
        if self._compiles == 0 and 2 * run_s > LONG_S:
            self._compiling_until = self.clock() - self.started + 2 * run_s
            self._compiling = (f"torch.compile compiles a graph at each new range of {self.name} (the first took "
                               f"{_about(run_s)}): this fit takes about {_about(self._compiling_until)}, most of "
                               "it compiling")
        self._compiles += 1

    def expected_s(self, value: int) -> float | None:
        """How long a run at ``value`` will take: the last run at the largest value so far, scaled to it (None
        before any run ended)."""
        if not self._took:
            return None
        top = max(self._took)
        return self._took[top] * value / top

    def done(self, failed: BaseException | None = None) -> None:
        """The fit ended: the line goes, or, where it was interrupted, stays saying so and what was put back (the
        runner's note on the error, where it has one)."""
        if self.show is None:
            return
        if isinstance(failed, KeyboardInterrupt):
            at = f" at {self.name}={self._at[0]:,}" if self._at is not None else ""
            notes = [n for n in getattr(failed, "__notes__", ()) if isinstance(n, str) and n.startswith("nbmem fit: ")]
            told = notes[-1].removeprefix("nbmem fit: ") if notes else (
                f"stopped after {self.runs} run{'s' if self.runs != 1 else ''} of the body")
            self.show(f"nbmem fit interrupted{at} after {fmt_seconds(self.clock() - self.started)}: {told}", True)
        elif self.shown:
            self.show("", True)

    def _of(self) -> str:
        least, most = max(self.least, self.runs), max(self.most, self.runs)
        return f"{most}" if least >= most else f"{least}–{most}"


class Presses:
    """The Ctrl-C presses ``interrupts_held`` kept from its block."""

    def __init__(self) -> None:
        self.count = 0

    @property
    def pressed(self) -> bool:
        return self.count > 0


@contextmanager
def interrupts_held() -> Iterator[Presses]:
    """Ctrl-C pressed inside the block waits until the block is done: a fit putting the training state back is
    never stopped halfway by a second press. The presses are counted, not raised: the caller finishes what it
    was doing, says so, and raises ``KeyboardInterrupt`` itself (or drops the press where the fit is already
    stopping with an error). Only in the main thread, and only where Python's own handler is the one installed
    (a handler of the notebook's or the kernel's is left alone, and sees the press as it would without the fit)."""
    presses = Presses()
    if threading.current_thread() is not threading.main_thread() or (
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield presses
        return

    def held(signum: int, frame: object) -> None:
        presses.count += 1

    signal.signal(signal.SIGINT, held)
    try:
        yield presses
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _about(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min"


# -- where the line goes ------------------------------------------------------------------------------------------
def progress_line(display: Callable[..., Any] | None, fault: Callable[[Exception], object]) -> Show:
    """Where the adapter shows a fit's line: with IPython's ``display`` in a kernel, else on the terminal's
    stdout; ``guarded`` with ``fault``."""
    return guarded(display_line(display) if display is not None else terminal_line(), fault)


def terminal_line(stream: Callable[[], TextIO] = lambda: sys.stdout, width: Callable[[], int] | None = None) -> Show:
    """The line on a terminal: written over itself with ``\\r``, cut to the terminal's width (a line that wraps
    cannot be written over), erased at the end or left whole with a newline when final (it is not written over
    again, and an interrupted fit's says what it put back). ``stream`` is read at each update (IPython may swap
    ``sys.stdout``)."""
    cols = width or (lambda: shutil.get_terminal_size().columns)
    last = [0]

    def show(text: str, final: bool) -> None:
        text = text if final else text[:max(cols() - 1, 20)]
        out = stream()
        out.write("\r" + text + " " * max(last[0] - len(text), 0) + ("\r" if not text else "\n" if final else ""))
        out.flush()
        last[0] = 0 if final else len(text)

    return show


def display_line(display: Callable[..., Any]) -> Show:
    """The line in a kernel: one output under the cell, updated in place (IPython's ``display`` with a
    ``display_id``), emptied at the end or left final."""
    handle: list[Any] = []

    def show(text: str, final: bool) -> None:
        data = {"text/plain": text}
        if handle:
            handle[0].update(data, raw=True)
        else:
            handle.append(display(data, raw=True, display_id=True))

    return show


def guarded(show: Show, fault: Callable[[Exception], object]) -> Show:
    """``show`` that never breaks the fit: its first error is handed to ``fault`` (recorded, told once) and the
    line shows no more."""
    broken: list[Exception] = []

    def safe(text: str, final: bool) -> None:
        if broken:
            return
        try:
            show(text, final)
        except Exception as e:
            broken.append(e)
            fault(e)

    return safe


__all__ = ["LONG_S", "QUIET_S", "FitProgress", "Presses", "Show", "display_line", "guarded", "interrupts_held",
           "planned_runs", "progress_line", "terminal_line"]
