"""A fit on every GPU its body uses: which devices those are, each one's room, the answer over all of them, and
the cache and cuBLAS's workspaces given back on each.

A device is measured only where this process has a CUDA context on it already (a device the user has not
used gets none from nbmem: cudaMemGetInfo there would make one); a device the runs are the first to use has a
context once they ran, and its room is read then. ``analyse_devices`` is the analysis of ``prediction.analyse``
per device, over the traces each run recorded there, and the answer is the largest value that fits on all.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nbmem.clean.release import TorchRelease
from nbmem.fitting.analysis.allocator import SegmentState, segments_from_snapshot
from nbmem.fitting.analysis.devices import DeviceFit, Target, target_notes, target_room
from nbmem.fitting.analysis.model import Checked, Room, RunTrace, margin_bytes_for
from nbmem.fitting.analysis.prediction import FitResult, analyse
from nbmem.fitting.analysis.timeline import Built
from nbmem.fitting.runs.state import FitRefused
from nbmem.formatting import fmt_bytes
from nbmem.measure.sources import TorchSource


@dataclass(frozen=True)
class RunSet:
    """One run of the body: the allocator's trace on each device it had a context on or allocated on."""

    value: int
    counted: bool
    oom: bool
    traces: Mapping[int, RunTrace]

    @classmethod
    def single(cls, trace: RunTrace, device: int = 0) -> RunSet:
        return cls(trace.value, trace.counted, trace.oom, {device: trace})

NOTHING_ON_CUDA = ("the body allocated no CUDA memory in its first run: a fit predicts GPU memory, so the cell must "
                   "put its tensors on a GPU (e.g. device='cuda')")


def synchronize(t: Any, devices: Sequence[int]) -> None:
    for d in devices:
        t.cuda.synchronize(d)


def used_devices(runs: Sequence[RunSet]) -> list[int]:
    """The devices any run allocated on."""
    return sorted({d for r in runs for d, tr in r.traces.items()
                   if any(e.get("action") == "alloc" for e in tr.entries)})


def allocated_reserved(src: TorchSource, device: int) -> tuple[int, int]:
    r = src.read(device)
    if r is None:
        raise FitRefused("fitting needs the allocator's counters, and they could not be read")
    return r.allocated_bytes, r.reserved_bytes


def free_cached(src: TorchRelease, devices: Sequence[int], *, unless_back_to: int | None = None) -> None:
    """What the last run left in the cache, given back on each device (the user asked for the fit: this is its
    cleanup). ``unless_back_to``: what was allocated on them together when the run started; where no more is
    allocated now, no garbage holds the run's tensors and the collection is left out (a tenth of a second with
    a notebook's imports, for each of a fit's 6 to 30 runs)."""
    if unless_back_to is None or sum(allocated_reserved(src, d)[0] for d in devices) > unless_back_to:
        gc.collect()
    for d in devices:  # each device's streams waited for, so the blocks they still use come back too
        src.empty_cache(d)


def read_room(src: TorchSource, device: int, margin_bytes: int | None, outside: int | None = None, *,
              new: bool = False) -> tuple[Room, tuple[SegmentState, ...], int]:
    """A device's room, read with its cache given back: the room, its segments, and what is allocated there.
    ``new``: the runs were the first to use the device, so it had nothing before them; what its allocator holds
    now (the runs' leftovers, such as workspaces) was free then and is in the runs' traces. ``outside``: managed
    memory the state holds, taken from the free memory whether or not it is on the GPU now (paged memory moves
    there when a step touches it, so counting it where it already is errs low, never high)."""
    before, reserved = allocated_reserved(src, device)
    got = src.device_free(device)
    if got is None:
        raise FitRefused("fitting needs the device's free memory, and CUDA could not say (cudaMemGetInfo)")
    free, total = got
    fraction, whole = src.memory_fraction(device), src.allocator_total(device)
    if fraction is not None and fraction < 1.0 and whole:  # the user's own cap on this process's allocator
        free = min(free, int(fraction * whole) - reserved)
    free -= max(outside or 0, 0)
    segments: tuple[SegmentState, ...] = ()
    if new:
        free, reserved, before = free + reserved, 0, 0
    else:
        segments = tuple(segments_from_snapshot(src.segments() or [], device))
    margin = margin_bytes_for(free, reserved, before) if margin_bytes is None else int(margin_bytes)
    return Room(f"cuda:{device}", free, reserved, before, margin, total), segments, before


def room_now(src: TorchSource, device: int, room: Room) -> tuple[Room, int]:
    """The room again after runs, with their cache given back, and how much of it went outside PyTorch's
    allocator meanwhile: free plus reserved only falls when something else took device memory, such as the code
    of kernels CUDA loads the first time they run (a bf16 step loads others than an fp32 one) or another
    process. The room never grows back: the fit answers for the smaller one."""
    got = src.device_free(device)
    if got is None:
        return room, 0
    lost = room.free_bytes + room.reserved_bytes - (got[0] + allocated_reserved(src, device)[1])
    return (replace(room, free_bytes=room.free_bytes - lost), lost) if lost > 0 else (room, 0)


def on_target(rooms: Mapping[int, Room], target: Target, own_used: Callable[[int], int | None] | None,
              margin_bytes: int | None, outside: Mapping[int, int] | None = None
              ) -> tuple[dict[int, Room], tuple[str, ...]]:
    """Each measured device's room as it would be on ``target``, and what that assumes. The CUDA context is
    this process's memory on the device beyond its allocator's (NVML's per-process figure); where NVML cannot
    say, all the memory neither free nor this allocator's (other processes' too: it errs low). ``outside``:
    managed memory the state holds, taken there too (where it is on this GPU now, NVML's figure has it already,
    and it is counted twice: low, never high)."""
    out: dict[int, Room] = {}
    notes: tuple[str, ...] = ()
    for d, room in sorted(rooms.items()):
        used = own_used(d) if own_used is not None else None
        if used is not None and used >= room.reserved_bytes:
            context, how = used - room.reserved_bytes, f"this process's memory on {room.device} beyond its allocator's"
        else:
            context = room.others_bytes or 0
            how = (f"all of {room.device}'s memory that is neither free nor this process's allocator's, other "
                   "processes' too if any (NVML gave no per-process figure)")
        out[d] = target_room(room, target, context + (outside or {}).get(d, 0), margin_bytes)
        notes = notes or target_notes(target, room.device, context, how)
        if out[d].free_bytes < 0:
            notes += (f"what this notebook's allocator holds on {room.device} now ({fmt_bytes(room.reserved_bytes)}) "
                      f"and a CUDA context are more than the {target.label} has: nothing fits there as the notebook "
                      "stands",)
    return out, notes


def gpu_name(t: Any, device: int) -> str:
    try:
        return str(t.cuda.get_device_name(device))
    except Exception:
        return ""


def analyse_devices(runs: Sequence[RunSet], rooms: Mapping[int, Room], segments: Mapping[int, Sequence[SegmentState]],
                    *, gpus: Mapping[int, str] | None = None, memos: dict[int, Built] | None = None,
                    checked: Mapping[int, Checked] | None = None, **kw: Any) -> FitResult:
    """``analyse`` on each device the runs allocated on, each against its own room; the answer is the smallest
    device's answer (a device whose memory does not grow with the value limits nothing), and names it. ``memos``:
    each device's runs as the fit's last analysis left them (``timeline.Built``), kept there for the next.
    ``checked``: a value run past the model's answer, each device's peaks in it (``nearby.beyond``)."""
    gpus = gpus or {}
    devs = [d for d in used_devices(runs) if d in rooms]
    name = kw.get("name", "value")
    if not devs:
        values = tuple(sorted({r.value for r in runs if r.counted and not r.oom}))
        return FitResult(name=name, device="no CUDA device", values=values, points=(), room=None,
                         reason=NOTHING_ON_CUDA, notes=tuple(kw.get("notes", ())))
    memos = {} if memos is None else memos
    results = {d: analyse([r.traces[d] for r in runs if d in r.traces], rooms[d], segments=segments.get(d, ()),
                          memo=memos.setdefault(d, Built()), checked=(checked or {}).get(d), **kw) for d in devs}
    if len(devs) == 1:
        (d, res), = results.items()
        return replace(res, devices=(DeviceFit(rooms[d].device, gpus.get(d, ""), res.largest_value, res.reason,
                                               rooms[d], res.peak_reserved_at_largest_bytes, limits=True),))
    blocked = [d for d in devs if results[d].largest_value is None and not _any_value(results[d])]
    sized = [d for d in devs if results[d].largest_value is not None]
    limit = (blocked[0] if blocked else min(sized, key=lambda d: results[d].largest_value or 0) if sized else
             devs[0])
    devices = tuple(DeviceFit(rooms[d].device, gpus.get(d, ""), results[d].largest_value, results[d].reason, rooms[d],
                              results[d].peak_reserved_at_largest_bytes, limits=d == limit and (bool(blocked) or
                                                                                                bool(sized)))
                    for d in devs)
    return replace(results[limit], device=", ".join(rooms[d].device for d in devs), devices=devices)


def _any_value(res: FitResult) -> bool:
    """The result says any value fits (its memory does not grow with it), rather than none or no model."""
    return res.reason.startswith("its memory does not grow")


def left_allocated(before: Mapping[int, int], after: Mapping[int, int], workspaces: bool) -> list[str]:
    """A line for each device where the fit leaves more or less allocated than there was before it."""
    out = []
    several = len(before) > 1
    for d in sorted(before):
        on = f" on cuda:{d}" if several else ""
        if after[d] > before[d]:
            out.append(f"after the fit {fmt_bytes(after[d] - before[d], signed=True)} is allocated{on} that was not "
                       "before it (something the body keeps that is neither in the namespace nor in the state "
                       "restored)")
        elif after[d] < before[d]:
            out.append(f"after the fit {fmt_bytes(before[d] - after[d])} less is allocated{on} than before it: "
                       "garbage that only a collection frees (reference cycles) was freed by the fit's gc.collect()"
                       + (", or cuBLAS's workspaces (above)" if workspaces else ""))
    return out


# -- cuBLAS's workspaces ------------------------------------------------------------------------------------
def give_back_workspaces(src: TorchRelease, before: Mapping[int, int]) -> tuple[dict[int, int], str | None]:
    """cuBLAS keeps a workspace per handle, stream and device from its first matrix product on: where runs made
    them (more is allocated on a device than ``before``), they go again, on every device at once (torch can only
    clear them all), and the user's own are made again on each device that had them. The bytes allocated after,
    per device, and a line for the report where that could not be done exactly. A workspace left in place also
    pins the segment it was made in: a cache emptied around it keeps that segment, and a later run's large
    blocks cannot use its free part (716 MiB of a 748 MiB segment, seen)."""
    devices = sorted(before)
    after = {d: allocated_reserved(src, d)[0] for d in devices}
    if all(after[d] <= before[d] for d in devices):
        return after, None
    if not src.clear_cublas_workspaces():
        return after, None
    # The garbage went before ``after`` was read, so what is missing now (never more than the clear freed, as
    # more than ``before`` was held) is the user's workspaces.
    free_cached(src, devices)
    after = {d: allocated_reserved(src, d)[0] for d in devices}
    if any(after[d] > before[d] for d in devices):  # something else is kept: the caller says so
        return after, "cuBLAS's workspaces were given back as well; torch makes them at the next matrix product"
    missing = [d for d in devices if after[d] < before[d]]
    if not missing:
        return after, None
    try:
        after = _remake_workspaces(src, devices, before, missing)
    except Exception as e:
        src.clear_cublas_workspaces()
        free_cached(src, devices)
        after = {d: allocated_reserved(src, d)[0] for d in devices}
        return after, (f"cuBLAS's workspaces were given back, and making yours again failed ({type(e).__name__}: "
                       f"{(str(e).splitlines() or [''])[0][:100]}); torch makes them at the next matrix product")
    if after != dict(before):
        return after, ("cuBLAS's workspaces were given back and yours could not be made again exactly; torch "
                       "makes them at the next matrix product")
    return after, None


def _remake_workspaces(src: TorchRelease, devices: Sequence[int], before: Mapping[int, int],
                       missing: Sequence[int]) -> dict[int, int]:
    """Clearing cuBLAS's workspaces took the ones the user had before the fit too, on every device: make again,
    on each device that lost some, the fewest of them that bring its memory back to where it was (torch keeps no
    list of them). A wrong guess is undone by clearing them all, so the devices already settled are made again
    after it. The bytes allocated after, per device."""
    kinds = src.CUBLAS_WORKSPACES
    settled: dict[int, tuple[str, ...]] = {}

    def undo() -> None:
        src.clear_cublas_workspaces()
        free_cached(src, devices)
        for d, chosen in settled.items():
            for kind in chosen:
                src.make_cublas_workspace(kind, d)

    for d in missing:
        for chosen in (c for n in range(1, len(kinds) + 1) for c in itertools.combinations(kinds, n)):
            for kind in chosen:
                src.make_cublas_workspace(kind, d)
            if allocated_reserved(src, d)[0] == before[d]:
                settled[d] = chosen
                break
            undo()
    return {d: allocated_reserved(src, d)[0] for d in devices}


__all__ = ["NOTHING_ON_CUDA", "RunSet", "allocated_reserved", "analyse_devices", "free_cached",
           "give_back_workspaces", "gpu_name", "left_allocated", "on_target", "read_room", "synchronize",
           "used_devices"]
