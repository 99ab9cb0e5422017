"""The records every layer shares: readings, samples, cell records, findings, cleanup reports.

Small frozen dataclasses with units in their field names. They hold numbers and names, never the
objects they describe, and render themselves (text for terminals, HTML for notebooks). ``None``
means unknown; it is shown as NA, never as 0.
"""

from __future__ import annotations

import datetime as _dt
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from nbmem.formatting import fmt_bytes

#: The device of a tensor over CUDA managed memory (a bitsandbytes paged optimizer's state): ``paged:cuda:0``.
#: It is not ``cuda:0``: PyTorch's allocator does not count it, so it is never set against the allocator's figures.
PAGED = "paged:"


class HolderKind(StrEnum):
    """What keeps a storage alive, which decides how it is freed (``cleanup_of``)."""

    NAMESPACE = "namespace"  # a variable of the notebook, or something inside one
    OUTPUT = "output"  # IPython's output history: Out[n], _n, _, __, ___, the last result
    TRACEBACK = "traceback"  # the frames of the last exception
    MODULE = "module"  # an attribute of a module the notebook made (in sys.modules)


@dataclass(frozen=True, slots=True)
class KindInfo:
    """Everything a holder kind means, in one place: how its paths rank, what frees it, and its words.

    The templates take ``{path}`` (the holder's path), ``{root}`` (its top-level name) and ``{module}`` (the
    module of a module attribute). The gauge reads ``label`` and ``no_del`` from the widget's model.
    """

    rank: int  # naming: a tensor is named by the path of the lowest rank first (a variable before an output)
    cleans: str  # what ``%cudamem clean`` does to free it: "names", "outputs", "traceback", or "" (nothing can)
    label: str  # its word beside a holder's device in the gauge ("" for a variable)
    holds: str  # in "also held by ...": how another holder of this kind is named
    kept: str  # the hint of a row this kind alone keeps
    still: str  # "... still holds it: what frees it", after a cleanup left it
    no_del: str  # why the gauge has no *del* for it, and what frees it instead


HOLDER_KINDS: dict[HolderKind, KindInfo] = {
    HolderKind.NAMESPACE: KindInfo(
        0, "names", "", "`{path}`", "`del {root}` frees it",
        "`{path}` still holds it: `%cudamem clean {root}` frees it", "no top-level name to delete"),
    HolderKind.MODULE: KindInfo(
        1, "", "module", "`{path}`", "an attribute of the module `{root}`: `del {path}` or set it to None",
        "`{path}` still holds it: set it to None to free it", "an attribute of module {module}: set it to None"),
    HolderKind.OUTPUT: KindInfo(
        2, "outputs", "output", "the output history ({path})",
        "kept by the output history{graph}: `%cudamem clean --outputs`, or end the line with `;`",
        "the output history still holds it (`{path}`): `%cudamem clean --outputs` frees it",
        "held by the output history: use “clear outputs”"),
    HolderKind.TRACEBACK: KindInfo(
        3, "traceback", "traceback", "the last exception's frames",
        "kept by the last exception's frames: `%cudamem clean --traceback` (ends `%debug` for it)",
        "the last exception's frames still hold it (`{path}`): `%cudamem clean --traceback` frees it "
        "(ends `%debug` for it)", "held by the last traceback: use “clear traceback”"),
}


def kind_words(kind: HolderKind, field: str, path: str, graph: str = "") -> str:
    """One of a kind's templates (``KindInfo``) filled in for ``path`` (``graph``: "(with its autograd graph, …)")."""
    head = path.split("[", 1)[0]
    module = head.rsplit(".", 1)[0] if "." in head else head
    return str(getattr(HOLDER_KINDS[kind], field)).format(path=path, root=root_name(path), module=module,
                                                          graph=graph)



#: The output names IPython moves on every displayed result; a change among them is no news.
ROTATING_OUTPUTS = ("_", "__", "___")
LAST_RESULT = "<last result>"
_OUTPUT_N = re.compile(r"_\d+\Z")
_INPUT_N = re.compile(r"_i+\d*\Z")


def is_output_name(name: str) -> bool:
    """IPython's output-cache names: ``_``, ``__``, ``___`` and ``_<n>``."""
    return name in ROTATING_OUTPUTS or bool(_OUTPUT_N.match(name))


def is_cache_name(name: str) -> bool:
    """Output- and input-cache names (``_i``, ``_ii``, ``_i12``): IPython's, not the user's."""
    return is_output_name(name) or bool(_INPUT_N.match(name))


def root_name(path: str) -> str:
    """The top-level name a holder path starts from (``losses[3]`` → ``losses``)."""
    return path.split(".", 1)[0].split("[", 1)[0]  # in C: every root's path is asked, every cell


# -- readings -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A process on a GPU, as NVML lists it; ``name`` is what the machine could tell about it."""

    pid: int
    used_bytes: int | None
    name: str
    command: str = ""  # a child of this notebook: its command line (others' are not read)
    started_wall: float | None = None  # a child: when it started (epoch seconds)


@dataclass(frozen=True, slots=True)
class GpuReading:
    """NVML's view of one visible device; ``None`` where NVML could not say."""

    used_bytes: int | None
    total_bytes: int | None
    process_used_bytes: int | None
    other_processes_bytes: int | None  # processes that are neither this one nor its descendants
    processes: tuple[GpuProcess, ...] = ()
    children_bytes: int | None = None  # this process's descendants (its child processes); None: unknown
    children: tuple[GpuProcess, ...] = ()


#: The CUDA caching allocator's block granularity: ``memory_allocated()`` counts whole blocks.
CUDA_BLOCK_BYTES = 512


def block_bytes(size: int) -> int:
    """The allocator's block for a request of ``size`` bytes (default settings: whole 512-byte blocks)."""
    return CUDA_BLOCK_BYTES if size < CUDA_BLOCK_BYTES else -(-size // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


@dataclass(frozen=True, slots=True)
class AllocatorReading:
    """The torch caching allocator's counters for one device."""

    allocated_bytes: int
    reserved_bytes: int
    active_bytes: int
    inactive_split_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    allocated_total_bytes: int = 0  # every byte ever allocated (cumulative; never reset by nbmem)
    allocations: int = 0  # every allocation ever made (cumulative)


@dataclass(frozen=True, slots=True)
class GpuDevice:
    """A CUDA device this process can see, with its NVML identity."""

    name: str  # "cuda:0" in this process's numbering
    nvml_index: int
    uuid: str
    model: str


#: The share of the limit at which the gauge warns and a cell's report says what grew.
WARN_SHARE = 0.9


@dataclass(frozen=True, slots=True)
class MemoryLimit:
    """The memory limit read for this process; ``limit_bytes`` None and no reason: no limit is set."""

    limit_bytes: int | None
    usage_bytes: int | None  # what the cgroup charges against it, less file cache it can drop
    oom_kills: int | None  # the cgroup's OOM-kill count (v2 memory.events, v1 memory.oom_control)
    source: str  # where the limit comes from, as a person reads it ("cgroup v2 memory.max", "MEM_LIMIT")
    cgroup_dir: str = ""  # the cgroup directory whose limit binds, where one does
    reason: str = ""  # why the limit is unknown
    host_total_bytes: int | None = None

    @property
    def applies(self) -> bool:
        """A limit below the host's RAM: the one the kernel dies at."""
        lim, host = self.limit_bytes, self.host_total_bytes
        return lim is not None and (host is None or lim < host)

    @property
    def share(self) -> float | None:
        """Usage over the limit, where both are known and the limit applies."""
        if not self.applies or self.usage_bytes is None or not self.limit_bytes:
            return None
        return self.usage_bytes / self.limit_bytes

    def text(self) -> str:
        """One line for ``%cudamem status``."""
        if self.reason:
            return f"memory limit unknown: {self.reason}"
        if self.limit_bytes is None:
            return "memory limit: none set (the host's RAM applies)"
        if not self.applies:
            return (f"memory limit: {fmt_bytes(self.limit_bytes)} ({self.source}), not below the host's RAM "
                    f"({fmt_bytes(self.host_total_bytes)})")
        used = f"; {fmt_bytes(self.usage_bytes)} of it in use" if self.usage_bytes is not None else ""
        kills = f"; OOM kills so far: {self.oom_kills}" if self.oom_kills is not None else ""
        return f"memory limit: {fmt_bytes(self.limit_bytes)} container limit ({self.source}){used}{kills}"


@dataclass(frozen=True, slots=True)
class Sample:
    """One device at one instant, with the process list it was read with; ``None`` is unknown."""

    t_wall: float
    device: str
    allocated_bytes: int | None
    reserved_bytes: int | None
    active_bytes: int | None
    inactive_split_bytes: int | None
    nvml_used_bytes: int | None
    nvml_total_bytes: int | None
    process_used_bytes: int | None
    other_processes_bytes: int | None
    rss_bytes: int | None
    host_total_bytes: int | None = None  # host RAM, on the cpu row only
    host_used_bytes: int | None = None
    peak_bytes: int | None = None  # the high-water mark: peak RSS (cpu), the allocator's peak (cuda)
    processes: tuple[GpuProcess, ...] = ()  # other processes on this GPU, named where possible
    children_used_bytes: int | None = None  # this notebook's child processes on this GPU (NVML); cpu: None
    children: tuple[GpuProcess, ...] = ()  # those processes, with their command lines
    memory_limit: MemoryLimit | None = None  # cpu: the cgroup's limit read; host_total/used use it where lower


#: Sample fields that become columns of ``nbmem.samples()`` (t_wall becomes ``time``).
SAMPLE_COLUMNS = ("time", "device", "allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
                  "nvml_used_bytes", "nvml_total_bytes", "process_used_bytes", "other_processes_bytes", "rss_bytes",
                  "host_used_bytes", "host_total_bytes", "peak_bytes", "children_used_bytes")


@dataclass(frozen=True, slots=True)
class Boundary:
    """Everything read at a cell boundary: allocator counters (exact), NVML and RSS."""

    t_wall: float
    t_monotonic: float
    rss_bytes: int | None
    max_rss_bytes: int | None
    allocator: dict[str, AllocatorReading | None]
    nvml: dict[str, GpuReading]


# -- cells -----------------------------------------------------------------------------------------------
CELL_COLUMNS = ("cell", "started", "duration_s", "device", "allocated_before_bytes", "allocated_after_bytes",
                "delta_allocated_bytes", "reserved_before_bytes", "reserved_after_bytes", "delta_reserved_bytes",
                "peak_allocated_bytes", "peak_note", "peak_line", "process_used_before_bytes",
                "process_used_after_bytes", "delta_process_used_bytes", "rss_before_bytes", "rss_after_bytes",
                "delta_rss_bytes", "peak_rss_bytes", "error")


def _delta(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else b - a


@dataclass(frozen=True, slots=True)
class CellRecord:
    """What one monitored cell did on one device."""

    cell: int
    started: float  # epoch seconds
    duration_s: float
    device: str
    allocated_before_bytes: int | None
    allocated_after_bytes: int | None
    reserved_before_bytes: int | None
    reserved_after_bytes: int | None
    peak_allocated_bytes: int | None
    peak_note: str
    process_used_before_bytes: int | None
    process_used_after_bytes: int | None
    rss_before_bytes: int | None
    rss_after_bytes: int | None
    peak_rss_bytes: int | None
    error: str
    peak_line: int | None = None  # the cell's line running at the peak, where the allocator's trace tells

    @property
    def delta_allocated_bytes(self) -> int | None:
        return _delta(self.allocated_before_bytes, self.allocated_after_bytes)

    @property
    def delta_reserved_bytes(self) -> int | None:
        return _delta(self.reserved_before_bytes, self.reserved_after_bytes)

    @property
    def delta_process_used_bytes(self) -> int | None:
        return _delta(self.process_used_before_bytes, self.process_used_after_bytes)

    @property
    def delta_rss_bytes(self) -> int | None:
        return _delta(self.rss_before_bytes, self.rss_after_bytes)

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        d["started"] = _dt.datetime.fromtimestamp(self.started, _dt.UTC)
        for k in ("delta_allocated_bytes", "delta_reserved_bytes", "delta_process_used_bytes", "delta_rss_bytes"):
            d[k] = getattr(self, k)
        return {c: d[c] for c in CELL_COLUMNS}


# -- findings -------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Finding:
    """Memory worth the user's attention: the names that keep it alive, how much, and what frees it.

    One storage, or a group (``tensors`` > 1: a container of many small tensors that together pass
    the threshold). ``graph_bytes`` are the saved tensors of the autograd graphs it keeps alive; a
    graph several holders share is counted under each of them (``graph_shared_with`` names the others).
    """

    cell: int  # where it appeared; 0 = before nbmem was watching
    name: str
    holders: tuple[str, ...]
    kind: HolderKind
    device: str
    storage_bytes: int
    graph_bytes: int = 0
    holds_graph: bool = False
    tensors: int = 1
    view_bytes: int | None = None  # a view: the bytes its tensor spans, of a storage of storage_bytes
    graph_shared_with: tuple[str, ...] = ()
    hint: str = ""
    roots: tuple[str, ...] = ()  # top-level names `del` removes to free it
    id: str = ""  # a handle the gauge refers to
    line: int | None = None  # the cell's line that allocated it, where the allocator's trace tells
    owner: str = ""  # the owner it belongs to (on an owner row, its own name)
    description: str = ""  # an owner row's "what", in words ("Sequential: 42M parameters")
    members: tuple[Finding, ...] = ()  # an owner row's biggest members: a row per storage (or small group)
    more_bytes: int = 0  # an owner row's bytes in members not listed
    also_held_by: tuple[str, ...] = ()  # other owners that reach some of its memory
    also_clears: tuple[str, ...] = ()  # "outputs", "traceback": what must be cleared with its names to free it
    state: str = ""  # what the cell meant to keep ("model", "optimizer", ...; intent.py): never offered in one click

    @property
    def bytes(self) -> int:
        return self.storage_bytes + self.graph_bytes

    @property
    def more(self) -> int:
        """An owner row's members not listed (tensors counts them all)."""
        return max(0, self.tensors - sum(m.tensors for m in self.members)) if self.members else 0

    def what(self) -> str:
        """The size, as a person reads it: views, groups and graphs said in words ("tensor" when it is
        just one tensor's storage: the bytes column says how big); an owner row says what it is."""
        if self.description:
            shared = f"; graph shared with {', '.join(self.graph_shared_with)}" if self.graph_shared_with else ""
            return self.description + shared
        parts = [fmt_bytes(self.storage_bytes)]
        if self.tensors == 1 and self.view_bytes is None and not self.graph_bytes:
            return "tensor"
        if self.tensors > 1:
            parts = [f"{self.tensors:,} tensors, {fmt_bytes(self.storage_bytes)}"]
        if self.view_bytes is not None:
            parts = [f"a {fmt_bytes(self.view_bytes)} view of a {fmt_bytes(self.storage_bytes)} storage"]
        if self.graph_bytes:
            shared = f", shared with {', '.join(self.graph_shared_with)}" if self.graph_shared_with else ""
            parts.append(f"graph {fmt_bytes(self.graph_bytes)}{shared}")
        return " + ".join(parts)

    def row(self) -> dict[str, Any]:
        return {"cell": self.cell, "name": self.name, "holders": list(self.holders), "kind": self.kind.value,
                "device": self.device, "bytes": self.bytes, "storage_bytes": self.storage_bytes,
                "graph_bytes": self.graph_bytes, "holds_graph": self.holds_graph, "tensors": self.tensors,
                "view_bytes": self.view_bytes, "line": self.line, "what": self.what(),
                "also_held_by": list(self.also_held_by), "owner": self.owner, "hint": self.hint,
                "action": cleanup_text(self), "state": self.state}


FINDING_COLUMNS = ("cell", "name", "holders", "kind", "device", "bytes", "storage_bytes", "graph_bytes",
                   "holds_graph", "tensors", "view_bytes", "line", "what", "also_held_by", "owner", "hint", "action",
                   "state")


@dataclass(frozen=True, slots=True)
class CleanupOf:
    """What frees a finding: the one mapping from holder kinds to cleanup steps."""

    names: tuple[str, ...] = ()
    outputs: bool = False
    traceback: bool = False

    def __bool__(self) -> bool:
        return bool(self.names or self.outputs or self.traceback)


def cleanup_of(f: Finding) -> CleanupOf:
    cleans = HOLDER_KINDS[f.kind].cleans
    if cleans == "outputs":
        return CleanupOf(outputs=True)
    if cleans == "traceback":
        return CleanupOf(traceback=True)
    if cleans == "names":
        # What else holds it out of a variable's reach (a displayed element, a frame's local) goes too: the
        # row's hint names the same flags (freeing.py).
        return CleanupOf(names=f.roots, outputs="outputs" in f.also_clears, traceback="traceback" in f.also_clears)
    return CleanupOf()


def cleanup_text(f: Finding | CleanupOf) -> str:
    """The cleanup a finding (or several, merged) asks for, as ``%cudamem clean`` would be typed."""
    c = cleanup_of(f) if isinstance(f, Finding) else f
    parts = list(c.names) + (["--outputs"] if c.outputs else []) + (["--traceback"] if c.traceback else [])
    return ("%cudamem clean " + " ".join(parts)) if parts else ""


def merge_cleanups(findings: Iterable[Finding]) -> CleanupOf:
    names: dict[str, None] = {}
    outputs = traceback = False
    for f in findings:
        c = cleanup_of(f)
        names.update(dict.fromkeys(c.names))
        outputs |= c.outputs
        traceback |= c.traceback
    return CleanupOf(tuple(names), outputs, traceback)


@dataclass(frozen=True, slots=True)
class StillHeld:
    """What a cleanup could not free of one name it deleted: the bytes still alive and who keeps them."""

    name: str
    nbytes: int
    named_by: tuple[str, ...] = ()  # other paths to the same storages (`trainer.model.0.weight`, `Out[15]`)
    saved_by: tuple[str, ...] = ()  # tensors whose autograd graphs saved them (`out['loss']`)
    unnamed_bytes: int = 0  # alive, but nothing nbmem walks reaches them
    frees: CleanupOf = field(default_factory=lambda: CleanupOf())  # what would free the rest
    paged_bytes: int = 0  # a paged optimizer's CUDA managed memory: bitsandbytes never frees it
    graph_bytes: int = 0  # what the autograd graphs of those tensors keep besides (a loss another name holds)

    def text(self) -> str:
        if self.paged_bytes and self.paged_bytes == self.nbytes:
            return (f"`{self.name}`: {fmt_bytes(self.paged_bytes)} of paged memory (CUDA managed, a bitsandbytes "
                    f"paged optimizer's state) is not given back: bitsandbytes never frees it; restarting the "
                    f"kernel does")
        parts = []
        if self.paged_bytes:
            parts.append(f"{fmt_bytes(self.paged_bytes)} of paged memory that bitsandbytes never frees")
        if self.named_by:
            parts.append(f"named by `{'`, `'.join(self.named_by)}`")
        if self.saved_by:
            graphs = "graph" if len(self.saved_by) == 1 else "graphs"
            parts.append(f"saved by the autograd {graphs} of `{'`, `'.join(self.saved_by)}`")
        if self.unnamed_bytes:
            parts.append(f"{fmt_bytes(self.unnamed_bytes)} by something no name reaches (C++ or a library)")
        how = f" → `{cleanup_text(self.frees)}` frees it" if self.frees else ""
        graph = f" (and its autograd graph, {fmt_bytes(self.graph_bytes)})" if self.graph_bytes else ""
        return (f"`{self.name}`: {fmt_bytes(self.nbytes)} of its memory{graph} is still held, {'; '.join(parts)}"
                f"{how}")


# -- the report under a cell -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LineRecord:
    """One line of a cell, from the allocator's event trace: what it left allocated and its peak."""

    cell: int
    device: str
    line: int
    source: str
    delta_allocated_bytes: int
    peak_allocated_bytes: int
    events: int
    top_frame: str = ""  # the deepest user frame that allocated the largest blocks live at the peak

    def row(self) -> dict[str, Any]:
        return asdict(self)


LINE_COLUMNS = ("cell", "device", "line", "source", "delta_allocated_bytes", "peak_allocated_bytes", "events",
                "top_frame")
# -- cleanup -------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CleanupStep:
    """One action and what it freed; ``error`` when the step itself failed."""

    action: str
    target: str
    freed_allocated_bytes: int | None
    freed_reserved_bytes: int | None
    note: str = ""
    error: str = ""


def known_sum(values: Iterable[int | None]) -> int | None:
    """Sum of the known values; None (unknown) when none is known, rather than a made-up 0."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


# -- what the engine tells its subscribers ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Tick:
    """One sampler tick: a sample per device (``cpu`` first), all read at the same moment."""

    samples: tuple[Sample, ...]


@dataclass(frozen=True, slots=True)
class Holders:
    """The current holders above the threshold, after a scan (a cell, a cleanup, ``%cudamem on``)."""

    findings: tuple[Finding, ...]


# -- status ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Fault:
    """An exception inside nbmem, recorded (and shown once); the user's cell was not affected."""

    where: str
    error: str
    count: int


# -- what a notebook's compiled models and child processes hold ---------------------------------------------
@dataclass(frozen=True, slots=True)
class PoolUse:
    """One device's private memory pools: where CUDA graphs keep their memory (``torch.compile`` with
    ``mode="reduce-overhead"``, ``torch.cuda.graph``), apart from the allocator's default pool."""

    device: str
    pools: int  # private pools with memory on this device
    reserved_bytes: int  # their segments, allocated or cached
    allocated_bytes: int
    unnamed_bytes: int  # allocated there, reached by no name the scan walked (the graphs' own buffers)
    compiled: tuple[str, ...] = ()  # the notebook's compiled modules (what ``torch.compile`` returned)


@dataclass(frozen=True, slots=True)
class ChildrenUse:
    """What this notebook's child processes held on one GPU during a cell (NVML's per-process figures)."""

    device: str
    after_bytes: int | None  # at the cell's end
    peak_bytes: int  # the most while it ran: its two ends and the sampler's readings between (a lower bound)
    # The children seen holding memory there at either end or a reading between; the figures above are all of
    # theirs together, so one whose memory did not move is named beside one whose did.
    pids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ChildProcess:
    """A process this notebook started, alive and holding memory on a GPU when a cell ended."""

    device: str
    pid: int
    used_bytes: int | None
    command: str
    started_wall: float | None = None

    def row(self) -> dict[str, Any]:
        return asdict(self)
