"""nbmem: where your GPU memory went, inside the notebook, and how to get it back.

``%load_ext nbmem`` starts it. Importing this package does nothing heavy: no torch, no NVML, no
CUDA; everything is loaded when the extension is.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = [
    "Gauge",
    "__version__",
    "cleanup",
    "leaks",
    "load_ipython_extension",
    "plot",
    "report",
    "samples",
    "status",
    "unload_ipython_extension",
]


def load_ipython_extension(shell: Any) -> None:
    from .magics import load_ipython_extension as load

    load(shell)


def unload_ipython_extension(shell: Any) -> None:
    from .magics import unload_ipython_extension as unload

    unload(shell)


def _session() -> Any:
    from .magics import _magics

    return _magics().session


def leaks(cell: int | None = None) -> Any:
    """Findings as a DataFrame: what cell N added (``cell=N``), or everything held now (``None``).

    Columns: cell, name, holders, kind ("namespace", "output", "traceback"), device, bytes,
    holds_graph, hint. Storages are counted once; bytes include the saved tensors of a kept graph.
    """
    import numbers

    if cell is not None and (isinstance(cell, bool) or not isinstance(cell, numbers.Integral)):
        raise TypeError(f"nbmem.leaks(cell=...) takes a cell number (the N of In[N]) or None, got {cell!r}")
    return _session().leaks(None if cell is None else int(cell))


def cleanup(names: Any = (), outputs: bool = False, traceback: bool = False, collect: bool = True,
            empty_cache: bool = True, to_cpu: Any = ()) -> Any:
    """Delete the named variables, clear outputs / the last traceback if asked, then gc and empty_cache.

    Returns a report with ``freed_allocated_bytes`` and ``freed_reserved_bytes`` and one line per step.
    """
    from .magics import cleanup as _cleanup

    return _cleanup(names=names, outputs=outputs, traceback=traceback, collect=collect,
                    empty_cache=empty_cache, to_cpu=to_cpu)


def samples() -> Any:
    """The background samples as a DataFrame, one row per (time, device)."""
    return _session().samples()


def report() -> Any:
    """One row per monitored cell (and device), indexed by the cell's execution count."""
    return _session().report()


def status() -> Any:
    """What nbmem can and cannot see, and why."""
    return _session().status()


def plot() -> Any:
    """A matplotlib Figure of memory over time per device, monitored cells shaded with their peaks."""
    from .plotting import plot as _plot

    return _plot(_session())


def __getattr__(name: str) -> Any:
    if name == "Gauge":
        from .widget import Gauge

        return Gauge
    raise AttributeError(f"module 'nbmem' has no attribute {name!r}")
