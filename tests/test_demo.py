"""scripts/demo.sh, run on a copy of the scripts and notebooks with a stand-in ``jupyter``: the demo opens a copy.

JupyterLab saves a notebook as it runs, outputs and all; the committed notebooks are kept without outputs
(tests/test_notebooks.py), so the demo must open and save copies outside notebooks/, never the notebooks there.
The stand-in records its arguments and working folder, then saves the notebook the demo's URL opens, as
JupyterLab's autosave would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: ``.venv/bin/jupyter`` for the demo: what it was asked, then the opened notebook saved with an output.
JUPYTER = """#!/usr/bin/env bash
printf '%s\\n' "$PWD" "$@" > "$STUB_ARGS"
exec "$(dirname "$0")/python" -c '
import json, sys
from pathlib import Path
args = sys.argv[1:]
root = Path(next(a.split("=", 1)[1] for a in args if a.startswith("--ServerApp.root_dir=")))
url = next(a.split("=", 1)[1] for a in args if a.startswith("--LabApp.default_url="))
path = root / url.removeprefix("/lab/tree/")
nb = json.loads(path.read_text())
nb["cells"][0].setdefault("outputs", []).append({"output_type": "stream", "name": "stdout", "text": "ran"})
path.write_text(json.dumps(nb))
' "$@"
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """What demo.sh reads, copied, with a setup.sh that does nothing and a .venv whose jupyter is the stand-in."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks")
    (tmp_path / "scripts" / "setup.sh").write_text("exit 0\n")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    # This interpreter, with its packages (jupyter_core: the runtime folder the demo reads); a symlink would lose
    # the virtual environment, which Python finds beside the link.
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "jupyter").write_text(JUPYTER)
    for exe in ("python", "jupyter"):
        (bin_dir / exe).chmod(0o755)
    return tmp_path


def demo(checkout: Path) -> tuple[str, list[str]]:
    """Run the demo; what it printed, and the stand-in's working folder followed by its arguments."""
    environ = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "JUPYTER_CONFIG_PATH")}
    environ |= {"STUB_ARGS": str(checkout / "args.txt"), "JUPYTER_RUNTIME_DIR": str(checkout / "runtime")}
    # Into a file, not a pipe: the demo's URL watcher runs on in the background until the server is reaped, and
    # a pipe would stay open until it gave up.
    with (checkout / "demo.log").open("w") as log:
        done = subprocess.run(["bash", "scripts/demo.sh"], cwd=checkout, env=environ, timeout=60, stdout=log,
                              stderr=subprocess.STDOUT)
    printed = (checkout / "demo.log").read_text()
    assert done.returncode == 0, printed
    return printed, (checkout / "args.txt").read_text().splitlines()


def test_the_demo_opens_a_copy_and_the_committed_notebooks_stay_as_they_are(checkout: Path) -> None:
    committed = {p.name: p.read_bytes() for p in (checkout / "notebooks").glob("*.ipynb")}
    out, (cwd, *args) = demo(checkout)
    assert args[0] == "lab" and Path(cwd) == checkout
    root = Path(next(a.split("=", 1)[1] for a in args if a.startswith("--ServerApp.root_dir=")))
    assert root == checkout / "demo", "JupyterLab serves the copies only"
    assert "--LabApp.default_url=/lab/tree/quickstart.ipynb" in args
    assert {p.name: p.read_bytes() for p in (checkout / "notebooks").glob("*.ipynb")} == committed
    assert {p.name for p in root.glob("*.ipynb")} == set(committed), "every notebook has its copy"
    saved = json.loads((root / "quickstart.ipynb").read_text())
    assert saved["cells"][0]["outputs"], "the stand-in saved the copy, as JupyterLab's autosave would"
    assert "copies in demo/" in out, out


def test_a_later_demo_keeps_the_copies_as_they_were_left_and_replaces_a_deleted_one(checkout: Path) -> None:
    demo(checkout)
    copies = checkout / "demo"
    ran = (copies / "quickstart.ipynb").read_bytes()
    (copies / "timeline.ipynb").unlink()
    demo(checkout)
    assert json.loads((copies / "quickstart.ipynb").read_text())["cells"][0]["outputs"] == \
        json.loads(ran)["cells"][0]["outputs"] * 2, "the run's outputs stayed, and the second run saved more"
    assert (copies / "timeline.ipynb").read_bytes() == (checkout / "notebooks" / "timeline.ipynb").read_bytes()


def test_git_ignores_the_demos_copies() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", "demo/quickstart.ipynb"], cwd=ROOT)
    assert ignored.returncode == 0, "demo/ must be in .gitignore"
