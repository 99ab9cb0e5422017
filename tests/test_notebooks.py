"""The notebooks run top to bottom in a real kernel, and the Binder install steps work from scratch.

Both are slow (a kernel per notebook; a fresh virtual environment), hence ``-m "not slow"`` skips them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: What nbmem prints when one of its own hooks failed; a notebook that shows it is broken for its reader.
FAULT = "nbmem: an internal error"
#: Printed by the new environment's Python: where nbmem and torch came from.
PROBE = """
import json, pathlib, nbmem, torch
static = pathlib.Path(nbmem.__file__).parent / "static"
print(json.dumps({"nbmem": nbmem.__version__, "file": nbmem.__file__, "torch": torch.__version__,
                  "cuda_build": torch.version.cuda, "static": sorted(p.name for p in static.glob("*"))}))
"""


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
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
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


@pytest.mark.slow
def test_binder_install(tmp_path: Path) -> None:
    """What Binder does, minus Binder: requirements.txt, then postBuild, in a fresh environment.

    Then JupyterLab has the widget extensions, torch is the CPU build, nbmem is installed as a wheel
    (with its JavaScript), and the quickstart runs top to bottom in that environment's kernel.
    """
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True)
    bin_dir = env_dir / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "JUPYTER_PATH")}
    env |= {"PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "VIRTUAL_ENV": str(env_dir),
            "PIP_RETRIES": "0",  # an unreachable extra index (an offline mirror) fails fast instead of retrying
            "PIP_DISABLE_PIP_VERSION_CHECK": "1"}

    def run(*cmd: str, cwd: Path = ROOT, timeout: float = 600) -> str:
        """Run in the new environment (from the repository root, like Binder); stdout and stderr together."""
        done = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-6000:]}"
        return done.stdout

    run("python", "-m", "pip", "install", "-r", "binder/requirements.txt")
    run("bash", "binder/postBuild")

    # Away from the checkout, so that `import nbmem` cannot find the source tree instead of the install.
    probe = run("python", "-c", PROBE, cwd=tmp_path)
    info = json.loads(probe.strip().splitlines()[-1])
    assert info["torch"].startswith("2.13.0") and info["cuda_build"] is None, info
    assert str(env_dir) in info["file"], f"nbmem was not installed into the new environment: {info}"
    js = sorted(p.name for p in (ROOT / "js").glob("*.js"))
    assert set(js) <= set(info["static"]), f"the wheel lacks the widget's JavaScript: {info['static']}"

    extensions = run("jupyter", "labextension", "list")  # it writes the list to stderr
    for ext in ("anywidget", "@jupyter-widgets/jupyterlab-manager", "@jupyter-widgets/jupyterlab-sidecar"):
        assert ext in extensions, f"{ext} is not enabled in JupyterLab:\n{extensions}"

    run("jupyter", "execute", "--kernel_name=python3", "notebooks/quickstart.ipynb", timeout=300)
