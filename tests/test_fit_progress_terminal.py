"""A fit you can watch in terminal IPython (issue 36): a real ``ipython`` on a pseudo-terminal runs
``%%cudamem --fit`` over a body that takes seconds, and the bytes it writes are read as a terminal draws them.
CUDA is stood in for (``tests/fit_stand_in.py``); the magic, the runner, the line and the body are real."""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.slow  # a real IPython, and a fit of about 8 s each

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = 100

#: What a terminal user types: the stand-in first, then a model, an optimizer and a fit of a step that sleeps
#: 0.3 s a sample (``RUNS``: about 8 s in all).
CELLS = [
    f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests import fit_stand_in; fit_stand_in.install()",
    "%load_ext nbmem",
    "import time, torch; model = torch.nn.Linear(8, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)",
    "%%cudamem --fit batch=1,2,4\nmodel(torch.randn(batch, 8)).sum().backward()\nopt.step()\nopt.zero_grad()\n"
    "time.sleep(0.3 * batch)\n\n",  # a cell magic at a simple prompt ends at two blank lines
    "print('after the fit')",
]


def on_a_terminal(cells: list[str], timeout_s: float = 120, ctrl_c_at: str | None = None) -> bytes:
    """What a terminal IPython writes for ``cells`` typed at its prompt, byte for byte: each line typed once the
    prompt for it is there, as a person does, on a pseudo-terminal ``COLUMNS`` wide (the width the line is cut
    to comes from it, as on a user's terminal). ``ctrl_c_at``: Ctrl-C is pressed once this text is shown (the
    terminal's SIGINT to IPython)."""
    main, sub = os.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 40, COLUMNS, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(IPYTHONDIR=tempfile.mkdtemp(prefix="nbmem-ipython-"), TERM="dumb",
               JUPYTER_RUNTIME_DIR=tempfile.mkdtemp(prefix="nbmem-runtime-"))
    proc = subprocess.Popen([sys.executable, "-m", "IPython", "--simple-prompt", "--colors=nocolor", "--no-banner",
                             "--HistoryManager.hist_file=:memory:"], stdin=sub, stdout=sub, stderr=sub, cwd=ROOT,
                            env=env, close_fds=True,
                            # Ctrl-C reaches IPython as it does on a terminal, even where this run ignores SIGINT
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(sub)
    typed = "\n".join([*cells, "exit"]).split("\n")
    out = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if typed and PROMPT.search(out.decode(errors="replace")[-40:]):
                os.write(main, typed.pop(0).encode() + b"\n")
            if ctrl_c_at is not None and ctrl_c_at.encode() in out:
                os.kill(proc.pid, signal.SIGINT)
                ctrl_c_at = None
            ready, _, _ = select.select([main], [], [], 0.2)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the terminal closed: IPython has exited
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=5) == 0 and not typed, out.decode(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main)
    return bytes(out)


#: IPython's prompts at ``--simple-prompt``: a cell's first line, and each line after it.
PROMPT = re.compile(r"(In \[\d+\]|   \.\.\.): $")


def screen(raw: str) -> list[str]:
    """The lines a terminal shows for ``raw``: ``\\r`` goes back to the line's start and what follows writes
    over what was there."""
    lines: list[str] = []
    line: list[str] = []
    col = 0
    for ch in raw:
        if ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        else:
            line[col:col + 1] = [ch]
            col += 1
    return [*lines, "".join(line).rstrip()]


#: The values the fit runs the body at, in order: the warm-up, the three asked for, two nearer the answer, and two
#: steps in a row at the answer (12).
RUNS = [1, 1, 2, 4, 8, 10, 12, 12]


def test_a_fits_line_is_written_over_itself_on_a_terminal_and_gone_when_the_fit_ends() -> None:
    raw = on_a_terminal(CELLS).decode()
    assert "Traceback" not in raw and "fault" not in raw, raw[-3000:]
    # The pseudo-terminal turns each newline into \r\n: a \r alone is the line drawn over itself.
    typed = raw.index("time.sleep(0.3 * batch)")
    drawn = raw[raw.index("\r\n\r", typed) + 2:raw.index("nbmem fit ·", typed)]
    assert "\n" not in drawn, repr(drawn)
    parts = drawn.split("\r")
    assert parts[0] == "" and parts[-1] == "", "each update starts at the line's start; the report after them too"
    updates, blank = parts[1:-2], parts[-2]
    said = [re.fullmatch(r"nbmem fit: run (\d+) of (\d+)–20 · batch=(\d+) · ([\d.]+) s so far", u) for u in updates]
    assert len(said) >= 2 and all(said), updates
    runs = [int(m[1]) for m in said if m]
    assert runs == list(range(runs[0], len(RUNS) + 1)), "every run from the first second on, to the last one"
    assert [int(m[3]) for m in said if m] == RUNS[runs[0] - 1:], "at the value each run is at"
    seconds = [float(m[4]) for m in said if m]
    assert seconds == sorted(seconds) and seconds[0] >= 1 and seconds[-1] >= 0.3 * sum(RUNS[:-1]), updates
    assert all(len(u) < COLUMNS for u in updates), "a line that wraps could not be written over"
    assert blank == " " * len(updates[-1]), "the line is blanked when the fit ends"
    shown = screen(raw.replace("\r\n", "\n"))
    report = shown.index("nbmem fit · batch · cuda:0")
    assert shown[report - 1] == "   ...:", "the report where the line was, on the line after the cell"
    assert shown[report + 1] == "largest batch that fits: 12 (power of two below: 8)"
    assert not any("nbmem fit: run" in ln for ln in shown), "nothing of the line is left on the screen"
    after = shown.index("In [5]: print('after the fit')")
    assert after > report and shown[after + 1] == "after the fit", "the next cell runs as usual"


def test_ctrl_c_during_a_fit_on_a_terminal_leaves_one_whole_line_saying_what_was_put_back() -> None:
    cells = [*CELLS[:3], "w0 = model.weight.detach().clone()", CELLS[3], "print('weights put back:', "
             "torch.equal(w0, model.weight))"]
    raw = on_a_terminal(cells, ctrl_c_at="batch=8 ").decode()
    shown = screen(raw.replace("\r\n", "\n"))
    line = next(i for i, ln in enumerate(shown) if "nbmem fit interrupted" in ln)
    assert re.fullmatch(r"nbmem fit interrupted at batch=8 after [\d.]+ s: stopped after 5 runs of the body; "
                        r"training state put back; memory allocated is back where it was", shown[line]), shown[line]
    assert shown[line - 1] == "   ...:", "where the line was, whole (a final line is not cut to the width)"
    assert "KeyboardInterrupt" in shown[line + 2], "then IPython's own report of the interrupt"
    below = "\n".join(shown[line + 1:])
    assert "fitting" not in below and "session.py" not in below, "not a way through nbmem's insides"
    assert "weights put back: True" in shown[line:]
