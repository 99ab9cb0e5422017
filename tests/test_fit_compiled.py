"""``graphs_compiled``: torch.compile's own graph counter, read without importing dynamo (issue 36)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nbmem.fitting.runner import graphs_compiled

torch = pytest.importorskip("torch")


def test_it_moves_when_torch_compile_makes_a_graph_and_not_when_a_compiled_shape_runs_again() -> None:
    f = torch.compile(lambda t: t * 3 - 1, backend="eager")
    f(torch.ones(4))
    first = graphs_compiled()
    assert first >= 1
    f(torch.ones(4))
    assert graphs_compiled() == first, "the same shape again: no new graph"
    f(torch.ones(4, 5))
    assert graphs_compiled() == first + 1, "a new shape: a new graph"


def test_it_reads_zero_and_imports_nothing_where_dynamo_is_not_loaded() -> None:
    code = ("import sys, torch\nfrom nbmem.fitting.runner import graphs_compiled\n"
            "assert graphs_compiled() == 0\nassert 'torch._dynamo' not in sys.modules, 'dynamo was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
