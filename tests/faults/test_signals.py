"""SIGTERM (SLURM preemption, scancel, a time limit), SIGHUP and Ctrl-C on a real study: the trial
ends, the runs are closed as KILLED, the interrupted trial's parameters are queued, and the
same command resumes the study to exactly n_trials."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from batchfit.search.core.record import Attr
from tests.faults.forkserver import Process
from tests.faults.study import NAME, STUDY, journal_of, run_study, start_study
from tests.sweeps import journal_study, training, wait_for_trial

pytestmark = pytest.mark.slow
# Trials of several seconds, so that a signal lands inside one: 6 epochs took under a second
# a trial on a fast machine, and the study was over before its first Ctrl-C.
LONGER = [*STUDY, "trainer.max_epochs=30"]


def _in_training(cwd: Path, process: Process):  # noqa: ANN202 - a FrozenTrial
    return wait_for_trial(
        lambda: journal_study(cwd / "mlruns" / "optuna.journal", NAME),
        training(0),
        alive=lambda: process.poll() is None,
    )


def _client(cwd: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{cwd}/mlruns/mlflow.db")


def _runs(cwd: Path) -> dict:
    client = _client(cwd)
    experiment = client.get_experiment_by_name(NAME)
    return {
        r.data.tags.get("batchfit.trial", "parent"): r
        for r in client.search_runs([experiment.experiment_id])
    }


@pytest.mark.parametrize(
    ("stop", "status", "said"),
    [
        (signal.SIGTERM, 143, "Terminated (SIGTERM)"),
        # a closed terminal or a dropped ssh connection: not killed silently, runs RUNNING
        (signal.SIGHUP, 129, "Hung up (SIGHUP"),
    ],
    ids=["sigterm", "sighup"],
)
def test_a_stop_signal_ends_the_trial_queues_it_again_and_the_study_resumes(
    tmp_path: Path, stop: signal.Signals, status: int, said: str
) -> None:
    process = start_study(tmp_path, LONGER)
    running = _in_training(tmp_path, process)
    process.send_signal(stop)
    out, err = process.communicate(timeout=120)
    assert process.returncode == status, out[-2000:] + err[-2000:]
    assert said in out and "queued to run again" in out
    assert "Traceback" not in out + err

    study = journal_of(tmp_path)
    killed, queued = study.trials[running.number], study.trials[-1]
    assert killed.state == TrialState.FAIL and Attr.ERROR not in killed.user_attrs
    assert queued.state == TrialState.WAITING and queued.params == killed.params
    runs = _runs(tmp_path)
    assert runs[str(running.number)].info.status == "KILLED", out[-3000:]
    assert runs["parent"].info.status == "KILLED", out[-3000:]

    run_study(tmp_path, LONGER)
    study = journal_of(tmp_path)
    rerun = study.trials[queued.number]
    assert rerun.state == TrialState.COMPLETE and rerun.params == killed.params
    finished = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(finished) == 2
    assert not [t for t in study.trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert all(r.info.status != "RUNNING" for r in _runs(tmp_path).values())


def test_two_ctrl_c_stop_the_study_once_without_a_traceback(tmp_path: Path) -> None:
    process = start_study(tmp_path, LONGER)
    _in_training(tmp_path, process)
    process.send_signal(signal.SIGINT)
    time.sleep(0.3)  # the second while the first is being handled
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, out[-2000:] + err[-2000:]
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    assert "Interrupted." in out
    study = journal_of(tmp_path)
    assert [t.state for t in study.trials][-1] == TrialState.WAITING  # queued to run again
