"""GPU memory of every notebook on a Jupyter server: ``GET /api/nbmem/gpu`` and metrics in ``/metrics``;
and which of its kernels died, and why (``nbmem_kernel_deaths_total{reason}``).

A jupyter-server extension, enabled on install by ``etc/jupyter/jupyter_server_config.d/nbmem.json`` and
turned off with ``jupyter server extension disable nbmem``. It reads NVML in the server process (never
CUDA: no context is made) for every GPU of the machine, whatever the server's ``CUDA_VISIBLE_DEVICES``,
and names each GPU process by this server's kernels: a process counts for a kernel when it is the
kernel's process or one of its descendants (DataLoader workers, a subprocess), and the kernel's session
names the notebook. A number nbmem cannot know is ``None`` (JSON null, no Prometheus sample), never 0,
and ``reason`` says why in words.

One reading, at most ``MAX_AGE_S`` old, serves both the endpoint and the metrics. Only jupyter_server
imports this module, so ``import nbmem`` stays light.

A kernel that dies on its own is seen by its restarter, which calls ``DeathWatch.died`` before it starts
the new one: the death is counted by its likely cause (from the capsule the kernel left, ``flight``, and
the process's exit status), and the status is added to the capsule, so the story the notebook's next
kernel tells names the signal.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jupyter_client.provisioning import LocalProvisioner
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.application import ExtensionApp
from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily, Metric
from tornado import web
from tornado.ioloop import PeriodicCallback
from traitlets import Unicode
from traitlets.utils.importstring import import_item

from nbmem.measure.limits import oom_kills_of
from nbmem.measure.processes import known_total, lineages
from nbmem.measure.sources import NvmlSource
from nbmem.recorder.deaths import REASONS, cause_of
from nbmem.recorder.flight import flight_dir, read_capsule, write_private
from nbmem.records import GpuDevice, GpuProcess

#: How long one reading serves every request and scrape: NVML's process list takes the driver's lock
#: and costs milliseconds, so it is asked at most once per this many seconds.
MAX_AGE_S = 1.0
#: Where the JSON is served, under the server's base URL.
ENDPOINT = "/api/nbmem/gpu"


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    """What jupyter_server loads; ``nbmem._jupyter_server_extension_points`` hands this on."""
    return [{"module": "nbmem.server", "app": NbmemServer}]


# -- records ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Kernel:
    """One of this server's kernels: its notebook (None without a session) and its process here
    (None when it has none on this machine: a remote provisioner, a gateway)."""

    kernel_id: str
    notebook: str | None
    pid: int | None


@dataclass(frozen=True, slots=True)
class KernelUse:
    """What one kernel's processes hold on one GPU; ``pids`` and ``used_bytes`` are None where unknown."""

    kernel_id: str
    notebook: str | None
    pids: tuple[int, ...] | None
    used_bytes: int | None

    def to_json(self) -> dict[str, Any]:
        pids = None if self.pids is None else list(self.pids)
        return {"kernel_id": self.kernel_id, "notebook": self.notebook, "pids": pids, "bytes": self.used_bytes}


@dataclass(frozen=True, slots=True)
class GpuUse:
    """One GPU by NVML index: its totals, the kernels of this server on it, and every other process."""

    index: int
    uuid: str
    name: str
    total_bytes: int | None
    used_bytes: int | None
    kernels: tuple[KernelUse, ...]
    other_processes: tuple[GpuProcess, ...]

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "name": self.name, "total_bytes": self.total_bytes,
                "used_bytes": self.used_bytes, "kernels": [k.to_json() for k in self.kernels],
                "other_processes": [{"pid": p.pid, "name": p.name, "bytes": p.used_bytes}
                                    for p in self.other_processes]}


@dataclass(frozen=True, slots=True)
class Reading:
    """Every GPU at one moment; ``reason`` says what is not known, None when everything is."""

    gpus: tuple[GpuUse, ...]
    reason: str | None
    t_monotonic: float

    def to_json(self) -> dict[str, Any]:
        return {"gpus": [g.to_json() for g in self.gpus], "reason": self.reason}


# -- attribution (pure) ----------------------------------------------------------------------------------
def _unknown(kernels: Sequence[Kernel]) -> tuple[KernelUse, ...]:
    return tuple(KernelUse(k.kernel_id, k.notebook, None, None) for k in kernels)


def attribute(gpu: GpuDevice, used_bytes: int | None, total_bytes: int | None,
              procs: tuple[GpuProcess, ...] | None, kernels: Sequence[Kernel],
              lineage: Mapping[int, tuple[int, ...] | None]) -> tuple[GpuUse, list[str]]:
    """Name one GPU's processes by kernel, and say what could not be known.

    ``procs`` is NVML's list (None when NVML could not give one: the caller says why); ``lineage`` maps each
    listed PID to itself and its ancestors, nearest first, or to None when no such PID exists here.
    """
    def use(kernel_uses: Iterable[KernelUse], others: Iterable[GpuProcess]) -> GpuUse:
        return GpuUse(gpu.nvml_index, gpu.uuid, gpu.model, total_bytes, used_bytes,
                      tuple(sorted(kernel_uses, key=lambda k: k.kernel_id)), tuple(sorted(others, key=lambda p: p.pid)))

    if procs is None:
        return use(_unknown(kernels), ()), []
    foreign = [p.pid for p in procs if lineage.get(p.pid) is None]
    if foreign:
        # The driver reports host PIDs; in a container without the host's PID namespace they name nothing
        # here (a process that just exited looks the same, for one reading).
        return use(_unknown(kernels), procs), [
            f"GPU {gpu.nvml_index}: NVML lists {len(foreign)} process(es) whose PID does not exist here (a "
            "container without the host PID namespace), so which kernel holds what is unknown"]
    by_pid = {k.pid: k for k in kernels if k.pid is not None}
    owned: dict[str, list[GpuProcess]] = {}
    others: list[GpuProcess] = []
    for p in procs:
        owner = next((by_pid[a] for a in lineage[p.pid] or () if a in by_pid), None)
        if owner is None:
            others.append(p)
        else:
            owned.setdefault(owner.kernel_id, []).append(p)
    uses = [KernelUse(k.kernel_id, k.notebook, tuple(sorted(q.pid for q in owned[k.kernel_id])),
                      known_total(owned[k.kernel_id])) for k in kernels if k.kernel_id in owned]
    remote = [k for k in kernels if k.pid is None]
    reasons = [f"kernel {k.kernel_id} has no process on this machine: its GPU memory is unknown" for k in remote]
    blank = sum(p.used_bytes is None for p in procs)
    if blank:
        reasons.append(f"GPU {gpu.nvml_index}: NVML gives no memory figure for {blank} process(es) (as under MIG "
                       "or WDDM)")
    return use([*uses, *_unknown(remote)], others), reasons


# -- what the server knows ---------------------------------------------------------------------------------
def kernel_pid(kernel_manager: Any, kernel_id: str) -> int | None:
    """The kernel's process on this machine, or None.

    Only a local provisioner's PID is a process here: remote provisioners may keep a ``pid`` that belongs
    to another host (or to a launcher), and a gateway's kernels have no provisioner at all.
    """
    try:
        provisioner = kernel_manager.get_kernel(kernel_id).provisioner
    except (KeyError, AttributeError):  # shut down meanwhile, or a kernel manager without provisioners
        return None
    if not isinstance(provisioner, LocalProvisioner):
        return None
    pid = provisioner.pid
    return pid if isinstance(pid, int) and pid > 0 else None


def notebooks_by_kernel(session_manager: Any) -> tuple[dict[str, str], str | None]:
    """Kernel id to notebook path, from the session table, and why not when it cannot be read.

    Read synchronously: ``/metrics`` calls collectors on the event loop, where the session manager's
    coroutines cannot be awaited. ``list_sessions`` runs this same query; its awaits only drop rows whose
    kernel died, and rows are joined with the live kernels here anyway. A fresh cursor, so the session
    manager's own is never disturbed.
    """
    try:
        rows = session_manager.cursor.connection.execute("SELECT kernel_id, path FROM session").fetchall()
    except Exception as e:  # a session manager without the table, or a call from another thread
        return {}, f"the server's sessions could not be read ({e}): notebooks are unknown"
    return {str(kid): str(path) for kid, path in rows if kid and path}, None


class ServerMonitor:
    """NVML and this server's kernels, read together at most once per ``max_age_s``; thread-safe."""

    def __init__(self, source: NvmlSource, kernel_manager: Any, session_manager: Any, *,
                 clock: Callable[[], float] = time.monotonic, max_age_s: float = MAX_AGE_S) -> None:
        self._source = source
        self._kernel_manager = kernel_manager
        self._session_manager = session_manager
        self._clock = clock
        self._max_age_s = max_age_s
        self._lock = threading.Lock()
        self._last: Reading | None = None

    def start(self) -> str | None:
        """Initialise NVML; returns why it sees nothing, when it does not."""
        self._source.start()
        return self._source.reason

    def reading(self) -> Reading:
        with self._lock:
            now = self._clock()
            if self._last is None or now - self._last.t_monotonic >= self._max_age_s:
                self._last = self._read(now)
            return self._last

    def close(self) -> None:
        self._source.close()

    def _kernels(self) -> tuple[tuple[Kernel, ...], str | None]:
        notebooks, why = notebooks_by_kernel(self._session_manager)
        kernels = tuple(Kernel(str(kid), notebooks.get(str(kid)), kernel_pid(self._kernel_manager, kid))
                        for kid in self._kernel_manager.list_kernel_ids())
        return kernels, why

    def _read(self, now: float) -> Reading:
        self._source.start()
        reasons = [self._source.reason]
        kernels, why = self._kernels()
        reasons.append(why)
        listed = {d.name: (self._source.memory(d.name), self._source.processes(d.name, max_age_s=0.0))
                  for d in self._source.devices}
        lineage = lineages(p.pid for _, procs in listed.values() for p in procs or ())
        gpus = []
        for d in self._source.devices:
            (used, total), procs = listed[d.name]
            if procs is None:
                reasons.append(self._source.process_reason)
            gpu, why_not = attribute(d, used, total, procs, kernels, lineage)
            gpus.append(gpu)
            reasons += why_not
        known = [r for r in dict.fromkeys(reasons) if r]  # in order, once each (a remote kernel, every GPU)
        return Reading(tuple(gpus), "; ".join(known) or None, now)


# -- kernels that died --------------------------------------------------------------------------------------
def exit_status(kernel_manager: Any, kernel_id: str) -> int | None:
    """How a local kernel's process ended (negative: the signal), None where it has not or is not local."""
    try:
        provisioner = kernel_manager.get_kernel(kernel_id).provisioner
    except (KeyError, AttributeError):
        return None
    process = getattr(provisioner, "process", None) if isinstance(provisioner, LocalProvisioner) else None
    return process.poll() if process is not None else None


def death_reason(capsule: Mapping[str, Any] | None, status: int | None) -> str:
    """The reason label of a death: from the dead kernel's capsule (nbmem was loaded) and its exit status."""
    ended = {"status": status} if status is not None else {}
    if capsule is None:
        return cause_of({"exit": ended}, None)[0]
    kills = oom_kills_of(str((capsule.get("limit") or {}).get("cgroup_dir") or ""))
    return cause_of({**capsule, "exit": ended}, kills)[0]


class DeathWatch:
    """Counts this server's kernels that died (the restarter's "restart" and "dead" events) by reason, and
    adds the exit status to the capsule the dead kernel left, for the story its notebook's next kernel tells."""

    def __init__(self, kernel_manager: Any, directory: Path, log: Any) -> None:
        self._kernel_manager = kernel_manager
        self._directory = directory
        self._log = log
        self._watched: set[str] = set()
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def watch(self) -> None:
        """Register for the kernels started since the last call (a periodic callback on the event loop)."""
        ids = set(map(str, self._kernel_manager.list_kernel_ids()))
        for kid in sorted(ids - self._watched):
            try:
                km = self._kernel_manager.get_kernel(kid)
            except KeyError:  # shut down meanwhile
                continue
            if getattr(km, "_restarter", None) is None:
                continue  # still starting (its restarter comes with it), or without auto-restart: nothing to see
            for event in ("restart", "dead"):
                km.add_restart_callback(functools.partial(self.died, kid), event)
            self._watched.add(kid)
        self._watched &= ids

    def died(self, kernel_id: str) -> None:
        try:
            pid, status = kernel_pid(self._kernel_manager, kernel_id), exit_status(self._kernel_manager, kernel_id)
            path = next(iter(sorted(self._directory.glob(f"kernel-{pid}-*.json"))), None) if pid else None
            capsule = read_capsule(path) if path is not None else None
            reason = death_reason(capsule, status)
            if path is not None and capsule is not None and status is not None:
                write_private(path.parent, path.name, json.dumps({**capsule, "exit": {"status": status}}).encode())
        except Exception:  # never in the way of the server's own restart
            self._log.exception("nbmem: reading how kernel %s died failed", kernel_id)
            reason = "unknown"
        with self._lock:
            self.counts[reason] = self.counts.get(reason, 0) + 1

    def families(self) -> list[Metric]:
        deaths = CounterMetricFamily("nbmem_kernel_deaths", "Kernels of this server that died (their restarter "
                                     "saw them gone) by likely cause: " + ", ".join(REASONS), labels=["reason"])
        with self._lock:  # every reason from the server's start, at 0: increase() then counts a first death too
            counts = {**dict.fromkeys(REASONS, 0), **self.counts}
        for reason, n in sorted(counts.items()):
            deaths.add_metric([reason], n)
        return [deaths]


# -- Prometheus --------------------------------------------------------------------------------------------
def metric_families(reading: Reading | None) -> list[Metric]:
    """The three families; samples only for known numbers, and only for the kernels alive in ``reading``."""
    used = GaugeMetricFamily("nbmem_gpu_memory_used_bytes", "GPU memory in use (NVML); gpu is the NVML index",
                             labels=["gpu"])
    total = GaugeMetricFamily("nbmem_gpu_memory_total_bytes", "GPU memory in all (NVML); gpu is the NVML index",
                              labels=["gpu"])
    kernel = GaugeMetricFamily("nbmem_kernel_gpu_memory_bytes",
                               "GPU memory held by a kernel and its child processes (NVML); notebook is empty "
                               "for a kernel without a session", labels=["gpu", "kernel_id", "notebook"])
    for g in reading.gpus if reading else ():
        gpu = str(g.index)
        if g.used_bytes is not None:
            used.add_metric([gpu], g.used_bytes)
        if g.total_bytes is not None:
            total.add_metric([gpu], g.total_bytes)
        for k in g.kernels:
            if k.used_bytes is not None:
                kernel.add_metric([gpu, k.kernel_id, k.notebook or ""], k.used_bytes)
    return [used, total, kernel]


class GpuCollector:
    """A prometheus_client collector over the monitor's reading.

    It keeps no series between scrapes, so a kernel that is gone has no series: cardinality is bounded by
    the kernels alive now.
    """

    def __init__(self, reading: Callable[[], Reading], log: Any, deaths: DeathWatch | None = None) -> None:
        self._reading = reading
        self._log = log
        self._deaths = deaths

    def describe(self) -> list[Metric]:
        # Names without samples: registering the collector must not read NVML.
        return metric_families(None) + (self._deaths.families() if self._deaths else [])

    def collect(self) -> list[Metric]:
        deaths = self._deaths.families() if self._deaths else []
        try:
            reading = self._reading()
        except Exception:  # one failure here would fail all of the server's metrics
            self._log.exception("nbmem: reading GPU memory for /metrics failed")
            return metric_families(None) + deaths
        return metric_families(reading) + deaths


# -- the extension -----------------------------------------------------------------------------------------
class GpuHandler(APIHandler):
    """``GET /api/nbmem/gpu``: the reading as JSON."""

    # It shows the server's kernels and their notebooks: whoever may read kernels may read this.
    auth_resource = "kernels"

    @web.authenticated
    @authorized
    def get(self) -> None:
        monitor: ServerMonitor = self.settings["nbmem_monitor"]
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(monitor.reading().to_json()))


def _nvml_binding(name: str) -> Any | None:
    """The configured NVML module; None lets NvmlSource import pynvml itself and say so when it is missing."""
    return None if name == "pynvml" else import_item(name)


class NbmemServer(ExtensionApp):
    """nbmem's server extension: GPU memory per kernel and notebook, as JSON and Prometheus metrics.

    An ExtensionApp rather than a bare module, because only extension apps are told when the server stops
    (``stop_extension``): that is where the collector leaves the process-wide registry.
    """

    name = "nbmem"

    nvml_module = Unicode(
        "pynvml",
        help="""The NVML binding to read, as an import string ("module" or "module.attribute").
        The default is NVIDIA's nvidia-ml-py (pynvml); tests name a fake here (e.g. "tests.fake_nvml").""",
    ).tag(config=True)

    monitor: ServerMonitor
    deaths: DeathWatch
    _collector: GpuCollector | None = None
    _watching: PeriodicCallback | None = None

    def initialize_settings(self) -> None:
        assert self.serverapp is not None
        # environ={}: the server sees every GPU, whatever CUDA_VISIBLE_DEVICES it was started with.
        source = NvmlSource(nvml=_nvml_binding(self.nvml_module), environ={})
        self.monitor = ServerMonitor(source, self.serverapp.kernel_manager, self.serverapp.session_manager)
        # NVML's first init can take a while on a large machine: at startup, not in someone's request.
        why = self.monitor.start()
        if why:
            self.log.warning("nbmem: %s; %s answers with this reason and no GPU numbers", why, ENDPOINT)
        self.settings["nbmem_monitor"] = self.monitor
        # Capsules are where the server's kernels write them: the runtime dir they inherit from it.
        self.deaths = DeathWatch(self.serverapp.kernel_manager, flight_dir(), self.log)
        collector = GpuCollector(self.monitor.reading, self.log, self.deaths)
        try:
            REGISTRY.register(collector)
        except ValueError as e:  # another server in this process registered the families and is still up
            self.log.warning("nbmem: no GPU metrics in /metrics: %s", e)
        else:
            self._collector = collector

    def initialize_handlers(self) -> None:
        self.handlers.append((ENDPOINT, GpuHandler))

    async def _start_jupyter_server_extension(self, serverapp: Any) -> None:
        # Kernels started since the last look get the restarter's callbacks (the loop runs by now).
        self._watching = PeriodicCallback(self.deaths.watch, 1000)
        self._watching.start()

    async def stop_extension(self) -> None:
        if self._watching is not None:
            self._watching.stop()
        if self._collector is not None:
            REGISTRY.unregister(self._collector)
            self._collector = None
        self.monitor.close()
