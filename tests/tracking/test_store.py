"""tracking/store.py on real failures: the retries at start (which failures, how long, how
often, what is said at the end) and the schema lock between processes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException

from batchfit.common.checks import ConfigError
from batchfit.tracking import store as tracking_store
from batchfit.tracking.runs import Tracker
from batchfit.tracking.store import retry_at_start, schema_lock
from tests.sweeps import free_port


def _failing(times: int, error: BaseException) -> tuple[Callable[[], str], list[float]]:
    """A call that raises `error` its first `times` calls, then answers; and when each began."""
    began: list[float] = []

    def call() -> str:
        began.append(time.monotonic())
        if len(began) <= times:
            raise error
        return "answered"

    return call, began


def test_a_passing_failure_is_tried_again_with_a_doubling_delay() -> None:
    call, began = _failing(5, MlflowException("database is locked"))
    assert retry_at_start(call, "sqlite:///mlflow.db") == "answered"
    gaps = [b - a for a, b in zip(began, began[1:], strict=False)]
    # 0.05 s doubled after each failure (RETRY_MIN_S; capped at 2 s, not reached here); the
    # upper bound leaves 0.25 s for a loaded machine's scheduling, which is more than was seen.
    for gap, delay in zip(gaps, [0.05, 0.1, 0.2, 0.4, 0.8], strict=True):
        assert delay <= gap < delay + 0.25, gaps


def test_a_lost_race_to_create_the_schema_is_tried_again() -> None:
    call, began = _failing(1, RuntimeError("table experiments already exists"))
    assert retry_at_start(call, "sqlite:///mlflow.db") == "answered"
    assert len(began) == 2


@pytest.mark.parametrize(
    "error",
    [
        MlflowException("RESOURCE_DOES_NOT_EXIST: no such experiment"),
        PermissionError(13, "Permission denied"),
    ],
)
def test_a_real_error_at_start_is_said_at_once(error: BaseException) -> None:
    call, began = _failing(100, error)
    with pytest.raises(ConfigError) as raised:
        retry_at_start(call, "sqlite:///mlruns/mlflow.db")
    assert len(began) == 1
    (message,) = raised.value.problems
    assert message.startswith(
        f"mlflow.tracking_uri='sqlite:///mlruns/mlflow.db' cannot be used ({type(error).__name__}:"
    )
    assert "start the tracking server, or use a local store" in message


def test_a_config_error_is_raised_as_it_is_even_when_it_reads_like_a_race() -> None:
    """open_client's advice on a half-made store quotes MLflow's "already exists"."""
    advice = ConfigError(["the store was left half-made (table _alembic_tmp_runs already exists)"])
    call, began = _failing(100, advice)
    with pytest.raises(ConfigError) as raised:
        retry_at_start(call, "sqlite:///mlflow.db")
    assert raised.value is advice and len(began) == 1


def test_ctrl_c_at_start_is_not_retried() -> None:
    call, began = _failing(100, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        retry_at_start(call, "sqlite:///mlflow.db")
    assert len(began) == 1


def test_a_tracking_server_that_stays_down_is_waited_for_then_said(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Nothing listens on the port: every attempt is refused at once (MLflow's own retries
    off, as the entry points set them), until START_RETRY_S has passed."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setattr(tracking_store, "START_RETRY_S", 1.0)
    uri = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(ConfigError) as raised:
        Tracker(uri, "study", str(tmp_path / "artifacts"))
    waited = time.monotonic() - started
    # At least the second; at most a last delay (0.8 s at that point) and a last refusal.
    assert 1.0 <= waited < 1.0 + 0.8 + 2.0, waited
    (message,) = raised.value.problems
    assert message.startswith(f"mlflow.tracking_uri={uri!r} cannot be used (MlflowException:")
    assert "start the tracking server" in message


def _hold(uri: str, held: multiprocessing.synchronize.Event) -> None:
    with schema_lock(uri):
        held.set()
        time.sleep(600)


def test_the_schema_lock_keeps_others_out_until_its_holder_dies(tmp_path: Path) -> None:
    """A worker holds the lock beside a new store; another (a thread here) waits for it, and
    gets it once the holder is killed with SIGKILL: the kernel releases the lock of a dead
    process, so no stale lock is left behind. Forked, not spawned: the holder needs only
    this module's code, and a spawned child would import MLflow again (seconds)."""
    uri = f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    context = multiprocessing.get_context("fork")
    held = context.Event()
    holder = context.Process(target=_hold, args=(uri, held), daemon=True)
    holder.start()
    try:
        assert held.wait(30)
        entered = threading.Event()

        def second_worker() -> None:
            with schema_lock(uri):
                entered.set()

        threading.Thread(target=second_worker, daemon=True).start()
        assert not entered.wait(1.0)  # kept out while the holder lives
        os.kill(holder.pid, signal.SIGKILL)
        assert entered.wait(10)  # let in once it is dead
    finally:
        holder.kill()
        holder.join(10)
    assert (tmp_path / "mlruns" / "mlflow.db.lock").is_file()  # left in place for the next


def test_the_schema_lock_excludes_threads_of_one_process(tmp_path: Path) -> None:
    """Two Trackers opening one store in two threads: one at a time, as two processes."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    inside: list[int] = []
    overlapped = threading.Event()

    def worker() -> None:
        with schema_lock(uri):
            inside.append(1)
            if len(inside) > 1:
                overlapped.set()
            time.sleep(0.3)
            inside.pop()

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not overlapped.is_set()


def test_no_lock_for_a_store_that_is_not_a_sqlite_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for uri in ("sqlite:///:memory:", "postgresql://u@h/db", "http://127.0.0.1:5000"):
        with schema_lock(uri):
            pass
    assert list(tmp_path.iterdir()) == []


def test_a_new_sqlite_store_is_a_copy_of_the_template_and_reads_as_one_mlflow_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first new store makes the template (MLflow's migrations, once); the next is copied
    from it, and reads as a store MLflow made there: its Default experiment in the directory
    it was opened from, and the first experiment created is id 1 (the README's link)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    caplog.set_level("INFO", logger="mlflow.store.db.utils")
    first = tracking_store.open_client(f"sqlite:///{tmp_path / 'a' / 'mlflow.db'}")
    assert "Creating initial MLflow database tables" in caplog.text
    assert tracking_store._template_path().is_relative_to(tmp_path / "cache")
    assert tracking_store._template_path().is_file()
    caplog.clear()
    monkeypatch.chdir(tmp_path / "a")
    second = tracking_store.open_client(f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}")
    assert "Creating initial MLflow database tables" not in caplog.text  # copied, not migrated
    default = second.get_experiment("0")
    assert default.name == "Default"
    assert default.artifact_location == str(tmp_path / "a" / "mlruns" / "0")
    assert second.create_experiment("study") == first.create_experiment("study") == "1"
    assert not list((tmp_path / "b").glob("tmp*")), "the copy's folder is left behind"
