"""The throughput clock: the seconds and counts behind a run's throughput figures.

A run's first steps stay off the clock: the warm-up steps (kernel selection, allocator
growth) and the steps measured under the CPU memory tracker (train/step.py `memory_steps`),
whose time is tracking, not training. Validation stays off it too. The device is
synchronised before every reading, so a reading counts the kernels queued before it; the
clock is read only at logging intervals and validations, never in the hot loop. The energy
meter (train/measure/energy.py) is read at the same synchronised points: its joules are
the timed steps'.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from batchfit.tracking.metrics import DATA_WAIT_SHARE, THROUGHPUT_SAMPLES, throughput
from batchfit.train.measure.energy import Energy, EnergyMeter


class Stopwatch:
    """Seconds between start() and stop(), summed; synchronises the device before reading,
    and reads the energy `meter` there too."""

    def __init__(
        self,
        device: torch.device,
        now: Callable[[], float] | None = None,
        meter: EnergyMeter | None = None,
    ):
        self.device = device
        self.seconds = 0.0
        self._now = now or time.perf_counter  # looked up now: a patched perf_counter counts
        self._started: float | None = None
        self.meter = meter

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        if self.meter is not None:
            self.meter.start()
        self._started = self._now()

    def stop(self) -> None:
        if self._started is not None:
            self._sync()
            self.seconds += self._now() - self._started
            self._started = None
            if self.meter is not None:
                self.meter.stop()

    def read(self) -> float:
        self.stop()
        self.start()
        return self.seconds


def estimate_train_seconds(
    timed_s: float, steps: int, first_timed: int, untimed_wall: float
) -> float:
    """Training seconds of the first `steps` steps, validation excluded, by the throughput
    clock: the timed steps as timed, and the steps it leaves out (warm-up, memory-measured)
    at the timed steps' mean (their own time is kernel selection and tracking, not
    training); before any timed step, their wall time."""
    timed = steps - first_timed
    if timed <= 0:
        return untimed_wall
    return timed_s + first_timed * timed_s / timed


class ThroughputClock:
    """Times a run's steps from `first_timed_step` on and counts what those steps trained.

    Per step, begin(step) before its batches are fetched (the wait for them is training
    time) and step(...) after it; interval(step) at each logging interval; pause() and
    resume(step) around each validation, train_seconds(steps) in between. `meter`: the
    device's energy meter, or why it has none (energy(), energy_note).
    """

    def __init__(
        self,
        device: torch.device,
        first_timed_step: int,
        unit: str = "samples",
        now: Callable[[], float] | None = None,
        meter: EnergyMeter | str | None = None,
    ):
        self._meter = meter if isinstance(meter, EnergyMeter) else None
        self._why_unmeasured = meter if isinstance(meter, str) else ""
        self.first_timed_step = first_timed_step
        self.unit = unit  # the task's loss unit (tokens for a language model)
        self.timed_samples = 0
        self.timed_units = 0
        self.data_wait_s = 0.0  # of the timed seconds, waiting for the input pipeline
        self.interval_rates: list[float] = []  # samples/s of each timed logging interval
        self._watch = Stopwatch(device, now, self._meter)
        self._now = now or time.perf_counter
        self._started = self._now()  # the run's wall clock, for on_step and the untimed steps
        self._untimed_wall = 0.0  # wall seconds of the steps before the first timed one
        self._validation_s = 0.0  # wall seconds of the validations so far (between pauses)
        self._paused_at: float | None = None
        self._last_read = (0, 0.0)  # timed samples and seconds at the previous interval
        self._train_s = 0.0

    def energy(self) -> Energy | None:
        """What the energy meter counted over the timed steps; None without one."""
        return self._meter.reading() if self._meter is not None else None

    @property
    def energy_note(self) -> str:
        """What counted the timed steps' joules, or why nothing did."""
        if self._meter is None:
            return self._why_unmeasured
        if self._meter.failed is not None:
            return self._meter.failed
        reading = self._meter.reading()
        return reading.source if reading is not None else "energy: no timed step"

    @property
    def seconds(self) -> float:
        """Timed seconds so far, as of the last reading."""
        return self._watch.seconds

    def elapsed(self) -> float:
        """Wall seconds since the clock was made, validation included; no device sync."""
        return self._now() - self._started

    def timed_steps(self, num_steps: int) -> int:
        return max(num_steps - self.first_timed_step, 0)

    def begin(self, step: int) -> None:
        if step == self.first_timed_step:
            self._watch.start()

    def step(self, step: int, samples: int, units: int, waited: float) -> None:
        """Counts a finished step: its samples, units and data wait if the clock timed it."""
        if step >= self.first_timed_step:
            self.timed_samples += samples
            self.timed_units += units
            self.data_wait_s += waited
        else:  # its wall time, less the validations before it (which train nothing)
            self._untimed_wall = self.elapsed() - self._validation_s

    def interval(self, step: int) -> dict[str, float]:
        """At the end of a logging interval: reads the clock (a device sync), records the
        interval's samples/s, and returns the throughput figures of the timed steps so far
        (none before the first timed step, whose clock has not started)."""
        if step < self.first_timed_step:
            return {}
        seconds = self._watch.read()
        last_samples, last_seconds = self._last_read
        if seconds > last_seconds:  # else the clock's resolution saw no time pass
            rate = (self.timed_samples - last_samples) / (seconds - last_seconds)
            self.interval_rates.append(rate)
            self._last_read = (self.timed_samples, seconds)
        if seconds <= 0:
            return {}
        figures = {THROUGHPUT_SAMPLES: self.timed_samples / seconds}
        if self.unit != "samples":
            figures[throughput(self.unit)] = self.timed_units / seconds
        figures[DATA_WAIT_SHARE] = self.data_wait_s / seconds
        return figures

    def pause(self) -> None:
        self._watch.stop()
        self._paused_at = self._now()

    def resume(self, step: int) -> None:
        if self._paused_at is not None:
            self._validation_s += self._now() - self._paused_at
            self._paused_at = None
        if step >= self.first_timed_step:
            self._watch.start()

    def stop(self) -> None:
        self._watch.stop()

    def train_seconds(self, steps: int) -> float:
        """Training seconds of the first `steps` steps (estimate_train_seconds), read while
        paused. Never less than at the previous call: the estimate of the steps off the
        clock moves with the timed mean."""
        estimate = estimate_train_seconds(
            self.seconds, steps, self.first_timed_step, self._untimed_wall
        )
        self._train_s = max(self._train_s, estimate)
        return self._train_s
