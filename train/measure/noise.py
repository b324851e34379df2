"""The gradient noise scale of a run, measured from the gradients its steps compute anyway.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training" (arXiv 1812.06162):
the simple noise scale B_simple = tr(Σ) / |G|² is the batch size at which the gradient's
noise equals its signal; a batch well below it wastes steps, one well above it wastes
samples. Their Appendix A.1 estimates both parts without per-example gradients, from the
squared norms of gradients over two batch sizes B_small < B_big:

    |G|²  ≈ (B_big |g_big|² − B_small |g_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|g_small|² − |g_big|²) / (1/B_small − 1/B_big)

each smoothed over steps (an exponential moving average, bias-corrected) before the ratio.

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
of squares stay on the device; the host reads them once per logging interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tracking.metrics import GRAD_NOISE_SCALE, GRAD_SQ_NORM, GRAD_VARIANCE

if TYPE_CHECKING:
    from train.parallel.ranks import Ranks

NOISE_TAG = "batchfit.noise_scale"  # a run's tag: which estimator measured it, or why none did
DECAY = 0.9  # the moving averages' decay per measured step
WINDOW = 8  # default steps of the split estimator (trainer.noise_scale_window)


@dataclass(frozen=True)
class NoiseReading:
    """The smoothed estimates after the steps measured so far."""

    grad_sq_norm: float  # |G|², the true gradient's squared norm
    grad_variance: float  # tr(Σ), the per-sample gradient covariance's trace
    steps: int  # measured steps they smooth

    @property
    def noise_scale(self) -> float:
        """B_simple in samples; NaN when |G|² is not positive (noise swamps the signal)."""
        if not self.grad_sq_norm > 0 or not math.isfinite(self.grad_variance):
            return math.nan
        return self.grad_variance / self.grad_sq_norm

    def metrics(self) -> dict[str, float]:
        values = {
            GRAD_NOISE_SCALE: self.noise_scale,
            GRAD_SQ_NORM: self.grad_sq_norm,
            GRAD_VARIANCE: self.grad_variance,
        }
        return {k: v for k, v in values.items() if math.isfinite(v)}


class NoiseScale:
    """B_simple's two parts, smoothed on the device over the steps measured.

    Per measured step the loop calls `begin` (the step's batch sizes), then the optimizer
    step calls `first_micro_batch` after its first backward and `step_end` before the
    optimizer updates (and before any clipping). `read` (one host sync) gives the estimate.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        estimator: str,
        world: int = 1,
        sharded: bool = False,
        adapters: bool = False,
        decay: float = DECAY,
    ):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.estimator = estimator
        self.world, self.sharded, self.adapters = world, sharded, adapters
        self.decay = decay
        zeros = torch.zeros(4, dtype=torch.float64, device=device)
        # [ema |G|², ema tr(Σ), weight of the averages (for the bias correction), steps]
        self._state = zeros
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
            return torch.zeros((), dtype=torch.float64, device=self._state.device)
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        total = torch.stack(norms).double().square().sum()
        if self._scaler is not None:  # the scale as a device tensor: no host sync
            total /= self._scaler._get_scale_async().double().square()
        return total

    def first_micro_batch(self) -> None:
        if self._sizes is not None:
            self._small = self._sq_norm() * self._sizes[2] ** 2

    def step_end(self) -> None:
        if self._sizes is None or self._small is None:
            self._sizes = self._small = None
            return
        small_b, big_b, _ = self._sizes
        big = self._sq_norm()
        small = self._small
        self._sizes = self._small = None
        grad_sq = (big_b * big - small_b * small) / (big_b - small_b)
        variance = (small - big) / (1 / small_b - 1 / big_b)
        ok = torch.isfinite(grad_sq) & torch.isfinite(variance)  # fp16 overflow: skipped
        d = self.decay
        state = self._state
        update = torch.stack([grad_sq, variance, torch.ones_like(grad_sq)])
        smoothed = torch.cat([d * state[:3] + (1 - d) * update, state[3:] + 1])
        state.copy_(torch.where(ok, smoothed, state))

    def read(self, ranks: Ranks | None = None) -> NoiseReading | None:
        """The smoothed estimate (host sync); None before any measured step. On several
        ranks a collective: every rank calls it."""
        values = self._state.tolist()
        if ranks is not None:
            # FSDP: each rank's sums are over its shards, so they add; DDP: every rank holds
            # whole gradients, so the estimate is their mean. The weight and the step count
            # are the same on every rank.
            summed, w = ranks.sum(values), self.world
            parts = summed[:2] if self.sharded else [v / w for v in summed[:2]]
            values = [*parts, summed[2] / w, summed[3] / w]
        ema_sq, ema_var, weight, steps = values
        if not weight > 0:
            return None
        return NoiseReading(ema_sq / weight, ema_var / weight, round(steps))
