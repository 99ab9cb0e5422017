"""GPU tests run only where NVML sees a GPU; asking NVML (not CUDA) keeps this check context-free."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from tests.conftest import _nvml_gpus, ok

GPUS = _nvml_gpus()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="no CUDA GPU (NVML sees none)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if GPUS == 0:
                item.add_marker(skip)


@pytest.fixture
def gpu(ip):
    """The monitored shell, with CUDA started (by the test, never by nbmem)."""
    ok(ip, "import torch\ntorch.cuda.init()\ntorch.cuda.synchronize()")
    return ip


@pytest.fixture
def room() -> Iterator[None]:
    """All of the GPU but 3 GiB held by one tensor, given back after (a fit then answers for a small room)."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    hold = torch.empty(free - 3 * 2**30, dtype=torch.uint8, device="cuda")
    yield
    del hold
    gc.collect()
    torch.cuda.empty_cache()
