"""What the server's ``/metrics`` costs with nbmem's extension and 100 kernels: time per scrape and bytes (issue 49).

    python benchmarks/bench_metrics.py [--kernels 100] [--gpus 8] [--scrapes 21] [--quick]

A real jupyter server with the extension (tests/test_server.py's ``JupyterServer``) and the fake NVML binding
(tests/fake_nvml.py), which lists one process per kernel, the kernels spread over the GPUs. The kernels are real
processes that the server starts, through a kernelspec that only sleeps (tests/test_dashboard.py's
``idle_kernels``): ipykernel would cost each of them its import, and nothing here talks to a kernel. Everything
between NVML's answers and the HTTP response runs for real: the session table, the kernels' PIDs, every listed
PID's ancestors, the collector, jupyter_server's handler.

Each scrape is a GET of ``/metrics`` over loopback, timed at the client, and the CPU time the server's event loop
spent meanwhile (Linux only): the loop answers nothing else while the collector runs. A *fresh* scrape comes at least
``MAX_AGE_S`` after the one before, so it pays for a new reading, as every scrape by a Prometheus that scrapes
every 15 s does; a *cached* one comes right after another and reuses that reading. The fake NVML reads a small
JSON file where the driver would answer: the driver's own time is not in these figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import line, print_summary  # benchmarks/ is on sys.path when run as a script

from nbmem.measure.processes import lineage_of, lineages
from nbmem.server import MAX_AGE_S
from tests import fake_nvml
from tests.test_dashboard import idle_kernels
from tests.test_server import GiB, JupyterServer, fake_gpu


def loop_cpu_s(pid: int) -> float:
    """CPU time of the server's main thread, where its event loop, and so the collector, runs (Linux's schedstat:
    nanoseconds, where psutil's times count clock ticks of 10 ms)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9


def scrape(server: Any, pid: int) -> tuple[float, float, bytes]:
    """One GET of ``/metrics``: its time at the client, the server loop's CPU time meanwhile, and the body."""
    cpu, t = loop_cpu_s(pid), time.perf_counter()
    status, body = server.request("GET", "/metrics")
    dt, cpu = time.perf_counter() - t, loop_cpu_s(pid) - cpu
    if status != 200:
        raise RuntimeError(f"GET /metrics: {status}")
    return dt, cpu, body


def nbmem_part(body: bytes) -> bytes:
    """The lines of nbmem's families: their samples and their HELP and TYPE lines."""
    keep = [
        ln
        for ln in body.splitlines(keepends=True)
        if ln.startswith(b"nbmem_") or ln.startswith((b"# HELP nbmem_", b"# TYPE nbmem_"))
    ]
    return b"".join(keep)


def ms(xs: list[float]) -> str:
    return (
        f"median {statistics.median(xs) * 1e3:.1f} ms (min {min(xs) * 1e3:.1f}, max {max(xs) * 1e3:.1f}, n={len(xs)})"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=100, help="notebooks, each with a kernel (default: %(default)s)")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs the fake NVML lists (default: %(default)s)")
    ap.add_argument("--scrapes", type=int, default=21, help="scrapes of each kind (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="5 kernels, 3 scrapes of each kind (a smoke run)")
    a = ap.parse_args()
    kernels, scrapes = (5, 3) if a.quick else (a.kernels, a.scrapes)
    with tempfile.TemporaryDirectory(prefix="nbmem-bench-metrics-") as tmp:
        root = Path(tmp)
        gpus = root / "gpus.json"
        fake_nvml.write(gpus, [fake_gpu(g, 0, []) for g in range(a.gpus)])  # the devices are read at startup
        # The idle kernels never answer a shutdown request: the server need not wait long for them.
        config = {"NbmemServer": {"nvml_module": "tests.fake_nvml"}, "KernelManager": {"shutdown_wait_time": 1.0}}
        with JupyterServer(root, config, {fake_nvml.ENV: str(gpus)}, startup_s=60) as server:
            t = time.perf_counter()
            pids = idle_kernels(server, kernels)
            started_s = time.perf_counter() - t
            held = {
                g: [(pid, (1 + k % 7) * GiB) for k, pid in enumerate(pids) if k % a.gpus == g] for g in range(a.gpus)
            }
            fake_nvml.write(gpus, [fake_gpu(g, sum(b for _, b in held[g]), held[g]) for g in range(a.gpus)])
            print(
                f"{kernels} kernels on {a.gpus} GPUs, started in {started_s:.1f} s; {scrapes} scrapes of each kind",
                flush=True,
            )
            server_pid = psutil.Process(pids[0]).ppid()
            fresh: list[tuple[float, float]] = []
            cached: list[tuple[float, float]] = []
            for _ in range(scrapes):
                time.sleep(MAX_AGE_S + 0.05)
                dt, cpu, body = scrape(server, server_pid)
                fresh.append((dt, cpu))
                cached.append(scrape(server, server_pid)[:2])
            # The ancestry of the kernels' PIDs, one by one (as the server read it before) and all at once (as
            # it reads it now), in turns: most of a fresh reading was this.
            one_by_one: list[float] = []
            at_once: list[float] = []
            for _ in range(scrapes):
                t = time.perf_counter()
                each = {pid: lineage_of(pid) for pid in pids}
                one_by_one.append(time.perf_counter() - t)
                t = time.perf_counter()
                together = lineages(pids)
                at_once.append(time.perf_counter() - t)
                if together != each:
                    raise RuntimeError("lineages() and lineage_of() disagree")
            series = sum(ln.startswith(b"nbmem_kernel_gpu_memory_bytes{") for ln in body.splitlines())
            if series != kernels:
                raise RuntimeError(f"/metrics has {series} kernel series, not {kernels}:\n{server.log()[-2000:]}")
    for kind, times in (("fresh", fresh), ("cached", cached)):
        line(f"/metrics, {kernels} kernels, {kind} reading, at the client", ms([dt for dt, _ in times]))
        line(f"/metrics, {kernels} kernels, {kind} reading, server loop CPU", ms([cpu for _, cpu in times]))
    line(f"ancestry of {kernels} kernels' PIDs, one by one (lineage_of)", ms(one_by_one))
    line(f"ancestry of {kernels} kernels' PIDs, at once (lineages)", ms(at_once))
    line("ancestry, at once / one by one", f"{statistics.median(at_once) / statistics.median(one_by_one):.2f}×")
    line(
        f"/metrics size, {kernels} kernels",
        f"{len(body)} B, of which nbmem's families {len(nbmem_part(body))} B ({series} kernel series, {a.gpus} GPUs)",
    )
    # Other work on the machine stretches the client's times (the CPU times much less): say how busy it was.
    line("machine", f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end")
    return print_summary()


if __name__ == "__main__":
    sys.exit(main())
