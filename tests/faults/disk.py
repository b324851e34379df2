"""A real full filesystem for the fault tests: a small tmpfs (the test is skipped where none
can be mounted) and a file that fills it."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` (created) while the block runs; the test is
    skipped where none can be mounted. Unmounted lazily after: detached at once, gone once
    no file on it is open (a cached SQLite connection may be)."""
    path.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            check=True, capture_output=True,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"cannot mount a tmpfs here ({error})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=False)


def fill(folder: Path, leave_bytes: int) -> Path:
    """A file that leaves `leave_bytes` free on folder's filesystem (in whole blocks)."""
    filler = folder / "filler"
    stat = os.statvfs(folder)
    free = stat.f_bavail * stat.f_frsize
    filler.write_bytes(b"\0" * max(0, free - leave_bytes))
    return filler
