"""A trial's configuration: the config re-composed with its sampled values, its run spec, and
its predicted peak memory, before anything trains.

The trial re-composes the config from the command line's overrides plus its own, so group
choices and interpolations behave exactly as on the command line. With
search.accumulation=derived the effective batch is sampled and the micro-batch is the
largest divisor of it that is predicted to fit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hydra.errors import HydraException
from omegaconf import DictConfig

from batchfit.common.checks import ConfigError
from batchfit.search.core.study_config import SearchConfig
from batchfit.search.sampling.space import SearchSpace
from batchfit.train.config import RunSpec
from batchfit.train.device.sizes import format_bytes
from batchfit.train.memory.fitting import largest_fitting_batch
from batchfit.train.memory.predict import Prediction, PredictionUnsupported
from batchfit.train.params import ACCUM_KEY, BATCH_KEY
from batchfit.train.plan import plan
from batchfit.train.run import Planned
from batchfit.train.workload import Workloads


@dataclass(frozen=True)
class Configured:
    """A trial ready to train (its run planned and predicted: train/run.py `Planned`), or
    known not to fit before it trains."""

    planned: Planned
    fits: bool

    @property
    def cfg(self) -> DictConfig:
        return self.planned.cfg

    @property
    def spec(self) -> RunSpec:
        return self.planned.spec

    @property
    def prediction(self) -> Prediction | None:  # None: not predicted (or not asked)
        return self.planned.prediction

    def misfit_message(self, margin: float) -> str:
        """Why a trial that does not fit is pruned before it trains."""
        need = (
            f"its step is predicted to need {format_bytes(self.prediction.peak_bytes)}"
            if self.prediction is not None
            else "no micro-batch of it can train"
        )
        return (
            f"{need}, over the budget of {format_bytes(self.spec.limit_bytes)} less "
            f"search.preflight_margin={margin:g}"
        )


class Configurer:
    """Configures trials from their sampled values; says once when the model cannot be
    predicted (its trials then measure their memory as they train)."""

    def __init__(
        self,
        compose: Callable[[list[str]], DictConfig],
        space: SearchSpace,
        settings: SearchConfig,
        workloads: Workloads,
        notify: Callable[[str], None] = print,
    ):
        self.compose = compose
        self.space = space
        self.settings = settings
        self.workloads = workloads  # the study's: the fit report's predictors are the trials'
        self.notify = notify
        self._unsupported_said = False

    def __call__(self, params: dict[str, Any]) -> Configured:
        overrides = self.space.overrides(params)
        if self.settings.accumulation == "derived":
            return self._derive(overrides)
        cfg = self._compose(overrides)
        budget, preflight = self.settings.memory_budget, self.settings.preflight
        planned = Planned.planned(cfg, budget, self.workloads, predict=preflight)
        if planned.unsupported is not None:
            self.say_unsupported(planned.unsupported)
        return Configured(planned, planned.fits(self.settings.preflight_margin))

    def _compose(self, overrides: list[str]) -> DictConfig:
        try:
            return self.compose(overrides)
        except HydraException as error:
            raise ConfigError([f"trial overrides {overrides} do not compose: {error}"]) from None

    def say_unsupported(self, error: PredictionUnsupported) -> None:
        if not self._unsupported_said:
            self._unsupported_said = True
            self.notify(
                f"memory is not predicted for this model: {error.because()}; trials measure "
                f"their memory as they train"
            )

    def _derive(self, overrides: list[str]) -> Configured:
        # First as one micro-batch of the whole effective batch (a consistent config) ...
        effective = self._compose(overrides).trainer.effective_batch_size
        cfg = self._compose([*overrides, f"{BATCH_KEY}={effective}", f"{ACCUM_KEY}=1"])
        spec = plan(cfg, self.settings.memory_budget)
        try:
            workload = self.workloads.of(cfg)
            predictor = workload.predictor(spec, cfg.optimizer)
            num_train = workload.num_train
            found = largest_fitting_batch(
                predictor, spec.trainer, num_train, spec.limit_bytes, self.settings.preflight_margin
            )
        except PredictionUnsupported as error:
            self.say_unsupported(error)
            return Configured(Planned.of(cfg, spec, self.workloads, predict=False), True)
        if found is None:  # not even a micro-batch of 1 fits (or trains)
            try:
                prediction = predictor.predict(spec.trainer, num_train)
            except PredictionUnsupported:
                prediction = None
            planned = Planned.of(cfg, spec, self.workloads, prediction=prediction, predict=False)
            return Configured(planned, False)
        # ... then as the largest micro-batch that fits, accumulated to the effective batch.
        batch_size, prediction = found
        split = [f"{BATCH_KEY}={batch_size}", f"{ACCUM_KEY}={effective // batch_size}"]
        cfg = self._compose(overrides + split)
        spec = plan(cfg, self.settings.memory_budget)
        return Configured(Planned.of(cfg, spec, self.workloads, prediction=prediction), True)
