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

from tracking.redact import redact
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
    """Mixed into a storage: record the owner on a trial's first beat, and find the running
    trials that are stale by this mechanism: a provably gone owner, or a last sign of life
    older than the grace period."""

    _owned: set[int]

    def _record_owner(self, trial_id: int) -> None:
        if trial_id not in self._owned:
            self._owned.add(trial_id)
            self.set_trial_system_attr(trial_id, OWNER_ATTR, this_owner())  # type: ignore[attr-defined]

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
        self._record_owner(trial_id)
        super().record_heartbeat(trial_id)

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


def _create_rdb(url: str, heartbeat: dict[str, Any]) -> HeartbeatRDBStorage:
    """Workers starting together on a new database all create Optuna's tables; the losers
    of that race see "already exists" or a duplicate key, and find the tables made on a
    later try."""
    for _ in range(4):
        try:
            return HeartbeatRDBStorage(url, **heartbeat)
        except Exception as error:  # noqa: BLE001 - re-raised unless it is that race
            if not re.search(r"already exists|duplicate key|UniqueViolation", str(error)):
                raise
            time.sleep(0.2 + random.random())
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
