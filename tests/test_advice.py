"""Advice after a cell on a GPU: the headroom line, and fragmentation named when it is the cause."""

from __future__ import annotations

from nbmem import advice
from nbmem.records import Boundary, CellRecord, GpuReading

GiB, MiB = 2**30, 2**20


def record(*, before: int, after: int, reserved: int, peak: int | None, device: str = "cuda:0") -> CellRecord:
    return CellRecord(3, 0.0, 1.0, device, before, after, reserved, reserved, peak, "", None, None, None, None, None,
                      "")


def boundary(used: int | None, total: int | None) -> Boundary:
    return Boundary(0.0, 0.0, None, None, {}, {"cuda:0": GpuReading(used, total, None, None)})


def test_the_headroom_line_says_how_many_times_the_cells_growth_still_fits() -> None:
    r = record(before=2 * GiB, after=3 * GiB, reserved=6 * GiB, peak=5 * GiB)
    # free for this process: its 6 GiB cache + the device's 80 - 20 GiB free = 66 GiB; room 64 GiB for 3 GiB growth
    (line,) = advice.headroom([r], boundary(20 * GiB, 80 * GiB), MiB)
    assert line == "cuda:0: peak 5.00 GiB of 66.0 GiB free for this process: room for ~21.3× this cell's growth"


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
