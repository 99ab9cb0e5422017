"""A fit on every GPU its body uses, and for a GPU it is asked about (``--on``): the per-device analysis over
synthetic traces, the runner's devices with stand-ins for CUDA, and ``--on``'s sizes, names and table. The
runs on two real GPUs are in tests/gpu/test_fit_multi_gpu.py."""

from __future__ import annotations

import itertools
import sys
from typing import Any

import pytest
import torch
from IPython.core.error import UsageError

import nbmem
from nbmem.fitting.analysis import devices
from nbmem.fitting.analysis.allocator import SegmentState
from nbmem.fitting.analysis.devices import GB, GPUS, GiB, parse_on, target_notes
from nbmem.fitting.analysis.hostroom import parse_host_limit
from nbmem.fitting.analysis.model import Room, RunTrace
from nbmem.fitting.runs import multigpu, nearby, runner, torchcheck
from nbmem.fitting.runs.multigpu import NOTHING_ON_CUDA, RunSet, analyse_devices
from nbmem.fitting.runs.state import FitRefused
from tests.test_fit_nearby import trace
from tests.test_fit_remedies import FakeSource, FakeTorch

MiB = 1 << 20
# What CUDA gives a process on these cards, typed from docs/research/gpu-memory.md (not read from the table).
L4_MIB, T4_MIB, H100_MIB = 22692, 14904, 81003


def step(value: int, per_unit: int, addrs: Any, fixed: int = 0) -> list[dict[str, Any]]:
    """One run's events on one device: an input and an activation per unit, freed by the end."""
    x, a = next(addrs) << 36, next(addrs) << 36
    out = [{"action": "alloc", "addr": x, "size": value * per_unit},
           {"action": "alloc", "addr": a, "size": value * per_unit},
           {"action": "free_requested", "addr": a, "size": value * per_unit},
           {"action": "free_requested", "addr": x, "size": value * per_unit}]
    if fixed:
        f = next(addrs) << 36
        out = [{"action": "alloc", "addr": f, "size": fixed}, *out, {"action": "free_requested", "addr": f,
                                                                      "size": fixed}]
    return out


def runs_on(per_unit: dict[int, int], values: tuple[int, ...] = (8, 16, 32), fixed: int = 0) -> list[RunSet]:
    """A body that allocates ``per_unit[d]`` bytes per unit, twice at its peak, on each device ``d``."""
    addrs = itertools.count(1)
    out = []
    for v in values:
        traces = {d: RunTrace(v, step(v, p, addrs, fixed) if p else [], True, 0, 0) for d, p in per_unit.items()}
        out.append(RunSet(v, True, False, traces))
    return out


def rooms(capacity: dict[int, int]) -> dict[int, Room]:
    return {d: Room(f"cuda:{d}", c, 0, 0, 0, 80 * GiB) for d, c in capacity.items()}


# -- several devices -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("per_unit", "limit"), [({0: 2 * MiB, 1: 4 * MiB}, 1), ({0: 8 * MiB, 1: 4 * MiB}, 0)])
def test_the_answer_fits_on_every_device_and_names_the_one_that_limits_it(per_unit: dict[int, int],
                                                                           limit: int) -> None:
    room = rooms({0: 4 * GiB, 1: 4 * GiB})
    res = analyse_devices(runs_on(per_unit), room, {}, gpus={0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H100 80GB HBM3"},
                          name="batch")
    alone = {d: analyse_devices([RunSet(r.value, True, False, {d: r.traces[d]}) for r in runs_on(per_unit)],
                                room, {}, name="batch").largest_value for d in per_unit}
    low, high = alone[limit], alone[1 - limit]
    assert low is not None and high is not None and res.largest_value == low < high, (res.largest_value, alone)
    assert res.limited_by is not None and res.limited_by.device == f"cuda:{limit}"
    assert res.device == "cuda:0, cuda:1" and res.room == room[limit]
    assert f"; limited by cuda:{limit} (NVIDIA H100 80GB HBM3)" in res.answer()
    said = str(res)
    assert f"limited by cuda:{limit} (NVIDIA H100 80GB HBM3): batch={alone[limit]:,} fits" in said
    assert f"cuda:{1 - limit} (NVIDIA H100 80GB HBM3): batch={alone[1 - limit]:,} fits" in said
    assert res.row()["limited_by"] == f"cuda:{limit}" and res.row()["devices"] == {f"cuda:{d}": alone[d]
                                                                                   for d in (0, 1)}


def test_the_plot_of_a_fit_over_several_devices_says_whose_room_it_draws() -> None:
    pytest.importorskip("matplotlib")
    from nbmem.ui.plotting import plot_fit

    res = analyse_devices(runs_on({0: 2 * MiB, 1: 4 * MiB}), rooms({0: 4 * GiB, 1: 3 * GiB}), {}, name="batch")
    drawn = plot_fit(res)
    ax = drawn.figure.axes[0]
    assert "room on cuda:1 (0 B margin kept)" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert ax.get_title().endswith("limited by cuda:1")


def test_a_body_on_another_device_is_fitted_there_whatever_the_current_one_holds() -> None:
    """Issue 34: cuda:0 holds 30 GiB and the body runs on cuda:1; cuda:0's room (nearly nothing) does not
    enter, nor does its memory that never grows, and the answer is cuda:1's."""
    room = rooms({0: 64 * MiB, 1: 4 * GiB})
    res = analyse_devices(runs_on({0: 0, 1: 4 * MiB}), room, {}, name="batch")
    only = analyse_devices(runs_on({1: 4 * MiB}), room, {}, name="batch")
    assert res.largest_value is not None and res.largest_value == only.largest_value
    assert res.device == "cuda:1" and [f.device for f in res.devices] == ["cuda:1"] and res.limited_by is None
    assert "limited by" not in str(res)


def test_a_device_whose_memory_does_not_grow_limits_nothing_and_one_where_nothing_fits_limits_all() -> None:
    flat = runs_on({0: 0, 1: 4 * MiB})
    addrs = itertools.count(1 << 20)
    for r in flat:  # cuda:0: the same 100 MiB at every value
        r.traces[0].entries.extend(step(1, 50 * MiB, addrs))  # type: ignore[attr-defined]
    res = analyse_devices(flat, rooms({0: 4 * GiB, 1: 4 * GiB}), {}, name="batch")
    assert res.limited_by is not None and res.limited_by.device == "cuda:1" and res.largest_value is not None
    assert any(f.device == "cuda:0" and f.largest_value is None and "does not grow" in f.reason for f in res.devices)
    none = analyse_devices(runs_on({0: 4 * MiB, 1: 4 * MiB}, fixed=6 * GiB), rooms({0: 4 * GiB, 1: 80 * GiB}), {},
                           name="batch")
    assert none.largest_value is None and "does not fit" in none.reason
    assert none.limited_by is not None and none.limited_by.device == "cuda:0"


def test_runs_that_allocate_on_no_device_have_no_answer_and_say_why() -> None:
    res = analyse_devices(runs_on({0: 0}), rooms({0: 4 * GiB}), {}, name="batch")
    assert res.largest_value is None and res.reason == NOTHING_ON_CUDA and res.values == (8, 16, 32)


def test_on_another_gpu_each_device_the_runs_used_becomes_that_gpu_and_keeps_its_name() -> None:
    room = rooms({0: 4 * GiB, 1: 4 * GiB})
    there, notes = multigpu.on_target(room, parse_on("L4"), lambda d: 700 * MiB, 0)
    assert [r.device for r in there.values()] == ["cuda:0 as L4 (24 GB)", "cuda:1 as L4 (24 GB)"]
    assert all(r.capacity_bytes == L4_MIB * MiB - 700 * MiB for r in there.values())
    res = analyse_devices(runs_on({0: 2 * MiB, 1: 4 * MiB}), there, {}, name="batch", notes=notes)
    assert res.limited_by is not None and "limited by cuda:1 as L4 (24 GB): batch=" in str(res)
    assert any("CUDA gives a process 22,692 MiB there, the least seen reported, of the 23,034 MiB nvidia-smi "
               "shows: Unsloth's banner on an L4" in n and "700 MiB" in n for n in res.notes)


def test_on_a_gpu_smaller_than_what_the_notebook_holds_nothing_fits_and_it_says_why() -> None:
    held = {0: Room("cuda:0", 10 * GiB, 20 * GiB, 20 * GiB, 0, 80 * GiB)}
    there, notes = multigpu.on_target(held, parse_on("T4"), lambda d: 20 * GiB + 500 * MiB, 0)
    assert there[0].capacity_bytes == T4_MIB * MiB - 500 * MiB, "its memory less the context, however much is held"
    assert any("are more than the T4 (16 GB) has: nothing fits there" in n for n in notes)
    weights = (SegmentState(1 << 40, 20 * GiB, 0, False, ((1 << 40, 20 * GiB, True),)),)  # the 20 GiB it holds
    res = analyse_devices(runs_on({0: 2 * MiB}), there, {0: weights}, name="batch")
    assert res.largest_value is None and "does not fit" in res.reason


# -- the runner's devices, CUDA stood in for -------------------------------------------------------------------------
class TwoGpus(FakeSource):
    """Two devices: cuda:0 busy (a few MiB free), cuda:1 with 1 GiB free; what each allocator holds is 64 MiB
    on a device the runs used first (their leftovers, e.g. workspaces)."""

    def __init__(self, held: dict[int, int]) -> None:
        self.held = held

    def read(self, device: int) -> Any:
        n = self.held.get(device, 0)
        return type("Reading", (), {"allocated_bytes": n, "reserved_bytes": n})()

    def device_free(self, device: int) -> tuple[int, int]:
        return (8 * MiB if device == 0 else 1 * GiB), 80 * GiB

    def context_devices(self) -> list[int]:
        """cuda:0 had a context before the fit; cuda:1 has one once a run used it."""
        return sorted({0} | set(self.held))


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A fit whose body "allocates" ``per_unit`` bytes per unit on the devices named, as its traces say; cuda:0 has
    a context before the fit, cuda:1 only once a run used it."""
    seen: dict[str, Any] = {"per_unit": {1: 2 * MiB}, "calls": []}
    addrs = itertools.count(1)

    class Cuda(type(FakeTorch.cuda)):  # type: ignore[misc]
        def get_device_name(self, device: int | None = None) -> str:
            return f"stand-in {device}"

    class Torch(FakeTorch):
        cuda = Cuda()

    def one_run(run: Any, value: int, counted: bool, src: Any, devs: list[int], stacks: bool, max_entries: int) -> Any:
        seen["calls"].append(list(devs))
        run(value)
        traces = {d: RunTrace(value, [], counted, 0, 0) for d in devs}
        for d, p in seen["per_unit"].items():
            traces[d] = RunTrace(value, step(value, p, addrs), counted, 0, 0)
            src.held[d] = 64 * MiB  # the first run on a device leaves its workspaces there
        return RunSet(value, counted, False, traces), ""

    monkeypatch.setattr(runner, "_torch", lambda: Torch())
    monkeypatch.setattr(torchcheck, "_torch", lambda: Torch())
    monkeypatch.setattr(runner, "_one_run", one_run)
    monkeypatch.setattr(multigpu, "gc", type("NoGc", (), {"collect": staticmethod(lambda: 0)}))
    return seen


def test_a_body_on_two_gpus_gets_no_checks_past_its_answer_and_is_told_why(
        two_gpus: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two allocators held to a cap at once crashed a real two-GPU step (CUDA's "unspecified launch failure"): a
    body that allocates on both devices is never run under a cap, and the report says why; the same body on one
    device is run past its answer, with only that device's allocator held."""
    held: list[dict[int, int]] = []
    real = FakeSource.capped

    def capped(self: Any, caps: dict[int, int]) -> Any:
        held.append(dict(caps))
        return real(self, caps)

    def saturating(value: int, per_unit: int, addrs: Any, fixed: int = 0) -> list[dict[str, Any]]:
        """An input kept to the end, and a workspace that stops growing at 64 units: the model keeps it growing."""
        return trace(addrs, value * per_unit, min(value, 64) * 8 * per_unit)

    class Roomy(TwoGpus):
        def device_free(self, device: int) -> tuple[int, int]:
            return 1 * GiB, 80 * GiB

        def context_devices(self) -> list[int]:
            return [0, 1]  # both have a context from the start: a body on one of them uses only that one

    monkeypatch.setattr(FakeSource, "capped", capped)
    monkeypatch.setattr(sys.modules[__name__], "step", saturating)
    two_gpus["per_unit"] = {1: 1 * MiB}
    one = runner.fit(lambda b: None, [8, 16, 32], source=Roomy({}), name="batch", margin_bytes=0)  # type: ignore[arg-type]
    assert held and all(list(c) == [1] for c in held), ("checks past the answer on cuda:1 alone", held, one.notes)
    assert not any(nearby.SEVERAL_GPUS in n for n in one.notes), one.notes
    held.clear()
    two_gpus["per_unit"] = {0: 1 * MiB, 1: 1 * MiB}
    res = runner.fit(lambda b: None, [8, 16, 32], source=Roomy({}), name="batch", margin_bytes=0)  # type: ignore[arg-type]
    assert res.largest_value is not None and res.device == "cuda:0, cuda:1", str(res)
    assert held == [], "no allocator was held to a cap"
    assert f"no values past the model's answer were run: {nearby.SEVERAL_GPUS}" in res.notes, res.notes
    # Asked about a smaller GPU, the check at the answer would hold both allocators to its room: not run either.
    there = runner.fit(lambda b: None, [8, 16, 32], source=Roomy({}), name="batch", margin_bytes=0,  # type: ignore[arg-type]
                       on="512MiB", own_used=lambda d: 0)
    assert held == [] and f"the answer was not run: {nearby.SEVERAL_GPUS}" in there.notes, (held, there.notes)


def test_the_runner_measures_a_device_its_runs_were_the_first_to_use_once_its_context_exists(
        two_gpus: dict[str, Any]) -> None:
    src = TwoGpus({})
    res = runner.fit(lambda b: None, [8, 16, 32], source=src, name="batch", margin_bytes=0)  # type: ignore[arg-type]
    assert two_gpus["calls"][0] == [0] and all(c == [0, 1] for c in two_gpus["calls"][1:])
    assert res.device == "cuda:1" and res.room is not None
    # what the allocator holds there after the warm-up was free before it, and is the runs' own
    assert (res.room.free_bytes, res.room.reserved_bytes, res.room.allocated_bytes) == (GiB + 64 * MiB, 0, 0)
    assert res.largest_value is not None and res.largest_value * 4 * MiB <= GiB + 64 * MiB
    assert [f.gpu for f in res.devices] == ["stand-in 1"]


def test_a_body_that_allocates_on_no_cuda_device_is_refused_in_one_line(two_gpus: dict[str, Any]) -> None:
    two_gpus["per_unit"] = {}
    with pytest.raises(FitRefused, match="allocated no CUDA memory in its first run") as e:
        runner.fit(lambda b: torch.ones(b), [8, 16], source=TwoGpus({}), name="batch")  # type: ignore[arg-type]
    assert "\n" not in str(e.value) and e.value.ran and len(two_gpus["calls"]) == 1, "no run after the first"


def test_on_another_gpu_the_same_runs_are_replayed_against_its_memory_less_this_contexts(
        two_gpus: dict[str, Any]) -> None:
    two_gpus["per_unit"] = {0: 2 * MiB}

    def src() -> TwoGpus:
        s = TwoGpus({0: 0})
        s.device_free = lambda device: (70 * GiB, 80 * GiB)  # type: ignore[method-assign]
        return s

    here = runner.fit(lambda b: None, [8, 16, 32], source=src(), name="batch", margin_bytes=0)  # type: ignore[arg-type]
    t4 = runner.fit(lambda b: None, [8, 16, 32], source=src(), name="batch", margin_bytes=0, on="T4",  # type: ignore[arg-type]
                    own_used=lambda d: 600 * MiB)
    assert here.largest_value is not None and t4.largest_value is not None
    assert t4.room is not None and t4.room.total_bytes == T4_MIB * MiB
    assert t4.room.capacity_bytes == (T4_MIB - 600) * MiB, "the T4's memory less a context as large as this one's"
    assert t4.largest_value * 4 * MiB <= (T4_MIB - 600) * MiB < (t4.largest_value + 2) * 4 * MiB + 20 * MiB
    assert here.largest_value > 4 * t4.largest_value
    assert t4.device == "T4 (16 GB), as measured on cuda:0"
    said = " ".join(t4.notes)
    assert "'total capacity of 14.56 GiB' on a Colab T4" in said and "600 MiB: this process's memory on cuda:0" in said
    assert "no bf16" in said and "kernels and workspaces are chosen by its size and architecture" in said
    # without NVML's per-process figure, all of the device's memory that is not free nor the allocator's
    guess = runner.fit(lambda b: None, [8, 16, 32], source=src(), name="batch", margin_bytes=0, on="24GiB")  # type: ignore[arg-type]
    assert guess.room is not None and guess.room.capacity_bytes == 24 * GiB - 10 * GiB
    assert "other processes' too if any" in " ".join(guess.notes) and "no bf16" not in " ".join(guess.notes)


def test_on_the_card_it_was_measured_on_the_room_is_that_cards_own(two_gpus: dict[str, Any]) -> None:
    """A stand-in H100 whose CUDA total is the least reported (81,003 MiB), with a 520 MiB context: a fit asked
    about "H100 80GB" there answers as the fit on the card itself, the same room and the same value."""
    two_gpus["per_unit"] = {0: 256 * MiB}

    def src() -> TwoGpus:
        s = TwoGpus({0: 0})
        s.device_free = lambda device: ((H100_MIB - 520) * MiB, H100_MIB * MiB)  # type: ignore[method-assign]
        return s

    here = runner.fit(lambda b: None, [8, 16, 32], source=src(), name="batch", margin_bytes=0)  # type: ignore[arg-type]
    there = runner.fit(lambda b: None, [8, 16, 32], source=src(), name="batch", margin_bytes=0,  # type: ignore[arg-type]
                       on="H100 80GB", own_used=lambda d: 520 * MiB)
    assert here.room is not None and there.room is not None
    assert there.room.capacity_bytes == here.room.capacity_bytes == (H100_MIB - 520) * MiB
    assert there.largest_value == here.largest_value is not None and there.device.startswith("H100 80GB, as measured")
    # the same with a notebook that holds 2 GiB, and where NVML gives no per-process figure
    room = Room("cuda:0", (H100_MIB - 520 - 2048) * MiB, 2 * GiB, GiB, 0, H100_MIB * MiB)
    for own in (lambda d: 520 * MiB + 2 * GiB, None):
        on, _ = multigpu.on_target({0: room}, parse_on("NVIDIA H100 80GB HBM3"), own, 0)
        assert (on[0].free_bytes, on[0].capacity_bytes) == (room.free_bytes, room.capacity_bytes)


def test_on_a_real_h100_the_table_answers_below_the_card_and_nvidia_smis_total_would_answer_above() -> None:
    """Read on an H100 80GB HBM3 (driver 580.159.04, torch 2.11.0+cu130), 2 GiB held: cudaMemGetInfo said
    82,221,137,920 B free of 85,017,493,504 (81,079 MiB), NVML 610 MiB for this process beyond its allocator's;
    nvidia-smi showed 81,559 MiB and 480 MiB reserved. Filled until out of memory, the process got 80,448 MiB of the
    80,460 free: what cudaMemGetInfo says is free is what a process gets."""
    measured = Room("cuda:0", 82_221_137_920, 2 * GiB, 2 * GiB, 0, 85_017_493_504)

    def own(device: int) -> int:
        return 610 * MiB + 2 * GiB  # NVML's figure for this process: the context and what the allocator holds

    table, _ = multigpu.on_target({0: measured}, parse_on("H100 80GB"), own, 0)
    assert measured.free_bytes - 70 * MiB < table[0].free_bytes <= measured.free_bytes, "67 MiB below, on this driver"
    smi, _ = multigpu.on_target({0: measured}, parse_on("81559MiB"), own, 0)
    assert smi[0].free_bytes > measured.free_bytes + 400 * MiB, "nvidia-smi's total counts the driver's 480 MiB"


# -- --on ------------------------------------------------------------------------------------------------------------
#: Every GPU in the table: what CUDA gives a process there and what nvidia-smi shows, in MiB, typed from
#: docs/research/gpu-memory.md; its label; whether it runs bf16.
TABLE = [("T4", 14904, 15360, "T4 (16 GB)", False), ("V100 16GB", 16130, 16384, "V100 16GB", False),
         ("V100 32GB", 32496, 32768, "V100 32GB", False), ("L4", 22692, 23034, "L4 (24 GB)", True),
         ("A10", 22512, 23028, "A10 (24 GB)", True), ("A10G", 22515, 23028, "A10G (24 GB)", True),
         ("A100 40GB", 40441, 40960, "A100 40GB", True), ("A100 80GB", 81034, 81920, "A100 80GB", True),
         ("H100 80GB", 81003, 81559, "H100 80GB", True), ("H100 NVL", 95226, 95830, "H100 NVL (94 GB)", True),
         ("H200 141GB", 143052, 143771, "H200 141GB", True), ("H200 NVL", 143052, 143771, "H200 NVL (141 GB)", True),
         ("B200", 182625, 183359, "B200 (180 GB)", True), ("L40", 45460, 46068, "L40 (48 GB)", True),
         ("L40S", 45456, 46068, "L40S (48 GB)", True), ("A40", 45416, 46068, "A40 (48 GB)", True),
         ("RTX A6000", 45492, 46068, "RTX A6000 (48 GB)", True),
         ("RTX 6000 Ada", 45491, 46068, "RTX 6000 Ada (48 GB)", True),
         ("RTX 3060 12GB", 11931, 12288, "RTX 3060 12GB", True), ("RTX 3090", 24251, 24576, "RTX 3090 (24 GB)", True),
         ("RTX 4080 16GB", 16049, 16376, "RTX 4080 16GB", True), ("RTX 4090", 24073, 24564, "RTX 4090 (24 GB)", True),
         ("RTX 5090", 32093, 32607, "RTX 5090 (32 GB)", True)]


@pytest.mark.parametrize(("name", "cuda_mib", "smi_mib", "label", "bf16"), TABLE)
def test_each_gpu_is_the_memory_cuda_gives_a_process_there_with_its_source(name: str, cuda_mib: int, smi_mib: int,
                                                                           label: str, bf16: bool) -> None:
    got = parse_on(name)
    assert got.gpu is not None and (got.memory_bytes, got.label, got.gpu.bf16) == (cuda_mib * MiB, label, bf16)
    assert got.gpu.smi_mib == smi_mib and 250 <= smi_mib - cuda_mib <= 900, "nvidia-smi's total less the reserve"
    assert "github.com" in got.gpu.source or "fs id" in got.gpu.source
    assert f"CUDA gives a process {cuda_mib:,} MiB there" in target_notes(got, "cuda:0", 0, "")[0]


def test_the_table_is_these_gpus_and_the_refusal_lists_them_all() -> None:
    assert [g.name for g in GPUS] == [row[0] for row in TABLE]
    assert devices.ACCEPTED.startswith("a memory size (24GiB, 24GB") and devices.ACCEPTED.endswith(", RTX 5090")
    assert all(g.name in devices.ACCEPTED for g in GPUS)


@pytest.mark.parametrize(("spec", "memory", "label"), [
    ("24GiB", 24 * GiB, "24.0 GiB"), ("24 GiB", 24 * GiB, "24.0 GiB"), ("24G", 24 * GiB, "24.0 GiB"),
    ("24GB", 24 * GB, "24 GB"), ("24gb", 24 * GB, "24 GB"), ("1.5TB", 1500 * GB, "1.5 TB"),
    ("40000MiB", 40000 * MiB, None),
    ("L4", L4_MIB * MiB, "L4 (24 GB)"), ('"A100 40GB"', 40441 * MiB, "A100 40GB"),
    ("nvidia l4", L4_MIB * MiB, "L4 (24 GB)"), ("a100-80gb", 81034 * MiB, "A100 80GB"),
    ("GeForce RTX 3060 12GB", 11931 * MiB, "RTX 3060 12GB"), ("rtx3060-12gb", 11931 * MiB, "RTX 3060 12GB"),
    # Other spellings: a bare "H100" is the 80 GB card (the NVL is named so, and is larger: the answer errs low).
    ("H100", H100_MIB * MiB, "H100 80GB"), ("H200", 143052 * MiB, "H200 141GB"), ("A6000", 45492 * MiB, None),
    ("4090", 24073 * MiB, "RTX 4090 (24 GB)"), ("5090", 32093 * MiB, "RTX 5090 (32 GB)"),
    ("RTX 4080", 16049 * MiB, "RTX 4080 16GB"), ("6000 Ada", 45491 * MiB, "RTX 6000 Ada (48 GB)"),
    ("A10", 22512 * MiB, "A10 (24 GB)"), ("a10g", 22515 * MiB, "A10G (24 GB)"), ("l40", 45460 * MiB, None),
    # As nvidia-smi and torch.cuda.get_device_name print them, and as a fit's report names this machine's GPU.
    ("NVIDIA H100 80GB HBM3", H100_MIB * MiB, "H100 80GB"), ("H100 PCIe", H100_MIB * MiB, "H100 80GB"),
    ("NVIDIA H100 NVL", 95226 * MiB, "H100 NVL (94 GB)"), ("NVIDIA H200", 143052 * MiB, "H200 141GB"),
    ("NVIDIA H200 NVL", 143052 * MiB, "H200 NVL (141 GB)"), ("NVIDIA B200", 182625 * MiB, "B200 (180 GB)"),
    ("NVIDIA A100-SXM4-40GB", 40441 * MiB, "A100 40GB"), ("NVIDIA A100-PCIE-80GB", 81034 * MiB, "A100 80GB"),
    ("NVIDIA A100 80GB PCIe", 81034 * MiB, "A100 80GB"), ("Tesla T4", T4_MIB * MiB, "T4 (16 GB)"),
    ("Tesla V100-SXM2-32GB", 32496 * MiB, "V100 32GB"), ("Tesla V100-PCIE-16GB", 16130 * MiB, "V100 16GB"),
    ("NVIDIA A10G", 22515 * MiB, "A10G (24 GB)"), ("NVIDIA A10", 22512 * MiB, "A10 (24 GB)"),
    ("NVIDIA L40", 45460 * MiB, "L40 (48 GB)"), ("NVIDIA L40S", 45456 * MiB, "L40S (48 GB)"),
    ("NVIDIA A40", 45416 * MiB, "A40 (48 GB)"), ("NVIDIA RTX A6000", 45492 * MiB, "RTX A6000 (48 GB)"),
    ("NVIDIA RTX 6000 Ada Generation", 45491 * MiB, "RTX 6000 Ada (48 GB)"),
    ("NVIDIA GeForce RTX 4090", 24073 * MiB, "RTX 4090 (24 GB)"),
    ("NVIDIA GeForce RTX 5090", 32093 * MiB, "RTX 5090 (32 GB)"),
])
def test_on_takes_a_size_or_a_gpus_name(spec: str, memory: int, label: str | None) -> None:
    got = parse_on(spec)
    assert got.memory_bytes == memory
    if label is not None:
        assert got.label == label


@pytest.mark.parametrize(("spec", "said"), [
    ("A100", "'A100' is ambiguous: A100 40GB (40,960 MiB) or A100 80GB (81,920 MiB); name one, or give a size"),
    ("nvidia a100", "'nvidia a100' is ambiguous: A100 40GB (40,960 MiB) or A100 80GB (81,920 MiB); name one, "
                    "or give a size"),
    ("V100", "'V100' is ambiguous: V100 16GB (16,384 MiB) or V100 32GB (32,768 MiB); name one, or give a size"),
    ("Tesla V100-SXM2", "'Tesla V100-SXM2' is ambiguous: V100 16GB (16,384 MiB) or V100 32GB (32,768 MiB); name "
                        "one, or give a size"),
    ("NVIDIA GeForce RTX 3060", "'NVIDIA GeForce RTX 3060' is ambiguous: RTX 3060 12GB (12,288 MiB) or the 8 GB "
                                "RTX 3060 (not in the table); name one, or give a size"),
    ("3060", "'3060' is ambiguous: RTX 3060 12GB (12,288 MiB) or the 8 GB RTX 3060 (not in the table); name one, "
             "or give a size"),
])
def test_a_bare_name_sold_in_several_sizes_is_refused_with_its_sizes(spec: str, said: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_on(spec)
    assert str(e.value) == said


def test_the_magic_and_nbmem_fit_refuse_an_ambiguous_name_in_one_line_and_run_nothing(ip: Any) -> None:
    body = "x = torch.ones(batch)\nran = True"
    with pytest.raises(UsageError) as e:
        ip.run_cell_magic("cudamem", "--fit batch=8,16 --on A100", body)
    assert str(e.value) == ("%%cudamem --on 'A100' is ambiguous: A100 40GB (40,960 MiB) or A100 80GB (81,920 MiB); "
                            "name one, or give a size. Nothing was run.")
    with pytest.raises(ValueError) as f:
        nbmem.fit(body, "batch", [8, 16], on="V100")
    assert str(f.value) == ("nbmem.fit(on=...) 'V100' is ambiguous: V100 16GB (16,384 MiB) or V100 32GB (32,768 MiB); "
                            "name one, or give a size. Nothing was run.")
    assert "ran" not in ip.user_ns


@pytest.mark.parametrize("spec", ["banana", "24", "GiB", "24 parsecs", "A100 41GB", "", "0.1GB", "-24GB", "SXM4",
                                  "PCIe", "GH200", "NVIDIA GH200 480GB", "RTX 6000", "RTX 3060 Ti", "H20"])
def test_a_bad_on_is_refused_in_one_line_that_lists_the_accepted_forms(spec: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_on(spec)
    said = str(e.value)
    assert "\n" not in said and "24GiB, 24GB" in said and "T4" in said and "A100 40GB" in said and "A10G" in said


@pytest.mark.parametrize("spec", ["24GiB", "24 GiB", "24G", "24GB", "24gb", "1.5TB", "1T", "40000MiB", "40000MB",
                                  "2048M"])
def test_on_and_host_limit_read_a_size_as_the_same_bytes(spec: str) -> None:
    # Two options, one reader: a size typed for --on means the same memory typed for --host-limit.
    assert parse_on(spec).memory_bytes == parse_host_limit(spec)
