"""A stop a signal asked for, delivered even where Python swallows it, and never inside a
write.

The signal handler (search/__main__.py `stop_on_signals`) raises at once. Raised while a
weakref callback or a `__del__` runs (SQLAlchemy's, during a garbage collection), the
exception is printed as "Exception ignored" and the study goes on, as if no signal had come.
So the stop is also remembered, and raised again at the next safe point (each training step,
each trial's start, the study's end) until the study's handler has it.

Raised inside a write to a store, the stop cuts it in two: SQLite's transaction stays open
in the interrupted frames, which the stop's traceback keeps alive while the study closes
its records, and every one of those writes then meets "database is locked". A write runs
in `deferred()`: a signal during it is remembered, and raised when the write has ended.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_pending: type[KeyboardInterrupt] | None = None
_deferring = 0  # nested deferred() blocks of the main thread, where signal handlers run


def request(kind: type[KeyboardInterrupt]) -> None:
    """A signal asked to stop with `kind` (KeyboardInterrupt, or its SIGTERM subclass)."""
    global _pending
    _pending = kind


def delivered() -> None:
    """The stop reached code that handles it: raise it no more."""
    global _pending
    _pending = None


def check() -> None:
    """Raise the stop asked for, if one was and has not reached its handler."""
    if _pending is not None:
        raise _pending()


def deferring() -> bool:
    """Whether the main thread is inside a `deferred()` block: a signal handler, which runs
    there, then only requests the stop."""
    return _deferring > 0


@contextmanager
def deferred() -> Iterator[None]:
    """A block a stop must not cut in two (one write to a store). A stop requested during
    it is raised as it ends, unless the block raised; on other threads, where no signal
    handler runs, nothing changes."""
    global _deferring
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
    if not _deferring:
        check()
