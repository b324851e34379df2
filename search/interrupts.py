"""A stop a signal asked for, delivered even where Python swallows it.

The signal handler (search/__main__.py `stop_on_signals`) raises at once. Raised while a
weakref callback or a `__del__` runs (SQLAlchemy's, during a garbage collection), the
exception is printed as "Exception ignored" and the study goes on, as if no signal had come.
So the stop is also remembered, and raised again at the next safe point (each training step,
each trial's start, the study's end) until the study's handler has it.
"""

from __future__ import annotations

_pending: type[KeyboardInterrupt] | None = None


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
