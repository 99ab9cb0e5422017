"""A fit you can watch, in a real JupyterLab driven like a user in headless Chromium (issue 36): the line under a
``%%cudamem --fit`` cell while the fit runs, updated in place, gone when the report comes.

A fit needs CUDA, which this machine lacks: ``tests/fit_stand_in.py`` stands in for it in the kernel and nothing
else (the magic, the runner, the line, IPython's display handle, JupyterLab's rendering of it and the cell's body,
which sleeps 0.5 s a sample, are the real ones): about 13 s of runs."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import nbformat
import pytest

from tests.browser.conftest import Cells

expect = pytest.importorskip("playwright.sync_api").expect

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
CELLS = [
    # This checkout's nbmem and tests, whichever nbmem the kernel's environment has installed.
    f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom tests import fit_stand_in\nfit_stand_in.install()",
    "%load_ext nbmem",
    "import time, torch\nmodel = torch.nn.Linear(8, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)",
    "%%cudamem --fit batch=1,2,4\nmodel(torch.randn(batch, 8)).sum().backward()\nopt.step()\nopt.zero_grad()\n"
    "time.sleep(0.5 * batch)",
]
STAND_IN, LOAD, MODEL, FIT = range(len(CELLS))
#: The values the fit runs the body at, in order: the warm-up, the three asked for, two nearer the answer, and two
#: steps in a row at the answer (12).
RUNS = [1, 1, 2, 4, 8, 10, 12, 12]
LINE = re.compile(r"nbmem fit: run (\d+) of (\d+)–20 · batch=(\d+) · ([\d.]+) s so far")


def _notebook(path: Path) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


def test_a_fits_line_is_one_output_under_the_cell_updated_in_place_and_gone_at_the_end(
        lab: Any, page: Any, artifacts: Path) -> None:
    _notebook(lab.root / "fit.ipynb")
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(30_000)
    page.goto(lab.url("/lab/tree/fit.ipynb?reset"))  # ?reset: no restored workspace tabs
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for()
    nb = Cells(page)
    for i in (STAND_IN, LOAD, MODEL):
        nb.run(i)
    assert "Error" not in nb.output(STAND_IN) + nb.output(LOAD), nb.output(STAND_IN) + nb.output(LOAD)

    outputs = nb.cells.nth(FIT).locator(".jp-OutputArea-child")
    before = nb.start(FIT)
    seen: list[tuple[int, int, str]] = []  # (outputs under the cell, the line's place among them, its text)
    shot = False
    deadline = time.monotonic() + 90
    while nb.prompt(FIT) == "[*]:" and time.monotonic() < deadline:
        texts = [str(t) for t in outputs.all_inner_texts()]
        at = [i for i, t in enumerate(texts) if t.startswith("nbmem fit: run")]
        if at:
            assert len(at) == 1, texts
            if not seen or seen[-1][2] != texts[at[0]]:
                seen.append((len(texts), at[0], texts[at[0]].strip()))
            if not shot and len(seen) >= 3:  # a few updates in: the line as a user watches it
                nb.cells.nth(FIT).screenshot(path=str(artifacts / "fit-progress-lab.png"))
                shot = True
        time.sleep(0.1)
    nb.wait(FIT, before, timeout_s=60)

    said = [LINE.fullmatch(text) for _, _, text in seen]
    assert len(said) >= 3 and all(said), seen
    assert {(n, i) for n, i, _ in seen} == {(1, 0)}, "one output under the cell, the line, updated in place"
    runs = [int(m[1]) for m in said if m]
    assert runs == list(range(runs[0], len(RUNS) + 1)), "every run from the first second on, to the last one"
    assert [int(m[3]) for m in said if m] == RUNS[runs[0] - 1:], "at the value each run is at"
    seconds = [float(m[4]) for m in said if m]
    assert seconds == sorted(seconds) and seconds[0] >= 1 and seconds[-1] >= 0.5 * sum(RUNS[:-1]), seen

    # At the end the line is gone and the fit's report is there; the line's place stays, emptied.
    expect(nb.cells.nth(FIT).locator(".jp-OutputArea")).to_contain_text("largest batch that fits: 12")
    texts = [str(t).strip() for t in outputs.all_inner_texts()]
    assert not any("nbmem fit: run" in t for t in texts), texts
    assert texts[0] == "" and texts[1].startswith("nbmem fit · batch · cuda:0"), texts
    nb.cells.nth(FIT).screenshot(path=str(artifacts / "fit-progress-lab-done.png"))
    assert shot
    assert not errors, errors


def test_a_fit_interrupted_from_the_toolbar_leaves_its_line_saying_what_it_put_back(
        lab: Any, page: Any, artifacts: Path) -> None:
    cells = [*CELLS[:3], "w0 = model.weight.detach().clone()", CELLS[FIT],
             "print('weights put back:', torch.equal(w0, model.weight))"]
    nb_path = lab.root / "fit_interrupted.ipynb"
    _notebook(nb_path)
    book = nbformat.read(nb_path, as_version=4)
    book.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    nbformat.write(book, nb_path)
    page.set_default_timeout(30_000)
    page.goto(lab.url("/lab/tree/fit_interrupted.ipynb?reset"))
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for()
    nb = Cells(page)
    for i in range(4):
        nb.run(i)
    fit = 4
    before = nb.start(fit)
    line = nb.cells.nth(fit).locator(".jp-OutputArea-child").first
    expect(line).to_contain_text("batch=8 ", timeout=60_000)
    page.locator(".jp-NotebookPanel-toolbar [data-jp-item-name=interrupt]").click()  # the ■ button
    nb.wait(fit, before)
    expect(line).to_have_text(re.compile(
        r"^nbmem fit interrupted at batch=8 after [\d.]+ s: stopped after 5 runs of the body; training state put "
        r"back; memory allocated is back where it was$"))
    expect(nb.cells.nth(fit).locator(".jp-OutputArea")).to_contain_text("KeyboardInterrupt")
    assert "fitting" not in nb.output(fit), "the interrupt's traceback is not a way through nbmem's insides"
    nb.cells.nth(fit).screenshot(path=str(artifacts / "fit-progress-lab-interrupted.png"))
    nb.run(fit + 1)
    assert "weights put back: True" in nb.output(fit + 1)
