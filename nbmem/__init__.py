"""nbmem: where your GPU memory went, inside the notebook, and how to get it back.

``%load_ext nbmem`` starts it. Importing this package does nothing heavy: no torch, no NVML, no
CUDA; everything is loaded when the extension is.
"""

from __future__ import annotations

import keyword
import numbers
from typing import Any

__version__ = "0.3.0"
__all__ = [
    "Gauge",
    "__version__",
    "cleanup",
    "fit",
    "last_death",
    "leaks",
    "lines",
    "load_ipython_extension",
    "plot",
    "plot_fit",
    "report",
    "samples",
    "status",
    "unload_ipython_extension",
]


def load_ipython_extension(shell: Any) -> None:
    from nbmem.ipython.root import load

    load(shell)


def unload_ipython_extension(shell: Any) -> None:
    from nbmem.ipython.root import unload

    unload(shell)


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    """Where jupyter_server finds nbmem's server extension (only the server imports it)."""
    from nbmem.server import _jupyter_server_extension_points as points

    return points()


def _session() -> Any:
    from nbmem.ipython.root import session_of

    return session_of()


def _cell_number(cell: Any, what: str) -> int | None:
    if cell is None:
        return None
    if isinstance(cell, bool) or not isinstance(cell, numbers.Integral) or int(cell) < 0:
        raise TypeError(f"nbmem.{what}(cell=...) takes a cell number (the N of In[N]) or None, got {cell!r}")
    return int(cell)


def leaks(cell: int | None = None, detail: bool = False) -> Any:
    """Who holds memory, as a DataFrame: what cell N added (``cell=N``), or everything held now (``None``).

    A row per owner by default: the name you typed that keeps the memory (a variable, ``Out[n]``, a
    module's attribute, the last exception's frame), with every tensor under it counted once, largest
    first; the state a notebook keeps on purpose (``state``: a model, an optimizer) after the rest.
    ``detail=True`` gives a row per tensor storage instead (containers of small tensors as one row), each
    with its ``owner``.

    Columns: cell, name, holders (the member paths), kind ("namespace", "module", "output",
    "traceback"), device, bytes (storage + autograd graph), storage_bytes, graph_bytes, holds_graph,
    tensors, view_bytes, line, what (in words), also_held_by (other owners reaching some of it), owner,
    hint, action (the cleanup that frees it), state (what a cell meant to keep: "model", "optimizer", ...;
    "" otherwise). Byte columns are integers, NA where unknown. An empty frame says why under its columns
    (``attrs["note"]``: the threshold, and how to lower it). A cell that was not measured is a LookupError.
    """
    if not isinstance(detail, bool):
        raise TypeError(f"nbmem.leaks(detail=...) takes True or False, got {detail!r:.40}")
    return _session().leaks(_cell_number(cell, "leaks"), detail=detail)


def lines(cell: int | None = None) -> Any:
    """Memory per line of a cell measured with ``%%cudamem --lines`` (the last one, or cell N).

    Columns: cell, device, line, source, delta_allocated_bytes (what the line left allocated, over all
    its runs), peak_allocated_bytes (while it ran), events, top_frame (the user frame that allocated the
    largest block live at that peak). A cell without lines is a LookupError.
    """
    return _session().lines(_cell_number(cell, "lines"))


def cleanup(names: Any = (), outputs: bool = False, traceback: bool = False, collect: bool = True,
            empty_cache: bool = True, to_cpu: Any = (), compiled: bool = False) -> Any:
    """Delete exactly the named variables, clear outputs / the last traceback if asked, then gc and empty_cache.

    A name's object also loses IPython's hidden references to it (``Out[n]``, ``_n``, ``_``, the last
    result); other variables bound to it are never removed (the report says they still hold it).
    ``compiled=True`` runs ``torch._dynamo.reset()`` before gc: what ``torch.compile`` made goes (compiled
    code, CUDA graphs and their private memory pool); compiled modules compile again when next called.
    The whole request is checked first: any unknown or protected name raises ``ValueError`` listing
    every problem, and nothing is removed. Returns a report with ``freed_allocated_bytes``,
    ``freed_reserved_bytes`` and one line per step.
    """
    from nbmem.clean.request import CleanupRequest

    return _session().cleanup(CleanupRequest.of(names, to_cpu, outputs, traceback, collect, empty_cache, compiled))


def fit(body: Any, name: str, values: Any, *, restore: bool = True, warmup: bool = True,
        want: int | None = None, on: str | None = None, host_limit: int | str | None = None) -> Any:
    """Will it fit? The largest ``name`` that ``body`` can run at on this GPU, never above the real limit.

    ``body`` is a cell's source (run in the notebook's namespace with ``name`` bound to each value, as
    ``%%cudamem --fit name=...`` does) or a function called with each value. ``values``: 2 to 5 positive
    whole numbers (ints or NumPy integers), small enough to run (e.g. ``[8, 16, 32]``). The smallest runs once
    first, uncounted (a warm-up, so one-time allocations such as optimizer state are not taken for growth). The
    training state it reaches (modules, optimizers, LR schedulers, gradient scalers) and the random generators
    are copied before and put back bit for bit after, also after an error (``restore=False`` skips that; the fit
    then trains them); ``restored`` and ``not_restored`` name them, a line each.

    ``want``: the value you want to run at; when it does not fit, ``remedies`` lists what would let it run
    and the largest value each allows: gradient accumulation (from the fit itself), activation checkpointing
    of the model's repeated blocks and bf16 autocast (measured: the small runs again under each, undone
    after, with the time per sample against the plain step), ``expandable_segments`` (predicted; it needs a
    restart). A remedy that cannot apply is left out with its reason.

    Every GPU the body allocates on is measured against its own free memory; the answer fits on all of them,
    and ``limited_by`` names the one that limits it. ``on``: the answer for another GPU from the same runs, a
    memory size (``"24GiB"``, ``"24GB"``) or a GPU's name (``"T4"``, ``"L4"``, ``"A100 40GB"``; the table is
    ``nbmem.fitting.analysis.devices.GPUS``), less a CUDA context as large as this one's.

    Where the body keeps memory on the host (``save_on_cpu``, pinned buffers, ``.cpu()`` in the step), host
    memory is a limit too: the answer fits there as well, and says when the host limits it. The room there is
    the container's memory limit, else the machine's available memory, less a margin; ``host_limit`` (``"8GiB"``,
    or an int of bytes) sets the memory this kernel may use by hand. No value predicted not to fit on either is run.

    Returns a ``FitResult``: ``largest_value``, ``power_of_two``, ``fixed_bytes``, ``bytes_per_unit``,
    ``lines`` (where memory grows), ``room`` (the memory it fits into and the margin), ``notes``;
    ``.to_frame()`` and ``.row()`` for code. ``largest_value`` is None with ``reason`` when there is no
    prediction. An argument that is not what it should be (a str, float or bool among the values, a body that is
    neither source nor a function, a ``host_limit`` of 0) raises ``TypeError`` or ``ValueError``, and a machine
    without CUDA ``RuntimeError``, each in one line ending "Nothing was run.", before anything runs.
    """
    from nbmem.fitting.runs.state import FitRefused

    if not isinstance(body, str) and not callable(body):
        raise TypeError(f"nbmem.fit(body=...) takes a cell's source (a str) or a function called with each value, "
                        f"got {body!r:.40}. {_NOTHING_RAN}")
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise TypeError(f"nbmem.fit(name=...) takes a variable name, got {name!r:.40}. {_NOTHING_RAN}")
    vals = _fit_values(values)
    if want is not None and (_whole(want) is None or want < 1):
        raise ValueError(f"nbmem.fit(want=...) takes the {name} you want to run at, a positive whole number, "
                         f"got {want!r:.40}. {_NOTHING_RAN}")
    for flag, given in (("restore", restore), ("warmup", warmup)):
        if not isinstance(given, bool):
            raise TypeError(f"nbmem.fit({flag}=...) takes True or False, got {given!r:.40}. {_NOTHING_RAN}")
    from nbmem.fitting.analysis.devices import parse_on
    from nbmem.fitting.analysis.hostroom import parse_host_limit

    try:
        target = None if on is None else parse_on(on)
    except ValueError as e:
        raise ValueError(f"nbmem.fit(on=...) {e}. {_NOTHING_RAN}") from None
    try:
        host_bytes = None if host_limit is None else parse_host_limit(host_limit)
    except ValueError as e:
        raise ValueError(f"nbmem.fit(host_limit=...) {e}. {_NOTHING_RAN}") from None
    sess = _session()
    if isinstance(body, str) and name not in sess.adapter.mentioned(body):
        raise ValueError(f"nbmem.fit: the body does not use `{name}`; it runs with {name} bound to each value. "
                         f"{_NOTHING_RAN}")
    try:
        return sess.fit(body, name, vals, warmup=warmup, restore=restore, want=None if want is None else int(want),
                        on=target, host_limit=host_bytes)
    except FitRefused as e:
        raise RuntimeError(f"nbmem.fit: {e}. {'The body ran once, no more.' if e.ran else _NOTHING_RAN}") from None


_NOTHING_RAN = "Nothing was run."


def _whole(value: object) -> int | None:
    """``value`` as an int where it is a whole number (an int or a NumPy integer, never a bool); else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _fit_values(values: Any) -> list[int]:
    """``nbmem.fit``'s values, sorted and distinct; a one-line TypeError or ValueError that names the fix.

    Whole numbers only: a float (8.0 too, and inf) or a str is refused rather than rounded or read digit by digit,
    and so is a bool, which is an int to Python but never a size."""
    try:
        # A str is iterable, as characters: "816" is not 8, 16 (nor 1, 6, 8).
        items = None if isinstance(values, str | bytes | bytearray) else iter(values)
    except TypeError:
        items = None
    if items is None:
        raise TypeError(f"nbmem.fit(values=...) takes a list of whole numbers such as [8, 16, 32], got "
                        f"{values!r:.40}. {_NOTHING_RAN}")
    given = list(items)
    for v in given:
        if _whole(v) is None:
            raise TypeError(f"nbmem.fit(values=...) takes whole numbers such as [8, 16, 32], not {v!r:.40} "
                            f"({type(v).__name__}). {_NOTHING_RAN}")
    vals = sorted({int(v) for v in given})
    if not 2 <= len(vals) <= 5 or vals[0] < 1:
        raise ValueError(f"nbmem.fit(values=...) takes 2 to 5 different positive values, such as [8, 16, 32], got "
                         f"{values!r:.60}. {_NOTHING_RAN}")
    return vals


def plot_fit(result: Any = None, ax: Any = None) -> Any:
    """The last fit (or ``result``) drawn: each run's peak, the model over the value, the memory it fits in."""
    from nbmem.ui.plotting import plot_fit as _plot

    result = result if result is not None else _session().last_fit
    if result is None:
        raise LookupError("no fit has run yet: `%%cudamem --fit batch=8,16,32` on a cell, or nbmem.fit(...)")
    return _plot(result, ax=ax)


def samples() -> Any:
    """The background samples as a DataFrame, one row per (time, device); integer bytes, NA where unknown."""
    return _session().samples()


def report() -> Any:
    """One row per monitored cell (and device), indexed by the cell's execution count."""
    return _session().report()


def status() -> Any:
    """What nbmem can and cannot see, and why."""
    return _session().status()


def last_death() -> Any:
    """How this notebook's previous kernel died (told by ``%load_ext nbmem``), or None when it ended cleanly."""
    from nbmem.ipython.root import root_of

    flight = root_of().flight
    return None if flight is None else flight.last_death


def plot(death: Any = None, **kwargs: Any) -> Any:
    """A matplotlib Figure of memory over time per device, monitored cells shaded with their peaks;
    ``nbmem.plot(nbmem.last_death())`` draws the previous kernel's last samples instead."""
    from nbmem.recorder.deaths import Death
    from nbmem.ui.plotting import plot as _plot
    from nbmem.ui.plotting import plot_death

    if death is not None:
        if not isinstance(death, Death):
            raise TypeError(f"nbmem.plot(death) takes what nbmem.last_death() returns, not {type(death).__name__}")
        return plot_death(death)
    return _plot(_session(), **kwargs)


def __getattr__(name: str) -> Any:
    if name == "Gauge":
        from nbmem.ui.widget import Gauge

        return Gauge
    raise AttributeError(f"module 'nbmem' has no attribute {name!r}")
