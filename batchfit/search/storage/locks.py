"""The study's lock: the end of a study is made once, by one worker (search/study/decision.py),
under `study_lock`: an flock on `<journal>.decision.flock` beside a journal, a PostgreSQL
advisory lock in the database.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

# optuna.storages._heartbeat and optuna.storages.journal._file are private (no public name);
# what this module relies on (the heartbeat base class, for which Optuna beats and fails stale
# trials; the journal lock's base class and context) is pinned by tests/test_private_apis.py.
import sqlalchemy
from optuna.storages import BaseStorage
from optuna.storages.journal import JournalFileSymlinkLock
from optuna.storages.journal._file import BaseJournalFileLock, get_lock_file

from batchfit.search.storage.journal import FlockJournalLock, SafeJournalFileBackend

DECISION_SUFFIX = ".decision.flock"  # beside the journal: held while a study's end is decided
DECISION_GRACE_S = 600  # no flock: Optuna's symlink lock older than this is a dead holder's


@contextlib.contextmanager
def study_lock(storage: BaseStorage, study_name: str) -> Iterator[None]:
    """Held by one process at a time among all the study's workers, on any host, and
    released when its holder dies however it dies:
    - journal file: an flock on `<journal>.decision.flock` (one per journal); where the
      filesystem has no flock, Optuna's symlink lock `<journal>.decision.lock`, taken over
      from a holder that kept it DECISION_GRACE_S (a dead one);
    - PostgreSQL: a session advisory lock keyed by the study's name, on a connection of its
      own (the server releases it when that connection ends);
    - SQLite and in-memory storages have one worker (validate refuses more): no lock;
      neither for another database (MySQL), where two workers ending at once may each
      decide (the later decision is the study's)."""
    backend = getattr(storage, "_backend", None)
    if isinstance(backend, SafeJournalFileBackend):
        lock: BaseJournalFileLock
        if isinstance(backend.lock, FlockJournalLock):
            lock = FlockJournalLock(
                backend.path,
                DECISION_SUFFIX,
                "another worker is deciding the study's recommendation",
                warn_s=60.0,  # a speed check takes tens of seconds
            )
        else:
            lock = JournalFileSymlinkLock(f"{backend.path}.decision", DECISION_GRACE_S)
        with get_lock_file(lock):
            yield
        return
    engine = getattr(storage, "engine", None)
    if engine is not None and engine.dialect.name == "postgresql":
        with _advisory_lock(engine, study_name):
            yield
        return
    yield


@contextlib.contextmanager
def _advisory_lock(engine: Any, study_name: str) -> Iterator[None]:
    digest = hashlib.sha256(f"batchfit:study_lock:{study_name}".encode()).digest()
    key = {"key": int.from_bytes(digest[:8], "big", signed=True)}  # PostgreSQL's bigint
    with engine.connect() as connection:
        connection.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), key)
        connection.commit()
        try:
            yield
        finally:
            try:
                connection.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:key)"), key)
                connection.commit()
            except Exception:
                connection.invalidate()  # closed, never back to the pool holding the lock
                raise
