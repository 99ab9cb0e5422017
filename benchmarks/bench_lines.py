"""What per-line recording costs a training loop, each way of recording it, side by side in one shell.

    python benchmarks/bench_lines.py               # needs CUDA; 15 rounds, about 80 s on an H100
    python benchmarks/bench_lines.py --rounds 3    # a quicker look

nbmem is loaded once; each round runs the same launch-bound cell (bench_overhead's: 400 steps of
8×Linear(256), batch 64) unmonitored, monitored, with the allocator's trace, with ``--lines`` by time
(Python 3.12+) and with ``--lines`` by stacks, switching between them with ``%config`` only. Loading and
unloading between pairs (bench_overhead.py) adds its own noise; this isolates the recording. Ratios are
plain / mode: the median over rounds of each round's ratio, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict

from bench_overhead import MODELS, TRAIN_SETUP, TRAIN_STEP
from harness import Quiet, cell, line, new_shell, print_summary

import nbmem.measure.sources

MODES = {
    "plain": ["%cudamem off"],
    "monitored": ["%config Nbmem.lines = False", "%config Nbmem.trace = False", "%cudamem on"],
    "trace": ["%config Nbmem.trace = True", "%config Nbmem.lines = False", "%cudamem on"],
    "--lines": ["%config Nbmem.trace = False", "%config Nbmem.lines = True", "%cudamem on"],
    "--lines, stacks": ["%config Nbmem.trace = False", "%config Nbmem.lines = True", "%cudamem on"],
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench_lines.py needs CUDA: the allocator's trace exists only there.")
        return 0
    sh = new_shell()
    cell(sh, TRAIN_SETUP.format(dev="cuda", **MODELS["launch-bound"]))
    step = TRAIN_STEP.format(steps=400)
    cell(sh, step)  # warm-up
    cell(sh, "%load_ext nbmem")
    clock = nbmem.measure.sources.LineClock
    by_time = clock.__dict__["unsupported"]
    print(f"lines by time on this Python: {clock.unsupported() or 'yes'}")
    times: dict[str, list[float]] = defaultdict(list)
    with Quiet():
        for _ in range(a.rounds):
            for mode, setup in MODES.items():
                if mode == "--lines, stacks":  # as on Python 3.11: a stack with every allocator event
                    clock.unsupported = staticmethod(lambda: "forced off by bench_lines")  # type: ignore[method-assign]
                try:
                    for c in setup:
                        cell(sh, c)
                    cell(sh, "pass")
                    times[mode].append(cell(sh, step))
                    cell(sh, "%cudamem off")
                finally:
                    clock.unsupported = by_time  # type: ignore[method-assign]
    plain = times["plain"]
    for mode, xs in times.items():
        if mode == "plain":
            continue
        ratios = [p / x for p, x in zip(plain, xs, strict=True)]
        line(f"launch-bound throughput ratio {mode}",
             f"median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}, "
             f"n={len(ratios)}); ratio of medians {statistics.median(plain) / statistics.median(xs):.3f}")
    return print_summary()


if __name__ == "__main__":
    sys.exit(main())
