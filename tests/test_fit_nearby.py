"""Two steps in a row at a fit's answer (issue 36), on the CPU with CUDA stood in for: the second step runs with
the first one's results still bound, as when the user runs the cell again; where the two run out of memory, the
answer is capped with the prediction's margin below the value that failed, and the lower answer is run in turn."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from nbmem.fitting.analysis.model import RunTrace  # noqa: E402
from nbmem.fitting.runs import nearby, runner  # noqa: E402
from nbmem.fitting.runs.multigpu import RunSet  # noqa: E402
from tests import test_fit_remedies  # noqa: E402
from tests.test_fit_remedies import FakeSource  # noqa: E402

MiB = 1 << 20


class Notebook:
    """A cell's namespace and its body: each step binds ``out``; ``clean`` is the fit putting the namespace back."""

    def __init__(self) -> None:
        self.ns: dict[str, Any] = {}
        self.steps: list[tuple[int, bool]] = []  # (value, whether the last step's ``out`` was still bound)

    def step(self, b: int) -> None:
        self.steps.append((b, "out" in self.ns))
        self.ns["out"] = b

    def clean(self) -> None:
        self.ns.clear()


def steps_run(book: Notebook, run: Any, value: int) -> int:
    """Run the body as the fit asked (one step, or steps in a row) and say how many steps that was."""
    before = len(book.steps)
    run(value)
    return len(book.steps) - before


def trace(addrs: Iterator[int], kept: int, passing: int) -> list[dict[str, Any]]:
    """A run's allocator events: ``kept`` bytes held to its end, ``passing`` bytes made and freed within it."""
    x, y = next(addrs) << 32, next(addrs) << 32
    return [{"action": "alloc", "addr": x, "size": kept}, {"action": "alloc", "addr": y, "size": passing},
            {"action": "free_requested", "addr": y, "size": passing},
            {"action": "free_requested", "addr": x, "size": kept}]


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Each run's trace: an input of 1 MiB and activations of 8 MiB per sample. Two steps in a row at
    ``oom_from`` or more run out of memory (what the allocator model does not see: the second step's block finds
    no free stretch), one step never does."""
    seen: dict[str, Any] = {"runs": [], "oom_from": None, "book": None, "caps": []}
    addrs = itertools.count(1)

    def one_run(run: Any, value: int, counted: bool, src: Any, devs: list[int], stacks: bool,
                max_entries: int) -> Any:
        steps = steps_run(seen["book"], run, value)
        seen["runs"].append((value, steps))
        seen["caps"].append((value, steps, (src.caps or {}).get(0)))
        entries = trace(addrs, value * MiB, value * 8 * MiB)
        if steps > 1 and seen["oom_from"] is not None and value >= seen["oom_from"]:
            oom = "CUDA out of memory. Tried to allocate 904.00 MiB"
            return RunSet.single(RunTrace(value, entries[:1], counted, 0, 0, oom=True)), oom
        return RunSet.single(RunTrace(value, entries, counted, 0, 0)), ""

    test_fit_remedies.stand_in.__wrapped__(monkeypatch)  # type: ignore[attr-defined]  # CUDA stood in for
    monkeypatch.setattr(runner, "_one_run", one_run)  # with these runs
    return seen


def fit(stand_in: dict[str, Any], margin_bytes: int, **kw: Any) -> tuple[Any, Notebook]:
    book = stand_in["book"] = Notebook()
    res = runner.fit(book.step, [8, 16, 32], source=FakeSource(), name="batch", clean=book.clean,  # type: ignore[arg-type]
                     margin_bytes=margin_bytes, restore=False, **kw)
    return res, book


def test_the_answer_is_run_twice_in_a_row_with_the_first_steps_results_bound_and_stands_where_it_fits(
        stand_in: dict[str, Any]) -> None:
    res, book = fit(stand_in, 0)
    assert res.largest_value is not None
    # 9 MiB per sample in 1 GiB: 113 by the allocator's rounding (114 MiB and 904 MiB segments)
    assert res.largest_value == 113
    assert stand_in["runs"][-1] == (113, 2), "the last run: two steps at the answer"
    assert all(n == 1 for _, n in stand_in["runs"][:-1]), "every other run one step"
    assert book.steps[-2:] == [(113, False), (113, True)], "the second step with the first one's `out` still bound"
    assert any(n.startswith("checked: 2 steps in a row at batch=113, the answer, ran") for n in res.notes)
    assert res.steps_run == len(book.steps), "each of the two steps is a step of the body"
    assert not book.ns, "the namespace put back after the two steps too"


def test_two_steps_that_run_out_of_memory_cap_the_answer_with_the_margin_and_the_lower_answer_is_run(
        stand_in: dict[str, Any]) -> None:
    plain, _ = fit(stand_in, 64 * MiB)
    stand_in["runs"].clear()
    stand_in["oom_from"] = plain.largest_value - 2
    res, book = fit(stand_in, 64 * MiB)
    assert res.largest_value is not None and res.largest_value < stand_in["oom_from"], "never the value that failed"
    assert res.largest_value >= 0.9 * plain.largest_value, "the margin below it, not a search from scratch"
    two = [(v, n) for v, n in stand_in["runs"] if n == 2]
    assert two == [(plain.largest_value, 2), (res.largest_value, 2)], "the answer, then the capped answer, run"
    assert any(f"2 steps in a row at batch={plain.largest_value:,}, the model's answer, ran out of memory" in n
               for n in res.notes)
    assert any(n.startswith(f"checked: 2 steps in a row at batch={res.largest_value:,}") for n in res.notes)
    assert not book.ns


def test_the_answer_is_not_run_where_two_steps_would_take_too_long(
        stand_in: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nearby, "REFINE_SECONDS", 0.0)  # any step takes longer than this
    res, _ = fit(stand_in, 0)
    assert all(n == 1 for _, n in stand_in["runs"]), "no two steps in a row"
    assert any(n.startswith("the answer was not run: 2 steps at batch=") for n in res.notes)


def test_another_gpus_answer_is_not_run_here_where_this_one_has_less_room(stand_in: dict[str, Any]) -> None:
    res, _ = fit(stand_in, 0, on="24GiB", own_used=lambda d: 500 * MiB)
    assert res.largest_value is not None
    assert all(n == 1 for _, n in stand_in["runs"]), "a 24 GiB GPU's answer is not run on one with 1 GiB free"
    assert "the answer was not run: this GPU cannot be held to the other GPU's room" in "\n".join(res.notes)


def test_a_smaller_gpus_answer_is_run_here_with_the_allocator_held_to_its_room(stand_in: dict[str, Any]) -> None:
    """768 MiB, no context beyond the allocator: this GPU (1 GiB free) stands for it, its allocator held there."""
    res, _ = fit(stand_in, 0, on="768MiB", own_used=lambda d: 0)
    assert res.largest_value == 768 // 9 - 1 or res.largest_value == 768 // 9, res.largest_value
    two = [(v, cap) for v, n, cap in stand_in["caps"] if n >= 2]
    assert two == [(res.largest_value, 768 * MiB)], stand_in["caps"]
    assert all(cap is None for v, n, cap in stand_in["caps"] if n == 1), "the fit's own runs are not held"
    assert any(n.startswith(f"checked: 2 steps in a row at batch={res.largest_value:,}, the answer, ran with the "
                            "allocator held to that GPU's room") for n in res.notes), res.notes


def test_past_a_smaller_gpus_checked_answer_the_checks_are_held_to_its_room(saturating: dict[str, Any]) -> None:
    res = fit_saturating(saturating, on="768MiB", own_used=lambda d: 0)
    past = [(v, cap) for v, n, cap in saturating["runs"] if n == 3]
    assert past and {cap for _, cap in past} == {768 * MiB}, saturating["runs"]
    assert res.largest_value is not None and 2 * res.largest_value * MiB + 512 * MiB <= 768 * MiB, res.largest_value
    assert any(n.startswith("checked past the model") for n in res.notes), res.notes


def test_a_value_asked_about_that_ran_past_a_smaller_gpus_answer_needs_no_remedy(saturating: dict[str, Any]) -> None:
    """Asked whether the answer the checks past the model reached fits on that GPU: it does, so no remedy's runs are
    made (they were weighed against the model's answer alone, lower)."""
    net = test_fit_remedies.Net()  # repeated blocks: activation checkpointing is a remedy to measure
    first = fit_saturating(saturating, on="768MiB", own_used=lambda d: 0, modules=[net])
    model = next(v for v, n, cap in saturating["runs"] if n == 2)
    assert first.largest_value is not None and first.largest_value > model, (first.largest_value, model)
    plain_runs = len(saturating["runs"])
    saturating["runs"].clear()
    res = fit_saturating(saturating, on="768MiB", own_used=lambda d: 0, modules=[net], want=first.largest_value)
    assert res.largest_value == first.largest_value
    assert len(saturating["runs"]) == plain_runs, ("no remedy's runs", saturating["runs"])
    assert not res.remedies, res.remedies


@pytest.fixture
def saturating(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Each run's trace: an input of 1 MiB per sample, kept to the end, and a workspace of 8 MiB per sample up to
    512 MiB (a library buffer that stops growing at 64 samples), freed at once. In 1 GiB the true limit of steps in
    a row (each input made while the last one's is bound) is 256 samples; a model that keeps the workspace growing
    stops near 140. A run under a cap (``FakeSource.capped``) whose blocks need more than it runs out of memory, as
    the allocator held there does."""
    seen: dict[str, Any] = {"runs": [], "book": None, "src": FakeSource()}
    addrs = itertools.count(1)

    def one_run(run: Any, value: int, counted: bool, src: Any, devs: list[int], stacks: bool,
                max_entries: int) -> Any:
        steps = steps_run(seen["book"], run, value)
        cap = (src.caps or {}).get(0)
        seen["runs"].append((value, steps, cap))
        work = min(value, 64) * 8 * MiB
        entries = trace(addrs, value * MiB, work)
        if cap is not None and (2 if steps > 1 else 1) * value * MiB + work > cap:  # a step's input beside the last
            return RunSet.single(RunTrace(value, entries[:1], counted, 0, 0, oom=True)), "CUDA out of memory."
        return RunSet.single(RunTrace(value, entries, counted, 0, 0)), ""

    test_fit_remedies.stand_in.__wrapped__(monkeypatch)  # type: ignore[attr-defined]  # CUDA stood in for
    monkeypatch.setattr(runner, "_one_run", one_run)
    return seen


def fit_saturating(seen: dict[str, Any], **kw: Any) -> Any:
    book = seen["book"] = Notebook()
    kw.setdefault("restore", True)
    return runner.fit(book.step, [8, 16, 32], source=seen["src"], name="batch", clean=book.clean,  # type: ignore[arg-type]
                      margin_bytes=0, **kw)


def test_past_a_checked_answer_values_run_with_the_allocator_held_to_the_room_raise_the_answer(
        saturating: dict[str, Any]) -> None:
    res = fit_saturating(saturating)
    runs = saturating["runs"]
    model = next(v for v, n, cap in runs if n == 2 and cap is None)  # the model's answer, checked as before
    past = [(v, cap) for v, n, cap in runs if cap is not None]
    assert model < 200 and past, runs  # the model keeps the workspace growing: 142 here
    assert all(n == 3 for v, n, cap in runs if cap is not None), "each check past the answer is three steps in a row"
    assert {cap for _, cap in past} == {1 << 30}, "every one held to the room less the margin (1 GiB, none)"
    ran = [v for v, _ in past if 2 * v * MiB + min(v, 64) * 8 * MiB <= 1 << 30]
    assert res.largest_value == max(ran) and res.largest_value > 1.4 * model, (res.largest_value, runs)
    assert res.largest_value <= 256, "never above the true limit"
    said = f"checked past the model: 3 steps in a row at batch={res.largest_value:,} ran with the allocator held to "
    assert any(n.startswith(said + "1.00 GiB (the room less the margin)") for n in res.notes), res.notes
    # The report's peak is the checked run's (the input and the workspace), not the model's replay there.
    assert res.peak_allocated_at_largest_bytes == res.largest_value * MiB + 512 * MiB
    assert saturating["src"].caps is None, "the cap is lifted after the checks"


def test_a_check_past_the_answer_that_runs_out_of_memory_leaves_the_last_that_ran(
        saturating: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # The room as the checks see it is smaller than the model's: every value past the answer fails under the cap.
    real = FakeSource.capped

    @contextlib.contextmanager
    def tight(self: Any, caps: dict[int, int]) -> Any:
        with real(self, {d: 0 for d in caps}) as held:
            yield held

    monkeypatch.setattr(FakeSource, "capped", tight)
    res = fit_saturating(saturating)
    runs = saturating["runs"]
    model = next(v for v, n, cap in runs if n == 2 and cap is None)
    tried = [v for v, n, cap in runs if cap is not None]
    assert res.largest_value == model and len(tried) >= 2, (res.largest_value, runs)
    # never within 1 % of the largest that ran, where whether a value runs depends on where its blocks fall; the
    # halving stops there
    assert all(v >= 1.01 * model for v in tried), (model, tried)
    assert any(n.startswith("past the model's answer, 3 steps in a row at batch=") and "ran out of memory" in n
               for n in res.notes), res.notes
    assert not any(n.startswith("checked past the model") for n in res.notes)


def test_past_the_answer_values_nearer_than_3_percent_are_run_where_the_cap_stops_the_body_there(
        saturating: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A cap that stops the body 2 % past the model's answer (a CNN's two margins on a 16 GiB card left 1.8 %): the
    halving goes on down to 1 % past the largest that ran, so the answer gains what the cap allows."""
    real = FakeSource.capped

    @contextlib.contextmanager
    def near(self: Any, caps: dict[int, int]) -> Any:
        with real(self, {d: 802 * MiB for d in caps}) as held:  # 2 × 145 MiB of inputs and 512 MiB of workspace
            yield held

    monkeypatch.setattr(FakeSource, "capped", near)
    monkeypatch.setattr(nearby, "BEYOND_TRIES", 8)  # from far past the answer, halving down to it
    res = fit_saturating(saturating)
    runs = saturating["runs"]
    model = next(v for v, n, cap in runs if n == 2 and cap is None)
    assert 145 < 1.03 * model, model  # what the case is about: the cap's limit is nearer than 3 %
    assert model < res.largest_value <= 145, (res.largest_value, runs)
    lo = model
    for v in (v for v, n, cap in runs if cap is not None):
        assert v >= 1.01 * lo, ("each value at least 1 % past the largest that ran", v, lo, runs)
        lo = v if 2 * v + 512 <= 802 else lo


def test_the_time_a_check_past_the_answer_would_take_counts_putting_the_users_state_back(
        saturating: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps that take no time, a restore that takes 50 ms, and 40 ms allowed a check: the first check runs (what a
    restore takes is not known before one), and none after it."""
    real = runner._as_the_user_has_it

    def slow(*args: Any) -> None:
        time.sleep(0.05)
        real(*args)

    beyond = nearby.beyond

    def no_step_time(body: Any, *args: Any) -> None:
        body.durations.clear()  # steps that take no time: only the restore counts, however busy the machine
        beyond(body, *args)

    monkeypatch.setattr(runner, "_as_the_user_has_it", slow)
    monkeypatch.setattr(nearby, "beyond", no_step_time)
    monkeypatch.setattr(nearby, "REFINE_SECONDS", 0.04)
    fit_saturating(saturating)
    assert [n for _, n, cap in saturating["runs"] if cap is not None] == [3], saturating["runs"]


def test_where_torch_cannot_hold_the_allocator_to_the_room_nothing_is_run_past_the_answer(
        saturating: dict[str, Any]) -> None:
    saturating["src"].can_cap = False
    res = fit_saturating(saturating)
    assert [n for _, n, _ in saturating["runs"]].count(2) == 1, "the check at the answer only"
    assert res.largest_value == max(v for v, n, _ in saturating["runs"] if n == 2), "the model's checked answer"


def test_a_fit_already_near_its_limit_runs_nothing_past_its_answer(stand_in: dict[str, Any]) -> None:
    """The model is exact here: what the allocated memory leaves is less than a few per cent of the answer."""
    fit(stand_in, 0)
    assert [n for _, n in stand_in["runs"]].count(2) == 1, stand_in["runs"]


def test_a_memory_fraction_the_user_set_is_the_room(stand_in: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.cuda.set_per_process_memory_fraction(0.25)`` on a device of 2 GiB with 1 GiB free: the allocator may
    hold 512 MiB, and the fit answers for that, not for the free memory."""
    monkeypatch.setattr(FakeSource, "fraction", 0.25)
    res, _ = fit(stand_in, 0)
    assert res.room is not None and res.room.capacity_bytes == 512 * MiB
    v = res.largest_value
    assert v is not None and v * 9 * MiB <= 512 * MiB < (v + 2) * 9 * MiB


def test_each_check_past_the_answer_starts_from_the_state_the_user_has(saturating: dict[str, Any],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """No model stands behind those values: the optimizer's state the fit's runs made, and their cuBLAS workspaces,
    are not there when the user's next cell runs, so they are not there when a check past the answer runs."""
    real = runner._as_the_user_has_it
    put_back: list[int] = []

    def counted(body: Any, *a: Any) -> None:
        put_back.append(len(saturating["runs"]))
        real(body, *a)

    monkeypatch.setattr(runner, "_as_the_user_has_it", counted)
    fit_saturating(saturating, restore=True)
    past = [k for k, (_, n, cap) in enumerate(saturating["runs"]) if cap is not None]
    assert past and put_back == past, (put_back, saturating["runs"])  # just before each, and only those


def test_where_the_state_is_not_put_back_nothing_is_run_past_the_answer(saturating: dict[str, Any]) -> None:
    """``restore=False``: the fit's runs train the model for good, and no check past the answer could start from the
    state the user's next cell has; a remedy's runs neither."""
    res = fit_saturating(saturating, restore=False)
    assert [n for _, n, _ in saturating["runs"]].count(3) == 0, saturating["runs"]
    assert not any(n.startswith("checked past the model") for n in res.notes)


def test_checks_past_the_answer_keep_the_margin(saturating: dict[str, Any]) -> None:
    """Held to the room less the margin, the room the model's answer is for: with a margin of 64 MiB, 1 GiB less
    64 MiB."""
    book = saturating["book"] = Notebook()
    res = runner.fit(book.step, [8, 16, 32], source=saturating["src"], name="batch", clean=book.clean,  # type: ignore[arg-type]
                     margin_bytes=64 * MiB, restore=True)
    caps = {cap for _, n, cap in saturating["runs"] if n == 3}
    assert caps == {(1 << 30) - 64 * MiB}, saturating["runs"]
    assert res.largest_value is not None and 2 * res.largest_value * MiB + 512 * MiB <= (1 << 30) - 64 * MiB
