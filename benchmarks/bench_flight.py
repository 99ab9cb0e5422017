"""What the flight recorder (nbmem/flight.py) costs: a capsule write, the sampler's time with it, a cell's hooks.

The capsule is rewritten by the sampler thread at most every 2 s, with a full two-minute window; the cell
hooks only note the cell. Prints one summary line per figure, last. CPU only: the GPU rows are the same
records the sampler makes, built here so 1 and 8 GPUs can be compared on any machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import line, print_summary  # benchmarks/ is on sys.path when run as a script

from nbmem.measure.sources import Probe
from nbmem.recorder.flight import WINDOW_S, WRITE_EVERY_S, FlightRecorder
from nbmem.records import Sample, Tick

INTERVAL_S = 0.5
GiB = 2**30


def median_s(fn: object, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def gpu_rows(t: float, gpus: int) -> list[Sample]:
    return [Sample(t, f"cuda:{i}", 3 * GiB + i, 4 * GiB, 3 * GiB, 0, 9 * GiB, 80 * GiB, 5 * GiB, 4 * GiB, None)
            for i in range(gpus)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    args = ap.parse_args()
    n = 20 if args.quick else 200
    probe = Probe()
    probe.start()
    tick_s = median_s(probe.samples, n)
    cpu = probe.samples()[0]
    line("sampler tick (this machine's sources)", f"{tick_s * 1e3:.2f} ms")
    with tempfile.TemporaryDirectory() as d:
        for gpus in (1, 8):
            rec = FlightRecorder(Path(d) / f"g{gpus}", pid=1, started=0.0, notebook="bench.ipynb", kernel="k",
                                 write_every_s=float("inf"))
            rec.start()
            t0 = time.time()
            for k in range(int(WINDOW_S / INTERVAL_S)):
                t = t0 + k * INTERVAL_S
                rec.listen(Tick((replace(cpu, t_wall=t), *gpu_rows(t, gpus))))
            write_s = median_s(rec.write, n)
            g = f"{gpus} GPU{'s' if gpus > 1 else ''}"
            line(f"capsule write, full window, {g}", f"{write_s * 1e3:.2f} ms ({rec.last_bytes / 1024:.0f} KiB)")
            # The write holds the GIL: its share of the time is what a cell running beside it can lose.
            line(f"share of the time the recorder holds, {g}", f"{write_s / WRITE_EVERY_S:.4%} (one write per "
                 f"{WRITE_EVERY_S:g} s; the sampler's own ticks: {tick_s / INTERVAL_S:.4%})")
            hooks_s = median_s(lambda r=rec: (r.running(7, "x = torch.load('ckpt.pt')\n"), r.running(None)), n)
            line("cell hooks per cell", f"{hooks_s * 1e6:.1f} us")
            rec.close()
    probe.close()
    return print_summary()


if __name__ == "__main__":
    raise SystemExit(main())
