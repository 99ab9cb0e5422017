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
            "torch.cuda.synchronize(); a0 = torch.cuda.memory_allocated()")
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
