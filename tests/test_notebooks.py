"""The notebooks run top to bottom in a real kernel, and the Binder install steps work from scratch.

Both are slow (a kernel per notebook; a fresh virtual environment), hence ``-m "not slow"`` skips them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: What nbmem prints when one of its own hooks failed; a notebook that shows it is broken for its reader.
FAULT = "nbmem: an internal error"
#: Notebooks that fail because of a known nbmem bug, with the bug. Strict: once the bug is fixed the test
#: passes, xfail(strict=True) turns that into a failure, and the entry must go.
KNOWN_BUGS: dict[str, str] = {}
#: Printed by the new environment's Python: where nbmem and torch came from.
PROBE = """
import json, nbmem, torch
from nbmem.ui.frontend import bundle, js_dir
print(json.dumps({"nbmem": nbmem.__version__, "file": nbmem.__file__, "torch": torch.__version__,
                  "cuda_build": torch.version.cuda, "js_dir": str(js_dir()), "js_bytes": len(bundle())}))
"""


def _known_bug(name: str) -> Any:
    return [pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[name])] if name in KNOWN_BUGS else []


NOTEBOOK_PARAMS = [pytest.param(p, id=p.stem, marks=_known_bug(p.stem)) for p in NOTEBOOKS]


@pytest.fixture
def kernel_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kernelspec for this interpreter, found first, whatever other ``python3`` kernels the machine has."""
    spec = tmp_path / "jupyter" / "kernels" / "nbmem-test"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "nbmem test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return "nbmem-test"


def test_there_are_notebooks() -> None:
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "leak-gallery.ipynb", "timeline.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stripped(path: Path) -> None:
    """Outputs are not committed: they would go stale, and they bloat diffs."""
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, cell["source"][:80]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOK_PARAMS)
def test_notebook_runs(path: Path, kernel_name: str) -> None:
    """Run All in a fresh kernel: no cell may fail (their asserts check the story they tell)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name=kernel_name, timeout=120, startup_timeout=60,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    faults = [(cell.execution_count, out.get("text", ""))
              for cell in nb.cells if cell.cell_type == "code"
              for out in cell.outputs if out.output_type == "stream" and FAULT in out.get("text", "")]
    assert not faults, f"nbmem reported an internal error while running {path.name}: {faults}"


class Env:
    """A virtual environment made the way Binder makes its own; ``run`` runs a command inside it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "JUPYTER_PATH")}
        self.environ = env | {
            "PATH": f"{path / 'bin'}{os.pathsep}{env['PATH']}", "VIRTUAL_ENV": str(path),
            "PIP_RETRIES": "0",  # an unreachable extra index (an offline mirror) fails fast instead of retrying
            "PIP_DISABLE_PIP_VERSION_CHECK": "1"}

    def run(self, *cmd: str, cwd: Path = ROOT, timeout: float = 600) -> str:
        """Run from the repository root (as Binder does) unless told otherwise; stdout and stderr together."""
        done = subprocess.run(cmd, cwd=cwd, env=self.environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-6000:]}"
        return done.stdout


@pytest.fixture(scope="module")
def binder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """What Binder does, minus Binder: a fresh environment, ``binder/requirements.txt``, then ``postBuild``."""
    path = tmp_path_factory.mktemp("binder") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    env = Env(path)
    env.run("python", "-m", "pip", "install", "-r", "binder/requirements.txt")
    env.run("bash", "binder/postBuild")
    yield env


@pytest.mark.slow
def test_binder_install(binder: Env, tmp_path: Path) -> None:
    """torch is the CPU build; nbmem is installed as a wheel with the gauge's JavaScript; JupyterLab has widgets."""
    # Away from the checkout, so that `import nbmem` cannot find the source tree instead of the install.
    info = json.loads(binder.run("python", "-c", PROBE, cwd=tmp_path).strip().splitlines()[-1])
    assert info["torch"].startswith("2.13.0") and info["cuda_build"] is None, info
    assert str(binder.path) in info["file"], f"nbmem was not installed into the new environment: {info}"
    assert str(binder.path) in info["js_dir"] and info["js_bytes"] > 0, f"the gauge's JavaScript is missing: {info}"

    extensions = binder.run("jupyter", "labextension", "list")  # it writes the list to stderr
    for ext in ("anywidget", "@jupyter-widgets/jupyterlab-manager", "@jupyter-widgets/jupyterlab-sidecar"):
        assert ext in extensions, f"{ext} is not enabled in JupyterLab:\n{extensions}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param("quickstart", marks=_known_bug("quickstart"))])
def test_binder_runs_quickstart(binder: Env, name: str) -> None:
    """The notebook Binder opens runs top to bottom in that environment's own kernel."""
    binder.run("jupyter", "execute", "--kernel_name=python3", f"notebooks/{name}.ipynb", timeout=300)
