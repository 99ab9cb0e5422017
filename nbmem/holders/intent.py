"""Intent: what a cell made and meant to keep (its *state*) against what it kept by mistake.

The rule, in one place: a variable is **state** when it reaches training state: an ``nn.Module`` (a model,
or any part of one), an optimizer, an LR scheduler, a gradient scaler, a dataset or a data loader, the
tensors of a module's parameters, buffers or an optimizer's state, or a checkpoint (a dict of tensors keyed
like a module's ``state_dict``). It reaches it through attributes, items, closures or a bound method, never
through an autograd graph: a trainer object holding the model and its optimizer, a list of models, an EMA's
shadow copy, the best weights so far, a ``functools.partial`` or a closure over a model are state. It is
judged from types and keys read without running user code (``reached.state_reached``), never by size or name.
Memory such a variable owns is shown as the cell's state: its bytes and what it holds, with the command
that deletes it by name, but it is never in the one-click cleanup (``%cudamem clean --last-report``, the
report's last line, the gauge's *del*). Outputs in ``Out[]`` and the last traceback are judged by their
object's type alone: clearing them deletes no variable.

Everything else a cell kept is offered: tensors and containers of tensors (the autograd graphs they keep,
the loop's last-iteration leftovers, caches of activations), outputs in ``Out[]`` and the last traceback.
A plain tensor a person means to keep (``X_train``) is offered too, as it was before state was told apart;
what the cleanup deletes is always listed by name before it runs.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

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


#: The words of what a holder reaches, in the order a report lists them.
WORDS = ("model", "optimizer", "LR scheduler", "gradient scaler", "dataset", "data loader", "checkpoint",
         "parameters", "optimizer state")
_ARTICLES = {"model": "a model", "optimizer": "an optimizer", "LR scheduler": "an LR scheduler",
             "gradient scaler": "a gradient scaler", "dataset": "a dataset", "data loader": "a data loader",
             "checkpoint": "a checkpoint"}
#: What a model's state_dict keys end with whatever the model (``fc.weight``, ``bn.running_mean``).
LEAF_NAMES = frozenset({"weight", "bias", "running_mean", "running_var", "num_batches_tracked"})
#: Most parameter names kept from the walks (a 7B Llama has a few hundred).
MAX_NAMES = 200_000


def words(reached: Collection[str]) -> str:
    """A holder's state in words: what it reaches (``holds a model, an optimizer``). A model's parameters and an
    optimizer's state go without saying beside the model and the optimizer."""
    ws = [w for w in WORDS if w in reached]
    if "model" in ws and "parameters" in ws:
        ws.remove("parameters")
    if "optimizer" in ws and "optimizer state" in ws:
        ws.remove("optimizer state")
    return "holds " + ", ".join(_ARTICLES.get(w, w) for w in ws) if ws else ""


class KnownNames:
    """The ``state_dict`` keys of every module the walks met, to tell a checkpoint (a dict of tensors keyed
    like one: ``best = {k: v.clone() for k, v in model.state_dict().items()}``) from a dict of activations."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.leaves: set[str] = set(LEAF_NAMES)

    def add(self, names: Iterable[str]) -> None:
        for n in names:
            if len(self.names) >= MAX_NAMES:
                return
            self.names.add(n)
            leaf = n.rpartition(".")[2]
            if not leaf.isdigit():  # a ParameterList's "0" would make a hook's {"layer1.0": output} a checkpoint
                self.leaves.add(leaf)

    def like_state_dict(self, keys: Collection[str]) -> bool:
        """Whether most of a dict's tensors are keyed as a module's parameters and buffers are: a name a
        module has, or a dotted name ending as one does (``fc.weight``)."""
        hits = sum(1 for k in keys if k in self.names or k in LEAF_NAMES
                   or ("." in k and k.rpartition(".")[2] in self.leaves))
        return bool(keys) and 2 * hits >= len(keys)
