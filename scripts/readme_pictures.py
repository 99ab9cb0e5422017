"""Take the README's pictures from the real product: JupyterLab in headless Chromium runs the notebooks.

    .venv/bin/python scripts/readme_pictures.py [OUTDIR]      # OUTDIR defaults to docs/img; ~1 min on 2 cores

- quickstart-leak.png: notebooks/quickstart.ipynb after Run All, the leak cell with the report under it (its
  first owner row expanded);
- gauge-training.png: notebooks/training.ipynb in the JupyterLab window, the gauge in the right sidebar while
  the training cell runs.

The server is isolated as in tests/browser/conftest.py (its own config, runtime and IPython dirs, no news
pop-up), in the light theme, at 100 % zoom. Look at the pictures before committing them.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import ViewportSize, sync_playwright

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.browser.jupyter import ANNOUNCEMENTS, CHROMIUM, FLAGS, LAB, serve  # noqa: E402  (the tests' server)

WINDOW: ViewportSize = {"width": 1400, "height": 900}
#: A wide window keeps the leak report's hint column from wrapping; the picture is cropped to the cell anyway.
WIDE_WINDOW: ViewportSize = {"width": 1500, "height": 900}
#: Front-end plugins that would put something in the picture that is not nbmem: the news pop-up, and the
#: "open in Notebook" button that the notebook package adds to JupyterLab's toolbar.
DISABLED = (ANNOUNCEMENTS, "@jupyter-notebook/lab-extension")
SIDEBAR_PX = 460  # the gauge's sidebar in the training picture
PAUSE_S = 5.0  # between the training notebook's cells
PROMPT_DONE = re.compile(r"^\[\d+\]:$")


@contextmanager
def jupyterlab(notebooks: list[Path]) -> Iterator[tuple[str, str]]:
    """A JupyterLab server on a free port with copies of ``notebooks``; yields its base URL and token."""
    with tempfile.TemporaryDirectory(prefix="nbmem-pictures-") as tmp:
        d = Path(tmp)
        for nb in notebooks:
            shutil.copy(nb, d / nb.name)
        with serve(d, LAB, disabled=DISABLED) as server:
            yield server.base, server.token


def accept_kernel_dialog(page: Any) -> None:
    """Accept "Select Kernel" whenever it is in the way.

    A run asked for before the notebook's kernel has started can make JupyterLab ask which kernel to start,
    although the notebook names one; the choice it offers first is that one (python3).
    """
    dialog = page.locator(".jp-Dialog", has_text="Select Kernel")
    page.add_locator_handler(dialog, lambda d: d.locator(".jp-mod-accept").click())


def open_notebook(page: Any, base: str, token: str, name: str) -> None:
    """Open ``name`` alone (``?reset``: no restored tabs), wait for its kernel, fold the file browser away."""
    page.goto(f"{base}/lab/tree/{name}?reset&token={token}")
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for()
    left = page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current")
    if left.count():
        left.click()
    page.locator("#jp-left-stack").wait_for(state="hidden")


def run_cell(page: Any, i: int, *, wait: bool = True, keys: str = "Shift+Enter") -> None:
    """Run cell i like a user (click it, press ``keys``); retried while the kernel is still connecting."""
    cell = page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").nth(i)
    prompt = cell.locator(".jp-InputPrompt")
    before = prompt.inner_text().strip()
    for _ in range(20):
        cell.locator(".jp-InputArea-editor").click()
        page.keyboard.press(keys)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline and prompt.inner_text().strip() == before:
            time.sleep(0.05)
        if prompt.inner_text().strip() != before:
            break
    else:
        raise RuntimeError(f"cell {i} never started")
    deadline = time.monotonic() + 120
    while wait and not PROMPT_DONE.match(prompt.inner_text().strip()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"cell {i} did not finish")
        time.sleep(0.05)


def quickstart_leak(page: Any, base: str, token: str, png: Path) -> None:
    """Run All on the quickstart; the cell that plants the leak, with its report, cropped to the cell."""
    page.set_viewport_size(WIDE_WINDOW)
    open_notebook(page, base, token, "quickstart.ipynb")
    first = page.locator(".jp-NotebookPanel .jp-CodeCell .jp-InputPrompt").first
    for _ in range(6):
        page.locator(".lm-MenuBar-item", has_text=re.compile("^Run$")).click()
        page.locator("li.lm-Menu-item[data-command='runmenu:run-all']").click()
        # Asked for while the kernel is still connecting, the run is dropped: the prompt stays "[ ]:".
        try:
            page.wait_for_function("e => e.textContent.trim() !== '[ ]:'", arg=first.element_handle(), timeout=10_000)
            break
        except PlaywrightTimeout:
            continue
    # textContent, not innerText: cells far out of view are not rendered, and their innerText is empty.
    prompts = "() => [...document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell .jp-InputPrompt')]"
    try:
        page.wait_for_function(f"{prompts}.every(e => /^\\[\\d+\\]:$/.test(e.textContent.trim()))",
                               timeout=180_000, polling=250)
    except PlaywrightTimeout:
        raise RuntimeError(f"Run All did not finish: {page.evaluate(prompts + '.map(e => e.textContent)')}") from None
    # The notebook as wide as the window: the sidebars folded away.
    right = page.locator(".jp-SideBar.jp-mod-right .lm-TabBar-tab.lm-mod-current")
    if right.count():
        right.click()
    cell = page.locator(".jp-NotebookPanel .jp-CodeCell", has_text="a quick look at some logits")
    cell.scroll_into_view_if_needed()
    cell.locator(".nbmem-report").wait_for()
    cell.locator(".nbmem-report details summary").first.click()  # an owner row, expanded to its tensors
    page.mouse.move(0, 0)
    cell.screenshot(path=str(png))


def gauge_training(page: Any, base: str, token: str, png: Path) -> None:
    """The training notebook in the window, the gauge in the right sidebar while the training cell runs."""
    open_notebook(page, base, token, "training.ipynb")
    cells = page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell")
    train = next(i for i in range(cells.count()) if "opt.step()" in cells.nth(i).inner_text())
    code = [i for i in range(train) if "jp-CodeCell" in (cells.nth(i).get_attribute("class") or "")]
    for i in code:
        run_cell(page, i)
        # A reader's pause between cells: the sparkline shows each cell's step instead of one jump.
        time.sleep(PAUSE_S)
    page.locator("#jp-right-stack .nbmem-gauge").wait_for()
    # A wider sidebar: drag the split handle between the notebook and the sidebar to the left.
    handle = page.locator("#jp-main-split-panel > .lm-SplitPanel-handle:not(.lm-mod-hidden)").last
    box = handle.bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] / 2, y)
    page.mouse.down()
    page.mouse.move(WINDOW["width"] - SIDEBAR_PX, y, steps=10)
    page.mouse.up()
    run_cell(page, train, wait=False, keys="Control+Enter")  # it stays the selected cell
    # In view: the cell that made the data, with its report, then the training cell.
    cells.nth(code[-1]).evaluate("e => e.scrollIntoView({block: 'start'})")
    # Mid-training: some epochs done, the sparkline up with the data, the optimizer state and the steps.
    cells.nth(train).locator(".jp-OutputArea", has_text="epoch 3:").wait_for(timeout=120_000)
    page.mouse.move(0, 0)
    page.screenshot(path=str(png))


def shut_down_kernels(base: str, token: str) -> None:
    """Delete every session: a kernel left running would bring its gauge back into the next page's sidebar."""
    with urllib.request.urlopen(f"{base}/api/sessions?token={token}") as r:
        sessions = json.load(r)
    for s in sessions:
        req = urllib.request.Request(f"{base}/api/sessions/{s['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(req).close()


PICTURES = {"quickstart-leak.png": quickstart_leak, "gauge-training.png": gauge_training}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    notebooks = [ROOT / "notebooks" / "quickstart.ipynb", ROOT / "notebooks" / "training.ipynb"]
    with jupyterlab(notebooks) as (base, token), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            for name, take in PICTURES.items():
                page = browser.new_page(viewport=WINDOW, device_scale_factor=1, color_scheme="light")
                page.set_default_timeout(60_000)
                accept_kernel_dialog(page)
                take(page, base, token, out / name)
                page.close()
                shut_down_kernels(base, token)
                print(f"wrote {out / name}")
        finally:
            browser.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "img")
