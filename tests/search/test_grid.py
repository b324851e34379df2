"""Grid and random search from config (`search/sampler=grid | random | tpe`): the grid comes
from search.params, a continuous key is refused with points to use, TPE-only settings of an
experiment are left out (and said), and a grid study ends when every point was proposed."""

from __future__ import annotations

import itertools

import optuna
import pytest
from omegaconf import OmegaConf
from optuna.trial import TrialState
from rich.console import Console

from batchfit.common.checks import ConfigError
from batchfit.search.core.record import Attr
from batchfit.search.sampling.sampler import build_sampler, grid_of
from batchfit.search.sampling.space import parse_space
from batchfit.search.study.driver import StudyDriver
from batchfit.search.study.validate import validate

FAST = [
    "model=small_cnn",
    "model.width=4",
    "data=digits",
    "trainer.max_epochs=1",
    "trainer.device=cpu",
    "search.trial_time_budget_s=null",
    "search.objectives=[val/acc]",
    "mlflow.system_metrics=false",
]


def test_the_grid_is_every_value_of_every_discrete_key() -> None:
    space = parse_space(
        {
            "trainer.batch_size": "choice(16, 64)",
            "trainer.accum_steps": "range(1, 4)",
            "model.width": "range(2, 8, step=3)",
            "trainer.precision": "choice(fp32, bf16)",
        }
    )
    assert grid_of(space) == {
        "trainer.batch_size": [16, 64],
        "trainer.accum_steps": [1, 2, 3, 4],
        "model.width": [2, 5, 8],
        "trainer.precision": ["fp32", "bf16"],
    }


def test_a_continuous_key_is_refused_with_points_to_give_instead() -> None:
    space = parse_space(
        {"optimizer.lr": "tag(log, interval(0.001, 0.1))", "trainer.batch_size": "choice(8)"}
    )
    with pytest.raises(ConfigError) as error:
        grid_of(space)
    message = str(error.value)
    assert "search.params.optimizer.lr is continuous (log interval 0.001..0.1)" in message
    # Log-spaced points of the interval, ends included, as a choice to paste.
    assert "optimizer.lr: choice(0.001, 0.0046, 0.022, 0.1)" in message
    assert "search/sampler=tpe or random" in message


def test_tpe_settings_of_an_experiment_are_left_out_for_another_sampler_and_said() -> None:
    space = parse_space({"trainer.batch_size": "choice(16, 64)"})
    node = OmegaConf.create(
        {"_target_": "optuna.samplers.RandomSampler", "seed": 3, "n_startup_trials": 6}
    )
    sampler, notes = build_sampler(node, space)
    assert isinstance(sampler, optuna.samplers.RandomSampler)
    assert notes == ["search.sampler: n_startup_trials left out: settings of TPE, not of "
                     "RandomSampler"]  # fmt: skip
    typo = OmegaConf.create({"_target_": "optuna.samplers.TPESampler", "n_startup_trails": 6})
    with pytest.raises(ConfigError, match="TPESampler takes no n_startup_trails; it takes"):
        build_sampler(typo, space)


def test_validate_refuses_a_grid_over_an_interval_before_any_trial(hydra_conf, tmp_path) -> None:
    overrides = [
        "+experiment=resnet",
        "data=digits",
        "search/sampler=grid",
        f"search.storage=sqlite:///{tmp_path}/o.db",
    ]
    cfg = hydra_conf(overrides)
    with pytest.raises(ConfigError, match=r"search.params.optimizer.lr is continuous"):
        validate(cfg, "grid", lambda extra: hydra_conf([*overrides, *extra]), open_store=False)


@pytest.mark.parametrize("sampler", ["grid", "random"])
@pytest.mark.study
def test_a_study_runs_with_the_sampler_from_config(hydra_conf, stores, sampler: str) -> None:
    overrides = [
        *FAST,
        *stores["overrides"],
        f"search/sampler={sampler}",
        f"search.study_name={sampler}",
        "search.n_trials=7",
        '++search.params={trainer.batch_size:"choice(16,64)",trainer.accum_steps:"choice(1,2)"}',
    ]
    cfg = hydra_conf(overrides)
    console = Console(record=True, width=200)
    driver = StudyDriver.prepare(cfg, overrides, {"model": "small_cnn", "data": "digits"}, console)
    driver.run()
    trials = driver.study.get_trials()
    configs = [(t.params["trainer.batch_size"], t.params["trainer.accum_steps"]) for t in trials]
    text = console.export_text()
    if sampler == "grid":
        # Each of the 4 points once, then the study ends below search.n_trials=7.
        assert sorted(configs) == sorted(itertools.product([16, 64], [1, 2]))
        assert all(t.state == TrialState.COMPLETE for t in trials)
        assert "grid of 4 configurations from search.params" in text
        assert "the grid is exhausted" in text
    else:
        # Random proposes repeats; each configuration trains once all the same, and the study
        # ends when all 4 are known, below search.n_trials=7.
        trained = [
            c for c, t in zip(configs, trials, strict=True) if Attr.REPEAT_OF not in t.user_attrs
        ]
        assert sorted(trained) == sorted(itertools.product([16, 64], [1, 2]))
        assert "every one of the 4 configurations of search.params has been tried" in text
        assert isinstance(driver.study.sampler.base, optuna.samplers.RandomSampler)
