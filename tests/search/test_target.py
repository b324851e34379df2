"""Time to accuracy (`search.target`, `time/to_target_s`): the target parsed and checked
against the task's metrics, a trial stopped at the validation that reaches it with the
training seconds until then, and one that ends short of it pruned as missed_target."""

from __future__ import annotations

import pytest
import torch
from optuna.trial import TrialState
from rich.console import Console

from batchfit.common.checks import ConfigError
from batchfit.search.core.record import Attr
from batchfit.search.core.study_config import OBJECTIVE_METRICS, SearchConfig, Target
from batchfit.search.study.driver import StudyDriver
from batchfit.tracking.metrics import TO_TARGET_S, TRAIN_S, VAL_ACC
from batchfit.train.config import TrainerConfig
from batchfit.train.data import Splits
from batchfit.train.loop import Run, fit
from batchfit.train.lr import constant
from batchfit.train.measure.memory import MemoryMeter
from batchfit.train.step import Hooks
from batchfit.train.tasks import Classification, LanguageModel

CPU = torch.device("cpu")


def test_a_target_is_parsed_and_checked_against_the_task() -> None:
    target = Target.parse("val/acc >= 0.95", OBJECTIVE_METRICS)
    assert (target.metric, target.op, target.value) == (VAL_ACC, ">=", 0.95)
    assert target.met(0.95) and not target.met(0.9499) and not target.met(None)
    assert Target.parse("val/loss<=0.3", OBJECTIVE_METRICS).met(0.29)
    with pytest.raises(ConfigError, match="val/loss is minimized, .* write val/loss<=0.3"):
        Target.parse("val/loss>=0.3", OBJECTIVE_METRICS)
    with pytest.raises(ConfigError, match="'throughput/samples_per_sec' is not a validation"):
        Target.parse("throughput/samples_per_sec>=100", OBJECTIVE_METRICS)
    with pytest.raises(ConfigError, match="'high' is not a number"):
        Target.parse("val/acc>=high", OBJECTIVE_METRICS)
    with pytest.raises(ConfigError, match="is not METRIC>=VALUE or METRIC<=VALUE"):
        Target.parse("val/acc=0.9", OBJECTIVE_METRICS)


@pytest.mark.parametrize(
    ("task", "text", "said"),
    [
        (Classification(), "val/acc>=2", "val/acc is at most 1, so no trial can reach 2; give a "
         "value between 0 and 1"),
        (Classification(), "val/loss<=-0.5", "val/loss is at least 0, so no trial can reach "
         "-0.5; give a value of 0 or more"),
        (LanguageModel(), "val/perplexity<=0.9", "val/perplexity is at least 1"),
    ],
)  # fmt: skip
def test_a_target_beyond_the_metrics_range_is_refused(task, text: str, said: str) -> None:
    """`val/acc>=2` trained two trials and exited 0 with no answer, advising more epochs."""
    with pytest.raises(ConfigError) as refused:
        Target.parse(text, task.directions(), task.ranges())
    assert said in refused.value.problems[0]


def test_a_target_at_the_edge_of_the_range_and_a_users_unbounded_loss_are_accepted() -> None:
    task = Classification()
    assert Target.parse("val/acc>=1", task.directions(), task.ranges()).value == 1.0

    class Elbo(Classification):
        loss_range = (None, None)  # a loss of one's own may be negative

    assert Target.parse("val/loss<=-3", task.directions(), Elbo().ranges()).value == -3.0


def test_a_study_refuses_a_target_beyond_its_range_before_trial_0(prepare_study) -> None:
    with pytest.raises(ConfigError) as refused:
        prepare_study(["search.target='val/acc>=2'", "search.objectives=[time/to_target_s]"])
    # one problem: the target's, not also "time/to_target_s needs search.target"
    (problem,) = refused.value.problems
    assert "val/acc is at most 1" in problem


def test_time_to_target_as_an_objective_needs_a_target() -> None:
    with pytest.raises(ConfigError, match="time/to_target_s needs search.target"):
        SearchConfig("s", "sqlite://", 1, None, (TO_TARGET_S,), None, None)


def test_a_validation_hook_can_end_the_run() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, 1, 1, generator=gen), torch.randint(0, 2, (64,), generator=gen)
    data = Splits(x, y, x, y, 2)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # CPU runs measure the memory of steps 0 and 1 off the clock: timed from step 2 on.
    # (no noise-scale window of split steps, which would take steps 2-8 off the clock too)
    cfg = TrainerConfig(
        batch_size=8, max_epochs=3, val_every_steps=3, warmup_steps=0, noise_scale_window=0
    )
    seen = []

    def on_eval(step: int, metrics: dict) -> bool:
        seen.append((step, metrics[TRAIN_S]))
        return step == 9

    result = fit(Run(
        model, optimizer, constant(optimizer, 24), data, cfg, CPU, MemoryMeter(CPU, None),
        Hooks(on_eval=on_eval),
    ))  # fmt: skip
    assert [step for step, _ in seen] == [3, 6, 9]
    assert result.num_steps == 9 and len(result.evals) == 3
    assert 0 < seen[0][1] <= seen[1][1] <= seen[2][1]  # training seconds never go back
    assert seen[2][1] >= result.timed_seconds  # the clock's seconds, and the steps off it
    assert result.timed_steps == 9 - 2


@pytest.mark.study
def test_a_study_stops_each_trial_at_the_target_and_prunes_those_that_miss(
    hydra_conf, stores
) -> None:
    overrides = [
        "model=small_cnn",
        "model.width=8",
        "data=digits",
        "trainer.max_epochs=3",
        "trainer.device=cpu",
        "search.trial_time_budget_s=null",
        "search.study_name=target",
        "search.n_trials=4",
        "search.target='val/acc>=0.85'",
        "search.objectives=[time/to_target_s,val/acc]",
        "mlflow.system_metrics=false",
        # lr 0.001 cannot learn digits in 3 epochs; 0.3 gets there within the first epoch
        "+search.params={optimizer.lr:'choice(0.001, 0.3)',trainer.batch_size:'choice(16, 32)'}",
        *stores["overrides"],
    ]
    cfg = hydra_conf(overrides)
    console = Console(record=True, width=200)
    driver = StudyDriver.prepare(cfg, overrides, {"model": "small_cnn", "data": "digits"}, console)
    driver.run()
    trials = [t for t in driver.study.get_trials() if Attr.REPEAT_OF not in t.user_attrs]
    assert len(trials) == 4  # the 4 configurations, each trained once
    assert {t.params["optimizer.lr"] for t in trials} == {0.001, 0.3}
    for t in trials:
        if t.params["optimizer.lr"] == 0.001:
            assert t.state == TrialState.PRUNED and t.user_attrs[Attr.REASON] == "missed_target"
            assert "short of search.target val/acc>=0.85" in t.user_attrs[Attr.MESSAGE]
        else:
            assert t.state == TrialState.COMPLETE
            figures = t.user_attrs[Attr.METRICS]
            assert figures[VAL_ACC] >= 0.85  # stopped at the validation that reached it
            assert t.values[0] == figures[TO_TARGET_S] > 0
    text = console.export_text()
    assert "target in" in text
