"""Where a run writes: Hydra's output directory (and, by default, both stores under ./mlruns)
must be writable, or the run stops at once with what failed and how to point it elsewhere.

Hydra creates its output directory inside the job and, when it cannot, ends with a chained
OSError traceback. `CheckOutputDir`, a Hydra callback registered in conf/config.yaml, tries
first, before any job starts. It tries for real (a probe directory in the nearest existing
parent): permission bits do not stop root, a read-only mount does.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def cache_folder() -> Path:
    """batchfit's folder in the user's cache ($XDG_CACHE_HOME, else ~/.cache): what is made
    once per machine and kept (the CPU's measured peak, the empty MLflow store)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "batchfit"


def cannot_create(path: Path) -> str | None:
    """Why directory `path` cannot be created (or written into), None if it can."""
    existing = path.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        probe = tempfile.mkdtemp(prefix=".batchfit-probe-", dir=existing)
    except OSError as error:
        return f"{error.strerror or type(error).__name__}: {existing}"
    os.rmdir(probe)
    return None


def writable_folder() -> Path:
    """A folder to suggest when a store or the outputs cannot be written where they are:
    batchfit/ in the home directory, else in the system's temporary directory (per user),
    the first that can be created now (tried for real, nothing left behind); a placeholder
    if neither can. Never the path that failed: that one cannot be created."""
    try:
        home = [Path.home() / "batchfit"]
    except RuntimeError:  # no HOME and a uid without a passwd entry (some containers)
        home = []
    candidates = (*home, Path(tempfile.gettempdir()) / f"batchfit-{os.getuid()}")
    for folder in candidates:
        if cannot_create(folder) is None:
            return folder
    return Path("/writable")


def store_examples() -> tuple[str, str]:
    """The overrides that put both stores in a folder that can be written."""
    folder = writable_folder()
    return (
        f"search.storage=journal:{folder}/optuna.journal",
        f"mlflow.tracking_uri=sqlite:///{folder}/mlflow.db",
    )


def unwritable_message(path: Path, key: str, reason: str) -> str:
    storage, tracking = store_examples()
    return (
        f"batchfit cannot write its outputs: {key}={path} cannot be created ({reason}).\n"
        f"Run from a writable directory, or point the outputs to one: "
        f"{key}={writable_folder()}/outputs, and the stores, which default under ./mlruns "
        f"too: {storage} {tracking}"
    )


def _check(directory: Any, key: str) -> None:
    path = Path(str(directory))
    reason = cannot_create(path)
    if reason is not None:
        sys.stderr.write(unwritable_message(path, key, reason) + "\n")
        sys.exit(2)  # SystemExit: Hydra warns about a callback's exceptions and goes on


class CheckOutputDir(Callback):
    """Hydra callback: stop before the job when its output directory cannot be created."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check(config.hydra.sweep.dir, "hydra.sweep.dir")
