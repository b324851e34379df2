"""The gradient noise scale of a run, measured from the gradients its steps compute anyway.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training" (arXiv 1812.06162):
the simple noise scale B_simple = tr(Σ) / |G|² is the batch size at which the gradient's
noise equals its signal; a batch well below it wastes steps, one well above it wastes
samples. Their Appendix A.1 estimates both parts without per-example gradients, from the
squared norms of gradients over two batch sizes B_small < B_big:

    |G|²  ≈ (B_big |g_big|² − B_small |g_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|g_small|² − |g_big|²) / (1/B_small − 1/B_big)

each an unbiased estimate from one step. The paper smooths both over many steps before
taking their ratio (one step's ratio is not a measurement: both norms are noisy, and |G|²
is a small difference of them). Here a run's figure is the ratio of the two parts' means
over all its measured steps, with Fieller's 95% interval for a ratio of means (Fieller
1954, "Some problems in interval estimation", JRSS B 16:175-185) from their spread and
covariance across steps, and the steps it rests on. The steps' samples are independent
(within an epoch, disjoint), so the spread is the sampling noise; the parameters drifting
along the run add to it and widen the interval. A ratio of means weighs each step by its
|G|²: the figure leans to the early steps, where the signal is strongest. Where the mean
|G|² is not resolved above zero at that confidence, the interval has no upper end: the run
logs the parts and its steps, no B_simple, and its tag says why; with under MIN_STEPS
measured steps, likewise.

Where the two gradients come from (`estimator`):
- accumulation: the step's first micro-batch (B_small) and the whole step (B_big);
- data-parallel ranks: with DDP, each rank's first micro-batch before the all-reduce and
  the all-reduced step; with FSDP2, which reduce-scatters every micro-batch, the first
  micro-batch over all ranks and the whole step;
- split: a step of one micro-batch on one device has one gradient. For `window` steps
  after the memory-measured and warm-up steps, that micro-batch runs as two halves
  (accumulated, so the step's gradient is the same): B_small is the half. These steps stay
  off the throughput clock, and never use more memory than a whole micro-batch.

The norms are over the parameters that train: for LoRA, the adapters' noise scale. Sums
of squares stay on the device; the host reads the steps' estimates once per logging
interval and keeps their running moments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from batchfit.tracking.metrics import (
    GRAD_NOISE_SCALE,
    GRAD_NOISE_SCALE_HIGH,
    GRAD_NOISE_SCALE_LOW,
    GRAD_NOISE_STEPS,
    GRAD_SQ_NORM,
    GRAD_VARIANCE,
)

if TYPE_CHECKING:
    from batchfit.train.parallel.ranks import Ranks

NOISE_TAG = "batchfit.noise_scale"  # a run's tag: which estimator measured it, or why none did
WINDOW = 8  # default steps of the split estimator (trainer.noise_scale_window)
MIN_STEPS = 3  # measured steps for a spread across them with 2 degrees of freedom, at least
# Student's t at 97.5% for 1 and 2 degrees of freedom; from 3 on, Abramowitz & Stegun 26.7.5
T_975 = {1: 12.7062, 2: 4.3027}
Z_975 = 1.959963984540054


def t_975(df: int) -> float:
    """Student's t quantile at 0.975 (a two-sided 95% interval) for `df` degrees of freedom:
    A&S 26.7.5's expansion in 1/df, within 0.13% of the exact from df 3 on."""
    if df in T_975:
        return T_975[df]
    z = Z_975
    g = (
        (z**3 + z) / 4,
        (5 * z**5 + 16 * z**3 + 3 * z) / 96,
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
        (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160,
    )
    return z + sum(gi / df ** (i + 1) for i, gi in enumerate(g))


@dataclass(frozen=True)
class NoiseReading:
    """The two parts' means over the steps measured so far, and their spread across steps."""

    grad_sq_norm: float  # |G|², the true gradient's squared norm: the steps' mean estimate
    grad_variance: float  # tr(Σ), the per-sample gradient covariance's trace: likewise
    steps: int  # measured steps they average
    # the per-step estimates' sample variances and covariance across the steps (n - 1)
    sq_norm_var: float = math.nan
    variance_var: float = math.nan
    covariance: float = math.nan

    @property
    def noise_scale(self) -> float:
        """B_simple in samples; NaN when |G|² is not positive (noise swamps the signal)."""
        if not self.grad_sq_norm > 0 or not math.isfinite(self.grad_variance):
            return math.nan
        return self.grad_variance / self.grad_sq_norm

    def interval(self) -> tuple[float, float] | None:
        """Fieller's 95% interval for tr(Σ) / |G|² (the means' ratio), its lower end at 0 at
        least; None with under MIN_STEPS steps, or where the mean |G|² is not resolved above
        zero (the interval is then unbounded)."""
        n = self.steps
        if n < MIN_STEPS or not math.isfinite(self.sq_norm_var):
            return None
        a, b, t2 = self.grad_variance, self.grad_sq_norm, t_975(n - 1) ** 2
        v_aa, v_bb, v_ab = self.variance_var / n, self.sq_norm_var / n, self.covariance / n
        # The ratios r with (a - r b)² <= t² var(a - r b): a quadratic in r, bounded when
        # b² > t² var(b), that is b's t statistic above t.
        quad = b * b - t2 * v_bb
        if not b > 0 or not quad > 0:
            return None
        mid = a * b - t2 * v_ab
        root = math.sqrt(max(mid * mid - quad * (a * a - t2 * v_aa), 0.0))
        return max((mid - root) / quad, 0.0), (mid + root) / quad

    def why_not(self) -> str:
        """Why there is no B_simple to log ('' where there is one)."""
        if self.steps < MIN_STEPS:
            return f"{self.steps} measured step(s), {MIN_STEPS} needed"
        if self.interval() is None:
            se = math.sqrt(max(self.sq_norm_var, 0.0) / self.steps)
            return (
                f"|G|² not resolved above zero over {self.steps} steps (mean "
                f"{self.grad_sq_norm:.3g} ± {t_975(self.steps - 1) * se:.3g} at 95%)"
            )
        if not self.noise_scale > 0:
            return f"tr(Σ) not above zero over {self.steps} steps (mean {self.grad_variance:.3g})"
        return ""

    def metrics(self) -> dict[str, float]:
        """The parts and the steps always; B_simple and its interval where measured."""
        values = {
            GRAD_SQ_NORM: self.grad_sq_norm,
            GRAD_VARIANCE: self.grad_variance,
            GRAD_NOISE_STEPS: float(self.steps),
        }
        interval = self.interval()
        if interval is not None and not self.why_not():
            values[GRAD_NOISE_SCALE] = self.noise_scale
            values[GRAD_NOISE_SCALE_LOW], values[GRAD_NOISE_SCALE_HIGH] = interval
        return {k: v for k, v in values.items() if math.isfinite(v)}

    def logged(self) -> dict[str, float]:
        """metrics() as a logging interval writes them: B_simple and its interval NaN where
        this reading has none, so that a run whose figure was resolved at an earlier interval
        and no longer is does not keep the earlier one as its latest value in MLflow."""
        unmeasured = dict.fromkeys(
            (GRAD_NOISE_SCALE, GRAD_NOISE_SCALE_LOW, GRAD_NOISE_SCALE_HIGH), math.nan
        )
        return {**unmeasured, **self.metrics()}


@dataclass
class _Moments:
    """Running means, and sums of squared deviations, of the steps' (|G|², tr(Σ)) estimates
    (Welford's update: no cancellation of large sums)."""

    n: int = 0
    mean_sq: float = 0.0
    mean_var: float = 0.0
    m2_sq: float = 0.0
    m2_var: float = 0.0
    m2_cross: float = 0.0

    def add(self, sq: float, var: float) -> None:
        self.n += 1
        d_sq, d_var = sq - self.mean_sq, var - self.mean_var
        self.mean_sq += d_sq / self.n
        self.mean_var += d_var / self.n
        self.m2_sq += d_sq * (sq - self.mean_sq)
        self.m2_var += d_var * (var - self.mean_var)
        self.m2_cross += d_sq * (var - self.mean_var)

    def reading(self) -> NoiseReading | None:
        if not self.n:
            return None
        dof = self.n - 1
        spread = (self.m2_sq / dof, self.m2_var / dof, self.m2_cross / dof) if dof else ()
        return NoiseReading(self.mean_sq, self.mean_var, self.n, *spread)


class NoiseScale:
    """B_simple's two parts, estimated on the device at each measured step.

    Per measured step the loop calls `begin` (the step's batch sizes), then the optimizer
    step calls `first_micro_batch` after its first backward and `step_end` before the
    optimizer updates (and before any clipping). `read` (one host sync) takes the steps'
    estimates since the last read into the running moments and gives the reading.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        estimator: str,
        world: int = 1,
        sharded: bool = False,
        adapters: bool = False,
    ):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = device
        self.estimator = estimator
        self.world, self.sharded, self.adapters = world, sharded, adapters
        # each measured step's (|G|², tr(Σ)) estimates on the device, until the next read
        self._pending: list[torch.Tensor] = []
        self._moments = _Moments()
        self._small: torch.Tensor | None = None
        self._sizes: tuple[int, int, float] | None = None  # (B_small, B_big, grad factor)
        self._scaler: torch.amp.GradScaler | None = None

    def describe(self) -> str:
        """Which estimator, over which gradients: what the run records."""
        where = {
            "accumulation": "first micro-batch against the accumulated step",
            "ranks": "first micro-batch against the all-reduced step",
            "split": "a micro-batch's first half against the whole, in a window of steps",
        }[self.estimator]
        over = "LoRA adapters" if self.adapters else "trainable parameters"
        return f"{self.estimator}: {where}; over the {over}"

    def note(self, reading: NoiseReading | None) -> str:
        """describe(), and after the run the steps its B_simple rests on, or why it has none:
        the run's tag."""
        why = reading.why_not() if reading else "no step measured"
        outcome = f"no B_simple: {why}" if why else f"over {reading.steps} steps"
        return f"{self.describe()}; {outcome}"

    def begin(
        self, small: int, big: int, grad_factor: float, scaler: torch.amp.GradScaler | None = None
    ) -> None:
        """This step measures: B_small and B_big in samples; the first micro-batch's gradient
        times `grad_factor` is its mean gradient (the loss is divided by the whole step's
        units); `scaler`, fp16's, scales the gradients by its loss scale."""
        self._sizes = (small, big, grad_factor)
        self._scaler = scaler if scaler is not None and scaler.is_enabled() else None

    def _sq_norm(self) -> torch.Tensor:
        """Σ |grad|² over this rank's gradients (its shards under FSDP), in float64: one
        fused norm per gradient (float32, also for bf16 gradients), as clip_grad_norm_
        computes them."""
        grads = [p.grad for p in self.params if p.grad is not None]
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        total = torch.stack(norms).double().square().sum()
        if self._scaler is not None:  # the scale as a device tensor: no host sync
            total /= self._scaler._get_scale_async().double().square()
        return total

    def first_micro_batch(self) -> None:
        if self._sizes is not None:
            self._small = self._sq_norm() * self._sizes[2] ** 2

    def step_end(self) -> None:
        """The step's unbiased estimates of |G|² and tr(Σ), kept on the device (an fp16
        overflow's, not finite, is left out when read)."""
        if self._sizes is None or self._small is None:
            self._sizes = self._small = None
            return
        small_b, big_b, _ = self._sizes
        big = self._sq_norm()
        small = self._small
        self._sizes = self._small = None
        grad_sq = (big_b * big - small_b * small) / (big_b - small_b)
        variance = (small - big) / (1 / small_b - 1 / big_b)
        self._pending.append(torch.stack([grad_sq, variance]))

    def read(self, ranks: Ranks | None = None) -> NoiseReading | None:
        """The reading over every step measured so far (one host sync); None before any. On
        several ranks a collective: every rank calls it, with as many steps pending."""
        pending = torch.stack(self._pending).tolist() if self._pending else []
        self._pending.clear()
        if ranks is not None and pending:
            # FSDP: each rank's norms are over its shards, so a step's estimates add; DDP:
            # every rank estimates from its own first micro-batch, so they are averaged.
            summed = ranks.sum([v for step in pending for v in step])
            w = 1 if self.sharded else self.world
            pending = [[summed[i] / w, summed[i + 1] / w] for i in range(0, len(summed), 2)]
        for grad_sq, variance in pending:
            if math.isfinite(grad_sq) and math.isfinite(variance):
                self._moments.add(grad_sq, variance)
        return self._moments.reading()
