"""What a process looks like from inside, as JSON on stdout, then an exit of the given kind:
compares a fork server's child with a fresh interpreter (tests/faults/test_forkserver.py).

    python -m tests.faults.probe {return | exit:N | kill | term | interrupt | pause} [ARGS...]

It imports what the fork server imports, so that both hold the same modules.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import random
import re
import signal
import sys
import threading
import warnings
from pathlib import Path

from tests.faults.forkserver import import_preloaded


def _stdio(stream) -> dict:  # noqa: ANN001 - sys.stdin and co
    return {
        "isatty": stream.isatty(),
        "seekable": stream.seekable(),
        "line_buffering": stream.line_buffering,
        "encoding": stream.encoding,
        "errors": stream.errors,
    }


def _fds() -> list[str]:
    """What each open fd is, without inode numbers: "pipe", "socket", a path."""
    folder = "/proc/self/fd"
    kinds = []
    for fd in os.listdir(folder):
        with contextlib.suppress(OSError):  # the listing's own fd, closed by now
            kinds.append(re.sub(r":\[\d+\]$", "", os.readlink(f"{folder}/{fd}")))
    return sorted(kinds)


def _signals() -> dict:
    status = Path("/proc/self/status").read_text().splitlines()
    # SigQ counts the signals queued to the whole user, not this process: other processes
    # of the machine move it (seen when a test of killed ranks ran beside).
    kernel = {
        k: v.strip()
        for k, v in (line.split(":", 1) for line in status)
        if k[:3] == "Sig" and k != "SigQ"
    }
    python = {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals() - {0}
              if isinstance(s, signal.Signals)}  # fmt: skip
    return {"kernel": kernel, "python": python, "blocked": sorted(signal.pthread_sigmask(0, []))}


def _torch() -> dict:
    import torch

    default = torch.get_num_threads()
    torch.set_num_interop_threads(1)  # raises once inter-op work has run in the process
    torch.set_num_threads(1)
    value = float((torch.ones(64, 64) @ torch.ones(64, 64)).sum())  # an intra-op pool works
    return {"num_threads": default, "matmul": value, "cuda": torch.cuda.is_initialized()}


def report() -> dict:
    import numpy
    from hydra.core.global_hydra import GlobalHydra

    umask = os.umask(0o22)
    os.umask(umask)
    return {
        "argv": sys.argv[1:],
        "argv0": Path(sys.argv[0]).name,
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "pgrp": os.getpgrp(),
        "sid": os.getsid(0),
        "umask": umask,
        "stdio": [_stdio(s) for s in (sys.stdin, sys.stdout, sys.stderr)],
        "fds": _fds(),
        "signals": _signals(),
        "python_threads": threading.active_count(),
        "modules": {
            name: name in sys.modules for name in ("batchfit.search.__main__", __spec__.name)
        },
        "loggers": {
            name: [
                (type(h).__name__, getattr(h, "stream", None) is sys.stderr)
                for h in logging.getLogger(name).handlers
            ]
            for name in ("mlflow", "optuna", "alembic", "search")
        },
        "warning_filters": [repr(f) for f in warnings.filters],
        "hydra": GlobalHydra.instance().is_initialized(),
        "torch": _torch(),
        "draws": {"random": random.random(), "numpy": float(numpy.random.random())},
    }


def main() -> None:
    import_preloaded()
    atexit.register(lambda: print("atexit ran", flush=True))
    print(json.dumps(report()), flush=True)
    how = sys.argv[1]
    if how.startswith("exit:"):
        sys.exit(int(how[5:]))
    if how in ("kill", "term"):
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGTERM)
        signal.pause()
    if how == "interrupt":
        raise KeyboardInterrupt
    if how == "pause":  # until a SIGINT, even where the tests were started with it ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pause()


if __name__ == "__main__":
    main()
