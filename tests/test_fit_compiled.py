"""``graphs_compiled``: torch.compile's own graph counter, read without importing dynamo (issue 36)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nbmem.fitting.runs.runner import graphs_compiled

torch = pytest.importorskip("torch")


def test_it_moves_when_torch_compile_makes_a_graph_and_not_when_a_compiled_shape_runs_again() -> None:
    f = torch.compile(lambda t: t * 3 - 1, backend="eager")
    f(torch.ones(4))
    first = graphs_compiled()
    assert first >= 1
    f(torch.ones(4))
    assert graphs_compiled() == first, "the same shape again: no new graph"
    f(torch.ones(4, 5))
    assert graphs_compiled() == first + 1, "a new shape: a new graph"


def test_it_reads_zero_and_imports_nothing_where_dynamo_is_not_loaded() -> None:
    code = ("import sys, torch\nfrom nbmem.fitting.runs.runner import graphs_compiled\n"
            "assert graphs_compiled() == 0\nassert 'torch._dynamo' not in sys.modules, 'dynamo was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


class Compiler:
    """torch.compile's graph counter as the runs move it: a graph per new shape until ``dynamic_after`` shapes."""

    def __init__(self, dynamic_after: int = 2) -> None:
        self.graphs, self.shapes, self.dynamic_after = 0, set(), dynamic_after

    def run(self, v: int) -> None:
        if v not in self.shapes and len(self.shapes) < self.dynamic_after:
            self.graphs += 1
        self.shapes.add(v)


def runs_of(monkeypatch: pytest.MonkeyPatch, compiler: Compiler,
            fails_from: int | None = None) -> list[tuple[int, bool]]:
    from nbmem.fitting.analysis.model import RunTrace
    from nbmem.fitting.runs import runner
    from nbmem.fitting.runs.multigpu import RunSet
    from tests.test_fit import MiB, record, training_step

    body = training_step(per_sample=MiB, param=MiB)
    ran: list[tuple[int, bool]] = []

    def one_run(run: object, value: int, counted: bool, *rest: object) -> tuple[RunSet, str]:
        ran.append((value, counted))
        if fails_from is not None and value >= fails_from:
            return RunSet.single(RunTrace(value, [], counted, 0, 0, oom=True)), "CUDA out of memory"
        compiler.run(value)
        return RunSet.single(RunTrace(value, record(body, [value], warmup=False)[0].entries, counted, 0, 0)), ""

    monkeypatch.setattr(runner, "_one_run", one_run)
    monkeypatch.setattr(runner, "graphs_compiled", lambda: compiler.graphs)
    monkeypatch.setattr(runner, "free_cached", lambda src, devs, **kw: None)
    monkeypatch.setattr(runner, "allocated_reserved", lambda src, dev: (0, 0))
    monkeypatch.setattr(runner, "room_now", lambda src, d, room: (room, 0))
    return ran


def body_for_runs() -> tuple[object, list[str], list[object]]:
    from nbmem.fitting.analysis.model import Room
    from nbmem.fitting.runs import runner
    from tests.test_fit import GiB

    notes: list[str] = []
    body = runner.FitBody(lambda v: None, None, [0], False, 10**6, None, "batch", notes)  # type: ignore[arg-type]
    body.rooms[0], body.segments[0] = Room("cuda:0", 80 * GiB, 0, 0, 0), ()
    return body, notes, []


def test_a_warm_up_that_compiled_gets_a_second_at_the_next_value_and_the_counted_runs_compile_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from nbmem.fitting.runs import runner

    ran = runs_of(monkeypatch, Compiler())
    body, notes, runs = body_for_runs()
    assert not runner._runs(body, [8, 16, 32], True, runs, [], frozenset())  # type: ignore[arg-type]
    assert ran[:3] == [(8, False), (16, False), (8, True)], ran
    assert [v for v, c in ran if c] == [8, 16, 32], "no counted run compiled, none ran twice"
    assert any("torch.compile compiled a graph in the runs at batch=16" in n for n in notes), notes


def test_a_counted_run_that_compiled_runs_again_and_the_compiling_one_is_not_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from nbmem.fitting.runs import runner

    ran = runs_of(monkeypatch, Compiler(dynamic_after=10))  # a graph for every shape (dynamic=False)
    body, _, runs = body_for_runs()
    runner._runs(body, [8, 16, 32], True, runs, [], frozenset())  # type: ignore[arg-type]
    counted = [v for v, c in ran if c]
    # 8 and 16 compiled in the two warm-ups; 32 compiled in its first counted run, which ran again
    assert ran[:2] == [(8, False), (16, False)] and counted == [8, 16, 32, 32], ran
    assert [r.value for r in runs if r.counted] == [8, 16, 32], "one run kept per value: the second"


def test_a_second_warm_up_that_runs_out_of_memory_stops_the_runs_and_caps_the_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from nbmem.fitting.runs import runner

    ran = runs_of(monkeypatch, Compiler(), fails_from=16)
    body, notes, runs = body_for_runs()
    skipped: list[int] = []
    assert runner._runs(body, [8, 16, 32], True, runs, skipped, frozenset())  # type: ignore[arg-type]
    assert ran == [(8, False), (16, False)] and skipped == [16, 32]
    assert [r.value for r in runs if r.oom] == [16], "the failure is kept: it caps the answer"
    assert any("second warm-up, at batch=16, ran out of memory" in n for n in notes), notes
