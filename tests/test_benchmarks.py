"""The benchmarks still run (a smoke run on the CPU); their figures are read by people, not asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("args", [
    ["bench_scan.py", "--device", "cpu", "--quick", "--only", "small"],
    ["bench_overhead.py", "--device", "cpu", "--quick", "--only", "cell,footprint,load", "--sizes", "10000"],
    ["bench_stack.py", "--device", "cpu", "--seconds", "1", "--pairs", "2"],
    ["bench_stack.py", "--device", "cpu", "--seconds", "1", "--pairs", "2", "--design", "runs"],
    ["bench_stack.py", "--device", "cpu", "--seconds", "1", "--pairs", "2", "--interval", "0.05"],
])
def test_a_benchmark_runs_and_prints_its_summary(args: list[str]) -> None:
    out = subprocess.run([sys.executable, str(BENCH / args[0]), *args[1:]], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = out.stdout.split("=== summary ===")[1].strip().splitlines()
    assert summary and all(": " in s for s in summary), out.stdout[-2000:]
