"""The bounded store of samples and cell records; the only place that builds pandas frames."""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import fields
from typing import Any

from nbmem.formatting import prose
from nbmem.records import SAMPLE_COLUMNS, CellRecord, Sample

#: Columns that hold bytes or counts: nullable integers in every frame (NA where unknown).
_INT_SUFFIXES = ("_bytes", "tensors", "events", "cell", "line")


def ticks_for(history_s: float, interval_s: float) -> int:
    """How many sampler ticks cover ``history_s`` seconds (each tick holds every device)."""
    return max(1, math.ceil(history_s / interval_s))


class Store:
    """Ring buffers: the newest ``ticks`` sampler ticks (one batch of samples each) and cell records."""

    def __init__(self, ticks: int = 7200, cell_capacity: int = 10_000) -> None:
        if ticks < 1 or cell_capacity < 1:
            raise ValueError("capacities must be >= 1")
        self._ticks: deque[tuple[Sample, ...]] = deque(maxlen=ticks)
        self._cells: deque[CellRecord] = deque(maxlen=cell_capacity)
        self._lock = threading.Lock()  # the sampler appends while the user reads

    def resize(self, ticks: int) -> None:
        """Keep at most ``ticks`` ticks from now on; the newest are kept when it shrinks."""
        with self._lock:
            self._ticks = deque(self._ticks, maxlen=max(1, ticks))

    def add_tick(self, batch: Iterable[Sample]) -> None:
        with self._lock:
            self._ticks.append(tuple(batch))

    def add_cell(self, record: CellRecord) -> None:
        with self._lock:
            self._cells.append(record)

    def sample_list(self) -> list[Sample]:
        with self._lock:
            return [s for tick in self._ticks for s in tick]

    def cell_list(self) -> list[CellRecord]:
        with self._lock:
            return list(self._cells)

    def last_samples(self, seconds: float, now: float) -> list[Sample]:
        """Samples of the last ``seconds``, oldest first (for the gauge's sparkline)."""
        with self._lock:
            out: list[Sample] = []
            for tick in reversed(self._ticks):
                if tick and tick[0].t_wall < now - seconds:
                    break
                out.extend(reversed(tick))
        out.reverse()
        return out

    def samples_between(self, start: float, end: float) -> list[Sample]:
        """Samples taken from ``start`` to ``end`` (epoch seconds), oldest first (what a cell saw)."""
        with self._lock:
            out: list[Sample] = []
            for tick in reversed(self._ticks):
                if tick and tick[0].t_wall < start:
                    break
                if tick and tick[0].t_wall <= end:
                    out.extend(reversed(tick))
        out.reverse()
        return out

    def latest_tick(self) -> tuple[Sample, ...]:
        with self._lock:
            return self._ticks[-1] if self._ticks else ()

    def clear(self) -> None:
        with self._lock:
            self._ticks.clear()
            self._cells.clear()

    def samples_frame(self) -> Any:
        return samples_frame(self.sample_list())


def _is_int_column(name: str) -> bool:
    return name.endswith(_INT_SUFFIXES)


def samples_frame(samples: Sequence[Sample]) -> Any:
    """One row per (time, device); integer bytes, NA where a value is unknown."""
    import pandas as pd

    names = [f.name for f in fields(Sample) if f.name not in ("processes", "children", "memory_limit")]
    cols: dict[str, list[Any]] = {n: [getattr(s, n) for s in samples] for n in names}
    df = pd.DataFrame({
        "time": pd.to_datetime(pd.Series(cols.pop("t_wall"), dtype="float64"), unit="s", utc=True),
        "device": pd.Series(cols.pop("device"), dtype="object"),
        **{n: pd.Series(v, dtype="Int64") for n, v in cols.items()},
    })
    return df[list(SAMPLE_COLUMNS)]


def records_frame(records: Sequence[Any], *, columns: Sequence[str], index: str | None = None,
                  note: str = "") -> Any:
    """A frame from frozen records' ``row()`` dicts: bytes and counts as ``Int64`` with NA, seconds as float;
    an empty one says ``note`` (why it is empty) under its columns."""
    import pandas as pd

    df = pd.DataFrame([r.row() for r in records], columns=list(columns))
    for c in df.columns:
        if _is_int_column(c):
            df[c] = pd.array([None if v is None or v != v else int(v) for v in df[c]], dtype="Int64")
        elif c.endswith("_s"):
            df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    if index is not None:
        df = df.set_index(index)
    return noted(df, note) if note and df.empty else df


_NOTED: list[type] = []  # the class below, made once: pandas is imported when a frame is asked for, not on load


def noted(df: Any, note: str) -> Any:
    """``df`` as a DataFrame that shows ``note`` (``attrs["note"]``) under its columns while it has no rows."""
    if not _NOTED:
        import pandas as pd

        class NotedFrame(pd.DataFrame):
            """A DataFrame in all but its display: what is made from it (a filter, a copy) is a plain
            DataFrame, and it pickles as one."""

            @property
            def _constructor(self) -> Any:
                return pd.DataFrame

            def __reduce_ex__(self, protocol: Any) -> Any:
                return pd.DataFrame, (pd.DataFrame(self),)

            def _note(self) -> str:
                return str(self.attrs.get("note", "")) if self.empty else ""

            def __repr__(self) -> str:
                return "\n".join(filter(None, [repr(pd.DataFrame(self)), self._note()]))

            def _repr_html_(self) -> str | None:
                html, note = pd.DataFrame(self)._repr_html_(), self._note()
                return f"{html}<p>{prose(note)}</p>" if html is not None and note else html

        _NOTED.append(NotedFrame)
    out = _NOTED[0](df)
    out.attrs["note"] = note
    return out
