"""Fixtures for the browser tests: a Jupyter server (tests/browser/jupyter.py), a Chromium page, a cell driver."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser.jupyter import CHROMIUM, FLAGS, LAB, NOTEBOOK7, Server, serve

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


def _serve(d: Path, app: list[str]) -> Iterator[Server]:
    if not shutil.which(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: bash scripts/test.sh installs it when run as root, "
                    f"or apt-get install chromium")
    with serve(d, app) as server:
        yield server


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve(tmp_path_factory.mktemp("lab"), LAB)


@pytest.fixture(scope="session")
def notebook7(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Jupyter Notebook 7 (the `notebook` package), the same isolation as ``lab``."""
    notebook = pytest.importorskip("notebook")
    if not notebook.__version__.startswith("7."):
        pytest.skip(f"notebook {notebook.__version__} is not Notebook 7: pip install -r requirements/dev.txt")
    yield from _serve(tmp_path_factory.mktemp("notebook7"), NOTEBOOK7)


class Cells:
    """The open notebook's cells (JupyterLab or Notebook 7): run one like a user (click it, Shift+Enter), read it."""

    PROMPT_DONE = re.compile(r"^\[\d+\]:$")

    def __init__(self, page: Any) -> None:
        self.page = page
        self.cells = page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell")

    def prompt(self, i: int) -> str:
        return str(self.cells.nth(i).locator(".jp-InputPrompt").inner_text()).strip()

    def start(self, i: int) -> str:
        """Run cell i without waiting for it; returns its prompt from before."""
        from playwright.sync_api import expect

        expect(self.cells.nth(i).locator(".jp-InputPrompt")).to_have_text(re.compile(r"^\[[ \d]+\]:$"))
        before = self.prompt(i)
        for _ in range(20):
            self.cells.nth(i).locator(".jp-InputArea-editor").click()
            self.page.keyboard.press("Shift+Enter")
            # A run asked for while the kernel is still connecting is dropped (the prompt stays
            # "[ ]:"); once accepted it turns "[*]:" at once, so asking again is safe.
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                p = self.prompt(i)
                if p == "[*]:" or (p != before and self.PROMPT_DONE.match(p)):
                    return before
                time.sleep(0.05)
        raise AssertionError(f"cell {i} never started")

    def wait(self, i: int, before: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            p = self.prompt(i)
            if p != before and self.PROMPT_DONE.match(p):
                return
            assert time.monotonic() < deadline, f"cell {i} did not finish (prompt {p!r})"
            time.sleep(0.05)

    def run(self, i: int) -> None:
        self.wait(i, self.start(i))

    def output(self, i: int) -> str:
        return str(self.cells.nth(i).locator(".jp-OutputArea").inner_text())


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "ud"), executable_path=CHROMIUM, headless=True,
                                                   args=FLAGS, viewport={"width": 1400, "height": 1000})
        page = ctx.pages[0] if ctx.pages else ctx.new_page()
        # A run asked for before the notebook's kernel has started can make JupyterLab ask which kernel to
        # start, although the notebook names one; the choice it offers first is that one (python3): take it.
        dialog = page.locator(".jp-Dialog", has_text="Select Kernel")
        page.add_locator_handler(dialog, lambda d: d.locator(".jp-mod-accept").click())
        try:
            yield page
        finally:
            ctx.close()


@pytest.fixture
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


#: A cell that draws a gauge state recorded on a GPU machine (no browser runs there) with the gauge's own front
#: end (``nbmem.ui.frontend.bundle()``): the widget's synced traits set from the recording.
RECORDED_CELL = """import sys
sys.path.insert(0, {root!r})
import json, anywidget, traitlets
from nbmem.ui.frontend import bundle

class Recorded(anywidget.AnyWidget):
    _esm = bundle()
    snapshot = traitlets.Dict().tag(sync=True)
    history = traitlets.Dict().tag(sync=True)
    cells = traitlets.List().tag(sync=True)
    processes = traitlets.Dict().tag(sync=True)
    children = traitlets.Dict().tag(sync=True)
    last_cell = traitlets.Dict().tag(sync=True)
    holders = traitlets.List().tag(sync=True)
    holders_note = traitlets.Unicode("").tag(sync=True)
    action = traitlets.Dict().tag(sync=True)
    holders_at = traitlets.Float(None, allow_none=True).tag(sync=True)
    note = traitlets.Unicode("").tag(sync=True)
    placement = traitlets.Unicode("inline").tag(sync=True)

state = json.load(open({path!r}))["state"]
Recorded(**{{k: v for k, v in state.items() if k in Recorded.class_trait_names(sync=True)}})"""


def draw_recorded(lab: Any, page: Any, recorded: Path, name: str, errors: list[str]) -> Any:
    """A notebook ``name`` whose one cell draws the gauge state in ``recorded``, run in JupyterLab: the gauge's
    locator (page errors go to ``errors``)."""
    import nbformat
    from playwright.sync_api import expect

    root = Path(__file__).resolve().parents[2]
    cell = RECORDED_CELL.format(root=str(root), path=str(recorded))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, lab.root / name)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(30_000)
    page.goto(lab.url(f"/lab/tree/{name}?reset"))
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for()
    Cells(page).run(0)
    gauge = page.locator(".nbmem-gauge")
    expect(gauge).to_have_count(1)
    return gauge
