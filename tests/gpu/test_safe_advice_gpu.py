"""On a real GPU: every piece of advice in a single-cell notebook's report is safe to follow (issue 37).

The same notebooks and checks as ``tests/test_safe_advice.py``, their tensors on CUDA: the freed figures are
the caching allocator's own (``memory_allocated``), whose blocks the rows' bytes are rounded to.
"""

from __future__ import annotations

import pytest

from tests.test_safe_advice import NOTEBOOKS, follow_every_hint


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_every_piece_of_advice_is_safe_to_follow_on_cuda(name: str) -> None:
    follow_every_hint(name, "cuda")
