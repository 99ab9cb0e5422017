"""A fit of a notebook cell: its source as the body, and the training state it reaches, found by a walk.

``fit_in_notebook`` turns a cell's source (run in the notebook's namespace, its NAME bound and put back after
each run) or a function of the value into ``runner.fit``'s ``run(value)``, and hands it the training state the
body can change: the modules, optimizers, schedulers, scalers and iterators reached from the names it uses and
from the globals of the user's functions among them.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from nbmem.clean.release import TorchRelease
from nbmem.fitting.analysis.devices import Target
from nbmem.fitting.analysis.prediction import FitResult
from nbmem.fitting.runs.progress import Show
from nbmem.fitting.runs.runner import fit, refusal
from nbmem.fitting.runs.state import FitRefused, training_kinds
from nbmem.formatting import fmt_bytes
from nbmem.holders.reached import TrainingState, reachable_state
from nbmem.holders.walk import Root
from nbmem.records import HolderKind

#: How long the walk for the training state a fit restores may take (``fit_in_notebook``'s ``budget_s``):
#: longer than a cell's scan (``Nbmem.scan_budget``), since the fit must find all of it. Under a profiler the
#: scan's 0.5 s ended inside a 7B model, before its optimizer, and the fit put back the model alone.
FIT_WALK_S = 30.0
_NOT_ALL_FOUND = ("the training state this cell reaches could not all be found in {s:g} s (the walk from the names "
                  "it uses stopped before the end), so the fit could not put it all back; fit without restoring it "
                  "(--no-restore) to go ahead, and the fit will train the model")


def fit_in_notebook(adapter: Any, source: TorchRelease, type_cache: Any, body: str | Callable[[int], object],
                    name: str, values: Sequence[int], *, cell: int, warmup: bool, restore: bool,
                    budget_s: float | None = FIT_WALK_S, want: int | None = None, on: Target | str | None = None,
                    own_used: Callable[[int], int | None] | None = None, show: Show | None = None,
                    host_limit: int | None = None) -> FitResult:
    """A fit of a cell's source (run in the notebook's namespace, ``name`` bound, put back after each run) or
    of a function of the value; the training state it reaches (found by a walk from the names it uses) is
    what is restored. ``adapter`` is the IPython adapter (``shell.ShellAdapter``). ``budget_s``: how long the walk
    for that state may take; where it stops first, a fit that restores is refused (what it did not reach is not
    put back)."""
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
    if restore and found.stopped_after is not None:
        # the traceback keeps this frame: it must keep neither the model nor the namespace's copy
        del found, runner, clean
        if space is not None:
            space.close()
            space = None
        raise FitRefused(_NOT_ALL_FOUND.format(s=budget_s))
    nothing = not (found.modules or found.optimizers or found.others)
    try:
        result = fit(runner, values, source=source, name=name, clean=clean, warmup=warmup, modules=found.modules,
                     optimizers=found.optimizers, others=found.others, iterators=found.iterators, restore=restore,
                     stacks=True, cell_files=files, sources=lines, want=want, on=on, own_used=own_used,
                     show=show, host_limit=host_limit, outside=found.paged_bytes)
        if found.paged_bytes:
            paged = ", ".join(f"{fmt_bytes(n)} on cuda:{d}" for d, n in sorted(found.paged_bytes.items()))
            result = replace(result, notes=(*result.notes, f"paged optimizer state ({paged}, CUDA managed memory "
                                            "outside PyTorch's allocator) is counted as taken: a step moves it onto "
                                            "the GPU"))
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
