"""A stop a signal asked for survives being swallowed (search/interrupts.py): Python prints
and drops an exception raised in a weakref callback, where SIGTERM once landed mid-study
and the study went on to the end."""

from __future__ import annotations

import gc
import weakref

import pytest

from search import interrupts


class _Garbage:
    pass


def test_a_stop_raised_in_a_weakref_callback_is_raised_again_at_the_next_check() -> None:
    def callback(_ref: weakref.ref) -> None:
        interrupts.request(KeyboardInterrupt)
        raise KeyboardInterrupt  # what the signal handler does; Python ignores it here

    obj = _Garbage()
    ref = weakref.ref(obj, callback)  # noqa: F841 - kept alive until obj dies
    try:
        del obj
        gc.collect()  # the callback ran, its KeyboardInterrupt swallowed
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()
        interrupts.delivered()
        interrupts.check()  # delivered: no second stop
    finally:
        interrupts.delivered()
