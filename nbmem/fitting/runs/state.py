"""The training state a fit's body can change, copied before the fit and put back after it, bit for bit.

What is copied: the parameters, buffers, gradients (``None`` stays ``None``) and train/eval flags of the
modules handed in, the optimizers' state, param groups and own attributes, the instance attributes of LR
schedulers and gradient scalers (``training_kinds``: what their ``state_dict`` holds, and the state they
create lazily, such as a scaler's ``_scale``), and the random number generators: torch's CPU generator,
every CUDA device's once CUDA is up, Python's ``random`` and NumPy's global one. Tensors go to host memory;
containers are put back in place (a hook handle keeps pointing at its dict). The objects come from a walk
(``reached.reachable_state``); no method of a user's object is ever called, only torch's tensor operations and
the C methods of plain containers.
"""

from __future__ import annotations

import functools
import random
import sys
import traceback
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbmem.formatting import fmt_bytes
from nbmem.holders import reach

#: Host memory a state copy may take, of what the kernel calls available.
HOST_FRACTION = 0.9
#: How deep a copy of an object's attributes follows plain containers (a scaler's per-optimizer state is 3).
_DEPTH = 6
#: The optimizer's attributes copied on their own (their tensors are keyed by parameter).
_OPT_OWN = ("state", "param_groups")


class FitRefused(Exception):
    """A fit that cannot go ahead; the message is one line that says why, and the way on where there is one.
    ``ran``: the body ran once before the fit could tell (it allocated on no GPU), and was put back."""

    def __init__(self, message: str, *, ran: bool = False) -> None:
        super().__init__(message)
        self.ran = ran


def _torch() -> Any:
    return sys.modules.get("torch")


def training_kinds(torch: Any) -> tuple[type, ...]:
    """The classes, besides modules and optimizers, whose instances hold training state: LR schedulers and
    gradient scalers, as this torch names them."""
    out: list[type] = []
    sched = getattr(getattr(torch, "optim", None), "lr_scheduler", None)
    for owner, name in ((sched, "LRScheduler"), (sched, "_LRScheduler"), (sched, "ReduceLROnPlateau"),
                        (getattr(torch, "amp", None), "GradScaler")):
        k = getattr(owner, name, None)
        if isinstance(k, type) and k not in out:
            out.append(k)
    for legacy in ("cuda", "cpu"):  # torch.cuda.amp.GradScaler is its own class in torch before 2.3
        amp = sys.modules.get(f"torch.{legacy}.amp")
        k = getattr(amp, "GradScaler", None)
        if isinstance(k, type) and not any(reach.derives(k, b) for b in out):
            out.append(k)
    return tuple(out)


# -- copies of values --------------------------------------------------------------------------------------------
@dataclass
class _Tensor:
    """A tensor copied to host: the tensor itself (to write back into) and where it lived."""

    original: Any
    host: Any
    device: Any


@dataclass
class _Box:
    """A plain container copied item by item; put back into the same container object."""

    original: Any
    items: list[Any]  # values, or (key, value) pairs for a dict


class _Copier:
    """Copies an attribute's value: tensors to host, plain containers item by item, anything else by reference
    (an object that holds state of its own is walked and copied on its own)."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.bytes = 0

    def copy(self, v: Any, depth: int = 0) -> Any:
        t = type(v)
        if reach.derives(t, self.torch.Tensor):
            host = v.detach().to("cpu", copy=True)
            self.bytes += _nbytes(host)
            return _Tensor(v, host, v.device)
        if depth >= _DEPTH:
            return v
        if t is list:
            return _Box(v, [self.copy(x, depth + 1) for x in list(v)])
        if t is dict or t is defaultdict or t is OrderedDict:
            return _Box(v, [(k, self.copy(x, depth + 1)) for k, x in dict.items(v)])
        if t is tuple:
            return tuple(self.copy(x, depth + 1) for x in v)
        return v


def _put_back(v: Any) -> Any:
    """The value a copy stands for, written back into the objects it came from where they still fit."""
    if isinstance(v, _Tensor):
        old = v.original
        if _fits_in(old, v.host, v.device):
            old.copy_(v.host)
            return old
        return v.host.to(v.device)
    if isinstance(v, _Box):
        c = v.original
        if type(c) is list:
            c[:] = [_put_back(x) for x in v.items]
        else:
            c.clear()
            c.update((k, _put_back(x)) for k, x in v.items)
        return c
    if type(v) is tuple:
        return tuple(_put_back(x) for x in v)
    return v


# -- the copy ----------------------------------------------------------------------------------------------------
@dataclass
class StateCopy:
    """Training state taken before a fit, put back after it by ``restore_state``.

    It holds the objects it will write back into (parameters, buffers, optimizers, schedulers, scalers) until
    ``restore_state`` is called; a result keeps only ``restored`` and ``not_restored``, one line each.
    """

    copied_bytes: int
    _params: list[tuple[Any, Any, Any]] = field(default_factory=list, repr=False)  # (param, data, grad or None)
    _buffers: list[tuple[Any, Any]] = field(default_factory=list, repr=False)
    _training: list[tuple[Any, bool]] = field(default_factory=list, repr=False)
    _optimizers: list[tuple[Any, dict[Any, dict[str, Any]], list[dict[str, Any]]]] = field(default_factory=list,
                                                                                          repr=False)
    _attrs: list[tuple[Any, dict[Any, Any]]] = field(default_factory=list, repr=False)  # (object, its dict copied)
    _rng: list[tuple[str, Any]] = field(default_factory=list, repr=False)
    restored: list[str] = field(default_factory=list)
    not_restored: list[str] = field(default_factory=list)
    _arena: _Arena | None = field(default=None, repr=False)

    def close(self) -> None:
        """Unlock the host memory the copies are in (they stay readable); after the last ``restore_state`` (a copy
        that is dropped unlocks it too)."""
        if self._arena is not None:
            self._arena.close()


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


def _host(t: Any) -> tuple[Any, Any]:
    """A host copy of a tensor and the device it came from."""
    return t.detach().to("cpu", copy=True), t.device


#: Each copy's place in the arena starts at a multiple of this (any dtype's element; the copy engines' liking).
_ALIGN = 512
#: Below this the arena is not page-locked: registering costs more than it saves.
_REGISTER_BYTES = 64 << 20


class _Arena:
    """Host memory for the copies of CUDA tensors: one anonymous mapping, in 2 MiB pages where the kernel allows,
    page-locked for the GPU's copy engines where CUDA allows (``cudaHostRegister``, portable, as torch's own
    checkpoint stager does). Measured on an H100 host with a 7B model's 12.5 GiB: to separate host tensors 12.1 s
    (4 KiB page faults) and back 1.9 s; here 2.4 s and back 0.3 s. ``close`` unlocks it; the mapping goes with
    its last copy."""

    def __init__(self, torch: Any, tensors: Sequence[Any]) -> None:
        import mmap

        self.torch = torch
        self.places: dict[int, int] = {}
        size = 0
        for x in tensors:
            if id(x) not in self.places:
                self.places[id(x)] = size
                size += -(-_nbytes(x) // _ALIGN) * _ALIGN
        self.size = size
        self.locked_on: int | None = None  # the device it was registered under, while it is page-locked
        self.buf: Any = None
        if size == 0:
            return
        flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        self.map = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)
        huge = getattr(mmap, "MADV_HUGEPAGE", None)
        if huge is not None:
            try:
                self.map.madvise(huge)
            except OSError:
                pass  # 4 KiB pages: slower to fill, the same copy
        self.buf = torch.frombuffer(self.map, dtype=torch.uint8)
        if size >= _REGISTER_BYTES:
            # under a device the tensors are on: registering under the current one could make a context on a GPU
            # the notebook never used
            dev = tensors[0].device.index
            if _register(torch, dev, self.buf.data_ptr(), size):
                self.locked_on = dev

    def copy(self, t: Any) -> Any:
        """``t`` copied into the arena: its shape, dtype and, where it is dense (channels-last too), its strides,
        so that a tensor made again from it (a grad the fit freed) is laid out as the original was."""
        if self.buf is None:  # every tensor empty
            return _host(t)[0]
        off = self.places[id(t)]
        flat = self.buf[off:off + _nbytes(t)].view(t.dtype)
        mf = self.torch.channels_last if t.dim() == 4 else self.torch.channels_last_3d if t.dim() == 5 else None
        dense = t.is_contiguous() or (mf is not None and t.is_contiguous(memory_format=mf))
        out = flat.as_strided(t.shape, t.stride()) if dense else flat.view(t.shape)
        out.copy_(t.detach())
        return out

    def close(self) -> None:
        if self.locked_on is not None:
            dev, self.locked_on = self.locked_on, None
            try:
                with self.torch.cuda.device(dev):
                    if int(self.torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())) != 0:
                        _clear_cuda_error()
            except Exception:
                pass
        self.buf = None  # the mapping is unmapped when its last copy goes


#: cudaHostRegisterPortable: page-locked for every device's context, not only the one current when registered.
_PORTABLE = 1


def _register(torch: Any, device: int, ptr: int, size: int) -> bool:
    """Page-lock host memory for the copy engines; False where it cannot. Only where a failure's error can be
    cleared: CUDA keeps it to be read once, and torch's check after the next kernel launch (the user's own) would
    raise it as that kernel's."""
    if _cuda_error_clearer() is None:
        return False
    try:
        with torch.cuda.device(device):
            if int(torch.cuda.cudart().cudaHostRegister(ptr, size, _PORTABLE)) == 0:
                return True
    except Exception:
        pass
    _clear_cuda_error()
    return False


@functools.cache
def _cuda_error_clearer() -> Any:
    """``cudaGetLastError`` of the CUDA runtime library this process loaded (torch's binding of the runtime has
    none), or None where none is found (a runtime linked into torch): then nothing is page-locked."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
    except OSError:
        return None
    for path in paths:
        try:
            fn = ctypes.CDLL(path).cudaGetLastError
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return fn
    return None


def _clear_cuda_error() -> None:
    fn = _cuda_error_clearer()
    if fn is not None:
        fn()


def _arena_tensors(torch: Any, params: Sequence[Any], buffers: Sequence[Any], optimizers: Sequence[Any]) -> list[Any]:
    """The CUDA tensors a snapshot copies whole: parameters, their grads, buffers, optimizer state tensors."""
    out = [x for p in params for x in (p, p.grad) if x is not None]
    out += buffers
    out += [v for opt in optimizers for st in opt.state.values() for v in st.values() if _is_tensor(v)]
    return [x for x in out if _in_arena(torch, x)]


def _in_arena(torch: Any, t: Any) -> bool:
    """A CUDA tensor whose bytes are its data: not a wrapper subclass (one that defines ``__torch_dispatch__``, such
    as DTensor or a quantized tensor type, copies as something else); those keep their own host copy."""
    return (t.device.type == "cuda" and t.layout == torch.strided and not t.is_quantized
            and not any("__torch_dispatch__" in vars(c) for c in reach.mro(type(t))
                        if c is not torch.Tensor and c is not torch._C.TensorBase))


def state_bytes(modules: Iterable[Any] = (), optimizers: Iterable[Any] = ()) -> int:
    """Bytes ``snapshot_state`` would copy for these: parameters, their grads, buffers, optimizer state tensors."""
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


def snapshot_state(modules: Iterable[Any] = (), optimizers: Iterable[Any] = (), others: Iterable[Any] = (), *,
                   rng: bool = True, iterators: Sequence[str] = (), available_bytes: int | None = None) -> StateCopy:
    """Copy the training state of ``modules``, ``optimizers`` and ``others`` (LR schedulers, gradient scalers:
    their instance attributes) and, with ``rng``, the random generators. ``iterators`` are named in
    ``not_restored``: the body may advance them, and nothing can put them back.

    Raises ``FitRefused`` (one line) when host memory cannot hold the copy: ``available_bytes`` defaults to
    what psutil calls available, of which at most ``HOST_FRACTION`` is used.
    """
    t = _torch()
    assert t is not None
    modules, optimizers, others = list(modules), list(optimizers), list(others)
    need = state_bytes(modules, optimizers)
    avail = host_available_bytes() if available_bytes is None else available_bytes
    if avail is not None and need > HOST_FRACTION * avail:
        raise FitRefused(f"the model's state ({fmt_bytes(need)}) does not fit into host memory "
                         f"({fmt_bytes(avail)} available) to be restored after the fit; fit without restoring it "
                         "(--no-restore) to go ahead, and the fit will train the model")
    params, buffers = _params(modules, optimizers), _buffers(modules)
    arena = _Arena(t, _arena_tensors(t, params, buffers, optimizers))
    try:
        return _copy(t, StateCopy(need, _arena=arena), arena, modules, optimizers, others, params, buffers, rng,
                     iterators)
    except BaseException as e:
        arena.close()  # a copy cut short (an error, Ctrl-C) leaves nothing locked ...
        if e.__traceback__ is not None:  # ... and its traceback none of the copies (gigabytes of host memory)
            traceback.clear_frames(e.__traceback__.tb_next)
        raise


def _copy(t: Any, saved: StateCopy, arena: _Arena, modules: list[Any], optimizers: list[Any], others: list[Any],
          params: list[Any], buffers: list[Any], rng: bool, iterators: Sequence[str]) -> StateCopy:
    weakref.finalize(saved, arena.close)  # unlocked as the copy goes (the runner drops it after its last restore)

    def host(x: Any) -> tuple[Any, Any]:
        if id(x) in arena.places:
            return arena.copy(x), x.device
        return _host(x)

    for p in params:
        data, _ = host(p)
        grad = None if p.grad is None else host(p.grad)
        saved._params.append((p, data, grad))
    saved._buffers = [(b, host(b)[0]) for b in buffers]
    saved._training = [(m, bool(m.training)) for top in modules for m in top.modules()]
    copier = _Copier(t)
    for opt in optimizers:
        state = {p: {k: (host(v) if _is_tensor(v) else copier.copy(v)) for k, v in st.items()}
                 for p, st in opt.state.items()}
        groups = [{k: copier.copy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
        saved._optimizers.append((opt, state, groups))
        own = reach.dict_of(opt) or {}
        saved._attrs.append((opt, {k: copier.copy(v) for k, v in dict.items(own) if k not in _OPT_OWN}))
    for obj in others:
        d = reach.dict_of(obj)
        if d is None:
            saved.not_restored.append(f"{reach.type_name(type(obj))}: its attributes cannot be read without running "
                                      "its code")
            continue
        saved._attrs.append((obj, {k: copier.copy(v) for k, v in dict.items(d)}))
    saved.copied_bytes += copier.bytes
    if rng:
        saved._rng = _rng_states(t)
    saved.restored = _restored_lines(saved, modules, optimizers, others)
    saved.not_restored += [f"{where}: the body may have advanced it, and an iterator cannot be put back"
                           for where in iterators]
    return saved


def _rng_states(t: Any) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [("torch", t.get_rng_state())]
    if t.cuda.is_initialized():  # never the first CUDA call
        out.append(("cuda", t.cuda.get_rng_state_all()))
    out.append(("random", random.getstate()))
    np = sys.modules.get("numpy")
    if np is not None:
        out.append(("numpy", np.random.get_state()))
    return out


def _restored_lines(saved: StateCopy, modules: Sequence[Any], optimizers: Sequence[Any],
                    others: Sequence[Any]) -> list[str]:
    """What will be put back, a line each, in the words of the objects' types."""
    lines = []

    def name(o: Any) -> str:
        return reach.type_name(type(o))

    if modules:
        grads = sum(g is not None for _, _, g in saved._params)
        lines.append(f"parameters, buffers and train/eval flags of {', '.join(name(m) for m in modules)}; "
                     f"gradients as they were ({grads} set, {len(saved._params) - grads} None)")
    lines += [f"optimizer {name(o)}: state, param groups (learning rates) and attributes" for o in optimizers]
    lines += [f"{name(o)}: its state (what its state_dict holds, and what it made lazily)" for o in others]
    if saved._rng:
        words = {"torch": "torch CPU", "cuda": "every CUDA device's", "random": "Python random",
                 "numpy": "NumPy global"}
        lines.append("random generators: " + ", ".join(words[k] for k, _ in saved._rng))
    return lines


def _fits_in(old: Any, host: Any, device: Any) -> bool:
    """Whether a copy can be written back into the tensor that is there now (same shape, dtype, device)."""
    return (_is_tensor(old) and old.shape == host.shape and old.dtype == host.dtype and old.device == device
            and old.layout == host.layout)


def restore_state(saved: StateCopy) -> int:
    """Put a ``snapshot_state`` copy back, bit for bit, in place where the tensors still fit; its tensor bytes.

    Parameters and buffers are written into their own storage; a ``.grad`` or an optimizer state tensor the
    fit freed or replaced is made again on its device; state the fit created (an optimizer's first step, a
    scaler's first scale) is dropped, and so are grads that were not there. A part that cannot be put back is
    named in ``saved.not_restored`` and the rest is still restored.
    """
    t = _torch()
    assert t is not None
    with t.no_grad():
        for part, put in _PARTS:
            try:
                put(saved, t)
            except Exception as e:
                saved.not_restored.append(f"{part}: putting them back failed ({type(e).__name__}: {str(e)[:120]})")
    for m, training in saved._training:
        m.training = training
    return saved.copied_bytes


def _put_params(saved: StateCopy, t: Any) -> None:
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


def _put_buffers(saved: StateCopy, t: Any) -> None:
    for b, data in saved._buffers:
        b.copy_(data)


def _put_optimizers(saved: StateCopy, t: Any) -> None:
    for opt, state, groups in saved._optimizers:
        for p in [p for p in opt.state if p not in state]:
            del opt.state[p]
        for p, st in state.items():
            cur = opt.state[p]
            for k in [k for k in cur if k not in st]:
                del cur[k]
            for k, v in st.items():
                if isinstance(v, tuple) and len(v) == 2 and _is_tensor(v[0]):
                    host, device = v
                    old = cur.get(k)
                    if _fits_in(old, host, device):
                        old.copy_(host)
                    else:
                        cur[k] = host.to(device)
                else:
                    cur[k] = _put_back(v)
        for g, saved_group in zip(opt.param_groups, groups):
            for k, v in saved_group.items():
                g[k] = _put_back(v)


def _put_attrs(saved: StateCopy, t: Any) -> None:
    for obj, attrs in saved._attrs:
        d = reach.dict_of(obj)
        if d is None:
            continue
        own = _OPT_OWN if any(obj is o for o, _, _ in saved._optimizers) else ()
        for k in [k for k in dict.keys(d) if k not in attrs and k not in own]:
            del d[k]  # made during the fit: a scaler's per-optimizer state, a wrapper set on the instance
        for k, v in attrs.items():
            d[k] = _put_back(v)


def _put_rng(saved: StateCopy, t: Any) -> None:
    for kind, st in saved._rng:
        if kind == "torch":
            t.set_rng_state(st)
        elif kind == "cuda":
            t.cuda.set_rng_state_all(st)
        elif kind == "random":
            random.setstate(st)
        elif kind == "numpy":
            np = sys.modules.get("numpy")
            if np is not None:
                np.random.set_state(st)


#: What ``restore_state`` puts back, in order; each part on its own, so one that fails leaves the others done.
_PARTS = (("parameters and gradients", _put_params), ("buffers", _put_buffers), ("optimizer state", _put_optimizers),
          ("attributes of optimizers, schedulers and scalers", _put_attrs), ("random generators", _put_rng))


__all__ = ["HOST_FRACTION", "FitRefused", "StateCopy", "host_available_bytes", "restore_state", "snapshot_state",
           "state_bytes", "training_kinds"]
