"""A PostgreSQL server of a test's own, to stop and start again under a running study.

Run by the `postgres` user (the server refuses root) from a fresh folder under /tmp, with
trust authentication on 127.0.0.1. Without the server binaries it skips the test, unless
BATCHFIT_REQUIRE_CLUSTER=1 (CI), where a test that cannot run must not pass by skipping.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REQUIRED = os.environ.get("BATCHFIT_REQUIRE_CLUSTER") == "1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """`initdb` once, then `start` and `stop` at will on the same data and port."""

    def __init__(self, data: Path, initdb: str, pg_ctl: str, runuser: str):
        self.data = data
        self.pg_ctl = pg_ctl
        self.as_postgres = [runuser, "-u", "postgres", "--"]
        self.port = _free_port()
        self._ctl([initdb, "-D", str(data), "--auth=trust"])

    @property
    def url(self) -> str:
        """The server's URL, without a database."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1"
        self._ctl([self.pg_ctl, "-D", str(self.data), "-o", options, "-w", "-l",
                   f"{self.data}/log", "start"])  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        """`fast` ends every session at once, as an administrator's restart does."""
        self._ctl([self.pg_ctl, "-D", str(self.data), "-m", mode, "-w", "stop"])

    def _ctl(self, command: list[str]) -> None:
        done = subprocess.run([*self.as_postgres, *command], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def _server_binary(name: str) -> str | None:
    """`name` on PATH, else in the newest of Debian's /usr/lib/postgresql/<version>/bin
    (the `postgresql` package, as tests/cluster/services.sh installs it, puts the server's
    programs there, off PATH)."""
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: [int(x) if x.isdigit() else x for x in p.parent.name.split(".")],
    )
    candidates = [v / name for v in versions if (v / name).is_file()]
    return str(candidates[-1]) if candidates else None


def _unavailable(why: str) -> None:
    if REQUIRED:
        pytest.fail(f"{why}, but BATCHFIT_REQUIRE_CLUSTER=1; install PostgreSQL's server")
    pytest.skip(why)


@contextlib.contextmanager
def own_server() -> Iterator[PostgresServer]:
    """A running server of its own, stopped and removed afterwards (a test's fixture)."""
    initdb, pg_ctl = (_server_binary(name) for name in ("initdb", "pg_ctl"))
    runuser = shutil.which("runuser")
    if not (initdb and pg_ctl and runuser):
        _unavailable("no PostgreSQL server binaries (initdb, pg_ctl, runuser) here")
    # /tmp itself: the postgres user must reach it (a TMPDIR under /root is 0700), and the
    # server's socket path in it must stay under 107 bytes
    data = Path(tempfile.mkdtemp(prefix="batchfit-pg-", dir="/tmp"))
    try:
        shutil.chown(data, "postgres")
    except (LookupError, PermissionError) as error:
        shutil.rmtree(data, ignore_errors=True)
        _unavailable(f"no `postgres` user to run the server as ({error})")
    server = None
    try:
        server = PostgresServer(data, initdb, pg_ctl, runuser)
        server.start()
        yield server
    finally:
        if server is not None:  # stopped whatever the test did, before its data goes
            subprocess.run(
                [*server.as_postgres, pg_ctl, "-D", str(data), "-m", "immediate", "stop"],
                check=False, capture_output=True,
            )  # fmt: skip
        shutil.rmtree(data, ignore_errors=True)
