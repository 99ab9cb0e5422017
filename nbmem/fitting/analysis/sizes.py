"""The size of one allocation as a function of the value, from the sizes the fit's runs showed at a few values:
a model that errs on the large side beyond them. Pure arithmetic (``model`` lines the runs up and calls it)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

#: Slack for growth that is neither fixed nor in proportion (a padded or rounded size).
GROWTH_SLACK_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class SizeModel:
    """Bytes of one aligned allocation at a value: fixed + per-unit × v + per-unit² × v² (+ per-unit^p × v^p)."""

    fixed_bytes: float
    per_unit_bytes: float
    per_unit_sq_bytes: float
    kind: str  # "fixed", "linear", "quadratic", "power", "steepest", "steepest near", "largest seen", "proportional",
    # "unmatched"
    per_unit_pow_bytes: float = 0.0  # growth faster than quadratic, as value ** power
    power: float = 0.0

    def at(self, value: float) -> int:
        v = float(value)
        grown = self.per_unit_pow_bytes * v**self.power if self.per_unit_pow_bytes else 0.0
        return max(0, math.ceil(self.fixed_bytes + self.per_unit_bytes * v + self.per_unit_sq_bytes * v * v + grown))


#: A slope that grows by more than this between consecutive values, every time, is growth faster than linear.
QUADRATIC_SLOPE_GAIN = 0.01
#: Local exponents (log size ratio over log value ratio) this close are one power law, not a step.
POWER_AGREEMENT = 0.25
#: The last three values' steady growth is the growth beyond them only where they span this factor or more:
#: the fit's runs stop once the answer is less than 1.5× beyond the largest (nearby.REFINE_FACTOR), so the
#: stretch measured is as long as the one predicted; and the runner's runs near the answer, each at least
#: 1.25× the last, always span it (2× missed a CNN's 286, 447, 571 on the H100: 1.997×).
NEAR_SPAN = 1.5


def fit_size(points: Iterable[tuple[int, int]]) -> SizeModel:
    """A size model through (value, bytes) points that errs on the large side beyond the largest value.

    One point: proportional to the value (an upper bound for any growth with a non-negative fixed part).
    Equal sizes: fixed. Sizes that shrink somewhere: the largest seen, fixed. Slopes that grow at every
    step (three or more values): the quadratic through the last three where its terms are all non-negative
    (attention scores in the sequence length); growth faster than that at one steady rate (the same local
    exponent twice: a volume in its side length) a power law; otherwise (a library buffer that jumped from
    one size to another) a line. Lines go through the largest value's point with the steepest slope seen,
    exact for linear sizes and above concave ones; with four values or more, the slope of the last three (the
    runs made nearer the answer) where it is steady over them, less steep, and they span ``NEAR_SPAN``× or more.
    """
    by_value: dict[int, int] = {}
    for v, s in points:
        by_value[v] = max(s, by_value.get(v, 0))
    pts = sorted(by_value.items())
    vn, sn = pts[-1]
    if len(pts) == 1:
        return SizeModel(0.0, sn / vn, 0.0, "proportional") if vn > 0 else SizeModel(sn, 0.0, 0.0, "fixed")
    sizes = [s for _, s in pts]
    if min(sizes) == max(sizes):
        return SizeModel(float(sn), 0.0, 0.0, "fixed")
    if any(b < a for a, b in itertools.pairwise(sizes)):
        return SizeModel(float(max(sizes)), 0.0, 0.0, "largest seen")
    slopes = [(s2 - s1) / (v2 - v1) for (v1, s1), (v2, s2) in itertools.pairwise(pts)]
    if len(slopes) >= 2 and all(d2 - d1 > max(1.0, QUADRATIC_SLOPE_GAIN * d2) for d1, d2 in itertools.pairwise(slopes)):
        (v1, s1), (v2, s2), (v3, s3) = pts[-3:]
        d12, d23 = slopes[-2], slopes[-1]
        c = (d23 - d12) / (v3 - v1)
        b = d23 - c * (v2 + v3)
        a = s3 - b * v3 - c * v3 * v3
        if b >= -1e-6 * d23 and a >= -GROWTH_SLACK_BYTES:
            return SizeModel(a, b, c, "quadratic")
        if s1 > 0 and v1 > 0:
            p12, p23 = math.log(s2 / s1) / math.log(v2 / v1), math.log(s3 / s2) / math.log(v3 / v2)
            if abs(p23 - p12) <= POWER_AGREEMENT * p23:
                p = max(p12, p23)
                return SizeModel(0.0, 0.0, 0.0, "power", s3 / v3**p, p)
    b = max(slopes)
    if b - min(slopes) <= max(1.0, 0.01 * b):
        return SizeModel(sn - b * vn, b, 0.0, "linear")
    # A jump between the smallest values (another algorithm there) is not the growth near the answer, where the
    # fit's later runs looked (a CNN's 1 MiB per sample at 8 and 16, 2 from 32 to 587: the jump's 3 MiB per sample
    # put it 16 % below its real boundary). Replayed over 48 recorded rows, none went above.
    # Only steady growth there: the two slopes within 1 % (not a plateau of bucketed sizes, nor a switch between
    # them), over a stretch where the largest value is 1.5× the smallest or more.
    if len(pts) >= 4:
        d1, d2 = slopes[-2:]
        b_near = max(d1, d2)
        steady = 0 < b_near < b and b_near - min(d1, d2) <= 0.01 * b_near
        if steady and vn >= NEAR_SPAN * pts[-3][0]:
            return SizeModel(sn - b_near * vn, b_near, 0.0, "steepest near")
    return SizeModel(sn - b * vn, b, 0.0, "steepest")


__all__ = ["GROWTH_SLACK_BYTES", "SizeModel", "fit_size"]
