"""A 7B fine-tune in a notebook, at its real size (issue 48): ``notebooks/finetune-7b.ipynb``'s own cells, found by
their tags and run one by one in a real IPython shell with nbmem, at Llama-2-7B's shape (``NBMEM_FINETUNE_SIZE=7b``),
on one GPU with 70 GiB free (skipped, with the reason, elsewhere). Each test checks one of the issue's promises
against what the GPU itself says: the report's rows and order, the cleanup's bytes, the fit against real steps
(never above the first value that fails, and at least 95 % of the largest that runs), the state put back bit for
bit, the gauge's samples during a long step, the out-of-memory report, bitsandbytes' 4-bit weights and paged
optimizer, and ``--on 24GiB`` against the allocator capped to a 24 GiB card.

Timings are not asserted here: ``benchmarks/bench_finetune.py`` prints them.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import nbmem
from nbmem.ipython.root import session_of
from tests.conftest import last_cell, ok, run

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "finetune-7b.ipynb"
GiB = 2**30
NEED_FREE = 70 * GiB


def _free_bytes() -> int:
    """GPU 0's free memory, asked of NVML (no CUDA context)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free)
    except Exception:
        return 0


FREE = _free_bytes()
pytestmark = pytest.mark.skipif(FREE < NEED_FREE, reason=f"a 7B model in bf16 needs one GPU with 70 GiB free "
                                                          f"({FREE / GiB:.1f} GiB free here)")


def _cells() -> dict[str, str]:
    nb = json.loads(NOTEBOOK.read_text())
    out = {}
    for c in nb["cells"]:
        for tag in c.get("metadata", {}).get("tags", []):
            out[tag] = "".join(c["source"])
    return out


CELLS = _cells()


def _need(module: str) -> None:
    pytest.importorskip(module, reason=f"{module} is not installed: the 7B notebook needs it (scripts/gpu_wheels.sh)")


class Notebook:
    """The notebook's cells in a shell, by tag; ``out`` is what the last one printed."""

    def __init__(self, sh: Any, capsys: pytest.CaptureFixture[str]) -> None:
        self.sh, self.capsys, self.out = sh, capsys, ""

    def __call__(self, *tags: str) -> None:
        for tag in tags:
            self.capsys.readouterr()
            ok(self.sh, CELLS[tag])
            self.out = self.capsys.readouterr().out

    def cell(self, src: str) -> Any:
        self.capsys.readouterr()
        r = run(self.sh, src)
        self.out = self.capsys.readouterr().out
        return r

    @property
    def ns(self) -> dict[str, Any]:
        return self.sh.user_ns


@pytest.fixture
def nb(shell, capsys, monkeypatch) -> Iterator[Notebook]:
    for m in ("transformers", "peft", "bitsandbytes"):
        _need(m)
    monkeypatch.setenv("NBMEM_FINETUNE_SIZE", "7b")
    book = Notebook(shell, capsys)
    book("setup", "settings")
    yield book
    weights = shell.user_ns.get("WEIGHTS")
    if weights:
        import shutil

        shutil.rmtree(weights, ignore_errors=True)
    shell.run_line_magic("cudamem", "off")
    # The namespace and the output history (an Out[n] keeps a graph that reaches 13 GB of weights), and the last
    # exception: a failed test's traceback keeps this shell alive, and the next test must start from nothing.
    shell.reset(new_session=False)
    sys.last_type = sys.last_value = sys.last_traceback = None
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def _planted(nb: Notebook) -> dict[str, int]:
    """Build, LoRA, then the three cells with mistakes: each cell's number by tag."""
    nb("build", "lora")
    cells = {}
    for tag in ("train", "eval-leak", "show"):
        nb(tag)
        cells[tag] = last_cell(nb.sh)
    return cells


def test_each_mistake_is_named_by_its_cell_and_listed_before_the_state(nb):
    cells = _planted(nb)
    # Each cell's own report names its mistake.
    assert "out" in set(nbmem.leaks(cell=cells["train"]).name)
    assert "losses" in set(nbmem.leaks(cell=cells["eval-leak"]).name)
    shown = f"Out[{cells['show']}]"
    assert shown in set(nbmem.leaks(cell=cells["show"]).name)
    nb("report")
    held = nbmem.leaks()
    names = list(held.name)
    assert len(names) <= 8, names
    # The mistakes first, then the state the notebook keeps on purpose.
    assert set(names[:3]) == {"out", "losses", shown} and set(names[3:]) == {"model", "opt"}, names
    model = nb.ns["model"]
    import torch

    # The model's row holds every parameter and buffer once, in the allocator's 512-byte blocks.
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    blocks = sum(-(-n // 512) * 512 for n in storages.values())
    row = held[held.name == "model"].iloc[0]
    assert row.storage_bytes == blocks, (row.storage_bytes, blocks)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == 32 * 4 * 16 * 4096 * 2  # r 16 on q, k, v, o: A [16, 4096] and B [4096, 16]
    assert "6.76B parameters (16.8M trainable)" in row.what, row.what
    assert torch.cuda.memory_allocated() > 0


def test_the_cleanup_frees_what_it_says(nb):
    import torch

    _planted(nb)
    held = nbmem.leaks()
    mistakes = held[held.state == ""]
    before = torch.cuda.memory_allocated()
    nb("cleanup")
    after = torch.cuda.memory_allocated()
    freed = before - after
    rep = session_of(nb.sh).last_cleanup
    # The cleanup's own figure, against the allocator around the whole cell (which measured 3 KiB less on an H100
    # once: the cell's own bookkeeping after the cleanup's last step).
    assert rep is not None and abs(rep.freed_allocated_bytes - freed) <= 64 * 1024, (rep, freed)
    # What the rows said the mistakes hold (their storages and graphs, a shared graph counted once) went.
    assert freed >= 0.95 * mistakes.bytes.sum(), (freed, mistakes[["name", "bytes"]])
    nb("cleanup-check")
    assert {"model", "opt"} <= set(nb.ns)


# -- the fit against real steps ---------------------------------------------------------------------------------
def _trainable(model: Any, opt: Any) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Host copies of the trainable parameters and of the optimizer's state, by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}
    state = {names[id(p)]: {k: v.detach().to("cpu", copy=True) if hasattr(v, "detach") else v for k, v in s.items()}
             for p, s in opt.state.items()}
    return params, state


def _put_back(model: Any, opt: Any, saved: tuple[dict[str, Any], dict[str, dict[str, Any]]]) -> None:
    import torch

    params, state = saved
    by_name = dict(model.named_parameters())
    with torch.no_grad():
        for n, host in params.items():
            by_name[n].copy_(host)
            by_name[n].grad = None
        for n, s in state.items():
            cur = opt.state[by_name[n]]
            for k, v in s.items():
                if hasattr(v, "detach"):
                    cur[k].copy_(v)
                else:
                    cur[k] = v


def _same(a: Any, b: Any) -> list[str]:
    import torch

    (pa, sa), (pb, sb) = a, b
    assert pa.keys() == pb.keys() and sa.keys() == sb.keys()
    bad = [n for n in pa if not torch.equal(pa[n], pb[n])]
    bad += [f"{n}.{k}" for n in sa for k in sa[n] if not (
        torch.equal(sa[n][k], sb[n][k]) if hasattr(sa[n][k], "detach") else sa[n][k] == sb[n][k])]
    return bad


def _three_in_a_row(nb: Notebook, step: str, name: str) -> Callable[[int], bool]:
    """Whether three real steps in a row run at a value, from the notebook's state, put back after each try."""
    import torch

    model, opt = nb.ns["model"], nb.ns["opt"]
    code = compile(step, "<step>", "exec")

    def ok_at(v: int) -> bool:
        saved = _trainable(model, opt)
        space = {**nb.ns, name: v}
        gc.collect()
        torch.cuda.empty_cache()
        try:
            for _ in range(3):
                exec(code, space)
            torch.cuda.synchronize()
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            space.clear()
            opt.zero_grad(set_to_none=True)
            _put_back(model, opt, saved)
            del saved
            gc.collect()
            torch.cuda.empty_cache()

    return ok_at


def _first_failure_above(ok_at: Callable[[int], bool], answer: int, rel: float) -> tuple[int, int]:
    """The largest value that runs and the smallest above the answer that does not (steps of ``rel``, then
    bisected to one): the truth the answer may not pass."""
    lo, hi = answer, None
    step = max(1, int(answer * rel))
    v = answer + step
    while hi is None:
        if ok_at(v):
            lo, v = v, v + step
        else:
            hi = v
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok_at(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def _check_fit(nb: Notebook, tag: str, name: str, step: str, rel: float,
               limit: Callable[[Callable[[int], bool]], Callable[[int], bool]] | None = None) -> None:
    """Run the fit cell ``tag``: its state put back, memory back, and its answer against real steps (the cell's
    ``step`` source, ``name`` bound), under ``limit`` where the truth is another card's."""
    import torch

    model, opt = nb.ns["model"], nb.ns["opt"]
    gc.collect()
    torch.cuda.empty_cache()
    before = _trainable(model, opt)
    allocated = torch.cuda.memory_allocated()
    nb(tag)
    res = session_of(nb.sh).last_fit
    assert res is not None and res.largest_value is not None, nb.out
    gc.collect()
    assert torch.cuda.memory_allocated() == allocated, "memory back to the byte"
    assert _same(before, _trainable(model, opt)) == [], "the trainable state put back bit for bit"
    del before
    answer = res.largest_value
    ok_at = _three_in_a_row(nb, nb.ns[step], name)
    if limit is not None:
        ok_at = limit(ok_at)
    assert ok_at(answer), f"the answer {name}={answer} does not run: {nb.out}"
    runs, fails = _first_failure_above(ok_at, answer, rel)
    assert answer < fails
    assert answer >= 0.95 * runs or (runs < 20 and runs - answer <= 1), (answer, runs, fails, nb.out)
    with nb.capsys.disabled():  # the figures, in the run's output
        print(f"\n{tag}: answer {name}={answer}, runs {runs}, fails {fails} ({answer / runs:.3f}); the fit took "
              f"{res.duration_s:.1f} s")


def test_the_fit_on_the_batch_and_on_the_sequence_length(nb):
    _planted(nb)
    nb("cleanup")  # the mistakes are not what the fit is about: a fresh step's room
    _check_fit(nb, "fit-batch", "B", "STEP", rel=0.0)
    _check_fit(nb, "fit-seq", "S", "STEP_S", rel=0.02)


def test_a_batch_that_does_not_fit_names_its_line(nb):
    import torch

    nb("build", "lora", "train")
    before = torch.cuda.memory_allocated()
    r = nb.cell("ids = torch.randint(0, config.vocab_size, (256, SEQ), device=DEV)\n"
                "loss = model(input_ids=ids, labels=ids).loss\n"
                "loss.backward()\n")
    assert not r.success and type(r.error_in_exec).__name__ == "OutOfMemoryError"
    assert "the allocation that failed was asked for by line 2: loss = model(input_ids=ids, labels=ids).loss" in \
        nb.out, nb.out
    ok(nb.sh, "%cudamem clean --traceback")
    gc.collect()
    # What the failed cell left: its input ids (256 x 512 int64, in one block) and no activation.
    assert torch.cuda.memory_allocated() - before <= 256 * 512 * 8 + 512


def _record_gauge(sh: Any, into: dict[str, Any]) -> None:
    """What the gauge would be sent now, built by the real gauge from the real sampler (run while a cell trains)."""
    from nbmem.ui.widget import Gauge

    session = session_of(sh)
    g = Gauge(session, start=False)
    try:
        g._publisher.put(**g._build())
        g._publisher.flush()
        into["state"] = {k: v for k, v in g.get_state().items() if not k.startswith("_") and k not in (
            "layout", "tabbable", "tooltip", "gauge_id", "placement")}
        into["recorded_on"] = {d.name: d.model for d in session.devices()}
    finally:
        g.close()


def test_the_gauge_samples_through_a_long_step(nb):
    """The sampler keeps its pace while a cell trains for 15 s; with ``NBMEM_RECORD_DIR`` set, what the gauge is
    sent 10 s into that cell (the three mistakes still held) goes to ``gauge-7b.json`` there, which
    ``tests/browser/test_gauge_7b_lab.py`` draws in JupyterLab (no browser runs on the GPU machine)."""
    _planted(nb)
    import threading

    rec: dict[str, Any] = {}
    out = os.environ.get("NBMEM_RECORD_DIR")
    timer = threading.Timer(10.0, _record_gauge, (nb.sh, rec)) if out else None
    t0 = time.time()
    if timer is not None:
        pytest.importorskip("anywidget")
        timer.start()
    ok(nb.sh, "import time\nstart = time.time()\n"
              "while time.time() - start < 15:\n"
              "    ids = torch.randint(0, config.vocab_size, (4, SEQ), device=DEV)\n"
              "    model(input_ids=ids, labels=ids).loss.backward()\n"
              "    opt.zero_grad(set_to_none=True)\n")
    t1 = time.time()
    if timer is not None:
        timer.join()
        assert rec, "the gauge's state was not recorded"
        Path(out, "gauge-7b.json").write_text(json.dumps(rec, default=str))
    s = nbmem.samples()
    import pandas as pd

    secs = (s[s.device == "cuda:0"].time - pd.Timestamp(0, tz="UTC")).dt.total_seconds()
    t = sorted(x for x in secs if t0 <= x <= t1)
    interval = session_of(nb.sh).sampler.interval_s
    gaps = [b - a for a, b in itertools.pairwise(t)]
    assert len(t) >= 0.5 * (t1 - t0) / interval, (len(t), t1 - t0, interval)
    assert max(gaps) <= 4 * interval, max(gaps)


# -- QLoRA -------------------------------------------------------------------------------------------------------
def _paged_bytes() -> int:
    import bitsandbytes.functional as F

    return sum(t.untyped_storage().nbytes() for t in F.GlobalPageManager.get_instance().paged_tensors)


def _own_used() -> int:
    """This process's memory on GPU 0 as NVML lists it per process (CUDA managed memory is not in it)."""
    import pynvml

    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    mine = [int(p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == os.getpid()]
    return mine[0] if mine else _nvml_used()


def _nvml_used() -> int:
    """GPU 0's used memory as the driver counts it (this test's process is the only one there)."""
    import pynvml

    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)


def test_qlora_for_a_24gb_card(nb):
    import torch

    nb("build", "qlora-save")
    ok(nb.sh, "del model")
    gc.collect()
    torch.cuda.empty_cache()
    paged_before = _paged_bytes()
    nb("qlora-load", "qlora-train")
    model = nb.ns["model"]
    # The 4-bit weights are the model's, counted as the weights they stand for, with their true bytes.
    params = 0
    storages: dict[int, int] = {}
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        params += int(torch.Size(qs.shape).numel()) if qs is not None else p.numel()
        storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
        todo = [qs]
        while todo:
            q = todo.pop()
            if q is None:
                continue
            for t in (q.absmax, q.code, getattr(q, "offset", None)):
                if t is not None:
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            todo.append(getattr(q, "state2", None))
    for b in model.buffers():
        storages[b.untyped_storage().data_ptr()] = b.untyped_storage().nbytes()
    held = nbmem.leaks()
    row = held[(held.name == "model") & (held.device == "cuda:0")].iloc[0]
    assert row.storage_bytes == sum(-(-n // 512) * 512 for n in storages.values()), row.what
    assert "in 4 bits (nf4)" in row.what, row.what
    assert f"{params / 1e9:.3g}B parameters" in row.what, (params, row.what)  # three significant digits
    # The paged optimizer's state is named as paged memory, with its bytes.
    paged = _paged_bytes() - paged_before
    assert paged > 0, "PagedAdamW8bit paged nothing: no tensor of 100,000 elements or more trains"
    prow = held[held.device == "paged:cuda:0"]
    assert list(prow.name) == ["opt"] and int(prow.storage_bytes.iloc[0]) == paged, held[["name", "device", "what"]]
    status = str(nbmem.status())
    assert "paged memory on cuda:0" in status and "`opt`" in status, status
    # --on 24GiB against the allocator capped to a 24 GiB card, less this process's CUDA context (what the driver
    # counts beyond the allocator) and the paged memory, which the cap cannot hold and the card would (taken, never
    # room: issue 48).
    total = torch.cuda.mem_get_info()[1]

    def on_24gib(ok_at: Callable[[int], bool]) -> Callable[[int], bool]:
        def capped(v: int) -> bool:
            context = _own_used() - torch.cuda.memory_reserved()  # the CUDA context: managed memory is not in it
            torch.cuda.set_per_process_memory_fraction((24 * GiB - context - paged) / total, 0)
            try:
                return ok_at(v)
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0, 0)

        return capped

    _check_fit(nb, "qlora-fit-on", "B", "STEP", rel=0.0, limit=on_24gib)
    assert "paged optimizer state" in nb.out, nb.out
    # Cleaning up the optimizer says its paged memory is not given back, and NVML agrees.
    used, reserved = _nvml_used(), torch.cuda.memory_reserved()
    nb("qlora-cleanup")
    assert "of paged memory" in nb.out and "never frees" in nb.out, nb.out
    gc.collect()
    torch.cuda.empty_cache()
    # What the GPU gave back is what the allocator gave back: none of the paged memory.
    assert used - _nvml_used() <= reserved - torch.cuda.memory_reserved() + paged // 2, (used, paged)
    assert _paged_bytes() - paged_before == paged  # bitsandbytes' page manager still holds every paged tensor
