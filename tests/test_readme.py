"""README.md as a newcomer reads it: its code runs as written, and what it lists is what exists."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from nbmem.ipython.magics import COMMANDS
from nbmem.ipython.root import session_of
from nbmem.options import OPTIONS
from tests.conftest import ok, run

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, re.S)


def blocks(lang: str) -> list[str]:
    return [body for kind, body in BLOCKS if kind == lang]


def test_the_first_lines_are_the_two_commands():
    first = blocks("bash")[0].strip().splitlines()
    assert [ln.split("#")[0].strip() for ln in first] == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    assert (ROOT / ".ci/run").read_text().strip().endswith("bash scripts/test.sh")


def test_the_python_blocks_run_in_order_and_find_the_leak_they_describe(shell):
    for body in blocks("python"):
        r = run(shell, body)
        assert r.success, (body, r.error_before_exec or r.error_in_exec)
        if "val_losses.append" in body:
            report = session_of(shell).last_report
            names = {f.name for f in report.findings}
            assert "val_losses" in names, names
            losses = next(f for f in report.findings if f.name == "val_losses")
            assert losses.tensors == 4 and losses.graph_bytes > 0 and losses.holds_graph
            assert {m.name for m in losses.members} == {f"val_losses[{i}]" for i in range(4)}
            assert any(f.kind == "output" for f in report.findings)
        if "--last-report" in body:
            rep = session_of(shell).last_cleanup
            assert r.result is None, "the cleanup's table is shown, not kept in Out[]"
            assert "val_losses" not in shell.user_ns and list(shell.user_ns["Out"]) == []
            assert rep.freed_allocated_bytes > 4 * 2**20
            # The cell that cleaned reports the same fall: its baseline is not re-read after the graphs died.
            cpu = next(c for c in session_of(shell).last_report.records if c.device == "cpu")
            assert cpu.delta_allocated_bytes == -rep.freed_allocated_bytes, (cpu, rep)


@pytest.mark.parametrize("line", [ln for b in blocks("bash") for ln in b.strip().splitlines()])
def test_every_shell_command_is_real(line):
    cmd = line.split("  #")[0].strip()
    words = shlex.split(cmd)
    env = dict(os.environ)
    while words and "=" in words[0]:
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    if words[:1] == ["bash"]:
        script = ROOT / words[1]
        assert script.is_file(), script
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
        if "NBMEM_TORCH" in env:  # the CPU route: what setup would run, without running it
            out = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, capture_output=True, text=True,
                                 env={**env, "NBMEM_DRY_RUN": "1"}, timeout=120)
            assert out.returncode == 0 and "CPU build" in out.stdout, out.stdout + out.stderr
    else:
        assert words[:2] == ["pip", "install"], cmd


def test_every_option_and_command_is_in_the_readme():
    for o in OPTIONS:
        assert f"`{o.name}`" in README, o.name
    for command in COMMANDS:
        assert f"%cudamem {command}" in README, command


def test_linked_files_and_pictured_modules_exist():
    for target in re.findall(r"\]\(((?!https?:|#)[^)]+)\)", README):
        assert (ROOT / target).exists(), target
    start = README.index("## How it is built")
    picture = blocks("")[0] if blocks("") else README[start:README.index("\n## ", start)]
    for module in set(re.findall(r"(?<![/\w])(\w+)\.py", picture)):  # bare names: nbmem modules
        assert list((ROOT / "nbmem").rglob(f"{module}.py")), module
    for folder in set(re.findall(r"(?<![/\w])(\w+)/ ", picture)):  # folders: nbmem's sub-packages, or js/
        assert (ROOT / "nbmem" / folder / "__init__.py").exists() or (ROOT / folder).is_dir(), folder


def test_the_cleanup_section_says_what_the_code_does(ip):
    # "Other variables bound to the same object are never removed"
    ok(ip, "x = torch.empty(2**20)\nalias = x")
    rep = __import__("nbmem").cleanup(names=["x"])
    assert "alias" in ip.user_ns and [(h.name, h.named_by) for h in rep.still_held] == [("x", ("alias",))]


def test_the_package_metadata_points_nowhere_it_cannot_back():
    """No placeholder URL: a project link is added when the project has a public home, not before."""
    meta = (ROOT / "pyproject.toml").read_text()
    assert "example.invalid" not in meta and "example.com" not in meta


def test_the_leaks_columns_the_readme_lists_are_the_frames():
    from nbmem.records import FINDING_COLUMNS

    row = next(ln for ln in README.splitlines() if ln.startswith("| `nbmem.leaks("))
    listed = row.rsplit("`", 2)[-2]
    assert listed.split(", ") == list(FINDING_COLUMNS), listed


RESULTS = (ROOT / "benchmarks" / "RESULTS.md").read_text()


def section(heading: str) -> str:
    """The README's text under a heading, up to the next heading of the same or a higher level."""
    start = README.index(heading + "\n")
    level = heading.split(" ")[0]
    ends = [README.find(f"\n{h} ", start + 1) for h in ("#" * n for n in range(2, len(level) + 1))]
    return README[start:min((e for e in ends if e > 0), default=len(README))]


def test_figures_withdrawn_as_hand_derived_stay_out_of_the_readme():
    """Issues 38 and 49: no command printed these; RESULTS.md says why they were withdrawn."""
    for withdrawn in (r"0\.7\s*[-–]\s*1\.2\s*%", r"0\.988", r"about\s+15\s*ms"):
        assert not re.search(withdrawn, README), withdrawn


def test_the_comparison_has_the_peers_people_pick_instead():
    compares = section("## How it compares")
    fit = section("### Will it fit: the batch-size finders")
    dead = section("### A dead kernel: resource panels and process watchers")
    assert fit in compares and dead in compares
    assert "| tool | what it does | how it fails | measured here |" in fit
    for peer in ("`BatchSizeFinder`", "`find_executable_batch_size`", "`accelerate estimate-memory`", "batch-probe",
                 "torch-kitsune", "**nbmem**"):
        row = next((ln for ln in fit.splitlines() if ln.startswith("| ") and peer in ln), None)
        assert row is not None and row.count(" | ") == 3, peer
    for peer in ("jupyter-resource-usage", "nvidia-smi", "gpustat", "nvitop"):
        assert peer in dead, peer


@pytest.mark.parametrize("heading", ["### Will it fit: the batch-size finders", "## What it costs"])
def test_the_measured_figures_quoted_are_the_ones_results_prints(heading):
    """Each number in a 'measured here' cell, or in the costs, is in benchmarks/RESULTS.md as a command printed it."""
    text = section(heading)
    if "| measured here |" in text:
        text = "\n".join(ln.rsplit(" | ", 1)[1] for ln in text.splitlines() if ln.startswith("| **"))
    for number in set(re.findall(r"\d[\d,]*\.\d+|\d{1,3}(?:,\d{3})+", text)):
        assert number in RESULTS, (heading, number)
