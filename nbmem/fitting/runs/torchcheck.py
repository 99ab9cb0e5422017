"""What this process's torch allows a fit: whether it can run at all (``refusal``), which errors are CUDA's
out-of-memory, and how many graphs torch.compile has made (a run that compiled paid a one-time cost). Reads
``sys.modules`` only: nothing here imports torch or its compiler.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def _torch() -> Any:
    return sys.modules.get("torch")


def graphs_compiled() -> int:
    """How many graphs torch.compile has made in this process (dynamo's own counter; 0 where dynamo is not
    loaded: it is never imported here). A run during which it moves paid for a compile, a one-time cost."""
    utils = sys.modules.get("torch._dynamo.utils")
    try:
        return int(getattr(utils, "counters", {}).get("stats", {}).get("unique_graphs", 0))
    except Exception:
        return 0


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


def expandable_on() -> bool:
    """Whether this process's caching allocator was started with expandable segments (the settings torch read)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
    return "expandable_segments:true" in conf.replace(" ", "").lower()


__all__ = ["expandable_on", "graphs_compiled", "is_out_of_memory", "refusal"]
