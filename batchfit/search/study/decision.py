"""One answer per study: the recommendation, and the speed check it rests on, are made once,
by one worker, and every worker of the study prints and writes that same answer.

The workers of one study end together (the study's last trial ends them all), and each used
to time the candidates on the same cores at once and write a best.yaml of its own, which the
parent MLflow run kept whichever came last. Now:
- a worker whose loop has ended waits while other workers' trials run (`wait_for_others`),
  so that the last to finish decides; a dead worker's trials are not waited for (judged as
  the heartbeat check judges them: search/storage/owners.py `running_elsewhere`);
- under the study's lock (search/storage/locks.py `study_lock`: an flock beside the journal, a
  PostgreSQL advisory lock) the first to take it runs the speed check and the
  recommendation, and stores the `Decision` in the study (user attr `decision`): the
  finished trials it was made from, the recommended trial and best.yaml as written;
- the others, taking the lock after, find a decision made from the same finished trials
  and reuse it: no second speed check, and best.yaml byte for byte.
A study resumed for more trials has other finished trials, so its end decides anew.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import optuna
from optuna.storages import BaseStorage

from batchfit.search.core.trial_count import num_trained, study_records
from batchfit.search.storage.locks import study_lock
from batchfit.search.storage.owners import running_elsewhere, this_owner

DECISION_ATTR = "decision"
POLL_S = 2.0  # a worker waiting for the others' trials looks at the study this often


@dataclass(frozen=True)
class Decision:
    """The study's answer, as one worker made it."""

    finished: tuple[int, ...]  # the finished trials it was made from (TrialRecord.is_finished)
    trial: int | None  # the recommended trial; None: no trial has the metric yet
    best_yaml: str | None  # best.yaml as every worker writes it (None with no trial)
    made_by: str  # 'host HOST, pid PID': the worker that made it
    made_at: float | None = None  # when (time.time()); None: stored before it was kept

    @classmethod
    def stored(cls, study: optuna.Study) -> Decision | None:
        found = study.user_attrs.get(DECISION_ATTR)
        if not found:
            return None
        return cls(
            tuple(found["finished"]),
            found["trial"],
            found["best_yaml"],
            found["made_by"],
            found.get("made_at"),
        )

    def reused(self, started_at: float, num_finished: int, num_uncounted: int = 0) -> str:
        """What a process that reuses this decision says of it: made by an earlier run of
        the study (before `started_at`, this process's start: the same command run again)
        or by another worker running with this one; from `num_finished` trials counted as the
        summary counts them, and `num_uncounted` answered without training."""
        if self.made_at is not None and self.made_at < started_at:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.made_at))
            who, mine = f"an earlier run of this study ({when}, {self.made_by})", "run"
        elif self.made_at is not None:
            who, mine = f"another worker of this study ({self.made_by})", "worker"
        else:
            who, mine = f"another worker or an earlier run of this study ({self.made_by})", "run"
        uncounted = (
            f" (and {num_uncounted} not counted in search.n_trials)" if num_uncounted else ""
        )
        return (
            f"The recommendation was made by {who} from the same {num_finished} finished "
            f"trials{uncounted}: its speed check and best.yaml are this {mine}'s too"
        )

    def store(self, study: optuna.Study) -> None:
        study.set_user_attr(DECISION_ATTR, {**asdict(self), "finished": list(self.finished)})


def finished_trials(study: optuna.Study) -> tuple[int, ...]:
    """What a decision is made from, and whose change (a resumed study) calls for a new one."""
    return tuple(sorted(t.number for t in study_records(study) if t.is_finished))


def wait_for_others(
    study: optuna.Study,
    storage: BaseStorage,
    n_trials: int,
    say: Callable[[str], None],
    poll_s: float = POLL_S,
) -> None:
    """Return once no other worker's trial runs (said once, when there are some). A study
    short of `n_trials` (this worker stopped early: search.timeout_s, a spent space) is
    looked at once more `poll_s` later, as another worker may be between two trials."""
    said, quiet = False, False
    while True:
        running = running_elsewhere(study, storage)
        if not running and (quiet or num_trained(study_records(study)) >= n_trials):
            return
        quiet = not running
        if running and not said:
            say(
                f"Waiting for {len(running)} running trial{'s' * (len(running) > 1)} of other "
                "workers: the last worker to finish makes the study's recommendation, once, "
                "for all of them"
            )
            said = True
        time.sleep(poll_s)


def decide(
    study: optuna.Study,
    storage: BaseStorage,
    make: Callable[[], tuple[int | None, str | None]],
) -> tuple[Decision, bool]:
    """The study's decision and whether this worker made it: under the study's lock, the
    stored one if it was made from the trials finished now, else `make()` (the speed check
    and the recommendation: the trial, its best.yaml), stored for the others."""
    with study_lock(storage, study.study_name):
        finished = finished_trials(study)
        found = Decision.stored(study)
        if found is not None and found.finished == finished:
            return found, False
        trial, best_yaml = make()
        owner = this_owner()
        made_by = f"host {owner['host']}, pid {owner['pid']}"
        made = Decision(finished, trial, best_yaml, made_by, time.time())
        made.store(study)
        return made, True
