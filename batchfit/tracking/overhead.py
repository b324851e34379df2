"""What coordination costs: seconds spent in the study's storage and in MLflow, per trial.

Several workers pay for sharing a study in storage round trips (the sampler reads every
trial, each trial writes its params, attributes and state) and MLflow writes. `CallClock`
adds up the time of such calls made by the worker's main thread (heartbeat threads run
beside the trial and cost it nothing); a trial logs the difference since the previous one as
`time/storage_s` and `time/tracking_s`.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any


class CallClock:
    """Total seconds spent inside timed calls on the thread that created the clock."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._thread = threading.get_ident()
        self._depth = 0  # a timed call inside another is counted once

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self._thread or self._depth:
                return function(*args, **kwargs)
            self._depth += 1
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self._depth -= 1

        return timed

    def time_methods(self, obj: object, names: Iterable[str]) -> None:
        """Time these methods of this object (the instance's, not its class's)."""
        for name in names:
            setattr(obj, name, self.wrap(getattr(obj, name)))


def storage_methods(storage: object) -> list[str]:
    """The public storage API that Optuna's study and samplers call."""
    from optuna.storages import BaseStorage

    return [
        name
        for name in vars(BaseStorage)
        if not name.startswith("_") and callable(getattr(storage, name, None))
    ]


class Lap:
    """Seconds a clock has added since the last lap."""

    def __init__(self, clock: CallClock):
        self.clock = clock
        self._last = clock.seconds

    def __call__(self) -> float:
        now = self.clock.seconds
        lap, self._last = now - self._last, now
        return lap
