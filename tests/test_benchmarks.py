"""The benchmarks still run (a smoke run on the CPU); their figures are read by people, not asserted."""

from __future__ import annotations

import gzip
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("args", [
    ["bench_scan.py", "--device", "cpu", "--quick", "--only", "small"],
    ["bench_scan.py", "--device", "cpu", "--quick", "--only", "small", "--reps", "2", "--against", str(BENCH.parent)],
    ["bench_overhead.py", "--device", "cpu", "--quick", "--only", "cell,footprint,load", "--sizes", "10000"],
    ["bench_stack.py", "--device", "cpu", "--seconds", "1", "--pairs", "2"],
    ["bench_stack.py", "--device", "cpu", "--seconds", "1", "--pairs", "2", "--design", "runs"],
    ["bench_stack.py", "--device", "cpu", "--seconds", "1", "--pairs", "2", "--interval", "0.05",
     "--default-pairs", "2"],
])
def test_a_benchmark_runs_and_prints_its_summary(args: list[str]) -> None:
    out = subprocess.run([sys.executable, str(BENCH / args[0]), *args[1:]], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = out.stdout.split("=== summary ===")[1].strip().splitlines()
    assert summary and all(": " in s for s in summary), out.stdout[-2000:]


def test_the_fit_replay_runs_on_every_committed_trace_file() -> None:
    """`bench_fit.py --replay` reads every trace file the repository keeps, the remedy and training ones too."""
    traces = sorted(str(p) for p in (BENCH.parent / "tests" / "data").glob("*.json.gz"))
    assert len(traces) >= 4, traces
    out = subprocess.run([sys.executable, str(BENCH / "bench_fit.py"), "--replay", *traces], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(BENCH.parent)})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = sum(len(json.load(gzip.open(p, "rt"))) for p in traces)
    assert f"bench_fit: replayed {rows} rows" in out.stdout, out.stdout[-3000:]


def test_the_stack_benchmarks_t_quantile_is_students_for_the_pairs_degrees_of_freedom() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        from bench_stack import interval95, t_quantile
    finally:
        sys.path.remove(str(BENCH))
    tables = {1: 12.706, 4: 2.776, 19: 2.093, 29: 2.045, 49: 2.010, 1000: 1.962}  # two-sided 95 %, by df
    for df, t in tables.items():
        assert abs(t_quantile(0.975, df) - t) < 5e-4, (df, t_quantile(0.975, df))
    xs = [1.0 + (-1) ** i * 0.01 * (i % 7) for i in range(50)]
    _mean, lo, hi = interval95(xs)
    assert abs((hi - lo) / 2 - 2.0096 * statistics.stdev(xs) / 50**0.5) < 1e-6
