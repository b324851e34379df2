"""common/redact.py: passwords in URLs are masked wherever batchfit writes text."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from batchfit.common.redact import RedactingFilter, redact, redact_file, redact_tree


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("postgresql://bf:pa55@db:5432/optuna", "postgresql://bf:***@db:5432/optuna"),
        ("postgresql+psycopg://bf:p%40ss@db/x", "postgresql+psycopg://bf:***@db/x"),
        ("http://user:s3cret@127.0.0.1:5000", "http://user:***@127.0.0.1:5000"),
        # An unescaped @ inside the password: the password ends at the last @ before the host.
        ("postgresql://bf:p@ss@db/x", "postgresql://bf:***@db/x"),
        (
            "storage=mysql://a:b@h/db, uri=http://u:v@h:1",
            "storage=mysql://a:***@h/db, uri=http://u:***@h:1",
        ),
        # As Hydra logs and saves an override: colons escaped.
        (
            r"search.storage=postgresql\://bf\:pa55@db\:5432/x",
            r"search.storage=postgresql\://bf\:***@db\:5432/x",
        ),
        # A password as a query parameter (psycopg and PyMySQL take it so), first or not.
        ("postgresql://bf@db/optuna?password=pa55", "postgresql://bf@db/optuna?password=***"),
        (
            "postgresql://bf@db/x?sslmode=require&password=pa55&connect_timeout=3",
            "postgresql://bf@db/x?sslmode=require&password=***&connect_timeout=3",
        ),
        ("mysql+pymysql://bf@db/x?passwd=pa55", "mysql+pymysql://bf@db/x?passwd=***"),
        # libpq's key=value connection string, its quoted form, an environment variable.
        ("host=db password=pa55 dbname=x", "host=db password=*** dbname=x"),
        (r"host=db password='pa 55\'x' dbname=x", "host=db password=*** dbname=x"),
        ("PGPASSWORD=pa55 python -m search", "PGPASSWORD=*** python -m search"),
        # As Hydra saves it and as a message quotes it.
        (
            r"search.storage=postgresql\://bf@db/x?password\=pa55",
            r"search.storage=postgresql\://bf@db/x?password\=***",
        ),
        (
            "search.storage='postgresql://bf@db/x?Password=pa55' cannot be opened",
            "search.storage='postgresql://bf@db/x?Password=***' cannot be opened",
        ),
        # Nothing to mask: no password, a port, a journal path, plain text.
        ("postgresql://bf@db:5432/optuna", "postgresql://bf@db:5432/optuna"),
        ("http://127.0.0.1:5000/#/experiments/1", "http://127.0.0.1:5000/#/experiments/1"),
        ("journal:mlruns/optuna.journal", "journal:mlruns/optuna.journal"),
        ("batch 64 x 2: 3 of 5 done", "batch 64 x 2: 3 of 5 done"),
        ("the password is in ~/.pgpass", "the password is in ~/.pgpass"),
    ],
)
def test_redact(text: str, masked: str) -> None:
    assert redact(text) == masked


def test_redact_tree_and_file(tmp_path: Path) -> None:
    tree = {"search": {"storage": "postgresql://u:pw@h/d", "n_trials": 3}, "l": ["http://a:b@h"]}
    assert redact_tree(tree) == {
        "search": {"storage": "postgresql://u:***@h/d", "n_trials": 3},
        "l": ["http://a:***@h"],
    }
    saved = tmp_path / "overrides.yaml"
    saved.write_text("- search.storage=postgresql://u:pw@h/d\n- search.n_trials=3\n")
    redact_file(saved)
    assert saved.read_text() == "- search.storage=postgresql://u:***@h/d\n- search.n_trials=3\n"
    redact_file(tmp_path / "absent.yaml")  # nothing saved: nothing to do


def test_logging_filter_masks_formatted_messages() -> None:
    record = logging.LogRecord(
        "x", logging.INFO, __file__, 1, "opening %s", ("postgresql://u:pw@h/d",), None
    )
    assert RedactingFilter().filter(record)
    assert record.getMessage() == "opening postgresql://u:***@h/d"
