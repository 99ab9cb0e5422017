"""On a machine with two GPUs (issue 34): what the gauge is sent when a notebook's own workers run one per GPU,
built by the real gauge from the real sampler (NVML, torch's allocator), and kept for the browser test.

A browser cannot run on the GPU machine (nothing can be installed there), so the gauge's state is recorded
here and drawn in JupyterLab by ``tests/browser/test_gauge_two_gpus_lab.py`` from
``docs/img/gauge-two-gpus.json``. With ``NBMEM_RECORD_DIR`` set, this test writes that file there.

    NBMEM_RECORD_DIR=/tmp python -m pytest -q tests/gpu/test_gauge_two_gpus_gpu.py
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from nbmem.ipython.root import session_of
from tests.conftest import ok
from tests.gpu.conftest import GPUS
from tests.gpu.test_stack_gpu import spawn_workers, stop_workers

pytestmark = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs; NVML sees {GPUS} here")

GiB = 2**30


def test_the_gauge_shows_each_gpus_own_workers_as_this_notebooks_children(gpu: Any) -> None:
    pytest.importorskip("anywidget")
    from nbmem.ui.widget import Gauge

    pids, dev_of = spawn_workers(gpu, 2)
    try:
        ok(gpu, "a = torch.empty(3 * 2**30, dtype=torch.uint8, device='cuda:0')\n"
                "b = torch.empty(5 * 2**30, dtype=torch.uint8, device='cuda:1')")
        time.sleep(2.5)  # two sampler ticks with the workers' memory in NVML's process list
        session = session_of(gpu)
        g = Gauge(session, start=False)
        try:
            g._publisher.put(**g._build())
            g._publisher.flush()
            state = {k: v for k, v in g.get_state().items() if not k.startswith("_") and k not in (
                "layout", "tabbable", "tooltip", "gauge_id", "placement")}
        finally:
            g.close()
        snap = state["snapshot"]
        devices = list(snap["device"])
        assert {"cuda:0", "cuda:1"} <= set(devices), devices
        for d in ("cuda:0", "cuda:1"):
            kids = {c["pid"]: c for c in state["children"][d]}
            want = {pid for pid, dev in dev_of.items() if f"cuda:{dev}" == d}
            assert set(kids) == want, (d, kids, dev_of)
            row = devices.index(d)
            assert snap["children"][row] == sum(c["bytes"] for c in kids.values()) > 0
            assert not {p["pid"] for p in state["processes"][d]} & pids, "a worker is not another process"
        assert snap["allocated"][devices.index("cuda:1")] >= 5 * GiB
        out = os.environ.get("NBMEM_RECORD_DIR")
        if out:
            models = {d.name: d.model for d in session.devices()}
            Path(out, "gauge-two-gpus.json").write_text(json.dumps(
                {"recorded_on": models, "workers": {str(p): f"cuda:{d}" for p, d in dev_of.items()},
                 "state": state}, default=str))
    finally:
        stop_workers(gpu)
