"""``%%cudamem --fit`` and ``nbmem.fit`` as a user meets them on any machine: arguments, the CPU refusal, and
what a fit puts back (the namespace, the model's state) — the GPU runs are in tests/gpu/test_fit_gpu.py."""

from __future__ import annotations

import pytest
import torch
from IPython.core.error import UsageError

import nbmem
from nbmem.holders.walk import Root, reachable_state
from nbmem.ipython.root import session_of
from nbmem.records import HolderKind
from tests.conftest import HAS_GPU, ok

BODY = "x = torch.randn(batch, 64)\nloss = model(x).sum()\nloss.backward()\nopt.step()\nran = True"


@pytest.fixture
def nb(ip):
    ok(ip, "model = torch.nn.Linear(64, 64)\nopt = torch.optim.Adam(model.parameters())")
    return ip


@pytest.mark.parametrize(("line", "message"), [
    ("--fit batch", r"takes NAME=V1,V2,\.\.\. \(e\.g\. --fit batch=8,16,32\)"),
    ("--fit batch=8,sixteen", r"must be positive whole numbers"),
    ("--fit batch=0,8", r"must be positive whole numbers"),
    ("--fit batch=8", r"give 2 to 5 different values .*one value shows no growth"),
    ("--fit batch=8,8", r"one value shows no growth"),
    ("--fit batch=1,2,3,4,5,6", r"each one runs the cell"),
    ("--fit size=8,16", r"the cell does not use `size`"),
    ("--fit batch=8,16 --lines", r"does not take --lines"),
    ("--no-restore", r"--no-restore goes with --fit"),
    ("--want 512", r"--want goes with --fit"),
    ("--fit batch=8,16 --want 0", r"--want takes the batch you want to run at, a positive whole number"),
    ("--fit batch=8,16 --want lots", r"--want takes the batch .*not 'lots'"),
    ("--fit batch=8,16 --want -4", r"--want takes the batch"),
    ("--fit batch=8,16 --want 2.5", r"--want takes the batch .*not '2.5'"),
    ("--fit batch=8,16 --want 512 --lines", r"does not take --lines"),
    ("--on L4", r"--on goes with --fit"),
    ("--fit batch=8,16 --on banana", r"--on takes a memory size \(24GiB, 24GB.*\) or a GPU: T4, .*L4.*; not 'banana'"),
    ("--fit batch=8,16 --on 24", r"--on takes a memory size"),
    ("--fit batch=8,16 --on 100MB", r"--on takes a memory size .*too small for a GPU"),
    ("--fit batch=8,16 --on L4 --lines", r"does not take --lines"),
    # A name's second word left unquoted: the fix, not the line form of a command that does not exist.
    ("--fit batch=8,16 --on A100 40GB", r"--on and --host-limit take one value each, not '40GB' after it: quote a "
                                        r"name with a space \(`--on \"A100 40GB\"`\)\. Nothing was run\."),
    ("--fit batch=8,16 --on 24 GiB", r"not 'GiB' after it"),
    ("--fit batch=8,16 --on", r"^%%cudamem: could not read .*expected one argument.*Nothing was run\.$"),
    ("--host-limit 8GiB", r"--host-limit goes with --fit"),
    ("--fit batch=8,16 --host-limit lots", r"--host-limit: host_limit takes a memory size such as '8GiB'.*'lots'"),
])
def test_a_bad_fit_is_refused_in_one_line_and_the_cell_does_not_run(nb, line, message):
    with pytest.raises(UsageError, match=message) as e:
        nb.run_cell_magic("cudamem", line, BODY)
    assert "\n" not in str(e.value)
    assert "ran" not in nb.user_ns and "x" not in nb.user_ns


@pytest.mark.skipif(HAS_GPU, reason="checks the machine without CUDA")
def test_without_cuda_a_fit_says_it_needs_cudas_allocator_and_the_body_does_not_run(nb):
    w = nb.user_ns["model"].weight.detach().clone()
    with pytest.raises(UsageError, match=r"fitting needs CUDA's caching allocator.*The cell did not run"):
        nb.run_cell_magic("cudamem", "--fit batch=8,16,32", BODY)
    assert "ran" not in nb.user_ns and torch.equal(nb.user_ns["model"].weight, w)
    with pytest.raises(RuntimeError, match=r"fitting needs CUDA's caching allocator, .*; nothing was run"):
        nbmem.fit(BODY, "batch", [8, 16])
    with pytest.raises(ValueError, match="does not use `n`"):
        nbmem.fit(BODY, "n", [8, 16])
    with pytest.raises(ValueError, match="2 to 5 different positive values"):
        nbmem.fit(BODY, "batch", [8])
    with pytest.raises(LookupError, match="no fit has run yet"):
        nbmem.plot_fit()
    for on in ("L4", '"A100 40GB"', "24GiB", "L4 --host-limit 8GiB"):  # a good --on gets as far as the usual refusal
        with pytest.raises(UsageError, match=r"fitting needs CUDA's caching allocator.*The cell did not run"):
            nb.run_cell_magic("cudamem", f"--fit batch=8,16,32 --on {on}", BODY)
    with pytest.raises(RuntimeError, match=r"fitting needs CUDA's caching allocator"):
        nbmem.fit(BODY, "batch", [8, 16], on="A100 40GB")
    assert "ran" not in nb.user_ns
    assert session_of(nb).probe.nvml.own_used(0) is None, "no NVML here: the context's size is not known from it"


def test_the_namespace_is_put_back_after_each_run_and_the_fits_variable_restored(nb):
    ok(nb, "batch = 'mine'\nloss = 'old loss'")
    adapter = session_of(nb).adapter
    before = dict(nb.user_ns)
    space = adapter.fit_namespace(BODY, "batch", 7)
    space.run(4)
    assert nb.user_ns["batch"] == 4 and nb.user_ns["ran"] is True and nb.user_ns["x"].shape == (4, 64)
    space.clean()
    assert "ran" not in nb.user_ns and "x" not in nb.user_ns, "names the body made are gone"
    assert nb.user_ns["loss"] == "old loss" and nb.user_ns["batch"] == "mine", "rebound names are bound again"
    ok(nb, "del batch")
    space = adapter.fit_namespace("del loss\ny = batch", "batch", 8)
    space.run(2)
    space.close()
    assert "batch" not in nb.user_ns, "a name that was not there before the fit is not there after it"
    assert nb.user_ns["loss"] == "old loss", "a name the body deleted is bound again"
    assert "y" not in nb.user_ns and before["model"] is nb.user_ns["model"]
    assert space.filename == "<nbmem fit of In[8]>" and space.sources == {1: "del loss", 2: "y = batch"}


def test_the_state_a_fit_restores_is_found_by_walking_what_the_cell_names(nb):
    ok(nb, "class Trainer:\n    def __init__(self, m, o):\n        self.model, self.optimizer = m, o\n"
           "trainer = Trainer(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), None)\n"
           "trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.1)")
    sess = session_of(nb)
    ns = nb.user_ns
    roots = [Root(n, HolderKind.NAMESPACE, ns[n]) for n in ("trainer", "model", "opt")]
    found = reachable_state(torch, roots, sess.holdings.scanner.type_cache)
    assert {id(m) for m in found.modules} == {id(ns["trainer"].model), id(ns["model"])}, "outermost modules only"
    assert {id(o) for o in found.optimizers} == {id(ns["trainer"].optimizer), id(ns["opt"])}


def test_a_fit_finds_schedulers_scalers_and_the_iterators_it_cannot_put_back(nb):
    from nbmem.fitting.notebook import state_reached

    ok(nb, "sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=100)\n"
           "scaler = torch.amp.GradScaler('cpu')\n"
           "class Loop:\n    def __init__(self):\n        self.sched, self.batches = sched, iter([1, 2, 3])\n"
           "loop = Loop()\n"
           "def gen():\n    yield 1\n"
           "g = gen()")
    sess = session_of(nb)
    used = sess.adapter.mentioned("loop.sched.step(); scaler.update(); next(g); opt.step()")
    found = state_reached(sess.adapter, torch, sess.holdings.scanner.type_cache, used, [], budget_s=None)
    assert sorted(type(o).__name__ for o in found.others) == ["GradScaler", "OneCycleLR"]
    assert [id(o) for o in found.optimizers] == [id(nb.user_ns["opt"])]
    assert sorted(found.iterators) == ["g (generator)", "loop.batches (list_iterator)"]


def test_a_fit_finds_the_state_a_cell_changes_through_the_functions_it_calls(nb):
    """`train_step(batch)` trains `model` and `opt` through its globals: they are what a fit must restore."""
    from nbmem.fitting.notebook import state_reached

    ok(nb, "def _inner(x):\n    return model(x).sum()\n"
           "def train_step(b):\n    loss = _inner(torch.randn(b, 64))\n    loss.backward()\n    opt.step()")
    sess = session_of(nb)
    used = sess.adapter.mentioned("train_step(batch)") - {"batch"}
    found = state_reached(sess.adapter, torch, sess.holdings.scanner.type_cache, used, [], budget_s=None)
    assert [id(m) for m in found.modules] == [id(nb.user_ns["model"])]
    assert [id(o) for o in found.optimizers] == [id(nb.user_ns["opt"])]


@pytest.mark.parametrize("on", ["banana", "", 24, "-4GB"])
def test_nbmem_fit_refuses_a_bad_gpu_in_one_line_that_lists_the_accepted_forms_and_runs_nothing(nb, on):
    with pytest.raises(ValueError, match=r"nbmem.fit\(on=...\) takes a memory size .* or a GPU: T4, ") as e:
        nbmem.fit(BODY, "batch", [8, 16], on=on)
    assert "\n" not in str(e.value) and "ran" not in nb.user_ns


@pytest.mark.parametrize("want", [0, -3, 2.5, "512"])
def test_nbmem_fit_refuses_a_bad_want_in_one_line_and_runs_nothing(nb, want):
    with pytest.raises(ValueError, match=r"nbmem.fit\(want=...\) takes the batch you want to run at") as e:
        nbmem.fit(BODY, "batch", [8, 16], want=want)
    assert "\n" not in str(e.value) and "ran" not in nb.user_ns
