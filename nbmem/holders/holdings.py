"""The engine's side of the holder scan: when to scan, what a cell added, what is held now.

``Holdings`` owns the ``Scanner`` and the scans it made: the latest one, the one the last measured cell
closed with (the next cell's baseline), each cell's findings, and the findings of everything held now.
It decides how much to walk: a cell's closing scan walks the roots the cell could have changed, and
more only while the allocator (or, on the CPU, the C heap) says memory grew by more than what was found.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from nbmem.formatting import fmt_bytes
from nbmem.holders import findings as judge
from nbmem.holders import owners, pools
from nbmem.holders.freeing import Keepers
from nbmem.holders.graphs import Graph, GraphState
from nbmem.holders.grouping import Grouping
from nbmem.holders.held import Held
from nbmem.holders.scanner import Scan, Scanner
from nbmem.measure.sources import Probe
from nbmem.options import Settings
from nbmem.records import PAGED, Boundary, CellRecord, CleanupOf, StillHeld
from nbmem.trace.linetrace import Replay

#: Most cells whose findings are kept for ``nbmem.leaks(cell=N)``.
CELLS_KEPT = 10_000
#: The walk after a cell nobody measured: what changed since the last scan, this long at most (a truncated
#: walk says so in the gauge, whose "rescan" walks everything).
REFRESH_BUDGET_S = 0.05


class Mark(NamedTuple):
    """What a scan is compared with to tell whether another could find more: CUDA allocated per device, the C
    heap's bytes in use with what collections freed added back (``HeapWatch``; None: unknown) and the namespace's
    fingerprint."""

    allocated: tuple[tuple[str, int | None], ...]
    heap: int | None
    fingerprint: Any


@dataclass(frozen=True)
class Baseline:
    """What a monitored cell is compared with, taken when it opened."""

    scan: Scan | None
    tensor_bytes: dict[str, int] | None  # per device, taken while its storages' graphs were alive
    mentioned: frozenset[str]
    gen_collections: int
    # The C heap in use when the cell opened (what collections freed added back), None: unknown. Read here, not
    # taken from the previous cell's closing: what ran in between (a front end's silent run, another extension, a
    # thread) may have freed heap, which would then hide the growth of this cell that tells the scan to look further.
    heap_bytes: int | None


class _GraphsRead(NamedTuple):
    """The graphs of everything held now, and what they were read from: kept while none of it changed."""

    scan: Scan
    holders: list[int]  # the storages that hold a graph
    truncated: bool
    ends: int  # storages ended so far (``Storages.ends``)
    walked: list[GraphState | None]  # each holder's graph as walked
    saved: frozenset[int]  # the storages those graphs save
    graphs: dict[int, Graph]
    saved_in: dict[int, list[int]]  # ``Keepers.saved_in``, made from these graphs


class Holdings:
    """The scans, the findings per cell and the findings of now, for one shell."""

    def __init__(self, adapter: Any, probe: Probe, settings: Callable[[], Settings]) -> None:
        self.adapter = adapter
        self.probe = probe
        self._settings = settings
        self.scanner = Scanner(probe.torch.torch)
        self.last_scan: Scan | None = None
        self.closed_scan: Scan | None = None  # the last scan a measured cell closed with
        self._scan_mark: Mark | None = None
        self._gaps: dict[str, int] = {}  # allocated bytes no name reached, per device, after the last scan
        self._by_cell: dict[int, owners.Rows] = {}
        self._cells: deque[int] = deque()
        self._totals_cache: list[tuple[Scan, dict[str, int]]] = []
        self._finding_cache: dict[int, Any] = {}
        self._row_cache = owners.RowCache()
        self._grouping = Grouping()  # the latest scan looked at whole, by owner
        self._graphs: _GraphsRead | None = None  # what the last graphs of everything held now were read from
        self._current = owners.Rows((), ())
        self._current_of: Scan | None = None  # the scan _current was computed from
        self.scanned_at: float | None = None  # epoch seconds of the latest scan (the gauge says how old it is)

    @property
    def settings(self) -> Settings:
        return self._settings()

    def clear(self) -> None:
        self._by_cell.clear()
        self._cells.clear()
        self.last_scan = self.closed_scan = None
        self.scanned_at = None

    # -- scanning --------------------------------------------------------------------------------------
    def rescan(self, *, cell: int, walk: str, mentioned: frozenset[str] = frozenset(), budget_s: float | None = None,
               validate: bool = True, mark: Mark | None = None) -> Scan:
        """Scan now and keep the result as the latest scan, together with the state it saw."""
        mark = self.mark() if mark is None else mark
        self.last_scan = self.scanner.update(list(self.adapter.roots()), cell=cell, walk=walk, mentioned=mentioned,
                                             budget_s=budget_s, validate=validate)
        self._scan_mark = mark
        self.scanned_at = time.time()
        return self.last_scan

    def scan_all(self) -> Scan:
        """Every root walked again (``nbmem.leaks()``, ``%cudamem on``): the current findings follow."""
        self.rescan(cell=0, walk="all")
        self._current_of = None
        return self.last_scan  # type: ignore[return-value]

    def refresh(self, budget_s: float) -> Scan | None:
        """After a cell nobody measured: walk what changed since the last scan, within ``budget_s``, so what is
        held now stays true without ``%cudamem on``. None when nothing could have changed (no walk at all)."""
        if self.probe.torch.torch() is None:
            return None
        mark = self.mark()
        if not self._changed_since_scan(mark):
            return None
        self.rescan(cell=0, walk="changed", budget_s=budget_s, mark=mark)
        self._current_of = None
        return self.last_scan

    def mark(self, allocator: Any = None) -> Mark:
        readings = self.probe.allocator() if allocator is None else allocator
        alloc = tuple(sorted((d, r.allocated_bytes if r else None) for d, r in readings.items()))
        return Mark(alloc, self.probe.heap.bytes(), self.adapter.fingerprint())

    def _changed_since_scan(self, mark: Mark) -> bool:
        """Whether a new scan could find something new: memory moved (CUDA allocated by any amount,
        exactly; the C heap, where CPU tensors live, by half the threshold), or a name was added,
        deleted or rebound, or an output or exception was kept."""
        if self.last_scan is None or self._scan_mark is None:
            return True
        alloc, heap, fp = mark
        alloc0, heap0, fp0 = self._scan_mark
        if alloc != alloc0 or fp != fp0:
            return True
        return heap is None or heap0 is None or abs(heap - heap0) >= max(1, self.settings.threshold_bytes // 2)

    def fresh_baseline(self, monitoring: bool) -> bool:
        """Whether the latest scan was a measured cell's closing scan, with monitoring still on."""
        return self.closed_scan is not None and self.closed_scan is self.last_scan and monitoring

    def baseline(self, source: str, *, scan: bool, monitoring: bool) -> Baseline:
        """What a cell opening now is compared with; scans what changed since the last cell when needed."""
        if scan and not self.fresh_baseline(monitoring):
            # The previous cell's closing scan is this cell's baseline; without one (monitoring began
            # inside the previous cell, or it was not measured), what changed since is walked now.
            self.rescan(cell=0, walk="changed")
        mentioned = frozenset(self.adapter.mentioned(source)) if scan and source else frozenset()
        base = self.last_scan
        base_bytes = self.tensor_bytes(base) if scan and base is not None else None
        return Baseline(base, base_bytes, mentioned, collections(), self.probe.heap.bytes())

    def tensor_bytes(self, scan: Scan) -> dict[str, int]:
        """Bytes per device of the storages a scan found, and of the walked graphs they keep.

        Kept for the last two scans. A scan's graphs are read from the live tensors, so a scan whose
        storages have since died reads smaller: a cell keeps its baseline's figure from when it opened.
        """
        for s, totals in self._totals_cache:
            if s is scan:
                return totals
        out = dict(scan.totals)
        for dev, n in self.scanner.storages.graph_totals(scan, self.scanner.updates).items():
            out[dev] = out.get(dev, 0) + n
        self._totals_cache = [*self._totals_cache[-1:], (scan, out)]
        return out

    # -- a cell's closing scan and its findings ---------------------------------------------------------
    def close_cell(self, cell: int, base: Baseline, before: Boundary, after: Boundary,
                   replays: Mapping[str, Replay]) -> tuple[Scan, owners.Rows, bool]:
        """The cell's closing scan, what it added (owners), and whether anything could have changed."""
        cur = self._scan_after_cell(cell, base, before, after)
        self.closed_scan = cur
        prev = base.scan
        found = owners.Rows((), ())
        changed = cur is not prev  # the same scan object: nothing could have changed, nothing to redo
        if changed:
            s = self.settings
            touched = self.scanner.updates.changed(prev, cur)
            graphs = self.scanner.graphs(judge.graph_candidates(cur, prev, touched), exclude=cur.storages,
                                         budget_s=s.scan_budget_s, truncated=cur.truncated)
            had = ({o for o, _d in self._grouping.of(prev, None).groups}
                   if prev is not None and self._grouping.scan is prev else None)
            found = owners.cell_rows(cur, prev, cell, threshold_bytes=s.threshold_bytes, graphs=graphs,
                                     lines=_alloc_lines(cur, replays, touched), changed=touched, owners_before=had)
            self._current_of = None  # everything held now: computed when someone looks
        self._remember(cell, found)
        return cur, found, changed

    def _scan_after_cell(self, cell: int, base: Baseline, before: Boundary, after: Boundary) -> Scan:
        """Changed roots first; everything else only if memory moved unexplained."""
        mark = self.mark(after.allocator)
        if not self._changed_since_scan(mark) and self.last_scan is not None:
            return self.last_scan
        budget = self.settings.scan_budget_s
        t0 = time.perf_counter()
        cur = self.rescan(cell=cell, walk="changed", mentioned=base.mentioned, budget_s=budget, validate=False,
                          mark=mark)
        # Then, only while memory grew more than what was found: cached roots whose tensors changed
        # (a gradient, a swapped storage), and at last every other root.
        for walk in ("invalid", "rest"):
            left = budget - (time.perf_counter() - t0)
            if left <= 0 or cur.truncated or not self._unexplained(base, before, after, cur, mark.heap):
                break
            cur = self.rescan(cell=cell, walk=walk, budget_s=left, mark=mark)
        return cur

    def _unexplained(self, base: Baseline, before: Boundary, after: Boundary, cur: Scan, h1: int | None) -> bool:
        """Whether memory grew by at least the threshold more than the storages the scan found.

        CUDA's allocator says exactly what was allocated. The CPU has no such counter: the C heap is a
        proxy that also grows for non-tensor data, so it counts only while young tensors that no walked
        root reaches are alive, or when a collection promoted the cell's objects out of the young
        generations (then they cannot be checked). ``h1`` is the C heap as the cell left it (read once, when
        the cell closed: reading it walks every arena, and what the scan itself allocated is not the cell's).
        """
        t = self.settings.threshold_bytes
        self.scanner.graphs(judge.graph_candidates(cur, base.scan, self.scanner.updates.changed(base.scan, cur)),
                            exclude=cur.storages)
        now = self.tensor_bytes(cur)
        then = base.tensor_bytes or {}

        def found(dev: str) -> int:
            return now.get(dev, 0) - then.get(dev, 0)

        for dev, a1 in after.allocator.items():
            a0 = before.allocator.get(dev)
            if a1 is not None and a1.allocated_bytes - (a0.allocated_bytes if a0 else 0) - found(dev) >= t:
                return True
        if h1 is None or base.heap_bytes is None or h1 - base.heap_bytes - found("cpu") < t:
            return False
        if collections() != base.gen_collections:
            return True
        return self.scanner.young_unlocated(cur).get("cpu", 0) >= t

    def unattributed(self, records: Sequence[CellRecord], cur: Scan) -> pools.Unnamed:
        """Allocated bytes no name reaches (cuBLAS workspaces, C++-held buffers), when this cell made them grow;
        and where a device's private pools (CUDA graphs of a compiled model) hold memory that grew, those."""
        out = []
        earlier = []
        grew = set()
        t = self.settings.threshold_bytes
        tensors = self.tensor_bytes(cur)
        for r in records:
            if r.device == "cpu" or r.allocated_after_bytes is None:
                continue
            gap = r.allocated_after_bytes - tensors.get(r.device, 0)
            if gap - self._gaps.get(r.device, 0) >= t:
                out.append((r.device, gap))
                earlier.append((r.device, max(self._gaps.get(r.device, 0), 0)))
                grew.add(r.device)
            elif (r.delta_reserved_bytes or 0) >= t:
                grew.add(r.device)  # a graph's intermediates freed back to its pool stay reserved there
            self._gaps[r.device] = gap
        if not grew:
            return pools.Unnamed((), (), ())
        # The allocator's segments say which pool holds what: read (a host-side walk) only when something grew.
        segments = self.probe.torch.segments() or []
        compiled = pools.compiled_modules(cur.root_types)
        named = pools.named_addresses((h.device, h.addr) for h in cur.storages.values())
        found = pools.private_pools(segments, named, compiled)
        return pools.Unnamed(tuple(out), tuple(found[d] for d in sorted(grew) if d in found), compiled,
                             tuple(earlier))

    def _remember(self, cell: int, found: owners.Rows) -> None:
        self._by_cell[cell] = found
        self._cells.append(cell)
        while len(self._cells) > CELLS_KEPT:
            self._by_cell.pop(self._cells.popleft(), None)

    # -- reading ------------------------------------------------------------------------------------------
    def of_cell(self, cell: int) -> owners.Rows | None:
        """What cell N added (owner rows and the detail), or None when it was not scanned."""
        return self._by_cell.get(cell)

    def current(self) -> owners.Rows:
        """Everything above the threshold as of the latest scan: owner rows (what the gauge lists), detail."""
        cur = self.last_scan
        if cur is None:
            return owners.Rows((), ())
        if self._current_of is not cur:
            s = self.settings
            graphs, keepers = self._graphs_now(cur)
            by_owner = self._grouping.of(cur, self.scanner.updates.changed(self._grouping.scan, cur))
            self._current = owners.current_rows(cur, threshold_bytes=s.threshold_bytes, graphs=graphs,
                                                cache=self._finding_cache, row_cache=self._row_cache,
                                                by_owner=by_owner, keepers=keepers)
            self._current_of = cur
        return self._current

    def _graphs_now(self, cur: Scan) -> tuple[dict[int, Graph], Keepers]:
        """The graphs of ``cur``'s storages that hold one, and which of them save each storage. Those of the last
        call are kept while nothing they read changed (issue 38): the same storages hold graphs, each the graph
        walked before and still its tensor's, no storage ended, and none of those they save was named or
        unnamed since (a kept list of losses is not walked again each cell)."""
        holders = cur.holding_graphs()
        states = [self.scanner.storages.states.get(sid) for sid in holders]
        walked = [st.graph if st is not None else None for st in states]
        last = self._graphs
        if last is not None and (last.holders, last.truncated, last.ends, last.walked) == (
                holders, cur.truncated, self.scanner.storages.ends(), walked):
            changed = self.scanner.updates.changed(last.scan, cur)
            if (changed is not None and last.saved.isdisjoint(changed) and all(
                    st is not None and st.graph is not None and st.graph_tensor is not None
                    and _same_tensor(st.graph.tensor(), st.graph_tensor()) for st in states)):
                self._graphs = last._replace(scan=cur)
                return last.graphs, Keepers(cur.storages, last.graphs, last.saved_in)
        graphs = self.scanner.graphs(holders, exclude=cur.storages, budget_s=self.settings.scan_budget_s,
                                     truncated=cur.truncated)
        keepers = Keepers(cur.storages, graphs)
        walked = [st.graph if st is not None else None for st in states]  # as the walk left them
        saved = frozenset(g for gs in walked if gs is not None for g in gs.saved)
        self._graphs = _GraphsRead(cur, holders, cur.truncated, self.scanner.storages.ends(), walked, saved, graphs,
                                   keepers.saved_in)
        return graphs, keepers

    def note(self) -> str:
        """What to say where no owner is listed: nothing passed the threshold, or why that is not known."""
        s = self.last_scan
        if s is None:
            if self.probe.torch.torch() is None:
                return "torch is not imported yet: no tensors to hold"
            return "no holder scan has run yet: `%cudamem leaks` or `%cudamem on` scans the notebook"
        if s.truncated:
            return (f"the last holder scan stopped at Nbmem.scan_budget before finishing "
                    f"{', '.join(s.unfinished[:3])}: `%cudamem leaks` scans everything")
        return f"nothing above the threshold ({fmt_bytes(self.settings.threshold_bytes)})"

    def why_empty(self, cell: int | None = None) -> str:
        """Why ``nbmem.leaks()`` (``cell``: of that cell) lists nothing: the threshold and how to lower it."""
        t, lower = self.settings.threshold_bytes, "`%config Nbmem.threshold = 0`"
        if cell is None and (self.last_scan is None or self.last_scan.truncated):
            return self.note()
        if cell is not None and self.of_cell(cell) is None:
            return (f"cell {cell} ran without a holder scan (`%cudamem on --no-scan` or `Nbmem.scan = False`): "
                    "`%cudamem leaks` lists what is held now")
        if cell is not None:  # judged by the threshold of then
            return (f"nothing above Nbmem.threshold when it ran (now {fmt_bytes(t)}); "
                    + (f"after {lower} the cells you run next list holders of any size, and " if t else "")
                    + "`%cudamem leaks` lists what is held now")
        if t == 0:
            return "nothing held (Nbmem.threshold is 0: holders of any size are listed)"
        return f"nothing above Nbmem.threshold ({fmt_bytes(t)}); {lower} lists holders of any size"

    def held_by(self, names: Sequence[str]) -> dict[str, set[int]]:
        """The storages each of these top-level names reached at the last scan (before a cleanup)."""
        out: dict[str, set[int]] = {}
        if names and self.last_scan is not None:
            for sid, h in self.last_scan.storages.items():
                for name in h.roots & set(names):
                    out.setdefault(name, set()).add(sid)
        return out

    def still_held(self, held_by: Mapping[str, set[int]]) -> tuple[StillHeld, ...]:
        """For each deleted name whose memory is still alive: who keeps it now and the cleanup that would free it."""
        alive = self.scanner.storages.alive
        lefts = {name: [s for s in sids if alive(s)] for name, sids in held_by.items()}
        cur = self.last_scan
        if cur is None or not any(lefts.values()):
            return ()
        graphs, keepers = self._graphs_now(cur)
        return still_held(lefts, cur, self.scanner.storages.states, keepers, graphs)

    def forget_current(self) -> None:
        self._current_of = None


def still_held(lefts: Mapping[str, list[int]], cur: Scan, states: Mapping[int, Any], keepers: Keepers,
               graphs: Mapping[int, Graph]) -> tuple[StillHeld, ...]:
    """Per deleted name, of its storages still alive (``lefts``): the other paths to them, the autograd graphs that
    saved them, the bytes nothing nbmem walks reaches, what would free the rest (``Keepers.needs``), and the
    graphs those storages' tensors keep (``graphs``: a loss that another name holds keeps its whole graph)."""
    out = []
    for name, left in lefts.items():
        if not left:
            continue
        kept_graph: dict[int, int] = {}
        for s in left:
            g = graphs.get(s)
            if g is not None:
                kept_graph.update(g.saved)
        named: dict[str, None] = {}
        saved: dict[str, None] = {}
        holders: list[Held] = []
        unnamed = paged = 0
        for s in left:
            if states[s].device.startswith(PAGED):  # bitsandbytes never frees it: no other holder to name
                paged += states[s].nbytes
                continue
            h = cur.storages.get(s)
            kept = [cur.storages[k] for k in keepers.saved_in.get(s, ()) if k in cur.storages and k != s]
            if h is not None:
                named.update(dict.fromkeys(h.holders[:2]))
                holders.append(h)
            saved.update(dict.fromkeys(k.name for k in kept))
            holders += kept
            if h is None and not kept:
                unnamed += states[s].nbytes
        need = keepers.needs("", holders)
        out.append(StillHeld(name, sum(states[s].nbytes for s in left), tuple(named)[:6], tuple(saved)[:6], unnamed,
                             CleanupOf(need.names, need.outputs, need.traceback), paged,
                             sum(n for k, n in kept_graph.items() if k not in left)))
    return tuple(out)


def _same_tensor(a: Any, b: Any) -> bool:
    """Whether two weak references' referents are one live tensor (by identity: a tensor is never asked)."""
    return a is not None and a is b


def _alloc_lines(cur: Scan, replays: Mapping[str, Replay], changed: Collection[int] | None = None) -> dict[int, int]:
    """Storage id -> the cell line that allocated it, where a trace with lines tells (GPU). ``changed``: the
    storages whose records the cell changed, when known (one it allocated is new, so among them)."""
    if not replays:
        return {}
    out = {}
    sids = cur.storages if changed is None else [s for s in changed if s in cur.storages]
    for sid in sids:
        h = cur.storages[sid]
        rp = replays.get(h.device)
        line = rp.alloc_line.get(h.addr) if rp is not None else None
        if line is not None:
            out[sid] = line
    return out


def collections() -> int:
    """Collections of the older generations so far: when they ran, new objects left the young ones."""
    stats = gc.get_stats()
    return sum(s.get("collections", 0) for s in stats[1:])


def with_cpu_allocated(records: Sequence[CellRecord], base: Baseline, now_bytes: Mapping[str, int]) -> list[CellRecord]:
    """The CPU has no allocator counters: its "allocated" is the live CPU tensor storages the scan found."""
    before = base.tensor_bytes.get("cpu", 0) if base.tensor_bytes is not None else None
    return [replace(r, allocated_before_bytes=before, allocated_after_bytes=now_bytes.get("cpu", 0))
            if r.device == "cpu" else r for r in records]
