"""On a real GPU: each remedy a fit measures for ``want`` runs at its predicted value under that remedy, three
times in a row, so it is never above the real boundary; the fit leaves the model and memory as they were.

Self-contained (no IPython shell), like ``test_fit_gpu.py``: ``pytest --noconftest tests/gpu/test_fit_remedies_gpu.py``.
The GPU is held but 3 GiB for the test (one tensor), so the steps near the boundary stay small.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from nbmem.fitting.runs import remedies  # noqa: E402
from nbmem.fitting.runs import runner as fitting  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MiB, GiB = 2**20, 2**30
nn = torch.nn


class Block(nn.Module):
    def __init__(self, d: int = 256) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Any) -> Any:
        return x + self.ff(self.ln(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(6)])
        self.head = nn.Linear(256, 10)

    def forward(self, x: Any) -> Any:
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(1))


def attrs(model: Any) -> list[tuple[str, dict[str, int]]]:
    return [(path, {k: id(v) for k, v in vars(m).items()}) for path, m in model.named_modules()]


def fit_far_beyond(model: Any, opt: Any, step: Any, ns: dict[str, Any]) -> tuple[Any, list[Any], Any, int]:
    """A fit asked for far more than fits (256 MiB margin), and what must be as it was after it: the weights,
    the modules' attributes and the bytes allocated."""
    gc.collect()
    torch.cuda.empty_cache()
    weights = [p.detach().clone() for p in model.parameters()]
    before, held = attrs(model), torch.cuda.memory_allocated()
    res = fitting.fit(step, [4, 8, 16], clean=ns.clear, name="batch", modules=[model], optimizers=[opt],
                      want=10**7, margin_bytes=256 * MiB)
    return res, weights, before, held


def test_each_remedys_prediction_runs_under_it_and_the_fit_leaves_the_model_as_it_was(room: None) -> None:
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ns: dict[str, Any] = {}

    def step(b: int) -> None:
        ns["x"] = torch.randn(b, 64, 256, device="cuda")
        ns["loss"] = torch.nn.functional.cross_entropy(model(ns["x"]), torch.randint(0, 10, (b,), device="cuda"))
        ns["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    res, weights, before, held = fit_far_beyond(model, opt, step, ns)
    assert res.largest_value is not None, str(res)
    by = {r.name: r for r in res.remedies}
    assert remedies.CHECKPOINTING in by and remedies.BF16 in by, str(res)
    assert by[remedies.CHECKPOINTING].largest_value > 1.5 * res.largest_value, str(res)
    assert all(by[n].time_per_sample_ratio is not None for n in (remedies.CHECKPOINTING, remedies.BF16))
    gc.collect()
    assert torch.cuda.memory_allocated() == held, "memory back to the byte after the fit and its remedies' runs"
    assert attrs(model) == before and all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    assert not opt.state
    cands, _ = remedies.candidates(torch, [model], [])
    for c in cands:
        value = by[c.name].largest_value
        with c.applied():
            for _ in range(3):  # never above the real boundary: the predicted value runs, three times in a row
                c.wrap(step)(value)
            torch.cuda.synchronize()
        ns.clear()
        gc.collect()
        torch.cuda.empty_cache()
    assert attrs(model) == before


def test_each_remedys_runs_start_with_the_users_bytes_not_the_plain_runs_workspaces_or_state(room: None) -> None:
    """The plain runs made AdamW's state and cuBLAS's workspaces (the user had neither): a remedy's first run
    starts without them, as the user's next cell would, so its first step makes them where the model sees them."""
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ns: dict[str, Any] = {}
    firsts: dict[tuple[bool, bool], tuple[int, int]] = {}

    def step(b: int) -> None:
        mode = ("forward" in vars(model.blocks[0]), torch.is_autocast_enabled("cuda"))
        firsts.setdefault(mode, (torch.cuda.memory_allocated(), len(opt.state)))
        ns["x"] = torch.randn(b, 64, 256, device="cuda")
        ns["loss"] = torch.nn.functional.cross_entropy(model(ns["x"]), torch.randint(0, 10, (b,), device="cuda"))
        ns["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch._C._cuda_clearCublasWorkspaces()  # the user has made none yet
    res, weights, _, held = fit_far_beyond(model, opt, step, ns)  # ``held`` counts the weights' copies
    assert {r.name for r in res.remedies} >= {remedies.CHECKPOINTING, remedies.BF16}, str(res)
    assert len(firsts) == 3, firsts
    assert set(firsts.values()) == {(held, 0)}, f"each first run finds the user's {held:,} bytes: {firsts}"
    gc.collect()
    assert torch.cuda.memory_allocated() == held and not opt.state
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
