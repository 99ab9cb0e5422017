"""``nbmem.plot()``: memory over time per device, stacked as the gauge splits it, monitored cells shaded;
``nbmem.plot_fit()``: a fit's runs, its model over the value and the room (drawn from the result record).

Each panel stacks the gauge's memory kinds with the gauge's names and colours. A kind that is unknown
at some time is left out of the stack there, never drawn as zero; what NVML (or the host) counts as in
use but the known kinds do not explain is then drawn as "used, not split", as the gauge does.
"""

from __future__ import annotations

import datetime as _dt
import io
import itertools
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from matplotlib.artist import Artist
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.text import Text
from matplotlib.ticker import Formatter, FuncFormatter, Locator
from matplotlib.transforms import ScaledTranslation, blended_transform_factory

from nbmem.formatting import fmt_bytes
from nbmem.ui.frontend import ROW_COLUMNS, segment_spec

if TYPE_CHECKING:
    from nbmem.fitting.analysis.prediction import FitResult

_SPEC = segment_spec()  # js/segments.js: the gauge's split, read here so nbmem.plot() agrees with the gauge
_ALL = [*_SPEC["gpu"], *_SPEC["cpu"], _SPEC["cpu_unscanned"], _SPEC["gpu_unscanned"], _SPEC["unsplit"], _SPEC["free"]]
#: The gauge's colours, by the gauge's names.
COLORS = {d["label"]: d["color"] for d in _ALL}
#: The kinds a panel always names, as drawn or as unknown; an optional kind (paged memory) only where it has bytes.
GPU_KINDS = tuple(d["label"] for d in [*_SPEC["gpu"], _SPEC["free"]] if not d.get("optional"))
CPU_KINDS = tuple(d["label"] for d in [*_SPEC["cpu"], _SPEC["free"]] if not d.get("optional"))

#: Tick steps of the time axis, in seconds; past a day, whole days.
TIME_STEPS = (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800,
              3600, 7200, 10800, 21600, 43200, 86400)

_LABEL_PT = 8.0  # cell labels
_ROW_PT = 10.5  # one row of cell labels
_TITLE_PAD_PT = 2 + 2 * _ROW_PT + 3  # the title sits above both rows
_INK = "#424242"


class MemoryFigure(Figure):
    """A matplotlib Figure that shows itself in a notebook without ``%matplotlib inline``.

    It is built without pyplot (no global figure state, nothing shown twice), so IPython has no
    inline formatter for it unless the user enabled one; ``_repr_png_`` is the fallback.
    """

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=100)
        return buf.getvalue()


@dataclass(frozen=True)
class Band:
    """One layer of a panel's stack: bytes per sample, NaN where unknown."""

    label: str
    bytes: np.ndarray
    hatch: str | None = None

    @property
    def known(self) -> bool:
        return bool(np.isfinite(self.bytes).any())


def plot(session: Any, *, clock: bool = False) -> MemoryFigure:
    """One panel per GPU (or one "cpu" panel) of memory over time; ``clock=True`` labels local time."""
    import pandas as pd

    samples = session.samples()
    cells = _cells(session.report())
    gpus = sorted({d for d in samples["device"] if d != "cpu"}, key=_device_key)
    devices = gpus or ["cpu"]
    models = _models(session)
    fig = MemoryFigure(figsize=(9.6, 0.5 + 2.9 * len(devices)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)  # a renderer of its own, for the label placement at draw time
    axes = fig.subplots(len(devices), 1, squeeze=False, sharex=True)[:, 0]
    if samples.empty:
        _empty(axes[0], devices[0], "no samples yet")
        return fig

    times = pd.to_datetime(samples["time"], utc=True)
    t0 = times.min()
    x_all = (times - t0).dt.total_seconds().to_numpy()
    # Each sample stands for the interval after it, the last one too, so that it shows.
    hold = float(np.median(np.diff(np.unique(x_all)))) if len(np.unique(x_all)) > 1 else 0.0
    ends = (cells["start"] - t0).dt.total_seconds() + cells["duration"]
    span = max(float(x_all.max()) + hold, float(ends.max()) if len(ends) else 0.0)  # the latest cells too
    lo, hi = (0.0, span) if span > 0 else (-0.5, 0.5)
    legend: dict[str, Patch] = {}
    for ax, dev in zip(axes, devices):
        mine = (samples["device"] == dev).to_numpy()
        order = np.argsort(x_all[mine], kind="stable")
        rows = samples[mine].iloc[order]
        x = x_all[mine][order]
        on_dev = cells[cells["device"] == dev]
        # A GPU's paged memory is known from the latest scan only, not over time: its panel keeps it in non-PyTorch.
        bands, total = stack(dev, rows, _cpu_tensors(on_dev, t0, x) if dev == "cpu" else None)
        if hold and len(x):
            x = np.r_[x, x[-1] + hold]
            bands = [replace(b, bytes=np.r_[b.bytes, b.bytes[-1:]]) for b in bands]
        _title(ax, dev, models.get(dev, ""), total)
        if not any(b.known for b in bands):
            _empty(ax, dev, "no memory readings known for this device")
            continue
        top = _draw_stack(ax, x, bands, total, legend)
        peaks = _draw_cells(ax, cells, on_dev, t0, dev, (lo, hi))
        ymax = max(top, peaks, 1.0)
        ax.set_xlim(lo, hi)
        ax.set_ylim(0, ymax * 1.06)
        ax.yaxis.set_major_locator(BinaryLocator())
        ax.yaxis.set_major_formatter(_BytesFormatter())
        ax.spines[["top", "right"]].set_visible(False)
        ax.tick_params(labelsize=9, colors=_INK)
    origin = _local_epoch(t0) if clock else 0.0
    axes[-1].xaxis.set_major_locator(TimeLocator(origin, minimum=1.0 if clock else 0.0))
    fmt = ClockFormatter(t0.timestamp()) if clock else ElapsedFormatter(hi)
    axes[-1].xaxis.set_major_formatter(fmt)
    axes[-1].set_xlabel(fmt.axis_label, fontsize=9, color=_INK)
    if legend:
        lines = math.ceil(len(legend) / 5)  # five fit on one line at this width
        fig.legend(handles=list(legend.values()), loc="outside upper center", ncols=math.ceil(len(legend) / lines),
                   frameon=False, fontsize=9, handlelength=1.2, columnspacing=1.4)
    return fig


# -- a dead kernel's last samples --------------------------------------------------------------------
_DEATH_STYLE = {"rss": ("#1976d2", "-", "host RSS"), "used": ("#ef6c00", "--", "counted against the limit"),
                "total": ("#c62828", ":", "the limit"), "allocated": ("#1976d2", "-", "allocated"),
                "reserved": ("#64b5f6", "--", "reserved"), "process": ("#6a1b9a", ":", "this process (NVML)")}


def plot_death(death: Any) -> MemoryFigure:
    """A dead kernel's last samples (its capsule's): host memory against the limit, and each GPU, over the
    seconds before it died, with the cell that was running marked."""
    devices = list(dict.fromkeys(d for d, _w, _v in death.series)) or ["cpu"]
    fig = MemoryFigure(figsize=(9.6, 0.5 + 2.6 * len(devices)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(devices), 1, squeeze=False, sharex=True)[:, 0]
    if not death.times:
        _empty(axes[0], "cpu", "the capsule kept no samples")
        return fig
    x = np.array(death.times) - death.last_seen_wall
    for ax, dev in zip(axes, devices):
        top = 0.0
        for d, what, values in death.series:
            if d != dev or all(v is None for v in values):
                continue
            color, style, label = _DEATH_STYLE[what]
            y = np.array([np.nan if v is None else float(v) for v in values])
            ax.plot(x, y, color=color, ls=style, lw=1.6, label=label)
            top = max(top, float(np.nanmax(y)))
        ax.set_ylim(0, top * 1.08 or 1)  # from zero: how much of the limit was in use reads off the picture
        ax.set_title(dev if dev != "cpu" else "host memory", loc="left", fontsize=10, fontweight="bold",
                     color="#212121")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, pos: tick_bytes(v)))
        ax.tick_params(labelsize=9, colors=_INK)
        if death.cell_started_wall is not None and death.cell_started_wall - death.last_seen_wall >= x[0]:
            ax.axvline(death.cell_started_wall - death.last_seen_wall, color=_INK, lw=1.0, ls="--")
        ax.legend(fontsize=8, loc="lower right", frameon=False)
    if death.cell is not None:
        axes[0].text(0.99, 1.02, f"In [{death.cell}]: {death.first_line[:60]}", transform=axes[0].transAxes,
                     ha="right", va="bottom", fontsize=8, color=_INK)
    axes[-1].set_xlabel("seconds before the kernel died (its last sample at 0)", fontsize=9, color=_INK)
    return fig


# -- a fit ---------------------------------------------------------------------------------------------
def plot_fit(result: FitResult, ax: Any = None) -> Any:
    """The runs' peaks, the model's peak reserved memory over the value, the room and the prediction."""
    fig = None
    if ax is None:
        fig = MemoryFigure(figsize=(7.2, 3.6), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
    if result.curve:
        xs = [v for v, _, _ in result.curve]
        ax.plot(xs, [r for _, _, r in result.curve], color="#1976d2", lw=1.6, label="model: peak reserved")
        ax.plot(xs, [a for _, a, _ in result.curve], color="#90caf9", lw=1.2, ls="--", label="model: peak allocated")
    runs = [p for p in result.points if p.counted and not p.skipped and p.peak_reserved_bytes is not None]
    if runs:
        ax.scatter([p.value for p in runs], [p.peak_reserved_bytes for p in runs], color="#0d47a1", zorder=3,
                   label="runs: peak reserved")
    if result.room is not None:
        on = f" on {result.room.device}" if len(result.devices) > 1 else ""  # the runs drawn are that device's
        ax.axhline(result.room.capacity_bytes, color="#d32f2f", lw=1.2,
                   label=f"room{on} ({fmt_bytes(result.room.margin_bytes)} margin kept)")
    if result.largest_value is not None:
        ax.axvline(result.largest_value, color="#424242", lw=1, ls=":",
                   label=f"largest that fits: {result.largest_value:,}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(result.name)
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(BinaryLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda x, pos: tick_bytes(x)))
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(frameon=False, fontsize=8)
    ax.set_title(f"{result.name}: {result.answer()}", fontsize=10)
    return fig if fig is not None else ax.figure


# -- what is stacked --------------------------------------------------------------------------------
def stack(device: str, rows: Any, scanned: np.ndarray | None = None) -> tuple[list[Band], float]:
    """A panel's bands, bottom to top, and the device's total (NaN if unknown).

    GPU: torch allocated, torch cached (reserved - allocated), paged memory, non-PyTorch (NVML process - reserved
    - paged), the notebook's child processes, other processes, then free (total - used). CPU: CPU tensors, rest of
    this process (RSS - tensors), other processes (host used - RSS), free. ``scanned`` is the column the holder
    scan gives (the CPU tensors, a GPU's paged memory; NaN where unknown): where it is unknown the process is one
    block, "this process (RSS)" or "non-PyTorch (this process)" as before paged memory was named, as in the gauge.
    Where some in-use kind is unknown, "used, not split" covers what is in use but unexplained.
    """
    n = len(rows)
    kind = "cpu" if device == "cpu" else "gpu"
    u = _SPEC[f"{kind}_unscanned"]
    scan = np.full(n, np.nan) if scanned is None else np.asarray(scanned, dtype="float64")

    def col(name: str) -> np.ndarray:
        if name == u["scan"]:
            return scan
        sample_col = ROW_COLUMNS[kind].get(name)
        if sample_col is None or sample_col not in rows:
            return np.full(n, np.nan)
        import pandas as pd

        return pd.to_numeric(rows[sample_col], errors="coerce").astype("float64").to_numpy()

    def bytes_of(how: Any) -> np.ndarray:
        return col(how) if isinstance(how, str) else _diff(col(how[0]), *(col(c) for c in how[2::2]))

    in_use = [Band(d["label"], bytes_of(d["bytes"])) for d in _SPEC[kind]]
    # Where the last scan's column is known the process is split by it; elsewhere it is one block.
    split = np.isfinite(scan)
    replaced = [i for i, d in enumerate(_SPEC[kind]) if d["key"] in u["replaces"]]
    for i in replaced:
        in_use[i] = Band(in_use[i].label, np.where(split, in_use[i].bytes, np.nan))
    # Hatched on the CPU, where RSS is not split at all; a GPU's block is the non-PyTorch slice drawn as always.
    block = Band(u["label"], np.where(split, np.nan, bytes_of(u["bytes"])), hatch="//" if kind == "cpu" else None)
    in_use.insert(replaced[-1] + 1, block)
    unknown = ~np.isfinite(np.where(split, sum(in_use[i].bytes for i in replaced), block.bytes))
    for b in [b for i, b in enumerate(in_use) if i not in replaced and b is not block]:
        unknown |= ~np.isfinite(b.bytes)
    # Dropped after the sums above: an optional band with no bytes anywhere is left out, never drawn as unknown.
    optional = {d["label"] for d in _SPEC[kind] if d.get("optional")}
    in_use = [b for b in in_use if b.label not in optional or bool((np.nan_to_num(b.bytes) > 0).any())]
    used, total = col("used"), col("total")
    known = np.nansum(np.vstack([b.bytes for b in in_use]), axis=0) if n else np.zeros(0)
    unsplit = np.where(unknown & (used > known), used - known, np.nan)
    free = Band(_SPEC["free"]["label"], bytes_of(_SPEC["free"]["bytes"]))
    bands = [*in_use, Band(_SPEC["unsplit"]["label"], unsplit, hatch="//"), free]
    finite = total[np.isfinite(total)]
    return bands, float(finite.max()) if finite.size else math.nan


def _diff(a: np.ndarray, *rest: np.ndarray) -> np.ndarray:
    """``a - b - ...``, unknown where any is; at least 0, as they come from different reads."""
    ok = np.isfinite(a)
    for b in rest:
        ok &= np.isfinite(b)
    with np.errstate(invalid="ignore"):
        return np.where(ok, np.maximum(a - sum(rest, np.zeros_like(a)), 0.0), np.nan)


def _cpu_tensors(cpu_cells: Any, t0: Any, x: np.ndarray) -> np.ndarray:
    """CPU tensor bytes at each sample time, known between cells: what the latest cell measured at its end.

    The scan runs at cell boundaries only, so during a cell (and before the first one) it is unknown.
    """
    import pandas as pd

    out = np.full(len(x), np.nan)
    if cpu_cells.empty:
        return out
    c = cpu_cells.sort_values("start", kind="stable")
    start = (c["start"] - t0).dt.total_seconds().to_numpy()
    end = start + c["duration"].to_numpy()
    after = pd.to_numeric(c["allocated_after_bytes"], errors="coerce").astype("float64").to_numpy()
    i = np.searchsorted(end, x, side="right") - 1  # the latest cell that ended at or before x
    known = i >= 0
    out[known] = after[i[known]]
    nxt = np.searchsorted(start, x, side="right") - 1  # the latest cell that started at or before x
    out[nxt > i] = np.nan  # inside a cell
    return out


# -- drawing -----------------------------------------------------------------------------------------
def _draw_stack(ax: Any, x: np.ndarray, bands: Sequence[Band], total: float, legend: dict[str, Patch]) -> float:
    """Fills the bands one on another where each is known; returns the highest value drawn."""
    base = np.zeros(len(x))
    for band in bands:
        v = band.bytes
        ok = np.isfinite(v)
        top = base + np.where(ok, v, 0.0)
        if ok.any():
            style: dict[str, Any] = {"facecolor": COLORS[band.label], "linewidth": 0}
            if band.hatch:
                style |= {"hatch": band.hatch, "edgecolor": "white"}
            if band.label == "free":
                style["alpha"] = 0.5  # light, and the cell shading behind it shows through
            if len(x) == 1:  # one sample: a bar, since an area needs two
                ax.bar(x, top - base, bottom=base, width=0.2, label=band.label, **style)
            else:
                # Each sample holds until the next one, so a known run reaches the next sample.
                held = ok | np.r_[False, ok[:-1]]
                ax.fill_between(x, base, top, where=held, step="post", label=band.label, **style)
            named = legend.get(band.label)
            if named is None or named.get_label() != band.label:  # a band of its name was unknown: it is drawn here
                legend[band.label] = Patch(label=band.label, **style)
        elif band.label in GPU_KINDS + CPU_KINDS:
            # Named in the legend as unknown, so a missing band does not read as an empty one.
            legend.setdefault(band.label, Patch(facecolor="none", edgecolor="#9e9e9e", linestyle=(0, (2, 2)),
                                                label=f"{band.label}: unknown"))
        base = top
    high = float(np.nanmax(base)) if len(base) else 0.0
    if math.isfinite(total):
        ax.axhline(total, color="#757575", linewidth=0.8, zorder=2.2)
        high = max(high, total)
    return high


def _draw_cells(ax: Any, cells: Any, on_dev: Any, t0: Any, device: str, view: tuple[float, float]) -> float:
    """Shades each cell's span, marks its exact peak and queues its label; returns the highest peak."""
    if cells.empty:
        return 0.0
    spans = cells.groupby("cell", sort=True).agg(start=("start", "min"), duration=("duration", "max"))
    start = (spans["start"] - t0).dt.total_seconds().to_numpy()
    end = start + spans["duration"].to_numpy()
    seen = (end >= view[0]) & (start <= view[1])
    peak_col = "peak_rss_bytes" if device == "cpu" else "peak_allocated_bytes"
    by_cell = on_dev.groupby("cell", sort=True).first() if not on_dev.empty else on_dev.set_index("cell")
    peak = _num(by_cell, peak_col).reindex(spans.index).to_numpy()
    moved = (_num(by_cell, "allocated_after_bytes") - _num(by_cell, "allocated_before_bytes")).abs()
    rise = _num(by_cell, peak_col) - _num(by_cell, "allocated_before_bytes")
    score = np.fmax(moved.reindex(spans.index).to_numpy(), rise.reindex(spans.index).to_numpy())
    labels = []
    for i, n in enumerate(spans.index):
        if not seen[i]:
            continue
        ax.axvspan(start[i], end[i], facecolor="#000000", alpha=0.07, linewidth=0, zorder=0.5)
        # A strip on the top edge ties each label to its span; at least a line wide for short cells.
        ax.axvspan(start[i], end[i], ymin=0.975, facecolor=_INK, linewidth=0, zorder=2.3)
        ax.axvline(start[i], ymin=0.975, color=_INK, linewidth=1.0, zorder=2.3)
        if math.isfinite(peak[i]):
            ax.hlines(peak[i], start[i], end[i], color="#212121", linewidth=1.0, zorder=4)
            ax.plot([(start[i] + end[i]) / 2], [peak[i]], linestyle="none", marker="v", markersize=4,
                    color="#212121", zorder=4)
        text = Text(0, 1, f"[{n}]", fontsize=_LABEL_PT, color=_INK, ha="center", va="bottom", gid="cell-label")
        text.set_in_layout(False)
        text.set_clip_on(False)
        ax.add_artist(text)
        # Labels go to the cells that moved memory most, then the longest, then the earliest.
        labels.append(((-np.nan_to_num(score[i]), -(end[i] - start[i]), i), text, start[i], end[i]))
    labels.sort(key=lambda t: t[0])
    ax.add_artist(CellLabels(ax, [(t, s, e) for _, t, s, e in labels]))
    finite = peak[np.isfinite(peak) & seen]
    return float(finite.max()) if finite.size else 0.0


class CellLabels(Artist):
    """Places the cells' "[n]" labels above the axes when drawn, in two rows, skipping any that would overlap.

    Placement happens at draw time with the renderer in use, so it holds at any size and dpi.
    Labels are given in priority order; each goes in the first row where it overlaps nothing.
    """

    zorder = 0  # before the labels themselves (Text: 3)

    def __init__(self, ax: Any, labels: Sequence[tuple[Text, float, float]]) -> None:
        super().__init__()
        self.set_in_layout(False)
        self._ax = ax
        self._labels = list(labels)
        fig = ax.get_figure()
        base = blended_transform_factory(ax.transData, ax.transAxes)
        self._rows = [base + ScaledTranslation(0, (2 + r * _ROW_PT) / 72, fig.dpi_scale_trans) for r in (0, 1)]

    def draw(self, renderer: Any) -> None:
        ax = self._ax
        x0, x1 = ax.bbox.x0, ax.bbox.x1
        to_px, to_data = ax.transData, ax.transData.inverted()
        gap = renderer.points_to_pixels(4)
        taken: list[list[tuple[float, float]]] = [[], []]
        for text, start, end in self._labels:
            text.set_visible(True)  # an invisible Text measures as a unit box
            a, b = (min(max(to_px.transform((v, 0))[0], x0), x1) for v in (start, end))
            text.set_transform(self._rows[0])
            text.set_x(start)
            w = text.get_window_extent(renderer).width
            left = min(max((a + b - w) / 2, x0), x1 - w)
            text.set_visible(False)
            for row, spans in enumerate(taken):
                if all(left + w + gap <= s or left >= e + gap for s, e in spans):
                    spans.append((left, left + w))
                    text.set_transform(self._rows[row])
                    text.set_x(to_data.transform((left + w / 2, 0))[0])
                    text.set_visible(True)
                    break


def _title(ax: Any, device: str, model: str, total: float) -> None:
    ax.set_title(f"{device} · {model}" if model else device, loc="left", fontsize=10, fontweight="bold",
                 pad=_TITLE_PAD_PT, color="#212121")
    if math.isfinite(total):
        what = "host RAM" if device == "cpu" else "total"
        ax.set_title(f"{what} {fmt_bytes(total)}   ▾ cell peak", loc="right", fontsize=9,
                     pad=_TITLE_PAD_PT, color=_INK)


def _empty(ax: Any, device: str, message: str) -> None:
    ax.set_title(device, loc="left", fontsize=10, fontweight="bold", color="#212121")
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color=_INK)
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_color("#bdbdbd")


# -- axes --------------------------------------------------------------------------------------------
class TimeLocator(Locator):
    """Ticks at round steps of time (1/2/5/10/15/30 s, 1/2/5/10/15/30 min, 1/2/3/6/12 h, days).

    ``origin`` is added before rounding: 0 for elapsed time, the local epoch of the first sample for
    wall-clock ticks that fall on round local times.
    """

    def __init__(self, origin: float = 0.0, *, minimum: float = 0.0) -> None:
        self.origin = origin
        self.minimum = minimum

    def __call__(self) -> Sequence[float]:
        lo, hi = sorted(self.axis.get_view_interval()) if self.axis else (0.0, 1.0)
        return self.tick_values(lo, hi, max_ticks=max(2, int(_axes_points(self.axis)[0] // 64)))

    def tick_values(self, vmin: float, vmax: float, max_ticks: int = 8) -> Sequence[float]:
        step = time_step(vmax - vmin, max_ticks, minimum=self.minimum)
        k0 = math.ceil((vmin + self.origin) / step - 1e-9)
        k1 = math.floor((vmax + self.origin) / step + 1e-9)
        return [k * step - self.origin for k in range(k0, k1 + 1)]


def time_step(span: float, max_ticks: int, *, minimum: float = 0.0) -> float:
    """The smallest round step that puts at most ``max_ticks`` ticks on ``span`` seconds."""
    for step in TIME_STEPS:
        if step >= minimum and span / step < max_ticks:
            return float(step)
    days = 1.0
    while span / (86400 * days) >= max_ticks:
        days = days * 2.5 if str(days)[0] == "2" else days * 2  # 1, 2, 5, 10, 20, 50 … days
    return 86400.0 * days


class ElapsedFormatter(Formatter):
    """Elapsed time in one style for the whole axis: "20 s" below a minute, "m:ss", "h:mm:ss" past an hour."""

    def __init__(self, end_s: float) -> None:
        self.style = "s" if end_s < 60 else "m:ss" if end_s < 3600 else "h:mm:ss"
        self.axis_label = "time since the first sample" + ("" if self.style == "s" else f" ({self.style})")
        self.decimals = 0

    def set_locs(self, locs: list[float]) -> None:
        super().set_locs(locs)
        step = min((b - a for a, b in itertools.pairwise(locs)), default=1.0)
        self.decimals = 0 if step >= 1 - 1e-9 else 1

    def __call__(self, x: float, pos: int | None = None) -> str:
        if self.style == "s":
            return f"{0.0 if abs(x) < 1e-9 else x:.{self.decimals}f} s"  # never "-0 s"
        s = round(x)
        sign, s = ("-" if s < 0 else ""), abs(s)
        if self.style == "m:ss":
            return f"{sign}{s // 60}:{s % 60:02d}"
        return f"{sign}{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class ClockFormatter(Formatter):
    """Local wall-clock time, HH:MM:SS; ``x`` is seconds after ``t0`` (epoch seconds)."""

    axis_label = "local time"

    def __init__(self, t0: float) -> None:
        self.t0 = t0

    def __call__(self, x: float, pos: int | None = None) -> str:
        return _dt.datetime.fromtimestamp(round(self.t0 + x)).strftime("%H:%M:%S")


class BinaryLocator(Locator):
    """Byte ticks at multiples of a power of two (…, 256 MiB, 512 MiB, 1 GiB, 2 GiB, …), from 0."""

    def __call__(self) -> Sequence[float]:
        lo, hi = sorted(self.axis.get_view_interval()) if self.axis else (0.0, 1.0)
        return self.tick_values(lo, hi, max_ticks=max(3, int(_axes_points(self.axis)[1] // 22)))

    def tick_values(self, vmin: float, vmax: float, max_ticks: int = 6) -> Sequence[float]:
        step = binary_step(vmax - vmin, max_ticks)
        return [k * step for k in range(math.ceil(vmin / step), math.floor(vmax / step) + 1)]


def binary_step(span: float, max_ticks: int) -> float:
    """The smallest power of two (in bytes) that puts at most ``max_ticks`` ticks on ``span``."""
    step = 1.0
    while span / step >= max_ticks:
        step *= 2
    return step


class _BytesFormatter(Formatter):
    def __call__(self, x: float, pos: int | None = None) -> str:
        return tick_bytes(x)


def tick_bytes(n: float) -> str:
    """A byte tick label: ``fmt_bytes`` without trailing zeros ("1 GiB", "1.5 GiB", "768 MiB"), "0" for 0."""
    if n == 0:
        return "0"
    number, unit = fmt_bytes(n).split(" ")
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    return f"{number} {unit}"


# -- inputs ------------------------------------------------------------------------------------------
def _cells(report: Any) -> Any:
    """The report with the cell number as a column, ``start`` as UTC times and ``duration`` in seconds."""
    import pandas as pd

    out = report.reset_index()
    out["start"] = pd.to_datetime(out["started"], utc=True)
    out["duration"] = pd.to_numeric(out["duration_s"], errors="coerce").astype("float64").fillna(0.0).clip(lower=0)
    return out


def _num(df: Any, col: str) -> Any:
    import pandas as pd

    if col not in df:
        return pd.Series(np.nan, index=df.index, dtype="float64")
    return pd.to_numeric(df[col], errors="coerce").astype("float64")


def _models(session: Any) -> dict[str, str]:
    """GPU model names by device, from the engine's public ``devices()`` (a stand-in session may have none)."""
    devices = session.devices() if callable(getattr(session, "devices", None)) else ()
    return {d.name: d.model for d in devices}


def _axes_points(axis: Any) -> tuple[float, float]:
    """Width and height of the axis's Axes in points (a default size when it has none yet)."""
    axes = getattr(axis, "axes", None)
    fig = axes.get_figure() if axes is not None else None
    if axes is None or fig is None:
        return 500.0, 150.0
    return axes.bbox.width * 72 / fig.dpi, axes.bbox.height * 72 / fig.dpi


def _device_key(device: str) -> tuple[int, str]:
    kind, _, index = device.partition(":")
    return (int(index) if index.isdigit() else -1, kind)


def _local_epoch(t0: Any) -> float:
    """Epoch seconds of ``t0`` shifted by the local UTC offset, so round multiples are round local times."""
    epoch = t0.timestamp()
    offset = _dt.datetime.fromtimestamp(epoch).astimezone().utcoffset()
    return epoch + (offset.total_seconds() if offset else 0.0)
