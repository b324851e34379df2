"""tracking/mlflow_config.py: the `mlflow` section's problems, all at once, each naming its key
and the fix, as a user reads them."""

from __future__ import annotations

import pytest

from batchfit.common.checks import ConfigError
from batchfit.tracking.mlflow_config import MlflowConfig


def _problems(**values: object) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        MlflowConfig.from_mapping(values)
    return raised.value.problems


def test_the_defaults_are_valid() -> None:
    assert MlflowConfig.from_mapping({}) == MlflowConfig()


def test_every_problem_is_said_at_once_with_its_fix() -> None:
    problems = _problems(
        tracking_uri=" ", artifact_root="", system_metrics="yes", system_metrics_interval_s=0
    )
    assert problems == [
        "mlflow.tracking_uri must be a tracking URI, got ' '; "
        "e.g. mlflow.tracking_uri=sqlite:///mlruns/mlflow.db",
        "mlflow.artifact_root must be a directory, got ''; "
        "override with mlflow.artifact_root=mlruns/artifacts",
        "mlflow.system_metrics must be true or false, got 'yes'; "
        "override with mlflow.system_metrics=true",
        "mlflow.system_metrics_interval_s must be a number of seconds > 0, got 0; "
        "override with mlflow.system_metrics_interval_s=5",
    ]


@pytest.mark.parametrize("interval", [True, "5", -1.0, float("nan"), None])
def test_the_sampling_interval_is_a_positive_number(interval: object) -> None:
    (problem,) = _problems(system_metrics_interval_s=interval)
    assert problem.startswith(
        f"mlflow.system_metrics_interval_s must be a number of seconds > 0, got {interval!r}"
    )


def test_an_unknown_store_names_the_ones_mlflow_has() -> None:
    (problem,) = _problems(tracking_uri="postgres://u:secret@db/mlflow")
    assert problem.startswith("mlflow.tracking_uri='postgres://u:***@db/mlflow': MLflow has no")
    assert "it takes sqlite, postgresql, mysql" in problem and "secret" not in problem


def test_an_unknown_key_names_the_closest_one() -> None:
    (problem,) = _problems(system_metric=False)
    assert problem.startswith("mlflow.system_metric is not an mlflow setting; known: ")
    assert problem.endswith("did you mean mlflow.system_metrics?")
