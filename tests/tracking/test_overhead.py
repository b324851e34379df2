"""search/overhead.py: the seconds spent in storage and MLflow calls, per trial."""

from __future__ import annotations

import threading
import time

import optuna

from tracking.overhead import CallClock, Lap, storage_methods


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


def test_time_methods_times_a_real_storage() -> None:
    storage = optuna.storages.InMemoryStorage()
    clock = CallClock()
    names = storage_methods(storage)
    assert {"create_new_trial", "get_all_trials", "set_trial_state_values"} <= set(names)
    clock.time_methods(storage, names)
    study = optuna.create_study(storage=storage)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    assert clock.seconds > 0
    before = clock.seconds
    study.trials  # noqa: B018 - a read through the storage
    assert clock.seconds > before
