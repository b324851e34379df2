"""The study's trial budget: search.n_trials, counted over every worker that shares the study,
and the one rule that a configuration is never trained twice.

- A trial counts (`num_trained`) when it trained and finished (search/core/record.py
  `is_trained`). Proposals answered without training (predicted not to fit, or answered
  from an earlier trial's record: `is_unbilled`) are trials in Optuna, so the sampler learns
  from them, but take no slot.
- Workers that start together may both start the last trial: trial numbers are given out
  atomically, so the later one sees the earlier and steps back (`claims_slot`; it is marked
  `surplus`, fails without an error and never counts).
- A configuration whose outcome a new run would repeat (search/core/record.py `is_settled`) is
  not trained again. That rule has three users: the sampler redraws such a proposal
  (search/sampling/sampler.py, through `settled`), a proposal that gets through is answered from the
  record (`answer_for`, search/trial/objective.py), and a finite space whose every configuration
  is settled or predicted not to fit ends the study (`known_configurations`,
  `TrialBudget.spent`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import TrialState

from batchfit.search.core.record import UNTRAINED, TrialRecord, records

# A worker whose proposals go this many in a row without training (predicted not to fit, or
# already trained) stops: the feasible part of search.params is spent or too small.
MAX_UNBILLED_IN_A_ROW = 50

Configuration = tuple[tuple[str, Any], ...]


def configuration(params: Mapping[str, Any]) -> Configuration:
    """A trial's sampled values, as a key: equal for equal configurations."""
    return tuple(sorted(params.items()))


def study_records(study: optuna.Study) -> list[TrialRecord]:
    return records(study.get_trials(deepcopy=False))


def num_trained(trials: Iterable[TrialRecord]) -> int:
    """Trials that count towards search.n_trials."""
    return sum(t.is_trained for t in trials)


def num_running(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


def settled(trials: Iterable[TrialRecord]) -> dict[Configuration, TrialRecord]:
    """Each settled configuration and the first trial that settled it."""
    found: dict[Configuration, TrialRecord] = {}
    for t in trials:
        if t.is_settled:
            found.setdefault(configuration(t.params), t)
    return found


def answer_for(
    trials: Iterable[TrialRecord], number: int, params: Mapping[str, Any]
) -> TrialRecord | None:
    """The earlier trial whose record answers trial `number`'s proposal `params`, if any."""
    return settled(t for t in trials if t.number != number).get(configuration(params))


def _holds_slot(trial: TrialRecord) -> bool:
    """Finished with a result that counts, running, or queued: it takes one of the n_trials."""
    return trial.is_trained or trial.state in ("RUNNING", "WAITING")


def should_start_trial(study: optuna.Study, n_trials: int) -> bool | None:
    """True: start a trial (a queued one first). None: the trials running elsewhere complete
    the study, so wait (one of them may die and be queued again). False: the study is done."""
    trials = study_records(study)
    if num_trained(trials) >= n_trials:
        return False
    if any(t.state == "WAITING" for t in trials):
        return True  # a dead worker's trial, queued again: someone must run it
    return True if sum(_holds_slot(t) for t in trials) < n_trials else None


def claims_slot(study: optuna.Study, number: int, n_trials: int) -> bool:
    """Whether trial `number`, just started, is within search.n_trials (see the module)."""
    earlier = [t for t in study_records(study) if t.number < number]
    return sum(_holds_slot(t) for t in earlier) < n_trials


def interrupted_numbers(study: optuna.Study) -> set[int]:
    """Trials that ended without a result of their own because their worker died (failed by
    a heartbeat check) or was interrupted."""
    return {
        t.number
        for t in study_records(study)
        if t.state == "FAIL" and not t.is_finished and not t.surplus
    }


def known_configurations(
    trials: Iterable[TrialRecord], distributions: Mapping[str, BaseDistribution]
) -> set[Configuration]:
    """The distinct configurations of the space (sampled values within `distributions`) that
    a new trial would not train: settled, or pruned before training (predicted not to fit,
    larger than the data)."""
    known = set()
    for t in trials:
        if not (t.is_settled or (t.state == "PRUNED" and t.outcome.reason in UNTRAINED)):
            continue
        if set(t.params) != set(distributions) or not all(
            _within(distributions[k], v) for k, v in t.params.items()
        ):
            continue  # from an earlier space of a resumed study
        known.add(configuration(t.params))
    return known


def _within(dist: BaseDistribution, value: Any) -> bool:
    # Private in Optuna, pinned by tests/test_private_apis.py: membership of a value in a
    # distribution, step and bounds included, as Optuna's own checks do it.
    try:
        return dist._contains(dist.to_internal_repr(value))
    except (ValueError, TypeError):
        return False


class TrialBudget:
    """One worker's view of search.n_trials: whether to start a trial, whether one it
    started is within the budget, and whether the space is spent before it."""

    def __init__(self, n_trials: int, space_size: int | None, distributions: Mapping[str, Any]):
        self.n_trials = n_trials
        self.space_size = space_size  # None: an infinite space (an interval)
        self.distributions = distributions
        self.unbilled_in_a_row = 0  # this worker's proposals answered without training

    def trial_finished(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        """Optuna callback: count this worker's unbilled proposals in a row."""
        t = TrialRecord.of(trial)
        if not t.surplus:
            self.unbilled_in_a_row = self.unbilled_in_a_row + 1 if t.is_unbilled else 0

    def spent(self, study: optuna.Study, grid_exhausted: bool) -> str | None:
        """Why the study ends short of search.n_trials, if it does: every configuration of
        a finite space is known, or proposals keep landing where nothing new trains."""
        trained = num_trained(study_records(study))
        done = f"{trained} trials trained of search.n_trials={self.n_trials}"
        if grid_exhausted:
            return (
                f"the grid is exhausted: every configuration of search.params was proposed ({done})"
            )
        known = known_configurations(study_records(study), self.distributions)
        if self.space_size is not None and len(known) >= self.space_size:
            return (
                f"every one of the {self.space_size} configurations of search.params has been "
                f"tried or predicted not to fit ({done}); the study ends here"
            )
        if self.unbilled_in_a_row >= MAX_UNBILLED_IN_A_ROW:
            return (
                f"[yellow]the last {self.unbilled_in_a_row} proposals were all predicted not "
                f"to fit or trained before, so this worker stops ({done}).[/yellow] Little of "
                "search.params fits search.memory_budget: raise the budget, or keep "
                "search.params to the batch sizes and precisions the fit report shows fitting"
            )
        return None
