"""Who started whom: this notebook's child processes on a GPU, told apart from everyone else's.

One rule, ``lineage_of`` (a PID and its ancestors; ``lineages`` for many at once), answers it for this kernel
(``sources``: the GPU processes it started, through ``torch.multiprocessing``, ``accelerate.notebook_launcher``
or DataLoader workers) and for every kernel of a Jupyter server (``server``). Everything here only reads the process
table through psutil and ``/proc``: no process is signalled, waited for or changed.

A PID NVML lists that does not exist here is the sign of a container without the host's PID namespace:
then which process is whose cannot be known, and ``split_children`` says so instead of guessing.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

import psutil

from nbmem.formatting import fmt_bytes
from nbmem.records import Boundary, ChildProcess, ChildrenUse, GpuProcess, Sample

#: How much of a child's command line is kept: enough to recognise it, never a page of arguments.
COMMAND_CHARS = 300
#: How long a PID keeps what was read about it (name, ancestry, command line): psutil costs milliseconds
#: per process, and a PID keeps them while it lives.
TTL_S = 60.0
_NAMES: dict[int, tuple[float, str]] = {}


def exists_here(pid: int) -> bool:
    """Whether the PID names a process in this PID namespace, even one that /proc hides (``hidepid``)."""
    if os.name != "posix":
        return bool(psutil.pid_exists(pid))
    try:
        os.kill(pid, 0)  # signal 0 sends nothing: it only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def lineage_of(pid: int) -> tuple[int, ...] | None:
    """The PID and its ancestors, nearest first; None when no such process exists in this PID namespace."""
    if pid <= 0:  # not a process (psutil would count the kernel's swapper, PID 0, as one)
        return None
    try:
        return (pid, *(a.pid for a in psutil.Process(pid).parents()))
    except psutil.NoSuchProcess:
        # Another user's process under hidepid looks gone to /proc: it exists, and is none of ours.
        return (pid,) if exists_here(pid) else None
    except psutil.Error:  # it exists, but its parents cannot be read
        return (pid,)


def lineages(pids: Iterable[int]) -> dict[int, tuple[int, ...] | None]:
    """``lineage_of`` for many PIDs at once, each process's parent read once: a server's kernels share their
    ancestors (the server, its shell, init), which ``lineage_of`` would read again for every kernel."""
    parent: dict[int, int | None] = {}  # a process -> its parent (None: it has none, or it is gone)

    def parent_of(pid: int) -> int | None:
        if pid not in parent:
            got = psutil.Process(pid).parent()
            parent[pid] = None if got is None else got.pid
        return parent[pid]

    out: dict[int, tuple[int, ...] | None] = {}
    for pid in pids:
        if pid in out:
            continue
        if pid <= 0:
            out[pid] = None
            continue
        try:
            up = parent_of(pid)
        except psutil.NoSuchProcess:
            out[pid] = (pid,) if exists_here(pid) else None
            continue
        except psutil.Error:
            out[pid] = (pid,)
            continue
        chain = [pid]
        while up is not None and up not in chain:
            chain.append(up)
            try:
                up = parent_of(up)
            except psutil.Error:  # an ancestor gone or unreadable: the chain ends there, as psutil's does
                parent[chain[-1]] = None
                up = None
        out[pid] = tuple(chain)
    return out


def name_of(pid: int) -> str:
    """What a GPU process is, in a few words: its program, or the notebook of a Jupyter kernel; "?" when this
    namespace cannot see it. Remembered for ``TTL_S``."""
    now = time.monotonic()
    hit = _NAMES.get(pid)
    if hit is not None and now - hit[0] < TTL_S:
        return hit[1]
    if len(_NAMES) > 4096:
        _NAMES.clear()
    name = _read_name(pid)
    _NAMES[pid] = (now, name)
    return name


def _read_name(pid: int) -> str:
    try:
        p = psutil.Process(pid)
        cmd = " ".join(p.cmdline())
        if "ipykernel" not in cmd:
            return str(p.name())
        try:  # Jupyter's server tells each kernel its notebook's path; readable for our own user only
            notebook = p.environ().get("JPY_SESSION_NAME", "")
        except Exception:
            notebook = ""
        return f"Jupyter kernel ({notebook})" if notebook else f"Jupyter kernel ({p.name()})"
    except Exception:  # PIDs from the host are not visible inside a container
        return "?"


def alive(pid: int) -> bool:
    """Whether the process runs still: it exists and is not a zombie (ended, not yet reaped by its parent)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def command_of(pid: int) -> str:
    """The process's command line (cut to ``COMMAND_CHARS``), or "" when it cannot be read."""
    try:
        cmd = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""
    return cmd if len(cmd) <= COMMAND_CHARS else cmd[:COMMAND_CHARS - 1] + "…"


def started_at(pid: int) -> float | None:
    """When the process started (epoch seconds), or None when it cannot be read."""
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def has_children(pid: int | None = None) -> bool:
    """Whether the process has a child now. On Linux each thread's ``/proc/…/task/<tid>/children`` (tens
    of microseconds); elsewhere, or where the kernel lacks those files, psutil's walk of every process."""
    pid = os.getpid() if pid is None else pid
    files = glob.glob(f"/proc/{pid}/task/*/children")
    if files:
        for f in files:
            try:
                with open(f) as fh:
                    if fh.read().strip():
                        return True
            except OSError:  # a thread that ended meanwhile
                continue
        return False
    try:
        return bool(psutil.Process(pid).children())
    except psutil.Error:
        return False


@dataclass(frozen=True, slots=True)
class Split:
    """One GPU's process list split three ways: this process, its descendants, everyone else.

    ``unknown`` says why the descendants could not be told apart (then ``children`` is empty and
    ``others`` holds every process but this one, as before there was a split).
    """

    children: tuple[GpuProcess, ...]
    others: tuple[GpuProcess, ...]
    unknown: str | None = None


def split_children(procs: Iterable[GpuProcess], me: int, lineage: Mapping[int, tuple[int, ...] | None], *,
                   pids_match: bool) -> Split:
    """Which listed processes descend from ``me``.

    ``lineage`` maps each listed PID to itself and its ancestors (``lineage_of``). ``pids_match`` says NVML's
    PIDs are known to be this namespace's (it lists ``me``): a listed PID that does not exist here then
    just exited. Otherwise such a PID means NVML speaks of the host's PIDs, and nothing can be matched.
    """
    listed = [p for p in procs if p.pid != me]
    if not pids_match and any(lineage.get(p.pid) is None for p in listed):
        return Split((), tuple(listed), "NVML lists processes whose PIDs do not exist here (a container without "
                                        "host PIDs): this notebook's child processes cannot be told from others")
    children = tuple(p for p in listed if me in (lineage.get(p.pid) or ())[1:])
    return Split(children, tuple(p for p in listed if p not in children))


class Descendants:
    """Splits each GPU's process list into this process, its descendants and the rest, for ``NvmlSource``.

    A PID's ancestry and command line are read once per ``TTL_S``; a child that has ended is dropped even
    where a cached list still has it.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._known: dict[int, tuple[float, tuple[int, ...] | None, str, float | None]] = {}
        self._unknown: dict[str, str] = {}  # device -> why its children cannot be told apart

    @property
    def reason(self) -> str | None:
        """Why a device's children cannot be told from other processes, where they cannot."""
        return next(iter(self._unknown.values()), None)

    def split(self, device: str, procs: Iterable[GpuProcess], me: int, *, pids_match: bool) -> Split:
        procs = tuple(procs)
        found = split_children(procs, me, {p.pid: self._read(p.pid)[1] for p in procs if p.pid != me},
                               pids_match=pids_match)
        if found.unknown:
            self._unknown[device] = found.unknown
            return found
        self._unknown.pop(device, None)
        # A cached list outlives the processes in it by up to a second: one that ended holds nothing now.
        out = []
        for p in found.children:
            if not alive(p.pid):
                continue
            t, chain, command, started = self._read(p.pid)
            if not command:
                command, started = command_of(p.pid), started_at(p.pid)
                self._known[p.pid] = (t, chain, command, started)
            out.append(replace(p, command=command, started_wall=started))
        return replace(found, children=tuple(out))

    def _read(self, pid: int) -> tuple[float, tuple[int, ...] | None, str, float | None]:
        now = self._clock()
        hit = self._known.get(pid)
        if hit is None or now - hit[0] >= TTL_S:
            if len(self._known) > 4096:
                self._known.clear()
            hit = (now, lineage_of(pid), "", None)
            self._known[pid] = hit
        return hit


def known_total(procs: Iterable[GpuProcess]) -> int | None:
    """The processes' bytes together; None when NVML gave no figure for one of them (MIG, WDDM)."""
    sizes = [p.used_bytes for p in procs]
    return None if any(s is None for s in sizes) else sum(s or 0 for s in sizes)


# -- what a cell's report says about them (pure) -------------------------------------------------------------
def children_use(before: Boundary, after: Boundary, samples: Iterable[Sample], *,
                 threshold_bytes: int) -> tuple[ChildrenUse, ...]:
    """Per GPU where this notebook's child processes' memory moved by ``threshold_bytes`` while a cell ran (at
    its end, or at any reading between: the sampler's): what they held at the end, and the most at any reading.
    Children that held the same all along are no news of this cell."""
    start = {d: g.children_bytes or 0 for d, g in before.nvml.items()}
    peaks: dict[str, int] = {}
    # The PIDs come from both ends and every reading between: children that started and ended inside the cell
    # (accelerate's notebook_launcher waits for its ranks) are gone at its end, and one the cell stopped
    # (os.kill, as a report advises) was there only at its start. Each holds a CUDA context, so there are few.
    pids: dict[str, set[int]] = {d: {p.pid for p in g.children if p.used_bytes} for d, g in before.nvml.items()}
    for dev, value, kids in [*((s.device, s.children_used_bytes, s.children) for s in samples),
                             *((d, g.children_bytes, g.children) for d, g in after.nvml.items())]:
        if value is not None:
            peaks[dev] = max(peaks.get(dev, start.get(dev, 0)), value)
        pids.setdefault(dev, set()).update(p.pid for p in kids if p.used_bytes)
    out = []
    for dev, peak in sorted(peaks.items()):
        end = after.nvml[dev].children_bytes if dev in after.nvml else None
        moved = max(peak - start.get(dev, 0), abs((end or 0) - start.get(dev, 0)) if end is not None else 0)
        if peak and moved >= threshold_bytes:
            out.append(ChildrenUse(dev, end, peak, tuple(sorted(pids.get(dev, ())))))
    return tuple(out)


#: A child process as reports remember it: its GPU, PID and start time (a PID can be reused).
ChildKey = tuple[str, int, float | None]


def on_gpus(after: Boundary) -> frozenset[ChildKey]:
    """Every child process on a GPU at a boundary, as a key."""
    return frozenset((dev, p.pid, p.started_wall) for dev, g in after.nvml.items() for p in g.children)


def left_running(after: Boundary, named: frozenset[ChildKey]) -> tuple[ChildProcess, ...]:
    """The child processes alive with memory on a GPU at a cell's end that were not there at the end of the
    last measured cell (``named``: its ``on_gpus``). Largest first."""
    out = [ChildProcess(dev, p.pid, p.used_bytes, p.command or p.name, p.started_wall)
           for dev, g in after.nvml.items() for p in g.children
           if (dev, p.pid, p.started_wall) not in named and p.used_bytes != 0]
    return tuple(sorted(out, key=lambda c: (-(c.used_bytes or 0), c.device, c.pid)))


def child_lines(samples: Iterable[Sample]) -> tuple[str, ...]:
    """This notebook's child processes on each GPU of one sampler tick, a line each (``%cudamem status``)."""
    return tuple(f"{smp.device}: PID {c.pid} holds {fmt_bytes(c.used_bytes)} (`{c.command or c.name}`)"
                 for smp in samples for c in smp.children)
