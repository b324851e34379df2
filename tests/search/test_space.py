"""The search-space grammar (hydra-optuna-sweeper's) and its translation to Optuna."""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from batchfit.common.checks import ConfigError
from batchfit.search.sampling.space import parse_space


def test_sweeper_grammar_maps_to_optuna_distributions() -> None:
    space = parse_space(
        {
            "trainer.batch_size": "choice(16, 32, 64)",
            "trainer.precision": "choice(fp32, bf16)",
            "trainer.accum_steps": "range(1, 9)",
            "x.step": "range(0, 10, 2)",
            "optimizer.lr": "tag(log, interval(1e-4, 1e-1))",
            "optimizer.momentum": "interval(0.8, 0.99)",
            "optimizer.weight_decay": 0.0005,
        }
    )
    d = space.distributions
    assert d["trainer.batch_size"] == CategoricalDistribution([16, 32, 64])
    assert d["trainer.precision"] == CategoricalDistribution(["fp32", "bf16"])
    # The plugin reads range's stop as included (IntUniformDistribution(start, stop)).
    assert d["trainer.accum_steps"] == IntDistribution(1, 9)
    assert d["x.step"] == IntDistribution(0, 10, step=2)
    assert d["optimizer.lr"] == FloatDistribution(1e-4, 1e-1, log=True)
    assert d["optimizer.momentum"] == FloatDistribution(0.8, 0.99)
    assert space.fixed == {"optimizer.weight_decay": "0.0005"}


def test_suggest_and_overrides_use_the_public_optuna_api() -> None:
    space = parse_space(
        {"trainer.batch_size": "choice(16, 32)", "optimizer.lr": "tag(log, interval(0.01, 0.1))"}
    )
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    trial = study.ask()
    params = space.suggest(trial)
    assert params == trial.params
    assert params["trainer.batch_size"] in (16, 32)
    assert 0.01 <= params["optimizer.lr"] <= 0.1
    overrides = space.overrides(params)
    assert overrides[0] == f"trainer.batch_size={params['trainer.batch_size']}"
    assert overrides[1].startswith("optimizer.lr=0.0")


def test_restrict_choices_drops_unsupported_values() -> None:
    space = parse_space({"trainer.precision": "choice(fp32, tf32, bf16)"})
    dropped = space.restrict_choices("trainer.precision", lambda c: c != "tf32")
    assert dropped == ["tf32"]
    assert space.distributions["trainer.precision"].choices == ("fp32", "bf16")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "interval(0.5, 0.1)",
            r"search.params.optimizer.lr: interval\(0.5, 0.1\) has low 0.5 > high 0.1; swap",
        ),
        ("tag(log, interval(0, 0.1))", r"log scale but its low bound 0.0 is not positive"),
        ("range(9, 1)", r"low 9 > high 1"),
        ("choice(1,", r"cannot parse 'choice\(1,'"),
    ],
)
def test_bad_distributions_name_the_key_and_the_fix(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_space({"optimizer.lr": text})


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as error:
        parse_space({"a": "interval(2, 1)", "b": "tag(log, interval(-1, 1))", "c": "choice(1, 2)"})
    assert len(error.value.problems) == 2
    assert "search.params.a" in str(error.value) and "search.params.b" in str(error.value)


def test_one_command_line_form_narrows_widens_adds_and_drops_searched_keys(hydra_conf) -> None:
    """`'++search.params={KEY: DIST, KEY: null}'` merges into the experiment's space."""
    cfg = hydra_conf(
        [
            "+experiment=resnet",
            "data=digits",
            "++search.params={trainer.precision:'choice(fp32)',"  # narrow
            "trainer.accum_steps:'choice(1,2,4,8)',"  # widen
            "trainer.grad_clip_norm:'choice(0.5,1.0)',"  # add
            "optimizer.lr:null}",  # drop: trials use optimizer.lr from the config
        ]
    )
    space = parse_space(cfg.search.params)
    d = space.distributions
    assert d["trainer.precision"] == CategoricalDistribution(["fp32"])
    assert d["trainer.accum_steps"] == CategoricalDistribution([1, 2, 4, 8])
    assert d["trainer.grad_clip_norm"] == CategoricalDistribution([0.5, 1.0])
    assert "optimizer.lr" not in d and "optimizer.lr" not in space.fixed
    # The experiment's other keys are untouched.
    assert d["trainer.batch_size"] == CategoricalDistribution([16, 32, 64, 128, 256, 512, 1024])
    # The same form works where nothing was searched yet.
    plain = hydra_conf(["++search.params={trainer.batch_size:'choice(16,32)'}"])
    assert parse_space(plain.search.params).distributions == {
        "trainer.batch_size": CategoricalDistribution([16, 32])
    }


@pytest.mark.study
def test_a_dropped_key_is_not_searched_by_a_study(hydra_conf, stores) -> None:
    from rich.console import Console

    from batchfit.search.study.driver import StudyDriver

    overrides = [
        *stores["overrides"],
        "model=small_cnn",
        "model.width=4",
        "trainer.max_epochs=1",
        "search.n_trials=1",
        "search.study_name=dropped",
        "search.memory_budget=null",
        "++search.params={trainer.batch_size:'choice(32)',optimizer.lr:null}",
    ]
    cfg = hydra_conf(overrides)
    driver = StudyDriver.prepare(cfg, overrides, {"model": "small_cnn"}, Console(quiet=True))
    driver.run()
    (trial,) = driver.study.get_trials()
    assert trial.params == {"trainer.batch_size": 32}
    assert trial.user_attrs["optimizer.lr"] == cfg.optimizer.lr  # the config's own value
