"""Cut a release: the CHANGELOG's "Unreleased" section becomes the version, dated, and ``nbmem.__version__`` says it.

    python scripts/release.py 0.4.0            # today's date
    python scripts/release.py 0.4.0 --date 2026-12-01

The version lives in ``nbmem/__init__.py`` (the wheel reads it there) and the CHANGELOG names it with its date;
``tests/test_release.py`` holds the two in step. Refused, with nothing changed: a version that is not above the
last one, a CHANGELOG without an "## Unreleased" section or with nothing under it. Afterwards: commit, tag
``v<version>``, build the wheel (``.venv/bin/python -m build --wheel``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: A released section's heading: "## 0.3.0 (2026-11-27)".
RELEASED = re.compile(r"^## (\d+)\.(\d+)\.(\d+) \((\d{4}-\d{2}-\d{2})\)$", re.M)
#: The section of what changed since: "## Unreleased", or "## Unreleased (0.4.0)" naming the version it will be.
UNRELEASED = re.compile(r"^## Unreleased(?: \((\d+\.\d+\.\d+)\))?$", re.M)
VERSION_LINE = re.compile(r'^__version__ = "(\d+\.\d+\.\d+)"$', re.M)


def version(text: str) -> tuple[int, int, int]:
    parts = text.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"a version is three whole numbers, such as 0.4.0; not {text!r}")
    return int(parts[0]), int(parts[1]), int(parts[2])


def released(changelog: str) -> list[tuple[tuple[int, int, int], str]]:
    """Every released version in the CHANGELOG with its date, newest first as written."""
    return [((int(a), int(b), int(c)), d) for a, b, c, d in RELEASED.findall(changelog)]


def cut(root: Path, new: str, date: str) -> str:
    """Release ``new`` in ``root`` (its CHANGELOG.md and nbmem/__init__.py): what was done, in one line."""
    log_path, init_path = root / "CHANGELOG.md", root / "nbmem" / "__init__.py"
    log, init = log_path.read_text(), init_path.read_text()
    have = VERSION_LINE.search(init)
    if have is None:
        raise ValueError(f"{init_path} has no line __version__ = \"X.Y.Z\"")
    if version(new) <= version(have.group(1)):
        raise ValueError(f"{new} is not above the version now, {have.group(1)}")
    dt.date.fromisoformat(date)  # a ValueError names a date that is none
    head = UNRELEASED.search(log)
    if head is None:
        raise ValueError("CHANGELOG.md has no '## Unreleased' section: nothing to release")
    if head.group(1) not in (None, new):
        raise ValueError(f"CHANGELOG.md's Unreleased section says it will be {head.group(1)}, not {new}")
    nxt = re.compile(r"^## ", re.M).search(log, head.end())
    if not log[head.end():nxt.start() if nxt else len(log)].strip():
        raise ValueError("CHANGELOG.md's Unreleased section is empty: nothing to release")
    log_path.write_text(log[:head.start()] + f"## {new} ({date})" + log[head.end():])
    init_path.write_text(init[:have.start(1)] + new + init[have.end(1):])
    return f"released {new} ({date}): CHANGELOG.md and nbmem/__init__.py; now commit and tag v{new}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/release.py", description=__doc__.split("\n")[0])
    p.add_argument("version", help="the new version, three whole numbers (0.4.0), above the one now")
    p.add_argument("--date", default=dt.date.today().isoformat(), help="the release date, YYYY-MM-DD (today)")
    p.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)  # a copy, for the tests
    args = p.parse_args(argv)
    try:
        print(cut(args.root, args.version, args.date))
    except ValueError as e:
        print(f"release.py: {e}; nothing was changed", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
