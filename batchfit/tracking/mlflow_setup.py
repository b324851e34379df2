"""What batchfit changes in MLflow's own behaviour, for the whole process: its HTTP client's
retries and URL printing (environment variables) and its loggers (levels, and one line per
error of the system-metrics thread).

The entry points (search/__main__.py, train/__main__.py) call `http_defaults()` and
`quiet_logging()` before their first MLflow call; importing this module changes nothing.
"""

from __future__ import annotations

import logging
import os

from batchfit.common.redact import redact

# MLflow's system-metrics thread logs a failed write with the whole database error in the
# message (a locked SQLite store: the SQL statement and its parameters, ~70 lines).
SYSTEM_METRICS_LOGGER = "mlflow.system_metrics.system_metrics_monitor"


def http_defaults() -> None:
    """MLflow's REST client retries a failed request 7 times over ~4 minutes, inside the
    call; the outbox retries instead, so a trial never blocks on a down server. MLflow also
    prints each run's URL, password included, to stdout; the study prints its own lines; and
    it draws a tqdm bar for each artifact download (a resumed study's plots, a worker's
    summary), which leaks into a worker's console and a SLURM log. A user's own setting of
    these variables wins."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


class FirstLineFilter(logging.Filter):
    """Cuts a record's message to its first line, redacted, and says that the rest was left
    out; for a logger whose messages embed whole exception texts."""

    def filter(self, record: logging.LogRecord) -> bool:
        lines = record.getMessage().splitlines()
        if len(lines) > 1:
            left_out = len(lines) - 1
            record.msg = f"{redact(lines[0].rstrip())} [{left_out} more lines left out]"
            record.args = None
        return True


def quiet_logging() -> None:
    """MLflow's INFO chatter (schema migrations through alembic, the system-metrics monitor)
    would bury the trial lines, and its system-metrics thread's errors are one line each;
    the entry points call this, importing does not."""
    for name in ("alembic", "mlflow"):
        logging.getLogger(name).setLevel(logging.WARNING)
    monitor = logging.getLogger(SYSTEM_METRICS_LOGGER)
    if not any(isinstance(f, FirstLineFilter) for f in monitor.filters):
        monitor.addFilter(FirstLineFilter())
