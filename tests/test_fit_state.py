"""What a fit puts back (``fitting.runs.state``), on CPU tensors: training after a fit goes on exactly as without it.

A seeded training setup (OneCycleLR stepped each step, a gradient scaler, dropout, BatchNorm) is built twice
the same way. One copy is saved, trained a few steps and restored; the other never trains. The next step of
each must agree bit for bit: loss, weights, buffers, gradients, learning rate, scale and every RNG.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from nbmem.fitting.runs.state import restore_state, snapshot_state, training_kinds  # noqa: E402

nn = torch.nn


def make() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=50)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    return {"model": model, "opt": opt, "sched": sched, "scaler": scaler}


def step(s: dict[str, Any]) -> float:
    """One training step whose every input comes from the three global generators."""
    model, opt, sched, scaler = s["model"], s["opt"], s["sched"], s["scaler"]
    x = torch.randn(16, 8) * (1 + random.random()) + float(np.random.rand())
    y = torch.randint(0, 3, (16,))
    loss = nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    return float(loss.detach())


def observe(s: dict[str, Any]) -> dict[str, Any]:
    model, opt, scaler = s["model"], s["opt"], s["scaler"]
    return {"state": {k: v.clone() for k, v in model.state_dict().items()},
            "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            "lr": [g["lr"] for g in opt.param_groups], "betas": [g["betas"] for g in opt.param_groups],
            "sched": {k: v for k, v in s["sched"].state_dict().items()},
            "scale": scaler.get_scale(), "growth": scaler._get_growth_tracker(),
            "torch_rng": torch.get_rng_state(), "random": random.getstate(), "numpy": np.random.get_state()[1].copy(),
            "opt_state": {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
                          for i, st in enumerate(opt.state.values())}}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def timeline(trained_before: int, fit_steps: int | None, *, restore: bool = True,
             **what: Any) -> list[tuple[float | None, dict[str, Any]]]:
    """What training shows from a point on: ``fit_steps`` steps saved and put back there (None: no fit)."""
    s = make()
    for _ in range(trained_before):  # 0: the scaler has made nothing yet, its scale is made lazily
        step(s)
    if fit_steps is not None:
        scaler_made = s["scaler"]._scale is not None
        saved = snapshot_state([s["model"]], [s["opt"]], what.get("others", [s["sched"], s["scaler"]]),
                               rng=what.get("rng", True))
        for _ in range(fit_steps):
            step(s)
        s["model"].eval()
        if not restore:
            return [(None, observe(s))]
        restore_state(saved)
        assert (s["scaler"]._scale is not None) == scaler_made, "a scale made during the fit is dropped again"
        assert s["model"].training and not saved.not_restored
    seen: list[tuple[float | None, dict[str, Any]]] = [(None, observe(s))]
    for _ in range(3):
        loss = step(s)
        seen.append((loss, observe(s)))
    return seen


@pytest.mark.parametrize("trained_before", [0, 3])
def test_training_after_a_restore_goes_on_bit_for_bit_as_if_the_steps_never_ran(trained_before: int) -> None:
    plain = timeline(trained_before, None)
    fitted = timeline(trained_before, 5)
    assert same(fitted, plain)
    assert not same(timeline(trained_before, 5, restore=False)[0], plain[0]), "the check can fail"


@pytest.mark.parametrize("left_out", [{"rng": False}, {"others": []}])
def test_each_part_left_out_shows(left_out: dict[str, Any]) -> None:
    """Without the generators, or without the scheduler and scaler, the next steps differ."""
    assert not same(timeline(3, 5, **left_out), timeline(3, None))


def test_the_restore_is_named_a_line_each_and_keeps_hook_handles_working() -> None:
    s = make()
    step(s)
    calls: list[int] = []
    handle = s["opt"].register_step_pre_hook(lambda opt, args, kwargs: calls.append(1))
    saved = snapshot_state([s["model"]], [s["opt"]], [s["sched"], s["scaler"]], iterators=["it (list_iterator)"])
    step(s)
    restore_state(saved)
    handle.remove()
    step(s)
    assert calls == [1], "the hook's handle still removes it from the optimizer's own dict"
    assert any(line.startswith("parameters, buffers and train/eval flags of Sequential") for line in saved.restored)
    assert "optimizer AdamW: state, param groups (learning rates) and attributes" in saved.restored
    assert any(line.startswith("OneCycleLR:") for line in saved.restored)
    assert any(line.startswith("GradScaler:") for line in saved.restored)
    assert saved.restored[-1] == "random generators: torch CPU, Python random, NumPy global"
    assert saved.not_restored == ["it (list_iterator): the body may have advanced it, and an iterator cannot be "
                                  "put back"]


def test_grads_that_were_none_stay_none_and_state_made_during_the_fit_is_dropped() -> None:
    model = nn.Linear(8, 2)
    opt = torch.optim.Adam(model.parameters())
    saved = snapshot_state([model], [opt])
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    restore_state(saved)
    assert not opt.state and model.weight.grad is None and model.bias.grad is None


def test_a_part_that_cannot_be_put_back_is_named_and_the_rest_is_restored() -> None:
    model = nn.Linear(4, 2)
    saved = snapshot_state([model], [], rng=True)
    before = torch.get_rng_state()
    saved._buffers.append((torch.zeros(3), torch.zeros(2)))  # a buffer the fit replaced by another shape
    torch.randn(5)
    restore_state(saved)
    assert len(saved.not_restored) == 1 and saved.not_restored[0].startswith("buffers: putting them back failed")
    assert torch.equal(torch.get_rng_state(), before)


def test_the_kinds_walked_for_are_torchs_schedulers_and_scalers() -> None:
    kinds = training_kinds(torch)
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    for obj in (torch.optim.lr_scheduler.StepLR(opt, 1), torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
                torch.amp.GradScaler("cpu")):
        assert any(isinstance(obj, k) for k in kinds), type(obj)


def test_the_host_arena_copies_every_layout_bit_for_bit_and_keeps_dense_strides():
    """The arena a fit copies CUDA tensors into, filled here from CPU tensors (the copy is the same operation):
    each dtype at an aligned place, a channels-last tensor's strides kept (a grad made again from it is laid out
    as before), a transposed one made contiguous, an empty one, and one tensor named twice copied once."""
    from nbmem.fitting.runs.state import _ALIGN, _Arena

    g = torch.Generator().manual_seed(0)
    cl = torch.randn(2, 3, 5, 7, generator=g).to(memory_format=torch.channels_last)
    t = torch.randn(6, 9, generator=g).t()
    xs = [torch.randn(3, generator=g).to(torch.bfloat16), torch.tensor([True, False, True]),
          torch.arange(7, dtype=torch.int64), torch.randn(4, dtype=torch.complex64, generator=g), cl, t,
          torch.empty(0, 5), torch.randn(1, generator=g)]
    arena = _Arena(torch, [*xs, xs[0]])
    copies = [arena.copy(x) for x in xs]
    for x, c in zip(xs, copies):
        assert c.dtype == x.dtype and c.shape == x.shape and torch.equal(c, x)
        assert c.data_ptr() % _ALIGN == arena.buf.data_ptr() % _ALIGN
    assert copies[4].stride() == cl.stride(), "channels-last strides are kept"
    assert copies[5].is_contiguous() and not t.is_contiguous()
    assert len({c.data_ptr() for c in copies if c.numel()}) == len([x for x in xs if x.numel()])
    assert arena.size == sum(-(-x.numel() * x.element_size() // _ALIGN) * _ALIGN for x in xs)
    xs[7].add_(1)  # the original changes; its copy does not
    assert not torch.equal(copies[7], xs[7])
    arena.close()
    assert torch.equal(copies[2], torch.arange(7)), "the copies outlive close()"


def test_an_arena_of_empty_tensors_copies_them_without_a_mapping():
    from nbmem.fitting.runs.state import _Arena

    xs = [torch.empty(0), torch.empty(0, 4, dtype=torch.bfloat16)]
    arena = _Arena(torch, xs)
    assert arena.size == 0 and arena.buf is None
    copies = [arena.copy(x) for x in xs]
    assert [(c.shape, c.dtype) for c in copies] == [(x.shape, x.dtype) for x in xs]
    arena.close()
    arena.close()  # twice: nothing was locked, nothing to undo
