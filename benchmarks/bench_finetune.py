"""A 7B fine-tune in a notebook, at its real size (issue 48, its first slice): LoRA in bf16, in one process.

    PYTHONPATH=. python3 benchmarks/bench_finetune.py           # the figures: under 8 minutes on an H100 80GB
    PYTHONPATH=. python3 benchmarks/bench_finetune.py --quick   # 4 of the 32 layers, fewer pairs: a smoke run

One IPython shell (``InteractiveShell.instance()``), ``%load_ext nbmem`` and ``%cudamem on`` first, then the
notebook's cells as a user runs them: a Llama-2-7B-shaped ``LlamaForCausalLM`` from a ``LlamaConfig`` (hidden 4096,
intermediate 11008, 32 layers, 32 heads, vocabulary 32000), random weights made directly on the GPU in bf16 (no
download), LoRA from peft (r 16, alpha 32, on q/k/v/o), AdamW over the trainable parameters, and a hand-written
training step on random token ids (batch B, sequence 512, labels = inputs; no autocast, no gradient
checkpointing). The classic mistakes are planted in cells: the last outputs kept (``out = model(...)``), an
evaluation loop without ``torch.no_grad()`` whose ``losses.append(loss)`` keeps every graph, and a cell that ends
in a CUDA tensor, displayed, so ``Out[]`` keeps it. Then, with all of it in the namespace:

1. per-cell cost: a memory-moving cell (``x = torch.empty(...)``, 4 MiB more, after an untimed ``del x``) with
   ``%cudamem on`` against the same cell with ``%cudamem off``, in interleaved pairs (on then off, off then on),
   one untimed cell after each ``on`` (the first cell after it rescans); the median of the pairs' differences.
   Issue 48's target: at most 5 ms;
2. a full ``nbmem.leaks()``, the median of 5; target: at most 0.5 s. Its owner rows: how many and the first 8,
   and what each planted cell's own report listed, to see whether the mistakes come first;
3. ``%%cudamem --fit batch=1,2,4`` over the training step: its answer and time (target: at most 30 s), whether the
   LoRA parameters and AdamW's state came back bit for bit (``torch.equal`` against host copies) and
   ``torch.cuda.memory_allocated()`` to the byte; then the real boundary, bench_fit's ``boundary()`` from the
   answer: three steps in a row at a value, only ``torch.cuda.OutOfMemoryError`` counted as a failure, the
   training state put back after each try (``snapshot_state``/``restore_state``). Target: the answer never
   above the boundary and at least 95 % of it.

Timings are printed, never asserted. Without CUDA it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from bench_fit import boundary  # benchmarks/ is on sys.path when run as a script
from harness import Quiet, cell, line, new_shell, print_summary
from IPython.core.interactiveshell import InteractiveShell

NEEDS_CUDA = "bench_finetune: needs a CUDA GPU (nothing measured)"
T0 = time.perf_counter()
#: Issue 48's promises.
CELL_MS, LEAKS_S, FIT_S, OWNER_ROWS, OF_BOUNDARY = 5.0, 0.5, 30.0, 8, 0.95


def progress(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


@dataclass(frozen=True)
class Shape:
    """The decoder's shape: Llama-2-7B's, or fewer of its layers for a smoke run."""

    hidden: int = 4096
    intermediate: int = 11008
    layers: int = 32
    heads: int = 32
    vocab: int = 32000
    seq: int = 512


SEVEN_B = Shape()

# -- the notebook's cells ---------------------------------------------------------------------------------------
SETUP = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from peft import LoraConfig, get_peft_model

torch.manual_seed(0)
DEV, SEQ = {dev!r}, {s.seq}
config = LlamaConfig(vocab_size={s.vocab}, hidden_size={s.hidden}, intermediate_size={s.intermediate},
                     num_hidden_layers={s.layers}, num_attention_heads={s.heads}, num_key_value_heads={s.heads},
                     max_position_embeddings=4096)
_default = torch.get_default_dtype()
torch.set_default_dtype(torch.bfloat16)  # random weights made in bf16 where they live: no download, no fp32 copy
try:
    with torch.device(DEV):
        model = get_peft_model(LlamaForCausalLM(config),
                               LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
finally:
    torch.set_default_dtype(_default)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
"""

#: The training step, the cell the fit runs (``batch`` bound); the training loop below is the same step.
STEP = """
ids = torch.randint(0, config.vocab_size, (batch, SEQ), device=DEV)
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
opt.step()
opt.zero_grad(set_to_none=True)
"""

#: Two steps at batch 2; ``out`` keeps the last step's outputs (its logits) after the loop.
TRAIN = """
for step in range(2):
    ids = torch.randint(0, config.vocab_size, (2, SEQ), device=DEV)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""

#: An evaluation loop without ``torch.no_grad()``: each loss appended keeps its graph, activations and all.
EVAL = """
losses = []
for _ in range(2):
    ids = torch.randint(0, config.vocab_size, (1, SEQ), device=DEV)
    loss = model(input_ids=ids, labels=ids).loss
    losses.append(loss)
"""

#: A cell that ends in a CUDA tensor (with its graph): displayed, and kept in ``Out[]``.
SHOW = "model(input_ids=ids[:, :128]).logits.softmax(-1)"

PLANTED = (("train loop (out kept)", TRAIN), ("eval without no_grad (losses kept)", EVAL),
           ("displayed result (Out[])", SHOW))

#: Keeps 4 MiB more; an untimed ``del x`` before each keeps the namespace the same from pair to pair (a list that
#: grows by one tensor a cell makes the scan's work grow with it).
MOVE = "x = torch.empty(4 << 20, dtype=torch.uint8, device=DEV)"


def build(sh: InteractiveShell, dev: str, shape: Shape) -> None:
    """The notebook up to its mistakes, each cell monitored; what each planted cell's report listed."""
    from nbmem.ipython.root import session_of

    with Quiet():
        cell(sh, "%load_ext nbmem")
        cell(sh, "%cudamem on")
    t = cell(sh, SETUP.format(dev=dev, s=shape))
    ns = sh.user_ns
    model, opt = ns["model"], ns["opt"]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    progress(f"model built in {t:.1f} s: {total / 1e9:.2f}B parameters, {trainable / 1e6:.1f}M trainable "
             f"({', '.join(dtypes)}), {len(list(model.parameters()))} parameter tensors")
    line("model", f"LlamaForCausalLM {shape.layers} layers x {shape.hidden} (intermediate {shape.intermediate}, "
         f"{shape.heads} heads, vocab {shape.vocab}) + LoRA r 16 on q/k/v/o: {total / 1e9:.2f}B parameters, "
         f"{trainable / 1e6:.1f}M trainable, {dtypes}; built on {dev} in {t:.1f} s; AdamW over "
         f"{len(opt.param_groups[0]['params'])} tensors")
    for what, src in PLANTED:
        with Quiet():
            t = cell(sh, src)
        rep = session_of(sh).last_report
        holders = [f"{f.name} ({f.bytes / 2**20:,.0f} MiB{', graph' if f.holds_graph else ''})"
                   for f in rep.holders.findings] if rep is not None else ["no report"]
        state = [f.name for f in rep.state.findings] if rep is not None else []
        line(f"report of the {what} cell", f"{len(holders)} holder rows: {', '.join(holders) or 'none'}; "
             f"state: {', '.join(state) or 'none'} ({t:.1f} s)")
    progress(f"mistakes planted; allocated {allocated(sh) / 2**30:.2f} GiB")


def allocated(sh: InteractiveShell) -> int:
    torch = sh.user_ns["torch"]
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated())


# -- 1. per-cell cost --------------------------------------------------------------------------------------------
def per_cell(sh: InteractiveShell, pairs: int, model: str) -> None:
    """``pairs`` interleaved pairs of the memory-moving cell, ``%cudamem on`` against ``off``."""
    with Quiet():
        cell(sh, MOVE)  # warm-up: first-call costs that are not nbmem's
    on_ms: list[float] = []
    off_ms: list[float] = []
    first_ms: list[float] = []
    toggle_ms: list[float] = []
    for i in range(pairs):
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
            with Quiet():
                toggle_ms.append(cell(sh, f"%cudamem {mode}") * 1e3)
                if mode == "on":
                    first_ms.append(cell(sh, MOVE) * 1e3)  # the first cell after `on` rescans: not per-cell cost
                cell(sh, "del x")
                (on_ms if mode == "on" else off_ms).append(cell(sh, MOVE) * 1e3)
        print(f"    pair {i + 1}: on {on_ms[-1]:.2f} ms, off {off_ms[-1]:.2f} ms", flush=True)
    diffs = [a - b for a, b in zip(on_ms, off_ms)]
    d = statistics.median(diffs)
    line(f"per-cell cost, memory-moving cell (keeps 4 MiB more), {model} + LoRA + AdamW in the namespace",
         f"{d:.2f} ms (median of {pairs} pairs' differences; with {statistics.median(on_ms):.2f} ms, without "
         f"{statistics.median(off_ms):.2f} ms; differences min {min(diffs):.2f}, max {max(diffs):.2f}); target <= "
         f"{CELL_MS:g} ms: {'met' if d <= CELL_MS else 'NOT met'}")
    line("first cell after %cudamem on", f"median {statistics.median(first_ms):.1f} ms, max {max(first_ms):.1f} ms "
         f"(the rescan a toggle costs, left out of the pairs); %cudamem on/off itself: median "
         f"{statistics.median(toggle_ms):.1f} ms")
    with Quiet():
        cell(sh, "%cudamem on")
        cell(sh, "del x")


# -- 2. leaks() --------------------------------------------------------------------------------------------------
def leaks(sh: InteractiveShell, runs: int) -> None:
    import nbmem

    xs = []
    frame = None
    with Quiet():
        for _ in range(runs):
            t = time.perf_counter()
            frame = nbmem.leaks()
            xs.append(time.perf_counter() - t)
    m = statistics.median(xs)
    line("full nbmem.leaks()", f"{m:.3f} s (median of {runs}; min {min(xs):.3f}, max {max(xs):.3f}); target <= "
         f"{LEAKS_S:g} s: {'met' if m <= LEAKS_S else 'NOT met'}")
    assert frame is not None
    first = [f"{r['name']} ({int(r['bytes']) / 2**20:,.0f} MiB{', ' + r['state'] if r['state'] else ''}"
             f"{', graph' if r['holds_graph'] else ''})" for _, r in frame.head(OWNER_ROWS).iterrows()]
    line("owner rows of nbmem.leaks()", f"{len(frame)} (target <= {OWNER_ROWS}: "
         f"{'met' if len(frame) <= OWNER_ROWS else 'NOT met'}); first {min(len(frame), OWNER_ROWS)}: "
         f"{'; '.join(first)}")


# -- 3. the fit, and the real boundary ---------------------------------------------------------------------------
def trainable_copy(model: Any, opt: Any) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Host copies of the LoRA parameters and of AdamW's state, by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}
    state = {names[id(p)]: {k: v.detach().to("cpu", copy=True) if hasattr(v, "detach") else v for k, v in s.items()}
             for p, s in opt.state.items()}
    return params, state


def same(a: tuple[dict[str, Any], dict[str, dict[str, Any]]], b: tuple[dict[str, Any], dict[str, dict[str, Any]]],
         torch: Any) -> str:
    """'bit for bit', or what differs."""
    (pa, sa), (pb, sb) = a, b
    if pa.keys() != pb.keys() or sa.keys() != sb.keys():
        return f"NOT: {len(pa)} -> {len(pb)} LoRA tensors, state of {len(sa)} -> {len(sb)} parameters"
    bad = [n for n in pa if not torch.equal(pa[n], pb[n])]
    bad += [f"{n}.{k}" for n in sa for k in sa[n] if k not in sb[n] or not (
        torch.equal(sa[n][k], sb[n][k]) if isinstance(sa[n][k], torch.Tensor) else sa[n][k] == sb[n][k])]
    n_state = sum(len(s) for s in sa.values())
    return (f"bit for bit ({len(pa)} LoRA tensors, {n_state} AdamW state entries)" if not bad else
            f"NOT: {len(bad)} differ ({', '.join(bad[:4])})")


class OutOfTime(Exception):
    """The run's time budget is spent: the bisection stops where it is."""


def fit_and_boundary(sh: InteractiveShell, values: str, budget_s: float) -> None:
    from nbmem.clean.release import TorchRelease
    from nbmem.fitting.runs.multigpu import give_back_workspaces
    from nbmem.fitting.runs.state import restore_state, snapshot_state
    from nbmem.ipython.root import session_of

    ns = sh.user_ns
    torch, model, opt = ns["torch"], ns["model"], ns["opt"]
    gc.collect()
    torch.cuda.empty_cache()
    before_state = trainable_copy(model, opt)
    a0 = allocated(sh)
    progress(f"fit: %%cudamem --fit batch={values} (allocated {a0 / 2**30:.2f} GiB, free "
             f"{torch.cuda.mem_get_info()[0] / 2**30:.2f} GiB)")
    with Quiet():
        t_cell = cell(sh, f"%%cudamem --fit batch={values}\n" + STEP.strip())
    res = session_of(sh).last_fit
    gc.collect()
    a1 = allocated(sh)
    back = same(before_state, trainable_copy(model, opt), torch)
    del before_state
    print(str(res), flush=True)
    answer = None if res is None else res.largest_value
    fit_s = res.duration_s if res is not None and res.duration_s is not None else t_cell
    line("fit's answer", f"batch {answer} ({res.steps_run if res else 0} steps run"
         f"{'; ' + res.reason if res is not None and res.reason else ''})")
    line("fit's time", f"{fit_s:.1f} s (the cell {t_cell:.1f} s); target <= {FIT_S:g} s: "
         f"{'met' if t_cell <= FIT_S else 'NOT met'}")
    line("trainable state after the fit", back)
    line("memory after the fit", f"allocated {a0:,} -> {a1:,} bytes: "
         f"{'back to the byte' if a0 == a1 else f'NOT back ({a1 - a0:+,})'}")
    if answer is None:
        line("real boundary", "not measured: the fit gave no answer")
        return

    # The real boundary from the same notebook state: the step's source in a namespace of its own, three in a row.
    code = compile(STEP, "<training step>", "exec")
    step_ns: dict[str, Any] = {k: ns[k] for k in ("torch", "model", "opt", "config", "SEQ", "DEV")}
    start = snapshot_state([model], [opt])
    src, device = TorchRelease(), torch.cuda.current_device()
    base = allocated(sh)
    tries: list[tuple[int, bool, float]] = []

    def three_in_a_row(v: int) -> bool:
        if time.perf_counter() - T0 > budget_s:
            raise OutOfTime
        gc.collect()
        torch.cuda.empty_cache()
        give_back_workspaces(src, {device: base})  # each try starts as the fit left the user
        torch.cuda.empty_cache()
        ok, t = True, time.perf_counter()
        try:
            for _ in range(3):
                exec(code, {**step_ns, "batch": v})
            torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError:
            ok = False
        finally:
            restore_state(start)
            gc.collect()
            torch.cuda.empty_cache()
        tries.append((v, ok, time.perf_counter() - t))
        print(f"    batch {v}: {'ran' if ok else 'out of memory'} ({tries[-1][2]:.1f} s)", flush=True)
        return ok

    t = time.perf_counter()
    try:
        lo, hi = boundary(three_in_a_row, answer)
        done = ""
    except OutOfTime:
        ran = [v for v, ok, _ in tries if ok]
        failed = [v for v, ok, _ in tries if not ok]
        lo, hi = max(ran, default=None), min(failed, default=None)
        done = f"; stopped at the time budget ({budget_s:.0f} s), not bisected to 1 %"
    t_real = time.perf_counter() - t
    gc.collect()
    torch.cuda.empty_cache()
    line("real boundary (three steps in a row)", f"batch {lo} runs, {hi} does not ({len(tries)} tries in "
         f"{t_real:.0f} s{done})")
    if lo:
        r = answer / lo
        line("answer / boundary", f"{answer} / {lo} = {r:.3f}; target: never above it and >= {OF_BOUNDARY:.0%}: "
             f"{'met' if OF_BOUNDARY <= r <= 1 else 'NOT met'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 of the 32 layers, 6 pairs, 3 leaks() runs")
    ap.add_argument("--pairs", type=int, default=None, help="on/off pairs of the memory-moving cell (default 15)")
    ap.add_argument("--values", default="1,2,4", help="the fit's batch values")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="the bisection stops (and says so) once the run has taken this long")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(NEEDS_CUDA)
        return 0
    shape = replace(SEVEN_B, layers=4) if a.quick else SEVEN_B
    pairs = a.pairs or (6 if a.quick else 15)
    import peft
    import transformers

    print(json.dumps({"python": sys.version.split()[0], "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                      "transformers": transformers.__version__, "peft": peft.__version__, "layers": shape.layers,
                      "pairs": pairs}), flush=True)
    sh = new_shell()
    progress("building the model and planting the mistakes")
    build(sh, "cuda", shape)
    progress(f"per-cell cost: {pairs} pairs")
    per_cell(sh, pairs, "7B" if shape == SEVEN_B else f"{shape.layers}-layer 7B-shaped model")
    progress("full nbmem.leaks()")
    leaks(sh, 3 if a.quick else 5)
    fit_and_boundary(sh, a.values, a.budget_s)
    line("whole run", f"{time.perf_counter() - T0:.0f} s")
    with Quiet():
        cell(sh, "%unload_ext nbmem")
    return print_summary()


if __name__ == "__main__":
    sys.exit(main())
