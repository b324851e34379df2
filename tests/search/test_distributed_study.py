"""Studies of data-parallel trials, `python -m search` in a subprocess as a user runs it: a
study that searches the strategy and the number of devices (one rank over its budget
pruned as `oom`, the global figures in MLflow, the winner rerun from best.yaml), one
whose trial loses a rank to SIGKILL, and workers killed as their ranks start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest
import yaml
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from batchfit.search.core.record import Attr
from batchfit.tracking.metrics import (
    PEAK_BYTES,
    PREDICTION_ERROR,
    SCALING_EFFICIENCY,
    THROUGHPUT_SAMPLES,
    VAL_ACC,
)
from batchfit.train.plan import plan
from batchfit.train.workload import Workloads
from tests.sweeps import LONG_DDP, REPO, clean_env

pytestmark = pytest.mark.slow

DATA = [
    "data=synthetic",
    "data.num_samples=90",
    "data.channels=1",
    "data.image_size=8",
    "trainer.max_epochs=2",
    "trainer.log_every_steps=2",
    "optimizer.lr=0.1",
]
LOPSIDED = ["model._target_=tests.train.test_distributed.Lopsided", "~model.width"]
BALLAST = 4096  # floats per sample rank 1 holds in its forward at batch 16


def _env() -> dict[str, str]:
    return clean_env(PYTHONPATH=str(REPO))  # the ranks import the test's model


def _search(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "search", *args],
        cwd=cwd, env=_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _journal(cwd: Path, name: str) -> optuna.Study:
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(cwd / "mlruns" / "optuna.journal"))
    )
    return optuna.load_study(study_name=name, storage=storage)


def test_a_study_searches_strategy_and_devices_and_logs_global_figures(
    tmp_path: Path, hydra_conf
) -> None:
    # Rank 1 of a 2-device trial at batch 16 holds BALLAST x 16 floats more than rank 0,
    # which the predictor sees: a per-rank budget with room for rank 0 (and the margin)
    # but not for rank 1.
    model = [*LOPSIDED, f"+model.ballast={BALLAST}", "+model.from_batch=16"]
    peaks = []
    for strategy in ("ddp", "fsdp"):
        cfg = hydra_conf([*DATA, *model, f"trainer.strategy={strategy}", "trainer.devices=2",
                          "trainer.batch_size=16"])  # fmt: skip
        peaks.append(Workloads().of(cfg).predict(plan(cfg, None), cfg.optimizer).peak_bytes)
    budget = int(max(peaks) * 1.06)
    assert min(peaks) + 16 * BALLAST * 4 > budget  # rank 1 at batch 16 is over, either way
    study = [
        *DATA,
        *model,
        "search/sampler=grid",
        "search.study_name=spread",
        "search.n_trials=8",
        f"search.memory_budget={budget}",
        "search.objectives=[val/acc]",
        "+search.params={trainer.strategy:'choice(ddp,fsdp)',trainer.devices:'choice(1,2)',"
        "trainer.batch_size:'choice(4,16)'}",
    ]
    out = _search(study, tmp_path).stdout
    trials = _journal(tmp_path, "spread").get_trials()
    assert len(trials) == 8
    over = [
        t
        for t in trials
        if t.params["trainer.devices"] == 2 and t.params["trainer.batch_size"] == 16
    ]
    assert len(over) == 2
    for t in over:  # predicted to fit (rank 0), over on rank 1: every rank stopped
        assert t.state == TrialState.PRUNED and t.user_attrs[Attr.REASON] == "oom", t.user_attrs
        assert "rank 1 of 2" in t.user_attrs[Attr.MESSAGE]
        assert t.constraints["memory"] > 0  # the sampler learns it did not fit
    done = [t for t in trials if t not in over]
    assert all(t.state == TrialState.COMPLETE for t in done), [t.user_attrs for t in done]

    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    experiment = client.get_experiment_by_name("spread")
    runs = {
        int(r.data.tags["batchfit.trial"]): r
        for r in client.search_runs([experiment.experiment_id])
        if r.data.tags.get("batchfit.role") == "trial"
    }
    efficiencies = 0
    for t in done:
        run = runs[t.number]
        metrics, params = run.data.metrics, run.data.params
        devices, batch = t.params["trainer.devices"], t.params["trainer.batch_size"]
        assert params["trainer.strategy"] == t.params["trainer.strategy"]
        assert params["global_batch_size"] == str(batch * devices)
        # Validation ran once per epoch over the whole split, not once per rank.
        assert len(client.get_metric_history(run.info.run_id, VAL_ACC)) == 2
        assert metrics[THROUGHPUT_SAMPLES] > 0
        assert metrics[PREDICTION_ERROR] == 0.0  # the per-rank prediction is exact
        if devices == 2:
            ranks = [metrics["memory/rank_0/peak_bytes"], metrics["memory/rank_1/peak_bytes"]]
            assert metrics[PEAK_BYTES] == max(ranks)
            one = [
                s
                for s in done
                if s.number < t.number
                and s.params["trainer.devices"] == 1
                and s.params["trainer.batch_size"] == batch
            ]
            if one:  # the same per-device configuration on one device, trained before
                efficiencies += 1
                expected = metrics[THROUGHPUT_SAMPLES] / (
                    2 * max(runs[s.number].data.metrics[THROUGHPUT_SAMPLES] for s in one)
                )
                assert metrics[SCALING_EFFICIENCY] == pytest.approx(expected)
            else:
                assert SCALING_EFFICIENCY not in metrics
        else:
            assert "memory/rank_0/peak_bytes" not in metrics
    assert efficiencies >= 1

    (best_path,) = (tmp_path / "mlruns" / "hydra").glob("*/*/best.yaml")
    best = yaml.safe_load(best_path.read_text())
    winner = next(t for t in trials if t.number == best["trial"])
    for key in ("trainer.strategy", "trainer.devices"):
        assert f"{key}={winner.params[key]}" in best["overrides"]
    assert "python -m train" in out
    rerun = subprocess.run(
        [sys.executable, "-m", "train", f"+best={best_path}"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    devices = winner.params["trainer.devices"]
    if devices > 1:
        assert f"Training on {devices} x cpu ({winner.params['trainer.strategy']}" in rerun.stdout
    retrained = [
        r for r in client.search_runs([experiment.experiment_id])
        if r.data.tags.get("batchfit.role") == "train"
    ]  # fmt: skip
    assert len(retrained) == 1
    assert retrained[0].data.params["trainer.devices"] == str(devices)
    assert retrained[0].data.metrics[VAL_ACC] == pytest.approx(
        runs[winner.number].data.metrics[VAL_ACC]
    )


def _ranks(study: psutil.Process) -> list[psutil.Process]:
    """The study's rank processes (spawned by the launcher: `multiprocessing.spawn`), not
    multiprocessing's resource tracker."""
    found = []
    for child in study.children(recursive=True):
        try:
            line = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "spawn_main" in line and "resource_tracker" not in line:
            found.append(child)
    return found


def test_a_rank_killed_mid_trial_fails_the_trial_in_bounded_time_and_the_study_goes_on(
    tmp_path: Path,
) -> None:
    args = [
        *LONG_DDP,
        "search.study_name=killed",
        "search.n_trials=2",
        "search.objectives=[val/acc]",
        "+search.params={optimizer.lr:'tag(log, interval(0.01, 0.1))'}",
    ]
    study = subprocess.Popen(
        [sys.executable, "-m", "search", *args],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        parent = psutil.Process(study.pid)
        deadline = time.monotonic() + 300
        ranks: list[psutil.Process] = []
        while len(ranks) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            ranks = _ranks(parent)
        assert len(ranks) == 2, "the first trial's ranks never started"
        time.sleep(4)  # into training (they build data and the model first)
        victim, survivor = ranks
        killed_at = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        # The other rank waits in a collective for the dead one: the launcher stops it.
        gone, _ = psutil.wait_procs([survivor], timeout=30)
        assert gone, "the surviving rank was left running"
        out, _ = study.communicate(timeout=600)
    finally:
        if study.poll() is None:
            study.kill()
    assert study.returncode == 0, out
    # the launcher runs on a thread of the worker on purpose: torch's warning is not said;
    # the killed rank is said in one line (the trial's), not with the launcher's traceback
    assert "Failed to register signal handlers" not in out
    assert "terminated with signal" not in out and "Traceback" not in out, out
    trials = _journal(tmp_path, "killed").get_trials()
    first = trials[0]
    assert first.state == TrialState.FAIL
    message = first.user_attrs[Attr.MESSAGE]
    assert "rank" in message and "SIGKILL" in message, message
    assert first.datetime_complete.timestamp() - killed_at < 30  # bounded: not a hang
    assert len(trials) == 2  # a trial that failed with an error counts as one of n_trials
    assert trials[1].state == TrialState.COMPLETE  # the study went on
    # No rank outlives its study, the killed trial's included.
    assert not [p for p in (victim, survivor) if p.is_running() and p.status() != "zombie"]


def _started_in(directory: Path) -> list[psutil.Process]:
    """Every process whose working directory is `directory`: a study started there, the
    ranks it spawned and multiprocessing's resource tracker, whoever their parent now is."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and Path(process.cwd()) == directory:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return [p for p in found if _alive(p)]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("after_s", [0.0, 2.0])
def test_a_worker_killed_as_its_ranks_start_leaves_no_process(
    tmp_path: Path, after_s: float
) -> None:
    """SIGKILL of the study's worker while its data-parallel trial's ranks are still
    starting (importing torch, unpickling their job: before a death signal could be asked
    for): every rank, and the resource tracker, ends within seconds, none left with parent
    1."""
    args = [*DATA, "model=mlp", "trainer.strategy=ddp", "trainer.devices=2",
            "trainer.batch_size=16", "search.study_name=orphans", "search.n_trials=1",
            "search.objectives=[val/acc]"]  # fmt: skip
    study = subprocess.Popen(
        [sys.executable, "-m", "search", *args],
        cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        parent = psutil.Process(study.pid)
        deadline = time.monotonic() + 300
        while not _ranks(parent) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _ranks(parent), "the trial's ranks never started"
        time.sleep(after_s)
        study.kill()
        study.wait()
        deadline = time.monotonic() + 60
        while _started_in(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [" ".join(p.cmdline())[:200] for p in _started_in(tmp_path)]
    finally:
        for process in _started_in(tmp_path):
            process.kill()
    assert not left, f"left behind after the worker was killed: {left}"
