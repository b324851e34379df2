"""tracking/outputs.py: a read-only working directory stops a run with batchfit's message,
on a real read-only filesystem (a tmpfs this test mounts and remounts read-only; tests run as
root, whom `chmod 555` does not stop)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchfit.tracking.outputs import cannot_create
from tests.sweeps import run_module


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "ro"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)])
    if made.returncode != 0:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        (mount / "existing").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_cannot_create_tries_for_real(read_only_dir: Path, tmp_path: Path) -> None:
    assert cannot_create(tmp_path / "a" / "b") is None
    assert not (tmp_path / "a").exists()  # only probed
    assert cannot_create(read_only_dir / "mlruns" / "hydra") == (
        f"Read-only file system: {read_only_dir}"
    )
    assert cannot_create(read_only_dir / "existing") == (
        f"Read-only file system: {read_only_dir / 'existing'}"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "args"), [("search", []), ("search", ["--multirun"]), ("train", [])]
)
def test_read_only_working_directory_is_one_message(
    read_only_dir: Path, module: str, args: list[str]
) -> None:
    done = run_module(module, args, read_only_dir, returncode=2)
    key = "hydra.sweep.dir" if args else "hydra.run.dir"
    assert done.stderr.startswith(f"batchfit cannot write its outputs: {key}=mlruns/hydra/"), (
        done.stderr
    )
    assert (
        f"(Read-only file system: {read_only_dir}).\nRun from a writable directory" in done.stderr
    )
    # A folder that can be written is suggested, not a placeholder, nor the one that failed.
    suggested = Path(re.search(rf"{key}=(\S+)/outputs,", done.stderr).group(1))
    assert cannot_create(suggested) is None and not suggested.is_relative_to(read_only_dir)
    assert f"search.storage=journal:{suggested}/optuna.journal" in done.stderr
    assert "mlflow.tracking_uri=" in done.stderr
    assert "Traceback" not in done.stderr and "OSError" not in done.stderr
