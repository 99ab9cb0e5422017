"""Remedies measured by runs of their own (issue 27), on the CPU: which can be applied and why not, the model as it
was after one is applied (also after an error), and a whole fit with ``want`` through a stand-in for CUDA whose
traces follow what the real body did (checkpointed blocks keep less per sample)."""

from __future__ import annotations

import contextlib
import itertools
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

torch = pytest.importorskip("torch")

from nbmem.fitting.analysis.model import RunTrace  # noqa: E402
from nbmem.fitting.runs import multigpu, remedies, runner, torchcheck  # noqa: E402
from nbmem.fitting.runs.multigpu import RunSet  # noqa: E402

nn = torch.nn
MiB = 2**20


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: Any) -> Any:
        return x + self.drop(self.ff(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(16, 1)

    def forward(self, x: Any) -> Any:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class FakeHF(Net):
    """Hugging Face's switch as it behaves: flags and a function on the blocks, a hook on the input layer; its
    ``disable`` leaves the function and the hook behind (as ``PreTrainedModel``'s does for some)."""

    supports_gradient_checkpointing = True

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
        assert gradient_checkpointing_kwargs == {"use_reentrant": False}
        for b in self.blocks:
            b.gradient_checkpointing = True
            b._gradient_checkpointing_func = torch.utils.checkpoint.checkpoint
        self._require_grads_hook = self.inp.register_forward_hook(lambda m, i, o: o.requires_grad_(True))

    def gradient_checkpointing_disable(self) -> None:
        for b in self.blocks:
            b.gradient_checkpointing = False


def attrs(model: Any) -> list[tuple[str, dict[str, Any], dict[str, list[Any]]]]:
    """Each module's attributes (by identity) and its hook tables' contents."""
    out = []
    for path, m in model.named_modules():
        d = dict(vars(m))
        hooks = {k: list(v.items()) for k, v in d.items() if k.endswith("hooks") and isinstance(v, dict)}
        out.append((path, {k: id(v) for k, v in d.items()}, {k: [(a, id(b)) for a, b in v] for k, v in hooks.items()}))
    return out


def grads_of(model: Any, x: Any) -> list[Any]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


# -- which remedies, and why not ----------------------------------------------------------------------------------
def test_repeated_blocks_are_the_outermost_list_of_one_composite_type() -> None:
    net = Net()
    found = remedies.repeated_blocks(torch, net)
    assert [(path, len(blocks)) for path, blocks in found] == [("blocks", 3)]
    mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    assert remedies.repeated_blocks(torch, mlp) == []
    assert remedies.repeated_blocks(torch, nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))) == [], "leaf layers"


def test_on_the_cpu_checkpointing_is_a_candidate_and_bf16_is_left_out_with_one_line_why() -> None:
    net = Net()
    got, why = remedies.candidates(torch, [net, net.blocks[0], net.head], [])
    assert [c.name for c in got] == [remedies.CHECKPOINTING]
    assert "each of the 3 Block in Net.blocks" in got[0].setting and "use_reentrant=False" in got[0].setting
    assert len(why) == 1 and why[0].startswith("bf16 autocast left out: CUDA is not in use")
    assert not torch.cuda.is_initialized(), "asking never starts CUDA"


@pytest.mark.parametrize(("modules", "reason"), [
    ([], "no model (a torch.nn.Module) was found"),
    ([nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))], "Sequential has no repeated blocks"),
])
def test_checkpointing_that_cannot_be_applied_says_why_in_one_line(modules: list[Any], reason: str) -> None:
    got, why = remedies.candidates(torch, modules, [])
    assert got == [] and reason in why[0] and all("\n" not in w for w in why)


def test_a_block_whose_forward_the_notebook_replaced_is_left_alone() -> None:
    net = Net()
    net.blocks[1].forward = net.blocks[1].forward
    assert "already replaced" in str(remedies.checkpointing(torch, [net]))


# -- applied, and undone --------------------------------------------------------------------------------------------
def test_checkpointing_computes_the_same_gradients_and_the_model_is_as_it_was_after() -> None:
    net = Net()
    x = torch.randn(5, 8)
    plain = grads_of(net, x)
    before = attrs(net)
    c = remedies.checkpointing(torch, [net])
    assert isinstance(c, remedies.Candidate)
    with c.applied():
        assert all("forward" in vars(b) for b in net.blocks)
        under = grads_of(net, x)
        with torch.no_grad():
            net(x)  # without gradients the blocks run plainly
    assert attrs(net) == before
    assert all(torch.equal(a, b) for a, b in zip(plain, under))


def test_the_model_is_as_it_was_after_an_error_under_a_remedy_and_hugging_faces_leftovers_go_too() -> None:
    net = FakeHF()
    before = attrs(net)
    c = remedies.checkpointing(torch, [net])
    assert isinstance(c, remedies.Candidate) and "gradient_checkpointing_enable" in c.setting
    with pytest.raises(ValueError, match="the body's"), c.applied():
        assert net.blocks[0].gradient_checkpointing and net.inp._forward_hooks
        raise ValueError("the body's own error")
    assert attrs(net) == before
    assert not hasattr(net.blocks[0], "gradient_checkpointing") and not net.inp._forward_hooks


# -- a run of blocks next to other modules (issue 36) ---------------------------------------------------------------
def gpt() -> Any:
    """The GPT shape many notebooks write: embedding, six blocks, norm and head in one ``Sequential``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 16), *[Block() for _ in range(6)], nn.LayerNorm(16), nn.Linear(16, 50))


class Mixed(nn.Module):
    """A ``ModuleList`` of mixed members: a stem, three blocks, a norm, and one more block on its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(8, 16), Block(), Block(), Block(), nn.LayerNorm(16), Block()])

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_run_of_blocks_next_to_other_modules_is_found_and_only_the_run() -> None:
    model = gpt()
    found = remedies.repeated_blocks(torch, model)
    assert [(path, len(blocks)) for path, blocks in found] == [("[1:7]", 6)]
    assert [id(b) for b in found[0][1]] == [id(model[k]) for k in range(1, 7)]
    mixed = Mixed()
    assert [(p, [id(b) for b in bs]) for p, bs in remedies.repeated_blocks(torch, mixed)] == [
        ("layers[1:4]", [id(mixed.layers[k]) for k in range(1, 4)])], "the lone block after the norm is no run"
    named = nn.Sequential(OrderedDict([("wte", nn.Embedding(50, 16)), ("h0", Block()), ("h1", Block()),
                                       ("ln_f", nn.LayerNorm(16))]))
    assert [(p, len(bs)) for p, bs in remedies.repeated_blocks(torch, named)] == [("['h0' to 'h1']", 2)]
    shared = Block()
    assert [len(bs) for _, bs in remedies.repeated_blocks(torch, nn.Sequential(shared, shared, nn.Linear(16, 1)))] \
        == [], "a block used twice is one block"
    got, _ = remedies.candidates(torch, [model], [])
    assert [c.name for c in got] == [remedies.CHECKPOINTING]
    assert "around each of the 6 Block in Sequential[1:7]" in got[0].setting
    got, _ = remedies.candidates(torch, [mixed], [])
    assert "around each of the 3 Block in Mixed.layers[1:4]" in got[0].setting


@pytest.mark.parametrize(("make", "x"), [(gpt, lambda: torch.randint(0, 50, (4, 10))),
                                         (Mixed, lambda: torch.randn(5, 8))])
def test_checkpointing_a_run_changes_only_its_blocks_computes_the_same_and_is_undone(make: Any, x: Any) -> None:
    model, x = make(), x()
    run = remedies.repeated_blocks(torch, model)[0][1]
    rest = [m for m in model.modules() if m not in run and not any(m is s for b in run for s in b.modules())]
    calls: list[int] = []
    for b in run:  # before the copy, so the hooks are the model's own as it was
        b.ff.register_forward_pre_hook(lambda m, i: calls.append(1))
    torch.manual_seed(2)
    out = model(x)
    del calls[:]
    plain = grads_of(model, x)
    plain_calls, before = len(calls), attrs(model)
    c = remedies.checkpointing(torch, [model])
    assert isinstance(c, remedies.Candidate)
    with c.applied():
        assert all("forward" in vars(b) for b in run) and not any("forward" in vars(m) for m in rest)
        torch.manual_seed(2)
        under_out = model(x)
        del calls[:]
        under = grads_of(model, x)
        assert len(calls) == 2 * plain_calls, "each block of the run ran again in backward: checkpointed"
    assert attrs(model) == before
    assert torch.equal(out, under_out) and all(torch.equal(a, b) for a, b in zip(plain, under, strict=True))


# -- a whole fit with want, CUDA stood in for ------------------------------------------------------------------------
class FakeCuda:
    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_allocator_backend(self) -> str:
        return "native"

    def current_device(self) -> int:
        return 0

    def synchronize(self, device: int | None = None) -> None:
        pass

    def is_bf16_supported(self) -> bool:
        return False

    def get_device_name(self, device: int | None = None) -> str:
        return "a stand-in GPU"


class FakeTorch:
    """torch, with a stand-in ``torch.cuda``. Its ``_C`` would be the real one, which on the CUDA build answers for
    this machine's devices (none, without a GPU), not for the stand-in's: asking for it is an error on every
    build. What the fit reads of the devices comes from the source (``FakeSource``)."""

    cuda = FakeCuda()

    def __getattr__(self, name: str) -> Any:
        if name == "_C":
            raise AttributeError("the stand-in torch has no _C: the fit reads the devices through its source")
        return getattr(torch, name)


class FakeSource:
    """The allocator as the fit reads it: 1 GiB free, nothing held."""

    def trace_unsupported(self) -> None:
        return None

    def read(self, device: int) -> Any:
        return type("Reading", (), {"allocated_bytes": 0, "reserved_bytes": 0})()

    def segments(self) -> list[Any]:
        return []

    def device_free(self, device: int) -> tuple[int, int]:
        return 1 << 30, 2 << 30

    def empty_cache(self, device: int) -> None:
        pass

    def clear_cublas_workspaces(self) -> bool:
        return False

    def context_devices(self) -> list[int]:
        return [0]

    #: The share of the device the user let this process's allocator hold (None: a torch that cannot say).
    fraction: float | None = None

    def memory_fraction(self, device: int) -> float | None:
        return self.fraction

    def allocator_total(self, device: int) -> int:
        return 2 << 30

    #: Each device's cap while a check past the model's answer runs (``TorchRelease.capped``); None outside one.
    caps: dict[int, int] | None = None
    #: Whether this torch can hold the allocator to a cap (``get_per_process_memory_fraction``, torch 2.9 on).
    can_cap = True

    @contextlib.contextmanager
    def capped(self, caps: dict[int, int]) -> Iterator[bool]:
        if not self.can_cap:
            yield False
            return
        self.caps = dict(caps)
        try:
            yield True
        finally:
            self.caps = None


class Bf16Cuda(FakeCuda):
    def is_bf16_supported(self) -> bool:
        return True


class Bf16Torch(FakeTorch):
    cuda = Bf16Cuda()


@pytest.mark.parametrize(("make", "others", "reason"), [
    (lambda: Net().to(torch.bfloat16), [], "not all fp32 (bfloat16)"),
    (Net, [torch.amp.GradScaler("cpu")], "a gradient scaler (GradScaler) says the body already trains in fp16"),
    (None, [], "no model (a torch.nn.Module) was found"),
])
def test_bf16_autocast_is_left_out_where_the_body_is_not_plain_fp32(make: Any, others: list[Any], reason: str) -> None:
    tops = [] if make is None else [make()]
    got = remedies.bf16_autocast(Bf16Torch(), tops, others)
    assert isinstance(got, str) and got.startswith("bf16 autocast left out: ") and reason in got


def test_bf16_autocast_is_a_candidate_for_an_fp32_model_on_a_gpu_with_bf16() -> None:
    got = remedies.bf16_autocast(Bf16Torch(), [Net()], [])
    assert isinstance(got, remedies.Candidate) and "torch.autocast('cuda', dtype=torch.bfloat16)" in got.setting


def test_a_hugging_face_model_already_checkpointing_and_a_compiled_one_are_left_alone() -> None:
    net = FakeHF()
    net.blocks[0].gradient_checkpointing = True
    assert "already has gradient checkpointing on" in str(remedies.checkpointing(torch, [net]))

    class OptimizedModule(nn.Module):  # what torch.compile wraps a module in, by name
        def __init__(self) -> None:
            super().__init__()
            self._orig_mod = Net()

    assert "torch.compile'd" in str(remedies.checkpointing(torch, [OptimizedModule()]))


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A fit that runs the real body on the CPU; each run's trace holds its input and its activations, 8 MiB per
    sample plainly and 2 MiB under checkpointing (what the blocks' forward says at the time)."""
    seen: dict[str, Any] = {"runs": []}
    net: list[Any] = []
    seen["net"] = net
    addrs = itertools.count(1)

    def one_run(run: Any, value: int, counted: bool, src: Any, devs: list[int], stacks: bool, max_entries: int) -> Any:
        run(value)
        ckpt = all("forward" in vars(b) for b in net[0].blocks)
        seen["runs"].append((value, ckpt))
        x, act = next(addrs) << 32, next(addrs) << 32
        per = 2 * MiB if ckpt and not seen.get("no gain") else 8 * MiB
        entries = [{"action": "alloc", "addr": x, "size": value * MiB},
                   {"action": "alloc", "addr": act, "size": value * per},
                   {"action": "free_requested", "addr": act, "size": value * per},
                   {"action": "free_requested", "addr": x, "size": value * MiB}]
        return RunSet.single(RunTrace(value, entries, counted, 0, 0)), ""

    monkeypatch.setattr(runner, "_torch", lambda: FakeTorch())
    monkeypatch.setattr(torchcheck, "_torch", lambda: FakeTorch())
    monkeypatch.setattr(runner, "_one_run", one_run)
    monkeypatch.setattr(runner, "free_cached", lambda src, devs, **kw: None)
    return seen


def seeded_net(stand_in: dict[str, list[Any]]) -> tuple[Any, Any, list[Any], Any, Any]:
    """A seeded ``Net`` the stand-in CUDA sees, its AdamW, and what a fit must put back: weights, attributes, RNG."""
    torch.manual_seed(0)
    net = Net()
    stand_in["net"].append(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    return net, opt, [p.detach().clone() for p in net.parameters()], attrs(net), torch.get_rng_state()


def test_a_fit_with_want_measures_checkpointing_by_runs_under_it_and_puts_everything_back(
        stand_in: dict[str, list[Any]]) -> None:
    net, opt, weights, before, rng = seeded_net(stand_in)

    def step(b: int) -> None:
        net.train()
        net(torch.randn(b, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    res = runner.fit(step, [8, 16, 32], source=FakeSource(), name="batch", modules=[net], optimizers=[opt],
                     margin_bytes=0, want=10_000)  # type: ignore[arg-type]
    assert res.largest_value is not None and res.want == 10_000
    by = {r.name: r for r in res.remedies}
    assert list(by) == ["gradient accumulation", "activation checkpointing"]
    ckpt = by["activation checkpointing"]
    assert ckpt.largest_value > 3 * res.largest_value, "2 + 1 MiB per sample under it, not 8 + 1"
    assert ckpt.largest_value * 3 * MiB <= 1 << 30, "never above what the room holds"
    assert ckpt.time_per_sample_ratio is not None and ckpt.time_per_sample_ratio > 0
    assert "measured: the fit's runs again with it (batch=8, 16, 32" in ckpt.how
    assert any(n.startswith("bf16 autocast left out: a stand-in GPU does not support bf16") for n in res.notes)
    assert {c for _, c in stand_in["runs"]} == {False, True}, "runs plainly, then under the remedy"
    # every run counted, the timed steps (two each), and each answer's check (the plain one's and the remedy's):
    # two steps under one trace
    assert res.steps_run == len(stand_in["runs"]) + 4 + 2
    assert attrs(net) == before and all(torch.equal(a, p) for a, p in zip(weights, net.parameters()))
    assert not opt.state and all(p.grad is None for p in net.parameters())
    assert torch.equal(rng, torch.get_rng_state())
    assert "activation checkpointing" in str(res) and "time per sample" in res._repr_html_()
    assert [r["remedy"] for r in res.row()["remedies"]] == ["gradient accumulation", "activation checkpointing"]


def test_each_remedys_runs_start_from_the_users_training_state_as_the_users_next_cell_would(
        stand_in: dict[str, list[Any]]) -> None:
    """The plain runs trained the model and made AdamW's state; a remedy's first run must not find them (the user's
    next cell, with the remedy, makes the optimizer's state in its first step, as the model of a first run has it)."""
    net, opt, weights, _, _ = seeded_net(stand_in)
    firsts: list[tuple[bool, int, bool]] = []

    def step(b: int) -> None:
        ckpt = "forward" in vars(net.blocks[0])
        if not firsts or firsts[-1][0] != ckpt:
            firsts.append((ckpt, len(opt.state), all(torch.equal(a, p) for a, p in zip(weights, net.parameters()))))
        net(torch.randn(b, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    res = runner.fit(step, [8, 16, 32], source=FakeSource(), name="batch", modules=[net], optimizers=[opt],
                     margin_bytes=0, want=10_000)  # type: ignore[arg-type]
    assert [r.name for r in res.remedies] == ["gradient accumulation", "activation checkpointing"]
    assert firsts[0] == (False, 0, True)
    assert (True, 0, True) in firsts, f"the remedy's first run found the plain runs' state: {firsts}"
    assert not opt.state and all(torch.equal(a, p) for a, p in zip(weights, net.parameters()))


def test_a_want_that_fits_runs_no_remedy(stand_in: dict[str, list[Any]]) -> None:
    net = Net()
    stand_in["net"].append(net)
    res = runner.fit(lambda b: net(torch.randn(b, 8)).sum().backward(), [8, 16, 32], source=FakeSource(),  # type: ignore[arg-type]
                     name="batch", modules=[net], margin_bytes=0, want=16)
    assert not res.remedies and not any(c for _, c in stand_in["runs"])
    assert not any("left out" in n for n in res.notes)


def test_a_remedy_the_body_fails_under_is_left_out_and_the_model_is_as_it_was(
        stand_in: dict[str, list[Any]]) -> None:
    net = Net()
    stand_in["net"].append(net)
    before = attrs(net)

    def step(b: int) -> None:
        if "forward" in vars(net.blocks[0]):
            raise RuntimeError("this body cannot run checkpointed")
        net(torch.randn(b, 8)).sum().backward()

    res = runner.fit(step, [8, 16, 32], source=FakeSource(), name="batch", modules=[net],  # type: ignore[arg-type]
                     margin_bytes=0, want=10_000)
    assert [r.name for r in res.remedies] == ["gradient accumulation"]
    assert any(n.startswith("activation checkpointing left out: the body failed under it (RuntimeError: this body")
               for n in res.notes)
    assert attrs(net) == before


def test_a_remedy_that_allows_no_more_is_left_out_and_says_what_it_measured(stand_in: dict[str, Any]) -> None:
    net = Net()
    stand_in["net"].append(net)
    stand_in["no gain"] = True
    res = runner.fit(lambda b: net(torch.randn(b, 8)).sum().backward(), [8, 16, 32], source=FakeSource(),  # type: ignore[arg-type]
                     name="batch", modules=[net], margin_bytes=0, want=10_000)
    assert [r.name for r in res.remedies] == ["gradient accumulation"]
    assert res.largest_value is not None
    assert any(n.startswith("activation checkpointing left out: measured, the largest batch under it is ") and
               f"no more than {res.largest_value:,} without it" in n for n in res.notes)
    assert any(c for _, c in stand_in["runs"]), "it was measured"


class WorkspaceSource(FakeSource):
    """cuBLAS's workspaces as torch keeps them: 32 MiB each, cleared all at once; the autograd thread's backward
    makes this thread's too (its forward product)."""

    SIZES: ClassVar[dict[str, int]] = {
        "this thread's cuBLAS": 32 << 20, "cuBLASLt": 33 << 20, "the autograd thread's cuBLAS": 32 << 20}
    CUBLAS_WORKSPACES = tuple(SIZES)

    def __init__(self, present: set[str]) -> None:
        self.present = set(present)
        self.leak = 0

    def read(self, device: int) -> Any:
        n = 100 + self.leak + sum(self.SIZES[k] for k in self.present)
        return type("Reading", (), {"allocated_bytes": n, "reserved_bytes": n})()

    def clear_cublas_workspaces(self) -> bool:
        self.present.clear()
        return True

    def make_cublas_workspace(self, kind: str, device: int) -> None:
        self.present.add(kind)
        if kind == "the autograd thread's cuBLAS":
            self.present.add("this thread's cuBLAS")


@pytest.mark.parametrize("users", [set(), {"this thread's cuBLAS"}, {"this thread's cuBLAS", "cuBLASLt"},
                                   set(WorkspaceSource.SIZES)])
def test_the_fit_gives_back_the_workspaces_its_runs_made_and_makes_the_users_again(users: set[str]) -> None:
    src = WorkspaceSource(users)
    before = src.read(0).allocated_bytes
    src.present |= set(WorkspaceSource.SIZES)  # the fit's runs made every kind
    assert multigpu.give_back_workspaces(src, {0: before}) == ({0: before}, None)  # type: ignore[arg-type]
    assert src.present == users


def test_workspaces_are_left_alone_when_the_fit_made_none() -> None:
    src = WorkspaceSource({"cuBLASLt"})
    before = src.read(0).allocated_bytes
    assert multigpu.give_back_workspaces(src, {0: before}) == ({0: before}, None)  # type: ignore[arg-type]
    assert src.present == {"cuBLASLt"}


class OddWorkspaces(WorkspaceSource):
    """A workspace of a kind the fit cannot make (another stream's), and, optionally, making one fails."""

    SIZES: ClassVar[dict[str, int]] = {**WorkspaceSource.SIZES, "another stream's": 34 << 20}

    def __init__(self, present: set[str], fail: bool = False) -> None:
        super().__init__(present)
        self.fail = fail

    def make_cublas_workspace(self, kind: str, device: int) -> None:
        if self.fail:
            raise RuntimeError("CUDA error: out of memory")
        super().make_cublas_workspace(kind, device)


@pytest.mark.parametrize(("fail", "says"), [(False, "could not be made again exactly"), (True, "failed (RuntimeError")])
def test_workspaces_the_fit_cannot_make_again_are_said_and_none_is_left_half_made(fail: bool, says: str) -> None:
    src = OddWorkspaces({"another stream's"}, fail=fail)
    before = src.read(0).allocated_bytes
    src.present.add("the autograd thread's cuBLAS")
    after0, note = multigpu.give_back_workspaces(src, {0: before})  # type: ignore[arg-type]
    after = after0[0]
    assert after < before and src.present == set() and note is not None and says in note


def test_a_fit_that_also_leaks_says_the_workspaces_went_too() -> None:
    src = WorkspaceSource({"this thread's cuBLAS"})
    before = src.read(0).allocated_bytes
    src.present.add("cuBLASLt")
    src.leak = 40 << 20  # more than the user's workspace: the fit cannot tell what to make again
    after0, note = multigpu.give_back_workspaces(src, {0: before})  # type: ignore[arg-type]
    after = after0[0]
    assert after > before and note is not None and "given back as well" in note


class DeviceWorkspaces(WorkspaceSource):
    """Several GPUs: each device its own workspaces, and torch's clear takes every device's at once."""

    def __init__(self, present: dict[int, set[str]]) -> None:
        self.on = {d: set(p) for d, p in present.items()}
        self.leak = 0

    def read(self, device: int) -> Any:
        n = 100 + sum(self.SIZES[k] for k in self.on[device])
        return type("Reading", (), {"allocated_bytes": n, "reserved_bytes": n})()

    def clear_cublas_workspaces(self) -> bool:
        for p in self.on.values():
            p.clear()
        return True

    def make_cublas_workspace(self, kind: str, device: int) -> None:
        self.on[device].add(kind)
        if kind == "the autograd thread's cuBLAS":
            self.on[device].add("this thread's cuBLAS")


@pytest.mark.parametrize("users", [
    {0: set(), 1: set()},
    {0: {"this thread's cuBLAS"}, 1: set()},  # forwards on cuda:0 only; the fit's runs on cuda:1
    {0: {"this thread's cuBLAS", "cuBLASLt"}, 1: {"the autograd thread's cuBLAS", "this thread's cuBLAS"}},
    {0: set(WorkspaceSource.SIZES), 1: {"cuBLASLt"}, 2: {"this thread's cuBLAS"}},
])
def test_on_several_gpus_the_workspaces_the_runs_made_go_and_each_devices_own_are_made_again(
        users: dict[int, set[str]]) -> None:
    src = DeviceWorkspaces(users)
    before = {d: src.read(d).allocated_bytes for d in users}
    for d in (0, 1):
        src.on[d] |= set(WorkspaceSource.SIZES)  # the fit's runs made every kind on two of the devices
    assert multigpu.give_back_workspaces(src, before) == (before, None)  # type: ignore[arg-type]
    assert src.on == users


def test_a_fit_never_analyses_the_same_runs_twice_and_only_the_last_analysis_is_the_full_one(
        stand_in: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # The analyses are most of a fit's time (each aligns every run with the largest and simulates the allocator
    # some 50 times): between runs only the largest value is asked for, and what was analysed is not again.
    calls: list[tuple[tuple[int, ...], bool]] = []
    kept: list[Any] = []  # every run seen, so no id is reused
    real = multigpu.analyse

    def counting(runs: Any, room: Any, **kw: Any) -> Any:
        kept.extend(runs)
        calls.append((tuple(id(r) for r in runs), bool(kw.get("largest_only"))))
        return real(runs, room, **kw)

    monkeypatch.setattr(multigpu, "analyse", counting)
    net = Net()
    stand_in["net"].append(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)

    def step(b: int) -> None:
        net(torch.randn(b, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    res = runner.fit(step, [8, 16, 32], source=FakeSource(), name="batch", modules=[net], optimizers=[opt],
                     margin_bytes=0, want=10_000)  # type: ignore[arg-type]
    assert res.curve and [r.name for r in res.remedies] == ["gradient accumulation", "activation checkpointing"]
    assert "more runs" in " ".join(res.notes), "the plain runs were refined (the case where analyses repeated)"
    between, last = calls[:-1], calls[-1]
    assert all(quick for _, quick in between) and not last[1], calls
    assert len({ids for ids, _ in between}) == len(between), "a list of runs analysed twice"
    assert len(between) >= 6, "the plain runs and the remedy's, each analysed as they grew"


def test_a_fit_whose_body_fails_keeps_no_copy_of_the_state_alive_while_its_error_is_kept(
        stand_in: dict[str, list[Any]]) -> None:
    """The notebook keeps the last error (``sys.last_value``, ``%debug``), and so its frames: they must not keep the
    fit's copy of the training state (the host copy of every weight, and the user's modules)."""
    import gc

    from nbmem.fitting.runs.state import StateCopy

    net, opt, *_ = seeded_net(stand_in)
    calls: list[int] = []

    def step(b: int) -> None:
        calls.append(b)
        if len(calls) == 3:
            raise ValueError("a bug in the cell")
        net(torch.randn(b, 8)).sum().backward()
        opt.step()

    with pytest.raises(ValueError) as info:
        runner.fit(step, [2, 4, 8], source=FakeSource(), name="b", modules=[net], optimizers=[opt])  # type: ignore[arg-type]
    kept = info.value  # as the notebook keeps it
    gc.collect()
    assert kept is not None and not [o for o in gc.get_objects() if type(o) is StateCopy]


class _Cuda:
    """What of ``torch.cuda`` ``TorchRelease.capped`` calls, for its own logic; tests/gpu has the real one."""

    def __init__(self, fractions: dict[int, float], fail_on: int | None = None) -> None:
        self.fractions, self.fail_on, self.device, self.set_calls = dict(fractions), fail_on, 1, 0
        self.memory = type("Memory", (), {"get_per_process_memory_fraction": lambda _, d: self.fractions[d]})()

    def get_device_properties(self, d: int) -> Any:
        return type("Props", (), {"total_memory": 100 << 30})()

    def set_per_process_memory_fraction(self, f: float, d: int) -> None:
        self.set_calls += 1
        self.device = d  # as older torch left cudaSetDevice behind
        if d == self.fail_on and self.set_calls > len(self.fractions):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.fractions[d] = f

    def current_device(self) -> int:
        return self.device

    def set_device(self, d: int) -> None:
        self.device = d


def _release_with(cuda: _Cuda) -> Any:
    from nbmem.clean.release import TorchRelease

    class Release(TorchRelease):
        def cuda(self) -> Any:  # type: ignore[override]
            return type("Torch", (), {"cuda": cuda})()

    return Release()


def test_the_cap_is_set_per_device_and_each_users_fraction_and_the_current_device_come_back_on_an_error() -> None:
    cuda = _Cuda({0: 0.0, 1: 0.5})
    src = _release_with(cuda)
    with pytest.raises(KeyError), src.capped({0: 10 << 30, 1: 25 << 30}) as held:
        assert held and cuda.fractions == {0: 0.1, 1: 0.25}
        raise KeyError("the body's own error")
    assert cuda.fractions == {0: 0.0, 1: 0.5} and cuda.device == 1, "a fraction of 0 stays 0; the device is back"


def test_a_device_that_cannot_take_its_fraction_back_does_not_keep_the_others_capped() -> None:
    cuda = _Cuda({0: 1.0, 1: 1.0}, fail_on=0)
    src = _release_with(cuda)
    with pytest.raises(RuntimeError, match="could not give the allocator its memory fraction back"):
        with src.capped({0: 10 << 30, 1: 10 << 30}):
            pass
    assert cuda.fractions[1] == 1.0
