"""A rank's life tied to the process that launched it: when the launcher dies (a study's
worker SIGKILLed, say), each rank gets SIGKILL from the kernel within milliseconds, whatever
it is doing, importing torch at start-up included.

The kernel's mechanism is Linux's PR_SET_PDEATHSIG: a process asks for a signal when its
parent dies. The request must come from the child itself, before anything slow: a spawned
rank spends its first seconds (tens under load) importing torch, where no code of ours runs.
multiprocessing's spawn child runs, in order: the interpreter's start-up, the parent's
preparation data (sys.path, cwd, the main module: none to import for `python -m train`
or `python -m search`), then it unpickles its Process object, whose per-process config dict
comes before the target (torch's and the launcher's functions, which import torch). So the
launching thread puts a `_Lifeline` in that dict (`tied`), every Process it starts copies it,
and unpickling it calls `die_with_parent` in the child before the first torch import.

The alternatives, and why not: a watchdog thread or a pipe the rank watches starts only
after the imports (as a check of the parent at the rank's start did, which left ranks alive
10-60 s); a launcher executable (multiprocessing.set_executable) is process-wide, also
starts the resource tracker and the forkserver, and needs an executable file on disk.

multiprocessing's resource tracker needs nothing of its own: it exits when the write end of
its pipe closes, which the worker and every rank hold, so it ends with the last of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.context
import os
import signal
import sys
import threading
from collections.abc import Iterator

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(launcher: int) -> None:
    """SIGKILL for this process when its parent dies (Linux), and an exit now if its parent
    is no longer `launcher`: a parent that died before the request is not signalled for.
    Elsewhere, only the check."""
    if sys.platform.startswith("linux"):
        # No stdlib call for prctl; libc's is in the process's own symbols (CDLL(None)).
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != launcher:  # reparented: the launcher is gone
        os._exit(1)


class _Lifeline:
    """`die_with_parent(launcher)` when unpickled in a child that `thread` spawned; nothing
    (None) in any other child. The death signal follows the parent *thread* that created
    the child, so only children of the thread that lives as long as they should are tied;
    and only spawned ones, whose parent is the launcher (a forkserver child's is not)."""

    def __init__(self, thread: threading.Thread, launcher: int) -> None:
        self.thread = thread
        self.launcher = launcher

    def __reduce__(self) -> tuple:
        # Pickled while a Process starts, in the thread that starts it.
        popen = multiprocessing.context.get_spawning_popen()
        spawned = getattr(popen, "method", None) == "spawn"
        if spawned and threading.current_thread() is self.thread:
            return die_with_parent, (self.launcher,)
        return type(None), ()


@contextlib.contextmanager
def tied() -> Iterator[None]:
    """Every process the calling thread spawns meanwhile (multiprocessing's spawn) dies with
    this process; the thread must outlive them (see `_Lifeline`)."""
    # Private to the stdlib's multiprocessing (the same from 3.4 to 3.13): the dict each new
    # Process copies. tests/faults/test_rank_death.py fails if that ever changes.
    config = multiprocessing.current_process()._config
    key = f"batchfit.lifeline.{threading.get_ident()}"
    config[key] = _Lifeline(threading.current_thread(), os.getpid())
    try:
        yield
    finally:
        config.pop(key, None)
