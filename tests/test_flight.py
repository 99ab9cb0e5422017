"""The flight recorder's capsule and the story a restarted kernel tells from it (real kernels: test_flight_kernels)."""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import nbmem
from nbmem.ipython.root import root_of, session_of
from nbmem.measure.limits import Cgroup
from nbmem.recorder.deaths import Death, cause_of, explain, pressure_note
from nbmem.recorder.flight import (
    FORMAT,
    STALE_S,
    FlightRecorder,
    Identity,
    claims,
    connection_file,
    error_text,
    first_line,
    flight_dir,
    kernel_id,
    parent_process,
    take_dead,
    usable_dir,
)
from nbmem.records import Finding, HolderKind, Holders, MemoryLimit, Sample, Tick
from tests.conftest import ok, run
from tests.test_limits import v1_layout

GiB = 2**30
MiB = 2**20


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def tick(t: float, rss: int, *, limit: int | None = 4 * GiB, used: int | None = None, oom_kills: int | None = 0,
         gpus: int = 1) -> Tick:
    lim = MemoryLimit(limit, used if used is not None else rss, oom_kills, "cgroup v1 memory.limit_in_bytes",
                      "/sys/fs/cgroup/memory/x", host_total_bytes=64 * GiB)
    cpu = Sample(t, "cpu", None, None, None, None, None, None, None, None, rss,
                 limit if limit else 64 * GiB, used if used is not None else rss, memory_limit=lim)
    gs = [Sample(t, f"cuda:{i}", 1 * GiB + i, 2 * GiB, None, None, 3 * GiB, 80 * GiB, 2 * GiB + 5, 0, rss)
          for i in range(gpus)]
    return Tick((cpu, *gs))


def recorder(tmp_path: Path, clock: Clock, **kw: object) -> FlightRecorder:
    rec = FlightRecorder(tmp_path / "flight", pid=4242, started=clock.t - 100, notebook="work/a.ipynb", kernel="k1",
                         clock=clock, **kw)  # type: ignore[arg-type]
    rec.start()
    return rec


def dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(p.stdout)


# -- the capsule ----------------------------------------------------------------------------------------------
def test_the_capsule_is_private_atomic_and_written_at_most_every_two_seconds(tmp_path: Path) -> None:
    clock = Clock()
    rec = recorder(tmp_path, clock)
    for i in range(20):  # ten seconds of half-second ticks
        clock.t += 0.5
        rec.listen(tick(clock.t, (1 + i) * 100 * MiB))
    assert rec.writes == 5  # the first tick, then every 2 s
    assert stat.S_IMODE(rec.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(rec.directory.stat().st_mode) == 0o700
    assert [p.name for p in rec.directory.iterdir()] == [rec.name]  # no temporary file left behind
    c = json.loads(rec.path.read_bytes())
    assert c["format"] == FORMAT and (c["pid"], c["notebook"], c["kernel_id"]) == (4242, "work/a.ipynb", "k1")
    assert c["samples"]["rss"][-1] == 17 * 100 * MiB  # as of the last write (tick 17)
    assert c["samples"]["gpus"]["cuda:0"]["allocated"][-1] == GiB and c["limit"]["bytes"] == 4 * GiB
    rec.running(7, "\n\n  x = load('big.pt')  \ny = 2\n")
    clock.t += 0.5
    rec.listen(tick(clock.t, 2 * GiB))  # a new cell is written at the next tick, not 2 s later
    c = json.loads(rec.path.read_bytes())
    assert c["cell"]["number"] == 7 and c["cell"]["first_line"] == "x = load('big.pt')"
    rec.close()
    assert not rec.path.exists()
    clock.t += 5
    rec.listen(tick(clock.t, GiB))
    assert not rec.path.exists()  # nothing is written after the clean end


def test_the_capsule_keeps_two_minutes_and_stays_under_its_bound(tmp_path: Path) -> None:
    clock = Clock()
    rec = recorder(tmp_path, clock, max_bytes=16 * 1024)
    for _ in range(600):  # five minutes, eight GPUs
        clock.t += 0.5
        rec.listen(tick(clock.t, GiB, gpus=8))
    t = json.loads(rec.path.read_bytes())["samples"]["t"]
    assert rec.path.stat().st_size <= 16 * 1024 and rec.last_bytes <= 16 * 1024
    assert t[-1] - t[0] <= 120.0 and t[-1] >= clock.t - 2.0
    assert len(t) < 240  # thinned to fit
    full = FlightRecorder(tmp_path / "f2", pid=1, started=0.0, notebook="", kernel="", clock=clock)
    full.start()
    for _ in range(600):
        clock.t += 0.5
        full.listen(tick(clock.t, GiB, gpus=8))
    assert len(json.loads(full.path.read_bytes())["samples"]["t"]) == 241  # the default bound keeps them all
    assert full.last_bytes <= 256 * 1024
    full.close()
    rec.close()


def test_only_the_type_of_an_ordinary_error_is_kept_and_cuda_errors_in_full() -> None:
    assert error_text(ValueError("secret 3.14159")) == ("ValueError", False)
    text, cuda = error_text(RuntimeError("CUDA error: device-side assert triggered"))
    assert cuda and text == "RuntimeError: CUDA error: device-side assert triggered"
    assert error_text(None) == ("", False)
    assert first_line("x" * 500).endswith("…") and len(first_line("x" * 500)) == 160


def test_kernel_id_and_where_capsules_live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernel_id(["ipykernel_launcher.py", "-f", "/run/user/1/jupyter/kernel-3f2a-bb.json"]) == "3f2a-bb"
    assert kernel_id(["pytest"]) == ""
    assert flight_dir({"JUPYTER_RUNTIME_DIR": str(tmp_path)}) == tmp_path / "nbmem-flight"
    blocked = tmp_path / "file"
    blocked.write_text("")  # a runtime dir that cannot be made: the cache takes it
    assert usable_dir([blocked / "nbmem-flight", tmp_path / "cache"]) == tmp_path / "cache"
    with pytest.raises(OSError, match="no directory for the flight recorder's capsule"):
        usable_dir([blocked / "a"])


# -- which capsule is told ------------------------------------------------------------------------------------
def capsule_file(d: Path, *, pid: int, notebook: str = "work/a.ipynb", kernel: str = "k1", written: float | None = None,
                 started: float = 1.0) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    c = {"format": FORMAT, "pid": pid, "started": started, "kernel_id": kernel, "notebook": notebook,
         "written": time.time() if written is None else written, "cell": {"number": 3, "first_line": "x = 1",
                                                                            "started": 0.0},
         "samples": {"t": [1.0, 2.0], "rss": [GiB, 2 * GiB], "used": [GiB, 2 * GiB], "total": [64 * GiB] * 2}}
    p = d / f"kernel-{pid}-{int(started)}.json"
    p.write_text(json.dumps(c))
    return p


def test_a_dead_kernels_capsule_is_taken_once_and_only_by_its_notebook(tmp_path: Path) -> None:
    d = tmp_path / "flight"
    pid = dead_pid()
    mine = capsule_file(d, pid=pid)
    other = capsule_file(d, pid=pid + 100_000, notebook="work/b.ipynb", kernel="k2")
    alive = capsule_file(d, pid=os.getpid(), started=__import__("psutil").Process().create_time())
    assert take_dead(d, notebook="work/c.ipynb", kernel="k9") is None  # another notebook: nothing
    got = take_dead(d, notebook="work/a.ipynb", kernel="zz")
    assert got is not None and got["pid"] == pid and not mine.exists()
    assert take_dead(d, notebook="work/a.ipynb", kernel="zz") is None  # told once
    assert other.exists() and alive.exists()
    # Without a notebook path the kernel id (kept across a restart) decides; with neither, nothing is anyone's.
    assert take_dead(d, notebook="", kernel="k2") is not None and not other.exists()
    capsule_file(d, pid=pid, notebook="", kernel="")
    assert take_dead(d, notebook="", kernel="") is None
    # A capsule of a live process is never a death, even of this notebook.
    assert take_dead(d, notebook="work/a.ipynb", kernel="k1") is None and alive.exists()


def test_stale_capsules_nobody_claims_are_removed(tmp_path: Path) -> None:
    d = tmp_path / "flight"
    old = capsule_file(d, pid=dead_pid(), notebook="gone.ipynb", written=time.time() - 30 * 24 * 3600)
    assert take_dead(d, notebook="a.ipynb", kernel="") is None and not old.exists()
    assert STALE_S == 7 * 24 * 3600  # the README says 7 days
    now = time.time()
    week = capsule_file(d, pid=dead_pid(), notebook="", kernel="", written=now - STALE_S + 3600)
    me = __import__("psutil").Process()
    live = capsule_file(d, pid=me.pid, notebook="", kernel="", started=me.create_time(), written=now - 100 * 86400)
    other_format = d / f"kernel-{dead_pid()}-5.json"
    other_format.write_text(json.dumps({"format": "nbmem-flight/9"}))
    torn, fresh_tmp = d / ".tmp-x1.json", d / ".tmp-x2.json"
    torn.write_text("{")
    fresh_tmp.write_text("{")
    for p in (other_format, torn):
        os.utime(p, (now - STALE_S - 60, now - STALE_S - 60))
    assert take_dead(d, notebook="", kernel="", connection="/tmp/x.json") is None
    assert week.exists() and live.exists() and fresh_tmp.exists()  # under 7 days, or a live process's
    assert not other_format.exists() and not torn.exists()
    assert take_dead(d, notebook="", kernel="", now=now + 2 * 3600) is None
    assert not week.exists() and live.exists()


def test_a_kernel_without_a_server_is_known_by_its_connection_file_and_parent() -> None:
    argv = ["/usr/bin/python", "-m", "ipykernel_launcher", "-f", "/tmp/tmpab12.json"]
    assert connection_file(argv) == "/tmp/tmpab12.json" and kernel_id(argv) == ""
    assert connection_file(["x", "--f=/tmp/a.json"]) == "/tmp/a.json"
    assert connection_file(["x", "--IPKernelApp.connection_file=/r/kernel-1.json"]) == "/r/kernel-1.json"
    assert connection_file(["pytest"]) == ""
    me = parent_process({"JPY_PARENT_PID": str(os.getpid())})
    assert me is not None and me[0] == os.getpid()
    assert parent_process({"JPY_PARENT_PID": str(dead_pid())}) is None  # the manager is gone
    mgr = (4242, 1000.0)
    kernel = Identity(connection="/tmp/tmpab12.json", parent=mgr)
    assert "its connection file, /tmp/tmpab12.json" in claims(kernel, kernel)
    assert claims(kernel, Identity(connection="/tmp/other.json", parent=mgr)) == ""
    assert claims(kernel, Identity(connection="/tmp/tmpab12.json", parent=(4242, 5000.0))) == ""  # a PID reused
    assert claims(kernel, Identity(connection="/tmp/tmpab12.json")) != ""  # the parent unknown: the file decides
    # A notebook path or kernel id, where both know one, decides before the file does.
    assert claims(Identity("a.ipynb", connection="/f.json"), Identity("b.ipynb", connection="/f.json")) == ""
    assert claims(Identity(kernel="k1", connection="/f.json"), Identity(kernel="k2", connection="/f.json")) == ""
    # Known by nothing else (a terminal IPython): the same parent process; with no parent, no one's.
    bare = Identity(parent=mgr)
    assert "its parent process (PID 4242)" in claims(bare, bare) and claims(bare, Identity(parent=(1, 2.0))) == ""
    assert claims(Identity(), Identity()) == "" and Identity().why_unclaimable()
    assert claims(bare, kernel) == "" and claims(kernel, bare) == ""


def test_the_story_names_the_holders_of_host_memory_and_how_it_was_matched(tmp_path: Path) -> None:
    big = [bytearray(2 * MiB) for _ in range(20)]
    reads: list[float] = []
    clock = Clock()

    def roots() -> list[tuple[str, object]]:
        reads.append(clock.t)
        return [("big", big), ("n", 3)]

    rec = FlightRecorder(tmp_path / "flight", pid=4242, started=clock.t - 100, notebook="", kernel="",
                         connection="/tmp/tmpab12.json", parent=(77, 5.0), roots=roots, clock=clock)
    rec.start()
    rec.running(4, "big = [bytearray(2 * MiB) for _ in range(20)]")
    for _ in range(50):  # 25 s of a running cell: read at the first tick, then every 10 s
        clock.t += 0.5
        rec.listen(tick(clock.t, GiB))
    assert [r - reads[0] for r in reads] == [0.0, 10.0, 20.0]
    rec.running(None)
    clock.t += 0.5
    rec.listen(tick(clock.t, GiB))  # the cell ended: read again at the next tick
    clock.t += 0.5
    rec.listen(tick(clock.t, GiB))
    assert len(reads) == 4
    c = json.loads(rec.path.read_bytes())
    assert c["connection_file"] == "/tmp/tmpab12.json" and c["parent"] == {"pid": 77, "started": 5.0}
    assert c["unclaimable"] == ""
    nobody = FlightRecorder(tmp_path / "f2", pid=1, started=0.0, notebook="", kernel="", connection="", parent=None)
    assert nobody.capsule()["unclaimable"].startswith("it had no notebook path, Jupyter kernel id, connection file")
    assert [h["name"] for h in c["host"]["holders"]] == ["big"] and c["host"]["holders"][0]["bytes"] > 40 * MiB
    text = str(explain({**c, "claimed_by": claims(Identity(connection="/tmp/tmpab12.json", parent=(77, 5.0)),
                                                  Identity(connection="/tmp/tmpab12.json", parent=(77, 5.0)))}))
    assert "nbmem: the previous kernel died after" in text
    assert "It is this notebook's previous kernel by its connection file, /tmp/tmpab12.json, " in text
    assert "Host memory its names held: big (list of 20 bytearray, 40.0 MiB)." in text
    cut = {**c, "host": {**c["host"], "holders": [{**c["host"]["holders"][0], "partial": True}],
                         "reason": "the scan's budget (50 ms) ran out with 1 of 2 names read in part or not at all"}}
    assert "big (list of 20 bytearray, at least 40.0 MiB). Not every name was read: the scan's budget" in str(
        explain(cut))
    assert "previous kernel by" not in str(explain({**c, "claimed_by": "notebook"}))
    rec.close()


# -- the story ------------------------------------------------------------------------------------------------
def growing(rec: FlightRecorder, clock: Clock, *, to: int, limit: int | None = 4 * GiB, kills: int = 0) -> None:
    for i in range(41):  # twenty seconds of growth to `to`
        clock.t += 0.5
        rec.listen(tick(clock.t, int(to * (0.3 + 0.7 * i / 40)), limit=limit, oom_kills=kills))
    rec.write()


def test_the_story_of_a_kernel_killed_at_its_limit(tmp_path: Path) -> None:
    clock = Clock()
    rec = recorder(tmp_path, clock)
    rec.listen(Holders((Finding(5, "ckpt", ("ckpt",), HolderKind.NAMESPACE, "cpu", 2 * GiB),)))
    rec.running(5, "state = torch.load('ckpt.pt', map_location='cpu')\nmodel.load_state_dict(state)")
    growing(rec, clock, to=int(3.96 * GiB))
    c = json.loads(rec.path.read_bytes())
    d = explain(c, oom_kills_now=None)
    assert isinstance(d, Death) and d.cause == "limit" and d.cell == 5
    assert d.first_line == "state = torch.load('ckpt.pt', map_location='cpu')"
    assert d.rss_bytes == int(3.96 * GiB) and d.total_bytes == 4 * GiB and d.limit_source
    assert d.growth_bytes == int(3.96 * GiB) - int(int(3.96 * GiB) * (0.3 + 0.7 * 0 / 40)) and d.growth_s == 20.0
    text = str(d)
    assert "host RSS 3.96 GiB of a 4.00 GiB container limit, +2.77 GiB in the last 20.00 s" in text
    assert "It was running cell [5]: state = torch.load(" in text and "ckpt (namespace, cpu) 2.00 GiB" in text
    assert "cuda:0 allocated 1.00 GiB, reserved 2.00 GiB" in text
    assert "<div" in d._repr_html_() and "cell [5]" in d._repr_html_()
    # The cgroup's OOM-kill count rising after the last sample is surer still.
    assert explain(c, oom_kills_now=1).cause == "oom-kill"
    assert "rose from 0 to 1" in explain(c, oom_kills_now=1).cause_text
    rec.close()


def test_nbmem_plot_draws_a_deaths_last_samples(tmp_path: Path) -> None:
    """``nbmem.plot(nbmem.last_death())``: host memory against the limit and each GPU, over the seconds before
    the kernel died, with the running cell marked; anything else is a clear error."""
    import nbmem

    clock = Clock()
    rec = recorder(tmp_path, clock)
    rec.running(5, "state = torch.load('ckpt.pt', map_location='cpu')")
    growing(rec, clock, to=int(3.96 * GiB))
    d = explain(json.loads(rec.path.read_bytes()))
    rec.close()
    assert len(d.times) == 41 and {(dev, what) for dev, what, _ in d.series} >= {("cpu", "rss"), ("cpu", "total"),
                                                                                    ("cuda:0", "allocated")}
    fig = nbmem.plot(d)
    host, gpu = fig.axes
    assert host.get_title(loc="left") == "host memory" and gpu.get_title(loc="left") == "cuda:0"
    lines = {ln.get_label(): ln for ln in host.get_lines() if not ln.get_label().startswith("_")}
    assert max(lines["host RSS"].get_ydata()) == int(3.96 * GiB) and set(lines["the limit"].get_ydata()) == {4 * GiB}
    assert lines["host RSS"].get_xdata()[-1] == 0.0 and lines["host RSS"].get_xdata()[0] == -20.0
    assert "In [5]: state = torch.load(" in " ".join(t.get_text() for t in host.texts)
    fig.savefig(tmp_path / "death.png")
    with pytest.raises(TypeError, match="last_death"):
        nbmem.plot("a death")


def test_causes_far_from_a_limit(tmp_path: Path) -> None:
    clock = Clock()
    rec = recorder(tmp_path, clock)
    growing(rec, clock, to=GiB)
    c = json.loads(rec.path.read_bytes())
    assert cause_of(c, 0)[0] == "unknown" and cause_of(c, None)[0] == "unknown"
    rec.running(8, "y = x.cuda()")
    rec.running(None, error=RuntimeError("CUDA error: an illegal memory access was encountered"))
    growing(rec, clock, to=GiB)
    label, text = cause_of(json.loads(rec.path.read_bytes()), 0)
    assert label == "cuda-error" and "cell [8]" in text and "illegal memory access" in text
    rec.close()
    host = recorder(tmp_path / "h", Clock())
    growing(host, host._clock, to=63 * GiB, limit=None)  # type: ignore[arg-type]
    assert cause_of(json.loads(host.path.read_bytes()), None)[0] == "host-memory"
    host.close()


def test_pressure_note_says_what_grew() -> None:
    lim = MemoryLimit(4 * GiB, int(3.7 * GiB), 0, "cgroup v2 memory.max", host_total_bytes=64 * GiB)
    near = Sample(10.0, "cpu", None, None, None, None, None, None, None, None, int(3.6 * GiB), memory_limit=lim)
    f = Finding(2, "frame", ("frame",), HolderKind.NAMESPACE, "cpu", 3 * GiB)
    note = pressure_note([near], since=5.0, findings=[f], rss_delta_bytes=3 * GiB)
    assert "3.70 GiB of the 4.00 GiB container limit (92%)" in note and "RSS +3.00 GiB, `frame` 3.00 GiB" in note
    assert pressure_note([near], since=11.0) == ""  # before the cell started
    far = Sample(10.0, "cpu", None, None, None, None, None, None, None, None, GiB,
                 memory_limit=MemoryLimit(4 * GiB, GiB, 0, "x", host_total_bytes=64 * GiB))
    assert pressure_note([far], since=5.0) == ""


# -- in a real shell ------------------------------------------------------------------------------------------
SENTINEL = math.pi * 1e7


def test_the_notebooks_names_are_read_for_host_memory_in_a_real_shell(shell) -> None:
    ok(shell, "%load_ext nbmem")
    ok(shell, "import numpy as np\nblob = [bytearray(3_000_000) for _ in range(4)]\narr = np.ones(500_000)")
    rec = root_of(shell).flight
    assert rec is not None and rec.roots is not None
    rec.read_host()
    rec.write()
    held = json.loads(rec.path.read_bytes())["host"]
    named = [(h["name"], h["what"]) for h in held["holders"]]
    assert named[:2] == [("blob", "list of 4 bytearray"), ("arr", "ndarray float64 (500000,)")], named
    # After them only attributes of modules the session imported from outside site-packages (this suite's own,
    # when it runs whole), which a notebook's own modules are too: smaller, and named by their module.
    assert all("." in name for name, _ in named[2:]), named
    # The whole suite leaves many modules imported, and a busy 2-core machine can run out of the 50 ms: then the
    # capsule says so, and the notebook's own names (read first) are still all there.
    assert (held["reason"] == "" and held["names"] == held["names_total"]) or held["reason"].startswith(
        "the scan's budget"), held


def test_no_tensor_values_on_disk(shell) -> None:
    ok(shell, "%load_ext nbmem")
    ok(shell, "%cudamem on")
    ok(shell, "import math, torch\nbig = torch.full((1_000_000,), math.pi * 1e7, dtype=torch.float64)")
    ok(shell, "small = torch.full((4,), math.pi * 1e7)\nbig_out = big[:3]\nbig_out")
    rec = root_of(shell).flight
    assert rec is not None
    rec.write()
    data = rec.path.read_bytes()
    c = json.loads(data)
    assert [o["name"] for o in c["owners"]][:1] == ["big"] and c["owners"][0]["bytes"] == 8_000_000
    for needle in (repr(SENTINEL).encode(), b"31415926", struct.pack("<d", SENTINEL),
                   struct.pack("<f", SENTINEL), str(SENTINEL)[:8].encode()):
        assert needle not in data, needle


def test_unload_removes_the_capsule_and_a_crash_left_one_is_told_once(shell, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("JPY_SESSION_NAME", "/work/notebooks/train.ipynb")
    d = flight_dir()
    p = capsule_file(d, pid=dead_pid(), notebook="/work/notebooks/train.ipynb")
    other = capsule_file(d, pid=dead_pid() + 200_000, notebook="/work/notebooks/other.ipynb")
    ok(shell, "%load_ext nbmem")
    out = capsys.readouterr().out
    assert out.startswith("nbmem: the previous kernel of /work/notebooks/train.ipynb died after ")  # first
    assert "It was running cell [3]: x = 1" in out and not p.exists() and other.exists()
    death = nbmem.last_death()
    assert isinstance(death, Death) and death.cell == 3
    own = root_of(shell).flight
    assert own is not None and own.notebook == "/work/notebooks/train.ipynb"
    ok(shell, "1 + 1")
    own.write()
    assert own.path.exists()
    ok(shell, "%unload_ext nbmem")
    assert not own.path.exists()
    ok(shell, "%load_ext nbmem")
    assert "died" not in capsys.readouterr().out and nbmem.last_death() is None
    other.unlink()


def test_a_cell_near_the_limit_says_so_in_its_report(shell, tmp_path: Path) -> None:
    v1_layout(tmp_path, usage=int(3.8 * GiB), inactive=0)
    ok(shell, "%load_ext nbmem")
    ok(shell, "%cudamem on")
    s = session_of(shell)
    s.probe.host.limits = Cgroup(tmp_path, environ={})
    r = run(shell, "from nbmem.ipython.root import session_of\nxs = [bytes(2**20) for _ in range(3)]\n"
                   "session_of().sampler.sample_once()  # a tick while the cell runs")
    assert r.success
    rep = s.last_report
    assert rep is not None and any("of the 4.00 GiB container limit (95%)" in n and "what grew: RSS" in n
                                   for n in rep.notes), rep.notes


def test_the_exit_status_the_server_adds_names_the_signal_when_memory_does_not_explain(tmp_path: Path) -> None:
    from nbmem.server import death_reason

    clock = Clock()
    rec = recorder(tmp_path, clock)
    growing(rec, clock, to=GiB)  # far from the 4 GiB limit
    c = json.loads(rec.path.read_bytes())
    assert cause_of({**c, "exit": {"status": -9}}, 0)[0] == "killed"
    label, text = cause_of({**c, "exit": {"status": -11}}, 0)
    assert label == "crashed" and "SIGSEGV (signal 11)" in text
    assert cause_of({**c, "exit": {"status": 1}}, 0) == ("exited", "its process exited with status 1 (the server "
                                                                    "saw it end)")
    assert death_reason(None, -6) == "crashed" and death_reason(None, None) == "unknown"
    assert death_reason(c, -9) == "killed"
    rec.close()
    near = recorder(tmp_path / "n", Clock())
    growing(near, near._clock, to=int(3.98 * GiB))  # type: ignore[arg-type]
    assert death_reason(json.loads(near.path.read_bytes()), -9) == "limit"  # memory explains it first
    near.close()


def test_the_cell_hooks_name_user_cells_and_skip_a_cell_magics_body(tmp_path: Path) -> None:
    from types import SimpleNamespace

    rec = recorder(tmp_path, Clock())
    outer = SimpleNamespace(store_history=True, silent=False, raw_cell="%%cudamem --lines\nx = big()\n")
    body = SimpleNamespace(store_history=False, silent=False, raw_cell="x = big()\n")
    rec.pre_run_cell(outer, 12)
    rec.pre_run_cell(body, 13)
    rec.post_run_cell(SimpleNamespace(info=body, error_in_exec=None))
    assert rec.capsule()["cell"]["number"] == 12 and rec.capsule()["cell"]["first_line"] == "%%cudamem --lines"
    rec.post_run_cell(SimpleNamespace(info=outer, error_in_exec=MemoryError("x = 3.14")))
    c = rec.capsule()
    assert c["cell"] is None and c["last_error"]["error"] == "MemoryError" and c["last_error"]["cell"] == 12
    rec.pre_run_cell(object(), 14)  # no ExecutionInfo at all: not a user cell, and no error
    assert rec.capsule()["cell"] is None
    rec.close()
