"""The cost of a monitored cell stays small in a notebook that holds a big model (issue 38), and what the gauge
lists stays true: an owner row whose memory did not change is reused, and a reused row is the row a fresh
judgement would make."""

from __future__ import annotations

from typing import Any

import pytest

from nbmem.holders import findings as judge
from nbmem.holders import grouping, held, owners, scanner
from nbmem.ipython.root import session_of
from tests.conftest import ok

MODEL = """
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(16)])
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 256)).sum().backward()
opt.step()
bag = []
"""
MOVE = "bag.append(torch.empty(2**20))"


def fresh(ip: Any) -> tuple[Any, ...]:
    """The gauge's rows worked out again from nothing, from the same scan."""
    h = session_of(ip).holdings
    cur = h.last_scan
    assert cur is not None
    graphs = h.scanner.graphs([s for s, x in cur.storages.items() if x.holds_graph], exclude=cur.storages)
    return owners.current_rows(cur, threshold_bytes=session_of(ip).settings.threshold_bytes, graphs=graphs).owners


def test_a_cell_that_changes_one_owner_judges_that_owner_again_and_no_other(ip, monkeypatch):
    ok(ip, MODEL)
    ok(ip, MOVE)
    session_of(ip).findings()
    judged: list[str] = []
    real = owners._row

    def counting(owner: str, *a: Any, **kw: Any) -> Any:
        judged.append(owner)
        return real(owner, *a, **kw)

    monkeypatch.setattr(owners, "_row", counting)
    ok(ip, MOVE)
    rows = session_of(ip).findings()
    assert {"model", "opt", "bag"} <= {r.owner for r in rows}, rows
    assert set(judged) == {"bag"}, judged  # the cell's own rows and the gauge's: `bag` only


@pytest.mark.parametrize("cell", [
    "alias = model[0].weight",  # a new holder of a member
    "del opt",  # an owner gone; its state now under nothing, or under the model
    "model[3].weight.data = torch.zeros(256, 256)",  # a member's storage replaced
    "model = torch.nn.Sequential(*list(model)[:8])",  # rebound: half the members
    "bag.append(torch.empty(2**20)); bag2 = bag",
    "bag.clear()",
    "x = torch.randn(64, 256)\nloss = model(x).sum()",  # a new graph saves x and the model's weights
    "out = model(torch.randn(64, 256))",  # a graph that saves the members of an unchanged row
])
def test_a_reused_row_is_the_row_a_fresh_judgement_makes(ip, cell):
    ok(ip, MODEL)
    ok(ip, MOVE)
    session_of(ip).findings()
    ok(ip, cell)
    ok(ip, "pass")
    assert session_of(ip).findings() == fresh(ip), cell


CELLS = [
    "alias = model[0].weight",
    "del opt",
    "model[3].weight.data = torch.zeros(4096, 256)",
    "model = torch.nn.Sequential(*list(model)[:8])",
    "bag.append(torch.empty(2**20)); bag2 = bag",
    "bag.clear()",
    "x = torch.randn(64, 256)\nloss = model(x).sum()",
    "out = model(torch.randn(64, 256))",
    "del bag",
]


@pytest.mark.parametrize("cell", CELLS)
def test_a_cell_judged_from_the_storages_it_changed_names_what_a_judgement_of_every_storage_names(ip, cell):
    ok(ip, MODEL)
    ok(ip, MOVE)
    h = session_of(ip).holdings
    prev = h.closed_scan
    ok(ip, cell)
    cur = h.closed_scan
    assert prev is not None and cur is not None and cur is not prev
    changed = h.scanner.updates.changed(prev, cur)
    assert changed is not None  # judged from the storages it changed, not from every storage
    graphs = h.scanner.graphs(judge.graph_candidates(cur, prev), exclude=cur.storages)
    assert judge.graph_candidates(cur, prev, changed) == judge.graph_candidates(cur, prev)
    whole = owners.cell_rows(cur, prev, ip.execution_count - 1, graphs=graphs, lines={},
                             threshold_bytes=session_of(ip).settings.threshold_bytes)
    got = h.of_cell(ip.execution_count - 1)
    assert got is not None
    assert got.owners == whole.owners and got.detail == whole.detail, cell


def test_the_scanner_knows_which_records_changed_between_two_of_its_scans_and_says_when_it_does_not(ip):
    ok(ip, MODEL)
    h = session_of(ip).holdings
    scans = [h.closed_scan]
    ok(ip, "def drop():\n    bag[0] = None")  # frees a storage through a root the cell does not name
    for cell in [MOVE, MOVE, "drop()", "del opt", "bag.clear()", MOVE, "model[1].weight.data = torch.zeros(256, 256)"]:
        ok(ip, cell)
        scans.append(h.closed_scan)
        h.scanner.storages.forget_dead()  # the storages whose weak references told of their end
        assert not [s for s, st in h.scanner.storages.states.items() if st.ref() is None], cell
    for i, prev in enumerate(scans):
        for cur in scans[i:]:
            assert prev is not None and cur is not None
            changed = h.scanner.updates.changed(prev, cur)
            assert changed is not None
            differ = {s for s in {*prev.storages, *cur.storages} if prev.storages.get(s) is not cur.storages.get(s)}
            assert differ <= changed, (differ - changed)
    old = scans[0]
    assert old is not None and h.scanner.updates.changed(None, old) is None
    for _ in range(held.CHANGES_KEPT):
        ok(ip, MOVE)
    assert h.scanner.updates.changed(old, h.closed_scan) is None  # older than what the scanner remembers
    other = scanner.Scanner(lambda: None)
    assert other.updates.changed(old, old) is None  # another scanner's scans


def test_a_cell_that_changes_one_owner_regroups_only_that_owner(ip):
    ok(ip, MODEL)
    ok(ip, MOVE)
    before = dict(session_of(ip).holdings._grouping.of(session_of(ip).holdings.last_scan, None).groups)
    session_of(ip).findings()
    ok(ip, MOVE)
    session_of(ip).findings()
    h = session_of(ip).holdings
    after = h._grouping.of(h.last_scan, None).groups
    assert after["model", "cpu"].members is before["model", "cpu"].members  # the same list: not regrouped
    assert after["bag", "cpu"].members is not before["bag", "cpu"].members
    assert len(after["bag", "cpu"].members) == 2
    assert list(after) == list(grouping.grouped(h.last_scan.storages.values()).groups)


def test_a_list_that_grew_keeps_its_old_elements_records_and_only_the_new_one_is_judged(ip):
    ok(ip, MODEL)
    ok(ip, MOVE)
    ok(ip, MOVE)
    h = session_of(ip).holdings
    prev = h.closed_scan
    ok(ip, MOVE)  # walks `bag` again: its two old elements have the same paths, so the same records
    cur = h.closed_scan
    assert prev is not None and cur is not None
    new = set(cur.storages) - set(prev.storages)
    assert len(new) == 1 and h.scanner.updates.changed(prev, cur) == new
    assert all(cur.storages[s] is prev.storages[s] for s in prev.storages)


def test_a_scan_lists_the_storages_that_hold_graphs_in_its_own_order(ip):
    ok(ip, MODEL)
    h = session_of(ip).holdings
    for cell in ["loss = model(torch.randn(64, 256)).sum()", "out = model(torch.randn(64, 256))", MOVE,
                 "bag.append(model(torch.randn(4096, 256)))", "del loss", "loss = out.sum()", "del out"]:
        ok(ip, cell)
        cur = h.closed_scan
        assert cur is not None and cur.graph_holders is not None
        assert list(cur.graph_holders) == [s for s, x in cur.storages.items() if x.holds_graph], cell
    assert cur.graph_holders, "no graph was kept: the test shows nothing"


def test_kept_graphs_read_again_only_when_what_they_read_changed_give_the_rows_a_fresh_judgement_gives(ip):
    ok(ip, MODEL)
    ok(ip, "xs = [torch.randn(64, 256) for _ in range(4)]\nlosses = [model(x).sum() for x in xs]\n"
           "outs = [model(torch.randn(64, 256)) for _ in range(3)]")
    session_of(ip).findings()
    h = session_of(ip).holdings
    walks = []
    real = h.scanner.graphs

    def counting(sids: Any, **kw: Any) -> Any:
        walks.append(list(sids))
        return real(sids, **kw)

    h.scanner.graphs = counting
    for cell in [MOVE, MOVE, "del xs", "kept = outs[0]", "del outs[1]", "x = torch.ones(4)", MOVE,
                 "losses.append(model(torch.randn(8, 256)).sum())", "h0 = losses[0].grad_fn", "del losses[2]",
                 "del kept", "losses[0].backward()"]:
        ok(ip, cell)
        walks.clear()
        rows = session_of(ip).findings()
        if cell == MOVE:
            assert not walks, "a cell that added a tensor beside the kept graphs read them all again"
        assert rows == fresh(ip), cell
        cur = h.last_scan
        assert cur is not None
        whole = dict(cur.totals)  # the bytes found, the graphs' worked out from nothing
        for dev, n in h.scanner.storages.graph_totals(cur).items():
            whole[dev] = whole.get(dev, 0) + n
        assert h.tensor_bytes(cur) == whole, cell


def test_kept_graphs_compare_by_identity_never_by_their_tensors() -> None:
    """The scanner's cache key holds the walked graphs: comparing two walks of one storage must not run the tensors'
    ``__eq__`` (user code, and elementwise for a plain tensor: "ambiguous" as a bool)."""
    import weakref

    torch = pytest.importorskip("torch")
    from nbmem.holders.graphs import GraphState

    class Hostile(torch.Tensor):  # type: ignore[name-defined]
        def __eq__(self, other: object) -> Any:
            raise AssertionError("the scan ran user code")

        __hash__ = torch.Tensor.__hash__

    a, b = torch.zeros(3).as_subclass(Hostile), torch.zeros(3).as_subclass(Hostile)
    one, other = GraphState(weakref.ref(a), {1: ("cpu", 12)}), GraphState(weakref.ref(b), {1: ("cpu", 12)})
    assert {7: one} != {7: other} and {7: one} == {7: one}


def test_graph_sharing_is_worked_out_again_only_when_an_owner_that_keeps_a_graph_changes(ip, monkeypatch):
    """A kept list of losses and the output they came from share a graph; a tensor without a graph made and deleted
    cell after cell (the 7B notebook's memory-moving cell) does not make the gauge work their sharing out again."""
    ok(ip, MODEL)
    ok(ip, "out = model(torch.randn(512, 256))\nlosses = [out.sum(), out.mean()]")
    session_of(ip).findings()
    calls: list[int] = []
    real = owners.graph_sharing

    def counting(saved_by: Any) -> Any:
        if len(saved_by) > 1:  # the cell's own rows (the new tensor, no graph) have nothing to share
            calls.append(len(saved_by))
        return real(saved_by)

    monkeypatch.setattr(owners, "graph_sharing", counting)
    for cell in ["x = torch.empty(2**20)", "del x"] * 3:
        ok(ip, cell)
        rows = session_of(ip).findings()
        assert calls == [], (cell, calls)
        monkeypatch.setattr(owners, "graph_sharing", real)
        assert rows == fresh(ip), cell  # a judgement from nothing (it works the sharing out itself)
        monkeypatch.setattr(owners, "graph_sharing", counting)
    shared = {r.owner: r.graph_shared_with for r in session_of(ip).findings()}
    assert shared["losses"] == ("out",) and shared["out"] == ("losses",), shared
    ok(ip, "more = out * 2")  # a third owner keeps the same graph: worked out again, and named
    shared = {r.owner: r.graph_shared_with for r in session_of(ip).findings()}
    assert len(calls) == 1 and "more" in shared["out"], (calls, shared)


def test_heap_a_silent_run_frees_between_cells_does_not_hide_what_the_next_cell_keeps(ip):
    """A cell's C heap baseline is read when it opens: heap a front end's silent run freed in between (not a tensor)
    must not cancel the growth that tells the scan to look past the roots the cell names."""
    ok(ip, MODEL)
    ok(ip, "holder = [torch.zeros(1)]\ndef stash():\n    holder[0] = torch.ones(2**22)")
    ok(ip, "big = bytearray(2**25)")
    ip.run_cell("del big", store_history=False)  # 32 MiB freed by a run nobody measures
    ok(ip, "stash()")  # 16 MiB kept by `holder`, whose length does not change and which the cell never names
    rep = session_of(ip).last_report
    assert rep is not None and any(f.name.startswith("holder") for f in rep.holders.findings), rep


def test_heap_a_collection_inside_the_cell_frees_does_not_hide_what_the_cell_keeps(ip):
    """A full collection during the cell that frees old garbage (here 16 MiB in a cycle that lived through a full
    collection before it became garbage; in a test run, the previous test's shell) must not cancel the growth that
    tells the scan to look past the roots the cell names. Garbage that young collections free is not watched (it is
    what the last few hundred allocations made), so the cycle is made old first."""
    ok(ip, MODEL)
    ok(ip, "holder = [torch.zeros(1)]\ndef stash():\n    holder[0] = torch.ones(2**22)")
    ip.run_cell("junk = [bytearray(2**24)]; junk.append(junk); __import__('gc').collect(); del junk",
                store_history=False)
    ok(ip, "stash(); __import__('gc').collect()")  # 16 MiB kept by `holder`, 16 MiB of the cycle freed
    rep = session_of(ip).last_report
    assert rep is not None and any(f.name.startswith("holder") for f in rep.holders.findings), rep


def test_graph_sharers_are_named_in_the_order_a_fresh_judgement_names_them(ip):
    """The kept sharing is reused only while each owner's graph storages are the same in the same order: an owner
    whose oldest storage went moves in the rows, and the names under the others follow."""
    ok(ip, MODEL)
    ok(ip, "out = model(torch.randn(512, 256))\nlosses = [out.repeat(2, 1)]")
    session_of(ip).findings()
    ok(ip, "other = [out.repeat(2, 1)]")
    session_of(ip).findings()
    ok(ip, "losses.append(out.repeat(2, 1))")
    assert session_of(ip).findings() == fresh(ip)
    ok(ip, "del losses[0]")
    assert session_of(ip).findings() == fresh(ip)


def test_a_storage_that_ends_takes_its_identity_entry_with_it(ip):
    ok(ip, MODEL)
    st = session_of(ip).holdings.scanner.storages
    for cell in [MOVE, MOVE, "bag.clear()", "x = torch.empty(2**20)", "del x", "del model, opt",
                 "import gc; gc.collect()", "y = torch.empty(2**20)"]:
        ok(ip, cell)
        assert set(st.by_obj.values()) == set(st.states), cell


def test_a_dead_storage_never_takes_the_identity_entry_of_a_new_one_at_its_address():
    """CPython reuses a freed object's address: the entry for the new storage there stays when the old one's
    death is told later."""
    class Storage:
        def data_ptr(self) -> int:
            return 0

    st = scanner.Storages()
    a = Storage()
    address = id(a)
    first = st.sid(a, "cpu", 8, 1)
    del a  # its weak reference tells of its death; forget_dead has not run yet
    made = [Storage()]  # kept alive, so that each new one is at another free address, until one is at a's
    while id(made[-1]) != address and len(made) < 100_000:
        made.append(Storage())
    b = made[-1]
    if id(b) != address:
        pytest.skip("the allocator did not reuse the address this time")
    second = st.sid(b, "cpu", 8, 2)
    assert second != first
    st.forget_dead()
    assert st.known(b) == second and st.by_obj == {address: second}
