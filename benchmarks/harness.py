"""What the benchmarks share: a plain IPython shell, a timed cell, and silence while timing."""

from __future__ import annotations

import os
import sys
import time

# This checkout's nbmem, not whichever one pip installed in editable mode (a second work tree shares the
# first's .venv); an explicit PYTHONPATH picks, as bench_scan.py --against does for its two children.
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

SUMMARY: list[str] = []


def line(name: str, value: str) -> None:
    """One figure: printed now, and again in the summary at the end."""
    SUMMARY.append(f"{name}: {value}")
    print(f"  {name}: {value}", flush=True)


def print_summary() -> int:
    print("\n=== summary ===")
    for s in SUMMARY:
        print(s)
    return 0


def new_shell(gauge: str = "none") -> InteractiveShell:
    """A fresh shell with history in memory and no reports shown (they would be timed too)."""
    InteractiveShell.clear_instance()
    cfg = Config()
    cfg.HistoryManager.hist_file = ":memory:"
    cfg.Nbmem.gauge = gauge
    cfg.Nbmem.show = "never"
    return InteractiveShell.instance(config=cfg)


def cell(sh: InteractiveShell, src: str, *, fails: bool = False) -> float:
    """Run a cell as a notebook would and return its wall time; a cell that does not do as expected stops the run."""
    t = time.perf_counter()
    r = sh.run_cell(src, store_history=True)
    dt = time.perf_counter() - t
    if r.success == fails:
        why = "succeeded, but should fail" if fails else repr(r.error_in_exec or r.error_before_exec)
        raise RuntimeError(f"{src[:60]!r}: {why}")
    return dt


class Quiet:
    """Silence the cells' output (greetings, Out[] reprs, tracebacks, other tools' tables) while timing."""

    def __enter__(self) -> None:
        self.out, sys.stdout = sys.stdout, open(os.devnull, "w")

    def __exit__(self, *a: object) -> None:
        sys.stdout.close()
        sys.stdout = self.out
