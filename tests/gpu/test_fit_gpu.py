"""On a real GPU: a fit leaves the model, its optimizer and ``memory_allocated()`` as it found them (issue 23).

Self-contained (no IPython shell): the fit engine is below the IPython glue, and these run where IPython is
not installed too (``pytest --noconftest tests/gpu/test_fit_gpu.py``).
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from nbmem.fitting.runs import runner as fitting  # noqa: E402
from nbmem.fitting.runs.state import state_bytes  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MiB = 2**20


def make(bn: bool = True) -> tuple[Any, Any]:
    nn = torch.nn
    mid: list[Any] = [nn.BatchNorm1d(512)] if bn else []
    model = nn.Sequential(nn.Linear(256, 512), *mid, nn.ReLU(), nn.Linear(512, 10)).cuda()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def step(model: Any, opt: Any, ns: dict[str, Any], batch: int, *, zero: bool = True) -> None:
    ns["x"] = torch.randn(batch, 256, device="cuda")
    ns["loss"] = model(ns["x"]).square().mean()
    ns["loss"].backward()
    opt.step()
    if zero:
        opt.zero_grad(set_to_none=True)


def bits(t: Any) -> Any:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone()


def state_bits(model: Any, opt: Any) -> dict[str, Any]:
    """Every byte of the parameters, grads, buffers and optimizer state, by name (``None``: absent)."""
    out: dict[str, Any] = {}
    for n, p in model.named_parameters():
        out[n] = bits(p)
        out[n + ".grad"] = None if p.grad is None else bits(p.grad)
    for n, b in model.named_buffers():
        out[n] = bits(b)
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"opt.{names[id(p)]}.{k}"] = bits(v) if isinstance(v, torch.Tensor) else v
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    return all((x is None and y is None) or (isinstance(x, torch.Tensor) and torch.equal(x, y)) or x == y
               for x, y in ((a[k], b[k]) for k in a))


def allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated())


def test_the_state_is_restored_bit_for_bit_after_a_fit() -> None:
    model, opt = make()
    ns: dict[str, Any] = {}
    step(model, opt, ns, 32, zero=False)  # a step already ran: Adam state, grads and running stats exist
    ns.clear()
    before, held = state_bits(model, opt), allocated()
    res = fitting.fit(lambda v: step(model, opt, ns, v), [16, 32, 64], clean=ns.clear, modules=[model],
                      optimizers=[opt], name="batch")
    assert res.largest_value is not None and res.largest_value > 64, str(res)
    assert res.restored_bytes == state_bytes([model], [opt]) > 0
    assert same(state_bits(model, opt), before)
    assert allocated() == held


def test_optimizer_state_and_grads_the_fit_made_are_dropped() -> None:
    model, opt = make(bn=False)
    ns: dict[str, Any] = {}
    before, held = state_bits(model, opt), allocated()
    assert not opt.state
    fitting.fit(lambda v: step(model, opt, ns, v, zero=False), [16, 32, 64], clean=ns.clear, modules=[model],
                optimizers=[opt])
    assert not opt.state and all(p.grad is None for p in model.parameters())
    assert same(state_bits(model, opt), before)
    assert allocated() == held


def test_an_out_of_memory_during_a_fit_leaves_memory_allocated_where_it_was() -> None:
    model, opt = make()
    ns: dict[str, Any] = {}

    def body(v: int) -> None:
        step(model, opt, ns, 64 * v)
        ns["keep"] = torch.empty(v * MiB, dtype=torch.uint8, device="cuda")
        if v >= 4:  # growth no small run can show: the fit cannot predict it, so it runs into it
            ns["huge"] = torch.empty(2**46, dtype=torch.uint8, device="cuda")

    held = allocated()
    res = fitting.fit(body, [1, 2, 4], clean=ns.clear, modules=[model], optimizers=[opt])
    assert [p.value for p in res.points if p.oom] == [4]
    assert res.largest_value is not None and res.largest_value < 4, str(res)
    assert allocated() == held
    assert float(torch.ones(1024, device="cuda").sum()) == 1024.0  # the process goes on


def test_memory_allocated_is_back_after_each_fit_and_no_value_predicted_not_to_fit_runs() -> None:
    ran: list[int] = []
    ns: dict[str, Any] = {}

    def body(v: int) -> None:
        ran.append(v)
        ns["x"] = torch.empty(v * MiB, dtype=torch.uint8, device="cuda")
        ns["y"] = ns["x"][: v * MiB // 2].clone()

    for values in ([1, 2, 4], [8, 16, 32, 10**9]):
        model, opt = make()
        held = allocated()
        ran.clear()
        res = fitting.fit(body, values, clean=ns.clear, modules=[model], optimizers=[opt])
        assert allocated() == held, values
        assert 10**9 not in ran
    assert res.points[-1].skipped and res.points[-1].value == 10**9
    assert res.largest_value is not None and 32 < res.largest_value < 10**9


def test_runs_whose_tensors_only_a_collection_frees_are_collected_after_each_and_the_answer_is_the_same() -> None:
    """The fit collects garbage after a run only where the run left more allocated than it started with: a body
    whose tensors sit in reference cycles (with the automatic collector off, only the fit's collection frees
    them) gives the answer a body without cycles gives, and memory ends where it was."""
    ns: dict[str, Any] = {}

    def plain(v: int) -> None:
        ns["x"] = torch.empty(v * 64 * MiB, dtype=torch.uint8, device="cuda")
        ns["y"] = (ns["x"][: v * 32 * MiB] + 1)

    def cyclic(v: int) -> None:
        plain(v)
        loop: dict[str, Any] = {"t": torch.empty(v * 16 * MiB, dtype=torch.uint8, device="cuda")}
        loop["self"] = loop  # garbage when the run ends, freed by a collection only

    held = allocated()
    want = fitting.fit(plain, [1, 2, 4], clean=ns.clear)
    gc.disable()
    try:
        got = fitting.fit(cyclic, [1, 2, 4], clean=ns.clear)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == held  # read without a collection of its own
    finally:
        gc.enable()
    assert want.largest_value is not None and got.largest_value is not None
    # Each run starts where the first did: one left uncollected would start 16 MiB per value higher.
    for p in got.points:
        if p.peak_allocated_bytes is not None:
            assert p.peak_allocated_bytes - held <= 112 * p.value * MiB + MiB, (p.value, p.peak_allocated_bytes - held)
    # The cycle's block is one more per run, never a smaller room: at most the answer without it.
    assert 0.7 * want.largest_value <= got.largest_value <= want.largest_value


def test_a_fit_starts_from_what_the_notebook_holds() -> None:
    ns: dict[str, Any] = {}

    def body(v: int) -> None:
        ns["x"] = torch.empty(v * 64 * MiB, dtype=torch.uint8, device="cuda")

    first = fitting.fit(body, [1, 2, 4], clean=ns.clear)
    free = torch.cuda.mem_get_info()[0]
    hold = torch.empty(free // 2, dtype=torch.uint8, device="cuda")
    try:
        second = fitting.fit(body, [1, 2, 4], clean=ns.clear)
    finally:
        del hold
        torch.cuda.empty_cache()
    assert first.largest_value is not None and second.largest_value is not None
    assert second.largest_value < 0.6 * first.largest_value
    # one block of v × 64 MiB: what the fit predicts is exactly what cudaMalloc may still give
    assert second.room is not None
    assert second.largest_value * 64 * MiB <= second.room.capacity_bytes - second.room.reserved_bytes


@pytest.mark.parametrize("before", ["none", "forward", "forward and backward"])
def test_the_fit_gives_back_the_cublas_workspaces_it_made_and_keeps_the_users(before: str) -> None:
    """cuBLAS keeps a workspace per handle and stream from a first product on, in memory_allocated(); torch can
    only clear them all. A user who ran only forwards has this thread's: the fit's backward makes the autograd
    thread's, and the fit takes back that one only."""
    torch._C._cuda_clearCublasWorkspaces()  # the test's own start: no workspace from earlier tests
    model, opt = make(bn=False)
    if before != "none":
        with torch.set_grad_enabled(before != "forward"):
            out = model(torch.ones(32, 256, device="cuda")).sum()
            if before != "forward":
                out.backward()
                model.zero_grad(set_to_none=True)
        del out
    ns: dict[str, Any] = {}
    gc.collect()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    res = fitting.fit(lambda b: step(model, opt, ns, b), [64, 128, 256], clean=ns.clear, name="batch",
                      modules=[model], optimizers=[opt])
    gc.collect()
    torch.cuda.synchronize()
    assert res.largest_value is not None, str(res)
    assert torch.cuda.memory_allocated() == held, (before, torch.cuda.memory_allocated() - held, res.notes)
