"""The gauge during a 7B fine-tune (issue 48), in a real JupyterLab.

No browser can run on the GPU machine, so what the gauge was sent there is recorded by
``tests/gpu/test_finetune_7b_gpu.py`` with ``NBMEM_RECORD_DIR`` (the real sampler, NVML and torch's allocator, 10 s
into a cell that trains the notebook's Llama-2-7B-shaped model with LoRA, its three mistakes still held) into
``docs/img/gauge-7b.json``; here the gauge's own front end (``nbmem.ui.frontend.bundle()``) draws that state under
a cell in JupyterLab, and the picture is ``docs/img/gauge-7b.png``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import nbformat
import pytest

from tests.browser.conftest import Cells

expect = pytest.importorskip("playwright.sync_api").expect

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "docs" / "img" / "gauge-7b.json"

CELL = f"""import sys
sys.path.insert(0, {str(ROOT)!r})
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

state = json.load(open({str(RECORDED)!r}))["state"]
Recorded(**{{k: v for k, v in state.items() if k in Recorded.class_trait_names(sync=True)}})"""



def test_the_gauge_during_a_7b_fine_tune_in_jupyterlab(lab: Any, page: Any, artifacts: Path) -> None:
    if not RECORDED.exists():
        pytest.skip(f"{RECORDED.name} is recorded on a GPU: NBMEM_RECORD_DIR=docs/img pytest "
                    "tests/gpu/test_finetune_7b_gpu.py -k gauge")
    rec = json.loads(RECORDED.read_text())
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CELL)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, lab.root / "finetune_7b.ipynb")
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(30_000)
    page.goto(lab.url("/lab/tree/finetune_7b.ipynb?reset"))
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for()
    Cells(page).run(0)
    gauge = page.locator(".nbmem-gauge")
    expect(gauge).to_have_count(1)
    state = rec["state"]
    for dev, model in rec["recorded_on"].items():
        section = gauge.locator(f"section[data-device='{dev}']")
        expect(section).to_have_count(1)
        expect(section).to_contain_text(model)
    # The holders the notebook's mistakes left, by name, as the gauge was sent them.
    names = [h["name"] for h in state["holders"]]
    assert {"out", "losses"} <= set(names), names
    for name in ("out", "losses"):
        expect(gauge).to_contain_text(name)
    assert not errors, errors
    gauge.screenshot(path=str(artifacts / "gauge-7b.png"))
