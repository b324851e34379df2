"""tracking/overhead.py: the seconds spent in storage and MLflow calls, per trial."""

from __future__ import annotations

import threading
import time

import optuna

from batchfit.tracking.overhead import CallClock, Lap, storage_methods


def test_clock_counts_this_threads_calls_once() -> None:
    clock = CallClock()
    nap = clock.wrap(lambda s: time.sleep(s))
    outer = clock.wrap(lambda: nap(0.05) or nap(0.05))
    lap = Lap(clock)
    outer()  # 0.1 s, counted once though the inner calls are timed too
    assert 0.1 <= clock.seconds < 0.2
    other = threading.Thread(target=nap, args=(0.2,))  # a heartbeat thread: not counted
    other.start()
    other.join()
    assert clock.seconds < 0.2
    assert 0.1 <= lap() < 0.2 and lap() == 0.0


class _Napper:
    """A method of known duration: `nap` sleeps 0.05 s and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def nap(self) -> None:
        self.calls += 1
        time.sleep(0.05)


def test_time_methods_adds_up_each_call_of_the_instance() -> None:
    clock = CallClock()
    timed, untimed = _Napper(), _Napper()
    clock.time_methods(timed, ["nap"])
    untimed.nap()  # the instance's method is timed, not the class's
    assert clock.seconds == 0.0
    for _ in range(3):
        timed.nap()
    assert (timed.calls, untimed.calls) == (3, 1)
    # time.sleep sleeps at least its argument, so 3 x 0.05 s is a floor; the ceiling leaves
    # 0.25 s of scheduling delay (a loaded 2-core runner). A clock that kept only the last
    # call (0.05 s), or lost the sign, falls below the floor.
    assert 0.15 <= clock.seconds < 0.4
    lap = Lap(clock)
    timed.nap()
    assert 0.05 <= lap() < 0.3 and 0.2 <= clock.seconds < 0.5


def test_time_methods_times_a_real_storage() -> None:
    storage = optuna.storages.InMemoryStorage()
    clock = CallClock()
    names = storage_methods(storage)
    assert {"create_new_trial", "get_all_trials", "set_trial_state_values"} <= set(names)
    clock.time_methods(storage, names)
    started = time.perf_counter()
    study = optuna.create_study(storage=storage)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    wall = time.perf_counter() - started
    assert 0 < clock.seconds <= wall  # the storage calls are part of the study's time
    assert len(study.trials) == 3  # the timed methods still do their job
    before, started = clock.seconds, time.perf_counter()
    study.get_trials(deepcopy=False)  # a read through the storage
    wall = time.perf_counter() - started
    assert 0 < clock.seconds - before <= wall
