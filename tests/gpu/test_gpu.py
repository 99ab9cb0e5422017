"""On a real CUDA GPU: no context on load, exact per-cell numbers, NVML agreement, cleanup, faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import last_cell, ok, run
from tests.gpu.conftest import GPUS

MiB, GiB = 2**20, 2**30


def in_fresh_process(code: str, env: dict | None = None, timeout: float = 180) -> dict:
    """Run ``code`` in a new Python (CUDA untouched), which prints one JSON line last."""
    full = textwrap.dedent("""
        import json, os, sys, time
        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config
        cfg = Config(); cfg.HistoryManager.hist_file = ":memory:"; cfg.Nbmem.gauge = "none"
        sh = InteractiveShell.instance(config=cfg)
        def cell(src):
            r = sh.run_cell(src, store_history=True)
            assert r.success, (src, r.error_in_exec)
            return r
    """) + textwrap.dedent(code)
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    p = subprocess.run([sys.executable, "-c", full], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})}, cwd=root)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_loading_creates_no_cuda_context():
    out = in_fresh_process("""
        cell("%load_ext nbmem"); cell("%cudamem on"); cell("import torch"); cell("x = torch.ones(1000)")
        cell("%cudamem status"); time.sleep(1.5)
        import pynvml, torch
        pids = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            pids += [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
        print(json.dumps({"init": torch.cuda.is_initialized(), "mine": os.getpid() in pids}))
    """)
    assert out == {"init": False, "mine": False}


def row_of(cell: int, device: str = "cuda:0"):
    """The report row of one cell on one device (a cell has a row per device torch holds memory on)."""
    import nbmem

    rep = nbmem.report()
    rep = rep[(rep.index == cell) & (rep["device"] == device)]
    assert len(rep) == 1, nbmem.report()
    return rep.iloc[0]


def test_sampler_picks_up_the_allocator_once_cuda_starts(gpu):
    import nbmem

    ok(gpu, "a = torch.empty(64 * 2**20, dtype=torch.uint8, device='cuda')")
    time.sleep(1.2)
    df = nbmem.samples()
    cuda = df[df.device == "cuda:0"].dropna(subset=["allocated_bytes"])
    assert len(cuda) >= 1 and cuda["allocated_bytes"].iloc[-1] >= 64 * MiB
    last = cuda.iloc[-1]
    assert last["process_used_bytes"] >= last["reserved_bytes"]  # context + cache ≥ what torch reserved
    assert last["nvml_total_bytes"] > last["nvml_used_bytes"] > 0


def test_a_freed_1gib_temporary_peaks_and_leaves_nothing(gpu):

    ok(gpu, "%%cudamem\nt = torch.empty(2**30, dtype=torch.uint8, device='cuda')\ndel t")
    row = row_of(last_cell(gpu))
    assert row["peak_allocated_bytes"] >= GiB
    assert row["delta_allocated_bytes"] == 0


def test_a_smaller_spike_below_an_earlier_peak_is_exact_without_touching_the_counter(gpu):
    ok(gpu, "%%cudamem\nt = torch.empty(2**30, dtype=torch.uint8, device='cuda')\ndel t")
    before = gpu.user_ns["torch"].cuda.max_memory_allocated()
    ok(gpu, "%%cudamem\nt = torch.empty(2**28, dtype=torch.uint8, device='cuda')\ndel t")
    row = row_of(last_cell(gpu))
    assert row["peak_allocated_bytes"] == row["allocated_before_bytes"] + 2**28, row.to_dict()
    assert gpu.user_ns["torch"].cuda.max_memory_allocated() == before >= GiB, "the user's counter is untouched"
    ok(gpu, "%%cudamem --reset-peak\nt = torch.empty(2**28, dtype=torch.uint8, device='cuda')\ndel t")
    row = row_of(last_cell(gpu))
    assert row["peak_allocated_bytes"] == row["allocated_before_bytes"] + 2**28


def test_a_kept_256mib_tensor_is_exactly_256mib(gpu):
    import nbmem

    ok(gpu, "%%cudamem\nk = torch.empty(256 * 2**20, dtype=torch.uint8, device='cuda')")
    row = row_of(last_cell(gpu))
    assert row["delta_allocated_bytes"] == 256 * MiB
    f = nbmem.leaks(cell=last_cell(gpu))
    assert list(f["name"]) == ["k"] and list(f["device"]) == ["cuda:0"] and list(f["bytes"]) == [256 * MiB]


def test_nvml_used_agrees_with_nvidia_smi(gpu):
    import nbmem
    from nbmem.ipython.root import _ACTIVE

    sess = _ACTIVE[gpu].session
    dev = sess.probe.nvml.devices[0]
    time.sleep(0.6)
    ours = nbmem.samples()
    ours = ours[ours.device == "cuda:0"].iloc[-1]
    smi = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits",
                          "-i", str(dev.nvml_index)], capture_output=True, text=True, check=True).stdout
    used_mib, total_mib = (float(v) for v in smi.strip().split(","))
    assert abs(ours["nvml_used_bytes"] / MiB - used_mib) <= max(64, 0.01 * used_mib)
    assert abs(ours["nvml_total_bytes"] / MiB - total_mib) <= 1


def test_cleanup_frees_what_it_names_and_empties_the_cache(gpu):
    import nbmem

    # Bigger than any segment earlier tests left cached, so x gets a segment of its own (a block carved
    # from a cached segment that something else still uses cannot be given back: fragmentation).
    ok(gpu, "x = torch.empty(4 * 2**30, dtype=torch.uint8, device='cuda')\ny = 1")
    rep = nbmem.cleanup(names=["x"])
    assert rep.freed_allocated_bytes >= 4 * GiB
    assert rep.freed_reserved_bytes >= 4 * GiB  # empty_cache gave the cache back
    assert "y" in gpu.user_ns


def test_out_of_memory_reports_itself_with_remedies(gpu, capsys):

    r = run(gpu, "big = torch.empty(10 * 2**40, dtype=torch.uint8, device='cuda')")
    assert not r.success
    out = capsys.readouterr().out
    assert "OutOfMemoryError" in out and "no_grad" in out and "expandable_segments" in out
    assert row_of(last_cell(gpu))["error"] == "OutOfMemoryError"


LOADER_CELL = (
    "import torch\n"
    "from torch.utils.data import DataLoader, Dataset\n"
    "class D(Dataset):\n"
    "    def __len__(self): return 64\n"
    "    def __getitem__(self, i): return torch.tensor([float(torch.cuda.is_initialized())])\n"
    "w = torch.empty(2**20, device='cuda')\n"
    "flags = torch.cat([b for b in DataLoader(D(), batch_size=8, num_workers=4, multiprocessing_context='fork')])\n"
)


def test_dataloader_fork_workers_while_sampling():
    out = in_fresh_process(f"""
        cell("%load_ext nbmem"); cell("%config Nbmem.interval = 0.02"); cell("%cudamem on")
        cell({LOADER_CELL!r})
        print(json.dumps({{"worker_cuda": float(sh.user_ns["flags"].sum()), "n": len(sh.user_ns["flags"])}}))
    """, timeout=120)
    assert out == {"worker_cuda": 0.0, "n": 64}


def test_user_threads_allocating_while_a_cell_is_monitored(gpu):

    ok(gpu, """
import threading
held = []
def work():
    for _ in range(50):
        held.append(torch.empty(2**20, device='cuda'))
ts = [threading.Thread(target=work) for _ in range(4)]
for t in ts: t.start()
for t in ts: t.join()
""")
    assert row_of(last_cell(gpu))["delta_allocated_bytes"] == 4 * 50 * 4 * MiB


def test_device_side_assert_says_restart():
    out = in_fresh_process("""
        cell("%load_ext nbmem"); cell("%cudamem on")
        src = ("import torch\\nx = torch.zeros(4, device='cuda')\\n"
               "x[torch.tensor([10], device='cuda')] = 1\\ntorch.cuda.synchronize()")
        r = sh.run_cell(src, store_history=True)
        import nbmem
        from nbmem.ipython.root import _ACTIVE
        rep = _ACTIVE[sh].session.last_report
        print(json.dumps({"ok": r.success, "advice": " ".join(rep.advice)}))
    """)
    assert out["ok"] is False and "restart" in out["advice"]


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_numbers_are_per_device_when_tensors_live_on_cuda1(gpu):
    import nbmem

    ok(gpu, "%%cudamem\nz = torch.empty(128 * 2**20, dtype=torch.uint8, device='cuda:1')")
    assert row_of(last_cell(gpu), "cuda:1")["delta_allocated_bytes"] == 128 * MiB
    rep = nbmem.report()
    others = rep[(rep.index == last_cell(gpu)) & (rep["device"] != "cuda:1")]
    assert (others["delta_allocated_bytes"] == 0).all()
    assert list(nbmem.leaks(cell=last_cell(gpu))["device"]) == ["cuda:1"]


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("how", ["index", "uuid"])
def test_cuda_visible_devices_maps_to_the_right_nvml_device(how):
    import pynvml

    pynvml.nvmlInit()
    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(1))
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    value = "1" if how == "index" else uuid
    out = in_fresh_process("""
        cell("%load_ext nbmem"); cell("%cudamem on")
        cell("import torch\\nq = torch.empty(256 * 2**20, dtype=torch.uint8, device='cuda')")
        import nbmem
        from nbmem.ipython.root import _ACTIVE
        d = _ACTIVE[sh].session.probe.nvml.devices
        g = _ACTIVE[sh].session.probe.nvml.read("cuda:0", cuda_in_use=True)
        print(json.dumps({"n": len(d), "nvml_index": d[0].nvml_index, "own": g.process_used_bytes}))
    """, env={"CUDA_VISIBLE_DEVICES": value, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert out["n"] == 1 and out["nvml_index"] == 1 and out["own"] and out["own"] >= 256 * MiB
