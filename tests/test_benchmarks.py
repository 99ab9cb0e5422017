"""The benchmarks still run (a smoke run on the CPU); their figures are read by people, not asserted."""

from __future__ import annotations

import gzip
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

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
    ["bench_metrics.py", "--quick"],
    ["bench_analysis.py", "--turns", "1", "--against", str(BENCH.parent),
     "--traces", str(BENCH.parent / "tests" / "data" / "fit_remedy_resnet_h100_b.json.gz")],
])
def test_a_benchmark_runs_and_prints_its_summary(args: list[str]) -> None:
    out = subprocess.run([sys.executable, str(BENCH / args[0]), *args[1:]], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = out.stdout.split("=== summary ===")[1].strip().splitlines()
    assert summary and all(": " in s for s in summary), out.stdout[-2000:]


def test_the_scan_benchmark_says_where_a_cells_cost_goes_stage_by_stage() -> None:
    out = subprocess.run([sys.executable, str(BENCH / "bench_scan.py"), "--device", "cpu", "--quick", "--only", "small",
                          "--stages", "--reps", "3"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = out.stdout.split("=== summary ===")[1]
    for stage in ("Session.end_cell", "Holdings.close_cell", "Scanner.update", "step holders", "Probe.boundary"):
        assert f"stage {stage}: " in summary, summary


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


# -- bench_multi.py (issue 34): its rows' logic on the CPU; the rows themselves need one or two GPUs ---------------
def _bench_multi() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        import bench_multi
    finally:
        sys.path.remove(str(BENCH))
    return bench_multi


def test_bench_multi_parses_its_arguments_and_says_it_needs_cuda_without_importing_ipython() -> None:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import bench_multi; rc = bench_multi.main(sys.argv[2:]); "
            "print('IPython imported:', 'IPython' in sys.modules); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, str(BENCH), "--only", "twogpu,on", "--budget-s", "5"],
                         capture_output=True, text=True, timeout=300, cwd=BENCH.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = out.stdout.split("=== summary ===")[1].strip().splitlines()
    assert summary[0] == "bench_multi: needs CUDA (nothing measured)", out.stdout
    assert "IPython imported: False" in out.stdout, out.stdout
    bad = subprocess.run([sys.executable, str(BENCH / "bench_multi.py"), "--only", "twogpus"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "--only takes twogpu, on" in bad.stderr, bad.stderr
    helped = subprocess.run([sys.executable, str(BENCH / "bench_multi.py"), "--help"], capture_output=True, text=True,
                            timeout=300)
    assert helped.returncode == 0 and "--budget-s" in helped.stdout and "--out" in helped.stdout


def test_bench_multis_summary_counts_rows_never_above_and_within_10_percent_below() -> None:
    bm = _bench_multi()
    rows = [bm.Row("on", "a", "16GiB", answer=90, truth=100), bm.Row("on", "b", "24GiB", answer=100, truth=100),
            bm.Row("on", "c", "16GiB", answer=89, truth=100), bm.Row("on", "d", "16GiB", error="boom"),
            bm.Row("twogpu", "e", answer=101, truth=100), bm.Row("twogpu", "f", answer=None, truth=100)]
    assert bm.summary("on", rows) == "on: never above: yes; within 10 % below: 2 of 3 (1 of 4 rows without both)"
    assert bm.summary("twogpu", rows) == "twogpu: never above: no; within 10 % below: 0 of 1 (1 of 2 rows without both)"
    assert bm.summary("on", rows[3:4]) == ("on: never above: NA (no row has both an answer and a real boundary); "
                                           "within 10 % below: 0 of 0 (1 of 1 rows without both)")
    assert rows[0].ratio == 0.9 and rows[3].ratio is None


def test_bench_multis_rows_go_on_after_a_failure_and_stop_at_the_budget(tmp_path: Path) -> None:
    """Each row: the fit's answer and the device that limits it, then the real boundary by bisection from it; a
    row that fails says why and the next runs; the time budget stops a bisection and the rows after it."""
    from nbmem.fitting.analysis.devices import DeviceFit
    from nbmem.fitting.analysis.prediction import FitResult

    bm = _bench_multi()
    now = [0.0]
    tried: list[int] = []

    def result(largest: int | None) -> FitResult:
        devices = (DeviceFit("cuda:0", "Fake 80GB", 400, "", None), DeviceFit("cuda:1", "Fake 80GB", largest,
                                                                              "", None, limits=True))
        return FitResult("batch", "cuda:0, cuda:1", (8, 16, 32), (), None, largest_value=largest,
                         reason="" if largest else "its memory does not grow with batch", devices=devices)

    def up_to(limit: int, cost_s: float = 0.0) -> Any:
        tried.clear()

        def ok(v: int) -> bool:
            tried.append(v)
            now[0] += cost_s
            return v <= limit
        return ok

    def answered(row: Any, hard: float) -> None:
        bm.measure_row(row, lambda: result(95), up_to(100), 32, hard, clock=lambda: now[0])

    def unanswered(row: Any, hard: float) -> None:
        bm.measure_row(row, lambda: result(None), up_to(50), 32, hard, clock=lambda: now[0])
        assert tried[0] == 32, "without an answer the search starts at the value given"

    def broken(row: Any, hard: float) -> None:
        raise RuntimeError("boom\nsecond line")

    def slow(row: Any, hard: float) -> None:
        bm.measure_row(row, lambda: result(95), up_to(1000, cost_s=100.0), 32, hard, clock=lambda: now[0])

    rows: list[Any] = []
    plan = [(bm.Row("twogpu", n), f) for n, f in (("a", answered), ("b", broken), ("c", unanswered), ("d", slow),
                                                   ("e", answered))]
    bm.run_plan(plan, rows, 0.0, 100.0, str(tmp_path), clock=lambda: now[0])
    a, b, c, d, e = rows
    assert (a.answer, a.truth, a.limited_by, a.error) == (95, 100, "cuda:1 (Fake 80GB)", ""), a
    assert a.truth_hi is not None and 100 < a.truth_hi <= 101 and a.ratio == 0.95
    assert b.error == "RuntimeError: boom" and b.answer is None
    assert c.answer is None and c.note.startswith("no prediction: its memory does not grow") and c.truth == 50, c
    assert c.error == "", c.error
    assert d.answer == 95 and d.truth is None and d.error == "real boundary not found: time budget spent"
    assert now[0] == 200.0, "the budget (100 s) and its grace (60 s) stop the bisection at the try after"
    assert e.error == "not run: time budget spent" and e.answer is None
    saved = json.loads((tmp_path / "bench_multi.json").read_text())["rows"]
    assert [r["family"] for r in saved] == ["a", "b", "c", "d", "e"] and saved[0]["ratio"] == 0.95


def test_bench_multis_truth_for_another_gpu_runs_under_the_memory_fraction_and_restores_the_state() -> None:
    """``Gpu.fit_and_truth`` with a stand-in for torch.cuda (the fraction it sets is the only limit) around a real
    CPU model: each try runs 3 steps under the fraction from the restored state, and the fraction goes back."""
    import torch

    from nbmem.fitting.analysis.devices import DeviceFit
    from nbmem.fitting.analysis.prediction import FitResult
    from nbmem.fitting.runs import runner

    bm = _bench_multi()
    GiB = 1 << 30

    class Cuda:
        def __init__(self) -> None:
            self.fraction = 1.0
            self.fractions: list[float] = []

        def synchronize(self, device: int | None = None) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def memory_allocated(self, device: int) -> int:
            return 1000

        def mem_get_info(self, device: int = 0) -> tuple[int, int]:
            return 80 * GiB, 80 * GiB

        def set_per_process_memory_fraction(self, fraction: float, device: int) -> None:
            self.fraction = fraction
            self.fractions.append(fraction)

    cuda = Cuda()
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = model.weight.detach().clone()
    ns: dict[str, Any] = {}
    steps: list[tuple[int, float]] = []

    def step(v: int) -> None:
        steps.append((v, cuda.fraction))
        if v * GiB > cuda.fraction * 80 * GiB:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        ns["loss"] = model(torch.randn(v, 4)).square().mean()
        ns["loss"].backward()
        opt.step()

    asked: dict[str, Any] = {}
    given: list[dict[int, int]] = []

    def fit(run: Any, values: Any, **kw: Any) -> FitResult:
        asked.update(kw)
        return FitResult("batch", "16.0 GiB, as measured on cuda:0", tuple(values), (), None, largest_value=15,
                         devices=(DeviceFit("cuda:0", "", 15, "", None, limits=True),))

    fitting = SimpleNamespace(fit=fit, is_out_of_memory=runner.is_out_of_memory,
                              give_back_workspaces=lambda src, before: given.append(dict(before)))
    gpu = bm.Gpu(SimpleNamespace(cuda=cuda), fitting)
    row = bm.Row("on", "linear", "16GiB")
    gpu.fit_and_truth(row, step, (2, 4, 8), ns, [model], opt, (0,), float("inf"), on="16GiB",
                      fraction_of=lambda: 16 * GiB)
    assert (row.answer, row.truth, row.truth_hi, row.memory_back) == (15, 16, 17, True), row
    assert asked["on"] == "16GiB" and asked["clean"] == ns.clear
    assert cuda.fraction == 1.0 and set(cuda.fractions) == {0.2, 1.0}, "set for each try, and back after it"
    assert all(f == 0.2 for _, f in steps) and {v for v, _ in steps} >= {15, 16, 17}
    assert [v for v, _ in steps].count(16) == 3, "three steps in a row at the boundary"
    assert torch.equal(model.weight, weights) and not ns, "each try starts from the state before the fit"
    assert given and all(g == {0: 1000} for g in given)
