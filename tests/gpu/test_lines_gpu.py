"""On a real GPU: exact peaks and per-line memory from the allocator's trace (issue 13)."""

from __future__ import annotations

import pandas as pd

import nbmem
from nbmem.ipython.root import session_of
from tests.conftest import last_cell, ok, run
from tests.gpu.test_gpu import row_of

MiB, GiB = 2**20, 2**30

SPIKES = """%%cudamem --lines
a = torch.empty(64 * 2**20, dtype=torch.uint8, device='cuda')
b = a[:1].clone()
del a
c = torch.empty(128 * 2**20, dtype=torch.uint8, device='cuda')
del c
keep = torch.empty(8 * 2**20, dtype=torch.uint8, device='cuda')"""


def test_sub_ms_spikes_below_an_earlier_peak_get_the_exact_peak_and_the_right_lines(gpu):
    ok(gpu, "big = torch.empty(2**30, dtype=torch.uint8, device='cuda')\ndel big")  # an earlier, higher peak
    counter = gpu.user_ns["torch"].cuda.max_memory_allocated()
    ok(gpu, SPIKES)
    n = last_cell(gpu)
    row = row_of(n)
    start = row["allocated_before_bytes"]
    assert row["peak_allocated_bytes"] == start + 512 + 128 * MiB, row.to_dict()
    assert row["peak_line"] == 4
    lines = nbmem.lines().set_index("line")
    assert lines.loc[1, "delta_allocated_bytes"] == 64 * MiB and lines.loc[3, "delta_allocated_bytes"] == -64 * MiB
    assert lines.loc[4, "peak_allocated_bytes"] == start + 512 + 128 * MiB
    assert lines.loc[6, "delta_allocated_bytes"] == 8 * MiB
    assert lines.loc[4, "source"].startswith("c = torch.empty")
    assert gpu.user_ns["torch"].cuda.max_memory_allocated() == counter, "the user's peak counter is untouched"
    from nbmem.ui.widget import last_cell_row

    assert last_cell_row(session_of(gpu).last_report)["rows"][0]["peak_line"].startswith("line 4: c = torch.empty")


def test_monitored_cells_get_exact_peaks_from_counters_and_with_nbmem_trace_from_the_events(gpu):
    ok(gpu, "big = torch.empty(2**30, dtype=torch.uint8, device='cuda')\ndel big")
    ok(gpu, "kept = torch.empty(64 * 2**20, dtype=torch.uint8, device='cuda')")  # nothing freed: counters pin it
    row = row_of(last_cell(gpu))
    assert row["peak_allocated_bytes"] == row["allocated_after_bytes"] and row["peak_note"] == ""
    ok(gpu, "x = torch.empty(64 * 2**20, dtype=torch.uint8, device='cuda')\ny = x * 2\ndel x, y")
    row = row_of(last_cell(gpu))
    assert pd.isna(row["peak_allocated_bytes"]) and row["peak_note"].startswith("≤ "), row.to_dict()
    ok(gpu, "%config Nbmem.trace = True")
    ok(gpu, "x = torch.empty(64 * 2**20, dtype=torch.uint8, device='cuda')\ny = x * 2\ndel x, y")
    row = row_of(last_cell(gpu))
    assert row["peak_allocated_bytes"] == row["allocated_before_bytes"] + 128 * MiB and row["peak_note"] == ""


def test_a_holder_gets_the_line_that_allocated_it(gpu):
    ok(gpu, SPIKES)
    f = nbmem.leaks(cell=last_cell(gpu)).set_index("name")
    assert f.loc["keep", "line"] == 6


def test_an_out_of_memory_names_the_line_and_what_each_line_had_live(gpu, capsys):
    r = run(gpu, "%%cudamem --lines\nsmall = torch.empty(8 * 2**20, device='cuda')\n"
                 "huge = torch.empty(10 * 2**40, dtype=torch.uint8, device='cuda')")
    assert not r.success
    advice = " ".join(session_of(gpu).last_report.advice)
    assert "line 2: huge = torch.empty" in advice, advice
    assert "line 1: 32.0 MiB" in advice, advice
    r = run(gpu, "huge = torch.empty(10 * 2**40, dtype=torch.uint8, device='cuda')")
    advice = " ".join(session_of(gpu).last_report.advice)
    assert "line 1: huge = torch.empty" in advice and "--lines" in advice


def test_a_users_own_history_recording_is_read_and_left_as_it_was(gpu):
    torch = gpu.user_ns["torch"]
    torch.cuda.memory._record_memory_history(max_entries=100_000)  # with stacks, the user's settings
    try:
        ok(gpu, "mine = torch.empty(2**20, device='cuda')")
        ok(gpu, SPIKES)
        assert torch._C._cuda_isHistoryEnabled(), "nbmem turned the user's recording off"
        ok(gpu, "after = torch.empty(2**20, device='cuda')")
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        allocs = [e for e in trace if e["action"] == "alloc"]
        assert any(e.get("frames") for e in allocs[:3]), "the user's stacks are still recorded"
        assert len(allocs) >= 5, "the user's trace was not cleared by nbmem"
        assert nbmem.lines().set_index("line").loc[6, "delta_allocated_bytes"] == 8 * MiB
    finally:
        torch.cuda.memory._record_memory_history(None)


def test_unloading_inside_a_recorded_cell_stops_nbmems_recording(gpu):
    # The cell that unloads never ends for nbmem: its recording must stop with it, or it runs on unread and
    # the next %load_ext takes it for the user's own and never stops (nor clears) it again.
    torch = gpu.user_ns["torch"]
    ok(gpu, "%config Nbmem.trace = True")
    ok(gpu, "x = torch.ones(1, device='cuda')")
    ok(gpu, "%unload_ext nbmem")
    assert not torch._C._cuda_isHistoryEnabled()
    ok(gpu, "%load_ext nbmem")
    ok(gpu, "%cudamem on")
    ok(gpu, "y = torch.ones(1, device='cuda')")
    assert not torch._C._cuda_isHistoryEnabled(), "a later cell's recording was taken for the user's"
    ok(gpu, "%config Nbmem.trace = False")


def test_lines_of_a_training_loop_with_a_blank_first_line_are_placed_and_named_right(gpu):
    # The lines come from timestamps on Python 3.12+ (sys.monitoring), from stacks before: either way the
    # line that only frees (zero_grad) gets the frees, and the text beside each line is that line's.
    ok(gpu, "model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).cuda()\n"
            "opt = torch.optim.SGD(model.parameters(), lr=1e-3)\nxb = torch.randn(64, 256, device='cuda')")
    ok(gpu, "%%cudamem --lines\n\nfor _ in range(20):\n    opt.zero_grad(set_to_none=True)\n"
            "    loss = model(xb).square().mean()\n    loss.backward()\n    opt.step()\ntorch.cuda.synchronize()")
    lines = nbmem.lines().set_index("line")
    assert lines.loc[2, "source"].strip() == "opt.zero_grad(set_to_none=True)"
    assert lines.loc[2, "delta_allocated_bytes"] < 0, lines.to_dict()
    assert lines.loc[3, "source"].strip().startswith("loss = model(xb)") and lines.loc[3, "delta_allocated_bytes"] > 0
    assert lines.loc[4, "source"].strip() == "loss.backward()" and lines.loc[4, "delta_allocated_bytes"] > 0
