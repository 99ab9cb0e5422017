"""The sampler thread and the bounded store (injected reads are fine here: this is the thread's logic)."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from types import SimpleNamespace
from typing import Any

import pytest

from nbmem.records import SAMPLE_COLUMNS, Sample
from nbmem.sampler import THREAD_NAME, Sampler
from nbmem.store import Store


def sample(t: float, dev: str = "cpu", v: int | None = 1) -> Sample:
    return Sample(t, dev, v, v, v, 0, v, 100, v, None, 10)


def test_sample_once_hands_one_tick_to_the_sink():
    store = Store(ticks=10)
    s = Sampler(lambda: [sample(1.0), sample(1.0, "cuda:0")], store.add_tick)
    assert len(s.sample_once()) == 2
    assert [x.device for x in store.sample_list()] == ["cpu", "cuda:0"]
    assert store.latest_tick()[1].device == "cuda:0"


def test_a_failing_read_is_reported_and_the_thread_keeps_going():
    errors, n = [], [0]

    def read():
        n[0] += 1
        if n[0] % 2:
            raise RuntimeError("GPU lost")
        return [sample(time.time())]

    store = Store(ticks=100)
    s = Sampler(read, store.add_tick, interval_s=0.01, on_error=errors.append)
    s.start()
    time.sleep(0.2)
    s.stop()
    assert errors and len(store.sample_list()) >= 3
    assert not any(t.name == THREAD_NAME for t in threading.enumerate())


def test_schedule_does_not_drift():
    ticks = []
    s = Sampler(lambda: ticks.append(time.monotonic()) or [], lambda b: None, interval_s=0.02)
    s.start()
    time.sleep(0.5)
    s.stop()
    assert 20 <= len(ticks) <= 27  # 0.5 s / 0.02 s, a sleep overshoot does not accumulate


def test_one_named_daemon_thread_and_stop_joins():
    s = Sampler(lambda: [], lambda b: None, interval_s=0.01)
    s.start()
    s.start()
    ours = [t for t in threading.enumerate() if t.name == THREAD_NAME]
    assert len(ours) == 1 and ours[0].daemon
    s.stop()
    assert not s.running


def test_bad_interval_is_refused():
    with pytest.raises(ValueError, match="interval_s"):
        Sampler(lambda: [], lambda b: None, interval_s=0)


def test_store_is_bounded_by_ticks_whatever_the_number_of_devices():
    st = Store(ticks=5)
    for i in range(10):
        t = float(i)
        st.add_tick([sample(t, v=None if i == 9 else i), sample(t, "cuda:0", v=i), sample(t, "cuda:1")])
    assert len(st.sample_list()) == 15, "5 ticks of 3 devices, not 5 samples"
    df = st.samples_frame()
    assert list(df.columns) == list(SAMPLE_COLUMNS)
    cpu = df[df.device == "cpu"]
    assert list(cpu["allocated_bytes"].iloc[:4]) == [5, 6, 7, 8] and cpu["allocated_bytes"].isna().iloc[-1]
    assert str(df["allocated_bytes"].dtype) == "Int64" and df["other_processes_bytes"].isna().all()
    assert str(df["time"].dt.tz) == "UTC"
    assert [s.t_wall for s in st.last_samples(2.5, now=9.0) if s.device == "cpu"] == [7.0, 8.0, 9.0]


def test_resizing_keeps_the_newest_ticks():
    st = Store(ticks=10)
    for i in range(10):
        st.add_tick([sample(float(i))])
    st.resize(3)
    assert [s.t_wall for s in st.sample_list()] == [7.0, 8.0, 9.0]
    st.resize(6)
    for i in range(10, 14):
        st.add_tick([sample(float(i))])
    assert [s.t_wall for s in st.sample_list()] == [8.0, 9.0, 10.0, 11.0, 12.0, 13.0]


class _Exits:
    """Stands in for the atexit module: what was registered, and not taken back."""

    def __init__(self) -> None:
        self.funcs: list[Any] = []

    def register(self, f: Any) -> None:
        self.funcs.append(f)

    def unregister(self, f: Any) -> None:
        self.funcs = [g for g in self.funcs if g != f]


@pytest.mark.parametrize("kind", ["sampler", "gauge"])
def test_the_thread_is_stopped_at_exit_and_a_stopped_one_is_not_kept_for_it(kind: str, monkeypatch: Any) -> None:
    """At interpreter exit the thread is stopped before Python finalizes (a daemon thread ended there inside a C++
    call aborts the process); once stopped, nothing of it is kept until exit."""
    import importlib

    mod = importlib.import_module("nbmem.sampler" if kind == "sampler" else "nbmem.ui.widget")

    def make() -> Any:
        if kind == "sampler":
            return Sampler(lambda: [], lambda b: None, interval_s=0.01)
        return mod.Publisher(SimpleNamespace(hold_sync=contextlib.nullcontext), build=dict, rate_hz=100)

    exits = _Exits()
    monkeypatch.setattr(mod, "atexit", exits)
    t = make()
    t.start()
    thread = t._thread
    assert thread.is_alive() and len(exits.funcs) == 1
    exits.funcs[0]()  # what the interpreter runs at exit
    assert not thread.is_alive() and exits.funcs == []
    monkeypatch.undo()  # the real atexit: a stopped thread's owner is not held until exit
    t = make()
    t.start()
    t.stop()
    gone = weakref.ref(t)
    del t
    gc.collect()
    assert gone() is None
