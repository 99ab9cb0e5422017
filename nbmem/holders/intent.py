"""Intent: what a cell made and meant to keep (its *state*) against what it kept by mistake.

The rule, in one place: a variable is **state** when its object is one of the things a training notebook
makes on purpose and keeps across cells: an ``nn.Module`` (a model, or any part of one), an optimizer, an
LR scheduler, a gradient scaler, a dataset or a data loader. It is judged by the object's type alone (its
MRO, read without running user code), never by its size or its name. Memory such a variable owns is shown
as the cell's state: its bytes and what it holds, with the command that deletes it by name, but it is never
in the one-click cleanup (``%cudamem clean --last-report``, the report's last line, the gauge's *del*).

Everything else a cell kept is offered: tensors and containers of tensors (the autograd graphs they keep,
the loop's last-iteration leftovers, caches of activations), outputs in ``Out[]`` and the last traceback.
A plain tensor a person means to keep (``X_train``) is offered too, as it was before state was told apart;
what the cleanup deletes is always listed by name before it runs.
"""

from __future__ import annotations

from nbmem.holders import reach

#: (module, class) of the bases that make a variable state, and the word the report uses for it.
STATE_BASES: dict[tuple[str, str], str] = {
    ("torch.nn.modules.module", "Module"): "model",
    ("torch.optim.optimizer", "Optimizer"): "optimizer",
    ("torch.optim.lr_scheduler", "LRScheduler"): "LR scheduler",
    ("torch.optim.lr_scheduler", "_LRScheduler"): "LR scheduler",
    ("torch.optim.lr_scheduler", "ReduceLROnPlateau"): "LR scheduler",
    ("torch.amp.grad_scaler", "GradScaler"): "gradient scaler",
    ("torch.cuda.amp.grad_scaler", "GradScaler"): "gradient scaler",
    ("torch.utils.data.dataset", "Dataset"): "dataset",
    ("torch.utils.data.dataset", "IterableDataset"): "dataset",
    ("torch.utils.data.dataloader", "DataLoader"): "data loader",
    ("datasets.arrow_dataset", "Dataset"): "dataset",
    ("datasets.iterable_dataset", "IterableDataset"): "dataset",
}


def state_of(t: type) -> str:
    """What state an object of type ``t`` is ("model", "optimizer", ...), or "" when it is not state."""
    try:
        for c in reach.mro(t):
            word = STATE_BASES.get((reach.type_module(c), reach.type_name(c)))
            if word is not None:
                return word
    except Exception:  # a type whose MRO cannot be read is not known to be state: it stays offered
        return ""
    return ""
