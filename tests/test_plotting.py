"""nbmem.plot(): checked on the rendered figure (Agg), from a real shell and from frames built here."""

from __future__ import annotations

import itertools
import re
import time
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_hex

import nbmem
from nbmem.ui.plotting import COLORS, CPU_KINDS, GPU_KINDS, TIME_STEPS, binary_step, plot, tick_bytes, time_step
from tests.conftest import ok

MiB, GiB = 2**20, 2**30
T0 = pd.Timestamp("2024-05-01 13:59:47.25", tz="UTC")
BYTE_COLUMNS = ["allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes", "nvml_used_bytes",
                "nvml_total_bytes", "process_used_bytes", "other_processes_bytes", "rss_bytes", "host_used_bytes",
                "host_total_bytes", "children_used_bytes"]


class Recorded:
    """A session-like object: the two frames ``nbmem.plot`` reads, and the GPU models the engine would know."""

    def __init__(self, samples: pd.DataFrame, report: pd.DataFrame, models: dict[str, str] | None = None) -> None:
        self._samples, self._report = samples, report
        self._devices = tuple(SimpleNamespace(name=k, model=v) for k, v in (models or {}).items())

    def devices(self) -> tuple[SimpleNamespace, ...]:
        return self._devices

    def samples(self) -> pd.DataFrame:
        return self._samples

    def report(self) -> pd.DataFrame:
        return self._report


def _nullable(df: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """Byte columns as the engine now writes them: Int64 with NA where unknown."""
    out = df.copy()
    for c in columns:
        if c in out:
            out[c] = pd.array([None if pd.isna(v) else round(v) for v in out[c]], dtype="Int64")
    return out


def gpu_session(*, gpus: int = 1, seconds: float = 600, cells: int = 30, int64: bool = True,
                per_process: bool = True, unknown_before_s: float = 0.0) -> Recorded:
    """GPUs of 80 GiB sampled every 0.5 s, with ``cells`` cells spread over ``seconds``.

    Per-process numbers are unknown everywhere without ``per_process``, and before ``unknown_before_s``.
    """
    t = np.arange(0, seconds, 0.5)
    starts = np.linspace(5, seconds - 15, cells)
    durations = np.resize([0.3, 2.0, 6.0], cells)
    rows, report = [], []
    for g in range(gpus):
        alloc = np.minimum(t, seconds) / seconds * 30 * GiB * (g + 1) / gpus
        process_known = per_process & (t >= unknown_before_s)
        rows.append(pd.DataFrame({
            "time": T0 + pd.to_timedelta(t, unit="s"), "device": f"cuda:{g}",
            "allocated_bytes": alloc, "reserved_bytes": alloc * 1.2, "active_bytes": alloc,
            "inactive_split_bytes": 0.0, "nvml_used_bytes": alloc * 1.2 + 6.5 * GiB, "nvml_total_bytes": 80.0 * GiB,
            "process_used_bytes": np.where(process_known, alloc * 1.2 + 500 * MiB, np.nan),
            "other_processes_bytes": np.where(process_known, 4.0 * GiB, np.nan),
            "children_used_bytes": np.where(process_known, 1.0 * GiB, np.nan),
            "rss_bytes": 3.0 * GiB, "host_used_bytes": np.nan, "host_total_bytes": np.nan}))
        for n, (s, d) in enumerate(zip(starts, durations), start=1):
            before = s / seconds * 30 * GiB * (g + 1) / gpus
            report.append({"cell": n, "started": T0 + pd.Timedelta(seconds=s), "duration_s": d, "device": f"cuda:{g}",
                           "allocated_before_bytes": before, "allocated_after_bytes": before + MiB,
                           "peak_allocated_bytes": before + 2 * GiB if n % 3 else np.nan, "peak_rss_bytes": np.nan})
    samples = pd.concat(rows).sort_values(["time", "device"], kind="stable").reset_index(drop=True)
    rep = pd.DataFrame(report).set_index("cell")
    if int64:
        samples = _nullable(samples, BYTE_COLUMNS)
        rep = _nullable(rep, ["allocated_before_bytes", "allocated_after_bytes", "peak_allocated_bytes",
                              "peak_rss_bytes"])
    return Recorded(samples, rep, {f"cuda:{g}": "NVIDIA H100 80GB HBM3" for g in range(gpus)})


def cpu_session(*, host: bool = True) -> Recorded:
    """A CPU-only minute: the first cell ends with the first sample, so the CPU tensors are known throughout."""
    t = np.arange(0, 60, 0.5)
    rss = 700 * MiB + np.where(t > 30, GiB, 0)
    samples = pd.DataFrame({"time": T0 + pd.to_timedelta(t, unit="s"), "device": "cpu",
                            **{c: np.nan for c in BYTE_COLUMNS}})
    samples["rss_bytes"] = rss
    if host:
        samples["host_used_bytes"] = rss + 6 * GiB
        samples["host_total_bytes"] = 31.2 * GiB
    else:
        samples = samples.drop(columns=["host_used_bytes", "host_total_bytes"])
    cells = [(-1.0, 1.0, 0, 100 * MiB, 900 * MiB), (30.0, 0.0, 100 * MiB, 900 * MiB, 2 * GiB)]
    report = pd.DataFrame([{"cell": n, "started": T0 + pd.Timedelta(seconds=s), "duration_s": d, "device": "cpu",
                            "allocated_before_bytes": a, "allocated_after_bytes": b, "peak_allocated_bytes": np.nan,
                            "peak_rss_bytes": p} for n, (s, d, a, b, p) in enumerate(cells, start=1)])
    return Recorded(_nullable(samples, BYTE_COLUMNS), report.set_index("cell"))


def sampled_after_the_last_cell(timeout_s: float = 5.0) -> None:
    """Waits for the sampler to take a sample after the last cell ended (it samples every 0.5 s)."""
    rep = nbmem.report()
    end = (pd.to_datetime(rep["started"], utc=True) + pd.to_timedelta(rep["duration_s"], unit="s")).max()
    deadline = time.monotonic() + timeout_s
    while pd.to_datetime(nbmem.samples()["time"], utc=True).max() <= end:
        assert time.monotonic() < deadline, "no sample after the last cell"
        time.sleep(0.05)


def drawn(fig):
    fig.canvas.draw()
    return fig


def legend_texts(fig) -> list[str]:
    assert len(fig.legends) == 1
    return [t.get_text() for t in fig.legends[0].get_texts()]


def visible_labels(ax) -> list:
    return [t for t in ax.texts if t.get_gid() == "cell-label" and t.get_visible()]


def fills(ax) -> dict[str, list]:
    """The stacked areas by label (fill_between makes one collection per band)."""
    out: dict[str, list] = {}
    for c in ax.collections:
        if isinstance(c, PolyCollection) and not c.get_label().startswith("_"):
            out.setdefault(c.get_label(), []).append(c)
    return out


def assert_labels_do_not_overlap(fig) -> None:
    """No two visible cell labels overlap, nor a label a title; each stays over its panel."""
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        boxes = [t.get_window_extent(renderer) for t in visible_labels(ax)]
        titles = [t.get_window_extent(renderer) for t in (ax.title, ax._left_title, ax._right_title) if t.get_text()]
        for a, b in itertools.combinations(boxes, 2):
            assert not a.overlaps(b), f"cell labels overlap: {a} and {b}"
        for a, b in itertools.product(boxes, titles):
            assert not a.overlaps(b), f"a cell label overlaps the title: {a} and {b}"
        assert all(ax.bbox.x0 - 0.5 <= b.x0 and b.x1 <= ax.bbox.x1 + 0.5 for b in boxes), "label outside its panel"


# -- from a real shell -----------------------------------------------------------------------------------
def test_a_cpu_session_plots_the_four_cpu_kinds(ip):
    ok(ip, "a = torch.empty(2**24)")
    ok(ip, "b = torch.empty(2**25)")
    ok(ip, "del a")
    sampled_after_the_last_cell()
    fig = drawn(nbmem.plot())
    ax = fig.axes[0]
    assert ax.get_title(loc="left") == "cpu"
    # Before the first scan and during cells the split is unknown: the process is one "RSS" block there.
    # Without the host columns (engine before its refactor) the last two are named as unknown.
    named = [t.removesuffix(": unknown") for t in legend_texts(fig) if t != "this process (RSS)"]
    assert named == list(CPU_KINDS)
    assert "CPU tensors (last scan)" in fills(ax)
    assert len(visible_labels(ax)) >= 1
    assert fig._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"


def test_thirty_short_cells_get_labels_that_never_overlap(ip):
    ok(ip, "import time\ntime.sleep(2)")  # the 30 cells below then take a sliver of the time axis
    for i in range(30):
        ok(ip, f"t{i} = torch.empty(2**{10 + i % 8})")
    sampled_after_the_last_cell()
    fig = drawn(nbmem.plot())
    ax = fig.axes[0]
    assert len([t for t in ax.texts if t.get_gid() == "cell-label"]) >= 30
    shown = visible_labels(ax)
    assert 1 <= len(shown) < 30  # some fit, the rest are skipped rather than piled up
    assert_labels_do_not_overlap(fig)


# -- from recorded frames ------------------------------------------------------------------------------
@pytest.mark.parametrize("int64", [True, False], ids=["Int64", "float64"])
def test_a_gpu_panel_stacks_the_five_gauge_kinds_in_the_gauge_colours(int64):
    fig = drawn(plot(gpu_session(int64=int64)))
    assert legend_texts(fig) == list(GPU_KINDS)
    for patch, name in zip(fig.legends[0].get_patches(), GPU_KINDS):
        assert to_hex(patch.get_facecolor()) == COLORS[name]
    ax = fig.axes[0]
    assert ax.get_title(loc="left") == "cuda:0 · NVIDIA H100 80GB HBM3"
    assert set(fills(ax)) == set(GPU_KINDS)
    assert to_hex(fills(ax)["non-PyTorch (this process)"][0].get_facecolor()[0]) == "#f57c00"
    # Paged memory is known from the latest scan only, not over time: a panel draws non-PyTorch whole, unhatched,
    # and does not name paged memory as unknown on every GPU.
    assert fills(ax)["non-PyTorch (this process)"][0].get_hatch() is None
    assert not any(t.startswith("paged") for t in legend_texts(fig))


def test_a_cpu_panel_with_the_host_columns_names_the_four_kinds():
    fig = drawn(plot(cpu_session()))
    assert legend_texts(fig) == list(CPU_KINDS)
    assert set(fills(fig.axes[0])) == set(CPU_KINDS)


def test_without_the_host_columns_the_cpu_panel_leaves_others_and_free_out():
    fig = drawn(plot(cpu_session(host=False)))
    assert legend_texts(fig) == ["CPU tensors (last scan)", "rest of this process", "other processes: unknown",
                                 "free: unknown"]
    assert set(fills(fig.axes[0])) == {"CPU tensors (last scan)", "rest of this process"}


def test_unknown_per_process_numbers_are_not_drawn_as_zero():
    fig = drawn(plot(gpu_session(per_process=False)))
    ax = fig.axes[0]
    assert "non-PyTorch (this process)" not in fills(ax) and "other processes" not in fills(ax)
    assert legend_texts(fig) == ["torch allocated", "torch cached", "non-PyTorch (this process): unknown",
                                 "child processes (this notebook): unknown", "other processes: unknown",
                                 "used, not split", "free"]
    colours = {to_hex(c.get_facecolor()[0]) for bands in fills(ax).values() for c in bands}
    assert colours.isdisjoint({"#f57c00", "#d32f2f"})


def test_a_kind_unknown_for_a_while_is_drawn_only_where_known():
    fig = drawn(plot(gpu_session(unknown_before_s=300)))
    (band,) = fills(fig.axes[0])["non-PyTorch (this process)"]
    xs = np.concatenate([p.vertices[:, 0] for p in band.get_paths()])
    assert xs.min() >= 300  # not a zero-height band from 0 s


def test_y_ticks_fall_on_round_binary_values():
    for session in (gpu_session(), cpu_session(), gpu_session(seconds=60, cells=3)):
        fig = drawn(plot(session))
        for ax in fig.axes:
            lo, hi = ax.get_ylim()
            ticks = [v for v in ax.get_yticks() if lo <= v <= hi]
            assert len(ticks) >= 3 and ticks[0] == 0
            step = ticks[1] - ticks[0]
            assert step == 2 ** round(np.log2(step)), f"step {step} is not a power of two bytes"
            assert all(v % step == 0 for v in ticks)
            labels = [t.get_text() for t in ax.get_yticklabels() if lo <= t.get_position()[1] <= hi]
            assert all(re.fullmatch(r"0|[1-9]\d*(\.\d*[1-9])? (B|KiB|MiB|GiB|TiB)", s) for s in labels), labels


@pytest.mark.parametrize(("seconds", "pattern"), [(40, r"\d+ s"), (600, r"\d+:\d\d"), (4500, r"\d+:\d\d:\d\d")])
def test_x_ticks_are_round_steps_of_elapsed_time_in_one_style(seconds, pattern):
    fig = drawn(plot(gpu_session(seconds=seconds, cells=5, gpus=2)))
    ax = fig.axes[-1]
    lo, hi = ax.get_xlim()
    ticks = [v for v in ax.get_xticks() if lo <= v <= hi]
    labels = [t.get_text() for t in ax.get_xticklabels() if lo <= t.get_position()[0] <= hi]
    assert len(labels) >= 4
    assert all(re.fullmatch(pattern, s) for s in labels), labels
    step = ticks[1] - ticks[0]
    assert step in TIME_STEPS and all(np.isclose(v / step, round(v / step)) for v in ticks)
    assert not any(t.get_text() for t in fig.axes[0].get_xticklabels())  # one axis, under the last panel


def test_clock_ticks_are_round_local_times():
    fig = drawn(plot(gpu_session(seconds=600, cells=5), clock=True))
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    labels = [t.get_text() for t in ax.get_xticklabels() if lo <= t.get_position()[0] <= hi]
    assert len(labels) >= 4 and all(re.fullmatch(r"\d\d:\d\d:\d\d", s) for s in labels), labels
    seconds = [int(h) * 3600 + int(m) * 60 + int(s) for h, m, s in (x.split(":") for x in labels)]
    step = seconds[1] - seconds[0]
    assert step in TIME_STEPS and all(s % step == 0 for s in seconds)


def test_labels_and_titles_do_not_overlap_on_two_gpus():
    fig = drawn(plot(gpu_session(gpus=2, seconds=600, cells=30)))
    assert [ax.get_title(loc="left") for ax in fig.axes] == [f"cuda:{g} · NVIDIA H100 80GB HBM3" for g in (0, 1)]
    assert legend_texts(fig) == list(GPU_KINDS)  # one legend for both panels
    assert_labels_do_not_overlap(fig)
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        assert not ax._left_title.get_window_extent(renderer).overlaps(ax._right_title.get_window_extent(renderer))
    fig.set_size_inches(5, 4)  # placed again at the size it is drawn at
    drawn(fig)
    assert_labels_do_not_overlap(fig)


def test_each_known_peak_is_marked_over_its_cell():
    session = gpu_session(cells=9)
    fig = drawn(plot(session))
    marks = [line for line in fig.axes[0].lines if line.get_marker() == "v"]
    rep = session.report()
    known = rep["peak_allocated_bytes"].dropna()
    assert sorted(float(m.get_ydata()[0]) for m in marks) == sorted(float(v) for v in known)
    start = (rep["started"] - T0).dt.total_seconds()
    for m in marks:
        x = float(m.get_xdata()[0])
        assert any(s <= x <= s + d for s, d in zip(start, rep["duration_s"]))


def test_an_empty_session_says_so_and_still_renders():
    empty = Recorded(pd.DataFrame(columns=["time", "device", *BYTE_COLUMNS]),
                     pd.DataFrame(columns=["started", "duration_s", "device"]).rename_axis("cell"))
    fig = drawn(plot(empty))
    assert [t.get_text() for t in fig.axes[0].texts] == ["no samples yet"]
    assert fig._repr_png_()[:4] == b"\x89PNG"


# -- the tick rules -------------------------------------------------------------------------------------
def test_tick_rules():
    assert [time_step(s, 8) for s in (3, 40, 600, 4500, 86400 * 30)] == [0.5, 10, 120, 600, 86400 * 5]
    assert time_step(3, 8, minimum=1) == 1
    assert binary_step(80 * GiB, 6) == 16 * GiB
    assert binary_step(1.3 * GiB, 6) == 256 * MiB
    assert [tick_bytes(v) for v in (0, 768 * MiB, GiB, 1.5 * GiB, 48 * GiB, 100 * MiB)] == [
        "0", "768 MiB", "1 GiB", "1.5 GiB", "48 GiB", "100 MiB"]
