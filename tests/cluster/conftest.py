"""The real cluster of tests/cluster/services.sh: SLURM with accounting and PostgreSQL.

Without them these tests skip; with BATCHFIT_REQUIRE_CLUSTER=1 (CI) a missing service fails
them instead, so that CI cannot pass by skipping.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator

import pytest

REQUIRED = os.environ.get("BATCHFIT_REQUIRE_CLUSTER") == "1"
START = "tests/cluster/services.sh up (as root; `install` first for the packages)"


def _missing(what: str) -> None:
    if REQUIRED:
        pytest.fail(f"{what}, but BATCHFIT_REQUIRE_CLUSTER=1; start it: {START}")
    pytest.skip(f"{what}; start it: {START}")


@pytest.fixture(scope="session")
def slurm() -> None:
    try:
        states = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        states = []
    if "idle" not in states and "mixed" not in states:
        _missing("no SLURM node is up (sinfo shows none idle)")


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A new, empty database on the cluster's PostgreSQL server, dropped afterwards."""
    server = os.environ.get("BATCHFIT_PG_URL")
    if not server:
        _missing("BATCHFIT_PG_URL is not set (no PostgreSQL server)")
    import psycopg

    name = f"batchfit_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
        yield server.rsplit("/", 1)[0] + f"/{name}"
        admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
