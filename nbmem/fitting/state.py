"""The training state a fit's body can change, copied to host memory before the fit and put back after it.

The engine part of a fit that touches the user's objects: it reads and writes only tensors and the plain
state of modules and optimizers handed to it (found by ``walk.reachable_state``), never calls their code.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..formatting import fmt_bytes

#: Host memory a state copy may take, of what the kernel calls available.
HOST_FRACTION = 0.9


class FitRefused(Exception):
    """A fit that cannot go ahead; the message is one line that says why, and the way on where there is one."""


def _torch() -> Any:
    return sys.modules.get("torch")


@dataclass
class StateCopy:
    """A host copy of modules' and optimizers' tensors, taken before a fit, put back bit for bit after it.

    It holds the tensors it will write back into (the parameters, buffers and optimizer state themselves)
    until ``restore_state`` is called; nothing of it is kept in a result.
    """

    copied_bytes: int
    _params: list[tuple[Any, Any, Any]] = field(default_factory=list, repr=False)  # (param, data, grad or None)
    _buffers: list[tuple[Any, Any]] = field(default_factory=list, repr=False)
    _training: list[tuple[Any, bool]] = field(default_factory=list, repr=False)
    _optimizers: list[tuple[Any, dict[Any, dict[str, Any]], list[dict[str, Any]]]] = field(default_factory=list,
                                                                                          repr=False)


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


def _host(t: Any) -> tuple[Any, Any]:
    """A host copy of a tensor and the device it came from."""
    return t.detach().to("cpu", copy=True), t.device


def state_bytes(modules: Iterable[Any] = (), optimizers: Iterable[Any] = ()) -> int:
    """Bytes ``snapshot_state`` would copy: parameters, their grads, buffers and optimizer state tensors."""
    total = 0
    seen: set[int] = set()
    modules, optimizers = list(modules), list(optimizers)
    for p in _params(modules, optimizers):
        if id(p) not in seen:
            seen.add(id(p))
            total += _nbytes(p) + (_nbytes(p.grad) if p.grad is not None else 0)
    for b in _buffers(modules):
        total += _nbytes(b)
    for opt in optimizers:
        for st in opt.state.values():
            total += sum(_nbytes(v) for v in st.values() if _is_tensor(v))
    return total


def _is_tensor(v: Any) -> bool:
    t = _torch()
    return t is not None and isinstance(v, t.Tensor)


def _params(modules: Sequence[Any], optimizers: Sequence[Any]) -> list[Any]:
    out: dict[int, Any] = {}
    for m in modules:
        for p in m.parameters():
            out.setdefault(id(p), p)
    for opt in optimizers:
        for g in opt.param_groups:
            for p in g["params"]:
                out.setdefault(id(p), p)
    return list(out.values())


def _buffers(modules: Sequence[Any]) -> list[Any]:
    out: dict[int, Any] = {}
    for m in modules:
        for b in m.buffers():
            out.setdefault(id(b), b)
    return list(out.values())


def host_available_bytes() -> int | None:
    """What the kernel calls available host memory (psutil), or None where it cannot be read."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        return None


def snapshot_state(modules: Iterable[Any] = (), optimizers: Iterable[Any] = (), *,
                   available_bytes: int | None = None) -> StateCopy:
    """Copy parameters, their ``.grad``s, buffers, training flags and optimizer state to host memory.

    Raises ``FitRefused`` (one line) when host memory cannot hold the copy: ``available_bytes`` defaults to
    what psutil calls available, of which at most ``HOST_FRACTION`` is used.
    """
    modules, optimizers = list(modules), list(optimizers)
    need = state_bytes(modules, optimizers)
    avail = host_available_bytes() if available_bytes is None else available_bytes
    if avail is not None and need > HOST_FRACTION * avail:
        raise FitRefused(f"the model's state ({fmt_bytes(need)}) does not fit into host memory "
                         f"({fmt_bytes(avail)} available) to be restored after the fit; fit without restoring it "
                         "(--no-restore) to go ahead, and the fit will train the model")
    saved = StateCopy(need)
    for p in _params(modules, optimizers):
        data, _ = _host(p)
        grad = None if p.grad is None else _host(p.grad)
        saved._params.append((p, data, grad))
    saved._buffers = [(b, _host(b)[0]) for b in _buffers(modules)]
    saved._training = [(m, bool(m.training)) for top in modules for m in top.modules()]
    for opt in optimizers:
        state = {p: {k: (_host(v) if _is_tensor(v) else copy.deepcopy(v)) for k, v in st.items()}
                 for p, st in opt.state.items()}
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
        saved._optimizers.append((opt, state, groups))
    return saved


def _fits_in(old: Any, host: Any, device: Any) -> bool:
    """Whether a copy can be written back into the tensor that is there now (same shape, dtype, device)."""
    return (_is_tensor(old) and old.shape == host.shape and old.dtype == host.dtype and old.device == device
            and old.layout == host.layout)


def restore_state(saved: StateCopy) -> int:
    """Put a ``snapshot_state`` copy back, bit for bit, in place where the tensors still fit; its bytes.

    Parameters and buffers are written into their own storage; a ``.grad`` or an optimizer state tensor the
    fit freed or replaced is made again on its device; state the fit created (an optimizer's first step)
    is dropped, and so are grads that were not there.
    """
    t = _torch()
    assert t is not None
    with t.no_grad():
        for p, data, grad in saved._params:
            p.copy_(data)
            if grad is None:
                p.grad = None
            else:
                host, device = grad
                if _fits_in(p.grad, host, device):
                    p.grad.copy_(host)
                else:
                    p.grad = host.to(device)
        for b, data in saved._buffers:
            b.copy_(data)
        for opt, state, groups in saved._optimizers:
            for p in [p for p in opt.state if p not in state]:
                del opt.state[p]
            for p, st in state.items():
                cur = opt.state[p]
                for k in [k for k in cur if k not in st]:
                    del cur[k]
                for k, v in st.items():
                    if isinstance(v, tuple):
                        host, device = v
                        old = cur.get(k)
                        if _fits_in(old, host, device):
                            old.copy_(host)
                        else:
                            cur[k] = host.to(device)
                    else:
                        cur[k] = copy.deepcopy(v)
            for g, saved_group in zip(opt.param_groups, groups):
                for k, v in saved_group.items():
                    g[k] = copy.deepcopy(v)
    for m, training in saved._training:
        m.training = training
    return saved.copied_bytes


__all__ = ["HOST_FRACTION", "FitRefused", "StateCopy", "host_available_bytes", "restore_state", "snapshot_state",
           "state_bytes"]
