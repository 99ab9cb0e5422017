"""On a real GPU (issue 36): Ctrl-C pressed again while a finished fit puts the training state back waits until
everything is back, cuBLAS's workspaces that the fit's runs made given back too, and then stops the fit, saying so.

Run: ``pytest tests/gpu/test_fit_interrupt_gpu.py`` (the GPU is held but 3 GiB for the test: ``room``).
"""

from __future__ import annotations

import gc
import signal
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from nbmem.fitting.runs import runner as fitting  # noqa: E402
from tests.gpu.test_fit_remedies_more_gpu import CONTEXT, VOCAB, Block, D, adam_state  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MiB = 2**20
nn = torch.nn


def test_ctrl_c_while_a_finished_fit_puts_things_back_stops_it_once_all_is_back(
        room: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real SIGINT in the middle of putting the state back, in a process whose first matrix products are the
    fit's own (so its runs made cuBLAS's workspaces): the state, the random generators and the memory allocated
    are as before the fit, to the byte, before the interrupt is raised; the error and the final line say so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, D), *[Block() for _ in range(6)], nn.LayerNorm(D),
                          nn.Linear(D, VOCAB)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ns: dict[str, Any] = {}
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    weights = [p.detach().clone() for p in model.parameters()]
    cpu_rng, cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state()
    held = torch.cuda.memory_allocated()

    def step(b: int) -> None:
        ns["x"] = torch.randint(0, VOCAB, (b, CONTEXT), device="cuda")
        ns["loss"] = nn.functional.cross_entropy(model(ns["x"]).flatten(0, 1), ns["x"].flatten())
        ns["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    put_back = fitting.restore_state

    def restore_pressed(saved: Any) -> Any:
        signal.raise_signal(signal.SIGINT)  # Ctrl-C again: Python's own handler would raise here, halfway
        return put_back(saved)

    monkeypatch.setattr(fitting, "restore_state", restore_pressed)
    shown: list[tuple[str, bool]] = []
    with pytest.raises(KeyboardInterrupt) as e:
        fitting.fit(step, [4, 8, 16], clean=ns.clear, name="batch", modules=[model], optimizers=[opt],
                    margin_bytes=256 * MiB, show=lambda text, final: shown.append((text, final)))
    (note,) = e.value.__notes__
    assert note.startswith("nbmem fit: stopped after ") and note.endswith(
        " runs of the body; training state put back; memory allocated is back where it was"), note
    text, final = shown[-1]
    assert final and text.startswith("nbmem fit interrupted at batch=") and text.endswith(
        note.removeprefix("nbmem fit")), text
    del e
    gc.collect()
    assert torch.cuda.memory_allocated() == held, "memory back to the byte: cuBLAS's workspaces given back too"
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters(), strict=True))
    assert not opt.state and all(p.grad is None for p in model.parameters())
    assert adam_state(model, opt) == []
    assert torch.equal(cpu_rng, torch.get_rng_state()) and torch.equal(cuda_rng, torch.cuda.get_rng_state())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
