"""What a store that cannot be used says, on real stores: a read-only filesystem under
./mlruns, and a PostgreSQL server that answers that the database does not exist."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from search.storage import open_storage
from tests.faults.disk import mount_tmpfs, unmount
from tracking.outputs import cannot_create
from tracking.runs import Tracker
from train.config import ConfigError


@pytest.fixture
def read_only_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The working directory on a read-only filesystem (root writes anywhere else), and
    a home directory that can be written."""
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "1m")
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    monkeypatch.chdir(disk)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    yield disk
    monkeypatch.chdir(tmp_path)
    unmount(disk)


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def postgres_server():
    """A PostgreSQL server of its own (trust authentication on 127.0.0.1), run by the
    `postgres` user (the server refuses root) in a folder it can reach: its URL, without a
    database."""
    initdb, pg_ctl, runuser = (shutil.which(name) for name in ("initdb", "pg_ctl", "runuser"))
    if not (initdb and pg_ctl and runuser):
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) here")
    data = Path(tempfile.mkdtemp(prefix="batchfit-pg-"))
    shutil.chown(data, "postgres")
    as_postgres = [runuser, "-u", "postgres", "--"]
    try:
        subprocess.run(
            [*as_postgres, initdb, "-D", str(data), "--auth=trust"],
            check=True, capture_output=True,
        )  # fmt: skip
        port = _free_port()
        options = f"-p {port} -k {data} -c listen_addresses=127.0.0.1"
        subprocess.run(
            [*as_postgres, pg_ctl, "-D", str(data), "-o", options, "-w", "-l", f"{data}/log",
             "start"],
            check=True, capture_output=True,
        )  # fmt: skip
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}"
        subprocess.run(
            [*as_postgres, pg_ctl, "-D", str(data), "-m", "immediate", "stop"],
            check=False, capture_output=True,
        )  # fmt: skip
    finally:
        shutil.rmtree(data, ignore_errors=True)


def test_a_database_that_does_not_exist_is_said_at_once(postgres_server: str) -> None:
    """The server answers: no outage to wait out (MLflow's own retries took 113 s)."""
    started = time.monotonic()
    with pytest.raises(ConfigError, match='database "no_such_db" does not exist'):
        Tracker(f"{postgres_server}/no_such_db", "study", "mlruns/artifacts")
    assert time.monotonic() - started < 15
