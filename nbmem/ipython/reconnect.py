"""A page that connects while a cell runs gets its widgets, the gauge among them, without waiting for the cell.

A JupyterLab page reloaded mid-cell first asks the kernel who it is (``kernel_info_request``), then opens
ipywidgets' control comm and asks it for every widget's state (falling back to ``comm_info_request`` and each
widget's ``request_state``). ipykernel answers all of these on the main thread, between cells: a page reloaded
during an hour-long training cell had no gauge for the hour. ipykernel 7 reads the shell channel on a thread of
its own; nbmem answers exactly these requests there. Kernel and comm facts come from ipykernel's own handlers;
widget states are read here, from a snapshot of ipywidgets' widget table (a cell may add widgets meanwhile),
and sent without firing IPython's execute events (``%matplotlib inline`` would flush the running cell's figures
on this thread). Answers carry their request as parent, as ipykernel's would. Every other message takes
ipykernel's route. Without that thread (ipykernel 6, another kernel, a plain IPython) nothing changes and a
reloaded page gets its gauge when the running cell ends.

``BetweenCells`` is the other half: a gauge click that arrives while a cell runs (JupyterLab sends comm
messages to subshells, threads beside the running cell) waits for the cell and then runs on the main thread.

This is the adapter's one reach into ipykernel's insides (its shell-channel thread and stream, its parent
context variables, 7.x); anything unexpected there leaves the kernel as it was, with the reason kept.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from typing import Any

CONTROL_TARGET = "jupyter.widget.control"  # ipywidgets' comm that hands a new page every widget's state
#: What a connecting page waits on; the comm messages only for ipywidgets' control comm or a state request.
ROUTED = ("kernel_info_request", "comm_info_request", "comm_open", "comm_msg", "comm_close")
_WAIT_S = 2.0


class ReconnectRoute:
    """A page's connecting requests answered on ipykernel's shell-channel thread, while the route is open."""

    def __init__(self, kernel: Any) -> None:
        self._kernel = kernel
        self.reason: str | None = None  # why there is no route, when there is none
        self._control_comms: set[str] = set()
        self._stream: Any = None
        self._original: Any = None
        self._thread: Any = None
        self._route: Any = None
        self._started = False  # the kernel's loop runs: what is registered now stays (see ``ensure``)

    def open(self) -> bool:
        """Route through the thread; False (and ``reason``) where this kernel cannot."""
        k = self._kernel
        thread = getattr(k, "shell_channel_thread", None)
        stream = getattr(k, "shell_stream", None)
        original = getattr(k, "shell_channel_thread_main", None)
        handlers = getattr(k, "shell_handlers", None)
        if thread is None or stream is None or original is None or not isinstance(handlers, dict) \
                or not all(callable(handlers.get(kind)) for kind in ROUTED) \
                or not all(isinstance(getattr(k, v, None), contextvars.ContextVar)
                           for v in ("_shell_parent", "_shell_parent_ident")) \
                or not getattr(k, "_supports_kernel_subshells", False):
            self.reason = (f"ipykernel {_version()} answers pages only between cells "
                           "(ipykernel 7 reads them on a thread of its own)")
            return False
        self._stream, self._original, self._thread = stream, original, thread
        self._route = self._make_route(k.session, original, stream)
        return self.ensure()

    def ensure(self) -> bool:
        """Register the route, once the kernel has started. An extension loaded at the kernel's start
        (``c.InteractiveShellApp.extensions``) is loaded before ipykernel registers its own callback, which would
        replace the route: then this waits for the first cell (``BetweenCells.pre_run_cell`` calls it)."""
        if self._original is None or self._started:
            return self._original is not None
        if getattr(self._kernel, "io_loop", None) is None:
            return True  # not started yet: the first cell registers it
        stream, route = self._stream, self._route
        err = _on_thread(self._thread, lambda: stream.on_recv(route, copy=False))
        if err is not None:
            self.reason = f"ipykernel {_version()}: {err}"
            self._original = None
            return False
        self._started = True
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

    def _peek(self, session: Any, msg: list[Any]) -> bool:
        """Whether ``msg`` is ours, read cheaply: its header, and its content only where it may be. The
        signature is checked once, when an answer reads the message (ipykernel checks the others)."""
        try:
            _idents, rest = session.feed_identities(msg, copy=False)
            header = session.unpack(rest[1].bytes)
            kind = header.get("msg_type")
            if kind not in ROUTED:
                return False
            raw = rest[4].bytes
            if kind in ("comm_msg", "comm_close") and b"request_state" not in raw \
                    and not any(c.encode() in raw for c in self._control_comms):
                return False  # the widgets' own traffic, most of what comes: not parsed twice
            return self._mine(header, session.unpack(raw))
        except Exception:
            return False  # ipykernel's own route says what is wrong with the message

    def _make_route(self, session: Any, original: Any, stream: Any) -> Any:
        kernel = self._kernel

        async def route(msg: list[Any]) -> None:  # on the shell-channel thread, which owns the stream
            if not self._peek(session, msg):
                await original(msg)
                return
            try:
                idents, rest = session.feed_identities(msg, copy=False)
                parent = session.deserialize(rest, content=True, copy=False)
            except Exception:
                kernel.log.error("nbmem: an invalid message on the shell channel", exc_info=True)
                return
            # The request is the parent of what answers it (a page matches answers by it), in a context of its
            # own: ipykernel's shared "last parent", which the user's threads print through, stays the cell's.
            kind, comm_id = parent["header"]["msg_type"], parent["content"].get("comm_id")
            if kind == "comm_open":  # now, not in the task: the next message may be this comm's, read at once
                self._control_comms.add(comm_id)
            elif kind == "comm_close":
                self._control_comms.discard(comm_id)
            ctx = contextvars.copy_context()
            ctx.run(kernel._shell_parent.set, parent)
            ctx.run(kernel._shell_parent_ident.set, idents)
            await asyncio.create_task(self._answer(stream, idents, parent), context=ctx)

        return route

    async def _answer(self, stream: Any, idents: Any, parent: dict[str, Any]) -> None:
        kernel = self._kernel
        kind = parent["header"]["msg_type"]
        # busy and idle as the main shell sends them: a page's request is done when both reply and idle came
        _status(kernel, "busy", parent)
        try:
            if kind == "comm_msg":
                _comm_msg(kernel, parent)
            else:
                result = kernel.shell_handlers[kind](stream, idents, parent)
                if hasattr(result, "__await__"):
                    await result
        except Exception:
            kernel.log.exception("nbmem: %s answered on the shell-channel thread failed", kind)
        finally:
            _status(kernel, "idle", parent)
            _still_busy(kernel, parent)

    def close(self) -> None:
        """ipykernel's own routing again."""
        if self._original is None:
            return
        stream, original, started = self._stream, self._original, self._started
        self._original = None
        if started:
            _on_thread(self._thread, lambda: stream.on_recv(original, copy=False))


def _comm_msg(kernel: Any, parent: dict[str, Any]) -> None:
    """A state request: every widget's (the control comm's ``request_states``) or one widget's. Answered from a
    snapshot of ipywidgets' table, each widget read on its own, without IPython's execute events."""
    content = parent["content"]
    data = content.get("data") or {}
    comm = kernel.comm_manager.get_comm(content.get("comm_id"))
    if comm is None:
        return
    try:
        from ipywidgets.widgets.widget import _instances, _remove_buffers
    except ImportError:  # another ipywidgets: its own callback, still without the events
        if comm._msg_callback is not None:
            comm._msg_callback(parent)
        return
    if data.get("method") == "request_state":
        widget = _instances.get(comm.comm_id)
        if widget is not None:
            widget.send_state()
        return
    if data.get("method") != "request_states":
        return
    states: dict[str, Any] = {}
    for widget in list(_instances.values()):  # a copy in one step: the running cell may add widgets
        try:
            states[widget.model_id] = {"model_name": widget._model_name, "model_module": widget._model_module,
                                       "model_module_version": widget._model_module_version,
                                       "state": widget.get_state(drop_defaults=False)}
        except Exception:
            continue  # a widget closed meanwhile, or one that cannot say its state: the rest still restore
    states, buffer_paths, buffers = _remove_buffers(states)
    comm.send({"method": "update_states", "states": states, "buffer_paths": buffer_paths}, buffers=buffers)


def reconnect_route(shell: Any, cannot: list[str], fault: Any, between: BetweenCells | None = None
                    ) -> ReconnectRoute | None:
    """The route for ``shell``'s kernel, open; None in a shell without one (what it cannot do goes to ``cannot``).
    ``between``'s cells then make sure it is registered (an extension loaded at the kernel's start)."""
    kernel = getattr(shell, "kernel", None)
    if kernel is None:  # not a Jupyter kernel: no page connects to it
        return None
    try:
        route = ReconnectRoute(kernel)
        if route.open():
            if between is not None:
                between.on_cell = route.ensure
            return route
        cannot.append(f"a page reloaded while a cell runs shows the gauge when the cell ends: {route.reason}")
    except Exception as e:
        fault("the reconnect route", e)
    return None


class BetweenCells:
    """Runs a page's click on the kernel's main thread between cells, whatever thread the click arrived on.

    JupyterLab sends comm messages to subshells (threads beside the running cell), and ipykernel dispatches them
    even on the main thread while an async cell awaits; a cleanup must never run in the middle of the user's
    code. ``pre_run_cell`` and ``post_run_cell`` are told of every run by the adapter's cell hooks (runs nest: a
    cell magic runs its body); a run is counted by its info, so a post without a pre (an empty cell) changes
    nothing.
    """

    def __init__(self, kernel: Any, on_cell: Callable[[], object] | None = None) -> None:
        self._kernel = kernel
        self.on_cell = on_cell  # called as each run starts (the reconnect route's ``ensure``)
        self._running: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False

    def pre_run_cell(self, info: Any) -> None:
        with self._lock:
            self._running.add(id(info))
        if self.on_cell is not None:
            self.on_cell()

    def post_run_cell(self, result: Any) -> None:
        with self._lock:
            self._running.discard(id(getattr(result, "info", None)))

    @property
    def busy(self) -> bool:
        """Whether a cell runs now."""
        return bool(self._running)

    def close(self) -> None:
        """nbmem unloaded: a click still waiting is dropped."""
        self._closed = True

    def later(self, fn: Callable[[], object]) -> bool:
        """Run ``fn`` on the main thread once no cell runs; False where there is no kernel loop to wait on."""
        loop = getattr(self._kernel, "io_loop", None)  # the main thread's loop: free only between cells
        if loop is None or self._closed:
            return False

        def attempt() -> None:
            if self._closed:
                return
            if self._running:
                loop.call_later(0.2, attempt)
            else:
                fn()

        loop.add_callback(attempt)
        return True


def _status(kernel: Any, state: str, parent: Any) -> None:
    """An iopub status for ``parent``; a failure here must not keep the request from its answer."""
    try:
        kernel._publish_status(state, "shell", parent)
    except Exception:
        pass


def _still_busy(kernel: Any, parent: Any) -> None:
    """Say "busy" again while the main shell still runs a cell: pages and the server take the kernel's state from
    the latest status, and an "idle" mid-cell would show a training kernel as idle (and let an idle culler end it).
    The main loop, free only once the cell is over, then checks again: if its "idle" came before this "busy",
    "idle" follows."""
    lock = getattr(kernel, "_main_asyncio_lock", None)
    if lock is None or not lock.locked():
        return
    _status(kernel, "busy", parent)
    loop = getattr(kernel, "io_loop", None)
    if loop is not None:
        loop.add_callback(lambda: None if lock.locked() else _status(kernel, "idle", parent))


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
