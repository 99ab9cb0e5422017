"""bench_finetune.py's parts past its first slice (issue 48), and what every part shares.

The fit against the real boundary (batch, sequence length, QLoRA ``--on``), the gauge during a long step, the OOM
post-mortem and QLoRA; bench_finetune.py's docstring says what each prints. Every cell runs in the bench's IPython
shell; the bench's own code only reads, times, and frees between parts.
"""

from __future__ import annotations

import cProfile
import gc
import io
import itertools
import os
import pstats
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench_fit import boundary  # benchmarks/ is on sys.path when run as a script
from harness import Quiet, cell, line
from IPython.core.interactiveshell import InteractiveShell

T0 = time.perf_counter()
GiB, MiB = 2**30, 2**20
#: Issue 48's promises for a fit: its time, and its answer against the real boundary (within one below it where
#: the answer is under ``SMALL``: one step of a small value is more than 5 %).
FIT_S, OF_BOUNDARY, SMALL = 30.0, 0.95, 20
#: The batch of the sequence-length fit, and of the training steps elsewhere.
SEQ_BATCH = 2
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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


# -- the notebook's cells ---------------------------------------------------------------------------------------
#: The model's config, made in a cell: the LoRA notebook's and the QLoRA one's.
CONFIG = """
DEV, SEQ = {dev!r}, {s.seq}
config = LlamaConfig(vocab_size={s.vocab}, hidden_size={s.hidden}, intermediate_size={s.intermediate},
                     num_hidden_layers={s.layers}, num_attention_heads={s.heads}, num_key_value_heads={s.heads},
                     max_position_embeddings=4096)
"""

#: One training step, ``{b}`` sequences of ``{s}`` tokens: the cell a fit runs, and the real boundary's step.
STEP_T = """
ids = torch.randint(0, config.vocab_size, ({b}, {s}), device=DEV)
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
opt.step()
opt.zero_grad(set_to_none=True)
"""
STEP = STEP_T.format(b="batch", s="SEQ")
SEQ_STEP = STEP_T.format(b=SEQ_BATCH, s="S")
QSTEP = STEP_T.format(b="B", s="SEQ")

#: A long cell: training steps at batch 2 for ``{secs}`` seconds, the loss read after each (as a loop that logs).
LONG = """
import time
steps, _until = 0, time.monotonic() + {secs}
while time.monotonic() < _until:
    ids = torch.randint(0, config.vocab_size, (2, SEQ), device=DEV)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    last_loss = loss.item()
    steps += 1
"""

#: A step at a batch far too large; names of its own, so what it leaves is its own.
OOM = """
ids_big = torch.randint(0, config.vocab_size, ({b}, SEQ), device=DEV)
loss_big = model(input_ids=ids_big, labels=ids_big).loss
loss_big.backward()
"""

#: Random bf16 weights of the same config, made on the device, saved to local disk (no download).
QSAVE = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
{config}
QDIR = {qdir!r}
torch.manual_seed(0)
_default = torch.get_default_dtype()
torch.set_default_dtype(torch.bfloat16)
try:
    with torch.device(DEV):
        base = LlamaForCausalLM(config)
finally:
    torch.set_default_dtype(_default)
base.save_pretrained(QDIR)
del base
"""

#: QLoRA as the usual notebook does it: 4-bit nf4 weights with double quantization, LoRA on every projection, a
#: paged 8-bit AdamW.
QLOAD = """
import bitsandbytes as bnb
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

model = AutoModelForCausalLM.from_pretrained(
    QDIR, dtype=torch.bfloat16, device_map={{"": {dev_map!r}}},
    quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16))
model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
model = get_peft_model(model, LoraConfig(r=64, lora_alpha=16, lora_dropout=0.05, task_type="CAUSAL_LM",
                                         target_modules={targets!r}))
model.train()
opt = bnb.optim.PagedAdamW8bit([p for p in model.parameters() if p.requires_grad], lr=2e-4)
"""

#: Two steps at batch 2: the optimizer's (paged) state exists before anything is measured.
QTRAIN = """
for step in range(2):
    ids = torch.randint(0, config.vocab_size, (2, SEQ), device=DEV)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""


# -- reading the process ----------------------------------------------------------------------------------------
def cuda(torch: Any) -> bool:
    return bool(torch.cuda.is_available())


def settle(torch: Any) -> None:
    """Garbage collected and the cache emptied: the bench's own, between its measurements."""
    gc.collect()
    if cuda(torch):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def allocated(sh: InteractiveShell) -> int:
    torch = sh.user_ns["torch"]
    if not cuda(torch):
        return 0
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated())


_NVML: list[Any] = []


def nvml_own_used() -> int | None:
    """NVML's per-process used memory for this PID on cuda:0 (pynvml, through nbmem's reader); None: unknown."""
    from nbmem.measure.sources import NvmlSource

    if not _NVML:
        _NVML.append(NvmlSource())
        _NVML[0].start()
    nvml = _NVML[0]
    try:
        return nvml.own_used(0) if nvml.devices else None
    except Exception:  # NVML's figure is optional here: printed as NA
        return None


def whole(v: Any) -> int | None:
    """A frame's byte count as an int; None for NA."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def mib(n: int | None) -> str:
    return "NA" if n is None else f"{n / MiB:,.0f} MiB"


class Captured:
    """What the cells print kept, not shown: what a notebook would show under them (ANSI colours taken out)."""

    text = ""

    def __enter__(self) -> Captured:
        self.out, sys.stdout = sys.stdout, io.StringIO()
        return self

    def __exit__(self, *a: object) -> None:
        buf, sys.stdout = sys.stdout, self.out
        assert isinstance(buf, io.StringIO)
        self.text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", buf.getvalue())


# -- a fit, and the real boundary -------------------------------------------------------------------------------
def trainable_copy(model: Any, opt: Any) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Host copies of the trainable parameters and of the optimizer's state, by parameter name."""
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
        return f"NOT: {len(pa)} -> {len(pb)} trainable tensors, state of {len(sa)} -> {len(sb)} parameters"
    bad = [n for n in pa if not torch.equal(pa[n], pb[n])]
    bad += [f"{n}.{k}" for n in sa for k in sa[n] if k not in sb[n] or not (
        torch.equal(sa[n][k], sb[n][k]) if isinstance(sa[n][k], torch.Tensor) else sa[n][k] == sb[n][k])]
    n_state = sum(len(s) for s in sa.values())
    return (f"bit for bit ({len(pa)} trainable tensors, {n_state} optimizer state entries)" if not bad else
            f"NOT: {len(bad)} differ ({', '.join(bad[:4])})")


class OutOfTime(Exception):
    """The part's time is spent: the bisection stops where it is."""


@dataclass(frozen=True)
class Fit:
    """One ``%%cudamem --fit`` over a training step; its real boundary is where three steps in a row fail."""

    what: str  # in the printed lines
    name: str  # the name the cell binds
    values: str
    body: str
    on: str = ""  # --on SIZE; the truth then runs under the allocator capped at SIZE less this process's context


@dataclass(frozen=True)
class Found:
    answer: int | None = None
    lo: int | None = None  # the largest value that ran three steps in a row
    hi: int | None = None  # the smallest above it that did not


def _record_analyses(what: str) -> Any:
    """With ``NBMEM_BENCH_RECORD=DIR``: each analysis the fit cell makes, its inputs pickled whole (the traces with
    their stacks) to ``DIR/<part>-<k>.pkl.gz``, so the analysis can be timed and changed on a machine without a GPU
    (``bench_analysis.py --pickles``). Returns what undoes it."""
    where = os.environ.get("NBMEM_BENCH_RECORD")
    if not where:
        return lambda: None
    import gzip
    import pickle

    from nbmem.fitting.runs import multigpu

    real = multigpu.analyse
    slug = re.sub(r"[^A-Za-z0-9]+", "-", what).strip("-")
    count = itertools.count()

    from dataclasses import replace as renew

    from nbmem.measure import libraries

    cells = None

    def slim(entries: Any) -> list[Any]:
        # Only the frames the analysis reads (the cell's and the user's own files): the sites come out the same.
        out = []
        for e in entries:
            frames = e.get("frames")
            if frames:
                e = dict(e)
                e["frames"] = [f for f in frames if str(f.get("filename", "")) in cells
                               or libraries.is_user_file(str(f.get("filename", "")))]
            out.append(e)
        return out

    def recording(runs: Any, room: Any, **kw: Any) -> Any:
        nonlocal cells
        t = time.perf_counter()
        res = real(runs, room, **kw)
        took = time.perf_counter() - t
        cells = kw.get("cell_files") or frozenset()
        kept = [renew(r, entries=slim(r.entries)) for r in runs]
        with gzip.open(os.path.join(where, f"{slug}-{next(count):02d}.pkl.gz"), "wb") as fh:
            pickle.dump({"runs": kept, "room": room, "kw": kw, "answer": res.largest_value, "seconds": took}, fh)
        return res

    multigpu.analyse = recording
    return lambda: setattr(multigpu, "analyse", real)


def fit_and_boundary(sh: InteractiveShell, fit: Fit, deadline_s: float) -> Found:
    """The fit, its state and memory checks, then the real boundary from its answer (no try starts after
    ``deadline_s``, counted from the run's start)."""
    from nbmem.ipython.root import session_of

    ns = sh.user_ns
    torch, model, opt = ns["torch"], ns["model"], ns["opt"]
    settle(torch)
    before_state = trainable_copy(model, opt)
    a0 = allocated(sh)
    magic = f"%%cudamem --fit {fit.name}={fit.values}" + (f" --on {fit.on}" if fit.on else "")
    progress(f"{fit.what}: {magic} (allocated {a0 / GiB:.2f} GiB, free {torch.cuda.mem_get_info()[0] / GiB:.2f} GiB)")
    session = session_of(sh)
    prev = session.last_fit
    t_cell, failed = time.perf_counter(), ""
    where = os.environ.get("NBMEM_BENCH_PROFILE")  # a folder: each fit cell's profile, by cumulative time, there
    prof = cProfile.Profile() if where else None
    unrecord = _record_analyses(fit.what)
    try:
        with Quiet():
            if prof is not None:
                prof.enable()
            try:
                cell(sh, magic + "\n" + fit.body.strip())
            finally:
                if prof is not None:
                    prof.disable()
                    slug = re.sub(r"[^A-Za-z0-9]+", "-", fit.what).strip("-")
                    with open(os.path.join(str(where), f"fit-{slug}.txt"), "w") as fh:
                        pstats.Stats(prof, stream=fh).sort_stats("cumulative").print_stats(60)
    except RuntimeError as e:  # the cell failed: said, and the real boundary is still measured
        failed = str(e)
        free_exception(sh)  # its frames may hold the failed run's tensors
    unrecord()
    t_cell = time.perf_counter() - t_cell
    res = session.last_fit if session.last_fit is not prev else None
    gc.collect()
    a1 = allocated(sh)
    back = same(before_state, trainable_copy(model, opt), torch)
    del before_state
    print(str(res), flush=True)
    answer = None if res is None else res.largest_value
    fit_s = res.duration_s if res is not None and res.duration_s is not None else t_cell
    why = "; ".join(x for x in (res.reason if res is not None else "", f"the cell FAILED: {failed[:400]}" if failed
                                else "") if x)
    line(f"{fit.what}: fit's answer", f"{fit.name} {answer} ({res.steps_run if res else 0} steps run"
         f"{'; ' + why if why else ''})")
    line(f"{fit.what}: fit's time", f"{fit_s:.1f} s (the cell {t_cell:.1f} s); target <= {FIT_S:g} s: "
         f"{'NA (no answer)' if answer is None else 'met' if t_cell <= FIT_S else 'NOT met'}")
    line(f"{fit.what}: trainable state after the fit", back)
    line(f"{fit.what}: memory after the fit", f"allocated {a0:,} -> {a1:,} bytes: "
         f"{'back to the byte' if a0 == a1 else f'NOT back ({a1 - a0:+,})'}")
    lo, hi = real_boundary(sh, fit, answer or max(int(v) for v in fit.values.split(",")), deadline_s)
    if answer is not None:
        judge(fit, answer, lo, hi)
    return Found(answer, lo, hi)


def real_boundary(sh: InteractiveShell, fit: Fit, start_value: int, deadline_s: float) -> tuple[int | None,
                                                                                                int | None]:
    """bench_fit's ``boundary()`` from the notebook's state: the step's source in a namespace of its own, three in
    a row per value, only an out-of-memory error counted as a failure, the state put back after each try."""
    from nbmem.clean.release import TorchRelease
    from nbmem.fitting.analysis.devices import parse_on
    from nbmem.fitting.runs.multigpu import give_back_workspaces
    from nbmem.fitting.runs.state import restore_state, snapshot_state
    from nbmem.fitting.runs.torchcheck import is_out_of_memory

    ns = sh.user_ns
    torch, model, opt = ns["torch"], ns["model"], ns["opt"]
    code = compile(fit.body, f"<{fit.what} step>", "exec")
    step_ns: dict[str, Any] = {k: ns[k] for k in ("torch", "model", "opt", "config", "SEQ", "DEV")}
    settle(torch)
    start = snapshot_state([model], [opt])
    src, device = TorchRelease(), torch.cuda.current_device()
    base = allocated(sh)
    cap = None
    if fit.on:
        # A card of that size holds this process's CUDA context too, and the fraction caps only the allocator: the
        # context (NVML's figure for this process beyond what the allocator reserves) comes off the size.
        size = parse_on(fit.on).memory_bytes
        used = nvml_own_used()
        context = max(0, used - int(torch.cuda.memory_reserved(device))) if used is not None else 0
        total = int(torch.cuda.mem_get_info(device)[1])
        # Paged memory is outside the allocator's cap; a card of that size holds it where a step touches it
        # (issue 48: counted as taken, never as room), so it comes off the size like the context.
        paged_bytes = paged()[1]
        cap = (size - context - paged_bytes) / total
        line(f"{fit.what}: the truth's cap", f"set_per_process_memory_fraction(({size / GiB:g} GiB - "
             f"{context / MiB:,.0f} MiB context - {paged_bytes / MiB:,.0f} MiB paged) / {total / GiB:.1f} GiB) = "
             f"{cap:.4f} (NVML's own {mib(used)}, reserved {mib(int(torch.cuda.memory_reserved(device)))})")
    tries: list[tuple[int, bool, float]] = []

    def three_in_a_row(v: int) -> bool:
        if time.perf_counter() - T0 > deadline_s:
            raise OutOfTime
        settle(torch)
        give_back_workspaces(src, {device: base})  # each try starts as the fit left the user
        torch.cuda.empty_cache()
        ok, t = True, time.perf_counter()
        if cap is not None:
            torch.cuda.set_per_process_memory_fraction(cap, device)
        try:
            for _ in range(3):
                exec(code, {**step_ns, fit.name: v})
            torch.cuda.synchronize()
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            ok = False
        finally:
            if cap is not None:
                torch.cuda.set_per_process_memory_fraction(1.0, device)
            restore_state(start)
            settle(torch)
        tries.append((v, ok, time.perf_counter() - t))
        print(f"    {fit.name} {v}: {'ran' if ok else 'out of memory'} ({tries[-1][2]:.1f} s)", flush=True)
        return ok

    t = time.perf_counter()
    try:
        lo, hi = boundary(three_in_a_row, start_value)
        done = ""
    except OutOfTime:
        lo = max((v for v, ok, _ in tries if ok), default=None)
        hi = min((v for v, ok, _ in tries if not ok), default=None)
        done = f"; stopped at the part's time limit ({deadline_s:.0f} s into the run), not bisected to 1 %"
    line(f"{fit.what}: real boundary (three steps in a row{', capped' if cap is not None else ''})",
         f"{fit.name} {lo} runs, {hi} does not ({len(tries)} tries in {time.perf_counter() - t:.0f} s{done})")
    return lo, hi


def judge(fit: Fit, answer: int, lo: int | None, hi: int | None) -> None:
    """The answer against the real boundary: never above it, and at least 95 % of it (one below, under 20)."""
    target = f"never above it and >= {OF_BOUNDARY:.0%} (within one where the answer is under {SMALL})"
    if lo is None:
        said = f"{answer} / none ({hi} does not run)" if hi is not None else f"{answer} / not measured"
        line(f"{fit.what}: answer / boundary", f"{said}; target: {target}: {'NOT met' if hi is not None else 'NA'}")
        return
    r = answer / lo
    ok = answer <= lo and (r >= OF_BOUNDARY or (answer < SMALL and lo - answer <= 1))
    line(f"{fit.what}: answer / boundary", f"{answer} / {lo} = {r:.3f}; target: {target}: "
         f"{'met' if ok else 'NOT met'}")


# -- the gauge during a long step -------------------------------------------------------------------------------
def long_step(sh: InteractiveShell, seconds: float) -> None:
    """A cell that trains for ``seconds``; the sampler's ticks inside it, from the store (``samples()``)."""
    import pandas as pd

    from nbmem.ipython.root import session_of

    session = session_of(sh)
    t0 = time.time()
    with Quiet():
        dt = cell(sh, LONG.format(secs=seconds))
    t1 = time.time()
    df = session.samples()
    start, end = pd.to_datetime(t0, unit="s", utc=True), pd.to_datetime(t1, unit="s", utc=True)
    ticks = sorted(set(df[(df["time"] >= start) & (df["time"] <= end)]["time"]))
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(ticks)]
    steps = int(sh.user_ns.get("steps", 0))
    interval = session.sampler.interval_s
    edges = (f"; the cell's start to the first {(ticks[0] - start).total_seconds():.2f} s, the last to its end "
             f"{(end - ticks[-1]).total_seconds():.2f} s" if ticks else "")
    line("gauge during a long step", f"{len(ticks)} samples in the {dt:.1f} s cell (about {dt / interval:.0f} "
         f"expected); largest gap between consecutive samples {max(gaps, default=float('nan')):.2f} s{edges}; the "
         f"sampler's interval {interval:g} s (Nbmem.interval); {steps} training steps of batch 2, "
         f"{dt / max(steps, 1):.2f} s each")


# -- the OOM post-mortem ----------------------------------------------------------------------------------------
def oom_batch(found: Found | None, shape: Shape, free_bytes: int) -> tuple[int, str]:
    """A batch far too large: 4x the boundary found (or the fit's answer), else twice what an estimate of a step's
    activations says the free memory holds; at most what keeps the largest activation under 2**31 elements."""
    cap = 2**31 // (shape.seq * shape.intermediate)
    known = None if found is None else found.lo or found.answer
    if found is not None and known:
        b, why = 4 * known, f"4 x the {'real boundary' if found.lo else 'fit answer'} ({known})"
    else:
        per = shape.seq * shape.layers * (20 * shape.hidden + 8 * shape.intermediate)  # bytes a sample keeps
        b, why = max(8, 2 * free_bytes // per), f"twice what {free_bytes / GiB:.0f} GiB free holds at ~{mib(per)}" \
                                                  " a sample"
    if b > cap:
        b, why = cap, f"{why}, capped at {cap} (B x SEQ x intermediate under 2**31 elements)"
    return b, why


def post_mortem(sh: InteractiveShell, batch: int, why: str) -> None:
    """A training step at ``batch`` under ``%%cudamem``: what the cell showed, whether nbmem's report names the
    line that failed; then ``%cudamem clean`` of what the failure left, and whether memory is back."""
    from nbmem.ipython.root import session_of

    ns = sh.user_ns
    torch = ns["torch"]
    settle(torch)
    a0 = allocated(sh)
    body = OOM.format(b=batch).strip()
    forward = next(i for i, s in enumerate(body.splitlines(), 1) if "model(" in s)
    session = session_of(sh)
    prev = session.last_report
    progress(f"OOM post-mortem: a step at batch {batch} ({why}) under %%cudamem")
    t = time.perf_counter()
    with Captured() as shown:
        failed = not sh.run_cell("%%cudamem\n" + body, store_history=True).success
    dt = time.perf_counter() - t
    failed_at = _cell_line_failed()
    rep = session.last_report if session.last_report is not prev else None
    lines = shown.text.splitlines()
    at = next((i for i, s in enumerate(lines) if s.startswith("nbmem [")), None)
    mine = lines[at:] if at is not None else []
    error = type(getattr(sys, "last_value", None)).__name__ if failed else "none"
    line("OOM cell", f"batch {batch}: {'failed' if failed else 'did NOT fail'} ({error}) in {dt:.1f} s; it printed "
         f"{len(lines)} lines, {at if at is not None else len(lines)} of them the traceback before nbmem's report"
         f"{'' if mine else ' (no nbmem report found in them)'}")
    print("    --- nbmem's report, first 15 lines ---")
    for s in mine[:15]:
        print(f"    | {s}")
    print(f"    --- ({max(0, len(mine) - 15)} more) ---", flush=True)
    named = next((a for a in (rep.advice if rep is not None else ()) if "asked for by" in a), "")
    m = re.search(r"asked for by line (\d+)", named)
    where = f"failed at line {failed_at} of the cell" if failed else "did not fail"
    line("OOM report names the line", f"{'yes' if m and int(m.group(1)) == failed_at else 'NO'}: the step {where} "
         f"(the forward call is line {forward}); the report says "
         f"{named or 'nothing of the line' if rep is not None else 'nothing (no report)'}")
    if rep is not None:
        from nbmem.records import cleanup_text

        suggested = rep.last_report_cleanup()
        line("OOM report's cleanup", cleanup_text(suggested) if suggested else "none listed")
    names = [n for n in ("ids_big", "loss_big") if n in ns]
    command = f"%cudamem clean {' '.join(names)} --traceback".replace("  ", " ")
    with Captured() as cleaned:
        ok = sh.run_cell(command, store_history=True).success
    settle(torch)
    a1 = allocated(sh)
    print(f"    --- {command} ---")
    for s in cleaned.text.splitlines()[:12]:
        print(f"    | {s}")
    line("memory after the OOM and the cleanup", f"{command}: {'ran' if ok else 'FAILED'}; allocated {a0:,} -> "
         f"{a1:,} bytes: {'back to the byte' if a0 == a1 else f'NOT back ({a1 - a0:+,})'}")
    if a1 != a0:  # the next part starts from what this one found, whatever nbmem's cleanup left
        ns.pop("ids_big", None)
        ns.pop("loss_big", None)
        free_exception(sh)
        settle(torch)
        a2 = allocated(sh)
        line("memory after the bench's own freeing", f"the last exception dropped by the bench: allocated {a2:,} "
             f"bytes: {'back to the byte' if a0 == a2 else f'NOT back ({a2 - a0:+,})'}")


def free_exception(sh: InteractiveShell) -> None:
    """The last exception and its frames let go of, where IPython and ``sys`` keep them (the bench's own code)."""
    for attr in ("last_type", "last_value", "last_traceback", "last_exc"):
        sys.__dict__.pop(attr, None)
    if getattr(sh, "InteractiveTB", None) is not None:
        sh.InteractiveTB.tb = None
    if sh.last_execution_result is not None:
        sh.last_execution_result.error_in_exec = None


def _cell_line_failed() -> int | None:
    """The line of the cell the last exception left: its innermost ``<module>`` frame (the cell's own code)."""
    tb, found = getattr(sys, "last_traceback", None), None
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "<module>":
            found = tb.tb_lineno
        tb = tb.tb_next
    return found


# -- QLoRA --------------------------------------------------------------------------------------------------------
def _holds_torch(v: Any, torch: Any, depth: int = 0) -> bool:
    if isinstance(v, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
        return True
    if depth < 2 and isinstance(v, (list, tuple)):
        return any(_holds_torch(x, torch, depth + 1) for x in v)
    if depth < 2 and isinstance(v, dict):
        return any(_holds_torch(x, torch, depth + 1) for x in v.values())
    return False


def free_notebook(sh: InteractiveShell, what: str) -> None:
    """Every variable that holds a tensor, module or optimizer deleted, the output history and the last exception
    dropped, gc and the cache emptied: the bench's own code, not nbmem's cleanup."""
    ns = sh.user_ns
    torch = ns.get("torch")
    if torch is None:
        return
    a0 = allocated(sh)
    gone = [k for k, v in list(ns.items()) if not k.startswith("_") and k not in sh.user_ns_hidden
            and _holds_torch(v, torch)]
    for k in gone:
        del ns[k]
    sh.displayhook.flush()  # Out[], _N, _, __, ___
    if sh.last_execution_result is not None:
        sh.last_execution_result.result = None
    free_exception(sh)
    settle(torch)
    line(f"{what} freed (del, gc.collect, empty_cache: the bench's own)", f"{', '.join(gone) or 'nothing'} and "
         f"Out[] deleted: allocated {a0 / GiB:.2f} -> {allocated(sh) / GiB:.2f} GiB")


def bnb_missing(sh: InteractiveShell) -> str:
    """'' where the shell can import bitsandbytes; else why not."""
    with Captured():
        r = sh.run_cell("import bitsandbytes as bnb", store_history=True)
    err = r.error_in_exec or r.error_before_exec
    return "" if r.success else f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def paged() -> tuple[int, int]:
    """bitsandbytes' paged tensors (CUDA managed memory, outside torch's allocator): how many, their bytes."""
    f = sys.modules.get("bitsandbytes.functional")
    ts = f.GlobalPageManager.get_instance().paged_tensors if f is not None else []
    return len(ts), sum(int(t.numel()) * int(t.element_size()) for t in ts)


def four_bit(model: Any) -> tuple[int, int, int]:
    """The 4-bit weights: how many, their packed bytes, and their quantization statistics' bytes (each once)."""
    n = packed = 0
    stats: dict[int, int] = {}
    for p in model.parameters():
        if type(p).__name__ != "Params4bit":
            continue
        n, packed = n + 1, packed + int(p.numel()) * int(p.element_size())
        qs = getattr(p, "quant_state", None)
        s2 = getattr(qs, "state2", None)
        for t in (getattr(qs, "absmax", None), getattr(qs, "code", None), getattr(s2, "absmax", None),
                  getattr(s2, "code", None)):
            if t is not None:
                stats[id(t)] = int(t.numel()) * int(t.element_size())
    return n, packed, sum(stats.values())


def qlora_setup(sh: InteractiveShell, shape: Shape, dev: str, qdir: str) -> None:
    """Random bf16 weights saved to ``qdir``, loaded in 4 bits, LoRA and a paged 8-bit AdamW, two steps; what
    nbmem, torch, NVML and bitsandbytes each say the process holds."""
    import nbmem

    with Quiet():
        t_save = cell(sh, QSAVE.format(config=CONFIG.format(dev=dev, s=shape), qdir=qdir))
    settle(sh.user_ns["torch"])
    on_disk = sum(os.path.getsize(os.path.join(qdir, f)) for f in os.listdir(qdir))
    progress(f"QLoRA: random bf16 weights saved in {t_save:.1f} s ({on_disk / GiB:.2f} GiB in {qdir})")
    with Quiet():
        t_load = cell(sh, QLOAD.format(dev_map=0 if dev == "cuda" else "cpu", targets=list(LORA_TARGETS)))
        t_train = cell(sh, QTRAIN)
    ns = sh.user_ns
    torch, model = ns["torch"], ns["model"]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n4, packed, stats = four_bit(model)
    line("QLoRA model", f"{shape.layers} layers, saved in {t_save:.1f} s ({on_disk / GiB:.2f} GiB bf16), loaded in "
         f"4 bits with LoRA r 64 on {len(LORA_TARGETS)} projections and PagedAdamW8bit in {t_load:.1f} s; "
         f"{trainable / 1e6:.1f}M trainable; {n4} Params4bit tensors, {mib(packed)} packed + {mib(stats)} "
         f"quantization statistics; two steps at batch 2 in {t_train:.1f} s")
    settle(torch)
    frame = nbmem.leaks()
    rows = [f"{r['name']} {mib(whole(r['bytes']))}: {r['what']}" for _, r in frame.head(8).iterrows()]
    line("QLoRA: nbmem.leaks() rows (name, bytes, what)", f"{len(frame)}: " + "; ".join(rows))
    n_paged, paged_bytes = paged()
    reserved = int(torch.cuda.memory_reserved()) if cuda(torch) else 0
    line("QLoRA: what holds the GPU", f"torch.cuda.memory_allocated() {mib(allocated(sh))} (reserved "
         f"{mib(reserved)}); NVML's used memory for this PID {mib(nvml_own_used())}; bitsandbytes' paged "
         f"tensors {n_paged}, {mib(paged_bytes)} (numel x element_size; managed memory, outside the allocator)")
