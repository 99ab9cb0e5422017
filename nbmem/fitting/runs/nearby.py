"""The fit's runs near its answer: more runs while the prediction lies far beyond the values run (``refine``),
then two steps in a row at the answer itself (``confirm``), then a few values past it, each three steps in a row
from the user's state with the allocator held to the room (``beyond``; a body on one GPU only).

The allocator model replays the runs' allocations, scaled to the value, through the caching allocator's rules;
where single blocks are a large part of the room, where in the segments they land (cudaMalloc's addresses,
the segments the previous step left split) decides whether the second of two steps finds a free stretch for
its largest block, and neither placement the model tries need be the driver's. Two steps at the answer, the
second with the first one's results still bound, as when the user runs the cell again, is the case a user
meets; where it runs out of memory, the answer is capped with the margin a prediction keeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from nbmem.fitting.analysis.model import Checked, Room, Run
from nbmem.fitting.analysis.prediction import FitResult, proportional_bound
from nbmem.fitting.analysis.search import halfway_within
from nbmem.fitting.runs.hostwatch import HostWatch
from nbmem.fitting.runs.multigpu import RunSet, used_devices
from nbmem.fitting.runs.progress import FitProgress


class BodyRuns(Protocol):
    """What of the runner's ``FitBody`` these runs use (the runner imports this module, not the other way)."""

    name: str
    ran: int
    notes: list[str]
    durations: dict[int, float]
    progress: FitProgress | None
    host: HostWatch | None

    def once(self, value: int, counted: bool) -> tuple[RunSet, str]: ...

    def steps_at(self, value: int, steps: int, caps: Mapping[int, int] | None = None) -> tuple[RunSet, str] | None: ...

    rooms: dict[int, Room]
    checked: dict[int, Checked]
    as_the_user: Callable[[], None] | None

    @property
    def target(self) -> object: ...  # another GPU the answer is for (``fit``'s ``on``), or None

    def check_rooms(self) -> dict[int, Room]: ...

    def check_caps(self, devices: Sequence[int]) -> dict[int, int] | None: ...

    def analyse(self, runs: list[RunSet], cell_files: frozenset[str], max_value: int | None = None) -> FitResult: ...

#: A prediction this far beyond the largest value run is checked by another run, halfway to it ...
REFINE_FACTOR = 1.5
#: ... at most this many times ...
REFINE_RUNS = 3
#: ... and never a run that would take longer than this (its time scaled from the largest run's).
REFINE_SECONDS = 30.0
#: Steps in a row at the answer: the second meets what the first left bound, as a cell run again does.
CONFIRM_STEPS = 2
#: At most this many such checks (one more at the lower answer a failed one leaves).
CONFIRM_TRIES = 2
#: Past a checked answer (``beyond``), a value is run only where it adds at least this much to the largest that
#: ran: nearer, whether a value runs depends on where its blocks fall as much as on its size (a Llama on the H200,
#: checked from the fit's warmed state under the room less the margin, ran 3 steps at 524, 1.9 % past its answer,
#: where the real boundary's bisection had 524 fail; from the user's state 524 failed under the cap). A wider step
#: (3 %, once) left a CNN 5-7 % short, its cap's limit 1.8 % past the model's answer ...
BEYOND_STEP = 0.01
#: ... at most this many times, each halving the stretch still unknown ...
BEYOND_TRIES = 3
#: ... each this many steps in a row: no model stands behind these values, so they run the three steps the model
#: replays (two ran on the H200 where three failed: a Llama's 524 against its 520).
BEYOND_STEPS = 3
#: Why a body on several GPUs gets no check under a cap (past its answer, or at it for another GPU): with two
#: allocators held at once, a GPT-2 that accelerate's ``device_map="auto"`` split over two H200s crashed its step
#: ("CUDA error: unspecified launch failure", the process's CUDA unusable after) in each of 5 runs; without the
#: caps it ran.
SEVERAL_GPUS = ("the body uses more than one GPU, and holding two allocators to a cap at once crashed such a step "
                "on CUDA (a model split by accelerate)")
#: The runs a fit's plan counts for them (``progress.planned_runs``): each step is a run of the body.
CONFIRM_RUNS = CONFIRM_STEPS * CONFIRM_TRIES + BEYOND_STEPS * BEYOND_TRIES


def refine(body: BodyRuns, runs: list[RunSet], cell_files: frozenset[str]) -> FitResult | None:
    """More counted runs far from the small values while the prediction lies far beyond them: kernels change
    their buffers with size (chunked products, buffers sized by the data), and a point near the answer shows
    it. Each run is halfway from the largest value run to the prediction, so it is predicted to fit with room
    to spare; an out-of-memory there is caught, and the prediction stays below it. The analysis (largest value
    only) of the runs as they stand at the end, so the caller need not make it again; None after an
    out-of-memory run."""
    name, notes, durations = body.name, body.notes, body.durations
    made = executed = 0
    first: int | None = None
    res: FitResult | None = body.analyse(runs, cell_files)
    ok = [r.value for r in runs if r.counted and not r.oom]
    if (body.progress is not None and res is not None and res.largest_value is not None and ok
            and res.largest_value >= REFINE_FACTOR * max(ok)):
        # the runs this makes at most (as the loop below chooses them), each within its time budget
        top, took, v = max(ok), durations.get(max(ok), 0.0), max(ok)
        plan: list[int] = []
        while len(plan) < REFINE_RUNS and res.largest_value >= REFINE_FACTOR * v:
            v = halfway_within(v, res.largest_value, took * v / top, REFINE_SECONDS)
            if v <= top or (plan and v <= plan[-1]):
                break
            plan.append(v)
        body.progress.ahead(plan, "the runs near the answer")
    while res is not None and executed < REFINE_RUNS:
        ok = [r.value for r in runs if r.counted and not r.oom]
        top = max(ok)
        if res.largest_value is None or res.largest_value < REFINE_FACTOR * top:
            break
        first = res.largest_value if first is None else first
        value = halfway_within(top, res.largest_value, durations.get(top, 0.0), REFINE_SECONDS)
        if value <= top:
            break
        trace, oom = body.once(value, True)
        runs.append(trace)
        made += 1
        executed += 1
        if oom:
            notes.append(f"the run at {name}={value:,} ran out of memory ({oom}): the prediction stays below it")
            res = None
            break
        checked = body.analyse(runs, cell_files)
        if checked.method != "timeline":
            # Its allocations do not line up with the others' (another algorithm at this size): the model of the
            # runs that do line up stands (``res``, of the runs before it), rather than a peak scaled from one run.
            runs.pop()
            made -= 1
            notes.append(f"a run at {name}={value:,} allocated differently from the others (another algorithm at "
                         "that size) and was left out of the model")
            break
        res = checked
    if body.progress is not None:
        body.progress.ahead([], "")  # said of these runs only
    if made:
        at = ", ".join(f"{r.value:,}" for r in runs[-made:])
        notes.append(f"the small runs predicted {first:,}: {made} more run{'s' if made > 1 else ''} ({name}={at}) "
                     "checked the growth nearer the answer")
    return res


def confirm(body: BodyRuns, runs: list[RunSet], res: FitResult | None, cell_files: frozenset[str],
            max_value: int | None = None, capped: bool = False) -> FitResult | None:
    """The answer (``res``, of ``runs``; None: analyse them) run: ``CONFIRM_STEPS`` steps in a row at it, traced,
    not counted. Where they run out of memory, their run joins ``runs`` as a failed one, which caps the answer
    with the prediction's margin below what the model gives that value, and the lower answer is run in turn
    (``CONFIRM_TRIES`` in all). Not where a run has already failed, where the answer is no larger than a value
    run, or where the steps would take longer than ``REFINE_SECONDS`` (the note says so). ``capped``: the answer is
    another GPU's, and the steps run with each allocator held to that GPU's room (``check_rooms``), or not at all
    where this one cannot stand for it. The analysis of ``runs`` as they stand at the end (largest value only)."""
    if any(r.oom for r in runs):
        return res
    name, notes = body.name, body.notes
    for _ in range(CONFIRM_TRIES):
        res = res if res is not None else body.analyse(runs, cell_files)
        ok = [r.value for r in runs if r.counted and not r.oom]
        if res.largest_value is None or not ok:
            return res
        value, top = res.largest_value if max_value is None else min(res.largest_value, max_value), max(ok)
        if value <= top or (body.host is not None and body.host.over(value, name)):
            return res
        took = CONFIRM_STEPS * body.durations.get(top, 0.0) * value / top
        if took > REFINE_SECONDS:
            notes.append(f"the answer was not run: {CONFIRM_STEPS} steps at {name}={value:,} would take about "
                         f"{took:.0f} s")
            return res
        used = used_devices(runs) if capped else []
        if len(used) > 1:
            notes.append(f"the answer was not run: {SEVERAL_GPUS}")
            return res
        if body.progress is not None:
            body.progress.ahead([value] * CONFIRM_STEPS, "the check at the answer")
        caps = body.check_caps(used) if capped else None
        ran = None if capped and caps is None else body.steps_at(value, CONFIRM_STEPS, caps)
        if body.progress is not None:
            body.progress.ahead([], "")
        if ran is None:
            notes.append("the answer was not run: this GPU cannot be held to the other GPU's room (it has less free "
                         "memory, or this torch cannot cap its allocator)")
            return res
        got, oom = ran
        if not oom:
            held = " with the allocator held to that GPU's room" if capped else ""
            notes.append(f"checked: {CONFIRM_STEPS} steps in a row at {name}={value:,}, the answer, ran{held} (the "
                         "second with the first one's results still bound, as when the cell runs again)")
            if (max_value is None or value < max_value) and not any(r.oom for r in runs):
                beyond(body, runs, value, got, max_value)  # not past a check that failed: the model is short there
            return body.analyse(runs, cell_files) if body.checked else res
        runs.append(got)
        notes.append(f"{CONFIRM_STEPS} steps in a row at {name}={value:,}, the model's answer, ran out of memory "
                     f"({oom}): the answer keeps the margin below what the model gives that value")
        res = None
    res = body.analyse(runs, cell_files)
    values = [r.value for r in runs if not r.oom]
    if res.largest_value is not None and res.largest_value > max(values, default=0):
        # Every check failed: near its limit the body takes more than its runs showed, and this answer is unrun.
        notes.append(f"the answer ({name}={res.largest_value:,}) was not run: the {CONFIRM_TRIES} checks above it ran "
                     "out of memory, so near its limit this cell takes more than the fit's runs showed; run it once "
                     "at the answer before relying on it")
    return res


def beyond(body: BodyRuns, runs: list[RunSet], answer: int, check: RunSet, max_value: int | None) -> None:
    """Past the checked ``answer``, where the model may keep more than the body takes near its limit (a buffer that
    stops growing, a workspace a library gives up for another algorithm when it does not fit): values between the
    answer and where the allocated memory of the runs alone would fill a device's room, halving the stretch, each
    run ``BEYOND_STEPS`` steps in a row from the user's state (``as_the_user``) with every allocator held to its
    room less the margin, the room the model's answer is for. (From the fit's warmed state a Llama ran 524 under
    that cap where its real boundary was 519; from the user's state 524 failed, and on two H200s no row went above
    its boundary. A second margin cost a CNN 2-6 % and kept nothing below that one did not.) The largest that ran
    goes to ``body.checked``, where the analyses take it as the answer; a fit that is short of time, or a value that
    the host has no room for, is not run."""
    if body.as_the_user is None:  # the state cannot be put back (no copy: ``restore=False``, a remedy's runs)
        return
    ok = [r for r in runs if r.counted and not r.oom]
    top = max(ok, key=lambda r: r.value, default=None)
    bound = None if top is None or top.value >= answer else _allocated_bound(body.check_rooms(), top, check, answer)
    if top is None or bound is None:
        return
    lo, hi = answer, bound + 1 if max_value is None else min(bound, max_value) + 1  # hi: the least not known to run
    failed: list[int] = []
    used = used_devices([*runs, check])
    restore_s = 0.0  # what putting the user's state back took (a 7B's trainable state: seconds), once it is known
    for _ in range(BEYOND_TRIES):
        value = (lo + hi) // 2
        took = BEYOND_STEPS * body.durations.get(top.value, 0.0) * value / top.value + restore_s
        if (value < lo * (1 + BEYOND_STEP) or took > REFINE_SECONDS
                or (body.host is not None and body.host.over(value, body.name))):
            break
        if len(used) > 1:
            body.notes.append(f"no values past the model's answer were run: {SEVERAL_GPUS}")
            return
        # No model stands behind these values: they start where the user's next cell would, the optimizer's state
        # not yet made where it was not, no workspace of cuBLAS's that the fit's runs made.
        caps = body.check_caps(used)
        if caps is None:
            return
        started = time.perf_counter()
        body.as_the_user()
        restore_s = time.perf_counter() - started
        if body.progress is not None:
            body.progress.ahead([value] * BEYOND_STEPS, "a check past the model's answer")
        ran = body.steps_at(value, BEYOND_STEPS, caps)
        if body.progress is not None:
            body.progress.ahead([], "")
        if ran is None:  # torch cannot hold the allocator to the room (before 2.9)
            return
        got, oom = ran
        if oom:
            hi = value
            failed.append(value)
            continue
        lo = value
        body.checked = {d: Checked(value, BEYOND_STEPS, p.peak_allocated_bytes, p.peak_reserved_bytes, caps[d])
                        for d, p in ((d, Run.sizes(tr)) for d, tr in got.traces.items()) if d in caps}
    if failed:
        at = ", ".join(f"{body.name}={v:,}" for v in failed)
        body.notes.append(f"past the model's answer, {BEYOND_STEPS} steps in a row at {at} ran out of memory with "
                          "the allocator held to the room less the margin")


def _allocated_bound(rooms: dict[int, Room], top: RunSet, check: RunSet, answer: int) -> int | None:
    """The value at which the peak allocated memory would fill the first device's room, going on from the largest
    counted run (``top``) to the check at the answer as it grew between them; None where no device's grows or a
    peak is unknown. Allocated is never more than reserved: the bound is one no value above can fit under."""
    bound = None
    for d, tr in check.traces.items():
        if d not in rooms or d not in top.traces:
            continue
        p_top, p_answer = Run.sizes(top.traces[d]).peak_allocated_bytes, Run.sizes(tr).peak_allocated_bytes
        if p_top is None or p_answer is None:
            return None
        slope = (p_answer - p_top) / (answer - top.value)
        if slope > 0:
            at = answer + max(0, int((rooms[d].capacity_bytes - p_answer) / slope))
            bound = at if bound is None else min(bound, at)
    return bound


def predicted_not_to_fit(body: BodyRuns, runs: list[RunSet], value: int, cell_files: frozenset[str]) -> bool:
    """Whether the runs so far say ``value`` would not fit on this machine's devices (never run it then): from
    two values, the analysis searched no further than ``value``; from one, its peak in proportion."""
    done = [r for r in runs if r.counted and not r.oom]
    if len({r.value for r in done}) >= 2:
        res = body.analyse(runs, cell_files, max_value=value)
        return res.largest_value is not None and value > res.largest_value
    last = next((r for r in reversed(runs) if not r.oom), None)
    if last is None:
        return False
    for d in used_devices([last]):  # a device the body does not allocate on limits nothing, however full it is
        bound = proportional_bound(last.traces[d], value)
        if d in body.rooms and bound is not None and bound > body.rooms[d].capacity_bytes:
            return True
    return False


def near_answer(body: BodyRuns, runs: list[RunSet], stopped: bool, cell_files: frozenset[str], max_value: int | None,
                here: bool) -> FitResult | None:
    """The runs after the fit's schedule: ``refine`` unless the schedule ``stopped`` early (a value skipped, or an
    out-of-memory), then ``confirm`` where the answer is for this machine's GPUs (``here``), or for another GPU
    that this one can stand for (the body's ``target``: the checks held to its room). The analysis of ``runs`` as
    they stand at the end (largest value only), or None where none was made."""
    res = None if stopped else refine(body, runs, cell_files)
    if here or body.target is not None:
        return confirm(body, runs, res, cell_files, max_value, capped=not here)
    return res


__all__ = ["BEYOND_STEP", "BEYOND_STEPS", "BEYOND_TRIES", "CONFIRM_RUNS", "REFINE_FACTOR", "REFINE_RUNS",
           "REFINE_SECONDS", "SEVERAL_GPUS", "beyond", "confirm", "near_answer", "predicted_not_to_fit", "refine"]
