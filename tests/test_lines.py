"""Per-line memory: the replay of allocator events (its logic, on made-up traces), and --lines on a CPU.

The real allocator's traces are checked on a GPU in tests/gpu/test_lines_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from IPython.core.error import UsageError

import nbmem
from nbmem.cells.peaks import with_trace
from nbmem.records import CellRecord, block_bytes
from nbmem.trace.linetrace import cell_line, line_of_exception, replay
from tests.conftest import last_cell, ok, run

MiB = 2**20
CELL = "<ipython-input-7-abc>"
FILES = frozenset({CELL})


def at(line: int, *inner: tuple[str, int, str]) -> list[dict]:
    """A stack, innermost first: library frames, then the cell's own line."""
    return [{"filename": f, "line": n, "name": fn} for f, n, fn in inner] + [
        {"filename": CELL, "line": line, "name": "<module>"}]


def alloc(addr: int, size: int, frames=None, t: int = 10) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "time_us": t, **({"frames": frames} if frames else {})}


def free(addr: int, size: int, frames=None, t: int = 10) -> dict:
    return {"action": "free_requested", "addr": addr, "size": size, "time_us": t,
            **({"frames": frames} if frames else {})}


def test_blocks_are_what_the_allocator_counts():
    assert [block_bytes(n) for n in (1, 511, 512, 513, 10 * MiB + 1)] == [512, 512, 512, 1024, 10 * MiB + 512]


def test_a_spike_below_an_earlier_peak_is_exact_and_on_its_line():
    start = 100 * MiB
    events = [alloc(1, 64 * MiB, at(2)), free(1, 64 * MiB, at(2)), alloc(2, 8 * MiB, at(3)),
              alloc(3, 32 * MiB, at(4)), free(3, 32 * MiB, at(4)), {"action": "segment_alloc", "size": 2**30},
              {"action": "free_completed", "addr": 3, "size": 32 * MiB}]
    rp = replay(events, device="cuda:0", cell=7, start_allocated=start, end_allocated=start + 8 * MiB,
                cell_files=FILES, sources={2: "a = x.clone()", 3: "kept = ...", 4: "b = y * 2"})
    assert rp.exact and rp.peak_bytes == start + 64 * MiB and rp.peak_line == 2
    by = {r.line: r for r in rp.lines}
    assert by[2].delta_allocated_bytes == 0 and by[2].peak_allocated_bytes == start + 64 * MiB
    assert by[3].delta_allocated_bytes == 8 * MiB and by[4].peak_allocated_bytes == start + 8 * MiB + 32 * MiB
    assert by[2].source == "a = x.clone()" and rp.alloc_line[2] == 3


def test_events_without_a_cell_frame_belong_to_the_line_that_ran_last():
    # loss.backward() allocates on autograd's threads: no Python frames, but line 5 is the one waiting
    events = [alloc(1, MiB, at(5)), alloc(2, 4 * MiB), alloc(3, 4 * MiB), free(2, 4 * MiB)]
    rp = replay(events, device="cuda:0", cell=1, start_allocated=0, end_allocated=5 * MiB, cell_files=FILES)
    assert [(r.line, r.delta_allocated_bytes, r.events) for r in rp.lines] == [(5, 5 * MiB, 4)]


def test_the_deepest_user_frame_of_the_largest_block_at_the_lines_peak():
    model_py = ("/home/me/model.py", 42, "forward")
    torch_py = ("/x/site-packages/torch/nn/modules/linear.py", 125, "forward")
    events = [alloc(1, MiB, at(3, torch_py, model_py)), alloc(2, 64 * MiB, at(3, torch_py, model_py)),
              alloc(3, 2 * MiB, at(3, torch_py))]
    rp = replay(events, device="cuda:0", cell=1, start_allocated=0, end_allocated=67 * MiB, cell_files=FILES)
    (line,) = rp.lines
    assert line.top_frame == "/home/me/model.py:42 in forward"


def test_a_replay_that_ends_elsewhere_than_the_allocator_is_not_called_exact():
    events = [alloc(1, 10 * MiB), free(1, 10 * MiB)]
    rp = replay(events, device="cuda:0", cell=1, start_allocated=0, end_allocated=512 * 1024, cell_files=FILES)
    assert not rp.exact and rp.difference_bytes == -512 * 1024 and rp.note().startswith("≈")


def test_a_recording_the_user_started_is_read_from_the_cells_start_only():
    events = [alloc(1, 100 * MiB, t=5), alloc(2, MiB, t=20)]
    rp = replay(events, device="cuda:0", cell=1, start_allocated=100 * MiB, end_allocated=101 * MiB,
                cell_files=FILES, since_us=10)
    assert rp.exact and rp.events == 1 and rp.peak_bytes == 101 * MiB


def test_an_oom_lists_what_was_live_by_line():
    events = [alloc(1, 8 * MiB, at(2)), alloc(2, 16 * MiB, at(3)),
              {"action": "oom", "size": 80 * 2**30, "device_free": 3 * 2**30, "frames": at(4)}]
    rp = replay(events, device="cuda:0", cell=1, start_allocated=MiB, end_allocated=25 * MiB, cell_files=FILES)
    assert rp.oom is not None and rp.oom.line == 4 and rp.oom.requested_bytes == 80 * 2**30
    assert rp.oom.live_by_line == ((3, 16 * MiB), (2, 8 * MiB), (None, MiB))


def test_the_counter_stays_where_it_knows_and_the_trace_fills_in_where_it_does_not():
    def rec(peak):
        return CellRecord(1, 0.0, 1.0, "cuda:0", 0, 0, 0, 0, peak, "" if peak else "≤ 1.00 GiB", None, None, None,
                          None, None, "")

    exact = replay([alloc(1, MiB, at(2)), free(1, MiB)], device="cuda:0", cell=1, start_allocated=0,
                   end_allocated=0, cell_files=FILES)
    off = replay([alloc(1, MiB)], device="cuda:0", cell=1, start_allocated=0, end_allocated=0, cell_files=FILES)
    (a,) = with_trace([rec(None)], {"cuda:0": exact})
    assert (a.peak_allocated_bytes, a.peak_note, a.peak_line) == (MiB, "", 2)
    (b,) = with_trace([rec(5 * MiB)], {"cuda:0": exact})
    assert b.peak_allocated_bytes == 5 * MiB, "the counter's exact value is not replaced"
    (c,) = with_trace([rec(None)], {"cuda:0": off})
    assert c.peak_allocated_bytes is None and c.peak_note.startswith("≈ 1.00 MiB")


def test_the_line_of_an_exception_in_a_cell():
    code = compile("x = 1\ndef f():\n    raise ValueError\nf()\n", CELL, "exec")
    try:
        exec(code, {})
    except ValueError as e:
        line, user = line_of_exception(e, FILES)
    assert line == 4 and user.endswith("in f") and cell_line([{"filename": "other", "line": 1}], FILES) is None


# -- in the shell, on a CPU --------------------------------------------------------------------------------
def test_lines_on_a_cpu_runs_the_cell_and_says_why_there_are_no_lines(ip):
    r = run(ip, "%%cudamem --lines\nx = torch.ones(1000)")
    assert r.success and ip.user_ns["x"].numel() == 1000
    report = nbmem.ipython.root.session_of(ip).last_report
    assert report.notes == ("per-line figures need a CUDA device: this cell ran on the CPU only",)
    assert nbmem.lines().empty
    with pytest.raises(UsageError, match="not measured with lines"):
        ip.run_line_magic("cudamem", f"lines --cell {last_cell(ip) - 1}")


def test_no_lines_yet_is_a_clear_error(ip):
    with pytest.raises(LookupError, match="no cell was measured with lines yet"):
        nbmem.lines()


def test_asking_for_a_trace_never_starts_cuda(ip):
    sess = nbmem.ipython.root.session_of(ip)
    assert sess.probe.torch.start_trace(stacks=True, max_entries=10) is None
    assert sess.probe.torch.trace_unsupported() == "CUDA is not initialised"
    ok(ip, "%%cudamem --lines\ny = torch.ones(10)")
    assert not torch.cuda.is_initialized()


def test_a_cudamem_body_is_the_innermost_cell_frame_and_cpp_frames_are_not_user_frames():
    outer = {"filename": "<ipython-input-7-outer>", "line": 1, "name": "<module>"}  # the magic call
    files = FILES | {outer["filename"]}
    cpp = {"filename": "??", "line": 0, "name": "torch::unwind::unwind()"}
    frames = [cpp, {"filename": "/x/site-packages/torch/functional.py", "line": 9, "name": "f"},
              {"filename": CELL, "line": 4, "name": "<module>"},
              {"filename": "/x/site-packages/IPython/core/interactiveshell.py", "line": 1, "name": "run_code"},
              outer]
    assert cell_line(frames, files) == 4
    rp = replay([alloc(1, MiB, frames)], device="cuda:0", cell=7, start_allocated=0, end_allocated=MiB,
                cell_files=files, names={CELL: "In[7]"})
    assert [(r.line, r.top_frame) for r in rp.lines] == [(4, "")], "the cell's own line, no C++ frame"
    helper = {"filename": "<ipython-input-3-def>", "line": 2, "name": "step"}
    rp = replay([alloc(1, MiB, [cpp, helper, *frames[2:]])], device="cuda:0", cell=7, start_allocated=0,
                end_allocated=MiB, cell_files=files, names={"<ipython-input-3-def>": "In[3]"})
    assert rp.lines[0].top_frame == "In[3]:2 in step"


def test_the_learnt_cell_frame_is_the_body_and_other_stacks_are_searched():
    # _CellLines tries the body frame's distance from the outer end first: stacks of other depths, other
    # threads' stacks and the magic's own line must still get their own answer.
    outer = {"filename": "<ipython-input-7-outer>", "line": 1, "name": "<module>"}
    files = FILES | {outer["filename"]}
    shell = [{"filename": "/x/site-packages/IPython/core/magic.py", "line": 9, "name": "run_cell_magic"}, outer]
    torch_py = {"filename": "/x/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"}
    thread = [{"filename": "/x/lib/python3.12/threading.py", "line": 1, "name": "run"}] * 3
    step = {"filename": CELL, "line": 2, "name": "step"}  # a function of this cell: not a cell line
    events = [alloc(1, MiB, [torch_py, {"filename": CELL, "line": 3, "name": "<module>"}, *shell]),
              alloc(2, MiB, [torch_py, torch_py, step, {"filename": CELL, "line": 5, "name": "<module>"}, *shell]),
              alloc(3, MiB, shell),  # the magic's own line, before or after the body
              alloc(4, MiB, thread),  # a DataLoader thread: the line that ran last
              alloc(5, MiB, [{"filename": CELL, "line": 6, "name": "<module>"}, *shell])]
    rp = replay(events, device="cuda:0", cell=7, start_allocated=0, end_allocated=5 * MiB, cell_files=files)
    assert [(r.line, r.events) for r in rp.lines] == [(1, 2), (3, 1), (5, 1), (6, 1)]


def test_a_recording_nbmem_started_stops_when_nbmem_unloads_inside_the_cell(ip, monkeypatch):
    # The trace itself needs CUDA (tests/gpu checks the real one); here, that the session stops what it
    # started for a cell that never ends, and leaves a recording of the user's alone.
    from nbmem.measure.sources import Trace

    for owner, expect in (("nbmem", [("nbmem", False)]), ("user", [])):
        src = nbmem.ipython.root.session_of(ip).probe.torch
        stopped: list = []
        monkeypatch.setattr(src, "start_trace", lambda *, stacks, max_entries, o=owner: Trace(o, 0, stacks, 10))
        monkeypatch.setattr(src, "finish_trace", lambda tr, *, read, s=stopped: s.append((tr.owner, read)))
        ok(ip, "%cudamem on --lines")  # from the next cell on: this one began without a recording
        ok(ip, "%unload_ext nbmem")  # began with one, and never ends for nbmem
        assert stopped == expect, owner
        ok(ip, "%load_ext nbmem")
        ok(ip, "%cudamem on")


def _codes():
    """A cell's module code and a helper function of another cell, as real code objects."""
    ns: dict = {}
    exec(compile("def step():\n    pass\n", "<ipython-input-3-def>", "exec"), ns)
    return compile("x = 1\n", CELL, "exec"), ns["step"].__code__


def test_events_get_the_user_stack_that_ran_at_their_time():
    cell, step = _codes()
    # the cell's line 2 calls step() (its line 2 allocates), returns, line 3 only frees, line 4 allocates
    marks = [(10, cell, 2), (20, step, 2), (30, step, -1), (40, cell, 3), (50, cell, 4)]
    events = [alloc(1, 64 * MiB, t=25), alloc(2, MiB, t=35), free(1, 64 * MiB, t=45), alloc(3, 2 * MiB, t=55)]
    from nbmem.trace.linetrace import with_marked_frames

    with_marked_frames(events, marks)
    assert [e["frames"][0]["name"] for e in events] == ["step", "<module>", "<module>", "<module>"]
    rp = replay(events, device="cuda:0", cell=7, start_allocated=0, end_allocated=3 * MiB, cell_files=FILES,
                names={"<ipython-input-3-def>": "In[3]"})
    by = {r.line: r for r in rp.lines}
    assert (by[2].delta_allocated_bytes, by[3].delta_allocated_bytes, by[4].delta_allocated_bytes) == (
        65 * MiB, -64 * MiB, 2 * MiB), "the line that only frees gets its frees"
    assert by[2].top_frame == "In[3]:2 in step" and rp.peak_line == 2


def test_a_callee_that_left_without_a_mark_is_popped_when_its_caller_runs_again():
    cell, step = _codes()
    from nbmem.trace.linetrace import with_marked_frames

    events = [alloc(1, MiB, t=25)]
    with_marked_frames(events, [(10, cell, 2), (15, step, 1), (20, cell, 3)])
    assert [(f["name"], f["line"]) for f in events[0]["frames"]] == [("<module>", 3)]


@pytest.mark.skipif(not hasattr(__import__("sys"), "monitoring"), reason="sys.monitoring needs Python 3.12")
def test_the_line_clock_marks_the_users_lines_on_the_cells_thread_only():
    import json
    import threading

    from nbmem.trace.lineclock import LineClock

    ns: dict = {"json": json, "threading": threading}
    code = compile("def f():\n    return 1\nt = threading.Thread(target=f)\nt.start(); t.join()\n"
                   "json.dumps({'a': 1})\ny = f()\n", CELL, "exec")
    clock = LineClock()
    assert clock.start()
    try:
        exec(code, ns)
    finally:
        marks = clock.stop()
    seen = [(c.co_filename, c.co_name, ln) for _t, c, ln in marks]
    assert (CELL, "<module>", 3) in seen and (CELL, "<module>", 6) in seen
    assert seen.count((CELL, "f", 2)) == 1, "f ran twice, once on another thread: only the cell's is marked"
    assert not any("json" in f or "threading" in f for f, _n, _l in seen), "library code is not marked"
    assert [t for t, _c, _l in marks] == sorted(t for t, _c, _l in marks)
    assert LineClock.unsupported() is None, "the tool id was given back"


def test_line_numbers_count_from_the_first_line_ipython_compiles(ip):
    # IPython drops a cell's leading blank lines before compiling it: the source shown beside line N must
    # be the line its code calls N, in %%cudamem bodies and in %cudamem on cells alike.
    from nbmem.cells.watch import as_compiled

    assert as_compiled("\n  \nfor x in y:\n\n    z = 1\n") == "for x in y:\n\n    z = 1"
    assert as_compiled("a = 1") == "a = 1" and as_compiled("") == ""
    r = run(ip, "\n\nraise ValueError('on line 1 of the compiled cell')")
    assert line_of_exception(r.error_in_exec, ip.compile._filename_map and frozenset(
        k for k, v in ip.compile._filename_map.items() if v == last_cell(ip)))[0] == 1


def test_events_after_the_marks_ran_out_have_no_line_but_count_toward_the_peak():
    cell, _step = _codes()
    from nbmem.trace.linetrace import with_marked_frames

    events = [alloc(1, MiB, t=15), alloc(2, 8 * MiB, t=30), free(2, 8 * MiB, t=31)]
    with_marked_frames(events, [(10, cell, 2)], until_us=20)
    rp = replay(events, device="cuda:0", cell=7, start_allocated=0, end_allocated=MiB, cell_files=FILES)
    assert [(r.line, r.delta_allocated_bytes, r.events) for r in rp.lines] == [(2, MiB, 1)]
    assert rp.exact and rp.peak_bytes == 9 * MiB and rp.peak_line is None


def test_recording_that_fails_half_way_leaves_nothing_running(ip, monkeypatch):
    # The clock (sys.monitoring, 3.12+) starts before the trace; when the trace then fails, the clock
    # stops too: a fake clock stands in for it here so that this runs on every Python.
    import nbmem.trace.recording as recording_mod

    started, stopped = [], []

    class Clock:
        def __init__(self, max_marks: int) -> None:
            self.full_at_us = None
            self.max_marks = max_marks

        @staticmethod
        def unsupported():
            return None

        def start(self) -> bool:
            started.append(self)
            return True

        def stop(self) -> list:
            stopped.append(self)
            return []

    def boom(*, stacks, max_entries):
        raise RuntimeError("the allocator said no")

    sess = nbmem.ipython.root.session_of(ip)
    monkeypatch.setattr(recording_mod, "LineClock", Clock)
    monkeypatch.setattr(sess.probe.torch, "start_trace", boom)
    ok(ip, "%cudamem on --lines")
    ok(ip, "x = 1")  # the cell runs; the failure is recorded, not raised
    assert started and stopped == started
    assert any("allocator said no" in f for f in map(str, sess.faults))


@pytest.mark.skipif(not hasattr(__import__("sys"), "monitoring"), reason="sys.monitoring needs Python 3.12")
def test_the_line_clock_is_bounded_and_hands_its_tool_id_back_as_it_found_it():
    import json
    import sys

    from nbmem.trace.lineclock import LineClock

    mon = sys.monitoring
    code = compile("for i in range(1000):\n    y = i\n", CELL, "exec")
    clock = LineClock(max_marks=100)
    assert clock.start()
    tool = clock._tool
    try:
        json.dumps({"a": [1, 2]})  # library lines: switched off for nbmem's tool
        exec(code, {})
    finally:
        marks = clock.stop()
    assert len(marks) == 100 and clock.full_at_us is not None, "a Python-heavy cell stops being marked"
    seen = []
    mon.use_tool_id(tool, "someone else")
    try:
        mon.register_callback(tool, mon.events.LINE, lambda code, line: seen.append(code.co_filename))
        mon.set_events(tool, mon.events.LINE)
        json.dumps({"a": [1, 2]})
        mon.set_events(tool, 0)
        mon.register_callback(tool, mon.events.LINE, None)
    finally:
        mon.free_tool_id(tool)
    assert any("json" in f for f in seen), "the next tool on this id sees the library lines nbmem switched off"


def test_an_out_of_memory_error_names_its_line_and_the_users_function_it_came_through(ip):
    # The advice names the frame as the lines table does (one rule for "the user's own code"): a helper
    # from another cell as In[N], never a library's or the standard library's frame.
    ok(ip, "import contextlib\ndef step():\n    with contextlib.nullcontext():\n"
           "        raise RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB')")
    helper = last_cell(ip)
    r = run(ip, "x = 1\nstep()")
    assert not r.success
    advice = nbmem.ipython.root.session_of(ip).last_report.advice
    assert advice[0] == f"the allocation that failed was asked for by line 2: step() (in In[{helper}]:4 in step)"


def test_an_inexact_peak_says_what_the_trace_missed_in_a_readers_units():
    from nbmem.trace.linetrace import Replay

    def note(diff: int) -> str:
        return Replay("cuda:0", 20 * 2**30, False, diff, 10, None, (), {}, None).note()

    # The 7B notebook's gauge read "(-31,064,064 bytes unaccounted)": a sign a reader had to decode.
    assert note(-31_064_064) == "≈ from the allocator's trace (it missed 29.6 MiB the allocator counted)"
    assert note(2 * 2**20) == "≈ from the allocator's trace (it has 2.00 MiB the allocator did not count)"
    assert Replay("cuda:0", 1, True, 0, 1, None, (), {}, None).note() == ""
