"""Where the numbers come from: NVML, the torch caching allocator, and the host.

Each driver has one choke point (`NvmlSource._call`, `TorchSource._stats`) with one error policy:
a failure becomes ``None`` (unknown) plus a reason the user is told once, never a made-up zero.
Nothing here creates a CUDA context: torch is read only from ``sys.modules`` (if the user never
imported torch there are no tensors to see) and only when ``torch.cuda.is_initialized()``
(``TorchSource.cuda``). Nothing here changes what it reads: what gives the allocator's memory back
(``empty_cache``, ``torch._dynamo.reset``, cuBLAS's workspaces) is ``nbmem.clean.release``'s.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nbmem.measure import processes as lineage
from nbmem.measure.host import HeapWatch, HostSource
from nbmem.measure.notebooks import notebook_of_pids
from nbmem.records import AllocatorReading, Boundary, GpuDevice, GpuProcess, GpuReading, Sample

#: How often the NVML process list may be asked for: it takes the driver's lock and can cost
#: milliseconds (MangoHud measured 4.5 ms for the graphics list), so never faster than this.
PROCESS_LIST_MIN_INTERVAL_S = 1.0


class NvmlFailure(Exception):
    """An NVML call failed; the message says why in words a user can act on."""


def parse_visible_devices(value: str | None, uuids: list[str]) -> tuple[list[int], str | None]:
    """Map ``CUDA_VISIBLE_DEVICES`` to NVML indices without touching CUDA.

    Follows CUDA's rules: integers and (prefixes of) ``GPU-…`` UUIDs, and enumeration stops at the
    first entry that is invalid. Returns the NVML indices in CUDA order and, where something could not
    be mapped, a reason.
    """
    if value is None:
        return list(range(len(uuids))), None
    out: list[int] = []
    for raw in value.split(","):
        token = raw.strip()
        if not token:
            break
        if token.startswith("MIG-"):
            return out, f"CUDA_VISIBLE_DEVICES names a MIG instance ({token}); NVML numbers for MIG are not mapped"
        if token.lstrip("-").isdigit():
            idx = int(token)
            if idx < 0 or idx >= len(uuids) or idx in out:
                break
            out.append(idx)
            continue
        matches = [i for i, u in enumerate(uuids) if u.startswith(token) or u.startswith("GPU-" + token)]
        if len(matches) != 1 or matches[0] in out:
            break
        out.append(matches[0])
    return out, None


class NvmlSource:
    """NVML device totals and per-process usage, for the devices this process can see."""

    def __init__(self, nvml: Any | None = None, environ: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._nv = nvml
        self._env = os.environ if environ is None else environ
        self._clock = clock
        self._lock = threading.Lock()  # NVML handles are shared by the sampler and the cell hooks
        self.devices: list[GpuDevice] = []
        self.reason: str | None = None  # why NVML sees nothing, when it does not
        self.process_reason: str | None = None  # why per-process numbers are unknown
        self._handles: dict[str, Any] = {}
        self._proc_cache: dict[str, tuple[float, tuple[GpuProcess, ...]]] = {}
        self._pid_invisible: set[str] = set()  # devices where we use CUDA but NVML never lists our PID
        self._descendants = lineage.Descendants(clock)  # which listed processes this one started
        self._started = False

    # -- the one choke point -------------------------------------------------------------------
    def _call(self, fn: str, *args: Any, **kwargs: Any) -> Any:
        try:
            with self._lock:
                return getattr(self._nv, fn)(*args, **kwargs)
        except Exception as e:  # pynvml raises NVMLError subclasses; a missing symbol is AttributeError
            raise NvmlFailure(f"{fn}: {e}") from None

    def start(self) -> None:
        """Initialise NVML and find the visible devices; afterwards ``reason`` says what failed."""
        if self._started:
            return
        self._started = True
        if self._nv is None:
            try:
                import pynvml  # nvidia-ml-py, NVIDIA's own binding

                self._nv = pynvml
            except ImportError:
                self.reason = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
                return
        try:
            self._call("nvmlInit")
        except NvmlFailure as e:
            self.reason = _nvml_init_reason(str(e))
            self._nv = None
            return
        try:
            count = int(self._call("nvmlDeviceGetCount"))
            handles = [self._call("nvmlDeviceGetHandleByIndex", i) for i in range(count)]
            uuids = [_text(self._call("nvmlDeviceGetUUID", h)) for h in handles]
            models = [_text(self._call("nvmlDeviceGetName", h)) for h in handles]
        except NvmlFailure as e:
            self.reason = f"NVML could not list devices ({e})"
            return
        indices, why = parse_visible_devices(self._env.get("CUDA_VISIBLE_DEVICES"), uuids)
        if why:
            self.reason = why
        for torch_index, nv in enumerate(indices):
            dev = GpuDevice(f"cuda:{torch_index}", nv, uuids[nv], models[nv])
            self.devices.append(dev)
            self._handles[dev.name] = handles[nv]
        if not self.devices and not self.reason:
            self.reason = "NVML sees no GPU that CUDA_VISIBLE_DEVICES leaves visible"

    def close(self) -> None:
        if self._nv is not None and self._started and self._handles is not None:
            try:
                self._call("nvmlShutdown")
            except NvmlFailure:
                pass
        self._started = False
        self._handles = {}
        self.devices = []

    # -- readings ------------------------------------------------------------------------------
    def memory(self, device: str) -> tuple[int | None, int | None]:
        """(used, total) bytes; the v2 query so driver-reserved memory is not counted as used."""
        h = self._handles.get(device)
        if h is None:
            return None, None
        try:
            v2 = getattr(self._nv, "nvmlMemory_v2", None)
            info = self._call("nvmlDeviceGetMemoryInfo", h, version=v2) if v2 else None
        except NvmlFailure:
            info = None  # driver older than R510: fall back to v1
        if info is None:
            try:
                info = self._call("nvmlDeviceGetMemoryInfo", h)
            except NvmlFailure:
                return None, None
        return int(info.used), int(info.total)

    def processes(self, device: str, *,
                  max_age_s: float = PROCESS_LIST_MIN_INTERVAL_S) -> tuple[GpuProcess, ...] | None:
        """Processes using the device, cached so NVML is asked at most once per ``max_age_s``."""
        h = self._handles.get(device)
        if h is None:
            return None
        now = self._clock()
        cached = self._proc_cache.get(device)
        if cached and now - cached[0] < max_age_s:
            return cached[1]
        try:
            raw = list(self._call("nvmlDeviceGetComputeRunningProcesses", h))
        except NvmlFailure as e:
            self.process_reason = f"NVML cannot list processes on {device} ({e})"
            return None
        not_available = getattr(self._nv, "NVML_VALUE_NOT_AVAILABLE", None)
        # Where this kernel's Jupyter server has nbmem's extension, it names every kernel by notebook.
        notebooks = notebook_of_pids(int(p.pid) for p in raw)
        procs = []
        for p in raw:
            pid = int(p.pid)
            used = getattr(p, "usedGpuMemory", None)
            if used is None or used == not_available:
                used = None  # WDDM and MIG report no per-process memory
            name = f"notebook {notebooks[pid]}" if pid in notebooks else lineage.name_of(pid)
            procs.append(GpuProcess(pid, None if used is None else int(used), name))
        result = tuple(procs)
        self._proc_cache[device] = (now, result)
        return result

    def read(self, device: str, *, cuda_in_use: bool, pid: int | None = None,
             max_age_s: float = PROCESS_LIST_MIN_INTERVAL_S) -> GpuReading:
        """NVML's numbers for one device; per-process values are ``None`` where they cannot be known.

        ``cuda_in_use`` says whether this process holds memory on *this* device (torch's reserved
        bytes there); ``max_age_s`` how old a cached process list may be.
        """
        used, total = self.memory(device)
        procs = self.processes(device, max_age_s=max_age_s)
        if procs is None:
            return GpuReading(used, total, None, None)
        me = os.getpid() if pid is None else pid
        if cuda_in_use and device not in self._pid_invisible and not any(p.pid == me for p in procs):
            # The cached list may predate our context on this device: look once more before concluding.
            procs = self.processes(device, max_age_s=0.0) or ()
            if not any(p.pid == me for p in procs):
                self._pid_invisible.add(device)
        mine = [p for p in procs if p.pid == me]
        if mine:
            self._pid_invisible.discard(device)
            own = mine[0].used_bytes
        elif cuda_in_use or device in self._pid_invisible:
            # We hold (or held: a context outlives an emptied cache) a CUDA context yet NVML lists no process
            # with our PID: we are in a PID namespace (a container without --pid=host), so NVML's PIDs are
            # the host's and cannot be matched; what this process holds is unknown, not 0.
            self.process_reason = ("NVML lists no process with this PID although CUDA is in use: a container "
                                   "without host PIDs; per-process numbers are unknown")
            return GpuReading(used, total, None, None, tuple(p for p in procs if p.pid != me))
        else:
            own = 0  # no CUDA context in this process: it holds nothing on the device
        split = self._descendants.split(device, procs, me, pids_match=bool(mine))
        other_bytes = lineage.known_total(split.others)
        if own is None or other_bytes is None:
            self.process_reason = "NVML gives no per-process memory on this system (WDDM or MIG)"
        children_bytes = None if split.unknown else lineage.known_total(split.children)
        return GpuReading(used, total, own, other_bytes, split.others, children_bytes, split.children)

    @property
    def children_reason(self) -> str | None:
        """Why this process's child processes cannot be told from other processes, where they cannot."""
        return self._descendants.reason

    def own_used(self, device: int) -> int | None:
        """This process's memory on ``cuda:N`` as NVML lists it (a fit's measure of a CUDA context); None: unknown."""
        procs = self.processes(f"cuda:{device}", max_age_s=0.0)
        return next((p.used_bytes for p in procs or () if p.pid == os.getpid()), None)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class TorchSource:
    """The torch caching allocator, read only once CUDA is initialised (never initialises it)."""

    @staticmethod
    def torch() -> Any | None:
        return sys.modules.get("torch")

    def cuda_initialized(self) -> bool:
        t = self.torch()
        cuda = getattr(t, "cuda", None) if t is not None else None
        try:
            return bool(cuda is not None and cuda.is_initialized())
        except Exception:
            return False

    def cuda(self) -> Any | None:
        """torch, once CUDA is initialised in this process; None before (nothing may start it): every call to
        torch's CUDA side goes through here, this class's reads and ``clean.release.TorchRelease``'s releases."""
        return self.torch() if self.cuda_initialized() else None

    def device_count(self) -> int:
        """Devices torch sees; asked only once CUDA is initialised, so asking costs nothing."""
        t = self.cuda()
        if t is None:
            return 0
        return int(t.cuda.device_count())

    def context_devices(self) -> list[int]:
        """The devices this process has a CUDA context on (asking makes none); none before CUDA is initialised."""
        t = self.cuda()
        if t is None:
            return []
        has = getattr(t._C, "_cuda_hasPrimaryContext", None)
        if has is None:  # a torch without the binding: the current device, which has one once CUDA is up
            return [int(t.cuda.current_device())]
        return [i for i in range(int(t.cuda.device_count())) if has(i)]

    # -- the one choke point -------------------------------------------------------------------
    def _stats(self, index: int) -> dict[str, Any] | None:
        t = self.cuda()
        if t is None:
            return None
        try:
            # The nested form is what the allocator returns; memory_stats() flattens and sorts it in
            # Python, which is most of its ~115 µs.
            return dict(t.cuda.memory.memory_stats_as_nested_dict(index))
        except Exception:
            return None

    def read(self, index: int) -> AllocatorReading | None:
        s = self._stats(index)
        if not s:
            return None

        def stat(name: str, kind: str = "current") -> int:
            return int(s.get(name, {}).get("all", {}).get(kind, 0))

        return AllocatorReading(
            allocated_bytes=stat("allocated_bytes"),
            reserved_bytes=stat("reserved_bytes"),
            active_bytes=stat("active_bytes"),
            inactive_split_bytes=stat("inactive_split_bytes"),
            peak_allocated_bytes=stat("allocated_bytes", "peak"),
            peak_reserved_bytes=stat("reserved_bytes", "peak"),
            allocated_total_bytes=stat("allocated_bytes", "allocated"),
            allocations=stat("allocation", "allocated"),
        )

    # -- the allocator's event trace (per-cell peaks and lines) ------------------------------------
    def trace_unsupported(self) -> str | None:
        """Why this torch cannot record the allocator's events for a cell, or None when it can."""
        if not self.cuda_initialized():
            return "CUDA is not initialised"
        t = self.torch()
        assert t is not None
        mem = getattr(t.cuda, "memory", None)
        if not all(hasattr(mem, f) for f in ("_record_memory_history", "_snapshot")) or not hasattr(
                t._C, "_cuda_isHistoryEnabled"):
            return f"torch {t.__version__} has no allocator history"
        try:
            if t.cuda.get_allocator_backend() != "native":
                return "the cudaMallocAsync allocator keeps no history"
        except Exception:
            pass
        return None

    def start_trace(self, *, stacks: bool, max_entries: int) -> Trace | None:
        """Record the allocator's events from now on (never when CUDA is not up). A recording the user
        started is left exactly as it is: it is only read."""
        if max_entries <= 0 or self.trace_unsupported():
            return None
        t = self.torch()
        assert t is not None
        since = time.time_ns() // 1000
        if t._C._cuda_isHistoryEnabled():
            return Trace("user", since, stacks, max_entries)
        # Each event costs the allocator time to record and us time to read back (about a microsecond each
        # on an H100), and a training step makes a hundred: "free_completed" (a block back in the pool
        # once its stream is done) changes neither allocated bytes nor the line, so it is not recorded.
        # Stacks are needed on frees as well as allocations: a line that only frees (zero_grad) is a line.
        kw: dict[str, Any] = {"context": "all" if stacks else None, "stacks": "python", "max_entries": max_entries,
                              "clear_history": True, "skip_actions": ["snapshot", "free_completed"]}
        try:
            t.cuda.memory._record_memory_history("all", **kw)
        except TypeError:  # an older torch without skip_actions
            kw.pop("skip_actions")
            t.cuda.memory._record_memory_history("all", **kw)
        return Trace("nbmem", since, stacks, max_entries)

    def finish_trace(self, trace: Trace, *, read: bool) -> list[list[dict[str, Any]]] | None:
        """The events per device (when ``read``); a recording nbmem started is stopped (which clears it)."""
        t = self.torch()
        assert t is not None
        try:
            return list(t.cuda.memory._snapshot().get("device_traces", [])) if read else None
        finally:
            if trace.owner == "nbmem":
                t.cuda.memory._record_memory_history(None)

    def reset_peak(self, index: int) -> None:
        """Reset the allocator's peak counter: only ever on an explicit ``--reset-peak``."""
        t = self.cuda()
        if t is not None:
            t.cuda.reset_peak_memory_stats(index)

    # -- the allocator's segments and the device's free memory (fits, out-of-memory advice, pools) ------
    def segments(self) -> list[dict[str, Any]] | None:
        """The allocator's segments and their blocks (``torch.cuda.memory_snapshot()``: every device, each
        segment with its ``device``, ``segment_pool_id`` and ``blocks``), or None when CUDA is not up or the
        read failed. A host-side walk of the allocator's state: no kernel runs, nothing changes."""
        t = self.cuda()
        if t is None:
            return None
        try:
            return list(t.cuda.memory_snapshot())
        except Exception:
            return None

    def memory_fraction(self, index: int) -> float | None:
        """The share of the device's memory this process's allocator may hold (``set_per_process_memory_fraction``;
        1.0 when nobody set one), CUDA being up; None where torch cannot say (before 2.9)."""
        t = self.cuda()
        get = getattr(getattr(getattr(t, "cuda", None), "memory", None), "get_per_process_memory_fraction", None)
        if get is None:
            return None
        try:
            return float(get(index))
        except Exception:
            return None

    def allocator_total(self, index: int) -> int | None:
        """The device's memory as torch's allocator counts it for a memory fraction (``totalGlobalMem``)."""
        t = self.cuda()
        try:
            return None if t is None else int(t.cuda.get_device_properties(index).total_memory)
        except Exception:
            return None

    def device_free(self, index: int) -> tuple[int, int] | None:
        """(free, total) bytes of the device as the driver sees them (``cudaMemGetInfo``), CUDA being up."""
        t = self.cuda()
        if t is None:
            return None
        try:
            free, total = t.cuda.mem_get_info(index)
        except Exception:
            return None
        return int(free), int(total)


def largest_free_block(segments: list[dict[str, Any]], device: int) -> int:
    """The largest inactive block of one device's segments: the biggest single request the cache could
    serve without asking the driver for more."""
    best = 0
    for seg in segments:
        if seg.get("device") != device:
            continue
        for b in seg.get("blocks", ()):
            if b.get("state") == "inactive":
                best = max(best, int(b.get("size", 0)))
    return best


@dataclass(frozen=True)
class Trace:
    """An allocator recording around one cell: who started it, since when, with stacks or not."""

    owner: str  # "nbmem": started for this cell and stopped after it; "user": yours, only read
    since_us: int  # wall clock, as the trace's time_us
    stacks: bool
    max_entries: int


#: How old a process list may be at a cell boundary (cells are user-paced, not a polling loop).
BOUNDARY_MAX_AGE_S = 0.05


def _holds_memory(a: AllocatorReading | None) -> bool:
    return a is not None and a.reserved_bytes > 0


class Probe:
    """All sources behind one face: what the sampler and the cell hooks read."""

    def __init__(self, nvml: NvmlSource | None = None, torch: TorchSource | None = None,
                 host: HostSource | None = None, wall: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.nvml = nvml or NvmlSource()
        self.torch = torch or TorchSource()
        self.host = host or HostSource()
        self.heap = HeapWatch()
        self._wall = wall
        self._mono = monotonic

    def start(self) -> None:
        self.nvml.start()
        self.heap.install()

    def close(self) -> None:
        self.heap.remove()
        self.nvml.close()

    def gpu_names(self) -> list[str]:
        """Visible GPUs: NVML's list, or torch's once CUDA is up and NVML is missing."""
        names = [d.name for d in self.nvml.devices]
        if not names:
            names = [f"cuda:{i}" for i in range(self.torch.device_count())]
        return names

    def allocator(self) -> dict[str, AllocatorReading | None]:
        if not self.torch.cuda_initialized():
            return {}
        return {f"cuda:{i}": self.torch.read(i) for i in range(self.torch.device_count())}

    def samples(self) -> list[Sample]:
        """One sample per device (``cpu`` first), as the sampler stores them."""
        now = self._wall()
        rss = self.host.rss_bytes()
        total, used, limit = self.host.memory()
        out = [Sample(now, "cpu", None, None, None, None, None, None, None, None, rss, total, used,
                      self.host.max_rss_bytes(), memory_limit=limit)]
        alloc = self.allocator()
        for name in self.gpu_names():
            a = alloc.get(name)
            g = self.nvml.read(name, cuda_in_use=_holds_memory(a))
            out.append(Sample(
                now, name,
                a.allocated_bytes if a else None, a.reserved_bytes if a else None,
                a.active_bytes if a else None, a.inactive_split_bytes if a else None,
                g.used_bytes, g.total_bytes, g.process_used_bytes, g.other_processes_bytes, rss,
                peak_bytes=a.peak_allocated_bytes if a else None, processes=g.processes,
                children_used_bytes=g.children_bytes, children=g.children))
        return out

    def boundary(self) -> Boundary:
        alloc = self.allocator()
        # A cell's Δ of NVML process usage needs a fresh list at both ends, not the sampler's cached one;
        # only on devices this process uses, or everywhere while it has child processes (a cell that started
        # them is told what they hold); elsewhere its usage is 0 and the cached list will do.
        nv = {}
        kids: bool | None = None
        for name in self.gpu_names():
            used = _holds_memory(alloc.get(name))
            if not used and kids is None and self.nvml.devices:
                kids = lineage.has_children()
            fresh = used or bool(kids)
            nv[name] = self.nvml.read(name, cuda_in_use=used,
                                      max_age_s=BOUNDARY_MAX_AGE_S if fresh else PROCESS_LIST_MIN_INTERVAL_S)
        return Boundary(self._wall(), self._mono(), self.host.rss_bytes(), self.host.max_rss_bytes(), alloc, nv)


def _nvml_init_reason(error: str) -> str:
    """Why NVML did not start, as a user reads it (the gauge shows it): the cause first, NVML's words after."""
    low = error.lower()
    if "library not found" in low:
        return "no NVIDIA driver on this machine (NVML's library is missing)"
    if "driver not loaded" in low:
        return "the NVIDIA driver is installed but not loaded (NVML: Driver Not Loaded)"
    if "insufficient permissions" in low or "no permission" in low:
        return "no permission to read the GPU (NVML: Insufficient Permissions)"
    return f"NVML did not start ({error}): no NVIDIA driver, or no GPU on this machine"
