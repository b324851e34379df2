"""Runs `python -m search` in this process with one fault armed, for the fault tests.

    python -m tests.faults.inject [--kill-at-append K | --kill-at-record OP:KEY]
        [--kill-in MODULE:ATTR] [--killed FILE] -- OVERRIDES...

- `--kill-at-append K`: the K-th append to the study's journal (by any thread: trials,
  heartbeats) writes half its bytes, reaches the disk, and the process SIGKILLs itself: a
  writer dead mid-record, as a node failure or the OOM killer leaves it.
- `--kill-at-record OP:KEY`: the same, at the first append of a record of that kind: its
  Optuna op code and the attribute, parameter or trial state it sets (`9:batchfit:owner`,
  `6:state=1` for COMPLETE; see `record_kind`).
- `--kill-in MODULE:ATTR` (`search.study.driver:_log_fit_report`, `tracking.runs:RunLog.params`):
  the first call of that function SIGKILLs the process instead of running.
- `--killed FILE`: the records whose append was killed are added to FILE (JSON lines).
The signal is real and nothing is cleaned up: what a test then finds on disk is what a
real kill leaves. New faults are added here as flags.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import signal
import sys
from pathlib import Path

from batchfit.search.storage.journal import SafeJournalFileBackend


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def record_kind(record: dict) -> str:
    """`OP:KEY`: what a journal record does (Optuna's op code) and to which attribute or
    parameter ('' for none)."""
    attrs = record.get("user_attr") or record.get("system_attr") or {}
    key = record.get("param_name") or next(iter(attrs), "")
    if "state" in record:  # a trial's new state: a resume's FAIL of a dead trial is not a COMPLETE
        key = f"state={record['state']}"
    return f"{record['op_code']}:{key}"


def arm_appends(kill_at: int | None, kind: str | None, killed: Path | None) -> None:
    write = SafeJournalFileBackend._write
    count = 0

    def counted(f, data: bytes) -> None:  # noqa: ANN001 - the backend's open journal
        nonlocal count
        count += 1
        if count == kill_at or (kind and record_kind(json.loads(data.split(b"\n")[0])) == kind):
            if killed is not None:
                with open(killed, "ab") as out:
                    out.write(data)
            f.write(data[: max(1, len(data) // 2)])
            f.flush()
            os.fsync(f.fileno())
            die()
        write(f, data)

    SafeJournalFileBackend._write = staticmethod(counted)


def arm_kill_in(target: str) -> None:
    module_name, _, path = target.partition(":")
    owner = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    setattr(owner, name, lambda *args, **kwargs: die())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill-at-append", type=int)
    parser.add_argument("--kill-in")
    parser.add_argument("--kill-at-record")
    parser.add_argument("--killed", type=Path)
    args, overrides = parser.parse_known_args()
    if overrides[:1] == ["--"]:
        overrides = overrides[1:]
    arm_appends(args.kill_at_append, args.kill_at_record, args.killed)
    if args.kill_in:
        arm_kill_in(args.kill_in)
    sys.argv = ["search", *overrides]
    runpy.run_module("search", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
