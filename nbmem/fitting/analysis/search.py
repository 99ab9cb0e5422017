"""The search every fit answer comes from: the largest value for which a prediction says "fits".

Doubling and bisection over whole values, with a few values under the answer checked again, because what fits
need not be monotone in the value (fragmentation): no value at or under the answer is known to fail. A failure
there is a prediction's, which already keeps the margin below the room; a real run that failed caps the answer
with that margin too (``below_failure``), never at the failing value minus one.
"""

from __future__ import annotations

from collections.abc import Callable

#: Where the search stops when nothing stops it (memory that does not grow with the value).
SEARCH_CAP = 1 << 40


def largest_fitting(fits: Callable[[int], bool], start: int, cap: int = SEARCH_CAP) -> int | None:
    """The largest value in [1, cap] for which ``fits`` holds, by doubling and bisection (None: not even 1).

    A few values below the answer are checked as well; where one fails (fragmentation is not monotone in the
    value), the search goes on below the failure, so no value at or under the answer is known to fail. No value
    is tried twice (each try is a replay of the whole program).
    """
    seen: dict[int, bool] = {}

    def once(v: int) -> bool:
        if v not in seen:
            seen[v] = fits(v)
        return seen[v]

    return _largest(once, start, cap)


def _largest(fits: Callable[[int], bool], start: int, cap: int) -> int | None:
    start = max(1, min(start, cap))
    lo, hi = 0, cap + 1
    v = start
    if fits(v):
        lo = v
        while lo < cap:
            v = min(cap, lo * 2)
            if not fits(v):
                hi = v
                break
            lo = v
    else:
        hi = v
        v //= 2
        while v >= 1 and not fits(v):
            hi = v
            v //= 2
        if v < 1:
            return None
        lo = v
    lo = _bisect(fits, lo, hi)
    for _ in range(8):
        below = sorted({lo - 1, int(lo * 0.99), int(lo * 0.97), int(lo * 0.95)})
        bad = [c for c in below if 0 < c < lo and not fits(c)]
        if not bad:
            return lo
        hi = bad[0]
        lo = hi - 1
        while lo >= 1 and not fits(lo):
            hi, lo = lo, lo // 2 if lo > 1 else 0
        if lo < 1:
            return None
        lo = _bisect(fits, lo, hi)
    return lo


def below_failure(peak: Callable[[int], float], failed: int, margin_bytes: float) -> int | None:
    """The largest value under ``failed`` whose modelled ``peak`` is ``margin_bytes`` below the failed value's.

    A run that failed at ``failed`` says the room is no larger than what that value asks for; the answer keeps
    the margin a prediction keeps below the room, below that (None: no value does).
    """
    if failed <= 1:
        return None
    limit = peak(failed) - margin_bytes
    return largest_fitting(lambda v: peak(v) <= limit, max(1, failed // 2), failed - 1)


def _bisect(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest value in [lo, hi) that fits, given that lo fits and hi does not."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def halfway_within(top: int, prediction: int, took_s: float, budget_s: float) -> int:
    """The value halfway from ``top`` (the largest run, ``took_s`` seconds) to ``prediction``, or less where a run
    there would take longer than ``budget_s`` (its time scaled from ``top``'s): where a fit checks its growth next."""
    value = (top + prediction) // 2
    return value if took_s * value / top <= budget_s else int(top * budget_s / max(took_s, 1e-6))
