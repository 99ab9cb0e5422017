"""``%%cudamem --fit`` and ``nbmem.fit`` as a user meets them on any machine: arguments, the CPU refusal, and
what a fit puts back (the namespace, the model's state) — the GPU runs are in tests/gpu/test_fit_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from IPython.core.error import UsageError

import nbmem
from nbmem.holders.reached import reachable_state
from nbmem.holders.walk import Root
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
    ("--fit batch=8,16 --host-limit lots", r"^%%cudamem --host-limit takes a memory size above 0, such as '8GiB', "
                                           r"'8GB' or '8000MiB'; not 'lots'\. Nothing was run\.$"),
    # Digits str.isdigit takes and int() does not ("²"), or that no one types for a batch ("８", fullwidth).
    ("--fit batch=8,²", r"^%%cudamem --fit batch=\.\.\.: the values must be positive whole numbers, comma-separated "
                        r"\(e\.g\. batch=8,16,32\), not '8,²'\. Nothing was run\.$"),
    ("--fit batch=８,16", r"must be positive whole numbers.*not '８,16'"),
    ("--fit batch=8.0,16", r"must be positive whole numbers.*not '8\.0,16'"),
    ("--fit batch=8," + "9" * 5000, r"must be positive whole numbers.*not '8,9999"),  # more digits than int() reads
    ("--fit batch=8,-16", r"must be positive whole numbers"),
    ("--fit batch=8,16 --want ²", r"^%%cudamem --want takes the batch you want to run at, a positive whole number "
                                  r"\(e\.g\. --want 512\), not '²'\. Nothing was run\.$"),
    ("--fit batch=8,16 --host-limit 0GB", r"^%%cudamem --host-limit takes a memory size above 0, such as '8GiB', "
                                          r"'8GB' or '8000MiB'; not '0GB'\. Nothing was run\.$"),
    ("--fit batch=8,16 --host-limit 8", r"--host-limit takes a memory size above 0.*; not '8'"),  # 8 what?
    ("--fit batch=8,16 --host-limit=-1GB", r"--host-limit takes a memory size above 0.*; not '-1GB'"),
    ("--fit batch=8,16 --bogus", r"^%%cudamem does not take --bogus; .*`%cudamem\?` says what each option does\. "
                                 r"Nothing was run\.$"),
    # The line form's command on a cell's first line.
    ("on --fit batch=8,16", r"^%%cudamem takes options only, not 'on': put `%%cudamem` alone on the first line, or "
                            r"use the line form `%cudamem on`\. Nothing was run\.$"),
])
def test_a_bad_fit_is_refused_in_one_line_and_the_cell_does_not_run(nb, line, message):
    with pytest.raises(UsageError, match=message) as e:
        nb.run_cell_magic("cudamem", line, BODY)
    assert "\n" not in str(e.value) and str(e.value).endswith(" Nothing was run.")
    assert "ran" not in nb.user_ns and "x" not in nb.user_ns


@pytest.mark.skipif(HAS_GPU, reason="checks the machine without CUDA")
def test_without_cuda_a_fit_says_it_needs_cudas_allocator_and_the_body_does_not_run(nb):
    w = nb.user_ns["model"].weight.detach().clone()
    with pytest.raises(UsageError, match=r"^%%cudamem --fit: fitting needs CUDA's caching allocator, .*\. "
                                         r"Nothing was run\.$"):
        nb.run_cell_magic("cudamem", "--fit batch=8,16,32", BODY)
    assert "ran" not in nb.user_ns and torch.equal(nb.user_ns["model"].weight, w)
    with pytest.raises(RuntimeError, match=r"^nbmem.fit: fitting needs CUDA's caching allocator, .*\. "
                                           r"Nothing was run\.$"):
        nbmem.fit(BODY, "batch", [8, 16])
    # Good values of every allowed kind get as far as the usual refusal.
    with pytest.raises(UsageError, match=r"fitting needs CUDA's caching allocator.*Nothing was run\.$"):
        nb.run_cell_magic("cudamem", "--fit batch=8,16,32 --want 1_000 --host-limit 8GiB", BODY)
    for values, kwargs in [(np.array([8, 16]), {}), ((np.int64(8), 16), {"want": np.int32(64)}),
                           (range(8, 11), {"host_limit": np.int64(8 << 30)}), ({16, 8}, {"host_limit": "1.5GB"})]:
        with pytest.raises(RuntimeError, match=r"fitting needs CUDA's caching allocator.*Nothing was run\.$"):
            nbmem.fit(BODY, "batch", values, **kwargs)
    with pytest.raises(ValueError, match="does not use `n`"):
        nbmem.fit(BODY, "n", [8, 16])
    with pytest.raises(ValueError, match="2 to 5 different positive values"):
        nbmem.fit(BODY, "batch", [8])
    with pytest.raises(LookupError, match="no fit has run yet"):
        nbmem.plot_fit()
    for on in ("L4", '"A100 40GB"', "24GiB", "L4 --host-limit 8GiB"):  # a good --on gets as far as the usual refusal
        with pytest.raises(UsageError, match=r"fitting needs CUDA's caching allocator.*Nothing was run\.$"):
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
    from nbmem.fitting.runs.notebook import state_reached

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


def test_a_walk_for_the_state_that_runs_out_of_time_says_so(nb):
    """The optimizer comes after a large object in the walk: out of time before it, the walk must not pass for
    complete (a fit would then put back the model and not the optimizer, as it did at 7B under a profiler)."""
    from nbmem.fitting.runs.notebook import state_reached

    ok(nb, "big = [[i] for i in range(200_000)]")
    sess = session_of(nb)
    used = {"big", "model", "opt"}
    cut = state_reached(sess.adapter, torch, sess.holdings.scanner.type_cache, used, [], budget_s=0.0)
    whole = state_reached(sess.adapter, torch, sess.holdings.scanner.type_cache, used, [], budget_s=None)
    assert cut.stopped_after is not None and cut.stopped_after < 200_000
    assert whole.stopped_after is None
    assert [id(o) for o in whole.optimizers] == [id(nb.user_ns["opt"])]


def test_a_fit_finds_the_state_a_cell_changes_through_the_functions_it_calls(nb):
    """`train_step(batch)` trains `model` and `opt` through its globals: they are what a fit must restore."""
    from nbmem.fitting.runs.notebook import state_reached

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
    assert "\n" not in str(e.value) and str(e.value).endswith(". Nothing was run.") and "ran" not in nb.user_ns


@pytest.mark.parametrize("want", [0, -3, 2.5, "512", True, float("inf")])
def test_nbmem_fit_refuses_a_bad_want_in_one_line_and_runs_nothing(nb, want):
    with pytest.raises(ValueError, match=r"nbmem.fit\(want=...\) takes the batch you want to run at") as e:
        nbmem.fit(BODY, "batch", [8, 16], want=want)
    assert "\n" not in str(e.value) and str(e.value).endswith(". Nothing was run.") and "ran" not in nb.user_ns


SIZES = "takes a memory size above 0, such as '8GiB', '8GB' or '8000MiB'"


@pytest.mark.parametrize(("args", "kwargs", "error", "message"), [
    # Values: whole numbers only, never read digit by digit, rounded, or taken from a bool.
    ((["8", "16"],), {}, TypeError, "nbmem.fit(values=...) takes whole numbers such as [8, 16, 32], not '8' (str)."),
    (("816",), {}, TypeError, "nbmem.fit(values=...) takes a list of whole numbers such as [8, 16, 32], got '816'."),
    ((b"\x08\x10",), {}, TypeError,
     "nbmem.fit(values=...) takes a list of whole numbers such as [8, 16, 32], got b'\\x08\\x10'."),
    (([8.7, 16.2],), {}, TypeError, "nbmem.fit(values=...) takes whole numbers such as [8, 16, 32], not 8.7 (float)."),
    (([8.0, 16],), {}, TypeError, "nbmem.fit(values=...) takes whole numbers such as [8, 16, 32], not 8.0 (float)."),
    (([8, float("inf")],), {}, TypeError,
     "nbmem.fit(values=...) takes whole numbers such as [8, 16, 32], not inf (float)."),
    (([8, np.float64(16)],), {}, TypeError,
     "nbmem.fit(values=...) takes whole numbers such as [8, 16, 32], not np.float64(16.0) (float64)."),
    (([True, 8],), {}, TypeError, "nbmem.fit(values=...) takes whole numbers such as [8, 16, 32], not True (bool)."),
    ((True,), {}, TypeError, "nbmem.fit(values=...) takes a list of whole numbers such as [8, 16, 32], got True."),
    ((8,), {}, TypeError, "nbmem.fit(values=...) takes a list of whole numbers such as [8, 16, 32], got 8."),
    ((None,), {}, TypeError, "nbmem.fit(values=...) takes a list of whole numbers such as [8, 16, 32], got None."),
    (([0, 8],), {}, ValueError,
     "nbmem.fit(values=...) takes 2 to 5 different positive values, such as [8, 16, 32], got [0, 8]."),
    (([-16, 8],), {}, ValueError,
     "nbmem.fit(values=...) takes 2 to 5 different positive values, such as [8, 16, 32], got [-16, 8]."),
    (([8, 8],), {}, ValueError,
     "nbmem.fit(values=...) takes 2 to 5 different positive values, such as [8, 16, 32], got [8, 8]."),
    ((range(1, 7),), {}, ValueError,
     "nbmem.fit(values=...) takes 2 to 5 different positive values, such as [8, 16, 32], got range(1, 7)."),
    # host_limit: the same rule whether it is written as a size or as bytes.
    (([8, 16],), {"host_limit": "0GB"}, ValueError, f"nbmem.fit(host_limit=...) {SIZES}; not '0GB'."),
    (([8, 16],), {"host_limit": "0.5B"}, ValueError, f"nbmem.fit(host_limit=...) {SIZES}; not '0.5B'."),
    (([8, 16],), {"host_limit": "8"}, ValueError, f"nbmem.fit(host_limit=...) {SIZES}; not '8'."),
    (([8, 16],), {"host_limit": 0}, ValueError,
     f"nbmem.fit(host_limit=...) {SIZES}, or a whole number of bytes; not 0."),
    (([8, 16],), {"host_limit": -(8 << 30)}, ValueError,
     f"nbmem.fit(host_limit=...) {SIZES}, or a whole number of bytes; not -8589934592."),
    (([8, 16],), {"host_limit": True}, ValueError,
     f"nbmem.fit(host_limit=...) {SIZES}, or a whole number of bytes; not True."),
    (([8, 16],), {"host_limit": 8e9}, ValueError,
     f"nbmem.fit(host_limit=...) {SIZES}, or a whole number of bytes; not 8000000000.0."),
    (([8, 16],), {"host_limit": float("inf")}, ValueError,
     f"nbmem.fit(host_limit=...) {SIZES}, or a whole number of bytes; not inf."),
    # The other arguments.
    (([8, 16],), {"restore": "no"}, TypeError, "nbmem.fit(restore=...) takes True or False, got 'no'."),
    (([8, 16],), {"warmup": 0}, TypeError, "nbmem.fit(warmup=...) takes True or False, got 0."),
    (([8, 16],), {"want": np.float32(64)}, ValueError,
     "nbmem.fit(want=...) takes the batch you want to run at, a positive whole number, got np.float32(64.0)."),
])
def test_nbmem_fit_refuses_bad_values_in_one_line_before_anything_runs(nb, args, kwargs, error, message):
    ran = []
    for body in (BODY, ran.append):
        with pytest.raises(error) as e:
            nbmem.fit(body, "batch", *args, **kwargs)
        assert str(e.value) == f"{message} Nothing was run."
    assert not ran and "ran" not in nb.user_ns and "batch" not in nb.user_ns


@pytest.mark.parametrize(("body", "name", "message"), [
    (None, "batch", "nbmem.fit(body=...) takes a cell's source (a str) or a function called with each value, got "
                    "None."),
    (42, "batch", "nbmem.fit(body=...) takes a cell's source (a str) or a function called with each value, got 42."),
    (BODY, "for", "nbmem.fit(name=...) takes a variable name, got 'for'."),
    (BODY, "2batch", "nbmem.fit(name=...) takes a variable name, got '2batch'."),
])
def test_nbmem_fit_refuses_a_body_that_is_neither_source_nor_a_function_and_a_name_that_is_no_variable(
        nb, body, name, message):
    with pytest.raises(TypeError) as e:
        nbmem.fit(body, name, [8, 16])
    assert str(e.value) == f"{message} Nothing was run."
    assert "ran" not in nb.user_ns
