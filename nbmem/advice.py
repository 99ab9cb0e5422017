"""What to tell a user whose cell failed on the GPU: out of memory, or CUDA broken for good.

Pure functions over a cell's records, its replayed trace and the exception; they return lines of text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .formatting import fmt_bytes
from .linetrace import Replay, line_of_exception
from .records import CellRecord

OOM_ADVICE = (
    "evaluate under torch.no_grad() (or torch.inference_mode()): no activations are kept for backward",
    "optimizer.zero_grad(set_to_none=True) frees gradients between steps",
    "a smaller batch, with gradient accumulation to keep the effective batch size",
    "mixed precision: torch.autocast(device_type='cuda', dtype=torch.bfloat16)",
    "activation checkpointing (torch.utils.checkpoint) trades compute for memory",
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before CUDA starts) reduces fragmentation",
)
RESTART_ADVICE = ("CUDA is in an error state (a device-side assert or an illegal access) and stays so for the "
                  "life of this process: restart the kernel. Cleanup cannot free GPU memory now.")
_CUDA_BROKEN = ("device-side assert", "illegal memory access", "unspecified launch failure",
                "cuda error: misaligned address")


def is_oom(error: BaseException | None) -> bool:
    return error is not None and (type(error).__name__ == "OutOfMemoryError" or "out of memory" in f"{error}".lower())


def breaks_cuda(error: BaseException | None) -> bool:
    """Whether the error leaves CUDA unusable for the rest of the process."""
    if error is None:
        return False
    text = f"{type(error).__name__}: {error}".lower()
    return any(s in text for s in _CUDA_BROKEN)


def oom_advice(records: Sequence[CellRecord], error: BaseException, *, source: str, lines_recorded: bool,
               replays: Mapping[str, Replay], cell_files: frozenset[str], names: Mapping[str, str]) -> tuple[str, ...]:
    """Which line asked, what was live by line, what is cached but free, and the usual remedies."""
    out = []
    line, user = line_of_exception(error, cell_files, names)
    src = source.splitlines()
    where = f"line {line}: {src[line - 1].strip()}" if line and line <= len(src) else "this cell"
    out.append(f"the allocation that failed was asked for by {where}" + (f" (in {user})" if user else ""))
    for dev, rp in replays.items():
        if rp.oom is not None and any(ln is not None for ln, _b in rp.oom.live_by_line):
            live = ", ".join(f"{'before this cell' if ln is None else f'line {ln}'}: {fmt_bytes(b)}"
                             for ln, b in rp.oom.live_by_line[:4])
            out.append(f"{dev}: live when it failed, by the line that allocated it: {live}")
    if not lines_recorded:
        out.append("%%cudamem --lines on this cell shows which line allocated what was live")
    for r in records:
        if r.reserved_after_bytes is not None and r.allocated_after_bytes is not None:
            cached = r.reserved_after_bytes - r.allocated_after_bytes
            out.append(f"{r.device}: allocated {fmt_bytes(r.allocated_after_bytes)}, reserved "
                       f"{fmt_bytes(r.reserved_after_bytes)} ({fmt_bytes(cached)} cached but free: "
                       f"fragmentation if large)")
    return (*out, *OOM_ADVICE)
