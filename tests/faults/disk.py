"""A real full filesystem for the fault tests: a small tmpfs (the test is skipped where none
can be mounted) and a file that fills it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


def mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            check=True, capture_output=True,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"cannot mount a tmpfs here ({error})")


def unmount(path: Path) -> None:
    """Detached now, gone once no file on it is open (a cached SQLite connection may be)."""
    subprocess.run(["umount", "--lazy", str(path)], check=False)


def fill(folder: Path, leave_bytes: int) -> Path:
    """A file that leaves `leave_bytes` free on folder's filesystem (in whole blocks)."""
    filler = folder / "filler"
    stat = os.statvfs(folder)
    free = stat.f_bavail * stat.f_frsize
    filler.write_bytes(b"\0" * max(0, free - leave_bytes))
    return filler
