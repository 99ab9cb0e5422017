"""Training throughput with `%cudamem on` against plain, on the stack people train with (issues 19, 26).

    python benchmarks/bench_stack.py --pairs 60 --seconds 2         # both workloads, CUDA, 60 pairs of 2 s blocks
    python benchmarks/bench_stack.py --only trainer                 # one workload per command
    python benchmarks/bench_stack.py --pairs 20 --seconds 2 --interval 0.05   # ten times the ticks: the cost shows
    python benchmarks/bench_stack.py --design runs --pairs 12 --seconds 6   # whole cells, nbmem loaded/unloaded
    python benchmarks/bench_stack.py --device cpu --seconds 1 --pairs 4    # a smoke run anywhere

Two workloads, each a notebook cell that trains for ``--seconds`` and counts the samples it trained on:

- ``trainer``: transformers' ``Trainer`` on a small random-init ``LlamaForCausalLM`` (``LlamaConfig``, no
  download) and synthetic tokens; skipped, and said so, where transformers is not installed;
- ``loader``: the PyTorch quickstart's shape, DataLoader-bound: 60,000 FashionMNIST-sized images (1x28x28,
  uint8, turned into float tensors per item as ``ToTensor`` does), batch 64, the quickstart's MLP, SGD.

Two designs, both in one process and one shell, on and off in many short pairs (on then off, off then on, and so
on, so that a slow drift of the machine cancels); each pair's ratio is on/off throughput, and the summary gives
their mean with a 95 % interval (Student's t). Target: the interval's lower bound >= 0.98.

- ``blocks`` (the default): one training cell, nbmem loaded with ``%cudamem on`` and a gauge publishing (where
  anywidget is installed) throughout; its sampler thread, which drives all it does while a cell runs (samples,
  the gauge's publishing, the flight recorder's writes), is started and stopped every ``--seconds``. Adjacent
  blocks share the machine's state, so the pairs are tight: this is the cost of monitoring a long cell.
- ``runs``: whole cells of ``--seconds``, with nbmem loaded (``%cudamem on``, gauge) and unloaded; a run's
  throughput is its samples over the cell's whole wall time (nbmem's cell boundaries included). Two such runs
  a few seconds apart differ by up to 10 % on the GPU machine, which needs many pairs.

``--interval 0.05`` (blocks only) runs the sampler ten times as often in the on blocks, so that what nbmem costs
shows above the pairs' noise. Not every cost is per tick (the gauge flushes at most 4 times a second, the flight
recorder writes every 2 s), so the loss is set against the CPU share nbmem's threads used in the same blocks;
that factor times the share measured at the default interval bounds the loss there.

Beside the ratio, the cost measured directly: the CPU time nbmem's own threads used in the "on" blocks or runs,
as a share of one core (read per thread from the OS).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from bench_overhead import nbmem_off, nbmem_on  # benchmarks/ is on sys.path when run as a script
from harness import Quiet, cell, line, new_shell, print_summary
from IPython.core.interactiveshell import InteractiveShell

TARGET = 0.98  # issue 26: the 95 % interval's lower bound

LOADER_SETUP = """
import time, torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

_dev = {dev!r}
torch.manual_seed(0)

class FashionLike(Dataset):
    '''60,000 28x28 grey images and labels, made up; each item becomes a float tensor as ToTensor does.'''
    def __init__(self, n=60_000):
        self.images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8)
        self.labels = torch.randint(0, 10, (n,))
    def __len__(self):
        return len(self.labels)
    def __getitem__(self, i):
        return self.images[i].unsqueeze(0).float().div(255), int(self.labels[i])

class NeuralNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(nn.Linear(28 * 28, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                                               nn.Linear(512, 10))
    def forward(self, x):
        return self.linear_relu_stack(self.flatten(x))

train_dataloader = DataLoader(FashionLike(), batch_size=64, shuffle=True)
model = NeuralNetwork().to(_dev)
loss_fn = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

def train_for(seconds, blocks=None):
    '''The quickstart's train loop, epoch after epoch, until ``seconds`` have passed (or ``blocks`` says it is
    done); returns the samples seen.'''
    model.train()
    seen, t0 = 0, time.perf_counter()
    while True:
        for X, y in train_dataloader:
            X, y = X.to(_dev), y.to(_dev)
            loss = loss_fn(model(X), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seen += len(X)
            if blocks is not None and blocks.step(len(X)):
                return seen
            if time.perf_counter() - t0 >= seconds:
                if _dev == "cuda":
                    torch.cuda.synchronize()
                return seen
"""

TRAINER_SETUP = """
import time, torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

_dev = {dev!r}
torch.manual_seed(0)
config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
model = LlamaForCausalLM(config)

class Tokens(torch.utils.data.Dataset):
    '''Synthetic token sequences: no download, the same each epoch.'''
    def __init__(self, n=4096, length=128):
        self.ids = torch.randint(0, config.vocab_size, (n, length))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {{"input_ids": self.ids[i], "labels": self.ids[i]}}

class StopAfter(TrainerCallback):
    '''Ends training once ``seconds`` have passed; counts the optimizer steps.'''
    def __init__(self):
        self.seconds, self.steps, self.blocks = 0.0, 0, None
    def on_train_begin(self, args, state, control, **kw):
        self.t0, self.steps = time.perf_counter(), 0
    def on_step_end(self, args, state, control, **kw):
        self.steps += 1
        if self.blocks is not None and self.blocks.step(args.per_device_train_batch_size):
            control.should_training_stop = True
        elif time.perf_counter() - self.t0 >= self.seconds:
            control.should_training_stop = True

stop = StopAfter()
bf16 = _dev == "cuda" and torch.cuda.is_bf16_supported()
args = TrainingArguments(output_dir={out!r}, per_device_train_batch_size=8, max_steps=10**9, learning_rate=1e-4,
                         report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, bf16=bf16,
                         use_cpu=_dev == "cpu", dataloader_num_workers=0, seed=0)
trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[stop])

def train_for(seconds, blocks=None):
    '''trainer.train() until ``seconds`` have passed (or ``blocks`` says it is done); returns the sequences
    trained on.'''
    stop.seconds, stop.blocks = seconds, blocks
    trainer.train()
    if _dev == "cuda":
        torch.cuda.synchronize()
    return stop.steps * args.per_device_train_batch_size
"""


def nbmem_cpu_s() -> float:
    """CPU seconds nbmem's own threads (the sampler, the gauge's publisher) have used so far, read from the OS
    per thread: the direct measure of what monitoring takes from a training loop that holds the GIL."""
    import psutil

    ours = {t.native_id for t in threading.enumerate() if t.name.startswith("nbmem")}
    return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id in ours)


def run(sh: InteractiveShell, seconds: float, cpu: list[tuple[float, float]] | None = None) -> float:
    """One run: a cell that trains for ``seconds``; its samples over the cell's wall time. ``cpu`` gets the
    CPU seconds nbmem's threads used during the run, and the run's wall seconds."""
    c0 = nbmem_cpu_s()
    wall = cell(sh, f"_seen = train_for({seconds!r})")
    if cpu is not None:
        cpu.append((nbmem_cpu_s() - c0, wall))
    return float(sh.user_ns["_seen"]) / wall


#: Two-sided 95 % critical values of Student's t by degrees of freedom (scipy is not a dependency).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
       20: 2.086, 24: 2.064, 29: 2.045}


def interval95(xs: list[float]) -> tuple[float, float, float]:
    """The mean of ``xs`` and its 95 % confidence interval (Student's t)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan"), float("nan")
    df = len(xs) - 1
    t = T95.get(df) or T95[max(k for k in T95 if k <= df)] if df <= 29 else 1.96
    half = t * statistics.stdev(xs) / len(xs) ** 0.5
    return m, m - half, m + half


def median95(xs: list[float]) -> tuple[float, float, float]:
    """The median of ``xs`` and its distribution-free 95 % interval (order statistics, the sign test's binomial):
    one hiccup of the machine moves it by one rank, not by its size."""
    v, n = sorted(xs), len(xs)
    k = 0  # the largest k with P(Binomial(n, 1/2) <= k - 1) <= 2.5 %
    while k + 1 <= n and sum(math.comb(n, i) for i in range(k + 1)) / 2**n <= 0.025:
        k += 1
    if k == 0:
        return statistics.median(v), float("nan"), float("nan")
    return statistics.median(v), v[k - 1], v[n - k]


def summarize(name: str, design: str, ratios: list[float], cpu_s: float, wall_s: float) -> None:
    """The summary lines of one workload: the pairs' on/off ratios (mean with Student's t interval, median with
    its distribution-free one) and nbmem's threads' CPU over the monitored seconds."""
    mean, lo, hi = interval95(ratios)
    med, mlo, mhi = median95(ratios)
    line(f"{name} throughput ratio on/off, {design}",
         f"mean {mean:.4f}, 95 % interval [{lo:.4f}, {hi:.4f}]; median {med:.4f}, 95 % interval [{mlo:.4f}, "
         f"{mhi:.4f}]; over {len(ratios)} pairs (min {min(ratios):.4f}, max {max(ratios):.4f}); lower bound >= "
         f"{TARGET}: mean {'met' if lo >= TARGET else 'NOT met'}, median {'met' if mlo >= TARGET else 'NOT met'}")
    line(f"{name}: nbmem's threads' CPU while monitoring", f"{cpu_s:.2f} s in {wall_s:.0f} s = {cpu_s / wall_s:.3%} "
         f"of one core (the OS counts 10 ms ticks): what the sampler and the gauge take from a loop that holds "
         f"the GIL")


class Blocks:
    """Monitoring on and off in turn inside one training cell: ``pairs`` pairs of blocks of ``block_s`` seconds,
    on then off and off then on in turn. nbmem stays loaded with ``%cudamem on`` and its gauge; "off" stops its
    sampler thread, which drives everything it does while a cell runs (the samples, the gauge's publishing, the
    flight recorder's writes). The training loop calls ``step(samples)`` after each step; True ends it."""

    def __init__(self, sampler: Any, pairs: int, block_s: float, sync: Any) -> None:
        self.plan = [m for i in range(pairs) for m in (("on", "off") if i % 2 == 0 else ("off", "on"))]
        self.sampler, self.block_s, self.sync = sampler, block_s, sync
        self.results: list[tuple[str, int, float, float]] = []  # mode, samples, wall s, nbmem's CPU s
        self.i = 0
        self._begin()

    def _begin(self) -> None:
        if self.plan[self.i] == "on":
            self.sampler.start()
        else:
            self.sampler.stop()
        self.n, self.cpu0, self.t0 = 0, nbmem_cpu_s(), time.perf_counter()

    def step(self, samples: int) -> bool:
        self.n += samples
        if time.perf_counter() - self.t0 < self.block_s:
            return False
        self.sync()  # the block's queued GPU work is its own
        wall = time.perf_counter() - self.t0
        if self.sampler.running != (self.plan[self.i] == "on"):
            raise RuntimeError(f"block {self.i}: the sampler was {'on' if self.sampler.running else 'off'} in an "
                               f"{self.plan[self.i]} block")
        self.results.append((self.plan[self.i], self.n, wall, nbmem_cpu_s() - self.cpu0))
        self.i += 1
        if self.i == len(self.plan):
            self.sampler.start()
            return True
        self._begin()
        return False


class TickClock:
    """The wall time the sampler's ticks take on its own thread (reads and hand-off), and how many ran."""

    def __init__(self, sampler: Any) -> None:
        self.ticks, self.wall_s = 0, 0.0
        read, sink = sampler._read, sampler._sink

        def timed_read() -> Any:
            t0 = time.perf_counter()
            try:
                return read()
            finally:
                self.wall_s += time.perf_counter() - t0

        def timed_sink(batch: Any) -> None:
            t0 = time.perf_counter()
            try:
                sink(batch)
            finally:
                self.wall_s += time.perf_counter() - t0
                self.ticks += 1

        sampler._read, sampler._sink = timed_read, timed_sink


def blocks_run(name: str, sh: InteractiveShell, block_s: float, pairs: int, gauge: bool,
               interval_s: float | None = None) -> None:
    """``pairs`` pairs of on/off blocks inside one cell (class Blocks): each pair's ratio is on/off throughput.
    ``interval_s`` below the sampler's own runs it that much more often in the on blocks, so its cost shows."""
    from nbmem.ipython.root import session_of

    with Quiet():
        nbmem_on(sh, gauge)
        cell(sh, "pass")
    sync = sh.user_ns["torch"].cuda.synchronize if sh.user_ns.get("_dev") == "cuda" else lambda: None
    sampler = session_of(sh).sampler
    default_s = sampler.interval_s
    if interval_s:
        sampler.stop()
        sampler.interval_s = interval_s
    clock = TickClock(sampler)
    sh.user_ns["_blocks"] = Blocks(sampler, pairs, block_s, sync)
    with Quiet():
        cell(sh, f"_seen = train_for({pairs * 2 * block_s * 10 + 60!r}, blocks=_blocks)")
    b: Blocks = sh.user_ns.pop("_blocks")
    with Quiet():
        nbmem_off(sh)
    done = b.results
    ratios = [on[1] / on[2] / (off[1] / off[2]) for on, off in
              ((x, y) if x[0] == "on" else (y, x) for x, y in zip(done[0::2], done[1::2]))]
    for i, r in enumerate(ratios):
        print(f"    {name} pair {i + 1}: {r:.4f}", flush=True)
    on_blocks = [r for r in done if r[0] == "on"]
    cpu_s, wall_s = sum(r[3] for r in on_blocks), sum(r[2] for r in on_blocks)
    summarize(name, f"{block_s:g} s blocks in one cell{' (+gauge)' if gauge else ''}"
              f"{f', ticks every {interval_s:g} s' if interval_s else ''}", ratios, cpu_s, wall_s)
    if clock.ticks:
        per_tick_ms = clock.wall_s / clock.ticks * 1e3
        line(f"{name}: one tick", f"{per_tick_ms:.2f} ms of wall time on the sampler's thread, on average over "
             f"{clock.ticks} ticks (the flight recorder's writes included)")
    if interval_s:
        # Not every cost is per tick (the gauge flushes at most 4 times a second, the flight recorder writes every
        # 2 s), so the loss is not scaled by ticks: it is set against the CPU share nbmem's threads used, which
        # counts every part whatever its rate. A run at the default interval gives that share there.
        mean, lo, _ = interval95(ratios)
        share = cpu_s / max(1e-9, wall_s)
        if share > 0:
            line(f"{name}: loss per CPU share", f"the loop lost {1 - mean:.2%} (95 % at most {1 - lo:.2%}) while "
                 f"nbmem's threads used {share:.2%} of a core: {(1 - mean) / share:.2f}x their share (95 % at most "
                 f"{(1 - lo) / share:.2f}x); times the share at the default interval bounds the loss there")
        sampler.interval_s = default_s


def pairs_run(name: str, sh: InteractiveShell, seconds: float, pairs: int, gauge: bool) -> None:
    """``pairs`` short pairs in this shell, on then off and off then on in turn (so drift cancels); each pair's
    ratio is on/off, and the summary gives their mean and median with 95 % intervals."""
    ratios: list[float] = []
    cpu: list[tuple[float, float]] = []
    for i in range(pairs):
        tput: dict[str, float] = {}
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
            with Quiet():
                if mode == "on":
                    nbmem_on(sh, gauge)
                    cell(sh, "pass")  # loading's one-time work (the first scan, the gauge's first push) is done
                    time.sleep(0.3)
                tput[mode] = run(sh, seconds, cpu if mode == "on" else None)
                if mode == "on":
                    nbmem_off(sh)
        ratios.append(tput["on"] / tput["off"])
        print(f"    {name} pair {i + 1}: on {tput['on']:.1f}, off {tput['off']:.1f} samples/s -> {ratios[-1]:.4f}",
              flush=True)
    summarize(name, f"{seconds:g} s runs{' (+gauge)' if gauge else ''}", ratios, sum(c for c, _ in cpu),
              sum(w for _, w in cpu))


def measure(name: str, sh: InteractiveShell, seconds: float, pairs: int, gauge: bool, design: str,
            interval_s: float | None) -> None:
    if design == "blocks":
        blocks_run(name, sh, seconds, pairs, gauge, interval_s)
    else:
        pairs_run(name, sh, seconds, pairs, gauge)


def bench_loader(dev: str, seconds: float, pairs: int, gauge: bool, design: str, interval_s: float | None) -> None:
    print("loader: the PyTorch quickstart's loop, DataLoader-bound (1x28x28, batch 64, MLP, SGD)", flush=True)
    sh = new_shell()
    cell(sh, LOADER_SETUP.format(dev=dev))
    cell(sh, f"_seen = train_for({min(seconds, 5.0)!r})")  # warm-up: kernels, allocator, the loader's first epoch
    measure("loader", sh, seconds, pairs, gauge, design, interval_s)


def bench_trainer(dev: str, seconds: float, pairs: int, gauge: bool, design: str, interval_s: float | None) -> None:
    try:
        import transformers
    except ImportError:
        line("trainer throughput ratio on/off", "skipped (transformers is not installed: pip install transformers)")
        return
    print(f"trainer: transformers {transformers.__version__} Trainer, LlamaForCausalLM 4 x 256 from LlamaConfig, "
          f"batch 8 x 128 tokens", flush=True)
    sh = new_shell()
    with tempfile.TemporaryDirectory(prefix="nbmem-bench-trainer-") as out:
        with Quiet():
            cell(sh, TRAINER_SETUP.format(dev=dev, out=out))
            cell(sh, f"_seen = train_for({min(seconds, 5.0)!r})")  # warm-up
        measure("trainer", sh, seconds, pairs, gauge, design, interval_s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each run")
    ap.add_argument("--pairs", type=int, default=12, help="pairs of runs (on/off, then off/on) per workload")
    ap.add_argument("--only", default="", help="comma list: trainer,loader")
    ap.add_argument("--design", default="blocks", choices=["blocks", "runs"],
                    help="blocks: on/off blocks of --seconds inside one training cell (nbmem loaded, its sampler "
                         "started and stopped); runs: whole cells with nbmem loaded and unloaded")
    ap.add_argument("--interval", type=float, default=None,
                    help="blocks only: the sampler's interval in the on blocks (0.05: ten times the ticks of the "
                         "default 0.5 s, so that nbmem's cost shows above the pairs' noise)")
    a = ap.parse_args()
    only = set(filter(None, a.only.split(",")))
    try:
        import anywidget  # noqa: F401

        gauge = True
    except Exception:
        gauge = False
    import torch

    env = {"python": sys.version.split()[0], "device": a.device, "torch": torch.__version__, "gauge": gauge,
           "seconds": a.seconds, "pairs": a.pairs, "design": a.design,
           "interval": a.interval}
    if a.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print(json.dumps(env), flush=True)
    for name, fn in (("trainer", bench_trainer), ("loader", bench_loader)):
        if not only or name in only:
            fn(a.device, a.seconds, a.pairs, gauge, a.design, a.interval)
    return print_summary()


if __name__ == "__main__":
    sys.exit(main())
