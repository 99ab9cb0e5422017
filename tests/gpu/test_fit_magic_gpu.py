"""``%%cudamem --fit`` in a real shell on a real GPU: a prediction, and the notebook left as it was."""

from __future__ import annotations

import torch

from nbmem.ipython.root import session_of
from tests.conftest import ok

TRAIN = ("x = torch.randn(batch, 1024, device='cuda')\n"
         "loss = model(x).square().mean()\n"
         "loss.backward()\n"
         "opt.step()\n"
         "opt.zero_grad(set_to_none=True)")


def test_a_fit_predicts_and_leaves_the_model_the_variable_and_memory_as_they_were(gpu):
    ok(gpu, "model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),\n"
            "                            torch.nn.Linear(4096, 10)).cuda()\n"
            "opt = torch.optim.Adam(model.parameters())\n"
            "model(torch.randn(8, 1024, device='cuda')).sum().backward(); opt.step(); opt.zero_grad()\n"
            "batch = 'mine'\nw0 = model[0].weight.detach().clone()\n"
            "s0 = {k: v.clone() for k, v in opt.state[model[0].weight].items()}\n"
            "import gc; gc.collect(); torch.cuda.synchronize(); a0 = torch.cuda.memory_allocated()")
    ok(gpu, "%%cudamem --fit batch=256,512,1024\n" + TRAIN)
    res = session_of(gpu).last_fit
    assert res is not None and res.largest_value is not None and res.largest_value > 1024, res
    assert res.power_of_two <= res.largest_value and res.restored_bytes and res.restored_bytes > 0
    ns = gpu.user_ns
    assert ns["batch"] == "mine" and "x" not in ns and "loss" not in ns, "the namespace is as it was"
    assert torch.equal(ns["model"][0].weight, ns["w0"]), "the weights are restored bit for bit"
    assert all(torch.equal(ns["opt"].state[ns["model"][0].weight][k], v) for k, v in ns["s0"].items())
    ok(gpu, "import gc; gc.collect(); torch.cuda.synchronize(); a1 = torch.cuda.memory_allocated()")
    assert ns["a1"] == ns["a0"], (ns["a0"], ns["a1"])
    text = str(res)
    assert f"largest batch that fits: {res.largest_value:,}" in text, text


def test_a_fit_whose_walk_cannot_find_all_the_state_in_time_is_refused_and_runs_nothing(gpu):
    """The optimizer lies past a large object: a walk out of time before it would put back the model alone."""
    from nbmem.fitting.runs.notebook import fit_in_notebook
    from nbmem.fitting.runs.state import FitRefused

    ok(gpu, "model = torch.nn.Linear(1024, 1024).cuda()\nopt = torch.optim.Adam(model.parameters())\n"
            "big = [[i] for i in range(200_000)]\nruns = 0")
    sess = session_of(gpu)
    body = "runs += 1\n_ = big\n" + TRAIN
    try:
        fit_in_notebook(sess.adapter, sess.release, sess.holdings.scanner.type_cache, body, "batch", [8, 16],
                        cell=0, warmup=True, restore=True, budget_s=0.0)
    except FitRefused as e:
        assert "could not all be found" in str(e) and "--no-restore" in str(e), e
    else:
        raise AssertionError("a fit that could not find all the state went ahead")
    assert gpu.user_ns["runs"] == 0, "nothing ran"
