"""scripts/setup.sh, run on a copy of the scripts: the torch it chooses, and how it fails; scripts/test.sh's
stages, from its definitions: what each says it checks, and which tests each runs.

Nothing is installed: the torch choices are checked in its dry run (``NBMEM_DRY_RUN=1`` prints the commands),
and the failure test stops at the first pip command, which asks for a torch release that does not exist.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH_PIN = re.findall(r"^torch==(\S+)", (ROOT / "requirements/torch.txt").read_text(), re.M)[0]
PIP = ".venv/bin/python -m pip install --disable-pip-version-check --progress-bar off"


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """What setup.sh reads, copied, so that nothing it does can touch this checkout's .venv."""
    for d in ("scripts", "requirements"):
        shutil.copytree(ROOT / d, tmp_path / d)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def setup(checkout: Path, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("NBMEM_") and k != "VIRTUAL_ENV"}
    # TMPDIR: the log setup.sh keeps when a command fails goes into the test's folder.
    environ |= {"NBMEM_PYTHON": sys.executable, "PIP_RETRIES": "0", "TMPDIR": str(checkout)} | env
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=checkout, env=environ, text=True, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_the_cpu_build_comes_from_pytorchs_cpu_index_before_anything_else(checkout: Path) -> None:
    out = setup(checkout, NBMEM_DRY_RUN="1", NBMEM_TORCH="cpu")
    assert out.returncode == 0, out.stdout
    torch = (f"{PIP} --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple "
             f"torch=={TORCH_PIN}+cpu")
    rest = f"{PIP} -r requirements/dev.txt -e ."
    assert f"would run: {torch}\n" in out.stdout, out.stdout
    assert out.stdout.index(torch) < out.stdout.index(rest), "torch must be installed before nbmem asks for it"
    assert not (checkout / ".venv").exists(), "a dry run made .venv"


def test_the_default_build_says_it_may_be_the_cuda_one_and_how_to_get_the_cpu_one(checkout: Path) -> None:
    out = setup(checkout, NBMEM_DRY_RUN="1", NBMEM_TORCH="default")
    assert out.returncode == 0, out.stdout
    assert f"would run: {PIP} torch=={TORCH_PIN}\n" in out.stdout, out.stdout
    assert "CUDA build" in out.stdout and "NBMEM_TORCH=cpu" in out.stdout, out.stdout


def no_nvidia_driver() -> bool:
    return not Path("/proc/driver/nvidia").exists() and shutil.which("nvidia-smi") is None


@pytest.mark.skipif(sys.platform != "linux" or not no_nvidia_driver(), reason="this machine has an NVIDIA driver")
def test_without_an_nvidia_driver_setup_picks_the_cpu_build_and_says_so_in_one_line(checkout: Path) -> None:
    out = setup(checkout, NBMEM_DRY_RUN="1")
    assert out.returncode == 0, out.stdout
    assert f"torch=={TORCH_PIN}+cpu\n" in out.stdout, out.stdout
    said = [ln for ln in out.stdout.splitlines() if "no NVIDIA driver" in ln]
    assert len(said) == 1 and "CPU build" in said[0] and "NBMEM_TORCH=default" in said[0], out.stdout


@pytest.mark.skipif(sys.platform != "linux", reason="only Linux's PyPI torch is the CUDA build")
def test_with_an_nvidia_driver_setup_leaves_the_build_to_pip(checkout: Path) -> None:
    bin_dir = checkout / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    out = setup(checkout, NBMEM_DRY_RUN="1", PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert out.returncode == 0, out.stdout
    assert f"would run: {PIP} torch=={TORCH_PIN}\n" in out.stdout, out.stdout
    assert f"torch as pip resolves it ({bin_dir}/nvidia-smi; NBMEM_TORCH=cpu overrides)" in out.stdout, out.stdout


def test_an_explicit_choice_is_not_second_guessed(checkout: Path) -> None:
    out = setup(checkout, NBMEM_DRY_RUN="1", NBMEM_TORCH="default")
    assert out.returncode == 0 and "+cpu" not in out.stdout and "NVIDIA driver" not in out.stdout, out.stdout


def test_an_unknown_torch_choice_is_refused(checkout: Path) -> None:
    out = setup(checkout, NBMEM_DRY_RUN="1", NBMEM_TORCH="gpu")
    assert out.returncode == 2 and "default, cpu, cuda, skip" in out.stdout, out.stdout


def test_the_cuda_build_is_the_unlabelled_release_in_the_venv_named_even_without_a_driver(checkout: Path) -> None:
    """What test.sh's "cuda fit" stage makes: torch===PIN, which no local 2.13.0+cpu satisfies, into .venv-cuda."""
    out = setup(checkout, NBMEM_DRY_RUN="1", NBMEM_TORCH="cuda", NBMEM_VENV=".venv-cuda")
    assert out.returncode == 0, out.stdout
    pip = PIP.replace(".venv/", ".venv-cuda/")
    torch, rest = f"{pip} torch==={TORCH_PIN}", f"{pip} -r requirements/dev.txt -e ."
    assert f"would run: {torch}\n" in out.stdout and "CUDA build" in out.stdout, out.stdout
    assert out.stdout.index(torch) < out.stdout.index(rest), "torch must be installed before nbmem asks for it"
    assert "would run: .venv-cuda/bin/python -I" in out.stdout and "NVIDIA driver" not in out.stdout, out.stdout
    assert not (checkout / ".venv-cuda").exists() and not (checkout / ".venv").exists(), "a dry run made a venv"


def test_an_old_python_is_refused_before_anything_is_made(checkout: Path) -> None:
    fake = checkout / "python3.10"
    fake.write_text("#!/bin/sh\necho 3.10.13\n")
    fake.chmod(0o755)
    out = setup(checkout, NBMEM_PYTHON=str(fake))
    assert out.returncode == 1, out.stdout
    assert "is Python 3.10.13; nbmem needs Python 3.11 or newer" in out.stdout, out.stdout
    assert "[1/4]" not in out.stdout and not (checkout / ".venv").exists()


@pytest.mark.slow
def test_a_failing_pip_stops_setup_and_names_the_command(checkout: Path) -> None:
    """The first step is real (a venv, ~5 s); pip then fails on a torch release that does not exist."""
    (checkout / "requirements/torch.txt").write_text("torch==0.0.0\n")
    out = setup(checkout, timeout=180, NBMEM_TORCH="default")
    assert out.returncode != 0, out.stdout
    assert f"FAILED (exit {out.returncode}): {PIP} torch==0.0.0\n" in out.stdout, out.stdout
    assert "last lines of its output" in out.stdout and "torch==0.0.0" in out.stdout.split("last lines")[1]
    assert "[3/4]" not in out.stdout and "setup done" not in out.stdout, "setup went on after the failure"


def test_ci_runs_the_readmes_test_command() -> None:
    command = "bash scripts/test.sh"
    assert command in (ROOT / "README.md").read_text().split("```")[1], "the README's first block names it"
    assert re.search(rf"^{command}$", (ROOT / ".ci/run").read_text(), re.M), ".ci/run must run it verbatim"


def test_one_measured_test_time_everywhere() -> None:
    """The README and test.sh give the same measured time for a whole run, and no other estimate of it."""
    test_sh = (ROOT / "scripts/test.sh").read_text()
    full_run = re.findall(r'^FULL_RUN="(.+)"', test_sh, re.M)
    assert len(full_run) == 1 and re.match(r"\d+ min \d+ s from .+ on a \d+-core", full_run[0]), full_run
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```")[1]
    test_line = next(ln for ln in first_block.splitlines() if "scripts/test.sh" in ln)
    develop = " ".join(readme[readme.index("## Develop"):].split("\n\n")[1].split())
    assert full_run[0] in test_line and full_run[0] in develop, develop
    for text in (test_line, develop, test_sh):
        times = set(re.findall(r"\d+(?:\.\d+)? min(?: \d+ s)?", text.replace(full_run[0], "")))
        # stages' own: setup, pytest, wheel, and cuda fit (making .venv-cuda, and its tests)
        assert times <= {"3 min 36 s", "3 min", "4 min", "24 min", "2 min 30 s", "6 min", "3 min 30 s"}, times


def in_test_sh(definitions: str, script: str) -> str:
    """``script``, run by bash after the definitions of scripts/test.sh that ``definitions`` picks (sed
    addresses); its stdout."""
    code = f'source scripts/lib.sh; eval "$(sed -n {shlex.quote(definitions)} scripts/test.sh)"\n{script}'
    done = subprocess.run(["bash", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_stage_says_what_it_checks_when_it_starts() -> None:
    """A reader of CI's log learns what each stage is, a skipped one too (the leak zoo, absent from a fresh clone)."""
    out = in_test_sh("/^STAGES=/,/^)/p; /^announce()/,/^}/p",
                     'n=0; for s in "${STAGES[@]}"; do announce "$s" "~1 s"; echo "<$s>"; done')
    said = dict(re.findall(r"==> \[\d+/\d+\] (.+?) \(~1 s\)\n(.*?)\n<\1>", out, re.S))
    assert list(said) == ["setup", "chromium", "ruff", "mypy", "js tests", "leak zoo", "pytest", "wheel", "cuda fit"]
    assert all(len(what.split()) >= 2 for what in said.values()), said
    assert "../shared/leak-zoo" in said["leak zoo"] and "catalogue" in said["leak zoo"], said["leak zoo"]
    assert "fresh virtual environment" in said["wheel"] and "/metrics" in said["wheel"], said["wheel"]
    assert max(len(line) for line in out.splitlines()) <= 120, out


@pytest.mark.parametrize(("own", "args", "runs"), [
    ("tests/wheel", "", "tests/wheel"),
    ("tests/wheel", "-x -k lab", "tests/wheel -x -k lab"),
    ("tests/wheel", "tests/wheel/test_wheel.py::test_x -x", "tests/wheel/test_wheel.py::test_x -x"),
    ("tests/wheel", "tests/test_cells.py", None),
    ("tests/wheel", "tests", None),
    ("tests/test_fit.py tests/test_sources.py", "-k peak", "tests/test_fit.py tests/test_sources.py -k peak"),
    ("tests/test_fit.py tests/test_sources.py", "./tests/test_sources.py", "./tests/test_sources.py"),
    ("tests/test_fit.py tests/test_sources.py", "tests/wheel", None),
])
def test_a_stage_of_its_own_tests_takes_the_options_and_is_skipped_for_other_paths(
        own: str, args: str, runs: str | None) -> None:
    """The wheel and cuda fit stages: what they give pytest for test.sh's arguments; None: the stage is skipped."""
    script = f'if own_args {own} -- {args}; then echo "${{OWN_ARGS[*]}}"; else echo SKIP; fi'
    assert in_test_sh("/^own_args()/,/^}/p", script).strip() == (runs or "SKIP")


def test_the_pytest_stage_leaves_the_wheel_tests_to_the_wheel_stage() -> None:
    out = in_test_sh("/^pytest_stage()/p", 'pytest_in() { echo "$*"; }; pytest_stage -x')
    assert out.strip() == ".venv --deselect tests/wheel/ -x"
