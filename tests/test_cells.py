"""Per-cell analysis: exact peaks from the allocator's counters without resetting them."""

from __future__ import annotations

from nbmem.cells.peaks import cell_peak, cell_records
from nbmem.records import AllocatorReading, Boundary

MiB = 2**20


def b(alloc, peak, reserved=None, t=0.0, rss=100, maxrss=200, total=0):
    a = {"cuda:0": AllocatorReading(alloc, reserved or max(alloc, peak), alloc, 0, peak, reserved or peak, total)}
    return Boundary(t, t, rss, maxrss, a if alloc is not None else {}, {})


def test_a_cell_that_raises_the_high_water_mark_has_an_exact_peak():
    assert cell_peak(b(10, 50), b(10, 80), "cuda:0", was_reset=False) == (80, "")


def test_below_an_earlier_peak_the_cumulative_counter_bounds_it_and_says_so():
    # 50 bytes allocated and freed inside the cell, below an earlier high-water mark of 80
    peak, note = cell_peak(b(10, 80, total=100), b(10, 80, total=150), "cuda:0", was_reset=False)
    assert peak is None and note.startswith("≤ 60 B") and "%%cudamem" in note


def test_the_cumulative_counters_pin_the_peak_when_nothing_allocated_was_freed():
    assert cell_peak(b(10, 80, total=100), b(10, 80, total=100), "cuda:0", was_reset=False) == (10, "")
    assert cell_peak(b(10, 80, total=100), b(30, 80, total=120), "cuda:0", was_reset=False) == (30, "")
    assert cell_peak(b(30, 80, total=100), b(10, 80, total=100), "cuda:0", was_reset=False) == (30, "")


def test_when_the_bounds_meet_the_peak_is_exact():
    assert cell_peak(b(80, 80), b(10, 80), "cuda:0", was_reset=False) == (80, "")


def test_a_reset_inside_the_cell_is_recognised():
    peak, note = cell_peak(b(10, 80), b(10, 30), "cuda:0", was_reset=False)
    assert peak is None and "reset inside" in note
    assert cell_peak(b(10, 10), b(10, 30), "cuda:0", was_reset=True) == (30, "")


def test_cuda_starting_inside_the_cell_counts_from_zero():
    before = Boundary(0.0, 0.0, 1, 1, {}, {})
    (r,) = cell_records(3, before, b(256 * MiB, 300 * MiB, t=1.5))
    assert (r.device, r.allocated_before_bytes, r.delta_allocated_bytes, r.peak_allocated_bytes) == \
        ("cuda:0", 0, 256 * MiB, 300 * MiB)
    assert r.duration_s == 1.5


def test_cpu_only_has_one_cpu_row_with_unknown_peak():
    cpu = Boundary(0.0, 0.0, 100, 200, {}, {})
    (r,) = cell_records(1, cpu, Boundary(1.0, 1.0, 150, 300, {}, {}), error="ValueError")
    assert r.device == "cpu" and r.peak_allocated_bytes is None and r.delta_rss_bytes == 50
    assert r.peak_rss_bytes == 300 and r.error == "ValueError"
