"""The short study the fault tests break, and how they run and read it."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import optuna
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from batchfit.search.storage.heartbeat import MAX_RETRY
from batchfit.search.storage.opening import open_storage
from tests.faults import forkserver
from tests.faults.inject import record_kind
from tests.sweeps import clean_env

REPO = Path(__file__).resolve().parents[2]
NAME = "faults"
# Two trained trials of a tiny CNN on digits, one epoch each: ~30 journal appends a trial.
STUDY = [
    "model=small_cnn",
    "model.width=4",
    "data=digits",
    "trainer.max_epochs=1",
    "search.n_trials=2",
    f"search.study_name={NAME}",
    "mlflow.system_metrics=false",
    # No trial pruned as slow: beside a busy suite a slow prune finishes a trial early, and
    # a run meant to die at a trial's first param then finds none left to sample.
    "search.trial_time_budget_s=null",
    '++search.params={trainer.batch_size:"choice(16,32)",'
    'optimizer.lr:"tag(log, interval(0.01, 0.3))"}',
]


def _env() -> dict[str, str]:
    return clean_env(PYTHONPATH=str(REPO))


def _run(
    module: str, args: list[str], cwd: Path, returncode: int | None, timeout_s: float
) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    done = forkserver.run(module, args, cwd, _env(), timeout_s)
    if returncode is not None:
        assert done.returncode == returncode, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def start_study(cwd: Path, overrides: list[str]) -> forkserver.Process:
    """`python -m search OVERRIDES` in cwd, running, its output piped (text): a real process
    to signal, a child of tests/faults/forkserver.py."""
    cwd.mkdir(parents=True, exist_ok=True)
    return forkserver.start("search", overrides, cwd, _env())


def run_study(
    cwd: Path, overrides: list[str], returncode: int = 0, timeout_s: float = 600
) -> subprocess.CompletedProcess:
    """`python -m search OVERRIDES` in cwd, as a user runs it: the stores default to the
    relative cwd/mlruns paths. A child of tests/faults/forkserver.py, which spares it the
    imports."""
    return _run("search", overrides, cwd, returncode, timeout_s)


def inject(
    cwd: Path, overrides: list[str], faults: list[str], check: bool = True
) -> subprocess.CompletedProcess:
    """The study run by tests/faults/inject.py with `faults` armed; checked for success
    unless `check` is False."""
    return _run("tests.faults.inject", [*faults, "--", *overrides], cwd, 0 if check else None, 600)


def journal_of(cwd: Path, name: str = NAME) -> optuna.Study:
    """The study in cwd's default journal."""
    return optuna.load_study(
        study_name=name, storage=open_storage(f"journal:{cwd}/mlruns/optuna.journal", None)
    )


def check_recovered(cwd: Path, n_trials: int) -> None:
    """What a study that was killed, maybe many times, and resumed to its end holds: exactly
    n_trials finished, nothing running or queued; every killed trial queued again with the
    parameters it had (unless its line was retried MAX_RETRY times); in MLflow one FINISHED parent
    run with its setup, no run left RUNNING, one run per trial at most, FINISHED for the
    finished trials and KILLED for the killed ones."""
    study = journal_of(cwd)
    trials = study.get_trials()
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == n_trials, [(t.number, t.state.name) for t in trials]
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    killed = [
        t
        for t in trials
        if t.state == TrialState.FAIL and not {"error", "surplus"} & set(t.user_attrs)
    ]
    retries = {
        t.system_attrs["retry_history"][-1]: t for t in trials if "retry_history" in t.system_attrs
    }
    for dead in killed:
        if len(dead.system_attrs.get("retry_history", [])) < MAX_RETRY:
            assert dead.number in retries, f"trial {dead.number} was killed and never run again"
            # A trial killed while sampling had only some of its params: the retry
            # keeps those and samples the rest.
            assert dead.params.items() <= retries[dead.number].params.items()

    client = MlflowClient(f"sqlite:///{cwd}/mlruns/mlflow.db")
    experiment = client.get_experiment_by_name(study.study_name)
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("batchfit.role") == "study"]
    assert parent.info.status == "FINISHED" and parent.data.tags["batchfit.setup"] == "complete"
    assert parent.data.metrics["trials/trained"] == n_trials
    assert not [r.info.run_name for r in runs if r.info.status == "RUNNING"]
    by_trial = {}
    for run in runs:
        if run.data.tags.get("batchfit.role") == "trial":
            number = int(run.data.tags["batchfit.trial"])
            assert number not in by_trial, f"two MLflow runs for trial {number}"
            by_trial[number] = run
    for t in finished:
        assert by_trial[t.number].info.status == "FINISHED"
        assert by_trial[t.number].data.tags["batchfit.state"] == t.state.name
    for t in killed:
        if t.number in by_trial:
            assert by_trial[t.number].info.status == "KILLED", t.number


def kill_at_every_kind(tmp_path: Path, part: int) -> None:
    """A clean study's journal lists every kind of record a study writes (study creation,
    its config, the parent run's id, the fit report's first trials, a trial's start, owner,
    heartbeat, each param and attribute, intermediate values, the state). For each kind of
    one `part` of that list (0: the first third, 1: the rest), in order, one run of the study
    dies by SIGKILL halfway through writing the first record of that kind, and the next run
    resumes what it left: the torn record, a trial RUNNING for a dead owner, MLflow runs
    RUNNING. After the last kill, one clean run ends the study: exactly n_trials, nothing
    RUNNING, every killed trial's parameters run again, both stores agreeing."""
    clean = tmp_path / "clean"
    inject(clean, STUDY, [])
    kinds = list(
        dict.fromkeys(
            record_kind(json.loads(line))
            for line in (clean / "mlruns" / "optuna.journal").read_bytes().splitlines()
        )
    )
    assert len(kinds) > 30  # the study's own records and a trial's life
    # Split where the two take about as long: the runs that die in the study's setup
    # redo it all (14 s each on 2 busy cores), those that die in a trial 5.5 s.
    split = len(kinds) // 3
    kinds = [kinds[:split], kinds[split:]][part]
    runs, killed = tmp_path / "runs", tmp_path / "killed.jsonl"
    for kind in kinds:
        done = inject(runs, STUDY, ["--kill-at-record", kind, "--killed", str(killed)], False)
        assert done.returncode == -signal.SIGKILL, (kind, done.stdout[-2000:] + done.stderr[-2000:])
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
    torn = [record_kind(json.loads(line)) for line in killed.read_bytes().splitlines()]
    assert torn == kinds  # each run died where it was meant to
    run_study(runs, STUDY)
    check_recovered(runs, n_trials=2)
    for line in (runs / "mlruns" / "optuna.journal").read_bytes().splitlines():
        json.loads(line)  # every record whole
