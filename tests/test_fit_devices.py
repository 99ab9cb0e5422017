"""A fit on every GPU its body uses, and for a GPU it is asked about (``--on``): the per-device analysis over
synthetic traces, the runner's devices with stand-ins for CUDA, and ``--on``'s sizes, names and table. The
runs on two real GPUs are in tests/gpu/test_fit_multi_gpu.py."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from nbmem.fitting.analysis import devices
from nbmem.fitting.analysis.allocator import SegmentState
from nbmem.fitting.analysis.devices import GB, GPUS, GiB, parse_on
from nbmem.fitting.analysis.hostroom import parse_host_limit
from nbmem.fitting.analysis.model import Room, RunTrace
from nbmem.fitting.runs import multigpu, runner, torchcheck
from nbmem.fitting.runs.multigpu import NOTHING_ON_CUDA, RunSet, analyse_devices
from nbmem.fitting.runs.state import FitRefused
from tests.test_fit_remedies import FakeSource, FakeTorch

MiB = 1 << 20


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
    assert all(r.capacity_bytes == 24 * GB - 700 * MiB for r in there.values())
    res = analyse_devices(runs_on({0: 2 * MiB, 1: 4 * MiB}), there, {}, name="batch", notes=notes)
    assert res.limited_by is not None and "limited by cuda:1 as L4 (24 GB): batch=" in str(res)
    assert any("(NVIDIA L4 Tensor Core GPU datasheet)" in n and "700 MiB" in n for n in res.notes)


def test_on_a_gpu_smaller_than_what_the_notebook_holds_nothing_fits_and_it_says_why() -> None:
    held = {0: Room("cuda:0", 10 * GiB, 20 * GiB, 20 * GiB, 0, 80 * GiB)}
    there, notes = multigpu.on_target(held, parse_on("T4"), lambda d: 20 * GiB + 500 * MiB, 0)
    assert there[0].capacity_bytes == 16 * GB - 500 * MiB, "its memory less the context, however much is held"
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
    assert t4.room is not None and t4.room.total_bytes == 16 * GB
    assert t4.room.capacity_bytes == 16 * GB - 600 * MiB, "the T4's memory less a context as large as this one's"
    assert t4.largest_value * 4 * MiB <= 16 * GB - 600 * MiB < (t4.largest_value + 2) * 4 * MiB + 20 * MiB
    assert here.largest_value > 4 * t4.largest_value
    assert t4.device == "T4 (16 GB), as measured on cuda:0"
    said = " ".join(t4.notes)
    assert "NVIDIA T4 Tensor Core GPU datasheet" in said and "600 MiB: this process's memory on cuda:0" in said
    assert "no bf16" in said and "kernels and workspaces are chosen by its size and architecture" in said
    # without NVML's per-process figure, all of the device's memory that is not free nor the allocator's
    guess = runner.fit(lambda b: None, [8, 16, 32], source=src(), name="batch", margin_bytes=0, on="24GiB")  # type: ignore[arg-type]
    assert guess.room is not None and guess.room.capacity_bytes == 24 * GiB - 10 * GiB
    assert "other processes' too if any" in " ".join(guess.notes) and "no bf16" not in " ".join(guess.notes)


# -- --on ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("spec", "memory", "label"), [
    ("24GiB", 24 * GiB, "24.0 GiB"), ("24 GiB", 24 * GiB, "24.0 GiB"), ("24G", 24 * GiB, "24.0 GiB"),
    ("24GB", 24 * GB, "24 GB"), ("24gb", 24 * GB, "24 GB"), ("1.5TB", 1500 * GB, "1.5 TB"),
    ("40000MiB", 40000 * MiB, None),
    ("L4", 24 * GB, "L4 (24 GB)"), ('"A100 40GB"', 40 * GB, "A100 40GB"),
    ("nvidia l4", 24 * GB, "L4 (24 GB)"), ("A100 40GB", 40 * GB, "A100 40GB"),
    ("a100-80gb", 80 * GB, "A100 80GB"), ("A100", 40 * GB, "A100 40GB"), ("T4", 16 * GB, "T4 (16 GB)"),
    ("RTX 4090", 24 * GB, "RTX 4090 (24 GB)"), ("GeForce RTX 3060 12GB", 12 * GB, "RTX 3060 12GB"),
    ("H200", 141 * GB, "H200 141GB"), ("V100 32GB", 32 * GB, "V100 32GB"), ("L40S", 48 * GB, "L40S (48 GB)"),
    # As nvidia-smi and torch.cuda.get_device_name print them, and as a fit's report names this machine's GPU.
    ("NVIDIA H100 80GB HBM3", 80 * GB, "H100 80GB"), ("NVIDIA A100-SXM4-40GB", 40 * GB, "A100 40GB"),
    ("NVIDIA A100-PCIE-80GB", 80 * GB, "A100 80GB"), ("Tesla T4", 16 * GB, "T4 (16 GB)"),
    ("Tesla V100-SXM2-32GB", 32 * GB, "V100 32GB"), ("H100 PCIe", 80 * GB, "H100 80GB"),
    ("NVIDIA GeForce RTX 4090", 24 * GB, "RTX 4090 (24 GB)"),
])
def test_on_takes_a_size_or_a_gpus_name(spec: str, memory: int, label: str | None) -> None:
    got = parse_on(spec)
    assert got.memory_bytes == memory
    if label is not None:
        assert got.label == label


@pytest.mark.parametrize("spec", ["banana", "24", "GiB", "24 parsecs", "A100 41GB", "", "0.1GB", "-24GB",
                                  "H100 NVL", "NVIDIA H200 NVL", "A10G", "SXM4", "PCIe"])
def test_a_bad_on_is_refused_in_one_line_that_lists_the_accepted_forms(spec: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_on(spec)
    said = str(e.value)
    assert "\n" not in said and "24GiB, 24GB" in said and "T4" in said and "A100 40GB" in said


@pytest.mark.parametrize("spec", ["24GiB", "24 GiB", "24G", "24GB", "24gb", "1.5TB", "1T", "40000MiB", "40000MB",
                                  "2048M"])
def test_on_and_host_limit_read_a_size_as_the_same_bytes(spec: str) -> None:
    # Two options, one reader: a size typed for --on means the same memory typed for --host-limit.
    assert parse_on(spec).memory_bytes == parse_host_limit(spec)


def test_every_gpu_in_the_table_has_its_memory_and_its_source_and_is_found_by_its_own_name() -> None:
    names = {"T4", "L4", "A10", "A100 40GB", "A100 80GB", "H100 80GB", "H200 141GB", "RTX 3090", "RTX 4090",
             "RTX 4080 16GB", "RTX 3060 12GB", "V100 16GB", "V100 32GB", "RTX A6000", "L40S"}
    assert {g.name for g in GPUS} == names
    for g in GPUS:
        assert g.memory_bytes >= 12 * GB and ("datasheet" in g.source or "specifications" in g.source)
        assert parse_on(g.name).gpu == g
    assert not parse_on("T4").gpu.bf16 and not parse_on("V100").gpu.bf16 and parse_on("L4").gpu.bf16  # type: ignore[union-attr]
    assert devices.ACCEPTED.startswith("a memory size")
