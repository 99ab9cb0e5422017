"""The background sampler: a boring, named daemon thread on a drift-free schedule."""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")

THREAD_NAME = "nbmem-sampler"


class Sampler(Generic[T]):
    """Calls ``read`` every ``interval_s`` and hands the result to ``sink``.

    Ticks are scheduled on multiples of the interval from the start, so they do not drift; ticks
    missed while the process was stalled are skipped, not replayed. A failing read is passed to
    ``on_error`` and the thread keeps going.
    """

    def __init__(self, read: Callable[[], Sequence[T]], sink: Callable[[Sequence[T]], None], *,
                 interval_s: float = 0.5, clock: Callable[[], float] = time.monotonic,
                 on_error: Callable[[BaseException], None] = lambda e: None) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self._read = read
        self._sink = sink
        self.interval_s = float(interval_s)
        self._clock = clock
        self._on_error = on_error
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample_once(self) -> Sequence[T]:
        """Take one sample now and hand it to the sink; errors go to ``on_error``."""
        try:
            batch = self._read()
            self._sink(batch)
        except Exception as e:
            self._on_error(e)
            return ()
        return batch

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        # A daemon thread still running when the interpreter finalizes is ended where it next takes the GIL; in a
        # C++ call (torch's allocator stats) that unwinding aborts the process ("terminate called without an
        # active exception") as IPython exits. At exit it is stopped first, given 2 s to finish a reading. Made
        # before the thread, so a stop() that follows at once always finds it to take back.
        atexit.register(self._stop_at_exit)
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def _stop_at_exit(self) -> None:
        self.stop(timeout_s=2.0)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and wait for it to end."""
        atexit.unregister(self._stop_at_exit)
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        start = self._clock()
        k = 0
        while True:
            self.sample_once()
            now = self._clock()
            k = max(k + 1, int((now - start) / self.interval_s) + 1)
            if self._stop.wait(max(0.0, start + k * self.interval_s - now)):
                return
