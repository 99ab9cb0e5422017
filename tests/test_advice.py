"""Advice after a cell on a GPU: the headroom line, and fragmentation named when it is the cause."""

from __future__ import annotations

from nbmem.cells import advice
from nbmem.formatting import fmt_times
from nbmem.records import Boundary, CellRecord, GpuReading

GiB, MiB = 2**30, 2**20


def record(*, before: int, after: int, reserved: int, peak: int | None, device: str = "cuda:0") -> CellRecord:
    return CellRecord(3, 0.0, 1.0, device, before, after, reserved, reserved, peak, "", None, None, None, None, None,
                      "")


def boundary(used: int | None, total: int | None) -> Boundary:
    return Boundary(0.0, 0.0, None, None, {}, {"cuda:0": GpuReading(used, total, None, None)})


def test_the_headroom_line_says_how_many_times_the_cells_growth_still_fits() -> None:
    r = record(before=2 * GiB, after=2 * GiB, reserved=6 * GiB, peak=12 * GiB)
    (line,) = advice.headroom([r], boundary(70 * GiB, 80 * GiB), MiB)
    # capacity 6 + 10 = 16 GiB; room 14 GiB for 10 GiB of growth: more than a quarter of the room is at stake
    assert line == "cuda:0: peak 12.0 GiB of 16.0 GiB free for this process: room for ~1.4× this cell's growth"


def test_no_headroom_line_where_the_cell_used_a_sliver_of_the_room() -> None:
    # The tutorial case: a peak of a few MiB on an idle 80 GiB device helps no one.
    small = record(before=2 * GiB, after=2 * GiB, reserved=3 * GiB, peak=2 * GiB + 3 * MiB)
    assert advice.headroom([small], boundary(3 * GiB, 80 * GiB), MiB) == []
    # A quarter of the room is the line: 19 GiB of growth in 79 GiB of room is not at stake, 20 GiB is.
    under = record(before=1 * GiB, after=1 * GiB, reserved=20 * GiB, peak=20 * GiB)
    assert advice.headroom([under], boundary(20 * GiB, 80 * GiB), MiB) == []
    over = record(before=1 * GiB, after=1 * GiB, reserved=21 * GiB, peak=21 * GiB + 1)
    assert advice.headroom([over], boundary(21 * GiB, 80 * GiB), MiB) != []


def test_what_a_cell_keeps_is_told_when_a_few_more_like_it_fill_the_device() -> None:
    r = record(before=30 * GiB, after=50 * GiB, reserved=50 * GiB, peak=50 * GiB)
    (line,) = advice.headroom([r], boundary(50 * GiB, 80 * GiB), MiB)
    # 30 GiB left after it, 20 GiB kept: one more cell like it fits
    assert line.endswith("it kept 20.0 GiB, so about 1 more cell like this one fit before the device is full")
    # Kept 1 GiB with 29 GiB left: 29 more cells, not at stake, and the peak was small: nothing said.
    calm = record(before=30 * GiB, after=31 * GiB, reserved=31 * GiB, peak=31 * GiB)
    assert advice.headroom([calm], boundary(31 * GiB, 60 * GiB), MiB) == []


def test_ratios_are_rounded_the_way_a_person_reads_them() -> None:
    assert (fmt_times(2.4444), fmt_times(31713.02), fmt_times(9.96)) == ("~2.4×", "~31713×", "~10×")


def test_no_headroom_line_without_growth_or_without_nvml() -> None:
    flat = record(before=2 * GiB, after=2 * GiB, reserved=4 * GiB, peak=2 * GiB)
    assert advice.headroom([flat], boundary(20 * GiB, 80 * GiB), MiB) == []
    grew = record(before=2 * GiB, after=3 * GiB, reserved=6 * GiB, peak=5 * GiB)
    assert advice.headroom([grew], boundary(None, None), MiB) == [], "unknown is not zero: no line"
    assert advice.headroom([grew], boundary(20 * GiB, 80 * GiB), 4 * GiB) == []


def test_fragmentation_is_named_when_the_cache_had_room_but_no_block_big_enough() -> None:
    err = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB")
    assert advice.requested_bytes(err) == 2 * GiB
    r = record(before=60 * GiB, after=60 * GiB, reserved=66 * GiB, peak=None)
    (line,) = advice.fragmentation([r], advice.requested_bytes(err), {"cuda:0": 512 * MiB})
    assert "6.00 GiB reserved but unallocated, yet its largest free block is 512 MiB and 2.00 GiB was asked" in line
    assert "expandable_segments:True" in line
    assert advice.fragmentation([r], 2 * GiB, {"cuda:0": 3 * GiB}) == [], "a block was big enough: not the cause"
    assert advice.fragmentation([r], 8 * GiB, {"cuda:0": 512 * MiB}) == [], "the cache could never have held it"
    advice_lines = advice.oom_advice([r], err, source="x = f()", lines_recorded=True, replays={},
                                     cell_files=frozenset(), names={}, largest_free={"cuda:0": 512 * MiB})
    assert any("fragmentation" in a for a in advice_lines)
