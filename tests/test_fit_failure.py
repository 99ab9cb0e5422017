"""A run that failed caps the fit's answer with the margin a prediction keeps, never at the failing value minus one."""

from __future__ import annotations

import math

import pytest

from nbmem.fitting.analysis.model import Room, Run, RunTrace
from nbmem.fitting.analysis.prediction import analyse
from nbmem.fitting.analysis.search import below_failure
from nbmem.fitting.analysis.timeline import Timeline, build_timeline
from tests.test_fit import GiB, MiB, loop_body, record, room, training_step


def test_below_failure_keeps_the_margin_under_the_failed_values_peak() -> None:
    def peak(v: int) -> float:
        return 1000 + 10 * v

    # peak(1000) = 11,000; 2 % of it is 220 bytes, 22 values' worth
    assert below_failure(peak, 1000, 220) == 978
    assert below_failure(peak, 1000, 0) == 999
    assert below_failure(peak, 1000, 11_000) is None
    assert below_failure(peak, 1, 0) is None


@pytest.mark.parametrize("margin", [0, 512 * MiB])
def test_a_failed_run_caps_the_answer_by_the_margin_not_at_one_below(margin: int) -> None:
    body = training_step(per_sample=MiB, param=MiB)
    runs = record(body, [100, 200, 1000])
    assert analyse(runs, room(20 * GiB, margin), name="batch").largest_value > 1000  # the model alone says it fits
    runs[-1] = RunTrace(1000, runs[-1].entries[:5], oom=True)
    res = analyse(runs, room(20 * GiB, margin), name="batch", cell_files=frozenset({"<cell>"}))
    assert res.largest_value is not None and res.largest_value < 990
    tl = build_timeline([Run(r, lambda frames: None) for r in runs], ())
    assert isinstance(tl, Timeline)

    def peak(v: int) -> int:
        return tl.simulate(v, math.inf).peak_reserved_bytes

    kept = max(margin, math.ceil(0.02 * peak(1000)))
    assert peak(res.largest_value) <= peak(1000) - kept < peak(res.largest_value + 1)
    assert f"capped below the failed run at 1,000, with the {'2' if not margin else '7'} % margin" in res.answer()
    assert any("1,000 ran out of memory" in n and "margin a prediction keeps" in n for n in res.notes)
    assert res.answer() in str(res)


def test_a_failed_run_caps_a_scaled_peak_by_the_margin_too() -> None:
    runs = record(loop_body, [8, 16, 32, 64])
    runs[-1] = RunTrace(64, runs[-1].entries[:3], oom=True)
    res = analyse(runs, room(64 * GiB), name="batch")
    assert res.method == "scaled peak" and res.largest_value is not None and res.largest_value < 63
    assert "capped below the failed run at 64" in res.answer()


def test_a_failed_run_where_no_smaller_value_keeps_the_margin_gives_no_answer() -> None:
    body = training_step()  # memory barely grows: 2 % of the peak is more than every sample's bytes
    runs = record(body, [8, 16, 32])
    runs[-1] = RunTrace(32, runs[-1].entries[:5], oom=True)
    res = analyse(runs, Room("cuda:0", 20 * GiB, 0, 0, 0), name="batch")
    assert res.largest_value is None and "32 ran out of memory in its run" in res.reason
    assert "less" in res.reason


def test_a_run_that_failed_on_one_request_larger_than_the_room_caps_at_one_below() -> None:
    """The failed run asked for 64 TiB at once (growth no small run showed): it failed on that whatever else was
    held, which says nothing of the values below it; the model answers for those against the room."""
    body = training_step()  # memory barely grows: 2 % of the modelled peak is more than a sample's bytes
    runs = record(body, [8, 16, 32])
    cut = runs[-1].entries[:5]
    runs[-1] = RunTrace(32, [*cut, {"action": "oom", "size": 2**46, "device_free": 0}], oom=True,
                        allocated_before_bytes=0, reserved_before_bytes=0)
    res = analyse(runs, Room("cuda:0", 20 * GiB, 0, 0, 0), name="batch")
    assert res.largest_value == 31, res.reason
    assert any("asked for 64.0 TiB at once, more than the device's whole room" in n for n in res.notes), res.notes


def test_a_run_that_failed_on_a_request_within_the_room_keeps_the_margin_below_the_models_figure() -> None:
    """A real trace ends in its "oom" entry; a request the room could have held (fragmentation, the model wrong
    at that value) keeps the margin below the model's figure for the failed value, never "one below"."""
    body = training_step()
    runs = record(body, [8, 16, 32])
    cut = runs[-1].entries[:5]
    runs[-1] = RunTrace(32, [*cut, {"action": "oom", "size": 64 * MiB, "device_free": 0}], oom=True,
                        allocated_before_bytes=0, reserved_before_bytes=0)
    res = analyse(runs, Room("cuda:0", 20 * GiB, 0, 0, 0), name="batch")
    assert res.largest_value is None and "32 ran out of memory in its run" in res.reason
