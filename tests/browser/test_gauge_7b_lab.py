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

import pytest

from tests.browser.conftest import draw_recorded

expect = pytest.importorskip("playwright.sync_api").expect

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "docs" / "img" / "gauge-7b.json"


def test_the_gauge_during_a_7b_fine_tune_in_jupyterlab(lab: Any, page: Any, artifacts: Path) -> None:
    if not RECORDED.exists():
        pytest.skip(f"{RECORDED.name} is recorded on a GPU: NBMEM_RECORD_DIR=docs/img pytest "
                    "tests/gpu/test_finetune_7b_gpu.py -k gauge")
    rec = json.loads(RECORDED.read_text())
    errors: list[str] = []
    gauge = draw_recorded(lab, page, RECORDED, "finetune_7b.ipynb", errors)
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
