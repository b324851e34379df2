"""Passwords inside URLs (`postgresql://user:secret@host/db`, `http://user:secret@host:5000`),
as a URL's query parameter (`postgresql://user@host/db?password=secret`, `&password=`) or in a
libpq connection string (`host=db password=secret`) never reach the console, MLflow or a log
file: everything batchfit writes passes `redact`.

Hydra saves the command line's overrides and the config under `.hydra/` (and `multirun.yaml`
for a sweep) before the job starts; `RedactSavedConfigs`, a Hydra callback registered in
conf/config.yaml, rewrites those files with the passwords masked as the job starts.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

MASK = "***"
# scheme://user:password@ (the password ends at the last @ before the host), also as Hydra
# writes an override back: postgresql\://user\:password@host\:5432/db
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*\\?://[^\s/:@'\"\\]*\\?:)([^\s/'\"]*)@")
# password=VALUE (also passwd=, any case, with a prefix: PGPASSWORD=, db_password=): a URL's
# query parameter, a libpq key=value connection string, an environment assignment. The value
# ends where a query parameter, a key=value pair or a quoted string does; libpq's quoted form
# 'with spaces' is masked whole. Hydra may escape the `=` in what it saves.
_KEY_PASSWORD = re.compile(
    r"((?<![A-Za-z0-9_])[A-Za-z0-9_]*(?:password|passwd)\\?=)('(?:\\.|[^'\\])*'|[^\s&;'\"]+)",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """`text` with every password in it (of a URL, a query parameter, a connection string)
    replaced by ***."""
    text = _URL_PASSWORD.sub(lambda m: f"{m.group(1)}{MASK}@", text)
    return _KEY_PASSWORD.sub(lambda m: f"{m.group(1)}{MASK}", text)


def redact_tree(value: Any) -> Any:
    """A container (dicts, lists, strings) with every string redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact_tree(v) for v in value)
    return value


class RedactingFilter(logging.Filter):
    """A logging filter that redacts the formatted message of every record it passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = redact(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


def redact_logging() -> None:
    """Redact every record that reaches a handler of the root logger (Hydra's job log file
    and console among them)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


def redact_file(path: Path) -> None:
    """Rewrite `path` with its passwords masked (atomically: workers may share the file)."""
    try:
        text = path.read_text()
    except OSError:
        return
    masked = redact(text)
    if masked != text:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(masked)
        tmp.replace(path)


class RedactSavedConfigs(Callback):
    """Hydra callback: mask passwords in the files Hydra saved for this job and its sweep."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        redact_logging()
        runtime = config.hydra.runtime
        subdir = config.hydra.output_subdir
        if subdir is not None:
            for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
                redact_file(Path(runtime.output_dir) / subdir / name)
        redact_file(Path(config.hydra.sweep.dir) / "multirun.yaml")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        redact_logging()  # the launcher logs each job's overrides from this process

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        redact_file(Path(config.hydra.sweep.dir) / "multirun.yaml")
