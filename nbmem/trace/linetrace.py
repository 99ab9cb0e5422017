"""Which line: a cell's allocations and frees, replayed from the CUDA caching allocator's event trace.

Pure analysis over the entries of ``torch.cuda.memory._snapshot()["device_traces"][i]`` (dicts with
``action``, ``addr``, ``size``, ``time_us`` and, when stacks were recorded, ``frames``), recorded only
while one cell ran. Replaying them from the allocated bytes at the cell's start gives the cell's exact
peak without the allocator's global peak counter, and, with stacks, the line of the cell each event
came from: what each line left allocated, its peak, and the user frame that allocated the largest
blocks live at that peak.

Trace sizes are the bytes asked for; ``memory_allocated()`` counts blocks. ``block_bytes`` rounds as
the allocator does by default (512-byte blocks); the replay is called exact only when it ends where
the allocator's own counter does, so a block the allocator did not split (or a rounding setting this
module does not model) shows as "≈" with the difference, never as a wrong exact number.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nbmem.formatting import fmt_bytes
from nbmem.measure import libraries
from nbmem.records import LineRecord, block_bytes


@dataclass(frozen=True, slots=True)
class Oom:
    """A CUDA out-of-memory inside the cell: where, and what was live then, by line."""

    line: int | None
    requested_bytes: int
    device_free_bytes: int | None
    stack: tuple[str, ...]  # innermost first, "file:line in function"
    live_by_line: tuple[tuple[int | None, int], ...]  # (cell line, live bytes), largest first


@dataclass(frozen=True, slots=True)
class Replay:
    """One device's events of one cell, replayed."""

    device: str
    peak_bytes: int
    exact: bool
    difference_bytes: int  # where the replay ended minus the allocator's counter (0 when exact)
    events: int
    peak_line: int | None
    lines: tuple[LineRecord, ...]
    alloc_line: Mapping[int, int]  # address -> the cell line that last allocated there
    oom: Oom | None

    def note(self) -> str:
        if self.exact:
            return ""
        d = self.difference_bytes
        off = (f"it missed {fmt_bytes(-d)} the allocator counted" if d < 0 else
               f"it has {fmt_bytes(d)} the allocator did not count")
        return f"≈ from the allocator's trace ({off})"


def _frame_text(f: Mapping[str, Any], names: Mapping[str, str] | None = None) -> str:
    file = str(f.get("filename", "?"))
    return f"{(names or {}).get(file, file)}:{f.get('line', '?')} in {f.get('name', '?')}"


def _is_cell_frame(f: Mapping[str, Any], cell_files: frozenset[str]) -> bool:
    """The cell's own module-level code (not a function the cell defines)."""
    return f.get("name") == "<module>" and f.get("filename") in cell_files


def cell_line(frames: Sequence[Mapping[str, Any]], cell_files: frozenset[str]) -> int | None:
    """The line of the cell's own code in a stack (innermost first).

    The innermost module-level frame of the cell: a ``%%cudamem`` cell's outer frame (the magic call,
    line 1) is compiled under the same cell number, further out.
    """
    for f in frames:
        if _is_cell_frame(f, cell_files):
            return int(f.get("line", 0)) or None
    return None


def deepest_user_frame(frames: Sequence[Mapping[str, Any]], cell_files: frozenset[str] = frozenset(),
                       names: Mapping[str, str] | None = None) -> str:
    """The innermost frame of the user's own code, unless it is the cell's line itself (shown anyway)."""
    for f in frames:
        if libraries.is_user_file(str(f.get("filename", ""))):
            if _is_cell_frame(f, cell_files):
                return ""
            return _frame_text(f, names)
    return ""


class _CellLines:
    """``cell_line`` for every event of one recording, in constant time per event.

    Every event of the cell's own thread has the same frames outside the cell's body (IPython's, then the
    cell's module frame), so the body's frame sits at the same distance from the outer end of each stack.
    That distance is learnt from full searches (the largest seen: a ``%%cudamem`` magic's own frame is
    further out than its body's) and tried first; a stack without a cell frame there is searched in full.
    """

    def __init__(self, cell_files: frozenset[str]) -> None:
        self.files = cell_files
        self.from_end = 0

    def __call__(self, frames: Sequence[Mapping[str, Any]]) -> int | None:
        k = self.from_end
        if k and len(frames) >= k and _is_cell_frame(frames[-k], self.files):
            return int(frames[-k].get("line", 0)) or None
        for i, f in enumerate(frames):  # innermost first: the first cell frame is the body's
            if _is_cell_frame(f, self.files):
                self.from_end = max(k, len(frames) - i)
                return int(f.get("line", 0)) or None
        return None


#: The frames of an event after the line clock stopped marking (``LineClock.max_marks``): no line is known.
NO_LINE: list[dict[str, Any]] = [{"filename": "", "line": 0, "name": "<no line: marks ran out>"}]


def with_marked_frames(entries: Sequence[dict[str, Any]], marks: Sequence[tuple[int, Any, int]],
                       until_us: int | None = None) -> None:
    """Give each event the user's stack at its ``time_us``, rebuilt from a ``LineClock``'s marks.

    The marks say when each line of the user's code began and when its code returned; replayed in time
    order beside the events, they give the stack of user frames (innermost first, as the allocator's own
    ``frames``) that was running when each event happened. Library frames are not in it, as they are not
    the user's. A recursive call of the same function reads as a return to it (its depth is not kept).
    Events after ``until_us`` (when the clock stopped marking) get ``NO_LINE``.
    """
    stack: list[list[Any]] = []  # [code, line], outermost first
    frames: list[dict[str, Any]] = []
    j, n = 0, len(marks)
    for e in entries:
        t = e.get("time_us", 0)
        if until_us is not None and t > until_us:
            e["frames"] = NO_LINE
            continue
        if j < n and marks[j][0] <= t:
            while j < n and marks[j][0] <= t:
                _, code, line = marks[j]
                j += 1
                if line >= 0 and stack and stack[-1][0] is code:
                    stack[-1][1] = line
                    continue
                i = len(stack) - 1
                while i >= 0 and stack[i][0] is not code:
                    i -= 1
                if line >= 0:
                    if i >= 0:  # back in a caller whose callee left without a mark
                        del stack[i + 1:]
                        stack[i][1] = line
                    else:
                        stack.append([code, line])
                elif i >= 0:
                    del stack[i:]
            frames = [{"filename": c.co_filename, "line": ln, "name": c.co_name} for c, ln in reversed(stack)]
        e["frames"] = frames


def replay(entries: Iterable[Mapping[str, Any]], *, device: str, cell: int, start_allocated: int,
           end_allocated: int, cell_files: frozenset[str] = frozenset(), since_us: int | None = None,
           sources: Mapping[int, str] | None = None, names: Mapping[str, str] | None = None) -> Replay:
    """Replay one device's trace entries of one cell from its allocated bytes at the start.

    ``since_us`` drops entries older than the cell (a trace the user was recording anyway). Events
    without a cell frame (autograd's backward threads, other threads) belong to the line that ran last.
    ``names`` shows cells' file names as people know them (``In[3]``).

    This runs after every traced cell over all its events (tens of thousands for a training loop), on
    the user's time, so the loop does a few lookups per event: the cell line only when the stack changed
    (and then in constant time, ``_CellLines``), and each line's top block is found once, afterwards, from
    the blocks' lifetimes at that line's peak.
    """
    level = start_allocated
    peak = level
    peak_line: int | None = None
    blocks: list[list[Any]] = []  # [bytes, line, frames, allocated at event i, freed at event i or None]
    live: dict[int, int] = {}  # addr -> index into blocks
    per: dict[int | None, list[int]] = {}  # line -> [delta bytes, peak bytes, events, the event of its peak]
    alloc_line: dict[int, int] = {}
    current: int | None = None
    line_of = _CellLines(cell_files)
    stat = per[None] = [0, 0, 0, -1]
    seen_frames: Any = None
    n = 0
    oom: Oom | None = None
    for i, e in enumerate(entries):
        action = e.get("action")
        if action != "alloc" and action != "free_requested" and action != "oom":
            continue  # segment and completion events change reserved memory, not allocated
        if since_us is not None and e.get("time_us", since_us) < since_us:
            continue
        frames = e.get("frames")
        if frames and frames is not seen_frames:  # events placed by time share one stack until it changes
            seen_frames = frames
            if frames is NO_LINE:
                current, stat = None, per[None]
            else:
                ln = line_of(frames)
                if ln is not None and ln != current:
                    current = ln
                    stat = per.get(ln) or per.setdefault(ln, [0, 0, 0, -1])
        if action == "alloc":
            b = block_bytes(e.get("size", 0))
            addr = e.get("addr", 0)
            level += b
            live[addr] = len(blocks)
            blocks.append([b, current, frames or (), i, None])
            if current is not None:
                alloc_line[addr] = current
            stat[0] += b
        elif action == "free_requested":
            k = live.pop(e.get("addr", 0), None)
            if k is None:
                b = block_bytes(e.get("size", 0))
            else:
                b = blocks[k][0]
                blocks[k][4] = i
            level -= b
            stat[0] -= b
        else:
            oom = _oom(e, frames or (), cell_files, [blocks[k] for k in live.values()], level, names)
            continue
        n += 1
        stat[2] += 1
        if level > stat[1]:
            stat[1] = level
            stat[3] = i
        if level > peak:
            peak, peak_line = level, current
    top = _top_frames(blocks, per, cell_files, names)
    diff = level - end_allocated
    lines = tuple(LineRecord(cell, device, ln, (sources or {}).get(ln, ""), s[0], s[1], s[2], top.get(ln, ""))
                  for ln, s in sorted(per.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
                  if ln is not None and s[2])
    return Replay(device, peak, diff == 0, diff, n, peak_line, lines, alloc_line, oom)


def _top_frames(blocks: Sequence[Sequence[Any]], per: Mapping[int | None, Sequence[int]], cell_files: frozenset[str],
                names: Mapping[str, str] | None) -> dict[int, str]:
    """Each line's "allocated at": the deepest user frame of the largest block the line allocated that was
    live at the line's peak (allocated at or before that event, not yet freed)."""
    best: dict[int, tuple[int, Any]] = {}
    for b, ln, frames, born, died in blocks:
        if ln is None:
            continue
        at = per[ln][3]
        if born <= at and (died is None or died > at) and b > best.get(ln, (0, None))[0]:
            best[ln] = (b, frames)
    return {ln: deepest_user_frame(frames, cell_files, names) for ln, (_b, frames) in best.items()}


def _oom(e: Mapping[str, Any], frames: Sequence[Mapping[str, Any]], cell_files: frozenset[str],
         live: Sequence[Sequence[Any]], level: int, names: Mapping[str, str] | None) -> Oom:
    """What was live when the allocation failed, by the cell line that allocated it (None: before the cell)."""
    by_line: dict[int | None, int] = {}
    for b, ln, *_ in live:
        by_line[ln] = by_line.get(ln, 0) + b
    by_line[None] = by_line.get(None, 0) + level - sum(blk[0] for blk in live)
    free = e.get("device_free")
    return Oom(cell_line(frames, cell_files), int(e.get("size", 0)), None if free is None else int(free),
               tuple(_frame_text(f, names) for f in frames),
               tuple(sorted(by_line.items(), key=lambda kv: -kv[1])))


def line_of_exception(exc: BaseException, cell_files: frozenset[str],
                      names: Mapping[str, str] | None = None) -> tuple[int | None, str]:
    """The cell line an exception came from, and the deepest frame of the user's own code it passed
    through ("" when that is the cell's line itself), as the lines table's "allocated at" names it."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        frames.append({"filename": code.co_filename, "line": tb.tb_lineno, "name": code.co_name})
        tb = tb.tb_next
    frames.reverse()
    return cell_line(frames, cell_files), deepest_user_frame(frames, cell_files, names)
