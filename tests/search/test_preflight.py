"""Preflight memory prediction in real studies (the driver in-process, as in test_driver.py):
oom_predicted trials, the constraint the sampler learns from, the fit report, models that
cannot be predicted, derived accumulation and a budget too small for any trial."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import optuna
import pytest
import torch
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState
from rich.console import Console
from torch import nn

from batchfit.common.checks import ConfigError
from batchfit.search.core import trial_count as budget_module
from batchfit.search.core.record import Attr
from batchfit.search.core.trial_count import num_trained, study_records
from batchfit.search.fit.tabulate import fit_report
from batchfit.search.sampling.sampler import FeasibilityFilter
from batchfit.search.study.driver import StudyDriver
from batchfit.search.study.validate import validate
from batchfit.tracking.metrics import PREDICTED_BYTES, PREDICTION_ERROR, PREDICTION_S
from batchfit.train.device.sizes import format_bytes
from batchfit.train.memory.fitting import largest_fitting_batch
from batchfit.train.memory.predict import PredictionUnsupported
from batchfit.train.memory.preflight import MARGIN_KEY, Margin, Misfit, PreflightConfig
from batchfit.train.params import EFFECTIVE_PARAM
from batchfit.train.plan import plan
from batchfit.train.workload import Workloads

FAST = [
    "model=small_cnn",
    "model.width=4",
    "data=digits",
    "trainer.max_epochs=1",
    "trainer.max_steps=4",  # past the steady-state step the prediction is compared with
    "trainer.device=cpu",
    "search.trial_time_budget_s=null",
    "search.objectives=[val/acc]",
    "search.sampler._target_=optuna.samplers.RandomSampler",
    "~search.sampler.multivariate",
]
MiB = 2**20
# small_cnn(width=4) on digits peaks at ~0.66 MB at batch 64 and ~2.6 MB at 256 (test_driver):
# under 1 MiB with the 5 % margin, 16 and 64 fit and 256 and 512 do not.
BATCHES = "+search.params={trainer.batch_size:'choice(16,64,256,512)'}"


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One MLflow database for the module (creating one runs ~6 s of migrations); each study
    records into its own experiment, named after it."""
    root = tmp_path_factory.mktemp("mlflow")
    return {"mlflow": f"sqlite:///{root}/mlflow.db", "artifacts": str(root / "artifacts")}


@pytest.fixture
def stores(tmp_path: Path, mlflow_store: dict) -> dict:
    """conftest's stores, with the module's MLflow database: a fresh Optuna one per test."""
    optuna_url = f"sqlite:///{tmp_path}/optuna.db"
    return {
        "optuna": optuna_url,
        **mlflow_store,
        "overrides": [
            f"search.storage={optuna_url}",
            f"mlflow.tracking_uri={mlflow_store['mlflow']}",
            f"mlflow.artifact_root={mlflow_store['artifacts']}",
        ],
    }


def _driver(hydra_conf, overrides: list[str], name: str = "t") -> StudyDriver:
    overrides = [*FAST, f"search.study_name={name}", *overrides]
    cfg = hydra_conf(overrides)
    console = Console(record=True, width=200)
    return StudyDriver.prepare(cfg, overrides, {"model": "small_cnn", "data": "digits"}, console)


def _runs(stores: dict, experiment: str) -> dict[str, object]:
    client = MlflowClient(stores["mlflow"])
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    # Trial runs by trial number (their names carry the outcome), the parent by its name.
    return {
        f"trial-{r.data.tags['batchfit.trial']}" if "batchfit.trial" in r.data.tags
        else r.data.tags["mlflow.runName"]: r
        for r in runs
    }  # fmt: skip


@pytest.mark.study
def test_trials_predicted_not_to_fit_are_pruned_before_training(hydra_conf, stores) -> None:
    driver = _driver(
        hydra_conf,
        [*stores["overrides"], "search.n_trials=6", "search.memory_budget=1MiB", BATCHES],
    )
    driver.run()
    # 4 configurations, 2 predicted not to fit (again at each proposal, taking no slot): the
    # 2 that fit train once each (a repeat is answered from the record) and are the study's
    # only billed trials; it ends when all 4 are known, short of search.n_trials=6.
    trials = [t for t in driver.study.get_trials() if Attr.REPEAT_OF not in t.user_attrs]
    assert {t.params["trainer.batch_size"] for t in trials} == {16, 64, 256, 512}
    predicted_oom = [t for t in trials if t.params["trainer.batch_size"] >= 256]
    trained = [t for t in trials if t.params["trainer.batch_size"] < 256]
    assert sorted(t.params["trainer.batch_size"] for t in trained) == [16, 64]
    assert num_trained(study_records(driver.study)) == len(trained) == 2
    shown = driver.console.export_text()
    assert "every one of the 4 configurations of search.params has been tried" in shown
    assert "2 trials trained of search.n_trials=6" in shown
    for t in predicted_oom:
        assert t.state == TrialState.PRUNED
        assert t.user_attrs[Attr.REASON] == "oom_predicted"
        assert t.user_attrs[Attr.PREDICTED_BYTES] > t.user_attrs[Attr.BUDGET_BYTES] == MiB
        assert Attr.PEAK_BYTES not in t.user_attrs  # never ran
        assert "predicted to need" in t.user_attrs[Attr.MESSAGE]
        # the excess with the margin that pruned it (search.preflight_margin, 5%)
        excess = t.user_attrs[Attr.PREDICTED_BYTES] * 1.05 / MiB - 1
        assert t.constraints["memory"] == pytest.approx(excess) and excess > 0
    for t in trained:
        assert _trained(t)
        assert abs(t.user_attrs[Attr.PREDICTION_ERROR]) < 0.01
        assert t.user_attrs[Attr.PEAK_BYTES] <= MiB
        assert t.constraints["memory"] <= 0
        assert t.constraints["memory"] == pytest.approx((t.user_attrs[Attr.PEAK_BYTES] - MiB) / MiB)
    assert isinstance(driver.study.sampler, FeasibilityFilter)

    runs = _runs(stores, "t")
    parent = runs.pop("t")
    for t in trials:
        metrics = runs[f"trial-{t.number}"].data.metrics
        assert metrics[PREDICTED_BYTES] == t.user_attrs[Attr.PREDICTED_BYTES]
        assert metrics[PREDICTION_S] == 0  # the fit report at study start predicted it
        if _trained(t):
            assert metrics[PREDICTION_ERROR] == pytest.approx(t.user_attrs[Attr.PREDICTION_ERROR])
        else:
            assert PREDICTION_ERROR not in metrics
            assert runs[f"trial-{t.number}"].data.tags["batchfit.prune_reason"] == "oom_predicted"
    client = MlflowClient(stores["mlflow"])
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"fit_report.json", "fit_report.txt"} <= artifacts
    text = Path(client.download_artifacts(parent.info.run_id, "fit_report.txt")).read_text()
    assert "Fit report" in text and "largest that fits" in text
    assert "OOM" in text  # 256 and 512 are marked
    assert parent.data.metrics["trials/trained"] == 2
    assert parent.data.metrics["trials/pruned_oom_predicted"] == len(predicted_oom)
    # The console shows the same table before the first trial.
    assert shown.index("Fit report") < shown.index("#0 ")


@pytest.mark.study
def test_without_preflight_the_oom_is_measured(hydra_conf, stores) -> None:
    driver = _driver(
        hydra_conf,
        [
            *stores["overrides"],
            "search.n_trials=2",
            "search.preflight=false",
            "search.memory_budget=1MiB",
            "+search.params={trainer.batch_size:'choice(64,512)'}",
        ],
        name="measured",
    )
    driver.run()
    trials = driver.study.get_trials()
    assert {t.params["trainer.batch_size"] for t in trials} == {64, 512}
    for t in trials:
        assert Attr.PREDICTED_BYTES not in t.user_attrs
        assert Attr.PREDICTION_ERROR not in t.user_attrs
        if t.params["trainer.batch_size"] == 512:
            assert t.state == TrialState.PRUNED and t.user_attrs[Attr.REASON] == "oom"
            assert t.user_attrs[Attr.PEAK_BYTES] > MiB
            assert t.constraints["memory"] > 0
        else:
            assert _trained(t) and t.constraints["memory"] <= 0
    for name, run in _runs(stores, "measured").items():
        assert PREDICTED_BYTES not in run.data.metrics, name


@pytest.mark.study
def test_without_the_oom_constraint_the_sampler_is_not_told(hydra_conf, stores) -> None:
    driver = _driver(
        hydra_conf,
        [
            *stores["overrides"],
            "search.n_trials=2",
            "search.oom_constraint=false",
            "search.memory_budget=1MiB",
            "+search.params={trainer.batch_size:'choice(16,512)'}",
        ],
        name="unconstrained",
    )
    assert not isinstance(driver.study.sampler, FeasibilityFilter)
    assert isinstance(driver.study.sampler, optuna.samplers.RandomSampler)
    driver.run()
    trials = driver.study.get_trials()
    assert {t.params["trainer.batch_size"] for t in trials} == {16, 512}
    for t in trials:
        assert t.constraints == {}
        assert Attr.VIOLATION not in t.user_attrs
        assert Attr.PREDICTED_BYTES in t.user_attrs  # still predicted, still pruned
    (oom,) = [t for t in trials if t.params["trainer.batch_size"] == 512]
    assert oom.user_attrs[Attr.REASON] == "oom_predicted"


class ItemModel(nn.Module):
    """A model that reads a value on the host in its forward: it trains, but it cannot run
    on fake tensors, so its memory cannot be predicted."""

    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 4):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, width, 3, padding=1)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        return self.head(h.mean((2, 3))) * (1.0 if h.abs().sum().item() >= 0 else 0.0)


ITEM_MODEL = "model._target_=tests.search.test_preflight.ItemModel"
NOT_PREDICTED = "memory is not predicted for this model"


@pytest.mark.study
def test_a_model_that_cannot_be_predicted_is_measured(hydra_conf, stores) -> None:
    driver = _driver(
        hydra_conf,
        [
            *stores["overrides"],
            ITEM_MODEL,
            "search.n_trials=2",
            "search.memory_budget=1MiB",
            "+search.params={trainer.batch_size:'choice(16,32)'}",
        ],
        name="item",
    )
    driver.run()
    trials = driver.study.get_trials()
    assert len(trials) == 2
    for t in trials:
        assert _trained(t)
        assert 0 < t.user_attrs[Attr.PEAK_BYTES] <= MiB
        assert Attr.PREDICTED_BYTES not in t.user_attrs
        assert t.constraints["memory"] <= 0  # measured memory still reaches the sampler
    shown = driver.console.export_text()
    assert shown.count(NOT_PREDICTED) == 1, shown
    assert "DataDependentOutputException" in shown


def test_the_fit_report_of_a_model_that_cannot_be_predicted_raises(hydra_conf) -> None:
    cfg = hydra_conf(
        [*FAST, ITEM_MODEL, "search.memory_budget=1MiB", BATCHES, "search.study_name=fit"]
    )
    checked = validate(cfg, "fit", lambda overrides: hydra_conf(overrides), open_store=False)
    assert checked.notes == []  # the predictor builds: only its steps fail
    with pytest.raises(PredictionUnsupported):
        fit_report(cfg, checked.space, checked.spec, checked.settings)


def _predicted(cfg, batch: int) -> int:
    spec = plan(cfg, cfg.search.memory_budget)
    trainer = dataclasses.replace(
        spec.trainer, batch_size=batch, accum_steps=1, effective_batch_size=None
    )
    workload = Workloads().of(cfg)
    return workload.predictor(spec, cfg.optimizer).predict(trainer, workload.num_train).peak_bytes


@pytest.mark.study
def test_derived_accumulation_splits_the_effective_batch_to_fit(hydra_conf, stores) -> None:
    overrides = [
        *stores["overrides"],
        "search.n_trials=2",
        "search.memory_budget=1MiB",
        "search.accumulation=derived",
        "+search.params={trainer.effective_batch_size:'choice(64,256)'}",
    ]
    base = hydra_conf([*FAST, *overrides])
    # The premise: 256 as one micro-batch is over the budget, 64 is within it.
    assert _predicted(base, 256) * 1.05 > MiB >= _predicted(base, 64) * 1.05
    driver = _driver(hydra_conf, overrides, name="derived")
    driver.run()
    trials = driver.study.get_trials()
    assert {t.params["trainer.effective_batch_size"] for t in trials} == {64, 256}
    for t in trials:
        effective = t.params["trainer.effective_batch_size"]
        batch, accum = t.user_attrs["trainer.batch_size"], t.user_attrs["trainer.accum_steps"]
        assert batch * accum == effective == t.user_attrs[EFFECTIVE_PARAM]
        assert _trained(t)
        assert t.user_attrs[Attr.PEAK_BYTES] <= MiB
        assert abs(t.user_attrs[Attr.PREDICTION_ERROR]) < 0.01
        # The largest divisor predicted to fit, as train.memory.fitting finds it.
        cfg = hydra_conf(
            [*FAST, *overrides, f"trainer.batch_size={effective}", "trainer.accum_steps=1"]
        )
        spec = plan(cfg, MiB)
        workload = Workloads().of(cfg)
        predictor = workload.predictor(spec, cfg.optimizer)
        found = largest_fitting_batch(predictor, spec.trainer, workload.num_train, MiB, 0.05)
        assert found is not None and found[0] == batch
        assert t.user_attrs[Attr.PREDICTED_BYTES] == found[1].peak_bytes
        if effective == 64:
            assert (batch, accum) == (64, 1)
        else:
            assert accum > 1 and _predicted(cfg, 2 * batch) * 1.05 > MiB


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["search.accumulation=derived", "+search.params={optimizer.lr:'choice(0.01,0.1)'}"],
            "search.accumulation=derived searches the effective batch size: add "
            "search.params.trainer.effective_batch_size",
        ),
        (
            [
                "search.accumulation=derived",
                "+search.params={trainer.effective_batch_size:'choice(64,256)',"
                "trainer.batch_size:'choice(16,32)'}",
            ],
            "search.params.trainer.batch_size: search.accumulation=derived sets "
            "trainer.batch_size itself",
        ),
        (
            ["+search.params={trainer.effective_batch_size:'choice(64,256)'}"],
            "search.params.trainer.effective_batch_size is searched only with "
            "search.accumulation=derived",
        ),
    ],
    ids=["derived-without-effective-batch", "derived-with-batch-size", "searched-effective-batch"],
)
def test_bad_accumulation_settings_stop_before_any_trial(hydra_conf, stores, overrides, message):
    with pytest.raises(ConfigError) as error:
        _driver(hydra_conf, [*stores["overrides"], "search.n_trials=2", *overrides], name="bad")
    assert any(p.startswith(message) for p in error.value.problems), error.value.problems
    assert optuna.get_all_study_names(stores["optuna"]) == []


def test_a_budget_below_the_training_state_stops_before_the_first_trial(hydra_conf, stores):
    overrides = [*stores["overrides"], "search.n_trials=2", "search.memory_budget=2KiB"]
    cfg = hydra_conf([*FAST, *overrides])
    spec = plan(cfg, None)
    predictor = Workloads().of(cfg).predictor(spec, cfg.optimizer)
    state = predictor.state_bytes  # parameters, gradients, momentum
    assert 2048 < state < 20_000
    smallest = _predicted(hydra_conf([*FAST, *overrides, "trainer.batch_size=1"]), 1)
    with pytest.raises(ConfigError) as error:
        _driver(hydra_conf, overrides, name="tiny")
    problem, advice = error.value.problems
    assert problem.startswith("search.memory_budget=2.0 KiB is below the ")
    # Then what would fit, predicted (search/fit/advice.py): the small CNN has no weights' dtype,
    # no LoRA and no blocks to checkpoint; one rank of FSDP over 2 still needs about as much
    sharded = _predicted(
        hydra_conf([*FAST, *overrides, "trainer.strategy=fsdp", "trainer.devices=2"]), 1
    )
    # what batch 1 needs is its peak with the margin (5% on CPU), the figure the check compares
    assert advice.startswith(
        f"What would fit batch 1 (accum_steps 1, fp32): it needs {format_bytes(smallest)} on "
        f"this machine, {format_bytes(smallest * 1.05)} with the margin of 5% to spare, over "
        "the budget of 2.0 KiB (search.memory_budget)"
    ), advice
    assert (
        f"FSDP over 2 devices: {format_bytes(sharded)} per rank of 2 on this machine "
        f"({format_bytes(sharded * 1.05)} with its 5% margin), does "
    ) in advice
    assert "None of them makes batch 1 fit" in advice
    assert "activation checkpointing (ConfigError" in advice and "Sequential has no block" in advice
    assert f"the {format_bytes(state)} that the parameters, gradients and optimizer state" in (
        problem
    )
    assert f"the smallest step (batch size 1 in fp32) needs {format_bytes(smallest)}" in problem
    assert "search.memory_budget=1MiB" in problem  # the suggested fix: 1.25 x, in whole MiB
    assert optuna.get_all_study_names(stores["optuna"]) == []


def _trained(t: optuna.trial.FrozenTrial) -> bool:
    """Trained to its end: COMPLETE, or pruned as `diverged` because a few steps of the tiny
    CNN left it at chance level (search/trial/objective.py learning_failure): its memory figures
    are the same either way."""
    if t.state == TrialState.COMPLETE:
        return True
    return t.user_attrs.get(Attr.REASON) == "diverged" and t.user_attrs[Attr.MESSAGE].startswith(
        "did not learn"
    )


LR = "optimizer.lr:'interval(0.01,0.1)'"  # a continuous key: no two proposals repeat


@pytest.mark.study
def test_proposals_predicted_not_to_fit_take_no_trial_slot(hydra_conf, stores) -> None:
    driver = _driver(
        hydra_conf,
        [
            *stores["overrides"],
            "search.n_trials=5",
            "search.memory_budget=1MiB",
            f"+search.params={{trainer.batch_size:'choice(16,64,256,512)',{LR}}}",
        ],
        name="slots",  # its own experiment in the module's MLflow store, as each study's
    )
    driver.run()
    trials = driver.study.get_trials()
    unbilled = [t for t in trials if t.user_attrs.get(Attr.REASON) == "oom_predicted"]
    trained = [t for t in trials if t not in unbilled]
    # All 5 of search.n_trials trained; the proposals predicted not to fit came on top, and
    # still reached the sampler as infeasible.
    assert len(trained) == 5 and all(_trained(t) for t in trained)
    assert unbilled, "the seed gives no proposal over the budget: the test shows nothing"
    for t in unbilled:
        assert t.params["trainer.batch_size"] >= 256 and t.constraints["memory"] > 0
    parent = _runs(stores, "slots")["slots"]
    assert parent.data.metrics["trials/trained"] == 5
    assert parent.data.metrics["trials/unbilled"] == len(unbilled)
    shown = driver.console.export_text()
    assert "5 finished trials: " in shown
    assert f"; not counted, answered without training: {len(unbilled)}" in shown
    assert shown.count("not counted in search.n_trials") == len(unbilled)


@pytest.mark.study
def test_a_space_where_nothing_fits_ends_with_a_message(hydra_conf, stores, monkeypatch) -> None:
    monkeypatch.setattr(budget_module, "MAX_UNBILLED_IN_A_ROW", 6)
    driver = _driver(
        hydra_conf,
        [
            *stores["overrides"],
            "search.n_trials=3",
            "search.memory_budget=1MiB",
            f"+search.params={{trainer.batch_size:'choice(256,512)',{LR}}}",
        ],
        name="nothing",
    )
    driver.run()
    trials = driver.study.get_trials()
    assert len(trials) == 6 and num_trained(study_records(driver.study)) == 0
    assert all(t.user_attrs[Attr.REASON] == "oom_predicted" for t in trials)
    shown = driver.console.export_text()
    assert "the last 6 proposals were all predicted not to fit or trained before" in shown
    assert "0 trials trained of search.n_trials=3" in shown


def test_a_refusal_names_the_margin_and_where_it_comes_from(hydra_conf) -> None:
    """python -m train's refusal: the peak, then the figure the run needs, peak x (1 +
    margin), with the reason when the margin comes from the kind of step, against the
    budget (36 GiB x 1.01 = 36.36 GiB; x 1.05 = 37.8 GiB)."""
    cfg = hydra_conf(["+experiment=llm_lora", "trainer.batch_size=4", "trainer.accum_steps=8",
                      "trainer.precision=bf16", "trainer.device=cpu"])  # fmt: skip
    trainer = plan(cfg, None).trainer
    GiB = 2**30
    why = "language-model LoRA steps measured within 0.71% on an H200"
    measured = Misfit(trainer, 36 * GiB, 36 * GiB, Margin(0.01, why), ())
    assert measured.describe() == (
        "trainer.batch_size=4 x trainer.accum_steps=8 in bf16 is predicted to peak at 36.0 GiB; "
        f"with search.preflight_margin=0.01 ({why}) that is 36.4 GiB, over "
        "search.memory_budget=36.0 GiB"
    )
    given = Misfit(trainer, 36 * GiB, 36 * GiB, Margin(0.05, MARGIN_KEY), ())
    assert "with search.preflight_margin=0.05 that is 37.8 GiB, over" in given.describe()


def test_the_margin_is_a_number_in_0_to_1_or_null() -> None:
    assert PreflightConfig(True, None).preflight_margin is None  # from the step's kind
    with pytest.raises(ConfigError, match=r"search.preflight_margin must be a number in "
                       r"\[0, 1\) or null, got 1.5"):  # fmt: skip
        PreflightConfig(True, 1.5)


def test_the_smallest_step_of_a_language_model_is_named_with_its_sequence_length(
    hydra_conf,
) -> None:
    """'the smallest step (batch size 1 in fp32) needs 150.1 GiB' beside the advice's
    'batch 1 (..., data.seq_len=128): it needs 150.0 GiB' read as one step with two figures:
    they are steps of two lengths (the command's and the space's shortest)."""
    from batchfit.train.run import OverBudget, check_builds

    cfg = hydra_conf(["+experiment=gpt", "data.seq_len=96", "search.memory_budget=4KiB"])
    with pytest.raises(OverBudget) as raised:
        check_builds(cfg, plan(cfg, cfg.search.memory_budget), Workloads())
    assert (
        "the smallest step (batch size 1 in fp32, data.seq_len=96) needs "
        in (raised.value.problems[0])
    )
