"""On a GPU: a report keeps every column the GPU fills, says nothing about the CPU, and `%cudamem report` fits 80
columns; nbmem's own commands get no report and leave nothing in Out[]."""

from __future__ import annotations

from nbmem.ipython.root import session_of
from nbmem.reports import CPU_CANNOT
from tests.conftest import ok, run

MiB = 2**20


def test_a_gpu_report_keeps_the_columns_a_gpu_fills_and_the_cell_table_fits_80_columns(gpu, capsys):
    capsys.readouterr()
    ok(gpu, "x = torch.empty(64 * 2**20, device='cuda')")
    ok(gpu, "y = torch.empty(32 * 2**20, device='cuda'); del y")
    out = capsys.readouterr().out
    head = next(ln for ln in out.splitlines() if ln.startswith("device"))
    assert "Δreserved" in head and "peak allocated" in head and "Δ NVML process" in head, out
    assert CPU_CANNOT not in out
    ok(gpu, "%cudamem report")
    table = capsys.readouterr().out
    assert "cuda:0" in table and "Δreserved" in table and max(len(ln) for ln in table.splitlines()) <= 80, table


def test_own_commands_get_no_report_and_leave_nothing_in_out_on_a_gpu(gpu, capsys):
    ok(gpu, "x = torch.empty(64 * 2**20, device='cuda')")
    capsys.readouterr()
    assert not run(gpu, "%cudamem claen x").success
    for line in ("%cudamem status", "%cudamem leaks", "%cudamem clean x"):
        assert ok(gpu, line).result is None
    out = capsys.readouterr().out
    assert "nbmem [" not in out and gpu.user_ns["Out"] == {}, out
    assert session_of(gpu).last_cleanup.freed_allocated_bytes == 256 * MiB
    rec = next(r for r in session_of(gpu).last_report.records if r.device == "cuda:0")
    assert rec.delta_allocated_bytes == -256 * MiB  # the cleanup cell was measured: the records add up
