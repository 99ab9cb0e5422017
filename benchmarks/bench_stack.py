"""Training throughput with `%cudamem on` against plain, on the stack people train with (issues 19, 26).

    python benchmarks/bench_stack.py --pairs 60 --seconds 2         # both workloads, CUDA, 60 pairs of 2 s blocks
    python benchmarks/bench_stack.py --only trainer                 # one workload per command
    python benchmarks/bench_stack.py --pairs 20 --seconds 2 --interval 0.05 --default-pairs 50
                                        # ten times the ticks, then the default's: the derived 2 Hz bound
    python benchmarks/bench_stack.py --design runs --pairs 12 --seconds 6   # whole cells, nbmem loaded/unloaded
    python benchmarks/bench_stack.py --device cpu --seconds 1 --pairs 4    # a smoke run anywhere

Two workloads, each a notebook cell that trains for ``--seconds`` and counts the samples it trained on:

- ``trainer``: transformers' ``Trainer`` on a small random-init ``LlamaForCausalLM`` (``LlamaConfig``, no
  download) and synthetic tokens; skipped, and said so, where transformers is not installed;
- ``loader``: the PyTorch quickstart's shape, DataLoader-bound: 60,000 FashionMNIST-sized images (1x28x28,
  uint8, turned into float tensors per item as ``ToTensor`` does), batch 64, the quickstart's MLP, SGD.

Two designs, both in one process and one shell, on and off in many short pairs (on then off, off then on, and so
on, so that a slow drift of the machine cancels); each pair's ratio is on/off throughput, and the summary gives
their mean with a 95 % interval (Student's t, its quantile for the pairs' n - 1 degrees of freedom). Target:
the interval's low end, a one-sided 97.5 % lower bound, >= 0.98.

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
that factor times the share measured at the default interval bounds the loss there. The same command then runs
``--default-pairs`` pairs at the default interval and prints that derived ratio and its one-sided 97.5 % lower
bound, with the assumption it rests on (the loss is in proportion to the CPU nbmem's threads take).

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
from dataclasses import dataclass
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


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h


def _beta_inc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0 or x >= 1:
        return max(0.0, min(1.0, x))
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(a, b, x) / a
    return 1 - front * _beta_fraction(b, a, 1 - x) / b


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile for 0.5 <= ``p`` < 1 and ``df`` degrees of freedom (scipy is not a dependency):
    bisection on the distribution function, to 1e-12. t_quantile(0.975, 49) = 2.0096."""
    def cdf(t: float) -> float:
        return 1 - 0.5 * _beta_inc(df / 2, 0.5, df / (df + t * t))

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        hi *= 2
    while hi - lo > 1e-12:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def interval95(xs: list[float]) -> tuple[float, float, float]:
    """The mean of ``xs`` and its two-sided 95 % confidence interval (Student's t with n - 1 degrees of
    freedom). Its low end alone is a one-sided 97.5 % lower bound."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan"), float("nan")
    half = t_quantile(0.975, len(xs) - 1) * statistics.stdev(xs) / len(xs) ** 0.5
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
    t = f"t = {t_quantile(0.975, len(ratios) - 1):.3f}, {len(ratios) - 1} df; " if len(ratios) > 1 else ""
    line(f"{name} throughput ratio on/off, {design}",
         f"mean {mean:.4f}, 95 % interval [{lo:.4f}, {hi:.4f}] ({t}its low end is a one-sided 97.5 % lower "
         f"bound); median {med:.4f}, 95 % interval [{mlo:.4f}, {mhi:.4f}]; over {len(ratios)} pairs (min "
         f"{min(ratios):.4f}, max {max(ratios):.4f}); lower bound >= {TARGET}: mean "
         f"{'met' if lo >= TARGET else 'NOT met'}, median {'met' if mlo >= TARGET else 'NOT met'}")
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
               interval_s: float | None = None) -> Share:
    """``pairs`` pairs of on/off blocks inside one cell (class Blocks): each pair's ratio is on/off throughput.
    ``interval_s`` below the sampler's own runs it that much more often in the on blocks, so its cost shows.
    Returns the pairs' ratios and what nbmem's threads used in the on blocks (Share)."""
    from nbmem.ipython.root import session_of

    with Quiet():
        nbmem_on(sh, gauge)
        cell(sh, "pass")
    threads = sum(t.name.startswith("nbmem") for t in threading.enumerate()) or 1  # whose CPU is counted
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
    return Share(ratios, cpu_s, wall_s, 2 * TICK_S * threads, interval_s or default_s)


#: The unit in which the OS counts a thread's CPU time (Linux: 100 ticks a second).
TICK_S = 0.01


@dataclass(frozen=True)
class Share:
    """One blocks run: the pairs' ratios, and the CPU nbmem's threads used in its on blocks over their wall
    time, to within ``resolution_s`` (the OS counts each thread's user and system time in whole ticks; the
    off blocks add nothing, so the on blocks' sum is off by at most that much)."""

    ratios: list[float]
    cpu_s: float
    wall_s: float
    resolution_s: float
    interval_s: float

    def at_least(self) -> float:
        return max(0.0, self.cpu_s - self.resolution_s) / max(1e-9, self.wall_s)

    def at_most(self) -> float:
        return (self.cpu_s + self.resolution_s) / max(1e-9, self.wall_s)


def derived_bound(name: str, fast: Share, default: Share) -> None:
    """The on/off ratio at the default interval, derived from the faster one's loss per CPU share times the
    share measured at the default interval: the figure RESULTS.md gives for the default 2 Hz."""
    ratios, fast_s, default_s = fast.ratios, fast.interval_s, default.interval_s
    mean, lo, _hi = interval95(ratios)
    share, share_default = fast.cpu_s / max(1e-9, fast.wall_s), default.cpu_s / max(1e-9, default.wall_s)
    if fast.at_least() <= 0 or len(ratios) < 2:
        line(f"{name}: derived ratio at the default interval",
             f"not derived: at {1 / fast_s:g} Hz nbmem's threads used {fast.cpu_s:.2f} s of CPU, within the OS's "
             f"resolution ({fast.resolution_s:.2f} s), or there was one pair: more --pairs or --seconds")
        return
    at_mean = 1 - (1 - mean) / share * share_default
    # The bound takes each share at its least favourable end of the OS's resolution.
    at_lo = 1 - max(0.0, 1 - lo) / fast.at_least() * default.at_most()
    t = t_quantile(0.975, len(ratios) - 1)
    line(f"{name}: derived ratio at the default interval ({1 / default_s:g} Hz)",
         f"{at_mean:.4f}, one-sided 97.5 % lower bound {at_lo:.4f} (lower bound >= {TARGET}: "
         f"{'met' if at_lo >= TARGET else 'NOT met'}). From: the {1 / fast_s:g} Hz pairs' loss {1 - mean:.2%}, "
         f"at most {1 - lo:.2%} (the low end of their mean's 95 % t-interval, t = {t:.3f} for {len(ratios) - 1} "
         f"df), over nbmem's threads' share there {share:.3%} of a core, times their share at {1 / default_s:g} Hz "
         f"{share_default:.3%} (for the bound: {fast.at_least():.3%} and {default.at_most():.3%}, the ends of the "
         f"OS's 10 ms ticks against it). It rests on the assumption that what a loop loses is in proportion to "
         f"the CPU nbmem's threads take (their time holding the GIL, the allocator's lock while its counters are "
         f"read): a cost with no CPU in it (a wait inside the driver) escapes it")


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
            interval_s: float | None, default_pairs: int) -> None:
    """``--interval``: the blocks at that interval, then ``default_pairs`` at the default interval, and the
    default's ratio derived from both (derived_bound); 0 pairs there skips the derivation."""
    if design != "blocks":
        pairs_run(name, sh, seconds, pairs, gauge)
        return
    fast = blocks_run(name, sh, seconds, pairs, gauge, interval_s)
    if interval_s and default_pairs:
        derived_bound(name, fast, blocks_run(name, sh, seconds, default_pairs, gauge))


def bench_loader(dev: str, seconds: float, pairs: int, gauge: bool, design: str, interval_s: float | None,
                 default_pairs: int) -> None:
    print("loader: the PyTorch quickstart's loop, DataLoader-bound (1x28x28, batch 64, MLP, SGD)", flush=True)
    sh = new_shell()
    cell(sh, LOADER_SETUP.format(dev=dev))
    cell(sh, f"_seen = train_for({min(seconds, 5.0)!r})")  # warm-up: kernels, allocator, the loader's first epoch
    measure("loader", sh, seconds, pairs, gauge, design, interval_s, default_pairs)


def bench_trainer(dev: str, seconds: float, pairs: int, gauge: bool, design: str, interval_s: float | None,
                  default_pairs: int) -> None:
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
        measure("trainer", sh, seconds, pairs, gauge, design, interval_s, default_pairs)


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
    ap.add_argument("--default-pairs", type=int, default=None,
                    help="with --interval: pairs at the default interval run after it, whose CPU share turns the "
                         "faster run's loss into the derived ratio at the default interval (default: --pairs; "
                         "0 skips)")
    a = ap.parse_args()
    default_pairs = a.pairs if a.default_pairs is None else a.default_pairs
    only = set(filter(None, a.only.split(",")))
    try:
        import anywidget  # noqa: F401

        gauge = True
    except Exception:
        gauge = False
    import torch

    env = {"python": sys.version.split()[0], "device": a.device, "torch": torch.__version__, "gauge": gauge,
           "seconds": a.seconds, "pairs": a.pairs, "design": a.design,
           "interval": a.interval, "default_pairs": default_pairs if a.interval else None}
    if a.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print(json.dumps(env), flush=True)
    for name, fn in (("trainer", bench_trainer), ("loader", bench_loader)):
        if not only or name in only:
            fn(a.device, a.seconds, a.pairs, gauge, a.design, a.interval, default_pairs)
    return print_summary()


if __name__ == "__main__":
    sys.exit(main())
