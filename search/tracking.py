"""MLflow records: one experiment per study, a parent run per study, a nested run per trial.

Uses `MlflowClient` with explicit run ids (no fluent active-run stack), and batches: a trial
buffers its interval metrics and writes them with one `log_batch` per validation.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from search.report import best_trials, state_label
from search.study import counts_as_finished

PARENT_TAG = "mlflow.parentRunId"
ROLE_TAG = "batchfit.role"


def _now_ms() -> int:
    return int(time.time() * 1000)


def _ensure_sqlite_dir(uri: str) -> None:
    if uri.startswith("sqlite:///"):
        path = uri.removeprefix("sqlite:///")
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)


class RunLog:
    """One MLflow run with buffered metrics."""

    def __init__(self, client: MlflowClient, run_id: str):
        self.client = client
        self.run_id = run_id
        self._pending: list[Metric] = []

    def metrics(self, values: Mapping[str, float], step: int = 0, flush: bool = False) -> None:
        now = _now_ms()
        self._pending += [Metric(k, float(v), now, step) for k, v in values.items()]
        if flush:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self.client.log_batch(self.run_id, metrics=self._pending)
            self._pending = []

    def params(self, values: Mapping[str, Any]) -> None:
        # MlflowClient.log_batch splits into chunks within the server's per-request limits.
        self.client.log_batch(
            self.run_id, params=[Param(k, _param_str(v)) for k, v in values.items()]
        )

    def tags(self, values: Mapping[str, Any]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in values.items()])

    def text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def table(self, columns: Mapping[str, list], artifact_file: str) -> None:
        """A table (column name -> values) the MLflow UI shows as one (artifact view)."""
        self.client.log_table(self.run_id, data=dict(columns), artifact_file=artifact_file)

    def finish(self, status: str = "FINISHED") -> None:
        self.flush()
        self.client.set_terminated(self.run_id, status=status)


def _param_str(value: Any) -> str:
    return "null" if value is None else str(value)


class Tracker:
    """The MLflow side of a study or a single run."""

    def __init__(self, tracking_uri: str, experiment_name: str, artifact_root: str):
        _ensure_sqlite_dir(tracking_uri)
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.tracking_uri = tracking_uri
        self.experiment_id = self._experiment(experiment_name, artifact_root)

    def _experiment(self, name: str, artifact_root: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = (Path(artifact_root).resolve() / name).as_uri()
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except MlflowException:  # another worker created it first
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def start_run(self, name: str, tags: Mapping[str, Any], parent_id: str | None = None) -> RunLog:
        all_tags = {k: str(v) for k, v in tags.items()}
        if parent_id:
            all_tags[PARENT_TAG] = parent_id
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        return RunLog(self.client, run.info.run_id)

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
        return RunLog(self.client, run_id)


class StudyRun:
    """The study's parent run: fixed config, counts per state, the best trial so far."""

    def __init__(self, log: RunLog, metrics: list[str]):
        self.log = log
        self.metrics = metrics

    def update(self, study: Any) -> None:
        """Optuna callback: refresh counts and best values after each finished trial."""
        counts: dict[str, float] = {}
        for trial in study.get_trials(deepcopy=False):
            if counts_as_finished(trial):
                key = "trials/" + state_label(trial).lower().replace(" (", "_").rstrip(")")
                counts[key] = counts.get(key, 0) + 1
        counts["trials/finished"] = sum(counts.values())
        best = best_trials(study, limit=1)
        tags: dict[str, Any] = {}
        if best:
            for metric, value in zip(self.metrics, best[0].values, strict=True):
                counts[f"best/{metric}"] = value
            tags = {"best.trial": best[0].number}
            tags.update({f"best.{k}": v for k, v in best[0].params.items()})
        self.log.metrics(counts, step=len(study.trials), flush=True)
        if tags:
            self.log.tags(tags)

    def __call__(self, study: Any, trial: Any) -> None:
        self.update(study)
