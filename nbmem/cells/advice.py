"""What to tell a user whose cell failed on the GPU (out of memory, or CUDA broken for good), or whose cell made
a second copy of state an earlier cell made and still holds.

Pure functions over a cell's records, its replayed trace and the exception; they return lines of text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from nbmem.formatting import fmt_bytes, fmt_times
from nbmem.records import Boundary, CellRecord, Finding, cleanup_text, merge_cleanups
from nbmem.trace.linetrace import Replay, line_of_exception

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


_ASKED = re.compile(r"tried to allocate ([\d.]+) ?(B|KiB|MiB|GiB|TiB)", re.I)
_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def requested_bytes(error: BaseException) -> int | None:
    """The bytes an out-of-memory error says were asked for ("Tried to allocate 2.00 GiB"), or None."""
    m = _ASKED.search(str(error))
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()]) if m else None


def fragmentation(records: Sequence[CellRecord], asked: int | None, largest_free: Mapping[str, int]) -> list[str]:
    """Lines for devices where the cache had room for the request in total but not in one block."""
    out = []
    for r in records:
        free_block = largest_free.get(r.device)
        if asked is None or free_block is None or r.reserved_after_bytes is None or r.allocated_after_bytes is None:
            continue
        cached = r.reserved_after_bytes - r.allocated_after_bytes
        if cached >= asked > free_block:
            out.append(f"{r.device}: fragmentation: {fmt_bytes(cached)} reserved but unallocated, yet its largest "
                       f"free block is {fmt_bytes(free_block)} and {fmt_bytes(asked)} was asked for; "
                       f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before CUDA starts) lets blocks grow "
                       f"into one another, or `torch.cuda.empty_cache()` between phases")
    return out


#: The headroom line shows when a cell's transient growth took more than this share of the room it had ...
HEADROOM_SHARE = 0.25
#: ... or when what it kept would fill the rest of the device within this many more cells like it.
HEADROOM_CELLS = 3


def headroom(records: Sequence[CellRecord], after: Boundary, threshold_bytes: int) -> list[str]:
    """How much room a GPU cell left, only where the memory left is at stake: its peak took more than a quarter
    of the room this process had ("room for ~2.4× this cell's growth"), or what it kept would fill the device
    within a few more cells like it. Free for this process: what its allocator holds plus what the device has
    free (other processes and the CUDA context are not this process's to take)."""
    out = []
    for r in records:
        nv = after.nvml.get(r.device)
        if (not r.device.startswith("cuda") or nv is None or nv.used_bytes is None or nv.total_bytes is None
                or r.peak_allocated_bytes is None or r.allocated_before_bytes is None
                or r.reserved_after_bytes is None or r.allocated_after_bytes is None):
            continue
        growth = r.peak_allocated_bytes - r.allocated_before_bytes
        if growth < max(threshold_bytes, 1):
            continue
        capacity = r.reserved_after_bytes + (nv.total_bytes - nv.used_bytes)
        room = capacity - r.allocated_before_bytes
        kept = r.allocated_after_bytes - r.allocated_before_bytes
        cells_left = (capacity - r.allocated_after_bytes) / kept if kept >= max(threshold_bytes, 1) else None
        head = f"{r.device}: peak {fmt_bytes(r.peak_allocated_bytes)} of {fmt_bytes(capacity)} free for this process"
        if cells_left is not None and cells_left <= HEADROOM_CELLS:
            n = max(int(cells_left), 0)
            more = "no more cells like this one fit" if n == 0 else (
                f"about {n} more cell{'s' if n != 1 else ''} like this one fit")
            out.append(f"{head}: it kept {fmt_bytes(kept)}, so {more} before the device is full")
        elif growth > room * HEADROOM_SHARE:
            out.append(f"{head}: room for {fmt_times(room / growth)} this cell's growth")
    return out


def oom_advice(records: Sequence[CellRecord], error: BaseException, *, source: str, lines_recorded: bool,
               replays: Mapping[str, Replay], cell_files: frozenset[str], names: Mapping[str, str],
               largest_free: Mapping[str, int] | None = None) -> tuple[str, ...]:
    """Which line asked, what was live by line, what is cached but free (fragmentation when it is the cause),
    and the usual remedies."""
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
        out.append("`%%cudamem --lines` on this cell shows which line allocated what was live")
    fragmented = fragmentation(records, requested_bytes(error), largest_free or {})
    for r in records:
        if r.reserved_after_bytes is not None and r.allocated_after_bytes is not None:
            cached = r.reserved_after_bytes - r.allocated_after_bytes
            out.append(f"{r.device}: allocated {fmt_bytes(r.allocated_after_bytes)}, reserved "
                       f"{fmt_bytes(r.reserved_after_bytes)} ({fmt_bytes(cached)} cached but free)")
    return (*out, *fragmented, *OOM_ADVICE)


def _recipe(f: Finding) -> str:
    """What state is, in words that two copies of one recipe share: its type and size (``Sequential: 2.1M
    parameters``), without what changes as it trains (gradients, optimizer state)."""
    return f.description.partition(",")[0]


def second_copies(cell: int, made: Sequence[Finding], held: Sequence[Finding]) -> list[str]:
    """For each piece of state this cell made (``made``) that is like state an earlier cell made and that is still
    held (``held``: every owner now): a line with that one's bytes, its holders and what deletes it."""
    earlier = [f for f in held if f.state and f.cell < cell and f.description]
    out = []
    for f in made:
        if not f.state or f.cell != cell or not f.description:
            continue
        for e in earlier:
            if e.name == f.name or _recipe(e) != _recipe(f):
                continue
            # What else keeps that copy's training going: state rows of the names that also hold it (a trainer's
            # optimizer state).
            also = [g for g in earlier if g is not e and g.name in e.roots]
            total = e.bytes + sum(g.bytes for g in also)
            holders = ", ".join(f"`{n}`" for n in e.roots)
            more = "".join(f"; `{g.name}` holds {g.description.partition(': ')[2] or g.state}, {fmt_bytes(g.bytes)}"
                           for g in also)
            out.append(f"`{f.name}` is a second {_recipe(f)}: the one cell [{e.cell}] made is still held, "
                       f"{fmt_bytes(e.bytes)} by {holders}{more}. If you no longer need it, "
                       f"`{cleanup_text(merge_cleanups([e, *also]))}` deletes it ({fmt_bytes(total)})")
    return out
