"""A bitsandbytes paged optimizer's state (QLoRA's ``PagedAdamW8bit``) on the gauge's bar, in a real JupyterLab.

The state lives in CUDA managed memory: NVML counts it in this process, torch's allocator does not, so without
the last scan's ``paged`` column it would read as "non-PyTorch". No GPU here (and no browser on the GPU machine),
so the state is built by the publisher's own column builders from samples and a scan's findings, written where the
kernel reads it, and drawn by the gauge's own front end (``nbmem.ui.frontend.bundle()``) under a cell.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.browser.conftest import draw_recorded

expect = pytest.importorskip("playwright.sync_api").expect

pytestmark = pytest.mark.browser

GiB = 2**30
MiB = 2**20
LABEL = "paged (bitsandbytes, CUDA managed)"


def _state() -> dict[str, Any]:
    """Two GPUs after a scan: 305 MiB of paged optimizer state on cuda:0, none on cuda:1."""
    from nbmem.records import Finding, HolderKind, Sample
    from nbmem.ui.frontend import scan_bytes
    from nbmem.ui.widget import holder_rows, snapshot_columns

    t = 1_800_000_000.0
    batch = [Sample(t, "cpu", None, None, None, None, None, None, None, None, 3 * GiB, 64 * GiB, 20 * GiB),
             Sample(t, "cuda:0", 5 * GiB, 6 * GiB, 5 * GiB, 0, 7.5 * GiB, 80 * GiB, 7.5 * GiB, 0, None,
                    children_used_bytes=0),
             Sample(t, "cuda:1", GiB, 2 * GiB, GiB, 0, 3 * GiB, 24 * GiB, 3 * GiB, 0, None, children_used_bytes=0)]
    opt = Finding(5, "opt", ("opt",), HolderKind.NAMESPACE, "paged:cuda:0", 305 * MiB, roots=("opt",),
                  id="paged:cuda:0:o:opt", state="optimizer", description="optimizer state, in paged memory")
    # The scan's bytes per device, as Session.tensor_totals gives them: nothing paged on cuda:1.
    tensors, paged = scan_bytes({"cpu": GiB, opt.device: opt.storage_bytes})
    snap = snapshot_columns(batch, models={"cuda:0": "NVIDIA H100 80GB HBM3", "cuda:1": "NVIDIA L4"},
                            peaks={"cpu": 3 * GiB, "cuda:0": 5 * GiB, "cuda:1": GiB}, cpu_tensors_bytes=tensors,
                            paged_bytes=paged)
    return {"snapshot": snap, "history": {}, "cells": [], "processes": {"cuda:0": [], "cuda:1": []},
            "children": {"cuda:0": [], "cuda:1": []}, "last_cell": {}, "holders": holder_rows([opt]),
            "action": {}, "note": ""}


def legend(section: Any) -> dict[str, str]:
    keys = section.locator(".nbmem-legend li").evaluate_all("els => els.map(e => e.dataset.seg)")
    return dict(zip(keys, section.locator(".nbmem-legend [data-role=value]").all_inner_texts(), strict=True))


def test_paged_optimizer_state_is_its_own_slice_of_the_gpu_bar(lab: Any, page: Any, artifacts: Path) -> None:
    recorded = lab.root / "gauge-paged.json"
    recorded.write_text(json.dumps({"state": _state()}))
    errors: list[str] = []
    gauge = draw_recorded(lab, page, recorded, "paged.ipynb", errors)

    h100 = gauge.locator("section[data-device='cuda:0']")
    expect(h100).to_contain_text("NVIDIA H100 80GB HBM3")
    segs = h100.locator(".nbmem-bar [data-seg]").evaluate_all("els => els.map(e => e.dataset.seg)")
    assert segs == ["allocated", "cached", "paged", "nontorch", "free"]
    # process 7.5 GiB = torch reserved 6 GiB + paged 305 MiB + the rest, non-PyTorch: 1.5 GiB - 305 MiB = 1231 MiB
    assert legend(h100) == {"allocated": "5.00 GiB", "cached": "1.00 GiB", "paged": "305 MiB", "nontorch": "1.20 GiB",
                            "children": "0 B", "others": "0 B", "free": "72.5 GiB", "peak": "5.00 GiB"}
    expect(h100.locator(".nbmem-legend li[data-seg=paged]")).to_contain_text(LABEL)
    expect(h100.locator(".nbmem-bar [data-seg=paged]")).to_have_attribute("title", f"{LABEL}: 305 MiB")
    assert f"{LABEL} 305 MiB" in str(h100.locator(".nbmem-bar").get_attribute("aria-label"))
    colours = h100.locator(".nbmem-bar [data-seg]").evaluate_all(
        "els => els.map(e => getComputedStyle(e).backgroundColor)")
    assert colours[2] != colours[3], "paged memory is drawn apart from the rest of non-PyTorch"

    # The scan found no paged memory on the L4: no slice, no legend line, non-PyTorch is process - reserved.
    l4 = gauge.locator("section[data-device='cuda:1']")
    assert l4.locator("[data-seg=paged]").count() == 0
    assert legend(l4)["nontorch"] == "1.00 GiB"
    # The holder list names the owner, on the paged device.
    expect(gauge.locator("[data-role=holder][data-id='paged:cuda:0:o:opt']")).to_contain_text("paged:cuda:0")
    assert not errors, errors
    gauge.screenshot(path=str(artifacts / "gauge-paged.png"))
