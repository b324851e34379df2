"""Where a study lives, and how its workers notice that one of them died.

`search.storage` is an Optuna journal file (`journal:PATH`, the default: no server, works on
a shared filesystem) or any RDB URL (`postgresql://...`, `sqlite:///...`). Both get Optuna's
heartbeat machinery (`study.optimize` beats in a thread; `fail_stale_trials` fails a silent
trial and `RetryHeartbeatStaleTrialCallback` queues its parameters again):
- RDB: Optuna's own heartbeat table;
- journal: Optuna 5's JournalStorage has none, so `HeartbeatJournalStorage` records each beat
  as a trial system attribute and reads them back the same way.
On top of the grace period, each running trial records its owner (host, boot, process). A
worker on the same host can prove that owner gone (its process is dead) and fails its trial
at once: a study killed and started again re-runs the killed trial right away; this holds
without heartbeats too (`fail_orphaned_trials`).

The journal file survives its writers' deaths (`SafeJournalFileBackend`): appends hold an
flock(2) on `<journal>.flock`, which the kernel releases when a writer dies, so a process
killed inside an append leaves no lock behind (Optuna's own symlink lock, made from a relative
path, leaves a dangling link that hangs every later writer); an append that fails (disk
full) truncates what it wrote; and a torn record, left by a writer killed mid-write, is
moved aside to `<journal>.torn-<time>` before anything is appended after it.

The end of a study is made once, by one worker (search/decision.py), under `study_lock`: an
flock on `<journal>.decision.flock` beside a journal, a PostgreSQL advisory lock in the
database; and `running_elsewhere` says which trials of other workers that worker waits for.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import json
import logging
import os
import re
import socket
import time
import traceback
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

# optuna.storages._heartbeat and optuna.storages.journal._file are private (no public name);
# what this module relies on (the heartbeat base class, for which Optuna beats and fails stale
# trials; the journal lock's base class and context) is pinned by tests/test_private_apis.py.
import filelock
import optuna
import sqlalchemy
import tenacity
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import BaseStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock
from optuna.storages.journal._file import BaseJournalFileLock, get_lock_file
from optuna.trial import FrozenTrial, TrialState

from search.budget import interrupted_numbers
from tracking.config import ConfigError
from tracking.outputs import store_examples
from tracking.redact import redact

JOURNAL_PREFIX = "journal:"
OWNER_ATTR = "batchfit:owner"  # system attr of a running trial: who runs it
BEAT_ATTR = "batchfit:heartbeat"  # journal only: unix time of the trial's last heartbeat
MAX_RETRY = 3  # a trial whose worker died this many times is not queued again
LOCK_SUFFIX = ".flock"  # beside the journal: the lock its appends hold
DECISION_SUFFIX = ".decision.flock"  # beside the journal: held while a study's end is decided
DECISION_GRACE_S = 600  # no flock: Optuna's symlink lock older than this is a dead holder's
TORN_SUFFIX = ".torn-"  # beside the journal: bytes of a record whose writer died mid-write
UNRETRIED_SETTLE_S = 5.0  # a failed trial not queued again this long after: its worker died
LOCK_WARN_S = 10.0  # say that the journal lock is taking long, this often
_RECORD_START = b'{"op_code":'  # every record of Optuna's journal begins so
_log = logging.getLogger(__name__)
# Optuna keeps a trial's constraints in its system attrs; a re-run computes its own.
_NOT_INHERITED = (OWNER_ATTR, BEAT_ATTR, "constraints")


@cache
def this_owner() -> dict[str, Any]:
    """This process, as another process can recognise it: host, kernel boot, pid, and the
    pid's start time (a pid is reused; its start time is not). SLURM's job id when there."""
    return {
        "host": socket.gethostname(),
        "boot": _boot_id(),
        "pid_namespace": _pid_namespace(),  # containers with one hostname and boot differ here
        "pid": os.getpid(),
        "started": _process_start(os.getpid()),
        "slurm_job": _slurm_job(),
    }


def _slurm_job() -> str | None:
    """The SLURM job, as sacct and scancel name it: <array>_<task> for a job array (Hydra's
    submitit launcher submits one), whose first task's SLURM_JOB_ID is the whole array's."""
    env = os.environ
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _process_start(pid: int) -> int | None:
    """Clock ticks after boot at which `pid` started (Linux); None if it is not running or
    is a zombie (dead, not yet reaped by its parent). Not psutil's create_time(): that adds
    /proc/stat's btime, which Linux recomputes from the wall clock at each read, so two
    processes (or one, across an NTP step) can see one process start at two times
    (psutil #2526), and a live owner would be taken for gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name: field 3 onwards
    return None if fields[0] == "Z" else int(fields[19])


def _on_this_host(owner: dict[str, Any] | None) -> bool:
    """Whether `owner` is a process this one can see: same host, boot and pid namespace."""
    me = this_owner()
    if not owner or owner.get("boot") is None or owner.get("boot") != me["boot"]:
        return False
    return owner.get("host") == me["host"] and owner.get("pid_namespace") == me["pid_namespace"]


def owner_is_gone(owner: dict[str, Any] | None) -> bool:
    """True only when provably gone: same host and boot as us, and its process is no more
    (or the pid now belongs to a younger process). Another host's worker is never provably
    gone; its heartbeat's grace period decides."""
    if not owner or not _on_this_host(owner):
        return False
    return _process_start(int(owner["pid"])) != owner.get("started")


def owner_is_alive(owner: dict[str, Any] | None) -> bool:
    """True only when provably alive: on this host, and its process is still the one that
    recorded itself."""
    if not owner or not _on_this_host(owner):
        return False
    return _process_start(int(owner["pid"])) == owner.get("started")


class RetryStaleTrial:
    """Optuna's RetryHeartbeatStaleTrialCallback, queueing the dead trial's parameters only:
    its user attributes (a killed run's MLflow id, what it trained with) and its owner are not the
    new trial's."""

    def __init__(self, max_retry: int = MAX_RETRY):
        self._retry = RetryHeartbeatStaleTrialCallback(max_retry=max_retry)

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        fresh = copy.deepcopy(trial)
        fresh.user_attrs = {}
        fresh.system_attrs = {
            k: v for k, v in trial.system_attrs.items() if k not in _NOT_INHERITED
        }
        self._retry(study, fresh)


class _Owners:
    """Mixed into a storage: record the owner on a trial's first beat, and find the running
    trials that are stale by this mechanism: a provably gone owner, or a last sign of life
    older than the grace period."""

    _owned: set[int]

    def _record_owner(self, trial_id: int) -> None:
        if trial_id not in self._owned:  # (once recorded: a failed write is tried again)
            self.set_trial_system_attr(trial_id, OWNER_ATTR, this_owner())  # type: ignore[attr-defined]
            self._owned.add(trial_id)

    def _last_sign_of_life(self, trial: FrozenTrial) -> float | None:
        """Unix time of the trial's last beat that this mixin must judge (None: not ours)."""
        raise NotImplementedError

    def _own_stale_ids(self, study_id: int, grace_s: float) -> list[int]:
        running = self.get_all_trials(  # type: ignore[attr-defined]
            study_id, deepcopy=False, states=(TrialState.RUNNING,)
        )
        now = time.time()
        stale = []
        for trial in running:
            last = self._last_sign_of_life(trial)
            silent = last is not None and now - last > grace_s
            if silent or owner_is_gone(trial.system_attrs.get(OWNER_ATTR)):
                stale.append(trial._trial_id)
        return stale


class HeartbeatRDBStorage(_Owners, optuna.storages.RDBStorage):
    """Optuna's RDBStorage, whose heartbeat also records the trial's owner."""

    def __init__(self, url: str, **kwargs: Any):
        super().__init__(url, **kwargs)
        self._owned = set()

    def record_heartbeat(self, trial_id: int) -> None:
        """A beat the database cannot take is said, not raised: raised, it would end Optuna's
        heartbeat thread with a traceback, and no beat would follow once the server is back.
        The trial's own next record, failing too, stops the study (search/__main__.py)."""
        try:
            self._record_owner(trial_id)
            super().record_heartbeat(trial_id)
        except Exception as error:
            lost = _lost_connection(error)
            if lost is None:
                raise
            _log.warning(
                "the heartbeat of the running trial (id %d in the database) was not "
                "recorded: the study's database did not answer (%s); the trial goes on, and "
                "its next record stops the study if the database is still gone",
                trial_id, _reason(lost),
            )  # fmt: skip

    def _last_sign_of_life(self, trial: FrozenTrial) -> float | None:
        # Optuna's heartbeat table judges a trial that has beaten (its owner is recorded at
        # the first beat); one whose worker died before that is as alive as its start.
        if OWNER_ATTR in trial.system_attrs or trial.datetime_start is None:
            return None
        return trial.datetime_start.timestamp()

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        assert self.grace_period is not None  # open_storage gives it
        stale = set(super()._get_stale_trial_ids(study_id))
        return sorted(stale | set(self._own_stale_ids(study_id, self.grace_period)))


class HeartbeatJournalStorage(_Owners, optuna.storages.JournalStorage, BaseHeartbeat):
    """Optuna's JournalStorage with heartbeats kept in the journal itself: each beat appends
    one system-attribute record (one line a minute per running trial by default). Times are
    each host's clock, so hosts sharing a journal need synchronised clocks (NTP), as usual."""

    def __init__(
        self,
        backend: SafeJournalFileBackend,
        heartbeat_interval: int | None,
        grace_period: int | None = None,
        heartbeat_stale_trial_callback: Any = None,
    ):
        super().__init__(backend)
        self._owned = set()
        self.heartbeat_interval = heartbeat_interval
        self.grace_period = grace_period
        self.heartbeat_stale_trial_callback = heartbeat_stale_trial_callback

    def __setstate__(self, state: dict[Any, Any]) -> None:  # a pickled copy owns nothing yet
        super().__setstate__(state)
        self._owned = set()

    def record_heartbeat(self, trial_id: int) -> None:
        self._record_owner(trial_id)
        self.set_trial_system_attr(trial_id, BEAT_ATTR, time.time())

    def _last_sign_of_life(self, trial: FrozenTrial) -> float | None:
        # Before its first beat, a trial is as alive as its start.
        start = trial.datetime_start.timestamp() if trial.datetime_start else None
        return trial.system_attrs.get(BEAT_ATTR, start)

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        assert self.grace_period is not None
        return self._own_stale_ids(study_id, self.grace_period)

    def get_heartbeat_interval(self) -> int | None:
        return self.heartbeat_interval

    def get_heartbeat_stale_trial_callback(self) -> Any:
        return self.heartbeat_stale_trial_callback


class JournalWriteError(OSError):
    """The journal could not be written (a full disk, a read-only or vanished filesystem).
    Nothing of the failed append is left in it: the study resumes once the cause is gone."""


def storage_failure(error: BaseException | None, url: str) -> str | None:
    """What to tell the user when `error` is the study's storage failing, not a bug: a
    journal that could not be written, or a database that stopped answering (its server
    stopped, restarted, crashed or out of reach: SQLAlchemy's OperationalError raised in the
    study's storage, not in MLflow's). None for anything else. The causes are searched:
    Optuna, failing to record the trial's end on the same storage, raises its own error from
    the failure (StorageInternalError, or an UnboundLocalError from its failed-transaction
    handling in Optuna 5)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, JournalWriteError):
            return str(error)
        if _database_gone(error):
            return redact(
                f"the study's database (search.storage={url}) stopped answering "
                f"({_reason(error)}); nothing recorded was lost (a trial that was running is "
                "trained again by the next run). Once the database answers, run the same "
                "command again: the study resumes"
            )
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _database_gone(error: BaseException) -> bool:
    """A connection to the study's database that failed or was lost, raised through Optuna's
    storage or this module (MLflow's SQL store raises the same errors)."""
    if not isinstance(error, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError):
        return False
    modules = (
        frame.f_globals.get("__name__", "") for frame, _ in traceback.walk_tb(error.__traceback__)
    )
    return any(name.startswith(("optuna.storages.", __name__)) for name in modules)


def _lost_connection(error: BaseException | None) -> BaseException | None:
    """The database error under `error` (Optuna wraps it in StorageInternalError), if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if _database_gone(error):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _reason(error: BaseException) -> str:
    """`Type: first line` of the driver's own error (psycopg's says what the server did)."""
    cause = getattr(error, "orig", None) or error
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__


class FlockJournalLock(BaseJournalFileLock):
    """An exclusive flock(2) on `<journal>.flock` (or another `suffix`), through filelock's
    UnixFileLock. The kernel releases it when its holder dies, however it dies, so no stale
    lock is ever left behind. Local filesystems, NFS (v3 with lockd, v4) and Lustre or GPFS
    mounted with flock support it; a wait longer than `warn_s` is said, with the lock's path
    and `held_by`, every `warn_s`. Each thread holds it through a descriptor of its own, so
    threads exclude each other as processes do (a thread taking it again only counts)."""

    def __init__(
        self,
        journal: Path,
        suffix: str = LOCK_SUFFIX,
        held_by: str = "another process is writing the study (a stopped or hung one holds it "
        "until it ends)",
        warn_s: float | None = None,  # None: LOCK_WARN_S
    ):
        self.path = Path(f"{journal}{suffix}")
        self.held_by = held_by
        self.warn_s = warn_s
        self._lock = self._flock()

    def _flock(self) -> filelock.UnixFileLock:
        # No soft fallback: where flock is missing, the backend uses Optuna's symlink lock
        # (_flock_works), as every other writer of the journal then does.
        return filelock.UnixFileLock(
            self.path, mode=0o644, poll_interval=0.01, fallback_to_soft=False
        )

    def __getstate__(self) -> dict[str, Any]:  # a pickled storage (a launcher's worker)
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = self._flock()

    def acquire(self) -> bool:
        started = time.monotonic()
        while True:
            try:
                self._lock.acquire(timeout=self.warn_s or LOCK_WARN_S)
                return True
            except filelock.Timeout:
                waited = time.monotonic() - started
                _log.warning("waiting %.0f s for the lock %s: %s", waited, self.path, self.held_by)

    def release(self) -> None:
        self._lock.release()


def _flock_works(journal: Path) -> bool:
    lock = FlockJournalLock(journal)
    try:
        lock.acquire()
    except OSError as error:
        if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return False
        raise
    lock.release()
    return True


class SafeJournalFileBackend(JournalFileBackend):
    """Optuna's journal file, safe against its writers' deaths and a full disk:
    - appends hold a FlockJournalLock (Optuna's symlink lock on a filesystem without flock);
    - the path is absolute, so no lock or message depends on the working directory;
    - an append that fails truncates the journal back to where it began, and raises
      JournalWriteError;
    - bytes after the last complete record (a writer killed mid-write) are moved aside to
      `<journal>.torn-<time>` before the next append, and at open also a record that a
      later append was glued onto (the next record is kept). `notes` says what was moved."""

    def __init__(self, path: str | Path):
        journal = Path(path).absolute()
        journal.parent.mkdir(parents=True, exist_ok=True)
        lock = (
            FlockJournalLock(journal)
            if _flock_works(journal)
            else JournalFileSymlinkLock(str(journal))
        )
        super().__init__(str(journal), lock_obj=lock)
        self.lock = lock  # our own reference: the backend's (`_lock`) is private
        self.path = journal
        self.notes: list[str] = []
        self._opened = False
        _remove_dangling_link(Path(f"{journal}.lock"), self.notes)
        with get_lock_file(self.lock):
            self._repair()
        self._opened = True

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        data = ("\n".join(json.dumps(log, separators=(",", ":")) for log in logs) + "\n").encode()
        # Unbuffered: every byte the kernel took is one `_write` knows of, and none is left
        # in a buffer for closing the file to flush after the cut below (the tail of a
        # record, which a running worker then fails to parse).
        with get_lock_file(self.lock), open(self.path, "a+b", buffering=0) as f:
            end = f.seek(0, os.SEEK_END)
            try:
                if end and _byte_at(f, end - 1) != b"\n":
                    end = self._cut_torn_tail(f, end)
                self._write(f, data)
            except OSError as error:
                _truncate_quietly(f, end)
                raise JournalWriteError(
                    error.errno,
                    f"the study's journal {self.path} could not be written "
                    f"({os.strerror(error.errno) if error.errno else error}); nothing was lost "
                    "but the record being written. Free the space (or fix the filesystem) and "
                    "run the same command again: the study resumes",
                ) from None

    @staticmethod
    def _write(f: Any, data: bytes) -> None:
        """All of `data`, to the file's end (O_APPEND), through write(2) itself: a short
        write is continued, and the first error raised with nothing of it buffered."""
        view = memoryview(data)
        while view:
            view = view[os.write(f.fileno(), view) :]
        os.fsync(f.fileno())

    def _cut_torn_tail(self, f: Any, end: int) -> int:
        """Move the bytes after the last newline aside; the new end of the journal."""
        keep = _last_newline(f, end) + 1
        f.seek(keep)
        torn = f.read(end - keep)
        self._set_aside([torn], f"{end - keep} bytes of a record whose writer died mid-write")
        os.ftruncate(f.fileno(), keep)
        os.fsync(f.fileno())
        return keep

    def _repair(self) -> None:
        """At open: every record complete. A torn tail is cut; a line that does not parse
        (a torn record with the next one appended to it) keeps the record it ends with."""
        data = self.path.read_bytes()
        *lines, tail = data.split(b"\n")
        kept, torn = [], []
        for line in lines:
            record, scrap = _whole_record(line)
            if scrap:
                torn.append(scrap)
            if record is not None:
                kept.append(record)
        if not torn:
            if tail:
                with open(self.path, "a+b") as f:
                    self._cut_torn_tail(f, len(data))
            return
        if tail:
            torn.append(tail)
        self._set_aside(torn, "a torn record" if len(torn) == 1 else f"{len(torn)} torn records")
        fresh = self.path.with_name(f".{self.path.name}.{os.getpid()}.repair")
        with open(fresh, "wb") as f:
            f.write(b"".join(line + b"\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        fresh.replace(self.path)

    def _set_aside(self, pieces: list[bytes], what: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        aside = self.path.with_name(f"{self.path.name}{TORN_SUFFIX}{stamp}-{os.getpid()}")
        with open(aside, "ab") as f:
            f.write(b"\n".join(pieces) + b"\n")
        note = (
            f"the study's journal held {what}; the complete records are kept and the "
            f"torn bytes moved to {aside}"
        )
        self.notes.append(note)
        if self._opened:  # at open, the driver prints the notes with its others
            _log.warning(note)


def _byte_at(f: Any, offset: int) -> bytes:
    f.seek(offset)
    return f.read(1)


def _last_newline(f: Any, end: int, block: int = 1 << 16) -> int:
    """Offset of the last newline before `end` (-1: none)."""
    stop = end
    while stop > 0:
        start = max(0, stop - block)
        f.seek(start)
        found = f.read(stop - start).rfind(b"\n")
        if found >= 0:
            return start + found
        stop = start
    return -1


def _whole_record(line: bytes) -> tuple[bytes | None, bytes]:
    """(the record the line holds, or None; the bytes of it that are no record)."""
    try:
        json.loads(line)
        return line, b""
    except ValueError:
        pass
    cut = line.rfind(_RECORD_START, 1)
    while cut > 0:
        try:
            json.loads(line[cut:])
            return line[cut:], line[:cut]
        except ValueError:
            cut = line.rfind(_RECORD_START, 1, cut)
    return None, line


def _truncate_quietly(f: Any, size: int) -> None:
    with contextlib.suppress(OSError):  # the write's own error is the one to report
        os.ftruncate(f.fileno(), size)


def _remove_dangling_link(link: Path, notes: list[str]) -> None:
    """Optuna's symlink lock of a relative journal path points nowhere; one left by a killed
    writer of an older batchfit would be taken for a live lock by Optuna."""
    if link.is_symlink() and not link.exists():
        link.unlink(missing_ok=True)
        notes.append(f"removed {link}, a lock left by a writer that died (it pointed nowhere)")


def fail_orphaned_trials(study: optuna.Study) -> list[int]:
    """Without heartbeats: fail the running trials whose owner is provably gone (same host,
    process dead) and queue their parameters again, as a heartbeat check would. Returns the
    numbers of the trials failed here."""
    storage = study._storage
    failed = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not owner_is_gone(trial.system_attrs.get(OWNER_ATTR)):
            continue
        try:
            changed = storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
        except UpdateFinishedTrialError:
            continue  # another worker got there first
        if changed:
            RetryStaleTrial()(study, study._storage.get_trial(trial._trial_id))
            failed.append(trial.number)
    return failed


def queue_unretried(study: optuna.Study, settle_s: float = UNRETRIED_SETTLE_S) -> list[int]:
    """Queue again the parameters of interrupted trials that were failed but never queued
    (their worker died between the two records, or was stopped there): failed at least
    `settle_s` ago (a live worker queues its own at once), no trial made from them yet, and
    fewer than MAX_RETRY before them. The numbers queued."""
    trials = study.get_trials(deepcopy=False)
    # A retry's retry_history ends with the trial it was made from (its failed_trial is the
    # first of the line).
    retried = {
        t.system_attrs["retry_history"][-1] for t in trials if t.system_attrs.get("retry_history")
    }
    now = time.time()
    queued = []
    for number in sorted(interrupted_numbers(study) - retried):
        trial = trials[number]
        ended = trial.datetime_complete.timestamp() if trial.datetime_complete else now
        if len(trial.system_attrs.get("retry_history", [])) < MAX_RETRY and now - ended >= settle_s:
            RetryStaleTrial()(study, trial)
            queued.append(number)
    return queued


def record_owner(study: optuna.Study, trial_id: int) -> None:
    """Say who runs this trial (heartbeats do it on their first beat)."""
    study._storage.set_trial_system_attr(trial_id, OWNER_ATTR, this_owner())


def running_elsewhere(study: optuna.Study, storage: BaseStorage) -> list[FrozenTrial]:
    """The study's running trials that their workers may still finish: with heartbeats,
    those the heartbeat check would not fail (silent past the grace period, or an owner
    provably gone); without, those whose owner is provably alive (its process on this host).
    Without heartbeats a worker on another host that died is never noticed, so its trials
    are not waited for (search.heartbeat_interval_s says the same)."""
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    if isinstance(storage, BaseHeartbeat) and storage.get_heartbeat_interval():
        study_id = storage.get_study_id_from_name(study.study_name)
        stale = set(storage._get_stale_trial_ids(study_id))
        return [t for t in running if t._trial_id not in stale]
    return [t for t in running if owner_is_alive(t.system_attrs.get(OWNER_ATTR))]


@contextlib.contextmanager
def study_lock(storage: BaseStorage, study_name: str) -> Iterator[None]:
    """Held by one process at a time among all the study's workers, on any host, and
    released when its holder dies however it dies:
    - journal file: an flock on `<journal>.decision.flock` (one per journal); where the
      filesystem has no flock, Optuna's symlink lock `<journal>.decision.lock`, taken over
      from a holder that kept it DECISION_GRACE_S (a dead one);
    - PostgreSQL: a session advisory lock keyed by the study's name, on a connection of its
      own (the server releases it when that connection ends);
    - SQLite and in-memory storages have one worker (validate refuses more): no lock;
      neither for another database (MySQL), where two workers ending at once may each
      decide (the later decision is the study's)."""
    backend = getattr(storage, "_backend", None)
    if isinstance(backend, SafeJournalFileBackend):
        lock: BaseJournalFileLock
        if isinstance(backend.lock, FlockJournalLock):
            lock = FlockJournalLock(
                backend.path,
                DECISION_SUFFIX,
                "another worker is deciding the study's recommendation",
                warn_s=60.0,  # a speed check takes tens of seconds
            )
        else:
            lock = JournalFileSymlinkLock(f"{backend.path}.decision", DECISION_GRACE_S)
        with get_lock_file(lock):
            yield
        return
    engine = getattr(storage, "engine", None)
    if engine is not None and engine.dialect.name == "postgresql":
        with _advisory_lock(engine, study_name):
            yield
        return
    yield


@contextlib.contextmanager
def _advisory_lock(engine: Any, study_name: str) -> Iterator[None]:
    digest = hashlib.sha256(f"batchfit:study_lock:{study_name}".encode()).digest()
    key = {"key": int.from_bytes(digest[:8], "big", signed=True)}  # PostgreSQL's bigint
    with engine.connect() as connection:
        connection.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), key)
        connection.commit()
        try:
            yield
        finally:
            try:
                connection.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:key)"), key)
                connection.commit()
            except Exception:
                connection.invalidate()  # closed, never back to the pool holding the lock
                raise


def _lost_creation_race(error: BaseException) -> bool:
    """The errors of a worker that lost the race to create the tables: PostgreSQL's "already
    exists", "duplicate key" (UniqueViolation), and SQLite's "UNIQUE constraint failed" (two
    workers inserting alembic_version's one row)."""
    return bool(
        re.search(r"already exists|duplicate key|UniqueViolation|UNIQUE constraint", str(error))
    )


@tenacity.retry(
    retry=tenacity.retry_if_exception(_lost_creation_race),
    stop=tenacity.stop_after_attempt(5),
    wait=tenacity.wait_random(0.2, 1.2),
    reraise=True,
)
def _create_rdb(url: str, heartbeat: dict[str, Any]) -> HeartbeatRDBStorage:
    """Workers starting together on a new database all create Optuna's tables; the losers
    of that race see "already exists" or a duplicate key, and find the tables made on a
    later try (five in all; the last one's error is raised as it is)."""
    return HeartbeatRDBStorage(url, **heartbeat)


def open_storage(url: str, heartbeat_interval_s: int | None) -> BaseStorage:
    """An Optuna storage for `url`: any RDB URL, or journal:PATH for a journal file; with
    heartbeats every `heartbeat_interval_s` seconds (None: off) and a grace of twice that."""
    heartbeat: dict[str, Any] = {}
    if heartbeat_interval_s:
        heartbeat = {
            "heartbeat_interval": heartbeat_interval_s,
            "grace_period": 2 * heartbeat_interval_s,
            "heartbeat_stale_trial_callback": RetryStaleTrial(),
        }
    try:
        if url.startswith(JOURNAL_PREFIX):
            backend = SafeJournalFileBackend(url.removeprefix(JOURNAL_PREFIX))
            if heartbeat:
                return HeartbeatJournalStorage(backend, **heartbeat)
            return optuna.storages.JournalStorage(backend)
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        return _create_rdb(url, heartbeat)
    except Exception as error:  # noqa: BLE001 - any failure here is the URL's
        reason = str(error).splitlines()[0] if str(error) else ""
        raise ConfigError(
            [
                f"search.storage={redact(url)!r} cannot be opened ({type(error).__name__}: "
                f"{redact(reason)}); use a reachable database URL or a journal file in a "
                f"folder that can be written, e.g. {store_examples()[0]}"
            ]
        ) from None
