"""On a real GPU: a notebook that ran a fit trains on bit for bit as one that did not (issue 27).

A seeded setup (OneCycleLR stepped in the body, an fp16 GradScaler, dropout, BatchNorm) is found the way a
fit finds it (a walk from the names the cell uses), fitted, then trained: losses, weights, buffers, LR, scale
and the RNGs must equal those of the same setup that never ran a fit. Also: non-reentrant checkpointing
called from notebook code fits, and a body that fails leaves memory where it was.
"""

from __future__ import annotations

import gc
import random
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from nbmem.fitting.runs import runner  # noqa: E402
from nbmem.fitting.runs.state import training_kinds  # noqa: E402
from nbmem.holders import reach  # noqa: E402
from nbmem.holders.reached import reachable_state  # noqa: E402
from nbmem.holders.walk import Root  # noqa: E402
from nbmem.records import HolderKind  # noqa: E402
from tests.test_fit_state import same  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
nn = torch.nn


def make() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(256, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=1000)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12, growth_interval=3)
    torch.manual_seed(1)
    torch.cuda.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    return {"model": model, "opt": opt, "sched": sched, "scaler": scaler, "ns": {}}


def step(s: dict[str, Any], batch: int) -> float:
    model, opt, sched, scaler = s["model"], s["opt"], s["sched"], s["scaler"]
    x = torch.randn(batch, 64, device="cuda") + float(np.random.rand()) * random.random()
    y = torch.randint(0, 10, (batch,), device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    sched.step()
    s["ns"]["loss"] = loss
    return float(loss.detach())


def observe(s: dict[str, Any]) -> dict[str, Any]:
    model, opt, scaler = s["model"], s["opt"], s["scaler"]
    return {"state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "opt": {i: {k: v.cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
                    for i, st in enumerate(opt.state.values())},
            "lr": [g["lr"] for g in opt.param_groups], "sched": dict(s["sched"].state_dict()),
            "scale": scaler.get_scale() if scaler._scale is not None else None,
            "torch_rng": torch.get_rng_state(), "cuda_rng": torch.cuda.get_rng_state_all(),
            "random": random.getstate(), "numpy": np.random.get_state()[1].copy()}


def allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated())


def timeline(trained_before: int, fit: bool) -> tuple[list[Any], Any]:
    s = make()
    for _ in range(trained_before):
        step(s, 32)
    s["ns"].clear()
    held = allocated()
    res = None
    if fit:
        found = reachable_state(torch, [Root("s", HolderKind.NAMESPACE, s)], reach.TypeCache(),
                                kinds=training_kinds(torch))
        res = runner.fit(lambda v: step(s, v), [16, 32, 64], clean=s["ns"].clear, modules=found.modules,
                         optimizers=found.optimizers, others=found.others, name="batch")
        del found
        assert allocated() == held, "memory allocated is back to the byte"
    seen = [observe(s)]
    for _ in range(3):
        seen.append((step(s, 32), observe(s)))
    return seen, res


@pytest.mark.parametrize("trained_before", [0, 2])
def test_training_after_a_fit_is_bit_for_bit_training_without_it(trained_before: int) -> None:
    plain, _ = timeline(trained_before, fit=False)
    fitted, res = timeline(trained_before, fit=True)
    assert res is not None and res.largest_value is not None, str(res)
    assert any(r.startswith("OneCycleLR") for r in res.restored) and any(r.startswith("GradScaler")
                                                                         for r in res.restored), res.restored
    assert "every CUDA device's" in res.restored[-1]
    assert same(fitted, plain)


NOTEBOOK = '''
import torch, torch.nn as nn
from torch.utils.checkpoint import checkpoint

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(256, 1024), nn.Linear(1024, 256), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.b(self.drop(torch.relu(self.a(x))))

emb = nn.Embedding(1000, 256).cuda()
blocks = nn.ModuleList([Block() for _ in range(4)]).cuda()
opt = torch.optim.Adam([*emb.parameters(), *blocks.parameters()])

def forward(x):
    for blk in blocks:
        x = checkpoint(blk, x, use_reentrant=REENTRANT)
    return x

def train_step(batch):
    x = emb(torch.randint(0, 1000, (batch, 64), device="cuda"))
    with CONTEXT:
        loss = forward(x).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
'''


def notebook(reentrant: bool, context: str) -> dict[str, Any]:
    g: dict[str, Any] = {}
    src = NOTEBOOK.replace("REENTRANT", str(reentrant)).replace("CONTEXT", context)
    exec(compile(src, "<ipython-input-3-0123456789ab>", "exec"), g)  # the function is the notebook's own
    return g


@pytest.mark.parametrize(("reentrant", "context"), [
    (False, "torch.autocast('cuda', enabled=False)"),
    (True, "torch.autocast('cuda', enabled=False)"),
    (False, "torch.autocast('cuda', dtype=torch.bfloat16)"),
    (False, "torch.autocast('cuda', dtype=torch.float16)"),
    (False, "torch.autograd.graph.save_on_cpu()"),
])
def test_checkpointing_autocast_and_offloading_from_notebook_code_fit(reentrant: bool, context: str) -> None:
    g = notebook(reentrant, context)
    g["train_step"](2)
    held = allocated()
    res = runner.fit(g["train_step"], [2, 4, 8], modules=[g["emb"], g["blocks"]], optimizers=[g["opt"]],
                     stacks=True, name="batch")
    assert res.largest_value is not None and res.largest_value > 8, str(res)
    assert allocated() == held
    del g


def test_a_body_that_fails_leaves_memory_where_it_was_and_says_what_was_put_back() -> None:
    g = notebook(True, "torch.autocast('cuda', enabled=False)")
    blocks = g["blocks"]

    def body(v: int) -> None:  # reentrant checkpointing of an input without grad: backward has nothing to do
        x = torch.randn(v, 64, 256, device="cuda")
        for blk in blocks:
            x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=True)
        x.square().mean().backward()

    held = allocated()
    with pytest.raises(RuntimeError, match="does not require grad") as e:
        runner.fit(body, [2, 4, 8], modules=[blocks], optimizers=[g["opt"]], stacks=True, name="batch")
    notes = getattr(e.value, "__notes__", [])
    assert any("training state put back" in n and "memory allocated is back where it was" in n for n in notes), notes
    del e
    assert allocated() == held
