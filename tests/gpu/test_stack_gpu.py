"""The 2026 GPU notebook stack on a real GPU (issue 19): compiled models, child processes, mixed precision,
accelerate's notebook_launcher (issue 34).

torch, pynvml and the standard library besides nbmem's own test tools (and accelerate, where it is installed);
every figure is checked against the allocator's own segments (``torch.cuda.memory_snapshot()``) or the driver's
per-process numbers (NVML).

    python -m pytest -q -p no:randomly tests/gpu/test_stack_gpu.py
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

import nbmem
from nbmem.ipython.root import session_of
from tests.cells import autocast_steps, checkpointed_training
from tests.conftest import ok
from tests.gpu.conftest import GPUS
from tests.gpu.nvml_truth import nvml_by_pid

MiB = 2**20
DEFAULT_POOL = (0, 0)

MLP = """
import torch
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                          torch.nn.ReLU(), torch.nn.Linear(4096, 4096)).cuda()
x = torch.randn(2048, 4096, device="cuda")
"""


def private_segments(torch: Any) -> list[dict[str, Any]]:
    return [s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) != DEFAULT_POOL]


def memory(torch: Any) -> tuple[int, int]:
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated()), int(torch.cuda.memory_reserved())


# -- compiled models ----------------------------------------------------------------------------------------
# The default mode first: after a reduce-overhead graph in this process, torch (2.11) was seen to allocate
# later tensors into a private pool even after torch._dynamo.reset(), which a later test would read as a pool.
def test_default_mode_has_no_graph_pool_and_its_reset_is_measured(gpu: Any) -> None:
    torch = gpu.user_ns["torch"]
    ok(gpu, MLP)
    ok(gpu, "cm = torch.compile(mlp)\nwith torch.no_grad():\n    for _ in range(3):\n        y = cm(x)")
    rep = session_of(gpu).last_report
    assert private_segments(torch) == [] and rep.pools == (), "no CUDA graphs: no pool is claimed"
    assert nbmem.status().pools == ()
    before = memory(torch)
    clean = nbmem.cleanup(compiled=True)
    after = memory(torch)
    assert not clean.errors and clean.steps[0].action == "reset torch.compile"
    assert (clean.freed_allocated_bytes, clean.freed_reserved_bytes) == (before[0] - after[0], before[1] - after[1])


def test_reduce_overhead_pool_is_named_to_the_byte_and_the_compiled_step_frees_it(gpu: Any) -> None:
    torch = gpu.user_ns["torch"]
    ok(gpu, MLP)
    ok(gpu, "cm = torch.compile(mlp, mode='reduce-overhead')\n"
            "with torch.no_grad():\n"
            "    for _ in range(4):  # warm-up runs, then the CUDA graph is recorded and replayed\n"
            "        y = cm(x)\n"
            "torch.cuda.synchronize()")
    rep = session_of(gpu).last_report
    assert rep is not None
    segs = private_segments(torch)
    assert segs, "mode='reduce-overhead' records CUDA graphs into a private pool"
    reserved = sum(int(s["total_size"]) for s in segs)
    blocks = [b for s in segs for b in s["blocks"] if b["state"] == "active_allocated"]
    allocated = sum(int(b["size"]) for b in blocks)
    y_ptr = gpu.user_ns["y"].data_ptr()
    # Where torch hands the graph's output back in its pool (some versions copy it out), `y` is the user's.
    y_block = [int(b["size"]) for b in blocks if b["address"] <= y_ptr < b["address"] + b["size"]]
    (pool,) = rep.pools
    assert (pool.device, pool.reserved_bytes, pool.allocated_bytes) == ("cuda:0", reserved, allocated)
    assert pool.unnamed_bytes == allocated - sum(y_block), "what a name reaches is the user's; the rest the graph's"
    assert pool.compiled == ("cm",) and rep.compiled == ("cm",)
    assert "`%cudamem clean --compiled`" in str(rep) and session_of(gpu).should_show(rep)
    assert any(line.startswith("cuda:0: ") and "compiled modules: cm" in line for line in nbmem.status().pools)
    assert private_segments(torch) == segs, "measuring changed nothing"

    before = memory(torch)
    clean = nbmem.cleanup(names=["y"], compiled=True)
    after = memory(torch)
    assert [s.action for s in clean.steps] == ["del", "reset torch.compile", "gc.collect()", "empty_cache()"]
    assert not clean.errors, clean
    assert (clean.freed_allocated_bytes, clean.freed_reserved_bytes) == (before[0] - after[0], before[1] - after[1])
    assert private_segments(torch) == [], "the graphs' pool is gone"
    assert clean.freed_reserved_bytes >= reserved
    ok(gpu, "with torch.no_grad():\n    z = cm(x)")  # it still runs: it compiles again


# -- the notebook's own child processes ---------------------------------------------------------------------
def hold(rank: int, mib: int, devices: int, ready: Any, stop: Any) -> None:
    """A worker as torch.multiprocessing.spawn starts it: ``mib`` MiB on cuda:(rank % devices), then it waits."""
    import torch

    dev = rank % devices
    block = torch.empty(mib * MiB, dtype=torch.uint8, device=f"cuda:{dev}")
    torch.cuda.synchronize(dev)
    ready.put((rank, os.getpid(), dev))
    stop.wait(300)
    del block


def spawn_workers(gpu: Any, devices: int) -> tuple[set[int], dict[int, int]]:
    """Two workers from a cell, as a notebook starts them; returns their PIDs and each one's device."""
    ok(gpu, "import torch.multiprocessing as mp\n"
            "from tests.gpu.test_stack_gpu import hold\n"
            "_spawn = mp.get_context('spawn')\n"
            "ready, stop = _spawn.Queue(), _spawn.Event()\n"
            f"ctx = mp.spawn(hold, args=(256, {devices}, ready, stop), nprocs=2, join=False)\n"
            "workers = [ready.get(timeout=240) for _ in range(2)]")
    workers = gpu.user_ns["workers"]
    return {pid for _, pid, _ in workers}, {pid: dev for _, pid, dev in workers}


def stop_workers(gpu: Any) -> None:
    ok(gpu, "stop.set()\nctx.join(120)")


def ctx_pids(gpu: Any) -> set[int]:
    return set(gpu.user_ns["ctx"].pids())


@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.skipif(
    GPUS < 2, reason=f"needs 2 GPUs; NVML sees {GPUS} here (the 1-GPU case runs)"))])
def test_spawned_workers_are_the_notebooks_per_process_and_per_gpu(gpu: Any, devices: int) -> None:
    pids, dev_of = spawn_workers(gpu, devices)
    session = session_of(gpu)
    rep = session.last_report
    assert rep is not None and ctx_pids(gpu) == pids
    truth = nvml_by_pid(pids)
    index = {d.name: d.nvml_index for d in session.devices()}
    # The report of the cell that started them names each one, on its GPU, with NVML's figure (to 1 %).
    named = {(c.device, c.pid): c.used_bytes for c in rep.children}
    assert {pid for _, pid in named} == pids
    for (device, pid), used in named.items():
        assert device == f"cuda:{dev_of[pid]}"
        assert used is not None and abs(used - truth[(index[device], pid)]) <= 0.01 * truth[(index[device], pid)]
    assert "still running" in str(rep) and "os.kill(PID, signal.SIGTERM)" in str(rep)
    # The samples, status and the gauge's columns count them as this notebook's, apart from other processes.
    want = {d: sum(b for (i, pid), b in truth.items() if i == index[f"cuda:{d}"]) for d in range(devices)}

    def children_now() -> dict[int, float]:
        df = nbmem.samples()
        return {d: float(df[df.device == f"cuda:{d}"].iloc[-1]["children_used_bytes"]) for d in range(devices)}

    # The sampler's process list is a second old at most, but the sampler is a thread of a busy process: wait for
    # its next reading of them (15 s at most), never a fixed time.
    deadline = time.monotonic() + 15
    while (any(not abs(got - want[d]) <= 0.01 * want[d] for d, got in children_now().items())
           and time.monotonic() < deadline):
        time.sleep(0.2)
    got = children_now()
    assert all(abs(got[d] - want[d]) <= 0.01 * want[d] for d in range(devices)), (got, want)
    tick = session.store.latest_tick()
    for smp in tick:
        assert not {p.pid for p in smp.processes} & pids, "a worker is not another process"
    lines = nbmem.status().children
    assert all(any(f"PID {pid} holds" in line for line in lines) for pid in pids)
    # A later cell does not name them again; once they are stopped, nothing is left running.
    ok(gpu, "n = 1")
    assert session.last_report.children == ()
    stop_workers(gpu)
    ok(gpu, "n = 2")
    assert session.last_report.children == ()


# -- mixed precision and checkpointing ------------------------------------------------------------------------
TRAINING = checkpointed_training(width=1024, blocks=6, classes=1000, batch=512, device="cuda", lr=1e-4)
STEP = autocast_steps(steps=5, device="cuda", dtype="float16")


def test_autocast_gradscaler_checkpoint_loop_rerun_three_times_finds_nothing_new_and_peaks_stay_exact(
        gpu: Any) -> None:
    torch = gpu.user_ns["torch"]
    session = session_of(gpu)
    ok(gpu, TRAINING)
    ok(gpu, STEP)
    first = session.last_report
    assert {f.name for f in first.findings} >= {"opt"}, "the first run made the optimizer's state: true news"
    for _ in range(3):
        ok(gpu, "torch.cuda.reset_peak_memory_stats()")
        ok(gpu, STEP)
        rep = session.last_report
        assert rep.findings == (), [(f.name, f.bytes, f.what()) for f in rep.findings]
        assert rep.unattributed == () and rep.pools == ()
        (rec,) = [r for r in rep.records if r.device == "cuda:0"]
        assert rec.peak_allocated_bytes == torch.cuda.max_memory_allocated(), "the peak is exact"
        assert abs(rec.delta_allocated_bytes) < MiB, "a re-run keeps no more than the run before"
    assert gpu.user_ns["out"].dtype == torch.float16 and gpu.user_ns["scaler"].get_scale() > 0


# -- accelerate's notebook_launcher ---------------------------------------------------------------------------
LAUNCHER_SCRIPT = r'''
import json, os, sys, threading, time
import torch  # not CUDA: importing torch makes no context
from IPython.core.interactiveshell import InteractiveShell

tmp = sys.argv[1]
ip = InteractiveShell.instance()
for src in ("%load_ext nbmem", "%cudamem on", "import torch"):
    assert ip.run_cell(src, store_history=True).success, src
import nbmem
from nbmem.ipython.root import session_of
from tests.gpu.nvml_truth import cuda_name, nvml_by_pid

seen = {}


def nvml_of(pids):
    out = {}
    for (i, _), used in nvml_by_pid(pids).items():
        name = cuda_name(i)  # nbmem names devices as CUDA does in this process
        out[name] = out.get(name, 0) + used
    return out


def watch():
    """While the launcher's cell runs: once both ranks hold their memory, what nbmem's sampler says of them beside
    NVML's own figure; then the ranks are let go."""
    try:
        deadline = time.monotonic() + 150
        ready = {}
        while time.monotonic() < deadline and len(ready) < 2:
            for r in (0, 1):
                f = os.path.join(tmp, f"ready{r}")
                if os.path.exists(f) and os.path.getsize(f):
                    ready[r] = tuple(map(int, open(f).read().split()))
            time.sleep(0.1)
        pids = {pid for pid, _ in ready.values()}
        truth = nvml_of(pids)
        got = {}
        while time.monotonic() < deadline:
            df = nbmem.samples()
            got = {d: float(df[df.device == d].iloc[-1]["children_used_bytes"]) for d in truth}
            if all(abs(got[d] - truth[d]) <= 0.01 * truth[d] for d in truth):
                break
            time.sleep(0.2)
        others = {p.pid for smp in session_of(ip).store.latest_tick() for p in smp.processes}
        seen.update(ranks={str(r): v for r, v in ready.items()}, truth=truth, got=got,
                    others=sorted(others & pids), status=list(nbmem.status().children))
    except Exception as e:  # said in the test's failure, not lost with the thread
        seen["error"] = repr(e)
    finally:
        open(os.path.join(tmp, "go"), "w").close()


threading.Thread(target=watch, daemon=True).start()
cell = f"""
from accelerate import notebook_launcher

def train(tmp):
    import os, time, torch
    rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    dev = rank % torch.cuda.device_count()
    block = torch.empty(256 << 20, dtype=torch.uint8, device=f"cuda:{{dev}}")
    torch.cuda.synchronize(dev)
    with open(os.path.join(tmp, f"ready{{rank}}"), "w") as f:
        f.write(f"{{os.getpid()}} {{dev}}")
    deadline = time.monotonic() + 170
    while not os.path.exists(os.path.join(tmp, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
    del block

notebook_launcher(train, args=({tmp!r},), num_processes=2)
"""
r = ip.run_cell(cell, store_history=True)
rep = session_of(ip).last_report
print(json.dumps(dict(
    success=r.success, error=repr(r.error_before_exec or r.error_in_exec), seen=seen,
    cuda_initialized=torch.cuda.is_initialized(),
    use={u.device: [u.after_bytes, u.peak_bytes, list(u.pids)] for u in (rep.children_use if rep else ())},
    report=str(rep))))
'''


def test_accelerates_notebook_launcher_runs_with_nbmem_loaded_and_its_ranks_are_the_notebooks(tmp_path: Any) -> None:
    """accelerate's ``notebook_launcher`` refuses to start when CUDA is initialized in the notebook, then forks
    one rank per GPU and waits for them. With nbmem loaded and every cell monitored it still starts (nbmem made
    no CUDA context), the ranks are this notebook's children on each GPU while they run (NVML's figure, not other
    processes), and the cell's report says what they held there. A fresh process: this one has CUDA."""
    import importlib.util
    import json
    import subprocess
    import sys

    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed")
    devices = min(GPUS, 2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", LAUNCHER_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["success"], (res["error"], out.stdout[-3000:])
    assert res["cuda_initialized"] is False
    seen = res["seen"]
    assert "error" not in seen, seen
    ranks = seen["ranks"]
    assert sorted(ranks) == ["0", "1"] and {dev for _, dev in ranks.values()} == set(range(devices))
    # While they ran: each GPU's children, as the sampler read them, are NVML's figure for the ranks there (1 %).
    truth, got = seen["truth"], seen["got"]
    assert set(truth) == {f"cuda:{d}" for d in range(devices)}
    assert all(abs(got[d] - truth[d]) <= 0.01 * truth[d] for d in truth), (got, truth)
    assert seen["others"] == [], "a rank is not another process"
    assert all(any(f"PID {pid} holds" in line for line in seen["status"]) for pid, _ in ranks.values())
    # The launcher's cell: what they held at most on each GPU, and which rank it was, though they ended with it.
    for d, t in truth.items():
        assert d in res["use"] and res["use"][d][1] >= 0.99 * t, (res["use"], res["report"])
        assert res["use"][d][2] == sorted(pid for pid, dev in ranks.values() if f"cuda:{dev}" == d), res["use"]
        assert f"child processes of this notebook on {d} ({'PID' if devices == 2 else 'PIDs'} " in res["report"]
