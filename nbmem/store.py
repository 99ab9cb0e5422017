"""The bounded store of samples and cell records; the only place that builds pandas frames."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import fields
from typing import Any, Iterable, Sequence

from .sources import Sample

SAMPLE_COLUMNS = ["time", "device", "allocated_bytes", "reserved_bytes", "active_bytes",
                  "inactive_split_bytes", "nvml_used_bytes", "nvml_total_bytes", "process_used_bytes",
                  "other_processes_bytes", "rss_bytes"]


class Store:
    """Ring buffers: the newest ``capacity`` samples and ``cell_capacity`` cell records."""

    def __init__(self, capacity: int = 7200 * 2, cell_capacity: int = 10_000) -> None:
        if capacity < 1 or cell_capacity < 1:
            raise ValueError("capacities must be >= 1")
        self._samples: deque[Sample] = deque(maxlen=capacity)
        self._cells: deque[Any] = deque(maxlen=cell_capacity)
        self._lock = threading.Lock()  # the sampler appends while the user reads

    @property
    def capacity(self) -> int:
        return self._samples.maxlen or 0

    def add_samples(self, batch: Iterable[Sample]) -> None:
        with self._lock:
            self._samples.extend(batch)

    def add_cell(self, record: Any) -> None:
        with self._lock:
            self._cells.append(record)

    def sample_list(self) -> list[Sample]:
        with self._lock:
            return list(self._samples)

    def cell_list(self) -> list[Any]:
        with self._lock:
            return list(self._cells)

    def last_samples(self, seconds: float, now: float) -> list[Sample]:
        """Samples of the last ``seconds``, oldest first (for the gauge's sparkline)."""
        with self._lock:
            out = []
            for s in reversed(self._samples):
                if s.t_wall < now - seconds:
                    break
                out.append(s)
        out.reverse()
        return out

    def clear(self) -> None:
        with self._lock:
            self._samples.clear()
            self._cells.clear()

    # -- frames ----------------------------------------------------------------------------------
    def samples_frame(self) -> Any:
        return samples_frame(self.sample_list())

    def cells_frame(self) -> Any:
        return records_frame(self.cell_list(), index="cell")


def samples_frame(samples: Sequence[Sample]) -> Any:
    """One row per (time, device); NaN where a value is unknown."""
    import pandas as pd

    names = [f.name for f in fields(Sample)]
    cols: dict[str, list[Any]] = {n: [getattr(s, n) for s in samples] for n in names}
    df = pd.DataFrame({
        "time": pd.to_datetime(pd.Series(cols.pop("t_wall"), dtype="float64"), unit="s", utc=True),
        "device": pd.Series(cols.pop("device"), dtype="object"),
        **{n: pd.Series(v, dtype="float64") for n, v in cols.items()},
    })
    return df[SAMPLE_COLUMNS]


def records_frame(records: Sequence[Any], *, index: str | None = None, columns: list[str] | None = None) -> Any:
    """A frame from frozen records, using their ``row()`` dicts."""
    import pandas as pd

    rows = [r.row() for r in records]
    df = pd.DataFrame(rows, columns=columns or (list(rows[0]) if rows else None))
    for c in df.columns:
        if c.endswith(("_bytes", "_s")):  # unknown is NaN, as in samples(), not an object column of None
            df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    if index is not None and index in df.columns:
        df = df.set_index(index)
    return df
