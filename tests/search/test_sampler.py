"""The feasibility filter (search/sampling/sampler.py): which proposals an OOM rules out, and
that it keeps a TPE study off the infeasible region on a small, calibrated synthetic problem."""

from __future__ import annotations

import math

import optuna
import pytest
from optuna.samplers import TPESampler
from optuna.trial import TrialState, create_trial

from batchfit.search.core.record import TrialRecord
from batchfit.search.sampling.sampler import FeasibilityFilter, dominated

BATCH, ACCUM, PRECISION = "trainer.batch_size", "trainer.accum_steps", "trainer.precision"
EFFECTIVE, LR = "trainer.effective_batch_size", "optimizer.lr"
OOM = {BATCH: 256, PRECISION: "fp32", ACCUM: 1, LR: 0.01}
FLOATS = {LR}


# ------------------------------------------------------------------------------ dominated


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, True),  # the same configuration
        ({BATCH: 512}, True),  # a larger batch needs at least as much
        ({BATCH: 128}, False),  # a smaller one may fit
        ({PRECISION: "bf16"}, False),  # another precision: another memory curve
        ({BATCH: 512, PRECISION: "fp16"}, False),
        ({ACCUM: 2}, True),  # accumulating keeps the gradients alive: no lighter than 1
        ({ACCUM: 4, BATCH: 1024}, True),
        ({LR: 0.5}, True),  # float params do not change the memory
        ({LR: 1e-5, BATCH: 128}, False),
    ],
)
def test_dominated_by_an_oom_at_accum_1(changes, expected):
    assert dominated({**OOM, **changes}, OOM, FLOATS) is expected


@pytest.mark.parametrize(
    ("accum", "expected"),
    [(1, False), (2, True), (4, True)],  # from 2 micro-batches on the peak is the same
)
def test_an_oom_with_accumulation_does_not_rule_out_a_single_micro_batch(accum, expected):
    oom = {**OOM, ACCUM: 2}
    assert dominated({**OOM, ACCUM: accum}, oom, FLOATS) is expected
    assert dominated({**OOM, ACCUM: accum, BATCH: 128}, oom, FLOATS) is False


def test_dominated_by_effective_batch_and_other_keys():
    # Derived accumulation: a larger effective batch may train a smaller micro-batch, so an
    # OOM at 256 says nothing of 512; only the same effective batch is dominated.
    oom = {EFFECTIVE: 256, PRECISION: "bf16", "model.width": 32}
    assert dominated({EFFECTIVE: 256, PRECISION: "bf16", "model.width": 32}, oom, set())
    assert not dominated({EFFECTIVE: 512, PRECISION: "bf16", "model.width": 32}, oom, set())
    assert not dominated({EFFECTIVE: 128, PRECISION: "bf16", "model.width": 32}, oom, set())
    assert not dominated({EFFECTIVE: 512, PRECISION: "bf16", "model.width": 16}, oom, set())
    # Keys the proposal does not have (a conditional parameter) are not compared.
    assert dominated({EFFECTIVE: 256}, oom, set())


def test_a_float_key_is_ignored_only_when_declared_float():
    oom = {BATCH: 64, "optimizer.weight_decay": 0.1}
    params = {BATCH: 64, "optimizer.weight_decay": 0.2}
    assert dominated(params, oom, {"optimizer.weight_decay"})
    assert not dominated(params, oom, set())  # compared as any other value


def test_is_infeasible_reads_the_memory_constraint():
    def trial(constraints: dict | None) -> optuna.trial.FrozenTrial:
        return create_trial(state=TrialState.PRUNED, params={}, constraints=constraints)

    assert TrialRecord.of(trial({"memory": 0.2})).infeasible
    assert not TrialRecord.of(trial({"memory": -0.5})).infeasible
    assert not TrialRecord.of(trial({"memory": 0.0})).infeasible
    assert not TrialRecord.of(trial(None)).infeasible


# ------------------------------------------------------------------------------ the direction

# A synthetic memory curve: peak = 100 + batch x bytes per sample, against a budget of 200.
# fp32 needs 1.4 x 0.6 = 0.84 per sample (batch 128 and up do not fit), bf16 and fp16 0.42
# (256 and up): 10 of the 21 (batch, precision) pairs, 48 %, are infeasible. Accumulation and
# the learning rate do not change the memory. The objective rewards a larger batch and an lr
# near 1e-2, so TPE is drawn towards the boundary.
BATCHES = [16, 32, 64, 128, 256, 512, 1024]
BYTES_PER_SAMPLE = {"fp32": 1.4 * 0.6, "bf16": 0.7 * 0.6, "fp16": 0.7 * 0.6}
BUDGET = 200.0
N_TRIALS = 40
# Calibration (optuna 5.0, 40 trials, n_startup_trials=6): OOM trials among trials 20-39,
# per seed 0..9, with the filter [3, 1, 1, 1, 2, 1, 3, 0, 1, 2] = 15 of 200 (7.5 %) and
# without it [7, 7, 3, 4, 3, 1, 4, 4, 5, 8] = 46 of 200 (23 %): a ratio of 0.33. Over seeds
# 0..39 the ratio is 0.25 and no 10 consecutive seeds exceed 0.33, so the 0.5 asserted below
# (the target) holds with room. Single seeds vary too much to assert on (seed 4: 2 vs
# 3). The 20 studies take about 2 s.
SEEDS = range(10)


def _late_oom_count(seed: int, with_filter: bool) -> tuple[int, int]:
    """(OOM trials among the last half, proposals redrawn) of one study."""
    base = TPESampler(multivariate=True, seed=seed, n_startup_trials=6)
    sampler = FeasibilityFilter(base) if with_filter else base
    study = optuna.create_study(direction="maximize", sampler=sampler)
    oom = []
    for _ in range(N_TRIALS):
        trial = study.ask()
        batch = trial.suggest_categorical(BATCH, BATCHES)
        precision = trial.suggest_categorical(PRECISION, list(BYTES_PER_SAMPLE))
        accum = trial.suggest_categorical(ACCUM, [1, 2, 4])
        lr = trial.suggest_float(LR, 1e-4, 1e-1, log=True)
        excess = (100 + batch * BYTES_PER_SAMPLE[precision] - BUDGET) / BUDGET
        trial.set_constraint("memory", excess)  # as search/trial/ending.py records every trial
        if excess > 0:
            study.tell(trial, state=TrialState.PRUNED)
        else:
            value = 0.1 * math.log2(batch) - (math.log10(lr) + 2) ** 2 + 0.05 * math.log2(accum)
            study.tell(trial, value)
        oom.append(excess > 0)
    assert all(t.constraints for t in study.trials)
    redrawn = sampler.num_redrawn if with_filter else 0
    return sum(oom[N_TRIALS // 2 :]), redrawn


def test_the_filter_halves_late_oom_proposals():
    with_filter = [_late_oom_count(seed, True) for seed in SEEDS]
    without = [_late_oom_count(seed, False) for seed in SEEDS]
    late_with = sum(count for count, _ in with_filter)
    late_without = sum(count for count, _ in without)
    # Without the filter TPE keeps proposing OOMs late in the study: the test is meaningful.
    assert late_without >= 30  # 15 % of the 200 late trials
    assert late_with <= 0.5 * late_without, (late_with, late_without)
    assert sum(redrawn for _, redrawn in with_filter) > 0
    assert all(redrawn > 0 for _, redrawn in with_filter)


def test_the_filter_redraws_a_dominated_proposal():
    """With one OOM recorded, a base sampler that proposes a dominated configuration first
    is asked again, and the next, feasible proposal is kept."""

    class Scripted(optuna.samplers.RandomSampler):
        def __init__(self, proposals: list[dict]):
            super().__init__(seed=0)
            self.proposals = proposals

        def infer_relative_search_space(self, study, trial):  # noqa: ANN001, ANN201
            return {BATCH: optuna.distributions.CategoricalDistribution(BATCHES)}

        def sample_relative(self, study, trial, search_space):  # noqa: ANN001, ANN201
            return self.proposals.pop(0)

    study = optuna.create_study()
    oom = create_trial(
        state=TrialState.PRUNED,
        params={BATCH: 256},
        distributions={BATCH: optuna.distributions.CategoricalDistribution(BATCHES)},
        constraints={"memory": 0.3},
    )
    study.add_trial(oom)
    sampler = FeasibilityFilter(Scripted([{BATCH: 512}, {BATCH: 1024}, {BATCH: 64}]))
    study.sampler = sampler
    trial = study.ask()
    assert trial.suggest_categorical(BATCH, BATCHES) == 64
    assert sampler.num_redrawn == 2
