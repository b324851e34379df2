"""The study's pruner in real studies (the driver in-process, as in test_driver.py): when it
may prune (not at a trial's first validation, never at its last) and what a pruned trial
leaves in MLflow (its measured memory and the prediction's error, as a completed one)."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from batchfit.search.core.record import Attr
from batchfit.search.study.driver import StudyDriver
from batchfit.tracking.metrics import PEAK_BYTES, PREDICTED_BYTES, PREDICTION_ERROR

pytestmark = pytest.mark.study

GOOD_LR, BAD_LR = 0.1, 1e-6
FAST = [
    "model=small_cnn",
    "model.width=4",
    "data=digits",
    "trainer.device=cpu",
    "trainer.batch_size=64",
    "search.trial_time_budget_s=null",
    "search.objectives=[val/acc]",
    # The bundled pruner (conf/search/default.yaml), as a user gets it, with one completed
    # trial to compare with instead of 5.
    "search.pruner.n_startup_trials=1",
    f"+search.params={{optimizer.lr:'choice({GOOD_LR},{BAD_LR})'}}",
]


def _study(prepare_study, stores: dict, name: str, epochs: int) -> StudyDriver:
    """Trial 0 trains at a good rate, trial 1 at a rate that learns nothing in a few epochs:
    small_cnn(width=4) on digits reaches val/acc ~0.6-0.9 per epoch at lr 0.1 and stays at
    chance (~0.1) at 1e-6, so trial 1 is below trial 0 at every validation."""
    overrides = [
        *FAST,
        *stores["overrides"],
        f"trainer.max_epochs={epochs}",
        "search.n_trials=2",
        f"search.study_name={name}",
    ]
    driver = prepare_study(overrides)
    driver.study.enqueue_trial({"optimizer.lr": GOOD_LR})
    driver.study.enqueue_trial({"optimizer.lr": BAD_LR})
    driver.run()
    return driver


def _trials(driver: StudyDriver):  # noqa: ANN202
    good, bad = sorted(driver.study.get_trials(), key=lambda t: t.number)
    assert good.params["optimizer.lr"] == GOOD_LR and bad.params["optimizer.lr"] == BAD_LR
    assert good.state == TrialState.COMPLETE
    return good, bad


def test_the_pruner_never_prunes_at_a_trials_only_validation(prepare_study, stores) -> None:
    # One epoch: one validation, after all the training. Pruning there saves nothing and
    # throws the result away (issue 16, point 14: it did, at step == n_warmup_steps).
    good, bad = _trials(_study(prepare_study, stores, "only", epochs=1))
    assert bad.intermediate_values[0] < good.intermediate_values[0]  # worse than the median
    # Trained to its end: complete, or (at lr 1e-6 it stays at chance level) pruned by the
    # learning check as diverged, never by the pruner.
    assert list(bad.intermediate_values) == [0]
    assert bad.state == TrialState.COMPLETE or bad.user_attrs[Attr.REASON] == "diverged"


def test_the_pruner_prunes_after_the_first_validation_before_the_last(prepare_study, stores):
    # Three epochs: not at validation 1 (n_warmup_steps: 1), at validation 2, so the last
    # is never reached.
    good, bad = _trials(_study(prepare_study, stores, "three", epochs=3))
    assert list(good.intermediate_values) == [0, 1, 2]  # steps count validations from 0
    assert bad.state == TrialState.PRUNED and bad.user_attrs[Attr.REASON] == "pruner"
    assert list(bad.intermediate_values) == [0, 1]
    assert "at validation 2 " in bad.user_attrs[Attr.MESSAGE]


def test_a_pruned_trial_records_its_memory_in_mlflow(prepare_study, stores) -> None:
    driver = _study(prepare_study, stores, "memory", epochs=3)
    good, bad = _trials(driver)
    assert bad.state == TrialState.PRUNED  # by the pruner, after its memory check
    client = MlflowClient(stores["mlflow"])
    for trial in (good, bad):
        metrics = client.get_run(trial.user_attrs[Attr.RUN_ID]).data.metrics
        peak, predicted = trial.user_attrs[Attr.PEAK_BYTES], trial.user_attrs[Attr.PREDICTED_BYTES]
        assert metrics[PEAK_BYTES] == peak > 0
        assert metrics[PREDICTED_BYTES] == predicted
        assert metrics[PREDICTION_ERROR] == pytest.approx((predicted - peak) / peak)
        assert trial.user_attrs[Attr.PREDICTION_ERROR] == pytest.approx((predicted - peak) / peak)
