"""On a real GPU: a ``torch.compile``d model's fit measures the compiled steps, not the compiling (issue 36).

torch.compile makes a graph for the first shape, and at a second shape one for every shape (dynamic): the runs
during which it compiles allocate for autotuning and code generation once. Without running them again the runs
did not line up (461, 2,653 and 469 events) and the fit fell back to scaling one run's peak: 0.500 of the real
boundary on the H100 (``bench_fit.py --only stack``).

    python -m pytest -q --noconftest tests/gpu/test_fit_compiled_gpu.py
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from nbmem.fitting.runs import runner as fitting  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def compiled_mlp() -> tuple[Any, Any, Any]:
    nn = torch.nn
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(),
                          nn.Linear(2048, 10)).cuda()
    return model, torch.compile(model), torch.optim.AdamW(model.parameters(), lr=1e-4)


def test_a_compiled_models_runs_line_up_and_the_compiling_runs_are_made_again() -> None:
    model, cm, opt = compiled_mlp()
    ns: dict[str, Any] = {}

    def run(b: int) -> None:
        ns["x"] = torch.randn(b, 512, device="cuda")
        ns["loss"] = torch.nn.functional.cross_entropy(cm(ns["x"]), torch.zeros(b, dtype=torch.long, device="cuda"))
        ns["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    graphs = fitting.graphs_compiled()
    res = fitting.fit(run, [256, 512, 1024], clean=ns.clear, modules=[model], optimizers=[opt])
    assert fitting.graphs_compiled() > graphs, "the fit's runs compiled (the test is about that)"
    text = " ".join(res.notes)
    assert "torch.compile compiled a graph" in text, res.notes
    assert res.method == "timeline", (res.method, res.notes)  # the runs line up: not a peak scaled from one run
    assert res.largest_value is not None and res.largest_value > 100 * 1024
    # the same model uncompiled: the compiled step allocates no more (it fuses), so its answer is not smaller
    eager = fitting.fit(lambda b: run_eager(model, opt, ns, b), [256, 512, 1024], clean=ns.clear, modules=[model],
                        optimizers=[opt])
    assert eager.largest_value is not None and res.largest_value >= 0.9 * eager.largest_value, (
        res.largest_value, eager.largest_value)


def run_eager(model: Any, opt: Any, ns: dict[str, Any], b: int) -> None:
    ns["x"] = torch.randn(b, 512, device="cuda")
    ns["loss"] = torch.nn.functional.cross_entropy(model(ns["x"]), torch.zeros(b, dtype=torch.long, device="cuda"))
    ns["loss"].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

