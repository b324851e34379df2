"""The study's PostgreSQL server stopped while a trial trains (a restart, a crash, a
failover): the study stops as it does on a full journal disk, with one message and no
traceback, its MLflow runs ended, and the same command, once the server is back, re-runs the
interrupted trial and completes the study."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import sqlalchemy
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from batchfit.search.storage.opening import open_storage
from tests.faults.postgres import PostgresServer, own_server
from tests.faults.study import NAME, STUDY, run_study, start_study
from tests.sweeps import training, wait_for_trial

pytestmark = pytest.mark.slow
# Trials of several seconds, so that the server stops inside one.
LONGER = [*STUDY, "trainer.max_epochs=30"]


@pytest.fixture
def postgres_server() -> Iterator[PostgresServer]:
    with own_server() as server:
        yield server


def _study(url: str) -> optuna.Study | None:
    try:
        return optuna.load_study(study_name=NAME, storage=url)
    except KeyError:
        return None


def _runs(client: MlflowClient) -> dict[str, object]:
    experiment = client.get_experiment_by_name(NAME)
    return {
        r.data.tags.get("batchfit.trial", "parent"): r
        for r in client.search_runs([experiment.experiment_id])
    }


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_a_server_stopped_mid_trial_stops_the_study_cleanly_and_it_resumes(
    tmp_path: Path, postgres_server: PostgresServer, mode: str
) -> None:
    url = f"{postgres_server.url}/postgres"
    open_storage(url, None)  # Optuna's tables, before the study and this test both poll them
    args = [*LONGER, f"search.storage={url}"]
    process = start_study(tmp_path, args)
    running = wait_for_trial(lambda: _study(url), training(0), alive=lambda: process.poll() is None)
    postgres_server.stop(mode)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 1, out[-3000:] + err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    assert "Storage error" in err and "run the same command again" in err, err[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    runs = _runs(client)
    assert runs[str(running.number)].info.status == "KILLED"
    assert runs["parent"].info.status == "KILLED"

    postgres_server.start()
    run_study(tmp_path, args)
    study = _study(url)
    assert study is not None
    trials = study.get_trials()
    assert not [t.number for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert len([t for t in trials if t.state == TrialState.COMPLETE]) == 2
    assert trials[running.number].state == TrialState.FAIL  # its owner gone: failed at resume
    rerun = [t for t in trials if t.system_attrs.get("retry_history") == [running.number]]
    assert [t.state for t in rerun] == [TrialState.COMPLETE]
    assert rerun[0].params == running.params
    assert all(r.info.status != "RUNNING" for r in _runs(client).values())


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used")
def test_a_heartbeat_the_server_cannot_take_is_said_and_the_next_one_recorded(
    postgres_server: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Raised, it would end Optuna's heartbeat thread with a traceback: no beat after it,
    and the trial failed as stale by the next worker though its own worker lives."""
    url = f"{postgres_server.url}/postgres"
    storage = open_storage(url, heartbeat_interval_s=60)
    study = optuna.create_study(study_name=NAME, storage=storage)
    trial_id = study.ask()._trial_id
    storage.record_heartbeat(trial_id)
    postgres_server.stop("fast")
    storage.record_heartbeat(trial_id)
    (said,) = [r.getMessage() for r in caplog.records if "heartbeat" in r.getMessage()]
    assert "was not recorded" in said and "terminating connection" in said, said
    postgres_server.start()
    before = _beat(storage)
    storage.record_heartbeat(trial_id)
    assert _beat(storage) > before


def _beat(storage: optuna.storages.RDBStorage) -> object:
    with storage.engine.connect() as connection:
        query = sqlalchemy.text("SELECT heartbeat FROM trial_heartbeats")
        return connection.execute(query).scalar_one()
