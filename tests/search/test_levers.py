"""search/sampling/levers.py and the study's start: an empty search.params searches the four levers
over ranges from the model and the budget; the first trials are the fit report's largest
fitting batches; search.timeout_s ends a study on time, with a recommendation."""

from __future__ import annotations

import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState

from batchfit.search.sampling.levers import default_params, with_default_space
from tests.conftest import FAST

SMALL = ["model=small_cnn", "model.width=4", "data=digits", "trainer.device=cpu"]


def test_an_empty_space_searches_the_four_levers_up_to_what_fits(hydra_conf) -> None:
    # small_cnn(4) needs ~0.66 MiB at batch 64 in fp32 and about half that in bf16: with a
    # 1 MiB budget and the 5% margin the most frugal precision fits up to 128.
    cfg = hydra_conf([*SMALL, "search.memory_budget=1MiB", "optimizer.lr=0.08"])
    params, note = default_params(cfg)
    assert params == {
        "trainer.batch_size": "choice(8, 16, 32, 64, 128)",
        "trainer.accum_steps": "choice(1, 2, 4)",
        "trainer.precision": "choice(fp32, bf16)",  # no fast fp16 kernels on a CPU
        "optimizer.lr": "tag(log, interval(0.02, 0.32))",
    }
    assert "batch sizes up to 128: the largest predicted to fit the budget, in bf16" in note
    # Without a budget the cap is a quarter of the 1,437 training digits: 256.
    params, note = default_params(hydra_conf(SMALL))
    assert params["trainer.batch_size"] == "choice(16, 32, 64, 128, 256)" and "the cap" in note


def test_a_given_space_or_default_space_false_is_left_alone(hydra_conf) -> None:
    own = hydra_conf([*SMALL, "+search.params={trainer.batch_size:'choice(16,32)'}"])
    assert with_default_space(own) is None
    assert dict(own.search.params) == {"trainer.batch_size": "choice(16,32)"}
    off = hydra_conf([*SMALL, "search.default_space=false"])
    assert with_default_space(off) is None and not off.search.params


def test_a_study_without_params_searches_them(prepare_study, stores) -> None:
    driver = prepare_study([*SMALL, "search.memory_budget=1MiB", *stores["overrides"]])
    dists = driver.checked.space.distributions
    assert set(dists) == {
        "trainer.batch_size", "trainer.accum_steps", "trainer.precision", "optimizer.lr",
    }  # fmt: skip
    assert dists["trainer.batch_size"] == CategoricalDistribution([8, 16, 32, 64, 128])
    assert isinstance(dists["optimizer.lr"], FloatDistribution) and dists["optimizer.lr"].log
    assert "search.params is empty: searching the four levers" in driver.console.export_text()


def test_the_first_trials_are_the_fit_reports_largest_per_precision(prepare_study, stores) -> None:
    space = (
        "+search.params={trainer.batch_size:'choice(32,64,128,256)',"
        "trainer.accum_steps:'choice(1,2)',trainer.precision:'choice(fp32,bf16)',"
        "optimizer.lr:'tag(log, interval(0.01, 0.1))'}"
    )
    driver = prepare_study([*SMALL, "search.memory_budget=1MiB", space, *stores["overrides"]])
    waiting = driver.study.get_trials(states=(TrialState.WAITING,))
    # fp32 fits 64 at accumulation 1, bf16 128 (the fit report); the lr is the sampler's.
    assert [t.system_attrs["fixed_params"] for t in waiting] == [
        {"trainer.batch_size": 64, "trainer.accum_steps": 1, "trainer.precision": "fp32"},
        {"trainer.batch_size": 128, "trainer.accum_steps": 1, "trainer.precision": "bf16"},
    ]
    again = prepare_study([*SMALL, "search.memory_budget=1MiB", space, *stores["overrides"]])
    assert len(again.study.get_trials(states=(TrialState.WAITING,))) == 2  # not twice
    off = [*SMALL, "search.memory_budget=1MiB", space, "search.fit_report_first=false"]
    fresh = prepare_study([*off, *stores["overrides"], "search.study_name=off"])
    assert not fresh.study.get_trials(states=(TrialState.WAITING,))


@pytest.mark.study
def test_a_timeout_ends_the_study_after_a_completed_trial(prepare_study, stores) -> None:
    overrides = [
        *FAST, "search.n_trials=5", "search.timeout_s=0.001", "search.study_name=timeout",
        "mlflow.system_metrics=false", "+search.params={trainer.batch_size:'choice(16,64)'}",
        "search.fit_report_first=false", *stores["overrides"],
    ]  # fmt: skip
    driver = prepare_study(overrides, width=300)
    assert driver.run() is not None  # a recommendation
    assert [t.state for t in driver.study.get_trials()] == [TrialState.COMPLETE]
    said = driver.console.export_text()
    assert "search.timeout_s=0.001 has passed with no trial completed" in said
    assert "search.timeout_s=0.001 reached" in said and "1 of 5 trials trained" in said
