"""The study's journal against its writers' deaths and a full disk, on real files, real
processes and real signals: torn records, locks left by killed writers, a filesystem that
fills up, and a SIGKILL at every journal append of a short study.

A new fault goes into tests/faults/inject.py as a flag, and its test here or beside."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from batchfit.search.storage.journal import (
    TORN_SUFFIX,
    FlockJournalLock,
    JournalWriteError,
    SafeJournalFileBackend,
)
from batchfit.search.storage.opening import open_storage
from tests.faults.disk import fill, tmpfs
from tests.faults.study import (
    NAME,
    STUDY,
    journal_of,
    kill_at_every_kind,
    run_study,
)
from tests.sweeps import check_stores

REPO = Path(__file__).resolve().parents[2]


def _study_with_trials(url: str, n: int) -> optuna.Study:
    study = optuna.create_study(study_name="s", storage=open_storage(url, None))
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=n)
    return study


def _load(url: str) -> optuna.Study:
    return optuna.load_study(study_name="s", storage=open_storage(url, None))


def _torn_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"*{TORN_SUFFIX}*"))


def test_a_torn_tail_is_moved_aside_and_the_study_resumes(tmp_path: Path) -> None:
    journal = tmp_path / "optuna.journal"
    _study_with_trials(f"journal:{journal}", 3)
    whole = journal.read_bytes()
    torn = b'{"op_code":5,"worker_id":"a-writer-killed-he'
    journal.write_bytes(whole + torn)

    storage = open_storage(f"journal:{journal}", None)
    (note,) = storage._backend.notes
    assert "moved to" in note and str(_torn_files(tmp_path)[0]) in note
    assert journal.read_bytes() == whole  # every complete record kept, nothing else
    assert _torn_files(tmp_path)[0].read_bytes() == torn + b"\n"
    study = optuna.load_study(study_name="s", storage=storage)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    assert [t.state for t in _load(f"journal:{journal}").trials] == [TrialState.COMPLETE] * 4


def test_a_record_glued_onto_a_torn_one_is_kept(tmp_path: Path) -> None:
    """What a writer that appended after a torn record left (before this repair existed):
    the torn bytes and the next record on one line. Optuna refuses such a journal for good."""
    journal = tmp_path / "optuna.journal"
    _study_with_trials(f"journal:{journal}", 2)
    lines = journal.read_bytes().split(b"\n")
    # The first trial's state record, glued onto the torn record before it; trial 1 follows.
    state = next(i for i, line in enumerate(lines) if b'"op_code":6' in line)
    glued = lines[state - 1][:17] + lines[state]
    broken = [*lines[: state - 1], glued, *lines[state + 1 :]]
    journal.write_bytes(b"\n".join(broken))
    with pytest.raises(ValueError):  # Optuna's own reader
        optuna.load_study(
            study_name="s",
            storage=optuna.storages.JournalStorage(
                optuna.storages.journal.JournalFileBackend(str(journal))
            ),
        )
    storage = open_storage(f"journal:{journal}", None)
    assert "a torn record" in storage._backend.notes[0]
    study = optuna.load_study(study_name="s", storage=storage)
    # The record torn came before the trial's state: the state survives.
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    assert _torn_files(tmp_path)[0].read_bytes() == lines[state - 1][:17] + b"\n"


# A writer of the journal that holds its lock, as one killed inside an append does.
_HOLDER = textwrap.dedent(
    """
    import sys, time
    from batchfit.search.storage.journal import SafeJournalFileBackend
    backend = SafeJournalFileBackend(sys.argv[1])
    backend.lock.acquire()
    print("holding", flush=True)
    time.sleep(60)
    """
)
_RECORD = {"op_code": 0, "worker_id": "w", "study_name": "s", "directions": [1]}


def test_a_writer_killed_holding_the_lock_leaves_no_lock(tmp_path: Path) -> None:
    journal = tmp_path / "optuna.journal"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(journal)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert holder.stdout.readline().strip() == "holding"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    started = time.monotonic()
    SafeJournalFileBackend(journal).append_logs([_RECORD])  # opening takes the lock too
    assert time.monotonic() - started < 1.0  # Optuna's symlink lock would wait 30 s
    assert json.loads(journal.read_bytes()) == _RECORD


def test_a_long_wait_for_the_lock_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Optuna's own "taking longer" warning is hidden at batchfit's log level; this one is
    not: a writer stopped (Ctrl-Z) while holding the lock holds it until it goes on."""
    monkeypatch.setattr("batchfit.search.storage.journal.LOCK_WARN_S", 0.2)
    journal = tmp_path / "optuna.journal"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(journal)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert holder.stdout.readline().strip() == "holding"
    holder.send_signal(signal.SIGSTOP)
    subprocess.Popen(["sh", "-c", f"sleep 1; kill -KILL {holder.pid}"])
    lock = FlockJournalLock(journal)
    with caplog.at_level("WARNING", logger="batchfit.search.storage.journal"):
        lock.acquire()
    lock.release()
    holder.wait()
    assert any("waiting" in m and str(lock.path) in m for m in caplog.messages), caplog.messages


@pytest.mark.slow
def test_a_dangling_lock_link_does_not_hang_the_study(tmp_path: Path) -> None:
    """The issue's reproduction: Optuna's symlink lock of the relative default journal path,
    left by a writer killed inside an append, points nowhere."""
    (tmp_path / "mlruns").mkdir()
    link = tmp_path / "mlruns" / "optuna.journal.lock"
    link.symlink_to("mlruns/optuna.journal")
    done = run_study(tmp_path, STUDY, timeout_s=300)
    assert "removed" in done.stdout and "pointed nowhere" in done.stdout
    assert not link.is_symlink()
    study = journal_of(tmp_path)
    assert len([t for t in study.trials if t.state == TrialState.COMPLETE]) == 2


@pytest.fixture
def small_disk(tmp_path: Path):
    disk = tmp_path / "disk"
    with tmpfs(disk, "1m"):
        yield disk


def test_an_append_on_a_full_disk_leaves_the_journal_whole(small_disk: Path) -> None:
    journal = small_disk / "optuna.journal"
    _study_with_trials(f"journal:{journal}", 1)
    before = journal.read_bytes()
    fill(small_disk, 0)
    backend = SafeJournalFileBackend(journal)
    big = [{"op_code": 8, "worker_id": "w", "trial_id": 0, "user_attr": {"x": "y" * 20000}}]
    with pytest.raises(JournalWriteError, match="could not be written .*No space left"):
        backend.append_logs(big)
    assert journal.read_bytes() == before
    assert len(_load(f"journal:{journal}").trials) == 1


@pytest.mark.slow
def test_a_disk_that_fills_mid_study_then_resumes(tmp_path: Path, small_disk: Path) -> None:
    """The journal's filesystem fills during the first trial: the study stops with a
    message, not a traceback; once space is freed, the same command completes it."""
    storage = [f"search.storage=journal:{small_disk}/optuna.journal"]
    filler = fill(small_disk, 4096)  # one page: the first trial's records do not fit
    stopped = run_study(tmp_path, [*STUDY, *storage], returncode=1)
    assert "Storage error" in stopped.stderr and "No space left" in stopped.stderr
    assert "Traceback" not in stopped.stderr + stopped.stdout
    filler.unlink()
    run_study(tmp_path, [*STUDY, *storage])
    study = optuna.load_study(
        study_name=NAME, storage=open_storage(storage[0].split("=", 1)[1], None)
    )
    check_stores(study, MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db"), 2, num_epochs=1)


@pytest.mark.slow
def test_a_sigkill_at_every_kind_of_journal_append_then_resume_first_third(tmp_path: Path) -> None:
    """tests/faults/study.py kill_at_every_kind, the first third of the kinds (the rest
    is tests/faults/test_journal_kills.py, so that two workers run them side by side)."""
    kill_at_every_kind(tmp_path, 0)


# A second worker on the same journal, open across another worker's failed append: it waits
# for a line on stdin, then runs a trial and says how many the study holds.
_WORKER = textwrap.dedent(
    """
    import sys
    import optuna
    from batchfit.search.storage.opening import open_storage
    study = optuna.load_study(study_name="s", storage=open_storage("journal:" + sys.argv[1], None))
    print(len(study.trials), flush=True)
    sys.stdin.readline()
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    print(len(study.trials), flush=True)
    """
)


def test_a_failed_append_leaves_nothing_for_a_running_worker_to_trip_on(small_disk: Path) -> None:
    """A record shorter than a write buffer, of which the disk takes only a part: the
    journal ends at the record before it, byte for byte, and stays so (no buffer left to
    flush after the cut), and a worker that had it open reads and appends after it."""
    journal = small_disk / "optuna.journal"
    _study_with_trials(f"journal:{journal}", 1)
    worker = subprocess.Popen(
        [sys.executable, "-c", _WORKER, str(journal)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert worker.stdout.readline().strip() == "1"
        before = journal.read_bytes()
        assert len(before) < 4096  # the rest of its page takes part of the record below
        filler = fill(small_disk, 0)
        backend = SafeJournalFileBackend(journal)
        record = [{"op_code": 8, "worker_id": "w", "trial_id": 0, "user_attr": {"x": "y" * 5000}}]
        with pytest.raises(JournalWriteError, match="No space left"):
            backend.append_logs(record)
        assert journal.read_bytes() == before
        filler.unlink()
        assert journal.read_bytes() == before
        worker.stdin.write("go\n")
        worker.stdin.flush()
        assert worker.stdout.readline().strip() == "2", worker.communicate()
        assert worker.wait(timeout=60) == 0
    finally:
        worker.kill()
        worker.wait()
    assert [t.state for t in _load(f"journal:{journal}").trials] == [TrialState.COMPLETE] * 2
