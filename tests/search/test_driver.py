"""Studies run in-process through the real driver: states, reasons, records, resume."""

from __future__ import annotations

import gc
import shlex
from pathlib import Path

import optuna
import pytest
import torch
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState
from rich.console import Console

from batchfit.common.checks import ConfigError
from batchfit.search.core.record import Attr
from batchfit.search.fit.render import summary_lines
from batchfit.search.fit.report import Cell, FitReport
from batchfit.search.study.driver import PARENT_ATTR, StudyDriver, located
from batchfit.search.trial.stopping import PROBE_MARGIN, Prune, TimeBudget
from batchfit.tracking.metrics import BUDGET_BYTES, PEAK_BYTES, THROUGHPUT_SAMPLES, VAL_ACC

FAST = [
    "model=small_cnn",
    "model.width=4",
    "data=digits",
    "trainer.max_epochs=1",
    "trainer.device=cpu",
    "search.trial_time_budget_s=null",
    "search.objectives=[val/acc]",
    "search.sampler._target_=optuna.samplers.RandomSampler",
    "~search.sampler.multivariate",
]


def _driver(hydra_conf, overrides: list[str], name: str = "t") -> StudyDriver:
    overrides = [*FAST, f"search.study_name={name}", *overrides]
    cfg = hydra_conf(overrides)
    console = Console(record=True, width=200)
    return StudyDriver.prepare(cfg, overrides, {"model": "small_cnn", "data": "digits"}, console)


def _trials_by_number(study: optuna.Study) -> dict[int, optuna.trial.FrozenTrial]:
    return {t.number: t for t in study.get_trials()}


def _mlflow_runs(stores: dict, experiment: str) -> list:
    client = MlflowClient(stores["mlflow"])
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id], max_results=1000)


@pytest.mark.study
def test_oom_trials_are_pruned_with_reason_and_memory_figures(hydra_conf, stores) -> None:
    # small_cnn(width=4) on digits peaks at ~0.66 MB at batch 64 and ~2.6 MB at 256
    # (measured by the CPU tracker), so a 1 MiB budget fits 16/64 and not 256/512.
    # The preflight prediction is off: this is the measured OOM path. The space has 4
    # configurations: each trains once, repeats are answered from the record, and the study
    # ends when all 4 are known, short of its 6 trials.
    driver = _driver(
        hydra_conf,
        [
            *stores["overrides"],
            "search.preflight=false",
            "search.n_trials=6",
            "search.memory_budget=1MiB",
            "+search.params={trainer.batch_size:'choice(16,64,256,512)'}",
        ],
    )
    driver.run()
    study = driver.study
    repeats = [t for t in study.get_trials() if Attr.REPEAT_OF in t.user_attrs]
    trials = [t for t in study.get_trials() if Attr.REPEAT_OF not in t.user_attrs]
    assert sorted(t.params["trainer.batch_size"] for t in trials) == [16, 64, 256, 512]
    # The seeded random sampler (seed 0) draws a configuration again before it has drawn all
    # 4: without a repeat the loop below checks nothing.
    assert repeats, "no trial repeated an earlier configuration: the repeat path went untested"
    for repeat in repeats:  # same configuration, same outcome, nothing trained
        earlier = study.trials[repeat.user_attrs[Attr.REPEAT_OF]]
        assert earlier.params == repeat.params and earlier.state == repeat.state
        assert earlier.values == repeat.values and earlier.constraints == repeat.constraints
        assert Attr.PEAK_BYTES not in repeat.user_attrs and Attr.RUN_ID not in repeat.user_attrs
    by_batch = {}
    for t in trials:
        batch = t.params["trainer.batch_size"]
        by_batch.setdefault(batch, set()).add(t.state)
        if batch >= 256:
            assert t.state == TrialState.PRUNED
            assert t.user_attrs[Attr.REASON] == "oom"
            assert t.user_attrs[Attr.PEAK_BYTES] > t.user_attrs[Attr.BUDGET_BYTES] == 2**20
            assert t.user_attrs["trainer.precision"] == "fp32"
            assert t.user_attrs["trainer.accum_steps"] == 1
        else:
            assert t.state == TrialState.COMPLETE
            assert t.user_attrs[Attr.PEAK_BYTES] <= 2**20
    assert any(b >= 256 for b in by_batch) and any(b < 256 for b in by_batch)

    runs = {
        f"trial-{r.data.tags['batchfit.trial']}" if "batchfit.trial" in r.data.tags
        else r.data.tags["mlflow.runName"]: r
        for r in _mlflow_runs(stores, "t")
    }  # fmt: skip
    parent = runs.pop("t")
    assert study.user_attrs[PARENT_ATTR] == parent.info.run_id
    assert parent.data.metrics["trials/trained"] == 4
    assert parent.data.metrics["trials/unbilled"] == len(repeats)
    assert parent.data.params["search.memory_budget"] == "1MiB"
    assert len(runs) == 4  # a repeat has no run of its own
    for t in trials:
        run = runs[f"trial-{t.number}"]
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.info.run_id == t.user_attrs[Attr.RUN_ID]
        assert run.data.params["trainer.batch_size"] == str(t.params["trainer.batch_size"])
        assert run.data.metrics[BUDGET_BYTES] == 2**20
        assert PEAK_BYTES in run.data.metrics
        assert run.data.tags["batchfit.state"] == t.state.name
        if t.state == TrialState.PRUNED:
            assert run.data.tags["batchfit.prune_reason"] == "oom"
            assert VAL_ACC not in run.data.metrics
        else:
            assert 0 <= run.data.metrics[VAL_ACC] <= 1
            assert run.data.metrics[THROUGHPUT_SAMPLES] > 0


def _live_tensor_bytes() -> int:
    gc.collect()
    total = 0
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                total += obj.untyped_storage().nbytes()
        except Exception:  # noqa: BLE001, S112 - objects that are not real tensors
            continue
    return total


@pytest.mark.study
def test_twenty_oom_trials_in_a_row_leave_memory_at_baseline(hydra_conf, stores) -> None:
    driver = _driver(
        hydra_conf,
        [
            *stores["overrides"],
            "search.n_trials=20",
            "search.preflight=false",  # real (accounted) OOMs, not predicted ones
            "search.memory_budget=64KiB",
            # a continuous lr: 20 configurations, none a repeat of another
            "+search.params={trainer.batch_size:'choice(256,512)',optimizer.lr:'interval(0.01,0.1)'}",
        ],
        name="oom20",
    )
    # Warm everything up (dataset cache, allocator) with one trial, then take the baseline.
    seen: list[int] = []
    baseline = {}

    def check(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        assert trial.user_attrs[Attr.REASON] == "oom"
        live = _live_tensor_bytes()
        baseline.setdefault("bytes", live)
        seen.append(live)

    original = driver.study.optimize

    def optimize(*args, **kwargs):
        kwargs["callbacks"] = [*kwargs["callbacks"], check]
        return original(*args, **kwargs)

    driver.study.optimize = optimize
    driver.run()
    assert len(seen) == 20
    # Identical after every OOM trial: nothing of a failed trial survives it.
    assert all(live == baseline["bytes"] for live in seen), seen
    states = {t.state for t in driver.study.get_trials()}
    assert states == {TrialState.PRUNED}


@pytest.mark.study
def test_a_failing_trial_is_recorded_and_the_study_goes_on(hydra_conf, stores) -> None:
    # model.width=0 makes the model builder fail at build time (Conv2d with 0 channels).
    driver = _driver(
        hydra_conf,
        [
            *stores["overrides"],
            "search.n_trials=4",
            "+search.params={model.width:'choice(0,4)',optimizer.lr:'interval(0.01,0.1)'}",
        ],
        name="fail",
    )
    driver.run()
    trials = driver.study.get_trials()
    assert len(trials) == 4
    failed = [t for t in trials if t.params["model.width"] == 0]
    ok = [t for t in trials if t.params["model.width"] == 4]
    assert failed and ok
    assert all(t.state == TrialState.FAIL and Attr.ERROR in t.user_attrs for t in failed)
    assert all(t.state == TrialState.COMPLETE for t in ok)
    runs = {r.info.run_id: r for r in _mlflow_runs(stores, "fail")}
    for t in failed:
        run = runs[t.user_attrs[Attr.RUN_ID]]
        assert run.info.status == "FAILED"
        assert run.data.tags["batchfit.state"] == "FAIL"


@pytest.mark.study
def test_diverged_and_slow_trials_are_pruned_with_their_reason(hydra_conf, stores) -> None:
    driver = _driver(
        hydra_conf,
        [
            *stores["overrides"],
            "search.n_trials=2",
            "optimizer.lr=1e12",
            "trainer.log_every_steps=1",
        ],
        name="diverge",
    )
    driver.run()
    (trial, *_) = driver.study.get_trials()
    assert trial.state == TrialState.PRUNED
    assert trial.user_attrs[Attr.REASON] == "diverged"
    message = trial.user_attrs[Attr.MESSAGE]
    assert "train loss is nan" in message or "inf" in message

    slow = _driver(
        hydra_conf,
        [*stores["overrides"], "search.n_trials=1", "search.trial_time_budget_s=0.001"],
        name="slow",
    )
    slow.run()
    (trial,) = slow.study.get_trials()
    assert trial.state == TrialState.PRUNED and trial.user_attrs[Attr.REASON] == "slow"
    assert "search.trial_time_budget_s" in trial.user_attrs[Attr.MESSAGE]
    # Stopped by the probe, before its first step: not by the per-step check, which would
    # also say `slow` after paying for a step (its memory check sets peak_bytes).
    assert trial.user_attrs[Attr.MESSAGE].startswith("a probe step projects")
    assert Attr.PEAK_BYTES not in trial.user_attrs


@pytest.mark.study
def test_a_trial_that_trained_without_learning_is_pruned_as_diverged(hydra_conf, stores) -> None:
    """optimizer.lr=1e-30: the run trains to its end with its weights as they started (each
    update is below a float32 weight's resolution), so its validation loss stays at its
    initial one, no better than a uniform guess's; pruned as diverged (counted and shown,
    never recommended)."""
    still = ["search.n_trials=1", "optimizer.lr=1e-30", "trainer.val_every_steps=2"]
    driver = _driver(hydra_conf, [*stores["overrides"], *still], name="still")
    driver.run()
    (trial,) = driver.study.get_trials()
    assert trial.state == TrialState.PRUNED
    assert trial.user_attrs[Attr.REASON] == "diverged"
    message = trial.user_attrs[Attr.MESSAGE]
    # the seeded initial weights' loss: 2.318 on digits, above ln 10 = 2.303
    assert message.startswith("did not learn: val/loss"), message
    assert "no better than a uniform guess over 10 classes (ln 10 = 2.303)" in message
    assert driver.study.best_trials == []


@pytest.mark.study
def test_resume_runs_to_n_trials_without_duplicates(hydra_conf, stores) -> None:
    common = [
        *stores["overrides"],
        "+search.params={trainer.batch_size:'choice(16,32,64)',optimizer.lr:'interval(0.01,0.1)'}",
    ]
    first = _driver(hydra_conf, [*common, "search.n_trials=2"], name="resume")
    assert first.study.trials[0].state == TrialState.WAITING  # the fit report's first trial
    first.run()
    # New, though the fit report's first trial waited in it before the first ran.
    assert "Study resume in sqlite:" in (said := first.console.export_text())
    assert ": new, 2 trials to train; MLflow" in said  # no guess at another directory
    # said before the fit report (its title starts "Fit report for")
    assert said.index("Study resume in") < said.index("Fit report for")
    second = _driver(hydra_conf, [*common, "search.n_trials=5"], name="resume")
    second.run()
    assert ": resumed: 2 of 5 trials trained; MLflow" in second.console.export_text()
    again = _driver(hydra_conf, [*common, "search.n_trials=5"], name="resume")
    again.run()  # already finished: runs nothing
    trials = again.study.get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3, 4]
    # Its reused decision counts the trials as the summary does (it said 17 against 12).
    said = again.console.export_text()
    assert "from the same 5 finished trials: its speed check" in said
    assert "5 finished trials: 5 COMPLETE" in said
    runs = _mlflow_runs(stores, "resume")
    parents = [r for r in runs if r.data.tags.get("batchfit.role") == "study"]
    assert len(parents) == 1
    assert len(runs) == 1 + 5
    assert parents[0].data.metrics["trials/trained"] == 5
    assert parents[0].info.status == "FINISHED"


@pytest.mark.study
def test_resume_with_another_fixed_config_is_refused(hydra_conf, stores) -> None:
    _driver(hydra_conf, [*stores["overrides"], "search.n_trials=1"], name="fixed").run()
    with pytest.raises(
        ConfigError, match=r"(?s)trainer.max_epochs was 1, now 2.*search.study_name=fixed-2"
    ):
        _driver(
            hydra_conf,
            [*stores["overrides"], "search.n_trials=2", "trainer.max_epochs=2"],
            name="fixed",
        )


@pytest.mark.study
def test_group_choices_are_searched_by_recomposing(hydra_conf, stores) -> None:
    driver = _driver(
        hydra_conf,
        [
            *stores["overrides"],
            "search.n_trials=3",
            "+search.params={optimizer:'choice(sgd,adamw)'}",
        ],
        name="groups",
    )
    driver.run()
    client = MlflowClient(stores["mlflow"])
    for t in driver.study.get_trials():
        assert t.state == TrialState.COMPLETE
        path = client.download_artifacts(t.user_attrs[Attr.RUN_ID], "config.yaml")
        target = "torch.optim.SGD" if t.params["optimizer"] == "sgd" else "torch.optim.AdamW"
        assert f"_target_: {target}" in Path(path).read_text()


@pytest.mark.study
def test_single_objective_studies_use_the_pruner_on_val_acc(hydra_conf, stores) -> None:
    # ThresholdPruner prunes any trial whose reported val/acc is below `lower`: no trial of
    # a 2-epoch small CNN reaches 0.999, so each is pruned at its first validation.
    driver = _driver(
        hydra_conf,
        [
            *stores["overrides"],
            "search.n_trials=2",
            "trainer.max_epochs=2",
            "search.pruner._target_=optuna.pruners.ThresholdPruner",
            "~search.pruner.n_startup_trials",
            "~search.pruner.n_warmup_steps",
            "+search.pruner.lower=0.999",
        ],
        name="pruner",
    )
    driver.run()
    for t in driver.study.get_trials():
        assert t.state == TrialState.PRUNED and t.user_attrs[Attr.REASON] == "pruner"
        assert len(t.intermediate_values) == 1  # stopped at the first of two validations


def test_the_probe_prunes_only_a_projection_far_over_the_budget() -> None:
    budget = TimeBudget(60.0)
    # 1 ms per sample x 1000 samples = 1 s: far under 60 s.
    budget.on_probe(0.001, 1000)
    # Just under and just over PROBE_MARGIN x 60 s.
    budget.on_probe(PROBE_MARGIN * 60.0 / 1000 * 0.99, 1000)
    with pytest.raises(Prune, match=r"projects \d+ s of training for 1000 samples") as info:
        budget.on_probe(PROBE_MARGIN * 60.0 / 1000 * 1.01, 1000)
    assert info.value.reason == "slow"
    TimeBudget(None).on_probe(1e6, 1000)  # no budget: never pruned


@pytest.mark.parametrize("budget", ["90%", "50GiB"])
def test_a_plan_for_a_gpu_this_machine_lacks_opens_no_store(hydra_conf, stores, budget) -> None:
    """search.gpu on a machine without that card: the study stops with a ConfigError before
    its storage is opened, with the config otherwise valid (90%) or not (more than the
    card has): the decision is the config's, not validate's."""
    if torch.cuda.is_available():
        pytest.skip("a machine without CUDA")
    optuna_db = Path(stores["optuna"].removeprefix("sqlite:///"))
    overrides = [*stores["overrides"], "search.gpu=A100-40GB", f"search.memory_budget={budget}"]
    said = "plans for a GPU this machine does not have" if budget == "90%" else "A100-40GB has"
    with pytest.raises(ConfigError, match=said):
        _driver(hydra_conf, overrides)
    assert not optuna_db.exists()


def test_a_relative_store_is_said_with_its_absolute_path(tmp_path, monkeypatch) -> None:
    """Run from another directory, `mlruns/` is another store: the start line says which."""
    monkeypatch.chdir(tmp_path)
    where = tmp_path / "mlruns" / "optuna.journal"
    assert located("journal:mlruns/optuna.journal") == f"journal:mlruns/optuna.journal ({where})"
    assert located("sqlite:///mlruns/mlflow.db").endswith(f"({tmp_path / 'mlruns' / 'mlflow.db'})")
    assert located("sqlite:////abs/optuna.db") == "sqlite:////abs/optuna.db"  # as given
    assert located("postgresql://u@h/db") == "postgresql://u@h/db"


@pytest.mark.study
def test_a_study_says_its_space_and_boundary_in_a_few_lines_and_where_the_tables_are(
    hydra_conf, stores, tmp_path: Path
) -> None:
    """Before its first trial a study prints what it searches and the largest batch that
    fits per precision, not the fit report's tables (six of them, 150 lines, for
    llm_lora): those are in fit_report.txt, beside best.yaml and on the parent run, and
    `python -m search.fit` with the same overrides prints them."""
    space = (
        "+search.params={trainer.batch_size:'choice(16,64,256)',"
        "trainer.accum_steps:'choice(1,2)',optimizer.lr:'interval(0.01,0.1)'}"
    )
    overrides = [*FAST, "search.study_name=few", *stores["overrides"], space]
    console = Console(record=True, width=200)
    StudyDriver.prepare(
        hydra_conf(overrides), overrides, {"model": "small_cnn", "data": "digits"}, console,
        output_dir=tmp_path / "out",
    )  # fmt: skip
    said = console.export_text()
    assert "┃" not in said and "largest that fits" not in said  # no table
    lines = said.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Searching "))
    assert lines[start].startswith("Searching trainer.batch_size=choice(16, 64, 256), ")
    assert lines[start + 1].startswith("Fit report for cpu: the largest batch size predicted")
    assert "per precision at accum_steps 1/2 (predicted in" in lines[start + 1]
    assert lines[start + 2].startswith("  as configured: fp32 ")
    full = (tmp_path / "out" / "fit_report.txt").read_text()
    assert "largest that fits" in full and "┃" in full  # the tables, whole
    where, command = lines[start + 3].split(", or ")
    assert where == (
        f"The full tables: {tmp_path / 'out' / 'fit_report.txt'} (and fit_report.txt on the "
        "study's MLflow parent run)"
    )
    assert shlex.split(command) == ["python", "-m", "search.fit", *overrides], command
    assert len(said.split("Searching ")[1].splitlines()) < 10


def _report(seq_len: int, fits_up_to: int) -> FitReport:
    """A fit report of one layout (data.seq_len), fp32 at accum_steps 1 and 2: batch sizes
    up to `fits_up_to` fit at accumulation 1, half of it at 2."""
    report = FitReport(
        100 * 2**20, 0.05, False, ["fp32"], {}, [1, 2, 4], [1, 2], at={"data.seq_len": seq_len}
    )
    report.device, report.limit_bytes, report.budget_source = "cpu", 100 * 2**20, "budget"
    for accum in (1, 2):
        for batch in (1, 2, 4):
            fits = batch <= fits_up_to // accum
            report.cells["fp32", batch, accum] = Cell(batch * accum, batch, accum, 1, fits)
    return report


def test_the_boundary_is_a_line_per_layout_or_one_line_when_they_agree() -> None:
    lines = summary_lines([_report(128, 4), _report(256, 2)])
    assert lines[0].startswith("Fit report for cpu: the largest batch size predicted to fit")
    assert "per precision at accum_steps 1/2" in lines[0]
    assert lines[1:] == ["  data.seq_len=128: fp32 4/2", "  data.seq_len=256: fp32 2/1"]
    same = summary_lines([_report(128, 4), _report(256, 4)])
    assert same[1:] == ["  each of the 2 layouts (data.seq_len): fp32 4/2"]


@pytest.mark.study
def test_a_stop_as_the_trials_run_id_is_written_ends_its_run_killed(
    hydra_conf, stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop (SIGTERM, SIGHUP and Ctrl-C raise KeyboardInterrupt where they land) as the
    trial's MLflow run id is written to the study, the moment tests/faults/test_signals.py
    waits for before it signals: the run ends KILLED, not RUNNING forever."""
    from batchfit.search.trial import objective

    write = objective.write

    def stopped_at_the_run_id(trial, record) -> None:  # noqa: ANN001
        write(trial, record)
        if record.run_id is not None:
            raise KeyboardInterrupt

    monkeypatch.setattr(objective, "write", stopped_at_the_run_id)
    overrides = [*stores["overrides"], "search.n_trials=1", "search.fit_report_first=false"]
    driver = _driver(hydra_conf, [*overrides, "+search.params={trainer.batch_size:'choice(16)'}"])
    with pytest.raises(KeyboardInterrupt):
        driver.run()
    assert driver.tracker.close(30)
    (run,) = [r for r in _mlflow_runs(stores, "t") if r.data.tags.get("batchfit.role") == "trial"]
    assert run.info.status == "KILLED" and run.data.tags["batchfit.state"] == "KILLED"
