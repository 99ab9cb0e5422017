"""A real Jupyter server (JupyterLab or Notebook 7) on a free loopback port, isolated in one folder, and
the Chromium that drives it, as research/browser-recipe.md found works. Used by the browser tests and by
scripts/readme_pictures.py; it needs no pytest."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
#: Front-end plugins off by default: the news pop-up would cover the notebook.
ANNOUNCEMENTS = "@jupyterlab/apputils-extension:announcements"
LAB = ["jupyterlab", "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
NOTEBOOK7 = ["notebook", "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A running Jupyter server: its base URL, token and root folder."""

    def __init__(self, root: Path, port: int, token: str, proc: subprocess.Popen[bytes]) -> None:
        self.root = root
        self.base = f"http://127.0.0.1:{port}"
        self.token = token
        self.proc = proc

    def url(self, path: str) -> str:
        return f"{self.base}/{path.lstrip('/')}{'&' if '?' in path else '?'}token={self.token}"


@contextmanager
def serve(d: Path, app: list[str], *, disabled: tuple[str, ...] = (ANNOUNCEMENTS,)) -> Iterator[Server]:
    """``python -m <app...>`` isolated in ``d`` (its own config, runtime, IPython and data dirs), stopped after."""
    for sub in ("cfg/labconfig", "rt", "ipy", "data"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "cfg/labconfig/page_config.json").write_text(json.dumps({"disabledExtensions": dict.fromkeys(disabled, True)}))
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(d / "cfg"), "JUPYTER_RUNTIME_DIR": str(d / "rt"),
           "IPYTHONDIR": str(d / "ipy"), "JUPYTER_DATA_DIR": str(d / "data")}
    env.pop("VSCODE_PID", None)  # the gauge would go inline instead of into the sidebar
    env.pop("VSCODE_CWD", None)
    with (d / "server.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", *app, "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--allow-root",
             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={d}", "--KernelManager.transport=ipc"],
            env=env, cwd=d, stdout=log, stderr=subprocess.STDOUT)
        server = Server(d, port, token, proc)
        try:
            deadline = time.monotonic() + 60  # generous: a loaded 2-core CI machine
            while True:
                try:
                    with urllib.request.urlopen(server.url("/api/status"), timeout=1):
                        break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"{app[0]} did not start:\n"
                                           + (d / "server.log").read_text()[-3000:]) from None
                    time.sleep(0.2)
            yield server
        finally:
            proc.terminate()  # it shuts its kernels down too
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
