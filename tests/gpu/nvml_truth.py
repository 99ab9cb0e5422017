"""What the driver itself says each process holds: the figure GPU tests hold nbmem's readings to. No pytest here,
so the launcher test's fresh notebook process imports it too."""

from __future__ import annotations


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
