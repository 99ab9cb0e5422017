"""Running a fit: the body once per value under the allocator's trace, then ``prediction.analyse`` over the traces.

The engine-level runner; it knows nothing of IPython. The caller hands it ``run(value)``, which runs the
body once with the variable bound to ``value``, and ``clean()``, which takes back what the body left in the
namespace; ``clean`` is called after each run's trace is read, so what a run leaves behind shows in its
trace as left allocated (and is modelled as still there while the next run runs, as it is when the user
runs the cell again). The allocator's events are recorded only through ``TorchSource.start_trace`` and
``finish_trace``. The trace covers every GPU: each device the runs allocate on has its own room and its own
analysis (``multigpu``), and nothing here reads a device this process has no CUDA context on.

Besides a cleanup, a fit is the one place nbmem changes the allocator's cache: between runs it frees what each run
left (``torch.cuda.empty_cache()``, through ``clean.release``, and the pinned host cache: ``hostwatch``), because
the user asked for the fit.
It never runs a value predicted not to fit (on the GPU or on the host), catches an out-of-memory in a run
(frees what the run allocated, reports it, and stops), and with
``restore`` (the default) copies the training state the body reaches (``state.snapshot_state``: modules,
optimizers, LR schedulers, gradient scalers, random generators) before the first run and puts it back, bit
for bit, after the last, also after a failure, so the training steps the fit ran leave no trace.
"""

from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from nbmem.clean.release import TorchRelease
from nbmem.fitting.analysis.allocator import SegmentState
from nbmem.fitting.analysis.devices import Target, parse_on
from nbmem.fitting.analysis.hostroom import with_host
from nbmem.fitting.analysis.model import Checked, Room, RunTrace
from nbmem.fitting.analysis.modelled import Remedy
from nbmem.fitting.analysis.prediction import FitResult
from nbmem.fitting.analysis.timeline import Built
from nbmem.fitting.runs import remedies
from nbmem.fitting.runs.hostwatch import HostWatch, room_for
from nbmem.fitting.runs.multigpu import (
    NOTHING_ON_CUDA,
    RunSet,
    allocated_reserved,
    analyse_devices,
    free_cached,
    give_back_workspaces,
    gpu_name,
    left_allocated,
    on_target,
    read_room,
    room_now,
    synchronize,
    used_devices,
)
from nbmem.fitting.runs.nearby import CONFIRM_RUNS, REFINE_RUNS, near_answer, predicted_not_to_fit
from nbmem.fitting.runs.progress import FitProgress, Show, interrupts_held, planned_runs
from nbmem.fitting.runs.state import FitRefused, StateCopy, restore_state, snapshot_state
from nbmem.fitting.runs.torchcheck import _torch, expandable_on, graphs_compiled, is_out_of_memory, refusal
from nbmem.formatting import fmt_bytes, fmt_seconds

#: How many allocator events one run may record; a run that fills it cannot be lined up with the others.
DEFAULT_MAX_ENTRIES = 1_000_000


# -- the fit --------------------------------------------------------------------------------------------------
def fit(run: Callable[[int], object], values: Sequence[int], *, source: TorchRelease | None = None,
        name: str = "value", clean: Callable[[], object] | None = None,
        warmup: bool = True, modules: Iterable[Any] = (), optimizers: Iterable[Any] = (), others: Iterable[Any] = (),
        iterators: Sequence[str] = (), restore: bool = True, margin_bytes: int | None = None, stacks: bool = False,
        cell_files: frozenset[str] = frozenset(), sources: Mapping[int, str] | None = None,
        max_value: int | None = None, want: int | None = None, max_entries: int = DEFAULT_MAX_ENTRIES,
        on: Target | str | None = None, own_used: Callable[[int], int | None] | None = None,
        show: Show | None = None, host_limit: int | None = None, outside: Mapping[int, int] | None = None) -> FitResult:
    """Run ``run(value)`` at each value (ascending) under the allocator's trace and predict the largest that fits.

    Every device the runs allocate on is measured, each against its own room, and the answer is the largest
    value that fits on all of them (``devices``; ``limited_by`` names the device that limits it).
    ``warmup`` runs the smallest value once first, not counted, so the one-time allocations (optimizer
    state, workspaces) are made before the counted runs. ``modules``, ``optimizers`` and ``others`` (LR
    schedulers, gradient scalers) are the state the body reaches, copied and restored afterwards with the
    random generators when ``restore``; ``iterators`` name what it may advance that cannot be put back.
    ``stacks`` records Python stacks, so the result names the lines that grow (``cell_files`` and ``sources``
    name the cell's own). ``margin_bytes`` defaults to ``analysis.model.margin_bytes_for``. ``want``: a value asked
    about; where it does not fit, the result's ``remedies`` say what would let it run: gradient accumulation
    from the fit itself, activation checkpointing and bf16 autocast from the fit's runs again under each
    (``remedies.candidates``: applied for those runs only, and undone), ``expandable_segments`` from the model.
    ``on``: another GPU (``devices.parse_on``): the same runs, the answer for that GPU's memory in place of each
    device's (``own_used(device)``: this process's memory there as NVML lists it, for the CUDA context's size).
    Host memory is a limit too where the runs keep memory there (``hostroom``: pinned or pageable), against
    ``host_limit`` (bytes this process may use) where given, else the container's limit or the machine's memory;
    no value predicted not to fit on the host is run either. ``outside``: bytes per GPU the state holds outside
    PyTorch's allocator (a paged optimizer's CUDA managed memory), counted as taken: it can move onto the GPU.
    A body that raises anything but CUDA's out-of-memory error stops the fit (cleaned up and
    restored) and the error propagates, told what was put back; one that allocates on no CUDA device is refused.
    """
    started = time.perf_counter()
    src = source or TorchRelease()
    target = None if on is None else parse_on(on)
    why = refusal()
    if why:
        raise FitRefused(why)
    vals = sorted({int(v) for v in values})
    if len(vals) < 2 or vals[0] < 1:
        raise ValueError(f"a fit needs two or more distinct positive values, got {list(values)!r}")
    t = _torch()
    if not t.cuda.is_initialized():
        t.cuda.init()  # the user asked for a fit, which runs CUDA code anyway (init makes no device's context)
    unsupported = src.trace_unsupported()
    if unsupported:
        raise FitRefused(f"fitting needs the allocator's trace, and {unsupported}")
    modules, optimizers, others = list(modules), list(optimizers), list(others)
    candidates, left_out = remedies.candidates(t, modules, others) if want is not None else ([], [])
    progress = FitProgress(show, name, *planned_runs(len(vals) + warmup, REFINE_RUNS + CONFIRM_RUNS, len(candidates)),
                           compiled_model=any(remedies.is_compiled(m) for m in modules),
                           graphs=lambda: graphs_compiled())  # looked up when called: the tests stand in for it
    saved = snapshot_state(modules, optimizers, others, iterators=iterators) if restore else None
    modules = optimizers = others = ()
    measured: list[Remedy] = []
    remedy_notes: list[str] = []
    others_ran: list[int] = []  # the runs under remedies
    runs: list[RunSet] = []
    skipped: list[int] = []
    notes: list[str] = []
    body = FitBody(progress.watch(run), src, src.context_devices(), stacks, max_entries, clean, name, notes,
                 margin_bytes=margin_bytes, host=HostWatch(*room_for(host_limit)), progress=progress,
                 outside=dict(outside or {}), target=None if target is None else (target, own_used))
    failed: BaseException | None = None
    before: dict[int, int] = {}
    reset_said: list[str] = []  # what giving back the workspaces before a remedy's runs said
    try:
        before = body.measure()
        body.as_the_user = None if saved is None else functools.partial(_as_the_user_has_it, body, saved, before,
                                                                         reset_said)
        refined = near_answer(body, runs, _runs(body, vals, warmup, runs, skipped, cell_files), cell_files,
                              max_value, target is None)
        if want is not None and (candidates or left_out):
            # with the cell's lines as the sites, as refine's analyses and the final one have them, and what ran
            # past the model's answer
            plain = (body.host_bound(refined, target) if refined is not None and max_value is None and target is None
                     else body.analyse(runs, cell_files, max_value))
            ran_ok = [r.value for r in runs if r.counted and not r.oom]
            if plain.largest_value is not None and want > plain.largest_value and ran_ok:
                remedy_notes += left_out
                measured = _measure_remedies(body, candidates, vals, warmup, plain.largest_value, max(ran_ok),
                                             max_value, remedy_notes, others_ran, (target, own_used),
                                             functools.partial(_as_the_user_has_it, body, saved, before, reset_said))
    except BaseException as e:
        runs.clear()  # the error's frames keep this one: let go of the traces (and the copy, below) now
        body.memos.clear()
        failed = e
        raise
    finally:
        candidates = []  # they hold the modules: no reference is kept past the fit
        steps = body.ran + sum(others_ran)
        ended_well = failed is None
        stopped: KeyboardInterrupt | None = None
        with interrupts_held() as held:  # Ctrl-C now waits until everything is back, cuBLAS's workspaces too
            restored = restore_state(saved) if saved is not None else None
            lines = ((tuple(saved.restored), tuple(dict.fromkeys(saved.not_restored))) if saved is not None
                     else ((), ()))
            if saved is not None:
                saved.close()  # the copies' host memory unlocked now, not when the copy is collected
            saved = body.as_the_user = None  # an error kept by the notebook keeps this frame, not the copy
            devs = body.every_device()
            free_cached(src, devs)
            if body.host is not None:
                body.host.close()
            if ended_well:
                before, after, workspaces = body.workspaces_back(before)
                if held.pressed:  # the fit stops, as asked, now that everything is back, and says so
                    failed = stopped = KeyboardInterrupt()
            if failed is not None:
                _say_what_was_put_back(failed, src, devs, before, lines, steps)
            progress.done(failed)  # the line goes, or stays saying that an interrupted fit put everything back
        failed = None
        if ended_well and held.pressed:  # a press while the fit already stops with an error adds nothing
            raise stopped or KeyboardInterrupt()
    workspaces = workspaces or (reset_said[-1] if reset_said else None)  # the user's, lost before a remedy's runs
    if workspaces:
        notes.append(workspaces)
    notes += left_allocated(before, after, bool(workspaces))
    if progress.compile_s >= 1:
        notes.append(f"the runs during which torch.compile made a graph took {fmt_seconds(progress.compile_s)} of "
                     f"the fit's {fmt_seconds(progress.clock() - progress.started)} (a graph for each new range of "
                     f"{name}; they stay compiled for your own runs)")
    if not restore and steps:
        notes.append(f"not restored: the fit ran the body {steps} times, and whatever it trains was trained")
    if any(body.lost.values()):
        notes.append("the runs' kernels took " + ", ".join(f"{fmt_bytes(n)} of cuda:{d}" for d, n in body.lost.items()
                                                           if n) + " outside PyTorch's allocator (CUDA loads a "
                     "kernel's code the first time it runs): the answer is for the room left after them")
    rooms, said = (dict(body.rooms), ()) if target is None else on_target(body.rooms, target, own_used, margin_bytes,
                                                                           body.outside)
    notes += said
    result = analyse_devices(runs, rooms, body.segments, gpus={d: gpu_name(t, d) for d in rooms}, memos=body.memos,
                             checked=body.checked, name=name, cell_files=cell_files, sources=sources,
                             max_value=max_value, notes=notes, skipped=skipped, want=want, expandable=expandable_on(),
                             measured=measured, remedy_notes=remedy_notes)
    result = body.host_bound(result, target)
    if target is not None:
        here = ", ".join(body.rooms[d].device for d in used_devices(runs) if d in body.rooms)
        result = replace(result, device=f"{target.label}, as measured on {here}")
    return replace(result, restored_bytes=restored, restored=lines[0], not_restored=lines[1], steps_run=steps,
                   duration_s=time.perf_counter() - started)


def _runs(body: FitBody, vals: Sequence[int], warmup: bool, runs: list[RunSet], skipped: list[int],
          cell_files: frozenset[str]) -> bool:
    """The fit's runs (a warm-up, then each value ascending, none predicted not to fit) into ``runs``; whether
    they stopped early (a value skipped, or an out-of-memory)."""
    name, notes, max_entries = body.name, body.notes, body.max_entries
    schedule = ([(vals[0], False)] if warmup else []) + [(v, True) for v in vals]
    graphs = graphs_compiled()
    for k, (v, counted) in enumerate(schedule):
        if (k == 1 and warmup and graphs_compiled() != graphs and not (body.host and body.host.over(vals[1], name))
                and not predicted_not_to_fit(body, runs, vals[1], cell_files)):
            # torch.compile made a graph for the warm-up's shape; at a second shape it makes one for every shape
            # (dynamic): one more warm-up there, so that every counted run runs that one graph.
            body.compiled.append(vals[1])
            again, oom = body.once(vals[1], False)
            if oom:  # that value fails: it caps the answer as a counted run's failure would
                runs.append(again)
                skipped += list(vals[1:])
                notes.append(f"the second warm-up, at {name}={vals[1]:,}, ran out of memory ({oom}); what it "
                             "allocated was freed")
                return True
        on_host = body.host.over(v, name) if counted and body.host is not None else ""
        if on_host or (counted and predicted_not_to_fit(body, runs, v, cell_files)):
            skipped += [w for w, c in schedule[k:] if c]
            notes.append(f"{name}={v:,} was not run: {on_host or 'the runs before it predict it does not fit'}")
            return True
        trace, oom = body.once(v, counted)
        runs.append(trace)
        if k == 0 and not oom and not used_devices(runs):  # nothing to fit: the other runs are not made
            raise FitRefused(NOTHING_ON_CUDA, ran=True)
        if any(len(tr.entries) >= max_entries for tr in trace.traces.values()):
            notes.append(f"the run at {name}={v:,} filled the trace ({max_entries:,} events): what it recorded "
                         "first is lost, so it may not line up with the others")
        if oom:
            notes.append(f"what the run at {name}={v:,} allocated before it ran out of memory was freed ({oom})")
            return True
    if body.compiled:
        at = ", ".join(f"{w:,}" for w in dict.fromkeys(body.compiled))
        notes.append(f"torch.compile compiled a graph in the runs at {name}={at}: each of those ran again, the "
                     "compiling run not counted, so that the runs measure the compiled steps")
    return False


def _as_the_user_has_it(body: FitBody, saved: StateCopy | None, before: Mapping[int, int], said: list[str]) -> None:
    """Each remedy's runs start where the user's next cell would: their training state (``saved``), and none of
    cuBLAS's workspaces the fit's runs made (a first step makes them mid-step, which the model's first run then
    has, as a plain fit's does). What giving them back said goes into ``said``."""
    with interrupts_held() as held:  # a Ctrl-C between giving the user's workspaces back and making them again
        if saved is not None:
            restore_state(saved)
        free_cached(body.src, body.every_device())
        line = body.workspaces_back(before)[2]
        if line:
            said.append(line)
    if held.pressed:
        raise KeyboardInterrupt()


def _measure_remedies(body: FitBody, candidates: Sequence[remedies.Candidate], vals: Sequence[int], warmup: bool,
                      plain_largest: int, timed: int, max_value: int | None, notes: list[str], ran: list[int],
                      on: tuple[Target | None, Callable[[int], int | None] | None],
                      reset: Callable[[], None]) -> list[Remedy]:
    """Each remedy's largest value: the fit's runs again with it applied (no stacks), the same analysis over
    them (for ``on``'s GPU where one is asked about), and one timed step at the same value with it and without
    it for its cost. A remedy that fails the body (an error other than out-of-memory) or allows no more than the
    plain fit is left out with a line that says so; the modules are as they were after each
    (``Candidate.applied``), the training state is the fit's to put back. ``reset`` runs before each remedy's
    runs, so that they start from the state the user's next cell would."""
    name = body.name
    plain_s = _timed_step(body, timed) if candidates else None
    out: list[Remedy] = []
    for c in candidates:
        sub = FitBody(c.wrap(body.run), body.src, list(body.devs), False, body.max_entries, body.clean, name, [],
                    margin_bytes=body.margin_bytes, host=body.host.fresh() if body.host is not None else None)
        runs: list[RunSet] = []
        started = time.perf_counter()
        reset()  # not the body's: its errors, and a Ctrl-C, stop the fit
        try:
            with c.applied():
                sub.measure()
                refined = near_answer(sub, runs, _runs(sub, vals, warmup, runs, [], frozenset()), frozenset(),
                                      max_value, on[0] is None)
                res = (refined if refined is not None and max_value is None and on[0] is None else
                       analyse_devices(runs, sub.answer_rooms(*on), sub.segments, name=name, max_value=max_value,
                                       largest_only=True, memos=sub.memos))
                res = sub.host_bound(res, on[0])
                notes += [f"{c.name}: {n}" for n in sub.notes if "steps in a row" in n]  # what running its answer said
                step_s = _timed_step(sub, timed) if res.largest_value is not None else None
        except Exception as e:
            why = (str(e).strip().splitlines() or [""])[0][:120]
            _let_go_of_frames(e)
            notes.append(f"{c.name} left out: the body failed under it ({type(e).__name__}: {why})")
            continue
        finally:
            ran.append(sub.ran)
            runs_at = ", ".join(f"{r.value:,}" for r in runs if r.counted)
            runs.clear()
        largest = res.largest_value
        if largest is None or largest < remedies.MIN_GAIN * plain_largest:
            got = res.reason if largest is None else f"the largest {name} under it is {largest:,}"
            notes.append(f"{c.name} left out: measured, {got}, no more than {plain_largest:,} without it")
            continue
        ratio = None if step_s is None or plain_s is None or plain_s <= 0 else step_s / plain_s
        cost = "" if ratio is None else f"; one step at {name}={timed:,} took {ratio:.2f}× the plain step's time"
        took = time.perf_counter() - started
        out.append(Remedy(c.name, largest, c.setting,
                          f"measured: the fit's runs again with it ({name}={runs_at}, {took:.1f} s), the same "
                          f"model{cost}", time_per_sample_ratio=ratio))
    return out


def _timed_step(body: FitBody, value: int, repeats: int = 2) -> float | None:
    """The shortest of ``repeats`` untraced runs' times (synchronized), for a remedy's cost; None where one ran out
    of memory. The runs are counted in the body's steps and cleaned up as any other."""
    t = _torch()
    times = []
    for _ in range(repeats):
        body.ran += 1
        start = body.allocated()
        try:
            synchronize(t, body.devs)
            started = time.perf_counter()
            body.run(value)
            synchronize(t, body.devs)
            times.append(time.perf_counter() - started)
        except BaseException as e:
            if not is_out_of_memory(e):
                raise
            _let_go_of_frames(e)
            return None
        finally:
            if body.clean is not None:
                body.clean()
            free_cached(body.src, body.devs, unless_back_to=start)
    return min(times)


def _say_what_was_put_back(e: BaseException, src: TorchRelease, devices: Sequence[int], before: Mapping[int, int],
                           lines: tuple[tuple[str, ...], tuple[str, ...]], steps: int) -> None:
    """A failed fit's error, told what the fit put back and whether memory is where it was before the fit."""
    if not isinstance(e, (Exception, KeyboardInterrupt)) or not hasattr(e, "add_note"):
        return
    try:
        moved = {d: allocated_reserved(src, d)[0] - before.get(d, 0) for d in devices}
    except Exception:
        moved = None
    several = len(devices) > 1
    memory = ("" if not before or moved is None else
              "; memory allocated is back where it was" if not any(moved.values()) else
              "".join(f"; {fmt_bytes(n, signed=True)} stays allocated{f' on cuda:{d}' if several else ''} that was "
                      "not before the fit" for d, n in moved.items() if n))
    restored = "training state put back" if lines[0] else "nothing restored"
    kept = f"; not restored: {'; '.join(lines[1])}" if lines[1] else ""
    e.add_note(f"nbmem fit: stopped after {steps} run{'s' if steps != 1 else ''} of the body; {restored}{kept}"
               f"{memory}")


@dataclass
class FitBody:
    """The body as a fit runs it, the instruments it runs under (which can fall back during the fit), and each
    device's room: those this process had a context on before the runs, and those the runs were the first to use."""

    run: Callable[[int], object]
    src: TorchRelease
    devs: list[int]  # the devices with a CUDA context: synchronized, emptied and measured
    stacks: bool
    max_entries: int
    clean: Callable[[], object] | None
    name: str
    notes: list[str]
    durations: dict[int, float] = field(default_factory=dict)
    ran: int = 0  # times the body was started
    margin_bytes: int | None = None
    rooms: dict[int, Room] = field(default_factory=dict)
    segments: dict[int, tuple[SegmentState, ...]] = field(default_factory=dict)
    progress: FitProgress | None = None  # the fit's line, told what the runs near the answer will take
    compiled: list[int] = field(default_factory=list)  # values whose first run compiled a graph (run again)
    lost: dict[int, int] = field(default_factory=dict)  # device -> what went outside the allocator in the runs
    host: HostWatch | None = None  # each run's host bytes, and the room there
    outside: dict[int, int] = field(default_factory=dict)  # device -> managed memory counted as taken (``fit``)
    target: tuple[Target, Callable[[int], int | None] | None] | None = None  # another GPU's answer (``fit``'s ``on``)
    memos: dict[int, Built] = field(default_factory=dict)  # each device's runs as the last analysis left them
    checked: dict[int, Checked] = field(default_factory=dict)  # a value run past the model's answer (``beyond``)
    as_the_user: Callable[[], None] | None = None  # the training state put back, as before a check past the model

    def measure(self) -> dict[int, int]:
        """Each device's room, read after the cache is given back; what is allocated on each before the runs."""
        free_cached(self.src, self.devs)
        before = {}
        for d in self.devs:
            self.rooms[d], self.segments[d], before[d] = read_room(self.src, d, self.margin_bytes, self.outside.get(d))
        return before

    def every_device(self) -> list[int]:
        """The devices with a context now: the ones measured, and any a run was the first to use."""
        return sorted(set(self.devs) | set(self.src.context_devices()))

    def workspaces_back(self, before: Mapping[int, int]) -> tuple[dict[int, int], dict[int, int], str | None]:
        """cuBLAS's workspaces the runs made given back on every device with a context (``give_back_workspaces``)
        against ``before``, where a device the runs were first to use had nothing: that mapping, the bytes
        allocated after, and a line for the report where it could not be done exactly."""
        every = {d: before.get(d, 0) for d in self.every_device()}
        after, said = give_back_workspaces(self.src, every)
        return every, after, said

    def allocated(self) -> int:
        return sum(allocated_reserved(self.src, d)[0] for d in self.devs)

    def answer_rooms(self, target: Target | None, own_used: Callable[[int], int | None] | None) -> dict[int, Room]:
        """The rooms the answer is for: each device's own, or ``target``'s in place of each."""
        return dict(self.rooms) if target is None else on_target(self.rooms, target, own_used, self.margin_bytes,
                                                                 self.outside)[0]

    def analyse(self, runs: Sequence[RunSet], cell_files: frozenset[str], max_value: int | None = None) -> FitResult:
        """The largest value only (up to ``max_value``), against the devices the answer is for: what the runs ask
        between them."""
        rooms = self.rooms if self.target is None else self.answer_rooms(*self.target)
        res = analyse_devices(runs, rooms, self.segments, name=self.name, cell_files=cell_files, largest_only=True,
                              max_value=max_value, memos=self.memos, checked=self.checked)
        return self.host_bound(res, None if self.target is None else self.target[0])

    def host_bound(self, res: FitResult, target: Target | None = None) -> FitResult:
        """``res`` bound by host memory too, where the runs keep memory there (not another GPU's: another host's)."""
        return res if self.host is None or target is not None else with_host(res, self.host.fit(), self.name)

    def steps_at(self, value: int, steps: int, caps: Mapping[int, int] | None = None) -> tuple[RunSet, str] | None:
        """``steps`` runs of the body at ``value`` under one trace, the namespace put back only after the last (the
        second meets what the first left bound, as a cell run again does); not a point of the host model. ``caps``:
        each allocator held to so many bytes meanwhile (``check_caps``); None (nothing run) where torch cannot."""
        if caps is None:
            return self._steps(value, steps)
        with self.src.capped(caps) as held:
            return self._steps(value, steps) if held else None

    def check_rooms(self) -> dict[int, Room]:
        """The rooms a check holds each allocator to: this GPU's, or where the answer is for another, that one's."""
        return self.rooms if self.target is None else self.answer_rooms(*self.target)

    def check_caps(self, devices: Sequence[int]) -> dict[int, int] | None:
        """The room (``check_rooms``) less the margin of each of ``devices`` (those the runs use: no other allocator
        is held); None where another GPU's is larger than this one's, or none of them has a room."""
        caps = {d: room.capacity_bytes for d, room in self.check_rooms().items() if d in devices}
        return None if not caps or any(c > self.rooms[d].capacity_bytes for d, c in caps.items()) else caps

    def _steps(self, value: int, steps: int) -> tuple[RunSet, str]:
        one = self.run  # the body, run ``steps`` times in place of one run
        def repeated(v: int) -> None:
            for _ in range(steps):
                one(v)

        self.run = repeated
        try:
            return self.once(value, False)
        finally:
            self.run = one
            self.ran += steps - 1  # ``once`` counts one start of the body
            self._not_a_host_point()

    def _not_a_host_point(self) -> None:
        """The last run's host bytes leave the host model: they are not one step's at its value."""
        if self.host is not None and self.host.uses:
            self.host.uses.pop()

    def once(self, value: int, counted: bool) -> tuple[RunSet, str]:
        """One run, timed; afterwards, whatever happened, the namespace put back and the cache given back.

        A run whose error was lost on the way (CPython's ``SystemError``: a function "returned NULL without
        setting an exception") while Python stacks were recorded runs again without them, and so does the rest
        of the fit: the stacks are taken in whichever thread allocates, the autograd engine's too, while an
        error from a hook there (checkpointing's recomputation) is still on its way to the caller.
        """
        try:
            return self._again_if_compiled(value, counted)
        except SystemError as e:
            if not self.stacks:
                raise
            why = (str(e).splitlines() or [""])[0][:160]
            _let_go_of_frames(e)
            del e
        self.stacks = False
        self.notes.append(f"the run at {self.name}={value:,} lost its error under the trace's Python stacks ({why}): "
                          "the fit went on without stacks, so it cannot name the lines that grow")
        return self._again_if_compiled(value, counted)

    def _again_if_compiled(self, value: int, counted: bool) -> tuple[RunSet, str]:
        """A counted run during which torch.compile compiled (a new shape) runs again at the same value: the
        compile's own allocations (autotuning, code generation) happen once, and its graph is what later steps run."""
        graphs = graphs_compiled()
        got = self._met(self._timed(value, counted))
        if counted and not got[1] and graphs_compiled() != graphs:
            self.compiled.append(value)
            self._not_a_host_point()  # the compiler's own host memory (code generation) is not the step's
            got = self._met(self._timed(value, counted))
        return got

    def _met(self, got: tuple[RunSet, str]) -> tuple[RunSet, str]:
        """A device the run allocated on for the first time in this process: its room, read now that its
        context exists (the cache given back)."""
        for d in sorted(set(got[0].traces) - set(self.rooms)):
            if d not in self.devs:
                self.devs.append(d)
            free_cached(self.src, [d])
            self.rooms[d], self.segments[d], _ = read_room(self.src, d, self.margin_bytes, new=True)
        return got

    def _timed(self, value: int, counted: bool) -> tuple[RunSet, str]:
        started = time.perf_counter()
        self.ran += 1
        start = self.allocated()
        freed_older = True  # until the run's trace says otherwise
        oom = "an error"  # until the run returns
        if self.host is not None:
            self.host.before()
        try:
            trace, oom = _one_run(self.run, value, counted, self.src, self.devs, self.stacks, self.max_entries)
            freed_older = any(_frees_older_blocks(tr.entries) for tr in trace.traces.values())
            return trace, oom
        finally:
            with interrupts_held() as held:  # a Ctrl-C (the first, or a second one) waits until the run is undone
                if self.host is not None:
                    self.host.after(value, counted, bool(oom))
                self.durations[value] = time.perf_counter() - started
                if self.clean is not None:
                    self.clean()
                # A run that freed blocks older than itself can hide garbage of its own behind them: collect then.
                free_cached(self.src, self.devs, unless_back_to=None if freed_older else start)
                for d, room in list(self.rooms.items()):  # what the kernels took outside the allocator: no room
                    self.rooms[d], lost = room_now(self.src, d, room)
                    self.lost[d] = self.lost.get(d, 0) + lost
            if held.pressed:
                raise KeyboardInterrupt


def _frees_older_blocks(entries: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a run's trace frees a block the run did not allocate (last step's gradients, a rebound name)."""
    made: set[Any] = set()
    for e in entries:
        action = e.get("action")
        if action == "alloc":
            made.add(e.get("addr"))
        elif action == "free_requested" and e.get("addr") not in made:
            return True
    return False


def _let_go_of_frames(e: BaseException) -> None:
    """Clear the locals of the finished frames an error keeps (and of the errors it chains), so the tensors a
    failed run made are freed now: the error still says what and where, a debugger sees no locals."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen or len(seen) > 32:
            continue
        seen.add(id(x))
        traceback.clear_frames(x.__traceback__)
        stack += [x.__cause__, x.__context__]


def _one_run(run: Callable[[int], object], value: int, counted: bool, src: TorchRelease, devs: Sequence[int],
             stacks: bool, max_entries: int) -> tuple[RunSet, str]:
    """One run under the trace: its events on each device it allocated on or that had a context before it, and
    the first line of its out-of-memory error ("" when none)."""
    t = _torch()
    synchronize(t, devs)
    start = {d: allocated_reserved(src, d) for d in devs}
    trace = src.start_trace(stacks=stacks, max_entries=max_entries)
    if trace is None:
        raise FitRefused(f"fitting needs the allocator's trace, and {src.trace_unsupported() or 'it did not start'}")
    oom = ""
    try:
        run(value)
    except BaseException as e:
        if not is_out_of_memory(e):
            _let_go_of_frames(e)
            raise
        # The error's frames (and those of the errors it chains) hold the run's tensors; only its first line is kept.
        oom = (str(e).strip().splitlines() or ["out of memory"])[0][:200]
        _let_go_of_frames(e)
        e.__traceback__ = None
        del e
    finally:
        synchronize(t, sorted(set(devs) | set(src.context_devices())))
        traces = src.finish_trace(trace, read=True) or []
    out = {}
    for d, entries in enumerate(traces):
        # A recording the user had running holds older events too: only this run's are its.
        mine = [e for e in entries if e.get("time_us", trace.since_us) >= trace.since_us]
        if mine or d in start:
            allocated, reserved = start.get(d, (0, 0))
            out[d] = RunTrace(value, mine, counted, allocated, reserved, oom=bool(oom))
    return RunSet(value, counted, bool(oom), out), oom


__all__ = ["DEFAULT_MAX_ENTRIES", "FitRefused", "fit", "is_out_of_memory", "refusal"]
