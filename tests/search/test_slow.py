"""The slow-trial guard on a busy machine: a probe prunes only the absurdly slow, real steps
after the warm-up are held to the budget and to the study's completed trials, and a study
whose every trial was slow says that the machine or the budget is the problem."""

from __future__ import annotations

import re

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial
from rich.console import Console

from batchfit.search.core.record import Attr, Outcome, TrialRecord
from batchfit.search.results.summary import none_completed, summary
from batchfit.search.storage.heartbeat import RetryStaleTrial
from batchfit.search.trial.stopping import PROBE_MARGIN, SETTLE_STEPS, Prune, TimeBudget, Yardstick
from batchfit.tracking.metrics import VAL_ACC
from tests.conftest import FAST

# ResNet-18/digits on a 2-core AVX2 CPU, 2876 samples (2 epochs), a 60 s budget. fp32 trials
# train in 10-28 s on an idle machine; their 8-sample probes projected 279-543 s beside two
# CPU-bound processes (issue 16) and up to 1587 s at a load of 6-7 (this test's author). bf16
# runs 36x slower than fp32 there (no native kernels): 12.5 vs 453 ms per probe sample idle.
BUSY_FP32_S, NO_KERNELS_IDLE_S = 1587.0, 1302.0
IDLE_FP32_PROBE, IDLE_BF16_PROBE = 0.0125, 0.453


def _records(study: optuna.Study) -> list[TrialRecord]:
    return [TrialRecord.of(t) for t in study.get_trials()]


def _steps(budget: TimeBudget, seconds: list[float], num_steps: int) -> None:
    """Run `budget.on_step` over steps taking `seconds` each."""
    elapsed = 0.0
    for step, took in enumerate(seconds, start=1):
        elapsed += took
        budget.on_step(step, num_steps, elapsed)


def test_alone_the_probe_stops_only_what_is_absurdly_slow() -> None:
    budget = TimeBudget(60.0)  # no trial has completed yet
    budget.on_probe(BUSY_FP32_S / 2876, 2876)  # busy, not hopeless: it trains
    budget.on_probe(NO_KERNELS_IDLE_S / 2876, 2876)  # its real steps will tell
    busy_bf16 = 36 * BUSY_FP32_S
    with pytest.raises(Prune, match=r"projects 57132 s .* over 100 x search.trial_time_budget_s"):
        budget.on_probe(busy_bf16 / 2876, 2876)
    assert BUSY_FP32_S < PROBE_MARGIN * 60 < busy_bf16


def test_beside_completed_trials_the_probe_is_compared_with_theirs() -> None:
    budget = TimeBudget(60.0, Yardstick(seconds=20.0, probe_s_per_sample=IDLE_FP32_PROBE))
    with pytest.raises(Prune) as info:
        budget.on_probe(IDLE_BF16_PROBE, 2876)
    assert info.value.reason == "slow"
    assert str(info.value) == (
        "a probe step projects 1303 s of training for 2876 samples, over 1.5 x "
        "search.trial_time_budget_s=60, and 453 ms per sample is over 10 x the 12.5 ms of the "
        "study's completed trials' probes (median)"
    )
    # fp32 while the machine got 7x busier than when the others probed: it trains.
    budget.on_probe(7 * IDLE_FP32_PROBE, 2876)


def test_the_settling_steps_do_not_project() -> None:
    # The first steps (memory-tracked, warm-up) take 10 s each, the rest 0.1 s: 30 s + 97 x
    # 0.1 s = 40 s in all, under 1.5 x 60 s. Projected from the first 3 steps it was 1000 s.
    budget = TimeBudget(60.0, Yardstick(seconds=10.0))
    _steps(budget, [10.0] * SETTLE_STEPS + [0.1] * 97, num_steps=100)


def test_real_steps_on_a_busy_machine_are_held_to_the_completed_trials() -> None:
    # Every trial is 5x slower on a busy machine: the completed ones took 200 s against a
    # 60 s budget. One projecting 300 s is as slow as they are and trains.
    settle = [1.0] * SETTLE_STEPS
    _steps(TimeBudget(60.0, Yardstick(seconds=200.0)), settle + [3.0] * 97, num_steps=100)
    # One projecting 900 s (3 + 97 x 9.25) is 4.5x them, and over budget: slow.
    with pytest.raises(Prune) as info:
        _steps(TimeBudget(60.0, Yardstick(seconds=200.0)), settle + [9.25] * 97, num_steps=100)
    assert info.value.reason == "slow"
    assert re.fullmatch(
        r"steps 4-6 of 100 took 9.2 s each, projecting 900 s, over 1.5 x "
        r"search.trial_time_budget_s=60 and 4 x the 200 s of the study's completed trials "
        r"\(median\)",
        str(info.value),
    )
    assert info.value.projected_s == pytest.approx(3 + 97 * 9.25)
    # Far under the completed trials but over the budget: not slow (they set the yardstick).
    _steps(TimeBudget(60.0, Yardstick(seconds=10.0)), settle + [0.5] * 97, num_steps=100)
    with pytest.raises(Prune, match="over 1.5 x search.trial_time_budget_s=60 and 4 x the 10 s"):
        _steps(TimeBudget(60.0, Yardstick(seconds=10.0)), settle + [1.0] * 97, num_steps=100)


def test_before_any_trial_completed_only_far_over_the_budget_is_slow() -> None:
    settle = [1.0] * SETTLE_STEPS
    _steps(TimeBudget(60.0), settle + [5.0] * 97, num_steps=100)  # 488 s: busy, it trains
    with pytest.raises(Prune, match=r"over 10 x search.trial_time_budget_s=60 \(no trial"):
        _steps(TimeBudget(60.0), settle + [7.0] * 97, num_steps=100)  # 682 s
    TimeBudget(None).on_step(50, 100, 1e9)  # no budget: never slow


def _slow(number: int, projected_s: float) -> optuna.trial.FrozenTrial:
    return create_trial(
        state=TrialState.PRUNED,
        params={"trainer.batch_size": 16 * (number + 1)},
        distributions={"trainer.batch_size": CategoricalDistribution([16, 32, 48, 64])},
        user_attrs=TrialRecord(
            number,
            "PRUNED",
            outcome=Outcome("PRUNED", "slow", projected_s=projected_s),
            time_budget_s=60.0,
        ).to_attrs(),
    )


def test_the_yardstick_is_the_median_of_the_completed_trials() -> None:
    study = optuna.create_study(directions=["maximize"])
    assert Yardstick.of(_records(study)) == Yardstick(None, None)
    for seconds, probe in ((30.0, 0.03), (10.0, 0.01), (20.0, None)):
        attrs = {"seconds": seconds, **({"probe_s_per_sample": probe} if probe else {})}
        study.add_trial(create_trial(value=0.5, user_attrs=attrs))
    study.add_trial(create_trial(value=0.5, user_attrs={"seconds": 99.0, "repeat_of": 0}))
    study.add_trial(_slow(0, 500.0))
    assert Yardstick.of(_records(study)) == Yardstick(20.0, 0.03)


def test_trials_that_missed_the_target_are_a_yardstick_too() -> None:
    """In a time-to-target study every trial may end its budget short of the target: those
    trained their whole budget, so their time judges the next trial (a bf16 trial 30x
    slower than fp32 on a CPU must not get 10 x the budget for want of a COMPLETE one)."""
    study = optuna.create_study(directions=["minimize"])
    missed = {"seconds": 40.0, "probe_s_per_sample": 0.02, "reason": "missed_target"}
    study.add_trial(create_trial(state=TrialState.PRUNED, user_attrs=missed))
    study.add_trial(_slow(1, 900.0))  # pruned early: not a whole budget's time
    assert Yardstick.of(_records(study)) == Yardstick(40.0, 0.02)
    settle = [1.0] * SETTLE_STEPS
    with pytest.raises(Prune, match=r"4 x the 40 s of the study's completed trials"):
        _steps(TimeBudget(60.0, Yardstick.of(_records(study))), settle + [2.0] * 97, num_steps=100)


def test_when_every_trial_is_slow_the_summary_blames_the_machine_or_the_budget() -> None:
    study = optuna.create_study(study_name="busy", directions=["maximize"])
    for number, projected in enumerate((279.0, 412.0, 543.0)):
        study.add_trial(_slow(number, projected))
    console = Console(record=True, width=400)
    summary(console, study, [VAL_ACC], None)
    text = console.export_text()
    assert re.search(
        r"All 3 trials were pruned as slow: they projected 279-543 s \(4.7-9.1x\) against "
        r"search.trial_time_budget_s=60; this machine's load is \d+\.\d on the \d+ cores? this "
        r"process may use. The machine or the budget is the problem, not the configurations: "
        r"raise search.trial_time_budget_s to ~600 or free the machine.",
        text,
    )
    assert "see the reasons above" not in text
    alone = optuna.create_study(study_name="alone", directions=["maximize"])
    alone.add_trial(_slow(0, 318.0))
    console = Console(record=True, width=400)
    summary(console, alone, [VAL_ACC], None)
    assert re.search(
        r"The only trial was pruned as slow: it projected 318 s \(5.3x\) against "
        r"search.trial_time_budget_s=60; this machine's load is \d+\.\d on the \d+ cores? this "
        r"process may use. Raise search.trial_time_budget_s to ~400 or free the machine.",
        console.export_text(),
    )
    # One trial pruned for another reason: the configurations may be the problem.
    study.add_trial(create_trial(state=TrialState.PRUNED, user_attrs={"reason": "diverged"}))
    assert none_completed(study.get_trials()) == (
        "No trial completed. The trials ended as: 3 PRUNED (slow); 1 PRUNED (diverged) (the "
        "loss diverged or did not learn (its message says which): narrow the optimizer.lr "
        "range in search.params)."
    )
    study.add_trial(create_trial(state=TrialState.FAIL, user_attrs={"error": "boom"}))
    assert "; 1 FAIL (an error in training: its line above says which" in none_completed(
        study.get_trials()
    )


@pytest.mark.study
def test_a_study_of_slow_trials_records_their_projection_and_says_so(prepare_study, stores):
    overrides = [
        *FAST,  # small_cnn(4) on digits, one epoch, on the CPU
        "search.trial_time_budget_s=0.0001",  # any probe projects over 100 x this
        "search.objectives=[val/acc]",
        "search.n_trials=2",
        "search.study_name=slow",
        "+search.params={trainer.batch_size:'choice(16,64)'}",
        *stores["overrides"],
    ]
    driver = prepare_study(overrides, width=400)
    driver.run()
    trials = [t for t in driver.study.get_trials() if Attr.REPEAT_OF not in t.user_attrs]
    assert trials and all(t.user_attrs[Attr.REASON] == "slow" for t in trials)
    for t in trials:
        assert t.user_attrs[Attr.PROJECTED_S] > PROBE_MARGIN * 0.0001
        assert t.user_attrs[Attr.PROBE_S_PER_SAMPLE] > 0
        assert t.user_attrs[Attr.TIME_BUDGET_S] == 0.0001
    text = driver.console.export_text()
    assert f"All {len(trials)} trials were pruned as slow: they projected" in text
    assert "against search.trial_time_budget_s=0.0001" in text


@pytest.mark.study
def test_a_trial_queued_again_after_a_stop_goes_through_the_probe(prepare_study, stores):
    """A trial interrupted (Ctrl-C, SIGTERM, a dead worker) is queued again with its
    parameters; run again, it is probed like a new one: pruned `slow` by the probe, before
    its first step, not after training for a while."""
    overrides = [
        *FAST, "search.trial_time_budget_s=0.0001", "search.objectives=[val/acc]",
        "search.n_trials=1", "search.study_name=requeued",
        "+search.params={trainer.batch_size:'choice(16,64)'}", *stores["overrides"],
        # No fit report trial waiting before the interrupted one (failed to get it out of
        # the way, it would itself be an interrupted trial never queued, and queued).
        "search.fit_report_first=false",
    ]  # fmt: skip
    driver = prepare_study(overrides, width=400)
    study = driver.study
    assert not study.get_trials(states=(TrialState.WAITING,))
    dist = {"trainer.batch_size": CategoricalDistribution([16, 64])}
    study.add_trial(
        create_trial(state=TrialState.FAIL, params={"trainer.batch_size": 16}, distributions=dist)
    )  # interrupted: no error of its own
    interrupted = study.get_trials()[-1]
    RetryStaleTrial()(study, interrupted)
    driver.run()
    (rerun,) = [t for t in study.get_trials() if t.system_attrs.get("failed_trial") is not None]
    assert rerun.system_attrs["failed_trial"] == interrupted.number
    assert rerun.state == TrialState.PRUNED and rerun.user_attrs[Attr.REASON] == "slow"
    assert rerun.user_attrs[Attr.MESSAGE].startswith("a probe step projects")
    assert Attr.PEAK_BYTES not in rerun.user_attrs  # stopped before its first step
