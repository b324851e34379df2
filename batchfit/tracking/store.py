"""Opening an MLflow tracking store as workers starting together meet it, every failure that
stays said as a ConfigError that names mlflow.tracking_uri and what to do (`_cannot_use`).

- `check_database`: a database server is asked once whether the URL's database can be used;
  MLflow would retry for two minutes an answer that no wait changes.
- `schema_lock`: workers opening one new SQLite store take a lock beside it in turn, so that
  one of them creates MLflow's schema and the others find it made.
- `open_client`: a new SQLite store is a copy of an empty one that MLflow made once per MLflow
  version (`_from_template`: its schema migrations take seconds, every time); a SQLite store
  whose creation a full disk cut short is made anew if it holds nothing, and left as it is,
  with advice, if it holds something; a corrupt one (not a SQLite database) is said so, with
  how to move it aside.
- `retry_at_start`: passing failures (a server still starting, a peer creating the schema)
  are tried again for START_RETRY_S; a server that does not answer is said at once to be
  waited for.
tracking/runs.py's Tracker opens its store through these.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import shutil
import sqlite3
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import filelock
import mlflow
import sqlalchemy
import tenacity
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from batchfit.common import interrupts
from batchfit.common.checks import ConfigError
from batchfit.common.redact import redact
from batchfit.tracking.outbox import RETRY_MIN_S, is_transient
from batchfit.tracking.outputs import cache_folder, store_examples

_logger = logging.getLogger(__name__)

START_RETRY_S = 30.0  # reaching the store at start (SQLite schema being created by a peer)
# What MLflow's schema migrations meet in a SQLite store whose creation stopped part-way:
# they are not transactional, and the next run trips on what the last one left.
_HALF_MADE = re.compile(r"already exists|duplicate column|no such (table|column)", re.IGNORECASE)
# What SQLite says of a file that is not a whole database (overwritten, or truncated): no
# retry or migration reads it.
_CORRUPT = re.compile(r"is not a database|disk image is malformed", re.IGNORECASE)
# Tables a new MLflow store fills itself: the schema's version and the default workspace
# (and the Default experiment, id 0, which _empty_if_it_holds_nothing passes over).
_SEEDED_TABLES = ("alembic_version", "workspaces")
# A database server's answers that no wait changes: the URL names a database or user that is
# not there, or a password that is wrong.
_PERMANENT = re.compile(
    r'database "[^"]*" does not exist|role "[^"]*" does not exist|password authentication '
    r"failed|no pg_hba\.conf entry|Unknown database|Access denied for user",
    re.IGNORECASE,
)
# A store that does not answer, in the words of the line that says it is waited for.
_NO_ANSWER = re.compile(
    r"connection refused|name or service not known|timed out|connection reset|connection "
    r"aborted|remote end closed|\b50[234]\b",
    re.IGNORECASE,
)
CONNECT_TIMEOUT_S = 10  # the check of a database server's answer: no longer than this


def _sqlite_path(uri: str) -> Path | None:
    path = uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else ""
    return Path(path) if path and path != ":memory:" else None


def _cannot_use(uri: str, error: BaseException, fix: str | None = None) -> ConfigError:
    reason = redact(str(error).splitlines()[0]) if str(error) else ""
    return ConfigError(
        [
            f"mlflow.tracking_uri={redact(uri)!r} cannot be used ({type(error).__name__}: "
            f"{reason}); "
            + (
                fix
                or f"start the tracking server, or use a local store, e.g. {store_examples()[1]}"
            )
        ]
    )


def check_database(uri: str) -> None:
    """Ask a database server once whether the URL's database can be used. MLflow retries
    reaching it for two minutes whatever the server said, as for a server still starting;
    one that answers that the database does not exist (or refuses the user) answers so
    every time. Any other failure is left to MLflow's retries."""
    if not uri.startswith(("postgresql", "mysql")):
        return
    try:  # a URL it cannot parse, a driver not installed: MLflow's own attempt says which
        url = sqlalchemy.engine.make_url(uri)
        timeout = {} if "connect_timeout" in url.query else {"connect_timeout": CONNECT_TIMEOUT_S}
        engine = sqlalchemy.create_engine(
            url, poolclass=sqlalchemy.pool.NullPool, connect_args=timeout
        )
    except Exception:  # noqa: BLE001 - reported by the store's own opening
        return
    try:
        with engine.connect():
            pass
    except Exception as error:
        if _PERMANENT.search(str(error)):
            raise _cannot_use(
                uri,
                error,
                "the server answered, so waiting will not help: create the database, or fix "
                "the URL's database name, user or password",
            ) from None
    finally:
        engine.dispose()


def _template_path() -> Path:
    return cache_folder() / f"mlflow-{mlflow.__version__}-empty.db"


def _template() -> Path:
    """An empty SQLite store made by this MLflow, without its Default experiment (whose
    artifact location is the directory it was made from: MLflow adds it to a store that
    lacks it, as it opens it). Made once per MLflow version in the user's cache, atomically
    (os.replace), so that workers making it together each leave a whole one."""
    path = _template_path()
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as folder:
            made = Path(folder) / "empty.db"
            MlflowClient(f"sqlite:///{made}").search_experiments(max_results=1)
            with contextlib.closing(sqlite3.connect(made, isolation_level=None)) as db:
                db.execute("DELETE FROM experiments")
            os.replace(made, path)
    return path


def _from_template(uri: str) -> None:
    """A SQLite store that is not there yet becomes a copy of `_template`: MLflow would run
    its 50-odd schema migrations on it, seconds every time (a study's first; every test's).
    Under schema_lock, which the caller holds; the copy takes the store's name only when
    whole (os.link, which fails if another made it meanwhile). Any failure leaves it to
    MLflow to make it as it always does."""
    path = _sqlite_path(uri)
    if path is None or path.exists():
        return
    try:
        template = _template()
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as folder:
            copy = Path(folder) / path.name
            shutil.copyfile(template, copy)
            os.link(copy, path)
    except (OSError, sqlite3.Error, sqlalchemy.exc.SQLAlchemyError, MlflowException) as error:
        _logger.debug("no template for MLflow's store %s (%s): MLflow makes it", path, error)


def open_client(uri: str) -> MlflowClient:
    """A client whose store is open (MLflow creates or migrates a SQLite schema at its first
    call; a new one is copied from `_template`). A SQLite store whose creation a full disk
    cut short fails every later run ("table _alembic_tmp_runs already exists"): holding
    nothing, it is emptied and made anew; holding something, it is left as it is and the
    error says what to do. A file that is no SQLite database (overwritten, truncated) is
    left as it is, and the error says how to move it aside (otherwise it would read as a
    store to start a server for)."""
    _from_template(uri)
    try:
        client = MlflowClient(uri)
        client.search_experiments(max_results=1)
        return client
    except Exception as error:
        path = _sqlite_path(uri)
        if path is not None and _CORRUPT.search(str(error)):
            raise ConfigError([_corrupt_advice(uri, path, error)]) from None
        if path is None or not _HALF_MADE.search(str(error)):
            raise
        reason = str(error).splitlines()[0]
        try:
            emptied = _empty_if_it_holds_nothing(path)
        except sqlite3.Error as failure:
            raise ConfigError([_half_made_advice(uri, path, reason, str(failure))]) from None
        if not emptied:
            raise ConfigError(
                [_half_made_advice(uri, path, reason, "it holds experiments or runs")]
            ) from None
    _logger.warning(
        "MLflow's store %s was half-made (its creation stopped part-way, as on a full disk: "
        "%s) and held nothing: made anew",
        path,
        reason,
    )
    client = MlflowClient(uri)
    client.search_experiments(max_results=1)
    return client


def _empty_if_it_holds_nothing(path: Path) -> bool:
    """Drop every table of the SQLite store if it holds nothing but what MLflow puts in a new
    one (whatever its schema's state; a table a migration was copying counts); True if it
    did. In place, in one transaction: MLflow keeps one engine per URI, whose pooled
    connections would still write to a file moved aside."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute("BEGIN IMMEDIATE")  # no other writer between the check and the drop
        objects = db.execute(
            "SELECT type, name FROM sqlite_master "
            "WHERE type IN ('table', 'view') AND name NOT LIKE 'sqlite_%'"
        ).fetchall()
        for kind, name in objects:
            where = " WHERE experiment_id != 0" if name == "experiments" else ""
            seeded = name in _SEEDED_TABLES or kind == "view"
            if not seeded and db.execute(f'SELECT 1 FROM "{name}"{where} LIMIT 1').fetchone():
                db.execute("ROLLBACK")
                return False
        for kind, name in objects:
            db.execute(f'DROP {kind.upper()} IF EXISTS "{name}"')
        db.execute("COMMIT")
    return True


def _corrupt_advice(uri: str, path: Path, error: BaseException) -> str:
    reason = redact(str(error).splitlines()[0].removeprefix("(sqlite3.DatabaseError) "))
    aside = shlex.quote(f"{path}.corrupt")
    return (
        f"mlflow.tracking_uri={redact(uri)!r}: the store {path} is corrupt, not a SQLite "
        f"database that can be read ({reason}); no wait or server helps. Move it aside and run "
        f"again, which makes a new, empty store there: mv {shlex.quote(str(path))} {aside}; "
        "or restore it from a backup"
    )


def _half_made_advice(uri: str, path: Path, reason: str, kept_because: str) -> str:
    return (
        f"mlflow.tracking_uri={redact(uri)!r}: the store {path} was left half-made (MLflow's "
        f"schema migration stopped part-way, as on a full disk: {redact(reason)}), and batchfit "
        f"left it as it is ({kept_because}). MLflow cannot finish that migration: move it "
        f"aside to start a new store there (mv {path} {path}.broken), or use another, e.g. "
        f"mlflow.tracking_uri=sqlite:///{path.with_name('mlflow-new.db')}"
    )


@contextlib.contextmanager
def schema_lock(uri: str) -> Iterator[None]:
    """Workers opening one new SQLite store together would each run MLflow's schema
    migrations on it and break them; a file lock beside the database lets one go first.
    An flock(2), through filelock: the kernel releases it when its holder dies, however it
    dies, and the file stays for the next. Threads wait for each other as processes do. No
    fallback where flock is missing (to a lock file a dead holder would leave): it is said."""
    path = _sqlite_path(uri)
    if path is None:
        yield
        return
    lock = filelock.UnixFileLock(path.with_name(path.name + ".lock"), fallback_to_soft=False)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        held = lock.acquire()
    except OSError as error:
        raise _cannot_use(uri, error) from None
    with held:
        yield


def retry_at_start(call: Callable[[], Any], tracking_uri: str) -> Any:
    """`call`, retried on passing failures for START_RETRY_S, 0.05 s apart doubling up to 2 s
    (tenacity): workers starting together on one new SQLite store race to create its schema,
    and a server may be starting. A store other than SQLite's that fails so says at the
    first failure, in one line on stderr, that it is waited for and how long at most.
    Anything else is said at once, as the store's problem."""

    def passing(error: BaseException) -> bool:
        if isinstance(error, ConfigError) or not isinstance(error, Exception):
            return False  # already says what to do; or a Ctrl-C
        return is_transient(error) or "already exists" in str(error)

    def say_waiting(state: tenacity.RetryCallState) -> None:
        # A server or database that does not answer is waited for, out loud: the user sees
        # at once why nothing happens for up to START_RETRY_S, and can stop it. A SQLite
        # store's peer creating the schema takes a moment: nothing to say.
        if state.attempt_number == 1 and _sqlite_path(tracking_uri) is None and state.outcome:
            sys.stderr.write(_waiting_line(tracking_uri, state.outcome.exception()) + "\n")
            sys.stderr.flush()

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(passing),
        wait=tenacity.wait_exponential(multiplier=RETRY_MIN_S, min=RETRY_MIN_S, max=2.0),
        stop=tenacity.stop_after_delay(START_RETRY_S),
        before_sleep=say_waiting,
        reraise=True,  # the last error itself, not tenacity's RetryError
    )
    try:
        return retrying(_deferred, call)
    except ConfigError:
        raise
    except Exception as error:
        raise _cannot_use(tracking_uri, error) from None


def _waiting_line(tracking_uri: str, error: BaseException | None) -> str:
    """`MLflow at URI does not answer (connection refused); retrying for up to 30 s`."""
    found = _NO_ANSWER.search(str(error))
    why = found.group(0).lower() if found else type(error).__name__
    why = f"HTTP {why}" if why.isdigit() else why
    return (
        f"MLflow at {redact(tracking_uri)} does not answer ({why}); retrying for up to "
        f"{START_RETRY_S:g} s"
    )


def _deferred(call: Callable[[], Any]) -> Any:
    with interrupts.deferred():  # as the outbox's writes (common/interrupts.py)
        return call()
