"""How workers notice that one of them died: Optuna's heartbeat machinery for both kinds of
storage, and the owner check on top of it.

`study.optimize` beats in a thread; `fail_stale_trials` fails a silent trial and
`RetryHeartbeatStaleTrialCallback` queues its parameters again:
- RDB: Optuna's own heartbeat table (`HeartbeatRDBStorage`);
- journal: Optuna 5's JournalStorage has none, so `HeartbeatJournalStorage` records each beat as a
  trial system attribute and reads them back the same way.
On top of the grace period, a trial whose owner is provably gone (search/storage/owners.py) is
failed at once (`fail_orphaned_trials`) and queued again (`queue_unretried`).
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

# optuna.storages._heartbeat and optuna.storages.journal._file are private (no public name);
# what this module relies on (the heartbeat base class, for which Optuna beats and fails stale
# trials; the journal lock's base class and context) is pinned by tests/test_private_apis.py.
import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.trial import FrozenTrial, TrialState

from batchfit.search.core.trial_count import interrupted_numbers
from batchfit.search.storage.failures import error_reason, lost_connection
from batchfit.search.storage.journal import SafeJournalFileBackend
from batchfit.search.storage.owners import OWNER_ATTR, owner_is_gone, this_owner

BEAT_ATTR = "batchfit:heartbeat"  # journal only: unix time of the trial's last heartbeat
MAX_RETRY = 3  # a trial whose worker died this many times is not queued again
UNRETRIED_SETTLE_S = 5.0  # a failed trial not queued again this long after: its worker died
_log = logging.getLogger(__name__)
# Optuna keeps a trial's constraints in its system attrs; a re-run computes its own.
_NOT_INHERITED = (OWNER_ATTR, BEAT_ATTR, "constraints")


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
            lost = lost_connection(error)
            if lost is None:
                raise
            _log.warning(
                "the heartbeat of the running trial (id %d in the database) was not "
                "recorded: the study's database did not answer (%s); the trial goes on, and "
                "its next record stops the study if the database is still gone",
                trial_id, error_reason(lost),
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
