"""Which notebook a GPU process belongs to, asked of the Jupyter server this kernel runs under.

A kernel that jupyter_server started has ``JPY_PARENT_PID`` (the server's PID, set by jupyter_client's
launcher) in its environment, and the server keeps ``jpserver-<pid>.json`` (its URL and token) in the
Jupyter runtime directory. When that server has nbmem's extension, ``/api/nbmem/gpu`` names every GPU
process of every kernel by notebook. Anywhere else (no server, another server, an old one, a timeout)
the answer is ``{}``: this never raises, and the caller keeps its own names.

Only the standard library (and jupyter_core, when present, for the runtime directory): no jupyter_server.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

#: How long one answer (or one failure) is reused: the server's own reading changes once a second, and an
#: absent server must not cost a timeout on every call.
CACHE_S = 5.0
#: The most one question to the server may take.
TIMEOUT_S = 0.5
ENDPOINT = "api/nbmem/gpu"


def _runtime_dir() -> Path | None:
    try:
        from jupyter_core.paths import jupyter_runtime_dir
    except ImportError:
        return None
    return Path(jupyter_runtime_dir())


def pids_to_notebooks(payload: Mapping[str, Any]) -> dict[int, str]:
    """PID to notebook path, for every kernel process the server's JSON lists with a notebook."""
    out: dict[int, str] = {}
    for gpu in payload.get("gpus") or ():
        for kernel in gpu.get("kernels") or ():
            if kernel.get("notebook"):
                out.update((int(pid), str(kernel["notebook"])) for pid in kernel.get("pids") or ())
    return out


class ServerNotebooks:
    """Notebook names from the parent Jupyter server, cached for ``cache_s``; thread-safe."""

    def __init__(self, environ: Mapping[str, str] = os.environ,
                 runtime_dir: Callable[[], Path | None] = _runtime_dir,
                 clock: Callable[[], float] = time.monotonic, cache_s: float = CACHE_S,
                 timeout_s: float = TIMEOUT_S) -> None:
        self._env = environ
        self._runtime_dir = runtime_dir
        self._clock = clock
        self._cache_s = cache_s
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._known: dict[int, str] = {}
        self._at: float | None = None
        # The server is on this machine: a proxy from the environment (http_proxy) must not be asked.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def notebook_of_pids(self, pids: Iterable[int]) -> dict[int, str]:
        """The notebook of each PID the server knows; the others are left out."""
        known = self._current()
        return {pid: known[pid] for pid in pids if pid in known}

    def _current(self) -> dict[int, str]:
        with self._lock:
            now = self._clock()
            if self._at is None or now - self._at >= self._cache_s:
                self._known = self._ask()
                self._at = now
            return self._known

    def _server(self) -> dict[str, Any] | None:
        """The parent server's runtime info, when this kernel has one."""
        pid = self._env.get("JPY_PARENT_PID", "")
        runtime = self._runtime_dir()
        if not pid.isdigit() or runtime is None:
            return None
        info = json.loads((runtime / f"jpserver-{pid}.json").read_text())
        return info if isinstance(info, dict) else None

    def _ask(self) -> dict[int, str]:
        try:
            info = self._server()
            if info is None or info.get("sock"):  # no server, or one on a Unix socket, which urllib cannot reach
                return {}
            # A JupyterHub single-user server keeps no token in its runtime file; its kernels have the hub's.
            token = info.get("token") or self._env.get("JUPYTERHUB_API_TOKEN", "")
            url = str(info["url"]).rstrip("/") + "/" + ENDPOINT
            request = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
            with self._opener.open(request, timeout=self._timeout_s) as response:
                return pids_to_notebooks(json.loads(response.read()))
        except Exception:  # whatever went wrong, the caller keeps its own names
            return {}


_default = ServerNotebooks()


def notebook_of_pids(pids: Iterable[int]) -> dict[int, str]:
    """Notebook path of each PID that the Jupyter server this kernel runs under knows; ``{}`` otherwise."""
    return _default.notebook_of_pids(pids)
