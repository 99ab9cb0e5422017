"""The flight recorder: a small capsule on disk that outlives a kernel killed without warning.

A kernel killed by the OOM killer (SIGKILL) takes everything nbmem sampled with it. So the sampler
thread keeps a capsule for this kernel on disk: the last two minutes of samples (RSS, the memory limit,
each GPU's allocated / reserved / process bytes), the running cell (number, first line, start), the last
owner rows (names, kinds, bytes), the notebook's path where the server tells it, the PID and start time.
It also names the biggest holders of host memory the notebook's names reach (``hostheld``: arrays,
DataFrames, buffers, CPU tensors, by their own sizes), read on the sampler thread when a cell ended and
every ``HOST_EVERY_S`` while one runs. It holds numbers and names only: never a tensor's values, a cell's
output or a whole cell's source.

Which kernel's death the next kernel tells: the same notebook's (where the server names it), else the same
Jupyter kernel id (a server's kernels), else the same connection file started by the same process (a
``jupyter_client.KernelManager`` without a server restarts its kernel with the connection file it made),
else, for a kernel with none of these (a terminal IPython), one started by the same parent process.

Writes are atomic (a temporary file, then ``os.replace``), by the sampler thread: at most every
``WRITE_EVERY_S``, and at the next tick when a cell started or ended; bounded to ``MAX_BYTES``;
owner-only (file 0o600 in a 0o700 directory).
A clean end (``%unload_ext nbmem``, kernel shutdown, interpreter exit) removes it; one left behind by a
process that is gone is a death, which the next kernel of the same notebook tells (``deaths``). A dead
kernel's capsule that no kernel claimed is removed ``STALE_S`` (7 days) after its last write by the next
kernel that loads nbmem; a live process's capsule never is.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbmem.holders.hostheld import scan_host
from nbmem.holders.walk import Root
from nbmem.measure.limits import oom_kills_of
from nbmem.recorder.deaths import Death, explain
from nbmem.records import Holders, Sample, Tick

Listener = Callable[[Any], None]

FORMAT = "nbmem-flight/1"
WRITE_EVERY_S = 2.0
WINDOW_S = 120.0
MAX_BYTES = 256 * 1024
TOP_OWNERS = 10
FIRST_LINE_CHARS = 160
ERROR_CHARS = 300
#: Capsules of dead kernels no notebook claimed are removed this long after their last write (7 days).
STALE_S = 7 * 24 * 3600.0
#: How often the holders of host memory are read again while a cell runs (and once when it ends).
HOST_EVERY_S = 10.0
_CONNECTION_FILE = re.compile(r"kernel-([0-9A-Za-z-]+)\.json\Z")
_CAPSULE_NAME = re.compile(r"kernel-(\d+)-(\d+)\.json\Z")
Roots = Callable[[], Iterable[tuple[str, Any]]]
_CUDA_ERROR = ("cuda", "cublas", "cudnn", "nccl", "device-side assert", "illegal memory access")


def flight_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where capsules live: Jupyter's runtime directory (``JUPYTER_RUNTIME_DIR`` too), else the user's cache."""
    env = os.environ if environ is None else environ
    try:
        from jupyter_core.paths import jupyter_runtime_dir

        base = Path(env.get("JUPYTER_RUNTIME_DIR") or jupyter_runtime_dir())
    except Exception:
        return cache_flight_dir(env)
    return base / "nbmem-flight"


def cache_flight_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The user's cache: where capsules go when Jupyter's runtime directory cannot be written."""
    env = os.environ if environ is None else environ
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nbmem-flight"


def usable_dir(candidates: Sequence[Path]) -> Path:
    """The first of ``candidates`` that can be made private; an OSError naming why none could."""
    errors = []
    for d in candidates:
        try:
            return private_dir(d)
        except OSError as e:
            errors.append(f"{d}: {e.strerror or e}")
    raise OSError("no directory for the flight recorder's capsule (" + "; ".join(errors) + ")")


def kernel_id(argv: Sequence[str] | None = None) -> str:
    """The Jupyter kernel id, from the connection file the kernel was started with (``-f kernel-<id>.json``);
    it survives a restart, unlike the PID."""
    for arg in (sys.argv if argv is None else argv):
        m = _CONNECTION_FILE.search(os.path.basename(arg))
        if m:
            return m.group(1)
    return ""


def connection_file(argv: Sequence[str] | None = None) -> str:
    """The connection file the kernel was started with (``-f X``, ``--f=X``, ``--IPKernelApp.connection_file=X``),
    as an absolute path, or "". Only its path is kept: the file holds the kernel's key."""
    args = list(sys.argv if argv is None else argv)
    for i, arg in enumerate(args):
        for flag in ("-f", "--f", "--IPKernelApp.connection_file"):
            if arg == flag and i + 1 < len(args):
                return os.path.abspath(args[i + 1])
            if arg.startswith(flag + "="):
                return os.path.abspath(arg[len(flag) + 1:])
    return ""


def parent_process(environ: Mapping[str, str] | None = None) -> tuple[int, float] | None:
    """(PID, start time) of the process that started this kernel: jupyter_client's ``JPY_PARENT_PID`` (the
    manager, through any wrapper script), else the parent; None when it is gone or unknown."""
    env = os.environ if environ is None else environ
    raw = env.get("JPY_PARENT_PID", "")
    pid = int(raw) if raw.isdigit() else os.getppid()
    started = process_started(pid) if pid > 1 else None
    return None if started is None else (pid, started)


def process_started(pid: int) -> float | None:
    """When a process started (epoch seconds), or None when there is none with that PID."""
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:
        return None


def first_line(source: str) -> str:
    """The cell's first line with text, cut short: what names the cell without keeping the cell."""
    line = next((ln.strip() for ln in source.splitlines() if ln.strip()), "")
    return line if len(line) <= FIRST_LINE_CHARS else line[:FIRST_LINE_CHARS - 1] + "…"


def error_text(error: BaseException | None) -> tuple[str, bool]:
    """(what the capsule keeps of an error, whether it is CUDA's): a CUDA error's message (it names the
    failure), otherwise only the exception's type, since a message can quote the user's data."""
    if error is None:
        return "", False
    name = type(error).__name__
    msg = f"{error}"
    cuda = any(s in f"{name}: {msg}".lower() for s in _CUDA_ERROR)
    return (f"{name}: {msg}"[:ERROR_CHARS] if cuda else name), cuda


def _user_cell(info: Any) -> bool:
    """Whether a run is a cell the user ran: it keeps history and is not silent (a cell magic's body is neither)."""
    return bool(getattr(info, "store_history", False)) and not getattr(info, "silent", False)


def write_private(directory: Path, name: str, data: bytes) -> None:
    """Write ``directory/name`` atomically, owner-only."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)  # mkstemp: mode 0o600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, directory / name)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def private_dir(path: Path) -> Path:
    """Make ``path`` (mode 0o700); an existing one of ours is narrowed to 0o700 too."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


class FlightRecorder:
    """This kernel's capsule: fed by the session's records (``listen``) and the cells (``pre_run_cell``,
    ``post_run_cell``: the adapter's cell hooks pass them on).

    ``parent`` is the process that started it (``parent_process``, read when True); ``roots`` gives the
    notebook's names, whose holders of host memory it reads (``read_host``)."""

    def __init__(self, directory: Path, *, pid: int | None = None, started: float | None = None,
                 notebook: str | None = None, kernel: str | None = None, connection: str | None = None,
                 parent: tuple[int, float] | bool | None = True, roots: Roots | None = None,
                 clock: Callable[[], float] = time.time, write_every_s: float = WRITE_EVERY_S,
                 window_s: float = WINDOW_S, max_bytes: int = MAX_BYTES, host_every_s: float = HOST_EVERY_S) -> None:
        self.directory = directory
        self.pid = os.getpid() if pid is None else pid
        self.started = (process_started(self.pid) or clock()) if started is None else started
        self.notebook = os.environ.get("JPY_SESSION_NAME", "") if notebook is None else notebook
        self.kernel = kernel_id() if kernel is None else kernel
        self.connection = connection_file() if connection is None else connection
        self.parent = parent_process() if parent is True else (parent or None)
        self.roots = roots  # the notebook's names, for the holders of host memory (None: not read)
        self.host_every_s = host_every_s
        self.name = f"kernel-{self.pid}-{int(self.started)}.json"
        self._clock = clock
        self.write_every_s = write_every_s
        self.window_s = window_s
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._ticks: deque[tuple[Sample, ...]] = deque()
        self._cell: dict[str, Any] | None = None
        self._error: dict[str, Any] | None = None
        self._owners: list[dict[str, Any]] = []
        self._owners_t: float | None = None
        self._written = float("-inf")
        self._host: dict[str, Any] | None = None
        self._host_t = float("-inf")
        self._host_due = True  # at the first tick, and when a cell ends
        self._news = False  # a cell started or ended since the last write: write at the next tick
        self._closed = False
        self.writes = 0
        self.last_bytes = 0
        self.last_death: Death | None = None  # how this notebook's previous kernel died (``open_flight``)

    @property
    def path(self) -> Path:
        return self.directory / self.name

    def start(self) -> None:
        private_dir(self.directory)
        atexit.register(self.close)

    def close(self) -> None:
        """The clean end: the capsule goes (nothing died)."""
        with self._lock:
            self._closed = True
        atexit.unregister(self.close)
        try:
            os.unlink(self.path)
        except OSError:
            pass

    # -- what it is fed --------------------------------------------------------------------------------
    def listen(self, event: Any) -> None:
        """A session subscriber: samples (the sampler thread, which also writes) and owner rows."""
        if isinstance(event, Tick):
            self._tick(event.samples)
        elif isinstance(event, Holders):
            rows = [{"name": f.name[:120], "kind": f.kind.value, "device": f.device, "bytes": int(f.bytes)}
                    for f in sorted(event.findings, key=lambda f: -f.bytes)[:TOP_OWNERS]]
            with self._lock:
                self._owners, self._owners_t = rows, self._clock()

    def running(self, cell: int | None, source: str = "", error: BaseException | None = None) -> None:
        """A cell started (``cell``) or ended (None, with its error): the next tick writes it."""
        now = self._clock()
        with self._lock:
            if cell is not None:
                self._cell = {"number": cell, "first_line": first_line(source), "started": now}
                self._news = True
                return
            ended, self._cell = self._cell, None
            self._news |= ended is not None
            self._host_due |= ended is not None
            text, cuda = error_text(error)
            if text:
                self._error = {"cell": ended["number"] if ended else None, "error": text, "cuda": cuda, "t": now}

    def pre_run_cell(self, info: Any, number: int) -> None:
        """IPython's ``pre_run_cell``, passed on by the adapter's cell hooks: a user cell (``number``) started,
        measured or not. A run that is silent or keeps no history (the body a cell magic runs) is not one."""
        if _user_cell(info):
            self.running(number, getattr(info, "raw_cell", "") or "")

    def post_run_cell(self, result: Any) -> None:
        """IPython's ``post_run_cell``: the user cell ended, with its error."""
        if _user_cell(getattr(result, "info", None)):
            self.running(None, error=getattr(result, "error_in_exec", None))

    def _tick(self, samples: Sequence[Sample]) -> None:
        if not samples:
            return
        now = samples[0].t_wall
        with self._lock:
            self._ticks.append(tuple(samples))
            while self._ticks and self._ticks[0][0].t_wall < now - self.window_s:
                self._ticks.popleft()
            due = self._news or self._clock() - self._written >= self.write_every_s
            host = self.roots is not None and (self._host_due or (
                self._cell is not None and self._clock() - self._host_t >= self.host_every_s))
        if host:
            self.read_host()
            due = True
        if due:
            self.write()

    def read_host(self) -> None:
        """Read the biggest holders of host memory (``hostheld``, bounded in time) for the next write."""
        assert self.roots is not None
        with self._lock:
            self._host_due, self._host_t = False, self._clock()
        try:
            host = scan_host(self.roots()).to_json()
        except Exception as e:  # kept as words only: a traceback would keep the notebook's objects alive
            host = {"holders": [], "reason": f"the notebook's names could not be read ({type(e).__name__})"}
        with self._lock:
            self._host = {**host, "t": self._clock()}

    # -- the capsule -------------------------------------------------------------------------------------
    def capsule(self, *, thin: int = 1) -> dict[str, Any]:
        """What is written: numbers and names only (every ``thin``-th sample, to stay under the bound)."""
        with self._lock:
            ticks = list(self._ticks)[::-1][::thin][::-1]
            cell, error, owners, owners_t, host = (self._cell, self._error, list(self._owners), self._owners_t,
                                                   self._host)
        cpu = [next((s for s in t if s.device == "cpu"), None) for t in ticks]
        gpus: dict[str, dict[str, list[int | None]]] = {}
        for i, t in enumerate(ticks):
            for s in t:
                if s.device == "cpu":
                    continue
                g = gpus.setdefault(s.device, {"allocated": [None] * len(ticks), "reserved": [None] * len(ticks),
                                               "process": [None] * len(ticks)})
                g["allocated"][i], g["reserved"][i], g["process"][i] = (s.allocated_bytes, s.reserved_bytes,
                                                                        s.process_used_bytes)
        lim = next((c.memory_limit for c in reversed(cpu) if c is not None and c.memory_limit is not None), None)
        return {
            "format": FORMAT, "pid": self.pid, "started": self.started, "kernel_id": self.kernel,
            "notebook": self.notebook, "connection_file": self.connection,
            "parent": None if self.parent is None else {"pid": self.parent[0], "started": self.parent[1]},
            "unclaimable": Identity(self.notebook, self.kernel, self.connection, self.parent).why_unclaimable(),
            "written": self._clock(), "cell": cell, "last_error": error,
            "limit": None if lim is None else {
                "bytes": lim.limit_bytes, "applies": lim.applies, "source": lim.source, "cgroup_dir": lim.cgroup_dir,
                "oom_kills": lim.oom_kills, "host_total": lim.host_total_bytes, "reason": lim.reason},
            "samples": {
                "t": [round(t[0].t_wall, 2) for t in ticks],
                "rss": [c.rss_bytes if c else None for c in cpu],
                "used": [c.host_used_bytes if c else None for c in cpu],
                "total": [c.host_total_bytes if c else None for c in cpu],
                "oom_kills": [c.memory_limit.oom_kills if c and c.memory_limit else None for c in cpu],
                "gpus": gpus,
            },
            "owners": owners, "owners_t": owners_t, "host": host,
        }

    def encode(self) -> bytes:
        """The capsule as JSON, under ``max_bytes``: older samples are thinned until it fits."""
        thin = 1
        while True:
            data = json.dumps(self.capsule(thin=thin), separators=(",", ":")).encode()
            if len(data) <= self.max_bytes or thin > 1024:
                return data
            thin *= 2

    def write(self) -> None:
        data = self.encode()
        with self._lock:
            if self._closed:
                return
            write_private(self.directory, self.name, data)
            self._written, self._news = self._clock(), False
            self.writes += 1
            self.last_bytes = len(data)


# -- reading capsules back -----------------------------------------------------------------------------
def read_capsule(path: Path) -> dict[str, Any] | None:
    """A capsule, or None when it is not one (unreadable, too big, another format)."""
    try:
        if path.stat().st_size > 4 * MAX_BYTES:
            return None
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def is_alive(capsule: Mapping[str, Any]) -> bool:
    """Whether the capsule's process still runs: its PID, started when the capsule says (PIDs are reused)."""
    started = process_started(int(capsule.get("pid", -1)))
    return started is not None and abs(started - float(capsule.get("started", 0.0))) < 2.0


@dataclass(frozen=True)
class Identity:
    """What a kernel is known by, across a restart: see ``claims``."""

    notebook: str = ""
    kernel: str = ""
    connection: str = ""  # the connection file's path
    parent: tuple[int, float] | None = None  # (PID, start time) of the process that started it

    def why_unclaimable(self) -> str:
        """Why no later kernel could tell this one's death, or "" when one can."""
        if self.notebook or self.kernel or self.connection or self.parent:
            return ""
        return "it had no notebook path, Jupyter kernel id, connection file or parent process nbmem could read"


def identity_of(capsule: Mapping[str, Any]) -> Identity:
    p = capsule.get("parent") or {}
    parent = (int(p["pid"]), float(p["started"])) if isinstance(p, dict) and "pid" in p and "started" in p else None
    return Identity(str(capsule.get("notebook") or ""), str(capsule.get("kernel_id") or ""),
                    str(capsule.get("connection_file") or ""), parent)


def _same_process(a: tuple[int, float] | None, b: tuple[int, float] | None) -> bool:
    return a is not None and b is not None and a[0] == b[0] and abs(a[1] - b[1]) < 2.0


def claims(me: Identity, theirs: Identity) -> str:
    """How a dead kernel's capsule is this kernel's notebook's, in words for the story ("" when it is not),
    the surest first: the notebook path where both know one; else the Jupyter kernel id (kept across a
    restart); else the connection file, from the same process (a KernelManager without a server restarts
    its kernel with the file it made; a file name can come again later, a process cannot); else, where
    neither knows any of these, the same parent process."""
    if theirs.notebook and me.notebook:
        return "notebook" if theirs.notebook == me.notebook else ""
    if theirs.kernel and me.kernel:
        return "kernel id" if theirs.kernel == me.kernel else ""
    if theirs.connection and me.connection:
        if theirs.connection != me.connection:
            return ""
        if theirs.parent and me.parent and not _same_process(theirs.parent, me.parent):
            return ""
        return (f"its connection file, {theirs.connection}, which this kernel was started with too (by a kernel "
                f"manager without a Jupyter server, which names no notebook)")
    if not (theirs.notebook or theirs.kernel or theirs.connection or me.notebook or me.kernel or me.connection):
        if _same_process(theirs.parent, me.parent):
            assert me.parent is not None
            return (f"its parent process (PID {me.parent[0]}), the only thing nbmem knew it by: it had no notebook "
                    f"path, Jupyter kernel id or connection file")
    return ""


def take_dead(directory: Path, *, notebook: str, kernel: str, connection: str = "",
              parent: tuple[int, float] | None = None, now: float | None = None,
              alive: Callable[[Mapping[str, Any]], bool] = is_alive) -> dict[str, Any] | None:
    """The newest capsule this notebook's dead kernel left, removed so it is told once, with how it was
    matched (``"claimed_by"``). A dead kernel's capsule no kernel claimed is removed ``STALE_S`` after its
    last write, and so is a half-written temporary file; a live process's capsule never is."""
    now = time.time() if now is None else now
    me = Identity(notebook, kernel, connection, parent)
    try:
        paths = sorted(directory.glob("kernel-*.json"))
        temps = sorted(directory.glob(".tmp-*.json"))
    except OSError:
        return None
    for p in temps:  # a write cut short by a kill: a live writer's temporary file lives milliseconds
        if now - _mtime(p) > STALE_S:
            _unlink(p)
    mine: list[tuple[float, Path, dict[str, Any], str]] = []
    for p in paths:
        c = read_capsule(p)
        if c is None:
            _remove_stale_other(p, now)
            continue
        if alive(c):
            continue
        how = claims(me, identity_of(c))
        if how:
            mine.append((float(c.get("written") or 0.0), p, c, how))
        elif now - (float(c.get("written") or 0.0) or _mtime(p)) > STALE_S:  # its own clock, else the file's
            _unlink(p)
    if not mine:
        return None
    mine.sort(key=lambda x: x[0])
    for _, p, _, _ in mine:
        _unlink(p)
    return {**mine[-1][2], "claimed_by": mine[-1][3]}


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return float("inf")  # gone or unreadable: never "old"


def _remove_stale_other(p: Path, now: float) -> None:
    """A file that is not a capsule this version reads (another version's, a torn one): removed when it is
    older than ``STALE_S`` and the process its name gives is gone."""
    m = _CAPSULE_NAME.search(p.name)
    if m is None or now - _mtime(p) <= STALE_S:
        return
    started = process_started(int(m.group(1)))
    if started is None or abs(started - int(m.group(2))) >= 2.0:
        _unlink(p)


def _unlink(p: Path) -> None:
    try:
        p.unlink()
    except OSError:
        pass


def open_flight(subscribe: Callable[[Listener], Callable[[], None]], directory: Path | None = None, *,
                roots: Callable[[], Iterable[Root]] | None = None) -> FlightRecorder:
    """Read the capsule this notebook's dead kernel left (told once: ``last_death``), then start this
    kernel's, fed through ``subscribe`` (``Session.subscribe``: ticks on the sampler thread, which writes);
    ``roots`` gives the notebook's names for the holders of host memory."""
    names = None if roots is None else (lambda: ((r.path, r.obj) for r in roots()))
    rec = FlightRecorder(directory or usable_dir([flight_dir(), cache_flight_dir()]), roots=names)
    dead = take_dead(rec.directory, notebook=rec.notebook, kernel=rec.kernel, connection=rec.connection,
                     parent=rec.parent)
    if dead is not None:
        # The cgroup that held the dead kernel is read again: a count that rose after its last sample is the OOM killer.
        rec.last_death = explain(dead, oom_kills_of(str((dead.get("limit") or {}).get("cgroup_dir") or "")))
    rec.start()
    subscribe(rec.listen)
    return rec
