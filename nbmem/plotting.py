"""``nbmem.plot()``: memory over time per device, monitored cells shaded and their peaks marked."""

from __future__ import annotations

import io
from typing import Any

from matplotlib.figure import Figure

from .formatting import fmt_bytes

_SERIES = (("allocated_bytes", "torch allocated"), ("reserved_bytes", "torch reserved"),
           ("nvml_used_bytes", "NVML used (device)"), ("process_used_bytes", "NVML this process"),
           ("rss_bytes", "RSS (host)"))


class MemoryFigure(Figure):
    """A matplotlib Figure that shows itself in a notebook without ``%matplotlib inline``.

    It is built without pyplot (no global figure state, nothing shown twice), so IPython has no
    inline formatter for it unless the user enabled one; ``_repr_png_`` is the fallback.
    """

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=100)
        return buf.getvalue()


def plot(session: Any) -> Any:
    """A matplotlib Figure with one panel per device; returns it without showing it twice."""
    from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
    from matplotlib.ticker import FuncFormatter

    samples = session.samples()
    cells = session.report()
    devices = [d for d in dict.fromkeys(samples["device"]) if d != "cpu"] or ["cpu"]
    fig = MemoryFigure(figsize=(9, 2.6 * len(devices)), layout="constrained")
    axes = fig.subplots(len(devices), 1, squeeze=False)[:, 0]
    for ax, dev in zip(axes, devices):
        rows = samples[samples["device"] == dev]
        for col, label in _SERIES:
            if col in rows and rows[col].notna().any():
                ax.plot(rows["time"], rows[col], label=label, linewidth=1.2)
        dev_cells = cells[cells["device"] == dev] if len(cells) else cells
        for n, c in dev_cells.iterrows():
            start = c["started"]
            end = start + _timedelta(c["duration_s"])
            ax.axvspan(start, end, color="tab:gray", alpha=0.15, linewidth=0)
            ax.annotate(f"[{n}]", (start, 1.0), xycoords=("data", "axes fraction"), fontsize=8,
                        va="top", ha="left", color="dimgray")
            peak = c["peak_allocated_bytes"]
            if peak is not None and peak == peak:  # not NaN
                ax.plot([start + (end - start) / 2], [peak], marker="v", color="tab:red", markersize=6)
        if dev == "cpu" and len(dev_cells) and dev_cells["allocated_after_bytes"].notna().any():
            ends = dev_cells["started"] + dev_cells["duration_s"].map(_timedelta)
            ax.step(ends, dev_cells["allocated_after_bytes"], where="post", label="CPU tensors (scan)")
        ax.set_title(dev, loc="left", fontsize=10)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: fmt_bytes(v)))
        locator = AutoDateLocator()
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(ConciseDateFormatter(locator))
        if ax.has_data():
            ax.legend(loc="upper left", fontsize=8, frameon=False)
        else:
            ax.text(0.5, 0.5, "no samples yet", ha="center", va="center", transform=ax.transAxes)
    return fig


def _timedelta(seconds: float) -> Any:
    import pandas as pd

    return pd.Timedelta(seconds=float(seconds))
