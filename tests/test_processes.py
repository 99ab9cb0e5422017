"""This notebook's child processes: told apart by the real process tree, shown per GPU, named when left running.

The processes are real (``subprocess``, ``torch.multiprocessing``) and so is their ancestry; only NVML is a
stand-in (no GPU here) that lists this process and its live descendants as a driver would once they have a
CUDA context, each with the bytes the test gives it. tests/gpu/test_stack_gpu.py checks it against a real
driver's per-process figures.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

import nbmem
from nbmem.ipython.root import root_of
from nbmem.measure import processes
from nbmem.measure.processes import Split, has_children, lineage_of, lineages, split_children
from nbmem.measure.sources import NvmlSource
from nbmem.records import Boundary, GpuProcess, GpuReading
from nbmem.reports import child_texts
from tests.conftest import ok

MiB = 2**20
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(SLEEPER)
    yield p
    p.kill()
    p.wait()


def test_a_child_descends_from_us_and_a_gone_process_from_nobody(child: subprocess.Popen[bytes]) -> None:
    chain = lineage_of(child.pid)
    assert chain is not None and chain[:2] == (child.pid, os.getpid())
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert lineage_of(gone.pid) is None and lineage_of(0) is None
    assert "time.sleep(120)" in processes.command_of(child.pid)
    started = processes.started_at(child.pid)
    assert started is not None and abs(started - time.time()) < 60


def test_has_children_reads_the_process_tree() -> None:
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
                               "print(c.pid, flush=True); time.sleep(120)"], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        grandchild = int(parent.stdout.readline())
        assert has_children(parent.pid) is True
        assert has_children(grandchild) is False
        assert lineage_of(grandchild)[:3] == (grandchild, parent.pid, os.getpid())  # type: ignore[index]
        gone = subprocess.Popen(["true"])
        gone.wait()
        pids = [grandchild, parent.pid, os.getpid(), gone.pid, 0, grandchild]
        # many at once, each parent read once (what a server does for its kernels), say the same as one by one
        assert lineages(pids) == {p: lineage_of(p) for p in pids}
        assert lineages(pids)[grandchild][:3] == (grandchild, parent.pid, os.getpid())  # type: ignore[index]
        assert lineages([gone.pid, 0]) == {gone.pid: None, 0: None}
    finally:
        for p in psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        parent.kill()
        parent.wait()


def gp(pid: int, used: int | None = MiB) -> GpuProcess:
    return GpuProcess(pid, used, "python")


def test_split_children_by_lineage() -> None:
    me = 100
    procs = [gp(me), gp(200), gp(300), gp(400)]
    lineage = {200: (200, me, 1), 300: (300, 250, me, 1), 400: (400, 1)}
    assert split_children(procs, me, lineage, pids_match=False) == Split((gp(200), gp(300)), (gp(400),))


def test_a_pid_that_does_not_exist_here_makes_children_unknown_unless_ours_is_listed() -> None:
    me = 100
    procs = [gp(200), gp(999)]
    lineage = {200: (200, me, 1), 999: None}
    unknown = split_children(procs, me, lineage, pids_match=False)
    assert unknown.children == () and unknown.others == (gp(200), gp(999)) and "container" in (unknown.unknown or "")
    # NVML lists our own PID: its PIDs are ours, and one that is not here just exited.
    known = split_children([gp(me), *procs], me, lineage, pids_match=True)
    assert known == Split((gp(200),), (gp(999),))


class TreeNvml:
    """NVML for one GPU listing this process and the descendants it starts from now on (as once each has a
    CUDA context), with the bytes ``sizes`` gives by PID, plus ``strangers`` (PID, bytes) of other users."""

    NVML_VALUE_NOT_AVAILABLE = 2**64 - 1

    def __init__(self, *, me_listed: bool = True, started: tuple[int, ...] = ()) -> None:
        self.ready: Path | None = None  # when set, a child is listed once it has made a file named by its PID here
        self.sizes: dict[int, int | None] = {}
        self.strangers: list[tuple[int, int]] = []
        self.me_listed = me_listed
        # Processes other tests left running (session-wide servers) are not on this GPU; ``started`` are.
        self.before = {p.pid for p in psutil.Process().children(recursive=True)} - set(started)

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int:
        return 1
    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i
    def nvmlDeviceGetUUID(self, h: int) -> str:
        return "GPU-tree-0"
    def nvmlDeviceGetName(self, h: int) -> str:
        return "Fake H100"
    def nvmlDeviceGetMemoryInfo(self, h: int, version: Any = None) -> Any:
        return SimpleNamespace(used=20 * 2**30, total=80 * 2**30)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        kids = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in self.before
                and (self.ready is None or (self.ready / str(p.pid)).exists())]
        rows = [(os.getpid(), 500 * MiB)] if self.me_listed else []
        rows += [(pid, self.sizes.get(pid, 100 * MiB)) for pid in kids] + self.strangers
        return [SimpleNamespace(pid=pid, usedGpuMemory=self.NVML_VALUE_NOT_AVAILABLE if b is None else b)
                for pid, b in rows]


def test_nvml_source_splits_this_process_its_children_and_others(child: subprocess.Popen[bytes]) -> None:
    nv = TreeNvml(started=(child.pid,))
    nv.sizes[child.pid] = 300 * MiB
    nv.strangers = [(4242424, 7 * MiB)]  # no such PID here, and NVML lists ours: it just exited
    src = NvmlSource(nv, environ={})
    src.start()
    g = src.read("cuda:0", cuda_in_use=True)
    assert (g.process_used_bytes, g.children_bytes, g.other_processes_bytes) == (500 * MiB, 300 * MiB, 7 * MiB)
    assert [p.pid for p in g.children] == [child.pid] and [p.pid for p in g.processes] == [4242424]
    c = g.children[0]
    assert "time.sleep(120)" in c.command and c.started_wall is not None
    assert src.children_reason is None


def test_children_unknown_when_nvml_speaks_of_other_pids(child: subprocess.Popen[bytes]) -> None:
    nv = TreeNvml(me_listed=False, started=(child.pid,))
    nv.strangers = [(4242424, 7 * MiB)]
    src = NvmlSource(nv, environ={})
    src.start()
    g = src.read("cuda:0", cuda_in_use=False)  # this process has no context: NVML's PIDs cannot be checked
    assert g.children_bytes is None and g.children == ()
    assert g.other_processes_bytes == 107 * MiB, "everything but this process, as before the split"
    assert "container" in (src.children_reason or "")
    # With CUDA in use and our PID missing, NVML's PIDs are the host's: nothing per process is known.
    g = src.read("cuda:0", cuda_in_use=True)
    assert (g.process_used_bytes, g.children_bytes) == (None, None)


# -- in a notebook -----------------------------------------------------------------------------------------
@pytest.fixture
def tree(ip: Any) -> Iterator[TreeNvml]:
    """The monitored shell seeing one stand-in GPU where this process's descendants appear as they start."""
    nv = TreeNvml()
    session = root_of(ip).session
    session.sampler.stop()
    old = session.probe.nvml
    session.probe.nvml = NvmlSource(nv, environ={})
    session.probe.start()
    session.sampler.start()
    yield nv
    ok(ip, "for _p in _children:\n    _p.kill(); _p.wait()")
    old.close()


def test_a_cell_that_leaves_a_child_running_names_it_and_says_how_to_stop_it(ip: Any, tree: TreeNvml) -> None:
    ok(ip, "import subprocess, sys, time\n_children = []")
    # As a launcher does, the cell waits a moment for its worker (a real one is listed once it has a context).
    ok(ip, f"_children.append(subprocess.Popen({SLEEPER!r}))\ntime.sleep(0.1)")
    session = root_of(ip).session
    rep = session.last_report
    pid = ip.user_ns["_children"][0].pid
    assert rep is not None and [(c.device, c.pid, c.used_bytes) for c in rep.children] == [("cuda:0", pid, 100 * MiB)]
    started = rep.children[0].started_wall
    assert "time.sleep(120)" in rep.children[0].command and started is not None and abs(started - time.time()) < 5
    assert [(u.device, u.after_bytes, u.peak_bytes, u.pids) for u in rep.children_use] == [
        ("cuda:0", 100 * MiB, 100 * MiB, (pid,))]
    assert session.should_show(rep)
    assert f"PID {pid} is still running" in str(rep) and "os.kill(PID, signal.SIGTERM)" in str(rep)
    # Named once: the next cell leaves it as it was, and says nothing of it.
    ok(ip, "x = 1")
    assert session.last_report.children == () and session.last_report.children_use == ()
    # The gauge's columns, the samples and the status show it as this notebook's, apart from the others.
    time.sleep(0.6)
    df = nbmem.samples()
    assert df[df.device == "cuda:0"]["children_used_bytes"].iloc[-1] == 100 * MiB
    assert df[df.device == "cuda:0"]["other_processes_bytes"].iloc[-1] == 0
    assert any(f"PID {pid} holds 100 MiB" in line for line in nbmem.status().children)


def test_a_child_that_ran_and_ended_inside_the_cell_is_counted_from_the_samples(ip: Any, tree: TreeNvml) -> None:
    ok(ip, "import subprocess, sys, time\n_children = []")
    tree.sizes = {}
    ok(ip, "_p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1.5)'])\n"
           "_children.append(_p)\n_p.wait()")
    rep = root_of(ip).session.last_report
    pid = ip.user_ns["_p"].pid
    assert rep.children == (), "nothing is left running"
    # Gone at the cell's end, it is named by the PID the sampler's readings saw while it ran.
    assert [(u.device, u.after_bytes, u.peak_bytes, u.pids) for u in rep.children_use] == [
        ("cuda:0", 0, 100 * MiB, (pid,))]
    assert f"child processes of this notebook on cuda:0 (PID {pid}): 0 B at the end, at most 100 MiB" in str(rep)


def test_a_child_that_reaches_the_gpu_after_its_cell_ended_is_named_by_the_next_report(
        ip: Any, tree: TreeNvml, tmp_path: Path) -> None:
    # As mp.spawn(..., join=False) or notebook_launcher in a cell that returns at once: the workers make their
    # CUDA context a moment later, while no cell runs.
    tree.ready = tmp_path
    ok(ip, "import subprocess, sys, time\n_children = []")
    code = "import os, pathlib, sys, time; time.sleep(0.3); pathlib.Path(sys.argv[1], str(os.getpid())).touch(); " \
           "time.sleep(120)"
    ok(ip, f"_children.append(subprocess.Popen([sys.executable, '-c', {code!r}, {str(tmp_path)!r}]))")
    session = root_of(ip).session
    assert session.last_report.children == ()
    pid = ip.user_ns["_children"][0].pid
    deadline = time.monotonic() + 30
    while not (tmp_path / str(pid)).exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ok(ip, "x = 1")
    assert [c.pid for c in session.last_report.children] == [pid]
    ok(ip, "x = 2")
    assert session.last_report.children == ()


# -- what a report says of them (pure) --------------------------------------------------------------------------
def _boundary(children: dict[int, int]) -> Boundary:
    kids = tuple(GpuProcess(pid, used, "python3") for pid, used in children.items())
    gpu = GpuReading(80 * 1024 * MiB, 80 * 1024 * MiB, 0, 0, children_bytes=sum(children.values()), children=kids)
    return Boundary(0.0, 0.0, None, None, {}, {"cuda:0": gpu})


def test_a_child_the_cell_stopped_before_any_reading_is_named_from_the_cells_start() -> None:
    # It held 1 GiB when the cell began and was gone at the first reading (os.kill, as a report advises).
    use = processes.children_use(_boundary({4242: 1024 * MiB}), _boundary({}), [], threshold_bytes=MiB)
    assert [(u.device, u.after_bytes, u.peak_bytes, u.pids) for u in use] == [("cuda:0", 0, 1024 * MiB, (4242,))]
    assert child_texts(use, ())[0].startswith("child processes of this notebook on cuda:0 (PID 4242): 0 B at the end")


def test_a_report_names_a_few_children_by_pid_and_counts_the_rest() -> None:
    few = processes.children_use(_boundary({}), _boundary({11: 800 * MiB, 7: 800 * MiB}), [], threshold_bytes=MiB)
    assert "on cuda:0 (PIDs 7, 11): 1.56 GiB at the end" in child_texts(few, ())[0]
    many = processes.children_use(_boundary({}), _boundary({pid: 600 * MiB for pid in range(100, 110)}), [],
                                  threshold_bytes=MiB)
    assert "(PIDs 100, 101, 102, 103, 104, 105, 106, 107 and 2 more)" in child_texts(many, ())[0]
