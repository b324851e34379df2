"""What the entry points (`python -m search`, `python -m search.fit`, `python -m train`) print
when they stop on an error, and the exit status they stop with. The one printer for all of
them: every message and traceback passes common.redact, so a password in an override
(`search.storage=postgresql://user:secret@host/db`) that a message or a traceback quotes is
printed as ***.
"""

from __future__ import annotations

import sys
import traceback
from typing import NoReturn

from rich.console import Console
from rich.markup import escape  # messages carry [...]: not markup

from batchfit.common.checks import ConfigError
from batchfit.common.redact import redact

CONFIG_ERROR_STATUS = 2  # a problem of the config: nothing ran, fix the named key
FAILED_STATUS = 1  # anything else that stopped the entry point


def stopped(errors: Console, headline: str, text: str, status: int = FAILED_STATUS) -> NoReturn:
    """Print `headline` in bold red and `text` (redacted) below it, then exit with `status`."""
    # soft_wrap: one problem per line, whole, in logs too
    errors.print(f"[bold red]{escape(headline)}[/bold red]\n{escape(redact(text))}", soft_wrap=True)
    sys.exit(status)


def config_error(errors: Console, error: ConfigError) -> NoReturn:
    """Every problem of the config (one per line), then exit 2."""
    stopped(errors, "Configuration error", str(error), CONFIG_ERROR_STATUS)


def crashed(errors: Console, headline: str, what: str) -> NoReturn:
    """An unexpected error, called in its `except` block: its traceback (which may quote the
    overrides), then `headline: what` (`The study did not start: RuntimeError while ...`),
    both redacted; exit 1."""
    errors.print(redact(traceback.format_exc()), markup=False, highlight=False)
    errors.print(f"[bold red]{escape(headline)}[/bold red]: {escape(redact(what))}", soft_wrap=True)
    sys.exit(FAILED_STATUS)
