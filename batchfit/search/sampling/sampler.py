"""Keep the study's sampler from proposing what is already known not to fit.

Every OOM trial, real or predicted, is recorded with the Optuna constraint `memory` > 0
(search/trial/ending.py). Optuna's samplers use that only weakly: TPE ranks infeasible trials
after all others, where a pruned trial without intermediate values already sits (so its
proposals do not change), and GPSampler and NSGA-II read only COMPLETE trials. Peak memory,
though, only grows with the batch: a configuration is sure not to fit if an infeasible trial
had the same precision and other memory-relevant values with a batch size no larger and an
accumulation pattern no lighter. `FeasibilityFilter` wraps any sampler and redraws such
proposals, so the OOM boundary found by one trial holds for later ones; a proposal of a
configuration already settled is redrawn too (a repeat teaches nothing: search/core/trial_count.py).
It acts on joint (relative) proposals: not during the base sampler's independent start-up
trials, nor for samplers that only sample independently (RandomSampler, TPE without
multivariate).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import optuna
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.samplers import BaseSampler, GridSampler, TPESampler
from optuna.trial import FrozenTrial, TrialState

from batchfit.common.checks import ConfigError
from batchfit.search.core.trial_count import configuration, settled, study_records
from batchfit.search.sampling.space import SearchSpace
from batchfit.train.params import ACCUM_KEY, BATCH_KEY

# Memory grows with the micro-batch. Not with trainer.effective_batch_size (derived
# accumulation): a larger one may train a smaller micro-batch, so it is compared for equality.
BATCH_KEYS = (BATCH_KEY,)
# ACCUM_KEY (train/params.py) counts as 1 micro-batch, or 2 or more: the same peak from 2 on.


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
    """Delegates to `base`; a joint proposal dominated by an infeasible trial, or equal to a
    configuration already tried, is redrawn, up to `max_redraws` times (then the last is kept:
    the search must go on, and the trial answers it without training, search/trial/objective.py)."""

    def __init__(self, base: BaseSampler, max_redraws: int = 30):
        self.base = base
        self.max_redraws = max_redraws
        self.num_redrawn = 0  # infeasible proposals replaced, for benchmarks and tests
        self.num_repeats_redrawn = 0  # proposals of a configuration already tried, replaced

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
        trials = study_records(study)
        finished = [t for t in trials if t.state in ("PRUNED", "COMPLETE")]
        infeasible = [t.params for t in finished if t.infeasible]
        # settled, or training in another worker now: a second run of it would repeat it
        known = set(settled(finished))
        known |= {
            configuration(t.params)
            for t in trials
            if t.state == "RUNNING" and t.number != trial.number
        }
        floats = {k for k, d in search_space.items() if isinstance(d, FloatDistribution)}
        for _ in range(self.max_redraws):
            if any(dominated(params, oom, floats) for oom in infeasible):
                self.num_redrawn += 1
            elif configuration(params) in known:
                self.num_repeats_redrawn += 1
            else:
                break
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


# Optuna's GridSampler lists every point of its grid in memory (10^8 points: a MemoryError),
# and a study trains a few dozen of them: a grid larger than this is refused, with its size.
MAX_GRID_POINTS = 1_000_000


def _grid_count(dist: BaseDistribution) -> int | None:
    """How many values of `dist` a grid enumerates; None: continuous, no finite grid."""
    if isinstance(dist, CategoricalDistribution):
        return len(dist.choices)
    if isinstance(dist, IntDistribution) and not dist.log:
        return (dist.high - dist.low) // dist.step + 1
    if isinstance(dist, IntDistribution | FloatDistribution) and dist.step is not None:
        return round((dist.high - dist.low) / dist.step) + 1
    return None


def grid_of(space: SearchSpace) -> dict[str, list[Any]]:
    """search.params as GridSampler's search space: every value of every key. A continuous
    interval has no finite grid, and a grid over MAX_GRID_POINTS cannot be listed: both
    refused, with what to give instead. Counted before any value is listed."""
    counts = {key: _grid_count(dist) for key, dist in space.distributions.items()}
    problems = []
    for key, count in counts.items():
        if count is None:
            dist = space.distributions[key]
            points = _points(dist.low, dist.high, dist.log)
            problems.append(
                f"search.params.{key} is continuous ({'log ' if dist.log else ''}interval "
                f"{dist.low:g}..{dist.high:g}), which search/sampler=grid cannot enumerate; "
                f"give it as points, e.g. {key}: choice({', '.join(points)}), or search it with "
                "search/sampler=tpe or random"
            )
    if problems:
        raise ConfigError(problems)
    size = math.prod(counts.values())
    if size > MAX_GRID_POINTS:
        factors = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        raise ConfigError(
            [
                f"search/sampler=grid: search.params make a grid of {size:,} points "
                f"({' x '.join(f'{key} {count:,}' for key, count in factors)}), more than the "
                f"{MAX_GRID_POINTS:,} Optuna's GridSampler can list; give the largest fewer "
                "values (choice(16, 64, 256), or a range with a step: range(1, 100, 10)), "
                "or search them with search/sampler=tpe"
            ]
        )
    grid: dict[str, list[Any]] = {}
    for key, dist in space.distributions.items():
        if isinstance(dist, CategoricalDistribution):
            grid[key] = list(dist.choices)
        elif isinstance(dist, IntDistribution) and not dist.log:
            grid[key] = list(range(dist.low, dist.high + 1, dist.step))
        else:
            grid[key] = [dist.low + i * dist.step for i in range(counts[key])]
    return grid


def _points(low: float, high: float, log: bool, count: int = 4) -> list[str]:
    if log and low > 0:
        ratio = math.log(high / low)
        values = [low * math.exp(ratio * i / (count - 1)) for i in range(count)]
    else:
        values = [low + (high - low) * i / (count - 1) for i in range(count)]
    return [f"{v:.2g}" for v in values]


def build_sampler(node: DictConfig, space: SearchSpace) -> tuple[BaseSampler, list[str]]:
    """The sampler of search.sampler, and what was left out of its settings. GridSampler's
    grid is derived from search.params. Settings that only TPE takes (an experiment's
    n_startup_trials, multivariate) are dropped for another sampler, and said; any other
    unknown setting is an error."""
    values = OmegaConf.to_container(node, resolve=True)
    target_path = values.pop("_target_", None)
    try:
        target = get_object(target_path)
    except Exception as error:  # noqa: BLE001 - any import error of the user's path
        raise ConfigError([f"search.sampler._target_={target_path!r}: {error}"]) from None
    params = inspect.signature(target).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    tpe_only = set(inspect.signature(TPESampler).parameters)
    dropped = sorted(k for k in values if k not in params and not takes_all and k in tpe_only)
    unknown = sorted(k for k in values if k not in params and not takes_all and k not in tpe_only)
    if unknown:
        raise ConfigError(
            [
                f"search.sampler: {target.__name__} takes no {', '.join(unknown)}; it takes "
                f"{', '.join(sorted(params))}"
            ]
        )
    kwargs = {k: v for k, v in values.items() if k not in dropped}
    if isinstance(target, type) and issubclass(target, GridSampler):
        kwargs.setdefault("search_space", grid_of(space))
    notes = []
    if dropped:
        notes.append(
            f"search.sampler: {', '.join(dropped)} left out: settings of TPE, not of "
            f"{target.__name__}"
        )
    if isinstance(target, type) and issubclass(target, GridSampler):
        size = math.prod(len(v) for v in kwargs["search_space"].values())
        notes.append(f"grid of {size} configurations from search.params")
    try:
        return target(**kwargs), notes
    except (TypeError, ValueError) as error:  # a setting's value the sampler refuses
        reason = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        raise ConfigError(
            [f"search.sampler ({target.__name__}) cannot be built: {reason}"]
        ) from None


def grid_exhausted(sampler: BaseSampler, study: optuna.Study) -> bool:
    """Whether a grid sampler (wrapped or not) has proposed every point of its grid."""
    base = sampler.base if isinstance(sampler, FeasibilityFilter) else sampler
    return isinstance(base, GridSampler) and base.is_exhausted(study)
