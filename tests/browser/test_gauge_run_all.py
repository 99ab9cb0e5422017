"""The gauge as people drive a notebook: Run All with a long cell queued behind `%load_ext nbmem`, in a real
JupyterLab in headless Chromium (no GPU: the CPU layout).

Comm messages from the page reach the kernel only between cells, so the sidebar must not wait on one: the
page makes its own sidebar panel (js/panel.js). These tests watch the page from the Run All click on.
"""

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

LOOP_S = 24
CELLS = [
    "%load_ext nbmem",
    "import torch\nkept = torch.zeros(64 * 2**20 // 4)  # 64 MiB held by a global",
    "import time\nchunks = []\n"
    f"for i in range({LOOP_S * 4}):  # a long training cell, its memory growing\n"
    "    time.sleep(0.25)\n"
    "    if i % 8 == 0:\n"
    "        chunks.append(torch.ones(8 * 2**20 // 4))",
    "print('queue done')",
]
LOAD, KEPT, LOOP, DONE = range(len(CELLS))
#: The reload test's loop makes a widget each step, as tqdm's bars do: the page's widget-state request is
#: answered on another thread while the running cell adds widgets.
CHURN = [*CELLS[:LOOP], "import time, ipywidgets as W\nfrom IPython.display import display\nbars = []\n"
         f"for i in range({LOOP_S * 4}):  # a training loop with a progress bar per step\n"
         "    b = W.IntProgress(max=10)\n    display(b)\n    bars.append(b)\n"
         "    for j in range(10):\n        b.value = j\n        time.sleep(0.025)", *CELLS[LOOP + 1:]]
SHOTS = Path("/tmp/shots")


def _notebook(path: Path, cells: list[str]) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


def _run_all(page: Any, nb: Cells) -> float:
    """Run ▸ Run All, like a user; returns when the click that started the cells was made.

    A run asked for while the page is still connecting to the kernel is dropped (every prompt stays "[ ]:",
    as conftest's Cells.start found): then it is asked again, which is safe because nothing ran."""
    for _ in range(10):
        page.locator(".lm-MenuBar-item", has_text=re.compile("^Run$")).click()
        item = page.locator("li.lm-Menu-item[data-command='runmenu:run-all']")
        item.wait_for()
        t0 = time.monotonic()
        item.click()
        if _wait_for(lambda: nb.prompt(LOAD) != "[ ]:", 1.5, step_s=0.05) is not None:
            return t0
    raise AssertionError("Run All never started the cells")


def _open(server: Any, page: Any, name: str, cells: list[str] = CELLS) -> Cells:
    _notebook(server.root / name, cells)
    page.set_default_timeout(60_000)  # a loaded 2-core machine
    page.goto(server.url(f"/lab/tree/{name}?reset"))  # ?reset: no restored workspace tabs
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for()
    return Cells(page)


def _wait_for(check: Any, timeout_s: float, step_s: float = 0.1) -> float | None:
    """Seconds until ``check()`` held, or None when it did not within ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if check():
            return time.monotonic() - t0
        time.sleep(step_s)
    return None


def _type_cell(page: Any, nb: Cells, src: str) -> int:
    """Add a cell at the end with ``src`` and run it; returns its index."""
    n = nb.cells.count()
    nb.cells.nth(n - 1).locator(".jp-InputArea-editor").click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")
    expect(nb.cells).to_have_count(n + 1)
    page.keyboard.press("Enter")
    page.keyboard.type(src)
    page.keyboard.press("Escape")
    nb.run(n)
    return n


def test_run_all_puts_the_gauge_in_the_sidebar_at_once_and_keeps_it_live(lab: Any, page: Any) -> None:
    SHOTS.mkdir(exist_ok=True)
    errors: list[str] = []
    console: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    nb = _open(lab, page, "runall.ipynb")
    sidebar = page.locator("#jp-right-stack .nbmem-gauge")

    t0 = _run_all(page, nb)
    # In the sidebar while the queue is still running: the page made the panel, the kernel was not asked.
    appeared = _wait_for(lambda: sidebar.count() == 1 and sidebar.is_visible(), 30)
    if appeared is None:
        page.screenshot(path=str(SHOTS / "run-all-missing.png"))
    assert appeared is not None, f"the gauge never reached the sidebar; the console said: {console[-30:]}"
    since_click = time.monotonic() - t0
    print(f"gauge in the sidebar {since_click:.2f} s after Run All")
    assert nb.prompt(DONE) == "[*]:", "the queue should still be running"
    # The issue asks for 3 s from Run All (%load_ext itself takes about a second of it); measured here 0.4-1.3 s.
    # The bound leaves room for a loaded CI machine: what fails the old behaviour is the queue check above
    # (the sidebar came only after the queue drained, 15 s and more).
    assert since_click < 5.0, f"the gauge reached the sidebar {since_click:.2f} s after Run All"
    expect(page.locator(".nbmem-gauge")).to_have_count(1)  # the one in the sidebar; under the cell, a pointer
    expect(nb.cells.nth(LOAD).locator(".nbmem-pointer")).to_contain_text("in the right sidebar")
    expect(page.get_by_role("tab", name="nbmem")).to_have_count(1)

    # Live while the long cell runs: its text changes at least twice, and the holder the previous cell made is
    # listed already (each cell's end walks what changed).
    expect(nb.cells.nth(LOOP).locator(".jp-InputPrompt")).to_have_text("[*]:", timeout=30_000)
    texts = [sidebar.inner_text()]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        t = sidebar.inner_text()
        if t != texts[-1]:
            texts.append(t)
        time.sleep(0.25)
    assert len(texts) >= 3, f"the gauge's text changed {len(texts) - 1} times in 5 s while the cell ran"
    assert nb.prompt(LOOP) == "[*]:", "the loop should still be running"
    holders = sidebar.locator("[data-role=holders]")
    expect(holders.locator("[data-role=name]", has_text=re.compile("^kept$"))).to_have_count(1)
    page.mouse.move(0, 0)
    page.screenshot(path=str(SHOTS / "run-all-busy.png"))

    # After the queue: the list names the kept tensor and says when it looked; torch is never "not imported".
    expect(nb.cells.nth(DONE).locator(".jp-OutputArea")).to_contain_text("queue done", timeout=90_000)
    expect(holders.locator("[data-role=name]", has_text=re.compile("^kept$"))).to_have_count(1)
    expect(holders.locator("[data-role=scanned]")).to_contain_text("scanned")
    assert "torch is not imported" not in sidebar.inner_text()
    page.screenshot(path=str(SHOTS / "run-all-done.png"))
    sidebar.screenshot(path=str(SHOTS / "run-all-sidebar.png"))

    # The rescan button walks everything, between cells; the list stays and the status says what it found.
    sidebar.locator("[data-action=rescan]").click()
    expect(sidebar.locator("[data-role=status]")).to_contain_text(re.compile(r"rescan: \d+ holders? listed"))

    # Closing the sidebar tab puts the gauge back under its cell (the page makes no other panel for it).
    tab = page.locator(".lm-TabBar-tab", has_text="nbmem")
    tab.locator(".lm-TabBar-tabCloseIcon").click(force=True)  # the vertical tab's label overlaps its icon
    expect(page.get_by_role("tab", name="nbmem")).to_have_count(0)
    expect(nb.cells.nth(LOAD).locator(".nbmem-gauge")).to_have_count(1)
    expect(page.locator(".nbmem-pointer")).to_have_count(0)

    # Never two gauges: `%cudamem gauge` replaces the panel, a second `%load_ext` does nothing, and
    # `--inline` takes it out of the sidebar, under its cell.
    _type_cell(page, nb, "%cudamem gauge")
    expect(page.locator("#jp-right-stack .nbmem-gauge")).to_have_count(1)
    expect(page.get_by_role("tab", name="nbmem")).to_have_count(1)
    expect(page.locator(".nbmem-gauge")).to_have_count(1)
    _type_cell(page, nb, "%load_ext nbmem")
    expect(page.locator(".nbmem-gauge")).to_have_count(1)
    inline = _type_cell(page, nb, "%cudamem gauge --inline")
    expect(page.get_by_role("tab", name="nbmem")).to_have_count(0)
    expect(page.locator(".nbmem-gauge")).to_have_count(1)
    expect(nb.cells.nth(inline).locator(".nbmem-gauge")).to_have_count(1)
    assert not [e for e in errors if "nbmem" in e or "anywidget" in e or "idecar" in e], errors


def test_a_page_reloaded_mid_run_gets_its_gauge_back_while_the_cell_runs(lab: Any, page: Any) -> None:
    """A reloaded page asks the kernel who it is, then every widget's state, and ipykernel answers between
    cells: the gauge came back only when the long cell ended. nbmem answers those requests on ipykernel's
    shell-channel thread (reconnect.py), so the page makes exactly one live panel mid-cell, while the cell
    keeps making widgets (a progress bar per step)."""
    SHOTS.mkdir(exist_ok=True)
    nb = _open(lab, page, "reload.ipynb", CHURN)
    sidebar = page.locator("#jp-right-stack .nbmem-gauge")
    _run_all(page, nb)
    if _wait_for(lambda: sidebar.count() == 1, 30) is None:
        page.screenshot(path=str(SHOTS / "reload-first-missing.png"))
        raise AssertionError("no gauge in the sidebar after Run All")
    expect(nb.cells.nth(LOOP).locator(".jp-InputPrompt")).to_have_text("[*]:", timeout=30_000)
    loop_ends = time.monotonic() + LOOP_S  # at the earliest: the loop sleeps LOOP_S s
    page.reload()
    t0 = time.monotonic()
    page.locator(".jp-NotebookPanel").first.wait_for()
    back = _wait_for(lambda: sidebar.count() == 1, LOOP_S + 60, step_s=0.25)
    page.screenshot(path=str(SHOTS / "reload-back.png"))
    assert back is not None, "no gauge after the reload"
    after_s = time.monotonic() - t0
    print(f"gauge back {after_s:.1f} s after the reload")
    # A reloaded page does not know which cell runs (its prompts are the saved ones): the loop's own clock says.
    assert time.monotonic() < loop_ends, f"the gauge came back only after the running cell ({after_s:.1f} s)"
    expect(page.locator("#jp-right-stack .nbmem-gauge")).to_have_count(1)
    expect(page.get_by_role("tab", name="nbmem")).to_have_count(1)
    # Live: each sample redraws it (data-updated is the sample's time; idle RSS may not move).
    first = sidebar.get_attribute("data-updated")
    page.wait_for_function("([el, t]) => el.dataset.updated !== t", arg=[sidebar.element_handle(), first])
    assert time.monotonic() < loop_ends, "live while the cell runs"
    sidebar.screenshot(path=str(SHOTS / "reload-sidebar.png"))
