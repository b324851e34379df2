"""MLflow's SQLite store against a full disk, on a real filesystem: a store whose creation
the disk cut short is made anew once there is space, unless it holds something."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from batchfit.common.checks import ConfigError
from batchfit.tracking.runs import Tracker
from tests.faults.disk import fill, tmpfs


@pytest.fixture
def disk(tmp_path: Path):
    folder = tmp_path / "disk"
    with tmpfs(folder, "2m"):
        yield folder


def _half_made(disk: Path, leave_bytes: int) -> Path:
    """mlflow.db as a full disk leaves it when MLflow creates it, the disk freed again."""
    filler = fill(disk, leave_bytes)
    with pytest.raises(ConfigError, match="full"):
        Tracker(f"sqlite:///{disk}/mlflow.db", "study", str(disk / "artifacts"))
    filler.unlink()
    store = disk / "mlflow.db"
    with pytest.raises(Exception, match="already exists|duplicate column"):
        MlflowClient(f"sqlite:///{store}").search_experiments()  # MLflow's own: broken for good
    return store


# Where MLflow 3's migrations stop, by the space left: a column added, not yet recorded; a
# table copied to _alembic_tmp_runs, not yet renamed; a table created, not yet recorded.
@pytest.mark.parametrize("leave_bytes", [64 << 10, 128 << 10, 384 << 10])
def test_a_store_cut_short_by_a_full_disk_is_made_anew(
    disk: Path, leave_bytes: int, caplog
) -> None:
    store = _half_made(disk, leave_bytes)
    tracker = Tracker(f"sqlite:///{store}", "study", str(disk / "artifacts"))
    run, created = tracker.study_run("study", None)
    assert created and tracker.created_experiment
    assert f"MLflow's store {store} was half-made" in caplog.text and "made anew" in caplog.text
    client = MlflowClient(f"sqlite:///{store}")
    assert client.get_run(run.run_id).info.experiment_id == tracker.experiment_id


def test_a_half_made_store_that_holds_something_is_kept_and_said(disk: Path) -> None:
    store = _half_made(disk, 128 << 10)
    with sqlite3.connect(store) as db:
        db.execute(
            "INSERT INTO experiments (experiment_id, name, lifecycle_stage) "
            "VALUES (7, 'kept', 'active')"
        )
    before = store.read_bytes()
    with pytest.raises(ConfigError) as raised:
        Tracker(f"sqlite:///{store}", "study", str(disk / "artifacts"))
    (message,) = raised.value.problems
    assert f"{store} was left half-made" in message
    assert f"mv {store} {store}.broken" in message
    assert store.read_bytes() == before  # nothing of it touched
