"""`python -m search` and `python -m train` as a user runs them, in subprocesses, then the
Optuna storage and the MLflow store read back."""

from __future__ import annotations

import shlex
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from batchfit.search.core.record import Attr
from batchfit.search.study.driver import PARENT_ATTR
from batchfit.tracking.metrics import (
    ACHIEVED_FLOPS,
    BUDGET_BYTES,
    FLOPS_PER_SAMPLE,
    MFU,
    PEAK_BYTES,
    PEAK_FLOPS,
    PREDICTED_BYTES,
    PREDICTION_ERROR,
    STEP_MS,
    THROUGHPUT_SAMPLES,
    TRAIN_LOSS,
    VAL_ACC,
)
from batchfit.train.params import EFFECTIVE_PARAM, PRECISION_KEY
from tests.sweeps import run_module

pytestmark = pytest.mark.slow

STUDY = [
    "model=small_cnn",
    "model.width=4",
    "data=digits",
    "trainer.max_epochs=2",
    "search.study_name=e2e",
    "search.n_trials=6",
    # small_cnn(width=4) peaks at ~0.66 MB at batch 64, ~2.6 MB at 256 (CPU accounting)
    "search.memory_budget=1MiB",
    "search.objectives=[val/acc,throughput/samples_per_sec]",
    "+search.params={trainer.batch_size:'choice(16,64,256)',"
    "trainer.accum_steps:'choice(1,2)',optimizer.lr:'tag(log, interval(0.01, 0.3))'}",
]


def test_study_then_resume_then_rerun_the_winner(tmp_path: Path) -> None:
    out = run_module("search", STUDY, tmp_path).stdout
    # Defaults put both stores under ./mlruns of the working directory.
    journal = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "mlruns" / "optuna.journal"))
    )
    mlflow_url = f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    assert "Pareto front" in out and "Memory boundary" in out and "python -m train" in out

    study = optuna.load_study(study_name="e2e", storage=journal)
    trials = study.get_trials()
    # Predicted before training (search.preflight): batch 256 needs ~2.6 MB, over 1 MiB. Such
    # proposals take no trial slot: all 6 of search.n_trials train.
    oom = [t for t in trials if t.user_attrs.get(Attr.REASON) == "oom_predicted"]
    assert oom and all(t.params["trainer.batch_size"] == 256 for t in oom)
    assert len(trials) == 6 + len(oom)
    assert all(t.state == TrialState.COMPLETE for t in trials if t not in oom)
    assert (
        f"6 finished trials: 6 COMPLETE; not counted, answered without training: {len(oom)}" in out
    )
    for t in oom:
        assert t.state == TrialState.PRUNED
        assert t.user_attrs[Attr.PREDICTED_BYTES] > t.user_attrs[Attr.BUDGET_BYTES] == 2**20
        assert t.constraints["memory"] > 0
        assert PRECISION_KEY in t.user_attrs and EFFECTIVE_PARAM in t.user_attrs

    client = MlflowClient(mlflow_url)
    experiment = client.get_experiment_by_name("e2e")
    runs = client.search_runs([experiment.experiment_id])
    parent = [r for r in runs if r.data.tags.get("batchfit.role") == "study"]
    assert len(parent) == 1
    parent = parent[0]
    nested = {f"trial-{r.data.tags['batchfit.trial']}": r for r in runs if r is not parent}
    assert parent.info.run_id == study.user_attrs[PARENT_ATTR]
    assert parent.data.params["model.width"] == "4"
    assert parent.data.metrics["trials/trained"] == 6
    assert parent.data.metrics["trials/pruned_oom_predicted"] == len(oom)
    assert "best/val/acc" in parent.data.metrics
    assert sorted(nested) == sorted(f"trial-{t.number}" for t in trials)
    for t in trials:
        run = nested[f"trial-{t.number}"]
        assert run.info.run_id == t.user_attrs[Attr.RUN_ID]
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.data.tags["batchfit.trial"] == str(t.number)
        assert run.data.tags["batchfit.state"] == t.state.name
        params = run.data.params
        for key, value in t.params.items():
            assert params[key] == str(value)
        eff = t.params["trainer.batch_size"] * t.params["trainer.accum_steps"]
        assert params["effective_batch_size"] == str(eff)
        # lr follows the effective batch: SGD's rule (trainer.lr_scaling=auto: linear), from
        # the reference the study fixed at the command line's batch (trainer.batch_size=32)
        assert (params["lr_rule"], params["lr_reference"]) == ("linear", "32")
        assert float(params["lr_scaled"]) == pytest.approx(t.params["optimizer.lr"] * eff / 32)
        metrics = run.data.metrics
        assert metrics[BUDGET_BYTES] == 2**20
        assert metrics[PREDICTED_BYTES] > 0  # every trial is predicted first
        if t.state == TrialState.COMPLETE:  # and a trained one measured too: same accounting
            assert metrics[PEAK_BYTES] == metrics[PREDICTED_BYTES]
            assert metrics[PREDICTION_ERROR] == 0
        artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
        assert "config.yaml" in artifacts
        if t.state == TrialState.COMPLETE:
            assert metrics[THROUGHPUT_SAMPLES] > 0 and metrics[STEP_MS] > 0
            history = client.get_metric_history(run.info.run_id, VAL_ACC)
            assert len(history) == 2  # one per epoch, with the step
            assert history[0].step < history[1].step
            assert client.get_metric_history(run.info.run_id, TRAIN_LOSS)
            assert t.values[0] == pytest.approx(metrics[VAL_ACC])
        else:
            assert run.data.tags["batchfit.prune_reason"] == t.user_attrs[Attr.REASON]

    # The same command with a larger n_trials resumes: same study, same parent run.
    run_module("search", [*STUDY, "search.n_trials=8"], tmp_path)
    study = optuna.load_study(study_name="e2e", storage=journal)
    trials = study.get_trials()
    assert [t.number for t in trials] == list(range(len(trials)))
    assert sum(t.user_attrs.get(Attr.REASON) != "oom_predicted" for t in trials) == 8
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 + len(trials)
    assert [r for r in runs if r.data.tags.get("batchfit.role") == "study"][0].info.run_id == (
        parent.info.run_id
    )

    # The printed rerun command trains the winner as a plain MLflow run.
    rerun = next(line for line in out.splitlines() if line.startswith("Train it again: "))
    args = shlex.split(rerun.removeprefix("Train it again: "))[3:]  # after python -m train
    done = run_module("train", args, tmp_path)
    assert "val/acc " in done.stdout
    train_runs = client.search_runs([client.get_experiment_by_name("train").experiment_id])
    assert len(train_runs) == 1
    assert train_runs[0].data.tags["batchfit.state"] == "COMPLETE"
    assert "mlflow.parentRunId" not in train_runs[0].data.tags


def test_train_entry_point_with_the_issue_command(tmp_path: Path) -> None:
    done = run_module(
        "train",
        [
            "+experiment=resnet", "data=digits", "model=small_cnn", "trainer.batch_size=64",
            "trainer.accum_steps=2", "trainer.precision=bf16", "optimizer.lr=0.05",
            "trainer.max_steps=3", "search.memory_budget=150MiB",
        ],
        tmp_path,
    )  # fmt: skip
    assert "batch 64 x 2 = 128, bf16" in done.stdout
    # Its threads line names the key python -m train takes, not a study's workers.
    threads = done.stdout.splitlines()[0]
    assert threads.startswith("torch: ") and "per worker" not in threads
    assert "search.threads=N, which python -m train reads" in threads
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("train").experiment_id])
    # The model's path on disk, which a user can open (the store is local).
    saved = next(line for line in done.stdout.splitlines() if line.startswith("Model saved: "))
    path = saved.removeprefix("Model saved: ").split(" (")[0]
    assert (tmp_path / path).is_file() and path.endswith("model/model.pt")
    assert run.info.run_id in path
    assert run.data.params["trainer.precision"] == "bf16"
    assert run.data.params["effective_batch_size"] == "128"
    # lr_scaling=linear with reference 128 in the resnet experiment: 0.05 x 128/128
    assert float(run.data.params["lr_scaled"]) == pytest.approx(0.05)
    assert run.data.metrics[BUDGET_BYTES] == 150 * 2**20
    # MFU as a trial logs it: counted FLOPs x measured speed over the device's peak.
    metrics = run.data.metrics
    achieved = metrics[FLOPS_PER_SAMPLE] * metrics[THROUGHPUT_SAMPLES]
    assert metrics[ACHIEVED_FLOPS] == pytest.approx(achieved)
    assert metrics[MFU] == pytest.approx(achieved / metrics[PEAK_FLOPS])


def test_fit_report_entry_point(tmp_path: Path) -> None:
    # ResNet-18 on digits under the 160 MiB of conf/budget/resnet18_digits.yaml: parameters,
    # gradients and momentum take 128 MiB; with the 5% margin fp32 fits up to batch 32.
    done = run_module("search.fit", ["+experiment=resnet", "data=digits"], tmp_path)
    out = done.stdout
    title = " ".join(out.split())  # the title may wrap
    assert "budget 160.0 MiB (search.memory_budget), margin 5%" in title
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 3}
    assert "145.9 MiB" in rows["32"] and "(OOM)" in rows["64"]
    assert rows["largest that fits"].split("│")[2].strip() == "32"  # the fp32 column
    records = ("mlflow.db", "optuna.journal")  # a report records nothing (Hydra's log dir aside)
    assert not any((tmp_path / "mlruns" / name).exists() for name in records)


def test_a_study_for_a_gpu_this_machine_lacks_shows_its_preflight_and_stops(
    tmp_path: Path,
) -> None:
    """search.gpu on a machine without that GPU: the study's preflight (the fit report, in
    CUDA's reserved bytes for the card) is shown, then it stops before any study or run
    exists; python -m train refuses the same way."""
    small = ["model=small_cnn", "model.width=4", "data=digits", "search.gpu=A100-40GB"]
    done = run_module("search", [*small, "search.n_trials=2"], tmp_path, returncode=2)
    out, message = " ".join(done.stdout.split()), " ".join(done.stderr.split())
    assert "Fit report for A100-40GB (39.4 GiB, CUDA reserve, planned" in out, out
    assert "search.gpu=A100-40GB plans for a GPU this machine does not have" in message
    records = ("mlflow.db", "optuna.journal")  # no store, no study, no run (Hydra's logs aside)
    assert not any((tmp_path / "mlruns" / name).exists() for name in records)
    done = run_module("train", small, tmp_path, returncode=2)
    assert "plans for a GPU this machine does not have" in " ".join(done.stderr.split())


def test_fit_report_of_a_budget_below_the_optimizer_state(tmp_path: Path) -> None:
    done = run_module(
        "search.fit", ["+experiment=resnet", "data=digits", "search.memory_budget=100MiB"],
        tmp_path, returncode=2,
    )  # fmt: skip
    message = " ".join(done.stderr.split())  # rich wraps it to the terminal width
    assert "below the 127.9 MiB that the parameters, gradients and optimizer state" in message
