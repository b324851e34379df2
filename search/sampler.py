"""Keep the study's sampler from proposing what is already known not to fit.

Every OOM trial, real or predicted, is recorded with the Optuna constraint `memory` > 0
(search/objective.py). Optuna's samplers use that only weakly: TPE ranks infeasible trials
after all others, where a pruned trial without intermediate values already sits (so its
proposals do not change), and GPSampler and NSGA-II read only COMPLETE trials. Peak memory,
though, only grows with the batch: a configuration is sure not to fit if an infeasible trial
had the same precision and other memory-relevant values with a batch size no larger and an
accumulation pattern no lighter. `FeasibilityFilter` wraps any sampler and redraws such
proposals, so the OOM boundary found by one trial holds for later ones. It acts on joint
(relative) proposals: not during the base sampler's independent start-up trials, nor for
samplers that only sample independently (RandomSampler, TPE without multivariate).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, FloatDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

from train.run import ACCUM_KEY, BATCH_KEY

CONSTRAINT = "memory"
# Memory grows with the micro-batch. Not with trainer.effective_batch_size (derived
# accumulation): a larger one may train a smaller micro-batch, so it is compared for equality.
BATCH_KEYS = (BATCH_KEY,)
# ACCUM_KEY (train/run.py) counts as 1 micro-batch, or 2 or more: the same peak from 2 on.


def is_infeasible(trial: FrozenTrial) -> bool:
    return trial.constraints.get(CONSTRAINT, 0.0) > 0


def dominated(params: Mapping[str, Any], oom: Mapping[str, Any], floats: set[str]) -> bool:
    """True when `params` needs at least the memory of the infeasible `oom`. Float-valued
    keys (learning rates, weight decay) are taken not to change the memory."""
    for key, value in oom.items():
        if key not in params or key in floats:
            continue
        if key in BATCH_KEYS:
            if params[key] < value:
                return False
        elif key == ACCUM_KEY:
            if value > 1 and params[key] == 1:
                return False
        elif params[key] != value:
            return False
    return True


class FeasibilityFilter(BaseSampler):
    """Delegates to `base`; a joint proposal dominated by an infeasible trial is redrawn, up
    to `max_redraws` times (then the last is kept: the search must go on)."""

    def __init__(self, base: BaseSampler, max_redraws: int = 30):
        self.base = base
        self.max_redraws = max_redraws
        self.num_redrawn = 0  # proposals replaced, for benchmarks and tests

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return self.base.infer_relative_search_space(study, trial)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        params = self.base.sample_relative(study, trial, search_space)
        if not params:  # the base sampler's start-up phase: independent sampling
            return params
        infeasible = [
            t.params
            for t in study.get_trials(
                deepcopy=False, states=(TrialState.PRUNED, TrialState.COMPLETE)
            )
            if is_infeasible(t)
        ]
        floats = {k for k, d in search_space.items() if isinstance(d, FloatDistribution)}
        for _ in range(self.max_redraws):
            if not any(dominated(params, oom, floats) for oom in infeasible):
                break
            self.num_redrawn += 1
            params = self.base.sample_relative(study, trial, search_space)
        return params

    def sample_independent(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        return self.base.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.base.before_trial(study, trial)

    def after_trial(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        self.base.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.base.reseed_rng()
