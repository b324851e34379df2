"""MLflow records: one experiment per study, a parent run per study, a nested run per trial.

Uses `MlflowClient` with explicit run ids (no fluent active-run stack), and batches: a trial
buffers its interval metrics and writes them with one `log_batch` per validation.

Several workers write to one store. Every write goes through an `Outbox` (tracking/outbox.py),
in order, retried while the store is away: the study goes on meanwhile, and nothing is lost
unless the store is still unreachable `mlflow.outage_wait_s` after the last trial.
The study's parent run is created once, by the worker that created the study's MLflow
experiment (MLflow refuses a second experiment of one name): the others wait for it.

Opening the store is tracking/store.py's; the runs' tags are named in tracking/tags.py, and
the experiment's saved view in the MLflow UI is built by tracking/mlflow_ui.py.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from batchfit.common.redact import redact
from batchfit.tracking.metrics import (
    DATA_WAIT_SHARE,
    THROUGHPUT_PREFIX,
    THROUGHPUT_SAMPLES,
    TRAIN_EPOCH,
)
from batchfit.tracking.mlflow_ui import VIEW_TAG, experiment_tags
from batchfit.tracking.outbox import Outbox
from batchfit.tracking.store import check_database, open_client, retry_at_start, schema_lock
from batchfit.tracking.tags import (
    NOTE_TAG,
    PARENT_TAG,
    RECOMMENDED_TAG,
    ROLE_TAG,
    STATE_TAG,
    STUDY_TAG,
    TRIAL_TAG,
)

_logger = logging.getLogger(__name__)

PARENT_WAIT_S = 60.0  # how long a worker waits for the parent run another worker creates
FRESH_EXPERIMENT_S = 300.0  # an experiment younger than this may still be getting its parent
# Logged per interval while a run trains (the unit's throughput too, e.g. tokens_per_sec).
CURVE_METRICS = (THROUGHPUT_SAMPLES, DATA_WAIT_SHARE)
MIB = 2**20


def mib_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """memory/*_bytes figures in MiB too (memory/peak_mib), to 0.1 MiB: the runs table shows
    bytes as a 9-digit number, cut at its column's width."""
    return {
        f"{key.removesuffix('_bytes')}_mib": round(value / MIB, 1)
        for key, value in metrics.items()
        if key.startswith("memory/") and key.endswith("_bytes") and value == value
    }


def elsewhere_note(location: str, wanted: Path) -> str | None:
    """What to say when an experiment's artifacts are not where mlflow.artifact_root puts a
    new one's. MLflow stores an experiment's artifact location absolute, fixed at creation
    (a relative one is resolved against the working directory), and each run's too: a moved
    or copied project directory still writes into the old one, and batchfit cannot change
    that through MLflow's API. So it says so, once per start, instead."""
    parsed = urlparse(location)
    if parsed.scheme not in ("", "file"):
        return None  # a remote artifact store: not the project directory's
    path = Path(url2pathname(parsed.path)) if parsed.scheme else Path(location)
    if path == wanted.resolve():
        return None
    gone = "" if path.parent.exists() else ", which no longer exists"
    return (
        f"MLflow experiment {wanted.name!r} keeps its artifacts in {path}{gone}, not under "
        f"mlflow.artifact_root ({wanted.resolve().parent}): MLflow fixed that absolute path "
        "when it created the experiment, so this study's artifacts go there. To keep them with "
        "this project, start a new MLflow store (e.g. mlflow.tracking_uri=sqlite:///"
        "mlruns/mlflow-moved.db) or move the project back"
    )


def _now_ms() -> int:
    return int(time.time() * 1000)


class RunLog:
    """One MLflow run with buffered metrics; its id is known once the outbox created it."""

    def __init__(self, client: MlflowClient, outbox: Outbox, run_id: str | None = None):
        self.client = client
        self.outbox = outbox
        self.run_id = run_id
        self._pending: list[Metric] = []
        # Uploads still queued, by artifact path: a newer version of the same files joins
        # the queued one instead of queueing again (plots are megabytes, redrawn often).
        # (The outbox writes in this thread, between calls: nothing else touches them.)
        self._uploads: dict[str | None, dict[str, bytes]] = {}

    def metrics(self, values: Mapping[str, float], step: int = 0, flush: bool = False) -> None:
        now = _now_ms()
        self._pending += [Metric(k, float(v), now, step) for k, v in values.items()]
        if flush:
            self.flush()

    def end_figures(self, metrics: Mapping[str, float], last_step: int) -> None:
        """A run's end figures (a trial's, `python -m train`'s), NaN left out, with
        memory/*_mib beside memory/*_bytes. At step 0: MLflow's chart view draws a metric
        whose last step is 0 as one bar per run (a comparison), not as a one-point line.
        Figures with a curve (throughput, logged per interval) end at `last_step` instead."""
        known = {k: v for k, v in metrics.items() if v == v}
        curves = {
            k: v for k, v in known.items() if k in CURVE_METRICS or k.startswith(THROUGHPUT_PREFIX)
        }
        figures = {k: v for k, v in {**known, **mib_metrics(known)}.items() if k not in curves}
        self.metrics(figures, step=0)
        if curves:
            self.metrics(curves, step=last_step)

    def validation(self, step: int, metrics: Mapping[str, Any]) -> None:
        """A validation's figures (the `/`-named ones of the training loop's on_eval) at
        `step`, written now; with the epoch as a metric of its own, which the UI's charts
        can use as their x-axis to compare runs of different step sizes."""
        figures = {k: v for k, v in metrics.items() if "/" in k}
        figures[TRAIN_EPOCH] = metrics["epoch"]
        self.metrics(figures, step, flush=True)

    def flush(self) -> None:
        if self._pending:
            batch, self._pending = self._pending, []
            self.outbox.put(lambda: self.client.log_batch(self.run_id, metrics=batch))

    def params(self, values: Mapping[str, Any]) -> None:
        # MlflowClient.log_batch splits into chunks within the server's per-request limits.
        params = [Param(k, redact(_param_str(v))) for k, v in values.items()]
        self.outbox.put(lambda: self.client.log_batch(self.run_id, params=params))

    def tags(self, values: Mapping[str, Any]) -> None:
        tags = [RunTag(k, redact(str(v))) for k, v in values.items()]
        self.outbox.put(lambda: self.client.log_batch(self.run_id, tags=tags))

    def text(self, text: str, artifact_file: str) -> None:
        masked = redact(text)
        self.outbox.put(lambda: self.client.log_text(self.run_id, masked, artifact_file))

    def table(self, columns: Mapping[str, list], artifact_file: str) -> None:
        """A table (column name -> values) the MLflow UI shows as one (artifact view)."""
        data = dict(columns)
        self.outbox.put(
            lambda: self.client.log_table(self.run_id, data=data, artifact_file=artifact_file)
        )

    def artifacts(self, files: Mapping[str, bytes], artifact_path: str | None = None) -> None:
        """Files (name -> content) under `artifact_path`, replacing earlier versions. While
        an upload to the same path waits in the outbox (MLflow away or busy), these files
        replace its contents: one upload, of the newest versions."""
        queued = self._uploads.get(artifact_path)
        if queued is not None:
            queued.update(files)
            return
        contents = self._uploads[artifact_path] = dict(files)

        def upload() -> None:
            with tempfile.TemporaryDirectory() as folder:
                for name, content in contents.items():
                    (Path(folder) / name).write_bytes(content)
                self.client.log_artifacts(self.run_id, folder, artifact_path)
            del self._uploads[artifact_path]  # written: a new version queues anew

        self.outbox.put(upload)

    def rename(self, name: str) -> None:
        self.outbox.put(lambda: self.client.update_run(self.run_id, name=name))

    def description(self, markdown: str) -> None:
        """The run's description, shown rendered at the top of its page in the MLflow UI."""
        self.tags({NOTE_TAG: markdown})

    def save_view(self, objectives: Sequence[str]) -> None:
        """batchfit's saved view (view_state) on this run's experiment, for these objectives."""
        tags = experiment_tags(objectives)

        def write() -> None:
            experiment_id = self.client.get_run(self.run_id).info.experiment_id
            for key, value in tags.items():
                self.client.set_experiment_tag(experiment_id, key, value)

        self.outbox.put(write)

    def mark_recommended(self, trial_number: int) -> None:
        """Tag the run of this (parent) run's trial `trial_number` RECOMMENDED_TAG=true, and
        untag the one that was: the recommendation moves as trials finish, and any worker
        may have tagged the last one."""

        def write() -> None:
            experiment_id = self.client.get_run(self.run_id).info.experiment_id
            children = f"tags.`{PARENT_TAG}` = '{self.run_id}'"
            marked = self.client.search_runs(
                [experiment_id], f"{children} and tags.`{RECOMMENDED_TAG}` = 'true'"
            )
            chosen = self.client.search_runs(
                [experiment_id], f"{children} and tags.`{TRIAL_TAG}` = '{trial_number}'"
            )
            chosen_ids = {run.info.run_id for run in chosen}
            for run in marked:
                if run.info.run_id not in chosen_ids:
                    self._untag(run.info.run_id, RECOMMENDED_TAG)
            for run_id in chosen_ids - {run.info.run_id for run in marked}:
                self.client.set_tag(run_id, RECOMMENDED_TAG, "true")

        self.outbox.put(write)

    def _untag(self, run_id: str, key: str) -> None:
        """Delete a tag another worker may have deleted since it was read: gone either way."""
        try:
            self.client.delete_tag(run_id, key)
        except MlflowException:
            if key in self.client.get_run(run_id).data.tags:
                raise

    def finish(self, status: str = "FINISHED") -> None:
        self.flush()
        end_ms = _now_ms()
        self.outbox.put(
            lambda: self.client.set_terminated(self.run_id, status=status, end_time=end_ms)
        )


def _param_str(value: Any) -> str:
    return "null" if value is None else str(value)


class Tracker:
    """The MLflow side of a study or a single run."""

    def __init__(
        self,
        tracking_uri: str,
        experiment_name: str,
        artifact_root: str,
        system_metrics_interval_s: float | None = None,
    ):
        self.tracking_uri = tracking_uri
        # MLflow's system metrics (CPU, memory, GPU) per run, sampled this often; None: off
        self.system_metrics_interval_s = system_metrics_interval_s
        self.outbox = Outbox()
        self.created_experiment = False  # True in the one worker that created it
        check_database(tracking_uri)
        with schema_lock(tracking_uri):  # MlflowClient creates or migrates the schema
            self.client = retry_at_start(lambda: open_client(tracking_uri), tracking_uri)
            self.experiment_id = retry_at_start(
                lambda: self._experiment(experiment_name, artifact_root), tracking_uri
            )

    def _experiment(self, name: str, artifact_root: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            if VIEW_TAG not in found.tags:  # made before batchfit saved its view
                for key, value in experiment_tags().items():
                    self.client.set_experiment_tag(found.experiment_id, key, value)
            moved = elsewhere_note(found.artifact_location, Path(artifact_root) / name)
            if moved:
                _logger.warning(moved)
            return found.experiment_id
        location = (Path(artifact_root).resolve() / name).as_uri()
        try:
            experiment_id = self.client.create_experiment(
                name, artifact_location=location, tags=experiment_tags()
            )
        except MlflowException:  # another worker created it first
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id
        self.created_experiment = True
        return experiment_id

    @classmethod
    def from_config(cls, mlflow: Any, experiment_name: str) -> Tracker:
        """From the `mlflow` config node (conf/config.yaml)."""
        interval = mlflow.system_metrics_interval_s if mlflow.system_metrics else None
        return cls(mlflow.tracking_uri, experiment_name, mlflow.artifact_root, interval)

    @contextlib.contextmanager
    def system_metrics(self, run_id: str | None) -> Iterator[None]:
        """MLflow's system metrics monitor on this run while the block runs (a thread that
        samples CPU, memory and GPU every system_metrics_interval_s and logs `system/*`)."""
        if not self.system_metrics_interval_s or run_id is None:
            yield
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(
            run_id,
            sampling_interval=self.system_metrics_interval_s,
            samples_before_logging=1,
            tracking_uri=self.tracking_uri,
        )
        monitor.start()
        try:
            yield
        finally:
            monitor.finish()

    def start_run(self, name: str, tags: Mapping[str, Any], parent_id: str | None = None) -> RunLog:
        all_tags = {k: redact(str(v)) for k, v in tags.items()}
        if parent_id:
            all_tags[PARENT_TAG] = parent_id
        log = RunLog(self.client, self.outbox)

        def create() -> None:
            run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
            log.run_id = run.info.run_id

        self.outbox.put(create)
        return log

    def resume_run(self, run_id: str | None) -> RunLog | None:
        """The run with this id, set back to RUNNING; None if it is gone from the store."""
        if not run_id:
            return None
        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            return None
        if run.info.experiment_id != self.experiment_id:
            return None
        self.client.update_run(run_id, status="RUNNING")
        return RunLog(self.client, self.outbox, run_id)

    def study_run(self, study_name: str, known_id: str | None) -> tuple[RunLog, bool]:
        """The study's parent run and whether this worker created it. It is created once:
        by the worker that created the experiment, or, for an experiment that has been
        there a while without one, by the first worker that finds it so."""
        resumed = retry_at_start(
            lambda: self.resume_run(known_id) or self.resume_run(self._find_study_run(study_name)),
            self.tracking_uri,
        )
        if resumed is not None:
            return resumed, False
        if not self.created_experiment and self._experiment_is_fresh():
            deadline = time.monotonic() + PARENT_WAIT_S
            while time.monotonic() < deadline:
                time.sleep(0.2)
                found = retry_at_start(
                    lambda: self.resume_run(self._find_study_run(study_name)), self.tracking_uri
                )
                if found is not None:
                    return found, False
        tags = {ROLE_TAG: "study", STUDY_TAG: study_name}
        run = retry_at_start(
            lambda: self.client.create_run(self.experiment_id, run_name=study_name, tags=tags),
            self.tracking_uri,
        )
        return RunLog(self.client, self.outbox, run.info.run_id), True

    def _find_study_run(self, study_name: str) -> str | None:
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{ROLE_TAG}` = 'study' and tags.`{STUDY_TAG}` = '{study_name}'",
            order_by=["attributes.start_time ASC"],
            max_results=1,
        )
        return runs[0].info.run_id if runs else None

    def earlier_study(self, study_name: str) -> str | None:
        """The study run of this name already in the experiment, said in words ('parent run
        R, started T, N trial runs'); None where there is none."""
        run_id = retry_at_start(lambda: self._find_study_run(study_name), self.tracking_uri)
        if run_id is None:
            return None
        run = self.client.get_run(run_id)
        trials = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` = '{run_id}' and tags.`{ROLE_TAG}` = 'trial'",
            max_results=1000,
        )
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(run.info.start_time / 1000))
        return f"parent run {run_id}, started {started}, {len(trials)} trial runs"

    def _experiment_is_fresh(self) -> bool:
        experiment = retry_at_start(
            lambda: self.client.get_experiment(self.experiment_id), self.tracking_uri
        )
        created_ms = experiment.creation_time or 0
        return _now_ms() - created_ms < FRESH_EXPERIMENT_S * 1000

    def end_killed_runs(self, trial_numbers: set[int]) -> list[int]:
        """End as KILLED the runs of these trials (whose workers died); the trial numbers
        whose runs were ended. A run may have FINISHED already: its worker died after
        closing it, before the trial's state reached the study, which runs it again."""
        if not trial_numbers:
            return []
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"attributes.status != 'KILLED' and tags.`{ROLE_TAG}` = 'trial'",
        )
        ended = []
        for run in runs:
            number = int(run.data.tags.get(TRIAL_TAG, -1))
            if number in trial_numbers:
                log = RunLog(self.client, self.outbox, run.info.run_id)
                log.tags({STATE_TAG: "KILLED"})
                log.finish(RunStatus.to_string(RunStatus.KILLED))
                ended.append(number)
        return ended

    def close(self, timeout_s: float) -> bool:
        """Wait for queued writes; False if some are still unwritten after `timeout_s`."""
        return self.outbox.wait(timeout_s)
