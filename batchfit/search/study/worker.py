"""One worker's loop over trials: take trials until the study, counted over all its workers,
has search.n_trials trained (search/core/trial_count.py), search.timeout_s has passed, or the
space is spent.

While the trials running elsewhere would complete the study, the worker waits: if their
worker dies, its trial is failed (Optuna's heartbeat check, or its owner gone: see
search/storage/) and queued again with its parameters, and this worker runs it. Trials
whose worker died get their MLflow runs ended as KILLED, once, by any worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import optuna
from optuna.trial import TrialState
from rich.console import Console

from batchfit.search.core.record import TrialRecord
from batchfit.search.core.study_config import SearchConfig
from batchfit.search.core.trial_count import (
    TrialBudget,
    claims_slot,
    interrupted_numbers,
    num_running,
    num_trained,
    should_start_trial,
    study_records,
)
from batchfit.search.sampling.sampler import grid_exhausted
from batchfit.search.storage.heartbeat import RetryStaleTrial, fail_orphaned_trials, queue_unretried
from batchfit.search.storage.owners import OWNER_ATTR, record_owner
from batchfit.search.trial.ending import TrialFailed, write
from batchfit.search.trial.objective import Objective
from batchfit.tracking.outbox import is_transient
from batchfit.tracking.runs import Tracker

IDLE_POLL_S = 2.0  # an idle worker looks for dead workers' trials this often


class Surplus(Exception):
    """A trial started past search.n_trials by a worker racing another; it does not run."""


def _owner_text(owner: dict | None) -> str:
    if not owner:
        return "owner unknown"
    job = f", SLURM job {owner['slurm_job']}" if owner.get("slurm_job") else ""
    return f"host {owner.get('host')}, pid {owner.get('pid')}{job}"


class TrialLoop:
    def __init__(
        self,
        study: optuna.Study,
        settings: SearchConfig,
        budget: TrialBudget,
        tracker: Tracker,
    ):
        self.study = study
        self.settings = settings
        self.budget = budget
        self.tracker = tracker
        self.current: int | None = None  # the trial this worker is running
        self._killed_seen: set[int] = set()
        self._started = time.monotonic()  # search.timeout_s counts from here
        self._timeout_said = False

    def run(self, objective: Objective, callbacks: list, console: Console) -> None:
        """Take trials until the study (all workers together) has search.n_trials trained.
        While the trials running elsewhere would complete it, wait instead: if their worker
        dies, its trial is failed (fail_stale_trials, Optuna's heartbeat check) and queued
        again with its parameters, and this worker runs it."""
        self._started = time.monotonic()
        n_trials = self.settings.n_trials
        said_waiting = False
        beats = bool(self.settings.heartbeat_interval_s)
        while True:
            optuna.storages.fail_stale_trials(self.study)  # with heartbeats only
            failed = fail_orphaned_trials(self.study)  # the owner is gone: needs no beat
            failed += queue_unretried(self.study)  # failed, but died before queueing it
            if failed:
                console.print(
                    f"trials {failed} were left unfinished by a process that died: their "
                    "parameters run again"
                )
            self._end_killed_runs(console)
            start = should_start_trial(self.study, n_trials)
            if start and (self._space_spent(console) or self._timed_out(console)):
                return
            if start is None and not beats:
                # Without heartbeats a trial running in a worker elsewhere is never failed
                # if that worker died: do not wait forever, but say it.
                self._say_orphaned(console)
                return
            if start is False:
                return
            if start is None:
                if not said_waiting:
                    console.print(
                        f"waiting: {num_running(self.study)} trials running in other workers "
                        "complete the study; a trial whose worker dies is run here"
                    )
                    said_waiting = True
                self.tracker.outbox.drain()
                time.sleep(IDLE_POLL_S)
                continue
            said_waiting = False
            self.study.optimize(
                self._within_n_trials(objective),
                n_trials=1,
                catch=(TrialFailed, Surplus),
                callbacks=callbacks,
            )

    def _timed_out(self, console: Console) -> bool:
        """Whether search.timeout_s has passed since this worker began, with a trial
        completed (a study that must end on time still answers)."""
        limit = self.settings.timeout_s
        elapsed = time.monotonic() - self._started
        if limit is None or elapsed < limit:
            return False
        if not self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if not self._timeout_said:
                self._timeout_said = True
                console.print(
                    f"search.timeout_s={limit:g} has passed with no trial completed: trials go "
                    "on until one completes, for a recommendation"
                )
            return False
        console.print(
            f"search.timeout_s={limit:g} reached ({elapsed:.0f} s): no new trial starts; "
            f"{num_trained(study_records(self.study))} of {self.settings.n_trials} "
            "trials trained, "
            "and the recommendation is from them. Run the same command again to go on (it "
            "resumes the study), or with search.timeout_s=null to run to search.n_trials.",
            soft_wrap=True,
        )
        return True

    def _say_orphaned(self, console: Console) -> None:
        running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        owners = ", ".join(
            f"#{t.number} ({_owner_text(t.system_attrs.get(OWNER_ATTR))})" for t in running
        )
        console.print(
            f"[yellow]{len(running)} trials are still running elsewhere: {owners}.[/yellow] "
            "With search.heartbeat_interval_s=null a worker that died on another host is "
            "never noticed: if it is gone, its trial stays RUNNING and the study is short of "
            "search.n_trials. Set search.heartbeat_interval_s (e.g. 60) to have it run again.",
            soft_wrap=True,
        )

    def _space_spent(self, console: Console) -> bool:
        """Whether the study ends short of search.n_trials (search/core/trial_count.py says why)."""
        why = self.budget.spent(self.study, grid_exhausted(self.study.sampler, self.study))
        if why is not None:
            console.print(why, soft_wrap=True)
        return why is not None

    def _within_n_trials(self, objective: Objective) -> Callable[[optuna.Trial], list[float]]:
        n_trials = self.settings.n_trials
        beats = bool(self.settings.heartbeat_interval_s)

        def run_if_within(trial: optuna.Trial) -> list[float]:
            if not beats:  # heartbeats record it; without them the owner still counts
                record_owner(self.study, trial._trial_id)
            if not claims_slot(self.study, trial.number, n_trials):
                # Nothing sampled or recorded yet; FAIL without an error: not counted.
                write(trial, TrialRecord(trial.number, "RUNNING", surplus=True))
                raise Surplus(f"trial {trial.number} started past search.n_trials={n_trials}")
            self.current = trial.number
            values = objective(trial)
            self.current = None
            return values

        return run_if_within

    def _end_killed_runs(self, console: Console) -> None:
        """Trials whose worker died: their MLflow runs end as KILLED (once, by any worker)."""
        new = interrupted_numbers(self.study) - self._killed_seen
        if new:
            try:
                ended = self.tracker.end_killed_runs(new)
            except Exception as error:
                if not is_transient(error):
                    raise
                return  # MLflow is away: try again on the next pass
            for number in ended:
                console.print(f"#{number:<3} KILLED: its worker died; its parameters run again")
            self._killed_seen |= new

    def queue_again_interrupted(self) -> None:
        number, self.current = self.current, None
        if number is None:
            return
        trial = self.study.get_trials(deepcopy=False)[number]
        if trial.state == TrialState.RUNNING:  # stopped before Optuna could tell it
            self.study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
            trial = self.study._storage.get_trial(trial._trial_id)
        if trial.state == TrialState.FAIL and not TrialRecord.of(trial).is_finished:
            RetryStaleTrial()(self.study, trial)
