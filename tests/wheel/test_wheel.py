"""nbmem as users install it: the wheel, built from a clean copy of this checkout, installed in a fresh virtual
environment and used away from the repository, in terminal IPython, in JupyterLab and through the server extension.

The environment gets torch first, the build and version ``.venv`` has (setup.sh's choice for this machine, from
the same index, so pip finds it in its cache), then the wheel with its ``server`` extra and JupyterLab, pinned by
``requirements/dev.txt``. Every command it runs starts in a temporary folder; the terminal and the JupyterLab tests
check that ``nbmem`` and the gauge's sources are the fresh environment's, and that no entry of ``sys.path`` is
inside this repository.

``scripts/test.sh`` runs this folder as its "wheel" stage (~2 min 30 s on 2 cores, most of it pip making the
environment) and leaves it out of its pytest stage; ``-m "not slow"`` skips it, ``-m "not browser"`` its JupyterLab
test.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import nbformat
import pytest

from tests.browser.conftest import Cells
from tests.browser.jupyter import CHROMIUM, LAB, Server, serve
from tests.test_notebooks import Env
from tests.test_readme import blocks
from tests.test_terminal import answers

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
#: The README's "Thirty seconds": loading nbmem and the data, the validation cell that leaks, its cleanup.
README = blocks("python")[:3]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# --no-compile: byte-compiling every module of torch takes longer than these tests; Python compiles what it imports.
PIP = ["python", "-m", "pip", "install", "--no-compile", "--progress-bar", "off"]
#: One line a front end prints: where nbmem and the gauge's sources came from, and the interpreter's path.
PROBE = ("import json, os, sys, nbmem, nbmem.ui.frontend; print('WHERE ' + json.dumps({'nbmem': nbmem.__file__, "
         "'js_dir': str(nbmem.ui.frontend.js_dir()), 'sys_path': [os.path.abspath(p) for p in sys.path]}))")


@dataclass(frozen=True)
class Built:
    """The wheel and the clean copy it was built from."""

    wheel: Path
    checkout: Path


@dataclass(frozen=True)
class Fresh:
    """The fresh environment: ``env`` runs commands in it; ``site`` is its site-packages."""

    env: Env
    site: Path

    @property
    def python(self) -> Path:
        return self.env.path / "bin" / "python"


def clean_copy(dest: Path) -> None:
    """What a fresh clone of this checkout holds, edits not yet committed included: the files git tracks or
    would track (nothing ignored: no .venv, no build output, no caches)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():  # a tracked file deleted in the working tree is not in a fresh clone either
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


def torch_args() -> list[str]:
    """pip's arguments for torch as ``.venv`` has it, asked for as setup.sh asks: the CPU build from PyTorch's
    index (PyPI as well, for its dependencies); any other build, that exact release from PyPI."""
    version = importlib.metadata.version("torch")
    if version.endswith("+cpu"):
        return ["--index-url", CPU_INDEX, "--extra-index-url", "https://pypi.org/simple", f"torch=={version}"]
    return [f"torch==={version}"]


def took(t0: float) -> str:
    return f"{time.monotonic() - t0:.0f} s"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The wheel, as pip builds it (hatchling, in an isolated build environment) from a clean copy."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the wheel is built from the files git tracks")
    t0 = time.monotonic()
    checkout = tmp_path_factory.mktemp("checkout")
    clean_copy(checkout)
    out = checkout.parent / "dist"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--progress-bar", "off", "-w", str(out),
                           str(checkout)], cwd=checkout.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (wheel,) = out.glob("nbmem-*.whl")
    print(f"\n    built {wheel.name} ({wheel.stat().st_size // 1024} KiB) from a clean copy in {took(t0)}")
    return Built(wheel, checkout)


@pytest.fixture(scope="module")
def fresh(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Fresh:
    """A new virtual environment with torch, then the wheel with its server extra, and JupyterLab."""
    t0 = time.monotonic()
    path = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    env = Env(path)
    env.run(*PIP, *torch_args(), cwd=path.parent)
    t1 = time.monotonic()
    env.run(*PIP, "-c", str(built.checkout / "requirements/dev.txt"), f"{built.wheel}[server]", "jupyterlab",
            cwd=path.parent)
    versions = env.run("python", "-c", "import importlib.metadata as m; print(m.version('torch'), "
                       "m.version('jupyterlab'))", cwd=path.parent).split()
    print(f"\n    fresh environment in {took(t0)}: torch {versions[0]} in {t1 - t0:.0f} s, then the wheel[server] "
          f"and jupyterlab {versions[1]} in {took(t1)}")
    (site,) = path.glob("lib/python3*/site-packages")
    return Fresh(env, site)


def where(text: str) -> dict[str, Any]:
    """The PROBE's answer in ``text``."""
    m = re.search(r"WHERE (\{.*\})", text)
    assert m, text[-3000:]
    return dict(json.loads(m.group(1)))


def assert_from_the_wheel(fresh: Fresh, probe: dict[str, Any]) -> None:
    assert Path(probe["nbmem"]) == fresh.site / "nbmem/__init__.py", probe["nbmem"]
    assert Path(probe["js_dir"]) == fresh.site / "nbmem/static", "the gauge's sources are not the wheel's"
    inside = [p for p in probe["sys_path"] if Path(p).resolve().is_relative_to(ROOT)]
    assert not inside, f"the repository is on the path: {inside}"


def test_the_wheel_holds_the_package_its_front_end_and_the_server_config(built: Built) -> None:
    with zipfile.ZipFile(built.wheel) as z:
        names = set(z.namelist())
        data = [n for n in names if n.endswith(".data/data/etc/jupyter/jupyter_server_config.d/nbmem.json")]
        assert len(data) == 1, "the wheel does not install the config that turns the server extension on"
        config = json.loads(z.read(data[0]))
        static = {n.rsplit("/", 1)[1]: z.read(n) for n in names if n.startswith("nbmem/static/")}
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    code = {p.relative_to(built.checkout).as_posix() for p in (built.checkout / "nbmem").rglob("*.py")}
    assert code <= names and "nbmem/py.typed" in names, sorted(code - names)
    front = {p.name: p.read_bytes() for p in (built.checkout / "js").iterdir()
             if p.suffix in (".js", ".json") and not p.name.endswith(".test.js")}
    assert static == front, "nbmem/static/ is not js/ without its tests"
    assert config == json.loads((built.checkout / "jupyter-config/jupyter_server_config.d/nbmem.json").read_text())
    assert {n.split("/")[0].split("-")[0] for n in names} == {"nbmem"}, "the wheel holds more than nbmem"
    assert "Provides-Extra: server" in meta and re.search(r"^Requires-Dist: torch$", meta, re.M), meta[:2000]


def test_the_readme_in_terminal_ipython(fresh: Fresh, tmp_path: Path) -> None:
    env = {**fresh.env.environ, "IPYTHONDIR": str(tmp_path / "ipython"), "COLUMNS": "80"}
    cells = "\n".join([*README, PROBE, "exit", ""])
    done = subprocess.run([str(fresh.python), "-m", "IPython", "--simple-prompt", "--colors=nocolor", "--no-banner",
                           "--HistoryManager.hist_file=:memory:"], input=cells, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert "Traceback" not in text and "internal error" not in text and "fault in" not in text, text
    said = answers(text)
    assert re.search(r"^val_losses\b", next(a for a in said if "val_losses " in a), re.M), text
    assert next(a for a in said if "nbmem cleanup" in a).startswith("nbmem cleanup: freed"), text
    assert_from_the_wheel(fresh, where(text))


@pytest.fixture(scope="module")
def lab(fresh: Fresh, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """JupyterLab of the fresh environment (its kernel too), started by the browser tests' harness."""
    with ExitStack() as stack:
        # serve() runs `sys.executable -m jupyterlab` with this process's environment: the fresh environment's,
        # for as long as it starts the server.
        with mock.patch.object(sys, "executable", str(fresh.python)), \
                mock.patch.dict(os.environ, fresh.env.environ, clear=True):
            server = stack.enter_context(serve(tmp_path_factory.mktemp("lab"), LAB))
        yield server


@pytest.fixture
def chromium() -> None:
    """Skips a test without Chromium (asked for before ``page``, which would fail to launch it)."""
    if not shutil.which(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: bash scripts/test.sh installs it when run as root, or apt-get install "
                    f"chromium")


@pytest.mark.browser
def test_the_readme_in_jupyterlab_draws_the_gauge_from_the_wheel(fresh: Fresh, lab: Server, chromium: None,
                                                                  page: Any, artifacts: Path) -> None:
    from playwright.sync_api import expect

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in [*README, PROBE]])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, lab.root / "readme.ipynb")
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(30_000)

    page.goto(lab.url("/lab/tree/readme.ipynb?reset"))
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for()
    cells = Cells(page)
    cells.run(0)
    gauge = page.locator("#jp-right-stack .nbmem-gauge")
    expect(gauge).to_have_count(1)
    expect(gauge.locator("section[data-device]").first).to_be_visible()
    cells.run(1)
    assert "val_losses" in cells.output(1), cells.output(1)
    cells.run(2)
    assert cells.output(2).startswith("nbmem cleanup: freed"), cells.output(2)
    cells.run(3)
    assert_from_the_wheel(fresh, where(cells.output(3)))
    page.mouse.move(0, 0)
    page.screenshot(path=str(artifacts / "wheel-lab.png"))
    assert not [e for e in errors if "nbmem" in e or "anywidget" in e], errors


def test_the_server_extension_is_on_and_answers(lab: Server) -> None:
    from nbmem.server import metric_families

    assert "nbmem | extension was successfully loaded." in (lab.root / "server.log").read_text()
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy

    def get(path: str) -> str:
        with opener.open(lab.url(path), timeout=30) as r:
            return str(r.read().decode())

    reading = json.loads(get("/api/nbmem/gpu"))
    assert set(reading) == {"gpus", "reason"} and (reading["gpus"] or reading["reason"]), reading
    metrics = get("/metrics")
    for family in metric_families(None):
        assert f"# TYPE {family.name} {family.type}" in metrics, family.name
    assert "# TYPE nbmem_kernel_deaths_total counter" in metrics
    for gpu in reading["gpus"]:
        assert f'nbmem_gpu_memory_total_bytes{{gpu="{gpu["index"]}"}}' in metrics, metrics
