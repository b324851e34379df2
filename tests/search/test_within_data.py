"""A search space kept within its data (search/study/within_data.py): searched batches larger
than the training set dropped before trial 0 and said, a space with none left refused, and a
trial whose micro-batch times accumulation outgrows the data pruned as `over_data` before it
trains, not counted in search.n_trials. The training side's rule (train/batches.py
`larger_than_data`) refuses `python -m train` alike (tests/test_bad_input.py)."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient
from optuna.distributions import CategoricalDistribution, IntDistribution
from rich.console import Console

from batchfit.common.checks import ConfigError
from batchfit.search.core.record import OVER_DATA, TrialRecord
from batchfit.search.sampling.space import parse_space
from batchfit.search.study.driver import StudyDriver
from batchfit.search.study.within_data import keep_within_data
from batchfit.train.config import TrainerConfig
from batchfit.train.params import BATCH_KEY, EFFECTIVE_KEY

FAST = ["model=small_cnn", "model.width=4", "data=digits", "trainer.max_epochs=1"]


def _space(params: dict):  # noqa: ANN202
    return parse_space(params)


def test_searched_batches_beyond_the_data_are_dropped_and_said() -> None:
    space = _space({BATCH_KEY: "choice(64, 1024, 2048)"})
    notes, problems = keep_within_data(space, TrainerConfig(), 1438, "data=digits")
    assert problems == []
    assert notes == [
        "trainer.batch_size: dropped 2048 (larger than the 1438 training samples of data=digits)"
    ]
    assert space.distributions[BATCH_KEY] == CategoricalDistribution([64, 1024])


def test_the_least_accumulation_and_the_devices_count() -> None:
    space = _space({BATCH_KEY: "choice(64, 512, 1024)", "trainer.accum_steps": "choice(2, 4)"})
    trainer = TrainerConfig(devices=2, strategy="ddp")
    notes, _ = keep_within_data(space, trainer, 1438, "data=digits")
    # 1438 // 2 devices = 719 a device's step; at accumulation 2 at least, 359 a micro-batch
    assert notes == [
        "trainer.batch_size: dropped 512, 1024 (x2 steps: larger than the 1438 training "
        "samples of data=digits over trainer.devices=2)"
    ]


def test_an_integer_range_is_cut_at_the_data() -> None:
    space = _space({EFFECTIVE_KEY: "range(16, 4096, step=16)"})
    notes, problems = keep_within_data(space, TrainerConfig(), 1000, "data=x")
    assert problems == []
    assert space.distributions[EFFECTIVE_KEY] == IntDistribution(16, 992, step=16)
    assert notes == ["trainer.effective_batch_size: searched up to 992, not 4096 (larger than "
                     "the 1000 training samples of data=x)"]  # fmt: skip


@pytest.mark.parametrize(
    ("params", "said"),
    [
        ({BATCH_KEY: "choice(2048, 4096)"}, "search.params.trainer.batch_size: every value"),
        ({"trainer.accum_steps": "choice(2, 4)"}, "the smallest step the space draws, 2048"),
    ],
)
def test_a_space_with_nothing_within_the_data_is_refused(params: dict, said: str) -> None:
    space = _space(params)
    trainer = TrainerConfig(batch_size=1024)  # the command line's, where not searched
    _, problems = keep_within_data(space, trainer, 1438, "data=digits")
    assert len(problems) == 1 and problems[0].startswith(said), problems


def test_a_study_refuses_a_space_beyond_its_data_before_trial_0(hydra_conf, stores) -> None:
    overrides = [
        *FAST, *stores["overrides"], "search.study_name=big",
        "++search.params={trainer.batch_size:'choice(2048,4096)'}",
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="every value is larger than the 1438 training samples"):
        StudyDriver.prepare(hydra_conf(overrides), overrides, {}, Console(record=True))


@pytest.mark.study
def test_a_trial_beyond_the_data_is_pruned_before_it_trains_and_not_counted(
    hydra_conf, stores
) -> None:
    overrides = [
        *FAST, *stores["overrides"], "search.study_name=over", "search.n_trials=2",
        "search.memory_budget=1GiB",
        "search.sampler._target_=optuna.samplers.GridSampler",
        "++search.params={trainer.batch_size:'choice(1024)',trainer.accum_steps:'choice(2,1)'}",
    ]  # fmt: skip
    driver = StudyDriver.prepare(hydra_conf(overrides), overrides, {}, Console(record=True))
    driver.run()
    records = {r.number: r for r in map(TrialRecord.of, driver.study.trials)}
    over = [r for r in records.values() if r.outcome.reason == OVER_DATA]
    trained = [r for r in records.values() if r.is_trained]
    assert [(r.batch_size, r.accum_steps) for r in over] == [(1024, 2)]
    assert [(r.batch_size, r.accum_steps) for r in trained] == [(1024, 1)]
    assert over[0].is_unbilled and over[0].state == "PRUNED"
    assert "1024 x trainer.accum_steps=2 = 2048 samples a step is larger than" in (
        over[0].outcome.message
    )
    assert over[0].memory_violation == 1.0  # infeasible to the sampler
    client = MlflowClient(stores["mlflow"])
    runs = client.search_runs([client.get_experiment_by_name("over").experiment_id])
    assert any(r.info.run_name.endswith("PRUNED over_data") for r in runs)


def test_the_searching_line_shows_the_space_as_searched(hydra_conf, stores) -> None:
    """Not the values as typed: 2048 and 4096 were dropped, and tf32 on a CPU."""
    overrides = [
        *FAST, *stores["overrides"], "search.study_name=said",
        "++search.params={trainer.batch_size:'choice(64,2048,4096)',"
        "trainer.precision:'choice(fp32,tf32)',optimizer.lr:'tag(log, interval(0.01, 0.2))'}",
    ]  # fmt: skip
    console = Console(record=True, width=300)
    StudyDriver.prepare(hydra_conf(overrides), overrides, {}, console)
    said = console.export_text()
    assert "trainer.batch_size: dropped 2048, 4096 (larger than the 1438" in said
    assert (
        "Searching trainer.batch_size=choice(64), trainer.precision=choice(fp32), "
        "optimizer.lr=tag(log, interval(0.01, 0.2))\n"
    ) in said
