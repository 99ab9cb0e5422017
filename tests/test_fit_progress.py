"""A fit you can watch (issue 36), on the CPU: the progress line as the runner drives it (a fit whose CUDA is stood
in for, its body the real one), what it says and when, how a terminal and a kernel draw it, and an interrupted fit
that puts everything back and says so in one line."""

from __future__ import annotations

import functools
import io
import json
import os
import signal
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
from IPython.display import display
from IPython.utils.capture import capture_output

torch = pytest.importorskip("torch")

from nbmem.fitting.runs import progress, runner  # noqa: E402
from nbmem.fitting.runs.progress import FitProgress  # noqa: E402
from tests import test_fit_remedies  # noqa: E402
from tests.test_fit_remedies import FakeSource, Net, attrs, seeded_net  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def python_handles_ctrl_c() -> Any:
    """Python's own SIGINT handler, as an interactive session has it: a test run started where SIGINT is ignored
    (a CI job in the background, nohup) has SIG_IGN instead, and the presses these tests make would be lost."""
    was = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, was)


class Clock:
    """Time as the body spends it (the body moves it on)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Shown:
    """A ``show`` callback that keeps what it was asked to draw."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def __call__(self, text: str, final: bool) -> None:
        self.calls.append((text, final))


# -- the line, as the runner drives it ------------------------------------------------------------------------------
@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``test_fit_remedies``' fit on the CPU: CUDA stood in for, the body the real one, its traces made up."""
    return test_fit_remedies.stand_in.__wrapped__(monkeypatch)  # type: ignore[attr-defined,no-any-return]


@pytest.fixture
def clocked(stand_in: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(runner, "FitProgress", functools.partial(FitProgress, clock=clock))
    return clock


def test_each_run_of_a_fit_is_a_step_of_the_line_and_the_line_goes_when_the_fit_ends(
        stand_in: dict[str, Any], clocked: Clock) -> None:
    net = Net()
    stand_in["net"].append(net)

    def step(b: int) -> None:
        clocked.now += 0.1 * b  # 0.8 s at 8: the warm-up and the first run are quiet, the line shows from 1 s
        net(torch.randn(b, 8)).sum().backward()

    shown = Shown()
    res = runner.fit(step, [8, 16, 32], source=FakeSource(), name="batch", modules=[net], margin_bytes=0,  # type: ignore[arg-type]
                     show=shown)
    ran = [v for v, _ in stand_in["runs"]]
    assert ran[:4] == [8, 8, 16, 32] and len(ran) > 4, "the warm-up, the values, and runs nearer the answer"
    assert res.largest_value is not None
    lines = [t for t, final in shown.calls if not final and " · batch=" in t]  # a line per run (not the totals)
    # the last trace is the two steps at the answer (``nearby.confirm``): a line for each
    assert len(lines) == len(ran) - 1 and shown.calls[-1] == ("", True), "quiet for the first second; gone at the end"
    # at most: the warm-up and 3 values, 3 runs near the answer, 2 × 2 steps at it, 3 × 3 steps past it
    assert lines[0] == "nbmem fit: run 3 of 4–20 · batch=16 · 1.60 s so far"
    assert lines[1].startswith("nbmem fit: run 4 of 4–20 · batch=32 · 3.20 s so far")
    assert [t.split(" · ")[1] for t in lines] == [f"batch={v:,}" for v in [*ran[2:], ran[-1]]]


def test_a_run_that_will_take_long_is_said_before_it_starts_with_its_time(
        stand_in: dict[str, Any], clocked: Clock) -> None:
    net = Net()
    stand_in["net"].append(net)

    shown = Shown()
    on_screen: dict[int, str] = {}  # what the line said as each run began

    def step(b: int) -> None:
        on_screen[b] = shown.calls[-1][0] if shown.calls else ""
        clocked.now += 0.25 * b  # 8 s at 32: the run nearer the answer, at 72, takes 18 s
        net(torch.randn(b, 8)).sum().backward()

    runner.fit(step, [8, 16, 32], source=FakeSource(), name="batch", modules=[net], margin_bytes=0,  # type: ignore[arg-type]
               show=shown)
    ran = [v for v, _ in stand_in["runs"]]
    assert ran[4] == 72, ran
    assert on_screen[72].endswith("batch=72 · 16.00 s so far · this run will take about 18 s"), (
        "said before the long run starts, with how long it will take")
    said = [t for t, _ in shown.calls if "this run will take" in t]
    assert said and said[0].startswith("nbmem fit: run 5 of 5–20 · batch=72 · 16.00 s so far")
    assert said[0].endswith(" · this run will take about 18 s")
    assert not any("will take" in t for t, _ in shown.calls[:3]), "runs estimated shorter are not"


def test_the_runs_near_the_answer_are_said_before_they_start_with_their_time_in_all(
        stand_in: dict[str, Any], clocked: Clock) -> None:
    """Each of them takes under ``LONG_S``, together more: the line says so before the first, and while they run."""
    net = Net()
    stand_in["net"].append(net)
    shown = Shown()
    on_screen: dict[int, str] = {}

    def step(b: int) -> None:
        on_screen[b] = shown.calls[-1][0] if shown.calls else ""
        clocked.now += 0.12 * b  # 3.84 s at 32; the runs nearer the answer, at 72 and beyond, 8.6 s and more each
        net(torch.randn(b, 8)).sum().backward()

    runner.fit(step, [8, 16, 32], source=FakeSource(), name="batch", modules=[net], margin_bytes=0,  # type: ignore[arg-type]
               show=shown)
    ran = [v for v, _ in stand_in["runs"]]
    assert len(ran) > 4 and ran[4] > 32, ran
    first_near = on_screen[ran[4]]
    assert "the runs near the answer will take about" in first_near and first_near.endswith(" in all"), first_near
    assert "this run will take" not in first_near, "each run alone is short"
    assert not any("near the answer" in on_screen[v] for v in ran[:4]), "not before the runs it is about"


def test_ahead_says_nothing_for_runs_that_are_short_together() -> None:
    shown = Shown()
    clock = Clock()
    p = FitProgress(shown, "batch", 4, 7, clock=clock)
    p.step(10)
    clock.now += 2.0
    p.step(20)
    p.ahead([30, 40], "the runs near the answer")  # 6 s + 8 s: 14 s, under LONG_S
    assert not any("near the answer" in t for t, _ in shown.calls)
    p.ahead([30, 40, 50], "the runs near the answer")  # 24 s
    assert shown.calls[-1][0].endswith("the runs near the answer will take about 24 s in all"), shown.calls[-1]


class Compiling:
    """A body torch.compile'd: its first run at each value in ``compiles`` makes a graph, which takes that long."""

    def __init__(self, clock: Clock, compiles: dict[int, float], step_s: float = 0.001) -> None:
        self.clock, self.compiles, self.step_s, self.graphs = clock, dict(compiles), step_s, 0

    def __call__(self, v: int) -> None:
        if v in self.compiles:
            self.graphs += 1
            self.clock.now += self.compiles.pop(v)
        self.clock.now += self.step_s * v


def test_a_first_compile_that_took_long_says_what_the_fit_will_take_until_that_time_is_up() -> None:
    shown = Shown()
    clock = Clock()
    body = Compiling(clock, {8: 14.0})
    p = FitProgress(shown, "batch", 5, 12, clock=clock, graphs=lambda: body.graphs)
    run = p.watch(body)
    run(8)
    run(16)
    assert "this run will take" not in shown.calls[-1][0], "the compile's time is not the step's"
    assert shown.calls[-1][0].endswith("torch.compile compiles a graph at each new range of batch (the first took "
                                       "14 s): this fit takes about 42 s, most of it compiling"), shown.calls[-1]
    clock.now += 30.0
    run(32)
    assert p.expected_s(16_000) == pytest.approx(16.0), "scaled from the run at 16 alone"
    assert "compiling" not in shown.calls[-1][0], "not once the time it gave is up"
    assert p.compile_s == pytest.approx(14.0 + 0.008)
    quick = FitProgress(Shown(), "batch", 5, 12, clock=clock, graphs=lambda: small.graphs)
    small = Compiling(clock, {8: 3.0})  # a small graph: the fit stays short, nothing is said
    run = quick.watch(small)
    run(8)
    clock.now += 1.0
    run(16)
    assert "compil" not in quick.show.calls[-1][0]  # type: ignore[attr-defined]


def test_a_compile_in_the_first_of_two_steps_under_one_run_is_not_a_steps_time() -> None:
    """The check at the answer runs the watched body twice in one run (``nearby._steps``): the compile is told
    apart per step, so the second step's time is the one kept."""
    clock = Clock()
    body = Compiling(clock, {1000: 20.0}, step_s=0.01)
    p = FitProgress(Shown(), "batch", 5, 12, clock=clock, graphs=lambda: body.graphs)
    run = p.watch(body)
    run(1000)
    run(1000)
    p.step(10)
    assert p.expected_s(1000) == pytest.approx(10.0), "the step's 10 s, not the compiling run's 30 s"


def test_a_run_that_failed_gives_no_steps_time() -> None:
    clock = Clock()
    p = FitProgress(Shown(), "batch", 5, 12, clock=clock)

    def body(v: int) -> None:
        clock.now += 1.0
        if v > 50:
            raise RuntimeError("CUDA out of memory")

    run = p.watch(body)
    run(10)
    with pytest.raises(RuntimeError):
        run(100)
    p.step(20)
    assert p.expected_s(100) == pytest.approx(10.0), "from the run at 10; the failed one stopped halfway"


def test_the_fits_note_says_how_long_the_runs_that_compiled_took(stand_in: dict[str, Any], clocked: Clock,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    net = Net()
    stand_in["net"].append(net)
    body = Compiling(clocked, {8: 14.0, 16: 9.0})
    monkeypatch.setattr(runner, "graphs_compiled", lambda: body.graphs)

    def step(b: int) -> None:
        body(b)
        net(torch.randn(b, 8)).sum().backward()

    res = runner.fit(step, [8, 16, 32], source=FakeSource(), name="batch", modules=[net], margin_bytes=0)  # type: ignore[arg-type]
    said = [n for n in res.notes if n.startswith("the runs during which torch.compile made a graph took")]
    assert len(said) == 1 and said[0].startswith("the runs during which torch.compile made a graph took 23.02 s of "
                                                 "the fit's "), res.notes


def test_a_compiled_models_fit_says_at_its_first_run_that_compiling_comes_first() -> None:
    shown = Shown()
    clock = Clock()
    FitProgress(shown, "batch", 5, 12, clock=clock, compiled_model=True).step(8)
    assert shown.calls == [("nbmem fit: run 1 of 5–12 · batch=8 · a torch.compile'd model: it compiles a graph first "
                            "at each new range of batch, often 10 s or more each", False)], "at once, not a second on"
    plain = Shown()
    FitProgress(plain, "batch", 5, 12, clock=clock).step(8)
    assert not plain.calls


def test_the_runner_tells_the_line_when_a_module_is_torch_compiled(stand_in: dict[str, Any], clocked: Clock) -> None:
    net = Net()
    stand_in["net"].append(net)

    class OptimizedModule(torch.nn.Module):  # what torch.compile wraps a module in, by name
        def __init__(self) -> None:
            super().__init__()
            self._orig_mod = net

    def step(b: int) -> None:
        net(torch.randn(b, 8)).sum().backward()

    for modules, first in (([OptimizedModule()], True), ([net], False)):
        shown = Shown()
        runner.fit(step, [8, 16, 32], source=FakeSource(), name="batch", modules=modules, margin_bytes=0,  # type: ignore[arg-type]
                   show=shown)
        said = [t for t, _ in shown.calls if "torch.compile'd" in t]
        assert said == ([shown.calls[0][0]] if first else []), shown.calls[:2]
        assert not first or said[0].startswith("nbmem fit: run 1 of 4–20 · batch=8 · ")


def test_a_runs_expected_time_is_scaled_from_the_runs_own_time_not_the_analysis_between_runs() -> None:
    clock = Clock()
    p = FitProgress(Shown(), "batch", 4, 7, clock=clock)

    def body(v: int) -> None:
        clock.now += v / 100  # 0.32 s at 32

    run = p.watch(body)
    run(16)
    run(32)
    clock.now += 5.0  # the fit's analysis after the small runs
    p.step(64)
    assert p.expected_s(3200) == pytest.approx(32.0), "0.32 s at 32, scaled; not 5.32 s"


def test_a_fit_interrupted_puts_everything_back_and_says_so_in_one_line(
        stand_in: dict[str, Any], clocked: Clock) -> None:
    """Ctrl-C during a run under a remedy: the remedy undone, the training state and the RNG put back, the error
    told what was put back, and the line left final saying so."""
    net, opt, weights, before, rng = seeded_net(stand_in)

    calls: list[tuple[int, bool]] = []

    def step(b: int) -> None:
        clocked.now += 0.5
        calls.append((b, "forward" in vars(net.blocks[0])))
        if calls[-1][1]:  # checkpointed: the fit is measuring the remedy
            raise KeyboardInterrupt
        net(torch.randn(b, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    shown = Shown()
    with pytest.raises(KeyboardInterrupt) as e:
        runner.fit(step, [8, 16, 32], source=FakeSource(), name="batch", modules=[net], optimizers=[opt],  # type: ignore[arg-type]
                   margin_bytes=0, want=10_000, show=shown)
    steps = len(calls)
    assert calls[-1] == (8, True) and not any(c for _, c in calls[:-1]), "stopped in the remedy's warm-up"
    assert attrs(net) == before, "the remedy was undone"
    assert all(torch.equal(w, p) for w, p in zip(weights, net.parameters(), strict=True))
    assert not opt.state and all(p.grad is None for p in net.parameters())
    assert torch.equal(rng, torch.get_rng_state())
    told = f"stopped after {steps} runs of the body; training state put back; memory allocated is back where it was"
    assert e.value.__notes__ == [f"nbmem fit: {told}"]
    text, final = shown.calls[-1]
    assert final and "\n" not in text
    assert text == f"nbmem fit interrupted at batch=8 after {clocked.now:.2f} s: {told}"


class Workspaces(FakeSource):
    """The allocator with cuBLAS's workspaces: the body's first matrix product makes 4 MiB of them, which stay
    allocated until they are cleared."""

    def __init__(self) -> None:
        self.workspace_bytes = 0
        self.cleared = 0

    def read(self, device: int) -> Any:
        return type("Reading", (), {"allocated_bytes": self.workspace_bytes, "reserved_bytes": self.workspace_bytes})()

    def clear_cublas_workspaces(self) -> bool:
        self.cleared += 1
        self.workspace_bytes = 0
        return True


def test_ctrl_c_while_the_user_state_is_put_back_before_a_remedys_runs_waits_then_stops_the_fit(
        stand_in: dict[str, Any], clocked: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real SIGINT while the workspaces go back before a remedy's runs (the user's given back, not yet made
    again): that finishes, then the fit stops, everything put back, and no remedy ran."""
    net, opt, weights, _, _ = test_fit_remedies.seeded_net(stand_in)
    real = runner.give_back_workspaces
    calls: list[bool] = []

    def give_back(src: Any, before: Any) -> Any:
        calls.append(True)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGINT)  # Python's own handler would raise here, halfway
        return real(src, before)

    monkeypatch.setattr(runner, "give_back_workspaces", give_back)
    src = Workspaces()

    def step(b: int) -> None:
        net(torch.randn(b, 8)).square().mean().backward()
        src.workspace_bytes = 4 << 20
        opt.step()
        opt.zero_grad(set_to_none=True)

    with pytest.raises(KeyboardInterrupt):
        runner.fit(step, [8, 16, 32], source=src, name="batch", modules=[net], optimizers=[opt],  # type: ignore[arg-type]
                   margin_bytes=0, want=10_000)
    assert len(calls) == 1 and src.cleared == 1 and src.workspace_bytes == 0, "the give-back ran to its end"
    assert not any(ckpt for _, ckpt in stand_in["runs"]), "no remedy's run after the press"
    assert all(torch.equal(w, p) for w, p in zip(weights, net.parameters(), strict=True)) and not opt.state
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("restore", [True, False])
def test_a_remedys_first_run_finds_none_of_the_workspaces_the_plain_runs_made(
        stand_in: dict[str, Any], clocked: Clock, restore: bool) -> None:
    net = Net()
    stand_in["net"].append(net)
    src = Workspaces()
    found: dict[bool, int] = {}

    def step(b: int) -> None:
        found.setdefault("forward" in vars(net.blocks[0]), src.workspace_bytes)
        net(torch.randn(b, 8)).sum().backward()
        src.workspace_bytes = 4 << 20

    res = runner.fit(step, [8, 16, 32], source=src, name="batch", modules=[net], margin_bytes=0,  # type: ignore[arg-type]
                     want=10_000, restore=restore)
    assert [r.name for r in res.remedies][-1] == "activation checkpointing"
    assert found == {False: 0, True: 0}, "the remedy starts as the user's next cell would, restored or not"


@pytest.mark.parametrize("first", [KeyboardInterrupt, None])
def test_ctrl_c_again_while_the_fit_puts_things_back_waits_until_they_are_back(
        stand_in: dict[str, Any], clocked: Clock, monkeypatch: pytest.MonkeyPatch, first: type[BaseException] | None
) -> None:
    """A real SIGINT in the middle of putting the training state back: the state is all back first, and cuBLAS's
    workspaces given back; then a fit that ended well stops, saying so in its error and its line, and one already
    interrupted stays so (the press dropped, the first one's line kept)."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    torch.manual_seed(0)
    net = Net()
    stand_in["net"].append(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    weights = [p.detach().clone() for p in net.parameters()]
    put_back = runner.restore_state

    def restore_pressed(saved: Any) -> Any:
        signal.raise_signal(signal.SIGINT)  # the handler runs now: Python's own would raise here, halfway
        return put_back(saved)

    monkeypatch.setattr(runner, "restore_state", restore_pressed)
    src = Workspaces()

    def step(b: int) -> None:
        clocked.now += 0.5
        net(torch.randn(b, 8)).square().mean().backward()
        src.workspace_bytes = 4 << 20
        opt.step()
        opt.zero_grad(set_to_none=True)
        if first is not None and b == 16:
            raise first

    shown = Shown()
    with pytest.raises(KeyboardInterrupt) as e:
        runner.fit(step, [8, 16, 32], source=src, name="batch", modules=[net], optimizers=[opt],  # type: ignore[arg-type]
                   margin_bytes=0, show=shown)
    assert all(torch.equal(w, p) for w, p in zip(weights, net.parameters(), strict=True)) and not opt.state
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "Python's handler is back"
    text, final = shown.calls[-1]
    if first is None:
        runs = len(stand_in["runs"]) + 1  # the last trace: the two steps at the answer
        assert src.cleared == 1 and src.workspace_bytes == 0, "cuBLAS's workspaces went before the fit stopped"
        told = (f"stopped after {runs} runs of the body; training state put back; memory allocated is back where "
                "it was")
        assert e.value.__notes__ == [f"nbmem fit: {told}"] and e.value.__context__ is None
        assert final and text == f"nbmem fit interrupted at batch={stand_in['runs'][-1][0]:,} after " \
                                 f"{clocked.now:.2f} s: {told}", "the line stays, saying so"
    else:
        assert e.value.__notes__[0].startswith("nbmem fit: stopped after 3 runs of the body; training state put back")
        assert final and text.startswith("nbmem fit interrupted at batch=16")


def test_a_handler_of_the_notebooks_is_left_alone_and_other_threads_are_not_held() -> None:
    seen: list[int] = []
    mine = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with progress.interrupts_held() as held:
            signal.raise_signal(signal.SIGINT)
        assert seen == [signal.SIGINT], "the notebook's own handler ran, as it would have without the fit"
        assert not held.pressed, "and the fit was not told of a press it never held"
    finally:
        signal.signal(signal.SIGINT, mine)
    went_on = []
    with progress.interrupts_held() as held:
        signal.raise_signal(signal.SIGINT)
        went_on.append("the block went on to its end")
        os.kill(os.getpid(), signal.SIGINT)
    assert went_on == ["the block went on to its end"] and held.count == 2, "both presses kept, none raised"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    untouched: list[bool] = []
    t = threading.Thread(target=lambda: untouched.append(_handler_untouched_in_a_thread()))
    t.start()
    t.join()
    assert untouched == [True], "outside the main thread there is nothing to hold (signals go to the main thread)"


def _handler_untouched_in_a_thread() -> bool:
    with progress.interrupts_held():
        return signal.getsignal(signal.SIGINT) is signal.default_int_handler


# -- the line itself --------------------------------------------------------------------------------------------------
def test_the_line_says_which_run_of_about_how_many_at_which_value_and_the_time_so_far() -> None:
    clock, shown = Clock(), Shown()
    p = FitProgress(shown, "batch", *progress.planned_runs(4, 3, 0), clock=clock)
    p.step(8)
    assert shown.calls == [] and p.expected_s(8) is None, "quiet: no line for a fit shorter than a second"
    clock.now = 2.0
    p.step(8)
    clock.now = 6.0
    p.step(16_384)
    assert shown.calls == [("nbmem fit: run 2 of 4–7 · batch=8 · 2.00 s so far", False),
                           ("nbmem fit: run 3 of 4–7 · batch=16,384 · 6.00 s so far · this run will take about 137 min",
                            False)], "4 s at 8, the last run there, scaled to 16,384"
    p.done()
    assert shown.calls[-1] == ("", True)
    assert progress.planned_runs(4, 3, 2) == (4, 7 * 3 + 6), "under each of 2 remedies as many again, and timed steps"
    shown = Shown()
    many = FitProgress(shown, "n", 2, 3, clock=clock)
    clock.now = 10.0
    for _ in range(5):
        many.step(1)
    assert shown.calls[-1][0].startswith("nbmem fit: run 5 of 5 · n=1 · 4.00 s so far"), "never fewer than it ran"


def test_a_fit_that_ended_before_a_line_was_shown_shows_nothing_and_an_interrupt_is_still_said() -> None:
    shown = Shown()
    p = FitProgress(shown, "batch", 4, 7, clock=Clock())
    p.step(8)
    p.done(ValueError("the body's own error"))
    assert shown.calls == []
    p.done(KeyboardInterrupt())
    assert shown.calls == [("nbmem fit interrupted at batch=8 after 0 ms: stopped after 1 run of the body", True)]


def test_on_a_terminal_the_line_is_written_over_itself_cut_to_the_width_and_erased() -> None:
    out = io.StringIO()
    show = progress.terminal_line(lambda: out, width=lambda: 30)
    show("nbmem fit: run 1 of 4 · batch=8", False)
    show("run 2", False)
    show("", True)
    assert out.getvalue() == ("\rnbmem fit: run 1 of 4 · batch\r" "run 2" + " " * 24 + "\r" + " " * 5 + "\r")
    out = io.StringIO()
    show = progress.terminal_line(lambda: out, width=lambda: 80)
    show("nbmem fit: run 1", False)
    show("interrupted", True)
    assert out.getvalue().endswith("\rinterrupted     \n"), "a final line stays, and the prompt comes below it"
    out = io.StringIO()
    show = progress.terminal_line(lambda: out, width=lambda: 30)
    show("nbmem fit interrupted at batch=8: training state put back", True)
    assert out.getvalue() == "\rnbmem fit interrupted at batch=8: training state put back\n", "whole: not written over"


def test_in_a_kernel_the_line_is_one_output_updated_in_place(shell: Any) -> None:
    show = progress.display_line(display)
    with capture_output() as cap:
        show("nbmem fit: run 2 of 4", False)
        show("nbmem fit: run 3 of 4", False)
        show("", True)
    ids = [o.transient["display_id"] for o in cap.outputs]
    assert len(set(ids)) == 1 and [o.update for o in cap.outputs] == [False, True, True]
    assert [o.data for o in cap.outputs] == [{"text/plain": "nbmem fit: run 2 of 4"},
                                             {"text/plain": "nbmem fit: run 3 of 4"}, {"text/plain": ""}]


def test_a_line_that_cannot_be_drawn_is_recorded_once_and_the_fit_goes_on() -> None:
    faults: list[Exception] = []

    def broken(text: str, final: bool) -> None:
        raise OSError("stdout closed")

    show = progress.guarded(broken, faults.append)
    show("a", False)
    show("b", False)
    assert [str(f) for f in faults] == ["stdout closed"]


# -- the adapter: a Jupyter kernel, and terminal IPython ------------------------------------------------------------
FIT_STOOD_IN = textwrap.dedent("""
    from nbmem.fitting.runs.progress import FitProgress
    from nbmem.session import Session

    def fit(self, body, name, values, *, show=None, **kw):
        clock = iter([0.0, 2.0, 4.0, 6.0, 8.0]).__next__
        p = FitProgress(show, name, 2, 3, clock=clock)
        p.step(8)
        p.step(16)
        p.done()
        return "fitted"

    Session.fit = fit
""")


@pytest.mark.slow
def test_in_a_jupyter_kernel_a_fits_line_is_one_output_updated_in_place_and_emptied(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real kernel (jupyter_client): ``%%cudamem --fit`` hands the fit a line drawn as one display output,
    updated in place (the fit itself is stood in for, as it needs CUDA: it drives the line as the runner does)."""
    jupyter_client = pytest.importorskip("jupyter_client")
    spec = tmp_path / "jupyter" / "kernels" / "nbmem-progress"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "nbmem", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    km = jupyter_client.KernelManager(kernel_name="nbmem-progress")
    km.start_kernel(cwd=str(ROOT), env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt")})
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        for code in (FIT_STOOD_IN, "%load_ext nbmem"):
            assert kc.execute_interactive(code, timeout=60)["content"]["status"] == "ok"
        got: list[dict[str, Any]] = []
        reply = kc.execute_interactive("%%cudamem --fit batch=8,16\nx = batch", timeout=60, output_hook=got.append)
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    shown = [m for m in got if m["msg_type"] in ("display_data", "update_display_data")]
    line = next(m for m in shown if m["content"]["data"].get("text/plain", "").startswith("nbmem fit"))
    line_id = line["content"]["transient"]["display_id"]
    assert [(m["msg_type"], m["content"]["data"]) for m in shown
            if m["content"].get("transient", {}).get("display_id") == line_id] == [
        ("display_data", {"text/plain": "nbmem fit: run 1 of 2–3 · batch=8 · 2.00 s so far"}),
        ("update_display_data", {"text/plain": "nbmem fit: run 2 of 2–3 · batch=16 · 4.00 s so far"}),
        ("update_display_data", {"text/plain": ""})], got
    results = [m for m in got if m["msg_type"] in ("display_data", "execute_result")
               and m["content"]["data"].get("text/plain") == "'fitted'"]
    assert results and got.index(results[0]) > max(got.index(m) for m in got if m["msg_type"] == "update_display_data")


@pytest.mark.parametrize("raises", [KeyboardInterrupt, SystemExit])
def test_only_an_interrupt_among_base_exceptions_is_told_what_was_put_back(raises: type[BaseException]) -> None:
    e = raises()
    runner._say_what_was_put_back(e, FakeSource(), [0], {0: 0}, (("weights",), ()), 3)  # type: ignore[arg-type]
    assert getattr(e, "__notes__", []) == (["nbmem fit: stopped after 3 runs of the body; training state put back; "
                                            "memory allocated is back where it was"] if raises is KeyboardInterrupt
                                           else [])



def test_ctrl_c_while_a_run_is_being_undone_waits_until_the_namespace_is_back(stand_in: dict[str, Any]) -> None:
    """A press while a run's cleanup puts the namespace back (a second press, after the one that stopped the body,
    or the first): the cleanup finishes, then the fit stops, its training state put back."""
    net, opt, weights, before, _ = seeded_net(stand_in)
    ns: dict[str, Any] = {}
    cleaned: list[bool] = []

    def step(b: int) -> None:
        ns["out"] = net(torch.randn(b, 8))
        ns["out"].square().mean().backward()
        opt.step()

    def clean() -> None:
        signal.raise_signal(signal.SIGINT)  # Python's own handler would raise here, halfway through
        ns.clear()
        cleaned.append(True)

    with pytest.raises(KeyboardInterrupt):
        runner.fit(step, [8, 16, 32], source=FakeSource(), name="batch", clean=clean, modules=[net],  # type: ignore[arg-type]
                   optimizers=[opt], margin_bytes=0)
    assert cleaned == [True] and not ns, "the run was undone, the namespace put back, before the fit stopped"
    assert attrs(net) == before and all(torch.equal(w, p) for w, p in zip(weights, net.parameters(), strict=True))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
