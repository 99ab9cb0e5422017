"""On a real GPU (issue 36): the GPT shape many notebooks write, one ``Sequential`` of an embedding, six blocks, a
norm and a head, gets a measured checkpointing remedy (the run of blocks checkpointed, the rest left); its
prediction runs under it three times in a row, so it is never above the real boundary; the fit leaves the model
and memory as they were, also when Ctrl-C stops it halfway through a run.

Self-contained (no IPython shell), like ``test_fit_remedies_gpu.py``:
``pytest --noconftest tests/gpu/test_fit_remedies_more_gpu.py``. The GPU is held but 3 GiB for the test.
"""

from __future__ import annotations

import gc
import signal
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from nbmem.fitting.runs import remedies  # noqa: E402
from nbmem.fitting.runs import runner as fitting  # noqa: E402
from tests.gpu.test_fit_remedies_gpu import attrs, fit_far_beyond  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MiB, GiB = 2**20, 2**30
nn = torch.nn
VOCAB, D, CONTEXT = 512, 256, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.ff = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: Any) -> Any:
        return x + self.ff(self.ln(x))


def adam_state(model: Any, opt: Any) -> list[Any]:
    """The optimizer's tensors, in the parameters' order and by name."""
    state = [opt.state[p] for p in model.parameters()]
    return [s[k] for s in state for k in sorted(s) if torch.is_tensor(s[k])]


def test_the_gpt_shaped_sequential_gets_a_measured_checkpointing_row_never_above_its_boundary(room: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, D), *[Block() for _ in range(6)], nn.LayerNorm(D),
                          nn.Linear(D, VOCAB)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ns: dict[str, Any] = {}

    def step(b: int) -> None:
        ns["x"] = torch.randint(0, VOCAB, (b, CONTEXT), device="cuda")
        ns["loss"] = nn.functional.cross_entropy(model(ns["x"]).flatten(0, 1), ns["x"].flatten())
        ns["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    res, weights, before, held = fit_far_beyond(model, opt, step, ns)
    assert res.largest_value is not None, str(res)
    assert not any("no repeated blocks" in n for n in res.notes), str(res)
    by = {r.name: r for r in res.remedies}
    assert remedies.CHECKPOINTING in by, str(res)
    ckpt = by[remedies.CHECKPOINTING]
    assert "each of the 6 Block in Sequential[1:7]" in ckpt.setting, ckpt.setting
    assert ckpt.largest_value > 1.3 * res.largest_value, str(res)
    print(f"\nplain {res.largest_value:,}; checkpointed {ckpt.largest_value:,} ({ckpt.how})")
    gc.collect()
    assert torch.cuda.memory_allocated() == held, "memory back to the byte after the fit and its remedies' runs"
    assert attrs(model) == before and all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    assert not opt.state
    c = next(c for c in remedies.candidates(torch, [model], [])[0] if c.name == remedies.CHECKPOINTING)
    with c.applied():
        for _ in range(3):  # never above the real boundary: the predicted value runs, three times in a row
            c.wrap(step)(ckpt.largest_value)
        torch.cuda.synchronize()
    ns.clear()
    gc.collect()
    torch.cuda.empty_cache()
    assert attrs(model) == before


def test_a_fit_interrupted_by_ctrl_c_leaves_the_state_and_memory_as_they_were(room: None) -> None:
    """A real SIGINT halfway through a run's step (after the forward, its activations held): the training state,
    the random generators and the memory allocated are as before the fit, the error says so, and so does the
    progress line, final."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, D), *[Block() for _ in range(6)], nn.LayerNorm(D),
                          nn.Linear(D, VOCAB)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ns: dict[str, Any] = {}
    runs: list[int] = []

    def step(b: int) -> None:
        runs.append(b)
        ns["x"] = torch.randint(0, VOCAB, (b, CONTEXT), device="cuda")
        ns["loss"] = nn.functional.cross_entropy(model(ns["x"]).flatten(0, 1), ns["x"].flatten())
        if b == 16:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C, with the forward's activations alive
        ns["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # the user's own steps first: optimizer state, grads set to None, workspaces made
        step(4)
    runs.clear()
    ns.clear()
    gc.collect()
    torch.cuda.empty_cache()
    weights = [p.detach().clone() for p in model.parameters()]
    moments = [t.clone() for t in adam_state(model, opt)]
    cpu_rng, cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state()
    held = torch.cuda.memory_allocated()
    shown: list[tuple[str, bool]] = []
    with pytest.raises(KeyboardInterrupt) as e:
        fitting.fit(step, [4, 8, 16], clean=ns.clear, name="batch", modules=[model], optimizers=[opt],
                    margin_bytes=256 * MiB, show=lambda text, final: shown.append((text, final)))
    assert runs == [4, 4, 8, 16]
    told = "stopped after 4 runs of the body; training state put back; memory allocated is back where it was"
    assert e.value.__notes__ == [f"nbmem fit: {told}"]
    text, final = shown[-1]
    assert final and text.startswith("nbmem fit interrupted at batch=16 after ") and text.endswith(f": {told}"), text
    del e
    gc.collect()
    assert torch.cuda.memory_allocated() == held, "memory back to the byte"
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters(), strict=True))
    assert all(torch.equal(m, t) for m, t in zip(moments, adam_state(model, opt), strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(cpu_rng, torch.get_rng_state()) and torch.equal(cuda_rng, torch.cuda.get_rng_state())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
