"""A page that connects to a real kernel (jupyter_client) while a cell runs gets its answers and its widgets' state
before the cell ends, as a reloaded JupyterLab page asks them: kernel info, then ipywidgets' control comm."""

from __future__ import annotations

import json
import os
import queue
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel.shellchannel", reason="ipykernel 7 reads the shell channel on a thread")

SLEEP = "import time\ntime.sleep({s})\nprint('cell done')"


@pytest.fixture
def kc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A kernel of this interpreter; ``@pytest.mark.parametrize("kc", [[ARGS]], indirect=True)`` adds arguments."""
    spec = tmp_path / "jupyter" / "kernels" / "nbmem-reconnect"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}", *getattr(request, "param", [])]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "nbmem", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    km = jupyter_client.KernelManager(kernel_name="nbmem-reconnect")
    km.start_kernel(env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt")})
    client = km.client()
    client.start_channels()
    client.wait_for_ready(timeout=60)
    yield client
    client.stop_channels()
    km.shutdown_kernel(now=True)


def _both(kc: Any, timeout_s: float = 60) -> Iterator[dict[str, Any]]:
    """Messages from the shell and iopub channels as they come, for ``timeout_s`` at most."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for get in (kc.get_shell_msg, kc.get_iopub_msg):
            try:
                yield get(timeout=0.05)
            except queue.Empty:
                continue
    raise AssertionError(f"nothing more came in {timeout_s} s")


def _order(kc: Any, sent: dict[str, str]) -> list[str]:
    """The names of ``sent`` (name -> request msg_id, on shell) and "cell" (the execute_reply of ``sent["_cell"]``)
    in the order their replies came; a name ending in "/states" waits for the control comm's update_states."""
    seen: list[str] = []
    want = {n for n in sent if not n.startswith("_")} | {"cell"}
    for m in _both(kc):
        parent = m["parent_header"].get("msg_id")
        for name, msg_id in sent.items():
            if name.startswith("_"):
                continue
            if name.endswith("/states"):
                data = m["content"].get("data", {}) if m["msg_type"] == "comm_msg" else {}
                if m["content"].get("comm_id") == msg_id and data.get("method") == "update_states":
                    seen.append(name)
            elif parent == msg_id and m["msg_type"].endswith("_reply"):
                seen.append(name)
        if m["msg_type"] == "execute_reply" and parent == sent.get("_cell"):
            seen.append("cell")
        if not want - set(seen):
            break
    return seen


def _states_request(kc: Any, sent: list[str] | None = None) -> str:
    """Open ipywidgets' control comm and ask for every widget's state, as a page does; the comm's id (``sent``
    gets the two messages' ids)."""
    comm_id = str(uuid.uuid4())
    for msg in (kc.session.msg("comm_open", {"comm_id": comm_id, "target_name": "jupyter.widget.control",
                                             "data": {}}, metadata={"version": "1.0.0"}),
                kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {"method": "request_states"}})):
        kc.shell_channel.send(msg)
        if sent is not None:
            sent.append(msg["header"]["msg_id"])
    return comm_id


def test_a_connecting_page_is_answered_while_a_cell_runs(kc: Any) -> None:
    kc.execute_interactive("%load_ext nbmem", timeout=60)
    cell = kc.execute(SLEEP.format(s=6))
    info = kc.kernel_info()
    comms = kc.comm_info()
    states = _states_request(kc)
    order = _order(kc, {"_cell": cell, "info": info, "comms": comms, "control/states": states})
    assert order.index("cell") == len(order) - 1, f"answered only after the running cell: {order}"


def test_the_states_name_the_gauge_in_answer_to_their_request(kc: Any) -> None:
    """The page takes the states as the answer to its request: their parent is that request, not the cell."""
    kc.execute_interactive("%load_ext nbmem", timeout=60)
    kc.execute(SLEEP.format(s=4))
    sent: list[str] = []
    comm_id = _states_request(kc, sent)
    while True:
        m = kc.get_iopub_msg(timeout=30)
        if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == comm_id:
            break
    states = m["content"]["data"]["states"]
    gauges = [s for s in states.values() if "gauge_id" in s["state"]]
    assert len(gauges) == 1, sorted(s["model_name"] for s in states.values())
    assert m["parent_header"]["msg_id"] == sent[1], m["parent_header"].get("msg_type")


def test_after_unload_the_kernel_answers_between_cells_again(kc: Any) -> None:
    kc.execute_interactive("%load_ext nbmem", timeout=60)
    kc.execute_interactive("%unload_ext nbmem", timeout=60)
    cell = kc.execute(SLEEP.format(s=3))
    info = kc.kernel_info()
    assert _order(kc, {"_cell": cell, "info": info}) == ["cell", "info"]


def test_a_kernel_without_the_thread_keeps_its_route_and_status_says_why() -> None:
    from types import SimpleNamespace

    from nbmem.ipython.reconnect import reconnect_route

    cannot: list[str] = []
    faults: list[Any] = []
    old = SimpleNamespace(shell_handlers={}, session=object())  # ipykernel 6: no shell-channel thread
    assert reconnect_route(SimpleNamespace(kernel=old), cannot, lambda *a: faults.append(a)) is None
    assert len(cannot) == 1 and "when the cell ends" in cannot[0] and not faults
    assert reconnect_route(SimpleNamespace(kernel=None), cannot, faults.append) is None  # plain IPython
    assert len(cannot) == 1


def _states(kc: Any) -> dict[str, Any]:
    comm_id = _states_request(kc)
    while True:
        m = kc.get_iopub_msg(timeout=30)
        if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == comm_id:
            return dict(m["content"]["data"]["states"])


def test_a_click_sent_to_a_subshell_mid_cell_runs_after_the_cell(kc: Any) -> None:
    """JupyterLab sends comm messages to a subshell, a thread beside the running cell: the gauge's cleanup
    must wait for the cell (BetweenCells), never delete a name the running code is using."""
    kc.execute_interactive("%load_ext nbmem", timeout=60)
    kc.execute_interactive("import torch\nkept = torch.zeros(2**20)", timeout=60)
    for _ in range(50):  # the holder list follows the cell a moment after it (the gauge's publisher)
        gauge_id, gauge = next((k, s["state"]) for k, s in _states(kc).items() if "gauge_id" in s["state"])
        holder = next((h["id"] for h in gauge["holders"] if h["name"] == "kept"), None)
        if holder:
            break
        time.sleep(0.1)
    assert holder, gauge["holders"]
    reply = kc.control_channel.get_msg  # the subshell, as JupyterLab makes one for a comm target
    kc.control_channel.send(kc.session.msg("create_subshell_request", {}))
    subshell = reply(timeout=10)["content"]["subshell_id"]
    cell = kc.execute("import time\nseen = []\nfor _ in range(40):\n    seen.append('kept' in globals())\n"
                      "    time.sleep(0.1)\nprint(all(seen))")
    time.sleep(0.5)  # the cell is running
    # A request the subshell handles now makes its message the kernel's latest parent; the gauge's next update
    # then routes the gauge's comm to that subshell (ipykernel's comm.py), as JupyterLab's traffic does.
    ask = kc.session.msg("kernel_info_request", {})
    ask["header"]["subshell_id"] = subshell
    kc.shell_channel.send(ask)
    time.sleep(1.0)
    click = kc.session.msg("comm_msg", {"comm_id": gauge_id, "data": {"method": "custom", "content": {
        "type": "cleanup", "req": "t-1", "action": "del", "id": holder}}})
    click["header"]["subshell_id"] = subshell
    kc.shell_channel.send(click)
    out, action_after_cell, done = [], None, False
    while action_after_cell is None:
        m = kc.get_iopub_msg(timeout=30)
        if m["msg_type"] == "stream":
            out.append(m["content"]["text"])
        if m["msg_type"] == "status" and m["parent_header"].get("msg_id") == cell \
                and m["content"]["execution_state"] == "idle":
            done = True
        state = m["content"].get("data", {}).get("state", {}) if m["msg_type"] == "comm_msg" else {}
        if state.get("action", {}).get("req") == "t-1":
            action_after_cell = done
            assert state["action"]["ok"], state["action"]
    assert "".join(out).strip() == "True", f"the running cell lost `kept`: {out}"
    assert action_after_cell, "the cleanup ran before the cell ended"
    after: list[str] = []
    kc.execute_interactive("print('kept' in globals())", timeout=30,
                           output_hook=lambda m: after.append(m["content"].get("text", "")))
    assert "".join(after).strip() == "False", "the click was not carried out after the cell"


def test_the_fallback_restore_one_widget_at_a_time_is_answered_mid_cell(kc: Any) -> None:
    """Where the control comm fails, ipywidgets lists the comms and asks each widget for its state; ipykernel
    sends that request back to the main shell whatever subshell it came on. Both are answered mid-cell."""
    kc.execute_interactive("%load_ext nbmem", timeout=60)
    gauge_id = next(k for k, s in _states(kc).items() if "gauge_id" in s["state"])
    kc.control_channel.send(kc.session.msg("create_subshell_request", {}))
    subshell = kc.control_channel.get_msg(timeout=10)["content"]["subshell_id"]
    cell = kc.execute(SLEEP.format(s=5))
    comms = kc.comm_info(target_name="jupyter.widget")
    ask = kc.session.msg("comm_msg", {"comm_id": gauge_id, "data": {"method": "request_state"}})
    ask["header"]["subshell_id"] = subshell
    kc.shell_channel.send(ask)
    seen: list[str] = []
    for m in _both(kc):
        parent = m["parent_header"].get("msg_id")
        if parent == comms and m["msg_type"] == "comm_info_reply":
            assert gauge_id in m["content"]["comms"]
            seen.append("comms")
        data = m["content"].get("data", {}) if m["msg_type"] == "comm_msg" else {}
        if m["content"].get("comm_id") == gauge_id and data.get("method") == "update" \
                and "gauge_id" in data.get("state", {}):
            # ipywidgets' page takes a widget's state only as the answer to its own request
            assert m["parent_header"]["msg_id"] == ask["header"]["msg_id"], m["parent_header"].get("msg_type")
            seen.append("state")
        if parent == cell and m["msg_type"] == "execute_reply":
            seen.append("cell")
            break
    assert seen.index("cell") == len(seen) - 1 and {"comms", "state"} <= set(seen), seen


def test_the_kernel_still_reads_busy_after_a_mid_cell_answer(kc: Any) -> None:
    """Pages and the server take the kernel's state from the latest status message: an "idle" for the answered
    request, mid-cell, must be followed by "busy" again (else a training kernel shows idle, and can be culled)."""
    kc.execute_interactive("%load_ext nbmem", timeout=60)
    cell = kc.execute(SLEEP.format(s=4))
    time.sleep(0.5)
    sent: list[str] = [kc.kernel_info()]
    _states_request(kc, sent)
    asked = set(sent)
    states: list[tuple[str, str]] = []
    while True:
        m = kc.get_iopub_msg(timeout=30)
        if m["msg_type"] == "status":
            states.append((m["parent_header"].get("msg_id"), m["content"]["execution_state"]))
            if m["parent_header"].get("msg_id") == cell and states[-1][1] == "idle":
                break
    mid = [st for pid, st in states[:-1] if pid != cell]
    assert asked <= {pid for pid, _ in states}, "no status for the answered requests"
    assert mid and mid[-1] == "busy", states


@pytest.mark.parametrize("kc", [["--ext=nbmem"]], indirect=True)
def test_loaded_at_the_kernels_start_it_answers_from_the_first_cell_on(kc: Any) -> None:
    """``c.InteractiveShellApp.extensions = ["nbmem"]`` loads nbmem before ipykernel registers its own shell
    callback: the route is registered when the first cell runs, and a click can wait for a cell."""
    kc.execute_interactive("x = 1", timeout=60)
    cell = kc.execute(SLEEP.format(s=4))
    info = kc.kernel_info()
    assert _order(kc, {"_cell": cell, "info": info}) == ["info", "cell"]


def test_a_state_request_amid_new_widgets_is_answered_every_time(kc: Any) -> None:
    """A cell that makes widgets as it runs (progress bars) while pages ask for every widget's state: the answer
    comes from a snapshot of the widget table, every time."""
    kc.execute_interactive("%load_ext nbmem\nimport ipywidgets as W\nkeep = [W.IntSlider() for _ in range(300)]",
                           timeout=60)
    cell = kc.execute("import time\nfor i in range(200):\n    keep.append(W.IntProgress())\n    time.sleep(0.02)")
    asked = [_states_request(kc) for _ in range(10)]
    answered: set[str] = set()
    while len(answered) < len(asked):
        m = kc.get_iopub_msg(timeout=30)
        if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] in asked:
            assert len(m["content"]["data"]["states"]) >= 300
            answered.add(m["content"]["comm_id"])
    kc.get_shell_msg(timeout=30)  # the cell's reply, or another: the kernel is alive and answering
    assert cell


def test_a_click_waiting_for_the_cell_is_dropped_when_nbmem_unloads() -> None:
    """BetweenCells on a real tornado loop: a deferred click runs once no cell runs, never after close()."""
    from types import SimpleNamespace

    from tornado.ioloop import IOLoop

    from nbmem.ipython.reconnect import BetweenCells

    loop = IOLoop(make_current=False)
    ran: list[str] = []
    b = BetweenCells(SimpleNamespace(io_loop=loop))
    info, other = object(), object()
    b.pre_run_cell(info)
    b.post_run_cell(SimpleNamespace(info=other))  # a post without its pre (an empty cell): still running
    assert b.busy and b.later(lambda: ran.append("first"))
    loop.call_later(0.5, lambda: b.post_run_cell(SimpleNamespace(info=info)))
    loop.call_later(1.2, loop.stop)
    loop.start()
    assert ran == ["first"] and not b.busy
    b.pre_run_cell(info)
    assert b.later(lambda: ran.append("second"))
    b.close()
    b.post_run_cell(SimpleNamespace(info=info))
    loop.call_later(0.6, loop.stop)
    loop.start()
    loop.close()
    assert ran == ["first"]
    assert not BetweenCells(SimpleNamespace()).later(lambda: None)  # no kernel loop: the caller refuses
