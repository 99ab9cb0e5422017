"""Cleanup through the real shell: exactly what is named goes, all or nothing, each step measured."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

import nbmem
from nbmem.clean.request import CleanupRefused
from nbmem.ipython.root import _ACTIVE
from nbmem.records import is_cache_name
from tests.conftest import last_cell, ok, run

MiB = 2**20


def user_names(sh) -> set[str]:
    hidden = sh.user_ns_hidden
    return {k for k, v in sh.user_ns.items()
            if not (k.startswith("_") or (k in hidden and hidden[k] is v))}


def dunders(sh) -> dict[str, object]:
    return {k: v for k, v in sh.user_ns.items() if k.startswith("__") and k.endswith("__")}


# -- exact deletion -------------------------------------------------------------------------------------
def test_deleting_a_name_leaves_other_names_bound_to_the_same_tensor(ip):
    ok(ip, "x = torch.empty(4 * 2**20)\nalias = x\nother = torch.empty(2**20)")
    ok(ip, "x")  # displayed: now also in Out, _N, _ and the last result
    shown = last_cell(ip)
    before = user_names(ip)
    rep = nbmem.cleanup(names=["x"])
    assert user_names(ip) == before - {"x"}
    assert ip.user_ns["alias"].numel() == 4 * MiB
    assert shown not in ip.user_ns["Out"] and f"_{shown}" not in ip.user_ns and ip.user_ns["_"] == ""
    assert rep.freed_allocated_bytes == 0, "alias still holds the 16 MiB: nothing was freed"
    ((held),) = rep.still_held
    assert (held.name, held.nbytes, held.named_by, held.saved_by, held.unnamed_bytes) == ("x", 16 * MiB, ("alias",),
                                                                                          (), 0)
    assert held.frees.names == ("alias",) and not (held.frees.outputs or held.frees.traceback)
    assert ("`x`: 16.0 MiB of its memory is still held, named by `alias` → `%cudamem clean alias` frees it"
            in str(rep)), str(rep)
    assert [s.action for s in rep.steps] == ["del", "gc.collect()", "empty_cache()"]
    assert "Out[" in rep.steps[0].note and "_" in rep.steps[0].note


def test_what_is_still_held_counts_the_graph_the_other_name_keeps(ip):
    """A loss still bound to `loss` after its list is deleted keeps its whole graph, not only its 4 bytes."""
    ok(ip, "w = torch.randn(1024, 1024, requires_grad=True)\nlosses = []\nfor _ in range(3):\n"
           "    loss = (torch.randn(1024, 1024) @ w).sum()  # its graph saves the 4 MiB input\n"
           "    losses.append(loss)")
    rep = nbmem.cleanup(names=["losses"])
    ((held),) = rep.still_held
    assert (held.name, held.nbytes, held.named_by, held.graph_bytes) == ("losses", 4, ("loss",), 4 * MiB)
    assert ("`losses`: 4 B of its memory (and its autograd graph, 4.00 MiB) is still held, named by `loss` → "
            "`%cudamem clean loss` frees it") in str(rep), str(rep)
    rep = nbmem.cleanup(names=["loss"])
    assert rep.freed_allocated_bytes == 4 * MiB + 4 and rep.still_held == ()  # the graph went with it


def test_deleting_a_name_frees_what_only_it_held(ip):
    ok(ip, "x = torch.empty(4 * 2**20)")
    ref = weakref.ref(ip.user_ns["x"])
    rep = nbmem.cleanup(names=["x"])
    gc.collect()
    assert ref() is None and rep.freed_allocated_bytes == 16 * MiB and rep.still_held == ()
    assert rep.freed_reserved_bytes is None  # no CUDA: unknown, not 0


def test_the_collector_never_starts_on_its_own_inside_a_cleanup_step(ip):
    """A step's bytes are what it freed: were the collector to start inside `del x`, garbage from earlier cells
    (reference cycles holding tensors) would be counted as the step's. The gc step collects that garbage, when
    asked."""
    ok(ip, "x = torch.empty(4 * 2**20)")
    inside: list[int] = []

    def watch(phase: str, info: dict) -> None:
        f = sys._getframe(1)
        while phase == "start" and f is not None:
            if f.f_code.co_name == "step" and f.f_code.co_filename.endswith("cleaner.py"):
                inside.append(info["generation"])
                break
            f = f.f_back

    threshold = gc.get_threshold()
    gc.callbacks.append(watch)
    gc.set_threshold(1, 1, 1)  # a collection at almost every allocation
    try:
        rep = nbmem.cleanup(names=["x"], collect=False, empty_cache=False)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(watch)
    assert [s.action for s in rep.steps] == ["del"] and rep.freed_allocated_bytes == 16 * MiB
    assert inside == [], f"{len(inside)} collections started inside the step"
    assert gc.isenabled()
    # A user who turned the collector off finds it off after a cleanup, and its gc step still collects.
    ok(ip, "y = torch.empty(2**20)")
    gc.disable()
    try:
        rep = nbmem.cleanup(names=["y"])
        assert not gc.isenabled() and [s.action for s in rep.steps][:2] == ["del", "gc.collect()"]
    finally:
        gc.enable()


@pytest.mark.parametrize("value", ["None", "0", "True", "'a'", "()"])
def test_a_name_bound_to_a_shared_singleton_removes_only_that_name(ip, value):
    ok(ip, f"gone = {value}\nkept1 = {value}\nkept2 = {value}")
    spec = ip.user_ns["__spec__"], ip.user_ns["__loader__"], ip.user_ns["__package__"]
    before, under = user_names(ip), dunders(ip)
    nbmem.cleanup(names=["gone"], collect=False, empty_cache=False)
    assert user_names(ip) == before - {"gone"}
    assert dunders(ip) == under
    assert (ip.user_ns["__spec__"], ip.user_ns["__loader__"], ip.user_ns["__package__"]) == spec
    assert eval(f"kept1 == kept2 == {value}", ip.user_ns)


def test_cleaning_two_names_after_the_first_was_displayed(ip):
    # 0.1 crashed half-way here: del_var set last_execution_result to None
    ok(ip, "a = torch.empty(2**20)\nb = torch.empty(2**20)")
    ok(ip, "a")
    assert ip.run_line_magic("cudamem", "clean a b a") is None  # shown, not left in Out[]
    rep = _ACTIVE[ip].session.last_cleanup
    assert "a" not in ip.user_ns and "b" not in ip.user_ns
    assert [s.target for s in rep.steps if s.action == "del"] == ["a", "b"]
    assert rep.freed_allocated_bytes == 8 * MiB
    assert ip.last_execution_result is not None
    ok(ip, "c = 1")
    nbmem.cleanup(names=["c"])


def test_the_hidden_underscore_after_reset_out_is_cleaned_with_the_name(ip):
    ok(ip, "t = torch.empty(2**20)")
    ok(ip, "t")
    ok(ip, "%reset -f out")
    assert ip.user_ns_hidden["_"] is ip.user_ns["t"], "IPython keeps _ in its hidden namespace"
    ref = weakref.ref(ip.user_ns["t"])
    nbmem.cleanup(names=["t"])
    assert ip.user_ns_hidden["_"] == "" and ref() is None


# -- all or nothing ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,problems", [
    (dict(names=["x", "nope"]), ["no variable named 'nope'"]),
    (dict(names=["x", "nope", "In", "__name__", "_"]),
     ["no variable named 'nope'", "'In' is IPython's own", "'__name__' is Python's own", "'_' is IPython's output"]),
    (dict(names=["x", "not a name"]), ["not a variable name"]),
    (dict(names=[3]), ["not a variable name"]),
    (dict(names="x y"), ["not a variable name"]),
    (dict(to_cpu=["n"]), ["'n' is a int: only tensors and torch.nn.Modules move"]),
    (dict(names=["x"], to_cpu=["x"]), ["both deleted and moved"]),
    (dict(names=["x"], outputs="yes"), ["outputs must be True or False"]),
])
def test_a_bad_request_lists_every_problem_and_removes_nothing(ip, kwargs, problems):
    ok(ip, "x = torch.empty(2**20)\nn = 3")
    ok(ip, "x")
    before = dict(ip.user_ns)
    out_before = dict(ip.user_ns["Out"])
    with pytest.raises(CleanupRefused) as e:
        nbmem.cleanup(**kwargs)
    for p in problems:
        assert any(p in q for q in e.value.problems), (p, e.value.problems)
    assert "Nothing was removed" in str(e.value)
    assert dict(ip.user_ns) == before and dict(ip.user_ns["Out"]) == out_before


def test_the_magic_refuses_the_same_way_as_a_usage_error(ip):
    ok(ip, "x = torch.empty(2**20)")
    with pytest.raises(UsageError, match=r"no variable named 'nope'.*Nothing was removed"):
        ip.run_line_magic("cudamem", "clean x nope")
    assert "x" in ip.user_ns


def test_a_step_that_fails_keeps_the_report_of_the_steps_before_it(ip, monkeypatch):
    ok(ip, "x = torch.empty(2**20)")
    sess = _ACTIVE[ip].session

    def broken() -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(sess, "_empty_cache", broken)
    rep = nbmem.cleanup(names=["x"])
    assert "x" not in ip.user_ns
    assert [s.action for s in rep.steps] == ["del", "gc.collect()", "empty_cache()"]
    assert rep.steps[0].freed_allocated_bytes == 4 * MiB and rep.steps[-1].error.startswith("RuntimeError")
    assert rep.errors and not sess.faults


# -- the last report ------------------------------------------------------------------------------------
def test_last_report_removes_exactly_what_the_last_report_listed(ip):
    ok(ip, "model = torch.nn.Linear(512, 512)\ndata = [torch.empty(2**20)]\nsmall = torch.empty(10)")
    ok(ip, "a = torch.empty(2**20)\nb = {'k': torch.empty(2**20)}")
    listed = _ACTIVE[ip].session.last_report
    assert {f.name for f in listed.findings} == {"a", "b"}
    ok(ip, "torch.ones(2**20)")  # a later cell: its report (an output) is now the last one
    ip.run_line_magic("cudamem", "clean --last-report")
    rep = _ACTIVE[ip].session.last_cleanup
    assert {"model", "data", "small", "a", "b"} <= user_names(ip), "only the output was in the last report"
    assert ip.user_ns["Out"] == {} and rep.freed_allocated_bytes == 4 * MiB


def test_last_report_deletes_the_variables_it_named(ip):
    ok(ip, "keep = torch.empty(2**20)")
    ok(ip, "a = torch.empty(2**20)\nb = {'k': torch.empty(2**20)}")
    report = _ACTIVE[ip].session.last_report
    assert str(report).splitlines()[-1] == "`%cudamem clean --last-report` would run: a b"
    ip.run_line_magic("cudamem", "clean --last-report")
    rep = _ACTIVE[ip].session.last_cleanup
    assert "a" not in ip.user_ns and "b" not in ip.user_ns and "keep" in ip.user_ns
    assert rep.freed_allocated_bytes == 8 * MiB


def test_last_report_means_the_last_report_shown_not_a_hidden_one(ip):
    ok(ip, "a = torch.empty(2**20)")
    ok(ip, "y = 1")  # changed nothing: its report is recorded but not shown
    assert _ACTIVE[ip].session.last_report.cell == last_cell(ip)
    ip.run_line_magic("cudamem", "clean --last-report")
    assert "a" not in ip.user_ns and "y" in ip.user_ns


def test_last_report_that_listed_nothing_says_so_and_runs_nothing(ip, capsys):
    ok(ip, "a = torch.empty(2**20)")
    ok(ip, "%config Nbmem.show = 'always'")
    ok(ip, "y = 1")
    with pytest.raises(UsageError, match=r"listed nothing to remove\. Nothing was run"):
        ip.run_line_magic("cudamem", "clean --last-report")
    assert "a" in ip.user_ns


def test_all_flagged_says_it_was_renamed_and_removes_nothing(ip):
    ok(ip, "a = torch.empty(2**20)")
    with pytest.raises(UsageError, match="--last-report"):
        ip.run_line_magic("cudamem", "clean --all-flagged")
    assert "a" in ip.user_ns


# -- the other steps --------------------------------------------------------------------------------------
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
    assert list(f["kind"]) == ["traceback"] and f["name"].iloc[0] == "<traceback step>"
    assert "<traceback step>.batch" in f["holders"].iloc[0]
    assert "--traceback" in f["hint"].iloc[0]
    ip.run_line_magic("tb", "")  # the formatter materialises frame locals (the 3.11 trap)
    rep = nbmem.cleanup(traceback=True)
    assert rep.freed_allocated_bytes == 16 * MiB
    assert "no longer inspect" in rep.steps[0].note
    assert nbmem.leaks().empty


def test_a_failed_step_is_named_by_the_users_frame_not_the_librarys(ip):
    # the batch reaches torch's forward() as `input`; the user knows it as train_step's `big_batch`
    ok(ip, "model = torch.nn.Linear(1024, 1024)\n"
           "def train_step():\n    big_batch = torch.ones(2048, 1024)\n    return model(big_batch.T)")
    assert not run(ip, "train_step()").success
    f = nbmem.leaks(cell=last_cell(ip))
    assert f["name"].iloc[0] == "<traceback train_step>", f
    assert f["holders"].iloc[0][:2] == ["<traceback train_step>.big_batch", "<traceback forward in torch>.input"]
    hint = nbmem.leaks().set_index("name").loc["model", "hint"]
    assert hint == ("`del model` frees nothing: also held by the last exception's frames → "
                    "`%cudamem clean model --traceback`"), hint


def test_to_cpu_keeps_the_data_bit_for_bit(ip):
    ok(ip, "m = torch.nn.Linear(8, 8)\nt = torch.randn(1000)\nt_copy = t.clone()\nw_copy = m.weight.detach().clone()")
    rep = nbmem.cleanup(to_cpu=["t", "m"], collect=False, empty_cache=False)
    assert torch.equal(ip.user_ns["t"], ip.user_ns["t_copy"])
    assert torch.equal(ip.user_ns["m"].weight, ip.user_ns["w_copy"])
    assert [s.action for s in rep.steps] == ["to CPU", "to CPU"]


# -- the property: exactly the names asked for, plus IPython's own references to their objects --------------
VALUES = ["None", "0", "1", "True", "'a'", "''", "()", "torch.empty(16)", "[torch.empty(4)]", "{'k': 1}", "object()"]


@st.composite
def namespaces(draw):
    n = draw(st.integers(1, 6))
    names = [f"v{i}" for i in range(n)]
    plan = []
    for i, name in enumerate(names):
        if i and draw(st.booleans()):
            plan.append((name, names[draw(st.integers(0, i - 1))]))  # an alias of an earlier name
        else:
            plan.append((name, draw(st.sampled_from(VALUES))))
    shown = draw(st.lists(st.sampled_from(names), max_size=3))
    fail = draw(st.booleans())
    asked = draw(st.lists(st.sampled_from(names), min_size=1, max_size=n))
    return plan, shown, fail, asked


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(namespaces())
def test_cleanup_removes_exactly_the_names_asked_for_property(shell, case):
    if "nbmem" not in sys.modules or shell not in _ACTIVE:
        ok(shell, "%load_ext nbmem")
        ok(shell, "import torch")
    plan, shown, fail, asked = case
    for k in [k for k in user_names(shell) if k.startswith("v")]:
        del shell.user_ns[k]
    ok(shell, "\n".join(f"{a} = {b}" for a, b in plan))
    for name in shown:
        ok(shell, name)
    if fail:
        run(shell, "def _boom(x=v0):\n    local = x\n    raise ValueError('x')\n_boom()")
    before = dict(shell.user_ns)
    out_before = dict(shell.user_ns["Out"])
    hidden_before = dict(shell.user_ns_hidden)
    gone = [before[a] for a in dict.fromkeys(asked)]
    nbmem.cleanup(names=asked, collect=False, empty_cache=False)

    def is_gone(obj):
        return any(obj is g for g in gone)

    assert user_names(shell) == user_names_of(before, shell) - set(asked)
    for k, v in before.items():
        if k in asked:
            continue
        if is_cache_name(k) and is_gone(v):
            assert k not in shell.user_ns or shell.user_ns[k] == "", k  # IPython's cache: dropped
        else:
            assert shell.user_ns[k] is v, k  # every other name, dunders included, untouched
    for n, v in out_before.items():
        assert (n not in shell.user_ns["Out"]) if is_gone(v) else shell.user_ns["Out"][n] is v
    for k, v in hidden_before.items():
        if not is_gone(v):
            assert shell.user_ns_hidden[k] is v, k


def user_names_of(ns, sh) -> set[str]:
    hidden = sh.user_ns_hidden
    return {k for k, v in ns.items() if not (k.startswith("_") or (k in hidden and hidden[k] is v))}


def test_a_refusal_of_a_thousand_names_names_a_few_and_counts_the_rest(ip):
    names = [f"n{i}" for i in range(1000)]
    with pytest.raises(ValueError) as e:
        nbmem.cleanup(names=names)
    assert str(e.value) == ("no variable named 'n0', 'n1', 'n2', 'n3', 'n4' (and 995 more) in this notebook. "
                            "Nothing was removed.")
    with pytest.raises(ValueError, match=r"\(and 995 more\)") as e:
        nbmem.cleanup(names=[f"{i}x" for i in range(1000)])
    assert len(str(e.value)) < 400


def test_memory_a_deleted_name_left_to_the_last_exception_says_how_to_free_it(ip):
    ok(ip, "batch = torch.ones(2**20)\ndef step(b):\n    raise RuntimeError('x')")
    assert not run(ip, "step(batch)").success
    ok(ip, "del batch")
    f = nbmem.leaks(cell=last_cell(ip))
    assert list(f["name"]) == ["<traceback step>"], f
    assert f["hint"].iloc[0] == ("`batch` was deleted or rebound, but the last exception's frames still hold it "
                                 "(`<traceback step>.b`): `%cudamem clean --traceback` frees it (ends `%debug` for it)")


class _Moves:
    """A namespace whose one model moves 200 bytes from a GPU to the host: the cleaner's arithmetic alone (the
    real move is measured on a GPU in tests/gpu/test_cleanup_gpu.py)."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def has(self, name: str) -> bool:
        return name == "m"

    def protected(self, name: str) -> None:
        return None

    def movable(self, name: str) -> None:
        return None

    def to_cpu(self, name: str) -> str:
        self.state.update({"cuda:0": (100, 400), "cpu": (210, None)})
        return "module moved in place"


def test_a_move_to_the_cpu_counts_what_left_the_gpu_and_says_what_the_host_gained():
    from nbmem.clean.cleaner import Cleaner
    from nbmem.clean.request import CleanupRequest

    state = {"cuda:0": (300, 400), "cpu": (10, None)}
    ns = _Moves(state)
    rep = Cleaner(ns, lambda: dict(state), lambda: True, lambda: "").run(  # type: ignore[arg-type]
        CleanupRequest(to_cpu=("m",), collect=False, empty_cache=False))
    (move,) = rep.steps
    assert (move.freed_allocated_bytes, move.freed_reserved_bytes) == (200, 0), "not 0: the host's gain is apart"
    assert move.note == "module moved in place; 200 B more on the CPU"
    assert rep.freed_allocated_bytes == 200


def test_last_report_frees_an_element_the_output_history_also_holds(ip):
    # Out[n] holds losses[0], not the list: deleting `losses` alone would leave it; the hint and the one click
    # say --outputs too. A displayed variable itself needs no flag: nbmem's delete takes IPython's references.
    ok(ip, "lin = torch.nn.Linear(512, 512)\nlosses = [lin(torch.randn(1024, 512)).relu().sum() for _ in range(3)]")
    ok(ip, "losses[0]")
    report = _ACTIVE[ip].session.last_report
    (row,) = report.findings
    assert row.hint.endswith("`%cudamem clean losses --outputs` removes both"), row.hint
    assert str(report).splitlines()[-1] == "`%cudamem clean --last-report` would run: losses --outputs"
    ip.run_line_magic("cudamem", "clean --last-report")  # shows its table and returns None
    rep = _ACTIVE[ip].session.last_cleanup
    assert rep.freed_allocated_bytes >= 12 * MiB and "lin" in ip.user_ns
    ok(ip, "x = torch.empty(2**20)")
    ok(ip, "x")
    (row,) = [r for r in nbmem.leaks().itertuples() if r.name == "x"]
    assert row.hint == (f"the output history (Out[{last_cell(ip)}]) also holds it: `del x` alone frees nothing; "
                        "`%cudamem clean x` removes both") and row.action == "%cudamem clean x", row
