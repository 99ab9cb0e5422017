"""Host memory as a fit's limit: the room there, the model of each run's host bytes, the answer it allows, and
a search that never runs a value predicted not to fit on the host."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import numpy as np
import pytest

from nbmem.fitting.analysis import hostroom as H
from nbmem.fitting.analysis.hostroom import HostRoom, HostUse
from nbmem.fitting.analysis.model import Room, RunTrace
from nbmem.fitting.analysis.prediction import analyse
from nbmem.fitting.runs import hostwatch, nearby, runner
from nbmem.fitting.runs.hostwatch import HostWatch
from nbmem.fitting.runs.multigpu import RunSet
from nbmem.records import MemoryLimit
from tests.test_fit import GiB, MiB, record, room, training_step


# -- the room ------------------------------------------------------------------------------------------------------
class FakeHost:
    def __init__(self, total: int | None, used: int | None, lim: MemoryLimit, rss: int | None = GiB) -> None:
        self.total, self.used, self.lim, self.rss = total, used, lim, rss

    def memory(self) -> tuple[int | None, int | None, MemoryLimit]:
        return self.total, self.used, self.lim

    def rss_bytes(self) -> int | None:
        return self.rss


NO_LIMIT = MemoryLimit(None, None, None, "", host_total_bytes=64 * GiB)


def test_the_host_room_is_the_limit_set_by_hand_else_the_containers_else_the_machines_less_a_margin() -> None:
    by_hand, why = hostwatch.room_for(8 * GiB, FakeHost(64 * GiB, 10 * GiB, NO_LIMIT, rss=3 * GiB))  # type: ignore[arg-type]
    assert by_hand is not None and not why
    assert (by_hand.limit_bytes, by_hand.used_bytes, by_hand.source) == (8 * GiB, 3 * GiB, "host_limit")
    assert by_hand.margin_bytes == int(0.05 * 8 * GiB)
    assert by_hand.capacity_bytes == 5 * GiB - int(0.05 * 8 * GiB)
    cgroup = MemoryLimit(16 * GiB, 6 * GiB, 0, "cgroup v2 memory.max", host_total_bytes=64 * GiB)
    boxed, _ = hostwatch.room_for(None, FakeHost(16 * GiB, 6 * GiB, cgroup))  # type: ignore[arg-type]
    assert boxed is not None and boxed.source == "the container's memory limit (cgroup v2 memory.max)"
    assert boxed.capacity_bytes == 10 * GiB - max(256 * MiB, int(0.05 * 16 * GiB))
    machine, _ = hostwatch.room_for(None, FakeHost(64 * GiB, 40 * GiB, NO_LIMIT))  # type: ignore[arg-type]
    assert machine is not None and machine.source == "the machine's memory"
    assert machine.capacity_bytes == 24 * GiB - int(0.05 * 64 * GiB)
    assert machine.text().startswith(f"{machine.capacity_bytes / GiB:.1f} GiB room: the machine's memory 64.0 GiB − "
                                     "40.0 GiB in use − 3.20 GiB margin (5 %)"), machine.text()
    small, _ = hostwatch.room_for(None, FakeHost(2 * GiB, GiB, NO_LIMIT))  # type: ignore[arg-type]
    assert small is not None and small.margin_bytes == 256 * MiB  # never less than the floor
    unknown, why = hostwatch.room_for(None, FakeHost(None, None, MemoryLimit(None, None, None, "", reason="no /proc")))  # type: ignore[arg-type]
    assert unknown is None and why == "no /proc"


@pytest.mark.parametrize(("spec", "want"), [("8GiB", 8 * GiB), ("8 GB", 8 * 10**9), ("512MiB", 512 * MiB),
                                            (3 * GiB, 3 * GiB), ("1.5G", 3 * GiB // 2), (np.int64(GiB), GiB), (1, 1)])
def test_host_limit_takes_a_size_or_bytes(spec: object, want: int) -> None:
    got = H.parse_host_limit(spec)
    assert got == want and type(got) is int


@pytest.mark.parametrize("spec", ["8", "lots", "0GB", "0MiB", "0.0000000001GiB", "-1GB", "", -1, 0, True, None, 8e9,
                                  float("inf"), float("nan"), np.float64(8e9), [8 * GiB]])
def test_a_host_limit_that_is_no_size_above_0_names_the_fix(spec: object) -> None:
    with pytest.raises(ValueError) as e:
        H.parse_host_limit(spec)
    ints = "" if isinstance(spec, str) else ", or a whole number of bytes"
    assert str(e.value) == f"takes a memory size above 0, such as '8GiB', '8GB' or '8000MiB'{ints}; not {spec!r}"


# -- the model -----------------------------------------------------------------------------------------------------
def test_pinned_bytes_are_bounded_by_the_power_of_two_a_block_can_round_up_to() -> None:
    need = H.host_need([HostUse(8, 4 * MiB, 0, counted=False), HostUse(8, 4 * MiB, 0), HostUse(16, 8 * MiB, 0),
                        HostUse(32, 16 * MiB, 0)])
    assert need is not None and need.pageable is None and "pinned" in need.how
    assert need.at(32) == 16 * MiB and need.at(20) == 8 * MiB * 2  # past 16: a block may round up to twice
    assert need.at(33) == 32 * MiB and need.at(64) == 32 * MiB and need.at(65) == 64 * MiB
    # a block of 3 MiB × v/32 rounds to 4 MiB at 32 and to 8 MiB at 33 through 64: never above the bound
    for v in range(1, 2000):
        assert PinnedHost.need(v) <= need.at(v), v
    fixed = H.host_need([HostUse(8, 64 * MiB, 0), HostUse(16, 64 * MiB, 0), HostUse(32, 64 * MiB, 0)])
    assert fixed is not None and fixed.pinned_fixed and fixed.at(10_000) == 64 * MiB


def _pow2(n: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def test_a_fixed_part_of_the_pinned_pool_is_not_scaled_by_the_power_of_two_bound() -> None:
    """save_on_cpu packs the weights a layer saves as well as its activations: an MLP of 6 × 4096² Linear and GELU
    layers has 13 blocks of 16 KiB × batch and 384 MiB of weights in the pool (the H100's bench row)."""
    def pool(b: int) -> int:
        return 384 * MiB + 13 * _pow2(16 * 1024 * b)

    runs = [1024, 1024, 2048, 4096, 18_432, 27_648, 41_472]
    need = H.host_need([HostUse(v, pool(v), 0, counted=k > 0) for k, v in enumerate(runs)])
    assert need is not None and need.pinned_floor_bytes == 384 * MiB
    assert need.at(65_536) == pool(65_536), "13 blocks of 1 GiB and the weights, not 16 × the pool at 4,096"
    assert need.at(65_537) == pool(65_537)
    for v in range(1, 140_000, 97):
        assert pool(v) <= need.at(v), v
    # one pair a power of two apart cannot tell a fixed part from blocks of a × v + c: no floor
    assert H.host_need([HostUse(v, pool(v), 0) for v in (1024, 2048, 3000)]).pinned_floor_bytes == 0  # type: ignore[union-attr]


def test_a_block_that_has_not_grown_yet_is_no_fixed_part_where_a_run_shows_it_growing() -> None:
    """A block of 3 KiB × v + 1 MiB is 2 MiB at 16, 32 and 64 (it looks fixed) and 4 MiB from 342 on: the run at
    400 does not show the bound's growth from 16, so there is no floor, and the bound holds beyond. (Where no run
    reaches the value at which such a block starts to grow, it is taken as fixed: the host margin is all there is.)"""
    def pool(v: int) -> int:
        return 64 * MiB + _pow2(4096 * v) + _pow2(3072 * v + MiB)

    assert H.host_need([HostUse(v, pool(v), 0) for v in (16, 32, 64, 182)]).pinned_floor_bytes > 64 * MiB  # type: ignore[union-attr]
    need = H.host_need([HostUse(v, pool(v), 0) for v in (16, 32, 64, 400)])
    assert need is not None and need.pinned_floor_bytes == 0
    for v in range(1, 20_000, 7):
        assert pool(v) <= need.at(v), v


@pytest.mark.parametrize("seed", range(40))
def test_the_pinned_bound_with_a_fixed_part_never_falls_below_the_pool(seed: int) -> None:
    """What save_on_cpu packs: activations (a × v bytes each, rounded up to powers of two) and weights (fixed), with
    runs at three values a power of two apart and some between: at any value the bound is at or above the pool."""
    rng = random.Random(seed)
    blocks = [(rng.choice([0.5, 1, 3, 4, 7, 16]) * 1024, 0) for _ in range(rng.randint(1, 6))] + [
        (0, rng.choice([4096, 1 << 20, 3 << 20, 64 * MiB])) for _ in range(rng.randint(0, 3))]
    fixed = rng.choice([0, 64 * MiB, 384 * MiB])

    def pool(v: int) -> int:
        return fixed + sum(_pow2(a * v + c) for a, c in blocks)

    base = rng.choice([8, 16, 100, 1024])
    values = [base, 2 * base, 4 * base] + [int(base * rng.uniform(4.1, 30)) for _ in range(rng.randint(0, 3))]
    need = H.host_need([HostUse(v, pool(v), 0) for v in values])
    assert need is not None
    for v in range(1, 400 * base, max(1, base // 4)):
        assert pool(v) <= need.at(v), (v, blocks, fixed, need.pinned_floor_bytes)


def test_host_growth_below_noise_is_no_limit() -> None:
    assert H.host_need([HostUse(8, 0, MiB), HostUse(16, 0, 3 * MiB), HostUse(32, 0, 2 * MiB)]) is None
    assert H.host_need([HostUse(8, 4096, 0), HostUse(16, 4096, 0), HostUse(32, 4096, 0)]) is None  # a scalar's
    assert H.host_need([]) is None


def test_pageable_growth_is_a_line_through_the_runs() -> None:
    need = H.host_need([HostUse(8, 0, 100 * MiB), HostUse(16, 0, 200 * MiB), HostUse(32, 0, 400 * MiB)])
    assert need is not None and not need.pinned and "pageable" in need.how
    assert need.at(64) == 800 * MiB


def test_the_answer_fits_on_the_host_and_on_the_gpu_and_says_which_limits_it() -> None:
    res = analyse(record(training_step(per_sample=MiB, param=MiB), [8, 16, 32]), room(80 * GiB), name="batch")
    gpu = res.largest_value
    assert gpu is not None and gpu > 1000
    host_room = HostRoom(16 * GiB, 4 * GiB, 800 * MiB, "the container's memory limit (cgroup v2 memory.max)")
    need = H.host_need([HostUse(v, v * 16 * MiB, 0) for v in (8, 16, 32)])  # a pinned copy of 16 MiB a sample
    limited = H.with_host(res, H.fit_host(need, host_room), "batch")
    assert limited.largest_value == 512  # 16 × 2^k: the largest whose 2× rounding bound fits in 11.2 GiB
    assert need is not None and need.at(512) <= host_room.capacity_bytes < need.at(513)
    assert limited.answer().endswith("; limited by host memory")
    text = str(limited)
    assert "limited by host memory: 11.2 GiB room: the container's memory limit (cgroup v2 memory.max) 16.0 GiB" in text
    assert f"the GPU alone would allow {gpu:,}" in text and limited.row()["host_limits"] is True
    assert limited.row()["host_largest_value"] == 512 and limited._repr_html_().count("limited by host memory") == 2

    roomy = HostRoom(1 << 50, 0, 256 * MiB, "host_limit")
    fits = H.with_host(res, H.fit_host(need, roomy), "batch")
    assert fits.largest_value == gpu and "limited by host" not in str(fits)
    assert f"at {gpu:,}: it fits" in str(fits) and fits.row()["host_limits"] is False

    none = H.with_host(res, H.fit_host(H.host_need([HostUse(v, 0, MiB) for v in (8, 16, 32)]), host_room), "batch")
    assert none is res and str(none) == str(res)  # no host growth: not a word more


def test_a_body_whose_gpu_memory_does_not_grow_gets_the_hosts_answer() -> None:
    def fixed(v: int, first: bool) -> Any:
        yield ("alloc", "w", 64 * MiB, 1)
        yield ("free", "w", 1)

    res = analyse(record(fixed, [8, 16, 32]), room(GiB), name="batch")
    assert res.largest_value is None
    need = H.host_need([HostUse(v, 0, v * 10 * MiB) for v in (8, 16, 32)])
    got = H.with_host(res, H.fit_host(need, HostRoom(4 * GiB, 0, 256 * MiB, "host_limit")), "batch")
    assert got.largest_value == (4 * GiB - 256 * MiB) // (10 * MiB) and "limited by host memory" in got.answer()


# -- the runs ------------------------------------------------------------------------------------------------------
class PinnedHost:
    """A host whose pinned pool a test double's runs grow: 4 blocks of 3 MiB × value / 32, rounded to powers of
    two (as CUDA's host allocator rounds them), failing where the pool would pass ``real_bytes``."""

    def __init__(self, real_bytes: int) -> None:
        self.real_bytes = real_bytes
        self.pool = 0
        self.ran: list[int] = []

    @staticmethod
    def need(v: int) -> int:
        return 4 * (1 << max(0, (3 * MiB * v // 32 - 1).bit_length()))

    def run(self, v: int) -> None:
        self.ran.append(v)
        if self.pool + self.need(v) > self.real_bytes:
            raise RuntimeError("CUDA error: out of memory")
        self.pool += self.need(v)

    def empty(self) -> bool:
        self.pool = 0
        return True


@pytest.fixture
def fake_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    body = training_step(per_sample=16 * 1024, param=MiB)  # the GPU: room for millions

    def one_run(run: Any, value: int, counted: bool, src: Any, devs: Any, stacks: bool, n: int) -> Any:
        try:
            run(value)
        except RuntimeError as e:
            return RunSet.single(RunTrace(value, [], counted, 0, 0, oom=True)), str(e)
        trace = record(body, [value], warmup=False)[0]
        return RunSet.single(RunTrace(value, trace.entries, counted, 0, 0)), ""

    monkeypatch.setattr(runner, "_one_run", one_run)
    monkeypatch.setattr(runner, "free_cached", lambda src, devs, **kw: None)
    monkeypatch.setattr(runner, "allocated_reserved", lambda src, dev: (0, 0))
    monkeypatch.setattr(runner, "room_now", lambda src, d, room: (room, 0))


def fit_with(host: PinnedHost, host_room: HostRoom, vals: list[int]) -> tuple[Any, list[str]]:
    notes: list[str] = []
    watch = HostWatch(host_room, read_pageable=lambda: 0, read_rss=lambda: GiB, read_pinned=lambda: host.pool,
                      empty_pinned=host.empty)
    body = runner.FitBody(host.run, None, [0], False, 10**6, None, "batch", notes, host=watch)  # type: ignore[arg-type]
    body.rooms[0], body.segments[0] = Room("cuda:0", 80 * GiB, 0, 0, 0), ()
    runs: list[RunSet] = []
    res = None
    if not runner._runs(body, vals, True, runs, [], frozenset()):
        res = nearby.refine(body, runs, frozenset())
    watch.close()
    final = H.with_host(analyse([r.traces[0] for r in runs], body.rooms[0], name="batch"), watch.fit(), "batch")
    assert res is None or res.largest_value == final.largest_value
    return final, notes


def test_the_runs_never_run_a_value_predicted_over_the_host_room(fake_runs: None) -> None:
    real = 4 * GiB
    host = PinnedHost(real)
    host_room = HostRoom(real, 0, 256 * MiB, "host_limit")
    res, notes = fit_with(host, host_room, [32, 64, 128, 16384])
    boundary = max(v for v in range(1, 100_000) if host.need(v) <= real)
    in_room = max(v for v in range(1, 100_000) if host.need(v) <= host_room.capacity_bytes)
    assert host.ran and all(host.need(v) <= real for v in host.ran), host.ran  # nothing ran that fails
    assert 16384 not in host.ran and any("16,384 was not run" in n and "pinned" in n for n in notes)
    assert res.largest_value is not None and res.largest_value <= in_room < boundary
    assert res.largest_value > in_room // 2  # the rounding bound costs less than a factor of two
    assert "limited by host memory" in res.answer()


def test_the_runs_near_the_answer_stay_under_the_host_room(fake_runs: None) -> None:
    real = 6 * GiB
    host = PinnedHost(real)
    res, _ = fit_with(host, HostRoom(real, 0, 256 * MiB, "host_limit"), [32, 64, 128])
    assert len(host.ran) > 4, "the GPU's far answer brings runs nearer it"
    assert all(host.need(v) <= real - 256 * MiB for v in host.ran), host.ran
    assert res.largest_value is not None and host.need(res.largest_value) <= real


def test_a_host_watch_measures_a_runs_pinned_and_heap_growth_and_stops_its_thread() -> None:
    import threading

    pool = itertools.count(0, 8 * MiB)
    heap = iter([100 * MiB, 130 * MiB, 110 * MiB] + [110 * MiB] * 10_000)
    watch = HostWatch(None, read_pageable=lambda: next(heap), read_pinned=lambda: next(pool),
                      empty_pinned=lambda: False)
    watch.before()
    assert any(t.name == "nbmem-fit-host" for t in threading.enumerate())
    watch.after(16, True, False)
    assert not any(t.name == "nbmem-fit-host" for t in threading.enumerate())
    (use,) = watch.uses
    assert use.value == 16 and use.pinned_bytes == 8 * MiB and use.pageable_bytes == 30 * MiB  # the heap's
    watch.close()


def test_off_glibc_a_runs_pageable_bytes_are_rss_less_the_pinned_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostwatch, "heap_bytes", None)
    pool = iter([0, 8 * MiB])
    rss = iter([GiB, GiB + 50 * MiB] + [GiB + 20 * MiB] * 10_000)  # 50 MiB more resident, 8 of them pinned
    watch = HostWatch(None, read_rss=lambda: next(rss), read_pinned=lambda: next(pool), empty_pinned=lambda: False)
    watch.before()
    watch.after(16, True, False)
    assert watch.uses[0].pinned_bytes == 8 * MiB and watch.uses[0].pageable_bytes == 42 * MiB


def test_nbmem_fit_refuses_a_host_limit_that_is_no_size_before_anything_runs() -> None:
    import nbmem

    ran: list[int] = []
    with pytest.raises(ValueError) as e:
        nbmem.fit(ran.append, "batch", [8, 16], host_limit="lots")
    assert str(e.value) == ("nbmem.fit(host_limit=...) takes a memory size above 0, such as '8GiB', '8GB' or "
                            "'8000MiB'; not 'lots'. Nothing was run.")
    assert not ran


class _EveryCheckFails:
    """A fit's body (``nearby.BodyRuns``) that ran once at 100, whose every check at an answer runs out of
    memory, and whose analysis answers ``answers[n]`` after ``n`` failed checks."""

    name, ran, progress, host = "batch", 0, None, None

    def __init__(self, answers: tuple[int, ...]) -> None:
        self.answers = answers
        self.notes: list[str] = []
        self.durations = {100: 0.01}
        self.rooms: dict[int, Room] = {}
        self.asked: list[int] = []

    def analyse(self, runs: list[RunSet], cell_files: frozenset[str], max_value: int | None = None) -> Any:
        from nbmem.fitting.analysis.prediction import FitResult

        failed = sum(1 for r in runs if r.oom)
        return FitResult(name="batch", device="cuda:0", values=(100,), points=(), room=None,
                         largest_value=self.answers[failed])

    def steps_at(self, value: int, steps: int, caps: Any = None) -> tuple[RunSet, str]:
        self.asked.append(value)
        return RunSet.single(RunTrace(value, [], False, 0, 0, oom=True)), "CUDA out of memory"

    def confirm(self) -> Any:
        return nearby.confirm(self, [RunSet.single(RunTrace(100, [], True, 0, 0))], None,  # type: ignore[arg-type]
                              frozenset())


def test_an_answer_below_checks_that_all_ran_out_of_memory_says_it_was_not_run() -> None:
    """Where both checks at the model's answers run out of memory, the model under-counts the body near its limit
    (a compiled LM on an H200 did so); the lower answer it then gives is unrun, and the report says so."""
    body = _EveryCheckFails((1000, 950, 900))
    res = body.confirm()
    assert body.asked == [1000, 950] and res.largest_value == 900
    assert sum(n.startswith("2 steps in a row at batch=") for n in body.notes) == 2
    assert body.notes[-1].startswith("the answer (batch=900) was not run: the 2 checks above it ran out of memory")


def test_an_answer_at_or_below_a_value_that_ran_is_not_called_unrun() -> None:
    body = _EveryCheckFails((1000, 950, 80))
    res = body.confirm()
    assert body.asked == [1000, 950] and res.largest_value == 80  # below the value 100 that ran
    assert not any("was not run" in n for n in body.notes), body.notes
