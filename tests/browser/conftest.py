"""A real JupyterLab on a free loopback port and headless Chromium, as research/browser-recipe.md found works."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Lab:
    """A running JupyterLab server: its base URL, token and root folder."""

    def __init__(self, root: Path, port: int, token: str, proc: subprocess.Popen[bytes]) -> None:
        self.root = root
        self.base = f"http://127.0.0.1:{port}"
        self.token = token
        self.proc = proc

    def url(self, path: str) -> str:
        return f"{self.base}/{path.lstrip('/')}{'&' if '?' in path else '?'}token={self.token}"


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    if not shutil.which(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: bash scripts/test.sh installs it when run as root, "
                    f"or apt-get install chromium")
    d = tmp_path_factory.mktemp("lab")
    for sub in ("cfg/labconfig", "rt", "ipy", "data"):
        (d / sub).mkdir(parents=True)
    # The announcements toast ("get notified about news?") would cover the notebook.
    (d / "cfg/labconfig/page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(d / "cfg"), "JUPYTER_RUNTIME_DIR": str(d / "rt"),
           "IPYTHONDIR": str(d / "ipy"), "JUPYTER_DATA_DIR": str(d / "data")}
    env.pop("VSCODE_PID", None)  # the gauge would go inline instead of into the sidebar
    env.pop("VSCODE_CWD", None)
    log = (d / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--allow-root",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={d}", "--KernelManager.transport=ipc",
         "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, cwd=d, stdout=log, stderr=subprocess.STDOUT)
    server = Lab(d, port, token, proc)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(server.url("/api/status"), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n" + (d / "server.log").read_text()[-3000:]) from None
                time.sleep(0.2)
        yield server
    finally:
        proc.terminate()  # it shuts its kernels down too
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "ud"), executable_path=CHROMIUM, headless=True,
                                                   args=FLAGS, viewport={"width": 1400, "height": 1000})
        try:
            yield ctx.pages[0] if ctx.pages else ctx.new_page()
        finally:
            ctx.close()


@pytest.fixture
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
