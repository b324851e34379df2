"""Whether a predicted step fits a budget, with a margin to spare, and the largest micro-batch
of an effective batch that does (a bisection over its divisors with a MemoryPredictor of
train/memory/predict.py): the rule a search trial and a run's preflight apply
(train/memory/preflight.py), and the batches a fit report tables (search/fit/)."""

from __future__ import annotations

from dataclasses import replace

from batchfit.train.config import TrainerConfig
from batchfit.train.memory.predict import MemoryPredictor, Prediction, PredictionUnsupported


def fits_budget(peak_bytes: int, budget_bytes: int, margin: float) -> bool:
    """Whether a predicted peak fits the budget with `margin` (a share of the peak) to spare."""
    return peak_bytes * (1 + margin) <= budget_bytes


def largest_fitting_batch(
    predictor: MemoryPredictor,
    trainer: TrainerConfig,
    num_train: int,
    budget_bytes: int,
    margin: float,
) -> tuple[int, Prediction] | None:
    """For `trainer`'s effective batch E: the largest micro-batch b dividing E whose step is
    predicted to fit `budget_bytes` with `margin` to spare, and its prediction; None when even
    b = 1 does not fit. The whole batch (one micro-batch) is tried first: accumulating adds a
    second micro-batch over live gradients, so it can peak higher than b = E. Among proper
    divisors peak memory grows with b, so they are bisected."""
    effective = trainer.effective_batch_size
    # b = 1 last: that it cannot train (BatchNorm) says nothing of larger micro-batches.
    divisors = [b for b in range(2, effective) if effective % b == 0]

    def fits(b: int) -> Prediction | None:
        geometry = replace(trainer, batch_size=b, accum_steps=effective // b)  # same effective
        try:
            prediction = predictor.predict(geometry, num_train, budget_bytes)
        except PredictionUnsupported:
            if b == 1:  # e.g. BatchNorm over a 1x1 feature map: a single sample cannot train
                return None
            raise
        return prediction if fits_budget(prediction.peak_bytes, budget_bytes, margin) else None

    whole = fits(effective)
    if whole is not None:
        return effective, whole
    best = None
    low, high = 0, len(divisors) - 1
    while low <= high:
        mid = (low + high) // 2
        prediction = fits(divisors[mid])
        if prediction is not None:
            best, low = (divisors[mid], prediction), mid + 1
        else:
            high = mid - 1
    if best is None and effective > 1:
        one = fits(1)
        best = (1, one) if one is not None else None
    return best
