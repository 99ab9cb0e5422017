"""nbmem.server in a real jupyter server, with a fake NVML binding; its pure parts; the kernel-side lookup.

The servers are real (``scripts/gpu_server_check.py``'s ``JupyterServer``: a subprocess with the extension
enabled by the config file the wheel installs), and so are the kernels, their PIDs and a child process.
Only the NVML binding is fake (``tests/fake_nvml.py``, told the real PIDs through a JSON file).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from jupyter_server.auth.authorizer import Authorizer

from nbmem.measure.notebooks import ServerNotebooks, pids_to_notebooks
from nbmem.measure.processes import lineage_of
from nbmem.measure.sources import NvmlSource
from nbmem.records import GpuDevice, GpuProcess
from nbmem.server import Kernel, Reading, ServerMonitor, attribute, metric_families
from tests import fake_nvml

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


#: The deaths counter from a server's start: every reason, at 0 (docs/operators.md lists them).
NO_DEATHS = [f'nbmem_kernel_deaths_total{{reason="{r}"}} 0.0' for r in (
    "oom-kill", "limit", "cuda-error", "host-memory", "killed", "crashed", "exited", "unknown")]

def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_server_check", ROOT / "scripts/gpu_server_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_script = _script()
JupyterServer = check_script.JupyterServer


class DenyKernelReads(Authorizer):
    """Loaded by a test server: refuses "kernels" to requests marked X-Deny, so the endpoint must ask."""

    def is_authorized(self, handler: Any, user: Any, action: str, resource: str) -> bool:
        return not (resource == "kernels" and "X-Deny" in handler.request.headers)


def fake_gpu(index: int, used: int, processes: list[tuple[int, int]]) -> dict[str, Any]:
    """What the fake NVML lists for one GPU; ``processes`` as (pid, bytes)."""
    return {"name": f"Fake GPU {index}", "uuid": f"GPU-fake-{index}", "total_bytes": 80 * GiB, "used_bytes": used,
            "processes": [{"pid": pid, "used_bytes": b} for pid, b in processes]}


def gpu_json(index: int, used: int, kernels: list[dict[str, Any]], others: list[dict[str, Any]]) -> dict[str, Any]:
    """What the endpoint must answer for a ``fake_gpu``."""
    return {"index": index, "uuid": f"GPU-fake-{index}", "name": f"Fake GPU {index}", "total_bytes": 80 * GiB,
            "used_bytes": used, "kernels": sorted(kernels, key=lambda k: k["kernel_id"]), "other_processes": others}


def kernel_line(gpu: int, kernel: str, notebook: str, value: str) -> str:
    return f'nbmem_kernel_gpu_memory_bytes{{gpu="{gpu}",kernel_id="{kernel}",notebook="{notebook}"}} {value}'


@dataclass
class TwoNotebooks:
    """A server with the fake NVML and two notebooks: A (a.ipynb) and B (sub/b.ipynb), whose kernel has a child."""

    server: Any
    gpus: Path
    session_a: str
    kernel_a: str
    kernel_b: str
    pid_a: int
    pid_b: int
    child_b: int


@pytest.fixture
def two_notebooks(tmp_path: Path) -> Iterator[TwoNotebooks]:
    gpus = tmp_path / "gpus.json"
    fake_nvml.write(gpus, [fake_gpu(0, 10 * GiB, []), fake_gpu(1, 3 * GiB, [])])  # devices are read at startup
    config = {"NbmemServer": {"nvml_module": "tests.fake_nvml"}}
    # CUDA_VISIBLE_DEVICES hides GPU 0 from CUDA, not from the server: it must still see both.
    env = {fake_nvml.ENV: str(gpus), "CUDA_VISIBLE_DEVICES": "1"}
    (tmp_path / "sub").mkdir()
    with JupyterServer(tmp_path, config, env) as server:
        session_a, kernel_a = server.open_notebook("a.ipynb")
        _, kernel_b = server.open_notebook("sub/b.ipynb")
        pid_a = int(server.execute(kernel_a, "import os; print(os.getpid())"))
        spawn = "import os, subprocess\np = subprocess.Popen(['sleep', '60'])\nprint(os.getpid(), p.pid)"
        pid_b, child = map(int, server.execute(kernel_b, spawn).split())
        try:
            yield TwoNotebooks(server, gpus, session_a, kernel_a, kernel_b, pid_a, pid_b, child)
        finally:
            # Reaped by its kernel, which then stops at once (a kernel with a live child takes 3 s more).
            server.execute(kernel_b, "p.kill(); p.wait()")


@pytest.fixture
def sleeper() -> Iterator[int]:
    """A process that is neither a kernel nor one's child: an "other process" on the GPU."""
    p = subprocess.Popen(["sleep", "60"])
    yield p.pid
    p.kill()
    p.wait()


def test_two_notebooks_named_by_kernel_and_child_and_a_closed_one_leaves_the_metrics(
        two_notebooks: TwoNotebooks, sleeper: int) -> None:
    t = two_notebooks
    fake_nvml.write(t.gpus, [fake_gpu(0, 10 * GiB, [(t.pid_a, 3 * GiB // 2), (t.child_b, 2 * GiB), (sleeper, GiB)]),
                             fake_gpu(1, 3 * GiB, [(t.pid_b, GiB // 2)])])
    a = {"kernel_id": t.kernel_a, "notebook": "a.ipynb", "pids": [t.pid_a], "bytes": 3 * GiB // 2}
    b0 = {"kernel_id": t.kernel_b, "notebook": "sub/b.ipynb", "pids": [t.child_b], "bytes": 2 * GiB}
    b1 = {"kernel_id": t.kernel_b, "notebook": "sub/b.ipynb", "pids": [t.pid_b], "bytes": GiB // 2}
    other = {"pid": sleeper, "name": "sleep", "bytes": GiB}
    # The first reading: nothing has asked the extension before, so no cached one can be in the way.
    assert t.server.json("/api/nbmem/gpu") == {
        "gpus": [gpu_json(0, 10 * GiB, [a, b0], [other]), gpu_json(1, 3 * GiB, [b1], [])], "reason": None}
    devices = ['nbmem_gpu_memory_used_bytes{gpu="0"} 1.073741824e+10',
               'nbmem_gpu_memory_used_bytes{gpu="1"} 3.221225472e+09',
               'nbmem_gpu_memory_total_bytes{gpu="0"} 8.589934592e+10',
               'nbmem_gpu_memory_total_bytes{gpu="1"} 8.589934592e+10']
    lines_b = [kernel_line(0, t.kernel_b, "sub/b.ipynb", "2.147483648e+09"),
               kernel_line(1, t.kernel_b, "sub/b.ipynb", "5.36870912e+08")]
    assert sorted(t.server.metrics()) == sorted(
        [*devices, kernel_line(0, t.kernel_a, "a.ipynb", "1.610612736e+09"), *lines_b, *NO_DEATHS])

    # The kernel side: kernel B asks its server which notebook each GPU process belongs to.
    asked = t.server.execute(t.kernel_b, "import json\nfrom nbmem.measure.notebooks import notebook_of_pids\n"
                                         f"print(json.dumps(notebook_of_pids([{t.pid_a}, {t.child_b}, {t.pid_b}, "
                                         f"{sleeper}])))")
    assert json.loads(asked) == {str(t.pid_a): "a.ipynb", str(t.child_b): "sub/b.ipynb", str(t.pid_b): "sub/b.ipynb"}

    # Notebook A is closed: its kernel exits, so NVML stops listing it; its series must go.
    t.server.close_notebook(t.session_a)
    fake_nvml.write(t.gpus, [fake_gpu(0, 10 * GiB, [(t.child_b, 2 * GiB), (sleeper, GiB)]),
                             fake_gpu(1, 3 * GiB, [(t.pid_b, GiB // 2)])])
    time.sleep(1.1)  # the extension's reading may be up to a second old
    assert t.server.json("/api/nbmem/gpu") == {
        "gpus": [gpu_json(0, 10 * GiB, [b0], [other]), gpu_json(1, 3 * GiB, [b1], [])], "reason": None}
    assert sorted(t.server.metrics()) == sorted([*devices, *lines_b, *NO_DEATHS])


def test_without_nvml_the_server_starts_and_says_why_and_asks_for_credentials(tmp_path: Path) -> None:
    if check_script.nvml_missing() is None:
        pytest.skip("this machine has NVML: the fake-NVML test covers it")
    config = {"ServerApp": {"authorizer_class": "tests.test_server.DenyKernelReads"}}
    with JupyterServer(tmp_path, config) as server:
        body = server.json("/api/nbmem/gpu")
        assert body["gpus"] == []
        assert body["reason"] == "no NVIDIA driver on this machine (NVML's library is missing)", body
        assert sorted(server.metrics()) == sorted(NO_DEATHS)  # the GPU families are there, without a single sample
        assert server.request("GET", "/api/nbmem/gpu", token=False)[0] == 403
        assert server.request("GET", "/api/nbmem/gpu", headers={"X-Deny": "1"})[0] == 403
        assert "nbmem: no NVIDIA driver on this machine" in server.log()


# -- the pure parts -------------------------------------------------------------------------------------------
GPU = GpuDevice("cuda:0", 0, "GPU-x", "Fake")
KERNELS = (Kernel("k1", "one.ipynb", 100), Kernel("k2", None, 200))


def test_a_container_without_host_pids_knows_the_device_but_not_the_kernels() -> None:
    procs = (GpuProcess(4_000_001, GiB, "?"),)
    gpu, why = attribute(GPU, 5 * GiB, 80 * GiB, procs, KERNELS, {4_000_001: None})
    assert (gpu.used_bytes, gpu.total_bytes, gpu.other_processes) == (5 * GiB, 80 * GiB, procs)
    assert [(k.kernel_id, k.pids, k.used_bytes) for k in gpu.kernels] == [("k1", None, None), ("k2", None, None)]
    assert why == ["GPU 0: NVML lists 1 process(es) whose PID does not exist here (a container without the host "
                   "PID namespace), so which kernel holds what is unknown"]


def test_a_kernel_without_a_local_process_and_bytes_nvml_cannot_give_are_unknown_not_zero() -> None:
    kernels = (*KERNELS, Kernel("k3", "remote.ipynb", None))
    procs = (GpuProcess(100, None, "python"), GpuProcess(300, GiB, "python"))
    gpu, why = attribute(GPU, GiB, 80 * GiB, procs, kernels, {100: (100, 1), 300: (300, 200, 1)})
    assert [(k.kernel_id, k.pids, k.used_bytes) for k in gpu.kernels] == [
        ("k1", (100,), None), ("k2", (300,), GiB), ("k3", None, None)]
    assert why == ["kernel k3 has no process on this machine: its GPU memory is unknown",
                   "GPU 0: NVML gives no memory figure for 1 process(es) (as under MIG or WDDM)"]
    samples = [s for family in metric_families(Reading((gpu,), None, 0.0)) for s in family.samples]
    kernel_samples = [(s.labels, s.value) for s in samples if s.name == "nbmem_kernel_gpu_memory_bytes"]
    assert kernel_samples == [({"gpu": "0", "kernel_id": "k2", "notebook": ""}, GiB)]  # no session: empty label


def test_without_a_process_list_every_kernel_is_unknown() -> None:
    gpu, why = attribute(GPU, GiB, 80 * GiB, None, KERNELS, {})
    assert [(k.pids, k.used_bytes) for k in gpu.kernels] == [(None, None), (None, None)]
    assert (gpu.other_processes, why) == ((), [])


def test_a_process_counts_for_its_ancestors_and_a_gone_one_for_nobody() -> None:
    chain = lineage_of(os.getpid())
    assert chain is not None and chain[:2] == (os.getpid(), os.getppid())
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert lineage_of(gone.pid) is None
    assert lineage_of(0) is None


def test_one_reading_a_second_serves_everyone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gpus = tmp_path / "gpus.json"
    fake_nvml.write(gpus, [fake_gpu(0, GiB, [(os.getpid(), GiB)])])
    monkeypatch.setenv(fake_nvml.ENV, str(gpus))
    asked: list[int] = []

    def listed(handle: int) -> list[SimpleNamespace]:
        asked.append(handle)
        return fake_nvml.nvmlDeviceGetComputeRunningProcesses(handle)

    nvml = SimpleNamespace(**{n: getattr(fake_nvml, n) for n in dir(fake_nvml) if n.startswith("nvml")})
    nvml.nvmlDeviceGetComputeRunningProcesses = listed
    sessions = sqlite3.connect(":memory:")
    sessions.execute("CREATE TABLE session (session_id, path, name, type, kernel_id)")
    now = [0.0]
    monitor = ServerMonitor(NvmlSource(nvml=nvml, environ={}), SimpleNamespace(list_kernel_ids=lambda: []),
                            SimpleNamespace(cursor=sessions.cursor()), clock=lambda: now[0])
    first = monitor.reading()
    now[0] = 0.999
    assert monitor.reading() is first and asked == [0]
    now[0] = 1.0
    assert monitor.reading() is not first and asked == [0, 0]


# -- the kernel side ------------------------------------------------------------------------------------------
def test_outside_a_server_the_lookup_answers_nothing_and_asks_once(tmp_path: Path) -> None:
    assert ServerNotebooks(environ={}).notebook_of_pids([1]) == {}
    port = check_script.free_port()  # nothing listens there
    (tmp_path / "jpserver-42.json").write_text(json.dumps({"url": f"http://127.0.0.1:{port}/", "token": "t"}))
    looked: list[int] = []

    def runtime() -> Path:
        looked.append(1)
        return tmp_path

    now = [0.0]
    lookup = ServerNotebooks(environ={"JPY_PARENT_PID": "42"}, runtime_dir=runtime, clock=lambda: now[0])
    assert lookup.notebook_of_pids([1, 2]) == {}
    now[0] = 4.9
    assert lookup.notebook_of_pids([1, 2]) == {} and len(looked) == 1  # a failure is cached too
    now[0] = 5.0
    assert lookup.notebook_of_pids([1]) == {} and len(looked) == 2


def test_pids_are_named_by_the_notebook_of_their_kernel() -> None:
    payload = {"gpus": [{"kernels": [{"notebook": "a.ipynb", "pids": [1, 2]}, {"notebook": None, "pids": [3]},
                                     {"notebook": "b.ipynb", "pids": None}]},
                        {"kernels": [{"notebook": "c.ipynb", "pids": [4]}]}], "reason": None}
    assert pids_to_notebooks(payload) == {1: "a.ipynb", 2: "a.ipynb", 4: "c.ipynb"}


# -- packaging ------------------------------------------------------------------------------------------------
def test_importing_nbmem_loads_no_server_and_no_driver() -> None:
    heavy = ("jupyter_server", "tornado", "prometheus_client", "pynvml", "torch", "psutil")
    code = ("import sys, nbmem, nbmem.measure.notebooks\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_wheel_enables_the_extension_by_its_package_name() -> None:
    config = json.loads((ROOT / "jupyter-config/jupyter_server_config.d/nbmem.json").read_text())
    assert config == {"ServerApp": {"jpserver_extensions": {"nbmem": True}}}
    import nbmem

    assert [p["module"] for p in nbmem._jupyter_server_extension_points()] == ["nbmem.server"]


def test_the_gpu_check_says_so_and_passes_where_there_is_no_nvml() -> None:
    if check_script.nvml_missing() is None:
        pytest.skip("this machine has NVML: the check itself runs here (tests/gpu or by hand)")
    run = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_server_check.py")], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["ok"] is True and out["skipped"].startswith("NVML is not available")


@pytest.mark.slow
def test_a_kernel_that_dies_is_counted_by_reason_and_its_capsule_gets_the_signal(tmp_path: Path) -> None:
    """A real kernel with nbmem loaded is killed: the server's restarter sees it, /metrics counts it, and the
    restarted kernel's story has the signal the server added to the capsule."""
    import signal

    with JupyterServer(tmp_path, {}, {}) as server:
        _, kernel = server.open_notebook("dies.ipynb")
        pid = int(server.execute(kernel, "%load_ext nbmem\nimport os; print(os.getpid())").strip().splitlines()[-1])
        flight = server.runtime / "nbmem-flight"
        deadline = time.monotonic() + 20
        while not list(flight.glob(f"kernel-{pid}-*.json")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(flight.glob(f"kernel-{pid}-*.json")), "the kernel wrote no capsule"
        served = [m for m in server.metrics() if m.startswith("nbmem_kernel_deaths_total")]
        assert len(served) == 8 and all(m.endswith("} 0.0") for m in served), served  # every reason, at 0
        time.sleep(1.5)  # the extension registers with a kernel's restarter within a second of its start
        os.kill(pid, signal.SIGKILL)
        counted: list[str] = []
        while not counted and time.monotonic() < deadline + 20:
            counted = [m for m in server.metrics() if m.startswith("nbmem_kernel_deaths_total")
                       and not m.endswith("} 0.0")]
            time.sleep(0.2)
        assert counted == ['nbmem_kernel_deaths_total{reason="killed"} 1.0'], server.log()[-3000:]
        # The restarter started a new kernel for the same notebook: its %load_ext tells the story, signal and all.
        told = ""
        while "previous kernel" not in told and time.monotonic() < deadline + 40:
            try:
                told = server.execute(kernel, "%load_ext nbmem\nimport nbmem; print(nbmem.last_death())")
            except Exception:  # the new kernel may still be starting
                time.sleep(0.5)
        assert f"the previous kernel of {tmp_path / 'dies.ipynb'} died after " in told, told
        assert "Likely cause: it was killed with SIGKILL (signal 9)" in told, told
