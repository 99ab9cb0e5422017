"""Real kernels (jupyter_client) die with nbmem loaded; the restarted kernel's ``%load_ext nbmem`` tells how."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nbmem.measure.limits import Cgroup

pytestmark = pytest.mark.slow

jupyter_client = pytest.importorskip("jupyter_client")

GROW = "chunks = []  # grows until it is stopped\nimport time\nwhile True:\n    chunks.append(b'x' * {step})\n" \
       "    time.sleep(0.05)"
MiB = 2**20


@pytest.fixture
def kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Start kernels of this interpreter for a notebook, with capsules under a runtime dir of the test's own."""
    spec = tmp_path / "jupyter" / "kernels" / "nbmem-flight"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}", "--Nbmem.gauge=none"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "nbmem", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    started: list[Kernel] = []

    def start(notebook: str | None) -> Kernel:
        k = Kernel(tmp_path, notebook)
        started.append(k)
        return k
    yield start
    for k in started:
        k.stop()


class Kernel:
    """A kernel a ``KernelManager`` starts, as a harness or an editor does without a Jupyter server; with
    ``notebook`` None nothing names its notebook (its connection file is a temporary file)."""

    def __init__(self, tmp: Path, notebook: str | None) -> None:
        self.flight = tmp / "runtime" / "nbmem-flight"
        env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp / "runtime"))
        env.pop("JPY_SESSION_NAME", None)
        if notebook is not None:
            env["JPY_SESSION_NAME"] = notebook
        self.km = jupyter_client.KernelManager(kernel_name="nbmem-flight")
        self.km.start_kernel(env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    @property
    def pid(self) -> int:
        return int(self.km.provisioner.process.pid)

    def run(self, code: str, timeout: float = 60) -> str:
        """Run a cell and return what it showed: streams, and the text of what it displayed."""
        out: list[str] = []

        def hook(msg: dict[str, Any]) -> None:
            c = msg["content"]
            if msg["msg_type"] == "stream":
                out.append(c["text"])
            elif msg["msg_type"] in ("display_data", "execute_result"):
                out.append(c["data"].get("text/plain", "") + "\n")
            elif msg["msg_type"] == "error":
                out.append("\n".join(c["traceback"]))
        self.kc.execute_interactive(code, output_hook=hook, timeout=timeout)
        return "".join(out)

    def capsules(self) -> list[Path]:
        return sorted(self.flight.glob("kernel-*.json")) if self.flight.exists() else []

    def wait_capsule(self, ok: Any, timeout: float = 30) -> dict[str, Any]:
        """The capsule once ``ok(capsule)`` holds (the sampler thread rewrites it every 2 s)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for p in self.capsules():
                try:
                    c = json.loads(p.read_bytes())
                except (OSError, ValueError):
                    continue
                if c.get("pid") == self.pid and ok(c):
                    return dict(c)
            time.sleep(0.1)
        raise AssertionError(f"no capsule as wanted within {timeout} s: {self.capsules()}")

    def restart(self, *, now: bool) -> None:
        self.km.restart_kernel(now=now)
        self.kc.wait_for_ready(timeout=60)

    def stop(self) -> None:
        self.kc.stop_channels()
        if self.km.has_kernel:
            self.km.shutdown_kernel(now=True)


def growing_cell(c: dict[str, Any], by: int) -> bool:
    rss = [r for r in c["samples"]["rss"] if r]
    return bool(c["cell"]) and c["cell"]["first_line"].startswith("chunks = []") and rss[-1] - rss[0] >= by


def figure(text: str) -> float:
    """The "host RSS 1.23 GiB" figure of the story, in MiB."""
    m = re.search(r"host RSS ([\d.]+) (MiB|GiB)", text)
    assert m, text
    return float(m.group(1)) * (1024 if m.group(2) == "GiB" else 1)


def test_a_kernel_killed_while_a_cell_grows_is_told_after_the_restart(kernels: Any, tmp_path: Path) -> None:
    k = kernels(str(tmp_path / "train.ipynb"))
    assert "previous kernel" not in k.run("%load_ext nbmem")
    k.kc.execute(GROW.format(step=10_000_000))
    seen = k.wait_capsule(lambda c: growing_cell(c, 150 * MiB))
    # Another notebook's dead kernel left a capsule too: never told here.
    other = k.flight / "kernel-999999-1.json"
    other.write_text(json.dumps({**seen, "pid": 999_999, "started": 1.0, "notebook": "/elsewhere/b.ipynb",
                                 "kernel_id": "other"}))
    os.kill(k.pid, signal.SIGKILL)
    k.restart(now=True)
    out = k.run("%load_ext nbmem")
    assert out.startswith(f"nbmem: the previous kernel of {tmp_path / 'train.ipynb'} died after "), out
    n = seen["cell"]["number"]
    assert f"It was running cell [{n}]: chunks = []  # grows until it is stopped" in out
    assert figure(out) >= (seen["samples"]["rss"][-1] / MiB) * 0.99  # at least what it had when we looked
    assert "Likely cause: unknown" in out  # kill -9 far from any limit: nbmem does not guess
    assert "/elsewhere/b.ipynb" not in out and other.exists()
    told = k.run("import nbmem; d = nbmem.last_death(); print(d.cell, d.cause)\n"
                 "f = nbmem.plot(d); print(f.axes[0].get_title(loc='left'), len(d.times) >= 2)")
    assert told.split() == [str(n), "unknown", "host", "memory", "True"], told
    # Told once: the dead kernel's capsule is gone; this kernel's own is there.
    assert [json.loads(p.read_bytes())["pid"] for p in k.capsules() if p != other] == [k.pid]


def test_a_clean_shutdown_leaves_no_capsule_and_no_message(kernels: Any, tmp_path: Path) -> None:
    k = kernels(str(tmp_path / "clean.ipynb"))
    k.run("%load_ext nbmem")
    k.run("x = b'x' * 50_000_000")
    k.kc.execute("import time\ntime.sleep(30)")  # restarted while busy, as a runaway cell is
    k.wait_capsule(lambda c: bool(c["cell"]) and c["cell"]["first_line"] == "import time")
    k.restart(now=False)  # what Jupyter's "Restart kernel" does: a shutdown request, then a new kernel
    assert k.capsules() == []
    out = k.run("%load_ext nbmem")
    assert "previous kernel" not in out and "died" not in out
    assert k.run("import nbmem; print(nbmem.last_death())").strip() == "None"
    k.run("%unload_ext nbmem")
    assert k.capsules() == []


def child_cgroup(limit_bytes: int) -> Path:
    """A child of this process's v1 memory cgroup with a limit, or a skip that says why there is none."""
    c = Cgroup()
    if c.version != 1:
        pytest.skip(f"a child memory cgroup is made here only on cgroup v1 (this machine: {c.version or c.reason})")
    d = c.dirs[0] / f"nbmem-test-oom-{os.getpid()}"
    try:
        d.mkdir()
        (d / "memory.limit_in_bytes").write_text(str(limit_bytes))
    except OSError as e:
        if d.exists():
            d.rmdir()
        pytest.skip(f"no child memory cgroup can be made here ({e}): the SIGKILL test stands in for a real OOM")
    return d


def test_a_real_oom_kill_in_a_child_cgroup_is_named(kernels: Any, tmp_path: Path) -> None:
    cg = child_cgroup(300 * MiB)
    try:
        k = kernels(str(tmp_path / "oom.ipynb"))
        (cg / "cgroup.procs").write_text(str(k.pid))  # before nbmem loads: it reads its own cgroup then
        status = k.run("%load_ext nbmem\n%cudamem status")
        assert "of a 300 MiB container limit (cgroup v1 memory.limit_in_bytes)" in status, status
        k.kc.execute(GROW.format(step=5_000_000))
        end = time.monotonic() + 30
        while k.km.is_alive() and time.monotonic() < end:
            time.sleep(0.1)
        assert not k.km.is_alive(), "the kernel outlived its cgroup's limit"
        assert "oom_kill 1" in (cg / "memory.oom_control").read_text()  # the kernel's OOM killer did it
        k.restart(now=True)
        out = k.run("%load_ext nbmem")
        assert "Likely cause: the kernel's OOM killer ended it at the 300 MiB container limit (the cgroup's " \
               "oom_kill count rose from 0 to 1)" in out, out
        assert "of a 300 MiB container limit" in out and "It was running cell [" in out
        assert k.run("import nbmem; print(nbmem.last_death().cause)").strip() == "oom-kill"
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


HOLD = """import numpy as np, pandas as pd
big = [bytearray(10_000_000) for _ in range(12)]
arr = np.ones((2_000, 1_000))
df = pd.DataFrame({"a": np.arange(1_000_000.0), "b": np.arange(1_000_000)})"""


def test_a_kernel_without_a_server_holding_host_memory_is_told_by_its_connection_file(kernels: Any) -> None:
    """A plain jupyter_client KernelManager (no server: no notebook path, no kernel id in the connection file's
    name) restarts its kernel with the same connection file: the story is told, and names what held memory."""
    k = kernels(None)
    assert "previous kernel" not in k.run("%load_ext nbmem")
    assert k.run(HOLD) == ""
    k.kc.execute("import time\ntime.sleep(60)")
    seen = k.wait_capsule(lambda c: bool(c["cell"]) and any(h["name"] == "big" for h in (c["host"] or {}).get(
        "holders", [])))
    assert seen["notebook"] == "" and seen["kernel_id"] == "" and seen["connection_file"] == k.km.connection_file
    # Capsules no kernel claims: a dead one written 8 days ago goes, one of 6 days stays, a live one always stays.
    now = time.time()
    stray = {**seen, "connection_file": "/tmp/elsewhere.json", "parent": None}
    old = k.flight / "kernel-999998-1.json"
    old.write_text(json.dumps({**stray, "pid": 999_998, "started": 1.0, "written": now - 8 * 86400}))
    recent = k.flight / "kernel-999997-1.json"
    recent.write_text(json.dumps({**stray, "pid": 999_997, "started": 1.0, "written": now - 6 * 86400}))
    me = psutil_process()
    live = k.flight / f"kernel-{me.pid}-{int(me.create_time())}.json"
    live.write_text(json.dumps({**stray, "pid": me.pid, "started": me.create_time(), "written": now - 30 * 86400}))
    torn = k.flight / ".tmp-abc.json"
    torn.write_text("{")
    os.utime(torn, (now - 8 * 86400, now - 8 * 86400))
    os.kill(k.pid, signal.SIGKILL)
    k.restart(now=True)
    out = k.run("%load_ext nbmem")
    assert out.startswith("nbmem: the previous kernel died after "), out
    assert f"It is this notebook's previous kernel by its connection file, {k.km.connection_file}," in out
    host = next(line for line in out.splitlines() if line.startswith("Host memory its names held: "))
    assert host.startswith("Host memory its names held: big (list of 12 bytearray, 114 MiB); "), host
    assert "df (DataFrame 1,000,000 × 2, 15.3 MiB)" in host and "arr (ndarray float64 (2000, 1000), 15.3 MiB)" in host
    told = k.run("import nbmem; d = nbmem.last_death(); print([h[0] for h in d.host], d.pid)")
    assert told.split("]")[0] == "['big', 'arr', 'df'" or told.split("]")[0] == "['big', 'df', 'arr'", told
    assert not old.exists() and not torn.exists() and recent.exists() and live.exists()


def psutil_process() -> Any:
    import psutil

    return psutil.Process()
