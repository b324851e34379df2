"""tracking/runs.py against real MLflow stores: the outbox's retries, workers opening one
new SQLite store together, and the parent run created once. The saved view's contents:
test_mlflow_ui.py."""

from __future__ import annotations

import json
import logging
import multiprocessing
import sqlite3
import time
from pathlib import Path

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from batchfit.search.core.record import TrialRecord
from batchfit.tracking.mlflow_setup import SYSTEM_METRICS_LOGGER, http_defaults, quiet_logging
from batchfit.tracking.mlflow_ui import VIEW_TAG
from batchfit.tracking.outbox import Outbox
from batchfit.tracking.runs import RunLog, Tracker, mib_metrics
from batchfit.tracking.tags import RECOMMENDED_TAG, ROLE_TAG, TRIAL_TAG
from tests.sweeps import free_port


def test_outbox_queues_writes_to_an_unreachable_server_in_order(monkeypatch) -> None:
    http_defaults()
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    client = MlflowClient(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    outbox = Outbox()
    written: list[int] = []
    outbox.put(lambda: client.log_batch("run", metrics=[Metric("m", 1.0, 0, 0)]))
    outbox.put(lambda: written.append(2))  # waits behind the first: order is kept
    assert len(outbox) == 2 and written == []
    assert "Connection refused" in outbox.last_error or "Max retries" in outbox.last_error
    assert not outbox.wait(0.5)
    assert len(outbox) == 2


def test_outbox_records_a_real_error_and_goes_on(tmp_path: Path) -> None:
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    outbox = Outbox()
    written: list[int] = []
    outbox.put(lambda: client.log_batch("no-such-run", metrics=[Metric("m", 1.0, 0, 0)]))
    outbox.put(lambda: written.append(1))  # not blocked, and not hit by the first's error
    assert written == [1] and len(outbox) == 0
    (failure,) = outbox.failed
    assert failure.startswith("MlflowException: ") and "no-such-run" in failure
    assert outbox.clock.seconds > 0  # the MLflow calls were timed


def _open(uri: str, queue: multiprocessing.Queue) -> None:
    tracker = Tracker(uri, "study", str(Path(uri.removeprefix("sqlite:///")).parent / "a"))
    run, created = tracker.study_run("study", None)
    queue.put((tracker.created_experiment, created, run.run_id))


@pytest.mark.slow  # fresh Python processes: a minute on 2 busy cores
def test_workers_opening_one_new_sqlite_store_together(tmp_path: Path) -> None:
    """Three processes create the store, the experiment and the parent run at once: MLflow's
    schema migrations must not collide, and one experiment and one parent run result."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_open, args=(uri, queue)) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    results = [queue.get(timeout=5) for _ in workers]
    assert sorted(r[0] for r in results) == [False, False, True]  # one created the experiment
    assert sorted(r[1] for r in results) == [False, False, True]  # and the parent run
    assert len({r[2] for r in results}) == 1  # the others found that same run
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("study")
    assert len(client.search_runs([experiment.experiment_id])) == 1


def test_system_metrics_are_sampled_while_a_trial_trains_and_can_be_turned_off(
    tmp_path: Path, hydra_conf
) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    stores = [f"mlflow.tracking_uri={uri}", f"mlflow.artifact_root={tmp_path / 'a'}"]
    cfg = hydra_conf([*stores, "mlflow.system_metrics_interval_s=0.5"])
    on = Tracker.from_config(cfg.mlflow, "sys")  # on by default
    run = on.start_run("trial-0", tags={})
    assert on.close(30)
    client = MlflowClient(uri)
    with on.system_metrics(run.run_id):
        # Work until two samples are in the store: four 0.5 s intervals are enough on an idle
        # machine, but on a loaded 2-core one MLflow's monitor thread took over 2 s to log
        # its second (a full test run failed so); 30 s bounds the wait.
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            sum(i * i for i in range(100_000))
            if len(client.get_metric_history(run.run_id, "system/cpu_utilization_percentage")) >= 2:
                break
    history = client.get_metric_history(run.run_id, "system/cpu_utilization_percentage")
    assert len(history) >= 2, history  # sampled over the block, not once
    assert (
        "system/system_memory_usage_megabytes" in MlflowClient(uri).get_run(run.run_id).data.metrics
    )

    off = Tracker.from_config(hydra_conf([*stores, "mlflow.system_metrics=false"]).mlflow, "sys")
    quiet = off.start_run("trial-1", tags={})
    assert off.close(30)
    with off.system_metrics(quiet.run_id):
        time.sleep(1.0)
    assert not [k for k in MlflowClient(uri).get_run(quiet.run_id).data.metrics if "system" in k]


def test_an_experiment_made_before_the_saved_view_gets_it(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    client.create_experiment("old", artifact_location=(tmp_path / "a").as_uri())
    tracker = Tracker(uri, "old", str(tmp_path / "a"))
    tags = client.get_experiment(tracker.experiment_id).tags
    view = json.loads(tags["mlflow.sharedViewState.batchfit"])
    assert "metrics.`val/acc`" in json.loads(view["state"])["selectedColumns"]
    assert tags["mlflow.experimentKind"] == "custom_model_development"


def test_artifact_downloads_draw_no_progress_bar(monkeypatch, tmp_path: Path, capfd) -> None:
    """MLflow's 'Downloading artifacts' bars leaked into a worker's console."""
    monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)
    http_defaults()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "a").as_uri())
    run = client.create_run(experiment).info.run_id
    for name in ("one.txt", "two.txt"):
        client.log_text(run, "x" * 1000, f"plots/{name}")
    capfd.readouterr()
    client.download_artifacts(run, "plots", str(tmp_path))
    said = capfd.readouterr()
    assert "Downloading artifacts" not in said.out + said.err
    assert (tmp_path / "plots" / "two.txt").read_text() == "x" * 1000


def test_a_queued_upload_takes_the_newest_files_instead_of_queueing_again(
    monkeypatch, tmp_path: Path
) -> None:
    http_defaults()
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    client = MlflowClient(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    log = RunLog(client, Outbox(), run_id="run")
    log.artifacts({"a.png": b"1", "b.png": b"1"}, "plots")
    log.artifacts({"a.png": b"2"}, "plots")  # redrawn while the first waits: joins it
    log.artifacts({"summary.md": b"x"})  # another path queues on its own
    assert len(log.outbox) == 2
    assert log._uploads["plots"] == {"a.png": b"2", "b.png": b"1"}


def _hold_exclusive_lock(db: Path, seconds: float, locked: multiprocessing.Event) -> None:
    connection = sqlite3.connect(db, isolation_level=None)
    connection.execute("BEGIN EXCLUSIVE")
    locked.set()
    time.sleep(seconds)
    connection.execute("ROLLBACK")


@pytest.mark.slow
def test_a_locked_store_gives_one_line_from_the_system_metrics_thread(
    tmp_path: Path, caplog
) -> None:
    """Another process holds mlflow.db in an exclusive transaction for 30 s: MLflow's
    system-metrics thread gives up after its 20 s busy timeout and logs the database error,
    SQL statement and parameters included; batchfit keeps its first line."""
    quiet_logging()
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri, "locked", str(tmp_path / "a"), system_metrics_interval_s=0.2)
    run = tracker.start_run("trial-0", tags={})
    assert tracker.close(30)
    context = multiprocessing.get_context("spawn")
    locked = context.Event()
    holder = context.Process(target=_hold_exclusive_lock, args=(tmp_path / "mlflow.db", 30, locked))
    holder.start()
    assert locked.wait(30)
    watching = caplog.at_level(logging.WARNING, logger=SYSTEM_METRICS_LOGGER)
    with watching, tracker.system_metrics(run.run_id):
        deadline = time.monotonic() + 28  # the monitor's read fails after 20 s
        while time.monotonic() < deadline and not caplog.records:
            time.sleep(0.2)
    holder.join(timeout=30)
    records = [r for r in caplog.records if r.name == SYSTEM_METRICS_LOGGER]
    assert records, "the monitor did not meet the lock"
    for record in records:
        message = record.getMessage()
        assert "\n" not in message and "database is locked" in message, message
        assert "more lines left out" in message


def test_mlflow_stores_an_experiments_artifact_location_absolute(
    tmp_path: Path, monkeypatch
) -> None:
    """Why a moved project directory cannot carry its artifact location along (docs/
    troubleshooting.md): MLflow resolves a relative location against the working directory."""
    monkeypatch.chdir(tmp_path)
    client = MlflowClient("sqlite:///mlflow.db")
    experiment_id = client.create_experiment("rel", artifact_location="artifacts/rel")
    location = client.get_experiment(experiment_id).artifact_location
    assert location == str(tmp_path / "artifacts" / "rel")


def test_a_moved_project_directory_is_said(tmp_path: Path, monkeypatch, caplog) -> None:
    """The decision (docs/troubleshooting.md): MLflow keeps the old absolute location, and
    batchfit says where the study's artifacts go and how to keep them with the project."""
    caplog.set_level(logging.WARNING, logger="batchfit.tracking.runs")
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    monkeypatch.chdir(old)
    for _ in range(2):  # created, then found again in place: nothing to say
        Tracker("sqlite:///mlruns/mlflow.db", "study", "mlruns/artifacts")
    assert not [r for r in caplog.records if r.name == "batchfit.tracking.runs"]
    old.rename(new)
    monkeypatch.chdir(new)
    tracker = Tracker("sqlite:///mlruns/mlflow.db", "study", "mlruns/artifacts")
    (said,) = [r.getMessage() for r in caplog.records if r.name == "batchfit.tracking.runs"]
    assert said.startswith(
        f"MLflow experiment 'study' keeps its artifacts in {old}/mlruns/artifacts/study, which "
        f"no longer exists, not under mlflow.artifact_root ({new}/mlruns/artifacts): MLflow "
        "fixed that absolute path when it created the experiment"
    )
    location = tracker.client.get_experiment(tracker.experiment_id).artifact_location
    assert location == (old / "mlruns" / "artifacts" / "study").as_uri()  # as said: the old one


def test_memory_figures_are_logged_in_mib_too() -> None:
    figures = {"memory/peak_bytes": 152991520.0, "memory/budget_bytes": 2**30, "val/acc": 0.9}
    assert mib_metrics(figures) == {"memory/peak_mib": 145.9, "memory/budget_mib": 1024.0}
    assert mib_metrics({"memory/peak_bytes": float("nan")}) == {}


def test_a_study_saves_its_objectives_view_on_its_experiment(tmp_path: Path) -> None:
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "lm", str(tmp_path / "a"))
    parent, _ = tracker.study_run("lm", None)
    parent.save_view(["val/loss", "throughput/tokens_per_sec"])
    assert tracker.close(30)
    view = json.loads(tracker.client.get_experiment(tracker.experiment_id).tags[VIEW_TAG])
    assert json.loads(view["state"])["selectedColumns"][1] == "metrics.`val/loss`"


def test_the_recommended_mark_moves_to_the_new_recommendation(tmp_path: Path) -> None:
    """One run of the study's trials carries it, whichever worker marked the last one."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri, "study", str(tmp_path / "a"))
    parent, _ = tracker.study_run("study", None)
    other = Tracker(uri, "other", str(tmp_path / "a"))  # another study's trial 1: untouched
    stranger = other.start_run("trial-1", {ROLE_TAG: "trial", TRIAL_TAG: 1})
    for number in range(3):
        tracker.start_run(f"trial-{number}", {ROLE_TAG: "trial", TRIAL_TAG: number}, parent.run_id)
    another_worker = RunLog(MlflowClient(uri), Outbox(), parent.run_id)

    def marked() -> list[str]:
        assert tracker.close(30) and other.close(30)
        runs = MlflowClient(uri).search_runs(
            [tracker.experiment_id, other.experiment_id],
            filter_string=f"tags.`{RECOMMENDED_TAG}` = 'true'",
        )
        return [r.info.run_name for r in runs]

    parent.mark_recommended(1)
    assert marked() == ["trial-1"]
    another_worker.mark_recommended(2)
    assert marked() == ["trial-2"]
    parent.mark_recommended(2)  # again: nothing changes
    assert marked() == ["trial-2"]
    assert RECOMMENDED_TAG not in MlflowClient(uri).get_run(stranger.run_id).data.tags


# --- trial run names (search/core/record.py TrialRecord.run_name: the runs table's first column)

CONFIG = {"trainer.batch_size": 64, "trainer.accum_steps": 2, "trainer.precision": "bf16"}


@pytest.mark.parametrize(
    ("objectives", "attrs", "name"),
    [
        (  # a language model: its loss and tokens/s, not accuracy and samples/s
            ["val/loss", "throughput/tokens_per_sec"],
            {"unit": "tokens", "throughput": 9120.4, "peak_bytes": 152991520,
             "metrics": {"val/loss": 2.31012, "throughput/tokens_per_sec": 9120.4,
                         "throughput/samples_per_sec": 35.6}},
            "trial-3 · 64x2 bf16 · loss 2.310 · 9120 tokens/s · 145.9 MiB",
        ),
        (  # one objective: its throughput anyway; a memory objective is the MiB at the end
            ["val/acc", "memory/peak_bytes", "perf/mfu"],
            {"unit": "samples", "throughput": 912.4, "peak_bytes": 678996,
             "metrics": {"val/acc": 0.9456, "perf/mfu": 0.41234,
                         "throughput/samples_per_sec": 912.4}},
            "trial-3 · 64x2 bf16 · acc 0.946 · mfu 0.4123 · 912/s · 0.6 MiB",
        ),
    ],
)  # fmt: skip
def test_a_trials_name_gives_the_studys_objectives(objectives, attrs, name) -> None:
    record = TrialRecord.from_attrs(3, CONFIG | {"state": "COMPLETE"} | attrs)
    assert record.run_name(objectives) == name


def test_a_slow_trials_name_gives_its_projection() -> None:
    attrs = {"state": "PRUNED", "reason": "slow", "projected_s": 412.3, "time_budget_s": 60.0}
    assert TrialRecord.from_attrs(3, CONFIG | attrs).run_name() == (
        "trial-3 · 64x2 bf16 · PRUNED slow (projected 412 s, budget 60 s)"
    )


def test_a_mark_another_worker_removed_meanwhile_is_no_error(tmp_path: Path) -> None:
    """Two workers move the recommendation at once: both read trial 1's run as marked, one
    untags it first; the other's untag finds no tag (MLflow raises) and goes on."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri, "study", str(tmp_path / "a"))
    parent, _ = tracker.study_run("study", None)
    for number in range(3):
        tracker.start_run(f"trial-{number}", {ROLE_TAG: "trial", TRIAL_TAG: number}, parent.run_id)
    parent.mark_recommended(1)
    assert tracker.close(30)

    class Racing(MlflowClient):
        def delete_tag(self, run_id: str, key: str) -> None:
            MlflowClient(uri).delete_tag(run_id, key)  # the other worker, first
            super().delete_tag(run_id, key)

    outbox = Outbox()
    RunLog(Racing(uri), outbox, parent.run_id).mark_recommended(2)
    assert outbox.wait(30) and outbox.failed == []  # written, nothing refused
    runs = MlflowClient(uri).search_runs(
        [tracker.experiment_id], filter_string=f"tags.`{RECOMMENDED_TAG}` = 'true'"
    )
    assert [r.info.run_name for r in runs] == ["trial-2"]
