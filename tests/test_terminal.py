"""nbmem wherever IPython runs: a real terminal IPython fed the README, and shells with the default gauge setting.

The ``shell`` fixture sets ``Nbmem.gauge = "none"``, which hid a fault that every terminal user met on
``%load_ext nbmem``; these tests load nbmem as a newcomer does.
"""

from __future__ import annotations

import atexit
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from IPython.core.interactiveshell import InteractiveShell

import nbmem
from nbmem.ipython.root import session_of
from nbmem.records import CellRecord
from nbmem.reports import CPU_CANNOT, CellTable
from tests.conftest import cpu_only, nbmem_callbacks, new_shell, ok
from tests.test_readme import blocks

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


def terminal(cells: str) -> str:
    """What a terminal IPython prints for ``cells`` typed at its prompt (stdout and stderr together)."""
    env = {**os.environ, "IPYTHONDIR": tempfile.mkdtemp(prefix="nbmem-ipython-"),
           "JUPYTER_RUNTIME_DIR": tempfile.mkdtemp(prefix="nbmem-runtime-"), "COLUMNS": "80"}
    out = subprocess.run([sys.executable, "-m", "IPython", "--simple-prompt", "--colors=nocolor", "--no-banner",
                          "--HistoryManager.hist_file=:memory:"], input=cells + "\nexit\n", cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def answers(transcript: str) -> list[str]:
    """The transcript cut at each prompt: what each cell printed, in order (blank cells included)."""
    return re.split(r"\nIn \[\d+\]: (?:   \.\.\.: )*", "\n" + transcript)[1:]


def test_the_readme_in_a_real_terminal_ipython():
    readme = blocks("python")[:3]  # "Thirty seconds": load and data, the validation cell, the cleanup
    assert readme[2].strip() == "%cudamem clean --last-report"
    extra = ["%cudamem status", "%cudamem claen x", "%cudamem on --bogus", "%cudamem report", "nbmem.leaks()"]
    text = terminal("\n".join(readme[:2]) + "\n" + readme[2] + "\n".join(["", "import nbmem", *extra]))
    assert "internal error" not in text and "Traceback" not in text and "fault in" not in text, text
    said = answers(text)
    validation = next(a for a in said if "val_losses " in a)
    assert re.search(r"^val_losses +namespace +cpu +48\.0 MiB", validation, re.M), validation
    clean = next(a for a in said if "nbmem cleanup" in a)
    assert clean.startswith("nbmem cleanup: freed 58.0 MiB") and "1 output cleared" in clean, clean
    assert "nbmem [" not in clean and "Out[" not in clean, "the cleanup is its own report, not in Out[]"
    refused = next(a for a in said if "claen" in a)
    assert "did you mean `clean`?" in refused and "nbmem [" not in refused, refused
    bogus = next(a for a in said if "--bogus" in a)
    assert "it takes --lines, --no-scan, --reset-peak" in bogus and "nbmem [" not in bogus, bogus
    status = next(a for a in said if "sampling every" in a)
    assert "nbmem [" not in status and "Out[" not in status, status
    assert text.count(CPU_CANNOT) == 1, "what a CPU cannot tell is said once a session"
    report = next(a for a in said if "nbmem.report()" in a)
    assert max(len(ln) for ln in report.splitlines()) <= 80, report
    assert next(a for a in said if "Out[" in a and "DataFrame" not in a and "name" in a)  # nbmem.leaks() returns


@pytest.fixture
def default_shell():
    """An embedded InteractiveShell with nbmem's options as they come (the gauge setting too)."""
    sh = new_shell(gauge=None)
    yield sh
    sh.run_line_magic("unload_ext", "nbmem")
    assert not nbmem_callbacks(sh)
    InteractiveShell.clear_instance()
    atexit.unregister(sh.atexit_operations)


def test_an_embedded_shell_loads_nbmem_with_the_default_gauge_and_no_fault(default_shell, capsys):
    ok(default_shell, "%load_ext nbmem")
    ok(default_shell, "%cudamem status")
    out = capsys.readouterr().out
    assert session_of(default_shell).faults == () and "fault" not in out and "internal error" not in out, out
    assert "sampling every" in out


def test_a_front_end_without_widgets_gets_a_line_of_text_for_the_gauge(default_shell):
    from nbmem.ui.widget import Gauge

    ok(default_shell, "%load_ext nbmem")
    g = Gauge(session_of(default_shell), start=False)
    try:
        plain = default_shell.display_formatter.format(g)[0]["text/plain"]  # what a front end gets
        assert plain == repr(g) and "object at" not in plain and "\n" not in plain and "%cudamem status" in plain
    finally:
        g.close()


@cpu_only
def test_a_cpu_report_draws_only_columns_with_numbers_and_says_why_once(default_shell, capsys):
    sh = default_shell
    ok(sh, "%load_ext nbmem")
    ok(sh, "%cudamem on")
    ok(sh, "import torch")
    capsys.readouterr()
    ok(sh, "a = torch.empty(2**20)")
    ok(sh, "b = torch.empty(2**20)")
    out = capsys.readouterr().out
    heads = [ln for ln in out.splitlines() if ln.startswith("device")]
    assert [h.split() for h in heads] == [["device", "Δallocated", "Δ", "RSS"]] * 2, heads
    assert out.count(CPU_CANNOT) == 1, out
    # Only the drawing leaves them out: the record keeps its NA, and the DataFrame every column.
    assert session_of(sh).last_report.records[0].delta_reserved_bytes is None
    assert "delta_reserved_bytes" in nbmem.report().columns


def record(cell: int, device: str, **kw: object) -> CellRecord:
    base: dict[str, object] = dict(
        cell=cell, started=0.0, duration_s=12.3456, device=device, allocated_before_bytes=0,
        allocated_after_bytes=123 * 2**30, reserved_before_bytes=0, reserved_after_bytes=-75 * 2**30,
        peak_allocated_bytes=None, peak_note="≤ 79.1 GiB (the cell freed some of what it allocated; %%cudamem "
        "gives the exact peak)", peak_line=None, process_used_before_bytes=None, process_used_after_bytes=None,
        rss_before_bytes=0, rss_after_bytes=-999 * MiB, peak_rss_bytes=999 * 2**30, error="OutOfMemoryError")
    base.update(kw)
    return CellRecord(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["cuda:7", "cpu"])
def test_the_cell_table_fits_80_columns_and_says_where_the_rest_is(device):
    recs = tuple(record(n, device, error="DistBackendErrorWithAVeryLongName" if n % 2 else "")
                 for n in range(9990, 10050))
    text = str(CellTable(recs))
    assert max(len(ln) for ln in text.splitlines()) <= 80, text
    assert "nbmem.report()" in text.splitlines()[-1] and "of 60" in text.splitlines()[-1]
    assert ("≤ 79.1 GiB" in text) == (device != "cpu") and ("Δreserved" in text) == (device != "cpu")
    assert "nbmem.report()" in CellTable(recs)._repr_html_()
    assert "no cell measured yet" in str(CellTable(()))


def test_nbmems_threads_have_ended_before_the_interpreter_does() -> None:
    """A daemon thread still running when Python finalizes is ended where it next takes the GIL; inside a C++ call
    (torch's allocator stats, read by the sampler) that aborts the process as IPython exits ("terminate called
    without an active exception"). nbmem's threads are stopped at exit, before that. The check is registered
    first, so it runs after nbmem's own (atexit runs the last registered first)."""
    names = "sorted(t.name for t in threading.enumerate() if t.name.startswith('nbmem'))"
    out = terminal("import atexit, threading, time\n"  # bound now: IPython empties the namespace at exit
                   f"atexit.register(lambda threading=threading: print('nbmem threads at exit:', {names}))\n"
                   "%load_ext nbmem\n%cudamem on\ntime.sleep(0.3)\n"
                   f"print('nbmem threads:', {names})")
    assert "nbmem threads: ['nbmem-sampler']" in out, out[-2000:]
    assert "nbmem threads at exit: []" in out, out[-2000:]
