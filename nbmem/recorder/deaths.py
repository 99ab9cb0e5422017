"""Why a kernel died: the warning before (a cell near the memory limit) and the story after (a capsule).

Pure analysis over records and capsules (``flight``). ``pressure_note`` is the line a cell's report gets
when memory crossed ``records.WARN_SHARE`` of the limit that applies while it ran, saying what grew.
``explain`` turns a dead kernel's capsule into a ``Death``: when it died, the cell it was running, memory
at the end and how fast it grew, the likely cause, the biggest owners it held and the biggest holders
of host memory its names reached (``hostheld``).
"""

from __future__ import annotations

import datetime as _dt
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nbmem.formatting import esc, fmt_bytes, fmt_seconds
from nbmem.records import WARN_SHARE, Finding, Sample
from nbmem.reports import CellReport, Shown

#: A kernel whose last samples reach this share of its limit (going on as it grew) died at the limit.
AT_LIMIT_SHARE = 0.95
GROWTH_WINDOW_S = 20.0
#: A CUDA error this close to the end is named as the likely cause.
CUDA_ERROR_RECENT_S = 60.0
TOP_OWNERS = 5


# -- the warning before ------------------------------------------------------------------------------------
def pressure_note(samples: Sequence[Sample], *, since: float, findings: Sequence[Finding] = (),
                  rss_delta_bytes: int | None = None) -> str:
    """What a cell's report says when memory crossed ``WARN_SHARE`` of the limit while it ran: how near,
    and what grew (RSS, the CPU tensors it added); "" when it did not."""
    worst: tuple[float, int, int] | None = None
    for s in samples:
        lim = s.memory_limit
        if s.device != "cpu" or s.t_wall < since or lim is None or not lim.applies or not lim.limit_bytes:
            continue
        used = lim.usage_bytes if lim.usage_bytes is not None else s.rss_bytes
        if used is not None and (worst is None or used / lim.limit_bytes > worst[0]):
            worst = (used / lim.limit_bytes, used, lim.limit_bytes)
    if worst is None or worst[0] < WARN_SHARE:
        return ""
    share, used, limit = worst
    grew = [f"RSS {fmt_bytes(rss_delta_bytes, signed=True)}"] if rss_delta_bytes is not None else []
    cpu = sorted((f for f in findings if f.device == "cpu"), key=lambda f: -f.bytes)[:3]
    grew += [f"`{f.name}` {fmt_bytes(f.bytes)}" for f in cpu]
    what = "; what grew: " + ", ".join(grew) if grew else ""
    if not cpu:
        what += (" (no CPU tensor this cell added explains it: objects outside torch, a DataFrame, a loaded file, "
                 "or a library's own memory)")
    return (f"memory reached {fmt_bytes(used)} of the {fmt_bytes(limit)} container limit ({share:.0%}) while this "
            f"cell ran: the kernel is killed (SIGKILL, no traceback) when it reaches the limit{what}")


# -- the story after -------------------------------------------------------------------------------------
@dataclass(frozen=True, repr=False)
class Death(Shown):
    """A dead kernel's last moments, read from its capsule; numbers and names only."""

    pid: int
    notebook: str
    last_seen_wall: float  # its last sample: it died after this
    cell: int | None
    first_line: str
    cell_started_wall: float | None
    rss_bytes: int | None
    used_bytes: int | None  # what counted against the limit (or host RAM in use)
    total_bytes: int | None  # the limit that applied, or host RAM
    limit_source: str  # "" when no limit below the host's RAM applied
    growth_bytes: int | None
    growth_s: float
    cause: str  # "oom-kill", "limit", "cuda-error", "host-memory", "unknown": the metric's reason label
    cause_text: str
    owners: tuple[tuple[str, str, str, int], ...] = ()  # (name, kind, device, bytes), biggest first
    gpus: tuple[tuple[str, int | None, int | None, int | None], ...] = ()  # (device, allocated, reserved, process)
    #: The biggest holders of host memory its names reached: (name, what, bytes, at least, not counted).
    host: tuple[tuple[str, str, int, bool, str], ...] = ()
    host_note: str = ""  # why that list may be short (the scan's budget ran out), or ""
    matched_by: str = ""  # how it was known to be this notebook's, where the notebook path did not say
    #: The capsule's samples, for ``nbmem.plot(death)``: wall times, then each series over them (None: unknown).
    times: tuple[float, ...] = ()
    series: tuple[tuple[str, str, tuple[int | None, ...]], ...] = ()  # (device, what, values): "cpu" "rss", ...

    def _when(self) -> str:
        t = _dt.datetime.fromtimestamp(self.last_seen_wall)
        return t.strftime("%H:%M:%S" if t.date() == _dt.date.today() else "%Y-%m-%d %H:%M:%S")

    def _memory(self) -> str:
        rss = f"host RSS {fmt_bytes(self.rss_bytes)}"
        if self.limit_source:
            of = f" of a {fmt_bytes(self.total_bytes)} container limit"
            if self.used_bytes is not None and self.used_bytes != self.rss_bytes:
                of += f" ({fmt_bytes(self.used_bytes)} of it in use)"
        else:
            of = f" (host RAM {fmt_bytes(self.total_bytes)}, {fmt_bytes(self.used_bytes)} in use)"
        grew = ""
        if self.growth_bytes is not None and self.growth_s >= 0.5:
            grew = f", {fmt_bytes(self.growth_bytes, signed=True)} in the last {fmt_seconds(self.growth_s)}"
        return rss + of + grew

    def lines(self) -> list[str]:
        """The story, a line each: when, which cell, memory at the end, the likely cause, what it held."""
        where = f" of {self.notebook}" if self.notebook else ""
        out = [f"nbmem: the previous kernel{where} died after {self._when()} (PID {self.pid}; its last sample)."]
        if self.cell is not None:
            out.append(f"It was running cell [{self.cell}]: {self.first_line}")
        else:
            out.append("No cell was running.")
        out.append(f"At the end: {self._memory()}.")
        out.append(f"Likely cause: {self.cause_text}.")
        if self.matched_by:
            out.append(f"It is this notebook's previous kernel by {self.matched_by}.")
        if self.owners:
            out.append("It held: " + "; ".join(f"{n} ({k}, {d}) {fmt_bytes(b)}" for n, k, d, b in self.owners) + ".")
        if self.host:
            out.append("Host memory its names held: " + "; ".join(
                f"{n} ({w}, {'at least ' if part else ''}{fmt_bytes(b)}{f'; not counted: {u}' if u else ''})"
                for n, w, b, part, u in self.host) + "." + (f" Not every name was read: {self.host_note}."
                                                           if self.host_note else ""))
        gpus = [f"{d} allocated {fmt_bytes(a)}, reserved {fmt_bytes(r)}" for d, a, r, _ in self.gpus
                if a is not None or r is not None]
        if gpus:
            out.append("GPUs at the end: " + "; ".join(gpus) + ".")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def _repr_html_(self) -> str:
        head, *rest = self.lines()
        body = "".join(f"<div>{esc(x)}</div>" for x in rest)
        return (f"<div class='nbmem-report nbmem-death'><div style='font-weight:600'>{esc(head)}</div>"
                f"{body}</div>")


def _last(xs: Sequence[Any]) -> Any:
    return next((x for x in reversed(xs) if x is not None), None)


def _growth(t: Sequence[float], rss: Sequence[int | None], window_s: float) -> tuple[int | None, float]:
    """RSS at the end less RSS ``window_s`` before it (or at the first sample, if later)."""
    pts = [(ti, v) for ti, v in zip(t, rss, strict=False) if v is not None]
    if len(pts) < 2:
        return None, 0.0
    end_t, end_v = pts[-1]
    start = next(((ti, v) for ti, v in pts if ti >= end_t - window_s), pts[0])
    return end_v - start[1], end_t - start[0]


def _at_limit(t: Sequence[float], used: Sequence[int | None], limit: int) -> bool:
    """The last sample at the limit, or near it and growing fast enough to get there before the next one."""
    pts = [(ti, v) for ti, v in zip(t, used, strict=False) if v is not None]
    if not pts:
        return False
    end_t, end_v = pts[-1]
    before = next(((ti, v) for ti, v in reversed(pts) if ti <= end_t - 1.0), None)
    step = max(0, end_v - before[1]) if before else 0
    return end_v >= AT_LIMIT_SHARE * limit or (end_v >= WARN_SHARE * limit and end_v + step >= limit)


def cause_of(capsule: Mapping[str, Any], oom_kills_now: int | None) -> tuple[str, str]:
    """(reason label, the likely cause in words), the surest first."""
    lim = capsule.get("limit") or {}
    s = capsule.get("samples") or {}
    t, used = s.get("t") or [], s.get("used") or []
    kills_then = _last(s.get("oom_kills") or []) if s.get("oom_kills") else lim.get("oom_kills")
    limit = lim.get("bytes") if lim.get("applies") else None
    if oom_kills_now is not None and kills_then is not None and oom_kills_now > kills_then:
        at = f" at the {fmt_bytes(limit)} container limit" if limit else ""
        return "oom-kill", (f"the kernel's OOM killer ended it{at} (the cgroup's oom_kill count rose from "
                            f"{kills_then} to {oom_kills_now})")
    if limit and _at_limit(t, used, int(limit)):
        return "limit", (f"the {fmt_bytes(limit)} container limit was reached ({lim.get('source') or 'cgroup'}): the "
                         f"kernel's OOM killer ends a process there with SIGKILL")
    err = capsule.get("last_error") or {}
    end = float(t[-1]) if t else float(capsule.get("written") or 0.0)
    if err.get("cuda") and end - float(err.get("t") or 0.0) <= CUDA_ERROR_RECENT_S:
        cell = f" in cell [{err['cell']}]" if err.get("cell") is not None else ""
        return "cuda-error", f"a CUDA error was recorded just before{cell}: {err.get('error', '')}"
    total = s.get("total") or []
    host = _last(total)
    if not limit and host and _at_limit(t, used, int(host)):
        return "host-memory", "the machine's memory was full: the kernel's OOM killer ends the largest process"
    return exit_cause(capsule.get("exit") or {})


#: The reason labels, as ``nbmem_kernel_deaths_total{reason}`` counts them (a bounded set).
REASONS = ("oom-kill", "limit", "cuda-error", "host-memory", "killed", "crashed", "exited", "unknown")


def exit_cause(ended: Mapping[str, Any]) -> tuple[str, str]:
    """The cause from how the process ended, as the Jupyter server saw it (``{"status": -9}``), when memory
    does not explain it: a signal (negative status) or an exit code; unknown without one."""
    status = ended.get("status")
    if not isinstance(status, int):
        return "unknown", ("unknown: memory was not near a limit in its last sample (a crash in native code, an "
                           "abort, or a signal from outside, such as `kill -9`)")
    if status >= 0:
        return "exited", f"its process exited with status {status} (the server saw it end)"
    name = _signal_name(-status)
    if -status == signal.SIGKILL:
        return "killed", (f"it was killed with {name}, far from any memory limit nbmem could read: `kill -9`, or an "
                          f"OOM killer acting on a limit outside this container's cgroup")
    return "crashed", (f"it ended with {name}: a crash in native code (an extension, a driver) or an abort "
                       f"(a fatal error in C++ or CUDA)")


def _signal_name(n: int) -> str:
    try:
        return f"{signal.Signals(n).name} (signal {n})"
    except ValueError:
        return f"signal {n}"


def explain(capsule: Mapping[str, Any], oom_kills_now: int | None = None) -> Death:
    """A dead kernel's capsule as the story told after the restart."""
    s = capsule.get("samples") or {}
    t = s.get("t") or []
    rss = s.get("rss") or []
    lim = capsule.get("limit") or {}
    cause, text = cause_of(capsule, oom_kills_now)
    growth, span = _growth(t, rss, GROWTH_WINDOW_S)
    cell = capsule.get("cell") or {}
    owners = tuple((str(o.get("name", "")), str(o.get("kind", "")), str(o.get("device", "")), int(o.get("bytes", 0)))
                   for o in (capsule.get("owners") or [])[:TOP_OWNERS])
    gpus = tuple((dev, _last(g.get("allocated") or []), _last(g.get("reserved") or []), _last(g.get("process") or []))
                 for dev, g in sorted((s.get("gpus") or {}).items()))
    held = capsule.get("host") or {}
    host = tuple((str(h.get("name", "")), str(h.get("what", "")), int(h.get("bytes", 0)), bool(h.get("partial")),
                  str(h.get("uncounted") or "")) for h in (held.get("holders") or [])[:TOP_OWNERS])
    series = [("cpu", what, tuple(s.get(what) or ())) for what in ("rss", "used", "total")]
    series += [(dev, what, tuple(g.get(what) or ())) for dev, g in sorted((s.get("gpus") or {}).items())
               for what in ("allocated", "reserved", "process")]
    return Death(
        pid=int(capsule.get("pid", 0)), notebook=str(capsule.get("notebook") or ""),
        last_seen_wall=float(t[-1]) if t else float(capsule.get("written") or 0.0),
        cell=cell.get("number"), first_line=str(cell.get("first_line", "")), cell_started_wall=cell.get("started"),
        rss_bytes=_last(rss), used_bytes=_last(s.get("used") or []), total_bytes=_last(s.get("total") or []),
        limit_source=str(lim.get("source") or "") if lim.get("applies") else "",
        growth_bytes=growth, growth_s=span, cause=cause, cause_text=text, owners=owners, gpus=gpus, host=host,
        host_note=str(held.get("reason") or "") if host else "",
        matched_by="" if capsule.get("claimed_by") in (None, "notebook", "kernel id") else str(capsule["claimed_by"]),
        times=tuple(float(x) for x in t), series=tuple((d, w, v) for d, w, v in series if len(v) == len(t)))


def with_pressure(report: CellReport, samples: Sequence[Sample]) -> CellReport:
    """The cell's report with the near-the-limit note, where memory crossed ``WARN_SHARE`` while it ran."""
    cpu = next((r for r in report.records if r.device == "cpu"), None)
    since = min((r.started for r in report.records), default=0.0)
    note = pressure_note(samples, since=since, findings=report.findings,
                         rss_delta_bytes=cpu.delta_rss_bytes if cpu else None)
    return replace(report, notes=(*report.notes, note)) if note else report
