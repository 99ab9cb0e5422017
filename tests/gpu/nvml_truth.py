"""What the driver itself says each process holds: the figure GPU tests hold nbmem's readings to. No pytest here,
so the launcher test's fresh notebook process imports it too."""

from __future__ import annotations

import os


def nvml_by_pid(pids: set[int]) -> dict[tuple[int, int], int]:
    """(NVML index, PID) -> bytes, as the driver reports them, for these PIDs."""
    import pynvml

    pynvml.nvmlInit()
    out = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid in pids:
                out[(i, int(p.pid))] = int(p.usedGpuMemory)
    return out


def cuda_name(nvml_index: int) -> str | None:
    """What CUDA in this process calls NVML's device ``nvml_index`` (``cuda:N``, N its place in
    ``CUDA_VISIBLE_DEVICES``), or None where it is hidden from this process."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return f"cuda:{nvml_index}"
    import pynvml

    pynvml.nvmlInit()
    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(nvml_index))
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    for place, entry in enumerate(e.strip() for e in visible.split(",")):
        if entry == str(nvml_index) or (entry.startswith("GPU-") and uuid.startswith(entry)):
            return f"cuda:{place}"
    return None
