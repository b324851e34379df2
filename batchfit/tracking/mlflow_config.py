"""The `mlflow` section of the config (conf/config.yaml) as a typed, checked record.

`MlflowConfig` checks what can be checked without reaching the store, before the first trial
(search/study/validate.py, train/__main__.py): that the tracking URI names a store MLflow has (its
scheme, plugins' included) and that the other settings have the right types. Whether the
store can be reached and used is found when it is opened (tracking/store.py).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from batchfit.common.checks import (
    ConfigError,
    flag_problems,
    must_be,
    number_problems,
    section_from_mapping,
)
from batchfit.common.redact import redact

# The tracking stores MLflow 3 has (a bare path is a file store too), as URI schemes; a
# database's driver follows a + (postgresql+psycopg). Plugins add theirs by entry point.
TRACKING_SCHEMES = (
    "sqlite", "postgresql", "mysql", "mssql", "http", "https", "file", "databricks",
)  # fmt: skip
TRACKING_EXAMPLES = (
    "mlflow.tracking_uri=sqlite:///mlruns/mlflow.db (a local file) or "
    "mlflow.tracking_uri=http://HOST:5000 (a tracking server)"
)


def tracking_schemes() -> tuple[str, ...]:
    plugins = importlib.metadata.entry_points(group="mlflow.tracking_store")
    return (*TRACKING_SCHEMES, *sorted(p.name for p in plugins))


@dataclass(frozen=True)
class MlflowConfig:
    """The `mlflow` section of the config (conf/config.yaml), checked before the first trial."""

    tracking_uri: str = "sqlite:///mlruns/mlflow.db"
    artifact_root: str = "mlruns/artifacts"  # where new experiments keep their artifacts
    outage_wait_s: float = 600.0  # checked with the study's settings (search/core/study_config.py)
    system_metrics: bool = True
    system_metrics_interval_s: float = 5.0

    def __post_init__(self) -> None:
        problems = []
        uri = self.tracking_uri
        scheme = urlparse(uri).scheme.split("+")[0].lower() if isinstance(uri, str) else None
        if not isinstance(uri, str) or not uri.strip():
            hint = "e.g. mlflow.tracking_uri=sqlite:///mlruns/mlflow.db"
            problems.append(must_be("mlflow.tracking_uri", "a tracking URI", uri, hint=hint))
        elif scheme and scheme not in tracking_schemes():
            problems.append(
                f"mlflow.tracking_uri={redact(uri)!r}: MLflow has no tracking store for "
                f"{scheme}://; it takes {', '.join(tracking_schemes())}; e.g. "
                f"{TRACKING_EXAMPLES}"
            )
        root = self.artifact_root
        if not isinstance(root, str) or not root.strip():
            problems.append(
                must_be("mlflow.artifact_root", "a directory", root, "mlruns/artifacts")
            )
        problems += flag_problems("mlflow.system_metrics", self.system_metrics)
        problems += number_problems(
            "mlflow.system_metrics_interval_s",
            self.system_metrics_interval_s,
            "a number of seconds > 0",
            above=0,
            fix=5,
        )
        if problems:
            raise ConfigError(problems)

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> MlflowConfig:
        return section_from_mapping(cls, "mlflow", values, owner="an mlflow setting")
