"""search/study/decision.py: one answer per study. Real processes race for the decision on the
study's own storage (a journal file; PostgreSQL where tests/cluster/services.sh runs one) and
exactly one makes it; a decision is reused for the same finished trials only; the end waits
for other workers' live trials, not for a dead worker's. The whole study with two real
workers is tests/test_workers.py::test_two_workers_give_one_answer."""

from __future__ import annotations

import multiprocessing
import subprocess
import threading
import time
from pathlib import Path

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from batchfit.search.storage.heartbeat import BEAT_ATTR
from batchfit.search.storage.locks import DECISION_SUFFIX
from batchfit.search.storage.opening import open_storage
from batchfit.search.storage.owners import OWNER_ATTR, _process_start, running_elsewhere, this_owner
from batchfit.search.study.decision import Decision, decide, finished_trials, wait_for_others
from tests.cluster.conftest import postgres_url  # noqa: F401 - the fixture, for the PG race

NAME = "one-answer"
MAKE_S = 1.0  # how long a decision takes to make: the racers overlap well within it


def _study(url: str, heartbeat_s: int | None = None) -> tuple[optuna.Study, object]:
    storage = open_storage(url, heartbeat_s)
    study = optuna.create_study(study_name=NAME, storage=storage, load_if_exists=True)
    return study, storage


def _add_finished(study: optuna.Study, value: float) -> None:
    x = FloatDistribution(0, 1)
    study.add_trial(create_trial(params={"x": value}, distributions={"x": x}, value=value))


def _race(url: str, made: str, answers: str, start: object) -> None:
    """One racer: wait for the start, then decide; `made` gets a line per decision made,
    `answers` the best.yaml each racer ends with."""
    study, storage = _study(url)
    start.wait()

    def make() -> tuple[int | None, str | None]:
        with open(made, "a") as f:
            f.write("made\n")
        time.sleep(MAKE_S)  # the speed check's place: the other racer arrives meanwhile
        return 1, f"trial: 1  # decided by {multiprocessing.current_process().name}\n"

    decision, _ = decide(study, storage, make)
    with open(answers, "a") as f:
        f.write(decision.best_yaml)


def _racers_decide_once(url: str, tmp_path: Path) -> None:
    study, _ = _study(url)
    for value in (0.2, 0.8):
        _add_finished(study, value)
    made, answers = tmp_path / "made.txt", tmp_path / "answers.txt"
    context = multiprocessing.get_context("spawn")  # real processes, nothing inherited
    start = context.Event()
    racers = [
        context.Process(target=_race, args=(url, str(made), str(answers), start), name=f"r{i}")
        for i in range(2)
    ]
    for racer in racers:
        racer.start()
    time.sleep(0.5)  # both opened the study
    start.set()
    for racer in racers:
        racer.join(timeout=120)
        assert racer.exitcode == 0
    assert made.read_text() == "made\n"  # one speed check and recommendation, not two
    first, second = answers.read_text().splitlines()
    assert first == second  # the same best.yaml, byte for byte
    stored = Decision.stored(optuna.load_study(study_name=NAME, storage=open_storage(url, None)))
    assert stored.finished == (0, 1) and stored.trial == 1


def test_two_processes_racing_on_a_journal_decide_once(tmp_path: Path) -> None:
    journal = tmp_path / "optuna.journal"
    _racers_decide_once(f"journal:{journal}", tmp_path)
    assert Path(f"{journal}{DECISION_SUFFIX}").exists()  # the lock beside the journal


@pytest.mark.cluster
def test_two_processes_racing_on_postgresql_decide_once(
    postgres_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    _racers_decide_once(postgres_url, tmp_path)


def test_a_decision_is_reused_for_the_same_finished_trials_only(tmp_path: Path) -> None:
    study, storage = _study(f"journal:{tmp_path}/optuna.journal")
    _add_finished(study, 0.5)
    calls = []

    def make() -> tuple[int | None, str | None]:
        calls.append(len(study.trials))
        return 0, f"made from {len(study.trials)} trials\n"

    first, made_here = decide(study, storage, make)
    assert made_here and first.finished == (0,)
    again, made_here = decide(study, storage, make)
    assert not made_here and again == first and calls == [1]
    # A running trial changes nothing; the study resumed for one more trial decides anew.
    study.ask()
    assert decide(study, storage, make) == (first, False)
    _add_finished(study, 0.7)
    resumed, made_here = decide(study, storage, make)
    assert made_here and resumed.finished == (0, 2) and calls == [1, 3]
    assert Decision.stored(study) == resumed


def _running_owned_by(study: optuna.Study, pid: int) -> optuna.trial.FrozenTrial:
    trial = study.ask()
    owner = {**this_owner(), "pid": pid, "started": _process_start(pid)}
    study._storage.set_trial_system_attr(trial._trial_id, OWNER_ATTR, owner)
    return study.trials[trial.number]


def test_without_heartbeats_the_end_waits_for_a_live_workers_trial_not_a_dead_ones(
    tmp_path: Path,
) -> None:
    study, storage = _study(f"journal:{tmp_path}/optuna.journal")
    worker = subprocess.Popen(["sleep", "60"])
    try:
        trial = _running_owned_by(study, worker.pid)
        assert [t.number for t in running_elsewhere(study, storage)] == [trial.number]
    finally:
        worker.kill()
        worker.wait()
    assert running_elsewhere(study, storage) == []  # its process is gone


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study")
def test_with_heartbeats_a_silent_trial_is_not_waited_for(tmp_path: Path) -> None:
    study, storage = _study(f"journal:{tmp_path}/optuna.journal", heartbeat_s=5)
    trial = study.ask()  # a worker on another host: only its beats tell
    storage.set_trial_system_attr(trial._trial_id, OWNER_ATTR, {"host": "elsewhere"})
    storage.set_trial_system_attr(trial._trial_id, BEAT_ATTR, time.time())
    assert [t.number for t in running_elsewhere(study, storage)] == [trial.number]
    storage.set_trial_system_attr(trial._trial_id, BEAT_ATTR, time.time() - 11)  # > 2 x 5 s
    assert running_elsewhere(study, storage) == []


def test_the_end_waits_until_the_other_workers_trial_finishes(tmp_path: Path) -> None:
    study, storage = _study(f"journal:{tmp_path}/optuna.journal")
    trial = _running_owned_by(study, subprocess.os.getpid())  # provably alive
    said: list[str] = []
    waiter = threading.Thread(
        target=wait_for_others, args=(study, storage, 1, said.append, 0.05), daemon=True
    )
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive()
    study.tell(trial.number, 0.5)
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert said == [
        "Waiting for 1 running trial of other workers: the last worker to finish makes the "
        "study's recommendation, once, for all of them"
    ]
    assert finished_trials(study) == (0,)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE]


def test_a_decision_reused_says_whether_an_earlier_run_or_another_worker_made_it(
    tmp_path: Path,
) -> None:
    """The same finished study run again: its decision was made by this user's earlier run
    (before this process started), not by another worker of this launch."""
    study, storage = _study(f"journal:{tmp_path}/optuna.journal")
    _add_finished(study, 0.5)
    before = time.time() - 1  # a worker started before the decision was made
    made, _ = decide(study, storage, lambda: (0, "trial: 0\n"))
    after = time.time() + 1  # a run started after it was made
    me = this_owner()
    assert made.made_by == f"host {me['host']}, pid {me['pid']}"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(made.made_at))
    assert made.reused(after, 1) == (
        f"The recommendation was made by an earlier run of this study ({when}, "
        f"{made.made_by}) from the same 1 finished trials: its speed check and best.yaml are "
        "this run's too"
    )
    assert made.reused(before, 1) == (
        f"The recommendation was made by another worker of this study ({made.made_by}) from "
        "the same 1 finished trials: its speed check and best.yaml are this worker's too"
    )
    assert "from the same 12 finished trials (and 5 not counted in search.n_trials): its" in (
        made.reused(after, 12, 5)
    )
    assert Decision.stored(study) == made  # the time is kept in the study
