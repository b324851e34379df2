"""Running sweeps of several workers and reading back what they wrote: an MLflow tracking
server on 127.0.0.1 (stopped and started again to test an outage), the study's journal read
while workers write it, and the check that both stores hold every trial exactly once."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import optuna
from mlflow.tracking import MlflowClient
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState

from batchfit.search.core.record import Attr
from batchfit.search.storage.owners import OWNER_ATTR
from batchfit.tracking.metrics import STORAGE_S, TRACKING_S, TRIAL_S, VAL_ACC
from tests.faults import forkserver

REPO = Path(__file__).resolve().parents[1]


FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def check_stores(
    study: optuna.Study,
    client: MlflowClient,
    n_trials: int,
    num_epochs: int = 2,
    outage: bool = False,
) -> None:
    """Exactly n_trials finished once each; one parent run and one run per trial in MLflow,
    none left RUNNING; trials whose worker died are KILLED there and were run again. With
    `outage` (MLflow was away for a while), a trial that ran while no retry of the queued
    writes was due made no MLflow call: its time/tracking_s is 0, the study's is not."""
    trials = study.get_trials()
    finished = [t for t in trials if t.state in FINISHED]
    assert len(finished) == n_trials, [(t.number, t.state.name) for t in trials]
    killed = [t for t in trials if t.state == TrialState.FAIL and Attr.SURPLUS not in t.user_attrs]
    retried = [t for t in trials if "failed_trial" in t.system_attrs]
    assert sorted(r.system_attrs["failed_trial"] for r in retried) == [t.number for t in killed]
    for retry in retried:
        dead = study.trials[retry.system_attrs["failed_trial"]]
        assert retry.params == dead.params and retry.state in FINISHED
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]

    experiment = client.get_experiment_by_name(study.study_name)
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("batchfit.role") == "study"]
    assert len(parents) == 1
    children = [r for r in runs if r.data.tags.get("batchfit.role") == "trial"]
    assert len(runs) == 1 + len(children)
    by_trial = {int(r.data.tags["batchfit.trial"]): r for r in children}
    assert len(by_trial) == len(children)  # one run per trial, no duplicates
    # A worker killed before its trial's run was created leaves no run.
    assert {t.number for t in finished} <= set(by_trial) <= {t.number for t in finished + killed}
    for run in children:
        assert run.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
    for t in finished:
        run = by_trial[t.number]
        assert run.info.status == "FINISHED"
        assert run.data.tags["batchfit.state"] == t.state.name
        assert run.data.metrics[TRIAL_S] > 0
        # Every trial reads the study (sampler) and writes MLflow records.
        assert run.data.metrics[STORAGE_S] > 0
        tracking_s = run.data.metrics[TRACKING_S]
        assert tracking_s > 0 or (outage and tracking_s == 0)
        if t.state == TrialState.COMPLETE:
            history = client.get_metric_history(run.info.run_id, VAL_ACC)
            assert len(history) == num_epochs
        assert "worker" not in run.data.params and "worker" not in t.params
    for t in killed:
        if t.number in by_trial or Attr.RUN_ID in t.user_attrs:
            assert by_trial[t.number].info.status == "KILLED"
            assert by_trial[t.number].data.tags["batchfit.state"] == "KILLED"
    assert parents[0].data.metrics["trials/trained"] == n_trials
    assert sum(by_trial[t.number].data.metrics[TRACKING_S] for t in finished) > 0


def training(first: int) -> Callable[[FrozenTrial], bool]:
    """A trial numbered `first` or later that is running and has its MLflow run: a worker
    killed now dies mid-training, with a run to end as KILLED."""
    return lambda t: (
        t.number >= first
        and t.state == TrialState.RUNNING
        and OWNER_ATTR in t.system_attrs
        and Attr.RUN_ID in t.user_attrs
    )


def search_process(args: list[str], cwd: Path) -> forkserver.Process:
    """`python -m search ARGS` in `cwd`, as a user starts it, its output piped (text): a
    child of tests/faults/forkserver.py (a fresh interpreter with BATCHFIT_FORKSERVER=0)."""
    return forkserver.start("search", args, cwd, clean_env())


def finish(process: forkserver.Process, expect_rc: int | None = 0) -> tuple[str, str]:
    out, err = process.communicate(timeout=600)
    if expect_rc is not None:
        assert process.returncode == expect_rc, out[-3000:] + err[-3000:]
    return out, err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return {**env, **extra}


def run_module(
    module: str, args: list[str], cwd: Path, returncode: int = 0
) -> subprocess.CompletedProcess:
    """`python -m module args` in `cwd` as a user runs it (without MLFLOW_TRACKING_URI, the
    stores default to cwd/mlruns), checked for its exit status: a child of
    tests/faults/forkserver.py, which spares each run the 10-30 s of a study's imports (a
    fresh interpreter with BATCHFIT_FORKSERVER=0)."""
    done = forkserver.run(module, args, cwd, clean_env(), 600)
    assert done.returncode == returncode, done.stdout + done.stderr
    return done


class MlflowServer:
    """`mlflow server` on 127.0.0.1:port with the given backend store; start/stop at will."""

    def __init__(self, backend_uri: str, workdir: Path, port: int | None = None):
        self.backend_uri = backend_uri
        self.workdir = workdir
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90) -> None:
        log = self.workdir / f"mlflow-server-{self.port}.log"
        with open(log, "a") as output:
            self.process = self._popen(output)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
            assert self.process.poll() is None, f"mlflow server exited: see {log}"
        raise TimeoutError(f"mlflow server on {self.url} did not answer in {timeout_s} s")

    def _popen(self, output: object) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
                "--port", str(self.port), "--workers", "1",
                "--backend-store-uri", self.backend_uri,
            ],
            cwd=self.workdir, stdout=output, stderr=subprocess.STDOUT, env=clean_env(),
            start_new_session=True,  # it starts helpers: stop them all as one group
        )  # fmt: skip

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None

    def __enter__(self) -> MlflowServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def journal_study(path: Path, name: str) -> optuna.Study | None:
    """The study in a journal file, None while it does not exist yet."""
    if not path.exists():
        return None
    storage = JournalStorage(JournalFileBackend(str(path)))
    try:
        return optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        return None


def wait_for_trial(
    load: Callable[[], optuna.Study | None],
    predicate: Callable[[FrozenTrial], bool],
    timeout_s: float = 240,
    alive: Callable[[], bool] = lambda: True,
) -> FrozenTrial:
    """The first trial of the study that satisfies `predicate`, polled every 50 ms."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert alive(), "the workers exited before the awaited trial"
        study = load()
        if study is not None:
            for trial in study.get_trials(deepcopy=False):
                if predicate(trial):
                    return trial
        time.sleep(0.05)
    raise TimeoutError("no such trial appeared")


# Two DDP ranks on a small MLP for minutes (1000 samples x 40 epochs): far longer than a
# fault test waits, so the ranks are there to kill.
LONG_DDP = [
    "data=synthetic", "data.num_samples=1000", "data.channels=1", "data.image_size=8",
    "model=mlp", "model.hidden=64", "trainer.max_epochs=40", "trainer.strategy=ddp",
    "trainer.devices=2", "trainer.batch_size=16",
]  # fmt: skip
