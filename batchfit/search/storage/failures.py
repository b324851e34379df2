"""What a storage error means: the database or the journal's disk gone (the study cannot go on,
said once with its cause), or a connection lost that a retry may heal.
"""

from __future__ import annotations

import traceback

# optuna.storages._heartbeat and optuna.storages.journal._file are private (no public name);
# what this module relies on (the heartbeat base class, for which Optuna beats and fails stale
# trials; the journal lock's base class and context) is pinned by tests/test_private_apis.py.
import sqlalchemy

from batchfit.common.redact import redact
from batchfit.search.storage.journal import JournalWriteError


def storage_failure(error: BaseException | None, url: str) -> str | None:
    """What to tell the user when `error` is the study's storage failing, not a bug: a
    journal that could not be written, or a database that stopped answering (its server
    stopped, restarted, crashed or out of reach: SQLAlchemy's OperationalError raised in the
    study's storage, not in MLflow's). None for anything else. The causes are searched:
    Optuna, failing to record the trial's end on the same storage, raises its own error from
    the failure (StorageInternalError, or an UnboundLocalError from its failed-transaction
    handling in Optuna 5)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, JournalWriteError):
            return str(error)
        if _database_gone(error):
            return redact(
                f"the study's database (search.storage={url}) stopped answering "
                f"({error_reason(error)}); nothing recorded was lost (a trial that was running is "
                "trained again by the next run). Once the database answers, run the same "
                "command again: the study resumes"
            )
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _database_gone(error: BaseException) -> bool:
    """A connection to the study's database that failed or was lost, raised through Optuna's
    storage or this module (MLflow's SQL store raises the same errors)."""
    if not isinstance(error, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError):
        return False
    modules = (
        frame.f_globals.get("__name__", "") for frame, _ in traceback.walk_tb(error.__traceback__)
    )
    return any(name.startswith(("optuna.storages.", __name__)) for name in modules)


def lost_connection(error: BaseException | None) -> BaseException | None:
    """The database error under `error` (Optuna wraps it in StorageInternalError), if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if _database_gone(error):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def error_reason(error: BaseException) -> str:
    """`Type: first line` of the driver's own error (psycopg's says what the server did)."""
    cause = getattr(error, "orig", None) or error
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__
