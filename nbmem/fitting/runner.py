"""Running a fit: the body once per value under the allocator's trace, then ``fit.analyse`` over the traces.

The engine-level runner; it knows nothing of IPython. The caller hands it ``run(value)``, which runs the
body once with the variable bound to ``value``, and ``clean()``, which takes back what the body left in the
namespace; ``clean`` is called after each run's trace is read, so what a run leaves behind shows in its
trace as left allocated (and is modelled as still there while the next run runs, as it is when the user
runs the cell again). The allocator's events are recorded only through ``TorchSource.start_trace`` and
``finish_trace``.

A fit is the one place nbmem may change the allocator's cache: between runs it frees what each run left
(``torch.cuda.empty_cache()``), because the user asked for the fit. It never runs a value predicted not to
fit, catches an out-of-memory in a run (frees what the run allocated, reports it, and stops), and with
``restore`` (the default) copies the training state the body reaches (``state.snapshot_state``: modules,
optimizers, LR schedulers, gradient scalers, random generators) before the first run and puts it back, bit
for bit, after the last, also after a failure, so the training steps the fit ran leave no trace.
"""

from __future__ import annotations

import gc
import itertools
import os
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..formatting import fmt_bytes
from ..records import HolderKind
from ..sources import TorchSource
from ..walk import Root, TrainingState, reachable_state
from . import remedies
from .allocator import segments_from_snapshot
from .model import Room, RunTrace, margin_bytes_for
from .prediction import FitResult, Remedy, analyse, proportional_bound
from .progress import FitProgress, Show, interrupts_held, planned_runs
from .state import FitRefused, restore_state, snapshot_state, training_kinds

#: How many allocator events one run may record; a run that fills it cannot be lined up with the others.
DEFAULT_MAX_ENTRIES = 1_000_000


def _torch() -> Any:
    return sys.modules.get("torch")


def refusal() -> str | None:
    """Why a fit cannot run in this process, in one line; None when it can."""
    t = _torch()
    if t is None:
        return "fitting needs CUDA's caching allocator, and torch is not imported"
    try:
        available = bool(t.cuda.is_available())
    except Exception:
        available = False
    if not available:
        return "fitting needs CUDA's caching allocator, and this machine has no CUDA device torch can use"
    try:
        backend = t.cuda.get_allocator_backend()
    except Exception:
        backend = "native"
    if backend != "native":
        return (f"fitting needs CUDA's caching allocator, and PYTORCH_CUDA_ALLOC_CONF selects {backend}, which "
                "keeps no trace")
    return None


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA out-of-memory error (torch's own type, or a RuntimeError that says so from an older torch)."""
    t = _torch()
    oom = getattr(getattr(t, "cuda", None), "OutOfMemoryError", None)
    if isinstance(oom, type) and isinstance(exc, oom):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


# -- the fit --------------------------------------------------------------------------------------------------
def _free_cached(src: TorchSource, device: int, *, unless_back_to: int | None = None) -> None:
    """What the last run left in the cache, given back (the user asked for the fit: this is its cleanup).
    ``unless_back_to``: what was allocated when the run started; where no more is allocated now, no garbage
    holds the run's tensors and the collection is left out (a tenth of a second with a notebook's imports, for
    each of a fit's 6 to 30 runs)."""
    if unless_back_to is None or _allocated_reserved(src, device)[0] > unless_back_to:
        gc.collect()
    src.empty_cache(device)


def give_back_workspaces(src: TorchSource, device: int, before: int) -> tuple[int, str | None]:
    """cuBLAS keeps a workspace per handle and stream from its first matrix product on: where runs made them
    (more is allocated than ``before``), they go again, and the user's own are made again. The bytes allocated
    after, and a line for the report where that could not be done exactly. A workspace left in place also pins
    the segment it was made in: a cache emptied around it keeps that segment, and a later run's large blocks
    cannot use its free part (716 MiB of a 748 MiB segment, seen)."""
    after = _allocated_reserved(src, device)[0]
    if after <= before:
        return after, None
    if src.device_count() > 1:
        return after, ("cuBLAS's workspaces the runs made were left in place: torch clears them on every GPU at "
                       "once, and the ones your own products made on the other GPUs would go too")
    if not src.clear_cublas_workspaces():
        return after, None
    # The garbage went before ``after`` was read, so what is missing now (never more than the clear freed, as
    # more than ``before`` was held) is the user's workspaces.
    _free_cached(src, device)
    after = _allocated_reserved(src, device)[0]
    if after > before:  # something else is kept: the caller says so, and this says the workspaces went too
        return after, "cuBLAS's workspaces were given back as well; torch makes them at the next matrix product"
    if after == before:
        return after, None
    try:
        after = _remake_workspaces(src, device, before)
    except Exception as e:
        src.clear_cublas_workspaces()
        _free_cached(src, device)
        after = _allocated_reserved(src, device)[0]
        return after, (f"cuBLAS's workspaces were given back, and making yours again failed ({type(e).__name__}: "
                       f"{(str(e).splitlines() or [''])[0][:100]}); torch makes them at the next matrix product")
    if after != before:
        return after, ("cuBLAS's workspaces were given back and yours could not be made again exactly; torch "
                       "makes them at the next matrix product")
    return after, None


def _remake_workspaces(src: TorchSource, device: int, before: int) -> int:
    """Clearing cuBLAS's workspaces took the ones the user had before the fit too: make again the fewest of
    them that bring memory back to where it was (torch keeps no list of them); the bytes allocated after."""
    kinds = src.CUBLAS_WORKSPACES
    after = _allocated_reserved(src, device)[0]
    for n in range(1, len(kinds) + 1):
        for chosen in itertools.combinations(kinds, n):
            for kind in chosen:
                src.make_cublas_workspace(kind, device)
            after = _allocated_reserved(src, device)[0]
            if after == before:
                return after
            src.clear_cublas_workspaces()
            _free_cached(src, device)
            after = _allocated_reserved(src, device)[0]
    return after


def _allocated_reserved(src: TorchSource, device: int) -> tuple[int, int]:
    r = src.read(device)
    if r is None:
        raise FitRefused("fitting needs the allocator's counters, and they could not be read")
    return r.allocated_bytes, r.reserved_bytes


def fit(run: Callable[[int], object], values: Sequence[int], *, source: TorchSource | None = None,
        name: str = "value", device: int | None = None, clean: Callable[[], object] | None = None,
        warmup: bool = True, modules: Iterable[Any] = (), optimizers: Iterable[Any] = (), others: Iterable[Any] = (),
        iterators: Sequence[str] = (), restore: bool = True, margin_bytes: int | None = None, stacks: bool = False,
        cell_files: frozenset[str] = frozenset(), sources: Mapping[int, str] | None = None,
        max_value: int | None = None, want: int | None = None, max_entries: int = DEFAULT_MAX_ENTRIES,
        show: Show | None = None) -> FitResult:
    """Run ``run(value)`` at each value (ascending) under the allocator's trace and predict the largest that fits.

    ``warmup`` runs the smallest value once first, not counted, so the one-time allocations (optimizer
    state, workspaces) are made before the counted runs. ``modules``, ``optimizers`` and ``others`` (LR
    schedulers, gradient scalers) are the state the body reaches, copied and restored afterwards with the
    random generators when ``restore``; ``iterators`` name what it may advance that cannot be put back.
    ``stacks`` records Python stacks, so the result names the lines that grow (``cell_files`` and ``sources``
    name the cell's own). ``margin_bytes`` defaults to ``fit.margin_bytes_for``. ``want``: a value asked
    about; where it does not fit, the result's ``remedies`` say what would let it run: gradient accumulation
    from the fit itself, activation checkpointing and bf16 autocast from the fit's runs again under each
    (``remedies.candidates``: applied for those runs only, and undone), ``expandable_segments`` from the model.
    A body that raises anything but CUDA's out-of-memory error stops the fit (cleaned up and
    restored) and the error propagates, told what was put back.
    """
    started = time.perf_counter()
    src = source or TorchSource()
    why = refusal()
    if why:
        raise FitRefused(why)
    vals = sorted({int(v) for v in values})
    if len(vals) < 2 or vals[0] < 1:
        raise ValueError(f"a fit needs two or more distinct positive values, got {list(values)!r}")
    t = _torch()
    if not t.cuda.is_initialized():
        t.cuda.init()  # the user asked for a fit, which runs CUDA code anyway
    dev = t.cuda.current_device() if device is None else int(device)
    unsupported = src.trace_unsupported()
    if unsupported:
        raise FitRefused(f"fitting needs the allocator's trace, and {unsupported}")
    modules, optimizers, others = list(modules), list(optimizers), list(others)
    candidates, left_out = remedies.candidates(t, modules, others) if want is not None else ([], [])
    progress = FitProgress(show, name, *planned_runs(len(vals) + warmup, REFINE_RUNS, len(candidates)))
    saved = snapshot_state(modules, optimizers, others, iterators=iterators) if restore else None
    modules = optimizers = others = ()
    measured: list[Remedy] = []
    remedy_notes: list[str] = []
    others_ran: list[int] = []  # the runs under remedies
    runs: list[RunTrace] = []
    skipped: list[int] = []
    notes: list[str] = []
    body = _Body(progress.watch(run), src, dev, stacks, max_entries, clean, name, notes)
    failed: BaseException | None = None
    before: int | None = None
    try:
        room, segments, before = _room(src, dev, margin_bytes)
        refined = None
        if not _runs(body, vals, warmup, runs, skipped, room, segments, cell_files):
            refined = _refine(body, runs, room, segments, cell_files)
        if want is not None and (candidates or left_out):
            # with the cell's lines as the sites, as refine's analyses and the final one have them
            plain = (refined if refined is not None and max_value is None else
                     analyse(runs, room, name=name, segments=segments, cell_files=cell_files, max_value=max_value,
                             largest_only=True))
            ran_ok = [r.value for r in runs if r.counted and not r.oom]
            if plain.largest_value is not None and want > plain.largest_value and ran_ok:
                remedy_notes += left_out
                measured = _measure_remedies(body, candidates, vals, warmup, plain.largest_value, max(ran_ok),
                                             margin_bytes, max_value, remedy_notes, others_ran)
    except BaseException as e:
        runs.clear()  # the error's frames keep this one: let go of the traces (and the copy, below) now
        failed = e
        raise
    finally:
        candidates = []  # they hold the modules: no reference is kept past the fit
        steps = body.ran + sum(others_ran)
        with interrupts_held(raise_after=failed is None):  # Ctrl-C again waits until everything is back
            restored = restore_state(saved) if saved is not None else None
            lines = (tuple(saved.restored), tuple(saved.not_restored)) if saved is not None else ((), ())
            saved = None
            _free_cached(src, dev)
            if failed is not None:
                _say_what_was_put_back(failed, src, dev, before, lines, steps)
            progress.done(failed)  # the line goes, or stays saying that an interrupted fit put everything back
        failed = None
    after, workspaces = give_back_workspaces(src, dev, before)
    if workspaces:
        notes.append(workspaces)
    if after > before:
        notes.append(f"after the fit {fmt_bytes(after - before, signed=True)} is allocated that was not before it "
                     "(something the body keeps that is neither in the namespace nor in the state restored)")
    elif after < before:
        notes.append(f"after the fit {fmt_bytes(before - after)} less is allocated than before it: garbage that only "
                     "a collection frees (reference cycles) was freed by the fit's gc.collect()"
                     + (", or cuBLAS's workspaces (above)" if workspaces else ""))
    if not restore and steps:
        notes.append(f"not restored: the fit ran the body {steps} times, and whatever it trains was trained")
    result = analyse(runs, room, name=name, segments=segments, cell_files=cell_files, sources=sources,
                     max_value=max_value, notes=notes, skipped=skipped, want=want, expandable=_expandable_on(),
                     measured=measured, remedy_notes=remedy_notes)
    return replace(result, restored_bytes=restored, restored=lines[0], not_restored=lines[1], steps_run=steps,
                   duration_s=time.perf_counter() - started)


def fit_in_notebook(adapter: Any, source: TorchSource, type_cache: Any, body: str | Callable[[int], object],
                    name: str, values: Sequence[int], *, cell: int, warmup: bool, restore: bool,
                    budget_s: float | None, want: int | None = None, show: Show | None = None) -> FitResult:
    """A fit of a cell's source (run in the notebook's namespace, ``name`` bound, put back after each run) or
    of a function of the value; the training state it reaches (found by a walk from the names it uses) is
    what is restored. ``adapter`` is the IPython adapter (``shell.ShellAdapter``)."""
    why = refusal()
    if why:
        raise FitRefused(why)
    space = None
    if callable(body):
        runner, clean, files, lines = body, None, frozenset[str](), None
        used = _globals_used(body)
        extra = [Root(getattr(body, "__name__", "body"), HolderKind.NAMESPACE, body)]
    else:
        space = adapter.fit_namespace(body, name, cell)
        runner, clean, files, lines = space.run, space.clean, frozenset({space.filename}), space.sources
        used = set(adapter.mentioned(body)) - {name}
        extra = []
    found = state_reached(adapter, source.torch(), type_cache, used, extra, budget_s=budget_s)
    del extra
    nothing = not (found.modules or found.optimizers or found.others)
    try:
        result = fit(runner, values, source=source, name=name, clean=clean, warmup=warmup, modules=found.modules,
                     optimizers=found.optimizers, others=found.others, iterators=found.iterators, restore=restore,
                     stacks=True, cell_files=files, sources=lines, want=want, show=show)
        if restore and nothing:
            result = replace(result, notes=("no model, optimizer, LR scheduler or gradient scaler was found under the "
                                            "names the cell uses or the functions it calls: only the random "
                                            "generators were put back, and what else the fit's runs changed stays "
                                            "changed", *result.notes))
        return result
    finally:
        del found
        if space is not None:
            space.close()


def state_reached(adapter: Any, torch: Any, type_cache: Any, used: set[str], extra: Sequence[Root], *,
                  budget_s: float | None) -> TrainingState:
    """The training state a cell can change (modules, optimizers, schedulers, scalers, and the iterators it
    may advance): reached by a walk from the names it uses, and from the
    globals of the user's functions among them (``train_step(batch)`` reaches ``model`` and ``opt``)."""
    items = dict(adapter.namespace_items(used))
    for _ in range(_CALL_DEPTH):
        more = {n for v in list(items.values()) if type(v) is types.FunctionType for n in _globals_used(v)}
        new = dict(adapter.namespace_items(more - items.keys()))
        if not new:
            break
        items.update(new)
    roots = [Root(n, HolderKind.NAMESPACE, v) for n, v in items.items()] + list(extra)
    del items
    return reachable_state(torch, roots, type_cache, budget_s=budget_s, kinds=training_kinds(torch))


#: How deep a fit follows the user's functions to the globals they use (a step that calls a helper).
_CALL_DEPTH = 3
_CODE: Any = vars(types.FunctionType)["__code__"]


def _globals_used(fn: Any) -> set[str]:
    """The global names a function's code (and the code nested in it) reads: read from its code object,
    which is the interpreter's, never the user's."""
    try:
        code = _CODE.__get__(fn)
    except Exception:
        return set()
    out: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        out.update(n for n in c.co_names if type(n) is str)
        stack.extend(x for x in c.co_consts if type(x) is types.CodeType)
    return out


def _room(src: TorchSource, dev: int, margin_bytes: int | None) -> tuple[Room, Any, int]:
    """The room a fit's runs have, read after the cache is given back: the room, the allocator's segments, and
    what is allocated before the runs."""
    _free_cached(src, dev)
    before, reserved = _allocated_reserved(src, dev)
    segments = segments_from_snapshot(src.segments() or [], dev)
    got = src.device_free(dev)
    if got is None:
        raise FitRefused("fitting needs the device's free memory, and CUDA could not say (cudaMemGetInfo)")
    free, total = got
    margin = margin_bytes_for(free, reserved) if margin_bytes is None else int(margin_bytes)
    return Room(f"cuda:{dev}", free, reserved, before, margin, total), segments, before


def _runs(body: _Body, vals: Sequence[int], warmup: bool, runs: list[RunTrace], skipped: list[int], room: Room,
          segments: Any, cell_files: frozenset[str]) -> bool:
    """The fit's runs (a warm-up, then each value ascending, none predicted not to fit) into ``runs``; whether
    they stopped early (a value skipped, or an out-of-memory)."""
    name, notes, max_entries = body.name, body.notes, body.max_entries
    schedule = ([(vals[0], False)] if warmup else []) + [(v, True) for v in vals]
    for k, (v, counted) in enumerate(schedule):
        if counted and _predicted_not_to_fit(runs, v, room, segments, name, cell_files):
            skipped += [w for w, c in schedule[k:] if c]
            notes.append(f"{name}={v:,} was not run: the runs before it predict it does not fit")
            return True
        trace, oom = body.once(v, counted)
        runs.append(trace)
        if len(trace.entries) >= max_entries:
            notes.append(f"the run at {name}={v:,} filled the trace ({max_entries:,} events): what it recorded "
                         "first is lost, so it may not line up with the others")
        if oom:
            notes.append(f"what the run at {name}={v:,} allocated before it ran out of memory was freed ({oom})")
            return True
    return False


def _measure_remedies(body: _Body, candidates: Sequence[remedies.Candidate], vals: Sequence[int], warmup: bool,
                      plain_largest: int, timed: int, margin_bytes: int | None, max_value: int | None,
                      notes: list[str], ran: list[int]) -> list[Remedy]:
    """Each remedy's largest value: the fit's runs again with it applied (no stacks), the same analysis over
    them, and one timed step at the same value with it and without it for its cost. A remedy that fails the
    body (an error other than out-of-memory) or allows no more than the plain fit is left out with a line that
    says so; the modules are as they were after each (``Candidate.applied``), the training state is the fit's to
    put back."""
    name = body.name
    plain_s = _timed_step(body, timed) if candidates else None
    out: list[Remedy] = []
    for c in candidates:
        sub = _Body(c.wrap(body.run), body.src, body.dev, False, body.max_entries, body.clean, name, [])
        runs: list[RunTrace] = []
        started = time.perf_counter()
        try:
            with c.applied():
                room, segments, _ = _room(body.src, body.dev, margin_bytes)
                refined = None
                if not _runs(sub, vals, warmup, runs, [], room, segments, frozenset()):
                    refined = _refine(sub, runs, room, segments, frozenset())
                res = (refined if refined is not None and max_value is None else
                       analyse(runs, room, name=name, segments=segments, max_value=max_value, largest_only=True))
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


def _timed_step(body: _Body, value: int, repeats: int = 2) -> float | None:
    """The shortest of ``repeats`` untraced runs' times (synchronized), for a remedy's cost; None where one ran out
    of memory. The runs are counted in the body's steps and cleaned up as any other."""
    times = []
    for _ in range(repeats):
        took = _timed_once(body, value)
        if took is None:
            return None
        times.append(took)
    return min(times)


def _timed_once(body: _Body, value: int) -> float | None:
    t = _torch()
    body.ran += 1
    start = _allocated_reserved(body.src, body.dev)[0]
    try:
        t.cuda.synchronize(body.dev)
        started = time.perf_counter()
        body.run(value)
        t.cuda.synchronize(body.dev)
        return time.perf_counter() - started
    except BaseException as e:
        if not is_out_of_memory(e):
            raise
        _let_go_of_frames(e)
        return None
    finally:
        if body.clean is not None:
            body.clean()
        _free_cached(body.src, body.dev, unless_back_to=start)


#: A prediction this far beyond the largest value run is checked by another run, halfway to it ...
REFINE_FACTOR = 1.5
#: ... at most this many times ...
REFINE_RUNS = 3
#: ... and never a run that would take longer than this (its time scaled from the largest run's).
REFINE_SECONDS = 30.0


def _refine(body: _Body, runs: list[RunTrace], room: Room, segments: Any,
            cell_files: frozenset[str]) -> FitResult | None:
    """More counted runs far from the small values while the prediction lies far beyond them: kernels change
    their buffers with size (chunked products, buffers sized by the data), and a point near the answer shows
    it. Each run is halfway from the largest value run to the prediction, so it is predicted to fit with room
    to spare; an out-of-memory there is caught, and the prediction stays below it. The analysis (largest value
    only) of the runs as they stand at the end, so the caller need not make it again; None after an
    out-of-memory run."""
    name, notes, durations = body.name, body.notes, body.durations
    made = executed = 0
    first: int | None = None
    res: FitResult | None = analyse(runs, room, name=name, segments=segments, cell_files=cell_files,
                                    largest_only=True)
    while res is not None and executed < REFINE_RUNS:
        ok = [r.value for r in runs if r.counted and not r.oom]
        top = max(ok)
        if res.largest_value is None or res.largest_value < REFINE_FACTOR * top:
            break
        first = res.largest_value if first is None else first
        value = (top + res.largest_value) // 2
        took = durations.get(top, 0.0)
        if took * value / top > REFINE_SECONDS:
            value = int(top * REFINE_SECONDS / max(took, 1e-6))
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
        checked = analyse(runs, room, name=name, segments=segments, cell_files=cell_files, largest_only=True)
        if checked.method != "timeline":
            # Its allocations do not line up with the others' (another algorithm at this size): the model of the
            # runs that do line up stands (``res``, of the runs before it), rather than a peak scaled from one run.
            runs.pop()
            made -= 1
            notes.append(f"a run at {name}={value:,} allocated differently from the others (another algorithm at "
                         "that size) and was left out of the model")
            break
        res = checked
    if made:
        at = ", ".join(f"{r.value:,}" for r in runs[-made:])
        notes.append(f"the small runs predicted {first:,}: {made} more run{'s' if made > 1 else ''} ({name}={at}) "
                     "checked the growth nearer the answer")
    return res


def _expandable_on() -> bool:
    """Whether this process's caching allocator was started with expandable segments (the settings torch read)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def _say_what_was_put_back(e: BaseException, src: TorchSource, dev: int, before: int | None,
                           lines: tuple[tuple[str, ...], tuple[str, ...]], steps: int) -> None:
    """A failed fit's error, told what the fit put back and whether memory is where it was before the fit."""
    if not isinstance(e, (Exception, KeyboardInterrupt)) or not hasattr(e, "add_note"):
        return
    try:
        after = _allocated_reserved(src, dev)[0]
    except Exception:
        after = None
    memory = ("" if before is None or after is None else
              "; memory allocated is back where it was" if after == before else
              f"; {fmt_bytes(after - before, signed=True)} stays allocated that was not before the fit")
    restored = "training state put back" if lines[0] else "nothing restored"
    kept = f"; not restored: {'; '.join(lines[1])}" if lines[1] else ""
    e.add_note(f"nbmem fit: stopped after {steps} run{'s' if steps != 1 else ''} of the body; {restored}{kept}"
               f"{memory}")


@dataclass
class _Body:
    """The body as a fit runs it, and the instruments it runs under (which can fall back during the fit)."""

    run: Callable[[int], object]
    src: TorchSource
    dev: int
    stacks: bool
    max_entries: int
    clean: Callable[[], object] | None
    name: str
    notes: list[str]
    durations: dict[int, float] = field(default_factory=dict)
    ran: int = 0  # times the body was started

    def once(self, value: int, counted: bool) -> tuple[RunTrace, str]:
        """One run, timed; afterwards, whatever happened, the namespace put back and the cache given back.

        A run whose error was lost on the way (CPython's ``SystemError``: a function "returned NULL without
        setting an exception") while Python stacks were recorded runs again without them, and so does the rest
        of the fit: the stacks are taken in whichever thread allocates, the autograd engine's too, while an
        error from a hook there (checkpointing's recomputation) is still on its way to the caller.
        """
        try:
            return self._timed(value, counted)
        except SystemError as e:
            if not self.stacks:
                raise
            why = (str(e).splitlines() or [""])[0][:160]
            _let_go_of_frames(e)
            del e
        self.stacks = False
        self.notes.append(f"the run at {self.name}={value:,} lost its error under the trace's Python stacks ({why}): "
                          "the fit went on without stacks, so it cannot name the lines that grow")
        return self._timed(value, counted)

    def _timed(self, value: int, counted: bool) -> tuple[RunTrace, str]:
        started = time.perf_counter()
        self.ran += 1
        start = _allocated_reserved(self.src, self.dev)[0]
        freed_older = True  # until the run's trace says otherwise
        try:
            trace, oom = _one_run(self.run, value, counted, self.src, self.dev, self.stacks, self.max_entries)
            freed_older = _frees_older_blocks(trace.entries)
            return trace, oom
        finally:
            self.durations[value] = time.perf_counter() - started
            if self.clean is not None:
                self.clean()
            # A run that freed blocks older than itself can hide garbage of its own behind them: collect then.
            _free_cached(self.src, self.dev, unless_back_to=None if freed_older else start)


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


def _one_run(run: Callable[[int], object], value: int, counted: bool, src: TorchSource, dev: int,
             stacks: bool, max_entries: int) -> tuple[RunTrace, str]:
    """One run under the trace; the trace, and the first line of its out-of-memory error ("" when none)."""
    t = _torch()
    t.cuda.synchronize(dev)
    allocated, reserved = _allocated_reserved(src, dev)
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
        t.cuda.synchronize(dev)
        traces = src.finish_trace(trace, read=True) or []
    entries = traces[dev] if dev < len(traces) else []
    # A recording the user had running holds older events too: only this run's are its.
    entries = [e for e in entries if e.get("time_us", trace.since_us) >= trace.since_us]
    return RunTrace(value, entries, counted, allocated, reserved, oom=bool(oom)), oom


def _predicted_not_to_fit(runs: Sequence[RunTrace], value: int, room: Room, segments: Any, name: str,
                          cell_files: frozenset[str]) -> bool:
    """Whether the runs so far say ``value`` would not fit (never run it then)."""
    done = [r for r in runs if r.counted and not r.oom]
    if len({r.value for r in done}) >= 2:
        res = analyse(runs, room, name=name, segments=segments, cell_files=cell_files, largest_only=True)
        return res.largest_value is not None and value > res.largest_value
    last = next((r for r in reversed(runs) if not r.oom), None)
    if last is None:
        return False
    bound = proportional_bound(last, value)
    return bound is not None and bound > room.capacity_bytes


__all__ = ["DEFAULT_MAX_ENTRIES", "FitRefused", "fit", "fit_in_notebook", "is_out_of_memory", "refusal",
           "state_reached"]
