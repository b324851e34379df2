"""tracking/outbox.py's schedule of retries: a write that meets a passing failure is tried
again after 0.05 s, then after twice as long each time, and the delay starts over once a
write goes through. (Writes to real stores that are away: tests/tracking/test_runs.py.)"""

from __future__ import annotations

import time
from collections.abc import Callable

from batchfit.tracking.outbox import RETRY_MIN_S, Outbox


def _refused(times: int) -> tuple[Callable[[], None], list[float]]:
    """A write to a server that refuses the connection `times` times, then takes it; and
    when each attempt began."""
    began: list[float] = []

    def write() -> None:
        began.append(time.monotonic())
        if len(began) <= times:
            raise ConnectionRefusedError(111, "Connection refused")

    return write, began


def _gaps(began: list[float]) -> list[float]:
    return [b - a for a, b in zip(began, began[1:], strict=False)]


def test_a_passing_failure_is_tried_again_after_a_doubling_delay() -> None:
    write, began = _refused(5)
    outbox = Outbox()
    outbox.put(write)
    assert len(outbox) == 1 and outbox.last_error == "[Errno 111] Connection refused"
    assert outbox.wait(10) and len(outbox) == 0 and outbox.failed == []
    # Never before it is due, and not much later: 0.25 s of slack for a loaded machine's
    # scheduling, more than was seen on 2 busy cores.
    for gap, delay in zip(_gaps(began), [0.05, 0.1, 0.2, 0.4, 0.8], strict=True):
        assert delay <= gap < delay + 0.25, _gaps(began)


def test_the_delay_starts_over_after_a_write_goes_through() -> None:
    outbox = Outbox()
    first, _ = _refused(4)  # the delay grows to 0.8 s
    outbox.put(first)
    assert outbox.wait(10)
    second, began = _refused(1)
    outbox.put(second)
    assert outbox.wait(10)
    (gap,) = _gaps(began)
    assert RETRY_MIN_S <= gap < RETRY_MIN_S + 0.25


def test_a_write_queued_behind_a_failing_one_waits_for_it() -> None:
    outbox = Outbox()
    failing, _ = _refused(2)
    written: list[float] = []
    outbox.put(failing)
    outbox.put(lambda: written.append(time.monotonic()))
    assert written == [] and len(outbox) == 2
    assert outbox.wait(10) and len(written) == 1 and len(outbox) == 0


def test_wait_gives_up_at_its_timeout() -> None:
    write, began = _refused(1000)
    outbox = Outbox()
    outbox.put(write)
    started = time.monotonic()
    assert not outbox.wait(1.0)
    assert 1.0 <= time.monotonic() - started < 1.25  # it sleeps to the deadline, not past it
    # At 0, 0.05, 0.15, 0.35 and 0.75 s; one fewer if the machine stalls a try past 0.6 s.
    assert len(outbox) == 1 and 4 <= len(began) <= 5, _gaps(began)
