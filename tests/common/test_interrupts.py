"""A stop a signal asked for survives being swallowed (common/interrupts.py): Python prints
and drops an exception raised in a weakref callback, where SIGTERM once landed mid-study
and the study went on to the end."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from rich.console import Console
from sqlalchemy import event
from sqlalchemy.engine import Engine

from batchfit.common import interrupts
from batchfit.search.__main__ import stop_on_signals
from batchfit.tracking.outbox import Outbox


class _Garbage:
    pass


def test_a_stop_raised_in_a_weakref_callback_is_raised_again_at_the_next_check() -> None:
    def callback(_ref: weakref.ref) -> None:
        interrupts.request(KeyboardInterrupt)
        raise KeyboardInterrupt  # what the signal handler does; Python ignores it here

    obj = _Garbage()
    ref = weakref.ref(obj, callback)  # noqa: F841 - kept alive until obj dies
    try:
        del obj
        gc.collect()  # the callback ran, its KeyboardInterrupt swallowed
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()
        interrupts.delivered()
        interrupts.check()  # delivered: no second stop
    finally:
        interrupts.delivered()


@pytest.fixture
def study_signals() -> Iterator[None]:
    """The study's own SIGINT and SIGTERM handlers (search/__main__.py), restored after."""
    kept = {each: signal.getsignal(each) for each in (signal.SIGINT, signal.SIGTERM)}
    hook = sys.unraisablehook
    stop_on_signals(Console(stderr=True))
    try:
        yield
    finally:
        for each, handler in kept.items():
            signal.signal(each, handler)
        sys.unraisablehook = hook
        interrupts.delivered()


def test_a_sigterm_inside_an_mlflow_write_stops_the_study_after_it(
    tmp_path: Path, study_signals: None
) -> None:
    """SIGTERM landing while a trial's metrics were being inserted into the SQLite store cut
    the transaction short; its connection kept the database locked, every later write
    (the trial's and the study's runs ended as KILLED) met 'database is locked' until the
    study exited, and both runs stayed RUNNING. The write now finishes first."""
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    sent = []

    def signal_mid_insert(conn, cursor, statement: str, *args: object) -> None:
        if statement.startswith("INSERT INTO metrics") and not sent:
            sent.append(statement)
            # Its handler runs at the next bytecode: the rows are inserted, not committed.
            os.kill(os.getpid(), signal.SIGTERM)

    outbox = Outbox()
    metrics = [Metric("train/loss", 0.5, 0, step) for step in range(20)]
    event.listen(Engine, "after_cursor_execute", signal_mid_insert)
    try:
        with pytest.raises(KeyboardInterrupt):
            outbox.put(lambda: client.log_batch(run_id, metrics=metrics))
    finally:
        event.remove(Engine, "after_cursor_execute", signal_mid_insert)
    assert sent and len(outbox) == 0  # written, not left queued to be written twice
    interrupts.delivered()  # as the objective does on the stop
    outbox.put(lambda: client.set_terminated(run_id, status="KILLED"))
    assert outbox.wait(5.0), outbox.last_error
    assert client.get_run(run_id).info.status == "KILLED"
    assert len(client.get_metric_history(run_id, "train/loss")) == 20


def test_only_the_main_thread_defers_a_stop() -> None:
    """Signal handlers run on the main thread: another thread's write (MLflow's system
    metrics) neither holds a stop back nor raises the main thread's."""
    seen = []

    def write() -> None:
        with interrupts.deferred():
            seen.append(interrupts.deferring())

    interrupts.request(KeyboardInterrupt)
    try:
        thread = threading.Thread(target=write)
        thread.start()
        thread.join()
        assert seen == [False]
        with pytest.raises(KeyboardInterrupt), interrupts.deferred():
            assert interrupts.deferring()
    finally:
        interrupts.delivered()
    with interrupts.deferred():  # delivered: nothing more is raised
        pass
