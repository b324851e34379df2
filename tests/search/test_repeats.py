"""Which finished trials answer a repeat of their configuration, and which configurations of
a space count as known (the study ends when all are)."""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from batchfit.search.core.record import Outcome, TrialRecord
from batchfit.search.core.trial_count import answer_for, known_configurations, study_records
from batchfit.search.sampling.sampler import FeasibilityFilter
from batchfit.search.trial.objective import answer_from_record

B = "trainer.batch_size"
SIZES = {B: CategoricalDistribution([16, 32, 64, 256])}


def _pruned(reason: str, device: str = "cpu", batch: int = 16) -> optuna.trial.FrozenTrial:
    return create_trial(
        params={B: batch},
        distributions=SIZES,
        state=TrialState.PRUNED,
        user_attrs={"reason": reason, "device": device},
    )


@pytest.mark.parametrize(
    ("reason", "device", "settled"),
    [
        ("diverged", "cpu", True),  # seeded: diverges again
        ("missed_target", "cpu", True),
        ("oom", "cpu", True),  # the CPU budget check is exact
        ("oom", "cuda", False),  # fragmentation or another process: may fit next time
        ("oom_predicted", "cpu", False),  # predicted again: the margin may have changed
        ("slow", "cpu", False),  # timing noise
        ("pruner", "cpu", False),  # depends on the other trials
    ],
)
def test_which_outcomes_a_repeat_is_answered_with(reason, device, settled) -> None:
    assert TrialRecord.of(_pruned(reason, device)).is_settled is settled


def test_complete_trials_settle_and_repeats_do_not() -> None:
    done = create_trial(params={B: 16}, distributions=SIZES, value=1.0)
    assert TrialRecord.of(done).is_settled
    repeat = create_trial(
        params={B: 16}, distributions=SIZES, value=1.0, user_attrs={"repeat_of": 0}
    )
    assert not TrialRecord.of(repeat).is_settled


def test_known_configurations_are_those_of_the_current_space() -> None:
    old = {"n": IntDistribution(1, 7)}
    study = optuna.create_study()
    for n in (1, 4, 7):
        study.add_trial(create_trial(params={"n": n}, distributions=old, value=float(n)))
    study.add_trial(
        create_trial(
            params={"n": 5}, distributions=old, state=TrialState.PRUNED,
            user_attrs={"reason": "slow"},
        )
    )  # fmt: skip
    # Resumed with range(4, 10): 1 is out of it, 5 would train again, 4 and 7 are known.
    assert known_configurations(study_records(study), {"n": IntDistribution(4, 10)}) == {
        (("n", 4),),
        (("n", 7),),
    }
    assert (
        known_configurations(
            study_records(study), {"n": IntDistribution(4, 10), "m": IntDistribution(1, 2)}
        )
        == set()
    )


class _Scripted(optuna.samplers.RandomSampler):
    """A base sampler whose joint proposals come from a script."""

    def __init__(self, script: list[dict]):
        super().__init__(seed=0)
        self.script = list(script)

    def sample_relative(self, study, trial, search_space):  # noqa: ANN001, ANN201
        return self.script.pop(0)


def test_the_filter_redraws_a_configuration_another_worker_is_training() -> None:
    study = optuna.create_study()
    study.add_trial(create_trial(params={B: 16}, distributions=SIZES, value=1.0))
    study.enqueue_trial({B: 32})
    other = study.ask()  # another worker's trial of batch 32, still running
    assert other.suggest_categorical(B, SIZES[B].choices) == 32
    sampler = FeasibilityFilter(_Scripted([{B: 32}, {B: 64}]))
    study.ask()
    mine = study.get_trials()[-1]
    assert sampler.sample_relative(study, mine, SIZES) == {B: 64}
    assert sampler.num_repeats_redrawn == 1


def test_the_filter_redraws_known_configurations_and_infeasible_ones() -> None:
    study = optuna.create_study()
    study.add_trial(create_trial(params={B: 16}, distributions=SIZES, value=1.0))
    study.add_trial(
        create_trial(
            params={B: 64},
            distributions=SIZES,
            state=TrialState.PRUNED,
            system_attrs={"constraints:memory": 0.5},  # how Trial.set_constraint stores it
        )
    )
    sampler = FeasibilityFilter(_Scripted([{B: 16}, {B: 256}, {B: 32}, {B: 16}]))
    study.ask()
    mine = study.get_trials()[-1]
    # 16 was trained (a repeat teaches nothing), 256 is larger than 64, which did not fit.
    assert sampler.sample_relative(study, mine, SIZES) == {B: 32}
    assert (sampler.num_repeats_redrawn, sampler.num_redrawn) == (1, 1)


@pytest.mark.parametrize("state", [TrialState.COMPLETE, TrialState.PRUNED])
def test_a_repeat_is_answered_with_the_earlier_state_values_reason_and_constraint(state) -> None:
    """The answer is what the sampler learns from: the same state, values and memory
    constraint as the trial that settled the configuration, unbilled, naming it."""
    study = optuna.create_study()
    pruned = state == TrialState.PRUNED
    study.add_trial(
        create_trial(
            params={B: 32},
            distributions=SIZES,
            state=state,
            value=None if pruned else 0.9,
            user_attrs=TrialRecord(
                0, state.name, outcome=Outcome(state.name, "diverged" if pruned else None)
            ).to_attrs(),
            system_attrs={"constraints:memory": -0.25},
        )
    )
    earlier = answer_for(study_records(study), 1, {B: 32})
    assert earlier is not None and earlier.number == 0
    assert answer_for(study_records(study), 1, {B: 64}) is None  # not trained: no answer
    trial = study.ask()
    trial.suggest_categorical(B, SIZES[B].choices)
    if pruned:
        with pytest.raises(optuna.TrialPruned, match="the configuration of trial 0"):
            answer_from_record(trial, earlier)
        study.tell(trial, state=TrialState.PRUNED)
    else:
        study.tell(trial, answer_from_record(trial, earlier))
    answer = TrialRecord.of(study.trials[1])
    assert answer.state == state.name and answer.repeat_of == 0
    assert answer.memory_violation == -0.25  # the constraint is copied
    assert answer.outcome.reason == ("diverged" if pruned else None)
    assert answer.values == (None if pruned else (0.9,))
    assert answer.is_unbilled and not answer.is_trained and not answer.is_settled
