"""What the holder scan costs per cell on realistic notebook namespaces (issue 11), side by side in one run.

    python benchmarks/bench_scan.py --device cuda          # the figures for RESULTS.md (~8 min on a fast host)
    python benchmarks/bench_scan.py --device cpu --quick   # a smoke run anywhere (shapes 10x smaller)
    git worktree add /tmp/old 278038b && python benchmarks/bench_scan.py --device cpu --against /tmp/old
                                         # this checkout's per-cell cost against another's, side by side (issue 38)
    python benchmarks/bench_scan.py --device cuda --stages  # where that cost goes, stage by stage (thread CPU)

For each namespace shape, a fresh IPython shell is filled, then the same cells run interleaved, first
without nbmem and then after ``%load_ext nbmem`` + ``%cudamem on``: a memory-moving cell (keeps 4 MiB
more) and an empty cell. A per-cell overhead is the difference of the two medians. Also: whether the
scan was truncated, what it found, the first cell after ``%cudamem on``, and full ``nbmem.leaks()``.
Timings are printed, never asserted.

``--against DIR`` compares this checkout's nbmem with the one in another checkout DIR (an old commit's work
tree) on the memory-moving cell: each runs in its own process (``PYTHONPATH`` picks its ``nbmem``) with the
same namespace, and the two take turns, one cell each (A B B A ...), so that a busy machine slows both alike;
it prints each one's median overhead and their ratio, and whether each named ``bag`` and nothing else.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from string import Template
from typing import Any

from harness import Quiet, cell, line, new_shell, print_summary  # benchmarks/ is on sys.path when run as a script
from IPython.core.interactiveshell import InteractiveShell

T0 = time.perf_counter()

MOVE = "bag.append(torch.empty(2**20, device=DEV))"  # keeps 4 MiB more
EMPTY = "pass"
KINDS = {"memory-moving cell": MOVE, "empty cell": EMPTY}


def progress(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


# -- the namespaces ---------------------------------------------------------------------------------
PRELUDE = """
import torch
DEV = $dev
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(DEV)
bag = []
"""


@dataclass(frozen=True)
class Shape:
    """One namespace: a label and setup cell with ``$n`` (the size, 10x smaller with --quick), then extra cells."""

    key: str
    label: str
    n: int
    setup: str
    after: tuple[tuple[str, bool], ...] = ()  # (source, whether it fails): expression and failing cells
    scales: bool = True  # --quick divides n by 10

    def size(self, quick: bool) -> int:
        return max(1, self.n // 10) if quick and self.scales else self.n

    def cells(self, dev: str, quick: bool) -> list[tuple[str, bool]]:
        fill = Template(PRELUDE + textwrap.dedent(self.setup)).substitute(dev=repr(dev), n=self.size(quick))
        return [(fill, False), *((textwrap.dedent(s), f) for s, f in self.after)]


SHAPES = [
    Shape("tokens", "tokenized dataset, {n:,} lists of 256 ints", 40_000, """
        import numpy as np
        input_ids = np.random.default_rng(0).integers(0, 50257, ($n, 256)).tolist()
    """),
    Shape("dicts", "{n:,} small dicts with lists", 333_000, """
        records = [{"i": i, "v": [i, float(i)]} for i in range($n)]
    """),
    Shape("vocab", "vocabulary dict, {n:,} str -> int", 500_000, """
        vocab = {f"tok{i}": i for i in range($n)}
    """),
    Shape("strings", "{n:,} strings in a list", 1_000_000, """
        lines = [f"line {i}: the quick brown fox jumps over the lazy dog" for i in range($n)]
    """),
    Shape("encoder", "{n}-layer TransformerEncoder (d_model 512) + AdamW state", 48, """
        encoder = torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(512, 8, batch_first=True), $n, enable_nested_tensor=False).to(DEV)
        opt = torch.optim.AdamW(encoder.parameters(), lr=1e-4)
        encoder(torch.randn(2, 16, 512, device=DEV)).square().mean().backward()
        opt.step()
    """),
    Shape("dataframe", "{n:,}-row DataFrame", 1_000_000, """
        import numpy as np
        import pandas as pd
        rng = np.random.default_rng(0)
        df = pd.DataFrame({"id": np.arange($n), "x": rng.random($n), "label": rng.integers(0, 10, $n)})
    """),
    Shape("graphs", "kept graphs as in the tutorial case ({n} outputs and losses, Out[], a failed cell)", 200, """
        cnn = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(16 * 5 * 5, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(DEV)
        loss_fn = torch.nn.CrossEntropyLoss()
        test_data = [(torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))) for _ in range($n)]
        val_outputs, val_losses = [], []
        for X, y in test_data:  # an evaluation loop without torch.no_grad(): every output keeps its graph
            X, y = X.to(DEV), y.to(DEV)
            pred = cnn(X)
            loss = loss_fn(pred, y)
            val_outputs.append(pred)
            val_losses.append(loss)
    """, after=(
        ("cnn(test_data[0][0].to(DEV)).softmax(1)", False),  # a tensor with a graph left in Out[]
        ("""
        def evaluate_big(batch_size):
            X = torch.randn(batch_size, 1, 28, 28, device=DEV)
            y = torch.randint(0, 10, (batch_size,), device=DEV)
            return loss_fn(cnn(X), y[:-1])  # wrong target length: raises, the frames keep X and the graph

        evaluate_big(2048)
        """, True),
    )),
    Shape("small", "small realistic namespace (~{n:,} objects: Adam, DataLoader, dicts, 1,000 tensors)", 10_000, """
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(4, 256, device=DEV)).sum().backward(); opt.step()
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(512, 256)), batch_size=32)
        objs = [{"i": i, "v": [i, float(i)]} for i in range($n // 3)]
        tensors = [torch.empty(256, device=DEV) for _ in range(1000)]
    """, scales=False),
    Shape("lora7b", "Llama-2-7B-shaped decoder ({n} layers, narrow: 7B's tensor count, not its bytes) + LoRA on "
          "q/k/v/o + AdamW state, a kept loss list and Out[] (issue 48's notebook)", 32, """
        from transformers import LlamaConfig, LlamaForCausalLM
        from peft import LoraConfig, get_peft_model
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=172, num_hidden_layers=$n,
                             num_attention_heads=4, num_key_value_heads=4)
        lora = get_peft_model(LlamaForCausalLM(config).to(DEV),
                              LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM",
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-4)
        for step in range(2):
            ids = torch.randint(0, 320, (2, 32), device=DEV)
            out = lora(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses = [lora(input_ids=ids, labels=ids).loss for _ in range(2)]  # evaluated without no_grad
    """, after=(("lora(input_ids=ids[:, :16]).logits.softmax(-1)", False),)),
    Shape("gpt2", "GPT-2-small-shaped model ({n} layers, d_model 768, tied 50257 vocab) + AdamW state", 12, """
        class GPT(torch.nn.Module):
            def __init__(self, layers, vocab=50257, ctx=1024, d=768, heads=12):
                super().__init__()
                self.wte = torch.nn.Embedding(vocab, d)
                self.wpe = torch.nn.Embedding(ctx, d)
                block = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, activation="gelu", batch_first=True,
                                                         norm_first=True)
                self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
                self.ln_f = torch.nn.LayerNorm(d)
                self.head = torch.nn.Linear(d, vocab, bias=False)
                self.head.weight = self.wte.weight

            def forward(self, idx):
                t = idx.shape[1]
                x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
                mask = torch.nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
                return self.head(self.ln_f(self.blocks(x, mask=mask, is_causal=True)))

        gpt = GPT($n).to(DEV)
        opt_gpt = torch.optim.AdamW(gpt.parameters(), lr=3e-4)
        idx = torch.randint(0, 50257, (2, 64), device=DEV)
        logits = gpt(idx)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), idx.view(-1))
        loss.backward()
        opt_gpt.step()
        opt_gpt.zero_grad()
    """),
]
BY_KEY = {s.key: s for s in SHAPES}
LEAKS_AT = ("dicts", "tokens", "encoder")  # where full nbmem.leaks() is timed (the encoder: issue 26, <= 0.3 s)


# -- one shape --------------------------------------------------------------------------------------
@dataclass
class Seen:
    """What nbmem said about the monitored cells of one kind."""

    cells: int = 0
    truncated: int = 0
    with_bag: int = 0  # memory-moving cells whose findings name `bag`
    others: tuple[str, ...] = ()  # any other finding names (false ones for these cells)
    errors: tuple[str, ...] = ()


def observe(sh: InteractiveShell, seen: Seen) -> None:
    try:
        from nbmem.ipython.root import session_of
    except ImportError:  # an older checkout (--against), from before the house by capability
        from nbmem.magics import session_of  # type: ignore[import-not-found,no-redef]

    rep = session_of(sh).last_report
    seen.cells += 1
    if rep is None or rep.cell != sh.execution_count - 1:
        seen.errors += (f"no report for cell {sh.execution_count - 1}",)
        return
    seen.truncated += any("scan_budget" in n for n in rep.notes)
    names = [f.name for f in rep.findings]
    seen.with_bag += any(n.startswith("bag") for n in names)
    seen.others += tuple(n for n in names if not n.startswith("bag") and n not in seen.others)
    if rep.error:
        seen.errors += (rep.error,)


def scan_status(sh: InteractiveShell) -> str:
    import nbmem

    lines = str(nbmem.status()).splitlines()
    return "; ".join(ln.removeprefix("scan: ") for ln in lines if ln.startswith("scan: ")) or "no scan yet"


def bench_shape(shape: Shape, dev: str, quick: bool, reps: int) -> None:
    label = shape.label.format(n=shape.size(quick))
    progress(f"{shape.key}: filling ({label})")
    sh = new_shell()
    times: dict[tuple[str, bool], list[float]] = {(k, on): [] for k in KINDS for on in (False, True)}
    seen = {k: Seen() for k in KINDS}
    with Quiet():
        t = time.perf_counter()
        for src, fails in shape.cells(dev, quick):
            cell(sh, src, fails=fails)
        fill_s = time.perf_counter() - t
        for src in KINDS.values():  # warm-up: first-call costs that are not nbmem's
            cell(sh, src)
    progress(f"{shape.key}: filled in {fill_s:.1f} s; {reps} cells of each kind without nbmem")
    with Quiet():
        gc.collect()
        for _ in range(reps):
            for k, src in KINDS.items():
                times[k, False].append(cell(sh, src))
        gc.collect()
        cell(sh, "%load_ext nbmem")
        on_s = cell(sh, "%cudamem on")
        first_s = cell(sh, MOVE)
        first = Seen()
        observe(sh, first)
    progress(f"{shape.key}: `%cudamem on` {on_s * 1e3:.0f} ms, first cell {first_s * 1e3:.0f} ms; {reps} cells with")
    with Quiet():
        for _ in range(reps):
            for k, src in KINDS.items():
                times[k, True].append(cell(sh, src))
                observe(sh, seen[k])
    status = scan_status(sh)
    for k in KINDS:
        on, off = statistics.median(times[k, True]), statistics.median(times[k, False])
        line(f"per-cell overhead, {k}, {label}", f"{(on - off) * 1e3:.2f} ms (median with {on * 1e3:.2f}, "
             f"without {off * 1e3:.2f}, max with {max(times[k, True]) * 1e3:.2f}, n={reps})")
    base = statistics.median(times["memory-moving cell", False])
    line(f"first cell after %cudamem on, {label}",
         f"{(first_s - base) * 1e3:.2f} ms (the `%cudamem on` cell itself: {on_s * 1e3:.2f} ms"
         f"{'; scan truncated' if first.truncated else ''}{'' if first.with_bag else '; `bag` not found'})")
    for k, s in seen.items():
        what = f"truncated in {s.truncated} of {s.cells} {k}s"
        if k == "memory-moving cell":
            what += f"; `bag` found in {s.with_bag} of {s.cells}"
        if s.others:
            what += f"; other findings: {', '.join(s.others[:5])}"
        if s.errors:
            what += f"; problems: {', '.join(dict.fromkeys(s.errors))}"
        line(f"scan, {k}s, {label}", what)
    line(f"scan status after the last cell, {label}", status)
    if shape.key in LEAKS_AT:
        bench_leaks(sh, label)
    with Quiet():
        cell(sh, "%unload_ext nbmem")
    drop(sh)


def bench_leaks(sh: InteractiveShell, label: str, runs: int = 3) -> None:
    import nbmem

    xs, rows = [], 0
    with Quiet():
        for _ in range(runs):
            t = time.perf_counter()
            rows = len(nbmem.leaks())
            xs.append(time.perf_counter() - t)
    status = scan_status(sh)
    m = re.search(r"last holder scan: ([\d,]+) objects", status)
    objects = f", {m.group(1)} objects" if m else ""
    line(f"full nbmem.leaks(), {label}", f"{statistics.median(xs) * 1e3:.0f} ms (min {min(xs) * 1e3:.0f}, "
         f"max {max(xs) * 1e3:.0f}, n={runs}; {rows} rows{objects})")


def drop(sh: InteractiveShell) -> None:
    """Free the shape's memory before the next one: its namespace, outputs, and the failed cell's frames."""
    sh.reset(new_session=False)
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    InteractiveShell.clear_instance()
    gc.collect()
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# -- where a cell's cost goes -------------------------------------------------------------------------------
#: (module, attribute path): nbmem's per-cell work, timed by ``--stages``; nested ones are counted inside their
#: callers too. Those missing from a checkout are left out.
STAGES = [
    ("nbmem.session", "Session.begin_cell"), ("nbmem.session", "Session.end_cell"),
    ("nbmem.session", "Session._publish_holders"),
    ("nbmem.holders.holdings", "Holdings.baseline"), ("nbmem.holders.holdings", "Holdings.mark"),
    ("nbmem.holders.holdings", "Holdings.close_cell"), ("nbmem.holders.holdings", "Holdings._unexplained"),
    ("nbmem.holders.holdings", "Holdings.unattributed"), ("nbmem.holders.holdings", "Holdings.current"),
    ("nbmem.holders.holdings", "Holdings.tensor_bytes"),
    ("nbmem.holders.scanner", "Scanner.update"), ("nbmem.holders.scanner", "Scanner.graphs"),
    ("nbmem.holders.owners", "cell_rows"), ("nbmem.holders.owners", "current_rows"),
    ("nbmem.measure.sources", "Probe.boundary"), ("nbmem.measure.sources", "Probe.allocator"),
    ("nbmem.measure.host", "HeapWatch.bytes"),
]


def stages(shape: Shape, dev: str, quick: bool, reps: int) -> None:
    """Run ``reps`` memory-moving cells with nbmem on and print, per stage of its work, the thread CPU time it
    took per cell (a busy machine stretches wall time, not this), each report step included."""
    import functools
    import importlib

    took: dict[str, list[float]] = {}
    on = [False]

    def timed(name: str, f: Any) -> Any:
        @functools.wraps(f)
        def run(*a: Any, **kw: Any) -> Any:
            t = time.thread_time()
            try:
                return f(*a, **kw)
            finally:
                if on[0]:
                    took.setdefault(name, []).append(time.thread_time() - t)
        return run

    for mod, path in STAGES:
        try:
            owner: Any = importlib.import_module(mod)
            *outer, attr = path.split(".")
            for o in outer:
                owner = getattr(owner, o)
            setattr(owner, attr, timed(path, getattr(owner, attr)))
        except (ImportError, AttributeError):
            continue
    try:
        from nbmem.cells import watch
        watch.REPORT_STEPS = tuple(timed(f"step {f.__name__}", f) for f in watch.REPORT_STEPS)
    except (ImportError, AttributeError):
        pass
    sh = new_shell()
    with Quiet():
        for src, fails in shape.cells(dev, quick):
            cell(sh, src, fails=fails)
        cell(sh, "%load_ext nbmem")
        cell(sh, "%cudamem on")
        for _ in range(3):
            cell(sh, MOVE)
        on[0] = True
        whole = []
        for _ in range(reps):
            t = time.thread_time()
            cell(sh, MOVE)
            whole.append(time.thread_time() - t)
        on[0] = False
        cell(sh, "%unload_ext nbmem")
    label = shape.label.format(n=shape.size(quick))
    line(f"thread CPU per memory-moving cell, the cell included, {label}",
         f"{statistics.median(whole) * 1e3:.2f} ms (median, n={reps})")
    for name, xs in sorted(took.items(), key=lambda kv: -sum(kv[1])):
        line(f"  stage {name}", f"{sum(xs) / reps * 1e3:.2f} ms per cell ({len(xs) / reps:g} calls per cell)")
    drop(sh)


# -- two checkouts side by side ---------------------------------------------------------------------------
PROTOCOL = "@@ "  # a child's answers on its stdout start with this; anything else there is the cells' noise


def serve(shape: Shape, dev: str, quick: bool, reps: int) -> None:
    """A child of ``--against``: fill, time ``reps`` cells of each kind without nbmem, load it, then answer
    each "cell" line on stdin with one memory-moving and one empty cell's times and what the report named."""
    import nbmem

    out = sys.stdout

    def say(**kw: object) -> None:
        print(PROTOCOL + json.dumps(kw), file=out, flush=True)

    def timed(src: str) -> tuple[float, float]:
        """A cell's wall time and the CPU time of the thread that ran it (nbmem's work at the cell's end runs
        there): the second holds still on a machine busy with other work, which stretches the first."""
        c0 = time.thread_time()
        wall = cell(sh, src)
        return wall, time.thread_time() - c0

    sh = new_shell()
    without: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
    with Quiet():
        for src, fails in shape.cells(dev, quick):
            cell(sh, src, fails=fails)
        for src in KINDS.values():
            cell(sh, src)
        gc.collect()
        for _ in range(reps):
            for k, src in KINDS.items():
                without[k].append(timed(src))
        gc.collect()
        cell(sh, "%load_ext nbmem")
        cell(sh, "%cudamem on")
        for src in KINDS.values():  # the first cells after `on` do one-time work
            cell(sh, src)
    say(nbmem=os.path.dirname(os.path.dirname(nbmem.__file__)),
        without={k: [statistics.median(x[i] for x in v) for i in (0, 1)] for k, v in without.items()})
    for request in sys.stdin:
        if request.strip() != "cell":
            break
        seen = Seen()
        with Quiet():
            times = {"memory-moving cell": timed(MOVE)}
            observe(sh, seen)
            times["empty cell"] = timed(EMPTY)
        say(times=times, bag=seen.with_bag, others=list(seen.others), errors=list(seen.errors))


def commit_of(tree: str) -> str:
    r = subprocess.run(["git", "-C", tree, "log", "-1", "--format=%h %cs"], capture_output=True, text=True)
    return r.stdout.strip() or "not a git checkout"


def against(shape: Shape, dev: str, quick: bool, reps: int, other: str) -> None:
    """This checkout's nbmem and ``other``'s in two processes taking turns, one cell each (A B B A ...)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this checkout": here, "other": os.path.abspath(other)}
    names = {"this checkout": f"this checkout ({commit_of(here)}, with its changes)",
             "other": f"{other} ({commit_of(other)})"}
    label = shape.label.format(n=shape.size(quick))
    procs: dict[str, subprocess.Popen[str]] = {}
    for who, tree in trees.items():
        env = {**os.environ, "PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", "")}
        argv = [sys.executable, os.path.abspath(__file__), "--serve", shape.key, "--device", dev, "--reps", str(reps)]
        procs[who] = subprocess.Popen(argv + (["--quick"] if quick else []), env=env, cwd=tree, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def answer(who: str) -> dict:
        stdout = procs[who].stdout
        assert stdout is not None
        for ln in stdout:
            if ln.startswith(PROTOCOL):
                return json.loads(ln[len(PROTOCOL):])
        raise RuntimeError(f"{names[who]}: the child ended without answering (exit {procs[who].wait()})")

    progress(f"{shape.key}: filling two shells, one per checkout ({label})")
    ready = {who: answer(who) for who in procs}
    for who, r in ready.items():
        if os.path.realpath(r["nbmem"]) != os.path.realpath(trees[who]):
            raise RuntimeError(f"{names[who]} imported nbmem from {r['nbmem']}: PYTHONPATH did not pick it")
    progress(f"{shape.key}: {reps} turns of one cell of each kind per checkout")
    got: dict[str, list[dict]] = {who: [] for who in procs}
    for i in range(reps):
        for who in (("this checkout", "other") if i % 2 == 0 else ("other", "this checkout")):
            stdin = procs[who].stdin
            assert stdin is not None
            stdin.write("cell\n")
            stdin.flush()
            got[who].append(answer(who))
    for p in procs.values():
        assert p.stdin is not None
        p.stdin.close()
        p.wait()
    over: dict[tuple[str, str, int], float] = {}
    for who in procs:
        for k in KINDS:
            for i, what in ((0, "wall"), (1, "CPU")):
                xs = [g["times"][k][i] for g in got[who]]
                base = ready[who]["without"][k][i]
                over[who, k, i] = statistics.median(xs) - base
                line(f"per-cell overhead ({what}), {k}, {label}, {names[who]}",
                     f"{over[who, k, i] * 1e3:.2f} ms (median with {statistics.median(xs) * 1e3:.2f}, without "
                     f"{base * 1e3:.2f}, max with {max(xs) * 1e3:.2f}, n={reps})")
        bag = sum(g["bag"] for g in got[who])
        others = sorted({o for g in got[who] for o in g["others"]})
        errors = sorted({e for g in got[who] for e in g["errors"]})
        line(f"holders named, {label}, {names[who]}",
             f"`bag` in {bag} of {reps} memory-moving cells; other names: {', '.join(others) or 'none'}"
             f"{'; problems: ' + ', '.join(errors) if errors else ''}")
    for k in KINDS:
        for i, what in ((0, "wall"), (1, "CPU")):
            old = over["other", k, i]
            ratio = f"{over['this checkout', k, i] / old:.2f}x" if old > 0 else "n/a (no overhead there)"
            line(f"per-cell overhead ratio ({what}), {k}, {label}", f"this checkout / {other}: {ratio}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="shapes 10x smaller and fewer cells, for a smoke run")
    ap.add_argument("--only", default="", help="comma list of shapes: " + ",".join(BY_KEY))
    ap.add_argument("--reps", type=int, default=0, help="cells of each kind, with and without (default 7; 3 quick)")
    ap.add_argument("--against", metavar="DIR", default="",
                    help="another checkout (e.g. `git worktree add /tmp/old 278038b`): its nbmem and this one's, "
                         "side by side on the memory-moving cell (default shape: encoder; reps default 21)")
    ap.add_argument("--stages", action="store_true",
                    help="where this checkout's per-cell cost goes: thread CPU per stage of nbmem's work on the "
                         "memory-moving cell (default shape: encoder; reps default 40)")
    ap.add_argument("--serve", default="", help=argparse.SUPPRESS)  # a child of --against
    a = ap.parse_args()
    if a.serve:
        serve(BY_KEY[a.serve], a.device, a.quick, a.reps or 7)
        return 0
    keys = [k for k in a.only.split(",") if k] or (["encoder"] if a.against or a.stages else list(BY_KEY))
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(BY_KEY)}")
    reps = a.reps or (3 if a.quick else 21 if a.against else 40 if a.stages else 7)
    if a.against and not os.path.isdir(os.path.join(a.against, "nbmem")):
        ap.error(f"--against {a.against}: no nbmem/ there (make one: git worktree add {a.against} 278038b)")

    import IPython
    import torch

    import nbmem

    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda, but torch sees no GPU; use --device cpu")
    env = {"python": sys.version.split()[0], "torch": torch.__version__, "ipython": IPython.__version__,
           "nbmem": nbmem.__version__, "nbmem_from": os.path.dirname(nbmem.__file__),
           "device": a.device, "cpus": os.cpu_count(), "quick": a.quick, "reps": reps,
           "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else None}
    print(json.dumps(env), flush=True)
    print("holder scan cost per cell (with minus without nbmem, medians of interleaved cells)")
    for k in keys:
        if a.stages:
            stages(BY_KEY[k], a.device, a.quick, reps)
        elif a.against:
            against(BY_KEY[k], a.device, a.quick, reps, a.against)
        else:
            bench_shape(BY_KEY[k], a.device, a.quick, reps)
    line("benchmark wall time", f"{time.perf_counter() - T0:.0f} s")
    return print_summary()


if __name__ == "__main__":
    sys.exit(main())
