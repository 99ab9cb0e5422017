"""Kernel → front-end traffic of the gauge at default settings: messages per second and bytes each.

    python benchmarks/bench_widget.py [--seconds 10]

Counts what the gauge hands to its comm (every `update` message, JSON-encoded) for the devices this
machine has, and for 8 GPUs fed with synthetic samples at the sampler's rate. Prints `widget …` lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config


def measure(gauge, seconds: float, feed=None, interval_s: float = 0.5) -> tuple[float, list[int]]:
    sizes: list[int] = []
    real_send = gauge._send

    def counting_send(msg, buffers=None):
        sizes.append(len(json.dumps(msg, default=str)) + sum(len(b) for b in buffers or ()))
        return real_send(msg, buffers)

    gauge._send = counting_send
    t0 = time.monotonic()
    k = 0
    while time.monotonic() - t0 < seconds:
        if feed is not None:
            feed(k)
            k += 1
        time.sleep(interval_s if feed is not None else 0.05)
    gauge._send = real_send
    return len(sizes) / seconds, sizes


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    seconds = 4.0 if a.quick else a.seconds
    cfg = Config()
    cfg.HistoryManager.hist_file = ":memory:"
    cfg.Nbmem.gauge = "none"
    sh = InteractiveShell.instance(config=cfg)
    sh.run_line_magic("load_ext", "nbmem")
    from nbmem.ipython.root import _ACTIVE
    from nbmem.records import Sample, Tick
    from nbmem.ui.widget import Gauge

    session = _ACTIVE[sh].session
    gauge = Gauge(session)
    try:
        rate, sizes = measure(gauge, seconds)
        devices = len(session.probe.gpu_names())
        print(f"widget traffic, this machine ({devices} GPU): {rate:.2f} msg/s, "
              f"median {statistics.median(sizes or [0]):.0f} B, max {max(sizes or [0])} B")
        session.sampler.stop()  # from here the gauge sees 8 synthetic GPUs at the default rate

        def feed(k: int) -> None:
            t = time.time()
            batch = [Sample(t, "cpu", None, None, None, None, None, None, None, None, 2**33 + k, 2**37, 2**36)]
            batch += [Sample(t, f"cuda:{i}", 2**34 + k * 2**20, 2**35, 2**34, 0, 2**36, 141 * 2**30, 2**35 + 2**29,
                             2**33, 2**33 + k) for i in range(8)]
            session.store.add_tick(batch)
            gauge._on_event(Tick(tuple(batch)))

        rate8, sizes8 = measure(gauge, seconds, feed=feed, interval_s=session.settings.interval_s)
        print(f"widget traffic, 8 GPUs (synthetic samples): {rate8:.2f} msg/s, median "
              f"{statistics.median(sizes8 or [0]):.0f} B, max {max(sizes8 or [0])} B")
    finally:
        gauge.close()
        sh.run_line_magic("unload_ext", "nbmem")
    return 0


if __name__ == "__main__":
    sys.exit(main())
