"""Training throughput with `%cudamem on` against plain, on the stack people train with (issue 19).

    python benchmarks/bench_stack.py                                   # both workloads, CUDA, 60 s runs, 2 rounds
    python benchmarks/bench_stack.py --only trainer --rounds 2         # about 9 min: one workload per command
    python benchmarks/bench_stack.py --only loader --rounds 2
    python benchmarks/bench_stack.py --device cpu --seconds 2 --rounds 1   # a smoke run anywhere

Two workloads, each a notebook cell that trains for ``--seconds`` and counts the samples it trained on:

- ``trainer``: transformers' ``Trainer`` on a small random-init ``LlamaForCausalLM`` (``LlamaConfig``, no
  download) and synthetic tokens; skipped, and said so, where transformers is not installed;
- ``loader``: the PyTorch quickstart's shape, DataLoader-bound: 60,000 FashionMNIST-sized images (1x28x28,
  uint8, turned into float tensors per item as ``ToTensor`` does), batch 64, the quickstart's MLP, SGD.

Runs go ABBA in one process and one shell: on, off, off, on, repeated ``--rounds`` times. "on" is nbmem
loaded with ``%cudamem on`` (and a gauge publishing, where anywidget is installed); "off" is nbmem unloaded.
A run's throughput is its samples over the cell's whole wall time (nbmem's boundaries included). Each
round's ratio is (on + on) / (off + off); the summary gives each round's ratio and their spread. Target: >= 0.99.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

from bench_overhead import nbmem_off, nbmem_on  # benchmarks/ is on sys.path when run as a script
from harness import Quiet, cell, line, new_shell, print_summary
from IPython.core.interactiveshell import InteractiveShell

TARGET = 0.99

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

def train_for(seconds):
    '''The quickstart's train loop, epoch after epoch, until ``seconds`` have passed; returns the samples seen.'''
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
        self.seconds, self.steps = 0.0, 0
    def on_train_begin(self, args, state, control, **kw):
        self.t0, self.steps = time.perf_counter(), 0
    def on_step_end(self, args, state, control, **kw):
        self.steps += 1
        if time.perf_counter() - self.t0 >= self.seconds:
            control.should_training_stop = True

stop = StopAfter()
bf16 = _dev == "cuda" and torch.cuda.is_bf16_supported()
args = TrainingArguments(output_dir={out!r}, per_device_train_batch_size=8, max_steps=10**9, learning_rate=1e-4,
                         report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, bf16=bf16,
                         use_cpu=_dev == "cpu", dataloader_num_workers=0, seed=0)
trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[stop])

def train_for(seconds):
    '''trainer.train() until ``seconds`` have passed; returns the sequences trained on.'''
    stop.seconds = seconds
    trainer.train()
    if _dev == "cuda":
        torch.cuda.synchronize()
    return stop.steps * args.per_device_train_batch_size
"""


def run(sh: InteractiveShell, seconds: float) -> float:
    """One run: a cell that trains for ``seconds``; its samples over the cell's wall time."""
    wall = cell(sh, f"_seen = train_for({seconds!r})")
    return float(sh.user_ns["_seen"]) / wall


def abba(name: str, sh: InteractiveShell, seconds: float, rounds: int, gauge: bool) -> None:
    """``rounds`` times on, off, off, on in this shell; prints each run, each round's ratio and the spread."""
    ratios = []
    for r in range(1, rounds + 1):
        tput: dict[str, list[float]] = {"on": [], "off": []}
        for mode in ("on", "off", "off", "on"):
            with Quiet():
                if mode == "on":
                    nbmem_on(sh, gauge)
                    cell(sh, "pass")  # loading's one-time work (the first scan, the gauge's first push) is done
                    time.sleep(0.3)
                tput[mode].append(run(sh, seconds))
                if mode == "on":
                    nbmem_off(sh)
        ratio = sum(tput["on"]) / sum(tput["off"])
        ratios.append(ratio)
        print(f"    {name} round {r}: on {tput['on'][0]:.1f}, off {tput['off'][0]:.1f}, off {tput['off'][1]:.1f}, "
              f"on {tput['on'][1]:.1f} samples/s -> ratio {ratio:.4f}", flush=True)
    med = statistics.median(ratios)
    each = ", ".join(f"{x:.4f}" for x in ratios)
    line(f"{name} throughput ratio on/off{' (+gauge)' if gauge else ''}",
         f"median {med:.4f} (min {min(ratios):.4f}, max {max(ratios):.4f}, spread {max(ratios) - min(ratios):.4f}, "
         f"rounds {each}; {seconds:g} s runs); target >= {TARGET}: {'met' if med >= TARGET else 'NOT met'}")


def bench_loader(dev: str, seconds: float, rounds: int, gauge: bool) -> None:
    print("loader: the PyTorch quickstart's loop, DataLoader-bound (1x28x28, batch 64, MLP, SGD)", flush=True)
    sh = new_shell()
    cell(sh, LOADER_SETUP.format(dev=dev))
    cell(sh, f"_seen = train_for({min(seconds, 5.0)!r})")  # warm-up: kernels, allocator, the loader's first epoch
    abba("loader", sh, seconds, rounds, gauge)


def bench_trainer(dev: str, seconds: float, rounds: int, gauge: bool) -> None:
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
        abba("trainer", sh, seconds, rounds, gauge)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seconds", type=float, default=60.0, help="length of each run (the issue asks >= 60)")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds (on, off, off, on) per workload")
    ap.add_argument("--only", default="", help="comma list: trainer,loader")
    a = ap.parse_args()
    only = set(filter(None, a.only.split(",")))
    try:
        import anywidget  # noqa: F401

        from nbmem import widget  # noqa: F401
        gauge = True
    except Exception:
        gauge = False
    import torch

    env = {"python": sys.version.split()[0], "device": a.device, "torch": torch.__version__, "gauge": gauge,
           "seconds": a.seconds, "rounds": a.rounds}
    if a.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print(json.dumps(env), flush=True)
    for name, fn in (("trainer", bench_trainer), ("loader", bench_loader)):
        if not only or name in only:
            fn(a.device, a.seconds, a.rounds, gauge)
    return print_summary()


if __name__ == "__main__":
    sys.exit(main())
