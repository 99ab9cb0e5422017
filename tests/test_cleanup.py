"""Cleanup through the real shell: exactly what is named goes, each step's bytes are measured."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import nbmem
from nbmem import holders
from nbmem.magics import _ACTIVE
from tests.conftest import last_cell, ok, run

MiB = 2**20


def storage_ref(sh, expr):
    """A weakref to a tensor in the shell (tensors support weakrefs; storages are recreated per call)."""
    return weakref.ref(eval(expr, sh.user_ns))


def test_delete_by_name_goes_through_del_var_and_nothing_else(ip):
    ok(ip, "x = torch.empty(4 * 2**20)\nalias = x\nother = torch.empty(2**20)")
    ok(ip, "x")  # displayed: now also in Out, _N, _ and the last result
    ref = storage_ref(ip, "x")
    rep = nbmem.cleanup(names=["x"])
    assert "x" not in ip.user_ns and "alias" not in ip.user_ns  # del_var removes every name bound to it
    assert "other" in ip.user_ns
    gc.collect()
    assert ref() is None
    assert rep.freed_allocated_bytes == 16 * MiB
    assert rep.freed_reserved_bytes is None  # no CUDA: unknown, not 0
    assert [s.action for s in rep.steps] == ["del", "gc.collect()", "empty_cache()"]


def test_a_name_in_a_container_stays_held_and_the_report_says_who(ip):
    ok(ip, "x = torch.empty(4 * 2**20)\nbag = [x]")
    ok(ip, "del x")
    f = nbmem.leaks(cell=last_cell(ip))
    assert list(f["name"]) == ["bag[0]"] and "x was deleted or rebound" in f["hint"].iloc[0]


def test_clear_outputs_frees_what_the_history_held(ip):
    ok(ip, "torch.ones(4 * 2**20)")
    cell = last_cell(ip)
    f = nbmem.leaks(cell=cell)
    assert set(f["kind"]) == {"output"} and {f"Out[{cell}]", f"_{cell}", "_"} <= set(f["holders"].iloc[0])
    ref = weakref.ref(ip.user_ns["Out"][cell])
    rep = nbmem.cleanup(outputs=True)
    gc.collect()
    assert ref() is None and rep.freed_allocated_bytes == 16 * MiB
    assert ip.user_ns["Out"] == {}


def test_clear_traceback_frees_the_frames_locals(ip):
    ok(ip, "def step():\n    batch = torch.ones(4 * 2**20)\n    raise RuntimeError('x')")
    r = run(ip, "step()")
    assert not r.success
    f = nbmem.leaks(cell=last_cell(ip))
    assert list(f["kind"]) == ["traceback"] and "batch" in f["name"].iloc[0]
    ip.run_line_magic("tb", "")  # the formatter materialises frame locals (the 3.11 trap)
    rep = nbmem.cleanup(traceback=True)
    assert rep.freed_allocated_bytes == 16 * MiB
    assert "no longer inspect" in rep.steps[0].note
    assert nbmem.leaks().empty


def test_to_cpu_keeps_the_data_bit_for_bit(ip):
    ok(ip, "m = torch.nn.Linear(8, 8)\nt = torch.randn(1000)\nt_copy = t.clone()\nw_copy = m.weight.detach().clone()")
    rep = nbmem.cleanup(to_cpu=["t", "m"], collect=False, empty_cache=False)
    assert torch.equal(ip.user_ns["t"], ip.user_ns["t_copy"])
    assert torch.equal(ip.user_ns["m"].weight, ip.user_ns["w_copy"])
    assert [s.action for s in rep.steps] == ["to CPU", "to CPU"]


@pytest.mark.parametrize("kwargs,err", [
    (dict(names=["x", "nope"]), NameError),
    (dict(names=["x", "not a name"]), ValueError),
    (dict(names=[3]), ValueError),
    (dict(to_cpu=["n"]), TypeError),
])
def test_bad_cleanup_input_removes_nothing(ip, kwargs, err):
    ok(ip, "x = torch.empty(2**20)\nn = 3")
    with pytest.raises(err, match="Nothing was removed"):
        nbmem.cleanup(**kwargs)
    assert "x" in ip.user_ns and "n" in ip.user_ns


def test_clean_all_flagged_takes_what_the_report_lists(ip):
    ok(ip, "a = torch.empty(2**20)\nb = {'k': torch.empty(2**20)}\nsmall = torch.empty(10)")
    ok(ip, "torch.ones(2**20)")
    rep = ip.run_line_magic("cudamem", "clean --all-flagged")
    assert "a" not in ip.user_ns and "b" not in ip.user_ns and "small" in ip.user_ns
    assert rep.freed_allocated_bytes == 12 * MiB
    assert nbmem.leaks().empty


def test_an_idle_cell_is_not_walked_again(ip, monkeypatch):
    ok(ip, "x = torch.empty(2**20)")
    calls = []
    real = holders.scan
    monkeypatch.setattr(holders, "scan", lambda *a, **k: calls.append(1) or real(*a, **k))
    ok(ip, "pass")
    ok(ip, "1 + 1;")
    assert calls == []
    ok(ip, "state = {'runs': [{}]}")
    ok(ip, "state['runs'][0]['acts'] = torch.empty(2**20)")  # no new name: the heap counter sees it
    assert len(calls) == 2
    assert list(nbmem.leaks(cell=last_cell(ip))["name"]) == ["state['runs'][0]['acts']"]


def test_findings_are_shown_under_the_cell_as_text_and_html(ip, capsys):
    capsys.readouterr()
    ok(ip, "d = {'<img src=x onerror=alert(1)>': torch.empty(2**20)}")
    out = capsys.readouterr().out
    assert "d['<img src=x onerror=alert(1)>']" in out
    report = _ACTIVE[ip].session.last_report
    html = report._repr_html_()
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html


def test_rebinding_a_name_with_a_digit_or_an_i_prefix_counts_as_a_change(ip):
    # The fingerprint once skipped every name whose second character is a digit (`x1`) or that starts
    # with `_i` (`_idx`), as if they were IPython's `_12` / `_i12`.
    from nbmem.magics import _ACTIVE

    adapter = _ACTIVE[ip].session.adapter
    for name in ("x1", "_idx"):
        ok(ip, f"{name} = object()")
        before = adapter.fingerprint()
        ok(ip, f"{name} = object()")
        assert adapter.fingerprint()[1] != before[1], name
