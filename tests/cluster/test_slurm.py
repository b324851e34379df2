"""Real sweeps on the real single-node SLURM cluster (tests/cluster/services.sh): workers
are SLURM jobs submitted by Hydra's submitit launcher, sharing a journal file or a PostgreSQL
study, logging to a local MLflow store or to an MLflow server backed by PostgreSQL. One job is
cancelled with scancel mid-trial. sacct, the Optuna storage and MLflow are read back."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from batchfit.search.storage.owners import OWNER_ATTR
from tests.sweeps import (
    MlflowServer,
    check_stores,
    finish,
    journal_study,
    search_process,
    training,
    wait_for_trial,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

STUDY = [
    "model=small_cnn",
    "model.width=4",
    "data=digits",
    "trainer.max_epochs=2",
    "search.study_name=slurm",
    "+search.params={trainer.batch_size:'choice(32,64)',"
    "optimizer.lr:'tag(log, interval(0.01, 0.3))'}",
]
# One CPU and 1 GB per job: the node has 2 CPUs, so two workers run at once and a third
# queues until one ends (SLURM decides, as on a real cluster).
SLURM = [
    "--multirun",
    "hydra/launcher=submitit_slurm",
    "hydra.launcher.partition=debug",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=1",
    "hydra.launcher.timeout_min=15",
]


def _job_states(sweep_root: Path, want: int, timeout_s: float = 20) -> dict[str, str]:
    """sacct's state of each job of the sweep (sacct lags a moment behind a job's end)."""
    (submitit,) = sweep_root.glob("*/*/.submitit")
    jobs = sorted(p.name for p in submitit.iterdir() if p.is_dir() and "_" in p.name)
    assert len(jobs) == want, jobs
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", jobs[0].split("_")[0]],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        states = dict(line.split("|")[:2] for line in out.splitlines() if line)
        states = {job: states.get(job, "?").split()[0] for job in jobs}
        pending = {"RUNNING", "PENDING", "COMPLETING", "?"}
        if not set(states.values()) & pending or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


def test_three_slurm_workers_on_a_journal_file(slurm: None, tmp_path: Path) -> None:
    args = [*SLURM, "search.workers=3", "search.n_trials=6", *STUDY]
    finish(search_process(args, tmp_path))
    states = _job_states(tmp_path / "mlruns" / "hydra" / "multirun", want=3)
    assert set(states.values()) == {"COMPLETED"}, states
    study = journal_study(tmp_path / "mlruns" / "optuna.journal", "slurm")
    check_stores(study, MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db"), 6)
    jobs = {t.system_attrs[OWNER_ATTR]["slurm_job"] for t in study.trials}
    assert len(jobs) >= 2 and None not in jobs  # trials ran inside SLURM jobs


def test_three_slurm_workers_on_postgresql(slurm: None, postgres_url: str, tmp_path: Path) -> None:
    """With a password in the storage URL (the test server trusts loopback, so any password
    connects): it shows nowhere a user or a log reads."""
    secret = "pg-S3cret"
    url = postgres_url.replace("postgres@", f"postgres:{secret}@")
    args = [*SLURM, "search.workers=3", "search.n_trials=6", f"search.storage={url}"]
    out, err = finish(search_process([*args, *STUDY], tmp_path))
    states = _job_states(tmp_path / "mlruns" / "hydra" / "multirun", want=3)
    assert set(states.values()) == {"COMPLETED"}, states
    study = optuna.load_study(study_name="slurm", storage=postgres_url)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    check_stores(study, client, 6)
    # Console, Hydra's saved configs and job logs (submitit's pickles hold the config to run
    # it, and are not read here), MLflow's params, tags and artifacts, the study.
    texts = [out, err, str(study.user_attrs), str([t.user_attrs for t in study.trials])]
    logs = [p for p in (tmp_path / "mlruns").rglob("*") if p.is_file() and p.suffix != ".pkl"]
    texts += [p.read_text(errors="replace") for p in logs if p.suffix != ".db"]
    for run in client.search_runs([client.get_experiment_by_name("slurm").experiment_id]):
        texts += [str(run.data.params), str(run.data.tags)]
    leaks = [line for text in texts for line in text.splitlines() if secret in line]
    assert not leaks
    assert any("postgres:***@127.0.0.1" in text for text in texts)  # shown, masked


def test_two_slurm_workers_log_to_a_tracking_server_on_postgresql(
    slurm: None, postgres_url: str, tmp_path: Path
) -> None:
    with MlflowServer(postgres_url, tmp_path) as server:
        args = [
            *SLURM,
            "search.workers=2",
            "search.n_trials=4",
            f"mlflow.tracking_uri={server.url}",
        ]
        finish(search_process([*args, *STUDY], tmp_path))
        study = journal_study(tmp_path / "mlruns" / "optuna.journal", "slurm")
        check_stores(study, MlflowClient(server.url), 4)
    states = _job_states(tmp_path / "mlruns" / "hydra" / "multirun", want=2)
    assert set(states.values()) == {"COMPLETED"}, states


def test_a_slurm_job_cancelled_mid_trial(slurm: None, postgres_url: str, tmp_path: Path) -> None:
    """scancel one of two workers while it trains. SLURM sends SIGTERM, on which batchfit
    ends the trial, closes its run as KILLED and queues its parameters (SIGKILL follows after
    KillWait, 5 s here, should it hang). The other worker runs the queued trial."""
    # The kill (SIGKILL 5 s after scancel) must land in a trial, not between two or after
    # the worker's last: trials of several seconds each, the study far longer than 5 s.
    longer = [*STUDY, "trainer.max_epochs=20"]
    args = [*SLURM, "search.workers=2", "search.n_trials=10", f"search.storage={postgres_url}"]
    sweep = search_process([*args, *longer], tmp_path)
    # One storage for every poll: a storage per poll (20 a second) is an engine whose pooled
    # connection stays open until the garbage collector finds it, and 50 were open at once,
    # a quarter of the server's max_connections, shared with the other tests.
    storage = optuna.storages.RDBStorage(postgres_url)

    def load() -> optuna.Study | None:
        try:
            return optuna.load_study(study_name="slurm", storage=storage)
        except KeyError:
            return None

    running = wait_for_trial(
        load,
        training(first=2),
        alive=lambda: sweep.poll() is None,
    )
    job = running.system_attrs[OWNER_ATTR]["slurm_job"]
    subprocess.run(["scancel", job], check=True)
    finish(sweep, expect_rc=None)
    assert sweep.returncode != 0  # Hydra reports the cancelled job
    # The submitit launcher collects the jobs' results in order: when the cancelled job is
    # the first, the sweep returns at once, while the other worker is still finishing the
    # study in its SLURM job. The study is complete when that job has ended.
    states = _job_states(tmp_path / "mlruns" / "hydra" / "multirun", want=2, timeout_s=300)
    assert sorted(states.values()) == ["CANCELLED", "COMPLETED"], states
    study = load()
    check_stores(study, MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db"), 10, num_epochs=20)
    (killed,) = [t for t in study.trials if t.state == TrialState.FAIL]
    assert killed.system_attrs[OWNER_ATTR]["slurm_job"] == job
    (retry,) = [t for t in study.trials if t.system_attrs.get("failed_trial") == killed.number]
    assert retry.params == killed.params
    assert retry.system_attrs[OWNER_ATTR]["slurm_job"] != job
