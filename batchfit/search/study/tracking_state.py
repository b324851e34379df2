"""What a study says about its MLflow records while the store is away: once when writes
start to queue, once when they are through, every write MLflow refused; and at the end, a
worker whose records could not all be written exits non-zero (the study itself is complete
in search.storage either way: tracking/outbox.py keeps the writes in order).
"""

from __future__ import annotations

from rich.console import Console

from batchfit.common.redact import redact
from batchfit.tracking.runs import Tracker


class TrackingIncomplete(Exception):
    """MLflow stayed unreachable: some records of this worker were not written."""


class TrackingState:
    def __init__(self, tracker: Tracker):
        self.tracker = tracker
        self._outage_said = False
        self._failures_said = 0

    def say_state(self, console: Console) -> None:
        """Say once when MLflow writes start to queue, and once when they are through; say
        every write MLflow refused."""
        for failure in self.tracker.outbox.failed[self._failures_said :]:
            console.print(f"[red]MLflow refused a record[/red]: {failure}", soft_wrap=True)
        self._failures_said = len(self.tracker.outbox.failed)
        queued = len(self.tracker.outbox)
        if queued and not self._outage_said:
            console.print(
                f"[yellow]MLflow unreachable ({self.tracker.outbox.last_error}): {queued} "
                "records queued; the study goes on and they are written when it is back[/yellow]",
                soft_wrap=True,
            )
        elif not queued and self._outage_said:
            console.print("MLflow reachable again: the queued records are written")
        self._outage_said = bool(queued)

    def _check_refused(self) -> None:
        failed = self.tracker.outbox.failed
        if failed:
            raise TrackingIncomplete(
                f"MLflow refused {len(failed)} records of this worker (first: {failed[0]}); "
                "the study itself is complete in search.storage"
            )

    def close(self, console: Console, wait_s: float) -> None:
        """At the end: write what is queued, waiting up to `wait_s` for MLflow to come
        back; raise TrackingIncomplete when some records are not written."""
        outbox = self.tracker.outbox
        if not outbox.drain():
            self._outage_said = True
            console.print(
                f"[yellow]MLflow at {redact(self.tracker.tracking_uri)} is unreachable "
                f"({outbox.last_error}); waiting up to {wait_s:g} s to write {len(outbox)} "
                "queued records[/yellow]",
                soft_wrap=True,
            )
            if not self.tracker.close(wait_s):
                raise TrackingIncomplete(
                    f"{len(outbox)} MLflow records of this worker could not be written to "
                    f"{redact(self.tracker.tracking_uri)} ({outbox.last_error}); the study "
                    "itself is complete in search.storage. Raise mlflow.outage_wait_s to wait "
                    "longer."
                )
        self.say_state(console)
        self._check_refused()
