"""What each per-cell part costs on a GPU: the boundary reads, and the allocator trace (start, record, read).

    python benchmarks/bench_trace_costs.py     # needs CUDA; prints one line per part, medians of 7

It times the parts directly (not through a notebook), so the per-cell overhead in bench_overhead.py
and bench_scan.py can be explained: a launch-bound training cell, its events per step, the cost of
recording them without and with Python stacks, and of reading them back.
"""

from __future__ import annotations

import statistics
import time

import torch

from nbmem.measure.sources import Probe

STEPS = 200


def median_ms(fn, n: int = 7) -> float:
    xs = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        xs.append((time.perf_counter() - t) * 1e3)
    return statistics.median(xs)


def main() -> None:
    torch.cuda.init()
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    xb = torch.randn(64, 256, device="cuda")

    def steps() -> None:
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=True)
            model(xb).square().mean().backward()
            opt.step()
        torch.cuda.synchronize()

    steps()
    probe = Probe()
    probe.start()
    src = probe.torch
    plain = median_ms(steps)
    print(f"launch-bound step: {plain / STEPS * 1e3:.0f} µs ({STEPS} steps: {plain:.1f} ms)")
    print(f"boundary read (allocator, NVML, RSS): {median_ms(probe.boundary, 21):.2f} ms")
    print(f"sampler tick: {median_ms(probe.samples, 21):.2f} ms")
    for stacks in (False, True):
        tr = src.start_trace(stacks=stacks, max_entries=1_000_000)
        assert tr is not None
        steps()
        events = src.finish_trace(tr, read=True) or []
        n = sum(len(x) for x in events)
        rec = median_ms(lambda s=stacks: _recorded(src, s, steps))
        print(f"recording, {'python stacks' if stacks else 'no stacks'}: {(rec - plain) / STEPS * 1e3:+.0f} µs per "
              f"step ({rec / plain:.3f}x), {n / STEPS:.0f} events per step")
        t = time.perf_counter()
        tr = src.start_trace(stacks=stacks, max_entries=1_000_000)
        steps()
        t_read = time.perf_counter()
        src.finish_trace(tr, read=True)
        read = time.perf_counter() - t_read
        print(f"  reading {n:,} events: {read * 1e3:.0f} ms ({read / max(1, n) * 1e6:.1f} µs each)")
    tr = src.start_trace(stacks=False, max_entries=100_000)
    assert tr is not None
    t = time.perf_counter()
    src.finish_trace(tr, read=False)
    print(f"start + stop a recording (an empty cell): {(time.perf_counter() - t) * 1e3:.2f} ms")
    print(f"  reading an empty trace: {median_ms(lambda: _empty_read(src)):.2f} ms")
    probe.close()


def _recorded(src, stacks: bool, steps) -> None:
    tr = src.start_trace(stacks=stacks, max_entries=1_000_000)
    steps()
    src.finish_trace(tr, read=False)


def _empty_read(src) -> None:
    tr = src.start_trace(stacks=False, max_entries=100_000)
    src.finish_trace(tr, read=True)


if __name__ == "__main__":
    main()
