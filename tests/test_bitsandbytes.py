"""bitsandbytes named as what it is (issue 48): a 4-bit weight is the model's state with the weights its packed
bytes stand for and its true bytes, its statistics part of it; a paged optimizer's state is paged memory, named
apart from PyTorch's allocator, never offered to move, and a cleanup says bitsandbytes never gives it back.

The 4-bit weights are real ``bitsandbytes.nn.Params4bit`` quantized on the CPU (bitsandbytes 0.50 quantizes there).
A real paged tensor needs CUDA managed memory; on the CPU the paged state here has the layout
``bitsandbytes.functional.get_paged`` gives it (a CPU tensor marked ``is_paged`` and ``page_deviceid``), and
``tests/gpu/test_finetune_7b_gpu.py`` checks a real ``PagedAdamW8bit`` on a GPU.
"""

from __future__ import annotations

import sys

import pytest

import nbmem
from nbmem.ipython.root import session_of
from tests.conftest import ok

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (requirements/dev.txt pins it)")

FOUR_BIT = """
import torch, bitsandbytes as bnb
from torch import nn
torch.manual_seed(0)
qmodel = nn.Sequential(*[bnb.nn.Linear4bit(2048, 1024, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                                           compress_statistics=True) for _ in range(3)]).to("cpu")
"""


def _row(name: str):
    frame = nbmem.leaks()
    rows = frame[frame["name"] == name]
    assert len(rows) == 1, frame[["name", "what"]].to_string()
    return rows.iloc[0]


def _quant_bytes(qs) -> int:
    """A QuantState's tensors' bytes, its nested state's too, read from bitsandbytes' own attributes."""
    total = sum(t.untyped_storage().nbytes() for t in (qs.absmax, qs.code) if t is not None)
    if getattr(qs, "offset", None) is not None:
        total += qs.offset.untyped_storage().nbytes()
    if getattr(qs, "state2", None) is not None:
        total += _quant_bytes(qs.state2)
    return total


def test_four_bit_weights_are_counted_as_the_weights_they_stand_for(ip):
    ok(ip, FOUR_BIT)
    qmodel = ip.user_ns["qmodel"]
    w = qmodel[0].weight
    assert type(w).__name__ == "Params4bit" and w.numel() == 2048 * 1024 // 2  # two weights a byte
    row = _row("qmodel")
    # The parameters are the layers' 3 x 1024 x 2048 weights, not the packed bytes' element count.
    assert "6.29M parameters" in row["what"], row["what"]
    assert "in 4 bits (nf4)" in row["what"] and "frozen" in row["what"]
    # The statistics (absmax, the code table, the nested state) are part of the weights, not "other tensors".
    assert "other tensor" not in row["what"], row["what"]
    true_bytes = sum(m.weight.untyped_storage().nbytes() + _quant_bytes(m.weight.quant_state) for m in qmodel)
    assert row["storage_bytes"] == true_bytes
    # bitsandbytes' `weight.module` points back at the layer: no second path through it.
    assert not any(".module." in h for h in row["holders"]), row["holders"]
    assert row["state"] == "model" and row["device"] == "cpu"


def test_one_four_bit_weight_reads_as_its_shape_and_format(ip):
    ok(ip, FOUR_BIT + "w = qmodel[1].weight\ndel qmodel")
    row = _row("w")
    assert "2.1M parameters (frozen), in 4 bits (nf4)" in row["what"], row["what"]  # 2048 x 1024


def test_lora_over_four_bit_layers_says_which_part_is_trained(ip):
    peft = pytest.importorskip("peft", reason="peft is not installed (requirements/dev.txt pins it)")
    ok(ip, FOUR_BIT + """
from peft import LoraConfig, get_peft_model
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = qmodel[0]
        self.out = qmodel[1]
qlora = get_peft_model(Net(), LoraConfig(r=8, target_modules=["proj", "out"]))
del qmodel
""")
    assert peft.__version__
    row = _row("qlora")
    lora = 8 * (2048 + 1024) * 2  # A [8, 2048] and B [1024, 8] on each of the two layers
    frozen = 2 * 2048 * 1024
    assert (lora, frozen) == (49_152, 4_194_304)
    assert "4.24M parameters (49.2K trainable), 4.19M of them in 4 bits (nf4)" in row["what"], row["what"]


PAGED = """
import torch
from torch import nn
net = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
opt = torch.optim.AdamW(net.parameters())
def paged(shape, dtype):  # bitsandbytes.functional.get_paged's marks, over plain memory
    t = torch.zeros(shape, dtype=dtype)
    t.is_paged = True
    t.page_deviceid = 0
    return t
for p in net.parameters():
    opt.state[p]["state1"] = paged(p.shape, torch.uint8)
    opt.state[p]["state2"] = paged(p.shape, torch.uint8)
import types, sys
# bitsandbytes' page manager keeps every paged tensor it made, so deleting the optimizer frees none of it
pager = types.ModuleType("pager")
pager.paged_tensors = [s[k] for s in opt.state.values() for k in ("state1", "state2")]
sys.modules["pager"] = pager
del p, pager
"""


@pytest.fixture
def pager():
    """The stand-in page manager's module goes with the test (sys.modules outlives the shell)."""
    yield
    sys.modules.pop("pager", None)


def test_paged_optimizer_state_is_named_as_paged_memory(ip, pager):
    ok(ip, PAGED)
    expected = sum(2 * p.numel() for p in ip.user_ns["net"].parameters())  # two uint8 buffers a parameter
    frame = nbmem.leaks()
    paged = frame[frame["device"] == "paged:cuda:0"]
    assert list(paged["name"]) == ["opt"], frame[["name", "device", "what"]].to_string()
    row = paged.iloc[0]
    assert row["storage_bytes"] == expected
    assert "paged memory (CUDA managed memory, outside PyTorch's allocator)" in row["what"]
    assert "optimizer state (8 tensors)" in row["what"]  # two a parameter, four parameters
    assert "never frees" in row["hint"] and "`del opt` gives none of it back" in row["hint"]
    # The model's own row stays on the CPU, its bytes not mixed with the paged ones.
    assert (frame[frame["name"] == "net"]["device"] == "cpu").all()
    status = str(session_of(ip).status())
    line = next(x for x in status.splitlines() if x.startswith("paged memory on cuda:0"))
    assert "`opt`" in line and "never frees it" in line
    from nbmem.ui.widget import can_move_to_cpu
    rows = session_of(ip).holdings.current().owners
    assert not any(can_move_to_cpu(f) for f in rows if f.owner == "opt")


def test_cleaning_a_paged_optimizer_says_nothing_came_back(ip, pager):
    ok(ip, PAGED)
    expected = sum(2 * p.numel() for p in ip.user_ns["net"].parameters())
    nbmem.leaks()
    rep = nbmem.cleanup(["opt"])
    text = str(rep)
    assert "opt" not in ip.user_ns
    assert f"{nbmem.formatting.fmt_bytes(expected)} of paged memory" in text, text
    assert "bitsandbytes never frees" in text


def test_no_paged_memory_no_status_line(ip):
    ok(ip, "import torch\nx = torch.zeros(1 << 20)")
    nbmem.leaks()
    assert "paged memory" not in str(session_of(ip).status())
