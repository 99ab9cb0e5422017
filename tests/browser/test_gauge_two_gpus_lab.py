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

import pytest

from tests.browser.conftest import draw_recorded

expect = pytest.importorskip("playwright.sync_api").expect

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "docs" / "img" / "gauge-two-gpus.json"


def test_two_gpus_each_with_this_notebooks_worker_in_jupyterlab(lab: Any, page: Any, artifacts: Path) -> None:
    rec = json.loads(RECORDED.read_text())
    errors: list[str] = []
    gauge = draw_recorded(lab, page, RECORDED, "two_gpus.ipynb", errors)
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
