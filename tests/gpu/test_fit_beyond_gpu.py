"""On a real GPU: the allocator held to a cap while a fit checks values past its model's answer, and given back
as the user had it; a memory fraction the user set is the fit's room; a buffer that stops growing no longer keeps
the answer far below the limit, and the answer still runs.

Self-contained (no IPython shell), like tests/gpu/test_fit_gpu.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from nbmem.clean.release import TorchRelease  # noqa: E402
from nbmem.fitting.runs import runner as fitting  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MiB, GiB = 2**20, 2**30


@pytest.fixture
def fraction() -> Iterator[Any]:
    """Set the fraction as a user would; put 1.0 back after the test whatever happened."""
    torch.cuda.init()
    torch.cuda.empty_cache()
    yield lambda f: torch.cuda.set_per_process_memory_fraction(f, 0)
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    torch.cuda.empty_cache()


def total() -> int:
    return int(torch.cuda.mem_get_info(0)[1])


def test_the_cap_holds_while_inside_and_the_users_fraction_is_back_after(fraction: Any) -> None:
    fraction(0.5)
    src = TorchRelease()
    assert src.memory_fraction(0) == pytest.approx(0.5)
    with src.capped({0: torch.cuda.memory_reserved(0) + 1 * GiB}) as held:
        assert held
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
    assert src.memory_fraction(0) == pytest.approx(0.5)
    x = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")  # the user's own cap allows it again
    del x


def test_a_memory_fraction_the_user_set_is_the_fits_room(fraction: Any) -> None:
    torch.cuda.empty_cache()
    allowed = torch.cuda.memory_reserved(0) + 4 * GiB
    fraction(allowed / total())
    ns: dict[str, Any] = {}

    def body(v: int) -> None:
        ns["x"] = torch.empty(v * MiB, dtype=torch.uint8, device="cuda")

    res = fitting.fit(body, [64, 128, 256], name="mib", clean=ns.clear, restore=False)
    assert res.room is not None and res.room.free_bytes + res.room.reserved_bytes <= allowed
    assert res.largest_value is not None and res.largest_value * MiB <= 4 * GiB, res
    for _ in range(2):  # the answer runs under the user's cap
        body(res.largest_value)
    ns.clear()


def test_a_buffer_that_stops_growing_is_run_past_and_the_answer_runs(fraction: Any) -> None:
    """An input of 1 MiB per unit, kept, and a buffer of 8 MiB per unit up to 512 MiB, freed at once, in a room of
    8 GiB: the model keeps the buffer growing and stops near 1,000 units; checks past its answer under the cap find
    more, below the limit (a step's input is made while the last one's is still bound: 2 MiB a unit and the buffer,
    3,700 units)."""
    torch.cuda.empty_cache()
    room = 8 * GiB
    fraction((torch.cuda.memory_reserved(0) + room) / total())
    ns: dict[str, Any] = {}

    def body(v: int) -> None:
        ns["x"] = torch.empty(v * MiB, dtype=torch.uint8, device="cuda")
        w = torch.empty(min(v, 64) * 8 * MiB, dtype=torch.uint8, device="cuda")
        del w

    res = fitting.fit(body, [8, 16, 32], name="units", clean=ns.clear)  # a copy to put back: the checks need it
    assert res.largest_value is not None, res
    said = "\n".join(res.notes)
    assert any(n.startswith("checked past the model: 3 steps in a row") for n in res.notes), said
    assert res.largest_value > 2000 and (2 * res.largest_value + 512) * MiB <= room, (res.largest_value, said)
    for _ in range(3):
        body(res.largest_value)
    ns.clear()
    assert torch.cuda.get_per_process_memory_fraction(0) < 0.5, "the user's fraction is back after the fit"
