"""The version and the CHANGELOG stay in step, and ``scripts/release.py`` cuts the next release keeping them so."""

from __future__ import annotations

import datetime as dt
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import nbmem

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "release.py"


def headings(changelog: str) -> list[str]:
    return re.findall(r"^## (.+)$", changelog, re.M)


def in_step(root: Path) -> list[str]:
    """What is out of step between ``root``'s CHANGELOG and its ``__version__`` (nothing: in step)."""
    log = (root / "CHANGELOG.md").read_text()
    init = (root / "nbmem" / "__init__.py").read_text()
    version = re.search(r'^__version__ = "([^"]+)"$', init, re.M)
    problems = [] if version else ["no __version__ line"]
    dated = []
    for h in headings(log):
        m = re.fullmatch(r"(\d+\.\d+\.\d+) \((\d{4}-\d{2}-\d{2})\)", h)
        if m:
            dated.append((tuple(int(x) for x in m.group(1).split(".")), m.group(1), dt.date.fromisoformat(m.group(2))))
        elif not re.fullmatch(r"Unreleased( \(\d+\.\d+\.\d+\))?", h):
            problems.append(f"a heading that is neither a dated version nor Unreleased: {h!r}")
    if not dated:
        return [*problems, "no released version"]
    if version and dated[0][1] != version.group(1):
        problems.append(f"__version__ is {version.group(1)}, the newest release in the CHANGELOG {dated[0][1]}")
    if [d[0] for d in dated] != sorted((d[0] for d in dated), reverse=True):
        problems.append("the releases are not newest first")
    if [d[2] for d in dated] != sorted((d[2] for d in dated), reverse=True) or dated[0][2] > dt.date.today():
        problems.append("the release dates are not newest first, or one is in the future")
    first = headings(log)[0]
    if first.startswith("Unreleased (") and tuple(int(x) for x in first[12:-1].split(".")) <= dated[0][0]:
        problems.append(f"'{first}' is not above the last release")
    return problems


def test_the_version_is_the_newest_dated_release_in_the_changelog() -> None:
    assert in_step(ROOT) == []
    assert nbmem.__version__ == "0.3.0"  # what this checkout released, typed by hand


def copy(tmp_path: Path) -> Path:
    """The checkout's CHANGELOG and version as released: an Unreleased section it has now is left out."""
    (tmp_path / "nbmem").mkdir()
    text = (ROOT / "CHANGELOG.md").read_text()
    text = re.sub(r"\n## Unreleased\b.*?(?=\n## )", "", text, count=1, flags=re.S)
    (tmp_path / "CHANGELOG.md").write_text(text)
    shutil.copy(ROOT / "nbmem" / "__init__.py", tmp_path / "nbmem" / "__init__.py")
    return tmp_path


def release(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args, "--root", str(root)], capture_output=True, text=True)


def test_cutting_the_next_release_keeps_the_two_in_step(tmp_path: Path) -> None:
    root = copy(tmp_path)
    log = root / "CHANGELOG.md"
    text = log.read_text()
    # what a developer does after a release: an Unreleased section with a change in it
    log.write_text(text.replace("\n## 0.3.0 (", "\n## Unreleased\n\n- A change.\n\n## 0.3.0 (", 1))
    assert in_step(root) == []
    today = dt.date.today().isoformat()
    done = release(root, "0.3.1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"released 0.3.1 ({today})")
    assert headings(log.read_text())[:2] == [f"0.3.1 ({today})", "0.3.0 (2026-11-27)"]
    assert '__version__ = "0.3.1"' in (root / "nbmem" / "__init__.py").read_text()
    assert in_step(root) == []


@pytest.mark.parametrize(("args", "said"), [
    (["0.3.0"], "0.3.0 is not above the version now, 0.3.0"),
    (["0.2.9"], "0.2.9 is not above"),
    (["0.4"], "a version is three whole numbers"),
    (["0.4.0", "--date", "2026-13-01"], "month must be in 1..12"),
])
def test_a_release_that_is_wrong_is_refused_and_changes_nothing(tmp_path: Path, args: list[str], said: str) -> None:
    root = copy(tmp_path)
    log = root / "CHANGELOG.md"
    log.write_text(log.read_text().replace("\n## 0.3.0 (", "\n## Unreleased\n\n- A change.\n\n## 0.3.0 (", 1))
    before = log.read_text(), (root / "nbmem" / "__init__.py").read_text()
    done = release(root, *args)
    assert done.returncode == 2 and said in done.stderr and "nothing was changed" in done.stderr, done.stderr
    assert (log.read_text(), (root / "nbmem" / "__init__.py").read_text()) == before


def test_a_release_with_nothing_unreleased_is_refused(tmp_path: Path) -> None:
    root = copy(tmp_path)  # the checkout as released: no Unreleased section
    done = release(root, "0.3.1")
    assert done.returncode == 2 and "no '## Unreleased' section" in done.stderr
    log = root / "CHANGELOG.md"
    log.write_text(log.read_text().replace("\n## 0.3.0 (", "\n## Unreleased\n\n## 0.3.0 (", 1))
    assert "section is empty" in release(root, "0.3.1").stderr


def test_the_check_sees_a_version_out_of_step(tmp_path: Path) -> None:
    root = copy(tmp_path)
    init = root / "nbmem" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "0.3.0"', '__version__ = "0.2.0"'))
    assert in_step(root) == ["__version__ is 0.2.0, the newest release in the CHANGELOG 0.3.0"]


def test_the_wheel_reads_its_version_where_the_release_writes_it() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["hatch"]["version"]["path"] == "nbmem/__init__.py"
