"""A fit on a machine without CUDA, for the tests that watch its progress line where a person sees it: a real
Jupyter kernel in JupyterLab, and a real terminal IPython.

Everything but CUDA is real: the ``%%cudamem --fit`` magic, the session, the fit's runner, the progress line and
the adapter's way of drawing it, and the cell's body, which runs once per run and takes as long as it takes (a
body that sleeps makes a fit you can watch). Only CUDA is stood in for, as ``tests/test_fit_remedies.py`` does on
the CPU: ``torch.cuda`` says it is there, each run's allocator trace is made up from the value
(``PER_VALUE_BYTES`` a unit, allocated and freed), and the allocator's readings are ``FakeSource``'s (1 GiB
free). ``install()`` puts the stand-in in place in the process that runs the fit (a notebook cell calls it).
"""

from __future__ import annotations

import itertools
from typing import Any

from nbmem.fitting.analysis.model import RunTrace
from nbmem.fitting.runs import notebook, runner, torchcheck
from nbmem.fitting.runs.multigpu import RunSet
from tests.test_fit_remedies import FakeSource, FakeTorch

#: What a unit of the value allocates in a run's made-up trace: 1 GiB holds about 16 of them.
PER_VALUE_BYTES = 64 << 20

_addresses = itertools.count(1)


def _one_run(run: Any, value: int, counted: bool, src: Any, devs: list[int], stacks: bool,
             max_entries: int) -> tuple[RunSet, str]:
    """The body run once, for real; its trace as the allocator would have recorded a body of that size."""
    run(value)
    addr = next(_addresses) << 32
    entries = [{"action": "alloc", "addr": addr, "size": value * PER_VALUE_BYTES},
               {"action": "free_requested", "addr": addr, "size": value * PER_VALUE_BYTES}]
    return RunSet.single(RunTrace(value, entries, counted, 0, 0)), ""


def install() -> None:
    """CUDA stood in for in this process's fits, from now on."""
    fit = notebook.fit

    def fit_on_stand_in(*args: Any, **kwargs: Any) -> Any:
        return fit(*args, **{**kwargs, "source": FakeSource()})

    runner._torch = FakeTorch
    torchcheck._torch = FakeTorch
    runner._one_run = _one_run  # type: ignore[assignment]
    notebook.fit = fit_on_stand_in
