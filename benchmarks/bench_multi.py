"""Every GPU (issue 34): nbmem's fit against the real out-of-memory boundary on two GPUs, and for another GPU.

    PYTHONPATH=. python3 benchmarks/bench_multi.py --only twogpu     # needs 2 GPUs; a few minutes on H100s
    PYTHONPATH=. python3 benchmarks/bench_multi.py --only on         # one GPU; a few minutes on an H100
    PYTHONPATH=. python3 benchmarks/bench_multi.py --only on --out DIR --budget-s 300   # rows also as JSON

``twogpu``: a fit of a body that uses a GPU other than the current one, or both. Each family:

- ``mlp-cuda1``: a 9-layer MLP (4096 wide) and its AdamW on cuda:1, one step already run, while cuda:0 holds a
  big tensor (issue 34's first case);
- ``split-lm``: a small transformer LM in bf16 autocast split by hand, its embeddings and first half of the
  blocks on cuda:0 and the rest and the head on cuda:1, activations moved between them, cuda:0 holding a big
  tensor as well.

``on``: a fit with ``on="16GiB"`` and ``on="24GiB"`` on the whole GPU, for bench_fit's MLP, bf16 and fp32
transformer LMs, CNN with BatchNorm, LSTM and encoder (fresh: model and optimizer made). The truth for that size
is the same bisection on this GPU under ``torch.cuda.set_per_process_memory_fraction((size - context) / total)``,
which caps this process's allocator at that size less this process's CUDA context (NVML's figure beyond the
allocator's): a GPU of that size holds the context too.

- answer: ``nbmem.fitting.runs.runner.fit`` at three small values (warm-up included), state restored afterwards;
- real boundary: the largest value for which the body runs 3 times in a row without CUDA out of memory (on any
  device), by bisection with real OOMs in this process (bench_fit's ``boundary``, to 1 %), the state restored,
  the cache emptied and cuBLAS's workspaces the last try made given back between tries.

The target, per part: never above the real boundary and at most 10 % below it, on every row. A family that
fails prints its error and the others go on; no row starts after ``--budget-s`` and no bisection step starts a
minute after it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_fit import boundary, cuda_or_say, families  # noqa: E402 (benchmarks/ is not a package)

GiB, MiB = 2**30, 2**20
#: A bisection step may still start this long after ``--budget-s``; a row may not.
GRACE_S = 60.0
ON_SIZES = ("16GiB", "24GiB")
ON_FAMILIES = ("mlp", "lm-bf16", "cnn-bn", "lstm", "encoder", "lm-fp32")
PARTS = ("twogpu", "on")


@dataclass
class Row:
    """One family (and, for ``on``, one size): the fit's answer beside the real boundary."""

    part: str
    family: str
    size: str = ""  # the GPU memory asked about (``on``); "" for the GPUs of this machine
    answer: int | None = None
    truth: int | None = None
    truth_hi: int | None = None  # the smallest value above the truth that failed
    limited_by: str = ""  # the device the fit says limits the answer
    t_fit: float | None = None
    t_truth: float | None = None
    memory_back: bool | None = None  # allocated memory on every device the same after the fit as before it
    note: str = ""
    error: str = ""

    @property
    def ratio(self) -> float | None:
        return None if self.answer is None or not self.truth else self.answer / self.truth


class OutOfTime(Exception):
    """The time budget ran out during a row's bisection."""


def judged(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if r.answer is not None and r.truth is not None]


def summary(part: str, rows: Sequence[Row]) -> str:
    """The part's line: never above the real boundary, and how many rows are within 10 % below it."""
    ok = judged([r for r in rows if r.part == part])
    n_rows = sum(r.part == part for r in rows)
    above = [r for r in ok if r.answer is not None and r.truth is not None and r.answer > r.truth]
    within = [r for r in ok if r.answer is not None and r.truth is not None and 0.9 * r.truth <= r.answer <= r.truth]
    never = "NA (no row has both an answer and a real boundary)" if not ok else "no" if above else "yes"
    missing = f" ({n_rows - len(ok)} of {n_rows} rows without both)" if n_rows > len(ok) else ""
    return f"{part}: never above: {never}; within 10 % below: {len(within)} of {len(ok)}{missing}"


def limiting(res: Any) -> str:
    """The device the fit's answer is limited by (its only device where the runs used one)."""
    by = next((f for f in getattr(res, "devices", ()) if f.limits), None)
    return by.label if by is not None else str(res.device)


def measure_row(row: Row, fit_once: Callable[[], Any], ok: Callable[[int], bool], start: int, hard_deadline: float,
                clock: Callable[[], float] = time.perf_counter) -> Any:
    """The fit, then the real boundary searched from its answer (``start`` where it has none); the fit's result."""
    t = clock()
    res = fit_once()
    row.t_fit = clock() - t
    row.answer = res.largest_value
    row.limited_by = limiting(res)
    if res.largest_value is None:
        row.note = f"no prediction: {res.reason}"

    def tried(v: int) -> bool:
        if clock() > hard_deadline:
            raise OutOfTime
        return ok(v)

    t = clock()
    try:
        row.truth, row.truth_hi = boundary(tried, row.answer or start)
    except OutOfTime:
        row.error = "real boundary not found: time budget spent"
    row.t_truth = clock() - t
    return res


def run_plan(plan: Sequence[tuple[Row, Callable[[Row, float], None]]], rows: list[Row], started: float,
             budget_s: float, out: str = "", clock: Callable[[], float] = time.perf_counter,
             after: Callable[[], None] = lambda: None, machine: str = "") -> None:
    """Each row's measurement in turn, printed as it ends; one that fails says why and the next goes on.
    ``after`` runs after each (the GPU's cache emptied)."""
    for row, measure in plan:
        rows.append(row)
        if clock() - started > budget_s:
            row.error = "not run: time budget spent"
        else:
            try:
                measure(row, started + budget_s + GRACE_S)
            except Exception as e:
                first = (str(e).splitlines() or [""])[0][:160]
                row.error = f"{type(e).__name__}: {first}"
                traceback.print_exc()
            finally:
                after()
        print(f"  {line(row)}", flush=True)
        if out:
            write_json(out, rows, machine)


def fmt(n: int | None) -> str:
    return "NA" if n is None else f"{n:,}"


def line(r: Row) -> str:
    what = f"{r.family}{' @ ' + r.size if r.size else ''}"
    ratio = "NA" if r.ratio is None else f"{r.ratio:.3f}"
    times = " ".join(f"{k} {v:.1f}s" for k, v in (("fit", r.t_fit), ("real", r.t_truth)) if v is not None)
    back = "" if r.memory_back is None else f"; memory back: {'yes' if r.memory_back else 'NO'}"
    return (f"{what}: answer {fmt(r.answer)}, real {fmt(r.truth)} (fails at {fmt(r.truth_hi)}), answer/real {ratio}"
            f"{', limited by ' + r.limited_by if r.limited_by else ''}; {times}{back}"
            f"{'; ' + r.note if r.note else ''}{'; ' + r.error if r.error else ''}")


def write_json(out: str, rows: Sequence[Row], machine: str = "") -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_multi.json"), "w") as f:
        json.dump({"machine": machine, "rows": [{**dataclasses.asdict(r), "ratio": r.ratio} for r in rows]}, f,
                  indent=1)


def print_table(part: str, rows: Sequence[Row]) -> None:
    mine = [r for r in rows if r.part == part]
    if not mine:
        return
    head = ("family", "size", "answer", "real (fails at)", "answer/real", "limited by", "t fit", "t real",
            "memory back", "note")
    table = [(r.family, r.size, fmt(r.answer), f"{fmt(r.truth)} ({fmt(r.truth_hi)})",
              "NA" if r.ratio is None else f"{r.ratio:.3f}", r.limited_by,
              *("" if x is None else f"{x:.1f}s" for x in (r.t_fit, r.t_truth)),
              "" if r.memory_back is None else "yes" if r.memory_back else "NO",
              "; ".join(x for x in (r.note, r.error) if x)) for r in mine]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
    print(f"\n{part}:")
    for t in (head, *table):
        print("  ".join(str(x).ljust(w) for x, w in zip(t, widths)).rstrip())


# -- on the GPU -----------------------------------------------------------------------------------------------------
class Gpu:
    """What every row does on the GPU: settle the devices between tries, and the three steps in a row."""

    def __init__(self, torch: Any, fitting: Any) -> None:
        from nbmem.clean.release import TorchRelease

        self.torch, self.fitting, self.src = torch, fitting, TorchRelease()

    def settle(self, devices: Sequence[int]) -> None:
        gc.collect()
        for d in devices:
            self.torch.cuda.synchronize(d)
        self.torch.cuda.empty_cache()

    def allocated(self, devices: Sequence[int]) -> dict[int, int]:
        self.settle(devices)
        return {d: int(self.torch.cuda.memory_allocated(d)) for d in devices}

    def three_in_a_row(self, step: Callable[[int], None], start: Any, ns: dict[str, Any], devices: Sequence[int],
                       before: dict[int, int]) -> Callable[[int], bool]:
        """Whether ``step`` runs 3 times in a row at a value without CUDA out of memory; each try starts as a fit
        leaves the user (state restored, cache emptied, the workspaces an earlier try made given back)."""
        from nbmem.fitting.runs.state import restore_state

        def ok(v: int) -> bool:
            self.settle(devices)
            self.fitting.give_back_workspaces(self.src, before)
            try:
                for _ in range(3):
                    step(v)
                for d in devices:
                    self.torch.cuda.synchronize(d)
                return True
            except Exception as e:
                if not self.fitting.is_out_of_memory(e):
                    raise
                return False
            finally:
                ns.clear()
                restore_state(start)
                self.settle(devices)

        return ok

    def fit_and_truth(self, row: Row, step: Callable[[int], None], values: Sequence[int], ns: dict[str, Any],
                      modules: list[Any], opt: Any, devices: Sequence[int], hard_deadline: float,
                      others: Sequence[Any] = (), on: str | None = None, own_used: Any = None,
                      fraction_of: Callable[[], int] | None = None) -> None:
        """The fit (``on`` another GPU's memory), the memory check, then the real boundary (under a memory
        fraction of ``fraction_of()`` bytes on cuda:0 where given, asked before each try)."""
        from nbmem.fitting.runs.state import snapshot_state

        torch = self.torch
        before = self.allocated(devices)
        start = snapshot_state(modules, [opt], others)

        def fit_once() -> Any:
            unrecord = recording(f"{row.part}-{row.family}-{row.size}")
            try:
                res = self.fitting.fit(step, values, name="batch", clean=ns.clear, modules=modules,
                                       optimizers=[opt], others=others, stacks=True, on=on, own_used=own_used)
            finally:
                unrecord()
            row.memory_back = self.allocated(devices) == before
            print(str(res), flush=True)
            return res

        def limited() -> None:
            if fraction_of is not None:
                torch.cuda.set_per_process_memory_fraction(fraction_of() / torch.cuda.mem_get_info(0)[1], 0)

        ok = self.three_in_a_row(step, start, ns, devices, before)

        def truth(v: int) -> bool:
            limited()
            try:
                return ok(v)
            finally:
                if fraction_of is not None:
                    torch.cuda.set_per_process_memory_fraction(1.0, 0)

        try:
            measure_row(row, fit_once, truth, values[-1], hard_deadline)
        finally:
            self.fitting.give_back_workspaces(self.src, before)  # the last try's, as a fit leaves them


def recording(what: str) -> Callable[[], None]:
    """With ``NBMEM_BENCH_RECORD=DIR``, each analysis the fit makes is pickled there (bench_finetune's recorder),
    so it can be studied and changed without a GPU. Returns what undoes it."""
    if not os.environ.get("NBMEM_BENCH_RECORD"):
        return lambda: None
    from finetune_parts import _record_analyses  # imports IPython, which the other rows do not need

    undo: Callable[[], None] = _record_analyses(what)
    return undo


def hold(torch: Any, device: int, gib: float) -> list[Any]:
    """A big tensor another part of the notebook keeps on ``device`` (at most its free memory less 2 GiB)."""
    free, _ = torch.cuda.mem_get_info(device)
    n = max(0, min(int(gib * GiB), free - 2 * GiB))
    return [torch.empty(n, dtype=torch.uint8, device=f"cuda:{device}")] if n else []


def twogpu_plan(gpu: Gpu, hold_gib: float) -> list[tuple[Row, Callable[[Row, float], None]]]:
    torch = gpu.torch
    nn, F = torch.nn, torch.nn.functional

    def mlp_cuda1(row: Row, hard: float) -> None:
        layers: list[Any] = []
        for _ in range(8):
            layers += [nn.Linear(4096, 4096), nn.GELU()]
        model = nn.Sequential(*layers, nn.Linear(4096, 10)).to("cuda:1")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ns: dict[str, Any] = {}

        def step(b: int) -> None:
            ns["x"] = torch.randn(b, 4096, device="cuda:1")
            ns["y"] = torch.randint(0, 10, (b,), device="cuda:1")
            ns["out"] = model(ns["x"])
            ns["loss"] = F.cross_entropy(ns["out"], ns["y"])
            ns["loss"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step(512)  # one step already run, as in the notebook of issue 34
        ns.clear()
        held = hold(torch, 0, hold_gib)
        row.note = f"cuda:0 holds {sum(h.numel() for h in held) / GiB:.1f} GiB"
        try:
            gpu.fit_and_truth(row, step, (512, 1024, 2048), ns, [model], opt, (0, 1), hard)
        finally:
            held.clear()

    V, D, T, H = 8192, 512, 256, 8

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.ff = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

        def forward(self, x: Any) -> Any:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, H, d // H).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.ff(self.ln2(x))

    class Front(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
            self.blocks = nn.Sequential(*[Block() for _ in range(4)])

        def forward(self, idx: Any) -> Any:
            return self.blocks(self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))

    class Back(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*[Block() for _ in range(4)])
            self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, V)

        def forward(self, h: Any) -> Any:
            return self.head(self.ln(self.blocks(h)))

    def split_lm(row: Row, hard: float) -> None:
        front, back = Front().to("cuda:0"), Back().to("cuda:1")
        opt = torch.optim.AdamW([*front.parameters(), *back.parameters()], lr=1e-4)
        ns: dict[str, Any] = {}

        def step(b: int) -> None:
            ns["x"] = torch.randint(0, V, (b, T + 1), device="cuda:0")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ns["out"] = back(front(ns["x"][:, :-1]).to("cuda:1"))
            ns["loss"] = F.cross_entropy(ns["out"].float().reshape(-1, V), ns["x"][:, 1:].to("cuda:1").reshape(-1))
            ns["loss"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step(8)
        ns.clear()
        held = hold(torch, 0, hold_gib)
        row.note = f"cuda:0 holds {sum(h.numel() for h in held) / GiB:.1f} GiB"
        try:
            gpu.fit_and_truth(row, step, (8, 16, 32), ns, [front, back], opt, (0, 1), hard)
        finally:
            held.clear()

    return [(Row("twogpu", "mlp-cuda1"), mlp_cuda1), (Row("twogpu", "split-lm"), split_lm)]


def on_plan(gpu: Gpu, names: Sequence[str], sizes: Sequence[str]) -> list[tuple[Row, Callable[[Row, float], None]]]:
    from nbmem.fitting.analysis.devices import parse_on
    from nbmem.measure.sources import NvmlSource

    torch = gpu.torch
    fams = families(torch, "cuda:0")
    nvml = NvmlSource()
    nvml.start()

    def own_used(device: int) -> int | None:
        try:
            return nvml.own_used(device)
        except Exception:  # NVML's figure is optional: the fit falls back on the device's own numbers
            return None

    def measure(name: str, size: str) -> Callable[[Row, float], None]:
        def go(row: Row, hard: float) -> None:
            fam = fams[name]
            target = parse_on(size).memory_bytes
            total = torch.cuda.mem_get_info(0)[1]
            if target >= total:
                raise ValueError(f"{size} is not less than this GPU's {total / GiB:.1f} GiB")
            model = fam.make("cuda:0")
            opt = fam.optimizer(model)
            ns: dict[str, Any] = {}

            def step(v: int) -> None:
                fam.body(model, opt, ns, v)

            read: list[int] = []

            def fraction_of() -> int:
                """A GPU of that size holds this process's CUDA context too; the fraction caps only the allocator,
                so the context (NVML's figure for this process beyond what its allocator reserves) comes off the
                size. Read once, at the truth's first try, after the fit's steps: the libraries' kernels they load
                (cuDNN's, 240 MiB for the CNN) are part of it on that GPU too, and a row read before them was 1.5 %
                roomier. Every try has the same cap."""
                if not read:
                    used = own_used(0) if nvml.devices else None
                    context = max(0, used - torch.cuda.memory_reserved(0)) if used is not None else 0
                    row.note = (f"truth: set_per_process_memory_fraction(({target / GiB:g} GiB - "
                                f"{context / MiB:.0f} MiB context) / {total / GiB:.1f} GiB)")
                    read.append(int(target - context))
                return read[0]

            gpu.fit_and_truth(row, step, fam.values, ns, [model], opt, (0,), hard, fam.others(model, opt), on=size,
                              own_used=own_used if nvml.devices else None, fraction_of=fraction_of)

        return go

    return [(Row("on", n, s), measure(n, s)) for n in names for s in sizes]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--only", default=",".join(PARTS),
                    help="comma-separated parts: twogpu (needs 2 GPUs), on (one GPU); default: both")
    ap.add_argument("--budget-s", type=float, default=360.0,
                    help="for the whole run (both parts share it): no row starts after this long, and no "
                         "bisection step a minute after it")
    ap.add_argument("--hold-gib", type=float, default=30.0, help="twogpu: what cuda:0 holds for every family")
    ap.add_argument("--families", default=",".join(ON_FAMILIES), help="on: bench_fit's families to fit")
    ap.add_argument("--sizes", default=",".join(ON_SIZES), help="on: the GPU memory sizes to answer for")
    ap.add_argument("--out", default="", help="a folder for bench_multi.json (the rows), written as they come")
    a = ap.parse_args(argv)
    parts = [p for p in a.only.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        ap.error(f"--only takes {', '.join(PARTS)} (comma-separated); got {a.only!r}")
    import torch

    from nbmem.fitting.runs import runner as fitting

    if not cuda_or_say(torch, fitting, "bench_multi"):
        return 0
    started = time.perf_counter()
    gpu = Gpu(torch, fitting)
    n = torch.cuda.device_count()
    # the devices' properties, not cudaMemGetInfo: that would make a CUDA context on each
    names = ", ".join(f"cuda:{d} {p.name} ({p.total_memory / GiB:.1f} GiB)"
                      for d, p in ((d, torch.cuda.get_device_properties(d)) for d in range(n)))
    machine = f"torch {torch.__version__}; {names}"
    print(machine, flush=True)
    rows: list[Row] = []
    for part in parts:
        if part == "twogpu" and n < 2:
            rows += [Row("twogpu", f, error=f"not run: needs two GPUs, this machine has {n}")
                     for f in ("mlp-cuda1", "split-lm")]
            continue
        if part == "twogpu":
            print(f"twogpu: the real boundary is where 3 steps in a row run out of memory on any device; cuda:0 "
                  f"holds up to {a.hold_gib:g} GiB", flush=True)
            plan = twogpu_plan(gpu, a.hold_gib)
        else:
            print("on: the truth for each size is the same bisection on cuda:0 under "
                  "torch.cuda.set_per_process_memory_fraction((size - this process's CUDA context) / total memory), "
                  "as a card of that size holds the context too (each row's note has the figures)", flush=True)
            plan = on_plan(gpu, [f for f in a.families.split(",") if f], [s for s in a.sizes.split(",") if s])
        used = range(n) if part == "twogpu" else (0,)
        run_plan(plan, rows, started, a.budget_s, a.out, after=functools.partial(gpu.settle, used), machine=machine)
    for part in parts:
        print_table(part, rows)
    if a.out:
        write_json(a.out, rows, machine)
    print("\n=== summary ===")
    for part in parts:
        print(summary(part, rows))
    print(f"bench_multi: {len(rows)} rows in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
