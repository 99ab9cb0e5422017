"""A fake NVML binding (the part of pynvml that ``nbmem.measure.sources.NvmlSource`` calls), for the server tests.

The server is told to use it with ``c.NbmemServer.nvml_module = "tests.fake_nvml"``; only the binding is
fake, NvmlSource and the server's mapping run for real. What it reports is read, on every call, from
the JSON file that ``$NBMEM_FAKE_NVML`` names, so a test can list processes once it knows their PIDs::

    {"gpus": [{"name": "...", "uuid": "GPU-...", "total_bytes": 1, "used_bytes": 1,
               "processes": [{"pid": 123, "used_bytes": 1}]}]}

``used_bytes`` of a process may be null (NVML's "not available"). Without the variable, ``nvmlInit``
fails as pynvml's does on a machine without a driver.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ENV = "NBMEM_FAKE_NVML"


class NVMLError(Exception):
    """What every failing call raises, as pynvml's NVMLError subclasses do."""


def write(path: Path, gpus: list[dict[str, Any]]) -> None:
    """Set what the fake reports from now on (atomically: the server may be reading)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": gpus}))
    tmp.replace(path)


def _gpus() -> list[dict[str, Any]]:
    path = os.environ.get(ENV)
    if not path:
        raise NVMLError(f"NVML Shared Library Not Found (fake: ${ENV} is not set)")
    gpus: list[dict[str, Any]] = json.loads(Path(path).read_text())["gpus"]
    return gpus


def _gpu(handle: int) -> dict[str, Any]:
    try:
        return _gpus()[handle]
    except IndexError:
        raise NVMLError("Invalid Argument") from None


def nvmlInit() -> None:
    _gpus()


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(_gpus())


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    _gpu(index)
    return index


def nvmlDeviceGetUUID(handle: int) -> str:
    return str(_gpu(handle)["uuid"])


def nvmlDeviceGetName(handle: int) -> str:
    return str(_gpu(handle)["name"])


def nvmlDeviceGetMemoryInfo(handle: int) -> SimpleNamespace:
    gpu = _gpu(handle)
    total, used = gpu["total_bytes"], gpu["used_bytes"]
    return SimpleNamespace(total=total, used=used, free=total - used)


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(pid=p["pid"], usedGpuMemory=p["used_bytes"]) for p in _gpu(handle).get("processes", ())]
