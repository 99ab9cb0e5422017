"""The extension in a real InteractiveShell: load/unload, %%cudamem, %cudamem commands, bad input."""

from __future__ import annotations

import gc
import re
import sys
import weakref

import pytest
import torch
from IPython.core.error import UsageError

import nbmem
from nbmem.ipython.root import _ACTIVE
from tests.conftest import last_cell, nbmem_callbacks, nbmem_threads, ok, run

MB = MiB = 2**20


def test_import_is_light():
    import subprocess
    import sys

    code = ("import sys, nbmem; bad = [m for m in ('torch', 'pynvml', 'pandas', 'IPython', 'anywidget') "
            "if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_load_twice_is_once_and_unload_leaves_nothing(shell):
    ok(shell, "%load_ext nbmem")
    ok(shell, "%reload_ext nbmem")
    ok(shell, "%load_ext nbmem")
    assert len(nbmem_callbacks(shell)) == 2  # one pair of cell hooks: they pass each run on to every part
    assert len(nbmem_threads()) == 1
    ok(shell, "%unload_ext nbmem")
    ok(shell, "%unload_ext nbmem")
    assert nbmem_callbacks(shell) == [] and nbmem_threads() == []
    assert shell not in _ACTIVE
    with pytest.raises(RuntimeError, match="load_ext nbmem"):
        nbmem.leaks()


def test_load_says_once_what_it_cannot_see(shell, capsys):
    ok(shell, "%load_ext nbmem")
    out = capsys.readouterr().out
    assert "nbmem:" in out and ("no GPU seen" in out or "watching" in out)
    assert out.count("nbmem:") == 1


def test_load_never_initialises_cuda(shell):
    ok(shell, "%load_ext nbmem")
    ok(shell, "%cudamem on")
    ok(shell, "import torch\nx = torch.ones(3)")
    ok(shell, "%cudamem status")
    assert not torch.cuda.is_initialized()


def test_cell_magic_reports_and_records(shell):
    ok(shell, "%load_ext nbmem")
    ok(shell, "import torch")
    r = ok(shell, "%%cudamem\nkept = torch.empty(4 * 2**20)\ntmp = torch.empty(2**20)\ndel tmp")
    assert r.success
    cell = last_cell(shell)
    rep = nbmem.report()
    assert list(rep.index) == [cell]
    row = rep.loc[cell]
    assert row["device"] == "cpu" and row["delta_allocated_bytes"] == 16 * MB and row["error"] == ""
    assert row["duration_s"] > 0
    leaks = nbmem.leaks(cell=cell)
    assert list(leaks["name"]) == ["kept"]
    assert shell.user_ns["kept"].numel() == 4 * MB  # the body really ran in the user namespace


def test_a_failing_body_fails_the_cell_once_with_its_own_traceback(shell, capsys):
    import sys

    ok(shell, "%load_ext nbmem")
    ok(shell, "def inner():\n    raise ValueError('boom')")
    r = run(shell, "%%cudamem\ninner()")
    assert not r.success and isinstance(r.error_in_exec, ValueError)  # Run All stops here
    assert nbmem.report().iloc[-1]["error"] == "ValueError"
    out = capsys.readouterr().out
    assert out.count("ValueError: boom") == 1 and "inner()" in out and "_measure_cell" not in out
    assert sys.last_value is r.error_in_exec  # %debug inspects the user's exception
    r = run(shell, "%%cudamem\ndef (:")
    assert not r.success
    assert capsys.readouterr().out.count("SyntaxError: invalid syntax") == 1
    ok(shell, "%%cudamem\nfine = 1")


def test_monitoring_every_cell_on_and_off(ip):
    ok(ip, "a = torch.empty(2**20)")
    n_a = last_cell(ip)
    ok(ip, "%cudamem off")
    ok(ip, "b = torch.empty(2**20)")
    ok(ip, "%cudamem on")
    ok(ip, "c = 1")
    cells = list(nbmem.report().index)
    assert n_a in cells and last_cell(ip) in cells and n_a + 2 not in cells


def test_report_columns_are_the_documented_ones(ip):
    ok(ip, "z = torch.empty(10)")
    cols = set(nbmem.report().columns) | {"cell"}
    need = {"cell", "started", "duration_s", "device", "allocated_before_bytes", "allocated_after_bytes",
            "delta_allocated_bytes", "reserved_before_bytes", "reserved_after_bytes", "delta_reserved_bytes",
            "peak_allocated_bytes", "error"}
    assert need <= cols
    assert str(nbmem.report()["started"].dt.tz) == "UTC"


def test_samples_frame_columns_and_na(ip):
    import time

    time.sleep(0.6)
    df = nbmem.samples()
    assert list(df.columns) == ["time", "device", "allocated_bytes", "reserved_bytes", "active_bytes",
                                "inactive_split_bytes", "nvml_used_bytes", "nvml_total_bytes",
                                "process_used_bytes", "other_processes_bytes", "rss_bytes", "host_used_bytes",
                                "host_total_bytes", "peak_bytes", "children_used_bytes"]
    cpu = df[df.device == "cpu"]
    assert len(cpu) >= 2 and cpu["rss_bytes"].gt(0).all()
    assert cpu["nvml_used_bytes"].isna().all()  # unknown is NA, not 0
    assert cpu["children_used_bytes"].isna().all()  # child processes are counted on GPUs only
    assert all(str(df[c].dtype) == "Int64" for c in df.columns if c.endswith("_bytes"))
    assert str(df["time"].dt.tz) == "UTC"


def test_a_report_holds_no_reference_to_user_objects(ip):
    ok(ip, "x = torch.empty(4 * 2**20)")
    ref = weakref.ref(ip.user_ns["x"])
    assert "x" in list(nbmem.leaks(cell=last_cell(ip))["name"])
    report = nbmem.report()
    leaks_now = nbmem.leaks()
    ok(ip, "del x")
    gc.collect()
    assert ref() is None
    assert len(report) and len(leaks_now)


@pytest.mark.parametrize("line,fix", [
    ("", "needs a command"),
    ("frobnicate", "unknown command"),
    ("on extra", "does not take extra"),
    ("clean", "say what goes"),
    ("clean 'x y'", "not a variable name"),
    ("clean 1x", "not a variable name"),
    ("clean nosuchname", "no variable named"),
    ("leaks --cell -3", "cell number"),
    ("leaks --cell abc", "invalid int"),
    ("--no-such-flag", "the command comes first"),
    ("on --no-such-flag", "it takes --lines, --no-scan, --reset-peak"),
    ("gauge --inline --sidebar", "choose one"),
])
def test_bad_line_input_is_a_usage_error_naming_the_fix(ip, line, fix):
    ok(ip, "keep = torch.empty(2**20)")
    with pytest.raises(UsageError, match=fix):
        ip.run_line_magic("cudamem", line)
    assert "keep" in ip.user_ns


def test_bad_cell_magic_input_does_not_run_the_body(ip):
    r = run(ip, "%%cudamem on\nran = True")
    assert not r.success and "ran" not in ip.user_ns
    r = run(ip, "%%cudamem --bogus\nran = True")
    assert not r.success and "ran" not in ip.user_ns


@pytest.mark.parametrize("line,expect", [
    ("Nbmem.interval = -1", "Nbmem.interval must be a number from 0.01 to 60; got -1; kept 0.5."),
    ("Nbmem.show = 'sometimes'", "Nbmem.show must be one of 'auto', 'always', 'never'; got 'sometimes'; kept 'auto'."),
    ("Nbmem.threshold = -5", "Nbmem.threshold must be a size in bytes, 0 to 1024 PiB: a whole number such as 2097152 "
                             "or `2 * 2**20`, or a string with KiB, MiB, GiB or TiB such as '2 MiB'; got -5; kept "
                             "1048576."),
    ("Nbmem.threshold = 'two MiB'", "Nbmem.threshold must be a size in bytes, 0 to 1024 PiB: a whole number such as "
                                    "2097152 or `2 * 2**20`, or a string with KiB, MiB, GiB or TiB such as '2 MiB'; "
                                    "got 'two MiB'; kept 1048576."),
    ("Nbmem.scan = 'yes'", "Nbmem.scan must be True or False; got 'yes'; kept True."),
])
def test_a_bad_option_is_refused_in_one_line_and_the_old_value_stays(ip, capsys, line, expect):
    capsys.readouterr()
    r = run(ip, f"%config {line}")
    assert r.success, "a refused value is not a failed cell"
    out = capsys.readouterr()
    assert out.out.strip() == f"nbmem: {expect}" and "Traceback" not in out.err
    name = line.split(".")[1].split(" ")[0]
    m = _ACTIVE[ip]
    assert getattr(m.options, name) == getattr(type(m.options)(), name)
    ok(ip, "%reload_ext nbmem")  # the bad value IPython kept in its config must not break loading
    assert "cudamem" in ip.magics_manager.magics["line"]
    assert getattr(_ACTIVE[ip].options, name) == getattr(type(m.options)(), name)


def test_the_threshold_takes_a_size_with_its_unit_as_formatting_reads_it(ip):
    m = _ACTIVE[ip]
    ok(ip, '%config Nbmem.threshold = "2 MiB"')
    assert m.options.threshold == 2 * MiB and m.session.settings.threshold_bytes == 2 * MiB
    ok(ip, "%config Nbmem.threshold = 3 * 2**20")
    assert m.session.settings.threshold_bytes == 3 * MiB
    ok(ip, "%config Nbmem.threshold = '16KiB'")  # as reports print small sizes
    assert m.session.settings.threshold_bytes == 16 * 1024


def test_config_nbmem_is_titled_as_nbmems_options_and_the_trace_cost_is_the_readmes(ip, capsys):
    from pathlib import Path

    capsys.readouterr()
    ok(ip, "%config Nbmem")
    out = capsys.readouterr().out
    head = "nbmem's options: `%config Nbmem.NAME = VALUE` sets one (e.g. `%config Nbmem.threshold = 0`)"
    assert out.splitlines()[:2] == [head, "=" * len(head)] and "_Options" not in out
    flat = " ".join(out.split())
    assert ("Costs time per allocation while the cell runs: a launch-bound training loop (1.5 ms steps) ran at "
            "0.87–0.93× of plain, a compute-bound one at 0.99× (an H100, benchmarks/RESULTS.md)") in flat
    assert "20%" not in flat
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert "runs at 0.87–0.93× of plain with the trace" in readme
    assert "With `Nbmem.trace`, 0.87–0.93× of plain on a launch-bound loop and 0.993× on a compute-bound one" in readme


def test_a_bad_value_in_the_config_file_falls_back_to_the_default_with_a_message(shell, capsys):
    shell.config.Nbmem.show = "sometimes"
    shell.config.Nbmem.interval = 0.25
    ok(shell, "%load_ext nbmem")
    out = capsys.readouterr().out
    assert "nbmem: Nbmem.show must be one of 'auto', 'always', 'never'; got 'sometimes'; kept 'auto'." in out
    m = _ACTIVE[shell]
    assert m.options.show == "auto" and m.options.interval == 0.25 and m.session.sampler.interval_s == 0.25


def test_interval_and_history_changes_take_effect_after_load(ip):
    m = _ACTIVE[ip]
    ok(ip, "%config Nbmem.interval = 0.25")
    assert m.session.sampler.interval_s == 0.25 and m.session.sampler.running
    per_tick = len(m.session.store.latest_tick())
    for _ in range(30):
        m.session.store.add_tick(m.session.store.latest_tick())
    assert len(m.session.store.sample_list()) >= 30 * per_tick
    ok(ip, "%config Nbmem.history = 2")
    assert len(m.session.store.sample_list()) == 8 * per_tick, "2 s at 4 Hz: the newest 8 ticks are kept"


@pytest.mark.parametrize("line,fix", [
    ("status --outputs --cell 3", "%cudamem status does not take --cell, --outputs; it takes no options"),
    ("on --to-cpu a", "%cudamem on does not take --to-cpu; it takes --lines, --no-scan, --reset-peak"),
    ("leaks --outputs", "%cudamem leaks does not take --outputs; it takes --cell"),
    ("off x", "%cudamem off does not take x"),
    ("gauge --cell 1", "%cudamem gauge does not take --cell"),
])
def test_options_a_command_does_not_take_are_refused_and_nothing_runs(ip, line, fix):
    sess = _ACTIVE[ip].session
    was = sess.monitoring
    with pytest.raises(UsageError, match=re.escape(fix)):
        ip.run_line_magic("cudamem", line)
    assert sess.monitoring == was


def test_a_nested_cudamem_is_refused_its_body_does_not_run_and_the_outer_cell_still_reports(ip):
    sess = _ACTIVE[ip].session
    r = run(ip, "%%cudamem\nouter = 1\nget_ipython().run_cell_magic('cudamem', '', 'inner = 1')")
    assert not r.success and "inner" not in ip.user_ns and ip.user_ns["outer"] == 1
    assert "cannot be nested" in str(r.error_in_exec) and "did not run" in str(r.error_in_exec)
    assert sess.last_report is not None and sess.last_report.cell == last_cell(ip)
    ok(ip, "%%cudamem\nafter = 1")  # the refusal left no state behind: the next measured cell is not "nested"
    assert ip.user_ns["after"] == 1 and sess.last_report.cell == last_cell(ip)


def test_cell_magic_refuses_line_options_and_does_not_run_the_body(ip):
    r = run(ip, "%%cudamem --cell 4\nran = True")
    assert not r.success and "ran" not in ip.user_ns
    assert "does not take --cell" in str(r.error_in_exec)


def test_on_and_off_say_so(shell, capsys):
    ok(shell, "%load_ext nbmem")
    capsys.readouterr()
    ok(shell, "%cudamem on")
    assert capsys.readouterr().out.startswith("nbmem: measuring every cell from now on")
    ok(shell, "%cudamem off")
    assert capsys.readouterr().out.startswith("nbmem: no longer measuring cells")


def test_leaks_of_a_cell_that_was_not_measured_says_so(ip):
    ok(ip, "x = 1")
    n = last_cell(ip)
    with pytest.raises(UsageError, match=f"cell 99 was not measured \\(measured cells: .*{n}"):
        ip.run_line_magic("cudamem", "leaks --cell 99")
    with pytest.raises(LookupError, match="cell 99 was not measured"):
        nbmem.leaks(cell=99)
    assert nbmem.leaks(cell=n).empty


def test_a_users_showtraceback_stays_and_runs_for_a_failing_body(ip, capsys):
    seen = []

    def mine(*args, **kwargs):
        seen.append(sys.exc_info()[1])

    ip.showtraceback = mine  # what rich.traceback.install() does
    try:
        r = run(ip, "%%cudamem\n1 / 0")
        assert not r.success and isinstance(r.error_in_exec, ZeroDivisionError)
        assert ip.showtraceback is mine, "nbmem left the user's showtraceback in place"
        assert len(seen) == 1 and seen[0] is r.error_in_exec
        ok(ip, "%%cudamem\nfine = 2")
        assert ip.showtraceback is mine
    finally:
        del ip.showtraceback


def test_a_failing_body_is_labelled_with_its_own_cell_and_shows_no_magic_frames(ip, capsys):
    ok(ip, "def inner():\n    raise ValueError('boom')")
    capsys.readouterr()
    r = run(ip, "%%cudamem\ninner()")
    n = last_cell(ip)
    out = capsys.readouterr().out
    assert not r.success and f"Cell In[{n}], line 1" in out and f"In[{n + 1}]" not in out
    assert "run_cell_magic" not in out and "_measure_cell" not in out
    assert out.count("ValueError: boom") == 1


def test_without_anywidget_load_says_so_in_one_plain_line(tmp_path):
    import subprocess

    code = """
import sys
sys.modules["anywidget"] = None  # as if it were not installed
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config
from nbmem.ipython import root
c = Config(); c.HistoryManager.hist_file = ":memory:"; c.Nbmem.gauge = "inline"
sh = InteractiveShell.instance(config=c)
sh.run_cell("%load_ext nbmem")  # a terminal-like shell: nowhere to draw a gauge, and nothing said about one
print("TERMINAL")
sh.run_cell("%unload_ext nbmem")
root.in_kernel = lambda shell: True  # as in a kernel, where the gauge would be drawn
sh.run_cell("%load_ext nbmem")
import nbmem
print("FAULTS", len(nbmem.status().faults))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    terminal, kernel = out.stdout.split("TERMINAL", 1)
    assert "anywidget" not in terminal, "a shell without a front end is told nothing about a gauge"
    lines = [ln for ln in kernel.splitlines() if ln.startswith("nbmem:")]
    assert any("the live gauge needs anywidget" in ln and "pip install anywidget" in ln for ln in lines), lines
    assert "internal error" not in out.stdout and out.stdout.strip().endswith("FAULTS 0")


def test_a_fault_in_our_hook_never_breaks_the_cell_and_is_told_once(ip, capsys, monkeypatch):
    sess = _ACTIVE[ip].session

    def boom(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(sess, "end_cell", boom)
    capsys.readouterr()
    for _ in range(3):
        r = ok(ip, "v = 41 + 1")
        assert r.result is None and ip.user_ns["v"] == 42
    out = capsys.readouterr().out
    assert out.count("injected") == 1
    assert any("injected" in f.error and f.count == 3 for f in sess.faults)
    assert "injected" in str(nbmem.status())


def test_one_pair_of_cell_hooks_tells_every_part_even_after_one_fails(ip, monkeypatch):
    loaded = _ACTIVE[ip]
    assert loaded.flight is not None

    def boom(*a, **k):
        raise RuntimeError("the recorder broke")

    monkeypatch.setattr(loaded.flight, "pre_run_cell", boom)
    seen = []
    monkeypatch.setattr(loaded.between, "post_run_cell", lambda result: seen.append(result.info.raw_cell))
    ok(ip, "w = torch.ones(4)")
    assert seen == ["w = torch.ones(4)"], "the parts after the failing one were told"
    assert loaded.session.last_report is not None and loaded.session.last_report.cell == ip.execution_count - 1
    assert [f.where for f in loaded.session.faults] == ["the flight recorder"]


def test_reset_peak_is_explicit(ip):
    sess = _ACTIVE[ip].session
    calls = []
    sess.probe.torch.reset_peak = lambda i: calls.append(i)  # CPU: record that it would be called
    sess.probe.torch.device_count = lambda: 1
    ok(ip, "a1 = 1")
    assert calls == []
    ok(ip, "%%cudamem --reset-peak\na2 = 1")
    assert calls == [0]


def test_reset_with_nbmem_loaded(ip):
    ok(ip, "x = torch.empty(2**20)")
    ok(ip, "%reset -f")
    ok(ip, "import torch\ny = torch.empty(2**20)")
    assert "y" in list(nbmem.leaks()["name"])


def test_await_in_a_monitored_cell(ip):
    ip.autoawait = True
    r = run(ip, "import asyncio\nawait asyncio.sleep(0.01)\nw = torch.empty(2**20)")
    assert r.success
    assert "w" in list(nbmem.leaks(cell=last_cell(ip))["name"])


def test_plot_returns_a_figure(ip):
    ok(ip, "p = torch.empty(2**20)")
    fig = nbmem.plot()
    from matplotlib.figure import Figure

    assert isinstance(fig, Figure) and fig.axes[0].get_title(loc="left") == "cpu"
    shown, _ = ip.display_formatter.format(fig)  # a fresh kernel, no %matplotlib: still a picture
    assert shown["image/png"][:4] == b"\x89PNG"


def test_a_displayed_dataframe_does_not_break_later_scans(ip):
    ok(ip, "import pandas as pd\npd.DataFrame({'a': [1, 2]})")
    ok(ip, "%cudamem leaks")
    ok(ip, "x = torch.empty(2**20)")
    assert nbmem.cleanup(names=["x"]).freed_allocated_bytes == 4 * MiB
    assert not _ACTIVE[ip].session.faults


def test_a_semicolon_ends_a_measured_cell_quietly(ip):
    ok(ip, "%%cudamem\ntorch.ones(2**20);")
    assert nbmem.leaks().empty and ip.user_ns["Out"] == {}


def test_leaks_takes_numpy_cell_numbers(ip):
    import numpy as np

    ok(ip, "x = torch.empty(2**20)")
    cell = nbmem.report().index[-1]
    assert isinstance(cell, np.integer) or isinstance(cell, int)
    assert list(nbmem.leaks(cell=np.int64(cell))["name"]) == ["x"]


def test_a_cleanup_inside_a_monitored_cell_shows_in_its_delta(ip):
    ok(ip, "x = torch.ones(8 * 2**20)")
    ok(ip, "nbmem_report = __import__('nbmem').cleanup(names=['x'])")
    assert nbmem.report().iloc[-1]["delta_allocated_bytes"] == -32 * MiB


def test_tensors_from_before_monitoring_are_cell_0(shell):
    ok(shell, "%load_ext nbmem")
    ok(shell, "import torch\nold = torch.empty(2**20)")
    ok(shell, "%cudamem on")
    ok(shell, "new = torch.empty(2**20)")
    cells = dict(zip(nbmem.leaks()["name"], nbmem.leaks()["cell"]))
    assert cells == {"old": 0, "new": last_cell(shell)}


def test_a_cell_that_allocates_then_calls_leaks_still_reports_what_it_added(ip):
    # nbmem.leaks() walks mid-cell; that walk must not become the mark the cell's own scan is skipped by.
    ok(ip, "import nbmem as _nb\n_nb.leaks();")  # warm: pandas' first frame allocates a lot
    ok(ip, "x = torch.empty(2**20)\n_nb.leaks();")
    assert list(nbmem.leaks(cell=last_cell(ip))["name"]) == ["x"]


def test_a_new_name_for_memory_already_there_is_not_news_but_a_moved_holder_is(ip):
    ok(ip, "batches = [torch.ones(2**20) for _ in range(3)]")
    ok(ip, "for b in batches: pass")  # the loop variable now also holds the last batch: nothing was added
    assert nbmem.leaks(cell=last_cell(ip)).empty
    ok(ip, "del batches")  # the last batch lives on in `b`: the report names what keeps it
    assert list(nbmem.leaks(cell=last_cell(ip))["name"]) == ["b"]


def test_the_line_column_shows_only_when_a_finding_has_a_line():
    from nbmem.records import Finding, HolderKind
    from nbmem.reports import CellReport, Leaks

    plain = Finding(3, "x", ("x",), HolderKind.NAMESPACE, "cpu", 4 * MiB, roots=("x",))
    lined = Finding(3, "y", ("y",), HolderKind.NAMESPACE, "cuda:0", 4 * MiB, roots=("y",), line=2)
    for record in (lambda fs: CellReport(3, 0.1, (), fs), lambda fs: Leaks(fs, "held now")):
        assert " line " not in str(record((plain,))) and ">line<" not in record((plain,))._repr_html_()
        assert " line " in str(record((plain, lined))) and ">line<" in record((plain, lined))._repr_html_()


def test_losing_a_name_is_news_only_when_it_kept_the_memory_itself(ip):
    # the CIFAR-10 tutorial: `dataiter` moves from the training loader to the test loader
    ok(ip, "from torch.utils.data import DataLoader, TensorDataset\n"
           "trainset, testset = TensorDataset(torch.ones(2**20)), TensorDataset(torch.ones(2**20))\n"
           "trainloader, testloader = DataLoader(trainset, batch_size=4), DataLoader(testset, batch_size=4)\n"
           "dataiter = iter(trainloader)")
    ok(ip, "dataiter = iter(testloader)")  # the old iterator reached the data only through `trainset`
    assert nbmem.leaks(cell=last_cell(ip)).empty
    # the transfer-learning tutorial: the scheduler moves from one optimizer to another
    ok(ip, "model_ft, model_conv = torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)\n"
           "opt_ft = torch.optim.SGD(model_ft.parameters(), lr=0.1)\n"
           "opt_conv = torch.optim.SGD(model_conv.parameters(), lr=0.1)\n"
           "sched = torch.optim.lr_scheduler.StepLR(opt_ft, 1)")
    ok(ip, "sched = torch.optim.lr_scheduler.StepLR(opt_conv, 1)")
    assert nbmem.leaks(cell=last_cell(ip)).empty
    # the quickstart: `model` reloaded while the optimizer still holds the old weights
    ok(ip, "model = torch.nn.Linear(1024, 1024)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)")
    ok(ip, "model = torch.nn.Linear(8, 8)")
    f = nbmem.leaks(cell=last_cell(ip))
    assert list(f["name"]) == ["opt"] and f["tensors"].iloc[0] == 2, "the old model's weight and bias, as one row"
    assert list(f["holders"].iloc[0]) == ["opt.param_groups[0]['params'][0]", "opt.param_groups[0]['params'][1]"]
    assert "`model` was deleted or rebound" in f["hint"].iloc[0]


def test_a_scalar_rebound_to_one_that_keeps_its_graph_is_reported(ip):
    ok(ip, "w = torch.randn(1024, 1024, requires_grad=True)\nx = torch.randn(1024, 1024)\n"
           "loss = (x @ w).relu().sum()\nloss.backward()")  # the training cell: backward freed the graph
    ok(ip, "loss = (x @ w).relu().sum()")  # evaluation without no_grad: the same 4 B, a 4 MiB graph
    f = nbmem.leaks(cell=last_cell(ip))
    assert list(f["name"]) == ["loss"] and f["graph_bytes"].iloc[0] >= 4 * MiB, f
    ok(ip, "loss.backward()")
    ok(ip, "loss = torch.tensor(0.5)")  # a plain scalar in place of a scalar: nothing new
    assert nbmem.leaks(cell=last_cell(ip)).empty


def test_a_users_own_module_is_a_holder_but_an_installed_one_is_not(ip, tmp_path, monkeypatch):
    mine, installed = tmp_path / "mine", tmp_path / "target"
    for d, name in ((mine, "helpers_mine"), (installed, "helpers_installed")):
        d.mkdir()
        (d / f"{name}.py").write_text("CACHE = []\n")
        monkeypatch.syspath_prepend(str(d))
    (installed / "helpers_installed-1.0.dist-info").mkdir()  # what `pip install --target` leaves
    try:
        ok(ip, "import helpers_mine, helpers_installed")
        ok(ip, "helpers_mine.CACHE.append(torch.empty(2**20))\nhelpers_installed.CACHE.append(torch.empty(2**20))")
        f = nbmem.leaks(cell=last_cell(ip))
        assert list(f["name"]) == ["helpers_mine.CACHE"] and list(f["kind"]) == ["module"], f
        assert list(f["holders"].iloc[0]) == ["helpers_mine.CACHE[0]"]
    finally:  # modules outlive the shell: later tests must not find their tensors
        for name in ("helpers_mine", "helpers_installed"):
            sys.modules.pop(name, None)


def test_a_displayed_variable_is_news_in_the_cell_that_showed_it(ip):
    ok(ip, "x = torch.empty(2 * 2**20)")
    ok(ip, "x")  # Out[n], _n and _ now hold x too: `del x` alone would free nothing
    n = last_cell(ip)
    f = nbmem.leaks(cell=n)
    assert list(f["name"]) == ["x"] and f["bytes"].iloc[0] == 8 * 2**20, f
    assert f["hint"].iloc[0] == (f"displayed, so the output history (Out[{n}], _{n}) now also holds it: "
                                 "`del x` alone frees nothing; `%cudamem clean x` removes both")
    ok(ip, "x")  # shown again: Out[n+1] is new news; nothing else changed
    assert list(nbmem.leaks(cell=last_cell(ip))["name"]) == ["x"]
    ip.run_line_magic("cudamem", "clean x")
    assert nbmem.leaks().empty, "clean x took the output history's references to x with it"


def test_an_unclosed_quote_is_a_usage_error_and_the_cell_does_not_run(ip):
    with pytest.raises(UsageError, match=r"^%%cudamem: could not read \"'x\" \(No closing quotation\)"):
        ip.run_cell_magic("cudamem", "'x", "ran = True")
    assert "ran" not in ip.user_ns
    with pytest.raises(UsageError, match="No closing quotation"):
        ip.run_line_magic("cudamem", "clean 'x")


def test_a_failure_inside_nbmem_never_keeps_a_cudamem_cell_from_running(ip, monkeypatch):
    sess = _ACTIVE[ip].session

    def broken(*args, **kwargs):
        raise RuntimeError("nbmem's own bug")

    monkeypatch.setattr(sess.cells, "begin", broken)
    ok(ip, "%%cudamem\nran = 1")
    assert ip.user_ns["ran"] == 1 and any("nbmem's own bug" in f.error for f in sess.faults)
    monkeypatch.undo()
    monkeypatch.setattr(sess.cells, "_end", broken)
    ok(ip, "%%cudamem\nran = 2")
    assert ip.user_ns["ran"] == 2 and not sess.in_cell


# -- a report only where memory changed; nothing of nbmem's own in Out[] ---------------------------------
def test_a_mistyped_command_is_only_refused_with_the_closest_one_and_the_list(ip, capsys):
    ok(ip, "x = torch.empty(2**20)")
    before = len(nbmem.report())
    capsys.readouterr()
    r = run(ip, "%cudamem claen x")
    out = capsys.readouterr()
    assert not r.success and "did you mean `clean`?" in str(r.error_in_exec)
    assert "on, off, status, report, leaks, clean, gauge, plot, lines" in str(r.error_in_exec)
    assert "nbmem [" not in out.out + out.err, "a cell report under a refusal"
    assert len(nbmem.report()) == before and "x" in ip.user_ns


@pytest.mark.parametrize("line,fix", [
    ("on --bogus", "%cudamem on does not take --bogus; it takes --lines, --no-scan, --reset-peak."),
    ("on --reset-peek", "does not take --reset-peek (did you mean `--reset-peak`?); it takes --lines, --no-scan"),
    ("leaks --detial", "%cudamem leaks does not take --detial (did you mean `--detail`?); it takes --cell, --detail"),
])
def test_an_unknown_option_is_told_the_options_the_command_takes(ip, line, fix):
    with pytest.raises(UsageError, match=re.escape(fix)):
        ip.run_line_magic("cudamem", line)


def test_nbmem_commands_leave_nothing_in_out_and_get_no_report(ip, capsys):
    ok(ip, "x = torch.empty(4 * 2**20)")
    capsys.readouterr()
    for line in ("%cudamem status", "%cudamem report", "%cudamem leaks", "%cudamem clean x"):
        r = ok(ip, line)
        assert r.result is None, line
    out = capsys.readouterr().out
    assert ip.user_ns["Out"] == {} and "nbmem cleanup: freed 16.0 MiB" in out
    assert "nbmem [" not in out, "a second report after nbmem's own commands"
    # The cleanup was measured, so the records add up; the Python functions still return values.
    assert nbmem.report().iloc[-1]["delta_allocated_bytes"] == -16 * MiB
    assert len(nbmem.leaks()) == 0 and nbmem.status().monitoring


def test_one_output_cleared_and_one_object_scanned_read_as_english(ip):
    from types import SimpleNamespace

    from nbmem.formatting import plural
    from nbmem.session import scan_lines

    assert (plural(1, "output"), plural(2, "output"), plural(12345, "object")) == \
        ("1 output", "2 outputs", "12,345 objects")
    scan = SimpleNamespace(objects=1, seconds=0.0003, walked=("x",), errors=1, error_types=("E",), unfinished=())
    assert scan_lines(scan)[:2] == ("last holder scan: 1 object in 0.3 ms, walked 1 of the roots (the others were "
                                    "unchanged)", "skipped 1 object that could not be read (E)")
    ok(ip, "torch.empty(2**20)")
    rep = nbmem.cleanup(outputs=True)
    assert next(s.note for s in rep.steps if s.action == "clear outputs") == "1 output cleared"


@pytest.mark.parametrize("cell,command", [
    ("%cudamem status", "status"),
    ("%cudamem claen x", "claen"),
    ("# tidy up\n%cudamem leaks\n%cudamem clean x", "clean"),  # a cleanup anywhere: measured, not shown
    ("%cudamem --lines on", "on"),
    ("%cudamem?", "?"),
    ("%cudamem", ""),
    ("x = 1\n%cudamem status", None),  # the user's code too: measured and reported as always
    ("%%cudamem\nx = 1", None),
    ("%cudamemx status", None),
])
def test_which_cells_are_nbmems_own_commands(cell, command):
    from nbmem.ipython.usage import own_command

    assert own_command(cell) == command


def test_an_empty_leaks_says_the_threshold_and_how_to_lower_it(ip, capsys):
    import pandas as pd

    # A threshold above what other tests' modules may hold at module level (nbmem walks the modules a notebook made).
    ok(ip, "%config Nbmem.threshold = 2**28")
    ok(ip, "small = torch.zeros(1000)")
    n = last_cell(ip)
    why = "nothing above Nbmem.threshold (256 MiB); `%config Nbmem.threshold = 0` lists holders of any size"
    f = nbmem.leaks()
    assert isinstance(f, pd.DataFrame) and f.empty and f.attrs["note"] == why
    assert repr(f).splitlines()[-1] == why and "Empty DataFrame" in repr(f)
    assert f._repr_html_().endswith("<p>nothing above Nbmem.threshold (256 MiB); <code>%config Nbmem.threshold = "
                                    "0</code> lists holders of any size</p>")
    assert type(f[f["bytes"] > 0]) is pd.DataFrame and type(f.copy()) is pd.DataFrame, "what is made from it is plain"
    capsys.readouterr()
    ip.run_line_magic("cudamem", "leaks")
    ip.run_line_magic("cudamem", f"leaks --cell {n}")
    assert capsys.readouterr().out.splitlines() == [
        f"holders of memory now: {why}",
        f"holders of memory cell [{n}] added: nothing above Nbmem.threshold when it ran (now 256 MiB); after "
        "`%config Nbmem.threshold = 0` the cells you run next list holders of any size, and `%cudamem leaks` lists "
        "what is held now"]
    ok(ip, "%config Nbmem.threshold = 0")
    now = nbmem.leaks()
    assert list(now[now["kind"] == "namespace"]["name"]) == ["small"]


def test_a_mistyped_variable_to_clean_is_told_the_closest_name(ip):
    ok(ip, "model = torch.empty(2**20)")
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("cudamem", "clean modle")
    assert str(e.value) == ("%cudamem clean: no variable named 'modle' (did you mean `model`?) in this notebook. "
                            "Nothing was removed.")
    with pytest.raises(ValueError, match=re.escape("no variable named 'modle' (did you mean `model`?), 'zzz' in")):
        nbmem.cleanup(names=["modle", "zzz"])
    assert "model" in ip.user_ns


def test_nbmems_own_cleanup_cells_are_left_out_of_report_and_the_measured_cells(ip, capsys):
    ok(ip, "x = torch.empty(4 * 2**20)")
    mine = last_cell(ip)
    ok(ip, "%cudamem clean x")
    clean = last_cell(ip)
    assert clean in nbmem.report().index, "measured, so the records add up"
    capsys.readouterr()
    ok(ip, "%cudamem report")
    cells = [ln.split()[0] for ln in capsys.readouterr().out.splitlines()[1:-1]]
    assert str(mine) in cells and str(clean) not in cells, cells
    with pytest.raises(UsageError, match=r"cell 999 was not measured \(measured cells: [^)]*\)") as e:
        ip.run_line_magic("cudamem", "leaks --cell 999")
    assert str(clean) not in str(e.value).split("measured cells: ")[1], str(e.value)


def test_the_commands_in_hints_are_code(ip):
    ok(ip, "torch.ones(2**20)")
    ok(ip, "def f():\n    t = torch.ones(2**20)\n    raise RuntimeError('x')")
    assert not run(ip, "f()").success
    hints = set(nbmem.leaks()["hint"])
    assert hints == {"kept by the output history: `%cudamem clean --outputs`, or end the line with `;`",
                     "kept by the last exception's frames: `%cudamem clean --traceback` (ends `%debug` for it)"}
