"""The cost of a monitored cell stays small in a notebook that holds a big model (issue 38), and what the gauge
lists stays true: an owner row whose memory did not change is reused, and a reused row is the row a fresh
judgement would make."""

from __future__ import annotations

from typing import Any

import pytest

from nbmem.holders import owners
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
