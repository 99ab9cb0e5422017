"""The notebook's state is what reaches training state, whatever holds it (issue 46); what a cleanup could not
free is said with who keeps it; a second copy of state is named.

Every expectation here is written by hand from the notebook's source, as its author would label it.
"""

from __future__ import annotations

import re

import pytest
import torch

from nbmem.holders.intent import KnownNames
from nbmem.ipython.root import session_of
from tests.conftest import ok

RAN: list[str] = []  # every hostile hook below appends here; nothing may run while nbmem looks


class Keeper:
    """A user's trainer that runs code on every attribute it does not have, and behind a property."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def __getattr__(self, name: str) -> object:
        RAN.append(f"__getattr__ {name}")
        raise AttributeError(name)

    def __eq__(self, other: object) -> bool:
        RAN.append("__eq__")
        return self is other

    def __hash__(self) -> int:
        RAN.append("__hash__")
        return 1

    def __repr__(self) -> str:
        RAN.append("__repr__")
        return "Keeper"

    @property
    def lr(self) -> float:
        RAN.append("property lr")
        return 0.1


class Shadows(dict):
    """A dict subclass whose own methods run user code."""

    def items(self):  # type: ignore[override]
        RAN.append("items")
        raise RuntimeError

    def __len__(self) -> int:
        RAN.append("__len__")
        raise RuntimeError


def state_of_names(ip) -> dict[str, str]:
    scan = session_of(ip).holdings.last_scan
    assert scan is not None
    return {k: v for k, v in scan.root_state.items() if k.isidentifier()}


def test_whatever_reaches_a_model_optimizer_or_checkpoint_is_state_found_without_running_user_code(ip):
    RAN.clear()
    ip.user_ns.update(Keeper=Keeper, Shadows=Shadows)
    ok(ip, "import functools\nfrom torch import nn\n"
           "keeper = Keeper(nn.Linear(256, 256))\n"
           "keeper.model(torch.randn(4, 256)).sum().backward()\nkeeper.opt.step()\n"
           "models = {'a': [nn.Linear(256, 256)], 'b': None}\n"
           "net = nn.Linear(256, 256)\n"
           "best = Shadows((k, v.detach().clone()) for k, v in net.state_dict().items())\n"
           "ckpt = {'epoch': 3, 'weights': {k: v.clone() for k, v in net.state_dict().items()}}\n"
           "opt_state = keeper.opt.state_dict()\n"
           "bound = net.forward\n"
           "call = functools.partial(print, nn.Linear(256, 256))\n"
           "program = torch.export.export(nn.Linear(256, 256), (torch.randn(2, 256),))\n"
           "acts = {'0': torch.randn(1024, 1024), '1.relu': torch.randn(1024, 1024)}\n"
           "history = [torch.randn(1024, 1024) for _ in range(3)]\n"
           "w = net.weight.repeat(16, 1) * 2\n")
    assert RAN == [], f"user code ran while looking: {RAN}"
    state = state_of_names(ip)
    assert state == {
        "keeper": "holds a model, an optimizer",
        "models": "holds a model",
        "net": "model",
        "best": "holds a checkpoint",
        "ckpt": "holds a checkpoint",
        "opt_state": "holds optimizer state",
        "bound": "holds a model",
        "call": "holds a model",
        "program": "holds a model, a checkpoint",
    }, state
    offered = set(session_of(ip).last_report.last_report_cleanup().names)
    assert offered == {"acts", "history", "w"}, offered


def test_a_checkpoint_is_told_by_its_keys_from_a_dict_of_activations():
    known = KnownNames()
    known.add(["encoder.0.weight", "encoder.0.bias", "head.scale", "lst.0"])
    assert known.like_state_dict(["encoder.0.weight", "encoder.0.bias"])
    assert known.like_state_dict(["weight", "bias"]), "a Linear's own state_dict"
    assert known.like_state_dict(["decoder.9.weight", "decoder.9.scale", "step"]), "dotted names ending as a module's"
    assert not known.like_state_dict(["0", "1.relu", "encoder.0"]), "a forward hook's cache, keyed by module names"
    assert not known.like_state_dict(["layer1.0", "layer2.0"]), "a ParameterList's '0' is no parameter's name"
    assert not known.like_state_dict(["x", "logits", "loss.weight"])
    assert not known.like_state_dict([])


def test_a_cleanup_that_frees_less_names_every_holder_left_and_its_command_frees_the_rest(ip):
    ok(ip, "from torch import nn\n"
           "class Trainer:\n    def __init__(self, model):\n        self.model = model\n"
           "        self.opt = torch.optim.AdamW(model.parameters())\n"
           "model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))\n"
           "trainer = Trainer(model)\nout = model(torch.randn(64, 1024)).sum()\n")
    ok(ip, "out * 1")
    shown = ip.execution_count - 1
    weights = 2 * (1024 * 1024 + 1024) * 4
    ip.run_line_magic("cudamem", "clean model trainer")
    rep = session_of(ip).last_cleanup
    assert rep is not None and rep.freed_allocated_bytes == 0, rep
    by = {x.name: x for x in rep.still_held}
    assert set(by) == {"model", "trainer"}, rep
    for x in by.values():
        assert x.nbytes >= weights and not x.named_by and not x.unnamed_bytes, x
        assert set(x.saved_by) == {"out", f"Out[{shown}]"}, x
    line = str(rep).splitlines()[-1]
    assert "saved by the autograd graphs of `out`, " in line, line
    (cmd,) = re.findall(r"→ `%cudamem clean ([^`]+)` frees it", line)
    assert set(cmd.split()) == {"out", "--outputs"}, line
    ip.run_line_magic("cudamem", f"clean {cmd}")
    after = session_of(ip).last_cleanup
    assert after is not rep and (after.freed_allocated_bytes or 0) >= weights, after
    assert not after.still_held, after


def test_a_second_copy_of_state_names_the_first_one_still_held_with_its_holders(ip):
    ok(ip, "from torch import nn\n"
           "class Trainer:\n    def __init__(self, model):\n        self.model = model\n"
           "        self.opt = torch.optim.AdamW(model.parameters())\n"
           "model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))\n"
           "trainer = Trainer(model)\nmodel(torch.randn(8, 1024)).sum().backward()\ntrainer.opt.step()\n")
    first = ip.execution_count - 1
    ok(ip, "model2 = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))")
    notes = [n for n in session_of(ip).last_report.notes if "second" in n]
    assert len(notes) == 1, session_of(ip).last_report.notes
    note = notes[0]
    assert note.startswith(f"`model2` is a second Sequential: 2.1M parameters: the one cell [{first}] made is "
                           "still held"), note
    assert "by `model`, `trainer`" in note and "`trainer` holds optimizer state" in note, note
    assert note.endswith("`%cudamem clean model trainer` deletes it (32.0 MiB)"), note
    # A different recipe is no second copy; nor is the same one made again once the first is gone.
    ok(ip, "small = nn.Linear(512, 1024)")
    assert not [n for n in session_of(ip).last_report.notes if "second" in n]
    ok(ip, "del model, trainer, model2")
    ok(ip, "model3 = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))")
    assert not [n for n in session_of(ip).last_report.notes if "second" in n]


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_traced_modules_object_arrays_and_frames_holding_tensors_have_rows_found_without_user_code(ip):
    import numpy as np
    import pandas as pd

    RAN.clear()

    class Loud(np.ndarray):
        def __array_finalize__(self, obj: object) -> None:
            if obj is not None:
                RAN.append("__array_finalize__")

    ip.user_ns.update(Loud=Loud, np=np, pd=pd)
    ok(ip, "from torch import nn\n"
           "traced = torch.jit.trace(nn.Linear(1024, 1024), torch.randn(2, 1024))\n"
           "frame = pd.DataFrame({'step': range(4), 'h': [torch.randn(256, 1024) for _ in range(4)]})\n"
           "arr = np.empty(3, dtype=object)\narr[:] = [torch.randn(512, 1024) for _ in range(3)]\n")
    ok(ip, "loud = np.empty(2, dtype=object).view(Loud)\nloud[0] = torch.randn(512, 1024)\n"
           "loud[1] = torch.randn(512, 1024)\n")
    RAN.clear()
    ok(ip, "marker = 1")
    rows = {r.name: r for r in session_of(ip).leak_list()}
    assert RAN == [], f"user code ran while looking: {RAN}"
    assert rows["traced"].state == "model" and rows["traced"].storage_bytes == (1024 * 1024 + 1024) * 4
    assert rows["frame"].storage_bytes == 4 * 256 * 1024 * 4 and not rows["frame"].state
    assert rows["arr"].storage_bytes == 3 * 512 * 1024 * 4 and not rows["arr"].state
    assert rows["loud"].storage_bytes == 2 * 512 * 1024 * 4
