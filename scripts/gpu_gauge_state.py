"""On a GPU machine: run a training cell under nbmem with a second process on the same GPU, and save
what the gauge would draw (its synced traits), mid-cell and after, plus the ground truth to check it.

    python scripts/gpu_gauge_state.py OUTDIR      # then: python scripts/render_gauge.py OUTDIR/….json

The browser lives on the CPU machine, so the picture is drawn there from the saved state
(scripts/render_gauge.py mounts the same front-end bundle the kernel ships).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

TRAITS = ("snapshot", "history", "cells", "processes", "last_cell", "holders", "action", "note")
OTHER = """
import torch, time, sys
x = torch.empty(20 * 2**30, dtype=torch.uint8, device="cuda")
open(sys.argv[1], "w").close()
time.sleep(120)
"""


def truth() -> dict:
    import pynvml
    import torch

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    procs = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
    mem = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    return {"allocated": torch.cuda.memory_allocated(0), "reserved": torch.cuda.memory_reserved(0),
            "process": procs.get(os.getpid()), "others": sum(v for k, v in procs.items() if k != os.getpid()),
            "used": mem.used, "total": mem.total, "pids": {str(k): v for k, v in procs.items()}}


def dump(gauge, path: str) -> None:
    state = {k: getattr(gauge, k) for k in TRAITS}
    state["truth"] = truth()
    with open(path, "w") as f:
        json.dump(state, f, default=str, indent=1)


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    flag = os.path.join(out, ".other-ready")
    other = subprocess.Popen([sys.executable, "-c", OTHER, flag])
    while not os.path.exists(flag):
        time.sleep(0.1)
    cfg = Config()
    cfg.HistoryManager.hist_file = ":memory:"
    cfg.Nbmem.gauge = "none"
    sh = InteractiveShell.instance(config=cfg)

    def cell(src: str) -> None:
        r = sh.run_cell(src, store_history=True)
        assert r.success, r.error_in_exec

    cell("%load_ext nbmem")
    cell("%cudamem on")
    from nbmem.ipython.root import _ACTIVE
    from nbmem.ui.widget import Gauge

    gauge = Gauge(_ACTIVE[sh].session, shell=sh)
    cell("import torch\nmodel = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(4)]).cuda()\n"
         "opt = torch.optim.AdamW(model.parameters())\nxb = torch.randn(4096, 8192, device='cuda')\nlosses = []")
    time.sleep(2)
    timer = threading.Timer(4.0, dump, (gauge, os.path.join(out, "gauge-state-live.json")))
    timer.start()
    cell("t0 = __import__('time').time()\nstep = 0\n"
         "while __import__('time').time() - t0 < 7:\n"
         "    opt.zero_grad(set_to_none=True)\n    loss = model(xb).square().mean()\n    loss.backward()\n"
         "    opt.step()\n    step += 1\n"
         "    if step % 40 == 0:\n        losses.append(loss)  # keeps the graph: the planted leak\n"
         "torch.cuda.synchronize()")
    timer.join()
    cell("model(xb[:1024]).detach()")  # a displayed output: kept in Out[]
    time.sleep(1.5)
    dump(gauge, os.path.join(out, "gauge-state-after.json"))
    gauge.close()
    sh.run_line_magic("unload_ext", "nbmem")
    other.terminate()
    os.remove(flag)
    print("saved", out)


if __name__ == "__main__":
    main(sys.argv[1])
