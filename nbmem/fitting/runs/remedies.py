"""The measured remedies: what lets a wanted value that does not fit run, found by running the body again.

Activation checkpointing and bf16 autocast are measured: a fit's runs again under each, undone after. The
remedies modelled from the fit's own runs, with nothing run again (gradient accumulation, expandable segments),
and the ``Remedy`` record every remedy is reported in, are ``analysis.modelled``.

When the wanted value does not fit, ``runner.fit`` runs the body's small runs again with one remedy applied,
and the same analysis predicts the largest value under it (never above the real boundary, as for the plain
fit). What a remedy is, and whether it can be applied, is decided here, without running the body:

- *activation checkpointing*: a Hugging Face model through its own switch (``activation_checkpointing_enable``
  in newer transformers, ``gradient_checkpointing_enable`` before; non-reentrant); any other model where it
  has repeated blocks (two or more modules in a row of one type that have modules of their own, in a
  ``ModuleList`` or ``Sequential``, also next to other modules there, which are left as they are), each block's
  ``forward`` wrapped in ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` while gradients are on;
- *bf16 autocast*: the body run inside ``torch.autocast("cuda", dtype=torch.bfloat16)``, where the model's
  parameters are fp32, no gradient scaler says it already trains in fp16, and the device supports bf16.

A remedy that cannot be applied is a line that says why, never a guess. One that is applied changes only
attributes of the model's modules (an instance ``forward``, Hugging Face's ``gradient_checkpointing`` flags,
its hooks): each module's attributes, hook tables and config are copied before and put back after, also
after a failure, so afterwards the model is the object it was (its training state is the fit's to put back).
Modules and scalers are the ones the fit was handed; their types are read, and only torch's own methods and
Hugging Face's documented switch are called on them.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from nbmem.holders import reach

CHECKPOINTING = "activation checkpointing"
BF16 = "bf16 autocast"
#: A remedy is listed only where it allows at least this much more than the plain fit (else it is no remedy).
MIN_GAIN = 1.05

Run = Callable[[int], object]


@dataclass
class Candidate:
    """A remedy that can be applied to this body: what it is called, what the user would write, and how the fit
    applies it for its runs (``applied``) and runs the body under it (``wrap``)."""

    name: str
    setting: str
    modules: Sequence[Any]  # whose attributes are put back after
    enter: Callable[[], None] = lambda: None
    leave: Callable[[], None] = lambda: None
    wrap: Callable[[Run], Run] = lambda run: run
    _undo: list[Any] = field(default_factory=list, repr=False)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The remedy on for the block's duration; the modules' attributes as they were afterwards, whatever
        happened (``leave`` is the library's own way back, and the copy is put back after it as well)."""
        saved = _module_attrs(self.modules)
        try:
            self.enter()
            yield
        finally:
            try:
                self.leave()
            finally:
                _put_module_attrs_back(saved)


def candidates(torch: Any, modules: Sequence[Any], others: Sequence[Any]) -> tuple[list[Candidate], list[str]]:
    """The remedies that can be measured for a body that trains ``modules`` (with ``others``: schedulers,
    scalers), and a line for each that cannot, saying why. Never starts CUDA."""
    tops = top_modules(torch, modules)
    out: list[Candidate] = []
    why: list[str] = []
    for make in (checkpointing, bf16_autocast):
        got = make(torch, tops, others)
        if isinstance(got, str):
            why.append(got)
        else:
            out.append(got)
    return out, why


def top_modules(torch: Any, modules: Sequence[Any]) -> list[Any]:
    """The modules that are no other one's submodule, in the order given (a model, not its layers too)."""
    module = torch.nn.Module
    mods = [m for m in modules if reach.derives(type(m), module)]
    inner: set[int] = set()
    for m in mods:
        inner.update(id(s) for s in m.modules() if s is not m)
    seen: set[int] = set()
    out = []
    for m in mods:
        if id(m) not in inner and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


# -- activation checkpointing ------------------------------------------------------------------------------------
def checkpointing(torch: Any, tops: Sequence[Any], others: Sequence[Any] = ()) -> Candidate | str:
    """Activation checkpointing of the models' repeated blocks, or why it cannot be applied."""
    left = f"{CHECKPOINTING} left out"
    if not tops:
        return f"{left}: no model (a torch.nn.Module) was found in what the body uses"
    if any(is_compiled(m) for top in tops for m in top.modules()):
        return f"{left}: the model is torch.compile'd, and wrapping its blocks would make it compile again"
    hf = [m for m in tops if _hf_checkpointable(m)]
    if hf:
        if any(_static(s, "gradient_checkpointing", False) is True for m in hf for s in m.modules()):
            return f"{left}: the Hugging Face model already has gradient checkpointing on"
        names = ", ".join(reach.type_name(type(m)) for m in hf)
        # newer transformers call it activation checkpointing (the old name warns); before, gradient checkpointing
        word = "activation" if all(callable(_static(m, "activation_checkpointing_enable", None)) for m in hf) else (
            "gradient")

        def enable() -> None:
            for m in hf:
                getattr(m, f"{word}_checkpointing_enable")(**{f"{word}_checkpointing_kwargs": {"use_reentrant": False}})

        def disable() -> None:
            for m in hf:
                getattr(m, f"{word}_checkpointing_disable")()

        return Candidate(CHECKPOINTING, f"model.{word}_checkpointing_enable({word}_checkpointing_kwargs="
                         f"{{'use_reentrant': False}}) ({names})", tops, enable, disable)
    found = [(top, path, blocks) for top in tops for path, blocks in repeated_blocks(torch, top)]
    if not found:
        names = ", ".join(reach.type_name(type(m)) for m in tops)
        return (f"{left}: {names} has no repeated blocks (two or more of one block type in a row in a ModuleList or "
                "Sequential) to checkpoint")
    if any(_already_checkpointed(b) for _, _, blocks in found for b in blocks):
        return f"{left}: its blocks' forward is already replaced (checkpointed or patched by the notebook)"
    ckpt = importlib.import_module("torch.utils.checkpoint").checkpoint
    where = "; ".join(f"each of the {len(b)} {reach.type_name(type(b[0]))} in "
                      f"{reach.type_name(type(top))}{'.' + path if path[:1].isalnum() else path}"
                      for top, path, b in found)

    def wrap_blocks() -> None:
        for _, _, blocks in found:
            for b in blocks:
                object.__setattr__(b, "forward", _checkpointed(torch, ckpt, b.forward))

    return Candidate(CHECKPOINTING, f"torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) around "
                     f"{where}", tops, wrap_blocks)


def repeated_blocks(torch: Any, top: Any) -> list[tuple[str, list[Any]]]:
    """The outermost runs, in the ``ModuleList``s and ``Sequential``s under ``top`` (itself included), of two or more
    modules in a row of one type that have submodules of their own: (their path under ``top``, their blocks). A
    list of blocks only is one run at the list's path; a run next to other modules (a GPT's embedding, blocks,
    norm and head in one ``Sequential``) has the slice of the list it is, ``[1:7]``, and the rest is left out."""
    nn = torch.nn
    out: list[tuple[str, list[Any]]] = []
    taken: set[int] = set()
    for path, m in top.named_modules():
        if id(m) in taken or not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        kids = list(m.named_children())
        for start, end in _runs(kids, taken):
            blocks = [k for _, k in kids[start:end]]
            out.append((path if end - start == len(kids) else path + _slice(kids[start][0], kids[end - 1][0]), blocks))
            taken.update(id(s) for b in blocks for s in b.modules())
    return out


def _runs(kids: Sequence[tuple[str, Any]], taken: set[int]) -> list[tuple[int, int]]:
    """Where in ``kids`` two or more in a row are of one type, have submodules, and are in no run already (a block
    shared by two lists is checkpointed once): ``(start, end)`` of each."""
    out = []
    start = 0
    while start < len(kids):
        end = start + 1
        kind = type(kids[start][1])
        if id(kids[start][1]) not in taken and next(kids[start][1].children(), None) is not None:
            while end < len(kids) and type(kids[end][1]) is kind and id(kids[end][1]) not in taken:
                end += 1
        if end - start >= 2:
            out.append((start, end))
        start = end
    return out


def _slice(first: str, last: str) -> str:
    """Where a run sits in its list: ``[1:7]`` (as ``model[1:7]`` reads it), or by name in a ``Sequential`` of an
    ``OrderedDict``."""
    return f"[{first}:{int(last) + 1}]" if first.isdigit() and last.isdigit() else f"[{first!r} to {last!r}]"


def _checkpointed(torch: Any, ckpt: Any, forward: Callable[..., Any]) -> Callable[..., Any]:
    """A block's forward under non-reentrant checkpointing while gradients are on (as PyTorch recommends)."""
    def forward_checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return ckpt(forward, *args, use_reentrant=False, **kwargs)
    forward_checkpointed.__wrapped__ = forward  # type: ignore[attr-defined]
    return forward_checkpointed


def _hf_checkpointable(m: Any) -> bool:
    """A Hugging Face model that says it supports gradient checkpointing (its class's own flag)."""
    return (callable(_static(m, "gradient_checkpointing_enable", None))
            and callable(_static(m, "gradient_checkpointing_disable", None))
            and _static(m, "supports_gradient_checkpointing", False) is True)  # the flag both versions read


def _already_checkpointed(block: Any) -> bool:
    return "forward" in (reach.dict_of(block) or {})


def is_compiled(m: Any) -> bool:
    """A module torch.compile wrapped (read by its type's name: nothing of the module's runs)."""
    return reach.type_name(type(m)).endswith("OptimizedModule")


def _static(obj: Any, name: str, default: Any) -> Any:
    """An attribute looked up without running the object's code: its instance dict, then its class's."""
    d = reach.dict_of(obj) or {}
    if name in d:
        return d[name]
    for k in reach.mro(type(obj)):
        own = dict(reach.own_items(k))
        if name in own:
            v = own[name]
            return default if isinstance(v, property) else v
    return default


# -- bf16 autocast ---------------------------------------------------------------------------------------------------
def bf16_autocast(torch: Any, tops: Sequence[Any], others: Sequence[Any]) -> Candidate | str:
    """The body under ``torch.autocast("cuda", dtype=torch.bfloat16)``, or why that is no remedy here."""
    left = f"{BF16} left out"
    if not tops:
        return f"{left}: no model (a torch.nn.Module) was found in what the body uses"
    if not torch.cuda.is_initialized():  # never the first CUDA call
        return f"{left}: CUDA is not in use in this process (the model runs on the CPU)"
    if not torch.cuda.is_bf16_supported():
        return f"{left}: {torch.cuda.get_device_name()} does not support bf16"
    dtypes = {p.dtype for m in tops for p in m.parameters() if p.is_floating_point()}
    if dtypes != {torch.float32}:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes)) or "none"
        return f"{left}: the model's parameters are not all fp32 ({names}): it already runs in lower precision"
    scaler = next((o for o in others if reach.type_name(type(o)).endswith("GradScaler")), None)
    if scaler is not None:
        return f"{left}: a gradient scaler ({reach.type_name(type(scaler))}) says the body already trains in fp16"

    def wrap(run: Run) -> Run:
        def under_autocast(value: int) -> object:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return run(value)
        return under_autocast

    return Candidate(BF16, "with torch.autocast('cuda', dtype=torch.bfloat16): around the step (measured around "
                     "the whole body)", tops, wrap=wrap)


# -- modules' attributes, copied and put back -------------------------------------------------------------------
_TABLES = (dict, OrderedDict)
#: The module's own tables whose contents a remedy does not change (the fit puts tensors back itself).
_KEPT = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})


def _module_attrs(tops: Sequence[Any]) -> list[tuple[dict[Any, Any], dict[Any, Any], dict[str, list[Any]]]]:
    """Each module's instance dict, shallowly: its attributes, the contents of its hook tables, and its config's
    attributes (a Hugging Face config is one object per model)."""
    out = []
    seen: set[int] = set()
    for top in tops:
        for m in top.modules():
            for obj in (m, _static(m, "config", None)):
                d = reach.dict_of(obj)
                if d is None or id(d) in seen:
                    continue
                seen.add(id(d))
                tables = {k: list(dict.items(v)) for k, v in dict.items(d) if type(v) in _TABLES and k not in _KEPT}
                out.append((d, dict(d), tables))
    return out


def _put_module_attrs_back(saved: list[tuple[dict[Any, Any], dict[Any, Any], dict[str, list[Any]]]]) -> None:
    for d, before, tables in saved:
        for k in [k for k in d if k not in before]:
            del d[k]
        for k, v in before.items():
            if k not in d or d[k] is not v:
                d[k] = v
        for k, items in tables.items():
            table = before[k]
            now = list(dict.items(table))
            if len(now) != len(items) or any(a is not c or b is not e for (a, b), (c, e) in zip(now, items)):
                table.clear()
                table.update(items)


__all__ = ["BF16", "CHECKPOINTING", "MIN_GAIN", "Candidate", "bf16_autocast", "candidates", "checkpointing",
           "is_compiled", "repeated_blocks", "top_modules"]
