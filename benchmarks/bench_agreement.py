"""Where the fit's gap comes from (issue 47): the allocator model alone on real traces, and the fit's extrapolation.

    PYTHONPATH=. python3 benchmarks/bench_agreement.py --quick      # needs CUDA; meant for under 4 minutes
    PYTHONPATH=. python3 benchmarks/bench_agreement.py              # 4 bodies, 6 values each: under 8 minutes
    PYTHONPATH=. python3 benchmarks/bench_agreement.py --quick --save-traces tests/data/traces   # + the CPU test's

The bodies are bench_fit's (``mlp``, ``lm-bf16``, ``cnn-bn``, and ``lstm`` in the full run), each from its
``fresh`` state (model and optimizer made, no step run). A *try* at a value runs ``--steps`` training steps in a
row (3, as bench_fit's real boundary: what one step leaves is there while the next runs), from that state put
back, with the cache emptied and the cuBLAS workspaces the last try made given back; only
``torch.cuda.OutOfMemoryError`` counts as a failure (anything else stops the body, which says so).

Part A, the allocator replay alone: under a cap of ``--cap-gib`` (``set_per_process_memory_fraction`` of the
device's total: the allocator's segments may add up to ``int(fraction × total)`` bytes, which is the model's
capacity), the real boundary by bisection to one unit (the largest value whose try runs, and the next, which fails:
lo and hi); then at values around it (lo − 5 %, lo − 2 %, lo, hi, hi + 2 %, hi + 5 %; ``--quick`` leaves out the
5 %) one recorded try each, and that try's real trace (its requests and frees in order, from the allocator's segments
just before it) replayed through ``CachingAllocatorModel`` at the same capacity, with new segments placed above all
others and below them (the model fits only where both fit, as the prediction does). Where the real try failed, the
model must refuse the request that failed it; a request the real allocator refused and the try survived (cuDNN
takes another algorithm) is replayed as a request too. Table A's columns:

- real / model: the try's outcome, and the model's (``OOM`` where it refused a request);
- agree: ``yes``, ``model fails, real ran`` (errs low), or ``MODEL FITS, REAL FAILED`` (must never be);
- where: for a failure, the request (counted from the try's first) the model refused, against the real one;
- real / model peak reserved: the allocator's peak (``max_memory_reserved``) and the model's replay, in MiB.

Part B, the extrapolation: with all but ``--cap-gib`` of the device held by one tensor, ``nbmem``'s fit
(``nbmem.fitting.runs.runner.fit``, as bench_fit calls it); the timeline its last analysis built (the one the
answer is from) is simulated at the answer, and a recorded try at the answer gives the real trace to hold it
against. Table B's columns, real then synthesised:

- fit's runs: the values the fit ran (the warm-up left out), the last ones near its answer;
- allocations: requests in the three steps (the fit's timeline: its first run, then its steady run twice);
- in order ±10 %: the share of the real requests the synthesised ones have in the same order, each within
  10 % of the real size (the longest common subsequence); same block: the same, to the 512-byte block;
- bytes requested, the largest request;
- peak allocated / reserved: above what was allocated / reserved before the try (the held tensor left out).

``--save-traces DIR``: Part A again for ``mlp``, ``cnn-bn`` and ``lm-bf16`` under ``--save-cap-gib`` (1 GiB), each
recorded try written to ``DIR`` with its real outcome (json, gzip above 200 kB, none above 300 kB), for
``tests/test_agreement.py`` to replay on the CPU (``--parts ''``: those tries only). Without CUDA it prints one
line and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
# This checkout's nbmem, not whichever one pip installed in editable mode (harness.py says why).
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, os.path.dirname(HERE))

from nbmem.fitting.analysis.allocator import CachingAllocatorModel, SegmentState  # noqa: E402
from nbmem.records import block_bytes  # noqa: E402

GiB, MiB = 2**30, 2**20
NEEDS_CUDA = "bench_agreement: needs CUDA (nothing measured)"
BODIES = ("mlp", "lm-bf16", "cnn-bn", "lstm")
QUICK_BODIES = ("mlp", "lm-bf16", "cnn-bn")
SAVE_BODIES = ("mlp", "cnn-bn", "lm-bf16")
#: Around the boundary (lo: the largest value that ran, hi: the smallest that failed): (relative to, factor, label).
AROUND = (("lo", 0.95, "lo − 5 %"), ("lo", 0.98, "lo − 2 %"), ("lo", 1.0, "lo"), ("hi", 1.0, "hi"),
          ("hi", 1.02, "hi + 2 %"), ("hi", 1.05, "hi + 5 %"))
QUICK_AROUND = AROUND[1:5]
#: The trace's buffer: a try that fills it lost its first events and is not replayed.
MAX_ENTRIES = 1_000_000
#: The actions a replay reads (the recording skips ``free_completed`` and ``snapshot``, as the fit's does).
ACTIONS = ("alloc", "free_requested", "segment_alloc", "segment_free", "oom")
TRACE_FORMAT = 1
GZIP_ABOVE_BYTES = 200_000
MAX_FILE_BYTES = 300_000
SIZE_TOLERANCE = 0.10
#: A bisection step may still start this long after ``--budget-s``; a body or part may not.
GRACE_S = 60.0


# -- pure: the replay of a real trace through the allocator model -------------------------------------------------
def slim(entries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The trace entries a replay reads, without stacks or times (an ``oom`` has ``device_free``, not ``addr``)."""
    out = []
    for e in entries:
        action = e.get("action")
        if action not in ACTIONS:
            continue
        d: dict[str, Any] = {"action": action, "size": int(e.get("size", 0)), "stream": int(e.get("stream", 0))}
        if action == "oom":
            d["device_free"] = int(e.get("device_free", 0))
        else:
            d["addr"] = int(e.get("addr", 0))
        out.append(d)
    return out


@dataclass(frozen=True)
class Replay:
    """A real trace replayed through the model with one placement of new segments (above or below the others)."""

    ok: bool  # the model met every request the real try met, and the one that failed it where it failed
    refused_at: int | None  # the request (1 = the try's first) the model refused; None where it met them all
    requests: int  # requests replayed (to the model's refusal, or the real failure)
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    met_refused: int = 0  # requests the real allocator refused (the try went on) that the model met
    unknown_frees: int = 0  # frees of blocks neither the trace nor the segments before it had
    ties: int = 0  # large requests with free blocks of one size to choose from: addresses decide only these


def requests_in(entries: Sequence[Mapping[str, Any]]) -> tuple[int, int | None]:
    """How many requests a try's trace has (met or refused), and which (1 = first) is its last ``oom``: the one
    that failed the try where it failed; None where it has none."""
    n = fatal = 0
    for e in entries:
        action = e.get("action")
        if action == "oom" or (action == "alloc" and int(e.get("size", 0)) > 0):
            n += 1
            if action == "oom":
                fatal = n
    return n, fatal or None


def replay(entries: Sequence[Mapping[str, Any]], segments: Sequence[SegmentState], capacity_bytes: float, *,
           failed: bool, descending: bool = False) -> Replay:
    """The try's requests and frees, in order, through ``CachingAllocatorModel(capacity_bytes, segments)``.

    Stops at the first request the model refuses that the real allocator met, or, where the try failed
    (``failed``), at the request that failed it (its last ``oom``); a refused request the try survived is tried
    in the model too, and given back at once if the model met it (the real allocator never had it).
    """
    model = CachingAllocatorModel(capacity_bytes, segments, descending=descending)
    fatal = requests_in(entries)[1] if failed else None
    held = {addr for s in segments if s.usable for addr, _, allocated in s.blocks if allocated}
    mine: dict[int, int] = {}  # the real block's address -> the model's
    requests = met_refused = unknown = 0

    def done(ok: bool, refused: int | None) -> Replay:
        return Replay(ok, refused, requests, model.peak_allocated_bytes, model.peak_reserved_bytes, met_refused,
                      unknown, model.ties)

    for e in entries:
        action = e.get("action")
        size, stream = int(e.get("size", 0)), int(e.get("stream", 0))
        if action == "alloc" and size > 0:
            requests += 1
            addr = int(e.get("addr", 0))
            old = mine.pop(addr, None)
            if old is not None:  # the address came back before its free was seen: the free was not recorded
                model.free(old)
            got = model.malloc(size, stream)
            if got is None:
                return done(False, requests)
            mine[addr] = got
        elif action == "free_requested":
            addr = int(e.get("addr", 0))
            got = mine.pop(addr, None)
            if got is None and addr in held:  # a block from before the try: the model has it at its real address
                held.discard(addr)
                got = addr
            if got is None:
                unknown += 1
                continue
            model.free(got)
        elif action == "oom":
            requests += 1
            got = model.malloc(size, stream)
            if requests == fatal:
                return done(got is not None, None if got is not None else requests)
            if got is not None:
                met_refused += 1
                model.free(got)
    return done(True, None)


@dataclass(frozen=True)
class Verdict:
    """A try's real outcome beside the model's, with new segments placed above and below the others."""

    failed: bool  # the real try ran out of memory
    fatal: int | None  # the request that failed it
    requests: int  # in the try's trace, met or refused
    up: Replay
    down: Replay

    @property
    def model_ok(self) -> bool:
        return self.up.ok and self.down.ok

    @property
    def agrees(self) -> bool:
        return self.model_ok != self.failed

    @property
    def unsafe(self) -> bool:
        """The model fits a try that failed: the one error the fit must never make."""
        return self.model_ok and self.failed

    @property
    def peak_reserved_bytes(self) -> int:
        return max(self.up.peak_reserved_bytes, self.down.peak_reserved_bytes)

    @property
    def refused_at(self) -> int | None:
        return min((r.refused_at for r in (self.up, self.down) if r.refused_at is not None), default=None)

    def agreement(self) -> str:
        if self.unsafe:
            return "MODEL FITS, REAL FAILED"
        return "yes" if self.agrees else "model fails, real ran"

    def model(self) -> str:
        if self.up.ok == self.down.ok:
            return "ok" if self.model_ok else "OOM"
        return "OOM (new segments above)" if not self.up.ok else "OOM (new segments below)"

    def where(self) -> str:
        """For a failure, which request the model refused, against the real one."""
        at = self.refused_at
        if self.failed and self.fatal is not None:
            if at is None:
                return f"met request {self.fatal:,}, which failed"
            return "the same request" if at == self.fatal else f"request {at:,}, {self.fatal - at:,} before"
        return "" if at is None else f"request {at:,} of {self.requests:,}"


def judge(entries: Sequence[Mapping[str, Any]], segments: Sequence[SegmentState], capacity_bytes: float,
          failed: bool) -> Verdict | None:
    """The model's verdict on one real try; None where a failed try's trace has no failed request to hold it to."""
    requests, fatal = requests_in(entries)
    if failed and fatal is None:
        return None
    return Verdict(failed, fatal if failed else None, requests,
                   replay(entries, segments, capacity_bytes, failed=failed),
                   replay(entries, segments, capacity_bytes, failed=failed, descending=True))


# -- pure: a synthesised allocation sequence against a real one ----------------------------------------------------
def in_order(real: Sequence[int], synth: Sequence[int], tolerance: float = 0.0) -> int:
    """How many of ``real``'s sizes ``synth`` has in the same order, each within ``tolerance`` of it (0: equal):
    the longest common subsequence, bit-parallel (Hyyrö 2004), so thousands of requests take milliseconds."""
    at: dict[int, int] = {}
    for j, s in enumerate(synth):
        at[s] = at.get(s, 0) | (1 << j)
    full = (1 << len(synth)) - 1
    masks: dict[int, int] = {}
    v = full
    for x in real:
        m = masks.get(x)
        if m is None:
            m = 0
            for y, bits in at.items():
                if y == x or (tolerance and abs(y - x) <= tolerance * max(x, y)):
                    m |= bits
            masks[x] = m
        u = v & m
        v = ((v + u) | (v - u)) & full
    return len(synth) - bin(v).count("1")


@dataclass(frozen=True)
class Compared:
    """A real try's requests beside the ones the fit's timeline makes at the same value (512-byte blocks)."""

    real: int
    synth: int
    real_bytes: int
    synth_bytes: int
    real_largest: int
    synth_largest: int
    in_order: int  # real requests matched in order within SIZE_TOLERANCE
    same_block: int  # real requests matched in order with the same block


def compare(real: Sequence[int], synth: Sequence[int]) -> Compared:
    a = [block_bytes(s) for s in real]
    b = [block_bytes(s) for s in synth]
    return Compared(len(a), len(b), sum(a), sum(b), max(a, default=0), max(b, default=0),
                    in_order(a, b, SIZE_TOLERANCE), in_order(a, b))


def requests_of(entries: Sequence[Mapping[str, Any]]) -> list[int]:
    """The sizes of the requests a trace's allocator met, in order."""
    return [int(e["size"]) for e in entries if e.get("action") == "alloc" and int(e.get("size", 0)) > 0]


# -- pure: trace files ---------------------------------------------------------------------------------------------
def segments_from_json(rows: Sequence[Mapping[str, Any]]) -> tuple[SegmentState, ...]:
    """Segments as ``dataclasses.asdict`` wrote them (bench_fit's saved traces use the same keys)."""
    return tuple(SegmentState(int(s["address"]), int(s["total_bytes"]), int(s["stream"]), bool(s["small"]),
                              tuple((int(a), int(n), bool(x)) for a, n, x in s["blocks"]), bool(s.get("usable", True)))
                 for s in rows)


def trace_name(record: Mapping[str, Any]) -> str:
    outcome = "ok" if record["real"]["ok"] else "oom"
    return f"{record['body']}-{record['capacity_bytes'] // MiB}MiB-{record['value']}-{outcome}"


def write_trace(directory: str | Path, record: Mapping[str, Any]) -> tuple[Path | None, int]:
    """One try as a file in ``directory`` (json, gzip above ``GZIP_ABOVE_BYTES``): its path, or None where it
    would be larger than ``MAX_FILE_BYTES``, and its size."""
    text = json.dumps(record, separators=(",", ":")).encode()
    path = Path(directory) / f"{trace_name(record)}.json"
    if len(text) > GZIP_ABOVE_BYTES:
        text = gzip.compress(text, mtime=0)
        path = path.with_suffix(".json.gz")
    if len(text) > MAX_FILE_BYTES:
        return None, len(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)
    return path, len(text)


def read_trace(path: str | Path) -> dict[str, Any]:
    """A try written by ``write_trace``, its segments as ``SegmentState``."""
    p = Path(path)
    raw = p.read_bytes()
    record = json.loads(gzip.decompress(raw) if p.name.endswith(".gz") else raw)
    if record.get("format") != TRACE_FORMAT:
        raise ValueError(f"{p.name}: trace format {record.get('format')!r}, this code reads {TRACE_FORMAT}")
    record["segments"] = segments_from_json(record["segments"])
    return record


def trace_files(directory: str | Path) -> list[Path]:
    d = Path(directory)
    return sorted([*d.glob("*.json"), *d.glob("*.json.gz")]) if d.is_dir() else []


# -- printing ------------------------------------------------------------------------------------------------------
def markdown(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table (for RESULTS.md), padded so it reads in a terminal too."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    head = [str(c).replace("|", "/") for c in head]
    rows = [[str(c).replace("|", "/") for c in r] for r in rows]
    return [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in rows)]


def mib(n: int | float | None) -> str:
    return "NA" if n is None else f"{n / MiB:,.1f}"


def share(part: int, whole: int) -> str:
    return "NA" if not whole else f"{100 * part / whole:.1f} %"


def fmt(n: int | None) -> str:
    return "NA" if n is None else f"{n:,}"


# -- on the GPU ----------------------------------------------------------------------------------------------------
class OutOfTime(Exception):
    """The time budget ran out during a bisection."""


@dataclass
class Try:
    """One try: ``steps`` training steps in a row at ``value``, from the body's state put back."""

    value: int
    ok: bool
    error: str
    seconds: float
    allocated_before_bytes: int
    reserved_before_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    entries: list[dict[str, Any]] | None = None  # recorded tries: the trace, slimmed
    segments: tuple[SegmentState, ...] | None = None  # recorded tries: the allocator's segments before it
    full: bool = False  # the trace filled its buffer (its first events are lost)


class Body:
    """A bench_fit family's model and optimizer on the GPU, and the state every try starts from."""

    def __init__(self, torch: Any, fam: Any, steps: int) -> None:
        from nbmem.clean.release import TorchRelease
        from nbmem.fitting.runs.state import snapshot_state

        self.torch, self.fam, self.steps = torch, fam, steps
        self.src = TorchRelease()
        self.device = torch.cuda.current_device()
        self.model = fam.make("cuda")
        self.opt = fam.optimizer(self.model)
        self.others = fam.others(self.model, self.opt)
        self.ns: dict[str, Any] = {}
        gc.collect()
        torch.cuda.empty_cache()
        self.before = torch.cuda.memory_allocated()  # what a try starts from: cuBLAS's workspaces above it go
        self.start = snapshot_state([self.model], [self.opt], self.others)

    def run(self, value: int) -> None:
        self.fam.body(self.model, self.opt, self.ns, value)

    def settle(self) -> None:
        """The cache emptied and the workspaces the last try made given back (a workspace left in place pins its
        segment, whose free part the next try's large blocks cannot use)."""
        from nbmem.fitting.runs.multigpu import give_back_workspaces

        t = self.torch
        t.cuda.synchronize()
        gc.collect()
        t.cuda.empty_cache()
        give_back_workspaces(self.src, {self.device: self.before})
        t.cuda.empty_cache()
        t.cuda.synchronize()

    def attempt(self, value: int, *, record: bool) -> Try:
        """One try; with ``record``, its trace and the segments before it. The state goes back after it, whatever
        happened; only CUDA's out-of-memory error is caught."""
        from nbmem.fitting.analysis.allocator import segments_from_snapshot
        from nbmem.fitting.runs.state import restore_state

        t = self.torch
        self.settle()
        segments = segments_from_snapshot(t.cuda.memory_snapshot(), self.device) if record else None
        allocated, reserved = t.cuda.memory_allocated(), t.cuda.memory_reserved()
        t.cuda.reset_peak_memory_stats()
        trace = self.src.start_trace(stacks=False, max_entries=MAX_ENTRIES) if record else None
        if record and trace is None:
            raise RuntimeError(f"the allocator's trace did not start: {self.src.trace_unsupported() or 'unknown'}")
        ok, error, raw = True, "", None
        started = time.perf_counter()
        try:
            for _ in range(self.steps):
                self.run(value)
            t.cuda.synchronize()
        except t.cuda.OutOfMemoryError as e:
            ok, error = False, (str(e).strip().splitlines() or ["out of memory"])[0][:160]
        finally:
            seconds = time.perf_counter() - started
            self.ns.clear()  # after the error is gone: its frames held the try's tensors
            t.cuda.synchronize()
            if trace is not None:
                raw = self.src.finish_trace(trace, read=True) or []
            peak_allocated, peak_reserved = t.cuda.max_memory_allocated(), t.cuda.max_memory_reserved()
            restore_state(self.start)
            gc.collect()
            t.cuda.empty_cache()
        got = Try(value, ok, error, seconds, allocated, reserved, peak_allocated, peak_reserved, segments=segments)
        if trace is not None and raw is not None:
            mine = raw[self.device] if self.device < len(raw) else []
            if trace.owner != "nbmem":  # a recording that was running already holds older events too
                mine = [e for e in mine if e.get("time_us", trace.since_us) >= trace.since_us]
            got.entries, got.full = slim(mine), len(mine) >= MAX_ENTRIES
        return got

    def close(self) -> None:
        self.ns.clear()
        self.settle()
        del self.model, self.opt, self.others, self.start
        gc.collect()
        self.torch.cuda.empty_cache()


@contextmanager
def capped(torch: Any, fraction: float, device: int) -> Iterator[None]:
    """``set_per_process_memory_fraction`` for the block, and back to what it was after, whatever happens."""
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch 2.6 and later
    was = get(device) if get is not None else 1.0
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(float(was), device)


@dataclass
class RowA:
    body: str
    cap_bytes: int
    value: int | None = None
    label: str = ""
    tried: Try | None = None
    verdict: Verdict | None = None
    saved: str = ""
    note: str = ""


def first_guess(body: Body, v0: int, capacity: int) -> int:
    """Where the boundary may be, from two tries at small values (their allocated peaks' slope, to 90 %)."""
    a = body.attempt(v0, record=False)
    if not a.ok:
        return max(1, v0 // 4)
    b = body.attempt(2 * v0, record=False)
    if not b.ok:
        return v0
    slope = (b.peak_allocated_bytes - a.peak_allocated_bytes) / v0
    if slope <= 0:
        return 8 * v0
    return max(v0, int(v0 + 0.9 * (capacity - a.peak_reserved_bytes) / slope))


def values_around(lo: int, hi: int, spacing: Sequence[tuple[str, float, str]]) -> list[tuple[int, str]]:
    out: dict[int, str] = {}
    for rel, factor, label in spacing:
        v = max(1, round((lo if rel == "lo" else hi) * factor))
        out.setdefault(v, label)
    return sorted(out.items())


def part_a(body: Body, cap_bytes: int, spacing: Sequence[tuple[str, float, str]], rows: list[RowA],
           hard_deadline: float, save_dir: str = "") -> None:
    """Part A for one body under one cap: the boundary, then recorded tries around it, each replayed."""
    from bench_fit import boundary

    t, fam = body.torch, body.fam
    total = int(t.cuda.mem_get_info(body.device)[1])
    fraction = min(1.0, cap_bytes / total)
    capacity = int(fraction * float(total))  # setMemoryFraction's own arithmetic (a double, truncated)
    tries: list[Try] = []

    def ok(v: int) -> bool:
        if time.perf_counter() > hard_deadline:
            raise OutOfTime
        got = body.attempt(v, record=False)
        tries.append(got)
        return got.ok

    started = time.perf_counter()
    with capped(t, fraction, body.device):
        try:
            guess = first_guess(body, fam.values[-1], capacity)
            lo, hi = boundary(ok, guess, rel=0.0)
        except OutOfTime:
            rows.append(RowA(fam.name, capacity, note="boundary not found: time budget spent"))
            return
        print(f"  {fam.name} under {mib(capacity)} MiB: runs at {fmt(lo)}, fails at {fmt(hi)} ({len(tries)} tries "
              f"from {guess:,}, {time.perf_counter() - started:.1f} s)", flush=True)
        if lo is None or hi is None:
            rows.append(RowA(fam.name, capacity, note=f"even {fam.var}=1 fails under the cap"))
            return
        for v, label in values_around(lo, hi, spacing):
            if time.perf_counter() > hard_deadline:
                rows.append(RowA(fam.name, capacity, v, label, note="not run: time budget spent"))
                continue
            row = RowA(fam.name, capacity, v, label)
            rows.append(row)
            got = row.tried = body.attempt(v, record=True)
            if got.full or got.entries is None or got.segments is None:
                row.note = f"the trace filled its {MAX_ENTRIES:,} entries: not replayed"
            else:
                row.verdict = judge(got.entries, got.segments, capacity, not got.ok)
                if row.verdict is None:
                    row.note = "the failed try's trace has no out-of-memory request: not replayed"
                if got.reserved_before_bytes != sum(s.total_bytes for s in got.segments):
                    row.note += (f" segments before {mib(sum(s.total_bytes for s in got.segments))} MiB, reserved "
                                 f"{mib(got.reserved_before_bytes)} MiB")
            if save_dir and got.entries is not None and got.segments is not None and not got.full:
                path, size = write_trace(save_dir, {
                    "format": TRACE_FORMAT, "body": fam.name, "var": fam.var, "value": v, "label": label,
                    "steps": body.steps, "capacity_bytes": capacity, "fraction": fraction,
                    "device_total_bytes": total, "device": t.cuda.get_device_name(body.device),
                    "torch": t.__version__, "recorded": time.strftime("%Y-%m-%d"),
                    "real": {"ok": got.ok, "error": got.error, "allocated_before_bytes": got.allocated_before_bytes,
                             "reserved_before_bytes": got.reserved_before_bytes,
                             "peak_allocated_bytes": got.peak_allocated_bytes,
                             "peak_reserved_bytes": got.peak_reserved_bytes},
                    "segments": [asdict(s) for s in got.segments], "entries": got.entries})
                row.saved = path.name if path is not None else f"not saved: {size:,} bytes"
            verdict = row.verdict
            said = (f"model {verdict.model()} ({verdict.agreement()}); peak reserved real "
                    f"{mib(got.peak_reserved_bytes)} MiB, model {mib(verdict.peak_reserved_bytes)} MiB" if verdict
                    else f"model NA ({row.note.strip()})")
            print(f"  {fam.name} {v:,} ({label}): real {'ok' if got.ok else 'OOM'}, {said}"
                  + (f"; {row.saved}" if row.saved else ""), flush=True)


@dataclass
class RowB:
    body: str
    answer: int | None = None
    method: str = ""
    fit_s: float | None = None
    runs: tuple[int, ...] = ()  # the values the fit ran, warm-up left out
    real_ok: bool | None = None
    compared: Compared | None = None
    real_peaks: tuple[int, int] | None = None  # allocated, reserved: above what was there before the try
    synth_peaks: tuple[int, int] | None = None
    note: str = ""
    #: part C: values above the answer, each (value, the fit's timeline fits without the margin, a real try ran)
    sweep: list[tuple[int, bool, bool]] = field(default_factory=list)
    margin_bytes: int = 0


@contextmanager
def last_timeline() -> Iterator[list[Any]]:
    """Within it, the list holds the timeline (or why none) the last analysis built: a fit's answer is from it."""
    from nbmem.fitting.analysis import timeline as fitmodel

    built: list[Any] = []
    real_build = fitmodel.build_timeline  # the name Built.get calls

    def keep(runs: Any, segments: Any) -> Any:
        got = real_build(runs, segments)
        built[:] = [got]
        return got

    fitmodel.build_timeline = keep
    try:
        yield built
    finally:
        fitmodel.build_timeline = real_build


def synthesised(tl: Any, value: int, capacity: float) -> tuple[list[int], Any]:
    """The requests the fit's timeline makes at ``value`` (its allocator model, recording), and the simulation
    whose reserved peak is the larger of the two placements of new segments, as the prediction reports it."""
    from nbmem.fitting.analysis import timeline as fitmodel

    sizes: list[int] = []
    real_model = fitmodel.CachingAllocatorModel

    class Recording(CachingAllocatorModel):
        def malloc(self, size: int, stream: int = 0) -> int | None:
            sizes.append(size)
            return super().malloc(size, stream)

    fitmodel.CachingAllocatorModel = Recording  # type: ignore[misc]  # what Timeline.simulate builds its allocator from
    try:
        up = tl._simulate(value, capacity, 3, None, False)  # past the replays it keeps: the answer's is kept
    finally:
        fitmodel.CachingAllocatorModel = real_model  # type: ignore[misc]
    down = tl.simulate(value, capacity, descending=True)
    return sizes, max(up, down, key=lambda s: s.peak_reserved_bytes)


def sweep(body: Body, tl: Any, row: RowB, room: Any, values: int, reach: float) -> None:
    """Part C: values from the answer up to ``reach`` × it, each judged by the fit's timeline in the whole room
    (no margin: where the model, not the margin, says no) and by a real try in the same room."""
    whole = room.capacity_bytes + room.margin_bytes
    answer = row.answer or 0
    step = max(1, int(answer * (reach - 1) / max(1, values)))
    for v in range(answer + step, answer + step * values + 1, step):
        fits = all(tl.simulate(v, whole, descending=d).ok for d in (False, True))
        real = body.attempt(v, record=False).ok
        row.sweep.append((v, fits, real))
        print(f"  {row.body} at {v:,}: the fit's timeline {'fits' if fits else 'does not fit'} without the margin; "
              f"real {'ok' if real else 'OOM'}", flush=True)


def part_b(body: Body, cap_bytes: int, rows: list[RowB], sweep_values: int = 0, reach: float = 1.2) -> None:
    """Part B for one body: the fit in a room of ``cap_bytes``, its timeline at the answer against a real try."""
    from nbmem.fitting.analysis.timeline import Timeline
    from nbmem.fitting.runs import runner

    t, fam = body.torch, body.fam
    row = RowB(fam.name)
    rows.append(row)
    body.settle()
    free, _ = t.cuda.mem_get_info(body.device)
    hold_bytes = free + t.cuda.memory_reserved() - cap_bytes
    hold = t.empty(hold_bytes, dtype=t.uint8, device="cuda") if hold_bytes > 0 else None
    before = body.before
    body.before = t.cuda.memory_allocated()
    try:
        started = time.perf_counter()
        with last_timeline() as built:
            res = runner.fit(body.run, fam.values, name=fam.var, clean=body.ns.clear, modules=[body.model],
                             optimizers=[body.opt], others=body.others, stacks=True)
        row.fit_s = time.perf_counter() - started
        row.answer, row.method = res.largest_value, res.method
        row.runs = tuple(p.value for p in res.points if p.counted and not p.skipped)
        tl = built[0] if built and isinstance(built[0], Timeline) else None
        room = res.room
        print(f"  {fam.name} fit in {mib(room.capacity_bytes if room else None)} MiB: {res.answer()} "
              f"({res.method or 'no model'}, {row.fit_s:.1f} s)", flush=True)
        if row.answer is None or tl is None or room is None:
            row.note = res.reason or f"no timeline to compare (method: {res.method or 'none'})"
            return
        sizes, sim = synthesised(tl, row.answer, room.capacity_bytes)
        start = CachingAllocatorModel(float("inf"), tl.segments)
        got = body.attempt(row.answer, record=True)
        row.real_ok = got.ok
        if got.entries is None or got.full:
            row.note = "the real trace filled its buffer"
            return
        row.compared = compare(requests_of(got.entries), sizes)
        row.real_peaks = (got.peak_allocated_bytes - got.allocated_before_bytes,
                          got.peak_reserved_bytes - got.reserved_before_bytes)
        row.synth_peaks = (sim.peak_allocated_bytes - start.allocated_bytes,
                           sim.peak_reserved_bytes - start.reserved_bytes)
        notes = []
        if not sim.ok:
            notes.append("the timeline does not fit at its own answer")
        if res.peak_reserved_at_largest_bytes not in (None, sim.peak_reserved_bytes):  # not the answer's timeline
            notes.append(f"the fit reported {mib(res.peak_reserved_at_largest_bytes)} MiB reserved at its answer, "
                         f"this timeline {mib(sim.peak_reserved_bytes)}")
        if got.reserved_before_bytes != start.reserved_bytes:
            notes.append(f"reserved before: real {mib(got.reserved_before_bytes)}, "
                         f"fit's {mib(start.reserved_bytes)} MiB")
        if not got.ok:
            notes.append(f"the real try failed: {got.error[:80]}")
        row.note = "; ".join(notes)
        c = row.compared
        print(f"  {fam.name} at {row.answer:,}: real {'ok' if got.ok else 'OOM'}; requests {c.real:,} real, "
              f"{c.synth:,} synthesised, {share(c.in_order, c.real)} in order; peak reserved "
              f"{mib(row.real_peaks[1])} real, {mib(row.synth_peaks[1])} synthesised MiB", flush=True)
        row.margin_bytes = room.margin_bytes
        if sweep_values:
            sweep(body, tl, row, room, sweep_values, reach)
    finally:
        del hold
        body.before = before
        body.settle()


def print_tables(rows_a: Sequence[RowA], rows_b: Sequence[RowB], steps: int) -> list[str]:
    """Both tables (Markdown, for RESULTS.md), and the summary's lines."""
    summary = []
    if rows_a:
        head = ("body", "cap MiB", "value", "vs boundary", "real", "model", "agree", "where", "real peak reserved",
                "model peak reserved", "note")
        table = []
        for r in rows_a:
            v, t = r.verdict, r.tried
            table.append((r.body, mib(r.cap_bytes), fmt(r.value), r.label,
                          "" if t is None else ("ok" if t.ok else "OOM"), v.model() if v else "",
                          v.agreement() if v else "", v.where() if v else "",
                          "" if t is None else mib(t.peak_reserved_bytes),
                          "" if v is None else mib(v.peak_reserved_bytes),
                          "; ".join(x for x in (r.note.strip(), r.saved) if x)))
        print(f"\n## A. The allocator model on real traces ({steps} steps a try)\n\nlo: the largest value whose try "
              "ran in the bisection; hi: the next, whose try failed. Peaks in MiB.\n")
        print("\n".join(markdown(head, table)))
        judged = [r.verdict for r in rows_a if r.verdict is not None]
        both = [v for v in judged if v.failed and not v.model_ok]
        exact = sum(1 for v in both if v.refused_at == v.fatal)
        unsafe = sum(1 for v in judged if v.unsafe)
        low = sum(1 for v in judged if not v.failed and not v.model_ok)
        summary.append(f"bench_agreement A: the model agreed with the real try on {sum(v.agrees for v in judged)} of "
                       f"{len(judged)} tries ({exact} of {len(both)} failures at the same request); model fits, real "
                       f"failed: {unsafe}; model fails, real ran: {low}")
    if rows_b:
        head_b = ("body", "answer", "fit's runs", "real at answer", "allocations real / synth", "in order ±10 %",
                "same block", "MiB requested real / synth", "largest MiB real / synth",
                "peak allocated MiB real / synth", "peak reserved MiB real / synth", "note")
        table_b: list[tuple[str, ...]] = []
        for b in rows_b:
            c, rp, sp = b.compared, b.real_peaks, b.synth_peaks
            table_b.append((b.body, fmt(b.answer), ", ".join(f"{v:,}" for v in b.runs),
                          "" if b.real_ok is None else ("ok" if b.real_ok else "OOM"),
                          "" if c is None else f"{c.real:,} / {c.synth:,}",
                          "" if c is None else share(c.in_order, c.real),
                          "" if c is None else share(c.same_block, c.real),
                          "" if c is None else f"{mib(c.real_bytes)} / {mib(c.synth_bytes)}",
                          "" if c is None else f"{mib(c.real_largest)} / {mib(c.synth_largest)}",
                          "" if rp is None or sp is None else f"{mib(rp[0])} / {mib(sp[0])}",
                          "" if rp is None or sp is None else f"{mib(rp[1])} / {mib(sp[1])}", b.note))
        print(f"\n## B. The fit's timeline at its answer against the real trace there ({steps} steps)\n")
        print("\n".join(markdown(head_b, table_b)))
        done = [r for r in rows_b if r.compared is not None]
        orders = [r.compared.in_order / r.compared.real for r in done if r.compared and r.compared.real]
        ratios = [sp[1] / rp[1] for r in done if (rp := r.real_peaks) and (sp := r.synth_peaks) and rp[1] > 0]
        failed = sum(1 for r in rows_b if r.real_ok is False)
        summary.append(f"bench_agreement B: {len(done)} of {len(rows_b)} bodies compared; real requests in order "
                       f"within ±10 %: median {100 * statistics.median(orders):.1f} %" if orders else
                       f"bench_agreement B: {len(done)} of {len(rows_b)} bodies compared")
        if ratios:
            summary[-1] += (f"; synthesised / real peak reserved: {min(ratios):.3f} to {max(ratios):.3f}; real tries "
                            f"at the answer that failed: {failed}")
    swept = [b for b in rows_b if b.sweep]
    if swept:
        head_c = ("body", "answer", "margin MiB", "value", "× answer", "timeline, no margin", "real")
        table_c = [(b.body, fmt(b.answer), mib(b.margin_bytes), fmt(v), f"{v / (b.answer or 1):.3f}",
                    "fits" if fits else "does not fit", "ok" if real else "OOM")
                   for b in swept for v, fits, real in b.sweep]
        print(f"\n## C. Above the fit's answer: its timeline in the whole room against real tries ({steps} steps)\n")
        print("\n".join(markdown(head_c, table_c)))
        pairs = [(fits, real) for b in swept for _, fits, real in b.sweep]
        summary.append(f"bench_agreement C: {len(pairs)} values above the answers; the timeline without the margin "
                       f"agreed with the real try on {sum(f == r for f, r in pairs)}; it fits where the real try "
                       f"failed: {sum(f and not r for f, r in pairs)}; it does not fit where the real try ran: "
                       f"{sum(r and not f for f, r in pairs)}")
    return summary


def needs(torch: Any) -> str:
    """Why this process cannot measure (one line), or "" when it can."""
    if not torch.cuda.is_available():
        return NEEDS_CUDA
    from nbmem.fitting.runs.torchcheck import expandable_on, refusal

    why = refusal()
    if why:
        return f"bench_agreement: {why} (nothing measured)"
    if expandable_on():
        return ("bench_agreement: the allocator model is the native allocator's without expandable segments, and "
                "PYTORCH_CUDA_ALLOC_CONF turns them on (nothing measured)")
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 bodies and 4 values around each boundary (about 3 min)")
    ap.add_argument("--only", default="", help="comma-separated bodies (bench_fit's families)")
    ap.add_argument("--parts", default="a,b",
                    help="a: the allocator replay alone; b: the extrapolation ('' with --save-traces: those only)")
    ap.add_argument("--cap-gib", type=float, default=8.0, help="the allocator's cap (A) and the fit's room (B)")
    ap.add_argument("--steps", type=int, default=3, help="training steps in a row in each try")
    ap.add_argument("--save-traces", default="", metavar="DIR",
                    help="also record tries under --save-cap-gib and write them to DIR for the CPU test")
    ap.add_argument("--save-cap-gib", type=float, default=1.0, help="the cap of the tries --save-traces writes")
    ap.add_argument("--sweep", type=int, default=0, metavar="N",
                    help="part C: N values above each fit's answer, up to --reach × it, judged by the fit's timeline "
                         "without its margin and by real tries in the same room")
    ap.add_argument("--reach", type=float, default=1.2, help="part C's largest value, as a multiple of the answer")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="no body or part starts after this long (default: 170 with --quick, 420 without; "
                         "90 more with --save-traces)")
    a = ap.parse_args(argv)
    parts = {p for p in a.parts.split(",") if p}
    if not parts <= {"a", "b"} or a.steps < 1:
        ap.error("--parts takes a, b; --steps at least 1")
    try:
        import torch
    except ImportError:
        print(NEEDS_CUDA)
        return 0
    why = needs(torch)
    if why:
        print(why)
        return 0
    sys.path.insert(0, HERE)
    from bench_fit import families

    torch.backends.cuda.matmul.allow_tf32 = True  # as training runs it (and bench_fit)
    torch.backends.cudnn.allow_tf32 = True
    started = time.perf_counter()
    # --save-traces adds a pass of part A under its own cap (about a minute)
    budget = a.budget_s or (170.0 if a.quick else 420.0) + (90.0 if a.save_traces else 0.0)
    fams = families(torch)
    names = [n for n in a.only.split(",") if n] or list(QUICK_BODIES if a.quick else BODIES)
    unknown = [n for n in names if n not in fams]
    if unknown:
        ap.error(f"--only: no body {', '.join(unknown)} (bench_fit has {', '.join(fams)})")
    spacing = QUICK_AROUND if a.quick else AROUND
    cap, save_cap = int(a.cap_gib * GiB), int(a.save_cap_gib * GiB)
    total = torch.cuda.mem_get_info()[1]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {mib(total)} MiB; cap {a.cap_gib:g} GiB; "
          f"{a.steps} steps a try; bodies {', '.join(names)}", flush=True)
    rows_a: list[RowA] = []
    rows_b: list[RowB] = []
    # Each body's two parts together (a spent budget leaves whole bodies out), then the tries for the CPU test.
    plan = [(n, part, cap) for n in names for part in ("a", "b") if part in parts]
    if a.save_traces:
        plan += [(n, "save", save_cap) for n in SAVE_BODIES if n in names or not a.only]
    for name, part, bytes_ in plan:
        if time.perf_counter() - started > budget:
            if part == "b":
                rows_b.append(RowB(name, note="not run: time budget spent"))
            else:
                rows_a.append(RowA(name, bytes_, note="not run: time budget spent"))
            continue
        print(f"[{name}] part {'A (traces saved)' if part == 'save' else part.upper()}, {mib(bytes_)} MiB", flush=True)
        body = None
        had_b = len(rows_b)
        try:
            body = Body(torch, fams[name], a.steps)
            if part == "b":
                part_b(body, bytes_, rows_b, a.sweep, a.reach)
            else:
                part_a(body, bytes_, spacing, rows_a, started + budget + GRACE_S,
                       a.save_traces if part == "save" else "")
        except Exception as e:  # a body that breaks is reported; the others go on
            why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
            if part == "b" and len(rows_b) > had_b:  # part_b made its row: the error goes on it
                rows_b[-1].note = "; ".join(x for x in (rows_b[-1].note, why) if x)
            elif part == "b":
                rows_b.append(RowB(name, note=why))
            else:
                rows_a.append(RowA(name, bytes_, note=why))
            traceback.print_exc()
        finally:
            if body is not None:
                body.close()
            del body
            gc.collect()
            torch.cuda.empty_cache()
    summary = print_tables(rows_a, rows_b, a.steps)
    print("\n=== summary ===")
    for s in summary:
        print(s)
    print(f"bench_agreement: {time.perf_counter() - started:.0f} s on {torch.cuda.get_device_name()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
