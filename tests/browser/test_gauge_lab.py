"""The gauge in a real JupyterLab, driven like a user in headless Chromium (no GPU: the CPU layout)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import nbformat
import pytest

from tests.browser.conftest import Cells

expect = pytest.importorskip("playwright.sync_api").expect

pytestmark = pytest.mark.browser

HOSTILE = "<img src=x onerror=alert(1)>"
CELLS = [
    "%load_ext nbmem\n%cudamem on",
    "import torch\nkept = torch.zeros(32 * 2**20 // 4)  # 32 MiB held by a global",
    "torch.ones(48 * 2**20 // 4)  # 48 MiB kept alive by Out[]",
    f"hostile = {{{HOSTILE!r}: torch.zeros(24 * 2**20 // 4)}}",
    "import time\nchunks = []\nfor _ in range(8):  # RSS grows while the cell runs\n"
    "    chunks.append(torch.ones(16 * 2**20 // 4))\n    time.sleep(0.4)",
    "import json, nbmem\n_df = nbmem.leaks()\n"
    "print('LEAKS', json.dumps({'names': sorted(set(_df['name'])), 'kinds': sorted(set(_df['kind']))}))",
    "%unload_ext nbmem",
]
LOAD, KEPT, OUT, HOSTILE_CELL, GROW, CHECK, UNLOAD = range(len(CELLS))


def _save(locator: Any, artifacts: Path, name: str) -> None:
    locator.screenshot(path=str(artifacts / name))  # the README's pictures: scripts/readme_pictures.py


def _notebook(path: Path) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


def _leaks(nb: Cells) -> dict[str, list[str]]:
    nb.run(CHECK)
    m = re.search(r"LEAKS (\{.*\})", nb.output(CHECK))
    assert m, nb.output(CHECK)
    return json.loads(m.group(1))  # type: ignore[no-any-return]


def _confirm_click(page: Any, button: Any, status: Any, expect_text: str) -> None:
    """A destructive button: the first click arms it, the second sends; then the result shows."""
    button.click()
    expect(button).to_have_attribute("data-armed", "1")
    button.click()
    expect(status).to_contain_text(expect_text, timeout=10_000)


def test_gauge_in_jupyterlab(lab: Any, page: Any, artifacts: Path) -> None:
    _notebook(lab.root / "gauge.ipynb")
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(30_000)

    page.goto(lab.url("/lab/tree/gauge.ipynb?reset"))  # ?reset: no restored workspace tabs
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for()
    nb = Cells(page)
    for i in (LOAD, KEPT, OUT, HOSTILE_CELL):
        nb.run(i)

    # It renders in the right sidebar (sidecar), not in the notebook, with the CPU-only layout: "auto" shows it
    # under the cell, and this JupyterLab page asks for the sidebar; under the cell one line says where it went.
    gauge = page.locator("#jp-right-stack .nbmem-gauge")
    expect(gauge).to_have_count(1)
    expect(page.locator(".nbmem-gauge")).to_have_count(1)
    expect(nb.cells.nth(LOAD).locator(".nbmem-pointer")).to_contain_text("in the right sidebar")
    expect(page.get_by_role("tab", name="nbmem")).to_have_count(1)
    assert gauge.evaluate("el => !el.closest('#jp-main-dock-panel')")
    expect(gauge.locator("[data-role=note]")).to_contain_text("no GPU seen: no NVIDIA driver on this machine")
    cpu = gauge.locator("section[data-device=cpu]")
    expect(cpu.locator("li[data-seg=tensors] [data-role=value]")).not_to_have_text("NA")
    expect(cpu.locator("[data-role=sparkline] svg path").first).to_be_attached()

    # The hostile dict key is a member of the owner `hostile`, shown as literal text once the row is
    # expanded: no element made from it, no dialog; the row stays open across the gauge's redraws.
    name = f"hostile[{HOSTILE!r}]"
    owner = page.locator("[data-role=name]", has_text=re.compile("^hostile$"))
    hostile = gauge.locator("[data-role=holder]", has=owner)
    hostile.locator("[data-role=members] summary").click()
    expect(hostile.locator("[data-role=member] code")).to_have_text(name)
    page.wait_for_timeout(800)
    expect(hostile.locator("[data-role=member] code")).to_be_visible()
    assert gauge.locator("img").count() == 0
    assert page.locator("img[src=x]").count() == 0

    # Live while a cell runs: the RSS figure changes at least twice; a click meanwhile is pending.
    status = gauge.locator("[data-role=status]")
    rss = cpu.locator("[data-role=process]")
    before = nb.start(GROW)
    seen = [rss.inner_text()]
    t_end = time.monotonic() + 2.2
    while time.monotonic() < t_end:
        v = rss.inner_text()
        if v != seen[-1]:
            seen.append(v)
        time.sleep(0.05)
    assert len(seen) >= 3, f"RSS shown during the cell: {seen}"
    assert nb.prompt(GROW) == "[*]:", "the cell should still be running for the pending check"
    gauge.locator("[data-action=gc]").click()
    expect(status).to_contain_text("pending…")
    nb.wait(GROW, before)
    expect(status).to_contain_text("gc + empty cache: freed", timeout=10_000)

    # clear outputs frees the 48 MiB that Out[] kept; the kernel agrees.
    _confirm_click(page, gauge.locator("[data-action=outputs]"), status, "clear outputs: freed 48.0 MiB")
    expect(gauge.locator("[data-role=holder]", has=page.locator(".nbmem-meta", has_text="output"))).to_have_count(0)
    page.wait_for_timeout(600)  # one more sample, so the picture shows the freed memory
    page.mouse.move(0, 0)  # no hover highlight in the picture
    _save(gauge, artifacts, "gauge-sidebar.png")
    assert "output" not in _leaks(nb)["kinds"]

    # del on a listed holder frees it; the kernel agrees.
    kept = gauge.locator("[data-role=holder]", has=page.locator("[data-role=name]", has_text=re.compile("^kept$")))
    _confirm_click(page, kept.locator("[data-action=del]"), status, "del kept: freed 32.0 MiB")
    expect(kept).to_have_count(0)
    assert "kept" not in _leaks(nb)["names"]

    _save(nb.cells.nth(HOSTILE_CELL), artifacts, "leak-report.png")
    page.screenshot(path=str(artifacts / "lab.png"))

    # It follows the JupyterLab theme: switch to dark and the gauge's colours change with it.
    light = gauge.evaluate("el => getComputedStyle(el).backgroundColor")
    page.locator(".lm-MenuBar-item", has_text=re.compile("^Settings$")).click()
    page.locator("li.lm-Menu-item", has_text=re.compile("^Theme$")).hover()
    page.get_by_role("menuitem", name="JupyterLab Dark", exact=True).click()
    expect(page.locator("body[data-jp-theme-light='false']")).to_be_attached()
    page.wait_for_function("([el, c]) => getComputedStyle(el).backgroundColor !== c",
                           arg=[gauge.element_handle(), light])
    page.mouse.move(0, 0)
    gauge.screenshot(path=str(artifacts / "gauge-sidebar-dark.png"))

    assert not dialogs, dialogs
    assert page.locator("img[src=x]").count() == 0
    assert not [e for e in errors if "nbmem" in e or "anywidget" in e], errors

    # %unload_ext closes the gauge and its sidebar panel.
    nb.run(UNLOAD)
    expect(page.locator(".nbmem-gauge")).to_have_count(0)
    expect(page.get_by_role("tab", name="nbmem")).to_have_count(0)


# -- the GPU layout, from fake samples, in bare Chromium (no kernel) -----------------------------------
GiB = 2**30
MiB = 2**20
PAGE = """<!doctype html><html><head><meta charset="utf-8"></head>
<body style="margin:0;width:380px"><div id="el"></div><script type="module">
import gauge from "./gauge.js";
window.mount = (state) => {
  window.sent = [];
  const model = {get: (k) => state[k], on() {}, off() {}, send: (m) => window.sent.push(m)};
  gauge.render({model, el: document.getElementById("el")});
};
</script></body></html>"""


def _gpu_state() -> dict[str, Any]:
    """What the publisher would send for a CPU and two GPUs, built by the real column builders."""
    from nbmem.records import CellRecord, Finding, HolderKind, Sample
    from nbmem.reports import CellReport
    from nbmem.ui.widget import cell_spans, history_columns, holder_rows, last_cell_row, snapshot_columns

    now = 1_800_000_000.0
    samples = []
    for k in range(120):
        t = now - 120 + k
        a = int((2 + 6 * (k % 40) / 40) * GiB)
        samples += [Sample(t, "cpu", None, None, None, None, None, None, None, None, 3 * GiB, 64 * GiB, 20 * GiB),
                    Sample(t, "cuda:0", a, 10 * GiB, a, 0, 30 * GiB, 80 * GiB, 11 * GiB, 17 * GiB, 3 * GiB,
                           children_used_bytes=2 * GiB),
                    Sample(t, "cuda:1", GiB, 2 * GiB, GiB, 0, 9 * GiB, 24 * GiB, None, None, 3 * GiB)]
    batch = samples[-3:]
    snap = snapshot_columns(batch, models={"cuda:0": "NVIDIA H100 80GB HBM3", "cuda:1": "NVIDIA L4"},
                            peaks={"cpu": 4 * GiB, "cuda:0": 8 * GiB, "cuda:1": GiB}, cpu_tensors_bytes=GiB)
    rec = CellRecord(7, now - 30, 12.5, "cuda:0", 2 * GiB, 6 * GiB, 8 * GiB, 10 * GiB, 8 * GiB, "", 9 * GiB,
                     11 * GiB, 3 * GiB, 3 * GiB, None, "")
    ns, out = HolderKind.NAMESPACE, HolderKind.OUTPUT
    findings = [
        Finding(7, "model", ("model",), ns, "cuda:0", 3 * GiB, roots=("model",), id="cuda:0:a1"),
        Finding(7, "loss", ("loss", "losses[3]"), ns, "cuda:0", 100 * MiB, 800 * MiB, True, hint="graph",
                roots=("loss", "losses"), id="cuda:0:b2", also_held_by=("losses",)),
        Finding(6, "_", ("_", "Out[6]"), out, "cuda:0", 512 * MiB, id="cuda:0:c3"),
    ]
    return {"snapshot": snap, "history": history_columns(samples, now), "cells": cell_spans([rec], now),
            "processes": {"cuda:0": [{"pid": 4242, "name": "Jupyter kernel (python3)", "bytes": 12 * GiB},
                                     {"pid": 5151, "name": "python", "bytes": 5 * GiB}], "cuda:1": []},
            "children": {"cuda:0": [{"pid": 6001, "name": "python", "bytes": 2 * GiB,
                                     "command": "python -c from multiprocessing.spawn import spawn_main"}],
                         "cuda:1": []},
            "last_cell": last_cell_row(CellReport(7, 12.5, (rec,))), "holders": holder_rows(findings),
            "action": {}, "note": ""}


def test_gpu_layout_from_fake_samples(page: Any, artifacts: Path) -> None:
    from nbmem.ui.frontend import bundle

    files = {"index.html": PAGE, "gauge.js": bundle()}
    page.route("http://nbmem.test/**", lambda route: route.fulfill(
        body=files[route.request.url.rsplit("/", 1)[-1]],
        content_type="text/html" if route.request.url.endswith(".html") else "text/javascript"))
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto("http://nbmem.test/index.html")
    page.wait_for_function("() => typeof window.mount === 'function'")
    page.evaluate("s => window.mount(s)", _gpu_state())

    gauge = page.locator(".nbmem-gauge")
    assert gauge.locator("[data-role=note]").is_hidden()
    gpu = gauge.locator("section[data-device='cuda:0']")
    segs = gpu.locator(".nbmem-bar [data-seg]").evaluate_all("els => els.map(e => e.dataset.seg)")
    assert segs == ["allocated", "cached", "nontorch", "children", "others", "free"]
    values = dict(zip(gpu.locator(".nbmem-legend li").evaluate_all("els => els.map(e => e.dataset.seg)"),
                      gpu.locator(".nbmem-legend [data-role=value]").all_inner_texts(), strict=True))
    assert values == {"allocated": "7.85 GiB", "cached": "2.15 GiB", "nontorch": "1.00 GiB", "children": "2.00 GiB",
                      "others": "17.0 GiB", "free": "50.0 GiB", "peak": "8.00 GiB"}
    expect(gpu.locator("[data-role=process]")).to_have_text("11.0 GiB")
    expect(gpu.locator("[data-role=process-row][data-pid='4242']")).to_have_text(
        "PID 4242 Jupyter kernel (python3) · 12.0 GiB")
    # The notebook's own worker is listed as its child, its command line as the tooltip, not as another process.
    child = gpu.locator("[data-role=child-row][data-pid='6001']")
    expect(child).to_have_text("PID 6001 python · 2.00 GiB")
    expect(child).to_have_attribute("title", "python -c from multiprocessing.spawn import spawn_main")
    assert gpu.locator("[data-role=process-row][data-pid='6001']").count() == 0
    assert gpu.locator("[data-role=sparkline] path").count() == 2
    assert gpu.locator("[data-role=sparkline] rect[data-cell='7']").count() == 1

    # No per-process numbers on the second GPU: NA (not 0), and the rest of `used` is "not split".
    l4 = gauge.locator("section[data-device='cuda:1']")
    assert l4.locator("li[data-seg=nontorch] [data-role=value]").inner_text() == "NA"
    assert l4.locator("li[data-seg=others] [data-role=value]").inner_text() == "NA"
    assert l4.locator("li[data-seg=children] [data-role=value]").inner_text() == "NA"
    assert l4.locator("li[data-seg=unsplit] [data-role=value]").inner_text() == "7.00 GiB"

    expect(gauge.locator("[data-role=last-cell]")).to_contain_text("Δ allocated +4.00 GiB")
    loss = gauge.locator("[data-role=holder][data-id='cuda:0:b2']")
    expect(loss.locator("[data-role=graph]")).to_be_visible()
    assert gauge.locator("[data-role=holder][data-id='cuda:0:c3'] [data-action=del]").is_disabled()
    # The del button says which variables it deletes (every name the row's hint says must go for it to be freed:
    # `loss` alone frees nothing while `losses` holds it), before and while it asks to confirm; the row says who
    # else holds the memory.
    expect(loss.locator("[data-role=also]")).to_have_text("also held by losses")
    del_loss = loss.locator("[data-action=del]")
    expect(del_loss).to_have_text("del loss, losses")
    del_loss.click()
    expect(del_loss).to_have_text("del loss, losses?")
    page.mouse.move(0, 0)
    page.wait_for_timeout(4200)  # the confirmation lapses without a second click
    expect(del_loss).to_have_text("del loss, losses")
    assert page.evaluate("window.sent") == []

    # "to CPU" asks twice, then sends exactly one request naming the finding, and shows it pending.
    to_cpu = gauge.locator("[data-role=holder][data-id='cuda:0:a1'] [data-action=to_cpu]")
    to_cpu.click()
    expect(to_cpu).to_have_text("model.cpu()?")
    assert page.evaluate("window.sent") == []
    page.mouse.move(0, 0)
    gauge.screenshot(path=str(artifacts / "gauge-gpu-fake.png"))
    to_cpu.click()
    sent = page.evaluate("window.sent")
    assert [(m["type"], m["action"], m["id"]) for m in sent] == [("cleanup", "to_cpu", "cuda:0:a1")]
    expect(gauge.locator("[data-role=status]")).to_contain_text("pending… model.cpu()")
    assert not errors, errors
