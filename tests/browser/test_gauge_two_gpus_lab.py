"""The gauge with two GPUs and a notebook's own workers, one per GPU, in a real JupyterLab (issue 34).

No browser can run on the two-GPU machine, so what the gauge was sent there is recorded
(``tests/gpu/test_gauge_two_gpus_gpu.py`` with ``NBMEM_RECORD_DIR``: the real sampler, NVML and torch's allocator
on two GPUs with ``torch.multiprocessing.spawn`` workers) into ``docs/img/gauge-two-gpus.json``; here the gauge's
own front end (``nbmem.ui.frontend.bundle()``) draws that state under a cell in JupyterLab, and the picture is
``docs/img/gauge-two-gpus.png``.
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
RECORDED = ROOT / "docs" / "img" / "gauge-two-gpus.json"
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


def test_two_gpus_each_with_this_notebooks_worker_in_jupyterlab(lab: Any, page: Any, artifacts: Path) -> None:
    rec = json.loads(RECORDED.read_text())
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CELL)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, lab.root / "two_gpus.ipynb")
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(30_000)
    page.goto(lab.url("/lab/tree/two_gpus.ipynb?reset"))
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for()
    cells = Cells(page)
    cells.run(0)
    gauge = page.locator(".nbmem-gauge")
    expect(gauge).to_have_count(1)
    snap = rec["state"]["snapshot"]
    for dev, model in rec["recorded_on"].items():
        section = gauge.locator(f"section[data-device='{dev}']")
        expect(section).to_have_count(1)
        expect(section).to_contain_text(model)
        # This notebook's worker on this GPU: its own slice of the bar, and its row by PID, apart from others.
        workers = [int(pid) for pid, d in rec["workers"].items() if d == dev]
        assert workers, rec["workers"]
        row = snap["device"].index(dev)
        assert snap["children"][row] > 0
        expect(section.locator(".nbmem-bar [data-seg=children]")).to_have_count(1)
        for pid in workers:
            expect(section.locator(f"[data-role=child-row][data-pid='{pid}']")).to_have_count(1)
            assert section.locator(f"[data-role=process-row][data-pid='{pid}']").count() == 0
    assert not errors, errors
    gauge.screenshot(path=str(artifacts / "gauge-two-gpus.png"))
