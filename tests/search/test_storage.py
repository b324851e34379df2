"""search/storage/ and the trial counting of search/core/trial_count.py, on real journal files and
SQLite databases, with real processes that are really killed."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from batchfit.common.checks import ConfigError
from batchfit.search.core.record import Attr
from batchfit.search.core.study_config import SearchConfig
from batchfit.search.core.trial_count import (
    claims_slot,
    interrupted_numbers,
    num_trained,
    should_start_trial,
    study_records,
)
from batchfit.search.storage.heartbeat import (
    BEAT_ATTR,
    HeartbeatJournalStorage,
    HeartbeatRDBStorage,
)
from batchfit.search.storage.journal import SafeJournalFileBackend
from batchfit.search.storage.opening import _create_rdb, open_storage
from batchfit.search.storage.owners import OWNER_ATTR, _process_start, owner_is_gone, this_owner
from batchfit.tracking.metrics import VAL_ACC

REPO = Path(__file__).resolve().parents[2]
# These tests drive the heartbeat by hand (ask, record_heartbeat), not through optimize.
pytestmark = pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used")


def _urls(tmp_path: Path) -> dict[str, str]:
    return {
        "journal": f"journal:{tmp_path}/optuna.journal",
        "sqlite": f"sqlite:///{tmp_path}/optuna.db",
    }


@pytest.fixture(params=["journal", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return _urls(tmp_path)[request.param]


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_owner_is_gone_only_when_its_process_on_this_host_is_dead() -> None:
    me = this_owner()
    assert me["pid"] == os.getpid() and me["started"] == _process_start(os.getpid())
    assert not owner_is_gone(me)
    child = _sleeper()
    try:
        owner = {**me, "pid": child.pid, "started": _process_start(child.pid)}
        assert not owner_is_gone(owner)
        # The same pid with another start time is a reused pid: the owner is gone.
        assert owner_is_gone({**owner, "started": owner["started"] - 1})
        # Another host (or another boot of this one) is never provably gone.
        assert not owner_is_gone({**owner, "host": "elsewhere", "started": 0})
        assert not owner_is_gone({**owner, "boot": "another-boot", "started": 0})
    finally:
        child.kill()
        child.wait()
    assert owner_is_gone(owner)
    assert not owner_is_gone(None)


def test_open_storage_gives_heartbeat_storages(tmp_path: Path) -> None:
    urls = _urls(tmp_path)
    assert isinstance(open_storage(urls["journal"], 60), HeartbeatJournalStorage)
    assert isinstance(open_storage(urls["sqlite"], 60), HeartbeatRDBStorage)
    journal = open_storage(urls["journal"], 60)
    assert journal.get_heartbeat_interval() == 60 and journal.grace_period == 120
    assert not isinstance(open_storage(urls["journal"], None), HeartbeatJournalStorage)


# A worker in another process: starts a trial, samples, records a partial result and its
# heartbeat, then hangs mid-trial until it is killed.
_WORKER = textwrap.dedent(
    """
    import sys, time, optuna
    from batchfit.search.storage.opening import open_storage
    storage = open_storage(sys.argv[1], 60)
    study = optuna.create_study(study_name="s", storage=storage, load_if_exists=True)
    trial = study.ask()
    trial.suggest_int("batch_size", 8, 512)
    trial.suggest_float("lr", 1e-4, 1e-1, log=True)
    trial.set_user_attr("mlflow_run_id", "the-dead-run")
    storage.record_heartbeat(trial._trial_id)
    print("running", flush=True)
    time.sleep(60)
    """
)


def test_a_killed_workers_trial_is_failed_at_once_and_queued_with_its_params(url: str) -> None:
    worker = subprocess.Popen(
        [sys.executable, "-c", _WORKER, url], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert worker.stdout.readline().strip() == "running"
    storage = open_storage(url, 60)  # a grace of 120 s: only the dead owner can explain this
    study = optuna.load_study(study_name="s", storage=storage)
    (running,) = study.get_trials()
    assert running.state == TrialState.RUNNING
    assert running.system_attrs[OWNER_ATTR]["pid"] == worker.pid
    optuna.storages.fail_stale_trials(study)
    assert study.get_trials()[0].state == TrialState.RUNNING  # alive: left alone

    worker.send_signal(signal.SIGKILL)
    worker.wait()
    started = time.monotonic()
    optuna.storages.fail_stale_trials(study)
    assert time.monotonic() - started < 5
    dead, retry = study.get_trials()
    assert dead.state == TrialState.FAIL and Attr.ERROR not in dead.user_attrs
    assert retry.state == TrialState.WAITING
    assert retry.params == running.params
    assert retry.user_attrs == {}  # the dead run's MLflow id is not the retry's
    assert OWNER_ATTR not in retry.system_attrs and BEAT_ATTR not in retry.system_attrs
    assert retry.system_attrs["failed_trial"] == dead.number
    assert interrupted_numbers(study) == {dead.number}

    # The next trial of any worker is the retry, with the same parameters.
    again = study.ask()
    assert again.number == retry.number
    assert again.suggest_int("batch_size", 8, 512) == running.params["batch_size"]


def test_journal_heartbeat_fails_a_silent_trial_after_its_grace(tmp_path: Path) -> None:
    storage = open_storage(f"journal:{tmp_path}/j.journal", 1)  # beat 1 s, grace 2 s
    study = optuna.create_study(storage=storage)
    trial = study.ask()
    trial.suggest_float("x", 0, 1)
    storage.record_heartbeat(trial._trial_id)  # alive owner: only the grace can fail it
    beat = study.get_trials()[0].system_attrs[BEAT_ATTR]
    assert abs(beat - time.time()) < 5
    optuna.storages.fail_stale_trials(study)
    assert study.get_trials()[0].state == TrialState.RUNNING
    time.sleep(2.5)
    optuna.storages.fail_stale_trials(study)
    states = [t.state for t in study.get_trials()]
    assert states == [TrialState.FAIL, TrialState.WAITING]


def test_a_trial_retried_too_often_is_not_queued_again(tmp_path: Path) -> None:
    storage = open_storage(f"journal:{tmp_path}/j.journal", 1)
    study = optuna.create_study(storage=storage)
    for _ in range(4):
        trial = study.ask()  # the queued retry of the previous one, after the first
        trial.suggest_float("x", 0, 1)
        storage.record_heartbeat(trial._trial_id)
        storage.set_trial_system_attr(trial._trial_id, BEAT_ATTR, time.time() - 10)
        optuna.storages.fail_stale_trials(study)
    # The first run and its 3 retries (MAX_RETRY) all died; nothing is queued after that.
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["FAIL"] * 4
    assert trials[-1].system_attrs["retry_history"] == [0, 1, 2]


def _add(study: optuna.Study, state: TrialState, **attrs: object) -> None:
    study.add_trial(
        optuna.trial.create_trial(
            state=state,
            values=[0.5] if state == TrialState.COMPLETE else None,
            user_attrs=attrs,
        )
    )


def test_trial_counting_across_workers() -> None:
    study = optuna.create_study()
    assert should_start_trial(study, 3) is True
    _add(study, TrialState.COMPLETE)
    _add(study, TrialState.FAIL, error="ValueError: bad")  # its own error: counts
    _add(study, TrialState.FAIL)  # its worker died: does not count
    _add(study, TrialState.PRUNED)
    assert num_trained(study_records(study)) == 3
    assert should_start_trial(study, 3) is False
    assert should_start_trial(study, 4) is True
    _add(study, TrialState.RUNNING)  # another worker's: it would complete a study of 4
    assert should_start_trial(study, 4) is None
    assert should_start_trial(study, 5) is True
    _add(study, TrialState.WAITING)  # a dead worker's trial, queued again: always run it,
    assert should_start_trial(study, 5) is True  # even when it holds the last slot
    assert should_start_trial(study, 6) is True
    # Trial 6 starts while 5 trials before it hold slots: within 6, not within 5.
    assert claims_slot(study, 6, 6) and not claims_slot(study, 6, 5)
    assert interrupted_numbers(study) == {2}


def _settings(**changes: object) -> SearchConfig:
    values = dict(
        study_name="s",
        storage="journal:mlruns/optuna.journal",
        n_trials=4,
        memory_budget=None,
        objectives=(VAL_ACC,),
        trial_time_budget_s=None,
        heartbeat_interval_s=60,
    )
    return SearchConfig(**{**values, **changes})


def test_several_workers_refuse_sqlite_and_name_both_alternatives() -> None:
    assert _settings(workers=4).workers == 4
    with pytest.raises(ConfigError) as raised:
        _settings(storage="sqlite:///mlruns/optuna.db", workers=2)
    message = str(raised.value)
    assert "search.storage='sqlite:///mlruns/optuna.db' cannot be shared by" in message
    assert "search.workers=2" in message
    assert "search.storage=journal:" in message and "search.storage=postgresql://" in message
    with pytest.raises(ConfigError, match=r"search.workers must be an integer >= 1, got 0"):
        _settings(workers=0)
    _settings(storage="sqlite:///mlruns/optuna.db", workers=1)  # one worker: fine


def test_a_trial_that_never_beat_is_stale_after_the_grace(url: str) -> None:
    """A worker that died between starting a trial and its first heartbeat left neither a
    beat nor an owner: the trial's start stands in for its last sign of life."""
    storage = open_storage(url, 1)  # grace 2 s
    study = optuna.create_study(storage=storage)
    trial = study.ask()
    trial.suggest_float("x", 0, 1)
    optuna.storages.fail_stale_trials(study)
    assert study.get_trials()[0].state == TrialState.RUNNING
    time.sleep(2.5)
    optuna.storages.fail_stale_trials(study)
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL, TrialState.WAITING]


# A process that takes the journal lock from a pickled backend (as a launcher's worker gets
# it), says so, holds it for a while and says when it lets go.
_PICKLED_HOLDER = textwrap.dedent(
    """
    import pickle, sys, time
    backend = pickle.loads(sys.stdin.buffer.read())
    backend.lock.acquire()
    print("holding", time.time(), flush=True)
    time.sleep(1.0)
    print("releasing", time.time(), flush=True)
    backend.lock.release()
    """
)


def test_the_journal_lock_excludes_threads_and_a_pickled_copy(tmp_path: Path) -> None:
    """Optuna's heartbeat thread and the trial's thread append through one backend, so one
    lock object: each thread's hold is its own flock, and no two are inside at once; a
    pickled backend (a launcher's worker) excludes the original's writers too."""
    backend = SafeJournalFileBackend(tmp_path / "optuna.journal")
    inside: list[int] = []
    overlaps: list[int] = []

    def append_by_hand() -> None:
        for _ in range(30):
            backend.lock.acquire()
            inside.append(1)
            overlaps.append(len(inside) - 1)
            time.sleep(0.002)
            inside.pop()
            backend.lock.release()

    threads = [threading.Thread(target=append_by_hand) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(overlaps) == 120 and max(overlaps) == 0

    holder = subprocess.Popen(
        [sys.executable, "-c", _PICKLED_HOLDER], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=False, cwd=REPO,
    )  # fmt: skip
    holder.stdin.write(pickle.dumps(backend))
    holder.stdin.close()
    assert holder.stdout.readline().split()[0] == b"holding"
    backend.lock.acquire()
    got = time.time()
    backend.lock.release()
    released = float(holder.stdout.readline().split()[1])
    assert holder.wait() == 0
    assert got >= released  # not before the other process let go


_OPEN_AT_ONCE = textwrap.dedent(
    """
    import sys, time
    from batchfit.search.storage.opening import open_storage
    while time.time() < float(sys.argv[2]):
        time.sleep(0.001)
    open_storage(sys.argv[1], 60)
    print("opened", flush=True)
    """
)


def test_workers_creating_one_database_together_all_open_it(tmp_path: Path) -> None:
    """Four processes opening a new database at the same instant race to create Optuna's
    tables; the losers' "already exists" is tried again, and every one opens the study."""
    url = f"sqlite:///{tmp_path}/optuna.db"
    start = time.time() + 8  # after the imports of all four
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _OPEN_AT_ONCE, url, str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )  # fmt: skip
        for _ in range(4)
    ]
    for worker in workers:
        out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0 and out.strip() == "opened", err[-2000:]


def test_creating_the_tables_is_tried_five_times_then_its_error_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retry itself (the storage it retries is stood in for: a lost race cannot be made
    to happen on demand): only the race's errors are retried, 0.2-1.2 s apart, five
    attempts in all, and the last one's error is the one raised, as it is."""
    calls: list[float] = []

    class LosesTheRace:
        def __init__(self, url: str, **_: object) -> None:
            calls.append(time.monotonic())
            raise RuntimeError(f'relation "studies" already exists (attempt {len(calls)})')

    monkeypatch.setattr("batchfit.search.storage.opening.HeartbeatRDBStorage", LosesTheRace)
    with pytest.raises(RuntimeError, match=r"already exists \(attempt 5\)"):
        _create_rdb("postgresql://nowhere/db", {})
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert len(calls) == 5 and all(0.2 <= gap < 1.2 + 0.5 for gap in gaps), gaps

    calls.clear()

    class Refused(LosesTheRace):
        def __init__(self, url: str, **_: object) -> None:
            calls.append(time.monotonic())
            raise RuntimeError("connection refused")

    monkeypatch.setattr("batchfit.search.storage.opening.HeartbeatRDBStorage", Refused)
    with pytest.raises(RuntimeError, match="connection refused"):
        _create_rdb("postgresql://nowhere/db", {})
    assert len(calls) == 1


# Holds the journal's lock (an flock on <journal>.flock, as FlockJournalLock takes it) until
# killed, after saying so.
_LOCK_HOLDER = textwrap.dedent(
    """
    import fcntl, sys, time
    handle = open(sys.argv[1] + ".flock", "a")
    fcntl.flock(handle, fcntl.LOCK_EX)
    print("holding", flush=True)
    time.sleep(600)
    """
)


def test_an_append_waits_for_a_lock_held_by_another_process_then_lands_once(
    tmp_path: Path, caplog
) -> None:
    """append_logs under the journal's lock: while another process holds it the file is
    unchanged and the wait is said; once the holder dies (the kernel drops its flock) the
    record lands, once."""
    journal = tmp_path / "optuna.journal"
    backend = SafeJournalFileBackend(journal)
    backend.lock.warn_s = 0.2
    before = journal.read_bytes()
    holder = subprocess.Popen(
        [sys.executable, "-c", _LOCK_HOLDER, str(journal)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        record = {"op_code": 0, "worker_id": "w", "study_name": "held", "directions": [1]}
        writer = threading.Thread(target=backend.append_logs, args=([record],))
        with caplog.at_level("WARNING"):
            writer.start()
            time.sleep(0.6)
            assert writer.is_alive() and journal.read_bytes() == before  # nothing written
            assert "for the lock" in caplog.text and str(journal) + ".flock" in caplog.text
    finally:
        holder.kill()  # the process this test started, by its handle
        holder.wait()
    writer.join(timeout=10)
    assert not writer.is_alive()
    added = journal.read_bytes()[len(before) :].decode().splitlines()
    assert [json.loads(line) for line in added] == [record]
