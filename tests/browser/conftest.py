"""A real JupyterLab on a free loopback port and headless Chromium, as research/browser-recipe.md found works."""

from __future__ import annotations

import json
import os
import re
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


class Server:
    """A running Jupyter server (JupyterLab or Notebook 7): its base URL, token and root folder."""

    def __init__(self, root: Path, port: int, token: str, proc: subprocess.Popen[bytes]) -> None:
        self.root = root
        self.base = f"http://127.0.0.1:{port}"
        self.token = token
        self.proc = proc

    def url(self, path: str) -> str:
        return f"{self.base}/{path.lstrip('/')}{'&' if '?' in path else '?'}token={self.token}"


def _serve(d: Path, app: list[str]) -> Iterator[Server]:
    """``python -m <app...>`` isolated in ``d`` (its own config, runtime, IPython and data dirs), stopped after."""
    if not shutil.which(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: bash scripts/test.sh installs it when run as root, "
                    f"or apt-get install chromium")
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
                    raise RuntimeError(f"{app[0]} did not start:\n" + (d / "server.log").read_text()[-3000:]) from None
                time.sleep(0.2)
        yield server
    finally:
        proc.terminate()  # it shuts its kernels down too
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve(tmp_path_factory.mktemp("lab"), [
        "jupyterlab", "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"])


@pytest.fixture(scope="session")
def notebook7(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Jupyter Notebook 7 (the `notebook` package), the same isolation as ``lab``."""
    notebook = pytest.importorskip("notebook")
    if not notebook.__version__.startswith("7."):
        pytest.skip(f"notebook {notebook.__version__} is not Notebook 7: pip install -r requirements/dev.txt")
    yield from _serve(tmp_path_factory.mktemp("notebook7"), [
        "notebook", "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"])


class Cells:
    """The open notebook's cells (JupyterLab or Notebook 7): run one like a user (click it, Shift+Enter), read it."""

    PROMPT_DONE = re.compile(r"^\[\d+\]:$")

    def __init__(self, page: Any) -> None:
        self.page = page
        self.cells = page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell")

    def prompt(self, i: int) -> str:
        return str(self.cells.nth(i).locator(".jp-InputPrompt").inner_text()).strip()

    def start(self, i: int) -> str:
        """Run cell i without waiting for it; returns its prompt from before."""
        from playwright.sync_api import expect

        expect(self.cells.nth(i).locator(".jp-InputPrompt")).to_have_text(re.compile(r"^\[[ \d]+\]:$"))
        before = self.prompt(i)
        for _ in range(20):
            self.cells.nth(i).locator(".jp-InputArea-editor").click()
            self.page.keyboard.press("Shift+Enter")
            # A run asked for while the kernel is still connecting is dropped (the prompt stays
            # "[ ]:"); once accepted it turns "[*]:" at once, so asking again is safe.
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                p = self.prompt(i)
                if p == "[*]:" or (p != before and self.PROMPT_DONE.match(p)):
                    return before
                time.sleep(0.05)
        raise AssertionError(f"cell {i} never started")

    def wait(self, i: int, before: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            p = self.prompt(i)
            if p != before and self.PROMPT_DONE.match(p):
                return
            assert time.monotonic() < deadline, f"cell {i} did not finish (prompt {p!r})"
            time.sleep(0.05)

    def run(self, i: int) -> None:
        self.wait(i, self.start(i))

    def output(self, i: int) -> str:
        return str(self.cells.nth(i).locator(".jp-OutputArea").inner_text())


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "ud"), executable_path=CHROMIUM, headless=True,
                                                   args=FLAGS, viewport={"width": 1400, "height": 1000})
        page = ctx.pages[0] if ctx.pages else ctx.new_page()
        # A run asked for before the notebook's kernel has started can make JupyterLab ask which kernel to
        # start, although the notebook names one; the choice it offers first is that one (python3): take it.
        dialog = page.locator(".jp-Dialog", has_text="Select Kernel")
        page.add_locator_handler(dialog, lambda d: d.locator(".jp-mod-accept").click())
        try:
            yield page
        finally:
            ctx.close()


@pytest.fixture
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
