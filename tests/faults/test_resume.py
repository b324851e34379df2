"""What a resume finds and completes: a trial killed without heartbeats, a parent run whose
setup was cut short, a study whose first run failed before trial 0, two identical commands
started at once, a resume with a lower n_trials."""

from __future__ import annotations

import signal
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from batchfit.common.checks import ConfigError
from batchfit.search.storage.heartbeat import queue_unretried
from batchfit.search.storage.opening import open_storage
from batchfit.search.storage.owners import OWNER_ATTR
from batchfit.search.study.opening import CONFIG_ATTR, open_study
from tests.faults.study import NAME, STUDY, inject, journal_of, run_study, start_study
from tests.sweeps import journal_study, wait_for_trial


def _parent(cwd: Path):  # noqa: ANN202 - an mlflow Run
    client = MlflowClient(f"sqlite:///{cwd}/mlruns/mlflow.db")
    experiment = client.get_experiment_by_name(NAME)
    (parent,) = client.search_runs(
        [experiment.experiment_id], filter_string="tags.`batchfit.role` = 'study'"
    )
    return client, parent


@pytest.mark.slow
@pytest.mark.parametrize(
    "kill_in",
    ["batchfit.search.study.driver:_log_fit_report", "batchfit.tracking.runs:RunLog.params"],
)
def test_a_parent_run_cut_short_is_completed_by_the_resume(tmp_path: Path, kill_in: str) -> None:
    killed = inject(tmp_path, STUDY, ["--kill-in", kill_in], check=False)
    assert killed.returncode == -signal.SIGKILL
    client, parent = _parent(tmp_path)
    assert "batchfit.setup" not in parent.data.tags

    run_study(tmp_path, STUDY)
    client, parent = _parent(tmp_path)
    assert parent.data.tags["batchfit.setup"] == "complete"
    assert parent.data.params["trainer.max_epochs"] == "1"
    files = {f.path for f in client.list_artifacts(parent.info.run_id)}
    assert {"fit_report.json", "fit_report.txt", "search_space.yaml", "fixed_config.yaml"} <= files
    assert parent.info.status == "FINISHED"


@pytest.mark.slow
def test_without_heartbeats_a_killed_trial_is_run_again(tmp_path: Path) -> None:
    """search.heartbeat_interval_s=null: the owner of a running trial is still recorded, and
    a worker on the same host sees it dead."""
    overrides = [*STUDY, "search.heartbeat_interval_s=null", "trainer.max_epochs=4"]
    process = start_study(tmp_path, overrides)
    running = wait_for_trial(
        lambda: journal_study(tmp_path / "mlruns" / "optuna.journal", NAME),
        # Owned and both parameters sampled: a trial caught between its two suggestions is
        # retried with the one it had, and the test would compare half a configuration.
        lambda t: (
            t.state == TrialState.RUNNING and OWNER_ATTR in t.system_attrs and len(t.params) == 2
        ),
        alive=lambda: process.poll() is None,
    )
    process.send_signal(signal.SIGKILL)
    process.communicate()

    done = run_study(tmp_path, overrides)
    assert "left unfinished by a process that died" in done.stdout
    study = journal_of(tmp_path)
    assert study.trials[running.number].state == TrialState.FAIL
    assert [t for t in study.trials if t.state == TrialState.COMPLETE][0].params == running.params
    assert len([t for t in study.trials if t.state == TrialState.COMPLETE]) == 2
    assert not [t for t in study.trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]


@pytest.mark.slow
def test_two_identical_commands_at_once_train_different_first_configurations(
    tmp_path: Path,
) -> None:
    overrides = [*STUDY, "search.n_trials=4"]
    processes = [start_study(tmp_path, overrides) for _ in range(2)]
    for process in processes:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, out[-2000:] + err[-2000:]
    study = journal_of(tmp_path)
    firsts = {}
    for trial in study.trials:  # each process's first trial, by its owner
        firsts.setdefault(trial.system_attrs[OWNER_ATTR]["pid"], trial.params)
    assert len(firsts) == 2
    one, other = firsts.values()
    assert one != other
    assert len([t for t in study.trials if t.state == TrialState.COMPLETE]) == 4


def test_a_study_without_trials_takes_the_new_config(tmp_path: Path) -> None:
    """A first run that failed after creating the study (before trial 0) does not pin it."""
    storage = open_storage(f"journal:{tmp_path}/optuna.journal", None)
    sampler, pruner = optuna.samplers.RandomSampler(), optuna.pruners.NopPruner()
    _, created = open_study("s", storage, ["maximize"], sampler, pruner, "max_epochs: 1\n")
    assert created
    study, created = open_study("s", storage, ["minimize"], sampler, pruner, "max_epochs: 2\n")
    assert not created
    assert study.user_attrs[CONFIG_ATTR] == "max_epochs: 2\n"
    assert [d.name for d in study.directions] == ["MINIMIZE"]
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    # With a trial in it, the study is a record: another config is refused.
    with pytest.raises(ConfigError, match="was run with another config.*max_epochs"):
        open_study("s", storage, ["minimize"], sampler, pruner, "max_epochs: 3\n")


@pytest.mark.slow
def test_a_resume_with_fewer_trials_says_there_is_nothing_to_do(tmp_path: Path) -> None:
    run_study(tmp_path, STUDY)
    done = run_study(tmp_path, [*STUDY, "search.n_trials=1"])
    assert "2 trials trained, search.n_trials=1: nothing left to train" in done.stdout
    assert "2 of 1" not in done.stdout
    assert len(journal_of(tmp_path).trials) == 2


def test_an_interrupted_trial_never_queued_is_queued_once(tmp_path: Path) -> None:
    """Its worker died between failing it and queueing it: the next worker queues it, once;
    a trial that failed with an error of its own, or started past n_trials, is not."""
    storage = open_storage(f"journal:{tmp_path}/optuna.journal", None)
    study = optuna.create_study(study_name="s", storage=storage)

    def failed(attrs: dict) -> int:
        trial = study.ask()
        trial.suggest_float("x", 0, 1)
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        study.tell(trial, state=TrialState.FAIL)
        return trial.number

    interrupted = failed({})
    failed({"error": "ValueError: its own"})
    failed({"surplus": True})
    assert queue_unretried(study, settle_s=60) == []  # its worker may still be queueing it
    assert queue_unretried(study, settle_s=0) == [interrupted]
    assert queue_unretried(study, settle_s=0) == []
    (waiting,) = study.get_trials(states=(TrialState.WAITING,))
    assert waiting.params == study.trials[interrupted].params
