"""A page that connects while a cell runs gets its widgets, the gauge among them, without waiting for the cell.

A JupyterLab page reloaded mid-cell first asks the kernel who it is (``kernel_info_request``), then opens
ipywidgets' control comm and asks it for every widget's state (falling back to ``comm_info_request`` and each
widget's ``request_state``). ipykernel
answers all of these on the main thread, between cells: a page reloaded during an hour-long training cell had no
gauge for the hour. ipykernel 7 reads the shell channel on a thread of its own; nbmem answers exactly these
requests there, with ipykernel's and ipywidgets' own handlers, which only read (the kernel's fixed facts, the
list of comms, the widgets' states). Every other message takes ipykernel's route; the widgets' own comms later
use the subshells JupyterLab opens for them. Without that thread (ipykernel 6, another kernel, a plain IPython)
nothing changes and a reloaded page gets its gauge when the running cell ends.

This is the adapter's one reach into ipykernel's insides (its shell-channel thread and stream, 7.x); anything
unexpected there leaves the kernel as it was, with the reason kept.
"""

from __future__ import annotations

import threading
from typing import Any

CONTROL_TARGET = "jupyter.widget.control"  # ipywidgets' comm that hands a new page every widget's state
#: What a connecting page waits on; the comm messages only for ipywidgets' control comm.
ROUTED = ("kernel_info_request", "comm_info_request", "comm_open", "comm_msg", "comm_close")
_WAIT_S = 2.0


class ReconnectRoute:
    """A page's connecting requests answered on ipykernel's shell-channel thread, while the route is open."""

    def __init__(self, kernel: Any) -> None:
        self._kernel = kernel
        self.reason: str | None = None  # why there is no route, when there is none
        self.answered: dict[str, int] = {}  # requests answered on the thread, by type (tests read it)
        self._control_comms: set[str] = set()
        self._stream: Any = None
        self._original: Any = None
        self._thread: Any = None

    @property
    def is_open(self) -> bool:
        return self._original is not None

    def open(self) -> bool:
        """Route through the thread; False (and ``reason``) where this kernel cannot."""
        k = self._kernel
        thread = getattr(k, "shell_channel_thread", None)
        stream = getattr(k, "shell_stream", None)
        original = getattr(k, "shell_channel_thread_main", None)
        handlers = getattr(k, "shell_handlers", None)
        if thread is None or stream is None or original is None or not isinstance(handlers, dict) \
                or not all(callable(handlers.get(kind)) for kind in ROUTED) \
                or not getattr(k, "_supports_kernel_subshells", False):
            self.reason = (f"ipykernel {_version()} answers pages only between cells "
                           "(ipykernel 7 reads them on a thread of its own)")
            return False
        route = self._route(k.session, original, stream)
        err = _on_thread(thread, lambda: stream.on_recv(route, copy=False))
        if err is not None:
            self.reason = f"ipykernel {_version()}: {err}"
            return False
        self._stream, self._original, self._thread = stream, original, thread
        return True

    def _mine(self, header: dict[str, Any], content: dict[str, Any]) -> bool:
        """Whether a message is one a connecting page waits on: on the main shell, or (a widget's state, which
        ipykernel may route back to the main shell) on any."""
        kind = header.get("msg_type")
        data = content.get("data")
        if kind == "comm_msg" and isinstance(data, dict) and data.get("method") == "request_state":
            return True  # ipywidgets' fallback restore, one widget at a time: it only sends the widget's state
        if header.get("subshell_id") is not None:
            return False
        if kind in ("kernel_info_request", "comm_info_request"):
            return True
        if kind == "comm_open":
            return content.get("target_name") == CONTROL_TARGET
        return kind in ("comm_msg", "comm_close") and content.get("comm_id") in self._control_comms

    def _route(self, session: Any, original: Any, stream: Any) -> Any:
        kernel = self._kernel

        async def route(msg: list[Any]) -> None:  # on the shell-channel thread, which owns the stream
            try:
                idents, rest = session.feed_identities(msg, copy=False)
                header = session.deserialize(rest, content=False, copy=False)["header"]
                # Peeking at the content does not use up the message's signature; only a full read does.
                if header.get("msg_type") not in ROUTED:
                    mine = False
                else:
                    mine = self._mine(header, session.unpack(rest[4].bytes))
            except Exception:
                mine = False  # ipykernel's own route says what is wrong with the message
            if not mine:
                await original(msg)
                return
            parent = session.deserialize(rest, content=True, copy=False)
            kind = parent["header"]["msg_type"]
            comm_id = parent["content"].get("comm_id")
            if kind == "comm_open":
                self._control_comms.add(comm_id)
            elif kind == "comm_close":
                self._control_comms.discard(comm_id)
            # busy and idle as the main shell sends them: a page's request is done when both reply and idle came
            _status(kernel, "busy", parent)
            try:
                result = kernel.shell_handlers[kind](stream, idents, parent)
                if hasattr(result, "__await__"):
                    await result
                self.answered[kind] = self.answered.get(kind, 0) + 1
            except Exception:
                kernel.log.exception("nbmem: %s answered on the shell-channel thread failed", kind)
            finally:
                _status(kernel, "idle", parent)
                _still_busy(kernel, parent)

        return route

    def close(self) -> None:
        """ipykernel's own routing again."""
        if self._original is None:
            return
        stream, original = self._stream, self._original
        self._original = None
        _on_thread(self._thread, lambda: stream.on_recv(original, copy=False))


def reconnect_route(shell: Any, cannot: list[str], fault: Any) -> ReconnectRoute | None:
    """The route for ``shell``'s kernel, open; None in a shell without one (what it cannot do goes to ``cannot``)."""
    kernel = getattr(shell, "kernel", None)
    if kernel is None:  # not a Jupyter kernel: no page connects to it
        return None
    try:
        route = ReconnectRoute(kernel)
        if route.open():
            return route
        cannot.append(f"a page reloaded while a cell runs shows the gauge when the cell ends: {route.reason}")
    except Exception as e:
        fault("the reconnect route", e)
    return None


def _status(kernel: Any, state: str, parent: Any) -> None:
    """An iopub status for ``parent``; a failure here must not keep the request from its answer."""
    try:
        kernel._publish_status(state, "shell", parent)
    except Exception:
        pass


def _still_busy(kernel: Any, parent: Any) -> None:
    """Say "busy" again while the main shell still runs a cell: pages and the server take the kernel's state from
    the latest status, and an "idle" mid-cell would show a training kernel as idle (and let an idle culler end it).
    Checked again after: if the cell ended meanwhile, its "idle" may have come first, so "idle" follows."""
    lock = getattr(kernel, "_main_asyncio_lock", None)
    if lock is None or not lock.locked():
        return
    _status(kernel, "busy", parent)
    if not lock.locked():
        _status(kernel, "idle", parent)


def _on_thread(thread: Any, fn: Any) -> str | None:
    """Run ``fn`` on the shell-channel thread and wait for it; the error's text, or None."""
    done = threading.Event()
    errors: list[str] = []

    def call() -> None:
        try:
            fn()
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
        finally:
            done.set()

    if threading.current_thread() is thread:
        call()
    else:
        thread.io_loop.add_callback(call)
        if not done.wait(_WAIT_S):
            return f"its shell-channel thread did not answer in {_WAIT_S:.0f} s"
    return errors[0] if errors else None


def _version() -> str:
    try:
        import ipykernel

        return str(ipykernel.__version__)
    except Exception:
        return "(unknown version)"


class BetweenCells:
    """Runs a page's click on the kernel's main thread between cells, whatever thread the click arrived on.

    JupyterLab sends comm messages to subshells (threads beside the running cell), and ipykernel dispatches them
    even on the main thread while an async cell awaits; a cleanup must never run in the middle of the user's
    code. ``hooks`` are IPython's pre/post_run_cell for every run (they nest: a cell magic runs its body).
    """

    def __init__(self, kernel: Any) -> None:
        self._loop = getattr(kernel, "io_loop", None)  # the main thread's loop: free only between cells
        self._running = 0
        self.hooks = {"pre_run_cell": self._enter, "post_run_cell": self._leave}

    def _enter(self, _info: Any) -> None:
        self._running += 1

    def _leave(self, _result: Any) -> None:
        self._running = max(0, self._running - 1)

    def later(self, fn: Any) -> bool:
        """False when ``fn`` may run now (on the main thread, no cell running); else True, and ``fn`` runs on
        the main thread once no cell is (without a kernel loop to wait on, it does not run: the caller says so)."""
        if threading.current_thread() is threading.main_thread() and not self._running:
            return False
        loop = self._loop
        if loop is None:
            return True

        def attempt() -> None:
            if self._running:
                loop.call_later(0.2, attempt)
            else:
                fn()

        loop.add_callback(attempt)
        return True
