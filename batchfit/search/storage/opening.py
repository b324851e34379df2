"""Where a study lives: `search.storage` is an Optuna journal file (`journal:PATH`, the default: no
server, works on a shared filesystem) or any RDB URL (`postgresql://...`, `sqlite:///...`);
`open_storage` opens either with its heartbeats (search/storage/heartbeat.py), creating an RDB's
tables once when workers start together.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# optuna.storages._heartbeat and optuna.storages.journal._file are private (no public name);
# what this module relies on (the heartbeat base class, for which Optuna beats and fails stale
# trials; the journal lock's base class and context) is pinned by tests/test_private_apis.py.
import optuna
import tenacity
from optuna.storages import BaseStorage

from batchfit.common.checks import ConfigError
from batchfit.common.redact import redact
from batchfit.search.storage.heartbeat import (
    HeartbeatJournalStorage,
    HeartbeatRDBStorage,
    RetryStaleTrial,
)
from batchfit.search.storage.journal import SafeJournalFileBackend
from batchfit.tracking.outputs import store_examples

JOURNAL_PREFIX = "journal:"


def _lost_creation_race(error: BaseException) -> bool:
    """The errors of a worker that lost the race to create the tables: PostgreSQL's "already
    exists", "duplicate key" (UniqueViolation), and SQLite's "UNIQUE constraint failed" (two
    workers inserting alembic_version's one row)."""
    return bool(
        re.search(r"already exists|duplicate key|UniqueViolation|UNIQUE constraint", str(error))
    )


@tenacity.retry(
    retry=tenacity.retry_if_exception(_lost_creation_race),
    stop=tenacity.stop_after_attempt(5),
    wait=tenacity.wait_random(0.2, 1.2),
    reraise=True,
)
def _create_rdb(url: str, heartbeat: dict[str, Any]) -> HeartbeatRDBStorage:
    """Workers starting together on a new database all create Optuna's tables; the losers
    of that race see "already exists" or a duplicate key, and find the tables made on a
    later try (five in all; the last one's error is raised as it is)."""
    return HeartbeatRDBStorage(url, **heartbeat)


def open_storage(url: str, heartbeat_interval_s: int | None) -> BaseStorage:
    """An Optuna storage for `url`: any RDB URL, or journal:PATH for a journal file; with
    heartbeats every `heartbeat_interval_s` seconds (None: off) and a grace of twice that."""
    heartbeat: dict[str, Any] = {}
    if heartbeat_interval_s:
        heartbeat = {
            "heartbeat_interval": heartbeat_interval_s,
            "grace_period": 2 * heartbeat_interval_s,
            "heartbeat_stale_trial_callback": RetryStaleTrial(),
        }
    try:
        if url.startswith(JOURNAL_PREFIX):
            backend = SafeJournalFileBackend(url.removeprefix(JOURNAL_PREFIX))
            if heartbeat:
                return HeartbeatJournalStorage(backend, **heartbeat)
            return optuna.storages.JournalStorage(backend)
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        return _create_rdb(url, heartbeat)
    except Exception as error:  # noqa: BLE001 - any failure here is the URL's
        reason = str(error).splitlines()[0] if str(error) else ""
        raise ConfigError(
            [
                f"search.storage={redact(url)!r} cannot be opened ({type(error).__name__}: "
                f"{redact(reason)}); use a reachable database URL or a journal file in a "
                f"folder that can be written, e.g. {store_examples()[0]}"
            ]
        ) from None


def located(uri: str) -> str:
    """A store's URI as given, with its absolute path where the path is relative: a study
    started in another directory is in that directory's store, not this one's."""
    for prefix in (JOURNAL_PREFIX, "sqlite:///"):
        if uri.startswith(prefix):
            path = Path(uri[len(prefix) :])
            if not path.is_absolute():
                return f"{uri} ({path.resolve()})"
    return uri
