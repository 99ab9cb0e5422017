"""Advice that is safe to follow (issue 37), checked by following it.

Each notebook is one cell, as a first notebook is written: the model, the optimizer and the mistake together.
Its report is read as a user reads it, and then every piece of advice in it is followed in a fresh copy of
the state (the same cells run in a new shell): the one-click cleanup (``--last-report``) must free the leak
and leave every model, optimizer, scheduler, dataset and loader in place; every hint's command must free the
row it is on, and every "frees nothing" must free nothing; the state line must delete the state; counts in
"what" must be the containers' own. ``tests/gpu/test_safe_advice_gpu.py`` runs the same on CUDA.
"""

from __future__ import annotations

import atexit
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from IPython.core.interactiveshell import InteractiveShell

from nbmem.ipython.root import _ACTIVE
from nbmem.records import Finding
from nbmem.reports import CellReport
from tests.conftest import new_shell, ok

MODEL = "model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, {out})).to('{dev}')\n"
#: A trainer of the user's own, as people write one: the model and its optimizer live only inside it.
TRAINER = ("class Trainer:\n    def __init__(self, model):\n        self.model = model\n"
           "        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
           "    def step(self, x):\n        loss = self.model(x).pow(2).mean()\n        loss.backward()\n"
           "        self.opt.step()\n        self.opt.zero_grad()\n        return loss\n")
NOTEBOOKS = {
    # The notebook: a loss kept with its graph, every step, beside the whole training state.
    "train": ("from torch import nn\ntorch.manual_seed(0)\n"
              "model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)).to('{dev}')\n"
              + "opt = torch.optim.Adam(model.parameters(), lr=1e-3)\n"
                "sched = torch.optim.lr_scheduler.StepLR(opt, 10)\n"
                "model(torch.randn(8, 512, device='{dev}')).sum().backward()\nopt.step()\nsched.step()\n"
                "losses = []\nfor step in range(5):\n    x = torch.randn(1024, 512, device='{dev}')\n"
                "    loss = model(x).pow(2).mean()\n    losses.append(loss)\n"),
    # An evaluation without no_grad: the predictions keep a graph that saved the inputs.
    "eval": ("from torch import nn\n" + MODEL.replace("{out}", "10") + "model.eval()\n"
             "x_val = torch.randn(2048, 256, device='{dev}')\npreds = model(x_val)\n"),
    # Activations cached by forward hooks, with their graphs.
    "cache": ("from torch import nn\n" + MODEL.replace("{out}", "256") + "acts = {}\n"
              "def keep(name):\n    def hook(module, inputs, output):\n        acts[name] = output\n    return hook\n"
              "for name, m in model.named_children():\n    m.register_forward_hook(keep(name))\n"
              "out = model(torch.randn(1024, 256, device='{dev}')).sum()\n"),
    # A second name for the model, and outputs kept with their graphs.
    "alias": ("from torch import nn\nmodel = nn.Linear(1024, 1024).to('{dev}')\nnet = model\n"
              "opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)\n"
              "outs = [net(torch.randn(256, 1024, device='{dev}')).relu().sum() for _ in range(3)]\n"),
    # A dataset and its loader, and every batch kept (the loop's last batch is still bound to xb, yb).
    "data": ("from torch.utils.data import DataLoader, TensorDataset\n"
             "X = torch.randn(4096, 128, device='{dev}')\nY = torch.randn(4096, 8, device='{dev}')\n"
             "ds = TensorDataset(X, Y)\ndl = DataLoader(ds, batch_size=512)\nval_batches = []\n"
             "for xb, yb in dl:\n    val_batches.append((xb, yb))\n"),
    # Issue 46: the model and its AdamW state only inside the user's own trainer; predictions kept with graphs.
    "trainer": ("from torch import nn\n" + TRAINER
                + "trainer = Trainer(nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))"
                ".to('{dev}'))\nlosses = [trainer.step(torch.randn(256, 512, device='{dev}')) for _ in range(3)]\n"
                "preds = [trainer.model(torch.randn(1024, 512, device='{dev}')) for _ in range(2)]\n"),
    # The same trainer beside a variable of its model: the trainer's row is the optimizer's state.
    "trainer_and_model": ("from torch import nn\n" + TRAINER
                          + "model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))"
                          ".to('{dev}')\n"
                          "trainer = Trainer(model)\nlast = [trainer.step(torch.randn(512, 512, device='{dev}')) "
                          "for _ in range(2)]\nlogits = model(torch.randn(512, 512, device='{dev}'))\n"),
    # An ensemble in a list, its outputs kept with their graphs.
    "ensemble": ("from torch import nn\nensemble = [nn.Linear(1024, 1024).to('{dev}') for _ in range(3)]\n"
                 "outs = [m(torch.randn(256, 1024, device='{dev}')) for m in ensemble]\n"),
    # An EMA's shadow copy in a plain class, the best weights so far, a partial and a closure over models.
    "copies": ("import functools\nfrom torch import nn\nmodel = nn.Linear(1024, 1024).to('{dev}')\n"
               "class EMA:\n    def __init__(self, model, decay=0.99):\n        self.decay = decay\n"
               "        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}\n"
               "ema = EMA(model)\nbest = {k: v.detach().clone() for k, v in model.state_dict().items()}\n"
               "forward = functools.partial(nn.Linear(1024, 1024).to('{dev}').forward)\n"
               "def make():\n    m = nn.Linear(1024, 1024).to('{dev}')\n    def run(x):\n        return m(x)\n"
               "    return run\nrunner = make()\ny = model(torch.randn(512, 1024, device='{dev}'))\n"),
    # A list of the parameters: an alias on the model's row, never its owner.
    "params": ("from torch import nn\nmodel = nn.Linear(2048, 2048).to('{dev}')\nparams = list(model.parameters())\n"
               "decay = {n: p for n, p in model.named_parameters() if n.endswith('weight')}\n"
               "y = model(torch.randn(256, 2048, device='{dev}'))\n"),
    # No blind spot: a traced module is state; a DataFrame whose cells hold tensors is a leak with a row.
    "traced_frame": ("import pandas as pd\nfrom torch import nn\n"
                     "traced = torch.jit.trace(nn.Linear(1024, 1024).to('{dev}'), "
                     "torch.randn(2, 1024, device='{dev}'))\n"
                     "frame = pd.DataFrame({'step': range(4), 'h': [torch.randn(256, 1024, device='{dev}') "
                     "for _ in range(4)]})\n"),
    # Hugging Face's Trainer built around a model made inline: the model and AdamW's state live only in it.
    "hf_trainer": ("import tempfile\n"
                   "from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments\n"
                   "torch.manual_seed(0)\ncfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, "
                   "num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)\n"
                   "class Tokens(torch.utils.data.Dataset):\n    def __len__(self):\n        return 8\n"
                   "    def __getitem__(self, i):\n        ids = torch.randint(0, 512, (32,))\n"
                   "        return {'input_ids': ids, 'labels': ids}\n"
                   "args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=2, "
                   "per_device_train_batch_size=4, report_to='none', save_strategy='no', logging_strategy='no', "
                   "use_cpu={use_cpu})\n"
                   "trainer = Trainer(model=LlamaForCausalLM(cfg).to('{dev}'), args=args, train_dataset=Tokens())\n"
                   "trainer.train()\nbatch = torch.randint(0, 512, (16, 64), device='{dev}')\n"
                   "out = trainer.model(input_ids=batch, labels=batch)\n"),
}
#: What each notebook's report must offer in one click (exactly), and the state it must keep: written here by
#: hand, as the notebook's author would say it, never taken from nbmem.
OFFERED = {"train": {"losses", "loss", "x"}, "eval": {"preds", "x_val"}, "cache": {"acts", "out"},
           "alias": {"outs"}, "data": {"val_batches", "xb", "yb"}, "trainer": {"preds"},
           "trainer_and_model": {"logits"}, "ensemble": {"outs"}, "copies": {"y"}, "params": {"y"},
           "traced_frame": {"frame"}, "hf_trainer": {"out"}}
STATE = {"train": {"model", "opt", "sched"}, "eval": {"model"}, "cache": {"model"}, "alias": {"model", "net", "opt"},
         "data": {"ds", "dl"}, "trainer": {"trainer"}, "trainer_and_model": {"model", "trainer"},
         "ensemble": {"ensemble"}, "copies": {"model", "ema", "best", "forward", "runner"},
         "params": {"model", "params", "decay"}, "traced_frame": {"traced"}, "hf_trainer": {"trainer"}}
#: Notebooks that need a package the suite may lack, and which.
NEEDS = {"hf_trainer": "transformers"}

ARROW = re.compile(r"→ `%cudamem clean ([^`]+)`")
FREES_IT = re.compile(r"`del (\w+)` frees it")
FREES_NOTHING = re.compile(r"`del (\w+)` frees nothing")
FREES_ONLY = re.compile(r"`del (\w+)` frees only")
COUNT = re.compile(r"^(?:list|tuple|dict|deque|set) of ([\d,]+) (?:new )?(?:scalars|tensors)")


@contextmanager
def notebook(src: str) -> Iterator[InteractiveShell]:
    """A fresh shell (as the ``shell`` fixture makes it), monitored, with the notebook's cell run in it."""
    sh = new_shell()
    try:
        for cell in ("%load_ext nbmem", "%cudamem on", "import torch", src):
            ok(sh, cell)
        yield sh
    finally:
        sh.run_line_magic("unload_ext", "nbmem")
        InteractiveShell.clear_instance()
        atexit.unregister(sh.atexit_operations)  # as the shell fixture does: no exit-time sweep of every shell


def clean(sh: InteractiveShell, args: str) -> int:
    """Bytes a ``%cudamem clean`` gave back (allocated, every device)."""
    before = _ACTIVE[sh].session.last_cleanup
    sh.run_line_magic("cudamem", f"clean {args}")  # shows its table and returns None (nothing lands in Out[])
    rep = _ACTIVE[sh].session.last_cleanup
    assert rep is not None and rep is not before and not rep.errors, rep
    return int(rep.freed_allocated_bytes or 0)


def state_names(sh: InteractiveShell, name: str) -> dict[str, int]:
    """The notebook's state as its author labelled it (``STATE``), by name and identity: those still bound."""
    return {k: id(sh.user_ns[k]) for k in STATE[name] if k in sh.user_ns}


def tensors_in(obj: Any, torch: Any) -> int:
    """Distinct storages in a plain container of tensors: the count a row's "what" must say."""
    seen: set[int] = set()
    todo = [obj]
    while todo:
        o = todo.pop()
        if isinstance(o, torch.Tensor):
            seen.add(o.untyped_storage().data_ptr())
        elif isinstance(o, (list, tuple)):
            todo += o
        elif isinstance(o, dict):
            todo += o.values()
    return len(seen)


def slack(row: Finding) -> int:
    """What a freed figure may fall short of a row's bytes by: none but rounding to CUDA's blocks."""
    return 512 * row.tensors


def follow_every_hint(name: str, dev: str) -> None:
    """Read the notebook's report, then follow each piece of its advice in a fresh copy of its state."""
    if name in NEEDS:
        pytest.importorskip(NEEDS[name], reason=f"the {name} notebook needs {NEEDS[name]}")
    src = NOTEBOOKS[name].replace("{dev}", dev).replace("{use_cpu}", str(dev == "cpu"))
    with notebook(src) as sh:
        sess = _ACTIVE[sh].session
        report = sess.last_report
        assert isinstance(report, CellReport), "a single-cell notebook gets a report"
        rows = report.findings
        assert rows, str(report)
        offered = set(report.last_report_cleanup().names)
        state = state_names(sh, name)
        text = str(report)
        torch = sh.user_ns["torch"]
        # One owner per tensor, counted in full: each container's count is its own, and no name is two rows.
        for r in rows:
            m = COUNT.match(r.description)
            if m and r.name in sh.user_ns:
                assert int(m.group(1).replace(",", "")) == tensors_in(sh.user_ns[r.name], torch), (r.name, text)
        assert len({r.name for r in rows}) == len(rows)
        # The cell report and everything held now agree on the same state.
        now = sess.leak_list()
        assert {(r.name, r.tensors, r.storage_bytes, r.state) for r in rows} == {
            (r.name, r.tensors, r.storage_bytes, r.state) for r in now}, (text, now)
    assert offered == OFFERED[name], text
    assert set(state) == STATE[name] and not offered & set(state), text
    assert {r.name for r in rows if r.state} <= STATE[name], text
    assert f"`%cudamem clean --last-report` would run: {' '.join(report.last_report_cleanup().names)}" in text

    # The one click: frees every leak row, and nothing of the state goes.
    with notebook(src) as sh:
        before = state_names(sh, name)
        freed = clean(sh, "--last-report")
        assert state_names(sh, name) == before, "the one-click cleanup deleted the notebook's state"
        left = [r for r in _ACTIVE[sh].session.leak_list() if not r.state]
        assert not left, f"still held after --last-report: {left}"
        leaks = [r for r in rows if not r.state]
        assert freed >= sum(r.storage_bytes for r in leaks) - sum(slack(r) for r in leaks), (freed, text)

    # Every row's hint: its command frees the row, and "frees nothing" frees nothing.
    followed = 0
    for r in rows:
        cmd = ARROW.search(r.hint)
        alone = FREES_IT.search(r.hint)
        if cmd is not None or alone is not None:
            with notebook(src) as sh:
                freed = clean(sh, cmd.group(1) if cmd is not None else alone.group(1))  # type: ignore[union-attr]
            assert freed >= r.bytes - slack(r), (r.name, r.hint, freed, r.bytes)
            followed += 1
        for claim in (FREES_NOTHING.search(r.hint), FREES_ONLY.search(r.hint)):
            if claim is not None:
                with notebook(src) as sh:
                    freed = clean(sh, claim.group(1))
                limit = slack(r) if claim.re is FREES_NOTHING else r.bytes - 1
                assert freed <= limit, (r.name, r.hint, freed)
    assert followed == len(rows), "every row says what frees it"

    # The state line: deleting the state by name, as the report says.
    line = next((x for x in text.splitlines() if x.startswith("kept as the cell's state")), "")
    assert bool(line) == any(r.state for r in rows), text
    if line:
        (args,) = re.findall(r"`%cudamem clean ([^`]+)` deletes it", line)
        with notebook(src) as sh:
            if "after `%cudamem clean --last-report`" in line:
                clean(sh, "--last-report")
            freed = clean(sh, args)
            assert not state_names(sh, name), "the state line deletes every piece of state"
            assert not [r for r in _ACTIVE[sh].session.leak_list() if r.state], "the state's memory is freed"
        held = [r for r in rows if r.state]
        assert freed >= sum(r.storage_bytes for r in held) - sum(slack(r) for r in held), (freed, line)


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_every_piece_of_advice_is_safe_to_follow(name: str) -> None:
    follow_every_hint(name, "cpu")
