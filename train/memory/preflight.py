"""The memory check before a run trains: its predicted peak x (1 + search.preflight_margin)
against the budget, the rule a search trial applies (search/configure.py; such a trial is
pruned as oom_predicted), and for a run that fails it, the configurations that pass.

`python -m train` refuses such a run before anything trains, with these numbers and
configurations in the message, unless `search.preflight=false` forces it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tracking.config import ConfigError, flag_problems, number_problems
from train.config import TrainerConfig
from train.memory.budget import format_bytes
from train.memory.fitting import fits_budget, largest_fitting_batch
from train.memory.predict import MemoryPredictor, Prediction, PredictionUnsupported


@dataclass(frozen=True)
class PreflightConfig:
    """search.preflight and search.preflight_margin (conf/search/default.yaml)."""

    preflight: bool = True  # false: train without the check (a real OOM may still end it)
    preflight_margin: float = 0.05  # a share of the predicted peak kept free

    def __post_init__(self) -> None:
        problems = flag_problems("search.preflight", self.preflight)
        problems += number_problems(
            "search.preflight_margin", self.preflight_margin, "a number in [0, 1)",
            at_least=0, below=1, fix=0.05,
        )  # fmt: skip
        if problems:
            raise ConfigError(problems)


@dataclass(frozen=True)
class Geometry:
    """A batch geometry predicted to fit, as the overrides that select it."""

    batch_size: int
    accum_steps: int
    peak_bytes: int

    def overrides(self) -> str:
        return f"trainer.batch_size={self.batch_size} trainer.accum_steps={self.accum_steps}"


@dataclass(frozen=True)
class Misfit:
    """A run predicted not to fit its budget, and what fits instead at its precision."""

    trainer: TrainerConfig
    peak_bytes: int
    budget_bytes: int
    margin: float
    options: tuple[tuple[Geometry, str], ...]  # (what fits, how it differs), best first

    def describe(self) -> str:
        """The check's numbers: prediction, margin, budget."""
        t = self.trainer
        needed = self.peak_bytes * (1 + self.margin)
        return (
            f"trainer.batch_size={t.batch_size} x trainer.accum_steps={t.accum_steps} in "
            f"{t.precision} is predicted to peak at {format_bytes(self.peak_bytes)}; with "
            f"search.preflight_margin={self.margin:g} that is {format_bytes(needed)}, over "
            f"search.memory_budget={format_bytes(self.budget_bytes)}"
        )

    def message(self) -> str:
        """The refusal: the numbers, what fits instead, and how to train it anyway."""
        t = self.trainer
        fixes = [
            f"{g.overrides()} ({why}, predicted {format_bytes(g.peak_bytes)})"
            for g, why in self.options
        ]
        fit = f" What fits in {t.precision}: {'; or '.join(fixes)}." if fixes else ""
        if not any(g.accum_steps == t.accum_steps for g, _ in self.options):
            fit += f" At trainer.accum_steps={t.accum_steps} not even a batch of 2 fits."
        return (
            f"{self.describe()}, so it would run out of memory: nothing was trained.{fit} Or "
            "raise search.memory_budget, or lower search.preflight_margin; to train it anyway "
            "(a real OOM may end it), add search.preflight=false"
        )


def misfit(
    predictor: MemoryPredictor,
    trainer: TrainerConfig,
    num_train: int,
    prediction: Prediction,
    budget_bytes: int | None,
    margin: float,
) -> Misfit | None:
    """None when the run is predicted to fit (or has no budget); else what fits instead: its
    effective batch with more accumulation, the largest batch at its accumulation, and the
    largest without accumulation (up to its effective batch)."""
    if budget_bytes is None or fits_budget(prediction.peak_bytes, budget_bytes, margin):
        return None
    effective = trainer.effective_batch_size
    found: list[tuple[Geometry | None, str]] = []
    try:
        whole = largest_fitting_batch(predictor, trainer, num_train, budget_bytes, margin)
    except PredictionUnsupported:
        whole = None
    if whole is not None:
        geometry = Geometry(whole[0], effective // whole[0], whole[1].peak_bytes)
        found.append((geometry, f"the same effective batch {effective}"))

    def largest(accum_steps: int, at_most: int) -> Geometry | None:
        return _largest_batch(
            predictor, trainer, num_train, budget_bytes, margin, accum_steps, at_most
        )

    unaccumulated = "the largest batch without accumulation"
    if trainer.accum_steps > 1:
        at_accum = f"the largest batch at {trainer.accum_steps} micro-batches a step"
        found.append((largest(trainer.accum_steps, trainer.batch_size - 1), at_accum))
        found.append((largest(1, effective), unaccumulated))
    else:
        found.append((largest(1, trainer.batch_size - 1), unaccumulated))
    options: list[tuple[Geometry, str]] = []
    for geometry, why in found:
        if geometry is not None and all(geometry != g for g, _ in options):
            options.append((geometry, why))
    return Misfit(trainer, prediction.peak_bytes, budget_bytes, margin, tuple(options))


def _largest_batch(
    predictor: MemoryPredictor,
    trainer: TrainerConfig,
    num_train: int,
    budget_bytes: int,
    margin: float,
    accum_steps: int,
    at_most: int,
) -> Geometry | None:
    """The largest batch size up to `at_most` that fits at `accum_steps`, bisected (peak
    memory grows with the batch); None when not even 2 does (1 is not tried: BatchNorm
    cannot train on a single sample, nor is it advice)."""
    found = None
    low, high = 2, at_most
    while low <= high:
        mid = (low + high) // 2
        geometry = dataclasses.replace(
            trainer, batch_size=mid, accum_steps=accum_steps, effective_batch_size=None
        )
        try:
            peak = predictor.predict(geometry, num_train).peak_bytes
        except PredictionUnsupported:
            return found
        if fits_budget(peak, budget_bytes, margin):
            found, low = Geometry(mid, accum_steps, peak), mid + 1
        else:
            high = mid - 1
    return found
