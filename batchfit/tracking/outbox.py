"""MLflow writes that survive a store going away for a while.

Writes are made in the order they were queued. One that meets a passing failure (SQLite's
"database is locked" while another worker writes; a tracking server that is down or
restarting) stays queued and is tried again, with a growing delay, before the next write,
between trials and at the end of the study; the trial does not wait for it. One that meets
a real error is dropped and recorded in `failed` (the study says so and exits 1 at the end)
rather than raised from whichever later call happens to drain the queue.

The retries are not tenacity's: tenacity sleeps in the caller until the write is made, and
a trial must not wait for the store. Here a write that failed waits in the queue, and the
first call after its delay tries it again.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable

from mlflow.exceptions import MlflowException

from batchfit.common import interrupts
from batchfit.common.redact import redact
from batchfit.tracking.overhead import CallClock

# Failures that pass: the write is tried again later. Anything else is a real error.
_TRANSIENT = re.compile(
    r"database is locked|database table is locked|Max retries exceeded|Connection refused|"
    r"Connection aborted|Connection reset|Failed to establish|Name or service not known|"
    r"timed out|Remote end closed|\b50[234]\b|Service Unavailable|Bad Gateway",
    re.IGNORECASE,
)
RETRY_MIN_S, RETRY_MAX_S = 0.05, 15.0


def is_transient(error: BaseException) -> bool:
    return isinstance(error, MlflowException | OSError) and bool(_TRANSIENT.search(str(error)))


class Outbox:
    """MLflow writes, made in order; passing failures are retried with a growing delay, and
    a write that meets a real error is dropped and recorded in `failed`."""

    def __init__(self, clock: CallClock | None = None):
        self._queue: deque[Callable[[], object]] = deque()
        self._retry_at = 0.0
        self._delay_s = RETRY_MIN_S
        self.clock = clock or CallClock()
        self.last_error: str | None = None  # the last passing failure, redacted
        self.failed: list[str] = []  # writes dropped on a real error, redacted

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, write: Callable[[], object]) -> None:
        self._queue.append(write)
        self.drain()

    def drain(self) -> bool:
        """Make the queued writes, unless a retry is not yet due; True when none is left."""
        while self._queue:
            if time.monotonic() < self._retry_at:
                return False
            # Ctrl-C or SIGTERM waits for the write: cut short, a SQLite transaction held the
            # store locked while the study closed its runs (common/interrupts.py).
            with interrupts.deferred():
                passing = self._write_first()
            if passing:
                return False
        return True

    def _write_first(self) -> bool:
        """The first queued write, made and dequeued; True if it met a passing failure,
        and stays queued for its retry."""
        try:
            self.clock.wrap(self._queue[0])()
        except Exception as error:
            if is_transient(error):
                self.last_error = redact(str(error).splitlines()[0])
                self._retry_at = time.monotonic() + self._delay_s
                self._delay_s = min(2 * self._delay_s, RETRY_MAX_S)
                return True
            # It would fail again. Raising it here would hit whichever call drains next
            # (another trial's metrics); it is said and reported at the end.
            self.failed.append(f"{type(error).__name__}: {redact(str(error))[:500]}")
        else:
            self._delay_s = RETRY_MIN_S
        self._queue.popleft()
        return False

    def wait(self, timeout_s: float) -> bool:
        """Retry until everything is written or `timeout_s` has passed."""
        deadline = time.monotonic() + timeout_s
        while not self.drain():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(max(0.0, min(self._retry_at - time.monotonic(), left)))
        return True
