"""Real servers and processes for the tests of several workers: an MLflow tracking server on
127.0.0.1 (stopped and started again to test an outage), and the study's journal read back
while workers write it."""

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
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return {**env, **extra}


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
