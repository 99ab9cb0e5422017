"""The sampler thread and the bounded store (injected reads are fine here: this is the thread's logic)."""

from __future__ import annotations

import threading
import time

import pytest

from nbmem.sampler import THREAD_NAME, Sampler
from nbmem.sources import Sample
from nbmem.store import SAMPLE_COLUMNS, Store


def sample(t: float, dev: str = "cpu", v: int | None = 1) -> Sample:
    return Sample(t, dev, v, v, v, 0, v, 100, v, None, 10)


def test_sample_once_stores_and_tells_listeners():
    store = Store(capacity=10)
    got = []
    s = Sampler(lambda: [sample(1.0)], store.add_samples)
    s.listeners.append(got.append)
    s.sample_once()
    assert len(store.sample_list()) == 1 and len(got) == 1


def test_a_failing_read_is_reported_and_the_thread_keeps_going():
    errors, n = [], [0]

    def read():
        n[0] += 1
        if n[0] % 2:
            raise RuntimeError("GPU lost")
        return [sample(time.time())]

    store = Store(capacity=100)
    s = Sampler(read, store.add_samples, interval_s=0.01, on_error=errors.append)
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


def test_store_is_bounded_and_frames_have_nan_for_unknown():
    st = Store(capacity=5)
    st.add_samples([sample(float(i), v=None if i == 9 else i) for i in range(10)])
    df = st.samples_frame()
    assert list(df.columns) == SAMPLE_COLUMNS and len(df) == 5
    assert df["allocated_bytes"].isna().iloc[-1] and df["other_processes_bytes"].isna().all()
    assert str(df["time"].dt.tz) == "UTC"
    assert [s.t_wall for s in st.last_samples(2.5, now=9.0)] == [7.0, 8.0, 9.0]
