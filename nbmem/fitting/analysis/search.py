"""The search every fit answer comes from: the largest value for which a prediction says "fits".

Tries along the line the peaks so far draw, then doubling and bisection over whole values, with a few values
under the answer checked again, because what fits need not be monotone in the value (fragmentation): no value at
or under the answer is known to fail. A failure
there is a prediction's, which already keeps the margin below the room; a real run that failed caps the answer
with that margin too (``below_failure``), never at the failing value minus one.
"""

from __future__ import annotations

from collections.abc import Callable

#: Where the search stops when nothing stops it (memory that does not grow with the value).
SEARCH_CAP = 1 << 40


def largest_fitting(fits: Callable[[int], bool], start: int, cap: int = SEARCH_CAP,
                    peak: Callable[[int], float] | None = None, limit: float | None = None) -> int | None:
    """The largest value in [1, cap] for which ``fits`` holds, by doubling and bisection (None: not even 1).

    With ``peak`` (the modelled peak of a value that fits) and ``limit`` (what the peak must stay under), the
    values tried above ``start`` are where the line through the two largest that fit meets ``limit`` (``_Line``):
    a step's memory is close to linear in the value, so a few tries narrow what a dozen halvings over thousands
    would (each a replay of the whole program). A few values below the answer are
    checked as well; where one fails (fragmentation is not monotone in the value), the search goes on below the
    failure, from the largest value already seen to fit under it, so no value at or under the answer is known to
    fail. No value is tried twice.
    """
    seen: dict[int, bool] = {}

    def ok(v: int) -> bool:
        if v not in seen:
            seen[v] = fits(v)
        return seen[v]

    start = max(1, min(start, cap))
    lo, hi = 0, cap + 1
    v = start
    if ok(v):
        lo = v
        if peak is not None and limit is not None:
            lo, hi = _Line(ok, peak, limit, cap).search(lo)
        while lo < cap and hi > cap:
            v = min(cap, lo * 2)
            if not ok(v):
                hi = v
                break
            lo = v
    else:
        hi = v
        v //= 2
        while v >= 1 and not ok(v):
            hi = v
            v //= 2
        if v < 1:
            return None
        lo = v
    lo = _bisect(ok, lo, hi)
    for _ in range(8):
        below = sorted({lo - 1, int(lo * 0.99), int(lo * 0.97), int(lo * 0.95)})
        bad = [c for c in below if 0 < c < lo and not ok(c)]
        if not bad:
            return lo
        hi = bad[0]
        under = [w for w, fit in seen.items() if fit and w < hi]
        if under:
            lo = max(under)
        else:
            lo = hi - 1
            while lo >= 1 and not ok(lo):
                hi, lo = lo, lo // 2 if lo > 1 else 0
            if lo < 1:
                return None
        lo = _bisect(ok, lo, hi)
    return lo


class _Line:
    """Tries above a value that fits, each where the line through the two largest values seen to fit (with
    different peaks) reaches ``limit``, until one fails; the first from one value's peak in proportion (below the
    line's answer where memory has a fixed part), none past twice the largest that fit (where doubling would go).
    Where the line says the last value is at the limit and it still fits (reserved memory grows in steps, and a
    step's room is not used up), the tries go up by a stride that doubles. At the first failure, one try a little
    below it narrows what bisection is left with (where the line was right, to a fraction of a percent)."""

    def __init__(self, ok: Callable[[int], bool], peak: Callable[[int], float], limit: float, cap: int) -> None:
        self.ok, self.peak, self.limit, self.cap = ok, peak, limit, cap

    def search(self, lo: int) -> tuple[int, int]:
        """A value that fits and one above it that does not, for bisection (``cap + 1``: none failed, and the
        line tells nothing more: doubling goes on from the value that fits)."""
        fitted = [(lo, self.peak(lo))]
        stride = max(1, lo // 512)
        while lo < self.cap:
            guess = self._guess(fitted)
            if guess is None:
                break
            if guess <= lo:
                guess, stride = lo + stride, stride * 2
            guess = min(guess, 2 * lo, self.cap)  # never past where doubling would go: the line may be far off
            if not self.ok(guess):
                below = guess - max(1, guess // 256)
                return (below if below > lo and self.ok(below) else lo), guess
            lo = guess
            fitted.append((guess, self.peak(guess)))
        return lo, self.cap + 1

    def _guess(self, fitted: list[tuple[int, float]]) -> int | None:
        v2, p2 = fitted[-1]
        if len(fitted) == 1:
            return int(v2 * self.limit / p2) if p2 > 0 else None
        v1, p1 = next(((v, p) for v, p in reversed(fitted) if p < p2 and v < v2), (0, 0.0))
        if p2 <= p1 or v2 <= v1:
            return None
        return int(v2 + (self.limit - p2) * (v2 - v1) / (p2 - p1))


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
