"""How many steps a batch size needs to reach a given loss: the model of McCandlish et al.
2018, "An Empirical Model of Large-Batch Training" (arXiv 1812.06162), section 2.2.

Training to a fixed loss at batch size B takes

    S = S_min (1 + B_crit / B)  optimizer steps, and  E = E_min (1 + B / B_crit)  samples,

with E_min = S_min B_crit: below the critical batch B_crit more samples per step save
steps almost one for one; above it, they mostly buy nothing. The paper's B_crit is
predicted by the gradient noise scale B_simple (train/measure/noise.py) up to a factor of a few.

S is linear in 1/B (S = S_min + S_min B_crit / B), so measured (B, S) pairs give both
constants by a least-squares line; `fit_steps` says when they do not. When every batch
measured is well below B_crit, steps fall as 1/B (the same samples at every batch) and the
line's intercept S_min is lost in the noise, at or below zero: `fit_samples` then fits the
model's limit S = E_min / B (S_min 0, B_crit unbounded by the measurements: above the
largest batch measured, by how much they cannot say).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepsModel:
    """S(B) = s_min (1 + b_crit / B), fitted to `points` (batch, steps) measurements."""

    s_min: float
    b_crit: float  # math.inf: every batch measured is below it (`fit_samples`)
    points: tuple[tuple[float, float], ...] = ()
    limit_e_min: float | None = None  # E_min where b_crit is inf (s_min is 0 there)

    def steps(self, batch: float) -> float:
        return self.s_min + self.e_min / batch

    def samples(self, batch: float) -> float:
        """E(B) = S(B) B = E_min (1 + B / b_crit)."""
        return self.steps(batch) * batch

    @property
    def e_min(self) -> float:
        if self.limit_e_min is not None:
            return self.limit_e_min
        return self.s_min * self.b_crit

    @property
    def unbounded(self) -> bool:
        """B_crit above every batch measured, by an amount they cannot say."""
        return math.isinf(self.b_crit)

    def worst_error(self) -> float:
        """The largest |predicted - measured| / measured steps over the fitted points."""
        return max((abs(self.steps(b) - s) / s for b, s in self.points), default=math.nan)


class NoFit(ValueError):
    """The measurements do not determine the model; the message says why.
    `below_critical`: steps fell with the batch, as fast as 1/B or faster (the intercept
    S_min at or below zero): `fit_samples` is the model's limit for them."""

    def __init__(self, message: str, below_critical: bool = False):
        super().__init__(message)
        self.below_critical = below_critical


def fit_steps(batches: Sequence[float], steps: Sequence[float]) -> StepsModel:
    """S_min and B_crit from steps to the same target at several batch sizes, by least
    squares of S against 1/B (each point weighted by 1/S², so that the fit minimises the
    relative error, as the steps differ by orders of magnitude across batches). Raises
    NoFit with fewer than 2 distinct batch sizes, or when the line's intercept or slope is
    not positive (steps that do not fall as the batch grows: no critical batch to speak
    of)."""
    points = [(float(b), float(s)) for b, s in zip(batches, steps, strict=True)]
    points = [(b, s) for b, s in points if b > 0 and s > 0 and math.isfinite(s)]
    if len({b for b, _ in points}) < 2:
        raise NoFit(f"steps at {len({b for b, _ in points})} batch size(s): 2 or more needed")
    xs = [1 / b for b, _ in points]
    ys = [s for _, s in points]
    ws = [1 / s**2 for s in ys]
    total = sum(ws)
    mean_x = sum(w * x for w, x in zip(ws, xs, strict=True)) / total
    mean_y = sum(w * y for w, y in zip(ws, ys, strict=True)) / total
    sxx = sum(w * (x - mean_x) ** 2 for w, x in zip(ws, xs, strict=True))
    sxy = sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(ws, xs, ys, strict=True))
    slope = sxy / sxx
    intercept = mean_y - slope * mean_x
    if intercept <= 0 or slope <= 0:
        raise NoFit(
            f"steps to the target do not fall as the batch grows like S_min (1 + B_crit/B) "
            f"(fitted S_min {intercept:.3g}, S_min B_crit {slope:.3g})",
            below_critical=slope > 0,
        )
    return StepsModel(s_min=intercept, b_crit=slope / intercept, points=tuple(points))


def fit_samples(batches: Sequence[float], steps: Sequence[float]) -> StepsModel:
    """The model's limit below B_crit, S = E_min / B: the same samples to the target at
    every batch, E_min fitted by least squares of S against 1/B through the origin (weighted
    by 1/S² as `fit_steps`). Its `worst_error` says how well the batches agree on it."""
    points = [(float(b), float(s)) for b, s in zip(batches, steps, strict=True)]
    points = [(b, s) for b, s in points if b > 0 and s > 0 and math.isfinite(s)]
    if not points:
        raise NoFit("no steps to fit")
    # minimise sum ((S - E/B) / S)^2: E = sum(1/(B S)) / sum(1/(B S)^2)
    e_min = sum(1 / (b * s) for b, s in points) / sum(1 / (b * s) ** 2 for b, s in points)
    return StepsModel(0.0, math.inf, tuple(points), limit_e_min=e_min)
