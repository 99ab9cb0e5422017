"""GPU tests run only where NVML sees a GPU; asking NVML (not CUDA) keeps this check context-free."""

from __future__ import annotations

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
