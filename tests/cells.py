"""Notebook cells more than one test file runs (on the CPU in tests/, on a GPU in tests/gpu/)."""

from __future__ import annotations


def checkpointed_training(*, width: int, blocks: int, classes: int, batch: int, device: str, lr: float) -> str:
    """A residual MLP whose blocks recompute their activations in backward (torch.utils.checkpoint), AdamW
    and a GradScaler: the cell that defines ``model``, ``opt``, ``scaler``, ``xb`` and ``yb``."""
    to = ".cuda()" if device == "cuda" else ""
    return f"""
import torch
from torch.utils.checkpoint import checkpoint

class Block(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.up, self.down = torch.nn.Linear(w, 4 * w), torch.nn.Linear(4 * w, w)
    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))

class Net(torch.nn.Module):
    def __init__(self, w={width}, n={blocks}):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(w) for _ in range(n))
        self.head = torch.nn.Linear(w, {classes})
    def forward(self, x):
        for b in self.blocks:  # activations recomputed in backward, not kept
            x = checkpoint(b, x, use_reentrant=False)
        return self.head(x)

torch.manual_seed(0)
model = Net(){to}
opt = torch.optim.AdamW(model.parameters(), lr={lr})
scaler = torch.amp.GradScaler("{device}")
xb = torch.randn({batch}, {width}, device="{device}")
yb = torch.randint(0, {classes}, ({batch},), device="{device}")
"""


def autocast_steps(*, steps: int, device: str, dtype: str) -> str:
    """Training steps of that cell under autocast and the GradScaler, keeping only the loss's value."""
    return f"""
losses = []
for step in range({steps}):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("{device}", dtype=torch.{dtype}):
        out = model(xb)
        loss = torch.nn.functional.cross_entropy(out, yb)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    losses.append(loss.item())
"""
