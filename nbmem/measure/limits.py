"""The memory limit that actually applies to this kernel: its cgroup's, or JupyterHub's ``MEM_LIMIT``.

In a container (Docker, Kubernetes, JupyterHub) the kernel is killed at the cgroup's limit, not at the
host's RAM that ``psutil.virtual_memory()`` reports. This module finds the kernel's own memory cgroup
(``/proc/self/cgroup`` and ``/proc/self/mountinfo``, v1 or v2), and reads the lowest limit on the way to
the root, what counts against it and how often its OOM killer ran. Everything is read under an injectable
``root`` so tests use fixture directories. Measurement only: files are read, never written. A value the
machine does not give stays ``None`` with the reason, never 0.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from nbmem.records import MemoryLimit

#: At or above this a v1 limit means "no limit" (the kernel's PAGE_COUNTER_MAX, page-rounded, is 2**63 - 4096).
V1_UNLIMITED = 2**62
def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def _keyed(text: str | None) -> dict[str, int]:
    """``key value`` lines (memory.stat, memory.events, memory.oom_control) as a dict."""
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _inside(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


@dataclass(frozen=True, slots=True)
class _Mount:
    point: str  # where it is mounted
    base: str  # which part of the hierarchy is mounted there


def _mounts(root: Path) -> dict[str, _Mount]:
    """The memory controller's v1 mount (``"v1"``) and the v2 mount (``"v2"``), from mountinfo."""
    out: dict[str, _Mount] = {}
    for line in (_read(root / "proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) < 5 or len(r) < 3:
            continue
        if r[0] == "cgroup2":
            out.setdefault("v2", _Mount(f[4], f[3]))
        elif r[0] == "cgroup" and "memory" in r[2].split(","):
            out.setdefault("v1", _Mount(f[4], f[3]))
    return out


class Cgroup:
    """This process's memory cgroup, found once; ``read()`` is a few small file reads (every sample)."""

    def __init__(self, root: str | Path = "/", environ: Mapping[str, str] | None = None) -> None:
        self.root = Path(root)
        self.environ = os.environ if environ is None else environ
        self.version: int | None = None
        self.dirs: list[Path] = []  # the cgroup's directory, then its ancestors up to the mount (v2)
        self.reason = ""
        try:
            self._find()
        except Exception as e:  # a malformed file is "unknown", never an error in the user's kernel
            self.version, self.dirs, self.reason = None, [], f"the cgroup files could not be read ({e})"

    def _find(self) -> None:
        text = _read(self.root / "proc/self/cgroup")
        if text is None:
            self.reason = "no /proc/self/cgroup (not Linux, or /proc is not mounted)"
            return
        v1 = v2 = None
        for line in text.splitlines():
            hid, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            if "memory" in controllers.split(","):
                v1 = path
            elif hid == "0" and controllers == "":
                v2 = path
        mounts = _mounts(self.root)
        if v1 is not None:
            self._use(1, v1, mounts.get("v1", _Mount("/sys/fs/cgroup/memory", "/")), "memory.limit_in_bytes")
        elif v2 is not None:
            self._use(2, v2, mounts.get("v2", _Mount("/sys/fs/cgroup", "/")), "memory.current")
        else:
            self.reason = "this process is in no memory cgroup"

    def _use(self, version: int, path: str, m: _Mount, probe: str) -> None:
        mount = _inside(self.root, m.point)
        rel = os.path.relpath(path, m.base) if path.startswith(m.base) else path.lstrip("/")
        own = (mount / rel).resolve() if rel not in ("", ".") else mount
        if not (own / probe).exists():
            # A container that sees the host's path to its cgroup has its own cgroup at the mount's root.
            own = mount
        if not (own / probe).exists():
            self.reason = (f"no {probe} for this process's cgroup under {mount} (the memory controller is not "
                           f"enabled there)")
            return
        self.version = version
        self.dirs = [own]
        if version == 2:
            d = own
            while d != mount and mount in d.parents:
                d = d.parent
                self.dirs.append(d)

    def read(self, host_total_bytes: int | None = None) -> MemoryLimit:
        """The limit that binds (the lowest on the way up, or ``MEM_LIMIT``), its usage and OOM kills."""
        hub = _int(self.environ.get("MEM_LIMIT"))
        hub = hub if hub and hub > 0 else None
        if self.version is None:
            if hub is not None:
                return MemoryLimit(hub, None, None, "JupyterHub's MEM_LIMIT", host_total_bytes=host_total_bytes)
            return MemoryLimit(None, None, None, "", reason=self.reason, host_total_bytes=host_total_bytes)
        lim = self._read_v1() if self.version == 1 else self._read_v2()
        if lim.limit_bytes is None and lim.reason:
            return lim if hub is None else MemoryLimit(hub, None, None, "JupyterHub's MEM_LIMIT",
                                                        host_total_bytes=host_total_bytes)
        if hub is not None and (lim.limit_bytes is None or hub < lim.limit_bytes):
            lim = MemoryLimit(hub, lim.usage_bytes, lim.oom_kills, "JupyterHub's MEM_LIMIT", lim.cgroup_dir)
        return MemoryLimit(lim.limit_bytes, lim.usage_bytes, lim.oom_kills, lim.source, lim.cgroup_dir, lim.reason,
                           host_total_bytes)

    def _read_v1(self) -> MemoryLimit:
        d = self.dirs[0]
        stat = _keyed(_read(d / "memory.stat"))
        own = _int(_read(d / "memory.limit_in_bytes"))
        # memory.stat's hierarchical limit is the lowest of this cgroup's and its ancestors'.
        limit = stat.get("hierarchical_memory_limit", own)
        if limit is None:
            return MemoryLimit(None, None, None, "", reason=f"{d / 'memory.limit_in_bytes'} could not be read")
        usage = _int(_read(d / "memory.usage_in_bytes"))
        if usage is not None:
            usage = max(0, usage - stat.get("total_inactive_file", 0))
        kills = _keyed(_read(d / "memory.oom_control")).get("oom_kill")
        src = "cgroup v1 memory.limit_in_bytes" if limit == own else "cgroup v1 hierarchical_memory_limit"
        return MemoryLimit(None if limit >= V1_UNLIMITED else limit, usage, kills, src, str(d))

    def _read_v2(self) -> MemoryLimit:
        best: tuple[int, Path] | None = None
        for d in self.dirs:
            raw = (_read(d / "memory.max") or "").strip()
            if raw and raw != "max" and raw.isdigit() and (best is None or int(raw) < best[0]):
                best = (int(raw), d)
        where = best[1] if best else self.dirs[0]
        usage = _int(_read(where / "memory.current"))
        if usage is not None:
            usage = max(0, usage - _keyed(_read(where / "memory.stat")).get("inactive_file", 0))
        kills = _keyed(_read(where / "memory.events")).get("oom_kill")
        return MemoryLimit(best[0] if best else None, usage, kills, "cgroup v2 memory.max", str(where))


def oom_kills_of(cgroup_dir: str) -> int | None:
    """The OOM-kill count of a cgroup directory read earlier (v1 or v2), None where it is gone."""
    d = Path(cgroup_dir) if cgroup_dir else None
    if d is None:
        return None
    for name in ("memory.events", "memory.oom_control"):
        n = _keyed(_read(d / name)).get("oom_kill")
        if n is not None:
            return n
    return None


def applied(lim: MemoryLimit, host_total_bytes: int | None, host_used_bytes: int | None) -> tuple[int | None,
                                                                                                   int | None]:
    """(total, used) of the memory this process may use: the host's, or the limit's where it is lower (used
    is then what the cgroup charges, unknown without one: the host's figure counts other containers)."""
    if not lim.applies:
        return host_total_bytes, host_used_bytes
    return lim.limit_bytes, lim.usage_bytes
