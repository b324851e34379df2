"""search/results/speed_check.py in a study: at its end the candidates' geometries are timed side
by side, kept in the study, and the recommendation, summary and best.yaml say how the recommended
one compares with the runner-up."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.distributions import CategoricalDistribution
from optuna.trial import create_trial

from batchfit.search.results import speed_check
from batchfit.search.results.speed_check import SPEED_ATTR
from tests.conftest import FAST

pytestmark = pytest.mark.study


def test_a_study_times_its_candidates_and_recommends_by_that(prepare_study, stores) -> None:
    overrides = [
        *FAST,  # small_cnn(4) on digits, one epoch, on the CPU
        "search.trial_time_budget_s=null",
        "search.objectives=[val/acc,throughput/samples_per_sec]",
        "search.recommend.tolerance=1.0",  # every completed trial is a candidate
        "search.n_trials=3",
        "search.study_name=speed",
        "mlflow.system_metrics=false",
        # 30 steps at a high rate: both batch sizes learn (a trial left at chance level is
        # pruned as diverged, never a candidate: search/trial/objective.py learning_failure)
        "trainer.max_epochs=null",
        "trainer.max_steps=30",
        "+search.params={trainer.batch_size:'choice(16,512)',"
        "optimizer.lr:'tag(log, interval(0.1, 0.5))'}",
        *stores["overrides"],
    ]
    driver = prepare_study(overrides, width=400)
    driver.study.enqueue_trial({"trainer.batch_size": 16, "optimizer.lr": 0.3})
    driver.study.enqueue_trial({"trainer.batch_size": 512, "optimizer.lr": 0.3})
    driver.run()
    checked = driver.study.user_attrs[speed_check.SPEED_ATTR]
    assert set(checked["geometries"]) == {"16x1 fp32", "512x1 fp32"}
    assert all(len(g["samples_per_sec"]) == 3 for g in checked["geometries"].values())
    said = driver.console.export_text()
    assert "Speed check: timing 2 candidate configurations side by side" in said
    # Said once: in the summary's table (and the recommendation), not also as lines while
    # it timed them.
    assert "Speed check (the candidates timed side by side)" in said
    assert len([line for line in said.splitlines() if "over 3 rounds, spread" in line]) == 1
    # 512 samples a step against 16: faster in every round, so it wins whatever the accuracy.
    rec = driver.results.recommendation(driver.study)
    assert rec.trial.params["trainer.batch_size"] == 512
    assert rec.verdict.beyond_noise and rec.verdict.runner_up == "16x1 fp32"
    assert "the runner-up 16x1 fp32" in said and "beyond the measured spread" in said
    parent = MlflowClient(stores["mlflow"]).get_run(driver.parent.log.run_id)
    summary = Path(MlflowClient(stores["mlflow"]).download_artifacts(
        parent.info.run_id, "summary.md"
    )).read_text()  # fmt: skip
    assert "speed check: 512x1 fp32" in summary


def test_a_check_with_one_candidate_says_it_is_skipped() -> None:
    """One candidate configuration (a study of a few trials, as the quick start's on a busy
    machine): nothing to time it against, and the check says so instead of nothing."""
    study = optuna.create_study(directions=["maximize"])
    study.add_trial(
        create_trial(
            value=0.9,
            params={"trainer.batch_size": 64},
            distributions={"trainer.batch_size": CategoricalDistribution([64, 128])},
            user_attrs={
                "trainer.batch_size": 64,
                "trainer.accum_steps": 1,
                "trainer.precision": "fp32",
            },
        )  # fmt: skip
    )
    said: list[str] = []

    def configure(trial: object) -> None:
        raise AssertionError("nothing is timed")

    assert speed_check.check(study, study.trials, configure, said.append) == {}
    assert said == [
        "Speed check skipped: one candidate configuration, 64x1 fp32 (the completed trials "
        "within search.recommend's tolerance of the best, one per configuration): nothing "
        "to time it against, so the recommendation goes by the trials' own throughput"
    ]
    assert SPEED_ATTR not in study.user_attrs
