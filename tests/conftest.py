"""Shared fixtures: a real IPython shell, and a guard that nbmem leaves nothing behind."""

from __future__ import annotations

import atexit
import gc
import os
import tempfile
import threading

import pytest

# A private IPython profile dir and no history database, before IPython is imported anywhere.
os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="nbmem-ipython-"))
# Flight-recorder capsules (nbmem/flight.py) go to a private runtime dir, not the user's.
os.environ.setdefault("JUPYTER_RUNTIME_DIR", tempfile.mkdtemp(prefix="nbmem-runtime-"))

from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config


def _nvml_gpus() -> int:
    """GPUs this process may use: NVML's count (asked without CUDA, so no context is made), cut to
    ``CUDA_VISIBLE_DEVICES`` where it is set, as CUDA cuts it (at the first entry that names no GPU), so that
    the two-GPU tests skip in a process given one GPU of two."""
    try:
        import pynvml

        pynvml.nvmlInit()
        count = int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return count
    usable = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or (entry.lstrip("-").isdigit() and not 0 <= int(entry) < count):
            break
        usable += 1
    return min(count, usable)


HAS_GPU = _nvml_gpus() > 0
cpu_only = pytest.mark.skipif(HAS_GPU, reason="checks the layout of a machine without a GPU")


def nbmem_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("nbmem")]


def nbmem_callbacks(sh: InteractiveShell) -> list[object]:
    out = []
    for cbs in sh.events.callbacks.values():
        out += [cb for cb in cbs if "nbmem" in (getattr(cb, "__module__", "") or "")]
    return out


def nbmem_gc_callbacks() -> list[object]:
    return [cb for cb in gc.callbacks if "nbmem" in (getattr(cb, "__module__", "") or "")]


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    """After every test: no nbmem thread runs (the sampler is joined on unload), and no collector callback of
    nbmem's stays with the interpreter."""
    yield
    for t in nbmem_threads():
        t.join(2)
    assert not nbmem_threads(), f"nbmem threads left running: {nbmem_threads()}"
    assert not nbmem_gc_callbacks(), f"nbmem's gc callbacks left installed: {nbmem_gc_callbacks()}"


def new_shell(gauge: str | None = "none") -> InteractiveShell:
    """A fresh plain InteractiveShell (no kernel, no front end), its history in memory; ``gauge`` None: nbmem's
    own default for the gauge setting."""
    InteractiveShell.clear_instance()
    cfg = Config()
    cfg.HistoryManager.hist_file = ":memory:"
    if gauge is not None:
        cfg.Nbmem.gauge = gauge
    cfg.InteractiveShell.colors = "nocolor"
    return InteractiveShell.instance(config=cfg)


@pytest.fixture
def shell():
    """A fresh plain InteractiveShell (no kernel, no front end); nbmem unloaded and checked at the end."""
    sh = new_shell()
    yield sh
    sh.run_line_magic("unload_ext", "nbmem")
    assert not nbmem_callbacks(sh), f"nbmem callbacks left registered: {nbmem_callbacks(sh)}"
    assert "cudamem" not in sh.magics_manager.magics["line"]
    InteractiveShell.clear_instance()
    # IPython registers each shell's atexit_operations, which at exit resets its namespace and runs gc.collect()
    # (displayhook.flush): once per test's shell, all of them kept alive until then. That was pytest's 78 s at
    # 100 % CPU after its summary (issue 38). The shell goes now, with the test.
    atexit.unregister(sh.atexit_operations)


@pytest.fixture
def ip(shell):
    """The shell with nbmem loaded and every cell monitored."""
    ok(shell, "%load_ext nbmem")
    ok(shell, "%cudamem on")
    ok(shell, "import torch")
    return shell


def run(sh: InteractiveShell, src: str):
    """Run a cell as a notebook would (stored in history, so it has an execution count)."""
    return sh.run_cell(src, store_history=True)


def ok(sh: InteractiveShell, src: str):
    r = run(sh, src)
    assert r.success, f"cell failed: {src!r}: {r.error_before_exec or r.error_in_exec!r}"
    return r


def last_cell(sh: InteractiveShell) -> int:
    return sh.execution_count - 1
