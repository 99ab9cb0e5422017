"""On a real GPU: host memory as a fit's limit (issue 36). A body that offloads its activations to pinned host
memory (``save_on_cpu(pin_memory=True)``) under a small host room never runs a value that fails and answers at
or below the host boundary; a body that keeps nothing on the host is unchanged.

Self-contained (no IPython shell), as ``test_fit_gpu.py``. The host room is made small and exact with
``host_limit`` (the memory this kernel may use: its RSS now plus a few GiB), so the test does not depend on the
machine's RAM.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from nbmem.fitting.analysis.hostroom import host_margin_bytes  # noqa: E402
from nbmem.fitting.runs import runner as fitting  # noqa: E402
from nbmem.fitting.runs.hostwatch import empty_pinned_cache  # noqa: E402
from nbmem.measure.host import HostSource  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MiB, GiB = 2**20, 2**30
WIDTH = 2048


def make() -> tuple[Any, Any]:
    nn = torch.nn
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())], nn.Linear(WIDTH, 10))
    model = model.cuda()
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def step(model: Any, opt: Any, ns: dict[str, Any], batch: int, how: str) -> None:
    """One training step; ``how``: "pinned" offloads what autograd saves to pinned host memory, "pageable" keeps
    a host copy of the output in the namespace, "gpu" keeps nothing on the host."""
    ns["x"] = torch.randn(batch, WIDTH, device="cuda")
    if how == "pinned":
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            out = model(ns["x"])
    else:
        out = model(ns["x"])
    if how == "pageable":
        ns["kept"] = torch.cat([out.detach().cpu()] * 1024, dim=1)  # 40 KiB a sample on the host
    ns["loss"] = out.square().mean()
    ns["loss"].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del out


def pinned_pool_after_one_step(model: Any, opt: Any, batch: int) -> int:
    """The pinned pool one fresh step at ``batch`` grows to (the cache given back before and after)."""
    torch.cuda.synchronize()
    empty_pinned_cache()
    before = int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    ns: dict[str, Any] = {}
    step(model, opt, ns, batch, "pinned")
    torch.cuda.synchronize()
    grown = int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)) - before
    ns.clear()
    gc.collect()
    empty_pinned_cache()
    return grown


def small_room(extra: int) -> tuple[int, int]:
    """A ``host_limit`` this kernel's RSS now plus ``extra``, and the room the fit's runs may add to under it."""
    gc.collect()
    rss = HostSource().rss_bytes()
    assert rss is not None
    limit = rss + extra
    return limit, extra - host_margin_bytes(limit)


def test_pinned_offload_under_a_small_host_room_never_runs_a_value_that_fails() -> None:
    model, opt = make()
    ns: dict[str, Any] = {}
    ran: list[int] = []

    def run(v: int) -> None:
        ran.append(v)
        step(model, opt, ns, v, "pinned")

    limit, room = small_room(3 * GiB)
    res = fitting.fit(run, [256, 512, 1024], clean=ns.clear, modules=[model], optimizers=[opt], name="batch",
                      host_limit=limit)
    text = str(res)
    assert res.largest_value is not None, text
    assert not any(p.oom for p in res.points), text
    assert "ran out of memory" not in text and "limited by host memory" in res.answer(), text
    assert res.host is not None and res.host.room is not None and "pinned" in res.host.need.how
    assert res.host.room.source == "host_limit" and res.row()["host_limits"] is True
    # every value the fit ran fits the host room, and so does the answer: measured by a step of its own
    for v in [*sorted(set(ran))[-2:], res.largest_value]:
        grown = pinned_pool_after_one_step(model, opt, v)
        assert grown <= room, (v, grown, room, text)
    # and the GPU alone would allow more: the host limits it
    assert res.host.gpu_largest_value is not None and res.host.gpu_largest_value > res.largest_value


def test_pinned_offload_answers_within_a_factor_of_two_of_the_host_boundary() -> None:
    model, opt = make()
    ns: dict[str, Any] = {}
    limit, room = small_room(3 * GiB)
    res = fitting.fit(lambda v: step(model, opt, ns, v, "pinned"), [256, 512, 1024], clean=ns.clear,
                      modules=[model], optimizers=[opt], name="batch", host_limit=limit)
    assert res.largest_value is not None, str(res)
    # the real boundary of the pinned pool under the room, by bisection over fresh steps
    lo, hi = res.largest_value, res.largest_value * 4
    while pinned_pool_after_one_step(model, opt, hi) <= room:
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 200):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if pinned_pool_after_one_step(model, opt, mid) <= room else (lo, mid)
    print(f"answer {res.largest_value:,}, host boundary {lo:,} ({100 * (1 - res.largest_value / lo):.1f} % below)")
    assert res.largest_value <= lo and res.largest_value > lo // 2, (res.largest_value, lo)


def test_pageable_copies_on_the_host_limit_the_answer_too() -> None:
    model, opt = make()
    ns: dict[str, Any] = {}
    limit, _ = small_room(2 * GiB)
    res = fitting.fit(lambda v: step(model, opt, ns, v, "pageable"), [1024, 2048, 4096], clean=ns.clear,
                      modules=[model], optimizers=[opt], name="batch", host_limit=limit)
    text = str(res)
    assert res.host is not None and "pageable" in res.host.need.how, text
    assert "limited by host memory" in res.answer(), text
    assert not any(p.oom for p in res.points), text


def test_a_body_that_keeps_nothing_on_the_host_is_unchanged() -> None:
    model, opt = make()
    ns: dict[str, Any] = {}
    limit, _ = small_room(GiB)
    res = fitting.fit(lambda v: step(model, opt, ns, v, "gpu"), [256, 512, 1024], clean=ns.clear, modules=[model],
                      optimizers=[opt], name="batch", host_limit=limit)
    text = str(res)
    assert res.largest_value is not None and res.host is None, text
    assert "host memory" not in text and res.row()["host_limits"] is False
