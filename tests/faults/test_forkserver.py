"""The fork server's children (tests/faults/forkserver.py) are the processes the fault tests
mean: what a fresh `python -m` is from inside, with its own random draws, and the exit
statuses of its exits and signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults import forkserver
from tests.faults.study import REPO
from tests.sweeps import clean_env

PROBE = "tests.faults.probe"


def _env() -> dict[str, str]:
    return clean_env(PYTHONPATH=str(REPO))


def _report(done: subprocess.CompletedProcess) -> dict:
    first, *rest = done.stdout.splitlines()
    assert rest == ["atexit ran"], done.stdout + done.stderr
    return json.loads(first)


@pytest.mark.slow
def test_a_child_is_what_a_fresh_python_dash_m_is(tmp_path: Path) -> None:
    fresh = subprocess.run(
        [sys.executable, "-m", PROBE, "exit:3", "an argument"], cwd=tmp_path, env=_env(),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    forked = [forkserver.run(PROBE, ["exit:3", "an argument"], tmp_path, _env(), 600)
              for _ in range(2)]  # fmt: skip
    assert fresh.returncode == forked[0].returncode == forked[1].returncode == 3
    assert fresh.stderr == forked[0].stderr == ""
    expected, *children = [_report(done) for done in (fresh, *forked)]
    assert expected["cwd"] == str(tmp_path) and expected["argv"] == ["exit:3", "an argument"]
    assert expected["pgrp"] == os.getpgrp()  # in the tests' process group, as Popen starts it
    draws = [child.pop("draws") for child in children]
    assert draws[0]["random"] != draws[1]["random"] and draws[0]["numpy"] != draws[1]["numpy"]
    del expected["draws"]
    for child in children:
        assert child == expected


@pytest.mark.parametrize(
    ("how", "returncode", "said"),
    [
        ("return", 0, ["atexit ran"]),
        ("exit:143", 143, ["atexit ran"]),
        ("interrupt", -signal.SIGINT, ["atexit ran"]),  # Python's exit by an uncaught Ctrl-C
        ("kill", -signal.SIGKILL, []),
        ("term", -signal.SIGTERM, []),
    ],
)
def test_a_child_exits_as_a_fresh_python_does(
    tmp_path: Path, how: str, returncode: int, said: list[str]
) -> None:
    done = forkserver.run(PROBE, [how], tmp_path, _env(), 600)
    assert done.returncode == returncode, done.stderr[-3000:]
    assert done.stdout.splitlines()[1:] == said
    assert ("KeyboardInterrupt" in done.stderr) == (how == "interrupt")


def test_a_running_child_is_signalled_and_waited_for_by_its_pid(tmp_path: Path) -> None:
    process = forkserver.start(PROBE, ["pause"], tmp_path, _env())
    assert process.stdout.readline().startswith("{")  # its report: it is running
    assert process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.2)
    os.kill(process.pid, signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGINT and "KeyboardInterrupt" in err
    assert out == "atexit ran\n"
