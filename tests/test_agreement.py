"""The allocator model against real tries (issue 47): each file in ``tests/data/traces/`` is one try of
``benchmarks/bench_agreement.py``'s part A, recorded on a GPU under a cap (``set_per_process_memory_fraction``):
three training steps' allocator trace, the allocator's segments before them, and whether they ran or ran out of
memory. Replayed through ``CachingAllocatorModel`` at that cap, the model must agree with what happened, and must
never fit a try that failed. The expected outcomes are the recorded ones; the replay is pure, so these run
anywhere. The replay's own rules are checked below on made-up traces."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nbmem.fitting.analysis.allocator import SegmentState

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
TRACES = sorted([*(ROOT / "tests" / "data" / "traces").glob("*.json"),
                 *(ROOT / "tests" / "data" / "traces").glob("*.json.gz")])
RECORD = "python benchmarks/bench_agreement.py --quick --save-traces tests/data/traces (on a GPU)"
NONE_YET = f"tests/data/traces/ holds no recorded tries yet: record them with `{RECORD}`"
MiB = 1 << 20


def _bench() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        import bench_agreement
    finally:
        sys.path.remove(str(BENCH))
    return bench_agreement


ba = _bench()


@pytest.mark.parametrize("path", TRACES or [pytest.param(None, marks=pytest.mark.skip(reason=NONE_YET))],
                         ids=[p.name for p in TRACES] or ["none recorded"])
def test_the_model_agrees_with_each_recorded_try_and_never_fits_one_that_failed(path: Path) -> None:
    rec = ba.read_trace(path)
    failed = not rec["real"]["ok"]
    verdict = ba.judge(rec["entries"], rec["segments"], rec["capacity_bytes"], failed)
    what = f"{rec['body']} at {rec['var']}={rec['value']:,} under {rec['capacity_bytes'] / MiB:,.1f} MiB"
    assert verdict is not None, f"{what}: the failed try's trace has no out-of-memory request to hold the model to"
    assert not verdict.unsafe, f"{what}: the model fits a try that ran out of memory (request {verdict.fatal:,})"
    assert verdict.agrees, f"{what}: the try ran, and the model refused {verdict.where()}"


@pytest.mark.skipif(not TRACES, reason=NONE_YET)
def test_the_recorded_tries_hold_tries_that_ran_and_tries_that_failed() -> None:
    """Both outcomes, so the test above can fail both ways."""
    outcomes = {ba.read_trace(p)["real"]["ok"] for p in TRACES}
    assert outcomes == {True, False}, outcomes


# -- the replay's rules, on made-up traces ------------------------------------------------------------------------
def alloc(addr: int, size: int) -> dict[str, Any]:
    return {"action": "alloc", "addr": addr, "size": size, "stream": 0}


def free(addr: int, size: int) -> dict[str, Any]:
    return {"action": "free_requested", "addr": addr, "size": size, "stream": 0}


def oom(size: int) -> dict[str, Any]:
    return {"action": "oom", "size": size, "stream": 0, "device_free": 0}


A, B, C = 0x7F00_0000_0000, 0x7F10_0000_0000, 0x7F20_0000_0000
#: Two blocks of 16 MiB (a segment each) and a third that a 40 MiB cap cannot take, the try's last request.
FAILS_AT_THE_THIRD = [alloc(A, 16 * MiB), alloc(B, 16 * MiB), oom(16 * MiB), free(B, 16 * MiB), free(A, 16 * MiB)]


def test_a_try_that_failed_is_refused_by_the_model_at_the_same_request() -> None:
    v = ba.judge(FAILS_AT_THE_THIRD, (), 40 * MiB, failed=True)
    assert v is not None and v.agrees and not v.unsafe
    assert (v.fatal, v.refused_at, v.where()) == (3, 3, "the same request")
    assert v.model() == "OOM" and v.agreement() == "yes"


def test_a_model_with_more_room_than_the_try_had_fits_it_and_says_so() -> None:
    v = ba.judge(FAILS_AT_THE_THIRD, (), 64 * MiB, failed=True)
    assert v is not None and v.unsafe and not v.agrees
    assert v.agreement() == "MODEL FITS, REAL FAILED" and v.where() == "met request 3, which failed"


def test_a_try_that_ran_is_met_in_the_model_and_the_cache_is_given_back_before_a_failure() -> None:
    # 36 MiB of segments cached and free when 30 MiB is asked for under 44 MiB: the cache goes, and it fits.
    trace = [alloc(A, 8 * MiB), alloc(A + 8 * MiB, 8 * MiB), alloc(B, 16 * MiB), free(A, 8 * MiB),
             free(A + 8 * MiB, 8 * MiB), free(B, 16 * MiB), alloc(C, 30 * MiB), free(C, 30 * MiB)]
    v = ba.judge(trace, (), 44 * MiB, failed=False)
    assert v is not None and v.agrees and v.model_ok and v.where() == ""
    assert v.up.peak_reserved_bytes == 36 * MiB and v.up.unknown_frees == 0
    low = ba.judge(trace, (), 28 * MiB, failed=False)
    assert low is not None and not low.model_ok and low.agreement() == "model fails, real ran"
    assert low.where() == "request 3 of 4"


def test_a_refused_request_the_try_survived_is_refused_in_the_model_too_or_given_back() -> None:
    """cuDNN catches an out-of-memory error and takes another algorithm: the try runs on past it."""
    trace = [alloc(A, 16 * MiB), alloc(B, 16 * MiB), oom(16 * MiB), alloc(C, 512 << 10), free(C, 512 << 10)]
    tight = ba.judge(trace, (), 40 * MiB, failed=False)
    assert tight is not None and tight.agrees and tight.up.met_refused == 0
    roomy = ba.judge(trace, (), 64 * MiB, failed=False)
    assert roomy is not None and roomy.agrees and roomy.up.met_refused == 1
    assert roomy.up.peak_reserved_bytes == 50 * MiB  # the refused 16 MiB met, then given back: its segment cached


def test_blocks_from_before_the_try_are_freed_at_their_real_addresses() -> None:
    """An 8 MiB block the try frees leaves its 20 MiB segment whole: a 20 MiB request fits under a 20 MiB cap."""
    seg = SegmentState(A, 20 * MiB, 0, False, ((A, 8 * MiB, True), (A + 8 * MiB, 12 * MiB, False)))
    trace = [free(A, 8 * MiB), alloc(B, 20 * MiB)]
    v = ba.judge(trace, (seg,), 20 * MiB, failed=False)
    assert v is not None and v.model_ok and v.up.unknown_frees == 0 and v.up.peak_reserved_bytes == 20 * MiB
    kept = ba.judge(trace[1:], (seg,), 20 * MiB, failed=False)
    assert kept is not None and not kept.model_ok


def test_a_failed_try_without_its_failed_request_gets_no_verdict() -> None:
    assert ba.judge(FAILS_AT_THE_THIRD[:2], (), 40 * MiB, failed=True) is None


def test_slim_keeps_what_a_replay_reads() -> None:
    raw = [{"action": "alloc", "addr": A, "size": 512, "stream": 7, "time_us": 1, "frames": [{"line": 3}]},
           {"action": "free_completed", "addr": A, "size": 512, "stream": 7},
           {"action": "oom", "size": 1024, "stream": 7, "device_free": 5, "time_us": 2}]
    assert ba.slim(raw) == [{"action": "alloc", "addr": A, "size": 512, "stream": 7},
                            {"action": "oom", "size": 1024, "stream": 7, "device_free": 5}]


# -- the extrapolation's measures -------------------------------------------------------------------------------
def _lcs(a: list[int], b: list[int], tolerance: float) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            close = x == y or (tolerance > 0 and abs(x - y) <= tolerance * max(x, y))
            cur.append(prev[j] + 1 if close else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


@pytest.mark.parametrize("tolerance", [0.0, 0.1])
def test_in_order_is_the_longest_common_subsequence(tolerance: float) -> None:
    rng = random.Random(47)
    sizes = [512, 1024, 1100, 4096, 4500, 20 * MiB]
    for _ in range(300):
        a = [rng.choice(sizes) for _ in range(rng.randrange(0, 25))]
        b = [rng.choice(sizes) for _ in range(rng.randrange(0, 25))]
        assert ba.in_order(a, b, tolerance) == _lcs(a, b, tolerance), (a, b)


def test_compare_counts_bytes_and_order_in_blocks() -> None:
    real = [100, 2000, 4 * MiB, 512]
    c = ba.compare(real, [600, 2048, int(4.2 * MiB)])
    assert (c.real, c.synth, c.real_bytes, c.real_largest) == (4, 3, 512 + 2048 + 4 * MiB + 512, 4 * MiB)
    assert c.synth_largest == int(4.2 * MiB) // 512 * 512 + 512
    # blocks 512, 2,048, 4 MiB, 512 against 1,024, 2,048, 4.2 MiB: 512 is not within 10 % of 1,024
    assert (c.in_order, c.same_block) == (2, 1)


# -- the trace files ------------------------------------------------------------------------------------------------
def _record(entries: list[dict[str, Any]]) -> dict[str, Any]:
    seg = SegmentState(A, 2 * MiB, 0, True, ((A, 512, True), (A + 512, 2 * MiB - 512, False)))
    return {"format": ba.TRACE_FORMAT, "body": "mlp", "var": "batch", "value": 123, "capacity_bytes": 1 << 30,
            "real": {"ok": False}, "segments": [{"address": seg.address, "total_bytes": seg.total_bytes,
                                                 "stream": seg.stream, "small": seg.small,
                                                 "blocks": [list(b) for b in seg.blocks], "usable": True}],
            "entries": entries}


def test_a_trace_file_reads_back_as_written_and_large_ones_are_gzipped(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    small, size = ba.write_trace(tmp_path, _record(FAILS_AT_THE_THIRD))
    assert small is not None and small.name == "mlp-1024MiB-123-oom.json" and size == small.stat().st_size
    back = ba.read_trace(small)
    assert back["entries"] == FAILS_AT_THE_THIRD and back["real"] == {"ok": False}
    assert back["segments"] == (SegmentState(A, 2 * MiB, 0, True, ((A, 512, True), (A + 512, 2 * MiB - 512, False))),)
    many = [alloc(A + 512 * i, 512) for i in range(4000)]
    big, _ = ba.write_trace(tmp_path, _record(many))
    assert big is not None and big.name.endswith(".json.gz") and ba.read_trace(big)["entries"] == many
    assert ba.trace_files(tmp_path) == sorted([small, big])
    monkeypatch.setattr(ba, "MAX_FILE_BYTES", 100)
    assert ba.write_trace(tmp_path / "more", _record(FAILS_AT_THE_THIRD))[0] is None
    assert not (tmp_path / "more").exists()


def test_a_trace_file_of_another_format_is_refused(tmp_path: Path) -> None:
    path, _ = ba.write_trace(tmp_path, {**_record([]), "format": ba.TRACE_FORMAT + 1})
    assert path is not None
    with pytest.raises(ValueError, match="trace format"):
        ba.read_trace(path)


# -- the benchmark without a GPU ----------------------------------------------------------------------------------
def test_the_benchmark_without_cuda_says_so_in_one_line_and_exits_0() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(BENCH / "bench_agreement.py"), "--quick"], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [ba.NEEDS_CUDA], out.stdout


def test_part_bs_hooks_see_the_timeline_a_fit_builds_and_its_requests() -> None:
    """Part B reads the fit's timeline and its replay's requests through two names it swaps in the analysis; a
    rename there (as when the fit's house was split) must fail here, not on the next GPU run."""
    import gzip
    import json

    from nbmem.fitting.analysis.model import Room, RunTrace
    from nbmem.fitting.analysis.prediction import analyse
    from nbmem.fitting.analysis.timeline import Timeline

    row = json.load(gzip.open(ROOT / "tests" / "data" / "fit_traces_h100.json.gz", "rt"))[0]
    runs = [RunTrace(r["value"], r["entries"], r["counted"], r["allocated_before_bytes"], r["reserved_before_bytes"],
                     r["oom"]) for r in row["runs"]]
    room = Room(**row["room"])
    with ba.last_timeline() as built:
        res = analyse(runs, room, name=row["family"])
    assert res.largest_value is not None and len(built) == 1 and isinstance(built[0], Timeline)
    sizes, sim = ba.synthesised(built[0], res.largest_value, room.capacity_bytes)
    assert sim.ok and len(sizes) > 10 and sim.peak_allocated_bytes >= max(sizes)
