"""What a store that cannot be used says, on real stores: a read-only filesystem under
./mlruns, and a PostgreSQL server that answers that the database does not exist."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchfit.common.checks import ConfigError
from batchfit.search.storage.opening import open_storage
from batchfit.tracking.outputs import cannot_create
from batchfit.tracking.runs import Tracker
from tests.faults.disk import tmpfs
from tests.faults.postgres import own_server


@pytest.fixture
def read_only_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The working directory on a read-only filesystem (root writes anywhere else), and
    a home directory that can be written."""
    with tmpfs(tmp_path / "disk", "1m") as disk:
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        monkeypatch.chdir(disk)
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        yield disk
        monkeypatch.chdir(tmp_path)


def _suggested(message: str, key: str) -> Path:
    found = re.search(rf"{re.escape(key)}=(?:journal:|sqlite:///)(\S+?)[;,)]?(?:\s|$)", message)
    assert found, message
    return Path(found.group(1))


def test_a_read_only_journal_is_not_suggested_again(read_only_cwd: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        open_storage("journal:mlruns/optuna.journal", None)
    (message,) = raised.value.problems
    assert "Read-only file system" in message
    suggested = _suggested(message, "search.storage")
    assert suggested.is_absolute() and cannot_create(suggested.parent) is None
    assert suggested.is_relative_to(tmp_path / "home")


def test_a_read_only_mlflow_store_is_not_suggested_again(
    read_only_cwd: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as raised:
        Tracker("sqlite:///mlruns/mlflow.db", "study", "mlruns/artifacts")
    (message,) = raised.value.problems
    assert "Read-only file system" in message
    suggested = _suggested(message, "mlflow.tracking_uri")
    assert suggested.is_absolute() and cannot_create(suggested.parent) is None
    assert suggested.is_relative_to(tmp_path / "home")


@pytest.fixture
def postgres_server() -> Iterator[str]:
    """A PostgreSQL server of its own: its URL, without a database."""
    with own_server() as server:
        yield server.url


def test_a_database_that_does_not_exist_is_said_at_once(postgres_server: str) -> None:
    """The server answers: no outage to wait out (MLflow's own retries took 113 s)."""
    started = time.monotonic()
    with pytest.raises(ConfigError, match='database "no_such_db" does not exist'):
        Tracker(f"{postgres_server}/no_such_db", "study", "mlruns/artifacts")
    assert time.monotonic() - started < 15


def test_a_database_driver_not_installed_is_one_line() -> None:
    """psycopg2 is not batchfit's driver (psycopg 3 is): the asking-first check leaves the
    URL to MLflow's own opening, which says what is missing in one line, at once."""
    from batchfit.common.checks import ConfigError
    from batchfit.tracking.runs import Tracker

    with pytest.raises(ConfigError, match=r"cannot be used \(ModuleNotFoundError: No module"):
        Tracker("postgresql+psycopg2://u@127.0.0.1:1/x", "x", None, None)
