"""search/core/record.py: a trial's record survives a real Optuna storage whole, and the counting
predicates say what the trial budget (search/core/trial_count.py) counts."""

from __future__ import annotations

import dataclasses

import optuna
import pytest
import torch
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from batchfit.search.core.record import Attr, Outcome, TrialRecord
from batchfit.search.core.study_config import SearchConfig
from batchfit.search.trial.ending import trial_record, write
from batchfit.tracking.metrics import STEP_MS, THROUGHPUT_TOKENS, VAL_ACC
from batchfit.train.config import RunSpec, TrainerConfig
from batchfit.train.device.spec import DeviceSpec
from batchfit.train.params import ACCUM_KEY, BATCH_KEY, PRECISION_KEY

RUN = {BATCH_KEY: 64, ACCUM_KEY: 2, PRECISION_KEY: "bf16", "device": "cpu"}


def _full(number: int) -> TrialRecord:
    """A record with every stored field, its outcome's too, set to something other than
    its default."""
    outcome = Outcome(
        "PRUNED",
        reason="slow",
        message="steps 4-6 took 3 s each",
        peak_bytes=1_000_000,
        predicted_bytes=1_100_000,
        prediction_error=0.1,
        unit="tokens",
        metrics={VAL_ACC: 0.9, THROUGHPUT_TOKENS: 912.4, STEP_MS: 40.0},
        val_curve=[[10, 0.5]],
        target_curve=[[10, 0.8]],
        timed_steps=10,
        timed_samples=640,
        mfu_note="peak below the truth",
        probe_s_per_sample=0.02,
        projected_s=412.0,
    )
    return TrialRecord(
        number,
        "PRUNED",
        params={BATCH_KEY: 64},
        memory_violation=-0.25,
        run=RUN,
        outcome=outcome,
        repeat_of=7,
        surplus=True,
        run_id="abc123",
        seconds=12.5,
        storage_s=0.01,
        tracking_s=0.02,
        budget_bytes=2_000_000,
        time_budget_s=60.0,
    )


def test_every_stored_field_is_set_in_the_full_record() -> None:
    full = _full(0)
    for value in (full, full.outcome):
        stored = [f for f in dataclasses.fields(value) if "attr" in f.metadata]
        unset = [f.name for f in stored if getattr(value, f.name) == f.default]
        assert stored and not unset


def test_a_record_written_to_a_trial_reads_back_the_same(tmp_path) -> None:
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/optuna.db")
    study = optuna.create_study(storage=storage)
    trial = study.ask()
    trial.suggest_categorical(BATCH_KEY, [32, 64])
    written = dataclasses.replace(_full(trial.number), params={BATCH_KEY: trial.params[BATCH_KEY]})
    write(trial, written)
    study.tell(trial, state=TrialState.PRUNED)
    read = TrialRecord.of(optuna.load_study(study_name=study.study_name, storage=storage).trials[0])
    assert read == written
    # optuna-dashboard shows the constraint only as this user attr (its constraint view reads
    # Optuna 4's attribute): it is written beside the constraint.
    assert read.memory_violation == -0.25 and study.trials[0].constraints == {"memory": -0.25}
    assert study.trials[0].user_attrs[Attr.VIOLATION] == -0.25
    # a figure is stored once, in the record; a completed run's throughput, val/acc and step
    # time are written under names of their own too, for users and optuna-dashboard
    attrs = study.trials[0].user_attrs
    assert (attrs[Attr.THROUGHPUT], attrs[Attr.VAL_ACC], attrs[Attr.STEP_MS]) == (912.4, 0.9, 40.0)


def test_a_failure_counts_as_finished_whatever_its_reason() -> None:
    """A FAIL with an error of its own is finished (not run again); a FAIL without one was
    interrupted."""
    started = TrialRecord(3, "RUNNING", run=RUN)
    settings = SearchConfig("s", "sqlite://", 4, None, (VAL_ACC,), None, None)
    cpu = torch.device("cpu")
    spec = RunSpec(TrainerConfig(), cpu, DeviceSpec("cpu", 2**30), None, 0.1, 0.1)
    for reason in ("error", None):
        outcome = Outcome("FAIL", reason, "RuntimeError: boom")
        ended = trial_record(started, outcome, spec, 1.0, settings, {})
        assert ended.outcome.error == "RuntimeError: boom"
        assert ended.is_finished and ended.is_trained
    assert not TrialRecord(3, "FAIL", run=RUN).is_finished  # died: no error of its own


@pytest.mark.parametrize(
    ("state", "attrs", "finished", "unbilled", "trained"),
    [
        (TrialState.COMPLETE, {}, True, False, True),
        (TrialState.PRUNED, {"reason": "oom_predicted"}, True, True, False),
        (TrialState.COMPLETE, {"repeat_of": 0}, True, True, False),
        (TrialState.FAIL, {"error": "boom"}, True, False, True),
        (TrialState.FAIL, {}, False, False, False),  # its worker died: run again
        (TrialState.FAIL, {"surplus": True}, False, False, False),
    ],
)
def test_which_trials_count(state, attrs, finished, unbilled, trained) -> None:
    trial = create_trial(
        state=state,
        value=1.0 if state == TrialState.COMPLETE else None,
        params={BATCH_KEY: 64},
        distributions={BATCH_KEY: CategoricalDistribution([64])},
        user_attrs={**RUN, **attrs},
    )
    record = TrialRecord.of(trial)
    assert (record.is_finished, record.is_unbilled, record.is_trained) == (
        finished,
        unbilled,
        trained,
    )
