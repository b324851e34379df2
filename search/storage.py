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
at once: a study killed and started again re-runs the killed trial right away.
"""

from __future__ import annotations

import copy
import os
import random
import re
import socket
import time
from functools import cache
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState

from search.redact import redact
from train.config import ConfigError

JOURNAL_PREFIX = "journal:"
OWNER_ATTR = "batchfit:owner"  # system attr of a running trial: who runs it
BEAT_ATTR = "batchfit:heartbeat"  # journal only: unix time of the trial's last heartbeat
MAX_RETRY = 3  # a trial whose worker died this many times is not queued again
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
    is a zombie (dead, not yet reaped by its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name: field 3 onwards
    return None if fields[0] == "Z" else int(fields[19])


def owner_is_gone(owner: dict[str, Any] | None) -> bool:
    """True only when provably gone: same host and boot as us, and its process is no more
    (or the pid now belongs to a younger process). Another host's worker is never provably
    gone; its heartbeat's grace period decides."""
    if not owner or owner.get("boot") is None or owner.get("boot") != this_owner()["boot"]:
        return False
    me = this_owner()
    if owner.get("host") != me["host"] or owner.get("pid_namespace") != me["pid_namespace"]:
        return False
    return _process_start(int(owner["pid"])) != owner.get("started")


class RetryStaleTrial:
    """Optuna's RetryHeartbeatStaleTrialCallback, queueing the dead trial's parameters only:
    its user attributes (a killed run's MLflow id, a partial peak) and its owner are not the
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
    """Mixed into a storage: record the owner on a trial's first beat, and count a running
    trial whose owner is provably gone as stale at once."""

    _owned: set[int]

    def _record_owner(self, trial_id: int) -> None:
        if trial_id not in self._owned:
            self._owned.add(trial_id)
            self.set_trial_system_attr(trial_id, OWNER_ATTR, this_owner())  # type: ignore[attr-defined]

    def _orphan_ids(self, study_id: int) -> list[int]:
        running = self.get_all_trials(  # type: ignore[attr-defined]
            study_id, deepcopy=False, states=(TrialState.RUNNING,)
        )
        return [t._trial_id for t in running if owner_is_gone(t.system_attrs.get(OWNER_ATTR))]


class HeartbeatRDBStorage(_Owners, optuna.storages.RDBStorage):
    """Optuna's RDBStorage, whose heartbeat also records the trial's owner."""

    def __init__(self, url: str, **kwargs: Any):
        super().__init__(url, **kwargs)
        self._owned = set()

    def record_heartbeat(self, trial_id: int) -> None:
        self._record_owner(trial_id)
        super().record_heartbeat(trial_id)

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        # Optuna's check sees only trials with a heartbeat row; one whose worker died before
        # its first beat (its owner is recorded then) is as alive as its start.
        stale = set(super()._get_stale_trial_ids(study_id)) | set(self._orphan_ids(study_id))
        assert self.grace_period is not None  # open_storage gives it
        for trial in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
            started = trial.datetime_start
            silent = OWNER_ATTR not in trial.system_attrs and started is not None
            if silent and time.time() - started.timestamp() > self.grace_period:
                stale.add(trial._trial_id)
        return sorted(stale)


class HeartbeatJournalStorage(_Owners, optuna.storages.JournalStorage, BaseHeartbeat):
    """Optuna's JournalStorage with heartbeats kept in the journal itself: each beat appends
    one system-attribute record (one line a minute per running trial by default). Times are
    each host's clock, so hosts sharing a journal need synchronised clocks (NTP), as usual."""

    def __init__(
        self,
        backend: JournalFileBackend,
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

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        assert self.grace_period is not None
        now = time.time()
        stale = []
        for trial in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
            # Before its first beat, a trial is as alive as its start.
            last = trial.system_attrs.get(BEAT_ATTR)
            if last is None and trial.datetime_start is not None:
                last = trial.datetime_start.timestamp()
            owner = trial.system_attrs.get(OWNER_ATTR)
            if owner_is_gone(owner) or (last is not None and now - last > self.grace_period):
                stale.append(trial._trial_id)
        return stale

    def get_heartbeat_interval(self) -> int | None:
        return self.heartbeat_interval

    def get_heartbeat_stale_trial_callback(self) -> Any:
        return self.heartbeat_stale_trial_callback


def _create_rdb(url: str, heartbeat: dict[str, Any]) -> HeartbeatRDBStorage:
    """Workers starting together on a new database all create Optuna's tables; the losers
    of that race see "already exists" or a duplicate key, and find the tables made on a
    second try."""
    for attempt in range(5):
        try:
            return HeartbeatRDBStorage(url, **heartbeat)
        except Exception as error:  # noqa: BLE001 - re-raised unless it is that race
            racing = re.search(r"already exists|duplicate key|UniqueViolation", str(error))
            if not racing or attempt == 4:
                raise
            time.sleep(0.2 + random.random())
    raise AssertionError("unreachable")


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
            path = Path(url.removeprefix(JOURNAL_PREFIX))
            path.parent.mkdir(parents=True, exist_ok=True)
            backend = JournalFileBackend(str(path))
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
                f"{redact(reason)}); use a reachable database URL or a journal file, e.g. "
                "search.storage=journal:mlruns/optuna.journal"
            ]
        ) from None
