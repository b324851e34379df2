"""The throughput clock against hand-derived figures, on a fake time source."""

from __future__ import annotations

import pytest
import torch

from batchfit.tracking.metrics import DATA_WAIT_SHARE, THROUGHPUT_SAMPLES, THROUGHPUT_TOKENS
from batchfit.train.measure.throughput import Stopwatch, ThroughputClock, estimate_train_seconds

CPU = torch.device("cpu")


class FakeTime:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_clock_counts_times_and_estimates_by_hand() -> None:
    time = FakeTime()
    clock = ThroughputClock(CPU, first_timed_step=2, unit="tokens", now=time)
    # (samples, tokens, data wait) of steps 0..4, and the fake time each step ends at.
    steps = [(8, 80, 0.1), (8, 80, 0.1), (8, 100, 0.5), (4, 40, 0.5), (8, 80, 0.0)]
    ends_at = [1.0, 3.0, 5.0, 7.0]

    for step in range(2):  # the untimed steps: warm-up, or measured under the tracker
        clock.begin(step)
        time.now = ends_at[step]
        clock.step(step, *steps[step])
        assert clock.interval(step) == {} and clock.interval_rates == []
    assert clock.elapsed() == 3.0
    assert clock.train_seconds(2) == 3.0  # no timed step yet: the wall time of the two

    for step in (2, 3):  # timed from 3.0 (step 2 begins) to 7.0
        clock.begin(step)
        time.now = ends_at[step]
        clock.step(step, *steps[step])
    # Steps 2 and 3 only: 8 + 4 samples, 100 + 40 tokens, 0.5 + 0.5 s waiting, in 4 s.
    assert clock.interval(3) == {
        THROUGHPUT_SAMPLES: 12 / 4,
        THROUGHPUT_TOKENS: 140 / 4,
        DATA_WAIT_SHARE: 1.0 / 4,
    }
    assert (clock.timed_samples, clock.timed_units, clock.data_wait_s) == (12, 140, 1.0)
    assert clock.interval_rates == [3.0]

    time.now = 7.5  # on_log's half second is training time: on the clock
    clock.pause()  # a validation of 10 s, off the clock
    time.now = 17.5
    # 2 timed steps in 4.5 s, and the 2 untimed ones at their mean: 4.5 + 2 x 4.5 / 2.
    assert clock.train_seconds(4) == 9.0
    clock.resume(3)

    clock.begin(4)
    time.now = 19.5
    clock.step(4, *steps[4])
    # 4.5 + (17.5 -> 19.5): 6.5 timed seconds in all; since the last reading at 4.0 s this
    # interval trained 8 samples in 2.5 s.
    assert clock.interval(4)[THROUGHPUT_SAMPLES] == 20 / 6.5
    assert clock.interval_rates == [3.0, 8 / 2.5]
    clock.pause()
    assert clock.train_seconds(5) == pytest.approx(6.5 + 2 * 6.5 / 3)  # 10.83
    # A step taking no time lowers the timed mean and the estimate with it (6.5 + 2 x 6.5 /
    # 4 = 9.75): the training seconds still never go back.
    clock.resume(4)
    clock.begin(5)
    clock.step(5, 8, 80, 0.0)
    clock.pause()
    assert clock.train_seconds(6) == pytest.approx(6.5 + 2 * 6.5 / 3)
    assert clock.seconds == 6.5 and clock.timed_steps(6) == 4
    assert clock.elapsed() == 19.5  # wall time, validation included


def test_an_interval_the_clock_saw_no_time_pass_in_records_no_rate() -> None:
    time = FakeTime()
    clock = ThroughputClock(CPU, first_timed_step=0, now=time)
    clock.begin(0)
    clock.step(0, 8, 8, 0.0)
    assert clock.interval(0) == {} and clock.interval_rates == []
    time.now = 2.0
    clock.step(1, 8, 8, 0.0)
    # Samples are the unit here: no second figure of them.
    assert clock.interval(1) == {THROUGHPUT_SAMPLES: 8.0, DATA_WAIT_SHARE: 0.0}
    assert clock.interval_rates == [16 / 2]


def test_the_stopwatch_synchronises_the_device_before_each_reading(monkeypatch) -> None:
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: events.append("sync"))

    def now() -> float:
        events.append("now")
        return float(len(events))

    watch = Stopwatch(torch.device("cuda"), now)
    watch.start()
    watch.stop()
    assert events == ["sync", "now", "sync", "now"]  # the queued kernels first, then the time
    assert watch.seconds == 2.0


def test_training_seconds_extrapolate_the_untimed_steps() -> None:
    # 10 steps, the first 2 untimed: 8 timed in 4 s, so 0.5 s a step, 5 s in all.
    assert estimate_train_seconds(4.0, 10, 2, untimed_wall=99.0) == 5.0
    assert estimate_train_seconds(0.0, 2, 2, untimed_wall=1.5) == 1.5


@pytest.mark.parametrize("first_timed_step", [0, 3])
def test_no_step_before_the_first_timed_one_is_counted(first_timed_step: int) -> None:
    clock = ThroughputClock(CPU, first_timed_step, now=FakeTime())
    for step in range(5):
        clock.begin(step)
        clock.step(step, 10, 20, 0.25)
    timed = 5 - first_timed_step
    assert (clock.timed_samples, clock.timed_units) == (10 * timed, 20 * timed)
    assert clock.data_wait_s == 0.25 * timed
    assert clock.timed_steps(5) == timed


def test_a_validation_before_the_first_timed_step_is_not_training_time() -> None:
    """Steps 0 and 1 are off the clock (1 s each); a 100 s validation after step 0 is not
    training: before the first timed step, training time is their wall time less it."""
    time = FakeTime()
    clock = ThroughputClock(CPU, first_timed_step=2, now=time)
    clock.begin(0)
    time.now = 1.0
    clock.step(0, samples=4, units=4, waited=0.0)
    clock.pause()  # validation after step 0
    time.now = 101.0
    assert clock.train_seconds(1) == 1.0
    clock.resume(1)
    clock.begin(1)
    time.now = 102.0
    clock.step(1, samples=4, units=4, waited=0.0)
    clock.pause()
    assert clock.train_seconds(2) == 2.0  # not 102
