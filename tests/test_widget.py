"""The gauge without a browser: what it publishes, how often, what a click may do, and its lifecycle.

The widget gets ipywidgets' DummyComm (no kernel); a click is ``_handle_msg`` with a custom message,
exactly as the comm delivers it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
from IPython.core.error import UsageError

from nbmem.formatting import fmt_bytes
from nbmem.ipython.root import root_of
from nbmem.measure.sources import NvmlSource, Probe, TorchSource
from nbmem.records import AllocatorReading, CellRecord, CleanupStep, Finding, HolderKind, Sample, Tick
from nbmem.reports import CellReport, CleanupReport
from nbmem.session import Session
from nbmem.ui import widget
from nbmem.ui.frontend import scan_bytes
from nbmem.ui.widget import Gauge, Publisher, history_columns, show_gauge
from tests.conftest import HAS_GPU, cpu_only, ok

GiB = 2**30
MiB = 2**20
JS = Path(__file__).resolve().parents[1] / "js"
NODE = shutil.which("node")


def click(g: Gauge, content: Any) -> None:
    """What the comm does with ``model.send(content)`` from the front end."""
    g._handle_msg({"content": {"data": {"method": "custom", "content": content}}, "buffers": []})


def request(action: str, fid: str | None = None, req: str = "v-1") -> dict[str, Any]:
    msg = {"type": "cleanup", "req": req, "action": action}
    if fid is not None:
        msg["id"] = fid
    return msg


def holder_id(g: Gauge, name: str) -> str:
    return next(h["id"] for h in g.holders if h["name"] == name)


@pytest.fixture
def gauge(ip: Any) -> Iterator[Gauge]:
    """A gauge on the loaded extension's session; no publisher thread (tests flush by hand)."""
    g = Gauge(root_of(ip).session, start=False)
    yield g
    g.close()


def publish(g: Gauge) -> None:
    """One sample, published now (history included, which is otherwise rebuilt at most once a second)."""
    g.session.sampler.sample_once()
    g._history_at = float("-inf")
    g._publisher.flush()


# -- a GPU that is not there: fake NVML and allocator, real Probe and Session ---------------------------
class FakeNvml:
    """The pynvml calls NvmlSource makes, for one 80 GiB GPU shared with another process."""

    NVML_VALUE_NOT_AVAILABLE = 2**64 - 1

    def __init__(self, per_process: bool = True, children: tuple[int, ...] = ()) -> None:
        self.per_process = per_process
        self.children = children  # PIDs of real child processes, listed with 2 GiB each

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return "GPU-00000000-fake"

    def nvmlDeviceGetName(self, h: int) -> str:
        return "Fake H100"

    def nvmlDeviceGetMemoryInfo(self, h: int, version: Any = None) -> Any:
        return SimpleNamespace(used=30 * GiB, total=80 * GiB)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        if not self.per_process:
            raise RuntimeError("Not Supported")
        return [SimpleNamespace(pid=os.getpid(), usedGpuMemory=11 * GiB),
                SimpleNamespace(pid=4242, usedGpuMemory=19 * GiB - 2 * GiB * len(self.children)),
                *(SimpleNamespace(pid=pid, usedGpuMemory=2 * GiB) for pid in self.children)]


class FakeAllocator(TorchSource):
    def cuda_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def read(self, index: int) -> AllocatorReading:
        return AllocatorReading(8 * GiB, 10 * GiB, 8 * GiB, 0, 9 * GiB, 10 * GiB)


@pytest.fixture
def gpu_session() -> Iterator[Session]:
    with fake_gpu_session(FakeNvml()) as session:
        yield session


@contextlib.contextmanager
def fake_gpu_session(nvml: FakeNvml) -> Iterator[Session]:
    """A session over a fake NVML and allocator (a GPU this machine does not have), closed afterwards."""
    session = Session(adapter=None, probe=Probe(nvml=NvmlSource(nvml=nvml, environ={}), torch=FakeAllocator()))
    session.probe.start()
    try:
        yield session
    finally:
        session.close()


def columns(g: Gauge, device: str) -> dict[str, Any]:
    snap = g.snapshot
    i = snap["device"].index(device)
    return {k: v[i] for k, v in snap.items() if isinstance(v, list)}


# -- the front end ---------------------------------------------------------------------------------
def test_the_widget_gets_one_module_with_no_relative_imports() -> None:
    esm = str(Gauge._esm)
    assert "export default" in esm
    assert not re.search(r"^\s*import\s", esm, re.M), "anywidget cannot resolve imports of sibling files"
    assert esm.index("function fmtBytes") < esm.index("function segments") < esm.index("export default")


def test_the_front_end_never_writes_a_trait() -> None:
    src = (JS / "gauge.js").read_text()
    assert "model.set(" not in src and "save_changes" not in src
    assert "innerHTML" not in src and "insertAdjacentHTML" not in src and "outerHTML" not in src


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_the_bundle_loads_as_an_es_module(tmp_path: Path) -> None:
    f = tmp_path / "gauge.mjs"
    f.write_text(str(Gauge._esm))
    out = subprocess.run([str(NODE), "--input-type=module", "-e",
                          f"const m = await import({json.dumps(f.as_uri())}); console.log(typeof m.default.render)"],
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "function", out.stderr


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_js_formatting_prints_what_fmt_bytes_prints() -> None:
    rnd = random.Random(4)
    values: list[int | float | None] = [None, 0, 1, 1023, 1024, 1152, 10239, 2**53 - 1, 2**60]
    values += [rnd.randrange(0, 2**k) for k in range(1, 56) for _ in range(12)]
    values += [-v for v in values[1:40] if v]
    values += [rnd.uniform(0, 2**40) for _ in range(50)]
    script = (f"import {{ fmtBytes }} from {json.dumps((JS / 'format.js').as_uri())};"
              f"const vs = {json.dumps(values)};"
              "console.log(JSON.stringify(vs.flatMap(v => [fmtBytes(v), fmtBytes(v, {signed: true})])))")
    out = subprocess.run([str(NODE), "--input-type=module", "-e", script], capture_output=True, text=True, timeout=30)
    js = json.loads(out.stdout)
    py = [s for v in values for s in (fmt_bytes(v), fmt_bytes(v, signed=True))]
    assert js == py


# -- what it publishes -------------------------------------------------------------------------------
@cpu_only
def test_cpu_only_layout_says_why_there_is_no_gpu(ip: Any, gauge: Gauge) -> None:
    ok(ip, "x = torch.zeros(2**20)")
    publish(gauge)
    cpu = columns(gauge, "cpu")
    assert gauge.snapshot["device"] == ["cpu"]
    assert cpu["process"] > 0 and cpu["total"] > cpu["used"] > 0
    assert cpu["tensors"] >= 4 * MiB
    assert cpu["allocated"] is None and cpu["reserved"] is None and cpu["others"] is None
    assert cpu["peak"] >= cpu["process"]
    assert gauge.note.startswith("no GPU seen: ")
    assert gauge.note[len("no GPU seen: "):].strip()
    assert gauge.processes == {}
    assert gauge.history["main"]["cpu"][-1] == cpu["process"]


def test_gpu_layout_from_fake_samples(gpu_session: Session) -> None:
    g = Gauge(gpu_session, start=False)
    try:
        publish(g)
        gpu = columns(g, "cuda:0")
        assert gpu == {"device": "cuda:0", "model": "Fake H100", "allocated": 8 * GiB, "reserved": 10 * GiB,
                       "process": 11 * GiB, "others": 19 * GiB, "used": 30 * GiB, "total": 80 * GiB,
                       "tensors": None, "paged": None, "peak": 9 * GiB, "children": 0, "limit": None,
                       "near_limit": None}, "no holder scan has run: paged memory is unknown, not 0"
        assert g.children == {"cuda:0": []}
        assert [p["pid"] for p in g.processes["cuda:0"]] == [4242], "this process is not 'another process'"
        assert g.processes["cuda:0"][0]["bytes"] == 19 * GiB
        assert g.note == ""
        assert g.history["main"]["cuda:0"][-1] == 8 * GiB
        assert g.history["aux"]["cuda:0"][-1] == 10 * GiB
    finally:
        g.close()


PAGED_CELL = """
def paged(n, gpu):  # bitsandbytes.functional.get_paged's marks (is_paged, page_deviceid), over plain memory
    t = torch.zeros(n, dtype=torch.uint8)
    t.is_paged = True
    t.page_deviceid = gpu
    return t
state = {"state1": paged(3 * 2**20, 0), "state2": paged(2**20, 0), "state3": paged(2**21, 1)}
"""


def gpu_tick(g: Gauge) -> None:
    """The session's own CPU sample with two GPUs this machine does not have, published now."""
    g.session.sampler.sample_once()
    (cpu,) = g.session.store.latest_tick()
    gpus = [Sample(cpu.t_wall, f"cuda:{i}", GiB, 2 * GiB, GiB, 0, 30 * GiB, 80 * GiB, 11 * GiB, 19 * GiB, None)
            for i in (0, 1)]
    g._on_event(Tick((cpu, *gpus)))
    g._publisher.flush()


@cpu_only
def test_each_gpus_bar_gets_the_paged_memory_the_last_scan_found_on_it(ip: Any, gauge: Gauge) -> None:
    gpu_tick(gauge)
    paged = {d: columns(gauge, d)["paged"] for d in ("cpu", "cuda:0", "cuda:1")}
    assert paged == {"cpu": None, "cuda:0": 0, "cuda:1": 0}, "scanned, and none found: 0 on each GPU"
    ok(ip, PAGED_CELL)
    gpu_tick(gauge)
    paged = {d: columns(gauge, d)["paged"] for d in ("cpu", "cuda:0", "cuda:1")}
    assert paged == {"cpu": None, "cuda:0": 4 * MiB, "cuda:1": 2 * MiB}
    assert columns(gauge, "cpu")["tensors"] < MiB, "paged memory is not counted again as CPU tensors"
    # The holder list names the same memory on the same GPUs (the records the scan made, as the gauge lists them).
    rows = {h["device"]: h["bytes"] for h in gauge.holders if h["name"] == "state"}
    assert rows == {"paged:cuda:0": 4 * MiB, "paged:cuda:1": 2 * MiB}
    ok(ip, "del state")
    gpu_tick(gauge)
    assert (columns(gauge, "cuda:0")["paged"], columns(gauge, "cuda:1")["paged"]) == (0, 0)


def test_paged_bytes_are_sent_by_gpu_and_unknown_before_a_scan() -> None:
    batch = [Sample(0.0, "cpu", None, None, None, None, None, None, None, None, GiB),
             Sample(0.0, "cuda:0", GiB, 2 * GiB, GiB, 0, 30 * GiB, 80 * GiB, 11 * GiB, 19 * GiB, None)]
    tensors, paged = scan_bytes({"cpu": 7 * MiB, "paged:cuda:0": 305 * MiB, "paged:cuda:1": MiB, "cuda:0": GiB})
    assert (tensors, paged) == (7 * MiB, {"cuda:0": 305 * MiB, "cuda:1": MiB})

    def sent(by_gpu: dict[str, int] | None) -> list[int | None]:
        cols = widget.snapshot_columns(batch, models={}, peaks={}, cpu_tensors_bytes=0, paged_bytes=by_gpu)
        return list(cols["paged"])

    assert sent(paged) == [None, 305 * MiB]
    assert scan_bytes({"cpu": 0}) == (0, {}) and sent({}) == [None, 0], "a scan that found none: 0"
    assert scan_bytes(None) == (None, None) and sent(None) == [None, None], "no scan yet: unknown"
    assert widget.snapshot_columns(batch, models={}, peaks={}, cpu_tensors_bytes=None)["paged"] == [None, None]
    # Managed memory moved to host RAM is no longer in NVML's figure for this process: the bar shows no more than
    # that figure beyond torch's reserved (2.1 GiB - 2 GiB here), and the scan's bytes where NVML has no figure.
    batch[1] = Sample(0.0, "cuda:0", GiB, 2 * GiB, GiB, 0, 30 * GiB, 80 * GiB, 2 * GiB + 100 * MiB, 19 * GiB, None)
    assert sent(paged) == [None, 100 * MiB]
    batch[1] = Sample(0.0, "cuda:0", GiB, 2 * GiB, GiB, 0, 30 * GiB, 80 * GiB, None, None, None)
    assert sent(paged) == [None, 305 * MiB]


def test_the_notebooks_child_processes_are_its_own_not_other_processes() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with fake_gpu_session(FakeNvml(children=(child.pid,))) as session:
            g = Gauge(session, start=False)
            try:
                publish(g)
                gpu = columns(g, "cuda:0")
                assert (gpu["process"], gpu["children"], gpu["others"]) == (11 * GiB, 2 * GiB, 17 * GiB)
                assert [p["pid"] for p in g.processes["cuda:0"]] == [4242]
                (kid,) = g.children["cuda:0"]
                assert (kid["pid"], kid["bytes"]) == (child.pid, 2 * GiB) and "time.sleep(60)" in kid["command"]
            finally:
                g.close()
    finally:
        child.kill()
        child.wait()


def test_unknown_numbers_are_sent_as_null_never_zero() -> None:
    with fake_gpu_session(FakeNvml(per_process=False)) as session:
        g = Gauge(session, start=False)
        try:
            publish(g)
            gpu = columns(g, "cuda:0")
            assert gpu["process"] is None and gpu["others"] is None
            assert '"process": [' in json.dumps(g.snapshot) and "null" in json.dumps(g.snapshot["others"])
            assert g.note.startswith("per-process numbers unknown: NVML cannot list processes")
        finally:
            g.close()


def test_history_keeps_each_buckets_peak_and_unknowns() -> None:
    now = 1000.0

    def s(t: float, dev: str, v: int | None) -> Sample:
        return Sample(t, dev, v, v, None, None, None, None, None, None, 7)

    samples = [s(600.0, "cuda:0", 5), s(995.0, "cuda:0", None), s(996.5, "cuda:0", 1), s(997.9, "cuda:0", 9),
               s(998.5, "cuda:0", 3), s(999.9, "cuda:0", None)]
    h = history_columns(samples, now, window_s=300, buckets=150)
    assert h["t0"] == now and h["window"] == 300
    assert h["t"] == [-5.0, -2.1, -0.1], "one point per 2 s bucket, at its newest sample; 600 s is too old"
    assert h["main"]["cuda:0"] == [None, 9, 3], "a bucket's peak survives; unknown stays unknown"
    assert h["aux"]["cuda:0"] == [None, 9, 3]
    assert "cpu" not in h["aux"]


@cpu_only
def test_a_monitored_cell_publishes_its_numbers_and_holders(ip: Any, gauge: Gauge) -> None:
    ok(ip, "y = torch.zeros(2 * 2**20 // 4)")
    n = ip.execution_count - 1
    gauge._publisher.flush()
    assert gauge.last_cell["cell"] == n
    row = gauge.last_cell["rows"][0]
    assert row["device"] == "cpu" and row["what"] == "CPU tensors" and row["delta"] == 2 * MiB
    y = next(h for h in gauge.holders if h["name"] == "y")
    assert y["bytes"] == 2 * MiB and y["roots"] == ["y"] and y["kind"] == "namespace"
    assert y["to_cpu"] is False, "a CPU tensor has nowhere to move"
    assert n in [c["cell"] for c in gauge.cells]


def test_holder_names_are_passed_on_as_data(ip: Any, gauge: Gauge) -> None:
    ok(ip, "d = {'<img src=x onerror=alert(1)>': torch.zeros(2**20)}")
    gauge._publisher.flush()
    (row,) = [h for h in gauge.holders if h["name"] == "d"]
    assert [m["name"] for m in row["members"]] == ["d['<img src=x onerror=alert(1)>']"]


# -- clicks ----------------------------------------------------------------------------------------
def test_del_on_a_listed_holder_frees_it(ip: Any, gauge: Gauge) -> None:
    ok(ip, "x = torch.zeros(2**20)")
    gauge._publisher.flush()
    click(gauge, request("del", holder_id(gauge, "x")))
    gauge._publisher.flush()
    assert "x" not in ip.user_ns
    freed_reserved = gauge.action.pop("freed_reserved")
    assert gauge.action == {"req": "v-1", "label": "del x", "ok": True, "freed": 4 * MiB}
    assert freed_reserved is None or HAS_GPU  # no caching allocator on the CPU: unknown, not 0
    assert "x" not in [h["name"] for h in gauge.holders]


def test_a_click_that_arrives_on_another_thread_waits_for_the_cell(ip: Any, gauge: Gauge) -> None:
    """JupyterLab may deliver comm messages on a subshell thread, beside the running cell: no cleanup there."""
    ok(ip, "x = torch.zeros(2**20)")
    gauge._publisher.flush()
    t = threading.Thread(target=click, args=(gauge, request("del", holder_id(gauge, "x"))))
    t.start()
    t.join()
    gauge._publisher.flush()
    assert "x" in ip.user_ns
    assert gauge.action["ok"] is False and "running a cell" in gauge.action["error"]
    click(gauge, request("del", holder_id(gauge, "x")))  # the same click on the kernel's own thread
    assert "x" not in ip.user_ns


def test_clear_outputs_frees_what_out_kept(ip: Any, gauge: Gauge) -> None:
    ok(ip, "torch.ones(2**20)")
    gauge._publisher.flush()
    assert any(h["kind"] == "output" for h in gauge.holders)
    click(gauge, request("outputs"))
    gauge._publisher.flush()
    assert gauge.action["ok"] and gauge.action["label"] == "clear outputs"
    assert gauge.action["freed"] == 4 * MiB
    assert not any(h["kind"] == "output" for h in gauge.holders)


def test_gc_and_traceback_buttons_run(ip: Any, gauge: Gauge) -> None:
    click(gauge, request("gc", req="v-2"))
    gauge._publisher.flush()
    assert gauge.action["req"] == "v-2" and gauge.action["ok"] and gauge.action["label"] == "gc + empty cache"
    click(gauge, request("traceback", req="v-3"))
    gauge._publisher.flush()
    assert gauge.action["req"] == "v-3" and gauge.action["ok"]


@pytest.mark.parametrize("content", [
    "del x",
    ["cleanup"],
    {"type": "eval", "code": "import os"},
    {"type": "cleanup", "req": "v-1", "action": "exec", "id": "x"},
    {"type": "cleanup", "req": "v-1", "action": "del"},
    {"type": "cleanup", "req": "v-1", "action": "del", "id": "cpu:dead"},
    {"type": "cleanup", "req": "v-1", "action": "del", "id": ["cpu:1"]},
    {"type": "cleanup", "req": "v-1", "action": "del", "id": "x", "names": ["x"]},
    {"type": "cleanup", "req": "r" * 10_000, "action": "to_cpu", "id": "cpu:dead"},
])
def test_anything_but_a_request_on_a_listed_finding_is_refused(ip: Any, gauge: Gauge, content: Any) -> None:
    ok(ip, "x = torch.zeros(2**20)")
    click(gauge, content)
    gauge._publisher.flush()
    assert "x" in ip.user_ns
    assert len(gauge.refused) == 1
    assert gauge.action["ok"] is False and gauge.action["error"].startswith("refused: ")
    assert len(gauge.action["req"]) <= 64
    assert not gauge.session.faults


def test_buttons_that_do_not_apply_are_refused_too(ip: Any, gauge: Gauge) -> None:
    ok(ip, "x = torch.zeros(2**20)")
    ok(ip, "torch.ones(2**20)")
    gauge._publisher.flush()
    out = next(h["id"] for h in gauge.holders if h["kind"] == "output")
    click(gauge, request("del", out))  # an output has no name to delete
    click(gauge, request("to_cpu", holder_id(gauge, "x")))  # already on the CPU
    assert len(gauge.refused) == 2
    assert "x" in ip.user_ns and ip.user_ns["Out"]


def test_a_name_gone_since_the_scan_is_an_error_shown_not_raised(ip: Any, gauge: Gauge) -> None:
    ok(ip, "x = torch.zeros(2**20)")
    gauge._publisher.flush()
    fid = holder_id(gauge, "x")
    del ip.user_ns["x"]  # behind the scan's back
    click(gauge, request("del", fid))
    gauge._publisher.flush()
    assert gauge.action["ok"] is False and "no variable named 'x'" in gauge.action["error"]
    assert not gauge.session.faults


def test_to_cpu_applies_to_a_top_level_name_on_a_gpu() -> None:
    def f(name: str, device: str, roots: tuple[str, ...]) -> Finding:
        return Finding(1, name, (name,), HolderKind.NAMESPACE, device, GiB, roots=roots, id="id")

    assert widget.can_move_to_cpu(f("w", "cuda:0", ("w",)))
    assert not widget.can_move_to_cpu(f("w", "cpu", ("w",)))
    assert not widget.can_move_to_cpu(f("d['k']", "cuda:0", ("d",)))


def test_freed_bytes_are_na_when_no_step_measured_them() -> None:
    rep = CleanupReport((CleanupStep("gc.collect()", "", None, None), CleanupStep("del", "x", 5, None)))
    assert widget.freed(rep) == (5, None)
    assert widget.freed(CleanupReport(())) == (None, None)


# -- the publisher ---------------------------------------------------------------------------------
def test_updates_are_throttled_and_batched(ip: Any) -> None:
    g = Gauge(root_of(ip).session)
    sent: list[dict[str, Any]] = []
    real_send = g._send
    g._send = lambda msg, buffers=None: (sent.append(msg), real_send(msg, buffers))  # type: ignore[method-assign]
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:
            g.session.sampler.sample_once()  # far faster than the real 2 Hz
            time.sleep(0.005)
        time.sleep(0.3)
    finally:
        g.close()
    updates = [m for m in sent if m.get("method") == "update"]
    assert 3 <= len(updates) <= 1.5 * widget.MAX_UPDATES_PER_S + 2
    assert len(updates) <= g._publisher.flushes - 1, "one message per flush (the first flush was in __init__)"
    assert any({"snapshot", "history"} <= set(m["state"]) for m in updates), "traits go out batched"


def test_publisher_waits_out_its_interval() -> None:
    written: list[float] = []

    class W:
        class _Hold:
            def __enter__(self) -> None:
                pass

            def __exit__(self, *a: object) -> None:
                written.append(time.monotonic())

        def hold_sync(self) -> Any:
            return self._Hold()

    p = Publisher(W(), build=lambda: {"x": 1}, rate_hz=10)
    p.start()
    try:
        for _ in range(40):
            p.poke()
            time.sleep(0.01)
        time.sleep(0.2)
    finally:
        p.stop()
    assert 3 <= len(written) <= 7
    assert all(b - a >= 0.09 for a, b in itertools.pairwise(written))


def test_a_failing_build_is_recorded_and_the_gauge_goes_on(ip: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    g = Gauge(root_of(ip).session)
    try:
        def broken(*args: Any, **kwargs: Any) -> dict[str, Any]:
            raise OSError("no /proc here")

        monkeypatch.setattr(widget, "snapshot_columns", broken)
        g.session.sampler.sample_once()
        deadline = time.monotonic() + 3
        while not g.session.faults and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [f.where for f in g.session.faults] == ["gauge"]
        monkeypatch.undo()
        before = g._publisher.flushes
        g.session.sampler.sample_once()
        deadline = time.monotonic() + 3
        while g._publisher.flushes == before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert g._publisher.flushes > before
    finally:
        g.close()


# -- lifecycle and placement ---------------------------------------------------------------------------
def test_close_takes_back_everything_it_added(ip: Any) -> None:
    session = root_of(ip).session
    before = session.subscribers
    g = Gauge(session)
    closed: list[bool] = []
    g.sidecar = SimpleNamespace(close=lambda: closed.append(True))
    assert session.subscribers == before + 1
    g.close()
    g.close()
    assert session.subscribers == before
    assert closed == [True]
    assert g.comm is None
    assert not [t for t in threading.enumerate() if t.name == widget.THREAD_NAME]


@pytest.fixture
def kernel_like(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Pretend the shell is a kernel's; collect what would be displayed."""
    shown: list[Any] = []
    monkeypatch.setattr(widget, "in_kernel", lambda shell: True)
    monkeypatch.setattr("nbmem.ipython.root.in_kernel", lambda shell: True)
    monkeypatch.setattr("IPython.display.display", lambda *objs, **kw: shown.extend(objs))
    monkeypatch.delenv("VSCODE_PID", raising=False)
    monkeypatch.delenv("VSCODE_CWD", raising=False)
    return shown


def shown_in(sidecar: Any) -> list[str]:
    """The widget models a sidecar panel shows."""
    return [o["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] for o in sidecar.outputs]


def test_sidebar_then_inline_then_unload(ip: Any, kernel_like: list[Any]) -> None:
    from sidecar import Sidecar

    ip.run_line_magic("cudamem", "gauge --sidebar")
    m = root_of(ip)
    first = m.gauge
    assert isinstance(first, Gauge) and isinstance(first.sidecar, Sidecar) and first.sidecar.title == "nbmem"
    assert shown_in(first.sidecar) == [first.model_id] and first.placement == "sidebar"
    assert kernel_like == [], "nothing under the cell"
    sidecar = first.sidecar
    ip.run_line_magic("cudamem", "gauge --inline")
    second = m.gauge
    assert second is not first and second.sidecar is None and kernel_like == [second]
    assert first.comm is None and sidecar.comm is None, "the previous gauge and its panel are closed"
    assert m.session.subscribers == 2, "only the second gauge listens (beside the flight recorder)"
    ip.run_line_magic("unload_ext", "nbmem")
    assert second.comm is None
    assert not [t for t in threading.enumerate() if t.name == widget.THREAD_NAME]


def test_auto_is_shown_under_the_cell_and_a_jupyterlab_page_makes_its_own_sidebar_panel(
        ip: Any, kernel_like: list[Any]) -> None:
    # The kernel cannot tell JupyterLab from Notebook 7: the gauge shows once, under the cell. A JupyterLab page
    # makes its own sidebar panel for it at once (js/panel.js), because a request to the kernel would wait behind
    # every queued cell; the kernel hears of it later ("placed"), keeps placement "auto" (a page loaded later
    # makes its panel again) and makes no sidecar of its own: never two panels.
    gauge = show_gauge(root_of(ip).session, "auto", shell=ip)
    assert gauge is not None
    try:
        assert kernel_like == [gauge] and gauge.placement == "auto" and gauge.sidecar is None
        assert gauge.gauge_id == gauge.model_id, "the page shows this very model in its panel"
        assert not gauge.in_page_sidebar
        click(gauge, {"type": "placed", "where": "sidebar"})
        click(gauge, {"type": "placed", "where": "sidebar"})  # a second page: nothing more happens
        assert gauge.in_page_sidebar and gauge.placement == "auto" and gauge.sidecar is None
        assert kernel_like == [gauge] and gauge.refused == []
    finally:
        gauge.close()


def test_a_gauge_placed_by_hand_never_moves_and_a_bad_message_is_refused(ip: Any, kernel_like: list[Any]) -> None:
    gauge = show_gauge(root_of(ip).session, "inline", shell=ip)
    assert gauge is not None
    try:
        click(gauge, {"type": "placed", "where": "sidebar"})
        assert gauge.placement == "inline" and gauge.sidecar is None and not gauge.in_page_sidebar
        click(gauge, {"type": "placed", "where": "floating"})
        assert gauge.sidecar is None and gauge.refused and "unknown place" in gauge.refused[-1]
        click(gauge, {"type": "place", "where": "sidebar"})  # the old request: the kernel no longer moves it
        assert gauge.sidecar is None and "not a request the gauge sends" in gauge.refused[-1]
    finally:
        gauge.close()


def test_auto_without_sidecar_stays_under_the_cell(ip: Any, kernel_like: list[Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sidecar", None)  # `import sidecar` fails, as where it is not installed
    monkeypatch.setattr(widget.importlib.util, "find_spec", lambda name: None)
    gauge = show_gauge(root_of(ip).session, "auto", shell=ip)
    assert gauge is not None and gauge.placement == "inline" and kernel_like == [gauge]
    gauge.close()
    with pytest.raises(UsageError, match="needs the sidecar package"):
        ip.run_line_magic("cudamem", "gauge --sidebar")


def test_auto_is_under_the_cell_in_vs_code_and_colab_and_up_to_the_page_elsewhere(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    assert widget.auto_place({}) == "auto"
    assert widget.auto_place({"VSCODE_PID": "1"}) == "inline"
    assert widget.auto_place({"VSCODE_CWD": "/x"}) == "inline"
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert widget.auto_place({}) == "inline"


def test_in_a_terminal_auto_shows_nothing_and_asking_explains(ip: Any) -> None:
    session = root_of(ip).session
    assert not widget.in_kernel(ip)
    assert show_gauge(session, "auto", shell=ip) is None
    assert session.subscribers == 1  # the flight recorder alone
    with pytest.raises(RuntimeError, match="needs a Jupyter front end"):
        show_gauge(session, "inline", shell=ip, explicit=True)
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("cudamem", "gauge")
    assert str(e.value) == ("%cudamem gauge: the gauge needs a Jupyter front end (JupyterLab, Notebook, VS Code, "
                            "Colab); in a terminal, `%cudamem status` and `%cudamem report` give the numbers.")


def test_show_gauge_closes_the_previous_one(ip: Any) -> None:
    session = root_of(ip).session
    old = Gauge(session, start=False)
    assert show_gauge(session, "auto", previous=old, shell=ip) is None
    assert old.comm is None and session.subscribers == 1  # the flight recorder alone
    with pytest.raises(ValueError, match="where must be"):
        show_gauge(session, "floating", shell=ip)


@pytest.mark.parametrize(("version", "warned"), [("7.0.0", True), ("7.0.1", True), ("7.1.0", False),
                                                 ("6.29.5", False), ("7.4.0", False)])
def test_ipykernel_7_0_is_warned_about_once(monkeypatch: pytest.MonkeyPatch, version: str, warned: bool) -> None:
    told: list[str] = []
    session = Session(adapter=None, notify=told.append)
    monkeypatch.setitem(sys.modules, "ipykernel", SimpleNamespace(__version__=version))
    widget.warn_old_ipykernel(session)
    widget.warn_old_ipykernel(session)
    assert len(told) == (1 if warned else 0)
    if warned:
        assert version in told[0] and "pip install -U ipykernel" in told[0]


def test_a_cell_report_on_a_gpu_shows_allocated_and_its_peak() -> None:
    rec = CellRecord(3, 0.0, 1.0, "cuda:0", GiB, 2 * GiB, GiB, 3 * GiB, None, "≤ 4.00 GiB (below an earlier peak)",
                     None, None, None, None, None, "")
    row = widget.last_cell_row(CellReport(3, 1.0, (rec,)))["rows"][0]
    assert row == {"device": "cuda:0", "what": "allocated", "delta": GiB, "peak": None,
                   "peak_note": "≤ 4.00 GiB (below an earlier peak)", "peak_line": ""}


def test_the_del_button_says_which_variables_it_deletes(ip: Any, gauge: Gauge) -> None:
    ok(ip, "model = torch.nn.Linear(1024, 1024)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)")
    ok(ip, "model(torch.randn(4, 1024)).sum().backward()")
    ok(ip, "losses = [model(torch.randn(256, 1024)).sum() for _ in range(3)]\nloss = losses[-1]")
    gauge._publisher.flush()
    row = next(h for h in gauge.holders if h["name"] == "model")
    assert row["state"] == "model" and row["del_label"] == "", "the notebook's state has no del button"
    # The losses' graphs hold the weights too (their AccumulateGrad nodes): deleting the model takes them as well.
    assert row["also"] == ["opt"] and row["hint"].endswith("→ `%cudamem clean model opt losses loss`"), row["hint"]
    assert {m["name"] for m in row["members"]} == {"model.weight", "model.bias", "model.weight.grad",
                                                   "model.bias.grad"}
    click(gauge, request("del", row["id"]))  # an old page that still shows a del button: refused
    gauge._publisher.flush()
    assert gauge.action["ok"] is False and "model" in ip.user_ns and "opt" in ip.user_ns
    leak = next(h for h in gauge.holders if h["name"] == "losses")
    assert leak["del_label"] == "del losses, loss", "the button deletes every name its hint says must go"
    click(gauge, request("del", leak["id"]))
    gauge._publisher.flush()
    assert gauge.action["label"] == "del losses, loss"
    assert "losses" not in ip.user_ns and "loss" not in ip.user_ns and "model" in ip.user_ns and "opt" in ip.user_ns


def test_the_gauge_never_claims_a_notebook_holds_nothing_before_looking(shell: Any) -> None:
    ok(shell, "import torch\nkept = torch.empty(2**20)")  # made before nbmem was loaded
    shell.config.Nbmem.scan = False
    ok(shell, "%load_ext nbmem")
    g = Gauge(root_of(shell).session, start=False)
    try:
        assert g.holders == [] and g.holders_note == ("no holder scan has run yet: `%cudamem leaks` or "
                                                      "`%cudamem on` scans the notebook")
    finally:
        g.close()
    shell.run_line_magic("unload_ext", "nbmem")
    shell.config.Nbmem.scan = True
    ok(shell, "%load_ext nbmem")
    g = Gauge(root_of(shell).session, start=False)
    try:
        assert [h["name"] for h in g.holders] == ["kept"], "loading looks once, so the gauge opens knowing it"
        ok(shell, "%cudamem leaks")
        ok(shell, "del kept")
        ok(shell, "%cudamem leaks")
        g._publisher.flush()
        assert g.holders == [] and g.holders_note == "nothing above the threshold (1.00 MiB)"
    finally:
        g.close()


def test_holders_follow_cells_nobody_measured(shell: Any) -> None:
    """Without `%cudamem on`, each cell's end walks what changed (a few ms), so the list is true after Run All.
    Only while a gauge is shown: nothing else reads the list between cells."""
    ok(shell, "%load_ext nbmem")
    m = root_of(shell)
    before = m.session.holders_scanned_at()
    ok(shell, "import torch\nearly = torch.zeros(2**21)")
    assert m.session.holders_scanned_at() == before, "no gauge: no walk after the cell"
    m.gauge = g = Gauge(m.session, start=False)  # what show_gauge does in a kernel
    try:
        ok(shell, "del early\nkept = torch.zeros(2**21)")
        g._publisher.flush()
        assert [h["name"] for h in g.holders] == ["kept"]
        ok(shell, "pass")
        first = m.session.holders_scanned_at()
        assert first is not None and abs(time.time() - first) < 60
        ok(shell, "pass")  # no name added or rebound, no memory moved: no walk
        assert m.session.holders_scanned_at() == first
        ok(shell, "del kept")
        g._publisher.flush()
        assert g.holders == [] and g.holders_note == "nothing above the threshold (1.00 MiB)"
        assert g.holders_at is not None and g.holders_at > first
    finally:
        g.close()


def test_torch_is_not_imported_only_while_it_is_not(shell: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = sys.modules["torch"]
    monkeypatch.delitem(sys.modules, "torch")  # a notebook that loads nbmem before importing torch
    ok(shell, "%load_ext nbmem")
    root_of(shell).gauge = g = Gauge(root_of(shell).session, start=False)
    try:
        assert g.holders_note == "torch is not imported yet: no tensors to hold" and g.holders_at is None
        monkeypatch.setitem(sys.modules, "torch", torch)
        g._publisher.poke()
        publish(g)  # the note is read with each sample: it ends with the import, before any scan
        assert "torch is not imported" not in g.holders_note
        ok(shell, "import torch\nkept = torch.zeros(2**21)")
        g._publisher.flush()
        assert [h["name"] for h in g.holders] == ["kept"] and g.holders_at is not None
    finally:
        g.close()


def test_rescan_walks_everything_and_says_what_it_found(ip: Any, gauge: Gauge) -> None:
    ok(ip, "%cudamem off")
    ok(ip, "kept = torch.zeros(2**21)")
    click(gauge, {"type": "rescan", "req": "v-7"})
    gauge._publisher.flush()
    assert [h["name"] for h in gauge.holders] == ["kept"]
    assert gauge.action["req"] == "v-7" and gauge.action["label"] == "rescan" and gauge.action["ok"]
    assert re.fullmatch(r"1 holder listed \(\d+ ms\)", gauge.action["text"])
    ok(ip, "del kept")
    click(gauge, {"type": "rescan", "req": "v-8"})
    gauge._publisher.flush()
    assert gauge.holders == [] and gauge.action["text"].startswith("nothing above the threshold")



def test_each_holder_kind_is_worded_once_and_the_gauge_is_sent_its_label_and_what_frees_it() -> None:
    from nbmem.records import HOLDER_KINDS
    from nbmem.ui.widget import holder_rows

    assert set(HOLDER_KINDS) == set(HolderKind), "every kind has its words, rank and cleanup in one table"
    assert sorted(i.rank for i in HOLDER_KINDS.values()) == list(range(len(HolderKind)))

    def row(name: str, kind: HolderKind, **kw: Any) -> dict[str, Any]:
        (r,) = holder_rows([Finding(1, name, (name,), kind, "cuda:0", GiB, id="id", **kw)])
        return r

    mod = row("pkg.sub.cache", HolderKind.MODULE)
    assert (mod["kind_label"], mod["no_del"]) == ("module", "an attribute of module pkg.sub: set it to None")
    out = row("Out[4]", HolderKind.OUTPUT)
    assert (out["kind_label"], out["no_del"]) == ("output", "held by the output history: use “clear outputs”")
    tb = row("<traceback step>", HolderKind.TRACEBACK)
    assert (tb["kind_label"], tb["no_del"]) == ("traceback", "held by the last traceback: use “clear traceback”")
    state = row("model", HolderKind.NAMESPACE, roots=("model", "opt"), state="model")
    assert state["no_del"] == "the notebook's state (model): delete it by name, %cudamem clean model opt"
    leak = row("x", HolderKind.NAMESPACE, roots=("x",))
    assert (leak["kind_label"], leak["no_del"], leak["del_label"]) == ("", "", "del x")
